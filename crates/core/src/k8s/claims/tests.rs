use super::*;
use crate::domain::PortId;
use crate::inputs::model::ANNOTATION_ALLOCATED;
use crate::inputs::model::{LbPort, PortRequest, TrafficPolicy};

fn uid(c: char) -> String {
    format!("{}-0000-0000-0000-000000000000", c.to_string().repeat(8))
}

fn owner(c: char) -> Owner {
    Owner::of_uid(&uid(c))
}

/// Service `c` (name and uid from the letter), created on day `day`, holding `held`.
fn holder(c: char, day: u8, held: &[u16]) -> Holder {
    Holder {
        key: ServiceKey::new("default", c.to_string()),
        owner: owner(c),
        created: Some(format!("2024-01-{day:02}T00:00:00Z").parse().unwrap()),
        numbers: held.iter().copied().collect(),
    }
}

fn lb(h: &Holder) -> LbService {
    LbService {
        key: h.key.clone(),
        uid: Some(h.owner.0.clone()),
        created: h.created,
        allocated_since: None,
        previous_allocation: h
            .numbers
            .iter()
            .enumerate()
            .map(|(i, n)| (PortId::tcp(80 + i as u16), *n))
            .collect(),
        ports: vec![LbPort { id: PortId::tcp(80), name: String::new(), endpoints: vec![] }],
        families: vec![],
        source_ranges: vec![],
        traffic_policy: TrafficPolicy::Cluster,
        session_affinity: None,
        port_request: PortRequest::Auto,
        kube_node_ports: vec![],
    }
}

/// The claims, a number listed twice shared by both claimants.
fn claims_of<const N: usize>(claims: [(u16, Claim); N]) -> Claims {
    let mut out = Claims::new();
    for (n, c) in claims {
        put(&mut out, n, c);
    }
    out
}

fn put(claims: &mut Claims, n: u16, c: Claim) {
    match claims.get_mut(&n) {
        Some(h) => h.put(c),
        None => {
            claims.insert(n, c.into());
        }
    }
}

fn registry(claims: &[(u16, Claim)]) -> Registry {
    let mut r = Registry::default();
    for (n, c) in claims {
        put(Arc::make_mut(&mut r.blocks.entry(block_of(*n)).or_default().claims), *n, c.clone());
    }
    for b in r.blocks.values_mut() {
        b.resource_version = Some("7".into());
    }
    r
}

fn tok(s: &str) -> Token {
    Token(s.into())
}

fn pending(c: char, state: fn(Token) -> State, t: &str) -> Claim {
    Claim::new(owner(c), state(tok(t)))
}

/// The whole registry copied, every block compared: how [`plan`] kept it before [`Overlay`],
/// the oracle of `only_changed_claims_are_copied_and_the_plan_is_the_same`.
struct FullCopy(Claims);

impl ClaimStore for FullCopy {
    fn get(&self, n: u16) -> Option<&Holds> {
        self.0.get(&n)
    }

    fn set(&mut self, n: u16, holds: Option<Holds>) {
        match holds {
            Some(h) => self.0.insert(n, h),
            None => self.0.remove(&n),
        };
    }

    fn claimed_by(&self, owners: &BTreeSet<Owner>) -> Vec<(u16, Owner)> {
        let all = self.0.iter().flat_map(|(n, h)| h.iter().map(|c| (*n, c.owner.clone())));
        all.filter(|(_, o)| owners.contains(o)).collect()
    }

    fn blocks(&self, read: &Registry) -> Vec<(u16, Claims)> {
        let mut by_block: BTreeMap<u16, Claims> = read.blocks.keys().map(|b| (*b, Claims::new())).collect();
        for (n, h) in &self.0 {
            by_block.entry(block_of(*n)).or_default().insert(*n, h.clone());
        }
        by_block.into_iter().collect()
    }
}

#[test]
fn only_changed_claims_are_copied_and_the_plan_is_the_same() {
    // Random registries, views and writes over numbers spread across the blocks (the first,
    // the last, and both sides of a block boundary), both ways.
    struct Rng(u64);
    impl Rng {
        fn below(&mut self, m: u64) -> u64 {
            self.0 = self.0.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            (self.0 >> 33) % m
        }
    }
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
    let numbers = [0u16, 1, 8191, 8192, 8193, 20000, 20001, 24575, 24576, 65534, 65535];
    let pick = |rng: &mut Rng, k: u64| -> Vec<u16> {
        (0..rng.below(k)).map(|_| numbers[rng.below(numbers.len() as u64) as usize]).collect()
    };
    let letters = ['a', 'b', 'c', 'd', 'e', 'f'];
    let t = tok("me");
    let sharing = pools_apart();
    for case in 0..3000 {
        let holders: Vec<Holder> = letters
            .iter()
            .enumerate()
            .map(|(i, c)| holder(*c, 1 + (i as u8 % 3), &pick(&mut rng, 3)))
            .collect();
        let claims: Vec<(u16, Claim)> = pick(&mut rng, 8)
            .into_iter()
            .map(|n| {
                let c = letters[rng.below(letters.len() as u64) as usize];
                let claim = match rng.below(4) {
                    0 => pending(c, State::Adding, "x"),
                    1 => pending(c, State::Removing, "me"),
                    _ => Claim::held(owner(c)),
                };
                (n, claim)
            })
            .collect();
        let mut reg = registry(&claims);
        if rng.below(4) == 0 {
            // A block read empty (all its claims gone before).
            reg.blocks.insert(block_of(numbers[rng.below(numbers.len() as u64) as usize]), Block::default());
        }
        let mut changes: Vec<AnnotationChange<'_>> = Vec::new();
        for h in &holders {
            if rng.below(3) == 0 {
                changes.push(AnnotationChange { holder: h, after: pick(&mut rng, 3).into_iter().collect() });
            }
        }
        let gone: BTreeSet<Owner> = letters.iter().filter(|_| rng.below(5) == 0).map(|c| owner(*c)).collect();
        let expired: BTreeSet<ClaimOf> = (pick(&mut rng, 3).into_iter())
            .map(|n| (n, owner(letters[rng.below(letters.len() as u64) as usize])))
            .collect();
        let (held, scope) = (HeldNumbers::of(&holders), ClaimScope::All { expired: &expired });
        let copied = FullCopy(reg.blocks.values().flat_map(|b| Claims::clone(&b.claims)).collect());
        let sharing = (rng.below(2) == 0).then_some(&sharing);
        assert_eq!(
            plan(&reg, &held, &changes, &t, &gone, sharing, scope),
            plan_in(copied, &reg, &held, &changes, &t, &gone, sharing, scope),
            "case {case}: registry {reg:?}, holders {holders:?}, gone {gone:?}, expired {expired:?}"
        );
    }
}

