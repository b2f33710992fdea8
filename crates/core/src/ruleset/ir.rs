//! The nftables intermediate representation: the complete desired ruleset of the `nodelb` table as
//! plain data with stable names, plus its rendering in `nft` syntax (for golden tests, humans and the
//! `nft -f` benchmark). The planner produces it, the `nft` module encodes it into netlink, and the
//! tracer evaluates it. Expressions sit at the level of nft statements (`ip saddr 192.0.2.0/24`), not
//! registers: lowering to kernel expressions is the encoder's job.

use std::collections::BTreeMap;
use std::fmt::{self, Write as _};
use std::net::IpAddr;

use ipnet::IpNet;

use crate::domain::{Family, Protocol};

/// The name of a chain, set, map or named counter. Shared, not copied: a ruleset names each
/// object in its map's key, in the object and in every rule and element that refers to it (a
/// service port's chain in the dispatch map, its counters in its first rule and the forward
/// counter map), and the counter index names its counters again; copies would hold each name's
/// bytes several times in the agent's heap. A thin pointer (`arcstr`: the length
/// lives with the count and the bytes), so that a `Verdict` naming a chain is 16 bytes and an
/// `Expr` 24, where `Arc<str>`'s pointer and length would make them 24 and 32.
pub type Name = arcstr::ArcStr;

/// The table nodelb always owns (`inet`, so one table serves IPv4 and IPv6): everything, or with
/// the nat chains sharded ([`Table::Shard`]) everything but them.
pub const TABLE_NAME: &str = "nodelb";

/// The most nat shard tables a node may have (`--nat-shards`). A full replace deletes every one
/// of them that exists, whatever the shard count before it was.
pub const MAX_NAT_SHARDS: u8 = 32;

/// A table nodelb owns. With its nat chains sharded (docs/design/dispatch.md, "Sharding the nat
/// chains") each Service port's nat part (its chains, connection and refused counters, affinity
/// sets and dispatch elements) lives in shard table `nodelb-s<k>`, with that shard's own base
/// chains and dispatch maps, because the kernel validates only the tables a transaction changes.
///
/// An object's table is part of its name: a shard's objects are named `s<k>.<name>`, in the
/// kernel as in the IR ([`Table::of_name`]), so names stay unique across tables, a [`Ruleset`]
/// holds every table, and a change names its object as before.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Table {
    Main,
    Shard(u8),
}

impl Table {
    /// The table's kernel name: `nodelb`, `nodelb-s<k>`.
    pub fn name(self) -> String {
        match self {
            Table::Main => TABLE_NAME.to_string(),
            Table::Shard(k) => format!("{TABLE_NAME}-s{k}"),
        }
    }

    /// The table of an inet table name, if nodelb owns it.
    pub fn of_table_name(name: &str) -> Option<Table> {
        if name == TABLE_NAME {
            return Some(Table::Main);
        }
        let k = name.strip_prefix(TABLE_NAME)?.strip_prefix("-s")?;
        shard_number(k)
    }

    /// The table an object named `name` lives in.
    pub fn of_name(name: &str) -> Table {
        name.strip_prefix('s')
            .and_then(|rest| rest.split_once('.'))
            .and_then(|(k, _)| shard_number(k))
            .unwrap_or(Table::Main)
    }

    /// What a shard's object names start with (`s<k>.`); nothing for the main table.
    pub fn prefix(self) -> String {
        match self {
            Table::Main => String::new(),
            Table::Shard(k) => format!("s{k}."),
        }
    }

    /// Every table nodelb may own, the main one first.
    pub fn all() -> impl Iterator<Item = Table> + Clone {
        std::iter::once(Table::Main).chain((0..MAX_NAT_SHARDS).map(Table::Shard))
    }
}

/// `k` as a shard number: digits only, no leading zero, below [`MAX_NAT_SHARDS`].
fn shard_number(k: &str) -> Option<Table> {
    if k.is_empty() || !k.bytes().all(|b| b.is_ascii_digit()) || (k.len() > 1 && k.starts_with('0')) {
        return None;
    }
    k.parse::<u8>().ok().filter(|&k| k < MAX_NAT_SHARDS).map(Table::Shard)
}

/// Netfilter hooks used by base chains.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Hook {
    Prerouting,
    Input,
    Forward,
    Output,
    Postrouting,
}

impl Hook {
    /// NF_INET_* hook number.
    pub fn number(self) -> u32 {
        match self {
            Hook::Prerouting => 0,
            Hook::Input => 1,
            Hook::Forward => 2,
            Hook::Output => 3,
            Hook::Postrouting => 4,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Hook::Prerouting => "prerouting",
            Hook::Input => "input",
            Hook::Forward => "forward",
            Hook::Output => "output",
            Hook::Postrouting => "postrouting",
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum ChainType {
    Filter,
    Nat,
}

impl ChainType {
    pub fn name(self) -> &'static str {
        match self {
            ChainType::Filter => "filter",
            ChainType::Nat => "nat",
        }
    }
}

/// Well-known priorities (include/uapi/linux/netfilter_ipv4.h).
/// nodelb's base chain priorities. At one priority the kernel runs the chain registered last
/// first, so a chain that shared its priority with another component's would run before or
/// after it depending on which started first. Each sits one step from a conventional value,
/// never on it: nodelb's place among the others is the same whatever the start order.
pub mod priority {
    /// Just before `dstnat` (-100), where iptables' and kube-proxy's nat chains are: nodelb
    /// decides first about its own node ports.
    pub const DSTNAT: i32 = -101;
    pub const FILTER: i32 = 0;
    /// Just before `srcnat` (100): nodelb's masquerade of what it DNATed comes first.
    pub const SRCNAT: i32 = 99;
    /// Before every other chain of the hook but one at `NF_IP_PRI_FIRST` itself.
    pub const FIRST: i32 = i32::MIN + 1;
    /// After every other chain of the hook but one at `NF_IP_PRI_LAST` itself.
    pub const LAST: i32 = i32::MAX - 1;
}

#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct BaseChain {
    pub chain_type: ChainType,
    pub hook: Hook,
    pub priority: i32,
}

#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Chain {
    pub name: Name,
    /// `None` for regular chains reached by jump/goto/vmap.
    pub base: Option<BaseChain>,
    pub rules: Vec<Rule>,
    pub comment: Option<String>,
}

