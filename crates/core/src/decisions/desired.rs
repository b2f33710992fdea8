//! From a snapshot of the desired state (Services + EndpointSlices) to everything the node should
//! do: validated services, port allocations, the ruleset, and a status line per Service. Pure: the
//! agent loop feeds it and applies the result.
//!
//! Everything but the ruleset is decided per Service ([`Part`]) and kept by key in a
//! [`NodeBook`]; [`compute`] decides again only the Services whose inputs
//! changed, and those that share a node port number with them, when nothing every Service reads
//! changed (docs/design/incremental.md, "The node's sync scoped to what changed").

use std::borrow::Borrow;
use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use crate::inputs::compact::EndpointSlice;
use k8s_openapi::api::core::v1::Service;
use k8s_openapi::jiff::Timestamp;

use crate::decisions::alloc::{self, AllocProblem, Allocations};
use crate::decisions::endpoint_policy::{self, EndpointPolicy, HostAddresses, RefusedEndpoint};
use crate::decisions::pool::PoolContext;
use crate::decisions::port_policy::{self, Listeners, PortPolicy, PortRange, PortRefusal};
use crate::decisions::sharing::{self, Sharing};
use crate::domain::{Family, PortId, Scope, ServiceKey};
use crate::incremental::book::AllocationBook;
use crate::incremental::model_cache::{ModelCache, ModelContext, Modeled};
use crate::incremental::replan::{PlanInput, Planned, Planner};
use crate::incremental::view::SourceView;
use crate::inputs::model::{self, LbService, ModelOptions, Refusal};
use crate::k8s::claims::{Holds, Owner, Registry};
use crate::k8s::dupes::Duplicate;
use crate::reports::counters::{CounterIndex, IndexUpdate};
use crate::reports::report::{EndpointRefusalStatus, PortStatus, ServiceState, ServiceStatus};
use crate::ruleset::ir::Ruleset;
use crate::ruleset::plan::{self, NodeFacts};

/// Everything computed from one snapshot. `R`/`I`: the ruleset and counter index as the
/// incremental planner gives them ([`compute`]: [`Planned`], [`IndexUpdate`]), or whole
/// (`compute_whole`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Desired<R = Ruleset, I = CounterIndex> {
    pub ruleset: R,
    pub allocations: Allocations,
    /// One line per Service, sorted by key (shared with the sync loop's [`NodeBook`]: a Service
    /// not decided again keeps its line).
    pub services: Vec<Arc<ServiceStatus>>,
    /// Families the valid Services ask for.
    pub needed_families: BTreeSet<Family>,
    /// Sorted by Service.
    pub refusals: Vec<Refusal>,
    /// Sorted by Service.
    pub alloc_problems: Vec<AllocProblem>,
    /// Endpoint addresses the policy refused (taken out of the Services; each logged once).
    pub refused_endpoints: Vec<RefusedEndpoint>,
    /// Allocated node ports this node does not program (not allowed, or a local listener).
    pub refused_ports: Vec<RefusedPort>,
    /// Which counter feeds which per-Service-port series, and which Service ports exist (for
    /// `/metrics`); empty when computed without it.
    pub counter_index: I,
    /// Non-fatal input problems (e.g. a bad endpoint address skipped).
    pub warnings: Vec<String>,
}

/// Where the node ports come from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AllocationMode {
    /// Manifests mode: this agent allocates (keeping `previous`, the state file).
    Allocate,
    /// Kubernetes mode: the allocation written on each Service by the leader
    /// (`nodelb.io/allocated-ports`), each number only where the node-port registry gives it to
    /// that Service ([`Inputs::registry`]); this agent never computes one itself, so every node
    /// agrees.
    Annotated,
}

/// What a source knows about its Services beyond the objects it hands over.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SourceNotes {
    /// Services the source could not read at all (manifests mode: a wrongly typed field), each
    /// with the problem: refused, on their own status line.
    pub refused: Vec<Refusal>,
    /// Services served from their last good version (a broken manifest file, a Service edited
    /// into invalid input), and why.
    pub stale: BTreeMap<ServiceKey, String>,
}

/// What the operator allows Services to use on the nodes (flags).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct HostPolicy {
    pub endpoints: EndpointPolicy,
    pub ports: PortPolicy,
}

/// What this node's kernel (and, in Kubernetes mode, the Node objects) say about the nodes, read
/// at every sync: a change is a reason to recompute even when the Services did not change.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct HostFacts {
    /// This node's addresses and, in Kubernetes mode, every Node object's.
    pub addresses: HostAddresses,
    /// What processes on this node listen on (their ports are never taken here).
    pub listeners: Listeners,
}

/// A service port whose node port this node does not program (the allocation stays).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RefusedPort {
    pub service: ServiceKey,
    pub port: PortId,
    pub node_port: u16,
    pub reason: PortRefusal,
}

impl std::fmt::Display for RefusedPort {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "Service {}: port {}: node port {}/{} is not taken on this node: {}",
            self.service, self.port, self.node_port, self.port.protocol, self.reason
        )
    }
}

/// `S` / `E`: the objects owned or shared (`Arc`, as the sources hold them).
pub struct Inputs<'a, S = Service, E = EndpointSlice> {
    pub mode: AllocationMode,
    pub services: &'a [S],
    pub slices: &'a [E],
    pub notes: &'a SourceNotes,
    /// The allocations of the last sync (manifests mode: as the state file keeps them). The sync
    /// loop passes what its last [`compute`] gave: a Service's pool is chosen with the
    /// numbers it held then.
    pub previous: &'a Allocations,
    /// Manifests mode: when this node first allocated each Service (the state file), its age.
    /// Kubernetes mode reads no age of its own (duplicates are settled by creationTimestamp).
    pub since: &'a BTreeMap<ServiceKey, Timestamp>,
    pub range: &'a PortRange,
    pub model: &'a ModelOptions,
    pub node: &'a NodeFacts,
    pub policy: &'a HostPolicy,
    pub host: &'a HostFacts,
    /// Node port pools (`None`, or no pool object: the flags' range for every Service, every
    /// node).
    pub pools: Option<&'a PoolContext>,
    /// Kubernetes mode: the node-port registry, the record of who holds each number (only
    /// nodelb can write it). A number an annotation names is programmed only for the Service
    /// the registry names ([`crate::k8s::claims::Registry::holds`]): any Service owner can
    /// write their own annotation. The Kubernetes source always gives it; `None` trusts the
    /// annotations (manifests mode has none; pure tests that are about something else).
    pub registry: Option<&'a Registry>,
}

/// The whole decision made from nothing, every Service modeled, decided and planned afresh: the
/// oracle [`compute`] is tested against (tests/replan.rs, the fuzz targets).
/// `counter_index: false` leaves [`Desired::counter_index`] empty.
#[cfg(any(test, feature = "testing"))]
pub fn compute_whole<S: Borrow<Service>, E: Borrow<EndpointSlice>>(
    inputs: &Inputs<'_, S, E>,
    counter_index: bool,
) -> Desired {
    let modeled =
        crate::incremental::model_cache::build(inputs.services, inputs.slices, &model_context(inputs));
    let decided = decide(inputs, inputs.services, modeled, None);
    let mut book = NodeBook::default();
    let plans = book.replace(decided, inputs.mode, inputs.previous);
    let (ruleset, index) = Planner::new().full(plans, inputs.node, counter_index);
    book.desired().with(ruleset, index)
}

/// What the sync loop keeps from one sync to the next, to compute only what changed: what
/// changed in the source's view ([`SourceView`]), each Service's model ([`ModelCache`]), its part
/// of the decision ([`NodeBook`]) and what was planned ([`Planner`]).
#[derive(Debug, Default)]
pub struct Kept {
    pub models: ModelCache,
    pub planner: Planner,
    pub view: SourceView,
    pub book: NodeBook,
    /// The next sync is whole ([`Kept::next_sync_whole`]).
    whole: bool,
}

impl Kept {
    /// Makes the next [`compute`] decide every Service again (a periodic verification: the
    /// whole decision is the oracle of the scoped one).
    pub fn next_sync_whole(&mut self) {
        self.whole = true;
    }
}

