//! Node port pools (`NodePortPool`, `nodelb.io/v1alpha1`): the resource type (its CRD schema is
//! generated from these Rust types), and the pure decisions about pools: validation, which nodes
//! and Services a pool selects, overlap resolution between pools, and which pool a Service gets.
//! No I/O: `k8s::pools` (from the Kubernetes caches) and the manifests reader feed it objects.
//!
//! Decisions (docs/design/pools.md, "Node port pools"):
//! - **No pool object: the flags are the pool.** [`PoolSet::resolve`] returns one implicit pool
//!   (`--port-range`, every node, every address, every Service). Once a pool object exists the
//!   implicit pool is gone: a pool that restricts nodes or addresses must not be bypassed by a
//!   fallback that serves everything everywhere (k3s#11504 is exactly that complaint).
//! - **Numbers are unique wherever they are served**: the allocator's table is global, and only a
//!   number a Service asks for may be held beside Services of pools that never select one node
//!   with its own ([`crate::decisions::sharing`]). Two pools overlap only when their ranges
//!   overlap AND some node is selected by both: then
//!   the newer pool (creationTimestamp, then name) gets a `Conflict` naming the older, and its
//!   overlapping part is not used for new allocations. Existing allocations are never moved for
//!   it (they are kept anywhere inside the pool's own ranges).
//! - **Which pool a Service gets** ([`assign`]): the `nodelb.io/pool` annotation by name;
//!   else the pool it already holds its numbers in, while that pool still accepts it (stable:
//!   creating a better pool does not move serving Services); else the accepting, enabled,
//!   auto-assigning pool with the lowest `priority`, then the oldest.
//! - **Invalid pool: the last valid version stays in force** ([`LastValid`]); a pool never valid
//!   does not exist for selection. Either way the reason is reported on its status.

use std::borrow::Borrow;
use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::net::IpAddr;

use ipnet::IpNet;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, LabelSelector};
use kube::{CustomResource, KubeSchema};
use serde::{Deserialize, Serialize};

use k8s_openapi::api::core::v1::Service;

use crate::decisions::alloc::{AllocProblem, Allocations, PoolRanges};
use crate::decisions::port_policy::{NODEPORT_RANGE, PortRange};
use crate::decisions::sharing::Sharing;
use crate::domain::ServiceKey;
use crate::inputs::model::LbService;

/// Service annotation: the pool this Service wants, by name.
pub const ANNOTATION_POOL: &str = "nodelb.io/pool";
/// Name under which the implicit pool (the flags) appears in messages and status.
pub const IMPLICIT_POOL: &str = "(flags)";

/// Which node ports, on which nodes and node addresses, for which Services.
#[derive(CustomResource, KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[kube(
    group = "nodelb.io",
    version = "v1alpha1",
    kind = "NodePortPool",
    plural = "nodeportpools",
    shortname = "npp",
    category = "nodelb",
    status = "NodePortPoolStatus",
    derive = "PartialEq",
    doc = "NodePortPool: node ports nodelb allocates to LoadBalancer Services, on which nodes and node addresses, for which Services.",
    printcolumn = r#"{"name":"Ports", "type":"string", "jsonPath":".status.portRanges", "description":"ranges new allocations take from"}"#,
    printcolumn = r#"{"name":"Priority", "type":"integer", "jsonPath":".spec.priority"}"#,
    printcolumn = r#"{"name":"Allocated", "type":"integer", "jsonPath":".status.allocated", "description":"node port numbers in use"}"#,
    printcolumn = r#"{"name":"Free", "type":"integer", "jsonPath":".status.free", "description":"numbers left for new allocations"}"#,
    printcolumn = r#"{"name":"Nodes", "type":"integer", "jsonPath":".status.nodeCount", "description":"nodes serving this pool"}"#,
    printcolumn = r#"{"name":"Ready", "type":"string", "jsonPath":".status.conditions[?(@.type==\"Ready\")].status"}"#,
    printcolumn = r#"{"name":"Conflict", "type":"string", "jsonPath":".status.conditions[?(@.type==\"Conflict\")].status", "priority":1}"#,
    printcolumn = r#"{"name":"Mode", "type":"string", "jsonPath":".spec.portMode", "description":"Allocate: numbers from the ranges; ServicePort: each Service's own port", "priority":1}"#,
    printcolumn = r#"{"name":"Age", "type":"date", "jsonPath":".metadata.creationTimestamp"}"#
)]
#[x_kube(validation = Rule::new(
    "self.allowNodePortRange || self.ports.all(r, r.end < 30000 || r.start > 32767)"
).message("a port range overlaps the Kubernetes NodePort range 30000-32767 (set allowNodePortRange: true if that range was moved)"))]
#[serde(rename_all = "camelCase")]
pub struct NodePortPoolSpec {
    /// How its Services get their node ports: `Allocate` (the default) gives each service port
    /// the lowest free number of `ports`; `ServicePort` serves each service port on its own
    /// number (`port: 443` answers at node:443, as k3s ServiceLB does), which must lie in
    /// `ports` or `requestablePorts`.
    #[serde(default)]
    #[schemars(default = "PortMode::default")]
    pub port_mode: PortMode,
    /// Node port ranges (inclusive). `Allocate`: new allocations take the lowest free number.
    /// `ServicePort`: the service port numbers the pool serves on their own number.
    #[schemars(length(min = 1))]
    pub ports: Vec<PoolPortRange>,
    /// Allow ranges inside the Kubernetes NodePort range 30000-32767 (only if the cluster's
    /// service-node-port-range was moved elsewhere).
    #[serde(default)]
    pub allow_node_port_range: bool,
    /// Node ports outside `ports` that the Services of this pool (and only they) may ask for by
    /// number (annotation nodelb.io/ports: a number, or `service` for the Service's own ports),
    /// for example 80 and 443. Never allocated automatically.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub requestable_ports: Vec<PoolPortRange>,
    /// The most node ports the Services of one namespace may hold in this pool (a number counts
    /// once, whatever its protocols; absent: no bound). A Service that would go past it gets no
    /// new number; a Service with more ports than the bound gets none at all. Lowering it takes
    /// nothing away.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1))]
    pub max_ports_per_namespace: Option<u32>,
    /// Nodes that serve this pool's Services (empty or absent: every node).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub node_selector: Option<LabelSelector>,
    /// Node addresses that serve and are published (absent: every address of the node).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub addresses: Option<PoolAddresses>,
    /// Services this pool accepts by their labels (absent: all).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub service_selector: Option<LabelSelector>,
    /// Services this pool accepts by their Namespace's labels (absent: all).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub namespace_selector: Option<LabelSelector>,
    /// Lower wins when several pools accept a Service.
    #[serde(default)]
    pub priority: i32,
    /// false: only Services naming this pool (annotation nodelb.io/pool) use it.
    #[serde(default = "default_true")]
    #[schemars(default = "default_true")]
    pub auto_assign: bool,
    /// Drain: existing allocations stay, nothing new is allocated.
    #[serde(default)]
    pub disabled: bool,
}

