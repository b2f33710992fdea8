//! Node port pools in Kubernetes mode: from the cached `NodePortPool`, Namespace and Node objects
//! to the [`PoolContext`] the pure decisions ([`crate::pool`]) take. Every agent builds the same
//! context from the same objects, so the leader's allocation and each node's serving agree
//! without another annotation; the node adds its own labels (which pools select it).

use std::collections::{BTreeMap, BTreeSet};

use k8s_openapi::api::core::v1::Node;

use crate::alloc::PortRange;
use crate::model::ServiceKey;
use crate::pool::{Assignment, InvalidPool, LastValid, PoolContext, PoolObject, PoolSet};

use super::source::KubeSnapshot;

/// The pools in force for `snap` (an invalid edit keeps `last_valid`'s version), resolved
/// against every Node's labels, with `node`'s own labels; and the invalid pools.
pub fn context(
    snap: &KubeSnapshot,
    last_valid: &mut LastValid,
    flag_range: PortRange,
    node: &str,
) -> (PoolContext, Vec<InvalidPool>) {
    let objects: Vec<PoolObject> = snap.pools.iter().map(|p| PoolObject::from_resource(p)).collect();
    let (pools, invalid) = last_valid.update(&objects);
    let labels = |n: &Node| n.metadata.labels.clone().unwrap_or_default();
    let node_labels: Vec<BTreeMap<String, String>> = snap.nodes.iter().map(|n| labels(n)).collect();
    let refs: Vec<&BTreeMap<String, String>> = node_labels.iter().collect();
    let set = PoolSet::resolve(pools, !objects.is_empty(), flag_range, &refs);
    let namespaces = snap
        .namespaces
        .iter()
        .filter_map(|ns| Some((ns.metadata.name.clone()?, ns.metadata.labels.clone().unwrap_or_default())))
        .collect();
    let own = snap
        .nodes
        .iter()
        .find(|n| n.metadata.name.as_deref() == Some(node))
        .map(|n| labels(n))
        .unwrap_or_default();
    (PoolContext { set, namespaces, node_labels: own }, invalid)
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
