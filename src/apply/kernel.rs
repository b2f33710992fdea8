//! The seams between the sync loop and the node it runs on, as traits, so that the sync policy
//! (first sync replaces, diffs after, repair, retry, counters, affinities) runs in unit tests
//! against a fake instead of a kernel.
//!
//! - [`Kernel`]: nodelb's own table and what its rules leave in conntrack: apply a full replace
//!   (carrying the dynamic sets' elements) or a diff, read the ruleset generation, read the
//!   table, its named counters and its dynamic elements back, delete it; delete the stale UDP
//!   conntrack entries of endpoints that went. [`Netlink`] is the real one.
//! - [`NodeReads`]: what the sync reads of the node besides nftables: its addresses and its
//!   listening sockets. [`LocalNode`] reads this network namespace.
//!
//! The host-firewall check is not behind either: it reads and writes other tables (iptables'
//! FORWARD), never nodelb's, and its outcome never fails or shapes a sync, so it keeps its own
//! [`NftClient`] (a second netlink socket costs nothing).

use std::collections::BTreeSet;

use crate::apply::conntrack::{ConntrackClient, ConntrackError};
use crate::core::decisions::endpoint_policy::HostAddresses;
use crate::core::decisions::port_policy::Listener;
use crate::core::ruleset::ir::{Carried, Change, KeyType, Name, Ruleset};
use crate::core::ruleset::kernel_support::{self, Feature};
use crate::core::ruleset::plan::UdpBackend;
use crate::encode::nft::{ApplyStats, CounterValues, KernelTable, NftClient, NftError};
use crate::observe::hostaddrs::HostAddrError;
use crate::observe::listeners::ListenersError;

/// What the sync loop needs of the kernel. Every batch is one transaction: on error nothing of
/// it was applied.
pub trait Kernel {
    /// Applies `changes` as one batch (a diff).
    fn apply(&mut self, changes: &[Change]) -> Result<ApplyStats, NftError>;
    /// Replaces table inet nodelb with exactly `ruleset` in one batch, putting back the `carried`
    /// elements of its dynamic sets.
    fn apply_full_replace(&mut self, ruleset: &Ruleset, carried: &Carried) -> Result<ApplyStats, NftError>;
    /// The ruleset generation of the network namespace (moves with every transaction, anyone's).
    fn generation(&mut self) -> Result<u32, NftError>;
    /// Table inet nodelb as the kernel holds it; `None` when it does not exist. `expected` (the
    /// ruleset last programmed) names the chains and counters to read by name.
    fn read_table(&mut self, expected: &Ruleset) -> Result<Option<KernelTable>, NftError>;
    /// The named counters `names` of table inet nodelb (and its shards) that exist.
    fn read_counters(&mut self, names: &BTreeSet<Name>) -> Result<CounterValues, NftError>;
    /// The elements of the dynamic sets `sets` (name, key type), with the time each has left.
    fn read_dynamic_elements(&mut self, sets: &[(&str, &[KeyType])]) -> Result<Carried, NftError>;
    /// Deletes table inet nodelb; whether it existed.
    fn delete_table(&mut self) -> Result<bool, NftError>;
    /// Deletes the DNATed UDP conntrack entries of the (node port, endpoint) pairs in `gone`;
    /// how many.
    fn delete_stale_udp(&mut self, gone: &BTreeSet<UdpBackend>) -> Result<usize, ConntrackError>;
}

/// The kernel of the network namespace the agent runs in, over netlink.
pub struct Netlink {
    nft: NftClient,
}

impl Netlink {
    pub fn new() -> Result<Netlink, NftError> {
        Ok(Netlink { nft: NftClient::new()? })
    }
}

impl Kernel for Netlink {
    fn apply(&mut self, changes: &[Change]) -> Result<ApplyStats, NftError> {
        self.nft.apply(changes)
    }

    fn apply_full_replace(&mut self, ruleset: &Ruleset, carried: &Carried) -> Result<ApplyStats, NftError> {
        // The batch of a whole table is the agent's largest allocation: build it on what is
        // live, not on what the sync that planned it freed.
        crate::memory::release_freed();
        self.nft.apply_full_replace(ruleset, carried)
    }

