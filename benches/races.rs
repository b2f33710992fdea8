//! Targeted races, repeated until they would have shown. A benchmark-style
//! program, not a timed test: it runs a number of randomized rounds (seeded: the seed is printed
//! and `--seed` replays a run), checks its invariants in every round, prints a summary row per
//! scenario and exits 1 when an invariant broke.
//!
//! ```text
//! cargo bench --bench races -- --only split-brain --rounds 1000 [--seed S]
//! ```
//!
//! Scenarios:
//! - `split-brain`: two leaders at once against the real API server (testkube), each round with
//!   conflicting allocation requests and a different view of them; nodelb's own leader code
//!   (`round::plan_round` + its writes) on both sides; a watch on every stored Service
//!   counts node ports held twice.
//!
//! - `kill-mid-sync`: one node (manifests mode) with 10,000 Services (`--services N`) and three
//!   pre-existing ones probed by real clients (TCP twice, UDP); each round SIGKILLs the agent at a
//!   random moment of its full sync at start (even rounds) or of the sync of a churn change (odd
//!   rounds: up to 40 Services added, edited or removed), and starts it again; then the table must
//!   be exactly what `nodelb plan` computes from the same manifests and state file (canonical
//!   listings). Invariants: 0 failed requests to the pre-existing Services, every round's table
//!   equal to the plan. `--kill-rounds N` (default 10).
//!
//! Root only (network namespaces); everything is deleted on exit, on panic and on Ctrl-C.

#[path = "../tests/common/mod.rs"]
mod common;

use std::collections::BTreeSet;
use std::net::{IpAddr, Ipv4Addr};
use std::sync::Arc;
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::Service;
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams, PostParams};
use serde_json::json;

use common::agent::{Agent, canonical_ruleset, nft_list, nodelb};
use common::cluster::planned_listing;
use common::invariants::{AllocationWatch, doubles};
use common::kube::ControlPlane;
use common::manifest::{EndpointSpec, PortSpec, ServiceSpec, render_all};
use common::netns::NetNs;
use common::rng::Rng;
use common::topology::{ClientLoop, NODE_V4, Topology, backend_v4, wait_until};
use nodelb::core::decisions::port_policy::PortRange;
use nodelb::core::k8s::round::{ControllerConfig, LeaderState};
use nodelb::core::k8s::snapshot::KubeSnapshot;
use nodelb::k8s::controller;

struct Args {
    only: Vec<String>,
    rounds: usize,
    kill_rounds: usize,
    services: usize,
    seed: u64,
    out: Option<String>,
}

fn args() -> Args {
    let a = common::args::ProgramArgs::from_env();
    Args {
        only: a
            .value("--only")
            .unwrap_or_else(|| "split-brain".into())
            .split(',')
            .map(String::from)
            .collect(),
        rounds: a.number("--rounds", 1000),
        kill_rounds: a.number("--kill-rounds", 10),
        services: a.number("--services", 10_000),
        seed: a.seed(),
        out: a.value("--out"),
    }
}

/// One line of the summary (and of docs/reliability.md).
struct Row {
    scenario: String,
    load: String,
    faults: String,
    duration: Duration,
    lost: String,
    doubles: usize,
    leftovers: String,
    rss: String,
    ok: bool,
}

fn main() {
    common::cleanup::install_signal_cleanup();
    if !nix::unistd::Uid::effective().is_root() {
        eprintln!("races: needs root (network namespaces)");
        std::process::exit(2);
    }
    let a = args();
    println!("races: seed {} (replay with --seed {})", a.seed, a.seed);
    let mut rows = Vec::new();
    for s in &a.only {
        let mut rng = Rng::new(a.seed);
        let row = match s.as_str() {
            "split-brain" => split_brain(&a, &mut rng),
            "kill-mid-sync" => kill_mid_sync(&a, &mut rng),
            other => {
                eprintln!("races: unknown scenario {other:?} (split-brain, kill-mid-sync)");
                std::process::exit(2);
            }
        };
        rows.push(row);
    }
    let mut table = String::from(
        "| scenario | load | faults | duration | requests lost | double allocations | leftovers | RSS drift |\n|---|---|---|---|---|---|---|---|\n",
    );
    for r in &rows {
        table.push_str(&format!(
            "| {} | {} | {} | {:.0} s | {} | {} | {} | {} |\n",
            r.scenario,
            r.load,
            r.faults,
            r.duration.as_secs_f64(),
            r.lost,
            r.doubles,
            r.leftovers,
            r.rss
        ));
    }
    println!("\n{table}");
    if let Some(out) = &a.out {
        std::fs::write(out, &table).expect("--out");
    }
    let failed: Vec<&str> = rows.iter().filter(|r| !r.ok).map(|r| r.scenario.as_str()).collect();
    if !failed.is_empty() {
        eprintln!("races: FAILED: {} (seed {})", failed.join(", "), a.seed);
        std::process::exit(1);
    }
}

