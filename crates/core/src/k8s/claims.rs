//! The node-port registry: which Service holds which node port number, the one place every
//! leader must change (with a resourceVersion precondition) before it writes a number on a
//! Service. Pure: the controller reads and writes it ([`super::controller`]).
//!
//! Why: two agents can both act as leader for a moment (a leader paused past its Lease and
//! resumed, a Lease stolen), each with its own view of the Services. The allocation annotations
//! are one object per Service, so a resourceVersion precondition on each Service write stops a
//! stale leader from overwriting a Service that changed, but not from giving a number that looks
//! free in its view to one Service while the other leader gives it to another: two writes to two
//! objects, both preconditions hold, and the number is held twice. Kubernetes allocates
//! NodePorts and ClusterIPs the same way it is done here: through one object updated with
//! compare-and-swap (a `RangeAllocation`).
//!
//! The registry is a set of Leases `nodelb-node-ports-<block>` in the agent namespace, one per
//! block of 8,192 numbers (so one annotation stays well under the API's 256 KiB), labelled
//! [`LABEL`]. Annotation [`ANNOTATION`] lists the claims: `20001=0a1b2c3d4e5f` (the first 12
//! hex digits of the holding Service's uid), with `+token` while a leader is adding that number
//! to the Service's annotation and `-token` while it is removing it (`token` names that leader's
//! process); a number Services on disjoint pools share lists each holder (`record.rs`). The
//! rules:
//! - A number is written on a Service only after a claim naming the Service was written to the
//!   registry with the resourceVersion read in the same round: of two leaders that both saw the
//!   number free, the second's registry write fails (409) and it writes no Service.
//! - A number another Service claims, or one being added or removed, is never handed out; a
//!   request for it is refused as in use until it is free.
//! - A number leaves the registry only when it is known free: its Service's deletion was seen
//!   (present in an earlier view, absent now), or the leader's own write removed it from the
//!   Service. A claim nobody resolves (a leader that crashed mid-round, a number a human removed
//!   from an annotation) is left alone for [`GRACE`], observed unchanged while the Service watch
//!   works; then a pending one counts as held, and a held one whose Service does not hold the
//!   number is dropped. A number is never freed on a guess, so a claim can only be too careful.
//! - **The registry is the record; the annotation is a copy.** Any Service owner may edit their
//!   own Service's annotation, so an annotation naming a number the registry gives another
//!   Service is never believed: that Service loses the number (nodes never program it for it,
//!   [`Registry::holds`]), whatever the two Services' ages, and its annotation is written again
//!   from the record (its own numbers back, [`Screen::apply`]). A serving Service therefore never
//!   loses its number because of another Service's edit.
//! - A number a Service's annotation holds without a claim (the registry lost with its
//!   namespace, a re-install) is a request for that number: claimed for it when the allocator
//!   keeps it (in its range), of two the older; nodes program it once the claim is written.

use std::borrow::Borrow;
use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::Service;
use k8s_openapi::jiff::Timestamp;

use crate::decisions::sharing::Sharing;
pub use crate::domain::Owner;
use crate::domain::Protocol;
use crate::domain::ServiceKey;
use crate::incremental::view::{self, ServiceFacts, SourceView};
use crate::inputs::compact::EndpointSlice;
use crate::inputs::model::{self, LbService};

mod record;
pub use record::{Claim, Claims, Holds, State, Token, format, parse};

/// Name prefix of the registry Leases (`nodelb-node-ports-2` holds 16384–24575).
pub const LEASE_PREFIX: &str = "nodelb-node-ports-";
/// Label on every registry Lease (listed by it).
pub const LABEL: &str = "nodelb.io/node-port-claims";
/// Annotation holding a block's claims.
pub const ANNOTATION: &str = "nodelb.io/claims";
/// Numbers per registry Lease.
pub const BLOCK_SIZE: u32 = 8192;
/// How long a claim nobody resolves is left alone (see the module documentation).
pub const GRACE: Duration = Duration::from_secs(60);

pub fn block_of(number: u16) -> u16 {
    (u32::from(number) / BLOCK_SIZE) as u16
}

pub fn lease_name(block: u16) -> String {
    format!("{LEASE_PREFIX}{block}")
}

/// A Service as the registry sees it: every Service of the view, whatever its type (one that
/// stopped being ours holds its numbers until the leader takes them off), with every number its
/// annotation names as stored ([`model::annotated_numbers`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Holder {
    pub key: ServiceKey,
    pub owner: Owner,
    /// creationTimestamp (`None`: counts as the youngest), for "the older keeps it".
    pub created: Option<Timestamp>,
    pub numbers: BTreeSet<u16>,
}

impl Holder {
    pub fn of(svc: &Service) -> Holder {
        let key = model::service_key(svc);
        // Every number a node may program from the annotation (an entry without a protocol, a
        // port listed twice): held, and what ties this Service to another's in a scoped round.
        let numbers = model::allocated_annotation(svc)
            .map(|v| model::annotated_numbers(v).into_iter().collect())
            .unwrap_or_default();
        Holder {
            owner: Owner::of(&key, svc.metadata.uid.as_deref()),
            created: svc.metadata.creation_timestamp.as_ref().map(|t| t.0),
            numbers,
            key,
        }
    }

    /// Oldest first: creationTimestamp, then namespace/name (the allocator's order).
    fn older_first(a: &Holder, b: &Holder) -> std::cmp::Ordering {
        (a.created.is_none(), a.created, &a.key).cmp(&(b.created.is_none(), b.created, &b.key))
    }
}

/// A Service's registry holder is what the leader's view keeps of each Service object.
impl ServiceFacts for Arc<Holder> {
    fn of(service: &Service) -> Self {
        Arc::new(Holder::of(service))
    }

