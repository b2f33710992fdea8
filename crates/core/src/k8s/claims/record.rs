//! One registry block's claims and their text in the block's annotation: who holds each number,
//! in which state, and (for a number Services on disjoint pools share) on which pool.
//!
//! The text keeps a registry that shares no number byte for byte what an agent that cannot
//! share reads and writes: `20001=0a1b2c3d4e5f`, with `+token` while a leader adds the number
//! and `-token` while it removes it. A number with several holders is written
//! `443=<owner>+@edge;<owner>-<token>@internal`: each holder its owner, a mark, its token
//! (empty for a held claim) and `@pool`. Its first holder always carries a mark, so an agent
//! that cannot share reads the entry as the first holder's pending claim (the rest as its
//! token), never hands the number out and writes the entry back unchanged.

use std::collections::BTreeMap;

use crate::domain::Owner;

/// A leader process, in its pending claims (so that only it resolves them).
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Token(pub String);

impl Token {
    /// Eight hex digits from the node name, the process and the time it started.
    pub fn new(node: &str, pid: u32, started_ns: u128) -> Token {
        let mut h: u64 = 0xcbf2_9ce4_8422_2325;
        for b in node.bytes().chain(pid.to_le_bytes()).chain(started_ns.to_le_bytes()) {
            h = (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3);
        }
        Token(format!("{:08x}", h as u32))
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum State {
    Held,
    /// A leader is writing the number on the Service.
    Adding(Token),
    /// A leader is taking the number off the Service.
    Removing(Token),
}

/// One Service's claim on one number.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Claim {
    pub owner: Owner,
    pub state: State,
    /// The pool the Service held the number on when it was shared (`None`: not recorded, as for
    /// a number one Service holds).
    pub pool: Option<String>,
}

impl Claim {
    pub fn held(owner: Owner) -> Claim {
        Claim { owner, state: State::Held, pool: None }
    }

    pub fn new(owner: Owner, state: State) -> Claim {
        Claim { owner, state, pool: None }
    }
}

/// Who holds one number: its claims in registry order, one per Service, never empty. A number
/// has one claim unless Services whose pools never meet share it; one claim is kept inline (a
/// registry holds one per node port of the cluster, every node keeps a copy).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Holds(Inner);

#[derive(Debug, Clone, PartialEq, Eq)]
enum Inner {
    One(Claim),
    /// Two or more.
    Many(Vec<Claim>),
}

impl From<Claim> for Holds {
    fn from(claim: Claim) -> Holds {
        Holds(Inner::One(claim))
    }
}

impl Holds {
    /// `claims` as read (`None`: none).
    fn of_claims(mut claims: Vec<Claim>) -> Option<Holds> {
        match claims.len() {
            0 => None,
            1 => claims.pop().map(Holds::from),
            _ => Some(Holds(Inner::Many(claims))),
        }
    }

    fn as_slice(&self) -> &[Claim] {
        match &self.0 {
            Inner::One(c) => std::slice::from_ref(c),
            Inner::Many(v) => v,
        }
    }

    fn as_mut_slice(&mut self) -> &mut [Claim] {
        match &mut self.0 {
            Inner::One(c) => std::slice::from_mut(c),
            Inner::Many(v) => v,
        }
    }

    /// The claims, in registry order.
    pub fn iter(&self) -> std::slice::Iter<'_, Claim> {
        self.as_slice().iter()
    }

    /// `owner`'s claim, if it has one.
    pub fn of(&self, owner: &Owner) -> Option<&Claim> {
        self.iter().find(|c| &c.owner == owner)
    }

    /// `owner`'s claim, to change in place.
    pub fn of_mut(&mut self, owner: &Owner) -> Option<&mut Claim> {
        self.as_mut_slice().iter_mut().find(|c| &c.owner == owner)
    }

    /// Whether several Services hold the number.
    pub fn is_shared(&self) -> bool {
        matches!(self.0, Inner::Many(_))
    }

    /// Whether every claim is `owner`'s.
    pub fn only(&self, owner: &Owner) -> bool {
        self.iter().all(|c| &c.owner == owner)
    }

    /// The owners, in registry order.
    pub fn owners(&self) -> impl Iterator<Item = &Owner> {
        self.iter().map(|c| &c.owner)
    }

    /// `claim` in place of its owner's claim, or after the others when it had none.
    pub fn put(&mut self, claim: Claim) {
        if let Some(c) = self.of_mut(&claim.owner) {
            *c = claim;
            return;
        }
        match &mut self.0 {
            Inner::Many(v) => v.push(claim),
            Inner::One(c) => self.0 = Inner::Many(vec![c.clone(), claim]),
        }
    }

