//! What the leader writes on Services: the allocation annotation, `status.loadBalancer.ingress`
//! and the conditions `nodelb.io/Allocated` (are node ports allocated) and `nodelb.io/Serving`
//! (does any node serve them), and only where something changed. Pure: the edge turns each
//! [`ServiceWrite`] into patches with a resourceVersion precondition.

use foldhash::{HashMap, HashMapExt};
use std::borrow::Borrow;
use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use k8s_openapi::api::core::v1::{LoadBalancerIngress, PortStatus, Service};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};
use k8s_openapi::jiff::Timestamp;

use crate::decisions::alloc::{AllocProblem, Allocations};
use crate::decisions::endpoint_policy::{self, RefusedEndpoint};
use crate::domain::{Family, PortId, ServiceKey};
use crate::incremental::per_object::PerObject;
use crate::inputs::model::{self, LbService, ModelOptions, Refusal, TrafficPolicy};
use crate::ruleset::plan;

use super::dupes::Duplicate;
use super::nodes::ServingNode;

/// Condition type on Services we serve (also the marker that the status is ours).
pub const CONDITION_ALLOCATED: &str = crate::inputs::model::CONDITION_ALLOCATED;
/// Condition type saying whether any node serves the allocated ports (`False/NoServingNode` is
/// the state of the `NoServingNode` Event). Set wherever [`CONDITION_ALLOCATED`] is.
pub const CONDITION_SERVING: &str = "nodelb.io/Serving";
/// Condition type saying whether every endpoint address the Service names is one nodelb DNATs
/// to ([`crate::decisions::endpoint_policy`]): `False/EndpointRefused` names the refused ones and why.
pub const CONDITION_ENDPOINTS: &str = "nodelb.io/EndpointsAllowed";
/// Condition type on a Service nodelb restricts (source ranges, a pool's nodes or addresses,
/// refused endpoints), saying whether kube-proxy's NodePorts get around that:
/// `False/KubeNodePortsOpen` names them (also a Warning Event), `True/KubeNodePortsClosed` when the
/// Service has none. Absent on a Service with nothing to get around.
pub const CONDITION_KUBE_NODE_PORTS: &str = "nodelb.io/KubeNodePortsClosed";
/// Our condition types: what is removed from a Service that stops being ours.
pub const OUR_CONDITIONS: [&str; 4] =
    [CONDITION_ALLOCATED, CONDITION_SERVING, CONDITION_ENDPOINTS, CONDITION_KUBE_NODE_PORTS];
/// `ipMode` of our ingress entries: traffic reaches the node address (kube-proxy must not
/// short-circuit node-IP:service-port to the ClusterIP).
pub const IP_MODE_PROXY: &str = "Proxy";

/// The `reason` of one of our conditions: the API's vocabulary, spelt by [`ConditionReason::as_str`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum ConditionReason {
    /// The model refused the Service (Allocated, Serving).
    InvalidInput,
    /// Two Services ask for one node port (Allocated).
    PortConflict,
    /// A requested node port is outside the allowed ranges (Allocated).
    PortNotAllowed,
    /// A requested node port is taken by a listener on the node (Allocated).
    PortInUse,
    /// No free node port is left (Allocated).
    RangeExhausted,
    /// No node port pool serves the Service (Allocated).
    NoPool,
    /// Its namespace holds what its pool allows one namespace (Allocated).
    QuotaExceeded,
    /// Every port has its node port (Allocated).
    Allocated,
    /// No node port allocated (Serving).
    NotAllocated,
    /// Some node lists the Service in its ingress (Serving).
    Serving,
    /// No agent is ready for the Service's families (Serving; also an Event).
    NoServingNode,
    /// `externalTrafficPolicy: Local` and no serving node has a ready local endpoint (Serving).
    NoReadyLocalEndpoint,
    /// Every endpoint address is allowed (EndpointsAllowed).
    EndpointsAllowed,
    /// Some endpoint address is refused (EndpointsAllowed; also an Event).
    EndpointRefused,
    /// The Service has no Kubernetes NodePort (KubeNodePortsClosed).
    KubeNodePortsClosed,
    /// kube-proxy serves its NodePorts without what nodelb enforces (KubeNodePortsClosed; also
    /// an Event).
    KubeNodePortsOpen,
}

impl ConditionReason {
    pub fn as_str(self) -> &'static str {
        match self {
            ConditionReason::InvalidInput => "InvalidInput",
            ConditionReason::PortConflict => "PortConflict",
            ConditionReason::PortNotAllowed => "PortNotAllowed",
            ConditionReason::PortInUse => "PortInUse",
            ConditionReason::RangeExhausted => "RangeExhausted",
            ConditionReason::NoPool => "NoPool",
            ConditionReason::QuotaExceeded => "QuotaExceeded",
            ConditionReason::Allocated => "Allocated",
            ConditionReason::NotAllocated => "NotAllocated",
            ConditionReason::Serving => "Serving",
            ConditionReason::NoServingNode => "NoServingNode",
            ConditionReason::NoReadyLocalEndpoint => "NoReadyLocalEndpoint",
            ConditionReason::EndpointsAllowed => "EndpointsAllowed",
            ConditionReason::EndpointRefused => "EndpointRefused",
            ConditionReason::KubeNodePortsClosed => "KubeNodePortsClosed",
            ConditionReason::KubeNodePortsOpen => "KubeNodePortsOpen",
        }
    }
}

