use super::*;
use crate::inputs::model::ANNOTATION_ALLOCATED;
use crate::inputs::model::{Endpoint, LbPort};
use serde_json::json;

fn t(s: i64) -> Timestamp {
    Timestamp::from_second(1_700_000_000 + s).unwrap()
}

fn serving(nodes: &[(&str, &[Family], &[&str])]) -> BTreeMap<String, ServingNode> {
    nodes
        .iter()
        .map(|(n, f, a)| {
            (
                n.to_string(),
                ServingNode {
                    name: n.to_string(),
                    families: f.iter().copied().collect(),
                    addresses: a.iter().map(|s| s.parse().unwrap()).collect(),
                },
            )
        })
        .collect()
}

fn ep(addr: &str, node: &str, ready: bool) -> Endpoint {
    Endpoint {
        addr: addr.parse().unwrap(),
        port: 8080,
        node_name: Some(node.into()),
        ready,
        serving: ready,
        terminating: false,
    }
}

fn lb(families: &[Family], policy: TrafficPolicy, endpoints: Vec<Endpoint>) -> LbService {
    let mut s = LbService::with_defaults(
        ServiceKey::new("default", "web"),
        vec![LbPort { id: PortId::tcp(80), name: String::new(), endpoints }],
    );
    s.families = families.to_vec();
    s.traffic_policy = policy;
    s
}

fn ips(ing: &[LoadBalancerIngress]) -> Vec<String> {
    ing.iter().map(|i| i.ip.clone().unwrap()).collect()
}

#[test]
fn ingress_table() {
    use Family::{Ipv4 as V4, Ipv6 as V6};
    let nodes = serving(&[
        ("a", &[V4, V6], &["10.0.0.1", "fd00::1"]),
        ("b", &[V4], &["10.0.0.2"]),
        ("c", &[V6], &["fd00::3"]),
    ]);
    let ports = BTreeMap::from([(PortId::tcp(80), 20001)]);
    let eps =
        vec![ep("198.51.100.1", "b", true), ep("2001:db8::1", "a", true), ep("198.51.100.2", "a", false)];
    type Case = (&'static str, LbService, BTreeMap<PortId, u16>, Vec<&'static str>);
    let cases: Vec<Case> = vec![
        (
            "v4 cluster",
            lb(&[V4], TrafficPolicy::Cluster, vec![]),
            ports.clone(),
            vec!["10.0.0.1", "10.0.0.2"],
        ),
        ("v6 cluster", lb(&[V6], TrafficPolicy::Cluster, vec![]), ports.clone(), vec!["fd00::1", "fd00::3"]),
        (
            "dual stack",
            lb(&[V4, V6], TrafficPolicy::Cluster, vec![]),
            ports.clone(),
            vec!["10.0.0.1", "10.0.0.2", "fd00::1", "fd00::3"],
        ),
        (
            "local: only nodes with a ready local endpoint of the family",
            lb(&[V4, V6], TrafficPolicy::Local, eps.clone()),
            ports.clone(),
            vec!["10.0.0.2", "fd00::1"],
        ),
        ("local without endpoints", lb(&[V4], TrafficPolicy::Local, vec![]), ports.clone(), vec![]),
        ("no allocation, no ingress", lb(&[V4], TrafficPolicy::Cluster, vec![]), BTreeMap::new(), vec![]),
    ];
    for (name, svc, ports, want) in cases {
        let got = ingress_for(&svc, &ports, &nodes);
        assert_eq!(ips(&got), want, "{name}");
        for i in &got {
            assert_eq!(i.ip_mode.as_deref(), Some("Proxy"), "{name}");
            let p = &i.ports.as_ref().unwrap()[0];
            assert_eq!((p.port, p.protocol.as_str()), (80, "TCP"), "{name}: the Service's own port");
            assert_eq!(p.error.as_deref(), Some(PORT_ERROR_ALLOCATED_PORT), "{name}");
        }
    }
}

