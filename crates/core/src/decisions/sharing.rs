//! Which Services may hold one node port number together: those of two pools that can never
//! serve one node address, because their node selectors exclude each other
//! ([`crate::decisions::pool::Selector::disjoint`]) or their address CIDRs do not meet
//! ([`crate::decisions::pool::AddressFilter::disjoint`]; found by
//! [`crate::decisions::pool::PoolSet::sharing`]). Two ingress controllers on 443, one on the
//! edge nodes and one on the internal nodes, never meet on a node, so neither takes the number
//! from the other.
//!
//! Only a proof from the pools counts: nodes change their labels freely, and a relabelled node
//! then moves from one pool to the other without ever being in both. Pools that merely select
//! no common node today may select one tomorrow, so they never share. The leader builds this
//! from the pools in force; the registry records each holder's pool ([`crate::k8s::claims`]).

use std::collections::{BTreeMap, BTreeSet};

use crate::domain::{Owner, PortId, ServiceKey};

/// The pools whose Services may share numbers, and each such Service's pool.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Sharing {
    /// Each Service's pool (Services not listed share nothing).
    pools: BTreeMap<ServiceKey, String>,
    /// The Services of `pools` by their registry owner.
    keys: BTreeMap<Owner, ServiceKey>,
    /// Pairs of pools that never serve one node address, each pair both ways.
    disjoint: BTreeSet<(String, String)>,
    /// Numbers the registry records as shared, with each holder: kept together whatever the
    /// pools say now (a pool edited to overlap another does not move a serving Service).
    recorded: BTreeSet<(u16, ServiceKey)>,
    /// Only what is recorded stays shared: nothing new is ([`Sharing::only_recorded`]).
    closed: bool,
}

impl Sharing {
    /// Services of the pools of each of `apart` (pairs of pool names that never serve one node
    /// address) may share numbers.
    pub fn of_apart(apart: impl IntoIterator<Item = (String, String)>) -> Sharing {
        let mut disjoint = BTreeSet::new();
        for (a, b) in apart.into_iter().filter(|(a, b)| a != b) {
            disjoint.insert((b.clone(), a.clone()));
            disjoint.insert((a, b));
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

    /// Whether the pools of the Services `a` and `b` never serve one node address, and new
    /// numbers may be shared.
    pub fn apart(&self, a: &ServiceKey, b: &ServiceKey) -> bool {
        !self.closed && self.never_together(a, b)
    }

    /// Whether the pools of `a` and `b` never serve one node address (new numbers shared or
    /// not): on a node both serve, each is served on its own addresses.
    pub fn never_together(&self, a: &ServiceKey, b: &ServiceKey) -> bool {
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

/// Where the pools of a shared number's holders meet on a node, which one the node serves: the
/// lowest rank, the one whose pool is still the pool recorded beside its claim, then the first
/// recorded. `recorded`: each holder's owner and recorded pool, in registry order; `pool`: the
/// pool of `owner`'s Service now.
pub fn rank<'a>(
    recorded: impl Iterator<Item = (&'a Owner, Option<&'a str>)>,
    owner: &Owner,
    pool: Option<&str>,
) -> (bool, usize) {
    match recorded.enumerate().find(|(_, (o, _))| *o == owner) {
        Some((i, (_, recorded_pool))) => (recorded_pool != pool, i),
        None => (true, usize::MAX),
    }
}

/// One Service per number and node address on this node. Services of pools apart hold a
/// number together and a node serves one of them, or each on its own addresses (`coexist`:
/// the two are served on disjoint addresses here); where two that cannot coexist would both be
/// served (a pool edited to meet the other), the first by `rank` (then namespace/name) keeps
/// it, and the others' ports on it are taken off `programmed` and returned (refused here:
/// `PortRefusal::Shared`).
pub fn one_per_number(
    programmed: &mut BTreeMap<ServiceKey, BTreeMap<PortId, u16>>,
    rank: impl Fn(u16, &ServiceKey) -> (bool, usize),
    coexist: impl Fn(&ServiceKey, &ServiceKey) -> bool,
) -> Vec<(ServiceKey, PortId, u16)> {
    let mut by_number: BTreeMap<u16, BTreeSet<&ServiceKey>> = BTreeMap::new();
    for (key, ports) in programmed.iter() {
        for n in ports.values() {
            by_number.entry(*n).or_default().insert(key);
        }
    }
    let mut losing: Vec<(ServiceKey, u16)> = Vec::new();
    for (n, keys) in by_number.iter().filter(|(_, keys)| keys.len() > 1) {
        let mut ranked: Vec<&&ServiceKey> = keys.iter().collect();
        ranked.sort_by_key(|k| (rank(*n, k), **k));
        let mut kept: Vec<&ServiceKey> = Vec::new();
        for k in ranked {
            if kept.iter().all(|other| coexist(other, k)) {
                kept.push(k);
            } else {
                losing.push(((*k).clone(), *n));
            }
        }
    }
    let mut taken = Vec::new();
    for (key, n) in losing {
        let Some(ports) = programmed.get_mut(&key) else { continue };
        ports.retain(|port, number| {
            let keep = *number != n;
            if !keep {
                taken.push((key.clone(), *port, n));
            }
            keep
        });
    }
    taken
}

#[cfg(test)]
mod tests;