    fn numbers(&self) -> impl Iterator<Item = u16> + '_ {
        self.numbers.iter().copied()
    }
}

/// What changed between two views of the Services and their EndpointSlices, with each Service
/// object's holder.
pub type ViewChanges = view::ViewChanges<Arc<Holder>>;

/// The leader's view ([`SourceView`]: each Service's [`Holder`], built once per object version,
/// and what changed since the last round, by object), and who holds each number in it: a round
/// needs the holder of every Service, and building one (the key, the owner, the annotation
/// parsed) for every Service each round would be a share of the agent's CPU linear in the
/// Services during creates. The leader's round is scoped to what changed ([`Holders::changes`]).
#[derive(Debug)]
pub struct Holders {
    view: SourceView<Arc<Holder>>,
    changes: ViewChanges,
    /// Who holds each number in the last view (patched by the changes).
    held: HeldIndex,
}

impl Default for Holders {
    fn default() -> Self {
        Holders {
            view: SourceView::every_version(),
            changes: ViewChanges::default(),
            held: HeldIndex::default(),
        }
    }
}

/// Whether a Service new to the view names a number the registry gives another Service (one
/// not `gone`): an annotation the leader did not write.
pub fn name_anothers(changes: &ViewChanges, registry: &Registry, gone: &BTreeSet<Owner>) -> bool {
    changes.added.iter().any(|h| {
        h.numbers.iter().any(|n| {
            registry
                .get(*n)
                .is_some_and(|c| c.of(&h.owner).is_none() && c.owners().any(|o| !gone.contains(o)))
        })
    })
}

impl Holders {
    /// Passes over a view of the Services and their EndpointSlices (what the view does not hold
    /// any more is forgotten).
    pub fn pass(&mut self, services: &[Arc<Service>], slices: &[Arc<EndpointSlice>]) {
        self.changes = self.view.pass(services, slices);
        for (_, holder) in &self.changes.dropped {
            self.held.remove(holder);
        }
        for holder in &self.changes.added {
            self.held.add(holder);
        }
    }

    /// Who holds each number in the last view.
    pub fn held(&self) -> HeldNumbers<'_> {
        HeldNumbers(std::borrow::Cow::Borrowed(&self.held))
    }

    /// The holder of `object`, if the last view held it.
    pub fn of_object(&self, object: &Arc<Service>) -> Option<&Arc<Holder>> {
        self.view.facts(object)
    }

    /// The object of `key` in the last view, and its holder.
    pub fn of_key(&self, key: &ServiceKey) -> Option<(&Arc<Service>, &Arc<Holder>)> {
        self.view.facts_of(key).next()
    }

    /// The Service objects of `keys` in the last view, and their EndpointSlices.
    pub fn objects_of<'a>(
        &self,
        keys: impl IntoIterator<Item = &'a ServiceKey>,
    ) -> (Vec<Arc<Service>>, Vec<Arc<EndpointSlice>>) {
        self.view.objects_of(keys)
    }

    /// What changed between the view of the last [`Holders::pass`] and the one before.
    pub fn changes(&self) -> &ViewChanges {
        &self.changes
    }

    /// The numbers whose holders changed (those the added and the dropped holders name), or
    /// `None` for a first view.
    pub fn changed_numbers(&self) -> Option<&BTreeSet<u16>> {
        (!self.changes.first).then_some(&self.changes.numbers)
    }
}

/// One registry Lease as read.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Block {
    /// Shared: a read keeps the claims of every block at the version it already parsed, and a
    /// node's snapshot shares them with its source.
    pub claims: Arc<Claims>,
    /// `None`: the Lease does not exist yet (it is created).
    pub resource_version: Option<String>,
}

/// Every registry Lease, by block.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Registry {
    pub blocks: BTreeMap<u16, Block>,
}

impl Registry {
    /// Who holds `number`.
    pub fn get(&self, number: u16) -> Option<&Holds> {
        self.blocks.get(&block_of(number))?.claims.get(&number)
    }

    /// Every claim, by number (a shared number once per holder).
    pub fn iter(&self) -> impl Iterator<Item = (u16, &Claim)> {
        self.blocks.values().flat_map(|b| b.claims.iter().flat_map(|(n, h)| h.iter().map(|c| (*n, c))))
    }

    /// Each block's resourceVersion (`None`: the block did not exist when read).
    pub fn versions(&self) -> BTreeMap<u16, Option<String>> {
        self.blocks.iter().map(|(b, block)| (*b, block.resource_version.clone())).collect()
    }
}

impl Registry {
    /// Whether `number` belongs to the Service `owner`: it has a claim on it, in any state (a
    /// claim being added names the Service the leader is writing it on; one being removed is
    /// still that Service's until the write is seen). What every node programs by: a node port
    /// is programmed for a Service only when the registry names it here.
    pub fn holds(&self, number: u16, owner: &Owner) -> bool {
        self.get(number).is_some_and(|h| h.of(owner).is_some())
    }

    /// Whether any Service claims `number`.
    pub fn claimed(&self, number: u16) -> bool {
        self.get(number).is_some()
    }

    /// The numbers whose holders ([`Registry::holds`]) differ between `self` and `before` (a
    /// block read at the same resourceVersion holds the same claims and is not compared).
    pub fn owners_changed(&self, before: &Registry) -> Vec<u16> {
        let mut out = Vec::new();
        let blocks: BTreeSet<u16> = self.blocks.keys().chain(before.blocks.keys()).copied().collect();
        let empty = Claims::new();
        for b in blocks {
            let (now, was) = (self.blocks.get(&b), before.blocks.get(&b));
            if let (Some(now), Some(was)) = (now, was)
                && now.resource_version.is_some()
                && now.resource_version == was.resource_version
            {
                continue;
            }
            let now = now.map_or(&empty, |x| &x.claims);
            let was = was.map_or(&empty, |x| &x.claims);
            let numbers: BTreeSet<u16> = now.keys().chain(was.keys()).copied().collect();
            let owners = |c: &Claims, n: &u16| c.get(n).map(|h| h.owners().cloned().collect::<BTreeSet<_>>());
            out.extend(numbers.into_iter().filter(|n| owners(now, n) != owners(was, n)));
        }
        out
    }
}

