//! The controller's edge (`nodelb controller`, a Deployment of its own): its replicas elect a
//! leader ([`super::election`]), and the leader alone allocates node ports and writes Service
//! status, the node-port registry, NodePortPool status and Service Events, only once the caches
//! are complete: [`crate::alloc::allocate`] with the annotations as previous allocations, then
//! [`super::publish::plan_writes`] → merge patches with a `metadata.resourceVersion`
//! precondition (409 ⇒ retried on the next round), Events deduplicated per change. The node
//! agents only read what it writes.

use std::borrow::Borrow;
use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use ipnet::IpNet;
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::{Node, Service};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use k8s_openapi::jiff::Timestamp;
use kube::api::{Patch, PatchParams};
use kube::runtime::events::{Recorder, Reporter};
use kube::{Api, Client, Resource};
use serde_json::json;
use tracing::{debug, info, warn};

use crate::alloc::{self, Allocations};
use crate::compact::EndpointSlice;
use crate::domain::ServiceKey;
use crate::model::{self, ANNOTATION_ALLOCATED, ModelOptions};
use crate::model_cache::{ModelCache, ModelContext};
use crate::per_object::PerObject;
use crate::port_policy::PortRange;
use crate::serve::metrics::ControllerMetrics;

use super::api::{CONTROLLER_NAME, FIELD_MANAGER, is_conflict, post_params, publish_event};
use super::claims;
use super::dupes;
use super::election::{self, ElectionConfig, Leadership};
use super::events::{Deduper, Outbox};
use super::lastgood::LastGoodServices;
use super::nodes;
use super::publish::{self, Round, ServiceWrite};
use super::scope;
use super::source::{Journal, KubeSnapshot, KubeSource};

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
    pub policy: crate::desired::HostPolicy,
}

/// The running tasks: leadership, liveness, and a way to stop leading cleanly.
pub struct Controller {
    pub leadership: Arc<Leadership>,
    pub liveness: Arc<Liveness>,
    stop: tokio::sync::watch::Sender<bool>,
    elect: tokio::task::JoinHandle<()>,
}

impl Controller {
    /// Graceful shutdown: stop allocating and, when leading, release Lease `nodelb-leader` (holder
    /// cleared) so a successor takes over at its next poll (`lease/3`) instead of after a whole
    /// lease duration. Bounded: gives up after 3 s (the Lease then simply expires).
    pub async fn shutdown(self) {
        let _ = self.stop.send(true);
        if tokio::time::timeout(Duration::from_secs(3), self.elect).await.is_err() {
            warn!("leader election did not stop within 3 s; the Lease will expire instead");
        }
    }
}

/// What the controller's probes read: when the allocation loop last came round (it wakes at
/// least every couple of seconds, and a round's writes are bounded in time), and whether the
/// caches have finished their first lists.
#[derive(Debug)]
pub struct Liveness {
    started: Instant,
    /// Milliseconds since `started` at the loop's last turn.
    last_turn_ms: AtomicU64,
    complete: AtomicBool,
}

impl Default for Liveness {
    fn default() -> Self {
        Liveness {
            started: Instant::now(),
            last_turn_ms: AtomicU64::new(0),
            complete: AtomicBool::new(false),
        }
    }
}

impl Liveness {
    fn turned(&self, complete: bool) {
        let ms = self.started.elapsed().as_millis().min(u128::from(u64::MAX)) as u64;
        self.last_turn_ms.store(ms, Ordering::Release);
        self.complete.store(complete, Ordering::Release);
    }

    /// How long since the allocation loop last came round.
    pub fn since_last_turn(&self) -> Duration {
        let last = Duration::from_millis(self.last_turn_ms.load(Ordering::Acquire));
        self.started.elapsed().saturating_sub(last)
    }

    /// Whether every cache has finished its first list.
    pub fn complete(&self) -> bool {
        self.complete.load(Ordering::Acquire)
    }
}

/// Starts leader election and the allocation loop. They run for the life of the runtime (leader
/// election until [`Controller::shutdown`]) and never fail: every error is logged and retried.
pub fn spawn(
    client: Client,
    source: KubeSource,
    cfg: ControllerConfig,
    metrics: Arc<ControllerMetrics>,
) -> Controller {
    let leadership = Arc::new(Leadership::default());
    let liveness = Arc::new(Liveness::default());
    let recorder = Recorder::new(
        client.clone(),
        Reporter { controller: CONTROLLER_NAME.into(), instance: Some(cfg.identity.clone()) },
    );
    let (stop, stopped) = tokio::sync::watch::channel(false);
    let election = ElectionConfig {
        identity: cfg.identity.clone(),
        namespace: cfg.namespace.clone(),
        lease_duration: cfg.lease_duration,
    };
    let elect =
        tokio::spawn(election::elect(client.clone(), election, leadership.clone(), metrics.clone(), stopped));
    let tasks = Tasks { leadership: leadership.clone(), liveness: liveness.clone(), recorder, metrics };
    tokio::spawn(allocate_loop(client, source, cfg, tasks));
    Controller { leadership, liveness, stop, elect }
}

/// What the allocation loop shares with the rest of the controller.
struct Tasks {
    leadership: Arc<Leadership>,
    liveness: Arc<Liveness>,
    recorder: Recorder,
    metrics: Arc<ControllerMetrics>,
}

