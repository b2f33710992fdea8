//! The leader's round, pure: from a snapshot of the caches, the node-port registry as read and
//! what the last rounds left ([`LeaderState`], [`RoundMemory`]), what to write ([`plan_round`]:
//! the registry's blocks, each Service's annotation and status, pool status) and which Events to
//! record ([`events_to_send`]). No client, no clock of its own (the round's time comes in a
//! [`RoundClock`]): `tests/leader_rounds.rs` runs it against random histories, `benches/sync.rs`
//! times it. The agent's controller reads the registry, calls it and writes what it planned.

use std::borrow::Borrow;
use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::time::{Duration, Instant};

use ipnet::IpNet;
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::{Node, Service};
use k8s_openapi::jiff::Timestamp;

use crate::decisions::alloc::{self, Allocations};
use crate::decisions::port_policy::PortRange;
use crate::domain::{Scope, ServiceKey};
use crate::incremental::book::AllocationBook;
use crate::incremental::model_cache::{ModelCache, ModelContext};
use crate::inputs::compact::EndpointSlice;
use crate::inputs::model::{self, ModelOptions};

use super::claims;
use super::dupes;
use super::events::{Deduper, Outbox};
use super::lastgood::LastGoodServices;
use super::nodes;
use super::publish::{self, Round, ServiceWrite};
use super::snapshot::{Journal, KubeSnapshot};

#[derive(Debug, Clone)]
pub struct ControllerConfig {
    /// This replica's name (its pod's): leader Lease holder, Event reporter, registry claims.
    pub identity: String,
    /// nodelb's namespace (Leases).
    pub namespace: String,
    pub lease_duration: Duration,
    /// `--node-addresses`: status addresses restricted to these (empty: all).
    pub node_addresses: Vec<IpNet>,
    pub port_range: PortRange,
    pub model: ModelOptions,
    pub policy: crate::decisions::desired::HostPolicy,
}

/// The longest the leader goes without a whole round while nothing seems to change (what is not
/// watched, e.g. the registry edited by hand, is repaired within this).
const FULL_ROUND_EVERY: Duration = Duration::from_secs(60);

/// What a round reads from the node Leases (and Nodes) at a moment: the serving nodes (which
/// change when a Lease expires, with time), the ports processes listen on, the pool addresses
/// each node publishes. A renewal that changes none of them changes nothing for the round.
#[derive(Debug, Clone, PartialEq)]
pub struct LeaseView {
    serving: BTreeMap<String, nodes::ServingNode>,
    listening: BTreeMap<(crate::domain::Protocol, u16), String>,
    /// Nodes whose listeners are not known yet ([`nodes::listeners_unreported`]).
    unreported: Vec<String>,
    published: BTreeMap<String, nodes::PoolSelections>,
    refusals: super::cluster_view::Refusals,
    /// Nodes whose agent cannot read numbers with several holders
    /// ([`nodes::registry_format_unread`]): while there is one, nothing new is shared.
    unshared: Vec<String>,
}

impl LeaseView {
    pub fn of(
        nodes: &[Arc<Node>],
        leases: &[Arc<Lease>],
        leases_now: Option<Timestamp>,
        cfg: &ControllerConfig,
    ) -> LeaseView {
        LeaseView {
            serving: nodes::serving_nodes(nodes, leases, leases_now, &cfg.node_addresses),
            listening: nodes::listening_ports(leases),
            unreported: nodes::listeners_unreported(leases, leases_now),
            published: nodes::published_pool_addresses(leases).0,
            refusals: super::cluster_view::refusals(leases),
            unshared: nodes::registry_format_unread(leases, leases_now),
        }
    }
}

/// Takes off the nodes of each Service holding a shared number (`nodes`: the nodes its pool
/// selects, none listed for a pool of every node) those where the pool of another holder meets
/// its own and the node serves that one ([`crate::decisions::sharing::rank`]): its status
/// lists only the nodes where it answers.
fn serving_one_per_number<'a>(
    nodes: &mut BTreeMap<ServiceKey, std::collections::BTreeSet<String>>,
    services: &[Arc<model::LbService>],
    registry: &claims::Registry,
    assignment: &crate::decisions::pool::Assignment,
    sharing: Option<&crate::decisions::sharing::Sharing>,
    every_node: impl Iterator<Item = &'a String> + Clone,
) {
    let mut by_number: BTreeMap<u16, Vec<(&ServiceKey, claims::Owner)>> = BTreeMap::new();
    for s in services {
        for n in s.previous_allocation.values() {
            if registry.get(*n).is_some_and(claims::Holds::is_shared) {
                let holders = by_number.entry(*n).or_default();
                if !holders.iter().any(|(k, _)| *k == &s.key) {
                    holders.push((&s.key, claims::Owner::of(&s.key, s.uid.as_deref())));
                }
            }
        }
    }
    for (n, holders) in by_number {
        let claims =
            || registry.get(n).into_iter().flat_map(|h| h.iter()).map(|c| (&c.owner, c.pool.as_deref()));
        let rank = |(key, owner): &(&ServiceKey, claims::Owner)| {
            let pool = assignment.ranges.get(*key).map(|r| r.pool.as_str());
            (crate::decisions::sharing::rank(claims(), owner, pool), (*key).clone())
        };
        let mut ranked: Vec<_> = holders.iter().map(|h| (rank(h), h.0)).collect();
        ranked.sort();
        // Each node goes to the first holder whose pool selects it, but for holders served on
        // other addresses of it (pools apart by address).
        let mut earlier: Vec<(&ServiceKey, std::collections::BTreeSet<String>)> = Vec::new();
        for (_, key) in ranked {
            // No entry: its pool selects every node (and it gets one only when it loses some).
            let mut own = nodes.get(key).cloned().unwrap_or_else(|| every_node.clone().cloned().collect());
            let before = own.len();
            let coexist = |other: &ServiceKey| sharing.is_some_and(|s| s.never_together(key, other));
            for (_, theirs) in earlier.iter().filter(|(other, _)| !coexist(other)) {
                own.retain(|node| !theirs.contains(node));
            }
            if own.len() < before {
                nodes.insert(key.clone(), own.clone());
            }
            earlier.push((key, own));
        }
    }
}

