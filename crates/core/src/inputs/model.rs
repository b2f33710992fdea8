//! Kubernetes facts (Service, EndpointSlice) → validated, typed load-balancer services.
//! Pure: no I/O. Every rejection is a [`Refusal`] value that names the object and the offending
//! value; nothing in here panics on any input.
//!
//! [`build`] owns three decisions: which Services are ours, whether they are valid, and which
//! endpoints back each service port.
//!
//! **Which Services.** `spec.type: LoadBalancer` whose `spec.loadBalancerClass` is ours, or unset
//! (unless [`ModelOptions::ignore_unclassed`]), and that is not opted out with
//! `nodelb.io/ignore: "true"`. Anything else is silently not ours: it is neither served nor refused.
//! An `ignore` value other than `true`/`false` (any case) is not an opt-out but a refusal naming the
//! annotation and value: a typo (`"yes"`) must neither silently drop the Service nor silently keep it.
//!
//! **Validation** (any failure refuses the whole Service; a half-programmed Service is worse than a
//! clearly refused one):
//! - `metadata.namespace` and `metadata.name`: DNS-1123 labels ([`check_dns_label`]). The API
//!   server enforces this; manifests mode does not have one, and a `/` or NUL in the key would
//!   corrupt the state file (`ns/a/b` does not read back) and the ruleset's comments.
//! - ports: protocol `TCP`/`UDP`/`SCTP` (unset means TCP, as in the API), number 1–65535, no
//!   duplicate `port/protocol`, no duplicate names (endpoint resolution goes by name), at least one.
//! - `spec.ipFamilies`: `IPv4`/`IPv6`, deduplicated in spec order. Unset: the families of
//!   `clusterIPs` (or `clusterIP`), else `[IPv4]`.
//! - `externalTrafficPolicy`: unset/`Cluster`/legacy `Global` → Cluster, `Local` → Local.
//! - `loadBalancerSourceRanges`: each entry a CIDR, or a plain address taken as /32 or /128.
//!   Host bits set (`10.0.0.1/8`) are accepted and truncated to the network (`10.0.0.0/8`),
//!   exactly what Kubernetes' own validation (Go `net.ParseCIDR`) does, so we enforce what the
//!   API server accepted. Any other bad entry fails closed. When the field is empty the legacy
//!   annotation `service.beta.kubernetes.io/load-balancer-source-ranges` is honoured, like
//!   kube-proxy does. Ranges are sorted and deduplicated.
//! - `nodelb.io/ports`: `service`, or a list `80/TCP=20080,53/UDP=20053`. The protocol may be
//!   omitted (`53=20053`), then the entry applies to every service port with that number. Unknown
//!   service port, bad syntax, node port 0 or >65535, an entry given twice, or two service ports
//!   of the same protocol asking for the same node port ⇒ refusal naming annotation and value.
//! - `nodelb.io/allocated-ports` is machine-written, so a bad entry never refuses the Service: the
//!   bad entry is dropped with a [`ModelWarning`] and the good entries are kept (stability). Entries
//!   for ports the Service no longer has are dropped silently (the port was removed).
//!
//! **Endpoints.** An EndpointSlice belongs to the Service named by its `kubernetes.io/service-name`
//! label in the same namespace. Only `addressType` IPv4/IPv6 (FQDN slices are skipped). A service
//! port takes its target port from the slice port with the same name (unnamed ↔ unnamed/empty)
//! and protocol, which is how named targetPorts resolve; a slice without that port contributes
//! nothing to it. Conditions: ready nil ⇒ true, serving nil ⇒ ready, terminating nil ⇒ false.
//! All endpoints are kept whatever their conditions (the planner chooses ready ones, or
//! serving-terminating ones as a fallback). Endpoints of a family the Service does not have are
//! dropped. The same address:port from several slices (slice churn) is kept once, with the best
//! conditions. Unparsable or wrong-family addresses are skipped with a [`ModelWarning`].
//!
//! **Bounds** (docs/design.md, "Bounds on input"): nodelb's annotations at most
//! [`MAX_ANNOTATION_BYTES`] (the API server's limit; a larger `nodelb.io/allocated-ports` is
//! ignored with a warning, the others refuse); at most [`MAX_SERVICE_BACKENDS`] ports, ports ×
//! source ranges, and (port, endpoint) pairs per Service (each port keeps its share of endpoints,
//! the best ones); a message quotes at most [`MAX_QUOTED`] bytes of a value; address warnings
//! are capped per Service. All work is linear in the input.

use std::borrow::Borrow;
use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::net::IpAddr;

use crate::inputs::compact::{Address, EndpointPort, EndpointSlice};
use ipnet::IpNet;
use k8s_openapi::api::core::v1::{Service, ServicePort};
use k8s_openapi::jiff::Timestamp;

use crate::domain::{
    Family, ParseError, PortId, Protocol, ServiceKey, check_dns_label, parse_port_number, parse_protocol,
    quoted,
};

/// Default `spec.loadBalancerClass` this agent serves.
pub const DEFAULT_LB_CLASS: &str = "nodelb.io/nodelb";
/// Annotation asking for specific node ports (`80/TCP=20080,53/UDP=20053`) or `service`
/// (each port's own number, klipper-lb style).
pub const ANNOTATION_PORTS: &str = "nodelb.io/ports";
/// Annotation carrying the allocation (written by the allocator, read back on restart).
pub const ANNOTATION_ALLOCATED: &str = "nodelb.io/allocated-ports";
/// Annotation opting a Service out (`"true"`; `"false"` = not opted out; anything else is refused).
pub const ANNOTATION_IGNORE: &str = "nodelb.io/ignore";
/// Legacy source-range annotation, honoured when `spec.loadBalancerSourceRanges` is empty.
pub const ANNOTATION_LEGACY_SOURCE_RANGES: &str = "service.beta.kubernetes.io/load-balancer-source-ranges";
/// Service condition the leader sets: are node ports allocated (`False` says why).
pub const CONDITION_ALLOCATED: &str = "nodelb.io/Allocated";
pub use crate::inputs::compact::LABEL_SERVICE_NAME;
/// Nodes with this label are never listed in a Service's status (the Kubernetes convention).
pub const LABEL_EXCLUDE_LB: &str = "node.kubernetes.io/exclude-from-external-load-balancers";