/// How the last sync decided, for the sync loop's log and tests.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Extent {
    /// Every Service.
    Whole,
    /// Only these many Services (those that changed, and those sharing a number with them).
    Services(usize),
}

/// The node's decision: each Service modeled again only when its objects changed, only the
/// Services whose inputs changed (and those that share a node port number with them; in
/// manifests mode also the unsettled ones and those whose allocation age changed) decided again,
/// and the ruleset and the counter index as a patch of `applied` (what the kernel holds, the
/// planner's last plan) where only Services changed (modules [`crate::incremental::model_cache`],
/// [`crate::incremental::replan`], [`crate::incremental::view`]). A fresh `kept`, or no `applied`, decides everything and
/// plans the whole ruleset. The same result as `compute_whole` for the same inputs
/// (tests/replan.rs), given `inputs.previous` is what the last call gave. `counter_index:
/// false` leaves the counter index empty (per-Service metrics off: the index names chains of
/// every Service port).
pub fn compute(
    inputs: &Inputs<'_, Arc<Service>, Arc<EndpointSlice>>,
    counter_index: bool,
    kept: &mut Kept,
    applied: Option<&Ruleset>,
) -> (Desired<Planned, IndexUpdate>, Extent) {
    let ctx = model_context(inputs);
    let mut changes = kept.view.pass(inputs.services, inputs.slices);
    kept.models.rebase(&std::mem::take(&mut changes.rebased));
    // The numbers whose registry owner changed: the Services naming them are decided again.
    let recorded = match (&kept.book.registry, inputs.registry) {
        (Some(before), Some(now)) => Some(now.owners_changed(before)),
        (None, None) => Some(Vec::new()),
        _ => None,
    };
    kept.book.registry = inputs.registry.cloned();
    // A pool bounding what a namespace holds counts over every Service the node allocates, and
    // pools apart share numbers by the pools of every holder, which a scope does not see.
    let counts_all = inputs.mode == AllocationMode::Allocate
        && inputs
            .pools
            .is_some_and(|c| c.set.bounds_namespaces() || c.set.sharing().is_some_and(|s| !s.is_empty()));
    let whole = std::mem::take(&mut kept.whole)
        || counts_all
        || changes.first
        || applied.is_none()
        || recorded.is_none()
        || !kept.book.same_shared(inputs)
        || !kept.models.has_context(&ctx)
        || kept.view.has_shared_keys();
    let scope = (!whole).then(|| {
        // Manifests mode: a Service whose allocation age changed is decided again (the
        // allocator orders by age).
        let aged = match inputs.mode {
            AllocationMode::Allocate => kept.models.aged(inputs.since),
            AllocationMode::Annotated => Vec::new(),
        };
        kept.book.scope(&kept.view, changes, aged, recorded.unwrap_or_default(), inputs)
    });
    let (plans, extent) = match scope {
        None => {
            let modeled =
                (kept.models.build(Scope::All, inputs.services, inputs.slices, &ctx)).expect("a whole build");
            let decided = decide(inputs, inputs.services, modeled, None);
            let plans = kept.book.replace(decided, inputs.mode, inputs.previous);
            kept.book.keep_read(inputs);
            (Plans::Whole(plans), Extent::Whole)
        }
        Some(keys) => {
            let (services, slices) = kept.view.objects_of(&keys);
            let modeled = (kept.models.build(Scope::Keys(&keys), &services, &slices, &ctx))
                .expect("the model cache's context was checked");
            let elsewhere = kept.book.decided.elsewhere(&keys);
            let decided = decide(inputs, &services, modeled, elsewhere);
            let plans = kept.book.patch(&keys, decided, inputs.previous);
            (Plans::Changed(plans), Extent::Services(keys.len()))
        }
    };
    let (ruleset, index) = match plans {
        Plans::Whole(plans) => kept.planner.plan(plans, inputs.node, applied, counter_index),
        Plans::Changed(changes) => kept.planner.plan_changes(changes, inputs.node, applied, counter_index),
    };
    (kept.book.desired().with(ruleset, index), extent)
}

/// What the planner is given: every Service's input, or the inputs of the Services decided
/// again (`None`: no longer planned).
enum Plans {
    Whole(Vec<PlanInput>),
    Changed(Vec<(ServiceKey, Option<PlanInput>)>),
}

fn model_context<'a, S, E>(inputs: &Inputs<'a, S, E>) -> ModelContext<'a> {
    static NO_AGES: BTreeMap<ServiceKey, Timestamp> = BTreeMap::new();
    ModelContext {
        opts: inputs.model,
        since: match inputs.mode {
            AllocationMode::Allocate => inputs.since,
            AllocationMode::Annotated => &NO_AGES,
        },
        addresses: &inputs.host.addresses,
        policy: &inputs.policy.endpoints,
    }
}

impl Desired<(), ()> {
    fn with<R, I>(self, ruleset: R, counter_index: I) -> Desired<R, I> {
        Desired {
            ruleset,
            counter_index,
            allocations: self.allocations,
            services: self.services,
            needed_families: self.needed_families,
            refusals: self.refusals,
            alloc_problems: self.alloc_problems,
            refused_endpoints: self.refused_endpoints,
            refused_ports: self.refused_ports,
            warnings: self.warnings,
        }
    }
}

/// One Service's part of a sync's decision, everything but the ruleset. Kept for every Service
/// for as long as it exists, so sized for the usual one: a status line and what it asks for;
/// anything wrong with it boxed.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
struct Part {
    /// The valid Service's line, then one per refusal (a second object with its key), or the
    /// refusal's alone.
    statuses: Box<[Arc<ServiceStatus>]>,
    /// The families the valid Service asks for.
    families: FamilySet,
    faults: Option<Box<PartFaults>>,
}

impl Part {
    /// Whether the allocator left it unsettled: decided again every sync where the node
    /// allocates ([`AllocationBook`]).
    fn is_unsettled(&self) -> bool {
        self.faults.as_ref().is_some_and(|f| !f.refusals.is_empty() || !f.alloc_problems.is_empty())
    }
}

/// What is wrong with one Service, in the order the whole decision lists it.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
struct PartFaults {
    refusals: Vec<Refusal>,
    alloc_problems: Vec<AllocProblem>,
    refused_endpoints: Vec<RefusedEndpoint>,
    refused_ports: Vec<RefusedPort>,
    /// The model's warnings, as reported.
    warnings: Vec<String>,
}

/// A set of [`Family`] in a byte.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
struct FamilySet(u8);

impl FamilySet {
    fn bit(f: Family) -> u8 {
        match f {
            Family::Ipv4 => 1,
            Family::Ipv6 => 2,
        }
    }

    fn of(families: impl IntoIterator<Item = Family>) -> FamilySet {
        FamilySet(families.into_iter().map(FamilySet::bit).fold(0, |a, b| a | b))
    }

    fn contains(self, f: Family) -> bool {
        self.0 & FamilySet::bit(f) != 0
    }
}

/// A sync's decision by Service, before it is kept: each Service's part, allocation and
/// planner input, and the duplicates settled among them.
#[derive(Debug, Default)]
struct Decided {
    parts: BTreeMap<ServiceKey, Part>,
    allocations: Allocations,
    plans: Vec<PlanInput>,
    duplicates: Vec<Duplicate>,
}

impl Decided {
    fn part(&mut self, key: &ServiceKey) -> &mut Part {
        if !self.parts.contains_key(key) {
            self.parts.insert(key.clone(), Part::default());
        }
        self.parts.get_mut(key).expect("inserted")
    }

    fn faults(&mut self, key: &ServiceKey) -> &mut PartFaults {
        self.part(key).faults.get_or_insert_default()
    }
}

