//! "Once per change" for Events: the state a round describes is compared with what was last
//! *recorded* for the same object and reason. An Event counts as recorded only once the API
//! accepted it ([`Deduper::sent`]), so one that could not be sent (API error, object not in the
//! cache yet) stays pending and is tried again at the next round. Pure.

use std::collections::{BTreeMap, BTreeSet};

/// Longest Event note the API server accepts (`events.k8s.io/v1`: 1 KiB, in bytes).
pub const MAX_NOTE_BYTES: usize = 1024;

/// `message` as an Event note: cut to [`MAX_NOTE_BYTES`] at a character boundary. A longer note
/// is refused by the API server, and the Event would be retried, and refused, every round.
pub fn event_note(message: &str) -> String {
    if message.len() <= MAX_NOTE_BYTES {
        return message.to_string();
    }
    format!("{}…", crate::model::cut(message, MAX_NOTE_BYTES - '…'.len_utf8()))
}

/// Remembers the last message recorded per (object, reason).
#[derive(Debug)]
pub struct Deduper<K: Ord + Clone> {
    last: BTreeMap<(K, &'static str), String>,
}

impl<K: Ord + Clone> Default for Deduper<K> {
    fn default() -> Self {
        Deduper { last: BTreeMap::new() }
    }
}

impl<K: Ord + Clone> Deduper<K> {
    /// Of the `current` (object, reason, message) triples, those not recorded with the same
    /// message. States that no longer hold are forgotten, so a recurrence is recorded again.
    /// Nothing is marked recorded here: call [`Deduper::sent`] once the API accepted an Event.
    pub fn pending<'a, T>(
        &mut self,
        current: &'a [T],
        key: impl Fn(&T) -> (K, &'static str, String),
    ) -> Vec<&'a T> {
        let keys: Vec<(K, &'static str, String)> = current.iter().map(&key).collect();
        let live: BTreeSet<(K, &'static str)> = keys.iter().map(|(k, r, _)| (k.clone(), *r)).collect();
        self.last.retain(|k, _| live.contains(k));
        current
            .iter()
            .zip(keys)
            .filter(|(_, (k, r, msg))| self.last.get(&(k.clone(), *r)) != Some(msg))
            .map(|(item, _)| item)
            .collect()
    }

    /// The Event for this (object, reason, message) was recorded.
    pub fn sent(&mut self, (k, reason, msg): (K, &'static str, String)) {
        self.last.insert((k, reason), msg);
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

    /// A round where every pending Event is sent successfully.
    fn round<'a>(d: &mut Deduper<&'static str>, current: &'a [Ev]) -> Vec<&'a Ev> {
        let out = d.pending(current, k);
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

    #[test]
    fn not_recorded_until_sent() {
        let mut d: Deduper<&str> = Deduper::default();
        let off = [("node-1", "ForwardingDisabled", "ipv4 off")];
        // First attempt fails (API error, Node not in the cache yet): still pending next round.
        assert_eq!(d.pending(&off, k).len(), 1);
        assert_eq!(d.pending(&off, k).len(), 1, "retried until sent");
        d.sent(k(&off[0]));
        assert!(d.pending(&off, k).is_empty(), "sent once, not again");
        // A changed message that cannot be sent stays pending; the old one is not resent.
        let changed = [("node-1", "ForwardingDisabled", "ipv4 off: sysctl unreadable")];
        assert_eq!(d.pending(&changed, k), vec![&changed[0]]);
        assert_eq!(d.pending(&changed, k), vec![&changed[0]]);
        // The state ends before it could be sent: forgotten, nothing to send.
        assert!(d.pending(&[], k).is_empty());
        assert_eq!(d.pending(&off, k).len(), 1, "a recurrence after it ended is new");
    }
}
