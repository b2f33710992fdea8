use super::*;
use crate::decisions::alloc::Allocations;
use crate::inputs::model::{self, LABEL_EXCLUDE_LB, LABEL_SERVICE_NAME, ModelOptions};
use crate::k8s::nodes;
use crate::k8s::publish::{self, Round};
use k8s_openapi::api::core::v1::{LoadBalancerIngress, LoadBalancerStatus};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};
use serde_json::{Value, json};

/// A Service as the API server returns it, with every field nodelb does not read filled in.
fn full_service(name: &str, f: impl FnOnce(&mut Value)) -> Service {
    let mut v = json!({
        "apiVersion": "v1", "kind": "Service",
        "metadata": {
            "name": name, "namespace": "prod", "uid": format!("uid-{name}"), "resourceVersion": "42",
            "generation": 3, "creationTimestamp": "2024-01-02T03:04:05Z",
            "generateName": "web-", "selfLink": "/api/v1/x", "finalizers": ["service.kubernetes.io/load-balancer-cleanup"],
            "labels": {"app": "web", "team": "a"},
            "annotations": {
                "kubectl.kubernetes.io/last-applied-configuration": "{\"a\": \"very long JSON\"}",
                ANNOTATION_ALLOCATED: "80/TCP=20080,53/UDP=20053",
            },
            "ownerReferences": [{"apiVersion": "v1", "kind": "X", "name": "o", "uid": "u"}],
            "managedFields": [{"manager": "kubectl", "operation": "Apply"}]
        },
        "spec": {
            "type": "LoadBalancer", "selector": {"app": "web"}, "sessionAffinity": "ClientIP",
            "sessionAffinityConfig": {"clientIP": {"timeoutSeconds": 10}},
            "externalIPs": ["192.0.2.9"], "loadBalancerIP": "192.0.2.8", "ipFamilyPolicy": "PreferDualStack",
            "clusterIP": "10.0.0.1", "clusterIPs": ["10.0.0.1"], "healthCheckNodePort": 31000,
            "internalTrafficPolicy": "Cluster", "publishNotReadyAddresses": true,
            "ports": [
                {"name": "http", "port": 80, "targetPort": "web", "nodePort": 30080, "protocol": "TCP", "appProtocol": "http"},
                {"name": "dns", "port": 53, "targetPort": 5353, "protocol": "UDP"}
            ]
        },
        "status": {
            "loadBalancer": {"ingress": [{"ip": "192.0.2.1", "ipMode": "Proxy",
                                          "ports": [{"port": 20080, "protocol": "TCP"}]}]},
            "conditions": [{"type": "Other", "status": "True", "reason": "R", "message": "m",
                            "lastTransitionTime": "2024-01-02T03:04:05Z"}]
        }
    });
    f(&mut v);
    serde_json::from_value(v).expect("test Service")
}

fn full_slice(name: &str, service: &str, family: &str, addrs: &[&str]) -> EndpointSlice {
    let endpoints: Vec<Value> = addrs
        .iter()
        .enumerate()
        .map(|(i, a)| {
            json!({
                "addresses": [a], "hostname": format!("pod-{i}"), "nodeName": format!("node-{}", i % 2),
                "zone": "z1", "deprecatedTopology": {"topology.kubernetes.io/zone": "z1"},
                "hints": {"forZones": [{"name": "z1"}]},
                "conditions": {"ready": i != 1, "serving": true, "terminating": i == 1},
                "targetRef": {"kind": "Pod", "name": format!("pod-{i}"), "namespace": "prod", "uid": "p"}
            })
        })
        .collect();
    serde_json::from_value(json!({
            "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
            "metadata": {
                "name": name, "namespace": "prod", "uid": format!("uid-{name}"), "resourceVersion": "7",
                "generateName": format!("{service}-"),
                "labels": {LABEL_SERVICE_NAME: service, "endpointslice.kubernetes.io/managed-by": "x", "app": "web"},
                "annotations": {"endpoints.kubernetes.io/last-change-trigger-time": "2024-01-02T03:04:05Z"},
                "ownerReferences": [{"apiVersion": "v1", "kind": "Service", "name": service, "uid": "u"}]
            },
            "addressType": family,
            "ports": [
                {"name": "http", "port": 8080, "protocol": "TCP", "appProtocol": "http"},
                {"name": "dns", "port": 5353, "protocol": "UDP"}
            ],
            "endpoints": endpoints
        }))
        .expect("test EndpointSlice")
}