/// What the leader's pure round ([`plan_round`]) keeps from one round to the next.
#[derive(Debug, Default)]
pub struct RoundMemory {
    pub last_good: LastGoodServices,
    /// Each NodePortPool's last valid version ([`crate::decisions::pool::LastValid`]).
    pub pools_last_valid: crate::decisions::pool::LastValid,
    /// The last round's models, each kept while its Service and EndpointSlice objects are the
    /// same (as the nodes keep theirs).
    pub models: ModelCache,
    /// Each Service's status and Events, kept while its inputs are the same
    /// ([`publish::plan_services`]).
    pub published: publish::Published,
    /// The last rounds' node ports for every Service, and which Services every round plans
    /// ([`AllocationBook`]): a round that finds the same shared inputs plans only a scope.
    pub book: AllocationBook,
    /// With node port pools: each Service's pool as the last rounds decided it.
    pools: BTreeMap<ServiceKey, alloc::PoolRanges>,
    shared: Option<SharedInputs>,
    /// The last good copies the last round planned in place of invalid Services: new objects
    /// every round, so a scoped round lets go of what they left ([`plan_round`]).
    substituted: Vec<Arc<Service>>,
    /// Whether the registry last read records a number with several holders (kept through a
    /// round that cannot read it; `None`: never read, which counts as yes).
    registry_shares: Option<bool>,
}

/// The objects a round plans: its Services (a last good copy where one stands in), their
/// EndpointSlices, and (a scoped round) the objects that left the view since the last round.
struct RoundObjects {
    services: Vec<Arc<Service>>,
    slices: Vec<Arc<EndpointSlice>>,
    dropped: Vec<Arc<Service>>,
}

impl RoundMemory {
    /// The objects of the Services of `keys` in the view `holders` passed over, in key order,
    /// their EndpointSlices, and what left the view since the last round (with the last good
    /// copies the last round planned in place of invalid Services: new objects every round).
    fn objects_of(&self, keys: &foldhash::HashSet<ServiceKey>, holders: &claims::Holders) -> RoundObjects {
        let mut sorted: Vec<&ServiceKey> = keys.iter().collect();
        sorted.sort_unstable();
        let (services, slices) = holders.objects_of(sorted);
        let dropped = (holders.changes().dropped.iter().map(|(o, _)| Arc::clone(o)))
            .chain(self.substituted.iter().cloned())
            .collect();
        RoundObjects { services, slices, dropped }
    }
}

/// What every Service's part of a round reads besides its own objects: a round plans only a
/// scope ([`AllocationBook::closure`]) when these are what the last round read.
#[derive(Debug, PartialEq)]
struct SharedInputs {
    /// Every Node's name, labels and addresses, hashed.
    nodes: u64,
    pools: crate::decisions::pool::PoolContext,
    invalid_pools: Vec<crate::decisions::pool::InvalidPool>,
    leases: LeaseView,
}

/// A hash of what a round reads of the Nodes: names, labels, addresses.
fn node_facts<N: Borrow<Node>>(nodes: &[N]) -> u64 {
    use std::hash::{Hash, Hasher};
    let mut per_node: Vec<u64> = nodes
        .iter()
        .map(|n| {
            let n = n.borrow();
            let mut h = std::hash::DefaultHasher::new();
            n.metadata.name.hash(&mut h);
            n.metadata.labels.hash(&mut h);
            if let Some(addresses) = n.status.as_ref().and_then(|s| s.addresses.as_ref()) {
                for a in addresses {
                    (&a.type_, &a.address).hash(&mut h);
                }
            }
            h.finish()
        })
        .collect();
    per_node.sort_unstable();
    let mut h = std::hash::DefaultHasher::new();
    per_node.hash(&mut h);
    h.finish()
}

/// Each registry block's resourceVersion (`None`: the block did not exist when read).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RegistryVersions(BTreeMap<u16, Option<String>>);

