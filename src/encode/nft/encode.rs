//! Pure encoding: a list of [`Change`]s → the bytes of ONE nfnetlink batch, with a map from each
//! message's sequence number back to the change that produced it (so a kernel error can name the
//! change). Every `ir::Expr` is lowered to kernel expressions exactly as nft 1.0.6 lowers the same
//! statement (checked against `nft --debug=netlink,mnl`), so `nft list` prints our rules the way
//! `ir::render` writes them. No I/O here: unit tests compare bytes.

use std::collections::HashMap;
use std::net::IpAddr;

use ipnet::IpNet;

use super::NftError;
use super::consts::*;
use super::nla::{Writer, udata_put};
use crate::core::domain::{Family, Protocol, fnv1a};
use crate::core::ruleset::ir::{
    self, Change, ChangeRef, Expr, Key, KeyPart, KeyType, Mapped, Rule, SetKind, Table, Verdict,
};

/// Netlink caps one attribute at 64 KiB; element lists are split into messages well below that.
const MAX_ELEMENTS_NEST: usize = 48 * 1024;

/// An element as sent: encoded key bytes and, for maps, the mapped value.
pub type RawElement = (Vec<u8>, Option<Mapped>);

/// Size at which a batch continues in a new buffer ([`Writer::chunked`]).
const BATCH_CHUNK: usize = 1 << 20;

/// A batch ready to send: its messages back to back, in one or more buffers (one `sendmsg`
/// sends them all as one datagram).
pub struct Encoded {
    pub chunks: Vec<Vec<u8>>,
    /// Sequence number of BATCH_BEGIN; message `i` of the batch has `first_seq + 1 + i`.
    pub first_seq: u32,
    /// Index into the change list for each message between BATCH_BEGIN and BATCH_END.
    pub msg_change: Vec<usize>,
}

impl Encoded {
    /// Bytes of the whole batch.
    pub fn len(&self) -> usize {
        self.chunks.iter().map(Vec::len).sum()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The whole batch in one buffer (tests, debugging).
    pub fn bytes(&self) -> Vec<u8> {
        self.chunks.concat()
    }

    /// Which change produced the message with this sequence number (None: the batch itself).
    pub fn change_of(&self, seq: u32) -> Option<usize> {
        let i = seq.checked_sub(self.first_seq + 1)? as usize;
        self.msg_change.get(i).copied()
    }

    pub fn last_seq(&self) -> u32 {
        self.first_seq + 1 + self.msg_change.len() as u32
    }
}

/// 64-bit FNV-1a of the rule's nft text: the fingerprint stored in each rule's user data, so that a
/// rule read back can be matched to the IR rule that produced it (and a hand-made rule has none).
pub fn fingerprint(rule: &Rule) -> u64 {
    fnv1a(ir::render_rule(rule).as_bytes())
}

/// One-line description of a change, used in error messages.
pub fn describe(change: &Change) -> String {
    describe_ref(change.as_ref())
}

/// [`describe`] of a borrowed change.
pub fn describe_ref(change: ChangeRef<'_>) -> String {
    match change {
        ChangeRef::AddTable(t) => format!("add table inet {}", t.name()),
        ChangeRef::DeleteTable(t) => format!("delete table inet {}", t.name()),
        ChangeRef::AddChain(c) => format!("add chain {}", c.name),
        ChangeRef::FlushChain(c) => format!("flush chain {c}"),
        ChangeRef::DeleteChain(c) => format!("delete chain {c}"),
        ChangeRef::AddRule { chain, rule } => {
            format!("add rule to chain {chain} `{}`", ir::render_rule(rule))
        }
        ChangeRef::AddSet(s) => format!("add {} {}", s.kind.word(), s.name),
        ChangeRef::DeleteSet(s) => format!("delete set {s}"),
        ChangeRef::AddElements { set, elements } => {
            format!("add {} element(s) to {set}", elements.len())
        }
        ChangeRef::DeleteElements { set, keys } => {
            format!("delete {} element(s) from {set}", keys.len())
        }
        ChangeRef::AddDynamicElements { set, elements } => {
            format!("put back {} element(s) of dynamic set {set}", elements.len())
        }
        ChangeRef::AddCounter(c) => format!("add counter {}", c.name),
        ChangeRef::DeleteCounter(c) => format!("delete counter {c}"),
    }
}

/// The kernel name of the table an object named `name` lives in ([`Table::of_name`]).
fn table_of(name: &str) -> String {
    Table::of_name(name).name()
}

pub fn msg_type(msg: u8) -> u16 {
    (u16::from(NFNL_SUBSYS_NFTABLES) << 8) | u16::from(msg)
}

/// Encodes `changes` as one batch whose BATCH_BEGIN has sequence number `first_seq`.
pub fn encode_batch(changes: &[Change], first_seq: u32) -> Result<Encoded, NftError> {
    encode_refs(changes.iter().map(Change::as_ref), first_seq)
}

/// [`encode_batch`] of borrowed changes (a full replace walks the ruleset itself:
/// [`ir::Ruleset::full_replace_refs`]). `Encoded::msg_change` indexes this sequence.
pub fn encode_refs<'a>(
    changes: impl IntoIterator<Item = ChangeRef<'a>>,
    first_seq: u32,
) -> Result<Encoded, NftError> {
    encode_ending(changes, first_seq, true)
}

/// `changes` as a batch without its BATCH_END: the kernel processes and validates every message,
/// reports the failures, then aborts, committing nothing (what `nft --check` sends).
pub fn encode_check<'a>(
    changes: impl IntoIterator<Item = ChangeRef<'a>>,
    first_seq: u32,
) -> Result<Encoded, NftError> {
    encode_ending(changes, first_seq, false)
}

