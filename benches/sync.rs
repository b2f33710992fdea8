//! The agent's own (pure) work for one Service added or removed among N Services × E endpoints,
//! after the source's snapshot, two ways in one run: planned whole (`desired::compute_whole`, the
//! diff against the last ruleset, dropping the last one: how the sync loop worked before the
//! incremental planner) and as the sync loop does it now (`desired::compute`: the patch, its
//! batch, the patch applied to the last ruleset, the counter index patched). No root, no kernel:
//! the A/B loop for "recompute only what changed" (docs/benchmarks.md).
//!
//! ```text
//! cargo bench --bench sync -- --services 10000 --endpoints 5 --changes 20
//! cargo bench --bench sync -- --services 10000 --endpoints 5 --changes 20 --leader
//! cargo bench --bench sync -- --services 10000 --endpoints 5 --changes 20 --annotated
//! cargo bench --bench sync -- --services 10000 --endpoints 5 --changes 20 --manifests
//! ```
//!
//! `--leader`: the Kubernetes-mode leader's pure round instead (`k8s::round::plan_round`:
//! model, allocation, claims, status and Events of every Service, then which Events to record),
//! on Services that already carry what an earlier round wrote (so a round writes only the
//! changed Service), two Nodes with their Leases; median of `--changes` rounds, one Service
//! added or removed each. `--hash-order`: the objects in the order a reflector's store gives them
//! (a fixed shuffle), as the agent gets them in Kubernetes mode, not in key order.
//! `--annotated`: a node agent in Kubernetes mode (each Service carries the leader's allocation
//! annotation; the node reads it instead of allocating). `--next-only`: the sync loop's way
//! alone, unchecked and untimed (to profile it: `perf record -g target/release/deps/sync-… …`).
//! `--manifests`: a manifests-mode sync of the agent phase by phase, for one file written and
//! removed in a directory of N Services (500 per file, as `benches/dataplane.rs --scale` writes
//! them): the source's snapshot (`load`; `first load` parses every file), `compute`
//! (`desired`), the state file written (`state`; in a temporary directory, on this machine's
//! disk).

#[path = "../tests/common/mod.rs"]
mod common;

use std::collections::{BTreeMap, BTreeSet};
use std::net::Ipv4Addr;
use std::path::Path;
use std::sync::Arc;
use std::time::Instant;

use common::args::ProgramArgs;
use common::manifest::{EndpointSpec, PortSpec, ServiceSpec};
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::Node;
use k8s_openapi::api::core::v1::Service;
use k8s_openapi::jiff::Timestamp;
use nodelb::core::decisions::desired::{self, AllocationMode, HostFacts, HostPolicy, Inputs, SourceNotes};
use nodelb::core::decisions::port_policy::PortRange;
use nodelb::core::domain::Family;
use nodelb::core::domain::{Scope, ServiceKey};
use nodelb::core::incremental::replan::Planned;
use nodelb::core::inputs::compact::EndpointSlice;
use nodelb::core::inputs::model::ModelOptions;
use nodelb::core::k8s::claims::{self, Block, HeldNumbers, Holder, Registry, Token};
use nodelb::core::k8s::events::{Deduper, Outbox};
use nodelb::core::k8s::publish::{ServiceEvent, ServiceWrite};
use nodelb::core::k8s::round::{
    ControllerConfig, LeaderState, RegistryVersions, RoundClock, event_key, events_to_send,
};
use nodelb::core::k8s::snapshot::KubeSnapshot;
use nodelb::core::reports::counters::CounterIndex;
use nodelb::core::ruleset::ir::Ruleset;
use nodelb::core::ruleset::plan::{self, NodeFacts};

fn service(i: usize, endpoints: usize) -> ServiceSpec {
    let mut s = ServiceSpec::new(&format!("svc-{i}")).port(PortSpec::tcp(80, None));
    for e in 0..endpoints {
        s = s.endpoint(EndpointSpec::local(Ipv4Addr::new(
            198,
            51,
            100,
            100 + ((i * endpoints + e) % 150) as u8,
        )));
    }
    s
}

fn objects(text: &str) -> (Vec<Arc<Service>>, Vec<Arc<EndpointSlice>>) {
    let m = nodelb::core::inputs::manifests::parse(Path::new("bench.yaml"), "bench.yaml", text);
    assert!(m.problems.is_empty(), "{:?}", m.problems);
    (m.services, m.slices)
}

