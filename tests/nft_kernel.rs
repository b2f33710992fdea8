//! The netlink edge against a real kernel: every test programs nf_tables inside namespaces it
//! creates, and proves the result with nft itself (`nft -f` of `Ruleset::render()` in a second
//! namespace must list exactly the same table).
mod common;

use std::collections::BTreeMap;
use std::io::Write as _;
use std::net::IpAddr;

use common::netns::NetNs;
use nodelb::core::domain::{Family, Protocol};
use nodelb::core::ruleset::ir::{
    self, BaseChain, Chain, ChainType, Change, CtState, Expr, Hook, Key, KeyType, Mapped, NamedCounter, Rule,
    Ruleset, Set, SetKind, Verdict,
};
use nodelb::encode::nft::{KernelTable, NftClient, NftError, verify};

type V = Verdict;
type S = CtState;

fn ip(s: &str) -> IpAddr {
    s.parse().expect("test address")
}

fn base(name: &str, t: ChainType, hook: Hook, priority: i32, rules: Vec<Rule>) -> Chain {
    Chain { name: name.into(), base: Some(BaseChain { chain_type: t, hook, priority }), rules, comment: None }
}

fn regular(name: &str, rules: Vec<Rule>) -> Chain {
    Chain { name: name.into(), base: None, rules, comment: None }
}

fn goto(c: &str) -> Mapped {
    Mapped::Verdict(Verdict::Goto(c.into()))
}

fn verdict(v: Verdict) -> Mapped {
    Mapped::Verdict(v)
}

fn r(exprs: Vec<Expr>) -> Rule {
    Rule::new(exprs)
}

