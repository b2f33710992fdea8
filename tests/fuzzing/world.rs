//! The good objects every hostile input is mixed with: three valid Services (TCP, UDP with a
//! source range, dual-stack Local) with their EndpointSlices and allocations. Whatever the
//! hostile objects are, these must still be planned exactly as when they are alone.

use std::collections::{BTreeMap, BTreeSet};

use k8s_openapi::api::core::v1::Service;
use k8s_openapi::jiff::Timestamp;
use nodelb::core::decisions::alloc::Allocations;
use nodelb::core::decisions::desired::{
    self, AllocationMode, Desired, HostFacts, HostPolicy, Inputs, SourceNotes,
};
use nodelb::core::decisions::port_policy::PortRange;
use nodelb::core::domain::{Family, PortId, ServiceKey};
use nodelb::core::inputs::compact::EndpointSlice;
use nodelb::core::inputs::model::ModelOptions;
use nodelb::core::reports::report::ServiceState;
use nodelb::core::ruleset::plan::NodeFacts;
use serde_json::{Value, json};

/// Namespace of the good objects; hostile objects are kept out of it (see [`keep_out`]), so any
/// difference in how the good ones are planned is the hostile input's doing.
pub const GOOD_NS: &str = "good";

pub struct World {
    pub services: Vec<Value>,
    pub slices: Vec<Value>,
    /// What the node ports of the good Services are (manifests mode: the state file; Kubernetes
    /// mode: their annotation).
    pub allocations: Allocations,
}

fn service(name: &str, ports: Value, extra: Value, allocated: &str) -> Value {
    let mut v = json!({
        "apiVersion": "v1", "kind": "Service",
        "metadata": {
            "name": name, "namespace": GOOD_NS, "uid": format!("uid-{name}"), "resourceVersion": "1",
            "creationTimestamp": "2020-01-01T00:00:00Z",
            "annotations": {"nodelb.io/allocated-ports": allocated}
        },
        "spec": {"type": "LoadBalancer", "ports": ports}
    });
    if let (Some(spec), Some(extra)) = (v["spec"].as_object_mut(), extra.as_object()) {
        spec.extend(extra.clone());
    }
    v
}

fn slice(name: &str, service: &str, family: &str, addrs: &[&str], port: Value) -> Value {
    let endpoints: Vec<Value> = addrs
        .iter()
        .map(|a| json!({"addresses": [a], "nodeName": "node-1", "conditions": {"ready": true}}))
        .collect();
    json!({
        "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
        "metadata": {"name": name, "namespace": GOOD_NS, "labels": {"kubernetes.io/service-name": service}},
        "addressType": family, "endpoints": endpoints, "ports": [port]
    })
}

impl World {
    pub fn new() -> World {
        let services = vec![
            service("web", json!([{"port": 80, "protocol": "TCP"}]), json!({}), "80/TCP=20001"),
            service(
                "dns",
                json!([{"name": "dns", "port": 53, "protocol": "UDP"}]),
                json!({"loadBalancerSourceRanges": ["203.0.113.0/24"]}),
                "53/UDP=20002",
            ),
            service(
                "dual",
                json!([{"name": "https", "port": 443}]),
                json!({"ipFamilies": ["IPv4", "IPv6"], "externalTrafficPolicy": "Local"}),
                "443/TCP=20003",
            ),
        ];
        let slices = vec![
            slice("web-1", "web", "IPv4", &["198.51.100.11", "198.51.100.12"], json!({"port": 8080})),
            slice(
                "dns-1",
                "dns",
                "IPv4",
                &["198.51.100.13"],
                json!({"name": "dns", "port": 5353, "protocol": "UDP"}),
            ),
            slice("dual-4", "dual", "IPv4", &["198.51.100.14"], json!({"name": "https", "port": 8443})),
            slice("dual-6", "dual", "IPv6", &["2001:db8:2::14"], json!({"name": "https", "port": 8443})),
        ];
        let key = |n: &str| ServiceKey::new(GOOD_NS, n);
        let allocations = [
            (key("web"), PortId::tcp(80), 20001),
            (key("dns"), PortId::udp(53), 20002),
            (key("dual"), PortId::tcp(443), 20003),
        ]
        .into_iter()
        .map(|(k, id, n)| (k, BTreeMap::from([(id, n)])))
        .collect();
        World { services, slices, allocations }
    }

    pub fn typed(&self) -> (Vec<Service>, Vec<EndpointSlice>) {
        let s =
            self.services.iter().map(|v| serde_json::from_value(v.clone()).expect("good Service")).collect();
        let e = self.slices.iter().map(|v| serde_json::from_value(v.clone()).expect("good slice")).collect();
        (s, e)
    }

    pub fn keys(&self) -> BTreeSet<ServiceKey> {
        self.allocations.keys().cloned().collect()
    }
}