/// What the node decided, by Service: the last sync's parts, allocations and duplicates, and
/// what every Service's part read then. [`NodeBook::replace`] after a whole sync,
/// [`NodeBook::patch`] after a scoped one; [`NodeBook::desired`] gives the whole decision.
#[derive(Debug, Default)]
pub struct NodeBook {
    parts: BTreeMap<ServiceKey, Part>,
    /// Each Service's node ports; in manifests mode, where this node allocates, also who holds
    /// each number and which Services every sync decides again ([`AllocationBook`]).
    decided: AllocationBook,
    /// Sorted.
    duplicates: Vec<Duplicate>,
    /// How many valid Services ask for each family.
    families: BTreeMap<Family, usize>,
    /// The Services whose allocation is not what the sync was given as the last one: their pool
    /// is chosen again with it ([`Inputs::previous`]).
    moved: Vec<ServiceKey>,
    /// The notes of the Services served from a last good version, as the last sync read them.
    stale: BTreeMap<ServiceKey, String>,
    shared: Option<SharedInputs>,
    /// The node-port registry the last sync read (its blocks shared, not copied).
    registry: Option<Registry>,
}

/// The Services of `keys` whose part the allocator left unsettled.
fn unsettled<'a>(
    parts: &BTreeMap<ServiceKey, Part>,
    keys: impl Iterator<Item = &'a ServiceKey>,
) -> foldhash::HashSet<ServiceKey> {
    keys.filter(|k| parts.get(*k).is_some_and(Part::is_unsettled)).cloned().collect()
}

/// What every Service's part of a sync reads besides its own objects: a sync decides only a
/// scope when these are what the last one read.
#[derive(Debug, Clone, PartialEq)]
struct SharedInputs {
    mode: AllocationMode,
    refused: Vec<Refusal>,
    range: PortRange,
    model: ModelOptions,
    node: NodeFacts,
    policy: HostPolicy,
    host: HostFacts,
    pools: Option<PoolContext>,
}

impl SharedInputs {
    fn of<S, E>(inputs: &Inputs<'_, S, E>) -> SharedInputs {
        SharedInputs {
            mode: inputs.mode,
            refused: inputs.notes.refused.clone(),
            range: *inputs.range,
            model: inputs.model.clone(),
            node: inputs.node.clone(),
            policy: inputs.policy.clone(),
            host: inputs.host.clone(),
            pools: inputs.pools.cloned(),
        }
    }

    fn is<S, E>(&self, inputs: &Inputs<'_, S, E>) -> bool {
        self.mode == inputs.mode
            && self.refused == inputs.notes.refused
            && self.range == *inputs.range
            && self.model == *inputs.model
            && self.node == *inputs.node
            && self.policy == *inputs.policy
            && self.host == *inputs.host
            && self.pools.as_ref() == inputs.pools
    }
}

impl NodeBook {
    /// Whether what every Service's part reads is what the last whole sync read.
    fn same_shared<S, E>(&self, inputs: &Inputs<'_, S, E>) -> bool {
        self.shared.as_ref().is_some_and(|s| s.is(inputs))
    }

    /// After a whole sync: what every Service's part read, and the last-good notes.
    fn keep_read<S, E>(&mut self, inputs: &Inputs<'_, S, E>) {
        if !self.same_shared(inputs) {
            self.shared = Some(SharedInputs::of(inputs));
        }
        if self.stale != inputs.notes.stale {
            self.stale = inputs.notes.stale.clone();
        }
    }

    /// The Services a scoped sync decides: those whose objects came, went or changed
    /// (`changes`), those whose allocation moved in the last sync, those whose last-good note
    /// changed, and every Service whose allocation annotation names a number one of those names
    /// or named, or one whose registry owner changed (`recorded`), until no more come. A Service
    /// outside it reads what it read in the last sync, and no member shares a number with it:
    /// deciding it again would give what it has.
    fn scope(
        &mut self,
        view: &SourceView,
        changes: crate::incremental::view::ViewChanges,
        aged: Vec<ServiceKey>,
        recorded: Vec<u16>,
        inputs: &Inputs<'_, Arc<Service>, Arc<EndpointSlice>>,
    ) -> foldhash::HashSet<ServiceKey> {
        let mut todo: Vec<ServiceKey> = changes.keys.into_iter().collect();
        // A Service that moved is decided again for its pool, chosen with the numbers it held in
        // the last sync. Manifests mode with no pool object: nothing but the allocator reads
        // them, and it keeps a number the Service was given over one nobody held (what
        // exists wins, and nobody held it): deciding it again would give what it has (after
        // the start, that would be every Service at the first change).
        let pools = inputs.pools.is_some_and(|c| !c.set.implicit);
        match (inputs.mode, pools) {
            (AllocationMode::Allocate, false) => self.moved.clear(),
            _ => todo.append(&mut self.moved),
        }
        todo.extend(aged);
        let notes = &inputs.notes.stale;
        if *notes != self.stale {
            let differs = |a: &BTreeMap<ServiceKey, String>, b: &BTreeMap<ServiceKey, String>| {
                a.iter().filter(|(k, v)| b.get(*k) != Some(*v)).map(|(k, _)| k.clone()).collect::<Vec<_>>()
            };
            todo.extend(differs(notes, &self.stale));
            todo.extend(differs(&self.stale, notes));
            self.stale = notes.clone();
        }
        let numbers = changes.numbers.into_iter().chain(recorded);
        self.decided.closure(todo, numbers, |k| view.numbers_of(k), |n| view.holders_of(n))
    }

    /// Keeps a whole sync's decision; returns every Service's planner input. `previous`: the
    /// allocations the sync was given, to find those that moved.
    fn replace(&mut self, decided: Decided, mode: AllocationMode, previous: &Allocations) -> Vec<PlanInput> {
        let Decided { parts, allocations, plans, duplicates } = decided;
        self.moved = moved(previous, &allocations, allocations.keys().chain(previous.keys()));
        let unsettled = match mode {
            AllocationMode::Allocate => Some(unsettled(&parts, parts.keys())),
            AllocationMode::Annotated => None,
        };
        self.families.clear();
        for part in parts.values() {
            count_families(&mut self.families, part.families, 1);
        }
        self.decided.replace(allocations, unsettled);
        self.parts = parts;
        self.duplicates = duplicates;
        plans
    }

    /// Keeps a scoped sync's decision for the Services of `scope` (`decided` holds theirs);
    /// returns their planner inputs (`None`: no longer planned).
    fn patch(
        &mut self,
        scope: &foldhash::HashSet<ServiceKey>,
        decided: Decided,
        previous: &Allocations,
    ) -> Vec<(ServiceKey, Option<PlanInput>)> {
        let Decided { mut parts, allocations, plans, duplicates } = decided;
        let mut by_key: BTreeMap<ServiceKey, Option<PlanInput>> =
            scope.iter().map(|k| (k.clone(), None)).collect();
        for plan in plans {
            by_key.insert(plan.service.key.clone(), Some(plan));
        }
        self.moved = moved(previous, &allocations, scope.iter());
        for key in scope {
            if let Some(old) = self.parts.remove(key) {
                count_families(&mut self.families, old.families, -1);
            }
            if let Some(part) = parts.remove(key) {
                count_families(&mut self.families, part.families, 1);
                self.parts.insert(key.clone(), part);
            }
        }
        let unsettled = unsettled(&self.parts, scope.iter());
        self.decided.patch(scope, allocations, unsettled);
        // A duplicate names two Services that share a number: both in the scope, or neither.
        self.duplicates.retain(|d| !scope.contains(&d.keeper) && !scope.contains(&d.loser));
        self.duplicates.extend(duplicates);
        self.duplicates.sort();
        by_key.into_iter().collect()
    }

    /// The whole decision (but the ruleset), from every Service's kept part.
    fn desired(&self) -> Desired<(), ()> {
        let mut d = Desired {
            ruleset: (),
            counter_index: (),
            allocations: self.decided.allocations().clone(),
            services: Vec::with_capacity(self.parts.len()),
            needed_families: self.families.keys().copied().collect(),
            refusals: vec![],
            alloc_problems: vec![],
            refused_endpoints: vec![],
            refused_ports: vec![],
            warnings: vec![],
        };
        for part in self.parts.values() {
            d.services.extend(part.statuses.iter().cloned());
            if let Some(f) = &part.faults {
                d.refusals.extend(f.refusals.iter().cloned());
                d.alloc_problems.extend(f.alloc_problems.iter().cloned());
                d.refused_endpoints.extend(f.refused_endpoints.iter().cloned());
                d.refused_ports.extend(f.refused_ports.iter().cloned());
                d.warnings.extend(f.warnings.iter().cloned());
            }
        }
        d.warnings.extend(self.duplicates.iter().map(|d| format!("duplicate {d}")));
        d
    }

