//! The planner: validated services + their node ports + node facts → the complete desired ruleset
//! of the `nodelb` table (pure, no I/O), and the diff between two rulesets as a list of
//! [`Change`]s so that a small change is a small netlink batch.
//!
//! Layout (see docs/design.md for why each piece sits where it does):
//!
//! ```text
//! nat-prerouting     nat     prerouting -100  a connection's first packet, to a local daddr: vmap
//!                                             @firewall-ports-<fam> (jump fw chain / goto no-endpoints),
//!                                             then vmap @service-ports-<fam> (goto svc chain)
//! nat-output         nat     output     -100  same, for node-originated traffic
//! nat-postrouting    nat     postrouting 100  masquerade what a svc chain marked, and hairpin
//!                                             connections (`@endpoints-<fam>`: endpoint to itself)
//! filter-forward     filter  forward  first  drop invalid from our endpoints; count our new
//!                                             connections (`forward-entered-<fam>`); with
//!                                             --iptables-forward-accept, mark our flows
//! filter-forward-last filter forward   last   our flows: count in `counter name … map
//!                                             @forward-counters-<fam>` (clear the mark); count
//!                                             our new connections (`forward-passed-<fam>`)
//! svc<4|6>-…         per service port & family: count, mark for masquerade, then one dnat rule
//!                    per endpoint, chosen by `numgen random mod N-i 0` draws; with session
//!                    affinity, first a lookup per endpoint in its `aff<4|6>-…` set of clients
//!                    (dynamic, with timeout), and every draw records its choice there
//! fw<4|6>-…          per service port & family with source ranges: allowed saddr → continue, else
//!                    count and drop
//! no-endpoints       reject (TCP reset / ICMP port unreachable)
//! ```
//!
//! With `--nat-shards K` (K > 1), `nat-prerouting`, `nat-output`, `no-endpoints`, the dispatch
//! maps and every service port's svc/fw chains, `conn`/`refused` counters and `aff` sets are in
//! table `nodelb-s<k>` instead, named `s<k>.…`, k a hash of the port's identity
//! ([`nat_table_of`]); the rest stays in `nodelb` (docs/design/dispatch.md, "Sharding the nat
//! chains").
//!
//! Per-service counters are named counter objects (`conn<4|6>-…` new connections, `fwd<4|6>-…`
//! forwarded packets and bytes, `refused<4|6>-…` source-range drops): they exist while the Service
//! port is programmed for the family, with or without endpoints, and keep counting when its rules
//! are replaced.

use std::collections::{BTreeMap, BTreeSet};
use std::net::IpAddr;

use ipnet::IpNet;

use crate::domain::{FNV1A_OFFSET, Family, PortId, Protocol, fnv1a, fnv1a_extend};
use crate::inputs::model::{Endpoint, LbPort, LbService, TrafficPolicy};
use crate::ruleset::ir::{
    BaseChain, Chain, ChainType, Change, CtState, Expr, Hook, Key, KeyPart, KeyType, Mapped, Name,
    NamedCounter, Rule, Ruleset, Set, SetKind, Table, Verdict, priority,
};

/// Default packet-mark bit meaning "masquerade this connection's first packet in postrouting".
/// Same bit and meaning as kube-proxy's masquerade mark, so the two agree if both see it.
pub const DEFAULT_MASQUERADE_MARK: u32 = 0x4000;
/// Default `--connection-mark`: the conntrack-mark bit of the connections nodelb DNATs.
pub const DEFAULT_CONNECTION_MARK: u32 = 0x10_0000;

pub const CHAIN_FILTER_FORWARD: &str = "filter-forward";
pub const CHAIN_FILTER_FORWARD_LAST: &str = "filter-forward-last";
pub const CHAIN_NAT_PREROUTING: &str = "nat-prerouting";
pub const CHAIN_NAT_OUTPUT: &str = "nat-output";
pub const CHAIN_NAT_POSTROUTING: &str = "nat-postrouting";
pub const CHAIN_NO_ENDPOINTS: &str = "no-endpoints";

/// Longest chain name we generate (the kernel allows 256 bytes).
const MAX_CHAIN_NAME: usize = 200;

/// Longest comment, in bytes: nft refuses longer ones, and so does our encoder, which fails the
/// whole batch. Every comment built from user input is fitted to it here.
pub const MAX_COMMENT: usize = 128;

/// What the planner needs to know about this node.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NodeFacts {
    /// Node name, to tell local endpoints (`externalTrafficPolicy: Local`) from remote ones.
    pub node_name: String,
    /// Families this node may program (forwarding enabled). Others get no rules at all.
    pub families: BTreeSet<Family>,
    pub masquerade_mark: u32,
    /// `--connection-mark`: the conntrack-mark bit on every connection nodelb DNATs, by which its
    /// forward chains know their own.
    pub connection_mark: u32,
    /// `--iptables-forward-accept`: the packet-mark bit our flows carry through the forward hook,
    /// which the accept nodelb inserts into the host's iptables FORWARD chain matches.
    pub forward_mark: Option<u32>,
    /// `--nat-shards`: over how many tables the Service ports' nat parts are spread (0 and 1: all
    /// in the main table; docs/design/dispatch.md, "Sharding the nat chains"): a power of two, at
    /// most [`crate::ruleset::ir::MAX_NAT_SHARDS`] (another number counts as the power of two below it).
    pub nat_shards: u8,
}

impl NodeFacts {
    /// The number of nat shard tables: [`NodeFacts::nat_shards`] as a power of two, 1 for none.
    pub fn nat_shard_count(&self) -> u8 {
        let k = self.nat_shards.clamp(1, crate::ruleset::ir::MAX_NAT_SHARDS);
        1 << (7 - k.leading_zeros())
    }

    /// The tables holding nat base chains and dispatch maps: the main table, or every shard.
    pub fn nat_tables(&self) -> Vec<Table> {
        match self.nat_shard_count() {
            1 => vec![Table::Main],
            k => (0..k).map(Table::Shard).collect(),
        }
    }
}

/// `--nat-shards`: a fixed number of nat shard tables, or as many as the Services need.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NatShards {
    Fixed(u8),
    /// [`auto_nat_shards`] of the Service ports the node sees.
    Auto,
}

/// `--nat-shards auto`: the most Service ports a shard table is given before the shards double
/// (what adding one costs the kernel grows with the ports of its table; docs/benchmarks.md).
pub const PORTS_PER_NAT_SHARD: usize = 1_000;

