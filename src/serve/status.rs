//! What the agent reports about itself: per-Service state (programmed, waiting for endpoints,
//! refused and why: [`crate::core::reports::report`]), forwarding per family, the host firewall, the last sync. Shared between the sync loop (writer)
//! and the HTTP server (reader); serialised as the `/status` JSON that `nodelb status` prints.

use std::collections::BTreeMap;
use std::sync::{Arc, RwLock};
use std::time::Instant;

use serde::{Deserialize, Serialize};

use crate::core::reports::report::ServiceStatus;

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
    /// A host firewall drops this family's forwarded connections for certain: the family is
    /// programmed but not served (the table or chain, and the fix).
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub firewall: Option<String>,
    /// Only nodelb's forward counters say connections of this family are dropped: served, and
    /// reported as degraded.
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub evidence: Option<String>,
}

impl FamilyStatus {
    /// The family is delivered: programmed and no firewall known to drop it.
    pub fn served(&self) -> bool {
        self.programmed && self.firewall.is_none()
    }
}

/// What the last host-firewall check found (see [`crate::core::ruleset::hostfw`]).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct HostFirewallStatus {
    /// Seconds since the Unix epoch of the last check.
    pub checked_at: u64,
    /// Foreign forward chains that drop nodelb's connections (certain or not), with the fix.
    pub drops: Vec<FirewallDrop>,
    /// The node-level forward counters per family: new connections that entered the forward
    /// path and that left it, as last read.
    pub counters: BTreeMap<String, crate::core::ruleset::hostfw::ForwardCounts>,
    /// What the counters said last, per family (`dropping` since when, or `passing`).
    pub evidence: BTreeMap<String, crate::core::ruleset::hostfw::EvidenceState>,
    /// Where nodelb's ACCEPT is (`--iptables-forward-accept`), e.g. `table ip filter chain FORWARD`.
    pub accept_rules: Vec<String>,
    /// Chains or tables that could not be read or written.
    pub problems: Vec<String>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct FirewallDrop {
    #[serde(flatten)]
    pub finding: crate::core::ruleset::hostfw::Finding,
    /// Every new connection of the family is dropped there (not only maybe).
    pub certain: bool,
    pub fix: String,
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
    /// Shared with the sync loop's decision: a Service it did not decide again keeps its line.
    pub services: Vec<Arc<ServiceStatus>>,
    /// Of `services`, those this node refuses for causes of its own, as its node report says
    /// them: computed once per sync, not at every Lease write.
    #[serde(skip)]
    pub refused: Vec<crate::core::k8s::cluster_view::Refused>,
    pub families: BTreeMap<String, FamilyStatus>,
    /// Families the served Services ask for (`spec.ipFamilies`), e.g. `["ipv4", "ipv6"]`.
    pub needed_families: Vec<String>,
    /// Problems reading the manifests (file, document, message), or other input problems.
    pub problems: Vec<String>,
    /// Bridges on which an endpoint reaching its own Service through the node fails
    /// (hairpin mode off behind br_netfilter).
    #[serde(default)]
    pub hairpin: Vec<crate::core::ruleset::hairpin::HairpinWarning>,
    pub last_sync: Option<SyncStatus>,
    /// The source has been read completely at least once.
    pub source_synced: bool,
    /// Ports processes on this node listen on that nodelb could otherwise allocate
    /// (`22/TCP,20005/UDP`): never taken here; in Kubernetes mode published on the node Lease.
    /// `None` until this agent has read its node's sockets (tried, at its first sync): until
    /// then it publishes nothing, so that the leader neither reads an empty list as "no
    /// listeners" nor loses what the agent before it published.
    #[serde(default)]
    pub listening_ports: Option<String>,
    /// Per address-restricted node port pool, the addresses this node serves it on
    /// (`nodelb.io/pool-addresses` format); `None` until the first successful sync, or when too
    /// long to publish. In Kubernetes mode published on the node Lease.
    #[serde(default)]
    pub pool_addresses: Option<String>,
    /// This node's addresses as read from its kernel (`nodelb.io/addresses` format): in
    /// Kubernetes mode published on the node Lease, so that no node DNATs to them. `None` until
    /// read.
    #[serde(default)]
    pub node_addresses: Option<String>,
    #[serde(default)]
    pub host_firewall: HostFirewallStatus,
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
        let needed: Vec<&FamilyStatus> =
            self.needed_families.iter().filter_map(|f| self.families.get(f)).collect();
        let unserved: Vec<&&FamilyStatus> = needed.iter().filter(|f| !f.served()).collect();
        // A family not served says why: forwarding off, or a firewall that drops it; one served
        // whose connections only the counters see dropped is a degradation, not a refusal.
        let reasons = |fams: &[&&FamilyStatus]| {
            fams.iter()
                .filter_map(|f| if f.programmed { f.firewall.clone() } else { f.reason.clone() })
                .collect::<Vec<_>>()
                .join("; ")
        };
        let evidence: Vec<&&FamilyStatus> =
            needed.iter().filter(|f| f.served() && f.evidence.is_some()).collect();
        let mut degraded: Vec<String> = Vec::new();
        if !unserved.is_empty() {
            if unserved.len() == needed.len() && !needed.is_empty() {
                return Err(format!(
                    "no address family the Services need can be served: {}",
                    reasons(&unserved)
                ));
            }
            degraded.push(reasons(&unserved));
        }
        degraded.extend(evidence.iter().filter_map(|f| f.evidence.clone()));
        if degraded.is_empty() { Ok(None) } else { Ok(Some(format!("degraded: {}", degraded.join("; ")))) }
    }
}

