//! The netlink edge: owns everything between the `ir` ruleset and the kernel's nf_tables.
//!
//! - [`encode`]: pure `Change` list → one nfnetlink batch (bytes), lowering each `ir::Expr` exactly
//!   as nft 1.0.6 does, so `nft list` shows what `ir::render` writes.
//! - [`NftClient`]: a NETLINK_NETFILTER socket in the current thread's network namespace; sends a
//!   batch in one `sendmsg` and matches every error to the change that caused it; reads our table
//!   back (chains, rules with fingerprints and counters, sets with decoded elements).
//! - [`verify`]: compares the expected ruleset with what the kernel holds, in sentences.
//!
//! Nothing here runs `nft`; only tests do, to prove equivalence.

mod client;
mod consts;
pub mod decode;
pub mod encode;
pub mod foreign;
mod nla;
mod verify;

pub use client::NftClient;
pub use encode::fingerprint;
pub use verify::verify;

pub use crate::core::reports::counters::{Counter, CounterValues};

use std::collections::BTreeMap;

use crate::core::ruleset::ir::{Key, KeyType, Mapped, SetKind};

/// Every error of the module. Kernel input never panics: malformed replies become `Malformed`.
#[derive(Debug, thiserror::Error)]
pub enum NftError {
    /// The IR cannot be encoded (e.g. an element key that does not fit its set).
    #[error("cannot encode {0}")]
    Encode(String),
    /// The kernel rejected the batch; nothing of it was applied. `change` describes the first
    /// failing change (index `index` in the list passed to `apply`).
    #[error("{change}: {reason}{}", if *.more > 0 { format!(" (and {} more error(s))", .more) } else { String::new() })]
    Kernel { index: Option<usize>, change: String, errno: i32, reason: String, more: usize },
    /// A netlink request outside a batch failed.
    #[error("{what}: {reason}")]
    Request { what: String, errno: i32, reason: String },
    /// Socket-level failure (open, send, receive, timeout, lost replies).
    #[error("{context}: {source}")]
    Io { context: String, source: std::io::Error },
    /// The kernel sent something we could not parse.
    #[error("malformed netlink reply: {0}")]
    Malformed(String),
}

impl NftError {
    /// The kernel refused a batch because the ruleset changed after the generation it was
    /// computed on (`NFNL_BATCH_GENID`): decide again on a fresh read.
    pub fn is_restart(&self) -> bool {
        matches!(self, NftError::Kernel { errno, .. } if *errno == nix::errno::Errno::ERESTART as i32)
    }
}

/// What one `apply` sent.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ApplyStats {
    /// Netlink messages in the batch, BATCH_BEGIN/END included.
    pub messages: usize,
    pub bytes: usize,
    /// The ruleset generation right after the batch (`None`: no batch was sent, or the reply
    /// could not be read).
    pub generation: Option<u32>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KernelHook {
    /// `filter`, `nat`, ... as the kernel reports it.
    pub chain_type: String,
    /// NF_INET_* hook number.
    pub hook: u32,
    pub priority: i32,
    /// NF_ACCEPT (1) or NF_DROP (0).
    pub policy: Option<u32>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KernelRule {
    pub handle: u64,
    pub comment: Option<String>,
    /// Our fingerprint from the rule's user data; `None` for a rule we did not write.
    pub fingerprint: Option<u64>,
    /// The first `counter` expression's values, if the rule has one.
    pub counter: Option<Counter>,
    /// Kernel expression names in order (`meta`, `cmp`, ...), for diagnostics.
    pub exprs: Vec<String>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KernelChain {
    pub name: String,
    pub handle: u64,
    pub base: Option<KernelHook>,
    pub comment: Option<String>,
    /// In evaluation order.
    pub rules: Vec<KernelRule>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KernelSet {
    pub name: String,
    pub flags: u32,
    /// Decoded key type (`None` when the kernel's type id is not one nodelb writes).
    pub key: Option<Vec<KeyType>>,
    pub key_type_id: u32,
    pub key_len: u32,
    /// `None` when the set's data type is not one nodelb writes.
    pub kind: Option<SetKind>,
    pub comment: Option<String>,
    pub elements: BTreeMap<Key, Option<Mapped>>,
}

/// A named counter object of our table.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KernelCounter {
    pub name: String,
    pub comment: Option<String>,
    pub counter: Counter,
}

/// Our table as the kernel holds it.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct KernelTable {
    pub chains: BTreeMap<String, KernelChain>,
    /// Named sets and maps (anonymous ones belong to rules and are only counted).
    pub sets: BTreeMap<String, KernelSet>,
    pub anonymous_sets: usize,
    /// Named counter objects.
    pub counters: BTreeMap<String, KernelCounter>,
    /// Named objects of other types (not ours: nodelb only creates counters).
    pub other_objects: Vec<String>,
    /// Tables whose chains and objects were dumped whole: read without the ruleset last
    /// programmed, or holding more than it (`NftClient::read_table_expecting`).
    pub dumped_tables: usize,
    /// Things read back that could not be decoded (element keys of an unknown shape, ...).
    pub problems: Vec<String>,
}

impl KernelTable {
    /// `(chain, rule index, counter)` for every rule with an anonymous counter.
    pub fn rule_counters(&self) -> impl Iterator<Item = (&str, usize, Counter)> {
        self.chains.values().flat_map(|c| {
            c.rules.iter().enumerate().filter_map(move |(i, r)| r.counter.map(|k| (c.name.as_str(), i, k)))
        })
    }
}