impl Chain {
    /// The chain without its rules (what [`Change::AddChain`] carries).
    pub fn header(&self) -> Chain {
        Chain {
            name: self.name.clone(),
            base: self.base.clone(),
            rules: Vec::new(),
            comment: self.comment.clone(),
        }
    }
}

/// A rule: its statements, in order. Boxed slices rather than vectors: a kept ruleset holds
/// several rules per Service and endpoint, and a vector's capacity field (and any spare capacity)
/// would be 16 bytes and more of each. The comment (the planner writes none) is a thin pointer: 8
/// bytes of every rule, not 16.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Rule {
    pub exprs: Box<[Expr]>,
    pub comment: Option<Name>,
}

impl Rule {
    pub fn new(exprs: Vec<Expr>) -> Rule {
        Rule { exprs: exprs.into_boxed_slice(), comment: None }
    }

    pub fn with_comment(mut self, comment: impl Into<Name>) -> Rule {
        self.comment = Some(comment.into());
        self
    }

    /// Chains the rule sends packets to (its goto/jump verdict).
    pub fn targets(&self) -> impl Iterator<Item = &Name> {
        self.exprs.iter().filter_map(|e| match e {
            Expr::Verdict(Verdict::Goto(c) | Verdict::Jump(c)) => Some(c),
            _ => None,
        })
    }

    /// Sets and maps the rule looks up or updates.
    pub fn sets(&self) -> impl Iterator<Item = &Name> {
        self.exprs.iter().filter_map(|e| match e {
            Expr::L4ProtoDportVmap { map }
            | Expr::DaddrL4ProtoDportVmap { map, .. }
            | Expr::L4ProtoCtOrigDportVmap { map }
            | Expr::L4ProtoCtOrigDportCounterMap { map } => Some(map),
            Expr::SaddrTwiceL4ProtoSportInSet { set, .. }
            | Expr::L4ProtoDportInSet { set }
            | Expr::DaddrL4ProtoDportInSet { set, .. }
            | Expr::SaddrDaddrL4ProtoDportInSet { set, .. }
            | Expr::SaddrInSet { set, .. }
            | Expr::UpdateSaddr { set, .. } => Some(set),
            _ => None,
        })
    }

    /// Named counters the rule counts in by name.
    pub fn counters(&self) -> impl Iterator<Item = &Name> {
        self.exprs.iter().filter_map(|e| match e {
            Expr::CounterRef(c) => Some(c),
            _ => None,
        })
    }
}

/// A verdict, as a rule's final statement or as the data of a verdict map element.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Verdict {
    Accept,
    Drop,
    Return,
    Jump(Name),
    Goto(Name),
}

/// Conntrack states (`ct state`), as the bits the kernel uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum CtState {
    Invalid,
    Established,
    Related,
    New,
}

impl CtState {
    /// NF_CT_STATE_*_BIT.
    pub fn bit(self) -> u32 {
        match self {
            CtState::Invalid => 1,
            CtState::Established => 1 << 1,
            CtState::Related => 1 << 2,
            CtState::New => 1 << 3,
        }
    }
}

