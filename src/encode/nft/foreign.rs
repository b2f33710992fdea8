//! Other tables' chains, read-only, and the one rule nodelb may write into iptables' `filter
//! FORWARD` chain. Pure: dump replies in, [`hostfw`] chains and rules out (the expressions a rule
//! is made of interpreted as tests and an action, as far as [`hostfw::analyse`] needs them); and
//! the bytes of the batch that inserts or deletes nodelb's ACCEPT.
//!
//! nodelb's ACCEPT is written exactly as `iptables-nft -I FORWARD -m mark --mark B/B -m comment
//! --comment … -j ACCEPT` reads it back: `meta load mark`, `bitwise & B`, `cmp eq B`, `counter`,
//! `immediate accept` (iptables-nft 1.8.9 parses meta, bitwise, cmp, counter and immediate
//! natively, and refuses a table holding any expression outside its list), the comment as rule
//! user data (type 0, NUL-terminated: what iptables-nft turns into `-m comment`).

use std::fmt::Write as _;
use std::net::{Ipv4Addr, Ipv6Addr};

use super::NftError;
use super::consts::*;
use super::encode::msg_type;
use super::nla::{Writer, as_str, as_u32, as_u64, attrs, get, table, udata_iter, udata_put};
use crate::core::ruleset::hostfw::{Action, HostRule, TableFamily, Test, accept_comment};
use crate::encode::xt;

// Attributes of expressions nodelb only reads (nf_tables.h, nf_tables_compat.h).
const NFTA_CT_SREG: u16 = 4;
const NFTA_PAYLOAD_SREG: u16 = 5;
const NFTA_LOOKUP_FLAGS: u16 = 5;
const NFT_LOOKUP_F_INV: u32 = 1;
const NFTA_MATCH_NAME: u16 = 1;
const NFTA_MATCH_REV: u16 = 2;
const NFTA_MATCH_INFO: u16 = 3;
/// NF_INET_FORWARD.
const HOOK_FORWARD: u32 = 2;
const NFT_META_IIFNAME: u32 = 6;
const NFT_META_OIFNAME: u32 = 7;
const NFT_META_IIF: u32 = 4;
const NFT_META_OIF: u32 = 5;
const NFT_CMP_OPS: [&str; 6] = ["==", "!=", "<", "<=", ">", ">="];
const NFT_CONTINUE: i32 = -1;
const NFT_BREAK: i32 = -2;

/// A chain as the chain dump lists it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ChainHead {
    /// NFPROTO_* of its table.
    pub nfproto: u8,
    pub table: String,
    pub name: String,
    /// For a base chain on the forward hook: priority and whether the policy drops.
    pub forward: Option<(i32, bool)>,
    /// A base chain on another hook.
    pub other_hook: bool,
}

impl ChainHead {
    pub fn family(&self) -> Option<TableFamily> {
        TableFamily::from_nfproto(self.nfproto)
    }
}

fn body(payload: &[u8]) -> Result<(u8, &[u8]), NftError> {
    match payload {
        [family, _, _, _, rest @ ..] => Ok((*family, rest)),
        _ => Err(NftError::Malformed("message shorter than nfgenmsg".into())),
    }
}

/// A NEWCHAIN reply of a dump over every family.
pub fn chain_head(payload: &[u8]) -> Result<ChainHead, NftError> {
    let (nfproto, b) = body(payload)?;
    let t = table(b)?;
    let name = get(&t, NFTA_CHAIN_NAME).map(as_str).unwrap_or_default();
    let tbl = get(&t, NFTA_CHAIN_TABLE).map(as_str).unwrap_or_default();
    let mut head = ChainHead { nfproto, table: tbl, name, forward: None, other_hook: false };
    if let Some(h) = get(&t, NFTA_CHAIN_HOOK) {
        let ht = table(h)?;
        let hook = get(&ht, NFTA_HOOK_HOOKNUM).map(as_u32).transpose()?;
        let priority = get(&ht, NFTA_HOOK_PRIORITY).map(as_u32).transpose()?.unwrap_or(0) as i32;
        let policy = get(&t, NFTA_CHAIN_POLICY).map(as_u32).transpose()?;
        if hook == Some(HOOK_FORWARD) {
            head.forward = Some((priority, policy == Some(NF_DROP as u32)));
        } else {
            head.other_hook = true;
        }
    }
    Ok(head)
}

/// What a register holds while a rule is decoded.
#[derive(Debug, Clone)]
enum Reg {
    Meta(u32),
    Ct(u32),
    Payload { base: u32, offset: u32, len: u32 },
    Masked { inner: Box<Reg>, mask: Vec<u8> },
    Unknown,
}

