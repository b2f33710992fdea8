//! The x_tables table blob (what `IPT_SO_GET_ENTRIES` returns and `IPT_SO_SET_REPLACE` takes):
//! parsed into entries and chains, turned into [`hostfw`] chains, and edited the way libiptc
//! edits it (insert an entry at the head of FORWARD, delete entries), every offset that points
//! into the blob moved accordingly. Pure; layouts of 64-bit kernels (amd64, arm64), checked
//! against the kernel headers.
//!
//! Layout reminders: an entry is `struct ipt_entry` (112 bytes) / `struct ip6t_entry` (168)
//! followed by its matches (`struct xt_entry_match`: size, name, revision, payload) and, at
//! `target_offset`, its target (`struct xt_entry_target`). A built-in chain runs from
//! `hook_entry[hook]` to `underflow[hook]`, the entry holding its policy. A user chain starts
//! with an `ERROR` target entry naming it and ends with a `RETURN` entry; jumps hold the offset
//! of its first rule (after the head). The blob ends with an `ERROR` entry named `ERROR`.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::net::{Ipv4Addr, Ipv6Addr};

use crate::core::ruleset::hostfw::{
    Action, HostBase, HostChain, HostRule, Source, TableFamily, Test, accept_comment,
};
use crate::encode::xt::{self, u16_at, u32_at};

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error("iptables-legacy table blob: {0}")]
pub struct BlobError(pub String);

fn err<T>(msg: impl Into<String>) -> Result<T, BlobError> {
    Err(BlobError(msg.into()))
}

/// NF_INET_* hooks.
pub const HOOK_FORWARD: usize = 2;
const HOOK_NAMES: [&str; 5] = ["PREROUTING", "INPUT", "FORWARD", "OUTPUT", "POSTROUTING"];
const MATCH_HEADER: usize = 32;
const TARGET_HEADER: usize = 32;
const STANDARD_TARGET_SIZE: usize = 40;
/// `-NF_ACCEPT - 1`, `-NF_DROP - 1`, `XT_RETURN`.
const VERDICT_ACCEPT: i32 = -2;
const VERDICT_DROP: i32 = -1;
const VERDICT_RETURN: i32 = -5;
const INV_PROTO: u8 = 0x40;

/// IPv4 (`ipt_entry`) or IPv6 (`ip6t_entry`) entries.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Layout {
    V4,
    V6,
}

impl Layout {
    /// `sizeof(struct ipt_entry)` / `sizeof(struct ip6t_entry)`.
    pub fn entry_size(self) -> usize {
        match self {
            Layout::V4 => 112,
            Layout::V6 => 168,
        }
    }
    fn target_offset_at(self) -> usize {
        match self {
            Layout::V4 => 88,
            Layout::V6 => 140,
        }
    }
    fn counters_at(self) -> usize {
        match self {
            Layout::V4 => 96,
            Layout::V6 => 152,
        }
    }
    /// The `IPT_F_GOTO` / `IP6T_F_GOTO` bit and where the flags are.
    fn goto(self) -> (usize, u8) {
        match self {
            Layout::V4 => (82, 0x02),
            Layout::V6 => (131, 0x04),
        }
    }
    pub fn family(self) -> TableFamily {
        match self {
            Layout::V4 => TableFamily::Ip,
            Layout::V6 => TableFamily::Ip6,
        }
    }
}

/// What `IPT_SO_GET_INFO` says about a table.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Info {
    pub valid_hooks: u32,
    pub hook_entry: [u32; 5],
    pub underflow: [u32; 5],
    pub num_entries: u32,
    pub size: u32,
}

/// `struct ipt_getinfo` is 84 bytes: name[32], valid_hooks, hook_entry[5], underflow[5],
/// num_entries, size.
pub const GETINFO_SIZE: usize = 84;

impl Info {
    pub fn parse(b: &[u8]) -> Result<Info, BlobError> {
        if b.len() < GETINFO_SIZE {
            return err(format!("getinfo of {} bytes", b.len()));
        }
        let u = |at: usize| u32_at(b, at).unwrap_or(0);
        let mut info = Info { valid_hooks: u(32), num_entries: u(76), size: u(80), ..Info::default() };
        for h in 0..5 {
            info.hook_entry[h] = u(36 + 4 * h);
            info.underflow[h] = u(56 + 4 * h);
        }
        Ok(info)
    }
}