/// `--nat-shards auto`: how many shard tables for `ports` Service ports when there are `current`
/// now. The least power of two giving each at most [`PORTS_PER_NAT_SHARD`] (at most
/// [`crate::ruleset::ir::MAX_NAT_SHARDS`]; 1 is the main table alone); more at once when the ports need
/// them, fewer only once the ports would fill a quarter of what the current ones hold, so a
/// count moving around a boundary does not move every port back and forth (a new count is a full
/// replace).
pub fn auto_nat_shards(ports: usize, current: u8) -> u8 {
    let max = crate::ruleset::ir::MAX_NAT_SHARDS;
    let mut want: u8 = 1;
    while want < max && ports > PORTS_PER_NAT_SHARD * usize::from(want) {
        want *= 2;
    }
    let current = current.clamp(1, max);
    if want >= current || ports * 4 <= PORTS_PER_NAT_SHARD * usize::from(current) { want } else { current }
}

/// The table of the nat part of a service port with node port `node_port`: the shard its low
/// bits name, so each shard's nat chains can let every other port go with one masked compare
/// (`th dport & K-1 != k`) before any lookup. Both families and every protocol of a node port
/// share it; a new node port may move the port's chains and counters (whose totals the counter
/// fold keeps, `counters`).
pub fn nat_table_of(node_port: u16, node: &NodeFacts) -> Table {
    match node.nat_shard_count() {
        1 => Table::Main,
        k => Table::Shard((node_port & u16::from(k - 1)) as u8),
    }
}

/// `name` in table `t` (a shard's objects carry its prefix, [`Table::of_name`]).
pub fn in_table(t: Table, name: &str) -> Name {
    match t {
        Table::Main => name.into(),
        t => format!("{}{name}", t.prefix()).into(),
    }
}

/// One service to program, with the node ports allocated to its ports (a port without an
/// allocation is not programmed).
#[derive(Debug, Clone)]
pub struct ServicePlan<'a> {
    pub service: &'a LbService,
    pub node_ports: &'a BTreeMap<PortId, u16>,
}

/// Names of the per-family sets and maps.
pub fn service_ports_map(f: Family) -> Name {
    format!("service-ports-{}", f.name()).into()
}
pub fn firewall_ports_map(f: Family) -> Name {
    format!("firewall-ports-{}", f.name()).into()
}
/// [`service_ports_map`] for node ports whose pool restricts node addresses: keyed by
/// `address . protocol . node port`, one element per address that serves it.
pub fn service_address_ports_map(f: Family) -> Name {
    format!("service-address-ports-{}", f.name()).into()
}
/// [`firewall_ports_map`] for node ports whose pool restricts node addresses.
pub fn firewall_address_ports_map(f: Family) -> Name {
    format!("firewall-address-ports-{}", f.name()).into()
}
pub fn forward_counters_map(f: Family) -> Name {
    format!("forward-counters-{}", f.name()).into()
}
pub fn endpoints_set(f: Family) -> Name {
    format!("endpoints-{}", f.name()).into()
}
/// Node-level named counter: new connections of our Services entering the forward path.
pub fn forward_entered_counter(f: Family) -> Name {
    format!("forward-entered-{}", f.name()).into()
}
/// Node-level named counter: new connections of our Services leaving the forward path.
pub fn forward_passed_counter(f: Family) -> Name {
    format!("forward-passed-{}", f.name()).into()
}

fn fam_digit(f: Family) -> char {
    match f {
        Family::Ipv4 => '4',
        Family::Ipv6 => '6',
    }
}

/// Keeps characters nft accepts in an unquoted identifier (`[a-zA-Z0-9/\-_.]`).
fn sanitize(s: &str) -> String {
    s.chars().map(|c| if c.is_ascii_alphanumeric() || "/-_.".contains(c) { c } else { '.' }).collect()
}

/// Control characters (NUL included) become `?`: a NUL ends a comment in the kernel's user data
/// and nft cannot print the others. `"` becomes `'`, as [`crate::ruleset::ir`]'s rendering quotes it, so
/// the kernel and the rendering agree.
fn printable(s: &str) -> String {
    s.chars()
        .map(|c| {
            if c.is_control() {
                '?'
            } else if c == '"' {
                '\''
            } else {
                c
            }
        })
        .collect()
}

/// `s` itself when it has at most `max` bytes, else its longest prefix (cut on a character
/// boundary) that fits with a `...` after it.
fn fit(s: &str, max: usize) -> String {
    if s.len() <= max {
        return s.to_string();
    }
    let mut end = max.saturating_sub(3);
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}...", &s[..end])
}

/// The comment of a service port's chain, `<ns>/<name> <port>: node port <n><what>`, always at
/// most [`MAX_COMMENT`] bytes: a long namespace/name (up to 63 + 253 bytes in Kubernetes) is
/// shortened with `...`, each part keeping its beginning, so the port, node port and `what` stay
/// whole (the chain name carries the unique identity, this is for a human reading `nft list`).
pub fn port_comment(svc: &LbService, port: &LbPort, node_port: u16, what: &str) -> String {
    identity_comment(svc, &format!(" {}: node port {node_port}{what}", port.id))
}

/// `<ns>/<name><tail>` in at most [`MAX_COMMENT`] bytes, shortening the namespace and name only.
fn identity_comment(svc: &LbService, tail: &str) -> String {
    comment_of(&printable(&svc.key.namespace), &printable(&svc.key.name), tail)
}

/// [`identity_comment`] of an already [`printable`] namespace and name.
fn comment_of(ns: &str, name: &str, tail: &str) -> String {
    let tail = printable(tail);
    let budget = MAX_COMMENT.saturating_sub(tail.len() + 1); // 1 for the '/'
    let identity = if ns.len() + name.len() <= budget {
        format!("{ns}/{name}")
    } else {
        // The namespace gets half, or more when the name needs less than the other half.
        let ns_max = (budget / 2).max(budget.saturating_sub(name.len()));
        let ns = fit(ns, ns_max);
        let name = fit(name, budget.saturating_sub(ns.len()));
        format!("{ns}/{name}")
    };
    fit(&format!("{identity}{tail}"), MAX_COMMENT)
}

fn port_identity(svc: &LbService, port: &LbPort) -> String {
    format!("{}/{}/{}/{}", svc.key.namespace, svc.key.name, port.id.protocol.name(), port.id.port)
}

/// Every name and comment of one service port in one family, derived from its identity, which is
/// built, sanitized and made printable once (a full plan names each port's chain, counters and
/// comments: formatting the identity again for each would be a large share of the plan).
pub struct PortNames<'a> {
    family: Family,
    port: &'a LbPort,
    /// The table of its nat part (chains, connection and refused counters, affinity sets).
    table: Table,
    /// `ns/name/proto/port`: what the hashes cover.
    identity: String,
    /// [`sanitize`]d identity: the readable suffix of chain and counter names.
    readable: String,
    /// [`printable`] namespace and name, for comments.
    ns: String,
    name: String,
}