fn encode_ending<'a>(
    changes: impl IntoIterator<Item = ChangeRef<'a>>,
    first_seq: u32,
    commit: bool,
) -> Result<Encoded, NftError> {
    let mut e = Enc {
        w: Writer::chunked(BATCH_CHUNK),
        seq: first_seq,
        msg_change: Vec::new(),
        change: 0,
        next_set_id: 1,
        set_ids: HashMap::new(),
        set_keys: HashMap::new(),
    };
    e.w.begin_msg(
        NFNL_MSG_BATCH_BEGIN,
        NLM_F_REQUEST,
        e.seq,
        NFPROTO_UNSPEC,
        u16::from(NFNL_SUBSYS_NFTABLES),
    );
    e.w.end_msg();
    for (i, change) in changes.into_iter().enumerate() {
        e.change = i;
        e.change(change).map_err(|err| match err {
            NftError::Encode(msg) => NftError::Encode(format!("{}: {msg}", describe_ref(change))),
            other => other,
        })?;
    }
    e.seq += 1;
    if commit {
        e.w.begin_msg(
            NFNL_MSG_BATCH_END,
            NLM_F_REQUEST,
            e.seq,
            NFPROTO_UNSPEC,
            u16::from(NFNL_SUBSYS_NFTABLES),
        );
        e.w.end_msg();
    }
    Ok(Encoded { chunks: e.w.into_chunks(), first_seq, msg_change: e.msg_change })
}

struct Enc {
    w: Writer,
    seq: u32,
    msg_change: Vec<usize>,
    change: usize,
    next_set_id: u32,
    /// Sets created in this batch: name → NFTA_SET_ID (lookups and elements reference them by id too,
    /// as nft does, so they resolve inside the transaction).
    set_ids: HashMap<ir::Name, u32>,
    set_keys: HashMap<ir::Name, Vec<KeyType>>,
}

/// What an element carries besides its key.
#[derive(Clone, Copy)]
enum ElemData<'a> {
    /// A map element's value.
    Mapped(&'a Mapped),
    /// A dynamic set's element put back: milliseconds until it expires.
    Expires(u64),
}

/// An anonymous set or map a rule needs, created just before the rule in the same batch.
struct AnonSet {
    id: u32,
    name: &'static str,
    flags: u32,
    key_type: u32,
    key_len: u32,
    udata: Vec<u8>,
    elements: Vec<RawElement>,
}

impl Enc {
    fn begin(&mut self, msg: u8, flags: u16) {
        self.seq += 1;
        self.msg_change.push(self.change);
        self.w.begin_msg(msg_type(msg), NLM_F_REQUEST | flags, self.seq, NFPROTO_INET, 0);
    }

    fn change(&mut self, change: ChangeRef<'_>) -> Result<(), NftError> {
        match change {
            ChangeRef::AddTable(t) => {
                // NLM_F_CREATE without NLM_F_EXCL: adding an existing table is a no-op.
                self.begin(NFT_MSG_NEWTABLE, NLM_F_CREATE);
                self.w.put_str(NFTA_TABLE_NAME, &t.name());
                self.w.put_u32(NFTA_TABLE_FLAGS, 0);
                self.w.end_msg();
            }
            ChangeRef::DeleteTable(t) => {
                self.begin(NFT_MSG_DELTABLE, 0);
                self.w.put_str(NFTA_TABLE_NAME, &t.name());
                self.w.end_msg();
                self.set_ids.retain(|name, _| Table::of_name(name) != t);
            }
            ChangeRef::AddChain(chain) => {
                self.begin(NFT_MSG_NEWCHAIN, NLM_F_CREATE);
                self.w.put_str(NFTA_CHAIN_TABLE, &table_of(&chain.name));
                self.w.put_str(NFTA_CHAIN_NAME, &chain.name);
                if let Some(c) = &chain.comment {
                    self.put_comment(NFTA_CHAIN_USERDATA, NFTNL_UDATA_CHAIN_COMMENT, c)?;
                }
                if let Some(b) = &chain.base {
                    self.w.put_str(NFTA_CHAIN_TYPE, b.chain_type.name());
                    self.w.put_u32(NFTA_CHAIN_POLICY, NF_ACCEPT as u32);
                    let h = self.w.begin_nest(NFTA_CHAIN_HOOK);
                    self.w.put_u32(NFTA_HOOK_HOOKNUM, b.hook.number());
                    self.w.put_u32(NFTA_HOOK_PRIORITY, b.priority as u32);
                    self.w.end_nest(h);
                }
                self.w.end_msg();
            }
            ChangeRef::FlushChain(name) => {
                self.begin(NFT_MSG_DELRULE, 0);
                self.w.put_str(NFTA_RULE_TABLE, &table_of(name));
                self.w.put_str(NFTA_RULE_CHAIN, name);
                self.w.end_msg();
            }
            ChangeRef::DeleteChain(name) => {
                self.begin(NFT_MSG_DELCHAIN, 0);
                self.w.put_str(NFTA_CHAIN_TABLE, &table_of(name));
                self.w.put_str(NFTA_CHAIN_NAME, name);
                self.w.end_msg();
            }
            ChangeRef::AddRule { chain, rule } => self.rule(chain, rule)?,
            ChangeRef::AddSet(set) => self.named_set(set)?,
            ChangeRef::DeleteSet(name) => {
                self.begin(NFT_MSG_DELSET, 0);
                self.w.put_str(NFTA_SET_TABLE, &table_of(name));
                self.w.put_str(NFTA_SET_NAME, name);
                self.w.end_msg();
                self.set_ids.remove(name);
            }
            ChangeRef::AddElements { set, elements } => {
                let types = self.key_types_hint(set, elements.iter().next().map(|(k, _)| k));
                let mut encoded = Vec::with_capacity(elements.len());
                for (k, v) in elements.iter() {
                    encoded.push((key_bytes(types.as_deref(), k)?, v.as_ref()));
                }
                let id = self.set_ids.get(set).copied();
                let list = encoded.iter().map(|(k, v)| (k.as_slice(), v.map(ElemData::Mapped)));
                self.elements(NFT_MSG_NEWSETELEM, NLM_F_CREATE, (&table_of(set), set), id, list);
            }
            ChangeRef::AddDynamicElements { set, elements } => {
                let types = self.key_types_hint(set, elements.first().map(|(k, _)| k));
                let mut encoded = Vec::with_capacity(elements.len());
                for (k, ms) in elements {
                    encoded.push((key_bytes(types.as_deref(), k)?, *ms));
                }
                let id = self.set_ids.get(set).copied();
                let list = encoded.iter().map(|(k, ms)| (k.as_slice(), Some(ElemData::Expires(*ms))));
                self.elements(NFT_MSG_NEWSETELEM, NLM_F_CREATE, (&table_of(set), set), id, list);
            }
            ChangeRef::DeleteElements { set, keys } => {
                let types = self.key_types_hint(set, keys.first());
                let mut encoded = Vec::with_capacity(keys.len());
                for k in keys {
                    encoded.push(key_bytes(types.as_deref(), k)?);
                }
                let id = self.set_ids.get(set).copied();
                let list = encoded.iter().map(|k| (k.as_slice(), None));
                self.elements(NFT_MSG_DELSETELEM, 0, (&table_of(set), set), id, list);
            }
            ChangeRef::AddCounter(counter) => {
                self.begin(NFT_MSG_NEWOBJ, NLM_F_CREATE);
                self.w.put_str(NFTA_OBJ_TABLE, &table_of(&counter.name));
                self.w.put_str(NFTA_OBJ_NAME, &counter.name);
                self.w.put_u32(NFTA_OBJ_TYPE, NFT_OBJECT_COUNTER);
                if let Some(c) = &counter.comment {
                    self.put_comment(NFTA_OBJ_USERDATA, NFTNL_UDATA_OBJ_COMMENT, c)?;
                }
                let d = self.w.begin_nest(NFTA_OBJ_DATA);
                self.w.put_u64(NFTA_COUNTER_BYTES, 0);
                self.w.put_u64(NFTA_COUNTER_PACKETS, 0);
                self.w.end_nest(d);
                self.w.end_msg();
            }
            ChangeRef::DeleteCounter(name) => {
                self.begin(NFT_MSG_DELOBJ, 0);
                self.w.put_str(NFTA_OBJ_TABLE, &table_of(name));
                self.w.put_str(NFTA_OBJ_NAME, name);
                self.w.put_u32(NFTA_OBJ_TYPE, NFT_OBJECT_COUNTER);
                self.w.end_msg();
            }
        }
        Ok(())
    }

