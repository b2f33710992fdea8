//! The incremental planner (`replan`) against the full one (`plan::plan_with`), table-driven and
//! over random sequences of changes: the patch applied to the last ruleset is the full plan, its
//! diff is the full diff, its counter index update gives the full index, and the UDP backends it
//! drops are those the full rulesets drop. Pure (no root).

mod common;

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use nodelb::core::decisions::desired::Desired;
use nodelb::core::domain::{Family, PortId, Protocol, ServiceKey};
use nodelb::core::incremental::replan::{self, PlanInput, Planned, Planner};
use nodelb::core::inputs::model::{LbService, TrafficPolicy};
use nodelb::core::reports::counters::CounterIndex;
use nodelb::core::ruleset::ir::Ruleset;
use nodelb::core::ruleset::plan::{self, NodeFacts, ServicePlan};
use nodelb_oracles::simulate::simulate;

use common::rng::Rng;
use common::scenarios::*;

fn inputs(
    services: &[(LbService, BTreeMap<PortId, u16>)],
    addresses: &BTreeMap<ServiceKey, BTreeSet<std::net::IpAddr>>,
) -> Vec<PlanInput> {
    let mut out: Vec<PlanInput> = services
        .iter()
        .map(|(s, p)| PlanInput {
            service: Arc::new(s.clone()),
            node_ports: p.clone(),
            addresses: addresses.get(&s.key).cloned(),
        })
        .collect();
    out.sort_by(|a, b| a.service.key.cmp(&b.service.key));
    out
}

/// The full planner's ruleset for `inputs`.
fn full_plan(inputs: &[PlanInput], node: &NodeFacts) -> Ruleset {
    let plans: Vec<ServicePlan<'_>> =
        inputs.iter().map(|i| ServicePlan { service: &i.service, node_ports: &i.node_ports }).collect();
    let addresses =
        inputs.iter().filter_map(|i| Some((i.service.key.clone(), i.addresses.clone()?))).collect();
    plan::plan_with(&plans, node, &addresses)
}

/// The counter index of a full ruleset, as the agent computed it before the planner kept one:
/// every counter the whole ruleset has under a Service port's names, and every Service port.
fn index_of(inputs: &[PlanInput], rs: &Ruleset, node: &NodeFacts) -> CounterIndex {
    let mut index = CounterIndex::default();
    for input in inputs {
        replan::index_entries(&input.service, &input.node_ports, &rs.counters, node, &mut index);
    }
    index
}

/// One step of the planner from `applied` (its last plan) to `next`, checked against the full
/// planner; returns the new applied ruleset and index. `changes`: the planner is given only
/// these Services' inputs ([`Planner::plan_changes`]), not every one.
fn step(
    planner: &mut Planner,
    applied: &Ruleset,
    index: &CounterIndex,
    next: &[PlanInput],
    changes: Option<Vec<(ServiceKey, Option<PlanInput>)>>,
    node: &NodeFacts,
    what: &str,
) -> (Ruleset, CounterIndex, bool) {
    let want = full_plan(next, node);
    let want_index = index_of(next, &want, node);
    let (planned, update) = match changes {
        None => planner.plan(next.to_vec(), node, Some(applied), true),
        Some(changes) => planner.plan_changes(changes, node, Some(applied), true),
    };
    let mut got_index = index.clone();
    update.apply(&mut got_index);
    assert_eq!(got_index, want_index, "{what}: counter index");
    let patched = match planned {
        Planned::Full(rs) => {
            assert_eq!(rs, want, "{what}: full plan");
            return (rs, got_index, false);
        }
        Planned::Patch(patch) => {
            let batch = plan::diff(&patch.old, &patch.new);
            assert_eq!(batch, plan::diff(applied, &want), "{what}: batch");
            let gone = |a: &Ruleset, b: &Ruleset| -> BTreeSet<_> {
                plan::udp_backends(a).difference(&plan::udp_backends(b)).copied().collect()
            };
            assert_eq!(gone(&patch.old, &patch.new), gone(applied, &want), "{what}: stale UDP backends");
            let through_kernel = simulate(applied, &batch).unwrap_or_else(|e| panic!("{what}: {e}"));
            assert_eq!(through_kernel, want, "{what}: batch through the kernel model");
            let mut rs = applied.clone();
            patch.apply(&mut rs);
            rs
        }
    };
    assert_eq!(patched, want, "{what}: patched ruleset");
    (patched, got_index, true)
}

#[test]
fn every_scenario_to_every_other_patches_to_the_full_plan() {
    let all = scenarios();
    let mut patched = 0;
    for a in &all {
        for b in &all {
            let what = format!("{} → {}", a.name, b.name);
            let mut planner = Planner::new();
            let from = inputs(&a.services, &a.addresses);
            let (rs, index) = planner.full(from.clone(), &a.node, true);
            assert_eq!(rs, plan_of(a), "{what}: full plan of {}", a.name);
            assert_eq!(index, index_of(&from, &rs, &a.node), "{what}: index of {}", a.name);
            let to = inputs(&b.services, &b.addresses);
            let (rs, index, was_patch) = step(&mut planner, &rs, &index, &to, None, &b.node, &what);
            assert_eq!(was_patch, a.node == b.node, "{what}: a patch exactly when the node is the same");
            patched += usize::from(was_patch);
            // Nothing changed: an empty patch.
            let (planned, update) = planner.plan(to.clone(), &b.node, Some(&rs), true);
            match planned {
                Planned::Patch(p) => assert!(p.is_empty() && p.old.chains.is_empty(), "{what} again: {p:?}"),
                Planned::Full(_) => panic!("{what} again: full plan"),
            }
            let mut again = index.clone();
            update.apply(&mut again);
            assert_eq!(again, index, "{what} again: index");
        }
    }
    assert!(patched > 100, "{patched} patches");
}

/// The ruleset handed in is not the one the planner produced last (e.g. the agent forgot the
/// kernel's content): the plan is full, never a patch against the wrong base.
#[test]
fn a_foreign_ruleset_gets_a_full_plan() {
    let all = scenarios();
    let mixed = all.iter().find(|s| s.name == "mixed").unwrap();
    let web = all.iter().find(|s| s.name == "web").unwrap();
    let mut planner = Planner::new();
    let from = inputs(&mixed.services, &mixed.addresses);
    planner.full(from, &mixed.node, true);
    let (planned, _) =
        planner.plan(inputs(&web.services, &web.addresses), &web.node, Some(&plan_of(web)), true);
    assert!(matches!(planned, Planned::Full(ref rs) if *rs == plan_of(web)), "{planned:?}");
    let (planned, _) = planner.plan(inputs(&web.services, &web.addresses), &web.node, None, true);
    assert!(matches!(planned, Planned::Full(_)));
}