/// The registry as read from its Leases, each block with the problems of its parse, so that a
/// block read again at the same resourceVersion is taken as it was (a round writes a block or
/// two; parsing every claim again would be most of a read), by the leader's list and by each
/// node's cache alike.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ReadRegistry {
    pub registry: Registry,
    problems: BTreeMap<u16, Vec<String>>,
}

impl ReadRegistry {
    /// Every block among `leases` (the Leases labelled [`LABEL`]); `kept`: the last read. The
    /// problems found (a Lease labelled as a block that is none, entries that cannot be read).
    pub fn read<L: Borrow<k8s_openapi::api::coordination::v1::Lease>>(
        leases: &[L],
        kept: Option<ReadRegistry>,
    ) -> (ReadRegistry, Vec<String>) {
        let mut kept = kept.unwrap_or_default();
        let mut read = ReadRegistry::default();
        let mut problems = Vec::new();
        for lease in leases.iter().map(Borrow::borrow) {
            let name = lease.metadata.name.as_deref().unwrap_or_default();
            let Some(block) = name.strip_prefix(LEASE_PREFIX).and_then(|b| b.parse::<u16>().ok()) else {
                problems.push(format!("Lease {name} is labelled {LABEL} but is not a registry block"));
                continue;
            };
            let resource_version = lease.metadata.resource_version.clone();
            let (parsed, p) = match kept.registry.blocks.remove(&block) {
                Some(b) if b.resource_version == resource_version && resource_version.is_some() => {
                    (b.claims, kept.problems.remove(&block).unwrap_or_default())
                }
                _ => {
                    let value = lease.metadata.annotations.as_ref().and_then(|a| a.get(ANNOTATION));
                    let (claims, p) = parse(value.map_or("", String::as_str));
                    (Arc::new(claims), p.into_iter().map(|p| format!("Lease {name}: {p}")).collect())
                }
            };
            problems.extend(p.iter().cloned());
            read.problems.insert(block, p);
            read.registry.blocks.insert(block, Block { claims: parsed, resource_version });
        }
        (read, problems)
    }

    /// Puts back the blocks `before` had that this read lost (their Lease deleted: nodelb never
    /// deletes one, so an administrator or a tool did), as they were but with no resourceVersion:
    /// the record of who holds what is not lost with its Lease. A node keeps programming by them;
    /// the leader writes them again ([`plan`] creates a block that has claims and no version).
    /// Returns the blocks put back.
    pub fn keep_lost(&mut self, before: &ReadRegistry) -> Vec<u16> {
        let mut lost = Vec::new();
        for (b, block) in &before.registry.blocks {
            if !self.registry.blocks.contains_key(b) && !block.claims.is_empty() {
                let ghost = Block { claims: Arc::clone(&block.claims), resource_version: None };
                self.registry.blocks.insert(*b, ghost);
                lost.push(*b);
            }
        }
        lost
    }
}

/// What the registry lets each Service keep, before the allocator runs.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Screened {
    /// Numbers nobody may be given (claimed, and not held in this view by their claimant), for
    /// every protocol, with why: [`crate::decisions::alloc::Constraints::in_use`].
    pub in_use: BTreeMap<(Protocol, u16), String>,
    /// Numbers taken off a Service's annotation because another Service claims them.
    pub lost: Vec<(ServiceKey, u16)>,
}

/// Who holds each number of a view, oldest first, read by [`screen`] and [`plan`]: kept by
/// [`Holders`] from one view to the next (patched by what changed: building it for every round
/// would cost every leader's round time linear in the Services, and be most of a scoped one), or
/// built for a list of holders ([`HeldNumbers::of`]).
pub struct HeldNumbers<'h>(std::borrow::Cow<'h, HeldIndex>);

/// The map behind [`HeldNumbers`].
#[derive(Debug, Clone, Default)]
pub struct HeldIndex(BTreeMap<u16, Vec<Arc<Holder>>>);

impl HeldIndex {
    fn add(&mut self, holder: &Arc<Holder>) {
        for n in &holder.numbers {
            let hs = self.0.entry(*n).or_default();
            // Only a number held twice needs ordering.
            let at = hs.partition_point(|h| Holder::older_first(h, holder) != std::cmp::Ordering::Greater);
            hs.insert(at, Arc::clone(holder));
        }
    }

    fn remove(&mut self, holder: &Arc<Holder>) {
        for n in &holder.numbers {
            if let Some(hs) = self.0.get_mut(n) {
                hs.retain(|h| !Arc::ptr_eq(h, holder));
                if hs.is_empty() {
                    self.0.remove(n);
                }
            }
        }
    }
}

impl<'h> HeldNumbers<'h> {
    /// The Services whose annotation names `number`, oldest first.
    pub fn holders_of(&self, number: u16) -> &[Arc<Holder>] {
        self.0.0.get(&number).map_or(&[], Vec::as_slice)
    }

    /// Built for `holders` (a copy of each: for one-off callers; a leader's rounds read the
    /// index [`Holders`] keeps).
    pub fn of<H: Borrow<Holder>>(holders: &[H]) -> HeldNumbers<'h> {
        let mut out = HeldIndex::default();
        for h in holders.iter().map(Borrow::borrow) {
            out.add(&Arc::new(h.clone()));
        }
        HeldNumbers(std::borrow::Cow::Owned(out))
    }

    fn by_number(&self) -> &BTreeMap<u16, Vec<Arc<Holder>>> {
        &self.0.0
    }
}