/// The middle value (the upper one of an even count).
fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v.get(v.len() / 2).copied().unwrap_or(f64::NAN)
}

fn main() {
    let args = ProgramArgs::from_env();
    if args.flag("--leader") {
        return leader(&args);
    }
    if args.flag("--manifests") {
        return manifests_phases(&args);
    }
    let n = args.number("--services", 10_000);
    let (endpoints, changes) = (args.number("--endpoints", 5), args.number("--changes", 20));
    let (mut services, slices) = cluster(n, endpoints, args.flag("--hash-order"));
    let (mut extra_svc, extra_slices) = objects(&service(n, endpoints).render());
    let range = PortRange::new(1024, 64999).expect("range");
    let model = ModelOptions::default();
    let node = NodeFacts {
        node_name: "node-1".into(),
        families: BTreeSet::from([Family::Ipv4, Family::Ipv6]),
        masquerade_mark: plan::DEFAULT_MASQUERADE_MARK,
        connection_mark: plan::DEFAULT_CONNECTION_MARK,
        forward_mark: None,
        nat_shards: 1,
    };
    let policy = HostPolicy {
        ports: nodelb::core::decisions::port_policy::PortPolicy::with_range(range),
        ..Default::default()
    };
    let (host, notes) = (HostFacts::default(), SourceNotes::default());
    let annotated = args.flag("--annotated");
    if annotated {
        // As a node agent in Kubernetes mode gets them: each Service with the leader's annotation
        // (each Service has one port, 80/TCP: numbers from the range's start, in turn).
        services = annotate(&services, 0);
        extra_svc = annotate(&extra_svc, services.len());
    }
    let mode = if annotated { AllocationMode::Annotated } else { AllocationMode::Allocate };
    let next_only = args.flag("--next-only");
    let with_extra: Vec<Arc<Service>> = services.iter().chain(&extra_svc).cloned().collect();
    let slices_with_extra: Vec<Arc<EndpointSlice>> = slices.iter().chain(&extra_slices).cloned().collect();
    let mut previous = BTreeMap::new();
    let mut last: Option<desired::Desired> = None;
    let (mut desired_ms, mut diff_ms, mut drop_ms, mut sizes) = (vec![], vec![], vec![], vec![]);
    let mut kept = desired::Kept::default();
    let (mut applied, mut index): (Option<Ruleset>, CounterIndex) = (None, CounterIndex::default());
    let (mut next_ms, mut patch_ms, mut patch_sizes) = (vec![], vec![], vec![]);
    for k in 0..=changes {
        let (svcs, slcs) = if k % 2 == 1 { (&with_extra, &slices_with_extra) } else { (&services, &slices) };
        let inputs = Inputs {
            mode,
            services: svcs.as_slice(),
            slices: slcs.as_slice(),
            notes: &notes,
            previous: &previous,
            since: &BTreeMap::new(),
            range: &range,
            model: &model,
            node: &node,
            policy: &policy,
            host: &host,
            pools: None,
            registry: None,
        };
        // Planned whole (`--next-only`: not at all, for a profile of the sync loop's way alone).
        if next_only {
            let (next, _) = desired::compute(&inputs, true, &mut kept, applied.as_ref());
            match next.ruleset {
                Planned::Full(rs) => applied = Some(rs),
                Planned::Patch(patch) => patch.apply(applied.as_mut().expect("a ruleset to patch")),
            }
            previous = next.allocations;
            continue;
        }
        let t = Instant::now();
        let d = desired::compute_whole(&inputs, true);
        let t_desired = t.elapsed();
        if let Some(old) = last.take() {
            let t = Instant::now();
            let batch = plan::diff(&old.ruleset, &d.ruleset);
            let t_diff = t.elapsed();
            let t = Instant::now();
            drop(old);
            drop_ms.push(t.elapsed().as_secs_f64() * 1e3);
            desired_ms.push(t_desired.as_secs_f64() * 1e3);
            diff_ms.push(t_diff.as_secs_f64() * 1e3);
            sizes.push(batch.len() as f64);
        }
        if k == 0 {
            let served = d.services.iter().filter(|s| s.ports.iter().any(|p| p.node_port.is_some())).count();
            assert_eq!(served, n, "every Service allocated: {:?}", d.services.first());
            assert!(
                d.refused_ports.is_empty() && d.refused_endpoints.is_empty(),
                "{:?}",
                d.refused_ports.first()
            );
            assert_eq!(
                d.ruleset.chains.len(),
                n + plan::skeleton(&node).chains.len(),
                "a service chain per Service"
            );
        }
        // As the sync loop does it.
        let t = Instant::now();
        let (next, _) = desired::compute(&inputs, true, &mut kept, applied.as_ref());
        let t_next = t.elapsed();
        let t = Instant::now();
        let batch = match next.ruleset {
            Planned::Full(rs) => {
                assert_eq!(k, 0, "only the first plan is whole");
                applied = Some(rs);
                vec![]
            }
            Planned::Patch(patch) => {
                let batch = plan::diff(&patch.old, &patch.new);
                if let Some(rs) = applied.as_mut() {
                    patch.apply(rs);
                }
                batch
            }
        };
        next.counter_index.apply(&mut index);
        let t_patch = t.elapsed();
        assert_eq!(applied.as_ref(), Some(&d.ruleset), "the patched ruleset is the whole plan");
        assert_eq!(index, d.counter_index, "the patched index is the whole index");
        if k > 0 {
            next_ms.push(t_next.as_secs_f64() * 1e3);
            patch_ms.push(t_patch.as_secs_f64() * 1e3);
            patch_sizes.push(batch.len() as f64);
        }
        previous = d.allocations.clone();
        last = Some(d);
    }
    println!(
        "{n} Services × {endpoints} endpoints, one Service added or removed, {changes} changes; median ms:"
    );
    println!("planned whole (before the incremental planner):");
    println!("  desired (model, allocation, plan, status, counter index)  {:8.1}", median(desired_ms));
    println!("  diff against the last ruleset                             {:8.1}", median(diff_ms));
    println!("  drop the last desired state                               {:8.1}", median(drop_ms));
    println!("  changes per batch                                         {:8.0}", median(sizes));
    println!("incremental (the sync loop):");
    println!("  desired (model, allocation, status, the planner's patch)  {:8.1}", median(next_ms));
    println!("  batch of the patch, patch and index applied               {:8.1}", median(patch_ms));
    println!("  changes per batch                                         {:8.0}", median(patch_sizes));
}

