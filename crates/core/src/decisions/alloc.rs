//! The node-port allocator: pure, deterministic, over the whole set of known Services.
//!
//! It owns which node port each service port gets. Decisions:
//! - **Unit of uniqueness.** A node port *number* belongs to at most one Service, whatever the
//!   protocol, as Kubernetes' NodePort allocator does (so `20001/TCP` and `20001/UDP` never go to
//!   two Services; users can reason about "port 20001 is web's"). Within one Service the number may
//!   carry one service port per protocol, so `53/TCP` and `53/UDP` share one number: a new
//!   allocation for a port whose sibling (same service port number, other protocol) already has a
//!   number reuses that number.
//! - **Shared only where it is asked for, by pools apart** ([`Constraints::sharing`]): a number
//!   a port asks for (an explicit request, or its pool's `portMode: ServicePort`) or already
//!   holds may be held beside Services whose pools never serve one node with its own
//!   ([`crate::decisions::sharing`]); a number the registry records as shared stays so. A new
//!   number is always one nobody holds.
//! - **What exists wins.** An allocation that exists — the Service's own
//!   `nodelb.io/allocated-ports` annotation first (it is what the cluster sees), then `previous`
//!   (the state file) — is settled before any request: a Service that asks for a number later
//!   (a new Service, or an edit of `nodelb.io/ports`), however old, gets a
//!   [`AllocProblem::Conflict`], and the Service that holds the number keeps serving on it.
//!   Silently moving a serving Service's port breaks its clients; refusing the newcomer only
//!   delays a Service that is not serving yet.
//! - **Age breaks ties** ([`age_order`]): of two existing claims on one number (a human edit, a
//!   split brain: repaired so) or two new requests for it, the older Service wins. Age is when
//!   this node first allocated the Service a port (manifests mode: recorded in the state file,
//!   since manifests have no creationTimestamp), then creationTimestamp, then namespace/name; a
//!   Service without a time counts as the youngest. Kubernetes mode has no allocation time (the
//!   leader's view is the annotations), so there it is creationTimestamp, then namespace/name.
//! - **Order.** (1) existing allocations, oldest Service first: a previous number is kept when it
//!   is still in the range (or is what the port explicitly asks for) and no older claim holds it;
//!   a port whose request changed drops its old number, and a stale number another port of the
//!   same Service now asks for (same protocol) is dropped. (2) explicit requests not settled by
//!   (1), oldest first. (3) new ports, oldest first, lowest free number in the range. A new port
//!   therefore never takes a number another Service still holds, however young that Service is.
//! - **Explicit requests** (`nodelb.io/ports`: a number, or `service` = the service port's own
//!   number) may lie outside the range. If the number is held, the request is a
//!   [`AllocProblem::Conflict`] and that service port gets no port at all: silently serving it
//!   on another port would surprise whoever asked for a specific one. A range change moves
//!   previous numbers that fall outside it (explicit requests excepted).
//! - **Release.** Only Services in `services` get allocations; everything else in `previous` is
//!   released simply by not being carried over.
//!
//! - **Node ports a Service was not given** ([`allocate_with`], [`crate::decisions::port_policy`]): an
//!   explicit request outside the range(s) and the operator's `--allowed-node-ports` is refused
//!   ([`AllocProblem::NotAllowed`]), one on a port a process on a node listens on too
//!   ([`AllocProblem::InUse`]); new ports avoid numbers with a listener of any protocol. An
//!   allocation that exists keeps its number when a listener appears later (stability: the
//!   nodes with the listener stop programming that port and say so; the Service gets it back
//!   when the listener goes), but one that is no longer allowed is refused.

use std::borrow::Borrow;
use std::collections::{BTreeMap, BTreeSet};

use crate::decisions::port_policy::{PortPolicy, PortRange};
use crate::decisions::sharing::Sharing;
use crate::domain::{PortId, Protocol, ServiceKey};
use crate::inputs::model::{LbService, PortRequest};

