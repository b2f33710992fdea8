//! The chaos soak. A benchmark-style program, not a timed test: for a set time
//! it churns Services and EndpointSlices in a real API server (testkube) while injecting faults
//! into the control plane, the agents and one node's table, and checks its invariants the whole
//! time; then it stops the faults and checks that every node converges. It prints a summary row
//! (the one in docs/reliability.md) and exits 1 when an invariant broke.
//!
//! ```text
//! scripts/soak.sh [--duration 600] [--seed S]        # builds, then runs this program as root
//! ```
//!
//! Set-up: the three-node cluster of the Kubernetes tests (`tests/common/cluster.rs`: testkube
//! installed with `kubectl apply -f daemonset/`, three `nodelb` agents with the DaemonSet's
//! arguments in node namespaces, real backends), the API server with `--watch-cache=false` so that
//! an etcd compaction gives the agents' watches a real 410 Gone.
//!
//! Invariants:
//! - **stable Services lose 0 requests**: three Services created before the chaos (two TCP, one
//!   UDP, never edited) are probed by real clients through node-1 and node-2 every 200 ms for the
//!   whole run (node-3 is the one whose table is deleted and edited: its clients would rightly see
//!   that until the repair, so it is not probed); their node ports never change;
//! - **no node port held by two Services** in what the API server stores: a watch on every
//!   Service checks after every event ([`common::invariants::AllocationWatch`]);
//! - **convergence**: after the faults stop, every node's table equals, within
//!   [`CONVERGENCE_BOUND`], exactly what `nodelb plan` computes for that node from the final
//!   state of the cluster (canonical listings: every chain, rule, counter, set and element; no
//!   leftover);
//! - **memory**: node-1's agent (never SIGKILLed, so one process for the whole run) ends with an
//!   RSS within [`rss_margin`] of its RSS after the initial load;
//! - **no panic** in any agent's log (every start of every agent).
//!
//! Faults, in a shuffled round-robin so every kind comes up early, one at a time with churn going
//! on throughout: the API server's port reset (new connections refused, established ones killed)
//! and blackholed (packets dropped) for 4–10 s; the API server restarted; etcd compacted with the
//! watches cut (410 Gone); an agent SIGKILLed and restarted (node-2 or node-3); an agent SIGKILLed
//! 0–2 s into a burst of 100 Services (a large batch) and restarted; the leader SIGSTOPped past its
//! Lease and resumed (two agents believe they lead); the leader Lease deleted, a node-port registry
//! Lease deleted; the leader Lease stolen; node-3's table deleted; node-3's table edited (a foreign
//! rule added, a chain flushed).
//!
//! Root only (network namespaces); everything is deleted on exit, on panic and on Ctrl-C.

#[path = "../tests/common/mod.rs"]
mod common;

use std::collections::BTreeMap;
use std::net::IpAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde_json::{Value, json};

use common::agent::{canonical_ruleset, nft_list};
use common::cluster::{AGENT_NS, Cluster, LEADER_LEASE, node_name, node_v4, planned_listing};
use common::invariants::AllocationWatch;
use common::kube::Fault;
use common::manifest::{EndpointSpec, PortSpec, ServiceSpec};
use common::rng::Rng;
use common::topology::{backend_v4, http_request_here, udp_request_here, wait_until};

/// After the faults stop, every node's table must equal the plan within this time. The agents
/// resync every second and a restarted API server or a relist takes a few seconds on a loaded
/// 2-core machine; the leader settles claims it could not resolve after 60 s, which can delay a
/// Service's allocation, not a node's table (the plan follows what is stored).
const CONVERGENCE_BOUND: Duration = Duration::from_secs(60);
/// Churn namespace, and the namespace of the large batches.
const CHURN_NS: &str = "churn";
const BURST_NS: &str = "burst";
/// At most this many churned Services at once.
const MAX_CHURN: usize = 12;
/// Services in one large batch.
const BURST: usize = 100;
/// Node ports churned Services ask for (`nodelb.io/ports`), so that requests conflict.
const HOT: (u64, u64) = (20100, 20104);
/// Probes: one request per Service and node every this long, each with this timeout.
const PROBE_INTERVAL: Duration = Duration::from_millis(200);
const PROBE_TIMEOUT: Duration = Duration::from_secs(3);
/// The node whose agent is never SIGKILLed (the RSS witness), and the node whose table is tampered
/// with (not probed).
const WITNESS: usize = 0;
const TAMPERED: usize = 2;