fn i32_at(b: &[u8], at: usize) -> Option<i32> {
    Some(i32::from_ne_bytes(b.get(at..at + 4)?.try_into().ok()?))
}
fn put_u16(b: &mut [u8], at: usize, v: u16) {
    b[at..at + 2].copy_from_slice(&v.to_ne_bytes());
}
fn put_i32(b: &mut [u8], at: usize, v: i32) {
    b[at..at + 4].copy_from_slice(&v.to_ne_bytes());
}

/// One entry of the blob.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Entry {
    offset: usize,
    len: usize,
    target_offset: usize,
    /// The target's name (`""` standard, `"ERROR"` chain head or end, others).
    target: String,
    /// The standard target's verdict, or the error target's name as bytes.
    verdict: Option<i32>,
    error_name: Option<String>,
}

/// A chain's name, its hook (built-in chains), and the indexes of its entries.
type ChainSpan = (String, Option<usize>, std::ops::Range<usize>);

/// A parsed table.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Table {
    pub layout: Layout,
    pub name: String,
    pub info: Info,
    pub blob: Vec<u8>,
    entries: Vec<Entry>,
}

impl Table {
    /// Parses the entries of table `name` (`blob` is `info.size` bytes).
    pub fn parse(layout: Layout, name: &str, info: Info, blob: Vec<u8>) -> Result<Table, BlobError> {
        if blob.len() != info.size as usize {
            return err(format!("{} bytes, the table says {}", blob.len(), info.size));
        }
        let mut entries = Vec::new();
        let mut at = 0;
        while at < blob.len() {
            let e = &blob[at..];
            let (Some(target_offset), Some(next)) =
                (u16_at(e, layout.target_offset_at()), u16_at(e, layout.target_offset_at() + 2))
            else {
                return err(format!("entry at {at} truncated"));
            };
            let (target_offset, len) = (target_offset as usize, next as usize);
            if len < layout.entry_size()
                || len % 8 != 0
                || len > e.len()
                || target_offset < layout.entry_size()
                || target_offset + TARGET_HEADER > len
            {
                return err(format!("entry at {at}: next_offset {len}, target_offset {target_offset}"));
            }
            let t = &e[target_offset..len];
            let target = xt::c_string(&t[2..31]);
            let verdict = (target.is_empty()).then(|| i32_at(t, TARGET_HEADER)).flatten();
            let error_name = (target == "ERROR").then(|| xt::c_string(&t[TARGET_HEADER..]));
            entries.push(Entry { offset: at, len, target_offset, target, verdict, error_name });
            at += len;
        }
        if entries.len() != info.num_entries as usize {
            return err(format!("{} entries, the table says {}", entries.len(), info.num_entries));
        }
        Ok(Table { layout, name: name.to_string(), info, blob, entries })
    }

    fn index_at(&self, offset: u32) -> Option<usize> {
        self.entries.binary_search_by_key(&(offset as usize), |e| e.offset).ok()
    }

    /// The counters (packets, bytes) of every entry, in order.
    pub fn counters(&self) -> Vec<(u64, u64)> {
        let at = self.layout.counters_at();
        self.entries
            .iter()
            .map(|e| {
                let b = &self.blob[e.offset + at..e.offset + at + 16];
                let pk = u64::from_ne_bytes(b[..8].try_into().unwrap_or_default());
                let by = u64::from_ne_bytes(b[8..].try_into().unwrap_or_default());
                (pk, by)
            })
            .collect()
    }

    /// The entries of each chain: built-in ones (`hook_entry..underflow`, the policy entry
    /// last) and user ones (after their head, up to their RETURN entry, which is kept).
    fn chains(&self) -> Result<Vec<ChainSpan>, BlobError> {
        let mut out = Vec::new();
        for (h, hook_name) in HOOK_NAMES.iter().enumerate() {
            if self.info.valid_hooks & (1 << h) == 0 {
                continue;
            }
            let (Some(first), Some(policy)) =
                (self.index_at(self.info.hook_entry[h]), self.index_at(self.info.underflow[h]))
            else {
                return err(format!("hook {h} points between entries"));
            };
            if policy < first {
                return err(format!("hook {h}: underflow before its first entry"));
            }
            out.push((hook_name.to_string(), Some(h), first..policy + 1));
        }
        let heads: Vec<(usize, String)> = self
            .entries
            .iter()
            .enumerate()
            .filter_map(|(i, e)| e.error_name.clone().filter(|n| n != "ERROR").map(|n| (i, n)))
            .collect();
        for (k, (i, name)) in heads.iter().enumerate() {
            // Up to the next head, or the final ERROR entry.
            let end = heads.get(k + 1).map_or(self.entries.len().saturating_sub(1), |(j, _)| *j);
            out.push((name.clone(), None, i + 1..end.max(i + 1)));
        }
        Ok(out)
    }

