//! The root test topology: client namespaces → node namespace → backend namespaces, joined by veths
//! and two bridges inside the node namespace. Only documentation address ranges are used:
//!
//! ```text
//!  client i  (eth0: 203.0.113.(10+i)/24, 2001:db8:1::(10+i)/64, default via the node)
//!     │
//!  node      (br-c: 203.0.113.1/24, 2001:db8:1::1/64 │ br-b: 198.51.100.1/24, 2001:db8:2::1/64)
//!     │
//!  backend j (eth0: 198.51.100.(11+j)/24, 2001:db8:2::(11+j)/64, default via the node)
//! ```
//!
//! Backends run in-process servers on threads joined to their namespace: a TCP server that answers
//! every HTTP/1.0-style request with `backend=<name> peer=<addr>:<port>` and a UDP server that answers
//! every datagram the same way. Everything is stopped and deleted on drop.

use std::io::{ErrorKind, Read, Write};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, TcpListener, TcpStream, UdpSocket};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use super::netns::{NetNs, veth};

/// Node address on the client side.
pub const NODE_V4: Ipv4Addr = Ipv4Addr::new(203, 0, 113, 1);
pub const NODE_V6: Ipv6Addr = Ipv6Addr::new(0x2001, 0xdb8, 1, 0, 0, 0, 0, 1);
/// Node address on the backend side (what backends see with masquerade).
pub const NODE_BACKEND_V4: Ipv4Addr = Ipv4Addr::new(198, 51, 100, 1);
pub const NODE_BACKEND_V6: Ipv6Addr = Ipv6Addr::new(0x2001, 0xdb8, 2, 0, 0, 0, 0, 1);
/// Port the backends' TCP (HTTP) server listens on.
pub const BACKEND_TCP_PORT: u16 = 8080;
/// Port the backends' UDP server listens on.
pub const BACKEND_UDP_PORT: u16 = 5353;
/// Node name the agent is started with (`--node-name`).
pub const NODE_NAME: &str = "node-1";

pub fn client_v4(i: usize) -> Ipv4Addr {
    Ipv4Addr::new(203, 0, 113, 10 + i as u8)
}
pub fn client_v6(i: usize) -> Ipv6Addr {
    Ipv6Addr::new(0x2001, 0xdb8, 1, 0, 0, 0, 0, 0x10 + i as u16)
}
pub fn backend_v4(j: usize) -> Ipv4Addr {
    Ipv4Addr::new(198, 51, 100, 11 + j as u8)
}
pub fn backend_v6(j: usize) -> Ipv6Addr {
    Ipv6Addr::new(0x2001, 0xdb8, 2, 0, 0, 0, 0, 0x11 + j as u16)
}

/// A backend namespace with its servers.
pub struct Backend {
    /// `be1`, `be2`, … — the name the servers put in their answers.
    pub name: String,
    pub v4: Ipv4Addr,
    pub v6: Ipv6Addr,
    pub servers: Option<Servers>,
    // Declared last: the namespace goes after the servers have stopped.
    pub ns: NetNs,
}

pub struct Client {
    pub v4: Ipv4Addr,
    pub v6: Ipv6Addr,
    pub ns: NetNs,
}

pub struct Topology {
    pub clients: Vec<Client>,
    pub backends: Vec<Backend>,
    pub node: NetNs,
}

