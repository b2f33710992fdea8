//! A node agent's own Lease `nodelb-node-<node>`, renewed every `lease/3` with what the
//! controller needs from this node ([`crate::core::k8s::nodes`]: the families served, the ports processes
//! listen on, the pools' addresses, the node's addresses), and a Warning Event on its Node when
//! forwarding is off (or dropped) for a family the Services need, retried every renewal until
//! the API accepted it. This Lease and these Events are all a node agent writes; the shipped
//! admission policy refuses it anything else.

use std::collections::BTreeMap;
use std::time::Duration;

use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::api::core::v1::{Node, ObjectReference};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta};
use k8s_openapi::jiff::Timestamp;
use kube::runtime::events::{Recorder, Reporter};
use kube::{Api, Client};
use tracing::{debug, info};

use super::metrics::KubeMetrics;
use crate::core::domain::{Family, Scope};
use crate::serve::status::SharedStatus;

use super::api::{CONTROLLER_NAME, Failing, is_conflict, post_params, publish_event};
use super::source::KubeSource;
use crate::core::k8s::cluster_view::{self, FamilyReport, LastSync, NodeReport};
use crate::core::k8s::events::Deduper;
use crate::core::k8s::nodes::{self, ANNOTATION_FAMILIES, LABEL_NODE_LEASE};

/// Which node, where, renewed how often.
#[derive(Debug, Clone)]
pub struct NodeLeaseConfig {
    pub node_name: String,
    /// nodelb's namespace, where the Lease lives.
    pub namespace: String,
    pub lease_duration: Duration,
}

/// Starts the node-Lease task for the life of the runtime; it never fails (every error is
/// logged, counted and retried).
pub fn spawn(
    client: Client,
    cfg: NodeLeaseConfig,
    status: SharedStatus,
    source: KubeSource,
    metrics: KubeMetrics,
) {
    let recorder = Recorder::new(
        client.clone(),
        Reporter { controller: CONTROLLER_NAME.into(), instance: Some(cfg.node_name.clone()) },
    );
    tokio::spawn(node_lease(client, cfg, status, source, recorder, metrics));
}

/// How often the node-Lease task checks whether the served families changed.
const FAMILIES_POLL: Duration = Duration::from_millis(250);