    /// The chains of this table as [`hostfw`] sees them: the FORWARD chain as a base chain (its
    /// policy entry as the policy), user chains as chains (their final RETURN dropped).
    pub fn host_chains(&self) -> Result<Vec<HostChain>, BlobError> {
        let chains = self.chains()?;
        // A jump holds the offset of the first rule of its chain.
        let mut by_first_rule: BTreeMap<usize, String> = BTreeMap::new();
        for (name, hook, range) in &chains {
            if hook.is_none() && range.start < self.entries.len() {
                by_first_rule.insert(self.entries[range.start].offset, name.clone());
            }
        }
        let mut out = Vec::new();
        for (name, hook, range) in chains {
            if hook.is_some_and(|h| h != HOOK_FORWARD) {
                continue;
            }
            let mut rules = Vec::new();
            let last = range.end.saturating_sub(1);
            let mut base = None;
            for i in range {
                let e = &self.entries[i];
                if i == last {
                    if hook.is_some() {
                        base = Some(HostBase { priority: 0, policy_drop: e.verdict == Some(VERDICT_DROP) });
                        break;
                    }
                    if e.verdict == Some(VERDICT_RETURN) && self.rule_tests(e).is_empty() {
                        break;
                    }
                }
                rules.push(self.rule(e, &by_first_rule));
            }
            if hook.is_some() && base.is_none() {
                return err("FORWARD has no policy entry");
            }
            out.push(HostChain {
                source: Source::IptablesLegacy,
                family: self.layout.family(),
                table: self.name.clone(),
                name,
                base,
                rules,
            });
        }
        Ok(out)
    }

    fn rule(&self, e: &Entry, by_first_rule: &BTreeMap<usize, String>) -> HostRule {
        let mut tests = self.rule_tests(e);
        let mut comment = None;
        for m in self.matches(e) {
            let info = xt::decode_match(&m.0, m.1, m.2);
            tests.extend(info.tests);
            comment = comment.or(info.comment);
        }
        let (flags_at, goto_bit) = self.layout.goto();
        let goto = self.blob[e.offset + flags_at] & goto_bit != 0;
        let action = match (e.target.as_str(), e.verdict) {
            ("", Some(VERDICT_ACCEPT)) => Action::Accept,
            ("", Some(VERDICT_DROP)) => Action::Drop,
            ("", Some(VERDICT_RETURN)) => Action::Return,
            ("", Some(v)) if v >= 0 && v as usize == e.offset + e.len => Action::Continue,
            ("", Some(v)) if v >= 0 => match by_first_rule.get(&(v as usize)) {
                Some(c) if goto => Action::Goto(c.clone()),
                Some(c) => Action::Jump(c.clone()),
                None => Action::Unknown(format!("jump to offset {v}")),
            },
            ("", v) => Action::Unknown(format!("verdict {v:?}")),
            (name, _) => xt::target_action(name),
        };
        HostRule { tests, action, comment, handle: None }
    }