impl<'a> PortNames<'a> {
    pub fn new(family: Family, svc: &LbService, port: &'a LbPort) -> PortNames<'a> {
        let identity = port_identity(svc, port);
        PortNames {
            family,
            port,
            table: Table::Main,
            readable: sanitize(&identity),
            identity,
            ns: printable(&svc.key.namespace),
            name: printable(&svc.key.name),
        }
    }

    /// The names on a node whose nat parts are spread over `node.nat_shards` tables, for node
    /// port `node_port`.
    pub fn on(
        family: Family,
        svc: &LbService,
        port: &'a LbPort,
        node_port: u16,
        node: &NodeFacts,
    ) -> PortNames<'a> {
        let mut names = PortNames::new(family, svc, port);
        names.table = nat_table_of(node_port, node);
        names
    }

    /// The table of the port's nat part.
    pub fn table(&self) -> Table {
        self.table
    }

    /// `<kind><4|6>-<hash>-<readable suffix>`: the hash (32 bits of FNV-1a over
    /// `kind|family|identity[|node port]`, hashed in parts) makes it unique and stable, the suffix
    /// makes `nft list ruleset` readable; cut to [`MAX_CHAIN_NAME`] (the hash keeps it unique).
    fn named(&self, kind: &str, node_port: Option<u16>) -> Name {
        let mut h = fnv1a_extend(FNV1A_OFFSET, kind.as_bytes());
        for part in [b"|".as_slice(), self.family.name().as_bytes(), b"|", self.identity.as_bytes()] {
            h = fnv1a_extend(h, part);
        }
        if let Some(np) = node_port {
            h = fnv1a_extend(fnv1a_extend(h, b"|"), np.to_string().as_bytes());
        }
        let mut name = format!("{kind}{}-{:08x}-{}", fam_digit(self.family), h as u32, self.readable);
        if name.len() > MAX_CHAIN_NAME {
            name.truncate(MAX_CHAIN_NAME);
        }
        name.into()
    }

    /// `named` in the table of the port's nat part.
    fn nat_named(&self, kind: &str, node_port: Option<u16>) -> Name {
        let name = self.named(kind, node_port);
        if self.table == Table::Main { name } else { in_table(self.table, &name) }
    }

    /// The DNAT chain ([`service_chain`]).
    pub fn service_chain(&self, node_port: u16) -> Name {
        self.nat_named("svc", Some(node_port))
    }
    /// The source-range chain; the node port is part of its identity as for
    /// [`service_chain`].
    pub fn firewall_chain(&self, node_port: u16) -> Name {
        self.nat_named("fw", Some(node_port))
    }
    /// Named counter of the new connections the port's chain DNATs.
    pub fn connections_counter(&self) -> Name {
        self.nat_named("conn", None)
    }
    /// Named counter of the packets and bytes forwarded for the port's connections.
    pub fn forwarded_counter(&self) -> Name {
        self.named("fwd", None)
    }
    /// Named counter of the new connections the port's source ranges drop.
    pub fn refused_counter(&self) -> Name {
        self.nat_named("refused", None)
    }
    /// [`affinity_set`], in the table of the port's nat part.
    pub fn affinity_set(&self, svc: &LbService, ep: &Endpoint, timeout: u32) -> Name {
        let name = affinity_set(self.family, svc, self.port, ep, timeout);
        if self.table == Table::Main { name } else { in_table(self.table, &name) }
    }
    /// [`port_comment`].
    pub fn port_comment(&self, node_port: u16, what: &str) -> String {
        comment_of(&self.ns, &self.name, &format!(" {}: node port {node_port}{what}", self.port.id))
    }
    /// A counter's comment, `<ns>/<name> <port>: <what>`.
    fn counter_comment(&self, what: &str) -> String {
        comment_of(&self.ns, &self.name, &format!(" {}: {what}", self.port.id))
    }
}

/// A service port's DNAT chain. The node port is part of its identity (in the hash, not the
/// readable suffix): the chain's comment names the node port, and the kernel keeps a chain's
/// comment when the chain is added again, so a new node port must be a new chain (the diff adds
/// it and deletes the old one) for the table to say what it does.
pub fn service_chain(f: Family, svc: &LbService, port: &LbPort, node_port: u16) -> Name {
    PortNames::new(f, svc, port).service_chain(node_port)
}

/// Dynamic set of the clients whose last connection to a service port went to `ep`
/// (`sessionAffinity: ClientIP`), expiring after `timeout` seconds. The timeout is part of the
/// identity: a changed timeout is a new, empty set (a set's timeout cannot be changed in place).
/// `aff<4|6>-<64-bit hash>`, no readable suffix (its comment has one): the kernel finds a set by
/// comparing its name with every set name of the table, `strlen` included, once per set added and
/// per rule using one, so at thousands of affinity endpoints short names halve a full replace.
pub fn affinity_set(f: Family, svc: &LbService, port: &LbPort, ep: &Endpoint, timeout: u32) -> Name {
    let identity =
        format!("aff|{}|{}/{}/{}/{timeout}s", f.name(), port_identity(svc, port), ep.addr, ep.port);
    format!("aff{}-{:016x}", fam_digit(f), fnv1a(identity.as_bytes())).into()
}

/// The endpoints a service port uses on this node for one family: ready ones; if none is ready,
/// the serving-and-terminating ones (graceful termination, as kube-proxy does); with
/// `externalTrafficPolicy: Local` only those on this node.
pub fn usable_endpoints<'a>(
    svc: &LbService,
    port: &'a LbPort,
    family: Family,
    node_name: &str,
) -> Vec<&'a Endpoint> {
    let candidates: Vec<&Endpoint> = port
        .endpoints
        .iter()
        .filter(|e| Family::of(&e.addr) == family)
        .filter(|e| svc.traffic_policy == TrafficPolicy::Cluster || e.node_name.as_deref() == Some(node_name))
        .collect();
    let ready: Vec<&Endpoint> = candidates.iter().copied().filter(|e| e.ready).collect();
    if !ready.is_empty() {
        return ready;
    }
    candidates.into_iter().filter(|e| e.serving && e.terminating).collect()
}

fn loopback(f: Family) -> IpNet {
    match f {
        Family::Ipv4 => "127.0.0.0/8".parse().expect("literal"),
        Family::Ipv6 => "::1/128".parse().expect("literal"),
    }
}

