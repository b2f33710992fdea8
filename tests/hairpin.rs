//! Hairpin: a backend reaching its own Service through the node (`node-ip:node-port`), on the test
//! topology where the backends sit on bridge `br-b` of the node namespace and br_netfilter hands
//! bridged IP traffic to the netfilter hooks (`net.bridge.bridge-nf-call-iptables` = 1, the
//! default of a new namespace on this kernel).
//!
//! With hairpin mode on the bridge ports, every such connection must work, under both traffic
//! policies (under `Local` only if nodelb masquerades the connections whose endpoint is their own
//! client, and only those). With hairpin mode off, the bridge drops the ones drawn to the client
//! itself, which nodelb cannot change: it must say so.
mod common;

use std::net::{IpAddr, SocketAddr};
use std::time::Duration;

use common::agent::{Agent, nodelb};
use common::manifest::{EndpointSpec, PortSpec, ServiceSpec, render_all};
use common::netns::NetNs;
use common::topology::{
    ClientError, NODE_BACKEND_V4, NODE_BACKEND_V6, NODE_V4, NODE_V6, Topology, backend_v4, backend_v6,
    http_get, parse_answer, wait_until,
};

/// Per-request timeout where an answer is expected.
const T: Duration = Duration::from_secs(2);
/// Per-request timeout where some requests are expected to get no answer.
const SHORT: Duration = Duration::from_millis(700);
const READY: Duration = Duration::from_secs(15);
const CHANGE: Duration = Duration::from_secs(5);
/// Requests per Service and family: with two endpoints, the client itself is drawn about half
/// the time, so all of them avoiding it (a test that cannot fail) has a chance of 2^-40.
const REQUESTS: usize = 40;

/// `default/<name>` on node port `np`, endpoints be1 and be2 (both families) on this node.
fn both_backends(name: &str, np: u16) -> ServiceSpec {
    ServiceSpec::new(name).port(PortSpec::tcp(80, Some(np))).dual_stack().endpoints([
        EndpointSpec::local(backend_v4(0)),
        EndpointSpec::local(backend_v4(1)),
        EndpointSpec::local(backend_v6(0)),
        EndpointSpec::local(backend_v6(1)),
    ])
}

fn start(topo: &Topology, specs: &[&ServiceSpec]) -> Agent {
    let mut agent = Agent::start(&topo.node, &[("svc.yaml", render_all(specs))], &[]);
    agent.wait_ready(READY);
    for s in specs {
        agent.wait_state(&s.key(), "programmed", CHANGE);
    }
    agent
}

/// `n` GETs from `ns` to `addr:port`: each answer as (backend, peer) or the error.
fn requests(
    ns: &NetNs,
    addr: IpAddr,
    port: u16,
    n: usize,
    timeout: Duration,
) -> Vec<Result<(String, SocketAddr), ClientError>> {
    (0..n)
        .map(|_| {
            let body = http_get(ns, addr, port, timeout)?;
            parse_answer(&body).ok_or_else(|| ClientError::Other(format!("bad answer {body:?}")))
        })
        .collect()
}