/// A ruleset using every `Expr` variant and every set key shape, valid for the kernel's hook rules
/// (dnat only reached from nat prerouting/output, masquerade only in postrouting).
fn full_ruleset() -> Ruleset {
    use Expr::*;
    let mut rs = Ruleset::default();
    let pp = Key::proto_port;
    rs.add_set(Set {
        name: "service-ports".into(),
        key: vec![KeyType::InetProto, KeyType::InetService],
        kind: SetKind::VerdictMap,
        elements: BTreeMap::from([
            (pp(Protocol::Tcp, 20001), Some(goto("svc-a"))),
            (pp(Protocol::Udp, 20002), Some(verdict(V::Jump("svc-b".into())))),
            (pp(Protocol::Sctp, 20003), Some(verdict(V::Drop))),
        ]),
        comment: Some("node ports".into()),
    });
    rs.add_set(Set {
        name: "service-ports-ct".into(),
        key: vec![KeyType::InetProto, KeyType::InetService],
        kind: SetKind::VerdictMap,
        elements: BTreeMap::from([(pp(Protocol::Tcp, 20001), Some(verdict(V::Accept)))]),
        comment: None,
    });
    rs.add_counter(NamedCounter { name: "conn-a".into(), comment: Some("default/a 80/TCP".into()) });
    rs.add_counter(NamedCounter { name: "fwd-a".into(), comment: None });
    rs.add_set(Set {
        name: "forward-counters".into(),
        key: vec![KeyType::InetProto, KeyType::InetService],
        kind: SetKind::CounterMap,
        elements: BTreeMap::from([
            (pp(Protocol::Tcp, 20001), Some(Mapped::Counter("fwd-a".into()))),
            (pp(Protocol::Udp, 20002), Some(Mapped::Counter("fwd-a".into()))),
        ]),
        comment: Some("forwarded".into()),
    });
    let ep = |a: &str, p: Protocol, port: u16| Key::addrs_proto_port(ip(a), ip(a), p, port);
    rs.add_set(Set {
        name: "endpoints-ipv4".into(),
        key: vec![KeyType::Ipv4Addr, KeyType::Ipv4Addr, KeyType::InetProto, KeyType::InetService],
        kind: SetKind::Set,
        elements: BTreeMap::from([
            (ep("192.0.2.10", Protocol::Tcp, 8080), None),
            (ep("192.0.2.11", Protocol::Udp, 53), None),
        ]),
        comment: None,
    });
    rs.add_set(Set {
        name: "endpoints-ipv6".into(),
        key: vec![KeyType::Ipv6Addr, KeyType::Ipv6Addr, KeyType::InetProto, KeyType::InetService],
        kind: SetKind::Set,
        elements: BTreeMap::from([(ep("2001:db8::10", Protocol::Tcp, 8080), None)]),
        comment: Some("v6 endpoints".into()),
    });
    rs.add_set(Set {
        name: "aff-a".into(),
        key: vec![KeyType::Ipv4Addr],
        kind: SetKind::Dynamic { timeout: 3600 },
        elements: BTreeMap::new(),
        comment: Some("clients of 192.0.2.10".into()),
    });
    rs.add_set(Set {
        name: "aff-b".into(),
        key: vec![KeyType::Ipv6Addr],
        kind: SetKind::Dynamic { timeout: 86_400 },
        elements: BTreeMap::new(),
        comment: None,
    });
    rs.add_set(Set {
        name: "address-ports-ipv6".into(),
        key: vec![KeyType::Ipv6Addr, KeyType::InetProto, KeyType::InetService],
        kind: SetKind::VerdictMap,
        elements: BTreeMap::from([(
            Key::addr_proto_port("2001:db8::1".parse().unwrap(), Protocol::Tcp, 20004),
            Some(goto("svc-a")),
        )]),
        comment: None,
    });
    let dport_vmap = || L4ProtoDportVmap { map: "service-ports".into() };
    rs.add_chain(base(
        "nat-prerouting",
        ChainType::Nat,
        Hook::Prerouting,
        ir::priority::DSTNAT,
        vec![
            r(vec![NfProto(Family::Ipv4), FibDaddrLocal, dport_vmap()]),
            r(vec![FibDaddrLocal, dport_vmap()]),
            r(vec![L4ProtoDportInSet { set: "service-ports".into() }, FibDaddrLocal, dport_vmap()]),
            r(vec![
                NfProto(Family::Ipv6),
                DaddrL4ProtoDportInSet { family: Family::Ipv6, set: "address-ports-ipv6".into() },
                FibDaddrLocal,
                DaddrL4ProtoDportVmap { family: Family::Ipv6, map: "address-ports-ipv6".into() },
            ]),
        ],
    ));
    rs.add_chain(base(
        "nat-output",
        ChainType::Nat,
        Hook::Output,
        ir::priority::DSTNAT,
        vec![r(vec![FibDaddrLocal, dport_vmap()]).with_comment("node-originated")],
    ));
    rs.add_chain(base(
        "nat-postrouting",
        ChainType::Nat,
        Hook::Postrouting,
        ir::priority::SRCNAT,
        vec![
            r(vec![MarkHas(0x4000), MarkXor(0x4000), CtStatusDnat, Masquerade]),
            r(vec![
                SaddrTwiceL4ProtoSportInSet { family: Family::Ipv4, set: "endpoints-ipv4".into() },
                Counter,
            ]),
            r(vec![
                SaddrTwiceL4ProtoSportInSet { family: Family::Ipv6, set: "endpoints-ipv6".into() },
                Counter,
            ]),
            r(vec![
                CtStatusDnat,
                SaddrDaddrL4ProtoDportInSet { family: Family::Ipv4, set: "endpoints-ipv4".into() },
                Masquerade,
            ]),
        ],
    ));
    rs.add_chain(base(
        "filter-prerouting",
        ChainType::Filter,
        Hook::Prerouting,
        -110,
        vec![
            r(vec![
                SaddrInPrefix { prefix: "198.51.100.0/24".parse().expect("cidr"), negate: true },
                L4ProtoCtOrigDportVmap { map: "service-ports-ct".into() },
            ]),
            r(vec![
                SaddrInPrefix { prefix: "203.0.113.128/25".parse().expect("cidr"), negate: false },
                MarkSet(0x4000),
            ]),
            r(vec![
                NfProto(Family::Ipv6),
                DaddrInPrefix { prefix: "2001:db8:8000::/33".parse().expect("cidr"), negate: false },
                SaddrInPrefix { prefix: "2001:db8::/32".parse().expect("cidr"), negate: true },
                Verdict(V::Return),
            ]),
            r(vec![DaddrInPrefix { prefix: "192.0.2.7/32".parse().expect("cidr"), negate: false }, Counter])
                .with_comment("a host"),
        ],
    ));
    rs.add_chain(base(
        "filter-forward",
        ChainType::Filter,
        Hook::Forward,
        ir::priority::FILTER,
        vec![
            r(vec![CtState(Box::new([S::Invalid])), Verdict(V::Drop)]),
            r(vec![CtState(Box::new([S::Established, S::Related])), Counter, Verdict(V::Accept)]),
            r(vec![CtState(Box::new([S::New])), CtStatusDnat, Verdict(V::Jump("no-endpoints".into()))]),
            r(vec![
                NfProto(Family::Ipv4),
                CtStatusDnat,
                L4ProtoCtOrigDportCounterMap { map: "forward-counters".into() },
                Verdict(V::Accept),
            ]),
            r(vec![
                NfProto(Family::Ipv6),
                L4ProtoCtOrigDportInSet { set: "forward-counters".into() },
                MarkSet(0x2000),
            ]),
            r(vec![MarkHas(0x2000), MarkClear(0x2000)]),
        ],
    ));
    let mut svc_a = regular(
        "svc-a",
        vec![
            r(vec![SaddrInPrefix { prefix: "192.0.2.0/24".parse().expect("cidr"), negate: false }, Counter])
                .with_comment("service a"),
            r(vec![CounterRef("conn-a".into()), MarkSet(0x4000)]),
            r(vec![
                SaddrInSet { family: Family::Ipv4, set: "aff-a".into() },
                UpdateSaddr { family: Family::Ipv4, set: "aff-a".into() },
                L4Proto(Protocol::Tcp),
                Dnat { addr: ip("192.0.2.10"), port: 8080 },
            ]),
            r(vec![UpdateSaddr { family: Family::Ipv4, set: "aff-a".into() }]),
            r(vec![
                NumgenRandomIs { modulus: 3, value: 0 },
                L4Proto(Protocol::Tcp),
                Dnat { addr: ip("192.0.2.10"), port: 8080 },
            ]),
            r(vec![
                NumgenRandomIs { modulus: 2, value: 1 },
                L4Proto(Protocol::Tcp),
                Dnat { addr: ip("192.0.2.11"), port: 8080 },
            ]),
            r(vec![Verdict(V::Goto("ep-a-0".into()))]),
        ],
    );
    svc_a.comment = Some("default/a:http".into());
    rs.add_chain(svc_a);
    rs.add_chain(regular(
        "svc-b",
        vec![
            r(vec![SaddrInSet { family: Family::Ipv6, set: "aff-b".into() }, Counter]),
            r(vec![
                NumgenRandomIs { modulus: 2, value: 0 },
                UpdateSaddr { family: Family::Ipv6, set: "aff-b".into() },
                L4Proto(Protocol::Udp),
                Dnat { addr: ip("2001:db8::12"), port: 5353 },
            ]),
        ],
    ));
    rs.add_chain(regular(
        "ep-a-0",
        vec![r(vec![L4Proto(Protocol::Tcp), Dnat { addr: ip("192.0.2.10"), port: 8080 }])],
    ));
    rs.add_chain(regular(
        "ep-a-1",
        vec![r(vec![L4Proto(Protocol::Tcp), Dnat { addr: ip("192.0.2.11"), port: 8080 }])],
    ));
    rs.add_chain(regular(
        "ep-a-2",
        vec![r(vec![L4Proto(Protocol::Tcp), Dnat { addr: ip("2001:db8::10"), port: 8080 }])],
    ));
    rs.add_chain(regular(
        "ep-b-0",
        vec![r(vec![L4Proto(Protocol::Udp), Dnat { addr: ip("2001:db8::11"), port: 53 }])],
    ));
    rs.add_chain(regular(
        "no-endpoints",
        vec![
            r(vec![RejectTcpReset]),
            r(vec![L4Proto(Protocol::Tcp), RejectTcpReset]),
            r(vec![RejectIcmpPortUnreachable]),
        ],
    ));
    rs
}

