//! Incremental planning ("recompute only what changed", docs/design/incremental.md): the ruleset
//! of the last sync changed Service by Service instead of planned whole again. Pure.
//!
//! A [`Planner`] keeps what it last planned each Service from ([`PlanInput`]). Given the next
//! inputs and the ruleset the kernel holds (the one it last produced), it plans only the Services
//! whose input changed, once as they were and once as they are, and returns a [`RulesetPatch`]:
//! the old and new value of every name those Services had or have. Nothing of the other Services
//! is built, compared, copied or freed, so a one-Service change costs the same however many
//! Services there are. The patch applied to that ruleset gives exactly what [`plan::plan_with`]
//! gives for the same inputs, and `plan::diff(&patch.old, &patch.new)` gives exactly the batch
//! `plan::diff(&applied, &desired)` would (tests/replan.rs proves both over every pair of golden
//! scenarios and random sequences of their Services).
//!
//! Everything a Service adds is its own (its chains, counters and affinity sets are named by its
//! identity) except elements of the shared sets: two Services with the same endpoint put the same
//! element in `endpoints-*`. The planner counts those holders, so the element goes only with its
//! last one. Whenever the patch would not be exact the plan is full instead, as kube-proxy's
//! nftables mode falls back to a full sync: no ruleset to patch (the first sync, after a failure),
//! other node facts, a ruleset that is not the one last planned, two Services claiming one name
//! differently (a hash collision, a node port in two allocations: planned whole, in order, as
//! before), or more than a third of the Services changed (a patch plans each twice).

use std::collections::{BTreeMap, BTreeSet};
use std::net::IpAddr;
use std::sync::Arc;

use crate::domain::{PortId, ServiceKey};
use crate::inputs::model::LbService;
use crate::reports::counters::{CounterIndex, CounterKind, IndexUpdate, SeriesKey};
use crate::ruleset::ir::{Chain, Key, Mapped, Name, NamedCounter, Ruleset, Set};
use crate::ruleset::plan::{self, NodeFacts, ServicePlan};

/// One Service as the planner takes it: validated, with the node ports this node programs for
/// it and, when its pool restricts node addresses, the addresses of this node that serve it.
/// Two are equal when they plan the same (see [`plans_the_same`]).
#[derive(Debug, Clone)]
pub struct PlanInput {
    /// Shared with the model cache: an unchanged Service is the same `Arc` (compared by pointer
    /// first).
    pub service: Arc<LbService>,
    pub node_ports: BTreeMap<PortId, u16>,
    pub addresses: Option<BTreeSet<IpAddr>>,
}

impl PartialEq for PlanInput {
    fn eq(&self, other: &PlanInput) -> bool {
        self.node_ports == other.node_ports
            && self.addresses == other.addresses
            && (Arc::ptr_eq(&self.service, &other.service) || plans_the_same(&self.service, &other.service))
    }
}

/// Whether two models plan the same ruleset: equal in every field the planner reads. What only
/// the allocator reads (age, requests, the allocation found on the object) does not count, so a
/// Service whose allocation age is stamped is not planned again. Destructured whole: a field
/// added to [`LbService`] must be sorted here before this compiles.
fn plans_the_same(a: &LbService, b: &LbService) -> bool {
    let LbService {
        key,
        uid: _,
        created: _,
        allocated_since: _,
        ports,
        families,
        source_ranges,
        traffic_policy,
        session_affinity,
        port_request: _,
        previous_allocation: _,
        kube_node_ports: _,
    } = a;
    (key, ports, families, source_ranges, traffic_policy, session_affinity)
        == (&b.key, &b.ports, &b.families, &b.source_ranges, &b.traffic_policy, &b.session_affinity)
}

/// The old and the new value of every chain, counter, set and set element a sync changes; each
/// side holds those that exist on it. A set on both sides is a set whose elements change (only
/// the elements listed are touched); on one side only, a set that comes or goes whole.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RulesetPatch {
    pub old: Ruleset,
    pub new: Ruleset,
}

