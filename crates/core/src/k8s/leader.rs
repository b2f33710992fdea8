//! Leader election on the `coordination.k8s.io/v1` Lease `nodelb-leader` in the agent namespace:
//! the decision is a pure function of the Lease as last read, when we saw it change, and now.
//!
//! Our own small implementation rather than `kube-lease-manager` (which does build with kube 5):
//! the rules fit in one table-tested function, every write is a replace carrying the
//! resourceVersion we read (a 409 means someone else wrote first: we re-read, never overwrite),
//! and the agent needs the leader state synchronously for the allocator and the metrics.
//!
//! Rules (client-go's, which skew-proofs expiry by using *our* clock only):
//! - no Lease → create it, holding it;
//! - held by us → renew when `lease/3` passed since our last renewal;
//! - held by someone else (or nobody) → take it over only when it has not changed for a whole
//!   `leaseDurationSeconds` as observed on our own clock (or names no holder);
//! - we stop acting as leader when a renewal has not succeeded within the renew deadline
//!   (`2/3` of the duration), before anyone else may take over (a full duration).

use std::time::{Duration, Instant};

/// The Lease as read: who holds it, for how long, how often it changed hands.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LeaseRecord {
    pub holder: Option<String>,
    pub duration: Duration,
    pub transitions: i32,
    pub resource_version: Option<String>,
}

/// What to do now.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Decision {
    /// No Lease: create one naming us.
    Create,
    /// Take the expired (or released) Lease over: replace with our name, transitions + 1.
    Acquire,
    /// We hold it and renewal is due.
    Renew,
    /// Nothing to do until then.
    Wait(Instant),
}

/// Leader-election state kept between rounds.
#[derive(Debug, Clone)]
pub struct Observed {
    pub record: Option<LeaseRecord>,
    /// When `record` (holder or resourceVersion) last changed, on our clock.
    pub since: Instant,
}

/// Records a fresh read, keeping the observation time when nothing changed.
pub fn observe(prev: Option<&Observed>, record: Option<LeaseRecord>, now: Instant) -> Observed {
    match prev {
        Some(p) if p.record == record => p.clone(),
        _ => Observed { record, since: now },
    }
}

/// The decision for `me`; `last_renew` is when our last create/acquire/renew succeeded.
pub fn decide(me: &str, observed: &Observed, last_renew: Option<Instant>, now: Instant) -> Decision {
    let Some(rec) = &observed.record else { return Decision::Create };
    let held_by_me = rec.holder.as_deref() == Some(me);
    if held_by_me {
        let due = last_renew.map_or(now, |t| t + rec.duration / 3);
        return if now >= due { Decision::Renew } else { Decision::Wait(due) };
    }
    let free = rec.holder.as_deref().is_none_or(str::is_empty);
    let expires = observed.since + rec.duration;
    if free || now >= expires { Decision::Acquire } else { Decision::Wait(expires) }
}

/// Are we the leader at `now`: we hold the Lease and renewed it within the renew deadline.
pub fn is_leader(me: &str, observed: &Observed, last_renew: Option<Instant>, now: Instant) -> bool {
    let Some(rec) = &observed.record else { return false };
    rec.holder.as_deref() == Some(me)
        && last_renew.is_some_and(|t| now.saturating_duration_since(t) < rec.duration * 2 / 3)
}

#[cfg(test)]
mod tests {
    use super::*;

    const D: Duration = Duration::from_secs(15);

    fn rec(holder: Option<&str>, rv: &str) -> Option<LeaseRecord> {
        Some(LeaseRecord {
            holder: holder.map(String::from),
            duration: D,
            transitions: 0,
            resource_version: Some(rv.into()),
        })
    }

    #[test]
    fn decisions() {
        let t0 = Instant::now();
        let s = |n: u64| t0 + Duration::from_secs(n);
        // (name, record, observed since, last renew, now, want)
        type Case = (&'static str, Option<LeaseRecord>, Instant, Option<Instant>, Instant, Decision);
        let cases: Vec<Case> = vec![
            ("absent: create", None, t0, None, s(1), Decision::Create),
            (
                "ours, fresh: wait for lease/3",
                rec(Some("me"), "1"),
                t0,
                Some(s(0)),
                s(1),
                Decision::Wait(s(5)),
            ),
            ("ours, lease/3 passed: renew", rec(Some("me"), "1"), t0, Some(s(0)), s(5), Decision::Renew),
            (
                "ours after a restart (never renewed here): renew",
                rec(Some("me"), "1"),
                t0,
                None,
                s(0),
                Decision::Renew,
            ),
            (
                "other, unchanged for less than the duration: wait",
                rec(Some("b"), "1"),
                s(0),
                None,
                s(10),
                Decision::Wait(s(15)),
            ),
            (
                "other, unchanged for the duration: acquire",
                rec(Some("b"), "1"),
                s(0),
                None,
                s(15),
                Decision::Acquire,
            ),
            ("released (empty holder): acquire", rec(Some(""), "1"), s(0), None, s(1), Decision::Acquire),
            ("no holder: acquire", rec(None, "1"), s(0), None, s(1), Decision::Acquire),
        ];
        for (name, record, since, last, now, want) in cases {
            let obs = Observed { record, since };
            assert_eq!(decide("me", &obs, last, now), want, "{name}");
        }
    }

    #[test]
    fn observation_time_follows_changes_only() {
        let t0 = Instant::now();
        let later = t0 + Duration::from_secs(7);
        let o1 = observe(None, rec(Some("b"), "1"), t0);
        let o2 = observe(Some(&o1), rec(Some("b"), "1"), later);
        assert_eq!(o2.since, t0, "unchanged record keeps its time");
        let o3 = observe(Some(&o2), rec(Some("b"), "2"), later);
        assert_eq!(o3.since, later, "a renewal by the holder restarts the clock");
        // A holder that keeps renewing is never taken over.
        assert!(matches!(decide("me", &o3, None, later + Duration::from_secs(14)), Decision::Wait(_)));
    }

    #[test]
    fn leadership_ends_before_anyone_can_take_over() {
        let t0 = Instant::now();
        let obs = Observed { record: rec(Some("me"), "1"), since: t0 };
        let s = |n: u64| t0 + Duration::from_secs(n);
        assert!(is_leader("me", &obs, Some(t0), s(9)));
        assert!(!is_leader("me", &obs, Some(t0), s(10)), "renew deadline is 2/3 of the duration");
        assert!(!is_leader("me", &obs, None, s(0)), "not before our own write succeeded");
        assert!(!is_leader("other", &obs, Some(t0), s(1)));
        let none = Observed { record: None, since: t0 };
        assert!(!is_leader("me", &none, Some(t0), s(1)));
    }
}
