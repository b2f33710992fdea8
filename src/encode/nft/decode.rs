//! Pure decoding of dump replies (NEWCHAIN/NEWRULE/NEWSET/NEWSETELEM payloads) into the
//! `KernelTable` model. Anything unexpected is an error value or a recorded problem, never a panic:
//! every function here takes arbitrary bytes (fuzzed: `tests/fuzzing/netlink.rs`).

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use super::consts::*;
use super::encode::{RawElement, part_len};
use super::nla::{as_str, as_u32, as_u64, attrs, get, table, udata_iter};
use super::{Counter, KernelChain, KernelCounter, KernelHook, KernelRule, KernelSet, KernelTable, NftError};
use crate::core::domain::Protocol;
use crate::core::ruleset::ir::{Key, KeyPart, KeyType, Mapped, SetKind, Verdict};

/// nfgenmsg precedes the attributes of every nf_tables message.
const NFGENMSG_LEN: usize = 4;

fn body(payload: &[u8]) -> Result<&[u8], NftError> {
    payload.get(NFGENMSG_LEN..).ok_or_else(|| NftError::Malformed("message shorter than nfgenmsg".into()))
}

fn need<'a>(t: &[Option<&'a [u8]>], ty: u16, what: &str) -> Result<&'a [u8], NftError> {
    get(t, ty).ok_or_else(|| NftError::Malformed(format!("{what} without attribute {ty}")))
}

/// Table name of a NEWCHAIN/NEWRULE/NEWSET message (all use attribute 1 for it).
pub fn table_of(payload: &[u8]) -> Result<String, NftError> {
    let t = table(body(payload)?)?;
    Ok(get(&t, 1).map(as_str).unwrap_or_default())
}

/// A table reply's use count ([`NFTA_TABLE_USE`]).
pub fn table_use(payload: &[u8]) -> Result<u32, NftError> {
    let t = table(body(payload)?)?;
    as_u32(need(&t, NFTA_TABLE_USE, "table")?)
}

pub fn chain(payload: &[u8]) -> Result<KernelChain, NftError> {
    let t = table(body(payload)?)?;
    let name = as_str(need(&t, NFTA_CHAIN_NAME, "chain")?);
    let handle = get(&t, NFTA_CHAIN_HANDLE).map(as_u64).transpose()?.unwrap_or(0);
    let base = match get(&t, NFTA_CHAIN_HOOK) {
        None => None,
        Some(h) => {
            let ht = table(h)?;
            Some(KernelHook {
                chain_type: get(&t, NFTA_CHAIN_TYPE).map(as_str).unwrap_or_default(),
                hook: as_u32(need(&ht, NFTA_HOOK_HOOKNUM, "hook")?)?,
                priority: as_u32(need(&ht, NFTA_HOOK_PRIORITY, "hook")?)? as i32,
                policy: get(&t, NFTA_CHAIN_POLICY).map(as_u32).transpose()?,
            })
        }
    };
    let comment = get(&t, NFTA_CHAIN_USERDATA).and_then(|u| udata_comment(u, NFTNL_UDATA_CHAIN_COMMENT));
    Ok(KernelChain { name, handle, base, comment, rules: Vec::new() })
}

fn udata_comment(u: &[u8], ty: u8) -> Option<String> {
    udata_iter(u).find(|(t, _)| *t == ty).map(|(_, v)| as_str(v))
}

