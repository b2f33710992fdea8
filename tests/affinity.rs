//! `sessionAffinity: ClientIP` with real packets: client namespaces → node → three backends (see
//! `tests/common/topology.rs`). The agent keeps, per endpoint of an affinity Service port, a
//! dynamic set of the clients it served last (`aff4-…`/`aff6-…`, with the Service's
//! `timeoutSeconds`); the tests read those sets with `nft -j` where a statistical check alone
//! could pass by luck.
mod common;

use std::collections::BTreeSet;
use std::net::IpAddr;
use std::time::Duration;

use common::agent::{Agent, nft};
use common::manifest::{EndpointSpec, PortSpec, ServiceSpec, render_all};
use common::netns::NetNs;
use common::topology::{
    NODE_V4, NODE_V6, Topology, backend_v4, backend_v6, http_get, parse_answer, wait_until,
};

const T: Duration = Duration::from_secs(2);
const READY: Duration = Duration::from_secs(15);
const CHANGE: Duration = Duration::from_secs(5);
const NODE_PORT: u16 = 20090;

/// `default/sticky`, 80/TCP on [`NODE_PORT`], ClientIP affinity with `timeout`, the backends
/// `backends` (indexes) of both families, all on this node.
fn sticky(timeout: u32, backends: &[usize]) -> ServiceSpec {
    ServiceSpec::new("sticky")
        .port(PortSpec::tcp(80, Some(NODE_PORT)))
        .dual_stack()
        .client_ip_affinity(timeout)
        .endpoints(backends.iter().map(|&j| EndpointSpec::local(backend_v4(j))))
        .endpoints(backends.iter().map(|&j| EndpointSpec::local(backend_v6(j))))
}

fn start(topo: &Topology, spec: &ServiceSpec) -> Agent {
    let mut agent = Agent::start(&topo.node, &[("svc.yaml", render_all(&[spec]))], &[]);
    agent.wait_ready(READY);
    agent.wait_state(&spec.key(), "programmed", CHANGE);
    agent
}

/// Rewrites the manifest and waits until the node's table has exactly the affinity sets of
/// `backends` (one per backend and family).
fn change(topo: &Topology, agent: &Agent, spec: &ServiceSpec) {
    agent.write_manifest("svc.yaml", &render_all(&[spec]));
    let want = spec.endpoints.len();
    let ok = wait_until(CHANGE, || affinity_sets(&topo.node).len() == want);
    assert!(ok, "affinity sets of {:?}: {:?}", spec.endpoints, affinity_sets(&topo.node));
}

/// The backend (`be1`…) of each of `n` GETs from `ns` to `addr`, panicking on a failure.
fn backends_seen(ns: &NetNs, addr: IpAddr, n: usize) -> Vec<String> {
    (0..n)
        .map(|i| {
            let body =
                http_get(ns, addr, NODE_PORT, T).unwrap_or_else(|e| panic!("request {i} to {addr}: {e:?}"));
            parse_answer(&body).unwrap_or_else(|| panic!("bad answer {body:?}")).0
        })
        .collect()
}

/// The one backend all of `n` requests reached; panics if they were spread.
fn the_backend(ns: &NetNs, addr: IpAddr, n: usize) -> String {
    let seen = backends_seen(ns, addr, n);
    let distinct: BTreeSet<&String> = seen.iter().collect();
    assert_eq!(distinct.len(), 1, "every request of one client to one endpoint ({addr}): {seen:?}");
    seen[0].clone()
}

