//! The node-port allocator: pure, deterministic, over the whole set of known Services.
//!
//! It owns which node port each service port gets. Decisions:
//! - **Unit of uniqueness.** A node port *number* belongs to at most one Service, whatever the
//!   protocol, as Kubernetes' NodePort allocator does (so `20001/TCP` and `20001/UDP` never go to
//!   two Services; users can reason about "port 20001 is web's"). Within one Service the number may
//!   carry one service port per protocol, so `53/TCP` and `53/UDP` share one number: a new
//!   allocation for a port whose sibling (same service port number, other protocol) already has a
//!   number reuses that number.
//! - **What exists wins.** An allocation that exists — the Service's own
//!   `nodelb.io/allocated-ports` annotation first (it is what the cluster sees), then `previous`
//!   (the state file) — is settled before any request: a Service that asks for a number later
//!   (a new Service, or an edit of `nodelb.io/ports`), however old, gets a
//!   [`AllocProblem::Conflict`], and the Service that holds the number keeps serving on it.
//!   Silently moving a serving Service's port breaks its clients; refusing the newcomer only
//!   delays a Service that is not serving yet.
//! - **Age breaks ties** ([`older_first`]): of two existing claims on one number (a human edit, a
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
//! - **Node ports a Service was not given** ([`allocate_with`], [`crate::port_policy`]): an
//!   explicit request outside the range(s) and the operator's `--allowed-node-ports` is refused
//!   ([`AllocProblem::NotAllowed`]), one on a port a process on a node listens on too
//!   ([`AllocProblem::InUse`]); new ports avoid numbers with a listener of any protocol. An
//!   allocation that exists keeps its number when a listener appears later (stability: the
//!   nodes with the listener stop programming that port and say so; the Service gets it back
//!   when the listener goes), but one that is no longer allowed is refused.

use std::borrow::Borrow;
use std::collections::{BTreeMap, BTreeSet};

use crate::domain::{PortId, Protocol, ServiceKey};
use crate::model::{LbService, PortRequest};
use crate::port_policy::{PortPolicy, PortRange};

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

/// What limits the allocator besides the other Services ([`crate::port_policy`]).
#[derive(Debug, Clone, Copy, Default)]
pub struct Constraints<'a> {
    /// Which numbers explicit requests may name; `None`: any (the order rules alone).
    pub policy: Option<&'a PortPolicy>,
    /// Ports a process listens on, per protocol, with who (for the message): a request for one
    /// is refused, a new allocation avoids its number. An allocation that exists keeps it
    /// (nodes with the listener just do not program it).
    pub in_use: Option<&'a BTreeMap<(Protocol, u16), String>>,
    /// Per Service, its node port pool ([`crate::pool`]); `None`: every Service allocates from
    /// the range (no pool object: the flags' pool).
    pub pools: Option<&'a BTreeMap<ServiceKey, PoolRanges>>,
    /// Numbers held by Services this allocation does not see, which keep them (the leader's
    /// scoped round: docs/design.md, "The round scoped to what changed"): a request for one is a
    /// conflict naming its holder, and no port is given one, exactly as when their holders are
    /// allocated too and keep what exists.
    pub elsewhere: Option<Elsewhere<'a>>,
}

/// Numbers held outside an allocation, each with its holder ([`Constraints::elsewhere`]).
#[derive(Debug, Clone, Copy)]
pub struct Elsewhere<'a> {
    pub held: &'a NumberHolders,
    /// Holders of `held` that the allocation sees after all: their numbers are its to decide.
    pub except: &'a foldhash::HashSet<ServiceKey>,
}

impl<'a> Elsewhere<'a> {
    fn holder(&self, number: u16) -> Option<&'a ServiceKey> {
        self.held.holder(number).filter(|k| !self.except.contains(*k))
    }
}

/// The holder of each number of a decision's allocations (the allocator gives a number to one
/// Service, whatever the protocols), kept next to them by a scoped decision (the leader's
/// `k8s::scope::RoundBook`, a node's `desired::NodeBook` in manifests mode).
#[derive(Debug, Clone, Default)]
pub struct NumberHolders(foldhash::HashMap<u16, ServiceKey>);

impl NumberHolders {
    pub fn of(allocations: &Allocations) -> NumberHolders {
        let mut out = NumberHolders::default();
        for (key, ports) in allocations {
            out.0.extend(ports.values().map(|n| (*n, key.clone())));
        }
        out
    }

    pub fn holder(&self, number: u16) -> Option<&ServiceKey> {
        self.0.get(&number)
    }