fn slimmed<T: Slim + Clone>(objs: &[T]) -> Vec<T> {
    objs.iter()
        .cloned()
        .map(|mut o| {
            o.slim();
            o
        })
        .collect()
}

/// Every kind of input the model reads, each in a full and a slimmed copy: the model, the
/// leader's writes and its Events must come out the same.
#[test]
fn slimmed_objects_give_the_same_model_and_writes() {
    type Mutate = fn(&mut Value);
    let variants: Vec<(&str, Mutate)> = vec![
        ("plain", |_| {}),
        ("local policy, dual stack", |v| {
            v["spec"]["externalTrafficPolicy"] = json!("Local");
            v["spec"]["ipFamilies"] = json!(["IPv4", "IPv6"]);
        }),
        ("families from clusterIPs", |v| v["spec"]["clusterIPs"] = json!(["fd00::1", "10.0.0.1"])),
        ("family from clusterIP", |v| {
            v["spec"]["clusterIPs"] = Value::Null;
            v["spec"]["clusterIP"] = json!("fd00::2");
        }),
        ("source ranges", |v| v["spec"]["loadBalancerSourceRanges"] = json!(["198.51.100.0/24"])),
        ("affinity, default timeout", |v| v["spec"]["sessionAffinityConfig"] = Value::Null),
        ("no affinity", |v| v["spec"]["sessionAffinity"] = json!("None")),
        ("refused: affinity timeout", |v| {
            v["spec"]["sessionAffinityConfig"]["clientIP"]["timeoutSeconds"] = json!(0)
        }),
        ("legacy source ranges", |v| {
            v["metadata"]["annotations"][ANNOTATION_LEGACY_SOURCE_RANGES] = json!("203.0.113.0/24")
        }),
        ("requested ports", |v| v["metadata"]["annotations"][ANNOTATION_PORTS] = json!("80/TCP=20081")),
        ("refused: bad ignore value", |v| v["metadata"]["annotations"][ANNOTATION_IGNORE] = json!("yes")),
        ("opted out", |v| v["metadata"]["annotations"][ANNOTATION_IGNORE] = json!("true")),
        ("other class", |v| v["spec"]["loadBalancerClass"] = json!("other")),
        ("not a load balancer", |v| v["spec"]["type"] = json!("ClusterIP")),
    ];
    let services: Vec<Service> =
        variants.iter().enumerate().map(|(i, (_, f))| full_service(&format!("s{i}"), f)).collect();
    let slices: Vec<EndpointSlice> = (0..variants.len())
        .flat_map(|i| {
            let name = format!("s{i}");
            [
                full_slice(
                    &format!("{name}-4"),
                    &name,
                    "IPv4",
                    &["198.51.100.10", "198.51.100.11", "2001:db8::1"],
                ),
                full_slice(&format!("{name}-6"), &name, "IPv6", &["2001:db8::10"]),
            ]
        })
        .collect();
    let (slim_services, slim_slices) = (slimmed(&services), slimmed(&slices));
    let opts = ModelOptions::default();
    let full = model::build(&services, &slices, &opts);
    let slim = model::build(&slim_services, &slim_slices, &opts);
    assert_eq!(full, slim);
    assert!(
        full.services.len() >= 6 && !full.refused.is_empty(),
        "the variants exercise the model: {full:?}"
    );
    assert!(full.services.iter().any(|s| s.ports.iter().any(|p| !p.endpoints.is_empty())));

    let serving = BTreeMap::new();
    let round = |services: &[Service], out: &model::ModelOutput| {
        let allocations: Allocations =
            crate::decisions::alloc::allocate(&Default::default(), &out.services, &Allocations::new())
                .allocations;
        let round = Round {
            services,
            model: &opts,
            valid: &out.services,
            refused: &out.refused,
            allocations: &allocations,
            problems: &[],
            refused_endpoints: &[],
            listening: &BTreeMap::new(),
            serving: &serving,
            pool_nodes: None,
            pool_addresses: None,
            lost: &[],
            refusals: None,
            now: k8s_openapi::jiff::Timestamp::from_second(1_700_000_000).unwrap(),
        };
        (
            publish::plan_writes(&round),
            publish::service_events(&round, &[]),
            publish::reserved(services, &out.refused),
        )
    };
    let (writes, events, reserved) = round(&services, &full);
    assert!(!writes.is_empty());
    assert_eq!((writes, events, reserved), round(&slim_services, &slim));
}