/// `Serving=True` says on how many nodes, and names a few refusing ones with why.
#[test]
fn the_serving_message_counts_nodes_and_names_refusals() {
    let nodes = serving(&[
        ("a", &[Family::Ipv4], &["10.0.0.1"]),
        ("b", &[Family::Ipv4], &["10.0.0.2"]),
        ("c", &[Family::Ipv4], &["10.0.0.3"]),
        ("d", &[Family::Ipv4], &["10.0.0.4"]),
        ("e", &[Family::Ipv4], &["10.0.0.5"]),
    ]);
    let svc = lb(&[Family::Ipv4], TrafficPolicy::Cluster, vec![]);
    let ingress = ingress_for(&svc, &BTreeMap::from([(PortId::tcp(80), 20001)]), &nodes);
    assert_eq!(
        serving_summary(&nodes, &ingress, &[]),
        "served on 5 of 5 nodes (status.loadBalancer.ingress)"
    );
    let why = |n: &str, w: &str| (n.to_string(), w.to_string());
    let refused = [
        why(
            "c",
            "Service default/web: port 80/TCP: node port 20001/TCP is not taken on this node: in use: a process listens on 0.0.0.0:20001/TCP on this node",
        ),
        why("zz", "not one of its nodes"),
    ];
    assert_eq!(
        serving_summary(&nodes, &ingress, &refused),
        "served on 4 of 5 nodes (status.loadBalancer.ingress); c: port 80/TCP: node port 20001/TCP is not taken on this node: in use: a process listens on 0.0.0.0:20001/TCP on this node"
    );
    let many: Vec<(String, String)> =
        ["a", "b", "c", "d", "e"].iter().map(|n| why(n, "forwarding is off")).collect();
    assert_eq!(
        serving_summary(&nodes, &ingress, &many),
        "served on 0 of 5 nodes (status.loadBalancer.ingress); a: forwarding is off; b: forwarding is off; c: forwarding is off; 2 more nodes refuse it (nodelb status --cluster)"
    );
}

/// `ports` lists the Service's own ports: no error where it answers on its own number.
#[test]
fn ingress_ports_say_which_service_ports_answer_on_their_own_number() {
    let nodes = serving(&[("a", &[Family::Ipv4], &["10.0.0.1"])]);
    let mut svc = lb(&[Family::Ipv4], TrafficPolicy::Cluster, vec![]);
    let web = svc.ports[0].clone();
    svc.ports = [443, 80, 8080].into_iter().map(|n| LbPort { id: PortId::tcp(n), ..web.clone() }).collect();
    let ports = BTreeMap::from([(PortId::tcp(80), 80), (PortId::tcp(443), 443), (PortId::tcp(8080), 20001)]);
    let got: Vec<(i32, Option<String>)> = ingress_for(&svc, &ports, &nodes)[0]
        .ports
        .iter()
        .flatten()
        .map(|p| (p.port, p.error.clone()))
        .collect();
    assert_eq!(got, [(80, None), (443, None), (8080, Some(PORT_ERROR_ALLOCATED_PORT.to_string()))]);
    let partly = BTreeMap::from([(PortId::tcp(80), 80)]);
    let got: Vec<Option<String>> =
        ingress_for(&svc, &partly, &nodes)[0].ports.iter().flatten().map(|p| p.error.clone()).collect();
    let not = Some(PORT_ERROR_NOT_ALLOCATED.to_string());
    assert_eq!(got, [None, not.clone(), not]);
}

#[test]
fn conditions_table() {
    let key = ServiceKey::new("default", "web");
    let ports = BTreeMap::from([(PortId::tcp(80), 20001)]);
    let conflict = AllocProblem::Conflict {
        service: key.clone(),
        port: PortId::tcp(443),
        wanted: 20001,
        holder: ServiceKey::new("default", "old"),
    };
    let exhausted = AllocProblem::Exhausted {
        service: key.clone(),
        port: PortId::tcp(443),
        range: "range 20000-29999".into(),
    };
    let refusal = Refusal::InvalidSourceRange {
        service: key.clone(),
        value: "10.0.0.0/33".into(),
        reason: "bad".into(),
    };
    type Case<'a> =
        (&'static str, Vec<&'a AllocProblem>, Option<&'a Refusal>, bool, &'static str, &'static str);
    let cases: Vec<Case> = vec![
        ("allocated", vec![], None, true, "Allocated", "80/TCP=20001"),
        ("conflict", vec![&conflict], None, false, "PortConflict", "holds"),
        ("exhausted", vec![&exhausted], None, false, "RangeExhausted", "no free node port"),
        ("conflict wins over exhausted", vec![&exhausted, &conflict], None, false, "PortConflict", "holds"),
        ("invalid input names the value", vec![], Some(&refusal), false, "InvalidInput", "10.0.0.0/33"),
    ];
    for (name, problems, refusal, status, reason, msg) in cases {
        let c = condition_for(&ports, &problems, refusal);
        assert_eq!((c.status, c.reason.as_str()), (status, reason), "{name}");
        assert!(c.message.contains(msg), "{name}: {}", c.message);
    }
}

fn service(name: &str, f: impl FnOnce(&mut serde_json::Value)) -> Service {
    let mut v = json!({
        "metadata": {"name": name, "namespace": "default", "resourceVersion": "7", "generation": 1,
                     "creationTimestamp": "2024-01-01T00:00:00Z"},
        "spec": {"type": "LoadBalancer", "ports": [{"port": 80}]},
        "status": {}
    });
    f(&mut v);
    serde_json::from_value(v).unwrap()
}

static NO_LISTENERS: BTreeMap<(crate::domain::Protocol, u16), String> = BTreeMap::new();

/// A round at `t(0)` with no listeners, refused endpoints nor pools.
fn plain_round<'a, S, V>(
    services: &'a [S],
    opts: &'a ModelOptions,
    (valid, refused): (&'a [V], &'a [Refusal]),
    result: &'a crate::decisions::alloc::AllocationResult,
    serving: &'a BTreeMap<String, ServingNode>,
) -> Round<'a, S, V> {
    Round {
        services,
        model: opts,
        valid,
        refused,
        allocations: &result.allocations,
        problems: &result.problems,
        refused_endpoints: &[],
        listening: &NO_LISTENERS,
        serving,
        pool_nodes: None,
        pool_addresses: None,
        lost: &[],
        refusals: None,
        now: t(0),
    }
}