fn apply_in(ns: &NetNs, changes: Vec<Change>) -> Result<nodelb::encode::nft::ApplyStats, NftError> {
    ns.run(move || NftClient::new()?.apply(&changes))
}

fn read_in(ns: &NetNs) -> Option<nodelb::encode::nft::KernelTable> {
    ns.run(|| NftClient::new().and_then(|mut c| c.read_table())).expect("read_table")
}

fn list(ns: &NetNs) -> String {
    ns.exec_ok("nft", &["list", "table", "inet", "nodelb"])
}

/// Loads `text` with `nft -f` inside `ns`.
fn nft_load(ns: &NetNs, text: &str) {
    let mut f = tempfile::NamedTempFile::new().expect("temp file");
    f.write_all(text.as_bytes()).expect("write ruleset");
    let path = f.path().to_str().expect("utf8 path").to_string();
    ns.exec_ok("nft", &["-f", &path]);
}

/// The render of `rs` loaded by nft in a fresh namespace, listed.
fn nft_reference(rs: &Ruleset) -> String {
    let b = NetNs::new("nft-ref");
    nft_load(&b, &rs.render());
    list(&b)
}

#[test]
fn encoder_matches_nft_for_every_expression() {
    require_root!();
    let rs = full_ruleset();
    let a = NetNs::new("nft-eq");
    let stats = apply_in(&a, rs.full_replace()).expect("apply");
    assert!(stats.messages > 10 && stats.bytes > 1000, "{stats:?}");
    let ours = list(&a);
    let reference = nft_reference(&rs);
    assert_eq!(ours, reference, "nft lists our table differently from its own load of render()");
    // Applying the same full replace again is idempotent.
    apply_in(&a, rs.full_replace()).expect("re-apply");
    assert_eq!(list(&a), reference);
    assert_eq!(verify(&rs, read_in(&a).as_ref()), Vec::<String>::new());
}