/// Variants of one Service for the random walk: what a user edits.
fn variant(base: &LbService, which: u64, rng: &mut Rng) -> LbService {
    let mut s = base.clone();
    match which {
        0 => {}
        1 => {
            for p in &mut s.ports {
                p.endpoints.pop();
            }
        }
        2 => s.traffic_policy = TrafficPolicy::Local,
        3 => s.session_affinity = Some(300 + 300 * rng.below(2) as u32),
        4 => s.source_ranges = vec!["203.0.113.0/26".parse().unwrap()],
        5 => {
            s.families = vec![Family::Ipv6, Family::Ipv4];
            for p in &mut s.ports {
                p.endpoints.push(ep("2001:db8:2::12", 8080, NODE, true));
            }
        }
        6 => {
            for p in &mut s.ports {
                p.endpoints.push(ep("198.51.100.14", 8080, "node-3", rng.chance(0.5)));
            }
        }
        _ => {
            for p in &mut s.ports {
                for e in &mut p.endpoints {
                    e.ready = !e.ready;
                }
            }
        }
    }
    s
}

/// Random walks over many Services built from the scenarios' ones (copies under other names
/// share endpoints, so shared set elements come and go), each step changing, adding or removing
/// a few, now and then a node port taken twice (a clash: planned whole) or other node facts.
#[test]
fn random_walks_patch_to_the_full_plan() {
    let bases: Vec<LbService> = {
        let mut seen = BTreeSet::new();
        scenarios()
            .into_iter()
            .flat_map(|s| s.services.into_iter().map(|(svc, _)| svc))
            .filter(|s| seen.insert(s.key.clone()))
            .collect()
    };
    let second: std::net::IpAddr = SECOND_V4.parse().unwrap();
    for seed in [1u64, 2, 3, 4] {
        let mut rng = Rng::new(seed);
        let mut node = node(&[Family::Ipv4, Family::Ipv6]);
        // Seeds 3 and 4 with the nat chains sharded; seed 4 changes the shard count now and then.
        node.nat_shards = if seed >= 3 { 4 } else { 1 };
        let mut planner = Planner::new();
        let mut current: BTreeMap<ServiceKey, PlanInput> = BTreeMap::new();
        let (mut applied, mut index) = planner.full(vec![], &node, true);
        let (mut patches, mut fulls) = (0, 0);
        for n in 0..300 {
            // Now and then a burst (a redeploy); the keys touched, for the planner given only
            // what changed.
            let edits = if rng.chance(0.05) { rng.range(20, 40) } else { rng.range(1, 3) };
            let mut touched = BTreeSet::new();
            for _ in 0..edits {
                let which = rng.below(bases.len() as u64) as u16;
                let base = &bases[usize::from(which)];
                let copy = rng.below(6);
                let mut s = variant(base, rng.below(8), &mut rng);
                s.key.name = format!("{}-{copy}", s.key.name).into();
                touched.insert(s.key.clone());
                if rng.chance(0.25) {
                    current.remove(&s.key);
                    continue;
                }
                // Node ports from the Service's own block; 1 in 100 takes one another may hold.
                let first =
                    if rng.chance(0.01) { 20000 } else { 20000 + 100 * (1 + copy as u16) + 10 * which };
                let node_ports = s
                    .ports
                    .iter()
                    .enumerate()
                    .filter(|_| !rng.chance(0.05))
                    .map(|(i, p)| (p.id, first + i as u16))
                    .collect();
                let addresses = rng.chance(0.15).then(|| BTreeSet::from([second]));
                current.insert(s.key.clone(), PlanInput { service: Arc::new(s), node_ports, addresses });
            }
            if rng.chance(0.03) {
                node.families = if node.families.len() == 2 {
                    [Family::Ipv4].into()
                } else {
                    [Family::Ipv4, Family::Ipv6].into()
                };
            }
            if seed == 4 && rng.chance(0.02) {
                node.nat_shards = if node.nat_shards == 4 { 8 } else { 4 };
            }
            let next: Vec<PlanInput> = current.values().cloned().collect();
            let what = format!("seed {seed} step {n}");
            let changes = rng
                .chance(0.5)
                .then(|| touched.into_iter().map(|k| (k.clone(), current.get(&k).cloned())).collect());
            let was_patch;
            (applied, index, was_patch) = step(&mut planner, &applied, &index, &next, changes, &node, &what);
            if was_patch { patches += 1 } else { fulls += 1 }
        }
        eprintln!("seed {seed}: {patches} patches, {fulls} full plans");
        assert!(patches > 200 && fulls > 0, "seed {seed}: {patches} patches, {fulls} full plans");
    }
}

/// A UDP Service and a TCP one on the same node port and protocol pair never exist, but two
/// Services on one node port (a stale allocation) do, briefly: the plan is then the full plan's
/// (the later Service wins the dispatch element), and patches resume once the clash is gone.
#[test]
fn a_clash_is_planned_whole_until_it_is_gone() {
    let node = node(&[Family::Ipv4]);
    let a = svc("a", vec![(53, Protocol::Udp, two_backends())]);
    let b = svc("b", vec![(53, Protocol::Udp, vec![ep("198.51.100.20", 53, NODE, true)])]);
    let one = |s: &LbService, p: u16| PlanInput {
        service: Arc::new(s.clone()),
        node_ports: ports(s, p),
        addresses: None,
    };
    let mut planner = Planner::new();
    let (rs, index) = planner.full(vec![one(&a, 20001)], &node, true);
    let (rs, index, patch) =
        step(&mut planner, &rs, &index, &[one(&a, 20001), one(&b, 20001)], None, &node, "clash");
    assert!(!patch, "a clash is planned whole");
    let (rs, index, patch) =
        step(&mut planner, &rs, &index, &[one(&a, 20001), one(&b, 20002)], None, &node, "resolved");
    assert!(!patch, "the plan after a clash is full");
    let (_, _, patch) = step(&mut planner, &rs, &index, &[one(&a, 20001)], None, &node, "after");
    assert!(patch, "then patches again");
}

