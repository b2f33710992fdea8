//! The leader's writes of each `NodePortPool`'s status ([`write_statuses`]); the pools' pure
//! decisions are [`crate::core::k8s::pools`] and [`crate::core::decisions::pool`].

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex};

use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::jiff::Timestamp;
use kube::api::{Patch, PatchParams};
use kube::{Api, Client};
use serde_json::json;
use tracing::{debug, warn};

use crate::core::decisions::alloc::Allocations;
use crate::core::decisions::pool::{Assignment, InvalidPool, NodePortPool, PoolContext, StatusInput};
use crate::core::domain::ServiceKey;

use crate::core::k8s::nodes::{PoolSelections, ServingNode};
use crate::core::k8s::snapshot::KubeSnapshot;

/// Per node, the addresses it published per pool on its Lease
/// ([`crate::core::k8s::nodes::published_pool_addresses`]). A malformed value is logged (once per
/// node and value) and counts as not published.
pub fn published_selections(leases: &[Arc<Lease>]) -> BTreeMap<String, PoolSelections> {
    static LOGGED: Mutex<BTreeSet<(String, String)>> = Mutex::new(BTreeSet::new());
    let (out, malformed) = crate::core::k8s::nodes::published_pool_addresses(leases);
    let mut logged = LOGGED.lock().unwrap_or_else(|e| e.into_inner());
    for (node, why) in malformed {
        if logged.len() < 1024 && logged.insert((node.clone(), why.clone())) {
            warn!(
                node,
                annotation = crate::core::k8s::nodes::ANNOTATION_POOL_ADDRESSES,
                error = %why,
                "a node Lease's pool addresses are malformed; listing that node's Node-object addresses instead"
            );
        }
    }
    out
}

/// What the leader needs to write every pool's status after an allocation round.
pub struct StatusRound<'a> {
    pub snap: &'a KubeSnapshot,
    pub ctx: &'a PoolContext,
    pub invalid: &'a [InvalidPool],
    pub allocations: &'a Allocations,
    pub assignment: Option<&'a Assignment>,
    pub serving: &'a BTreeMap<String, ServingNode>,
}

/// Writes each pool's status ([`crate::core::decisions::pool::status_of`]) where it differs from what is stored:
/// a merge patch of the status subresource with a `metadata.resourceVersion` precondition (a 409
/// is retried on the next round, like Service writes). Leader only. Returns whether a write met
/// a stale resourceVersion.
pub async fn write_statuses(client: &Client, round: &StatusRound<'_>) -> Result<bool, kube::Error> {
    let api: Api<NodePortPool> = Api::all(client.clone());
    let params = PatchParams { field_manager: Some(super::api::FIELD_MANAGER.into()), ..Default::default() };
    let mut stale = false;
    let empty = BTreeMap::new();
    let published = published_selections(&round.snap.leases);
    for obj in &round.snap.pools {
        let Some(name) = obj.metadata.name.as_deref() else { continue };
        let resolved = round.ctx.set.get(name);
        let members: Vec<&ServiceKey> = round
            .assignment
            .map(|a| a.ranges.iter().filter(|(_, r)| r.pool == name).map(|(k, _)| k).collect())
            .unwrap_or_default();
        let nodes: Vec<String> = match resolved {
            None => vec![],
            Some(r) => round
                .snap
                .nodes
                .iter()
                .filter(|n| r.pool.nodes.matches(n.metadata.labels.as_ref().unwrap_or(&empty)))
                // With `addresses`: only nodes that published an address for it (not published
                // yet: whose Node object has an address the pool selects).
                .filter(|n| {
                    let name = n.metadata.name.as_deref().unwrap_or_default();
                    r.pool.addresses.is_everything()
                        || !crate::core::k8s::nodes::pool_addresses_of(
                            n,
                            published.get(name),
                            &r.pool.name,
                            &r.pool.addresses,
                            &[],
                        )
                        .is_empty()
                })
                .filter_map(|n| n.metadata.name.clone())
                .filter(|n| round.serving.contains_key(n))
                .collect(),
        };
        let input = StatusInput {
            generation: obj.metadata.generation,
            resolved,
            invalid: round.invalid.iter().find(|i| i.name == name),
            allocations: round.allocations,
            members,
            nodes,
            current: obj.status.as_ref(),
            now: Timestamp::now(),
        };
        let wanted = crate::core::decisions::pool::status_of(&input);
        if obj.status.as_ref() == Some(&wanted) {
            continue;
        }
        let mut status = serde_json::to_value(&wanted).unwrap_or_default();
        // A merge patch keeps keys it does not mention: clear the ones this status leaves out.
        for key in ["observedGeneration", "portRanges", "protocols", "nodes"] {
            if status.get(key).is_none() {
                status[key] = serde_json::Value::Null;
            }
        }
        let patch = json!({"metadata": {"resourceVersion": obj.metadata.resource_version}, "status": status});
        match api.patch_status(name, &params, &Patch::Merge(&patch)).await {
            Ok(_) => debug!(pool = name, "pool status written"),
            Err(kube::Error::Api(s)) if s.code == 409 => stale = true,
            Err(e) => return Err(e),
        }
    }
    Ok(stale)
}