impl RegistryVersions {
    pub fn of(registry: &claims::Registry) -> RegistryVersions {
        RegistryVersions(registry.versions())
    }

    pub fn get(&self, block: &u16) -> Option<&Option<String>> {
        self.0.get(block)
    }

    pub fn insert(&mut self, block: u16, version: Option<String>) {
        self.0.insert(block, version);
    }
}

/// What a leader keeps between rounds.
pub struct LeaderState {
    pub memory: RoundMemory,
    /// The resourceVersions the last round's Service writes made (the controller's `write_services`).
    pub echoes: HashMap<ServiceKey, Vec<String>>,
    /// The last round read the registry, found every claim in it resolved, and all its writes
    /// (registry, Services, pools) and Events succeeded.
    clean: bool,
    /// What the last round read from the node Leases ([`LeaseView`]), and when the last whole
    /// round started (a scoped one plans only what changed: [`plan_round`]).
    lease_view: Option<LeaseView>,
    last_whole_round: Option<Instant>,
    /// Each Service's registry holder ([`claims::Holders`]); its pass also says which Services
    /// changed since the last round.
    pub holders: claims::Holders,
    /// What it knows of the node-port registry's Services ([`claims::Keeper`]).
    pub claims: claims::Keeper,
    /// Each registry block's resourceVersion as the last round left it (its own writes
    /// included), when that round knows it: a registry read that differs was written by someone
    /// else (a human, another leader), and a round after that is whole.
    registry_versions: Option<RegistryVersions>,
    /// The registry as the last round read it, parsed (the controller's `read_registry`).
    pub registry_read: Option<claims::ReadRegistry>,
    /// The resourceVersion of this leader's last registry read or write: the next read asks
    /// for data at least that fresh, which the API server's cache serves at once, where a
    /// consistent read waits for the cache to catch up with etcd (most of a round). A write of
    /// someone else's that such a read misses fails its precondition (409); then, and after any
    /// failed read or write, the next read is a consistent one (`None`).
    pub registry_seen: Option<String>,
    /// Names this process in the claims it leaves pending.
    pub token: claims::Token,
    /// Registry problems last logged (each logged once while it lasts).
    pub logged: std::collections::BTreeSet<String>,
    /// The nodes the last round waited for ([`RoundPlan::listeners_unreported`]; logged once).
    unreported: Vec<String>,
}

impl LeaderState {
    /// `token`: what names this leader process in the registry's pending claims
    /// ([`claims::Token::new`]).
    pub fn new(token: claims::Token) -> LeaderState {
        LeaderState {
            memory: RoundMemory::default(),
            echoes: HashMap::new(),
            clean: false,
            lease_view: None,
            last_whole_round: None,
            holders: claims::Holders::default(),
            claims: claims::Keeper::default(),
            registry_versions: None,
            registry_read: None,
            registry_seen: None,
            token,
            logged: Default::default(),
            unreported: Vec::new(),
        }
    }

    /// Whether a round now would plan nothing: the last one was [`LeaderState::clean`], the last
    /// whole one recent ([`FULL_ROUND_EVERY`]), and since then only its own writes came back through the watch
    /// (the versions they made) and node Leases were renewed without changing what the round
    /// reads from them (`view`, taken now: a Lease that expired with time changes it).
    pub fn nothing_to_do(&self, changes: &Journal, view: &LeaseView, now: Instant) -> bool {
        self.clean
            && self.whole_round_is_recent(now)
            && changes.others.iter().all(|kind| *kind == "Lease")
            && self.only_echoes(changes)
            && self.lease_view.as_ref() == Some(view)
    }

    /// Whether the last whole round started less than [`FULL_ROUND_EVERY`] before `now`.
    fn whole_round_is_recent(&self, now: Instant) -> bool {
        self.last_whole_round.is_some_and(|t| now.saturating_duration_since(t) < FULL_ROUND_EVERY)
    }

    /// Whether every Service version in `changes` is one the last round's writes made.
    fn only_echoes(&self, changes: &Journal) -> bool {
        changes.services.iter().all(|(key, rv)| self.is_echo(key, rv.as_deref()))
    }

    /// Whether this version of the Service is one the last round's writes made.
    fn is_echo(&self, key: &ServiceKey, rv: Option<&str>) -> bool {
        rv.is_some_and(|rv| self.echoes.get(key).is_some_and(|made| made.iter().any(|m| m == rv)))
    }