/// Everything a sync decides but the ruleset and its counter index (as text: the two sides are
/// of different types).
fn rest<R, I>(d: &Desired<R, I>) -> String {
    let fields = (
        &d.allocations,
        &d.services,
        &d.needed_families,
        &d.refusals,
        &d.alloc_problems,
        &d.refused_endpoints,
        &d.refused_ports,
        &d.warnings,
    );
    format!("{fields:#?}")
}

/// One sync both ways: `compute_whole` from scratch, and `compute` with what the sync loop
/// keeps; everything but the ruleset must be the same, and the patch applied to the last
/// ruleset (`applied`, `index`: as the kernel holds them) the whole ruleset. Returns the whole
/// result, how `compute` decided, and whether it patched.
fn both_ways(
    inputs: &nodelb::core::decisions::desired::Inputs<
        '_,
        Arc<k8s_openapi::api::core::v1::Service>,
        Arc<nodelb::core::inputs::compact::EndpointSlice>,
    >,
    kept: &mut nodelb::core::decisions::desired::Kept,
    applied: &mut Option<Ruleset>,
    index: &mut CounterIndex,
    what: &str,
) -> (Desired, nodelb::core::decisions::desired::Extent, bool) {
    let whole = nodelb::core::decisions::desired::compute_whole(inputs, true);
    let (next, scope) = nodelb::core::decisions::desired::compute(inputs, true, kept, applied.as_ref());
    assert_eq!(rest(&next), rest(&whole), "{what} ({scope:?}): everything but the ruleset");
    let patched = match next.ruleset {
        Planned::Full(rs) => {
            *applied = Some(rs);
            false
        }
        Planned::Patch(p) => {
            p.apply(applied.as_mut().expect("a patch of the last ruleset"));
            true
        }
    };
    next.counter_index.apply(index);
    assert_eq!(applied.as_ref(), Some(&whole.ruleset), "{what} ({scope:?}): ruleset");
    assert_eq!(*index, whole.counter_index, "{what} ({scope:?}): counter index");
    (whole, scope, patched)
}

/// `v` in another order, as a reflector's hash map hands its objects over.
fn shuffle<T>(rng: &mut Rng, v: &mut [T]) {
    for i in (1..v.len()).rev() {
        v.swap(i, rng.below(i as u64 + 1) as usize);
    }
}

/// Random sequences of snapshots as the sources hand them over (each object an `Arc`, the same
/// `Arc` while it is unchanged): `desired::compute` with what it keeps between syncs (the
/// model cache, the planner) gives what `desired::compute_whole` gives from scratch, field by
/// field, its patch applied to the last ruleset the whole ruleset and its index patch the whole
/// index. Objects are replaced by edited ones, by equal copies (a new `Arc`), dropped and
/// duplicated, and handed over in another order; node addresses (an endpoint that becomes a
/// node's address is refused) and allocation ages change underneath.
#[test]
fn incremental_compute_gives_what_whole_compute_gives() {
    use common::manifest::{EndpointSpec, PortSpec, ServiceSpec};
    use k8s_openapi::api::core::v1::Service;
    use nodelb::core::decisions::desired::{
        AllocationMode, HostFacts, HostPolicy, Inputs, Kept, SourceNotes,
    };
    use nodelb::core::decisions::port_policy::{PortPolicy, PortRange};
    use nodelb::core::inputs::compact::EndpointSlice;
    use nodelb::core::inputs::model::ModelOptions;

    let spec = |i: u64, v: u64| -> ServiceSpec {
        // Some ask for one of three node ports: conflicts that the Services' ages decide.
        let asked = (v % 6 == 5).then_some(20090 + (i % 3) as u16);
        let mut s = ServiceSpec::new(&format!("s{i}")).port(PortSpec::tcp(80, asked));
        let eps = (0..1 + (i + v) % 3).map(|e| {
            EndpointSpec::local(std::net::Ipv4Addr::new(198, 51, 100, (10 + (i + e + v) % 20) as u8))
        });
        s = s.endpoints(eps);
        match v % 6 {
            // Two EndpointSlices (one per family).
            0 if v % 12 == 6 => s.dual_stack().endpoint(EndpointSpec::local(std::net::Ipv6Addr::new(
                0x2001,
                0xdb8,
                2,
                0,
                0,
                0,
                0,
                0x10 + i as u16,
            ))),
            1 => s.port(PortSpec::udp(53, None)),
            2 => s.client_ip_affinity(600),
            3 => s.source_range("203.0.113.0/24"),
            4 => s.local_policy(),
            _ => s,
        }
    };
    type Objects = (Vec<Arc<Service>>, Vec<Arc<EndpointSlice>>);
    let parse = |s: &ServiceSpec| -> Objects {
        let m = nodelb::core::inputs::manifests::parse(std::path::Path::new("t.yaml"), "t.yaml", &s.render());
        assert!(m.problems.is_empty(), "{:?}", m.problems);
        (m.services, m.slices)
    };
    let range = PortRange::new(20000, 20099).unwrap();
    let policy = HostPolicy { ports: PortPolicy::with_range(range), ..Default::default() };
    let model = ModelOptions::default();
    let node = node(&[Family::Ipv4, Family::Ipv6]);
    let notes = SourceNotes::default();
    for seed in [7u64, 8, 9] {
        let mut rng = Rng::new(seed);
        // Service number → its objects as the source holds them.
        let mut objects: BTreeMap<u64, Objects> = BTreeMap::new();
        let mut host = HostFacts::default();
        let mut previous = BTreeMap::new();
        let mut since = BTreeMap::new();
        let mut kept = Kept::default();
        let (mut applied, mut index): (Option<Ruleset>, CounterIndex) = (None, CounterIndex::default());
        let mut patches = 0;
        for step in 0..120 {
            for _ in 0..rng.range(1, 4) {
                let i = rng.below(30);
                match rng.below(10) {
                    0 => {
                        objects.remove(&i);
                    }
                    1 => {
                        // The Service goes, its EndpointSlices stay (they belong to nothing).
                        if let Some(o) = objects.get_mut(&i) {
                            o.0.clear();
                        }
                    }
                    2 => {
                        // An equal copy: a new Arc, the same content.
                        if let Some((s, _)) = objects.get_mut(&i)
                            && let Some(first) = s.first().cloned()
                        {
                            *s = vec![Arc::new((*first).clone())];
                        }
                    }
                    3 => {
                        // The same Service twice (the second is refused as a duplicate).
                        if let Some((s, _)) = objects.get_mut(&i)
                            && let Some(first) = s.first().cloned()
                        {
                            s.push(first);
                        }
                    }
                    _ => {
                        let (svcs, slices) = parse(&spec(i, rng.below(12)));
                        // Sometimes only the EndpointSlice is new.
                        match objects.get_mut(&i) {
                            Some(o) if rng.chance(0.3) => o.1 = slices,
                            _ => {
                                objects.insert(i, (svcs, slices));
                            }
                        }
                    }
                }
            }
            if rng.chance(0.05) {
                host = HostFacts::default();
                if rng.chance(0.5) {
                    // An endpoint address becomes a node's: refused from then on.
                    let a = std::net::Ipv4Addr::new(198, 51, 100, 10 + rng.below(20) as u8);
                    host.addresses.add(a.into(), "Node node-2");
                }
            }
            // Allocation ages come and go (the state file's record of when each was allocated).
            if rng.chance(0.3)
                && let Some(k) =
                    previous.keys().nth(rng.below(previous.len().max(1) as u64) as usize).cloned()
            {
                let at = 1_700_000_000 + rng.below(1000) as i64;
                since.insert(k, k8s_openapi::jiff::Timestamp::from_second(at).unwrap());
            }
            let mut services: Vec<Arc<Service>> =
                objects.values().flat_map(|(s, _)| s.iter().cloned()).collect();
            let mut slices: Vec<Arc<EndpointSlice>> =
                objects.values().flat_map(|(_, e)| e.iter().cloned()).collect();
            // Half the time in another order each sync, as a reflector's hash map hands them over.
            if rng.chance(0.5) {
                shuffle(&mut rng, &mut services);
                shuffle(&mut rng, &mut slices);
            }
            let inputs = Inputs {
                mode: AllocationMode::Allocate,
                services: services.as_slice(),
                slices: slices.as_slice(),
                notes: &notes,
                previous: &previous,
                since: &since,
                range: &range,
                model: &model,
                node: &node,
                policy: &policy,
                host: &host,
                pools: None,
                registry: None,
            };
            let what = format!("seed {seed} step {step}");
            let (whole, _, patched) = both_ways(&inputs, &mut kept, &mut applied, &mut index, &what);
            patches += usize::from(patched);
            previous = whole.allocations;
        }
        assert!(patches > 100, "seed {seed}: {patches} patches");
    }
}

