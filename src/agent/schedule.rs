//! When the sync loop syncs, as state of its own (controller-rs's reconcile / error_policy split:
//! the sync says how it went, this says when the next one is due). A change makes the next sync
//! due at once; a resync period makes one due that also verifies the kernel; a failed sync is
//! retried after a backoff that doubles from [`MIN_BACKOFF`] to [`MAX_BACKOFF`] and resets after
//! a success; a sync that left a change for later ([`Schedule::wake`]) makes one due at that time.
//! Pure: time is passed in.

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
}
