//! The sync loop of `nodelb run`: watch the source, check the forwarding sysctls, compute the
//! desired state, and program the kernel in one netlink batch per sync. A sync is three steps:
//! observe (the source's snapshot, this node's facts), plan (the pure desired state, persisted
//! allocations) and apply ([`Dataplane::program`]: what batch now, and the kernel's side of it),
//! then a report (metrics, `/status`, log). When syncs happen — after a change, every resync
//! period, after a failure only once its backoff passed — is [`Schedule`]'s.

use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use k8s_openapi::jiff::Timestamp;
use tracing::{debug, error, info, warn};

use crate::agent::schedule::{Pace, Schedule, Whole};
use crate::apply::dataplane::{Dataplane, DataplaneError};
use crate::apply::firewall::{self, Checker};
use crate::apply::kernel::{Kernel, LocalNode, Netlink, NodeReads};
use crate::core::decisions::desired::{self, AllocationMode, Desired, HostFacts, HostPolicy, Inputs};
use crate::core::decisions::endpoint_policy::HostAddresses;
use crate::core::decisions::port_policy::{Listeners, PortRange};
use crate::core::domain::{Family, ServiceKey};
use crate::core::incremental::replan::Planned;
use crate::core::inputs::model::ModelOptions;
use crate::core::reports::counters::IndexUpdate;
use crate::core::reports::report::{ServiceState, ServiceStatus};
use crate::core::ruleset::hairpin;
use crate::core::ruleset::plan::{self, NatShards, NodeFacts};
use crate::encode::nft::{self, NftClient};
use crate::observe::bridge::BridgeReader;
use crate::observe::manifest_dir::ManifestError;
use crate::observe::source::{Fingerprint, Loaded, Snapshot, Source};
use crate::observe::state::{State, StateFile};
use crate::observe::sysctl::{Sysctls, forwarding_sysctl};
use crate::serve::metrics::Metrics;
use crate::serve::status::{SharedStatus, SyncStatus};

#[derive(Debug, Clone)]
pub struct AgentConfig {
    /// Where allocations are kept across restarts (manifests mode); `None` in Kubernetes mode,
    /// where they live on the Services.
    pub state_file: Option<PathBuf>,
    pub node_name: String,
    pub port_range: PortRange,
    pub resync_period: Duration,
    pub enable_forwarding: bool,
    pub masquerade_mark: u32,
    /// `--connection-mark` (see [`NodeFacts::connection_mark`]).
    pub connection_mark: u32,
    /// `--iptables-forward-accept`: the mark bit of our flows (see [`NodeFacts::forward_mark`]).
    pub forward_mark: Option<u32>,
    /// `--nat-shards` (see [`NodeFacts::nat_shards`]).
    pub nat_shards: NatShards,
    pub model: ModelOptions,
    pub sysctls: Sysctls,
    pub policy: HostPolicy,
    /// The lock iptables-legacy writes take (`XTABLES_LOCKFILE`, else `/run/xtables.lock`).
    pub xtables_lockfile: PathBuf,
    pub bridges: BridgeReader,
}