struct World {
    services: Vec<Service>,
}

impl World {
    fn writes(&self, serving_nodes: &BTreeMap<String, ServingNode>) -> Vec<ServiceWrite> {
        let opts = ModelOptions::default();
        let out = model::build(&self.services, model::NO_SLICES, &opts);
        let result =
            crate::decisions::alloc::allocate(&Default::default(), &out.services, &Allocations::new());
        plan_writes(&plain_round(
            &self.services,
            &opts,
            (&out.services, &out.refused),
            &result,
            serving_nodes,
        ))
    }
}

/// Applies writes the way the API server would (for convergence checks).
fn apply(services: &mut [Service], writes: &[ServiceWrite]) {
    for w in writes {
        let svc = services.iter_mut().find(|s| model::service_key(s) == w.key).unwrap();
        if let Some(a) = &w.annotation {
            let ann = svc.metadata.annotations.get_or_insert_default();
            match a {
                Some(v) => ann.insert(ANNOTATION_ALLOCATED.into(), v.clone()),
                None => ann.remove(ANNOTATION_ALLOCATED),
            };
        }
        if let Some(s) = &w.status {
            let st = svc.status.get_or_insert_default();
            st.load_balancer.get_or_insert_default().ingress = Some(s.ingress.clone());
            st.conditions = Some(s.conditions.clone());
        }
    }
}