fn default_true() -> bool {
    true
}

/// How a pool's Services get their node ports ([`NodePortPoolSpec::port_mode`]).
#[derive(schemars::JsonSchema, Serialize, Deserialize, Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum PortMode {
    /// Each service port gets the lowest free number of the pool's ranges.
    #[default]
    Allocate,
    /// Each service port is served on its own number.
    ServicePort,
}

/// An inclusive node port range.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq)]
#[x_kube(validation = Rule::new("self.start <= self.end").message("start must not be greater than end"))]
pub struct PoolPortRange {
    #[schemars(range(min = 1, max = 65535))]
    pub start: u16,
    #[schemars(range(min = 1, max = 65535))]
    pub end: u16,
}

/// Which node addresses serve: an address qualifies when it matches every list given (a list
/// left out does not restrict).
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Default)]
#[serde(rename_all = "camelCase")]
pub struct PoolAddresses {
    /// Node address types (`ExternalIP`, `InternalIP`) of the Node object.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub types: Vec<String>,
    /// CIDRs the address must lie in.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub cidrs: Vec<String>,
    /// Interfaces the address must be configured on.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub interfaces: Vec<String>,
}

/// Written by the leader.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Default)]
#[serde(rename_all = "camelCase")]
pub struct NodePortPoolStatus {
    /// The generation this status describes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
    /// `Ready`, `Conflict`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub conditions: Vec<Condition>,
    /// The ranges new allocations take from (after conflicts), e.g. `20000-20099,21000-21009`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub port_ranges: Option<String>,
    /// Node port numbers held by this pool's Services.
    #[serde(default)]
    pub allocated: i64,
    /// Numbers left for new allocations.
    #[serde(default)]
    pub free: i64,
    /// Per protocol: numbers in the ranges, taken, left.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub protocols: Vec<ProtocolPorts>,
    /// Nodes currently serving this pool (selected and running an agent).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub nodes: Vec<String>,
    #[serde(default)]
    pub node_count: i64,
    /// With `maxPortsPerNamespace`: the namespaces that hold that many of its node ports (their
    /// Services get no new one).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub namespaces_at_limit: Vec<String>,
}

#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Default)]
#[serde(rename_all = "camelCase")]
pub struct ProtocolPorts {
    pub protocol: String,
    pub total: i64,
    pub allocated: i64,
    pub free: i64,
}

/// One requirement of a label selector.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
enum Requirement {
    In(String, BTreeSet<String>),
    NotIn(String, BTreeSet<String>),
    Exists(String),
    DoesNotExist(String),
}

/// A validated label selector; no requirement: selects everything.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Default)]
pub struct Selector(Vec<Requirement>);

impl Selector {
    /// `matchLabels` and `matchExpressions` of a Kubernetes label selector, checked as the API
    /// server checks them (In/NotIn need values, Exists/DoesNotExist take none).
    pub fn parse(s: Option<&LabelSelector>) -> Result<Selector, String> {
        let Some(s) = s else { return Ok(Selector::default()) };
        let mut out = Vec::new();
        for (k, v) in s.match_labels.iter().flatten() {
            out.push(Requirement::In(k.clone(), BTreeSet::from([v.clone()])));
        }
        for e in s.match_expressions.iter().flatten() {
            let values: BTreeSet<String> = e.values.iter().flatten().cloned().collect();
            let key = e.key.clone();
            out.push(match (e.operator.as_str(), values.is_empty()) {
                ("In", false) => Requirement::In(key, values),
                ("NotIn", false) => Requirement::NotIn(key, values),
                ("Exists", true) => Requirement::Exists(key),
                ("DoesNotExist", true) => Requirement::DoesNotExist(key),
                ("In" | "NotIn", true) => {
                    return Err(format!("expression on {key:?}: operator {} needs values", e.operator));
                }
                ("Exists" | "DoesNotExist", false) => {
                    return Err(format!("expression on {key:?}: operator {} takes no values", e.operator));
                }
                (op, _) => {
                    return Err(format!(
                        "expression on {key:?}: operator {op:?} is not In, NotIn, Exists or DoesNotExist"
                    ));
                }
            });
        }
        Ok(Selector(out))
    }

    /// Selects everything (no requirement).
    pub fn is_everything(&self) -> bool {
        self.0.is_empty()
    }

    pub fn matches(&self, labels: &BTreeMap<String, String>) -> bool {
        self.0.iter().all(|r| match r {
            Requirement::In(k, vs) => labels.get(k).is_some_and(|v| vs.contains(v)),
            Requirement::NotIn(k, vs) => labels.get(k).is_none_or(|v| !vs.contains(v)),
            Requirement::Exists(k) => labels.contains_key(k),
            Requirement::DoesNotExist(k) => !labels.contains_key(k),
        })
    }