    /// Whether the round these changes call for may wait a little (the controller's `NOT_URGENT_WAIT`, or until
    /// the next change, which it then covers too): nothing in them can give a Service a number.
    /// Services deleted (their numbers stay claimed a moment longer, which only keeps them from
    /// being handed out), EndpointSlices changed (statuses and Events follow; the nodes program
    /// endpoints on their own), the last round's writes coming back, Services written that are
    /// not nodelb's and carry no decision of a leader (`not_ours`, of the cache's version:
    /// ClusterIP Services, most of a cluster's, with their labels and annotations edited by
    /// every deploy tool; one replaced whole without its annotation is a deletion here), Lease
    /// renewals that change nothing the round reads. A Service of nodelb's created or changed,
    /// more Service writes than the journal itemizes, a Node, a pool, a namespace or a
    /// changed view of the Leases does not wait; a relist of the Services (after a watch
    /// restart: the journal does not itemize it) does, for at most that second. What the last
    /// round left unfinished (claims to settle, Events to send) waits as well: a stale write or
    /// statuses left over rerun the round at once, in the round loop. Why: a round takes time
    /// linear in the Services, and a create arriving while a deletion's round runs would wait
    /// for all of it.
    pub fn can_wait(
        &self,
        changes: &Journal,
        view: &LeaseView,
        not_ours: impl Fn(&ServiceKey) -> bool,
    ) -> bool {
        !changes.truncated
            && changes.services.iter().all(|(key, rv)| self.is_echo(key, rv.as_deref()) || not_ours(key))
            && changes.others.iter().all(|kind| matches!(*kind, "Service" | "EndpointSlice" | "Lease"))
            && self.lease_view.as_ref() == Some(view)
    }

    /// Forgets what only leading needs (the round memory, the last round's writes and view);
    /// keeps what every agent records ([`LeaderState::observe`]).
    pub fn step_down(&mut self) {
        self.memory = RoundMemory::default();
        self.holders = claims::Holders::default();
        self.registry_versions = None;
        self.registry_read = None;
        // A leader again reads the registry as it is, not as fresh as its old writes.
        self.registry_seen = None;
        self.echoes = HashMap::new();
        self.clean = false;
        self.lease_view = None;
        self.last_whole_round = None;
    }

    /// Records the Services of a view (see [`claims::Keeper::observe_view`]), as a follower:
    /// nothing is kept of them but their owners.
    pub fn observe(&mut self, snap: &KubeSnapshot, now: Instant) {
        let holders: Vec<claims::Holder> = snap.services.iter().map(|s| claims::Holder::of(s)).collect();
        self.claims.observe_view(&holders, now);
    }

    /// [`LeaderState::observe`] for a round, from what changed since the last one: each holder
    /// kept per object ([`LeaderState::holders`]).
    fn observe_for_round(&mut self, snap: &KubeSnapshot, at: Instant) {
        self.holders.pass(&snap.services, &snap.slices);
        self.claims.observe_changes(self.holders.changes(), at);
    }
}

/// The times a round judges by ([`LeaderState::begin_round`]).
#[derive(Debug, Clone, Copy)]
pub struct RoundClock {
    /// The time to judge node-Lease expiry by, `None` while the Lease cache may be behind (see
    /// [`nodes::serving_nodes`]).
    pub leases_now: Option<Timestamp>,
    /// The time written in conditions and statuses.
    pub now: Timestamp,
    /// When the round started: claim clocks and the whole-round timer count from it.
    pub at: Instant,
}

/// A round's decisions before its writes ([`LeaderState::begin_round`]).
pub struct BegunRound {
    pub plan: RoundPlan,
    /// Each registry block's resourceVersion as read; the round's own writes are added to it and
    /// it goes back to [`LeaderState::end_round`]. `None`: the registry could not be read.
    pub versions: Option<RegistryVersions>,
    /// The nodes the round waits for (`plan.listeners_unreported`) are not those of the last
    /// round (the agent logs them once).
    pub unreported_changed: bool,
}

impl LeaderState {
    /// The pure part of a round, between the registry read and the writes: what the view
    /// changed since the last round is recorded, the claims nobody resolved are found, and
    /// [`plan_round`] decides, planning only what changed when the agent's rule allows it: the
    /// last round was clean, a whole round ran within [`FULL_ROUND_EVERY`], the registry is the
    /// one the last round left (nobody else wrote it), no claim expired and every claim is
    /// resolved but a deleted Service's. `registry`: as read, `None` when it could not be.
    /// `services_current`: the Service watch is not failing (else the claims' clocks start over).
    /// Every round that begins is ended by [`LeaderState::end_round`] unless a registry write
    /// fails, after which the next round is whole.
    pub fn begin_round(
        &mut self,
        snap: &KubeSnapshot,
        cfg: &ControllerConfig,
        registry: Option<&claims::Registry>,
        clock: RoundClock,
        services_current: bool,
    ) -> BegunRound {
        let was_clean = std::mem::replace(&mut self.clean, false);
        self.echoes.clear();
        self.lease_view = Some(LeaseView::of(&snap.nodes, &snap.leases, clock.leases_now, cfg));
        self.observe_for_round(snap, clock.at);
        let touched = self.holders.changed_numbers();
        let expired = match registry {
            Some(r) => self.claims.expired(r, &self.holders.held(), touched, services_current, clock.at),
            None => {
                self.claims.lose_track();
                Default::default()
            }
        };
        let gone = self.claims.gone().clone();
        let gone_claims = self.claims.claims_of_gone();
        let inputs = ClaimInputs {
            registry,
            token: &self.token,
            gone: &gone,
            gone_claims: gone_claims.as_deref(),
            expired: &expired,
        };
        let versions = registry.map(RegistryVersions::of);
        let as_left = std::mem::take(&mut self.registry_versions);
        // A Service that came or changed naming a number the registry gives another (a forged
        // annotation) is screened: a scoped round takes every claim as its holder's.
        let forged = registry.is_some_and(|r| claims::name_anothers(self.holders.changes(), r, &gone));
        let may_scope = was_clean
            && self.whole_round_is_recent(clock.at)
            && versions.is_some()
            && as_left == versions
            && expired.is_empty()
            && !forged
            && self.claims.resolved_but_deletions();
        let plan = plan_round(
            snap,
            cfg,
            &mut self.memory,
            &self.holders,
            clock.leases_now,
            clock.now,
            &inputs,
            may_scope,
        );
        if plan.scope.is_none() {
            self.last_whole_round = Some(clock.at);
        }
        let unreported_changed = plan.listeners_unreported != self.unreported;
        if unreported_changed {
            self.unreported = plan.listeners_unreported.clone();
        }
        BegunRound { plan, versions, unreported_changed }
    }