/// Node port per service port, per Service.
pub type Allocations = BTreeMap<ServiceKey, BTreeMap<PortId, u16>>;

/// Why a service port got no node port. Each is a Warning Event and a Service condition.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error, serde::Serialize)]
pub enum AllocProblem {
    #[error("Service {service}: port {port} asks for node port {wanted}, which {} holds", holder.named_for(service))]
    Conflict { service: ServiceKey, port: PortId, wanted: u16, holder: ServiceKey },
    #[error("Service {service}: port {port}: no free node port left in {range}")]
    Exhausted { service: ServiceKey, port: PortId, range: String },
    #[error("Service {service}: port {port}: no node port pool serves it: {why}")]
    NoPool { service: ServiceKey, port: PortId, why: String },
    #[error(
        "Service {service}: port {port}: no new node port: {why} (pool {pool}'s maxPortsPerNamespace is {max})"
    )]
    QuotaExceeded { service: ServiceKey, port: PortId, pool: String, max: u32, why: String },
    #[error(
        "Service {service}: port {port} asks for node port {wanted}, which is not allowed (allowed: {allowed})"
    )]
    NotAllowed { service: ServiceKey, port: PortId, wanted: u16, allowed: String },
    #[error("Service {service}: port {port} asks for node port {wanted}/{}, which is in use: {by}", port.protocol)]
    InUse { service: ServiceKey, port: PortId, wanted: u16, by: String },
}

impl AllocProblem {
    pub fn service(&self) -> &ServiceKey {
        match self {
            AllocProblem::Conflict { service, .. }
            | AllocProblem::Exhausted { service, .. }
            | AllocProblem::NotAllowed { service, .. }
            | AllocProblem::InUse { service, .. }
            | AllocProblem::QuotaExceeded { service, .. }
            | AllocProblem::NoPool { service, .. } => service,
        }
    }

    /// Machine-readable: the `reason` code of the Service's node status and of its port.
    pub fn code(&self) -> &'static str {
        match self {
            AllocProblem::Conflict { .. } => "port_conflict",
            AllocProblem::Exhausted { .. } => "range_exhausted",
            AllocProblem::NotAllowed { .. } => "port_not_allowed",
            AllocProblem::InUse { .. } => "port_in_use",
            AllocProblem::NoPool { .. } => "no_pool",
            AllocProblem::QuotaExceeded { .. } => "quota_exceeded",
        }
    }

    pub fn port(&self) -> PortId {
        match self {
            AllocProblem::Conflict { port, .. }
            | AllocProblem::Exhausted { port, .. }
            | AllocProblem::NotAllowed { port, .. }
            | AllocProblem::InUse { port, .. }
            | AllocProblem::QuotaExceeded { port, .. }
            | AllocProblem::NoPool { port, .. } => *port,
        }
    }
}

/// What limits the allocator besides the other Services ([`crate::decisions::port_policy`]).
#[derive(Debug, Clone, Copy, Default)]
pub struct Constraints<'a> {
    /// Which numbers explicit requests may name; `None`: any (the order rules alone).
    pub policy: Option<&'a PortPolicy>,
    /// Ports a process listens on, per protocol, with who (for the message): a request for one
    /// is refused, a new allocation avoids its number. An allocation that exists keeps it
    /// (nodes with the listener just do not program it).
    pub in_use: Option<&'a BTreeMap<(Protocol, u16), String>>,
    /// Per Service, its node port pool ([`crate::decisions::pool`]); `None`: every Service allocates from
    /// the range (no pool object: the flags' pool).
    pub pools: Option<&'a BTreeMap<ServiceKey, PoolRanges>>,
    /// Numbers held by Services this allocation does not see, which keep them (the leader's scoped
    /// round: docs/design/incremental.md, "The round scoped to what changed"): a request for one is
    /// a conflict naming its holder, and no port is given one, exactly as when their holders are
    /// allocated too and keep what exists.
    pub elsewhere: Option<Elsewhere<'a>>,
    /// Which Services may hold one number together (`None`: none).
    pub sharing: Option<&'a Sharing>,
}

