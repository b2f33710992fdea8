//! Where each Service is served, and why not, across the cluster: what each agent publishes about
//! its node on its node Lease ([`NodeReport`], annotation [`ANNOTATION_REPORT`]: bounded), and the
//! view `nodelb status --cluster` (and `kubectl nodelb`) assembles from the Services, the Nodes
//! and those Leases. Pure: the CLI lists the objects, the agent's Lease task writes the report.
//!
//! Why the node Lease: every agent already renews its own Lease a few times a minute (the write
//! carries the report at no extra request), the admission policy lets an agent write only its
//! own, and reading it needs `get`/`list` on Leases in nodelb's namespace only, no exec into a
//! pod and no route to the nodes. The report is bounded (refusals and problems capped, texts
//! shortened), so however many Services there are, a Lease holds no more than [`MAX_REFUSED`]
//! entries; and it only rides on the writes the Lease gets anyway (its renewals), so it adds none
//! of its own.

use std::borrow::Borrow;
use std::collections::{BTreeMap, BTreeSet};
use std::net::IpAddr;

use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::{Node, Service};
use serde::{Deserialize, Serialize};

use super::nodes::{ANNOTATION_ADDRESSES, NODE_LEASE_PREFIX};
use crate::reports::report::{ServiceState, ServiceStatus};

/// Node Lease annotation: the agent's [`NodeReport`] as JSON.
pub const ANNOTATION_REPORT: &str = "nodelb.io/node-report";
/// Most Services a report names as not served on its node (the rest are counted).
pub const MAX_REFUSED: usize = 50;
/// Most problems a report carries.
pub const MAX_PROBLEMS: usize = 10;
/// Longest text (a reason, a problem) a report carries, in bytes.
pub const MAX_TEXT: usize = 240;

/// What one agent says about its node.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct NodeReport {
    /// `nodelb --version` of the agent.
    pub version: String,
    /// Its readiness (`/readyz`).
    pub ready: bool,
    /// Why not ready, or how it is degraded.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub not_ready: Option<String>,
    /// Per family (`ipv4`, `ipv6`): forwarding on, served, and why not (a sysctl, a firewall).
    #[serde(default)]
    pub families: BTreeMap<String, FamilyReport>,
    /// The last sync: when (Unix seconds) and whether the kernel took it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_sync: Option<LastSync>,
    /// The node's problems (input, host firewall, hairpin), at most [`MAX_PROBLEMS`].
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub problems: Vec<String>,
    /// Services this node does not serve (or not every port of), with why; at most
    /// [`MAX_REFUSED`], `refused_total` counts them all.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub refused: Vec<Refused>,
    #[serde(default)]
    pub refused_total: usize,
}

#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct FamilyReport {
    pub forwarding: bool,
    pub served: bool,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub why: Option<String>,
}

#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct LastSync {
    pub at: u64,
    pub ok: bool,
}

/// A Service its node does not serve, or not wholly.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Refused {
    /// `namespace/name`.
    pub service: String,
    /// Machine-readable (`node_port_refused`, `not_selected`, `no_endpoints`, …).
    pub code: String,
    pub reason: String,
}

fn shorten(s: &str) -> String {
    if s.len() <= MAX_TEXT {
        return s.to_string();
    }
    let mut end = MAX_TEXT - 3;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}...", &s[..end])
}

impl NodeReport {
    /// The report within its bounds: refusals sorted and capped (the total kept), problems
    /// capped, every text shortened.
    pub fn bounded(mut self) -> NodeReport {
        self.refused.sort();
        self.refused_total = self.refused.len();
        self.refused.truncate(MAX_REFUSED);
        for r in &mut self.refused {
            r.reason = shorten(&r.reason);
        }
        self.problems.truncate(MAX_PROBLEMS);
        self.problems = self.problems.iter().map(|p| shorten(p)).collect();
        self.not_ready = self.not_ready.as_deref().map(shorten);
        for f in self.families.values_mut() {
            f.why = f.why.as_deref().map(shorten);
        }
        self
    }

    pub fn to_annotation(&self) -> String {
        serde_json::to_string(self).unwrap_or_default()
    }

    /// The report on `lease`: `None` without one, an error naming the problem when it does not
    /// parse (an older agent, a hand edit).
    pub fn of_lease(lease: &Lease) -> Option<Result<NodeReport, String>> {
        let value = lease.metadata.annotations.as_ref()?.get(ANNOTATION_REPORT)?;
        Some(serde_json::from_str(value).map_err(|e| format!("annotation {ANNOTATION_REPORT}: {e}")))
    }
}