/// The per-family dispatch rules: local, non-loopback destination: verdict map lookup by
/// protocol . port (`map`), then, for node ports served on some node addresses only, by
/// address . protocol . port (`address_map`). A node port is in one of the two, never both.
/// Each rule first asks whether the map has the packet's key at all: a packet to any other port
/// (all of the node's other traffic) stops at that hash lookup and never costs a route lookup
/// (`fib`), which still guards every DNAT.
fn dispatch_rules(f: Family, map: Name, address_map: Name) -> [Rule; 2] {
    let guard = |known: Expr, last: Expr| {
        Rule::new(vec![
            Expr::NfProto(f),
            known,
            Expr::DaddrInPrefix { prefix: loopback(f), negate: true },
            Expr::FibDaddrLocal,
            last,
        ])
    };
    [
        guard(Expr::L4ProtoDportInSet { set: map.clone() }, Expr::L4ProtoDportVmap { map }),
        guard(
            Expr::DaddrL4ProtoDportInSet { family: f, set: address_map.clone() },
            Expr::DaddrL4ProtoDportVmap { family: f, map: address_map },
        ),
    ]
}

fn base(name: &str, chain_type: ChainType, hook: Hook, priority: i32, rules: Vec<Rule>) -> Chain {
    Chain { name: name.into(), base: Some(BaseChain { chain_type, hook, priority }), rules, comment: None }
}

fn regular(name: Name, comment: Option<String>, rules: Vec<Rule>) -> Chain {
    Chain { name, base: None, rules, comment }
}

fn port_map(name: Name, kind: SetKind, comment: &str) -> Set {
    Set {
        name,
        key: vec![KeyType::InetProto, KeyType::InetService],
        kind,
        elements: BTreeMap::new(),
        comment: Some(comment.to_string()),
    }
}

fn address_port_map(f: Family, name: Name, comment: &str) -> Set {
    let addr = match f {
        Family::Ipv4 => KeyType::Ipv4Addr,
        Family::Ipv6 => KeyType::Ipv6Addr,
    };
    Set {
        name,
        key: vec![addr, KeyType::InetProto, KeyType::InetService],
        kind: SetKind::VerdictMap,
        elements: BTreeMap::new(),
        comment: Some(comment.to_string()),
    }
}

