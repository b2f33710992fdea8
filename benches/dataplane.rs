//! nodelb versus the klipper-lb way, side by side in one run. A benchmark, not a test: it
//! prints (and writes as Markdown) a comparison, every number next to the direct route measured in the
//! same run, and never fails on a number. Variants: (a) direct, (b) nodelb, (c) klipper's iptables rules
//! (nft and legacy), (d) nat-floor, the least nftables NAT (one DNAT + one masquerade rule), against
//! which nodelb's own per-connection work is reported, (e) nodelb-affinity, nodelb with
//! `sessionAffinity: ClientIP` on the measured Service (docs/benchmarks.md, Method).
//!
//! ```text
//! sudo scripts/bench.sh --quick       # N = 1, 100, 1,000; a few minutes
//! sudo scripts/bench.sh               # N up to 10,000
//! cargo bench --bench dataplane -- --quick --out FILE.md --svg FILE.svg
//! ```
//!
//! Everything happens in network namespaces this process creates (client → node → backend, from
//! `tests/common`), with documentation addresses only; they are deleted on exit, on panic and on
//! Ctrl-C/SIGTERM. The host namespace is never touched.

#[path = "../tests/common/mod.rs"]
mod common;

use std::collections::BTreeMap;
use std::io::{Read, Write};
use std::net::{IpAddr, Ipv4Addr, SocketAddr, TcpListener, TcpStream};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use common::agent::Agent;
use common::cluster::{ANNOTATION_ALLOCATED, Cluster, node_v4};
use common::manifest::{EndpointSpec, PortSpec, ServiceSpec};
use common::netns::NetNs;
use common::scenarios::{ep, node as node_facts, svc};
use common::topology::{NODE_V4, Topology, backend_v4, client_v4};
use nodelb::core::domain::{Family, PortId, Protocol};
use nodelb::core::inputs::model::LbService;
use nodelb::core::ruleset::ir::{Carried, ChainType, Key, Ruleset};
use nodelb::core::ruleset::plan::{self, ServicePlan};
use nodelb::encode::nft::NftClient;

/// Port of the fast HTTP server in the backend namespace.
const HTTP_PORT: u16 = 8080;
/// Port of the iperf3 server in the backend namespace.
const IPERF_PORT: u16 = 5201;
/// Node port of the worst-placed Service (the target of every connect measurement).
const TARGET_NODE_PORT: u16 = 20000;
/// Node port of the extra Service that forwards to iperf3.
const IPERF_NODE_PORT: u16 = 19999;
/// Node port the reaction benchmark adds and removes (requested by annotation).
const REACTION_NODE_PORT: u16 = 29990;

// ---------------------------------------------------------------------------------------------
// Configuration

struct Config {
    quick: bool,
    sizes: Vec<usize>,
    reps: usize,
    conns: usize,
    warmup: usize,
    iperf_secs: u32,
    /// Largest N at which the klipper rules are also programmed one command per rule.
    per_command_max: usize,
    reaction_n: usize,
    reaction_changes: usize,
    footprint_n: usize,
    footprint_endpoints: usize,
    out: Option<String>,
    svg: Option<String>,
    svg_link: String,
    /// `--only a,b`: the parts to run (see [`PARTS`]); empty: all.
    only: Vec<String>,
    /// `--agent-log DIR`: keep the agents' logs there (they have a per-sync time breakdown).
    agent_log: Option<String>,
    /// `--scale`: the scale mode at [`Config::scale_sizes`] instead of the comparison.
    scale: bool,
    /// `--scale-sizes 10000,50000`.
    scale_sizes: Vec<usize>,
    /// Extra arguments of every agent the benchmark starts.
    agent_args: Vec<String>,
    /// Node port the reaction benchmark requests (by annotation).
    reaction_port: u16,
    /// `--kube-setup live|existing`: how the Kubernetes mode's N Services come to be.
    kube_setup: KubeSetupMode,
    /// `--nat-shards K` (scale mode): the agents run with it, and the programming and
    /// per-connection rows are measured with the nat chains in one table and over K tables,
    /// side by side (1: one table only). Without it the agents run with their default (`auto`)
    /// and K at N is what `auto` gives N Services ([`shards_at`]).
    nat_shards: Option<u8>,
}

/// How the Kubernetes-mode part gets its N Services.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum KubeSetupMode {
    /// Created while the agent runs: it allocates and programs them as they arrive (the API
    /// server's create rate and the agent share the machine).
    Live,
    /// Created with the agent stopped, then the agent started: an agent installed into (or
    /// restarted in) a cluster that already has them. Its first round allocates all N at once.
    Existing,
}

impl Config {
    fn wants(&self, part: &str) -> bool {
        self.only.is_empty() || self.only.iter().any(|p| p == part)
    }
}

/// What `--only` can select.
/// `programming` is the scale mode's kernel programming alone (part of `dataplane`, which also
/// runs the connections over the NAT floor).
const PARTS: [&str; 5] = ["dataplane", "programming", "reaction", "kube-reaction", "footprint"];

fn config() -> Config {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let quick = args.iter().any(|a| a == "--quick");
    let value = |flag: &str| args.iter().position(|a| a == flag).and_then(|i| args.get(i + 1)).cloned();
    let svg = value("--svg");
    let svg_link =
        value("--svg-link").or_else(|| svg.as_deref().map(|s| s.rsplit('/').next().unwrap_or(s).to_string()));
    let mut c = if quick {
        Config {
            quick,
            sizes: vec![1, 100, 1_000],
            reps: 5,
            conns: 600,
            warmup: 100,
            iperf_secs: 2,
            per_command_max: 1_000,
            reaction_n: 1_000,
            reaction_changes: 100,
            footprint_n: 1_000,
            footprint_endpoints: 5,
            out: None,
            svg: None,
            svg_link: String::new(),
            only: Vec::new(),
            agent_log: None,
            scale: false,
            scale_sizes: Vec::new(),
            agent_args: Vec::new(),
            reaction_port: REACTION_NODE_PORT,
            kube_setup: KubeSetupMode::Live,
            nat_shards: None,
        }
    } else {
        Config {
            quick,
            sizes: vec![1, 100, 1_000, 10_000],
            reps: 5,
            conns: 3_000,
            warmup: 300,
            iperf_secs: 5,
            per_command_max: 1_000,
            reaction_n: 1_000,
            reaction_changes: 100,
            footprint_n: 10_000,
            footprint_endpoints: 5,
            out: None,
            svg: None,
            svg_link: String::new(),
            only: Vec::new(),
            agent_log: None,
            scale: false,
            scale_sizes: Vec::new(),
            agent_args: Vec::new(),
            reaction_port: REACTION_NODE_PORT,
            kube_setup: KubeSetupMode::Live,
            nat_shards: None,
        }
    };
    // Scale defaults first: the flags below override them.
    if args.iter().any(|a| a == "--scale") {
        // Up to 50,000 Services: node ports from 1024 (the default range holds 10,000), the
        // reaction Service's port outside the range so no filler can hold it.
        c.scale = true;
        c.scale_sizes = vec![10_000, 50_000];
        c.reps = 3;
        c.conns = 3_000;
        c.warmup = 300;
        c.reaction_changes = 200;
        c.footprint_endpoints = 5;
        c.agent_args =
            ["--port-range", "1024-64999", "--allowed-node-ports", "65000"].map(String::from).to_vec();
        c.reaction_port = 65_000;
        // Created live, 50,000 Services took the API server over half an hour on two cores it
        // shares with the agent (docs/benchmarks.md): the scale mode creates them first.
        c.kube_setup = KubeSetupMode::Existing;
        if let Some(s) = value("--scale-sizes") {
            c.scale_sizes = s.split(',').filter_map(|x| x.trim().parse().ok()).collect();
        }
        c.nat_shards = value("--nat-shards").and_then(|k| k.parse().ok());
        if let Some(k) = c.nat_shards {
            c.agent_args.extend(["--nat-shards".to_string(), k.to_string()]);
        }
    }
    if let Some(s) = value("--sizes") {
        c.sizes = s.split(',').filter_map(|x| x.trim().parse().ok()).collect();
    }
    if let Some(r) = value("--reps").and_then(|r| r.parse().ok()) {
        c.reps = r;
    }
    if let Some(n) = value("--agent-n").and_then(|r| r.parse().ok()) {
        c.reaction_n = n;
        c.footprint_n = n;
    }
    if let Some(n) = value("--changes").and_then(|r| r.parse().ok()) {
        c.reaction_changes = n;
    }
    if let Some(o) = value("--only") {
        c.only = o.split(',').map(|p| p.trim().to_string()).filter(|p| !p.is_empty()).collect();
        for p in &c.only {
            if !PARTS.contains(&p.as_str()) {
                eprintln!("dataplane bench: --only {p}: unknown part (known: {})", PARTS.join(", "));
                std::process::exit(2);
            }
        }
    }
    match value("--kube-setup").as_deref() {
        None => {}
        Some("live") => c.kube_setup = KubeSetupMode::Live,
        Some("existing") => c.kube_setup = KubeSetupMode::Existing,
        Some(other) => {
            eprintln!("dataplane bench: --kube-setup {other}: unknown (known: live, existing)");
            std::process::exit(2);
        }
    }
    c.agent_log = value("--agent-log");
    c.out = value("--out");
    c.svg = svg;
    c.svg_link = svg_link.unwrap_or_default();
    c
}

// ---------------------------------------------------------------------------------------------
// Running things inside a namespace

/// Runs `f` on a thread that joined `ns` (a process it spawns is born in that namespace too).
fn in_ns<T: Send + 'static>(ns: &NetNs, f: impl FnOnce() -> T + Send + 'static) -> T {
    ns.run(f)
}

/// Runs a command from a thread in `ns` (no `ip netns exec` in between: only the command is timed).
fn run_in(ns: &NetNs, program: &str, args: &[String]) -> Result<Duration, String> {
    let (program, args) = (program.to_string(), args.to_vec());
    in_ns(ns, move || {
        let t = Instant::now();
        let out = Command::new(&program).args(&args).stdin(Stdio::null()).output();
        let d = t.elapsed();
        match out {
            Ok(o) if o.status.success() => Ok(d),
            Ok(o) => Err(format!("{program} {args:?}: {}", String::from_utf8_lossy(&o.stderr).trim())),
            Err(e) => Err(format!("{program}: {e}")),
        }
    })
}

/// Runs `program` with `stdin` as its standard input from a thread in `ns`; the time it took.
fn run_in_stdin(ns: &NetNs, program: &str, args: &[&str], stdin: String) -> Result<Duration, String> {
    let program = program.to_string();
    let args: Vec<String> = args.iter().map(|s| s.to_string()).collect();
    in_ns(ns, move || {
        let t = Instant::now();
        let mut child = Command::new(&program)
            .args(&args)
            .stdin(Stdio::piped())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .map_err(|e| format!("{program}: {e}"))?;
        child.stdin.take().unwrap().write_all(stdin.as_bytes()).map_err(|e| e.to_string())?;
        let out = child.wait_with_output().map_err(|e| e.to_string())?;
        let d = t.elapsed();
        if out.status.success() {
            Ok(d)
        } else {
            Err(format!("{program}: {}", String::from_utf8_lossy(&out.stderr).trim()))
        }
    })
}

fn have(program: &str) -> bool {
    Command::new("sh")
        .args(["-c", &format!("command -v {program}")])
        .output()
        .is_ok_and(|o| o.status.success())
}

/// `conntrack -F` in the node namespace, so one variant's NAT bindings never serve the next.
fn flush_conntrack(node: &NetNs) {
    let _ = node.exec("conntrack", &["-F"]);
}

// ---------------------------------------------------------------------------------------------
// A fast backend: one thread, accepts and answers inline (the tests' server spawns a thread per
// connection, which would dominate the numbers).

struct FastServer {
    stop: Arc<AtomicBool>,
    ns_path: String,
    addr: SocketAddr,
    thread: Option<JoinHandle<()>>,
}

const RESPONSE: &[u8] = b"HTTP/1.0 200 OK\r\nContent-Length: 3\r\nConnection: close\r\n\r\nok\n";

impl FastServer {
    fn start(ns: &NetNs, addr: Ipv4Addr, port: u16) -> FastServer {
        let listener = in_ns(ns, move || TcpListener::bind((Ipv4Addr::UNSPECIFIED, port)).expect("bind"));
        let stop = Arc::new(AtomicBool::new(false));
        let s = stop.clone();
        let thread = std::thread::spawn(move || {
            let mut buf = [0u8; 2048];
            for conn in listener.incoming() {
                if s.load(Ordering::SeqCst) {
                    break;
                }
                let Ok(mut c) = conn else { continue };
                let _ = c.set_nodelay(true);
                let _ = c.set_read_timeout(Some(Duration::from_secs(1)));
                let mut got = Vec::new();
                while !got.windows(4).any(|w| w == b"\r\n\r\n") && got.len() < 8192 {
                    match c.read(&mut buf) {
                        Ok(0) | Err(_) => break,
                        Ok(n) => got.extend_from_slice(&buf[..n]),
                    }
                }
                let _ = c.write_all(RESPONSE);
            }
        });
        FastServer {
            stop,
            ns_path: format!("/run/netns/{}", ns.name),
            addr: SocketAddr::new(IpAddr::V4(addr), port),
            thread: Some(thread),
        }
    }
}

