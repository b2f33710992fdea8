//! Coalescing bursts of change notifications, for both sources of desired state: the manifests
//! directory's inotify events and the Kubernetes reflectors' changes. Events less than the quiet
//! time apart (an editor's temp file and rename: 10 ms; watch events in Kubernetes mode: 2 ms,
//! so a Service's EndpointSlice or the leader's status patch, an API round trip later, are a
//! burst of their own) become one notification, at most `max` after the first so that a steady
//! stream of changes cannot starve the sync.

use std::time::Duration;

use tokio::time::Instant;

/// A source of change events: waits for the next ones and records them in a [`Burst`].
pub trait Events {
    type Error;

    /// Waits until something happens, and notes what changed in `burst` ([`Burst::note`])
    /// before returning, with no await in between (a call cancelled after reading events must
    /// not lose them). May return without noting anything (a wake-up with no change).
    async fn wait(&mut self, burst: &mut Burst) -> Result<(), Self::Error>;
}

/// The burst of changes not yet reported: the time of its first and of its last event. Kept by
/// the source, not in [`Burst::settle`]'s locals, so that `settle` is cancel-safe: the agent
/// awaits it inside `select!`, and a cancelled call must not lose a burst it already saw.
#[derive(Debug, Clone)]
pub struct Burst {
    quiet: Duration,
    max: Duration,
    pending: Option<(Instant, Instant)>,
}

impl Burst {
    /// Reports `quiet` after the last event of a burst, at most `max` after its first.
    pub fn new(quiet: Duration, max: Duration) -> Burst {
        Burst { quiet, max, pending: None }
    }

    /// Something changed now.
    pub fn note(&mut self) {
        let now = Instant::now();
        self.pending = Some(match self.pending {
            Some((first, _)) => (first, now),
            None => (now, now),
        });
    }

    /// When the pending burst is reported, if there is one.
    fn deadline(&self) -> Option<Instant> {
        self.pending.map(|(first, last)| (last + self.quiet).min(first + self.max))
    }

    /// Waits for a change of `events`, then for its burst to settle. Cancel-safe: a call dropped
    /// part-way leaves the burst pending, and the next call finishes it. An error is the
    /// source's own (then the burst stays pending).
    pub async fn settle<E: Events>(&mut self, events: &mut E) -> Result<(), E::Error> {
        while self.pending.is_none() {
            events.wait(self).await?;
        }
        while let Some(deadline) = self.deadline() {
            match tokio::time::timeout_at(deadline, events.wait(self)).await {
                Err(_elapsed) => break,
                Ok(result) => result?,
            }
        }
        if let Some((first, last)) = self.pending.take() {
            tracing::debug!(
                burst_ms = (last - first).as_secs_f64() * 1e3,
                waited_ms = first.elapsed().as_secs_f64() * 1e3,
                "changes settled"
            );
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Events at the given offsets from the start (then none).
    struct Script {
        start: tokio::time::Instant,
        at: std::collections::VecDeque<Duration>,
    }

    impl Events for Script {
        type Error = ();

        async fn wait(&mut self, burst: &mut Burst) -> Result<(), ()> {
            match self.at.pop_front() {
                Some(at) => {
                    tokio::time::sleep_until(self.start + at).await;
                    burst.note();
                }
                None => std::future::pending().await,
            }
            Ok(())
        }
    }

    /// How long `settle` takes for events at these offsets (ms), with quiet 10 ms and max 50 ms.
    async fn settled_after(at: &[u64]) -> u64 {
        let start = tokio::time::Instant::now();
        let mut script = Script { start, at: at.iter().map(|ms| Duration::from_millis(*ms)).collect() };
        let mut burst = Burst::new(Duration::from_millis(10), Duration::from_millis(50));
        burst.settle(&mut script).await.unwrap();
        (tokio::time::Instant::now() - start).as_millis() as u64
    }

    #[tokio::test(start_paused = true)]
    async fn a_burst_is_reported_quiet_after_its_last_event_and_at_most_max_after_its_first() {
        let cases: [(&str, &[u64], std::ops::RangeInclusive<u64>); 4] = [
            ("one event", &[5], 15..=16),
            ("a burst with short gaps", &[5, 8, 14, 20], 30..=31),
            ("a gap longer than the quiet time ends it", &[5, 30], 15..=16),
            (
                "a stream without a quiet time is cut at max",
                &[5, 10, 15, 20, 25, 30, 35, 40, 45, 50, 55, 60],
                55..=56,
            ),
        ];
        for (name, at, want) in cases {
            let got = settled_after(at).await;
            assert!(want.contains(&got), "{name}: reported after {got} ms, want {want:?}");
        }
    }
}
