//! The leader's round scoped to what changed (docs/design/incremental.md, "The round scoped to
//! what changed"): which Services a round must plan, and the decisions of the last rounds it keeps
//! for every other Service. Pure.
//!
//! What couples one Service's part of a round to another's is only node port numbers: who holds
//! which (an annotation, or the last decision), who asks for which. A Service is *settled* when
//! the last round planned nothing for it beyond what it carries (no allocation problem, no
//! duplicate, no refusal, no write) and nothing it reads changed since: its decision is its
//! annotation, and a round would decide it again. A scoped round plans the Services that changed,
//! the unsettled ones, and every Service that holds a number one of those holds or held, until
//! no more come ([`RoundBook::closure`]); every other Service keeps its numbers
//! ([`RoundBook::elsewhere`]).

use std::collections::{BTreeMap, BTreeSet};

use crate::decisions::alloc::{Allocations, Elsewhere, NumberHolders, PoolRanges};
use crate::domain::ServiceKey;

use super::claims::HeldNumbers;

/// The last rounds' decisions for every Service ([`RoundBook::replace`] after a whole round,
/// [`RoundBook::patch`] after a scoped one).
#[derive(Debug, Default)]
pub struct RoundBook {
    /// Each Service's node ports as decided (a Service with none is not here).
    allocations: Allocations,
    /// The holder of each number of `allocations`.
    numbers: NumberHolders,
    /// The Services every round plans, whatever changed.
    unsettled: foldhash::HashSet<ServiceKey>,
    /// With node port pools: each Service's pool.
    pools: BTreeMap<ServiceKey, PoolRanges>,
}

/// One Service a scoped round starts from, with the numbers it is known to name (its old and
/// new annotation: a deleted Service's numbers are free now, a new version's may clash).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Seed {
    pub key: ServiceKey,
    pub numbers: BTreeSet<u16>,
}

impl RoundBook {
    /// Each Service's node ports as decided.
    pub fn allocations(&self) -> &Allocations {
        &self.allocations
    }

    /// Each Service's pool (node port pools in force).
    pub fn pools(&self) -> &BTreeMap<ServiceKey, PoolRanges> {
        &self.pools
    }

    /// Whether `key`'s part was left unsettled.
    pub fn is_unsettled(&self, key: &ServiceKey) -> bool {
        self.unsettled.contains(key)
    }

    /// The numbers held by the Services outside `scope`, for the scope's allocation.
    pub fn elsewhere<'a>(&'a self, scope: &'a foldhash::HashSet<ServiceKey>) -> Elsewhere<'a> {
        self.numbers.elsewhere(scope)
    }

    /// After a whole round: its decisions for every Service.
    pub fn replace(
        &mut self,
        allocations: Allocations,
        unsettled: foldhash::HashSet<ServiceKey>,
        pools: BTreeMap<ServiceKey, PoolRanges>,
    ) {
        self.numbers = NumberHolders::of(&allocations);
        self.allocations = allocations;
        self.unsettled = unsettled;
        self.pools = pools;
    }

    /// After a round of `scope`: its decisions for the scope's Services replace theirs.
    /// `allocations`, `unsettled` and `pools` hold only the scope's.
    pub fn patch(
        &mut self,
        scope: &foldhash::HashSet<ServiceKey>,
        allocations: Allocations,
        unsettled: foldhash::HashSet<ServiceKey>,
        pools: BTreeMap<ServiceKey, PoolRanges>,
    ) {
        for key in scope {
            if let Some(ports) = self.allocations.remove(key) {
                self.numbers.update(key, Some(&ports), None);
            }
            self.unsettled.remove(key);
            self.pools.remove(key);
        }
        for (key, ports) in allocations {
            self.numbers.update(&key, None, Some(&ports));
            self.allocations.insert(key, ports);
        }
        self.unsettled.extend(unsettled);
        self.pools.extend(pools);
    }