/// Takes off each Service's `previous_allocation` the numbers another Service claims (claims of
/// `gone` owners do not count), gives it back its own, and lists what nobody may be given.
pub fn screen(
    services: &mut [Arc<LbService>],
    held: &HeldNumbers<'_>,
    registry: &Registry,
    gone: &BTreeSet<Owner>,
) -> Screened {
    let screen = Screen::of(held, registry, gone);
    let lost = screen.apply(services);
    Screened { in_use: screen.in_use, lost }
}

/// [`screen`] in two steps: what the registry decides for the view (who loses which numbers,
/// what nobody may be given), then applied to the models of the Services a round plans.
pub struct Screen<'h> {
    lose: BTreeMap<&'h ServiceKey, BTreeSet<u16>>,
    /// Per Service that loses a number, the numbers the registry gives it that its annotation no
    /// longer names (a forged annotation replaced them), lowest first: what it gets back.
    own: BTreeMap<&'h ServiceKey, Vec<u16>>,
    /// As [`Screened::in_use`].
    pub in_use: BTreeMap<(Protocol, u16), String>,
}

impl<'h> Screen<'h> {
    pub fn of(held: &'h HeldNumbers<'_>, registry: &Registry, gone: &BTreeSet<Owner>) -> Screen<'h> {
        Screen::within(held, registry, gone, None)
    }

    /// [`Screen::of`] for a scoped round: who loses which of `numbers` (the numbers the scope's
    /// Services hold). Nothing is in use then: a scoped round runs only when every claim names a
    /// Service that holds its number, or a deleted one. A forged annotation and its holder's
    /// victim are in the scope (they name one number; the forger is unsettled until repaired).
    pub fn within(
        held: &'h HeldNumbers<'_>,
        registry: &Registry,
        gone: &BTreeSet<Owner>,
        numbers: Option<&BTreeSet<u16>>,
    ) -> Screen<'h> {
        let by_number = held.by_number();
        let mut lose: BTreeMap<&ServiceKey, BTreeSet<u16>> = BTreeMap::new();
        let mut losers: BTreeMap<&Owner, &'h Holder> = BTreeMap::new();
        let looked_at: Box<dyn Iterator<Item = (&u16, &Vec<Arc<Holder>>)>> = match numbers {
            None => Box::new(by_number.iter()),
            Some(only) => Box::new(only.iter().filter_map(|n| by_number.get_key_value(n))),
        };
        for (n, hs) in looked_at {
            let Some(c) = registry.get(*n).filter(|c| c.owners().any(|o| !gone.contains(o))) else {
                continue;
            };
            // Only a claimant may hold it, whatever the ages: another Service's annotation
            // naming it was written by someone else than the leader.
            for h in hs.iter().filter(|h| c.of(&h.owner).is_none()) {
                lose.entry(&h.key).or_default().insert(*n);
                losers.insert(&h.owner, h);
            }
        }
        let mut own: BTreeMap<&ServiceKey, Vec<u16>> = BTreeMap::new();
        if !losers.is_empty() {
            for (n, c) in registry.iter() {
                if let Some(h) = losers.get(&c.owner)
                    && c.state == State::Held
                    && !h.numbers.contains(&n)
                {
                    own.entry(&h.key).or_default().push(n);
                }
            }
        }
        let mut in_use = BTreeMap::new();
        for (n, c) in registry.iter().filter(|_| numbers.is_none()) {
            if gone.contains(&c.owner) {
                continue;
            }
            let held_by_claimant = by_number.get(&n).is_some_and(|hs| hs.iter().any(|h| h.owner == c.owner));
            if held_by_claimant && c.state == State::Held {
                continue;
            }
            // A claimant holding a pending number keeps it (the allocator keeps what exists);
            // nobody else may be given it.
            let why = match &c.state {
                State::Held => "claimed by a Service that does not hold it in this view (being released)",
                State::Adding(_) => "being given to a Service by a leader",
                State::Removing(_) => "being released by a leader",
            };
            for p in [Protocol::Tcp, Protocol::Udp, Protocol::Sctp] {
                in_use
                    .insert((p, n), format!("{why} (node-port registry, Lease {})", lease_name(block_of(n))));
            }
        }
        Screen { lose, own, in_use }
    }

    /// Takes the numbers off the models of `services` that lose them, and gives each the numbers
    /// the registry records for it that its annotation dropped (the annotation written again
    /// from the record: the lowest lost number gets the lowest of its own, and so on, so ports
    /// that shared a number share its replacement); returns what each lost.
    pub fn apply(&self, services: &mut [Arc<LbService>]) -> Vec<(ServiceKey, u16)> {
        let mut lost = Vec::new();
        if self.lose.is_empty() {
            return lost;
        }
        for svc in services.iter_mut() {
            if let Some(ns) = self.lose.get(&svc.key) {
                let back: BTreeMap<u16, u16> = match self.own.get(&svc.key) {
                    Some(own) => ns.iter().copied().zip(own.iter().copied()).collect(),
                    None => BTreeMap::new(),
                };
                // A copy of the (shared) model, for the few that lose a number.
                let previous = &mut Arc::make_mut(svc).previous_allocation;
                previous.retain(|_, n| !ns.contains(n) || back.contains_key(n));
                for n in previous.values_mut() {
                    if let Some(own) = back.get(n) {
                        *n = *own;
                    }
                }
                lost.extend(ns.iter().map(|n| (svc.key.clone(), *n)));
            }
        }
        lost
    }

    /// The Services that lose a number, each with the numbers it loses.
    pub fn losing(&self) -> impl Iterator<Item = (&ServiceKey, &BTreeSet<u16>)> {
        self.lose.iter().map(|(k, ns)| (*k, ns))
    }
}