/// Numbers held outside an allocation, each with its holder ([`Constraints::elsewhere`]).
#[derive(Debug, Clone, Copy)]
pub struct Elsewhere<'a> {
    pub held: &'a NumberHolders,
    /// Holders of `held` that the allocation sees after all: their numbers are its to decide.
    pub except: &'a foldhash::HashSet<ServiceKey>,
}

impl<'a> Elsewhere<'a> {
    fn holders(&self, number: u16) -> impl Iterator<Item = &'a ServiceKey> {
        self.held.holders(number).filter(|k| !self.except.contains(*k))
    }
}

/// The holders of each number of a decision's allocations (one Service per number, whatever
/// the protocols, but where Services of pools apart share it), kept next to them where a
/// scoped pass allocates (`incremental::book::AllocationBook`).
#[derive(Debug, Clone, Default)]
pub struct NumberHolders {
    first: foldhash::HashMap<u16, ServiceKey>,
    /// The further holders of shared numbers (few: a map of them beside one of every number).
    more: BTreeMap<u16, Vec<ServiceKey>>,
}

impl NumberHolders {
    pub fn of(allocations: &Allocations) -> NumberHolders {
        let mut out = NumberHolders::default();
        for (key, ports) in allocations {
            out.add(key, ports);
        }
        out
    }

    fn add(&mut self, key: &ServiceKey, ports: &BTreeMap<PortId, u16>) {
        for n in ports.values() {
            match self.first.entry(*n) {
                std::collections::hash_map::Entry::Vacant(v) => {
                    v.insert(key.clone());
                }
                std::collections::hash_map::Entry::Occupied(o) if o.get() == key => {}
                std::collections::hash_map::Entry::Occupied(_) => {
                    let more = self.more.entry(*n).or_default();
                    if !more.contains(key) {
                        more.push(key.clone());
                    }
                }
            }
        }
    }

    pub fn holders(&self, number: u16) -> impl Iterator<Item = &ServiceKey> {
        self.first.get(&number).into_iter().chain(self.more.get(&number).into_iter().flatten())
    }

    /// How many numbers are held.
    pub fn len(&self) -> usize {
        self.first.len()
    }

    pub fn is_empty(&self) -> bool {
        self.first.is_empty()
    }

    /// `key` held `before` and holds `now`.
    pub fn update(
        &mut self,
        key: &ServiceKey,
        before: Option<&BTreeMap<PortId, u16>>,
        now: Option<&BTreeMap<PortId, u16>>,
    ) {
        for n in before.into_iter().flat_map(BTreeMap::values) {
            let more = self.more.get_mut(n);
            let first = self.first.get(n) == Some(key);
            match more {
                Some(more) => {
                    more.retain(|k| k != key);
                    if first && !more.is_empty() {
                        self.first.insert(*n, more.remove(0));
                    } else if first {
                        self.first.remove(n);
                    }
                    if more.is_empty() {
                        self.more.remove(n);
                    }
                }
                None if first => {
                    self.first.remove(n);
                }
                None => {}
            }
        }
        if let Some(now) = now {
            self.add(key, now);
        }
    }

    /// The numbers held outside `except` ([`Constraints::elsewhere`]).
    pub fn elsewhere<'a>(&'a self, except: &'a foldhash::HashSet<ServiceKey>) -> Elsewhere<'a> {
        Elsewhere { held: self, except }
    }
}