    /// How many Services' parts are kept.
    pub fn len(&self) -> usize {
        self.parts.len()
    }

    pub fn is_empty(&self) -> bool {
        self.parts.is_empty()
    }
}

/// The Services among `keys` whose allocation in `now` is not the one in `previous`.
fn moved<'a>(
    previous: &Allocations,
    now: &Allocations,
    keys: impl Iterator<Item = &'a ServiceKey>,
) -> Vec<ServiceKey> {
    let mut out: Vec<ServiceKey> = keys.filter(|k| previous.get(*k) != now.get(*k)).cloned().collect();
    out.sort();
    out.dedup();
    out
}

fn count_families(counts: &mut BTreeMap<Family, usize>, families: FamilySet, by: isize) {
    for f in Family::ALL.into_iter().filter(|f| families.contains(*f)) {
        let n = counts.entry(f).or_default();
        *n = n.saturating_add_signed(by);
        if *n == 0 {
            counts.remove(&f);
        }
    }
}

/// Every Service's part of the decision (everything but the ruleset) and what the planner
/// needs: each valid Service with the node ports this node programs for it. `services`: the
/// objects decided (the snapshot's, or a scope's), modeled in `out`; `elsewhere` (manifests
/// mode, a scope): the numbers the Services outside it hold, which they keep.
fn decide<S: Borrow<Service>, E: Borrow<EndpointSlice>>(
    inputs: &Inputs<'_, S, E>,
    services: &[S],
    mut out: Modeled,
    elsewhere: Option<alloc::Elsewhere<'_>>,
) -> Decided {
    out.refused.extend(
        inputs.notes.refused.iter().filter(|r| !out.services.iter().any(|s| &s.key == r.service())).cloned(),
    );
    let refused_endpoints = std::mem::take(&mut out.refused_endpoints);
    let pools = inputs.pools.filter(|c| !c.set.implicit);
    let assignment =
        pools.map(|c| crate::decisions::pool::assign_services(c, services, &out.services, inputs.previous));
    let mut not_recorded = Vec::new();
    // Whether some number is held by several Services (of pools apart): then this node keeps
    // one per number (below).
    let shared = std::cell::Cell::new(false);
    let (allocations, alloc_problems, duplicates) = match inputs.mode {
        AllocationMode::Allocate => {
            let in_use: BTreeMap<(crate::domain::Protocol, u16), String> = inputs
                .host
                .listeners
                .iter()
                .map(|l| ((l.protocol, l.port), format!("{l} on this node")))
                .collect();
            let sharing = pools.zip(assignment.as_ref()).and_then(|(c, a)| {
                let mut sharing = c.set.sharing().filter(|s| !s.is_empty())?;
                share_services(&mut sharing, a, &out.services, None);
                Some(sharing)
            });
            shared.set(sharing.is_some());
            let constraints = alloc::Constraints {
                policy: Some(&inputs.policy.ports),
                in_use: Some(&in_use),
                pools: assignment.as_ref().map(|a| &a.ranges),
                elsewhere,
                sharing: sharing.as_ref(),
            };
            // A Service no pool serves is not allocated (it says why instead).
            let pooled: Vec<&LbService> = match &assignment {
                Some(a) => out.services.iter().map(|s| &**s).filter(|s| a.has_pool(&s.key)).collect(),
                None => out.services.iter().map(|s| &**s).collect(),
            };
            let result = alloc::allocate_with(inputs.range, &pooled, inputs.previous, constraints);
            let mut allocations = result.allocations;
            keep_refused_allocations(&mut allocations, inputs.previous, &out.refused);
            let mut problems = result.problems;
            problems.extend(assignment.iter().flat_map(|a| a.problems.iter().cloned()));
            (allocations, problems, vec![])
        }
        AllocationMode::Annotated => {
            let (allocations, duplicates) = match inputs.registry {
                Some(registry) => {
                    let recorded = recorded(&out.services, registry, &mut not_recorded);
                    // A number the registry gives to several Services stays each one's.
                    let together = |n: u16, _: &ServiceKey, _: &ServiceKey| {
                        let together = registry.get(n).is_some_and(Holds::is_shared);
                        shared.set(shared.get() || together);
                        together
                    };
                    crate::k8s::dupes::settle(&recorded, Some(&together))
                }
                None => crate::k8s::dupes::settle(&out.services, None),
            };
            (allocations, vec![], duplicates)
        }
    };
    // In Kubernetes mode the leader says why on the Service (its Allocated condition).
    let leader_says: BTreeMap<ServiceKey, String> = match inputs.mode {
        AllocationMode::Allocate => BTreeMap::new(),
        AllocationMode::Annotated => services.iter().filter_map(|s| allocation_refused(s.borrow())).collect(),
    };
    let no_allocation = |key: &ServiceKey| match inputs.mode {
        AllocationMode::Allocate => "no node port could be allocated".to_string(),
        AllocationMode::Annotated => match leader_says.get(key) {
            Some(why) => format!("no node port: {why}"),
            None => format!(
                "no node port on the Service yet ({} is written by the leader)",
                model::ANNOTATION_ALLOCATED
            ),
        },
    };

    // Whatever the allocation says, this node never takes a port it may not (not allowed, or a
    // process here listens on it): the allocation stays, the port is not programmed here.
    let mut refused_ports = not_recorded;
    let mut programmed = allocations.clone();
    let mut restricted: BTreeMap<ServiceKey, BTreeSet<std::net::IpAddr>> = BTreeMap::new();
    let servicelb = inputs.pools.map(|c| servicelb_refusals(c, services)).unwrap_or_default();
    for (key, ports) in programmed.iter_mut() {
        let pool_policy = match (servicelb.get(key), pools, &assignment) {
            (Some(why), _, _) => Some(Err(PortRefusal::NotSelected(format!("ServiceLB labels: {why}")))),
            (None, Some(ctx), Some(a)) => {
                let own = &inputs.host.addresses.own;
                Some(pool_node_policy(ctx, a, key, own).map(|(policy, addresses)| {
                    if let Some(addresses) = addresses {
                        restricted.insert(key.clone(), addresses);
                    }
                    policy
                }))
            }
            _ => None,
        };
        // Served on some node addresses only (a pool's): a listener elsewhere does not clash.
        let served_on = restricted.get(key);
        ports.retain(|id, node_port| {
            let listeners = &inputs.host.listeners;
            let checked = match &pool_policy {
                Some(Err(not_here)) => Err(not_here.clone()),
                Some(Ok(policy)) => {
                    port_policy::node_check(*node_port, id.protocol, policy, listeners, served_on)
                }
                None => {
                    port_policy::node_check(*node_port, id.protocol, &inputs.policy.ports, listeners, None)
                }
            };
            match checked {
                Ok(()) => true,
                Err(reason) => {
                    let r = RefusedPort { service: key.clone(), port: *id, node_port: *node_port, reason };
                    refused_ports.push(r);
                    false
                }
            }
        });
    }

    if shared.get() {
        // Of the holders this node would serve a number for, the one whose pool is the one the
        // registry recorded for it, then the first the registry names (manifests mode: by
        // namespace/name).
        let rank = |n: u16, key: &ServiceKey| -> (bool, usize) {
            let uid = out.services.iter().find(|s| &s.key == key).and_then(|s| s.uid.as_deref());
            let owner = Owner::of(key, uid);
            let pool = assignment.as_ref().and_then(|a| a.ranges.get(key)).map(|r| r.pool.as_str());
            let claims = inputs.registry.and_then(|r| r.get(n)).into_iter().flat_map(|h| h.iter());
            sharing::rank(claims.map(|c| (&c.owner, c.pool.as_deref())), &owner, pool)
        };
        // Served on disjoint addresses of this node (pools apart by address): both.
        let coexist = |a: &ServiceKey, b: &ServiceKey| match (restricted.get(a), restricted.get(b)) {
            (Some(x), Some(y)) => x.is_disjoint(y),
            _ => false,
        };
        for (service, port, node_port) in sharing::one_per_number(&mut programmed, rank, coexist) {
            refused_ports.push(RefusedPort { service, port, node_port, reason: PortRefusal::Shared });
        }
    }

    let empty = BTreeMap::new();
    // Each Service's faults, looked up once each (not a scan of every fault per Service).
    let refused_by = by_service(&refused_endpoints, |r| &r.service);
    let not_taken_by = by_service(&refused_ports, |r| &r.service);
    let problems_by = by_service(&alloc_problems, AllocProblem::service);
    let none = (Vec::new(), Vec::new(), Vec::new());
    let mut decided = Decided::default();
    for s in &out.services {
        let ports = allocations.get(&s.key).unwrap_or(&empty);
        let refused = refused_by.get(&s.key).unwrap_or(&none.0);
        let not_taken = not_taken_by.get(&s.key).unwrap_or(&none.1);
        let problems = problems_by.get(&s.key).unwrap_or(&none.2);
        let fault = Faults { problems, endpoints: refused, ports: not_taken };
        let mut status = service_status(s, ports, &fault, inputs.node, || no_allocation(&s.key));
        status.pool = assignment.as_ref().and_then(|a| a.ranges.get(&s.key)).map(|r| r.pool.clone());
        if let Some(note) = inputs.notes.stale.get(&s.key) {
            status.reason = Some(match status.reason.take() {
                Some(r) => format!("{r}; {note}"),
                None => note.clone(),
            });
            status.reason_code.get_or_insert_with(|| "last_good_spec".to_string());
        }
        let part = decided.part(&s.key);
        part.statuses = Box::new([Arc::new(status)]);
        part.families = FamilySet::of(s.families.iter().copied());
    }
    for r in &out.refused {
        let status = ServiceStatus {
            namespace: r.service().namespace.clone(),
            name: r.service().name.clone(),
            state: ServiceState::Refused,
            reason_code: Some(r.code().to_string()),
            reason: Some(r.to_string()),
            ports: vec![],
            refused_endpoints: vec![],
            session_affinity_seconds: None,
            pool: None,
        };
        let part = decided.part(r.service());
        part.statuses = part.statuses.iter().cloned().chain([Arc::new(status)]).collect();
        decided.faults(r.service()).refusals.push(r.clone());
    }
    for p in alloc_problems {
        decided.faults(p.service()).alloc_problems.push(p);
    }
    for r in refused_endpoints {
        decided.faults(&r.service.clone()).refused_endpoints.push(r);
    }
    for r in refused_ports {
        decided.faults(&r.service.clone()).refused_ports.push(r);
    }
    for w in &out.warnings {
        decided.faults(&w.service).warnings.push(w.to_string());
    }
    decided.plans = out
        .services
        .into_iter()
        .map(|service| PlanInput {
            node_ports: programmed.remove(&service.key).unwrap_or_default(),
            addresses: restricted.remove(&service.key),
            service,
        })
        .collect();
    decided.allocations = allocations;
    decided.duplicates = duplicates;
    decided
}

