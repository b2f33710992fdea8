//! When the sync loop syncs, as state of its own (controller-rs's reconcile / error_policy split:
//! the sync says how it went, this says when the next one is due). A change makes the next sync
//! due at once; a resync period makes one due that also verifies the kernel; a failed sync is
//! retried after a backoff that doubles from [`MIN_BACKOFF`] to [`MAX_BACKOFF`] and resets after
//! a success; a sync that left a change for later ([`Schedule::wake`]) makes one due at that time.
//! What a due sync decides by time is [`Pace`]'s: when every Service is decided again, and how
//! long a change the node cannot program yet may wait. Pure: time is passed in.

use std::time::Duration;

use tokio::time::Instant;

pub const MIN_BACKOFF: Duration = Duration::from_millis(200);
pub const MAX_BACKOFF: Duration = Duration::from_secs(30);

#[derive(Debug, Clone)]
pub struct Schedule {
    /// The input changed (or the last attempt failed) since the last good sync.
    dirty: bool,
    /// A resync period passed: check the kernel against what we programmed.
    verify: bool,
    /// The host-firewall check is due (start, then every resync period).
    firewall: bool,
    /// After a failure: not before this.
    retry_at: Option<Instant>,
    /// A change was left for later: sync at this time.
    wake: Option<Instant>,
    /// The delay after the next failure.
    backoff: Duration,
}

impl Default for Schedule {
    fn default() -> Schedule {
        Schedule::new()
    }
}

impl Schedule {
    /// The first sync is due at once.
    pub fn new() -> Schedule {
        Schedule {
            dirty: true,
            verify: false,
            firewall: true,
            retry_at: None,
            wake: None,
            backoff: MIN_BACKOFF,
        }
    }

    /// The input changed: sync.
    pub fn changed(&mut self) {
        self.dirty = true;
    }

    /// A resync period passed: sync and verify the kernel; check the host firewall.
    pub fn resync(&mut self) {
        self.verify = true;
        self.firewall = true;
    }

    /// `Some(verify)` when a sync is due at `now`: something to do, and no backoff pending.
    pub fn due(&self, now: Instant) -> Option<bool> {
        let waiting = self.retry_at.is_some_and(|t| now < t);
        let woken = self.wake.is_some_and(|t| now >= t);
        ((self.dirty || self.verify || woken) && !waiting).then_some(self.verify)
    }

    /// The sync due at `now` went through.
    pub fn succeeded(&mut self) {
        self.retry_at = None;
        self.wake = None;
        self.backoff = MIN_BACKOFF;
        self.dirty = false;
        self.verify = false;
    }

    /// The sync that just went through left a change for later: another is due at `at`, if
    /// nothing makes one due before.
    pub fn wake(&mut self, at: Instant) {
        self.wake = Some(at);
    }

    /// The sync due at `now` failed: the next attempt (a full replace) waits the backoff, which
    /// doubles for the one after. Returns the wait.
    pub fn failed(&mut self, now: Instant) -> Duration {
        let wait = self.backoff;
        self.retry_at = Some(now + wait);
        self.backoff = (self.backoff * 2).min(MAX_BACKOFF);
        // The retry is a whole sync: it covers a change left for later.
        self.wake = None;
        self.dirty = true;
        self.verify = false;
        wait
    }

    /// When a failed sync is retried.
    pub fn retry_at(&self) -> Option<Instant> {
        self.retry_at
    }

    /// When the loop must wake up for a sync that no event announces: a retry, or a change left
    /// for later.
    pub fn wake_at(&self) -> Option<Instant> {
        self.retry_at.or(self.wake)
    }

    /// Whether the host-firewall check is due, given whether our table is programmed (it reads
    /// our forward counters, so it waits for the first good sync); clears it when it is.
    pub fn take_firewall(&mut self, programmed: bool) -> bool {
        let due = self.firewall && programmed;
        if due {
            self.firewall = false;
        }
        due
    }
}

/// How often a resync decides every Service again when syncs decided only what changed since the
/// last whole decision (`desired::compute`; the whole decision is the oracle of the scoped one):
/// it is linear in the Services, so on every resync it would be the slowest sync of a busy
/// minute. It runs on a resync with no change waiting, so that no change waits for it, unless
/// changes kept coming for [`WHOLE_SYNC_AT_MOST`]. The leader's whole rounds keep the same pace.
pub const WHOLE_SYNC_EVERY: Duration = Duration::from_secs(60);