/// The ranges of a Service's pool.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PoolRanges {
    pub pool: String,
    /// The pool's own ranges: an existing allocation inside them stays.
    pub keep: Vec<PortRange>,
    /// Where new numbers come from: `keep` minus what an older pool on shared nodes covers;
    /// empty while the pool is disabled (drain).
    pub take: Vec<PortRange>,
    /// What its Services may also ask for by number (`spec.requestablePorts`): with pool
    /// objects, nothing else outside its ranges (not `--allowed-node-ports`, which is everyone's).
    pub requestable: Vec<PortRange>,
    /// The most numbers one namespace's Services may hold in the pool (`spec.maxPortsPerNamespace`):
    /// counted over every Service the allocation sees, so a decision under it is whole.
    pub per_namespace: Option<u32>,
    /// `spec.portMode: ServicePort`: each service port asks for its own number, as
    /// `nodelb.io/ports: service` does, unless the Service asks for numbers itself.
    pub service_ports: bool,
}

impl Constraints<'_> {
    fn in_use(&self, protocol: Protocol, port: u16) -> Option<&String> {
        self.in_use.and_then(|m| m.get(&(protocol, port)))
    }

    fn any_in_use(&self, port: u16) -> bool {
        self.in_use.is_some_and(|m| m.keys().any(|(_, p)| *p == port))
    }

    fn allows(&self, key: &ServiceKey, port: u16) -> bool {
        match self.pool_of(key) {
            Some(pool) => pool.keep.iter().chain(&pool.requestable).any(|r| r.contains(port)),
            None => self.policy.is_none_or(|p| p.allows(port)),
        }
    }

    fn pool_of(&self, key: &ServiceKey) -> Option<&PoolRanges> {
        self.pools.and_then(|m| m.get(key))
    }

    /// What explicit requests of `key` may name, for messages.
    fn describe_allowed(&self, key: &ServiceKey) -> Option<String> {
        match self.pool_of(key) {
            Some(pool) if pool.requestable.is_empty() => Some(format!(
                "pool {} {}",
                pool.pool,
                crate::decisions::port_policy::describe_ranges(&pool.keep)
            )),
            Some(pool) => Some(format!(
                "pool {} {} or its requestablePorts {}",
                pool.pool,
                crate::decisions::port_policy::describe_ranges(&pool.keep),
                crate::decisions::port_policy::describe_ranges(&pool.requestable)
            )),
            None => self.policy.map(PortPolicy::describe),
        }
    }
}

#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct AllocationResult {
    /// Only Services with at least one allocated port appear.
    pub allocations: Allocations,
    /// In processing order (oldest Service first).
    pub problems: Vec<AllocProblem>,
}

impl AllocationResult {
    /// How many numbers of `range` are in use (for the free-ports metric).
    pub fn used_in(&self, range: &PortRange) -> usize {
        let numbers: BTreeSet<u16> = self.allocations.values().flat_map(|m| m.values().copied()).collect();
        numbers.into_iter().filter(|n| range.contains(*n)).count()
    }
}

/// Who holds each number, and for which protocols (a bit each). Keys are borrowed from the
/// Services of the round: owned keys would clone two strings per Service for this alone.
#[derive(Default)]
struct Table<'a> {
    owners: BTreeMap<u16, (&'a ServiceKey, u8)>,
    /// The further holders of shared numbers.
    sharers: BTreeMap<u16, Vec<(&'a ServiceKey, u8)>>,
    /// Numbers held outside the allocation: never free, never claimed (but shared).
    elsewhere: Option<Elsewhere<'a>>,
    sharing: Option<&'a Sharing>,
}

/// Whether a claim on a number may go beside other Services' holds of it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Share {
    /// A new number: nobody may hold it.
    Never,
    /// A number asked for: beside Services of pools apart from its own.
    Apart,
    /// A number held already: also beside those the registry records it with.
    Kept,
}

fn protocol_bit(p: Protocol) -> u8 {
    match p {
        Protocol::Tcp => 1,
        Protocol::Udp => 2,
        Protocol::Sctp => 4,
    }
}