    /// A user-data attribute holding only nft's comment TLV (chains and objects).
    fn put_comment(&mut self, attr: u16, tlv: u8, comment: &str) -> Result<(), NftError> {
        let mut u = Vec::new();
        udata_put(&mut u, tlv, &comment_bytes(comment)?);
        self.w.put(attr, &u);
        Ok(())
    }

    /// The key layout of an element list: the set's key type when the set is created in this batch
    /// (so a mismatching element is caught before the kernel sees it), else the first key's shape.
    fn key_types_hint(&self, set: &str, first: Option<&Key>) -> Option<Vec<KeyType>> {
        match self.set_keys.get(set) {
            Some(k) => Some(k.clone()),
            None => first.map(|k| k.parts().map(part_type).collect()),
        }
    }

    fn named_set(&mut self, set: &ir::Set) -> Result<(), NftError> {
        if set.key.is_empty() {
            return Err(NftError::Encode("set key has no parts".into()));
        }
        let id = self.next_set_id;
        self.next_set_id += 1;
        self.set_ids.insert(set.name.clone(), id);
        self.set_keys.insert(set.name.clone(), set.key.clone());
        let concat = set.key.len() > 1;
        let key_len: usize = set.key.iter().map(|t| part_len(*t, concat)).sum();
        self.begin(NFT_MSG_NEWSET, NLM_F_CREATE);
        self.w.put_str(NFTA_SET_TABLE, &table_of(&set.name));
        self.w.put_str(NFTA_SET_NAME, &set.name);
        let flags = match set.kind {
            SetKind::Set => 0,
            SetKind::VerdictMap => NFT_SET_MAP,
            SetKind::CounterMap => NFT_SET_OBJECT,
            SetKind::Dynamic { .. } => NFT_SET_TIMEOUT | NFT_SET_EVAL,
        };
        self.w.put_u32(NFTA_SET_FLAGS, flags);
        self.w.put_u32(NFTA_SET_KEY_TYPE, key_type_id(&set.key));
        self.w.put_u32(NFTA_SET_KEY_LEN, key_len as u32);
        match set.kind {
            SetKind::Set | SetKind::Dynamic { .. } => {}
            SetKind::VerdictMap => {
                self.w.put_u32(NFTA_SET_DATA_TYPE, NFT_DATA_VERDICT);
                self.w.put_u32(NFTA_SET_DATA_LEN, 0);
            }
            SetKind::CounterMap => self.w.put_u32(NFTA_SET_OBJ_TYPE, NFT_OBJECT_COUNTER),
        }
        self.w.put_u32(NFTA_SET_ID, id);
        if let SetKind::Dynamic { timeout } = set.kind {
            self.w.put_u64(NFTA_SET_TIMEOUT, u64::from(timeout) * 1000);
        }
        // Mirror the user data nft 1.0.6 writes for a `type a . b` set so `nft list` reads it back
        // the same way (byte order of key/data, and for concatenations the empty typeof marker).
        let mut u = Vec::new();
        udata_put(&mut u, NFTNL_UDATA_SET_KEYBYTEORDER, &key_byteorder(&set.key).to_ne_bytes());
        if set.kind == SetKind::VerdictMap {
            udata_put(&mut u, NFTNL_UDATA_SET_DATABYTEORDER, &0u32.to_ne_bytes());
        }
        if concat {
            let mut t = Vec::new();
            udata_put(&mut t, 0, &EXPR_CONCAT.to_ne_bytes());
            udata_put(&mut t, 1, &[]);
            udata_put(&mut u, NFTNL_UDATA_SET_KEY_TYPEOF, &t);
        }
        if matches!(set.kind, SetKind::VerdictMap | SetKind::CounterMap) {
            udata_put(&mut u, NFTNL_UDATA_SET_DATA_INTERVAL, &0u32.to_ne_bytes());
        }
        if let Some(c) = &set.comment {
            udata_put(&mut u, NFTNL_UDATA_SET_COMMENT, &comment_bytes(c)?);
        }
        self.w.put(NFTA_SET_USERDATA, &u);
        self.w.end_msg();
        Ok(())
    }