    /// Whether no labels can match both selectors: for some key, what the two ask of it together
    /// cannot hold (`In [a]` and `In [b]`, `In [a]` and `NotIn [a]`, `Exists` and
    /// `DoesNotExist`). Nodes change their labels freely, so only a proof from the selectors
    /// keeps two pools apart on every node, after any relabelling too.
    pub fn disjoint(&self, other: &Selector) -> bool {
        let both = || self.0.iter().chain(&other.0);
        let keys: BTreeSet<&str> = both().map(Requirement::key).collect();
        keys.into_iter().any(|key| !satisfiable(both().filter(|r| r.key() == key)))
    }
}

impl Requirement {
    fn key(&self) -> &str {
        match self {
            Requirement::In(k, _)
            | Requirement::NotIn(k, _)
            | Requirement::Exists(k)
            | Requirement::DoesNotExist(k) => k,
        }
    }
}

/// Whether one key's absence, or some value of it, meets every requirement on that key (label
/// values are unbounded, so a `NotIn` alone always leaves one).
fn satisfiable<'a>(on_key: impl Iterator<Item = &'a Requirement>) -> bool {
    let (mut absent, mut present) = (true, true);
    // `None`: any value.
    let mut allowed: Option<BTreeSet<&str>> = None;
    let mut refused: BTreeSet<&str> = BTreeSet::new();
    for r in on_key {
        match r {
            Requirement::In(_, values) => {
                absent = false;
                let values: BTreeSet<&str> = values.iter().map(String::as_str).collect();
                allowed = Some(match allowed {
                    None => values,
                    Some(before) => before.intersection(&values).copied().collect(),
                });
            }
            Requirement::NotIn(_, values) => refused.extend(values.iter().map(String::as_str)),
            Requirement::Exists(_) => absent = false,
            Requirement::DoesNotExist(_) => present = false,
        }
    }
    absent || (present && allowed.is_none_or(|a| a.iter().any(|v| !refused.contains(v))))
}

/// A node address type a pool may restrict to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum AddressType {
    ExternalIp,
    InternalIp,
}

impl AddressType {
    pub fn as_str(self) -> &'static str {
        match self {
            AddressType::ExternalIp => "ExternalIP",
            AddressType::InternalIp => "InternalIP",
        }
    }
}

/// Validated [`PoolAddresses`]; all empty: every address.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Default)]
pub struct AddressFilter {
    pub types: Vec<AddressType>,
    pub cidrs: Vec<IpNet>,
    pub interfaces: Vec<String>,
}

impl AddressFilter {
    pub fn is_everything(&self) -> bool {
        self.types.is_empty() && self.cidrs.is_empty() && self.interfaces.is_empty()
    }

    /// Whether no address can pass both filters: each names CIDRs, and none of one's meets one
    /// of the other's (an address passes a filter only inside one of its CIDRs).
    pub fn disjoint(&self, other: &AddressFilter) -> bool {
        let meet = |a: &IpNet, b: &IpNet| a.contains(&b.network()) || b.contains(&a.network());
        !self.cidrs.is_empty()
            && !other.cidrs.is_empty()
            && self.cidrs.iter().all(|a| other.cidrs.iter().all(|b| !meet(a, b)))
    }

    /// The addresses of this node that serve a pool with this filter: addresses configured on
    /// this node (`own.interfaces`), never loopback (the dispatch never matches it), matching
    /// every list given: in a CIDR, on one of the interfaces, listed in this node's Node object
    /// with one of the types. Manifests mode has no Node object, so `types` selects nothing
    /// there (fail closed: an operator who wrote "ExternalIP only" must not get every address).
    pub fn select(&self, own: &NodeAddresses) -> BTreeSet<IpAddr> {
        own.interfaces
            .iter()
            .filter(|(addr, _)| !addr.is_loopback())
            .filter(|(addr, _)| self.cidrs.is_empty() || self.cidrs.iter().any(|c| c.contains(*addr)))
            .filter(|(_, on)| self.interfaces.is_empty() || self.interfaces.iter().any(|i| on.contains(i)))
            .filter(|(addr, _)| {
                self.types.is_empty()
                    || own.types.get(*addr).is_some_and(|t| self.types.iter().any(|w| t.contains(w)))
            })
            .map(|(addr, _)| *addr)
            .collect()
    }

    /// Whether the leader publishes a Node object's address of type `kind` for a pool with this
    /// filter. The leader sees Node objects, not interfaces: `interfaces` is judged by the nodes
    /// only (an address it cannot place is published when the other lists accept it).
    pub fn publishes(&self, kind: Option<AddressType>, addr: &IpAddr) -> bool {
        (self.cidrs.is_empty() || self.cidrs.iter().any(|c| c.contains(addr)))
            && (self.types.is_empty() || kind.is_some_and(|k| self.types.contains(&k)))
    }

    /// Why [`Self::select`] found nothing on this node, for the refusal.
    pub fn describe(&self) -> String {
        let mut parts = Vec::new();
        if !self.types.is_empty() {
            let t: Vec<&str> = self.types.iter().map(|t| t.as_str()).collect();
            parts.push(format!("types {}", t.join(",")));
        }
        if !self.cidrs.is_empty() {
            let c: Vec<String> = self.cidrs.iter().map(|c| c.to_string()).collect();
            parts.push(format!("cidrs {}", c.join(",")));
        }
        if !self.interfaces.is_empty() {
            parts.push(format!("interfaces {}", self.interfaces.join(",")));
        }
        parts.join("; ")
    }
}

impl AddressType {
    /// The type of a Node `status.addresses` entry a pool can name (`Hostname` and others: none).
    pub fn parse(s: &str) -> Option<AddressType> {
        match s {
            "ExternalIP" => Some(AddressType::ExternalIp),
            "InternalIP" => Some(AddressType::InternalIp),
            _ => None,
        }
    }
}