/// The leader's work, whenever the caches change (coalesced) and every couple of seconds (node
/// Leases expire with time, not with an event); no round when it would plan nothing
/// ([`LeaderState::nothing_to_do`]).
async fn allocate_loop(client: Client, mut source: KubeSource, cfg: ControllerConfig, tasks: Tasks) {
    let Tasks { leadership, liveness, recorder, metrics } = tasks;
    let mut state = LeaderState::new(&cfg.identity);
    let mut deduper: Deduper<ServiceKey> = Deduper::default();
    let mut outbox: Outbox<ServiceKey, publish::ServiceEvent> = Outbox::default();
    let mut was_leader = false;
    // The caches, read while `source` waits for changes.
    let cache = source.clone();
    loop {
        let changed = tokio::select! {
            _ = source.changed() => true,
            _ = tokio::time::sleep(Duration::from_secs(2)) => false,
        };
        let changes = source.take_changes();
        let leading = leadership.get();
        let stepped_down = was_leader && !leading;
        if stepped_down {
            // What only a leader needs (its last round's models, statuses and Events) is let go:
            // a follower holds no copy of every Service beyond its caches. A new term then
            // starts as the first does, with nothing announced and no clean round.
            state.step_down();
            deduper = Deduper::default();
            outbox = Outbox::default();
        }
        was_leader = leading;
        liveness.turned(source.complete());
        if !source.complete() {
            continue;
        }
        if !leading {
            // Every replica remembers the Services it saw, so that as leader it knows which were
            // deleted (their node ports are free) without guessing from one view. (A leader's
            // round records them itself, unless it stepped down before its round.)
            if stepped_down || !changes.services.is_empty() || changes.others.contains("Service") {
                state.observe(&source.snapshot());
            }
            continue;
        }
        let (nodes, leases) = source.nodes_and_leases();
        let view = LeaseView::of(&nodes, &leases, leases_now(&source, &cfg), &cfg);
        if state.nothing_to_do(&changes, &view, Instant::now()) {
            debug!(timer = !changed, services = changes.services.len(), "nothing for a round to do");
            continue;
        }
        let others: Vec<&str> = changes.others.iter().copied().collect();
        debug!(timer = !changed, services = changes.services.len(), others = ?others, "allocation round cause");
        // A Service gone from the cache since is a deletion (the store is written before the
        // journal notes the event).
        let not_ours = |key: &ServiceKey| {
            cache.service(key).is_none_or(|s| model::Standing::of(&s, &cfg.model) == model::Standing::NotOurs)
        };
        if state.can_wait(&changes, &view, not_ours) {
            // Until a change that cannot wait (a deletion's other events, endpoints, renewals
            // and our own writes coming back can), or the time is up. The round reads the whole
            // view when it runs: what arrived meanwhile is in it.
            let until = tokio::time::Instant::now() + NOT_URGENT_WAIT;
            loop {
                tokio::select! {
                    _ = source.changed() => {}
                    _ = tokio::time::sleep_until(until) => break,
                }
                let more = source.take_changes();
                let (nodes, leases) = source.nodes_and_leases();
                let view = LeaseView::of(&nodes, &leases, leases_now(&source, &cfg), &cfg);
                if !state.can_wait(&more, &view, not_ours) {
                    debug!("a change that cannot wait arrived; the round that waited runs now");
                    break;
                }
            }
        }
        let mut again = true;
        while again && leadership.get() {
            let events = Events { deduper: &mut deduper, outbox: &mut outbox, recorder: &recorder };
            again = round(&client, &source, &cfg, &mut state, events, &metrics).await;
            if again {
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    }
}

/// How long a round that gives no Service a number may wait for the next change
/// ([`LeaderState::can_wait`]).
const NOT_URGENT_WAIT: Duration = Duration::from_secs(1);

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
        }
    }
}

/// The time to judge node-Lease expiry by: now, once the Lease cache has been current for a
/// lease duration (after an API outage every Lease looks expired until the agents' renewals
/// arrive); else `None`.
fn leases_now(source: &KubeSource, cfg: &ControllerConfig) -> Option<Timestamp> {
    source.leases_current_for().is_some_and(|d| d >= cfg.lease_duration).then(Timestamp::now)
}

/// What the leader's pure round ([`plan_round`]) keeps from one round to the next.
#[derive(Debug, Default)]
pub struct RoundMemory {
    pub last_good: LastGoodServices,
    /// Each NodePortPool's last valid version ([`crate::pool::LastValid`]).
    pub pools_last_valid: crate::pool::LastValid,
    /// The last round's models, each kept while its Service and EndpointSlice objects are the
    /// same (as the nodes keep theirs).
    pub models: ModelCache,
    /// Each Service's status and Events, kept while its inputs are the same
    /// ([`publish::plan_services`]).
    pub published: publish::Published,
    /// The last rounds' decisions for every Service ([`scope::RoundBook`]), and what every
    /// Service's part read then: a round that finds the same plans only a scope.
    pub book: scope::RoundBook,
    shared: Option<SharedInputs>,
    /// Each EndpointSlice's Service, per object (the slices that changed name theirs), and the
    /// slices of each Service in the last view.
    slices: PerObject<EndpointSlice, Option<ServiceKey>>,
    slices_by_key: foldhash::HashMap<ServiceKey, Vec<Arc<EndpointSlice>>>,
    /// The last good copies the last round planned in place of invalid Services: new objects
    /// every round, so a scoped round lets go of what they left ([`plan_round`]).
    substituted: Vec<Arc<Service>>,
}

impl RoundMemory {
    /// Keeps each EndpointSlice's Service and each Service's slices; returns the Services whose
    /// slices changed since the last call.
    fn observe_slices(&mut self, slices: &[Arc<EndpointSlice>]) -> Vec<ServiceKey> {
        let service = |s: &Arc<EndpointSlice>| model::slice_service(s).map(|(ns, n)| ServiceKey::new(ns, n));
        let pass = self.slices.pass_changes(slices, service);
        let mut changed = Vec::new();
        for (object, key) in pass.dropped {
            let Some(key) = key else { continue };
            if let Some(list) = self.slices_by_key.get_mut(&key) {
                list.retain(|s| !Arc::ptr_eq(s, &object));
                if list.is_empty() {
                    self.slices_by_key.remove(&key);
                }
            }
            changed.push(key);
        }
        for (object, key) in pass.computed {
            let Some(key) = key else { continue };
            self.slices_by_key.entry(key.clone()).or_default().push(object);
            changed.push(key);
        }
        changed
    }
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
        let services = sorted.iter().filter_map(|k| holders.of_key(k)).map(|(s, _)| Arc::clone(s)).collect();
        let slices = sorted
            .iter()
            .filter_map(|k| self.slices_by_key.get(*k))
            .flat_map(|list| list.iter().cloned())
            .collect();
        let dropped = (holders.changes().dropped.iter().map(|(o, _)| Arc::clone(o)))
            .chain(self.substituted.iter().cloned())
            .collect();
        RoundObjects { services, slices, dropped }
    }
}

/// What every Service's part of a round reads besides its own objects: a round plans only a
/// scope ([`scope::RoundBook::closure`]) when these are what the last round read.
#[derive(Debug, PartialEq)]
struct SharedInputs {
    /// Every Node's name, labels and addresses, hashed.
    nodes: u64,
    pools: crate::pool::PoolContext,
    invalid_pools: Vec<crate::pool::InvalidPool>,
    serving: BTreeMap<String, nodes::ServingNode>,
    listening: BTreeMap<(crate::domain::Protocol, u16), String>,
    unreported: Vec<String>,
    published: BTreeMap<String, nodes::PoolSelections>,
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

    fn get(&self, block: &u16) -> Option<&Option<String>> {
        self.0.get(block)
    }

    fn insert(&mut self, block: u16, version: Option<String>) {
        self.0.insert(block, version);
    }
}

/// What a leader keeps between rounds.
pub struct LeaderState {
    pub memory: RoundMemory,
    /// The resourceVersions the last round's Service writes made ([`write_services`]).
    echoes: HashMap<ServiceKey, Vec<String>>,
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
    /// The registry as the last round read it, parsed ([`read_registry`]).
    registry_read: Option<claims::ReadRegistry>,
    /// Names this process in the claims it leaves pending.
    pub token: claims::Token,
    /// Registry problems last logged (each logged once while it lasts).
    logged: std::collections::BTreeSet<String>,
    /// The nodes the last round waited for ([`RoundPlan::listeners_unreported`]; logged once).
    unreported: Vec<String>,
}

impl LeaderState {
    pub fn new(identity: &str) -> LeaderState {
        let started = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
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
            token: claims::Token::new(identity, std::process::id(), started.as_nanos()),
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
            && self.whole_round_within(now)
            && changes.others.iter().all(|kind| *kind == "Lease")
            && self.only_echoes(changes)
            && self.lease_view.as_ref() == Some(view)
    }