/// RSS margin: the end may exceed the start by at most 20 % or 8 MiB, whichever is larger.
fn rss_margin(start_kib: u64) -> u64 {
    (start_kib / 5).max(8 * 1024)
}

struct Args {
    duration: Duration,
    seed: u64,
    out: Option<String>,
}

fn args() -> Args {
    let a = common::args::ProgramArgs::from_env();
    Args { duration: Duration::from_secs(a.number("--duration", 600)), seed: a.seed(), out: a.value("--out") }
}

fn main() {
    common::cleanup::install_signal_cleanup();
    if !nix::unistd::Uid::effective().is_root() {
        eprintln!("soak: needs root (network namespaces)");
        std::process::exit(2);
    }
    let a = args();
    println!("soak: seed {} (replay with --seed {}), {:?} of faults", a.seed, a.seed, a.duration);
    let (row, failures) = soak(&a);
    let table = format!(
        "| scenario | load | faults | duration | requests lost | double allocations | leftovers | RSS drift |\n|---|---|---|---|---|---|---|---|\n{row}\n"
    );
    println!("\n{table}");
    if let Some(out) = &a.out {
        std::fs::write(out, &table).expect("--out");
    }
    if !failures.is_empty() {
        for f in &failures {
            eprintln!("soak: FAILED: {f}");
        }
        eprintln!("soak: seed {}", a.seed);
        std::process::exit(1);
    }
    println!("soak: every invariant held");
}

// ---------------------------------------------------------------------------------------------
// Probes

/// One failed probe: when (since the start), which target, what.
#[derive(Clone)]
struct Failure {
    at: Duration,
    target: String,
    error: String,
}

/// Real clients in the client namespace, one thread per target, each sending one request (a new
/// connection, or a fresh UDP socket) every [`PROBE_INTERVAL`].
struct Probes {
    stop: Arc<AtomicBool>,
    sent: Arc<Mutex<BTreeMap<String, u64>>>,
    failures: Arc<Mutex<Vec<Failure>>>,
    threads: Vec<std::thread::JoinHandle<()>>,
}

impl Probes {
    fn new() -> Probes {
        Probes {
            stop: Arc::new(AtomicBool::new(false)),
            sent: Default::default(),
            failures: Default::default(),
            threads: Vec::new(),
        }
    }

    fn start(&mut self, c: &Cluster, t0: Instant, node: usize, port: u16, udp: bool) {
        let target = format!("node-{}:{port}/{}", node + 1, if udp { "udp" } else { "tcp" });
        let addr = IpAddr::V4(node_v4(node));
        let path = format!("/run/netns/{}", c.client.name);
        let (stop, sent, failures) = (self.stop.clone(), self.sent.clone(), self.failures.clone());
        self.threads.push(std::thread::spawn(move || {
            let f = std::fs::File::open(&path).expect("open netns");
            nix::sched::setns(f, nix::sched::CloneFlags::CLONE_NEWNET).expect("setns");
            while !stop.load(Ordering::SeqCst) {
                let r = if udp {
                    udp_request_here(addr, port, b"ping", PROBE_TIMEOUT).map(|_| ())
                } else {
                    http_request_here(addr, port, "/", PROBE_TIMEOUT).and_then(|r| {
                        if r.status == 200 {
                            Ok(())
                        } else {
                            Err(common::topology::ClientError::Other(format!("HTTP {}", r.status)))
                        }
                    })
                };
                *sent.lock().unwrap().entry(target.clone()).or_default() += 1;
                if let Err(e) = r {
                    let at = t0.elapsed();
                    eprintln!("soak: {at:.1?}: probe {target} FAILED: {e:?}");
                    failures.lock().unwrap().push(Failure {
                        at,
                        target: target.clone(),
                        error: format!("{e:?}"),
                    });
                }
                std::thread::sleep(PROBE_INTERVAL);
            }
        }));
    }