/// The longest a whole decision waits for a resync with no change waiting.
pub const WHOLE_SYNC_AT_MOST: Duration = Duration::from_secs(300);

/// How long a node leaves a change it cannot program yet (Kubernetes mode: a Service created,
/// its EndpointSlice, before the leader writes its node ports). No rule comes of it, and
/// recomputing everything for it would cost every node time linear in the Services, twice per
/// create (docs/benchmarks.md, "Design decisions, measured"). What waits is this node's report
/// of such a Service (`nodelb status`, the `nodelb_services` gauge, the families its Services
/// need): it follows within this time even while no leader decides.
pub const UNDECIDED_WAIT: Duration = Duration::from_secs(1);

/// What the sync decides, by time: when every Service is decided again, and how long a change
/// that cannot be programmed yet may wait. Pure: time is passed in.
#[derive(Debug, Default)]
pub struct Pace {
    /// When the last sync decided every Service ([`WHOLE_SYNC_EVERY`]).
    pub(super) last_whole: Option<std::time::Instant>,
    /// A sync decided only what changed since then.
    pub(super) scoped_since_whole: bool,
    /// Since when a change the node cannot program yet has been left waiting.
    deferred_since: Option<std::time::Instant>,
}

/// Whether a sync should decide every Service ([`Pace::whole_due`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Whole {
    No,
    /// Due: on this resync if no change waits (the input is what the last sync read).
    IfQuiet,
    /// Overdue: on this resync, with whatever change comes.
    Now,
}

impl Pace {
    /// Whether the sync at `now` (`verify`: a resync) decides every Service: due on a resync
    /// once syncs decided only what changed for [`WHOLE_SYNC_EVERY`], overdue after
    /// [`WHOLE_SYNC_AT_MOST`].
    pub fn whole_due(&self, verify: bool, now: std::time::Instant) -> Whole {
        let since = self.last_whole.map(|t| now.saturating_duration_since(t));
        if !(verify && self.scoped_since_whole && since.is_none_or(|t| t >= WHOLE_SYNC_EVERY)) {
            return Whole::No;
        }
        match since.is_none_or(|t| t >= WHOLE_SYNC_AT_MOST) {
            true => Whole::Now,
            false => Whole::IfQuiet,
        }
    }

    /// The sync started `at` decided every Service (`whole`), or only what changed.
    pub fn decided(&mut self, whole: bool, at: std::time::Instant) {
        if whole {
            self.last_whole = Some(at);
        }
        self.scoped_since_whole = !whole;
    }

    /// Whether a change the node cannot program yet may be left for later at `now`: not on a
    /// resync, and not once one has waited [`UNDECIDED_WAIT`].
    pub fn may_defer(&self, verify: bool, now: std::time::Instant) -> bool {
        !verify && self.deferred_since.is_none_or(|t| now.saturating_duration_since(t) < UNDECIDED_WAIT)
    }

    /// The sync started `at` left such a change for later: when it must be computed at last.
    pub fn deferred(&mut self, at: std::time::Instant) -> std::time::Instant {
        *self.deferred_since.get_or_insert(at) + UNDECIDED_WAIT
    }

