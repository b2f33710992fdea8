//! Which endpoint addresses nodelb DNATs to (CVE-2020-8554 class). Pure.
//!
//! Whoever can write an EndpointSlice (or a manifest) names the addresses a public node port is
//! DNATed to. Some addresses must never be such a target, because they expose what lives on the
//! node or next to it rather than a backend. [`check`] decides per address, in this order:
//!
//! 1. **Never** (no flag allows them; the allow-list cannot either):
//!    - IPv4 `0.0.0.0` (unspecified) and `0.0.0.0/8` ("this network", RFC 1122: not a
//!      destination); IPv6 `::`.
//!    - loopback `127.0.0.0/8`, `::1`: node-local services (kubelet's healthz, local proxies).
//!    - cloud metadata and platform services ([`CLOUD_PLATFORM`]): `169.254.169.254` (AWS, GCP,
//!      Azure, OpenStack, Oracle, DigitalOcean), `168.63.129.16` (Azure's WireServer: the VM
//!      agent's channel, DNS, health probes), `100.100.100.200` and Alibaba Cloud's DNS, and
//!      over IPv6 AWS's metadata, DNS and time (`fd00:ec2::254`, `::253`, `::123`) and GCP's
//!      metadata (`fd20:ce::254`): named as such, because that is what an operator must hear.
//!      Their IPv4-mapped and NAT64 forms are refused too (below).
//!    - link-local `169.254.0.0/16`, `fe80::/10`: only meaningful on one link of this node.
//!    - multicast `224.0.0.0/4`, `ff00::/8`; broadcast `255.255.255.255` and the directed
//!      broadcast address of each of this node's interfaces (read with the addresses).
//!    - reserved `240.0.0.0/4` (never assigned; Linux does not route it).
//!    - IPv4-mapped IPv6 `::ffff:0:0/96`: not an IPv6 destination on the wire, and a way around
//!      the IPv4 checks (`::ffff:127.0.0.1`); refused whatever the IPv4 address is. Deprecated
//!      IPv4-compatible `::/96` (RFC 4291) likewise.
//!    - NAT64 `64:ff9b::/96` (RFC 6052) is a real destination, translated to IPv4 by a gateway: the
//!      embedded IPv4 address gets the IPv4 checks above and the node-address check, so
//!      `64:ff9b::a9fe:a9fe` is refused as the metadata service.
//! 2. **A node's own address** — every address of this node (read from the kernel) and, in
//!    Kubernetes mode, every address of every Node object and every address each agent reads on
//!    its own node and publishes on its node Lease (a second NIC, a CNI bridge or tunnel
//!    gateway, one added after start: a DNAT on node-1 to node-2:10250 exposes node-2's
//!    kubelet) — only with `--allow-node-endpoints` (hostNetwork backends). The risk: any port of
//!    any node becomes reachable through the Service. Also never, whatever the flags, in
//!    Kubernetes mode: the API server's own endpoints (the `default/kubernetes` Service's
//!    EndpointSlice: a public node port in front of the control plane) and the cluster's Service
//!    CIDRs (`ServiceCIDR` objects: a ClusterIP is no endpoint).
//! 3. **The operator's allow-list** (`--endpoint-cidrs`, e.g. the pod and host networks): when
//!    set, an address outside every CIDR is refused.
//!
//! Not refused: private (RFC 1918), shared (`100.64.0.0/10`), ULA (`fc00::/7`), documentation
//! and benchmarking ranges: pod networks use all of them. `--endpoint-cidrs` narrows further.
//!
//! [`filter`] applies this to the validated Services: refused addresses are taken out of every
//! service port (the rest of the Service keeps serving; a Service left with none is refused to
//! clients at once, like one without ready endpoints) and returned, each naming the Service, the
//! address and the reason.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use ipnet::IpNet;

use crate::domain::ServiceKey;
use crate::inputs::model::LbService;

/// What the operator allows beyond the fixed rules (flags).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct EndpointPolicy {
    /// `--allow-node-endpoints`: a node's own addresses may be endpoints (hostNetwork backends).
    pub allow_node_addresses: bool,
    /// `--endpoint-cidrs`: when not empty, endpoints must lie inside one of these.
    pub allowed_cidrs: Vec<IpNet>,
}