/// `NFT_REG_1..4` (16 bytes) and `NFT_REG32_*` name the same storage; one numbering.
fn reg_index(r: u32) -> u32 {
    if (1..=4).contains(&r) { 8 + (r - 1) * 4 } else { r }
}

fn data_value(nested: &[u8]) -> Result<Vec<u8>, NftError> {
    let t = table(nested)?;
    Ok(get(&t, NFTA_DATA_VALUE).unwrap_or_default().to_vec())
}

fn ne_u32(b: &[u8]) -> Option<u32> {
    Some(u32::from_ne_bytes(b.get(..4)?.try_into().ok()?))
}

fn hex(b: &[u8]) -> String {
    b.iter().fold(String::new(), |mut s, x| {
        let _ = write!(s, "{x:02x}");
        s
    })
}

/// An address with its mask, as a prefix when the mask is one (`10.42.0.0/16`).
fn prefix(addr: &[u8], mask: Option<&[u8]>) -> String {
    let ones = match mask {
        None => Some(addr.len() * 8),
        Some(m) => {
            let bits: Vec<bool> =
                m.iter().flat_map(|b| (0..8).rev().map(move |i| b & (1 << i) != 0)).collect();
            let n = bits.iter().take_while(|b| **b).count();
            bits[n..].iter().all(|b| !b).then_some(n)
        }
    };
    let a = match addr.len() {
        4 => Ipv4Addr::from(<[u8; 4]>::try_from(addr).unwrap_or_default()).to_string(),
        16 => Ipv6Addr::from(<[u8; 16]>::try_from(addr).unwrap_or_default()).to_string(),
        _ => hex(addr),
    };
    match (ones, mask) {
        (Some(n), Some(_)) => format!("{a}/{n}"),
        (Some(_), None) => a,
        (None, Some(m)) => format!("{a} & {}", hex(m)),
        (None, None) => a,
    }
}

/// Words for a payload comparison nodelb cannot judge (for the report only).
fn payload_words(base: u32, offset: u32, len: u32, mask: Option<&[u8]>, op: &str, data: &[u8]) -> String {
    let field = match (base, offset, len) {
        (NFT_PAYLOAD_NETWORK_HEADER, 12, 4) => Some("ip saddr"),
        (NFT_PAYLOAD_NETWORK_HEADER, 16, 4) => Some("ip daddr"),
        (NFT_PAYLOAD_NETWORK_HEADER, 8, 16) => Some("ip6 saddr"),
        (NFT_PAYLOAD_NETWORK_HEADER, 24, 16) => Some("ip6 daddr"),
        _ => None,
    };
    if let Some(field) = field {
        return format!("{field} {}{}", if op == "==" { "" } else { "!= " }, prefix(data, mask));
    }
    let port = match (base, offset, len) {
        (NFT_PAYLOAD_TRANSPORT_HEADER, 0, 2) => Some("th sport"),
        (NFT_PAYLOAD_TRANSPORT_HEADER, 2, 2) => Some("th dport"),
        _ => None,
    };
    match (port, <[u8; 2]>::try_from(data)) {
        (Some(field), Ok(b)) if mask.is_none() => format!("{field} {op} {}", u16::from_be_bytes(b)),
        _ => {
            let base = match base {
                0 => "ll",
                NFT_PAYLOAD_NETWORK_HEADER => "nh",
                NFT_PAYLOAD_TRANSPORT_HEADER => "th",
                _ => "?",
            };
            format!("@{base},{},{} {op} {}", offset * 8, len * 8, hex(data))
        }
    }
}

