//! Host firewalls on the forward path, judged without I/O: do another table's forward chains (or
//! iptables-legacy's FORWARD) drop nodelb's forwarded connections, and what do nodelb's own
//! node-level counters say about it.
//!
//! * [`analyse`] walks every foreign base chain on the forward hook, following jumps and gotos,
//!   for "a new connection nodelb DNATed" (conntrack state NEW, status DNAT, nodelb's mark bit
//!   when `--iptables-forward-accept` sets it): does it reach a drop (the policy, or a rule whose
//!   conditions all hold for such a connection) before an accept that covers it? A rule whose
//!   conditions cannot be judged (interfaces, addresses, ports, sets) is "partial": an accept of
//!   that kind before the drop makes the finding uncertain.
//! * [`Evidence`] follows the two counters that bracket every other forward chain
//!   (`forward-entered-<fam>` first, `forward-passed-<fam>` last): connections that enter and
//!   never leave, while none leaves, were dropped in between, whatever did it.
//! * [`diagnose`] combines both into what the agent reports per family.
//!
//! The edges that read the chains: `nft::NftClient::read_forward_chains` (nftables tables, also
//! iptables-nft's) and `xtables` (iptables-legacy).

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;

use serde::{Deserialize, Serialize};

use crate::domain::Family;

/// `ct state` bits (`NF_CT_STATE_*`), also those of `-m state` / `-m conntrack --ctstate`.
pub mod ct_state {
    pub const INVALID: u32 = 1 << 0;
    pub const ESTABLISHED: u32 = 1 << 1;
    pub const RELATED: u32 = 1 << 2;
    pub const NEW: u32 = 1 << 3;
    pub const UNTRACKED: u32 = 1 << 6;
}

/// Every comment of a rule nodelb inserts into iptables' FORWARD chain starts with this; it is
/// how nodelb finds its own rules again (also after `iptables-save | iptables-restore`, which
/// keeps the comment).
pub const ACCEPT_COMMENT_PREFIX: &str = "nodelb-forward-accept";

/// The comment of nodelb's ACCEPT for mark `bit`.
pub fn accept_comment(bit: u32) -> String {
    format!("{ACCEPT_COMMENT_PREFIX}: forwarded connections of nodelb Services (mark {bit:#x})")
}

/// Whether a rule with this comment is one nodelb inserted.
pub fn is_ours(comment: Option<&str>) -> bool {
    comment.is_some_and(|c| c.starts_with(ACCEPT_COMMENT_PREFIX))
}

/// `IPS_DST_NAT` and `IPS_DST_NAT_DONE` (nf_conntrack_common.h): set on a connection nodelb
/// DNATed, by the time it reaches the forward hook.
const IPS_DNAT_BITS: u32 = (1 << 5) | (1 << 7);

/// Where a chain lives.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Source {
    /// An nftables table (iptables-nft's `ip filter` among them).
    Nftables,
    /// The x_tables filter table of iptables-legacy.
    IptablesLegacy,
}

/// The family of the table a chain belongs to: which of nodelb's families it sees.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum TableFamily {
    Ip,
    Ip6,
    Inet,
}

impl TableFamily {
    pub fn name(self) -> &'static str {
        match self {
            TableFamily::Ip => "ip",
            TableFamily::Ip6 => "ip6",
            TableFamily::Inet => "inet",
        }
    }

    pub fn sees(self, f: Family) -> bool {
        matches!(
            (self, f),
            (TableFamily::Inet, _) | (TableFamily::Ip, Family::Ipv4) | (TableFamily::Ip6, Family::Ipv6)
        )
    }

    /// The NFPROTO_* value of an `ip`/`ip6`/`inet` table.
    pub fn from_nfproto(p: u8) -> Option<TableFamily> {
        match p {
            1 => Some(TableFamily::Inet),
            2 => Some(TableFamily::Ip),
            10 => Some(TableFamily::Ip6),
            _ => None,
        }
    }
}

/// One test of a rule, as far as nodelb can judge it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Test {
    /// The connection's state is one of `states` ([`ct_state`] bits), or it is SNATed (`snat`) or
    /// DNATed (`dnat`) (`-m conntrack --ctstate NEW,DNAT`); `invert` negates the whole.
    CtState { states: u32, snat: bool, dnat: bool, invert: bool },
    /// `ct status & mask != 0` (`invert`: `== 0`).
    CtStatus { mask: u32, invert: bool },
    /// `meta mark & mask == value` (`invert`: `!=`).
    Mark { mask: u32, value: u32, invert: bool },
    /// `meta nfproto == proto` (`invert`: `!=`).
    NfProto { proto: u8, invert: bool },
    /// Anything else (interfaces, addresses, ports, sets, limits, …), described.
    Other(String),
}