    /// Without `owner`'s claim (`None`: no claim is left). A claim left alone keeps no pool:
    /// a number one Service holds is written as it always was.
    pub fn without(self, owner: &Owner) -> Option<Holds> {
        let left: Vec<Claim> = match self.0 {
            Inner::One(c) => vec![c],
            Inner::Many(v) => v,
        };
        let mut left = Holds::of_claims(left.into_iter().filter(|c| &c.owner != owner).collect())?;
        if let Inner::One(alone) = &mut left.0 {
            alone.pool = None;
        }
        Some(left)
    }
}

/// A block's claims, by number.
pub type Claims = BTreeMap<u16, Holds>;

/// Parses a block's annotation. An entry whose number cannot be read is skipped (named in the
/// problems); one whose number can but the rest cannot counts as held by an unknown owner, so
/// the number is not handed out on a misreading.
pub fn parse(value: &str) -> (Claims, Vec<String>) {
    let mut claims = Claims::new();
    let mut problems = Vec::new();
    for item in value.split(',').map(str::trim).filter(|s| !s.is_empty()) {
        let Some((number, rest)) = item.split_once('=') else {
            problems.push(format!("registry entry {item:?}: no `=`"));
            continue;
        };
        let Ok(number) = number.trim().parse::<u16>() else {
            problems.push(format!("registry entry {item:?}: {number:?} is not a port number"));
            continue;
        };
        let mut read: Vec<Claim> = Vec::new();
        if rest.contains([';', '@']) {
            for holder in rest.split(';') {
                let claim = parse_shared(holder).unwrap_or_else(|| {
                    problems.push(format!("registry entry {item:?}: holder {holder:?} cannot be read"));
                    Claim::held(Owner(holder.to_string()))
                });
                if read.iter().any(|c| c.owner == claim.owner) {
                    problems.push(format!("registry entry {item:?}: {} is named twice", claim.owner));
                    continue;
                }
                read.push(claim);
            }
        } else {
            let (owner, state) = match rest.find(['+', '-']) {
                Some(i) if rest[i..].len() > 1 => {
                    let token = Token(rest[i + 1..].to_string());
                    let state = if rest.as_bytes()[i] == b'+' {
                        State::Adding(token)
                    } else {
                        State::Removing(token)
                    };
                    (&rest[..i], state)
                }
                _ => (rest, State::Held),
            };
            let owner = owner_of(owner).unwrap_or_else(|| {
                problems.push(format!("registry entry {item:?}: owner {owner:?} is not 12 hex digits"));
                Owner(owner.to_string())
            });
            read.push(Claim::new(owner, state));
        }
        if let Some(holds) = Holds::of_claims(read) {
            claims.insert(number, holds);
        }
    }
    (claims, problems)
}

fn owner_of(text: &str) -> Option<Owner> {
    (text.len() == 12 && text.chars().all(|c| c.is_ascii_hexdigit()))
        .then(|| Owner(text.to_ascii_lowercase()))
}

/// One holder of a shared entry: owner, `+` or `-`, token (empty: held), then `@pool` if any.
fn parse_shared(holder: &str) -> Option<Claim> {
    let (claim, pool) = match holder.split_once('@') {
        Some((claim, pool)) if !pool.is_empty() => (claim, Some(pool.to_string())),
        Some(_) => return None,
        None => (holder, None),
    };
    let owner = owner_of(claim.get(..12)?)?;
    let token = claim.get(13..)?;
    let state = match (claim.as_bytes().get(12)?, token.is_empty()) {
        (b'+', true) => State::Held,
        (b'+', false) => State::Adding(Token(token.to_string())),
        (b'-', false) => State::Removing(Token(token.to_string())),
        _ => return None,
    };
    Some(Claim { owner, state, pool })
}

pub fn format(claims: &Claims) -> String {
    let items: Vec<String> = claims
        .iter()
        .map(|(n, holds)| match holds.as_slice() {
            [c] if c.pool.is_none() => match &c.state {
                State::Held => format!("{n}={}", c.owner),
                State::Adding(t) => format!("{n}={}+{}", c.owner, t.0),
                State::Removing(t) => format!("{n}={}-{}", c.owner, t.0),
            },
            several => {
                let holders: Vec<String> = several
                    .iter()
                    .map(|c| {
                        let state = match &c.state {
                            State::Held => "+".to_string(),
                            State::Adding(t) => format!("+{}", t.0),
                            State::Removing(t) => format!("-{}", t.0),
                        };
                        let pool = c.pool.as_deref().map(|p| format!("@{p}")).unwrap_or_default();
                        format!("{}{state}{pool}", c.owner)
                    })
                    .collect();
                format!("{n}={}", holders.join(";"))
            }
        })
        .collect();
    items.join(",")
}