    /// The matches of an entry: (name, revision, payload).
    fn matches<'a>(&'a self, e: &Entry) -> Vec<(String, u32, &'a [u8])> {
        let mut out = Vec::new();
        let mut at = e.offset + self.layout.entry_size();
        let end = e.offset + e.target_offset;
        while at + MATCH_HEADER <= end {
            let size = u16_at(&self.blob, at).unwrap_or(0) as usize;
            if size < MATCH_HEADER || at + size > end {
                out.push(("?".to_string(), 0, &self.blob[at..at]));
                break;
            }
            let m = &self.blob[at..at + size];
            out.push((xt::c_string(&m[2..31]), u32::from(m[31]), &m[MATCH_HEADER..]));
            at += size;
        }
        out
    }

    /// The tests of the `ipt_ip` / `ip6t_ip6` part of an entry.
    fn rule_tests(&self, e: &Entry) -> Vec<Test> {
        let b = &self.blob[e.offset..e.offset + self.layout.entry_size()];
        let mut words = Vec::new();
        let (addr_len, ifaces_at, proto_at, flags_at, inv_at) = match self.layout {
            Layout::V4 => (4, 16, 80, 82, 83),
            Layout::V6 => (16, 64, 128, 131, 132),
        };
        let inv = b[inv_at];
        let not = |bit: u8| if inv & bit != 0 { "! " } else { "" };
        for (k, (flag, bit)) in [("-s", 0x08u8), ("-d", 0x10)].into_iter().enumerate() {
            let addr = &b[k * addr_len..(k + 1) * addr_len];
            let mask = &b[(2 + k) * addr_len..(3 + k) * addr_len];
            if mask.iter().any(|m| *m != 0) {
                words.push(format!("{}{flag} {}", not(bit), addr_words(addr, mask)));
            }
        }
        for (k, (flag, bit)) in [("-i", 0x01u8), ("-o", 0x02)].into_iter().enumerate() {
            let name = &b[ifaces_at + 16 * k..ifaces_at + 16 * (k + 1)];
            let mask = &b[ifaces_at + 32 + 16 * k..ifaces_at + 32 + 16 * (k + 1)];
            if mask.iter().any(|m| *m != 0) {
                let n = xt::c_string(name);
                let wildcard = if mask.iter().filter(|m| **m != 0).count() <= n.len() { "+" } else { "" };
                words.push(format!("{}{flag} {n}{wildcard}", not(bit)));
            }
        }
        let proto = u16_at(b, proto_at).unwrap_or(0);
        if proto != 0 {
            words.push(format!("{}-p {proto}", not(INV_PROTO)));
        }
        if self.layout == Layout::V4 && b[flags_at] & 0x01 != 0 {
            words.push(format!("{}-f", not(0x20)));
        }
        words.into_iter().map(Test::Other).collect()
    }

    /// The first entry of FORWARD (where nodelb inserts) and its policy entry.
    fn forward(&self) -> Result<(usize, usize), BlobError> {
        if self.info.valid_hooks & (1 << HOOK_FORWARD) == 0 {
            return err(format!("table {} has no FORWARD chain", self.name));
        }
        match (
            self.index_at(self.info.hook_entry[HOOK_FORWARD]),
            self.index_at(self.info.underflow[HOOK_FORWARD]),
        ) {
            (Some(first), Some(policy)) if first <= policy => Ok((first, policy)),
            _ => err("FORWARD points between entries"),
        }
    }

    /// Indexes of nodelb's entries in FORWARD (by their comment).
    fn ours_in_forward(&self) -> Result<Vec<usize>, BlobError> {
        let (first, policy) = self.forward()?;
        Ok((first..policy)
            .filter(|&i| {
                self.matches(&self.entries[i]).iter().any(|(name, rev, info)| {
                    crate::core::ruleset::hostfw::is_ours(
                        xt::decode_match(name, *rev, info).comment.as_deref(),
                    )
                })
            })
            .collect())
    }
}

fn addr_words(addr: &[u8], mask: &[u8]) -> String {
    let ones: u32 = mask.iter().map(|b| b.count_ones()).sum();
    let a = match addr.len() {
        4 => Ipv4Addr::from(<[u8; 4]>::try_from(addr).unwrap_or_default()).to_string(),
        _ => Ipv6Addr::from(<[u8; 16]>::try_from(addr).unwrap_or_default()).to_string(),
    };
    let mut s = format!("{a}/{ones}");
    let contiguous =
        mask.iter().flat_map(|b| (0..8).rev().map(move |i| b & (1 << i) != 0)).skip_while(|b| *b).all(|b| !b);
    if !contiguous {
        let _ = write!(s, " (mask {})", mask.iter().map(|b| format!("{b:02x}")).collect::<String>());
    }
    s
}

