//! Which nodes can serve, and at which addresses. Pure.
//!
//! **Addresses.** Per node and per family: the node's `ExternalIP` addresses of that family when it
//! has any, else its `InternalIP` addresses of that family (so a node with a public IPv4 and only
//! an internal IPv6 publishes both). `--node-addresses CIDR,…` restricts them further. Nodes
//! labelled `node.kubernetes.io/exclude-from-external-load-balancers` or being deleted are never
//! listed.
//!
//! **Serving.** Every agent keeps a per-node Lease `nodelb-node-<node>` in the agent namespace,
//! renewed while the agent runs, with the families it currently serves in the annotation
//! `nodelb.io/families` (`ipv4,ipv6`; empty while it is not ready: caches not synced, last sync
//! failed, or forwarding off for that family). A node serves a family iff its lease is fresh
//! (`renewTime + leaseDurationSeconds` is in the future) and lists the family. Freshness compares
//! wall clocks of two machines, like the node lifecycle controller's use of kubelet Leases: nodes
//! are expected to run NTP.

use std::borrow::Borrow;
use std::collections::{BTreeMap, BTreeSet};
use std::net::IpAddr;

use ipnet::IpNet;
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::Node;
use k8s_openapi::jiff::{SignedDuration, Timestamp};

use crate::decisions::endpoint_policy::HostAddresses;
use crate::decisions::pool::AddressType;
use crate::decisions::port_policy::Listeners;
use crate::domain::{Family, Protocol};
use crate::inputs::model::LABEL_EXCLUDE_LB;

/// Prefix of the per-node Lease names (`nodelb-node-<node>`).
pub const NODE_LEASE_PREFIX: &str = "nodelb-node-";
/// Annotation on a node Lease: the families the agent serves, comma-separated (`ipv4,ipv6`).
pub const ANNOTATION_FAMILIES: &str = "nodelb.io/families";
/// Annotation on a node Lease: the ports processes on that node listen on that nodelb could
/// otherwise allocate (`22/TCP,20005/UDP`; [`crate::decisions::port_policy::Listeners::format_relevant`]).
/// The leader treats them as taken on every node.
pub const ANNOTATION_LISTENING: &str = "nodelb.io/listening-ports";
/// Annotation on a node Lease: the addresses this node's agent selected (and serves) for each
/// node port pool that restricts addresses and selects this node
/// (`edge=192.0.2.1,2001:db8::1;other=198.51.100.7`; [`format_pool_addresses`]). A pool it
/// does not name: this node serves none of its addresses. Absent: not published (an agent
/// of a version without this annotation, one not synced yet, or a value that would exceed
/// [`MAX_POOL_ADDRESSES_LEN`]); the leader then judges from the Node object
/// ([`pool_addresses_of`]).
pub const ANNOTATION_POOL_ADDRESSES: &str = "nodelb.io/pool-addresses";
/// Longest [`ANNOTATION_POOL_ADDRESSES`] value written or read (all of a Lease's annotations
/// share the API server's 256 KiB limit).
pub const MAX_POOL_ADDRESSES_LEN: usize = 16 * 1024;
/// Label on node Leases, so the leader can watch only them.
pub const LABEL_NODE_LEASE: &str = "nodelb.io/node-lease";
/// Annotation on a node Lease: the addresses of that node as its agent reads them from its
/// kernel (every interface: a second NIC, a CNI bridge or tunnel gateway, one added after
/// start), comma-separated. No node DNATs to them ([`crate::decisions::endpoint_policy`]): the Node object
/// lists only some of a node's addresses.
pub const ANNOTATION_ADDRESSES: &str = "nodelb.io/addresses";
/// Annotation on a node Lease: the forms of the node-port registry its agent reads
/// ([`REGISTRY_FORMAT`]). A leader writes a number with several holders only while every
/// running agent reads them ([`registry_format_unread`]): an agent that cannot would serve
/// only its first holder, and as leader would keep only that one.
pub const ANNOTATION_REGISTRY_FORMAT: &str = "nodelb.io/registry-format";
/// What this agent writes in [`ANNOTATION_REGISTRY_FORMAT`]: numbers with several holders.
pub const REGISTRY_FORMAT: &str = "shared";

