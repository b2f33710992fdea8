use super::*;
use serde_json::{Value, json};

type Mutate = Box<dyn Fn(&mut Value)>;

fn svc_with(name: &str, f: impl FnOnce(&mut Value)) -> Service {
    let mut v = json!({
        "apiVersion": "v1", "kind": "Service",
        "metadata": {"name": name, "namespace": "default", "annotations": {}},
        "spec": {"type": "LoadBalancer", "ports": [{"port": 80, "protocol": "TCP", "targetPort": 8080}]}
    });
    f(&mut v);
    serde_json::from_value(v).expect("test Service")
}

/// Which Services are nodelb's: type, class, opt-out, and for those without a class, no
/// other load balancer's status or annotation.
#[test]
fn services_another_load_balancer_has_are_not_ours() {
    let opts = ModelOptions::default();
    let ignoring = ModelOptions { ignore_unclassed: true, ..ModelOptions::default() };
    type Case = (&'static str, fn(&mut Value), bool, bool);
    let cases: [Case; 9] = [
        ("plain", |_| {}, true, false),
        ("not a load balancer", |v| v["spec"]["type"] = json!("ClusterIP"), false, false),
        ("our class", |v| v["spec"]["loadBalancerClass"] = json!(DEFAULT_LB_CLASS), true, true),
        ("another class", |v| v["spec"]["loadBalancerClass"] = json!("metallb.io/metallb"), false, false),
        (
            "our own status",
            |v| {
                v["status"] = json!({"loadBalancer": {"ingress": [{"ip": "203.0.113.1", "ipMode": "Proxy"}]}})
            },
            true,
            false,
        ),
        (
            "MetalLB's status",
            |v| v["status"] = json!({"loadBalancer": {"ingress": [{"ip": "198.51.100.200"}]}}),
            false,
            false,
        ),
        (
            "a cloud's hostname",
            |v| v["status"] = json!({"loadBalancer": {"ingress": [{"hostname": "x.elb.amazonaws.com", "ipMode": "Proxy"}]}}),
            false,
            false,
        ),
        (
            "an AWS annotation",
            |v| {
                v["metadata"]["annotations"]["service.beta.kubernetes.io/aws-load-balancer-internal"] =
                    json!("true")
            },
            false,
            false,
        ),
        (
            "our class wins over another's status",
            |v| {
                v["spec"]["loadBalancerClass"] = json!(DEFAULT_LB_CLASS);
                v["status"] = json!({"loadBalancer": {"ingress": [{"ip": "198.51.100.200"}]}});
            },
            true,
            true,
        ),
    ];
    for (name, f, ours, ours_ignoring) in cases {
        let svc = svc_with("web", f);
        assert_eq!(is_ours(&svc, &opts), ours, "{name}");
        assert_eq!(is_ours(&svc, &ignoring), ours_ignoring, "{name} (--ignore-unclassed)");
    }
    let msg = another_load_balancer(&svc_with("web", |v| {
        v["status"] = json!({"loadBalancer": {"ingress": [{"ip": "198.51.100.200"}]}})
    }));
    assert_eq!(
        msg.as_deref(),
        Some("its status already has the ingress \"198.51.100.200\" of another load balancer")
    );
}

fn slice(name: &str, service: &str, v: Value) -> EndpointSlice {
    let mut base = json!({
        "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
        "metadata": {"name": name, "namespace": "default", "labels": {LABEL_SERVICE_NAME: service}},
        "addressType": "IPv4", "endpoints": [], "ports": []
    });
    if let (Some(b), Some(o)) = (base.as_object_mut(), v.as_object()) {
        for (k, val) in o {
            b.insert(k.clone(), val.clone());
        }
    }
    serde_json::from_value(base).expect("test EndpointSlice")
}

fn key(name: &str) -> ServiceKey {
    ServiceKey::new("default", name)
}

fn tcp(port: u16) -> PortId {
    PortId::tcp(port)
}

fn udp(port: u16) -> PortId {
    PortId::udp(port)
}

fn one(svc: Service) -> Result<LbService, Refusal> {
    let out = build(&[svc], NO_SLICES, &ModelOptions::default());
    match (out.services.into_iter().next(), out.refused.into_iter().next()) {
        (Some(s), None) => Ok(s),
        (None, Some(r)) => Err(r),
        other => panic!("expected exactly one result, got {other:?}"),
    }
}

/// Where a Service stands with the leader's decision: the decision (an allocation annotation,
/// even empty, or an `Allocated=False` condition) whatever the Service is now; else
/// undecided when nodelb's ([`is_ours`]), and not nodelb's otherwise.
#[test]
fn standing() {
    let annotated =
        |v: &mut Value| v["metadata"]["annotations"][ANNOTATION_ALLOCATED] = json!("80/TCP=20080");
    let refused = |v: &mut Value| {
        v["status"] = json!({"conditions": [{"type": CONDITION_ALLOCATED, "status": "False", "reason": "R",
                "message": "m", "lastTransitionTime": "2024-01-02T03:04:05Z"}]})
    };
    let cases: Vec<(&str, Mutate, Standing)> = vec![
        ("a LoadBalancer", Box::new(|_| {}), Standing::Undecided),
        ("allocated", Box::new(annotated), Standing::Decided),
        (
            "allocated nothing (an empty annotation)",
            Box::new(|v| v["metadata"]["annotations"][ANNOTATION_ALLOCATED] = json!("")),
            Standing::Decided,
        ),
        ("refused by the leader", Box::new(refused), Standing::Decided),
        (
            "allocated, then not refused",
            Box::new(move |v| {
                refused(v);
                v["status"]["conditions"][0]["status"] = json!("True");
            }),
            Standing::Undecided,
        ),
        ("a ClusterIP", Box::new(|v| v["spec"]["type"] = json!("ClusterIP")), Standing::NotOurs),
        (
            "a ClusterIP still annotated",
            Box::new(move |v| {
                annotated(v);
                v["spec"]["type"] = json!("ClusterIP");
            }),
            Standing::Decided,
        ),
        (
            "another class",
            Box::new(|v| v["spec"]["loadBalancerClass"] = json!("other.io/lb")),
            Standing::NotOurs,
        ),
        (
            "opted out",
            Box::new(|v| v["metadata"]["annotations"][ANNOTATION_IGNORE] = json!("true")),
            Standing::NotOurs,
        ),
        (
            "opted out, still annotated",
            Box::new(move |v| {
                annotated(v);
                v["metadata"]["annotations"][ANNOTATION_IGNORE] = json!("true");
            }),
            Standing::Decided,
        ),
    ];
    for (name, f, want) in cases {
        assert_eq!(Standing::of(&svc_with("web", f), &ModelOptions::default()), want, "{name}");
    }
}

#[test]
fn selection() {
    let cases: Vec<(&str, Mutate, ModelOptions, bool)> = vec![
        ("plain LoadBalancer", Box::new(|_| {}), ModelOptions::default(), true),
        ("ClusterIP", Box::new(|v| v["spec"]["type"] = json!("ClusterIP")), ModelOptions::default(), false),
        ("NodePort", Box::new(|v| v["spec"]["type"] = json!("NodePort")), ModelOptions::default(), false),
        ("no type", Box::new(|v| v["spec"]["type"] = Value::Null), ModelOptions::default(), false),
        (
            "our class",
            Box::new(|v| v["spec"]["loadBalancerClass"] = json!(DEFAULT_LB_CLASS)),
            ModelOptions::default(),
            true,
        ),
        (
            "other class",
            Box::new(|v| v["spec"]["loadBalancerClass"] = json!("metallb.io/metallb")),
            ModelOptions::default(),
            false,
        ),
        (
            "unclassed ignored by flag",
            Box::new(|_| {}),
            ModelOptions { ignore_unclassed: true, ..ModelOptions::default() },
            false,
        ),
        (
            "our class with ignore_unclassed",
            Box::new(|v| v["spec"]["loadBalancerClass"] = json!("x/y")),
            ModelOptions { lb_class: "x/y".into(), ignore_unclassed: true, servicelb_labels: true },
            true,
        ),
        (
            "opted out",
            Box::new(|v| v["metadata"]["annotations"][ANNOTATION_IGNORE] = json!("true")),
            ModelOptions::default(),
            false,
        ),
        (
            "ignore=false",
            Box::new(|v| v["metadata"]["annotations"][ANNOTATION_IGNORE] = json!("false")),
            ModelOptions::default(),
            true,
        ),
        (
            "ignore=\" TRUE \" (case and blanks)",
            Box::new(|v| v["metadata"]["annotations"][ANNOTATION_IGNORE] = json!(" TRUE ")),
            ModelOptions::default(),
            false,
        ),
        (
            "not ours even when invalid",
            Box::new(|v| {
                v["spec"]["type"] = json!("ClusterIP");
                v["spec"]["loadBalancerSourceRanges"] = json!(["nope"]);
            }),
            ModelOptions::default(),
            false,
        ),
    ];
    for (name, f, opts, ours) in cases {
        let out = build(&[svc_with("web", f)], NO_SLICES, &opts);
        assert_eq!(out.services.len(), usize::from(ours), "{name}");
        assert!(out.refused.is_empty(), "{name}: {:?}", out.refused);
    }
}

#[test]
fn refusals() {
    // (case, mutation, expected Refusal variant name, substring of its Display)
    type Case = (&'static str, Box<dyn Fn(&mut Value)>, &'static str, &'static str);
    let cases: Vec<Case> = vec![
        ("no ports", Box::new(|v| v["spec"]["ports"] = json!([])), "Invalid", "spec.ports is empty"),
        (
            "bad protocol",
            Box::new(|v| v["spec"]["ports"][0]["protocol"] = json!("ICMP")),
            "InvalidPort",
            "\"ICMP\"",
        ),
        ("port 0", Box::new(|v| v["spec"]["ports"][0]["port"] = json!(0)), "InvalidPort", "port number 0"),
        ("port 70000", Box::new(|v| v["spec"]["ports"][0]["port"] = json!(70000)), "InvalidPort", "70000"),
        ("negative port", Box::new(|v| v["spec"]["ports"][0]["port"] = json!(-1)), "InvalidPort", "-1"),
        (
            "duplicate port",
            Box::new(|v| {
                v["spec"]["ports"] =
                    json!([{"name": "a", "port": 80}, {"name": "b", "port": 80, "protocol": "TCP"}])
            }),
            "InvalidPort",
            "duplicate port 80/TCP",
        ),
        (
            "duplicate name",
            Box::new(|v| v["spec"]["ports"] = json!([{"name": "a", "port": 80}, {"name": "a", "port": 81}])),
            "InvalidPort",
            "duplicate port name",
        ),
        (
            "two unnamed",
            Box::new(|v| v["spec"]["ports"] = json!([{"port": 80}, {"port": 81}])),
            "InvalidPort",
            "more than one unnamed",
        ),
        (
            "bad ip family",
            Box::new(|v| v["spec"]["ipFamilies"] = json!(["IPv4", "IPv5"])),
            "InvalidIpFamily",
            "\"IPv5\"",
        ),
        (
            "bad traffic policy",
            Box::new(|v| v["spec"]["externalTrafficPolicy"] = json!("Nearby")),
            "InvalidTrafficPolicy",
            "\"Nearby\"",
        ),
        (
            "bad source range",
            Box::new(|v| v["spec"]["loadBalancerSourceRanges"] = json!(["10.0.0.0/8", "10.0.0.0/33"])),
            "InvalidSourceRange",
            "\"10.0.0.0/33\"",
        ),
        (
            "garbage source range",
            Box::new(|v| v["spec"]["loadBalancerSourceRanges"] = json!(["office"])),
            "InvalidSourceRange",
            "\"office\"",
        ),
        (
            "empty source range",
            Box::new(|v| v["spec"]["loadBalancerSourceRanges"] = json!([""])),
            "InvalidSourceRange",
            "empty entry",
        ),
        (
            "bad legacy source range annotation",
            Box::new(|v| {
                v["metadata"]["annotations"][ANNOTATION_LEGACY_SOURCE_RANGES] = json!("10.0.0.0/8,x")
            }),
            "InvalidAnnotation",
            "entry \"x\"",
        ),
        (
            "ignore annotation neither true nor false",
            Box::new(|v| v["metadata"]["annotations"][ANNOTATION_IGNORE] = json!("yes")),
            "InvalidAnnotation",
            "nodelb.io/ignore=\"yes\"",
        ),
        (
            "ports annotation syntax",
            Box::new(|v| v["metadata"]["annotations"][ANNOTATION_PORTS] = json!("80/TCP:20080")),
            "InvalidAnnotation",
            "nodelb.io/ports=\"80/TCP:20080\"",
        ),
        (
            "ports annotation unknown service port",
            Box::new(|v| v["metadata"]["annotations"][ANNOTATION_PORTS] = json!("443/TCP=20443")),
            "InvalidAnnotation",
            "names no port of the Service",
        ),
        (
            "ports annotation wrong protocol",
            Box::new(|v| v["metadata"]["annotations"][ANNOTATION_PORTS] = json!("80/UDP=20080")),
            "InvalidAnnotation",
            "names no port",
        ),
        (
            "ports annotation node port 0",
            Box::new(|v| v["metadata"]["annotations"][ANNOTATION_PORTS] = json!("80/TCP=0")),
            "InvalidAnnotation",
            "out of range",
        ),
        (
            "ports annotation node port too big",
            Box::new(|v| v["metadata"]["annotations"][ANNOTATION_PORTS] = json!("80/TCP=65536")),
            "InvalidAnnotation",
            "out of range",
        ),
        (
            "ports annotation bad protocol",
            Box::new(|v| v["metadata"]["annotations"][ANNOTATION_PORTS] = json!("80/XYZ=20080")),
            "InvalidAnnotation",
            "unknown protocol",
        ),
        (
            "ports annotation twice",
            Box::new(|v| v["metadata"]["annotations"][ANNOTATION_PORTS] = json!("80/TCP=20080,80=20081")),
            "InvalidAnnotation",
            "more than once",
        ),
        (
            "ports annotation same node port twice",
            Box::new(|v| {
                v["spec"]["ports"] = json!([{"name": "a", "port": 80}, {"name": "b", "port": 81}]);
                v["metadata"]["annotations"][ANNOTATION_PORTS] = json!("80/TCP=20080,81/TCP=20080");
            }),
            "InvalidAnnotation",
            "both ask for node port 20080/TCP",
        ),
        ("no name", Box::new(|v| v["metadata"]["name"] = json!("")), "Invalid", "metadata.name is empty"),
    ];
    for (name, f, variant, needle) in cases {
        let refusal = match one(svc_with("web", f)) {
            Err(r) => r,
            Ok(s) => panic!("{name}: expected refusal, got {s:?}"),
        };
        let debug = format!("{refusal:?}");
        assert!(debug.starts_with(&format!("{variant} ")), "{name}: wrong variant: {debug}");
        let text = refusal.to_string();
        assert!(text.contains(needle), "{name}: {text:?} lacks {needle:?}");
        assert!(text.contains("Service default/"), "{name}: {text:?} does not name the Service");
    }
}

#[test]
fn accepted_values() {
    let s = one(svc_with("web", |v| {
        v["spec"]["ports"] = json!([
            {"name": "dns", "port": 53, "protocol": "UDP"},
            {"name": "dns-tcp", "port": 53},
            {"name": "sctp", "port": 9, "protocol": "SCTP"}
        ]);
        v["spec"]["ipFamilies"] = json!(["IPv6", "IPv4", "IPv6"]);
        v["spec"]["externalTrafficPolicy"] = json!("Local");
        v["spec"]["loadBalancerSourceRanges"] =
            json!(["10.1.2.3/8", " 192.0.2.7 ", "2001:db8::1", "10.0.0.0/8", "2001:db8:1::5/48"]);
        v["metadata"]["creationTimestamp"] = json!("2024-05-06T07:08:09Z");
        v["metadata"]["uid"] = json!("u-1");
    }))
    .expect("valid");
    assert_eq!(
        s.ports.iter().map(|p| p.id).collect::<Vec<_>>(),
        vec![udp(53), tcp(53), PortId { port: 9, protocol: Protocol::Sctp }]
    );
    assert_eq!(s.families, vec![Family::Ipv6, Family::Ipv4]);
    assert_eq!(s.traffic_policy, TrafficPolicy::Local);
    let ranges: Vec<String> = s.source_ranges.iter().map(|n| n.to_string()).collect();
    assert_eq!(ranges, vec!["10.0.0.0/8", "192.0.2.7/32", "2001:db8::1/128", "2001:db8:1::/48"]);
    assert_eq!(s.created.map(|t| t.to_string()).as_deref(), Some("2024-05-06T07:08:09Z"));
    assert_eq!(s.uid.as_deref(), Some("u-1"));
    assert_eq!(s.port_request, PortRequest::Auto);
}

#[test]
fn families_and_policy_defaults() {
    let cases: Vec<(&str, Mutate, Vec<Family>, TrafficPolicy)> = vec![
        ("defaults", Box::new(|_| {}), vec![Family::Ipv4], TrafficPolicy::Cluster),
        (
            "clusterIPs v6",
            Box::new(|v| v["spec"]["clusterIPs"] = json!(["fd00::10"])),
            vec![Family::Ipv6],
            TrafficPolicy::Cluster,
        ),
        (
            "clusterIPs dual",
            Box::new(|v| v["spec"]["clusterIPs"] = json!(["fd00::10", "10.96.0.10"])),
            vec![Family::Ipv6, Family::Ipv4],
            TrafficPolicy::Cluster,
        ),
        (
            "clusterIP only",
            Box::new(|v| v["spec"]["clusterIP"] = json!("fd00::1")),
            vec![Family::Ipv6],
            TrafficPolicy::Cluster,
        ),
        (
            "headless clusterIP",
            Box::new(|v| v["spec"]["clusterIP"] = json!("None")),
            vec![Family::Ipv4],
            TrafficPolicy::Cluster,
        ),
        (
            "ipFamilies wins over clusterIPs",
            Box::new(|v| {
                v["spec"]["ipFamilies"] = json!(["IPv4"]);
                v["spec"]["clusterIPs"] = json!(["fd00::10"]);
            }),
            vec![Family::Ipv4],
            TrafficPolicy::Cluster,
        ),
        (
            "Global is Cluster",
            Box::new(|v| v["spec"]["externalTrafficPolicy"] = json!("Global")),
            vec![Family::Ipv4],
            TrafficPolicy::Cluster,
        ),
        (
            "empty policy",
            Box::new(|v| v["spec"]["externalTrafficPolicy"] = json!("")),
            vec![Family::Ipv4],
            TrafficPolicy::Cluster,
        ),
    ];
    for (name, f, families, policy) in cases {
        let s = one(svc_with("web", f)).unwrap_or_else(|r| panic!("{name}: {r}"));
        assert_eq!(s.families, families, "{name}");
        assert_eq!(s.traffic_policy, policy, "{name}");
    }
}

/// `sessionAffinity` and its timeout: defaults and bounds as the API server's, a bad value
/// refused naming the field and the value.
#[test]
fn session_affinity() {
    /// The affinity timeout, or the refusal's text.
    type Want = Result<Option<u32>, &'static str>;
    #[rustfmt::skip]
        let cases: Vec<(&str, Value, Want)> = vec![
            ("unset", json!({}), Ok(None)),
            ("None", json!({"sessionAffinity": "None"}), Ok(None)),
            ("None with a config (unused)", json!({"sessionAffinity": "None", "sessionAffinityConfig": {"clientIP": {"timeoutSeconds": 5}}}), Ok(None)),
            ("ClientIP, default timeout", json!({"sessionAffinity": "ClientIP"}), Ok(Some(10_800))),
            ("ClientIP, empty config", json!({"sessionAffinity": "ClientIP", "sessionAffinityConfig": {}}), Ok(Some(10_800))),
            ("ClientIP, 1 s", json!({"sessionAffinity": "ClientIP", "sessionAffinityConfig": {"clientIP": {"timeoutSeconds": 1}}}), Ok(Some(1))),
            ("ClientIP, one day", json!({"sessionAffinity": "ClientIP", "sessionAffinityConfig": {"clientIP": {"timeoutSeconds": 86400}}}), Ok(Some(86_400))),
            ("timeout 0", json!({"sessionAffinity": "ClientIP", "sessionAffinityConfig": {"clientIP": {"timeoutSeconds": 0}}}), Err("Service default/web: invalid spec.sessionAffinityConfig.clientIP.timeoutSeconds \"0\": must be between 1 and 86400 seconds")),
            ("timeout over a day", json!({"sessionAffinity": "ClientIP", "sessionAffinityConfig": {"clientIP": {"timeoutSeconds": 86401}}}), Err("Service default/web: invalid spec.sessionAffinityConfig.clientIP.timeoutSeconds \"86401\": must be between 1 and 86400 seconds")),
            ("negative timeout", json!({"sessionAffinity": "ClientIP", "sessionAffinityConfig": {"clientIP": {"timeoutSeconds": -5}}}), Err("Service default/web: invalid spec.sessionAffinityConfig.clientIP.timeoutSeconds \"-5\": must be between 1 and 86400 seconds")),
            ("unknown kind", json!({"sessionAffinity": "Cookie"}), Err("Service default/web: invalid spec.sessionAffinity \"Cookie\": supported values are \"None\" and \"ClientIP\"")),
            ("wrong case", json!({"sessionAffinity": "clientip"}), Err("Service default/web: invalid spec.sessionAffinity \"clientip\": supported values are \"None\" and \"ClientIP\"")),
        ];
    for (name, fields, want) in cases {
        let got = one(svc_with("web", |v| {
            for (k, val) in fields.as_object().unwrap() {
                v["spec"][k] = val.clone();
            }
        }));
        match (got, want) {
            (Ok(s), Ok(w)) => assert_eq!(s.session_affinity, w, "{name}"),
            (Err(r), Err(w)) => {
                assert_eq!(r.to_string(), w, "{name}");
                assert_eq!(r.code(), "invalid_session_affinity", "{name}");
            }
            (got, want) => panic!("{name}: got {got:?}, want {want:?}"),
        }
    }
}

#[test]
fn source_range_legacy_annotation() {
    let s = one(svc_with("web", |v| {
        v["metadata"]["annotations"][ANNOTATION_LEGACY_SOURCE_RANGES] =
            json!("192.0.2.0/24, 198.51.100.0/24,")
    }))
    .expect("valid");
    assert_eq!(s.source_ranges.len(), 2);
    // The spec field wins over the annotation.
    let s = one(svc_with("web", |v| {
        v["metadata"]["annotations"][ANNOTATION_LEGACY_SOURCE_RANGES] = json!("garbage");
        v["spec"]["loadBalancerSourceRanges"] = json!(["192.0.2.0/24"]);
    }))
    .expect("valid");
    assert_eq!(s.source_ranges, vec!["192.0.2.0/24".parse::<IpNet>().expect("net")]);
}

#[test]
fn port_requests() {
    let two = |v: &mut Value| {
        v["spec"]["ports"] = json!([
            {"name": "http", "port": 80},
            {"name": "dns", "port": 53, "protocol": "UDP"},
            {"name": "dns-tcp", "port": 53, "protocol": "TCP"}
        ])
    };
    let cases: Vec<(&str, &str, PortRequest)> = vec![
        ("service", "service", PortRequest::ServicePorts),
        ("Service upper", " Service ", PortRequest::ServicePorts),
        ("empty", "", PortRequest::Auto),
        ("explicit", "80/TCP=20080", PortRequest::Explicit(BTreeMap::from([(tcp(80), 20080)]))),
        (
            "no protocol covers both",
            "53=20053, 80/tcp=20080,",
            PortRequest::Explicit(BTreeMap::from([(tcp(53), 20053), (udp(53), 20053), (tcp(80), 20080)])),
        ),
        (
            "same node port, different protocol",
            "53/UDP=20053,80/TCP=20053",
            PortRequest::Explicit(BTreeMap::from([(udp(53), 20053), (tcp(80), 20053)])),
        ),
    ];
    for (name, value, want) in cases {
        let s = one(svc_with("web", |v| {
            two(v);
            v["metadata"]["annotations"][ANNOTATION_PORTS] = json!(value);
        }))
        .unwrap_or_else(|r| panic!("{name}: {r}"));
        assert_eq!(s.port_request, want, "{name}");
    }
}

#[test]
fn previous_allocation_annotation() {
    let svc = svc_with("web", |v| {
        v["spec"]["ports"] =
            json!([{"name": "http", "port": 80}, {"name": "dns", "port": 53, "protocol": "UDP"}]);
        v["metadata"]["annotations"][ANNOTATION_ALLOCATED] =
            json!("80/TCP=20001,53/UDP=x,443/TCP=20002,bogus");
    });
    let out = build(&[svc], NO_SLICES, &ModelOptions::default());
    assert!(out.refused.is_empty());
    assert_eq!(out.services[0].previous_allocation, BTreeMap::from([(tcp(80), 20001)]));
    // One warning for the annotation, naming the first bad entry and counting the others.
    assert_eq!(out.warnings.len(), 1, "{:?}", out.warnings);
    let w = out.warnings[0].to_string();
    assert!(w.contains("nodelb.io/allocated-ports") && w.contains("\"53/UDP=x\""), "{w}");
    assert!(w.ends_with("(and 1 more bad entries)"), "{w}");
}

#[test]
fn duplicate_service_objects() {
    let out = build(&[svc_with("web", |_| {}), svc_with("web", |_| {})], NO_SLICES, &ModelOptions::default());
    assert_eq!(out.services.len(), 1);
    assert_eq!(out.refused.len(), 1);
}

/// Namespaces and names that are not DNS-1123 labels are refused with a reason naming the
/// field and the value, while a valid Service next to them is served.
#[test]
fn invalid_names_are_refused() {
    let long = "x".repeat(64);
    // (case, namespace, name, substring of the reason)
    let cases: Vec<(&str, &str, &str, String)> = vec![
        ("slash in name", "default", "a/b", r#"metadata.name "a/b" contains '/'"#.into()),
        ("slash in namespace", "a/b", "web", r#"metadata.namespace "a/b" contains '/'"#.into()),
        ("NUL in name", "default", "a\0b", r#"metadata.name "a\0b" contains '\0'"#.into()),
        ("newline", "default", "a\nb", r#"contains '\n'"#.into()),
        ("uppercase", "default", "Web", r#"metadata.name "Web" contains 'W'"#.into()),
        ("dot", "default", "a.b", "contains '.'".into()),
        ("space", "default", "a b", "contains ' '".into()),
        ("non-ASCII", "default", "wéb", "contains 'é'".into()),
        ("leading dash", "default", "-web", "starts or ends with '-'".into()),
        ("trailing dash", "dev-", "web", r#"metadata.namespace "dev-" starts or ends"#.into()),
        ("64 bytes", "default", &long, format!("{long:?} is 64 bytes long")),
    ];
    for (case, ns, name, needle) in &cases {
        let bad = svc_with(name, |v| v["metadata"]["namespace"] = json!(ns));
        let out = build(&[bad, svc_with("web", |_| {})], NO_SLICES, &ModelOptions::default());
        assert_eq!(out.services.len(), 1, "{case}: the valid Service is still served");
        let reason = match out.refused.as_slice() {
            [r] => r.to_string(),
            other => panic!("{case}: want one refusal, got {other:?}"),
        };
        assert!(reason.contains(needle.as_str()), "{case}: {reason:?} lacks {needle:?}");
    }
    // Accepted: the longest label, digits (also leading: we accept DNS-1123, not only 1035).
    for (ns, name) in [
        ("default".to_string(), "x".repeat(63)),
        ("n".repeat(63), "a-1".into()),
        ("0ns".into(), "9web".into()),
    ] {
        let out = build(
            &[svc_with(&name, |v| v["metadata"]["namespace"] = json!(ns))],
            NO_SLICES,
            &ModelOptions::default(),
        );
        assert_eq!(out.services.len(), 1, "{ns}/{name}: {:?}", out.refused);
    }
}

#[test]
fn parse_keys() {
    assert_eq!("a/b".parse::<ServiceKey>(), Ok(key_ns("a", "b")));
    for bad in ["", "a", "/b", "a/", "a/b/c", "default/a/b", "Default/web", "default/a b", "default/a\0b"] {
        assert!(bad.parse::<ServiceKey>().is_err(), "{bad}");
    }
    assert_eq!("80/tcp".parse::<PortId>(), Ok(tcp(80)));
    for bad in ["80", "0/TCP", "80/ICMP", "x/TCP", "65536/UDP"] {
        assert!(bad.parse::<PortId>().is_err(), "{bad}");
    }
    let map = BTreeMap::from([(tcp(80), 20001), (udp(53), 20002)]);
    assert_eq!(format_port_map(&map), "53/UDP=20002,80/TCP=20001");
}

fn key_ns(ns: &str, name: &str) -> ServiceKey {
    ServiceKey { namespace: ns.into(), name: name.into() }
}

fn ep(addr: &str, port: u16, ready: bool, serving: bool, terminating: bool) -> Endpoint {
    Endpoint {
        addr: addr.parse().expect("addr"),
        port,
        node_name: Some("node-1".into()),
        ready,
        serving,
        terminating,
    }
}

fn endpoints_of(
    svc: Service,
    slices: &[EndpointSlice],
) -> (BTreeMap<PortId, Vec<Endpoint>>, Vec<ModelWarning>) {
    let out = build(&[svc], slices, &ModelOptions::default());
    assert!(out.refused.is_empty(), "{:?}", out.refused);
    let s = &out.services[0];
    (s.ports.iter().map(|p| (p.id, p.endpoints.clone())).collect(), out.warnings)
}

#[test]
fn endpoint_resolution() {
    let node = json!("node-1");
    let multi = |v: &mut Value| {
        v["spec"]["ports"] = json!([
            {"name": "http", "port": 80, "targetPort": "web"},
            {"name": "dns", "port": 53, "protocol": "UDP", "targetPort": 5353}
        ]);
    };
    type Case = (&'static str, Box<dyn Fn(&mut Value)>, Vec<EndpointSlice>, Vec<(PortId, Vec<Endpoint>)>);
    let cases: Vec<Case> = vec![
        (
            "single unnamed port",
            Box::new(|_| {}),
            vec![slice(
                "web-1",
                "web",
                json!({
                    "ports": [{"port": 8080, "protocol": "TCP"}],
                    "endpoints": [
                        {"addresses": ["198.51.100.12"], "nodeName": node},
                        {"addresses": ["198.51.100.11"], "nodeName": node, "conditions": {"ready": true}}
                    ]
                }),
            )],
            vec![(
                tcp(80),
                vec![
                    ep("198.51.100.11", 8080, true, true, false),
                    ep("198.51.100.12", 8080, true, true, false),
                ],
            )],
        ),
        (
            "unnamed with empty name and nil protocol",
            Box::new(|_| {}),
            vec![slice(
                "web-1",
                "web",
                json!({
                    "ports": [{"name": "", "port": 8080}],
                    "endpoints": [{"addresses": ["198.51.100.11"], "nodeName": node}]
                }),
            )],
            vec![(tcp(80), vec![ep("198.51.100.11", 8080, true, true, false)])],
        ),
        (
            "named ports resolve by name and protocol",
            Box::new(multi),
            vec![slice(
                "web-1",
                "web",
                json!({
                    "ports": [{"name": "http", "port": 8081, "protocol": "TCP"}, {"name": "dns", "port": 5353, "protocol": "UDP"},
                              {"name": "dns", "port": 9999, "protocol": "TCP"}],
                    "endpoints": [{"addresses": ["198.51.100.11"], "nodeName": node}]
                }),
            )],
            vec![
                (udp(53), vec![ep("198.51.100.11", 5353, true, true, false)]),
                (tcp(80), vec![ep("198.51.100.11", 8081, true, true, false)]),
            ],
        ),
        (
            "multiple slices, duplicates merged with best conditions",
            Box::new(|_| {}),
            vec![
                slice(
                    "web-1",
                    "web",
                    json!({
                        "ports": [{"port": 8080}],
                        "endpoints": [{"addresses": ["198.51.100.11"], "nodeName": node, "conditions": {"ready": false}},
                                      {"addresses": ["198.51.100.13"], "nodeName": node}]
                    }),
                ),
                slice(
                    "web-2",
                    "web",
                    json!({
                        "ports": [{"port": 8080}],
                        "endpoints": [{"addresses": ["198.51.100.11"], "nodeName": node, "conditions": {"ready": true}}]
                    }),
                ),
                // Same address, different target port (during a rollout): a different endpoint.
                slice(
                    "web-3",
                    "web",
                    json!({
                        "ports": [{"port": 9090}],
                        "endpoints": [{"addresses": ["198.51.100.11"], "nodeName": node}]
                    }),
                ),
            ],
            vec![(
                tcp(80),
                vec![
                    ep("198.51.100.11", 8080, true, true, false),
                    ep("198.51.100.11", 9090, true, true, false),
                    ep("198.51.100.13", 8080, true, true, false),
                ],
            )],
        ),
        (
            "dual-stack slices on a dual-stack Service",
            Box::new(|v| v["spec"]["ipFamilies"] = json!(["IPv4", "IPv6"])),
            vec![
                slice(
                    "web-v4",
                    "web",
                    json!({"ports": [{"port": 8080}], "endpoints": [{"addresses": ["198.51.100.11"], "nodeName": node}]}),
                ),
                slice(
                    "web-v6",
                    "web",
                    json!({"addressType": "IPv6", "ports": [{"port": 8080}], "endpoints": [{"addresses": ["2001:db8::11"], "nodeName": node}]}),
                ),
            ],
            vec![(
                tcp(80),
                vec![
                    ep("198.51.100.11", 8080, true, true, false),
                    ep("2001:db8::11", 8080, true, true, false),
                ],
            )],
        ),
        (
            "v6 slice of a v4-only Service and FQDN slices are dropped",
            Box::new(|_| {}),
            vec![
                slice(
                    "web-v6",
                    "web",
                    json!({"addressType": "IPv6", "ports": [{"port": 8080}], "endpoints": [{"addresses": ["2001:db8::11"]}]}),
                ),
                slice(
                    "web-fqdn",
                    "web",
                    json!({"addressType": "FQDN", "ports": [{"port": 8080}], "endpoints": [{"addresses": ["example.com"]}]}),
                ),
            ],
            vec![(tcp(80), vec![])],
        ),
        (
            "conditions defaults",
            Box::new(|_| {}),
            vec![slice(
                "web-1",
                "web",
                json!({
                    "ports": [{"port": 8080}],
                    "endpoints": [
                        {"addresses": ["198.51.100.1"], "nodeName": node, "conditions": {}},
                        {"addresses": ["198.51.100.2"], "nodeName": node, "conditions": {"ready": false}},
                        {"addresses": ["198.51.100.3"], "nodeName": node, "conditions": {"ready": false, "serving": true, "terminating": true}},
                        {"addresses": ["198.51.100.4"], "nodeName": node, "conditions": {"ready": true, "serving": false}}
                    ]
                }),
            )],
            vec![(
                tcp(80),
                vec![
                    ep("198.51.100.1", 8080, true, true, false),
                    ep("198.51.100.2", 8080, false, false, false),
                    ep("198.51.100.3", 8080, false, true, true),
                    ep("198.51.100.4", 8080, true, false, false),
                ],
            )],
        ),
        (
            "slices of other Services, namespaces, unlabeled, nil or wrong ports do not count",
            Box::new(|_| {}),
            vec![
                slice(
                    "other",
                    "other",
                    json!({"ports": [{"port": 1}], "endpoints": [{"addresses": ["198.51.100.1"]}]}),
                ),
                {
                    let mut s = slice(
                        "ns",
                        "web",
                        json!({"ports": [{"port": 2}], "endpoints": [{"addresses": ["198.51.100.2"]}]}),
                    );
                    s.metadata.namespace = Some("kube-system".into());
                    s
                },
                {
                    let mut s = slice(
                        "nolabel",
                        "web",
                        json!({"ports": [{"port": 3}], "endpoints": [{"addresses": ["198.51.100.3"]}]}),
                    );
                    s.service_name = None;
                    s
                },
                slice(
                    "nilport",
                    "web",
                    json!({"ports": [{}], "endpoints": [{"addresses": ["198.51.100.4"]}]}),
                ),
                slice("noports", "web", json!({"endpoints": [{"addresses": ["198.51.100.5"]}]})),
                slice(
                    "udp",
                    "web",
                    json!({"ports": [{"port": 6, "protocol": "UDP"}], "endpoints": [{"addresses": ["198.51.100.6"]}]}),
                ),
                slice(
                    "named",
                    "web",
                    json!({"ports": [{"name": "x", "port": 7}], "endpoints": [{"addresses": ["198.51.100.7"]}]}),
                ),
            ],
            vec![(tcp(80), vec![])],
        ),
    ];
    for (name, f, slices, want) in cases {
        let (got, warnings) = endpoints_of(svc_with("web", f), &slices);
        assert_eq!(got, want.into_iter().collect::<BTreeMap<_, _>>(), "{name}");
        assert!(warnings.is_empty(), "{name}: {warnings:?}");
    }
}

#[test]
fn bad_endpoint_addresses_are_warnings() {
    let slices = vec![slice(
        "web-1",
        "web",
        json!({
            "ports": [{"port": 8080}],
            "endpoints": [{"addresses": ["198.51.100.300", "2001:db8::1", "198.51.100.1"]}]
        }),
    )];
    let (got, warnings) = endpoints_of(svc_with("web", |_| {}), &slices);
    assert_eq!(got[&tcp(80)].len(), 1);
    assert_eq!(warnings.len(), 2, "{warnings:?}");
    assert!(warnings.iter().all(|w| w.to_string().contains("EndpointSlice \"web-1\"")), "{warnings:?}");
}

#[test]
fn output_is_sorted_and_order_independent() {
    let a = svc_with("a", |_| {});
    let b = svc_with("b", |v| v["spec"]["externalTrafficPolicy"] = json!("bad"));
    let c = svc_with("c", |_| {});
    let x = build(&[c.clone(), b.clone(), a.clone()], NO_SLICES, &ModelOptions::default());
    let y = build(&[a, b, c], NO_SLICES, &ModelOptions::default());
    assert_eq!(x, y);
    assert_eq!(x.services.iter().map(|s| s.key.clone()).collect::<Vec<_>>(), vec![key("a"), key("c")]);
}

#[test]
fn never_panics_on_empty_objects() {
    let svc = Service::default();
    let out = build(&[svc], &[EndpointSlice::default()], &ModelOptions::default());
    assert!(out.services.is_empty() && out.refused.is_empty());
    let svc = Service {
        spec: Some(k8s_openapi::api::core::v1::ServiceSpec {
            type_: Some("LoadBalancer".into()),
            ..Default::default()
        }),
        ..Default::default()
    };
    let out = build(&[svc], NO_SLICES, &ModelOptions::default());
    assert_eq!(out.refused.len(), 1);
}
