use super::*;

/// A chain of one table, by name, base (priority, policy drop) and rules.
type MakeChain = fn(&str, Option<(i32, bool)>, Vec<HostRule>) -> HostChain;
/// Name, chains, mark, expected changes.
type AcceptCase = (&'static str, Vec<HostChain>, Option<u32>, Vec<&'static str>);
/// Name, chains, families, mark, expected findings.
type AnalysisCase = (&'static str, Vec<HostChain>, &'static [Family], Option<u32>, Vec<&'static str>);

const NEW_DNAT_ACCEPT: &str = "-m conntrack --ctstate DNAT -j ACCEPT";
const MARK: u32 = 0x2000;

fn rule(tests: Vec<Test>, action: Action) -> HostRule {
    HostRule { tests, action, comment: None, handle: None }
}
fn other(s: &str) -> Test {
    Test::Other(s.into())
}
fn ctstate(states: u32) -> Test {
    Test::CtState { states, snat: false, dnat: false, invert: false }
}
fn jump(c: &str) -> Action {
    Action::Jump(c.into())
}
fn chain(
    source: Source,
    family: TableFamily,
    table: &str,
    name: &str,
    base: Option<(i32, bool)>,
    rules: Vec<HostRule>,
) -> HostChain {
    HostChain {
        source,
        family,
        table: table.into(),
        name: name.into(),
        base: base.map(|(priority, policy_drop)| HostBase { priority, policy_drop }),
        rules,
    }
}
fn ipt(name: &str, base: Option<(i32, bool)>, rules: Vec<HostRule>) -> HostChain {
    chain(Source::Nftables, TableFamily::Ip, "filter", name, base, rules)
}
fn legacy(name: &str, base: Option<(i32, bool)>, rules: Vec<HostRule>) -> HostChain {
    chain(Source::IptablesLegacy, TableFamily::Ip, "filter", name, base, rules)
}
fn our_accept() -> HostRule {
    HostRule {
        comment: Some("nodelb-forward-accept".into()),
        ..rule(vec![Test::Mark { mask: MARK, value: MARK, invert: false }], Action::Accept)
    }
}
fn dnat_accept() -> HostRule {
    let _ = NEW_DNAT_ACCEPT;
    rule(vec![Test::CtState { states: 0, snat: false, dnat: true, invert: false }], Action::Accept)
}

/// Docker ≥ 28 on iptables (nft or legacy): policy drop, DOCKER-USER, DOCKER-FORWARD.
fn docker28(mk: MakeChain, head: Vec<HostRule>) -> Vec<HostChain> {
    let mut forward = head;
    forward.push(rule(vec![], jump("DOCKER-USER")));
    forward.push(rule(vec![], jump("DOCKER-FORWARD")));
    vec![
        mk("FORWARD", Some((0, true)), forward),
        mk("DOCKER-USER", None, vec![rule(vec![], Action::Return)]),
        mk(
            "DOCKER-FORWARD",
            None,
            vec![
                rule(vec![], jump("DOCKER-CT")),
                rule(vec![], jump("DOCKER-ISOLATION-STAGE-1")),
                rule(vec![], jump("DOCKER-BRIDGE")),
                rule(vec![other("iifname \"docker0\"")], Action::Accept),
            ],
        ),
        mk(
            "DOCKER-CT",
            None,
            vec![rule(
                vec![other("oifname \"docker0\""), ctstate(ct_state::ESTABLISHED | ct_state::RELATED)],
                Action::Accept,
            )],
        ),
        mk(
            "DOCKER-ISOLATION-STAGE-1",
            None,
            vec![rule(
                vec![other("iifname \"docker0\""), other("oifname != \"docker0\"")],
                jump("DOCKER-ISOLATION-STAGE-2"),
            )],
        ),
        mk("DOCKER-ISOLATION-STAGE-2", None, vec![rule(vec![other("oifname \"docker0\"")], Action::Drop)]),
        mk("DOCKER-BRIDGE", None, vec![rule(vec![other("oifname \"docker0\"")], jump("DOCKER"))]),
        mk(
            "DOCKER",
            None,
            vec![rule(vec![other("iifname != \"docker0\""), other("oifname \"docker0\"")], Action::Drop)],
        ),
    ]
}

/// The same host without Docker's interface-scoped accept: only the established one.
fn docker_without_bridge_accept(mk: MakeChain) -> Vec<HostChain> {
    let mut chains = docker28(mk, vec![]);
    chains.retain(|c| c.name != "DOCKER-FORWARD");
    chains.push(mk(
        "DOCKER-FORWARD",
        None,
        vec![rule(vec![], jump("DOCKER-CT")), rule(vec![], jump("DOCKER-ISOLATION-STAGE-1"))],
    ));
    chains
}

/// firewalld (nftables backend): `inet firewalld` filter_FORWARD at filter + 10, accepting
/// DNATed connections unless StrictForwardPorts, rejecting at its end.
fn firewalld(strict: bool) -> Vec<HostChain> {
    let fw = |name: &str, base: Option<(i32, bool)>, rules| {
        chain(Source::Nftables, TableFamily::Inet, "firewalld", name, base, rules)
    };
    let mut forward = vec![
        rule(vec![ctstate(ct_state::ESTABLISHED | ct_state::RELATED)], Action::Accept),
        rule(vec![Test::CtStatus { mask: 1 << 5, invert: false }], Action::Accept),
        rule(vec![other("iifname \"lo\"")], Action::Accept),
        rule(vec![ctstate(ct_state::INVALID)], Action::Drop),
        rule(vec![Test::NfProto { proto: 10, invert: false }, other("ip6 daddr { ::/96 }")], Action::Reject),
        rule(vec![], jump("filter_FORWARD_ZONES")),
        rule(vec![], Action::Reject),
    ];
    if strict {
        forward.remove(1);
    }
    vec![
        fw("filter_FORWARD", Some((10, false)), forward),
        fw(
            "filter_FORWARD_ZONES",
            None,
            vec![
                rule(vec![other("iifname \"eth1\"")], Action::Goto("filter_FWD_internal".into())),
                rule(vec![], Action::Goto("filter_FWD_public".into())),
            ],
        ),
        fw("filter_FWD_internal", None, vec![rule(vec![other("oifname \"eth1\"")], Action::Accept)]),
        fw("filter_FWD_public", None, vec![rule(vec![], jump("filter_FWD_public_allow"))]),
        fw("filter_FWD_public_allow", None, vec![rule(vec![other("oifname \"eth0\"")], Action::Accept)]),
    ]
}

/// ufw on iptables: policy drop; before-forward accepts established and ICMP; user rules.
fn ufw(user: Vec<HostRule>) -> Vec<HostChain> {
    vec![
        legacy(
            "FORWARD",
            Some((0, true)),
            vec![
                rule(vec![], jump("ufw-before-logging-forward")),
                rule(vec![], jump("ufw-before-forward")),
                rule(vec![], jump("ufw-after-forward")),
                rule(vec![], jump("ufw-reject-forward")),
            ],
        ),
        legacy("ufw-before-logging-forward", None, vec![]),
        legacy(
            "ufw-before-forward",
            None,
            vec![
                rule(
                    vec![Test::CtState {
                        states: ct_state::ESTABLISHED | ct_state::RELATED,
                        snat: false,
                        dnat: false,
                        invert: false,
                    }],
                    Action::Accept,
                ),
                rule(vec![other("-p icmp --icmp-type 3")], Action::Accept),
                rule(vec![], jump("ufw-user-forward")),
            ],
        ),
        legacy("ufw-user-forward", None, user),
        legacy("ufw-after-forward", None, vec![]),
        legacy("ufw-reject-forward", None, vec![]),
    ]
}

fn summary(findings: &[Finding]) -> Vec<String> {
    findings
        .iter()
        .map(|f| {
            format!(
                "{} {} {}: {}{}",
                f.family,
                f.location(),
                if f.certain() { "certain" } else { "uncertain" },
                f.drop,
                if f.partial.is_empty() { String::new() } else { format!(" partial={}", f.partial.len()) }
            )
        })
        .collect()
}

#[test]
fn analysis_table() {
    static V4: [Family; 1] = [Family::Ipv4];
    static BOTH: [Family; 2] = [Family::Ipv4, Family::Ipv6];
    let (v4, both): (&'static [Family], &'static [Family]) = (&V4, &BOTH);
    #[rustfmt::skip]
        let cases: Vec<AnalysisCase> = vec![
            ("nothing", vec![], both, None, vec![]),
            ("iptables-nft -P FORWARD DROP",
                vec![ipt("FORWARD", Some((0, true)), vec![])], v4, None,
                vec!["ipv4 table ip filter chain FORWARD certain: policy drop"]),
            ("an ip table does not see ipv6",
                vec![ipt("FORWARD", Some((0, true)), vec![])], both, None,
                vec!["ipv4 table ip filter chain FORWARD certain: policy drop"]),
            ("policy accept", vec![ipt("FORWARD", Some((0, false)), vec![])], v4, None, vec![]),
            ("our accept at the head", vec![ipt("FORWARD", Some((0, true)), vec![our_accept()])], v4, Some(MARK), vec![]),
            ("our accept but the flag is off: a mark nodelb does not set",
                vec![ipt("FORWARD", Some((0, true)), vec![our_accept()])], v4, None,
                vec!["ipv4 table ip filter chain FORWARD uncertain: policy drop partial=1"]),
            ("a drop before our accept",
                vec![ipt("FORWARD", Some((0, true)), vec![rule(vec![], Action::Drop), our_accept()])], v4, Some(MARK),
                vec!["ipv4 table ip filter chain FORWARD certain: rule 1 of chain FORWARD (drop)"]),
            ("ctstate DNAT accept (klipper-style)", vec![ipt("FORWARD", Some((0, true)), vec![dnat_accept()])], v4, None, vec![]),
            ("ctstate NEW accept", vec![ipt("FORWARD", Some((0, true)), vec![rule(vec![ctstate(ct_state::NEW)], Action::Accept)])], v4, None, vec![]),
            ("established only: still dropped",
                vec![ipt("FORWARD", Some((0, true)), vec![rule(vec![ctstate(ct_state::ESTABLISHED | ct_state::RELATED)], Action::Accept)])], v4, None,
                vec!["ipv4 table ip filter chain FORWARD certain: policy drop"]),
            ("a conditional drop is not judged", vec![ipt("FORWARD", Some((0, false)), vec![rule(vec![other("-p tcp")], Action::Drop)])], v4, None, vec![]),
            ("an unconditional reject at the end",
                vec![ipt("FORWARD", Some((0, false)), vec![rule(vec![ctstate(ct_state::ESTABLISHED)], Action::Accept), rule(vec![], Action::Reject)])], v4, None,
                vec!["ipv4 table ip filter chain FORWARD certain: rule 2 of chain FORWARD (reject)"]),
            ("docker 28, iptables-nft: docker0's accept makes it uncertain",
                docker28(ipt, vec![]), v4, None,
                vec!["ipv4 table ip filter chain FORWARD uncertain: policy drop partial=1"]),
            ("docker 28, iptables-legacy", docker28(legacy, vec![]), v4, None,
                vec!["ipv4 iptables-legacy table filter chain FORWARD uncertain: policy drop partial=1"]),
            ("docker without a bridge accept: certain", docker_without_bridge_accept(ipt), v4, None,
                vec!["ipv4 table ip filter chain FORWARD certain: policy drop"]),
            ("docker with our accept at the head", docker28(ipt, vec![our_accept()]), v4, Some(MARK), vec![]),
            ("docker with DOCKER-USER's jump re-inserted ahead of ours", {
                let mut c = docker28(ipt, vec![]);
                c[0].rules.insert(1, our_accept());
                c
            }, v4, Some(MARK), vec![]),
            ("an accept for DNAT in DOCKER-USER", {
                let mut c = docker28(ipt, vec![]);
                c[1].rules.insert(0, dnat_accept());
                c
            }, v4, None, vec![]),
            ("a drop in DOCKER-USER before anything", {
                let mut c = docker28(ipt, vec![our_accept()]);
                c[0].rules.swap(0, 1); // -j DOCKER-USER first
                c[1].rules.insert(0, rule(vec![], Action::Drop));
                c
            }, v4, Some(MARK), vec!["ipv4 table ip filter chain FORWARD certain: rule 1 of chain DOCKER-USER (drop)"]),
            ("firewalld accepts DNATed connections", firewalld(false), both, None, vec![]),
            ("firewalld StrictForwardPorts: rejected unless a zone forwards them", firewalld(true), both, None, vec![
                "ipv4 table inet firewalld chain filter_FORWARD uncertain: rule 6 of chain filter_FORWARD (reject) partial=3",
                "ipv6 table inet firewalld chain filter_FORWARD uncertain: rule 6 of chain filter_FORWARD (reject) partial=3",
            ]),
            ("ufw (legacy) with no route rules", ufw(vec![]), v4, None,
                vec!["ipv4 iptables-legacy table filter chain FORWARD uncertain: policy drop partial=1"]),
            ("ufw route allow to the pod network", ufw(vec![rule(vec![other("-d 10.42.0.0/16")], Action::Accept)]), v4, None,
                vec!["ipv4 iptables-legacy table filter chain FORWARD uncertain: policy drop partial=2"]),
            ("a jump to a chain nodelb did not read", vec![ipt("FORWARD", Some((0, true)), vec![rule(vec![], jump("GONE"))])], v4, None,
                vec!["ipv4 table ip filter chain FORWARD uncertain: policy drop"]),
            ("a conditional return before a drop",
                vec![ipt("FORWARD", Some((0, false)), vec![rule(vec![], jump("X"))]), ipt("X", None, vec![rule(vec![other("-s 10.0.0.0/8")], Action::Return), rule(vec![], Action::Drop)])], v4, None,
                vec!["ipv4 table ip filter chain FORWARD uncertain: rule 2 of chain X (drop)"]),
            ("a verdict map", vec![ipt("FORWARD", Some((0, true)), vec![rule(vec![other("iifname")], Action::Unknown("vmap @jumps".into()))])], v4, None,
                vec!["ipv4 table ip filter chain FORWARD uncertain: policy drop"]),
            ("an inet table: nfproto tests", vec![chain(Source::Nftables, TableFamily::Inet, "t", "fwd", Some((0, false)), vec![
                    rule(vec![Test::NfProto { proto: 2, invert: false }], Action::Drop)])], both, None,
                vec!["ipv4 table inet t chain fwd certain: rule 1 of chain fwd (meta nfproto ipv4 drop)"]),
            ("a loop of jumps stops", vec![ipt("FORWARD", Some((0, true)), vec![rule(vec![], jump("A"))]), ipt("A", None, vec![rule(vec![other("x")], jump("A"))])], v4, None,
                vec!["ipv4 table ip filter chain FORWARD uncertain: policy drop"]),
            ("goto: the target's end ends the base chain",
                vec![ipt("FORWARD", Some((0, true)), vec![rule(vec![], Action::Goto("A".into())), rule(vec![], Action::Accept)]), ipt("A", None, vec![])], v4, None,
                vec!["ipv4 table ip filter chain FORWARD certain: policy drop"]),
            ("jump: the target's end comes back",
                vec![ipt("FORWARD", Some((0, true)), vec![rule(vec![], jump("A")), rule(vec![], Action::Accept)]), ipt("A", None, vec![])], v4, None, vec![]),
            ("mark tests with other bits cannot be judged",
                vec![ipt("FORWARD", Some((0, true)), vec![rule(vec![Test::Mark { mask: 0xff00, value: MARK, invert: false }], Action::Accept)])], v4, Some(MARK),
                vec!["ipv4 table ip filter chain FORWARD uncertain: policy drop partial=1"]),
            ("ct status without dnat bits cannot be judged",
                vec![ipt("FORWARD", Some((0, true)), vec![rule(vec![Test::CtStatus { mask: 1 << 3, invert: false }], Action::Accept)])], v4, None,
                vec!["ipv4 table ip filter chain FORWARD uncertain: policy drop partial=1"]),
        ];
    let mut failures = Vec::new();
    for (name, chains, families, mark, want) in cases {
        let got = summary(&analyse(&chains, families, mark));
        if got != want {
            failures.push(format!("{name}:\n  want {want:?}\n  got  {got:?}"));
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

#[test]
fn accept_changes_table() {
    let ours = |bit: u32| HostRule {
        comment: Some(accept_comment(bit)),
        handle: Some(9),
        ..rule(vec![Test::Mark { mask: bit, value: bit, invert: false }], Action::Accept)
    };
    let other_rule = rule(vec![other("-p tcp")], Action::Drop);
    let fwd = |rules| ipt("FORWARD", Some((0, true)), rules);
    let summary = |c: Vec<AcceptChange>| {
        c.iter().map(|c| format!("{} {:?} {:?}", c.family.name(), c.stale, c.insert)).collect::<Vec<_>>()
    };
    #[rustfmt::skip]
        let cases: Vec<AcceptCase> = vec![
            ("no iptables chain: nothing created", vec![], Some(MARK), vec![]),
            ("missing: inserted", vec![fwd(vec![other_rule.clone()])], Some(MARK), vec!["ip [] Some(8192)"]),
            ("present: left alone, wherever it is", vec![fwd(vec![other_rule.clone(), ours(MARK)])], Some(MARK), vec![]),
            ("another mark: replaced", vec![fwd(vec![ours(0x100), other_rule.clone()])], Some(MARK), vec!["ip [0] Some(8192)"]),
            ("twice (restored twice): one left", vec![fwd(vec![ours(MARK), other_rule.clone(), ours(MARK)])], Some(MARK), vec!["ip [0, 2] Some(8192)"]),
            ("flag off: removed", vec![fwd(vec![other_rule.clone(), ours(MARK)])], None, vec!["ip [1] None"]),
            ("flag off, none there: nothing", vec![fwd(vec![other_rule.clone()])], None, vec![]),
            ("ip6 and legacy too", vec![
                chain(Source::Nftables, TableFamily::Ip6, "filter", "FORWARD", Some((0, false)), vec![]),
                legacy("FORWARD", Some((0, true)), vec![]),
            ], Some(MARK), vec!["ip6 [] Some(8192)", "ip [] Some(8192)"]),
            ("not iptables' chains", vec![
                chain(Source::Nftables, TableFamily::Inet, "filter", "FORWARD", Some((0, true)), vec![]),
                ipt("forward", Some((0, true)), vec![]),
                ipt("FORWARD", None, vec![]),
            ], Some(MARK), vec![]),
            ("a hand-copied rule without our comment is not ours", vec![fwd(vec![HostRule { comment: None, ..ours(MARK) }])], None, vec![]),
        ];
    for (name, chains, mark, want) in cases {
        assert_eq!(summary(accept_changes(&chains, mark)), want, "{name}");
    }
}

#[test]
fn fixes_name_the_tool_and_the_flag() {
    let f = |source, table_family, table: &str, chain: &str, family| Finding {
        family,
        source,
        table_family,
        table: table.into(),
        chain: chain.into(),
        priority: 0,
        drop: "policy drop".into(),
        partial: vec![],
        uncertain: false,
    };
    let nft4 = f(Source::Nftables, TableFamily::Ip, "filter", "FORWARD", Family::Ipv4);
    assert!(nft4.fix(false).contains("--iptables-forward-accept"), "{}", nft4.fix(false));
    assert!(nft4.fix(false).contains("`iptables-nft -I FORWARD -m conntrack --ctstate DNAT -j ACCEPT`"));
    assert!(nft4.fix(true).contains("not ahead of this drop"));
    let legacy6 = f(Source::IptablesLegacy, TableFamily::Ip6, "filter", "FORWARD", Family::Ipv6);
    assert_eq!(legacy6.location(), "ip6tables-legacy table filter chain FORWARD");
    assert!(legacy6.fix(false).contains("`ip6tables-legacy -I FORWARD"));
    let fw = f(Source::Nftables, TableFamily::Inet, "firewalld", "filter_FORWARD", Family::Ipv4);
    assert!(!fw.iptables_filter_forward() && fw.fix(false).contains("firewalld"));
    let other = f(Source::Nftables, TableFamily::Inet, "filter", "FORWARD", Family::Ipv4);
    assert!(!other.iptables_filter_forward(), "an inet table is not iptables'");
    assert!(other.fix(false).contains("nft insert rule inet filter FORWARD ct status dnat accept"));
    assert_eq!(
        nft4.describe(),
        "table ip filter chain FORWARD (forward hook, priority 0) drops nodelb's new ipv4 connections: policy drop"
    );
}

#[test]
fn evidence_follows_the_counters() {
    let mut e = Evidence::default();
    let c = |entered, passed| ForwardCounts { entered, passed };
    let f = Family::Ipv4;
    e.observe(f, c(5, 5), 100);
    assert_eq!(e.state(f), None, "the first reading is a baseline");
    e.observe(f, c(5, 5), 101);
    assert_eq!(e.state(f), None, "no traffic, nothing known");
    e.observe(f, c(7, 5), 102);
    assert_eq!(e.state(f), Some(EvidenceState::Dropping { since: 102, connections: 2 }));
    e.observe(f, c(7, 5), 103);
    assert_eq!(e.state(f), Some(EvidenceState::Dropping { since: 102, connections: 2 }), "idle: kept");
    e.observe(f, c(8, 5), 104);
    assert_eq!(e.state(f), Some(EvidenceState::Dropping { since: 102, connections: 3 }));
    e.observe(f, c(9, 6), 105);
    assert_eq!(e.state(f), Some(EvidenceState::Passing), "one got through");
    e.observe(f, c(1, 0), 106);
    assert_eq!(e.state(f), Some(EvidenceState::Passing), "counters reset (table replaced): a new baseline");
    e.observe(f, c(2, 0), 107);
    assert_eq!(e.state(f), Some(EvidenceState::Dropping { since: 107, connections: 1 }));
    e.forget();
    assert_eq!(e.state(f), None);
    e.observe(f, c(5, 0), 108);
    assert_eq!(e.state(f), None, "connections counted before the rules changed say nothing");
    e.observe(f, c(5, 1), 109);
    assert_eq!(e.state(f), Some(EvidenceState::Passing));
    assert_eq!(e.state(Family::Ipv6), None);
}

#[test]
fn diagnosis_table() {
    let both = [Family::Ipv4, Family::Ipv6];
    let finding = |family, partial: Vec<&str>| Finding {
        family,
        source: Source::Nftables,
        table_family: TableFamily::Ip,
        table: "filter".into(),
        chain: "FORWARD".into(),
        priority: 0,
        drop: "policy drop".into(),
        partial: partial.into_iter().map(String::from).collect(),
        uncertain: false,
    };
    fn dropping(e: &mut Evidence, f: Family) {
        e.observe(f, ForwardCounts { entered: 0, passed: 0 }, 10);
        e.observe(f, ForwardCounts { entered: 3, passed: 0 }, 20);
    }
    fn passing(e: &mut Evidence, f: Family) {
        e.observe(f, ForwardCounts { entered: 0, passed: 0 }, 10);
        e.observe(f, ForwardCounts { entered: 3, passed: 1 }, 20);
    }
    type Case = (&'static str, Vec<Finding>, fn(&mut Evidence), [&'static str; 2]);
    #[rustfmt::skip]
        let cases: Vec<Case> = vec![
            ("clean", vec![], |_| {}, ["-", "-"]),
            ("certain finding: blocked", vec![finding(Family::Ipv4, vec![])], |_| {}, ["blocked", "-"]),
            ("uncertain, no traffic: suspect", vec![finding(Family::Ipv4, vec!["-i docker0 accept"])], |_| {}, ["suspect", "-"]),
            ("uncertain and dropping: blocked", vec![finding(Family::Ipv4, vec!["-i docker0 accept"])], |e| dropping(e, Family::Ipv4), ["blocked", "-"]),
            ("uncertain but passing: fine", vec![finding(Family::Ipv4, vec!["-d 10.42.0.0/16 accept"])], |e| passing(e, Family::Ipv4), ["-", "-"]),
            ("evidence only: reported, not blocked", vec![], |e| dropping(e, Family::Ipv6), ["-", "evidence"]),
            ("certain wins over passing evidence", vec![finding(Family::Ipv6, vec![])], |e| passing(e, Family::Ipv6), ["-", "blocked"]),
        ];
    for (name, findings, setup, want) in cases {
        let mut e = Evidence::default();
        setup(&mut e);
        let d = diagnose(&findings, &e, &both, false);
        let got: Vec<&str> = both
            .iter()
            .map(|f| {
                let d = &d[f];
                match (&d.blocked, &d.evidence, d.suspect.is_empty()) {
                    (Some(_), _, _) => "blocked",
                    (None, Some(_), _) => "evidence",
                    (None, None, false) => "suspect",
                    (None, None, true) => "-",
                }
            })
            .collect();
        assert_eq!(got, want, "{name}: {d:?}");
    }
    let mut e = Evidence::default();
    dropping(&mut e, Family::Ipv4);
    let d = diagnose(&[finding(Family::Ipv4, vec!["-i docker0 accept"])], &e, &[Family::Ipv4], false);
    let reason = d[&Family::Ipv4].blocked.clone().unwrap();
    assert!(
            reason.starts_with("new ipv4 connections of nodelb Services entered the forward path since 1970-01-01T00:00:20Z and none left it: table ip filter chain FORWARD"),
            "{reason}"
        );
    assert!(reason.contains("fix: run nodelb with --iptables-forward-accept"), "{reason}");
    assert_eq!(blocked_families(&d), BTreeSet::from([Family::Ipv4]));
}
