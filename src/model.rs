//! Kubernetes facts (Service, EndpointSlice) → validated, typed load-balancer services.
//! Pure: no I/O. Every rejection is a [`Refusal`] value that names the object and the offending
//! value; nothing in here panics on any input.

use std::collections::BTreeMap;
use std::fmt;
use std::net::IpAddr;

use ipnet::IpNet;

use crate::ir::{Family, Protocol};

/// Default `spec.loadBalancerClass` this agent serves.
pub const DEFAULT_LB_CLASS: &str = "nodelb.io/nodelb";
/// Annotation asking for specific node ports (`80/TCP=20080,53/UDP=20053`) or `service`
/// (each port's own number, klipper-lb style).
pub const ANNOTATION_PORTS: &str = "nodelb.io/ports";
/// Annotation carrying the allocation (written by the allocator, read back on restart).
pub const ANNOTATION_ALLOCATED: &str = "nodelb.io/allocated-ports";
/// Annotation opting a Service out (`"true"`).
pub const ANNOTATION_IGNORE: &str = "nodelb.io/ignore";

/// `namespace/name` of a Service.
#[derive(
    Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash, serde::Serialize, serde::Deserialize,
)]
pub struct ServiceKey {
    pub namespace: String,
    pub name: String,
}

impl fmt::Display for ServiceKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.namespace, self.name)
    }
}

/// Identity of one service port: its `port` number and protocol (`80/TCP`). Unique within a
/// Service by Kubernetes validation, and the key of allocations.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, serde::Serialize, serde::Deserialize,
)]
pub struct PortId {
    pub port: u16,
    pub protocol: Protocol,
}

impl fmt::Display for PortId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.port, self.protocol)
    }
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
    pub node_name: Option<String>,
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

/// A validated LoadBalancer Service that this agent serves.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct LbService {
    pub key: ServiceKey,
    pub uid: Option<String>,
    /// RFC 3339 creation timestamp, for "older Service keeps the port" ordering.
    pub created: Option<String>,
    pub ports: Vec<LbPort>,
    /// From `spec.ipFamilies` (default: IPv4), in spec order, deduplicated.
    pub families: Vec<Family>,
    /// From `spec.loadBalancerSourceRanges`; empty means everyone.
    pub source_ranges: Vec<IpNet>,
    pub traffic_policy: TrafficPolicy,
    pub port_request: PortRequest,
    /// Allocation found on the object ([`ANNOTATION_ALLOCATED`]), to keep ports stable.
    pub previous_allocation: BTreeMap<PortId, u16>,
}

/// Why a Service (or a document) is not programmed. Each names the object and the bad value.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error, serde::Serialize)]
pub enum Refusal {
    #[error("Service {service}: invalid loadBalancerSourceRanges entry {value:?}: {reason}")]
    InvalidSourceRange {
        service: ServiceKey,
        value: String,
        reason: String,
    },
    #[error("Service {service}: invalid annotation {annotation}={value:?}: {reason}")]
    InvalidAnnotation {
        service: ServiceKey,
        annotation: String,
        value: String,
        reason: String,
    },
    #[error("Service {service}: port {port:?}: {reason}")]
    InvalidPort {
        service: ServiceKey,
        port: String,
        reason: String,
    },
    #[error("Service {service}: invalid spec.ipFamilies entry {value:?}")]
    InvalidIpFamily { service: ServiceKey, value: String },
    #[error("Service {service}: invalid externalTrafficPolicy {value:?}")]
    InvalidTrafficPolicy { service: ServiceKey, value: String },
    #[error("Service {service}: {reason}")]
    Invalid { service: ServiceKey, reason: String },
}

impl Refusal {
    pub fn service(&self) -> &ServiceKey {
        match self {
            Refusal::InvalidSourceRange { service, .. }
            | Refusal::InvalidAnnotation { service, .. }
            | Refusal::InvalidPort { service, .. }
            | Refusal::InvalidIpFamily { service, .. }
            | Refusal::InvalidTrafficPolicy { service, .. }
            | Refusal::Invalid { service, .. } => service,
        }
    }
}