impl Topology {
    /// Builds `clients` client namespaces and `backends` backend namespaces around one node namespace,
    /// with IPv4 and IPv6 forwarding on in the node, and starts the backend servers.
    pub fn new(clients: usize, backends: usize) -> Topology {
        assert!((1..=40).contains(&clients) && backends <= 40);
        let node = NetNs::new("node");
        node.ip(&["link", "add", "br-c", "type", "bridge"]);
        node.ip(&["link", "add", "br-b", "type", "bridge"]);
        for br in ["br-c", "br-b"] {
            // No IPv6 DAD delays, no STP delays: links are usable at once.
            node.sysctl(&format!("net.ipv6.conf.{br}.accept_dad"), "0");
            node.ip(&["link", "set", br, "up"]);
        }
        node.ip(&["addr", "add", &format!("{NODE_V4}/24"), "dev", "br-c"]);
        node.ip(&["addr", "add", &format!("{NODE_V6}/64"), "dev", "br-c", "nodad"]);
        node.ip(&["addr", "add", &format!("{NODE_BACKEND_V4}/24"), "dev", "br-b"]);
        node.ip(&["addr", "add", &format!("{NODE_BACKEND_V6}/64"), "dev", "br-b", "nodad"]);
        node.sysctl("net.ipv4.ip_forward", "1");
        node.sysctl("net.ipv6.conf.all.forwarding", "1");

        let mut cs = Vec::new();
        for i in 0..clients {
            let ns = NetNs::new(&format!("cl{i}"));
            let (v4, v6) = (client_v4(i), client_v6(i));
            attach(&node, "br-c", &format!("c{i}"), &ns, v4, v6, NODE_V4, NODE_V6);
            cs.push(Client { v4, v6, ns });
        }
        let mut bs = Vec::new();
        for j in 0..backends {
            let ns = NetNs::new(&format!("be{}", j + 1));
            let (v4, v6) = (backend_v4(j), backend_v6(j));
            attach(&node, "br-b", &Self::backend_port(j), &ns, v4, v6, NODE_BACKEND_V4, NODE_BACKEND_V6);
            let name = format!("be{}", j + 1);
            let servers = Servers::start(&ns, &name, BACKEND_TCP_PORT, BACKEND_UDP_PORT);
            bs.push(Backend { name, v4, v6, servers: Some(servers), ns });
        }
        Topology { clients: cs, backends: bs, node }
    }

    pub fn client(&self, i: usize) -> &NetNs {
        &self.clients[i].ns
    }

    /// Stops the servers of backend `j` (its address stays up: connections get refused).
    pub fn stop_backend(&mut self, j: usize) {
        self.backends[j].servers.take();
    }

    /// The node's bridge port (on `br-b`) towards backend `j`.
    pub fn backend_port(j: usize) -> String {
        format!("b{j}")
    }

    /// Hairpin mode of every backend's bridge port (`br-b`), as a CNI sets it per pod.
    pub fn set_hairpin(&self, on: bool) {
        for j in 0..self.backends.len() {
            let port = Self::backend_port(j);
            self.node.ip(&[
                "link",
                "set",
                &port,
                "type",
                "bridge_slave",
                "hairpin",
                if on { "on" } else { "off" },
            ]);
        }
    }
}

#[allow(clippy::too_many_arguments)]
fn attach(
    node: &NetNs,
    bridge: &str,
    node_if: &str,
    ns: &NetNs,
    v4: Ipv4Addr,
    v6: Ipv6Addr,
    gw4: Ipv4Addr,
    gw6: Ipv6Addr,
) {
    ns.sysctl("net.ipv6.conf.default.accept_dad", "0");
    veth(node, node_if, ns, "eth0");
    node.ip(&["link", "set", node_if, "master", bridge]);
    ns.ip(&["addr", "add", &format!("{v4}/24"), "dev", "eth0"]);
    ns.ip(&["addr", "add", &format!("{v6}/64"), "dev", "eth0", "nodad"]);
    ns.ip(&["route", "add", "default", "via", &gw4.to_string()]);
    ns.ip(&["-6", "route", "add", "default", "via", &gw6.to_string()]);
}

/// Prints a peer address the way the servers report it (IPv4-mapped IPv6 shown as IPv4).
pub fn peer_string(peer: SocketAddr) -> String {
    match peer {
        SocketAddr::V6(v6) => match v6.ip().to_ipv4_mapped() {
            Some(v4) => SocketAddr::new(IpAddr::V4(v4), v6.port()).to_string(),
            None => peer.to_string(),
        },
        SocketAddr::V4(_) => peer.to_string(),
    }
}