/// The registry lost (its Lease deleted): `a` gives 20008 up in the round in which `b` asks
/// for it. `b` waits until `a`'s write is seen; `a`'s write marks the number Removing.
#[test]
fn a_number_given_up_without_a_claim_is_not_taken_in_the_same_round() {
    let (a, b) = (holder('a', 1, &[20008]), holder('b', 2, &[]));
    let holders = [a.clone(), b.clone()];
    let changes = vec![
        AnnotationChange { holder: &a, after: BTreeSet::from([20009]) },
        AnnotationChange { holder: &b, after: BTreeSet::from([20008]) },
    ];
    let (gone, expired) = (BTreeSet::new(), BTreeSet::new());
    let p = plan(
        &registry(&[]),
        &HeldNumbers::of(&holders),
        &changes,
        &tok("me"),
        &gone,
        None,
        ClaimScope::All { expired: &expired },
    );
    assert!(p.blocked.contains(&b.key), "{p:?}");
    assert_eq!(p.services[&a.key].removes, [20008], "{p:?}");
    // Once `a`'s write is seen (it holds 20009, the claim is gone), `b` takes 20008.
    let a2 = holder('a', 1, &[20009]);
    let holders = [a2.clone(), b.clone()];
    let changes = vec![AnnotationChange { holder: &b, after: BTreeSet::from([20008]) }];
    let reg = registry(&[(20009, Claim::held(owner('a')))]);
    let p = plan(
        &reg,
        &HeldNumbers::of(&holders),
        &changes,
        &tok("me"),
        &gone,
        None,
        ClaimScope::All { expired: &expired },
    );
    assert!(p.blocked.is_empty() && p.services[&b.key].adds == [(20008, None)], "{p:?}");
}

/// A read parses only the blocks whose resourceVersion changed (the others are the very
/// claims of the last read), names what it cannot read, and the owners that changed
/// between two reads are found, whatever the claims' states.
#[test]
fn reads_share_unchanged_blocks_and_owner_changes_are_found() {
    let lease = |name: &str, rv: &str, claims: &str| {
        let mut l = k8s_openapi::api::coordination::v1::Lease::default();
        l.metadata.name = Some(name.into());
        l.metadata.resource_version = Some(rv.into());
        l.metadata.annotations = Some([(ANNOTATION.to_string(), claims.to_string())].into());
        l
    };
    let a = format!("20000={},20001={}+t1", owner('a'), owner('b'));
    let leases = [lease("nodelb-node-ports-2", "1", &a), lease("nodelb-node-ports-x", "1", "")];
    let (first, problems) = ReadRegistry::read(&leases, None);
    assert_eq!(problems.len(), 1, "{problems:?}");
    assert_eq!(
        first.registry.get(20001).map(|h| h.owners().collect::<Vec<_>>()),
        Some(vec![&owner('b')]),
        "a pending claim names its Service"
    );
    // The same version again: the same claims, shared; a new version of another block parsed.
    let c = format!("24576={}", owner('c'));
    let leases = [lease("nodelb-node-ports-2", "1", &a), lease("nodelb-node-ports-3", "5", &c)];
    let (second, _) = ReadRegistry::read(&leases, Some(first.clone()));
    assert!(Arc::ptr_eq(&first.registry.blocks[&2].claims, &second.registry.blocks[&2].claims));
    assert_eq!(second.registry.owners_changed(&first.registry), [24576]);
    // Resolved (the state changes, not the owner), moved, released.
    let b = format!("20000={},20001={},20002={}", owner('a'), owner('b'), owner('c'));
    let leases = [lease("nodelb-node-ports-2", "2", &b)];
    let (third, _) = ReadRegistry::read(&leases, Some(second.clone()));
    assert_eq!(third.registry.owners_changed(&second.registry), [20002, 24576]);
    assert!(third.registry.owners_changed(&third.registry).is_empty());
}

/// A registry Lease deleted: its last claims stay in force (no version), and the leader's
/// next plan writes the block again with them, whatever the annotations say.
#[test]
fn a_deleted_block_is_kept_and_written_again() {
    let before = ReadRegistry {
        registry: registry(&[(20000, Claim::held(owner('a'))), (8000, Claim::held(owner('b')))]),
        ..Default::default()
    };
    let mut now =
        ReadRegistry { registry: registry(&[(8000, Claim::held(owner('b')))]), ..Default::default() };
    assert_eq!(now.keep_lost(&before), [2]);
    assert_eq!(
        now.registry.get(20000).map(|h| h.owners().collect::<Vec<_>>()),
        Some(vec![&owner('a')]),
        "still in force"
    );
    assert_eq!(now.registry.blocks[&2].resource_version, None);
    assert!(now.registry.owners_changed(&before.registry).is_empty(), "no owner changed");
    // A forged annotation of the moment does not win: the block is written as it was.
    let forger = holder('c', 1, &[20000]);
    let victim = holder('a', 2, &[20000]);
    let p = plan(
        &now.registry,
        &HeldNumbers::of(&[forger, victim]),
        &[],
        &tok("me"),
        &BTreeSet::new(),
        None,
        ClaimScope::All { expired: &BTreeSet::new() },
    );
    let written = p.blocks.get(&2).expect("the lost block is written again");
    assert_eq!(*written.claims, claims_of([(20000, Claim::held(owner('a')))]));
    assert_eq!(written.resource_version, None, "created, not replaced");
}

