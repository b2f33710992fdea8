//! What the agent reports about itself: per-Service state (programmed, waiting for endpoints,
//! refused and why), forwarding per family, the last sync. Shared between the sync loop (writer)
//! and the HTTP server (reader); serialised as the `/status` JSON that `nodelb status` prints.

use std::collections::BTreeMap;
use std::sync::{Arc, RwLock};
use std::time::Instant;

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
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ServiceStatus {
    pub namespace: String,
    pub name: String,
    pub state: ServiceState,
    /// Short machine-readable reason (`invalid_source_range`, `no_endpoints`, ...), the
    /// `reason` label of `nodelb_services`.
    #[serde(default)]
    pub reason_code: Option<String>,
    pub reason: Option<String>,
    pub ports: Vec<PortStatus>,
    /// `sessionAffinity: ClientIP` is honoured, with this timeout (seconds).
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub session_affinity_seconds: Option<u32>,
}

#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct FamilyStatus {
    /// The forwarding sysctl is on.
    pub forwarding: bool,
    /// Rules for this family are programmed.
    pub programmed: bool,
    /// Why not, in plain words.
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub reason: Option<String>,
}

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct SyncStatus {
    pub ok: bool,
    /// "full" or "incremental".
    pub kind: String,
    pub changes: usize,
    pub duration_ms: f64,
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub error: Option<String>,
    /// Seconds since the Unix epoch.
    pub at: u64,
}

#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Status {
    pub node_name: String,
    pub services: Vec<ServiceStatus>,
    pub families: BTreeMap<String, FamilyStatus>,
    /// Families the served Services ask for (`spec.ipFamilies`), e.g. `["ipv4", "ipv6"]`.
    pub needed_families: Vec<String>,
    /// Problems reading the manifests (file, document, message), or other input problems.
    pub problems: Vec<String>,
    /// Bridges on which an endpoint reaching its own Service through the node fails
    /// (hairpin mode off behind br_netfilter).
    #[serde(default)]
    pub hairpin: Vec<crate::hairpin::HairpinWarning>,
    pub last_sync: Option<SyncStatus>,
    /// The source has been read completely at least once.
    pub source_synced: bool,
    #[serde(skip)]
    pub last_tick: Option<Instant>,
}

impl Status {
    /// `Ok(None)` when the agent can serve everything; `Ok(Some(note))` when it serves but a
    /// family some Service needs is not served (degraded); `Err(reason)` when it cannot serve:
    /// source not read, last sync failed, or none of the families the Services need is usable.
    /// Reasons are plain words naming the sysctl or the error.
    pub fn readiness(&self) -> Result<Option<String>, String> {
        if !self.source_synced {
            return Err(
                "desired state not read yet (manifests not loaded, or Kubernetes caches not synced)".into()
            );
        }
        match &self.last_sync {
            None => return Err("no sync has completed yet".into()),
            Some(s) if !s.ok => {
                return Err(format!("last sync failed: {}", s.error.as_deref().unwrap_or("unknown error")));
            }
            Some(_) => {}
        }
        let unserved: Vec<&FamilyStatus> = self
            .needed_families
            .iter()
            .filter_map(|f| self.families.get(f))
            .filter(|f| !f.programmed)
            .collect();
        let reasons = || unserved.iter().filter_map(|f| f.reason.clone()).collect::<Vec<_>>().join("; ");
        if unserved.is_empty() {
            Ok(None)
        } else if unserved.len() == self.needed_families.len() {
            Err(format!("no address family the Services need can be served: {}", reasons()))
        } else {
            Ok(Some(format!("degraded: {}", reasons())))
        }
    }
}

pub type SharedStatus = Arc<RwLock<Status>>;