impl Drop for FastServer {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        // Wake the blocking accept with a connection from inside the backend namespace.
        let (path, addr) = (self.ns_path.clone(), self.addr);
        let _ = std::thread::spawn(move || {
            if let Ok(f) = std::fs::File::open(&path)
                && nix::sched::setns(f, nix::sched::CloneFlags::CLONE_NEWNET).is_ok()
            {
                let _ = TcpStream::connect_timeout(&addr, Duration::from_millis(200));
            }
        })
        .join();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// A child process (iperf3 server) killed on drop.
struct ChildGuard(std::process::Child);

impl Drop for ChildGuard {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn spawn_in(ns: &NetNs, program: &str, args: &[&str]) -> ChildGuard {
    let program = program.to_string();
    let args: Vec<String> = args.iter().map(|s| s.to_string()).collect();
    let child = in_ns(ns, move || {
        Command::new(&program)
            .args(&args)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("spawn")
    });
    ChildGuard(child)
}

/// The bench topology: one client, the node, one backend with the fast server and iperf3.
struct Bench {
    iperf: Option<ChildGuard>,
    server: Option<FastServer>,
    topo: Topology,
}

impl Bench {
    fn new(with_iperf: bool) -> Bench {
        let mut topo = Topology::new(1, 1);
        topo.stop_backend(0); // free port 8080 for the fast server
        let server = FastServer::start(&topo.backends[0].ns, backend_v4(0), HTTP_PORT);
        let iperf = with_iperf
            .then(|| spawn_in(&topo.backends[0].ns, "iperf3", &["-s", "-p", &IPERF_PORT.to_string()]));
        std::thread::sleep(Duration::from_millis(200));
        Bench { iperf, server: Some(server), topo }
    }
    fn node(&self) -> &NetNs {
        &self.topo.node
    }
    fn client(&self) -> &NetNs {
        self.topo.client(0)
    }
}

impl Drop for Bench {
    fn drop(&mut self) {
        self.iperf.take();
        self.server.take();
    }
}

// ---------------------------------------------------------------------------------------------
// Measurements from the client namespace

#[derive(Debug, Clone, Default)]
struct ConnSamples {
    /// Microseconds per connection (connect + request + response + close).
    us: Vec<f64>,
    errors: usize,
    /// Wall time of the measured loop.
    wall: Duration,
}

impl ConnSamples {
    fn extend(&mut self, o: ConnSamples) {
        self.us.extend(o.us);
        self.errors += o.errors;
        self.wall += o.wall;
    }
    fn p(&self, q: f64) -> f64 {
        percentile(&self.us, q)
    }
    fn rate(&self) -> f64 {
        if self.wall.is_zero() { 0.0 } else { self.us.len() as f64 / self.wall.as_secs_f64() }
    }
}

fn percentile(v: &[f64], q: f64) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    let mut s = v.to_vec();
    s.sort_by(|a, b| a.partial_cmp(b).unwrap());
    let i = ((s.len() - 1) as f64 * q).round() as usize;
    s[i]
}

/// The median; of an even count, the mean of the two middle values (with 2 repetitions,
/// `percentile(v, 0.5)` would be the larger one).
fn median(v: &[f64]) -> f64 {
    if !v.len().is_multiple_of(2) || v.is_empty() {
        return percentile(v, 0.5);
    }
    let mut s = v.to_vec();
    s.sort_by(|a, b| a.partial_cmp(b).unwrap());
    (s[s.len() / 2 - 1] + s[s.len() / 2]) / 2.0
}

fn one_request(addr: SocketAddr) -> Result<(), String> {
    let mut s = TcpStream::connect_timeout(&addr, Duration::from_secs(1)).map_err(|e| e.to_string())?;
    s.set_read_timeout(Some(Duration::from_secs(1))).map_err(|e| e.to_string())?;
    s.set_nodelay(true).map_err(|e| e.to_string())?;
    s.write_all(b"GET / HTTP/1.0\r\n\r\n").map_err(|e| e.to_string())?;
    let mut buf = [0u8; 256];
    let mut n = 0;
    loop {
        match s.read(&mut buf) {
            Ok(0) => break,
            Ok(k) => n += k,
            Err(e) => return Err(e.to_string()),
        }
    }
    if n != RESPONSE.len() {
        return Err(format!("short answer ({n} bytes)"));
    }
    Ok(())
}

/// Waits until the machine is idle (at most [`QUIET_WAIT_MAX`]): the kernel frees a replaced or
/// deleted table, and a deleted namespace, after the transaction or the `ip netns del` returned
/// (deferred work; at 10,000 Services a table is ~10,000 chains and 50,000 rules).
fn wait_quiet() {
    let busy_total = || -> Option<(u64, u64)> {
        let stat = std::fs::read_to_string("/proc/stat").ok()?;
        let cpu: Vec<u64> =
            stat.lines().next()?.split_whitespace().skip(1).take(8).filter_map(|v| v.parse().ok()).collect();
        // user nice system idle iowait irq softirq steal
        let total: u64 = cpu.iter().sum();
        Some((total - cpu.get(3)? - cpu.get(4)?, total))
    };
    let start = Instant::now();
    while start.elapsed() < QUIET_WAIT_MAX {
        let Some((b0, t0)) = busy_total() else { return };
        std::thread::sleep(Duration::from_millis(200));
        let Some((b1, t1)) = busy_total() else { return };
        if t1 > t0 && (b1 - b0) * 100 < (t1 - t0) * QUIET_BUSY_PERCENT {
            return;
        }
    }
}

/// Busy share of all CPUs under which the machine counts as idle ([`wait_quiet`]).
const QUIET_BUSY_PERCENT: u64 = 5;
const QUIET_WAIT_MAX: Duration = Duration::from_secs(10);

/// Connections to `a` and to `b` (each target from its own client namespace, on its own topology),
/// one after the other in turn: both are measured in the same time window, so whatever the
/// machine does meanwhile (another guest on the host, the kernel freeing a replaced table or a
/// deleted namespace) weighs on both alike. Measured one after the other instead, the variant
/// measured first on a fresh topology was up to ~10 µs a connection slower, whichever it was, and
/// a difference of 1 µs was lost in the noise.
fn interleaved(
    a: (&NetNs, SocketAddr),
    b: (&NetNs, SocketAddr),
    warmup: usize,
    n: usize,
) -> (ConnSamples, ConnSamples) {
    use std::sync::mpsc::{Receiver, SyncSender, sync_channel};
    fn side(
        ns: String,
        addr: SocketAddr,
        turns: usize,
        warmup: usize,
        mine: Receiver<()>,
        theirs: SyncSender<()>,
    ) -> JoinHandle<ConnSamples> {
        std::thread::spawn(move || {
            NetNs::enter_path(&ns);
            let mut out = ConnSamples::default();
            for i in 0..turns {
                if mine.recv().is_err() {
                    break;
                }
                let t = Instant::now();
                let ok = one_request(addr).is_ok();
                let d = t.elapsed();
                let _ = theirs.send(());
                match (i < warmup, ok) {
                    (true, _) => {}
                    (false, true) => {
                        out.us.push(d.as_secs_f64() * 1e6);
                        out.wall += d;
                    }
                    (false, false) => out.errors += 1,
                }
            }
            out
        })
    }
    let (to_a, a_turn) = sync_channel(1);
    let (to_b, b_turn) = sync_channel(1);
    let turns = warmup + n;
    let ha = side(a.0.name.clone(), a.1, turns, warmup, a_turn, to_b.clone());
    let hb = side(b.0.name.clone(), b.1, turns, warmup, b_turn, to_a.clone());
    let _ = to_a.send(());
    drop((to_a, to_b));
    let join = |h: JoinHandle<ConnSamples>| h.join().unwrap_or_else(|e| std::panic::resume_unwind(e));
    (join(ha), join(hb))
}

/// Sequential connections from the client namespace: `warmup` unmeasured, then `n` measured.
fn connects(client: &NetNs, addr: SocketAddr, warmup: usize, n: usize) -> ConnSamples {
    in_ns(client, move || {
        let mut errors = 0;
        for _ in 0..warmup {
            if one_request(addr).is_err() {
                errors += 1;
            }
        }
        if errors == warmup && warmup > 0 {
            eprintln!("    !! every warm-up connection to {addr} failed");
            return ConnSamples { errors, ..Default::default() };
        }
        let mut us = Vec::with_capacity(n);
        let mut errors = 0;
        let start = Instant::now();
        for _ in 0..n {
            let t = Instant::now();
            match one_request(addr) {
                Ok(()) => us.push(t.elapsed().as_secs_f64() * 1e6),
                Err(_) => errors += 1,
            }
        }
        ConnSamples { us, errors, wall: start.elapsed() }
    })
}

/// One iperf3 TCP stream from the client namespace; bits per second received.
fn iperf(client: &NetNs, addr: Ipv4Addr, port: u16, secs: u32) -> Option<f64> {
    let out = client.exec(
        "timeout",
        &[
            &format!("{}", secs + 15),
            "iperf3",
            "-c",
            &addr.to_string(),
            "-p",
            &port.to_string(),
            "-t",
            &secs.to_string(),
            "-J",
        ],
    );
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).ok()?;
    let bps = v["end"]["sum_received"]["bits_per_second"].as_f64();
    if bps.is_none() {
        eprintln!("    !! iperf3 to {addr}:{port}: {}", v["error"]);
    }
    bps
}

// ---------------------------------------------------------------------------------------------
// The Services: the same set for nodelb and for the klipper rules

#[derive(Debug, Clone)]
struct BenchSvc {
    name: String,
    node_port: u16,
    dest: Ipv4Addr,
    dest_port: u16,
}

/// `n` Services: the target (→ the real backend), then fillers (→ unused addresses, each with its
/// own target port, as distinct Services have), plus the iperf Service (not counted in `n`). The
/// list is in the order klipper-lb would have added them: iperf and the target first, so that with
/// its `-I` (insert at the top) their rules end up at the bottom, walked last.
fn bench_services(n: usize) -> Vec<BenchSvc> {
    let mut v = vec![iperf_svc(), target_svc()];
    for i in 1..n {
        v.push(filler(i));
    }
    v
}

/// The measured Service: node port 20000 → the fast HTTP server.
fn target_svc() -> BenchSvc {
    BenchSvc { name: "target".into(), node_port: TARGET_NODE_PORT, dest: backend_v4(0), dest_port: HTTP_PORT }
}

/// The throughput Service: node port 19999 → iperf3.
fn iperf_svc() -> BenchSvc {
    BenchSvc { name: "iperf".into(), node_port: IPERF_NODE_PORT, dest: backend_v4(0), dest_port: IPERF_PORT }
}

fn filler(i: usize) -> BenchSvc {
    BenchSvc {
        name: format!("fill-{i}"),
        // 20001… up to 45,535 Services, then from 1024 (the scale mode's 50,000).
        node_port: if i <= 45_535 { 20000 + i as u16 } else { 1024 + (i - 45_536) as u16 },
        dest: Ipv4Addr::new(198, 51, 100, 100 + (i % 150) as u8),
        dest_port: 10000 + (i % 50_000) as u16,
    }
}

/// The Services as nodelb models them, each with its node port.
fn nodelb_services(svcs: &[BenchSvc]) -> Vec<(LbService, BTreeMap<PortId, u16>)> {
    svcs.iter()
        .map(|s| {
            let l = svc(
                &s.name,
                vec![(80, Protocol::Tcp, vec![ep(&s.dest.to_string(), s.dest_port, "node-1", true)])],
            );
            let ports = BTreeMap::from([(l.ports[0].id, s.node_port)]);
            (l, ports)
        })
        .collect()
}

fn nodelb_plan(lb: &[(LbService, BTreeMap<PortId, u16>)]) -> Ruleset {
    nodelb_plan_sharded(lb, 1)
}

/// [`nodelb_plan`] with the nat chains over `nat_shards` tables.
fn nodelb_plan_sharded(lb: &[(LbService, BTreeMap<PortId, u16>)], nat_shards: u8) -> Ruleset {
    let plans: Vec<ServicePlan<'_>> =
        lb.iter().map(|(s, p)| ServicePlan { service: s, node_ports: p }).collect();
    plan::plan(&plans, &plan::NodeFacts { nat_shards, ..node_facts(&[Family::Ipv4]) })
}

fn nodelb_ruleset(svcs: &[BenchSvc]) -> Ruleset {
    nodelb_plan(&nodelb_services(svcs))
}

/// Endpoints of the target Service in variant (e): unused addresses, then the real backend.
const AFFINITY_ENDPOINTS: usize = 5;
/// `sessionAffinityConfig.clientIP.timeoutSeconds` of variant (e) (Kubernetes' default).
const AFFINITY_TIMEOUT: u32 = 10_800;

/// Variant (e): [`nodelb_ruleset`] with `sessionAffinity: ClientIP` on the target Service, whose
/// endpoints are [`AFFINITY_ENDPOINTS`] − 1 unused addresses followed by the backend, and the
/// client's affinity to the backend, to be put in its set by the full replace. Every connection
/// of the client then looks it up in each endpoint's set before it finds it in the last one,
/// refreshes it there and DNATs: the most an affinity costs with that many endpoints.
fn nodelb_affinity_ruleset(svcs: &[BenchSvc], client: Ipv4Addr) -> (Ruleset, Carried) {
    let mut lb = nodelb_services(svcs);
    let mut carried = Carried::new();
    for (s, _) in lb.iter_mut().filter(|(s, _)| &*s.key.name == "target") {
        s.session_affinity = Some(AFFINITY_TIMEOUT);
        let port = &mut s.ports[0];
        let backend = port.endpoints.remove(0);
        port.endpoints = (0..AFFINITY_ENDPOINTS - 1)
            .map(|i| ep(&format!("198.51.100.{}", 90 + i), backend.port, "node-1", true))
            .chain([backend.clone()])
            .collect();
        let set = plan::affinity_set(Family::Ipv4, s, &s.ports[0], &backend, AFFINITY_TIMEOUT);
        let key = Key::addr(IpAddr::V4(client));
        carried.insert(set, vec![(key, u64::from(AFFINITY_TIMEOUT) * 1000)]);
    }
    (nodelb_plan(&lb), carried)
}

/// Name of the table of variant (d), the NAT floor.
const NAT_FLOOR_TABLE: &str = "natfloor";

/// Variant (d): the least nftables NAT that makes `svcs` reachable at their node ports, as `nft -f`
/// input — one DNAT rule per Service in a nat prerouting chain (dstnat, as nodelb's) and one
/// masquerade rule per Service in nat postrouting (srcnat; `ct status dnat`: only what it DNATed),
/// in a table of its own. No fib check, no verdict map, no mark, no filter chain, no counter: what
/// any NAT dataplane pays at least (conntrack + DNAT + masquerade). Only the first packet of a
/// connection walks NAT chains, so the rule count does not matter; the target's rules come first
/// anyway.
fn nat_floor_rules(svcs: &[BenchSvc]) -> String {
    let (mut pre, mut post) = (String::new(), String::new());
    for s in svcs {
        pre += &format!("        tcp dport {} dnat to {}:{}\n", s.node_port, s.dest, s.dest_port);
        // Only the connections it DNATs: the node's other traffic to the same backend (the
        // direct route) stays unNATed, as with nodelb, so the two tables' other traffic compares.
        post += &format!("        ct status dnat ip daddr {} tcp dport {} masquerade\n", s.dest, s.dest_port);
    }
    format!(
        "table ip {NAT_FLOOR_TABLE} {{\n    chain pre {{\n        type nat hook prerouting priority -100; policy accept;\n{pre}    }}\n    chain post {{\n        type nat hook postrouting priority 100; policy accept;\n{post}    }}\n}}\n"
    )
}

/// klipper-lb's entry script (k3s-io/klipper-lb `entry`, `start_proxy`) for one IPv4 Service with
/// the default `SRC_RANGES=0.0.0.0/0`, as iptables argument lists, in the order it runs them.
fn klipper_commands(s: &BenchSvc) -> Vec<Vec<String>> {
    let (p, dp, sp, d) = ("tcp", s.dest_port.to_string(), s.node_port.to_string(), s.dest.to_string());
    let w = |x: &str| x.split_whitespace().map(str::to_string).collect::<Vec<_>>();
    vec![
        w(&format!("-t filter -I FORWARD -s 0.0.0.0/0 -p {p} --dport {dp} -j ACCEPT")),
        w(&format!("-t filter -A FORWARD -d {d}/32 -p {p} --dport {dp} -j DROP")),
        w(&format!("-t nat -I PREROUTING -p {p} --dport {sp} -j DNAT --to {d}:{dp}")),
        w(&format!("-t nat -I POSTROUTING -d {d}/32 -p {p} -j MASQUERADE")),
    ]
}

/// The same rules as `iptables-restore` input, in the order the commands leave them.
fn klipper_restore(svcs: &[BenchSvc]) -> String {
    let mut accept = Vec::new();
    let mut drop = Vec::new();
    let mut dnat = Vec::new();
    let mut masq = Vec::new();
    for s in svcs {
        let (dp, sp, d) = (s.dest_port, s.node_port, s.dest);
        accept.push(format!("-A FORWARD -s 0.0.0.0/0 -p tcp -m tcp --dport {dp} -j ACCEPT"));
        drop.push(format!("-A FORWARD -d {d}/32 -p tcp -m tcp --dport {dp} -j DROP"));
        dnat.push(format!("-A PREROUTING -p tcp -m tcp --dport {sp} -j DNAT --to-destination {d}:{dp}"));
        masq.push(format!("-A POSTROUTING -d {d}/32 -p tcp -j MASQUERADE"));
    }
    // `-I` puts the latest first; `-A` the latest last.
    accept.reverse();
    dnat.reverse();
    masq.reverse();
    let mut out = String::from("*filter\n:INPUT ACCEPT [0:0]\n:FORWARD ACCEPT [0:0]\n:OUTPUT ACCEPT [0:0]\n");
    for l in accept.iter().chain(&drop) {
        out.push_str(l);
        out.push('\n');
    }
    out.push_str("COMMIT\n*nat\n:PREROUTING ACCEPT [0:0]\n:INPUT ACCEPT [0:0]\n:OUTPUT ACCEPT [0:0]\n:POSTROUTING ACCEPT [0:0]\n");
    for l in dnat.iter().chain(&masq) {
        out.push_str(l);
        out.push('\n');
    }
    out.push_str("COMMIT\n");
    out
}