/// `services` (one port each, 80/TCP) with the leader's allocation annotation: node ports 1024
/// + `first`, 1025 + `first`, …
fn annotate(services: &[Arc<Service>], first: usize) -> Vec<Arc<Service>> {
    (services.iter().enumerate())
        .map(|(i, svc)| {
            let mut svc = Service::clone(svc);
            let value = format!("80/TCP={}", 1024 + first + i);
            let annotations = svc.metadata.annotations.get_or_insert_default();
            annotations.insert(nodelb::core::inputs::model::ANNOTATION_ALLOCATED.into(), value);
            Arc::new(svc)
        })
        .collect()
}

/// A Node with an InternalIP and its Lease, as a serving node's agent keeps it.
fn node_and_lease(i: usize) -> (Arc<Node>, Arc<Lease>) {
    let node = serde_json::json!({
        "apiVersion": "v1", "kind": "Node", "metadata": {"name": format!("node-{i}")},
        "status": {"addresses": [{"type": "InternalIP", "address": format!("192.0.2.{i}")}]}
    });
    let lease = serde_json::json!({
        "apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
        "metadata": {"name": format!("nodelb-node-node-{i}"), "namespace": "nodelb-system",
                     "annotations": {"nodelb.io/families": "ipv4", "nodelb.io/listening-ports": ""}},
        "spec": {"holderIdentity": format!("node-{i}"), "leaseDurationSeconds": 15,
                 "renewTime": "2027-01-15T08:00:00.000000Z"}
    });
    (
        Arc::new(serde_json::from_value(node).expect("node")),
        Arc::new(serde_json::from_value(lease).expect("lease")),
    )
}