impl std::fmt::Display for ConditionReason {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The condition we want on a Service (without times).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WantedCondition {
    pub status: bool,
    pub reason: ConditionReason,
    pub message: String,
}

/// Allocation state of one Service, from the allocator's result or the model's refusal.
pub fn condition_for(
    ports: &BTreeMap<PortId, u16>,
    problems: &[&AllocProblem],
    refusal: Option<&Refusal>,
) -> WantedCondition {
    if let Some(r) = refusal {
        return WantedCondition {
            status: false,
            reason: ConditionReason::InvalidInput,
            message: format!("{r}; the Service keeps what it had until this is fixed"),
        };
    }
    let msgs = || problems.iter().map(|p| p.to_string()).collect::<Vec<_>>().join("; ");
    if problems.iter().any(|p| matches!(p, AllocProblem::Conflict { .. })) {
        return WantedCondition { status: false, reason: ConditionReason::PortConflict, message: msgs() };
    }
    if problems.iter().any(|p| matches!(p, AllocProblem::NotAllowed { .. })) {
        return WantedCondition { status: false, reason: ConditionReason::PortNotAllowed, message: msgs() };
    }
    if problems.iter().any(|p| matches!(p, AllocProblem::InUse { .. })) {
        return WantedCondition { status: false, reason: ConditionReason::PortInUse, message: msgs() };
    }
    if problems.iter().any(|p| matches!(p, AllocProblem::NoPool { .. })) {
        return WantedCondition { status: false, reason: ConditionReason::NoPool, message: msgs() };
    }
    if problems.iter().any(|p| matches!(p, AllocProblem::QuotaExceeded { .. })) {
        return WantedCondition { status: false, reason: ConditionReason::QuotaExceeded, message: msgs() };
    }
    if !problems.is_empty() {
        return WantedCondition { status: false, reason: ConditionReason::RangeExhausted, message: msgs() };
    }
    WantedCondition {
        status: true,
        reason: ConditionReason::Allocated,
        message: format!("node ports {}", model::format_port_map(ports)),
    }
}

/// Whether anyone serves a Service, given its allocation and the `ingress` computed for it:
/// `True/Serving` when some node lists it; else `False` with why: `NotAllocated` (the Allocated
/// condition says why), `NoServingNode` (no agent is ready for any of its families: the state of
/// the `NoServingNode` Event), `NoReadyLocalEndpoint` (`externalTrafficPolicy: Local` and no
/// serving node has a ready local endpoint). The message does not name nodes or count them, so
/// it does not change (nor is rewritten) whenever a node comes or goes.
pub fn serving_condition(
    svc: &LbService,
    node_ports: &BTreeMap<PortId, u16>,
    serving: &BTreeMap<String, ServingNode>,
    ingress: &[LoadBalancerIngress],
) -> WantedCondition {
    if node_ports.is_empty() {
        return WantedCondition {
            status: false,
            reason: ConditionReason::NotAllocated,
            message: format!("no node port allocated; see condition {CONDITION_ALLOCATED}"),
        };
    }
    if !ingress.is_empty() {
        return WantedCondition {
            status: true,
            reason: ConditionReason::Serving,
            message: "served by the nodes listed in status.loadBalancer.ingress".to_string(),
        };
    }
    if !serving.values().any(|n| svc.families.iter().any(|f| n.families.contains(f))) {
        let fams: Vec<&str> = svc.families.iter().map(|f| f.name()).collect();
        return WantedCondition {
            status: false,
            reason: ConditionReason::NoServingNode,
            message: format!(
                "no node can serve this Service's families ({}): no agent is ready for them",
                fams.join(", ")
            ),
        };
    }
    WantedCondition {
        status: false,
        reason: ConditionReason::NoReadyLocalEndpoint,
        message: "externalTrafficPolicy: Local and no node that serves its families has a ready \
                  local endpoint"
            .to_string(),
    }
}

/// Whether kube-proxy's NodePorts of `svc` get around what nodelb enforces for it (its source
/// ranges, its pool's nodes or addresses, its refused endpoints: kube-proxy knows none of them);
/// `None` when it has nothing of the kind. The same message as the `KubeNodePortsOpen` Event.
pub fn kube_node_ports_condition<S, V>(
    round: &Round<'_, S, V>,
    svc: &LbService,
    refused: &[&RefusedEndpoint],
) -> Option<WantedCondition> {
    let mut bypassed = Vec::new();
    if !svc.source_ranges.is_empty() {
        bypassed.push("loadBalancerSourceRanges");
    }
    if round.pool_nodes.is_some_and(|m| m.contains_key(&svc.key)) {
        bypassed.push("the nodes its node port pool selects");
    }
    if round.pool_addresses.is_some_and(|m| m.contains_key(&svc.key)) {
        bypassed.push("the node addresses its node port pool selects");
    }
    if !refused.is_empty() {
        bypassed.push("nodelb's refusal of some of its endpoints");
    }
    if bypassed.is_empty() {
        return None;
    }
    if svc.kube_node_ports.is_empty() {
        return Some(WantedCondition {
            status: true,
            reason: ConditionReason::KubeNodePortsClosed,
            message: "no Kubernetes NodePort: only nodelb's node ports reach it".to_string(),
        });
    }
    let ports: Vec<String> = svc.kube_node_ports.iter().map(|(id, n)| format!("{n} (port {id})")).collect();
    Some(WantedCondition {
        status: false,
        reason: ConditionReason::KubeNodePortsOpen,
        message: format!(
            "kube-proxy serves its NodePorts {} on every node, without {}: set spec.allocateLoadBalancerNodePorts: false and remove spec.ports[].nodePort",
            ports.join(", "),
            bypassed.join(", ")
        ),
    })
}

/// Whether every endpoint address of a Service is allowed; `refused` are its refused endpoints.
/// The same message as the `EndpointRefused` Event.
pub fn endpoints_condition(refused: &[&RefusedEndpoint]) -> WantedCondition {
    if refused.is_empty() {
        return WantedCondition {
            status: true,
            reason: ConditionReason::EndpointsAllowed,
            message: "every endpoint address is allowed".to_string(),
        };
    }
    WantedCondition {
        status: false,
        reason: ConditionReason::EndpointRefused,
        message: format!(
            "endpoints refused (not DNATed to on any node; the others serve): {}",
            endpoint_policy::describe(refused)
        ),
    }
}

/// `Serving` of a Service that is refused and was never valid: not programmed anywhere.
fn not_served_refused() -> WantedCondition {
    WantedCondition {
        status: false,
        reason: ConditionReason::InvalidInput,
        message: format!("not programmed: invalid input; see condition {CONDITION_ALLOCATED}"),
    }
}

/// `status.loadBalancer.ingress[].ports[].error` of a service port served on another number (its
/// node port, in [`ANNOTATION_ALLOCATED`]): a client at this address does not reach it on its own.
pub const PORT_ERROR_ALLOCATED_PORT: &str = "nodelb.io/AllocatedPort";
/// `…ports[].error` of a service port with no node port (the Allocated condition says why).
pub const PORT_ERROR_NOT_ALLOCATED: &str = "nodelb.io/NotAllocated";

/// The ingress entries of a Service: every address of every node that serves one of its
/// families (with `Local` policy: only nodes with a usable local endpoint for that family), one
/// entry per address, `ipMode: Proxy`. `ports` holds what the API defines it as, the Service's
/// own ports, each with no error when it answers at that address on its own number, else
/// [`PORT_ERROR_ALLOCATED_PORT`] (served on its node port) or [`PORT_ERROR_NOT_ALLOCATED`]: a
/// reader that takes `address:port` from the status is never sent where nothing answers. No
/// allocated port: no entry.
pub fn ingress_for(
    svc: &LbService,
    node_ports: &BTreeMap<PortId, u16>,
    serving: &BTreeMap<String, ServingNode>,
) -> Vec<LoadBalancerIngress> {
    if node_ports.is_empty() {
        return vec![];
    }
    let mut ports: Vec<(u16, &'static str, Option<&'static str>)> = svc
        .ports
        .iter()
        .map(|p| {
            let error = match node_ports.get(&p.id) {
                Some(n) if *n == p.id.port => None,
                Some(_) => Some(PORT_ERROR_ALLOCATED_PORT),
                None => Some(PORT_ERROR_NOT_ALLOCATED),
            };
            (p.id.port, p.id.protocol.k8s_name(), error)
        })
        .collect();
    ports.sort();
    ports.dedup();
    let mut addrs = BTreeSet::new();
    for node in serving.values() {
        let families: Vec<Family> = svc
            .families
            .iter()
            .copied()
            .filter(|f| node.families.contains(f))
            .filter(|f| {
                svc.traffic_policy == TrafficPolicy::Cluster
                    || svc.ports.iter().any(|p| {
                        node_ports.contains_key(&p.id)
                            && plan::usable_endpoints(svc, p, *f, &node.name).iter().any(|e| e.ready)
                    })
            })
            .collect();
        addrs.extend(node.addresses.iter().filter(|a| families.contains(&Family::of(a))).copied());
    }
    addrs
        .into_iter()
        .map(|ip| LoadBalancerIngress {
            ip: Some(ip.to_string()),
            ip_mode: Some(IP_MODE_PROXY.to_string()),
            ports: Some(
                ports
                    .iter()
                    .map(|(n, proto, error)| PortStatus {
                        port: i32::from(*n),
                        protocol: proto.to_string(),
                        error: error.map(str::to_string),
                    })
                    .collect(),
            ),
            hostname: None,
        })
        .collect()
}

/// A Service's status as we want it.
#[derive(Debug, Clone, PartialEq)]
pub struct StatusWrite {
    pub ingress: Vec<LoadBalancerIngress>,
    /// The full list (other controllers' conditions kept as they are).
    pub conditions: Vec<Condition>,
}

/// What to write on one Service. `resource_version` is the precondition of every write.
#[derive(Debug, Clone, PartialEq)]
pub struct ServiceWrite {
    pub key: ServiceKey,
    pub resource_version: Option<String>,
    /// New value of [`ANNOTATION_ALLOCATED`]: `Some(None)` removes it; `None` leaves it.
    pub annotation: Option<Option<String>>,
    pub status: Option<StatusWrite>,
}

/// Everything the leader decided for one round. `S`: the Services owned or shared (`Arc`, as
/// the reflector store holds them).
pub struct Round<'a, S = Service, V = LbService> {
    pub services: &'a [S],
    pub model: &'a ModelOptions,
    /// Valid Services we serve (after last-good substitution), owned or shared.
    pub valid: &'a [V],
    /// Services refused for invalid input (left as they were, condition says why).
    pub refused: &'a [Refusal],
    pub allocations: &'a Allocations,
    pub problems: &'a [AllocProblem],
    /// Endpoint addresses the policy refused (already taken out of `valid`).
    pub refused_endpoints: &'a [RefusedEndpoint],
    /// Ports processes listen on, per node (the node Leases): an allocated port among them is
    /// not served on those nodes (`NodePortInUse` Event; the allocation stays), unless the
    /// Service is served on some node addresses only (`pool_addresses`), which nodes check per
    /// address.
    pub listening: &'a BTreeMap<(crate::domain::Protocol, u16), String>,
    pub serving: &'a BTreeMap<String, ServingNode>,
    /// Per Service whose node port pool restricts nodes, the nodes it selects (absent: every
    /// node); its status lists only those.
    pub pool_nodes: Option<&'a BTreeMap<ServiceKey, BTreeSet<String>>>,
    /// Per Service whose node port pool restricts node addresses, per node, the addresses its
    /// status lists ([`super::nodes::pool_addresses`]); a node with none is not listed.
    pub pool_addresses: Option<&'a BTreeMap<ServiceKey, BTreeMap<String, Vec<std::net::IpAddr>>>>,
    /// Numbers a Service's annotation names that the node-port registry gives another Service
    /// (a forged annotation: `NodePortNotOwned` Events).
    pub lost: &'a [(ServiceKey, u16)],
    /// What the node agents' reports say they refuse ([`super::cluster_view::refusals`]): the
    /// `Serving` condition names a few of those nodes with why.
    pub refusals: Option<&'a super::cluster_view::Refusals>,
    pub now: Timestamp,
}

