//! Duplicate node ports in the allocation annotations (a human edit, two leaders for a moment):
//! found and settled deterministically. Pure.
//!
//! The unit is the node port *number* (as in [`crate::decisions::alloc`]): it belongs to one Service for all
//! protocols, and one Service may use it once per protocol. Of two Services whose
//! `nodelb.io/allocated-ports` name one number, the **older** keeps it (creationTimestamp, then
//! namespace/name; a Service without a timestamp counts as the youngest), exactly the order the
//! allocator uses, so the allocator's next run reallocates the loser and nobody else moves. Until
//! then every node programs only the keeper (two elements with one key would fail the batch).

use std::borrow::Borrow;
use std::collections::{BTreeMap, BTreeSet};

use crate::decisions::alloc::Allocations;
use crate::domain::{PortId, Protocol, ServiceKey};
use crate::inputs::model::LbService;

/// One service port that lost its annotated node port to an older claim.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct Duplicate {
    pub node_port: u16,
    /// The Service that keeps the number.
    pub keeper: ServiceKey,
    /// The Service (may be the keeper itself, for a number given twice to one protocol) and
    /// port that lose it.
    pub loser: ServiceKey,
    pub loser_port: PortId,
}

impl std::fmt::Display for Duplicate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "node port {} is annotated on Service {} and on Service {} (port {}); {} keeps it (older)",
            self.node_port, self.keeper, self.loser, self.loser_port, self.keeper
        )
    }
}

impl Duplicate {
    /// What the Event on `viewer` (the keeper or the loser) says: the other Service named only
    /// when it is in the same namespace ([`ServiceKey::named_for`]).
    pub fn message_for(&self, viewer: &ServiceKey) -> String {
        let other = if *viewer == self.keeper { &self.loser } else { &self.keeper };
        let other = other.named_for(viewer);
        match (*viewer == self.keeper, self.keeper == self.loser) {
            (_, true) => format!(
                "node port {} is annotated twice for one protocol (port {} loses it)",
                self.node_port, self.loser_port
            ),
            (true, false) => format!(
                "node port {} is also annotated on {other}, which has no claim on it; this Service keeps it (older)",
                self.node_port
            ),
            (false, false) => format!(
                "node port {} of port {} is also annotated on {other}, which keeps it (older); this port is given another",
                self.node_port, self.loser_port
            ),
        }
    }
}

/// Whether two Services may both hold one number (the number, then the two Services): those
/// the registry gives it to together, or whose pools are apart ([`crate::decisions::sharing`]).
pub type Together<'a> = &'a dyn Fn(u16, &ServiceKey, &ServiceKey) -> bool;

/// The annotated allocations with every duplicate settled, and the duplicates found (sorted).
/// Services are one per key (the model refuses a second object with a key). `together`: which
/// Services are not duplicates of each other on a number (`None`: none).
pub fn settle<S: Borrow<LbService>>(
    services: &[S],
    together: Option<Together<'_>>,
) -> (Allocations, Vec<Duplicate>) {
    if !any_duplicate(services) {
        let kept = services
            .iter()
            .map(Borrow::borrow)
            .filter(|s| !s.previous_allocation.is_empty())
            .map(|s| (s.key.clone(), s.previous_allocation.clone()))
            .collect();
        return (kept, Vec::new());
    }
    settle_in_age_order(services, together)
}

/// The duplicates of [`settle`] alone (the leader's round: it allocates from the annotations
/// itself).
pub fn duplicates<S: Borrow<LbService>>(services: &[S], together: Option<Together<'_>>) -> Vec<Duplicate> {
    match any_duplicate(services) {
        true => settle_in_age_order(services, together).1,
        false => Vec::new(),
    }
}

/// Whether some number is annotated twice: on two Services, or twice for one protocol. Most
/// rounds have none, and this sort of numbers is a fraction of ordering every Service by age.
fn any_duplicate<S: Borrow<LbService>>(services: &[S]) -> bool {
    let mut claims: Vec<(u16, usize, Protocol)> = services
        .iter()
        .enumerate()
        .flat_map(|(i, s)| s.borrow().previous_allocation.iter().map(move |(id, n)| (*n, i, id.protocol)))
        .collect();
    claims.sort_unstable();
    claims.windows(2).any(|w| w[0].0 == w[1].0 && (w[0].1 != w[1].1 || w[0].2 == w[1].2))
}