/// Addresses that belong to nodes: this node's (read from the kernel) and, in Kubernetes mode,
/// every Node object's.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct HostAddresses {
    /// Address → whose it is, for the message (`this node (eth0)`, `Node node-2`).
    pub nodes: BTreeMap<IpAddr, String>,
    /// Directed broadcast addresses of this node's interfaces.
    pub broadcasts: BTreeSet<IpAddr>,
    /// This node's own addresses with their interfaces and Node address types: what a node
    /// port pool's `addresses` selects from ([`crate::decisions::pool::AddressFilter::select`]).
    pub own: crate::decisions::pool::NodeAddresses,
    /// The API server's endpoints (Kubernetes mode), with what names them.
    pub api_servers: BTreeMap<IpAddr, String>,
    /// The cluster's Service CIDRs (Kubernetes mode), with what names each.
    pub service_cidrs: Vec<(IpNet, String)>,
}

impl HostAddresses {
    /// Adds `addr` as belonging to `owner`, keeping the first owner named.
    pub fn add(&mut self, addr: IpAddr, owner: impl Into<String>) {
        self.nodes.entry(addr).or_insert_with(|| owner.into());
    }

    /// Both sets together (this node's and the cluster's).
    pub fn merged(&self, other: &HostAddresses) -> HostAddresses {
        let mut out = self.clone();
        for (a, o) in &other.nodes {
            out.add(*a, o.clone());
        }
        out.broadcasts.extend(other.broadcasts.iter().copied());
        out.own.merge(&other.own);
        for (a, o) in &other.api_servers {
            out.api_servers.entry(*a).or_insert_with(|| o.clone());
        }
        out.service_cidrs.extend(other.service_cidrs.iter().cloned());
        out
    }
}

/// Cloud metadata and platform service addresses (see the module documentation).
pub const CLOUD_PLATFORM: [&str; 9] = [
    "169.254.169.254",
    "168.63.129.16",
    "100.100.100.200",
    "100.100.2.136",
    "100.100.2.138",
    "fd00:ec2::254",
    "fd00:ec2::253",
    "fd00:ec2::123",
    "fd20:ce::254",
];

fn cloud_platform(addr: IpAddr) -> bool {
    CLOUD_PLATFORM.iter().any(|a| a.parse::<IpAddr>().is_ok_and(|c| c == addr))
}

/// Why an endpoint address is refused.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash, serde::Serialize)]
pub enum AddressRefusal {
    Unspecified,
    ThisNetwork,
    Loopback,
    CloudMetadata,
    LinkLocal,
    Multicast,
    Broadcast,
    Reserved,
    Ipv4Mapped,
    /// The NAT64 address embeds an IPv4 address refused for this reason.
    Nat64(Ipv4Addr, Box<AddressRefusal>),
    /// A node's own address; the owner as [`HostAddresses::nodes`] names it.
    NodeAddress(String),
    /// An endpoint of the API server (what names it).
    ApiServer(String),
    /// Inside a Service CIDR (which).
    ServiceCidr(String),
    OutsideAllowedCidrs,
}

/// Every value of [`AddressRefusal::code`] (the metric's label values, all exported).
pub const REASON_CODES: [&str; 13] = [
    "unspecified",
    "this_network",
    "loopback",
    "cloud_metadata",
    "link_local",
    "multicast",
    "broadcast",
    "reserved",
    "ipv4_mapped",
    "node_address",
    "api_server",
    "service_cidr",
    "outside_endpoint_cidrs",
];

impl AddressRefusal {
    /// Short machine-readable reason: the `reason` label of `nodelb_endpoints_refused`.
    pub fn code(&self) -> &'static str {
        match self {
            AddressRefusal::Unspecified => "unspecified",
            AddressRefusal::ThisNetwork => "this_network",
            AddressRefusal::Loopback => "loopback",
            AddressRefusal::CloudMetadata => "cloud_metadata",
            AddressRefusal::LinkLocal => "link_local",
            AddressRefusal::Multicast => "multicast",
            AddressRefusal::Broadcast => "broadcast",
            AddressRefusal::Reserved => "reserved",
            AddressRefusal::Ipv4Mapped => "ipv4_mapped",
            AddressRefusal::Nat64(_, inner) => inner.code(),
            AddressRefusal::NodeAddress(_) => "node_address",
            AddressRefusal::ApiServer(_) => "api_server",
            AddressRefusal::ServiceCidr(_) => "service_cidr",
            AddressRefusal::OutsideAllowedCidrs => "outside_endpoint_cidrs",
        }
    }
}