/// What a rule does when its tests hold.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Action {
    Accept,
    Drop,
    Reject,
    Jump(String),
    Goto(String),
    Return,
    /// No verdict (counter, log, mark, …): evaluation continues.
    Continue,
    /// A verdict nodelb cannot follow (verdict map, queue, an unknown target), described.
    Unknown(String),
}

/// A rule as decoded from the kernel.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HostRule {
    pub tests: Vec<Test>,
    pub action: Action,
    pub comment: Option<String>,
    /// nftables rule handle (`None` for iptables-legacy entries).
    pub handle: Option<u64>,
}

/// A base chain on the forward hook: its priority and whether its policy drops.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HostBase {
    pub priority: i32,
    pub policy_drop: bool,
}

/// A chain of a foreign table: a base chain on the forward hook, or a chain one of them reaches.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HostChain {
    pub source: Source,
    pub family: TableFamily,
    pub table: String,
    pub name: String,
    pub base: Option<HostBase>,
    pub rules: Vec<HostRule>,
}

impl fmt::Display for Test {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let not = |invert: bool| if invert { "!= " } else { "" };
        match self {
            Test::CtState { states, snat, dnat, invert } => {
                let mut names: Vec<&str> = [
                    (ct_state::INVALID, "invalid"),
                    (ct_state::ESTABLISHED, "established"),
                    (ct_state::RELATED, "related"),
                    (ct_state::NEW, "new"),
                    (ct_state::UNTRACKED, "untracked"),
                ]
                .iter()
                .filter(|(bit, _)| states & bit != 0)
                .map(|(_, n)| *n)
                .collect();
                if *snat {
                    names.push("snat");
                }
                if *dnat {
                    names.push("dnat");
                }
                write!(f, "ct state {}{}", not(*invert), names.join(","))
            }
            Test::CtStatus { mask, invert } if *mask == 1 << 5 => {
                write!(f, "ct status {}dnat", not(*invert))
            }
            Test::CtStatus { mask, invert } => {
                write!(f, "ct status & {mask:#x} {}0", if *invert { "==" } else { "!=" })
            }
            Test::Mark { mask, value, invert } => {
                write!(f, "meta mark & {mask:#x} {} {value:#x}", if *invert { "!=" } else { "==" })
            }
            Test::NfProto { proto, invert } => {
                let name = match proto {
                    2 => "ipv4".to_string(),
                    10 => "ipv6".to_string(),
                    p => p.to_string(),
                };
                write!(f, "meta nfproto {}{name}", not(*invert))
            }
            Test::Other(s) => f.write_str(s),
        }
    }
}

impl fmt::Display for Action {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Action::Accept => f.write_str("accept"),
            Action::Drop => f.write_str("drop"),
            Action::Reject => f.write_str("reject"),
            Action::Jump(c) => write!(f, "jump {c}"),
            Action::Goto(c) => write!(f, "goto {c}"),
            Action::Return => f.write_str("return"),
            Action::Continue => f.write_str("continue"),
            Action::Unknown(s) => f.write_str(s),
        }
    }
}

impl fmt::Display for HostRule {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for t in &self.tests {
            write!(f, "{t} ")?;
        }
        write!(f, "{}", self.action)?;
        if let Some(c) = &self.comment {
            write!(f, " comment {c:?}")?;
        }
        Ok(())
    }
}