impl<'a> Table<'a> {
    /// Takes `number` for `proto` on behalf of `key`, or returns the holder that prevents it.
    fn claim(
        &mut self,
        number: u16,
        proto: Protocol,
        key: &'a ServiceKey,
        share: Share,
    ) -> Result<(), ServiceKey> {
        let sharing = self.sharing;
        let beside = |other: &ServiceKey| match (share, sharing) {
            (Share::Never, _) | (_, None) => false,
            (Share::Apart, Some(s)) => s.apart(key, other),
            (Share::Kept, Some(s)) => s.apart(key, other) || s.recorded_together(number, key, other),
        };
        if let Some(holder) = self.elsewhere.and_then(|e| e.holders(number).find(|h| !beside(h))) {
            return Err(holder.clone());
        }
        let bit = protocol_bit(proto);
        let (owner, protos) = match self.owners.get_mut(&number) {
            None => {
                self.owners.insert(number, (key, bit));
                return Ok(());
            }
            Some(held) => held,
        };
        if *owner == key {
            return if *protos & bit == 0 {
                *protos |= bit;
                Ok(())
            } else {
                Err((*owner).clone())
            };
        }
        if !beside(owner) {
            return Err((*owner).clone());
        }
        let more = self.sharers.entry(number).or_default();
        if let Some((_, protos)) = more.iter_mut().find(|(k, _)| *k == key) {
            return if *protos & bit == 0 {
                *protos |= bit;
                Ok(())
            } else {
                Err(key.clone())
            };
        }
        if let Some((other, _)) = more.iter().find(|(k, _)| !beside(k)) {
            return Err((*other).clone());
        }
        more.push((key, bit));
        Ok(())
    }

    fn is_free(&self, number: u16) -> bool {
        !self.owners.contains_key(&number)
            && self.elsewhere.is_none_or(|e| e.holders(number).next().is_none())
    }
}

type Age = (bool, Option<k8s_openapi::jiff::Timestamp>, bool, Option<k8s_openapi::jiff::Timestamp>);

/// A Service's age, compared before its key: when this node first allocated it a port
/// (manifests mode's state file; a Service with that record is older than one without), then
/// creationTimestamp. In Kubernetes mode nothing has the first. `None` sorts after every time: a
/// Service without one counts as the youngest.
fn age(s: &LbService) -> Age {
    let (since, created) = (s.allocated_since, s.created);
    (since.is_none(), since, created.is_none(), created)
}

/// The Services oldest first (by age, then namespace/name), one per key. Each age is parsed once (parsing the
/// timestamps in every comparison of the sort would be most of an allocation round).
pub fn age_order<S: Borrow<LbService>>(services: &[S]) -> Vec<&LbService> {
    let mut ordered: Vec<(Age, &LbService)> =
        services.iter().map(|s| (age(s.borrow()), s.borrow())).collect();
    ordered.sort_by(|(age_a, a), (age_b, b)| age_a.cmp(age_b).then_with(|| a.key.cmp(&b.key)));
    // Two objects with one key cannot both be served (the model refuses the second); keep the
    // allocator total anyway (a hash set: a tree of the keys compares key strings at every level).
    let mut seen = foldhash::HashSet::with_capacity_and_hasher(ordered.len(), Default::default());
    ordered.retain(|(_, s)| seen.insert(&s.key));
    ordered.into_iter().map(|(_, s)| s).collect()
}

/// Whether the port `id` of the `i`th Service (in age order) is settled: it holds a number, or
/// its explicit request was refused.
fn settled(
    held: &[BTreeMap<PortId, u16>],
    refused: &BTreeSet<(usize, PortId)>,
    i: usize,
    id: PortId,
) -> bool {
    held[i].contains_key(&id) || refused.contains(&(i, id))
}

/// The number a service port asks for: its Service's `nodelb.io/ports`, else its own number when
/// its pool serves Services on their own ports.
fn explicit_request(svc: &LbService, id: PortId, constraints: &Constraints<'_>) -> Option<u16> {
    match &svc.port_request {
        PortRequest::Auto if pool_mode_request(svc, constraints) => Some(id.port),
        PortRequest::Auto => None,
        PortRequest::ServicePorts => Some(id.port),
        PortRequest::Explicit(map) => map.get(&id).copied(),
    }
}