/// Moves a hostile object out of the good namespace (a hostile Service of the same name would
/// legitimately be a duplicate, and a hostile slice naming a good Service would legitimately add
/// endpoints to it).
pub fn keep_out(v: &mut Value) {
    if let Some(meta) = v.get_mut("metadata").and_then(Value::as_object_mut)
        && meta.get("namespace").and_then(Value::as_str) == Some(GOOD_NS)
    {
        meta.insert("namespace".into(), json!("hostile"));
    }
}

pub fn node() -> NodeFacts {
    NodeFacts {
        node_name: "node-1".into(),
        families: BTreeSet::from([Family::Ipv4, Family::Ipv6]),
        masquerade_mark: 0x4000,
        connection_mark: nodelb::core::ruleset::plan::DEFAULT_CONNECTION_MARK,
        forward_mark: None,
        nat_shards: 1,
    }
}

pub fn range() -> PortRange {
    PortRange::new(20000, 29999).expect("range")
}

/// `desired::compute` as the agent runs it in either mode, with the good allocations as the
/// state file (manifests) — in Kubernetes mode they are on the objects themselves.
pub fn compute(
    mode: AllocationMode,
    services: &[Service],
    slices: &[EndpointSlice],
    notes: &SourceNotes,
    previous: &Allocations,
) -> Desired {
    // Manifests mode: the state file says since when the good Services hold their ports.
    let since: BTreeMap<ServiceKey, Timestamp> = match mode {
        AllocationMode::Allocate => previous.keys().map(|k| (k.clone(), Timestamp::UNIX_EPOCH)).collect(),
        AllocationMode::Annotated => BTreeMap::new(),
    };
    let range = range();
    let model = ModelOptions::default();
    let node = node();
    let policy = HostPolicy::default();
    let host = HostFacts::default();
    let inputs = Inputs {
        mode,
        services,
        slices,
        notes,
        previous,
        since: &since,
        range: &range,
        model: &model,
        node: &node,
        policy: &policy,
        host: &host,
        pools: None,
        registry: None,
    };
    desired::compute_whole(&inputs, true)
}

/// The good Services are planned exactly as when alone: programmed, on their node ports, with the
/// same chains in the ruleset.
pub fn assert_good_served(world: &World, alone: &Desired, with: &Desired, what: &str) {
    for key in world.keys() {
        let find = |d: &Desired| {
            d.services.iter().find(|s| s.namespace == key.namespace && s.name == key.name).cloned()
        };
        let (a, w) = (find(alone), find(with));
        let a = a.unwrap_or_else(|| panic!("{what}: {key} missing when alone"));
        assert_eq!(a.state, ServiceState::Programmed, "{what}: {key} alone: {a:?}");
        assert_eq!(Some(&a), w.as_ref(), "{what}: {key} is planned differently next to hostile input");
        assert_eq!(alone.allocations.get(&key), with.allocations.get(&key), "{what}: {key} allocation");
    }
    for (name, chain) in &alone.ruleset.chains {
        if name.contains(&format!("-{GOOD_NS}/")) {
            assert_eq!(with.ruleset.chains.get(name), Some(chain), "{what}: chain {name} differs");
        }
    }
}

/// What nodelb writes about one input problem must name it and stay short enough for every place
/// it goes: a status line, a log line, a condition message (the API server allows 32 KiB), an
/// Event note (1 KiB, cut there by the controller).
pub const MAX_MESSAGE: usize = 4096;

pub fn assert_messages_bounded(d: &Desired, what: &str) {
    for r in &d.refusals {
        let msg = r.to_string();
        assert!(msg.len() <= MAX_MESSAGE, "{what}: refusal message of {} bytes: {}", msg.len(), head(&msg));
        assert!(msg.contains(&r.service().to_string()), "{what}: refusal does not name its Service: {msg}");
    }
    for s in &d.services {
        if let Some(reason) = &s.reason {
            assert!(
                reason.len() <= 2 * MAX_MESSAGE,
                "{what}: status reason of {} bytes: {}",
                reason.len(),
                head(reason)
            );
        }
    }
    for w in &d.warnings {
        assert!(w.len() <= MAX_MESSAGE, "{what}: warning of {} bytes: {}", w.len(), head(w));
    }
}

pub fn head(s: &str) -> String {
    s.chars().take(300).collect()
}

/// The planned ruleset is one the kernel accepts as far as nodelb can tell without it: it
/// encodes (names and comments within nftables' limits) and a diff from the good ruleset replays
/// to exactly it.
pub fn assert_ruleset_sound(base: &nodelb::core::ruleset::ir::Ruleset, d: &Desired, what: &str) {
    if let Err(e) = nodelb::encode::nft::encode::encode_refs(d.ruleset.full_replace_refs(), 1) {
        panic!("{what}: the planned ruleset does not encode: {e}");
    }
    let changes = nodelb::core::ruleset::plan::diff(base, &d.ruleset);
    match nodelb_oracles::simulate::simulate(base, &changes) {
        Ok(after) => {
            assert!(after == d.ruleset, "{what}: diff from the good ruleset does not replay to the plan")
        }
        Err(e) => panic!("{what}: diff from the good ruleset is not applicable: {e}"),
    }
}