impl RulesetPatch {
    /// Turns the ruleset the patch was computed against into the desired one.
    pub fn apply(self, rs: &mut Ruleset) {
        let RulesetPatch { old, new } = self;
        for name in old.chains.keys() {
            rs.chains.remove(name);
        }
        rs.chains.extend(new.chains);
        for name in old.counters.keys() {
            rs.counters.remove(name);
        }
        rs.counters.extend(new.counters);
        let mut new_sets = new.sets;
        for (name, was) in old.sets {
            match (new_sets.remove(&name), rs.sets.get_mut(&name)) {
                (Some(is), Some(target)) => {
                    for key in was.elements.keys() {
                        target.elements.remove(key);
                    }
                    let Set { key, kind, elements, comment, .. } = is;
                    target.elements.extend(elements);
                    (target.key, target.kind, target.comment) = (key, kind, comment);
                }
                (Some(is), None) => {
                    rs.sets.insert(name, is);
                }
                (None, _) => {
                    rs.sets.remove(&name);
                }
            }
        }
        rs.sets.extend(new_sets);
    }

    /// Whether it changes nothing.
    pub fn is_empty(&self) -> bool {
        self.old == self.new
    }
}

/// What a sync's plan is: the whole ruleset, or a patch of the one the kernel holds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Planned {
    Full(Ruleset),
    Patch(RulesetPatch),
}

/// The planner's memory between syncs (see the module's documentation).
#[derive(Debug, Default)]
pub struct Planner {
    /// The node facts of the last plan.
    node: Option<NodeFacts>,
    /// Every Service of the last plan, sorted by key.
    services: Vec<PlanInput>,
    /// Elements of the skeleton's sets that more than one Service holds: how many besides one.
    shared: BTreeMap<(Name, Key), u32>,
    /// The last full plan had two Services claiming one name differently: only a full plan, in
    /// order, reproduces that, so every plan is full until one has no such clash.
    clashed: bool,
    /// The size of the ruleset the last plan produced: a patch is computed only against it.
    shape: Option<Shape>,
    /// Where one Service is planned.
    scratch: Scratch,
}

/// An empty skeleton (its sets only), to plan one Service into.
#[derive(Debug, Default)]
struct Scratch {
    rs: Ruleset,
    /// The names of the skeleton's sets (every other set is one Service's own).
    skeleton_sets: BTreeSet<Name>,
}

impl Planner {
    pub fn new() -> Planner {
        Planner::default()
    }

    /// The plan for `inputs` (sorted by key, each key once, as [`crate::inputs::model::build`] gives
    /// them): a patch of `applied` when it is the ruleset this planner last produced and nothing
    /// but Services changed, else the whole ruleset. With `index`, the counter index (or its
    /// patch) too; without it an empty one.
    pub fn plan(
        &mut self,
        inputs: Vec<PlanInput>,
        node: &NodeFacts,
        applied: Option<&Ruleset>,
        index: bool,
    ) -> (Planned, IndexUpdate) {
        let sorted = inputs.windows(2).all(|w| w[0].service.key < w[1].service.key);
        let patchable = applied.filter(|a| {
            sorted
                && !self.clashed
                && self.node.as_ref() == Some(node)
                && self.shape.is_some_and(|s| s == Shape::of(a))
        });
        if let Some(applied) = patchable {
            // Err: two Services claim one name, or most changed; planned whole below.
            if let Ok((patch, update)) = self.patch(&inputs, node, applied, index) {
                let shape = Shape::of(applied).plus(Shape::of(&patch.new)).minus(Shape::of(&patch.old));
                self.shape = Some(shape);
                self.services = inputs;
                return (Planned::Patch(patch), update);
            }
        }
        let (rs, counter_index) = self.full(inputs, node, index);
        (Planned::Full(rs), IndexUpdate::Full(counter_index))
    }

