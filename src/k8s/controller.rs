//! The controller's edge (`nodelb controller`, a Deployment of its own): its replicas elect a
//! leader ([`super::election`]), and the leader alone allocates node ports and writes Service
//! status, the node-port registry, NodePortPool status and Service Events, only once the caches
//! are complete: [`crate::core::decisions::alloc::allocate`] with the annotations as previous allocations, then
//! [`crate::core::k8s::publish::plan_services`] → merge patches with a `metadata.resourceVersion`
//! precondition (409 ⇒ retried on the next round), Events deduplicated per change. The node
//! agents only read what it writes.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::Service;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use k8s_openapi::jiff::Timestamp;
use kube::api::{Patch, PatchParams};
use kube::runtime::events::{Recorder, Reporter};
use kube::{Api, Client, Resource};
use serde_json::json;
use tracing::{debug, info, warn};

use crate::core::domain::{Scope, ServiceKey};
use crate::core::inputs::model::{self, ANNOTATION_ALLOCATED};
use crate::serve::metrics::ControllerMetrics;

use super::api::{CONTROLLER_NAME, FIELD_MANAGER, is_conflict, post_params, publish_event};
use super::election::{self, ElectionConfig, Leadership};
use super::source::KubeSource;
use crate::core::k8s::claims;
use crate::core::k8s::events::{Deduper, Outbox};
use crate::core::k8s::publish::{self, ServiceWrite};
use crate::core::k8s::round::{
    BegunRound, ControllerConfig, LeaderState, LeaseView, RegistryVersions, RoundClock, RoundPlan, event_key,
    events_to_send,
};
use crate::core::k8s::snapshot::KubeSnapshot;

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

/// What names this leader process in the registry's pending claims: its identity, process id
/// and start time ([`claims::Token::new`]), so a restarted leader never takes another's claims
/// for its own.
pub fn process_token(identity: &str) -> claims::Token {
    let started = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
    claims::Token::new(identity, std::process::id(), started.as_nanos())
}

