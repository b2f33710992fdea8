use super::*;
use serde_json::json;

fn spec(v: serde_json::Value) -> NodePortPoolSpec {
    serde_json::from_value(v).expect("spec")
}

fn pool(name: &str, created: u32, v: serde_json::Value) -> Pool {
    let t = format!("2024-01-01T00:00:{created:02}Z");
    validate(name, Some(t), Some(1), &spec(v)).expect("valid pool")
}

fn labels(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
    pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect()
}

#[test]
fn the_committed_crd_is_the_generated_one() {
    let committed = include_str!("../../../../../charts/nodelb/crds/nodeportpools.nodelb.io.yaml");
    assert!(
        committed == crd_yaml(),
        "charts/nodelb/crds/nodeportpools.nodelb.io.yaml is not what `nodelb crd` prints: run \
             `cargo run -q -- crd > charts/nodelb/crds/nodeportpools.nodelb.io.yaml`, then scripts/generate-manifests.sh"
    );
}

#[test]
fn validation() {
    let cases: Vec<(&str, serde_json::Value, Result<(), &str>)> = vec![
        ("one range", json!({"ports": [{"start": 20000, "end": 20099}]}), Ok(())),
        ("single port", json!({"ports": [{"start": 8080, "end": 8080}]}), Ok(())),
        ("no range", json!({"ports": []}), Err("at least one range")),
        (
            "reversed",
            json!({"ports": [{"start": 20099, "end": 20000}]}),
            Err("spec.ports[0]: port range \"20099-20000\": first port is greater than last"),
        ),
        ("port 0", json!({"ports": [{"start": 0, "end": 10}]}), Err("is not a port number")),
        (
            "NodePort range",
            json!({"ports": [{"start": 29000, "end": 30000}]}),
            Err("overlaps the Kubernetes NodePort range 30000-32767"),
        ),
        (
            "NodePort range allowed",
            json!({"ports": [{"start": 30000, "end": 30010}], "allowNodePortRange": true}),
            Ok(()),
        ),
        (
            "ranges overlap each other",
            json!({"ports": [{"start": 1000, "end": 2000}, {"start": 2000, "end": 2001}]}),
            Err("spec.ports[1]: 2000-2001 overlaps 1000-2000 of the same pool"),
        ),
        (
            "bad operator",
            json!({"ports": [{"start": 1, "end": 2}], "nodeSelector": {"matchExpressions": [{"key": "a", "operator": "Gt", "values": ["1"]}]}}),
            Err("spec.nodeSelector: expression on \"a\": operator \"Gt\""),
        ),
        (
            "In without values",
            json!({"ports": [{"start": 1, "end": 2}], "serviceSelector": {"matchExpressions": [{"key": "a", "operator": "In"}]}}),
            Err("spec.serviceSelector: expression on \"a\": operator In needs values"),
        ),
        (
            "Exists with values",
            json!({"ports": [{"start": 1, "end": 2}], "namespaceSelector": {"matchExpressions": [{"key": "a", "operator": "Exists", "values": ["x"]}]}}),
            Err("operator Exists takes no values"),
        ),
        (
            "address type",
            json!({"ports": [{"start": 1, "end": 2}], "addresses": {"types": ["Hostname"]}}),
            Err("spec.addresses.types: \"Hostname\" is not ExternalIP or InternalIP"),
        ),
        (
            "bad CIDR",
            json!({"ports": [{"start": 1, "end": 2}], "addresses": {"cidrs": ["192.0.2.0/33"]}}),
            Err("spec.addresses.cidrs: \"192.0.2.0/33\" is not a CIDR"),
        ),
        (
            "host bits",
            json!({"ports": [{"start": 1, "end": 2}], "addresses": {"cidrs": ["192.0.2.1/24"]}}),
            Err("has host bits set (did you mean 192.0.2.0/24?)"),
        ),
        (
            "interface",
            json!({"ports": [{"start": 1, "end": 2}], "addresses": {"interfaces": ["eth0/1"]}}),
            Err("spec.addresses.interfaces: \"eth0/1\" is not an interface name"),
        ),
        (
            "valid addresses",
            json!({"ports": [{"start": 1, "end": 2}], "addresses": {"types": ["ExternalIP"], "cidrs": ["2001:db8::/64"], "interfaces": ["eth0"]}}),
            Ok(()),
        ),
    ];
    for (name, v, want) in cases {
        let got = validate("p", None, None, &spec(v));
        match (want, got) {
            (Ok(()), Ok(_)) => {}
            (Err(part), Err(errors)) => {
                assert!(errors.iter().any(|e| e.contains(part)), "{name}: {errors:?} should contain {part:?}")
            }
            (want, got) => panic!("{name}: want {want:?}, got {got:?}"),
        }
    }
}

