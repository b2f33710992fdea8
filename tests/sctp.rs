//! SCTP Services with real packets. The dispatch is protocol-agnostic (`meta l4proto . th dport`),
//! so SCTP costs nothing extra; this proves it end to end. The test kernel has no SCTP stack
//! (`CONFIG_IP_SCTP` off), so the two ends speak SCTP through raw sockets: the client sends an INIT
//! to the node port, the backend receives it DNATed to its own address and target port and answers
//! with an INIT-ACK, and the client receives that reply from the node address and node port (the
//! node's conntrack undid the NAT). conntrack checks SCTP checksums (CRC32c) and verification tags,
//! so these are real, well-formed packets.
mod common;

use std::net::{IpAddr, Ipv4Addr};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::time::{Duration, Instant};

use common::agent::Agent;
use common::manifest::{EndpointSpec, PortSpec, ServiceSpec};
use common::topology::{NODE_BACKEND_V4, NODE_V4, Topology, backend_v4};

const IPPROTO_SCTP: i32 = 132;
const NODE_PORT: u16 = 20132;
const TARGET_PORT: u16 = 7777;
const CLIENT_PORT: u16 = 40132;
const INIT_TAG: u32 = 0x1234_5678;
const ACK_TAG: u32 = 0x0bad_cafe;

/// CRC32c (Castagnoli), as SCTP uses it (RFC 9260 appendix A), bit by bit.
fn crc32c(data: &[u8]) -> u32 {
    let mut crc = !0u32;
    for &b in data {
        crc ^= u32::from(b);
        for _ in 0..8 {
            crc = if crc & 1 == 1 { (crc >> 1) ^ 0x82f6_3b78 } else { crc >> 1 };
        }
    }
    !crc
}

/// An SCTP packet: common header + one INIT (type 1) or INIT-ACK (type 2, with a state cookie).
fn sctp_packet(src: u16, dst: u16, vtag: u32, chunk_type: u8, initiate_tag: u32) -> Vec<u8> {
    let mut p = Vec::new();
    p.extend_from_slice(&src.to_be_bytes());
    p.extend_from_slice(&dst.to_be_bytes());
    p.extend_from_slice(&vtag.to_be_bytes());
    p.extend_from_slice(&[0; 4]); // checksum, filled below
    let cookie: &[u8] = if chunk_type == 2 { &[0, 7, 0, 8, 1, 2, 3, 4] } else { &[] };
    let len = 4 + 16 + cookie.len() as u16;
    p.extend_from_slice(&[chunk_type, 0]);
    p.extend_from_slice(&len.to_be_bytes());
    p.extend_from_slice(&initiate_tag.to_be_bytes());
    p.extend_from_slice(&65535u32.to_be_bytes()); // a_rwnd
    p.extend_from_slice(&1u16.to_be_bytes()); // outbound streams
    p.extend_from_slice(&1u16.to_be_bytes()); // inbound streams
    p.extend_from_slice(&1u32.to_be_bytes()); // initial TSN
    p.extend_from_slice(cookie);
    // The CRC is stored little-endian (RFC 9260 appendix A).
    let crc = crc32c(&p);
    p[8..12].copy_from_slice(&crc.to_le_bytes());
    p
}

/// A raw IPv4 SCTP socket in the calling thread's namespace (the kernel writes the IP header on
/// send and hands us the whole IP packet on receive).
fn raw_socket() -> OwnedFd {
    // SAFETY: plain socket(2); the result is checked before it is owned.
    let fd = unsafe { libc::socket(libc::AF_INET, libc::SOCK_RAW, IPPROTO_SCTP) };
    assert!(fd >= 0, "raw SCTP socket: {}", std::io::Error::last_os_error());
    // SAFETY: a fresh descriptor nobody else owns.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    let tv = libc::timeval { tv_sec: 0, tv_usec: 200_000 };
    // SAFETY: a valid timeval of the right size.
    let rc = unsafe {
        libc::setsockopt(
            fd.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_RCVTIMEO,
            (&raw const tv).cast(),
            size_of::<libc::timeval>() as libc::socklen_t,
        )
    };
    assert_eq!(rc, 0, "SO_RCVTIMEO");
    fd
}

fn send_to(fd: &OwnedFd, to: Ipv4Addr, packet: &[u8]) {
    let addr = libc::sockaddr_in {
        sin_family: libc::AF_INET as libc::sa_family_t,
        sin_port: 0,
        sin_addr: libc::in_addr { s_addr: u32::from(to).to_be() },
        sin_zero: [0; 8],
    };
    // SAFETY: the buffer and address outlive the call; sizes are theirs.
    let n = unsafe {
        libc::sendto(
            fd.as_raw_fd(),
            packet.as_ptr().cast(),
            packet.len(),
            0,
            (&raw const addr).cast(),
            size_of::<libc::sockaddr_in>() as libc::socklen_t,
        )
    };
    assert_eq!(n, packet.len() as isize, "sendto: {}", std::io::Error::last_os_error());
}

