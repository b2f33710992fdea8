//! x_tables match and target payloads (`struct xt_*_info` as iptables writes them), decoded into
//! [`hostfw`] tests and actions, and the few nodelb writes. Shared by the nftables reader
//! (iptables-nft keeps `-m conntrack`, `-m state`, some `-m mark` and its targets as `match` /
//! `target` compat expressions) and the iptables-legacy reader, whose entries hold the same
//! payloads. Pure: bytes in, values out; nothing here panics on any input.

use crate::core::ruleset::hostfw::{Action, Test, ct_state};

/// `-m conntrack` (`struct xt_conntrack_mtinfo1/2/3`): offsets of the fields after the eight
/// addresses (8 × 16 bytes), the timeouts (2 × 4), the protocol (2) and the ports (4 × 2).
const CONNTRACK_FLAGS_AT: usize = 146;
const XT_CONNTRACK_STATE: u16 = 1 << 0;
const XT_CONNTRACK_STATUS: u16 = 1 << 6;
const XT_CONNTRACK_STATE_ALIAS: u16 = 1 << 13;
/// `XT_CONNTRACK_STATE_SNAT`, `_DNAT`, `_UNTRACKED`: `1 << (IP_CT_NUMBER + 1..3)` (the low bits
/// are the `ct state` bits).
const XT_CONNTRACK_SNAT: u32 = 1 << 6;
const XT_CONNTRACK_DNAT: u32 = 1 << 7;
const XT_CONNTRACK_UNTRACKED: u32 = 1 << 8;
/// `XT_STATE_UNTRACKED` of `-m state`.
const XT_STATE_UNTRACKED: u32 = 1 << 4;

/// Size of `struct xt_comment_info` (`XT_MAX_COMMENT_LEN`).
pub const COMMENT_LEN: usize = 256;
/// Size of `struct xt_mark_mtinfo1` (mark, mask, invert), padded to 8 (`XT_ALIGN`).
pub const MARK_INFO_LEN: usize = 16;

/// Targets that never end the evaluation of a chain.
const CONTINUING_TARGETS: &[&str] = &[
    "LOG",
    "NFLOG",
    "ULOG",
    "MARK",
    "CONNMARK",
    "TCPMSS",
    "CLASSIFY",
    "CT",
    "NOTRACK",
    "AUDIT",
    "TRACE",
    "DSCP",
    "TOS",
    "CHECKSUM",
    "SECMARK",
    "CONNSECMARK",
    "TEE",
    "IDLETIMER",
    "LED",
    "HMARK",
    "TTL",
    "HL",
    "ECN",
    "RATEEST",
];

/// The native-endian number at `at` of a kernel xtables structure (`None` past its end).
pub fn u16_at(b: &[u8], at: usize) -> Option<u16> {
    Some(u16::from_ne_bytes(b.get(at..at + 2)?.try_into().ok()?))
}

/// The native-endian number at `at` of a kernel xtables structure (`None` past its end).
pub fn u32_at(b: &[u8], at: usize) -> Option<u32> {
    Some(u32::from_ne_bytes(b.get(at..at + 4)?.try_into().ok()?))
}

/// A NUL-terminated string of a fixed-size field.
pub fn c_string(b: &[u8]) -> String {
    let end = b.iter().position(|&c| c == 0).unwrap_or(b.len());
    String::from_utf8_lossy(&b[..end]).into_owned()
}

/// What a match contributes to a rule: tests, and (for `-m comment`) its comment.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct MatchInfo {
    pub tests: Vec<Test>,
    pub comment: Option<String>,
}

/// `ct state` bits of a `-m conntrack --ctstate` mask: the low four are the same, untracked moves.
fn conntrack_states(mask: u32) -> (u32, bool, bool) {
    let mut states = mask & (ct_state::INVALID | ct_state::ESTABLISHED | ct_state::RELATED | ct_state::NEW);
    if mask & XT_CONNTRACK_UNTRACKED != 0 {
        states |= ct_state::UNTRACKED;
    }
    (states, mask & XT_CONNTRACK_SNAT != 0, mask & XT_CONNTRACK_DNAT != 0)
}