/// Most addresses [`ANNOTATION_ADDRESSES`] holds (written or read).
pub const MAX_PUBLISHED_ADDRESSES: usize = 256;
/// The Service whose EndpointSlice names the API server's endpoints.
pub const API_SERVER_SERVICE: (&str, &str) = ("default", "kubernetes");

/// [`ANNOTATION_ADDRESSES`] of this node's addresses (`own`: read from its kernel): the ones
/// another node could DNAT to (not loopback, link-local or multicast: refused anyway), sorted,
/// at most [`MAX_PUBLISHED_ADDRESSES`].
pub fn format_published_addresses(own: &HostAddresses) -> String {
    let global = |a: &&IpAddr| match a {
        IpAddr::V4(v4) => {
            !v4.is_loopback() && !v4.is_link_local() && !v4.is_multicast() && !v4.is_unspecified()
        }
        IpAddr::V6(v6) => {
            !v6.is_loopback()
                && !v6.is_multicast()
                && !v6.is_unspecified()
                && (v6.segments()[0] & 0xffc0) != 0xfe80
        }
    };
    let addrs: Vec<String> =
        own.nodes.keys().filter(global).take(MAX_PUBLISHED_ADDRESSES).map(IpAddr::to_string).collect();
    addrs.join(",")
}

/// What makes up the cluster's own addresses besides the Node objects: the node Leases (their
/// published addresses), the API server's EndpointSlices and the Service CIDRs.
pub struct ClusterObjects<'a, L, S, C> {
    pub leases: &'a [L],
    /// The EndpointSlices of `default/kubernetes` ([`API_SERVER_SERVICE`]).
    pub api_server: &'a [S],
    pub service_cidrs: &'a [C],
}

pub fn node_lease_name(node: &str) -> String {
    format!("{NODE_LEASE_PREFIX}{node}")
}

/// Status addresses of a node (see the module docs), sorted, restricted to `allowed` when not empty.
pub fn node_addresses(node: &Node, allowed: &[IpNet]) -> Vec<IpAddr> {
    let addrs = node.status.as_ref().and_then(|s| s.addresses.as_ref());
    let of = |kind: &str, f: Family| -> Vec<IpAddr> {
        addrs
            .into_iter()
            .flatten()
            .filter(|a| a.type_ == kind)
            .filter_map(|a| a.address.trim().parse::<IpAddr>().ok())
            .filter(|ip| Family::of(ip) == f)
            .filter(|ip| allowed.is_empty() || allowed.iter().any(|n| n.contains(ip)))
            .collect()
    };
    let mut out = Vec::new();
    for f in Family::ALL {
        let external = of("ExternalIP", f);
        out.extend(if external.is_empty() { of("InternalIP", f) } else { external });
    }
    out.sort();
    out.dedup();
    out
}

/// The addresses of a Node the leader publishes for a Service whose node port pool restricts
/// addresses (`filter`): every IP address in its `status.addresses` the filter accepts
/// ([`crate::decisions::pool::AddressFilter::publishes`]), restricted to `allowed` (`--node-addresses`)
/// when not empty, sorted. Unlike [`node_addresses`], InternalIP and ExternalIP alike: the pool
/// says which.
pub fn pool_addresses(
    node: &Node,
    filter: &crate::decisions::pool::AddressFilter,
    allowed: &[IpNet],
) -> Vec<IpAddr> {
    let mut out: Vec<IpAddr> = node
        .status
        .as_ref()
        .and_then(|s| s.addresses.as_ref())
        .into_iter()
        .flatten()
        .filter_map(|a| Some((AddressType::parse(&a.type_), a.address.trim().parse::<IpAddr>().ok()?)))
        .filter(|(kind, ip)| filter.publishes(*kind, ip))
        .map(|(_, ip)| ip)
        .filter(|ip| allowed.is_empty() || allowed.iter().any(|n| n.contains(ip)))
        .collect();
    out.sort();
    out.dedup();
    out
}

