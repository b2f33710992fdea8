//! Every planner scenario, in the real kernel: our netlink encoding of the planned ruleset lists
//! exactly like `nft -f` of its rendering (so the golden files are what the kernel runs), and the
//! incremental diff between any two scenarios applied in the kernel lands on the same listing.

mod common;

use std::io::Write;

use common::netns::NetNs;
use common::scenarios::{plan_of, scenarios};
use nodelb::core::ruleset::ir::{Change, Ruleset};
use nodelb::core::ruleset::plan;
use nodelb::encode::nft::{NftClient, verify};

fn apply(ns: &NetNs, changes: Vec<Change>) {
    ns.run(move || NftClient::new().and_then(|mut c| c.apply(&changes)))
        .unwrap_or_else(|e| panic!("apply in {}: {e}", ns.name));
}

/// Every table in the namespace: nodelb's, and its nat shards' when it has them.
fn list(ns: &NetNs) -> String {
    ns.exec_ok("nft", &["list", "ruleset"])
}

fn nft_listing_of(rs: &Ruleset) -> String {
    let ns = NetNs::new("gold-ref");
    let mut f = tempfile::NamedTempFile::new().unwrap();
    f.write_all(rs.render().as_bytes()).unwrap();
    ns.exec_ok("nft", &["-f", f.path().to_str().unwrap()]);
    list(&ns)
}

#[test]
fn golden_rulesets_load_identically_through_netlink_and_nft() {
    require_root!();
    for s in scenarios() {
        let rs = plan_of(&s);
        let ns = NetNs::new("gold");
        apply(&ns, rs.full_replace());
        assert_eq!(list(&ns), nft_listing_of(&rs), "scenario {}", s.name);
        let table = ns.run(|| NftClient::new().and_then(|mut c| c.read_table())).unwrap();
        assert_eq!(verify(&rs, table.as_ref()), Vec::<String>::new(), "scenario {}", s.name);
        // The uninstall's delete takes every table of nodelb's, shards included, and only those.
        ns.exec_ok("nft", &["add", "table", "inet", "nodelb-other"]);
        let existed = ns.run(|| NftClient::new().and_then(|mut c| c.delete_table())).unwrap();
        assert!(existed, "scenario {}", s.name);
        assert_eq!(
            ns.exec_ok("nft", &["list", "tables"]).trim(),
            "table inet nodelb-other",
            "scenario {}",
            s.name
        );
    }
}

#[test]
fn diffs_between_scenarios_apply_in_the_kernel() {
    require_root!();
    let all: Vec<(&str, Ruleset)> = scenarios().iter().map(|s| (s.name, plan_of(s))).collect();
    let ns = NetNs::new("gold-diff");
    // Walk every scenario from every other: a → b as a diff, then check, then back to a fresh a.
    for (a_name, a) in &all {
        for (b_name, b) in &all {
            if a_name == b_name {
                continue;
            }
            apply(&ns, a.full_replace());
            apply(&ns, plan::diff(a, b));
            let table = ns.run(|| NftClient::new().and_then(|mut c| c.read_table())).unwrap();
            assert_eq!(verify(b, table.as_ref()), Vec::<String>::new(), "{a_name} → {b_name}");
        }
    }
}