#[test]
fn a_view_naming_another_services_number_is_found() {
    let reg = registry(&[(20000, Claim::held(owner('a'))), (20001, Claim::held(owner('d')))]);
    let changes =
        |hs: Vec<Holder>| ViewChanges { added: hs.into_iter().map(Arc::new).collect(), ..Default::default() };
    let none = BTreeSet::new();
    assert!(!name_anothers(&changes(vec![holder('a', 1, &[20000]), holder('b', 1, &[20002])]), &reg, &none));
    assert!(name_anothers(&changes(vec![holder('b', 1, &[20000])]), &reg, &none));
    assert!(!name_anothers(&changes(vec![holder('b', 1, &[20001])]), &reg, &BTreeSet::from([owner('d')])));
}

#[test]
fn text_round_trips_and_bad_entries_are_never_free() {
    let claims = claims_of([
        (20000, Claim::held(owner('a'))),
        (20001, pending('b', State::Adding, "t1")),
        (20002, pending('c', State::Removing, "t2")),
    ]);
    let text = format(&claims);
    assert_eq!(text, "20000=aaaaaaaa0000,20001=bbbbbbbb0000+t1,20002=cccccccc0000-t2");
    assert_eq!(parse(&text), (claims, vec![]));
    let (c, problems) = parse("x=1, 20005=nothex, 20006, ,70000=aaaaaaaa0000");
    assert_eq!(c.keys().copied().collect::<Vec<_>>(), [20005], "a readable number stays claimed");
    assert_eq!(problems.len(), 4, "{problems:?}");
    assert_eq!(block_of(20000), 2);
    assert_eq!(lease_name(block_of(8191)), "nodelb-node-ports-0");
}

/// A number Services on disjoint pools share: each holder with its state and pool, in
/// registry order, and back to the form of a number one Service holds when one is left.
#[test]
fn shared_numbers_round_trip() {
    let on = |c: Claim, pool: &str| Claim { pool: Some(pool.into()), ..c };
    let claims = claims_of([
        (443, on(Claim::held(owner('b')), "edge")),
        (443, on(pending('a', State::Removing, "t2"), "internal")),
        (443, on(pending('c', State::Adding, "t3"), "lab")),
        (20000, Claim::held(owner('d'))),
    ]);
    let text = format(&claims);
    assert_eq!(
        text,
        "443=bbbbbbbb0000+@edge;aaaaaaaa0000-t2@internal;cccccccc0000+t3@lab,20000=dddddddd0000"
    );
    assert_eq!(parse(&text), (claims.clone(), vec![]));
    assert!(claims[&443].is_shared() && !claims[&20000].is_shared());
    let left = claims[&443].clone().without(&owner('b')).and_then(|h| h.without(&owner('c')));
    let left = Claims::from([(443, left.expect("one left"))]);
    assert_eq!(format(&left), "443=aaaaaaaa0000-t2", "one holder, no pool");
    let (c, problems) = parse("443=bbbbbbbb0000+@edge;bbbbbbbb0000+@lab;zz@x;cccccccc0000*@y");
    assert_eq!(c[&443].owners().count(), 3, "an unreadable holder still holds: {c:?}");
    assert_eq!(problems.len(), 3, "{problems:?}");
}

/// An agent that cannot share reads a shared entry as its first holder's pending claim: it
/// never hands the number out, and writes the entry back byte for byte. The parser and the
/// writer it runs are kept here as they are in it.
#[test]
fn an_agent_that_cannot_share_keeps_shared_entries() {
    /// Per number: the owner, and the mark and token of a pending claim.
    type Unshared = BTreeMap<u16, (String, Option<(char, String)>)>;
    fn parse_unshared(value: &str) -> Unshared {
        let mut claims = BTreeMap::new();
        for item in value.split(',').map(str::trim).filter(|s| !s.is_empty()) {
            let Some((number, rest)) = item.split_once('=') else { continue };
            let Ok(number) = number.trim().parse::<u16>() else { continue };
            let (owner, state) = match rest.find(['+', '-']) {
                Some(i) if rest[i..].len() > 1 => {
                    (&rest[..i], Some((char::from(rest.as_bytes()[i]), rest[i + 1..].to_string())))
                }
                _ => (rest, None),
            };
            claims.insert(number, (owner.to_ascii_lowercase(), state));
        }
        claims
    }
    fn format_unshared(claims: &Unshared) -> String {
        let items: Vec<String> = (claims.iter())
            .map(|(n, (o, s))| match s {
                None => format!("{n}={o}"),
                Some((mark, token)) => format!("{n}={o}{mark}{token}"),
            })
            .collect();
        items.join(",")
    }
    let on = |c: Claim, pool: &str| Claim { pool: Some(pool.into()), ..c };
    for first in
        [Claim::held(owner('a')), pending('a', State::Adding, "t1"), pending('a', State::Removing, "t1")]
    {
        for second in [Claim::held(owner('b')), pending('b', State::Adding, "t2")] {
            let claims = claims_of([
                (443, on(first.clone(), "edge")),
                (443, on(second.clone(), "internal")),
                (20000, Claim::held(owner('d'))),
                (20001, pending('e', State::Adding, "t3")),
            ]);
            let text = format(&claims);
            let read = parse_unshared(&text);
            let (holder, state) = &read[&443];
            assert_eq!(holder, &owner('a').0, "{text}");
            assert!(state.as_ref().is_some_and(|(_, t)| !t.is_empty()), "pending, never free: {text}");
            assert_eq!(format_unshared(&read), text);
        }
    }
    // And what it writes, this agent reads as it meant it.
    let text = "20000=dddddddd0000,20001=eeeeeeee0000+t3,20002=aaaaaaaa0000-t4";
    assert_eq!(format_unshared(&parse_unshared(text)), text);
    assert_eq!(format(&parse(text).0), text);
}