/// A Node's `status.addresses` of the types a node port pool can name (`ExternalIP`,
/// `InternalIP`), by address.
pub fn address_types(node: &Node) -> BTreeMap<IpAddr, BTreeSet<AddressType>> {
    let mut out: BTreeMap<IpAddr, BTreeSet<AddressType>> = BTreeMap::new();
    for a in node.status.as_ref().and_then(|s| s.addresses.as_ref()).into_iter().flatten() {
        if let (Some(kind), Ok(ip)) = (AddressType::parse(&a.type_), a.address.trim().parse::<IpAddr>()) {
            out.entry(ip).or_default().insert(kind);
        }
    }
    out
}

/// Every IP address of every Node object (any address type), owned by `Node <name>`: the
/// addresses the endpoint policy refuses as a node's own ([`crate::decisions::endpoint_policy`]). Not
/// restricted by `--node-addresses` (that only says which addresses are published).
pub fn cluster_node_addresses<N: Borrow<Node>>(nodes: &[N]) -> HostAddresses {
    let mut out = HostAddresses::default();
    for node in nodes.iter().map(Borrow::borrow) {
        let name = node.metadata.name.as_deref().unwrap_or("<unnamed>");
        let addrs = node.status.as_ref().and_then(|s| s.addresses.as_ref());
        for a in addrs.into_iter().flatten() {
            if let Ok(ip) = a.address.trim().parse::<IpAddr>() {
                out.add(ip, format!("Node {name}"));
            }
        }
    }
    out
}