    fn stop(mut self) -> (u64, Vec<Failure>) {
        self.stop.store(true, Ordering::SeqCst);
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
        let sent = self.sent.lock().unwrap().values().sum();
        (sent, self.failures.lock().unwrap().clone())
    }
}

// ---------------------------------------------------------------------------------------------
// Churn

/// The churned Services: name → what was last written.
struct Churn {
    specs: BTreeMap<String, ServiceSpec>,
    next: usize,
    ops: BTreeMap<&'static str, u64>,
    errors: u64,
}

fn random_spec(rng: &mut Rng, name: &str) -> ServiceSpec {
    let mut s = ServiceSpec::new(name);
    s.namespace = CHURN_NS.into();
    let request = |rng: &mut Rng| rng.chance(0.4).then(|| rng.range(HOT.0, HOT.1) as u16);
    match rng.below(3) {
        0 => s = s.port(PortSpec::tcp(80, request(rng))),
        1 => s = s.port(PortSpec::udp(53, request(rng))),
        _ => s = s.port(PortSpec::tcp(80, request(rng))).port(PortSpec::udp(53, None)),
    }
    set_random_endpoints(rng, &mut s);
    if rng.chance(0.3) {
        s = s.source_range(if rng.chance(0.5) { "203.0.113.0/24" } else { "198.51.100.0/25" });
    }
    if rng.chance(0.3) {
        s = s.local_policy();
    }
    s
}

fn set_random_endpoints(rng: &mut Rng, s: &mut ServiceSpec) {
    s.endpoints.clear();
    for b in 0..3 {
        if rng.chance(0.6) {
            let e = EndpointSpec::remote(backend_v4(b), &node_name(rng.below(3) as usize));
            s.endpoints.push(if rng.chance(0.15) { e.not_ready() } else { e });
        }
    }
}

impl Churn {
    fn new() -> Churn {
        Churn { specs: BTreeMap::new(), next: 0, ops: BTreeMap::new(), errors: 0 }
    }

