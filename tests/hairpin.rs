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

use common::agent::Agent;
use common::manifest::{EndpointSpec, PortSpec, ServiceSpec, render_all};
use common::netns::NetNs;
use common::topology::{
    ClientError, NODE_BACKEND_V4, NODE_BACKEND_V6, NODE_V4, NODE_V6, Topology, backend_v4, backend_v6,
    http_get, parse_answer,
};

/// Per-request timeout where an answer is expected.
const T: Duration = Duration::from_secs(2);
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