/// Families this node serves right now (none unless ready; else those programmed and not
/// dropped by a host firewall), and the Warning Events its Node should carry for families some
/// Service needs: `ForwardingDisabled` (forwarding off) and `ForwardedTrafficDropped` (a host
/// firewall drops them, or the forward counters say so), with why. A family nobody needs is not
/// worth a Warning Event on the Node: an IPv6-off node in an IPv4-only cluster would get one at
/// every restart; the agent's log still says it (once per change), and the Event follows as
/// soon as a Service needs the family. Before the first sync nothing is known to be needed, so
/// nothing is reported.
fn served_families(
    status: &SharedStatus,
) -> (std::collections::BTreeSet<Family>, Vec<(Family, &'static str, String)>) {
    let st = crate::locks::read(status);
    let mut events = Vec::new();
    for f in Family::ALL {
        let Some(fs) = st.families.get(f.name()) else { continue };
        if !st.needed_families.iter().any(|n| n == f.name()) {
            continue;
        }
        if !fs.forwarding {
            let why = fs.reason.clone().unwrap_or_else(|| format!("forwarding is off for {f}"));
            events.push((f, "ForwardingDisabled", why));
        } else if let Some(why) = fs.firewall.clone().or_else(|| fs.evidence.clone()) {
            events.push((f, "ForwardedTrafficDropped", why));
        }
    }
    if st.readiness().is_err() {
        return (Default::default(), events);
    }
    let served =
        Family::ALL.into_iter().filter(|f| st.families.get(f.name()).is_some_and(|fs| fs.served())).collect();
    (served, events)
}

/// What a node Lease publishes besides its renewal that the leader needs at once: the families
/// served, the listening ports, the pools' addresses, this node's addresses (`None`: not read
/// yet). A change is written at once; the node's report ([`report_of`]) is not among them: it
/// goes out with every write and never on its own, so a node whose Services come and go adds no
/// Lease write for it (and it is built once per write, not at every poll).
#[derive(Debug, Clone, PartialEq, Eq)]
struct LeaseAnnotations {
    families: String,
    listening: Option<String>,
    pool_addresses: Option<String>,
    addresses: Option<String>,
}

impl LeaseAnnotations {
    fn of(families: &std::collections::BTreeSet<Family>, status: &SharedStatus) -> LeaseAnnotations {
        let st = crate::locks::read(status);
        LeaseAnnotations {
            families: nodes::format_families(families),
            listening: st.listening_ports.clone(),
            pool_addresses: st.pool_addresses.clone(),
            addresses: st.node_addresses.clone(),
        }
    }
}

/// What this agent says about its node for `nodelb status --cluster`, from its `/status`.
fn report_of(st: &crate::serve::status::Status) -> NodeReport {
    let (ready, not_ready) = match st.readiness() {
        Ok(note) => (true, note),
        Err(why) => (false, Some(why)),
    };
    let families = st
        .families
        .iter()
        .map(|(f, s)| {
            let why = s.firewall.clone().or_else(|| s.reason.clone()).or_else(|| s.evidence.clone());
            (f.clone(), FamilyReport { forwarding: s.forwarding, served: s.served(), why })
        })
        .collect();
    let mut problems = st.problems.clone();
    problems.extend(st.host_firewall.problems.iter().cloned());
    problems.extend(st.hairpin.iter().map(|h| h.message.clone()));
    NodeReport {
        version: crate::VERSION.to_string(),
        ready,
        not_ready,
        families,
        last_sync: st.last_sync.as_ref().map(|s| LastSync { at: s.at, ok: s.ok }),
        problems,
        refused: st.refused.clone(),
        refused_total: 0,
    }
    .bounded()
}

async fn node_lease(
    client: Client,
    cfg: NodeLeaseConfig,
    status: SharedStatus,
    source: KubeSource,
    recorder: Recorder,
    metrics: KubeMetrics,
) {
    let api: Api<Lease> = Api::namespaced(client, &cfg.namespace);
    let name = nodes::node_lease_name(&cfg.node_name);
    let period = (cfg.lease_duration / 3).max(Duration::from_millis(500));
    let secs = cfg.lease_duration.as_secs().max(1) as i32;
    let mut node_events: Deduper<String> = Deduper::default();
    let mut failing =
        Failing::new("cannot renew the node Lease", metrics.api_errors.with_label_values(&["node_lease"]));
    let mut tick = tokio::time::interval(period);
    let mut last_families = None;
    // Families as last written: a change (ready at start, forwarding switched off, sync failing)
    // is written at once, not at the next renewal, so the leader's status follows within a second.
    let mut written: Option<LeaseAnnotations> = None;
    loop {
        tokio::select! {
            _ = tick.tick() => {}
            _ = tokio::time::sleep(FAMILIES_POLL) => {
                let (families, _) = served_families(&status);
                let now = LeaseAnnotations::of(&families, &status);
                if failing.since.is_some() || written.as_ref() == Some(&now) {
                    continue;
                }
            }
        }
        let (families, off) = served_families(&status);
        let now = LeaseAnnotations::of(&families, &status);
        let LeaseAnnotations { families: value, listening: ports, pool_addresses: selected, addresses } =
            now.clone();
        let report = report_of(&crate::locks::read(&status));
        if last_families.as_ref() != Some(&value) {
            info!(lease = %name, families = %value, "node Lease: serving families");
            last_families = Some(value.clone());
        }
        let mut annotations = BTreeMap::from([
            (ANNOTATION_FAMILIES.to_string(), value.clone()),
            (cluster_view::ANNOTATION_REPORT.to_string(), report.to_annotation()),
            (nodes::ANNOTATION_REGISTRY_FORMAT.to_string(), nodes::REGISTRY_FORMAT.to_string()),
        ]);
        // Not read yet: what the Lease says stays (an agent restarting keeps the listeners its
        // predecessor published; a new Lease has none, and the leader waits for them).
        if let Some(p) = &ports {
            annotations.insert(nodes::ANNOTATION_LISTENING.to_string(), p.clone());
        }
        if let Some(v) = &selected {
            annotations.insert(nodes::ANNOTATION_POOL_ADDRESSES.to_string(), v.clone());
        }
        if let Some(v) = &addresses {
            annotations.insert(nodes::ANNOTATION_ADDRESSES.to_string(), v.clone());
        }
        let stamp = Some(MicroTime(Timestamp::now()));
        let result = match api.get_opt(&name).await {
            Ok(None) => {
                let lease = Lease {
                    metadata: ObjectMeta {
                        name: Some(name.clone()),
                        labels: Some([(LABEL_NODE_LEASE.to_string(), "true".to_string())].into()),
                        annotations: Some(std::mem::take(&mut annotations)),
                        ..Default::default()
                    },
                    spec: Some(LeaseSpec {
                        holder_identity: Some(cfg.node_name.clone()),
                        lease_duration_seconds: Some(secs),
                        acquire_time: stamp.clone(),
                        renew_time: stamp,
                        ..Default::default()
                    }),
                };
                api.create(&post_params(), &lease).await.map(|_| ())
            }
            Ok(Some(mut lease)) => {
                let existing = lease.metadata.annotations.get_or_insert_default();
                // Not published (yet, or too long): the leader must not read an old selection.
                existing.remove(nodes::ANNOTATION_POOL_ADDRESSES);
                existing.append(&mut annotations);
                lease
                    .metadata
                    .labels
                    .get_or_insert_default()
                    .insert(LABEL_NODE_LEASE.to_string(), "true".into());
                let spec = lease.spec.get_or_insert_default();
                spec.holder_identity = Some(cfg.node_name.clone());
                spec.lease_duration_seconds = Some(secs);
                spec.renew_time = stamp;
                api.replace(&name, &post_params(), &lease).await.map(|_| ())
            }
            Err(e) => Err(e),
        };
        match result {
            Ok(()) => {
                failing.ok();
                written = Some(now);
            }
            Err(e) if is_conflict(&e) => {
                debug!(lease = %name, "node Lease changed under us (409); next tick")
            }
            Err(e) => failing.failed(&e),
        }
        // Forwarding off, or forwarded traffic dropped, for a needed family: a Warning Event on
        // our Node, once per change. Not recorded as sent until the API accepted it: while our
        // Node is not in the cache yet, or the Event cannot be written, it is tried again at
        // every renewal.
        let events: Vec<(String, &'static str, String)> =
            off.iter().map(|(f, reason, why)| (f.name().to_string(), *reason, why.clone())).collect();
        let key = |(f, reason, why): &(String, &'static str, String)| (f.clone(), *reason, why.clone());
        let pending = node_events.pending(&events, |(f, reason, why)| (f, *reason, why.as_str()), Scope::All);
        if pending.is_empty() {
            continue;
        }
        let Some(node) = source.node(&cfg.node_name) else {
            debug!(node = %cfg.node_name, "our Node is not in the cache yet; Node Events deferred");
            continue;
        };
        let reference = node_ref(&node);
        for e in pending {
            if publish_event(&recorder, &metrics.api_errors, &reference, true, e.1, &e.2).await {
                node_events.sent(key(e));
            }
        }
    }
}

fn node_ref(node: &Node) -> ObjectReference {
    ObjectReference {
        api_version: Some("v1".into()),
        kind: Some("Node".into()),
        name: node.metadata.name.clone(),
        uid: node.metadata.uid.clone(),
        ..Default::default()
    }
}
