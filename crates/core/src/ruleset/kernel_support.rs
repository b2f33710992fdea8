//! What nodelb needs of the kernel's nf_tables, and the probe that checks it at start. Pure: the
//! probe is a list of changes, each using one feature, that the apply edge sends as a batch the
//! kernel validates and never commits (`nft --check` does the same); the first change the kernel
//! refuses names the missing feature and the Linux version that brought it.
//!
//! Two checks, because a kernel fails in two ways. A missing expression, chain type or object
//! type is refused (`ENOENT`, `EOPNOTSUPP`): the probe sees it, also on a recent kernel built
//! without `CONFIG_NFT_FIB_INET` or `CONFIG_NFT_NUMGEN`. An attribute the kernel does not know is
//! silently ignored instead: before 5.10 the comments nodelb stores on chains and named counters
//! would vanish, every read-back would look like tampering, and the agent would replace its table
//! at every resync. No probe that commits nothing can see that, so the release is compared too.

use std::collections::BTreeMap;
use std::net::{IpAddr, Ipv4Addr};

use crate::domain::{Family, Protocol};
use crate::ruleset::ir::{
    BaseChain, Chain, ChainType, Change, Expr, Hook, KeyType, NamedCounter, Rule, Set, SetKind, Verdict,
    priority,
};

/// The oldest Linux release nodelb runs on (see [`FEATURES`] for why).
pub const MINIMUM_RELEASE: (u32, u32) = (5, 10);

/// One nf_tables feature nodelb relies on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Feature {
    pub what: &'static str,
    /// The Linux release that brought it.
    pub since: &'static str,
}

const TABLE: Feature = Feature { what: "nf_tables inet tables", since: "3.14" };
const COUNTER_OBJECT: Feature = Feature { what: "named counters (stateful objects)", since: "4.10" };
const DYNAMIC_SET: Feature = Feature { what: "dynamic sets with timeouts", since: "4.1" };
const COUNTER_MAP: Feature =
    Feature { what: "counter maps (objref maps) with concatenated keys", since: "4.10" };
const VERDICT_MAP: Feature = Feature { what: "verdict maps with concatenated keys", since: "4.1" };
const NAT_CHAIN: Feature = Feature { what: "nat chains in the inet family", since: "5.2" };
const FILTER_CHAIN: Feature = Feature { what: "filter base chains in the inet family", since: "3.14" };
const FIB: Feature = Feature { what: "the fib expression (fib daddr type local)", since: "4.10" };
const CT_STATUS: Feature = Feature { what: "ct state and ct status", since: "3.13" };
const TH_VMAP: Feature = Feature { what: "transport header (th) payloads and vmap lookups", since: "4.1" };
const DYNSET: Feature = Feature { what: "set updates from the packet path (update @set)", since: "4.1" };
const OBJREF_MAP: Feature =
    Feature { what: "counters chosen by a map (counter name … map @m)", since: "4.10" };
const NUMGEN_DNAT: Feature = Feature { what: "numgen random and dnat in inet chains", since: "5.2" };
const MASQUERADE: Feature = Feature { what: "masquerade in inet chains", since: "5.2" };
const REJECT: Feature = Feature { what: "reject (tcp reset, icmpx) in inet chains", since: "3.14" };

/// Every feature nodelb uses, with the release that brought it; the comments on chains and
/// named counters (`NFTA_CHAIN_USERDATA`, `NFTA_OBJ_USERDATA`, Linux 5.10) set the minimum.
pub const FEATURES: &[Feature] = &[
    TABLE,
    CT_STATUS,
    TH_VMAP,
    VERDICT_MAP,
    DYNAMIC_SET,
    DYNSET,
    FIB,
    COUNTER_OBJECT,
    COUNTER_MAP,
    OBJREF_MAP,
    NAT_CHAIN,
    NUMGEN_DNAT,
    MASQUERADE,
    REJECT,
    Feature { what: "the ruleset generation check of a batch (NFNL_BATCH_GENID)", since: "4.19" },
    Feature { what: "comments on chains and named counters (userdata)", since: "5.10" },
];