/// What nodelb knows about its own new connections at the forward hook.
#[derive(Debug, Clone, Copy)]
struct Flow {
    family: Family,
    /// The mark bit `--iptables-forward-accept` sets on them, if on.
    mark: Option<u32>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Holds {
    Yes,
    No,
    Unknown,
}

fn judge(t: &Test, flow: Flow) -> Holds {
    let holds = |b: bool| if b { Holds::Yes } else { Holds::No };
    match *t {
        // nodelb's connection is NEW and DNATed; not SNATed yet (masquerade runs in postrouting).
        Test::CtState { states, dnat, invert, .. } => holds((states & ct_state::NEW != 0 || dnat) != invert),
        Test::CtStatus { mask, invert } if mask & IPS_DNAT_BITS != 0 => holds(!invert),
        Test::CtStatus { .. } => Holds::Unknown,
        Test::Mark { mask, value, invert } => match flow.mark {
            // Only our bit is known; any other bit of the mask makes the test unknowable.
            Some(bit) if mask == bit => holds((value == bit) != invert),
            _ => Holds::Unknown,
        },
        Test::NfProto { proto, invert } => holds((proto == flow.family.nfproto()) != invert),
        Test::Other(_) => Holds::Unknown,
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Cond {
    /// Holds for every new nodelb connection.
    Always,
    /// Holds for none.
    Never,
    /// Holds for some, or nodelb cannot tell.
    Partial,
}

fn condition(rule: &HostRule, flow: Flow) -> Cond {
    let mut cond = Cond::Always;
    for t in &rule.tests {
        match judge(t, flow) {
            Holds::No => return Cond::Never,
            Holds::Unknown => cond = Cond::Partial,
            Holds::Yes => {}
        }
    }
    cond
}

/// Where a walk through a chain ends for nodelb's connections.
enum End {
    Accept,
    /// Dropped by this (the rule, in words).
    Drop(String),
    /// The end of the chain or a `return`: back to the caller (the policy, for a base chain).
    Fallthrough,
}

/// What a walk saw on the way.
#[derive(Default)]
struct Walk<'a> {
    /// Accepts that hold for only some connections (or nodelb cannot tell).
    partial: Vec<String>,
    /// Something could not be followed.
    uncertain: bool,
    /// Chains being walked (a jump back into one of them is a loop the kernel would refuse).
    stack: Vec<&'a str>,
    /// Rules looked at so far: a walk stops (uncertain) at [`MAX_RULES`].
    rules: usize,
}

/// Deepest chain nesting followed (the kernel allows 16 jumps).
const MAX_DEPTH: usize = 16;
/// Most rules looked at per base chain and family (chains reached through several jumps count
/// each time).
const MAX_RULES: usize = 100_000;

struct Tables<'a> {
    chains: BTreeMap<(Source, TableFamily, &'a str, &'a str), &'a HostChain>,
}

impl<'a> Tables<'a> {
    fn walk(&self, chain: &'a HostChain, flow: Flow, w: &mut Walk<'a>) -> End {
        w.stack.push(&chain.name);
        let end = self.walk_rules(chain, flow, w);
        w.stack.pop();
        end
    }

    fn walk_rules(&self, chain: &'a HostChain, flow: Flow, w: &mut Walk<'a>) -> End {
        for (i, rule) in chain.rules.iter().enumerate() {
            w.rules += 1;
            if w.rules > MAX_RULES {
                w.uncertain = true;
                return End::Fallthrough;
            }
            let cond = condition(rule, flow);
            if cond == Cond::Never {
                continue;
            }
            let always = cond == Cond::Always;
            let what = || format!("rule {} of chain {} ({rule})", i + 1, chain.name);
            match &rule.action {
                Action::Accept if always => return End::Accept,
                Action::Accept => w.partial.push(what()),
                Action::Drop | Action::Reject if always => return End::Drop(what()),
                // A drop of some connections: the evidence shows it when it hits them all.
                Action::Drop | Action::Reject => {}
                Action::Jump(target) | Action::Goto(target) => {
                    let Some(next) = self.chains.get(&(chain.source, chain.family, &chain.table, target))
                    else {
                        w.uncertain = true;
                        continue;
                    };
                    if w.stack.len() >= MAX_DEPTH || w.stack.contains(&target.as_str()) {
                        w.uncertain = true;
                        continue;
                    }
                    let end = self.walk(next, flow, w);
                    let goto = matches!(rule.action, Action::Goto(_));
                    match end {
                        End::Accept if always => return End::Accept,
                        End::Accept => w.partial.push(what()),
                        End::Drop(d) if always => return End::Drop(d),
                        End::Drop(_) => {}
                        // After a goto, the end of the target chain ends this one too.
                        End::Fallthrough if always && goto => return End::Fallthrough,
                        End::Fallthrough => {}
                    }
                }
                Action::Return if always => return End::Fallthrough,
                // Some connections leave the chain here: a drop further down may not hit them all.
                Action::Return => w.uncertain = true,
                Action::Continue => {}
                Action::Unknown(_) => w.uncertain = true,
            }
        }
        End::Fallthrough
    }
}

/// A foreign forward chain that drops nodelb's new connections of one family.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Finding {
    pub family: Family,
    pub source: Source,
    pub table_family: TableFamily,
    pub table: String,
    pub chain: String,
    pub priority: i32,
    /// What drops them: `policy drop`, or the rule.
    pub drop: String,
    /// Accepts before the drop that hold for only some connections (their conditions cannot be
    /// judged): some of nodelb's connections may pass there.
    pub partial: Vec<String>,
    /// Something on the way could not be followed (a verdict map, an unknown target, a
    /// conditional return, a missing or too deep chain).
    pub uncertain: bool,
}