    /// Nothing waits any more (computed now, or the change that waited was undone).
    pub fn nothing_deferred(&mut self) {
        self.deferred_since = None;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn first_sync_is_due_at_once_then_only_after_a_change_or_a_resync() {
        let now = Instant::now();
        let mut s = Schedule::new();
        assert_eq!(s.due(now), Some(false));
        s.succeeded();
        assert_eq!(s.due(now), None, "nothing changed");
        s.changed();
        assert_eq!(s.due(now), Some(false));
        s.succeeded();
        s.resync();
        assert_eq!(s.due(now), Some(true), "a resync verifies");
        s.succeeded();
        assert_eq!(s.due(now), None);
    }

    #[test]
    fn failures_back_off_doubling_to_the_cap_and_a_success_resets() {
        let mut now = Instant::now();
        let mut s = Schedule::new();
        let mut waits = vec![];
        for _ in 0..10 {
            assert_eq!(s.due(now), Some(false));
            let wait = s.failed(now);
            assert_eq!(s.due(now + wait - Duration::from_millis(1)), None, "not before the backoff");
            waits.push(wait.as_millis());
            now += wait;
        }
        assert_eq!(waits, [200, 400, 800, 1600, 3200, 6400, 12800, 25600, 30000, 30000]);
        // A change during the backoff waits for it too.
        s.failed(now);
        s.changed();
        assert_eq!(s.due(now), None);
        assert_eq!(s.due(now + MAX_BACKOFF), Some(false));
        s.succeeded();
        assert_eq!(s.retry_at(), None);
        s.changed();
        assert_eq!(s.failed(now).as_millis(), 200, "a success resets the backoff");
    }

    #[test]
    fn a_resync_during_a_backoff_waits_for_it_and_then_verifies() {
        let now = Instant::now();
        let mut s = Schedule::new();
        let wait = s.failed(now);
        s.resync();
        assert_eq!(s.due(now), None);
        assert_eq!(s.due(now + wait), Some(true));
    }

    #[test]
    fn a_change_left_for_later_makes_a_sync_due_at_its_time_unless_one_comes_first() {
        let now = Instant::now();
        let later = now + Duration::from_secs(1);
        let mut s = Schedule::new();
        s.succeeded();
        s.wake(later);
        assert_eq!(s.wake_at(), Some(later));
        assert_eq!(s.due(now), None, "not before its time");
        assert_eq!(s.due(later), Some(false));
        s.succeeded();
        assert_eq!((s.due(later), s.wake_at()), (None, None), "a sync took it");
        s.wake(later);
        s.changed();
        assert_eq!(s.due(now), Some(false), "a change does not wait for it");
        // A failure's retry covers it, at the retry's time however late the wake was.
        let mut s = Schedule::new();
        s.wake(later);
        let wait = s.failed(now);
        assert_eq!(s.due(now), None);
        assert_eq!(s.wake_at(), Some(now + wait));
        assert_eq!(s.due(now + wait), Some(false));
    }

    #[test]
    fn the_firewall_check_waits_for_our_table() {
        let mut s = Schedule::new();
        assert!(!s.take_firewall(false), "nothing programmed yet");
        assert!(s.take_firewall(true));
        assert!(!s.take_firewall(true), "once per resync period");
        s.resync();
        assert!(s.take_firewall(true));
    }

    #[test]
    fn every_service_is_decided_again_on_a_resync_once_syncs_were_scoped_long_enough() {
        let start = std::time::Instant::now();
        let mut p = Pace::default();
        assert_eq!(p.whole_due(true, start), Whole::No, "nothing scoped yet");
        p.decided(true, start);
        p.decided(false, start);
        let after = |d: Duration| start + d;
        assert_eq!(p.whole_due(false, after(WHOLE_SYNC_AT_MOST)), Whole::No, "only on a resync");
        assert_eq!(p.whole_due(true, after(WHOLE_SYNC_EVERY - Duration::from_secs(1))), Whole::No);
        assert_eq!(p.whole_due(true, after(WHOLE_SYNC_EVERY)), Whole::IfQuiet);
        assert_eq!(p.whole_due(true, after(WHOLE_SYNC_AT_MOST)), Whole::Now);
        p.decided(true, after(WHOLE_SYNC_AT_MOST));
        assert_eq!(p.whole_due(true, after(WHOLE_SYNC_AT_MOST * 3)), Whole::No, "nothing scoped since");
    }

    #[test]
    fn a_change_waits_for_the_leader_at_most_undecided_wait_and_never_on_a_resync() {
        let start = std::time::Instant::now();
        let mut p = Pace::default();
        assert!(p.may_defer(false, start));
        assert!(!p.may_defer(true, start), "a resync computes everything");
        assert_eq!(p.deferred(start), start + UNDECIDED_WAIT);
        let later = start + UNDECIDED_WAIT / 2;
        assert_eq!(p.deferred(later), start + UNDECIDED_WAIT, "counted from the first deferral");
        assert!(p.may_defer(false, later));
        assert!(!p.may_defer(false, start + UNDECIDED_WAIT), "waited long enough");
        p.nothing_deferred();
        assert!(p.may_defer(false, start + UNDECIDED_WAIT));
    }
}