#[test]
fn slimming_drops_what_is_not_read() {
    let mut svc = full_service("web", |_| {});
    svc.slim();
    let ann: Vec<&String> = svc.metadata.annotations.as_ref().unwrap().keys().collect();
    assert_eq!(ann, [ANNOTATION_ALLOCATED]);
    let m = &svc.metadata;
    // Labels stay: node port pools select Services by them.
    assert_eq!(m.labels.as_ref().map(|l| l.len()), Some(2));
    assert!(m.owner_references.is_none() && m.finalizers.is_none());
    assert!(m.managed_fields.is_none() && m.generate_name.is_none() && m.self_link.is_none());
    assert_eq!(
        (m.uid.as_deref(), m.resource_version.as_deref(), m.generation),
        (Some("uid-web"), Some("42"), Some(3))
    );
    let spec = svc.spec.as_ref().unwrap();
    assert!(spec.selector.is_none() && spec.external_ips.is_none() && spec.load_balancer_ip.is_none());
    assert_eq!(spec.session_affinity.as_deref(), Some("ClientIP"));
    let client_ip = spec.session_affinity_config.as_ref().and_then(|c| c.client_ip.as_ref());
    assert_eq!(client_ip.and_then(|c| c.timeout_seconds), Some(10));
    let ports = spec.ports.as_ref().unwrap();
    assert!(ports.iter().all(|p| p.target_port.is_none() && p.app_protocol.is_none()));
    let node_ports: Vec<Option<i32>> = ports.iter().map(|p| p.node_port).collect();
    assert_eq!(node_ports, [Some(30080), None], "kube-proxy's NodePorts are kept");
    let status = svc.status.as_ref().unwrap();
    let ingress = &status.load_balancer.as_ref().unwrap().ingress.as_ref().unwrap()[0];
    assert_eq!(ingress.ip_mode.as_deref(), Some("Proxy"), "status is written back: kept whole");

    let mut slice = full_slice("web-1", "web", "IPv4", &["198.51.100.1", "198.51.100.2", "198.51.100.3"]);
    slice.slim();
    assert_eq!(slice.service_name.as_deref(), Some("web"));
    assert!(slice.metadata.labels.is_none());
    assert!(slice.metadata.annotations.is_none() && slice.metadata.owner_references.is_none());
    let endpoints = slice.endpoints.as_ref().unwrap();
    assert_eq!(endpoints.capacity(), 3, "no spare capacity");
    // The fields it does not read are not in its type (crate::inputs::compact).
    assert!(endpoints.iter().all(|e| e.node_name.is_some() && e.conditions.is_some()));
    assert_eq!(slice.ports.as_ref().unwrap().capacity(), 2, "no spare capacity");
}

#[test]
fn slimmed_nodes_serve_the_same() {
    let node = |name: &str, excluded: bool| -> Node {
        let mut labels = json!({"kubernetes.io/hostname": name});
        if excluded {
            labels[LABEL_EXCLUDE_LB] = json!("");
        }
        let deleted = (name == "d").then_some("2024-01-02T03:04:05Z");
        serde_json::from_value(json!({
                "metadata": {"name": name, "uid": "u", "labels": labels, "annotations": {"a": "b"},
                             "deletionTimestamp": deleted},
                "spec": {"podCIDR": "10.244.0.0/24", "taints": [{"key": "k", "effect": "NoSchedule"}]},
                "status": {
                    "addresses": [{"type": "InternalIP", "address": "192.0.2.1"}, {"type": "ExternalIP", "address": "203.0.113.1"},
                                  {"type": "InternalIP", "address": "2001:db8::1"}, {"type": "Hostname", "address": name}],
                    "images": [{"names": ["registry.example/some/very/long/image@sha256:0123"], "sizeBytes": 1}],
                    "conditions": [{"type": "Ready", "status": "True"}],
                    "capacity": {"cpu": "2"}
                }
            }))
            .unwrap()
    };
    // b is excluded, d is being deleted.
    let all = vec![node("a", false), node("b", true), node("c", false), node("d", false)];
    let leases: Vec<Lease> = ["a", "b", "c", "d"]
            .iter()
            .map(|n| {
                serde_json::from_value(json!({
                    "metadata": {"name": nodes::node_lease_name(n), "annotations": {nodes::ANNOTATION_FAMILIES: "ipv4,ipv6"}},
                    "spec": {"holderIdentity": n, "renewTime": "2023-11-14T22:13:20.000000Z", "leaseDurationSeconds": 15}
                }))
                .unwrap()
            })
            .collect();
    let slim = slimmed(&all);
    let (full_serving, slim_serving) =
        (nodes::serving_nodes(&all, &leases, None, &[]), nodes::serving_nodes(&slim, &leases, None, &[]));
    assert_eq!(full_serving.len(), 2, "{full_serving:?}");
    assert_eq!(full_serving, slim_serving);
    let status = slim[0].status.as_ref().unwrap();
    assert!(status.images.is_none() && status.conditions.is_none() && slim[0].spec.is_none());
    // Labels stay (pools' nodeSelector); annotations go.
    assert!(slim[0].metadata.labels.is_some() && slim[0].metadata.annotations.is_none());
}

