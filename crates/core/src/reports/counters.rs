//! Per-Service-port traffic counters, from the kernel's named counter objects to the exported
//! totals. A named counter keeps counting while the rules that use it are replaced; it restarts
//! only when the table is replaced (start, repair, after a failure) and is gone while its Service
//! port is not programmed (no node port, forwarding off). So the values of counters a batch
//! deletes are folded into a base that is added to what the kernel reports: an exported `_total`
//! never goes down, and its series goes away only with its Service port. Pure: the sync loop
//! reads the kernel and holds the state's lock across a batch (see `metrics`).

use std::collections::{BTreeMap, BTreeSet};

use crate::domain::{PortId, ServiceKey};
use crate::ruleset::ir::Name;

/// Counter values of a rule's `counter` expression or of a named counter.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Counter {
    pub packets: u64,
    pub bytes: u64,
}

/// Named counters of our table by name, as the kernel reports them.
pub type CounterValues = BTreeMap<String, Counter>;

/// What a counter rule counts.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum CounterKind {
    /// New connections DNATed (counted in the service chain).
    Connections,
    /// Forwarded packets and bytes, both directions (counted in filter-forward-last).
    Traffic,
    /// Packets of new connections dropped by the source-range check (firewall chain).
    Refused,
}

/// One per-Service-port series (both address families summed).
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct SeriesKey {
    pub service: ServiceKey,
    pub port: PortId,
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Totals {
    pub packets: u64,
    pub bytes: u64,
}

pub type Series = (SeriesKey, CounterKind);

/// Which kernel counter feeds which series, and which Service ports exist; computed with the
/// desired state (`desired::compute`). Counters are named opaquely: the sync loop only
/// matches these names against what the kernel reports and what a batch resets.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct CounterIndex {
    /// Named counter in the kernel → the series it feeds.
    pub counters: BTreeMap<Name, Series>,
    /// Every Service port of the valid Services. A series of one of these stays exported with its
    /// total while no counter feeds it; a series goes when its Service port goes.
    pub ports: BTreeSet<SeriesKey>,
}

impl CounterIndex {
    /// The same index with its maps' B-tree nodes full (see [`crate::ruleset::ir::Ruleset::packed`]).
    pub fn packed(mut self) -> CounterIndex {
        crate::ruleset::ir::pack(&mut self.counters);
        crate::ruleset::ir::pack(&mut self.ports);
        self
    }
}

/// The counter index of the next ruleset: whole, or as a patch of the installed one (the
/// entries of the Service ports a sync replans: `removed` as they were, `added` as they are; a
/// port still there is in both).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum IndexUpdate {
    Full(CounterIndex),
    Patch { removed: CounterIndex, added: CounterIndex },
}

impl IndexUpdate {
    /// The entries it brings: every counter of a whole index, the replanned ones of a patch.
    fn new_counters(&self) -> &BTreeMap<Name, Series> {
        match self {
            IndexUpdate::Full(i) => &i.counters,
            IndexUpdate::Patch { added, .. } => &added.counters,
        }
    }

    /// Brings `index` (the installed one) to the next one.
    pub fn apply(self, index: &mut CounterIndex) {
        match self {
            IndexUpdate::Full(next) => *index = next,
            IndexUpdate::Patch { removed, added } => {
                for name in removed.counters.keys() {
                    index.counters.remove(name);
                }
                index.counters.extend(added.counters);
                for port in &removed.ports {
                    index.ports.remove(port);
                }
                index.ports.extend(added.ports);
            }
        }
    }
}

/// The index of the ruleset in the kernel, and every exported series with the folded-in values
/// of counters that the kernel no longer holds.
#[derive(Debug, Default)]
pub struct CounterState {
    /// The installed index.
    index: CounterIndex,
    /// Exactly the exported series.
    base: BTreeMap<Series, Totals>,
}

impl CounterState {
    /// Counters (of the installed index or of `next`) that feed a series still exported once
    /// `next` is installed: their values must be read before a batch resets them. A Service port
    /// that goes away takes its series with it, so its counters need no read (reading the table
    /// would add to a removal's reaction time).
    pub fn kept_counters(&self, next: &IndexUpdate) -> BTreeSet<Name> {
        let new = next.new_counters().keys();
        self.index.counters.keys().chain(new).filter(|n| self.is_kept(n, next)).cloned().collect()
    }

    /// Whether counter `name` is one of [`CounterState::kept_counters`], without listing them.
    pub fn is_kept(&self, name: &str, next: &IndexUpdate) -> bool {
        [self.index.counters.get(name), next.new_counters().get(name)]
            .into_iter()
            .flatten()
            .any(|(key, _)| self.has_port(key, next))
    }