/// The leader's allocation annotation on a Service ([`ANNOTATION_ALLOCATED`]), if any.
pub fn allocated_annotation(svc: &Service) -> Option<&String> {
    svc.metadata.annotations.as_ref().and_then(|a| a.get(ANNOTATION_ALLOCATED))
}

/// Where a Service stands with the leader's decision on its node ports, which is all that can
/// make a node program it in Kubernetes mode (or make the leader act on it).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Standing {
    /// The decision is on it: an allocation annotation, or an `Allocated=False` condition saying
    /// why there is none ([`refused_allocation`]).
    Decided,
    /// nodelb's ([`is_ours`]), waiting for the decision.
    Undecided,
    /// Not nodelb's, and no decision on it: nothing is computed from it.
    NotOurs,
}

impl Standing {
    pub fn of(svc: &Service, opts: &ModelOptions) -> Standing {
        if allocated_annotation(svc).is_some() || refused_allocation(svc).is_some() {
            Standing::Decided
        } else if is_ours(svc, opts) {
            Standing::Undecided
        } else {
            Standing::NotOurs
        }
    }
}

/// The leader's `Allocated=False` condition on a Service (why it has no node port), if any: what a
/// node says for a Service it does not program, so part of what a node reads of it.
pub fn refused_allocation(
    svc: &Service,
) -> Option<&k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition> {
    let conditions = svc.status.as_ref()?.conditions.as_ref()?;
    conditions.iter().find(|c| c.type_ == CONDITION_ALLOCATED && c.status == "False")
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, serde::Serialize)]
pub enum TrafficPolicy {
    Cluster,
    Local,
}

/// What node ports a Service asks for (annotation [`ANNOTATION_PORTS`]).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub enum PortRequest {
    /// Any free port from the range.
    Auto,
    /// Each service port's own number (klipper-lb behaviour).
    ServicePorts,
    /// Explicit node port per service port; ports not listed are allocated automatically.
    Explicit(BTreeMap<PortId, u16>),
}

/// One backend address:port for one service port.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash, serde::Serialize)]
pub struct Endpoint {
    pub addr: IpAddr,
    pub port: u16,
    /// Shared with the EndpointSlice's endpoint.
    pub node_name: Option<arcstr::ArcStr>,
    /// `conditions.ready` (nil counts as true, per the EndpointSlice API).
    pub ready: bool,
    /// `conditions.serving` (nil: same as ready).
    pub serving: bool,
    /// `conditions.terminating` (nil counts as false).
    pub terminating: bool,
}

#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct LbPort {
    pub id: PortId,
    /// Service port name ("" when the Service has a single unnamed port).
    pub name: String,
    /// Endpoints for this port from all EndpointSlices of the Service, port resolved through the
    /// slice's port of the same name and protocol (this is how named targetPorts resolve).
    /// Sorted and deduplicated.
    pub endpoints: Vec<Endpoint>,
}

/// A time as RFC 3339 text (the form the status and the goldens show).
fn rfc3339<S: serde::Serializer>(t: &Option<Timestamp>, s: S) -> Result<S::Ok, S::Error> {
    match t {
        Some(t) => s.collect_str(t),
        None => s.serialize_none(),
    }
}

/// A validated LoadBalancer Service that this agent serves.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct LbService {
    pub key: ServiceKey,
    pub uid: Option<String>,
    /// Creation timestamp, for "older Service keeps the port" ordering (kept parsed: the
    /// allocator orders every Service by it every round).
    #[serde(serialize_with = "rfc3339")]
    pub created: Option<Timestamp>,
    /// Manifests mode: when this node first allocated the Service a port (from the state
    /// file). Manifests have no creationTimestamp, so this is their age (see the allocator);
    /// `None` in Kubernetes mode and for Services never allocated.
    #[serde(serialize_with = "rfc3339")]
    pub allocated_since: Option<Timestamp>,
    pub ports: Vec<LbPort>,
    /// From `spec.ipFamilies` (default: IPv4), in spec order, deduplicated.
    pub families: Vec<Family>,
    /// From `spec.loadBalancerSourceRanges`; empty means everyone.
    pub source_ranges: Vec<IpNet>,
    pub traffic_policy: TrafficPolicy,
    /// `sessionAffinity: ClientIP`: every new connection of a client goes to the endpoint its
    /// previous one went to, while that endpoint is usable and the client was seen within this
    /// many seconds (`sessionAffinityConfig.clientIP.timeoutSeconds`). `None`: no affinity.
    pub session_affinity: Option<u32>,
    pub port_request: PortRequest,
    /// Allocation found on the object ([`ANNOTATION_ALLOCATED`]), to keep ports stable.
    pub previous_allocation: BTreeMap<PortId, u16>,
    /// The Kubernetes NodePorts of its ports (`spec.ports[].nodePort`, allocated by the API
    /// server unless `spec.allocateLoadBalancerNodePorts: false`): kube-proxy serves them on
    /// every node, without what nodelb enforces (source ranges, pools, the endpoint policy).
    pub kube_node_ports: Vec<(PortId, u16)>,
}

impl LbService {
    /// A Service with the API defaults (IPv4, Cluster policy, no source ranges, ports allocated
    /// automatically), for callers that then set what differs.
    pub fn with_defaults(key: ServiceKey, ports: Vec<LbPort>) -> LbService {
        LbService {
            key,
            uid: None,
            created: None,
            allocated_since: None,
            ports,
            families: vec![Family::Ipv4],
            source_ranges: vec![],
            traffic_policy: TrafficPolicy::Cluster,
            session_affinity: None,
            port_request: PortRequest::Auto,
            previous_allocation: BTreeMap::new(),
            kube_node_ports: Vec::new(),
        }
    }
}