impl<S, V> Round<'_, S, V> {
    /// The serving nodes of `key`'s pool, with the addresses it publishes.
    fn serving_of(&self, key: &ServiceKey) -> std::borrow::Cow<'_, BTreeMap<String, ServingNode>> {
        let nodes = self.nodes_of(key);
        let Some(addresses) = self.pool_addresses.and_then(|m| m.get(key)) else { return nodes };
        std::borrow::Cow::Owned(
            nodes
                .iter()
                .filter_map(|(n, s)| {
                    let on: Vec<std::net::IpAddr> = addresses
                        .get(n)?
                        .iter()
                        .copied()
                        .filter(|a| s.families.contains(&Family::of(a)))
                        .collect();
                    (!on.is_empty()).then(|| (n.clone(), ServingNode { addresses: on, ..s.clone() }))
                })
                .collect(),
        )
    }

    /// The serving nodes `key`'s pool selects.
    fn nodes_of(&self, key: &ServiceKey) -> std::borrow::Cow<'_, BTreeMap<String, ServingNode>> {
        match self.pool_nodes.and_then(|m| m.get(key)) {
            None => std::borrow::Cow::Borrowed(self.serving),
            Some(names) => std::borrow::Cow::Owned(
                self.serving
                    .iter()
                    .filter(|(n, _)| names.contains(*n))
                    .map(|(n, s)| (n.clone(), s.clone()))
                    .collect(),
            ),
        }
    }
}