impl fmt::Display for AddressRefusal {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            AddressRefusal::Unspecified => write!(f, "unspecified address"),
            AddressRefusal::ThisNetwork => write!(f, "\"this network\" address (0.0.0.0/8)"),
            AddressRefusal::Loopback => write!(f, "loopback address"),
            AddressRefusal::CloudMetadata => write!(f, "cloud metadata or platform service address"),
            AddressRefusal::LinkLocal => write!(f, "link-local address"),
            AddressRefusal::Multicast => write!(f, "multicast address"),
            AddressRefusal::Broadcast => write!(f, "broadcast address"),
            AddressRefusal::Reserved => write!(f, "reserved address"),
            AddressRefusal::Ipv4Mapped => write!(f, "IPv4-mapped or IPv4-compatible IPv6 address"),
            AddressRefusal::Nat64(v4, inner) => write!(f, "NAT64 address of {v4}, a {inner}"),
            AddressRefusal::NodeAddress(owner) => {
                write!(f, "address of {owner} (allowed only with --allow-node-endpoints)")
            }
            AddressRefusal::ApiServer(what) => write!(f, "an endpoint of the API server ({what})"),
            AddressRefusal::ServiceCidr(which) => write!(f, "inside {which}: a ClusterIP"),
            AddressRefusal::OutsideAllowedCidrs => write!(f, "outside --endpoint-cidrs"),
        }
    }
}

fn in_net(addr: IpAddr, net: &str) -> bool {
    net.parse::<IpNet>().is_ok_and(|n| n.contains(&addr))
}

/// The fixed IPv4 classes (rule 1).
fn v4_class(a: Ipv4Addr, broadcasts: &BTreeSet<IpAddr>) -> Option<AddressRefusal> {
    let ip = IpAddr::V4(a);
    Some(if a.is_unspecified() {
        AddressRefusal::Unspecified
    } else if in_net(ip, "0.0.0.0/8") {
        AddressRefusal::ThisNetwork
    } else if a.is_loopback() {
        AddressRefusal::Loopback
    } else if cloud_platform(ip) {
        AddressRefusal::CloudMetadata
    } else if a.is_link_local() {
        AddressRefusal::LinkLocal
    } else if a.is_multicast() {
        AddressRefusal::Multicast
    } else if a.is_broadcast() || broadcasts.contains(&ip) {
        AddressRefusal::Broadcast
    } else if in_net(ip, "240.0.0.0/4") {
        AddressRefusal::Reserved
    } else {
        return None;
    })
}

/// The fixed IPv6 classes (rule 1), NAT64 included (which needs the node check too).
fn v6_class(a: Ipv6Addr, host: &HostAddresses, policy: &EndpointPolicy) -> Option<AddressRefusal> {
    let ip = IpAddr::V6(a);
    Some(if a.is_unspecified() {
        AddressRefusal::Unspecified
    } else if a.is_loopback() {
        AddressRefusal::Loopback
    } else if a.to_ipv4_mapped().is_some() || in_net(ip, "::/96") {
        AddressRefusal::Ipv4Mapped
    } else if cloud_platform(ip) {
        AddressRefusal::CloudMetadata
    } else if in_net(ip, "fe80::/10") {
        AddressRefusal::LinkLocal
    } else if a.is_multicast() {
        AddressRefusal::Multicast
    } else if in_net(ip, "64:ff9b::/96") {
        let o = a.octets();
        let v4 = Ipv4Addr::new(o[12], o[13], o[14], o[15]);
        let inner = v4_class(v4, &host.broadcasts).or_else(|| node_check(IpAddr::V4(v4), host, policy))?;
        AddressRefusal::Nat64(v4, Box::new(inner))
    } else {
        return None;
    })
}

/// Rule 2: the cluster's own addresses.
fn node_check(addr: IpAddr, host: &HostAddresses, policy: &EndpointPolicy) -> Option<AddressRefusal> {
    if let Some(what) = host.api_servers.get(&addr) {
        return Some(AddressRefusal::ApiServer(what.clone()));
    }
    if let Some((_, which)) = host.service_cidrs.iter().find(|(n, _)| n.contains(&addr)) {
        return Some(AddressRefusal::ServiceCidr(which.clone()));
    }
    if policy.allow_node_addresses {
        return None;
    }
    host.nodes.get(&addr).map(|owner| AddressRefusal::NodeAddress(owner.clone()))
}

