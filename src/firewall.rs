//! The host-firewall check the agent runs at start and every resync period: reads the other
//! tables' forward chains over netlink and iptables-legacy's FORWARD through its socket options,
//! puts nodelb's ACCEPT into iptables' FORWARD chains (or takes it out) as
//! `--iptables-forward-accept` says, reads nodelb's two node-level forward counters, and hands
//! what it found to the pure [`hostfw`] judgement. Every failure is a problem in the report,
//! never a failed sync: the check only reports, and the rules of `table inet nodelb` do not
//! depend on it.

use std::collections::BTreeMap;

use crate::hostfw::{
    self, AcceptChange, Evidence, FamilyDiagnosis, Finding, ForwardCounts, HostChain, Source, TableFamily,
};
use crate::ir::Family;
use crate::nft::foreign::AcceptWrite;
use crate::nft::{NftClient, NftError};
use crate::plan;
use crate::xtables::{Layout, Xtables, XtablesError};

#[derive(Debug, thiserror::Error)]
pub enum FirewallError {
    #[error("nftables: {0}")]
    Nft(#[from] NftError),
    #[error(transparent)]
    Xtables(#[from] XtablesError),
}

/// One check's result.
#[derive(Debug, Clone, Default)]
pub struct Report {
    pub findings: Vec<Finding>,
    pub diagnosis: BTreeMap<Family, FamilyDiagnosis>,
    pub counters: BTreeMap<Family, ForwardCounts>,
    /// Where nodelb's ACCEPT is now.
    pub accept_rules: Vec<String>,
    /// What this check changed in iptables' chains, in words (for the log).
    pub changes: Vec<String>,
    pub problems: Vec<String>,
}

/// The check's state across resyncs: the packet evidence, and what the foreign chains looked
/// like (a change forgets the evidence: it was about other rules).
pub struct Checker {
    mark: Option<u32>,
    xtables: Xtables,
    evidence: Evidence,
    fingerprint: Option<u64>,
    /// The nftables forward chains as last read, and the ruleset generation they were read at:
    /// read again only when another transaction happened since.
    nft_cache: Option<(u32, Vec<HostChain>)>,
}

fn where_is(source: Source, family: TableFamily, table: &str, chain: &str) -> String {
    match source {
        Source::Nftables => format!("table {} {table} chain {chain}", family.name()),
        Source::IptablesLegacy => {
            let tool = if family == TableFamily::Ip6 { "ip6tables-legacy" } else { "iptables-legacy" };
            format!("{tool} table {table} chain {chain}")
        }
    }
}

fn nfproto_of(family: TableFamily) -> u8 {
    if family == TableFamily::Ip6 { Family::Ipv6.nfproto() } else { Family::Ipv4.nfproto() }
}

/// A digest of the chains' rules (what the evidence is about).
fn fingerprint(chains: &[HostChain]) -> u64 {
    let mut text = String::new();
    for c in chains {
        text.push_str(&format!("{:?} {:?} {} {} {:?}\n", c.source, c.family, c.table, c.name, c.base));
        for r in &c.rules {
            text.push_str(&format!("  {r}\n"));
        }
    }
    plan::fnv1a(text.as_bytes())
}

impl Checker {
    /// `mark`: `--iptables-forward-accept`'s bit, or `None` (then nodelb's ACCEPTs are removed).
    pub fn new(mark: Option<u32>, xtables: Xtables) -> Checker {
        Checker { mark, xtables, evidence: Evidence::default(), fingerprint: None, nft_cache: None }
    }

    /// One check, at `now` (Unix seconds).
    pub fn check(&mut self, nft: &mut NftClient, now: u64) -> Report {
        let mut report = Report::default();
        let mut chains = match self.nft_chains(nft, &mut report) {
            Ok(c) => c,
            Err(e) => {
                report.problems.push(format!("reading the nftables forward chains: {e}"));
                Vec::new()
            }
        };
        for layout in [Layout::V4, Layout::V6] {
            match self.legacy_chains(layout, &mut report) {
                Ok(c) => chains.extend(c),
                Err(e) => report.problems.push(e.to_string()),
            }
        }
        let fp = fingerprint(&chains);
        if self.fingerprint.replace(fp).is_some_and(|old| old != fp) {
            self.evidence.forget();
        }
        for f in Family::ALL {
            match read_counts(nft, f) {
                Ok(Some(c)) => {
                    self.evidence.observe(f, c, now);
                    report.counters.insert(f, c);
                }
                Ok(None) => {}
                Err(e) => report.problems.push(format!("reading nodelb's {f} forward counters: {e}")),
            }
        }
        for c in &chains {
            let ours = c.rules.iter().any(|r| hostfw::is_ours(r.comment.as_deref()));
            if ours {
                report.accept_rules.push(where_is(c.source, c.family, &c.table, &c.name));
            }
        }
        report.findings = hostfw::analyse(&chains, &Family::ALL, self.mark);
        report.diagnosis =
            hostfw::diagnose(&report.findings, &self.evidence, &Family::ALL, self.mark.is_some());
        report
    }

    pub fn evidence(&self) -> &Evidence {
        &self.evidence
    }

    /// The nftables forward chains, after bringing nodelb's ACCEPT in iptables-nft's FORWARD
    /// chains to what the flag says (each change on a fresh read, decided on its generation).
    fn nft_chains(&mut self, nft: &mut NftClient, report: &mut Report) -> Result<Vec<HostChain>, NftError> {
        // At most one change per chain (ip, ip6) and one retry after a concurrent change.
        for _ in 0..4 {
            let now = nft.generation()?;
            let (generation, chains) = match self.nft_cache.take() {
                Some((generation, chains)) if generation == now => (generation, chains),
                _ => nft.read_forward_chains()?,
            };
            self.nft_cache = Some((generation, chains.clone()));
            let changes: Vec<AcceptChange> = hostfw::accept_changes(&chains, self.mark);
            let Some(change) = changes.into_iter().find(|c| c.source == Source::Nftables) else {
                return Ok(chains);
            };
            let Some(chain) = chains.iter().find(|c| {
                c.source == change.source
                    && c.family == change.family
                    && c.table == change.table
                    && c.name == change.chain
            }) else {
                return Ok(chains);
            };
            let stale: Vec<u64> = change.stale.iter().filter_map(|&i| chain.rules.get(i)?.handle).collect();
            let write = AcceptWrite {
                genid: generation,
                nfproto: nfproto_of(change.family),
                table: &change.table,
                chain: &change.chain,
                stale: &stale,
                insert: change.insert,
            };
            match nft.write_forward_accept(&write) {
                Ok(()) => report.changes.push(describe(&change)),
                // Someone changed the ruleset meanwhile: decide again on a fresh read.
                Err(e) if e.is_restart() => continue,
                Err(e) => {
                    report.problems.push(format!("{}: {e}", describe(&change)));
                    return Ok(chains);
                }
            }
        }
        Ok(nft.read_forward_chains()?.1)
    }

    /// iptables-legacy's FORWARD (and what it jumps to) of one family, nodelb's ACCEPT first
    /// brought to what the flag says.
    fn legacy_chains(&self, layout: Layout, report: &mut Report) -> Result<Vec<HostChain>, FirewallError> {
        let Some(table) = self.xtables.read(layout)? else { return Ok(Vec::new()) };
        let chains = table.host_chains().map_err(XtablesError::from)?;
        let Some(change) = hostfw::accept_changes(&chains, self.mark).into_iter().next() else {
            return Ok(chains);
        };
        match self.xtables.write_accept(layout, self.mark) {
            Ok(true) => report.changes.push(describe(&change)),
            Ok(false) => {}
            Err(e) => {
                report.problems.push(format!("{}: {e}", describe(&change)));
                return Ok(chains);
            }
        }
        match self.xtables.read(layout)? {
            Some(t) => Ok(t.host_chains().map_err(XtablesError::from)?),
            None => Ok(Vec::new()),
        }
    }
}

fn describe(c: &AcceptChange) -> String {
    let place = where_is(c.source, c.family, &c.table, &c.chain);
    match (c.insert, c.stale.len()) {
        (Some(bit), 0) => format!("inserted nodelb's ACCEPT (mark {bit:#x}) at the head of {place}"),
        (Some(bit), n) => {
            format!("replaced {n} of nodelb's rules in {place} by its ACCEPT (mark {bit:#x}) at the head")
        }
        (None, n) => format!("removed {n} of nodelb's rules from {place}"),
    }
}

/// nodelb's node-level forward counters of a family; `None` while our table has none.
fn read_counts(nft: &mut NftClient, f: Family) -> Result<Option<ForwardCounts>, NftError> {
    let entered = nft.read_counter(&plan::forward_entered_counter(f))?;
    let passed = nft.read_counter(&plan::forward_passed_counter(f))?;
    Ok(match (entered, passed) {
        (Some(e), Some(p)) => Some(ForwardCounts { entered: e.packets, passed: p.packets }),
        _ => None,
    })
}

/// `nodelb cleanup`'s part: every rule nodelb put into iptables' FORWARD chains (iptables-nft
/// and iptables-legacy, IPv4 and IPv6), removed. Returns what was removed, and what could not
/// be.
pub fn remove_accepts(nft: &mut NftClient, xtables: &Xtables) -> (Vec<String>, Vec<String>) {
    let mut checker = Checker::new(None, xtables.clone());
    let mut report = Report::default();
    if let Err(e) = checker.nft_chains(nft, &mut report) {
        report.problems.push(format!("reading the nftables forward chains: {e}"));
    }
    for layout in [Layout::V4, Layout::V6] {
        if let Err(e) = checker.legacy_chains(layout, &mut report) {
            report.problems.push(e.to_string());
        }
    }
    (report.changes, report.problems)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn changes_are_described_for_the_log() {
        let c = |source, family, stale: Vec<usize>, insert| AcceptChange {
            source,
            family,
            table: "filter".into(),
            chain: "FORWARD".into(),
            stale,
            insert,
        };
        assert_eq!(
            describe(&c(Source::Nftables, TableFamily::Ip, vec![], Some(0x2000))),
            "inserted nodelb's ACCEPT (mark 0x2000) at the head of table ip filter chain FORWARD"
        );
        assert_eq!(
            describe(&c(Source::IptablesLegacy, TableFamily::Ip6, vec![3], None)),
            "removed 1 of nodelb's rules from ip6tables-legacy table filter chain FORWARD"
        );
        assert_eq!(nfproto_of(TableFamily::Ip), 2);
    }
}