// ---------------------------------------------------------------------------------------------
// Split brain

/// Namespace of the split-brain Services.
const NS: &str = "race";
/// A small range, so that automatic allocations and requests compete for the same numbers.
const RANGE: (u16, u16) = (20000, 20029);
/// The numbers requests ask for (the low end of the range: automatic allocation takes those
/// first too).
const HOT: (u16, u16) = (20000, 20005);
const MAX_SERVICES: usize = 16;

fn leader_config(name: &str) -> ControllerConfig {
    let range = PortRange::new(RANGE.0, RANGE.1).unwrap();
    ControllerConfig {
        identity: name.into(),
        namespace: "nodelb-system".into(),
        lease_duration: Duration::from_secs(3),
        node_addresses: Vec::new(),
        port_range: range,
        model: Default::default(),
        policy: nodelb::core::decisions::desired::HostPolicy {
            ports: nodelb::core::decisions::port_policy::PortPolicy {
                ranges: vec![range],
                allowed: Default::default(),
            },
            ..Default::default()
        },
    }
}

/// A leader as the agent runs one: its config and its memory between rounds.
struct Leader {
    cfg: ControllerConfig,
    state: LeaderState,
}

impl Leader {
    fn new(name: &str) -> Leader {
        Leader { cfg: leader_config(name), state: LeaderState::new(controller::process_token(name)) }
    }

    /// One round of nodelb's leader code (`controller::leader_round`: the node-port registry,
    /// then the Services) on `view`, a list of the Services as this leader saw them; `true` when
    /// a write met a stale resourceVersion.
    async fn round(&mut self, client: &kube::Client, view: &[Service]) -> bool {
        let snap =
            KubeSnapshot { services: view.iter().cloned().map(Arc::new).collect(), ..Default::default() };
        self.state.observe(&snap, std::time::Instant::now());
        controller::leader_round(client, &self.cfg, &snap, &mut self.state, None, true, None).await.again
    }
}

fn service_json(name: &str, ports: &[(u16, &str)], request: Option<(u16, &str, u16)>) -> serde_json::Value {
    let mut annotations = serde_json::Map::new();
    if let Some((port, proto, number)) = request {
        annotations.insert("nodelb.io/ports".into(), json!(format!("{port}/{proto}={number}")));
    }
    let ports: Vec<_> = ports
        .iter()
        .map(|(p, proto)| json!({"name": format!("{}-{p}", proto.to_lowercase()), "port": p, "protocol": proto}))
        .collect();
    json!({
        "apiVersion": "v1", "kind": "Service",
        "metadata": {"name": name, "namespace": NS, "annotations": annotations},
        "spec": {"type": "LoadBalancer", "ports": ports},
    })
}

/// One random change that makes two views of the Services disagree about who asks for what.
async fn mutate(api: &Api<Service>, rng: &mut Rng, next_name: &mut usize, current: &[Service]) {
    let names: Vec<String> = current.iter().filter_map(|s| s.metadata.name.clone()).collect();
    let op = if names.is_empty() || (names.len() < MAX_SERVICES && rng.chance(0.5)) {
        0
    } else if names.len() >= MAX_SERVICES || rng.chance(0.4) {
        2
    } else {
        1
    };
    match op {
        0 => {
            *next_name += 1;
            let name = format!("s{next_name}");
            let ports: Vec<(u16, &str)> = match rng.below(3) {
                0 => vec![(80, "TCP")],
                1 => vec![(80, "TCP"), (53, "UDP")],
                _ => vec![(53, "UDP")],
            };
            let request = rng.chance(0.6).then(|| {
                let (p, proto) = *rng.pick(&ports);
                (p, proto, rng.range(HOT.0.into(), HOT.1.into()) as u16)
            });
            let svc: Service = serde_json::from_value(service_json(&name, &ports, request)).unwrap();
            if let Err(e) = api.create(&PostParams::default(), &svc).await {
                panic!("create {name}: {e}");
            }
        }
        1 => {
            // Ask for another number (or stop asking), unconditionally, as a user's edit does.
            let svc = rng.pick(current);
            let name = svc.metadata.name.clone().unwrap();
            let port = svc.spec.as_ref().and_then(|s| s.ports.as_ref()).and_then(|p| p.first()).cloned();
            let Some(port) = port else { return };
            let value = if rng.chance(0.8) {
                json!(format!(
                    "{}/{}={}",
                    port.port,
                    port.protocol.as_deref().unwrap_or("TCP"),
                    rng.range(HOT.0.into(), HOT.1.into())
                ))
            } else {
                serde_json::Value::Null
            };
            let patch = json!({"metadata": {"annotations": {"nodelb.io/ports": value}}});
            let _ = api.patch(&name, &PatchParams::default(), &Patch::Merge(&patch)).await;
        }
        _ => {
            let svc = rng.pick(current);
            let name = svc.metadata.name.clone().unwrap();
            let _ = api.delete(&name, &DeleteParams::default()).await;
        }
    }
}