/// What the node agents' reports say they refuse: per Service (`namespace/name`), each refusing
/// node with its reason (nodes in name order). The leader's `Serving` condition summarises it.
pub type Refusals = BTreeMap<String, Vec<(String, String)>>;

/// The reason codes of a node's refusal that last as long as their cause (a process on the port,
/// forwarding off, endpoints refused): what the `Serving` condition names. A Service without
/// endpoints yet, or one a node has not seen allocated yet, passes in a moment; naming it would
/// rewrite the condition twice for every new Service.
pub const LASTING: &[&str] = &["node_port_refused", "port_refused", "forwarding_off", "endpoints_refused"];

/// Reason codes (of a Service's node status, or of one of its ports) that say what the leader
/// decided, or that the node waits for its decision: the same on every node and on the Service's
/// `Allocated` condition already, so no node's own to report.
pub const LEADERS_CODES: &[&str] = &[
    "no_allocation",
    "port_conflict",
    "range_exhausted",
    "port_not_allowed",
    "port_in_use",
    "no_pool",
    "quota_exceeded",
    "not_recorded",
];

/// What a node refuses for causes of its own, from its Services' status (`/status`): each
/// Service it does not serve, or not wholly, with its reason, in the status' order.
pub fn refused_on_node<S: Borrow<ServiceStatus>>(services: &[S]) -> Vec<Refused> {
    let leaders = |code: Option<&str>| code.is_some_and(|c| LEADERS_CODES.contains(&c));
    let mut refused = Vec::new();
    for s in services.iter().map(Borrow::borrow) {
        let own: Vec<&str> = s
            .ports
            .iter()
            .filter(|p| !leaders(p.problem_code.as_deref()))
            .filter_map(|p| p.problem.as_deref())
            .collect();
        let (code, reason) = match s.state {
            ServiceState::Programmed if own.is_empty() => continue,
            ServiceState::Programmed => ("port_refused".to_string(), own.join("; ")),
            _ if leaders(s.reason_code.as_deref()) => continue,
            // The ports the node does not take for causes of its own, if any (the Service's
            // reason lists those that wait for the leader too).
            _ if s.reason_code.as_deref() == Some("node_port_refused") => {
                if own.is_empty() {
                    continue;
                }
                ("node_port_refused".to_string(), own.join("; "))
            }
            _ => (
                s.reason_code.clone().unwrap_or_else(|| format!("{:?}", s.state).to_lowercase()),
                s.reason.clone().unwrap_or_else(|| own.join("; ")),
            ),
        };
        refused.push(Refused { service: format!("{}/{}", s.namespace, s.name), code, reason });
    }
    refused
}

/// [`Refusals`] from the node Leases, the [`LASTING`] ones (a report that does not parse says
/// nothing).
pub fn refusals<L: Borrow<Lease>>(leases: &[L]) -> Refusals {
    let mut out = Refusals::new();
    let mut by_node: Vec<(&str, NodeReport)> = leases
        .iter()
        .map(Borrow::borrow)
        .filter_map(|l| {
            let node = l.metadata.name.as_deref()?.strip_prefix(NODE_LEASE_PREFIX)?;
            Some((node, NodeReport::of_lease(l)?.ok()?))
        })
        .collect();
    by_node.sort_by(|a, b| a.0.cmp(b.0));
    for (node, report) in by_node {
        for r in report.refused.into_iter().filter(|r| LASTING.contains(&r.code.as_str())) {
            out.entry(r.service).or_default().push((node.to_string(), r.reason));
        }
    }
    out
}

/// What the view is restricted to (`None`: everything).
#[derive(Debug, Clone, Default)]
pub struct Filter {
    pub namespace: Option<String>,
    pub service: Option<String>,
    pub node: Option<String>,
}

/// One Service: its ports, the nodes that serve it, and why the others do not.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ServiceRow {
    pub namespace: String,
    pub name: String,
    /// `nodelb.io/allocated-ports` as written (`80/TCP=20001`); empty: none.
    pub ports: String,
    /// Its `nodelb.io/Allocated` condition when not `True`: why it has no (or not every) port.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub not_allocated: Option<String>,
    pub served_on: Vec<String>,
    /// Node → why it does not serve the Service.
    pub not_served: BTreeMap<String, String>,
}

