//! Stale UDP conntrack entries. UDP has no connection end: a client that keeps sending from the
//! same source port keeps refreshing its conntrack entry, whose DNAT binding still points at an
//! endpoint that is gone, and its traffic black-holes until the entry times out. When an endpoint
//! leaves a UDP service port, the agent deletes the DNATed entries of that node port that point
//! at it (ctnetlink dump + delete), the way kube-proxy does. A busy node's table is large: the
//! dump is read as it streams, keeping only the stale entries' tuples, at most [`BATCH`] of them
//! at a time (deleted, then the dump is taken again until a pass finds fewer), so memory stays
//! bounded whatever the table holds.

use std::collections::BTreeSet;
use std::net::IpAddr;

use netlink_packet_core::{
    NLM_F_ACK, NLM_F_DUMP, NLM_F_REQUEST, NetlinkHeader, NetlinkMessage, NetlinkPayload,
};
use netlink_packet_netfilter::conntrack::{
    ConntrackAttribute, ConntrackMessage, IPTuple, ProtoTuple, Protocol as CtProtocol, Status, Tuple,
};
use netlink_packet_netfilter::{
    NetfilterHeader, NetfilterMessage, NetfilterMessageInner, NetfilterProtoFamily,
};
use netlink_sys::{Socket, SocketAddr, protocols::NETLINK_NETFILTER};

use crate::core::domain::Protocol;
use crate::core::ruleset::plan::UdpBackend;

#[derive(Debug, thiserror::Error)]
pub enum ConntrackError {
    #[error("conntrack netlink socket: {0}")]
    Socket(std::io::Error),
    #[error("conntrack {op}: {source}")]
    Kernel { op: &'static str, source: std::io::Error },
    #[error("conntrack {op}: cannot decode the kernel's answer: {reason}")]
    Decode { op: &'static str, reason: String },
}

/// One conntrack entry, as far as we need it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Flow {
    pub protocol: u8,
    pub orig_src: Option<IpAddr>,
    pub orig_dst: Option<IpAddr>,
    pub orig_sport: Option<u16>,
    pub orig_dport: Option<u16>,
    /// In the reply direction the source is the real endpoint (after DNAT).
    pub reply_src: Option<IpAddr>,
    pub reply_sport: Option<u16>,
    pub dst_nat: bool,
    orig_tuple: Vec<Tuple>,
}

pub struct ConntrackClient {
    socket: Socket,
    seq: u32,
}

impl ConntrackClient {
    pub fn new() -> Result<ConntrackClient, ConntrackError> {
        let mut socket = Socket::new(NETLINK_NETFILTER).map_err(ConntrackError::Socket)?;
        socket.bind_auto().map_err(ConntrackError::Socket)?;
        socket.connect(&SocketAddr::new(0, 0)).map_err(ConntrackError::Socket)?;
        Ok(ConntrackClient { socket, seq: 1 })
    }

    fn send(
        &mut self,
        family: NetfilterProtoFamily,
        msg: ConntrackMessage,
        flags: u16,
    ) -> Result<u32, std::io::Error> {
        self.seq = self.seq.wrapping_add(1);
        let mut header = NetlinkHeader::default();
        header.flags = flags;
        header.sequence_number = self.seq;
        let inner = NetfilterMessage::new(NetfilterHeader::new(family, 0, 0), msg);
        let mut nl = NetlinkMessage::new(header, NetlinkPayload::InnerMessage(inner));
        nl.finalize();
        let mut buf = vec![0u8; nl.buffer_len()];
        nl.serialize(&mut buf);
        self.socket.send(&buf, 0)?;
        Ok(self.seq)
    }

    /// Receives until DONE (dumps) or the ACK/error for `seq`, handing each message to `f`, which
    /// returns whether to go on (`false`: stop reading, the rest of a dump left unread).
    fn receive(
        &mut self,
        op: &'static str,
        seq: u32,
        mut f: impl FnMut(ConntrackMessage) -> bool,
    ) -> Result<(), ConntrackError> {
        loop {
            let (buf, _) =
                self.socket.recv_from_full().map_err(|source| ConntrackError::Kernel { op, source })?;
            let mut offset = 0;
            while offset < buf.len() {
                let msg = NetlinkMessage::<NetfilterMessage>::deserialize(&buf[offset..])
                    .map_err(|e| ConntrackError::Decode { op, reason: e.to_string() })?;
                let len = msg.header.length as usize;
                if len == 0 {
                    return Err(ConntrackError::Decode { op, reason: "zero-length message".into() });
                }
                offset += (len + 3) & !3;
                if msg.header.sequence_number != seq {
                    continue;
                }
                match msg.payload {
                    NetlinkPayload::Done(_) => return Ok(()),
                    NetlinkPayload::Error(e) => {
                        return match e.code {
                            None => Ok(()),
                            Some(_) => Err(ConntrackError::Kernel { op, source: e.to_io() }),
                        };
                    }
                    NetlinkPayload::InnerMessage(NetfilterMessage {
                        inner: NetfilterMessageInner::Conntrack(ct),
                        ..
                    }) => {
                        let go_on = f(ct);
                        if !go_on {
                            return Ok(());
                        }
                    }
                    _ => {}
                }
            }
        }
    }