    /// An anonymous set of a rule of `chain`, in the chain's table.
    fn anon_set(&mut self, s: &AnonSet, chain: &str) {
        self.begin(NFT_MSG_NEWSET, NLM_F_CREATE);
        self.w.put_str(NFTA_SET_TABLE, &table_of(chain));
        self.w.put_str(NFTA_SET_NAME, s.name);
        self.w.put_u32(NFTA_SET_FLAGS, s.flags);
        self.w.put_u32(NFTA_SET_KEY_TYPE, s.key_type);
        self.w.put_u32(NFTA_SET_KEY_LEN, s.key_len);
        self.w.put_u32(NFTA_SET_ID, s.id);
        let d = self.w.begin_nest(NFTA_SET_DESC);
        self.w.put_u32(NFTA_SET_DESC_SIZE, s.elements.len() as u32);
        self.w.end_nest(d);
        self.w.put(NFTA_SET_USERDATA, &s.udata);
        self.w.end_msg();
        let list = s.elements.iter().map(|(k, v)| (k.as_slice(), v.as_ref().map(ElemData::Mapped)));
        self.elements(NFT_MSG_NEWSETELEM, NLM_F_CREATE, (&table_of(chain), s.name), Some(s.id), list);
    }

    /// NEWSETELEM/DELSETELEM messages for `elements`, split so no attribute exceeds 64 KiB.
    fn elements<'m>(
        &mut self,
        msg: u8,
        flags: u16,
        (table, set): (&str, &str),
        id: Option<u32>,
        elements: impl Iterator<Item = (&'m [u8], Option<ElemData<'m>>)>,
    ) {
        let mut rest = elements.peekable();
        while rest.peek().is_some() {
            self.begin(msg, flags);
            self.w.put_str(NFTA_SET_ELEM_LIST_TABLE, table);
            self.w.put_str(NFTA_SET_ELEM_LIST_SET, set);
            if let Some(id) = id {
                self.w.put_u32(NFTA_SET_ELEM_LIST_SET_ID, id);
            }
            let list = self.w.begin_nest(NFTA_SET_ELEM_LIST_ELEMENTS);
            for (key, data) in rest.by_ref() {
                let el = self.w.begin_nest(NFTA_LIST_ELEM);
                // nft writes the expiration before the key.
                if let Some(ElemData::Expires(ms)) = data {
                    self.w.put_u64(NFTA_SET_ELEM_EXPIRATION, ms);
                }
                let k = self.w.begin_nest(NFTA_SET_ELEM_KEY);
                self.w.put(NFTA_DATA_VALUE, key);
                self.w.end_nest(k);
                match data {
                    None | Some(ElemData::Expires(_)) => {}
                    Some(ElemData::Mapped(Mapped::Verdict(v))) => {
                        let d = self.w.begin_nest(NFTA_SET_ELEM_DATA);
                        put_verdict(&mut self.w, v);
                        self.w.end_nest(d);
                    }
                    Some(ElemData::Mapped(Mapped::Counter(name))) => {
                        self.w.put_str(NFTA_SET_ELEM_OBJREF, name)
                    }
                }
                self.w.end_nest(el);
                if self.w.buf.len() - list > MAX_ELEMENTS_NEST {
                    break;
                }
            }
            self.w.end_nest(list);
            self.w.end_msg();
        }
    }

    fn rule(&mut self, chain: &str, rule: &Rule) -> Result<(), NftError> {
        let mut l = Lower { w: Writer::new(), nfproto: None, l4proto: None, anon: Vec::new() };
        for expr in &rule.exprs {
            l.expr(expr, &mut *self)?;
        }
        let anon = std::mem::take(&mut l.anon);
        for s in &anon {
            self.anon_set(s, chain);
        }
        self.begin(NFT_MSG_NEWRULE, NLM_F_CREATE | NLM_F_APPEND);
        self.w.put_str(NFTA_RULE_TABLE, &table_of(chain));
        self.w.put_str(NFTA_RULE_CHAIN, chain);
        let n = self.w.begin_nest(NFTA_RULE_EXPRESSIONS);
        self.w.buf.extend_from_slice(&l.w.buf);
        self.w.end_nest(n);
        self.w.put(NFTA_RULE_USERDATA, &rule_udata(rule)?);
        self.w.end_msg();
        Ok(())
    }

    fn alloc_set_id(&mut self) -> u32 {
        let id = self.next_set_id;
        self.next_set_id += 1;
        id
    }
}

/// nft's `enum expr_types` value of EXPR_CONCAT / EXPR_META, written in set
/// "typeof" user data.
const EXPR_CONCAT: u32 = 13;
const EXPR_META: u32 = 9;

/// Rule user data: nft's comment TLV (with its NUL, as nft writes it), then our fingerprint.
pub fn rule_udata(rule: &Rule) -> Result<Vec<u8>, NftError> {
    let mut u = Vec::new();
    if let Some(c) = &rule.comment {
        udata_put(&mut u, NFTNL_UDATA_RULE_COMMENT, &comment_bytes(c)?);
    }
    udata_put(&mut u, NODELB_UDATA_RULE_FINGERPRINT, &fingerprint(rule).to_be_bytes());
    Ok(u)
}

fn comment_bytes(c: &str) -> Result<Vec<u8>, NftError> {
    // nft limits comments to 128 bytes (NFT_USERDATA_MAXLEN is larger; nft's own check is 128).
    if c.len() > 128 || c.contains('\0') {
        return Err(NftError::Encode(format!("comment {c:?} is longer than 128 bytes or has a NUL")));
    }
    let mut v = c.as_bytes().to_vec();
    v.push(0);
    Ok(v)
}

