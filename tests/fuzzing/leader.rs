//! The leader's round on hostile objects (`k8s::round::plan_round`, pure): what it would
//! write must be something the API server accepts (condition reasons and message lengths, Event
//! notes), and the good Services get exactly the writes they get alone.

use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::{Node, Service};
use k8s_openapi::jiff::Timestamp;
use nodelb::core::decisions::desired::HostPolicy;
use nodelb::core::inputs::compact::EndpointSlice;
use nodelb::core::inputs::model::ModelOptions;
use nodelb::core::k8s::claims::{Holders, Registry, Token};
use nodelb::core::k8s::events::{MAX_NOTE_BYTES, event_note};
use nodelb::core::k8s::round::{ClaimInputs, ControllerConfig, RoundPlan, plan_round};
use nodelb::core::k8s::snapshot::KubeSnapshot;
use serde_json::{Value, json};

use super::world::{self, GOOD_NS};

/// metav1.Condition: `message` at most 32768 bytes, `reason` at most 1024 and CamelCase-ish.
const MAX_CONDITION_MESSAGE: usize = 32768;

fn config() -> ControllerConfig {
    ControllerConfig {
        identity: "controller-1".into(),
        namespace: "nodelb-system".into(),
        lease_duration: Duration::from_secs(15),
        node_addresses: vec![],
        port_range: world::range(),
        model: ModelOptions::default(),
        policy: HostPolicy::default(),
    }
}

pub fn good_nodes() -> Vec<Value> {
    (1..=2)
        .map(|i| {
            json!({
                "apiVersion": "v1", "kind": "Node",
                "metadata": {"name": format!("node-{i}")},
                "status": {"addresses": [{"type": "InternalIP", "address": format!("192.0.2.{i}")},
                                          {"type": "InternalIP", "address": format!("2001:db8:9::{i}")}]}
            })
        })
        .collect()
}

pub fn good_leases() -> Vec<Value> {
    (1..=2)
        .map(|i| {
            json!({
                "apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
                "metadata": {"name": format!("nodelb-node-node-{i}"), "namespace": "nodelb-system",
                             "annotations": {"nodelb.io/families": "ipv4,ipv6",
                                             "nodelb.io/listening-ports": ""}},
                "spec": {"holderIdentity": format!("node-{i}"), "leaseDurationSeconds": 15,
                         "renewTime": "2030-01-01T00:00:00.000000Z"}
            })
        })
        .collect()
}

fn arcs<T: serde::de::DeserializeOwned>(values: &[Value]) -> Vec<Arc<T>> {
    values.iter().filter_map(|v| serde_json::from_value(v.clone()).ok()).map(Arc::new).collect()
}

fn plan(services: &[Service], slices: &[EndpointSlice], nodes: &[Value], leases: &[Value]) -> RoundPlan {
    let snap = KubeSnapshot {
        services: services.iter().cloned().map(Arc::new).collect(),
        slices: slices.iter().cloned().map(Arc::new).collect(),
        nodes: arcs::<Node>(nodes),
        leases: arcs::<Lease>(leases),
        pools: Vec::new(),
        namespaces: Vec::new(),
        ..Default::default()
    };
    let now = Timestamp::from_second(1_800_000_000).expect("time");
    // A leader whose node-port registry is empty: every number it allocates can be claimed.
    let (registry, token) = (Registry::default(), Token::new("fuzz", 1, 0));
    let (gone, expired) = (Default::default(), Default::default());
    let claims = ClaimInputs {
        registry: Some(&registry),
        token: &token,
        gone: &gone,
        gone_claims: None,
        expired: &expired,
    };
    let mut holders = Holders::default();
    holders.pass(&snap.services, &snap.slices);
    plan_round(&snap, &config(), &mut Default::default(), &holders, None, now, &claims, false)
}

fn reason_ok(r: &str) -> bool {
    let b = r.as_bytes();
    !b.is_empty()
        && r.len() <= 1024
        && b[0].is_ascii_alphabetic()
        && b.iter().all(|c| c.is_ascii_alphanumeric() || matches!(c, b'_' | b',' | b':'))
        && !matches!(b[b.len() - 1], b',' | b':')
}

/// Everything in the plan is something the API server accepts.
fn assert_acceptable(p: &RoundPlan, what: &str) {
    for w in &p.writes {
        if let Some(Some(value)) = &w.annotation {
            assert!(
                value.len() <= nodelb::core::inputs::model::MAX_ANNOTATION_BYTES,
                "{what}: annotation of {} bytes",
                value.len()
            );
        }
        for c in w.status.iter().flat_map(|s| &s.conditions) {
            assert!(reason_ok(&c.reason), "{what}: condition reason {:?}", c.reason);
            assert!(
                c.message.len() <= MAX_CONDITION_MESSAGE,
                "{what}: condition message of {} bytes: {}",
                c.message.len(),
                world::head(&c.message)
            );
        }
        for i in w.status.iter().flat_map(|s| &s.ingress) {
            let ip = i.ip.as_deref().unwrap_or("");
            assert!(ip.parse::<std::net::IpAddr>().is_ok(), "{what}: ingress ip {ip:?}");
        }
    }
    for e in &p.events {
        assert!(e.reason.len() <= 128 && reason_ok(e.reason), "{what}: Event reason {:?}", e.reason);
        let note = event_note(&e.message);
        assert!(note.len() <= MAX_NOTE_BYTES, "{what}: Event note of {} bytes", note.len());
        assert!(
            e.message.starts_with(note.trim_end_matches('…')),
            "{what}: the note is not the message's start"
        );
    }
}

/// The leader's round with the hostile objects: acceptable writes, and the good Services'
/// writes and Events as when alone. With hostile Nodes and Leases too: acceptable writes.
pub fn check(
    good: (&[Service], &[EndpointSlice]),
    all: (&[Service], &[EndpointSlice]),
    hostile_nodes: &[Value],
    hostile_leases: &[Value],
) {
    let (nodes, leases) = (good_nodes(), good_leases());
    let alone = plan(good.0, good.1, &nodes, &leases);
    let with = plan(all.0, all.1, &nodes, &leases);
    assert_acceptable(&with, "leader");
    let is_good = |k: &nodelb::core::domain::ServiceKey| &*k.namespace == GOOD_NS;
    let good_writes =
        |p: &RoundPlan| p.writes.iter().filter(|w| is_good(&w.key)).cloned().collect::<Vec<_>>();
    assert_eq!(good_writes(&alone), good_writes(&with), "leader: the good Services' writes changed");
    // A hostile Service annotated with a good one's port is a duplicate: both get a
    // DuplicateNodePort Event, rightly; the good one keeps the port (writes above).
    let good_events = |p: &RoundPlan| {
        p.events
            .iter()
            .filter(|e| is_good(&e.service) && e.reason != "DuplicateNodePort")
            .cloned()
            .collect::<Vec<_>>()
    };
    assert_eq!(good_events(&alone), good_events(&with), "leader: the good Services' Events changed");
    if !hostile_nodes.is_empty() || !hostile_leases.is_empty() {
        let nodes: Vec<Value> = nodes.into_iter().chain(hostile_nodes.iter().cloned()).collect();
        let leases: Vec<Value> = leases.into_iter().chain(hostile_leases.iter().cloned()).collect();
        assert_acceptable(&plan(all.0, all.1, &nodes, &leases), "leader with hostile Nodes and Leases");
    }
}