/// `services` after `writes`, as the API server would store them (annotation, status, a new
/// resourceVersion).
fn written(services: &[Arc<Service>], writes: &[ServiceWrite]) -> Vec<Arc<Service>> {
    let by_key: BTreeMap<&ServiceKey, &ServiceWrite> = writes.iter().map(|w| (&w.key, w)).collect();
    services
        .iter()
        .map(|svc| {
            let Some(w) = by_key.get(&nodelb::core::inputs::model::service_key(svc)) else {
                return svc.clone();
            };
            let mut svc = Service::clone(svc);
            if let Some(a) = &w.annotation {
                let ann = svc.metadata.annotations.get_or_insert_default();
                match a {
                    Some(v) => {
                        ann.insert(nodelb::core::inputs::model::ANNOTATION_ALLOCATED.into(), v.clone())
                    }
                    None => ann.remove(nodelb::core::inputs::model::ANNOTATION_ALLOCATED),
                };
            }
            if let Some(st) = &w.status {
                let status = svc.status.get_or_insert_default();
                status.load_balancer.get_or_insert_default().ingress = Some(st.ingress.clone());
                status.conditions = Some(st.conditions.clone());
            }
            let rv = svc.metadata.resource_version.as_deref().unwrap_or("1").parse::<u64>().unwrap_or(1);
            svc.metadata.resource_version = Some((rv + 1).to_string());
            Arc::new(svc)
        })
        .collect()
}

/// `n` Services × `endpoints` with their slices, in key order or (`hash`) a reflector's order.
fn cluster(n: usize, endpoints: usize, hash: bool) -> (Vec<Arc<Service>>, Vec<Arc<EndpointSlice>>) {
    let text: String = (0..n).map(|i| service(i, endpoints).render()).collect();
    let (mut services, mut slices) = objects(&text);
    if hash {
        hash_order(&mut services, 1);
        hash_order(&mut slices, 2);
    }
    (services, slices)
}

/// `v` in a fixed pseudo-random order: the order of a reflector's store (a hash map), which is
/// what the agent's Kubernetes source hands over, where a manifest file gives key order.
fn hash_order<T>(v: &mut [T], seed: u64) {
    let mut x: u64 = 0x9e37_79b9_7f4a_7c15 ^ seed;
    for i in (1..v.len()).rev() {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        v.swap(i, (x % (i as u64 + 1)) as usize);
    }
}