/// (ip, ipMode, sorted ports) of one ingress entry, for comparisons.
type IngressKey = (Option<String>, Option<String>, Vec<(i32, String)>);

fn normalise(ingress: &[LoadBalancerIngress]) -> Vec<IngressKey> {
    let mut v: Vec<_> = ingress
        .iter()
        .map(|i| {
            let mut ports: Vec<(i32, String)> =
                i.ports.iter().flatten().map(|p| (p.port, p.protocol.clone())).collect();
            ports.sort();
            (i.ip.clone(), i.ip_mode.clone(), ports)
        })
        .collect();
    v.sort();
    v
}

/// `conditions` with each of our condition types set to what `wanted` says (`None`: removed), the
/// others kept as they are; a transition time is kept when that condition's status did not
/// change. `None` when nothing changes.
fn merge_conditions(
    current: &[Condition],
    wanted: &[(&'static str, Option<&WantedCondition>)],
    generation: Option<i64>,
    now: Timestamp,
) -> Option<Vec<Condition>> {
    let mut out: Vec<Condition> =
        current.iter().filter(|c| !wanted.iter().any(|(t, _)| c.type_ == *t)).cloned().collect();
    let mut changed = false;
    for (type_, w) in wanted {
        let ours = current.iter().find(|c| c.type_ == *type_);
        let Some(w) = w else {
            changed |= ours.is_some();
            continue;
        };
        let status = if w.status { "True" } else { "False" };
        changed |= !ours.is_some_and(|c| {
            c.status == status
                && c.reason == w.reason.as_str()
                && c.message == w.message
                && c.observed_generation == generation
        });
        let since = match ours {
            Some(c) if c.status == status => c.last_transition_time.clone(),
            _ => Time(now),
        };
        out.push(Condition {
            type_: type_.to_string(),
            status: status.to_string(),
            reason: w.reason.as_str().to_string(),
            message: w.message.clone(),
            observed_generation: generation,
            last_transition_time: since,
        });
    }
    changed.then_some(out)
}

/// One round's per-Service inputs, each list indexed by Service once (a linear search per
/// Service is quadratic when many Services have a problem).
struct Index<'r, V> {
    valid: HashMap<&'r ServiceKey, &'r V>,
    refused: HashMap<&'r ServiceKey, &'r Refusal>,
    problems: HashMap<&'r ServiceKey, Vec<&'r AllocProblem>>,
    refused_endpoints: HashMap<&'r ServiceKey, Vec<&'r RefusedEndpoint>>,
    /// `round.allocations` hashed: a tree lookup per Service compares a key string per level.
    ports: HashMap<&'r ServiceKey, &'r BTreeMap<PortId, u16>>,
}

impl<'r, V: Borrow<LbService>> Index<'r, V> {
    fn of<S>(round: &Round<'r, S, V>) -> Self {
        let mut problems: HashMap<&ServiceKey, Vec<&AllocProblem>> = HashMap::new();
        for p in round.problems {
            problems.entry(p.service()).or_default().push(p);
        }
        let mut refused_endpoints: HashMap<&ServiceKey, Vec<&RefusedEndpoint>> = HashMap::new();
        for r in round.refused_endpoints {
            refused_endpoints.entry(&r.service).or_default().push(r);
        }
        Index {
            valid: round.valid.iter().map(|v| (&v.borrow().key, v)).collect(),
            refused: round.refused.iter().map(|r| (r.service(), r)).collect(),
            problems,
            refused_endpoints,
            ports: round.allocations.iter().collect(),
        }
    }

    fn ports(&self, key: &ServiceKey) -> Option<&'r BTreeMap<PortId, u16>> {
        self.ports.get(key).copied()
    }

    fn problems(&self, key: &ServiceKey) -> &[&'r AllocProblem] {
        self.problems.get(key).map_or(&[], Vec::as_slice)
    }

    fn refused_endpoints(&self, key: &ServiceKey) -> &[&'r RefusedEndpoint] {
        self.refused_endpoints.get(key).map_or(&[], Vec::as_slice)
    }
}