/// Why a Service (or a document) is not programmed. Each names the object and the bad value.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error, serde::Serialize)]
pub enum Refusal {
    #[error("Service {service}: invalid loadBalancerSourceRanges entry {}: {reason}", quoted(.value))]
    InvalidSourceRange { service: ServiceKey, value: String, reason: String },
    #[error("Service {service}: invalid annotation {annotation}={}: {reason}", quoted(.value))]
    InvalidAnnotation { service: ServiceKey, annotation: String, value: String, reason: String },
    #[error("Service {service}: port {}: {reason}", quoted(.port))]
    InvalidPort { service: ServiceKey, port: String, reason: String },
    #[error("Service {service}: invalid spec.ipFamilies entry {}", quoted(.value))]
    InvalidIpFamily { service: ServiceKey, value: String },
    #[error("Service {service}: invalid externalTrafficPolicy {}", quoted(.value))]
    InvalidTrafficPolicy { service: ServiceKey, value: String },
    #[error("Service {service}: invalid {field} {value:?}: {reason}")]
    InvalidSessionAffinity { service: ServiceKey, field: String, value: String, reason: String },
    #[error("Service {service}: {reason}")]
    Invalid { service: ServiceKey, reason: String },
}

impl Refusal {
    /// Short machine-readable reason, for metric labels.
    pub fn code(&self) -> &'static str {
        match self {
            Refusal::InvalidSourceRange { .. } => "invalid_source_range",
            Refusal::InvalidAnnotation { .. } => "invalid_annotation",
            Refusal::InvalidPort { .. } => "invalid_port",
            Refusal::InvalidIpFamily { .. } => "invalid_ip_family",
            Refusal::InvalidTrafficPolicy { .. } => "invalid_traffic_policy",
            Refusal::InvalidSessionAffinity { .. } => "invalid_session_affinity",
            Refusal::Invalid { .. } => "invalid",
        }
    }

    pub fn service(&self) -> &ServiceKey {
        match self {
            Refusal::InvalidSourceRange { service, .. }
            | Refusal::InvalidAnnotation { service, .. }
            | Refusal::InvalidPort { service, .. }
            | Refusal::InvalidIpFamily { service, .. }
            | Refusal::InvalidTrafficPolicy { service, .. }
            | Refusal::InvalidSessionAffinity { service, .. }
            | Refusal::Invalid { service, .. } => service,
        }
    }
}

/// Longest annotation value nodelb reads: what the API server allows for all of an object's
/// annotations together (256 KiB). A manifest has no API server in front of it.
pub const MAX_ANNOTATION_BYTES: usize = 256 * 1024;

/// Most (service port, endpoint) pairs one Service programs, and most ports × source ranges
/// (one rule each). Kubernetes' scalability envelope is 5,000 endpoints per Service; 20,000
/// pairs keep the agent's memory well within the DaemonSet's limit, whatever the input.
/// Endpoints beyond a port's share are cut (the best kept); more ports, or more source-range
/// rules, refuse the Service. docs/design.md, "Bounds on input".
pub const MAX_SERVICE_BACKENDS: usize = 20_000;

fn too_long(value: &str) -> String {
    format!(
        "is {} bytes long; the API server allows {MAX_ANNOTATION_BYTES} bytes for all annotations of an object",
        value.len()
    )
}

/// One entry of a port annotation: service port (protocol optional) → node port.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct PortMapEntry {
    port: u16,
    protocol: Option<Protocol>,
    node_port: u16,
}

/// Parses one `80/TCP=20080` (or `80=20080`) entry.
fn parse_port_map_entry(item: &str) -> Result<PortMapEntry, ParseError> {
    let (lhs, rhs) = item
        .split_once('=')
        .ok_or_else(|| ParseError(format!("entry {} is not PORT/PROTOCOL=NODEPORT", quoted(item))))?;
    let lhs = lhs.trim();
    let (port, protocol) = match lhs.split_once('/') {
        Some((p, proto)) => (parse_port_number(p)?, Some(parse_protocol(proto.trim())?)),
        None => (parse_port_number(lhs)?, None),
    };
    let node_port =
        parse_port_number(rhs).map_err(|e| ParseError(format!("entry {}: node {e}", quoted(item))))?;
    Ok(PortMapEntry { port, protocol, node_port })
}

/// Every node port number a port-map annotation can give its Service, as the model reads it
/// (entries with or without a protocol, a port listed twice: each of its numbers), sorted, each
/// once. A superset of what [`parse_allocated_ports`] keeps: what couples two Services through
/// one number must never be missed.
pub fn annotated_numbers(value: &str) -> Vec<u16> {
    let mut numbers: Vec<u16> = value
        .split(',')
        .map(str::trim)
        .filter_map(|item| parse_port_map_entry(item).ok())
        .map(|e| e.node_port)
        .collect();
    numbers.sort_unstable();
    numbers.dedup();
    numbers
}

/// Formats an allocation the way [`ANNOTATION_ALLOCATED`] and [`ANNOTATION_PORTS`] write it:
/// `53/UDP=20002,80/TCP=20001` (sorted by port, then protocol).
pub fn format_port_map(map: &BTreeMap<PortId, u16>) -> String {
    let items: Vec<String> = map.iter().map(|(id, node)| format!("{id}={node}")).collect();
    items.join(",")
}

/// Options of [`build`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ModelOptions {
    /// The `spec.loadBalancerClass` we serve.
    pub lb_class: String,
    /// Do not serve Services whose `loadBalancerClass` is unset.
    pub ignore_unclassed: bool,
    /// Honour the k3s ServiceLB node and Service labels ([`crate::decisions::servicelb`]).
    pub servicelb_labels: bool,
}

impl Default for ModelOptions {
    fn default() -> Self {
        ModelOptions {
            lb_class: DEFAULT_LB_CLASS.to_string(),
            ignore_unclassed: false,
            servicelb_labels: true,
        }
    }
}

/// A problem worth logging that does not refuse the Service (a skipped endpoint address, a
/// dropped entry of the machine-written allocation annotation).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct ModelWarning {
    pub service: ServiceKey,
    pub message: String,
}

impl fmt::Display for ModelWarning {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Service {}: {}", self.service, self.message)
    }
}

