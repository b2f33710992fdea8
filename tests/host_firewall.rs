//! Hosts whose firewall drops forwarded traffic (issue 13, point 1), on the real kernel: the
//! chains iptables-nft and iptables-legacy write, read back and judged by nodelb; nodelb's
//! ACCEPT written into iptables' FORWARD chain as the host's own tools expect it; and, end to end,
//! the agent's diagnosis and `--iptables-forward-accept` with real packets.
//!
//! Every test builds its own network namespaces; `iptables-nft`/`iptables-legacy` run only
//! inside them (tests may run iptables to set up and inspect; the agent never does), with
//! `XTABLES_LOCKFILE` pointing at a file of the test's own.
mod common;

use std::process::Output;

use common::netns::NetNs;
use nodelb::hostfw::{self, Action, HostChain, Source, TableFamily, Test};
use nodelb::ir::Family;
use nodelb::nft::NftClient;
use nodelb::nft::foreign::AcceptWrite;
use nodelb::xtables::{Layout, Xtables};

/// The xtables lock of this test process (iptables-legacy takes it; so does the agent).
fn lockfile() -> String {
    let path = std::env::temp_dir().join(format!("nodelb-test-xtables-{}.lock", std::process::id()));
    path.to_string_lossy().into_owned()
}

/// `<tool> <args>` in `ns` (with this test's xtables lock); the whole output.
fn xt(ns: &NetNs, tool: &str, args: &[&str]) -> Output {
    let mut full = vec!["netns", "exec", ns.name.as_str(), "env"];
    let lock = format!("XTABLES_LOCKFILE={}", lockfile());
    full.push(&lock);
    full.push(tool);
    full.extend_from_slice(args);
    std::process::Command::new("ip").args(&full).output().expect("spawn ip netns exec")
}

/// Like [`xt`], panicking unless it succeeds with nothing on stderr; returns stdout.
fn xt_clean(ns: &NetNs, tool: &str, args: &[&str]) -> String {
    let out = xt(ns, tool, args);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success() && stderr.is_empty(), "{tool} {args:?}: {:?}, stderr: {stderr}", out.status);
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn forward_chains(ns: &NetNs) -> (u32, Vec<HostChain>) {
    ns.run(|| NftClient::new().and_then(|mut c| c.read_forward_chains())).expect("read forward chains")
}

/// Docker 28's FORWARD layout, written by iptables-nft itself, reads back as the chains the
/// analysis expects (native and compat expressions alike), and is judged like Docker's.
#[test]
fn iptables_nft_chains_read_back_as_written() {
    require_root!();
    let ns = NetNs::new("fwread");
    for args in [
        "-N DOCKER",
        "-N DOCKER-USER",
        "-N DOCKER-FORWARD",
        "-N DOCKER-CT",
        "-P FORWARD DROP",
        "-A DOCKER-USER -j RETURN",
        "-A FORWARD -j DOCKER-USER",
        "-A FORWARD -j DOCKER-FORWARD",
        "-A DOCKER-CT -o docker0 -m conntrack --ctstate RELATED,ESTABLISHED -j ACCEPT",
        "-A DOCKER-FORWARD -j DOCKER-CT",
        "-A DOCKER-FORWARD -o docker0 -j DOCKER",
        "-A DOCKER-FORWARD -i docker0 -j ACCEPT",
        "-A DOCKER ! -i docker0 -o docker0 -j DROP",
        // Not reached from FORWARD: never read.
        "-N UNUSED",
        "-A UNUSED -j DROP",
    ] {
        xt_clean(&ns, "iptables-nft", &args.split(' ').collect::<Vec<_>>());
    }
    let (_, chains) = forward_chains(&ns);
    let names: Vec<&str> = chains.iter().map(|c| c.name.as_str()).collect();
    assert_eq!(names, ["FORWARD", "DOCKER-USER", "DOCKER-FORWARD", "DOCKER-CT", "DOCKER"], "breadth first");
    let forward = &chains[0];
    assert_eq!(
        (forward.source, forward.family, forward.table.as_str()),
        (Source::Nftables, TableFamily::Ip, "filter")
    );
    assert_eq!(forward.base.map(|b| (b.priority, b.policy_drop)), Some((0, true)));
    let actions: Vec<&Action> = forward.rules.iter().map(|r| &r.action).collect();
    assert_eq!(actions, [&Action::Jump("DOCKER-USER".into()), &Action::Jump("DOCKER-FORWARD".into())]);
    let ct = &chains[3].rules[0];
    assert_eq!(
        ct.tests,
        vec![
            Test::Other("oifname == \"docker0\"".into()),
            Test::CtState {
                states: hostfw::ct_state::ESTABLISHED | hostfw::ct_state::RELATED,
                snat: false,
                dnat: false,
                invert: false
            },
        ],
        "-m conntrack is a compat match: {ct}"
    );
    let findings = hostfw::analyse(&chains, &[Family::Ipv4, Family::Ipv6], None);
    assert_eq!(findings.len(), 1, "{findings:?}");
    assert_eq!(findings[0].drop, "policy drop");
    assert_eq!(findings[0].partial, ["rule 3 of chain DOCKER-FORWARD (iifname == \"docker0\" accept)"]);
    assert!(!findings[0].certain());

    // A DNAT accept in DOCKER-USER lets nodelb's connections through.
    xt_clean(
        &ns,
        "iptables-nft",
        &["-I", "DOCKER-USER", "-m", "conntrack", "--ctstate", "DNAT", "-j", "ACCEPT"],
    );
    let (_, chains) = forward_chains(&ns);
    let user = chains.iter().find(|c| c.name == "DOCKER-USER").expect("DOCKER-USER");
    assert_eq!(
        user.rules[0].tests,
        vec![Test::CtState { states: 0, snat: false, dnat: true, invert: false }],
        "{}",
        user.rules[0]
    );
    assert_eq!(hostfw::analyse(&chains, &[Family::Ipv4], None), vec![]);
}