/// [`cluster_node_addresses`], and the addresses every agent publishes for its node
/// ([`ANNOTATION_ADDRESSES`]: `node node-2 (its agent)`), the API server's endpoints and the
/// Service CIDRs: everything the endpoint policy refuses as the cluster's own.
pub fn cluster_addresses<N, L, S, C>(nodes: &[N], more: ClusterObjects<'_, L, S, C>) -> HostAddresses
where
    N: Borrow<Node>,
    L: Borrow<Lease>,
    S: Borrow<crate::inputs::compact::EndpointSlice>,
    C: Borrow<k8s_openapi::api::networking::v1::ServiceCIDR>,
{
    let mut out = cluster_node_addresses(nodes);
    for lease in more.leases.iter().map(Borrow::borrow) {
        let Some(node) = lease.metadata.name.as_deref().and_then(|n| n.strip_prefix(NODE_LEASE_PREFIX))
        else {
            continue;
        };
        let value = lease.metadata.annotations.as_ref().and_then(|a| a.get(ANNOTATION_ADDRESSES));
        for ip in value.into_iter().flat_map(|v| v.split(',')).take(MAX_PUBLISHED_ADDRESSES) {
            if let Ok(ip) = ip.trim().parse::<IpAddr>() {
                out.add(ip, format!("node {node} (its agent)"));
            }
        }
    }
    for slice in more.api_server.iter().map(Borrow::borrow) {
        if crate::inputs::model::slice_service(slice) != Some(API_SERVER_SERVICE) {
            continue;
        }
        let name = slice.metadata.name.as_deref().unwrap_or_default();
        for e in slice.endpoints.iter().flatten() {
            for a in e.addresses.iter() {
                if let crate::inputs::compact::Address::Ip(ip) = a {
                    out.api_servers.entry(*ip).or_insert_with(|| format!("EndpointSlice default/{name}"));
                }
            }
        }
    }
    for cidr in more.service_cidrs.iter().map(Borrow::borrow) {
        let name = cidr.metadata.name.as_deref().unwrap_or_default();
        for c in cidr.spec.iter().flat_map(|s| s.cidrs.iter().flatten()) {
            if let Ok(net) = c.trim().parse::<IpNet>() {
                out.service_cidrs.push((net, format!("ServiceCIDR {name} ({net})")));
            }
        }
    }
    out
}

/// Families a per-node Lease says its agent serves, `None` when the lease is not fresh at `now`.
/// `now: None` judges no expiry (the families last reported count): for a view of the Leases
/// that may be behind, e.g. just after the API came back from an outage, during which no agent
/// could renew (see [`serving_nodes`]).
pub fn lease_families(lease: &Lease, now: Option<Timestamp>) -> Option<BTreeSet<Family>> {
    if !lease_fresh(lease, now)? {
        return None;
    }
    let value = lease.metadata.annotations.as_ref().and_then(|a| a.get(ANNOTATION_FAMILIES))?;
    Some(
        value
            .split(',')
            .filter_map(|f| match f.trim().to_ascii_lowercase().as_str() {
                "ipv4" => Some(Family::Ipv4),
                "ipv6" => Some(Family::Ipv6),
                _ => None,
            })
            .collect(),
    )
}

/// Whether a Lease was renewed less than its duration before `now` (`None`: judged fresh, see
/// [`lease_families`]); `None` when it has no renewal time or duration.
pub fn lease_fresh(lease: &Lease, now: Option<Timestamp>) -> Option<bool> {
    let spec = lease.spec.as_ref()?;
    let renewed = spec.renew_time.as_ref()?.0;
    let duration = SignedDuration::from_secs(i64::from(spec.lease_duration_seconds?.max(0)));
    Some(now.is_none_or(|now| renewed + duration > now))
}

/// The nodes whose agent runs (its per-node Lease is fresh at `now`, as [`lease_families`] judges
/// it) but has not said yet which ports processes there listen on: no [`ANNOTATION_LISTENING`],
/// which an agent publishes once it has read its node's sockets, in its first sync. Until then
/// a new number could be one such a process holds (the agent's own health and metrics
/// listeners, at least), so the leader hands out none. A node whose agent has not written its
/// Lease at all is not waited for: the controller runs on no node of its own, and a node that
/// joins later refuses a number one of its processes holds (`in use`). Sorted.
pub fn listeners_unreported<L: Borrow<Lease>>(leases: &[L], now: Option<Timestamp>) -> Vec<String> {
    let reported =
        |l: &Lease| l.metadata.annotations.as_ref().is_some_and(|a| a.contains_key(ANNOTATION_LISTENING));
    fn node(l: &Lease) -> Option<&str> {
        l.metadata.name.as_deref()?.strip_prefix(NODE_LEASE_PREFIX)
    }
    let mut out: Vec<String> = leases
        .iter()
        .map(Borrow::borrow)
        .filter(|l| lease_fresh(l, now) == Some(true) && !reported(l))
        .filter_map(|l| node(l).map(str::to_string))
        .collect();
    out.sort();
    out
}

/// The nodes whose agent runs (its per-node Lease is fresh at `now`) but does not say it reads
/// numbers with several holders ([`ANNOTATION_REGISTRY_FORMAT`]): an agent of an older version.
/// Sorted.
pub fn registry_format_unread<L: Borrow<Lease>>(leases: &[L], now: Option<Timestamp>) -> Vec<String> {
    let reads = |l: &Lease| {
        let value = l.metadata.annotations.as_ref().and_then(|a| a.get(ANNOTATION_REGISTRY_FORMAT));
        value.is_some_and(|v| v.split(',').any(|f| f.trim() == REGISTRY_FORMAT))
    };
    let mut out: Vec<String> = (leases.iter().map(Borrow::borrow))
        .filter(|l| lease_fresh(l, now) == Some(true) && !reads(l))
        .filter_map(|l| l.metadata.name.as_deref()?.strip_prefix(NODE_LEASE_PREFIX).map(str::to_string))
        .collect();
    out.sort();
    out
}

/// The ports some node's agent says a process there listens on ([`ANNOTATION_LISTENING`]), with
/// the nodes, as the allocator takes them: `a process listens on it on node-2, node-3`. Every
/// Lease counts, fresh or not (a port in use on a node that is down for a moment is still
/// better not handed out).
pub fn listening_ports<L: Borrow<Lease>>(leases: &[L]) -> BTreeMap<(Protocol, u16), String> {
    let mut by_port: BTreeMap<(Protocol, u16), Vec<&str>> = BTreeMap::new();
    for lease in leases.iter().map(Borrow::borrow) {
        let Some(node) = lease.metadata.name.as_deref().and_then(|n| n.strip_prefix(NODE_LEASE_PREFIX))
        else {
            continue;
        };
        let value = lease.metadata.annotations.as_ref().and_then(|a| a.get(ANNOTATION_LISTENING));
        for key in value.map(|v| Listeners::parse_published(v)).unwrap_or_default() {
            by_port.entry(key).or_default().push(node);
        }
    }
    by_port
        .into_iter()
        .map(|(k, nodes)| (k, format!("a process listens on it on {}", nodes.join(", "))))
        .collect()
}

/// Per node port pool, the addresses a node serves it on.
pub type PoolSelections = BTreeMap<String, BTreeSet<IpAddr>>;

/// Formats [`ANNOTATION_POOL_ADDRESSES`]: pools sorted by name, `;`-separated, each
/// `name=addr,addr` (a pool with no address is left out). `None` when longer than
/// [`MAX_POOL_ADDRESSES_LEN`]: then nothing is published.
pub fn format_pool_addresses(selected: &PoolSelections) -> Option<String> {
    let value = selected
        .iter()
        .filter(|(_, addrs)| !addrs.is_empty())
        .map(|(pool, addrs)| {
            let addrs: Vec<String> = addrs.iter().map(IpAddr::to_string).collect();
            format!("{pool}={}", addrs.join(","))
        })
        .collect::<Vec<_>>()
        .join(";");
    (value.len() <= MAX_POOL_ADDRESSES_LEN).then_some(value)
}

/// Parses [`ANNOTATION_POOL_ADDRESSES`] (written by another node: anything may be in it). An
/// error says what is wrong; the caller treats the node as not having published.
pub fn parse_pool_addresses(value: &str) -> Result<PoolSelections, String> {
    if value.len() > MAX_POOL_ADDRESSES_LEN {
        return Err(format!("{} bytes, more than the {MAX_POOL_ADDRESSES_LEN} allowed", value.len()));
    }
    let mut out = PoolSelections::new();
    for entry in value.split(';').map(str::trim).filter(|e| !e.is_empty()) {
        let Some((pool, addrs)) = entry.split_once('=') else {
            return Err(format!("entry {entry:?} is not pool=address,..."));
        };
        let pool = pool.trim();
        if pool.is_empty() {
            return Err(format!("entry {entry:?} names no pool"));
        }
        if out.contains_key(pool) {
            return Err(format!("pool {pool:?} is listed twice"));
        }
        let addrs = addrs
            .split(',')
            .map(str::trim)
            .filter(|a| !a.is_empty())
            .map(|a| a.parse::<IpAddr>().map_err(|_| format!("pool {pool:?}: {a:?} is not an IP address")))
            .collect::<Result<BTreeSet<IpAddr>, String>>()?;
        out.insert(pool.to_string(), addrs);
    }
    Ok(out)
}

/// What a node Lease says its node selected per pool ([`ANNOTATION_POOL_ADDRESSES`]):
/// `Ok(None)` when it does not say.
pub fn lease_pool_addresses(lease: &Lease) -> Result<Option<PoolSelections>, String> {
    match lease.metadata.annotations.as_ref().and_then(|a| a.get(ANNOTATION_POOL_ADDRESSES)) {
        None => Ok(None),
        Some(v) => parse_pool_addresses(v).map(Some),
    }
}

/// Per node, what its Lease says it selected per pool ([`lease_pool_addresses`]); nodes whose
/// Lease does not say are absent. A malformed value counts as not published and comes back as
/// `(node, why)` for the log.
pub fn published_pool_addresses<L: Borrow<Lease>>(
    leases: &[L],
) -> (BTreeMap<String, PoolSelections>, Vec<(String, String)>) {
    let mut out = BTreeMap::new();
    let mut malformed = Vec::new();
    for lease in leases.iter().map(Borrow::borrow) {
        let Some(node) = lease.metadata.name.as_deref().and_then(|n| n.strip_prefix(NODE_LEASE_PREFIX))
        else {
            continue;
        };
        match lease_pool_addresses(lease) {
            Ok(Some(p)) => {
                out.insert(node.to_string(), p);
            }
            Ok(None) => {}
            Err(why) => malformed.push((node.to_string(), why)),
        }
    }
    (out, malformed)
}

/// The leader's choice of the addresses a node's status entry lists for a Service of node port
/// pool `pool` (with address filter `filter`), restricted to `allowed` (`--node-addresses`) when
/// not empty, sorted: what the node published for that pool (`published`: its Lease's
/// [`ANNOTATION_POOL_ADDRESSES`]; a pool it does not name: nothing) — the addresses that
/// answer there. A node that has not published (`None`) is judged from its Node object
/// ([`pool_addresses`]), as before the annotation existed.
///
/// What a node publishes is checked, not taken on its word: a published address is listed only
/// when the node's Node object has it (InternalIP or ExternalIP), or it lies in a bound the operator set (the
/// pool's `addresses.cidrs`, or `allowed`). Otherwise an agent (or whoever holds its token)
/// could make every Service of the pool publish an address of its choosing, another node's or
/// one outside the cluster, to clients, DNS and gateways reading the status.
pub fn pool_addresses_of(
    node: &Node,
    published: Option<&PoolSelections>,
    pool: &str,
    filter: &crate::decisions::pool::AddressFilter,
    allowed: &[IpNet],
) -> Vec<IpAddr> {
    let Some(published) = published else { return pool_addresses(node, filter, allowed) };
    let own: BTreeSet<IpAddr> = address_types(node).into_keys().collect();
    let bounded = |ip: &IpAddr| {
        own.contains(ip)
            || filter.cidrs.iter().any(|n| n.contains(ip))
            || (!allowed.is_empty() && allowed.iter().any(|n| n.contains(ip)))
    };
    published
        .get(pool)
        .into_iter()
        .flatten()
        .copied()
        .filter(|ip| allowed.is_empty() || allowed.iter().any(|n| n.contains(ip)))
        .filter(bounded)
        .collect()
}

/// Formats families for [`ANNOTATION_FAMILIES`].
pub fn format_families(families: &BTreeSet<Family>) -> String {
    families.iter().map(|f| f.name()).collect::<Vec<_>>().join(",")
}

/// A node whose agent serves at least one family, with its status addresses of those families.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ServingNode {
    pub name: String,
    pub families: BTreeSet<Family>,
    /// Only addresses of served families.
    pub addresses: Vec<IpAddr>,
}