/// Every affinity set of the node's table: (endpoint `addr:port` from its comment, clients).
fn affinity_sets(node: &NetNs) -> Vec<(String, Vec<String>)> {
    let listing: serde_json::Value =
        serde_json::from_str(&nft(node, &["-j", "list", "table", "inet", "nodelb"])).expect("nft -j output");
    listing["nftables"]
        .as_array()
        .expect("nftables array")
        .iter()
        .filter_map(|o| o.get("set"))
        .filter(|s| s["name"].as_str().is_some_and(|n| n.starts_with("aff")))
        .map(|s| {
            let comment = s["comment"].as_str().unwrap_or_default();
            let endpoint = comment.rsplit("clients of ").next().unwrap_or_default().to_string();
            let clients = s["elem"]
                .as_array()
                .map(|els| {
                    els.iter()
                        .filter_map(|e| e["elem"]["val"].as_str().or(e.as_str()).map(String::from))
                        .collect()
                })
                .unwrap_or_default();
            (endpoint, clients)
        })
        .collect()
}

/// The endpoints (`addr:port`) whose affinity set holds `client`.
fn affinities_of(node: &NetNs, client: IpAddr) -> Vec<String> {
    let c = client.to_string();
    affinity_sets(node).into_iter().filter(|(_, clients)| clients.contains(&c)).map(|(ep, _)| ep).collect()
}

/// `be2` → its IPv4 endpoint as the sets' comments write it.
fn endpoint_v4(backend: &str) -> String {
    let j: usize = backend.trim_start_matches("be").parse::<usize>().expect("beN") - 1;
    format!("{}:8080", backend_v4(j))
}

#[test]
fn every_request_of_a_client_reaches_one_endpoint_and_clients_spread() {
    require_root!();
    let topo = Topology::new(10, 3);
    let agent = start(&topo, &sticky(10_800, &[0, 1, 2]));
    let status = agent.service_status("default/sticky").expect("status");
    assert_eq!(status["sessionAffinitySeconds"], 10_800, "{status}");
    // A timeout the API server would refuse is refused here, naming the field and the value;
    // the good Service next to it is served.
    let mut bad = sticky(0, &[0]);
    bad.name = "bad".into();
    bad.ports[0].node_port = Some(NODE_PORT + 1);
    agent.write_manifest("bad.yaml", &render_all(&[&bad]));
    agent.wait_state("default/bad", "refused", CHANGE);
    let reason = agent.service_status("default/bad").expect("status")["reason"]
        .as_str()
        .unwrap_or_default()
        .to_string();
    assert!(
        reason.contains("spec.sessionAffinityConfig.clientIP.timeoutSeconds") && reason.contains("\"0\""),
        "{reason}"
    );
    for addr in [IpAddr::V4(NODE_V4), IpAddr::V6(NODE_V6)] {
        let chosen: Vec<String> = topo.clients.iter().map(|c| the_backend(&c.ns, addr, 15)).collect();
        // Ten clients on one backend out of three: a chance of 3^-9.
        let distinct: BTreeSet<&String> = chosen.iter().collect();
        assert!(distinct.len() > 1, "clients spread over the endpoints ({addr}): {chosen:?}");
    }
    // The kernel holds exactly one affinity per client and family.
    for (i, c) in topo.clients.iter().enumerate() {
        for addr in [IpAddr::V4(c.v4), IpAddr::V6(c.v6)] {
            assert_eq!(
                affinities_of(&topo.node, addr).len(),
                1,
                "client {i} ({addr}): {:?}",
                affinity_sets(&topo.node)
            );
        }
    }
}