// ---------------------------------------------------------------------------------------------
// Results

/// `other-via-nodelb` and `other-via-nat-floor`: the direct route (client → backend, routed by the
/// node, no node port) with nodelb's table, or the NAT floor's, loaded: what each costs the node's
/// other traffic (both turn conntrack on in the node, which the direct route has off).
/// `nodelb-nat-only` (scale mode): nodelb's ruleset without its filter chains, so that the gap
/// to the floor is split between its nat chains (firewall and DNAT) and its filter chains (the
/// forward path: invalid drop, forward counters) in the same repetition. `nodelb-sharded` and
/// `other-via-nodelb-sharded` (scale mode): the same with the nat chains over `--nat-shards`
/// tables, against `nodelb-one-table` and `other-via-nodelb-one-table`: the one-table layout on
/// the other topology at the same time.
const VARIANTS: [&str; 13] = [
    "direct",
    "other-via-nat-floor",
    "other-via-nodelb",
    "other-via-nodelb-sharded",
    "other-via-nodelb-one-table",
    "nodelb",
    "nodelb-nat-only",
    "nodelb-sharded",
    "nodelb-one-table",
    "nodelb-affinity",
    "nat-floor",
    "klipper-nft",
    "klipper-legacy",
];

#[derive(Default)]
struct Results {
    /// (N, variant) → pooled connection samples.
    conn: BTreeMap<(usize, &'static str), ConnSamples>,
    /// (N, repetition) → variant → p50 of that variant on that repetition's topology.
    rep_p50: BTreeMap<(usize, usize), BTreeMap<&'static str, f64>>,
    /// (N, variant) → iperf3 bits/s, one per repetition.
    tput: BTreeMap<(usize, &'static str), Vec<f64>>,
    /// (N, operation) → milliseconds, one per repetition.
    prog: BTreeMap<(usize, String), Vec<f64>>,
    /// Notes on what could not be measured.
    notes: Vec<String>,
    reaction: Option<Reaction>,
    kube_reaction: Option<Reaction>,
    footprint: Option<Footprint>,
    /// Kubernetes mode: how its N Services came to be, and how long it took.
    kube_setup: Option<KubeSetup>,
    /// The scale mode: N → what the agents measured at N.
    scale: BTreeMap<usize, ScaleAgents>,
    legacy: bool,
}

impl Results {
    /// (p50 of `v`, p50 of `base`) of each repetition at N that measured both (same topology).
    fn pairs(&self, n: usize, v: &str, base: &str) -> Vec<(f64, f64)> {
        self.rep_p50
            .range((n, 0)..=(n, usize::MAX))
            .filter_map(|(_, m)| Some((*m.get(v)?, *m.get(base)?)))
            .collect()
    }
    /// Median, min and max over repetitions of `f(p50 of v, p50 of base)`.
    fn paired(&self, n: usize, v: &str, base: &str, f: impl Fn(f64, f64) -> f64) -> (f64, f64, f64) {
        let q: Vec<f64> = self.pairs(n, v, base).into_iter().map(|(a, b)| f(a, b)).collect();
        (median(&q), percentile(&q, 0.0), percentile(&q, 1.0))
    }
    /// Median, min and max over repetitions of (variant p50 / direct p50 on the same topology).
    fn ratio(&self, n: usize, v: &str) -> (f64, f64, f64) {
        self.paired(n, v, "direct", |a, d| a / d)
    }
    /// Median over repetitions of (variant p50 − direct p50 on the same topology), µs.
    fn over_direct(&self, n: usize, v: &str) -> f64 {
        self.paired(n, v, "direct", |a, d| a - d).0
    }
    fn prog(&mut self, n: usize, op: &str, d: Duration) {
        self.prog.entry((n, op.to_string())).or_default().push(d.as_secs_f64() * 1e3);
    }
    fn note(&mut self, s: String) {
        eprintln!("    note: {s}");
        if !self.notes.contains(&s) {
            self.notes.push(s);
        }
    }
}

/// The agent measurements of the scale mode at one N.
#[derive(Default)]
struct ScaleAgents {
    footprint: Option<Footprint>,
    reaction: Option<Reaction>,
    kube_reaction: Option<Reaction>,
    kube_setup: Option<KubeSetup>,
}

/// The Kubernetes mode's setup, in seconds.
#[derive(Debug, Clone, Copy)]
struct KubeSetup {
    mode: KubeSetupMode,
    /// The N Services and their slices created, from the first create.
    created_s: f64,
    /// [`KubeSetupMode::Existing`]: the agent started → ready (its readiness probe).
    ready_s: Option<f64>,
    /// All N allocated and programmed: from the first create ([`KubeSetupMode::Live`]) or from
    /// the agent's start ([`KubeSetupMode::Existing`]).
    programmed_s: f64,
    /// The leader had nothing left to write or record (same origin).
    settled_s: f64,
}

struct Reaction {
    n: usize,
    add_ms: Vec<f64>,
    remove_ms: Vec<f64>,
    /// Kubernetes mode: Service created → the leader's allocation annotation in the API server.
    allocated_ms: Vec<f64>,
    timeouts: usize,
    /// Where the time went, from the agent's log during the changes: each sync that programmed
    /// something, and (Kubernetes mode) each allocation round of the leader.
    syncs: Vec<Breakdown>,
    rounds: Vec<Breakdown>,
    /// Kubernetes mode: the agent's `nodelb_network_programming_duration_seconds` over the
    /// creates (each slice carries its trigger time, as the EndpointSlice controller writes it):
    /// samples and their mean, ms.
    slo: Option<(u64, f64)>,
}

/// One "… breakdown (ms)" line of the agent's log: its phases in order, in ms.
type Breakdown = Vec<(String, f64)>;

/// The phases of a breakdown line, `phases=load=1.0 desired=2.0` (text log) or
/// `"phases":"load=1.0 desired=2.0"` (JSON log).
fn breakdown_of(line: &str) -> Option<Breakdown> {
    let rest = &line[line.find("phases")? + "phases".len()..];
    let rest = rest.trim_start_matches(['=', '"', ':']);
    let rest = rest.split('"').next().unwrap_or(rest);
    let phases: Breakdown = rest
        .split_whitespace()
        .filter_map(|kv| {
            let (k, v) = kv.split_once('=')?;
            Some((k.to_string(), v.parse().ok()?))
        })
        .collect();
    (!phases.is_empty()).then_some(phases)
}

/// A number field of a log line, `key=12` (text log) or `"key":12` (JSON log).
fn log_number(line: &str, key: &str) -> Option<f64> {
    [format!(" {key}="), format!("\"{key}\":")].iter().find_map(|k| {
        let rest = &line[line.find(k.as_str())? + k.len()..];
        let end = rest.find(|c: char| !(c.is_ascii_digit() || c == '.')).unwrap_or(rest.len());
        rest[..end].parse().ok()
    })
}

/// The syncs that programmed changes and the leader's allocation rounds in `log`.
fn breakdowns(log: &str) -> (Vec<Breakdown>, Vec<Breakdown>) {
    let syncs = log
        .lines()
        .filter(|l| l.contains("sync breakdown") && log_number(l, "changes").is_some_and(|c| c > 0.0))
        .filter_map(breakdown_of)
        .collect();
    let rounds =
        log.lines().filter(|l| l.contains("allocation round breakdown")).filter_map(breakdown_of).collect();
    (syncs, rounds)
}

/// Where a reaction's time went, after its table: the agent's syncs that programmed a change and
/// (Kubernetes mode) the leader's allocation rounds, from its log (the controller's).
fn where_line(w: &mut String, x: &Reaction) {
    use std::fmt::Write as _;
    let _ =
        write!(w, "\nThe agent's syncs that programmed a change (ms, its log): {}.", where_it_goes(&x.syncs));
    if !x.rounds.is_empty() {
        let _ = write!(w, " The leader's allocation rounds: {}.", where_it_goes(&x.rounds));
    }
    let _ = writeln!(w);
}

/// "median of K (total T ms): a 1.0, b 2.0; slowest (T ms): a 1.0, b 2.0" over `b`.
fn where_it_goes(b: &[Breakdown]) -> String {
    let total = |x: &Breakdown| x.iter().map(|(_, v)| v).sum::<f64>();
    let show = |x: &Breakdown| x.iter().map(|(k, v)| format!("{k} {v:.1}")).collect::<Vec<_>>().join(", ");
    let mut sorted: Vec<&Breakdown> = b.iter().collect();
    sorted.sort_by(|x, y| total(x).total_cmp(&total(y)));
    match (sorted.get(sorted.len() / 2), sorted.last()) {
        (Some(mid), Some(max)) => format!(
            "median of {} ({:.1} ms): {}; slowest ({:.1} ms): {}",
            b.len(),
            total(mid),
            show(mid),
            total(max),
            show(max)
        ),
        _ => "not in the log".to_string(),
    }
}

struct Footprint {
    n: usize,
    endpoints: usize,
    ready_s: f64,
    rss_mib: f64,
    hwm_mib: f64,
    cpu_total_s: f64,
    cpu_steady_pct: f64,
    steady_window_s: f64,
    /// The bytes of the first (full) sync's batch, from the agent's log.
    first_batch_bytes: Option<f64>,
}

// ---------------------------------------------------------------------------------------------
// One repetition at one N: all variants, side by side, on a fresh topology

fn nodelb_apply(node: &NetNs, changes: Vec<nodelb::core::ruleset::ir::Change>) -> Result<Duration, String> {
    in_ns(node, move || {
        let mut c = NftClient::new().map_err(|e| e.to_string())?;
        let t = Instant::now();
        c.apply(&changes).map_err(|e| e.to_string())?;
        Ok(t.elapsed())
    })
}

fn nodelb_delete(node: &NetNs) {
    let _ = in_ns(node, || NftClient::new().map(|mut c| c.delete_table()));
}

/// The target Service at its node port on the node: what every NAT variant is measured through.
fn target_lb() -> SocketAddr {
    SocketAddr::new(IpAddr::V4(NODE_V4), TARGET_NODE_PORT)
}

/// The target's backend itself, routed by the node: the direct route, and the node's other traffic.
fn target_direct() -> SocketAddr {
    SocketAddr::new(IpAddr::V4(backend_v4(0)), HTTP_PORT)
}

/// Variant (b)'s programming on `node`: the plan of `svcs` (pure) and its full replace in one
/// batch, each timed; returns the ruleset, now in the kernel.
fn nodelb_full_sync(node: &NetNs, n: usize, svcs: &[BenchSvc], r: &mut Results) -> Ruleset {
    let t = Instant::now();
    let rs = nodelb_ruleset(svcs);
    r.prog(n, "nodelb plan (pure)", t.elapsed());
    match nodelb_apply(node, rs.full_replace()) {
        Ok(d) => r.prog(n, "nodelb full sync (1 batch)", d),
        Err(e) => r.note(format!("nodelb apply at N={n}: {e}")),
    }
    rs
}

/// One more Service than `svcs` added to the kernel's `rs` as a diff, then removed again, each
/// timed (and both diffs, pure).
fn nodelb_add_remove_one(node: &NetNs, n: usize, svcs: &[BenchSvc], rs: &Ruleset, r: &mut Results) {
    let mut plus = svcs.to_vec();
    plus.push(filler(n + 1));
    let rs_plus = nodelb_ruleset(&plus);
    let t = Instant::now();
    let add = plan::diff(rs, &rs_plus);
    let remove = plan::diff(&rs_plus, rs);
    r.prog(n, "nodelb plan + diff (pure, both)", t.elapsed());
    drop(rs_plus);
    match nodelb_apply(node, add) {
        Ok(d) => r.prog(n, "nodelb add one Service (diff)", d),
        Err(e) => r.note(format!("nodelb add one at N={n}: {e}")),
    }
    match nodelb_apply(node, remove) {
        Ok(d) => r.prog(n, "nodelb remove one Service (diff)", d),
        Err(e) => r.note(format!("nodelb remove one at N={n}: {e}")),
    }
}

/// Variant (d)'s table on `node` ([`nat_floor_rules`] for the target and iperf Services).
fn nat_floor_load(node: &NetNs) -> Result<Duration, String> {
    run_in_stdin(node, "nft", &["-f", "-"], nat_floor_rules(&[target_svc(), iperf_svc()]))
}

fn nat_floor_delete(node: &NetNs) -> Result<Duration, String> {
    run_in(node, "nft", &["delete".into(), "table".into(), "ip".into(), NAT_FLOOR_TABLE.into()])
}

/// Variant (d) on the node of `b`: load [`nat_floor_rules`] for the target and iperf Services with
/// `nft -f` (no other table may be there: nodelb's is deleted before), measure connections and
/// throughput like the other variants, delete the table.
fn run_nat_floor(
    cfg: &Config,
    b: &Bench,
    n: usize,
    tput_now: bool,
    rep: &mut BTreeMap<&'static str, ConnSamples>,
    r: &mut Results,
) {
    let target_lb = target_lb();
    if let Err(e) = nat_floor_load(b.node()) {
        r.note(format!("nat-floor: nft -f at N={n}: {e}"));
        return;
    }
    let tables = String::from_utf8_lossy(&b.node().exec("nft", &["list", "tables"]).stdout).into_owned();
    let others: Vec<&str> =
        tables.lines().map(str::trim).filter(|l| !l.is_empty() && *l != "table ip natfloor").collect();
    if !others.is_empty() {
        r.note(format!("nat-floor at N={n}: other tables present in the node: {}", others.join(", ")));
    }
    flush_conntrack(b.node());
    let s = connects(b.client(), target_lb, cfg.warmup, cfg.conns);
    rep.entry("nat-floor").or_default().extend(s);
    let target_direct = target_direct();
    let s = connects(b.client(), target_direct, cfg.warmup, cfg.conns);
    rep.entry("other-via-nat-floor").or_default().extend(s);
    if tput_now && let Some(bps) = iperf(b.client(), NODE_V4, IPERF_NODE_PORT, cfg.iperf_secs) {
        r.tput.entry((n, "nat-floor")).or_default().push(bps);
    }
    if let Err(e) = nat_floor_delete(b.node()) {
        r.note(format!("nat-floor: delete table at N={n}: {e}"));
    }
    flush_conntrack(b.node());
}

/// Variant (e) on the node of `b`: [`nodelb_affinity_ruleset`] in one full replace (which puts
/// the client's affinity in), connections measured like the other variants, table deleted.
fn run_affinity(
    cfg: &Config,
    b: &Bench,
    n: usize,
    svcs: &[BenchSvc],
    rep: &mut BTreeMap<&'static str, ConnSamples>,
    r: &mut Results,
) {
    let target_lb = target_lb();
    let (rs, carried) = nodelb_affinity_ruleset(svcs, client_v4(0));
    let applied = in_ns(b.node(), move || {
        NftClient::new().and_then(|mut c| c.apply_full_replace(&rs, &carried)).map_err(|e| e.to_string())
    });
    if let Err(e) = applied {
        r.note(format!("nodelb-affinity apply at N={n}: {e}"));
        return;
    }
    flush_conntrack(b.node());
    let s = connects(b.client(), target_lb, cfg.warmup, cfg.conns);
    rep.entry("nodelb-affinity").or_default().extend(s);
    nodelb_delete(b.node());
}

fn run_rep(cfg: &Config, n: usize, rep: usize, r: &mut Results) {
    let b = Bench::new(true);
    let svcs = bench_services(n);
    let target_direct = target_direct();
    let target_lb = target_lb();
    let tput_now = rep == 0 || !cfg.quick;
    let rep_no = rep;
    let mut rep: BTreeMap<&'static str, ConnSamples> = BTreeMap::new();

    // (a) direct, no rules at all in the node.
    let s = connects(b.client(), target_direct, cfg.warmup, cfg.conns);
    rep.entry("direct").or_default().extend(s);
    if tput_now && let Some(bps) = iperf(b.client(), backend_v4(0), IPERF_PORT, cfg.iperf_secs) {
        r.tput.entry((n, "direct")).or_default().push(bps);
    }

    // (d) the NAT floor next to nodelb, alternately before and after it, so that neither of the two
    // compared variants is always the one measured later on the topology.
    let floor_first = !rep_no.is_multiple_of(2);
    if floor_first {
        run_nat_floor(cfg, &b, n, tput_now, &mut rep, r);
    }
    // (e) nodelb with ClientIP affinity, likewise before and after nodelb in turn.
    let affinity_first = floor_first;
    if affinity_first {
        run_affinity(cfg, &b, n, &svcs, &mut rep, r);
    }

    // (b) nodelb: plan, one netlink batch, measure; then diff add/remove one; nft -f of render().
    let rs = nodelb_full_sync(b.node(), n, &svcs, r);
    flush_conntrack(b.node());
    let s = connects(b.client(), target_lb, cfg.warmup, cfg.conns);
    rep.entry("nodelb").or_default().extend(s);
    // The node's other traffic crosses nodelb's filter chains too (not its nat chains: no node
    // port): the direct route again, with the table loaded.
    let s = connects(b.client(), target_direct, cfg.warmup, cfg.conns);
    rep.entry("other-via-nodelb").or_default().extend(s);
    if tput_now && let Some(bps) = iperf(b.client(), NODE_V4, IPERF_NODE_PORT, cfg.iperf_secs) {
        r.tput.entry((n, "nodelb")).or_default().push(bps);
    }
    nodelb_add_remove_one(b.node(), n, &svcs, &rs, r);
    nodelb_delete(b.node());
    match run_in_stdin(b.node(), "nft", &["-f", "-"], rs.render()) {
        Ok(d) => r.prog(n, "nft -f of render() (same ruleset)", d),
        Err(e) => r.note(format!("nft -f at N={n}: {e}")),
    }
    nodelb_delete(b.node());
    if !affinity_first {
        run_affinity(cfg, &b, n, &svcs, &mut rep, r);
    }
    if !floor_first {
        run_nat_floor(cfg, &b, n, tput_now, &mut rep, r);
    }

    // Direct again, between nodelb and klipper (pooled with the first).
    flush_conntrack(b.node());
    let s = connects(b.client(), target_direct, cfg.warmup, cfg.conns);
    rep.entry("direct").or_default().extend(s);

    // (c) klipper-lb rules, iptables-nft then iptables-legacy (legacy last: its tables stay
    // registered in the namespace once created; the topology is thrown away after).
    for (variant, ipt, restore) in [
        ("klipper-nft", "iptables-nft", "iptables-nft-restore"),
        ("klipper-legacy", "iptables-legacy", "iptables-legacy-restore"),
    ] {
        if variant == "klipper-legacy" && !r.legacy {
            continue;
        }
        if rep_no == 0 && n <= cfg.per_command_max {
            let t = Instant::now();
            let mut ok = true;
            for s in &svcs {
                for cmd in klipper_commands(s) {
                    if let Err(e) = run_in(b.node(), ipt, &cmd) {
                        r.note(format!("{variant} per-command at N={n}: {e}"));
                        ok = false;
                        break;
                    }
                }
            }
            if ok {
                r.prog(n, &format!("{variant}: per-Service commands (4 per Service)"), t.elapsed());
            }
            flush_iptables(b.node(), ipt);
        }
        match run_in_stdin(b.node(), restore, &[], klipper_restore(&svcs)) {
            Ok(d) => r.prog(n, &format!("{variant}: iptables-restore"), d),
            Err(e) => {
                r.note(format!("{variant} restore at N={n}: {e}"));
                continue;
            }
        }
        // Add one Service at N (its 4 commands), then remove it (the same rules with -D).
        let extra = filler(n + 1);
        let t = Instant::now();
        let added = klipper_commands(&extra).iter().all(|c| run_in(b.node(), ipt, c).is_ok());
        if added {
            r.prog(n, &format!("{variant}: add one Service (4 commands)"), t.elapsed());
            let t = Instant::now();
            let removed = klipper_commands(&extra).iter().all(|c| {
                let mut d = c.clone();
                for a in d.iter_mut() {
                    if a == "-I" || a == "-A" {
                        *a = "-D".into();
                    }
                }
                run_in(b.node(), ipt, &d).is_ok()
            });
            if removed {
                r.prog(n, &format!("{variant}: remove one Service (4 commands)"), t.elapsed());
            }
        }
        flush_conntrack(b.node());
        let s = connects(b.client(), target_lb, cfg.warmup, cfg.conns);
        let variant: &'static str = if variant == "klipper-nft" { "klipper-nft" } else { "klipper-legacy" };
        rep.entry(variant).or_default().extend(s);
        if tput_now && let Some(bps) = iperf(b.client(), NODE_V4, IPERF_NODE_PORT, cfg.iperf_secs) {
            r.tput.entry((n, variant)).or_default().push(bps);
        }
        flush_iptables(b.node(), ipt);
    }
    for (v, s) in rep {
        r.rep_p50.entry((n, rep_no)).or_default().insert(v, s.p(0.5));
        r.conn.entry((n, v)).or_default().extend(s);
    }
}

// ---------------------------------------------------------------------------------------------
// The scale mode

/// One repetition of the scale mode at N: nodelb's programming on a fresh topology (full sync,
/// add and remove one Service), then the per-connection comparison with the NAT floor on two
/// topologies at once: nodelb's ruleset on one node, the floor's on the other, connections to
/// both [`interleaved`], then the roles swapped (neither topology is always nodelb's). The same
/// for nodelb without its filter chains, the direct route with no table on either node, and the
/// node's other traffic (the direct route) with each table loaded.
fn run_scale_rep(cfg: &Config, n: usize, rep_no: usize, r: &mut Results) {
    let (one, two) = (Bench::new(false), Bench::new(false));
    let svcs = bench_services(n);
    let rs = nodelb_full_sync(one.node(), n, &svcs, r);
    nodelb_add_remove_one(one.node(), n, &svcs, &rs, r);
    nodelb_delete(one.node());

    let mut nat_only = rs.clone();
    nat_only.chains.retain(|_, c| c.base.as_ref().is_none_or(|b| b.chain_type == ChainType::Nat));
    let k = shards_at(cfg, n);
    let sharded = (k > 1).then(|| nodelb_plan_sharded(&nodelb_services(&svcs), k));
    let (lb, direct) = (target_lb(), target_direct());
    let mut rep: BTreeMap<&'static str, ConnSamples> = BTreeMap::new();
    let mut add = |v: &'static str, s: ConnSamples| rep.entry(v).or_default().extend(s);
    wait_quiet();
    let (a, b) = interleaved((one.client(), direct), (two.client(), direct), cfg.warmup, cfg.conns);
    add("direct", a);
    add("direct", b);
    // (variant, its other traffic, its ruleset, the baseline on the other node: the NAT floor,
    // or for the sharded layout nodelb's own in one table, so that the two layouts are measured
    // at the same time and their difference is not the VM's drift between two comparisons).
    let floor = ("nat-floor", "other-via-nat-floor", None);
    let one_table = ("nodelb-one-table", "other-via-nodelb-one-table", Some(&rs));
    let variants = [
        ("nodelb", Some("other-via-nodelb"), Some(&rs), floor),
        ("nodelb-nat-only", None, Some(&nat_only), floor),
        ("nodelb-sharded", Some("other-via-nodelb-sharded"), sharded.as_ref(), one_table),
    ];
    for (variant, other, ruleset, (base, base_other, base_rs)) in variants {
        let Some(ruleset) = ruleset else { continue };
        let orders = [(&one, &two), (&two, &one)];
        for k in 0..2 {
            // Which orientation goes first alternates with the repetition.
            let (with, without) = orders[(k + rep_no) % 2];
            if let Err(e) = nodelb_apply(with.node(), ruleset.full_replace()) {
                r.note(format!("{variant} apply at N={n}: {e}"));
                continue;
            }
            let loaded = match base_rs {
                None => nat_floor_load(without.node()),
                Some(b) => nodelb_apply(without.node(), b.full_replace()),
            };
            if let Err(e) = loaded {
                r.note(format!("{base}: load at N={n}: {e}"));
                nodelb_delete(with.node());
                continue;
            }
            flush_conntrack(with.node());
            flush_conntrack(without.node());
            wait_quiet();
            let (a, b) = interleaved((with.client(), lb), (without.client(), lb), cfg.warmup, cfg.conns);
            add(variant, a);
            add(base, b);
            if let Some(other) = other {
                let (a, b) =
                    interleaved((with.client(), direct), (without.client(), direct), cfg.warmup, cfg.conns);
                add(other, a);
                add(base_other, b);
            }
            nodelb_delete(with.node());
            if base_rs.is_some() {
                nodelb_delete(without.node());
            } else if let Err(e) = nat_floor_delete(without.node()) {
                r.note(format!("nat-floor: delete table at N={n}: {e}"));
            }
        }
    }
    for (v, s) in rep {
        r.rep_p50.entry((n, rep_no)).or_default().insert(v, s.p(0.5));
        r.conn.entry((n, v)).or_default().extend(s);
    }
}

/// A paired difference (median, low, high) as `+1.2 (+0.3…+2.5)`.
fn with_range((mid, lo, hi): (f64, f64, f64)) -> String {
    format!("{mid:+.1} ({lo:+.1}…{hi:+.1})")
}

/// The nat shard tables of the scale mode's sharded rows at N Services: `--nat-shards`, else
/// what the agent's `auto` gives them (the N, the target and the iperf Service).
fn shards_at(cfg: &Config, n: usize) -> u8 {
    cfg.nat_shards.unwrap_or_else(|| plan::auto_nat_shards(n + 2, 1))
}

/// Endpoints per Service of the scale mode's programming rows: × 1 and × 5.
const SCALE_ENDPOINTS: [usize; 2] = [1, 5];

/// (user, system) CPU time of the calling thread, ms.
fn thread_cpu_ms() -> (f64, f64) {
    use nix::sys::resource::{UsageWho, getrusage};
    let u = getrusage(UsageWho::RUSAGE_THREAD).expect("getrusage");
    let ms = |t: nix::sys::time::TimeVal| t.tv_sec() as f64 * 1e3 + t.tv_usec() as f64 / 1e3;
    (ms(u.user_time()), ms(u.system_time()))
}

/// The steps from the kernel's floor to nodelb's ruleset, each adding one part of what nodelb
/// programs for the same Services ([`ladder_ruleset`]). The scale mode programs each step the
/// same way, so the gap between nodelb and the floor is split into what each part costs.
const LADDER: [&str; 6] = [
    "floor: the dispatch verdict map, each Service chain's endpoint draws and DNATs",
    "+ `meta l4proto` before each DNAT (nft's syntax needs it; the kernel does not)",
    "+ the connection counter and masquerade mark (a named counter per Service port)",
    "+ the dispatch rules as nodelb writes them (the firewall's, then the DNAT's: port first, loopback, `fib`; both families' maps)",
    "+ the same dispatch in nat output (node-originated connections)",
    "nodelb: + forward counters, endpoint set, masquerade, filter chains",
];

/// Step `step` of [`LADDER`] for nodelb's ruleset `full`: step 0 is the least ruleset the kernel
/// needs to do what `full` does for its Services (the nat prerouting base chain with only
/// `meta l4proto . th dport vmap @service-ports-ipv4`, that map, and each Service chain's draws
/// and DNATs); each later step puts back one part of `full`, with the sets and named counters
/// its rules use; the last step is `full` itself.
fn ladder_ruleset(full: &Ruleset, step: usize) -> Ruleset {
    use nodelb::core::ruleset::ir::{BaseChain, Chain, Expr, Hook, Mapped, Rule};
    if step + 1 >= LADDER.len() {
        return full.clone();
    }
    let mut out = Ruleset::default();
    let nat_pre = plan::CHAIN_NAT_PREROUTING;
    if step < 3 {
        out.add_chain(Chain {
            name: nat_pre.into(),
            base: Some(BaseChain { chain_type: ChainType::Nat, hook: Hook::Prerouting, priority: -100 }),
            rules: vec![Rule::new(vec![Expr::L4ProtoDportVmap {
                map: plan::service_ports_map(Family::Ipv4),
            }])],
            comment: None,
        });
    } else {
        let base = if step < 4 { &[nat_pre][..] } else { &[nat_pre, plan::CHAIN_NAT_OUTPUT][..] };
        for name in base {
            if let Some(c) = full.chains.get(*name) {
                out.add_chain(c.clone());
            }
        }
    }
    let keep = |e: &&Expr| match e {
        Expr::NumgenRandomIs { .. } | Expr::Dnat { .. } => true,
        Expr::L4Proto(_) => step >= 1,
        _ => step >= 2,
    };
    for chain in full.chains.values().filter(|c| c.base.is_none() && c.name.starts_with("svc")) {
        let rules = chain
            .rules
            .iter()
            .map(|r| Rule::new(r.exprs.iter().filter(keep).cloned().collect()))
            .filter(|r| step >= 2 || r.exprs.iter().any(|e| matches!(e, Expr::Dnat { .. })))
            .collect();
        out.add_chain(Chain { rules, ..chain.header() });
    }
    // The sets and named counters the kept rules use (and the counters their maps name).
    let rules = || out.chains.values().flat_map(|c| &c.rules);
    let sets: Vec<_> = rules().flat_map(Rule::sets).filter_map(|n| full.sets.get(n)).cloned().collect();
    let mut counters: Vec<_> = rules().flat_map(Rule::counters).cloned().collect();
    counters.extend(sets.iter().flat_map(|s| s.elements.values()).filter_map(|v| match v {
        Some(Mapped::Counter(c)) => Some(c.clone()),
        _ => None,
    }));
    sets.into_iter().for_each(|s| out.add_set(s));
    counters.iter().filter_map(|n| full.counters.get(n)).for_each(|c| out.add_counter(c.clone()));
    out
}

/// Kernel programming at N × 1 and N × 5 endpoints, in a namespace of its own: the pure plan, one
/// full replace through `NftClient::apply` (wall and kernel time of the thread), then adding and
/// removing one Service as a diff; `cfg.reps` times each (`scale_ruleset`, the programming bench's).
/// The same for every step of [`LADDER`] from the kernel's floor up, through the same client:
/// nodelb's rows are the last step's, the floor's rows are named "… floor", the others "… step K".
fn run_scale_programming(cfg: &Config, n: usize, r: &mut Results) {
    for e in SCALE_ENDPOINTS {
        let t = Instant::now();
        let base = common::scenarios::scale_ruleset(n, e, false, 1);
        r.prog(n, &format!("plan (pure) × {e}"), t.elapsed());
        let plus = common::scenarios::scale_ruleset(n + 1, e, false, 1);
        let t = Instant::now();
        let _ = plan::diff(&base, &plus);
        r.prog(n, &format!("diff (pure, add one) × {e}"), t.elapsed());
        for step in 0..LADDER.len() {
            let (base, plus) = (ladder_ruleset(&base, step), ladder_ruleset(&plus, step));
            program_pair(cfg, n, e, &ladder_suffix(step), base, plus, r);
        }
        let k = shards_at(cfg, n);
        if k > 1 {
            let base = common::scenarios::scale_ruleset(n, e, false, k);
            let plus = common::scenarios::scale_ruleset(n + 1, e, false, k);
            program_pair(cfg, n, e, &format!(", {k} nat shards"), base, plus, r);
        }
    }
}

/// `base` fully replaced, then `plus` added and removed as diffs, in a namespace of its own,
/// `cfg.reps` times: rows "full sync × {e}{suffix}" (and its kernel time), "add one × …",
/// "remove one × …".
fn program_pair(
    cfg: &Config,
    n: usize,
    e: usize,
    suffix: &str,
    base: Ruleset,
    plus: Ruleset,
    r: &mut Results,
) {
    let (add, remove) = (plan::diff(&base, &plus), plan::diff(&plus, &base));
    drop(plus);
    let ns = NetNs::new("scp");
    let reps = cfg.reps;
    let rows = ns.run(move || -> Result<Vec<[f64; 4]>, String> {
        let mut c = NftClient::new().map_err(|e| e.to_string())?;
        let mut rows = Vec::new();
        for _ in 0..reps {
            let (_, s0) = thread_cpu_ms();
            let t = Instant::now();
            c.apply(&base.full_replace()).map_err(|e| format!("full replace: {e}"))?;
            let full = t.elapsed().as_secs_f64() * 1e3;
            let sys = thread_cpu_ms().1 - s0;
            let t = Instant::now();
            c.apply(&add).map_err(|e| format!("add one: {e}"))?;
            let a = t.elapsed().as_secs_f64() * 1e3;
            let t = Instant::now();
            c.apply(&remove).map_err(|e| format!("remove one: {e}"))?;
            rows.push([full, sys, a, t.elapsed().as_secs_f64() * 1e3]);
        }
        let _ = c.delete_table();
        Ok(rows)
    });
    match rows {
        Ok(rows) => {
            for [full, sys, a, rm] in rows {
                let ms = |x: f64| Duration::from_secs_f64(x / 1e3);
                r.prog(n, &format!("full sync × {e}{suffix}"), ms(full));
                r.prog(n, &format!("full sync × {e}{suffix}: kernel (system) time"), ms(sys));
                r.prog(n, &format!("add one × {e}{suffix}"), ms(a));
                r.prog(n, &format!("remove one × {e}{suffix}"), ms(rm));
            }
        }
        Err(err) => r.note(format!("scale programming{suffix} at N={n} × {e}: {err}")),
    }
}

/// How the programming rows of [`LADDER`]'s step `step` are named: nodelb's own rows have no
/// suffix.
fn ladder_suffix(step: usize) -> String {
    match step {
        0 => " floor".to_string(),
        s if s + 1 == LADDER.len() => String::new(),
        s => format!(" step {s}"),
    }
}

/// Every part of the scale mode at each N of `--scale-sizes`.
fn run_scale(cfg: &Config, r: &mut Results, t: Instant) {
    for &n in &cfg.scale_sizes {
        if cfg.wants("dataplane") || cfg.wants("programming") {
            eprintln!("[{:>6.1}s] scale N = {n}: programming", t.elapsed().as_secs_f64());
            run_scale_programming(cfg, n, r);
        }
        if cfg.wants("dataplane") {
            for rep in 0..cfg.reps {
                eprintln!(
                    "[{:>6.1}s] scale N = {n}: NAT floor, repetition {}",
                    t.elapsed().as_secs_f64(),
                    rep + 1
                );
                run_scale_rep(cfg, n, rep, r);
            }
        }
        let (reaction, footprint) = (cfg.wants("reaction"), cfg.wants("footprint"));
        if reaction || footprint {
            eprintln!("[{:>6.1}s] scale N = {n}: agent (manifests mode)", t.elapsed().as_secs_f64());
            run_agent(cfg, n, footprint, reaction, r);
        }
        if cfg.wants("kube-reaction") {
            eprintln!("[{:>6.1}s] scale N = {n}: agent (Kubernetes mode)", t.elapsed().as_secs_f64());
            // A failure of the API server part (it is the longest) keeps what was measured before it.
            let mut part = Results::default();
            match std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| run_kube(cfg, n, &mut part))) {
                Ok(()) => {
                    r.kube_reaction = part.kube_reaction.take();
                    r.kube_setup = part.kube_setup.take();
                    part.notes.into_iter().for_each(|s| r.note(s));
                }
                Err(_) => r.note(format!("Kubernetes mode at N={n} failed (see the log above)")),
            }
        }
        let a = r.scale.entry(n).or_default();
        a.footprint = r.footprint.take();
        a.reaction = r.reaction.take();
        a.kube_reaction = r.kube_reaction.take();
        a.kube_setup = r.kube_setup.take();
    }
}