fn part_type(p: KeyPart) -> KeyType {
    match p {
        KeyPart::Proto(_) => KeyType::InetProto,
        KeyPart::Port(_) => KeyType::InetService,
        KeyPart::Addr(IpAddr::V4(_)) => KeyType::Ipv4Addr,
        KeyPart::Addr(IpAddr::V6(_)) => KeyType::Ipv6Addr,
    }
}

pub fn type_id(t: KeyType) -> u32 {
    match t {
        KeyType::InetProto => TYPE_INET_PROTOCOL,
        KeyType::InetService => TYPE_INET_SERVICE,
        KeyType::Ipv4Addr => TYPE_IPADDR,
        KeyType::Ipv6Addr => TYPE_IP6ADDR,
    }
}

/// nft's id of a (possibly concatenated) key type: component ids in 6-bit chunks, first one highest.
pub fn key_type_id(key: &[KeyType]) -> u32 {
    key.iter().fold(0, |acc, t| (acc << TYPE_BITS) | type_id(*t))
}

/// Byte order nft records for a key: host order (1) for a lone inet_proto (an integer), big
/// endian (2) for a lone address, otherwise "invalid" (0), meaning "take it from the data type",
/// as nft writes for these types.
fn key_byteorder(key: &[KeyType]) -> u32 {
    match key {
        [KeyType::InetProto] => 1,
        [KeyType::Ipv4Addr | KeyType::Ipv6Addr] => 2,
        _ => 0,
    }
}

fn raw_len(t: KeyType) -> usize {
    match t {
        KeyType::InetProto => 1,
        KeyType::InetService => 2,
        KeyType::Ipv4Addr => 4,
        KeyType::Ipv6Addr => 16,
    }
}

/// Bytes a key part takes: its own size, rounded up to 4 inside a concatenation (each part starts
/// a new 32-bit register).
pub fn part_len(t: KeyType, concat: bool) -> usize {
    if concat { raw_len(t).div_ceil(4) * 4 } else { raw_len(t) }
}

/// Encodes an element key. `types` is the key layout (checked against the parts).
pub fn key_bytes(types: Option<&[KeyType]>, key: &Key) -> Result<Vec<u8>, NftError> {
    if key.is_empty() {
        return Err(NftError::Encode("empty element key".into()));
    }
    if let Some(types) = types
        && (types.len() != key.len() || types.iter().zip(key.parts()).any(|(t, p)| *t != part_type(p)))
    {
        return Err(NftError::Encode(format!(
            "element key `{}` does not match the set's key type",
            ir::render_key(key)
        )));
    }
    let concat = key.len() > 1;
    let mut out = Vec::new();
    for p in key.parts() {
        let start = out.len();
        match p {
            KeyPart::Proto(pr) => out.push(pr.number()),
            KeyPart::Port(port) => out.extend_from_slice(&port.to_be_bytes()),
            KeyPart::Addr(IpAddr::V4(a)) => out.extend_from_slice(&a.octets()),
            KeyPart::Addr(IpAddr::V6(a)) => out.extend_from_slice(&a.octets()),
        }
        out.resize(start + part_len(part_type(p), concat), 0);
    }
    Ok(out)
}

fn put_verdict(w: &mut Writer, v: &Verdict) {
    let n = w.begin_nest(NFTA_DATA_VERDICT);
    let (code, chain) = match v {
        Verdict::Accept => (NF_ACCEPT, None),
        Verdict::Drop => (NF_DROP, None),
        Verdict::Return => (NFT_RETURN, None),
        Verdict::Jump(c) => (NFT_JUMP, Some(c)),
        Verdict::Goto(c) => (NFT_GOTO, Some(c)),
    };
    w.put_u32(NFTA_VERDICT_CODE, code as u32);
    if let Some(c) = chain {
        w.put_str(NFTA_VERDICT_CHAIN, c);
    }
    w.end_nest(n);
}

/// Offsets of the source and destination address in the network header, and their length.
fn addr_fields(family: Family) -> (u32, u32, u32) {
    match family {
        Family::Ipv4 => (12, 16, 4),
        Family::Ipv6 => (8, 24, 16),
    }
}

/// The register number nft uses for a 32-bit slot: the legacy 128-bit register when the slot starts
/// one (compatibility with old kernels), else the 32-bit register (`netlink_put_register`).
pub fn reg(slot: u32) -> u32 {
    if slot.is_multiple_of(4) { NFT_REG_1 + slot / 4 } else { NFT_REG32_00 + slot }
}

/// Lowers one rule's expressions, tracking what nft tracks to decide implicit dependencies: the
/// network protocol (`ip saddr` in an inet table needs `meta nfproto ipv4` first) and the transport
/// protocol (`reject with tcp reset` needs `meta l4proto tcp`).
struct Lower {
    w: Writer,
    nfproto: Option<Family>,
    l4proto: Option<Protocol>,
    anon: Vec<AnonSet>,
}

impl Lower {
    fn ex(&mut self, name: &str, f: impl FnOnce(&mut Writer)) {
        let e = self.w.begin_nest(NFTA_LIST_ELEM);
        self.w.put_str(NFTA_EXPR_NAME, name);
        let d = self.w.begin_nest(NFTA_EXPR_DATA);
        f(&mut self.w);
        self.w.end_nest(d);
        self.w.end_nest(e);
    }

    fn meta_load(&mut self, key: u32, slot: u32) {
        self.ex("meta", |w| {
            w.put_u32(NFTA_META_KEY, key);
            w.put_u32(NFTA_META_DREG, reg(slot));
        });
    }

    fn cmp(&mut self, op: u32, data: &[u8]) {
        self.ex("cmp", |w| {
            w.put_u32(NFTA_CMP_SREG, reg(0));
            w.put_u32(NFTA_CMP_OP, op);
            let n = w.begin_nest(NFTA_CMP_DATA);
            w.put(NFTA_DATA_VALUE, data);
            w.end_nest(n);
        });
    }

    fn payload(&mut self, base: u32, offset: u32, len: u32, slot: u32) {
        self.ex("payload", |w| {
            w.put_u32(NFTA_PAYLOAD_DREG, reg(slot));
            w.put_u32(NFTA_PAYLOAD_BASE, base);
            w.put_u32(NFTA_PAYLOAD_OFFSET, offset);
            w.put_u32(NFTA_PAYLOAD_LEN, len);
        });
    }