    /// The end of a round [`LeaderState::begin_round`] began, once its writes are done:
    /// `all_written`: every Service write went through and every pending claim was resolved;
    /// `versions`: the registry's block versions as the round left them (`None` when someone
    /// else's write showed). The round is clean (the next may be skipped or scoped) when it read
    /// the registry, waited for no node's listeners, and left every claim resolved but a deleted
    /// Service's. What the Events and the pools' status do after this can still make it unclean
    /// ([`LeaderState::next_round_whole`]).
    pub fn end_round(
        &mut self,
        registry: Option<&claims::Registry>,
        all_written: bool,
        versions: Option<RegistryVersions>,
    ) {
        self.clean = registry.is_some()
            && self.unreported.is_empty()
            && self.claims.resolved_but_deletions()
            && all_written;
        self.registry_versions = versions;
        if let Some(r) = registry {
            self.claims.forget(r);
        }
    }

    /// Something the round left undone (an Event not sent, a pools' status not written): the
    /// next round is whole and is not skipped.
    pub fn next_round_whole(&mut self) {
        self.clean = false;
    }
}

/// What the leader writes and records in one round.
#[derive(Debug, Clone, Default)]
pub struct RoundPlan {
    pub writes: Vec<ServiceWrite>,
    pub events: Vec<publish::ServiceEvent>,
    /// The registry side: written before the Services, resolved after.
    pub claims: claims::ClaimPlan,
    /// What the pools' status is written from, when NodePortPool objects exist.
    pub pools: Option<PoolRound>,
    /// Nodes whose agent runs but has not reported its listeners yet: no new number was handed
    /// out this round (the Services that need one wait, in `claims.blocked`).
    pub listeners_unreported: Vec<String>,
    /// The Services the round planned, when not all of them ([`plan_round`]'s `may_scope`):
    /// its writes and Events are theirs.
    pub scope: Option<foldhash::HashSet<ServiceKey>>,
}

/// The round's decisions the pools' status is computed from (the agent writes their status from it).
#[derive(Debug, Clone)]
pub struct PoolRound {
    pub ctx: crate::decisions::pool::PoolContext,
    pub invalid: Vec<crate::decisions::pool::InvalidPool>,
    pub allocations: Allocations,
    pub assignment: Option<crate::decisions::pool::Assignment>,
    pub serving: std::collections::BTreeMap<String, nodes::ServingNode>,
}

/// What the node-port registry contributes to a round.
pub struct ClaimInputs<'a> {
    /// As read at the start of the round; `None` when it could not be read (then nothing that
    /// adds a number is written).
    pub registry: Option<&'a claims::Registry>,
    pub token: &'a claims::Token,
    pub gone: &'a std::collections::BTreeSet<claims::Owner>,
    /// The numbers `gone` owners claim, when known without a walk of the registry
    /// ([`claims::Keeper::claims_of_gone`]).
    pub gone_claims: Option<&'a [claims::ClaimOf]>,
    pub expired: &'a std::collections::BTreeSet<claims::ClaimOf>,
}