/// Decodes match `name` revision `rev` with payload `info`.
pub fn decode_match(name: &str, rev: u32, info: &[u8]) -> MatchInfo {
    let other = || MatchInfo { tests: vec![Test::Other(format!("-m {name}"))], comment: None };
    match (name, rev) {
        ("comment", _) => MatchInfo { tests: vec![], comment: Some(c_string(info)) },
        ("conntrack", 1..=3) => {
            let (Some(flags), Some(invert)) =
                (u16_at(info, CONNTRACK_FLAGS_AT), u16_at(info, CONNTRACK_FLAGS_AT + 2))
            else {
                return other();
            };
            let at = CONNTRACK_FLAGS_AT + 4;
            let (state, status) = if rev == 1 {
                (info.get(at).map(|&b| u32::from(b)), info.get(at + 1).map(|&b| u32::from(b)))
            } else {
                (u16_at(info, at).map(u32::from), u16_at(info, at + 2).map(u32::from))
            };
            let (Some(state), Some(status)) = (state, status) else { return other() };
            let mut tests = Vec::new();
            if flags & XT_CONNTRACK_STATE != 0 {
                let (states, snat, dnat) = conntrack_states(state);
                tests.push(Test::CtState { states, snat, dnat, invert: invert & XT_CONNTRACK_STATE != 0 });
            }
            if flags & XT_CONNTRACK_STATUS != 0 {
                tests.push(Test::CtStatus { mask: status, invert: invert & XT_CONNTRACK_STATUS != 0 });
            }
            let rest = flags & !(XT_CONNTRACK_STATE | XT_CONNTRACK_STATUS | XT_CONNTRACK_STATE_ALIAS);
            if rest != 0 {
                tests.push(Test::Other(format!("-m conntrack (flags {rest:#x})")));
            }
            MatchInfo { tests, comment: None }
        }
        ("state", 0) => match u32_at(info, 0) {
            Some(mask) => {
                let mut states = mask & 0xf;
                if mask & XT_STATE_UNTRACKED != 0 {
                    states |= ct_state::UNTRACKED;
                }
                MatchInfo {
                    tests: vec![Test::CtState { states, snat: false, dnat: false, invert: false }],
                    comment: None,
                }
            }
            None => other(),
        },
        ("mark", 1) => match (u32_at(info, 0), u32_at(info, 4), info.get(8)) {
            (Some(value), Some(mask), Some(&invert)) => {
                MatchInfo { tests: vec![Test::Mark { mask, value, invert: invert != 0 }], comment: None }
            }
            _ => other(),
        },
        _ => other(),
    }
}

/// What target `name` does (iptables-nft's compat `target`; the legacy reader handles the
/// standard and error targets itself).
pub fn target_action(name: &str) -> Action {
    match name {
        "REJECT" => Action::Reject,
        n if CONTINUING_TARGETS.contains(&n) => Action::Continue,
        n => Action::Unknown(format!("-j {n}")),
    }
}

/// `struct xt_mark_mtinfo1` for `--mark bit/bit`.
pub fn mark_info(bit: u32) -> [u8; MARK_INFO_LEN] {
    let mut b = [0u8; MARK_INFO_LEN];
    b[0..4].copy_from_slice(&bit.to_ne_bytes());
    b[4..8].copy_from_slice(&bit.to_ne_bytes());
    b
}