/// The complete desired ruleset. Families not in `node.families` get their sets but no elements,
/// so nothing of that family is served.
pub fn plan(services: &[ServicePlan<'_>], node: &NodeFacts) -> Ruleset {
    plan_with(services, node, &BTreeMap::new())
}

/// [`plan`], with the node addresses that serve each Service whose node port pool restricts
/// them (`addresses`; a Service not in it is served on every local address). Such a Service's
/// ports are dispatched by address . protocol . port, one element per address of the family;
/// with no address of a family it is not programmed for that family.
pub fn plan_with(
    services: &[ServicePlan<'_>],
    node: &NodeFacts,
    addresses: &BTreeMap<crate::domain::ServiceKey, BTreeSet<IpAddr>>,
) -> Ruleset {
    let mut rs = skeleton(node);
    for sp in services {
        plan_service(&mut rs, sp, addresses.get(&sp.service.key), node);
    }
    rs
}

/// The part of the ruleset that does not depend on the Services: the base chains, the
/// no-endpoints chain, the node-level counters and every dispatch set and map (empty).
pub fn skeleton(node: &NodeFacts) -> Ruleset {
    let mut rs = Ruleset::default();

    // Skeleton: always present, so the table's shape does not depend on the services.
    let mask = u16::from(node.nat_shard_count() - 1);
    for t in node.nat_tables() {
        nat_skeleton(&mut rs, t, mask);
    }
    for f in Family::ALL {
        rs.add_set(port_map(
            forward_counters_map(f),
            SetKind::CounterMap,
            "protocol . node port: counter of forwarded traffic",
        ));
        let addr = match f {
            Family::Ipv4 => KeyType::Ipv4Addr,
            Family::Ipv6 => KeyType::Ipv6Addr,
        };
        // The address twice: `ip saddr . ip saddr . …` (a packet from an endpoint) and
        // `ip saddr . ip daddr . …` (a connection DNATed to its own client) use the same set.
        rs.add_set(Set {
            name: endpoints_set(f),
            key: vec![addr, addr, KeyType::InetProto, KeyType::InetService],
            kind: SetKind::Set,
            elements: BTreeMap::new(),
            comment: Some("address . address . protocol . port of every programmed endpoint".into()),
        });
    }
    let mark = node.masquerade_mark;
    let mut postrouting = vec![Rule::new(vec![Expr::MarkHas(mark), Expr::MarkXor(mark), Expr::Masquerade])];
    // Hairpin: an endpoint that reaches its own Service through the node and is drawn itself
    // would get its own packet from its own address and answer it directly, bypassing the node's
    // conntrack; masqueraded, the answer goes back through the node. Only those connections, so
    // `externalTrafficPolicy: Local` keeps the address of a client sent to another endpoint.
    for f in Family::ALL {
        postrouting.push(Rule::new(vec![
            Expr::NfProto(f),
            Expr::CtStatusDnat,
            Expr::SaddrDaddrL4ProtoDportInSet { family: f, set: endpoints_set(f) },
            Expr::Masquerade,
        ]));
    }
    rs.add_chain(base(
        CHAIN_NAT_POSTROUTING,
        ChainType::Nat,
        Hook::Postrouting,
        priority::SRCNAT,
        postrouting,
    ));
    plan_forward(&mut rs, node);
    rs
}

/// The nat part of the skeleton in table `t` (the main one, or each shard): the dispatch maps,
/// the nat base chains using them and the no-endpoints chain. A shard's base chains see every
/// new connection as the main table's would: their first rule lets go every packet to a port
/// of another shard (`th dport & mask != k`, no lookup); the kernel's NAT stops at the first
/// nat chain of a hook that translates a connection, and a node port is in one shard only.
fn nat_skeleton(rs: &mut Ruleset, t: Table, mask: u16) {
    let name = |n: Name| in_table(t, &n);
    for f in Family::ALL {
        rs.add_set(port_map(
            name(service_ports_map(f)),
            SetKind::VerdictMap,
            "protocol . node port: service chain (DNAT)",
        ));
        rs.add_set(port_map(
            name(firewall_ports_map(f)),
            SetKind::VerdictMap,
            "protocol . node port: source-range check / no-endpoint reject",
        ));
        rs.add_set(address_port_map(
            f,
            name(service_address_ports_map(f)),
            "node address . protocol . node port (pools with addresses): service chain (DNAT)",
        ));
        rs.add_set(address_port_map(
            f,
            name(firewall_address_ports_map(f)),
            "node address . protocol . node port (pools with addresses): source-range check / no-endpoint reject",
        ));
    }
    // The firewall (source ranges, the no-endpoint reject) first, then the DNAT dispatch, in the
    // nat chains: they see only a connection's first packet, which is all the firewall judges, so
    // no other packet of the node pays a hook or a rule for it (a filter chain would be one more
    // hook on every packet the node receives or sends).
    let guard = match t {
        Table::Main => None,
        Table::Shard(k) => Some(Rule::new(vec![
            Expr::DportMaskIsNot { mask, value: u16::from(k) },
            Expr::Verdict(Verdict::Return),
        ])),
    };
    let nat_dispatch: Vec<Rule> =
        guard
            .into_iter()
            .chain(Family::ALL.iter().flat_map(|&f| {
                dispatch_rules(f, name(firewall_ports_map(f)), name(firewall_address_ports_map(f)))
            }))
            .chain(Family::ALL.iter().flat_map(|&f| {
                dispatch_rules(f, name(service_ports_map(f)), name(service_address_ports_map(f)))
            }))
            .collect();
    rs.add_chain(base(
        &in_table(t, CHAIN_NAT_PREROUTING),
        ChainType::Nat,
        Hook::Prerouting,
        priority::DSTNAT,
        nat_dispatch.clone(),
    ));
    rs.add_chain(base(
        &in_table(t, CHAIN_NAT_OUTPUT),
        ChainType::Nat,
        Hook::Output,
        priority::DSTNAT,
        nat_dispatch,
    ));
    rs.add_chain(regular(
        in_table(t, CHAIN_NO_ENDPOINTS),
        Some("service port has no usable endpoint: refuse, never black-hole".into()),
        vec![
            Rule::new(vec![Expr::L4Proto(Protocol::Tcp), Expr::RejectTcpReset]),
            Rule::new(vec![Expr::RejectIcmpPortUnreachable]),
        ],
    ));
}

/// Adds one Service's part to `rs` (a [`skeleton`] and what other Services added): its chains,
/// counters and affinity sets, and its elements of the skeleton's sets. `restricted`: the node
/// addresses serving it when its pool restricts them.
pub fn plan_service(
    rs: &mut Ruleset,
    sp: &ServicePlan<'_>,
    restricted: Option<&BTreeSet<IpAddr>>,
    node: &NodeFacts,
) {
    for port in &sp.service.ports {
        let Some(&node_port) = sp.node_ports.get(&port.id) else { continue };
        for &f in &sp.service.families {
            if let Some(on) = served_on(restricted, f, node) {
                let names = PortNames::on(f, sp.service, port, node_port, node);
                let at = Dispatch {
                    port: (port.id.protocol, node_port),
                    addresses: on.as_deref(),
                    table: names.table(),
                };
                plan_port(rs, sp.service, port, names, &at, f, node);
            }
        }
    }
}

/// Whether a Service port of family `f` is programmed on this node, and on which of its
/// addresses (`None`: every local address): the family is forwarded here and, when a pool
/// restricts the Service's addresses, one of them is of this family.
fn served_on(
    restricted: Option<&BTreeSet<IpAddr>>,
    f: Family,
    node: &NodeFacts,
) -> Option<Option<Vec<IpAddr>>> {
    let on: Option<Vec<IpAddr>> =
        restricted.map(|a| a.iter().copied().filter(|a| Family::of(a) == f).collect());
    (node.families.contains(&f) && on.as_ref().is_none_or(|a| !a.is_empty())).then_some(on)
}

/// The forward path: `filter-forward` runs before every other forward chain of the node
/// (priority [`priority::FIRST`]) and `filter-forward-last` after all of them
/// ([`priority::LAST`]), so the two node-level counters bracket whatever a host firewall does in
/// between: new connections of our Services that entered the forward path, and those that left it.
/// Entered but never left, while nothing passes, is the evidence of a drop after our chain that
/// netlink cannot show (iptables-legacy). Per-Service traffic is counted last, so it counts what
/// was really forwarded. With `forward_mark`, our flows carry that mark bit between the two
/// chains (set first, cleared last): the accept nodelb inserts into the host's iptables FORWARD
/// chain matches it.
///
/// Our flows are the connections our nat chains DNATed: they carry the connection mark
/// ([`NodeFacts::connection_mark`], set with the DNAT), and their original destination port is
/// one of our node ports. A port number alone is not enough: another component's DNATed flow (a
/// ClusterIP on 443, a Docker published port) may use the same one. A forward mark bit a packet
/// already carries is not trusted: it is cleared before ours are marked.
fn plan_forward(rs: &mut Ruleset, node: &NodeFacts) {
    let ours = |f: Family| {
        vec![
            Expr::NfProto(f),
            Expr::CtMarkHas(node.connection_mark),
            Expr::CtStatusDnat,
            Expr::L4ProtoCtOrigDportInSet { set: forward_counters_map(f) },
        ]
    };
    let new_ours = |f: Family| {
        vec![
            Expr::NfProto(f),
            Expr::CtMarkHas(node.connection_mark),
            Expr::CtStatusDnat,
            Expr::CtState(Box::new([CtState::New])),
            Expr::L4ProtoCtOrigDportInSet { set: forward_counters_map(f) },
        ]
    };
    // Most packets of the forward path belong to established flows, for which only the
    // per-packet work (the mark, the traffic counters) is to be done: the gate ends our chain
    // for them after one conntrack test instead of every rule's (an accept in our table ends
    // only our own chain).
    let established = || {
        Rule::new(vec![
            Expr::CtState(Box::new([CtState::Established, CtState::Related])),
            Expr::Verdict(Verdict::Accept),
        ])
    };
    let (mut first, mut last) = (Vec::new(), Vec::new());
    if let Some(bit) = node.forward_mark {
        first.push(Rule::new(vec![Expr::MarkHas(bit), Expr::MarkClear(bit)]));
    }
    for f in Family::ALL {
        if let Some(bit) = node.forward_mark {
            first.push(Rule::new([ours(f), vec![Expr::MarkSet(bit)]].concat()));
        }
        // Counted per service port without a chain per Service (every chain a verdict map
        // reaches is re-validated by the kernel in each transaction that adds a Service).
        let mut count = vec![
            Expr::NfProto(f),
            Expr::CtMarkHas(node.connection_mark),
            Expr::CtStatusDnat,
            Expr::L4ProtoCtOrigDportCounterMap { map: forward_counters_map(f) },
        ];
        if let Some(bit) = node.forward_mark {
            count.push(Expr::MarkClear(bit));
        }
        last.push(Rule::new(count));
    }
    first.push(established());
    last.push(established());
    for f in Family::ALL {
        // A reply that conntrack finds out of window would leave un-NATed (the kube-proxy
        // `ct state invalid drop` fix), scoped to packets from our endpoints.
        first.push(Rule::new(vec![
            Expr::NfProto(f),
            Expr::CtState(Box::new([CtState::Invalid])),
            Expr::SaddrTwiceL4ProtoSportInSet { family: f, set: endpoints_set(f) },
            Expr::Counter,
            Expr::Verdict(Verdict::Drop),
        ]));
        rs.add_counter(NamedCounter {
            name: forward_entered_counter(f),
            comment: Some(format!("new {f} connections of nodelb Services entering the forward path")),
        });
        rs.add_counter(NamedCounter {
            name: forward_passed_counter(f),
            comment: Some(format!("new {f} connections of nodelb Services leaving the forward path")),
        });
        first.push(Rule::new([new_ours(f), vec![Expr::CounterRef(forward_entered_counter(f))]].concat()));
        last.push(Rule::new([new_ours(f), vec![Expr::CounterRef(forward_passed_counter(f))]].concat()));
    }
    rs.add_chain(base(CHAIN_FILTER_FORWARD, ChainType::Filter, Hook::Forward, priority::FIRST, first));
    rs.add_chain(base(CHAIN_FILTER_FORWARD_LAST, ChainType::Filter, Hook::Forward, priority::LAST, last));
}

/// Where a service port is dispatched: its protocol and node port, on every local address
/// (`addresses: None`) or on these only.
struct Dispatch<'a> {
    port: (Protocol, u16),
    addresses: Option<&'a [IpAddr]>,
    /// The table whose dispatch maps take the port (its nat part's).
    table: Table,
}

impl Dispatch<'_> {
    /// Puts `verdict` in the firewall (`firewall: true`) or service dispatch map of family `f`.
    fn insert(&self, rs: &mut Ruleset, f: Family, firewall: bool, verdict: Verdict) {
        let (proto, port) = self.port;
        let mapped = Mapped::Verdict(verdict);
        match self.addresses {
            None => {
                let map = if firewall { firewall_ports_map(f) } else { service_ports_map(f) };
                let map = in_table(self.table, &map);
                insert_element(rs, &map, Key::proto_port(proto, port), mapped);
            }
            Some(addrs) => {
                let map = if firewall { firewall_address_ports_map(f) } else { service_address_ports_map(f) };
                let map = in_table(self.table, &map);
                for a in addrs {
                    insert_element(rs, &map, Key::addr_proto_port(*a, proto, port), mapped.clone());
                }
            }
        }
    }
}