#[derive(Debug, thiserror::Error)]
pub enum AgentError {
    /// Netlink unavailable, or the kernel refused a batch.
    #[error(transparent)]
    Nft(#[from] nft::NftError),
    /// Reading the ruleset generation or our table back failed.
    #[error("reading the ruleset back from the kernel: {0}")]
    KernelRead(#[source] nft::NftError),
    #[error(transparent)]
    Manifests(#[from] ManifestError),
    #[error(transparent)]
    State(#[from] crate::observe::state::StateError),
    #[error(transparent)]
    KernelSupport(#[from] crate::apply::kernel::SupportError),
    /// The planner and the kernel's known content disagree (a bug): the sync fails, the next one
    /// replaces the whole table.
    #[error("{0}")]
    Internal(DataplaneError),
}

impl From<DataplaneError> for AgentError {
    fn from(e: DataplaneError) -> AgentError {
        match e {
            DataplaneError::Batch(e) => AgentError::Nft(e),
            DataplaneError::KernelRead(e) => AgentError::KernelRead(e),
            e @ DataplaneError::NoBase => AgentError::Internal(e),
        }
    }
}

impl AgentError {
    /// The `reason` label of `nodelb_sync_failures_total`.
    fn reason(&self) -> &'static str {
        match self {
            AgentError::Nft(_) => "netlink",
            AgentError::KernelRead(_) => "kernel_read",
            AgentError::Manifests(_) => "manifests",
            AgentError::State(_) => "state_file",
            // Only at start, before any sync: never counted.
            AgentError::KernelSupport(_) => "kernel_support",
            AgentError::Internal(_) => "internal",
        }
    }
}

const SYSCTL_PERIOD: Duration = Duration::from_secs(1);

struct Agent<K, N> {
    cfg: AgentConfig,
    metrics: Arc<Metrics>,
    status: SharedStatus,
    dataplane: Dataplane<K>,
    node: N,
    source: Source,
    state: Option<StateFile>,
    /// The allocations (and their times) of the last sync, as in the state file.
    allocations: State,
    /// What the last sync modeled and planned, for the next one to compute only what changed.
    kept: desired::Kept,
    /// When the sync decides every Service, and how long a change may wait.
    pace: Pace,
    /// The nat shard tables the node has now (`--nat-shards`, or what `auto` chose last).
    nat_shards: u8,
    families: BTreeMap<Family, bool>,
    /// Refusals and input problems currently reported, to log each once per occurrence.
    logged_refusals: BTreeSet<String>,
    logged_problems: BTreeSet<String>,
    /// Hairpin warnings and bridge read errors currently reported.
    logged_hairpin: BTreeSet<String>,
    /// Source fingerprint and node facts of the last successful sync: the same again (a relist
    /// that brought nothing new) means nothing to recompute.
    last_input: Option<(Fingerprint, NodeFacts, HostFacts)>,
    /// This node's addresses as last read (kept when a read fails), and whether that failure
    /// was logged.
    local_addresses: HostAddresses,
    local_addresses_failing: bool,
    /// This node's listening sockets as last read, and whether a failing read was logged.
    listeners: Listeners,
    listeners_failing: bool,
    /// `(state, reason)` label sets of `nodelb_services` currently exported.
    services_series: BTreeSet<(&'static str, String)>,
    /// The pools `nodelb_pool_ports` has series for.
    pool_series: BTreeSet<String>,
}

/// The host-firewall check (its own netlink socket: it reads and writes other tables, never
/// ours through the sync's [`Kernel`]), and what it last logged per family and as problems.
struct HostFirewall {
    nft: NftClient,
    checker: Checker,
    logged: BTreeMap<Family, String>,
    logged_problems: BTreeSet<String>,
}

/// One sync attempt, as [`Agent::record`] reports it.
struct Attempt {
    started: Instant,
    /// `full` (table replaced) or `incremental`: the kind the batch is (or would have been).
    kind: &'static str,
    changes: usize,
    /// The Services' state, once computed (not when the attempt failed before).
    report: Option<Report>,
}

/// What a sync computed for `/status`.
struct Report {
    services: Vec<Arc<ServiceStatus>>,
    refused: Vec<crate::core::k8s::cluster_view::Refused>,
    needed_families: Vec<String>,
    problems: Vec<String>,
}

/// How a sync that did not fail ended.
enum Synced {
    /// The source is not completely read yet: nothing programmed, not counted as a sync.
    Waiting,
    /// Same input as the last good sync and our table untouched: not counted as a sync.
    Unchanged,
    /// Only Services waiting for the leader's node ports changed: left until this time, or until
    /// a change the node programs, whichever is first ([`schedule::UNDECIDED_WAIT`]). Not
    /// counted as a sync.
    Deferred(Instant),
    /// The batch (possibly empty) is in the kernel.
    Applied,
}

/// Runs until `shutdown` resolves. Errors only for things that make serving impossible from the
/// start (netlink unavailable, state file unreadable); everything else is retried and reported.
pub async fn run(
    cfg: AgentConfig,
    source: Source,
    status: SharedStatus,
    metrics: Arc<Metrics>,
    shutdown: impl std::future::Future<Output = ()>,
) -> Result<(), AgentError> {
    let mut state = cfg.state_file.clone().map(StateFile::new);
    let allocations = match &mut state {
        Some(s) => {
            let loaded = s.load()?;
            let loaded = migrate(s, loaded);
            // What a human reads is whole again, and the journal starts empty.
            if let Err(e) = s.fold_journal(&loaded) {
                warn!(error = %e, "cannot fold the state journal into the file; it stays, and is replayed at the next start");
            }
            loaded
        }
        None => Default::default(),
    };
    let kernel = Netlink::new()?;
    crate::apply::kernel::check_support(&mut NftClient::new()?)?;
    let mut firewall = HostFirewall {
        nft: NftClient::new()?,
        checker: Checker::new(
            cfg.forward_mark,
            crate::apply::xtables::Xtables::new(cfg.xtables_lockfile.clone()),
        ),
        logged: BTreeMap::new(),
        logged_problems: BTreeSet::new(),
    };
    let mut agent = Agent::new(cfg, source, status, metrics, kernel, LocalNode, state, allocations);
    info!(source = %agent.source.describe(), node = %agent.cfg.node_name, "nodelb agent starting");

    tokio::pin!(shutdown);
    let mut resync = tokio::time::interval(agent.cfg.resync_period);
    let mut sysctl_tick = tokio::time::interval(SYSCTL_PERIOD);
    // The host firewall is checked once per resync period (and right after the first sync).
    let mut schedule = Schedule::new();
    loop {
        agent.tick();
        if agent.check_forwarding() {
            schedule.changed();
        }
        agent.sync_if_due(&mut schedule, tokio::time::Instant::now()).await;
        if schedule.take_firewall(agent.dataplane.applied().is_some()) {
            firewall.check(&agent.metrics, &agent.status);
        }
        let wake_at = schedule.wake_at();
        let wake_sleep = async {
            match wake_at {
                Some(t) => tokio::time::sleep_until(t).await,
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            _ = &mut shutdown => {
                info!("shutting down: the sync loop stopped");
                agent.fold_state_journal();
                return Ok(());
            }
            _ = agent.source.changed() => { debug!("source changed"); schedule.changed(); }
            _ = resync.tick() => schedule.resync(),
            _ = sysctl_tick.tick() => {}
            _ = wake_sleep => {}
        }
    }
}

impl<K: Kernel, N: NodeReads> Agent<K, N> {
    /// At a clean shutdown: the state file written whole (the journal folded in), so a human, or
    /// an older nodelb after a rollback, reads every allocation from it.
    fn fold_state_journal(&mut self) {
        if let Some(state) = &mut self.state
            && let Err(e) = state.fold_journal(&self.allocations)
        {
            warn!(error = %e, "cannot fold the state journal into the file; it is replayed at the next start");
        }
    }

    #[allow(clippy::too_many_arguments)]
    fn new(
        cfg: AgentConfig,
        source: Source,
        status: SharedStatus,
        metrics: Arc<Metrics>,
        kernel: K,
        node: N,
        state: Option<StateFile>,
        allocations: State,
    ) -> Agent<K, N> {
        {
            let mut st = crate::locks::write(&status);
            st.node_name = cfg.node_name.clone();
        }
        let nat_shards = match cfg.nat_shards {
            NatShards::Fixed(k) => k,
            NatShards::Auto => 1,
        };
        Agent {
            cfg,
            metrics,
            status,
            dataplane: Dataplane::new(kernel),
            node,
            source,
            state,
            allocations,
            kept: desired::Kept::default(),
            pace: Pace::default(),
            nat_shards,
            families: BTreeMap::new(),
            logged_refusals: BTreeSet::new(),
            logged_problems: BTreeSet::new(),
            logged_hairpin: BTreeSet::new(),
            last_input: None,
            local_addresses: HostAddresses::default(),
            local_addresses_failing: false,
            listeners: Listeners::default(),
            listeners_failing: false,
            services_series: BTreeSet::new(),
            pool_series: BTreeSet::new(),
        }
    }

    /// Syncs when `schedule` says one is due at `now`, and tells it how it went (a failure
    /// forgets what the kernel holds: the next attempt is a full replace, after the backoff).
    async fn sync_if_due(&mut self, schedule: &mut Schedule, now: tokio::time::Instant) {
        let Some(verify) = schedule.due(now) else { return };
        match self.sync(verify).await {
            Ok(Synced::Deferred(until)) => {
                schedule.succeeded();
                schedule.wake(tokio::time::Instant::from_std(until));
            }
            Ok(_) => schedule.succeeded(),
            Err(e) => {
                let retry_in = schedule.failed(now);
                error!(error = %e, ?retry_in, "sync failed; next attempt is a full resync");
                self.dataplane.forget();
            }
        }
        if verify {
            self.check_hairpin();
        }
    }

    fn tick(&self) {
        let mut st = crate::locks::write(&self.status);
        st.last_tick = Some(Instant::now());
    }

    /// Reads the forwarding sysctls (switching them on if allowed); logs once per change.
    /// Returns true when the set of usable families changed.
    fn check_forwarding(&mut self) -> bool {
        let mut changed = false;
        for f in Family::ALL {
            let name = forwarding_sysctl(f);
            let mut on = self.cfg.sysctls.forwarding(f);
            if matches!(on, Ok(false)) && self.cfg.enable_forwarding {
                match self.cfg.sysctls.enable_forwarding(f) {
                    Ok(()) => {
                        info!(sysctl = name, "forwarding was off; switched it on (--enable-forwarding)");
                        on = Ok(true);
                    }
                    Err(e) => warn!(error = %e, "could not switch forwarding on"),
                }
            }
            let (enabled, reason) = match on {
                Ok(true) => (true, None),
                Ok(false) => (
                    false,
                    Some(format!(
                        "{name} is 0: {f} traffic cannot be forwarded, so {f} is not programmed on this node; \
                         fix with `sysctl -w {name}=1` or run with --enable-forwarding"
                    )),
                ),
                Err(e) => (false, Some(format!("{e}; {f} is not programmed"))),
            };
            if self.families.get(&f) != Some(&enabled) {
                changed = true;
                match &reason {
                    None => info!(sysctl = name, family = %f, "forwarding on: {f} is served"),
                    Some(r) => warn!(sysctl = name, family = %f, "{r}"),
                }
                self.families.insert(f, enabled);
            }
            let mut st = crate::locks::write(&self.status);
            let entry = st.families.entry(f.name().to_string()).or_default();
            entry.forwarding = enabled;
            self.metrics.forwarding.with_label_values(&[f.name()]).set(i64::from(enabled));
            entry.programmed = enabled && self.dataplane.applied().is_some();
            entry.reason = reason;
        }
        changed
    }

    /// What this node now serves each address-restricted pool on, for its node Lease (the leader
    /// lists exactly these in the Services' status). Too many to publish: not published, logged
    /// once; the leader then judges from the Node object.
    fn publish_pool_addresses(
        &mut self,
        pools: Option<&crate::core::decisions::pool::PoolContext>,
        host: &HostFacts,
    ) {
        let selected = pools.map(|c| c.selected_addresses(&host.addresses.own)).unwrap_or_default();
        let value = crate::core::k8s::nodes::format_pool_addresses(&selected);
        let mut status = crate::locks::write(&self.status);
        if value.is_none() && status.pool_addresses.is_some() {
            warn!(
                annotation = crate::core::k8s::nodes::ANNOTATION_POOL_ADDRESSES,
                limit = crate::core::k8s::nodes::MAX_POOL_ADDRESSES_LEN,
                "the addresses this node serves per pool are too many to publish; the leader lists the Node object's instead"
            );
        }
        status.pool_addresses = value;
    }

    /// This node's addresses (read now; the last ones when the read fails, logged once) and, in
    /// Kubernetes mode, every Node object's.
    fn host_facts(&mut self) -> HostFacts {
        match self.node.addresses() {
            Ok(addrs) => {
                if std::mem::take(&mut self.local_addresses_failing) {
                    info!("this node's addresses can be read again");
                }
                self.local_addresses = addrs;
            }
            Err(e) if !self.local_addresses_failing => {
                warn!(error = %e, "using the last known addresses of this node");
                self.local_addresses_failing = true;
            }
            Err(_) => {}
        }
        match self.node.listeners() {
            Ok(sockets) => {
                if std::mem::take(&mut self.listeners_failing) {
                    info!("this node's listening sockets can be read again");
                }
                self.listeners = Listeners::from_sockets(sockets);
            }
            Err(e) if !self.listeners_failing => {
                warn!(error = %e, "using the last known listening sockets of this node");
                self.listeners_failing = true;
            }
            Err(_) => {}
        }
        let listening = self.listeners.format_relevant(&self.cfg.policy.ports);
        let published = crate::core::k8s::nodes::format_published_addresses(&self.local_addresses);
        {
            let mut status = crate::locks::write(&self.status);
            status.listening_ports = Some(listening);
            status.node_addresses = Some(published);
        }
        HostFacts {
            addresses: self.local_addresses.merged(&self.source.node_addresses()),
            listeners: self.listeners.clone(),
        }
    }

    /// Reads the node's bridges and reports those on which an endpoint cannot reach its own
    /// Service (every resync period: a CNI sets a pod's bridge port when the pod starts). Logged
    /// once per warning while it lasts; `/status` always has the current ones.
    fn check_hairpin(&mut self) {
        let endpoints = self.dataplane.applied().map(hairpin::programmed_endpoints).unwrap_or_default();
        let (warnings, messages) = if endpoints.is_empty() {
            (Vec::new(), BTreeSet::new())
        } else {
            match self.cfg.bridges.read() {
                Ok(facts) => {
                    let w = hairpin::diagnose(&facts, &endpoints);
                    let m = w.iter().map(|w| w.message.clone()).collect();
                    (w, m)
                }
                Err(e) => {
                    (Vec::new(), BTreeSet::from([format!("cannot check the bridges for hairpin mode: {e}")]))
                }
            }
        };
        log_new(&mut self.logged_hairpin, messages, |m| warn!("{m}"));
        let mut st = crate::locks::write(&self.status);
        st.hairpin = warnings;
    }

    fn node_facts(&self) -> NodeFacts {
        NodeFacts {
            node_name: self.cfg.node_name.clone(),
            families: self.families.iter().filter(|(_, on)| **on).map(|(f, _)| *f).collect(),
            masquerade_mark: self.cfg.masquerade_mark,
            connection_mark: self.cfg.connection_mark,
            forward_mark: self.cfg.forward_mark,
            nat_shards: self.nat_shards,
        }
    }

    /// One sync attempt. Whatever happens, an attempt that got past "nothing to do" is recorded
    /// exactly once, in [`Agent::record`].
    async fn sync(&mut self, verify: bool) -> Result<Synced, AgentError> {
        let mut attempt = Attempt {
            started: Instant::now(),
            kind: if self.dataplane.applied().is_none() { "full" } else { "incremental" },
            changes: 0,
            report: None,
        };
        let result = self.sync_once(verify, &mut attempt).await;
        match &result {
            Ok(Synced::Waiting | Synced::Unchanged | Synced::Deferred(_)) => {}
            Ok(Synced::Applied) => self.record(attempt, None),
            Err(e) => self.record(attempt, Some(e)),
        }
        if let Ok(Synced::Applied | Synced::Unchanged) = result {
            let now = k8s_openapi::jiff::Timestamp::now();
            for t in self.source.take_programming_triggers() {
                let latency = now.duration_since(t).as_secs_f64().max(0.0);
                self.metrics.network_programming_duration.observe(latency);
            }
        }
        result
    }

    /// Reads the input, computes the desired state and programs it. Returns at the first error;
    /// fills `attempt` with what [`Agent::record`] reports.
    async fn sync_once(&mut self, verify: bool, attempt: &mut Attempt) -> Result<Synced, AgentError> {
        let mut phases = Phases::new(attempt.started);
        // Observe.
        let node = self.node_facts();
        let host = self.host_facts();
        // The whole decision, when due, is taken on a resync; on one with no change waiting, so
        // that no change waits for it (it computes then though nothing changed), unless changes
        // have kept coming for too long.
        let whole = self.pace.whole_due(verify, attempt.started);
        let mut observed = self.observe(verify, &node, &host)?;
        if whole != Whole::No && matches!(observed, Loaded::Unchanged) {
            observed = self.load(None, false)?;
        }
        if !matches!(observed, Loaded::Deferred) {
            self.pace.nothing_deferred();
        }
        let loaded = match observed {
            Loaded::Snapshot(loaded) => loaded,
            Loaded::Unchanged => return Ok(Synced::Unchanged),
            Loaded::Deferred => return Ok(Synced::Deferred(self.pace.deferred(attempt.started))),
            Loaded::Waiting => {
                // Never program from a partial view: the old rules stay until the caches are complete.
                debug!("source not complete yet; waiting");
                return Ok(Synced::Waiting);
            }
        };
        phases.mark("load");
        // `--nat-shards auto`: the shards for the Service ports of this snapshot, before it is
        // planned (an unchanged snapshot has the same ports, and the same shards).
        let node = match self.cfg.nat_shards {
            NatShards::Auto => {
                let k = plan::auto_nat_shards(
                    lb_service_ports(loaded.services.iter().map(|s| &**s)),
                    self.nat_shards,
                );
                if k != self.nat_shards {
                    info!(from = self.nat_shards, to = k, "nat shard tables (--nat-shards auto)");
                    self.nat_shards = k;
                }
                NodeFacts { nat_shards: k, ..node }
            }
            NatShards::Fixed(_) => node,
        };
        let problems: Vec<String> = loaded.problems.clone();
        log_new(
            &mut self.logged_problems,
            problems.iter().cloned().collect(),
            |p| warn!(problem = %p, "input problem"),
        );
        // Plan: every Service again when the whole decision is due and no change waits for it
        // (the input is what the last sync read), or it is overdue.
        let nothing_waits =
            loaded.fingerprint.is_some_and(|fp| self.last_input.as_ref().is_some_and(|l| l.0 == fp));
        if whole == Whole::Now || (whole == Whole::IfQuiet && nothing_waits) {
            self.kept.next_sync_whole();
        }
        let aged = self.provisional_ages(&loaded);
        let (mut desired, scope) = self.desired(&loaded, &node, &host, aged.as_ref());
        self.pace.decided(scope == desired::Extent::Whole, attempt.started);
        phases.mark("desired");
        self.report_refusals(&desired);
        self.persist(&mut desired, aged)?;
        phases.mark("state");
        // Apply.
        let planned = std::mem::replace(&mut desired.ruleset, Planned::Patch(Default::default()));
        let index = std::mem::replace(&mut desired.counter_index, IndexUpdate::Full(Default::default()));
        let programmed = self.dataplane.program(planned, index, verify, &self.metrics)?;
        let (kind, changes) = (programmed.kind, programmed.changes);
        attempt.kind = kind;
        attempt.changes = changes;
        phases.mark("apply");
        // Report.
        self.update_service_gauges(&desired, loaded.pools.as_deref(), problems.len());
        if programmed.result.is_ok() {
            self.publish_pool_addresses(loaded.pools.as_deref(), &host);
            if changes > 0 {
                let ms = attempt.started.elapsed().as_secs_f64() * 1000.0;
                info!(kind, changes, bytes = programmed.bytes, ms, "synced");
            }
            self.last_input = loaded.fingerprint.map(|fp| (fp, node.clone(), host.clone()));
        }
        attempt.report = Some(Report {
            refused: crate::core::k8s::cluster_view::refused_on_node(&desired.services),
            services: std::mem::take(&mut desired.services),
            needed_families: desired.needed_families.iter().map(|f| f.name().to_string()).collect(),
            problems: problems.into_iter().chain(desired.warnings.iter().cloned()).collect(),
        });
        phases.mark("after");
        let decided = match scope {
            desired::Extent::Whole => "all".to_string(),
            desired::Extent::Services(n) => n.to_string(),
        };
        debug!(kind, changes, decided, phases = %phases, "sync breakdown (ms)");
        programmed.result.map(|()| Synced::Applied).map_err(AgentError::from)
    }

    /// The source's snapshot to sync from. The same input as the last good sync is
    /// [`Loaded::Unchanged`] with nothing recomputed (the source does not even assemble its object
    /// lists): a resync then only asks the kernel whether any nftables transaction happened since
    /// our last batch, and if one did, the whole snapshot goes through so the apply step reads the
    /// table back and repairs it. (Recomputing every resync period would cost CPU linear in the
    /// Services and a transient copy of every object.)
    fn observe(&mut self, verify: bool, node: &NodeFacts, host: &HostFacts) -> Result<Loaded, AgentError> {
        let known = match &self.last_input {
            Some((fp, last_node, last_host))
                if last_node == node && last_host == host && self.dataplane.applied().is_some() =>
            {
                Some(*fp)
            }
            _ => None,
        };
        // A resync computes everything, and so does a change once one has waited long enough.
        let may_defer = self.pace.may_defer(verify, Instant::now());
        Ok(match self.load(known, may_defer)? {
            Loaded::Unchanged if !verify || !self.dataplane.generation_changed()? => Loaded::Unchanged,
            // Someone committed a transaction since our batch: the full path checks our table.
            Loaded::Unchanged => self.load(None, false)?,
            other => other,
        })
    }

    /// Everything the node should do, computed from the snapshot (pure): the ruleset as a patch
    /// of the one the kernel holds where only Services changed.
    fn desired(
        &mut self,
        loaded: &Snapshot,
        node: &NodeFacts,
        host: &HostFacts,
        aged: Option<&State>,
    ) -> (Desired<Planned, IndexUpdate>, desired::Extent) {
        let inputs = Inputs {
            mode: self.source.mode(),
            services: &loaded.services,
            slices: &loaded.slices,
            notes: &loaded.notes,
            previous: &self.allocations.allocations,
            since: &aged.unwrap_or(&self.allocations).since,
            range: &self.cfg.port_range,
            model: &self.cfg.model,
            node,
            policy: &self.cfg.policy,
            host,
            pools: loaded.pools.as_deref(),
            registry: loaded.registry.as_ref(),
        };
        desired::compute(&inputs, self.metrics.per_service, &mut self.kept, self.dataplane.applied())
    }

    /// Manifests mode, a whole sync (the first, or one after a failure): the allocation state
    /// with the time it will stamp given now to every Service that has none (later than every
    /// time it has, so that they stay the youngest, as without one); `None` when every Service
    /// has one. Decided with these ages, a Service allocated now is decided with the age it is
    /// stamped with, and the next sync does not decide every new Service again for its new age
    /// (at the start that is every Service, and the first change would wait for all of them).
    fn provisional_ages(&self, loaded: &Snapshot) -> Option<State> {
        if self.source.mode() != AllocationMode::Allocate || self.dataplane.applied().is_some() {
            return None;
        }
        let since = &self.allocations.since;
        let latest = since.values().max().map(|t| *t + Duration::from_micros(1));
        let now = latest.map_or(Timestamp::now(), |l| l.max(Timestamp::now()));
        let mut aged = self.allocations.clone();
        for svc in &loaded.services {
            aged.since.entry(crate::core::inputs::model::service_key(svc)).or_insert(now);
        }
        (aged.since.len() > since.len()).then_some(aged)
    }

    /// Keeps the allocations (manifests mode: in the state file, before anything is programmed
    /// with them), taken out of `desired`: from here on they are `self.allocations`. `aged`: the
    /// ages the sync decided with ([`Agent::provisional_ages`]), stamped on what it allocated.
    fn persist<R, I>(&mut self, desired: &mut Desired<R, I>, aged: Option<State>) -> Result<(), AgentError> {
        let write_due = self.state.as_ref().is_some_and(StateFile::write_due);
        if desired.allocations == self.allocations.allocations && !write_due {
            return Ok(());
        }
        match self.source.mode() {
            AllocationMode::Allocate => {
                // Never silently (manifests mode has no Events): a number no longer valid for
                // its Service, e.g. outside its pool's ranges after an edit.
                for (key, id, old, new) in
                    crate::core::decisions::alloc::moved(&self.allocations.allocations, &desired.allocations)
                {
                    warn!(service = %key, port = %id, old, new, "node port reallocated: {old} is no longer valid for it (its pool's ranges or its pool changed)");
                }
                let base = aged.as_ref().unwrap_or(&self.allocations);
                let next = base.stamp(std::mem::take(&mut desired.allocations), Timestamp::now());
                if let Some(state) = &mut self.state {
                    state.save_change(&self.allocations, &next)?;
                }
                self.allocations = next;
            }
            // The leader's annotations are the record, and nothing reads an allocation's age
            // (duplicates are settled by creationTimestamp): nothing is stamped or saved.
            AllocationMode::Annotated => {
                self.allocations.allocations = std::mem::take(&mut desired.allocations);
                self.allocations.since.clear();
            }
        }
        Ok(())
    }

    /// The source's snapshot ([`Loaded::Unchanged`] when its fingerprint is `known`). An error
    /// (the source could not be read at all) is reported in the status; the caller keeps the
    /// kernel as it is.
    fn load(&mut self, known: Option<Fingerprint>, may_defer: bool) -> Result<Loaded, AgentError> {
        self.source.snapshot(&self.cfg.model, known, may_defer).map_err(|e| {
            self.set_problems(vec![e.to_string()]);
            e.into()
        })
    }

    /// Counts one sync attempt: `nodelb_syncs_total`, the duration, the failure reason, the
    /// families served, and `last_sync` in the status (which `/readyz` reads), with the Services
    /// when the attempt computed them.
    fn record(&mut self, attempt: Attempt, error: Option<&AgentError>) {
        let m = &self.metrics;
        let ok = error.is_none();
        let elapsed = attempt.started.elapsed();
        let now = SystemTime::now().duration_since(UNIX_EPOCH).unwrap_or_default();
        m.syncs.with_label_values(&[attempt.kind, if ok { "success" } else { "error" }]).inc();
        m.sync_duration.with_label_values(&[attempt.kind]).observe(elapsed.as_secs_f64());
        match error {
            None => m.last_success.set(now.as_secs_f64()),
            Some(e) => m.sync_failures.with_label_values(&[e.reason()]).inc(),
        }
        // A failed sync serves no family: its next attempt replaces the whole table.
        let served: BTreeSet<Family> = if ok { self.node_facts().families } else { BTreeSet::new() };
        for f in Family::ALL {
            m.family_served.with_label_values(&[f.name()]).set(i64::from(served.contains(&f)));
        }
        let sync = SyncStatus {
            ok,
            kind: attempt.kind.to_string(),
            changes: attempt.changes,
            duration_ms: elapsed.as_secs_f64() * 1000.0,
            error: error.map(|e| e.to_string()),
            at: now.as_secs(),
        };
        // The previous status' Services are dropped after the lock is released.
        let _previous = {
            let mut st = crate::locks::write(&self.status);
            let previous = attempt.report.map(|r| {
                st.needed_families = r.needed_families;
                st.problems = r.problems;
                st.source_synced = true;
                st.refused = r.refused;
                std::mem::replace(&mut st.services, r.services)
            });
            st.last_sync = Some(sync);
            for (name, fam) in st.families.iter_mut() {
                fam.programmed = served.iter().any(|f| f.name() == name);
            }
            previous
        };
    }

    /// The gauges computed from the desired state. `nodelb_services` series are set in place and
    /// only the label sets that are gone are removed, so a scrape never sees them missing.
    fn update_service_gauges<R, I>(
        &mut self,
        desired: &Desired<R, I>,
        pools: Option<&crate::core::decisions::pool::PoolContext>,
        manifest_problems: usize,
    ) {
        let m = &self.metrics;
        let mut by_state: BTreeMap<(&'static str, String), i64> = BTreeMap::new();
        for s in &desired.services {
            let state = match s.state {
                ServiceState::Programmed => "programmed",
                ServiceState::NoEndpoints => "no-endpoints",
                ServiceState::Refused => "refused",
            };
            *by_state.entry((state, s.reason_code.clone().unwrap_or_default())).or_default() += 1;
        }
        for gone in self.services_series.iter().filter(|k| !by_state.contains_key(*k)) {
            let _ = m.services.remove_label_values(&[gone.0, &gone.1]);
        }
        for ((state, reason), n) in &by_state {
            m.services.with_label_values(&[state, reason.as_str()]).set(*n);
        }
        self.services_series = by_state.into_keys().collect();
        let ports = desired.services.iter().flat_map(|s| s.ports.iter());
        m.service_ports.set(ports.clone().filter(|p| p.node_port.is_some()).count() as i64);
        m.nat_shard_tables.set(i64::from(self.nat_shards));
        m.endpoints.set(ports.map(|p| p.endpoints as i64).sum());
        let allocations = &self.allocations.allocations;
        let numbers: BTreeSet<u16> = allocations.values().flat_map(|p| p.values().copied()).collect();
        m.allocations.set(numbers.len() as i64);
        let in_range = numbers.iter().filter(|n| self.cfg.port_range.contains(**n)).count();
        m.free_ports.set(self.cfg.port_range.len().saturating_sub(in_range) as i64);
        // Without pool objects (the flags' pool) there is nothing to count: no per-Service keys
        // are built on every sync.
        let usage = match pools.filter(|p| !p.set.implicit) {
            Some(p) => {
                let keys: Vec<(ServiceKey, &str)> = desired
                    .services
                    .iter()
                    .filter_map(|s| {
                        Some((ServiceKey::new(s.namespace.clone(), s.name.clone()), s.pool.as_deref()?))
                    })
                    .collect();
                crate::core::decisions::pool::usage(&p.set, allocations, keys.iter().map(|(k, p)| (k, *p)))
            }
            None => Vec::new(),
        };
        let series: BTreeSet<String> = usage.iter().map(|u| u.name.clone()).collect();
        for gone in self.pool_series.difference(&series) {
            for state in ["allocated", "free"] {
                let _ = m.pool_ports.remove_label_values(&[gone, state]);
            }
        }
        for u in &usage {
            m.pool_ports.with_label_values(&[u.name.as_str(), "allocated"]).set(u.allocated as i64);
            m.pool_ports.with_label_values(&[u.name.as_str(), "free"]).set(u.free as i64);
        }
        self.pool_series = series;
        m.manifest_problems.set(manifest_problems as i64);
        let mut refused: BTreeMap<&str, i64> =
            crate::core::decisions::endpoint_policy::REASON_CODES.iter().map(|c| (*c, 0)).collect();
        for r in &desired.refused_endpoints {
            *refused.entry(r.reason.code()).or_default() += 1;
        }
        for (reason, n) in refused {
            m.endpoints_refused.with_label_values(&[reason]).set(n);
        }
        let mut ports: BTreeMap<&str, i64> =
            [("not_allowed", 0), ("in_use", 0), ("not_selected", 0), ("not_recorded", 0)].into();
        for r in &desired.refused_ports {
            *ports.entry(r.reason.code()).or_default() += 1;
        }
        for p in &desired.alloc_problems {
            match p {
                crate::core::decisions::alloc::AllocProblem::NotAllowed { .. } => {
                    *ports.entry("not_allowed").or_default() += 1
                }
                crate::core::decisions::alloc::AllocProblem::InUse { .. } => {
                    *ports.entry("in_use").or_default() += 1
                }
                _ => {}
            }
        }
        for (reason, n) in ports {
            m.node_ports_refused.with_label_values(&[reason]).set(n);
        }
    }

    fn report_refusals<R, I>(&mut self, desired: &Desired<R, I>) {
        let current = desired
            .refusals
            .iter()
            .map(|r| r.to_string())
            .chain(desired.alloc_problems.iter().map(|p| p.to_string()))
            .chain(desired.refused_endpoints.iter().map(|r| r.to_string()))
            .chain(desired.refused_ports.iter().map(|r| r.to_string()))
            .collect();
        log_new(
            &mut self.logged_refusals,
            current,
            |msg| warn!(refusal = %msg, "service not (fully) programmed"),
        );
    }

    fn set_problems(&self, problems: Vec<String>) {
        let mut st = crate::locks::write(&self.status);
        st.problems = problems;
    }
}

impl HostFirewall {
    /// Runs the host-firewall check and reports it: a log line per change (naming the table and
    /// chain, or the evidence, and the fix), `/status`, readiness (a family dropped for certain
    /// is not served), metrics. The Kubernetes Event and node Lease follow from the status.
    fn check(&mut self, metrics: &Metrics, status: &SharedStatus) {
        let now = SystemTime::now().duration_since(UNIX_EPOCH).unwrap_or_default().as_secs();
        let report = self.checker.check(&mut self.nft, now);
        for c in &report.changes {
            info!(change = %c, "host firewall");
        }
        log_new(
            &mut self.logged_problems,
            report.problems.iter().cloned().collect(),
            |p| warn!(problem = %p, "host firewall check"),
        );
        for (f, d) in &report.diagnosis {
            let (state, text) = firewall::state_words(d);
            let key = format!("{state}: {text}");
            if self.logged.get(f) == Some(&key) {
                continue;
            }
            let was = self.logged.insert(*f, key).is_some();
            match state {
                "blocked" => warn!(
                    family = %f,
                    "forwarded {f} connections of nodelb Services are dropped by the host firewall, so this node does not serve {f}: {text}"
                ),
                "evidence" => warn!(family = %f, "{text}"),
                "suspect" => warn!(
                    family = %f,
                    "the host firewall may drop forwarded {f} connections of nodelb Services (no traffic yet to tell): {text}"
                ),
                _ if was => {
                    info!(family = %f, "no host firewall drops forwarded {f} connections of nodelb Services any more")
                }
                _ => {}
            }
        }
        let fw = &metrics.firewall;
        let (drops, accept) = report.metric_series();
        fw.set_chains(drops, accept);
        let mut st = crate::locks::write(status);
        for f in Family::ALL {
            let d = report.diagnosis.get(&f).cloned().unwrap_or_default();
            fw.blocked.with_label_values(&[f.name()]).set(i64::from(d.blocked.is_some()));
            fw.evidence.with_label_values(&[f.name()]).set(i64::from(d.evidence.is_some()));
            let entry = st.families.entry(f.name().to_string()).or_default();
            entry.firewall = d.blocked;
            entry.evidence = d.evidence;
        }
        st.host_firewall = report.status(now);
    }
}

/// Stamps the Services of a state file written by an older nodelb (no allocation times) with
/// the time they are first read, and writes that down at once: from then on their age is fixed.
/// A file that cannot be written is used as read (the next save retries).
fn migrate(file: &mut StateFile, state: State) -> State {
    let missing = state.allocations.keys().filter(|k| !state.since.contains_key(*k)).count();
    if missing == 0 {
        return state;
    }
    let stamped = state.stamp(state.allocations.clone(), Timestamp::now());
    info!(
        file = %file.path().display(),
        services = missing,
        "state file has Services without an allocation time (written by an older nodelb); recording now"
    );
    if let Err(e) = file.save(&stamped) {
        warn!(error = %e, "cannot write the allocation times yet; retrying at the next allocation change");
    }
    stamped
}

/// Where a sync's time went, for a debug line: `load=1.2 desired=8.0 …` (ms per phase).
struct Phases {
    last: Instant,
    done: Vec<(&'static str, Duration)>,
}

impl Phases {
    fn new(started: Instant) -> Phases {
        Phases { last: started, done: Vec::new() }
    }

    /// Ends the phase called `name` now.
    fn mark(&mut self, name: &'static str) {
        let now = Instant::now();
        self.done.push((name, now - self.last));
        self.last = now;
    }
}

impl std::fmt::Display for Phases {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        for (i, (name, d)) in self.done.iter().enumerate() {
            let sep = if i == 0 { "" } else { " " };
            write!(f, "{sep}{name}={:.2}", d.as_secs_f64() * 1e3)?;
        }
        Ok(())
    }
}

/// Logs the messages of `current` that were not reported last time, then remembers `current`: a
/// message is logged once while it persists, and again if it goes away and comes back.
fn log_new(reported: &mut BTreeSet<String>, current: BTreeSet<String>, log: impl Fn(&str)) {
    for msg in current.difference(reported) {
        log(msg);
    }
    *reported = current;
}

pub mod schedule;
#[cfg(test)]
mod tests;

/// The ports of the snapshot's `type: LoadBalancer` Services: what `--nat-shards auto` sizes the
/// shards for (an upper bound of the ports programmed: some may be refused or unallocated).
pub fn lb_service_ports<'a>(
    services: impl IntoIterator<Item = &'a k8s_openapi::api::core::v1::Service>,
) -> usize {
    services
        .into_iter()
        .filter_map(|s| s.spec.as_ref())
        .filter(|spec| spec.type_.as_deref() == Some("LoadBalancer"))
        .map(|spec| spec.ports.as_ref().map_or(0, Vec::len))
        .sum()
}