#[test]
fn writes_table() {
    let nodes = serving(&[("a", &[Family::Ipv4], &["10.0.0.1"])]);
    type Case = (&'static str, Vec<Service>, Vec<(&'static str, Option<Option<&'static str>>, bool)>);
    let cases: Vec<Case> = vec![
        (
            "new Service: annotation + status",
            vec![service("web", |_| {})],
            vec![("web", Some(Some("80/TCP=20000")), true)],
        ),
        (
            "annotated already: only status",
            vec![service("web", |v| {
                v["metadata"]["annotations"] = json!({ANNOTATION_ALLOCATED: "80/TCP=20005"})
            })],
            vec![("web", None, true)],
        ),
        ("not ours, untouched", vec![service("web", |v| v["spec"]["type"] = json!("ClusterIP"))], vec![]),
        (
            "opted out: our annotation and condition removed, ingress cleared",
            vec![service("web", |v| {
                v["metadata"]["annotations"] =
                    json!({ANNOTATION_ALLOCATED: "80/TCP=20005", "nodelb.io/ignore": "true"});
                v["status"] = json!({"loadBalancer": {"ingress": [{"ip": "10.0.0.1", "ipMode": "Proxy"}]},
                        "conditions": [{"type": CONDITION_ALLOCATED, "status": "True", "reason": "Allocated", "message": "", "lastTransitionTime": "2024-01-01T00:00:00Z"}]});
            })],
            vec![("web", Some(None), true)],
        ),
        (
            "other class, no marks of ours: untouched",
            vec![service("web", |v| {
                v["spec"]["loadBalancerClass"] = json!("other.io/lb");
                v["status"] = json!({"loadBalancer": {"ingress": [{"ip": "192.0.2.1"}]}});
            })],
            vec![],
        ),
        (
            "ignore typo: refused like any bad annotation (not opted out), annotation kept",
            vec![service("web", |v| {
                v["metadata"]["annotations"] =
                    json!({ANNOTATION_ALLOCATED: "80/TCP=20005", "nodelb.io/ignore": "yes"});
            })],
            vec![("web", None, true)],
        ),
        (
            "refused: only the condition, annotation kept",
            vec![service("web", |v| {
                v["metadata"]["annotations"] = json!({ANNOTATION_ALLOCATED: "80/TCP=20005"});
                v["spec"]["loadBalancerSourceRanges"] = json!(["10.0.0.0/33"]);
            })],
            vec![("web", None, true)],
        ),
    ];
    for (name, services, want) in cases {
        let mut world = World { services };
        let writes = world.writes(&nodes);
        let got: Vec<(&str, Option<Option<&str>>, bool)> = writes
            .iter()
            .map(|w| {
                let name: &str = world
                    .services
                    .iter()
                    .map(|s| s.metadata.name.as_deref().unwrap())
                    .find(|n| *n == &*w.key.name)
                    .unwrap();
                (name, w.annotation.as_ref().map(|a| a.as_deref()), w.status.is_some())
            })
            .collect();
        assert_eq!(got, want, "{name}");
        for w in &writes {
            assert_eq!(w.resource_version.as_deref(), Some("7"), "{name}: precondition");
        }
        // Converges: once applied, nothing more to write.
        apply(&mut world.services, &writes);
        assert_eq!(world.writes(&nodes), vec![], "{name}: second round");
    }
}

#[test]
fn transition_time_kept_while_status_unchanged() {
    let nodes = serving(&[("a", &[Family::Ipv4], &["10.0.0.1"])]);
    let mut world = World { services: vec![service("web", |_| {})] };
    let w = world.writes(&nodes);
    apply(&mut world.services, &w);
    // A node joins: the ingress changes and the Serving message counts it (one write, as
    // for the ingress alone); no condition's status, so no transition time, moves.
    let nodes2 = serving(&[("a", &[Family::Ipv4], &["10.0.0.1"]), ("b", &[Family::Ipv4], &["10.0.0.2"])]);
    let w2 = world.writes(&nodes2);
    assert_eq!(w2.len(), 1);
    let st = w2[0].status.as_ref().unwrap();
    assert_eq!(ips(&st.ingress), vec!["10.0.0.1", "10.0.0.2"]);
    let before = world.services[0].status.as_ref().unwrap().conditions.clone().unwrap();
    let times = |cs: &[Condition]| -> Vec<(String, String, Time)> {
        cs.iter().map(|c| (c.type_.clone(), c.status.clone(), c.last_transition_time.clone())).collect()
    };
    assert_eq!(times(&st.conditions), times(&before));
    let serving_message = |cs: &[Condition]| {
        cs.iter().find(|c| c.type_ == CONDITION_SERVING).map(|c| c.message.clone()).unwrap_or_default()
    };
    assert_eq!(serving_message(&before), "served on 1 of 1 nodes (status.loadBalancer.ingress)");
    assert_eq!(serving_message(&st.conditions), "served on 2 of 2 nodes (status.loadBalancer.ingress)");
}

#[test]
fn refused_services_keep_holding_their_ports() {
    let services = vec![
        service("broken", |v| {
            v["metadata"]["annotations"] = json!({ANNOTATION_ALLOCATED: "80/TCP=20000"});
            v["spec"]["loadBalancerSourceRanges"] = json!(["nope"]);
        }),
        service("new", |v| v["metadata"]["creationTimestamp"] = json!("2024-06-01T00:00:00Z")),
    ];
    let opts = ModelOptions::default();
    let out = model::build(&services, model::NO_SLICES, &opts);
    let stubs = reserved(&services, &out.refused);
    assert_eq!(stubs.len(), 1);
    let all: Vec<LbService> = out.services.iter().cloned().chain(stubs).collect();
    let r = crate::decisions::alloc::allocate(&Default::default(), &all, &Allocations::new());
    assert_eq!(r.allocations[&ServiceKey::new("default", "new")][&PortId::tcp(80)], 20001);
}

#[test]
fn serving_condition_table() {
    use Family::{Ipv4 as V4, Ipv6 as V6};
    let ports = BTreeMap::from([(PortId::tcp(80), 20001)]);
    let none: BTreeMap<PortId, u16> = BTreeMap::new();
    let no_nodes: BTreeMap<String, ServingNode> = BTreeMap::new();
    let v4_nodes = serving(&[("a", &[V4], &["10.0.0.1"])]);
    let v6_nodes = serving(&[("c", &[V6], &["fd00::3"])]);
    let ready_on_a = vec![ep("198.51.100.1", "a", true)];
    let ready_elsewhere = vec![ep("198.51.100.1", "b", true), ep("198.51.100.2", "a", false)];
    type Case<'a> = (
        &'static str,
        LbService,
        &'a BTreeMap<PortId, u16>,
        &'a BTreeMap<String, ServingNode>,
        bool,
        &'static str,
    );
    let cases: Vec<Case> = vec![
        ("listed", lb(&[V4], TrafficPolicy::Cluster, vec![]), &ports, &v4_nodes, true, "Serving"),
        ("not allocated", lb(&[V4], TrafficPolicy::Cluster, vec![]), &none, &v4_nodes, false, "NotAllocated"),
        (
            "no node at all",
            lb(&[V4], TrafficPolicy::Cluster, vec![]),
            &ports,
            &no_nodes,
            false,
            "NoServingNode",
        ),
        (
            "nodes serve only another family",
            lb(&[V4], TrafficPolicy::Cluster, vec![]),
            &ports,
            &v6_nodes,
            false,
            "NoServingNode",
        ),
        (
            "local, ready local endpoint",
            lb(&[V4], TrafficPolicy::Local, ready_on_a),
            &ports,
            &v4_nodes,
            true,
            "Serving",
        ),
        (
            "local, no ready endpoint on a serving node",
            lb(&[V4], TrafficPolicy::Local, ready_elsewhere),
            &ports,
            &v4_nodes,
            false,
            "NoReadyLocalEndpoint",
        ),
        (
            "local and no node: no node wins",
            lb(&[V4], TrafficPolicy::Local, vec![]),
            &ports,
            &no_nodes,
            false,
            "NoServingNode",
        ),
    ];
    for (name, svc, ports, nodes, status, reason) in cases {
        let ingress = ingress_for(&svc, ports, nodes);
        let c = serving_condition(&svc, ports, nodes, &ingress);
        assert_eq!((c.status, c.reason.as_str()), (status, reason), "{name}: {}", c.message);
    }
}