    fn generation(&mut self) -> Result<u32, NftError> {
        self.nft.generation()
    }

    fn read_table(&mut self, expected: &Ruleset) -> Result<Option<KernelTable>, NftError> {
        self.nft.read_table_expecting(Some(expected))
    }

    fn read_counters(&mut self, names: &BTreeSet<Name>) -> Result<CounterValues, NftError> {
        self.nft.read_counters(names)
    }

    fn read_dynamic_elements(&mut self, sets: &[(&str, &[KeyType])]) -> Result<Carried, NftError> {
        self.nft.read_dynamic_elements(sets)
    }

    fn delete_table(&mut self) -> Result<bool, NftError> {
        self.nft.delete_table()
    }

    /// A conntrack socket per flush: endpoints of UDP Services going away is rare.
    fn delete_stale_udp(&mut self, gone: &BTreeSet<UdpBackend>) -> Result<usize, ConntrackError> {
        ConntrackClient::new().and_then(|mut ct| ct.delete_stale_udp(gone))
    }
}

/// What a sync reads of the node besides nftables.
pub trait NodeReads {
    /// This node's interface addresses and broadcast addresses.
    fn addresses(&mut self) -> Result<HostAddresses, HostAddrError>;
    /// Every TCP listener and unconnected UDP socket.
    fn listeners(&mut self) -> Result<Vec<Listener>, ListenersError>;
}

/// The network namespace the agent runs in.
#[derive(Debug, Clone, Copy, Default)]
pub struct LocalNode;

impl NodeReads for LocalNode {
    fn addresses(&mut self) -> Result<HostAddresses, HostAddrError> {
        crate::observe::hostaddrs::read()
    }

    fn listeners(&mut self) -> Result<Vec<Listener>, ListenersError> {
        crate::observe::listeners::read()
    }
}

/// This kernel lacks something nodelb needs ([`crate::core::ruleset::kernel_support`]).
#[derive(Debug, thiserror::Error)]
pub enum SupportError {
    #[error("{0}")]
    TooOld(String),
    #[error("{0}")]
    Missing(String),
    #[error("probing the kernel's nf_tables: {0}")]
    Probe(#[source] NftError),
}

/// Where the running kernel's release is.
const OSRELEASE: &str = "/proc/sys/kernel/osrelease";

/// The kernel's named counters of our table, read now on a socket of their own (`None`: the read
/// failed). What `/metrics` reads at scrape time ([`crate::serve::metrics::ReadCounters`]), apart
/// from the sync loop's [`Kernel`], which a scrape must not wait for.
pub fn read_counters_now(names: &[&Name]) -> Option<CounterValues> {
    NftClient::new().and_then(|mut c| c.read_counters(names.iter().copied())).ok()
}

/// Checks at start that the kernel has what nodelb needs: its release (for what a kernel ignores
/// silently), then the feature probe, validated by the kernel and never committed. An unreadable
/// release leaves the probe alone to decide.
pub fn check_support(nft: &mut NftClient) -> Result<(), SupportError> {
    if let Ok(release) = std::fs::read_to_string(OSRELEASE)
        && let Some(why) = kernel_support::release_refusal(release.trim())
    {
        return Err(SupportError::TooOld(why));
    }
    check_probe(nft, &kernel_support::probe())
}

/// Sends `probe` as a batch the kernel validates and aborts; a refusal names the feature of the
/// change it failed at.
pub fn check_probe(nft: &mut NftClient, probe: &[(Change, Feature)]) -> Result<(), SupportError> {
    let changes: Vec<Change> = probe.iter().map(|(c, _)| c.clone()).collect();
    match nft.check(&changes) {
        Ok(()) => Ok(()),
        Err(NftError::Kernel { index, change, reason, .. }) => Err(SupportError::Missing(
            kernel_support::probe_refusal(probe, index, &format!("{change}: {reason}")),
        )),
        Err(e) => Err(SupportError::Probe(e)),
    }
}