pub type SharedStatus = Arc<RwLock<Status>>;

#[cfg(test)]
mod tests {
    use super::*;

    fn status(needed: &[&str], families: &[(&str, FamilyStatus)]) -> Status {
        Status {
            needed_families: needed.iter().map(|s| s.to_string()).collect(),
            families: families.iter().map(|(n, f)| (n.to_string(), f.clone())).collect(),
            source_synced: true,
            last_sync: Some(SyncStatus { ok: true, ..Default::default() }),
            ..Default::default()
        }
    }

    fn fam(
        programmed: bool,
        reason: Option<&str>,
        firewall: Option<&str>,
        evidence: Option<&str>,
    ) -> FamilyStatus {
        FamilyStatus {
            forwarding: programmed,
            programmed,
            reason: reason.map(String::from),
            firewall: firewall.map(String::from),
            evidence: evidence.map(String::from),
        }
    }

    /// Name, status, what `readiness` says.
    type ReadinessCase = (&'static str, Status, Result<Option<&'static str>, &'static str>);

    /// A family a host firewall drops for certain is not served, like one whose forwarding is
    /// off; packet evidence alone degrades readiness but keeps the family served.
    #[test]
    fn readiness_table() {
        let ok = fam(true, None, None, None);
        let off = fam(false, Some("net.ipv4.ip_forward is 0"), None, None);
        let dropped = fam(true, None, Some("table ip filter chain FORWARD drops"), None);
        let evidence = fam(true, None, None, Some("none left it"));
        #[rustfmt::skip]
        let cases: Vec<ReadinessCase> = vec![
            ("all served", status(&["ipv4"], &[("ipv4", ok.clone())]), Ok(None)),
            ("forwarding off, the only family", status(&["ipv4"], &[("ipv4", off.clone())]),
                Err("no address family the Services need can be served: net.ipv4.ip_forward is 0")),
            ("firewall, the only family", status(&["ipv4"], &[("ipv4", dropped.clone())]),
                Err("no address family the Services need can be served: table ip filter chain FORWARD drops")),
            ("firewall on one of two", status(&["ipv4", "ipv6"], &[("ipv4", dropped.clone()), ("ipv6", ok.clone())]),
                Ok(Some("degraded: table ip filter chain FORWARD drops"))),
            ("evidence only", status(&["ipv4"], &[("ipv4", evidence.clone())]), Ok(Some("degraded: none left it"))),
            ("firewall on a family nobody needs", status(&["ipv6"], &[("ipv4", dropped.clone()), ("ipv6", ok.clone())]), Ok(None)),
            ("both", status(&["ipv4", "ipv6"], &[("ipv4", off.clone()), ("ipv6", evidence.clone())]),
                Ok(Some("degraded: net.ipv4.ip_forward is 0; none left it"))),
        ];
        for (name, st, want) in cases {
            let got = st.readiness();
            let got = got.as_ref().map(|o| o.as_deref()).map_err(String::as_str);
            assert_eq!(got, want, "{name}");
        }
    }
}
