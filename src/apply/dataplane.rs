//! The apply step of a sync: the kernel and what nodelb last programmed into it. Owns the policy
//! around the batch: the first batch replaces whatever table is there atomically (so a restart
//! never drops traffic), later batches are diffs, a kernel that no longer holds what we
//! programmed (someone deleted or edited our table) is repaired with a full replace, a full
//! replace puts the client affinities back, and the named counters a batch resets are folded
//! into the exported totals. What to send is decided by pure functions: [`next_batch`] for a
//! whole ruleset, [`patch_batch`] for a patch of the one the kernel holds (the incremental
//! planner's, `crate::core::incremental::replan`), which is then applied to it in place.

use std::collections::BTreeSet;

use tracing::{debug, warn};

use crate::apply::kernel::Kernel;
use crate::core::incremental::replan::{Planned, RulesetPatch};
use crate::core::reports::counters::{CounterState, IndexUpdate};
use crate::core::ruleset::ir::{Carried, Change, KeyType, Name, Ruleset, SetKind};
use crate::core::ruleset::plan::{self, UdpBackend};
use crate::encode::nft::{self, NftError};
use crate::serve::metrics::Metrics;

#[derive(Debug, thiserror::Error)]
pub enum DataplaneError {
    /// The kernel refused the batch (or netlink failed while sending it).
    #[error(transparent)]
    Batch(NftError),
    /// Reading the ruleset generation or our table back failed.
    #[error("reading the ruleset back from the kernel: {0}")]
    KernelRead(#[source] NftError),
    /// A patch came for a ruleset the kernel is not known to hold (the sync loop plans against
    /// [`Dataplane::applied`], so only a bug gets here); the next sync replaces the whole table.
    #[error("a patch of the ruleset came without the ruleset it patches")]
    NoBase,
}

/// What a sync sends.
#[derive(Debug, PartialEq, Eq)]
pub enum Batch {
    /// The desired ruleset replaces the table (`Ruleset::full_replace`), encoded straight from
    /// the ruleset: a copy of it as a change list would add a second ruleset to the sync's peak.
    FullReplace,
    Diff(Vec<Change>),
}

impl Batch {
    /// The `kind` label of the sync metrics.
    pub fn kind(&self) -> &'static str {
        match self {
            Batch::FullReplace => "full",
            Batch::Diff(_) => "incremental",
        }
    }

    /// Number of changes (of `desired`'s full replace, for a full replace).
    pub fn len(&self, desired: &Ruleset) -> usize {
        match self {
            Batch::FullReplace => desired.full_replace_refs().count(),
            Batch::Diff(changes) => changes.len(),
        }
    }
}

/// What to send to bring the kernel from what we last programmed (`applied`; `None`: unknown,
/// as at start and after a failure) to `desired`. A table found `tampered` is replaced whole, as
/// is one whose base chains or set types change (which a diff cannot express).
pub fn next_batch(applied: Option<&Ruleset>, tampered: bool, desired: &Ruleset) -> Batch {
    match applied {
        None => Batch::FullReplace,
        Some(_) if tampered => Batch::FullReplace,
        Some(applied) if plan::needs_full_replace(applied, desired) => Batch::FullReplace,
        Some(applied) => Batch::Diff(plan::diff(applied, desired)),
    }
}

/// [`next_batch`] for a patch of the ruleset the kernel holds: the diff of the names it touches
/// (every other name is the same on both sides), unless the table was `tampered` with.
pub fn patch_batch(patch: &RulesetPatch, tampered: bool) -> Batch {
    if tampered || plan::needs_full_replace(&patch.old, &patch.new) {
        Batch::FullReplace
    } else {
        Batch::Diff(plan::diff(&patch.old, &patch.new))
    }
}

/// Named counters whose series outlive this batch ([`CounterState::is_kept`]) and that it
/// deletes: every one on a full replace, else the counters of Service ports that stop being
/// programmed. Flushing or replacing chains does not touch them. A diff looks at its own deletions
/// only (the whole index names the counters of every Service port).
pub fn resetting_counters(batch: &Batch, state: &CounterState, next: &IndexUpdate) -> BTreeSet<Name> {
    let changes = match batch {
        Batch::FullReplace => return state.kept_counters(next),
        Batch::Diff(changes) => changes,
    };
    changes
        .iter()
        .filter_map(|c| match c {
            Change::DeleteCounter(n) if state.is_kept(n, next) => Some(n.clone()),
            _ => None,
        })
        .collect()
}

