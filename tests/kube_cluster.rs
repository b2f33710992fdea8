//! Kubernetes mode end to end: three real `nodelb run --kubeconfig …` agents, each in its own node
//! namespace, against the in-process test API server (`nodelb-testapi`) in another namespace, with
//! real packets client → node → backends. See `tests/common/cluster.rs` for the topology.
//!
//! Each test builds its own cluster (namespaces, API server, agents) and tears it down on drop, also
//! on panic (the agents' logs are printed then).
mod common;

use std::collections::{BTreeMap, BTreeSet};
use std::net::IpAddr;
use std::time::{Duration, Instant};

use common::cluster::{CLIENT_V4, Cluster, node_v4};
use common::manifest::{EndpointSpec, PortSpec, ServiceSpec};
use common::topology::{ClientError, ClientLoop, backend_v4, parse_answer, wait_until};

/// Per-request timeout where an answer is expected.
const T: Duration = Duration::from_secs(2);
/// A Service change to allocation / rules on every node.
const CHANGE: Duration = Duration::from_secs(15);

/// `default/<name>`, `80/TCP` → backends `eps` (backend index, node index).
fn web(name: &str, eps: &[(usize, usize)]) -> ServiceSpec {
    ServiceSpec::new(name)
        .port(PortSpec::tcp(80, None))
        .endpoints(eps.iter().map(|(b, n)| EndpointSpec::remote(backend_v4(*b), &format!("node-{}", n + 1))))
}

/// The backends answering `n` requests to node `i`'s `port`.
fn backends_seen(c: &Cluster, i: usize, port: u16, n: usize) -> BTreeMap<String, usize> {
    let mut m = BTreeMap::new();
    for k in 0..n {
        let body = c.get(i, port, T).unwrap_or_else(|e| panic!("request {k} to node-{}:{port}: {e:?}", i + 1));
        let (b, _) = parse_answer(&body).unwrap_or_else(|| panic!("bad answer {body:?}"));
        *m.entry(b).or_insert(0) += 1;
    }
    m
}

fn names(m: &BTreeMap<String, usize>) -> Vec<&str> {
    m.keys().map(String::as_str).collect()
}

/// Only the leader of the moment writes Services: every Service write came from one of `leaders`.
fn assert_only_leaders_wrote(c: &Cluster, leaders: &[usize]) {
    let writers = c.service_writers();
    let allowed: BTreeSet<usize> = leaders.iter().copied().collect();
    assert!(writers.is_subset(&allowed), "Service writes from {writers:?}, leaders were {allowed:?}");
}

#[test]
fn service_is_served_on_every_node_with_status() {
    require_root!();
    let c = Cluster::new(2);
    c.create(&web("web", &[(0, 0), (1, 1)]));
    let ports = c.wait_allocated("web", 1, CHANGE);
    let np = ports["80/TCP"];
    assert!((20000..=29999).contains(&np), "{ports:?}");
    for i in 0..3 {
        c.wait_served(i, np, CHANGE);
        let seen = backends_seen(&c, i, np, 30);
        assert_eq!(names(&seen), ["be1", "be2"], "node-{}: {seen:?}", i + 1);
    }
    c.wait_ingress_nodes("web", &[0, 1, 2], CHANGE);
    for ing in c.ingress("web") {
        assert_eq!(ing["ipMode"], "Proxy", "{ing}");
        assert_eq!(ing["ports"], serde_json::json!([{"port": np, "protocol": "TCP"}]), "{ing}");
    }
    let cond = c.allocated_condition("web").expect("condition nodelb.io/Allocated");
    assert_eq!(cond["status"], "True", "{cond}");
    let leader = c.wait_leader(CHANGE);
    assert_eq!(c.service_writers(), BTreeSet::from([leader]), "only the leader writes Services");
    assert!(!c.events("web", "NodePortsAllocated").is_empty(), "a NodePortsAllocated Event");
}
