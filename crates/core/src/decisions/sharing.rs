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
use crate::k8s::claims::Owner;

/// The pools whose Services may share numbers, and each such Service's pool.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Sharing {
    /// Each Service's pool, by its registry owner (Services not listed share nothing).
    pools: BTreeMap<Owner, String>,
    /// Pairs of pools that never select one node, each pair both ways.
    disjoint: BTreeSet<(String, String)>,
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
        Sharing { pools: BTreeMap::new(), disjoint }
    }

    /// Records that the Service `owner` is served by `pool`.
    pub fn serve(&mut self, owner: Owner, pool: &str) {
        self.pools.insert(owner, pool.to_string());
    }

    /// Whether any two pools are apart (else nothing is ever shared).
    pub fn is_empty(&self) -> bool {
        self.disjoint.is_empty()
    }

    /// The pool of `owner`'s Service, as recorded beside its claim on a shared number.
    pub fn pool(&self, owner: &Owner) -> Option<&str> {
        self.pools.get(owner).map(String::as_str)
    }

    /// Whether the Services `a` and `b` may hold one number: their pools never serve one node.
    pub fn may_share(&self, a: &Owner, b: &Owner) -> bool {
        match (self.pools.get(a), self.pools.get(b)) {
            (Some(pa), Some(pb)) => self.disjoint.contains(&(pa.clone(), pb.clone())),
            _ => false,
        }
    }
}

#[cfg(test)]
mod tests;
