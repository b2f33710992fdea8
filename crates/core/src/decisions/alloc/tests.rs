use super::*;
use crate::inputs::model::LbPort;

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
    let ports = ports.iter().map(|id| LbPort { id: *id, name: String::new(), endpoints: vec![] }).collect();
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
            want: allocs(&[("old", &[(tcp(80), 20001), (tcp(443), 20002)]), ("young", &[(tcp(80), 20000)])]),
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
        allowed: "22,6443,80".parse::<crate::decisions::port_policy::PortList>().unwrap().0,
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

/// Two ingress controllers on 443, one served by the edge nodes, one by the internal nodes:
/// both hold it. A pool that may share a node with either does not; a new number is never
/// shared; a number the registry records as shared stays so after the pools meet; and a scoped
/// allocation sees every holder of a shared number.
#[test]
fn pools_apart_share_the_numbers_their_services_ask_for() {
    let r = |a: u16, b: u16| PortRange { first: a, last: b };
    let pool = |name: &str| PoolRanges {
        pool: name.into(),
        keep: vec![r(443, 443), r(21000, 21001)],
        take: vec![r(21000, 21001)],
        requestable: vec![],
        per_namespace: None,
        service_ports: false,
    };
    // `gpu` (the nodes with a GPU) may meet either.
    let mut sharing = Sharing::of_apart([("edge".to_string(), "internal".to_string())]);
    let services = vec![
        explicit(svc("edge-ingress", Some(1), &[tcp(443), tcp(8080)]), &[(tcp(443), 443)]),
        explicit(svc("internal-ingress", Some(2), &[tcp(443), tcp(8080)]), &[(tcp(443), 443)]),
        explicit(svc("gpu-ingress", Some(3), &[tcp(443)]), &[(tcp(443), 443)]),
    ];
    let mut pools = BTreeMap::new();
    for (s, p) in services.iter().zip(["edge", "internal", "gpu"]) {
        let owner = crate::k8s::claims::Owner::of(&s.key, None);
        sharing.serve(&s.key, owner, p);
        pools.insert(s.key.clone(), pool(p));
    }
    let c = Constraints { pools: Some(&pools), sharing: Some(&sharing), ..Default::default() };
    let got = allocate_with(&PortRange::default(), &services, &Allocations::new(), c);
    let want = allocs(&[
        ("edge-ingress", &[(tcp(443), 443), (tcp(8080), 21000)]),
        ("internal-ingress", &[(tcp(443), 443), (tcp(8080), 21001)]),
    ]);
    assert_eq!(got.allocations, want, "{:?}", got.problems);
    let problems: Vec<String> = got.problems.iter().map(|p| p.to_string()).collect();
    assert_eq!(
        problems,
        [
            "Service default/gpu-ingress: port 443/TCP asks for node port 443, which Service default/edge-ingress holds"
        ]
    );
    // Without sharing, the younger is refused.
    let c = Constraints { pools: Some(&pools), ..Default::default() };
    let got = allocate_with(&PortRange::default(), &services, &Allocations::new(), c);
    assert!(!got.allocations[&key("internal-ingress")].contains_key(&tcp(443)));
    // The gpu pool held 443 beside the edge one (the registry says so): kept, though the pools
    // may meet on a node now; a new request for it is still refused.
    let held = [
        annotated(services[0].clone(), &[(tcp(443), 443)]),
        annotated(services[2].clone(), &[(tcp(443), 443)]),
        services[1].clone(),
    ];
    sharing.record(443, &key("edge-ingress"));
    sharing.record(443, &key("gpu-ingress"));
    let c = Constraints { pools: Some(&pools), sharing: Some(&sharing), ..Default::default() };
    let got = allocate_with(&PortRange::default(), &held, &Allocations::new(), c);
    assert_eq!(got.allocations[&key("gpu-ingress")][&tcp(443)], 443);
    assert!(!got.allocations[&key("internal-ingress")].contains_key(&tcp(443)), "gpu may meet internal");
    // Scoped: the two holders are elsewhere; a Service of the internal pool may not join them
    // (the gpu one may meet it), and a number both hold is never a new one.
    let decided = got.allocations.clone();
    let holders = NumberHolders::of(&decided);
    assert_eq!(holders.holders(443).count(), 2);
    let except: foldhash::HashSet<ServiceKey> = [key("internal-ingress")].into_iter().collect();
    let scoped = [services[1].clone()];
    let c = Constraints {
        pools: Some(&pools),
        sharing: Some(&sharing),
        elsewhere: Some(holders.elsewhere(&except)),
        ..Default::default()
    };
    let got = allocate_with(&PortRange::default(), &scoped, &Allocations::new(), c);
    assert!(!got.allocations.get(&key("internal-ingress")).is_some_and(|m| m.contains_key(&tcp(443))));
    assert_eq!(got.allocations[&key("internal-ingress")][&tcp(8080)], 21001, "21000 is edge's");
    // Holders come and go.
    let mut holders = holders;
    holders.update(&key("edge-ingress"), decided.get(&key("edge-ingress")), None);
    assert_eq!(holders.holders(443).cloned().collect::<Vec<_>>(), [key("gpu-ingress")]);
    holders.update(&key("gpu-ingress"), decided.get(&key("gpu-ingress")), None);
    assert_eq!(holders.holders(443).count(), 0);
    assert_eq!(holders.len(), 1, "internal-ingress's 21001");
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
    let got: Vec<_> =
        moved(&before, &after).into_iter().map(|(k, id, a, b)| (k.name.to_string(), id.port, a, b)).collect();
    assert_eq!(got, [("web".to_string(), 80, 20001, 21001)]);
}