/// How the write of one Service ended, for [`resolve`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// Accepted: the Service now holds exactly what was written.
    Written,
    /// Refused (409, or another 4xx that says the request was not carried out): the Service is
    /// as it was.
    Refused,
    /// No answer (timeout, connection lost): it may or may not hold it.
    Unknown,
}

/// The registry changes of one Service's write.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ServiceClaims {
    pub owner: Owner,
    /// Numbers the write adds, each with the claim it had before (`None`: it had none).
    pub adds: Vec<(u16, Option<Claim>)>,
    /// Numbers the write removes that the Service claimed.
    pub removes: Vec<u16>,
}

/// The registry side of one round.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ClaimPlan {
    /// New content of each block that changes, written (resourceVersion precondition) before any
    /// Service write; `Block::resource_version` is the one read.
    pub blocks: BTreeMap<u16, Block>,
    /// Per Service written, what to resolve after its write ([`resolve`]).
    pub services: BTreeMap<ServiceKey, ServiceClaims>,
    /// Service writes that would add a number that is not free now: left out of this round.
    pub blocked: BTreeSet<ServiceKey>,
}

/// One planned annotation write: the Service and the numbers it will hold.
pub struct AnnotationChange<'a> {
    pub holder: &'a Holder,
    pub after: BTreeSet<u16>,
}

/// Which numbers a round's [`plan`] looks at.
#[derive(Debug, Clone, Copy)]
pub enum ClaimScope<'a> {
    /// A whole round's: every number held; `expired`: the claims unresolved for [`GRACE`], which
    /// are settled.
    All { expired: &'a BTreeSet<ClaimOf> },
    /// A scoped round's (the leader's round planning a scope of the Services): only the numbers
    /// the scope's Services hold (by annotation) are looked at for claims held without one or
    /// held twice. The round is scoped only when every other claim is settled and names a Service
    /// that holds its number (or a deleted one), and the Services outside the scope hold what
    /// they held: none of their numbers can be missing a claim. `gone_claims`: the numbers the
    /// deleted owners claim ([`Keeper::claims_of_gone`]), found without a walk of the registry
    /// (`None`: walked).
    Numbers { numbers: &'a BTreeSet<u16>, gone_claims: Option<&'a [ClaimOf]> },
}