async fn list(api: &Api<Service>) -> (Vec<Service>, u64) {
    let l = api.list(&ListParams::default()).await.expect("list Services");
    let rv = l.metadata.resource_version.as_deref().and_then(|v| v.parse().ok()).unwrap_or(0);
    (l.items, rv)
}

fn split_brain(a: &Args, rng: &mut Rng) -> Row {
    let ns = NetNs::new("race-api");
    // This scenario's requests are made from a thread inside the API namespace (`block_on`
    // polls them here, so their connections are opened here).
    std::thread::scope(|s| {
        s.spawn(|| {
            ns.enter_current_thread();
            split_brain_in(a, rng, &ns)
        })
        .join()
        .unwrap_or_else(|e| std::panic::resume_unwind(e))
    })
}

fn split_brain_in(a: &Args, rng: &mut Rng, ns: &NetNs) -> Row {
    let started = Instant::now();
    let cp = ControlPlane::start(ns, Ipv4Addr::LOCALHOST, 6443, &[]);
    cp.create(json!({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NS}})).unwrap();
    cp.create(json!({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "nodelb-system"}}))
        .unwrap();
    let watch = AllocationWatch::start(&cp, Some(NS));
    let client = cp.client();
    let api: Api<Service> = Api::namespaced(client.clone(), NS);
    let mut leaders = [Leader::new("node-a"), Leader::new("node-b")];
    let mut next_name = 0usize;
    let mut rounds_with_doubles = 0usize;
    let mut conflicts = 0usize;
    let mut last_rv = 0;
    let rt = cp.runtime();
    for round in 0..a.rounds {
        let mut r = rng.fork();
        let (stale_first, a_first, delay) =
            (r.chance(0.5), r.chance(0.5), if r.chance(0.7) { 0 } else { r.below(15) });
        let outcome = rt.block_on(async {
            // Two views of the Services, each after a few changes nobody allocated yet (new
            // Services, changed requests, deletions): the second also has the first's. Each
            // leader gets one, so both have work, and their decisions conflict.
            let mut current = list(&api).await.0;
            for _ in 0..r.range(1, 2) {
                mutate(&api, &mut r, &mut next_name, &current).await;
                current = list(&api).await.0;
            }
            let view_old = current.clone();
            for _ in 0..r.range(1, 2) {
                mutate(&api, &mut r, &mut next_name, &current).await;
                current = list(&api).await.0;
            }
            let view_new = current;
            let (va, vb) = if stale_first { (view_old, view_new) } else { (view_new, view_old) };
            let [la, lb] = &mut leaders;
            let (ca, cb) = (client.clone(), client.clone());
            let fa = async move {
                if !a_first {
                    tokio::time::sleep(Duration::from_millis(delay)).await;
                }
                la.round(&ca, &va).await
            };
            let fb = async move {
                if a_first {
                    tokio::time::sleep(Duration::from_millis(delay)).await;
                }
                lb.round(&cb, &vb).await
            };
            let (sa, sb) = tokio::join!(fa, fb);
            let (after, rv) = list(&api).await;
            (usize::from(sa) + usize::from(sb), doubles(&after), rv)
        });
        conflicts += outcome.0;
        if !outcome.1.is_empty() {
            rounds_with_doubles += 1;
            if rounds_with_doubles <= 5 {
                println!("round {round}: node port held twice after both leaders wrote: {:?}", outcome.1);
            }
        }
        last_rv = outcome.2;
        // The next round starts from a settled state: one leader alone, fresh views, until it
        // writes nothing more (it repairs what the two left, the older Service keeping a number).
        rt.block_on(async {
            for _ in 0..6 {
                let (view, _) = list(&api).await;
                let snap_writes = leaders[1].round(&client, &view).await;
                let (after, _) = list(&api).await;
                if !snap_writes && doubles(&after).is_empty() {
                    break;
                }
            }
        });
        if (round + 1) % 100 == 0 {
            println!(
                "split-brain: {} rounds, {} with a double stored, {} stale writes refused (409)",
                round + 1,
                rounds_with_doubles,
                conflicts
            );
        }
    }
    watch.wait_for(last_rv, Duration::from_secs(10));
    let seen = watch.doubles();
    let (events, relists) = watch.counts();
    println!(
        "split-brain: watch saw {events} events ({relists} list(s)); {} distinct double(s) stored",
        seen.len()
    );
    for d in seen.iter().take(10) {
        println!("  node port {} held by {}", d.number, d.holders.join(" and "));
    }
    Row {
        scenario: "split brain: two leaders at once".to_string(),
        load: format!("{} rounds, ≤{MAX_SERVICES} Services, requests for {}–{}", a.rounds, HOT.0, HOT.1),
        faults: "each round: two leaders at once, each seeing 1–2 or 2–4 changes not yet allocated".into(),
        duration: started.elapsed(),
        lost: "–".into(),
        doubles: seen.len(),
        leftovers: "–".into(),
        rss: "–".into(),
        ok: seen.is_empty(),
    }
}