    /// One random create, edit or delete (a failed request is counted, not fatal: faults are on).
    fn step(&mut self, c: &Cluster, rng: &mut Rng) {
        let op = if self.specs.is_empty() || (self.specs.len() < MAX_CHURN && rng.chance(0.3)) {
            "create"
        } else {
            *rng.pick(&["ports", "endpoints", "source-ranges", "policy", "annotation", "delete"])
        };
        *self.ops.entry(op).or_default() += 1;
        let ok = match op {
            "create" => {
                self.next += 1;
                let name = format!("c{}", self.next);
                let spec = random_spec(rng, &name);
                let mut svc = spec.service();
                svc["spec"].as_object_mut().unwrap().remove("selector");
                let ok =
                    c.api.create(svc).is_ok() && spec.slices().into_iter().all(|s| c.api.apply(s).is_ok());
                self.specs.insert(name, spec);
                ok
            }
            "delete" => {
                let name = rng.pick(&self.specs.keys().cloned().collect::<Vec<_>>()).clone();
                let spec = self.specs.remove(&name).unwrap();
                let mut ok = c.api.delete("v1", "Service", CHURN_NS, &name).is_ok();
                for s in spec.slices() {
                    let slice = s["metadata"]["name"].as_str().unwrap().to_string();
                    ok &= c.api.delete("discovery.k8s.io/v1", "EndpointSlice", CHURN_NS, &slice).is_ok();
                }
                ok
            }
            edit => {
                let name = rng.pick(&self.specs.keys().cloned().collect::<Vec<_>>()).clone();
                let spec = self.specs.get_mut(&name).unwrap();
                let patch = match edit {
                    "ports" => {
                        let fresh = random_spec(rng, &name);
                        spec.ports = fresh.ports;
                        if !spec.slices().into_iter().all(|s| c.api.apply(s).is_ok()) {
                            self.errors += 1;
                            return;
                        }
                        json!({"spec": {"ports": spec.service()["spec"]["ports"].clone()},
                               "metadata": {"annotations": {"nodelb.io/ports": spec.service()["metadata"]["annotations"]["nodelb.io/ports"].clone()}}})
                    }
                    "endpoints" => {
                        set_random_endpoints(rng, spec);
                        let ok = spec.slices().into_iter().all(|s| c.api.apply(s).is_ok());
                        if !ok {
                            self.errors += 1;
                        }
                        return;
                    }
                    "source-ranges" => {
                        spec.source_ranges = if spec.source_ranges.is_empty() {
                            vec!["203.0.113.0/24".into()]
                        } else {
                            Vec::new()
                        };
                        let v = if spec.source_ranges.is_empty() {
                            Value::Null
                        } else {
                            json!(spec.source_ranges)
                        };
                        json!({"spec": {"loadBalancerSourceRanges": v}})
                    }
                    "policy" => {
                        spec.traffic_policy =
                            if spec.traffic_policy == "Local" { "Cluster".into() } else { "Local".into() };
                        json!({"spec": {"externalTrafficPolicy": spec.traffic_policy}})
                    }
                    _ => {
                        let p = &mut spec.ports[0];
                        p.node_port =
                            if p.node_port.is_some() { None } else { Some(rng.range(HOT.0, HOT.1) as u16) };
                        json!({"metadata": {"annotations": {"nodelb.io/ports": spec.service()["metadata"]["annotations"]["nodelb.io/ports"].clone()}}})
                    }
                };
                merge_patch(c, "service", CHURN_NS, &name, patch)
            }
        };
        if !ok {
            self.errors += 1;
        }
    }
}

/// A JSON merge patch of an object (as `kubectl patch --type=merge`).
fn merge_patch(c: &Cluster, resource: &str, ns: &str, name: &str, patch: Value) -> bool {
    c.api
        .kubectl(&["patch", resource, name, "-n", ns, "--type=merge", "-p", &patch.to_string()])
        .status
        .success()
}

// ---------------------------------------------------------------------------------------------
// Faults

const FAULTS: &[&str] = &[
    "api-reset",
    "api-blackhole",
    "api-restart",
    "etcd-compaction",
    "agent-sigkill",
    "agent-sigkill-mid-batch",
    "leader-sigstop",
    "lease-deleted",
    "lease-stolen",
    "table-deleted",
    "table-edited",
];

/// Now, as a Lease's `renewTime` (RFC 3339, microseconds).
fn micro_time_now() -> String {
    let out = std::process::Command::new("date").args(["-u", "+%Y-%m-%dT%H:%M:%S.%6NZ"]).output().unwrap();
    String::from_utf8(out.stdout).unwrap().trim().to_string()
}

fn signal(pid: Option<u32>, sig: nix::sys::signal::Signal) {
    if let Some(pid) = pid {
        let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid as i32), sig);
    }
}

/// Churns for `d` (a step every 300–700 ms).
fn churn_for(c: &Cluster, churn: &mut Churn, rng: &mut Rng, d: Duration) {
    let end = Instant::now() + d;
    while Instant::now() < end {
        churn.step(c, rng);
        std::thread::sleep(
            Duration::from_millis(rng.range(300, 700)).min(end.saturating_duration_since(Instant::now())),
        );
    }
}

/// A burst of [`BURST`] Services with endpoints in one `kubectl apply` (one large batch on every
/// node).
fn burst_yaml(dir: &std::path::Path, round: usize) -> std::path::PathBuf {
    let mut docs = Vec::new();
    for k in 0..BURST {
        let mut s = ServiceSpec::new(&format!("b{round}-{k}"))
            .port(PortSpec::tcp(80, None))
            .endpoint(EndpointSpec::remote(backend_v4(k % 3), &node_name(k % 3)));
        s.namespace = BURST_NS.into();
        let mut svc = s.service();
        svc["spec"].as_object_mut().unwrap().remove("selector");
        docs.push(svc);
        docs.extend(s.slices());
    }
    let path = dir.join(format!("burst-{round}.yaml"));
    std::fs::write(&path, common::manifest::render_docs(&docs)).unwrap();
    path
}