/// Returns the chain name and the rule.
pub fn rule(payload: &[u8]) -> Result<(String, KernelRule), NftError> {
    let t = table(body(payload)?)?;
    let chain = as_str(need(&t, NFTA_RULE_CHAIN, "rule")?);
    let handle = get(&t, NFTA_RULE_HANDLE).map(as_u64).transpose()?.unwrap_or(0);
    let mut comment = None;
    let mut fingerprint = None;
    if let Some(u) = get(&t, NFTA_RULE_USERDATA) {
        for (ty, v) in udata_iter(u) {
            match ty {
                NFTNL_UDATA_RULE_COMMENT => comment = Some(as_str(v)),
                NODELB_UDATA_RULE_FINGERPRINT => fingerprint = Some(as_u64(v)?),
                _ => {}
            }
        }
    }
    let mut exprs = Vec::new();
    let mut counter = None;
    if let Some(list) = get(&t, NFTA_RULE_EXPRESSIONS) {
        for a in attrs(list) {
            let (_, e) = a?;
            let et = table(e)?;
            let name = as_str(need(&et, NFTA_EXPR_NAME, "expression")?);
            if name == "counter" && counter.is_none() {
                let dt = table(get(&et, NFTA_EXPR_DATA).unwrap_or(&[]))?;
                counter = Some(Counter {
                    packets: get(&dt, NFTA_COUNTER_PACKETS).map(as_u64).transpose()?.unwrap_or(0),
                    bytes: get(&dt, NFTA_COUNTER_BYTES).map(as_u64).transpose()?.unwrap_or(0),
                });
            }
            exprs.push(name);
        }
    }
    Ok((chain, KernelRule { handle, comment, fingerprint, counter, exprs }))
}

/// Splits a (possibly concatenated) key type id into nodelb key types.
pub fn key_types(id: u32) -> Option<Vec<KeyType>> {
    let mut parts = Vec::new();
    let mut v = id;
    while v != 0 {
        parts.push(match v & ((1 << TYPE_BITS) - 1) {
            TYPE_INET_PROTOCOL => KeyType::InetProto,
            TYPE_INET_SERVICE => KeyType::InetService,
            TYPE_IPADDR => KeyType::Ipv4Addr,
            TYPE_IP6ADDR => KeyType::Ipv6Addr,
            _ => return None,
        });
        v >>= TYPE_BITS;
    }
    parts.reverse();
    if parts.is_empty() { None } else { Some(parts) }
}

pub fn set(payload: &[u8]) -> Result<KernelSet, NftError> {
    let t = table(body(payload)?)?;
    let name = as_str(need(&t, NFTA_SET_NAME, "set")?);
    let flags = get(&t, NFTA_SET_FLAGS).map(as_u32).transpose()?.unwrap_or(0);
    let key_type_id = get(&t, NFTA_SET_KEY_TYPE).map(as_u32).transpose()?.unwrap_or(0);
    let key_len = get(&t, NFTA_SET_KEY_LEN).map(as_u32).transpose()?.unwrap_or(0);
    let data_type = get(&t, NFTA_SET_DATA_TYPE).map(as_u32).transpose()?;
    let comment = get(&t, NFTA_SET_USERDATA).and_then(|u| udata_comment(u, NFTNL_UDATA_SET_COMMENT));
    let obj_type = get(&t, NFTA_SET_OBJ_TYPE).map(as_u32).transpose()?;
    let timeout_ms = get(&t, NFTA_SET_TIMEOUT).map(as_u64).transpose()?;
    let dynamic = NFT_SET_EVAL | NFT_SET_TIMEOUT;
    let kind = if flags & dynamic == dynamic && flags & (NFT_SET_MAP | NFT_SET_OBJECT) == 0 {
        // A timeout that is not whole seconds is not one nodelb writes.
        timeout_ms
            .filter(|ms| ms % 1000 == 0)
            .and_then(|ms| u32::try_from(ms / 1000).ok())
            .map(|timeout| SetKind::Dynamic { timeout })
    } else if flags & NFT_SET_OBJECT != 0 {
        (obj_type == Some(NFT_OBJECT_COUNTER)).then_some(SetKind::CounterMap)
    } else if flags & NFT_SET_MAP != 0 {
        (data_type == Some(NFT_DATA_VERDICT)).then_some(SetKind::VerdictMap)
    } else if flags & (NFT_SET_EVAL | NFT_SET_TIMEOUT) != 0 {
        None
    } else {
        Some(SetKind::Set)
    };
    Ok(KernelSet {
        name,
        flags,
        key: key_types(key_type_id),
        key_type_id,
        key_len,
        kind,
        comment,
        elements: Default::default(),
    })
}