/// The nodes that can serve, by name: existing, not excluded, not being deleted, with a fresh
/// lease listing at least one family, and with an address of such a family.
///
/// `now: None` when the caller cannot trust its view of the Leases to be current (its watch failed,
/// or recovered less than a lease duration ago): every agent was probably cut off too, and their
/// renewals may not have arrived yet, so expiry would drop every node from every Service's status
/// for a moment. Then a lease's last reported families count, fresh or not; an agent that reported
/// "not ready" (no families) is still left out.
pub fn serving_nodes<N: Borrow<Node>, L: Borrow<Lease>>(
    nodes: &[N],
    leases: &[L],
    now: Option<Timestamp>,
    allowed: &[IpNet],
) -> BTreeMap<String, ServingNode> {
    let by_node: BTreeMap<&str, &Lease> = leases
        .iter()
        .map(Borrow::borrow)
        .filter_map(|l| {
            let name = l.metadata.name.as_deref()?.strip_prefix(NODE_LEASE_PREFIX)?;
            Some((name, l))
        })
        .collect();
    let mut out = BTreeMap::new();
    for node in nodes.iter().map(Borrow::borrow) {
        let Some(name) = node.metadata.name.as_deref() else { continue };
        if node.metadata.deletion_timestamp.is_some()
            || node.metadata.labels.as_ref().is_some_and(|l| l.contains_key(LABEL_EXCLUDE_LB))
        {
            continue;
        }
        let Some(families) = by_node.get(name).and_then(|l| lease_families(l, now)) else { continue };
        let addresses: Vec<IpAddr> =
            node_addresses(node, allowed).into_iter().filter(|a| families.contains(&Family::of(a))).collect();
        if addresses.is_empty() {
            continue;
        }
        out.insert(name.to_string(), ServingNode { name: name.to_string(), families, addresses });
    }
    out
}

#[cfg(test)]
mod tests;