/// The leader's decisions for one round, from the caches and the node-port registry alone
/// (pure): last-good substitution, the model, endpoint policy, node port pools, duplicate
/// repair, allocation within what the registry allows, status, conditions, Events, and the
/// registry changes that must be written before the Services. `memory`: what the last rounds
/// left ([`RoundMemory`]). `holders`: what each Service of `snap` holds ([`claims::Holder::of`],
/// in `snap`'s order). `leases_now`: the time to judge node-Lease expiry by, `None` while the
/// Lease cache may be behind (see [`nodes::serving_nodes`]).
///
/// `may_scope`: the last round ended clean (every write and Event went through, every claim
/// resolved) and `holders` are `memory.holders`' pass over `snap.services`. Then, if what every
/// Service's part reads is what the last round read, the round plans only the Services that
/// changed and those that share a number with them (docs/design/incremental.md, "The round
/// scoped to what changed"); the plan says which ([`RoundPlan::scope`]).
#[allow(clippy::too_many_arguments)]
pub fn plan_round(
    snap: &KubeSnapshot,
    cfg: &ControllerConfig,
    memory: &mut RoundMemory,
    holders: &claims::Holders,
    leases_now: Option<Timestamp>,
    now: Timestamp,
    registry: &ClaimInputs<'_>,
    may_scope: bool,
) -> RoundPlan {
    // The nodes refuse these endpoints (each also its own addresses): the status, the
    // conditions and the Events say so, and Local-policy ingress counts only usable endpoints.
    let node_addresses = snap.cluster_addresses();
    let no_ages = BTreeMap::new();
    let ctx = ModelContext {
        opts: &cfg.model,
        since: &no_ages,
        addresses: &node_addresses,
        policy: &cfg.policy.endpoints,
    };
    let held = holders.held();
    // Node port pools: which pool each Service gets (a Service none accepts is not allocated, and
    // says why), and which nodes its status may list.
    let (pool_ctx, invalid_pools) = super::pools::context(
        snap,
        &mut memory.pools_last_valid,
        cfg.port_range,
        None,
        cfg.model.servicelb_labels,
    );
    let leases = LeaseView::of(&snap.nodes, &snap.leases, leases_now, cfg);
    let shared = SharedInputs {
        nodes: node_facts(&snap.nodes),
        pools: pool_ctx.clone(),
        invalid_pools: invalid_pools.clone(),
        leases: leases.clone(),
    };
    let same_shared = memory.shared.as_ref() == Some(&shared);
    memory.shared = Some(shared);
    // What processes listen on, on any node (`listening`): never handed out, and a request for
    // it is refused. Each node refuses locally anyway, whatever is decided here.
    let LeaseView { serving, listening, unreported, published, refusals, unshared } = leases;
    // Which Services may hold one number together: those of pools apart, while every running
    // agent reads such numbers (else only what the registry records as shared stays so). A
    // round is then whole: a scope would not see every holder's pool.
    if let Some(r) = registry.registry.filter(|_| !pool_ctx.set.implicit) {
        let shared = |b: &claims::Block| b.claims.values().any(claims::Holds::is_shared);
        memory.registry_shares = Some(r.blocks.values().any(shared));
    }
    let mut sharing =
        pool_ctx.set.sharing().filter(|s| !s.is_empty() || memory.registry_shares.unwrap_or(true));
    if let Some(s) = sharing.as_mut().filter(|_| !unshared.is_empty()) {
        s.only_recorded();
    }
    // The Services this round plans: all of them, or a scope.
    let scope: Option<foldhash::HashSet<ServiceKey>> = (may_scope
        && same_shared
        && memory.models.has_context(&ctx)
        && !pool_ctx.set.bounds_namespaces()
        && sharing.is_none())
    .then(|| {
        let changes = holders.changes();
        memory.book.closure(
            changes.keys.iter().cloned(),
            changes.numbers.iter().copied(),
            |k| holders.of_key(k).into_iter().flat_map(|(_, h)| h.numbers.iter().copied()),
            |n| held.holders_of(n).iter().map(|h| &h.key),
        )
    });
    // What the registry takes off the Services and lets nobody have. A scoped round runs only
    // when every claim names a Service that holds its number, or a deleted one (`may_scope`):
    // then nothing is in use, and only a forged annotation in the scope loses a number (debug
    // builds check it against the whole screen).
    let scope_numbers: Option<std::collections::BTreeSet<u16>> = scope.as_ref().map(|keys| {
        (keys.iter()).filter_map(|k| holders.of_key(k)).flat_map(|(_, h)| h.numbers.iter().copied()).collect()
    });
    let screen =
        registry.registry.map(|r| claims::Screen::within(&held, r, registry.gone, scope_numbers.as_ref()));
    if cfg!(debug_assertions)
        && let (Some(keys), Some(r)) = (&scope, registry.registry)
    {
        let whole = claims::Screen::of(&held, r, registry.gone);
        assert!(
            whole.in_use.is_empty() && whole.losing().all(|(k, _)| keys.contains(k)),
            "a scoped round's registry: in use {:?}, losing {:?}",
            whole.in_use,
            whole.losing().collect::<Vec<_>>()
        );
    }
    let (subst, RoundObjects { services, slices, dropped }) = match &scope {
        None => {
            let subst = memory.last_good.apply(&snap.services, None, &cfg.model);
            let services = subst.services.clone();
            (subst, RoundObjects { services, slices: snap.slices.clone(), dropped: Vec::new() })
        }
        Some(keys) => {
            let objects = memory.objects_of(keys, holders);
            let gone: Vec<Arc<Service>> =
                holders.changes().dropped.iter().map(|(o, _)| Arc::clone(o)).collect();
            let subst = memory.last_good.apply(&objects.services, Some(&gone), &cfg.model);
            let services = subst.services.clone();
            (subst, RoundObjects { services, ..objects })
        }
    };
    memory.substituted = subst.substituted;
    let out = match &scope {
        Some(keys) => memory.models.build(Scope::Keys(keys), &services, &slices, &ctx).unwrap_or_default(),
        None => memory.models.build(Scope::All, &services, &slices, &ctx).expect("a whole build"),
    };
    let refused_endpoints = out.refused_endpoints;
    let stubs = publish::reserved(&services, &out.refused);
    // The stand-ins of refused Services hold their numbers for the allocator; nothing else of
    // theirs goes on, unless a valid Service has the same key. There are few: no set of every
    // valid key is built.
    let mut stand_ins: foldhash::HashSet<ServiceKey> = stubs.iter().map(|s| s.key.clone()).collect();
    if !stand_ins.is_empty() {
        for s in &out.services {
            stand_ins.remove(&s.key);
        }
    }
    let mut all: Vec<Arc<model::LbService>> =
        out.services.iter().cloned().chain(stubs.into_iter().map(Arc::new)).collect();
    let mut in_use = listening.clone();
    let mut lost = Vec::new();
    if let Some(screen) = &screen {
        // Numbers another Service claims are not this one's to keep, nor anyone's to take.
        lost = screen.apply(&mut all);
        for (k, why) in &screen.in_use {
            in_use.entry(*k).or_insert_with(|| why.clone());
        }
    }
    let assignment = (!pool_ctx.set.implicit)
        .then(|| crate::decisions::pool::assign_services(&pool_ctx, &services, &all, &Allocations::new()));
    if let (Some(sharing), Some(a)) = (sharing.as_mut(), &assignment) {
        crate::decisions::desired::share_services(sharing, a, &all, registry.registry);
    }
    // Among what the registry left them (numbers no claim names: the registry lost).
    let together = |n: u16, a: &ServiceKey, b: &ServiceKey| {
        sharing.as_ref().is_some_and(|s| s.apart(a, b) || s.recorded_together(n, a, b))
    };
    let duplicates = dupes::duplicates(&all[..out.services.len()], Some(&together));
    let all: Vec<Arc<model::LbService>> = match &assignment {
        Some(a) => all.into_iter().filter(|s| a.has_pool(&s.key)).collect(),
        None => all,
    };
    let pool_nodes = assignment.as_ref().map(|a| super::pools::selected_nodes(&pool_ctx, a, &snap.nodes));
    let mut pool_nodes = super::pools::narrow_by_servicelb(&pool_ctx, &services, &snap.nodes, pool_nodes);
    if let (Some(nodes), Some(r), Some(a)) = (pool_nodes.as_mut(), registry.registry, &assignment)
        && memory.registry_shares == Some(true)
    {
        serving_one_per_number(nodes, &all, r, a, sharing.as_ref(), serving.keys());
    }
    let pool_addresses = assignment.as_ref().map(|a| {
        // A malformed value counts as not published (the pools' status writes log it).
        super::pools::published_addresses(&pool_ctx, a, &snap.nodes, &published, &cfg.node_addresses)
    });
    let constraints = alloc::Constraints {
        policy: Some(&cfg.policy.ports),
        in_use: Some(&in_use),
        pools: assignment.as_ref().map(|a| &a.ranges),
        elsewhere: scope.as_ref().and_then(|keys| memory.book.elsewhere(keys)),
        sharing: sharing.as_ref(),
    };
    let mut result = alloc::allocate_with(&cfg.port_range, &all, &Allocations::new(), constraints);
    result.problems.extend(assignment.iter().flat_map(|a| a.problems.iter().cloned()));
    let allocations: Allocations =
        result.allocations.into_iter().filter(|(k, _)| !stand_ins.contains(k)).collect();
    let problems: Vec<alloc::AllocProblem> =
        result.problems.into_iter().filter(|p| !stand_ins.contains(p.service())).collect();
    let refused: Vec<model::Refusal> = out.refused.iter().cloned().chain(subst.masked).collect();
    let round = Round {
        services: &services,
        model: &cfg.model,
        valid: &out.services,
        refused: &refused,
        allocations: &allocations,
        problems: &problems,
        refused_endpoints: &refused_endpoints,
        listening: &in_use,
        serving: &serving,
        pool_nodes: pool_nodes.as_ref(),
        pool_addresses: pool_addresses.as_ref(),
        lost: &lost,
        refusals: Some(&refusals),
        now,
    };
    let (mut writes, mut events) = publish::plan_services(
        &round,
        &duplicates,
        &mut memory.published,
        scope.as_ref().map(|_| &dropped[..]),
    );
    // The registry side of the annotation writes: the holders of the Services written (a map of
    // those only, not of every Service).
    let annotated: foldhash::HashSet<&ServiceKey> =
        writes.iter().filter(|w| w.annotation.is_some()).map(|w| &w.key).collect();
    let by_key: foldhash::HashMap<&ServiceKey, &claims::Holder> =
        annotated.iter().filter_map(|k| Some((*k, &**holders.of_key(k)?.1))).collect();
    let mut changes: Vec<claims::AnnotationChange<'_>> = writes
        .iter()
        .filter_map(|w| {
            let after = match w.annotation.as_ref()? {
                Some(v) => model::parse_allocated_ports(v).into_values().collect(),
                None => Default::default(),
            };
            Some(claims::AnnotationChange { holder: by_key.get(&w.key)?, after })
        })
        .collect();
    // A number no node has said is free of listeners is not handed out: a running agent that has
    // not read its sockets yet (just started: a new node, a restart, an install into a cluster
    // whose Services all wait for numbers) has at least its own health and metrics listeners.
    let mut waiting = Vec::new();
    if !unreported.is_empty() {
        changes.retain(|c| {
            let adds = !c.after.is_subset(&c.holder.numbers);
            if adds {
                waiting.push(c.holder.key.clone());
            }
            !adds
        });
    }
    let mut claim_plan = match registry.registry {
        Some(r) => {
            // A scoped round: the numbers the scope's Services hold (every other one has its claim).
            let scope = match &scope_numbers {
                None => claims::ClaimScope::All { expired: registry.expired },
                Some(numbers) => claims::ClaimScope::Numbers { numbers, gone_claims: registry.gone_claims },
            };
            claims::plan(r, &held, &changes, registry.token, registry.gone, sharing.as_ref(), scope)
        }
        // The registry unread: nothing is added; and while pools may share, nothing is taken
        // off either (a shared number is kept by what the registry records, unread now).
        None => claims::ClaimPlan {
            blocked: changes
                .iter()
                .filter(|c| sharing.is_some() || !c.after.is_subset(&c.holder.numbers))
                .map(|c| c.holder.key.clone())
                .collect(),
            ..Default::default()
        },
    };
    claim_plan.blocked.extend(waiting);
    // A Service whose new numbers are not free now waits for the next round (its Events too).
    writes.retain(|w| !claim_plan.blocked.contains(&w.key));
    events.retain(|e| !claim_plan.blocked.contains(&e.service));
    // What the next round plans whatever changes: every Service this one left anything to do
    // for, or that anything stands in the way of.
    let unsettled: foldhash::HashSet<ServiceKey> = (problems.iter().map(|p| p.service()))
        .chain(duplicates.iter().flat_map(|d| [&d.keeper, &d.loser]))
        .chain(refused.iter().map(|r| r.service()))
        .chain(stand_ins.iter())
        .chain(lost.iter().map(|(k, _)| k))
        .chain(claim_plan.blocked.iter())
        .chain(writes.iter().map(|w| &w.key))
        .cloned()
        .collect();
    let pool_ranges = assignment.as_ref().map(|a| a.ranges.clone()).unwrap_or_default();
    let pools = match &scope {
        None => {
            memory.book.replace(allocations.clone(), Some(unsettled));
            memory.pools = pool_ranges;
            (!snap.pools.is_empty()).then_some(PoolRound {
                ctx: pool_ctx,
                invalid: invalid_pools,
                allocations,
                assignment,
                serving,
            })
        }
        Some(keys) => {
            memory.book.patch(keys, allocations, unsettled);
            memory.pools.retain(|k, _| !keys.contains(k));
            memory.pools.extend(pool_ranges);
            // The pools' status counts every Service's numbers: the book's.
            (!snap.pools.is_empty()).then(|| PoolRound {
                ctx: pool_ctx,
                invalid: invalid_pools,
                allocations: memory.book.allocations().clone(),
                assignment: assignment.map(|_| crate::decisions::pool::Assignment {
                    ranges: memory.pools.clone(),
                    problems: Vec::new(),
                }),
                serving,
            })
        }
    };
    RoundPlan { writes, events, claims: claim_plan, pools, listeners_unreported: unreported, scope }
}

