//! Which node ports a Service may take. Pure.
//!
//! A node port is DNATed on every node for every node address, for traffic arriving at the node
//! and for the node's own connections: a Service on port 22, 6443 or 10250 takes over the node's
//! SSH, API server or kubelet. Two rules, checked by the allocator (requests) and again by every
//! node before it programs a port (whatever the allocation says):
//!
//! 1. **Allowed ports** ([`PortPolicy::allows`]): a node port must lie in the allocation range(s)
//!    (`--port-range`; pools later feed more ranges through the same function) or in the ports
//!    the operator allowed explicitly (`--allowed-node-ports 80,443,8000-8100`). So
//!    `nodelb.io/ports: "22/TCP=22"`, or `service` on a Service whose port is 22, is refused
//!    unless the operator allowed 22: klipper-lb's style stays possible for the ports they chose.
//! 2. **Listening ports** ([`Listeners`]): a port a process on the node listens on (TCP `LISTEN`,
//!    or an unconnected bound UDP socket; IPv4 or IPv6; on a wildcard address or any non-loopback
//!    node address) is never taken, whatever the configuration. Per protocol: a TCP listener on
//!    53 blocks 53/TCP, not 53/UDP (the DNAT is per protocol). Loopback-only listeners
//!    (`127.0.0.1:10248`) do not count: nodelb's dispatch never matches loopback destinations, so
//!    it cannot take them over. New automatic allocations avoid a number with a listener of any
//!    protocol (they can pick any free number, so they pick a clean one).

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::net::IpAddr;
use std::str::FromStr;

use crate::domain::Protocol;

/// The Kubernetes NodePort range (default service-node-port-range).
pub const NODEPORT_RANGE: (u16, u16) = (30000, 32767);
/// The Linux default ephemeral (local) port range, `net.ipv4.ip_local_port_range`.
pub const EPHEMERAL_RANGE: (u16, u16) = (32768, 60999);

/// Inclusive range of node ports handed out automatically.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, serde::Serialize)]
pub struct PortRange {
    pub first: u16,
    pub last: u16,
}

impl Default for PortRange {
    /// 20000–29999: overlaps neither the NodePort range nor the ephemeral range.
    fn default() -> Self {
        PortRange { first: 20000, last: 29999 }
    }
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RangeError {
    #[error("port range {0:?} is not FIRST-LAST (like 20000-29999)")]
    Syntax(String),
    #[error("port range {0:?}: {1:?} is not a port number 1-65535")]
    Number(String, String),
    #[error("port range {0:?}: first port is greater than last")]
    Reversed(String),
}

impl PortRange {
    /// A range `first..=last`; both non-zero, `first <= last`.
    pub fn new(first: u16, last: u16) -> Result<PortRange, RangeError> {
        let shown = format!("{first}-{last}");
        if first == 0 {
            return Err(RangeError::Number(shown, "0".to_string()));
        }
        if first > last {
            return Err(RangeError::Reversed(shown));
        }
        Ok(PortRange { first, last })
    }

    pub fn contains(&self, port: u16) -> bool {
        (self.first..=self.last).contains(&port)
    }

    /// Number of ports in the range.
    pub fn len(&self) -> usize {
        usize::from(self.last) - usize::from(self.first) + 1
    }

    /// Never true for a range built through [`PortRange::new`] or `FromStr`.
    pub fn is_empty(&self) -> bool {
        self.first > self.last
    }

    /// Human-readable warnings when the range overlaps ranges other software hands out (the
    /// Kubernetes NodePort range, the Linux ephemeral range) or privileged ports. Not an error:
    /// an operator may have moved those ranges, but they should hear about it.
    pub fn warnings(&self) -> Vec<String> {
        let mut out = Vec::new();
        let overlaps = |(a, b): (u16, u16)| self.first <= b && a <= self.last;
        if overlaps(NODEPORT_RANGE) {
            out.push(format!(
                "port range {self} overlaps the Kubernetes NodePort range {}-{}",
                NODEPORT_RANGE.0, NODEPORT_RANGE.1
            ));
        }
        if overlaps(EPHEMERAL_RANGE) {
            out.push(format!(
                "port range {self} overlaps the Linux ephemeral port range {}-{} (net.ipv4.ip_local_port_range)",
                EPHEMERAL_RANGE.0, EPHEMERAL_RANGE.1
            ));
        }
        if self.first < 1024 {
            out.push(format!("port range {self} includes privileged ports below 1024"));
        }
        out
    }
}

impl fmt::Display for PortRange {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}-{}", self.first, self.last)
    }
}

