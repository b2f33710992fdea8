//! Planner scenarios shared by the golden tests (pure) and the kernel equivalence test.

use std::collections::{BTreeMap, BTreeSet};

use nodelb::core::domain::{Family, PortId, Protocol, ServiceKey};
use nodelb::core::inputs::model::{Endpoint, LbPort, LbService, TrafficPolicy};
use nodelb::core::ruleset::ir::Ruleset;
use nodelb::core::ruleset::plan::{self, NodeFacts, ServicePlan};

pub const NODE: &str = "node-1";
pub const NODE_V4: &str = "203.0.113.1";
pub const NODE_V6: &str = "2001:db8:1::1";
/// A second IPv4 address of the node (another interface).
pub const SECOND_V4: &str = "192.0.2.1";

pub fn ep(addr: &str, port: u16, node: &str, ready: bool) -> Endpoint {
    Endpoint {
        addr: addr.parse().unwrap(),
        port,
        node_name: Some(node.into()),
        ready,
        serving: ready,
        terminating: false,
    }
}

pub fn svc(name: &str, ports: Vec<(u16, Protocol, Vec<Endpoint>)>) -> LbService {
    let ports = ports
        .into_iter()
        .map(|(port, protocol, endpoints)| LbPort {
            id: PortId { port, protocol },
            name: String::new(),
            endpoints,
        })
        .collect();
    LbService::with_defaults(ServiceKey::new("default", name), ports)
}

pub fn two_backends() -> Vec<Endpoint> {
    vec![ep("198.51.100.11", 8080, NODE, true), ep("198.51.100.12", 8080, "node-2", true)]
}

pub fn node(families: &[Family]) -> NodeFacts {
    NodeFacts {
        node_name: NODE.into(),
        families: families.iter().copied().collect::<BTreeSet<_>>(),
        masquerade_mark: plan::DEFAULT_MASQUERADE_MARK,
        connection_mark: plan::DEFAULT_CONNECTION_MARK,
        forward_mark: None,
        nat_shards: 1,
    }
}

/// A named scenario: services with their node ports.
pub struct Scenario {
    pub name: &'static str,
    pub services: Vec<(LbService, BTreeMap<PortId, u16>)>,
    pub node: NodeFacts,
    /// Services whose node port pool restricts node addresses: the addresses serving them.
    pub addresses: BTreeMap<ServiceKey, BTreeSet<std::net::IpAddr>>,
}

/// A scenario whose Services are served on every local address (no pool restricts them).
fn scenario(
    name: &'static str,
    services: Vec<(LbService, BTreeMap<PortId, u16>)>,
    node: NodeFacts,
) -> Scenario {
    Scenario { name, services, node, addresses: BTreeMap::new() }
}

pub fn ports(svc: &LbService, first: u16) -> BTreeMap<PortId, u16> {
    svc.ports.iter().enumerate().map(|(i, p)| (p.id, first + i as u16)).collect()
}