impl Finding {
    /// Every new connection of nodelb's Services of this family is dropped.
    pub fn certain(&self) -> bool {
        self.partial.is_empty() && !self.uncertain
    }

    /// `table ip filter chain FORWARD` / `iptables-legacy table filter chain FORWARD`.
    pub fn location(&self) -> String {
        match self.source {
            Source::Nftables => {
                format!("table {} {} chain {}", self.table_family.name(), self.table, self.chain)
            }
            Source::IptablesLegacy => {
                let tool = if self.table_family == TableFamily::Ip6 {
                    "ip6tables-legacy"
                } else {
                    "iptables-legacy"
                };
                format!("{tool} table {} chain {}", self.table, self.chain)
            }
        }
    }

    /// Whether this is the FORWARD chain of iptables' filter table, where
    /// `--iptables-forward-accept` inserts nodelb's ACCEPT.
    pub fn iptables_filter_forward(&self) -> bool {
        self.table == "filter"
            && self.chain == "FORWARD"
            && (self.source == Source::IptablesLegacy || self.table_family != TableFamily::Inet)
    }

    /// One sentence: where, what, and (when uncertain) what may still let connections through.
    pub fn describe(&self) -> String {
        let mut s = format!(
            "{} (forward hook, priority {}) drops nodelb's new {} connections: {}",
            self.location(),
            self.priority,
            self.family,
            self.drop
        );
        if !self.partial.is_empty() {
            s.push_str(&format!(", unless one of these accepts them: {}", self.partial.join("; ")));
        }
        if self.uncertain {
            s.push_str(" (some rules on the way could not be followed)");
        }
        s
    }

    /// How to let nodelb's connections through, for an operator. `accept_flag`: nodelb runs with
    /// `--iptables-forward-accept`.
    pub fn fix(&self, accept_flag: bool) -> String {
        if self.iptables_filter_forward() {
            let tool = match (self.source, self.table_family) {
                (Source::IptablesLegacy, TableFamily::Ip6) => "ip6tables-legacy",
                (Source::IptablesLegacy, _) => "iptables-legacy",
                (_, TableFamily::Ip6) => "ip6tables-nft",
                _ => "iptables-nft",
            };
            if accept_flag {
                return format!(
                    "nodelb's ACCEPT (--iptables-forward-accept) is not ahead of this drop: a rule before it drops \
                     the connections; remove that rule or let DNATed connections through it \
                     (`{tool} -I FORWARD -m conntrack --ctstate DNAT -j ACCEPT`)"
                );
            }
            return format!(
                "run nodelb with --iptables-forward-accept (it inserts an ACCEPT for its own connections at the \
                 head of this chain and removes it when run without the flag or by `nodelb cleanup`), or accept \
                 DNATed connections yourself: `{tool} -I FORWARD -m conntrack --ctstate DNAT -j ACCEPT`"
            );
        }
        if self.source == Source::Nftables && self.table == "firewalld" {
            return "let firewalld forward to the Service endpoints (firewalld accepts DNATed connections unless \
                    StrictForwardPorts=yes; or put the pod network in a zone that forwards, e.g. \
                    `firewall-cmd --permanent --zone=trusted --add-source=<pod CIDR>`); nodelb never edits \
                    firewalld's table"
                .to_string();
        }
        format!(
            "accept nodelb's connections ahead of the drop, e.g. `nft insert rule {} {} {} ct status dnat accept` \
             (or a narrower accept for the Service endpoints); nodelb never edits another nftables table",
            self.table_family.name(),
            self.table,
            self.chain
        )
    }
}

/// Every foreign forward base chain that drops nodelb's new connections, per family in
/// `families`. `mark`: the bit `--iptables-forward-accept` puts on nodelb's connections.
pub fn analyse(chains: &[HostChain], families: &[Family], mark: Option<u32>) -> Vec<Finding> {
    let tables = Tables {
        chains: chains.iter().map(|c| ((c.source, c.family, c.table.as_str(), c.name.as_str()), c)).collect(),
    };
    let mut out = Vec::new();
    for chain in chains {
        let Some(base) = chain.base else { continue };
        for &family in families {
            if !chain.family.sees(family) {
                continue;
            }
            let mut w = Walk::default();
            let drop = match tables.walk(chain, Flow { family, mark }, &mut w) {
                End::Accept => continue,
                End::Drop(d) => d,
                End::Fallthrough if base.policy_drop => "policy drop".to_string(),
                End::Fallthrough => continue,
            };
            out.push(Finding {
                family,
                source: chain.source,
                table_family: chain.family,
                table: chain.table.clone(),
                chain: chain.name.clone(),
                priority: base.priority,
                drop,
                partial: w.partial,
                uncertain: w.uncertain,
            });
        }
    }
    out
}