/// The test a `cmp` of register content `reg` makes.
fn cmp_test(reg: &Reg, op: u32, data: &[u8]) -> Test {
    let op_word = NFT_CMP_OPS.get(op as usize).copied().unwrap_or("?");
    let eq_neq = op == NFT_CMP_EQ || op == NFT_CMP_NEQ;
    let invert = op == NFT_CMP_NEQ;
    let zero = data.iter().all(|b| *b == 0);
    let (inner, mask) = match reg {
        Reg::Masked { inner, mask } => (inner.as_ref(), Some(mask.as_slice())),
        other => (other, None),
    };
    match (inner, mask) {
        (Reg::Meta(NFT_META_NFPROTO), None) if eq_neq && data.len() == 1 => {
            Test::NfProto { proto: data[0], invert }
        }
        (Reg::Meta(NFT_META_MARK), m) if eq_neq => match (m.map_or(Some(u32::MAX), ne_u32), ne_u32(data)) {
            (Some(mask), Some(value)) => Test::Mark { mask, value, invert },
            _ => Test::Other(format!("meta mark {op_word} {}", hex(data))),
        },
        // `ct state x` / `ct status x`: `ct & bits != 0`.
        (Reg::Ct(key @ (NFT_CT_STATE | NFT_CT_STATUS)), Some(m)) if eq_neq && zero => match ne_u32(m) {
            Some(bits) if *key == NFT_CT_STATE => {
                Test::CtState { states: bits, snat: false, dnat: false, invert: !invert }
            }
            Some(bits) => Test::CtStatus { mask: bits, invert: !invert },
            None => Test::Other(format!("ct {op_word} {}", hex(data))),
        },
        (Reg::Meta(k @ (NFT_META_IIFNAME | NFT_META_OIFNAME)), None) => {
            let dir = if *k == NFT_META_IIFNAME { "iifname" } else { "oifname" };
            let name = xt::c_string(data);
            let wildcard = if data.last() == Some(&0) { "" } else { "*" };
            Test::Other(format!("{dir} {op_word} \"{name}{wildcard}\""))
        }
        (Reg::Meta(k @ (NFT_META_IIF | NFT_META_OIF)), None) => {
            let dir = if *k == NFT_META_IIF { "iif" } else { "oif" };
            Test::Other(format!("{dir} {op_word} index {}", ne_u32(data).unwrap_or(0)))
        }
        (Reg::Meta(NFT_META_L4PROTO), None) if data.len() == 1 => {
            Test::Other(format!("meta l4proto {op_word} {}", data[0]))
        }
        (Reg::Meta(k), _) => Test::Other(format!("meta key {k} {op_word} {}", hex(data))),
        (Reg::Ct(k), _) => Test::Other(format!("ct key {k} {op_word} {}", hex(data))),
        (Reg::Payload { base, offset, len }, m) => {
            Test::Other(payload_words(*base, *offset, *len, m, op_word, data))
        }
        _ => Test::Other(format!("(expression) {op_word} {}", hex(data))),
    }
}

fn verdict_action(code: i32, chain: Option<String>) -> Action {
    match (code, chain) {
        (NF_ACCEPT, _) => Action::Accept,
        (NF_DROP, _) => Action::Drop,
        (NFT_RETURN, _) => Action::Return,
        (NFT_JUMP, Some(c)) => Action::Jump(c),
        (NFT_GOTO, Some(c)) => Action::Goto(c),
        (NFT_CONTINUE, _) => Action::Continue,
        (NFT_BREAK, _) => Action::Continue,
        (code, _) => Action::Unknown(format!("verdict {code}")),
    }
}

