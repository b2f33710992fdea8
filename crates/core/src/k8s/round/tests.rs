use serde_json::json;

use crate::inputs::model::ANNOTATION_ALLOCATED;

use super::*;

/// A round is skipped only after a clean, recent round, for the very versions its writes
/// made and for Lease renewals that change nothing the round reads.
#[test]
fn a_round_is_skipped_only_when_it_would_plan_nothing() {
    let web = ServiceKey::new("default", "web");
    let db = ServiceKey::new("default", "db");
    let internal = ServiceKey::new("default", "internal");
    let view = |nodes: &[&str]| LeaseView {
        serving: nodes
            .iter()
            .map(|n| {
                let node = nodes::ServingNode {
                    name: n.to_string(),
                    families: [crate::domain::Family::Ipv4].into(),
                    addresses: vec!["192.0.2.1".parse().unwrap()],
                };
                (n.to_string(), node)
            })
            .collect(),
        listening: BTreeMap::new(),
        unreported: Vec::new(),
        published: BTreeMap::new(),
        refusals: BTreeMap::new(),
        unshared: vec![],
    };
    let t0 = Instant::now();
    let mut state = LeaderState::new(claims::Token::new("node-a", 1, 0));
    state.echoes = [(web.clone(), vec!["11".to_string(), "12".to_string()])].into();
    state.lease_view = Some(view(&["a", "b"]));
    state.last_whole_round = Some(t0);
    let changes = |services: &[(&ServiceKey, Option<&str>)], others: &[&'static str]| Journal {
        services: services.iter().map(|(k, rv)| ((*k).clone(), rv.map(String::from))).collect(),
        others: others.iter().copied().collect(),
        truncated: false,
    };
    let (soon, late) = (t0 + Duration::from_secs(2), t0 + FULL_ROUND_EVERY);
    let echo = || changes(&[(&web, Some("11")), (&web, Some("12"))], &[]);
    let last = || changes(&[(&web, Some("12"))], &[]);
    const AB: &[&str] = &["a", "b"];
    // (name, last round clean, changes, the serving nodes now, now, skip)
    type Case = (&'static str, bool, Journal, &'static [&'static str], Instant, bool);
    let cases: Vec<Case> = vec![
        ("both writes came back", true, echo(), AB, soon, true),
        ("the last write came back", true, last(), AB, soon, true),
        ("a timer wake, nothing changed", true, changes(&[], &[]), AB, soon, true),
        ("a renewal that changes nothing read", true, changes(&[], &["Lease"]), AB, soon, true),
        ("a node's Lease expired", true, changes(&[], &[]), &["a"], soon, false),
        ("the last round failed something", false, echo(), AB, soon, false),
        ("the last whole round is too old", true, echo(), AB, late, false),
        ("someone else wrote it after us", true, changes(&[(&web, Some("13"))], &[]), AB, soon, false),
        ("another Service changed", true, changes(&[(&db, Some("5"))], &[]), AB, soon, false),
        ("an EndpointSlice changed", true, changes(&[], &["EndpointSlice"]), AB, soon, false),
        ("a Service deleted or relisted", true, changes(&[], &["Service"]), AB, soon, false),
        ("no resourceVersion", true, changes(&[(&web, None)], &[]), AB, soon, false),
    ];
    for (name, clean, journal, serving, now, want) in cases {
        state.clean = clean;
        assert_eq!(state.nothing_to_do(&journal, &view(serving), now), want, "{name}");
    }
    // A node's agent reported its listeners, none (so `listening` is the same).
    let waiting = LeaseView { unreported: vec!["b".to_string()], ..view(AB) };
    state.clean = true;
    state.lease_view = Some(waiting);
    assert!(!state.nothing_to_do(&changes(&[], &["Lease"]), &view(AB), soon), "listeners reported");

    // Which rounds may wait for the next change: those that give no Service a number.
    state.lease_view = Some(view(AB));
    // (name, last round clean, changes, the serving nodes now, may wait)
    type Wait = (&'static str, bool, Journal, &'static [&'static str], bool);
    let cases: Vec<Wait> = vec![
        ("a Service deleted (and its slices)", true, changes(&[], &["Service", "EndpointSlice"]), AB, true),
        ("endpoints changed", true, changes(&[], &["EndpointSlice"]), AB, true),
        ("with a renewal that changes nothing read", true, changes(&[], &["Service", "Lease"]), AB, true),
        ("with our writes coming back", true, changes(&[(&web, Some("12"))], &["Service"]), AB, true),
        ("with someone else's write", true, changes(&[(&web, Some("13"))], &["Service"]), AB, false),
        ("a Service created or changed", true, changes(&[(&db, Some("5"))], &["EndpointSlice"]), AB, false),
        (
            "a Service that is not nodelb's changed",
            true,
            changes(&[(&internal, Some("7")), (&web, Some("12"))], &["EndpointSlice"]),
            AB,
            true,
        ),
        (
            "one that is not, one that is",
            true,
            changes(&[(&internal, Some("7")), (&db, Some("5"))], &[]),
            AB,
            false,
        ),
        (
            "more Service writes than the journal itemizes",
            true,
            Journal { truncated: true, ..changes(&[(&internal, Some("7"))], &["Service"]) },
            AB,
            false,
        ),
        ("a deletion, and a node's Lease expired", true, changes(&[], &["Service"]), &["a"], false),
        ("a Node changed", true, changes(&[], &["Service", "Node"]), AB, false),
        ("a pool changed", true, changes(&[], &["NodePortPool"]), AB, false),
        ("a namespace changed", true, changes(&[], &["Namespace"]), AB, false),
        (
            "the last round left work (claims to settle, Events to send)",
            false,
            changes(&[], &["Service"]),
            AB,
            true,
        ),
    ];
    for (name, clean, journal, serving, want) in cases {
        state.clean = clean;
        assert_eq!(state.can_wait(&journal, &view(serving), |k| *k == internal), want, "{name}");
    }
}

/// A node whose agent runs but has not published its listeners yet (just started) could have
/// a process on any number: the round hands out none until it has, and the Service waits;
/// then it gets a number no node listens on. A Service that keeps its numbers is not held.
#[test]
fn no_new_number_until_every_running_agent_has_reported_its_listeners() {
    let service = |name: &str, annotation: Option<&str>| -> Arc<Service> {
        let mut v = json!({
            "metadata": {"name": name, "namespace": "default", "uid": format!("uid-{name}")},
            "spec": {"type": "LoadBalancer", "ports": [{"port": 80, "protocol": "TCP"}]}
        });
        if let Some(a) = annotation {
            v["metadata"]["annotations"] = json!({ANNOTATION_ALLOCATED: a});
        }
        Arc::new(serde_json::from_value(v).unwrap())
    };
    let node: Arc<Node> = Arc::new(
        serde_json::from_value(json!({
            "metadata": {"name": "node-1"},
            "status": {"addresses": [{"type": "InternalIP", "address": "192.0.2.1"}]}
        }))
        .unwrap(),
    );
    let lease = |listening: Option<&str>| -> Arc<Lease> {
        let mut annotations = json!({nodes::ANNOTATION_FAMILIES: "ipv4"});
        if let Some(l) = listening {
            annotations[nodes::ANNOTATION_LISTENING] = json!(l);
        }
        Arc::new(
            serde_json::from_value(json!({
                "metadata": {"name": "nodelb-node-node-1", "annotations": annotations},
                "spec": {"holderIdentity": "node-1", "leaseDurationSeconds": 15,
                         "renewTime": "2030-01-01T00:00:00.000000Z"}
            }))
            .unwrap(),
        )
    };
    let cfg = ControllerConfig {
        identity: "controller-1".into(),
        namespace: "nodelb-system".into(),
        lease_duration: Duration::from_secs(15),
        node_addresses: vec![],
        port_range: PortRange::new(9471, 9473).unwrap(),
        model: ModelOptions::default(),
        policy: Default::default(),
    };
    let now: Timestamp = "2030-01-01T00:00:01Z".parse().unwrap();
    let round = |lease: Arc<Lease>| -> RoundPlan {
        let snap = KubeSnapshot {
            services: vec![service("new", None), service("kept", Some("80/TCP=9472"))],
            nodes: vec![node.clone()],
            leases: vec![lease],
            ..Default::default()
        };
        let registry = claims::Registry::default();
        let token = claims::Token::new("test", 1, 0);
        let (gone, expired) = (Default::default(), Default::default());
        let inputs = ClaimInputs {
            registry: Some(&registry),
            token: &token,
            gone: &gone,
            gone_claims: None,
            expired: &expired,
        };
        let mut holders = claims::Holders::default();
        holders.pass(&snap.services, &snap.slices);
        plan_round(&snap, &cfg, &mut RoundMemory::default(), &holders, Some(now), now, &inputs, false)
    };
    let written = |p: &RoundPlan, name: &str| -> Option<Option<String>> {
        p.writes.iter().find(|w| &*w.key.name == name).and_then(|w| w.annotation.clone())
    };

    let waiting = round(lease(None));
    assert_eq!(waiting.listeners_unreported, ["node-1"]);
    assert_eq!(written(&waiting, "new"), None, "a number handed out before node-1 said what listens");
    assert!(waiting.claims.blocked.contains(&ServiceKey::new("default", "new")));
    assert!(!waiting.claims.blocked.contains(&ServiceKey::new("default", "kept")));
    assert!(waiting.writes.iter().any(|w| &*w.key.name == "kept"), "kept is not held: {:?}", waiting.writes);

    // node-1's agent listens on 9471 (its health listener, say): the Service gets 9473.
    let reported = round(lease(Some("9471/TCP")));
    assert!(reported.listeners_unreported.is_empty());
    assert_eq!(written(&reported, "new"), Some(Some("80/TCP=9473".to_string())));
    assert!(reported.claims.blocked.is_empty(), "{:?}", reported.claims.blocked);
}

/// Two Services hold 443 together (the registry records it) after the internal pool was
/// edited to select every node: the registry's record keeps both. A round that cannot read the
/// registry takes nothing off either (it would take the younger's number for good).
#[test]
fn a_shared_number_stays_through_a_round_without_the_registry() {
    let service = |name: &str| -> Arc<Service> {
        Arc::new(
            serde_json::from_value(json!({
                "metadata": {"name": "ingress", "namespace": name, "uid": format!("{}-0000", name.repeat(8)),
                             "creationTimestamp": "2024-01-01T00:00:00Z",
                             "annotations": {ANNOTATION_ALLOCATED: "443/TCP=443", "nodelb.io/pool": name}},
                "spec": {"type": "LoadBalancer", "ports": [{"port": 443, "protocol": "TCP"}]}
            }))
            .unwrap(),
        )
    };
    let pool = |name: &str, selector: serde_json::Value| -> Arc<crate::decisions::pool::NodePortPool> {
        Arc::new(
            serde_json::from_value(json!({
                "apiVersion": "nodelb.io/v1alpha1", "kind": "NodePortPool",
                "metadata": {"name": name, "uid": format!("pool-{name}"), "generation": 2},
                "spec": {"portMode": "ServicePort", "ports": [{"start": 443, "end": 443}], "nodeSelector": selector}
            }))
            .unwrap(),
        )
    };
    let snap = KubeSnapshot {
        services: vec![service("a"), service("b")],
        pools: vec![pool("a", json!({"matchLabels": {"tier": "edge"}})), pool("b", json!({}))],
        ..Default::default()
    };
    let on = |c: claims::Claim, pool: &str| claims::Claim { pool: Some(pool.into()), ..c };
    let mut registry = claims::Registry::default();
    let mut shared: claims::Holds =
        on(claims::Claim::held(claims::Owner::of_uid("aaaaaaaa-0000")), "a").into();
    shared.put(on(claims::Claim::held(claims::Owner::of_uid("bbbbbbbb-0000")), "b"));
    Arc::make_mut(&mut registry.blocks.entry(0).or_default().claims).insert(443, shared);
    registry.blocks.get_mut(&0).unwrap().resource_version = Some("1".into());
    let cfg = ControllerConfig {
        identity: "controller-1".into(),
        namespace: "nodelb-system".into(),
        lease_duration: Duration::from_secs(15),
        node_addresses: vec![],
        port_range: PortRange::new(20000, 20009).unwrap(),
        model: ModelOptions::default(),
        policy: Default::default(),
    };
    let now: Timestamp = "2030-01-01T00:00:01Z".parse().unwrap();
    let token = claims::Token::new("test", 1, 0);
    let (gone, expired) = (Default::default(), Default::default());
    let mut memory = RoundMemory::default();
    let mut holders = claims::Holders::default();
    holders.pass(&snap.services, &snap.slices);
    for read in [Some(&registry), None] {
        let inputs =
            ClaimInputs { registry: read, token: &token, gone: &gone, gone_claims: None, expired: &expired };
        let plan = plan_round(&snap, &cfg, &mut memory, &holders, Some(now), now, &inputs, false);
        let annotations: Vec<_> =
            plan.writes.iter().filter(|w| w.annotation.is_some()).map(|w| &w.key).collect();
        assert!(annotations.is_empty(), "registry read: {}: {annotations:?}", read.is_some());
    }
    // A new leader (no memory) whose first round cannot read the registry either.
    let inputs =
        ClaimInputs { registry: None, token: &token, gone: &gone, gone_claims: None, expired: &expired };
    let plan = plan_round(&snap, &cfg, &mut RoundMemory::default(), &holders, Some(now), now, &inputs, false);
    let annotations: Vec<_> = plan.writes.iter().filter(|w| w.annotation.is_some()).map(|w| &w.key).collect();
    assert!(annotations.is_empty(), "a new leader without the registry: {annotations:?}");
}