// ---------------------------------------------------------------------------------------------
// SIGKILL during a full sync and during churn

/// The pre-existing Services' node ports (requested, so the plan and the probes know them).
const PRE_TCP: [u16; 2] = [39080, 39081];
const PRE_UDP: u16 = 39053;
/// Wide enough for 10,000 allocated ports next to the requested ones.
const KILL_RANGE: &str = "20000-39999";

fn pre_existing() -> String {
    let eps = || [0, 1].map(|j| EndpointSpec::local(backend_v4(j)));
    render_all(&[
        &ServiceSpec::new("pre-a").port(PortSpec::tcp(80, Some(PRE_TCP[0]))).endpoints(eps()),
        &ServiceSpec::new("pre-b").port(PortSpec::tcp(80, Some(PRE_TCP[1]))).endpoints(eps()),
        &ServiceSpec::new("pre-u").port(PortSpec::udp(53, Some(PRE_UDP))).endpoints(eps()),
    ])
}

/// `n` Services in files of 500 (`bulk-00000.yaml`, …), one TCP port each (allocated), one
/// endpoint at an address nothing answers on.
fn bulk(n: usize) -> Vec<(String, String)> {
    let mut files = Vec::new();
    let mut cur = String::new();
    for i in 0..n {
        let a = Ipv4Addr::new(198, 51, 100, 100 + (i % 150) as u8);
        cur.push_str(
            &ServiceSpec::new(&format!("bulk-{i}"))
                .port(PortSpec::tcp(80, None))
                .endpoint(EndpointSpec::local(a))
                .render(),
        );
        if (i + 1) % 500 == 0 || i + 1 == n {
            files.push((format!("bulk-{:05}.yaml", files.len()), std::mem::take(&mut cur)));
        }
    }
    files
}

/// Up to 40 churn Services (some of them, with random endpoints and sometimes a source range).
fn churn(rng: &mut Rng) -> String {
    let mut specs = Vec::new();
    for k in 0..40 {
        if !rng.chance(0.5) {
            continue;
        }
        let mut s = ServiceSpec::new(&format!("churn-{k}")).port(PortSpec::tcp(80, None));
        for j in 0..2 {
            if rng.chance(0.6) {
                s = s.endpoint(EndpointSpec::local(backend_v4(j)));
            }
        }
        if rng.chance(0.3) {
            s = s.source_range("203.0.113.0/24");
        }
        specs.push(s);
    }
    render_all(&specs.iter().collect::<Vec<_>>())
}

/// `nodelb plan` for the agent's manifests and state file, run in the node's namespace (its
/// addresses and sockets count), loaded into a scratch namespace and listed, canonical.
fn plan_of(node: &NetNs, agent: &Agent) -> String {
    let dir = agent.manifests_dir().to_str().unwrap().to_string();
    let state = agent.state_file().to_str().unwrap().to_string();
    let out = nodelb(
        node,
        &[
            "plan",
            "--manifests",
            &dir,
            "--state-file",
            &state,
            "--node-name",
            "node-1",
            "--port-range",
            KILL_RANGE,
        ],
    );
    assert!(out.status.success(), "nodelb plan: {}", String::from_utf8_lossy(&out.stderr));
    planned_listing(&String::from_utf8_lossy(&out.stdout))
}

