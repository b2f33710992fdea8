//! "Once per change" for Events: the state a round describes is compared with what was last
//! recorded for the same object and reason. Pure.

use std::collections::BTreeMap;

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
    /// message before. States that no longer hold are forgotten, so a recurrence is recorded again.
    pub fn fresh<'a, T>(
        &mut self,
        current: &'a [T],
        key: impl Fn(&T) -> (K, &'static str, String),
    ) -> Vec<&'a T> {
        let mut next = BTreeMap::new();
        let mut out = Vec::new();
        for item in current {
            let (k, reason, msg) = key(item);
            if self.last.get(&(k.clone(), reason)) != Some(&msg) {
                out.push(item);
            }
            next.insert((k, reason), msg);
        }
        self.last = next;
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn once_per_change() {
        let mut d: Deduper<&str> = Deduper::default();
        let k = |e: &(&'static str, &'static str, &'static str)| (e.0, e.1, e.2.to_string());
        let round1 = [("web", "Allocated", "80/TCP=20001"), ("dns", "Conflict", "x")];
        assert_eq!(d.fresh(&round1, k).len(), 2);
        assert_eq!(d.fresh(&round1, k).len(), 0, "same state: nothing");
        let round2 = [("web", "Allocated", "80/TCP=20002"), ("dns", "Conflict", "x")];
        assert_eq!(d.fresh(&round2, k), vec![&round2[0]], "changed message only");
        let round3 = [("web", "Allocated", "80/TCP=20002")];
        assert!(d.fresh(&round3, k).is_empty());
        assert_eq!(d.fresh(&round2, k), vec![&round2[1]], "a recurrence is recorded again");
    }
}