/// `services` with each annotated number the registry does not give to that Service taken off
/// (a copy of only those models), each such port pushed to `refused` ([`PortRefusal::NotRecorded`]).
fn recorded(
    services: &[Arc<LbService>],
    registry: &Registry,
    refused: &mut Vec<RefusedPort>,
) -> Vec<Arc<LbService>> {
    services
        .iter()
        .map(|s| {
            let owner = Owner::of(&s.key, s.uid.as_deref());
            let ours = |n: u16| registry.holds(n, &owner);
            if s.previous_allocation.values().all(|n| ours(*n)) {
                return Arc::clone(s);
            }
            let mut copy = LbService::clone(s);
            copy.previous_allocation.retain(|port, n| {
                if ours(*n) {
                    return true;
                }
                let another = registry.claimed(*n);
                let reason = PortRefusal::NotRecorded { another };
                refused.push(RefusedPort { service: s.key.clone(), port: *port, node_port: *n, reason });
                false
            });
            Arc::new(copy)
        })
        .collect()
}

/// Records in `sharing` each of `services` whose pool (`assignment`) is apart from another,
/// with its pool, and each number the registry gives it beside other Services.
pub fn share_services(
    sharing: &mut Sharing,
    assignment: &crate::decisions::pool::Assignment,
    services: &[Arc<LbService>],
    registry: Option<&Registry>,
) {
    for s in services {
        let owner = Owner::of(&s.key, s.uid.as_deref());
        for n in s.previous_allocation.values() {
            let shared = registry.and_then(|r| r.get(*n)).filter(|h| h.is_shared());
            if shared.is_some_and(|h| h.of(&owner).is_some()) {
                sharing.record(*n, &s.key);
            }
        }
        if let Some(pool) = assignment.ranges.get(&s.key).filter(|p| sharing.shares(&p.pool)) {
            sharing.serve(&s.key, owner, &pool.pool);
        }
    }
}

/// The port policy of a Service's pool on this node (its ranges, plus its `requestablePorts`) and,
/// when the pool restricts node addresses, the addresses of this node that serve it; or why this
/// node does not serve it at all (its pool does not select this node or any of its addresses, or
/// no pool serves it).
fn pool_node_policy(
    ctx: &PoolContext,
    assignment: &crate::decisions::pool::Assignment,
    key: &ServiceKey,
    own: &crate::decisions::pool::NodeAddresses,
) -> Result<(PortPolicy, Option<BTreeSet<std::net::IpAddr>>), PortRefusal> {
    let Some(ranges) = assignment.ranges.get(key) else {
        let why = assignment.problems.iter().find(|p| p.service() == key).map(|p| p.to_string());
        return Err(PortRefusal::NotSelected(why.unwrap_or_else(|| "no node port pool serves it".into())));
    };
    let Some(pool) = ctx.set.get(&ranges.pool) else {
        return Err(PortRefusal::NotSelected(format!("pool {} is gone", ranges.pool)));
    };
    if !pool.pool.nodes.matches(&ctx.node_labels) {
        return Err(PortRefusal::NotSelected(format!(
            "pool {} does not select this node (nodeSelector)",
            ranges.pool
        )));
    }
    let addresses = (!pool.pool.addresses.is_everything()).then(|| pool.pool.addresses.select(own));
    if addresses.as_ref().is_some_and(|a| a.is_empty()) {
        return Err(PortRefusal::NotSelected(format!(
            "pool {} selects no address of this node (addresses: {})",
            ranges.pool,
            pool.pool.addresses.describe()
        )));
    }
    Ok((PortPolicy { ranges: ranges.keep.clone(), allowed: ranges.requestable.clone() }, addresses))
}

/// The Services this node does not serve under the k3s ServiceLB labels (when in force), and why.
fn servicelb_refusals<S: Borrow<Service>>(ctx: &PoolContext, services: &[S]) -> BTreeMap<ServiceKey, String> {
    if !ctx.servicelb {
        return BTreeMap::new();
    }
    let empty = BTreeMap::new();
    services
        .iter()
        .map(|s| s.borrow())
        .filter_map(|s| {
            let labels = s.metadata.labels.as_ref().unwrap_or(&empty);
            let why = crate::decisions::servicelb::serves(&ctx.node_labels, labels).err()?;
            Some((model::service_key(s), why.to_string()))
        })
        .collect()
}

/// A Service refused for bad input keeps its ports (when nobody else took them meanwhile), so
/// fixing the input brings it back on the same ports instead of new ones. In a scoped sync the
/// refused Services are in the scope (unsettled: [`AllocationBook`]), and their numbers were theirs
/// alone in the last sync: only the scope can have taken one since.
fn keep_refused_allocations(allocations: &mut Allocations, previous: &Allocations, refused: &[Refusal]) {
    let used: BTreeSet<u16> = allocations.values().flat_map(|p| p.values().copied()).collect();
    let refused_keys: BTreeSet<&ServiceKey> = refused.iter().map(|r| r.service()).collect();
    for key in refused_keys {
        if allocations.contains_key(key) {
            continue;
        }
        if let Some(ports) = previous.get(key)
            && ports.values().all(|p| !used.contains(p))
        {
            allocations.insert(key.clone(), ports.clone());
        }
    }
}

