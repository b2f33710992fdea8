//! The test topology on its own, without the agent: clients reach backends directly through the node
//! namespace by plain routing (no NAT), over IPv4 and IPv6, TCP and UDP; the backends report the
//! client's own address; and the error classification of the client helpers is right.
mod common;

use std::net::IpAddr;
use std::time::{Duration, Instant};

use common::manifest::{EndpointSpec, PortSpec, ServiceSpec};
use common::topology::{
    BACKEND_TCP_PORT, BACKEND_UDP_PORT, ClientError, ClientLoop, NODE_V4, Topology, http_get, parse_answer,
    udp_request,
};

const T: Duration = Duration::from_secs(2);

#[test]
fn clients_reach_backends_through_the_node_without_nat() {
    require_root!();
    let topo = Topology::new(2, 2);
    for (ci, c) in topo.clients.iter().enumerate() {
        for b in &topo.backends {
            for (client_addr, addr) in
                [(IpAddr::V4(c.v4), IpAddr::V4(b.v4)), (IpAddr::V6(c.v6), IpAddr::V6(b.v6))]
            {
                let body = http_get(&c.ns, addr, BACKEND_TCP_PORT, T)
                    .unwrap_or_else(|e| panic!("client {ci} → {} {addr} TCP: {e:?}", b.name));
                let (name, peer) = parse_answer(&body).expect("answer format");
                assert_eq!(name, b.name);
                assert_eq!(peer.ip(), client_addr, "no NAT: the backend sees the client");

                let body = udp_request(&c.ns, addr, BACKEND_UDP_PORT, b"ping", T)
                    .unwrap_or_else(|e| panic!("client {ci} → {} {addr} UDP: {e:?}", b.name));
                let (name, peer) = parse_answer(&body).expect("answer format");
                assert_eq!(name, b.name);
                assert_eq!(peer.ip(), client_addr);
            }
        }
    }
}

#[test]
fn node_forwarding_off_cuts_the_path() {
    require_root!();
    let topo = Topology::new(1, 1);
    let be = IpAddr::V4(topo.backends[0].v4);
    assert!(http_get(topo.client(0), be, BACKEND_TCP_PORT, T).is_ok());
    topo.node.sysctl("net.ipv4.ip_forward", "0");
    let r = http_get(topo.client(0), be, BACKEND_TCP_PORT, Duration::from_millis(500));
    assert!(r.is_err(), "forwarding off, yet {r:?}");
    // IPv6 is independent of the IPv4 switch.
    let be6 = IpAddr::V6(topo.backends[0].v6);
    assert!(http_get(topo.client(0), be6, BACKEND_TCP_PORT, T).is_ok());
}

#[test]
fn client_helpers_tell_refused_from_timeout() {
    require_root!();
    let mut topo = Topology::new(1, 1);
    let node = IpAddr::V4(NODE_V4);
    // Nothing listens on the node: TCP RST → Refused, quickly.
    let start = Instant::now();
    assert_eq!(http_get(topo.client(0), node, 20080, T), Err(ClientError::Refused));
    assert!(start.elapsed() < Duration::from_secs(1));
    // UDP to a closed port: ICMP port unreachable → Refused.
    assert_eq!(udp_request(topo.client(0), node, 20053, b"x", T), Err(ClientError::Refused));
    // A silent drop → Timeout.
    topo.node.exec_ok("nft", &["add table inet nlbtest"]);
    topo.node.exec_ok("nft", &["add chain inet nlbtest in { type filter hook input priority 0; }"]);
    topo.node.exec_ok("nft", &["add rule inet nlbtest in tcp dport 20080 drop"]);
    let r = http_get(topo.client(0), node, 20080, Duration::from_millis(300));
    assert_eq!(r, Err(ClientError::Timeout));
    // A stopped backend refuses.
    topo.stop_backend(0);
    let be = IpAddr::V4(topo.backends[0].v4);
    assert_eq!(http_get(topo.client(0), be, BACKEND_TCP_PORT, T), Err(ClientError::Refused));
}

#[test]
fn client_loop_collects_results() {
    require_root!();
    let topo = Topology::new(1, 1);
    let be = IpAddr::V4(topo.backends[0].v4);
    let lp = ClientLoop::http(topo.client(0), be, BACKEND_TCP_PORT, Duration::from_millis(10), T);
    std::thread::sleep(Duration::from_millis(300));
    let results = lp.stop();
    assert!(results.len() >= 5, "only {} requests", results.len());
    assert!(results.iter().all(|r| r.as_ref().is_ok_and(|b| b.contains("backend=be1"))), "{results:?}");
}

#[test]
fn manifests_render_as_multi_document_yaml() {
    let spec = ServiceSpec::new("web")
        .port(PortSpec::tcp(80, Some(20080)))
        .port(PortSpec::udp(53, None))
        .source_range("203.0.113.0/24")
        .local_policy()
        .dual_stack()
        .endpoint(EndpointSpec::local(common::topology::backend_v4(0)))
        .endpoint(EndpointSpec::remote(common::topology::backend_v6(1), "node-2").not_ready());
    let yaml = spec.render();
    let docs: Vec<serde_json::Value> = serde_saphyr::from_multiple(&yaml).unwrap();
    assert_eq!(docs.len(), 3, "{yaml}");
    assert_eq!(docs[0]["kind"], "Service");
    assert_eq!(docs[0]["metadata"]["annotations"]["nodelb.io/ports"], "80/TCP=20080");
    assert_eq!(docs[0]["spec"]["externalTrafficPolicy"], "Local");
    assert_eq!(docs[0]["spec"]["loadBalancerSourceRanges"][0], "203.0.113.0/24");
    assert_eq!(docs[1]["addressType"], "IPv4");
    assert_eq!(docs[1]["endpoints"][0]["nodeName"], "node-1");
    assert_eq!(docs[2]["addressType"], "IPv6");
    assert_eq!(docs[2]["endpoints"][0]["conditions"]["ready"], false);
    assert_eq!(docs[2]["ports"][1]["port"], BACKEND_UDP_PORT);
}