    /// Whether the last whole round started less than [`FULL_ROUND_EVERY`] before `now`.
    fn whole_round_within(&self, now: Instant) -> bool {
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

    /// Whether the round these changes call for may wait a little ([`NOT_URGENT_WAIT`], or until
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
    /// linear in the Services (~80 ms at 10,000), and a create arriving while a deletion's round
    /// ran waited for all of it.
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
        self.echoes = HashMap::new();
        self.clean = false;
        self.lease_view = None;
        self.last_whole_round = None;
    }

    /// Records the Services of a view (see [`claims::Keeper::observe_view`]), as a follower:
    /// nothing is kept of them but their owners.
    pub fn observe(&mut self, snap: &KubeSnapshot) {
        let holders: Vec<claims::Holder> = snap.services.iter().map(|s| claims::Holder::of(s)).collect();
        self.claims.observe_view(&holders, Instant::now());
    }

    /// [`LeaderState::observe`] for a round, from what changed since the last one: each holder
    /// kept per object ([`LeaderState::holders`]).
    fn observe_for_round(&mut self, snap: &KubeSnapshot, at: Instant) {
        let holders = self.holders.of_view(&snap.services);
        self.claims.observe_changes(self.holders.changes(), &holders, at);
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
        let touched = self.holders.changes().numbers();
        let expired = match registry {
            Some(r) => {
                self.claims.expired(r, &self.holders.held(), touched.as_ref(), services_current, clock.at)
            }
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
        let forged = registry.is_some_and(|r| self.holders.changes().name_anothers(r, &gone));
        let may_scope = was_clean
            && self.whole_round_within(clock.at)
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

/// The round's decisions the pools' status is computed from ([`super::pools::StatusRound`]).
#[derive(Debug, Clone)]
pub struct PoolRound {
    pub ctx: crate::pool::PoolContext,
    pub invalid: Vec<crate::pool::InvalidPool>,
    pub allocations: Allocations,
    pub assignment: Option<crate::pool::Assignment>,
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
    pub gone_claims: Option<&'a [u16]>,
    pub expired: &'a std::collections::BTreeSet<u16>,
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
/// changed and those that share a number with them (docs/design.md, "The round scoped to what
/// changed"); the plan says which ([`RoundPlan::scope`]).
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
    let slices_changed = memory.observe_slices(&snap.slices);
    // Node port pools: which pool each Service gets (a Service none accepts is not allocated, and
    // says why), and which nodes its status may list.
    let (pool_ctx, invalid_pools) = super::pools::context(
        snap,
        &mut memory.pools_last_valid,
        cfg.port_range,
        None,
        cfg.model.servicelb_labels,
    );
    let serving = nodes::serving_nodes(&snap.nodes, &snap.leases, leases_now, &cfg.node_addresses);
    // What processes listen on, on any node (their Leases say): never handed out, and a request
    // for it is refused. Each node refuses locally anyway, whatever is decided here.
    let listening = nodes::listening_ports(&snap.leases);
    let unreported = nodes::listeners_unreported(&snap.leases, leases_now);
    let shared = SharedInputs {
        nodes: node_facts(&snap.nodes),
        pools: pool_ctx.clone(),
        invalid_pools: invalid_pools.clone(),
        serving: serving.clone(),
        listening: listening.clone(),
        unreported: unreported.clone(),
        published: nodes::published_pool_addresses(&snap.leases).0,
    };
    let same_shared = memory.shared.as_ref() == Some(&shared);
    memory.shared = Some(shared);
    // The Services this round plans: all of them, or a scope.
    let scope: Option<foldhash::HashSet<ServiceKey>> =
        (may_scope && same_shared && memory.models.has_context(&ctx) && !pool_ctx.set.bounds_namespaces())
            .then(|| {
                let changes = holders.changes();
                let seed = |key: &ServiceKey, numbers: &std::collections::BTreeSet<u16>| scope::Seed {
                    key: key.clone(),
                    numbers: numbers.clone(),
                };
                let mut seeds: Vec<scope::Seed> =
                    changes.added.iter().map(|h| seed(&h.key, &h.numbers)).collect();
                seeds.extend(changes.dropped.iter().map(|(_, h)| seed(&h.key, &h.numbers)));
                seeds.extend(slices_changed.iter().map(|k| seed(k, &Default::default())));
                memory.book.closure(seeds, &held, |k| holders.of_key(k).map(|(_, h)| &h.numbers))
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
            let subst = memory.last_good.apply(&snap.services, &cfg.model);
            let services = subst.services.clone();
            (subst, RoundObjects { services, slices: snap.slices.clone(), dropped: Vec::new() })
        }
        Some(keys) => {
            let objects = memory.objects_of(keys, holders);
            let gone: Vec<Arc<Service>> =
                holders.changes().dropped.iter().map(|(o, _)| Arc::clone(o)).collect();
            let subst = memory.last_good.apply_within(&objects.services, &gone, &cfg.model);
            let services = subst.services.clone();
            (subst, RoundObjects { services, ..objects })
        }
    };
    memory.substituted = subst.substituted;
    let out = match &scope {
        Some(keys) => memory.models.build_scoped(keys, &services, &slices, &ctx).unwrap_or_default(),
        None => memory.models.build(&services, &slices, &ctx),
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
    // Among what the registry left them (numbers no claim names: the registry lost).
    let duplicates = dupes::duplicates(&all[..out.services.len()]);
    let assignment = (!pool_ctx.set.implicit)
        .then(|| crate::pool::assign_services(&pool_ctx, &services, &all, &Allocations::new()));
    let all: Vec<Arc<model::LbService>> = match &assignment {
        Some(a) => all.into_iter().filter(|s| a.has_pool(&s.key)).collect(),
        None => all,
    };
    let pool_nodes = assignment.as_ref().map(|a| super::pools::selected_nodes(&pool_ctx, a, &snap.nodes));
    let pool_nodes = super::pools::narrow_by_servicelb(&pool_ctx, &services, &snap.nodes, pool_nodes);
    let pool_addresses = assignment.as_ref().map(|a| {
        let published = super::pools::published_selections(&snap.leases);
        super::pools::published_addresses(&pool_ctx, a, &snap.nodes, &published, &cfg.node_addresses)
    });
    let constraints = alloc::Constraints {
        policy: Some(&cfg.policy.ports),
        in_use: Some(&in_use),
        pools: assignment.as_ref().map(|a| &a.ranges),
        elsewhere: scope.as_ref().map(|keys| memory.book.elsewhere(keys)),
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
        now,
    };
    let (mut writes, mut events) = match &scope {
        None => publish::plan_services(&round, &duplicates, &mut memory.published),
        Some(_) => publish::plan_services_within(&round, &duplicates, &mut memory.published, &dropped),
    };
    // The registry side of the annotation writes: the holders of the Services written (a map of
    // those only, not of every Service).
    let annotated: foldhash::HashSet<&ServiceKey> =
        writes.iter().filter(|w| w.annotation.is_some()).map(|w| &w.key).collect();
    let by_key: foldhash::HashMap<&ServiceKey, &claims::Holder> =
        annotated.iter().filter_map(|k| Some((*k, &*holders.of_key(k)?.1))).collect();
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
    let mut claim_plan = match (registry.registry, &scope) {
        (Some(r), None) => claims::plan(r, &held, &changes, registry.token, registry.gone, registry.expired),
        (Some(r), Some(_)) => {
            // The numbers the scope's Services hold: every other one has its claim.
            let numbers = scope_numbers.as_ref().expect("a scope's numbers");
            claims::plan_within(
                r,
                &held,
                &changes,
                registry.token,
                registry.gone,
                registry.gone_claims,
                numbers,
            )
        }
        (None, _) => claims::ClaimPlan {
            blocked: changes
                .iter()
                .filter(|c| !c.after.is_subset(&c.holder.numbers))
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
            memory.book.replace(allocations.clone(), unsettled, pool_ranges);
            (!snap.pools.is_empty()).then_some(PoolRound {
                ctx: pool_ctx,
                invalid: invalid_pools,
                allocations,
                assignment,
                serving,
            })
        }
        Some(keys) => {
            memory.book.patch(keys, allocations, unsettled, pool_ranges);
            // The pools' status counts every Service's numbers: the book's.
            (!snap.pools.is_empty()).then(|| PoolRound {
                ctx: pool_ctx,
                invalid: invalid_pools,
                allocations: memory.book.allocations().clone(),
                assignment: assignment.map(|_| crate::pool::Assignment {
                    ranges: memory.book.pools().clone(),
                    problems: Vec::new(),
                }),
                serving,
            })
        }
    };
    RoundPlan { writes, events, claims: claim_plan, pools, listeners_unreported: unreported, scope }
}

/// One round of the leader's work on `snap`: read the node-port registry, decide
/// ([`plan_round`]), write the registry (resourceVersion precondition: a 409 means another
/// leader wrote it since, and nothing else is written), then the Services, then resolve the
/// claims left pending. Returns the Events to record, and `true` when the round is to be run
/// again at once, from a fresh view: a write met a stale resourceVersion, or statuses were left
/// for the next round.
pub async fn leader_round(
    client: &Client,
    cfg: &ControllerConfig,
    snap: &KubeSnapshot,
    state: &mut LeaderState,
    leases_now: Option<Timestamp>,
    services_current: bool,
    metrics: Option<&ControllerMetrics>,
) -> RoundOutcome {
    let started = Instant::now();
    let read = match read_registry(client, &cfg.namespace, state.registry_read.take()).await {
        Ok((r, problems)) => {
            let problems: std::collections::BTreeSet<String> = problems.into_iter().collect();
            for p in problems.difference(&state.logged) {
                warn!(problem = %p, "node-port registry");
            }
            state.logged = problems;
            Some(r)
        }
        Err(e) => {
            count_api_error(metrics, "registry");
            warn!(error = %e, "cannot read the node-port registry; no new node port is written this round");
            None
        }
    };
    let registry = read.as_ref().map(|r| &r.registry);
    let registry_read = started.elapsed();
    let BegunRound { mut plan, mut versions, unreported_changed } = state.begin_round(
        snap,
        cfg,
        registry,
        RoundClock { leases_now, now: Timestamp::now(), at: started },
        services_current,
    );
    let planned = started.elapsed();
    if unreported_changed && !plan.listeners_unreported.is_empty() {
        info!(
            nodes = %plan.listeners_unreported.join(","),
            waiting = plan.claims.blocked.len(),
            "no new node port until these nodes report their listening ports (their agents just started)"
        );
    }
    // The registry first: if another leader changed it since we read it, we write nothing.
    for (b, block) in &plan.claims.blocks {
        match write_block(client, &cfg.namespace, *b, block).await {
            Ok(written) => {
                if let Some(v) = versions.as_mut() {
                    v.insert(*b, written);
                }
            }
            Err(e) if is_conflict(&e) => {
                debug!(block = b, "node-port registry changed since read (409); retrying the round");
                return RoundOutcome { again: true, ..Default::default() };
            }
            Err(e) => {
                count_api_error(metrics, "registry");
                warn!(error = %e, block = b, "cannot write the node-port registry; retrying the round later");
                return RoundOutcome::default();
            }
        }
    }
    // Allocations first; a status that only follows (all of them, when the node serving every
    // Service starts) is written for at most STATUS_WRITES_FOR a round, the rest in the rounds
    // that follow at once, so that a new Service never waits behind thousands of them.
    plan.writes.sort_by_key(|w| w.annotation.is_none());
    let status_until = Instant::now() + STATUS_WRITES_FOR;
    let outcomes = write_services(client, &plan.writes, metrics, &mut state.echoes, status_until).await;
    let deferred: std::collections::BTreeSet<&ServiceKey> = (plan.writes.iter().zip(&outcomes))
        .filter(|(_, o)| **o == WriteOutcome::Deferred)
        .map(|(w, _)| &w.key)
        .collect();
    if !deferred.is_empty() {
        debug!(deferred = deferred.len(), "status writes left for the next round");
        plan.events.retain(|e| !deferred.contains(&e.service));
    }
    let mut stale = outcomes.iter().any(|o| matches!(o, WriteOutcome::Conflict | WriteOutcome::Deferred));
    let written = outcomes.iter().all(|o| *o == WriteOutcome::Written);
    let resolved =
        resolve_claims(client, &cfg.namespace, &plan, &outcomes, &state.token, metrics, &mut versions).await;
    state.end_round(registry, written && resolved, versions);
    if let Some(p) = &plan.pools {
        let pools = super::pools::StatusRound {
            snap,
            ctx: &p.ctx,
            invalid: &p.invalid,
            allocations: &p.allocations,
            assignment: p.assignment.as_ref(),
            serving: &p.serving,
        };
        match super::pools::write_statuses(client, &pools).await {
            Ok(s) => stale |= s,
            Err(e) => {
                state.next_round_whole();
                count_api_error(metrics, "nodeportpool");
                warn!(error = %e, "cannot update NodePortPool status");
            }
        }
    }
    state.registry_read = read;
    let ms = |d: std::time::Duration| d.as_secs_f64() * 1e3;
    let (read, plan_ms, writes) =
        (ms(registry_read), ms(planned - registry_read), ms(started.elapsed() - planned));
    debug!(
        phases = format!("registry={read:.2} plan={plan_ms:.2} writes={writes:.2}"),
        "allocation round breakdown (ms)"
    );
    RoundOutcome { again: stale, events: std::mem::take(&mut plan.events), scope: plan.scope }
}

/// How a leader round ended ([`leader_round`]).
#[derive(Debug, Default)]
pub struct RoundOutcome {
    /// Run the round again at once, from a fresh view: a write met a stale resourceVersion, or
    /// statuses were left for the next round.
    pub again: bool,
    /// The Events to record.
    pub events: Vec<publish::ServiceEvent>,
    /// The Services the round planned, when not all ([`RoundPlan::scope`]): the Events are theirs.
    pub scope: Option<foldhash::HashSet<ServiceKey>>,
}

/// How the leader records Service Events: state Events once per change ([`Deduper`]),
/// transitions until sent ([`Outbox`]).
struct Events<'a> {
    deduper: &'a mut Deduper<ServiceKey>,
    outbox: &'a mut Outbox<ServiceKey, publish::ServiceEvent>,
    recorder: &'a Recorder,
}

/// One allocation + status round; `true` when a write met a stale resourceVersion.
async fn round(
    client: &Client,
    source: &KubeSource,
    cfg: &ControllerConfig,
    state: &mut LeaderState,
    ev: Events<'_>,
    metrics: &ControllerMetrics,
) -> bool {
    let started = Instant::now();
    let snap = source.snapshot();
    let RoundOutcome { again: stale, events, scope } = leader_round(
        client,
        cfg,
        &snap,
        state,
        leases_now(source, cfg),
        source.services_current(),
        Some(metrics),
    )
    .await;
    debug!(ms = started.elapsed().as_secs_f64() * 1e3, "allocation round");
    // Side by side, and for at most EVENTS_FOR a round: an install into 10,000 Services records
    // 10,000 Events, and the Services created meanwhile are not to wait for them. What is not
    // sent stays pending (deduper, outbox) for the round that follows at once.
    use futures::StreamExt as _;
    let until = Instant::now() + EVENTS_FOR;
    let mut next =
        events_to_send(ev.deduper, ev.outbox, &events, |k| source.service(k).is_some(), scope.as_ref())
            .into_iter();
    let mut in_flight = futures::stream::FuturesUnordered::new();
    let mut left = false;
    loop {
        while in_flight.len() < WRITES_IN_FLIGHT
            && let Some(e) = next.next()
        {
            if Instant::now() >= until {
                left = true;
                break;
            }
            let Some(svc) = source.service(&e.service) else { continue };
            in_flight.push(send_event(ev.recorder, metrics, svc, e));
        }
        let Some((e, sent)) = in_flight.next().await else { break };
        // Recorded only once sent: an Event the API refused is tried again next round.
        if sent {
            let key = event_key(&e);
            ev.outbox.sent(&key);
            ev.deduper.sent(key);
        } else {
            state.next_round_whole();
        }
    }
    if left {
        debug!("Events left for the next round");
    }
    if left || !ev.outbox.is_empty() {
        state.next_round_whole();
    }
    stale || left
}

/// How long a round records Events ([`round`]).
const EVENTS_FOR: Duration = Duration::from_secs(1);

/// Records `e` on `svc` ([`publish_event`]); whether the API accepted it.
async fn send_event(
    recorder: &Recorder,
    metrics: &ControllerMetrics,
    svc: Arc<Service>,
    e: publish::ServiceEvent,
) -> (publish::ServiceEvent, bool) {
    let sent = publish_event(
        recorder,
        &metrics.kube.api_errors,
        &svc.object_ref(&()),
        e.warning,
        e.reason,
        &e.message,
    )
    .await;
    (e, sent)
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
/// with [`Deduper::sent`] and [`Outbox::sent`]. `within`: the round planned these Services
/// only ([`RoundPlan::scope`]): the others' states are as recorded.
pub fn events_to_send(
    deduper: &mut Deduper<ServiceKey>,
    outbox: &mut Outbox<ServiceKey, publish::ServiceEvent>,
    events: &[publish::ServiceEvent],
    exist: impl Fn(&ServiceKey) -> bool,
    within: Option<&foldhash::HashSet<ServiceKey>>,
) -> Vec<publish::ServiceEvent> {
    let mut sending: Vec<publish::ServiceEvent> = Vec::new();
    let pending = match within {
        None => deduper.pending(events, event_triple),
        Some(scope) => deduper.pending_within(events, event_triple, scope),
    };
    for e in pending {
        match publish::ONE_TIME_REASONS.contains(&e.reason) {
            true => outbox.add(event_key(e), e.clone()),
            false => sending.push(e.clone()),
        }
    }
    outbox.retain_objects(exist);
    sending.extend(outbox.waiting().map(|(_, e)| e.clone()));
    sending
}

fn count_api_error(metrics: Option<&ControllerMetrics>, operation: &str) {
    if let Some(m) = metrics {
        m.kube.api_errors.with_label_values(&[operation]).inc();
    }
}

/// How one Service write ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WriteOutcome {
    Written,
    /// 409: the Service changed since it was read.
    Conflict,
    /// The API said no (a 4xx other than 408) to the annotation patch, or a status-only write
    /// failed.
    Refused,
    /// No answer to the annotation patch, or one that may come after a commit (5xx, 408): it
    /// may or may not have been applied.
    Unknown,
    /// The annotation was written, the status was not.
    StatusFailed,
    /// Not tried: a status-only write when the round's time for those was up (the next round,
    /// at once, writes it).
    Deferred,
}

impl WriteOutcome {
    /// Whether the annotation, if the write had one, is on the Service now.
    fn claims(self) -> claims::Outcome {
        match self {
            WriteOutcome::Written | WriteOutcome::StatusFailed => claims::Outcome::Written,
            WriteOutcome::Conflict | WriteOutcome::Refused | WriteOutcome::Deferred => {
                claims::Outcome::Refused
            }
            WriteOutcome::Unknown => claims::Outcome::Unknown,
        }
    }
}

/// The Service writes of one round, each with its resourceVersion precondition, in order; how
/// each ended. A 409 means the Service changed since it was read (the round is retried from a
/// fresh cache); other failures are logged and counted (`metrics`), and retried at the next round.
/// `echoes`: the resourceVersions the writes made, per Service (what the watch will bring back).
pub async fn write_services(
    client: &Client,
    writes: &[ServiceWrite],
    metrics: Option<&ControllerMetrics>,
    echoes: &mut HashMap<ServiceKey, Vec<String>>,
    status_until: Instant,
) -> Vec<WriteOutcome> {
    use futures::StreamExt as _;
    // Each Service's two patches in order; Services side by side, results in `writes`' order.
    // Each write's future is made when it starts (a round can write 50,000 Services).
    let mut in_flight = futures::stream::FuturesOrdered::new();
    let mut next = writes.iter();
    let mut results = Vec::with_capacity(writes.len());
    loop {
        while in_flight.len() < WRITES_IN_FLIGHT
            && let Some(w) = next.next()
        {
            in_flight.push_back(write_one(client, w, status_until));
        }
        match in_flight.next().await {
            Some(r) => results.push(r),
            None => break,
        }
    }
    let mut out = Vec::with_capacity(writes.len());
    for (w, result) in writes.iter().zip(results) {
        let Some((annotated, result, made)) = result else {
            out.push(WriteOutcome::Deferred);
            continue;
        };
        echoes.entry(w.key.clone()).or_default().extend(made);
        let outcome = match (annotated, result) {
            (_, Ok(())) => WriteOutcome::Written,
            (annotated, Err(e)) => {
                if is_conflict(&e) {
                    debug!(service = %w.key, "Service changed since read (409); retrying on the next round");
                } else {
                    count_api_error(metrics, "service");
                    warn!(service = %w.key, error = %e, "cannot update Service");
                }
                failed_write(annotated, w.annotation.is_some(), &e)
            }
        };
        out.push(outcome);
    }
    let written = out.iter().filter(|o| **o != WriteOutcome::Deferred).count();
    if written > 0 {
        info!(services = written, "published allocations and status");
    }
    out
}

/// How a write that failed ended. `annotated`: its annotation patch was applied (the status
/// patch failed); `patched_annotation`: it had one to apply.
///
/// An answer from the API is final only when it says the request was not carried out: a 4xx
/// other than 408 (timeout). A 5xx (an etcd timeout, a 504 "may still be processing") can come
/// after the write committed, like a lost connection; taking it for a refusal would drop the
/// claim of a number the Service then holds, and another Service could be given it.
fn failed_write(annotated: bool, patched_annotation: bool, e: &kube::Error) -> WriteOutcome {
    match (annotated, e) {
        (true, _) => WriteOutcome::StatusFailed,
        (false, e) if is_conflict(e) => WriteOutcome::Conflict,
        (false, _) if !patched_annotation => WriteOutcome::Refused,
        (false, kube::Error::Api(s)) if (400..500).contains(&s.code) && s.code != 408 => {
            WriteOutcome::Refused
        }
        (false, _) => WriteOutcome::Unknown,
    }
}

/// Service writes the leader keeps in flight at once. One at a time, a round that allocates a
/// whole cluster (an install into 10,000 waiting Services) took 37 s of the API server's ~3.7 ms
/// round trip per Service; the API server's default limit is 200 mutating requests in flight,
/// shared by everyone, of which this takes a few (docs/benchmarks.md).
const WRITES_IN_FLIGHT: usize = 8;

/// How long a round writes statuses that come with no allocation ([`leader_round`]).
const STATUS_WRITES_FOR: Duration = Duration::from_secs(1);

/// [`write`], with the resourceVersions it made; `None` when it was not tried (a status-only
/// write after `status_until`).
async fn write_one(client: &Client, w: &ServiceWrite, status_until: Instant) -> Option<WriteResult> {
    if w.annotation.is_none() && Instant::now() >= status_until {
        return None;
    }
    let mut made = Vec::new();
    let (annotated, result) = write(client, w, &mut made).await;
    Some((annotated, result, made))
}

/// Whether the annotation was patched, how the write ended, the resourceVersions it made.
type WriteResult = (bool, Result<(), kube::Error>, Vec<String>);

/// Annotation first (merge patch, resourceVersion precondition), then status through the status
/// subresource with the resourceVersion the first patch returned. Also says whether an
/// annotation patch was applied (the status may still have failed). The resourceVersion of
/// each patched object goes to `made`.
async fn write(client: &Client, w: &ServiceWrite, made: &mut Vec<String>) -> (bool, Result<(), kube::Error>) {
    let api: Api<Service> = Api::namespaced(client.clone(), &w.key.namespace);
    let params = PatchParams { field_manager: Some(FIELD_MANAGER.into()), ..Default::default() };
    let mut rv = w.resource_version.clone().filter(|_| PRECONDITIONS);
    let mut annotated = false;
    if let Some(value) = &w.annotation {
        let mut patch = json!({"metadata": {"annotations": {ANNOTATION_ALLOCATED: value}}});
        if let Some(rv) = &rv {
            patch["metadata"]["resourceVersion"] = json!(rv);
        }
        match api.patch(&w.key.name, &params, &Patch::Merge(&patch)).await {
            Ok(svc) => {
                made.extend(svc.metadata.resource_version.clone());
                rv = svc.metadata.resource_version.filter(|_| PRECONDITIONS);
            }
            Err(e) => return (false, Err(e)),
        }
        annotated = true;
        match value {
            Some(v) => info!(service = %w.key, ports = %v, "allocated node ports"),
            None => info!(service = %w.key, "released node ports (no longer ours)"),
        }
    }
    if let Some(st) = &w.status {
        let mut patch =
            json!({"status": {"loadBalancer": {"ingress": st.ingress}, "conditions": st.conditions}});
        if let Some(rv) = &rv {
            patch["metadata"] = json!({"resourceVersion": rv});
        }
        match api.patch_status(&w.key.name, &params, &Patch::Merge(&patch)).await {
            Ok(svc) => made.extend(svc.metadata.resource_version),
            Err(e) => return (annotated, Err(e)),
        }
    }
    (annotated, Ok(()))
}

/// Whether the leader's writes (node-port registry and Services) carry their resourceVersion
/// preconditions. Always, except in the build of the race harness that shows what they prevent
/// (`--features race-demo-without-preconditions`, never for use).
const PRECONDITIONS: bool = !cfg!(feature = "race-demo-without-preconditions");

/// Every block of the node-port registry (Leases labelled [`claims::LABEL`]), with the problems
/// found reading them (a block read again at the same resourceVersion is not parsed again).
async fn read_registry(
    client: &Client,
    namespace: &str,
    kept: Option<claims::ReadRegistry>,
) -> Result<(claims::ReadRegistry, Vec<String>), kube::Error> {
    let api: Api<Lease> = Api::namespaced(client.clone(), namespace);
    let list = api.list(&kube::api::ListParams::default().labels(claims::LABEL)).await?;
    let before = kept.clone();
    let (mut read, mut problems) = claims::ReadRegistry::read(&list.items, kept);
    // A block whose Lease was deleted is written again from what this leader last read, not
    // rebuilt from the annotations (which any Service owner may have written).
    if let Some(before) = &before {
        for b in read.keep_lost(before) {
            problems.push(format!(
                "Lease {} (node-port registry) was deleted: written again from the claims last read",
                claims::lease_name(b)
            ));
        }
    }
    Ok((read, problems))
}

/// Writes one registry block: created when it did not exist, else replaced with the
/// resourceVersion it was read at (409 when anyone wrote it since). Returns the
/// resourceVersion the write made.
async fn write_block(
    client: &Client,
    namespace: &str,
    block: u16,
    b: &claims::Block,
) -> Result<Option<String>, kube::Error> {
    let api: Api<Lease> = Api::namespaced(client.clone(), namespace);
    let name = claims::lease_name(block);
    let lease = |resource_version: Option<String>| Lease {
        metadata: ObjectMeta {
            name: Some(name.clone()),
            labels: Some([(claims::LABEL.to_string(), "true".to_string())].into()),
            annotations: Some([(claims::ANNOTATION.to_string(), claims::format(&b.claims))].into()),
            resource_version,
            ..Default::default()
        },
        spec: None,
    };
    if !PRECONDITIONS {
        // Last writer wins: the Lease API insists on a resourceVersion, so take the current one,
        // again until no one wrote in between.
        for _ in 0..10 {
            let current = api.get_opt(&name).await?.and_then(|l| l.metadata.resource_version);
            let r = match &current {
                None => api.create(&post_params(), &lease(None)).await,
                Some(_) => api.replace(&name, &post_params(), &lease(current.clone())).await,
            };
            match r {
                Err(kube::Error::Api(e)) if e.code == 409 => continue,
                r => return r.map(|l| l.metadata.resource_version),
            }
        }
    }
    let written = match &b.resource_version {
        None => api.create(&post_params(), &lease(None)).await?,
        Some(_) => api.replace(&name, &post_params(), &lease(b.resource_version.clone())).await?,
    };
    Ok(written.metadata.resource_version)
}

/// After the Service writes: each claim left pending by this round becomes what the write's
/// outcome says ([`claims::resolve`]), on a fresh read of its block (retried on 409; what is
/// not resolved here is settled after [`claims::GRACE`]). Whether every block was resolved.
/// `versions`: each block's resourceVersion as this leader left it, kept up to date (`None`
/// when a block read shows a write of someone else's).
async fn resolve_claims(
    client: &Client,
    namespace: &str,
    plan: &RoundPlan,
    outcomes: &[WriteOutcome],
    token: &claims::Token,
    metrics: Option<&ControllerMetrics>,
    versions: &mut Option<RegistryVersions>,
) -> bool {
    let mut resolved = true;
    let mut by_block: BTreeMap<u16, Vec<(&claims::ServiceClaims, claims::Outcome)>> = BTreeMap::new();
    for (w, o) in plan.writes.iter().zip(outcomes) {
        let Some(sc) = plan.claims.services.get(&w.key) else { continue };
        let numbers = sc.adds.iter().map(|(n, _)| *n).chain(sc.removes.iter().copied());
        let blocks: std::collections::BTreeSet<u16> = numbers.map(claims::block_of).collect();
        for b in blocks {
            by_block.entry(b).or_default().push((sc, o.claims()));
        }
    }
    let api: Api<Lease> = Api::namespaced(client.clone(), namespace);
    for (b, items) in by_block {
        for attempt in 0..5 {
            let result = async {
                let Some(lease) = api.get_opt(&claims::lease_name(b)).await? else {
                    *versions = None;
                    return Ok(true);
                };
                if versions.as_ref().and_then(|v| v.get(&b)) != Some(&lease.metadata.resource_version) {
                    *versions = None;
                }
                let value = lease.metadata.annotations.as_ref().and_then(|a| a.get(claims::ANNOTATION));
                let (mut c, _) = claims::parse(value.map_or("", String::as_str));
                let mut changed = false;
                for (sc, outcome) in &items {
                    changed |= claims::resolve(&mut c, sc, *outcome, token);
                }
                if !changed {
                    return Ok(true);
                }
                let block =
                    claims::Block { claims: Arc::new(c), resource_version: lease.metadata.resource_version };
                let written = write_block(client, namespace, b, &block).await?;
                if let Some(v) = versions.as_mut() {
                    v.insert(b, written);
                }
                Ok(true)
            }
            .await;
            match result {
                Ok(_) => break,
                Err(e) if is_conflict(&e) && attempt < 4 => {
                    *versions = None;
                    continue;
                }
                Err(e) => {
                    *versions = None;
                    count_api_error(metrics, "registry");
                    warn!(error = %e, block = b, "cannot resolve pending node-port claims; they settle after the grace period");
                    resolved = false;
                    break;
                }
            }
        }
    }
    resolved
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Only an answer that says the write was not carried out gives its claims back; a 5xx or a
    /// timeout may come after the commit, so its claims are held until the Service is read.
    #[test]
    fn a_failed_write_is_refused_only_when_the_api_says_it_was_not_done() {
        let api = |code: u16| {
            kube::Error::Api(kube::core::Status { code, ..kube::core::Status::failure("answer", "") }.boxed())
        };
        let lost = || kube::Error::Service(std::io::Error::other("connection reset").into());
        // (name, annotation applied, had one to apply, error, outcome)
        let cases = [
            ("409 on the annotation", false, true, api(409), WriteOutcome::Conflict),
            ("422 invalid", false, true, api(422), WriteOutcome::Refused),
            ("403 forbidden", false, true, api(403), WriteOutcome::Refused),
            ("404 deleted", false, true, api(404), WriteOutcome::Refused),
            ("429 throttled", false, true, api(429), WriteOutcome::Refused),
            ("408 timeout", false, true, api(408), WriteOutcome::Unknown),
            ("500 etcd timeout", false, true, api(500), WriteOutcome::Unknown),
            ("504 may still be processing", false, true, api(504), WriteOutcome::Unknown),
            ("connection lost", false, true, lost(), WriteOutcome::Unknown),
            ("status only, connection lost", false, false, lost(), WriteOutcome::Refused),
            ("status only, 500", false, false, api(500), WriteOutcome::Refused),
            ("status failed after the annotation", true, true, api(500), WriteOutcome::StatusFailed),
        ];
        for (name, annotated, patched, e, want) in cases {
            assert_eq!(failed_write(annotated, patched, &e), want, "{name}");
        }
    }

    /// A round is skipped only after a clean, recent round, for the very versions its writes
    /// made and for Lease renewals that change nothing the round reads.
    #[test]
    fn a_round_is_skipped_only_when_it_would_plan_nothing() {
        let web = ServiceKey::new("default", "web");
        let db = ServiceKey::new("default", "db");
        let internal = ServiceKey::new("default", "internal");
        let view = |nodes: &[&str]| LeaseView {
            serving: nodes
                .iter()
                .map(|n| {
                    let node = nodes::ServingNode {
                        name: n.to_string(),
                        families: [crate::domain::Family::Ipv4].into(),
                        addresses: vec!["192.0.2.1".parse().unwrap()],
                    };
                    (n.to_string(), node)
                })
                .collect(),
            listening: BTreeMap::new(),
            unreported: Vec::new(),
            published: BTreeMap::new(),
        };
        let t0 = Instant::now();
        let mut state = LeaderState::new("node-a");
        state.echoes = [(web.clone(), vec!["11".to_string(), "12".to_string()])].into();
        state.lease_view = Some(view(&["a", "b"]));
        state.last_whole_round = Some(t0);
        let changes = |services: &[(&ServiceKey, Option<&str>)], others: &[&'static str]| Journal {
            services: services.iter().map(|(k, rv)| ((*k).clone(), rv.map(String::from))).collect(),
            others: others.iter().copied().collect(),
            truncated: false,
        };
        let (soon, late) = (t0 + Duration::from_secs(2), t0 + FULL_ROUND_EVERY);
        let echo = || changes(&[(&web, Some("11")), (&web, Some("12"))], &[]);
        let last = || changes(&[(&web, Some("12"))], &[]);
        const AB: &[&str] = &["a", "b"];
        // (name, last round clean, changes, the serving nodes now, now, skip)
        type Case = (&'static str, bool, Journal, &'static [&'static str], Instant, bool);
        let cases: Vec<Case> = vec![
            ("both writes came back", true, echo(), AB, soon, true),
            ("the last write came back", true, last(), AB, soon, true),
            ("a timer wake, nothing changed", true, changes(&[], &[]), AB, soon, true),
            ("a renewal that changes nothing read", true, changes(&[], &["Lease"]), AB, soon, true),
            ("a node's Lease expired", true, changes(&[], &[]), &["a"], soon, false),
            ("the last round failed something", false, echo(), AB, soon, false),
            ("the last whole round is too old", true, echo(), AB, late, false),
            ("someone else wrote it after us", true, changes(&[(&web, Some("13"))], &[]), AB, soon, false),
            ("another Service changed", true, changes(&[(&db, Some("5"))], &[]), AB, soon, false),
            ("an EndpointSlice changed", true, changes(&[], &["EndpointSlice"]), AB, soon, false),
            ("a Service deleted or relisted", true, changes(&[], &["Service"]), AB, soon, false),
            ("no resourceVersion", true, changes(&[(&web, None)], &[]), AB, soon, false),
        ];
        for (name, clean, journal, serving, now, want) in cases {
            state.clean = clean;
            assert_eq!(state.nothing_to_do(&journal, &view(serving), now), want, "{name}");
        }
        // A node's agent reported its listeners, none (so `listening` is the same).
        let waiting = LeaseView { unreported: vec!["b".to_string()], ..view(AB) };
        state.clean = true;
        state.lease_view = Some(waiting);
        assert!(!state.nothing_to_do(&changes(&[], &["Lease"]), &view(AB), soon), "listeners reported");

        // Which rounds may wait for the next change: those that give no Service a number.
        state.lease_view = Some(view(AB));
        // (name, last round clean, changes, the serving nodes now, may wait)
        type Wait = (&'static str, bool, Journal, &'static [&'static str], bool);
        let cases: Vec<Wait> = vec![
            (
                "a Service deleted (and its slices)",
                true,
                changes(&[], &["Service", "EndpointSlice"]),
                AB,
                true,
            ),
            ("endpoints changed", true, changes(&[], &["EndpointSlice"]), AB, true),
            ("with a renewal that changes nothing read", true, changes(&[], &["Service", "Lease"]), AB, true),
            ("with our writes coming back", true, changes(&[(&web, Some("12"))], &["Service"]), AB, true),
            ("with someone else's write", true, changes(&[(&web, Some("13"))], &["Service"]), AB, false),
            (
                "a Service created or changed",
                true,
                changes(&[(&db, Some("5"))], &["EndpointSlice"]),
                AB,
                false,
            ),
            (
                "a Service that is not nodelb's changed",
                true,
                changes(&[(&internal, Some("7")), (&web, Some("12"))], &["EndpointSlice"]),
                AB,
                true,
            ),
            (
                "one that is not, one that is",
                true,
                changes(&[(&internal, Some("7")), (&db, Some("5"))], &[]),
                AB,
                false,
            ),
            (
                "more Service writes than the journal itemizes",
                true,
                Journal { truncated: true, ..changes(&[(&internal, Some("7"))], &["Service"]) },
                AB,
                false,
            ),
            ("a deletion, and a node's Lease expired", true, changes(&[], &["Service"]), &["a"], false),
            ("a Node changed", true, changes(&[], &["Service", "Node"]), AB, false),
            ("a pool changed", true, changes(&[], &["NodePortPool"]), AB, false),
            ("a namespace changed", true, changes(&[], &["Namespace"]), AB, false),
            (
                "the last round left work (claims to settle, Events to send)",
                false,
                changes(&[], &["Service"]),
                AB,
                true,
            ),
        ];
        for (name, clean, journal, serving, want) in cases {
            state.clean = clean;
            assert_eq!(state.can_wait(&journal, &view(serving), |k| *k == internal), want, "{name}");
        }
    }

    /// A node whose agent runs but has not published its listeners yet (just started) could have
    /// a process on any number: the round hands out none until it has, and the Service waits;
    /// then it gets a number no node listens on. A Service that keeps its numbers is not held.
    #[test]
    fn no_new_number_until_every_running_agent_has_reported_its_listeners() {
        let service = |name: &str, annotation: Option<&str>| -> Arc<Service> {
            let mut v = json!({
                "metadata": {"name": name, "namespace": "default", "uid": format!("uid-{name}")},
                "spec": {"type": "LoadBalancer", "ports": [{"port": 80, "protocol": "TCP"}]}
            });
            if let Some(a) = annotation {
                v["metadata"]["annotations"] = json!({ANNOTATION_ALLOCATED: a});
            }
            Arc::new(serde_json::from_value(v).unwrap())
        };
        let node: Arc<Node> = Arc::new(
            serde_json::from_value(json!({
                "metadata": {"name": "node-1"},
                "status": {"addresses": [{"type": "InternalIP", "address": "192.0.2.1"}]}
            }))
            .unwrap(),
        );
        let lease = |listening: Option<&str>| -> Arc<Lease> {
            let mut annotations = json!({nodes::ANNOTATION_FAMILIES: "ipv4"});
            if let Some(l) = listening {
                annotations[nodes::ANNOTATION_LISTENING] = json!(l);
            }
            Arc::new(
                serde_json::from_value(json!({
                    "metadata": {"name": "nodelb-node-node-1", "annotations": annotations},
                    "spec": {"holderIdentity": "node-1", "leaseDurationSeconds": 15,
                             "renewTime": "2030-01-01T00:00:00.000000Z"}
                }))
                .unwrap(),
            )
        };
        let cfg = ControllerConfig {
            identity: "controller-1".into(),
            namespace: "nodelb-system".into(),
            lease_duration: Duration::from_secs(15),
            node_addresses: vec![],
            port_range: PortRange::new(9471, 9473).unwrap(),
            model: ModelOptions::default(),
            policy: Default::default(),
        };
        let now: Timestamp = "2030-01-01T00:00:01Z".parse().unwrap();
        let round = |lease: Arc<Lease>| -> RoundPlan {
            let snap = KubeSnapshot {
                services: vec![service("new", None), service("kept", Some("80/TCP=9472"))],
                nodes: vec![node.clone()],
                leases: vec![lease],
                ..Default::default()
            };
            let registry = claims::Registry::default();
            let token = claims::Token::new("test", 1, 0);
            let (gone, expired) = (Default::default(), Default::default());
            let inputs = ClaimInputs {
                registry: Some(&registry),
                token: &token,
                gone: &gone,
                gone_claims: None,
                expired: &expired,
            };
            let mut holders = claims::Holders::default();
            holders.of_view(&snap.services);
            plan_round(&snap, &cfg, &mut RoundMemory::default(), &holders, Some(now), now, &inputs, false)
        };
        let written = |p: &RoundPlan, name: &str| -> Option<Option<String>> {
            p.writes.iter().find(|w| &*w.key.name == name).and_then(|w| w.annotation.clone())
        };

        let waiting = round(lease(None));
        assert_eq!(waiting.listeners_unreported, ["node-1"]);
        assert_eq!(written(&waiting, "new"), None, "a number handed out before node-1 said what listens");
        assert!(waiting.claims.blocked.contains(&ServiceKey::new("default", "new")));
        assert!(!waiting.claims.blocked.contains(&ServiceKey::new("default", "kept")));
        assert!(
            waiting.writes.iter().any(|w| &*w.key.name == "kept"),
            "kept is not held: {:?}",
            waiting.writes
        );

        // node-1's agent listens on 9471 (its health listener, say): the Service gets 9473.
        let reported = round(lease(Some("9471/TCP")));
        assert!(reported.listeners_unreported.is_empty());
        assert_eq!(written(&reported, "new"), Some(Some("80/TCP=9473".to_string())));
        assert!(reported.claims.blocked.is_empty(), "{:?}", reported.claims.blocked);
    }
}