/// A patch plans each changed Service twice; when most Services changed (every allocation age
/// stamped after the first round, say) the plan is whole instead, and the same.
#[test]
fn most_services_changed_is_planned_whole() {
    let node = node(&[Family::Ipv4]);
    let services = |changed: usize| -> Vec<PlanInput> {
        (0..200)
            .map(|i| {
                let mut s = svc(&format!("s{i:03}"), vec![(80, Protocol::Tcp, two_backends())]);
                if i < changed {
                    s.traffic_policy = TrafficPolicy::Local;
                }
                PlanInput { node_ports: ports(&s, 20000 + i as u16), service: Arc::new(s), addresses: None }
            })
            .collect()
    };
    let mut planner = Planner::new();
    let (rs, index) = planner.full(services(0), &node, true);
    let (rs, index, patch) = step(&mut planner, &rs, &index, &services(20), None, &node, "20 of 200");
    assert!(patch, "20 of 200 changed: a patch");
    let (_, _, patch) = step(&mut planner, &rs, &index, &services(150), None, &node, "150 of 200");
    assert!(!patch, "130 of 200 changed: planned whole");
}

/// What only the allocator reads (the allocation age, creationTimestamp, the allocation found on
/// the object, the request) plans nothing again: a Service whose age is stamped after the first
/// round is not in the patch.
#[test]
fn what_only_the_allocator_reads_plans_nothing_again() {
    let node = node(&[Family::Ipv4]);
    let web = svc("web", vec![(80, Protocol::Tcp, two_backends())]);
    let input = |s: &LbService| PlanInput {
        service: Arc::new(s.clone()),
        node_ports: ports(s, 20001),
        addresses: None,
    };
    let mut planner = Planner::new();
    let (rs, _) = planner.full(vec![input(&web)], &node, true);
    let mut aged = web.clone();
    aged.allocated_since = Some("2024-01-02T00:00:00Z".parse().unwrap());
    aged.created = Some("2024-01-01T00:00:00Z".parse().unwrap());
    aged.previous_allocation = ports(&web, 20001);
    aged.port_request = nodelb::core::inputs::model::PortRequest::ServicePorts;
    aged.uid = Some("u".into());
    let (planned, _) = planner.plan(vec![input(&aged)], &node, Some(&rs), true);
    assert!(
        matches!(&planned, Planned::Patch(p) if p.old.chains.is_empty() && p.new.chains.is_empty()),
        "{planned:?}"
    );
}

/// Kubernetes mode, where the sync loop decides only a scope: the Services whose objects changed,
/// and whoever shares a node port number with them (docs/design/incremental.md, "The node's sync
/// scoped to what changed"). Random histories of a small cluster as a node's Kubernetes source
/// hands it over: Services created, deleted, re-annotated by the leader or by hand (numbers another
/// Service holds: duplicates settled by age; one number twice in one Service; entries without a
/// protocol, a port listed twice, a bad entry), undecided, refused by the leader (its `Allocated`
/// condition), edited into invalid input, turned into ClusterIP, relabelled (pools, the k3s
/// ServiceLB labels), given Local policy; EndpointSlices added, split in two, dropped, orphaned;
/// last-good notes set and cleared; listeners and node addresses that change; pools in force or
/// not; equal copies (new `Arc`s) and another order every sync. `compute` must give what
/// `compute_whole` gives, field by field, its patch applied to the last ruleset the whole ruleset;
/// and most syncs must be scoped, to a few Services.
#[test]
fn scoped_syncs_decide_what_whole_syncs_decide() {
    scoped_syncs(nodelb::core::decisions::desired::AllocationMode::Annotated);
}

/// Manifests mode, where the node allocates: the same histories, the allocation annotations
/// now numbers found on the objects (what exists wins), some Services asking for numbers
/// (`nodelb.io/ports`: conflicts settled by age), ranges exhausted in the pools, and the state
/// file's ages stamped as the agent stamps them (and changed underneath now and then).
#[test]
fn scoped_syncs_decide_what_whole_syncs_decide_when_the_node_allocates() {
    scoped_syncs(nodelb::core::decisions::desired::AllocationMode::Allocate);
}