/// The batch one [`Dataplane::program`] sent, and how it went.
pub struct Programmed {
    /// `full` or `incremental`.
    pub kind: &'static str,
    pub changes: usize,
    /// Bytes of the batch sent (0: none was).
    pub bytes: usize,
    /// `Err`: the kernel refused it (nothing of it was applied).
    pub result: Result<(), DataplaneError>,
}

/// The kernel, and what we know it holds.
pub struct Dataplane<K> {
    pub(crate) kernel: K,
    /// What we last programmed and saw the kernel accept; `None` forces a full replace.
    applied: Option<Ruleset>,
    /// Ruleset generation right after our last batch; a different value means someone else
    /// committed a transaction in this netns since, so we verify our table.
    generation: Option<u32>,
}

impl<K: Kernel> Dataplane<K> {
    pub fn new(kernel: K) -> Dataplane<K> {
        Dataplane { kernel, applied: None, generation: None }
    }

    /// What we last programmed, when the kernel is known to hold it.
    pub fn applied(&self) -> Option<&Ruleset> {
        self.applied.as_ref()
    }

    /// The kernel's content is unknown from now on (after any failed sync): the next batch
    /// replaces the whole table.
    pub fn forget(&mut self) {
        self.applied = None;
    }

    /// Whether any nftables transaction (ours or anyone's) happened since our last batch.
    pub fn generation_changed(&mut self) -> Result<bool, DataplaneError> {
        let now = self.kernel.generation().map_err(DataplaneError::KernelRead)?;
        Ok(self.generation != Some(now))
    }