    /// `reg1 = (reg1 & mask) ^ xor`; `explicit_op` adds NFTA_BITWISE_OP as nft does for binops the
    /// user wrote (`meta mark & x`), not for the masks it generates itself (prefixes, flags).
    fn bitwise(&mut self, mask: &[u8], xor: &[u8], explicit_op: bool) {
        self.ex("bitwise", |w| {
            w.put_u32(NFTA_BITWISE_SREG, reg(0));
            w.put_u32(NFTA_BITWISE_DREG, reg(0));
            if explicit_op {
                w.put_u32(NFTA_BITWISE_OP, NFT_BITWISE_BOOL);
            }
            w.put_u32(NFTA_BITWISE_LEN, mask.len() as u32);
            let m = w.begin_nest(NFTA_BITWISE_MASK);
            w.put(NFTA_DATA_VALUE, mask);
            w.end_nest(m);
            let x = w.begin_nest(NFTA_BITWISE_XOR);
            w.put(NFTA_DATA_VALUE, xor);
            w.end_nest(x);
        });
    }

    fn ct_load(&mut self, key: u32, slot: u32, dir: Option<u8>) {
        self.ex("ct", |w| {
            w.put_u32(NFTA_CT_KEY, key);
            w.put_u32(NFTA_CT_DREG, reg(slot));
            if let Some(d) = dir {
                w.put_u8(NFTA_CT_DIRECTION, d);
            }
        });
    }

    fn lookup(&mut self, set: &str, id: Option<u32>, map: bool) {
        self.ex("lookup", |w| {
            w.put_u32(NFTA_LOOKUP_SREG, reg(0));
            if map {
                w.put_u32(NFTA_LOOKUP_DREG, NFT_REG_VERDICT);
            }
            w.put_str(NFTA_LOOKUP_SET, set);
            if let Some(id) = id {
                w.put_u32(NFTA_LOOKUP_SET_ID, id);
            }
        });
    }

    fn immediate(&mut self, slot: u32, data: &[u8]) {
        self.ex("immediate", |w| {
            w.put_u32(NFTA_IMMEDIATE_DREG, reg(slot));
            let n = w.begin_nest(NFTA_IMMEDIATE_DATA);
            w.put(NFTA_DATA_VALUE, data);
            w.end_nest(n);
        });
    }

    fn need_nfproto(&mut self, f: Family) {
        if self.nfproto != Some(f) {
            self.meta_load(NFT_META_NFPROTO, 0);
            self.cmp(NFT_CMP_EQ, &[f.nfproto()]);
            self.nfproto = Some(f);
        }
    }

    fn prefix(&mut self, prefix: &IpNet, negate: bool, daddr: bool) {
        let (family, offset, addr): (Family, u32, Vec<u8>) = match prefix.trunc() {
            IpNet::V4(n) => (Family::Ipv4, if daddr { 16 } else { 12 }, n.addr().octets().to_vec()),
            IpNet::V6(n) => (Family::Ipv6, if daddr { 24 } else { 8 }, n.addr().octets().to_vec()),
        };
        self.need_nfproto(family);
        let bits = usize::from(prefix.prefix_len());
        let op = if negate { NFT_CMP_NEQ } else { NFT_CMP_EQ };
        if bits % 8 == 0 && bits > 0 {
            // Whole bytes: load only the prefix bytes and compare them (as nft does).
            let n = bits / 8;
            self.payload(NFT_PAYLOAD_NETWORK_HEADER, offset, n as u32, 0);
            self.cmp(op, &addr[..n]);
        } else {
            let mut mask = vec![0u8; addr.len()];
            for (i, m) in mask.iter_mut().enumerate() {
                let have = bits.saturating_sub(i * 8).min(8);
                *m = if have == 0 { 0 } else { 0xffu8 << (8 - have) };
            }
            self.payload(NFT_PAYLOAD_NETWORK_HEADER, offset, addr.len() as u32, 0);
            self.bitwise(&mask, &vec![0u8; addr.len()], false);
            self.cmp(op, &addr);
        }
    }

    /// `<flags expr> & bits != 0`, the lowering of `ct state a,b` and `ct status dnat`.
    fn ct_flags(&mut self, key: u32, bits: u32) {
        self.ct_load(key, 0, None);
        self.bitwise(&bits.to_ne_bytes(), &0u32.to_ne_bytes(), false);
        self.cmp(NFT_CMP_NEQ, &0u32.to_ne_bytes());
    }

    fn mark_set(&mut self, mask: u32, xor: u32) {
        self.meta_load(NFT_META_MARK, 0);
        self.bitwise(&mask.to_ne_bytes(), &xor.to_ne_bytes(), true);
        self.ex("meta", |w| {
            w.put_u32(NFTA_META_KEY, NFT_META_MARK);
            w.put_u32(NFTA_META_SREG, reg(0));
        });
    }

    /// `meta l4proto { tcp, udp, sctp } meta l4proto . ct original proto-dst` into registers 0 and 1.
    /// nft 1.0.6 only accepts `ct original proto-dst` in a concatenation once the transport protocol
    /// is known; `ir::render` writes the set match in front and we lower that set lookup too, so
    /// both agree.
    fn ct_orig_proto_port(&mut self, enc: &mut Enc) {
        let id = enc.alloc_set_id();
        let mut udata = Vec::new();
        udata_put(&mut udata, NFTNL_UDATA_SET_KEYBYTEORDER, &1u32.to_ne_bytes());
        let mut t = Vec::new();
        udata_put(&mut t, 0, &EXPR_META.to_ne_bytes());
        let mut m = Vec::new();
        udata_put(&mut m, 0, &NFT_META_L4PROTO.to_ne_bytes());
        udata_put(&mut t, 1, &m);
        udata_put(&mut udata, NFTNL_UDATA_SET_KEY_TYPEOF, &t);
        self.anon.push(AnonSet {
            id,
            name: "__set%d",
            flags: NFT_SET_ANONYMOUS | NFT_SET_CONSTANT,
            key_type: TYPE_INET_PROTOCOL,
            key_len: 1,
            udata,
            elements: [Protocol::Tcp, Protocol::Udp, Protocol::Sctp]
                .iter()
                .map(|p| (vec![p.number()], None))
                .collect(),
        });
        self.meta_load(NFT_META_L4PROTO, 0);
        self.lookup("__set%d", Some(id), false);
        self.meta_load(NFT_META_L4PROTO, 0);
        self.ct_load(NFT_CT_PROTO_DST, 1, Some(IP_CT_DIR_ORIGINAL));
    }