    /// Whether Service port `key` is there once `next` is installed.
    fn has_port(&self, key: &SeriesKey, next: &IndexUpdate) -> bool {
        match next {
            IndexUpdate::Full(i) => i.ports.contains(key),
            IndexUpdate::Patch { removed, added } => {
                added.ports.contains(key) || (self.index.ports.contains(key) && !removed.ports.contains(key))
            }
        }
    }

    /// Adds the values `table` holds for the counters in `resetting` to the base of their series
    /// (a batch resets them).
    pub fn fold(&mut self, kernel: &CounterValues, resetting: &BTreeSet<Name>, next: &IndexUpdate) {
        for (name, &c) in kernel {
            if !resetting.contains(name.as_str()) {
                continue;
            }
            if let Some(series) =
                next.new_counters().get(name.as_str()).or_else(|| self.index.counters.get(name.as_str()))
            {
                let t = self.base.entry(series.clone()).or_default();
                t.packets += c.packets;
                t.bytes += c.bytes;
            }
        }
    }

    /// Installs the index of the ruleset just applied: series of Service ports that are gone are
    /// forgotten, the others keep their totals, new counters start new series. A patch touches
    /// only its own Service ports.
    pub fn install(&mut self, next: IndexUpdate) {
        match &next {
            IndexUpdate::Full(i) => self.base.retain(|(key, _), _| i.ports.contains(key)),
            IndexUpdate::Patch { removed, added } => {
                for gone in removed.ports.iter().filter(|p| !added.ports.contains(*p)) {
                    for kind in [CounterKind::Connections, CounterKind::Traffic, CounterKind::Refused] {
                        self.base.remove(&(gone.clone(), kind));
                    }
                }
            }
        }
        for series in next.new_counters().values() {
            // Looked up first: a clone of every series key per sync would be a good part of a
            // one-Service sync.
            if !self.base.contains_key(series) {
                self.base.insert(series.clone(), Totals::default());
            }
        }
        if matches!(next, IndexUpdate::Full(_)) {
            crate::ruleset::ir::pack(&mut self.base);
        }
        next.apply(&mut self.index);
    }

    /// The named counters the installed index reads.
    pub fn counter_names(&self) -> impl Iterator<Item = &Name> {
        self.index.counters.keys()
    }