/// Services `a`, `e` on the edge nodes, `b` on the internal nodes, `c` on the nodes with a GPU
/// (which may be edge or internal ones); `d` and `f` in no pool that shares.
fn pools_apart() -> Sharing {
    // `gpu` (the nodes with a GPU) may meet either.
    let mut sharing = Sharing::of_apart([("edge".to_string(), "internal".to_string())]);
    for (c, pool) in [('a', "edge"), ('e', "edge"), ('b', "internal"), ('c', "gpu")] {
        sharing.serve(&ServiceKey::new("default", c.to_string()), owner(c), pool);
    }
    sharing
}

/// A number is given beside other Services' claims only to a Service whose pool is apart from
/// each of theirs, with each holder's pool recorded; held again by annotations alone (the
/// registry lost), the oldest keeps it, and so does each younger one apart from every claim.
#[test]
fn shared_numbers_are_planned_for_services_of_pools_apart() {
    let t = tok("me");
    let sharing = pools_apart();
    let none = BTreeSet::new();
    let a = holder('a', 1, &[443]);
    let text = |p: &ClaimPlan| p.blocks.get(&0).map(|b| format(&b.claims)).unwrap_or_default();
    let reg = registry(&[(443, Claim::held(owner('a')))]);
    let all = ClaimScope::All { expired: &BTreeSet::new() };
    for (who, sharing, given) in [
        ('b', Some(&sharing), true),
        ('c', Some(&sharing), false),
        ('e', Some(&sharing), false),
        ('d', Some(&sharing), false),
        ('b', None, false),
    ] {
        let asker = holder(who, 2, &[]);
        let holders = [a.clone(), asker.clone()];
        let changes = [change(&asker, &[443])];
        let p = plan(&reg, &HeldNumbers::of(&holders), &changes, &t, &none, sharing, all);
        assert_eq!(p.blocked.is_empty(), given, "{who}, sharing {}: {p:?}", sharing.is_some());
        if given {
            assert_eq!(text(&p), "443=aaaaaaaa0000+@edge;bbbbbbbb0000+me@internal");
            assert_eq!(p.services[&asker.key].adds, [(443, None)]);
        }
    }
    // The registry lost: `a`, `b`, `c` and `e` name 443 (oldest first).
    let holders = [a.clone(), holder('b', 2, &[443]), holder('c', 3, &[443]), holder('e', 4, &[443])];
    let p = plan(&registry(&[]), &HeldNumbers::of(&holders), &[], &t, &none, Some(&sharing), all);
    assert_eq!(text(&p), "443=aaaaaaaa0000+@edge;bbbbbbbb0000+@internal");
    // Giving a shared number up: the claim is removed, and the one left is written as one
    // Service's again.
    let shared = registry(&[
        (443, Claim { pool: Some("edge".into()), ..Claim::held(owner('a')) }),
        (443, Claim { pool: Some("internal".into()), ..Claim::held(owner('b')) }),
    ]);
    let holders = [a.clone(), holder('b', 2, &[443])];
    let changes = [change(&holders[1], &[])];
    let p = plan(&shared, &HeldNumbers::of(&holders), &changes, &t, &none, Some(&sharing), all);
    assert_eq!(text(&p), "443=aaaaaaaa0000+@edge;bbbbbbbb0000-me@internal");
    let mut claims = Claims::clone(&p.blocks[&0].claims);
    assert!(resolve(&mut claims, &p.services[&holders[1].key], Outcome::Written, &t));
    assert_eq!(format(&claims), "443=aaaaaaaa0000");
    // Each claimant keeps the number; any other Service naming it loses it.
    let mut holders = vec![a.clone(), holder('b', 2, &[443]), holder('e', 3, &[443])];
    holders[2].key = ServiceKey::new("other", "e");
    let held = HeldNumbers::of(&holders);
    let screen = Screen::of(&held, &shared, &none);
    let losing: Vec<String> = screen.losing().map(|(k, ns)| format!("{k} {ns:?}")).collect();
    assert_eq!(losing, ["other/e {443}"]);
}