/// Result of [`build`]: the Services we serve (sorted by key), the ones we refuse (sorted by key),
/// and warnings.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize)]
pub struct ModelOutput {
    pub services: Vec<LbService>,
    pub refused: Vec<Refusal>,
    pub warnings: Vec<ModelWarning>,
}

/// Annotation prefixes of other load-balancer implementations (cloud providers, MetalLB,
/// kube-vip, PureLB, Cilium's LB IPAM). A Service without a `loadBalancerClass` that carries one
/// was made for that implementation, which serves unclassed Services too: nodelb does not take
/// it (it would publish an internal load balancer on the nodes' addresses before the other one
/// writes its status).
pub const OTHER_IMPLEMENTATIONS: [&str; 15] = [
    "service.beta.kubernetes.io/aws-load-balancer-",
    "service.beta.kubernetes.io/azure-",
    "cloud.google.com/load-balancer-",
    "networking.gke.io/",
    "service.beta.kubernetes.io/oci-load-balancer-",
    "oci.oraclecloud.com/",
    "service.beta.kubernetes.io/do-loadbalancer-",
    "load-balancer.hetzner.cloud/",
    "loadbalancer.openstack.org/",
    "service.beta.kubernetes.io/openstack-",
    "metallb.universe.tf/",
    "metallb.io/",
    "kube-vip.io/",
    "purelb.io/",
    "lbipam.cilium.io/",
];

/// Whether `annotation` is one of [`OTHER_IMPLEMENTATIONS`]'.
pub fn names_another_implementation(annotation: &str) -> bool {
    OTHER_IMPLEMENTATIONS.iter().any(|p| annotation.starts_with(p))
}

/// Whether a status ingress entry is one nodelb writes: a node address with `ipMode: Proxy`.
pub fn is_nodelb_ingress(i: &k8s_openapi::api::core::v1::LoadBalancerIngress) -> bool {
    i.ip.as_deref().is_some_and(|ip| !ip.is_empty())
        && i.hostname.as_deref().is_none_or(str::is_empty)
        && i.ip_mode.as_deref() == Some("Proxy")
}

/// The first status ingress entry of the Service that nodelb does not write.
pub fn foreign_ingress(svc: &Service) -> Option<&k8s_openapi::api::core::v1::LoadBalancerIngress> {
    let ingress = svc.status.as_ref().and_then(|s| s.load_balancer.as_ref()).and_then(|l| l.ingress.as_ref());
    ingress.into_iter().flatten().find(|i| !is_nodelb_ingress(i))
}

/// Why a Service without a `loadBalancerClass` belongs to another load balancer, if it does: its
/// status has an ingress entry nodelb does not write (a hostname, an address without
/// `ipMode: Proxy`: a cloud provider or MetalLB published it), or it carries another
/// implementation's annotation ([`OTHER_IMPLEMENTATIONS`]). Such a Service is not nodelb's
/// unless it names nodelb's class: nodelb neither fights the other over the status nor
/// publishes it on the nodes.
pub fn another_load_balancer(svc: &Service) -> Option<String> {
    if let Some(i) = foreign_ingress(svc) {
        let what = i.hostname.as_deref().filter(|h| !h.is_empty()).or(i.ip.as_deref()).unwrap_or_default();
        return Some(format!("its status already has the ingress {} of another load balancer", quoted(what)));
    }
    let annotations = svc.metadata.annotations.iter().flatten();
    annotations
        .map(|(k, _)| k)
        .find(|k| names_another_implementation(k))
        .map(|k| format!("it carries {}, an annotation of another load balancer", quoted(k)))
}

/// Is this Service ours (type, class, opt-out, another load balancer's)? Not a validation: a
/// `false` is silent.
pub fn is_ours(svc: &Service, opts: &ModelOptions) -> bool {
    let Some(spec) = svc.spec.as_ref() else {
        return false;
    };
    if spec.type_.as_deref() != Some("LoadBalancer") {
        return false;
    }
    let class_ok = match spec.load_balancer_class.as_deref() {
        None | Some("") => !opts.ignore_unclassed && another_load_balancer(svc).is_none(),
        Some(class) => class == opts.lb_class,
    };
    let ignored = svc
        .metadata
        .annotations
        .as_ref()
        .and_then(|a| a.get(ANNOTATION_IGNORE))
        .is_some_and(|v| parse_ignore(v) == Ok(true));
    class_ok && !ignored
}

/// Value of [`ANNOTATION_IGNORE`]: `true`/`false`, any case, surrounding blanks allowed.
fn parse_ignore(value: &str) -> Result<bool, String> {
    match value.trim().to_ascii_lowercase().as_str() {
        "true" => Ok(true),
        "false" => Ok(false),
        _ => Err("expected \"true\" or \"false\"".to_string()),
    }
}

/// Key of a Service object.
pub fn service_key(svc: &Service) -> ServiceKey {
    ServiceKey::new(namespace_str(&svc.metadata.namespace), svc.metadata.name.as_deref().unwrap_or_default())
}

/// No EndpointSlices, for [`build`] of Services alone (`&[]` does not say what it is a slice of).
pub const NO_SLICES: &[EndpointSlice] = &[];

/// Validates and types the Services that are ours and resolves their endpoints. Pure and
/// deterministic: the output does not depend on the order of the inputs (except that of two
/// objects with the same key, the first is used and the second refused). Takes the objects owned
/// or shared (`Arc`, as the sources hold them).
pub fn build<S: Borrow<Service>, E: Borrow<EndpointSlice>>(
    services: &[S],
    slices: &[E],
    opts: &ModelOptions,
) -> ModelOutput {
    let mut out = ModelOutput::default();
    let slices_by_service = index_slices(slices);
    let mut seen = BTreeSet::new();
    for svc in services.iter().map(Borrow::borrow).filter(|s| is_ours(s, opts)) {
        let key = service_key(svc);
        if !seen.insert(key.clone()) {
            out.refused
                .push(Refusal::Invalid { service: key, reason: "duplicate Service object".to_string() });
            continue;
        }
        let svc_slices: Vec<&EndpointSlice> = slices_by_service
            .get(&(&*key.namespace, &*key.name))
            .into_iter()
            .flatten()
            .map(|s| (*s).borrow())
            .collect();
        match build_one(svc, key, &svc_slices, &mut out.warnings) {
            Ok(lb) => out.services.push(lb),
            Err(refusal) => out.refused.push(refusal),
        }
    }
    out.services.sort_by(|a, b| a.key.cmp(&b.key));
    out.refused.sort_by(|a, b| a.service().cmp(b.service()));
    out.warnings.sort_by(|a, b| a.service.cmp(&b.service));
    out
}