fn flush_iptables(node: &NetNs, ipt: &str) {
    for t in ["filter", "nat"] {
        let _ = node.exec(ipt, &["-t", t, "-F"]);
    }
    if ipt == "iptables-nft" {
        // Remove the tables themselves, so their hooks are gone too.
        let _ = node.exec("nft", &["delete", "table", "ip", "filter"]);
        let _ = node.exec("nft", &["delete", "table", "ip", "nat"]);
    }
    flush_conntrack(node);
}

// ---------------------------------------------------------------------------------------------
// The real agent: reaction time and footprint

/// Service `svc-<i>` of the agent measurements: one TCP port (node port allocated), `endpoints`
/// ready endpoints on node-1 at unused documentation addresses (no namespace answers there).
fn agent_service(i: usize, endpoints: usize) -> ServiceSpec {
    let mut s = ServiceSpec::new(&format!("svc-{i}")).port(PortSpec::tcp(80, None));
    for e in 0..endpoints {
        let a = Ipv4Addr::new(198, 51, 100, 100 + ((i * endpoints + e) % 150) as u8);
        s = s.endpoint(EndpointSpec::local(a));
    }
    s
}

fn agent_manifests(n: usize, endpoints: usize) -> Vec<(String, String)> {
    let mut files = Vec::new();
    let per_file = 500;
    let mut cur = String::new();
    for i in 0..n {
        cur.push_str(&agent_service(i, endpoints).render());
        if (i + 1) % per_file == 0 || i + 1 == n {
            files.push((format!("svc-{:05}.yaml", files.len()), std::mem::take(&mut cur)));
        }
    }
    files
}