/// [`settle`] the long way: every Service oldest first, each number to its first claimant.
fn settle_in_age_order<S: Borrow<LbService>>(
    services: &[S],
    together: Option<Together<'_>>,
) -> (Allocations, Vec<Duplicate>) {
    // Each number's holders so far, with the protocols each holds it for.
    let mut owners: BTreeMap<u16, Vec<(ServiceKey, BTreeSet<Protocol>)>> = BTreeMap::new();
    let mut kept = Allocations::new();
    let mut dups = Vec::new();
    // Oldest first, the allocator's order.
    for svc in crate::decisions::alloc::age_order(services) {
        for (port, number) in &svc.previous_allocation {
            let holders = owners.entry(*number).or_default();
            let blocker = match holders.iter_mut().find(|(k, _)| *k == svc.key) {
                Some((_, protos)) => (!protos.insert(port.protocol)).then(|| svc.key.clone()),
                None => {
                    let apart = |(k, _): &&(ServiceKey, BTreeSet<Protocol>)| {
                        !together.is_some_and(|t| t(*number, k, &svc.key))
                    };
                    let blocker = holders.iter().find(apart).map(|(k, _)| k.clone());
                    if blocker.is_none() {
                        holders.push((svc.key.clone(), BTreeSet::from([port.protocol])));
                    }
                    blocker
                }
            };
            if let Some(keeper) = blocker {
                dups.push(Duplicate {
                    node_port: *number,
                    keeper,
                    loser: svc.key.clone(),
                    loser_port: *port,
                });
                continue;
            }
            kept.entry(svc.key.clone()).or_default().insert(*port, *number);
        }
    }
    dups.sort();
    (kept, dups)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::inputs::model::LbPort;

    fn svc(name: &str, age: Option<u32>, ann: &[(PortId, u16)]) -> LbService {
        let ports =
            ann.iter().map(|(id, _)| LbPort { id: *id, name: String::new(), endpoints: vec![] }).collect();
        let mut s = LbService::with_defaults(ServiceKey::new("default", name), ports);
        s.created = age.map(|a| format!("2024-01-01T00:00:{a:02}Z").parse().unwrap());
        s.previous_allocation = ann.iter().copied().collect();
        s
    }

    fn key(n: &str) -> ServiceKey {
        ServiceKey::new("default", n)
    }

    #[test]
    fn table() {
        let tcp = PortId::tcp;
        let udp = PortId::udp;
        struct Case {
            name: &'static str,
            services: Vec<LbService>,
            kept: Vec<(&'static str, Vec<(PortId, u16)>)>,
            dups: Vec<(u16, &'static str, &'static str, PortId)>,
        }
        let cases = vec![
            Case {
                name: "no duplicates",
                services: vec![
                    svc("a", Some(1), &[(tcp(80), 20001)]),
                    svc("b", Some(2), &[(tcp(80), 20002)]),
                ],
                kept: vec![("a", vec![(tcp(80), 20001)]), ("b", vec![(tcp(80), 20002)])],
                dups: vec![],
            },
            Case {
                name: "older keeps it, whatever the input order",
                services: vec![
                    svc("young", Some(9), &[(tcp(80), 20001)]),
                    svc("old", Some(1), &[(tcp(80), 20001)]),
                ],
                kept: vec![("old", vec![(tcp(80), 20001)])],
                dups: vec![(20001, "old", "young", tcp(80))],
            },
            Case {
                name: "same age: namespace/name decides",
                services: vec![
                    svc("b", Some(1), &[(tcp(80), 20001)]),
                    svc("a", Some(1), &[(tcp(80), 20001)]),
                ],
                kept: vec![("a", vec![(tcp(80), 20001)])],
                dups: vec![(20001, "a", "b", tcp(80))],
            },
            Case {
                name: "no timestamp counts as youngest",
                services: vec![svc("a", None, &[(tcp(80), 20001)]), svc("z", Some(5), &[(tcp(80), 20001)])],
                kept: vec![("z", vec![(tcp(80), 20001)])],
                dups: vec![(20001, "z", "a", tcp(80))],
            },
            Case {
                name: "a number is a Service's for every protocol",
                services: vec![
                    svc("a", Some(1), &[(tcp(53), 20001)]),
                    svc("b", Some(2), &[(udp(53), 20001)]),
                ],
                kept: vec![("a", vec![(tcp(53), 20001)])],
                dups: vec![(20001, "a", "b", udp(53))],
            },
            Case {
                name: "one Service, one number, two protocols is fine",
                services: vec![svc("dns", Some(1), &[(tcp(53), 20053), (udp(53), 20053)])],
                kept: vec![("dns", vec![(tcp(53), 20053), (udp(53), 20053)])],
                dups: vec![],
            },
            Case {
                name: "one Service, one number twice for one protocol",
                services: vec![svc("a", Some(1), &[(tcp(80), 20001), (tcp(443), 20001)])],
                kept: vec![("a", vec![(tcp(80), 20001)])],
                dups: vec![(20001, "a", "a", tcp(443))],
            },
            Case {
                name: "loser keeps its other ports",
                services: vec![
                    svc("a", Some(1), &[(tcp(80), 20001)]),
                    svc("b", Some(2), &[(tcp(80), 20001), (tcp(443), 20002)]),
                ],
                kept: vec![("a", vec![(tcp(80), 20001)]), ("b", vec![(tcp(443), 20002)])],
                dups: vec![(20001, "a", "b", tcp(80))],
            },
        ];
        for c in cases {
            let (kept, dups) = settle(&c.services, None);
            let want: Allocations =
                c.kept.into_iter().map(|(n, m)| (key(n), m.into_iter().collect())).collect();
            assert_eq!(kept, want, "{}", c.name);
            let want: Vec<Duplicate> = c
                .dups
                .into_iter()
                .map(|(node_port, k, l, p)| Duplicate {
                    node_port,
                    keeper: key(k),
                    loser: key(l),
                    loser_port: p,
                })
                .collect();
            assert_eq!(dups, want, "{}", c.name);
            assert_eq!(duplicates(&c.services, None), want, "{}: duplicates alone", c.name);
        }
    }

    /// Services that hold a number together (the registry gives it to both) are no duplicates
    /// of each other; a third that does not go with each of them is.
    #[test]
    fn services_together_on_a_number_keep_it() {
        let tcp = PortId::tcp;
        let services = vec![
            svc("edge", Some(1), &[(tcp(443), 443)]),
            svc("internal", Some(2), &[(tcp(443), 443)]),
            svc("gpu", Some(3), &[(tcp(443), 443)]),
        ];
        let together = |_: u16, a: &ServiceKey, b: &ServiceKey| {
            let pair = [a.name.to_string(), b.name.to_string()];
            pair.contains(&"edge".to_string()) && !pair.contains(&"internal".to_string())
                || pair.contains(&"internal".to_string()) && pair.contains(&"edge".to_string())
        };
        let (kept, dups) = settle(&services, Some(&together));
        assert_eq!(kept.keys().map(|k| k.name.to_string()).collect::<Vec<_>>(), ["edge", "internal"]);
        let want =
            Duplicate { node_port: 443, keeper: key("internal"), loser: key("gpu"), loser_port: tcp(443) };
        assert_eq!(dups, [want], "gpu goes with edge, not with internal");
        assert_eq!(settle(&services, None).0.len(), 1);
    }

    /// The shortcut (no number annotated twice) gives what the long way gives, on random
    /// annotations over few numbers (so that about half of the sets have a duplicate).
    #[test]
    fn shortcut_is_the_long_way_without_duplicates() {
        let mut seed: u64 = 0x2545_f491_4f6c_dd1d;
        let mut next = |n: u64| {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed % n
        };
        let (mut with, mut without) = (0, 0);
        for _ in 0..2000 {
            let services: Vec<LbService> = (0..next(5) + 1)
                .map(|i| {
                    let ports: Vec<(PortId, u16)> = (0..next(3))
                        .map(|p| {
                            let proto = if next(2) == 0 { Protocol::Tcp } else { Protocol::Udp };
                            (PortId { port: 80 + p as u16, protocol: proto }, 20000 + next(12) as u16)
                        })
                        .collect();
                    svc(&format!("s{i}"), (next(4) > 0).then(|| next(60) as u32), &ports)
                })
                .collect();
            let long = settle_in_age_order(&services, None);
            assert_eq!(settle(&services, None), long, "{services:?}");
            assert_eq!(duplicates(&services, None), long.1, "{services:?}");
            if long.1.is_empty() { without += 1 } else { with += 1 }
        }
        assert!(with > 300 && without > 300, "both kinds of input: {with} with, {without} without");
    }

    #[test]
    fn messages_name_only_services_of_the_reader_s_namespace() {
        let d = |keeper: ServiceKey, loser: ServiceKey| Duplicate {
            node_port: 20001,
            keeper,
            loser,
            loser_port: PortId::tcp(80),
        };
        let (a, b) = (ServiceKey::new("team-a", "a"), ServiceKey::new("team-b", "b"));
        let across = d(a.clone(), b.clone());
        for viewer in [&a, &b] {
            let m = across.message_for(viewer);
            assert!(m.contains("another namespace") && !m.contains("team-"), "{m}");
        }
        let within = d(a.clone(), ServiceKey::new("team-a", "c"));
        assert!(within.message_for(&a).contains("Service team-a/c"), "{}", within.message_for(&a));
        assert!(within.message_for(&within.loser).contains("Service team-a/a"));
    }

    #[test]
    fn allocator_reallocates_the_loser_only() {
        // The leader runs the allocator with the annotations as previous allocations: the keeper
        // stays, the loser moves, nobody else does.
        let services = vec![
            svc("old", Some(1), &[(PortId::tcp(80), 20001)]),
            svc("young", Some(2), &[(PortId::tcp(80), 20001)]),
            svc("other", Some(3), &[(PortId::tcp(80), 20000)]),
        ];
        let r = crate::decisions::alloc::allocate(
            &crate::decisions::port_policy::PortRange::default(),
            &services,
            &Allocations::new(),
        );
        assert_eq!(r.allocations[&key("old")][&PortId::tcp(80)], 20001);
        assert_eq!(r.allocations[&key("other")][&PortId::tcp(80)], 20000);
        assert_eq!(r.allocations[&key("young")][&PortId::tcp(80)], 20002);
    }
}