pub fn scenarios() -> Vec<Scenario> {
    let web = svc("web", vec![(80, Protocol::Tcp, two_backends())]);
    let mut local = svc("local", vec![(80, Protocol::Tcp, two_backends())]);
    local.traffic_policy = TrafficPolicy::Local;
    let mut ranged = svc("ranged", vec![(443, Protocol::Tcp, two_backends())]);
    ranged.source_ranges = vec!["203.0.113.0/25".parse().unwrap(), "2001:db8:1::/64".parse().unwrap()];
    ranged.families = vec![Family::Ipv4, Family::Ipv6];
    let empty = svc(
        "empty",
        vec![
            (80, Protocol::Tcp, vec![ep("198.51.100.13", 80, NODE, false)]),
            (53, Protocol::Udp, vec![ep("198.51.100.13", 53, NODE, false)]),
        ],
    );
    let dns = svc(
        "dns",
        vec![
            (53, Protocol::Udp, vec![ep("198.51.100.11", 5353, NODE, true)]),
            (53, Protocol::Tcp, vec![ep("198.51.100.11", 5353, NODE, true)]),
        ],
    );
    let mut dual = svc(
        "dual",
        vec![(
            80,
            Protocol::Tcp,
            vec![ep("198.51.100.11", 8080, NODE, true), ep("2001:db8:2::11", 8080, NODE, true)],
        )],
    );
    dual.families = vec![Family::Ipv4, Family::Ipv6];
    // ClientIP affinity: two IPv4 endpoints (lookups, draws that record), one IPv6 endpoint.
    let mut sticky = svc(
        "sticky",
        vec![(80, Protocol::Tcp, [two_backends(), vec![ep("2001:db8:2::11", 8080, NODE, true)]].concat())],
    );
    sticky.families = vec![Family::Ipv4, Family::Ipv6];
    sticky.session_affinity = Some(600);
    let all = [Family::Ipv4, Family::Ipv6];
    // A pool restricted to one IPv4 node address (SECOND_V4): a dual-stack Service is served
    // there only (not on NODE_V4, not over IPv6), next to an unrestricted one.
    let mut edge = svc(
        "edge",
        vec![
            (443, Protocol::Tcp, [two_backends(), vec![ep("2001:db8:2::11", 8080, NODE, true)]].concat()),
            (53, Protocol::Udp, vec![ep("198.51.100.13", 53, NODE, false)]),
        ],
    );
    edge.families = vec![Family::Ipv4, Family::Ipv6];
    let second: std::net::IpAddr = SECOND_V4.parse().unwrap();
    vec![
        Scenario {
            name: "pool_addresses",
            services: vec![(web.clone(), ports(&web, 20001)), (edge.clone(), ports(&edge, 20010))],
            node: node(&all),
            addresses: BTreeMap::from([(edge.key.clone(), BTreeSet::from([second]))]),
        },
        scenario("empty", vec![], node(&all)),
        scenario("web", vec![(web.clone(), ports(&web, 20001))], node(&all)),
        scenario("local", vec![(local.clone(), ports(&local, 20002))], node(&all)),
        scenario("ranged", vec![(ranged.clone(), ports(&ranged, 20003))], node(&all)),
        scenario("no_endpoints", vec![(empty.clone(), ports(&empty, 20004))], node(&all)),
        scenario(
            "dns",
            vec![(dns.clone(), BTreeMap::from([(dns.ports[0].id, 20053), (dns.ports[1].id, 20053)]))],
            node(&all),
        ),
        scenario("dual_stack", vec![(dual.clone(), ports(&dual, 20006))], node(&all)),
        scenario(
            "dual_stack_v4_forwarding_off",
            vec![(dual.clone(), ports(&dual, 20006))],
            node(&[Family::Ipv6]),
        ),
        scenario(
            "web_iptables_forward_accept",
            vec![(web.clone(), ports(&web, 20001))],
            NodeFacts { forward_mark: Some(0x2000), ..node(&all) },
        ),
        scenario("affinity", vec![(sticky.clone(), ports(&sticky, 20008))], node(&all)),
        scenario(
            "mixed",
            vec![
                (web.clone(), ports(&web, 20001)),
                (local.clone(), ports(&local, 20002)),
                (ranged.clone(), ports(&ranged, 20003)),
                (empty.clone(), ports(&empty, 20004)),
            ],
            node(&all),
        ),
        // The nat chains spread over four tables (`--nat-shards 4`): every kind of Service
        // port (source ranges, no endpoints, affinity, a pool's addresses, a shared node port).
        Scenario {
            name: "sharded",
            services: vec![
                (web.clone(), ports(&web, 20001)),
                (local.clone(), ports(&local, 20002)),
                (ranged.clone(), ports(&ranged, 20003)),
                (empty.clone(), ports(&empty, 20004)),
                (dns.clone(), BTreeMap::from([(dns.ports[0].id, 20053), (dns.ports[1].id, 20053)])),
                (sticky.clone(), ports(&sticky, 20008)),
                (edge.clone(), ports(&edge, 20010)),
            ],
            node: NodeFacts { nat_shards: 4, ..node(&all) },
            addresses: BTreeMap::from([(edge.key.clone(), BTreeSet::from([second]))]),
        },
    ]
}

/// `s` planned with its nat chains spread over `shards` tables.
pub fn plan_sharded(s: &Scenario, shards: u8) -> Ruleset {
    let plans: Vec<ServicePlan<'_>> =
        s.services.iter().map(|(svc, p)| ServicePlan { service: svc, node_ports: p }).collect();
    plan::plan_with(&plans, &NodeFacts { nat_shards: shards, ..s.node.clone() }, &s.addresses)
}

pub fn plan_of(s: &Scenario) -> Ruleset {
    let plans: Vec<ServicePlan<'_>> =
        s.services.iter().map(|(svc, p)| ServicePlan { service: svc, node_ports: p }).collect();
    plan::plan_with(&plans, &s.node, &s.addresses)
}

/// The benchmarks' scale ruleset: `n` Services `s<i>`, one TCP port each, `endpoints` endpoints at
/// unused documentation addresses, node ports from 1024 up (distinct up to 64,000 Services);
/// `affinity`: every Service with `sessionAffinity: ClientIP` (a dynamic set per endpoint);
/// `nat_shards`: the node's `--nat-shards`.
pub fn scale_ruleset(n: usize, endpoints: usize, affinity: bool, nat_shards: u8) -> Ruleset {
    assert!(n <= 64_000, "scale_ruleset: at most 64,000 Services (one node port each)");
    let lb: Vec<(LbService, BTreeMap<PortId, u16>)> = (0..n)
        .map(|i| {
            let eps = (0..endpoints)
                .map(|k| {
                    let a = std::net::Ipv4Addr::new(198, 51, 100, 100 + ((i + k) % 150) as u8);
                    ep(&a.to_string(), 10000 + (i % 50000) as u16, NODE, true)
                })
                .collect();
            let mut l = svc(&format!("s{i}"), vec![(80, Protocol::Tcp, eps)]);
            l.session_affinity = affinity.then_some(10_800);
            let ports = BTreeMap::from([(l.ports[0].id, 1024 + i as u16)]);
            (l, ports)
        })
        .collect();
    let plans: Vec<ServicePlan<'_>> =
        lb.iter().map(|(s, p)| ServicePlan { service: s, node_ports: p }).collect();
    plan::plan(&plans, &NodeFacts { nat_shards, ..node(&[Family::Ipv4]) })
}