/// nodelb's ACCEPT as an x_tables entry: `-m mark --mark bit/bit -m comment --comment … -j
/// ACCEPT`, exactly what `iptables-legacy -I FORWARD` with those options writes.
pub fn accept_entry(layout: Layout, bit: u32) -> Vec<u8> {
    let head = layout.entry_size();
    let mark_size = MATCH_HEADER + xt::MARK_INFO_LEN;
    let comment_size = MATCH_HEADER + xt::COMMENT_LEN;
    let target_offset = head + mark_size + comment_size;
    let len = target_offset + STANDARD_TARGET_SIZE;
    let mut e = vec![0u8; len];
    put_u16(&mut e, layout.target_offset_at(), target_offset as u16);
    put_u16(&mut e, layout.target_offset_at() + 2, len as u16);
    let mut at = head;
    for (name, rev, size, payload) in [
        ("mark", 1u8, mark_size, xt::mark_info(bit).to_vec()),
        ("comment", 0, comment_size, xt::comment_info(&accept_comment(bit)).to_vec()),
    ] {
        put_u16(&mut e, at, size as u16);
        e[at + 2..at + 2 + name.len()].copy_from_slice(name.as_bytes());
        e[at + 31] = rev;
        e[at + MATCH_HEADER..at + MATCH_HEADER + payload.len()].copy_from_slice(&payload);
        at += size;
    }
    put_u16(&mut e, target_offset, STANDARD_TARGET_SIZE as u16);
    put_i32(&mut e, target_offset + TARGET_HEADER, VERDICT_ACCEPT);
    e
}

/// A new table for `IPT_SO_SET_REPLACE`, and where each of its entries came from (for
/// `IPT_SO_SET_ADD_COUNTERS`: the old counters go back to the entries that were kept).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Replacement {
    pub info: Info,
    pub blob: Vec<u8>,
    /// For every new entry, the index of the old entry it is (`None`: inserted).
    pub origin: Vec<Option<usize>>,
}

impl Replacement {
    /// Old counters (as `IPT_SO_SET_REPLACE` returns them, one per old entry) → the counters
    /// to add to the new entries.
    pub fn counters(&self, old: &[(u64, u64)]) -> Vec<(u64, u64)> {
        self.origin.iter().map(|o| o.and_then(|i| old.get(i).copied()).unwrap_or((0, 0))).collect()
    }
}

impl Table {
    /// Whether entry `i` is `wanted`, counters and the kernel's `comefrom` aside.
    fn entry_is(&self, i: usize, wanted: &[u8]) -> bool {
        let e = &self.entries[i];
        let volatile = self.layout.target_offset_at() + 4..self.layout.counters_at() + 16;
        let mut a = self.blob[e.offset..e.offset + e.len].to_vec();
        let mut b = wanted.to_vec();
        if a.len() != b.len() {
            return false;
        }
        a[volatile.clone()].fill(0);
        b[volatile].fill(0);
        a == b
    }
}