/// What one node knows about its own addresses, for [`AddressFilter::select`].
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct NodeAddresses {
    /// Addresses configured on this node's interfaces (read from its kernel), each with the
    /// interfaces it is on.
    pub interfaces: BTreeMap<IpAddr, BTreeSet<String>>,
    /// This node's Node object `status.addresses` of the types a pool can name (Kubernetes
    /// mode; empty in manifests mode).
    pub types: BTreeMap<IpAddr, BTreeSet<AddressType>>,
}

impl NodeAddresses {
    /// Both together (each address keeps every interface and type either names).
    pub fn merge(&mut self, other: &NodeAddresses) {
        for (a, i) in &other.interfaces {
            self.interfaces.entry(*a).or_default().extend(i.iter().cloned());
        }
        for (a, t) in &other.types {
            self.types.entry(*a).or_default().extend(t.iter().copied());
        }
    }
}

/// A validated pool.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Pool {
    pub name: String,
    /// `spec.portMode`.
    pub port_mode: PortMode,
    /// `spec.requestablePorts`: what its Services may also ask for by number.
    pub requestable: Vec<PortRange>,
    /// `spec.maxPortsPerNamespace`.
    pub per_namespace: Option<u32>,
    /// creationTimestamp (RFC 3339); manifests: none (then the name orders them).
    pub created: Option<String>,
    pub generation: Option<i64>,
    pub ranges: Vec<PortRange>,
    pub nodes: Selector,
    pub addresses: AddressFilter,
    pub services: Selector,
    pub namespaces: Selector,
    pub priority: i32,
    pub auto_assign: bool,
    pub disabled: bool,
}

impl Pool {
    /// The pool the flags describe when no pool object exists.
    pub fn implicit(range: PortRange) -> Pool {
        Pool {
            name: IMPLICIT_POOL.to_string(),
            port_mode: PortMode::Allocate,
            requestable: Vec::new(),
            per_namespace: None,
            created: None,
            generation: None,
            ranges: vec![range],
            nodes: Selector::default(),
            addresses: AddressFilter::default(),
            services: Selector::default(),
            namespaces: Selector::default(),
            priority: i32::MAX,
            auto_assign: true,
            disabled: false,
        }
    }

    /// Whether `number` lies in one of the pool's own ranges.
    pub fn contains(&self, number: u16) -> bool {
        self.ranges.iter().any(|r| r.contains(number))
    }

    /// Whether its Services and namespaces selectors accept a Service.
    pub fn accepts(&self, svc: &ServiceFacts<'_>) -> bool {
        self.services.matches(svc.labels) && self.namespaces.matches(svc.namespace_labels)
    }

    /// Older first: creationTimestamp (none: younger), then name.
    fn age_key(&self) -> (bool, Option<k8s_openapi::jiff::Timestamp>, &str) {
        let t = self.created.as_deref().and_then(|c| c.parse().ok());
        (t.is_none(), t, &self.name)
    }
}

/// Every reason `spec` is not a usable pool (empty: valid). The API server's schema refuses most
/// of these already; manifests have no API server, and a schema can be older than the agent.
pub fn validate(
    name: &str,
    created: Option<String>,
    generation: Option<i64>,
    spec: &NodePortPoolSpec,
) -> Result<Pool, Vec<String>> {
    let mut errors = Vec::new();
    let mut ranges = Vec::new();
    if spec.ports.is_empty() {
        errors.push("spec.ports: at least one range is required".to_string());
    }
    for (i, r) in spec.ports.iter().enumerate() {
        match PortRange::new(r.start, r.end) {
            Err(e) => errors.push(format!("spec.ports[{i}]: {e}")),
            Ok(range) => {
                let (a, b) = NODEPORT_RANGE;
                if !spec.allow_node_port_range && range.first <= b && a <= range.last {
                    errors.push(format!(
                        "spec.ports[{i}]: {range} overlaps the Kubernetes NodePort range {a}-{b} (allowNodePortRange is false)"
                    ));
                }
                if let Some(other) =
                    ranges.iter().find(|o: &&PortRange| o.first <= range.last && range.first <= o.last)
                {
                    errors.push(format!("spec.ports[{i}]: {range} overlaps {other} of the same pool"));
                }
                ranges.push(range);
            }
        }
    }
    let mut requestable = Vec::new();
    for (i, r) in spec.requestable_ports.iter().enumerate() {
        match PortRange::new(r.start, r.end) {
            Ok(range) => requestable.push(range),
            Err(e) => errors.push(format!("spec.requestablePorts[{i}]: {e}")),
        }
    }
    let mut selector = |field: &str, s: Option<&LabelSelector>| {
        Selector::parse(s).unwrap_or_else(|e| {
            errors.push(format!("spec.{field}: {e}"));
            Selector::default()
        })
    };
    let nodes = selector("nodeSelector", spec.node_selector.as_ref());
    let services = selector("serviceSelector", spec.service_selector.as_ref());
    let namespaces = selector("namespaceSelector", spec.namespace_selector.as_ref());
    let mut addresses = AddressFilter::default();
    if let Some(a) = &spec.addresses {
        for t in &a.types {
            match AddressType::parse(t) {
                Some(kind) => addresses.types.push(kind),
                None => errors.push(format!("spec.addresses.types: {t:?} is not ExternalIP or InternalIP")),
            }
        }
        for c in &a.cidrs {
            match c.parse::<IpNet>() {
                Ok(net) if net.trunc() == net => addresses.cidrs.push(net),
                Ok(net) => errors.push(format!(
                    "spec.addresses.cidrs: {c:?} has host bits set (did you mean {}?)",
                    net.trunc()
                )),
                Err(_) => errors.push(format!("spec.addresses.cidrs: {c:?} is not a CIDR")),
            }
        }
        for i in &a.interfaces {
            // IFNAMSIZ is 16 with the NUL; the kernel refuses '/', ':' and whitespace.
            let ok = !i.is_empty()
                && i.len() < 16
                && !i.chars().any(|c| c == '/' || c == ':' || c.is_whitespace());
            if ok {
                addresses.interfaces.push(i.clone());
            } else {
                errors.push(format!("spec.addresses.interfaces: {i:?} is not an interface name"));
            }
        }
    }
    if spec.max_ports_per_namespace == Some(0) {
        errors.push("spec.maxPortsPerNamespace: 0 would admit nothing (omit it for no bound)".to_string());
    }
    if !errors.is_empty() {
        return Err(errors);
    }
    Ok(Pool {
        name: name.to_string(),
        port_mode: spec.port_mode,
        requestable,
        per_namespace: spec.max_ports_per_namespace,
        created,
        generation,
        ranges,
        nodes,
        addresses,
        services,
        namespaces,
        priority: spec.priority,
        auto_assign: spec.auto_assign,
        disabled: spec.disabled,
    })
}