/// The registry changes of a round: claims for what the annotation writes add (pending, under
/// `token`), pending removal for what they take off, claims for numbers held without one, the
/// older keeping a number two hold, claims of deleted Services (`gone`) dropped, and (a whole
/// round) claims unresolved for [`GRACE`] settled. `held`: the numbers every Service holds as
/// seen (annotations as stored); `changes`: the annotation writes planned.
#[allow(clippy::too_many_arguments)]
pub fn plan(
    registry: &Registry,
    held: &HeldNumbers<'_>,
    changes: &[AnnotationChange<'_>],
    token: &Token,
    gone: &BTreeSet<Owner>,
    sharing: Option<&Sharing>,
    scope: ClaimScope<'_>,
) -> ClaimPlan {
    let next = Overlay { read: registry, changed: BTreeMap::new() };
    plan_in(next, registry, held, changes, token, gone, sharing, scope)
}

/// [`plan`], with the registry as the round leaves it kept in `next` (starting as `registry`).
#[allow(clippy::too_many_arguments)]
fn plan_in<S: ClaimStore>(
    mut next: S,
    registry: &Registry,
    held: &HeldNumbers<'_>,
    changes: &[AnnotationChange<'_>],
    token: &Token,
    gone: &BTreeSet<Owner>,
    sharing: Option<&Sharing>,
    scope: ClaimScope<'_>,
) -> ClaimPlan {
    let mut out = ClaimPlan::default();
    let shares = |a: &Owner, b: &Owner| sharing.is_some_and(|s| s.may_share(a, b));
    let pool_of = |o: &Owner| sharing.and_then(|s| s.pool(o)).map(str::to_string);
    let by_number = held.by_number();
    let holds =
        |owner: &Owner, n: u16| by_number.get(&n).is_some_and(|hs| hs.iter().any(|h| &h.owner == owner));
    let changing: BTreeMap<&ServiceKey, &BTreeSet<u16>> =
        changes.iter().map(|c| (&c.holder.key, &c.after)).collect();
    // Settle claims nobody resolved, and drop those of deleted Services.
    let expired = match scope {
        ClaimScope::All { expired } => Some(expired),
        ClaimScope::Numbers { .. } => None,
    };
    for (n, owner) in expired.into_iter().flatten() {
        let Some(c) = next.get(*n).and_then(|h| h.of(owner)).cloned() else { continue };
        match c.state {
            State::Adding(_) | State::Removing(_) => next.put(*n, Claim { state: State::Held, ..c }),
            State::Held if !holds(&c.owner, *n) => next.take(*n, owner),
            State::Held => {}
        }
    }
    if !gone.is_empty() {
        let claimed = match scope {
            ClaimScope::Numbers { gone_claims: Some(gone_claims), .. } => gone_claims.to_vec(),
            _ => next.claimed_by(gone),
        };
        for (n, owner) in claimed {
            next.take(n, &owner);
        }
    }
    // Claims for what is held without one (the oldest holder's; a claim never moves to another
    // holder). A number every holder gives up in this round is claimed for its oldest holder too,
    // whose write then marks it Removing: no other Service's addition takes it before that
    // write is seen (with the registry lost, a Lease deleted, the number was otherwise free to
    // an addition of the same round while the holder's annotation still named it: the chaos
    // soak's double allocation, seed 1795815239939159639).
    let numbers: Box<dyn Iterator<Item = (&u16, &Vec<Arc<Holder>>)>> = match scope {
        ClaimScope::All { .. } => Box::new(by_number.iter()),
        ClaimScope::Numbers { numbers, .. } => {
            Box::new(numbers.iter().filter_map(|n| by_number.get_key_value(n)))
        }
    };
    for (n, hs) in numbers {
        let keepers: Vec<&Arc<Holder>> =
            hs.iter().filter(|h| changing.get(&h.key).is_none_or(|after| after.contains(n))).collect();
        let Some(oldest) = keepers.first().copied().or_else(|| hs.first()) else { continue };
        if next.get(*n).is_some() {
            continue;
        }
        // Younger keepers whose pools are apart from those of every claim so far share it.
        let mut claimants = vec![&oldest.owner];
        for h in keepers.iter().filter(|h| h.owner != oldest.owner) {
            if claimants.iter().all(|o| shares(o, &h.owner)) {
                claimants.push(&h.owner);
            }
        }
        let shared = claimants.len() > 1;
        for o in claimants {
            next.put(*n, Claim { pool: pool_of(o).filter(|_| shared), ..Claim::held(o.clone()) });
        }
    }
    // The writes: additions pending under our token (only onto a free number, the Service's own
    // settled claim, or beside Services whose pools are apart from its own), removals pending
    // for the numbers it claims.
    for ch in changes {
        let owner = &ch.holder.owner;
        let before = &ch.holder.numbers;
        let mut sc = ServiceClaims { owner: owner.clone(), adds: Vec::new(), removes: Vec::new() };
        let mut staged = Vec::new();
        let mut ok = true;
        for n in ch.after.difference(before) {
            let adding = Claim::new(owner.clone(), State::Adding(token.clone()));
            match next.get(*n) {
                None => sc.adds.push((*n, None)),
                Some(h) => match h.of(owner) {
                    Some(c) if c.state == State::Held => {
                        sc.adds.push((*n, Some(c.clone())));
                        staged.push((*n, Claim { pool: c.pool.clone(), ..adding }));
                        continue;
                    }
                    // Beside the claims of Services whose pools are apart from its own, each
                    // with its pool recorded.
                    None if h.owners().all(|o| shares(owner, o)) => {
                        sc.adds.push((*n, None));
                        for c in h.iter().filter(|c| c.pool.is_none()) {
                            staged.push((*n, Claim { pool: pool_of(&c.owner), ..c.clone() }));
                        }
                        staged.push((*n, Claim { pool: pool_of(owner), ..adding }));
                        continue;
                    }
                    _ => ok = false,
                },
            }
            staged.push((*n, adding));
        }
        for n in before.difference(&ch.after) {
            if let Some(c) = next.get(*n).and_then(|h| h.of(owner)).filter(|c| c.state == State::Held) {
                sc.removes.push(*n);
                staged.push((*n, Claim { state: State::Removing(token.clone()), ..c.clone() }));
            }
        }
        if ok {
            for (n, c) in staged {
                next.put(n, c);
            }
            out.services.insert(ch.holder.key.clone(), sc);
        } else {
            out.blocked.insert(ch.holder.key.clone());
        }
    }
    for (b, new) in next.blocks(registry) {
        let old = registry.blocks.get(&b);
        // A block known but not stored (its Lease deleted: [`ReadRegistry::keep_lost`]) is
        // created again with its claims.
        let unstored = old.is_some_and(|o| o.resource_version.is_none()) && !new.is_empty();
        if unstored || (old.map(|o| &*o.claims) != Some(&new) && !(old.is_none() && new.is_empty())) {
            let resource_version = old.and_then(|o| o.resource_version.clone());
            out.blocks.insert(b, Block { claims: Arc::new(new), resource_version });
        }
    }
    out
}

/// Where [`plan`] keeps the registry as the round leaves it.
trait ClaimStore {
    fn get(&self, n: u16) -> Option<&Holds>;
    /// `None`: every claim on `n` goes.
    fn set(&mut self, n: u16, holds: Option<Holds>);
    /// The claims of `owners`, by number.
    fn claimed_by(&self, owners: &BTreeSet<Owner>) -> Vec<(u16, Owner)>;
    /// Every block whose claims may differ from `read`'s, with its claims now.
    fn blocks(&self, read: &Registry) -> Vec<(u16, Claims)>;

    /// `claim` on `n`, in place of its owner's claim if it had one.
    fn put(&mut self, n: u16, claim: Claim) {
        let holds = match self.get(n) {
            Some(h) => {
                let mut h = h.clone();
                h.put(claim);
                h
            }
            None => Holds::from(claim),
        };
        self.set(n, Some(holds));
    }

    /// `owner`'s claim on `n` gone.
    fn take(&mut self, n: u16, owner: &Owner) {
        if let Some(h) = self.get(n).filter(|h| h.of(owner).is_some()) {
            let left = h.clone().without(owner);
            self.set(n, left);
        }
    }
}

/// The registry as read, with the claims a round changes over it: only those are copied, and
/// only their blocks can change (the registry holds one claim per node port of the cluster:
/// copying them all would cost every round time linear in the cluster's node ports).
struct Overlay<'a> {
    read: &'a Registry,
    changed: BTreeMap<u16, Option<Holds>>,
}

impl ClaimStore for Overlay<'_> {
    fn get(&self, n: u16) -> Option<&Holds> {
        match self.changed.get(&n) {
            Some(c) => c.as_ref(),
            None => self.read.get(n),
        }
    }

    fn set(&mut self, n: u16, holds: Option<Holds>) {
        self.changed.insert(n, holds);
    }

    fn claimed_by(&self, owners: &BTreeSet<Owner>) -> Vec<(u16, Owner)> {
        let read = self.read.iter().filter(|(n, _)| !self.changed.contains_key(n));
        let changed =
            (self.changed.iter()).flat_map(|(n, h)| h.iter().flat_map(|h| h.iter().map(|c| (*n, c))));
        read.chain(changed)
            .filter(|(_, c)| owners.contains(&c.owner))
            .map(|(n, c)| (n, c.owner.clone()))
            .collect()
    }

    fn blocks(&self, read: &Registry) -> Vec<(u16, Claims)> {
        let mut touched: BTreeSet<u16> = self.changed.keys().map(|n| block_of(*n)).collect();
        // Blocks known but not stored are written whatever changed.
        touched.extend(read.blocks.iter().filter(|(_, b)| b.resource_version.is_none()).map(|(n, _)| *n));
        touched
            .into_iter()
            .map(|b| {
                let mut claims = read.blocks.get(&b).map(|o| Claims::clone(&o.claims)).unwrap_or_default();
                let first = u16::try_from(u32::from(b) * BLOCK_SIZE).unwrap_or(u16::MAX);
                let last = u16::try_from((u32::from(b) + 1) * BLOCK_SIZE - 1).unwrap_or(u16::MAX);
                for (n, c) in self.changed.range(first..=last) {
                    match c {
                        Some(c) => claims.insert(*n, c.clone()),
                        None => claims.remove(n),
                    };
                }
                (b, claims)
            })
            .collect()
    }
}