/// The table with nodelb's ACCEPT for `insert` at the head of FORWARD (or without it, for
/// `None`) and without nodelb's other entries in FORWARD; `None` when nothing changes.
///
/// Entries are kept byte for byte; what moves are the offsets that point into the blob: hook
/// entries, underflows, and the verdicts of standard targets (jumps, fall-throughs). Each keeps
/// pointing at the same entry (an offset of a deleted entry at the one after it); FORWARD's
/// hook entry points at the inserted ACCEPT.
pub fn with_accept(t: &Table, insert: Option<u32>) -> Result<Option<Replacement>, BlobError> {
    let ours = t.ours_in_forward()?;
    let (first, _) = t.forward()?;
    let wanted = insert.map(|bit| accept_entry(t.layout, bit));
    match (&wanted, ours.as_slice()) {
        (Some(w), [one]) if t.entry_is(*one, w) => return Ok(None),
        (None, []) => return Ok(None),
        _ => {}
    }
    // The new entries, in order, with the old index each one is.
    let mut list: Vec<(Option<usize>, &[u8])> = Vec::with_capacity(t.entries.len() + 1);
    for (i, e) in t.entries.iter().enumerate() {
        if i == first
            && let Some(w) = &wanted
        {
            list.push((None, w));
        }
        if !ours.contains(&i) {
            list.push((Some(i), &t.blob[e.offset..e.offset + e.len]));
        }
    }
    let mut new_offsets = Vec::with_capacity(list.len());
    let mut size = 0;
    for (_, bytes) in &list {
        new_offsets.push(size);
        size += bytes.len();
    }
    // Old offset → new offset: a kept entry's new place; a deleted one's successor's.
    let mut by_old: Vec<usize> = vec![size; t.entries.len() + 1];
    for ((old, _), &at) in list.iter().zip(&new_offsets) {
        if let Some(i) = old {
            by_old[*i] = at;
        }
    }
    for i in (0..t.entries.len()).rev() {
        if ours.contains(&i) {
            by_old[i] = by_old[i + 1];
        }
    }
    let map = |old: usize| -> Result<usize, BlobError> {
        if old == t.blob.len() {
            return Ok(size);
        }
        match t.index_at(old as u32) {
            Some(i) => Ok(by_old[i]),
            None => err(format!("offset {old} points between entries")),
        }
    };
    let mut info = t.info;
    for h in 0..5 {
        if info.valid_hooks & (1 << h) != 0 {
            info.hook_entry[h] = map(t.info.hook_entry[h] as usize)? as u32;
            info.underflow[h] = map(t.info.underflow[h] as usize)? as u32;
        }
    }
    if wanted.is_some() {
        let inserted = list.iter().position(|(o, _)| o.is_none()).unwrap_or(0);
        info.hook_entry[HOOK_FORWARD] = new_offsets[inserted] as u32;
    }
    let mut blob = Vec::with_capacity(size);
    for ((old, bytes), &at) in list.iter().zip(&new_offsets) {
        blob.extend_from_slice(bytes);
        let Some(e) = old.map(|i| &t.entries[i]) else { continue };
        if let (true, Some(v)) = (e.target.is_empty(), e.verdict)
            && v >= 0
        {
            put_i32(&mut blob, at + e.target_offset + TARGET_HEADER, map(v as usize)? as i32);
        }
    }
    info.num_entries = list.len() as u32;
    info.size = size as u32;
    // The kernel checks the new table too; this catches a mistake of ours first.
    Table::parse(t.layout, &t.name, info, blob.clone())?.host_chains()?;
    Ok(Some(Replacement { info, blob, origin: list.iter().map(|(o, _)| *o).collect() }))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A standard-target entry with `verdict` and an optional `-i` interface.
    fn standard(layout: Layout, verdict: i32, iface: Option<&str>) -> Vec<u8> {
        let head = layout.entry_size();
        let len = head + STANDARD_TARGET_SIZE;
        let mut e = vec![0u8; len];
        put_u16(&mut e, layout.target_offset_at(), head as u16);
        put_u16(&mut e, layout.target_offset_at() + 2, len as u16);
        put_u16(&mut e, head, STANDARD_TARGET_SIZE as u16);
        put_i32(&mut e, head + TARGET_HEADER, verdict);
        if let Some(i) = iface {
            let at = if layout == Layout::V4 { 16 } else { 64 };
            e[at..at + i.len()].copy_from_slice(i.as_bytes());
            e[at + 32..at + 32 + i.len() + 1].fill(0xff);
        }
        e
    }

    fn error(layout: Layout, name: &str) -> Vec<u8> {
        let head = layout.entry_size();
        let len = head + 64;
        let mut e = vec![0u8; len];
        put_u16(&mut e, layout.target_offset_at(), head as u16);
        put_u16(&mut e, layout.target_offset_at() + 2, len as u16);
        put_u16(&mut e, head, 64);
        e[head + 2..head + 7].copy_from_slice(b"ERROR");
        e[head + TARGET_HEADER..head + TARGET_HEADER + name.len()].copy_from_slice(name.as_bytes());
        e
    }

    /// A filter table like `iptables-legacy -P FORWARD DROP; -N USER; -A FORWARD -j USER;
    /// -A FORWARD -i docker0 -j ACCEPT; -A USER -j RETURN` lays it out: INPUT policy, FORWARD
    /// (jump, accept, policy), OUTPUT policy, USER (head, return, tail), ERROR.
    fn filter(layout: Layout) -> Table {
        let size = layout.entry_size() + STANDARD_TARGET_SIZE;
        let err_size = layout.entry_size() + 64;
        let user_first_rule = (4 * size + size + err_size) as i32; // after OUTPUT's policy and USER's head
        let entries = [
            standard(layout, VERDICT_ACCEPT, None),            // INPUT policy
            standard(layout, user_first_rule, None),           // FORWARD -j USER
            standard(layout, VERDICT_ACCEPT, Some("docker0")), // FORWARD -i docker0 -j ACCEPT
            standard(layout, VERDICT_DROP, None),              // FORWARD policy
            standard(layout, VERDICT_ACCEPT, None),            // OUTPUT policy
            error(layout, "USER"),
            standard(layout, VERDICT_RETURN, None), // USER -j RETURN
            standard(layout, VERDICT_RETURN, None), // USER tail
            error(layout, "ERROR"),
        ];
        let blob: Vec<u8> = entries.concat();
        let info = Info {
            valid_hooks: 0b1110,
            hook_entry: [0, 0, size as u32, 4 * size as u32, 0],
            underflow: [0, 0, 3 * size as u32, 4 * size as u32, 0],
            num_entries: entries.len() as u32,
            size: blob.len() as u32,
        };
        let mut t = Table::parse(layout, "filter", info, blob).unwrap();
        // Counters, to see them carried over.
        let at = layout.counters_at();
        for (i, e) in t.entries.clone().iter().enumerate() {
            t.blob[e.offset + at..e.offset + at + 8].copy_from_slice(&(i as u64 * 10).to_ne_bytes());
        }
        t
    }

    fn summary(t: &Table) -> Vec<String> {
        t.host_chains()
            .unwrap()
            .iter()
            .map(|c| {
                let rules: Vec<String> = c.rules.iter().map(|r| r.to_string()).collect();
                format!("{} {:?}: {}", c.name, c.base.map(|b| b.policy_drop), rules.join(" | "))
            })
            .collect()
    }

    #[test]
    fn chains_read_like_iptables_lists_them() {
        for layout in [Layout::V4, Layout::V6] {
            let t = filter(layout);
            assert_eq!(
                summary(&t),
                ["FORWARD Some(true): jump USER | -i docker0 accept", "USER None: return"],
                "{layout:?}"
            );
        }
    }

    #[test]
    fn accept_inserted_at_the_head_and_removed_again() {
        for layout in [Layout::V4, Layout::V6] {
            let t = filter(layout);
            let old_counters = t.counters();
            let r = with_accept(&t, Some(0x2000)).unwrap().expect("a change");
            let with = Table::parse(layout, "filter", r.info, r.blob.clone()).unwrap();
            let mark = format!("meta mark & 0x2000 == 0x2000 accept comment {:?}", accept_comment(0x2000));
            assert_eq!(
                summary(&with),
                [
                    format!("FORWARD Some(true): {mark} | jump USER | -i docker0 accept"),
                    "USER None: return".into()
                ],
                "{layout:?}: the jump still lands on USER's first rule"
            );
            assert_eq!(
                r.origin,
                [Some(0), None, Some(1), Some(2), Some(3), Some(4), Some(5), Some(6), Some(7), Some(8)]
            );
            let carried = r.counters(&old_counters);
            assert_eq!(carried[1], (0, 0), "the new entry starts at zero");
            assert_eq!(carried[2], old_counters[1], "the others keep theirs");
            assert_eq!(with_accept(&with, Some(0x2000)).unwrap(), None, "already there");
            // Another mark: the old one goes, the new one comes.
            let r2 = with_accept(&with, Some(0x100)).unwrap().expect("a change");
            let with2 = Table::parse(layout, "filter", r2.info, r2.blob).unwrap();
            assert!(summary(&with2)[0].contains("0x100 accept"), "{:?}", summary(&with2));
            assert_eq!(with2.entries.len(), with.entries.len());
            // Removed: byte for byte the table it was (counters aside).
            let back = with_accept(&with, None).unwrap().expect("a change");
            assert_eq!(back.info, t.info);
            assert_eq!(back.blob, t.blob);
            assert_eq!(
                back.origin,
                [Some(0), Some(2), Some(3), Some(4), Some(5), Some(6), Some(7), Some(8), Some(9)]
            );
            assert_eq!(with_accept(&t, None).unwrap(), None, "nothing to remove");
        }
    }

    #[test]
    fn garbage_is_an_error_not_a_panic() {
        let t = filter(Layout::V4);
        for cut in [0, 1, 50, 111, 200, t.blob.len() - 1] {
            let mut info = t.info;
            info.size = cut as u32;
            let _ = Table::parse(Layout::V4, "filter", info, t.blob[..cut].to_vec());
        }
        let mut bad = t.blob.clone();
        put_u16(&mut bad, 90, 3); // next_offset 3
        assert!(Table::parse(Layout::V4, "filter", t.info, bad).is_err());
        let mut info = t.info;
        info.underflow[HOOK_FORWARD] += 4;
        let odd = Table::parse(Layout::V4, "filter", info, t.blob.clone()).unwrap();
        assert!(odd.host_chains().is_err());
        assert!(Info::parse(&[0; 10]).is_err());
    }
}