/// The probe: changes in batch order, each with the feature it is there to test.
pub fn probe() -> Vec<(Change, Feature)> {
    const NAT: &str = "probe-nat";
    const FILTER: &str = "probe-filter";
    const AFFINITY: &str = "probe-affinity";
    const COUNTERS: &str = "probe-counters";
    const PORTS: &str = "probe-ports";
    const COUNTER: &str = "probe-counter";
    let comment = Some("nodelb kernel probe".to_string());
    let set = |name: &str, key: Vec<KeyType>, kind| Set {
        name: name.into(),
        key,
        kind,
        elements: BTreeMap::new(),
        comment: comment.clone(),
    };
    let base = |name: &str, chain_type, hook, priority| Chain {
        name: name.into(),
        base: Some(BaseChain { chain_type, hook, priority }),
        rules: vec![],
        comment: comment.clone(),
    };
    let rule =
        |chain: &str, exprs: Vec<Expr>| Change::AddRule { chain: chain.into(), rule: Rule::new(exprs) };
    let v4 = Family::Ipv4;
    let proto_port = vec![KeyType::InetProto, KeyType::InetService];
    vec![
        (Change::AddTable(crate::ruleset::ir::Table::Main), TABLE),
        (Change::AddCounter(NamedCounter { name: COUNTER.into(), comment: comment.clone() }), COUNTER_OBJECT),
        (
            Change::AddSet(set(AFFINITY, vec![KeyType::Ipv4Addr], SetKind::Dynamic { timeout: 10 })),
            DYNAMIC_SET,
        ),
        (Change::AddSet(set(COUNTERS, proto_port.clone(), SetKind::CounterMap)), COUNTER_MAP),
        (Change::AddSet(set(PORTS, proto_port, SetKind::VerdictMap)), VERDICT_MAP),
        (Change::AddChain(base(NAT, ChainType::Nat, Hook::Prerouting, priority::DSTNAT)), NAT_CHAIN),
        (Change::AddChain(base(FILTER, ChainType::Filter, Hook::Forward, priority::FILTER)), FILTER_CHAIN),
        (rule(NAT, vec![Expr::FibDaddrLocal]), FIB),
        (
            rule(NAT, vec![Expr::CtState(Box::new([crate::ruleset::ir::CtState::New])), Expr::CtStatusDnat]),
            CT_STATUS,
        ),
        (
            rule(NAT, vec![Expr::L4Proto(Protocol::Tcp), Expr::L4ProtoDportVmap { map: PORTS.into() }]),
            TH_VMAP,
        ),
        (rule(NAT, vec![Expr::NfProto(v4), Expr::UpdateSaddr { family: v4, set: AFFINITY.into() }]), DYNSET),
        (rule(NAT, vec![Expr::L4ProtoCtOrigDportCounterMap { map: COUNTERS.into() }]), OBJREF_MAP),
        (
            rule(
                NAT,
                vec![
                    Expr::NfProto(v4),
                    Expr::L4Proto(Protocol::Tcp),
                    Expr::CounterRef(COUNTER.into()),
                    Expr::NumgenRandomIs { modulus: 2, value: 0 },
                    Expr::Dnat { addr: IpAddr::V4(Ipv4Addr::new(192, 0, 2, 1)), port: 8080 },
                ],
            ),
            NUMGEN_DNAT,
        ),
        (
            Change::AddChain(base("probe-postrouting", ChainType::Nat, Hook::Postrouting, priority::SRCNAT)),
            NAT_CHAIN,
        ),
        (rule("probe-postrouting", vec![Expr::CtStatusDnat, Expr::Masquerade]), MASQUERADE),
        (rule(FILTER, vec![Expr::L4Proto(Protocol::Tcp), Expr::RejectTcpReset]), REJECT),
        (rule(FILTER, vec![Expr::RejectIcmpPortUnreachable]), REJECT),
        (rule(FILTER, vec![Expr::Verdict(Verdict::Accept)]), FILTER_CHAIN),
    ]
}