/// EndpointSlices grouped by the Service they belong to (its namespace and name, borrowed from
/// the slices), each Service's in [`slice_order`]. Slices without the label are not part of any
/// Service.
pub(crate) fn index_slices<E: Borrow<EndpointSlice>>(slices: &[E]) -> BTreeMap<(&str, &str), Vec<&E>> {
    let mut map: BTreeMap<(&str, &str), Vec<&E>> = BTreeMap::new();
    for object in slices {
        if let Some(key) = slice_service(object.borrow()) {
            map.entry(key).or_default().push(object);
        }
    }
    for list in map.values_mut() {
        list.sort_by(|a, b| slice_order((*a).borrow(), (*b).borrow()));
    }
    map
}

/// The order a Service's EndpointSlices are read in: by name (a stable sort keeps two of one
/// name in the order given). An address two slices name (an endpoint moving from one to
/// another) is taken from the one [`resolve_endpoints`]'s ranking prefers and, on a tie, from the
/// first by name: never from whichever a cache happens to hand over first (a reflector's order
/// changes when its map grows), so the same objects always give the same rules.
pub fn slice_order(a: &EndpointSlice, b: &EndpointSlice) -> std::cmp::Ordering {
    a.metadata.name.cmp(&b.metadata.name)
}

/// The namespace and name of the Service an EndpointSlice belongs to (its label), borrowed;
/// `None` without the label.
pub fn slice_service(slice: &EndpointSlice) -> Option<(&str, &str)> {
    let name = slice.service_name.as_deref()?;
    (!name.is_empty()).then(|| (namespace_str(&slice.metadata.namespace), name))
}

/// The namespace and name of an object, borrowed ([`service_key`] without the copies).
pub fn borrowed_key<'a>(namespace: &'a Option<String>, name: Option<&'a str>) -> (&'a str, &'a str) {
    (namespace_str(namespace), name.unwrap_or_default())
}

/// Namespace of an object, `default` when unset (manifests often omit it).
fn namespace_str(ns: &Option<String>) -> &str {
    match ns.as_deref() {
        None | Some("") => "default",
        Some(ns) => ns,
    }
}

pub(crate) fn build_one(
    svc: &Service,
    key: ServiceKey,
    slices: &[&EndpointSlice],
    warnings: &mut Vec<ModelWarning>,
) -> Result<LbService, Refusal> {
    if key.name.is_empty() {
        return Err(Refusal::Invalid { service: key, reason: "metadata.name is empty".to_string() });
    }
    // The key names chains, the state file and status; a `/` in it would not read back.
    for (field, value) in [("metadata.namespace", &key.namespace), ("metadata.name", &key.name)] {
        if let Err(e) = check_dns_label(value) {
            let reason = format!("{field} {} {e}", quoted(value));
            return Err(Refusal::Invalid { service: key.clone(), reason });
        }
    }
    let Some(spec) = svc.spec.as_ref() else {
        // Unreachable through is_ours, but never panic.
        return Err(Refusal::Invalid { service: key, reason: "no spec".to_string() });
    };
    let annotations = svc.metadata.annotations.clone().unwrap_or_default();
    if let Some(value) = annotations.get(ANNOTATION_IGNORE)
        && let Err(reason) = parse_ignore(value)
    {
        return Err(Refusal::InvalidAnnotation {
            service: key,
            annotation: ANNOTATION_IGNORE.to_string(),
            value: value.clone(),
            reason,
        });
    }

    for annotation in [ANNOTATION_PORTS, ANNOTATION_LEGACY_SOURCE_RANGES] {
        if let Some(value) = annotations.get(annotation)
            && value.len() > MAX_ANNOTATION_BYTES
        {
            return Err(Refusal::InvalidAnnotation {
                service: key,
                annotation: annotation.to_string(),
                value: value.clone(),
                reason: too_long(value),
            });
        }
    }

    let ports = validate_ports(&key, spec.ports.as_deref().unwrap_or(&[]))?;
    if ports.len() > MAX_SERVICE_BACKENDS {
        let reason = format!(
            "spec.ports has {} ports; nodelb programs at most {MAX_SERVICE_BACKENDS} (port, endpoint) pairs per Service",
            ports.len()
        );
        return Err(Refusal::Invalid { service: key, reason });
    }
    let families = ip_families(&key, spec)?;
    let traffic_policy = match spec.external_traffic_policy.as_deref() {
        None | Some("") | Some("Cluster") | Some("Global") => TrafficPolicy::Cluster,
        Some("Local") => TrafficPolicy::Local,
        Some(other) => {
            return Err(Refusal::InvalidTrafficPolicy { service: key, value: other.to_string() });
        }
    };
    let session_affinity = session_affinity(&key, spec)?;
    let source_ranges = source_ranges(&key, spec.load_balancer_source_ranges.as_deref(), &annotations)?;
    // One rule per range in each port's firewall chain.
    if ports.len().saturating_mul(source_ranges.len()) > MAX_SERVICE_BACKENDS {
        let reason = format!(
            "loadBalancerSourceRanges has {} distinct ranges for {} ports: {} rules, at most {MAX_SERVICE_BACKENDS} per Service",
            source_ranges.len(),
            ports.len(),
            ports.len() * source_ranges.len()
        );
        return Err(Refusal::Invalid { service: key, reason });
    }
    let ids: Vec<PortId> = ports.iter().map(|(id, _)| *id).collect();
    let port_request = match annotations.get(ANNOTATION_PORTS) {
        None => PortRequest::Auto,
        Some(value) => parse_port_request(&key, value, &ids)?,
    };
    let previous_allocation = match annotations.get(ANNOTATION_ALLOCATED) {
        None => BTreeMap::new(),
        Some(value) if value.len() > MAX_ANNOTATION_BYTES => {
            let message = format!("ignoring annotation {ANNOTATION_ALLOCATED}: {}", too_long(value));
            warnings.push(ModelWarning { service: key.clone(), message });
            BTreeMap::new()
        }
        Some(value) => parse_previous_allocation(&key, value, &ids, warnings),
    };

    let kube_node_ports = (spec.ports.iter().flatten().zip(&ports))
        .filter_map(|(p, (id, _))| Some((*id, u16::try_from(p.node_port?).ok().filter(|n| *n != 0)?)))
        .collect();
    let parsed = parse_slices(&key, slices, &families, warnings);
    // Each port keeps at most its share of the Service's budget (at least one: the port count
    // was checked against it above).
    let per_port = MAX_SERVICE_BACKENDS / ports.len().max(1);
    let lb_ports = ports
        .into_iter()
        .map(|(id, name)| {
            let endpoints = resolve_endpoints(&key, id, &name, &parsed, per_port, warnings);
            LbPort { id, name, endpoints }
        })
        .collect();

    Ok(LbService {
        created: svc.metadata.creation_timestamp.as_ref().map(|t| t.0),
        uid: svc.metadata.uid.clone(),
        allocated_since: None,
        key,
        ports: lb_ports,
        families,
        source_ranges,
        traffic_policy,
        session_affinity,
        port_request,
        previous_allocation,
        kube_node_ports,
    })
}