/// `struct xt_comment_info` holding `text` (cut to fit with its NUL).
pub fn comment_info(text: &str) -> [u8; COMMENT_LEN] {
    let mut b = [0u8; COMMENT_LEN];
    let n = text.len().min(COMMENT_LEN - 1);
    b[..n].copy_from_slice(&text.as_bytes()[..n]);
    b
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `struct xt_conntrack_mtinfo3` with the given flags, inversions and state mask.
    fn conntrack3(flags: u16, invert: u16, state: u16) -> Vec<u8> {
        let mut b = vec![0u8; 164];
        b[146..148].copy_from_slice(&flags.to_ne_bytes());
        b[148..150].copy_from_slice(&invert.to_ne_bytes());
        b[150..152].copy_from_slice(&state.to_ne_bytes());
        b
    }

    #[test]
    fn matches_decode() {
        let st = |states, snat, dnat, invert| Test::CtState { states, snat, dnat, invert };
        #[rustfmt::skip]
        let cases: Vec<(&str, &str, u32, Vec<u8>, MatchInfo)> = vec![
            ("--ctstate RELATED,ESTABLISHED", "conntrack", 3, conntrack3(1, 0, 0b110),
                MatchInfo { tests: vec![st(6, false, false, false)], comment: None }),
            ("--ctstate DNAT", "conntrack", 3, conntrack3(1, 0, 1 << 7),
                MatchInfo { tests: vec![st(0, false, true, false)], comment: None }),
            ("! --ctstate NEW,UNTRACKED", "conntrack", 2, conntrack3(1, 1, 8 | 1 << 8),
                MatchInfo { tests: vec![st(8 | 64, false, false, true)], comment: None }),
            ("--ctstate INVALID (rev 1, u8 masks)", "conntrack", 1, { let mut b = vec![0u8; 152]; b[146] = 1; b[150] = 1; b },
                MatchInfo { tests: vec![st(1, false, false, false)], comment: None }),
            ("--ctstate NEW --ctorigdst 10.0.0.1", "conntrack", 3, conntrack3(1 | 1 << 3, 0, 8),
                MatchInfo { tests: vec![st(8, false, false, false), Test::Other("-m conntrack (flags 0x8)".into())], comment: None }),
            ("--ctstatus DNAT", "conntrack", 3, { let mut b = conntrack3(1 << 6, 0, 0); b[152..154].copy_from_slice(&32u16.to_ne_bytes()); b },
                MatchInfo { tests: vec![Test::CtStatus { mask: 32, invert: false }], comment: None }),
            ("truncated conntrack", "conntrack", 3, vec![0u8; 10],
                MatchInfo { tests: vec![Test::Other("-m conntrack".into())], comment: None }),
            ("-m state --state NEW,UNTRACKED", "state", 0, (8u32 | 16).to_ne_bytes().to_vec(),
                MatchInfo { tests: vec![st(8 | 64, false, false, false)], comment: None }),
            ("-m mark --mark 0x2000/0x2000", "mark", 1, mark_info(0x2000).to_vec(),
                MatchInfo { tests: vec![Test::Mark { mask: 0x2000, value: 0x2000, invert: false }], comment: None }),
            ("-m comment", "comment", 0, comment_info("hello").to_vec(),
                MatchInfo { tests: vec![], comment: Some("hello".into()) }),
            ("-m multiport", "multiport", 1, vec![1, 2, 3],
                MatchInfo { tests: vec![Test::Other("-m multiport".into())], comment: None }),
        ];
        for (what, name, rev, info, want) in cases {
            assert_eq!(decode_match(name, rev, &info), want, "{what}");
        }
    }

    #[test]
    fn targets_and_payloads() {
        assert_eq!(target_action("REJECT"), Action::Reject);
        assert_eq!(target_action("LOG"), Action::Continue);
        assert_eq!(target_action("NFQUEUE"), Action::Unknown("-j NFQUEUE".into()));
        let long = "x".repeat(300);
        let c = comment_info(&long);
        assert_eq!(c[COMMENT_LEN - 1], 0, "always NUL-terminated");
        assert_eq!(c_string(&c).len(), COMMENT_LEN - 1);
        assert_eq!(c_string(b"abc\0def"), "abc");
        let m = mark_info(0x2000);
        assert_eq!(
            (u32_at(&m, 0), u32_at(&m, 4), m[8]),
            (Some(0x2000), Some(0x2000), 0),
            "mark, mask, not inverted"
        );
    }
}