#[test]
fn screening() {
    let (a, b) = (holder('a', 1, &[20000]), holder('b', 2, &[20000]));
    // (name, holders, registry, gone, numbers each keeps, in-use numbers)
    type Case = (&'static str, Vec<Holder>, Registry, Vec<Owner>, Vec<Vec<u16>>, Vec<u16>);
    let cases: Vec<Case> = vec![
        (
            "no claim: kept (claimed for it later)",
            vec![a.clone()],
            registry(&[]),
            vec![],
            vec![vec![20000]],
            vec![],
        ),
        (
            "its own claim: kept",
            vec![a.clone()],
            registry(&[(20000, Claim::held(owner('a')))]),
            vec![],
            vec![vec![20000]],
            vec![],
        ),
        (
            "another's claim, the claimant not holding it: lost, in use",
            vec![a.clone()],
            registry(&[(20000, Claim::held(owner('b')))]),
            vec![],
            vec![vec![]],
            vec![20000],
        ),
        (
            "another's pending claim: lost, in use",
            vec![a.clone()],
            registry(&[(20000, pending('b', State::Adding, "x"))]),
            vec![],
            vec![vec![]],
            vec![20000],
        ),
        (
            "two hold it, the younger claims it: only the claimant keeps it, whatever the ages",
            vec![a.clone(), b.clone()],
            registry(&[(20000, Claim::held(owner('b')))]),
            vec![],
            vec![vec![], vec![20000]],
            vec![],
        ),
        (
            "two hold it, the older claims it: only the claimant keeps it",
            vec![a.clone(), b.clone()],
            registry(&[(20000, Claim::held(owner('a')))]),
            vec![],
            vec![vec![20000], vec![]],
            vec![],
        ),
        (
            "a forged annotation replaced its own number: it gets its own back",
            vec![a.clone(), b.clone()],
            registry(&[(20000, Claim::held(owner('a'))), (20007, Claim::held(owner('b')))]),
            vec![],
            vec![vec![20000], vec![20007]],
            vec![20007],
        ),
        (
            "two hold a number nobody claims: both kept here (the allocator's older-keeps decides)",
            vec![a.clone(), b.clone()],
            registry(&[]),
            vec![],
            vec![vec![20000], vec![20000]],
            vec![],
        ),
        (
            "two hold it, the claimant's addition pending: only the claimant keeps it",
            vec![a.clone(), b.clone()],
            registry(&[(20000, pending('b', State::Adding, "x"))]),
            vec![],
            vec![vec![], vec![20000]],
            vec![20000],
        ),
        (
            "the claimant was deleted: its claim does not count",
            vec![a.clone()],
            registry(&[(20000, Claim::held(owner('b')))]),
            vec![owner('b')],
            vec![vec![20000]],
            vec![],
        ),
        (
            "a claim nobody holds: in use",
            vec![],
            registry(&[(20009, Claim::held(owner('z')))]),
            vec![],
            vec![],
            vec![20009],
        ),
    ];
    for (name, holders, reg, gone, keeps, in_use) in cases {
        let gone: BTreeSet<Owner> = gone.into_iter().collect();
        let mut services: Vec<Arc<LbService>> = holders.iter().map(|h| Arc::new(lb(h))).collect();
        let before = services.clone();
        let s = screen(&mut services, &HeldNumbers::of(&holders), &reg, &gone);
        let got: Vec<Vec<u16>> =
            services.iter().map(|s| s.previous_allocation.values().copied().collect()).collect();
        assert_eq!(got, keeps, "{name}");
        for (b, a) in before.iter().zip(&services) {
            let same = b.previous_allocation == a.previous_allocation;
            assert_eq!(Arc::ptr_eq(b, a), same, "{name}: only a model that loses a number is copied");
        }
        let used: BTreeSet<u16> = s.in_use.keys().map(|(_, n)| *n).collect();
        assert_eq!(used, in_use.into_iter().collect(), "{name}");
    }
}

fn change<'a>(h: &'a Holder, after: &[u16]) -> AnnotationChange<'a> {
    AnnotationChange { holder: h, after: after.iter().copied().collect() }
}

#[test]
fn planning() {
    let t = tok("me");
    let a = holder('a', 1, &[20000]);
    let b_new = holder('b', 2, &[]);
    // (name, registry, holders, changes, gone, expired, the blocks written (None: none), blocked)
    type Case<'a> = (
        &'static str,
        Registry,
        Vec<Holder>,
        Vec<AnnotationChange<'a>>,
        Vec<Owner>,
        Vec<u16>,
        Option<Claims>,
        bool,
    );
    let b_dup = holder('b', 2, &[20000]);
    let cases: Vec<Case<'_>> = vec![
        (
            "an annotation without a claim is claimed; a new number is pending",
            registry(&[]),
            vec![a.clone(), b_new.clone()],
            vec![change(&b_new, &[20001])],
            vec![],
            vec![],
            Some(claims_of([(20000, Claim::held(owner('a'))), (20001, pending('b', State::Adding, "me"))])),
            false,
        ),
        (
            "a number being added elsewhere is not added: the write waits",
            registry(&[(20000, Claim::held(owner('a'))), (20001, pending('c', State::Adding, "x"))]),
            vec![a.clone(), b_new.clone()],
            vec![change(&b_new, &[20001])],
            vec![],
            vec![],
            None,
            true,
        ),
        (
            "a move: the old number pending removal, the new one pending addition",
            registry(&[(20000, Claim::held(owner('a')))]),
            vec![a.clone()],
            vec![change(&a, &[20003])],
            vec![],
            vec![],
            Some(claims_of([
                (20000, pending('a', State::Removing, "me")),
                (20003, pending('a', State::Adding, "me")),
            ])),
            false,
        ),
        (
            "nothing to do: nothing written",
            registry(&[(20000, Claim::held(owner('a')))]),
            vec![a.clone()],
            vec![],
            vec![],
            vec![],
            None,
            false,
        ),
        (
            "a deleted owner's claims go; an expired pending claim is held, an expired orphan goes",
            registry(&[
                (20000, Claim::held(owner('a'))),
                (20004, Claim::held(owner('d'))),
                (20005, pending('a', State::Adding, "x")),
                (20006, Claim::held(owner('e'))),
            ]),
            vec![a.clone()],
            vec![],
            vec![owner('d')],
            vec![20005, 20006],
            Some(claims_of([(20000, Claim::held(owner('a'))), (20005, Claim::held(owner('a')))])),
            false,
        ),
        (
            "two hold a number the younger claims: the claim stays (the older's annotation is forged)",
            registry(&[(20000, Claim::held(owner('b')))]),
            vec![a.clone(), b_dup.clone()],
            vec![],
            vec![],
            vec![],
            None,
            false,
        ),
        (
            "the same, the younger seen first (a reflector's order): the claim stays",
            registry(&[(20000, Claim::held(owner('b')))]),
            vec![b_dup.clone(), a.clone()],
            vec![],
            vec![],
            vec![],
            None,
            false,
        ),
        (
            "two hold a number nobody claims, the younger seen first: the older claims it",
            registry(&[]),
            vec![b_dup.clone(), a.clone()],
            vec![],
            vec![],
            vec![],
            Some(claims_of([(20000, Claim::held(owner('a')))])),
            false,
        ),
        (
            "two hold it, the older is written off it: the younger's claim stays",
            registry(&[(20000, Claim::held(owner('b')))]),
            vec![a.clone(), b_dup.clone()],
            vec![change(&a, &[20002])],
            vec![],
            vec![],
            Some(claims_of([(20000, Claim::held(owner('b'))), (20002, pending('a', State::Adding, "me"))])),
            false,
        ),
    ];
    for (name, reg, holders, changes, gone, expired, want, blocked) in cases {
        let gone: BTreeSet<Owner> = gone.into_iter().collect();
        // Every claim on an expired number.
        let expired: BTreeSet<ClaimOf> = (expired.into_iter())
            .flat_map(|n| reg.get(n).into_iter().flat_map(move |h| h.owners().map(move |o| (n, o.clone()))))
            .collect();
        let scope = ClaimScope::All { expired: &expired };
        let p = plan(&reg, &HeldNumbers::of(&holders), &changes, &t, &gone, None, scope);
        assert_eq!(p.blocks.get(&2).map(|b| Claims::clone(&b.claims)), want, "{name}");
        if let Some(b) = p.blocks.get(&2) {
            assert_eq!(
                b.resource_version,
                reg.blocks.get(&2).and_then(|b| b.resource_version.clone()),
                "{name}"
            );
        }
        assert_eq!(!p.blocked.is_empty(), blocked, "{name}");
    }
}