/// `major.minor` of a kernel release string (`6.18.0-1-amd64`); `None` when it does not start so.
pub fn parse_release(release: &str) -> Option<(u32, u32)> {
    let mut parts = release.split(|c: char| !c.is_ascii_digit());
    let major = parts.next()?.parse().ok()?;
    let minor = parts.next()?.parse().ok()?;
    Some((major, minor))
}

/// Why the kernel named by `release` is too old for nodelb; `None` when it is recent enough or
/// its release cannot be read (then the probe alone decides).
pub fn release_refusal(release: &str) -> Option<String> {
    let found = parse_release(release)?;
    if found >= MINIMUM_RELEASE {
        return None;
    }
    let (major, minor) = MINIMUM_RELEASE;
    let missing: Vec<String> = FEATURES
        .iter()
        .filter(|f| parse_release(f.since).is_some_and(|since| since > found))
        .map(|f| format!("{} (Linux {})", f.what, f.since))
        .collect();
    Some(format!(
        "kernel {release} is older than Linux {major}.{minor}, the oldest nodelb runs on; it lacks {}",
        missing.join(", ")
    ))
}

/// The message for a probe the kernel refused at change `index` with `reason`.
pub fn probe_refusal(probe: &[(Change, Feature)], index: Option<usize>, reason: &str) -> String {
    let (major, minor) = MINIMUM_RELEASE;
    match index.and_then(|i| probe.get(i)) {
        Some((_, f)) => format!(
            "the kernel's nf_tables lacks {} (Linux {}; nodelb needs Linux {major}.{minor} or later with \
             nf_tables, nft_nat, nft_fib_inet, nft_numgen, nft_ct, nft_reject_inet, nft_masq and \
             nft_objref): {reason}",
            f.what, f.since
        ),
        None => format!("the kernel refused nodelb's feature probe: {reason}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn releases_below_the_minimum_are_refused_with_what_they_lack() {
        let cases: &[(&str, Option<&[&str]>)] = &[
            ("6.18.0", None),
            ("5.10.0-32-amd64", None),
            ("5.15.0-1019-aws", None),
            ("5.4.0-150-generic", Some(&["comments on chains", "nat chains in the inet family"][..1])),
            ("4.19.0-27-amd64", Some(&["nat chains in the inet family", "comments on chains"][..])),
            ("3.10.0-1160.el7.x86_64", Some(&["the fib expression", "named counters"][..])),
            ("not a release", None),
            ("", None),
        ];
        for (release, lacks) in cases {
            let got = release_refusal(release);
            match lacks {
                None => assert_eq!(got, None, "{release}"),
                Some(lacks) => {
                    let msg = got.unwrap_or_else(|| panic!("{release} must be refused"));
                    assert!(msg.contains(release) && msg.contains("Linux 5.10"), "{msg}");
                    for l in *lacks {
                        assert!(msg.contains(l), "{release}: {msg} must name {l}");
                    }
                }
            }
        }
        let msg = release_refusal("5.4.0").unwrap();
        assert!(!msg.contains("fib"), "5.4 has fib: {msg}");
    }

    #[test]
    fn every_feature_is_probed_or_known_silent_and_the_refusal_names_it() {
        let probe = probe();
        for f in FEATURES {
            let probed = probe.iter().any(|(_, p)| p == f);
            let silent = f.what.contains("userdata") || f.what.contains("NFNL_BATCH_GENID");
            assert!(probed || silent, "{} is neither probed nor checked by release", f.what);
        }
        let fib = probe.iter().position(|(_, f)| *f == FIB).unwrap();
        let msg = probe_refusal(&probe, Some(fib), "No such file or directory");
        assert!(
            msg.contains("fib daddr type local") && msg.contains("4.10") && msg.contains("No such file"),
            "{msg}"
        );
        assert!(probe_refusal(&probe, None, "x").contains("feature probe"));
    }
}
