//! Node port pools in Kubernetes mode: from the cached `NodePortPool`, Namespace and Node objects
//! to the [`PoolContext`] the pure decisions ([`crate::decisions::pool`]) take, and what the leader's round
//! reads of them per Service (the nodes and addresses its pool selects). Every agent builds the
//! same context from the same objects, so the leader's allocation and each node's serving agree
//! without another annotation; the node adds its own labels (which pools select it).

use std::collections::{BTreeMap, BTreeSet};

use k8s_openapi::api::core::v1::{Node, Service};

use crate::decisions::pool::{Assignment, ContextInput, InvalidPool, LastValid, PoolContext, PoolObject};
use crate::decisions::port_policy::PortRange;
use crate::domain::ServiceKey;

use super::nodes::PoolSelections;
use super::snapshot::KubeSnapshot;

/// The pools in force for `snap` (an invalid edit keeps `last_valid`'s version), resolved
/// against every Node's labels, with `node`'s own labels; and the invalid pools. `servicelb`:
/// `--servicelb-labels`.
pub fn context(
    snap: &KubeSnapshot,
    last_valid: &mut LastValid,
    flag_range: PortRange,
    node: Option<&str>,
    servicelb: bool,
) -> (PoolContext, Vec<InvalidPool>) {
    let objects: Vec<PoolObject> = snap.pools.iter().map(|p| PoolObject::from_resource(p)).collect();
    let labels = |n: &Node| n.metadata.labels.clone().unwrap_or_default();
    let node_labels: Vec<BTreeMap<String, String>> = snap.nodes.iter().map(|n| labels(n)).collect();
    let refs: Vec<&BTreeMap<String, String>> = node_labels.iter().collect();
    let own =
        snap.nodes.iter().position(|n| node.is_some() && n.metadata.name.as_deref() == node).map(|i| refs[i]);
    let namespaces = || {
        snap.namespaces
            .iter()
            .filter_map(|ns| {
                Some((ns.metadata.name.clone()?, ns.metadata.labels.clone().unwrap_or_default()))
            })
            .collect()
    };
    let input =
        ContextInput { objects: &objects, flag_range, nodes: &refs, own, namespaces: &namespaces, servicelb };
    crate::decisions::pool::context(last_valid, &input)
}

/// Per Service whose pool restricts nodes (`nodeSelector`), the names of the Nodes it selects.
pub fn selected_nodes<N: std::borrow::Borrow<Node>>(
    ctx: &PoolContext,
    assignment: &Assignment,
    nodes: &[N],
) -> BTreeMap<ServiceKey, BTreeSet<String>> {
    let mut out = BTreeMap::new();
    for (key, ranges) in &assignment.ranges {
        let Some(pool) = ctx.set.get(&ranges.pool) else { continue };
        if pool.pool.nodes.is_everything() {
            continue;
        }
        let empty = BTreeMap::new();
        let names = nodes
            .iter()
            .map(|n| &n.borrow().metadata)
            .filter(|m| pool.pool.nodes.matches(m.labels.as_ref().unwrap_or(&empty)))
            .filter_map(|m| m.name.clone())
            .collect();
        out.insert(key.clone(), names);
    }
    out
}

/// Per Service whose pool restricts node addresses (`addresses`), per Node, the addresses its
/// status lists ([`crate::k8s::nodes::pool_addresses_of`]: what the node published on its Lease,
/// else the Node object's; `published`: what the nodes published per pool,
/// [`crate::k8s::nodes::published_pool_addresses`]; `allowed`: `--node-addresses`).
pub fn published_addresses<N: std::borrow::Borrow<Node>>(
    ctx: &PoolContext,
    assignment: &Assignment,
    nodes: &[N],
    published: &BTreeMap<String, PoolSelections>,
    allowed: &[ipnet::IpNet],
) -> BTreeMap<ServiceKey, BTreeMap<String, Vec<std::net::IpAddr>>> {
    let mut out = BTreeMap::new();
    for (key, ranges) in &assignment.ranges {
        let Some(pool) = ctx.set.get(&ranges.pool) else { continue };
        if pool.pool.addresses.is_everything() {
            continue;
        }
        let per_node = nodes
            .iter()
            .map(|n| n.borrow())
            .filter_map(|n| {
                let name = n.metadata.name.clone()?;
                let addrs = crate::k8s::nodes::pool_addresses_of(
                    n,
                    published.get(&name),
                    &pool.pool.name,
                    &pool.pool.addresses,
                    allowed,
                );
                Some((name, addrs))
            })
            .collect();
        out.insert(key.clone(), per_node);
    }
    out
}