fn scoped_syncs(mode: nodelb::core::decisions::desired::AllocationMode) {
    use k8s_openapi::api::core::v1::Service;
    use nodelb::core::decisions::desired::{
        AllocationMode, Extent, HostFacts, HostPolicy, Inputs, Kept, SourceNotes,
    };
    use nodelb::core::decisions::pool::{self, PoolContext, PoolSet};
    use nodelb::core::decisions::port_policy::{PortPolicy, PortRange};
    use nodelb::core::inputs::compact::EndpointSlice;
    use nodelb::core::inputs::model::{
        ANNOTATION_ALLOCATED, ANNOTATION_PORTS, CONDITION_ALLOCATED, ModelOptions,
    };
    use nodelb::core::k8s::claims::{self, Owner, Registry};
    use serde_json::{Value, json};

    const NAMES: u64 = 24;
    let range = PortRange::new(20000, 20099).unwrap();
    let policy = HostPolicy { ports: PortPolicy::with_range(range), ..Default::default() };
    let model = ModelOptions::default();
    let pools_ctx = |servicelb: bool| -> PoolContext {
        let spec = |v: Value| serde_json::from_value(v).expect("pool spec");
        let low = pool::validate(
            "low",
            Some("2024-01-01T00:00:00Z".into()),
            None,
            &spec(json!({"ports": [{"start": 20000, "end": 20007}],
                         "serviceSelector": {"matchLabels": {"tier": "a"}}, "priority": 1})),
        )
        .expect("valid");
        let high = pool::validate(
            "high",
            Some("2024-01-02T00:00:00Z".into()),
            None,
            &spec(json!({"ports": [{"start": 20008, "end": 20015}], "priority": 2})),
        )
        .expect("valid");
        PoolContext {
            set: PoolSet::resolve(vec![low, high], true, range, &[]),
            namespaces: BTreeMap::new(),
            node_labels: [("svccontroller.k3s.cattle.io/lbpool".to_string(), "edge".to_string())].into(),
            servicelb,
        }
    };
    let parse_service = |v: &Value| -> Arc<Service> { Arc::new(serde_json::from_value(v.clone()).unwrap()) };
    let parse_slice =
        |v: &Value| -> Arc<EndpointSlice> { Arc::new(serde_json::from_value(v.clone()).unwrap()) };
    let (mut syncs, mut scoped, mut decided, mut seen) = (0, 0, 0, 0);
    for seed in 0..24u64 {
        let mut rng = Rng::new(1000 + seed);
        let node = node(&[Family::Ipv4, Family::Ipv6]);
        // Service number → its object and its EndpointSlices, as JSON (the source's cache).
        let mut services: BTreeMap<u64, Value> = BTreeMap::new();
        let mut slices: BTreeMap<u64, Vec<Value>> = BTreeMap::new();
        // The objects as shared with the last snapshot (by resourceVersion): unchanged ones are
        // the same `Arc` again, as a reflector's store hands them over.
        type Shared = (Option<Arc<Service>>, Option<Arc<EndpointSlice>>);
        let mut cached: BTreeMap<String, Shared> = BTreeMap::new();
        let mut rv = 0u64;
        let mut next_rv = || {
            rv += 1;
            rv.to_string()
        };
        let mut notes = SourceNotes::default();
        let mut host = HostFacts::default();
        let mut pools: Option<PoolContext> = None;
        let mut previous = BTreeMap::new();
        let mut since: BTreeMap<ServiceKey, k8s_openapi::jiff::Timestamp> = BTreeMap::new();
        let mut kept = Kept::default();
        let (mut applied, mut index): (Option<Ruleset>, CounterIndex) = (None, CounterIndex::default());
        // Kubernetes mode: the node-port registry, mostly naming the Service each annotated
        // number was written on, now and then another or none (a forged annotation, a claim not
        // written yet), its block at a new version at each change.
        let mut registry = Registry::default();
        let claim = |registry: &mut Registry, n: u16, owner: Option<Owner>, rv: String| {
            let block = registry.blocks.entry(claims::block_of(n)).or_default();
            match owner {
                Some(o) => Arc::make_mut(&mut block.claims).insert(n, claims::Claim::held(o).into()),
                None => Arc::make_mut(&mut block.claims).remove(&n),
            };
            block.resource_version = Some(rv);
        };
        for step in 0..150 {
            for _ in 0..rng.range(1, 2) {
                let i = rng.below(NAMES);
                let name = format!("s{i}");
                let ns = if i.is_multiple_of(3) { "team" } else { "default" };
                let number = |rng: &mut Rng| 20000 + rng.below(18) as u16;
                match rng.below(20) {
                    0 | 1 => {
                        services.remove(&i);
                        if rng.chance(0.5) {
                            slices.remove(&i);
                        }
                    }
                    2..=6 => {
                        // A new Service, or a new version: annotated by the leader (often with a
                        // number another Service has), or undecided, or refused by it.
                        let mut ports = vec![json!({"name": "http", "port": 80, "protocol": "TCP"})];
                        let udp = rng.chance(0.3);
                        if udp {
                            ports.push(json!({"name": "dns", "port": 53, "protocol": "UDP"}));
                        }
                        let mut svc = json!({
                            "apiVersion": "v1", "kind": "Service",
                            "metadata": {"name": name, "namespace": ns, "uid": format!("uid-{i}-{step}"),
                                         "resourceVersion": next_rv(),
                                         "creationTimestamp": format!("2024-01-0{}T00:00:00Z", 1 + rng.below(3)),
                                         "annotations": {}, "labels": {}},
                            "spec": {"type": "LoadBalancer", "ports": ports}
                        });
                        match rng.below(10) {
                            0 => {}
                            1 => {
                                svc["status"] = json!({"conditions": [{
                                    "type": CONDITION_ALLOCATED, "status": "False", "reason": "RangeExhausted",
                                    "message": "no free node port", "lastTransitionTime": "2024-01-01T00:00:00Z"}]});
                            }
                            _ => {
                                let mut value = format!("80/TCP={}", number(&mut rng));
                                if udp {
                                    // Now and then the same number for both protocols (allowed).
                                    let n = if rng.chance(0.3) {
                                        value[7..].parse().unwrap()
                                    } else {
                                        number(&mut rng)
                                    };
                                    value += &format!(",53/UDP={n}");
                                }
                                // Edited by hand now and then: an entry without a protocol, the
                                // port listed twice (the model keeps the first), a bad entry.
                                match rng.below(8) {
                                    0 => value = format!("80={}", number(&mut rng)),
                                    1 => value += &format!(",80/TCP={}", number(&mut rng)),
                                    2 => value = format!("80/TCP=x,{value}"),
                                    _ => {}
                                }
                                svc["metadata"]["annotations"][ANNOTATION_ALLOCATED] = json!(value);
                            }
                        }
                        if rng.chance(0.3) {
                            svc["metadata"]["labels"]["tier"] = json!("a");
                        }
                        // A number asked for (only the allocating node reads it): often one
                        // another Service holds, now and then the service port's own.
                        if rng.chance(0.25) {
                            let asked = match rng.below(4) {
                                0 => "80/TCP=service".to_string(),
                                _ => format!("80/TCP={}", number(&mut rng)),
                            };
                            svc["metadata"]["annotations"][ANNOTATION_PORTS] = json!(asked);
                        }
                        if rng.chance(0.15) {
                            svc["metadata"]["labels"]["svccontroller.k3s.cattle.io/lbpool"] = json!("other");
                        }
                        match rng.below(8) {
                            0 => svc["spec"]["externalTrafficPolicy"] = json!("Local"),
                            1 => svc["spec"]["loadBalancerSourceRanges"] = json!(["10.0.0.0/33"]),
                            2 => svc["spec"]["type"] = json!("ClusterIP"),
                            3 => {
                                svc["spec"]["sessionAffinity"] = json!("ClientIP");
                            }
                            _ => {}
                        }
                        // An edit of the Service that exists keeps its uid and creation time
                        // (a version that may read the same or not: every field above is drawn
                        // again).
                        if let Some(before) = services.get(&i)
                            && rng.chance(0.7)
                        {
                            for field in ["uid", "creationTimestamp"] {
                                svc["metadata"][field] = before["metadata"][field].clone();
                            }
                        }
                        // The leader claims what it writes, before it writes it (mostly).
                        let owner = Owner::of_uid(svc["metadata"]["uid"].as_str().unwrap());
                        let written = svc["metadata"]["annotations"][ANNOTATION_ALLOCATED].as_str();
                        for n in nodelb::core::inputs::model::annotated_numbers(written.unwrap_or_default()) {
                            if rng.chance(0.8) {
                                claim(&mut registry, n, Some(owner.clone()), next_rv());
                            }
                        }
                        services.insert(i, svc);
                    }
                    7..=11 => {
                        // Its EndpointSlices: one or two, addresses that may be refused.
                        let addresses = ["198.51.100.1", "198.51.100.2", "198.51.100.3", "127.0.0.1"];
                        let mut list = Vec::new();
                        for part in 0..rng.range(1, 2) {
                            let endpoints: Vec<Value> = (0..rng.range(1, 3))
                                .map(|_| {
                                    json!({"addresses": [*rng.pick(&addresses)],
                                           "conditions": {"ready": rng.chance(0.8)},
                                           "nodeName": format!("node-{}", rng.range(1, 2))})
                                })
                                .collect();
                            list.push(json!({
                                "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
                                "metadata": {"name": format!("{name}-{part}"), "namespace": ns,
                                             "resourceVersion": next_rv(),
                                             "labels": {"kubernetes.io/service-name": name}},
                                "addressType": "IPv4", "endpoints": endpoints,
                                "ports": [{"name": "http", "port": 8080, "protocol": "TCP"},
                                          {"name": "dns", "port": 5353, "protocol": "UDP"}]
                            }));
                        }
                        slices.insert(i, list);
                    }
                    12 => {
                        slices.remove(&i);
                    }
                    13 => {
                        // An equal copy of the object (a relist), or the leader's status write
                        // (its ingress, or an Allocated condition that is not a refusal): a new
                        // `Arc` that reads the same to a node.
                        if let Some(svc) = services.get_mut(&i) {
                            svc["metadata"]["resourceVersion"] = json!(next_rv());
                            let refused = svc["status"]["conditions"][0]["status"] == "False";
                            match rng.below(3) {
                                0 if !refused => {
                                    let ip = format!("192.0.2.{}", rng.range(1, 9));
                                    svc["status"] =
                                        json!({"loadBalancer": {"ingress": [{"ip": ip, "ipMode": "Proxy"}]}});
                                }
                                1 if !refused => {
                                    svc["status"] = json!({"conditions": [{
                                        "type": CONDITION_ALLOCATED, "status": "True", "reason": "Allocated",
                                        "message": "ok", "lastTransitionTime": "2024-01-01T00:00:00Z"}]});
                                }
                                _ => {}
                            }
                        }
                    }
                    16 => {
                        // The registry on its own: a number claimed for another Service, or
                        // released.
                        let owner = match rng.below(3) {
                            0 => None,
                            _ => services
                                .get(&rng.below(NAMES))
                                .map(|v| Owner::of_uid(v["metadata"]["uid"].as_str().unwrap())),
                        };
                        claim(&mut registry, number(&mut rng), owner, next_rv());
                    }
                    14 => {
                        let key = ServiceKey::new(ns, &name);
                        match notes.stale.remove(&key) {
                            Some(_) => {}
                            None => {
                                notes.stale.insert(key, "served from its last valid spec: x".into());
                            }
                        }
                    }
                    15 if rng.chance(0.3) => {
                        // Something every Service reads: a listener, a node address, the pools.
                        match rng.below(3) {
                            0 => {
                                let port = number(&mut rng);
                                let listening = rng.chance(0.5).then_some(
                                    nodelb::core::decisions::port_policy::Listener {
                                        protocol: Protocol::Tcp,
                                        port,
                                        addr: "0.0.0.0".parse().unwrap(),
                                    },
                                );
                                host.listeners =
                                    nodelb::core::decisions::port_policy::Listeners::from_sockets(listening);
                            }
                            1 => {
                                host = HostFacts { listeners: host.listeners.clone(), ..Default::default() };
                                if rng.chance(0.5) {
                                    host.addresses.add("198.51.100.2".parse().unwrap(), "Node node-2");
                                }
                            }
                            _ => {
                                pools = match (&pools, rng.chance(0.5)) {
                                    (Some(_), _) => None,
                                    (None, servicelb) => Some(pools_ctx(servicelb)),
                                }
                            }
                        }
                    }
                    _ => {}
                }
            }
            // The snapshot: unchanged objects the same `Arc`s, in another order now and then.
            let mut fresh = BTreeMap::new();
            let mut svc_objects = Vec::new();
            for v in services.values() {
                let rv = v["metadata"]["resourceVersion"].as_str().unwrap().to_string();
                let o = cached.remove(&rv).and_then(|c| c.0).unwrap_or_else(|| parse_service(v));
                fresh.insert(rv, (Some(o.clone()), None));
                svc_objects.push(o);
            }
            let mut slice_objects = Vec::new();
            for v in slices.values().flatten() {
                let rv = v["metadata"]["resourceVersion"].as_str().unwrap().to_string();
                let o = cached.remove(&rv).and_then(|c| c.1).unwrap_or_else(|| parse_slice(v));
                fresh.insert(rv, (None, Some(o.clone())));
                slice_objects.push(o);
            }
            cached = fresh;
            if rng.chance(0.5) {
                shuffle(&mut rng, &mut svc_objects);
                shuffle(&mut rng, &mut slice_objects);
            }
            let inputs = Inputs {
                mode,
                services: svc_objects.as_slice(),
                slices: slice_objects.as_slice(),
                notes: &notes,
                previous: &previous,
                since: &since,
                range: &range,
                model: &model,
                node: &node,
                policy: &policy,
                host: &host,
                pools: pools.as_ref(),
                registry: (mode == AllocationMode::Annotated).then_some(&registry),
            };
            let what = format!("seed {seed} step {step}");
            let (whole, scope, _) = both_ways(&inputs, &mut kept, &mut applied, &mut index, &what);
            if mode == AllocationMode::Annotated {
                // A number is programmed only for the Service the registry gives it to.
                for s in &svc_objects {
                    let key = nodelb::core::inputs::model::service_key(s);
                    let owner = Owner::of(&key, s.metadata.uid.as_deref());
                    for n in whole.allocations.get(&key).into_iter().flat_map(|p| p.values()) {
                        assert!(registry.holds(*n, &owner), "{what}: {key} programs {n}");
                    }
                }
            }
            syncs += 1;
            if let Extent::Services(n) = scope {
                scoped += 1;
                decided += n;
                seen += svc_objects.len();
            }
            previous = whole.allocations;
            if mode == AllocationMode::Allocate {
                // As the agent keeps the state file: the time of every Service allocated,
                // kept while it is; and now and then one changed underneath.
                let now = k8s_openapi::jiff::Timestamp::from_second(1_700_000_000 + step as i64).unwrap();
                since = previous.keys().map(|k| (k.clone(), since.get(k).copied().unwrap_or(now))).collect();
                if rng.chance(0.1)
                    && let Some(k) = since.keys().nth(rng.below(since.len().max(1) as u64) as usize).cloned()
                {
                    since.insert(k, k8s_openapi::jiff::Timestamp::from_second(1_600_000_000).unwrap());
                }
            }
        }
    }
    println!(
        "{mode:?}: {syncs} syncs, {scoped} scoped; the scoped ones decided {decided} Services of {seen} in their views"
    );
    assert!(scoped * 3 > syncs * 2, "only {scoped} of {syncs} syncs were scoped");
    // The allocating node decides every unsettled Service at every sync: with the pools' eight
    // numbers each, about half of these small views are exhausted (the sparse case is
    // `a_manifests_change_decides_only_its_service`).
    let most = match mode {
        AllocationMode::Annotated => seen / 3,
        AllocationMode::Allocate => seen * 4 / 5,
    };
    assert!(decided < most, "the scoped syncs decided {decided} Services of {seen}");
}