/// The TCP and UDP servers of one backend; stopped (threads joined) on drop.
pub struct Servers {
    stop: Arc<AtomicBool>,
    threads: Vec<JoinHandle<()>>,
}

impl Servers {
    /// Binds `[::]:tcp_port` and `[::]:udp_port` (dual-stack) inside `ns` and serves until dropped.
    pub fn start(ns: &NetNs, name: &str, tcp_port: u16, udp_port: u16) -> Servers {
        Self::start_at(ns, name, IpAddr::V6(Ipv6Addr::UNSPECIFIED), tcp_port, udp_port)
    }

    /// Like [`Servers::start`], bound to `addr` alone.
    pub fn start_at(ns: &NetNs, name: &str, addr: IpAddr, tcp_port: u16, udp_port: u16) -> Servers {
        let stop = Arc::new(AtomicBool::new(false));
        let (tcp, udp) = ns.run(move || {
            let tcp = TcpListener::bind((addr, tcp_port)).expect("bind backend TCP");
            tcp.set_nonblocking(true).unwrap();
            let udp = UdpSocket::bind((addr, udp_port)).expect("bind backend UDP");
            udp.set_read_timeout(Some(Duration::from_millis(50))).unwrap();
            (tcp, udp)
        });
        let mut threads = Vec::new();
        {
            let (stop, name) = (stop.clone(), name.to_string());
            threads.push(std::thread::spawn(move || serve_tcp(tcp, &name, &stop)));
        }
        {
            let (stop, name) = (stop.clone(), name.to_string());
            threads.push(std::thread::spawn(move || serve_udp(udp, &name, &stop)));
        }
        Servers { stop, threads }
    }
}