/// The leader's work, whenever the caches change (coalesced) and every couple of seconds (node
/// Leases expire with time, not with an event); no round when it would plan nothing
/// ([`LeaderState::nothing_to_do`]).
async fn allocate_loop(client: Client, mut source: KubeSource, cfg: ControllerConfig, tasks: Tasks) {
    let Tasks { leadership, liveness, recorder, metrics } = tasks;
    let mut state = LeaderState::new(process_token(&cfg.identity));
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
                state.observe(&source.snapshot(), Instant::now());
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

/// The time to judge node-Lease expiry by: now, once the Lease cache has been current for a
/// lease duration (after an API outage every Lease looks expired until the agents' renewals
/// arrive); else `None`.
fn leases_now(source: &KubeSource, cfg: &ControllerConfig) -> Option<Timestamp> {
    source.leases_current_for().is_some_and(|d| d >= cfg.lease_duration).then(Timestamp::now)
}

/// One round of the leader's work on `snap`: read the node-port registry, decide
/// ([`crate::core::k8s::round::plan_round`]), write the registry (resourceVersion precondition: a 409 means another
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
    let fresh_as = state.registry_seen.take();
    let read = match read_registry(client, &cfg.namespace, state.registry_read.take(), fresh_as.as_deref())
        .await
    {
        Ok((r, problems, listed_at)) => {
            // The next read is at least as fresh as this one, whether or not this round writes.
            state.registry_seen = listed_at;
            let problems: std::collections::BTreeSet<String> = problems.into_iter().collect();
            for p in problems.difference(&state.logged) {
                warn!(problem = %p, "node-port registry");
            }
            state.logged = problems;
            Some(r)
        }
        // The next read is a consistent one (`registry_seen` stays `None`): a version the API
        // server cannot serve (an etcd restored from a backup) is not asked for again.
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
                state.registry_seen.clone_from(&written);
                if let Some(v) = versions.as_mut() {
                    v.insert(*b, written);
                }
            }
            // Someone else wrote it: the round runs again from a consistent read, which sees that
            // write (a read only as fresh as this leader's own write may not).
            Err(e) if is_conflict(&e) => {
                state.registry_seen = None;
                debug!(block = b, "node-port registry changed since read (409); retrying the round");
                return RoundOutcome { again: true, ..Default::default() };
            }
            Err(e) => {
                state.registry_seen = None;
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
    let (resolved, resolve_written) =
        resolve_claims(client, &cfg.namespace, &plan, &outcomes, &state.token, metrics, &mut versions).await;
    if !resolved {
        state.registry_seen = None;
    } else if resolve_written.is_some() {
        state.registry_seen = resolve_written;
    }
    state.end_round(registry, written && resolved, versions);
    if let Some(p) = &plan.pools {
        let pools = super::pool_status::StatusRound {
            snap,
            ctx: &p.ctx,
            invalid: &p.invalid,
            allocations: &p.allocations,
            assignment: p.assignment.as_ref(),
            serving: &p.serving,
        };
        match super::pool_status::write_statuses(client, &pools).await {
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
    // Side by side, and for at most EVENTS_FOR a round: an install into many Services records
    // an Event for each, and the Services created meanwhile are not to wait for them. What is not
    // sent stays pending (deduper, outbox) for the round that follows at once.
    use futures::StreamExt as _;
    let until = Instant::now() + EVENTS_FOR;
    let mut next = events_to_send(
        ev.deduper,
        ev.outbox,
        &events,
        |k| source.service(k).is_some(),
        Scope::of(scope.as_ref()),
    )
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
    // Each write's future is made when it starts (a round can write every Service of the cluster).
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
/// whole cluster (an install into many waiting Services) would wait out an API server round trip
/// per Service; the API server's default limit is 200 mutating requests in flight,
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
    let mut rv = w.resource_version.clone();
    let mut annotated = false;
    if let Some(value) = &w.annotation {
        let mut patch = json!({"metadata": {"annotations": {ANNOTATION_ALLOCATED: value}}});
        if let Some(rv) = &rv {
            patch["metadata"]["resourceVersion"] = json!(rv);
        }
        match api.patch(&w.key.name, &params, &Patch::Merge(&patch)).await {
            Ok(svc) => {
                made.extend(svc.metadata.resource_version.clone());
                rv = svc.metadata.resource_version;
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

/// Every block of the node-port registry (Leases labelled [`claims::LABEL`]), with the problems
/// found reading them (a block read again at the same resourceVersion is not parsed again).
/// `fresh_as`: a resourceVersion the read is to be at least as fresh as (this leader's last read
/// or write of the registry; `None`: a consistent read). Also returns the list's
/// resourceVersion.
async fn read_registry(
    client: &Client,
    namespace: &str,
    kept: Option<claims::ReadRegistry>,
    fresh_as: Option<&str>,
) -> Result<(claims::ReadRegistry, Vec<String>, Option<String>), kube::Error> {
    let api: Api<Lease> = Api::namespaced(client.clone(), namespace);
    let mut params = kube::api::ListParams::default().labels(claims::LABEL);
    if let Some(rv) = fresh_as {
        params = params.at(rv).matching(kube::api::VersionMatch::NotOlderThan);
    }
    let list = api.list(&params).await?;
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
    Ok((read, problems, list.metadata.resource_version))
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
    let written = match &b.resource_version {
        None => api.create(&post_params(), &lease(None)).await?,
        Some(_) => api.replace(&name, &post_params(), &lease(b.resource_version.clone())).await?,
    };
    Ok(written.metadata.resource_version)
}

/// After the Service writes: each claim left pending by this round becomes what the write's
/// outcome says ([`claims::resolve`]), on a fresh read of its block (retried on 409; what is
/// not resolved here is settled after [`claims::GRACE`]). Whether every block was resolved, and
/// the resourceVersion its last write made.
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
) -> (bool, Option<String>) {
    let mut resolved = true;
    let mut last_write = None;
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
                last_write.clone_from(&written);
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
    (resolved, last_write)
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
}