#[test]
fn resolving() {
    let t = tok("me");
    let sc = ServiceClaims {
        owner: owner('a'),
        adds: vec![(20001, None), (20002, Some(Claim::held(owner('a'))))],
        removes: vec![20000],
    };
    let pending_claims = || {
        claims_of([
            (20000, pending('a', State::Removing, "me")),
            (20001, pending('a', State::Adding, "me")),
            (20002, pending('a', State::Adding, "me")),
        ])
    };
    let held = |ns: &[u16]| ns.iter().map(|n| (*n, Claim::held(owner('a')).into())).collect::<Claims>();
    for (outcome, want) in [
        (Outcome::Written, held(&[20001, 20002])),
        (Outcome::Refused, held(&[20000, 20002])),
        (Outcome::Unknown, held(&[20000, 20001, 20002])),
    ] {
        let mut c = pending_claims();
        assert!(resolve(&mut c, &sc, outcome, &t));
        assert_eq!(c, want, "{outcome:?}");
    }
    // Another leader's pending claims (another token) are not ours to resolve.
    let mut c = pending_claims();
    assert!(!resolve(&mut c, &sc, Outcome::Written, &tok("other")));
    assert_eq!(c, pending_claims());
    // On a shared number only the Service's own claim is settled; the other holder keeps its
    // place and, left alone, its number the way one holder holds it.
    let on = |c: Claim, pool: &str| Claim { pool: Some(pool.into()), ..c };
    let shared = || {
        claims_of([
            (20001, on(Claim::held(owner('b')), "edge")),
            (20001, on(pending('a', State::Adding, "me"), "internal")),
        ])
    };
    let sc = ServiceClaims { owner: owner('a'), adds: vec![(20001, None)], removes: vec![] };
    let mut c = shared();
    assert!(resolve(&mut c, &sc, Outcome::Written, &t));
    assert_eq!(format(&c), "20001=bbbbbbbb0000+@edge;aaaaaaaa0000+@internal");
    let mut c = shared();
    assert!(resolve(&mut c, &sc, Outcome::Refused, &t));
    assert_eq!(format(&c), "20001=bbbbbbbb0000");
}

#[test]
fn keeper_knows_deletions_and_waits_out_the_grace() {
    let mut k = Keeper::default();
    let a = holder('a', 1, &[20000]);
    let b = holder('b', 1, &[]);
    let t0 = Instant::now();
    k.observe_view(&[a.clone(), b.clone()], t0);
    assert!(k.gone().is_empty());
    k.observe_view(std::slice::from_ref(&a), t0);
    assert_eq!(k.gone(), &BTreeSet::from([owner('b')]));
    k.observe_view(std::slice::from_ref(&a), t0);
    assert_eq!(k.gone(), &BTreeSet::from([owner('b')]), "until no claim names it");
    k.forget(&registry(&[(20001, Claim::held(owner('b')))]));
    assert_eq!(k.gone(), &BTreeSet::from([owner('b')]));
    k.forget(&registry(&[]));
    assert!(k.gone().is_empty());
    let reg = registry(&[(20000, Claim::held(owner('a'))), (20001, Claim::held(owner('a')))]);
    let view = &HeldNumbers::of(std::slice::from_ref(&a));
    assert!(k.expired(&reg, view, None, true, t0).is_empty(), "20001 unresolved since now");
    assert!(k.expired(&reg, view, None, true, t0 + GRACE / 2).is_empty());
    assert_eq!(k.expired(&reg, view, None, true, t0 + GRACE), BTreeSet::from([(20001, owner('a'))]));
    assert!(k.expired(&reg, view, None, false, t0 + GRACE * 2).is_empty(), "watch failing");
    assert!(k.expired(&reg, view, None, true, t0 + GRACE * 2).is_empty(), "and the wait starts over");
}