    /// The whole ruleset for `inputs` (any order), as [`plan::plan_with`] plans it, and its
    /// counter index (empty without `index`); the planner then knows it as the last one.
    pub fn full(
        &mut self,
        mut inputs: Vec<PlanInput>,
        node: &NodeFacts,
        index: bool,
    ) -> (Ruleset, CounterIndex) {
        self.reset(node);
        let mut rs = plan::skeleton(node);
        let mut counter_index = CounterIndex::default();
        for input in &inputs {
            let part = self.scratch.part(input, node);
            if index {
                index_entries(&input.service, &input.node_ports, &part.counters, node, &mut counter_index);
            }
            self.clashed |= merge(&mut rs, part, &mut self.shared).is_err();
        }
        if self.clashed {
            // Planned again the way the full planner does it: the later Service overwrites.
            let plans: Vec<ServicePlan<'_>> = inputs
                .iter()
                .map(|i| ServicePlan { service: &i.service, node_ports: &i.node_ports })
                .collect();
            let addresses: BTreeMap<ServiceKey, BTreeSet<IpAddr>> =
                inputs.iter().filter_map(|i| Some((i.service.key.clone(), i.addresses.clone()?))).collect();
            rs = plan::plan_with(&plans, node, &addresses);
        }
        inputs.sort_by(|a, b| a.service.key.cmp(&b.service.key));
        self.clashed |= inputs.windows(2).any(|w| w[0].service.key == w[1].service.key);
        self.services = inputs;
        self.shape = Some(Shape::of(&rs));
        (rs.packed(), counter_index.packed())
    }

    /// Starts a whole plan for `node`: the scratch skeleton is `node`'s, nothing is shared or
    /// clashing yet (the services and the shape are set by the plan).
    fn reset(&mut self, node: &NodeFacts) {
        if self.node.as_ref() != Some(node) || self.scratch.skeleton_sets.is_empty() {
            let mut rs = plan::skeleton(node);
            rs.chains.clear();
            rs.counters.clear();
            self.scratch = Scratch { skeleton_sets: rs.sets.keys().cloned().collect(), rs };
        }
        self.node = Some(node.clone());
        self.shared.clear();
        self.clashed = false;
    }

    /// [`Planner::plan`] given what changed only: the inputs of the Services decided again
    /// (`None`: no longer planned), each key once, sorted by key; every other Service's input is
    /// the one last planned. The same plan as [`Planner::plan`] of every input.
    pub fn plan_changes(
        &mut self,
        changes: Vec<(ServiceKey, Option<PlanInput>)>,
        node: &NodeFacts,
        applied: Option<&Ruleset>,
        index: bool,
    ) -> (Planned, IndexUpdate) {
        let patchable = applied.filter(|a| {
            !self.clashed && self.node.as_ref() == Some(node) && self.shape.is_some_and(|s| s == Shape::of(a))
        });
        if let Some(applied) = patchable {
            let old = std::mem::take(&mut self.services);
            let changed: Vec<(Option<&PlanInput>, Option<&PlanInput>)> = changes
                .iter()
                .map(|(key, is)| {
                    let was = old.binary_search_by(|p| p.service.key.cmp(key)).ok().map(|i| &old[i]);
                    (was, is.as_ref())
                })
                .filter(|(was, is)| was != is)
                .collect();
            // As many Services as `plan` would count: the most of the old and the new inputs.
            let added = changed.iter().filter(|(was, is)| was.is_none() && is.is_some()).count();
            let removed = changed.iter().filter(|(was, is)| was.is_some() && is.is_none()).count();
            let services = old.len().max(old.len() + added - removed);
            let result = self.patch_changed(changed, services, node, applied, index);
            self.services = old;
            if let Ok((patch, update)) = result {
                let shape = Shape::of(applied).plus(Shape::of(&patch.new)).minus(Shape::of(&patch.old));
                self.shape = Some(shape);
                self.update_services(changes);
                return (Planned::Patch(patch), update);
            }
        }
        self.update_services(changes);
        let inputs = std::mem::take(&mut self.services);
        let (rs, counter_index) = self.full(inputs, node, index);
        (Planned::Full(rs), IndexUpdate::Full(counter_index))
    }