/// A NEWOBJ payload: `Ok(Err(name))` for an object that is not a counter.
pub fn object(payload: &[u8]) -> Result<Result<KernelCounter, String>, NftError> {
    let t = table(body(payload)?)?;
    let name = as_str(need(&t, NFTA_OBJ_NAME, "object")?);
    if as_u32(need(&t, NFTA_OBJ_TYPE, "object")?)? != NFT_OBJECT_COUNTER {
        return Ok(Err(name));
    }
    let dt = table(get(&t, NFTA_OBJ_DATA).unwrap_or(&[]))?;
    let counter = Counter {
        packets: get(&dt, NFTA_COUNTER_PACKETS).map(as_u64).transpose()?.unwrap_or(0),
        bytes: get(&dt, NFTA_COUNTER_BYTES).map(as_u64).transpose()?.unwrap_or(0),
    };
    let comment = get(&t, NFTA_OBJ_USERDATA).and_then(|u| udata_comment(u, NFTNL_UDATA_OBJ_COMMENT));
    Ok(Ok(KernelCounter { name, comment, counter }))
}

pub fn key(types: &[KeyType], bytes: &[u8]) -> Option<Key> {
    let concat = types.len() > 1;
    let mut rest = bytes;
    let mut key = Vec::with_capacity(types.len());
    for t in types {
        let n = part_len(*t, concat);
        if rest.len() < n {
            return None;
        }
        let (p, r) = rest.split_at(n);
        rest = r;
        key.push(match t {
            KeyType::InetProto => KeyPart::Proto(Protocol::from_number(p[0])?),
            KeyType::InetService => KeyPart::Port(u16::from_be_bytes([p[0], p[1]])),
            KeyType::Ipv4Addr => KeyPart::Addr(IpAddr::V4(Ipv4Addr::new(p[0], p[1], p[2], p[3]))),
            KeyType::Ipv6Addr => {
                let b: [u8; 16] = p.try_into().ok()?;
                KeyPart::Addr(IpAddr::V6(Ipv6Addr::from(b)))
            }
        });
    }
    if rest.is_empty() { Key::new(&key) } else { None }
}

fn verdict(data: &[u8]) -> Result<Verdict, NftError> {
    let t = table(data)?;
    let v = table(need(&t, NFTA_DATA_VERDICT, "verdict data")?)?;
    let code = as_u32(need(&v, NFTA_VERDICT_CODE, "verdict")?)? as i32;
    let chain = || {
        get(&v, NFTA_VERDICT_CHAIN)
            .map(as_str)
            .ok_or_else(|| NftError::Malformed("jump without chain".into()))
    };
    Ok(match code {
        NF_ACCEPT => Verdict::Accept,
        NF_DROP => Verdict::Drop,
        NFT_RETURN => Verdict::Return,
        NFT_JUMP => Verdict::Jump(chain()?.into()),
        NFT_GOTO => Verdict::Goto(chain()?.into()),
        other => return Err(NftError::Malformed(format!("verdict code {other}"))),
    })
}

/// Each element of a NEWSETELEM payload as its key bytes and its attribute table, mapped by `f`.
fn map_elements<T>(
    payload: &[u8],
    mut f: impl FnMut(Vec<u8>, &[Option<&[u8]>]) -> Result<T, NftError>,
) -> Result<Vec<T>, NftError> {
    let t = table(body(payload)?)?;
    let mut out = Vec::new();
    let Some(list) = get(&t, NFTA_SET_ELEM_LIST_ELEMENTS) else {
        return Ok(out);
    };
    for a in attrs(list) {
        let (_, el) = a?;
        let et = table(el)?;
        let kt = table(need(&et, NFTA_SET_ELEM_KEY, "element")?)?;
        let k = need(&kt, NFTA_DATA_VALUE, "element key")?.to_vec();
        out.push(f(k, &et)?);
    }
    Ok(out)
}

/// Raw elements of a NEWSETELEM payload: (key bytes, verdict or counter name).
pub fn elements(payload: &[u8]) -> Result<Vec<RawElement>, NftError> {
    map_elements(payload, |k, et| {
        let v = match (get(et, NFTA_SET_ELEM_DATA), get(et, NFTA_SET_ELEM_OBJREF)) {
            (Some(d), _) => Some(Mapped::Verdict(verdict(d)?)),
            (None, Some(o)) => Some(Mapped::Counter(as_str(o).into())),
            (None, None) => None,
        };
        Ok((k, v))
    })
}