/// Whether nodelb may DNAT to `addr` (see the module documentation for the rules and their order).
pub fn check(addr: IpAddr, host: &HostAddresses, policy: &EndpointPolicy) -> Result<(), AddressRefusal> {
    let class = match addr {
        IpAddr::V4(a) => v4_class(a, &host.broadcasts),
        IpAddr::V6(a) => v6_class(a, host, policy),
    };
    if let Some(r) = class.or_else(|| node_check(addr, host, policy)) {
        return Err(r);
    }
    if !policy.allowed_cidrs.is_empty() && !policy.allowed_cidrs.iter().any(|n| n.contains(&addr)) {
        return Err(AddressRefusal::OutsideAllowedCidrs);
    }
    Ok(())
}

/// One endpoint address a Service names and nodelb does not DNAT to.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, serde::Serialize)]
pub struct RefusedEndpoint {
    pub service: ServiceKey,
    pub address: IpAddr,
    pub reason: AddressRefusal,
}

impl fmt::Display for RefusedEndpoint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Service {}: endpoint {} refused: {}", self.service, self.address, self.reason)
    }
}

/// Takes every refused address out of the endpoints of `services` and returns them, one per
/// Service and address, sorted.
pub fn filter(
    services: &mut [LbService],
    host: &HostAddresses,
    policy: &EndpointPolicy,
) -> Vec<RefusedEndpoint> {
    let mut refused = BTreeSet::new();
    for svc in services.iter_mut() {
        for port in &mut svc.ports {
            port.endpoints.retain(|e| match check(e.addr, host, policy) {
                Ok(()) => true,
                Err(reason) => {
                    refused.insert(RefusedEndpoint { service: svc.key.clone(), address: e.addr, reason });
                    false
                }
            });
        }
    }
    refused.into_iter().collect()
}

/// How many refused endpoints a message lists before "and N more" (Events and conditions are
/// read by people; a Service can have thousands of endpoints).
const LISTED: usize = 10;