/// Whether `svc`'s ports ask for their own numbers because of its pool's `portMode`, not its
/// own annotation. A listener on such a number refuses it only on the nodes where it listens
/// (they say so on the Service's Serving condition), not everywhere: the pool chose the number,
/// and the other nodes serve it.
fn pool_mode_request(svc: &LbService, constraints: &Constraints<'_>) -> bool {
    svc.port_request == PortRequest::Auto && constraints.pool_of(&svc.key).is_some_and(|p| p.service_ports)
}

/// Allocates node ports for `services`, keeping `previous` (the state file) where possible.
/// See the module documentation for the rules.
pub fn allocate(range: &PortRange, services: &[LbService], previous: &Allocations) -> AllocationResult {
    allocate_with(range, services, previous, Constraints::default())
}

/// [`allocate`] within `constraints` (the port policy, ports in use on the nodes).
pub fn allocate_with<S: Borrow<LbService>>(
    range: &PortRange,
    services: &[S],
    previous: &Allocations,
    constraints: Constraints<'_>,
) -> AllocationResult {
    let ordered = age_order(services);
    let mut table =
        Table { elsewhere: constraints.elsewhere, sharing: constraints.sharing, ..Table::default() };
    let mut result = AllocationResult::default();
    // What each Service holds, and its explicit requests refused in phase 2, by its position in
    // `ordered`: no key is compared or cloned per port. A port is settled when it holds a number
    // or its request was refused.
    let mut held: Vec<BTreeMap<PortId, u16>> = vec![BTreeMap::new(); ordered.len()];
    let mut refused: BTreeSet<(usize, PortId)> = BTreeSet::new();

    // Phase 1: allocations that exist (annotation, then state file), oldest Service first. An
    // existing allocation of a port is one of its previous numbers, unless the port now asks
    // for another number (the request replaces it), or another port of the same Service now
    // asks for that number with the same protocol (the request wins over a stale number).
    for (i, svc) in ordered.iter().enumerate() {
        let from_state = previous.get(&svc.key);
        // Who asks for which number, per protocol: a Service may have thousands of ports, so
        // "does another port ask for it" must not look at each of them for each of them.
        let mut requested: BTreeMap<(Protocol, u16), Vec<PortId>> = BTreeMap::new();
        for port in &svc.ports {
            if let Some(n) = explicit_request(svc, port.id, &constraints) {
                requested.entry((port.id.protocol, n)).or_default().push(port.id);
            }
        }
        for port in &svc.ports {
            let wanted = explicit_request(svc, port.id, &constraints);
            let requested_by_sibling = |n: u16| {
                requested.get(&(port.id.protocol, n)).is_some_and(|ids| ids.iter().any(|id| *id != port.id))
            };
            let candidates =
                [svc.previous_allocation.get(&port.id), from_state.and_then(|m| m.get(&port.id))];
            for number in candidates.into_iter().flatten().copied() {
                let keep = match constraints.pool_of(&svc.key) {
                    Some(pool) => pool.keep.iter().any(|r| r.contains(number)),
                    None => range.contains(number),
                };
                let usable = match wanted {
                    Some(w) => w == number && constraints.allows(&svc.key, w),
                    None => keep && !requested_by_sibling(number),
                };
                if usable && table.claim(number, port.id.protocol, &svc.key, Share::Kept).is_ok() {
                    held[i].insert(port.id, number);
                    break;
                }
            }
        }
    }

    // Pools bounding what one namespace holds: what each namespace holds now, and the Services
    // that ask for more than the bound on their own (none of their ports gets a new number: such
    // a Service must not drain the pool for nothing).
    let mut quotas = Quotas::default();
    for (i, svc) in ordered.iter().enumerate() {
        let Some(pool) = constraints.pool_of(&svc.key) else { continue };
        let Some(max) = pool.per_namespace else { continue };
        quotas.count(&pool.pool, &svc.key.namespace, held[i].values().copied());
        let mut needed: BTreeSet<u16> = held[i].values().copied().collect();
        needed.extend(svc.ports.iter().filter(|p| !held[i].contains_key(&p.id)).map(|p| p.id.port));
        if needed.len() > max as usize {
            let why = format!("the Service has {} ports, more than one namespace may hold", needed.len());
            for port in svc.ports.iter().filter(|p| !held[i].contains_key(&p.id)) {
                result.problems.push(AllocProblem::QuotaExceeded {
                    service: svc.key.clone(),
                    port: port.id,
                    pool: pool.pool.clone(),
                    max,
                    why: why.clone(),
                });
                refused.insert((i, port.id));
            }
        }
    }
    let over_quota = |quotas: &Quotas, svc: &LbService, port: PortId, number: u16| {
        let pool = constraints.pool_of(&svc.key)?;
        let max = pool.per_namespace?;
        let holds = quotas.held(&pool.pool, &svc.key.namespace);
        (holds.len() >= max as usize && !holds.contains(&number)).then(|| AllocProblem::QuotaExceeded {
            service: svc.key.clone(),
            port,
            pool: pool.pool.clone(),
            max,
            why: format!("namespace {} holds {} node ports of it", svc.key.namespace, holds.len()),
        })
    };

    // Phase 2: explicit requests not settled above, oldest Service first. A number someone holds
    // from before is a conflict, whatever the requester's age: a serving Service never loses its
    // port to one that asks later.
    for (i, svc) in ordered.iter().enumerate() {
        for port in &svc.ports {
            let Some(wanted) = explicit_request(svc, port.id, &constraints) else {
                continue;
            };
            if settled(&held, &refused, i, port.id) {
                continue;
            }
            let id = port.id;
            let service = || svc.key.clone();
            let problem = if !constraints.allows(&svc.key, wanted)
                && let Some(allowed) = constraints.describe_allowed(&svc.key)
            {
                Some(AllocProblem::NotAllowed { service: service(), port: id, wanted, allowed })
            } else if let Some(by) = constraints.in_use(id.protocol, wanted)
                && !pool_mode_request(svc, &constraints)
            {
                Some(AllocProblem::InUse { service: service(), port: id, wanted, by: by.clone() })
            } else if let Some(p) = over_quota(&quotas, svc, id, wanted) {
                Some(p)
            } else {
                match table.claim(wanted, id.protocol, &svc.key, Share::Apart) {
                    Ok(()) => {
                        held[i].insert(id, wanted);
                        quotas.count_one(constraints.pool_of(&svc.key), &svc.key.namespace, wanted);
                        None
                    }
                    Err(holder) => {
                        Some(AllocProblem::Conflict { service: service(), port: id, wanted, holder })
                    }
                }
            };
            if let Some(p) = problem {
                result.problems.push(p);
                refused.insert((i, id));
            }
        }
    }

    // Phase 3: new ports, oldest Service first, lowest free number of the Service's pool (the
    // range without pools). Numbers are only ever taken in this phase, so the lowest free number
    // of a range never goes down: one cursor per range suffices.
    let mut cursors: BTreeMap<PortRange, Option<u16>> = BTreeMap::new();
    for (i, svc) in ordered.iter().enumerate() {
        let pool = constraints.pool_of(&svc.key);
        let take: &[PortRange] = pool.map_or(std::slice::from_ref(range), |p| p.take.as_slice());
        for port in &svc.ports {
            if settled(&held, &refused, i, port.id) {
                continue;
            }
            let sibling = [Protocol::Tcp, Protocol::Udp, Protocol::Sctp]
                .into_iter()
                .filter(|p| *p != port.id.protocol)
                .find_map(|protocol| held[i].get(&PortId { port: port.id.port, protocol }).copied());
            if let Some(number) = sibling
                && take.iter().any(|r| r.contains(number))
                && constraints.in_use(port.id.protocol, number).is_none()
                && table.claim(number, port.id.protocol, &svc.key, Share::Kept).is_ok()
            {
                held[i].insert(port.id, number);
                continue;
            }
            let mut found = None;
            for r in take {
                let cursor = cursors.entry(*r).or_insert(Some(r.first));
                while let Some(n) = *cursor {
                    if n > r.last || (table.is_free(n) && !constraints.any_in_use(n)) {
                        break;
                    }
                    *cursor = n.checked_add(1);
                }
                if let Some(n) = cursor.filter(|n| *n <= r.last) {
                    found = Some(n);
                    break;
                }
            }
            if let Some(number) = found
                && let Some(p) = over_quota(&quotas, svc, port.id, number)
            {
                result.problems.push(p);
                continue;
            }
            match found {
                Some(number) if table.claim(number, port.id.protocol, &svc.key, Share::Never).is_ok() => {
                    held[i].insert(port.id, number);
                    quotas.count_one(pool, &svc.key.namespace, number);
                }
                _ => result.problems.push(AllocProblem::Exhausted {
                    service: svc.key.clone(),
                    port: port.id,
                    range: match pool {
                        Some(p) if p.take.is_empty() && !p.keep.is_empty() => {
                            format!("pool {} (disabled, or all its ranges are another pool's)", p.pool)
                        }
                        Some(p) => {
                            format!(
                                "pool {} {}",
                                p.pool,
                                crate::decisions::port_policy::describe_ranges(&p.take)
                            )
                        }
                        None => format!("range {range}"),
                    },
                }),
            }
        }
    }
    result.allocations =
        ordered.iter().zip(held).filter(|(_, m)| !m.is_empty()).map(|(s, m)| (s.key.clone(), m)).collect();
    result
}

