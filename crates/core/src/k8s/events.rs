//! "Once per change" for Events: the state a round describes is compared with what was last
//! *recorded* for the same object and reason. An Event counts as recorded only once the API
//! accepted it ([`Deduper::sent`]), so one that could not be sent (API error, object not in the
//! cache yet) stays pending and is tried again at the next round. Pure.

use foldhash::{HashMap, HashMapExt};
use std::collections::BTreeMap;
use std::hash::Hash;

use crate::domain::Scope;

/// Longest Event note the API server accepts (`events.k8s.io/v1`: 1 KiB, in bytes).
pub const MAX_NOTE_BYTES: usize = 1024;

/// `message` as an Event note: cut to [`MAX_NOTE_BYTES`] at a character boundary. A longer note
/// is refused by the API server, and the Event would be retried, and refused, every round.
pub fn event_note(message: &str) -> String {
    if message.len() <= MAX_NOTE_BYTES {
        return message.to_string();
    }
    format!("{}…", crate::domain::cut(message, MAX_NOTE_BYTES - '…'.len_utf8()))
}

/// Remembers the last message recorded per (object, reason).
#[derive(Debug)]
pub struct Deduper<K: Eq + Hash> {
    /// Per object, each reason's last recorded message and the last [`Deduper::pending`] call
    /// that computed it (a few reasons per object: a list, not a map).
    last: HashMap<K, Vec<Recorded>>,
    /// Counts the calls to [`Deduper::pending`].
    pass: u64,
}

#[derive(Debug)]
struct Recorded {
    reason: &'static str,
    message: String,
    seen: u64,
}

impl<K: Eq + Hash> Default for Deduper<K> {
    fn default() -> Self {
        Deduper { last: HashMap::new(), pass: 0 }
    }
}

impl<K: Eq + Hash> Deduper<K> {
    /// Of the `current` (object, reason, message) triples, those not recorded with the same
    /// message. States of the objects in `scope` that no longer hold are forgotten, so a
    /// recurrence is recorded again; a scoped round computed the states of its objects alone, so
    /// every other object's records stay as they are. Nothing is marked recorded here: call
    /// [`Deduper::sent`] once the API accepted an Event. Nothing is copied, and each triple costs
    /// one lookup (what is recorded is marked as seen, the rest swept after): a leader's round
    /// holds one state Event per Service.
    pub fn pending<'a, T>(
        &mut self,
        current: &'a [T],
        key: impl Fn(&'a T) -> (&'a K, &'static str, &'a str),
        scope: Scope<'_, K>,
    ) -> Vec<&'a T>
    where
        K: 'a,
    {
        self.pass += 1;
        let pass = self.pass;
        let mut out = Vec::new();
        for t in current {
            let (k, reason, message) = key(t);
            let recorded = self.last.get_mut(k).and_then(|rs| rs.iter_mut().find(|r| r.reason == reason));
            match recorded {
                Some(r) => {
                    r.seen = pass;
                    if r.message != message {
                        out.push(t);
                    }
                }
                None => out.push(t),
            }
        }
        // Keeps the records computed again; false when none is left.
        let keep_seen = |reasons: &mut Vec<Recorded>| {
            reasons.retain(|r| r.seen == pass);
            !reasons.is_empty()
        };
        match scope {
            Scope::All => self.last.retain(|_, reasons| keep_seen(reasons)),
            Scope::Keys(keys) => {
                for k in keys {
                    if self.last.get_mut(k).is_some_and(|reasons| !keep_seen(reasons)) {
                        self.last.remove(k);
                    }
                }
            }
        }
        out
    }

    /// The Event for this (object, reason, message) was recorded.
    pub fn sent(&mut self, (k, reason, message): (K, &'static str, String)) {
        let seen = self.pass;
        let reasons = self.last.entry(k).or_default();
        match reasons.iter_mut().find(|r| r.reason == reason) {
            Some(r) => *r = Recorded { reason, message, seen },
            None => reasons.push(Recorded { reason, message, seen }),
        }
    }
}