    /// Puts `changes` (sorted by key) into the inputs last planned (sorted by key): one at a
    /// time when they are few, else in one merge (a burst of creates inserts each in the middle).
    fn update_services(&mut self, changes: Vec<(ServiceKey, Option<PlanInput>)>) {
        if changes.len() > MIN_PATCHED {
            let old = std::mem::take(&mut self.services);
            let mut merged = Vec::with_capacity(old.len() + changes.len());
            let mut old = old.into_iter().peekable();
            for (key, is) in changes {
                while let Some(p) = old.next_if(|p| p.service.key < key) {
                    merged.push(p);
                }
                old.next_if(|p| p.service.key == key);
                merged.extend(is);
            }
            merged.extend(old);
            self.services = merged;
            return;
        }
        for (key, is) in changes {
            match (self.services.binary_search_by(|p| p.service.key.cmp(&key)), is) {
                (Ok(i), Some(is)) => self.services[i] = is,
                (Ok(i), None) => {
                    self.services.remove(i);
                }
                (Err(i), Some(is)) => self.services.insert(i, is),
                (Err(_), None) => {}
            }
        }
    }

    /// The patch from the last plan (`self.services`, whose ruleset is `applied`) to `inputs`.
    fn patch(
        &mut self,
        inputs: &[PlanInput],
        node: &NodeFacts,
        applied: &Ruleset,
        index: bool,
    ) -> Result<(RulesetPatch, IndexUpdate), NoPatch> {
        let old = std::mem::take(&mut self.services);
        let mut changed: Vec<(Option<&PlanInput>, Option<&PlanInput>)> = Vec::new();
        let (mut o, mut n) = (old.iter().peekable(), inputs.iter().peekable());
        loop {
            let step = match (o.peek(), n.peek()) {
                (None, None) => break,
                (Some(_), None) => (o.next(), None),
                (None, Some(_)) => (None, n.next()),
                (Some(a), Some(b)) => match a.service.key.cmp(&b.service.key) {
                    std::cmp::Ordering::Less => (o.next(), None),
                    std::cmp::Ordering::Greater => (None, n.next()),
                    std::cmp::Ordering::Equal => (o.next(), n.next()),
                },
            };
            if step.0 != step.1 {
                changed.push(step);
            }
        }
        let result = self.patch_changed(changed, inputs.len().max(old.len()), node, applied, index);
        self.services = old;
        result
    }

    /// The patch of `applied` for the Services of `changed` (each as it was and as it is;
    /// `services` of them in all), or why there is none.
    fn patch_changed(
        &mut self,
        changed: Vec<(Option<&PlanInput>, Option<&PlanInput>)>,
        services: usize,
        node: &NodeFacts,
        applied: &Ruleset,
        index: bool,
    ) -> Result<(RulesetPatch, IndexUpdate), NoPatch> {
        // A patch plans each changed Service twice: past a third of them, planning whole is
        // cheaper (every Service's age is stamped after the first allocation round, say).
        if changed.len() > MAX_PATCHED_SHARE * services / 100 + MIN_PATCHED {
            return Err(NoPatch::TooMany);
        }
        let mut b =
            Builder { applied, patch: RulesetPatch::default(), shared: &self.shared, delta: BTreeMap::new() };
        let (mut removed, mut added) = (CounterIndex::default(), CounterIndex::default());
        let mut result = Ok(());
        for (was, is) in changed {
            if let Some(was) = was {
                let part = self.scratch.part(was, node);
                if index {
                    index_entries(&was.service, &was.node_ports, &part.counters, node, &mut removed);
                }
                b.remove(part);
            }
            if let Some(is) = is {
                let part = self.scratch.part(is, node);
                if index {
                    index_entries(&is.service, &is.node_ports, &part.counters, node, &mut added);
                }
                result = result.and(b.add(part));
            }
        }
        let Builder { patch, delta, .. } = b;
        result.map_err(|Clash| NoPatch::Clash)?;
        for (key, d) in delta {
            let n = i64::from(self.shared.get(&key).copied().unwrap_or(0)) + d;
            match u32::try_from(n) {
                Ok(0) | Err(_) => self.shared.remove(&key),
                Ok(n) => self.shared.insert(key, n),
            };
        }
        Ok((patch, IndexUpdate::Patch { removed, added }))
    }
}