/// Where a valid Service is served: its ingress and its `Serving` condition (one decision for
/// the status and the `NoServingNode` Event).
struct Served {
    ingress: Vec<LoadBalancerIngress>,
    condition: WantedCondition,
}

fn served<S, V>(round: &Round<'_, S, V>, lb: &LbService, ports: &BTreeMap<PortId, u16>) -> Served {
    let nodes = round.serving_of(&lb.key);
    let ingress = ingress_for(lb, ports, &nodes);
    let mut condition = serving_condition(lb, ports, &nodes, &ingress);
    if condition.status {
        condition.message = serving_summary(&nodes, &ingress, refused_by_nodes(round, &lb.key));
    }
    Served { ingress, condition }
}

/// How many nodes refusing a Service its `Serving` message names.
const NAMED_REFUSALS: usize = 3;

/// The message of `Serving=True`: on how many of the nodes that could serve it (its pool's,
/// with a ready agent) it is served, and the first few that refuse it with why (their agents'
/// reports), e.g. `served on 2 of 3 nodes (status.loadBalancer.ingress); node-3: … in use`.
/// Bounded: a Service refused on many nodes names [`NAMED_REFUSALS`] and counts the rest.
fn serving_summary(
    nodes: &BTreeMap<String, ServingNode>,
    ingress: &[LoadBalancerIngress],
    refused: &[(String, String)],
) -> String {
    let listed: BTreeSet<std::net::IpAddr> =
        ingress.iter().filter_map(|i| i.ip.as_deref()?.parse().ok()).collect();
    let refusing: BTreeSet<&str> = refused.iter().map(|(n, _)| n.as_str()).collect();
    let served = nodes
        .values()
        .filter(|n| n.addresses.iter().any(|a| listed.contains(a)) && !refusing.contains(n.name.as_str()))
        .count();
    let mut msg = format!("served on {served} of {} nodes (status.loadBalancer.ingress)", nodes.len());
    let named: Vec<&(String, String)> = refused.iter().filter(|(n, _)| nodes.contains_key(n)).collect();
    for (node, why) in named.iter().take(NAMED_REFUSALS) {
        // The agent's words name the Service first; the condition is on it already.
        let why = match why.split_once(": port ") {
            Some((_, rest)) => format!("port {rest}"),
            None => why.clone(),
        };
        let why: String = why.chars().take(160).collect();
        msg.push_str(&format!("; {node}: {why}"));
    }
    if named.len() > NAMED_REFUSALS {
        msg.push_str(&format!(
            "; {} more nodes refuse it (nodelb status --cluster)",
            named.len() - NAMED_REFUSALS
        ));
    }
    msg
}

static NO_PORTS: BTreeMap<PortId, u16> = BTreeMap::new();

/// One Service's write: its annotation, ingress and conditions where they differ from what it
/// carries; `None` when nothing does. `served`: computed exactly for the valid Services
/// (`idx.valid`), which we serve.
fn write_for<S, V: Borrow<LbService>>(
    round: &Round<'_, S, V>,
    idx: &Index<'_, V>,
    svc: &Service,
    key: &ServiceKey,
    served: Option<Served>,
) -> Option<ServiceWrite> {
    let generation = svc.metadata.generation;
    let status = svc.status.as_ref();
    let cur_ingress =
        || status.and_then(|s| s.load_balancer.as_ref()).and_then(|l| l.ingress.clone()).unwrap_or_default();
    let cur_conditions: &[Condition] = status.and_then(|s| s.conditions.as_deref()).unwrap_or_default();
    let mut write = ServiceWrite {
        key: key.clone(),
        resource_version: svc.metadata.resource_version.clone(),
        annotation: None,
        status: None,
    };
    if !model::is_ours(svc, round.model) {
        if model::allocated_annotation(svc).is_some() {
            write.annotation = Some(None);
        }
        if cur_conditions.iter().any(|c| OUR_CONDITIONS.contains(&c.type_.as_str())) {
            let none = OUR_CONDITIONS.map(|t| (t, None));
            let conditions =
                merge_conditions(cur_conditions, &none, generation, round.now).unwrap_or_default();
            // Another load balancer's entries stay: only what nodelb wrote goes.
            let ingress = cur_ingress().into_iter().filter(|i| !model::is_nodelb_ingress(i)).collect();
            write.status = Some(StatusWrite { ingress, conditions });
        }
    } else if let Some(served) = served {
        let ports = idx.ports(key).unwrap_or(&NO_PORTS);
        let value = model::format_port_map(ports);
        let wanted_annotation = if value.is_empty() { None } else { Some(value) };
        if model::allocated_annotation(svc) != wanted_annotation.as_ref() {
            write.annotation = Some(wanted_annotation);
        }
        // A Service served from its last valid spec still reports why its edit was refused.
        let allocated = condition_for(ports, idx.problems(key), idx.refused.get(key).copied());
        let endpoints = endpoints_condition(idx.refused_endpoints(key));
        let side_door = idx
            .valid
            .get(key)
            .and_then(|lb| kube_node_ports_condition(round, (*lb).borrow(), idx.refused_endpoints(key)));
        let wanted = [
            (CONDITION_ALLOCATED, Some(&allocated)),
            (CONDITION_SERVING, Some(&served.condition)),
            (CONDITION_ENDPOINTS, Some(&endpoints)),
            (CONDITION_KUBE_NODE_PORTS, side_door.as_ref()),
        ];
        let conditions = merge_conditions(cur_conditions, &wanted, generation, round.now);
        if conditions.is_some() || normalise(&served.ingress) != normalise(&cur_ingress()) {
            write.status = Some(StatusWrite {
                ingress: served.ingress,
                conditions: conditions.unwrap_or_else(|| cur_conditions.to_vec()),
            });
        }
    } else if let Some(r) = idx.refused.get(key) {
        let allocated = condition_for(&NO_PORTS, &[], Some(r));
        let serving = not_served_refused();
        let wanted = [(CONDITION_ALLOCATED, Some(&allocated)), (CONDITION_SERVING, Some(&serving))];
        if let Some(conditions) = merge_conditions(cur_conditions, &wanted, generation, round.now) {
            write.status = Some(StatusWrite { ingress: cur_ingress(), conditions });
        }
    }
    (write.annotation.is_some() || write.status.is_some()).then_some(write)
}