    /// Base + kernel values of every exported series.
    pub fn totals(&self, kernel: &CounterValues) -> BTreeMap<Series, Totals> {
        let mut out = self.base.clone();
        for (name, &Counter { packets, bytes }) in kernel {
            if let Some(series) = self.index.counters.get(name.as_str())
                && let Some(t) = out.get_mut(series)
            {
                t.packets += packets;
                t.bytes += bytes;
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::domain::Protocol;

    fn key(name: &str) -> SeriesKey {
        SeriesKey {
            service: ServiceKey { namespace: "default".into(), name: name.into() },
            port: PortId { port: 80, protocol: Protocol::Tcp },
        }
    }

    /// The kernel's named counters `(name, packets, bytes)`.
    fn kernel(counters: &[(&str, u64, u64)]) -> CounterValues {
        counters
            .iter()
            .map(|&(name, packets, bytes)| (name.to_string(), Counter { packets, bytes }))
            .collect()
    }

    fn index(counters: &[(&str, &str, CounterKind)], ports: &[&str]) -> CounterIndex {
        CounterIndex {
            counters: counters.iter().map(|&(c, s, k)| (c.into(), (key(s), k))).collect(),
            ports: ports.iter().map(|p| key(p)).collect(),
        }
    }

    /// One batch as the sync loop does it: read what it resets, fold, install; the same batch
    /// with the index as a patch (what changed since the last one, as the incremental planner
    /// gives it) on `twin`, which must end up exporting the same.
    fn sync(st: &mut CounterState, before: &CounterValues, resetting: &[&str], next: CounterIndex) {
        let mut twin = CounterState { index: st.index.clone(), base: st.base.clone() };
        let patch = patch_between(&st.index, &next);
        let kept = one_batch(st, before, resetting, IndexUpdate::Full(next));
        let twin_kept = one_batch(&mut twin, before, resetting, patch);
        assert_eq!(twin_kept, kept, "kept counters: full index and patch disagree");
        assert_eq!((&twin.index, &twin.base), (&st.index, &st.base), "full index and patch disagree");
    }

    /// Returns the counters it kept.
    fn one_batch(
        st: &mut CounterState,
        before: &CounterValues,
        resetting: &[&str],
        next: IndexUpdate,
    ) -> BTreeSet<Name> {
        let kept = st.kept_counters(&next);
        for name in resetting.iter().chain(["svc-a", "fwd-a", "fw-b", "gone"].iter()) {
            assert_eq!(st.is_kept(name, &next), kept.contains(*name), "{name}");
        }
        let resetting: BTreeSet<Name> =
            resetting.iter().map(|&s| Name::from(s)).filter(|s| st.is_kept(s, &next)).collect();
        st.fold(before, &resetting, &next);
        st.install(next);
        kept
    }

    /// The patch from `old` to `new` that replans every Service port whose entries differ.
    fn patch_between(old: &CounterIndex, new: &CounterIndex) -> IndexUpdate {
        let entries = |i: &CounterIndex, port: &SeriesKey| -> Vec<(Name, Series)> {
            i.counters.iter().filter(|(_, (k, _))| k == port).map(|(n, s)| (n.clone(), s.clone())).collect()
        };
        let (mut removed, mut added) = (CounterIndex::default(), CounterIndex::default());
        for port in old.ports.union(&new.ports) {
            let (was, is) = (entries(old, port), entries(new, port));
            if was == is && old.ports.contains(port) == new.ports.contains(port) {
                continue;
            }
            if old.ports.contains(port) {
                removed.ports.insert(port.clone());
                removed.counters.extend(was);
            }
            if new.ports.contains(port) {
                added.ports.insert(port.clone());
                added.counters.extend(is);
            }
        }
        IndexUpdate::Patch { removed, added }
    }

    fn exported(st: &CounterState, now: &CounterValues) -> Vec<(String, CounterKind, u64, u64)> {
        st.totals(now)
            .into_iter()
            .map(|((k, kind), t)| (k.service.name.to_string(), kind, t.packets, t.bytes))
            .collect()
    }

    use CounterKind::{Connections as C, Refused as R, Traffic as T};

    #[test]
    fn series_keep_their_totals_while_chains_come_and_go_and_go_with_the_service() {
        let mut st = CounterState::default();
        let full = || index(&[("svc-a", "a", C), ("fwd-a", "a", T), ("fw-b", "b", R)], &["a", "b"]);
        sync(&mut st, &kernel(&[]), &[], full());
        let k1 = kernel(&[("svc-a", 3, 180), ("fwd-a", 10, 1000), ("fw-b", 2, 120)]);
        let first = vec![("a".into(), C, 3, 180), ("a".into(), T, 10, 1000), ("b".into(), R, 2, 120)];
        assert_eq!(exported(&st, &k1), first);

        // a's endpoints go: its chains are deleted, its series stay with the same values.
        let no_endpoints = index(&[("fw-b", "b", R)], &["a", "b"]);
        assert_eq!(
            st.kept_counters(&IndexUpdate::Full(no_endpoints.clone())),
            ["fw-b", "fwd-a", "svc-a"].map(Name::from).into()
        );
        sync(&mut st, &k1, &["svc-a", "fwd-a"], no_endpoints);
        let k2 = kernel(&[("fw-b", 2, 120)]);
        assert_eq!(exported(&st, &k2), first);

        // They come back: new chains start at 0 in the kernel, the series continue.
        sync(&mut st, &k2, &[], full());
        let k3 = kernel(&[("svc-a", 1, 60), ("fwd-a", 4, 400), ("fw-b", 2, 120)]);
        let later = vec![("a".into(), C, 4, 240), ("a".into(), T, 14, 1400), ("b".into(), R, 2, 120)];
        assert_eq!(exported(&st, &k3), later);

        // A flush (endpoint change) folds the old value in.
        sync(&mut st, &k3, &["svc-a"], full());
        let k4 = kernel(&[("svc-a", 0, 0), ("fwd-a", 4, 400), ("fw-b", 2, 120)]);
        assert_eq!(exported(&st, &k4), later);

        // Service a goes: its series go, its chains need no read; b stays.
        let only_b = index(&[("fw-b", "b", R)], &["b"]);
        assert_eq!(
            st.kept_counters(&IndexUpdate::Full(only_b.clone())),
            BTreeSet::from([Name::from("fw-b")])
        );
        sync(&mut st, &k4, &["svc-a", "fwd-a"], only_b);
        assert_eq!(exported(&st, &k2), vec![("b".into(), R, 2, 120)]);

        // Without our table in the kernel, the folded base.
        assert_eq!(st.totals(&kernel(&[])).values().copied().collect::<Vec<_>>(), vec![Totals::default()]);
    }

    #[test]
    fn a_port_without_counters_has_no_series() {
        let mut st = CounterState::default();
        sync(&mut st, &kernel(&[]), &[], index(&[], &["a"]));
        assert!(st.totals(&kernel(&[])).is_empty());
    }
}