/// One statement of a rule. Matches stop evaluation of the rule when they do not match;
/// statements act; a verdict ends the rule.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Expr {
    /// `meta nfproto ipv4`
    NfProto(Family),
    /// `meta l4proto tcp`
    L4Proto(Protocol),
    /// `fib daddr type local`
    FibDaddrLocal,
    /// `ip saddr 192.0.2.0/24` (family implied by the prefix); `negate` gives `!=`.
    SaddrInPrefix { prefix: IpNet, negate: bool },
    /// `ip daddr 127.0.0.0/8`; `negate` gives `!=`.
    DaddrInPrefix { prefix: IpNet, negate: bool },
    /// `ct state new` (any of the listed states)
    CtState(Box<[CtState]>),
    /// `ct status dnat`
    CtStatusDnat,
    /// `meta mark & bit == bit`
    MarkHas(u32),
    /// `ct mark & bit == bit`: the connection carries the bit.
    CtMarkHas(u32),
    /// `ct mark set ct mark | bit`: mark the connection (every packet of it carries the bit).
    CtMarkSet(u32),
    /// `th dport & mask != value`: the packet's destination port is not one of a nat shard's
    /// ([`Table::Shard`]: the shard of a node port is its low bits). Two bytes of the transport
    /// header, whatever the protocol; a packet without one does not match.
    DportMaskIsNot { mask: u16, value: u16 },
    /// `meta mark set mark | bit`
    MarkSet(u32),
    /// `meta mark set mark ^ bit` (clears a bit known to be set)
    MarkXor(u32),
    /// `meta mark set meta mark & ~bit` (clears a bit, set or not)
    MarkClear(u32),
    /// `counter` (packets and bytes, anonymous: reset when the rule is replaced)
    Counter,
    /// `counter name "NAME"`: count in the named counter object NAME (read back for metrics).
    CounterRef(Name),
    /// `meta l4proto . th dport vmap @map`
    L4ProtoDportVmap { map: Name },
    /// `meta l4proto . th dport @set`: membership only (a set or a map), no verdict.
    L4ProtoDportInSet { set: Name },
    /// `<family> daddr . meta l4proto . th dport @set`: membership only (a set or a map).
    DaddrL4ProtoDportInSet { family: Family, set: Name },
    /// `<family> daddr . meta l4proto . th dport vmap @map`: the node port of a pool that
    /// restricts node addresses, keyed by each address that serves it.
    DaddrL4ProtoDportVmap { family: Family, map: Name },
    /// `meta l4proto . ct original proto-dst vmap @map`
    L4ProtoCtOrigDportVmap { map: Name },
    /// `counter name meta l4proto . ct original proto-dst map @map`: count in the named counter
    /// the counter map gives for the connection's original protocol and port; no match when the
    /// map has no such element.
    L4ProtoCtOrigDportCounterMap { map: Name },
    /// `meta l4proto . ct original proto-dst @set`: the connection's original protocol and port
    /// is a key of `set` (a set or a map: only membership is tested).
    L4ProtoCtOrigDportInSet { set: Name },
    /// `<family> saddr . <family> saddr . meta l4proto . th sport @set`: the packet comes from one
    /// of these endpoints (`address . address . protocol . port` elements: the address twice, so
    /// that one set also serves [`Expr::SaddrDaddrL4ProtoDportInSet`]).
    SaddrTwiceL4ProtoSportInSet { family: Family, set: Name },
    /// `<family> saddr . <family> daddr . meta l4proto . th dport @set`: after DNAT, the packet
    /// goes to one of these endpoints from that same address: a hairpin connection.
    SaddrDaddrL4ProtoDportInSet { family: Family, set: Name },
    /// `<family> saddr @set`: the client address is in the set (an affinity set: this client's
    /// last connection went to the set's endpoint, within its timeout).
    SaddrInSet { family: Family, set: Name },
    /// `update @set { <family> saddr }`: adds the client address to a dynamic set, or restarts
    /// its timeout. Does not match when the set is full (and a new element cannot be added).
    UpdateSaddr { family: Family, set: Name },
    /// `numgen random mod M V`: a fresh random draw in `0..M` equals `V`. A service chain picks one of
    /// N endpoints with rules matching `mod N 0`, `mod N-1 0`, ..., the last one unconditional: each
    /// is reached with probability (N-i)/N and matches with 1/(N-i), so every endpoint gets 1/N.
    NumgenRandomIs { modulus: u32, value: u32 },
    /// `dnat ip to 10.0.0.1:8080`
    Dnat { addr: IpAddr, port: u16 },
    /// `masquerade`
    Masquerade,
    /// `reject with tcp reset`
    RejectTcpReset,
    /// `reject` (icmpx port-unreachable)
    RejectIcmpPortUnreachable,
    /// A verdict statement.
    Verdict(Verdict),
}

/// One part of a set key.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum KeyType {
    /// `inet_proto` (1 byte, padded to 4 in concatenations)
    InetProto,
    /// `inet_service` (2 bytes big endian, padded to 4)
    InetService,
    /// `ipv4_addr`
    Ipv4Addr,
    /// `ipv6_addr`
    Ipv6Addr,
}

impl KeyType {
    pub fn name(self) -> &'static str {
        match self {
            KeyType::InetProto => "inet_proto",
            KeyType::InetService => "inet_service",
            KeyType::Ipv4Addr => "ipv4_addr",
            KeyType::Ipv6Addr => "ipv6_addr",
        }
    }
}

/// One part of a set element key; matches a [`KeyType`] position.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum KeyPart {
    Proto(Protocol),
    Port(u16),
    Addr(IpAddr),
}

/// A set element's key: its parts packed inline, each as a tag byte and its value in network
/// order (a protocol 1 byte, a port 2, an address 4 or 16). Kept by value in the sets' B-trees:
/// the ruleset holds elements for every Service and endpoint, and a key as a vector of
/// parts would be a 72-byte allocation of its own besides its 24 bytes in the tree. The tags are
/// numbered in [`KeyPart`]'s order and values compare as the parts do, so keys sort byte by byte
/// exactly as their parts would. Every key the planner writes fits (the longest, an IPv6
/// endpoint: address . address . protocol . port, is 39 bytes); a longer one is refused by
/// [`Key::new`] (a set of someone else's shape read from the kernel).
#[derive(Clone, Copy)]
pub struct Key {
    len: u8,
    bytes: [u8; Key::CAPACITY],
}

impl Key {
    /// The bytes a key holds: an IPv6 endpoint key (17 + 17 + 2 + 3).
    pub const CAPACITY: usize = 39;
    const PROTO: u8 = 0;
    const PORT: u8 = 1;
    const V4: u8 = 2;
    const V6: u8 = 3;

    /// The key of these parts, or `None` when they take more than [`Key::CAPACITY`] bytes.
    pub fn new(parts: &[KeyPart]) -> Option<Key> {
        let mut key = Key { len: 0, bytes: [0; Key::CAPACITY] };
        for part in parts {
            let mut buf = [0u8; 17];
            let n = match *part {
                KeyPart::Proto(p) => {
                    buf[..2].copy_from_slice(&[Key::PROTO, p.number()]);
                    2
                }
                KeyPart::Port(port) => {
                    buf[0] = Key::PORT;
                    buf[1..3].copy_from_slice(&port.to_be_bytes());
                    3
                }
                KeyPart::Addr(IpAddr::V4(a)) => {
                    buf[0] = Key::V4;
                    buf[1..5].copy_from_slice(&a.octets());
                    5
                }
                KeyPart::Addr(IpAddr::V6(a)) => {
                    buf[0] = Key::V6;
                    buf[1..17].copy_from_slice(&a.octets());
                    17
                }
            };
            let at = usize::from(key.len);
            key.bytes.get_mut(at..at + n)?.copy_from_slice(&buf[..n]);
            key.len += n as u8;
        }
        Some(key)
    }

    /// Parts the planner writes, which always fit.
    fn fitting(parts: &[KeyPart]) -> Key {
        match Key::new(parts) {
            Some(key) => key,
            None => unreachable!("a planner key of {} parts fits in {} bytes", parts.len(), Key::CAPACITY),
        }
    }

