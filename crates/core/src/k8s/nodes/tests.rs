use super::*;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::MicroTime;
use serde_json::json;

fn node(name: &str, addrs: &[(&str, &str)]) -> Node {
    let addrs: Vec<_> = addrs.iter().map(|(t, a)| json!({"type": t, "address": a})).collect();
    serde_json::from_value(json!({"metadata": {"name": name}, "status": {"addresses": addrs}})).unwrap()
}

#[test]
fn pool_addresses_follow_the_filter() {
    let n = node(
        "n",
        &[
            ("InternalIP", "192.0.2.1"),
            ("ExternalIP", "203.0.113.1"),
            ("Hostname", "n"),
            ("InternalIP", "2001:db8::1"),
        ],
    );
    let filter = |v: serde_json::Value| {
        let spec =
            serde_json::from_value(json!({"ports": [{"start": 1, "end": 2}], "addresses": v})).unwrap();
        crate::decisions::pool::validate("p", None, None, &spec).unwrap().addresses
    };
    let ips = |v: &[&str]| v.iter().map(|a| a.parse::<IpAddr>().unwrap()).collect::<Vec<_>>();
    assert_eq!(pool_addresses(&n, &filter(json!({"cidrs": ["192.0.2.0/24"]})), &[]), ips(&["192.0.2.1"]));
    assert_eq!(
        pool_addresses(&n, &filter(json!({"types": ["InternalIP"]})), &[]),
        ips(&["192.0.2.1", "2001:db8::1"])
    );
    assert_eq!(pool_addresses(&n, &filter(json!({"types": ["ExternalIP"]})), &[]), ips(&["203.0.113.1"]));
    let only_v6: Vec<IpNet> = vec!["2001:db8::/32".parse().unwrap()];
    assert_eq!(
        pool_addresses(&n, &filter(json!({"types": ["InternalIP"]})), &only_v6),
        ips(&["2001:db8::1"])
    );
    assert!(pool_addresses(&n, &filter(json!({"cidrs": ["198.51.100.0/24"]})), &[]).is_empty());
}

#[test]
fn pool_addresses_annotation_round_trips_and_refuses_garbage() {
    let sel = |v: &[(&str, &[&str])]| -> PoolSelections {
        v.iter().map(|(p, a)| (p.to_string(), a.iter().map(|a| a.parse().unwrap()).collect())).collect()
    };
    let both = sel(&[("edge", &["192.0.2.1", "2001:db8::1"]), ("other", &["198.51.100.7"])]);
    let text = format_pool_addresses(&both).unwrap();
    assert_eq!(text, "edge=192.0.2.1,2001:db8::1;other=198.51.100.7");
    assert_eq!(parse_pool_addresses(&text), Ok(both));
    // A pool with no address is left out; nothing selected is an empty value (published).
    assert_eq!(format_pool_addresses(&sel(&[("edge", &[])])).as_deref(), Some(""));
    assert_eq!(parse_pool_addresses(""), Ok(PoolSelections::new()));
    assert_eq!(parse_pool_addresses(" edge = 192.0.2.1 , ; "), Ok(sel(&[("edge", &["192.0.2.1"])])));
    // Too long to publish: not published (never truncated: a cut list would lie).
    let many: BTreeSet<IpAddr> = (0..4096u32)
        .map(|i| IpAddr::V6(std::net::Ipv6Addr::from(0x2001_0db8_u128 << 96 | u128::from(i))))
        .collect();
    assert_eq!(format_pool_addresses(&[("edge".to_string(), many)].into()), None);
    let cases: Vec<(&str, String)> = vec![
        ("no =", "edge".into()),
        ("no pool", "=192.0.2.1".into()),
        ("not an address", "edge=192.0.2.300".into()),
        ("a CIDR is not an address", "edge=192.0.2.0/24".into()),
        ("listed twice", "edge=192.0.2.1;edge=192.0.2.2".into()),
        ("too long", format!("edge={}", "1".repeat(MAX_POOL_ADDRESSES_LEN))),
    ];
    for (name, value) in cases {
        assert!(parse_pool_addresses(&value).is_err(), "{name}");
    }
}