#[test]
fn diff_after_full_replace_matches_nft() {
    require_root!();
    let rs1 = full_ruleset();
    let a = NetNs::new("nft-diff");
    apply_in(&a, rs1.full_replace()).expect("apply");

    let mut rs2 = rs1.clone();
    // svc-a loses an endpoint and gains a comment-less counter rule; ep-a-2 goes away.
    let svc_a = rs2.chains.get_mut("svc-a").expect("svc-a");
    svc_a.rules = vec![
        r(vec![Expr::Counter]),
        r(vec![
            Expr::L4Proto(Protocol::Tcp),
            Expr::NumgenRandomIs { modulus: 2, value: 0 },
            Expr::Dnat { addr: ip("192.0.2.10"), port: 8080 },
        ]),
    ];
    rs2.chains.remove("ep-a-2");
    // svc-a's affinity set goes with its rules (a set that a dynset bound once lists as `size
    // 65535`, one nft loads fresh does not: the kernel sets the size at the first binding).
    rs2.sets.remove("aff-a");
    let ports = rs2.sets.get_mut("service-ports").expect("map");
    let gone = Key::proto_port(Protocol::Udp, 20002);
    let new = Key::proto_port(Protocol::Tcp, 20004);
    ports.elements.remove(&gone);
    ports.elements.insert(new, Some(goto("svc-b")));

    let mut changes = vec![Change::FlushChain("svc-a".into())];
    changes.extend(
        rs2.chains["svc-a"]
            .rules
            .iter()
            .map(|rule| Change::AddRule { chain: "svc-a".into(), rule: rule.clone() }),
    );
    changes.push(Change::DeleteElements { set: "service-ports".into(), keys: vec![gone] });
    changes.push(Change::AddElements {
        set: "service-ports".into(),
        elements: vec![(new, Some(goto("svc-b")))],
    });
    changes.push(Change::DeleteChain("ep-a-2".into()));
    changes.push(Change::DeleteSet("aff-a".into()));
    apply_in(&a, changes).expect("apply diff");

    assert_eq!(list(&a), nft_reference(&rs2));
    assert_eq!(verify(&rs2, read_in(&a).as_ref()), Vec::<String>::new());
}

#[test]
fn failing_batch_changes_nothing_and_names_the_change() {
    require_root!();
    let rs = full_ruleset();
    let a = NetNs::new("nft-atomic");
    apply_in(&a, rs.full_replace()).expect("apply");
    let before = a.exec_ok("nft", &["list", "ruleset"]);
    let gen_before = a.run(|| NftClient::new().and_then(|mut c| c.generation())).expect("gen");

    let mut changes = rs.full_replace();
    changes.push(Change::AddChain(regular("fresh", vec![])));
    changes.push(Change::AddRule {
        chain: "fresh".into(),
        rule: r(vec![Expr::Verdict(Verdict::Jump("missing".into()))]),
    });
    let n = changes.len();
    let err = apply_in(&a, changes).expect_err("jump to a missing chain must fail");
    let text = err.to_string();
    assert!(text.contains("add rule to chain fresh `jump missing`"), "{text}");
    assert!(text.contains("No such file or directory"), "{text}");
    match err {
        NftError::Kernel { index, errno, .. } => {
            assert_eq!(index, Some(n - 1));
            assert_eq!(errno, 2);
        }
        other => panic!("unexpected error {other:?}"),
    }
    assert_eq!(a.exec_ok("nft", &["list", "ruleset"]), before);
    let gen_after = a.run(|| NftClient::new().and_then(|mut c| c.generation())).expect("gen");
    assert_eq!(gen_before, gen_after, "a failed batch must not commit");
}