impl Scratch {
    /// One Service's part of the ruleset, planned into the empty skeleton and taken out of it.
    fn part(&mut self, input: &PlanInput, node: &NodeFacts) -> Part {
        let sp = ServicePlan { service: &input.service, node_ports: &input.node_ports };
        plan::plan_service(&mut self.rs, &sp, input.addresses.as_ref(), node);
        let chains = std::mem::take(&mut self.rs.chains);
        let counters = std::mem::take(&mut self.rs.counters);
        let own: Vec<Name> =
            self.rs.sets.keys().filter(|n| !self.skeleton_sets.contains(*n)).cloned().collect();
        let sets = own.iter().filter_map(|n| self.rs.sets.remove(n)).collect();
        let elements = self
            .rs
            .sets
            .iter_mut()
            .filter(|(_, s)| !s.elements.is_empty())
            .map(|(name, s)| (name.clone(), std::mem::take(&mut s.elements)))
            .collect();
        Part { chains, counters, sets, elements }
    }
}

/// Two Services claim one name (chain, counter, set) or one set element with different values.
#[derive(Debug)]
struct Clash;

/// Why a plan is whole although a patch was possible.
#[derive(Debug)]
enum NoPatch {
    Clash,
    /// More Services changed than a patch is worth.
    TooMany,
}

/// A patch is made while at most this share (%) of the Services changed, plus [`MIN_PATCHED`].
const MAX_PATCHED_SHARE: usize = 33;
const MIN_PATCHED: usize = 16;

/// What one Service adds to the ruleset.
struct Part {
    chains: BTreeMap<Name, Chain>,
    counters: BTreeMap<Name, NamedCounter>,
    /// Its own sets (client affinity), whole.
    sets: Vec<Set>,
    /// Its elements of the skeleton's sets, by set.
    elements: Vec<(Name, BTreeMap<Key, Option<Mapped>>)>,
}

/// Adds `part` to the ruleset being planned whole, counting the elements it shares with earlier
/// Services in `shared`. A clash is reported; the part is added anyway (the caller plans again).
fn merge(rs: &mut Ruleset, part: Part, shared: &mut BTreeMap<(Name, Key), u32>) -> Result<(), Clash> {
    let mut clash = false;
    for (name, chain) in part.chains {
        clash |= rs.chains.insert(name, chain).is_some();
    }
    for (name, counter) in part.counters {
        clash |= rs.counters.insert(name, counter).is_some();
    }
    for set in part.sets {
        clash |= rs.sets.insert(set.name.clone(), set).is_some();
    }
    for (name, elements) in part.elements {
        let Some(set) = rs.sets.get_mut(&name) else { continue };
        for (key, value) in elements {
            match set.elements.get(&key) {
                None => {
                    set.elements.insert(key, value);
                }
                Some(v) if *v == value => *shared.entry((name.clone(), key)).or_default() += 1,
                Some(_) => clash = true,
            }
        }
    }
    if clash { Err(Clash) } else { Ok(()) }
}