    /// The Services a round must plan: the `seeds` (what changed), the unsettled ones, and every
    /// Service that holds a number one of those holds (in its annotation, `annotated`, or as
    /// decided), held, or names in a seed, until no more come. `held`: who holds each number in
    /// the view, by annotation.
    pub fn closure<'a>(
        &self,
        seeds: Vec<Seed>,
        held: &HeldNumbers<'_>,
        annotated: impl Fn(&ServiceKey) -> Option<&'a BTreeSet<u16>>,
    ) -> foldhash::HashSet<ServiceKey> {
        let mut scope: foldhash::HashSet<ServiceKey> = Default::default();
        let mut numbers_seen: foldhash::HashSet<u16> = Default::default();
        let mut todo: Vec<Seed> = seeds;
        todo.extend(self.unsettled.iter().map(|key| Seed { key: key.clone(), numbers: BTreeSet::new() }));
        while let Some(Seed { key, mut numbers }) = todo.pop() {
            if scope.insert(key.clone()) {
                numbers.extend(self.allocations.get(&key).into_iter().flat_map(|p| p.values().copied()));
                numbers.extend(annotated(&key).into_iter().flatten().copied());
            }
            for n in numbers {
                if !numbers_seen.insert(n) {
                    continue;
                }
                if let Some(holder) = self.numbers.holder(n)
                    && !scope.contains(holder)
                {
                    todo.push(Seed { key: holder.clone(), numbers: BTreeSet::new() });
                }
                for h in held.holders_of(n).iter().filter(|h| !scope.contains(&h.key)) {
                    todo.push(Seed { key: h.key.clone(), numbers: BTreeSet::new() });
                }
            }
        }
        scope
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::domain::{PortId, Protocol};
    use crate::k8s::claims::{Holder, Owner};

    fn key(name: &str) -> ServiceKey {
        ServiceKey::new("default", name)
    }

    fn ports(numbers: &[u16]) -> BTreeMap<PortId, u16> {
        numbers
            .iter()
            .enumerate()
            .map(|(i, n)| (PortId { port: 80 + i as u16, protocol: Protocol::Tcp }, *n))
            .collect()
    }

    fn holder(name: &str, numbers: &[u16]) -> Holder {
        Holder {
            key: key(name),
            owner: Owner::of(&key(name), Some(name)),
            created: None,
            numbers: numbers.iter().copied().collect(),
        }
    }

    fn seed(name: &str, numbers: &[u16]) -> Seed {
        Seed { key: key(name), numbers: numbers.iter().copied().collect() }
    }

    fn names(scope: &foldhash::HashSet<ServiceKey>) -> BTreeSet<String> {
        scope.iter().map(|k| k.name.to_string()).collect()
    }

    /// The scope is what changed, what is unsettled, and whoever shares a number with them,
    /// transitively; nobody else.
    #[test]
    fn the_scope_is_closed_under_shared_numbers() {
        let mut book = RoundBook::default();
        let decided: Allocations = [
            (key("a"), ports(&[20001])),
            (key("b"), ports(&[20002, 20003])),
            (key("c"), ports(&[20004])),
            (key("d"), ports(&[20005])),
        ]
        .into();
        book.replace(decided, [key("stuck")].into_iter().collect(), BTreeMap::new());
        // The view's annotations: e names b's 20002 (a duplicate), b also holds 20003, which c's
        // annotation does not name; d is on its own.
        let holders = [
            holder("a", &[20001]),
            holder("b", &[20002, 20003]),
            holder("c", &[20004]),
            holder("d", &[20005]),
            holder("e", &[20002, 20004]),
        ];
        let held = HeldNumbers::of(&holders);
        let annotated = |k: &ServiceKey| holders.iter().find(|h| h.key == *k).map(|h| &h.numbers);

        // Nothing changed: the unsettled Service alone.
        assert_eq!(names(&book.closure(vec![], &held, annotated)), ["stuck".to_string()].into());
        // a changed, alone with its number.
        assert_eq!(
            names(&book.closure(vec![seed("a", &[20001])], &held, annotated)),
            ["a", "stuck"].map(String::from).into()
        );
        // e is new and names 20002 (b's) and 20004 (c's): b and c join, and b's other number
        // brings nobody else.
        assert_eq!(
            names(&book.closure(vec![seed("e", &[20002, 20004])], &held, annotated)),
            ["b", "c", "e", "stuck"].map(String::from).into()
        );
        // A deletion of d: its old number brings whoever names it (nobody).
        assert_eq!(
            names(&book.closure(vec![seed("d", &[20005])], &held, annotated)),
            ["d", "stuck"].map(String::from).into()
        );
        // Via the decision alone: a seed without numbers still brings what it was given.
        assert_eq!(
            names(&book.closure(vec![seed("b", &[])], &held, annotated)),
            ["b", "e", "c", "stuck"].map(String::from).into()
        );
    }

    /// A patch replaces the scope's decisions and numbers, and nothing else.
    #[test]
    fn a_patch_replaces_the_scope_only() {
        let mut book = RoundBook::default();
        book.replace(
            [(key("a"), ports(&[20001])), (key("b"), ports(&[20002]))].into(),
            [key("b")].into_iter().collect(),
            BTreeMap::new(),
        );
        let scope: foldhash::HashSet<ServiceKey> = [key("b"), key("c")].into_iter().collect();
        book.patch(&scope, [(key("c"), ports(&[20002]))].into(), Default::default(), BTreeMap::new());
        assert_eq!(book.allocations().keys().map(|k| k.name.to_string()).collect::<Vec<_>>(), ["a", "c"]);
        assert_eq!(book.numbers.holder(20002), Some(&key("c")));
        assert_eq!(book.numbers.holder(20001), Some(&key("a")));
        assert!(!book.is_unsettled(&key("b")));
        let none: foldhash::HashSet<ServiceKey> = Default::default();
        let elsewhere = book.elsewhere(&none);
        assert_eq!(elsewhere.held.len(), 2);
    }
}