/// Brings iptables-nft's FORWARD chains in `ns` to hold nodelb's ACCEPT for `mark` (or none),
/// the way the agent does: one batch per chain, each decided on a fresh read.
fn sync_nft_accept(ns: &NetNs, mark: Option<u32>) -> usize {
    let mut batches = 0;
    loop {
        let (generation, chains) = forward_chains(ns);
        let changes: Vec<_> = hostfw::accept_changes(&chains, mark)
            .into_iter()
            .filter(|c| c.source == Source::Nftables)
            .collect();
        let Some(change) = changes.into_iter().next() else { return batches };
        let chain = chains
            .iter()
            .find(|c| c.family == change.family && c.table == change.table && c.name == change.chain)
            .expect("the chain the change is for");
        let stale: Vec<u64> = change.stale.iter().filter_map(|&i| chain.rules[i].handle).collect();
        let nfproto = if change.family == TableFamily::Ip6 { 10 } else { 2 };
        ns.run(move || {
            let write = AcceptWrite {
                genid: generation,
                nfproto,
                table: &change.table,
                chain: &change.chain,
                stale: &stale,
                insert: change.insert,
            };
            NftClient::new().and_then(|mut n| n.write_forward_accept(&write))
        })
        .unwrap_or_else(|e| panic!("write accept: {e}"));
        batches += 1;
        assert!(batches <= 4, "accept changes do not converge");
    }
}

