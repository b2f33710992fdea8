//! The sync loop of `nodelb run`: watch the source, check the forwarding sysctls, compute the
//! desired state, and program the kernel in one netlink batch per sync. Owns the policy around the
//! batch: the first sync replaces whatever is there atomically (so a restart never drops traffic),
//! later syncs are diffs, a failed batch forces a full resync with backoff, and a kernel that no
//! longer matches what we programmed (someone deleted or edited our table) is repaired.

use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use tracing::{debug, error, info, warn};

use crate::alloc::{Allocations, PortRange};
use crate::conntrack::{self, ConntrackClient};
use crate::desired::{self, AllocationMode, Desired, Inputs};
use crate::ir::{Change, Family, Ruleset};
use crate::manifests;
use crate::metrics::Metrics;
use crate::model::ModelOptions;
use crate::nft::{self, NftClient};
use crate::plan::{self, NodeFacts};
use crate::source::Source;
use crate::state::StateFile;
use crate::status::{ServiceState, SharedStatus, SyncStatus};
use crate::sysctl::{Sysctls, forwarding_sysctl};

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
    pub model: ModelOptions,
    pub sysctls: Sysctls,
}

#[derive(Debug, thiserror::Error)]
pub enum AgentError {
    #[error(transparent)]
    Nft(#[from] nft::NftError),
    #[error(transparent)]
    Manifests(#[from] manifests::ManifestError),
    #[error(transparent)]
    State(#[from] crate::state::StateError),
}

const MIN_BACKOFF: Duration = Duration::from_millis(200);
const MAX_BACKOFF: Duration = Duration::from_secs(30);
const SYSCTL_PERIOD: Duration = Duration::from_secs(1);

struct Agent {
    cfg: AgentConfig,
    metrics: Arc<Metrics>,
    status: SharedStatus,
    nft: NftClient,
    source: Source,
    state: Option<StateFile>,
    allocations: Allocations,
    /// What we last programmed and saw the kernel accept; `None` forces a full replace.
    applied: Option<Ruleset>,
    /// Ruleset generation right after our last batch; a different value means someone else
    /// committed a transaction in this netns since, so we verify our table.
    generation: Option<u32>,
    families: BTreeMap<Family, bool>,
    /// Refusals and input problems currently reported, to log each once per occurrence.
    logged_refusals: BTreeSet<String>,
    logged_problems: BTreeSet<String>,
    backoff: Duration,
    /// Source fingerprint and node facts of the last successful sync: the same again (a relist
    /// that brought nothing new) means nothing to recompute.
    last_input: Option<(u64, NodeFacts)>,
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
    let state = cfg.state_file.clone().map(StateFile::new);
    let allocations = match &state {
        Some(s) => s.load()?,
        None => Default::default(),
    };
    let nft = NftClient::new()?;
    {
        let mut st = status.write().unwrap_or_else(|e| e.into_inner());
        st.node_name = cfg.node_name.clone();
    }
    let mut agent = Agent {
        cfg,
        metrics,
        status,
        nft,
        source,
        state,
        allocations,
        applied: None,
        generation: None,
        families: BTreeMap::new(),
        logged_refusals: BTreeSet::new(),
        logged_problems: BTreeSet::new(),
        backoff: MIN_BACKOFF,
        last_input: None,
    };
    info!(source = %agent.source.describe(), node = %agent.cfg.node_name, "nodelb agent starting");

    tokio::pin!(shutdown);
    let mut resync = tokio::time::interval(agent.cfg.resync_period);
    let mut sysctl_tick = tokio::time::interval(SYSCTL_PERIOD);
    let mut dirty = true;
    let mut verify = false;
    let mut retry_at: Option<tokio::time::Instant> = None;
    loop {
        agent.tick();
        if agent.check_forwarding() {
            dirty = true;
        }
        let due = retry_at.is_none_or(|t| tokio::time::Instant::now() >= t);
        if (dirty || verify) && due {
            match agent.sync(verify).await {
                Ok(()) => {
                    retry_at = None;
                    agent.backoff = MIN_BACKOFF;
                }
                Err(e) => {
                    error!(error = %e, retry_in = ?agent.backoff, "sync failed; next attempt is a full resync");
                    agent.applied = None;
                    retry_at = Some(tokio::time::Instant::now() + agent.backoff);
                    agent.backoff = (agent.backoff * 2).min(MAX_BACKOFF);
                }
            }
            dirty = retry_at.is_some();
            verify = false;
        }
        let retry_sleep = async {
            match retry_at {
                Some(t) => tokio::time::sleep_until(t).await,
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            _ = &mut shutdown => {
                info!("shutting down; rules stay in the kernel (use `nodelb cleanup` to remove them)");
                return Ok(());
            }
            _ = agent.source.changed() => { debug!("source changed"); dirty = true; }
            _ = resync.tick() => { verify = true; }
            _ = sysctl_tick.tick() => {}
            _ = retry_sleep => {}
        }
    }
}

impl Agent {
    fn tick(&self) {
        let mut st = self.status.write().unwrap_or_else(|e| e.into_inner());
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
            let mut st = self.status.write().unwrap_or_else(|e| e.into_inner());
            let entry = st.families.entry(f.name().to_string()).or_default();
            entry.forwarding = enabled;
            self.metrics.forwarding.with_label_values(&[f.name()]).set(i64::from(enabled));
            entry.programmed = enabled && self.applied.is_some();
            entry.reason = reason;
        }
        changed
    }

    fn node_facts(&self) -> NodeFacts {
        NodeFacts {
            node_name: self.cfg.node_name.clone(),
            families: self.families.iter().filter(|(_, on)| **on).map(|(f, _)| *f).collect(),
            masquerade_mark: self.cfg.masquerade_mark,
        }
    }

    /// One sync, with its outcome counted in the metrics.
    async fn sync(&mut self, verify: bool) -> Result<(), AgentError> {
        let result = self.sync_once(verify).await;
        if let Err(e) = &result {
            let reason = match e {
                AgentError::Nft(_) => "netlink",
                AgentError::Manifests(_) => "manifests",
                AgentError::State(_) => "state_file",
            };
            self.metrics.sync_failures.with_label_values(&[reason]).inc();
        }
        result
    }

    async fn sync_once(&mut self, verify: bool) -> Result<(), AgentError> {
        let started = Instant::now();
        let mut phases = Phases::new(started);
        let loaded = match self.source.snapshot(&self.cfg.model) {
            Ok(Some(snapshot)) => snapshot,
            Ok(None) => {
                // Never program from a partial view: the old rules stay until the caches are complete.
                debug!("source not complete yet; waiting");
                return Ok(());
            }
            Err(e) => {
                // Never program from a view we could not read: keep the kernel as it is.
                self.set_problems(vec![e.to_string()]);
                return Err(e.into());
            }
        };
        let node = self.node_facts();
        // The same input as the last good sync: nothing to recompute. A resync then only asks the
        // kernel whether any nftables transaction happened since our last batch; if one did, the
        // full path below reads the table back and repairs it. (At 10,000 Services recomputing
        // every resync period cost ~7% of a core and a transient copy of every object.)
        if let (Some(fp), Some((last_fp, last_node))) = (loaded.fingerprint, &self.last_input)
            && fp == *last_fp
            && node == *last_node
            && self.applied.is_some()
            && (!verify || !self.generation_changed()?)
        {
            return Ok(());
        }
        phases.mark("load");
        let problems: Vec<String> = loaded.problems.clone();
        log_new(
            &mut self.logged_problems,
            problems.iter().cloned().collect(),
            |p| warn!(problem = %p, "input problem"),
        );
        let mut desired: Desired = desired::compute(&Inputs {
            mode: self.source.mode(),
            services: &loaded.services,
            slices: &loaded.slices,
            previous: &self.allocations,
            range: &self.cfg.port_range,
            model: &self.cfg.model,
            node: &node,
        });
        phases.mark("desired");
        self.report_refusals(&desired);
        if desired.allocations != self.allocations {
            if let Some(state) = &self.state
                && self.source.mode() == AllocationMode::Allocate
            {
                state.save(&desired.allocations)?;
            }
            self.allocations = desired.allocations.clone();
        }
        phases.mark("state");

        let applied = self.applied.take();
        let (changes, kind) = match &applied {
            None => (desired.ruleset.full_replace(), "full"),
            Some(applied) => {
                let needs_check = verify && self.generation_changed()?;
                if needs_check && self.tampered(applied)? {
                    self.metrics.repairs.inc();
                    (desired.ruleset.full_replace(), "full")
                } else {
                    (plan::diff(applied, &desired.ruleset), "incremental")
                }
            }
        };
        self.applied = applied;
        phases.mark("diff");
        let count = changes.len();
        // Counters of chains this batch flushes or deletes restart at zero: read them first and
        // fold them into the exported totals once the batch is in.
        let resetting = resetting_chains(&changes, &self.kept_counter_chains(&desired));
        let before = if resetting.is_empty() { None } else { self.nft.read_table().ok().flatten() };
        phases.mark("counters");
        let result = if changes.is_empty() {
            Ok(())
        } else {
            self.nft.apply(&changes).map(|stats| self.metrics.batch_messages.observe(stats.messages as f64))
        };
        let ok = result.is_ok();
        phases.mark("apply");
        self.metrics.syncs.with_label_values(&[kind, if ok { "success" } else { "error" }]).inc();
        self.metrics.sync_duration.with_label_values(&[kind]).observe(started.elapsed().as_secs_f64());
        self.update_gauges(&desired, &node, ok, problems.len());
        if ok {
            let mut counters = self.metrics.counters.lock().unwrap_or_else(|e| e.into_inner());
            if let Some(table) = &before {
                counters.fold(table, &resetting, &desired.counter_index);
            }
            counters.set_index(std::mem::take(&mut desired.counter_index));
            self.metrics
                .last_success
                .set(SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_secs_f64()).unwrap_or(0.0));
        }
        let sync = SyncStatus {
            ok,
            kind: kind.to_string(),
            changes: count,
            duration_ms: started.elapsed().as_secs_f64() * 1000.0,
            error: result.as_ref().err().map(|e| e.to_string()),
            at: SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0),
        };
        if ok {
            if count > 0 {
                info!(kind, changes = count, ms = sync.duration_ms, "synced");
            }
            self.flush_stale_udp(&desired.ruleset);
            self.generation = Some(self.nft.generation()?);
            self.last_input = loaded.fingerprint.map(|fp| (fp, node.clone()));
        }
        phases.mark("after");
        // The previous status' Services are dropped after the lock is released.
        let _previous = {
            let mut st = self.status.write().unwrap_or_else(|e| e.into_inner());
            let previous = std::mem::replace(&mut st.services, desired.services);
            st.needed_families = desired.needed_families.iter().map(|f| f.name().to_string()).collect();
            st.problems = problems;
            st.problems.extend(desired.warnings.iter().cloned());
            st.source_synced = true;
            st.last_sync = Some(sync);
            for (name, fam) in st.families.iter_mut() {
                let served = node.families.iter().any(|f| f.name() == name);
                fam.programmed = ok && served;
            }
            previous
        };
        if ok {
            self.applied = Some(desired.ruleset);
        }
        phases.mark("status");
        debug!(kind, changes = count, phases = %phases, "sync breakdown (ms)");
        result.map_err(AgentError::from)
    }

    /// Chains (now or in the previous sync) whose counters feed a series that is still exported
    /// after this sync: their counts must be read before a batch resets them. A Service that goes
    /// away takes its series with it, so its chains need no read (at 1,000 Services × 5 endpoints,
    /// reading the table costs ~40 ms of a removal's reaction time).
    fn kept_counter_chains(&self, desired: &Desired) -> BTreeSet<String> {
        let counters = self.metrics.counters.lock().unwrap_or_else(|e| e.into_inner());
        let live: BTreeSet<_> = desired.counter_index.values().collect();
        counters
            .index
            .iter()
            .chain(&desired.counter_index)
            .filter(|(_, series)| live.contains(series))
            .map(|(chain, _)| chain.clone())
            .collect()
    }

    fn update_gauges(&self, desired: &Desired, node: &NodeFacts, ok: bool, manifest_problems: usize) {
        let m = &self.metrics;
        m.services.reset();
        for s in &desired.services {
            let state = match s.state {
                ServiceState::Programmed => "programmed",
                ServiceState::NoEndpoints => "no-endpoints",
                ServiceState::Refused => "refused",
            };
            m.services.with_label_values(&[state, s.reason_code.as_deref().unwrap_or("")]).inc();
        }
        let ports = desired.services.iter().flat_map(|s| s.ports.iter());
        m.service_ports.set(ports.clone().filter(|p| p.node_port.is_some()).count() as i64);
        m.endpoints.set(ports.map(|p| p.endpoints as i64).sum());
        let numbers: BTreeSet<u16> = desired.allocations.values().flat_map(|p| p.values().copied()).collect();
        m.allocations.set(numbers.len() as i64);
        let in_range = numbers.iter().filter(|n| self.cfg.port_range.contains(**n)).count();
        m.free_ports.set(self.cfg.port_range.len().saturating_sub(in_range) as i64);
        m.manifest_problems.set(manifest_problems as i64);
        for f in Family::ALL {
            m.family_served.with_label_values(&[f.name()]).set(i64::from(ok && node.families.contains(&f)));
        }
    }

    /// UDP endpoints that left a node port since the last batch: delete their conntrack entries
    /// so clients that keep their source port are re-balanced instead of black-holed.
    fn flush_stale_udp(&mut self, desired: &Ruleset) {
        let Some(applied) = &self.applied else { return };
        let before = conntrack::udp_backends(applied);
        let after = conntrack::udp_backends(desired);
        let gone: BTreeSet<_> = before.difference(&after).copied().collect();
        if gone.is_empty() {
            return;
        }
        match ConntrackClient::new().and_then(|mut ct| ct.delete_stale_udp(&gone)) {
            Ok(n) => debug!(entries = n, backends = gone.len(), "deleted stale UDP conntrack entries"),
            Err(e) => warn!(error = %e, "could not delete stale UDP conntrack entries"),
        }
    }

    fn generation_changed(&mut self) -> Result<bool, AgentError> {
        let now = self.nft.generation()?;
        Ok(self.generation != Some(now))
    }

    /// Compares the kernel's table with what we programmed; logs each difference.
    fn tampered(&mut self, applied: &Ruleset) -> Result<bool, AgentError> {
        let table = self.nft.read_table()?;
        let diffs = nft::verify(applied, table.as_ref());
        if diffs.is_empty() {
            // Someone else's transaction (another table): remember the new generation.
            self.generation = Some(self.nft.generation()?);
            return Ok(false);
        }
        for d in diffs.iter().take(20) {
            warn!(difference = %d, "table inet nodelb was changed behind our back; repairing");
        }
        if diffs.len() > 20 {
            warn!(more = diffs.len() - 20, "further differences not shown");
        }
        Ok(true)
    }

    fn report_refusals(&mut self, desired: &Desired) {
        let current = desired
            .refusals
            .iter()
            .map(|r| r.to_string())
            .chain(desired.alloc_problems.iter().map(|p| p.to_string()))
            .collect();
        log_new(
            &mut self.logged_refusals,
            current,
            |msg| warn!(refusal = %msg, "service not (fully) programmed"),
        );
    }

    fn set_problems(&self, problems: Vec<String>) {
        let mut st = self.status.write().unwrap_or_else(|e| e.into_inner());
        st.problems = problems;
    }
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

/// Named counters (among `tracked`) that this batch deletes: the whole table on a full replace,
/// else the counters of Service ports that stop being programmed. Flushing or replacing chains
/// does not touch them.
fn resetting_chains(changes: &[Change], tracked: &BTreeSet<String>) -> BTreeSet<String> {
    if changes.iter().any(|c| matches!(c, Change::DeleteTable)) {
        return tracked.clone();
    }
    changes
        .iter()
        .filter_map(|c| match c {
            Change::DeleteCounter(n) if tracked.contains(n) => Some(n.clone()),
            _ => None,
        })
        .collect()
}

/// Logs the messages of `current` that were not reported last time, then remembers `current`: a
/// message is logged once while it persists, and again if it goes away and comes back.
fn log_new(reported: &mut BTreeSet<String>, current: BTreeSet<String>, log: impl Fn(&str)) {
    for msg in current.difference(reported) {
        log(msg);
    }
    *reported = current;
}