fn proc_status_kib(pid: u32, key: &str) -> Option<f64> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let line = s.lines().find(|l| l.starts_with(key))?;
    line.split_whitespace().nth(1)?.parse().ok()
}

/// utime + stime of a process, in seconds.
fn proc_cpu_s(pid: u32) -> Option<f64> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let rest = &s[s.rfind(')')? + 2..];
    let f: Vec<&str> = rest.split_whitespace().collect();
    let (u, st): (f64, f64) = (f.get(11)?.parse().ok()?, f.get(12)?.parse().ok()?);
    let hz = nix::unistd::sysconf(nix::unistd::SysconfVar::CLK_TCK).ok().flatten().unwrap_or(100) as f64;
    Some((u + st) / hz)
}

/// CPU time of every thread of `pid` now, in seconds, from the scheduler's nanosecond counts
/// (`/proc/PID/task/*/schedstat`): `/proc/PID/stat` counts in clock ticks (10 ms), and the steady
/// window's whole CPU time is a few ticks. A thread that exits within a window takes its time
/// with it (the agent's threads live as long as it does).
fn proc_cpu_precise_s(pid: u32) -> Option<f64> {
    let tasks = std::fs::read_dir(format!("/proc/{pid}/task")).ok()?;
    let ns: u64 = tasks
        .filter_map(|t| std::fs::read_to_string(t.ok()?.path().join("schedstat")).ok())
        .filter_map(|s| s.split_whitespace().next()?.parse::<u64>().ok())
        .sum();
    Some(ns as f64 / 1e9)
}

/// Polls a connection to `addr` every millisecond until it succeeds (`want_ok`) or is refused.
fn poll_live(client: &NetNs, addr: SocketAddr, want_ok: bool, timeout: Duration) -> Option<Duration> {
    poll_live_since(client, addr, want_ok, Instant::now(), timeout)
}