/// One pool object as read, before validation.
#[derive(Debug, Clone, PartialEq)]
pub struct PoolObject {
    pub name: String,
    pub uid: Option<String>,
    pub created: Option<String>,
    pub generation: Option<i64>,
    pub spec: NodePortPoolSpec,
}

impl PoolObject {
    pub fn from_resource(p: &NodePortPool) -> PoolObject {
        PoolObject {
            name: p.metadata.name.clone().unwrap_or_default(),
            uid: p.metadata.uid.clone(),
            created: p.metadata.creation_timestamp.as_ref().map(|t| t.0.to_string()),
            generation: p.metadata.generation,
            spec: p.spec.clone(),
        }
    }
}

/// A pool object nodelb does not use as written.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InvalidPool {
    pub name: String,
    pub generation: Option<i64>,
    pub errors: Vec<String>,
    /// The generation still in force (its last valid version), if any.
    pub in_force: Option<i64>,
}

impl fmt::Display for InvalidPool {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "NodePortPool {}: {}", self.name, self.errors.join("; "))?;
        match self.in_force {
            Some(g) => write!(f, " (generation {g}, its last valid version, stays in force)"),
            None => write!(f, " (not used)"),
        }
    }
}

/// Remembers each pool's last valid version (by name and uid: a pool deleted and created again
/// starts afresh), so an invalid edit keeps the previous configuration in force.
#[derive(Debug, Clone, Default)]
pub struct LastValid {
    pools: BTreeMap<String, (Option<String>, Pool)>,
}

impl LastValid {
    /// The pools in force for `objects`, and the invalid ones with their reasons.
    pub fn update(&mut self, objects: &[PoolObject]) -> (Vec<Pool>, Vec<InvalidPool>) {
        let mut in_force = Vec::new();
        let mut invalid = Vec::new();
        let mut seen = BTreeSet::new();
        for o in objects {
            if !seen.insert(o.name.clone()) {
                invalid.push(InvalidPool {
                    name: o.name.clone(),
                    generation: o.generation,
                    errors: vec!["a pool of this name appears twice".into()],
                    in_force: None,
                });
                continue;
            }
            match validate(&o.name, o.created.clone(), o.generation, &o.spec) {
                Ok(pool) => {
                    self.pools.insert(o.name.clone(), (o.uid.clone(), pool.clone()));
                    in_force.push(pool);
                }
                Err(errors) => {
                    let kept =
                        self.pools.get(&o.name).filter(|(uid, _)| *uid == o.uid).map(|(_, p)| p.clone());
                    invalid.push(InvalidPool {
                        name: o.name.clone(),
                        generation: o.generation,
                        errors,
                        in_force: kept.as_ref().and_then(|p| p.generation),
                    });
                    in_force.extend(kept);
                }
            }
        }
        self.pools.retain(|name, _| seen.contains(name));
        (in_force, invalid)
    }
}

/// A pool with the ranges it takes new numbers from after conflicts.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct ResolvedPool {
    pub pool: Pool,
    /// Its own ranges minus what older pools on shared nodes already cover. Empty when
    /// disabled (drain): nothing new is allocated.
    pub effective: Vec<PortRange>,
    /// Older pools whose ranges overlap this one's on a node both select.
    pub conflicts: Vec<String>,
}

/// The pools in force, resolved against the nodes.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct PoolSet {
    /// Oldest first.
    pub pools: Vec<ResolvedPool>,
    /// No pool object: the flags' pool.
    pub implicit: bool,
}

impl PoolSet {
    /// Which Services may hold one number together: those of pools whose node selectors, or
    /// whose node address CIDRs, exclude each other, and that both permit some number (`None`:
    /// no pool object). Pools with ranges of their own share nothing, and leave rounds scoped.
    pub fn sharing(&self) -> Option<Sharing> {
        if self.implicit {
            return None;
        }
        let permitted = |p: &Pool| p.ranges.iter().chain(&p.requestable).copied().collect::<Vec<PortRange>>();
        let meet = |a: &[PortRange], b: &[PortRange]| {
            a.iter().any(|x| b.iter().any(|y| x.first <= y.last && y.first <= x.last))
        };
        let mut apart = Vec::new();
        for (i, a) in self.pools.iter().enumerate() {
            for b in &self.pools[i + 1..] {
                let never_together =
                    a.pool.nodes.disjoint(&b.pool.nodes) || a.pool.addresses.disjoint(&b.pool.addresses);
                if meet(&permitted(&a.pool), &permitted(&b.pool)) && never_together {
                    apart.push((a.pool.name.clone(), b.pool.name.clone()));
                }
            }
        }
        Some(Sharing::of_apart(apart))
    }

    /// Whether a pool bounds what one namespace holds (`maxPortsPerNamespace`): then what a
    /// namespace holds is counted over every Service, and decisions are whole, not scoped.
    pub fn bounds_namespaces(&self) -> bool {
        self.pools.iter().any(|p| p.pool.per_namespace.is_some())
    }