/// A NEWRULE reply: its chain and the rule as tests and an action.
pub fn rule(payload: &[u8]) -> Result<(String, HostRule), NftError> {
    let (_, b) = body(payload)?;
    let t = table(b)?;
    let chain = get(&t, NFTA_RULE_CHAIN).map(as_str).unwrap_or_default();
    let handle = get(&t, NFTA_RULE_HANDLE).map(as_u64).transpose()?;
    let mut r = HostRule { tests: Vec::new(), action: Action::Continue, comment: None, handle };
    if let Some(u) = get(&t, NFTA_RULE_USERDATA) {
        r.comment = udata_iter(u).find(|(ty, _)| *ty == NFTNL_UDATA_RULE_COMMENT).map(|(_, v)| as_str(v));
    }
    let mut regs: std::collections::BTreeMap<u32, Reg> = Default::default();
    let Some(list) = get(&t, NFTA_RULE_EXPRESSIONS) else { return Ok((chain, r)) };
    for a in attrs(list) {
        let (_, e) = a?;
        let et = table(e)?;
        let name = get(&et, NFTA_EXPR_NAME).map(as_str).unwrap_or_default();
        let dt = table(get(&et, NFTA_EXPR_DATA).unwrap_or(&[]))?;
        let u32_attr = |ty| get(&dt, ty).map(as_u32).transpose();
        let reg_of = |r: Option<u32>| r.map(reg_index);
        match name.as_str() {
            "meta" => {
                // Without a destination register: `meta … set`, a statement.
                if let (Some(d), Some(k)) = (reg_of(u32_attr(NFTA_META_DREG)?), u32_attr(NFTA_META_KEY)?) {
                    regs.insert(d, Reg::Meta(k));
                }
            }
            "ct" if get(&dt, NFTA_CT_SREG).is_none() => {
                if let (Some(d), Some(k)) = (reg_of(u32_attr(NFTA_CT_DREG)?), u32_attr(NFTA_CT_KEY)?) {
                    regs.insert(d, Reg::Ct(k));
                }
            }
            "ct" => {}
            "payload" if get(&dt, NFTA_PAYLOAD_SREG).is_none() => {
                if let Some(d) = reg_of(u32_attr(NFTA_PAYLOAD_DREG)?) {
                    let p = Reg::Payload {
                        base: u32_attr(NFTA_PAYLOAD_BASE)?.unwrap_or(0),
                        offset: u32_attr(NFTA_PAYLOAD_OFFSET)?.unwrap_or(0),
                        len: u32_attr(NFTA_PAYLOAD_LEN)?.unwrap_or(0),
                    };
                    regs.insert(d, p);
                }
            }
            "payload" => {}
            "bitwise" => {
                let (s, d) = (reg_of(u32_attr(NFTA_BITWISE_SREG)?), reg_of(u32_attr(NFTA_BITWISE_DREG)?));
                let boolean = u32_attr(NFTA_BITWISE_OP)?.unwrap_or(NFT_BITWISE_BOOL) == NFT_BITWISE_BOOL;
                let xor = get(&dt, NFTA_BITWISE_XOR).map(data_value).transpose()?.unwrap_or_default();
                let mask = get(&dt, NFTA_BITWISE_MASK).map(data_value).transpose()?;
                if let Some(d) = d {
                    let inner = s.and_then(|s| regs.get(&s)).cloned().unwrap_or(Reg::Unknown);
                    let masked = match mask {
                        Some(mask) if boolean && xor.iter().all(|b| *b == 0) => {
                            Reg::Masked { inner: Box::new(inner), mask }
                        }
                        _ => Reg::Unknown,
                    };
                    regs.insert(d, masked);
                }
            }
            "cmp" => {
                let s = reg_of(u32_attr(NFTA_CMP_SREG)?).unwrap_or(0);
                let op = u32_attr(NFTA_CMP_OP)?.unwrap_or(NFT_CMP_EQ);
                let data = get(&dt, NFTA_CMP_DATA).map(data_value).transpose()?.unwrap_or_default();
                r.tests.push(cmp_test(regs.get(&s).unwrap_or(&Reg::Unknown), op, &data));
            }
            "immediate" => {
                let d = u32_attr(NFTA_IMMEDIATE_DREG)?.unwrap_or(0);
                let data = table(get(&dt, NFTA_IMMEDIATE_DATA).unwrap_or(&[]))?;
                match (d, get(&data, NFTA_DATA_VERDICT)) {
                    (0, Some(v)) => {
                        let vt = table(v)?;
                        let code = get(&vt, NFTA_VERDICT_CODE).map(as_u32).transpose()?.unwrap_or(0) as i32;
                        r.action = verdict_action(code, get(&vt, NFTA_VERDICT_CHAIN).map(as_str));
                    }
                    (d, _) => {
                        regs.insert(reg_index(d), Reg::Unknown);
                    }
                }
            }
            "lookup" => {
                let set = get(&dt, NFTA_LOOKUP_SET).map(as_str).unwrap_or_default();
                let inv = u32_attr(NFTA_LOOKUP_FLAGS)?.unwrap_or(0) & NFT_LOOKUP_F_INV != 0;
                match u32_attr(NFTA_LOOKUP_DREG)? {
                    None => r.tests.push(Test::Other(format!("{}@{set}", if inv { "!= " } else { "" }))),
                    Some(0) => r.action = Action::Unknown(format!("vmap @{set}")),
                    Some(d) => {
                        r.tests.push(Test::Other(format!("map @{set}")));
                        regs.insert(reg_index(d), Reg::Unknown);
                    }
                }
            }
            "match" => {
                let mname = get(&dt, NFTA_MATCH_NAME).map(as_str).unwrap_or_default();
                let rev = u32_attr(NFTA_MATCH_REV)?.unwrap_or(0);
                let m = xt::decode_match(&mname, rev, get(&dt, NFTA_MATCH_INFO).unwrap_or(&[]));
                r.tests.extend(m.tests);
                if r.comment.is_none() {
                    r.comment = m.comment;
                }
            }
            "target" => {
                let tname = get(&dt, NFTA_MATCH_NAME).map(as_str).unwrap_or_default();
                r.action = xt::target_action(&tname);
            }
            "reject" => r.action = Action::Reject,
            "queue" | "fwd" | "dup" | "nat" | "masq" | "redir" | "tproxy" | "synproxy" => {
                r.action = Action::Unknown(name.clone());
            }
            // Statements and counters: no test, no verdict.
            "counter" | "log" | "notrack" | "objref" | "flow_offload" | "tunnel" => {}
            // Anything else may be a test nodelb cannot judge (fib, limit, quota, range, …).
            _ => r.tests.push(Test::Other(name.clone())),
        }
    }
    Ok((chain, r))
}

/// One change to nodelb's rules in iptables' FORWARD chain of one family.
#[derive(Debug, Clone, Copy)]
pub struct AcceptWrite<'a> {
    /// The ruleset generation the change was decided on: the kernel refuses the batch
    /// (ERESTART) if anything changed since, so a rule is never deleted by a stale handle or
    /// inserted twice.
    pub genid: u32,
    /// NFPROTO_IPV4 or NFPROTO_IPV6.
    pub nfproto: u8,
    pub table: &'a str,
    pub chain: &'a str,
    /// Handles of nodelb's rules to delete.
    pub stale: &'a [u64],
    /// Insert nodelb's ACCEPT for this mark bit at the head of the chain.
    pub insert: Option<u32>,
}