/// One node: whether it runs an agent and what that agent says.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct NodeRow {
    pub name: String,
    /// Its agent's Lease is renewed (within its duration).
    pub agent: bool,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub report: Option<NodeReport>,
    /// Why the report cannot be read.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub report_problem: Option<String>,
}

/// The `--json` form (its schema: these types, read back with unknown fields refused).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ClusterView {
    pub services: Vec<ServiceRow>,
    pub nodes: Vec<NodeRow>,
}

/// The view of `services` (nodelb's are those with an allocation annotation or an `Allocated`
/// condition), `nodes` and the node `leases`, at `now`, within `filter`.
pub fn assemble<S: Borrow<Service>, N: Borrow<Node>, L: Borrow<Lease>>(
    services: &[S],
    nodes: &[N],
    leases: &[L],
    now: k8s_openapi::jiff::Timestamp,
    filter: &Filter,
) -> ClusterView {
    let leases: BTreeMap<&str, &Lease> = leases
        .iter()
        .map(Borrow::borrow)
        .filter_map(|l| Some((l.metadata.name.as_deref()?.strip_prefix(NODE_LEASE_PREFIX)?, l)))
        .collect();
    // Which node an ingress address belongs to: its Node object's addresses and those its agent
    // publishes.
    let mut owner: BTreeMap<IpAddr, String> = BTreeMap::new();
    let mut rows: Vec<NodeRow> = Vec::new();
    for node in nodes.iter().map(Borrow::borrow) {
        let Some(name) = node.metadata.name.clone() else { continue };
        for a in node.status.iter().flat_map(|s| s.addresses.iter().flatten()) {
            if let Ok(ip) = a.address.parse() {
                owner.insert(ip, name.clone());
            }
        }
        let lease = leases.get(name.as_str());
        let published = lease.and_then(|l| l.metadata.annotations.as_ref()?.get(ANNOTATION_ADDRESSES));
        for ip in published.into_iter().flat_map(|v| v.split(',')).filter_map(|a| a.trim().parse().ok()) {
            owner.entry(ip).or_insert_with(|| name.clone());
        }
        let (report, report_problem) = match lease.and_then(|l| NodeReport::of_lease(l)) {
            Some(Ok(r)) => (Some(r), None),
            Some(Err(e)) => (None, Some(e)),
            None => (None, None),
        };
        let agent = lease.is_some_and(|l| super::nodes::lease_fresh(l, Some(now)) == Some(true));
        rows.push(NodeRow { agent, name, report, report_problem });
    }
    rows.sort_by(|a, b| a.name.cmp(&b.name));
    let refused: BTreeMap<(&str, &str), &Refused> = rows
        .iter()
        .filter_map(|n| Some((n.name.as_str(), n.report.as_ref()?)))
        .flat_map(|(n, r)| r.refused.iter().map(move |x| ((n, x.service.as_str()), x)))
        .collect();

    let mut out = Vec::new();
    for svc in services.iter().map(Borrow::borrow) {
        let (Some(ns), Some(name)) = (svc.metadata.namespace.as_deref(), svc.metadata.name.as_deref()) else {
            continue;
        };
        if filter.namespace.as_deref().is_some_and(|f| f != ns)
            || filter.service.as_deref().is_some_and(|f| f != name)
        {
            continue;
        }
        let ports = crate::inputs::model::allocated_annotation(svc).cloned();
        let conditions = svc.status.as_ref().and_then(|s| s.conditions.as_ref());
        let allocated = conditions
            .and_then(|cs| cs.iter().find(|c| c.type_ == crate::inputs::model::CONDITION_ALLOCATED));
        if ports.is_none() && allocated.is_none() {
            continue;
        }
        let ingress =
            svc.status.as_ref().and_then(|s| s.load_balancer.as_ref()).and_then(|l| l.ingress.as_ref());
        let key = format!("{ns}/{name}");
        // Listed in the ingress and not refused by the node itself: a node whose agent refuses
        // the Service's port (a process listens on it there) stays listed for its other ports.
        let served: BTreeSet<String> = ingress
            .into_iter()
            .flatten()
            .filter_map(|i| owner.get(&i.ip.as_deref()?.parse().ok()?).cloned())
            .filter(|n| !refused.contains_key(&(n.as_str(), key.as_str())))
            .collect();
        let mut not_served = BTreeMap::new();
        for node in &rows {
            if served.contains(&node.name) {
                continue;
            }
            let why = if !node.agent {
                "no agent: its node Lease is not renewed".to_string()
            } else if let Some(r) = refused.get(&(node.name.as_str(), key.as_str())) {
                format!("{} ({})", r.reason, r.code)
            } else if let Some(report) = node.report.as_ref().filter(|r| !r.ready) {
                format!("agent not ready: {}", report.not_ready.as_deref().unwrap_or("no reason given"))
            } else if node.report.as_ref().is_some_and(|r| r.refused_total > r.refused.len()) {
                "refused there, among the refusals its report leaves out (`nodelb status` on the node lists them)"
                    .to_string()
            } else {
                "not in status.loadBalancer.ingress (not allocated, or the leader has not listed it yet)"
                    .to_string()
            };
            not_served.insert(node.name.clone(), why);
        }
        out.push(ServiceRow {
            namespace: ns.to_string(),
            name: name.to_string(),
            ports: ports.unwrap_or_default(),
            not_allocated: allocated
                .filter(|c| c.status != "True")
                .map(|c| format!("{}: {}", c.reason, c.message)),
            served_on: served.into_iter().collect(),
            not_served,
        });
    }
    out.sort_by(|a, b| (&a.namespace, &a.name).cmp(&(&b.namespace, &b.name)));
    if let Some(node) = &filter.node {
        rows.retain(|n| &n.name == node);
        for s in &mut out {
            s.served_on.retain(|n| n == node);
            s.not_served.retain(|n, _| n == node);
        }
    }
    ClusterView { services: out, nodes: rows }
}