    /// `pools` (valid, in force) resolved on `nodes` (each node's labels); without pools, the
    /// implicit pool of `flag_range`.
    pub fn resolve(
        pools: Vec<Pool>,
        any_objects: bool,
        flag_range: PortRange,
        nodes: &[&BTreeMap<String, String>],
    ) -> PoolSet {
        if !any_objects {
            let pool = Pool::implicit(flag_range);
            return PoolSet {
                pools: vec![ResolvedPool { effective: pool.ranges.clone(), pool, conflicts: vec![] }],
                implicit: true,
            };
        }
        let mut pools = pools;
        pools.sort_by(|a, b| a.age_key().cmp(&b.age_key()));
        let mut out: Vec<ResolvedPool> = Vec::new();
        for pool in pools {
            let mut effective = pool.ranges.clone();
            let mut conflicts = Vec::new();
            for older in &out {
                let shares_node = nodes.iter().any(|l| pool.nodes.matches(l) && older.pool.nodes.matches(l));
                // Pools apart by address never serve one node address: no overlap either.
                if !shares_node || pool.addresses.disjoint(&older.pool.addresses) {
                    continue;
                }
                let overlaps = pool
                    .ranges
                    .iter()
                    .any(|r| older.pool.ranges.iter().any(|o| o.first <= r.last && r.first <= o.last));
                if overlaps {
                    conflicts.push(older.pool.name.clone());
                    for o in &older.pool.ranges {
                        effective = subtract(&effective, o);
                    }
                }
            }
            if pool.disabled {
                effective.clear();
            }
            out.push(ResolvedPool { pool, effective, conflicts });
        }
        PoolSet { pools: out, implicit: false }
    }

    pub fn get(&self, name: &str) -> Option<&ResolvedPool> {
        self.pools.iter().find(|p| p.pool.name == name)
    }
}

/// `ranges` without the numbers of `cut`.
fn subtract(ranges: &[PortRange], cut: &PortRange) -> Vec<PortRange> {
    let mut out = Vec::new();
    for r in ranges {
        if cut.last < r.first || r.last < cut.first {
            out.push(*r);
            continue;
        }
        if r.first < cut.first {
            out.push(PortRange { first: r.first, last: cut.first - 1 });
        }
        if cut.last < r.last {
            out.push(PortRange { first: cut.last + 1, last: r.last });
        }
    }
    out
}

/// What selection looks at on a Service.
#[derive(Debug, Clone, Copy)]
pub struct ServiceFacts<'a> {
    pub labels: &'a BTreeMap<String, String>,
    pub namespace_labels: &'a BTreeMap<String, String>,
    /// `nodelb.io/pool`.
    pub requested: Option<&'a str>,
    /// Node port numbers the Service holds now (its allocation annotation / state file).
    pub held: &'a [u16],
}

/// Why no pool serves a Service.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum NoPool {
    #[error("it asks for pool {0:?} ({ANNOTATION_POOL}), which does not exist")]
    Missing(String),
    #[error(
        "it asks for pool {0:?} ({ANNOTATION_POOL}), which does not admit it (its serviceSelector or namespaceSelector does not select it)"
    )]
    NotAdmitted(String),
    #[error("no pool accepts it (serviceSelector, namespaceSelector, autoAssign, disabled)")]
    NoneAccepts,
}

/// The pool a Service gets (module documentation: annotation, then the pool it holds its numbers
/// in while that still accepts it, then lowest priority, then oldest).
pub fn assign<'p>(set: &'p PoolSet, svc: &ServiceFacts<'_>) -> Result<&'p ResolvedPool, NoPool> {
    if let Some(name) = svc.requested.map(str::trim).filter(|n| !n.is_empty()) {
        // A pool is access control: naming it gets a Service nothing its selectors refuse.
        let p = set.get(name).ok_or_else(|| NoPool::Missing(name.to_string()))?;
        return match p.pool.accepts(svc) {
            true => Ok(p),
            false => Err(NoPool::NotAdmitted(name.to_string())),
        };
    }
    if set.implicit {
        return set.pools.first().ok_or(NoPool::NoneAccepts);
    }
    fn order<'a>(p: &&'a ResolvedPool) -> (i32, (bool, Option<k8s_openapi::jiff::Timestamp>, &'a str)) {
        (p.pool.priority, p.pool.age_key())
    }
    let holding = set
        .pools
        .iter()
        .filter(|p| p.pool.auto_assign && p.pool.accepts(svc))
        .filter(|p| !svc.held.is_empty() && svc.held.iter().all(|n| p.pool.contains(*n)))
        .min_by(|a, b| order(a).cmp(&order(b)));
    if let Some(p) = holding {
        return Ok(p);
    }
    set.pools
        .iter()
        .filter(|p| p.pool.auto_assign && !p.pool.disabled && p.pool.accepts(svc))
        .min_by(|a, b| order(a).cmp(&order(b)))
        .ok_or(NoPool::NoneAccepts)
}

/// The CustomResourceDefinition as shipped (`nodelb crd`; the chart's `crds/` holds exactly this,
/// checked by a test).
pub fn crd_yaml() -> String {
    use kube::CustomResourceExt;
    let header = "# GENERATED by `nodelb crd` from src/pool.rs: change the Rust types, then run\n\
                  # `cargo run -q -- crd > charts/nodelb/crds/nodeportpools.nodelb.io.yaml`.\n";
    let body = serde_saphyr::to_string(&NodePortPool::crd())
        .unwrap_or_else(|e| format!("# cannot serialize: {e}\n"));
    format!("{header}{body}")
}

/// What the pool decisions need besides the pools: Namespace labels (`namespaceSelector`) and,
/// on a node, that node's own labels (`nodeSelector`).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct PoolContext {
    pub set: PoolSet,
    pub namespaces: BTreeMap<String, BTreeMap<String, String>>,
    pub node_labels: BTreeMap<String, String>,
    /// The k3s ServiceLB labels narrow which nodes serve ([`crate::decisions::servicelb::in_force`]).
    pub servicelb: bool,
}