/// Builds a [`RulesetPatch`] against `applied`. A name is touched the first time a Service's
/// part removes or adds it: its value in `applied` (if any) goes on both sides, and from then on
/// `patch.new` holds its current value. So its current value is the one in `patch.new`, else
/// none if `patch.old` has it (removed), else the one in `applied` (untouched).
struct Builder<'a> {
    applied: &'a Ruleset,
    patch: RulesetPatch,
    shared: &'a BTreeMap<(Name, Key), u32>,
    /// Changes to `shared` made by this patch.
    delta: BTreeMap<(Name, Key), i64>,
}

impl Builder<'_> {
    fn holders_besides_one(&self, key: &(Name, Key)) -> i64 {
        i64::from(self.shared.get(key).copied().unwrap_or(0)) + self.delta.get(key).copied().unwrap_or(0)
    }

    fn remove(&mut self, part: Part) {
        for name in part.chains.keys() {
            touch(&self.applied.chains, &mut self.patch.old.chains, &mut self.patch.new.chains, name);
            self.patch.new.chains.remove(name);
        }
        for name in part.counters.keys() {
            touch(&self.applied.counters, &mut self.patch.old.counters, &mut self.patch.new.counters, name);
            self.patch.new.counters.remove(name);
        }
        for set in &part.sets {
            touch(&self.applied.sets, &mut self.patch.old.sets, &mut self.patch.new.sets, &set.name);
            self.patch.new.sets.remove(&set.name);
        }
        for (name, elements) in part.elements {
            for key in elements.into_keys() {
                let id = (name.clone(), key);
                if self.holders_besides_one(&id) > 0 {
                    *self.delta.entry(id).or_default() -= 1;
                    continue;
                }
                let (name, key) = id;
                if let Some(new) = self.touch_element(&name, &key) {
                    new.elements.remove(&key);
                }
            }
        }
    }

    fn add(&mut self, part: Part) -> Result<(), Clash> {
        for (name, chain) in part.chains {
            if current(&self.applied.chains, &self.patch.old.chains, &self.patch.new.chains, &name).is_some()
            {
                return Err(Clash);
            }
            self.patch.new.chains.insert(name, chain);
        }
        for (name, counter) in part.counters {
            if current(&self.applied.counters, &self.patch.old.counters, &self.patch.new.counters, &name)
                .is_some()
            {
                return Err(Clash);
            }
            self.patch.new.counters.insert(name, counter);
        }
        for set in part.sets {
            if current(&self.applied.sets, &self.patch.old.sets, &self.patch.new.sets, &set.name).is_some() {
                return Err(Clash);
            }
            self.patch.new.sets.insert(set.name.clone(), set);
        }
        for (name, elements) in part.elements {
            for (key, value) in elements {
                let now = match self.patch.new.sets.get(&name).and_then(|s| s.elements.get(&key)) {
                    Some(v) => Some(v),
                    None if self.patch.old.sets.get(&name).is_some_and(|s| s.elements.contains_key(&key)) => {
                        None
                    }
                    None => self.applied.sets.get(&name).and_then(|s| s.elements.get(&key)),
                };
                match now {
                    None => {
                        if let Some(new) = self.touch_element(&name, &key) {
                            new.elements.insert(key, value);
                        }
                    }
                    Some(v) if *v == value => *self.delta.entry((name.clone(), key)).or_default() += 1,
                    Some(_) => return Err(Clash),
                }
            }
        }
        Ok(())
    }

    /// Touches element `key` of skeleton set `name` (its header goes on both sides, empty, the
    /// first time) and returns the set on the new side, or `None` if `applied` has no such set.
    fn touch_element(&mut self, name: &str, key: &Key) -> Option<&mut Set> {
        let set = self.applied.sets.get(name)?;
        let header = || Set {
            name: set.name.clone(),
            key: set.key.clone(),
            kind: set.kind,
            elements: BTreeMap::new(),
            comment: set.comment.clone(),
        };
        let old = self.patch.old.sets.entry(set.name.clone()).or_insert_with(header);
        let new = self.patch.new.sets.entry(set.name.clone()).or_insert_with(header);
        if !old.elements.contains_key(key)
            && !new.elements.contains_key(key)
            && let Some(value) = set.elements.get(key)
        {
            old.elements.insert(*key, value.clone());
            new.elements.insert(*key, value.clone());
        }
        Some(new)
    }
}