#[test]
fn leader_lists_what_each_node_published() {
    let n = node("n", &[("InternalIP", "203.0.113.1"), ("ExternalIP", "198.51.100.200")]);
    let spec = serde_json::from_value(
        json!({"ports": [{"start": 1, "end": 2}], "addresses": {"types": ["ExternalIP"]}}),
    )
    .unwrap();
    let filter = crate::decisions::pool::validate("edge", None, None, &spec).unwrap().addresses;
    let published = |v: &str| parse_pool_addresses(v).unwrap();
    let allowed: Vec<IpNet> = vec!["192.0.2.0/25".parse().unwrap()];
    type Case = (&'static str, Option<PoolSelections>, &'static [IpNet], Vec<&'static str>);
    let cases: Vec<Case> = vec![
        ("not published: the Node object's ExternalIP", None, &[], vec!["198.51.100.200"]),
        (
            "published: exactly that, of what its Node object has",
            Some(published("edge=203.0.113.1,198.51.100.200")),
            &[],
            vec!["198.51.100.200", "203.0.113.1"],
        ),
        (
            "published outside its Node object and every bound: not listed",
            Some(published("edge=192.0.2.1,203.0.113.1")),
            &[],
            vec!["203.0.113.1"],
        ),
        ("published for other pools only: nothing", Some(published("other=192.0.2.1")), &[], vec![]),
        ("published nothing: nothing (the NATed ExternalIP)", Some(published("")), &[], vec![]),
    ];
    for (name, p, allowed, want) in cases {
        assert_eq!(pool_addresses_of(&n, p.as_ref(), "edge", &filter, allowed), ips(&want), "{name}");
    }
    let p = published("edge=192.0.2.1,192.0.2.200");
    assert_eq!(
        pool_addresses_of(&n, Some(&p), "edge", &filter, &allowed),
        ips(&["192.0.2.1"]),
        "--node-addresses"
    );

    // From the Leases: a malformed value is reported and counts as not published.
    let mut good = lease("a", 0, 15, Some("ipv4"));
    let mut bad = lease("b", 0, 15, Some("ipv4"));
    let set = |l: &mut Lease, v: &str| {
        l.metadata.annotations.get_or_insert_default().insert(ANNOTATION_POOL_ADDRESSES.into(), v.into());
    };
    set(&mut good, "edge=192.0.2.1");
    set(&mut bad, "edge=nope");
    let (by_node, malformed) = published_pool_addresses(&[good, bad, lease("c", 0, 15, Some("ipv4"))]);
    assert_eq!(by_node.keys().collect::<Vec<_>>(), ["a"]);
    assert_eq!(malformed.len(), 1);
    assert_eq!(malformed[0].0, "b");
    assert!(malformed[0].1.contains("nope"), "{}", malformed[0].1);
}

fn t(s: i64) -> Timestamp {
    Timestamp::from_second(1_700_000_000 + s).unwrap()
}

fn lease(node: &str, renewed: i64, duration: i32, families: Option<&str>) -> Lease {
    let mut l: Lease = serde_json::from_value(json!({
        "metadata": {"name": node_lease_name(node)},
        "spec": {"holderIdentity": node, "leaseDurationSeconds": duration}
    }))
    .unwrap();
    l.spec.as_mut().unwrap().renew_time = Some(MicroTime(t(renewed)));
    if let Some(f) = families {
        l.metadata.annotations = Some([(ANNOTATION_FAMILIES.to_string(), f.to_string())].into());
    }
    l
}

fn ips(v: &[&str]) -> Vec<IpAddr> {
    v.iter().map(|s| s.parse().unwrap()).collect()
}

#[test]
fn address_selection() {
    type Case = (&'static str, Vec<(&'static str, &'static str)>, Vec<&'static str>, Vec<&'static str>);
    let cases: Vec<Case> = vec![
        ("internal only", vec![("InternalIP", "10.0.0.1"), ("Hostname", "n1")], vec![], vec!["10.0.0.1"]),
        (
            "external wins over internal",
            vec![("InternalIP", "10.0.0.1"), ("ExternalIP", "203.0.113.1")],
            vec![],
            vec!["203.0.113.1"],
        ),
        (
            "per family: external v4, internal v6",
            vec![("InternalIP", "10.0.0.1"), ("ExternalIP", "203.0.113.1"), ("InternalIP", "fd00::1")],
            vec![],
            vec!["203.0.113.1", "fd00::1"],
        ),
        (
            "several externals, sorted and deduplicated",
            vec![("ExternalIP", "203.0.113.2"), ("ExternalIP", "203.0.113.1"), ("ExternalIP", "203.0.113.2")],
            vec![],
            vec!["203.0.113.1", "203.0.113.2"],
        ),
        (
            "garbage skipped",
            vec![("InternalIP", "nope"), ("InternalIP", " 10.0.0.2 ")],
            vec![],
            vec!["10.0.0.2"],
        ),
        (
            "restricted by --node-addresses",
            vec![("InternalIP", "10.0.0.1"), ("InternalIP", "192.168.1.1")],
            vec!["192.168.0.0/16"],
            vec!["192.168.1.1"],
        ),
        (
            "restriction applies before the external/internal choice",
            vec![("InternalIP", "10.0.0.1"), ("ExternalIP", "203.0.113.1")],
            vec!["10.0.0.0/8"],
            vec!["10.0.0.1"],
        ),
        ("no status", vec![], vec![], vec![]),
    ];
    for (name, addrs, allowed, want) in cases {
        let allowed: Vec<IpNet> = allowed.iter().map(|s| s.parse().unwrap()).collect();
        assert_eq!(node_addresses(&node("n", &addrs), &allowed), ips(&want), "{name}");
    }
}

#[test]
fn every_node_address_of_every_type() {
    let nodes = vec![
        node("a", &[("InternalIP", "10.0.0.1"), ("ExternalIP", "203.0.113.1"), ("Hostname", "a")]),
        node("b", &[("InternalIP", "fd00::2"), ("InternalIP", "10.0.0.1")]),
    ];
    let got = cluster_node_addresses(&nodes);
    let want: BTreeMap<IpAddr, String> =
        [("10.0.0.1", "Node a"), ("203.0.113.1", "Node a"), ("fd00::2", "Node b")]
            .into_iter()
            .map(|(a, n)| (a.parse().unwrap(), n.to_string()))
            .collect();
    assert_eq!(got.nodes, want);
}

/// The cluster's own addresses: the Node objects', what each agent publishes (a node's
/// addresses beyond its Node object; more than the bound and garbage ignored), the API
/// server's EndpointSlice (only `default/kubernetes`'s) and the Service CIDRs.
#[test]
fn the_clusters_own_addresses() {
    let nodes = vec![node("a", &[("InternalIP", "10.0.0.1")])];
    let mut published = lease("b", 0, 15, Some("ipv4"));
    let mut own = HostAddresses::default();
    for a in ["127.0.0.1", "10.0.0.2", "198.51.100.250", "fe80::1", "2001:db8::2"] {
        own.add(a.parse().unwrap(), "this node (eth0)");
    }
    let value = format_published_addresses(&own);
    assert_eq!(value, "10.0.0.2,198.51.100.250,2001:db8::2", "global addresses only");
    published.metadata.annotations.get_or_insert_default().insert(ANNOTATION_ADDRESSES.into(), value + ",x");
    let slice = |ns: &str, service: &str, addr: &str| -> crate::inputs::compact::EndpointSlice {
        serde_json::from_value(json!({
                "metadata": {"name": service, "namespace": ns, "labels": {crate::inputs::model::LABEL_SERVICE_NAME: service}},
                "addressType": "IPv4", "endpoints": [{"addresses": [addr]}]
            }))
            .unwrap()
    };
    let api = [slice("default", "kubernetes", "203.0.113.100"), slice("team", "kubernetes", "203.0.113.7")];
    let cidr: k8s_openapi::api::networking::v1::ServiceCIDR = serde_json::from_value(
        json!({"metadata": {"name": "kubernetes"}, "spec": {"cidrs": ["10.96.0.0/16"]}}),
    )
    .unwrap();
    let more = ClusterObjects { leases: &[published], api_server: &api, service_cidrs: &[cidr] };
    let got = cluster_addresses(&nodes, more);
    let owners: Vec<(String, &str)> = got.nodes.iter().map(|(a, o)| (a.to_string(), o.as_str())).collect();
    assert_eq!(
        owners,
        [
            ("10.0.0.1".to_string(), "Node a"),
            ("10.0.0.2".to_string(), "node b (its agent)"),
            ("198.51.100.250".to_string(), "node b (its agent)"),
            ("2001:db8::2".to_string(), "node b (its agent)"),
        ]
    );
    let api: Vec<String> = got.api_servers.keys().map(|a| a.to_string()).collect();
    assert_eq!(api, ["203.0.113.100"]);
    assert_eq!(
        got.service_cidrs,
        [("10.96.0.0/16".parse().unwrap(), "ServiceCIDR kubernetes (10.96.0.0/16)".into())]
    );
}

#[test]
fn listening_ports_of_every_node() {
    let mut a = lease("a", 0, 15, Some("ipv4"));
    let mut b = lease("b", -100, 15, Some("ipv4"));
    let set = |l: &mut Lease, v: &str| {
        l.metadata.annotations.get_or_insert_default().insert(ANNOTATION_LISTENING.into(), v.into());
    };
    set(&mut a, "22/TCP,20005/UDP");
    set(&mut b, "22/TCP");
    let got = listening_ports(&[a, b, lease("c", 0, 15, Some("ipv4"))]);
    let want: BTreeMap<(Protocol, u16), String> = [
        ((Protocol::Tcp, 22), "a process listens on it on a, b".to_string()),
        ((Protocol::Udp, 20005), "a process listens on it on a".to_string()),
    ]
    .into();
    assert_eq!(got, want);
}

#[test]
fn nodes_whose_agent_runs_and_has_not_reported_its_listeners() {
    let listening = |mut l: Lease, v: &str| {
        l.metadata.annotations.get_or_insert_default().insert(ANNOTATION_LISTENING.into(), v.into());
        l
    };
    let mut other = lease("x", 0, 15, Some("ipv4"));
    other.metadata.name = Some("nodelb-leader".into());
    let leases = vec![
        lease("new", 0, 15, Some("")),
        listening(lease("none-listen", 0, 15, Some("ipv4")), ""),
        listening(lease("some", 0, 15, Some("ipv4")), "22/TCP"),
        lease("gone", -100, 15, Some("ipv4")),
        lease("a-starting", 0, 15, None),
        other,
    ];
    assert_eq!(listeners_unreported(&leases, Some(t(1))), ["a-starting", "new"]);
    // A view that may be behind judges no expiry: the one gone counts too.
    assert_eq!(listeners_unreported(&leases, None), ["a-starting", "gone", "new"]);
    let mut no_spec = lease("n", 0, 15, Some("ipv4"));
    no_spec.spec = None;
    assert!(listeners_unreported(&[listening(no_spec, "")], Some(t(1))).is_empty());
}

/// Running agents that do not say they read numbers with several holders: older ones.
#[test]
fn nodes_whose_agent_cannot_read_shared_numbers() {
    let format = |mut l: Lease, v: &str| {
        l.metadata.annotations.get_or_insert_default().insert(ANNOTATION_REGISTRY_FORMAT.into(), v.into());
        l
    };
    let leases = vec![
        format(lease("new", 0, 15, Some("ipv4")), REGISTRY_FORMAT),
        format(lease("newer", 0, 15, Some("ipv4")), &format!("other, {REGISTRY_FORMAT}")),
        format(lease("odd", 0, 15, Some("ipv4")), "shared-not"),
        lease("old", 0, 15, Some("ipv4")),
        lease("gone", -100, 15, Some("ipv4")),
    ];
    assert_eq!(registry_format_unread(&leases, Some(t(1))), ["odd", "old"]);
    assert!(registry_format_unread(&leases[..2], Some(t(1))).is_empty());
}

#[test]
fn lease_freshness() {
    let v4: BTreeSet<Family> = [Family::Ipv4].into();
    let both: BTreeSet<Family> = Family::ALL.into_iter().collect();
    let cases: Vec<(&str, Lease, i64, Option<BTreeSet<Family>>)> = vec![
        ("fresh", lease("n", 0, 15, Some("ipv4")), 10, Some(v4.clone())),
        ("expired at exactly the deadline", lease("n", 0, 15, Some("ipv4")), 15, None),
        ("expired", lease("n", 0, 15, Some("ipv4")), 60, None),
        ("both families", lease("n", 0, 15, Some("ipv4, IPv6")), 1, Some(both)),
        ("not ready: empty list", lease("n", 0, 15, Some("")), 1, Some(BTreeSet::new())),
        ("no annotation", lease("n", 0, 15, None), 1, None),
        ("renewed in the future (skew) is fresh", lease("n", 5, 15, Some("ipv4")), 0, Some(v4)),
    ];
    for (name, l, now, want) in cases {
        assert_eq!(lease_families(&l, Some(t(now))), want, "{name}");
    }
    let mut no_spec = lease("n", 0, 15, Some("ipv4"));
    no_spec.spec = None;
    assert_eq!(lease_families(&no_spec, Some(t(1))), None);
}

#[test]
fn which_nodes_serve() {
    let nodes = vec![
        node("a", &[("InternalIP", "10.0.0.1"), ("InternalIP", "fd00::1")]),
        node("b", &[("InternalIP", "10.0.0.2")]),
        node("c", &[("InternalIP", "10.0.0.3")]),
        node("d", &[("InternalIP", "10.0.0.4")]),
        node("e", &[("InternalIP", "fd00::5")]),
        {
            let mut n = node("x", &[("InternalIP", "10.0.0.9")]);
            n.metadata.labels = Some([(LABEL_EXCLUDE_LB.to_string(), String::new())].into());
            n
        },
    ];
    let leases = vec![
        lease("a", 0, 15, Some("ipv4")), // v6 not served: only its v4 address
        lease("b", 0, 15, Some("ipv4")),
        lease("c", -30, 15, Some("ipv4")),   // stale
        lease("d", 0, 15, Some("")),         // not ready
        lease("e", 0, 15, Some("ipv4")),     // serves v4 but has only a v6 address
        lease("x", 0, 15, Some("ipv4")),     // excluded
        lease("ghost", 0, 15, Some("ipv4")), // no Node
    ];
    let got = serving_nodes(&nodes, &leases, Some(t(1)), &[]);
    assert_eq!(got.keys().cloned().collect::<Vec<_>>(), vec!["a", "b"]);
    assert_eq!(got["a"].addresses, ips(&["10.0.0.1"]));

    // A view of the Leases that may be behind (just after an API outage): expiry is not judged,
    // so the stale "c" stays; "not ready" (d) is still positive information and stays out.
    let got = serving_nodes(&nodes, &leases, None, &[]);
    assert_eq!(got.keys().cloned().collect::<Vec<_>>(), vec!["a", "b", "c"]);
    assert_eq!(lease_families(&lease("n", 0, 15, Some("ipv4")), None), Some([Family::Ipv4].into()));
}