#[test]
fn a_backend_reaches_its_own_service_through_the_node_under_both_policies() {
    require_root!();
    let topo = Topology::new(1, 2);
    // br_netfilter on (the default of a new namespace here), as a bridge CNI needs it: without
    // it be2's answer to be1 under Local would cross the bridge outside the node's conntrack.
    topo.node.sysctl("net.bridge.bridge-nf-call-iptables", "1");
    topo.node.sysctl("net.bridge.bridge-nf-call-ip6tables", "1");
    topo.set_hairpin(true);
    let cluster = both_backends("cluster", 20081);
    let local = both_backends("local", 20082).local_policy();
    let _agent = start(&topo, &[&cluster, &local]);

    let be1 = &topo.backends[0];
    for (node_addr, own, masq) in [
        (IpAddr::V4(NODE_V4), IpAddr::V4(be1.v4), IpAddr::V4(NODE_BACKEND_V4)),
        (IpAddr::V6(NODE_V6), IpAddr::V6(be1.v6), IpAddr::V6(NODE_BACKEND_V6)),
    ] {
        for (svc, port) in [(&cluster, 20081), (&local, 20082)] {
            let what = format!("{} {node_addr}:{port} from be1", svc.key());
            let results = requests(&be1.ns, node_addr, port, REQUESTS, T);
            let failed: Vec<_> = results.iter().enumerate().filter(|(_, r)| r.is_err()).collect();
            assert!(failed.is_empty(), "{what}: {} of {REQUESTS} failed: {failed:?}", failed.len());
            let answers: Vec<(String, SocketAddr)> = results.into_iter().map(Result::unwrap).collect();
            let to_itself = answers.iter().filter(|(b, _)| b == "be1").count();
            assert!(to_itself > 0 && to_itself < REQUESTS, "{what}: both endpoints drawn: {answers:?}");
            for (backend, peer) in &answers {
                if backend == "be1" {
                    // Answering itself directly would bypass the node's conntrack: masqueraded.
                    assert_eq!(peer.ip(), masq, "{what}: a connection to itself is masqueraded");
                } else if svc.traffic_policy == "Local" {
                    // Exactly those: drawn to the other endpoint, the client keeps its address.
                    assert_eq!(peer.ip(), own, "{what}: Local keeps the address of a client sent elsewhere");
                } else {
                    assert_eq!(peer.ip(), masq, "{what}: Cluster masquerades everything");
                }
            }
        }
    }
}

/// The `hairpin` warnings of the agent's `/status`.
fn hairpin_warnings(agent: &Agent) -> Vec<serde_json::Value> {
    agent.status().and_then(|s| s["hairpin"].as_array().cloned()).unwrap_or_default()
}

#[test]
fn hairpin_off_behind_br_netfilter_is_diagnosed_until_turned_on() {
    require_root!();
    let topo = Topology::new(1, 2);
    // The topology's state on this kernel, made explicit: bridged IP traffic goes through the
    // netfilter hooks, and the backends' bridge ports have hairpin mode off.
    topo.node.sysctl("net.bridge.bridge-nf-call-iptables", "1");
    topo.node.sysctl("net.bridge.bridge-nf-call-ip6tables", "1");
    topo.set_hairpin(false);
    let web = both_backends("web", 20081);
    let agent = start(&topo, &[&web]);

    // What the diagnosis is about: connections drawn to the client itself get no answer.
    let be1 = &topo.backends[0];
    let results = requests(&be1.ns, IpAddr::V4(NODE_V4), 20081, 20, SHORT);
    assert!(results.iter().any(|r| r.is_err()), "hairpin off: some must fail: {results:?}");

    assert!(wait_until(CHANGE, || !hairpin_warnings(&agent).is_empty()), "no hairpin warning in /status");
    let warnings = hairpin_warnings(&agent);
    assert_eq!(warnings.len(), 1, "{warnings:?}");
    let w = &warnings[0];
    assert_eq!(w["bridge"], "br-b", "{w}");
    let ports: Vec<&str> = w["ports"].as_array().unwrap().iter().filter_map(|p| p.as_str()).collect();
    assert_eq!(ports, ["b0", "b1"], "{w}");
    let message = w["message"].as_str().unwrap();
    for needle in ["br-b", "hairpin", "bridge-nf-call-iptables", "hairpinMode"] {
        assert!(message.contains(needle), "message names {needle}: {message}");
    }
    let out = nodelb(&topo.node, &["status", "--http-addr", "127.0.0.1:9470"]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("hairpin") && text.contains("br-b"), "nodelb status:\n{text}");
    // Logged once, not at every sync.
    std::thread::sleep(Duration::from_secs(2));
    let logged = agent.logs().matches("hairpin mode is off").count();
    assert_eq!(logged, 1, "logged once:\n{}", agent.logs());

    topo.set_hairpin(true);
    assert!(wait_until(CHANGE, || hairpin_warnings(&agent).is_empty()), "warning stays after the fix");
    let results = requests(&be1.ns, IpAddr::V4(NODE_V4), 20081, REQUESTS, T);
    assert!(results.iter().all(Result::is_ok), "hairpin on: {results:?}");
}
