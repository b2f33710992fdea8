//! The node's listening sockets, read from the kernel of the agent's network namespace over
//! netlink `sock_diag` (`NETLINK_SOCK_DIAG`, the interface `ss` uses): TCP sockets in `LISTEN`
//! and UDP sockets that are bound but not connected, IPv4 and IPv6. Feeds the port policy
//! ([`crate::core::decisions::port_policy`]): a port a process on the node listens on is never taken.
//!
//! Why sock_diag and not `/proc/net/{tcp,udp}{,6}`: the kernel filters by state before anything
//! is copied (a node with any number of established connections sends only its few listeners), the
//! messages are typed (no hex text to parse, no format that varies across kernels), and it is
//! the same netlink family of crates as the rest of nodelb. It needs `CONFIG_INET_DIAG` (and
//! `INET_UDP_DIAG` for UDP), built into every distribution kernel; a kernel without it is an
//! error the agent reports (it then cannot tell, and says so).

use std::io;

use netlink_packet_core::{NLM_F_DUMP, NLM_F_REQUEST, NetlinkHeader, NetlinkMessage, NetlinkPayload};
use netlink_packet_sock_diag::SockDiagMessage;
use netlink_packet_sock_diag::constants::{AF_INET, AF_INET6, IPPROTO_TCP, IPPROTO_UDP};
use netlink_packet_sock_diag::inet::{ExtensionFlags, InetRequest, SocketId, StateFlags};
use netlink_sys::{Socket, SocketAddr, protocols::NETLINK_SOCK_DIAG};

use crate::core::decisions::port_policy::Listener;
use crate::core::domain::Protocol;

#[derive(Debug, thiserror::Error)]
pub enum ListenersError {
    #[error("listing the node's listening sockets (netlink sock_diag): {0}")]
    Io(#[from] io::Error),
    #[error("listing the node's {what} sockets (netlink sock_diag): the kernel answered error {code}")]
    Kernel { what: &'static str, code: i32 },
    #[error("listing the node's listening sockets (netlink sock_diag): malformed answer: {0}")]
    Decode(String),
}

/// Every TCP listener and unconnected UDP socket of this network namespace (loopback-bound ones
/// included; the policy leaves them out).
pub fn read() -> Result<Vec<Listener>, ListenersError> {
    let mut socket = Socket::new(NETLINK_SOCK_DIAG)?;
    socket.bind_auto()?;
    socket.connect(&SocketAddr::new(0, 0))?;
    let mut out = Vec::new();
    for (family, v6) in [(AF_INET, false), (AF_INET6, true)] {
        for (protocol, ipproto, states) in [
            (Protocol::Tcp, IPPROTO_TCP, StateFlags::LISTEN),
            (Protocol::Udp, IPPROTO_UDP, StateFlags::CLOSE),
        ] {
            let what = match (protocol, v6) {
                (Protocol::Tcp, false) => "TCP/IPv4",
                (Protocol::Tcp, true) => "TCP/IPv6",
                (_, false) => "UDP/IPv4",
                (_, true) => "UDP/IPv6",
            };
            let socket_id = if v6 { SocketId::new_v6() } else { SocketId::new_v4() };
            let request = InetRequest {
                family,
                protocol: ipproto,
                extensions: ExtensionFlags::empty(),
                states,
                socket_id,
            };
            dump(&socket, request, what, &mut |id: &SocketId| {
                // An unconnected UDP socket has no peer; a connected one is a client.
                if protocol == Protocol::Udp && id.destination_port != 0 {
                    return;
                }
                out.push(Listener { protocol, port: id.source_port, addr: id.source_address });
            })?;
        }
    }
    Ok(out)
}

fn dump(
    socket: &Socket,
    request: InetRequest,
    what: &'static str,
    each: &mut dyn FnMut(&SocketId),
) -> Result<(), ListenersError> {
    let mut header = NetlinkHeader::default();
    header.flags = NLM_F_REQUEST | NLM_F_DUMP;
    let mut msg = NetlinkMessage::new(header, SockDiagMessage::InetRequest(request).into());
    msg.finalize();
    let mut buf = vec![0; msg.buffer_len()];
    msg.serialize(&mut buf);
    socket.send(&buf, 0)?;
    loop {
        let (data, _) = socket.recv_from_full()?;
        if decode_datagram(&data, what, each)? {
            return Ok(());
        }
    }
}

/// Decodes one datagram of a sock_diag dump, calling `each` for every socket in it; `true` when
/// the dump is complete (`NLMSG_DONE`). Pure: any bytes give a value or an error, never a panic
/// or a loop (fuzzed: `tests/fuzzing/netlink.rs`).
pub fn decode_datagram(
    data: &[u8],
    what: &'static str,
    each: &mut dyn FnMut(&SocketId),
) -> Result<bool, ListenersError> {
    let mut offset = 0;
    while offset < data.len() {
        let reply = NetlinkMessage::<SockDiagMessage>::deserialize(&data[offset..])
            .map_err(|e| ListenersError::Decode(e.to_string()))?;
        let len = reply.header.length as usize;
        match reply.payload {
            NetlinkPayload::Done(_) => return Ok(true),
            NetlinkPayload::Error(e) => {
                let code = e.code.map_or(0, |c| c.get());
                return Err(ListenersError::Kernel { what, code });
            }
            NetlinkPayload::InnerMessage(SockDiagMessage::InetResponse(r)) => each(&r.header.socket_id),
            _ => {}
        }
        if len == 0 {
            break;
        }
        offset += len;
    }
    Ok(false)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A listener and an unconnected UDP socket this test opens are found (with their ports and
    /// protocols); a connected UDP socket is not. Runs in whatever namespace the test runs in,
    /// without privileges.
    #[test]
    fn finds_this_processes_listeners() {
        let tcp = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        let udp = std::net::UdpSocket::bind("[::1]:0").expect("bind");
        let client = std::net::UdpSocket::bind("127.0.0.1:0").expect("bind");
        client.connect(tcp.local_addr().unwrap()).expect("connect");
        let got = read().expect("sock_diag");
        let has = |p: Protocol, port: u16| got.iter().any(|l| l.protocol == p && l.port == port);
        assert!(has(Protocol::Tcp, tcp.local_addr().unwrap().port()), "{got:?}");
        assert!(has(Protocol::Udp, udp.local_addr().unwrap().port()), "{got:?}");
        assert!(!has(Protocol::Udp, client.local_addr().unwrap().port()), "a connected UDP socket: {got:?}");
    }
}