/// An Event's (Service, reason, message), borrowed: what the deduper compares.
fn event_triple(e: &publish::ServiceEvent) -> (&ServiceKey, &'static str, &str) {
    (&e.service, e.reason, e.message.as_str())
}

/// An Event's (Service, reason, message), as the deduper and the outbox remember it.
pub fn event_key(e: &publish::ServiceEvent) -> (ServiceKey, &'static str, String) {
    (e.service.clone(), e.reason, e.message.clone())
}

/// Which of a round's Events to record now (pure): the state Events not recorded with the same
/// message ([`Deduper`]), and the one-time ones waiting in the outbox (queued there first, so a
/// failed write keeps them) for Services that still `exist`. Each sent one is to be marked
/// with [`Deduper::sent`] and [`Outbox::sent`]. `scope`: the Services the round planned
/// ([`RoundPlan::scope`]): the others' states are as recorded.
pub fn events_to_send(
    deduper: &mut Deduper<ServiceKey>,
    outbox: &mut Outbox<ServiceKey, publish::ServiceEvent>,
    events: &[publish::ServiceEvent],
    exist: impl Fn(&ServiceKey) -> bool,
    scope: Scope<'_>,
) -> Vec<publish::ServiceEvent> {
    let mut sending: Vec<publish::ServiceEvent> = Vec::new();
    for e in deduper.pending(events, event_triple, scope) {
        match publish::ONE_TIME_REASONS.contains(&e.reason) {
            true => outbox.add(event_key(e), e.clone()),
            false => sending.push(e.clone()),
        }
    }
    outbox.retain_objects(exist);
    sending.extend(outbox.waiting().map(|(_, e)| e.clone()));
    sending
}

#[cfg(test)]
mod tests;
