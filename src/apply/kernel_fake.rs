//! A [`Kernel`] in memory for the sync policy's unit tests, the way kube-proxy's nftables proxier
//! is tested against knftables' `Fake`: batches are checked and applied with the planner's own
//! model of the kernel ([`simulate`]: no dangling jump, no deleting what is still
//! referenced, all or nothing), and the table reads back the way [`crate::encode::nft::verify`] reads
//! the real one. On top of that model it keeps what the kernel keeps and the model does not: the
//! ruleset generation, the named counters' values and the dynamic sets' elements. Failures are
//! injected per call; a tamper edits the table behind the agent's back.
//!
//! What it does not model: the encoder and the netlink socket (the root tests prove those), and
//! the fields of a read-back table the agent never compares (set flags and key length, handles,
//! kernel expression names).

use std::collections::{BTreeMap, BTreeSet};

use crate::apply::conntrack::ConntrackError;
use crate::apply::kernel::{Kernel, NodeReads};
use crate::core::decisions::endpoint_policy::HostAddresses;
use crate::core::decisions::port_policy::Listener;
use crate::core::ruleset::ir::{Carried, Change, KeyType, Name, Ruleset, SetKind, Table};
use crate::core::ruleset::plan::UdpBackend;
use crate::encode::nft::encode::{fingerprint, key_type_id};
use crate::encode::nft::{
    ApplyStats, Counter, CounterValues, KernelChain, KernelCounter, KernelHook, KernelRule, KernelSet,
    KernelTable, NftError,
};
use crate::observe::hostaddrs::HostAddrError;
use crate::observe::listeners::ListenersError;
use nodelb_oracles::simulate::simulate;

/// One batch the fake took (or refused).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Batch {
    /// `apply_full_replace`, with the dynamic elements it carried.
    FullReplace {
        carried: Carried,
    },
    Diff(Vec<Change>),
}

/// Calls of one kind that fail: the next `n` of them.
#[derive(Debug, Clone, Copy, Default)]
pub struct Failing(pub usize);

impl Failing {
    fn take(&mut self) -> bool {
        let fails = self.0 > 0;
        self.0 = self.0.saturating_sub(1);
        fails
    }
}

#[derive(Debug, Default)]
pub struct FakeKernel {
    /// Table inet nodelb; `None` when it does not exist.
    pub table: Option<Ruleset>,
    pub generation: u32,
    /// Values of the named counters of the table.
    pub counters: CounterValues,
    /// Elements of the dynamic sets, with the milliseconds each has left.
    pub dynamic: Carried,
    /// Every batch the fake accepted, in order.
    pub batches: Vec<Batch>,
    /// The (node port, endpoint) pairs of every conntrack flush.
    pub flushed: Vec<BTreeSet<UdpBackend>>,
    /// How many times the table was read back.
    pub table_reads: usize,
    pub refuse_batches: Failing,
    pub fail_generation: Failing,
    pub fail_read_table: Failing,
    pub fail_read_counters: Failing,
    pub fail_read_dynamic: Failing,
}

fn refused(what: &str) -> NftError {
    NftError::Kernel {
        index: Some(0),
        change: what.to_string(),
        errno: libc::EINVAL,
        reason: "Invalid argument (injected)".into(),
        more: 0,
    }
}

fn read_failure(what: &str) -> NftError {
    NftError::Request {
        what: what.to_string(),
        errno: libc::EIO,
        reason: "Input/output error (injected)".into(),
    }
}

impl FakeKernel {
    /// A kernel that already holds `table` (rules an earlier agent left).
    pub fn holding(table: Ruleset) -> FakeKernel {
        let counters = table.counters.keys().map(|n| (n.to_string(), Counter::default())).collect();
        FakeKernel { table: Some(table), generation: 1, counters, ..Default::default() }
    }

    /// Someone else's transaction: the generation moves, our table does not.
    pub fn other_transaction(&mut self) {
        self.generation += 1;
    }

    /// Someone edits our table behind our back (one transaction).
    pub fn tamper(&mut self, edit: impl FnOnce(&mut Ruleset)) {
        if let Some(table) = self.table.as_mut() {
            edit(table);
        }
        self.generation += 1;
    }

    /// Traffic: `packets` more on the named counter `name`.
    pub fn count(&mut self, name: &str, packets: u64) {
        let c = self.counters.get_mut(name).unwrap_or_else(|| panic!("no counter {name} in the table"));
        c.packets += packets;
        c.bytes += packets * 100;
    }

    /// Takes `changes` as the kernel would: all or nothing, then what the model does not keep.
    fn commit(&mut self, changes: &[Change]) -> Result<ApplyStats, NftError> {
        let start = match (&self.table, changes.first()) {
            (Some(t), _) => t.clone(),
            (None, Some(Change::AddTable(_))) => Ruleset::default(),
            (None, _) => return Err(refused("no table inet nodelb")),
        };
        let next = simulate(&start, changes).map_err(|e| refused(&e))?;
        for change in changes {
            match change {
                Change::DeleteTable(t) => {
                    self.counters.retain(|n, _| Table::of_name(n) != *t);
                    self.dynamic.retain(|n, _| Table::of_name(n) != *t);
                }
                Change::DeleteSet(name) => {
                    self.dynamic.remove(name);
                }
                Change::DeleteCounter(name) => {
                    self.counters.remove(&**name);
                }
                Change::AddCounter(c) => {
                    self.counters.entry(c.name.to_string()).or_default();
                }
                Change::AddDynamicElements { set, elements } => {
                    self.dynamic.entry(set.clone()).or_default().extend(elements.iter().cloned());
                }
                _ => {}
            }
        }
        self.table = Some(next);
        self.generation += 1;
        Ok(ApplyStats { messages: changes.len() + 2, bytes: 0, generation: Some(self.generation) })
    }
}