/// The writes of one round, sorted by Service key. Services we serve get their annotation,
/// ingress and condition; refused ones only the condition (their annotation and ingress stay);
/// Services that are no longer ours but carry our marks get them removed. Every Service's at
/// once: the oracle of [`plan_services`], which keeps what it planned per Service.
#[cfg(test)]
pub fn plan_writes<S: Borrow<Service>, V: Borrow<LbService>>(round: &Round<'_, S, V>) -> Vec<ServiceWrite> {
    let idx = Index::of(round);
    let mut out: Vec<ServiceWrite> = round
        .services
        .iter()
        .map(Borrow::borrow)
        .filter_map(|svc| {
            let key = model::service_key(svc);
            let served = idx.valid.get(&key).map(|lb| {
                let lb = (*lb).borrow();
                served(round, lb, round.allocations.get(&key).unwrap_or(&NO_PORTS))
            });
            write_for(round, &idx, svc, &key, served)
        })
        .collect();
    out.sort_by(|a, b| a.key.cmp(&b.key));
    out
}

/// What each Service's part of the last rounds came to, kept while its inputs stay the same
/// (recomputing them would spend much of the leader's round on the status and Events of
/// Services nothing has happened to). Only a part that writes nothing is kept: a
/// write changes the Service, so it is computed again from the written object anyway.
#[derive(Debug, Default)]
pub struct Published {
    /// The round's inputs shared by every Service, as of the kept parts.
    shared: Option<Shared>,
    /// By Service object: finding a part builds no key.
    parts: PerObject<Service, Part>,
    /// How many parts the last round took from the one before.
    reused: usize,
}

impl Published {
    /// How many Services' parts the last [`plan_services`] took unchanged from the round before.
    pub fn reused(&self) -> usize {
        self.reused
    }

    /// How many Services' parts are kept.
    pub fn len(&self) -> usize {
        self.parts.len()
    }

    pub fn is_empty(&self) -> bool {
        self.parts.is_empty()
    }
}

#[derive(Debug, PartialEq)]
struct Shared {
    model: ModelOptions,
    listening: BTreeMap<(crate::domain::Protocol, u16), String>,
    serving: BTreeMap<String, ServingNode>,
}

/// One Service's inputs (the very objects: the cache's `Arc`s) and its state Events.
#[derive(Debug)]
struct Part {
    key: ServiceKey,
    model: Option<Arc<LbService>>,
    ports: Option<BTreeMap<PortId, u16>>,
    problems: Vec<AllocProblem>,
    refused: Option<Refusal>,
    refused_endpoints: Vec<RefusedEndpoint>,
    pool_nodes: Option<BTreeSet<String>>,
    pool_addresses: Option<BTreeMap<String, Vec<std::net::IpAddr>>>,
    /// What the nodes' reports say they refuse of it (its `Serving` message names them).
    refused_by_nodes: Vec<(String, String)>,
    events: Vec<ServiceEvent>,
}

impl Part {
    fn same_inputs(
        &self,
        round: &Round<'_, Arc<Service>, Arc<LbService>>,
        idx: &Index<'_, Arc<LbService>>,
    ) -> bool {
        let key = &self.key;
        let same_model = match (&self.model, idx.valid.get(key)) {
            (Some(a), Some(b)) => Arc::ptr_eq(a, b),
            (None, None) => true,
            _ => false,
        };
        same_model
            && self.ports.as_ref() == idx.ports(key)
            && self.problems.iter().eq(idx.problems(key).iter().copied())
            && self.refused.as_ref() == idx.refused.get(key).copied()
            && self.refused_endpoints.iter().eq(idx.refused_endpoints(key).iter().copied())
            && self.pool_nodes.as_ref() == round.pool_nodes.and_then(|m| m.get(key))
            && self.pool_addresses.as_ref() == round.pool_addresses.and_then(|m| m.get(key))
            && self.refused_by_nodes.as_slice() == refused_by_nodes(round, key)
    }
}

/// What the nodes' reports say they refuse of `key` (no lookup while no node refuses anything).
fn refused_by_nodes<'r, S, V>(round: &Round<'r, S, V>, key: &ServiceKey) -> &'r [(String, String)] {
    match round.refusals {
        Some(r) if !r.is_empty() => r.get(&key.to_string()).map_or(&[][..], Vec::as_slice),
        _ => &[],
    }
}