/// Manifests mode among 200 settled Services: a new Service, a removed one, an edited one, one
/// whose allocation age changed under it are each decided alone (with whoever named a number it
/// names), every object parsed again to the same content is no change, and the results are the
/// whole decision's.
#[test]
fn a_manifests_change_decides_only_its_service() {
    use common::manifest::{EndpointSpec, PortSpec, ServiceSpec};
    use nodelb::core::decisions::desired::{
        AllocationMode, Extent, HostFacts, HostPolicy, Inputs, Kept, SourceNotes,
    };
    use nodelb::core::decisions::port_policy::{PortPolicy, PortRange};
    use nodelb::core::inputs::model::ModelOptions;

    let objects = |i: u16, asked: Option<u16>| {
        let s = ServiceSpec::new(&format!("s{i:03}"))
            .port(PortSpec::tcp(80, asked))
            .endpoint(EndpointSpec::local(std::net::Ipv4Addr::new(198, 51, 100, 1 + (i % 200) as u8)));
        let m = nodelb::core::inputs::manifests::parse(std::path::Path::new("t.yaml"), "t.yaml", &s.render());
        assert!(m.problems.is_empty(), "{:?}", m.problems);
        (m.services, m.slices)
    };
    let range = PortRange::new(20000, 29999).unwrap();
    let policy = HostPolicy { ports: PortPolicy::with_range(range), ..Default::default() };
    let (model, notes, host) = (ModelOptions::default(), SourceNotes::default(), HostFacts::default());
    let node = node(&[Family::Ipv4]);
    let mut all: BTreeMap<u16, _> = (0..200).map(|i| (i, objects(i, None))).collect();
    let mut previous = BTreeMap::new();
    let mut kept = Kept::default();
    let (mut applied, mut index): (Option<Ruleset>, CounterIndex) = (None, CounterIndex::default());
    let mut sync = |all: &BTreeMap<u16, _>, previous: &mut _, since: &mut BTreeMap<_, _>, what: &str| {
        let services: Vec<_> = all.values().flat_map(|(s, _): &(Vec<_>, Vec<_>)| s.iter().cloned()).collect();
        let slices: Vec<_> = all.values().flat_map(|(_, e): &(Vec<_>, Vec<_>)| e.iter().cloned()).collect();
        let inputs = Inputs {
            mode: AllocationMode::Allocate,
            services: &services,
            slices: &slices,
            notes: &notes,
            previous,
            since,
            range: &range,
            model: &model,
            node: &node,
            policy: &policy,
            host: &host,
            pools: None,
            registry: None,
        };
        let (whole, scope, _) = both_ways(&inputs, &mut kept, &mut applied, &mut index, what);
        let now = k8s_openapi::jiff::Timestamp::from_second(1_700_000_000).unwrap();
        *since =
            whole.allocations.keys().map(|k| (k.clone(), since.get(k).copied().unwrap_or(now))).collect();
        *previous = whole.allocations;
        scope
    };
    // The start decides with the ages it then stamps (the agent's `provisional_ages`): every
    // allocation is new (moved), and with no pool object that is no reason to decide it again.
    let start = k8s_openapi::jiff::Timestamp::from_second(1_700_000_000).unwrap();
    let mut since: BTreeMap<ServiceKey, _> = all
        .values()
        .flat_map(|(s, _)| s.iter())
        .map(|s| (nodelb::core::inputs::model::service_key(s), start))
        .collect();
    assert_eq!(sync(&all, &mut previous, &mut since, "first"), Extent::Whole);
    assert_eq!(sync(&all, &mut previous, &mut since, "after the start"), Extent::Services(0));
    all.insert(200, objects(200, None));
    assert_eq!(sync(&all, &mut previous, &mut since, "added"), Extent::Services(1));
    // Its allocation (new last sync) and its age (stamped since) are read again, alone.
    assert_eq!(sync(&all, &mut previous, &mut since, "after the add"), Extent::Services(1));
    assert_eq!(sync(&all, &mut previous, &mut since, "quiet"), Extent::Services(0));
    all.remove(&7);
    assert_eq!(sync(&all, &mut previous, &mut since, "removed"), Extent::Services(1));
    sync(&all, &mut previous, &mut since, "after the removal");
    // s008 asks for the number s009 holds: s009 keeps it (what exists wins, so a request does
    // not bring the holder in), s008 is refused and, unsettled, decided at every sync from then
    // on.
    let held = previous[&ServiceKey::new("default", "s009")][&PortId { port: 80, protocol: Protocol::Tcp }];
    all.insert(8, objects(8, Some(held)));
    assert_eq!(sync(&all, &mut previous, &mut since, "asks for a held number"), Extent::Services(1));
    assert!(!previous.contains_key(&ServiceKey::new("default", "s008")), "refused");
    assert_eq!(sync(&all, &mut previous, &mut since, "after"), Extent::Services(1));
    assert_eq!(sync(&all, &mut previous, &mut since, "unsettled"), Extent::Services(1));
    // s009 goes: its number is s008's now.
    all.remove(&9);
    assert_eq!(sync(&all, &mut previous, &mut since, "the holder goes"), Extent::Services(2));
    assert_eq!(
        previous[&ServiceKey::new("default", "s008")][&PortId { port: 80, protocol: Protocol::Tcp }],
        held
    );
    // An age changed underneath: that Service alone.
    sync(&all, &mut previous, &mut since, "after s008 got it");
    since.insert(ServiceKey::new("default", "s100"), k8s_openapi::jiff::Timestamp::from_second(1).unwrap());
    assert_eq!(sync(&all, &mut previous, &mut since, "aged"), Extent::Services(1));
    sync(&all, &mut previous, &mut since, "after the age");
    // Every Service object parsed again (new objects that read the same, as a leader's status
    // write of every Service gives in Kubernetes mode): nothing is decided again.
    for (i, (services, _)) in all.iter_mut() {
        *services = objects(*i, (*i == 8).then_some(held)).0;
    }
    assert_eq!(sync(&all, &mut previous, &mut since, "parsed again"), Extent::Services(0));
    all.insert(201, objects(201, None));
    assert_eq!(sync(&all, &mut previous, &mut since, "added after"), Extent::Services(1));
}