/// `selected` (per Service, the Nodes its pool selects; absent: every Node) narrowed by the k3s
/// ServiceLB labels when they are in force: a Node serves a Service when both select it.
pub fn narrow_by_servicelb<S: std::borrow::Borrow<Service>, N: std::borrow::Borrow<Node>>(
    ctx: &PoolContext,
    services: &[S],
    nodes: &[N],
    selected: Option<BTreeMap<ServiceKey, BTreeSet<String>>>,
) -> Option<BTreeMap<ServiceKey, BTreeSet<String>>> {
    if !ctx.servicelb {
        return selected;
    }
    let empty = BTreeMap::new();
    let mut out = selected.unwrap_or_default();
    for svc in services.iter().map(|s| s.borrow()) {
        let svc_labels = svc.metadata.labels.as_ref().unwrap_or(&empty);
        let serving: BTreeSet<String> = nodes
            .iter()
            .map(|n| &n.borrow().metadata)
            .filter(|m| {
                crate::decisions::servicelb::serves(m.labels.as_ref().unwrap_or(&empty), svc_labels).is_ok()
            })
            .filter_map(|m| m.name.clone())
            .collect();
        out.entry(crate::inputs::model::service_key(svc))
            .and_modify(|names| names.retain(|n| serving.contains(n)))
            .or_insert(serving);
    }
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::decisions::pool::PoolSet;
    use crate::decisions::servicelb::{LABEL_ENABLELB, LABEL_LBPOOL};

    fn node(name: &str, labels: &[(&str, &str)]) -> Node {
        let mut n = Node::default();
        n.metadata.name = Some(name.into());
        n.metadata.labels = Some(labels.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect());
        n
    }

    fn service(name: &str, labels: &[(&str, &str)]) -> Service {
        let mut s = Service::default();
        s.metadata.name = Some(name.into());
        s.metadata.namespace = Some("default".into());
        s.metadata.labels = Some(labels.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect());
        s
    }

    fn key(name: &str) -> ServiceKey {
        crate::inputs::model::service_key(&service(name, &[]))
    }

    fn names(n: &[&str]) -> BTreeSet<String> {
        n.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn servicelb_labels_narrow_what_the_pools_select() {
        let nodes = [
            node("a", &[(LABEL_ENABLELB, "true"), (LABEL_LBPOOL, "edge")]),
            node("b", &[(LABEL_ENABLELB, "true"), ("zone", "b")]),
            node("c", &[(LABEL_ENABLELB, "false"), ("zone", "b")]),
        ];
        let services = [service("plain", &[]), service("edge", &[(LABEL_LBPOOL, "edge")])];
        let ctx = |servicelb| PoolContext {
            set: PoolSet::resolve(vec![], false, PortRange { first: 20000, last: 29999 }, &[]),
            namespaces: BTreeMap::new(),
            node_labels: BTreeMap::new(),
            servicelb,
        };
        // Not in force: the pools' selection as it is (none: every node).
        assert_eq!(narrow_by_servicelb(&ctx(false), &services, &nodes, None), None);
        // In force, no pool restriction: the labels alone.
        let got = narrow_by_servicelb(&ctx(true), &services, &nodes, None).unwrap();
        assert_eq!(got[&key("plain")], names(&["a", "b"]));
        assert_eq!(got[&key("edge")], names(&["a"]));
        // A pool selecting b and c: both must select.
        let pool = BTreeMap::from([(key("plain"), names(&["b", "c"])), (key("edge"), names(&["b", "c"]))]);
        let got = narrow_by_servicelb(&ctx(true), &services, &nodes, Some(pool)).unwrap();
        assert_eq!(got[&key("plain")], names(&["b"]));
        assert_eq!(got[&key("edge")], names(&[]));
    }
}