/// Injects one fault (churn goes on meanwhile) and ends it.
fn fault(
    c: &mut Cluster,
    kind: &str,
    churn: &mut Churn,
    rng: &mut Rng,
    scratch: &std::path::Path,
    n: usize,
) -> String {
    let victim = |rng: &mut Rng| if rng.chance(0.5) { 1 } else { 2 };
    match kind {
        "api-reset" | "api-blackhole" => {
            let d = Duration::from_secs(rng.range(4, 10));
            c.api.cut(if kind == "api-reset" { Fault::Reset } else { Fault::Blackhole });
            churn_for(c, churn, rng, d);
            c.api.reopen();
            format!("{d:?}")
        }
        "api-restart" => {
            let t = Instant::now();
            c.api.restart();
            format!("down {:.1?}", t.elapsed())
        }
        "etcd-compaction" => {
            churn_for(c, churn, rng, Duration::from_secs(1));
            let rev = c.api.compact();
            // Every watch reconnects from its last resourceVersion, now compacted: 410 Gone.
            c.api.cut(Fault::Reset);
            std::thread::sleep(Duration::from_millis(500));
            c.api.reopen();
            format!("compacted at revision {rev}")
        }
        "agent-sigkill" => {
            let i = victim(rng);
            let d = Duration::from_millis(rng.range(0, 2000));
            churn_for(c, churn, rng, d);
            c.agents[i].kill9();
            std::thread::sleep(Duration::from_millis(rng.range(0, 3000)));
            c.agents[i].restart();
            format!("node-{}", i + 1)
        }
        "agent-sigkill-mid-batch" => {
            let i = victim(rng);
            let file = burst_yaml(scratch, n);
            let delay = Duration::from_millis(rng.range(0, 2000));
            let out = c.api.kubectl(&["apply", "-f", file.to_str().unwrap()]);
            std::thread::sleep(delay);
            c.agents[i].restart();
            churn_for(c, churn, rng, Duration::from_secs(5));
            // Deleting them is a large batch too.
            let del = c.api.kubectl(&[
                "delete",
                "services,endpointslices",
                "-n",
                BURST_NS,
                "--all",
                "--wait=false",
            ]);
            if !out.status.success() || !del.status.success() {
                churn.errors += 1;
            }
            format!("node-{} {delay:?} after a burst of {BURST}", i + 1)
        }
        "leader-sigstop" => {
            let Some(l) = c.leader_index() else { return "no leader".into() };
            let d = Duration::from_secs(rng.range(5, 8));
            signal(c.controllers[l].pid(), nix::sys::signal::Signal::SIGSTOP);
            churn_for(c, churn, rng, d);
            signal(c.controllers[l].pid(), nix::sys::signal::Signal::SIGCONT);
            format!("{} stopped {d:?} (Lease 3 s)", common::cluster::controller_name(l))
        }
        "lease-deleted" => {
            let mut what = vec![LEADER_LEASE.to_string()];
            let _ = c.api.delete("coordination.k8s.io/v1", "Lease", AGENT_NS, LEADER_LEASE);
            let registry: Vec<String> = c
                .api
                .list("coordination.k8s.io/v1", "Lease", Some(AGENT_NS))
                .iter()
                .filter_map(|l| l["metadata"]["name"].as_str().map(String::from))
                .filter(|n| n.starts_with("nodelb-node-ports-"))
                .collect();
            if let Some(r) = registry.first() {
                let _ = c.api.delete("coordination.k8s.io/v1", "Lease", AGENT_NS, r);
                what.push(r.clone());
            }
            churn_for(c, churn, rng, Duration::from_secs(3));
            what.join(", ")
        }
        "lease-stolen" => {
            let patch = json!({"spec": {"holderIdentity": "soak-intruder", "leaseDurationSeconds": 5,
                "renewTime": micro_time_now(), "acquireTime": micro_time_now()}});
            let ok = merge_patch(c, "lease", AGENT_NS, LEADER_LEASE, patch);
            churn_for(c, churn, rng, Duration::from_secs(7));
            if ok { "5 s".into() } else { "patch failed".into() }
        }
        "table-deleted" => {
            let out = c.nodes[TAMPERED].exec("nft", &["delete", "table", "inet", "nodelb"]);
            churn_for(c, churn, rng, Duration::from_secs(3));
            format!("node-{} ({})", TAMPERED + 1, if out.status.success() { "deleted" } else { "absent" })
        }
        "table-edited" => {
            let listing = nft_list(&c.nodes[TAMPERED]).unwrap_or_default();
            let chains = common::agent::chain_names(&listing);
            let mut done = Vec::new();
            if let Some(ch) = chains.iter().find(|c| c.starts_with("svc")).or(chains.first()) {
                let flushed = c.nodes[TAMPERED].exec("nft", &["flush", "chain", "inet", "nodelb", ch]);
                if flushed.status.success() {
                    done.push(format!("flushed {ch}"));
                }
            }
            let added = c.nodes[TAMPERED].exec(
                "nft",
                &["add", "rule", "inet", "nodelb", "filter-forward", "meta", "mark", "0x1234", "counter"],
            );
            if added.status.success() {
                done.push("foreign rule in filter-forward".into());
            }
            churn_for(c, churn, rng, Duration::from_secs(3));
            format!("node-{}: {}", TAMPERED + 1, done.join(", "))
        }
        other => panic!("unknown fault {other}"),
    }
}