    /// `protocol . port`
    pub fn proto_port(protocol: Protocol, port: u16) -> Key {
        Key::fitting(&[KeyPart::Proto(protocol), KeyPart::Port(port)])
    }

    /// `address . protocol . port`
    pub fn addr_proto_port(addr: IpAddr, protocol: Protocol, port: u16) -> Key {
        Key::fitting(&[KeyPart::Addr(addr), KeyPart::Proto(protocol), KeyPart::Port(port)])
    }

    /// `address . address . protocol . port` (an endpoint in `endpoints-*` is its address twice).
    pub fn addrs_proto_port(a: IpAddr, b: IpAddr, protocol: Protocol, port: u16) -> Key {
        Key::fitting(&[KeyPart::Addr(a), KeyPart::Addr(b), KeyPart::Proto(protocol), KeyPart::Port(port)])
    }

    /// `address`
    pub fn addr(addr: IpAddr) -> Key {
        Key::fitting(&[KeyPart::Addr(addr)])
    }

    /// The parts, in order.
    pub fn parts(&self) -> KeyParts<'_> {
        KeyParts { rest: self.as_bytes() }
    }

    pub fn first(&self) -> Option<KeyPart> {
        self.parts().next()
    }

    /// How many parts.
    pub fn len(&self) -> usize {
        self.parts().count()
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    fn as_bytes(&self) -> &[u8] {
        &self.bytes[..usize::from(self.len)]
    }
}

/// The parts of a [`Key`].
#[derive(Clone)]
pub struct KeyParts<'a> {
    rest: &'a [u8],
}

impl Iterator for KeyParts<'_> {
    type Item = KeyPart;

    fn next(&mut self) -> Option<KeyPart> {
        // Only `Key::new` writes the bytes: every tag is one of the four, with its whole value.
        let (&tag, rest) = self.rest.split_first()?;
        let (part, rest) = match tag {
            Key::PROTO => {
                let (&n, rest) = rest.split_first()?;
                (KeyPart::Proto(Protocol::from_number(n)?), rest)
            }
            Key::PORT => {
                let (v, rest) = rest.split_first_chunk::<2>()?;
                (KeyPart::Port(u16::from_be_bytes(*v)), rest)
            }
            Key::V4 => {
                let (v, rest) = rest.split_first_chunk::<4>()?;
                (KeyPart::Addr(IpAddr::from(*v)), rest)
            }
            _ => {
                let (v, rest) = rest.split_first_chunk::<16>()?;
                (KeyPart::Addr(IpAddr::from(*v)), rest)
            }
        };
        self.rest = rest;
        Some(part)
    }
}

impl PartialEq for Key {
    fn eq(&self, other: &Key) -> bool {
        self.as_bytes() == other.as_bytes()
    }
}

impl Eq for Key {}

impl PartialOrd for Key {
    fn partial_cmp(&self, other: &Key) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}

impl Ord for Key {
    /// As the parts compare (see [`Key`]).
    fn cmp(&self, other: &Key) -> std::cmp::Ordering {
        self.as_bytes().cmp(other.as_bytes())
    }
}

impl std::hash::Hash for Key {
    fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
        self.as_bytes().hash(state);
    }
}

impl fmt::Debug for Key {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_list().entries(self.parts()).finish()
    }
}

/// What a set holds: keys only, or keys mapped to a verdict or to a named counter.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum SetKind {
    /// `set`: keys only.
    Set,
    /// `map … : verdict`
    VerdictMap,
    /// `map … : counter` (elements name a [`NamedCounter`]; `counter name … map @m` counts in it)
    CounterMap,
    /// `set` with `flags dynamic,timeout`: keys only, added by the packet path
    /// ([`Expr::UpdateSaddr`]) and expiring `timeout` seconds after their last update. The
    /// planner gives it no elements; those the kernel holds are state, not configuration.
    Dynamic { timeout: u32 },
}

impl SetKind {
    /// `set` or `map`, as nft writes it.
    pub fn word(self) -> &'static str {
        match self {
            SetKind::Set | SetKind::Dynamic { .. } => "set",
            SetKind::VerdictMap | SetKind::CounterMap => "map",
        }
    }
}

/// The value of a map element.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Mapped {
    Verdict(Verdict),
    /// The name of a [`NamedCounter`] of the table.
    Counter(Name),
}

#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Set {
    pub name: Name,
    pub key: Vec<KeyType>,
    pub kind: SetKind,
    /// Element key → mapped value (always `None` for plain sets).
    pub elements: BTreeMap<Key, Option<Mapped>>,
    pub comment: Option<String>,
}

/// A named counter object (`counter NAME { }`): counts packets and bytes for every rule that
/// names it (`counter name NAME`) or reaches it through a counter map. Unlike an anonymous
/// `counter` in a rule, it keeps counting when the rules that use it are replaced, so per-Service
/// totals survive endpoint changes.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct NamedCounter {
    pub name: Name,
    pub comment: Option<String>,
}

/// Elements of dynamic sets by set name, each with the milliseconds until it expires: what a full
/// replace puts back ([`Ruleset::full_replace_carrying`]).
pub type Carried = BTreeMap<Name, Vec<(Key, u64)>>;

static NO_CARRIED: Carried = BTreeMap::new();

/// The complete desired content of the `nodelb` table.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Ruleset {
    pub chains: BTreeMap<Name, Chain>,
    pub sets: BTreeMap<Name, Set>,
    pub counters: BTreeMap<Name, NamedCounter>,
}

impl Ruleset {
    pub fn add_chain(&mut self, chain: Chain) {
        self.chains.insert(chain.name.clone(), chain);
    }

    pub fn add_set(&mut self, set: Set) {
        self.sets.insert(set.name.clone(), set);
    }

    pub fn add_counter(&mut self, counter: NamedCounter) {
        self.counters.insert(counter.name.clone(), counter);
    }