    /// `<family> saddr . <second address> . meta l4proto . th <port> @set`, the second address at
    /// `second` in the network header, the port at `port` in the transport header.
    fn addr_pair_port_lookup(&mut self, family: Family, second: u32, port: u32, set: &str, enc: &Enc) {
        self.need_nfproto(family);
        let (saddr, _, len) = addr_fields(family);
        let slot = len / 4;
        self.payload(NFT_PAYLOAD_NETWORK_HEADER, saddr, len, 0);
        self.payload(NFT_PAYLOAD_NETWORK_HEADER, second, len, slot);
        self.meta_load(NFT_META_L4PROTO, 2 * slot);
        self.payload(NFT_PAYLOAD_TRANSPORT_HEADER, port, 2, 2 * slot + 1);
        let id = enc.set_ids.get(set).copied();
        self.lookup(set, id, false);
    }

    /// `meta l4proto . th dport` looked up in `set` (`map`: its verdict is the rule's).
    fn l4proto_dport_lookup(&mut self, set: &str, map: bool, enc: &Enc) {
        self.meta_load(NFT_META_L4PROTO, 0);
        self.payload(NFT_PAYLOAD_TRANSPORT_HEADER, 2, 2, 1);
        let id = enc.set_ids.get(set).copied();
        self.lookup(set, id, map);
    }

    /// `<family> daddr . meta l4proto . th dport` looked up in `set` (`map`: its verdict).
    fn daddr_l4proto_dport_lookup(&mut self, family: Family, set: &str, map: bool, enc: &Enc) {
        self.need_nfproto(family);
        let (_, daddr, len) = addr_fields(family);
        let slot = len / 4;
        self.payload(NFT_PAYLOAD_NETWORK_HEADER, daddr, len, 0);
        self.meta_load(NFT_META_L4PROTO, slot);
        self.payload(NFT_PAYLOAD_TRANSPORT_HEADER, 2, 2, slot + 1);
        let id = enc.set_ids.get(set).copied();
        self.lookup(set, id, map);
    }