impl PoolContext {
    /// Per pool that restricts node addresses and selects this node, the addresses of this node
    /// that serve it ([`AddressFilter::select`]; pools selecting none are left out): what this
    /// node publishes on its Lease, so the leader lists exactly what answers.
    pub fn selected_addresses(&self, own: &NodeAddresses) -> BTreeMap<String, BTreeSet<IpAddr>> {
        self.set
            .pools
            .iter()
            .filter(|p| !p.pool.addresses.is_everything() && p.pool.nodes.matches(&self.node_labels))
            .map(|p| (p.pool.name.clone(), p.pool.addresses.select(own)))
            .filter(|(_, addrs)| !addrs.is_empty())
            .collect()
    }
}

/// What [`context`] builds a [`PoolContext`] from, in either mode.
pub struct ContextInput<'a> {
    /// The pool objects as read (Kubernetes: the cache; manifests: the directory).
    pub objects: &'a [PoolObject],
    /// `--port-range`: the implicit pool when there is no pool object.
    pub flag_range: PortRange,
    /// Every known node's labels (conflicts are judged on nodes both pools select). Manifests
    /// mode knows one node: its own (`--node-labels`).
    pub nodes: &'a [&'a BTreeMap<String, String>],
    /// This node's labels (`None`: not known, e.g. its Node object is not in the cache yet).
    pub own: Option<&'a BTreeMap<String, String>>,
    /// Each namespace's labels, read only when a pool in force has a `namespaceSelector`.
    pub namespaces: &'a dyn Fn() -> BTreeMap<String, BTreeMap<String, String>>,
    /// `--servicelb-labels`.
    pub servicelb: bool,
}

/// The pools in force (an invalid edit keeps `last_valid`'s version) resolved against the nodes,
/// with this node's labels; and the invalid pools with their reasons. Only what a pool in force
/// looks at is put in the context (it is part of the agent's input fingerprint): without pools
/// a new Namespace or a relabelled Node recomputes nothing.
pub fn context(last_valid: &mut LastValid, input: &ContextInput<'_>) -> (PoolContext, Vec<InvalidPool>) {
    let (pools, invalid) = last_valid.update(input.objects);
    let set = PoolSet::resolve(pools, !input.objects.is_empty(), input.flag_range, input.nodes);
    let servicelb = crate::decisions::servicelb::in_force(input.servicelb, input.nodes.iter().copied());
    let namespaces = match set.pools.iter().any(|p| !p.pool.namespaces.is_everything()) {
        true => (input.namespaces)(),
        false => BTreeMap::new(),
    };
    let own = match servicelb || set.pools.iter().any(|p| !p.pool.nodes.is_everything()) {
        true => input.own.cloned().unwrap_or_default(),
        false => BTreeMap::new(),
    };
    (PoolContext { set, namespaces, node_labels: own, servicelb }, invalid)
}

/// Namespace labels where no Namespace object is known (manifests mode): each namespace has the
/// label the API server puts on every Namespace, `kubernetes.io/metadata.name: <name>`.
pub fn implied_namespace_labels<'n>(
    namespaces: impl IntoIterator<Item = &'n str>,
) -> BTreeMap<String, BTreeMap<String, String>> {
    namespaces
        .into_iter()
        .map(|ns| (ns.to_string(), BTreeMap::from([(NAMESPACE_NAME_LABEL.to_string(), ns.to_string())])))
        .collect()
}

/// The label the API server sets on every Namespace to its name.
pub const NAMESPACE_NAME_LABEL: &str = "kubernetes.io/metadata.name";

/// Each Service's pool, as the allocator and the nodes use it.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Assignment {
    pub ranges: BTreeMap<ServiceKey, PoolRanges>,
    /// Services no pool serves: one problem per port (Event + condition).
    pub problems: Vec<AllocProblem>,
}

impl Assignment {
    /// Whether `key` has a pool.
    pub fn has_pool(&self, key: &ServiceKey) -> bool {
        self.ranges.contains_key(key)
    }
}

/// [`assign`] for every Service: `services` are the objects (labels, `nodelb.io/pool`), `valid`
/// the validated ones (ports, the numbers they hold), `previous` what the state file holds.
pub fn assign_services<S: Borrow<Service>, V: Borrow<LbService>>(
    ctx: &PoolContext,
    services: &[S],
    valid: &[V],
    previous: &Allocations,
) -> Assignment {
    let empty = BTreeMap::new();
    let by_key: BTreeMap<ServiceKey, &Service> =
        services.iter().map(|s| (crate::inputs::model::service_key(s.borrow()), s.borrow())).collect();
    let mut out = Assignment::default();
    for svc in valid.iter().map(Borrow::borrow) {
        let meta = by_key.get(&svc.key).map(|s| &s.metadata);
        let labels = meta.and_then(|m| m.labels.as_ref()).unwrap_or(&empty);
        let requested = meta.and_then(|m| m.annotations.as_ref()).and_then(|a| a.get(ANNOTATION_POOL));
        let mut held: Vec<u16> = svc.previous_allocation.values().copied().collect();
        held.extend(previous.get(&svc.key).into_iter().flat_map(|m| m.values().copied()));
        let facts = ServiceFacts {
            labels,
            namespace_labels: ctx.namespaces.get(&*svc.key.namespace).unwrap_or(&empty),
            requested: requested.map(String::as_str),
            held: &held,
        };
        match assign(&ctx.set, &facts) {
            Ok(p) => {
                let ranges = PoolRanges {
                    pool: p.pool.name.clone(),
                    keep: p.pool.ranges.clone(),
                    take: p.effective.clone(),
                    requestable: p.pool.requestable.clone(),
                    per_namespace: p.pool.per_namespace,
                    service_ports: p.pool.port_mode == PortMode::ServicePort,
                };
                out.ranges.insert(svc.key.clone(), ranges);
            }
            Err(why) => out.problems.extend(svc.ports.iter().map(|port| AllocProblem::NoPool {
                service: svc.key.clone(),
                port: port.id,
                why: why.to_string(),
            })),
        }
    }
    out
}