/// Kubernetes' default `sessionAffinityConfig.clientIP.timeoutSeconds`: 3 hours.
pub const DEFAULT_AFFINITY_TIMEOUT: u32 = 10_800;
/// The API server's bound for it: one day.
pub const MAX_AFFINITY_TIMEOUT: u32 = 86_400;

/// `spec.sessionAffinity` with its timeout, validated as the API server does (manifests are not).
fn session_affinity(
    key: &ServiceKey,
    spec: &k8s_openapi::api::core::v1::ServiceSpec,
) -> Result<Option<u32>, Refusal> {
    let bad = |field: &str, value: String, reason: String| Refusal::InvalidSessionAffinity {
        service: key.clone(),
        field: field.to_string(),
        value,
        reason,
    };
    match spec.session_affinity.as_deref() {
        // The API server refuses a sessionAffinityConfig with `None`; here it is simply unused.
        None | Some("") | Some("None") => Ok(None),
        Some("ClientIP") => {
            let timeout = spec
                .session_affinity_config
                .as_ref()
                .and_then(|c| c.client_ip.as_ref())
                .and_then(|c| c.timeout_seconds);
            match timeout {
                None => Ok(Some(DEFAULT_AFFINITY_TIMEOUT)),
                Some(t) => match u32::try_from(t) {
                    Ok(t) if (1..=MAX_AFFINITY_TIMEOUT).contains(&t) => Ok(Some(t)),
                    _ => Err(bad(
                        "spec.sessionAffinityConfig.clientIP.timeoutSeconds",
                        t.to_string(),
                        format!("must be between 1 and {MAX_AFFINITY_TIMEOUT} seconds"),
                    )),
                },
            }
        }
        Some(other) => Err(bad(
            "spec.sessionAffinity",
            other.to_string(),
            "supported values are \"None\" and \"ClientIP\"".to_string(),
        )),
    }
}

/// Validated `(id, name)` of each service port, in spec order.
fn validate_ports(key: &ServiceKey, ports: &[ServicePort]) -> Result<Vec<(PortId, String)>, Refusal> {
    if ports.is_empty() {
        return Err(Refusal::Invalid { service: key.clone(), reason: "spec.ports is empty".to_string() });
    }
    let mut out: Vec<(PortId, String)> = Vec::with_capacity(ports.len());
    let (mut ids, mut names) = (BTreeSet::new(), BTreeSet::new());
    for p in ports {
        let name = p.name.clone().unwrap_or_default();
        let shown = if name.is_empty() { p.port.to_string() } else { format!("{name} ({})", p.port) };
        let bad = |reason: String| Refusal::InvalidPort { service: key.clone(), port: shown.clone(), reason };
        let protocol = match p.protocol.as_deref() {
            None | Some("") => Protocol::Tcp,
            Some("TCP") => Protocol::Tcp,
            Some("UDP") => Protocol::Udp,
            Some("SCTP") => Protocol::Sctp,
            Some(other) => return Err(bad(format!("unsupported protocol {}", quoted(other)))),
        };
        let port = match u16::try_from(p.port) {
            Ok(n) if n != 0 => n,
            _ => {
                return Err(bad(format!("port number {} is out of range 1-65535", p.port)));
            }
        };
        let id = PortId { port, protocol };
        if !ids.insert(id) {
            return Err(bad(format!("duplicate port {id}")));
        }
        if !names.insert(name.clone()) {
            let what = if name.is_empty() {
                "more than one unnamed port".to_string()
            } else {
                format!("duplicate port name {}", quoted(&name))
            };
            return Err(bad(what));
        }
        out.push((id, name));
    }
    Ok(out)
}

fn ip_families(
    key: &ServiceKey,
    spec: &k8s_openapi::api::core::v1::ServiceSpec,
) -> Result<Vec<Family>, Refusal> {
    let mut families = Vec::new();
    let declared = spec.ip_families.as_deref().unwrap_or(&[]);
    for value in declared {
        let family = match value.as_str() {
            "IPv4" => Family::Ipv4,
            "IPv6" => Family::Ipv6,
            other => {
                return Err(Refusal::InvalidIpFamily { service: key.clone(), value: other.to_string() });
            }
        };
        if !families.contains(&family) {
            families.push(family);
        }
    }
    if families.is_empty() {
        // Older API servers (or hand-written manifests) leave ipFamilies unset; the cluster IPs
        // still say which families the Service has. "None" (headless) and garbage are skipped.
        let ips = spec.cluster_ips.clone().unwrap_or_default().into_iter().chain(spec.cluster_ip.clone());
        for ip in ips.filter_map(|ip| ip.parse::<IpAddr>().ok()) {
            let family = Family::of(&ip);
            if !families.contains(&family) {
                families.push(family);
            }
        }
    }
    if families.is_empty() {
        families.push(Family::Ipv4);
    }
    Ok(families)
}