fn plan_port(
    rs: &mut Ruleset,
    svc: &LbService,
    port: &LbPort,
    names: PortNames<'_>,
    at: &Dispatch<'_>,
    f: Family,
    node: &NodeFacts,
) {
    let node_port = at.port.1;
    let key = Key::proto_port(port.id.protocol, node_port);
    let no_endpoints = in_table(names.table(), CHAIN_NO_ENDPOINTS);
    let comment = |what: &str| Some(names.port_comment(node_port, what));
    let endpoints = usable_endpoints(svc, port, f, &node.node_name);

    // Source ranges and the no-endpoint reject run in the nat chains, before their DNAT dispatch.
    let ranges: Vec<&IpNet> = svc.source_ranges.iter().filter(|r| Family::of(&r.addr()) == f).collect();
    let after_allowed =
        if endpoints.is_empty() { Verdict::Goto(no_endpoints.clone()) } else { Verdict::Return };
    // A counter's comment never changes for its name (no node port in it): the diff only adds
    // and deletes counters, it never rewrites one.
    let counter = |name: Name, what: &str| NamedCounter { name, comment: Some(names.counter_comment(what)) };
    let connections = names.connections_counter();
    rs.add_counter(counter(connections.clone(), "new connections"));
    let forwarded = names.forwarded_counter();
    rs.add_counter(counter(forwarded.clone(), "forwarded traffic"));
    if !svc.source_ranges.is_empty() {
        // Ranges of the other family only ⇒ nobody of this family is allowed: fail closed.
        let refused = names.refused_counter();
        rs.add_counter(counter(refused.clone(), "refused by source ranges"));
        let fw = names.firewall_chain(node_port);
        let mut rules: Vec<Rule> = ranges
            .iter()
            .map(|r| {
                Rule::new(vec![
                    Expr::SaddrInPrefix { prefix: **r, negate: false },
                    Expr::Verdict(after_allowed.clone()),
                ])
            })
            .collect();
        rules.push(Rule::new(vec![Expr::CounterRef(refused), Expr::Verdict(Verdict::Drop)]));
        rs.add_chain(regular(fw.clone(), comment(": source ranges"), rules));
        // `jump`: an allowed client returns to the nat chain, whose next rules DNAT it.
        at.insert(rs, f, true, Verdict::Jump(fw));
    } else if endpoints.is_empty() {
        at.insert(rs, f, true, Verdict::Goto(no_endpoints));
    }
    if endpoints.is_empty() {
        return;
    }

    if let Some(set) = rs.sets.get_mut(&endpoints_set(f)) {
        for ep in &endpoints {
            set.elements.insert(Key::addrs_proto_port(ep.addr, ep.addr, port.id.protocol, ep.port), None);
        }
    }
    // Count and mark for masquerade, then one DNAT rule per endpoint, picked by independent draws
    // (`Expr::NumgenRandomIs`). No chain per endpoint: every chain a verdict map reaches is walked
    // by the kernel's loop check in each transaction that adds a jump. No map per service either:
    // the kernel binds each anonymous set in time linear in the transaction and each map lookup
    // walks every element of a shared map, both quadratic over a full sync
    // (docs/design/dispatch.md, "Why not a chain per endpoint, or a numgen map").
    // Vectors sized up front: the ruleset is kept until the next sync (vectors grown by doubling
    // would keep their spare capacity, for every Service, until then).
    let mut first = Vec::with_capacity(3);
    first.push(Expr::CounterRef(connections));
    // The connection is ours from here on: the forward chains know it by this mark.
    first.push(Expr::CtMarkSet(node.connection_mark));
    if svc.traffic_policy == TrafficPolicy::Cluster {
        first.push(Expr::MarkSet(node.masquerade_mark));
    }
    let rules = match svc.session_affinity {
        None => draw_rules(first, port, &endpoints),
        Some(timeout) => affinity_rules(rs, first, svc, &names, port, &endpoints, f, timeout),
    };
    let svc_chain = names.service_chain(node_port);
    rs.add_chain(regular(svc_chain.clone(), comment(""), rules));
    at.insert(rs, f, false, Verdict::Goto(svc_chain));
    insert_element(rs, &forward_counters_map(f), key, Mapped::Counter(forwarded));
}