fn leader(args: &ProgramArgs) {
    let n = args.number("--services", 10_000);
    let (endpoints, changes) = (args.number("--endpoints", 5), args.number("--changes", 20));
    let (mut services, slices) = cluster(n, endpoints, args.flag("--hash-order"));
    let (extra_svc, extra_slices) = objects(&service(n, endpoints).render());
    let (nodes, leases): (Vec<_>, Vec<_>) = (1..=2).map(node_and_lease).unzip();
    let cfg = ControllerConfig {
        identity: "controller-1".into(),
        namespace: "nodelb-system".into(),
        lease_duration: std::time::Duration::from_secs(15),
        node_addresses: vec![],
        port_range: PortRange::new(1024, 64999).expect("range"),
        model: ModelOptions::default(),
        policy: HostPolicy::default(),
    };
    let now = Timestamp::from_second(1_800_000_000).expect("time");
    let token = Token::new("bench", 1, 0);
    // One leader: the agent's own round between the registry read and the writes
    // (`LeaderState::begin_round`: the holders kept per object and the view recorded, the claims
    // nobody resolved, the plan), the Events to record (each recorded, as when the API accepts
    // them), and its end with every write through. `whole`: the next round is made whole first.
    struct Leader {
        state: LeaderState,
        deduper: Deduper<ServiceKey>,
        outbox: Outbox<ServiceKey, ServiceEvent>,
    }
    let round = |leader: &mut Leader,
                 services: &[Arc<Service>],
                 slices: &[Arc<EndpointSlice>],
                 registry: &Registry,
                 whole: bool| {
        let snap = KubeSnapshot {
            services: services.to_vec(),
            slices: slices.to_vec(),
            nodes: nodes.clone(),
            leases: leases.clone(),
            pools: Vec::new(),
            namespaces: Vec::new(),
            ..Default::default()
        };
        if whole {
            leader.state.next_round_whole();
        }
        let t = Instant::now();
        let clock = RoundClock { leases_now: Some(now), now, at: std::time::Instant::now() };
        let plan = leader.state.begin_round(&snap, &cfg, Some(registry), clock, true).plan;
        let planned = t.elapsed().as_secs_f64() * 1e3;
        let scope = Scope::of(plan.scope.as_ref());
        for e in events_to_send(&mut leader.deduper, &mut leader.outbox, &plan.events, |_| true, scope) {
            let key = event_key(&e);
            leader.outbox.sent(&key);
            leader.deduper.sent(key);
        }
        let events = t.elapsed().as_secs_f64() * 1e3 - planned;
        // Every write went through and left the registry as it is (the Services' claims are
        // there already).
        leader.state.end_round(Some(registry), true, Some(RegistryVersions::of(registry)));
        (plan, t.elapsed().as_secs_f64() * 1e3, [planned, events])
    };
    let new_leader = || {
        let state = LeaderState::new(token.clone());
        Leader { state, deduper: Deduper::default(), outbox: Outbox::default() }
    };
    let (mut whole, mut scoped) = (new_leader(), new_leader());
    // What earlier rounds wrote: every Service annotated, with its status.
    let (first, first_ms, _) = round(&mut whole, &services, &slices, &Registry::default(), true);
    assert_eq!(first.writes.len(), n, "the first round writes every Service");
    round(&mut scoped, &services, &slices, &Registry::default(), true);
    services = written(&services, &first.writes);
    // The registry as the agents leave it: every Service's numbers claimed for it.
    let registry = registry_of(&services, &token);
    for leader in [&mut whole, &mut scoped] {
        let (steady, _, _) = round(leader, &services, &slices, &registry, true);
        assert!(
            steady.writes.is_empty(),
            "a round over written Services writes nothing: {:?}",
            steady.writes.first()
        );
    }
    let with_extra: Vec<Arc<Service>> = services.iter().chain(&extra_svc).cloned().collect();
    let slices_with_extra: Vec<Arc<EndpointSlice>> = slices.iter().chain(&extra_slices).cloned().collect();
    // The two ways alternated, change by change: whole rounds, and rounds scoped to what changed
    // (the agent's, after a clean round).
    // `--scoped-only`: no whole rounds in between (for a profile of the scoped ones).
    let scoped_only = args.flag("--scoped-only");
    let (mut whole_ms, mut scoped_ms, mut planned) = (vec![], vec![], vec![]);
    let mut scoped_phases: [Vec<f64>; 2] = Default::default();
    for k in 1..=changes {
        let (svcs, slcs) = if k % 2 == 1 { (&with_extra, &slices_with_extra) } else { (&services, &slices) };
        if !scoped_only {
            let (plan, t, _) = round(&mut whole, svcs, slcs, &registry, true);
            assert_eq!(plan.writes.len(), k % 2, "only the added Service is written");
            whole_ms.push(t);
        }
        let (plan, t, p) = round(&mut scoped, svcs, slcs, &registry, false);
        for (all, one) in scoped_phases.iter_mut().zip(p) {
            all.push(one);
        }
        assert_eq!(plan.writes.len(), k % 2, "only the added Service is written");
        let scope = plan.scope.as_ref().expect("a round after a clean one, nothing shared changed: scoped");
        planned.push(scope.len() as f64);
        scoped_ms.push(t);
    }
    println!("{n} Services × {endpoints} endpoints, the leader's pure round (plan_round, with the");
    println!("holders' pass, the view recorded, unresolved claims and Events to record); ms:");
    println!("  first round (every Service allocated and written)         {first_ms:8.1}");
    println!("  one Service added or removed, median of {changes:<3}:");
    println!("    whole                                                   {:8.1}", median(whole_ms));
    println!("    scoped to what changed                                  {:8.1}", median(scoped_ms));
    println!("    Services the scoped round planned (median)              {:8.0}", median(planned));
    let [plan, events] = scoped_phases.map(median);
    println!("    scoped, by phase: the round begun (holders' pass, view recorded, unresolved claims,");
    println!("      plan_round) {plan:.1}, Events {events:.1}");
}

/// The node-port registry as a leader leaves it over `services`: the blocks `claims::plan` writes
/// from an empty one (a settled claim for every number held), each as stored.
fn registry_of(services: &[Arc<Service>], token: &Token) -> Registry {
    let holders: Vec<Holder> = services.iter().map(|s| Holder::of(s)).collect();
    let (gone, expired) = (Default::default(), Default::default());
    let plan = claims::plan(
        &Registry::default(),
        &HeldNumbers::of(&holders),
        &[],
        token,
        &gone,
        None,
        claims::ClaimScope::All { expired: &expired },
    );
    let stored = |mut block: Block| {
        block.resource_version = Some("1".into());
        block
    };
    Registry { blocks: plan.blocks.into_iter().map(|(b, block)| (b, stored(block))).collect() }
}

