//! The planner, table-driven: golden rulesets (tests/golden/*.nft; `UPDATE_GOLDEN=1` rewrites
//! them, review the diff), a packet tracer over the IR, and diff ≡ full replace.

mod common;

use std::collections::{BTreeMap, BTreeSet};

use nodelb::core::domain::{Family, Protocol};
use nodelb::core::ruleset::ir::{Change, CtState, Ruleset};
use nodelb::core::ruleset::plan::{self, ServicePlan};
use nodelb_oracles::simulate::simulate;
use nodelb_oracles::trace::{self, Env, Origin, Packet};

use common::scenarios::*;

#[test]
fn golden_rulesets() {
    let update = std::env::var("UPDATE_GOLDEN").as_deref() == Ok("1");
    let mut failures = vec![];
    for s in scenarios() {
        let rendered = plan_of(&s).render();
        let path = format!("{}/tests/golden/{}.nft", env!("CARGO_MANIFEST_DIR"), s.name);
        if update {
            std::fs::write(&path, &rendered).unwrap();
            continue;
        }
        let want = std::fs::read_to_string(&path)
            .unwrap_or_else(|e| panic!("{path}: {e} (UPDATE_GOLDEN=1 creates it)"));
        if want != rendered {
            failures.push(format!("--- {path}\n+++ planned\n{rendered}"));
        }
    }
    assert!(failures.is_empty(), "golden mismatch (UPDATE_GOLDEN=1 to accept):\n{}", failures.join("\n"));
}

fn packet(proto: Protocol, from: &str, to: &str, dport: u16) -> Packet {
    Packet {
        protocol: proto,
        saddr: from.parse().unwrap(),
        sport: 40000,
        daddr: to.parse().unwrap(),
        dport,
        origin: Origin::Network,
        ct_state: CtState::New,
    }
}