/// `meta l4proto <p> dnat to <endpoint>` (nft needs the transport protocol known before a DNAT
/// with a port).
fn dnat(port: &LbPort, ep: &Endpoint) -> [Expr; 2] {
    [Expr::L4Proto(port.id.protocol), Expr::Dnat { addr: ep.addr, port: ep.port }]
}

/// `first` (count, mark), then one DNAT rule per endpoint picked by the draw cascade
/// ([`Expr::NumgenRandomIs`]); with one endpoint, a single rule.
fn draw_rules(first: Vec<Expr>, port: &LbPort, endpoints: &[&Endpoint]) -> Vec<Rule> {
    match endpoints {
        [one] => vec![Rule::new(first.into_iter().chain(dnat(port, one)).collect())],
        many => {
            let n = many.len() as u32;
            let mut rules = Vec::with_capacity(many.len() + 1);
            rules.push(Rule::new(first));
            for (i, ep) in many.iter().enumerate() {
                let left = n - i as u32;
                let draw = (left > 1).then_some(Expr::NumgenRandomIs { modulus: left, value: 0 });
                rules.push(Rule::new(draw.into_iter().chain(dnat(port, ep)).collect()));
            }
            rules
        }
    }
}

/// `sessionAffinity: ClientIP`: a dynamic set per endpoint of the clients it served last
/// (`aff<4|6>-…`, created here, timeout `timeout`). After `first`: a client found in an
/// endpoint's set goes there again (and its timeout restarts); any other client is drawn as
/// without affinity, and the draw records it in the chosen endpoint's set. The last endpoint's
/// update is a rule of its own: `update` does not match when the set is full (65,535 clients), and
/// then the last rule must still DNAT (a full set of an earlier endpoint only makes its draw rule
/// fall through to the next draw). An endpoint that goes takes its set, and its affinities, with it.
#[allow(clippy::too_many_arguments)]
fn affinity_rules(
    rs: &mut Ruleset,
    first: Vec<Expr>,
    svc: &LbService,
    names: &PortNames<'_>,
    port: &LbPort,
    endpoints: &[&Endpoint],
    f: Family,
    timeout: u32,
) -> Vec<Rule> {
    let key = match f {
        Family::Ipv4 => KeyType::Ipv4Addr,
        Family::Ipv6 => KeyType::Ipv6Addr,
    };
    let sets: Vec<Name> = endpoints.iter().map(|ep| names.affinity_set(svc, ep, timeout)).collect();
    for (set, ep) in sets.iter().zip(endpoints) {
        rs.add_set(Set {
            name: set.clone(),
            key: vec![key],
            kind: SetKind::Dynamic { timeout },
            elements: BTreeMap::new(),
            comment: Some(identity_comment(svc, &format!(" {}: clients of {}", port.id, endpoint_text(ep)))),
        });
    }
    let update = |set: &Name| Expr::UpdateSaddr { family: f, set: set.clone() };
    let n = endpoints.len();
    let mut rules = Vec::with_capacity(2 * n + 2);
    rules.push(Rule::new(first));
    if n > 1 {
        for (set, ep) in sets.iter().zip(endpoints) {
            let known = [Expr::SaddrInSet { family: f, set: set.clone() }, update(set)];
            rules.push(Rule::new(known.into_iter().chain(dnat(port, ep)).collect()));
        }
    }
    for (i, (set, ep)) in sets.iter().zip(endpoints).enumerate() {
        let left = (n - i) as u32;
        if left > 1 {
            let draw = [Expr::NumgenRandomIs { modulus: left, value: 0 }, update(set)];
            rules.push(Rule::new(draw.into_iter().chain(dnat(port, ep)).collect()));
        } else {
            rules.push(Rule::new(vec![update(set)]));
            rules.push(Rule::new(dnat(port, ep).to_vec()));
        }
    }
    rules
}

/// `198.51.100.11:8080`, `[2001:db8::1]:8080`.
fn endpoint_text(ep: &Endpoint) -> String {
    std::net::SocketAddr::new(ep.addr, ep.port).to_string()
}

fn insert_element(rs: &mut Ruleset, set: &str, key: Key, value: Mapped) {
    if let Some(set) = rs.sets.get_mut(set) {
        set.elements.insert(key, Some(value));
    }
}

/// Whether going from `old` to `new` changes a base chain's hook, a set's type or the tables
/// (another `--nat-shards`), which an incremental update cannot express: then only a full
/// replace will do.
pub fn needs_full_replace(old: &Ruleset, new: &Ruleset) -> bool {
    old.tables() != new.tables()
        || old.chains.iter().any(|(name, c)| new.chains.get(name).is_some_and(|n| n.base != c.base))
        || old
            .sets
            .iter()
            .any(|(name, s)| new.sets.get(name).is_some_and(|n| n.key != s.key || n.kind != s.kind))
}