fn condition<'a>(w: &'a ServiceWrite, type_: &str) -> &'a Condition {
    let st = w.status.as_ref().expect("a status write");
    st.conditions.iter().find(|c| c.type_ == type_).unwrap_or_else(|| panic!("no {type_}: {st:?}"))
}

#[test]
fn no_serving_node_is_carried_by_the_serving_condition() {
    let mut world = World { services: vec![service("web", |_| {})] };
    // Allocated, but no agent is ready (forwarding off everywhere): Allocated stays True,
    // Serving says NoServingNode, with the message of the NoServingNode Event.
    let w = world.writes(&BTreeMap::new());
    assert_eq!(w.len(), 1);
    let alloc = condition(&w[0], CONDITION_ALLOCATED);
    assert_eq!((alloc.status.as_str(), alloc.reason.as_str()), ("True", "Allocated"));
    let serving_c = condition(&w[0], CONDITION_SERVING).clone();
    assert_eq!((serving_c.status.as_str(), serving_c.reason.as_str()), ("False", "NoServingNode"));
    assert!(serving_c.message.contains("ipv4"), "{}", serving_c.message);
    apply(&mut world.services, &w);
    assert_eq!(world.writes(&BTreeMap::new()), vec![], "converged");
    // A node becomes ready: listed, Serving flips to True (new transition time), Allocated
    // keeps its transition time.
    let nodes = serving(&[("a", &[Family::Ipv4], &["10.0.0.1"])]);
    let opts = ModelOptions::default();
    let out = model::build(&world.services, model::NO_SLICES, &opts);
    let allocs = crate::decisions::alloc::allocate(&Default::default(), &out.services, &Allocations::new());
    let no_nodes = BTreeMap::new();
    let nothing_listens = BTreeMap::new();
    let round = |node_ready: bool, now| Round {
        services: &world.services,
        model: &opts,
        valid: &out.services,
        refused: &out.refused,
        allocations: &allocs.allocations,
        problems: &allocs.problems,
        refused_endpoints: &[],
        listening: &nothing_listens,
        serving: if node_ready { &nodes } else { &no_nodes },
        pool_nodes: None,
        pool_addresses: None,
        lost: &[],
        refusals: None,
        now,
    };
    let later = plan_writes(&round(true, t(60)));
    assert_eq!(ips(&later[0].status.as_ref().unwrap().ingress), vec!["10.0.0.1"]);
    let s2 = condition(&later[0], CONDITION_SERVING);
    assert_eq!((s2.status.as_str(), s2.reason.as_str()), ("True", "Serving"));
    assert_eq!(s2.last_transition_time, Time(t(60)));
    assert_eq!(condition(&later[0], CONDITION_ALLOCATED).last_transition_time, alloc.last_transition_time);
    // The NoServingNode Event and the condition describe the same state.
    let events = service_events(&round(false, t(0)), &[]);
    let ev = events.iter().find(|e| e.reason == "NoServingNode").expect("NoServingNode Event");
    assert_eq!(ev.message, serving_c.message);
}

