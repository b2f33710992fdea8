//! The host-firewall check the agent runs at start and every resync period: reads the other
//! tables' forward chains over netlink and iptables-legacy's FORWARD through its socket options,
//! puts nodelb's ACCEPT into iptables' FORWARD chains (or takes it out) as
//! `--iptables-forward-accept` says, reads nodelb's two node-level forward counters, and hands
//! what it found to the pure [`hostfw`] judgement. Every failure is a problem in the report,
//! never a failed sync: the check only reports, and the rules of `table inet nodelb` do not
//! depend on it.

use std::collections::BTreeMap;

use crate::apply::xtables::{Layout, Xtables, XtablesError};
use crate::core::domain::{Family, fnv1a};
use crate::core::ruleset::hostfw::{
    self, AcceptChange, Evidence, EvidenceState, FamilyDiagnosis, Finding, ForwardCounts, HostChain, Source,
    TableFamily,
};
use crate::core::ruleset::plan;
use crate::encode::nft::foreign::AcceptWrite;
use crate::encode::nft::{NftClient, NftError};
use crate::serve::metrics::LabelSets;
use crate::serve::status::{FirewallDrop, HostFirewallStatus};

/// One check's result.
#[derive(Debug, Clone, Default)]
pub struct Report {
    pub findings: Vec<Finding>,
    pub diagnosis: BTreeMap<Family, FamilyDiagnosis>,
    pub counters: BTreeMap<Family, ForwardCounts>,
    pub evidence: BTreeMap<Family, EvidenceState>,
    /// Where nodelb's ACCEPT is now: the family its chain sees, and the chain in words.
    pub accept_rules: Vec<(Family, String)>,
    /// What this check changed in iptables' chains, in words (for the log).
    pub changes: Vec<String>,
    pub problems: Vec<String>,
    /// `--iptables-forward-accept` is on (the fixes suggested depend on it).
    pub accept_flag: bool,
}

/// What the agent says about a family, in one word and its sentence: `blocked`, `evidence`,
/// `suspect` or `ok`.
pub fn state_words(d: &FamilyDiagnosis) -> (&'static str, String) {
    match (&d.blocked, &d.evidence) {
        (Some(b), _) => ("blocked", b.clone()),
        (None, Some(e)) => ("evidence", e.clone()),
        (None, None) if !d.suspect.is_empty() => ("suspect", d.suspect.join("; and ")),
        (None, None) => ("ok", String::new()),
    }
}

impl Report {
    /// `/status`'s `hostFirewall`, checked at `now`.
    pub fn status(&self, now: u64) -> HostFirewallStatus {
        HostFirewallStatus {
            checked_at: now,
            drops: self
                .findings
                .iter()
                .map(|d| FirewallDrop {
                    finding: d.clone(),
                    certain: d.certain(),
                    fix: d.fix(self.accept_flag),
                })
                .collect(),
            counters: self.counters.iter().map(|(f, c)| (f.name().to_string(), *c)).collect(),
            evidence: self.evidence.iter().map(|(f, e)| (f.name().to_string(), *e)).collect(),
            accept_rules: self.accept_rules.iter().map(|(_, place)| place.clone()).collect(),
            problems: self.problems.clone(),
        }
    }

    /// The label values of `nodelb_host_firewall_drops` (family, table, chain, certain) and of
    /// `nodelb_iptables_forward_accept` (family, table).
    pub fn metric_series(&self) -> (LabelSets, LabelSets) {
        let drops = self
            .findings
            .iter()
            .map(|d| {
                let table = match d.source {
                    Source::Nftables => format!("{} {}", d.table_family.name(), d.table),
                    Source::IptablesLegacy => format!("iptables-legacy {}", d.table),
                };
                vec![d.family.name().to_string(), table, d.chain.clone(), d.certain().to_string()]
            })
            .collect();
        let accept =
            self.accept_rules.iter().map(|(f, place)| vec![f.name().to_string(), place.clone()]).collect();
        (drops, accept)
    }
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
    fnv1a(text.as_bytes())
}