impl AcceptWrite<'_> {
    /// Messages between BATCH_BEGIN and BATCH_END.
    pub fn messages(&self) -> u32 {
        self.stale.len() as u32 + u32::from(self.insert.is_some())
    }
}

/// The batch of `change`, its BATCH_BEGIN numbered `first_seq`.
pub fn accept_batch(first_seq: u32, change: &AcceptWrite<'_>) -> Result<Vec<u8>, NftError> {
    let AcceptWrite { genid, nfproto, table: table_name, chain, stale, insert } = *change;
    let mut w = Writer::new();
    let mut seq = first_seq;
    w.begin_msg(NFNL_MSG_BATCH_BEGIN, NLM_F_REQUEST, seq, NFPROTO_UNSPEC, u16::from(NFNL_SUBSYS_NFTABLES));
    w.put_u32(NFNL_BATCH_GENID, genid);
    w.end_msg();
    for handle in stale {
        seq += 1;
        w.begin_msg(msg_type(NFT_MSG_DELRULE), NLM_F_REQUEST | NLM_F_ACK, seq, nfproto, 0);
        w.put_str(NFTA_RULE_TABLE, table_name);
        w.put_str(NFTA_RULE_CHAIN, chain);
        w.put_u64(NFTA_RULE_HANDLE, *handle);
        w.end_msg();
    }
    if let Some(bit) = insert {
        seq += 1;
        // No NLM_F_APPEND and no position: the kernel puts the rule first.
        w.begin_msg(msg_type(NFT_MSG_NEWRULE), NLM_F_REQUEST | NLM_F_CREATE | NLM_F_ACK, seq, nfproto, 0);
        w.put_str(NFTA_RULE_TABLE, table_name);
        w.put_str(NFTA_RULE_CHAIN, chain);
        let list = w.begin_nest(NFTA_RULE_EXPRESSIONS);
        put_expr(&mut w, "meta", |w| {
            w.put_u32(NFTA_META_DREG, NFT_REG_1);
            w.put_u32(NFTA_META_KEY, NFT_META_MARK);
        });
        put_expr(&mut w, "bitwise", |w| {
            w.put_u32(NFTA_BITWISE_SREG, NFT_REG_1);
            w.put_u32(NFTA_BITWISE_DREG, NFT_REG_1);
            w.put_u32(NFTA_BITWISE_LEN, 4);
            put_value(w, NFTA_BITWISE_MASK, &bit.to_ne_bytes());
            put_value(w, NFTA_BITWISE_XOR, &0u32.to_ne_bytes());
        });
        put_expr(&mut w, "cmp", |w| {
            w.put_u32(NFTA_CMP_SREG, NFT_REG_1);
            w.put_u32(NFTA_CMP_OP, NFT_CMP_EQ);
            put_value(w, NFTA_CMP_DATA, &bit.to_ne_bytes());
        });
        put_expr(&mut w, "counter", |w| {
            w.put_u64(NFTA_COUNTER_BYTES, 0);
            w.put_u64(NFTA_COUNTER_PACKETS, 0);
        });
        put_expr(&mut w, "immediate", |w| {
            w.put_u32(NFTA_IMMEDIATE_DREG, NFT_REG_VERDICT);
            let d = w.begin_nest(NFTA_IMMEDIATE_DATA);
            let v = w.begin_nest(NFTA_DATA_VERDICT);
            w.put_u32(NFTA_VERDICT_CODE, NF_ACCEPT as u32);
            w.end_nest(v);
            w.end_nest(d);
        });
        w.end_nest(list);
        let comment = accept_comment(bit);
        let mut udata = Vec::new();
        let mut text = comment.into_bytes();
        text.push(0);
        if text.len() > 255 {
            return Err(NftError::Encode("accept rule comment too long".into()));
        }
        udata_put(&mut udata, NFTNL_UDATA_RULE_COMMENT, &text);
        w.put(NFTA_RULE_USERDATA, &udata);
        w.end_msg();
    }
    seq += 1;
    w.begin_msg(NFNL_MSG_BATCH_END, NLM_F_REQUEST, seq, NFPROTO_UNSPEC, u16::from(NFNL_SUBSYS_NFTABLES));
    w.end_msg();
    Ok(w.buf)
}