#[test]
fn leaving_us_removes_both_conditions_and_others_stay() {
    let nodes = serving(&[("a", &[Family::Ipv4], &["10.0.0.1"])]);
    let mut world = World { services: vec![service("web", |_| {})] };
    let w = world.writes(&nodes);
    apply(&mut world.services, &w);
    let st = world.services[0].status.as_mut().unwrap();
    st.conditions.as_mut().unwrap().insert(
        0,
        Condition {
            type_: "example.com/Other".into(),
            status: "True".into(),
            reason: "Fine".into(),
            message: String::new(),
            observed_generation: None,
            last_transition_time: Time(t(0)),
        },
    );
    world.services[0].spec.as_mut().unwrap().type_ = Some("ClusterIP".into());
    let w = world.writes(&nodes);
    assert_eq!(w.len(), 1);
    assert_eq!(w[0].annotation, Some(None), "allocation removed");
    let st = w[0].status.as_ref().unwrap();
    assert!(st.ingress.is_empty());
    let types: Vec<&str> = st.conditions.iter().map(|c| c.type_.as_str()).collect();
    assert_eq!(types, vec!["example.com/Other"]);
}

#[test]
fn events_for_a_round() {
    let services = vec![service("web", |_| {})];
    let opts = ModelOptions::default();
    let out = model::build(&services, model::NO_SLICES, &opts);
    let result = crate::decisions::alloc::allocate(&Default::default(), &out.services, &Allocations::new());
    let none = BTreeMap::new();
    let round = plain_round(&services, &opts, (&out.services, &out.refused), &result, &none);
    let reasons: Vec<&str> = service_events(&round, &[]).iter().map(|e| e.reason).collect();
    assert_eq!(reasons, vec!["NodePortsAllocated", "NoServingNode"]);
    // Two ports refused for one reason: one Event (one message per Service and reason).
    let key = ServiceKey::new("default", "web");
    let in_use = |port: u16| AllocProblem::InUse {
        service: key.clone(),
        port: PortId::tcp(port),
        wanted: port,
        by: "a process listens on it on a".into(),
    };
    let problems = [in_use(22), in_use(23)];
    let round = Round { problems: &problems, ..round };
    let events: Vec<ServiceEvent> =
        service_events(&round, &[]).into_iter().filter(|e| e.reason == "NodePortInUse").collect();
    assert_eq!(events.len(), 1, "{events:?}");
    assert!(events[0].message.contains("22/TCP") && events[0].message.contains("23/TCP"), "{events:?}");
}

/// A Service's own Events of one reason (two ports in use) are merged as a whole round
/// merges them, though `plan_services` merges Service by Service.
#[test]
fn one_services_events_are_merged_as_a_whole_round_merges_them() {
    let services = vec![Arc::new(service("web", |v| {
        v["spec"]["ports"] = json!([{"name": "a", "port": 80}, {"name": "b", "port": 81}]);
        v["metadata"]["annotations"] = json!({ANNOTATION_ALLOCATED: "80/TCP=20005,81/TCP=20006"});
    }))];
    use crate::incremental::model_cache::{ModelCache, ModelContext};
    let opts = ModelOptions::default();
    let (since, addresses, policy) = (BTreeMap::new(), Default::default(), Default::default());
    let ctx = ModelContext { opts: &opts, since: &since, addresses: &addresses, policy: &policy };
    let out =
        ModelCache::new().build(crate::domain::Scope::All, &services, &[], &ctx).expect("a whole build");
    let result = crate::decisions::alloc::allocate_with(
        &Default::default(),
        &out.services,
        &Allocations::new(),
        Default::default(),
    );
    let listening: BTreeMap<(crate::domain::Protocol, u16), String> =
        [20005, 20006].into_iter().map(|n| ((crate::domain::Protocol::Tcp, n), format!("pid {n}"))).collect();
    let none = BTreeMap::new();
    let round = Round {
        listening: &listening,
        ..plain_round(&services, &opts, (&out.services, &out.refused), &result, &none)
    };
    let (_, mut events) = plan_services(&round, &[], &mut Published::default(), None);
    events.sort();
    let whole = service_events(&round, &[]);
    assert_eq!(events, whole);
    let in_use: Vec<&ServiceEvent> = whole.iter().filter(|e| e.reason == "NodePortInUse").collect();
    assert!(in_use.len() == 1 && in_use[0].message.contains("20006"), "{whole:?}");
}

