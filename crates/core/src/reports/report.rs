//! What a sync reports about each Service: programmed, waiting for endpoints, or refused and why,
//! per port with its node port and usable endpoints. Computed with the desired state (pure);
//! `/status` and `nodelb status` show it as it is.

use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum ServiceState {
    /// Rules are in the kernel and at least one endpoint is usable on this node.
    Programmed,
    /// Rules are in the kernel but no endpoint is usable: clients are refused.
    NoEndpoints,
    /// Not programmed at all (invalid input, no allocation); `reason` says why.
    Refused,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct PortStatus {
    pub port: u16,
    pub protocol: String,
    /// Allocated node port; `None` when allocation failed for this port.
    pub node_port: Option<u16>,
    /// Endpoints usable on this node (all families served).
    pub endpoints: usize,
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub problem: Option<String>,
    /// Machine-readable `problem`: an allocation's (`port_conflict`, …, as the Service's
    /// `reasonCode`) or why this node does not take the port (`in_use`, `not_allowed`,
    /// `not_selected`; `not_recorded`: the registry does not give it the number, the same on
    /// every node), the `reason` label of `nodelb_node_ports_refused`.
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub problem_code: Option<String>,
    /// New connections DNATed on this node (kernel counter; filled in when `/status` is served,
    /// absent with `--per-service-metrics=false`).
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub connections: Option<u64>,
    /// Packets of new connections dropped by `loadBalancerSourceRanges` (kernel counter, as
    /// `connections`).
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub refused_packets: Option<u64>,
}

/// An endpoint address the policy refused ([`crate::decisions::endpoint_policy`]).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct EndpointRefusalStatus {
    pub address: String,
    /// The `reason` label of `nodelb_endpoints_refused` (`loopback`, `node_address`, …).
    pub reason_code: String,
    pub reason: String,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ServiceStatus {
    /// Shared with the Service's key.
    pub namespace: arcstr::ArcStr,
    pub name: arcstr::ArcStr,
    pub state: ServiceState,
    /// Short machine-readable reason (`invalid_source_range`, `no_endpoints`, ...), the
    /// `reason` label of `nodelb_services`.
    #[serde(default)]
    pub reason_code: Option<String>,
    pub reason: Option<String>,
    pub ports: Vec<PortStatus>,
    /// Endpoints named by the Service that are not DNATed to, and why.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub refused_endpoints: Vec<EndpointRefusalStatus>,
    /// `sessionAffinity: ClientIP` is honoured, with this timeout (seconds).
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub session_affinity_seconds: Option<u32>,
    /// The NodePortPool the Service is allocated from (none while no pool object exists: the
    /// flags' range).
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub pool: Option<String>,
}