/// One expression of a rule: its name and its data attributes written by `data`.
fn put_expr(w: &mut Writer, name: &str, data: impl FnOnce(&mut Writer)) {
    let e = w.begin_nest(NFTA_LIST_ELEM);
    w.put_str(NFTA_EXPR_NAME, name);
    let d = w.begin_nest(NFTA_EXPR_DATA);
    data(w);
    w.end_nest(d);
    w.end_nest(e);
}

/// A data attribute holding `value` (`NFTA_DATA_VALUE`).
fn put_value(w: &mut Writer, ty: u16, value: &[u8]) {
    let n = w.begin_nest(ty);
    w.put(NFTA_DATA_VALUE, value);
    w.end_nest(n);
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::core::ruleset::hostfw::{Test, is_ours};

    /// A NEWRULE payload (nfgenmsg + attributes) from expressions written like the encoder does.
    fn rule_payload(nfproto: u8, exprs: impl FnOnce(&mut Writer), udata: Option<&[u8]>) -> Vec<u8> {
        let mut w = Writer::new();
        w.buf.extend_from_slice(&[nfproto, 0, 0, 0]);
        w.put_str(NFTA_RULE_TABLE, "filter");
        w.put_str(NFTA_RULE_CHAIN, "FORWARD");
        w.put_u64(NFTA_RULE_HANDLE, 7);
        let l = w.begin_nest(NFTA_RULE_EXPRESSIONS);
        exprs(&mut w);
        w.end_nest(l);
        if let Some(u) = udata {
            w.put(NFTA_RULE_USERDATA, u);
        }
        w.buf
    }

    /// Our own ACCEPT, from the bytes of the batch that inserts it, reads back as the mark test
    /// the analysis judges, with its comment.
    #[test]
    fn our_accept_reads_back() {
        let change = |nfproto, stale, insert| AcceptWrite {
            genid: 5,
            nfproto,
            table: "filter",
            chain: "FORWARD",
            stale,
            insert,
        };
        let batch = accept_batch(100, &change(2, &[3, 4], Some(0x2000))).unwrap();
        let msgs = super::super::nla::messages(&batch).unwrap();
        let types: Vec<u16> = msgs.iter().map(|m| m.ty).collect();
        assert_eq!(
            types,
            [
                NFNL_MSG_BATCH_BEGIN,
                msg_type(NFT_MSG_DELRULE),
                msg_type(NFT_MSG_DELRULE),
                msg_type(NFT_MSG_NEWRULE),
                NFNL_MSG_BATCH_END
            ]
        );
        assert_eq!(msgs.iter().map(|m| m.seq).collect::<Vec<_>>(), [100, 101, 102, 103, 104]);
        let begin = table(&msgs[0].payload[4..]).unwrap();
        assert_eq!(get(&begin, NFNL_BATCH_GENID).map(as_u32).transpose().unwrap(), Some(5));
        let (chain, r) = rule(msgs[3].payload).unwrap();
        assert_eq!(chain, "FORWARD");
        assert_eq!(r.tests, vec![Test::Mark { mask: 0x2000, value: 0x2000, invert: false }]);
        assert_eq!(r.action, Action::Accept);
        assert!(is_ours(r.comment.as_deref()), "{:?}", r.comment);
        assert_eq!(
            r.comment.as_deref(),
            Some("nodelb-forward-accept: forwarded connections of nodelb Services (mark 0x2000)")
        );
        // Only deletions, no insert (the flag is off).
        let batch = accept_batch(1, &change(10, &[9], None)).unwrap();
        let msgs = super::super::nla::messages(&batch).unwrap();
        assert_eq!(msgs.len(), 3);
        assert_eq!(msgs[1].payload[0], 10, "ip6 family");
    }

    use super::{put_expr as expr, put_value as value};
    fn cmp(w: &mut Writer, reg: u32, op: u32, data: &[u8]) {
        expr(w, "cmp", |w| {
            w.put_u32(NFTA_CMP_SREG, reg);
            w.put_u32(NFTA_CMP_OP, op);
            value(w, NFTA_CMP_DATA, data);
        });
    }
    fn verdict(w: &mut Writer, code: i32, chain: Option<&str>) {
        expr(w, "immediate", |w| {
            w.put_u32(NFTA_IMMEDIATE_DREG, 0);
            let d = w.begin_nest(NFTA_IMMEDIATE_DATA);
            let v = w.begin_nest(NFTA_DATA_VERDICT);
            w.put_u32(NFTA_VERDICT_CODE, code as u32);
            if let Some(c) = chain {
                w.put_str(NFTA_VERDICT_CHAIN, c);
            }
            w.end_nest(v);
            w.end_nest(d);
        });
    }
    fn ct_bits(w: &mut Writer, key: u32, bits: u32, op: u32) {
        expr(w, "ct", |w| {
            w.put_u32(NFTA_CT_DREG, 1);
            w.put_u32(NFTA_CT_KEY, key);
        });
        expr(w, "bitwise", |w| {
            w.put_u32(NFTA_BITWISE_SREG, 1);
            w.put_u32(NFTA_BITWISE_DREG, 1);
            w.put_u32(NFTA_BITWISE_LEN, 4);
            value(w, NFTA_BITWISE_MASK, &bits.to_ne_bytes());
            value(w, NFTA_BITWISE_XOR, &0u32.to_ne_bytes());
        });
        cmp(w, 1, op, &0u32.to_ne_bytes());
    }

    /// Rules as nft and iptables-nft lower them, decoded into the tests the analysis judges.
    #[test]
    fn rules_decode() {
        type Case = (&'static str, Box<dyn Fn(&mut Writer)>, Vec<Test>, Action);
        #[rustfmt::skip]
        let cases: Vec<Case> = vec![
            ("ct state established,related accept", Box::new(|w| { ct_bits(w, NFT_CT_STATE, 6, NFT_CMP_NEQ); verdict(w, NF_ACCEPT, None) }),
                vec![Test::CtState { states: 6, snat: false, dnat: false, invert: false }], Action::Accept),
            ("ct status dnat accept", Box::new(|w| { ct_bits(w, NFT_CT_STATUS, 32, NFT_CMP_NEQ); verdict(w, NF_ACCEPT, None) }),
                vec![Test::CtStatus { mask: 32, invert: false }], Action::Accept),
            ("ct state != new drop (cmp eq 0)", Box::new(|w| { ct_bits(w, NFT_CT_STATE, 8, NFT_CMP_EQ); verdict(w, NF_DROP, None) }),
                vec![Test::CtState { states: 8, snat: false, dnat: false, invert: true }], Action::Drop),
            ("meta nfproto ipv4 jump x", Box::new(|w| {
                    expr(w, "meta", |w| { w.put_u32(NFTA_META_DREG, 1); w.put_u32(NFTA_META_KEY, NFT_META_NFPROTO) });
                    cmp(w, 1, NFT_CMP_EQ, &[2]);
                    verdict(w, NFT_JUMP, Some("x"))
                }),
                vec![Test::NfProto { proto: 2, invert: false }], Action::Jump("x".into())),
            ("-i docker0 ! -o docker0 -j ACCEPT (iptables-nft)", Box::new(|w| {
                    expr(w, "meta", |w| { w.put_u32(NFTA_META_DREG, 1); w.put_u32(NFTA_META_KEY, NFT_META_IIFNAME) });
                    cmp(w, 1, NFT_CMP_EQ, b"docker0\0");
                    expr(w, "meta", |w| { w.put_u32(NFTA_META_DREG, 1); w.put_u32(NFTA_META_KEY, NFT_META_OIFNAME) });
                    cmp(w, 1, NFT_CMP_NEQ, b"docker0\0");
                    expr(w, "counter", |_| {});
                    verdict(w, NF_ACCEPT, None)
                }),
                vec![Test::Other("iifname == \"docker0\"".into()), Test::Other("oifname != \"docker0\"".into())], Action::Accept),
            ("-d 10.42.0.0/16 -j ACCEPT", Box::new(|w| {
                    expr(w, "payload", |w| { w.put_u32(NFTA_PAYLOAD_DREG, 1); w.put_u32(NFTA_PAYLOAD_BASE, 1); w.put_u32(NFTA_PAYLOAD_OFFSET, 16); w.put_u32(NFTA_PAYLOAD_LEN, 4) });
                    expr(w, "bitwise", |w| { w.put_u32(NFTA_BITWISE_SREG, 1); w.put_u32(NFTA_BITWISE_DREG, 1); w.put_u32(NFTA_BITWISE_LEN, 4); value(w, NFTA_BITWISE_MASK, &[255, 255, 0, 0]); value(w, NFTA_BITWISE_XOR, &[0; 4]) });
                    cmp(w, 1, NFT_CMP_EQ, &[10, 42, 0, 0]);
                    verdict(w, NF_ACCEPT, None)
                }),
                vec![Test::Other("ip daddr 10.42.0.0/16".into())], Action::Accept),
            ("tcp dport 22 drop", Box::new(|w| {
                    expr(w, "meta", |w| { w.put_u32(NFTA_META_DREG, 1); w.put_u32(NFTA_META_KEY, NFT_META_L4PROTO) });
                    cmp(w, 1, NFT_CMP_EQ, &[6]);
                    expr(w, "payload", |w| { w.put_u32(NFTA_PAYLOAD_DREG, 1); w.put_u32(NFTA_PAYLOAD_BASE, 2); w.put_u32(NFTA_PAYLOAD_OFFSET, 2); w.put_u32(NFTA_PAYLOAD_LEN, 2) });
                    cmp(w, 1, NFT_CMP_EQ, &22u16.to_be_bytes());
                    verdict(w, NF_DROP, None)
                }),
                vec![Test::Other("meta l4proto == 6".into()), Test::Other("th dport == 22".into())], Action::Drop),
            ("-m conntrack --ctstate DNAT -j ACCEPT (compat match)", Box::new(|w| {
                    let mut info = vec![0u8; 164];
                    info[146..148].copy_from_slice(&1u16.to_ne_bytes());
                    info[150..152].copy_from_slice(&(1u16 << 7).to_ne_bytes());
                    expr(w, "match", |w| { w.put_str(NFTA_MATCH_NAME, "conntrack"); w.put_u32(NFTA_MATCH_REV, 3); w.put(NFTA_MATCH_INFO, &info) });
                    expr(w, "counter", |_| {});
                    verdict(w, NF_ACCEPT, None)
                }),
                vec![Test::CtState { states: 0, snat: false, dnat: true, invert: false }], Action::Accept),
            ("-j REJECT (compat target)", Box::new(|w| expr(w, "target", |w| { w.put_str(NFTA_MATCH_NAME, "REJECT"); w.put_u32(NFTA_MATCH_REV, 0); w.put(NFTA_MATCH_INFO, &[0; 8]) })),
                vec![], Action::Reject),
            ("iifname vmap @jumps", Box::new(|w| {
                    expr(w, "meta", |w| { w.put_u32(NFTA_META_DREG, 1); w.put_u32(NFTA_META_KEY, NFT_META_IIFNAME) });
                    expr(w, "lookup", |w| { w.put_u32(NFTA_LOOKUP_SREG, 1); w.put_str(NFTA_LOOKUP_SET, "jumps"); w.put_u32(NFTA_LOOKUP_DREG, 0) });
                }),
                vec![], Action::Unknown("vmap @jumps".into())),
            ("fib saddr . iif oif missing drop", Box::new(|w| {
                    expr(w, "fib", |w| { w.put_u32(1, 1) });
                    cmp(w, 1, NFT_CMP_EQ, &[0; 4]);
                    verdict(w, NF_DROP, None)
                }),
                vec![Test::Other("fib".into()), Test::Other("(expression) == 00000000".into())], Action::Drop),
            ("reject with icmpx admin-prohibited", Box::new(|w| expr(w, "reject", |w| { w.put_u32(1, 2); w.put_u8(2, 3) })),
                vec![], Action::Reject),
            ("counter goto chain", Box::new(|w| { expr(w, "counter", |_| {}); verdict(w, NFT_GOTO, Some("filter_FWD_public")) }),
                vec![], Action::Goto("filter_FWD_public".into())),
        ];
        for (what, exprs, tests, action) in cases {
            let p = rule_payload(2, exprs, None);
            let (_, r) = rule(&p).unwrap_or_else(|e| panic!("{what}: {e}"));
            assert_eq!((r.tests, r.action), (tests, action), "{what}");
        }
        // A comment from user data (nft, iptables-nft ≥ 1.8.? and ours) or from `-m comment`.
        let mut udata = Vec::new();
        udata_put(&mut udata, 0, b"hello\0");
        udata_put(&mut udata, 0xa5, &[1, 2, 3]);
        let (_, r) = rule(&rule_payload(2, |w| verdict(w, NF_ACCEPT, None), Some(&udata))).unwrap();
        assert_eq!(r.comment.as_deref(), Some("hello"));
        let p = rule_payload(
            2,
            |w| {
                expr(w, "match", |w| {
                    w.put_str(NFTA_MATCH_NAME, "comment");
                    w.put_u32(NFTA_MATCH_REV, 0);
                    w.put(NFTA_MATCH_INFO, &xt::comment_info("nodelb-forward-accept: x"))
                })
            },
            None,
        );
        let (_, r) = rule(&p).unwrap();
        assert!(is_ours(r.comment.as_deref()) && r.tests.is_empty(), "{r:?}");
        // Garbage never panics.
        for n in 0..p.len() {
            let _ = rule(&p[..n]);
        }
    }

    #[test]
    fn prefixes() {
        assert_eq!(prefix(&[10, 42, 0, 0], Some(&[255, 255, 0, 0])), "10.42.0.0/16");
        assert_eq!(prefix(&[10, 42, 0, 1], None), "10.42.0.1");
        assert_eq!(prefix(&[10, 0, 0, 0], Some(&[255, 0, 255, 0])), "10.0.0.0 & ff00ff00");
        let v6: Vec<u8> = "2001:db8::".parse::<Ipv6Addr>().unwrap().octets().to_vec();
        assert_eq!(prefix(&v6, Some(&[[255u8; 4].as_slice(), &[0; 12]].concat())), "2001:db8::/32");
    }
}