/// A Service served on some node addresses only gets no `NodePortInUse` Event from a listened-on
/// port: the Lease names no address, and a node serves the port beside a listener elsewhere.
#[test]
fn a_listened_on_port_is_not_in_use_for_a_service_on_some_addresses_only() {
    let services = vec![service("web", |v| {
        v["metadata"]["annotations"] = json!({ANNOTATION_ALLOCATED: "80/TCP=20443"});
    })];
    let opts = ModelOptions::default();
    let out = model::build(&services, model::NO_SLICES, &opts);
    let result = crate::decisions::alloc::allocate(&Default::default(), &out.services, &Allocations::new());
    let listening: BTreeMap<(crate::domain::Protocol, u16), String> = [(
        (crate::domain::Protocol::Tcp, 20443),
        "a process listens on 192.0.2.1:20443/TCP on node a".to_string(),
    )]
    .into();
    let none = BTreeMap::new();
    let round = Round {
        listening: &listening,
        ..plain_round(&services, &opts, (&out.services, &out.refused), &result, &none)
    };
    let in_use = |events: Vec<ServiceEvent>| events.iter().filter(|e| e.reason == "NodePortInUse").count();
    assert_eq!(in_use(service_events(&round, &[])), 1, "served on every address: the listener clashes");
    let key = ServiceKey::new("default", "web");
    let addresses: BTreeMap<ServiceKey, BTreeMap<String, Vec<std::net::IpAddr>>> =
        [(key, [("a".to_string(), vec!["192.0.2.2".parse().unwrap()])].into())].into();
    let round = Round { pool_addresses: Some(&addresses), ..round };
    assert_eq!(
        in_use(service_events(&round, &[])),
        0,
        "served on 192.0.2.2 only: the node decides per address"
    );
}