#[test]
fn defaults_of_an_object() {
    let s = spec(json!({"ports": [{"start": 20000, "end": 20009}]}));
    assert!(s.auto_assign && !s.disabled && s.priority == 0 && !s.allow_node_port_range);
}

#[test]
#[allow(clippy::type_complexity)]
fn selectors() {
    let sel = |v: serde_json::Value| Selector::parse(Some(&serde_json::from_value(v).unwrap())).unwrap();
    let cases: Vec<(&str, Selector, &[(&str, &str)], bool)> = vec![
        ("empty selects all", sel(json!({})), &[], true),
        ("matchLabels", sel(json!({"matchLabels": {"zone": "a"}})), &[("zone", "a")], true),
        ("matchLabels other value", sel(json!({"matchLabels": {"zone": "a"}})), &[("zone", "b")], false),
        (
            "In",
            sel(json!({"matchExpressions": [{"key": "zone", "operator": "In", "values": ["a", "b"]}]})),
            &[("zone", "b")],
            true,
        ),
        (
            "NotIn absent",
            sel(json!({"matchExpressions": [{"key": "zone", "operator": "NotIn", "values": ["a"]}]})),
            &[],
            true,
        ),
        (
            "NotIn present",
            sel(json!({"matchExpressions": [{"key": "zone", "operator": "NotIn", "values": ["a"]}]})),
            &[("zone", "a")],
            false,
        ),
        (
            "Exists",
            sel(json!({"matchExpressions": [{"key": "edge", "operator": "Exists"}]})),
            &[("edge", "")],
            true,
        ),
        (
            "DoesNotExist",
            sel(json!({"matchExpressions": [{"key": "edge", "operator": "DoesNotExist"}]})),
            &[("edge", "")],
            false,
        ),
        (
            "ANDed",
            sel(json!({"matchLabels": {"a": "1"}, "matchExpressions": [{"key": "b", "operator": "Exists"}]})),
            &[("a", "1")],
            false,
        ),
    ];
    for (name, s, l, want) in cases {
        assert_eq!(s.matches(&labels(l)), want, "{name}");
    }
}