/// What the leader knows about one pool object in a round, for its status.
pub struct StatusInput<'a> {
    pub generation: Option<i64>,
    /// Its resolution (`None`: never valid, so not in force).
    pub resolved: Option<&'a ResolvedPool>,
    /// Why the object as written is not used (`None`: valid).
    pub invalid: Option<&'a InvalidPool>,
    /// Every allocation (numbers are unique cluster-wide: what is free is free for everyone).
    pub allocations: &'a Allocations,
    /// Which Services this pool serves.
    pub members: Vec<&'a ServiceKey>,
    /// Names of the nodes that serve it (selected and running an agent).
    pub nodes: Vec<String>,
    /// Its current status (transition times are kept while a condition's status holds).
    pub current: Option<&'a NodePortPoolStatus>,
    pub now: k8s_openapi::jiff::Timestamp,
}

/// The status a pool should have. Pure.
pub fn status_of(input: &StatusInput<'_>) -> NodePortPoolStatus {
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
    let mut st = NodePortPoolStatus { observed_generation: input.generation, ..Default::default() };
    let (ready, ready_reason, ready_msg) = match (input.invalid, input.resolved) {
        (Some(bad), _) => (false, "Invalid", bad.to_string()),
        (None, Some(r)) if r.pool.disabled => {
            (true, "Draining", "disabled: existing allocations stay, nothing new is allocated".to_string())
        }
        (None, Some(_)) => (true, "InForce", String::new()),
        (None, None) => (false, "Invalid", "not validated".to_string()),
    };
    let (conflict, conflict_reason, conflict_msg) = match input.resolved {
        Some(r) if !r.conflicts.is_empty() => (
            true,
            "Overlap",
            format!(
                "ports overlap older pool(s) {} on nodes both select: the overlap is not used for new allocations",
                r.conflicts.join(", ")
            ),
        ),
        _ => (false, "NoOverlap", String::new()),
    };
    for (type_, status, reason, message) in
        [("Ready", ready, ready_reason, ready_msg), ("Conflict", conflict, conflict_reason, conflict_msg)]
    {
        let status = if status { "True" } else { "False" }.to_string();
        let since = input
            .current
            .and_then(|c| c.conditions.iter().find(|c| c.type_ == type_ && c.status == status))
            .map(|c| c.last_transition_time.clone())
            .unwrap_or(Time(input.now));
        st.conditions.push(Condition {
            type_: type_.to_string(),
            status,
            reason: reason.to_string(),
            message,
            observed_generation: input.generation,
            last_transition_time: since,
        });
    }
    let Some(r) = input.resolved else { return st };
    let taken: BTreeSet<u16> = input.allocations.values().flat_map(|m| m.values().copied()).collect();
    let free = r.effective.iter().flat_map(|x| x.first..=x.last).filter(|n| !taken.contains(n)).count();
    let total: usize = r.pool.ranges.iter().map(PortRange::len).sum();
    let mine: Vec<(crate::domain::Protocol, u16)> = input
        .members
        .iter()
        .filter_map(|k| input.allocations.get(*k))
        .flat_map(|m| m.iter().map(|(id, n)| (id.protocol, *n)))
        .collect();
    let numbers: BTreeSet<u16> = mine.iter().map(|(_, n)| *n).collect();
    st.port_ranges = Some(describe_ranges(&r.effective));
    st.allocated = numbers.len() as i64;
    st.free = free as i64;
    for proto in [crate::domain::Protocol::Tcp, crate::domain::Protocol::Udp, crate::domain::Protocol::Sctp] {
        let allocated = mine.iter().filter(|(p, _)| *p == proto).count();
        st.protocols.push(ProtocolPorts {
            protocol: proto.k8s_name().to_string(),
            total: total as i64,
            allocated: allocated as i64,
            free: free as i64,
        });
    }
    st.node_count = input.nodes.len() as i64;
    st.nodes = input.nodes.clone();
    if let Some(max) = r.pool.per_namespace {
        let mut by_namespace: BTreeMap<&str, BTreeSet<u16>> = BTreeMap::new();
        for k in &input.members {
            let numbers = input.allocations.get(*k).into_iter().flat_map(|m| m.values().copied());
            by_namespace.entry(&k.namespace).or_default().extend(numbers);
        }
        st.namespaces_at_limit = by_namespace
            .into_iter()
            .filter(|(_, n)| n.len() >= max as usize)
            .map(|(ns, _)| ns.to_string())
            .collect();
    }
    st
}

/// How full one pool in force is: what `nodelb_pool_ports` exports on every node (manifests mode
/// has no pool status to read it from).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PoolUsage {
    pub name: String,
    /// Node port numbers held by the pool's Services.
    pub allocated: usize,
    /// Numbers its effective ranges still have for new allocations (none while draining).
    pub free: usize,
}

/// The usage of every pool in `set` (none for the implicit pool: `--port-range`'s own gauge
/// covers it), given every allocation and which pool each Service is in. Numbers are unique
/// cluster-wide, so a number any Service holds is not free in any pool. Pure.
pub fn usage<'a>(
    set: &PoolSet,
    allocations: &Allocations,
    members: impl IntoIterator<Item = (&'a ServiceKey, &'a str)>,
) -> Vec<PoolUsage> {
    if set.implicit {
        return Vec::new();
    }
    let taken: BTreeSet<u16> = allocations.values().flat_map(|m| m.values().copied()).collect();
    let mut held: BTreeMap<&str, BTreeSet<u16>> = BTreeMap::new();
    for (key, pool) in members {
        let numbers = allocations.get(key).into_iter().flat_map(|m| m.values().copied());
        held.entry(pool).or_default().extend(numbers);
    }
    set.pools
        .iter()
        .map(|r| PoolUsage {
            name: r.pool.name.clone(),
            allocated: held.get(r.pool.name.as_str()).map_or(0, BTreeSet::len),
            free: r.effective.iter().flat_map(|x| x.first..=x.last).filter(|n| !taken.contains(n)).count(),
        })
        .collect()
}

pub use crate::decisions::port_policy::describe_ranges;

#[cfg(test)]
mod tests;
