//! Which Services may hold one node port number together: those of two pools that can never
//! serve one node, because their node selectors exclude each other ([`Selector::disjoint`]).
//! Two ingress controllers on 443, one on the edge nodes and one on the internal nodes, never
//! meet on a node, so neither takes the number from the other.
//!
//! Only a proof from the selectors counts: nodes change their labels freely, and a relabelled
//! node then moves from one pool to the other without ever being in both. Pools that merely
//! select no common node today may select one tomorrow, so they never share. The leader builds
//! this from the pools in force; the registry records each holder's pool
//! ([`crate::k8s::claims`]).

use std::collections::{BTreeMap, BTreeSet};

use crate::decisions::pool::Selector;
use crate::domain::ServiceKey;
use crate::k8s::claims::Owner;

/// The pools whose Services may share numbers, and each such Service's pool.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Sharing {
    /// Each Service's pool (Services not listed share nothing).
    pools: BTreeMap<ServiceKey, String>,
    /// The Services of `pools` by their registry owner.
    keys: BTreeMap<Owner, ServiceKey>,
    /// Pairs of pools that never select one node, each pair both ways.
    disjoint: BTreeSet<(String, String)>,
    /// Numbers the registry records as shared, with each holder: kept together whatever the
    /// pools say now (a pool edited to overlap another does not move a serving Service).
    recorded: BTreeSet<(u16, ServiceKey)>,
    /// Only what is recorded stays shared: nothing new is ([`Sharing::only_recorded`]).
    closed: bool,
}

impl Sharing {
    /// The pairs among `pools` (name and node selector) that never select one node.
    pub fn of<'a>(pools: impl IntoIterator<Item = (&'a str, &'a Selector)>) -> Sharing {
        let pools: Vec<(&str, &Selector)> = pools.into_iter().collect();
        let mut disjoint = BTreeSet::new();
        for (i, (a, sa)) in pools.iter().enumerate() {
            for (b, sb) in &pools[i + 1..] {
                if a != b && sa.disjoint(sb) {
                    disjoint.insert((a.to_string(), b.to_string()));
                    disjoint.insert((b.to_string(), a.to_string()));
                }
            }
        }
        Sharing { disjoint, ..Sharing::default() }
    }

    /// Records that the Service `key` (registry owner `owner`) is served by `pool`.
    pub fn serve(&mut self, key: &ServiceKey, owner: Owner, pool: &str) {
        self.pools.insert(key.clone(), pool.to_string());
        self.keys.insert(owner, key.clone());
    }

    /// Records that the registry gives `number` to `key` beside other Services.
    pub fn record(&mut self, number: u16, key: &ServiceKey) {
        self.recorded.insert((number, key.clone()));
    }

    /// Whether any two pools are apart (else nothing is ever shared).
    pub fn is_empty(&self) -> bool {
        self.disjoint.is_empty()
    }

    /// Whether `pool` is apart from another pool (its Services may share).
    pub fn shares(&self, pool: &str) -> bool {
        self.disjoint.range((pool.to_string(), String::new())..).next().is_some_and(|(a, _)| a == pool)
    }

    /// Nothing new is shared, only what the registry records stays so (an agent that cannot
    /// read shared numbers runs).
    pub fn only_recorded(&mut self) {
        self.closed = true;
    }

    /// The pool of `owner`'s Service, as recorded beside its claim on a shared number.
    pub fn pool(&self, owner: &Owner) -> Option<&str> {
        self.pools.get(self.keys.get(owner)?).map(String::as_str)
    }

    /// Whether the Services `a` and `b` (registry owners) may hold one number.
    pub fn may_share(&self, a: &Owner, b: &Owner) -> bool {
        match (self.keys.get(a), self.keys.get(b)) {
            (Some(a), Some(b)) => self.apart(a, b),
            _ => false,
        }
    }

    /// Whether the pools of the Services `a` and `b` never serve one node (and new numbers may
    /// be shared).
    pub fn apart(&self, a: &ServiceKey, b: &ServiceKey) -> bool {
        if self.closed {
            return false;
        }
        match (self.pools.get(a), self.pools.get(b)) {
            (Some(pa), Some(pb)) => self.disjoint.contains(&(pa.clone(), pb.clone())),
            _ => false,
        }
    }

    /// Whether the registry records `number` as shared by `a` and `b`.
    pub fn recorded_together(&self, number: u16, a: &ServiceKey, b: &ServiceKey) -> bool {
        self.recorded.contains(&(number, a.clone())) && self.recorded.contains(&(number, b.clone()))
    }
}

#[cfg(test)]
mod tests;