/// What to change in one of iptables' FORWARD chains so that nodelb's ACCEPT is in it exactly
/// when wanted.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AcceptChange {
    pub source: Source,
    pub family: TableFamily,
    pub table: String,
    pub chain: String,
    /// Positions (in the chain as read) of nodelb's rules to delete.
    pub stale: Vec<usize>,
    /// Insert nodelb's ACCEPT for this mark bit at the head.
    pub insert: Option<u32>,
}

/// The changes that make iptables' FORWARD chains (`ip`/`ip6 filter FORWARD` of iptables-nft,
/// FORWARD of iptables-legacy) hold nodelb's ACCEPT for `mark` (`--iptables-forward-accept`),
/// or, with `None`, none of nodelb's rules. A chain that holds exactly the right ACCEPT is left
/// alone wherever it is in it (a tool that inserted a rule ahead of it since is judged by
/// [`analyse`], not fought over); a missing one (the chain flushed or restored) is inserted at
/// the head again. A chain that does not exist is never created: nodelb writes only into
/// iptables' own chain.
pub fn accept_changes(chains: &[HostChain], mark: Option<u32>) -> Vec<AcceptChange> {
    let mut out = Vec::new();
    for c in chains {
        let iptables = match c.source {
            Source::IptablesLegacy => true,
            Source::Nftables => c.family != TableFamily::Inet,
        };
        if !iptables || c.table != "filter" || c.name != "FORWARD" || c.base.is_none() {
            continue;
        }
        let ours: Vec<usize> = c
            .rules
            .iter()
            .enumerate()
            .filter(|(_, r)| is_ours(r.comment.as_deref()))
            .map(|(i, _)| i)
            .collect();
        let right = |r: &HostRule, bit: u32| {
            r.action == Action::Accept
                && r.tests == [Test::Mark { mask: bit, value: bit, invert: false }]
                && r.comment.as_deref() == Some(accept_comment(bit).as_str())
        };
        let change = match mark {
            Some(bit) if ours.len() == 1 && right(&c.rules[ours[0]], bit) => None,
            Some(bit) => Some((ours, Some(bit))),
            None if ours.is_empty() => None,
            None => Some((ours, None)),
        };
        if let Some((stale, insert)) = change {
            out.push(AcceptChange {
                source: c.source,
                family: c.family,
                table: c.table.clone(),
                chain: c.name.clone(),
                stale,
                insert,
            });
        }
    }
    out
}

/// The node-level counters of one family: new connections of nodelb's Services that entered
/// the forward path (first chain) and that left it (last chain).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ForwardCounts {
    pub entered: u64,
    pub passed: u64,
}

/// What the counters said most recently about a family.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", tag = "state")]
pub enum EvidenceState {
    /// Connections entered and none left, in every check since `since` (Unix seconds):
    /// `connections` in all.
    Dropping { since: u64, connections: u64 },
    /// At least one connection left the forward path in the last check that saw traffic.
    Passing,
}

/// Packet evidence, per family: a check that sees connections enter the forward path and none
/// leave it says "dropping"; one that sees any leave says "passing"; one that sees no traffic
/// leaves the state as it was. Counters that went down (our table was replaced) start over.
#[derive(Debug, Clone, Default)]
pub struct Evidence {
    last: BTreeMap<Family, ForwardCounts>,
    state: BTreeMap<Family, EvidenceState>,
}

impl Evidence {
    /// One check's reading of the counters of `family`, at `now` (Unix seconds).
    pub fn observe(&mut self, family: Family, counts: ForwardCounts, now: u64) {
        let Some(prev) = self.last.insert(family, counts) else { return };
        if counts.entered < prev.entered || counts.passed < prev.passed {
            return;
        }
        let (entered, passed) = (counts.entered - prev.entered, counts.passed - prev.passed);
        if passed > 0 {
            self.state.insert(family, EvidenceState::Passing);
        } else if entered > 0 {
            let next = match self.state.get(&family) {
                Some(EvidenceState::Dropping { since, connections }) => {
                    EvidenceState::Dropping { since: *since, connections: connections + entered }
                }
                _ => EvidenceState::Dropping { since: now, connections: entered },
            };
            self.state.insert(family, next);
        }
    }