/// nodelb's ACCEPT in iptables-nft's FORWARD: at the head, listed by `iptables-nft -S`/`-L`
/// (and `ip6tables-nft`) without errors or warnings, judged as accepting nodelb's connections,
/// put back when the chain is flushed, replaced when the mark changes, and removed leaving the
/// chain exactly as before.
#[test]
fn accept_rule_is_what_iptables_nft_lists() {
    require_root!();
    let ns = NetNs::new("fwaccept");
    for tool in ["iptables-nft", "ip6tables-nft"] {
        xt_clean(&ns, tool, &["-P", "FORWARD", "DROP"]);
        xt_clean(&ns, tool, &["-A", "FORWARD", "-p", "tcp", "--dport", "22", "-j", "DROP"]);
        xt_clean(
            &ns,
            tool,
            &["-A", "FORWARD", "-m", "conntrack", "--ctstate", "RELATED,ESTABLISHED", "-j", "ACCEPT"],
        );
    }
    let saved = || (xt_clean(&ns, "iptables-nft-save", &[]), xt_clean(&ns, "ip6tables-nft-save", &[]));
    let strip_dates = |(a, b): (String, String)| {
        let keep = |s: String| s.lines().filter(|l| !l.starts_with('#')).collect::<Vec<_>>().join("\n");
        (keep(a), keep(b))
    };
    let before = strip_dates(saved());
    let (_, chains) = forward_chains(&ns);
    assert_eq!(hostfw::analyse(&chains, &[Family::Ipv4, Family::Ipv6], Some(0x2000)).len(), 2, "both drop");

    assert_eq!(sync_nft_accept(&ns, Some(0x2000)), 2, "one batch per family");
    let want = "-A FORWARD -m mark --mark 0x2000/0x2000 -m comment --comment \"nodelb-forward-accept: forwarded connections of nodelb Services (mark 0x2000)\" -j ACCEPT";
    for tool in ["iptables-nft", "ip6tables-nft"] {
        let listing = xt_clean(&ns, tool, &["-S", "FORWARD"]);
        let lines: Vec<&str> = listing.lines().collect();
        assert_eq!(
            lines,
            [
                "-P FORWARD DROP",
                want,
                "-A FORWARD -p tcp -m tcp --dport 22 -j DROP",
                "-A FORWARD -m conntrack --ctstate RELATED,ESTABLISHED -j ACCEPT"
            ],
            "{tool}"
        );
        let long = xt_clean(&ns, tool, &["-L", "FORWARD", "-n", "-v"]);
        assert!(long.contains("mark match 0x2000/0x2000 /* nodelb-forward-accept"), "{long}");
        xt_clean(&ns, &format!("{tool}-save"), &[]);
    }
    let (_, chains) = forward_chains(&ns);
    assert_eq!(hostfw::analyse(&chains, &[Family::Ipv4, Family::Ipv6], Some(0x2000)), vec![], "accepted now");
    assert_eq!(sync_nft_accept(&ns, Some(0x2000)), 0, "nothing to do twice");

    // Flushed by someone: put back at the head at the next sync.
    xt_clean(&ns, "iptables-nft", &["-F", "FORWARD"]);
    xt_clean(&ns, "iptables-nft", &["-A", "FORWARD", "-j", "ACCEPT"]);
    assert_eq!(sync_nft_accept(&ns, Some(0x2000)), 1);
    assert_eq!(xt_clean(&ns, "iptables-nft", &["-S", "FORWARD"]).lines().nth(1), Some(want));
    xt_clean(&ns, "iptables-nft", &["-D", "FORWARD", "-j", "ACCEPT"]);
    xt_clean(&ns, "iptables-nft", &["-A", "FORWARD", "-p", "tcp", "--dport", "22", "-j", "DROP"]);
    xt_clean(
        &ns,
        "iptables-nft",
        &["-A", "FORWARD", "-m", "conntrack", "--ctstate", "RELATED,ESTABLISHED", "-j", "ACCEPT"],
    );

    // Another mark: replaced, not added.
    assert_eq!(sync_nft_accept(&ns, Some(0x100)), 2);
    let listing = xt_clean(&ns, "iptables-nft", &["-S", "FORWARD"]);
    assert_eq!(listing.matches("nodelb-forward-accept").count(), 1, "{listing}");
    assert!(listing.contains("--mark 0x100/0x100"), "{listing}");

    // Without the flag: removed, the chains exactly as they were.
    assert_eq!(sync_nft_accept(&ns, None), 2);
    assert_eq!(strip_dates(saved()), before);
}

/// `iptables-legacy-save -c` without its date comments.
fn legacy_saved(ns: &NetNs, tool: &str) -> String {
    xt_clean(ns, tool, &["-c"]).lines().filter(|l| !l.starts_with('#')).collect::<Vec<_>>().join("\n")
}