/// One-time Events: a transition (a node port moved) that the next round's state no longer shows
/// once the write it describes has happened. The [`Deduper`] forgets what a round no longer
/// computes, so such an Event whose write to the API failed would be lost; here it stays until
/// sent. Kept once per (object, reason, message), so a transition still computed while it waits
/// is not queued twice.
#[derive(Debug)]
pub struct Outbox<K: Ord + Clone, T> {
    items: BTreeMap<(K, &'static str, String), T>,
}

impl<K: Ord + Clone, T> Default for Outbox<K, T> {
    fn default() -> Self {
        Outbox { items: BTreeMap::new() }
    }
}

impl<K: Ord + Clone, T> Outbox<K, T> {
    /// Queues `item` under `key` (object, reason, message) unless it waits already.
    pub fn add(&mut self, key: (K, &'static str, String), item: T) {
        self.items.entry(key).or_insert(item);
    }

    /// What waits, oldest key first.
    pub fn waiting(&self) -> impl Iterator<Item = (&(K, &'static str, String), &T)> {
        self.items.iter()
    }

    /// Sent: no longer waits.
    pub fn sent(&mut self, key: &(K, &'static str, String)) {
        self.items.remove(key);
    }

    /// Drops what waits for objects `keep` refuses (gone: nothing to record it on).
    pub fn retain_objects(&mut self, keep: impl Fn(&K) -> bool) {
        self.items.retain(|(k, _, _), _| keep(k));
    }

    pub fn len(&self) -> usize {
        self.items.len()
    }

    pub fn is_empty(&self) -> bool {
        self.items.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The API server counts a note's bytes: 1,000 three-byte characters are 3,000 bytes, and an
    /// Event with that note is refused (and would be retried, and refused, every round).
    #[test]
    fn event_notes_fit_the_api_servers_limit_in_bytes() {
        for message in ["short".to_string(), "€".repeat(1000), "x".repeat(5000), "a".repeat(1023) + "€"] {
            let note = event_note(&message);
            assert!(note.len() <= MAX_NOTE_BYTES, "{} bytes", note.len());
            assert!(message.starts_with(note.trim_end_matches('…')));
        }
        assert_eq!(event_note("short"), "short");
        assert_eq!(event_note(&"x".repeat(1024)), "x".repeat(1024));
    }

    type Ev = (&'static str, &'static str, &'static str);

    fn k(e: &Ev) -> (&'static str, &'static str, String) {
        (e.0, e.1, e.2.to_string())
    }

    fn b(e: &Ev) -> (&&'static str, &'static str, &str) {
        (&e.0, e.1, e.2)
    }

    /// A round where every pending Event is sent successfully.
    fn round<'a>(d: &mut Deduper<&'static str>, current: &'a [Ev]) -> Vec<&'a Ev> {
        let out = d.pending(current, b, Scope::All);
        for e in &out {
            d.sent(k(e));
        }
        out
    }

    #[test]
    fn once_per_change() {
        let mut d: Deduper<&str> = Deduper::default();
        let round1 = [("web", "Allocated", "80/TCP=20001"), ("dns", "Conflict", "x")];
        assert_eq!(round(&mut d, &round1).len(), 2);
        assert_eq!(round(&mut d, &round1).len(), 0, "same state: nothing");
        let round2 = [("web", "Allocated", "80/TCP=20002"), ("dns", "Conflict", "x")];
        assert_eq!(round(&mut d, &round2), vec![&round2[0]], "changed message only");
        let round3 = [("web", "Allocated", "80/TCP=20002")];
        assert!(round(&mut d, &round3).is_empty());
        assert_eq!(round(&mut d, &round2), vec![&round2[1]], "a recurrence is recorded again");
    }

    /// A transition Event whose send failed is retried although the next round no longer
    /// computes it, is not queued twice while it is computed again, and goes with its object.
    #[test]
    fn one_time_events_wait_until_sent() {
        let mut d: Deduper<&str> = Deduper::default();
        let mut out: Outbox<&str, Ev> = Outbox::default();
        let moved = ("web", "NodePortReallocated", "80/TCP: 20001 → 20101");
        // Round 1: computed, queued, the send fails.
        for e in d.pending(&[moved], b, Scope::All) {
            out.add(k(e), *e);
        }
        assert_eq!(out.len(), 1);
        // Round 2: still computed (the annotation write failed too): not queued twice.
        for e in d.pending(&[moved], b, Scope::All) {
            out.add(k(e), *e);
        }
        assert_eq!(out.len(), 1, "once");
        // Round 3: the annotation is written, the state no longer shows it: it still waits.
        assert!(d.pending(&[], b, Scope::All).is_empty());
        let waiting: Vec<Ev> = out.waiting().map(|(_, e)| *e).collect();
        assert_eq!(waiting, [moved]);
        // Sent: gone, and the deduper knows it (not queued again if computed once more).
        out.sent(&k(&moved));
        d.sent(k(&moved));
        assert!(out.is_empty());
        assert!(d.pending(&[moved], b, Scope::All).is_empty());
        // A Service deleted while its Event waits: nothing to record it on.
        out.add(k(&moved), moved);
        out.retain_objects(|o| *o != "web");
        assert!(out.is_empty());
    }

    #[test]
    fn not_recorded_until_sent() {
        let mut d: Deduper<&str> = Deduper::default();
        let off = [("node-1", "ForwardingDisabled", "ipv4 off")];
        // First attempt fails (API error, Node not in the cache yet): still pending next round.
        assert_eq!(d.pending(&off, b, Scope::All).len(), 1);
        assert_eq!(d.pending(&off, b, Scope::All).len(), 1, "retried until sent");
        d.sent(k(&off[0]));
        assert!(d.pending(&off, b, Scope::All).is_empty(), "sent once, not again");
        // A changed message that cannot be sent stays pending; the old one is not resent.
        let changed = [("node-1", "ForwardingDisabled", "ipv4 off: sysctl unreadable")];
        assert_eq!(d.pending(&changed, b, Scope::All), vec![&changed[0]]);
        assert_eq!(d.pending(&changed, b, Scope::All), vec![&changed[0]]);
        // The state ends before it could be sent: forgotten, nothing to send.
        assert!(d.pending(&[], b, Scope::All).is_empty());
        assert_eq!(d.pending(&off, b, Scope::All).len(), 1, "a recurrence after it ended is new");
    }
}