/// The agent's full replace, encoded straight from the ruleset: the same table as the change
/// list, and a kernel error names the failing change and its index in `full_replace()`.
#[test]
fn full_replace_from_the_ruleset_matches_the_change_list_and_names_failures() {
    require_root!();
    let rs = full_ruleset();
    let a = NetNs::new("nft-fullref");
    let moved = rs.clone();
    let direct = a
        .run(move || NftClient::new().and_then(|mut c| c.apply_full_replace(&moved, &Default::default())))
        .expect("apply");
    let listed = list(&a);
    let via_list = apply_in(&a, rs.full_replace()).expect("apply list");
    assert_eq!((direct.messages, direct.bytes), (via_list.messages, via_list.bytes));
    assert_eq!(list(&a), listed);
    assert_eq!(listed, nft_reference(&rs));

    let mut broken = rs.clone();
    broken.add_chain(regular("fresh", vec![r(vec![Expr::Verdict(Verdict::Jump("missing".into()))])]));
    let want = broken
        .full_replace()
        .iter()
        .position(|c| matches!(c, Change::AddRule { chain, .. } if &**chain == "fresh"))
        .expect("the rule is in the full replace");
    let gen_before = a.run(|| NftClient::new().and_then(|mut c| c.generation())).expect("gen");
    let err = a
        .run(move || NftClient::new().and_then(|mut c| c.apply_full_replace(&broken, &Default::default())))
        .expect_err("jump to a missing chain must fail");
    let text = err.to_string();
    assert!(text.contains("add rule to chain fresh `jump missing`"), "{text}");
    match err {
        NftError::Kernel { index, errno, .. } => assert_eq!((index, errno), (Some(want), 2)),
        other => panic!("unexpected error {other:?}"),
    }
    assert_eq!(list(&a), listed, "nothing applied");
    let gen_after = a.run(|| NftClient::new().and_then(|mut c| c.generation())).expect("gen");
    assert_eq!(gen_before, gen_after, "a failed batch must not commit");
}

#[test]
fn big_batch_is_one_transaction() {
    require_root!();
    const N: usize = 10_000;
    let mut rs = Ruleset::default();
    let mut elements = BTreeMap::new();
    for i in 0..N {
        let name = format!("svc-{i:05}");
        rs.add_chain(regular(&name, vec![r(vec![Expr::Counter, Expr::Verdict(Verdict::Accept)])]));
        elements.insert(
            Key::proto_port(if i % 2 == 0 { Protocol::Tcp } else { Protocol::Udp }, 10_000 + i as u16),
            Some(goto(&name)),
        );
    }
    rs.add_set(Set {
        name: "service-ports".into(),
        key: vec![KeyType::InetProto, KeyType::InetService],
        kind: SetKind::VerdictMap,
        elements,
        comment: None,
    });
    rs.add_chain(base(
        "nat-prerouting",
        ChainType::Nat,
        Hook::Prerouting,
        -100,
        vec![r(vec![Expr::FibDaddrLocal, Expr::L4ProtoDportVmap { map: "service-ports".into() }])],
    ));
    let a = NetNs::new("nft-big");
    let changes = rs.full_replace();
    let started = std::time::Instant::now();
    let stats = apply_in(&a, changes).expect("big apply");
    eprintln!("big batch: {stats:?} in {:?}", started.elapsed());
    let t = read_in(&a).expect("table");
    assert_eq!(t.chains.len(), N + 1);
    assert_eq!(t.sets["service-ports"].elements.len(), N);
    assert_eq!(verify(&rs, Some(&t)), Vec::<String>::new());
}

fn counter_ruleset() -> Ruleset {
    let mut rs = Ruleset::default();
    rs.add_chain(base(
        "filter-output",
        ChainType::Filter,
        Hook::Output,
        0,
        vec![
            r(vec![
                Expr::L4Proto(Protocol::Udp),
                Expr::DaddrInPrefix { prefix: "127.0.0.0/8".parse().expect("cidr"), negate: false },
                Expr::Counter,
            ])
            .with_comment("loopback udp"),
        ],
    ));
    rs.add_chain(regular("svc-x", vec![r(vec![Expr::Verdict(Verdict::Accept)])]));
    rs.add_set(Set {
        name: "service-ports".into(),
        key: vec![KeyType::InetProto, KeyType::InetService],
        kind: SetKind::VerdictMap,
        elements: BTreeMap::from([
            (Key::proto_port(Protocol::Tcp, 20001), Some(goto("svc-x"))),
            (Key::proto_port(Protocol::Udp, 20001), Some(goto("svc-x"))),
        ]),
        comment: None,
    });
    rs.add_counter(NamedCounter { name: "loopback-udp".into(), comment: Some("named".into()) });
    rs.chains.get_mut("filter-output").expect("chain").rules.push(r(vec![
        Expr::L4Proto(Protocol::Udp),
        Expr::DaddrInPrefix { prefix: "127.0.0.0/8".parse().expect("cidr"), negate: false },
        Expr::CounterRef("loopback-udp".into()),
    ]));
    rs
}