/// The table as [`crate::encode::nft::NftClient::read_table`] returns what the kernel holds after
/// programming exactly `rs` (dynamic sets without elements: they are not read back).
fn read_back(rs: &Ruleset, counters: &CounterValues) -> KernelTable {
    let chains = rs
        .chains
        .values()
        .map(|c| {
            let rules = c
                .rules
                .iter()
                .enumerate()
                .map(|(i, r)| KernelRule {
                    handle: i as u64 + 1,
                    comment: r.comment.as_deref().map(String::from),
                    fingerprint: Some(fingerprint(r)),
                    counter: None,
                    exprs: vec![],
                })
                .collect();
            let base = c.base.as_ref().map(|b| KernelHook {
                chain_type: b.chain_type.name().to_string(),
                hook: b.hook.number(),
                priority: b.priority,
                policy: Some(1),
            });
            let chain =
                KernelChain { name: c.name.to_string(), handle: 0, base, comment: c.comment.clone(), rules };
            (c.name.to_string(), chain)
        })
        .collect();
    let sets = rs
        .sets
        .values()
        .map(|s| {
            let elements = match s.kind {
                SetKind::Dynamic { .. } => BTreeMap::new(),
                _ => s.elements.clone(),
            };
            let set = KernelSet {
                name: s.name.to_string(),
                flags: 0,
                key: Some(s.key.clone()),
                key_type_id: key_type_id(&s.key),
                key_len: 0,
                kind: Some(s.kind),
                comment: s.comment.clone(),
                elements,
            };
            (s.name.to_string(), set)
        })
        .collect();
    let counters = rs
        .counters
        .values()
        .map(|c| {
            let counter = KernelCounter {
                name: c.name.to_string(),
                comment: c.comment.clone(),
                counter: counters.get(&*c.name).copied().unwrap_or_default(),
            };
            (c.name.to_string(), counter)
        })
        .collect();
    KernelTable { chains, sets, counters, ..Default::default() }
}

impl Kernel for FakeKernel {
    fn apply(&mut self, changes: &[Change]) -> Result<ApplyStats, NftError> {
        if self.refuse_batches.take() {
            return Err(refused("diff"));
        }
        let stats = self.commit(changes)?;
        self.batches.push(Batch::Diff(changes.to_vec()));
        Ok(stats)
    }

    fn apply_full_replace(&mut self, ruleset: &Ruleset, carried: &Carried) -> Result<ApplyStats, NftError> {
        if self.refuse_batches.take() {
            return Err(refused("full replace"));
        }
        let changes: Vec<Change> = ruleset.full_replace_carrying(carried).map(|c| c.to_change()).collect();
        let stats = self.commit(&changes)?;
        self.batches.push(Batch::FullReplace { carried: carried.clone() });
        Ok(stats)
    }

    fn generation(&mut self) -> Result<u32, NftError> {
        if self.fail_generation.take() {
            return Err(read_failure("get generation"));
        }
        Ok(self.generation)
    }

    fn read_table(&mut self, _expected: &Ruleset) -> Result<Option<KernelTable>, NftError> {
        if self.fail_read_table.take() {
            return Err(read_failure("list chains"));
        }
        self.table_reads += 1;
        Ok(self.table.as_ref().map(|t| read_back(t, &self.counters)))
    }

    fn read_counters(&mut self, names: &BTreeSet<Name>) -> Result<CounterValues, NftError> {
        if self.fail_read_counters.take() {
            return Err(read_failure("get counters"));
        }
        Ok(self
            .counters
            .iter()
            .filter(|(n, _)| names.contains(n.as_str()))
            .map(|(n, c)| (n.clone(), *c))
            .collect())
    }

    fn read_dynamic_elements(&mut self, sets: &[(&str, &[KeyType])]) -> Result<Carried, NftError> {
        if self.fail_read_dynamic.take() {
            return Err(read_failure("list elements"));
        }
        Ok(sets
            .iter()
            .filter_map(|(name, _)| self.dynamic.get(*name).map(|e| ((*name).into(), e.clone())))
            .filter(|(_, e)| !e.is_empty())
            .collect())
    }

    fn delete_table(&mut self) -> Result<bool, NftError> {
        let existed = self.table.take().is_some();
        if existed {
            self.counters.clear();
            self.dynamic.clear();
            self.generation += 1;
        }
        Ok(existed)
    }

    fn delete_stale_udp(&mut self, gone: &BTreeSet<UdpBackend>) -> Result<usize, ConntrackError> {
        self.flushed.push(gone.clone());
        Ok(0)
    }
}

/// A node with fixed addresses and listeners.
#[derive(Debug, Clone, Default)]
pub struct FakeNode {
    pub addresses: HostAddresses,
    pub listeners: Vec<Listener>,
}

impl NodeReads for FakeNode {
    fn addresses(&mut self) -> Result<HostAddresses, HostAddrError> {
        Ok(self.addresses.clone())
    }

    fn listeners(&mut self) -> Result<Vec<Listener>, ListenersError> {
        Ok(self.listeners.clone())
    }
}
