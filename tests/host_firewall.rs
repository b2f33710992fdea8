//! Hosts whose firewall drops forwarded traffic, on the real kernel: the
//! chains iptables-nft and iptables-legacy write, read back and judged by nodelb; nodelb's
//! ACCEPT written into iptables' FORWARD chain as the host's own tools expect it; and, end to end,
//! the agent's diagnosis and `--iptables-forward-accept` with real packets.
//!
//! Every test builds its own network namespaces; `iptables-nft`/`iptables-legacy` run only
//! inside them (tests may run iptables to set up and inspect; the agent never does), with
//! `XTABLES_LOCKFILE` pointing at a file of the test's own.
mod common;

use std::net::IpAddr;
use std::process::Output;
use std::time::{Duration, Instant};

use common::agent::{Agent, nodelb, xtables_lockfile};
use common::manifest::{EndpointSpec, PortSpec, ServiceSpec};
use common::netns::NetNs;
use common::topology::{
    ClientError, NODE_V4, NODE_V6, Topology, backend_v4, backend_v6, http_get, wait_until,
};
use nodelb::apply::xtables::{Layout, Xtables};
use nodelb::core::domain::Family;
use nodelb::core::ruleset::hostfw::{self, Action, HostChain, Source, TableFamily, Test};
use nodelb::encode::nft::NftClient;
use nodelb::encode::nft::foreign::AcceptWrite;

