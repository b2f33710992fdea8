//! A packet tracer over the IR: follows one packet through the `nodelb` table the way the kernel
//! would (hooks in priority order, vmap lookups, goto/jump/return, NAT) and says what happens to
//! it. Pure; used by table-driven tests ("tcp from 203.0.113.7 to node:20001 → DNAT
//! 198.51.100.11:8080, masquerade") and to explain the ruleset to people.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::net::IpAddr;

use nodelb_core::domain::{Family, Protocol};
use nodelb_core::ruleset::ir::{BaseChain, ChainType, CtState, Expr, Hook, Key, Mapped, Ruleset, Verdict};

/// Where the packet comes from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Origin {
    /// Arrives on an interface (PREROUTING).
    Network,
    /// Sent by a process on the node (OUTPUT).
    Node,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Packet {
    pub protocol: Protocol,
    pub saddr: IpAddr,
    pub sport: u16,
    pub daddr: IpAddr,
    pub dport: u16,
    pub origin: Origin,
    /// Conntrack state of the packet (first packet of a connection: `New`).
    pub ct_state: CtState,
}

/// What the node knows that the IR does not: its local addresses, which random number `numgen`
/// draws, and what the packet path put into dynamic sets (affinity: set name → client addresses).
#[derive(Debug, Clone, Default)]
pub struct Env {
    pub local_addrs: Vec<IpAddr>,
    pub numgen: u32,
    pub dynamic: BTreeMap<String, BTreeSet<IpAddr>>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    /// Not translated; delivered to the node itself (or routed on untouched).
    Untouched,
    /// Dropped in `chain`.
    Dropped { chain: String },
    /// Refused with a TCP reset or an ICMP port unreachable, in `chain`.
    Rejected { chain: String, tcp_reset: bool },
    /// Translated to `to` and forwarded (or delivered, for node-originated traffic); `masquerade`
    /// says whether the source is rewritten to the node's address.
    Dnat { to: (IpAddr, u16), masquerade: bool },
}

impl fmt::Display for Outcome {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Outcome::Untouched => write!(f, "untouched"),
            Outcome::Dropped { chain } => write!(f, "drop in {chain}"),
            Outcome::Rejected { chain, tcp_reset } => {
                write!(f, "reject ({}) in {chain}", if *tcp_reset { "tcp reset" } else { "icmp" })
            }
            Outcome::Dnat { to: (a, p), masquerade } => {
                let a = match a {
                    IpAddr::V4(a) => a.to_string(),
                    IpAddr::V6(a) => format!("[{a}]"),
                };
                write!(f, "DNAT {a}:{p}{}", if *masquerade { ", masquerade" } else { "" })
            }
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Trace {
    /// Chains visited, in order.
    pub chains: Vec<String>,
    /// Named counters the packet counted in, in order.
    pub counters: Vec<String>,
    /// Dynamic sets the packet put (or refreshed) its source address in, in order.
    pub updates: Vec<String>,
    pub outcome: Outcome,
}

struct State<'a> {
    pkt: &'a Packet,
    env: &'a Env,
    mark: u32,
    /// The connection's conntrack mark (what the nat chains set, the forward chains read).
    ct_mark: u32,
    dnat: Option<(IpAddr, u16)>,
    masquerade: bool,
    visited: Vec<String>,
    counters: Vec<String>,
    updates: Vec<String>,
}

enum ChainEnd {
    /// Base chain finished: the packet continues to the next hook.
    Continue,
    Drop(String),
    Reject(String, bool),
}