impl FromStr for PortRange {
    type Err = RangeError;

    fn from_str(s: &str) -> Result<PortRange, RangeError> {
        let (a, b) = s.trim().split_once('-').ok_or_else(|| RangeError::Syntax(s.to_string()))?;
        let num = |t: &str| match t.trim().parse::<u16>() {
            Ok(n) if n != 0 => Ok(n),
            _ => Err(RangeError::Number(s.to_string(), t.trim().to_string())),
        };
        let (first, last) = (num(a)?, num(b)?);
        if first > last {
            return Err(RangeError::Reversed(s.to_string()));
        }
        Ok(PortRange { first, last })
    }
}

/// The node ports Services may take, besides what listens on the node.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PortPolicy {
    /// The allocation ranges (`--port-range`).
    pub ranges: Vec<PortRange>,
    /// Ports the operator allowed beyond the ranges (`--allowed-node-ports`).
    pub allowed: Vec<PortRange>,
}

impl Default for PortPolicy {
    fn default() -> Self {
        PortPolicy { ranges: vec![PortRange::default()], allowed: vec![] }
    }
}

impl PortPolicy {
    /// The default range only, as `--port-range` says.
    pub fn with_range(range: PortRange) -> PortPolicy {
        PortPolicy { ranges: vec![range], allowed: vec![] }
    }

    /// Rule 1: inside a range or explicitly allowed.
    pub fn allows(&self, port: u16) -> bool {
        self.ranges.iter().chain(&self.allowed).any(|r| r.contains(port))
    }

    /// `20000-29999` (plus `and --allowed-node-ports 22,80`) for messages.
    pub fn describe(&self) -> String {
        let list = |v: &[PortRange]| v.iter().map(short).collect::<Vec<_>>().join(",");
        if self.allowed.is_empty() {
            format!("--port-range {}", list(&self.ranges))
        } else {
            format!("--port-range {} or --allowed-node-ports {}", list(&self.ranges), list(&self.allowed))
        }
    }
}

fn short(r: &PortRange) -> String {
    if r.first == r.last { r.first.to_string() } else { r.to_string() }
}

/// `--allowed-node-ports`: `80,443,8000-8100`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PortList(pub Vec<PortRange>);

impl FromStr for PortList {
    type Err = String;

    fn from_str(s: &str) -> Result<PortList, String> {
        let mut out = Vec::new();
        for item in s.split(',').map(str::trim).filter(|i| !i.is_empty()) {
            let r = if item.contains('-') {
                item.parse::<PortRange>().map_err(|e| e.to_string())?
            } else {
                let n = item
                    .parse::<u16>()
                    .ok()
                    .filter(|n| *n != 0)
                    .ok_or_else(|| format!("{item:?} is not a port number 1-65535"))?;
                PortRange { first: n, last: n }
            };
            out.push(r);
        }
        Ok(PortList(out))
    }
}

/// One socket a process on the node listens on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Listener {
    pub protocol: Protocol,
    pub port: u16,
    /// The local address it is bound to (`0.0.0.0`, `::` or a node address).
    pub addr: IpAddr,
}

impl fmt::Display for Listener {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let addr = match self.addr {
            IpAddr::V6(a) => format!("[{a}]"),
            IpAddr::V4(a) => a.to_string(),
        };
        write!(f, "a process listens on {addr}:{}/{}", self.port, self.protocol)
    }
}