/// `items` grouped by the Service they are about.
fn by_service<T>(items: &[T], key: impl Fn(&T) -> &ServiceKey) -> BTreeMap<&ServiceKey, Vec<&T>> {
    let mut map: BTreeMap<&ServiceKey, Vec<&T>> = BTreeMap::new();
    for item in items {
        map.entry(key(item)).or_default().push(item);
    }
    map
}

/// How many problems a status line spells out; the others are counted (a Service with thousands
/// of ports in an exhausted range can have thousands of them).
const MAX_LISTED: usize = 5;

/// The first [`MAX_LISTED`] of `items`, `; `-separated, and how many more there are.
fn listed(items: impl ExactSizeIterator<Item = String>) -> String {
    let total = items.len();
    let mut out: Vec<String> = items.take(MAX_LISTED).collect();
    if total > MAX_LISTED {
        out.push(format!("and {} more", total - MAX_LISTED));
    }
    out.join("; ")
}

/// What is wrong with one Service on this node, for its status line.
struct Faults<'a> {
    /// Its allocation problems.
    problems: &'a [&'a AllocProblem],
    /// Its refused endpoint addresses.
    endpoints: &'a [&'a RefusedEndpoint],
    /// Its node ports not taken on this node.
    ports: &'a [&'a RefusedPort],
}

/// One status line: the state of the Service on this node and, whenever it is not simply
/// programmed with ready endpoints, the reason in words (`nodelb status` prints one line per
/// Service, so the reason must be on it, not elsewhere).
fn service_status(
    svc: &LbService,
    node_ports: &BTreeMap<PortId, u16>,
    fault: &Faults<'_>,
    node: &NodeFacts,
    no_allocation: impl FnOnce() -> String,
) -> ServiceStatus {
    let refused_endpoints = fault.endpoints;
    // Kept (in /status) until the next sync: no spare capacity.
    let mut ports = Vec::with_capacity(svc.ports.len());
    let mut any_endpoints = false;
    let mut any_allocated = false;
    // Ports served only by terminating endpoints (no ready one: graceful termination).
    let mut terminating = Vec::new();
    let own = fault.problems;
    let own_by_port: BTreeMap<PortId, &AllocProblem> = own.iter().rev().map(|p| (p.port(), *p)).collect();
    let not_taken_by_port: BTreeMap<PortId, &RefusedPort> =
        fault.ports.iter().rev().map(|r| (r.port, *r)).collect();
    for port in &svc.ports {
        let node_port = node_ports.get(&port.id).copied();
        let not_taken = not_taken_by_port.get(&port.id);
        let programmed = node_port.is_some() && not_taken.is_none();
        any_allocated |= programmed;
        let usable: Vec<&model::Endpoint> = svc
            .families
            .iter()
            .filter(|f| node.families.contains(f))
            .flat_map(|&f| plan::usable_endpoints(svc, port, f, &node.node_name))
            .collect();
        let endpoints = usable.len();
        any_endpoints |= endpoints > 0 && programmed;
        if programmed && endpoints > 0 && usable.iter().all(|e| !e.ready) {
            terminating.push(format!("{} ({endpoints})", port.id));
        }
        let (problem, problem_code) = match (own_by_port.get(&port.id), not_taken) {
            (Some(p), _) => (Some(p.to_string()), Some(p.code())),
            (None, Some(r)) => (Some(r.to_string()), Some(r.reason.code())),
            (None, None) => (None, None),
        };
        ports.push(PortStatus {
            port: port.id.port,
            protocol: port.id.protocol.k8s_name().to_string(),
            node_port,
            endpoints,
            problem,
            problem_code: problem_code.map(String::from),
            connections: None,
            refused_packets: None,
        });
    }
    let port_problems = || listed(own.iter().map(|p| p.to_string()));
    let problem_code = || own.first().map_or("no_allocation", |p| p.code());
    let not_taken = || listed(fault.ports.iter().map(|r| r.to_string()));
    let endpoints_refused = || format!("endpoints refused: {}", endpoint_policy::describe(refused_endpoints));
    let served: Vec<Family> = svc.families.iter().copied().filter(|f| node.families.contains(f)).collect();
    let (state, reason_code, reason) = if !any_allocated && !fault.ports.is_empty() {
        (ServiceState::Refused, Some("node_port_refused"), Some(not_taken()))
    } else if !any_allocated {
        let reason = if own.is_empty() { no_allocation() } else { port_problems() };
        (ServiceState::Refused, Some(problem_code()), Some(reason))
    } else if served.is_empty() {
        let fams: Vec<&str> = svc.families.iter().map(|f| f.name()).collect();
        let reason = format!("forwarding is off on this node for its families ({})", fams.join(", "));
        (ServiceState::Refused, Some("forwarding_off"), Some(reason))
    } else if !any_endpoints
        && !refused_endpoints.is_empty()
        && svc.ports.iter().all(|p| p.endpoints.is_empty())
    {
        // Every endpoint it names is refused: clients are refused at once, and this says why.
        let reason = format!(
            "no usable endpoint: every endpoint refused: {}",
            endpoint_policy::describe(refused_endpoints)
        );
        (ServiceState::NoEndpoints, Some("endpoints_refused"), Some(reason))
    } else if !any_endpoints {
        let mut reason = "no ready endpoint usable on this node".to_string();
        if !refused_endpoints.is_empty() {
            reason += &format!("; {}", endpoints_refused());
        }
        (ServiceState::NoEndpoints, Some("no_endpoints"), Some(reason))
    } else {
        // Served; whatever is not plain goes on the line: ports without a node port, node ports
        // not taken here, refused endpoints, a terminating-endpoint fallback.
        let mut notes = Vec::new();
        let mut code = None;
        if !own.is_empty() {
            notes.push(port_problems());
            code = Some(problem_code());
        }
        if !fault.ports.is_empty() {
            notes.push(not_taken());
            code = code.or(Some("node_port_refused"));
        }
        if !refused_endpoints.is_empty() {
            notes.push(endpoints_refused());
            code = code.or(Some("endpoints_refused"));
        }
        if !terminating.is_empty() {
            notes.push(format!(
                "no ready endpoint: serving its terminating endpoints (graceful termination) on {}",
                listed(terminating.into_iter())
            ));
            code = code.or(Some("terminating_endpoints"));
        }
        (ServiceState::Programmed, code, (!notes.is_empty()).then(|| notes.join("; ")))
    };
    ServiceStatus {
        namespace: svc.key.namespace.clone(),
        name: svc.key.name.clone(),
        state,
        reason_code: reason_code.map(String::from),
        reason,
        ports,
        refused_endpoints: refused_endpoints
            .iter()
            .map(|r| EndpointRefusalStatus {
                address: r.address.to_string(),
                reason_code: r.reason.code().to_string(),
                reason: r.reason.to_string(),
            })
            .collect(),
        session_affinity_seconds: svc.session_affinity,
        pool: None,
    }
}