/// A view's holders are built once per Service object: the same object again gives the kept
/// holder, a new version of it (another object) a new one, and what a view no longer holds
/// is let go.
#[test]
fn holders_are_kept_per_object() {
    let svc = |allocated: &str| -> Arc<Service> {
        Arc::new(
            serde_json::from_value(serde_json::json!({
                "metadata": {"name": "web", "namespace": "default", "uid": uid('a'),
                             "annotations": {ANNOTATION_ALLOCATED: allocated}},
                "spec": {"type": "LoadBalancer", "ports": [{"port": 80}]}
            }))
            .unwrap(),
        )
    };
    let (v1, other) = (svc("80/TCP=20001"), svc("80/TCP=20009"));
    let mut memo = Holders::default();
    let first = of_view(&mut memo, &[Arc::clone(&v1), Arc::clone(&other)]);
    assert_eq!(*first[0], Holder::of(&v1));
    assert_eq!(first[0].numbers, BTreeSet::from([20001]));
    let again = of_view(&mut memo, std::slice::from_ref(&v1));
    assert!(Arc::ptr_eq(&first[0], &again[0]), "the same object: the kept holder");
    let v2 = svc("80/TCP=20002");
    let next = of_view(&mut memo, std::slice::from_ref(&v2));
    assert_eq!(next[0].numbers, BTreeSet::from([20002]), "a new version: a new holder");
    // What changed, for the round: v2 is new, v1 went (the last pass held it).
    let changes = memo.changes();
    assert_eq!(
        changes.added.iter().map(|h| h.numbers.clone()).collect::<Vec<_>>(),
        [BTreeSet::from([20002])]
    );
    assert!(changes.dropped.iter().any(|(o, _)| Arc::ptr_eq(o, &v1)));
    assert!(Arc::ptr_eq(memo.of_key(&v2_key()).unwrap().0, &v2));
    of_view(&mut memo, std::slice::from_ref(&v2));
    assert!(memo.changes().added.is_empty() && memo.changes().dropped.is_empty());
    assert_eq!((Arc::strong_count(&v1), Arc::strong_count(&other)), (1, 1), "the others let go");
}

/// What [`Keeper::expired`] finds when it looks again only at the claims of blocks written
/// since and at the numbers whose holders changed is what a look at every claim finds: the
/// claims expired, all resolved or not, the deleted Services' claims. Random registries
/// (claims held, pending, of unknown owners; blocks written at new versions or not) and
/// random views (Services created, deleted, their numbers changed), over time.
#[test]
fn looking_again_at_what_changed_is_looking_at_everything() {
    let mut rng = crate::domain::fnv1a(b"expired");
    let mut next = |below: u64| {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        rng % below
    };
    let letters: Vec<char> = "abcdef".chars().collect();
    let t0 = Instant::now();
    let (mut full, mut incremental) = (Keeper::default(), Keeper::default());
    let mut view: BTreeMap<char, BTreeSet<u16>> = BTreeMap::new();
    let mut reg = Registry::default();
    let mut version = 0u64;
    let mut memo = Holders::default();
    // Every Service created gets a uid of its own (a deleted Service's never comes back).
    let uid_of = |i: u64| format!("{i:08x}-0000-0000-0000-000000000000");
    let mut created = 0u64;
    let svc = |c: char, i: u64, numbers: &BTreeSet<u16>| -> Arc<Service> {
        let value: Vec<String> =
            numbers.iter().enumerate().map(|(i, n)| format!("{}/TCP={n}", 80 + i)).collect();
        Arc::new(
            serde_json::from_value(serde_json::json!({
                "metadata": {"name": c.to_string(), "namespace": "default", "uid": uid_of(i),
                             "annotations": {ANNOTATION_ALLOCATED: value.join(",")}},
                "spec": {"type": "LoadBalancer", "ports": [{"port": 80}]}
            }))
            .unwrap(),
        )
    };
    let mut objects: BTreeMap<char, Arc<Service>> = BTreeMap::new();
    // Numbers in two blocks (8191 is block 0, 8192 block 1).
    let numbers = [8189u16, 8190, 8191, 8192, 8193, 8194];
    for step in 0..600 {
        // The view changes now and then.
        if next(3) == 0 {
            let c = letters[next(letters.len() as u64) as usize];
            match next(3) {
                0 => {
                    view.remove(&c);
                    objects.remove(&c);
                }
                1 if view.contains_key(&c) => {
                    // A new version of the same Service.
                    let held: BTreeSet<u16> = (0..next(3)).map(|_| numbers[next(6) as usize]).collect();
                    let i = objects[&c]
                        .metadata
                        .uid
                        .as_deref()
                        .map_or(0, |u| u64::from_str_radix(&u[..8], 16).unwrap());
                    objects.insert(c, svc(c, i, &held));
                    view.insert(c, held);
                }
                _ => {
                    created += 1;
                    let held: BTreeSet<u16> = (0..next(3)).map(|_| numbers[next(6) as usize]).collect();
                    objects.insert(c, svc(c, created, &held));
                    view.insert(c, held);
                }
            }
        }
        // A block written now and then: claims added, changed, dropped.
        if next(2) == 0 {
            let b = next(2) as u16;
            let block = reg.blocks.entry(b).or_default();
            for _ in 0..next(3) {
                let n = numbers[next(6) as usize];
                if block_of(n) != b {
                    continue;
                }
                // Mostly a Service that holds the number now, else one created (maybe deleted
                // since), or nobody's.
                let holding: Vec<&Arc<Service>> =
                    objects.values().filter(|o| Holder::of(o).numbers.contains(&n)).collect();
                let owner = match (next(4), holding.is_empty()) {
                    (0, _) | (_, true) => Owner::of_uid(&uid_of(next(created + 2))),
                    _ => Holder::of(holding[next(holding.len() as u64) as usize]).owner,
                };
                let state = match next(4) {
                    0 => State::Adding(Token::new("x", 1, 0)),
                    1 => State::Removing(Token::new("x", 1, 0)),
                    _ => State::Held,
                };
                let claims = Arc::make_mut(&mut block.claims);
                match next(4) {
                    0 => drop(claims.remove(&n)),
                    // A claim added beside another Service's shares the number.
                    _ => put(claims, n, Claim::new(owner, state)),
                }
            }
            version += 1;
            block.resource_version = Some(version.to_string());
        }
        let list: Vec<Arc<Service>> = objects.values().cloned().collect();
        let holders = of_view(&mut memo, &list);
        let now = t0 + Duration::from_secs(7 * step);
        full.observe_view(&holders, now);
        incremental.observe_changes(memo.changes(), now);
        let touched = memo.changed_numbers();
        let held = memo.held();
        let a = full.expired(&reg, &held, None, true, now);
        let b = incremental.expired(&reg, &held, touched, true, now);
        assert_eq!(a, b, "step {step}: expired");
        assert_eq!(full.unresolved, incremental.unresolved, "step {step}: unresolved");
        assert_eq!(full.gone(), incremental.gone(), "step {step}: gone");
        let mut gone_claims: Vec<ClaimOf> = (reg.iter())
            .filter(|(_, c)| full.gone().contains(&c.owner))
            .map(|(n, c)| (n, c.owner.clone()))
            .collect();
        gone_claims.sort();
        assert_eq!(incremental.claims_of_gone(), Some(gone_claims), "step {step}: deleted Services' claims");
        full.forget(&reg);
        incremental.forget(&reg);
        assert_eq!(full.gone(), incremental.gone(), "step {step}: forgotten");
    }
}