/// The view as a person reads it at `now` (Unix seconds): one block per Service (its ports, where
/// it is served, each other node with why), then one line per node.
pub fn render(view: &ClusterView, now: u64) -> String {
    use std::fmt::Write;
    let mut s = String::new();
    for svc in &view.services {
        let total = svc.served_on.len() + svc.not_served.len();
        let ports = if svc.ports.is_empty() { "none" } else { svc.ports.as_str() };
        let _ = writeln!(
            s,
            "{}/{}  ports {ports}  served on {} of {total} nodes{}",
            svc.namespace,
            svc.name,
            svc.served_on.len(),
            match svc.served_on.is_empty() {
                true => String::new(),
                false => format!(": {}", svc.served_on.join(", ")),
            }
        );
        if let Some(why) = &svc.not_allocated {
            let _ = writeln!(s, "  not allocated: {why}");
        }
        for (node, why) in &svc.not_served {
            let _ = writeln!(s, "  {node}: {why}");
        }
    }
    let _ = writeln!(
        s,
        "\n{:<16} {:<28} {:<6} {:<20} {:<14} PROBLEMS",
        "NODE", "VERSION", "READY", "FORWARDING", "LAST SYNC"
    );
    for n in &view.nodes {
        let Some(r) = &n.report else {
            let why = match (&n.report_problem, n.agent) {
                (Some(p), _) => p.clone(),
                (None, true) => "its agent publishes no report (an older version?)".to_string(),
                (None, false) => "no agent".to_string(),
            };
            let _ = writeln!(s, "{:<16} {why}", n.name);
            continue;
        };
        let fams: Vec<String> = r
            .families
            .iter()
            .map(|(f, x)| {
                format!(
                    "{f} {}",
                    if !x.forwarding {
                        "off"
                    } else if x.served {
                        "on"
                    } else {
                        "dropped"
                    }
                )
            })
            .collect();
        let sync = match &r.last_sync {
            Some(l) => format!("{}s ago {}", now.saturating_sub(l.at), if l.ok { "ok" } else { "FAILED" }),
            None => "none".to_string(),
        };
        let mut problems: Vec<String> = r.not_ready.iter().cloned().collect();
        problems.extend(r.problems.iter().cloned());
        let ready = if !n.agent {
            "gone"
        } else if r.ready {
            "yes"
        } else {
            "no"
        };
        let _ = writeln!(
            s,
            "{:<16} {:<28} {:<6} {:<20} {:<14} {}",
            n.name,
            r.version,
            ready,
            fams.join(", "),
            sync,
            if problems.is_empty() { "-".to_string() } else { problems.join("; ") }
        );
    }
    s
}

#[cfg(test)]
mod tests;