    /// The same ruleset with its maps rebuilt full. A map grown by inserts keeps its B-tree
    /// nodes half to two-thirds full; one built from its sorted entries packs them. A whole
    /// plan is kept until the next sync (its maps' nodes are a good part of the agent's heap); a
    /// patch inserts into the packed maps as before.
    pub fn packed(mut self) -> Ruleset {
        pack(&mut self.chains);
        pack(&mut self.counters);
        for set in self.sets.values_mut() {
            pack(&mut set.elements);
        }
        pack(&mut self.sets);
        self
    }

    /// Renders the ruleset in `nft` syntax, loadable with `nft -f` (sets, then chains sorted by
    /// name, so the output is stable for golden tests). Chains come in the order
    /// [`Ruleset::full_replace`] creates them, because `nft list` prints chains in creation order:
    /// `nft -f` of this text and a netlink full replace then list identically.
    /// With the nat chains sharded, one `table` block per table, the main one first.
    pub fn render(&self) -> String {
        let mut out = String::new();
        for table in self.tables() {
            let ours = |name: &Name| Table::of_name(name) == table;
            let _ = writeln!(out, "table inet {} {{", table.name());
            for counter in self.counters.values().filter(|c| ours(&c.name)) {
                let _ = writeln!(out, "\tcounter {} {{", counter.name);
                if let Some(c) = &counter.comment {
                    let _ = writeln!(out, "\t\tcomment {}", quote(c));
                }
                out.push_str("\t}\n");
            }
            for set in self.sets.values().filter(|s| ours(&s.name)) {
                render_set(&mut out, set);
            }
            for chain in self.chains.values().filter(|c| ours(&c.name)) {
                render_chain(&mut out, chain);
            }
            out.push_str("}\n");
        }
        out
    }

    /// The tables the ruleset has objects in, and always the main one (in order: main first).
    pub fn tables(&self) -> std::collections::BTreeSet<Table> {
        let mut out = std::collections::BTreeSet::from([Table::Main]);
        // Shard objects are named `s<k>.…`: only names from "s0." to "s9…" can be one.
        use std::ops::Bound::Included;
        let shards = (Included("s0."), Included("s9~"));
        out.extend(self.chains.range::<str, _>(shards).map(|(n, _)| Table::of_name(n)));
        out.extend(self.sets.range::<str, _>(shards).map(|(n, _)| Table::of_name(n)));
        out.extend(self.counters.range::<str, _>(shards).map(|(n, _)| Table::of_name(n)));
        out
    }
}

/// Rebuilds a B-tree map or set from its entries in order (the standard library builds one from
/// sorted entries with full nodes).
pub fn pack<C: Default + IntoIterator + FromIterator<C::Item>>(tree: &mut C) {
    *tree = std::mem::take(tree).into_iter().collect();
}

fn render_set(out: &mut String, set: &Set) {
    let key: Vec<&str> = set.key.iter().map(|k| k.name()).collect();
    let _ = writeln!(out, "\t{} {} {{", set.kind.word(), set.name);
    let data = match set.kind {
        SetKind::Set | SetKind::Dynamic { .. } => "",
        SetKind::VerdictMap => " : verdict",
        SetKind::CounterMap => " : counter",
    };
    let _ = writeln!(out, "\t\ttype {}{data}", key.join(" . "));
    if let SetKind::Dynamic { timeout } = set.kind {
        let _ = writeln!(out, "\t\tflags dynamic,timeout\n\t\ttimeout {timeout}s");
    }
    if let Some(c) = &set.comment {
        let _ = writeln!(out, "\t\tcomment {}", quote(c));
    }
    if !set.elements.is_empty() {
        let elems: Vec<String> = set
            .elements
            .iter()
            .map(|(k, v)| match v {
                Some(v) => format!("{} : {}", render_key(k), render_mapped(v)),
                None => render_key(k),
            })
            .collect();
        let _ = writeln!(out, "\t\telements = {{ {} }}", elems.join(",\n\t\t\t     "));
    }
    out.push_str("\t}\n");
}

fn render_chain(out: &mut String, chain: &Chain) {
    let _ = writeln!(out, "\tchain {} {{", chain.name);
    if let Some(c) = &chain.comment {
        let _ = writeln!(out, "\t\tcomment {}", quote(c));
    }
    if let Some(b) = &chain.base {
        let _ = writeln!(
            out,
            "\t\ttype {} hook {} priority {}; policy accept;",
            b.chain_type.name(),
            b.hook.name(),
            b.priority
        );
    }
    for rule in &chain.rules {
        let _ = writeln!(out, "\t\t{}", render_rule(rule));
    }
    out.push_str("\t}\n");
}

fn quote(s: &str) -> String {
    format!("\"{}\"", s.replace('"', "'"))
}

pub fn render_key(key: &Key) -> String {
    let parts: Vec<String> = key
        .parts()
        .map(|p| match p {
            KeyPart::Proto(p) => p.name().to_string(),
            KeyPart::Port(n) => n.to_string(),
            KeyPart::Addr(a) => a.to_string(),
        })
        .collect();
    parts.join(" . ")
}

pub fn render_verdict(v: &Verdict) -> String {
    match v {
        Verdict::Accept => "accept".into(),
        Verdict::Drop => "drop".into(),
        Verdict::Return => "return".into(),
        Verdict::Jump(c) => format!("jump {c}"),
        Verdict::Goto(c) => format!("goto {c}"),
    }
}

pub fn render_mapped(m: &Mapped) -> String {
    match m {
        Mapped::Verdict(v) => render_verdict(v),
        Mapped::Counter(name) => quote(name),
    }
}

fn prefix_family_word(p: &IpNet) -> &'static str {
    match p {
        IpNet::V4(_) => "ip",
        IpNet::V6(_) => "ip6",
    }
}