impl Drop for Servers {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

fn serve_tcp(listener: TcpListener, name: &str, stop: &AtomicBool) {
    while !stop.load(Ordering::SeqCst) {
        match listener.accept() {
            Ok((stream, peer)) => {
                let body = format!("backend={name} peer={}\n", peer_string(peer));
                std::thread::spawn(move || answer_http(stream, body));
            }
            Err(e) if e.kind() == ErrorKind::WouldBlock => std::thread::sleep(Duration::from_millis(2)),
            Err(_) => std::thread::sleep(Duration::from_millis(2)),
        }
    }
}

fn answer_http(mut stream: TcpStream, body: String) {
    let _ = stream.set_nonblocking(false);
    let _ = stream.set_read_timeout(Some(Duration::from_secs(2)));
    let _ = stream.set_nodelay(true);
    // Read the request head (up to the blank line, or EOF, or 8 KiB).
    let mut buf = Vec::new();
    let mut chunk = [0u8; 1024];
    while !buf.windows(4).any(|w| w == b"\r\n\r\n") && buf.len() < 8192 {
        match stream.read(&mut chunk) {
            Ok(0) | Err(_) => break,
            Ok(n) => buf.extend_from_slice(&chunk[..n]),
        }
    }
    let resp = format!(
        "HTTP/1.0 200 OK\r\nContent-Type: text/plain\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    let _ = stream.write_all(resp.as_bytes());
    let _ = stream.flush();
}

fn serve_udp(sock: UdpSocket, name: &str, stop: &AtomicBool) {
    let mut buf = [0u8; 2048];
    while !stop.load(Ordering::SeqCst) {
        if let Ok((_, peer)) = sock.recv_from(&mut buf) {
            let body = format!("backend={name} peer={}\n", peer_string(peer));
            let _ = sock.send_to(body.as_bytes(), peer);
        }
    }
}

/// Why a client request did not get an answer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ClientError {
    /// Connection refused (TCP RST, or ICMP port/admin unreachable).
    Refused,
    /// No answer within the timeout.
    Timeout,
    /// Anything else (reset mid-request, unreachable network, bad response, …).
    Other(String),
}

fn classify(e: std::io::Error) -> ClientError {
    match e.kind() {
        ErrorKind::ConnectionRefused => ClientError::Refused,
        ErrorKind::TimedOut | ErrorKind::WouldBlock => ClientError::Timeout,
        _ => ClientError::Other(format!("{:?}: {e}", e.kind())),
    }
}

/// An HTTP answer: status code and body.
#[derive(Debug, Clone)]
pub struct HttpResponse {
    pub status: u16,
    pub body: String,
}

/// `GET path` over a fresh TCP connection to `addr:port`, on the calling thread (which must already
/// be in the right namespace). The whole exchange must finish within `timeout`.
pub fn http_request_here(
    addr: IpAddr,
    port: u16,
    path: &str,
    timeout: Duration,
) -> Result<HttpResponse, ClientError> {
    let deadline = Instant::now() + timeout;
    let mut s = TcpStream::connect_timeout(&SocketAddr::new(addr, port), timeout).map_err(classify)?;
    let left = deadline.saturating_duration_since(Instant::now()).max(Duration::from_millis(1));
    s.set_read_timeout(Some(left)).map_err(classify)?;
    s.set_write_timeout(Some(left)).map_err(classify)?;
    let host = SocketAddr::new(addr, port);
    s.write_all(format!("GET {path} HTTP/1.0\r\nHost: {host}\r\nUser-Agent: nodelb-test\r\n\r\n").as_bytes())
        .map_err(classify)?;
    let mut raw = Vec::new();
    let mut chunk = [0u8; 4096];
    loop {
        if Instant::now() >= deadline {
            return Err(ClientError::Timeout);
        }
        match s.read(&mut chunk) {
            Ok(0) => break,
            Ok(n) => raw.extend_from_slice(&chunk[..n]),
            Err(e) => return Err(classify(e)),
        }
    }
    let text = String::from_utf8_lossy(&raw).into_owned();
    let (head, body) =
        text.split_once("\r\n\r\n").ok_or_else(|| ClientError::Other(format!("no HTTP head in {text:?}")))?;
    let status = head
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| ClientError::Other(format!("bad status line in {head:?}")))?;
    Ok(HttpResponse { status, body: body.to_string() })
}

/// `GET path` from inside `ns`.
pub fn http_request(
    ns: &NetNs,
    addr: IpAddr,
    port: u16,
    path: &str,
    timeout: Duration,
) -> Result<HttpResponse, ClientError> {
    let path = path.to_string();
    ns.run(move || http_request_here(addr, port, &path, timeout))
}

/// `GET /` from inside `ns`; the body on a 200 answer.
pub fn http_get(ns: &NetNs, addr: IpAddr, port: u16, timeout: Duration) -> Result<String, ClientError> {
    let r = http_request(ns, addr, port, "/", timeout)?;
    if r.status != 200 {
        return Err(ClientError::Other(format!("HTTP {}: {}", r.status, r.body)));
    }
    Ok(r.body)
}

/// One UDP datagram from a fresh socket, on the calling thread; the first answer's text.
pub fn udp_request_here(
    addr: IpAddr,
    port: u16,
    payload: &[u8],
    timeout: Duration,
) -> Result<String, ClientError> {
    let bind: SocketAddr = match addr {
        IpAddr::V4(_) => (Ipv4Addr::UNSPECIFIED, 0).into(),
        IpAddr::V6(_) => (Ipv6Addr::UNSPECIFIED, 0).into(),
    };
    let s = UdpSocket::bind(bind).map_err(classify)?;
    // Connected, so ICMP errors come back as ECONNREFUSED.
    s.connect((addr, port)).map_err(classify)?;
    s.set_read_timeout(Some(timeout)).map_err(classify)?;
    s.send(payload).map_err(classify)?;
    let mut buf = [0u8; 2048];
    let n = s.recv(&mut buf).map_err(classify)?;
    Ok(String::from_utf8_lossy(&buf[..n]).into_owned())
}