#[test]
fn read_table_and_verify_notice_drift_and_count_packets() {
    require_root!();
    let rs = counter_ruleset();
    let a = NetNs::new("nft-verify");
    apply_in(&a, rs.full_replace()).expect("apply");
    let t = read_in(&a).expect("table");
    assert_eq!(verify(&rs, Some(&t)), Vec::<String>::new());
    let rule = &t.chains["filter-output"].rules[0];
    assert_eq!(rule.comment.as_deref(), Some("loopback udp"));
    assert_eq!(rule.counter.map(|c| c.packets), Some(0));

    // Packets through the counter rule: UDP datagrams to loopback from inside the namespace.
    a.run(|| {
        let s = std::net::UdpSocket::bind("127.0.0.1:0").expect("bind");
        for _ in 0..5 {
            s.send_to(b"hello", "127.0.0.1:9").expect("send");
        }
    });
    let t = read_in(&a).expect("table");
    let c = t.chains["filter-output"].rules[0].counter.expect("counter");
    assert_eq!(c.packets, 5);
    assert_eq!(c.bytes, 5 * (20 + 8 + 5));
    let listed = list(&a);
    assert!(listed.contains(&format!("counter packets {} bytes {}", c.packets, c.bytes)), "{listed}");
    assert_eq!(t.rule_counters().count(), 1);
    // The named counter counted the same packets.
    assert_eq!(t.counters["loopback-udp"].counter, c);
    assert_eq!(t.counters["loopback-udp"].comment.as_deref(), Some("named"));
    // Read by name: one that does not exist is left out, many requests to a datagram.
    let names: Vec<ir::Name> = ["absent", "loopback-udp", "s3.absent"].into_iter().map(Into::into).collect();
    let read =
        a.run(move || NftClient::new().and_then(|mut c| c.read_counters(&names))).expect("read counters");
    assert_eq!(read, BTreeMap::from([("loopback-udp".to_string(), c)]));

    // A hand-added rule is foreign.
    a.exec_ok("nft", &["add", "rule", "inet", "nodelb", "svc-x", "accept"]);
    let d = verify(&rs, read_in(&a).as_ref());
    assert_eq!(d, vec!["chain svc-x: rule 1 is not ours (foreign rule)".to_string()]);

    // A deleted element is missing.
    apply_in(&a, rs.full_replace()).expect("repair");
    a.exec_ok("nft", &["delete", "element", "inet", "nodelb", "service-ports", "{ udp . 20001 }"]);
    let d = verify(&rs, read_in(&a).as_ref());
    assert_eq!(d, vec!["map service-ports: element udp . 20001 missing".to_string()]);

    // A deleted table is reported.
    a.exec_ok("nft", &["delete", "table", "inet", "nodelb"]);
    assert!(read_in(&a).is_none());
    assert_eq!(verify(&rs, None), vec!["table inet nodelb is missing".to_string()]);
}

/// Reading the chains and counters the last ruleset names, by name, gives what dumping them
/// gives: the same table when the kernel holds exactly them, and a dump after all (the table's
/// use count is higher) when it holds more.
#[test]
fn reading_by_name_sees_what_a_dump_sees() {
    require_root!();
    // Anonymous sets too (not in a table's use count).
    let mut rs = full_ruleset();
    // A shard's chain and counter (a name's `s<k>.` prefix is its table).
    rs.add_chain(regular(
        "s1.svc-y",
        vec![r(vec![Expr::CounterRef("s1.conn-y".into()), Expr::Verdict(Verdict::Accept)])],
    ));
    rs.add_counter(NamedCounter { name: "s1.conn-y".into(), comment: Some("shard".into()) });
    let a = NetNs::new("nft-byname");
    apply_in(&a, rs.full_replace()).expect("apply");
    let read = |expected: Option<&Ruleset>| {
        let expected = expected.cloned();
        a.run(move || NftClient::new().and_then(|mut c| c.read_table_expecting(expected.as_ref())))
            .expect("read")
            .expect("table")
    };
    let same_as_dump = |by_name: KernelTable| KernelTable { dumped_tables: 2, ..by_name };

    let dumped = read(None);
    assert_eq!((dumped.dumped_tables, dumped.chains.len(), dumped.counters.len()), (2, 13, 3));
    assert!(dumped.anonymous_sets > 0);
    let by_name = read(Some(&rs));
    assert_eq!(by_name.dumped_tables, 0, "a table's use count did not match what was read");
    assert_eq!(same_as_dump(by_name), dumped);

    // A chain and a counter nodelb did not write: both tables dumped, both seen.
    let shard = ir::Table::Shard(1).name();
    a.exec_ok("nft", &["add", "chain", "inet", "nodelb", "by-hand"]);
    a.exec_ok("nft", &["add", "counter", "inet", &shard, "s1.by-hand"]);
    let dumped = read(None);
    let by_name = read(Some(&rs));
    assert_eq!(by_name.dumped_tables, 2);
    assert_eq!(by_name, dumped);
    assert_eq!(
        verify(&rs, Some(&by_name)),
        vec!["chain by-hand is unexpected".to_string(), "counter s1.by-hand is unexpected".to_string()]
    );

    // A chain of the ruleset gone: read by name (nothing more than named), reported missing.
    a.exec_ok("nft", &["delete", "chain", "inet", "nodelb", "by-hand"]);
    a.exec_ok("nft", &["delete", "counter", "inet", &shard, "s1.by-hand"]);
    a.exec_ok("nft", &["flush", "chain", "inet", &shard, "s1.svc-y"]);
    a.exec_ok("nft", &["delete", "chain", "inet", &shard, "s1.svc-y"]);
    let dumped = read(None);
    let by_name = read(Some(&rs));
    assert_eq!(by_name.dumped_tables, 0);
    assert_eq!(same_as_dump(by_name.clone()), dumped);
    assert_eq!(verify(&rs, Some(&by_name)), vec!["chain s1.svc-y is missing".to_string()]);
}