    /// How many numbers are held.
    pub fn len(&self) -> usize {
        self.0.len()
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// `key` held `before` and holds `now`.
    pub fn update(
        &mut self,
        key: &ServiceKey,
        before: Option<&BTreeMap<PortId, u16>>,
        now: Option<&BTreeMap<PortId, u16>>,
    ) {
        for n in before.into_iter().flat_map(BTreeMap::values) {
            if self.0.get(n) == Some(key) {
                self.0.remove(n);
            }
        }
        self.0.extend(now.into_iter().flat_map(BTreeMap::values).map(|n| (*n, key.clone())));
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
            Some(pool) if pool.requestable.is_empty() => {
                Some(format!("pool {} {}", pool.pool, crate::port_policy::describe_ranges(&pool.keep)))
            }
            Some(pool) => Some(format!(
                "pool {} {} or its requestablePorts {}",
                pool.pool,
                crate::port_policy::describe_ranges(&pool.keep),
                crate::port_policy::describe_ranges(&pool.requestable)
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
    /// Numbers held outside the allocation: never free, never claimed.
    elsewhere: Option<Elsewhere<'a>>,
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
    fn claim(&mut self, number: u16, proto: Protocol, key: &'a ServiceKey) -> Result<(), ServiceKey> {
        if let Some(holder) = self.elsewhere.and_then(|e| e.holder(number)) {
            return Err(holder.clone());
        }
        let bit = protocol_bit(proto);
        match self.owners.get_mut(&number) {
            None => {
                self.owners.insert(number, (key, bit));
                Ok(())
            }
            Some((owner, protos)) if *owner == key && *protos & bit == 0 => {
                *protos |= bit;
                Ok(())
            }
            Some((owner, _)) => Err((*owner).clone()),
        }
    }

    fn is_free(&self, number: u16) -> bool {
        !self.owners.contains_key(&number) && self.elsewhere.is_none_or(|e| e.holder(number).is_none())
    }
}

/// Compares two Services by age, oldest first: when this node first allocated them a port
/// (manifests mode's state file; a Service with that record is older than one without), then
/// creationTimestamp (none: youngest), then namespace/name. In Kubernetes mode nothing has the
/// first, so it is creationTimestamp, then namespace/name.
pub fn older_first(a: &LbService, b: &LbService) -> std::cmp::Ordering {
    age(a).cmp(&age(b)).then_with(|| a.key.cmp(&b.key))
}

type Age = (bool, Option<k8s_openapi::jiff::Timestamp>, bool, Option<k8s_openapi::jiff::Timestamp>);

/// What [`older_first`] compares before the key. `None` sorts after every time: a Service
/// without one counts as the youngest.
fn age(s: &LbService) -> Age {
    let (since, created) = (s.allocated_since, s.created);
    (since.is_none(), since, created.is_none(), created)
}

/// The Services oldest first ([`older_first`]), one per key. Each age is parsed once (parsing the
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
    let mut table = Table { elsewhere: constraints.elsewhere, ..Table::default() };
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
                if usable && table.claim(number, port.id.protocol, &svc.key).is_ok() {
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
                match table.claim(wanted, id.protocol, &svc.key) {
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
                && table.claim(number, port.id.protocol, &svc.key).is_ok()
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
                Some(number) if table.claim(number, port.id.protocol, &svc.key).is_ok() => {
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
                            format!("pool {} {}", p.pool, crate::port_policy::describe_ranges(&p.take))
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
mod tests {
    use super::*;
    use crate::model::LbPort;

    fn key(name: &str) -> ServiceKey {
        ServiceKey::new("default", name)
    }

    fn tcp(port: u16) -> PortId {
        PortId::tcp(port)
    }

    fn udp(port: u16) -> PortId {
        PortId::udp(port)
    }

    /// A Service created at second `age` of 2024-01-01 (None: no timestamp) with `ports`.
    fn svc(name: &str, age: Option<u32>, ports: &[PortId]) -> LbService {
        let ports =
            ports.iter().map(|id| LbPort { id: *id, name: String::new(), endpoints: vec![] }).collect();
        let mut s = LbService::with_defaults(key(name), ports);
        s.created = age.map(|s| format!("2024-01-01T00:{:02}:{:02}Z", s / 60, s % 60).parse().unwrap());
        s
    }

    fn explicit(mut s: LbService, req: &[(PortId, u16)]) -> LbService {
        s.port_request = PortRequest::Explicit(req.iter().copied().collect());
        s
    }

    fn annotated(mut s: LbService, prev: &[(PortId, u16)]) -> LbService {
        s.previous_allocation = prev.iter().copied().collect();
        s
    }

    /// Allocated by this node first at second `secs` of 2024-01-02 (manifests mode's state file).
    fn since(mut s: LbService, secs: u32) -> LbService {
        s.allocated_since = Some(format!("2024-01-02T00:00:{secs:02}Z").parse().unwrap());
        s
    }

    fn allocs(entries: &[(&str, &[(PortId, u16)])]) -> Allocations {
        entries.iter().map(|(n, m)| (key(n), m.iter().copied().collect())).collect()
    }

    fn small() -> PortRange {
        PortRange { first: 20000, last: 20009 }
    }

    struct Case {
        name: &'static str,
        range: PortRange,
        services: Vec<LbService>,
        previous: Allocations,
        want: Allocations,
        problems: Vec<AllocProblem>,
    }

    #[test]
    fn table() {
        let cases = vec![
            Case {
                name: "new ports, oldest first, lowest free",
                range: small(),
                services: vec![svc("b", Some(1), &[tcp(80)]), svc("a", Some(2), &[tcp(80), tcp(443)])],
                previous: Allocations::new(),
                want: allocs(&[("b", &[(tcp(80), 20000)]), ("a", &[(tcp(80), 20001), (tcp(443), 20002)])]),
                problems: vec![],
            },
            Case {
                name: "no timestamp counts as youngest, then key order",
                range: small(),
                services: vec![
                    svc("a", None, &[tcp(80)]),
                    svc("c", None, &[tcp(80)]),
                    svc("b", Some(9), &[tcp(80)]),
                ],
                previous: Allocations::new(),
                want: allocs(&[
                    ("b", &[(tcp(80), 20000)]),
                    ("a", &[(tcp(80), 20001)]),
                    ("c", &[(tcp(80), 20002)]),
                ]),
                problems: vec![],
            },
            Case {
                name: "previous kept, new Service fills the gap",
                range: small(),
                services: vec![svc("old", Some(1), &[tcp(80)]), svc("new", Some(2), &[tcp(80)])],
                previous: allocs(&[("old", &[(tcp(80), 20003)])]),
                want: allocs(&[("old", &[(tcp(80), 20003)]), ("new", &[(tcp(80), 20000)])]),
                problems: vec![],
            },
            Case {
                name: "a new port of an older Service never takes a younger Service's number",
                range: small(),
                services: vec![svc("old", Some(1), &[tcp(80), tcp(443)]), svc("young", Some(2), &[tcp(80)])],
                previous: allocs(&[("old", &[(tcp(80), 20001)]), ("young", &[(tcp(80), 20000)])]),
                want: allocs(&[
                    ("old", &[(tcp(80), 20001), (tcp(443), 20002)]),
                    ("young", &[(tcp(80), 20000)]),
                ]),
                problems: vec![],
            },
            Case {
                name: "release: a gone Service's port is free again",
                range: small(),
                services: vec![svc("new", Some(5), &[tcp(80)])],
                previous: allocs(&[("gone", &[(tcp(80), 20000)])]),
                want: allocs(&[("new", &[(tcp(80), 20000)])]),
                problems: vec![],
            },
            Case {
                name: "release of a removed port",
                range: small(),
                services: vec![svc("web", Some(1), &[tcp(80)])],
                previous: allocs(&[("web", &[(tcp(80), 20004), (tcp(443), 20005)])]),
                want: allocs(&[("web", &[(tcp(80), 20004)])]),
                problems: vec![],
            },
            Case {
                name: "duplicate in previous (split brain): older keeps it, younger moves",
                range: small(),
                services: vec![
                    annotated(svc("young", Some(2), &[tcp(80)]), &[(tcp(80), 20005)]),
                    annotated(svc("old", Some(1), &[tcp(80)]), &[(tcp(80), 20005)]),
                ],
                previous: Allocations::new(),
                want: allocs(&[("old", &[(tcp(80), 20005)]), ("young", &[(tcp(80), 20000)])]),
                problems: vec![],
            },
            Case {
                name: "explicit conflict: older wins, younger gets nothing and a Conflict",
                range: small(),
                services: vec![
                    explicit(svc("young", Some(2), &[tcp(80), tcp(81)]), &[(tcp(80), 8080)]),
                    explicit(svc("old", Some(1), &[tcp(80)]), &[(tcp(80), 8080)]),
                ],
                previous: Allocations::new(),
                want: allocs(&[("old", &[(tcp(80), 8080)]), ("young", &[(tcp(81), 20000)])]),
                problems: vec![AllocProblem::Conflict {
                    service: key("young"),
                    port: tcp(80),
                    wanted: 8080,
                    holder: key("old"),
                }],
            },
            Case {
                name: "explicit request for a number an older Service holds from before",
                range: small(),
                services: vec![
                    svc("old", Some(1), &[tcp(80)]),
                    explicit(svc("young", Some(2), &[tcp(80)]), &[(tcp(80), 20000)]),
                ],
                previous: allocs(&[("old", &[(tcp(80), 20000)])]),
                want: allocs(&[("old", &[(tcp(80), 20000)])]),
                problems: vec![AllocProblem::Conflict {
                    service: key("young"),
                    port: tcp(80),
                    wanted: 20000,
                    holder: key("old"),
                }],
            },
            Case {
                name: "an existing allocation (state file) beats an older Service's later request",
                range: small(),
                services: vec![
                    explicit(svc("old", Some(1), &[tcp(80)]), &[(tcp(80), 20000)]),
                    svc("young", Some(2), &[tcp(80)]),
                ],
                previous: allocs(&[("young", &[(tcp(80), 20000)])]),
                want: allocs(&[("young", &[(tcp(80), 20000)])]),
                problems: vec![AllocProblem::Conflict {
                    service: key("old"),
                    port: tcp(80),
                    wanted: 20000,
                    holder: key("young"),
                }],
            },
            Case {
                name: "an existing allocation (annotation) beats an older Service's later request",
                range: small(),
                services: vec![
                    explicit(svc("old", Some(1), &[tcp(80), tcp(81)]), &[(tcp(80), 20000)]),
                    annotated(svc("young", Some(2), &[tcp(80)]), &[(tcp(80), 20000)]),
                ],
                previous: Allocations::new(),
                want: allocs(&[("old", &[(tcp(81), 20001)]), ("young", &[(tcp(80), 20000)])]),
                problems: vec![AllocProblem::Conflict {
                    service: key("old"),
                    port: tcp(80),
                    wanted: 20000,
                    holder: key("young"),
                }],
            },
            Case {
                name: "a request its own allocation already satisfies is kept, outside the range too",
                range: small(),
                services: vec![
                    svc("old", Some(1), &[tcp(80)]),
                    annotated(
                        explicit(svc("young", Some(2), &[tcp(80)]), &[(tcp(80), 8080)]),
                        &[(tcp(80), 8080)],
                    ),
                ],
                previous: allocs(&[("old", &[(tcp(80), 8080)])]),
                want: allocs(&[("old", &[(tcp(80), 20000)]), ("young", &[(tcp(80), 8080)])]),
                problems: vec![],
            },
            Case {
                name: "a changed request drops the old number, which is free again",
                range: small(),
                services: vec![
                    explicit(svc("web", Some(1), &[tcp(80)]), &[(tcp(80), 20005)]),
                    svc("new", Some(2), &[tcp(80)]),
                ],
                previous: allocs(&[("web", &[(tcp(80), 20000)])]),
                want: allocs(&[("web", &[(tcp(80), 20005)]), ("new", &[(tcp(80), 20000)])]),
                problems: vec![],
            },
            Case {
                name: "manifests: allocation age, not creationTimestamp or name, settles two existing claims",
                range: small(),
                services: vec![
                    since(annotated(svc("a", Some(1), &[tcp(80)]), &[(tcp(80), 20004)]), 20),
                    since(svc("b", Some(9), &[tcp(80)]), 10),
                ],
                previous: allocs(&[("b", &[(tcp(80), 20004)])]),
                want: allocs(&[("a", &[(tcp(80), 20000)]), ("b", &[(tcp(80), 20004)])]),
                problems: vec![],
            },
            Case {
                name: "manifests: a Service allocated before is older than one never allocated",
                range: small(),
                services: vec![
                    explicit(svc("a", Some(1), &[tcp(80)]), &[(tcp(80), 20007)]),
                    since(explicit(svc("b", None, &[tcp(80), tcp(81)]), &[(tcp(80), 20007)]), 50),
                ],
                previous: allocs(&[("b", &[(tcp(81), 20001)])]),
                want: allocs(&[("b", &[(tcp(80), 20007), (tcp(81), 20001)])]),
                problems: vec![AllocProblem::Conflict {
                    service: key("a"),
                    port: tcp(80),
                    wanted: 20007,
                    holder: key("b"),
                }],
            },
            Case {
                name: "a number is one Service's for every protocol",
                range: small(),
                services: vec![svc("tcp", Some(1), &[tcp(80)]), svc("udp", Some(2), &[udp(53)])],
                previous: allocs(&[("tcp", &[(tcp(80), 20001)]), ("udp", &[(udp(53), 20001)])]),
                want: allocs(&[("tcp", &[(tcp(80), 20001)]), ("udp", &[(udp(53), 20000)])]),
                problems: vec![],
            },
            Case {
                name: "53/TCP and 53/UDP of one Service share a new number",
                range: small(),
                services: vec![svc("dns", Some(1), &[udp(53), tcp(53), tcp(80)])],
                previous: Allocations::new(),
                want: allocs(&[("dns", &[(tcp(53), 20000), (udp(53), 20000), (tcp(80), 20001)])]),
                problems: vec![],
            },
            Case {
                name: "sibling keeps its own previous number",
                range: small(),
                services: vec![svc("dns", Some(1), &[udp(53), tcp(53)])],
                previous: allocs(&[("dns", &[(tcp(53), 20003), (udp(53), 20007)])]),
                want: allocs(&[("dns", &[(tcp(53), 20003), (udp(53), 20007)])]),
                problems: vec![],
            },
            Case {
                name: "exhaustion",
                range: PortRange { first: 20000, last: 20001 },
                services: vec![svc("a", Some(1), &[tcp(80), tcp(81)]), svc("b", Some(2), &[tcp(80)])],
                previous: Allocations::new(),
                want: allocs(&[("a", &[(tcp(80), 20000), (tcp(81), 20001)])]),
                problems: vec![AllocProblem::Exhausted {
                    service: key("b"),
                    port: tcp(80),
                    range: "range 20000-20001".into(),
                }],
            },
            Case {
                name: "exhaustion at the top of the port space does not overflow",
                range: PortRange { first: 65535, last: 65535 },
                services: vec![svc("a", Some(1), &[tcp(80), tcp(81)])],
                previous: Allocations::new(),
                want: allocs(&[("a", &[(tcp(80), 65535)])]),
                problems: vec![AllocProblem::Exhausted {
                    service: key("a"),
                    port: tcp(81),
                    range: "range 65535-65535".into(),
                }],
            },
            Case {
                name: "service-ports request (klipper-lb), outside the range",
                range: small(),
                services: vec![{
                    let mut s = svc("dns", Some(1), &[udp(53), tcp(53), tcp(80)]);
                    s.port_request = PortRequest::ServicePorts;
                    s
                }],
                previous: Allocations::new(),
                want: allocs(&[("dns", &[(tcp(53), 53), (udp(53), 53), (tcp(80), 80)])]),
                problems: vec![],
            },
            Case {
                name: "service-ports conflict names the holder",
                range: small(),
                services: vec![
                    {
                        let mut s = svc("a", Some(1), &[tcp(80)]);
                        s.port_request = PortRequest::ServicePorts;
                        s
                    },
                    {
                        let mut s = svc("b", Some(2), &[tcp(80), udp(80)]);
                        s.port_request = PortRequest::ServicePorts;
                        s
                    },
                ],
                previous: Allocations::new(),
                want: allocs(&[("a", &[(tcp(80), 80)])]),
                problems: vec![
                    AllocProblem::Conflict { service: key("b"), port: tcp(80), wanted: 80, holder: key("a") },
                    AllocProblem::Conflict { service: key("b"), port: udp(80), wanted: 80, holder: key("a") },
                ],
            },
            Case {
                name: "explicit outside the range; unlisted ports auto",
                range: small(),
                services: vec![explicit(svc("web", Some(1), &[tcp(80), tcp(443)]), &[(tcp(443), 8443)])],
                previous: Allocations::new(),
                want: allocs(&[("web", &[(tcp(80), 20000), (tcp(443), 8443)])]),
                problems: vec![],
            },
            Case {
                name: "explicit request beats a stale previous number of another port of the same Service",
                range: small(),
                services: vec![explicit(svc("web", Some(1), &[tcp(80), tcp(81)]), &[(tcp(81), 20000)])],
                previous: allocs(&[("web", &[(tcp(80), 20000)])]),
                want: allocs(&[("web", &[(tcp(80), 20001), (tcp(81), 20000)])]),
                problems: vec![],
            },
            Case {
                name: "range change: previous outside the new range moves, explicit stays",
                range: PortRange { first: 21000, last: 21009 },
                services: vec![
                    svc("a", Some(1), &[tcp(80)]),
                    explicit(svc("b", Some(2), &[tcp(80)]), &[(tcp(80), 20005)]),
                    svc("c", Some(3), &[tcp(80)]),
                ],
                previous: allocs(&[
                    ("a", &[(tcp(80), 20001)]),
                    ("b", &[(tcp(80), 20005)]),
                    ("c", &[(tcp(80), 21004)]),
                ]),
                want: allocs(&[
                    ("a", &[(tcp(80), 21000)]),
                    ("b", &[(tcp(80), 20005)]),
                    ("c", &[(tcp(80), 21004)]),
                ]),
                problems: vec![],
            },
            Case {
                name: "annotation wins over the state file; state file is the fallback",
                range: small(),
                services: vec![
                    annotated(svc("a", Some(1), &[tcp(80), tcp(81)]), &[(tcp(80), 20007)]),
                    svc("b", Some(2), &[tcp(80)]),
                ],
                previous: allocs(&[("a", &[(tcp(80), 20002), (tcp(81), 20003)]), ("b", &[(tcp(80), 20007)])]),
                want: allocs(&[("a", &[(tcp(80), 20007), (tcp(81), 20003)]), ("b", &[(tcp(80), 20000)])]),
                problems: vec![],
            },
            Case {
                name: "annotation taken by an older Service: state file number used instead",
                range: small(),
                services: vec![
                    annotated(svc("old", Some(1), &[tcp(80)]), &[(tcp(80), 20001)]),
                    annotated(svc("young", Some(2), &[tcp(80)]), &[(tcp(80), 20001)]),
                ],
                previous: allocs(&[("young", &[(tcp(80), 20006)])]),
                want: allocs(&[("old", &[(tcp(80), 20001)]), ("young", &[(tcp(80), 20006)])]),
                problems: vec![],
            },
        ];
        for case in cases {
            let got = allocate(&case.range, &case.services, &case.previous);
            assert_eq!(got.allocations, case.want, "{}", case.name);
            assert_eq!(got.problems, case.problems, "{}", case.name);
            // Invariant: no number is held by two Services.
            let mut holders: BTreeMap<u16, ServiceKey> = BTreeMap::new();
            for (k, m) in &got.allocations {
                for n in m.values() {
                    if let Some(other) = holders.insert(*n, k.clone()) {
                        assert_eq!(&other, k, "{}: {n} double-allocated", case.name);
                    }
                }
            }
        }
    }

    /// The port policy and listeners: requests outside the allowed ports and on ports in use are
    /// refused with the reason; new ports skip numbers in use; existing allocations stay.
    #[test]
    fn constraints() {
        let policy = PortPolicy {
            ranges: vec![small()],
            allowed: "22,6443,80".parse::<crate::port_policy::PortList>().unwrap().0,
        };
        let in_use: BTreeMap<(Protocol, u16), String> = [
            ((Protocol::Tcp, 22), "sshd".to_string()),
            ((Protocol::Udp, 20000), "dns".to_string()),
            ((Protocol::Tcp, 20003), "web".to_string()),
        ]
        .into();
        let c = Constraints { policy: Some(&policy), in_use: Some(&in_use), ..Default::default() };
        let service = |s: LbService| {
            let mut s = s;
            s.port_request = PortRequest::ServicePorts;
            s
        };
        let services = vec![
            service(svc("ssh", Some(1), &[tcp(22)])),
            service(svc("kube", Some(2), &[tcp(6443), tcp(10250)])),
            explicit(svc("dns", Some(3), &[udp(53), tcp(53)]), &[(udp(53), 20000), (tcp(53), 20000)]),
            svc("auto", Some(4), &[tcp(80), udp(81)]),
            svc("kept", Some(5), &[tcp(80)]),
            explicit(svc("gone", Some(6), &[tcp(80)]), &[(tcp(80), 8080)]),
        ];
        let previous = allocs(&[("kept", &[(tcp(80), 20003)]), ("gone", &[(tcp(80), 8080)])]);
        let got = allocate_with(&small(), &services, &previous, c);
        assert_eq!(
            got.allocations,
            allocs(&[
                ("kube", &[(tcp(6443), 6443)]),
                ("dns", &[(tcp(53), 20000)]),
                ("auto", &[(tcp(80), 20001), (udp(81), 20002)]),
                ("kept", &[(tcp(80), 20003)]),
            ])
        );
        let msgs: Vec<String> = got.problems.iter().map(ToString::to_string).collect();
        assert_eq!(
            msgs,
            vec![
                "Service default/ssh: port 22/TCP asks for node port 22/TCP, which is in use: sshd",
                "Service default/kube: port 10250/TCP asks for node port 10250, which is not allowed (allowed: --port-range 20000-20009 or --allowed-node-ports 22,6443,80)",
                "Service default/dns: port 53/UDP asks for node port 20000/UDP, which is in use: dns",
                "Service default/gone: port 80/TCP asks for node port 8080, which is not allowed (allowed: --port-range 20000-20009 or --allowed-node-ports 22,6443,80)",
            ]
        );
        // Without constraints (the order rules alone), every request is taken.
        assert_eq!(allocate(&small(), &services, &previous).problems, vec![]);
    }

    #[test]
    fn stable_across_reordering_and_restart() {
        let services = vec![
            svc("a", Some(3), &[tcp(80), udp(53)]),
            svc("b", Some(1), &[tcp(80)]),
            svc("c", None, &[tcp(443)]),
            explicit(svc("d", Some(2), &[tcp(80)]), &[(tcp(80), 8080)]),
        ];
        let first = allocate(&small(), &services, &Allocations::new());
        let mut reversed = services.clone();
        reversed.reverse();
        assert_eq!(allocate(&small(), &reversed, &Allocations::new()), first);
        // Restart with the state file: identical. Then a Service goes away: the others keep theirs.
        assert_eq!(allocate(&small(), &reversed, &first.allocations), first);
        let without_b: Vec<LbService> = services.iter().filter(|s| s.key != key("b")).cloned().collect();
        let after = allocate(&small(), &without_b, &first.allocations);
        for (k, m) in &after.allocations {
            assert_eq!(Some(m), first.allocations.get(k), "{k} moved");
        }
        assert!(!after.allocations.contains_key(&key("b")));
        assert_eq!(after.used_in(&small()), first.used_in(&small()) - 1);
    }

    #[test]
    fn ranges() {
        assert_eq!("20000-29999".parse::<PortRange>(), Ok(PortRange::default()));
        assert_eq!(" 1 - 2 ".parse::<PortRange>(), Ok(PortRange { first: 1, last: 2 }));
        for bad in ["", "20000", "0-10", "10-0", "5-4", "a-b", "1-70000", "-5"] {
            assert!(bad.parse::<PortRange>().is_err(), "{bad}");
        }
        assert!(PortRange::new(5, 4).is_err());
        assert!(PortRange::new(0, 4).is_err());
        assert_eq!(PortRange::default().len(), 10000);
        assert!(PortRange::default().warnings().is_empty());
        assert_eq!(PortRange { first: 29000, last: 33000 }.warnings().len(), 2);
        assert_eq!(PortRange { first: 80, last: 90 }.warnings().len(), 1);
        let p = AllocProblem::Conflict { service: key("b"), port: tcp(80), wanted: 80, holder: key("a") };
        assert_eq!(
            p.to_string(),
            "Service default/b: port 80/TCP asks for node port 80, which Service default/a holds"
        );
    }

    #[test]
    fn pools_allocate_from_their_own_ranges() {
        let r = |a: u16, b: u16| PortRange { first: a, last: b };
        let pool = |name: &str, keep: Vec<PortRange>, take: Vec<PortRange>| PoolRanges {
            pool: name.into(),
            keep,
            take,
            requestable: vec![],
            per_namespace: None,
            service_ports: false,
        };
        let pools: BTreeMap<ServiceKey, PoolRanges> = [
            ("new-a", pool("a", vec![r(21000, 21009)], vec![r(21000, 21009)])),
            // Two pools on disjoint nodes with the same range: numbers stay unique.
            ("new-b", pool("b", vec![r(21000, 21009)], vec![r(21000, 21009)])),
            // Range shrunk to 22005-22009: 22001 is reallocated, 22006 stays.
            ("shrunk-out", pool("s", vec![r(22005, 22009)], vec![r(22005, 22009)])),
            ("shrunk-in", pool("s", vec![r(22005, 22009)], vec![r(22005, 22009)])),
            // The newer pool of a conflict keeps a number in the overlap, takes new ones outside.
            ("conflicted", pool("c", vec![r(21005, 21020)], vec![r(21010, 21020)])),
            // Disabled (drain): keeps, takes nothing.
            ("drain-kept", pool("d", vec![r(23000, 23009)], vec![])),
            ("drain-new", pool("d", vec![r(23000, 23009)], vec![])),
            ("explicit", pool("e", vec![r(24000, 24009)], vec![r(24000, 24009)])),
            // Its pool lets its Services ask for 80 and 443 by number.
            (
                "requestable",
                PoolRanges {
                    requestable: vec![r(80, 80), r(443, 443)],
                    ..pool("w", vec![r(25000, 25009)], vec![])
                },
            ),
        ]
        .into_iter()
        .map(|(n, p)| (key(n), p))
        .collect();
        let services = vec![
            svc("new-a", Some(1), &[tcp(80)]),
            svc("new-b", Some(2), &[tcp(80)]),
            annotated(svc("shrunk-out", Some(3), &[tcp(80)]), &[(tcp(80), 22001)]),
            annotated(svc("shrunk-in", Some(4), &[tcp(80)]), &[(tcp(80), 22006)]),
            annotated(svc("conflicted", Some(5), &[tcp(80), tcp(81)]), &[(tcp(80), 21007)]),
            annotated(svc("drain-kept", Some(6), &[tcp(80)]), &[(tcp(80), 23004)]),
            svc("drain-new", Some(7), &[tcp(80)]),
            explicit(svc("explicit", Some(8), &[tcp(80)]), &[(tcp(80), 80)]),
            explicit(svc("requestable", Some(9), &[tcp(80), tcp(8443)]), &[(tcp(80), 80), (tcp(8443), 8443)]),
        ];
        // `--allowed-node-ports` is everyone's: with pool objects, only a pool's
        // requestablePorts let its Services out of its ranges.
        let policy = PortPolicy { allowed: vec![r(80, 80), r(8443, 8443)], ..PortPolicy::default() };
        let c = Constraints { policy: Some(&policy), pools: Some(&pools), ..Default::default() };
        let got = allocate_with(&PortRange::default(), &services, &Allocations::new(), c);
        let want = allocs(&[
            ("new-a", &[(tcp(80), 21000)]),
            ("new-b", &[(tcp(80), 21001)]),
            ("shrunk-out", &[(tcp(80), 22005)]),
            ("shrunk-in", &[(tcp(80), 22006)]),
            ("conflicted", &[(tcp(80), 21007), (tcp(81), 21010)]),
            ("drain-kept", &[(tcp(80), 23004)]),
            ("requestable", &[(tcp(80), 80)]),
        ]);
        assert_eq!(got.allocations, want);
        let problems: Vec<String> = got.problems.iter().map(|p| p.to_string()).collect();
        assert_eq!(
            problems,
            vec![
                "Service default/explicit: port 80/TCP asks for node port 80, which is not allowed (allowed: pool e 24000-24009)",
                "Service default/requestable: port 8443/TCP asks for node port 8443, which is not allowed (allowed: pool w 25000-25009 or its requestablePorts 80,443)",
                "Service default/drain-new: port 80/TCP: no free node port left in pool d (disabled, or all its ranges are another pool's)",
            ]
        );
    }

    /// A pool bounding what one namespace holds: new numbers stop at the bound (per namespace,
    /// a number counted once whatever its protocols), what is held above it stays, and a
    /// Service with more ports than the bound gets none.
    #[test]
    fn a_namespace_holds_at_most_its_pools_bound() {
        let r = |a: u16, b: u16| PortRange { first: a, last: b };
        let in_ns = |ns: &str, name: &str, age: u32, ports: &[PortId]| {
            let mut s = svc(name, Some(age), ports);
            s.key = ServiceKey::new(ns, name);
            s
        };
        let bounded = PoolRanges {
            pool: "shared".into(),
            keep: vec![r(21000, 21099)],
            take: vec![r(21000, 21099)],
            requestable: vec![],
            per_namespace: Some(2),
            service_ports: false,
        };
        let services = vec![
            in_ns("a", "dns", 1, &[tcp(53), udp(53)]),
            in_ns("a", "web", 2, &[tcp(80)]),
            in_ns("a", "third", 3, &[tcp(80)]),
            in_ns("b", "web", 4, &[tcp(80)]),
            in_ns("b", "big", 5, &[tcp(1), tcp(2), tcp(3)]),
            // Held before the bound was set: kept, but nothing new.
            annotated(
                in_ns("c", "old", 6, &[tcp(1), tcp(2), tcp(3), tcp(4)]),
                &[(tcp(1), 21050), (tcp(2), 21051), (tcp(3), 21052)],
            ),
        ];
        let pools: BTreeMap<ServiceKey, PoolRanges> =
            services.iter().map(|s| (s.key.clone(), bounded.clone())).collect();
        let c = Constraints { pools: Some(&pools), ..Default::default() };
        let got = allocate_with(&PortRange::default(), &services, &Allocations::new(), c);
        let numbers = |ns: &str, name: &str| -> Vec<u16> {
            got.allocations
                .get(&ServiceKey::new(ns, name))
                .map(|m| m.values().copied().collect())
                .unwrap_or_default()
        };
        assert_eq!(numbers("a", "dns"), [21000, 21000], "one number for both protocols counts once");
        assert_eq!(numbers("a", "web"), [21001]);
        assert_eq!(numbers("a", "third"), Vec::<u16>::new(), "namespace a is at its bound");
        assert_eq!(numbers("b", "web"), [21002], "another namespace has its own bound");
        assert_eq!(numbers("b", "big"), Vec::<u16>::new(), "more ports than the bound: none");
        assert_eq!(numbers("c", "old"), [21050, 21051, 21052], "held above the bound: kept");
        let problems: Vec<String> = got.problems.iter().map(|p| p.to_string()).collect();
        assert!(
            problems.contains(&"Service c/old: port 4/TCP: no new node port: the Service has 4 ports, more than one namespace may hold (pool shared's maxPortsPerNamespace is 2)".to_string()),
            "{problems:#?}"
        );
        assert!(
            problems.contains(&"Service a/third: port 80/TCP: no new node port: namespace a holds 2 node ports of it (pool shared's maxPortsPerNamespace is 2)".to_string()),
            "{problems:#?}"
        );
        assert_eq!(problems.iter().filter(|p| p.starts_with("Service b/big")).count(), 3, "{problems:#?}");
    }

    /// A pool in `portMode: ServicePort` serves each service port on its own number, with no
    /// annotation: inside what the pool permits, never a number another Service holds, the
    /// Service's own `nodelb.io/ports` first; a listener refuses it only where it listens.
    #[test]
    fn a_service_port_pool_serves_each_port_on_its_own_number() {
        let r = |a: u16, b: u16| PortRange { first: a, last: b };
        let edge = PoolRanges {
            pool: "edge".into(),
            keep: vec![r(80, 80), r(443, 443)],
            take: vec![r(80, 80), r(443, 443)],
            requestable: vec![r(8443, 8443)],
            per_namespace: None,
            service_ports: true,
        };
        let services = vec![
            svc("traefik", Some(1), &[tcp(80), tcp(443), udp(443)]),
            svc("second", Some(2), &[tcp(443)]),
            svc("admin", Some(3), &[tcp(8443), tcp(9000)]),
            explicit(svc("asks", Some(4), &[tcp(80)]), &[(tcp(80), 8443)]),
        ];
        let pools: BTreeMap<ServiceKey, PoolRanges> =
            services.iter().map(|s| (s.key.clone(), edge.clone())).collect();
        // A node listens on 443/TCP and 8443/TCP: the pool's numbers are held anyway (the
        // nodes with the listener do not program them); an explicit request is refused.
        let in_use = BTreeMap::from([
            ((Protocol::Tcp, 443), "node-2".to_string()),
            ((Protocol::Tcp, 8443), "node-3".to_string()),
        ]);
        let c = Constraints { pools: Some(&pools), in_use: Some(&in_use), ..Default::default() };
        let got = allocate_with(&PortRange::default(), &services, &Allocations::new(), c);
        let want = allocs(&[
            ("traefik", &[(tcp(80), 80), (tcp(443), 443), (udp(443), 443)]),
            ("admin", &[(tcp(8443), 8443)]),
        ]);
        assert_eq!(got.allocations, want);
        let problems: Vec<String> = got.problems.iter().map(|p| p.to_string()).collect();
        assert_eq!(
            problems,
            vec![
                "Service default/second: port 443/TCP asks for node port 443, which Service default/traefik holds",
                "Service default/admin: port 9000/TCP asks for node port 9000, which is not allowed (allowed: pool edge 80,443 or its requestablePorts 8443)",
                "Service default/asks: port 80/TCP asks for node port 8443/TCP, which is in use: node-3",
            ]
        );
    }

    #[test]
    fn moved_ports_are_the_numbers_that_changed() {
        let key = |n: &str| ServiceKey::new("default", n);
        let port = |p: u16| PortId { port: p, protocol: crate::domain::Protocol::Tcp };
        let map = |e: &[(&str, u16, u16)]| {
            let mut m = Allocations::new();
            for (n, p, np) in e {
                m.entry(key(n)).or_default().insert(port(*p), *np);
            }
            m
        };
        let before = map(&[("web", 80, 20001), ("web", 443, 20002), ("dns", 53, 20003), ("gone", 1, 20004)]);
        let after = map(&[("web", 80, 21001), ("web", 443, 20002), ("new", 8, 20005), ("dns", 54, 20003)]);
        let got: Vec<_> = moved(&before, &after)
            .into_iter()
            .map(|(k, id, a, b)| (k.name.to_string(), id.port, a, b))
            .collect();
        assert_eq!(got, [("web".to_string(), 80, 20001, 21001)]);
    }
}