fn lockfile() -> String {
    xtables_lockfile().to_string_lossy().into_owned()
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

/// `iptables-legacy-save -c` without its date comments and with the built-in chains' policy
/// counters blanked (the namespace's own traffic, IPv6 neighbour discovery among it, moves
/// them); every rule keeps its counters.
fn legacy_saved(ns: &NetNs, tool: &str) -> String {
    xt_clean(ns, tool, &["-c"])
        .lines()
        .filter(|l| !l.starts_with('#'))
        .map(|l| match (l.starts_with(':'), l.find('[')) {
            (true, Some(a)) => format!("{}[]", &l[..a]),
            _ => l.to_string(),
        })
        .collect::<Vec<_>>()
        .join("\n")
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

// ---------------------------------------------------------------------------------------------
// End to end: the agent on a node whose firewall drops forwarded traffic.

/// Per-request timeout where an answer is expected.
const T: Duration = Duration::from_secs(2);
/// Per-request timeout where no answer is expected.
const SHORT: Duration = Duration::from_millis(700);
/// The agents here check the host firewall every resync period: this one.
const RESYNC: Duration = Duration::from_secs(2);
/// What "within one resync period" may take on a loaded machine beyond the period itself (the
/// check runs at the tick; it takes milliseconds).
const SLACK: Duration = Duration::from_millis(1500);
const READY: Duration = Duration::from_secs(15);

fn web(np: u16) -> ServiceSpec {
    ServiceSpec::new("web")
        .port(PortSpec::tcp(80, Some(np)))
        .endpoints((0..2).map(|j| EndpointSpec::local(backend_v4(j))))
}

fn dual(np: u16) -> ServiceSpec {
    web(np).dual_stack().endpoints((0..2).map(|j| EndpointSpec::local(backend_v6(j))))
}

fn start(topo: &Topology, svc: &ServiceSpec, extra: &[&str]) -> Agent {
    let mut args = vec!["--resync-period", "2s"];
    args.extend_from_slice(extra);
    let agent = Agent::start(&topo.node, &[("web.yaml", svc.render())], &args);
    agent.wait_state("default/web", "programmed", READY);
    agent
}

/// The value of metric `name` with exactly these labels, from `/metrics`.
fn metric(agent: &Agent, name: &str, labels: &[(&str, &str)]) -> Option<f64> {
    let r = agent.http("/metrics").ok()?;
    let scrape = prometheus_parse::Scrape::parse(r.body.lines().map(|l| Ok(l.to_string()))).ok()?;
    scrape
        .samples
        .iter()
        .find(|s| s.metric == name && labels.iter().all(|(k, v)| s.labels.get(k) == Some(*v)))
        .map(|s| match s.value {
            prometheus_parse::Value::Gauge(v)
            | prometheus_parse::Value::Counter(v)
            | prometheus_parse::Value::Untyped(v) => v,
            _ => f64::NAN,
        })
}

/// `nodelb status` in the node namespace: exit status and stdout.
fn status_text(ns: &NetNs) -> String {
    let out = nodelb(ns, &["status"]);
    assert!(out.status.success(), "nodelb status: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// Waits at most one resync period (plus [`SLACK`]) for `cond`; returns how long it took.
fn within_resync(what: &str, mut cond: impl FnMut() -> bool) -> Duration {
    let started = Instant::now();
    assert!(
        wait_until(RESYNC + SLACK, &mut cond),
        "{what}: not within one resync period ({RESYNC:?} + {SLACK:?})"
    );
    started.elapsed()
}

/// `save` of a tool, without dates and with every `[packets:bytes]` blanked (the policy
/// counters of a chain that dropped the test's own packets move).
fn saved_rules(ns: &NetNs, tool: &str) -> String {
    let text = xt_clean(ns, tool, &[]);
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .map(|l| match (l.find('['), l.find(']')) {
            (Some(a), Some(b)) if a < b => format!("{}[]{}", &l[..a], &l[b + 1..]),
            _ => l.to_string(),
        })
        .collect::<Vec<_>>()
        .join("\n")
}

/// The drop policy as Docker, ufw or an administrator leave it, through `tool`, and the
/// agent's diagnosis of it: within one resync period of the policy going in, a log line naming
/// the chain and the fix, the metrics, `/readyz` 503 (the node's only family is dropped for
/// certain), `nodelb status`; nothing written into the host's chain; gone again once the policy
/// is lifted.
fn drop_policy_is_diagnosed(tool: &str, location: &str, table_label: &str) {
    let topo = Topology::new(1, 2);
    let c = topo.client(0);
    let agent = start(&topo, &web(20080), &[]);
    get_ok(c, 20080);
    assert!(matches!(agent.readyz(), Some((200, _))), "{:?}", agent.readyz());

    xt_clean(&topo.node, tool, &["-P", "FORWARD", "DROP"]);
    let host_before = saved_rules(&topo.node, &format!("{tool}-save"));
    let took = within_resync(
        "the diagnosis",
        || matches!(agent.readyz(), Some((503, body)) if body.contains(location)),
    );
    eprintln!("{tool}: diagnosed {took:?} after the policy went in");
    let (_, body) = agent.readyz().unwrap();
    assert!(body.contains("drops nodelb's new ipv4 connections: policy drop"), "{body}");
    assert!(
        body.contains("--iptables-forward-accept") && body.contains("--ctstate DNAT -j ACCEPT"),
        "fix named: {body}"
    );
    match http_get(c, IpAddr::V4(NODE_V4), 20080, SHORT) {
        Err(ClientError::Timeout) => {}
        other => panic!("a dropped connection times out: {other:?}"),
    }
    let logs = agent.logs();
    let line = logs
        .lines()
        .find(|l| l.contains("dropped by the host firewall"))
        .unwrap_or_else(|| panic!("no log line:\n{logs}"));
    assert!(line.contains(location) && line.contains("--iptables-forward-accept"), "{line}");
    assert_eq!(metric(&agent, "nodelb_forward_blocked", &[("family", "ipv4")]), Some(1.0));
    assert_eq!(
        metric(
            &agent,
            "nodelb_host_firewall_drops",
            &[("family", "ipv4"), ("table", table_label), ("chain", "FORWARD"), ("certain", "true")]
        ),
        Some(1.0)
    );
    let status = status_text(&topo.node);
    assert!(status.contains("ipv4: forwarding on, NOT served"), "{status}");
    assert!(status.contains(&format!("{location} DROPS ipv4 connections: policy drop")), "{status}");
    assert!(status.contains("NOT READY"), "{status}");
    let st = agent.status().unwrap();
    assert_eq!(st["hostFirewall"]["drops"][0]["certain"], true, "{st}");
    assert_eq!(saved_rules(&topo.node, &format!("{tool}-save")), host_before, "nodelb wrote nothing there");

    xt_clean(&topo.node, tool, &["-P", "FORWARD", "ACCEPT"]);
    within_resync("ready again", || matches!(agent.readyz(), Some((200, b)) if b == "ready\n"));
    get_ok(c, 20080);
    assert_eq!(metric(&agent, "nodelb_forward_blocked", &[("family", "ipv4")]), Some(0.0));
    assert_eq!(metric(&agent, "nodelb_host_firewall_drops", &[("family", "ipv4")]), None, "series gone");
    assert!(
        agent
            .logs()
            .contains("no host firewall drops forwarded ipv4 connections of nodelb Services any more")
    );
}

fn get_ok(c: &NetNs, port: u16) {
    let body =
        http_get(c, IpAddr::V4(NODE_V4), port, T).unwrap_or_else(|e| panic!("request to {port}: {e:?}"));
    assert!(body.starts_with("backend=be"), "{body}");
}

#[test]
fn iptables_nft_drop_policy_is_diagnosed_without_the_flag() {
    require_root!();
    drop_policy_is_diagnosed("iptables-nft", "table ip filter chain FORWARD", "ip filter");
}

#[test]
fn iptables_legacy_drop_policy_is_diagnosed_without_the_flag() {
    require_root!();
    drop_policy_is_diagnosed(
        "iptables-legacy",
        "iptables-legacy table filter chain FORWARD",
        "iptables-legacy filter",
    );
}

/// `--iptables-forward-accept` on a node whose `tool` FORWARD policy drops (IPv4 and IPv6):
/// requests succeed; `-S`/`-L` list the chain cleanly with nodelb's ACCEPT first; a flushed
/// chain gets it back within one resync period; `nodelb cleanup`, and an agent started
/// without the flag, leave the chain exactly as it was (counters included for iptables-legacy,
/// whose other rules keep theirs throughout).
fn accept_flag_serves(tool: &str, tool6: &str, legacy: bool) {
    let topo = Topology::new(1, 2);
    let c = topo.client(0);
    for t in [tool, tool6] {
        xt_clean(&topo.node, t, &["-P", "FORWARD", "DROP"]);
        xt_clean(
            &topo.node,
            t,
            &["-A", "FORWARD", "-c", "7", "700", "-p", "tcp", "--dport", "22", "-j", "DROP"],
        );
    }
    let save = |t: &str| {
        if legacy {
            legacy_saved(&topo.node, &format!("{t}-save"))
        } else {
            saved_rules(&topo.node, &format!("{t}-save"))
        }
    };
    let before = (save(tool), save(tool6));
    let mut agent = start(&topo, &dual(20080), &["--iptables-forward-accept"]);
    agent.wait_ready(READY);
    let ours = "-A FORWARD -m mark --mark 0x2000/0x2000 -m comment --comment \"nodelb-forward-accept: forwarded connections of nodelb Services (mark 0x2000)\" -j ACCEPT";
    for t in [tool, tool6] {
        let listing = xt_clean(&topo.node, t, &["-S", "FORWARD"]);
        assert_eq!(listing.lines().nth(1), Some(ours), "{t}: at the head\n{listing}");
        xt_clean(&topo.node, t, &["-L", "FORWARD", "-n", "-v"]);
    }
    get_ok(c, 20080);
    let body = http_get(c, IpAddr::V6(NODE_V6), 20080, T).unwrap_or_else(|e| panic!("IPv6 request: {e:?}"));
    assert!(body.starts_with("backend=be"), "{body}");
    assert_eq!(metric(&agent, "nodelb_forward_blocked", &[("family", "ipv4")]), Some(0.0));
    let st = agent.status().unwrap();
    assert_eq!(st["hostFirewall"]["drops"], serde_json::json!([]), "{st}");
    assert_eq!(st["hostFirewall"]["acceptRules"].as_array().map(Vec::len), Some(2), "{st}");
    if legacy {
        let with = legacy_saved(&topo.node, &format!("{tool}-save"));
        assert!(
            with.contains("[7:700] -A FORWARD -p tcp -m tcp --dport 22 -j DROP"),
            "counters kept:\n{with}"
        );
    }

    // Flushed (a firewall reload): back within one resync period, and requests with it.
    xt_clean(&topo.node, tool, &["-F", "FORWARD"]);
    let took = within_resync("the ACCEPT back", || {
        xt_clean(&topo.node, tool, &["-S", "FORWARD"]).lines().nth(1) == Some(ours)
    });
    eprintln!("{tool}: ACCEPT back {took:?} after the flush");
    assert!(agent.logs().contains("inserted nodelb's ACCEPT (mark 0x2000) at the head of"), "logged");
    get_ok(c, 20080);
    xt_clean(
        &topo.node,
        tool,
        &["-A", "FORWARD", "-c", "7", "700", "-p", "tcp", "--dport", "22", "-j", "DROP"],
    );

    // `nodelb cleanup` (the agent stopped first, or it would put the rule back).
    agent.terminate(Duration::from_secs(5));
    let out = nodelb(&topo.node, &["cleanup"]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "cleanup: {}", String::from_utf8_lossy(&out.stderr));
    assert_eq!(stdout.matches("removed 1 of nodelb's rules from").count(), 2, "{stdout}");
    assert_eq!((save(tool), save(tool6)), before, "the chains exactly as before");

    // With the flag again, then restarted without it: removed by the agent itself.
    agent.extra_args = vec!["--resync-period".into(), "2s".into(), "--iptables-forward-accept".into()];
    agent.restart();
    agent.wait_ready(READY);
    assert_eq!(xt_clean(&topo.node, tool, &["-S", "FORWARD"]).lines().nth(1), Some(ours));
    agent.extra_args = vec!["--resync-period".into(), "2s".into()];
    agent.restart();
    within_resync("the ACCEPT gone without the flag", || (save(tool), save(tool6)) == before);
    assert!(agent.logs().contains("removed 1 of nodelb's rules from"), "logged");
}

#[test]
fn iptables_nft_drop_policy_with_the_flag_is_served() {
    require_root!();
    accept_flag_serves("iptables-nft", "ip6tables-nft", false);
}

#[test]
fn iptables_legacy_drop_policy_with_the_flag_is_served() {
    require_root!();
    accept_flag_serves("iptables-legacy", "ip6tables-legacy", true);
}

/// A drop nodelb cannot see in any chain it reads as a drop of its connections (here a rule
/// for the backends' network, as a NetworkPolicy or an unjudged iptables rule would be): the
/// forward counters show connections entering the forward path and none leaving it, which is
/// reported within one resync period (log, metric, `/readyz` still 200 but degraded, `nodelb
/// status`) without taking the node out of service; forgotten when the rules change, and
/// "passing" once a connection gets through.
#[test]
fn drops_no_chain_explains_show_as_packet_evidence() {
    require_root!();
    let topo = Topology::new(1, 2);
    let c = topo.client(0);
    let agent = start(&topo, &web(20080), &[]);
    get_ok(c, 20080);
    xt_clean(&topo.node, "iptables-nft", &["-A", "FORWARD", "-d", "198.51.100.0/24", "-j", "DROP"]);
    // The rules changed: the next check is a new baseline for the counters.
    std::thread::sleep(RESYNC + SLACK);
    assert!(matches!(agent.readyz(), Some((200, b)) if b == "ready\n"), "no finding: {:?}", agent.readyz());
    assert!(http_get(c, IpAddr::V4(NODE_V4), 20080, SHORT).is_err(), "dropped");
    let took = within_resync(
        "the evidence",
        || matches!(agent.readyz(), Some((200, b)) if b.contains("entered the forward path since") && b.contains("none left it")),
    );
    eprintln!("evidence reported {took:?} after the dropped request");
    let (_, body) = agent.readyz().unwrap();
    assert!(body.starts_with("ready (degraded: new ipv4 connections of nodelb Services"), "{body}");
    assert_eq!(metric(&agent, "nodelb_forward_drop_evidence", &[("family", "ipv4")]), Some(1.0));
    assert_eq!(metric(&agent, "nodelb_forward_blocked", &[("family", "ipv4")]), Some(0.0), "still served");
    let logs = agent.logs();
    assert!(
        logs.lines().any(|l| l.contains("WARN")
            && l.contains(
                "none left it: something between nodelb's first and last forward chain drops them"
            )),
        "{logs}"
    );
    let status = status_text(&topo.node);
    assert!(status.contains("ipv4: forwarding on, served"), "{status}");
    assert!(status.contains("DROPPING:") && status.contains("entered without leaving"), "{status}");
    let st = agent.status().unwrap();
    let counts = &st["hostFirewall"]["counters"]["ipv4"];
    assert!(counts["entered"].as_u64() > counts["passed"].as_u64(), "{st}");

    xt_clean(&topo.node, "iptables-nft", &["-D", "FORWARD", "-d", "198.51.100.0/24", "-j", "DROP"]);
    within_resync("the evidence forgotten", || matches!(agent.readyz(), Some((200, b)) if b == "ready\n"));
    get_ok(c, 20080);
    within_resync("passing", || {
        agent.status().is_some_and(|st| st["hostFirewall"]["evidence"]["ipv4"]["state"] == "passing")
    });
    assert_eq!(metric(&agent, "nodelb_forward_drop_evidence", &[("family", "ipv4")]), Some(0.0));
}

/// Docker's layout: FORWARD drops, but accepts what comes in on `docker0`, which nodelb cannot
/// judge for its own connections. Reported as a chain that may drop them (the node keeps
/// serving) until a connection is seen entering the forward path and not leaving it: then
/// blocked (`/readyz` 503, naming the chain and the evidence). An accept for DNATed connections
/// (what the fix says) ends it.
#[test]
fn docker_like_firewall_is_suspect_until_connections_are_seen_dropped() {
    require_root!();
    let topo = Topology::new(1, 2);
    let c = topo.client(0);
    xt_clean(&topo.node, "iptables-nft", &["-P", "FORWARD", "DROP"]);
    xt_clean(&topo.node, "iptables-nft", &["-A", "FORWARD", "-i", "docker0", "-j", "ACCEPT"]);
    let mut agent = start(&topo, &web(20080), &[]);
    agent.wait_ready(READY);
    assert!(matches!(agent.readyz(), Some((200, b)) if b == "ready\n"), "{:?}", agent.readyz());
    let status = status_text(&topo.node);
    assert!(
        status.contains("table ip filter chain FORWARD may drop ipv4 connections: policy drop"),
        "{status}"
    );
    assert!(
        status.contains("unless accepted by rule 1 of chain FORWARD (iifname == \"docker0\" accept)"),
        "{status}"
    );
    assert!(
        agent
            .logs()
            .contains("may drop forwarded ipv4 connections of nodelb Services (no traffic yet to tell)")
    );
    assert_eq!(
        metric(&agent, "nodelb_host_firewall_drops", &[("family", "ipv4"), ("certain", "false")]),
        Some(1.0)
    );

    assert!(http_get(c, IpAddr::V4(NODE_V4), 20080, SHORT).is_err(), "dropped");
    within_resync(
        "blocked on evidence",
        || matches!(agent.readyz(), Some((503, b)) if b.contains("none left it: table ip filter chain FORWARD")),
    );
    assert_eq!(metric(&agent, "nodelb_forward_blocked", &[("family", "ipv4")]), Some(1.0));

    xt_clean(
        &topo.node,
        "iptables-nft",
        &["-I", "FORWARD", "-m", "conntrack", "--ctstate", "DNAT", "-j", "ACCEPT"],
    );
    within_resync("served again", || matches!(agent.readyz(), Some((200, b)) if b == "ready\n"));
    get_ok(c, 20080);
    assert!(agent.status().unwrap()["hostFirewall"]["drops"].as_array().is_some_and(Vec::is_empty));
}

/// The packets of nodelb's named counters in the node: every per-Service forwarded counter
/// (`fwd4-…`) summed, and the two node-level forward counters.
fn forward_counts(ns: &NetNs) -> (u64, u64, u64) {
    let listing = common::agent::nft(ns, &["list", "counters", "table", "inet", "nodelb"]);
    let (mut fwd, mut entered, mut passed) = (0, 0, 0);
    let mut name = String::new();
    for line in listing.lines().map(str::trim) {
        if let Some(n) = line.strip_prefix("counter ") {
            name = n.trim_end_matches(" {").trim_matches('"').to_string();
        } else if let Some(rest) = line.strip_prefix("packets ") {
            let packets: u64 = rest.split_whitespace().next().and_then(|p| p.parse().ok()).unwrap_or(0);
            match name.as_str() {
                n if n.starts_with("fwd4-") => fwd += packets,
                "forward-entered-ipv4" => entered += packets,
                "forward-passed-ipv4" => passed += packets,
                _ => {}
            }
        }
    }
    (fwd, entered, passed)
}

/// Packets nodelb's ACCEPT in iptables' FORWARD chain accepted.
fn accepted(ns: &NetNs) -> u64 {
    let listing = xt_clean(ns, "iptables-nft", &["-L", "FORWARD", "-v", "-n", "-x"]);
    let line = listing.lines().find(|l| l.contains("nodelb-forward-accept")).expect("nodelb's ACCEPT");
    line.split_whitespace().next().and_then(|p| p.parse().ok()).expect("its packet count")
}

/// Only nodelb's flows get nodelb's treatment: another component's DNATed flow to the same port
/// number (a ClusterIP `192.0.2.99:20080` DNATed by a table of its own, as kube-proxy's are), even
/// one whose packets already carry nodelb's forward mark, is neither counted in nodelb's forward
/// counters nor accepted by nodelb's iptables ACCEPT (the host's `FORWARD DROP` drops it), while
/// nodelb's own flows to 20080 are counted and accepted.
#[test]
fn a_foreign_dnated_flow_on_a_node_port_number_is_not_nodelbs() {
    require_root!();
    let topo = Topology::new(1, 2);
    let c = topo.client(0);
    xt_clean(&topo.node, "iptables-nft", &["-P", "FORWARD", "DROP"]);
    let _agent = start(&topo, &web(20080), &["--iptables-forward-accept"]);
    let foreign = format!(
        "table ip foreign {{\n\
           chain mangle {{ type filter hook prerouting priority -150; ip daddr 192.0.2.99 meta mark set meta mark | 0x2000; }}\n\
           chain pre {{ type nat hook prerouting priority -100; ip daddr 192.0.2.99 tcp dport 20080 dnat to {}:8080; }}\n\
         }}\n",
        backend_v4(0)
    );
    let script = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(script.path(), foreign).unwrap();
    topo.node.exec_ok("nft", &["-f", script.path().to_str().unwrap()]);

    get_ok(c, 20080);
    let (fwd, entered, passed) = forward_counts(&topo.node);
    let ours = accepted(&topo.node);
    assert!(
        fwd > 0 && entered > 0 && passed > 0 && ours > 0,
        "nodelb's own flow counted: {fwd} {entered} {passed} {ours}"
    );

    for _ in 0..3 {
        let r = http_get(c, "192.0.2.99".parse().unwrap(), 20080, Duration::from_millis(700));
        assert!(r.is_err(), "the foreign flow went through nodelb's ACCEPT: {r:?}");
    }
    assert_eq!(forward_counts(&topo.node), (fwd, entered, passed), "the foreign flow counted as nodelb's");
    assert_eq!(accepted(&topo.node), ours, "the foreign flow accepted by nodelb's ACCEPT");
    get_ok(c, 20080);
    assert!(accepted(&topo.node) > ours, "nodelb's own flow still accepted");
}