/// The numbers each namespace holds in each pool that bounds them ([`PoolRanges::per_namespace`]).
#[derive(Default)]
struct Quotas(BTreeMap<(String, String), BTreeSet<u16>>);

impl Quotas {
    fn count(&mut self, pool: &str, namespace: &str, numbers: impl Iterator<Item = u16>) {
        self.0.entry((pool.to_string(), namespace.to_string())).or_default().extend(numbers);
    }

    /// Counts `number` for `namespace` in `pool` when that pool bounds its namespaces.
    fn count_one(&mut self, pool: Option<&PoolRanges>, namespace: &str, number: u16) {
        if let Some(pool) = pool.filter(|p| p.per_namespace.is_some()) {
            self.count(&pool.pool, namespace, std::iter::once(number));
        }
    }

    fn held(&self, pool: &str, namespace: &str) -> &BTreeSet<u16> {
        static NONE: BTreeSet<u16> = BTreeSet::new();
        self.0.get(&(pool.to_string(), namespace.to_string())).unwrap_or(&NONE)
    }
}

/// Ports whose node port changed from `previous` to `next` (a number no longer valid for its
/// Service, e.g. outside its pool's ranges now): `(service, port, old, new)`. A port that lost its
/// number is not a move (that is an allocation problem, reported as such). Manifests mode logs
/// these; in Kubernetes mode the leader records `NodePortReallocated`.
pub fn moved<'a>(
    previous: &'a Allocations,
    next: &'a Allocations,
) -> Vec<(&'a ServiceKey, PortId, u16, u16)> {
    // Both in key order: one merge walk, not a lookup per Service (the lookups would be a
    // good part of a one-Service sync's state phase).
    let mut prev = previous.iter().peekable();
    next.iter()
        .filter_map(move |(key, ports)| {
            while prev.next_if(|(k, _)| *k < key).is_some() {}
            let (_, old) = prev.next_if(|(k, _)| *k == key)?;
            Some((key, ports, old))
        })
        .flat_map(|(key, ports, old)| {
            ports.iter().filter_map(move |(id, n)| {
                let was = *old.get(id)?;
                (was != *n).then_some((key, *id, was, *n))
            })
        })
        .collect()
}

#[cfg(test)]
mod tests;