/// The index of held numbers that [`Holders`] keeps, patched by each view's changes, is the
/// one built afresh for the view, holders oldest first, over random views.
#[test]
fn the_kept_index_of_held_numbers_is_the_one_built_for_the_view() {
    let svc = |name: char, day: u8, numbers: &[u16]| -> Arc<Service> {
        let value: Vec<String> =
            numbers.iter().enumerate().map(|(i, n)| format!("{}/TCP={n}", 80 + i)).collect();
        Arc::new(
            serde_json::from_value(serde_json::json!({
                "metadata": {"name": name.to_string(), "namespace": "default", "uid": uid(name),
                             "creationTimestamp": format!("2024-01-{day:02}T00:00:00Z"),
                             "annotations": {ANNOTATION_ALLOCATED: value.join(",")}},
                "spec": {"type": "LoadBalancer", "ports": [{"port": 80}]}
            }))
            .unwrap(),
        )
    };
    let index = |held: &HeldNumbers<'_>| -> Vec<(u16, Vec<ServiceKey>)> {
        held.by_number().iter().map(|(n, hs)| (*n, hs.iter().map(|h| h.key.clone()).collect())).collect()
    };
    let mut rng = crate::domain::fnv1a(b"seed");
    let mut next = |below: u64| {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        rng % below
    };
    let mut memo = Holders::default();
    let mut view: Vec<Arc<Service>> = Vec::new();
    for step in 0..400 {
        let name = (b'a' + next(8) as u8) as char;
        view.retain(|s| s.metadata.name.as_deref() != Some(&name.to_string()));
        if next(4) != 0 {
            let numbers: Vec<u16> = (0..next(3)).map(|_| 20000 + next(6) as u16).collect();
            view.push(svc(name, 1 + next(3) as u8, &numbers));
        }
        let holders = of_view(&mut memo, &view);
        assert_eq!(index(&memo.held()), index(&HeldNumbers::of(&holders)), "step {step}");
    }
}

/// Passes `memo` over `services` (no EndpointSlices); the holder of each, in their order.
fn of_view(memo: &mut Holders, services: &[Arc<Service>]) -> Vec<Arc<Holder>> {
    memo.pass(services, &[]);
    services.iter().map(|s| Arc::clone(memo.of_object(s).expect("held"))).collect()
}

fn v2_key() -> ServiceKey {
    ServiceKey::new("default", "web")
}

#[test]
fn owners_are_the_uids_first_twelve_hex_digits() {
    for (uid, want) in [
        ("3F2504E0-4F89-11D3-9A0C-0305E82C3301", "3f2504e04f89"),
        ("3f2504e0-4f89-11d3-9a0c-0305e82c3301", "3f2504e04f89"),
        ("é1a-2ßB", "1a2b"),
        ("", ""),
    ] {
        assert_eq!(Owner::of_uid(uid), Owner(want.to_string()), "{uid}");
    }
}

#[test]
fn a_follower_forgets_deletions_with_time() {
    // A follower never reads the registry, so its memory of deletions is bounded by time.
    let mut k = Keeper::default();
    let (a, b, c) = (holder('a', 1, &[]), holder('b', 1, &[]), holder('c', 1, &[]));
    let t0 = Instant::now();
    k.observe_view(&[a.clone(), b.clone(), c.clone()], t0);
    k.observe_view(&[a.clone(), c.clone()], t0);
    k.observe_view(std::slice::from_ref(&a), t0 + REMEMBER_GONE / 2);
    assert_eq!(k.gone(), &BTreeSet::from([owner('b'), owner('c')]));
    k.observe_view(std::slice::from_ref(&a), t0 + REMEMBER_GONE);
    assert_eq!(k.gone(), &BTreeSet::from([owner('c')]), "b deleted REMEMBER_GONE ago");
    k.observe_view(std::slice::from_ref(&a), t0 + REMEMBER_GONE * 2);
    assert!(k.gone().is_empty());
    assert!(k.gone_since.is_empty());
}