pub fn render_rule(rule: &Rule) -> String {
    let mut parts: Vec<String> = rule.exprs.iter().map(render_expr).collect();
    if let Some(c) = &rule.comment {
        parts.push(format!("comment {}", quote(c)));
    }
    parts.join(" ")
}

pub fn render_expr(e: &Expr) -> String {
    match e {
        Expr::NfProto(f) => format!("meta nfproto {}", f.name()),
        Expr::L4Proto(p) => format!("meta l4proto {}", p.name()),
        Expr::FibDaddrLocal => "fib daddr type local".into(),
        Expr::SaddrInPrefix { prefix, negate } => format!(
            "{} saddr {}{}",
            prefix_family_word(prefix),
            if *negate { "!= " } else { "" },
            prefix.trunc()
        ),
        Expr::DaddrInPrefix { prefix, negate } => format!(
            "{} daddr {}{}",
            prefix_family_word(prefix),
            if *negate { "!= " } else { "" },
            prefix.trunc()
        ),
        Expr::CtState(states) => {
            let names: Vec<&str> = states
                .iter()
                .map(|s| match s {
                    CtState::Invalid => "invalid",
                    CtState::Established => "established",
                    CtState::Related => "related",
                    CtState::New => "new",
                })
                .collect();
            format!("ct state {}", names.join(","))
        }
        Expr::CtStatusDnat => "ct status dnat".into(),
        Expr::MarkHas(bit) => format!("meta mark & {bit:#010x} == {bit:#010x}"),
        Expr::CtMarkHas(bit) => format!("ct mark & {bit:#010x} == {bit:#010x}"),
        Expr::CtMarkSet(bit) => format!("ct mark set ct mark | {bit:#010x}"),
        Expr::DportMaskIsNot { mask, value } => format!("th dport & {mask} != {value}"),
        Expr::MarkSet(bit) => format!("meta mark set meta mark | {bit:#010x}"),
        Expr::MarkXor(bit) => format!("meta mark set meta mark ^ {bit:#010x}"),
        Expr::MarkClear(bit) => format!("meta mark set meta mark & {:#010x}", !bit),
        Expr::Counter => "counter".into(),
        Expr::CounterRef(name) => format!("counter name {}", quote(name)),
        Expr::L4ProtoDportVmap { map } => format!("meta l4proto . th dport vmap @{map}"),
        Expr::L4ProtoDportInSet { set } => format!("meta l4proto . th dport @{set}"),
        Expr::DaddrL4ProtoDportInSet { family, set } => {
            format!("{} daddr . meta l4proto . th dport @{set}", family.payload_word())
        }
        Expr::DaddrL4ProtoDportVmap { family, map } => {
            format!("{} daddr . meta l4proto . th dport vmap @{map}", family.payload_word())
        }
        Expr::L4ProtoCtOrigDportVmap { map } => {
            // nft 1.0.6 rejects `ct original proto-dst` in a concatenation until the transport
            // protocol is known; the set match gives it that context (and matches every protocol a
            // service port can have). The encoder lowers the same set lookup.
            format!("meta l4proto {{ tcp, udp, sctp }} meta l4proto . ct original proto-dst vmap @{map}")
        }
        Expr::L4ProtoCtOrigDportCounterMap { map } => {
            // Same transport-protocol context as the vmap form above.
            format!(
                "meta l4proto {{ tcp, udp, sctp }} counter name meta l4proto . ct original proto-dst map @{map}"
            )
        }
        Expr::L4ProtoCtOrigDportInSet { set } => {
            // Same transport-protocol context as the vmap form above.
            format!("meta l4proto {{ tcp, udp, sctp }} meta l4proto . ct original proto-dst @{set}")
        }
        Expr::SaddrTwiceL4ProtoSportInSet { family, set } => {
            let w = family.payload_word();
            format!("{w} saddr . {w} saddr . meta l4proto . th sport @{set}")
        }
        Expr::SaddrDaddrL4ProtoDportInSet { family, set } => {
            let w = family.payload_word();
            format!("{w} saddr . {w} daddr . meta l4proto . th dport @{set}")
        }
        Expr::SaddrInSet { family, set } => format!("{} saddr @{set}", family.payload_word()),
        Expr::UpdateSaddr { family, set } => format!("update @{set} {{ {} saddr }}", family.payload_word()),
        Expr::NumgenRandomIs { modulus, value } => format!("numgen random mod {modulus} {value}"),
        Expr::Dnat { addr, port } => match addr {
            IpAddr::V4(a) => format!("dnat ip to {a}:{port}"),
            IpAddr::V6(a) => format!("dnat ip6 to [{a}]:{port}"),
        },
        Expr::Masquerade => "masquerade".into(),
        Expr::RejectTcpReset => "reject with tcp reset".into(),
        Expr::RejectIcmpPortUnreachable => "reject".into(),
        Expr::Verdict(v) => render_verdict(v),
    }
}

/// One step of a netlink transaction against nodelb's tables (an object's table is named by its
/// name, [`Table::of_name`]). The planner emits a list of these (a full replace or a diff); the
/// `nft` module encodes the whole list as ONE batch, in order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Change {
    /// Create the table if missing (no-op if present).
    AddTable(Table),
    /// Delete the table and everything in it.
    DeleteTable(Table),
    /// Create a chain (its `rules` are ignored here; they come as [`Change::AddRule`]).
    AddChain(Chain),
    /// Remove every rule of a chain.
    FlushChain(Name),
    /// Delete an (empty, unreferenced) chain.
    DeleteChain(Name),
    /// Append a rule to a chain.
    AddRule {
        chain: Name,
        rule: Rule,
    },
    /// Create a set or map (its `elements` are ignored here; they come as [`Change::AddElements`]).
    AddSet(Set),
    DeleteSet(Name),
    AddElements {
        set: Name,
        elements: Vec<(Key, Option<Mapped>)>,
    },
    DeleteElements {
        set: Name,
        keys: Vec<Key>,
    },
    /// Put back elements of a dynamic set ([`SetKind::Dynamic`]) that a full replace deletes
    /// with the table, each expiring as it would have (milliseconds from now).
    AddDynamicElements {
        set: Name,
        elements: Vec<(Key, u64)>,
    },
    /// Create a named counter (starting at zero).
    AddCounter(NamedCounter),
    /// Delete an (unreferenced) named counter.
    DeleteCounter(Name),
}