/// The kept parts are what a whole round computes: a sequence of rounds, each planned both
/// ways on the same objects; what nothing happened to is reused, a change of the shared
/// inputs (nodes, listeners) starts over.
#[test]
fn kept_parts_are_what_a_whole_round_computes() {
    use crate::incremental::model_cache::{ModelCache, ModelContext};
    let opts = ModelOptions::default();
    let (since, addresses, policy) = (BTreeMap::new(), Default::default(), Default::default());
    let ctx = ModelContext { opts: &opts, since: &since, addresses: &addresses, policy: &policy };
    let mut services: Vec<Arc<Service>> = vec![
        Arc::new(service("web", |_| {})),
        Arc::new(service("db", |v| {
            v["metadata"]["annotations"] = json!({ANNOTATION_ALLOCATED: "80/TCP=20005"})
        })),
        Arc::new(service("other", |v| {
            v["spec"]["type"] = json!("ClusterIP");
            v["metadata"]["annotations"] = json!({ANNOTATION_ALLOCATED: "80/TCP=20009"});
        })),
        Arc::new(service("broken", |v| {
            v["metadata"]["annotations"] = json!({ANNOTATION_ALLOCATED: "80/TCP=20007"});
            v["spec"]["loadBalancerSourceRanges"] = json!(["nope"]);
        })),
    ];
    let one = serving(&[("a", &[Family::Ipv4], &["10.0.0.1"])]);
    let two = serving(&[("a", &[Family::Ipv4], &["10.0.0.1"]), ("b", &[Family::Ipv4], &["10.0.0.2"])]);
    let in_use: BTreeMap<(crate::domain::Protocol, u16), String> =
        [((crate::domain::Protocol::Tcp, 20005), "sshd on a".to_string())].into();
    let web = ServiceKey::new("default", "web");
    let refused_web = vec![RefusedEndpoint {
        service: web.clone(),
        address: "127.0.0.1".parse().unwrap(),
        reason: crate::decisions::endpoint_policy::AddressRefusal::Loopback,
    }];
    let no_listeners = BTreeMap::new();
    let none_refused = crate::k8s::cluster_view::Refusals::new();
    let b_refuses_web: crate::k8s::cluster_view::Refusals =
        [("default/web".to_string(), vec![("b".to_string(), "a process listens on it".to_string())])].into();
    // (step, serving nodes, listeners, refused endpoints, what the nodes refuse, Services
    // re-read, parts reused)
    type Step<'a> = (
        &'static str,
        &'a BTreeMap<String, ServingNode>,
        &'a BTreeMap<(crate::domain::Protocol, u16), String>,
        &'a [RefusedEndpoint],
        &'a crate::k8s::cluster_view::Refusals,
        &'static [&'static str],
        usize,
    );
    let steps: Vec<Step<'_>> = vec![
        ("first round: nothing kept", &one, &no_listeners, &[], &none_refused, &[], 0),
        ("every Service was written: all re-read", &one, &no_listeners, &[], &none_refused, &[], 0),
        ("nothing happened: every part kept", &one, &no_listeners, &[], &none_refused, &[], 4),
        ("one Service edited: the others kept", &one, &no_listeners, &[], &none_refused, &["db"], 3),
        ("a node joins: nothing kept", &two, &no_listeners, &[], &none_refused, &[], 0),
        ("a listener on db's port: nothing kept", &two, &in_use, &[], &none_refused, &[], 0),
        ("an endpoint of web refused: the others kept", &two, &in_use, &refused_web, &none_refused, &[], 3),
        ("web re-read after its condition was written", &two, &in_use, &refused_web, &none_refused, &[], 3),
        ("nothing happened: every part kept", &two, &in_use, &refused_web, &none_refused, &[], 4),
        ("node b refuses web: the others kept", &two, &in_use, &refused_web, &b_refuses_web, &[], 3),
        ("web re-read after its condition was written", &two, &in_use, &refused_web, &b_refuses_web, &[], 3),
        ("nothing happened: every part kept", &two, &in_use, &refused_web, &b_refuses_web, &[], 4),
    ];
    let (mut models, mut kept) = (ModelCache::new(), Published::default());
    let mut kept_extra = Published::default();
    let key = |name: &str| ServiceKey::new("default", name);
    let problems = [
        AllocProblem::InUse { service: key("web"), port: PortId::tcp(80), wanted: 22, by: "sshd".into() },
        AllocProblem::InUse { service: key("db"), port: PortId::tcp(80), wanted: 20005, by: "nc".into() },
    ];
    let duplicates =
        [Duplicate { node_port: 20005, keeper: key("db"), loser: key("other"), loser_port: PortId::tcp(80) }];
    let mut last_writes: Vec<ServiceWrite> = vec![];
    for (step, nodes, listening, refused_endpoints, refusals, edited, reused) in steps {
        // What the API server makes of the last round's writes and of the edits: new objects.
        let mut plain: Vec<Service> = services.iter().map(|s| Service::clone(s)).collect();
        apply(&mut plain, &last_writes);
        for (svc, old) in services.iter_mut().zip(plain) {
            let name = svc.metadata.name.clone().unwrap();
            if last_writes.iter().any(|w| *w.key.name == *name) || edited.contains(&name.as_str()) {
                let mut new = old;
                new.metadata.resource_version =
                    Some(format!("{}{}", new.metadata.resource_version.unwrap(), 1));
                if edited.contains(&name.as_str()) {
                    new.metadata.labels = Some([("edited".to_string(), step.to_string())].into());
                }
                *svc = Arc::new(new);
            }
        }
        let out = models.build(crate::domain::Scope::All, &services, &[], &ctx).expect("a whole build");
        let result = crate::decisions::alloc::allocate_with(
            &Default::default(),
            &out.services,
            &Allocations::new(),
            Default::default(),
        );
        let round = Round {
            refused_endpoints,
            listening,
            refusals: Some(refusals),
            ..plain_round(&services, &opts, (&out.services, &out.refused), &result, nodes)
        };
        let (writes, mut events) = plan_services(&round, &[], &mut kept, None);
        assert_eq!(writes, plan_writes(&round), "{step}: writes");
        events.sort();
        assert_eq!(events, service_events(&round, &[]), "{step}: events");
        assert_eq!(kept.reused(), reused, "{step}: parts reused");
        // With the round's own Events too, for the same Services and reasons as their parts'
        // (db's port in use, as the listener on it says in the later steps).
        let with_extra = Round { problems: &problems, ..round };
        let (_, mut events) = plan_services(&with_extra, &duplicates, &mut kept_extra, None);
        events.sort();
        assert_eq!(events, service_events(&with_extra, &duplicates), "{step}: events with the round's");
        last_writes = writes;
    }
}