/// One source range: a CIDR (host bits truncated) or a plain address.
pub fn parse_source_range(value: &str) -> Result<IpNet, String> {
    let v = value.trim();
    if v.is_empty() {
        return Err("empty entry".to_string());
    }
    if let Ok(net) = v.parse::<IpNet>() {
        return Ok(net.trunc());
    }
    if let Ok(addr) = v.parse::<IpAddr>() {
        return Ok(IpNet::from(addr));
    }
    Err("not a CIDR (like 192.0.2.0/24 or 2001:db8::/32) or an IP address".to_string())
}

fn source_ranges(
    key: &ServiceKey,
    spec_ranges: Option<&[String]>,
    annotations: &BTreeMap<String, String>,
) -> Result<Vec<IpNet>, Refusal> {
    let spec_ranges = spec_ranges.unwrap_or(&[]);
    let mut out = Vec::new();
    if !spec_ranges.is_empty() {
        for value in spec_ranges {
            let net = parse_source_range(value).map_err(|reason| Refusal::InvalidSourceRange {
                service: key.clone(),
                value: value.clone(),
                reason,
            })?;
            out.push(net);
        }
    } else if let Some(value) = annotations.get(ANNOTATION_LEGACY_SOURCE_RANGES) {
        // Comma-separated; empty items (a trailing comma) are not ranges and are skipped.
        for item in value.split(',').map(str::trim).filter(|i| !i.is_empty()) {
            let net = parse_source_range(item).map_err(|reason| Refusal::InvalidAnnotation {
                service: key.clone(),
                annotation: ANNOTATION_LEGACY_SOURCE_RANGES.to_string(),
                value: value.clone(),
                reason: format!("entry {}: {reason}", quoted(item)),
            })?;
            out.push(net);
        }
    }
    out.sort();
    out.dedup();
    Ok(out)
}

/// The service ports by number, for [`entry_targets`] (a Service may have thousands).
fn ports_by_number(ids: &[PortId]) -> BTreeMap<u16, Vec<PortId>> {
    let mut map: BTreeMap<u16, Vec<PortId>> = BTreeMap::new();
    for id in ids {
        map.entry(id.port).or_default().push(*id);
    }
    map
}

/// Matches an annotation entry against the service ports; empty when it names no service port.
fn entry_targets(entry: &PortMapEntry, by_number: &BTreeMap<u16, Vec<PortId>>) -> Vec<PortId> {
    by_number
        .get(&entry.port)
        .into_iter()
        .flatten()
        .filter(|id| entry.protocol.is_none_or(|p| p == id.protocol))
        .copied()
        .collect()
}

/// A list of ports for a message: the first ten, and how many there are.
fn port_list(ids: &[PortId]) -> String {
    let shown: Vec<String> = ids.iter().take(10).map(PortId::to_string).collect();
    match ids.len() {
        n if n > shown.len() => format!("{}, … ({n} ports)", shown.join(", ")),
        _ => shown.join(", "),
    }
}

fn parse_port_request(key: &ServiceKey, value: &str, ids: &[PortId]) -> Result<PortRequest, Refusal> {
    let bad = |reason: String| Refusal::InvalidAnnotation {
        service: key.clone(),
        annotation: ANNOTATION_PORTS.to_string(),
        value: value.to_string(),
        reason,
    };
    let trimmed = value.trim();
    if trimmed.is_empty() {
        return Ok(PortRequest::Auto);
    }
    if trimmed.eq_ignore_ascii_case("service") {
        return Ok(PortRequest::ServicePorts);
    }
    let mut map = BTreeMap::new();
    let by_number = ports_by_number(ids);
    for item in trimmed.split(',').map(str::trim).filter(|i| !i.is_empty()) {
        let entry = parse_port_map_entry(item).map_err(|e| bad(e.0))?;
        let targets = entry_targets(&entry, &by_number);
        if targets.is_empty() {
            return Err(bad(format!(
                "entry {} names no port of the Service (ports: {})",
                quoted(item),
                port_list(ids)
            )));
        }
        for id in targets {
            if map.insert(id, entry.node_port).is_some() {
                return Err(bad(format!("port {id} is given more than once")));
            }
        }
    }
    // One node port carries one service port per protocol; two would be ambiguous.
    let mut used = BTreeMap::new();
    for (id, node) in &map {
        if let Some(other) = used.insert((*node, id.protocol), *id) {
            return Err(bad(format!("ports {other} and {id} both ask for node port {node}/{}", id.protocol)));
        }
    }
    Ok(PortRequest::Explicit(map))
}

/// The entries of an allocation annotation (`80/TCP=20001,53/UDP=20002`, as the allocator writes
/// it) that are well-formed and name their protocol, without checking them against the Service's
/// ports (for Services that are refused, whose ports are unknown). Malformed entries are skipped.
pub fn parse_allocated_ports(value: &str) -> BTreeMap<PortId, u16> {
    value
        .split(',')
        .map(str::trim)
        .filter_map(|item| parse_port_map_entry(item).ok())
        .filter_map(|e| Some((PortId { port: e.port, protocol: e.protocol? }, e.node_port)))
        .collect()
}

fn parse_previous_allocation(
    key: &ServiceKey,
    value: &str,
    ids: &[PortId],
    warnings: &mut Vec<ModelWarning>,
) -> BTreeMap<PortId, u16> {
    let mut map = BTreeMap::new();
    let by_number = ports_by_number(ids);
    // One warning for the whole annotation, however many entries are bad.
    let (mut first_bad, mut bad) = (None, 0usize);
    for item in value.split(',').map(str::trim).filter(|i| !i.is_empty()) {
        let entry = match parse_port_map_entry(item) {
            Ok(entry) => entry,
            Err(e) => {
                bad += 1;
                first_bad.get_or_insert(e);
                continue;
            }
        };
        for id in entry_targets(&entry, &by_number) {
            map.entry(id).or_insert(entry.node_port);
        }
    }
    if let Some(e) = first_bad {
        let more = if bad > 1 { format!(" (and {} more bad entries)", bad - 1) } else { String::new() };
        warnings.push(ModelWarning {
            service: key.clone(),
            message: format!("ignoring an entry of annotation {ANNOTATION_ALLOCATED}: {e}{more}"),
        });
    }
    map
}