    /// Compares the kernel's table with what we programmed; logs each difference.
    fn tampered(&mut self, applied: &Ruleset) -> Result<bool, DataplaneError> {
        let table = self.kernel.read_table(applied).map_err(DataplaneError::KernelRead)?;
        if let Some(t) = &table {
            debug!(dumped_tables = t.dumped_tables, "read our tables back to verify them");
        }
        let diffs = nft::verify(applied, table.as_ref());
        if diffs.is_empty() {
            // Someone else's transaction (another table): remember the new generation.
            self.generation = Some(self.kernel.generation().map_err(DataplaneError::KernelRead)?);
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

    /// On a resync (`verify`), whether someone changed our table since our last batch (then it is
    /// replaced). Errors are kernel reads that failed.
    fn check(&mut self, verify: bool, applied: &Ruleset) -> Result<bool, DataplaneError> {
        Ok(verify && self.generation_changed()? && self.tampered(applied)?)
    }

    /// Brings the kernel to the planned ruleset in one batch ([`next_batch`], [`patch_batch`]).
    /// With per-Service metrics, the counters the batch resets are read first and folded into
    /// the exported totals once it is in, and `counter_index` is installed. On success the
    /// planned ruleset is what we know the kernel holds; on failure nothing of the batch was
    /// applied. An error is a failed check of the kernel on a resync (`verify`), before any batch.
    pub fn program(
        &mut self,
        planned: Planned,
        counter_index: IndexUpdate,
        verify: bool,
        metrics: &Metrics,
    ) -> Result<Programmed, DataplaneError> {
        let applied = self.applied.take();
        let checked = match &applied {
            None => Ok(false),
            Some(a) => self.check(verify, a),
        };
        let tampered = match checked {
            Ok(tampered) => tampered,
            Err(e) => {
                self.applied = applied;
                return Err(e);
            }
        };
        if tampered {
            metrics.repairs.inc();
        }
        // The batch, the UDP backends it takes away, and the whole ruleset it leads to.
        let (batch, gone_udp, desired) = match planned {
            Planned::Full(desired) => {
                let batch = next_batch(applied.as_ref(), tampered, &desired);
                let gone = applied.as_ref().map(|a| stale_udp(a, &desired)).unwrap_or_default();
                self.applied = applied;
                (batch, gone, desired)
            }
            Planned::Patch(patch) => {
                let Some(mut desired) = applied else { return Err(DataplaneError::NoBase) };
                let batch = patch_batch(&patch, tampered);
                let gone = stale_udp(&patch.old, &patch.new);
                // The kernel's content is unknown until the batch is in.
                patch.apply(&mut desired);
                (batch, gone, desired)
            }
        };
        let kind = batch.kind();
        let changes = batch.len(&desired);
        // Held until the fold: a scrape sees the counters of one side of the batch.
        let mut counters = metrics.per_service.then(|| crate::locks::lock(&metrics.counters));
        // Counters that this batch resets (table replaced, counter deleted) and whose series stay:
        // read them first and fold them into the exported totals once the batch is in.
        let resetting = match &counters {
            Some(c) => resetting_counters(&batch, c, &counter_index),
            None => BTreeSet::new(),
        };
        let before = if resetting.is_empty() {
            None
        } else {
            self.kernel.read_counters(&resetting).map(Some).unwrap_or_else(|e| {
                warn!(error = %e, "cannot read counters before the batch; totals of reset counters are lost");
                None
            })
        };
        // The generation our table is known to be at before this batch: a diff builds on the
        // last one we saw ours; a full replace builds on nothing, so anything committed before it
        // does not matter.
        let mut known_before = self.generation;
        let mut bytes = 0;
        let result = if changes == 0 {
            Ok(None)
        } else {
            let stats = match &batch {
                Batch::FullReplace => {
                    let carried = self.carried_affinities(&desired);
                    known_before = self.kernel.generation().ok();
                    self.kernel.apply_full_replace(&desired, &carried)
                }
                Batch::Diff(diff) => self.kernel.apply(diff),
            };
            stats.map(|stats| {
                metrics.batch_messages.observe(stats.messages as f64);
                metrics.batch_bytes.observe(stats.bytes as f64);
                bytes = stats.bytes;
                Some(stats.generation)
            })
        };
        drop(batch);
        if result.is_ok()
            && let Some(counters) = counters.as_mut()
        {
            if let Some(kernel) = &before {
                counters.fold(kernel, &resetting, &counter_index);
            }
            counters.install(counter_index);
        }
        drop(counters);
        if result.is_ok() {
            self.flush_stale_udp(&gone_udp);
            // Our table is as we left it only if our batch was the one commit since we last knew
            // it; else (someone committed before or after our batch, or we cannot tell) the next
            // resync reads it back and compares. Taking the generation after the batch as ours
            // would hide a change made just before it for good.
            if let Ok(Some(after)) = &result {
                self.generation =
                    known_before.zip(*after).and_then(|(b, a)| (a == next_generation(b)).then_some(a));
                if self.generation.is_none() {
                    debug!(
                        "another nftables transaction around our batch; our table is verified at the next resync"
                    );
                }
            }
            self.applied = Some(desired);
        }
        Ok(Programmed { kind, changes, bytes, result: result.map(|_| ()).map_err(DataplaneError::Batch) })
    }

    /// Deletes the conntrack entries of UDP endpoints that left a node port with the last batch,
    /// so clients that keep their source port are re-balanced instead of black-holed.
    fn flush_stale_udp(&mut self, gone: &BTreeSet<UdpBackend>) {
        if gone.is_empty() {
            return;
        }
        match self.kernel.delete_stale_udp(gone) {
            Ok(n) => debug!(entries = n, backends = gone.len(), "deleted stale UDP conntrack entries"),
            Err(e) => warn!(error = %e, "could not delete stale UDP conntrack entries"),
        }
    }

    /// The client affinities (elements of dynamic sets) the kernel holds for sets that `desired`
    /// has too, to be put back by a full replace, which deletes the table and them with it (every
    /// agent start, repair and retry). A set's name says its endpoint and timeout, so an element
    /// is put back only where it means the same. Read failures lose them (logged), nothing else.
    fn carried_affinities(&mut self, desired: &Ruleset) -> Carried {
        let sets: Vec<(&str, &[KeyType])> = desired
            .sets
            .values()
            .filter(|s| matches!(s.kind, SetKind::Dynamic { .. }))
            .map(|s| (&*s.name, s.key.as_slice()))
            .collect();
        if sets.is_empty() {
            return Carried::new();
        }
        match self.kernel.read_dynamic_elements(&sets) {
            Ok(carried) => {
                let n: usize = carried.values().map(Vec::len).sum();
                if n > 0 {
                    debug!(affinities = n, sets = carried.len(), "putting back client affinities");
                }
                carried
            }
            Err(e) => {
                warn!(error = %e, "cannot read the client affinities; the full replace starts them afresh");
                Carried::new()
            }
        }
    }
}

/// The UDP (node port → endpoint) pairs `old` programs and `new` does not.
fn stale_udp(old: &Ruleset, new: &Ruleset) -> BTreeSet<UdpBackend> {
    let after = plan::udp_backends(new);
    plan::udp_backends(old).into_iter().filter(|b| !after.contains(b)).collect()
}

/// The ruleset generation after one commit at `g` (the kernel skips 0 when it wraps).
fn next_generation(g: u32) -> u32 {
    match g.wrapping_add(1) {
        0 => 1,
        n => n,
    }
}