/// [`poll_live`], timed from `start`.
fn poll_live_since(
    client: &NetNs,
    addr: SocketAddr,
    want_ok: bool,
    start: Instant,
    timeout: Duration,
) -> Option<Duration> {
    in_ns(client, move || {
        while start.elapsed() < timeout {
            let ok = match TcpStream::connect_timeout(&addr, Duration::from_millis(200)) {
                Ok(mut s) => {
                    let _ = s.write_all(b"GET / HTTP/1.0\r\n\r\n");
                    let mut b = Vec::new();
                    let _ = s.set_read_timeout(Some(Duration::from_millis(500)));
                    s.read_to_end(&mut b).is_ok() && b.starts_with(b"HTTP/1.0 200")
                }
                Err(_) => false,
            };
            if ok == want_ok {
                return Some(start.elapsed());
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        None
    })
}

/// Records how long a removal took to be refused, unless its add never went live: a port that
/// was never served is "refused" at once, which says nothing about the removal (the add already
/// counts as not live).
fn record_removal(added: bool, removed: Option<Duration>, remove_ms: &mut Vec<f64>, timeouts: &mut usize) {
    match (added, removed) {
        (false, _) => {}
        (true, Some(d)) => remove_ms.push(d.as_secs_f64() * 1e3),
        (true, None) => *timeouts += 1,
    }
}

/// After a change that was not live in time, lets the agent catch up (the late add may still go
/// live, then be removed) before the next change is timed, so its delay is not charged to the
/// next one.
fn settle(client: &NetNs, addr: SocketAddr, added: bool) {
    if !added {
        std::thread::sleep(Duration::from_secs(5));
        let _ = poll_live(client, addr, false, Duration::from_secs(60));
    }
}

fn run_agent(cfg: &Config, n: usize, footprint: bool, reaction: bool, r: &mut Results) {
    let b = Bench::new(false);
    let files = agent_manifests(n, cfg.footprint_endpoints);
    let refs: Vec<(&str, String)> = files.iter().map(|(a, b)| (a.as_str(), b.clone())).collect();
    let t0 = Instant::now();
    let mut args = vec!["--resync-period", "10s"];
    args.extend(cfg.agent_args.iter().map(String::as_str));
    let mut agent = Agent::start(b.node(), &refs, &args);
    agent.wait_ready(Duration::from_secs(300));
    let ready_s = t0.elapsed().as_secs_f64();
    let pid = agent.pid().expect("agent pid");
    eprintln!("  agent ready with {n} Services in {ready_s:.2}s");

    if footprint {
        std::thread::sleep(Duration::from_secs(2));
        let window = if cfg.quick { 10.0 } else { 30.0 };
        let c0 = proc_cpu_precise_s(pid).unwrap_or(f64::NAN);
        std::thread::sleep(Duration::from_secs_f64(window));
        let c1 = proc_cpu_precise_s(pid).unwrap_or(f64::NAN);
        r.footprint = Some(Footprint {
            n,
            endpoints: cfg.footprint_endpoints,
            ready_s,
            rss_mib: proc_status_kib(pid, "VmRSS:").unwrap_or(f64::NAN) / 1024.0,
            hwm_mib: proc_status_kib(pid, "VmHWM:").unwrap_or(f64::NAN) / 1024.0,
            cpu_total_s: proc_cpu_s(pid).unwrap_or(f64::NAN),
            cpu_steady_pct: (c1 - c0) / window * 100.0,
            steady_window_s: window,
            first_batch_bytes: agent
                .logs()
                .lines()
                .find(|l| l.contains("synced") && l.contains("full"))
                .and_then(|l| log_number(l, "bytes")),
        });
    }

    if reaction && cfg.reaction_changes > 0 {
        let seen = agent.logs().len();
        let addr = SocketAddr::new(IpAddr::V4(NODE_V4), cfg.reaction_port);
        let (mut add_ms, mut remove_ms, mut timeouts) = (Vec::new(), Vec::new(), 0);
        for k in 0..cfg.reaction_changes / 2 {
            let s = ServiceSpec::new(&format!("react-{k}"))
                .port(PortSpec::tcp(80, Some(cfg.reaction_port)))
                .endpoint(EndpointSpec::local(backend_v4(0)));
            agent.write_manifest("react.yaml", &s.render());
            let live = poll_live(b.client(), addr, true, Duration::from_secs(5));
            match live {
                Some(d) => add_ms.push(d.as_secs_f64() * 1e3),
                None => timeouts += 1,
            }
            agent.remove_manifest("react.yaml");
            let removed = poll_live(b.client(), addr, false, Duration::from_secs(5));
            record_removal(live.is_some(), removed, &mut remove_ms, &mut timeouts);
            settle(b.client(), addr, live.is_some());
        }
        let (syncs, rounds) = breakdowns(&agent.logs()[seen..]);
        r.reaction = Some(Reaction {
            n,
            add_ms,
            remove_ms,
            allocated_ms: Vec::new(),
            timeouts,
            syncs,
            rounds,
            slo: None,
        });
    }
    agent.kill9();
    keep_log(cfg, "manifests-agent.log", &agent.logs());
}

/// Reaction time in Kubernetes mode: one node, and the controller's replicas (one leads: allocates
/// node ports and writes them, with the status, on the Services), against the real kube-apiserver +
/// etcd of the tests (`tests/common/cluster.rs`), with `n` Services + EndpointSlices. Each change is timed from the
/// API call to a connection through the node succeeding (create) or being refused (delete).
fn run_kube(cfg: &Config, n: usize, r: &mut Results) {
    let mut args = vec!["--resync-period", "10s"];
    args.extend(cfg.agent_args.iter().map(String::as_str));
    let mut c = Cluster::with_nodes(1, 1, &args);
    // The N Services are single-stack IPv6: their cluster IPs come from the test API server's
    // IPv6 service range (65,536 addresses; the IPv4 one, a documentation /24, holds 254). The
    // node gets an IPv6 address so that it serves them; the measured Service is IPv4.
    c.nodes[0].ip(&["addr", "add", &format!("{KUBE_NODE_V6}/64"), "dev", "eth0", "nodad"]);
    c.api.patch_status(
        "v1",
        "Node",
        "",
        &common::cluster::node_name(0),
        serde_json::json!({"status": {"addresses": [
            {"type": "InternalIP", "address": node_v4(0).to_string()},
            {"type": "InternalIP", "address": KUBE_NODE_V6},
            {"type": "Hostname", "address": common::cluster::node_name(0)},
        ]}}),
    );
    if cfg.kube_setup == KubeSetupMode::Existing {
        // Stopped as the kubelet stops them (the leader releases its Lease); the rules the agent
        // programmed stay, as on a node whose agent restarts.
        c.stop_agent(0, Duration::from_secs(10));
        for k in 0..c.controllers.len() {
            c.stop_controller(k, Duration::from_secs(10));
        }
    }
    let t0 = Instant::now();
    // Created by parallel requests (the API server takes them concurrently; one at a time, 50,000
    // Services and their slices would take most of an hour).
    let next = std::sync::atomic::AtomicUsize::new(0);
    std::thread::scope(|scope| {
        for _ in 0..KUBE_CREATE_THREADS {
            scope.spawn(|| {
                loop {
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    if i >= n {
                        break;
                    }
                    c.create(&kube_filler(i, cfg.footprint_endpoints));
                }
            });
        }
    });
    let created_s = t0.elapsed().as_secs_f64();
    eprintln!("  {n} Services + EndpointSlices created in {created_s:.1}s");
    let limit = Duration::from_secs(300.max(n as u64 / 20));
    let (t0, ready_s) = match cfg.kube_setup {
        KubeSetupMode::Live => (t0, None),
        KubeSetupMode::Existing => {
            let started = Instant::now();
            c.start_controllers(None);
            c.start_agent(0, limit);
            let ready_s = started.elapsed().as_secs_f64();
            eprintln!("  agent started with {n} Services in the API server: ready in {ready_s:.2}s");
            (started, Some(ready_s))
        }
    };
    let programmed = || {
        c.agents[0].status().map_or(0, |st| {
            st["services"].as_array().map_or(0, |v| v.iter().filter(|s| s["state"] == "programmed").count())
        })
    };
    if !common::topology::wait_until(limit, || programmed() >= n) {
        r.note(format!("Kubernetes mode: only {} of {n} Services programmed after {limit:?}", programmed()));
    }
    let programmed_s = t0.elapsed().as_secs_f64();
    eprintln!("  {n} Services allocated and programmed in {programmed_s:.2}s");
    // The leader then writes every Service's status and records its Events (a second or so of
    // them per round, rounds back to back); the reaction is measured once it has nothing left to
    // do, as it says in its log (a round it skips: everything written and sent).
    let leader = c.wait_leader(limit);
    let seen = c.controllers[leader].logs().len();
    let settled = common::topology::wait_until(limit, || {
        c.controllers[leader].logs().rfind("nothing for a round to do").is_some_and(|at| at >= seen)
    });
    if !settled {
        r.note(format!("Kubernetes mode: the leader had statuses or Events left after {limit:?}"));
    }
    let settled_s = t0.elapsed().as_secs_f64();
    eprintln!("  the leader settled (statuses and Events of all {n} written) in {settled_s:.2}s");
    r.kube_setup = Some(KubeSetup { mode: cfg.kube_setup, created_s, ready_s, programmed_s, settled_s });

    let addr = SocketAddr::new(IpAddr::V4(node_v4(0)), cfg.reaction_port);
    let backend = c.backends[0].v4;
    let seen = c.agents[0].logs().len();
    let leader_seen = c.controllers[leader].logs().len();
    let (mut add_ms, mut remove_ms, mut allocated_ms, mut timeouts) = (Vec::new(), Vec::new(), Vec::new(), 0);
    let mut unseen = 0;
    const SLO: &str = "nodelb_network_programming_duration_seconds";
    let slo_before = (c.metric_sum(0, &format!("{SLO}_count")), c.metric_sum(0, &format!("{SLO}_sum")));
    for k in 0..cfg.reaction_changes / 2 {
        let name = format!("react-{k}");
        let s = ServiceSpec::new(&name)
            .port(PortSpec::tcp(80, Some(cfg.reaction_port)))
            .endpoint(EndpointSpec::local(backend));
        let start = Instant::now();
        // As the EndpointSlice controller writes it: the time of the change on the slice.
        let mut svc = s.service();
        svc["spec"].as_object_mut().map(|spec| spec.remove("selector"));
        let trigger = k8s_openapi::jiff::Timestamp::now().to_string();
        if let Err(e) = c.api.create(svc) {
            r.note(format!("Kubernetes mode: create {name}: {e:?}"));
        }
        for mut slice in s.slices() {
            slice["metadata"]["annotations"] =
                serde_json::json!({"endpoints.kubernetes.io/last-change-trigger-time": trigger});
            let _ = c.api.create(slice);
        }
        // The leader's write, seen from the API server through a watch (a poll loop of GETs
        // loaded the API server, etcd and the two cores the change is timed on), while the
        // client polls the node.
        let (live, allocated) = std::thread::scope(|scope| {
            let allocated = scope.spawn(|| {
                let written =
                    |v: &serde_json::Value| v["metadata"]["annotations"][ANNOTATION_ALLOCATED].is_string();
                c.api.watch_until(("v1", "Service", "default", &name), start, Duration::from_secs(5), written)
            });
            let live = poll_live_since(&c.client, addr, true, start, Duration::from_secs(5));
            (live, allocated.join().unwrap_or(None))
        });
        match live {
            Some(d) => add_ms.push(d.as_secs_f64() * 1e3),
            None => timeouts += 1,
        }
        unseen += usize::from(live.is_some() && allocated.is_none());
        if let Some(d) = allocated {
            allocated_ms.push(d.as_secs_f64() * 1e3);
        }
        let start = Instant::now();
        if let Err(e) = c.api.delete("v1", "Service", "default", &name) {
            r.note(format!("Kubernetes mode: delete {name}: {e:?}"));
        }
        let removed = poll_live_since(&c.client, addr, false, start, Duration::from_secs(5));
        record_removal(live.is_some(), removed, &mut remove_ms, &mut timeouts);
        settle(&c.client, addr, live.is_some());
        for slice in s.slices() {
            let slice_name = slice["metadata"]["name"].as_str().unwrap_or_default().to_string();
            let _ = c.api.delete("discovery.k8s.io/v1", "EndpointSlice", "default", &slice_name);
        }
    }
    if unseen > 0 {
        r.note(format!(
            "Kubernetes mode: {unseen} of {} creates went live without the allocation probe seeing it written",
            add_ms.len()
        ));
    }
    let (syncs, _) = breakdowns(&c.agents[0].logs()[seen..]);
    let (_, rounds) = breakdowns(&c.controllers[leader].logs()[leader_seen..]);
    let samples = c.metric_sum(0, &format!("{SLO}_count")) - slo_before.0;
    let slo = (samples > 0.0)
        .then(|| (samples as u64, (c.metric_sum(0, &format!("{SLO}_sum")) - slo_before.1) / samples * 1e3));
    r.kube_reaction = Some(Reaction { n, add_ms, remove_ms, allocated_ms, timeouts, syncs, rounds, slo });
    keep_log(cfg, "kube-agent.log", &c.agents[0].logs());
    keep_log(cfg, "kube-controller.log", &c.controllers[leader].logs());
}

/// The node's IPv6 address in Kubernetes mode (for the IPv6 fillers).
const KUBE_NODE_V6: &str = "2001:db8:f::1";
/// Parallel requests creating the Kubernetes-mode Services.
const KUBE_CREATE_THREADS: usize = 16;

/// Filler `svc-<i>` of the Kubernetes mode: [`agent_service`], single-stack IPv6, endpoints at
/// unused documentation addresses.
fn kube_filler(i: usize, endpoints: usize) -> ServiceSpec {
    let mut s = ServiceSpec::new(&format!("svc-{i}"))
        .port(PortSpec::tcp(80, None))
        .ipv6_only()
        .without_kube_node_ports();
    for e in 0..endpoints {
        let a = std::net::Ipv6Addr::new(
            0x2001,
            0xdb8,
            0xe,
            0,
            0,
            0,
            0,
            1 + ((i * endpoints + e) % 60_000) as u16,
        );
        s = s.endpoint(EndpointSpec::local(a));
    }
    s
}

/// Copies an agent's log into `--agent-log DIR`, if given.
fn keep_log(cfg: &Config, name: &str, log: &str) {
    if let Some(dir) = &cfg.agent_log {
        let path = std::path::Path::new(dir).join(name);
        match std::fs::create_dir_all(dir).and_then(|()| std::fs::write(&path, log)) {
            Ok(()) => eprintln!("  agent log: {}", path.display()),
            Err(e) => eprintln!("  !! cannot write {}: {e}", path.display()),
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Report

fn fmt_us(x: f64) -> String {
    if x.is_nan() { "–".into() } else { format!("{x:.1}") }
}

fn report(cfg: &Config, r: &Results) -> String {
    let mut o = String::new();
    let w = &mut o;
    use std::fmt::Write as _;
    if cfg.wants("dataplane") {
        report_dataplane(cfg, r, w);
    }
    let _ =
        writeln!(w, "\n### 4. Reaction time (change → connection through the node succeeds / is refused)\n");
    let _ = writeln!(w, "1 ms polling by connection from the client; timeout 5 s.\n");
    match &r.reaction {
        Some(x) => {
            let _ = writeln!(w, "Manifests mode (`nodelb run --manifests`), N = {} Services:\n", x.n);
            reaction_table(
                w,
                x,
                &[("add Service (file written)", &x.add_ms), ("remove Service (file deleted)", &x.remove_ms)],
            );
            where_line(w, x);
        }
        None => {
            let _ = writeln!(w, "Manifests mode: not measured.");
        }
    }
    match &r.kube_reaction {
        Some(x) => {
            let _ = writeln!(
                w,
                "\nKubernetes mode (one node agent, the controller leading; test API server), N = {} Services:\n",
                x.n
            );
            reaction_table(
                w,
                x,
                &[
                    ("create Service + EndpointSlice", &x.add_ms),
                    ("… of which: until the allocation is written", &x.allocated_ms),
                    ("delete Service", &x.remove_ms),
                ],
            );
            if let Some((samples, mean_ms)) = x.slo {
                let _ = writeln!(
                    w,
                    "\nThe agent's own `nodelb_network_programming_duration_seconds` over the same creates \
                     (from each slice's trigger time to its rules in the kernel, kube-proxy's SLI): \
                     {samples} samples, mean {mean_ms:.1} ms (the create's figure above adds the \
                     first connection through the node)."
                );
            }
            where_line(w, x);
        }
        None => {
            let _ = writeln!(w, "\nKubernetes mode: not measured.");
        }
    }

    let _ = writeln!(w, "\n### 5. Footprint (the agent, `nodelb run --manifests`, steady state)\n");
    match &r.footprint {
        Some(f) => {
            let _ = writeln!(
                w,
                "| Services | endpoints each | start → ready s | RSS MiB | peak RSS MiB | CPU s since start | steady CPU % ({:.0} s window) |",
                f.steady_window_s
            );
            let _ = writeln!(w, "|---:|---:|---:|---:|---:|---:|---:|");
            let _ = writeln!(
                w,
                "| {} | {} | {:.2} | {:.1} | {:.1} | {:.2} | {:.2} |",
                f.n, f.endpoints, f.ready_s, f.rss_mib, f.hwm_mib, f.cpu_total_s, f.cpu_steady_pct
            );
        }
        None => {
            let _ = writeln!(w, "not measured");
        }
    }

    let _ = writeln!(w, "\n### Targets\n");
    let _ = writeln!(w, "| target | measured | verdict |");
    let _ = writeln!(w, "|---|---|---|");
    if cfg.wants("dataplane") {
        targets_dataplane(cfg, r, w);
    }
    for (mode, x) in [("manifests", &r.reaction), ("Kubernetes", &r.kube_reaction)] {
        let Some(x) = x else { continue };
        let all: Vec<f64> = x.add_ms.iter().chain(&x.remove_ms).copied().collect();
        let p = percentile(&all, 0.5);
        let _ = writeln!(
            w,
            "| change → rule live p50 ≤ 100 ms ({mode} mode) | {p:.1} ms (N = {}) | {} |",
            x.n,
            verdict(p <= 100.0)
        );
    }
    if let Some(f) = &r.footprint {
        let _ = writeln!(
            w,
            "| RSS ≤ 64 MiB at 10,000 Services | {:.1} MiB at N = {} | {} |",
            f.rss_mib,
            f.n,
            verdict(f.rss_mib <= 64.0)
        );
    }
    if !r.legacy {
        let _ = writeln!(
            w,
            "\niptables-legacy does not work in a network namespace on this kernel: not measured."
        );
    }
    if !r.notes.is_empty() {
        let _ = writeln!(w, "\nNotes from the run:\n");
        for n in &r.notes {
            let _ = writeln!(w, "- {n}");
        }
    }
    o
}

/// Sections 1–3 (connections, throughput, programming time).
fn report_dataplane(cfg: &Config, r: &Results, w: &mut String) {
    use std::fmt::Write as _;
    let _ = writeln!(
        w,
        "Mode: **{}** — N = {:?}, {} repetitions × {} connections per variant and N (after {} warm-up), \
         iperf3 {} s per run.\n",
        if cfg.quick { "quick" } else { "full" },
        cfg.sizes,
        cfg.reps,
        cfg.conns,
        cfg.warmup,
        cfg.iperf_secs
    );

    let _ = writeln!(w, "### 1. Per-connection cost (connect + request + response + close, sequential)\n");
    let _ = writeln!(
        w,
        "p50/p99 in µs over all connections of all repetitions; conn/s = connections / wall time of the \
         loop. The ratio and the difference to the direct route are computed per repetition (each \
         repetition builds a fresh topology and measures every variant on it) and then the median over \
         repetitions is shown, with the range across repetitions.\n"
    );
    let _ = writeln!(
        w,
        "| N | variant | p50 µs | p99 µs | conn/s | p50 ratio to direct (range) | p50 − direct µs | errors |"
    );
    let _ = writeln!(w, "|---:|---|---:|---:|---:|---:|---:|---:|");
    for &n in &cfg.sizes {
        for v in VARIANTS {
            let Some(s) = r.conn.get(&(n, v)) else { continue };
            let (q, lo, hi) = r.ratio(n, v);
            let _ = writeln!(
                w,
                "| {n} | {v} | {} | {} | {:.0} | {q:.2} ({lo:.2}–{hi:.2}) | {:+.1} | {} |",
                fmt_us(s.p(0.5)),
                fmt_us(s.p(0.99)),
                s.rate(),
                r.over_direct(n, v),
                s.errors
            );
        }
    }
    report_nat_floor(cfg, r, w);
    report_affinity(cfg, r, w);
    if !cfg.svg_link.is_empty() {
        let _ = writeln!(w, "\n![connect p50 ratio to direct vs N]({})\n", cfg.svg_link);
    }

    let _ = writeln!(w, "\n### 2. Throughput (one TCP stream, iperf3, client → node → backend)\n");
    let _ = writeln!(w, "| N | variant | Gbit/s (median) | ratio to direct |");
    let _ = writeln!(w, "|---:|---|---:|---:|");
    for &n in &cfg.sizes {
        let direct = r.tput.get(&(n, "direct")).map(|v| median(v)).unwrap_or(f64::NAN);
        for v in VARIANTS {
            let Some(x) = r.tput.get(&(n, v)) else { continue };
            let m = median(x);
            let _ = writeln!(w, "| {n} | {v} | {:.2} | {:.2} |", m / 1e9, m / direct);
        }
    }

    let _ =
        writeln!(w, "\n### 3. Programming time (ms, median over repetitions; N Services + 1 for iperf)\n");
    let ops: Vec<String> = {
        let mut ops: Vec<String> = Vec::new();
        for (_, op) in r.prog.keys() {
            if !ops.contains(op) {
                ops.push(op.clone());
            }
        }
        let order = |s: &str| {
            let k = ["nodelb", "nft -f", "klipper-nft", "klipper-legacy"];
            k.iter().position(|p| s.starts_with(p)).unwrap_or(9)
        };
        ops.sort_by_key(|s| (order(s), s.clone()));
        ops
    };
    let _ = write!(w, "| operation |");
    for n in &cfg.sizes {
        let _ = write!(w, " N = {n} |");
    }
    let _ = write!(w, "\n|---|");
    for _ in &cfg.sizes {
        let _ = write!(w, "---:|");
    }
    let _ = writeln!(w);
    for op in &ops {
        let _ = write!(w, "| {op} |");
        for &n in &cfg.sizes {
            match r.prog.get(&(n, op.clone())) {
                Some(v) => {
                    let _ = write!(w, " {:.2} |", median(v));
                }
                None => {
                    let _ = write!(w, " – |");
                }
            }
        }
        let _ = writeln!(w);
    }
    let _ = write!(w, "| nodelb full sync / nft -f |");
    for &n in &cfg.sizes {
        let a = r.prog.get(&(n, "nodelb full sync (1 batch)".into())).map(|v| median(v));
        let b = r.prog.get(&(n, "nft -f of render() (same ruleset)".into())).map(|v| median(v));
        match (a, b) {
            (Some(a), Some(b)) => {
                let _ = write!(w, " {:.2}× |", a / b);
            }
            _ => {
                let _ = write!(w, " – |");
            }
        }
    }
    let _ = writeln!(w);
    let _ = writeln!(
        w,
        "\nPer-Service commands are timed once (first repetition) and only up to N = {}; each is a \
         separate `iptables` process, as klipper-lb runs them.",
        cfg.per_command_max
    );
}

/// Section 1's split of nodelb's overhead into the NAT floor (variant (d)) and nodelb's own work.
fn report_nat_floor(cfg: &Config, r: &Results, w: &mut String) {
    use std::fmt::Write as _;
    if !cfg.sizes.iter().any(|&n| !r.pairs(n, "nodelb", "nat-floor").is_empty()) {
        let _ = writeln!(
            w,
            "\nThe NAT floor (nat-floor) was not measured: nodelb's share of it cannot be given."
        );
        return;
    }
    let _ = writeln!(w, "\n#### nodelb over the NAT floor\n");
    let _ = writeln!(
        w,
        "nat-floor is the least nftables NAT for the target Service: one `dnat` rule in a nat prerouting \
         chain and one `masquerade` rule (of the connections it DNATed) in nat postrouting, in a table of its own (nodelb's table absent), \
         measured on the same topology next to nodelb (alternately before and after it). nat-floor − direct \
         is what conntrack + DNAT + masquerade cost per connection here; nodelb − nat-floor is nodelb's own \
         work (fib + verdict-map lookups in nat prerouting, the firewall's and the DNAT's, the service chain's counter, mark and \
         DNAT, the mark-matched masquerade, the forward chain's ct checks and counter map). Differences and \
         ratios are per repetition, median (range) over repetitions.\n"
    );
    let _ = writeln!(
        w,
        "| N | nat-floor − direct µs | nodelb − direct µs | nodelb − nat-floor µs (range) | nodelb / nat-floor p50 (range) |"
    );
    let _ = writeln!(w, "|---:|---:|---:|---:|---:|");
    for &n in &cfg.sizes {
        if r.pairs(n, "nodelb", "nat-floor").is_empty() {
            continue;
        }
        let (d, dlo, dhi) = r.paired(n, "nodelb", "nat-floor", |a, b| a - b);
        let (q, qlo, qhi) = r.paired(n, "nodelb", "nat-floor", |a, b| a / b);
        let _ = writeln!(
            w,
            "| {n} | {:+.1} | {:+.1} | {d:+.1} ({dlo:+.1}…{dhi:+.1}) | {q:.2} ({qlo:.2}–{qhi:.2}) |",
            r.over_direct(n, "nat-floor"),
            r.over_direct(n, "nodelb"),
        );
    }
}

/// Section 1's cost of `sessionAffinity: ClientIP` (variant (e) against nodelb).
fn report_affinity(cfg: &Config, r: &Results, w: &mut String) {
    use std::fmt::Write as _;
    if !cfg.sizes.iter().any(|&n| !r.pairs(n, "nodelb-affinity", "nodelb").is_empty()) {
        return;
    }
    let _ = writeln!(w, "\n#### ClientIP affinity over nodelb\n");
    let _ = writeln!(
        w,
        "nodelb-affinity is nodelb with `sessionAffinity: ClientIP` on the target Service, whose {k} endpoints \
         are {unused} unused addresses and then the backend, and the client's affinity to the backend already \
         recorded: each connection looks the client up in the sets of all {k} endpoints (the last one hits), \
         restarts its timeout (`update`) and DNATs, the most an affinity costs with {k} endpoints. Measured on \
         the same topology as nodelb, alternately before and after it; differences per repetition, median \
         (range) over repetitions.\n",
        k = AFFINITY_ENDPOINTS,
        unused = AFFINITY_ENDPOINTS - 1,
    );
    let _ = writeln!(
        w,
        "| N | nodelb − direct µs | nodelb-affinity − direct µs | nodelb-affinity − nodelb µs (range) |"
    );
    let _ = writeln!(w, "|---:|---:|---:|---:|");
    for &n in &cfg.sizes {
        if r.pairs(n, "nodelb-affinity", "nodelb").is_empty() {
            continue;
        }
        let (d, lo, hi) = r.paired(n, "nodelb-affinity", "nodelb", |a, b| a - b);
        let _ = writeln!(
            w,
            "| {n} | {:+.1} | {:+.1} | {d:+.1} ({lo:+.1}…{hi:+.1}) |",
            r.over_direct(n, "nodelb"),
            r.over_direct(n, "nodelb-affinity"),
        );
    }
}

/// Rows of one reaction table, plus "all" (adds and removals together) and the timeouts.
fn reaction_table(w: &mut String, x: &Reaction, rows: &[(&str, &Vec<f64>)]) {
    use std::fmt::Write as _;
    let _ = writeln!(w, "| change | count | p50 ms | p99 ms | max ms |");
    let _ = writeln!(w, "|---|---:|---:|---:|---:|");
    let all: Vec<f64> = x.add_ms.iter().chain(&x.remove_ms).copied().collect();
    for (name, v) in rows.iter().copied().chain([("all (create/add and delete/remove)", &all)]) {
        let _ = writeln!(
            w,
            "| {name} | {} | {:.1} | {:.1} | {:.1} |",
            v.len(),
            percentile(v, 0.5),
            percentile(v, 0.99),
            percentile(v, 1.0)
        );
    }
    if x.timeouts > 0 {
        let _ = writeln!(w, "\n{} changes were not live within 5 s.", x.timeouts);
    }
}

/// The scale section: the scale targets at each N, then what they were measured from.
fn report_scale(cfg: &Config, r: &Results) -> String {
    use std::fmt::Write as _;
    let mut o = String::new();
    let w = &mut o;
    let med = |n: usize, op: &str| r.prog.get(&(n, op.to_string())).map_or(f64::NAN, |v| median(v));
    let fmt = |x: f64, unit: &str| if x.is_nan() { "–".to_string() } else { format!("{x:.1} {unit}") };
    let sizes = &cfg.scale_sizes;
    let _ = writeln!(
        w,
        "Scale mode: N = {sizes:?} Services, one TCP port each, 5 endpoints each unless said; {} repetitions \
         (programming, NAT floor); {} changes (half adds, half removals) per reaction run.\n",
        cfg.reps, cfg.reaction_changes
    );
    // The scale targets: (10,000, 50,000).
    let target = |n: usize, small: f64, large: f64| if n <= 10_000 { small } else { large };
    let _ = writeln!(w, "| target | N | target | measured | verdict |");
    let _ = writeln!(w, "|---|---:|---:|---|---|");
    for &n in sizes {
        let a = r.scale.get(&n);
        let fp = a.and_then(|a| a.footprint.as_ref());
        if let Some(f) = fp {
            let (t, p) = (target(n, 64.0, 256.0), target(n, 96.0, 384.0));
            let met = f.rss_mib <= t && f.hwm_mib <= p;
            let why = match f.first_batch_bytes {
                Some(b) if !met => format!(
                    ": peak − steady {:.1} MiB, the start's full-sync batch {:.1} MiB of it (one datagram: the kernel's transaction)",
                    f.hwm_mib - f.rss_mib,
                    b / 1048576.0
                ),
                _ => String::new(),
            };
            let _ = writeln!(
                w,
                "| RSS steady (peak) | {n} | ≤ {t:.0} (≤ {p:.0}) MiB | {:.1} ({:.1}) MiB | {}{why} |",
                f.rss_mib,
                f.hwm_mib,
                verdict(met)
            );
            let t = target(n, 3.0, 15.0);
            let _ = writeln!(
                w,
                "| start → ready | {n} | ≤ {t:.0} s | {:.2} s | {} |",
                f.ready_s,
                verdict(f.ready_s <= t)
            );
        }
        // Full sync: × 1 endpoint at 10,000, × 5 at 50,000 (the issue's rows).
        let e = if n <= 10_000 { 1 } else { 5 };
        let full = med(n, &format!("full sync × {e}"));
        if !full.is_nan() {
            let t = target(n, 200.0, 5_000.0);
            let floor = med(n, &format!("full sync × {e} floor"));
            let _ = writeln!(
                w,
                "| full sync (one batch, kernel included), × {e} endpoint{} | {n} | ≤ {t:.0} ms | {} (kernel {}); kernel floor {} (kernel {}) | {} |",
                if e == 1 { "" } else { "s" },
                fmt(full, "ms"),
                fmt(med(n, &format!("full sync × {e}: kernel (system) time")), "ms"),
                fmt(floor, "ms"),
                fmt(med(n, &format!("full sync × {e} floor: kernel (system) time")), "ms"),
                floor_verdict(&[(full, floor, t)])
            );
            let (add, rm) = (med(n, "add one × 5"), med(n, "remove one × 5"));
            let (add_floor, rm_floor) = (med(n, "add one × 5 floor"), med(n, "remove one × 5 floor"));
            let (ta, tr) = (target(n, 5.0, 15.0), target(n, 1.0, 2.0));
            let _ = writeln!(
                w,
                "| add / remove one Service (× 5) | {n} | ≤ {ta:.0} / ≤ {tr:.0} ms | {add:.2} / {rm:.2} ms; kernel floor {add_floor:.2} / {rm_floor:.2} ms | {} |",
                floor_verdict(&[(add, add_floor, ta), (rm, rm_floor, tr)])
            );
            let k = shards_at(cfg, n);
            let sharded = (
                med(n, &format!("add one × 5, {k} nat shards")),
                med(n, &format!("remove one × 5, {k} nat shards")),
            );
            if k > 1 && !sharded.0.is_nan() {
                let (add, rm) = sharded;
                let _ = writeln!(
                    w,
                    "| add / remove one Service (× 5), `--nat-shards {k}` | {n} | ≤ {ta:.0} / ≤ {tr:.0} ms | {add:.2} / {rm:.2} ms | {} |",
                    verdict(add <= ta && rm <= tr)
                );
            }
        }
        for (mode, x) in [
            ("manifests", a.and_then(|a| a.reaction.as_ref())),
            ("Kubernetes, real API server", a.and_then(|a| a.kube_reaction.as_ref())),
        ] {
            let Some(x) = x else { continue };
            let all: Vec<f64> = x.add_ms.iter().chain(&x.remove_ms).copied().collect();
            let (p99, t) = (percentile(&all, 0.99), target(n, 150.0, 300.0));
            let met = p99 <= t && x.timeouts == 0;
            let slowest = |b: &[Breakdown]| {
                let total = |x: &&Breakdown| x.iter().map(|(_, v)| v).sum::<f64>();
                b.iter()
                    .max_by(|a, b| total(a).total_cmp(&total(b)))
                    .map(|x| x.iter().map(|(k, v)| format!("{k} {v:.0}")).collect::<Vec<_>>().join(", "))
            };
            let why = match (met, slowest(&x.syncs), slowest(&x.rounds)) {
                (true, ..) | (false, None, None) => String::new(),
                (false, sync, round) => format!(
                    ": the slowest sync {} ms{}",
                    sync.unwrap_or_else(|| "–".to_string()),
                    round.map(|r| format!(", the slowest leader round {r} ms")).unwrap_or_default()
                ),
            };
            let _ = writeln!(
                w,
                "| change → rule live p99 ({mode}) | {n} | ≤ {t:.0} ms | {p99:.1} ms (p50 {:.1}; {} not live in 5 s) | {}{why} |",
                percentile(&all, 0.5),
                x.timeouts,
                verdict(met)
            );
        }
        if let Some(f) = fp {
            let t = target(n, 0.1, 0.5);
            let _ = writeln!(
                w,
                "| steady CPU ({:.0} s window) | {n} | {} | {:.2}% of a core | {} |",
                f.steady_window_s,
                if n <= 10_000 { "≈ 0 (≤ 0.1%)" } else { "≤ 0.5%" },
                f.cpu_steady_pct,
                verdict(f.cpu_steady_pct <= t)
            );
        }
        let floor = r.paired(n, "nodelb", "nat-floor", |a, f| a - f);
        if !floor.0.is_nan() {
            let nat_only = r.paired(n, "nodelb-nat-only", "nat-floor", |a, f| a - f);
            let why = if floor.0 <= OVER_FLOOR_TARGET_US || nat_only.0.is_nan() {
                String::new()
            } else {
                format!(
                    ": without its filter chains (the forward path's two: invalid drop, forward counters) nodelb is {:+.1} µs ({:+.1}…{:+.1}) over the floor in the same repetitions",
                    nat_only.0, nat_only.1, nat_only.2
                )
            };
            let _ = writeln!(
                w,
                "| per-connection cost over the NAT floor (p50, median of repetitions) | {n} | ≤ +3 µs | {:+.1} µs ({:+.1}…{:+.1}) | {}{why} |",
                floor.0,
                floor.1,
                floor.2,
                verdict(floor.0 <= OVER_FLOOR_TARGET_US)
            );
        }
    }

    let _ = writeln!(w, "\nProgramming (ms, median of {} repetitions; pure rows: one sample):\n", cfg.reps);
    let mut ops: Vec<&String> = r
        .prog
        .keys()
        .filter(|(n, op)| sizes.contains(n) && !op.contains(" step "))
        .map(|(_, op)| op)
        .collect();
    ops.sort();
    ops.dedup();
    let _ = writeln!(w, "| operation |{}", sizes.iter().map(|n| format!(" N = {n} |")).collect::<String>());
    let _ = writeln!(w, "|---|{}", "---:|".repeat(sizes.len()));
    for op in ops {
        let cells: String = sizes.iter().map(|&n| format!(" {} |", fmt(med(n, op), "").trim())).collect();
        let _ = writeln!(w, "| {op} |{cells}");
    }
    if r.prog.keys().any(|(n, op)| sizes.contains(n) && op.ends_with(" floor")) {
        let _ = writeln!(
            w,
            "\nFrom the kernel's floor to nodelb's ruleset, one part at a time (ms, median of {} repetitions; \
             full sync: the kernel's (system) time of the batch; add one: wall time, almost all of it the \
             kernel validating the table):\n",
            cfg.reps
        );
        let cols = ["full sync × 1", "add one × 1", "full sync × 5", "add one × 5"];
        let head: String =
            sizes.iter().flat_map(|n| cols.iter().map(move |c| format!(" {c}, N = {n} |"))).collect();
        let _ = writeln!(w, "| ruleset |{head}");
        let _ = writeln!(w, "|---|{}", "---:|".repeat(sizes.len() * cols.len()));
        for (step, what) in LADDER.iter().enumerate() {
            let sfx = ladder_suffix(step);
            let cells: String = sizes
                .iter()
                .flat_map(|&n| {
                    [
                        med(n, &format!("full sync × 1{sfx}: kernel (system) time")),
                        med(n, &format!("add one × 1{sfx}")),
                        med(n, &format!("full sync × 5{sfx}: kernel (system) time")),
                        med(n, &format!("add one × 5{sfx}")),
                    ]
                })
                .map(|x| format!(" {} |", fmt(x, "").trim()))
                .collect();
            let _ = writeln!(w, "| {what} |{cells}");
        }
    }
    let _ = writeln!(
        w,
        "\nPer-connection cost (p50 µs, differences per repetition, median; each variant measured at \
         the same time as the NAT floor on a second topology, connections in turn, roles swapped):\n"
    );
    let _ = writeln!(
        w,
        "| N | nat-floor − direct | nodelb − direct | nodelb − nat-floor (range) | other traffic: with nodelb − with the NAT floor (range) |"
    );
    let _ = writeln!(w, "|---:|---:|---:|---:|---:|");
    for &n in sizes {
        let f = r.paired(n, "nodelb", "nat-floor", |a, f| a - f);
        if f.0.is_nan() {
            continue;
        }
        let o = r.paired(n, "other-via-nodelb", "other-via-nat-floor", |a, f| a - f);
        let _ = writeln!(
            w,
            "| {n} | {:+.1} | {:+.1} | {} | {} |",
            r.over_direct(n, "nat-floor"),
            r.over_direct(n, "nodelb"),
            with_range(f),
            with_range(o)
        );
    }
    if sizes.iter().any(|&n| !r.pairs(n, "nodelb-sharded", "nodelb-one-table").is_empty()) {
        let _ = writeln!(
            w,
            "\nThe nat chains over K tables (`--nat-shards K`) against one table, the two layouts of the \
             same Services loaded on the two topologies at the same time (p50 µs, differences per repetition, median):\n"
        );
        let _ = writeln!(
            w,
            "| N | K | sharded − one table, to the node port (range) | other traffic: with sharded − with one table (range) |"
        );
        let _ = writeln!(w, "|---:|---:|---:|---:|");
        for &n in sizes {
            let f = r.paired(n, "nodelb-sharded", "nodelb-one-table", |a, b| a - b);
            if f.0.is_nan() {
                continue;
            }
            let o = r.paired(n, "other-via-nodelb-sharded", "other-via-nodelb-one-table", |a, b| a - b);
            let _ = writeln!(w, "| {n} | {} | {} | {} |", shards_at(cfg, n), with_range(f), with_range(o));
        }
    }
    for &n in sizes {
        let Some(a) = r.scale.get(&n) else { continue };
        if let Some(x) = &a.reaction {
            let _ = writeln!(w, "\nReaction, manifests mode, N = {n} × 5:\n");
            reaction_table(
                w,
                x,
                &[("add Service (file written)", &x.add_ms), ("remove Service (file deleted)", &x.remove_ms)],
            );
            where_line(w, x);
        }
        if let Some(x) = &a.kube_reaction {
            let _ = writeln!(
                w,
                "\nReaction, Kubernetes mode (real kube-apiserver + etcd; one node agent, the controller leading), N = {n} × 5:\n"
            );
            match a.kube_setup {
                Some(KubeSetup { mode: KubeSetupMode::Live, created_s, programmed_s, settled_s, .. }) => {
                    let _ = writeln!(
                        w,
                        "Setup (`--kube-setup live`): {n} Services + EndpointSlices created in {created_s:.1} s ({KUBE_CREATE_THREADS} parallel requests) while the agent ran, all allocated and programmed {programmed_s:.1} s after the first create, every status and Event written {settled_s:.1} s after it.\n"
                    );
                }
                Some(KubeSetup {
                    mode: KubeSetupMode::Existing,
                    created_s,
                    ready_s,
                    programmed_s,
                    settled_s,
                }) => {
                    let ready = ready_s.map_or("–".to_string(), |s| format!("{s:.2}"));
                    let _ = writeln!(
                        w,
                        "Setup (`--kube-setup existing`): {n} Services + EndpointSlices created in {created_s:.1} s ({KUBE_CREATE_THREADS} parallel requests) with the agent stopped; the agent then started with them in the API server: ready in {ready} s, all {n} allocated (the leader's writes) and programmed {programmed_s:.1} s after its start, every status and Event written {settled_s:.1} s after it. The changes below are measured after that.\n"
                    );
                }
                None => {}
            }
            reaction_table(
                w,
                x,
                &[
                    ("create Service + EndpointSlice", &x.add_ms),
                    ("… of which: until the allocation is written", &x.allocated_ms),
                    ("delete Service", &x.remove_ms),
                ],
            );
            where_line(w, x);
        }
        if let Some(f) = &a.footprint {
            let _ = writeln!(
                w,
                "\nFootprint, manifests mode, N = {n} × {}: ready {:.2} s, RSS {:.1} MiB, peak {:.1} MiB, CPU {:.2} s since start, {:.2}% of a core over {:.0} s.",
                f.endpoints,
                f.ready_s,
                f.rss_mib,
                f.hwm_mib,
                f.cpu_total_s,
                f.cpu_steady_pct,
                f.steady_window_s
            );
        }
    }
    if !r.notes.is_empty() {
        let _ = writeln!(w, "\nNotes from the run:\n");
        for n in &r.notes {
            let _ = writeln!(w, "- {n}");
        }
    }
    o
}

/// The scale target for nodelb's per-connection cost over the NAT floor (p50, µs).
const OVER_FLOOR_TARGET_US: f64 = 3.0;

fn verdict(ok: bool) -> &'static str {
    if ok { "met" } else { "**missed**" }
}

/// The verdict of rows that have a kernel floor, from (measured, floor, target) triples: met when
/// every measurement is within its target; otherwise missed, and when a floor is itself above its
/// target, by how much nodelb is above that floor (the issue asks for the gap to the floor where
/// the kernel does not allow the target).
fn floor_verdict(rows: &[(f64, f64, f64)]) -> String {
    if rows.iter().all(|(x, _, t)| x <= t) {
        return "met".to_string();
    }
    let gaps: Vec<String> = rows
        .iter()
        .filter(|(x, f, t)| x > t && f > t)
        .map(|(x, f, _)| format!("floor above the target; nodelb {:+.1} ms ({:.2}×) over it", x - f, x / f))
        .collect();
    if gaps.is_empty() { "**missed**".to_string() } else { format!("**missed**: {}", gaps.join("; ")) }
}

/// The rows of the Targets table about the dataplane and programming time.
fn targets_dataplane(cfg: &Config, r: &Results, w: &mut String) {
    use std::fmt::Write as _;
    let nmax = *cfg.sizes.iter().max().unwrap_or(&1);
    let nmin = *cfg.sizes.iter().min().unwrap_or(&1);
    let p50 = |n: usize, v: &'static str| r.conn.get(&(n, v)).map(|s| s.p(0.5)).unwrap_or(f64::NAN);
    let over: Vec<(usize, f64)> = cfg.sizes.iter().map(|&n| (n, r.over_direct(n, "nodelb"))).collect();
    let worst = over.iter().cloned().fold((0, f64::MIN), |a, b| if b.1 > a.1 { b } else { a });
    // Against the NAT floor measured in the same repetitions: how much of it any NAT dataplane pays.
    let floor = r.over_direct(worst.0, "nat-floor");
    let own = r.paired(worst.0, "nodelb", "nat-floor", |a, b| a - b).0;
    let own_worst = cfg
        .sizes
        .iter()
        .map(|&n| (n, r.paired(n, "nodelb", "nat-floor", |a, b| a - b).0))
        .filter(|x| x.1.is_finite())
        .fold((0, f64::MIN), |a, b| if b.1 > a.1 { b } else { a });
    let (vs_floor, why) = if floor.is_finite() && own.is_finite() {
        (
            format!(
                "; NAT floor (nat-floor − direct) {floor:+.1} µs, nodelb − nat-floor {own:+.1} µs at that N \
                 (largest nodelb − nat-floor: {:+.1} µs at N = {})",
                own_worst.1, own_worst.0
            ),
            if worst.1 > 15.0 && floor > 15.0 { " (the NAT floor alone is over 15 µs here)" } else { "" },
        )
    } else {
        ("; NAT floor not measured".to_string(), "")
    };
    let _ = writeln!(
        w,
        "| connect p50 ≤ direct + 15 µs at every N | worst {:+.1} µs (N = {}){vs_floor} | {}{why} |",
        worst.1,
        worst.0,
        verdict(worst.1 <= 15.0)
    );
    let flat = p50(nmax, "nodelb") / p50(nmin, "nodelb");
    let _ = writeln!(
        w,
        "| flat in N: p50 at N = {nmax} within 10% of N = {nmin} | {:+.1}% | {} |",
        (flat - 1.0) * 100.0,
        verdict(flat <= 1.10)
    );
    let tmin = cfg
        .sizes
        .iter()
        .filter_map(|&n| {
            let d = median(r.tput.get(&(n, "direct"))?);
            Some(median(r.tput.get(&(n, "nodelb"))?) / d)
        })
        .fold(f64::INFINITY, f64::min);
    let _ = writeln!(w, "| throughput ≥ 0.85× direct | worst {tmin:.2}× | {} |", verdict(tmin >= 0.85));
    let full =
        r.prog.get(&(nmax, "nodelb full sync (1 batch)".into())).map(|v| median(v)).unwrap_or(f64::NAN);
    let nftf = r
        .prog
        .get(&(nmax, "nft -f of render() (same ruleset)".into()))
        .map(|v| median(v))
        .unwrap_or(f64::NAN);
    let at = if nmax >= 10_000 { String::new() } else { format!(" (only N = {nmax} measured in this mode)") };
    let _ = writeln!(
        w,
        "| full sync of 10,000 ≤ 200 ms | {full:.1} ms at N = {nmax}{at} | {} |",
        verdict(full <= 200.0)
    );
    let _ = writeln!(
        w,
        "| full sync ≤ 0.25× `nft -f` | {:.2}× at N = {nmax} | {} |",
        full / nftf,
        verdict(full / nftf <= 0.25)
    );
    let add =
        r.prog.get(&(nmax, "nodelb add one Service (diff)".into())).map(|v| median(v)).unwrap_or(f64::NAN);
    let rem =
        r.prog.get(&(nmax, "nodelb remove one Service (diff)".into())).map(|v| median(v)).unwrap_or(f64::NAN);
    let _ = writeln!(
        w,
        "| add / remove one at 10,000 ≤ 5 ms | {add:.2} / {rem:.2} ms at N = {nmax}{at} | {} |",
        verdict(add <= 5.0 && rem <= 5.0)
    );
}

/// A line chart of the connect p50 ratio to direct vs N (log scale), as a standalone SVG.
fn svg(cfg: &Config, r: &Results) -> String {
    let (w, h, l, rt, t, b) = (640.0, 400.0, 60.0, 150.0, 30.0, 50.0);
    let ns = &cfg.sizes;
    let lx = |n: usize| (n.max(1) as f64).log10();
    let xmax = lx(*ns.iter().max().unwrap_or(&1)).max(1.0);
    let mut ymax: f64 = 1.5;
    for &n in ns {
        for v in VARIANTS {
            let (_, _, q) = r.ratio(n, v);
            if q.is_finite() {
                ymax = ymax.max(q);
            }
        }
    }
    let ymax = (ymax * 1.1).ceil();
    let px = |x: f64| l + x / xmax * (w - l - rt);
    let py = |y: f64| t + (1.0 - y / ymax) * (h - t - b);
    let mut s = format!(
        "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{w}\" height=\"{h}\" font-family=\"sans-serif\" font-size=\"12\">\n<rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n"
    );
    s += &format!(
        "<text x=\"{}\" y=\"18\" text-anchor=\"middle\" font-size=\"14\">connect p50 / direct p50 vs number of Services</text>\n",
        (l + w - rt) / 2.0
    );
    // Axes and grid.
    let steps = 5;
    for i in 0..=steps {
        let y = ymax * i as f64 / steps as f64;
        s += &format!(
            "<line x1=\"{l}\" x2=\"{}\" y1=\"{:.1}\" y2=\"{:.1}\" stroke=\"#ddd\"/><text x=\"{}\" y=\"{:.1}\" text-anchor=\"end\">{y:.1}×</text>\n",
            w - rt,
            py(y),
            py(y),
            l - 6.0,
            py(y) + 4.0
        );
    }
    for &n in ns {
        s += &format!(
            "<line x1=\"{:.1}\" x2=\"{:.1}\" y1=\"{t}\" y2=\"{}\" stroke=\"#eee\"/><text x=\"{:.1}\" y=\"{}\" text-anchor=\"middle\">{n}</text>\n",
            px(lx(n)),
            px(lx(n)),
            h - b,
            px(lx(n)),
            h - b + 16.0
        );
    }
    s += &format!(
        "<text x=\"{}\" y=\"{}\" text-anchor=\"middle\">Services (N, log scale)</text>\n",
        (l + w - rt) / 2.0,
        h - 12.0
    );
    let colors = [
        ("direct", "#888"),
        ("other-via-nat-floor", "#bcbd22"),
        ("other-via-nodelb", "#17becf"),
        ("nodelb-nat-only", "#aec7e8"),
        ("nodelb", "#1f77b4"),
        ("nodelb-affinity", "#9467bd"),
        ("nat-floor", "#2ca02c"),
        ("klipper-nft", "#d62728"),
        ("klipper-legacy", "#ff7f0e"),
    ];
    for (i, (v, c)) in colors.iter().enumerate() {
        let pts: Vec<String> = ns
            .iter()
            .filter_map(|&n| {
                let (q, _, _) = r.ratio(n, v);
                q.is_finite().then(|| format!("{:.1},{:.1}", px(lx(n)), py(q)))
            })
            .collect();
        if pts.is_empty() {
            continue;
        }
        s += &format!(
            "<polyline fill=\"none\" stroke=\"{c}\" stroke-width=\"2\" points=\"{}\"/>\n",
            pts.join(" ")
        );
        for p in &pts {
            let (x, y) = p.split_once(',').unwrap();
            s += &format!("<circle cx=\"{x}\" cy=\"{y}\" r=\"3\" fill=\"{c}\"/>\n");
        }
        let ly = t + 20.0 + i as f64 * 20.0;
        s += &format!(
            "<line x1=\"{}\" x2=\"{}\" y1=\"{ly}\" y2=\"{ly}\" stroke=\"{c}\" stroke-width=\"2\"/><text x=\"{}\" y=\"{}\">{v}</text>\n",
            w - rt + 10.0,
            w - rt + 30.0,
            w - rt + 35.0,
            ly + 4.0
        );
    }
    s += "</svg>\n";
    s
}

// ---------------------------------------------------------------------------------------------

fn main() {
    let cfg = config();
    if !nix::unistd::Uid::effective().is_root() {
        eprintln!(
            "dataplane bench: needs root (network namespaces); run `sudo scripts/bench.sh`. Nothing measured."
        );
        return;
    }
    for tool in ["ip", "nft", "iptables-nft", "iptables-nft-restore", "iperf3", "timeout"] {
        if !have(tool) {
            eprintln!("dataplane bench: `{tool}` missing (scripts/bench.sh installs it). Nothing measured.");
            return;
        }
    }
    common::cleanup::install_signal_cleanup();
    let result = std::panic::catch_unwind(|| {
        let legacy = have("iptables-legacy") && {
            let ns = NetNs::new("probe");
            ns.exec("iptables-legacy", &["-t", "nat", "-L", "-n"]).status.success()
        };
        let mut r = Results { legacy, ..Default::default() };
        let t = Instant::now();
        if cfg.scale {
            run_scale(&cfg, &mut r, t);
            eprintln!("[{:>6.1}s] done", t.elapsed().as_secs_f64());
            return r;
        }
        let sizes: &[usize] = if cfg.wants("dataplane") { &cfg.sizes } else { &[] };
        for &n in sizes {
            for rep in 0..cfg.reps {
                eprintln!(
                    "[{:>6.1}s] N = {n}: repetition {}/{}",
                    t.elapsed().as_secs_f64(),
                    rep + 1,
                    cfg.reps
                );
                run_rep(&cfg, n, rep, &mut r);
            }
            for v in VARIANTS {
                let d = r.ratio(n, v).0;
                if let Some(s) = r.conn.get(&(n, v)) {
                    eprintln!("    {v:>15}: p50 {:>8.1} µs ({:.2}×)  p99 {:>8.1} µs", s.p(0.5), d, s.p(0.99));
                }
            }
        }
        let (reaction, footprint) = (cfg.wants("reaction"), cfg.wants("footprint"));
        let same = cfg.footprint_n == cfg.reaction_n && footprint;
        if reaction {
            eprintln!("[{:>6.1}s] agent: reaction time at N = {}", t.elapsed().as_secs_f64(), cfg.reaction_n);
            run_agent(&cfg, cfg.reaction_n, same, true, &mut r);
        }
        if cfg.wants("kube-reaction") && cfg.reaction_changes > 0 {
            eprintln!(
                "[{:>6.1}s] agent: Kubernetes-mode reaction time at N = {}",
                t.elapsed().as_secs_f64(),
                cfg.reaction_n
            );
            run_kube(&cfg, cfg.reaction_n, &mut r);
        }
        if footprint && !(same && reaction) {
            eprintln!("[{:>6.1}s] agent: footprint at N = {}", t.elapsed().as_secs_f64(), cfg.footprint_n);
            run_agent(&cfg, cfg.footprint_n, true, false, &mut r);
        }
        eprintln!("[{:>6.1}s] done", t.elapsed().as_secs_f64());
        r
    });
    common::cleanup::kill_and_delete_own_namespaces();
    let r = match result {
        Ok(r) => r,
        Err(e) => std::panic::resume_unwind(e),
    };
    let md = if cfg.scale { report_scale(&cfg, &r) } else { report(&cfg, &r) };
    println!("{md}");
    if let Some(p) = &cfg.out {
        std::fs::write(p, &md).expect("write --out");
    }
    if let Some(p) = cfg.svg.as_ref().filter(|_| !cfg.scale) {
        std::fs::write(p, svg(&cfg, &r)).expect("write --svg");
    }
}