#[test]
fn tracer_table() {
    let by_name: BTreeMap<&str, Ruleset> = scenarios().iter().map(|s| (s.name, plan_of(s))).collect();
    let env = |numgen| Env {
        local_addrs: vec![
            NODE_V4.parse().unwrap(),
            NODE_V6.parse().unwrap(),
            "198.51.100.1".parse().unwrap(),
            SECOND_V4.parse().unwrap(),
        ],
        numgen,
        ..Default::default()
    };
    let from_node = |mut p: Packet| {
        p.origin = Origin::Node;
        p.saddr = NODE_V4.parse().unwrap();
        p
    };
    let established = |mut p: Packet| {
        p.ct_state = CtState::Established;
        p
    };
    #[rustfmt::skip]
    let cases: Vec<(&str, &str, Packet, u32, &str)> = vec![
        ("cluster picks endpoint 0", "web", packet(Protocol::Tcp, "203.0.113.7", NODE_V4, 20001), 0, "DNAT 198.51.100.11:8080, masquerade"),
        ("cluster picks endpoint 1", "web", packet(Protocol::Tcp, "203.0.113.7", NODE_V4, 20001), 1, "DNAT 198.51.100.12:8080, masquerade"),
        ("other port untouched", "web", packet(Protocol::Tcp, "203.0.113.7", NODE_V4, 20002), 0, "untouched"),
        ("udp on a tcp port untouched", "web", packet(Protocol::Udp, "203.0.113.7", NODE_V4, 20001), 0, "untouched"),
        ("not a local address: routed untouched", "web", packet(Protocol::Tcp, "203.0.113.7", "198.51.100.99", 20001), 0, "untouched"),
        ("loopback is not served", "web", Packet { saddr: "127.0.0.1".parse().unwrap(), ..from_node(packet(Protocol::Tcp, "127.0.0.1", "127.0.0.1", 20001)) }, 0, "untouched"),
        ("node itself", "web", from_node(packet(Protocol::Tcp, NODE_V4, NODE_V4, 20001)), 1, "DNAT 198.51.100.12:8080, masquerade"),
        ("established: nat chains skipped", "web", established(packet(Protocol::Tcp, "203.0.113.7", NODE_V4, 20001)), 0, "untouched"),
        ("local keeps client ip, local endpoint only", "local", packet(Protocol::Tcp, "203.0.113.7", NODE_V4, 20002), 1, "DNAT 198.51.100.11:8080"),
        ("in range", "ranged", packet(Protocol::Tcp, "203.0.113.7", NODE_V4, 20003), 0, "DNAT 198.51.100.11:8080, masquerade"),
        ("out of range", "ranged", packet(Protocol::Tcp, "203.0.113.200", NODE_V4, 20003), 0, "drop in fw4-"),
        ("v6 in range", "ranged", packet(Protocol::Tcp, "2001:db8:1::7", NODE_V6, 20003), 0, "reject (tcp reset) in no-endpoints"),
        ("v6 out of range", "ranged", packet(Protocol::Tcp, "2001:db8:9::7", NODE_V6, 20003), 0, "drop in fw6-"),
        ("no ready endpoint: tcp reset", "no_endpoints", packet(Protocol::Tcp, "203.0.113.7", NODE_V4, 20004), 0, "reject (tcp reset) in no-endpoints"),
        ("no ready endpoint: udp icmp", "no_endpoints", packet(Protocol::Udp, "203.0.113.7", NODE_V4, 20005), 0, "reject (icmp) in no-endpoints"),
        ("no ready endpoint: udp to the tcp-only node port untouched", "no_endpoints", packet(Protocol::Udp, "203.0.113.7", NODE_V4, 20004), 0, "untouched"),
        ("udp 53 shares node port with tcp 53", "dns", packet(Protocol::Udp, "203.0.113.7", NODE_V4, 20053), 0, "DNAT 198.51.100.11:5353, masquerade"),
        ("tcp 53", "dns", packet(Protocol::Tcp, "203.0.113.7", NODE_V4, 20053), 0, "DNAT 198.51.100.11:5353, masquerade"),
        ("dual v4 to v4 endpoint", "dual_stack", packet(Protocol::Tcp, "203.0.113.7", NODE_V4, 20006), 0, "DNAT 198.51.100.11:8080, masquerade"),
        ("dual v6 to v6 endpoint", "dual_stack", packet(Protocol::Tcp, "2001:db8:1::7", NODE_V6, 20006), 0, "DNAT [2001:db8:2::11]:8080, masquerade"),
        ("v4 forwarding off: v4 untouched", "dual_stack_v4_forwarding_off", packet(Protocol::Tcp, "203.0.113.7", NODE_V4, 20006), 0, "untouched"),
        ("v4 forwarding off: v6 served", "dual_stack_v4_forwarding_off", packet(Protocol::Tcp, "2001:db8:1::7", NODE_V6, 20006), 0, "DNAT [2001:db8:2::11]:8080, masquerade"),
        ("mixed: each port its own service", "mixed", packet(Protocol::Tcp, "203.0.113.200", NODE_V4, 20002), 0, "DNAT 198.51.100.11:8080"),
        ("hairpin: an endpoint drawn itself is masqueraded (Local)", "local", packet(Protocol::Tcp, "198.51.100.11", NODE_V4, 20002), 0, "DNAT 198.51.100.11:8080, masquerade"),
        ("hairpin: an endpoint drawn itself (Cluster)", "web", packet(Protocol::Tcp, "198.51.100.12", NODE_V4, 20001), 1, "DNAT 198.51.100.12:8080, masquerade"),
        ("hairpin: an endpoint of another node sent here keeps its address (Local)", "local", packet(Protocol::Tcp, "198.51.100.12", NODE_V4, 20002), 0, "DNAT 198.51.100.11:8080"),
        ("pool addresses: served on the selected address", "pool_addresses", packet(Protocol::Tcp, "203.0.113.7", SECOND_V4, 20010), 1, "DNAT 198.51.100.12:8080, masquerade"),
        ("pool addresses: not on the node's other address", "pool_addresses", packet(Protocol::Tcp, "203.0.113.7", NODE_V4, 20010), 0, "untouched"),
        ("pool addresses: not over the other family", "pool_addresses", packet(Protocol::Tcp, "2001:db8:1::7", NODE_V6, 20010), 0, "untouched"),
        ("pool addresses: the node itself, on the selected address", "pool_addresses", from_node(packet(Protocol::Tcp, NODE_V4, SECOND_V4, 20010)), 0, "DNAT 198.51.100.11:8080, masquerade"),
        ("pool addresses: no endpoint rejects on the selected address", "pool_addresses", packet(Protocol::Udp, "203.0.113.7", SECOND_V4, 20011), 0, "reject (icmp) in no-endpoints"),
        ("pool addresses: no endpoint, other address untouched", "pool_addresses", packet(Protocol::Udp, "203.0.113.7", NODE_V4, 20011), 0, "untouched"),
        ("pool addresses: an unrestricted Service still on every address", "pool_addresses", packet(Protocol::Tcp, "203.0.113.7", SECOND_V4, 20001), 0, "DNAT 198.51.100.11:8080, masquerade"),
        ("hairpin, v6: an endpoint drawn itself is masqueraded", "dual_stack", packet(Protocol::Tcp, "2001:db8:2::11", NODE_V6, 20006), 0, "DNAT [2001:db8:2::11]:8080, masquerade"),
    ];
    let mut failures = vec![];
    let all = scenarios();
    for (desc, scenario, pkt, numgen, want) in cases {
        let ruleset = &by_name[scenario];
        let t = trace::trace(ruleset, &pkt, &env(numgen));
        let got = t.outcome.to_string();
        let want = full_chain_names(ruleset, want);
        if got != want {
            failures.push(format!("{desc}: want {want:?}, got {got:?} via {:?}", t.chains));
        }
        // The same packet, the nat chains spread over tables: the same outcome, in the shard's
        // chain of the same name.
        let s = all.iter().find(|s| s.name == scenario).expect("scenario");
        for shards in [2, 4, 32] {
            let sharded = plan_sharded(s, shards);
            let t = trace::trace(&sharded, &pkt, &env(numgen));
            let got = unsharded_names(&t.outcome.to_string());
            if got != want {
                failures
                    .push(format!("{desc}, {shards} shards: want {want:?}, got {got:?} via {:?}", t.chains));
            }
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// `text` with the shard prefix (`s3.`) of every object name taken out.
fn unsharded_names(text: &str) -> String {
    text.split(' ')
        .map(|word| match word.split_once('.') {
            Some((k, rest))
                if k.len() > 1 && k.starts_with('s') && k[1..].bytes().all(|b| b.is_ascii_digit()) =>
            {
                rest.to_string()
            }
            _ => word.to_string(),
        })
        .collect::<Vec<_>>()
        .join(" ")
}

/// With the nat chains sharded, a Service port's nat part (its chains, connection and refused
/// counters, affinity sets and dispatch elements) is in one shard table, which has its own nat
/// base chains, dispatch maps and no-endpoints chain; the rest stays in the main table; and
/// every scenario's sharded plan takes the same packets the same way (`tracer_table`).
#[test]
fn sharded_plans_keep_each_port_in_one_table() {
    use nodelb::core::ruleset::ir::Table;
    for s in scenarios() {
        for shards in [2u8, 4, 32] {
            let rs = plan_sharded(&s, shards);
            let want_tables: BTreeSet<Table> =
                std::iter::once(Table::Main).chain((0..shards).map(Table::Shard)).collect();
            assert_eq!(rs.tables(), want_tables, "{} with {shards} shards", s.name);
            for t in (0..shards).map(Table::Shard) {
                let p = t.prefix();
                for base in [plan::CHAIN_NAT_PREROUTING, plan::CHAIN_NAT_OUTPUT] {
                    assert!(rs.chains[format!("{p}{base}").as_str()].base.is_some(), "{} {p}{base}", s.name);
                }
                assert!(rs.chains.contains_key(format!("{p}{}", plan::CHAIN_NO_ENDPOINTS).as_str()));
            }
            for name in [plan::CHAIN_NAT_PREROUTING, plan::CHAIN_NAT_OUTPUT, plan::CHAIN_NO_ENDPOINTS] {
                assert!(!rs.chains.contains_key(name), "{}: {name} in the main table", s.name);
            }
            // Only the forward path, postrouting and the forwarded-traffic parts stay main.
            for name in rs.chains.keys().chain(rs.sets.keys()).chain(rs.counters.keys()) {
                if Table::of_name(name) == Table::Main {
                    let main = name.starts_with("filter-forward")
                        || name.starts_with("nat-postrouting")
                        || name.starts_with("forward-")
                        || name.starts_with("endpoints-")
                        || name.starts_with("fwd");
                    assert!(main, "{} with {shards} shards: {name} in the main table", s.name);
                }
            }
            // Every port's parts in one shard: the same as unsharded, names aside.
            let flat = plan_of(&s);
            let strip = |names: Vec<&nodelb::core::ruleset::ir::Name>| -> BTreeSet<String> {
                names.into_iter().map(|n| unsharded_names(n)).collect()
            };
            let per_port = |rs: &Ruleset| {
                strip(rs.chains.keys().chain(rs.counters.keys()).chain(rs.sets.keys()).collect())
            };
            let (mut a, b) = (per_port(&flat), per_port(&rs));
            a.insert(plan::CHAIN_NO_ENDPOINTS.into());
            assert_eq!(a, b, "{} with {shards} shards: the same objects", s.name);
            let from_nothing = simulate(&Ruleset::default(), &rs.full_replace());
            assert_eq!(from_nothing.as_ref(), Ok(&rs), "{}: full replace", s.name);
        }
    }
}

/// `want` with a trailing chain-name prefix (`drop in fw4-`) replaced by the one chain of
/// `ruleset` that has it, so that the comparison is exact but the table need not spell hashes.
fn full_chain_names(ruleset: &Ruleset, want: &str) -> String {
    let Some((head, prefix)) = want.rsplit_once(' ').filter(|(_, last)| last.ends_with('-')) else {
        return want.to_string();
    };
    let named: Vec<&nodelb::core::ruleset::ir::Name> =
        ruleset.chains.keys().filter(|c| c.starts_with(prefix)).collect();
    assert_eq!(named.len(), 1, "{want:?}: chains named {prefix}*: {named:?}");
    format!("{head} {}", named[0])
}

#[test]
fn diff_between_any_two_scenarios_equals_full_replace() {
    let all: Vec<(&str, Ruleset)> = scenarios().iter().map(|s| (s.name, plan_of(s))).collect();
    for (a_name, a) in &all {
        let from_nothing = simulate(&Ruleset::default(), &a.full_replace());
        assert_eq!(from_nothing.as_ref(), Ok(a), "full replace of {a_name}");
        for (b_name, b) in &all {
            let changes = plan::diff(a, b);
            let got = simulate(a, &changes).unwrap_or_else(|e| panic!("{a_name} → {b_name}: {e}"));
            assert_eq!(&got, b, "{a_name} → {b_name}");
            if a_name == b_name {
                assert!(changes.is_empty(), "{a_name} → itself must be a no-op: {changes:?}");
            }
        }
    }
}

#[test]
fn one_endpoint_added_is_a_small_batch() {
    let mut web = svc("web", vec![(80, Protocol::Tcp, two_backends())]);
    let p = ports(&web, 20001);
    let n = node(&[Family::Ipv4, Family::Ipv6]);
    let before = plan::plan(&[ServicePlan { service: &web, node_ports: &p }], &n);
    web.ports[0].endpoints.push(ep("198.51.100.13", 8080, NODE, true));
    let after = plan::plan(&[ServicePlan { service: &web, node_ports: &p }], &n);
    let changes = plan::diff(&before, &after);
    // The service chain is flushed and refilled (counter/mark rule + 3 DNAT rules) and the new
    // endpoint joins the endpoints set: 6 changes, nothing else touched.
    assert_eq!(changes.len(), 6, "{changes:#?}");
    assert!(matches!(&changes[0], Change::FlushChain(c) if c.starts_with("svc4-")), "{changes:#?}");
    assert!(
        matches!(&changes[5], Change::AddElements { set, elements } if &**set == "endpoints-ipv4" && elements.len() == 1),
        "{changes:#?}"
    );
    assert!(
        !changes.iter().any(|c| matches!(c, Change::DeleteTable(_) | Change::DeleteChain(_))),
        "{changes:#?}"
    );
}

/// A Service whose node port changes (a request edited, a conflict resolved) gets the chains
/// its comments name: an incremental diff leaves nothing of the old number. The kernel keeps a
/// chain's comment when the chain is "added" again (`simulate` models that), so a chain
/// whose comment names the node port must be a new chain when the port changes. Found by the
/// chaos soak (a table listing `node port 20003` for a Service served on 20104).
#[test]
fn a_node_port_change_leaves_no_stale_comment() {
    let mut web = svc("web", vec![(80, Protocol::Tcp, two_backends())]);
    web.source_ranges = vec!["203.0.113.0/24".parse().unwrap()];
    let n = node(&[Family::Ipv4, Family::Ipv6]);
    let before = plan::plan(&[ServicePlan { service: &web, node_ports: &ports(&web, 20001) }], &n);
    let after = plan::plan(&[ServicePlan { service: &web, node_ports: &ports(&web, 20104) }], &n);
    let got = simulate(&before, &plan::diff(&before, &after)).unwrap();
    assert_eq!(got, after, "20001 → 20104");
    let comments: Vec<&str> = got.chains.values().filter_map(|c| c.comment.as_deref()).collect();
    assert!(comments.iter().all(|c| !c.contains("20001")), "{comments:#?}");
}

#[test]
fn chain_names_are_stable_and_bounded() {
    let long = "x".repeat(253);
    let mut s = svc(&long, vec![(80, Protocol::Tcp, two_backends())]);
    s.key.namespace = "n".repeat(63).into();
    let p = ports(&s, 20001);
    let rs = plan::plan(&[ServicePlan { service: &s, node_ports: &p }], &node(&[Family::Ipv4]));
    for name in rs.chains.keys() {
        assert!(name.len() <= 200, "{name}");
    }
    let again = plan::plan(&[ServicePlan { service: &s, node_ports: &p }], &node(&[Family::Ipv4]));
    assert_eq!(rs, again);
    let svc_chain = plan::service_chain(Family::Ipv4, &s, &s.ports[0], 20001);
    assert!(svc_chain.starts_with("svc4-"), "{svc_chain}");
}

/// Every chain comment of a Service with the longest namespace and a long name, in both families,
/// with source ranges (all three per-port chains), fits nft's limit, and the whole ruleset
/// encodes into a netlink batch (a comment over the limit fails the batch, i.e. every sync of the
/// node).
#[test]
fn long_names_plan_and_encode() {
    for name_len in [63, 253] {
        let mut s = svc(&"x".repeat(name_len), vec![(80, Protocol::Tcp, two_backends())]);
        s.key.namespace = "n".repeat(63).into();
        s.families = vec![Family::Ipv4, Family::Ipv6];
        s.ports[0].endpoints.push(ep("2001:db8:2::11", 8080, NODE, true));
        s.source_ranges = vec!["203.0.113.0/24".parse().unwrap(), "2001:db8::/32".parse().unwrap()];
        let p = ports(&s, 65535);
        let rs =
            plan::plan(&[ServicePlan { service: &s, node_ports: &p }], &node(&[Family::Ipv4, Family::Ipv6]));
        let per_port: Vec<_> =
            rs.chains.values().filter(|c| c.base.is_none() && &*c.name != plan::CHAIN_NO_ENDPOINTS).collect();
        assert_eq!(per_port.len(), 4, "svc and fw chain per family");
        for c in per_port {
            let comment = c.comment.as_deref().expect("per-port chains have a comment");
            assert!(comment.len() <= plan::MAX_COMMENT, "{} bytes: {comment}", comment.len());
            assert!(comment.starts_with("nnnnnnnn"), "namespace first: {comment}");
            assert!(comment.contains("...") && comment.contains("/xxxx"), "both parts shortened: {comment}");
            assert!(comment.contains(" 80/TCP: node port 65535"), "port and node port kept: {comment}");
        }
        let per_port: Vec<_> = rs.counters.values().filter(|c| !c.name.starts_with("forward-")).collect();
        assert_eq!(per_port.len(), 6, "connections, forwarded and refused counter per family");
        for c in per_port {
            let comment = c.comment.as_deref().expect("counters have a comment");
            assert!(comment.len() <= plan::MAX_COMMENT, "{} bytes: {comment}", comment.len());
            assert!(comment.contains("...") && comment.contains(" 80/TCP: "), "shortened: {comment}");
        }
        let encoded = nodelb::encode::nft::encode::encode_batch(&rs.full_replace(), 1);
        assert!(encoded.is_ok(), "name of {name_len} bytes: {:?}", encoded.err());
    }
}

/// Comments built from names: short ones unchanged, long or unprintable ones shortened on a
/// character boundary and cleaned, never over the limit.
#[test]
fn port_comments_fit_and_stay_readable() {
    #[rustfmt::skip]
    let cases: Vec<(&str, String, String, &str, String)> = vec![
        ("short", "default".into(), "web".into(), "", "default/web 80/TCP: node port 20001".into()),
        ("short, forwarded", "default".into(), "web".into(), ": forwarded traffic", "default/web 80/TCP: node port 20001: forwarded traffic".into()),
        ("NUL and control chars", "default".into(), "a\0b\nc\u{7f}".into(), "", "default/a?b?c? 80/TCP: node port 20001".into()),
        ("quote", "default".into(), "a\"b".into(), "", "default/a'b 80/TCP: node port 20001".into()),
        ("long name, short namespace", "default".into(), "x".repeat(253), ": source ranges", format!("default/{}... 80/TCP: node port 20001: source ranges", "x".repeat(78))),
        ("long namespace, short name", "n".repeat(120), "web".into(), "", format!("{}.../web 80/TCP: node port 20001", "n".repeat(97))),
        ("multi-byte cut on a boundary", "default".into(), "é".repeat(100), "", format!("default/{}... 80/TCP: node port 20001", "é".repeat(46))),
    ];
    let mut failures = vec![];
    for (desc, ns, name, what, want) in cases {
        let mut s = svc(&name, vec![(80, Protocol::Tcp, two_backends())]);
        s.key.namespace = ns.into();
        let got = plan::port_comment(&s, &s.ports[0], 20001, what);
        if got.len() > plan::MAX_COMMENT || got != want {
            failures.push(format!("{desc}: want {want:?}, got {got:?} ({} bytes)", got.len()));
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// Every endpoint of a service port gets an equal share: the chance of reaching DNAT rule i is the
/// product of missing every earlier draw, times its own draw (exact arithmetic over the planned
/// rules, N = 1..=12).
#[test]
fn endpoint_draws_are_uniform() {
    use nodelb::core::ruleset::ir::Expr;
    for n in 1..=12u32 {
        let endpoints = (0..n).map(|i| ep(&format!("198.51.100.{}", 10 + i), 8080, "node-1", true)).collect();
        let s = svc("spread", vec![(80, Protocol::Tcp, endpoints)]);
        let ports = BTreeMap::from([(s.ports[0].id, 20001)]);
        let rs = plan::plan(&[ServicePlan { service: &s, node_ports: &ports }], &node(&[Family::Ipv4]));
        let chain = rs.chains.values().find(|c| c.name.starts_with("svc4-")).expect("service chain");
        // (numerator, denominator) of the chance to reach the next rule, and of each DNAT.
        let (mut reach_num, mut reach_den) = (1u64, 1u64);
        let mut shares = vec![];
        for rule in &chain.rules {
            if !rule.exprs.iter().any(|e| matches!(e, Expr::Dnat { .. })) {
                continue;
            }
            let modulus = rule.exprs.iter().find_map(|e| match e {
                Expr::NumgenRandomIs { modulus, value: 0 } => Some(u64::from(*modulus)),
                _ => None,
            });
            let m = modulus.unwrap_or(1);
            shares.push((reach_num, reach_den * m));
            (reach_num, reach_den) = (reach_num * (m - 1), reach_den * m);
        }
        assert_eq!(shares.len(), n as usize, "one DNAT rule per endpoint (N = {n})");
        for (num, den) in shares {
            assert_eq!(num * u64::from(n), den, "share {num}/{den} is not 1/{n}");
        }
        assert_eq!(reach_num, 0, "the last DNAT rule takes whatever is left (N = {n})");
    }
}

/// Each packet counts in its Service port's named counters: the connection counter in the service
/// chain, the forwarded-traffic counter through the forward counter map, the refused counter in
/// the source-range chain. A counter outlives an endpoint change and exists without endpoints.
#[test]
fn packets_count_in_the_service_ports_named_counters() {
    let by_name: BTreeMap<&str, Ruleset> = scenarios().iter().map(|s| (s.name, plan_of(s))).collect();
    let env =
        Env { local_addrs: vec![NODE_V4.parse().unwrap(), NODE_V6.parse().unwrap()], ..Default::default() };
    let counted = |scenario: &str, pkt: Packet| {
        let t = trace::trace(&by_name[scenario], &pkt, &env);
        // Per-port counters by kind (`conn4-<hash>-…` → `conn4`), node-level ones by name.
        let kind = |c: &String| match c.starts_with("forward-") {
            true => c.clone(),
            false => c.split('-').next().unwrap_or_default().to_string(),
        };
        t.counters.iter().map(kind).collect::<Vec<_>>()
    };
    // Forwarded: entering the forward path (first chain), per Service and leaving it (last chain).
    assert_eq!(
        counted("web", packet(Protocol::Tcp, "203.0.113.7", NODE_V4, 20001)),
        ["conn4", "forward-entered-ipv4", "fwd4", "forward-passed-ipv4"]
    );
    assert_eq!(counted("ranged", packet(Protocol::Tcp, "203.0.113.200", NODE_V4, 20003)), ["refused4"]);
    assert_eq!(counted("web", packet(Protocol::Tcp, "203.0.113.7", NODE_V4, 20002)), Vec::<String>::new());
    // Every counter a packet can reach exists, and one without endpoints is still planned.
    for rs in by_name.values() {
        for set in rs.sets.values() {
            for v in set.elements.values().flatten() {
                if let nodelb::core::ruleset::ir::Mapped::Counter(c) = v {
                    assert!(rs.counters.contains_key(c), "{c} is mapped but not planned");
                }
            }
        }
    }
    let no_endpoints = &by_name["no_endpoints"];
    assert!(no_endpoints.counters.keys().any(|c| c.starts_with("conn4-")), "{:?}", no_endpoints.counters);
    assert!(!no_endpoints.chains.keys().any(|c| c.starts_with("svc4-")));
}

/// Hairpin masquerade is exact: under `Local` with two endpoints on this node, a connection from
/// one of them is masqueraded when it is drawn to itself and keeps its address when it is drawn to
/// the other.
#[test]
fn only_connections_drawn_to_their_own_client_are_masqueraded() {
    let mut local = svc(
        "local2",
        vec![(
            80,
            Protocol::Tcp,
            vec![ep("198.51.100.11", 8080, NODE, true), ep("198.51.100.12", 8080, NODE, true)],
        )],
    );
    local.traffic_policy = nodelb::core::inputs::model::TrafficPolicy::Local;
    let p = ports(&local, 20007);
    let rs = plan::plan(&[ServicePlan { service: &local, node_ports: &p }], &node(&[Family::Ipv4]));
    let from_be1 = packet(Protocol::Tcp, "198.51.100.11", NODE_V4, 20007);
    let env = |numgen| Env { local_addrs: vec![NODE_V4.parse().unwrap()], numgen, ..Default::default() };
    assert_eq!(
        trace::trace(&rs, &from_be1, &env(0)).outcome.to_string(),
        "DNAT 198.51.100.11:8080, masquerade"
    );
    assert_eq!(trace::trace(&rs, &from_be1, &env(1)).outcome.to_string(), "DNAT 198.51.100.12:8080");
}

/// `sessionAffinity: ClientIP` in the tracer: a client with an affinity goes to its endpoint
/// whatever the draw (and refreshes it); one without is drawn and recorded at the endpoint drawn;
/// an affinity to an endpoint that went is not followed (its set went with it); one to an endpoint
/// that stays survives another endpoint's arrival.
#[test]
fn affinity_is_followed_or_drawn_and_recorded() {
    let sticky = |eps: &[&str]| {
        let mut s =
            svc("sticky", vec![(80, Protocol::Tcp, eps.iter().map(|a| ep(a, 8080, NODE, true)).collect())]);
        s.session_affinity = Some(600);
        s
    };
    let plan_of = |s: &nodelb::core::inputs::model::LbService| {
        let p = ports(s, 20008);
        plan::plan(&[ServicePlan { service: s, node_ports: &p }], &node(&[Family::Ipv4]))
    };
    let two = sticky(&["198.51.100.11", "198.51.100.12"]);
    let aff = |s: &nodelb::core::inputs::model::LbService, i: usize| {
        plan::affinity_set(Family::Ipv4, s, &s.ports[0], &s.ports[0].endpoints[i], 600).to_string()
    };
    let (aff11, aff12) = (aff(&two, 0), aff(&two, 1));
    let client = packet(Protocol::Tcp, "203.0.113.7", NODE_V4, 20008);
    let env = |numgen, known: &[&String]| Env {
        local_addrs: vec![NODE_V4.parse().unwrap()],
        numgen,
        dynamic: known
            .iter()
            .map(|s| ((*s).clone(), BTreeSet::from(["203.0.113.7".parse().unwrap()])))
            .collect(),
    };
    let run = |rs: &Ruleset, e: &Env| {
        let t = trace::trace(rs, &client, e);
        (t.outcome.to_string(), t.updates)
    };
    let rs = plan_of(&two);
    #[rustfmt::skip]
    let cases: Vec<(&str, &Ruleset, Env, &str, Vec<&String>)> = vec![
        ("new client, drawn first", &rs, env(0, &[]), "DNAT 198.51.100.11:8080, masquerade", vec![&aff11]),
        ("new client, drawn second", &rs, env(1, &[]), "DNAT 198.51.100.12:8080, masquerade", vec![&aff12]),
        ("known client: its endpoint whatever the draw", &rs, env(0, &[&aff12]), "DNAT 198.51.100.12:8080, masquerade", vec![&aff12]),
        ("a client elsewhere is not sent here", &rs, env(1, &[&aff11]), "DNAT 198.51.100.11:8080, masquerade", vec![&aff11]),
    ];
    let mut failures = vec![];
    for (desc, rs, e, want, updates) in cases {
        let (got, got_updates) = run(rs, &e);
        let want_updates: Vec<String> = updates.into_iter().cloned().collect();
        if got != want || got_updates != want_updates {
            failures.push(format!("{desc}: want {want} {want_updates:?}, got {got} {got_updates:?}"));
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));

    // .12 goes: its set goes with it, so the client is drawn again (and recorded at .11).
    let one = sticky(&["198.51.100.11"]);
    let rs_one = plan_of(&one);
    assert!(!rs_one.sets.contains_key(aff12.as_str()) && rs_one.sets.contains_key(aff11.as_str()));
    assert_eq!(
        run(&rs_one, &env(0, &[&aff12])),
        ("DNAT 198.51.100.11:8080, masquerade".into(), vec![aff11.clone()])
    );
    // .13 arrives: the sets of the others keep their names (and, in the kernel, their elements).
    let three = sticky(&["198.51.100.11", "198.51.100.12", "198.51.100.13"]);
    let rs_three = plan_of(&three);
    assert_eq!(run(&rs_three, &env(0, &[&aff12])).0, "DNAT 198.51.100.12:8080, masquerade");
    let changes = plan::diff(&rs, &rs_three);
    let sets_touched: Vec<&Change> =
        changes.iter().filter(|c| matches!(c, Change::AddSet(_) | Change::DeleteSet(_))).collect();
    assert!(
        matches!(sets_touched.as_slice(), [Change::AddSet(s)] if *s.name == *aff(&three, 2)),
        "only the new endpoint's set is created: {sets_touched:?}"
    );
    let changes = plan::diff(&rs, &rs_one);
    assert!(
        changes.iter().any(|c| matches!(c, Change::DeleteSet(s) if **s == *aff12))
            && !changes.iter().any(|c| matches!(c, Change::DeleteSet(s) if **s == *aff11)),
        "only the leaving endpoint's set is deleted: {changes:?}"
    );
}

/// With affinity every endpoint still gets an equal share of the clients without one: the draw
/// rules (those without a lookup) are the cascade of `endpoint_draws_are_uniform`, and the last
/// endpoint's update has a rule of its own so that a full set never stops its DNAT.
#[test]
fn affinity_draws_are_the_plain_cascade() {
    use nodelb::core::ruleset::ir::Expr;
    for n in 1..=6u32 {
        let endpoints = (0..n).map(|i| ep(&format!("198.51.100.{}", 10 + i), 8080, NODE, true)).collect();
        let mut plain = svc("spread", vec![(80, Protocol::Tcp, endpoints)]);
        let p = ports(&plain, 20001);
        let plan_one = |s: &nodelb::core::inputs::model::LbService| {
            plan::plan(&[ServicePlan { service: s, node_ports: &p }], &node(&[Family::Ipv4]))
        };
        let draws = |rs: &Ruleset| -> Vec<Vec<Expr>> {
            let chain = rs.chains.values().find(|c| c.name.starts_with("svc4-")).expect("service chain");
            chain
                .rules
                .iter()
                .filter(|r| !r.exprs.iter().any(|e| matches!(e, Expr::SaddrInSet { .. })))
                .map(|r| {
                    r.exprs
                        .iter()
                        .filter(|e| matches!(e, Expr::NumgenRandomIs { .. } | Expr::Dnat { .. }))
                        .cloned()
                        .collect::<Vec<_>>()
                })
                .filter(|e| !e.is_empty())
                .collect()
        };
        let without = draws(&plan_one(&plain));
        plain.session_affinity = Some(60);
        let rs = plan_one(&plain);
        assert_eq!(draws(&rs), without, "N = {n}");
        let chain = rs.chains.values().find(|c| c.name.starts_with("svc4-")).unwrap();
        let lookups = chain
            .rules
            .iter()
            .filter(|r| r.exprs.iter().any(|e| matches!(e, Expr::SaddrInSet { .. })))
            .count();
        assert_eq!(lookups, if n > 1 { n as usize } else { 0 }, "a lookup per endpoint (N = {n})");
        let last_update = &chain.rules[chain.rules.len() - 2];
        assert!(matches!(&*last_update.exprs, [Expr::UpdateSaddr { .. }]), "N = {n}: {last_update:?}");
    }
}

/// The names derived from a port's identity built once (`plan::PortNames`) are the names the
/// kernels of running nodes hold: 32 bits of FNV-1a over `kind|family|ns/name/proto/port`
/// (`|node port` for chains), then the sanitized identity, cut to 200 bytes. A change here would
/// rename every chain and counter of every node on upgrade.
#[test]
fn port_names_are_the_hash_of_the_formatted_identity() {
    let mut long = svc("web", vec![(80, Protocol::Tcp, vec![])]);
    long.key.namespace = "n".repeat(63).into();
    long.key.name = "x.y z".repeat(40).into();
    for s in [svc("web", vec![(8443, Protocol::Udp, vec![])]), long] {
        let port = &s.ports[0];
        let identity =
            format!("{}/{}/{}/{}", s.key.namespace, s.key.name, port.id.protocol.name(), port.id.port);
        let readable: String = identity
            .chars()
            .map(|c| if c.is_ascii_alphanumeric() || "/-_.".contains(c) { c } else { '.' })
            .collect();
        for (f, digit) in [(Family::Ipv4, '4'), (Family::Ipv6, '6')] {
            let want = |kind: &str, key: String| {
                let hash = nodelb::core::domain::fnv1a(key.as_bytes()) as u32;
                let mut n = format!("{kind}{digit}-{hash:08x}-{readable}");
                n.truncate(200);
                nodelb::core::ruleset::ir::Name::from(n)
            };
            let names = plan::PortNames::new(f, &s, port);
            let fam = f.name();
            assert_eq!(names.connections_counter(), want("conn", format!("conn|{fam}|{identity}")));
            assert_eq!(names.forwarded_counter(), want("fwd", format!("fwd|{fam}|{identity}")));
            assert_eq!(names.refused_counter(), want("refused", format!("refused|{fam}|{identity}")));
            assert_eq!(names.service_chain(20001), want("svc", format!("svc|{fam}|{identity}|20001")));
            assert_eq!(names.firewall_chain(20001), want("fw", format!("fw|{fam}|{identity}|20001")));
            assert_eq!(names.port_comment(20001, ""), plan::port_comment(&s, port, 20001, ""));
        }
    }
}