/// The addresses of one EndpointSlice, parsed once for all the Service's ports.
struct ParsedSlice<'a> {
    slice: &'a EndpointSlice,
    /// The slice's ports by name (a manifest's slice is not limited to the API's 100 ports).
    ports: BTreeMap<&'a str, Vec<&'a EndpointPort>>,
    /// Per endpoint of the slice, its usable addresses.
    addresses: Vec<Vec<IpAddr>>,
}

/// Warnings about skipped addresses kept per Service: the first few, then a count (a slice set
/// with many bad addresses must not make a log line for each, times the number of ports).
const MAX_ADDRESS_WARNINGS: usize = 5;

/// The Service's slices of a family it has, with their addresses parsed; bad or wrong-family
/// addresses are skipped with a warning (at most [`MAX_ADDRESS_WARNINGS`] and a count).
fn parse_slices<'a>(
    key: &ServiceKey,
    slices: &[&'a EndpointSlice],
    families: &[Family],
    warnings: &mut Vec<ModelWarning>,
) -> Vec<ParsedSlice<'a>> {
    let mut skipped = 0usize;
    let mut out = Vec::new();
    for slice in slices {
        let family = match slice.address_type.as_str() {
            "IPv4" => Family::Ipv4,
            "IPv6" => Family::Ipv6,
            _ => continue, // FQDN (or unknown): nothing we can DNAT to.
        };
        if !families.contains(&family) {
            continue;
        }
        let slice_name = slice.metadata.name.as_deref().unwrap_or("<unnamed>");
        let mut addresses = Vec::new();
        for ep in slice.endpoints.iter().flatten() {
            let mut usable = Vec::new();
            for address in &ep.addresses {
                let problem = match address {
                    Address::Ip(addr) if Family::of(addr) == family => {
                        usable.push(*addr);
                        continue;
                    }
                    Address::Ip(addr) => format!("address {} is not {family}", quoted(&addr.to_string())),
                    Address::Unparsed(text) => format!("bad address {}", quoted(text)),
                };
                skipped += 1;
                if skipped <= MAX_ADDRESS_WARNINGS {
                    let message = format!("EndpointSlice {}: {problem}; skipped", quoted(slice_name));
                    warnings.push(ModelWarning { service: key.clone(), message });
                }
            }
            addresses.push(usable);
        }
        let mut ports: BTreeMap<&str, Vec<_>> = BTreeMap::new();
        for p in slice.ports.as_deref().unwrap_or(&[]) {
            ports.entry(p.name.as_deref().unwrap_or("")).or_default().push(p);
        }
        out.push(ParsedSlice { slice, ports, addresses });
    }
    if skipped > MAX_ADDRESS_WARNINGS {
        let message = format!("{} more endpoint addresses skipped", skipped - MAX_ADDRESS_WARNINGS);
        warnings.push(ModelWarning { service: key.clone(), message });
    }
    out
}

/// Endpoints of one service port from the Service's slices: sorted, one per address:port (with
/// the best conditions when slices disagree). More than `limit` (the port's share of
/// [`MAX_SERVICE_BACKENDS`]) are cut to the best `limit`: ready first, then serving, then not
/// terminating, then by address, so every node keeps the same ones; a warning says so.
fn resolve_endpoints(
    key: &ServiceKey,
    id: PortId,
    name: &str,
    slices: &[ParsedSlice<'_>],
    limit: usize,
    warnings: &mut Vec<ModelWarning>,
) -> Vec<Endpoint> {
    let mut best: BTreeMap<(IpAddr, u16), Endpoint> = BTreeMap::new();
    let rank = |e: &Endpoint| (e.ready, e.serving, !e.terminating);
    for parsed in slices {
        let slice = parsed.slice;
        let target_ports: Vec<u16> = parsed
            .ports
            .get(name)
            .into_iter()
            .flatten()
            .filter(|p| match p.protocol.as_deref() {
                None | Some("") => id.protocol == Protocol::Tcp,
                Some(proto) => parse_protocol(proto).is_ok_and(|p| p == id.protocol),
            })
            // A nil port means "all ports" in the API; we cannot DNAT to that, so skip it.
            .filter_map(|p| p.port.and_then(|n| u16::try_from(n).ok()).filter(|n| *n != 0))
            .collect();
        if target_ports.is_empty() {
            continue;
        }
        for (ep, addresses) in slice.endpoints.iter().flatten().zip(&parsed.addresses) {
            let cond = ep.conditions.as_ref();
            let ready = cond.and_then(|c| c.ready).unwrap_or(true);
            let serving = cond.and_then(|c| c.serving).unwrap_or(ready);
            let terminating = cond.and_then(|c| c.terminating).unwrap_or(false);
            for addr in addresses {
                for port in &target_ports {
                    let candidate = Endpoint {
                        addr: *addr,
                        port: *port,
                        node_name: ep.node_name.clone(),
                        ready,
                        serving,
                        terminating,
                    };
                    match best.get(&(*addr, *port)) {
                        Some(existing) if rank(existing) >= rank(&candidate) => {}
                        _ => {
                            best.insert((*addr, *port), candidate);
                        }
                    }
                }
            }
        }
    }
    let mut endpoints: Vec<Endpoint> = best.into_values().collect();
    if endpoints.len() > limit {
        let total = endpoints.len();
        endpoints.sort_by(|a, b| rank(b).cmp(&rank(a)).then_with(|| a.cmp(b)));
        endpoints.truncate(limit);
        endpoints.sort();
        warnings.push(ModelWarning {
            service: key.clone(),
            message: format!(
                "port {id}: {total} endpoints, {limit} programmed (a Service programs at most \
                 {MAX_SERVICE_BACKENDS} (port, endpoint) pairs; ready ones first, then by address)"
            ),
        });
    }
    endpoints
}

#[cfg(test)]
mod tests;