// ---------------------------------------------------------------------------------------------
// The run

fn rss_kib(pid: Option<u32>) -> Option<u64> {
    let status = std::fs::read_to_string(format!("/proc/{}/status", pid?)).ok()?;
    status.lines().find_map(|l| l.strip_prefix("VmRSS:")?.trim().strip_suffix("kB")?.trim().parse().ok())
}

fn stable_specs() -> Vec<ServiceSpec> {
    vec![
        ServiceSpec::new("stable-a").port(PortSpec::tcp(80, None)).endpoints([
            EndpointSpec::remote(backend_v4(0), "node-1"),
            EndpointSpec::remote(backend_v4(1), "node-2"),
        ]),
        ServiceSpec::new("stable-b").port(PortSpec::tcp(80, None)).endpoints([
            EndpointSpec::remote(backend_v4(1), "node-2"),
            EndpointSpec::remote(backend_v4(2), "node-3"),
        ]),
        ServiceSpec::new("stable-u")
            .port(PortSpec::udp(53, None))
            .endpoints([EndpointSpec::remote(backend_v4(2), "node-3")]),
    ]
}

fn soak(a: &Args) -> (String, Vec<String>) {
    let mut rng = Rng::new(a.seed);
    let mut failures = Vec::new();
    let setup = Instant::now();
    let mut c = Cluster::with_apiserver_args(3, &["--watch-cache=false"]);
    for ns in [CHURN_NS, BURST_NS] {
        c.api.create(common::kube::namespace(ns)).expect("namespace");
    }
    let watch = AllocationWatch::start(&c.api, None);
    let stable = stable_specs();
    let mut stable_ports = BTreeMap::new();
    for s in &stable {
        c.create(s);
        let ports = c.wait_allocated(&s.name, 1, Duration::from_secs(30));
        stable_ports.insert(s.name.clone(), ports);
    }
    for (name, ports) in &stable_ports {
        for &np in ports.values() {
            for i in 0..3 {
                if name != "stable-u" {
                    c.wait_served(i, np, Duration::from_secs(30));
                }
            }
        }
    }
    let scratch = tempfile::tempdir().unwrap();
    let mut churn = Churn::new();
    // The initial load, before the witness's RSS is taken.
    for _ in 0..MAX_CHURN {
        churn.step(&c, &mut rng);
    }
    std::thread::sleep(Duration::from_secs(5));
    let rss_start = rss_kib(c.agents[WITNESS].pid()).unwrap_or(0);
    println!(
        "soak: set up in {:.0?}; node-{} RSS {rss_start} KiB; stable ports {stable_ports:?}",
        setup.elapsed(),
        WITNESS + 1
    );

    let t0 = Instant::now();
    let mut probes = Probes::new();
    for (name, ports) in &stable_ports {
        for (key, &np) in ports {
            for node in 0..3 {
                if node != TAMPERED {
                    probes.start(&c, t0, node, np, key.ends_with("/UDP") || name == "stable-u");
                }
            }
        }
    }

    let mut order: Vec<&str> = Vec::new();
    let mut counts: BTreeMap<&str, u64> = BTreeMap::new();
    let mut n = 0;
    while t0.elapsed() < a.duration {
        if order.is_empty() {
            order = FAULTS.to_vec();
            for i in (1..order.len()).rev() {
                order.swap(i, rng.below(i as u64 + 1) as usize);
            }
        }
        let kind = order.pop().unwrap();
        n += 1;
        let start = t0.elapsed();
        let what = fault(&mut c, kind, &mut churn, &mut rng, scratch.path(), n);
        println!("soak: {start:>8.1?} fault {n}: {kind} ({what}), ended at {:.1?}", t0.elapsed());
        *counts.entry(kind).or_default() += 1;
        // Some calm (churn only) between faults.
        let calm = Duration::from_secs(rng.range(2, 5));
        churn_for(&c, &mut churn, &mut rng, calm);
    }
    let chaos = t0.elapsed();
    // Faults stop: every agent running, the API open. Churn stops too (the final state).
    for (i, agent) in c.agents.iter_mut().enumerate() {
        if !agent.is_running() {
            println!("soak: node-{} agent not running at the end: restarted", i + 1);
            failures.push(format!("node-{}'s agent had exited by itself", i + 1));
            agent.restart();
        }
    }
    let stop = Instant::now();
    let mut converged = vec![None; 3];
    let mut last = vec![(String::new(), String::new()); 3];
    wait_until(CONVERGENCE_BOUND, || {
        for i in 0..3 {
            if converged[i].is_none() {
                let plan = planned_listing(&c.plan(i));
                let table = canonical_ruleset(&nft_list(&c.nodes[i]).unwrap_or_default());
                if plan == table {
                    converged[i] = Some(stop.elapsed());
                }
                last[i] = (plan, table);
            }
        }
        converged.iter().all(Option::is_some)
    });
    // Converged once is not enough: the same a moment later (nothing left to undo).
    std::thread::sleep(Duration::from_secs(3));
    let mut leftovers = 0usize;
    for i in 0..3 {
        let plan = planned_listing(&c.plan(i));
        let table = canonical_ruleset(&nft_list(&c.nodes[i]).unwrap_or_default());
        if plan != table || converged[i].is_none() {
            let (p, t) = if converged[i].is_none() { last[i].clone() } else { (plan, table) };
            let diff = line_diff(&p, &t);
            leftovers += diff.len();
            failures.push(format!(
                "node-{}: table is not the plan {CONVERGENCE_BOUND:?} after the faults stopped:\n{}",
                i + 1,
                diff.join("\n")
            ));
        }
    }
    let conv = converged.iter().flatten().max().copied();
    println!("soak: converged to the plan: {:?} (bound {CONVERGENCE_BOUND:?})", converged);
    // Probes ran through convergence too.
    let (sent, lost) = probes.stop();
    if !lost.is_empty() {
        let first: Vec<String> =
            lost.iter().take(10).map(|f| format!("{:.1?} {}: {}", f.at, f.target, f.error)).collect();
        failures.push(format!(
            "{} of {sent} requests to stable Services failed: {}",
            lost.len(),
            first.join("; ")
        ));
    }
    for (name, ports) in &stable_ports {
        let now = c.allocated(name);
        if now.as_ref() != Some(ports) {
            failures.push(format!("stable Service {name}: node ports {ports:?} became {now:?}"));
        }
    }
    let (events, relists) = watch.counts();
    // The watch misses a double that came and went while it relisted; the final state is read
    // in full too.
    let stored: Vec<k8s_openapi::api::core::v1::Service> = c
        .api
        .list("v1", "Service", None)
        .into_iter()
        .filter_map(|v| serde_json::from_value(v).ok())
        .collect();
    let mut doubles = watch.doubles();
    doubles.extend(common::invariants::doubles(&stored));
    if !doubles.is_empty() {
        failures.push(format!("node ports held twice in stored Services: {doubles:?}"));
    }
    // Taken as the start was, 5 s after the last change.
    std::thread::sleep(Duration::from_secs(5));
    let rss_end = rss_kib(c.agents[WITNESS].pid()).unwrap_or(0);
    let drift = rss_end as i64 - rss_start as i64;
    if rss_end == 0 || drift > rss_margin(rss_start) as i64 {
        failures.push(format!(
            "node-{} RSS {rss_start} KiB → {rss_end} KiB (margin {} KiB)",
            WITNESS + 1,
            rss_margin(rss_start)
        ));
    }
    // Failed syncs are allowed (a table deleted under a batch, the kernel refusing one): each is
    // followed by a full resync, which convergence checks. They are counted by their error.
    let mut sync_failures: BTreeMap<String, u64> = BTreeMap::new();
    for (i, agent) in c.agents.iter().enumerate() {
        let logs = agent.logs();
        if let Some(line) = logs.lines().find(|l| l.contains("panicked")) {
            failures.push(format!("node-{}: panic in the log: {line}", i + 1));
        }
        for line in logs.lines().filter(|l| l.contains("sync failed")) {
            let error = serde_json::from_str::<Value>(line)
                .ok()
                .and_then(|v| v["fields"]["error"].as_str().map(String::from))
                .unwrap_or_else(|| line.to_string());
            *sync_failures.entry(format!("node-{}: {error}", i + 1)).or_default() += 1;
        }
    }
    println!("soak: failed syncs (each followed by a full resync): {sync_failures:#?}");
    println!(
        "soak: {n} faults {counts:?}; churn {:?} ({} failed requests to the API during faults); watch: {events} events, {relists} list(s)",
        churn.ops, churn.errors
    );
    println!("soak: {sent} requests to stable Services, {} failed", lost.len());
    let fault_kinds = counts.len();
    let row = format!(
        "| chaos soak, 3 agents | {} stable Services probed through 2 nodes every {:?} ({sent} requests); churn {} ops on ≤{MAX_CHURN} Services + {BURST}-Service bursts | {n} faults of {fault_kinds} kinds (each: {}) | {:.0} s of faults + {} to converge | {} | {} | {} | {:+} KiB ({rss_start} → {rss_end} KiB, margin {} KiB) |",
        stable.len(),
        PROBE_INTERVAL,
        churn.ops.values().sum::<u64>(),
        counts.iter().map(|(k, v)| format!("{k} ×{v}")).collect::<Vec<_>>().join(", "),
        chaos.as_secs_f64(),
        conv.map_or_else(|| format!("> {CONVERGENCE_BOUND:?}"), |d| format!("{d:.1?}")),
        lost.len(),
        doubles.len(),
        leftovers,
        drift,
        rss_margin(rss_start),
    );
    (row, failures)
}

/// The lines only one side has (`- plan`, `+ table`).
fn line_diff(plan: &str, table: &str) -> Vec<String> {
    let p: std::collections::BTreeSet<&str> = plan.lines().collect();
    let t: std::collections::BTreeSet<&str> = table.lines().collect();
    p.difference(&t).map(|l| format!("- {l}")).chain(t.difference(&p).map(|l| format!("+ {l}"))).collect()
}