/// The writes and the Events of a round of shared objects (`plan_writes` and `service_events`,
/// compiled for tests, compute them for every Service at once), each Service's part reused from
/// `kept` while its inputs are the very same objects and values. The Events come Service by
/// Service, as `round.services` has them.
///
/// `scoped`: `None` when the round sees every Service (the parts of those it does not see go);
/// `Some(dropped)` when it sees only some (the leader's scoped round: `round.services` are the
/// scope's objects): the other Services' parts stay as they are, and those of `dropped` objects
/// (deleted, or replaced by newer versions) go.
pub fn plan_services(
    round: &Round<'_, Arc<Service>, Arc<LbService>>,
    duplicates: &[Duplicate],
    kept: &mut Published,
    scoped: Option<&[Arc<Service>]>,
) -> (Vec<ServiceWrite>, Vec<ServiceEvent>) {
    let shared = Shared {
        model: round.model.clone(),
        listening: round.listening.clone(),
        serving: round.serving.clone(),
    };
    if kept.shared.as_ref() != Some(&shared) {
        kept.parts.clear();
        kept.shared = Some(shared);
    }
    let idx = Index::of(round);
    let (mut writes, mut events) = (Vec::new(), Vec::new());
    // The round's own Events (allocation problems, refused input, duplicates; few) by Service,
    // merged with that Service's part: Events are merged Service by Service, and the round's
    // (one or more per Service) are never sorted as a whole.
    let mut extra: foldhash::HashMap<ServiceKey, Vec<ServiceEvent>> = Default::default();
    for e in round_events(round, duplicates) {
        extra.entry(e.service.clone()).or_default().push(e);
    }
    let mut take_extra = |key: &ServiceKey| if extra.is_empty() { None } else { extra.remove(key) };
    kept.reused = 0;
    match scoped {
        None => kept.parts.begin(),
        Some(dropped) => dropped.iter().for_each(|o| kept.parts.remove(o)),
    }
    for svc in round.services {
        if let Some(part) = kept.parts.get(svc).filter(|p| p.same_inputs(round, &idx)) {
            push_merged(&mut events, &part.events, take_extra(&part.key));
            kept.reused += 1;
            continue;
        }
        let key = model::service_key(svc);
        let model = idx.valid.get(&key).map(|m| Arc::clone(m));
        let ports = idx.ports(&key);
        let served = model.as_ref().map(|lb| served(round, lb, ports.unwrap_or(&NO_PORTS)));
        let own_events = match (&model, &served) {
            (Some(lb), Some(served)) => {
                valid_events(round, lb, ports.unwrap_or(&NO_PORTS), idx.refused_endpoints(&key), served)
            }
            _ => Vec::new(),
        };
        push_merged(&mut events, &own_events, take_extra(&key));
        match write_for(round, &idx, svc, &key, served) {
            Some(write) => {
                // The write changes the Service: its next object is computed anew.
                kept.parts.remove(svc);
                writes.push(write);
            }
            None => {
                let part = Part {
                    model,
                    ports: ports.cloned(),
                    problems: idx.problems(&key).iter().map(|p| (*p).clone()).collect(),
                    refused: idx.refused.get(&key).map(|r| (*r).clone()),
                    refused_endpoints: idx.refused_endpoints(&key).iter().map(|r| (*r).clone()).collect(),
                    pool_nodes: round.pool_nodes.and_then(|m| m.get(&key)).cloned(),
                    pool_addresses: round.pool_addresses.and_then(|m| m.get(&key)).cloned(),
                    refused_by_nodes: refused_by_nodes(round, &key).to_vec(),
                    events: own_events,
                    key,
                };
                kept.parts.insert(svc, part);
            }
        }
    }
    // Gone, or replaced by a newer object.
    if scoped.is_none() {
        kept.parts.end();
    }
    writes.sort_by(|a, b| a.key.cmp(&b.key));
    for (_, group) in extra {
        events.extend(merge_events(group));
    }
    (writes, events)
}

/// Appends one Service's Events, `own` and the round's `extra`, merged as [`merge_events`]
/// merges them (which never merges two Services' Events): one Event, the usual case, as it is.
fn push_merged(out: &mut Vec<ServiceEvent>, own: &[ServiceEvent], extra: Option<Vec<ServiceEvent>>) {
    match extra {
        None if own.len() <= 1 => out.extend(own.iter().cloned()),
        extra => out.extend(merge_events(own.iter().cloned().chain(extra.into_iter().flatten()).collect())),
    }
}

/// Stand-ins for refused Services that carry an allocation: they keep holding their numbers
/// (as explicit requests, so they never get new ones), so fixing the input brings them back on the
/// same ports and nobody else is handed those ports meanwhile.
pub fn reserved<S: Borrow<Service>>(services: &[S], refused: &[Refusal]) -> Vec<LbService> {
    let refused: BTreeSet<&ServiceKey> = refused.iter().map(|r| r.service()).collect();
    services
        .iter()
        .map(Borrow::borrow)
        .filter(|s| refused.contains(&model::service_key(s)))
        .filter_map(|s| {
            let value = model::allocated_annotation(s)?;
            let map = model::parse_allocated_ports(value);
            if map.is_empty() {
                return None;
            }
            let ports = map
                .keys()
                .map(|id| model::LbPort { id: *id, name: String::new(), endpoints: vec![] })
                .collect();
            let mut lb = LbService::with_defaults(model::service_key(s), ports);
            lb.created = s.metadata.creation_timestamp.as_ref().map(|t| t.0);
            lb.port_request = model::PortRequest::Explicit(map);
            Some(lb)
        })
        .collect()
}

/// An Event the leader wants recorded on a Service (deduplicated by [`super::events::Deduper`]).
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct ServiceEvent {
    pub service: ServiceKey,
    pub warning: bool,
    pub reason: &'static str,
    pub message: String,
}

/// Reasons of Events that describe a transition, not a state: once the write they describe is
/// done, no later round computes them again, so they wait in an [`super::events::Outbox`] until
/// the API accepted them.
pub const ONE_TIME_REASONS: &[&str] = &["NodePortReallocated", "NodePortNotOwned"];

/// The Events describing a round's state; the deduper turns them into "once per change". Every
/// Service's at once: the oracle of [`plan_services`].
#[cfg(test)]
pub fn service_events<S, V: Borrow<LbService>>(
    round: &Round<'_, S, V>,
    duplicates: &[Duplicate],
) -> Vec<ServiceEvent> {
    let idx = Index::of(round);
    let mut out = Vec::new();
    for lb in round.valid.iter().map(Borrow::borrow) {
        let ports = round.allocations.get(&lb.key).unwrap_or(&NO_PORTS);
        let served = served(round, lb, ports);
        out.extend(valid_events(round, lb, ports, idx.refused_endpoints(&lb.key), &served));
    }
    out.extend(round_events(round, duplicates));
    merge_events(out)
}