/// The node's listening sockets that can be taken over, by protocol and port, in address order.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Listeners(BTreeMap<(Protocol, u16), Vec<Listener>>);

impl Listeners {
    /// From every listening socket read: loopback-bound ones are left out (rule 2).
    pub fn from_sockets(sockets: impl IntoIterator<Item = Listener>) -> Listeners {
        let mut sockets: Vec<Listener> = sockets.into_iter().filter(|l| !l.addr.is_loopback()).collect();
        sockets.sort();
        sockets.dedup();
        let mut map: BTreeMap<(Protocol, u16), Vec<Listener>> = BTreeMap::new();
        for l in sockets {
            map.entry((l.protocol, l.port)).or_default().push(l);
        }
        Listeners(map)
    }

    /// A listener on `port`/`protocol`, if any (the first by address).
    pub fn get(&self, protocol: Protocol, port: u16) -> Option<&Listener> {
        self.0.get(&(protocol, port)).and_then(|ls| ls.first())
    }

    /// A listener that a node port on `port`/`protocol` would take over: where the port is
    /// served on every node address, any; where only on `served_on`, one bound to an address
    /// of that set or to the unspecified address of its family (`::` also takes IPv4 unless
    /// the socket is IPv6-only, which is not read: it counts for both).
    pub fn blocking(
        &self,
        protocol: Protocol,
        port: u16,
        served_on: Option<&BTreeSet<IpAddr>>,
    ) -> Option<&Listener> {
        let listeners = self.0.get(&(protocol, port))?;
        let Some(served_on) = served_on else { return listeners.first() };
        listeners.iter().find(|l| {
            let addr = l.addr.to_canonical();
            match addr {
                IpAddr::V4(a) if a.is_unspecified() => served_on.iter().any(IpAddr::is_ipv4),
                IpAddr::V6(a) if a.is_unspecified() => !served_on.is_empty(),
                a => served_on.contains(&a),
            }
        })
    }

    /// Whether any protocol listens on `port` (new automatic allocations avoid it).
    pub fn any_on(&self, port: u16) -> bool {
        self.0.keys().any(|(_, p)| *p == port)
    }

    pub fn iter(&self) -> impl Iterator<Item = &Listener> {
        self.0.values().flatten()
    }

    /// Those that matter to nodelb (ports it may allocate), as `22/TCP,53/UDP`: what an agent
    /// publishes on its node Lease.
    pub fn format_relevant(&self, policy: &PortPolicy) -> String {
        self.0
            .keys()
            .filter(|(_, p)| policy.allows(*p))
            .map(|(proto, p)| format!("{p}/{proto}"))
            .collect::<Vec<_>>()
            .join(",")
    }

    /// Parses [`Listeners::format_relevant`]'s output of node `node` (bad items skipped); the
    /// address is unknown there, so it is the unspecified one.
    pub fn parse_published(value: &str) -> Vec<(Protocol, u16)> {
        value
            .split(',')
            .filter_map(|item| {
                let (p, proto) = item.trim().split_once('/')?;
                Some((crate::domain::parse_protocol(proto).ok()?, p.parse::<u16>().ok()?))
            })
            .collect()
    }
}

/// Why a node port is not taken.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, serde::Serialize)]
pub enum PortRefusal {
    /// Outside the ranges and the allowed ports; the message names what is allowed.
    NotAllowed(String),
    /// A process on the node listens on it (on the nodes named, for the leader's view).
    InUse(String),
    /// The Service's node port pool does not serve it on this node (why, in words).
    NotSelected(String),
    /// The node-port registry does not give the number to this Service (Kubernetes mode): its
    /// annotation names a number another Service holds (`true`) or one not claimed yet.
    NotRecorded { another: bool },
    /// Services of two pools hold the number together and both pools serve this node (one was
    /// edited to meet the other): another of them keeps it here.
    Shared,
}