/// One UDP request/response from inside `ns`.
pub fn udp_request(
    ns: &NetNs,
    addr: IpAddr,
    port: u16,
    payload: &[u8],
    timeout: Duration,
) -> Result<String, ClientError> {
    let payload = payload.to_vec();
    ns.run(move || udp_request_here(addr, port, &payload, timeout))
}

/// Parses `backend=<name> peer=<addr>` answers.
pub fn parse_answer(body: &str) -> Option<(String, SocketAddr)> {
    let mut backend = None;
    let mut peer = None;
    for word in body.split_whitespace() {
        if let Some(v) = word.strip_prefix("backend=") {
            backend = Some(v.to_string());
        } else if let Some(v) = word.strip_prefix("peer=") {
            peer = v.parse().ok();
        }
    }
    Some((backend?, peer?))
}

/// Polls `cond` every 50 ms until it holds (true) or `timeout` passes (false).
pub fn wait_until(timeout: Duration, mut cond: impl FnMut() -> bool) -> bool {
    let deadline = Instant::now() + timeout;
    loop {
        if cond() {
            return true;
        }
        if Instant::now() >= deadline {
            return false;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// A client sending requests in a loop (one new connection each) from a thread in its namespace,
/// until stopped. Collects every result.
pub struct ClientLoop {
    stop: Arc<AtomicBool>,
    results: Arc<Mutex<Vec<Result<String, ClientError>>>>,
    thread: Option<JoinHandle<()>>,
}

impl ClientLoop {
    /// HTTP GETs to `addr:port` every `interval`, each with `timeout`.
    pub fn http(ns: &NetNs, addr: IpAddr, port: u16, interval: Duration, timeout: Duration) -> ClientLoop {
        let one = move || {
            let r = http_request_here(addr, port, "/", timeout)?;
            if r.status == 200 { Ok(r.body) } else { Err(ClientError::Other(format!("HTTP {}", r.status))) }
        };
        Self::start(ns, one, interval)
    }

    /// UDP requests to `addr:port` every `interval`, each from a fresh socket, with `timeout`.
    pub fn udp(ns: &NetNs, addr: IpAddr, port: u16, interval: Duration, timeout: Duration) -> ClientLoop {
        Self::start(ns, move || udp_request_here(addr, port, b"ping", timeout), interval)
    }

    fn start(
        ns: &NetNs,
        mut one: impl FnMut() -> Result<String, ClientError> + Send + 'static,
        interval: Duration,
    ) -> ClientLoop {
        let stop = Arc::new(AtomicBool::new(false));
        let results = Arc::new(Mutex::new(Vec::new()));
        let path = format!("/run/netns/{}", ns.name);
        let (s, res) = (stop.clone(), results.clone());
        let thread = std::thread::spawn(move || {
            let f = std::fs::File::open(&path).expect("open netns");
            nix::sched::setns(f, nix::sched::CloneFlags::CLONE_NEWNET).expect("setns");
            // Bounded: at most 10 minutes' worth, whatever the caller does.
            let hard_stop = Instant::now() + Duration::from_secs(600);
            while !s.load(Ordering::SeqCst) && Instant::now() < hard_stop {
                let r = one();
                res.lock().unwrap().push(r);
                std::thread::sleep(interval);
            }
        });
        ClientLoop { stop, results, thread: Some(thread) }
    }

    /// The results so far, in order.
    pub fn snapshot(&self) -> Vec<Result<String, ClientError>> {
        self.results.lock().unwrap().clone()
    }

    /// Stops the loop and returns every result, in order.
    pub fn stop(mut self) -> Vec<Result<String, ClientError>> {
        self.stop.store(true, Ordering::SeqCst);
        if let Some(t) = self.thread.take() {
            t.join().expect("client loop panicked");
        }
        self.snapshot()
    }
}

impl Drop for ClientLoop {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}