/// Traces the first packet (or a later one, per `ct_state`) of a connection through the ruleset.
pub fn trace(rs: &Ruleset, pkt: &Packet, env: &Env) -> Trace {
    let mut st = State {
        pkt,
        env,
        mark: 0,
        ct_mark: 0,
        dnat: None,
        masquerade: false,
        visited: Vec::new(),
        counters: Vec::new(),
        updates: Vec::new(),
    };
    let first_hook = match pkt.origin {
        Origin::Network => Hook::Prerouting,
        Origin::Node => Hook::Output,
    };
    let mut hooks = vec![first_hook];
    // After DNAT in PREROUTING the packet is routed: forwarded unless the new address is local.
    // Node-originated packets go straight to POSTROUTING.
    hooks.push(Hook::Forward);
    hooks.push(Hook::Postrouting);
    for hook in hooks {
        if hook == Hook::Forward {
            let daddr = st.dnat.map(|d| d.0).unwrap_or(pkt.daddr);
            if pkt.origin == Origin::Node || is_local(env, &daddr) {
                continue;
            }
        }
        let mut bases: Vec<(&BaseChain, &nodelb_core::ruleset::ir::Name)> = rs
            .chains
            .values()
            .filter_map(|c| c.base.as_ref().map(|b| (b, &c.name)))
            .filter(|(b, _)| b.hook == hook)
            .collect();
        bases.sort_by_key(|(b, n)| (b.priority, (*n).clone()));
        // The kernel runs a hook's nat chains (of every table) until one translates the
        // connection, and no further (nf_nat_inet_fn): with the nat chains sharded, a node port's
        // DNAT is in one shard and the others' chains after it are not run.
        let translated = |st: &State<'_>| match hook {
            Hook::Postrouting => st.masquerade,
            _ => st.dnat.is_some(),
        };
        let before = translated(&st);
        for (b, name) in bases {
            // NAT chains see only the first packet of a connection.
            if b.chain_type == ChainType::Nat && (pkt.ct_state != CtState::New || translated(&st) != before) {
                continue;
            }
            match run_chain(rs, name, &mut st) {
                ChainEnd::Continue => {}
                ChainEnd::Drop(c) => return finish(st, Outcome::Dropped { chain: c }),
                ChainEnd::Reject(c, tcp) => {
                    return finish(st, Outcome::Rejected { chain: c, tcp_reset: tcp });
                }
            }
        }
    }
    let outcome = match st.dnat {
        Some(to) => Outcome::Dnat { to, masquerade: st.masquerade },
        None => Outcome::Untouched,
    };
    finish(st, outcome)
}

fn finish(st: State<'_>, outcome: Outcome) -> Trace {
    Trace { chains: st.visited, counters: st.counters, updates: st.updates, outcome }
}

fn is_local(env: &Env, a: &IpAddr) -> bool {
    a.is_loopback() || env.local_addrs.contains(a)
}

enum RuleEnd {
    NoMatch,
    Next,
    Verdict(Verdict),
    Terminal(ChainEnd),
    /// A NAT statement ran: the nat chain is done with this packet.
    NatDone,
}

fn run_chain(rs: &Ruleset, start: &str, st: &mut State<'_>) -> ChainEnd {
    // (chain, next rule index) frames for `jump`; `goto` replaces the top frame.
    let mut stack: Vec<(nodelb_core::ruleset::ir::Name, usize)> = vec![(start.into(), 0)];
    let mut guard = 0;
    while let Some((chain_name, idx)) = stack.pop() {
        guard += 1;
        if guard > 10_000 {
            return ChainEnd::Drop(format!("{chain_name} (loop)"));
        }
        let Some(chain) = rs.chains.get(&chain_name) else {
            return ChainEnd::Drop(format!("{chain_name} (missing)"));
        };
        if idx == 0 {
            st.visited.push(chain_name.to_string());
        }
        let Some(rule) = chain.rules.get(idx) else {
            continue; // end of chain: return to caller (or policy accept for the base chain)
        };
        match run_rule(rs, rule, st) {
            RuleEnd::NoMatch | RuleEnd::Next => stack.push((chain_name, idx + 1)),
            RuleEnd::NatDone => return ChainEnd::Continue,
            RuleEnd::Terminal(end) => return end,
            RuleEnd::Verdict(v) => match v {
                Verdict::Accept => return ChainEnd::Continue,
                Verdict::Drop => return ChainEnd::Drop(chain_name.to_string()),
                Verdict::Return => {}
                Verdict::Jump(target) => {
                    stack.push((chain_name, idx + 1));
                    stack.push((target, 0));
                }
                Verdict::Goto(target) => stack.push((target, 0)),
            },
        }
    }
    ChainEnd::Continue
}