/// The node's view ignores what only the leader's status write changes, and follows
/// everything else a node reads; [`same_for_node`] says what the hash says.
#[test]
fn node_view_follows_what_a_node_reads() {
    let base = || {
        let mut s = full_service("web", |_| {});
        s.slim();
        s
    };
    let condition = |status: &str, message: &str| Condition {
        type_: model::CONDITION_ALLOCATED.into(),
        status: status.into(),
        reason: "R".into(),
        message: message.into(),
        last_transition_time: Time(k8s_openapi::jiff::Timestamp::UNIX_EPOCH),
        observed_generation: None,
    };
    let set_conditions = |s: &mut Service, cs: Vec<Condition>| {
        s.status.get_or_insert_default().conditions = Some(cs);
    };
    let h0 = node_view_hash(&base());
    type Edit = Box<dyn Fn(&mut Service)>;
    let same: Vec<(&str, Edit)> = vec![
        ("resourceVersion", Box::new(|s| s.metadata.resource_version = Some("43".into()))),
        (
            "ingress",
            Box::new(|s| {
                s.status.get_or_insert_default().load_balancer = Some(LoadBalancerStatus {
                    ingress: Some(vec![LoadBalancerIngress {
                        ip: Some("192.0.2.9".into()),
                        ip_mode: Some("Proxy".into()),
                        ..Default::default()
                    }]),
                })
            }),
        ),
        ("Allocated True", Box::new(move |s| set_conditions(s, vec![condition("True", "ok")]))),
    ];
    for (name, change) in same {
        let mut s = base();
        change(&mut s);
        assert_eq!(node_view_hash(&s), h0, "{name}");
        assert!(same_for_node(&s, &base()) && same_for_node(&base(), &s), "{name}");
    }
    let refused = |m: &'static str| move |s: &mut Service| set_conditions(s, vec![condition("False", m)]);
    let mut refused_a = base();
    refused("no port")(&mut refused_a);
    let differ: Vec<(&str, Edit)> = vec![
        ("uid", Box::new(|s| s.metadata.uid = Some("other".into()))),
        ("generation", Box::new(|s| s.metadata.generation = Some(4))),
        (
            "label",
            Box::new(|s| {
                s.metadata.labels.get_or_insert_default().insert("team".into(), "b".into());
            }),
        ),
        (
            "annotation",
            Box::new(|s| {
                s.metadata
                    .annotations
                    .get_or_insert_default()
                    .insert(ANNOTATION_ALLOCATED.into(), "80/TCP=20081".into());
            }),
        ),
        (
            "deletion",
            Box::new(|s| {
                s.metadata.deletion_timestamp = Some(Time(k8s_openapi::jiff::Timestamp::UNIX_EPOCH))
            }),
        ),
        ("spec", Box::new(|s| s.spec.as_mut().unwrap().external_traffic_policy = Some("Local".into()))),
        ("Allocated False", Box::new(refused("no port"))),
        (
            "another load balancer's ingress",
            Box::new(|s| {
                s.status.get_or_insert_default().load_balancer = Some(LoadBalancerStatus {
                    ingress: Some(vec![LoadBalancerIngress {
                        ip: Some("198.51.100.200".into()),
                        ..Default::default()
                    }]),
                })
            }),
        ),
    ];
    for (name, change) in differ {
        let mut s = base();
        change(&mut s);
        assert_ne!(node_view_hash(&s), h0, "{name}");
        assert!(!same_for_node(&s, &base()) && !same_for_node(&base(), &s), "{name}");
    }
    let mut refused_b = base();
    refused("range exhausted")(&mut refused_b);
    assert_ne!(node_view_hash(&refused_a), node_view_hash(&refused_b), "the refusal's message");
    assert!(!same_for_node(&refused_a, &refused_b), "the refusal's message");
    assert!(same_for_node(&refused_a, &refused_a.clone()));
}