/// A [`Change`] borrowed from where its data lives: a change list (a diff), or the [`Ruleset`]
/// itself for a full replace ([`Ruleset::full_replace_refs`]), so that encoding a full replace
/// copies no chain, rule or element. The encoder works on these.
#[derive(Debug, Clone, Copy)]
pub enum ChangeRef<'a> {
    AddTable(Table),
    DeleteTable(Table),
    /// The chain's `rules` are ignored, as in [`Change::AddChain`].
    AddChain(&'a Chain),
    FlushChain(&'a str),
    DeleteChain(&'a str),
    AddRule {
        chain: &'a str,
        rule: &'a Rule,
    },
    /// The set's `elements` are ignored, as in [`Change::AddSet`].
    AddSet(&'a Set),
    DeleteSet(&'a str),
    AddElements {
        set: &'a str,
        elements: Elements<'a>,
    },
    DeleteElements {
        set: &'a str,
        keys: &'a [Key],
    },
    AddDynamicElements {
        set: &'a str,
        elements: &'a [(Key, u64)],
    },
    AddCounter(&'a NamedCounter),
    DeleteCounter(&'a str),
}

/// The elements of a [`ChangeRef::AddElements`]: a diff's list, or a whole set.
#[derive(Debug, Clone, Copy)]
pub enum Elements<'a> {
    List(&'a [(Key, Option<Mapped>)]),
    Set(&'a BTreeMap<Key, Option<Mapped>>),
}

impl<'a> Elements<'a> {
    pub fn len(&self) -> usize {
        match self {
            Elements::List(l) => l.len(),
            Elements::Set(s) => s.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub fn iter(&self) -> impl Iterator<Item = (&'a Key, &'a Option<Mapped>)> + 'a {
        let (list, set) = match *self {
            Elements::List(l) => (Some(l.iter().map(|(k, v)| (k, v))), None),
            Elements::Set(s) => (None, Some(s.iter())),
        };
        list.into_iter().flatten().chain(set.into_iter().flatten())
    }
}

impl Change {
    pub fn as_ref(&self) -> ChangeRef<'_> {
        match self {
            Change::AddTable(t) => ChangeRef::AddTable(*t),
            Change::DeleteTable(t) => ChangeRef::DeleteTable(*t),
            Change::AddChain(c) => ChangeRef::AddChain(c),
            Change::FlushChain(c) => ChangeRef::FlushChain(c),
            Change::DeleteChain(c) => ChangeRef::DeleteChain(c),
            Change::AddRule { chain, rule } => ChangeRef::AddRule { chain, rule },
            Change::AddSet(s) => ChangeRef::AddSet(s),
            Change::DeleteSet(s) => ChangeRef::DeleteSet(s),
            Change::AddElements { set, elements } => {
                ChangeRef::AddElements { set, elements: Elements::List(elements) }
            }
            Change::DeleteElements { set, keys } => ChangeRef::DeleteElements { set, keys },
            Change::AddDynamicElements { set, elements } => ChangeRef::AddDynamicElements { set, elements },
            Change::AddCounter(c) => ChangeRef::AddCounter(c),
            Change::DeleteCounter(c) => ChangeRef::DeleteCounter(c),
        }
    }
}

impl ChangeRef<'_> {
    /// The owned [`Change`] (a copy of the data it borrows).
    pub fn to_change(self) -> Change {
        match self {
            ChangeRef::AddTable(t) => Change::AddTable(t),
            ChangeRef::DeleteTable(t) => Change::DeleteTable(t),
            ChangeRef::AddChain(c) => Change::AddChain(c.clone()),
            ChangeRef::FlushChain(c) => Change::FlushChain(c.into()),
            ChangeRef::DeleteChain(c) => Change::DeleteChain(c.into()),
            ChangeRef::AddRule { chain, rule } => Change::AddRule { chain: chain.into(), rule: rule.clone() },
            ChangeRef::AddSet(s) => Change::AddSet(s.clone()),
            ChangeRef::DeleteSet(s) => Change::DeleteSet(s.into()),
            ChangeRef::AddElements { set, elements } => Change::AddElements {
                set: set.into(),
                elements: elements.iter().map(|(k, v)| (*k, v.clone())).collect(),
            },
            ChangeRef::DeleteElements { set, keys } => {
                Change::DeleteElements { set: set.into(), keys: keys.to_vec() }
            }
            ChangeRef::AddDynamicElements { set, elements } => {
                Change::AddDynamicElements { set: set.into(), elements: elements.to_vec() }
            }
            ChangeRef::AddCounter(c) => Change::AddCounter(c.clone()),
            ChangeRef::DeleteCounter(c) => Change::DeleteCounter(c.into()),
        }
    }
}

impl Ruleset {
    /// The changes that replace whatever the kernel holds with exactly `self`, atomically:
    /// create-if-missing, delete (every table nodelb may own, so shards of an earlier shard count
    /// go too), then build everything. Chains and counters come before sets
    /// (map elements point at them) and sets before rules (rules look up sets).
    pub fn full_replace(&self) -> Vec<Change> {
        self.full_replace_refs().map(ChangeRef::to_change).collect()
    }

    /// [`Ruleset::full_replace`] borrowing from `self`, computed as it is walked (nothing is
    /// copied or collected; walk it again to find the n-th change).
    pub fn full_replace_refs(&self) -> impl Iterator<Item = ChangeRef<'_>> + Clone {
        self.full_replace_carrying(&NO_CARRIED)
    }

    /// [`Ruleset::full_replace_refs`] that also puts back `carried` elements of dynamic sets
    /// (read from the kernel just before: the table's deletion would drop them), right after
    /// their set is created. Elements of sets `self` does not have as dynamic sets are left out.
    pub fn full_replace_carrying<'a>(
        &'a self,
        carried: &'a Carried,
    ) -> impl Iterator<Item = ChangeRef<'a>> + Clone {
        let start = Table::all()
            .flat_map(|t| [ChangeRef::AddTable(t), ChangeRef::DeleteTable(t)])
            .chain(self.tables().into_iter().map(ChangeRef::AddTable).collect::<Vec<_>>());
        let sets = self.sets.values().flat_map(move |set| {
            let elements = (!set.elements.is_empty())
                .then_some(ChangeRef::AddElements { set: &set.name, elements: Elements::Set(&set.elements) });
            let dynamic = match (set.kind, carried.get(&set.name)) {
                (SetKind::Dynamic { .. }, Some(e)) if !e.is_empty() => {
                    Some(ChangeRef::AddDynamicElements { set: &set.name, elements: e })
                }
                _ => None,
            };
            std::iter::once(ChangeRef::AddSet(set)).chain(elements).chain(dynamic)
        });
        let rules = self
            .chains
            .values()
            .flat_map(|c| c.rules.iter().map(move |rule| ChangeRef::AddRule { chain: &c.name, rule }));
        start
            .chain(self.chains.values().map(ChangeRef::AddChain))
            .chain(self.counters.values().map(ChangeRef::AddCounter))
            .chain(sets)
            .chain(rules)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The applied ruleset is kept between syncs and holds a few expressions per endpoint, so each
    /// byte of `Expr` counts once per expression of the node. Names are shared thin pointers
    /// (`Name`), the connection states boxed; a variant that makes it grow again must say why
    /// here.
    #[test]
    fn kept_ruleset_types_stay_small() {
        assert!(size_of::<Name>() <= 8, "Name is {} bytes", size_of::<Name>());
        // Cloned into every structure that names a Service (see its documentation).
        let key = size_of::<crate::domain::ServiceKey>();
        assert!(key <= 16, "ServiceKey is {key} bytes");
        assert!(size_of::<Expr>() <= 24, "Expr is {} bytes", size_of::<Expr>());
        assert!(size_of::<Rule>() <= 24, "Rule is {} bytes", size_of::<Rule>());
        assert!(size_of::<Verdict>() <= 16, "Verdict is {} bytes", size_of::<Verdict>());
        assert!(size_of::<Mapped>() <= 16, "Mapped is {} bytes", size_of::<Mapped>());
        // Inline, no allocation of its own: ~70,000 elements at 10,000 × 5.
        assert!(size_of::<Key>() <= 40, "Key is {} bytes", size_of::<Key>());
    }

    fn parts_of_every_shape() -> Vec<Vec<KeyPart>> {
        let addrs: [IpAddr; 4] = [
            "192.0.2.1".parse().unwrap(),
            "192.0.2.200".parse().unwrap(),
            "2001:db8::1".parse().unwrap(),
            "2001:db8:ffff::".parse().unwrap(),
        ];
        let protos = [Protocol::Tcp, Protocol::Udp, Protocol::Sctp];
        let ports = [0u16, 53, 255, 256, 20001, 65535];
        let mut out = vec![vec![]];
        for &a in &addrs {
            out.push(vec![KeyPart::Addr(a)]);
            for &p in &protos {
                for &port in &ports {
                    out.push(vec![KeyPart::Proto(p), KeyPart::Port(port)]);
                    out.push(vec![KeyPart::Addr(a), KeyPart::Proto(p), KeyPart::Port(port)]);
                    for &b in &addrs {
                        out.push(vec![
                            KeyPart::Addr(a),
                            KeyPart::Addr(b),
                            KeyPart::Proto(p),
                            KeyPart::Port(port),
                        ]);
                    }
                }
            }
        }
        out.push(vec![KeyPart::Port(7)]);
        out.push(vec![KeyPart::Port(7), KeyPart::Proto(Protocol::Udp)]);
        out
    }

    /// A key gives back its parts, and keys compare, and so sort in a set, exactly as their
    /// parts do (the golden rulesets list elements in that order), across every shape and
    /// value boundary (a port's high byte, an address's family).
    #[test]
    fn packed_keys_keep_their_parts_and_order() {
        let all = parts_of_every_shape();
        let keys: Vec<Key> = all.iter().map(|p| Key::new(p).expect("fits")).collect();
        for (parts, key) in all.iter().zip(&keys) {
            assert_eq!(key.parts().collect::<Vec<_>>(), *parts);
            assert_eq!(key.len(), parts.len());
            assert_eq!(format!("{key:?}"), format!("{parts:?}"));
        }
        for (i, a) in all.iter().enumerate() {
            for (j, b) in all.iter().enumerate() {
                assert_eq!(keys[i].cmp(&keys[j]), a.cmp(b), "{a:?} against {b:?}");
                assert_eq!(keys[i] == keys[j], a == b);
            }
        }
    }

    /// The longest key the planner writes fits; one longer than [`Key::CAPACITY`] is refused,
    /// not truncated.
    #[test]
    fn keys_longer_than_the_capacity_are_refused() {
        let v6 = KeyPart::Addr("2001:db8::1".parse().unwrap());
        let longest = [v6, v6, KeyPart::Proto(Protocol::Sctp), KeyPart::Port(65535)];
        assert_eq!(Key::new(&longest).map(|k| k.parts().count()), Some(4));
        assert_eq!(Key::new(&[v6, v6, v6]), None);
        assert_eq!(
            Key::new(&[v6, v6, KeyPart::Proto(Protocol::Tcp), KeyPart::Port(1), KeyPart::Port(2)]),
            None
        );
    }
}
