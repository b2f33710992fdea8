//! The incremental planner (`replan`) against the full one (`plan::plan_with`), table-driven and
//! over random sequences of changes: the patch applied to the last ruleset is the full plan, its
//! diff is the full diff, its counter index update gives the full index, and the UDP backends it
//! drops are those the full rulesets drop. Pure (no root).

mod common;

use std::collections::{BTreeMap, BTreeSet};

use nodelb::counters::{CounterIndex, CounterKind, SeriesKey};
use nodelb::domain::{Family, PortId, Protocol, ServiceKey};
use nodelb::ir::Ruleset;
use nodelb::model::{LbService, TrafficPolicy};
use nodelb::plan::{self, NodeFacts, ServicePlan};
use nodelb::replan::{PlanInput, Planned, Planner};
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
            service: s.clone(),
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
/// every counter the ruleset has under a Service port's names, and every Service port.
fn index_of(inputs: &[PlanInput], rs: &Ruleset) -> CounterIndex {
    let mut index = CounterIndex::default();
    for svc in inputs.iter().map(|i| &i.service) {
        for port in &svc.ports {
            let key = SeriesKey { service: svc.key.clone(), port: port.id };
            for &f in &svc.families {
                let names = plan::PortNames::new(f, svc, port);
                for (counter, kind) in [
                    (names.connections_counter(), CounterKind::Connections),
                    (names.forwarded_counter(), CounterKind::Traffic),
                    (names.refused_counter(), CounterKind::Refused),
                ] {
                    if rs.counters.contains_key(&counter) {
                        index.counters.insert(counter, (key.clone(), kind));
                    }
                }
            }
            index.ports.insert(key);
        }
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
                s.key.name = format!("{}-{copy}", s.key.name);
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
                current.insert(s.key.clone(), PlanInput { service: s, node_ports, addresses });
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
    let one =
        |s: &LbService, p: u16| PlanInput { service: s.clone(), node_ports: ports(s, p), addresses: None };
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