#[test]
fn delete_table_removes_only_ours_and_generation_moves() {
    require_root!();
    let a = NetNs::new("nft-cleanup");
    a.exec_ok("nft", &["add", "table", "inet", "other"]);
    a.exec_ok("nft", &["add", "chain", "inet", "other", "c"]);
    let (g0, g1, existed, again) = a.run(|| {
        let mut c = NftClient::new().expect("client");
        let g0 = c.generation().expect("gen");
        c.apply(&counter_ruleset().full_replace()).expect("apply");
        let g1 = c.generation().expect("gen");
        let existed = c.delete_table().expect("delete");
        let again = c.delete_table().expect("delete again");
        (g0, g1, existed, again)
    });
    assert_ne!(g0, g1);
    assert!(existed);
    assert!(!again);
    let rest = a.exec_ok("nft", &["list", "tables"]);
    assert_eq!(rest.trim(), "table inet other");
}

/// A batch reports the generation it left, one more than before it (what the agent relies on
/// to tell its own commit from someone else's); a refused batch commits
/// nothing, and another transaction in between shows as a larger step.
#[test]
fn a_batch_reports_the_generation_it_left() {
    require_root!();
    let a = NetNs::new("nft-gen");
    let steps = a.run(move || {
        let mut c = NftClient::new().expect("client");
        let g0 = c.generation().expect("gen");
        let s1 = c.apply(&counter_ruleset().full_replace()).expect("apply");
        let refused = c.apply(&[Change::FlushChain("no-such-chain".into())]);
        let g2 = c.generation().expect("gen");
        // Someone else's transaction (born in this thread's namespace).
        let out = std::process::Command::new("nft").args(["add", "table", "inet", "other"]).output().unwrap();
        assert!(out.status.success());
        let s3 = c.apply(&[Change::AddChain(regular("extra", vec![]))]);
        (g0, s1.generation, refused.is_err(), g2, s3.ok().and_then(|s| s.generation))
    });
    let (g0, g1, refused, g2, g3) = steps;
    assert_eq!(g1, Some(g0.wrapping_add(1)), "{steps:?}");
    assert!(refused, "{steps:?}");
    assert_eq!(Some(g2), g1, "a refused batch commits nothing: {steps:?}");
    assert!(g3.is_some_and(|g| g != g2.wrapping_add(1)), "someone else's commit in between: {steps:?}");
}