impl PortRefusal {
    /// `not_allowed` / `in_use`: the `reason` label of `nodelb_node_ports_refused`.
    pub fn code(&self) -> &'static str {
        match self {
            PortRefusal::NotAllowed(_) => "not_allowed",
            PortRefusal::InUse(_) => "in_use",
            PortRefusal::NotSelected(_) => "not_selected",
            PortRefusal::NotRecorded { .. } => "not_recorded",
            PortRefusal::Shared => "number_shared",
        }
    }
}

impl fmt::Display for PortRefusal {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            PortRefusal::NotAllowed(allowed) => write!(f, "not allowed (allowed: {allowed})"),
            PortRefusal::InUse(who) => write!(f, "in use: {who}"),
            PortRefusal::NotSelected(why) => write!(f, "{why}"),
            PortRefusal::NotRecorded { another: true } => f.write_str(
                "the node-port registry gives it to another Service (the allocation annotation was not written by nodelb)",
            ),
            PortRefusal::NotRecorded { another: false } => {
                f.write_str("not in the node-port registry yet (the leader claims a number before it writes it)")
            }
            PortRefusal::Shared => f.write_str(
                "a Service of another pool holds this number too and keeps it on this node (pools that share a number must not both select a node)",
            ),
        }
    }
}

/// Whether this node may program `node_port` for `protocol` (both rules), on every node
/// address or (`served_on`: a pool's addresses) only on those.
pub fn node_check(
    node_port: u16,
    protocol: Protocol,
    policy: &PortPolicy,
    listeners: &Listeners,
    served_on: Option<&BTreeSet<IpAddr>>,
) -> Result<(), PortRefusal> {
    if !policy.allows(node_port) {
        return Err(PortRefusal::NotAllowed(policy.describe()));
    }
    if let Some(l) = listeners.blocking(protocol, node_port, served_on) {
        return Err(PortRefusal::InUse(format!("{l} on this node")));
    }
    Ok(())
}