/// Manifests mode with two pools apart (edge and internal nodes, each serving 443 on its own):
/// a Service of the internal pool asking for 443 while one of the edge pool holds it gets it,
/// as the whole decision gives it, whatever the last syncs were.
#[test]
fn pools_apart_share_a_number_in_every_sync() {
    use k8s_openapi::api::core::v1::Service;
    use nodelb::core::decisions::desired::{
        AllocationMode, HostFacts, HostPolicy, Inputs, Kept, SourceNotes,
    };
    use nodelb::core::decisions::pool::{self, PoolContext, PoolSet};
    use nodelb::core::decisions::port_policy::{PortPolicy, PortRange};
    use nodelb::core::inputs::model::ModelOptions;
    use serde_json::json;

    let range = PortRange::new(20000, 20099).unwrap();
    let policy = HostPolicy { ports: PortPolicy::with_range(range), ..Default::default() };
    let (model, notes, host) = (ModelOptions::default(), SourceNotes::default(), HostFacts::default());
    let node = node(&[Family::Ipv4]);
    let pool = |name: &str, tier: &str| {
        let spec = json!({"portMode": "ServicePort", "ports": [{"start": 443, "end": 443}],
                          "nodeSelector": {"matchLabels": {"tier": tier}}});
        pool::validate(name, None, None, &serde_json::from_value(spec).unwrap()).expect("valid")
    };
    let ctx = PoolContext {
        set: PoolSet::resolve(vec![pool("edge", "edge"), pool("internal", "internal")], true, range, &[]),
        namespaces: BTreeMap::new(),
        node_labels: [("tier".to_string(), "internal".to_string())].into(),
        servicelb: false,
    };
    let service = |name: &str| -> Arc<Service> {
        Arc::new(
            serde_json::from_value(json!({
                "metadata": {"name": name, "namespace": "ingress", "uid": format!("uid-{name}"),
                             "annotations": {"nodelb.io/pool": name}},
                "spec": {"type": "LoadBalancer", "ports": [{"port": 443}]}
            }))
            .unwrap(),
        )
    };
    let (mut kept, mut applied, mut index) = (Kept::default(), None, CounterIndex::default());
    let mut previous = BTreeMap::new();
    let since = BTreeMap::new();
    let mut services = vec![service("edge")];
    for step in ["the edge Service", "quiet", "the internal Service comes", "quiet again"] {
        if step == "the internal Service comes" {
            services.push(service("internal"));
        }
        let inputs = Inputs {
            mode: AllocationMode::Allocate,
            services: &services,
            slices: &[],
            notes: &notes,
            previous: &previous,
            since: &since,
            range: &range,
            model: &model,
            node: &node,
            policy: &policy,
            host: &host,
            pools: Some(&ctx),
            registry: None,
        };
        let (whole, _, _) = both_ways(&inputs, &mut kept, &mut applied, &mut index, step);
        previous = whole.allocations;
    }
    let port = PortId { port: 443, protocol: Protocol::Tcp };
    for name in ["edge", "internal"] {
        assert_eq!(previous[&ServiceKey::new("ingress", name)][&port], 443, "{name}");
    }
}