    fn expr(&mut self, e: &Expr, enc: &mut Enc) -> Result<(), NftError> {
        match e {
            Expr::NfProto(f) => {
                self.meta_load(NFT_META_NFPROTO, 0);
                self.cmp(NFT_CMP_EQ, &[f.nfproto()]);
                self.nfproto = Some(*f);
            }
            Expr::L4Proto(p) => {
                self.meta_load(NFT_META_L4PROTO, 0);
                self.cmp(NFT_CMP_EQ, &[p.number()]);
                self.l4proto = Some(*p);
            }
            Expr::FibDaddrLocal => {
                self.ex("fib", |w| {
                    w.put_u32(NFTA_FIB_FLAGS, NFTA_FIB_F_DADDR);
                    w.put_u32(NFTA_FIB_RESULT, NFT_FIB_RESULT_ADDRTYPE);
                    w.put_u32(NFTA_FIB_DREG, reg(0));
                });
                self.cmp(NFT_CMP_EQ, &RTN_LOCAL.to_ne_bytes());
            }
            Expr::SaddrInPrefix { prefix, negate } => self.prefix(prefix, *negate, false),
            Expr::DaddrInPrefix { prefix, negate } => self.prefix(prefix, *negate, true),
            Expr::CtState(states) => {
                if states.is_empty() {
                    return Err(NftError::Encode("ct state with no states".into()));
                }
                let bits = states.iter().fold(0, |acc, s| acc | s.bit());
                self.ct_flags(NFT_CT_STATE, bits);
            }
            Expr::CtStatusDnat => self.ct_flags(NFT_CT_STATUS, IPS_DST_NAT),
            Expr::DportMaskIsNot { mask, value } => {
                self.payload(NFT_PAYLOAD_TRANSPORT_HEADER, 2, 2, 0);
                self.bitwise(&mask.to_be_bytes(), &[0, 0], true);
                self.cmp(NFT_CMP_NEQ, &value.to_be_bytes());
            }
            Expr::MarkHas(bit) => {
                self.meta_load(NFT_META_MARK, 0);
                self.bitwise(&bit.to_ne_bytes(), &0u32.to_ne_bytes(), true);
                self.cmp(NFT_CMP_EQ, &bit.to_ne_bytes());
            }
            Expr::CtMarkHas(bit) => {
                self.ct_load(NFT_CT_MARK, 0, None);
                self.bitwise(&bit.to_ne_bytes(), &0u32.to_ne_bytes(), true);
                self.cmp(NFT_CMP_EQ, &bit.to_ne_bytes());
            }
            Expr::CtMarkSet(bit) => {
                self.ct_load(NFT_CT_MARK, 0, None);
                self.bitwise(&(!bit).to_ne_bytes(), &bit.to_ne_bytes(), true);
                self.ex("ct", |w| {
                    w.put_u32(NFTA_CT_KEY, NFT_CT_MARK);
                    w.put_u32(NFTA_CT_SREG, reg(0));
                });
            }
            Expr::MarkSet(bit) => self.mark_set(!bit, *bit),
            Expr::MarkXor(bit) => self.mark_set(u32::MAX, *bit),
            Expr::MarkClear(bit) => self.mark_set(!bit, 0),
            Expr::Counter => self.ex("counter", |_| {}),
            Expr::CounterRef(name) => self.ex("objref", |w| {
                w.put_u32(NFTA_OBJREF_IMM_TYPE, NFT_OBJECT_COUNTER);
                // nft sends this name without a NUL (the kernel takes either).
                w.put(NFTA_OBJREF_IMM_NAME, name.as_bytes());
            }),
            Expr::L4ProtoDportVmap { map } => self.l4proto_dport_lookup(map, true, enc),
            Expr::L4ProtoDportInSet { set } => self.l4proto_dport_lookup(set, false, enc),
            Expr::DaddrL4ProtoDportVmap { family, map } => {
                self.daddr_l4proto_dport_lookup(*family, map, true, enc)
            }
            Expr::DaddrL4ProtoDportInSet { family, set } => {
                self.daddr_l4proto_dport_lookup(*family, set, false, enc)
            }
            Expr::L4ProtoCtOrigDportVmap { map } => {
                self.ct_orig_proto_port(enc);
                let mid = enc.set_ids.get(map).copied();
                self.lookup(map, mid, true);
            }
            Expr::L4ProtoCtOrigDportCounterMap { map } => {
                self.ct_orig_proto_port(enc);
                let mid = enc.set_ids.get(map).copied();
                self.ex("objref", |w| {
                    w.put_u32(NFTA_OBJREF_SET_SREG, reg(0));
                    w.put(NFTA_OBJREF_SET_NAME, map.as_bytes()); // no NUL, as nft sends it
                    if let Some(id) = mid {
                        w.put_u32(NFTA_OBJREF_SET_ID, id);
                    }
                });
            }
            Expr::L4ProtoCtOrigDportInSet { set } => {
                self.ct_orig_proto_port(enc);
                let id = enc.set_ids.get(set).copied();
                self.lookup(set, id, false);
            }
            Expr::SaddrTwiceL4ProtoSportInSet { family, set } => {
                let (saddr, _, _) = addr_fields(*family);
                // th sport: the first 2 bytes of the transport header.
                self.addr_pair_port_lookup(*family, saddr, 0, set, enc);
            }
            Expr::SaddrDaddrL4ProtoDportInSet { family, set } => {
                let (_, daddr, _) = addr_fields(*family);
                self.addr_pair_port_lookup(*family, daddr, 2, set, enc);
            }
            Expr::SaddrInSet { family, set } => {
                self.need_nfproto(*family);
                let (saddr, _, len) = addr_fields(*family);
                self.payload(NFT_PAYLOAD_NETWORK_HEADER, saddr, len, 0);
                let id = enc.set_ids.get(set).copied();
                self.lookup(set, id, false);
            }
            Expr::UpdateSaddr { family, set } => {
                self.need_nfproto(*family);
                let (saddr, _, len) = addr_fields(*family);
                self.payload(NFT_PAYLOAD_NETWORK_HEADER, saddr, len, 0);
                let id = enc.set_ids.get(set).copied();
                let set = set.clone();
                self.ex("dynset", |w| {
                    w.put_u32(NFTA_DYNSET_SREG_KEY, reg(0));
                    w.put_u32(NFTA_DYNSET_OP, NFT_DYNSET_OP_UPDATE);
                    w.put_str(NFTA_DYNSET_SET_NAME, &set);
                    if let Some(id) = id {
                        w.put_u32(NFTA_DYNSET_SET_ID, id);
                    }
                });
            }
            Expr::NumgenRandomIs { modulus, value } => {
                if *modulus == 0 || value >= modulus {
                    return Err(NftError::Encode(format!("numgen random mod {modulus} {value}")));
                }
                let m = *modulus;
                self.ex("numgen", |w| {
                    w.put_u32(NFTA_NG_DREG, reg(0));
                    w.put_u32(NFTA_NG_MODULUS, m);
                    w.put_u32(NFTA_NG_TYPE, NFT_NG_RANDOM);
                    w.put_u32(NFTA_NG_OFFSET, 0);
                });
                // numgen writes host byte order.
                self.cmp(NFT_CMP_EQ, &value.to_ne_bytes());
            }
            Expr::Dnat { addr, port } => {
                let (family, bytes) = match addr {
                    IpAddr::V4(a) => (Family::Ipv4, a.octets().to_vec()),
                    IpAddr::V6(a) => (Family::Ipv6, a.octets().to_vec()),
                };
                self.immediate(0, &bytes);
                self.immediate(4, &port.to_be_bytes());
                self.ex("nat", |w| {
                    w.put_u32(NFTA_NAT_TYPE, NFT_NAT_DNAT);
                    w.put_u32(NFTA_NAT_FAMILY, u32::from(family.nfproto()));
                    w.put_u32(NFTA_NAT_REG_ADDR_MIN, reg(0));
                    w.put_u32(NFTA_NAT_REG_PROTO_MIN, reg(4));
                    w.put_u32(NFTA_NAT_FLAGS, NF_NAT_RANGE_PROTO_SPECIFIED);
                });
            }
            Expr::Masquerade => self.ex("masq", |_| {}),
            Expr::RejectTcpReset => {
                if self.l4proto != Some(Protocol::Tcp) {
                    self.meta_load(NFT_META_L4PROTO, 0);
                    self.cmp(NFT_CMP_EQ, &[Protocol::Tcp.number()]);
                    self.l4proto = Some(Protocol::Tcp);
                }
                self.ex("reject", |w| {
                    w.put_u32(NFTA_REJECT_TYPE, NFT_REJECT_TCP_RST);
                    w.put_u8(NFTA_REJECT_ICMP_CODE, 0);
                });
            }
            Expr::RejectIcmpPortUnreachable => self.ex("reject", |w| {
                w.put_u32(NFTA_REJECT_TYPE, NFT_REJECT_ICMPX_UNREACH);
                w.put_u8(NFTA_REJECT_ICMP_CODE, NFT_REJECT_ICMPX_PORT_UNREACH);
            }),
            Expr::Verdict(v) => self.ex("immediate", |w| {
                w.put_u32(NFTA_IMMEDIATE_DREG, NFT_REG_VERDICT);
                let n = w.begin_nest(NFTA_IMMEDIATE_DATA);
                put_verdict(w, v);
                w.end_nest(n);
            }),
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests;