#[test]
fn disjoint_selectors() {
    let sel = |v: serde_json::Value| Selector::parse(Some(&serde_json::from_value(v).unwrap())).unwrap();
    let expr = |key: &str, op: &str, values: &[&str]| {
        let mut e = json!({"key": key, "operator": op});
        if !values.is_empty() {
            e["values"] = json!(values);
        }
        sel(json!({"matchExpressions": [e]}))
    };
    let role = |r: &str| sel(json!({"matchLabels": {"role": r}}));
    let cases = [
        ("two values of one key", role("edge"), role("internal"), true),
        ("one value", role("edge"), role("edge"), false),
        ("In and NotIn the value", expr("role", "In", &["edge"]), expr("role", "NotIn", &["edge"]), true),
        ("In two and NotIn one", expr("role", "In", &["a", "b"]), expr("role", "NotIn", &["a"]), false),
        ("Exists and DoesNotExist", expr("edge", "Exists", &[]), expr("edge", "DoesNotExist", &[]), true),
        ("In and DoesNotExist", role("edge"), expr("role", "DoesNotExist", &[]), true),
        ("NotIn and DoesNotExist", expr("role", "NotIn", &["a"]), expr("role", "DoesNotExist", &[]), false),
        (
            "two keys a node may both carry",
            expr("edge", "Exists", &[]),
            expr("internal", "Exists", &[]),
            false,
        ),
        ("everything and anything", sel(json!({})), role("edge"), false),
        ("everything twice", sel(json!({})), sel(json!({})), false),
        (
            "one key apart among others",
            sel(json!({"matchLabels": {"role": "edge", "zone": "a"}})),
            sel(json!({"matchLabels": {"zone": "a"}, "matchExpressions": [
                {"key": "role", "operator": "NotIn", "values": ["edge"]}]})),
            true,
        ),
        (
            "selects nothing by itself",
            sel(json!({"matchLabels": {"role": "edge"}, "matchExpressions": [
                {"key": "role", "operator": "NotIn", "values": ["edge"]}]})),
            sel(json!({})),
            true,
        ),
    ];
    for (name, a, b, want) in cases {
        assert_eq!(a.disjoint(&b), want, "{name}");
        assert_eq!(b.disjoint(&a), want, "{name}, the other way round");
    }
}

/// `disjoint` against its definition: no labels match both. Every selector of up to two
/// requirements on two keys and two values, against every labelling of those keys (absent, either
/// value, or a value no selector names).
#[test]
fn disjoint_is_no_labels_matching_both() {
    let values = |vs: &[&str]| vs.iter().map(|v| v.to_string()).collect::<BTreeSet<_>>();
    let mut one = Vec::new();
    for key in ["a", "b"] {
        for vs in [&["x"][..], &["y"], &["x", "y"]] {
            one.push(Requirement::In(key.into(), values(vs)));
            one.push(Requirement::NotIn(key.into(), values(vs)));
        }
        one.push(Requirement::Exists(key.into()));
        one.push(Requirement::DoesNotExist(key.into()));
    }
    let mut selectors = vec![Selector::default()];
    for r in &one {
        selectors.push(Selector(vec![r.clone()]));
        for r2 in &one {
            selectors.push(Selector(vec![r.clone(), r2.clone()]));
        }
    }
    let choices = [None, Some("x"), Some("y"), Some("z")];
    let mut labellings = Vec::new();
    for a in choices {
        for b in choices {
            let pairs: Vec<(&str, &str)> =
                [("a", a), ("b", b)].into_iter().filter_map(|(k, v)| v.map(|v| (k, v))).collect();
            labellings.push(labels(&pairs));
        }
    }
    let (mut apart, mut together) = (0, 0);
    for s in &selectors {
        for t in &selectors {
            let overlap = labellings.iter().any(|l| s.matches(l) && t.matches(l));
            assert_eq!(s.disjoint(t), !overlap, "{s:?} and {t:?}");
            if overlap { together += 1 } else { apart += 1 }
        }
    }
    assert!(apart > 1000 && together > 1000, "both answers are checked: {apart} apart, {together} not");
}