/// iptables-legacy: nothing is created where there is no legacy table; chains are read from
/// the kernel's table blob and judged; nodelb's ACCEPT goes in at the head of FORWARD (IPv4 and
/// IPv6) with the counters of every other rule kept, is listed cleanly by `iptables-legacy -S`,
/// is left alone when already there, and goes away leaving the table exactly as it was,
/// counters included.
#[test]
fn iptables_legacy_accept_keeps_the_table_and_its_counters() {
    require_root!();
    let ns = NetNs::new("fwlegacy");
    let xtables = Xtables::new(lockfile().into());
    let read = |layout| {
        let x = xtables.clone();
        ns.run(move || x.read(layout)).expect("read legacy table")
    };
    assert!(read(Layout::V4).is_none() && read(Layout::V6).is_none(), "no legacy table here");
    assert_eq!(ns.exec_ok("cat", &["/proc/net/ip_tables_names"]), "", "reading created nothing");
    let nft = xt(&ns, "iptables-nft", &["-S"]);
    assert!(
        String::from_utf8_lossy(&nft.stderr).is_empty()
            && !String::from_utf8_lossy(&nft.stdout).contains("legacy")
    );

    for tool in ["iptables-legacy", "ip6tables-legacy"] {
        for args in [
            "-N DOCKER-USER",
            "-A DOCKER-USER -j RETURN",
            "-P FORWARD DROP",
            "-A FORWARD -j DOCKER-USER",
            "-A FORWARD -c 7 700 -p tcp --dport 22 -j DROP",
            "-A FORWARD -c 3 300 -m conntrack --ctstate RELATED,ESTABLISHED -j ACCEPT",
            "-A FORWARD -c 1 100 -i docker0 ! -o docker0 -j ACCEPT",
            "-A INPUT -c 9 900 -p udp --dport 53 -j ACCEPT",
        ] {
            xt_clean(&ns, tool, &args.split(' ').collect::<Vec<_>>());
        }
    }
    let before4 = legacy_saved(&ns, "iptables-legacy-save");
    let before6 = legacy_saved(&ns, "ip6tables-legacy-save");
    for (layout, family) in [(Layout::V4, Family::Ipv4), (Layout::V6, Family::Ipv6)] {
        let table = read(layout).expect("a legacy table now");
        let chains = table.host_chains().unwrap();
        let findings = hostfw::analyse(&chains, &[family], None);
        assert_eq!(findings.len(), 1, "{findings:?}");
        assert_eq!(findings[0].source, Source::IptablesLegacy);
        assert_eq!(findings[0].drop, "policy drop");
        assert!(findings[0].partial[0].contains("-i docker0 ! -o docker0 accept"), "{:?}", findings[0]);
    }

    let write = |layout, bit| {
        let x = xtables.clone();
        ns.run(move || x.write_accept(layout, bit)).unwrap_or_else(|e| panic!("write: {e}"))
    };
    assert!(write(Layout::V4, Some(0x2000)) && write(Layout::V6, Some(0x2000)));
    let ours = "-A FORWARD -m mark --mark 0x2000/0x2000 -m comment --comment \"nodelb-forward-accept: forwarded connections of nodelb Services (mark 0x2000)\" -j ACCEPT";
    for (tool, save, before) in [
        ("iptables-legacy", "iptables-legacy-save", &before4),
        ("ip6tables-legacy", "ip6tables-legacy-save", &before6),
    ] {
        let listing = xt_clean(&ns, tool, &["-S", "FORWARD"]);
        let lines: Vec<&str> = listing.lines().collect();
        assert_eq!(&lines[..3], ["-P FORWARD DROP", ours, "-A FORWARD -j DOCKER-USER"], "{tool}:\n{listing}");
        xt_clean(&ns, tool, &["-L", "-n", "-v"]);
        // Every other rule with its counters, as before.
        let with = legacy_saved(&ns, save);
        let without: Vec<&str> = with.lines().filter(|l| !l.contains("nodelb-forward-accept")).collect();
        assert_eq!(without.join("\n"), *before, "{tool}: only nodelb's rule added");
        assert!(with.contains("[0:0] -A FORWARD -m mark --mark 0x2000/0x2000"), "{with}");
    }
    let table = read(Layout::V4).unwrap();
    assert_eq!(
        hostfw::analyse(&table.host_chains().unwrap(), &[Family::Ipv4], Some(0x2000)),
        vec![],
        "accepted now"
    );
    assert!(!write(Layout::V4, Some(0x2000)), "already there: nothing replaced");

    assert!(write(Layout::V4, None) && write(Layout::V6, None));
    assert_eq!(legacy_saved(&ns, "iptables-legacy-save"), before4);
    assert_eq!(legacy_saved(&ns, "ip6tables-legacy-save"), before6);
    assert!(!write(Layout::V4, None), "nothing left to remove");
}