/// The agent's allocator (src/main.rs), so the pure work is timed as the agent does it.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// `--manifests`: the phases of a manifests-mode sync (see the module's documentation).
fn manifests_phases(args: &ProgramArgs) {
    use nodelb::observe::source::{Loaded, ManifestPools, Source};
    use nodelb::observe::state::{State, StateFile};
    let n = args.number("--services", 10_000);
    let (endpoints, changes) = (args.number("--endpoints", 5), args.number("--changes", 20));
    let dir = tempfile::tempdir().expect("tempdir");
    let manifests = dir.path().join("manifests");
    std::fs::create_dir(&manifests).expect("mkdir");
    let mut text = String::new();
    for i in 0..n {
        text.push_str(&service(i, endpoints).render());
        if (i + 1) % 500 == 0 || i + 1 == n {
            std::fs::write(manifests.join(format!("svc-{:05}.yaml", i / 500)), std::mem::take(&mut text))
                .expect("write");
        }
    }
    let range = PortRange::new(1024, 64999).expect("range");
    let model = ModelOptions::default();
    let node = NodeFacts {
        node_name: "node-1".into(),
        families: BTreeSet::from([Family::Ipv4]),
        masquerade_mark: plan::DEFAULT_MASQUERADE_MARK,
        connection_mark: plan::DEFAULT_CONNECTION_MARK,
        forward_mark: None,
        nat_shards: plan::auto_nat_shards(n, 1),
    };
    let policy = HostPolicy {
        ports: nodelb::core::decisions::port_policy::PortPolicy::with_range(range),
        ..Default::default()
    };
    let host = HostFacts::default();
    let pools = ManifestPools { node_labels: Default::default(), port_range: range };
    // The source watches the directory (inotify, through Tokio).
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("runtime");
    let _runtime = runtime.enter();
    let mut source = Source::manifests(manifests.clone(), pools).expect("source");
    let mut state_file = StateFile::new(dir.path().join("state.json"));
    let mut state = State::default();
    let mut kept = desired::Kept::default();
    let mut applied: Option<Ruleset> = None;
    let (mut load_ms, mut desired_ms, mut state_ms) = (vec![], vec![], vec![]);
    let mut first_load_ms = 0.0;
    for k in 0..=changes {
        match k % 2 {
            1 => std::fs::write(manifests.join("react.yaml"), service(n, endpoints).render()).expect("write"),
            _ if k > 0 => std::fs::remove_file(manifests.join("react.yaml")).expect("remove"),
            _ => {}
        }
        let t = Instant::now();
        let Ok(Loaded::Snapshot(snap)) = source.snapshot(&model, None, false) else { panic!("no snapshot") };
        let t_load = t.elapsed();
        if k == 0 {
            first_load_ms = t_load.as_secs_f64() * 1e3;
        }
        let t = Instant::now();
        let inputs = Inputs {
            mode: AllocationMode::Allocate,
            services: &snap.services,
            slices: &snap.slices,
            notes: &snap.notes,
            previous: &state.allocations,
            since: &state.since,
            range: &range,
            model: &model,
            node: &node,
            policy: &policy,
            host: &host,
            pools: snap.pools.as_deref(),
            registry: None,
        };
        let (next, _) = desired::compute(&inputs, true, &mut kept, applied.as_ref());
        match next.ruleset {
            Planned::Full(rs) => applied = Some(rs),
            Planned::Patch(patch) => patch.apply(applied.as_mut().expect("a ruleset to patch")),
        }
        let t_desired = t.elapsed();
        let t = Instant::now();
        if next.allocations != state.allocations {
            state = state.stamp(next.allocations, Timestamp::now());
            state_file.save(&state).expect("save");
        }
        let t_state = t.elapsed();
        if k > 1 {
            load_ms.push(t_load.as_secs_f64() * 1e3);
            desired_ms.push(t_desired.as_secs_f64() * 1e3);
            state_ms.push(t_state.as_secs_f64() * 1e3);
        }
    }
    println!(
        "{n} Services × {endpoints} endpoints in manifests, one file written or removed, {changes} changes; median ms:"
    );
    println!("  first load (every file read and parsed)                   {first_load_ms:8.1}");
    println!("  load (the directory's snapshot)                           {:8.1}", median(load_ms));
    println!("  desired (compute)                                         {:8.1}", median(desired_ms));
    println!("  state (stamp, state file written)                         {:8.1}", median(state_ms));
}