/// A valid Service's state Events: endpoints refused, ports allocated (moved, in use on a
/// node), no serving node.
fn valid_events<S, V>(
    round: &Round<'_, S, V>,
    svc: &LbService,
    ports: &BTreeMap<PortId, u16>,
    refused_endpoints: &[&RefusedEndpoint],
    served: &Served,
) -> Vec<ServiceEvent> {
    let mut out = Vec::new();
    if !refused_endpoints.is_empty() {
        out.push(ServiceEvent {
            service: svc.key.clone(),
            warning: true,
            reason: ConditionReason::EndpointRefused.as_str(),
            message: endpoints_condition(refused_endpoints).message,
        });
    }
    if let Some(open) = kube_node_ports_condition(round, svc, refused_endpoints).filter(|c| !c.status) {
        out.push(ServiceEvent {
            service: svc.key.clone(),
            warning: true,
            reason: ConditionReason::KubeNodePortsOpen.as_str(),
            message: open.message,
        });
    }
    if ports.is_empty() {
        return out;
    }
    out.push(ServiceEvent {
        service: svc.key.clone(),
        warning: false,
        reason: "NodePortsAllocated",
        message: format!("node ports {}", model::format_port_map(ports)),
    });
    // An existing allocation that moved (never silently): its number is no longer valid
    // for the Service (outside its pool's ranges now, or it changed pools).
    let moved: Vec<String> = ports
        .iter()
        .filter_map(|(id, n)| {
            let old = svc.previous_allocation.get(id).filter(|old| *old != n)?;
            Some(format!("port {id}: node port {old} → {n}"))
        })
        .collect();
    if !moved.is_empty() {
        out.push(ServiceEvent {
            service: svc.key.clone(),
            warning: true,
            reason: "NodePortReallocated",
            message: format!(
                "{} (the old number is no longer valid for it: outside its node port pool's ranges, or its pool changed)",
                moved.join(", ")
            ),
        });
    }
    // Served on some node addresses only (its pool's): the nodes decide per address and their
    // reports say where it is not served; a listened-on port (which names no address) does not.
    let per_address = round.pool_addresses.is_some_and(|m| m.contains_key(&svc.key));
    for (id, n) in ports.iter().filter(|_| !per_address) {
        if let Some(who) = round.listening.get(&(id.protocol, *n)) {
            out.push(ServiceEvent {
                service: svc.key.clone(),
                warning: true,
                reason: "NodePortInUse",
                message: format!(
                    "node port {n}/{} of port {id} is in use: {who}; not served there (the allocation stays)",
                    id.protocol
                ),
            });
        }
    }
    // The same decision (and message) as the Serving condition.
    if served.condition.reason == ConditionReason::NoServingNode {
        out.push(ServiceEvent {
            service: svc.key.clone(),
            warning: true,
            reason: ConditionReason::NoServingNode.as_str(),
            message: served.condition.message.clone(),
        });
    }
    out
}

/// The round's Events that are not one valid Service's state: allocation problems, refused
/// input, duplicate claims.
fn round_events<S, V>(round: &Round<'_, S, V>, duplicates: &[Duplicate]) -> Vec<ServiceEvent> {
    let mut out = Vec::new();
    for p in round.problems {
        let reason = match p {
            AllocProblem::Conflict { .. } => "NodePortConflict",
            AllocProblem::Exhausted { .. } => "NodePortRangeExhausted",
            AllocProblem::NotAllowed { .. } => "NodePortNotAllowed",
            AllocProblem::InUse { .. } => "NodePortInUse",
            AllocProblem::NoPool { .. } => "NoNodePortPool",
            AllocProblem::QuotaExceeded { .. } => "NodePortQuotaExceeded",
        };
        out.push(ServiceEvent {
            service: p.service().clone(),
            warning: true,
            reason,
            message: p.to_string(),
        });
    }
    for r in round.refused {
        out.push(ServiceEvent {
            service: r.service().clone(),
            warning: true,
            reason: "InvalidInput",
            message: r.to_string(),
        });
    }
    for d in duplicates {
        for svc in [&d.keeper, &d.loser] {
            out.push(ServiceEvent {
                service: svc.clone(),
                warning: true,
                reason: "DuplicateNodePort",
                message: d.message_for(svc),
            });
        }
    }
    for (svc, number) in round.lost {
        out.push(ServiceEvent {
            service: svc.clone(),
            warning: true,
            reason: "NodePortNotOwned",
            message: format!(
                "{} names node port {number}, which the node-port registry gives another Service: no node serves it for this Service, and the annotation is written again from the registry",
                crate::inputs::model::ANNOTATION_ALLOCATED
            ),
        });
    }
    out
}

/// Sorted, one Event per Service and reason (two ports in conflict are one message): the
/// deduper remembers one message per (Service, reason), so two would be re-sent every round.
fn merge_events(mut out: Vec<ServiceEvent>) -> Vec<ServiceEvent> {
    // Unstable is exact here: equal Events are the same in every field (and deduplicated).
    out.sort_unstable();
    out.dedup();
    let mut merged: Vec<ServiceEvent> = Vec::with_capacity(out.len());
    for e in out {
        match merged.last_mut() {
            Some(last) if last.service == e.service && last.reason == e.reason => {
                last.message = format!("{}; {}", last.message, e.message);
            }
            _ => merged.push(e),
        }
    }
    merged
}

#[cfg(test)]
mod tests;