fn kill_mid_sync(a: &Args, rng: &mut Rng) -> Row {
    let started = Instant::now();
    let topo = Topology::new(1, 2);
    let mut files = vec![("pre.yaml".to_string(), pre_existing())];
    files.extend(bulk(a.services));
    let refs: Vec<(&str, String)> = files.iter().map(|(n, c)| (n.as_str(), c.clone())).collect();
    let t = Instant::now();
    let mut agent = Agent::start(&topo.node, &refs, &["--port-range", KILL_RANGE, "--resync-period", "2s"]);
    agent.wait_ready(Duration::from_secs(600));
    let full = t.elapsed();
    println!(
        "kill-mid-sync: {} Services programmed in {full:.1?} (the window a kill is drawn in)",
        a.services + 3
    );
    let node_addr = IpAddr::V4(NODE_V4);
    let client = topo.client(0);
    let probe = Duration::from_millis(100);
    let loops: Vec<(String, ClientLoop)> = PRE_TCP
        .iter()
        .map(|&p| (format!("tcp {p}"), ClientLoop::http(client, node_addr, p, probe, Duration::from_secs(3))))
        .chain([(
            format!("udp {PRE_UDP}"),
            ClientLoop::udp(client, node_addr, PRE_UDP, probe, Duration::from_secs(3)),
        )])
        .collect();
    let mut mismatched = 0usize;
    let mut leftovers = 0usize;
    for round in 0..a.kill_rounds {
        let (what, delay) = if round % 2 == 0 {
            // A full sync: the agent starts (SIGKILL of the steady one), and is killed during
            // its first sync of everything.
            agent.restart();
            let d = Duration::from_millis(rng.below(full.as_millis() as u64 + 1));
            std::thread::sleep(d);
            ("full sync", d)
        } else {
            agent.write_manifest("churn.yaml", &churn(rng));
            let d = Duration::from_millis(rng.below(1500));
            std::thread::sleep(d);
            ("churn", d)
        };
        agent.restart();
        agent.wait_ready(Duration::from_secs(600));
        let mut last = (String::new(), String::new());
        let same = wait_until(Duration::from_secs(60), || {
            last =
                (plan_of(&topo.node, &agent), canonical_ruleset(&nft_list(&topo.node).unwrap_or_default()));
            last.0 == last.1
        });
        let failed: usize =
            loops.iter().map(|(_, l)| l.snapshot().iter().filter(|r| r.is_err()).count()).sum();
        println!(
            "kill-mid-sync: round {round}: SIGKILL {delay:?} into a {what}; table = plan: {same}; failed requests so far: {failed}"
        );
        if !same {
            mismatched += 1;
            let p: BTreeSet<&str> = last.0.lines().collect();
            let t: BTreeSet<&str> = last.1.lines().collect();
            let diff: Vec<String> = p
                .difference(&t)
                .map(|l| format!("- {l}"))
                .chain(t.difference(&p).map(|l| format!("+ {l}")))
                .collect();
            leftovers += diff.len();
            for l in diff.iter().take(20) {
                println!("  {l}");
            }
        }
    }
    let mut sent = 0;
    let mut lost = 0;
    for (name, l) in loops {
        let results = l.stop();
        sent += results.len();
        let failed: Vec<_> = results.iter().enumerate().filter(|(_, r)| r.is_err()).collect();
        lost += failed.len();
        for (i, r) in failed.iter().take(5) {
            println!("  {name}: request {i} failed: {r:?}");
        }
    }
    let panicked = agent.logs().lines().any(|l| l.contains("panicked"));
    Row {
        scenario: "SIGKILL mid-sync, restart (manifests mode)".into(),
        load: format!(
            "{} Services + 3 pre-existing probed every {probe:?} ({sent} requests); churn ≤40 Services",
            a.services
        ),
        faults: format!(
            "{} SIGKILLs: even rounds 0–{:.0?} into the full sync at start, odd ones 0–1.5 s after a churn change",
            a.kill_rounds, full
        ),
        duration: started.elapsed(),
        lost: lost.to_string(),
        doubles: 0,
        leftovers: format!("{leftovers} lines in {mismatched} of {} rounds", a.kill_rounds),
        rss: "–".into(),
        ok: lost == 0 && mismatched == 0 && !panicked,
    }
}