    /// The firewall's rules changed: what was seen before says nothing about them any more,
    /// and neither do the connections counted since the last reading (they may have met the
    /// old rules): the next reading is a new baseline.
    pub fn forget(&mut self) {
        self.state.clear();
        self.last.clear();
    }

    pub fn state(&self, family: Family) -> Option<EvidenceState> {
        self.state.get(&family).copied()
    }

    pub fn counts(&self, family: Family) -> Option<ForwardCounts> {
        self.last.get(&family).copied()
    }
}

/// What the agent reports for one family.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct FamilyDiagnosis {
    /// nodelb's connections of this family are dropped for certain (a chain drops them all, or
    /// a chain drops them unless a rule nodelb cannot judge accepts them and the counters show
    /// none gets through): the node cannot serve the family. The reason, with the fix.
    pub blocked: Option<String>,
    /// Only the counters say connections are dropped (no chain nodelb can read drops them: an
    /// iptables rule it cannot judge, a NetworkPolicy, …): reported, not a reason to stop
    /// serving (it could be one Service's traffic, and a node that stops being listed gets no
    /// traffic to show it works again).
    pub evidence: Option<String>,
    /// Chains that may drop nodelb's connections (their rules cannot all be judged), with no
    /// traffic yet to tell.
    pub suspect: Vec<String>,
}

/// Stable while the state lasts (logged and recorded as an Event once, not at every check): the
/// count of connections is in the status, not here.
fn evidence_words(family: Family, since: u64) -> String {
    let at = i64::try_from(since)
        .ok()
        .and_then(|s| k8s_openapi::jiff::Timestamp::from_second(s).ok())
        .map_or_else(|| format!("{since}"), |t| t.to_string());
    format!(
        "new {family} connections of nodelb Services entered the forward path since {at} and none left it"
    )
}

/// Findings and evidence → per family in `families`, what to report. `accept_flag`: nodelb runs
/// with `--iptables-forward-accept` (the fix it suggests).
pub fn diagnose(
    findings: &[Finding],
    evidence: &Evidence,
    families: &[Family],
    accept_flag: bool,
) -> BTreeMap<Family, FamilyDiagnosis> {
    let mut out = BTreeMap::new();
    for &family in families {
        let mine: Vec<&Finding> = findings.iter().filter(|f| f.family == family).collect();
        let certain: Vec<&Finding> = mine.iter().copied().filter(|f| f.certain()).collect();
        let mut d = FamilyDiagnosis::default();
        let dropping = match evidence.state(family) {
            Some(EvidenceState::Dropping { since, .. }) => Some(evidence_words(family, since)),
            _ => None,
        };
        let passing = evidence.state(family) == Some(EvidenceState::Passing);
        let explain = |f: &Finding| format!("{}; fix: {}", f.describe(), f.fix(accept_flag));
        if !certain.is_empty() {
            d.blocked = Some(certain.iter().map(|f| explain(f)).collect::<Vec<_>>().join("; and "));
        } else if !mine.is_empty() {
            match &dropping {
                Some(words) => {
                    let why = mine.iter().map(|f| explain(f)).collect::<Vec<_>>().join("; and ");
                    d.blocked = Some(format!("{words}: {why}"));
                }
                // The counters show connections getting through: a partial accept lets them.
                None if passing => {}
                None => d.suspect = mine.iter().map(|f| explain(f)).collect(),
            }
        } else if let Some(words) = dropping {
            d.evidence = Some(format!(
                "{words}: something between nodelb's first and last forward chain drops them (a rule nodelb \
                 cannot judge, or a NetworkPolicy); look for it in `nft list ruleset` and `iptables-legacy -S` \
                 (`nodelb status` lists the chains nodelb judged), or let nodelb's connections through iptables' \
                 FORWARD chain with --iptables-forward-accept"
            ));
        }
        out.insert(family, d);
    }
    out
}

/// The families whose diagnosis says the node cannot serve them.
pub fn blocked_families(d: &BTreeMap<Family, FamilyDiagnosis>) -> BTreeSet<Family> {
    d.iter().filter(|(_, d)| d.blocked.is_some()).map(|(f, _)| *f).collect()
}

#[cfg(test)]
mod tests;