    /// Hands every conntrack entry of this network namespace to `f` as the dump streams in;
    /// `f` returning `false` ends the dump early (the rest is not read).
    fn each_flow(&mut self, mut f: impl FnMut(Flow) -> bool) -> Result<(), ConntrackError> {
        let seq = self
            .send(NetfilterProtoFamily::Unspec, ConntrackMessage::Get(vec![]), NLM_F_REQUEST | NLM_F_DUMP)
            .map_err(|source| ConntrackError::Kernel { op: "dump", source })?;
        let mut open = true;
        let ended = self.receive("dump", seq, |ct| {
            if let ConntrackMessage::New(attrs) = ct
                && open
            {
                open = f(flow_of(attrs));
            }
            open
        });
        if !open {
            // The dump was cut short: the kernel still has parts of it for this socket. A fresh
            // socket starts the next request clean.
            *self = ConntrackClient::new()?;
            return Ok(());
        }
        ended
    }

    /// Deletes one entry (by its original tuple). An entry that vanished meanwhile is not an error.
    pub fn delete(&mut self, flow: &Flow) -> Result<(), ConntrackError> {
        let seq = self
            .send(
                // The kernel parses the tuple by the message's family: it must be the flow's own.
                match flow.orig_src {
                    Some(IpAddr::V6(_)) => NetfilterProtoFamily::IPv6,
                    _ => NetfilterProtoFamily::IPv4,
                },
                ConntrackMessage::Delete(vec![ConntrackAttribute::CtaTupleOrig(flow.orig_tuple.clone())]),
                NLM_F_REQUEST | NLM_F_ACK,
            )
            .map_err(|source| ConntrackError::Kernel { op: "delete", source })?;
        match self.receive("delete", seq, |_| true) {
            Err(ConntrackError::Kernel { source, .. }) if source.raw_os_error() == Some(libc_enoent()) => {
                Ok(())
            }
            other => other,
        }
    }

    /// Deletes the DNATed UDP entries whose node port and endpoint are in `gone`. Returns how many.
    /// At most [`BATCH`] are held at a time: a pass of the dump that fills a batch stops there,
    /// deletes it and dumps again, until a pass finds fewer.
    pub fn delete_stale_udp(&mut self, gone: &BTreeSet<UdpBackend>) -> Result<usize, ConntrackError> {
        if gone.is_empty() {
            return Ok(0);
        }
        let mut deleted = 0;
        loop {
            let mut stale = Vec::new();
            self.each_flow(|f| {
                if is_stale(&f, gone) {
                    stale.push(f);
                }
                stale.len() < BATCH
            })?;
            for flow in &stale {
                self.delete(flow)?;
            }
            deleted += stale.len();
            if stale.len() < BATCH {
                return Ok(deleted);
            }
        }
    }
}

/// Stale entries held at most at a time ([`ConntrackClient::delete_stale_udp`]).
pub const BATCH: usize = 4096;

fn libc_enoent() -> i32 {
    nix::errno::Errno::ENOENT as i32
}

/// A DNATed UDP flow to one of the gone (node port, endpoint) pairs.
pub fn is_stale(f: &Flow, gone: &BTreeSet<UdpBackend>) -> bool {
    match (f.orig_dport, f.reply_src, f.reply_sport) {
        (Some(np), Some(addr), Some(port)) => {
            f.protocol == Protocol::Udp.number() && f.dst_nat && gone.contains(&(np, addr, port))
        }
        _ => false,
    }
}

fn flow_of(attrs: Vec<ConntrackAttribute>) -> Flow {
    let mut flow = Flow {
        protocol: 0,
        orig_src: None,
        orig_dst: None,
        orig_sport: None,
        orig_dport: None,
        reply_src: None,
        reply_sport: None,
        dst_nat: false,
        orig_tuple: vec![],
    };
    for attr in attrs {
        match attr {
            ConntrackAttribute::CtaTupleOrig(tuple) => {
                let (src, dst, sport, dport, proto) = tuple_parts(&tuple);
                flow.orig_src = src;
                flow.orig_dst = dst;
                flow.orig_sport = sport;
                flow.orig_dport = dport;
                flow.protocol = proto.unwrap_or(0);
                flow.orig_tuple = tuple;
            }
            ConntrackAttribute::CtaTupleReply(tuple) => {
                let (src, _, sport, _, _) = tuple_parts(&tuple);
                flow.reply_src = src;
                flow.reply_sport = sport;
            }
            ConntrackAttribute::CtaStatus(status) => {
                flow.dst_nat = status.contains(Status::DstNat);
            }
            _ => {}
        }
    }
    flow
}

type TupleParts = (Option<IpAddr>, Option<IpAddr>, Option<u16>, Option<u16>, Option<u8>);

fn tuple_parts(tuple: &[Tuple]) -> TupleParts {
    let (mut src, mut dst, mut sport, mut dport, mut proto) = (None, None, None, None, None);
    for t in tuple {
        match t {
            Tuple::Ip(ips) => {
                for ip in ips {
                    match ip {
                        IPTuple::SourceAddress(a) => src = Some(*a),
                        IPTuple::DestinationAddress(a) => dst = Some(*a),
                        _ => {}
                    }
                }
            }
            Tuple::Proto(ps) => {
                for p in ps {
                    match p {
                        ProtoTuple::SourcePort(n) => sport = Some(*n),
                        ProtoTuple::DestinationPort(n) => dport = Some(*n),
                        ProtoTuple::Protocol(pr) => proto = Some(ct_proto_number(pr)),
                        _ => {}
                    }
                }
            }
            _ => {}
        }
    }
    (src, dst, sport, dport, proto)
}

fn ct_proto_number(p: &CtProtocol) -> u8 {
    match p {
        CtProtocol::Tcp => 6,
        CtProtocol::Udp => 17,
        CtProtocol::Sctp => 132,
        CtProtocol::Other(n) => *n,
        _ => 0,
    }
}