#[test]
fn overlap_resolution() {
    let zone = |z: &str| json!({"matchLabels": {"zone": z}});
    let a = labels(&[("zone", "a")]);
    let b = labels(&[("zone", "b")]);
    let nodes = [&a, &b];
    struct Case {
        name: &'static str,
        pools: Vec<Pool>,
        // Per pool (oldest first): effective ranges, conflicts.
        want: Vec<(&'static str, &'static str, Vec<&'static str>)>,
    }
    let cases = vec![
        Case {
            name: "disjoint ranges",
            pools: vec![
                pool("old", 1, json!({"ports": [{"start": 20000, "end": 20009}]})),
                pool("new", 2, json!({"ports": [{"start": 20010, "end": 20019}]})),
            ],
            want: vec![("old", "20000-20009", vec![]), ("new", "20010-20019", vec![])],
        },
        Case {
            name: "overlap on shared nodes: the newer loses the overlap",
            pools: vec![
                pool("new", 2, json!({"ports": [{"start": 20005, "end": 20019}]})),
                pool("old", 1, json!({"ports": [{"start": 20000, "end": 20009}]})),
            ],
            want: vec![("old", "20000-20009", vec![]), ("new", "20010-20019", vec!["old"])],
        },
        Case {
            name: "overlap in the middle splits the newer",
            pools: vec![
                pool("old", 1, json!({"ports": [{"start": 20005, "end": 20006}]})),
                pool("new", 2, json!({"ports": [{"start": 20000, "end": 20009}]})),
            ],
            want: vec![("old", "20005-20006", vec![]), ("new", "20000-20004,20007-20009", vec!["old"])],
        },
        Case {
            name: "same ranges on disjoint nodes: no conflict",
            pools: vec![
                pool("za", 1, json!({"ports": [{"start": 20000, "end": 20009}], "nodeSelector": zone("a")})),
                pool("zb", 2, json!({"ports": [{"start": 20000, "end": 20009}], "nodeSelector": zone("b")})),
            ],
            want: vec![("za", "20000-20009", vec![]), ("zb", "20000-20009", vec![])],
        },
        Case {
            name: "same name order when no creation time: by name",
            pools: vec![
                validate("b", None, None, &spec(json!({"ports": [{"start": 1000, "end": 1001}]}))).unwrap(),
                validate("a", None, None, &spec(json!({"ports": [{"start": 1000, "end": 1001}]}))).unwrap(),
            ],
            want: vec![("a", "1000-1001", vec![]), ("b", "none", vec!["a"])],
        },
        Case {
            name: "disabled pool drains: nothing new",
            pools: vec![pool("d", 1, json!({"ports": [{"start": 20000, "end": 20009}], "disabled": true}))],
            want: vec![("d", "none", vec![])],
        },
    ];
    for c in cases {
        let set = PoolSet::resolve(c.pools, true, PortRange::default(), &nodes);
        let got: Vec<(String, String, Vec<String>)> = set
            .pools
            .iter()
            .map(|p| (p.pool.name.clone(), describe_ranges(&p.effective), p.conflicts.clone()))
            .collect();
        let want: Vec<(String, String, Vec<String>)> = c
            .want
            .iter()
            .map(|(n, r, cs)| (n.to_string(), r.to_string(), cs.iter().map(|s| s.to_string()).collect()))
            .collect();
        assert_eq!(got, want, "{}", c.name);
    }
}

/// Pools whose node selectors exclude each other may share numbers; pools that may meet on a
/// node may not; the flags' pool shares nothing.
#[test]
fn pools_apart_are_found_from_their_node_selectors() {
    let on = |k: &str, v: &str| json!({"ports": [{"start": 443, "end": 443}], "nodeSelector": {"matchLabels": {k: v}}});
    let pools = vec![
        pool("edge", 1, on("tier", "edge")),
        pool("internal", 2, on("tier", "internal")),
        pool("gpu", 3, on("gpu", "yes")),
        pool("everywhere", 4, json!({"ports": [{"start": 20000, "end": 20009}]})),
        pool(
            "zone-a",
            5,
            json!({"ports": [{"start": 21000, "end": 21009}], "nodeSelector": {"matchLabels": {"tier": "edge"}}}),
        ),
        pool(
            "zone-b",
            6,
            json!({"ports": [{"start": 21010, "end": 21019}], "requestablePorts": [{"start": 443, "end": 443}],
                                  "nodeSelector": {"matchLabels": {"tier": "internal"}}}),
        ),
    ];
    let sharing = PoolSet::resolve(pools, true, PortRange::default(), &[]).sharing().expect("pool objects");
    assert!(sharing.shares("edge") && sharing.shares("internal"));
    assert!(!sharing.shares("gpu") && !sharing.shares("everywhere"));
    assert!(!sharing.shares("zone-a"), "apart, but no number both permit");
    assert!(sharing.shares("zone-b"), "443 is requestable there, and edge serves it");
    let implicit = PoolSet::resolve(vec![], false, PortRange::default(), &[]);
    assert!(implicit.sharing().is_none());
    // By address: CIDRs that do not meet; a CIDR inside another's meets it; no CIDRs is every
    // address.
    let at = |cidrs: serde_json::Value| json!({"ports": [{"start": 443, "end": 443}], "addresses": {"cidrs": cidrs}});
    let pools = vec![
        pool("public", 1, at(json!(["192.0.2.0/24"]))),
        pool("private", 2, at(json!(["203.0.113.0/24", "2001:db8::/64"]))),
        pool("inside", 3, at(json!(["192.0.2.128/25"]))),
        pool(
            "typed",
            4,
            json!({"ports": [{"start": 443, "end": 443}], "addresses": {"types": ["ExternalIP"]}}),
        ),
    ];
    let node = labels(&[]);
    let set = PoolSet::resolve(pools, true, PortRange::default(), &[&node]);
    let conflicts = |name: &str| set.pools.iter().find(|p| p.pool.name == name).map(|p| p.conflicts.clone());
    assert_eq!(conflicts("private"), Some(vec![]), "apart by address: no overlap on a node both select");
    assert_eq!(conflicts("inside"), Some(vec!["public".to_string()]), "192.0.2.128/25 is in both");
    let sharing = set.sharing().expect("pool objects");
    assert!(sharing.shares("public") && sharing.shares("private") && sharing.shares("inside"));
    assert!(!sharing.shares("typed"), "a type alone may select any address");
    let key = |n: &str| crate::domain::ServiceKey::new("default", n);
    let mut sharing = sharing;
    for (k, p) in [("a", "public"), ("b", "private"), ("c", "inside")] {
        sharing.serve(&key(k), crate::domain::Owner(k.repeat(12)), p);
    }
    assert!(sharing.never_together(&key("a"), &key("b")) && sharing.never_together(&key("c"), &key("b")));
    assert!(!sharing.never_together(&key("a"), &key("c")), "192.0.2.129 is in both");
}

#[test]
fn no_pool_object_means_the_flags() {
    let set = PoolSet::resolve(vec![], false, PortRange { first: 20000, last: 20099 }, &[]);
    assert!(set.implicit);
    let none = BTreeMap::new();
    let svc = ServiceFacts { labels: &none, namespace_labels: &none, requested: None, held: &[] };
    let p = assign(&set, &svc).unwrap();
    assert_eq!(
        (p.pool.name.as_str(), describe_ranges(&p.effective).as_str()),
        (IMPLICIT_POOL, "20000-20099")
    );
    // Pool objects that are all invalid still end the implicit pool: their Services wait
    // rather than spill onto every node and address.
    let set = PoolSet::resolve(vec![], true, PortRange::default(), &[]);
    assert_eq!(assign(&set, &svc), Err(NoPool::NoneAccepts));
}

#[test]
#[allow(clippy::type_complexity)]
fn selection() {
    let pools = vec![
        pool("general", 1, json!({"ports": [{"start": 20000, "end": 20099}], "priority": 10})),
        pool(
            "team-a",
            2,
            json!({"ports": [{"start": 21000, "end": 21099}], "serviceSelector": {"matchLabels": {"team": "a"}}}),
        ),
        pool(
            "team-a-newer",
            3,
            json!({"ports": [{"start": 22000, "end": 22099}], "serviceSelector": {"matchLabels": {"team": "a"}}}),
        ),
        pool(
            "prod-ns",
            4,
            json!({"ports": [{"start": 23000, "end": 23099}], "priority": -5, "namespaceSelector": {"matchLabels": {"env": "prod"}}}),
        ),
        pool("by-name", 5, json!({"ports": [{"start": 24000, "end": 24099}], "autoAssign": false})),
        pool(
            "draining",
            6,
            json!({"ports": [{"start": 25000, "end": 25099}], "priority": -10, "disabled": true}),
        ),
    ];
    let set = PoolSet::resolve(pools, true, PortRange::default(), &[]);
    let none = BTreeMap::new();
    let team_a = labels(&[("team", "a")]);
    let prod = labels(&[("env", "prod")]);
    let cases: Vec<(
        &str,
        &BTreeMap<String, String>,
        &BTreeMap<String, String>,
        Option<&str>,
        &[u16],
        Result<&str, NoPool>,
    )> = vec![
        ("only the general pool accepts", &none, &none, None, &[], Ok("general")),
        ("same priority: the older pool", &team_a, &none, None, &[], Ok("team-a")),
        ("lower priority wins", &team_a, &prod, None, &[], Ok("prod-ns")),
        ("by name, autoAssign false", &none, &none, Some("by-name"), &[], Ok("by-name")),
        ("by name wins over priority", &team_a, &none, Some("general"), &[], Ok("general")),
        ("by name, admitted by its selectors", &team_a, &none, Some("team-a-newer"), &[], Ok("team-a-newer")),
        (
            "by name, not admitted by its serviceSelector",
            &none,
            &none,
            Some("team-a"),
            &[],
            Err(NoPool::NotAdmitted("team-a".into())),
        ),
        (
            "by name, not admitted by its namespaceSelector",
            &team_a,
            &none,
            Some("prod-ns"),
            &[],
            Err(NoPool::NotAdmitted("prod-ns".into())),
        ),
        ("missing pool", &none, &none, Some("nope"), &[], Err(NoPool::Missing("nope".into()))),
        ("stays in the pool it holds numbers in", &team_a, &none, None, &[22005], Ok("team-a-newer")),
        ("a draining pool keeps what it holds", &none, &none, None, &[25000], Ok("draining")),
        ("held numbers in no accepting pool: the best pool", &none, &none, None, &[21000], Ok("general")),
        ("numbers split over pools: the best pool", &team_a, &none, None, &[21000, 22000], Ok("team-a")),
    ];
    for (name, l, ns, requested, held, want) in cases {
        let svc = ServiceFacts { labels: l, namespace_labels: ns, requested, held };
        let got = assign(&set, &svc).map(|p| p.pool.name.as_str());
        assert_eq!(got, want, "{name}");
    }
    // Nothing accepts: a Service with labels no selector-free pool exists for.
    let only = PoolSet::resolve(
        vec![pool(
            "team-a",
            1,
            json!({"ports": [{"start": 21000, "end": 21099}], "serviceSelector": {"matchLabels": {"team": "a"}}}),
        )],
        true,
        PortRange::default(),
        &[],
    );
    let svc = ServiceFacts { labels: &none, namespace_labels: &none, requested: None, held: &[] };
    assert_eq!(assign(&only, &svc).map(|p| p.pool.name.clone()), Err(NoPool::NoneAccepts));
}

#[test]
fn invalid_edit_keeps_the_last_valid_version() {
    let obj = |gen_: i64, uid: &str, start: u16| PoolObject {
        name: "p".into(),
        uid: Some(uid.into()),
        created: None,
        generation: Some(gen_),
        spec: spec(json!({"ports": [{"start": start, "end": 20099}]})),
    };
    let mut lv = LastValid::default();
    let (pools, invalid) = lv.update(&[obj(1, "u1", 20000)]);
    assert_eq!((pools.len(), invalid.len()), (1, 0));
    // Edited into a reversed range: generation 1 stays in force, and says so.
    let (pools, invalid) = lv.update(&[obj(2, "u1", 20100)]);
    assert_eq!(pools.iter().map(|p| p.generation).collect::<Vec<_>>(), vec![Some(1)]);
    assert_eq!(invalid[0].in_force, Some(1));
    assert!(
        invalid[0].to_string().contains("generation 1, its last valid version, stays in force"),
        "{}",
        invalid[0]
    );
    // Deleted and created again (new uid) invalid: nothing in force.
    let (pools, invalid) = lv.update(&[obj(1, "u2", 20100)]);
    assert!(pools.is_empty());
    assert_eq!(invalid[0].in_force, None);
}

/// Which of a node's addresses serve a pool: pure, from the node's own facts.
#[test]
#[allow(clippy::type_complexity)]
fn address_selection() {
    let mut own = NodeAddresses::default();
    for (a, ifs) in [
        ("127.0.0.1", "lo"),
        ("::1", "lo"),
        ("198.51.100.7", "lo"), // an anycast address on lo is a node address
        ("192.0.2.10", "eth0"),
        ("203.0.113.10", "eth1"),
        ("2001:db8::10", "eth0"),
        ("fe80::1", "eth0"),
    ] {
        own.interfaces.entry(a.parse().unwrap()).or_default().insert(ifs.to_string());
    }
    let typed = |a: &str, t: AddressType| (a.parse::<IpAddr>().unwrap(), BTreeSet::from([t]));
    let k8s = NodeAddresses {
        types: BTreeMap::from([
            typed("192.0.2.10", AddressType::InternalIp),
            typed("203.0.113.10", AddressType::ExternalIp),
            // Published but not on an interface (cloud 1:1 NAT): packets never carry it.
            typed("198.51.100.99", AddressType::ExternalIp),
        ]),
        ..Default::default()
    };
    let mut kube = own.clone();
    kube.merge(&k8s);
    let cases: Vec<(&str, serde_json::Value, &NodeAddresses, Vec<&str>)> = vec![
        (
            "no restriction: every non-loopback local address",
            json!({}),
            &own,
            vec!["192.0.2.10", "198.51.100.7", "203.0.113.10", "2001:db8::10", "fe80::1"],
        ),
        ("one CIDR", json!({"cidrs": ["203.0.113.0/24"]}), &own, vec!["203.0.113.10"]),
        (
            "CIDRs of both families",
            json!({"cidrs": ["192.0.2.0/24", "2001:db8::/64"]}),
            &own,
            vec!["192.0.2.10", "2001:db8::10"],
        ),
        ("loopback never, even inside the CIDR", json!({"cidrs": ["127.0.0.0/8"]}), &own, vec![]),
        (
            "an interface",
            json!({"interfaces": ["eth0"]}),
            &own,
            vec!["192.0.2.10", "2001:db8::10", "fe80::1"],
        ),
        (
            "interface and CIDR: both",
            json!({"interfaces": ["eth0"], "cidrs": ["2001:db8::/32"]}),
            &own,
            vec!["2001:db8::10"],
        ),
        ("lo, not its loopback", json!({"interfaces": ["lo"]}), &own, vec!["198.51.100.7"]),
        (
            "types: the Node object's, on this node",
            json!({"types": ["ExternalIP"]}),
            &kube,
            vec!["203.0.113.10"],
        ),
        ("InternalIP", json!({"types": ["InternalIP"]}), &kube, vec!["192.0.2.10"]),
        ("types without a Node object (manifests): nothing", json!({"types": ["InternalIP"]}), &own, vec![]),
        ("an interface nobody has", json!({"interfaces": ["eth9"]}), &own, vec![]),
    ];
    for (name, addresses, facts, want) in cases {
        let pool = validate(
            "p",
            None,
            None,
            &spec(json!({"ports": [{"start": 1, "end": 2}], "addresses": addresses})),
        )
        .unwrap_or_else(|e| panic!("{name}: {e:?}"));
        let got: Vec<IpAddr> = pool.addresses.select(facts).into_iter().collect();
        let mut want: Vec<IpAddr> = want.iter().map(|a| a.parse().unwrap()).collect();
        want.sort();
        assert_eq!(got, want, "{name}");
    }
}

/// What a node publishes on its Lease: per address-restricted pool that selects it, what
/// it serves the pool on.
#[test]
fn selected_addresses_per_pool() {
    let mut own = NodeAddresses::default();
    for (a, i) in [("192.0.2.10", "eth0"), ("203.0.113.10", "edge0")] {
        own.interfaces.entry(a.parse().unwrap()).or_default().insert(i.to_string());
    }
    let zone = |z: &str| json!({"matchLabels": {"zone": z}});
    let pools = vec![
        pool("all", 1, json!({"ports": [{"start": 1, "end": 2}]})),
        pool("edge", 2, json!({"ports": [{"start": 3, "end": 4}], "addresses": {"interfaces": ["edge0"]}})),
        pool(
            "elsewhere",
            3,
            json!({"ports": [{"start": 5, "end": 6}], "addresses": {"interfaces": ["edge0"]}, "nodeSelector": zone("b")}),
        ),
        pool(
            "none",
            4,
            json!({"ports": [{"start": 7, "end": 8}], "addresses": {"cidrs": ["198.51.100.0/24"]}}),
        ),
    ];
    let me = labels(&[("zone", "a")]);
    let set = PoolSet::resolve(pools, true, PortRange::default(), &[&me]);
    let ctx = PoolContext { set, namespaces: BTreeMap::new(), node_labels: me.clone(), servicelb: false };
    let got = ctx.selected_addresses(&own);
    let want: BTreeMap<String, BTreeSet<IpAddr>> =
        [("edge".to_string(), BTreeSet::from(["203.0.113.10".parse().unwrap()]))].into();
    assert_eq!(got, want);
}

/// What the leader publishes: it sees Node objects, not interfaces.
#[test]
fn published_addresses() {
    let f = |v: serde_json::Value| {
        validate("p", None, None, &spec(json!({"ports": [{"start": 1, "end": 2}], "addresses": v})))
            .unwrap()
            .addresses
    };
    let a: IpAddr = "203.0.113.10".parse().unwrap();
    let ext = Some(AddressType::ExternalIp);
    assert!(f(json!({})).publishes(None, &a));
    assert!(f(json!({"cidrs": ["203.0.113.0/24"]})).publishes(ext, &a));
    assert!(!f(json!({"cidrs": ["192.0.2.0/24"]})).publishes(ext, &a));
    assert!(f(json!({"types": ["ExternalIP"]})).publishes(ext, &a));
    assert!(!f(json!({"types": ["InternalIP"]})).publishes(ext, &a));
    assert!(!f(json!({"types": ["ExternalIP"]})).publishes(None, &a));
    assert!(f(json!({"interfaces": ["eth1"]})).publishes(ext, &a));
}

#[test]
fn usage_counts_what_each_pool_holds_and_what_is_free_anywhere() {
    let pools = vec![
        pool("a", 1, json!({"ports": [{"start": 20000, "end": 20009}]})),
        pool("b", 2, json!({"ports": [{"start": 20005, "end": 20019}]})),
        pool("drained", 3, json!({"ports": [{"start": 21000, "end": 21004}], "disabled": true})),
    ];
    let set = PoolSet::resolve(pools, true, PortRange::default(), &[&BTreeMap::new()]);
    let key = |n: &str| ServiceKey::new("default", n);
    let port = |n: u16| BTreeMap::from([(crate::domain::PortId::tcp(80), n)]);
    let allocations: Allocations = BTreeMap::from([
        (key("x"), port(20001)),
        (key("y"), port(20012)),
        (key("z"), port(21002)),
        // Held by a Service of no pool (e.g. before pools): still not free in "a".
        (key("w"), port(20002)),
    ]);
    let (x, y, z) = (key("x"), key("y"), key("z"));
    let members = [(&x, "a"), (&y, "b"), (&z, "drained")];
    let got: Vec<(String, usize, usize)> =
        usage(&set, &allocations, members).into_iter().map(|u| (u.name, u.allocated, u.free)).collect();
    // "b" is newer and overlaps "a" on the node both select: it keeps 20010-20019 only.
    let want = vec![("a".to_string(), 1, 8), ("b".to_string(), 1, 9), ("drained".to_string(), 1, 0)];
    assert_eq!(got, want);
    let implicit = PoolSet::resolve(vec![], false, PortRange { first: 20000, last: 20099 }, &[]);
    assert_eq!(usage(&implicit, &allocations, []), vec![], "--port-range has its own gauge");
}
