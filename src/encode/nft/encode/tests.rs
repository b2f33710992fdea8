//! Byte-level checks against what nft 1.0.6 sends for the same statements, captured with
//! `nft --debug=mnl -f` (payloads after the 16-byte nlmsghdr: nfgenmsg + attributes).

use std::collections::BTreeMap;

use super::*;
use crate::core::ruleset::ir::{CtState, Set};
use crate::encode::nft::nla::messages;

fn unhex(s: &str) -> Vec<u8> {
    (0..s.len()).step_by(2).map(|i| u8::from_str_radix(&s[i..i + 2], 16).expect("hex")).collect()
}

/// (message type, payload) of every message between BATCH_BEGIN and BATCH_END.
fn encode(changes: &[Change]) -> Vec<(u16, Vec<u8>)> {
    let enc = encode_batch(changes, 100).expect("encode");
    let bytes = enc.bytes();
    let msgs = messages(&bytes).expect("parse");
    assert_eq!(msgs.len(), enc.msg_change.len() + 2);
    assert_eq!(msgs[0].ty, NFNL_MSG_BATCH_BEGIN);
    assert_eq!(msgs[msgs.len() - 1].ty, NFNL_MSG_BATCH_END);
    for (i, m) in msgs.iter().enumerate() {
        assert_eq!(m.seq, 100 + i as u32);
    }
    msgs[1..msgs.len() - 1].iter().map(|m| (m.ty, m.payload.to_vec())).collect()
}

fn svc_ports() -> Set {
    Set {
        name: "svc-ports".into(),
        key: vec![KeyType::InetProto, KeyType::InetService],
        kind: SetKind::VerdictMap,
        elements: BTreeMap::new(),
        comment: Some("hi".into()),
    }
}

fn rule_payload(chain: &str, exprs: Vec<Expr>) -> Vec<u8> {
    let m = encode(&[Change::AddRule { chain: chain.into(), rule: Rule::new(exprs) }]);
    assert_eq!(m.len(), 1);
    assert_eq!(m[0].0, msg_type(NFT_MSG_NEWRULE));
    m[0].1.clone()
}