/// Applies the end of one Service's write to a freshly read block (only claims still pending
/// under `token` for that Service are touched): written → additions held, removals dropped;
/// refused → each claim back to what it was; unknown → held (it may hold them). Returns whether
/// anything changed.
pub fn resolve(claims: &mut Claims, sc: &ServiceClaims, outcome: Outcome, token: &Token) -> bool {
    let mut changed = false;
    // Settles `owner`'s claim on `n` if it is still `pending`: dropped (`keep` false) or held.
    let mut settle = |n: u16, pending: State, keep: bool| {
        let Some(holds) = claims.get_mut(&n) else { return };
        let Some(mine) = holds.of_mut(&sc.owner).filter(|c| c.state == pending) else { return };
        changed = true;
        if keep {
            mine.state = State::Held;
        } else if let Some(left) = claims.remove(&n).and_then(|h| h.without(&sc.owner)) {
            claims.insert(n, left);
        }
    };
    for (n, prior) in &sc.adds {
        let refused_free = outcome == Outcome::Refused && prior.is_none();
        settle(*n, State::Adding(token.clone()), !refused_free);
    }
    for n in &sc.removes {
        settle(*n, State::Removing(token.clone()), outcome != Outcome::Written);
    }
    changed
}

/// One Service's claim on one number, named: the number and the claimant.
pub type ClaimOf = (u16, Owner);

/// A leader's memory of the registry between rounds: which Services it has seen (so a deletion
/// is known, not guessed) and since when each unresolved claim has looked the same. Every agent
/// keeps one from its first view on, so a new leader knows the deletions it saw before.
#[derive(Debug, Default)]
pub struct Keeper {
    /// Owners in the last view.
    seen: BTreeSet<Owner>,
    /// Owners seen once and absent since (deleted: a view never loses a Service that still
    /// exists), until no claim names them.
    gone: BTreeSet<Owner>,
    /// When each of `gone` was found deleted, oldest first: a follower never reads the registry
    /// (never [`Keeper::forget`]s), so it forgets deletions after [`REMEMBER_GONE`] instead.
    gone_since: std::collections::VecDeque<(Instant, Owner)>,
    unresolved: BTreeMap<ClaimOf, (Claim, Instant)>,
    /// Each registry block's resourceVersion at the last [`Keeper::expired`] (`None`: that call
    /// did not look at the registry, the Service watch failing): a block read again at the same
    /// version holds the same claims, and only those whose numbers changed holders are looked at
    /// again.
    versions: Option<BTreeMap<u16, Option<String>>>,
}

/// How long a deletion is remembered. Forgetting one is safe: a claim of a Service nobody knows
/// to be deleted is settled after [`GRACE`] like any unresolved claim; remembering only makes
/// that immediate. A leader forgets a deletion as soon as no claim names it.
pub const REMEMBER_GONE: Duration = Duration::from_secs(600);

impl Keeper {
    /// Records the Services of a view taken at `now`.
    pub fn observe_view<H: Borrow<Holder>>(&mut self, holders: &[H], now: Instant) {
        let owners: BTreeSet<Owner> = holders.iter().map(|h| h.borrow().owner.clone()).collect();
        for o in self.seen.difference(&owners) {
            self.gone.insert(o.clone());
            self.gone_since.push_back((now, o.clone()));
        }
        self.seen = owners;
        self.forget_old(now);
    }

    /// [`Keeper::observe_view`] of the view [`Holders::pass`] just passed over, from what
    /// changed since the one before: a leader's round does not build the set of every owner
    /// again. The first pass of `Holders` has nothing to compare with: the whole view is
    /// observed (every holder is added).
    pub fn observe_changes(&mut self, changes: &ViewChanges, now: Instant) {
        if changes.first {
            return self.observe_view(&changes.added, now);
        }
        let added: BTreeSet<&Owner> = changes.added.iter().map(|h| &h.owner).collect();
        for (_, h) in &changes.dropped {
            // A new version of the same Service (one uid) is not a deletion.
            if !added.contains(&h.owner) && self.seen.remove(&h.owner) {
                self.gone.insert(h.owner.clone());
                self.gone_since.push_back((now, h.owner.clone()));
            }
        }
        self.seen.extend(added.into_iter().cloned());
        self.forget_old(now);
    }