#[test]
fn an_affinity_lasts_while_its_endpoint_does_and_moves_once_when_it_goes() {
    require_root!();
    let topo = Topology::new(1, 3);
    let c = &topo.clients[0];
    let v4 = IpAddr::V4(NODE_V4);
    let all = [0, 1, 2];
    let agent = start(&topo, &sticky(10_800, &all));
    let first = the_backend(&c.ns, v4, 10);
    let first_j: usize = first.trim_start_matches("be").parse::<usize>().unwrap() - 1;

    // Another endpoint goes, and comes back: the affinity stays.
    let other = (first_j + 1) % 3;
    let without_other: Vec<usize> = all.iter().copied().filter(|&j| j != other).collect();
    change(&topo, &agent, &sticky(10_800, &without_other));
    assert_eq!(the_backend(&c.ns, v4, 10), first, "another endpoint left");
    change(&topo, &agent, &sticky(10_800, &all));
    assert_eq!(the_backend(&c.ns, v4, 10), first, "another endpoint came back");

    // Its own endpoint goes: the client moves, once, and stays on its new endpoint.
    let without_first: Vec<usize> = all.iter().copied().filter(|&j| j != first_j).collect();
    change(&topo, &agent, &sticky(10_800, &without_first));
    let second = the_backend(&c.ns, v4, 10);
    assert_ne!(second, first);
    // It comes back: the old affinity went with it, the client stays where it is now.
    change(&topo, &agent, &sticky(10_800, &all));
    assert!(
        affinities_of(&topo.node, IpAddr::V4(c.v4)) == [endpoint_v4(&second)],
        "{:?}",
        affinity_sets(&topo.node)
    );
    assert_eq!(the_backend(&c.ns, v4, 10), second, "the returning endpoint does not take the client back");
}

#[test]
fn an_idle_affinity_expires_after_timeout_seconds_and_an_active_one_does_not() {
    require_root!();
    let topo = Topology::new(1, 3);
    let c = &topo.clients[0];
    let client = IpAddr::V4(c.v4);
    let _agent = start(&topo, &sticky(3, &[0, 1, 2]));
    let first = the_backend(&c.ns, IpAddr::V4(NODE_V4), 3);
    assert_eq!(affinities_of(&topo.node, client), [endpoint_v4(&first)]);
    // A request every second for 5 s: each restarts the 3 s timeout, the client stays put.
    for _ in 0..5 {
        std::thread::sleep(Duration::from_secs(1));
        assert_eq!(the_backend(&c.ns, IpAddr::V4(NODE_V4), 1), first, "an active client keeps its affinity");
    }
    // Idle for longer than the timeout: the kernel forgets the client.
    std::thread::sleep(Duration::from_millis(3_500));
    assert_eq!(affinities_of(&topo.node, client), Vec::<String>::new(), "{:?}", affinity_sets(&topo.node));
    // The next request is drawn afresh and recorded again.
    let next = the_backend(&c.ns, IpAddr::V4(NODE_V4), 1);
    assert_eq!(affinities_of(&topo.node, client), [endpoint_v4(&next)]);
}

#[test]
fn affinities_survive_an_agent_restart() {
    require_root!();
    let topo = Topology::new(3, 3);
    let mut agent = start(&topo, &sticky(10_800, &[0, 1, 2]));
    let before: Vec<String> =
        topo.clients.iter().map(|c| the_backend(&c.ns, IpAddr::V4(NODE_V4), 5)).collect();
    let recorded: Vec<Vec<String>> =
        topo.clients.iter().map(|c| affinities_of(&topo.node, IpAddr::V4(c.v4))).collect();
    agent.restart();
    agent.wait_ready(READY);
    // The new agent replaced the whole table (its first sync is a full replace) ...
    let metrics = agent.http("/metrics").expect("metrics").body;
    let full = metrics.lines().find(|l| {
        l.starts_with("nodelb_syncs_total") && l.contains("kind=\"full\"") && l.contains("result=\"success\"")
    });
    assert!(full.is_some_and(|l| !l.ends_with(" 0")), "a full replace after the restart:\n{metrics}");
    // ... and put every affinity back before any client came again.
    for (i, c) in topo.clients.iter().enumerate() {
        assert_eq!(
            affinities_of(&topo.node, IpAddr::V4(c.v4)),
            recorded[i],
            "client {i}: {:?}",
            affinity_sets(&topo.node)
        );
    }
    let after: Vec<String> =
        topo.clients.iter().map(|c| the_backend(&c.ns, IpAddr::V4(NODE_V4), 5)).collect();
    assert_eq!(after, before);
}