/// `reason: message` of a Service's `nodelb.io/Allocated` condition when the leader could not
/// allocate (Kubernetes mode): what a node's status line says for a Service it does not program.
fn allocation_refused(svc: &Service) -> Option<(ServiceKey, String)> {
    let c = model::refused_allocation(svc)?;
    Some((model::service_key(svc), format!("{}: {}", c.reason, c.message)))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// [`compute`] on node-1 (IPv4) with the range 20000-20010 and default policies.
    fn compute_on(mode: AllocationMode, services: &[Service], pools: Option<&PoolContext>) -> Desired {
        compute_recorded(mode, services, pools, None)
    }

    fn compute_recorded(
        mode: AllocationMode,
        services: &[Service],
        pools: Option<&PoolContext>,
        registry: Option<&Registry>,
    ) -> Desired {
        let node = NodeFacts {
            node_name: "node-1".into(),
            families: [Family::Ipv4].into(),
            masquerade_mark: plan::DEFAULT_MASQUERADE_MARK,
            connection_mark: plan::DEFAULT_CONNECTION_MARK,
            forward_mark: None,
            nat_shards: 1,
        };
        compute_whole(
            &Inputs {
                mode,
                services,
                slices: model::NO_SLICES,
                notes: &SourceNotes::default(),
                previous: &Allocations::new(),
                since: &BTreeMap::new(),
                policy: &HostPolicy::default(),
                host: &HostFacts::default(),
                range: &PortRange::new(20000, 20010).expect("range"),
                model: &ModelOptions::default(),
                node: &node,
                pools,
                registry,
            },
            true,
        )
    }

    /// A node's status line for a Service the leader could not allocate repeats the leader's
    /// reason (the `nodelb.io/Allocated` condition), not a bare "no node port".
    #[test]
    fn a_node_tells_why_the_leader_allocated_nothing() {
        let svc: Service = serde_json::from_value(serde_json::json!({
            "metadata": {"name": "young", "namespace": "default"},
            "spec": {"type": "LoadBalancer", "ports": [{"port": 80}]},
            "status": {"conditions": [
                {"type": "nodelb.io/Serving", "status": "False", "reason": "NotAllocated", "message": "x",
                 "lastTransitionTime": "2024-01-01T00:00:00Z"},
                {"type": model::CONDITION_ALLOCATED, "status": "False", "reason": "PortConflict",
                 "message": "port 80/TCP asks for node port 20080, which Service default/old holds",
                 "lastTransitionTime": "2024-01-01T00:00:00Z"}]}
        }))
        .expect("service");
        let desired = compute_on(AllocationMode::Annotated, &[svc], None);
        let line = &desired.services[0];
        assert_eq!(line.state, ServiceState::Refused);
        assert_eq!(
            line.reason.as_deref(),
            Some(
                "no node port: PortConflict: port 80/TCP asks for node port 20080, which Service default/old holds"
            )
        );
    }

    /// A node programs an annotated number only for the Service the node-port registry gives it
    /// to: an annotation naming another Service's number (a forgery, older or younger than the
    /// holder) or one no claim names yet is refused on this node, named with its reason, and
    /// the holder keeps serving.
    #[test]
    fn a_node_programs_a_number_only_for_the_service_the_registry_names() {
        use crate::k8s::claims::Claim;
        let svc = |name: &str, uid: &str, created: &str, allocated: &str| -> Service {
            serde_json::from_value(serde_json::json!({
                "metadata": {"name": name, "namespace": name, "uid": uid, "creationTimestamp": created,
                             "annotations": {model::ANNOTATION_ALLOCATED: allocated}},
                "spec": {"type": "LoadBalancer", "ports": [{"port": 80}]}
            }))
            .expect("service")
        };
        let holder = svc("holder", "aaaaaaaa-0000", "2024-01-02T00:00:00Z", "80/TCP=20001");
        let older = svc("older", "bbbbbbbb-0000", "2024-01-01T00:00:00Z", "80/TCP=20001");
        let younger = svc("younger", "cccccccc-0000", "2024-01-03T00:00:00Z", "80/TCP=20001");
        let unclaimed = svc("unclaimed", "dddddddd-0000", "2024-01-03T00:00:00Z", "80/TCP=20002");
        let mut registry = Registry::default();
        Arc::make_mut(&mut registry.blocks.entry(2).or_default().claims)
            .insert(20001, Claim::held(Owner::of_uid("aaaaaaaa-0000")).into());
        let services = [older, holder, younger, unclaimed];
        let desired = compute_recorded(AllocationMode::Annotated, &services, None, Some(&registry));
        let programmed: Vec<String> = desired.allocations.keys().map(|k| k.to_string()).collect();
        assert_eq!(programmed, ["holder/holder"]);
        let refused: Vec<(String, u16, &str)> = (desired.refused_ports.iter())
            .map(|r| (r.service.to_string(), r.node_port, r.reason.code()))
            .collect();
        assert_eq!(
            refused,
            [
                ("older/older".to_string(), 20001, "not_recorded"),
                ("unclaimed/unclaimed".to_string(), 20002, "not_recorded"),
                ("younger/younger".to_string(), 20001, "not_recorded"),
            ]
        );
        assert!(desired.warnings.is_empty(), "no duplicate is left to settle: {:?}", desired.warnings);
        let line = |name: &str| desired.services.iter().find(|s| s.name == name).expect("a line");
        assert_eq!(line("holder").state, ServiceState::NoEndpoints, "programmed, with no endpoint");
        let forged = line("older");
        assert_eq!(forged.state, ServiceState::Refused);
        let reason = forged.reason.as_deref().unwrap_or_default();
        assert!(reason.contains("gives it to another Service") && !reason.contains("holder"), "{reason}");
        assert!(
            line("unclaimed").reason.as_deref().unwrap_or_default().contains("not in the node-port registry")
        );
    }

    /// Two Services hold 443 together (the registry says so), one of the edge pool, one of the
    /// internal pool: a node serves the one whose pool selects it. Where both pools select it
    /// (the internal pool edited to select every node), the holder whose pool is the one the
    /// registry recorded, then the first recorded, keeps it; the other is refused here.
    #[test]
    fn a_number_two_pools_share_is_served_by_each_on_its_own_nodes() {
        use crate::k8s::claims::Claim;
        let svc = |name: &str, uid: &str| -> Service {
            serde_json::from_value(serde_json::json!({
                "metadata": {"name": name, "namespace": "ingress", "uid": uid,
                             "creationTimestamp": "2024-01-01T00:00:00Z",
                             "annotations": {model::ANNOTATION_ALLOCATED: "443/TCP=443", "nodelb.io/pool": name}},
                "spec": {"type": "LoadBalancer", "ports": [{"port": 443}]}
            }))
            .expect("service")
        };
        let services = [svc("edge", "aaaaaaaa-0000"), svc("internal", "bbbbbbbb-0000")];
        let pool = |name: &str, tier: Option<&str>| {
            let mut spec =
                serde_json::json!({"portMode": "ServicePort", "ports": [{"start": 443, "end": 443}]});
            if let Some(tier) = tier {
                spec["nodeSelector"] = serde_json::json!({"matchLabels": {"tier": tier}});
            }
            let spec = serde_json::from_value(spec).expect("spec");
            crate::decisions::pool::validate(name, None, None, &spec).expect("valid")
        };
        let on = |c: Claim, pool: &str| Claim { pool: Some(pool.into()), ..c };
        let mut registry = Registry::default();
        let mut shared: Holds = on(Claim::held(Owner::of_uid("aaaaaaaa-0000")), "edge").into();
        shared.put(on(Claim::held(Owner::of_uid("bbbbbbbb-0000")), "internal"));
        Arc::make_mut(&mut registry.blocks.entry(0).or_default().claims).insert(443, shared);
        let range = PortRange::new(20000, 20010).expect("range");
        let run = |tier: &str, internal_everywhere: bool| {
            let internal = pool("internal", (!internal_everywhere).then_some("internal"));
            let ctx = PoolContext {
                set: crate::decisions::pool::PoolSet::resolve(
                    vec![pool("edge", Some("edge")), internal],
                    true,
                    range,
                    &[],
                ),
                namespaces: BTreeMap::new(),
                node_labels: [("tier".to_string(), tier.to_string())].into(),
                servicelb: false,
            };
            let d = compute_recorded(AllocationMode::Annotated, &services, Some(&ctx), Some(&registry));
            assert!(d.warnings.is_empty(), "no duplicate: {:?}", d.warnings);
            let programmed: Vec<String> = (d.services.iter())
                .flat_map(|s| s.ports.iter().map(move |p| (s, p)))
                .filter(|(_, p)| p.problem.is_none())
                .map(|(s, p)| format!("{}/{}={}", s.namespace, s.name, p.node_port.unwrap_or_default()))
                .collect();
            let refused: Vec<String> = d
                .refused_ports
                .iter()
                .map(|r| format!("{}={} {}", r.service, r.node_port, r.reason.code()))
                .collect();
            (programmed, refused)
        };
        assert_eq!(
            run("edge", false),
            (vec!["ingress/edge=443".into()], vec!["ingress/internal=443 not_selected".into()])
        );
        assert_eq!(
            run("internal", false),
            (vec!["ingress/internal=443".into()], vec!["ingress/edge=443 not_selected".into()])
        );
        assert_eq!(
            run("edge", true),
            (vec!["ingress/edge=443".into()], vec!["ingress/internal=443 number_shared".into()]),
            "the pools meet on this node"
        );
    }

    /// Manifests mode, the same pools: both Services are allocated 443, and this node serves the
    /// one whose pool selects it; a third pool that may meet either gets none.
    #[test]
    fn manifests_mode_shares_a_number_between_pools_apart() {
        let svc = |name: &str| -> Service {
            serde_json::from_value(serde_json::json!({
                "metadata": {"name": name, "namespace": "ingress", "annotations": {"nodelb.io/pool": name}},
                "spec": {"type": "LoadBalancer", "ports": [{"port": 443}]}
            }))
            .expect("service")
        };
        let pool = |name: &str, labels: serde_json::Value| {
            let spec = serde_json::json!({"portMode": "ServicePort", "ports": [{"start": 443, "end": 443}],
                                          "nodeSelector": {"matchLabels": labels}});
            let spec = serde_json::from_value(spec).expect("spec");
            crate::decisions::pool::validate(name, None, None, &spec).expect("valid")
        };
        let pools = vec![
            pool("edge", serde_json::json!({"tier": "edge"})),
            pool("internal", serde_json::json!({"tier": "internal"})),
            pool("gpu", serde_json::json!({"gpu": "yes"})),
        ];
        let range = PortRange::new(20000, 20010).expect("range");
        let ctx = PoolContext {
            set: crate::decisions::pool::PoolSet::resolve(pools, true, range, &[]),
            namespaces: BTreeMap::new(),
            node_labels: [("tier".to_string(), "internal".to_string())].into(),
            servicelb: false,
        };
        let services = [svc("edge"), svc("internal"), svc("gpu")];
        let d = compute_on(AllocationMode::Allocate, &services, Some(&ctx));
        let allocated: Vec<String> = (d.allocations.iter())
            .flat_map(|(k, ports)| ports.values().map(move |n| format!("{k}={n}")))
            .collect();
        assert_eq!(allocated, ["ingress/edge=443", "ingress/internal=443"], "{:?}", d.alloc_problems);
        assert_eq!(d.alloc_problems.len(), 1, "gpu: {:?}", d.alloc_problems);
        let refused: Vec<String> =
            d.refused_ports.iter().map(|r| format!("{} {}", r.service, r.reason.code())).collect();
        assert_eq!(refused, ["ingress/edge not_selected"]);
    }

    /// Under the k3s ServiceLB labels a node programs only the Services its labels select; the
    /// others stay allocated but are refused here with the label and values; the flag's context
    /// without them (`servicelb: false`) programs both.
    #[test]
    fn servicelb_labels_choose_what_this_node_programs() {
        use crate::decisions::servicelb::{LABEL_ENABLELB, LABEL_LBPOOL};
        let svc = |name: &str, labels: serde_json::Value| -> Service {
            serde_json::from_value(serde_json::json!({
                "metadata": {"name": name, "namespace": "default", "labels": labels},
                "spec": {"type": "LoadBalancer", "ports": [{"port": 80}]}
            }))
            .expect("service")
        };
        let services =
            [svc("plain", serde_json::json!({})), svc("edge", serde_json::json!({LABEL_LBPOOL: "edge"}))];
        let range = PortRange::new(20000, 20010).expect("range");
        let run = |servicelb: bool| {
            let ctx = PoolContext {
                set: crate::decisions::pool::PoolSet::resolve(vec![], false, range, &[]),
                namespaces: BTreeMap::new(),
                node_labels: [(LABEL_ENABLELB, "true"), (LABEL_LBPOOL, "other")]
                    .into_iter()
                    .map(|(k, v)| (k.to_string(), v.to_string()))
                    .collect(),
                servicelb,
            };
            compute_on(AllocationMode::Allocate, &services, Some(&ctx))
        };
        let on = run(true);
        assert_eq!(on.allocations.len(), 2, "both stay allocated: {:?}", on.allocations);
        let refused: Vec<String> =
            on.refused_ports.iter().map(|r| format!("{}: {}", r.service, r.reason)).collect();
        assert_eq!(refused.len(), 1, "{refused:?}");
        assert!(refused[0].starts_with("default/edge: ServiceLB labels:"), "{refused:?}");
        assert!(
            refused[0].contains("lbpool=\"edge\"") && refused[0].contains("lbpool=\"other\""),
            "{refused:?}"
        );
        assert!(run(false).refused_ports.is_empty());
    }

    /// A pool with `addresses`: this node programs its Services on the selected addresses of
    /// its own (address . protocol . port elements), or refuses them when none is selected.
    #[test]
    fn pool_addresses_choose_where_this_node_serves() {
        let svc: Service = serde_json::from_value(serde_json::json!({
            "metadata": {"name": "edge", "namespace": "default"},
            "spec": {"type": "LoadBalancer", "ports": [{"port": 80}]}
        }))
        .expect("service");
        let range = PortRange::new(20000, 20010).expect("range");
        let mut host = HostFacts::default();
        for (a, i) in [("192.0.2.1", "eth1"), ("203.0.113.1", "eth0"), ("127.0.0.1", "lo")] {
            host.addresses.own.interfaces.entry(a.parse().unwrap()).or_default().insert(i.to_string());
        }
        let node = NodeFacts {
            node_name: "node-1".into(),
            families: [Family::Ipv4].into(),
            masquerade_mark: plan::DEFAULT_MASQUERADE_MARK,
            connection_mark: plan::DEFAULT_CONNECTION_MARK,
            forward_mark: None,
            nat_shards: 1,
        };
        let run = |cidr: &str| {
            let spec = serde_json::from_value(serde_json::json!({
                "ports": [{"start": 20000, "end": 20010}], "addresses": {"cidrs": [cidr]}
            }))
            .expect("spec");
            let pool = crate::decisions::pool::validate("edge-pool", None, None, &spec).expect("valid");
            let ctx = PoolContext {
                set: crate::decisions::pool::PoolSet::resolve(vec![pool], true, range, &[]),
                namespaces: BTreeMap::new(),
                node_labels: BTreeMap::new(),
                servicelb: false,
            };
            compute_whole(
                &Inputs {
                    mode: AllocationMode::Allocate,
                    services: std::slice::from_ref(&svc),
                    slices: model::NO_SLICES,
                    notes: &SourceNotes::default(),
                    previous: &Allocations::new(),
                    since: &BTreeMap::new(),
                    policy: &HostPolicy::default(),
                    host: &host,
                    range: &range,
                    model: &ModelOptions::default(),
                    node: &node,
                    pools: Some(&ctx),
                    registry: None,
                },
                true,
            )
        };
        let elements = |d: &Desired, map: crate::ruleset::ir::Name| -> Vec<String> {
            d.ruleset.sets[&map].elements.keys().map(|k| format!("{k:?}")).collect()
        };
        let served = run("192.0.2.0/24");
        assert!(served.refused_ports.is_empty(), "{:?}", served.refused_ports);
        assert_eq!(
            elements(&served, plan::firewall_address_ports_map(Family::Ipv4)),
            vec!["[Addr(192.0.2.1), Proto(Tcp), Port(20000)]"]
        );
        assert!(elements(&served, plan::firewall_ports_map(Family::Ipv4)).is_empty());
        let nowhere = run("198.51.100.0/24");
        assert_eq!(nowhere.allocations.len(), 1, "the allocation stays");
        assert_eq!(nowhere.refused_ports.len(), 1);
        assert_eq!(
            nowhere.refused_ports[0].reason.to_string(),
            "pool edge-pool selects no address of this node (addresses: cidrs 198.51.100.0/24)"
        );
        assert!(elements(&nowhere, plan::firewall_address_ports_map(Family::Ipv4)).is_empty());
    }
}