/// nft's rule has no user data here; ours adds the fingerprint after the same attributes.
fn assert_rule_prefix(ours: &[u8], nft_hex: &str) {
    let nft = unhex(nft_hex);
    assert!(ours.len() > nft.len(), "ours shorter than nft's");
    assert_eq!(hex(&ours[..nft.len()]), hex(&nft));
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

#[test]
fn named_concat_map_and_elements_match_nft() {
    let m = encode(&[
        Change::AddSet(svc_ports()),
        Change::AddElements {
            set: "svc-ports".into(),
            elements: vec![(
                Key::proto_port(Protocol::Tcp, 20001),
                Some(Mapped::Verdict(Verdict::Jump("svc-a".into()))),
            )],
        },
    ]);
    assert_eq!(m[0].0, msg_type(NFT_MSG_NEWSET));
    assert_eq!(
        hex(&m[0].1),
        "010000000b0001006e6f64656c6200000e0002007376632d706f7274730000000800030000000008080004000000030d080005000000000808000600ffffff00080007000000000008000a000000000125000d00000400000000010400000000030800040d00000001000604000000000703686900000000"
    );
    assert_eq!(
        hex(&m[1].1),
        "010000000b0001006e6f64656c6200000e0002007376632d706f72747300000008000400000000013400038030000180100001800c000100060000004e2100001c0002801800028008000100fffffffd0a0002007376632d61000000"
    );
}

/// `counter svc4-a { comment "hello" }`, `map fc { type inet_proto . inet_service : counter;
/// comment "hi"; elements = { tcp . 20001 : "svc4-a" } }`, and the two rules using them.
#[test]
fn named_counter_counter_map_and_objref_match_nft() {
    let m = encode(&[
        Change::AddCounter(ir::NamedCounter { name: "svc4-a".into(), comment: Some("hello".into()) }),
        Change::AddSet(Set {
            name: "fc".into(),
            key: vec![KeyType::InetProto, KeyType::InetService],
            kind: SetKind::CounterMap,
            elements: BTreeMap::new(),
            comment: Some("hi".into()),
        }),
        Change::AddElements {
            set: "fc".into(),
            elements: vec![(Key::proto_port(Protocol::Tcp, 20001), Some(Mapped::Counter("svc4-a".into())))],
        },
        Change::AddRule {
            chain: "c".into(),
            rule: Rule::new(vec![Expr::CounterRef("svc4-a".into()), Expr::MarkSet(0x4000)]),
        },
        Change::AddRule {
            chain: "c".into(),
            rule: Rule::new(vec![
                Expr::NfProto(Family::Ipv4),
                Expr::CtStatusDnat,
                Expr::L4ProtoCtOrigDportCounterMap { map: "fc".into() },
                Expr::Verdict(Verdict::Accept),
            ]),
        },
    ]);
    assert_eq!(m[0].0, msg_type(NFT_MSG_NEWOBJ));
    assert_eq!(
        hex(&m[0].1),
        "010000000b0001006e6f64656c6200000b000200737663342d61000008000300000000010c000800000668656c6c6f001c0004800c00010000000000000000000c0002000000000000000000"
    );
    assert_eq!(m[1].0, msg_type(NFT_MSG_NEWSET));
    assert_eq!(
        hex(&m[1].1),
        "010000000b0001006e6f64656c62000007000200666300000800030000000040080004000000030d080005000000000808000f000000000108000a00000000011f000d00000400000000030800040d0000000100060400000000070368690000"
    );
    assert_eq!(m[2].0, msg_type(NFT_MSG_NEWSETELEM));
    assert_eq!(
        hex(&m[2].1),
        "010000000b0001006e6f64656c620000070002006663000008000400000000012400038020000180100001800c000100060000004e2100000b000900737663342d610000"
    );
    assert_eq!(m[3].0, msg_type(NFT_MSG_NEWRULE));
    assert_rule_prefix(
        &m[3].1,
        "010000000b0001006e6f64656c6200000600020063000000c0000480280001800b0001006f626a72656600001800028008000100000000010a000200737663342d61000024000180090001006d6574610000000014000280080002000000000308000100000000014c0001800c00010062697477697365003c00028008000100000000010800020000000001080006000000000008000300000000040c00048008000100ffbfffff0c000580080001000040000024000180090001006d657461000000001400028008000200000000030800030000000001",
    );
    // The protocol set (NEWSET + NEWSETELEM) comes before the rule that looks it up.
    assert_eq!(m[4].0, msg_type(NFT_MSG_NEWSET));
    assert_eq!(
        hex(&m[4].1),
        "010000000b0001006e6f64656c6200000c0002005f5f7365742564000800030000000003080004000000000c080005000000000108000a00000000020c00098008000100000000031a000d00000401000000030e00040900000001060004100000000000"
    );
    assert_rule_prefix(
        &m[6].1,
        "010000000b0001006e6f64656c6200000600020063000000e001048024000180090001006d6574610000000014000280080002000000000f08000100000000012c00018008000100636d700020000280080001000000000108000200000000000c00038005000100020000002000018007000100637400001400028008000200000000020800010000000001440001800c0001006269747769736500340002800800010000000001080002000000000108000300000000040c00048008000100200000000c00058008000100000000002c00018008000100636d700020000280080001000000000108000200000000010c000380080001000000000024000180090001006d657461000000001400028008000200000000100800010000000001300001800b0001006c6f6f6b757000002000028008000200000000010c0001005f5f736574256400080004000000000224000180090001006d6574610000000014000280080002000000001008000100000000012800018007000100637400001c000280080002000000000c080001000000000905000300000000002c0001800b0001006f626a72656600001c000280080003000000000106000400666300000800050000000001300001800e000100696d6d6564696174650000001c0002800800010000000000100002800c0002800800010000000001",
    );
}

#[test]
fn fib_and_concat_vmap_lookup_match_nft() {
    let m = encode(&[
        Change::AddSet(svc_ports()),
        Change::AddRule {
            chain: "pre".into(),
            rule: Rule::new(vec![
                Expr::NfProto(Family::Ipv4),
                Expr::FibDaddrLocal,
                Expr::L4ProtoDportVmap { map: "svc-ports".into() },
            ]),
        },
    ]);
    assert_rule_prefix(
        &m[1].1,
        "010000000b0001006e6f64656c62000008000200707265003c01048024000180090001006d6574610000000014000280080002000000000f08000100000000012c00018008000100636d700020000280080001000000000108000200000000000c00038005000100020000002800018008000100666962001c0002800800030000000002080002000000000308000100000000012c00018008000100636d700020000280080001000000000108000200000000000c000380080001000200000024000180090001006d657461000000001400028008000200000000100800010000000001340001800c0001007061796c6f6164002400028008000100000000090800020000000002080003000000000208000400000000023c0001800b0001006c6f6f6b757000002c000280080002000000000108000300000000000e0001007376632d706f7274730000000800040000000001",
    );
}

/// `set hairpin-ipv6 { type ipv6_addr . ipv6_addr . inet_proto . inet_service; comment "x" }`
/// and `meta nfproto ipv6 ct status dnat ip6 saddr . ip6 daddr . meta l4proto . th dport
/// @hairpin-ipv6 masquerade` (registers 1, 2, 3 and 17; the planner's set is
/// `endpoints-ipv6`, the name is nft's capture).
#[test]
fn hairpin_set_and_lookup_match_nft() {
    let m = encode(&[
        Change::AddSet(Set {
            name: "hairpin-ipv6".into(),
            key: vec![KeyType::Ipv6Addr, KeyType::Ipv6Addr, KeyType::InetProto, KeyType::InetService],
            kind: SetKind::Set,
            elements: BTreeMap::new(),
            comment: Some("x".into()),
        }),
        Change::AddRule {
            chain: "post".into(),
            rule: Rule::new(vec![
                Expr::NfProto(Family::Ipv6),
                Expr::CtStatusDnat,
                Expr::SaddrDaddrL4ProtoDportInSet { family: Family::Ipv6, set: "hairpin-ipv6".into() },
                Expr::Masquerade,
            ]),
        },
    ]);
    assert_eq!(
        hex(&m[0].1),
        "010000000b0001006e6f64656c620000110002006861697270696e2d69707636000000000800030000000000080004000020830d080005000000002808000a000000000118000d00000400000000030800040d000000010007027800"
    );
    assert_rule_prefix(
        &m[1].1,
        "010000000b0001006e6f64656c62000009000200706f737400000000f001048024000180090001006d6574610000000014000280080002000000000f08000100000000012c00018008000100636d700020000280080001000000000108000200000000000c000380050001000a0000002000018007000100637400001400028008000200000000020800010000000001440001800c0001006269747769736500340002800800010000000001080002000000000108000300000000040c00048008000100200000000c00058008000100000000002c00018008000100636d700020000280080001000000000108000200000000010c0003800800010000000000340001800c0001007061796c6f616400240002800800010000000001080002000000000108000300000000080800040000000010340001800c0001007061796c6f61640024000280080001000000000208000200000000010800030000000018080004000000001024000180090001006d657461000000001400028008000200000000100800010000000003340001800c0001007061796c6f616400240002800800010000000011080002000000000208000300000000020800040000000002380001800b0001006c6f6f6b75700000280002800800020000000001110001006861697270696e2d6970763600000000080004000000000114000180090001006d6173710000000004000280",
    );
}

/// `set aff { type ipv4_addr; flags dynamic,timeout; timeout 3h; comment "c" }`,
/// `ip saddr @aff update @aff { ip saddr } meta l4proto tcp dnat ip to 198.51.100.11:8080` and
/// `add element inet nodelb aff { 203.0.113.10 expires 1h }`.
#[test]
fn affinity_set_lookup_update_and_expiring_element_match_nft() {
    let m = encode(&[
        Change::AddSet(Set {
            name: "aff".into(),
            key: vec![KeyType::Ipv4Addr],
            kind: SetKind::Dynamic { timeout: 10_800 },
            elements: BTreeMap::new(),
            comment: Some("c".into()),
        }),
        Change::AddRule {
            chain: "svc".into(),
            rule: Rule::new(vec![
                Expr::SaddrInSet { family: Family::Ipv4, set: "aff".into() },
                Expr::UpdateSaddr { family: Family::Ipv4, set: "aff".into() },
                Expr::L4Proto(Protocol::Tcp),
                Expr::Dnat { addr: "198.51.100.11".parse().expect("ip"), port: 8080 },
            ]),
        },
        Change::AddDynamicElements {
            set: "aff".into(),
            elements: vec![(Key::addr("203.0.113.10".parse().expect("ip")), 3_600_000)],
        },
    ]);
    assert_eq!(m[0].0, msg_type(NFT_MSG_NEWSET));
    assert_eq!(
        hex(&m[0].1),
        "010000000b0001006e6f64656c620000080002006166660008000300000000300800040000000007080005000000000408000a00000000010c000b000000000000a4cb800e000d00000402000000070263000000"
    );
    assert_rule_prefix(
        &m[1].1,
        "010000000b0001006e6f64656c6200000800020073766300fc01048024000180090001006d6574610000000014000280080002000000000f08000100000000012c00018008000100636d700020000280080001000000000108000200000000000c0003800500010002000000340001800c0001007061796c6f6164002400028008000100000000010800020000000001080003000000000c08000400000000042c0001800b0001006c6f6f6b757000001c000280080002000000000108000100616666000800040000000001340001800c0001007061796c6f6164002400028008000100000000010800020000000001080003000000000c0800040000000004340001800b00010064796e736574000024000280080004000000000108000300000000010800010061666600080002000000000124000180090001006d6574610000000014000280080002000000001008000100000000012c00018008000100636d700020000280080001000000000108000200000000000c00038005000100060000002c0001800e000100696d6d6564696174650000001800028008000100000000010c00028008000100c633640b2c0001800e000100696d6d6564696174650000001800028008000100000000020c000280060001001f90000038000180080001006e6174002c00028008000100000000010800020000000002080003000000000108000500000000020800070000000002",
    );
    assert_eq!(m[2].0, msg_type(NFT_MSG_NEWSETELEM));
    assert_eq!(
        hex(&m[2].1),
        "010000000b0001006e6f64656c62000008000200616666000800040000000001200003801c0001800c000500000000000036ee800c00018008000100cb00710a"
    );
}

#[test]
fn prefix_ct_flags_counter_and_comment_match_nft() {
    let rule = Rule::new(vec![
        Expr::L4Proto(Protocol::Tcp),
        Expr::SaddrInPrefix { prefix: "192.0.2.0/24".parse().expect("cidr"), negate: true },
        Expr::CtState(Box::new([CtState::Established, CtState::Related])),
        Expr::CtStatusDnat,
        Expr::Counter,
    ])
    .with_comment("hello");
    let m = encode(&[Change::AddRule { chain: "svc-a".into(), rule: rule.clone() }]);
    let nft = "010000000b0001006e6f64656c6200000a0002007376632d610000003802048024000180090001006d6574610000000014000280080002000000001008000100000000012c00018008000100636d700020000280080001000000000108000200000000000c000380050001000600000024000180090001006d6574610000000014000280080002000000000f08000100000000012c00018008000100636d700020000280080001000000000108000200000000000c0003800500010002000000340001800c0001007061796c6f6164002400028008000100000000010800020000000001080003000000000c08000400000000032c00018008000100636d700020000280080001000000000108000200000000010c00038007000100c00002002000018007000100637400001400028008000200000000000800010000000001440001800c0001006269747769736500340002800800010000000001080002000000000108000300000000040c00048008000100060000000c00058008000100000000002c00018008000100636d700020000280080001000000000108000200000000010c00038008000100000000002000018007000100637400001400028008000200000000020800010000000001440001800c0001006269747769736500340002800800010000000001080002000000000108000300000000040c00048008000100200000000c00058008000100000000002c00018008000100636d700020000280080001000000000108000200000000010c0003800800010000000000140001800c000100636f756e74657200040002800c000700000668656c6c6f00";
    // Everything up to the user data is identical; the user data starts with nft's comment
    // TLV and continues with our fingerprint TLV.
    let nft = unhex(nft);
    let udata_at = nft.len() - 12;
    assert_eq!(hex(&m[0].1[..udata_at]), hex(&nft[..udata_at]));
    let mut udata = vec![0u8, 6];
    udata.extend_from_slice(b"hello\0");
    udata.extend_from_slice(&[NODELB_UDATA_RULE_FINGERPRINT, 8]);
    udata.extend_from_slice(&fingerprint(&rule).to_be_bytes());
    // (then padding to 4 bytes)
    assert_eq!(hex(&m[0].1[udata_at + 4..udata_at + 4 + udata.len()]), hex(&udata));
}

#[test]
fn mark_operations_match_nft() {
    let ours =
        rule_payload("svc-a", vec![Expr::MarkHas(0x4000), Expr::MarkSet(0x4000), Expr::MarkXor(0x4000)]);
    assert_rule_prefix(
        &ours,
        "010000000b0001006e6f64656c6200000a0002007376632d61000000c801048024000180090001006d6574610000000014000280080002000000000308000100000000014c0001800c00010062697477697365003c00028008000100000000010800020000000001080006000000000008000300000000040c00048008000100004000000c00058008000100000000002c00018008000100636d700020000280080001000000000108000200000000000c000380080001000040000024000180090001006d6574610000000014000280080002000000000308000100000000014c0001800c00010062697477697365003c00028008000100000000010800020000000001080006000000000008000300000000040c00048008000100ffbfffff0c000580080001000040000024000180090001006d65746100000000140002800800020000000003080003000000000124000180090001006d6574610000000014000280080002000000000308000100000000014c0001800c00010062697477697365003c00028008000100000000010800020000000001080006000000000008000300000000040c00048008000100ffffffff0c000580080001000040000024000180090001006d657461000000001400028008000200000000030800030000000001",
    );
}

#[test]
fn ipv6_unaligned_prefix_and_verdict_match_nft() {
    let ours = rule_payload(
        "post",
        vec![
            Expr::SaddrInPrefix { prefix: "2001:db8::/33".parse().expect("cidr"), negate: false },
            Expr::DaddrInPrefix { prefix: "2001:db8::1/128".parse().expect("cidr"), negate: false },
            Expr::Verdict(Verdict::Accept),
        ],
    );
    assert_rule_prefix(
        &ours,
        "010000000b0001006e6f64656c62000009000200706f737400000000b801048024000180090001006d6574610000000014000280080002000000000f08000100000000012c00018008000100636d700020000280080001000000000108000200000000000c000380050001000a000000340001800c0001007061796c6f6164002400028008000100000000010800020000000001080003000000000808000400000000105c0001800c00010062697477697365004c0002800800010000000001080002000000000108000300000000101800048014000100ffffffff8000000000000000000000001800058014000100000000000000000000000000000000003800018008000100636d70002c00028008000100000000010800020000000000180003801400010020010db8000000000000000000000000340001800c0001007061796c6f6164002400028008000100000000010800020000000001080003000000001808000400000000103800018008000100636d70002c00028008000100000000010800020000000000180003801400010020010db8000000000000000000000001300001800e000100696d6d6564696174650000001c0002800800010000000000100002800c0002800800010000000001",
    );
}

#[test]
fn dnat_ipv4_with_port_matches_nft() {
    let ours = rule_payload(
        "ep1",
        vec![Expr::L4Proto(Protocol::Tcp), Expr::Dnat { addr: "192.0.2.1".parse().expect("ip"), port: 8080 }],
    );
    assert_rule_prefix(
        &ours,
        "010000000b0001006e6f64656c6200000800020065703100e400048024000180090001006d6574610000000014000280080002000000001008000100000000012c00018008000100636d700020000280080001000000000108000200000000000c00038005000100060000002c0001800e000100696d6d6564696174650000001800028008000100000000010c00028008000100c00002012c0001800e000100696d6d6564696174650000001800028008000100000000020c000280060001001f90000038000180080001006e6174002c00028008000100000000010800020000000002080003000000000108000500000000020800070000000002",
    );
}

#[test]
fn registers_follow_nft_numbering() {
    assert_eq!(reg(0), 1);
    assert_eq!(reg(1), 9);
    assert_eq!(reg(4), 2);
    assert_eq!(reg(5), 13);
}

#[test]
fn key_type_ids_and_lengths() {
    use KeyType::*;
    assert_eq!(key_type_id(&[InetProto, InetService]), 0x30d);
    assert_eq!(key_type_id(&[Ipv4Addr, InetProto, InetService]), 0x730d);
    assert_eq!(key_type_id(&[Ipv6Addr, InetProto, InetService]), 0x830d);
    let k = Key::addr_proto_port("2001:db8::1".parse().expect("ip"), Protocol::Udp, 53);
    let b = key_bytes(Some(&[Ipv6Addr, InetProto, InetService]), &k).expect("key");
    assert_eq!(b.len(), 24);
    assert_eq!(crate::encode::nft::decode::key(&[Ipv6Addr, InetProto, InetService], &b), Some(k));
    assert_eq!(crate::encode::nft::decode::key_types(0x830d), Some(vec![Ipv6Addr, InetProto, InetService]));
    // A key that does not fit the set is an error, not a panic.
    assert!(key_bytes(Some(&[Ipv4Addr]), &Key::new(&[KeyPart::Port(1)]).expect("key")).is_err());
}

#[test]
fn big_element_lists_are_split_under_the_attribute_limit() {
    let elements: Vec<_> = (0..5000u16)
        .map(|p| (Key::proto_port(Protocol::Tcp, p), Some(Mapped::Verdict(Verdict::Accept))))
        .collect();
    let m = encode(&[Change::AddElements { set: "m".into(), elements }]);
    assert!(m.len() > 1);
    assert!(m.iter().all(|(_, p)| p.len() < 65535));
}

#[test]
fn errors_map_back_to_changes() {
    let changes = vec![
        Change::AddTable(Table::Main),
        Change::AddSet(svc_ports()),
        Change::AddRule {
            chain: "c".into(),
            rule: Rule::new(vec![Expr::Verdict(Verdict::Jump("x".into()))]),
        },
    ];
    let enc = encode_batch(&changes, 7).expect("encode");
    assert_eq!(enc.change_of(7), None); // BATCH_BEGIN
    assert_eq!(enc.change_of(8), Some(0));
    assert_eq!(enc.change_of(enc.last_seq() - 1), Some(2));
    assert_eq!(describe(&changes[2]), "add rule to chain c `jump x`");
}

/// A full replace encoded from the ruleset (elements walked in the set itself) is byte for
/// byte the one encoded from its change list, and elements split into several messages alike.
#[test]
fn full_replace_from_the_ruleset_encodes_like_its_change_list() {
    let mut rs = ir::Ruleset::default();
    let mut set = svc_ports();
    for port in 1..=6000u16 {
        let key = Key::proto_port(Protocol::Tcp, port);
        set.elements.insert(key, Some(Mapped::Verdict(Verdict::Goto(format!("svc-{port}").into()))));
    }
    rs.add_set(set);
    rs.add_chain(ir::Chain {
        name: "c".into(),
        base: None,
        rules: vec![Rule::new(vec![Expr::Verdict(Verdict::Accept)])],
        comment: Some("chain".into()),
    });
    let direct = encode_refs(rs.full_replace_refs(), 5).expect("encode refs");
    let listed = encode_batch(&rs.full_replace(), 5).expect("encode list");
    assert_eq!(direct.bytes(), listed.bytes());
    assert_eq!(direct.msg_change, listed.msg_change);
    let element_msgs = messages(&direct.bytes())
        .expect("parse")
        .iter()
        .filter(|m| m.ty == msg_type(NFT_MSG_NEWSETELEM))
        .count();
    assert!(element_msgs > 1, "6,000 elements need more than one message");
}

#[test]
fn invalid_ir_is_an_encode_error() {
    let e = encode_batch(
        &[Change::AddRule {
            chain: "c".into(),
            rule: Rule::new(vec![Expr::NumgenRandomIs { modulus: 0, value: 0 }]),
        }],
        1,
    );
    assert!(matches!(e, Err(NftError::Encode(_))));
}