/// Puts `applied`'s value of `name` on both sides the first time it is touched.
fn touch<V: Clone>(
    applied: &BTreeMap<Name, V>,
    old: &mut BTreeMap<Name, V>,
    new: &mut BTreeMap<Name, V>,
    name: &str,
) {
    if !old.contains_key(name)
        && !new.contains_key(name)
        && let Some((name, v)) = applied.get_key_value(name)
    {
        old.insert(name.clone(), v.clone());
        new.insert(name.clone(), v.clone());
    }
}

/// The current value of `name` while a patch is built (see [`Builder`]).
fn current<'a, V>(
    applied: &'a BTreeMap<Name, V>,
    old: &'a BTreeMap<Name, V>,
    new: &'a BTreeMap<Name, V>,
    name: &str,
) -> Option<&'a V> {
    match new.get(name) {
        Some(v) => Some(v),
        None if old.contains_key(name) => None,
        None => applied.get(name),
    }
}

/// Adds to `index` the named counters of each served Service port that `counters` has (the
/// Service's part; or a whole ruleset's, as the agent built the index before the planner kept
/// one), and every Service port (whose series outlive its counters: a port that lost its node
/// port has none).
pub fn index_entries(
    svc: &LbService,
    node_ports: &BTreeMap<PortId, u16>,
    counters: &BTreeMap<Name, NamedCounter>,
    node: &NodeFacts,
    index: &mut CounterIndex,
) {
    for port in &svc.ports {
        let key = SeriesKey { service: svc.key.clone(), port: port.id };
        // The planner names counters only for the Service's own families.
        // Without a node port, the port has no counters (and no shard).
        let Some(&node_port) = node_ports.get(&port.id) else {
            index.ports.insert(key);
            continue;
        };
        for &f in &svc.families {
            let names = plan::PortNames::on(f, svc, port, node_port, node);
            for (counter, kind) in [
                (names.connections_counter(), CounterKind::Connections),
                (names.forwarded_counter(), CounterKind::Traffic),
                (names.refused_counter(), CounterKind::Refused),
            ] {
                // The part's own name, shared with the ruleset's counter.
                if let Some((name, _)) = counters.get_key_value(&counter) {
                    index.counters.insert(name.clone(), (key.clone(), kind));
                }
            }
        }
        index.ports.insert(key);
    }
}

/// How many chains, counters, sets and set elements a ruleset has: a cheap check that the
/// ruleset a patch is computed against is the one the planner last produced.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Shape {
    chains: i64,
    counters: i64,
    sets: i64,
    elements: i64,
}

impl Shape {
    fn of(rs: &Ruleset) -> Shape {
        let n = |x: usize| i64::try_from(x).unwrap_or(i64::MAX);
        Shape {
            chains: n(rs.chains.len()),
            counters: n(rs.counters.len()),
            sets: n(rs.sets.len()),
            elements: n(rs.sets.values().map(|s| s.elements.len()).sum()),
        }
    }

    fn plus(self, o: Shape) -> Shape {
        Shape {
            chains: self.chains + o.chains,
            counters: self.counters + o.counters,
            sets: self.sets + o.sets,
            elements: self.elements + o.elements,
        }
    }

    fn minus(self, o: Shape) -> Shape {
        Shape {
            chains: self.chains - o.chains,
            counters: self.counters - o.counters,
            sets: self.sets - o.sets,
            elements: self.elements - o.elements,
        }
    }
}