impl Checker {
    /// `mark`: `--iptables-forward-accept`'s bit, or `None` (then nodelb's ACCEPTs are removed).
    pub fn new(mark: Option<u32>, xtables: Xtables) -> Checker {
        Checker { mark, xtables, evidence: Evidence::default(), fingerprint: None, nft_cache: None }
    }

    /// One check, at `now` (Unix seconds).
    pub fn check(&mut self, nft: &mut NftClient, now: u64) -> Report {
        let mut report = Report { accept_flag: self.mark.is_some(), ..Report::default() };
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
            if c.rules.iter().any(|r| hostfw::is_ours(r.comment.as_deref())) {
                let family = if c.family == TableFamily::Ip6 { Family::Ipv6 } else { Family::Ipv4 };
                report.accept_rules.push((family, where_is(c.source, c.family, &c.table, &c.name)));
            }
        }
        report.evidence = Family::ALL.iter().filter_map(|f| Some((*f, self.evidence.state(*f)?))).collect();
        report.findings = hostfw::analyse(&chains, &Family::ALL, self.mark);
        report.diagnosis =
            hostfw::diagnose(&report.findings, &self.evidence, &Family::ALL, self.mark.is_some());
        report
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
    fn legacy_chains(&self, layout: Layout, report: &mut Report) -> Result<Vec<HostChain>, XtablesError> {
        let Some(table) = self.xtables.read(layout)? else { return Ok(Vec::new()) };
        let chains = table.host_chains()?;
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
            Some(t) => Ok(t.host_chains()?),
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

    /// What the agent exports and logs from a report.
    #[test]
    fn report_as_status_metrics_and_words() {
        let finding = Finding {
            family: Family::Ipv4,
            source: Source::IptablesLegacy,
            table_family: TableFamily::Ip,
            table: "filter".into(),
            chain: "FORWARD".into(),
            priority: 0,
            drop: "policy drop".into(),
            partial: vec![],
            uncertain: false,
        };
        let report = Report {
            findings: vec![finding],
            counters: BTreeMap::from([(Family::Ipv4, ForwardCounts { entered: 3, passed: 0 })]),
            evidence: BTreeMap::from([(Family::Ipv4, EvidenceState::Dropping { since: 5, connections: 3 })]),
            accept_rules: vec![(Family::Ipv6, "table ip6 filter chain FORWARD".into())],
            accept_flag: true,
            ..Report::default()
        };
        let st = report.status(9);
        assert_eq!((st.checked_at, st.drops.len(), st.drops[0].certain), (9, 1, true));
        assert!(st.drops[0].fix.contains("not ahead of this drop"), "with the flag: {}", st.drops[0].fix);
        assert_eq!(st.counters["ipv4"], ForwardCounts { entered: 3, passed: 0 });
        assert_eq!(st.accept_rules, ["table ip6 filter chain FORWARD"]);
        let (drops, accept) = report.metric_series();
        assert_eq!(
            drops.into_iter().collect::<Vec<_>>(),
            [vec!["ipv4", "iptables-legacy filter", "FORWARD", "true"]]
        );
        assert_eq!(accept.into_iter().collect::<Vec<_>>(), [vec!["ipv6", "table ip6 filter chain FORWARD"]]);
        let d = |blocked: Option<&str>, evidence: Option<&str>, suspect: &[&str]| FamilyDiagnosis {
            blocked: blocked.map(String::from),
            evidence: evidence.map(String::from),
            suspect: suspect.iter().map(|s| s.to_string()).collect(),
        };
        assert_eq!(state_words(&d(Some("b"), Some("e"), &["s"])), ("blocked", "b".into()));
        assert_eq!(state_words(&d(None, Some("e"), &["s"])), ("evidence", "e".into()));
        assert_eq!(state_words(&d(None, None, &["s", "t"])), ("suspect", "s; and t".into()));
        assert_eq!(state_words(&d(None, None, &[])), ("ok", String::new()));
    }

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