/// The elements the packet path put into dynamic sets (affinities) are not configuration: the
/// tamper check ignores them; a full replace deletes them with the table unless they are read
/// first and put back, each with the time it had left.
#[test]
fn dynamic_elements_are_ignored_by_verify_and_put_back_by_a_full_replace() {
    require_root!();
    let rs = full_ruleset();
    let a = NetNs::new("nft-dyn");
    apply_in(&a, rs.full_replace()).expect("apply");
    // What `update @aff-a { ip saddr }` does for two clients (and one for the IPv6 set).
    a.exec_ok(
        "nft",
        &["add", "element", "inet", "nodelb", "aff-a", "{ 203.0.113.10 expires 30m, 203.0.113.11 }"],
    );
    a.exec_ok("nft", &["add", "element", "inet", "nodelb", "aff-b", "{ 2001:db8:1::10 }"]);
    assert_eq!(verify(&rs, read_in(&a).as_ref()), Vec::<String>::new(), "dynamic elements are not drift");

    let sets = [
        ("aff-a", [KeyType::Ipv4Addr].as_slice()),
        ("aff-b", [KeyType::Ipv6Addr].as_slice()),
        ("missing", &[KeyType::Ipv4Addr][..]),
    ];
    let carried = a
        .run(move || NftClient::new().and_then(|mut c| c.read_dynamic_elements(&sets)))
        .expect("read dynamic elements");
    let left = |set: &str, addr: &str| {
        carried[set].iter().find(|(k, _)| *k == Key::addr(ip(addr))).map(|(_, ms)| *ms)
    };
    let (a10, a11, b10) =
        (left("aff-a", "203.0.113.10"), left("aff-a", "203.0.113.11"), left("aff-b", "2001:db8:1::10"));
    assert!(a10.is_some_and(|ms| (29 * 60_000..=30 * 60_000).contains(&ms)), "{carried:?}");
    assert!(
        a11.is_some_and(|ms| (59 * 60_000..=60 * 60_000).contains(&ms)),
        "the set's timeout: {carried:?}"
    );
    assert!(b10.is_some_and(|ms| ms > 23 * 3_600_000), "{carried:?}");
    assert_eq!(carried.len(), 2, "a set that does not exist has none: {carried:?}");

    // Put back by the full replace, expiring as they would have.
    let (moved, kept) = (rs.clone(), carried.clone());
    a.run(move || NftClient::new().and_then(|mut c| c.apply_full_replace(&moved, &kept))).expect("replace");
    let listed = list(&a);
    for needle in ["203.0.113.10 expires 29m", "203.0.113.11 expires 59m", "2001:db8:1::10 expires 23h59m"] {
        assert!(listed.contains(needle), "{needle}:\n{listed}");
    }
    assert_eq!(verify(&rs, read_in(&a).as_ref()), Vec::<String>::new());
    // Without them, a full replace starts afresh.
    let moved = rs.clone();
    a.run(move || NftClient::new().and_then(|mut c| c.apply_full_replace(&moved, &Default::default())))
        .expect("replace");
    assert!(!list(&a).contains("203.0.113.10"), "{}", list(&a));
}

/// The start-up feature probe passes on this kernel and commits nothing, whether or not our
/// table is there: the kernel validates the batch and aborts it.
#[test]
fn kernel_probe_passes_and_commits_nothing() {
    require_root!();
    let a = NetNs::new("nft-probe");
    let probe = nodelb::core::ruleset::kernel_support::probe();
    let check = |ns: &NetNs| {
        let probe = probe.clone();
        ns.run(move || nodelb::apply::kernel::check_probe(&mut NftClient::new().expect("netlink"), &probe))
    };
    let gen_of = |ns: &NetNs| ns.run(|| NftClient::new().and_then(|mut c| c.generation())).expect("gen");
    let gen_before = gen_of(&a);
    check(&a).expect("this kernel has every feature");
    assert_eq!(gen_of(&a), gen_before, "the probe must not commit");
    assert_eq!(a.exec_ok("nft", &["list", "ruleset"]).trim(), "", "the probe must leave nothing");

    apply_in(&a, full_ruleset().full_replace()).expect("apply");
    let before = a.exec_ok("nft", &["list", "ruleset"]);
    let gen_before = gen_of(&a);
    check(&a).expect("the probe passes next to our table");
    assert_eq!(gen_of(&a), gen_before, "the probe must not commit");
    assert_eq!(a.exec_ok("nft", &["list", "ruleset"]), before, "our table is untouched");
}

/// A probe change the kernel refuses is reported as the feature it tests, with its release.
#[test]
fn kernel_probe_refusal_names_the_feature() {
    require_root!();
    let a = NetNs::new("nft-probe-no");
    let mut probe = nodelb::core::ruleset::kernel_support::probe();
    let missing = nodelb::core::ruleset::kernel_support::Feature {
        what: "jumps to chains that do not exist",
        since: "99.1",
    };
    let chain = match &probe[5].0 {
        Change::AddChain(c) => c.name.clone(),
        other => panic!("the probe's sixth change adds a chain, not {other:?}"),
    };
    probe.push((
        Change::AddRule { chain, rule: r(vec![Expr::Verdict(Verdict::Jump("missing".into()))]) },
        missing,
    ));
    let err = a
        .run(move || nodelb::apply::kernel::check_probe(&mut NftClient::new().expect("netlink"), &probe))
        .expect_err("a jump to a missing chain is refused");
    let text = err.to_string();
    assert!(text.contains("lacks jumps to chains that do not exist (Linux 99.1"), "{text}");
    assert!(text.contains("No such file or directory"), "{text}");
    assert_eq!(a.exec_ok("nft", &["list", "ruleset"]).trim(), "", "a refused probe leaves nothing");
}