/// `127.0.0.1 (loopback address), 203.0.113.2 (address of Node node-2 …)` for one Service's
/// refused endpoints (`refused` already filtered to it), at most [`LISTED`] of them.
pub fn describe(refused: &[&RefusedEndpoint]) -> String {
    let mut parts: Vec<String> =
        refused.iter().take(LISTED).map(|r| format!("{} ({})", r.address, r.reason)).collect();
    if refused.len() > LISTED {
        parts.push(format!("and {} more", refused.len() - LISTED));
    }
    parts.join(", ")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::domain::PortId;
    use crate::inputs::model::{Endpoint, LbPort};

    fn host() -> HostAddresses {
        let mut h = HostAddresses::default();
        h.add("203.0.113.1".parse().unwrap(), "this node (br-c)");
        h.add("2001:db8:1::1".parse().unwrap(), "this node (br-c)");
        h.add("203.0.113.2".parse().unwrap(), "Node node-2");
        h.broadcasts.insert("198.51.100.255".parse().unwrap());
        h.api_servers.insert("203.0.113.100".parse().unwrap(), "EndpointSlice default/kubernetes".into());
        h.service_cidrs
            .push(("10.96.0.0/16".parse().unwrap(), "ServiceCIDR kubernetes (10.96.0.0/16)".into()));
        h.service_cidrs
            .push(("fd00:96::/112".parse().unwrap(), "ServiceCIDR kubernetes (fd00:96::/112)".into()));
        h
    }

    fn cidrs(v: &[&str]) -> Vec<IpNet> {
        v.iter().map(|s| s.parse().unwrap()).collect()
    }

    /// Every address class, with the default policy and with the flags.
    #[test]
    fn address_table() {
        let default = EndpointPolicy::default();
        let allow_nodes = EndpointPolicy { allow_node_addresses: true, ..Default::default() };
        let listed = EndpointPolicy {
            allow_node_addresses: false,
            allowed_cidrs: cidrs(&["10.42.0.0/16", "198.51.100.0/24", "2001:db8:2::/64"]),
        };
        let listed_nodes = EndpointPolicy { allow_node_addresses: true, ..listed.clone() };
        // (address, default, --allow-node-endpoints, --endpoint-cidrs, both); "" = allowed.
        let cases: &[(&str, &str, &str, &str, &str)] = &[
            ("198.51.100.11", "", "", "", ""),
            ("10.42.3.4", "", "", "", ""),
            ("10.43.0.1", "", "", "outside_endpoint_cidrs", "outside_endpoint_cidrs"),
            ("192.168.1.1", "", "", "outside_endpoint_cidrs", "outside_endpoint_cidrs"),
            ("100.64.0.1", "", "", "outside_endpoint_cidrs", "outside_endpoint_cidrs"),
            ("0.0.0.0", "unspecified", "unspecified", "unspecified", "unspecified"),
            ("0.1.2.3", "this_network", "this_network", "this_network", "this_network"),
            ("127.0.0.1", "loopback", "loopback", "loopback", "loopback"),
            ("127.255.0.9", "loopback", "loopback", "loopback", "loopback"),
            ("169.254.169.254", "cloud_metadata", "cloud_metadata", "cloud_metadata", "cloud_metadata"),
            ("100.100.100.200", "cloud_metadata", "cloud_metadata", "cloud_metadata", "cloud_metadata"),
            ("168.63.129.16", "cloud_metadata", "cloud_metadata", "cloud_metadata", "cloud_metadata"),
            ("100.100.2.136", "cloud_metadata", "cloud_metadata", "cloud_metadata", "cloud_metadata"),
            ("203.0.113.100", "api_server", "api_server", "api_server", "api_server"),
            ("10.96.0.10", "service_cidr", "service_cidr", "service_cidr", "service_cidr"),
            ("169.254.1.1", "link_local", "link_local", "link_local", "link_local"),
            ("224.0.0.1", "multicast", "multicast", "multicast", "multicast"),
            ("239.255.255.250", "multicast", "multicast", "multicast", "multicast"),
            ("255.255.255.255", "broadcast", "broadcast", "broadcast", "broadcast"),
            ("198.51.100.255", "broadcast", "broadcast", "broadcast", "broadcast"),
            ("240.0.0.1", "reserved", "reserved", "reserved", "reserved"),
            ("203.0.113.1", "node_address", "", "node_address", "outside_endpoint_cidrs"),
            ("203.0.113.2", "node_address", "", "node_address", "outside_endpoint_cidrs"),
            ("::", "unspecified", "unspecified", "unspecified", "unspecified"),
            ("::1", "loopback", "loopback", "loopback", "loopback"),
            ("::ffff:127.0.0.1", "ipv4_mapped", "ipv4_mapped", "ipv4_mapped", "ipv4_mapped"),
            ("::ffff:198.51.100.11", "ipv4_mapped", "ipv4_mapped", "ipv4_mapped", "ipv4_mapped"),
            ("::198.51.100.11", "ipv4_mapped", "ipv4_mapped", "ipv4_mapped", "ipv4_mapped"),
            ("fe80::1", "link_local", "link_local", "link_local", "link_local"),
            ("febf::1", "link_local", "link_local", "link_local", "link_local"),
            ("fec0::1", "", "", "outside_endpoint_cidrs", "outside_endpoint_cidrs"),
            ("ff02::1", "multicast", "multicast", "multicast", "multicast"),
            ("fd00:ec2::254", "cloud_metadata", "cloud_metadata", "cloud_metadata", "cloud_metadata"),
            ("fd00:ec2::253", "cloud_metadata", "cloud_metadata", "cloud_metadata", "cloud_metadata"),
            ("fd00:ec2::252", "", "", "outside_endpoint_cidrs", "outside_endpoint_cidrs"),
            ("fd20:ce::254", "cloud_metadata", "cloud_metadata", "cloud_metadata", "cloud_metadata"),
            ("::ffff:168.63.129.16", "ipv4_mapped", "ipv4_mapped", "ipv4_mapped", "ipv4_mapped"),
            ("64:ff9b::a83f:8110", "cloud_metadata", "cloud_metadata", "cloud_metadata", "cloud_metadata"),
            ("fd00:96::1", "service_cidr", "service_cidr", "service_cidr", "service_cidr"),
            ("64:ff9b::a9fe:a9fe", "cloud_metadata", "cloud_metadata", "cloud_metadata", "cloud_metadata"),
            ("64:ff9b::7f00:1", "loopback", "loopback", "loopback", "loopback"),
            ("64:ff9b::cb00:7101", "node_address", "", "node_address", "outside_endpoint_cidrs"),
            ("64:ff9b::c633:640b", "", "", "outside_endpoint_cidrs", "outside_endpoint_cidrs"),
            ("2001:db8:2::11", "", "", "", ""),
            ("2001:db8:1::1", "node_address", "", "node_address", "outside_endpoint_cidrs"),
            ("fd12:3456::1", "", "", "outside_endpoint_cidrs", "outside_endpoint_cidrs"),
        ];
        let h = host();
        for (addr, d, n, l, ln) in cases {
            let ip: IpAddr = addr.parse().unwrap();
            for (policy, want, what) in [
                (&default, d, "default"),
                (&allow_nodes, n, "nodes"),
                (&listed, l, "cidrs"),
                (&listed_nodes, ln, "both"),
            ] {
                let got = check(ip, &h, policy).err().map(|r| r.code()).unwrap_or("");
                assert_eq!(got, *want, "{addr} with {what}");
            }
        }
    }

    #[test]
    fn messages_name_the_reason() {
        let h = host();
        let p = EndpointPolicy::default();
        let msg = |a: &str| check(a.parse().unwrap(), &h, &p).unwrap_err().to_string();
        assert_eq!(msg("169.254.169.254"), "cloud metadata or platform service address");
        assert_eq!(msg("203.0.113.100"), "an endpoint of the API server (EndpointSlice default/kubernetes)");
        assert_eq!(msg("10.96.0.1"), "inside ServiceCIDR kubernetes (10.96.0.0/16): a ClusterIP");
        assert_eq!(msg("203.0.113.2"), "address of Node node-2 (allowed only with --allow-node-endpoints)");
        assert_eq!(msg("64:ff9b::7f00:1"), "NAT64 address of 127.0.0.1, a loopback address");
    }

    fn port(addrs: &[&str]) -> LbPort {
        LbPort {
            id: PortId::tcp(80),
            name: String::new(),
            endpoints: addrs
                .iter()
                .map(|a| Endpoint {
                    addr: a.parse().unwrap(),
                    port: 8080,
                    node_name: None,
                    ready: true,
                    serving: true,
                    terminating: false,
                })
                .collect(),
        }
    }

    #[test]
    fn filter_keeps_the_valid_endpoints_and_names_the_others() {
        let key = ServiceKey::new("default", "web");
        let mut svc = LbService::with_defaults(
            key.clone(),
            vec![port(&["198.51.100.11", "127.0.0.1", "169.254.169.254"]), {
                let mut p = port(&["127.0.0.1", "198.51.100.12"]);
                p.id = PortId::tcp(443);
                p
            }],
        );
        svc.families.push(crate::domain::Family::Ipv6);
        let mut services = vec![svc];
        let refused = filter(&mut services, &host(), &EndpointPolicy::default());
        let kept: Vec<Vec<String>> = services[0]
            .ports
            .iter()
            .map(|p| p.endpoints.iter().map(|e| e.addr.to_string()).collect())
            .collect();
        assert_eq!(kept, vec![vec!["198.51.100.11"], vec!["198.51.100.12"]]);
        let got: Vec<String> = refused.iter().map(ToString::to_string).collect();
        assert_eq!(
            got,
            vec![
                "Service default/web: endpoint 127.0.0.1 refused: loopback address",
                "Service default/web: endpoint 169.254.169.254 refused: cloud metadata or platform service address",
            ],
            "one per address, not per port"
        );
        let refs: Vec<&RefusedEndpoint> = refused.iter().collect();
        assert_eq!(
            describe(&refs),
            "127.0.0.1 (loopback address), 169.254.169.254 (cloud metadata or platform service address)"
        );
        let many: Vec<RefusedEndpoint> = (0..12)
            .map(|i| RefusedEndpoint {
                service: key.clone(),
                address: IpAddr::V4(Ipv4Addr::new(127, 0, 0, i)),
                reason: AddressRefusal::Loopback,
            })
            .collect();
        let refs: Vec<&RefusedEndpoint> = many.iter().collect();
        assert!(describe(&refs).ends_with("127.0.0.9 (loopback address), and 2 more"), "{}", describe(&refs));
    }
}