    /// Forgets deletions older than [`REMEMBER_GONE`].
    fn forget_old(&mut self, now: Instant) {
        while let Some((at, o)) = self.gone_since.front() {
            if now.saturating_duration_since(*at) < REMEMBER_GONE {
                break;
            }
            self.gone.remove(o);
            self.gone_since.pop_front();
        }
    }

    /// Whether every claim of the registry, as last seen by [`Keeper::expired`], was resolved or
    /// is a deleted Service's ([`Keeper::gone`]: a round lets those go, and nothing else reads
    /// them): then every other claim names a Service that holds its number. `false` when that
    /// call did not look at the claims (the Service watch failing: it forgets them all, so
    /// nothing is known to be resolved).
    pub fn resolved_but_deletions(&self) -> bool {
        self.versions.is_some() && self.unresolved.values().all(|(c, _)| self.gone.contains(&c.owner))
    }

    /// The owners known to be deleted.
    pub fn gone(&self) -> &BTreeSet<Owner> {
        &self.gone
    }

    /// Forgets deleted owners no claim names any more.
    pub fn forget(&mut self, registry: &Registry) {
        if self.gone.is_empty() {
            return;
        }
        // A deleted Service's claims are unresolved ones, when the last look at the registry
        // (this one) found them.
        let named: BTreeSet<&Owner> = match &self.versions {
            Some(_) => {
                self.unresolved.values().map(|(c, _)| &c.owner).filter(|o| self.gone.contains(*o)).collect()
            }
            None => registry.iter().map(|(_, c)| &c.owner).filter(|o| self.gone.contains(*o)).collect(),
        };
        self.gone.retain(|o| named.contains(o));
        self.gone_since.retain(|(_, o)| named.contains(o));
    }

    /// The claims that have been unresolved (pending, or held by a Service that does not hold
    /// the number in this view) and unchanged for [`GRACE`], watching continuously (`healthy`:
    /// the Service watch works; else everything starts over).
    ///
    /// `touched`: the numbers whose holders changed since the last call (`None`: anything may
    /// have): claims of a block read at the version the last call saw are looked at again only
    /// for those numbers (a leader's round writes a block or two; walking every claim would be
    /// much of a scoped round).
    pub fn expired(
        &mut self,
        registry: &Registry,
        held: &HeldNumbers<'_>,
        touched: Option<&BTreeSet<u16>>,
        healthy: bool,
        now: Instant,
    ) -> BTreeSet<ClaimOf> {
        if !healthy {
            self.unresolved.clear();
            self.versions = None;
            return BTreeSet::new();
        }
        let last = self.versions.take();
        let unresolved = |c: &Claim, n: u16| {
            !(c.state == State::Held && held.holders_of(n).iter().any(|h| h.owner == c.owner))
        };
        // Looks again at every claim on `n` (`holds`: who holds it now).
        let check = |n: u16, holds: Option<&Holds>, kept: &mut BTreeMap<ClaimOf, (Claim, Instant)>| {
            let was: Vec<Owner> = (kept.range((n, Owner(String::new()))..))
                .take_while(|((m, _), _)| *m == n)
                .map(|((_, o), _)| o.clone())
                .collect();
            for o in was.into_iter().filter(|o| holds.is_none_or(|h| h.of(o).is_none())) {
                kept.remove(&(n, o));
            }
            for c in holds.into_iter().flat_map(Holds::iter) {
                let at = (n, c.owner.clone());
                if !unresolved(c, n) {
                    kept.remove(&at);
                    continue;
                }
                let since = match kept.get(&at) {
                    Some((prev, t)) if prev == c => *t,
                    _ => now,
                };
                kept.insert(at, (c.clone(), since));
            }
        };
        let mut kept = std::mem::take(&mut self.unresolved);
        // Blocks gone since: their claims too.
        kept.retain(|(n, _), _| registry.blocks.contains_key(&block_of(*n)));
        for (b, block) in &registry.blocks {
            let same =
                touched.is_some() && last.as_ref().and_then(|l| l.get(b)) == Some(&block.resource_version);
            if !same {
                let first = u16::try_from(u32::from(*b) * BLOCK_SIZE).unwrap_or(u16::MAX);
                let end = u16::try_from((u32::from(*b) + 1) * BLOCK_SIZE - 1).unwrap_or(u16::MAX);
                kept.retain(|(n, o), _| {
                    *n < first || *n > end || block.claims.get(n).is_some_and(|h| h.of(o).is_some())
                });
                for (n, holds) in block.claims.iter() {
                    check(*n, Some(holds), &mut kept);
                }
                continue;
            }
            // The same claims: only a number whose holders changed can change its standing.
            for n in touched.into_iter().flatten().copied().filter(|n| block_of(*n) == *b) {
                check(n, block.claims.get(&n), &mut kept);
            }
        }
        self.unresolved = kept;
        self.versions = Some(registry.versions());
        (self.unresolved.iter())
            .filter(|(_, (_, since))| now.saturating_duration_since(*since) >= GRACE)
            .map(|(at, _)| at.clone())
            .collect()
    }

    /// Forgets what the last [`Keeper::expired`] saw of the registry: the next one looks at
    /// every claim (a round that could not read the registry saw the holders change without it).
    pub fn lose_track(&mut self) {
        self.versions = None;
    }

    /// The numbers claimed by deleted Services ([`Keeper::gone`]) in the registry the last
    /// [`Keeper::expired`] saw: such a claim never names a holder, so it is among the unresolved
    /// ones. `None` when that call did not look at the registry.
    pub fn claims_of_gone(&self) -> Option<Vec<ClaimOf>> {
        self.versions.as_ref()?;
        Some(
            self.unresolved
                .iter()
                .filter(|(_, (c, _))| self.gone.contains(&c.owner))
                .map(|(at, _)| at.clone())
                .collect(),
        )
    }
}

#[cfg(test)]
mod tests;