/// One received SCTP packet: IP source and destination, SCTP ports, verification tag, first
/// chunk's type and initiate tag.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Seen {
    src: Ipv4Addr,
    dst: Ipv4Addr,
    sport: u16,
    dport: u16,
    vtag: u32,
    chunk: u8,
    initiate_tag: u32,
}

/// Waits up to `timeout` for an SCTP packet matching `want`.
fn receive(fd: &OwnedFd, timeout: Duration, want: impl Fn(&Seen) -> bool) -> Option<Seen> {
    let deadline = Instant::now() + timeout;
    let mut buf = [0u8; 2048];
    while Instant::now() < deadline {
        // SAFETY: the buffer is ours and its length is given.
        let n = unsafe { libc::recv(fd.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len(), 0) };
        if n <= 0 {
            continue;
        }
        let p = &buf[..n as usize];
        let ihl = usize::from(p[0] & 0x0f) * 4;
        if p.len() < ihl + 24 {
            continue;
        }
        let s = &p[ihl..];
        let u16_at = |i: usize| u16::from_be_bytes([s[i], s[i + 1]]);
        let u32_at = |i: usize| u32::from_be_bytes([s[i], s[i + 1], s[i + 2], s[i + 3]]);
        let seen = Seen {
            src: Ipv4Addr::new(p[12], p[13], p[14], p[15]),
            dst: Ipv4Addr::new(p[16], p[17], p[18], p[19]),
            sport: u16_at(0),
            dport: u16_at(2),
            vtag: u32_at(4),
            chunk: s[12],
            initiate_tag: u32_at(16),
        };
        if want(&seen) {
            return Some(seen);
        }
    }
    None
}

/// Client → node port (INIT), backend ← DNATed INIT, backend → INIT-ACK, client ← reply from the
/// node port. `Cluster` masquerades (the backend sees the node), `Local` keeps the client address.
fn sctp_round_trip(local: bool) {
    let topo = Topology::new(1, 1);
    let mut port = PortSpec::udp(9, Some(NODE_PORT));
    port.protocol = "SCTP".into();
    port.name = "sctp-9".into();
    port.target_port = TARGET_PORT;
    let mut svc = ServiceSpec::new("assoc").port(port).endpoint(EndpointSpec::local(backend_v4(0)));
    if local {
        svc = svc.local_policy();
    }
    let mut agent = Agent::start(&topo.node, &[("assoc.yaml", svc.render())], &[]);
    agent.wait_ready(Duration::from_secs(15));
    agent.wait_state("default/assoc", "programmed", Duration::from_secs(5));

    let client_addr = topo.clients[0].v4;
    let backend_addr = topo.backends[0].v4;
    // The backend listens first (its raw socket also keeps its kernel from answering "protocol
    // unreachable"), in its own namespace, on a thread of its own.
    let backend = {
        let (ready_tx, ready_rx) = std::sync::mpsc::channel();
        let ns_path = topo.backends[0].ns.name.clone();
        let handle = std::thread::spawn(move || {
            common::netns::NetNs::enter_path(&ns_path);
            let fd = raw_socket();
            ready_tx.send(()).expect("ready");
            let init = receive(&fd, Duration::from_secs(5), |s| s.chunk == 1 && s.initiate_tag == INIT_TAG)?;
            let ack = sctp_packet(init.dport, init.sport, INIT_TAG, 2, ACK_TAG);
            send_to(&fd, init.src, &ack);
            Some(init)
        });
        ready_rx.recv().expect("backend ready");
        handle
    };
    let reply = topo.clients[0].ns.run(move || {
        let fd = raw_socket();
        let init = sctp_packet(CLIENT_PORT, NODE_PORT, 0, 1, INIT_TAG);
        send_to(&fd, NODE_V4, &init);
        receive(&fd, Duration::from_secs(5), |s| s.chunk == 2 && s.dport == CLIENT_PORT)
    });
    let init = backend.join().expect("backend thread").expect("the backend received the INIT");
    assert_eq!(
        (init.dst, init.dport),
        (backend_addr, TARGET_PORT),
        "DNAT to endpoint address and target port"
    );
    let expected_src = if local { client_addr } else { NODE_BACKEND_V4 };
    assert_eq!(init.src, expected_src, "source seen by the backend (local policy: {local})");
    let reply = reply.expect("the client received the INIT-ACK");
    assert_eq!(
        (IpAddr::V4(reply.src), reply.sport, reply.dst, reply.vtag, reply.initiate_tag),
        (IpAddr::V4(NODE_V4), NODE_PORT, client_addr, INIT_TAG, ACK_TAG),
        "the reply comes back from the node port, un-NATed by the node's conntrack"
    );
}

#[test]
fn sctp_association_setup_crosses_the_node_cluster_policy() {
    require_root!();
    sctp_round_trip(false);
}

#[test]
fn sctp_association_setup_crosses_the_node_local_policy() {
    require_root!();
    sctp_round_trip(true);
}

#[test]
fn crc32c_matches_the_rfc_test_vector() {
    // RFC 3720 B.4: 32 bytes of zeros.
    assert_eq!(crc32c(&[0u8; 32]), 0x8a91_36aa);
}
