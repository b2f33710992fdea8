//! The node ports every Service was last decided, kept between passes, and which Services a pass
//! scoped to what changed must decide again ([`AllocationBook::closure`]). One book for the
//! leader's round and for a node's sync (docs/design/incremental.md). Pure.
//!
//! What couples one Service's decision to another's is only node port numbers: who holds which
//! (by annotation, or as last decided) and who asks for which. So a scope is what changed, the
//! Services decided again every pass (the unsettled ones), and every Service that holds a number
//! one of those holds or held, until no more come; every other Service keeps its numbers
//! ([`AllocationBook::elsewhere`]).

use std::collections::BTreeMap;

use crate::decisions::alloc::{Allocations, Elsewhere, NumberHolders};
use crate::domain::{PortId, ServiceKey};

/// Each Service's node ports as last decided ([`AllocationBook::replace`] after a whole pass,
/// [`AllocationBook::patch`] after a scoped one), and, where the pass allocates, who holds each
/// number and which Services every pass decides again.
#[derive(Debug, Default)]
pub struct AllocationBook {
    /// Each Service's node ports as decided (a Service with none is not here).
    allocations: Allocations,
    /// `None` where the pass does not allocate (a node in Kubernetes mode programs the numbers
    /// the leader allocated): its numbers couple Services by annotation only.
    index: Option<Index>,
}

#[derive(Debug, Default)]
struct Index {
    /// The holder of each number of the allocations.
    numbers: NumberHolders,
    /// The Services every pass decides, whatever changed: an allocation problem (a freed number
    /// may be theirs now), a refusal that keeps numbers, a write still to do.
    unsettled: foldhash::HashSet<ServiceKey>,
}

impl AllocationBook {
    /// Each Service's node ports as decided.
    pub fn allocations(&self) -> &Allocations {
        &self.allocations
    }

    /// Whether `key` is decided again every pass.
    pub fn is_unsettled(&self, key: &ServiceKey) -> bool {
        self.index.as_ref().is_some_and(|i| i.unsettled.contains(key))
    }

    /// The numbers held by the Services outside `scope`, for the scope's allocation (`None`
    /// where the pass does not allocate).
    pub fn elsewhere<'a>(&'a self, scope: &'a foldhash::HashSet<ServiceKey>) -> Option<Elsewhere<'a>> {
        self.index.as_ref().map(|i| i.numbers.elsewhere(scope))
    }

    /// After a whole pass: its decisions for every Service. `unsettled`: `None` where the pass
    /// does not allocate.
    pub fn replace(&mut self, allocations: Allocations, unsettled: Option<foldhash::HashSet<ServiceKey>>) {
        self.index = unsettled.map(|unsettled| Index { numbers: NumberHolders::of(&allocations), unsettled });
        self.allocations = allocations;
    }

    /// After a pass of `scope`: its decisions for the scope's Services replace theirs.
    /// `allocations` and `unsettled` hold the scope's (a decision for a Service outside it is
    /// kept too).
    pub fn patch(
        &mut self,
        scope: &foldhash::HashSet<ServiceKey>,
        mut allocations: Allocations,
        unsettled: foldhash::HashSet<ServiceKey>,
    ) {
        for key in scope {
            let ports = allocations.remove(key);
            if let Some(index) = &mut self.index {
                index.numbers.update(key, self.allocations.get(key), ports.as_ref());
                index.unsettled.remove(key);
            }
            match ports {
                Some(ports) => self.allocations.insert(key.clone(), ports),
                None => self.allocations.remove(key),
            };
        }
        for (key, ports) in allocations {
            if let Some(index) = &mut self.index {
                index.numbers.update(&key, self.allocations.get(&key), Some(&ports));
            }
            self.allocations.insert(key, ports);
        }
        if let Some(index) = &mut self.index {
            index.unsettled.extend(unsettled);
        }
    }

    /// The Services a scoped pass must decide: `changed` and the Services whose annotations name
    /// one of `numbers` (what changed names or named), the unsettled ones, and every Service that
    /// holds a number one of those holds (by annotation, `annotated`; or as decided), until no
    /// more come. `holders`: the Services whose annotation names a number.
    pub fn closure<'v, A, H>(
        &self,
        changed: impl IntoIterator<Item = ServiceKey>,
        numbers: impl IntoIterator<Item = u16>,
        annotated: impl Fn(&ServiceKey) -> A,
        holders: impl Fn(u16) -> H,
    ) -> foldhash::HashSet<ServiceKey>
    where
        A: IntoIterator<Item = u16>,
        H: IntoIterator<Item = &'v ServiceKey>,
    {
        let mut todo: Vec<ServiceKey> = changed.into_iter().collect();
        let mut numbers: Vec<u16> = numbers.into_iter().collect();
        if let Some(index) = &self.index {
            todo.extend(index.unsettled.iter().cloned());
        }
        let mut scope: foldhash::HashSet<ServiceKey> = Default::default();
        let mut seen: foldhash::HashSet<u16> = Default::default();
        loop {
            while let Some(key) = todo.pop() {
                if scope.insert(key.clone()) {
                    numbers.extend(annotated(&key));
                    if self.index.is_some() {
                        numbers.extend(self.allocations.get(&key).into_iter().flat_map(decided));
                    }
                }
            }
            let Some(n) = numbers.pop() else { break };
            if seen.insert(n) {
                todo.extend(holders(n).into_iter().filter(|k| !scope.contains(*k)).cloned());
                for holder in self.index.iter().flat_map(|i| i.numbers.holders(n)) {
                    if !scope.contains(holder) {
                        todo.push(holder.clone());
                    }
                }
            }
        }
        scope
    }
}

fn decided(ports: &BTreeMap<PortId, u16>) -> impl Iterator<Item = u16> + '_ {
    ports.values().copied()
}

#[cfg(test)]
mod tests;