/// Changes that turn the kernel state `old` (as we last programmed and verified it) into `new`.
/// Falls back to [`Ruleset::full_replace`] when a base chain or a set's type changes, which an
/// incremental update cannot express. Order within the batch:
/// new chains → new counters → new sets → rules of new/changed chains → element removals → element
/// additions → flush then delete removed chains → delete removed sets → delete removed counters
/// (references are gone before deletions).
pub fn diff(old: &Ruleset, new: &Ruleset) -> Vec<Change> {
    if needs_full_replace(old, new) {
        return new.full_replace();
    }

    // Each map walked once, old and new side by side in name order (a lookup per name each way
    // would be most of a one-Service diff).
    let chains = join(&old.chains, &new.chains);
    let counters = join(&old.counters, &new.counters);
    let sets = join(&old.sets, &new.sets);
    let mut changes = Vec::new();
    for (_, _, chain) in chains.iter().filter(|(_, o, _)| o.is_none()) {
        changes.extend(chain.map(|c| Change::AddChain(c.header())));
    }
    for (_, _, counter) in counters.iter().filter(|(_, o, _)| o.is_none()) {
        changes.extend(counter.map(|c| Change::AddCounter(c.clone())));
    }
    for (_, _, set) in sets.iter().filter(|(_, o, _)| o.is_none()) {
        changes.extend(set.map(|s| Change::AddSet(s.clone())));
    }
    for (name, o, chain) in &chains {
        match (o, chain) {
            (Some(o), Some(chain)) if o.rules == chain.rules => {}
            (Some(_), Some(chain)) => {
                changes.push(Change::FlushChain((*name).clone()));
                push_rules(&mut changes, chain);
            }
            (None, Some(chain)) => push_rules(&mut changes, chain),
            (_, None) => {}
        }
    }
    let empty = BTreeMap::new();
    let mut additions = Vec::new();
    for (name, o, set) in &sets {
        let Some(set) = set else { continue };
        let old_elems = o.map(|s| &s.elements).unwrap_or(&empty);
        let mut removed = Vec::new();
        let mut added = Vec::new();
        for (key, was, is) in join(old_elems, &set.elements) {
            if was != is {
                if was.is_some() {
                    removed.push(*key);
                }
                if let Some(v) = is {
                    added.push((*key, v.clone()));
                }
            }
        }
        if !removed.is_empty() {
            changes.push(Change::DeleteElements { set: (*name).clone(), keys: removed });
        }
        if !added.is_empty() {
            additions.push(Change::AddElements { set: (*name).clone(), elements: added });
        }
    }
    changes.extend(additions);
    let gone: Vec<(&Name, &Chain)> = chains
        .iter()
        .filter_map(|&(name, o, n)| match (o, n) {
            (Some(o), None) => Some((name, o)),
            _ => None,
        })
        .collect();
    for (name, chain) in &gone {
        if !chain.rules.is_empty() {
            changes.push(Change::FlushChain((*name).clone()));
        }
    }
    for (name, _) in gone {
        changes.push(Change::DeleteChain(name.clone()));
    }
    for (name, _, _) in sets.iter().filter(|(_, _, n)| n.is_none()) {
        changes.push(Change::DeleteSet((*name).clone()));
    }
    for (name, _, _) in counters.iter().filter(|(_, _, n)| n.is_none()) {
        changes.push(Change::DeleteCounter((*name).clone()));
    }
    changes
}

/// Every key of `old` or `new`, in order, with its value on each side: one walk over both.
fn join<'a, K: Ord, V>(
    old: &'a BTreeMap<K, V>,
    new: &'a BTreeMap<K, V>,
) -> Vec<(&'a K, Option<&'a V>, Option<&'a V>)> {
    use std::cmp::Ordering;
    let mut out = Vec::with_capacity(old.len().max(new.len()));
    let (mut o, mut n) = (old.iter().peekable(), new.iter().peekable());
    loop {
        let order = match (o.peek(), n.peek()) {
            (None, None) => break,
            (Some(_), None) => Ordering::Less,
            (None, Some(_)) => Ordering::Greater,
            (Some((ok, _)), Some((nk, _))) => ok.cmp(nk),
        };
        match order {
            Ordering::Less => out.extend(o.next().map(|(k, v)| (k, Some(v), None))),
            Ordering::Greater => out.extend(n.next().map(|(k, v)| (k, None, Some(v)))),
            Ordering::Equal => {
                if let (Some((k, ov)), Some((_, nv))) = (o.next(), n.next()) {
                    out.push((k, Some(ov), Some(nv)));
                }
            }
        }
    }
    out
}

fn push_rules(changes: &mut Vec<Change>, chain: &Chain) {
    for rule in &chain.rules {
        changes.push(Change::AddRule { chain: chain.name.clone(), rule: rule.clone() });
    }
}

/// A UDP backend reachable through a node port: (node port, endpoint address, endpoint port).
pub type UdpBackend = (u16, IpAddr, u16);

/// Every UDP (node port → endpoint) pair a ruleset programs, read from the IR itself: the
/// `service-ports-*` maps lead to service chains, whose DNAT rules name the endpoints.
pub fn udp_backends(rs: &Ruleset) -> BTreeSet<UdpBackend> {
    let mut out = BTreeSet::new();
    let maps = rs.tables().into_iter().flat_map(|t| {
        Family::ALL.into_iter().flat_map(move |f| {
            [in_table(t, &service_ports_map(f)), in_table(t, &service_address_ports_map(f))]
        })
    });
    for name in maps {
        let Some(map) = rs.sets.get(&name) else { continue };
        for (key, verdict) in &map.elements {
            // protocol . port, or address . protocol . port
            let tail = key.parts().skip_while(|k| matches!(k, KeyPart::Addr(_)));
            let [KeyPart::Proto(Protocol::Udp), KeyPart::Port(node_port)] = tail.collect::<Vec<_>>()[..]
            else {
                continue;
            };
            let Some(Mapped::Verdict(Verdict::Goto(svc))) = verdict else { continue };
            let rules = rs.chains.get(svc).map(|c| c.rules.as_slice()).unwrap_or_default();
            for e in rules.iter().flat_map(|r| &r.exprs) {
                if let Expr::Dnat { addr, port } = e {
                    out.insert((node_port, *addr, *port));
                }
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `--nat-shards auto`: (ports, current shards) → shards. Up at once, down only well below.
    #[test]
    fn auto_nat_shards_grow_at_once_and_shrink_with_hysteresis() {
        let max = crate::ruleset::ir::MAX_NAT_SHARDS;
        #[rustfmt::skip]
        let cases: &[(usize, u8, u8)] = &[
            (0, 1, 1), (1_000, 1, 1), (1_001, 1, 2), (2_001, 1, 4), (10_000, 1, 16),
            (10_000, 4, 16), (16_001, 16, 32), (50_000, 1, max), (1_000_000, max, max),
            // Down: only once the ports would fill a quarter of the current shards.
            (10_000, 32, 32), (8_001, 32, 32), (8_000, 32, 8), (5_000, 16, 16), (4_000, 16, 4),
            (999, 2, 2), (500, 2, 1), (0, 16, 1),
            // Just above a boundary and back just below it: no move back.
            (4_001, 4, 8), (4_000, 8, 8), (2_000, 8, 2),
            // A current count out of range counts as its clamp.
            (0, 0, 1), (10, 200, 1),
        ];
        for &(ports, current, want) in cases {
            assert_eq!(auto_nat_shards(ports, current), want, "{ports} ports, {current} shards now");
        }
        // Every result is a power of two the node can have, and stable: asked again, the same.
        for ports in (0..70_000).step_by(250) {
            for current in [1u8, 2, 4, 8, 16, 32] {
                let k = auto_nat_shards(ports, current);
                assert!(k.is_power_of_two() && k <= max, "{ports}, {current}: {k}");
                assert_eq!(auto_nat_shards(ports, k), k, "{ports} ports: {current} → {k} is not stable");
            }
        }
    }
}