/// An element's key bytes and the milliseconds until it expires (`None`: no expiration).
pub type ExpiringElement = (Vec<u8>, Option<u64>);

/// The elements of a NEWSETELEM payload, with their expiration.
pub fn expiring_elements(payload: &[u8]) -> Result<Vec<ExpiringElement>, NftError> {
    map_elements(payload, |k, et| Ok((k, get(et, NFTA_SET_ELEM_EXPIRATION).map(as_u64).transpose()?)))
}

pub fn gen_id(payload: &[u8]) -> Result<u32, NftError> {
    let t = table(body(payload)?)?;
    as_u32(need(&t, NFTA_GEN_ID, "generation")?)
}

/// The (negative) errno of an NLMSG_ERROR payload, made positive (0 = ACK).
pub fn error_code(payload: &[u8]) -> Result<i32, NftError> {
    let b: [u8; 4] = payload
        .get(..4)
        .and_then(|s| s.try_into().ok())
        .ok_or_else(|| NftError::Malformed("short NLMSG_ERROR".into()))?;
    // i32::MIN has no positive counterpart; no kernel sends it, but the bytes are not ours.
    i32::from_ne_bytes(b)
        .checked_neg()
        .ok_or_else(|| NftError::Malformed(format!("NLMSG_ERROR code {}", i32::from_ne_bytes(b))))
}

pub use super::nla::{Msg, messages};

/// The dump replies of our table (payloads after the nlmsghdr), as `NftClient::read_table`
/// receives them.
#[derive(Debug, Clone, Default)]
pub struct TableDump {
    pub chains: Vec<Vec<u8>>,
    pub rules: Vec<Vec<u8>>,
    pub sets: Vec<Vec<u8>>,
    pub objects: Vec<Vec<u8>>,
}

/// Builds the [`KernelTable`] of table `name` from its dumps; `elements(set)` returns the element
/// dump of one named set (a request to the kernel, or the fuzzer's bytes). Objects of other
/// tables in a dump are skipped.
pub fn assemble_table(
    name: &str,
    dump: &TableDump,
    mut elements: impl FnMut(&str) -> Result<Vec<Vec<u8>>, NftError>,
) -> Result<KernelTable, NftError> {
    let mut t = KernelTable::default();
    for p in &dump.chains {
        if table_of(p)? == name {
            let c = chain(p)?;
            t.chains.insert(c.name.clone(), c);
        }
    }
    for p in &dump.rules {
        if table_of(p)? != name {
            continue;
        }
        let (chain, rule) = rule(p)?;
        match t.chains.get_mut(&chain) {
            Some(c) => c.rules.push(rule),
            None => t.problems.push(format!("rule {} in unknown chain {chain}", rule.handle)),
        }
    }
    let mut sets = Vec::new();
    for p in &dump.sets {
        if table_of(p)? != name {
            continue;
        }
        let s = set(p)?;
        if s.flags & NFT_SET_ANONYMOUS != 0 {
            t.anonymous_sets += 1;
        } else {
            sets.push(s);
        }
    }
    for p in &dump.objects {
        if table_of(p)? != name {
            continue;
        }
        match object(p)? {
            Ok(c) => {
                t.counters.insert(c.name.clone(), c);
            }
            Err(other) => t.other_objects.push(other),
        }
    }
    for mut s in sets {
        // A dynamic set's elements are what the packet path put there, not configuration (and
        // there may be many): not read for a comparison with the ruleset.
        if matches!(s.kind, Some(SetKind::Dynamic { .. })) {
            t.sets.insert(s.name.clone(), s);
            continue;
        }
        for p in elements(&s.name)? {
            for (k, v) in self::elements(&p)? {
                match s.key.as_deref().and_then(|types| key(types, &k)) {
                    Some(key) => {
                        s.elements.insert(key, v);
                    }
                    None => {
                        t.problems.push(format!("set {}: element key {} cannot be decoded", s.name, hex(&k)))
                    }
                }
            }
        }
        t.sets.insert(s.name.clone(), s);
    }
    Ok(t)
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}
