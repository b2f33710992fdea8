//! The incremental planner (`replan`) against the full one (`plan::plan_with`), table-driven and
//! over random sequences of changes: the patch applied to the last ruleset is the full plan, its
//! diff is the full diff, its counter index update gives the full index, and the UDP backends it
//! drops are those the full rulesets drop. Pure (no root).

mod common;

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use nodelb::counters::CounterIndex;
use nodelb::desired::Desired;
use nodelb::domain::{Family, PortId, Protocol, ServiceKey};
use nodelb::ir::Ruleset;
use nodelb::model::{LbService, TrafficPolicy};
use nodelb::plan::{self, NodeFacts, ServicePlan};
use nodelb::replan::{self, PlanInput, Planned, Planner};
use nodelb::simulate::simulate;

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
fn index_of(inputs: &[PlanInput], rs: &Ruleset) -> CounterIndex {
    let mut index = CounterIndex::default();
    for input in inputs {
        replan::index_entries(&input.service, &rs.counters, &mut index);
    }
    index
}

/// One step of the planner from `applied` (its last plan) to `next`, checked against the full
/// planner; returns the new applied ruleset and index.
fn step(
    planner: &mut Planner,
    applied: &Ruleset,
    index: &CounterIndex,
    next: &[PlanInput],
    node: &NodeFacts,
    what: &str,
) -> (Ruleset, CounterIndex, bool) {
    let want = full_plan(next, node);
    let want_index = index_of(next, &want);
    let (planned, update) = planner.plan(next.to_vec(), node, Some(applied), true);
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
            assert_eq!(index, index_of(&from, &rs), "{what}: index of {}", a.name);
            let to = inputs(&b.services, &b.addresses);
            let (rs, index, was_patch) = step(&mut planner, &rs, &index, &to, &b.node, &what);
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
        let mut planner = Planner::new();
        let mut current: BTreeMap<ServiceKey, PlanInput> = BTreeMap::new();
        let (mut applied, mut index) = planner.full(vec![], &node, true);
        let (mut patches, mut fulls) = (0, 0);
        for n in 0..300 {
            for _ in 0..rng.range(1, 3) {
                let which = rng.below(bases.len() as u64) as u16;
                let base = &bases[usize::from(which)];
                let copy = rng.below(6);
                let mut s = variant(base, rng.below(8), &mut rng);
                s.key.name = format!("{}-{copy}", s.key.name).into();
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
            let next: Vec<PlanInput> = current.values().cloned().collect();
            let what = format!("seed {seed} step {n}");
            let was_patch;
            (applied, index, was_patch) = step(&mut planner, &applied, &index, &next, &node, &what);
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
        step(&mut planner, &rs, &index, &[one(&a, 20001), one(&b, 20001)], &node, "clash");
    assert!(!patch, "a clash is planned whole");
    let (rs, index, patch) =
        step(&mut planner, &rs, &index, &[one(&a, 20001), one(&b, 20002)], &node, "resolved");
    assert!(!patch, "the plan after a clash is full");
    let (_, _, patch) = step(&mut planner, &rs, &index, &[one(&a, 20001)], &node, "after");
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

/// Random sequences of snapshots as the sources hand them over (each object an `Arc`, the same
/// `Arc` while it is unchanged): `desired::compute_next` with what it keeps between syncs (the
/// model cache, the planner) gives what `desired::compute_with` gives from scratch, field by
/// field, its patch applied to the last ruleset the whole ruleset and its index patch the whole
/// index. Objects are replaced by edited ones, by equal copies (a new `Arc`), dropped and
/// duplicated, and handed over in another order; node addresses (an endpoint that becomes a
/// node's address is refused) and allocation ages change underneath.
#[test]
fn compute_next_gives_what_compute_gives() {
    use common::manifest::{EndpointSpec, PortSpec, ServiceSpec};
    use k8s_openapi::api::core::v1::Service;
    use nodelb::compact::EndpointSlice;
    use nodelb::desired::{self, AllocationMode, HostFacts, HostPolicy, Inputs, Kept, SourceNotes};
    use nodelb::model::ModelOptions;
    use nodelb::port_policy::{PortPolicy, PortRange};

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
        let m = nodelb::manifests::parse(std::path::Path::new("t.yaml"), "t.yaml", &s.render());
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
                for i in (1..services.len()).rev() {
                    services.swap(i, rng.below(i as u64 + 1) as usize);
                }
                for i in (1..slices.len()).rev() {
                    slices.swap(i, rng.below(i as u64 + 1) as usize);
                }
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
            };
            let what = format!("seed {seed} step {step}");
            let whole = desired::compute_with(&inputs, true);
            let next = desired::compute_next(&inputs, true, &mut kept, applied.as_ref());
            assert_eq!(rest(&next), rest(&whole), "{what}: everything but the ruleset");
            match next.ruleset {
                Planned::Full(rs) => applied = Some(rs),
                Planned::Patch(p) => {
                    patches += 1;
                    p.apply(applied.as_mut().expect("a patch of the last ruleset"));
                }
            }
            next.counter_index.apply(&mut index);
            assert_eq!(applied.as_ref(), Some(&whole.ruleset), "{what}: ruleset");
            assert_eq!(index, whole.counter_index, "{what}: counter index");
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
    let (rs, index, patch) = step(&mut planner, &rs, &index, &services(20), &node, "20 of 200");
    assert!(patch, "20 of 200 changed: a patch");
    let (_, _, patch) = step(&mut planner, &rs, &index, &services(150), &node, "150 of 200");
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
    aged.port_request = nodelb::model::PortRequest::ServicePorts;
    aged.uid = Some("u".into());
    let (planned, _) = planner.plan(vec![input(&aged)], &node, Some(&rs), true);
    assert!(
        matches!(&planned, Planned::Patch(p) if p.old.chains.is_empty() && p.new.chains.is_empty()),
        "{planned:?}"
    );
}