fn run_rule(rs: &Ruleset, rule: &nodelb_core::ruleset::ir::Rule, st: &mut State<'_>) -> RuleEnd {
    let pkt = st.pkt;
    let family = Family::of(&pkt.saddr);
    let daddr = st.dnat.map(|d| d.0).unwrap_or(pkt.daddr);
    let dport = st.dnat.map(|d| d.1).unwrap_or(pkt.dport);
    for e in &rule.exprs {
        let matched = match e {
            Expr::NfProto(f) => *f == family,
            Expr::L4Proto(p) => *p == pkt.protocol,
            Expr::FibDaddrLocal => is_local(st.env, &daddr),
            Expr::SaddrInPrefix { prefix, negate } => {
                (Family::of(&prefix.addr()) == family && prefix.contains(&pkt.saddr)) != *negate
            }
            Expr::DaddrInPrefix { prefix, negate } => {
                (Family::of(&prefix.addr()) == family && prefix.contains(&daddr)) != *negate
            }
            Expr::CtState(states) => states.contains(&pkt.ct_state),
            Expr::CtStatusDnat => st.dnat.is_some(),
            Expr::MarkHas(bit) => st.mark & bit == *bit,
            Expr::CtMarkHas(bit) => st.ct_mark & bit == *bit,
            Expr::CtMarkSet(bit) => {
                st.ct_mark |= bit;
                true
            }
            Expr::DportMaskIsNot { mask, value } => st.pkt.dport & mask != *value,
            Expr::MarkSet(bit) => {
                st.mark |= bit;
                true
            }
            Expr::MarkXor(bit) => {
                st.mark ^= bit;
                true
            }
            Expr::MarkClear(bit) => {
                st.mark &= !bit;
                true
            }
            Expr::Counter => true,
            Expr::CounterRef(name) => {
                st.counters.push(name.to_string());
                true
            }
            Expr::L4ProtoDportVmap { map } | Expr::L4ProtoCtOrigDportVmap { map } => {
                let port = if matches!(e, Expr::L4ProtoDportVmap { .. }) { dport } else { pkt.dport };
                let key = Key::proto_port(pkt.protocol, port);
                match rs.sets.get(map).and_then(|s| s.elements.get(&key)) {
                    Some(Some(Mapped::Verdict(v))) => return RuleEnd::Verdict(v.clone()),
                    _ => false,
                }
            }
            Expr::L4ProtoDportInSet { set } => {
                let key = Key::proto_port(pkt.protocol, dport);
                rs.sets.get(set).is_some_and(|s| s.elements.contains_key(&key))
            }
            Expr::DaddrL4ProtoDportInSet { set, .. } => {
                let key = Key::addr_proto_port(daddr, pkt.protocol, dport);
                rs.sets.get(set).is_some_and(|s| s.elements.contains_key(&key))
            }
            Expr::DaddrL4ProtoDportVmap { map, .. } => {
                let key = Key::addr_proto_port(daddr, pkt.protocol, dport);
                match rs.sets.get(map).and_then(|s| s.elements.get(&key)) {
                    Some(Some(Mapped::Verdict(v))) => return RuleEnd::Verdict(v.clone()),
                    _ => false,
                }
            }
            Expr::L4ProtoCtOrigDportCounterMap { map } => {
                let key = Key::proto_port(pkt.protocol, pkt.dport);
                match rs.sets.get(map).and_then(|s| s.elements.get(&key)) {
                    Some(Some(Mapped::Counter(name))) => {
                        st.counters.push(name.to_string());
                        true
                    }
                    _ => false,
                }
            }
            Expr::L4ProtoCtOrigDportInSet { set } => {
                let key = Key::proto_port(pkt.protocol, pkt.dport);
                rs.sets.get(set).is_some_and(|s| s.elements.contains_key(&key))
            }
            Expr::SaddrDaddrL4ProtoDportInSet { set, .. } => {
                let key = Key::addrs_proto_port(pkt.saddr, daddr, pkt.protocol, dport);
                rs.sets.get(set).is_some_and(|s| s.elements.contains_key(&key))
            }
            Expr::SaddrTwiceL4ProtoSportInSet { set, .. } => {
                let key = Key::addrs_proto_port(pkt.saddr, pkt.saddr, pkt.protocol, pkt.sport);
                rs.sets.get(set).is_some_and(|s| s.elements.contains_key(&key))
            }
            Expr::SaddrInSet { set, .. } => {
                st.env.dynamic.get(&**set).is_some_and(|s| s.contains(&pkt.saddr))
            }
            Expr::UpdateSaddr { set, .. } => {
                st.updates.push(set.to_string());
                true
            }
            // Every draw of one trace is `env.numgen`: with N endpoints, draw d picks the first i
            // with d % (N - i) == 0 (d = 0 → the first endpoint; N = 2: d % 2 picks as a map would).
            Expr::NumgenRandomIs { modulus, value } => *modulus != 0 && st.env.numgen % modulus == *value,
            Expr::Dnat { addr, port } => {
                if Family::of(addr) != family {
                    return RuleEnd::Terminal(ChainEnd::Drop("dnat family mismatch".into()));
                }
                st.dnat = Some((*addr, *port));
                return RuleEnd::NatDone;
            }
            Expr::Masquerade => {
                st.masquerade = true;
                return RuleEnd::NatDone;
            }
            Expr::RejectTcpReset => {
                let chain = st.visited.last().cloned().unwrap_or_default();
                return RuleEnd::Terminal(ChainEnd::Reject(chain, pkt.protocol == Protocol::Tcp));
            }
            Expr::RejectIcmpPortUnreachable => {
                let chain = st.visited.last().cloned().unwrap_or_default();
                return RuleEnd::Terminal(ChainEnd::Reject(chain, false));
            }
            Expr::Verdict(v) => return RuleEnd::Verdict(v.clone()),
        };
        if !matched {
            return RuleEnd::NoMatch;
        }
    }
    RuleEnd::Next
}