/// Ranges as `20000-20099,21000` for status and messages.
pub fn describe_ranges(ranges: &[PortRange]) -> String {
    if ranges.is_empty() {
        return "none".to_string();
    }
    ranges
        .iter()
        .map(|r| if r.first == r.last { r.first.to_string() } else { r.to_string() })
        .collect::<Vec<_>>()
        .join(",")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn l(protocol: Protocol, addr: &str, port: u16) -> Listener {
        Listener { protocol, port, addr: addr.parse().unwrap() }
    }

    #[test]
    fn port_lists() {
        let got: PortList = "80, 443,8000-8100".parse().unwrap();
        assert_eq!(
            got.0,
            vec![
                PortRange { first: 80, last: 80 },
                PortRange { first: 443, last: 443 },
                PortRange { first: 8000, last: 8100 }
            ]
        );
        assert_eq!("".parse::<PortList>().unwrap().0, vec![]);
        for bad in ["0", "x", "70000", "10-5", "22,ssh"] {
            assert!(bad.parse::<PortList>().is_err(), "{bad}");
        }
    }

    /// (port, protocol, allowed ports, listeners) → decision.
    #[test]
    fn node_check_table() {
        use Protocol::{Tcp, Udp};
        let listeners = Listeners::from_sockets([
            l(Tcp, "0.0.0.0", 22),
            l(Tcp, "203.0.113.1", 20005),
            l(Udp, "::", 20053),
            l(Tcp, "127.0.0.1", 20010),
            l(Tcp, "::1", 20011),
            l(Tcp, "::", 6443),
        ]);
        let none = PortPolicy::default();
        let some = PortPolicy { allowed: "22,6443,8000-8100".parse::<PortList>().unwrap().0, ..none.clone() };
        let cases: &[(u16, Protocol, &PortPolicy, &str)] = &[
            (20000, Tcp, &none, ""),
            (29999, Udp, &none, ""),
            (19999, Tcp, &none, "not_allowed"),
            (22, Tcp, &none, "not_allowed"),
            (22, Tcp, &some, "in_use"),
            (22, Udp, &some, ""),
            (6443, Tcp, &some, "in_use"),
            (10250, Tcp, &some, "not_allowed"),
            (8080, Tcp, &some, ""),
            (20005, Tcp, &none, "in_use"),
            (20005, Udp, &none, ""),
            (20053, Udp, &none, "in_use"),
            (20053, Tcp, &none, ""),
            (20010, Tcp, &none, ""),
            (20011, Tcp, &none, ""),
        ];
        for (port, proto, policy, want) in cases {
            let got = node_check(*port, *proto, policy, &listeners, None).err();
            assert_eq!(got.as_ref().map(|r| r.code()).unwrap_or(""), *want, "{port}/{proto}");
        }
        let msg = node_check(22, Tcp, &none, &listeners, None).unwrap_err().to_string();
        assert_eq!(msg, "not allowed (allowed: --port-range 20000-29999)");
        let msg = node_check(22, Tcp, &some, &listeners, None).unwrap_err().to_string();
        assert_eq!(msg, "in use: a process listens on 0.0.0.0:22/TCP on this node");
        let msg = node_check(10250, Tcp, &some, &listeners, None).unwrap_err().to_string();
        assert_eq!(
            msg,
            "not allowed (allowed: --port-range 20000-29999 or --allowed-node-ports 22,6443,8000-8100)"
        );
        assert!(listeners.any_on(20053) && !listeners.any_on(20010));
        assert_eq!(listeners.format_relevant(&some), "22/TCP,6443/TCP,20005/TCP,20053/UDP");
        assert_eq!(
            Listeners::parse_published("22/TCP, 20053/udp,bad,99999/TCP"),
            vec![(Tcp, 22), (Udp, 20053)]
        );
    }

    /// A port served only on some node addresses (a pool's) is taken over only by a listener on
    /// one of them or on its family's unspecified address: (listeners, served on) → blocked by.
    #[test]
    fn a_listener_blocks_only_the_addresses_it_is_bound_to() {
        use Protocol::Tcp;
        let open = PortPolicy { allowed: "443".parse::<PortList>().unwrap().0, ..PortPolicy::default() };
        let set = |addrs: &[&str]| addrs.iter().map(|a| a.parse().unwrap()).collect::<BTreeSet<IpAddr>>();
        /// Sockets (address, port), the addresses the port is served on, the blocking socket.
        type Case<'a> = (&'a [(&'a str, u16)], Option<&'a [&'a str]>, Option<&'a str>);
        let cases: &[Case<'_>] = &[
            (&[("192.0.2.1", 443)], Some(&["192.0.2.2"]), None),
            (&[("192.0.2.1", 443)], Some(&["192.0.2.1"]), Some("192.0.2.1")),
            (&[("192.0.2.1", 443)], None, Some("192.0.2.1")),
            (&[("192.0.2.1", 443), ("192.0.2.2", 443)], Some(&["192.0.2.2"]), Some("192.0.2.2")),
            (&[("0.0.0.0", 443)], Some(&["192.0.2.2"]), Some("0.0.0.0")),
            (&[("0.0.0.0", 443)], Some(&["2001:db8::2"]), None),
            (&[("::", 443)], Some(&["192.0.2.2"]), Some("::")),
            (&[("2001:db8::1", 443)], Some(&["2001:db8::2", "192.0.2.1"]), None),
            (&[("::ffff:192.0.2.1", 443)], Some(&["192.0.2.1"]), Some("::ffff:192.0.2.1")),
            (&[("192.0.2.1", 80)], Some(&["192.0.2.1"]), None),
        ];
        for (sockets, served_on, want) in cases {
            let listeners = Listeners::from_sockets(sockets.iter().map(|(a, p)| l(Tcp, a, *p)));
            let served_on = served_on.map(set);
            let got = listeners.blocking(Tcp, 443, served_on.as_ref()).map(|l| l.addr.to_string());
            assert_eq!(got.as_deref(), *want, "{sockets:?} served on {served_on:?}");
            let check = node_check(443, Tcp, &open, &listeners, served_on.as_ref());
            assert_eq!(check.is_err(), want.is_some(), "{sockets:?} served on {served_on:?}");
        }
    }
}
