//! Socket I/O: one NETLINK_NETFILTER socket, opened in the network namespace of the thread that
//! creates the client. Batches go out in a single `sendmsg`; replies are matched by sequence number.

use std::io::IoSlice;
use std::os::fd::{AsFd, AsRawFd};
use std::time::Duration;

use netlink_sys::{Socket, protocols::NETLINK_NETFILTER};
use nix::sys::socket::{MsgFlags, sendmsg, setsockopt, sockopt};
use nix::sys::time::TimeVal;

use super::consts::*;
use super::encode::{self, Encoded, describe_ref, msg_type};
use super::nla::{Writer, messages};
use super::{ApplyStats, Counter, CounterValues, KernelTable, NftError, decode, foreign};
use crate::core::ruleset::hostfw::{Action, HostBase, HostChain, Source, TableFamily};
use crate::core::ruleset::ir::{Carried, Change, ChangeRef, KeyType, Name, Ruleset, Table};

/// Most foreign chains [`NftClient::read_forward_chains`] reads (base chains first); a jump to a
/// chain beyond it makes the analysis uncertain, never wrong.
pub const MAX_FOREIGN_CHAINS: usize = 512;

/// Receive buffer for one datagram; dumps never send more than this in one.
const RECV_BUF: usize = 1 << 20;
/// Socket receive buffer: large, so error replies of a big failing batch all fit.
const SO_RCVBUF_BYTES: usize = 32 << 20;
/// A kernel that does not answer within this is treated as an error (never hang forever).
const REPLY_TIMEOUT: Duration = Duration::from_secs(30);

pub struct NftClient {
    sock: Socket,
    seq: u32,
    buf: Vec<u8>,
    sndbuf: usize,
}

fn io(context: &str) -> impl FnOnce(std::io::Error) -> NftError + '_ {
    move |source| NftError::Io { context: context.to_string(), source }
}

fn errno_io(context: &str, e: nix::errno::Errno) -> NftError {
    NftError::Io { context: context.to_string(), source: std::io::Error::from_raw_os_error(e as i32) }
}

fn strerror(errno: i32) -> String {
    nix::errno::Errno::from_raw(errno).desc().to_string()
}

/// What the kernel answered to a batch: the failures (sequence number, errno), sorted, and the
/// ruleset generation right after it.
type BatchReplies = (Vec<(u32, i32)>, Option<u32>);

/// An owned reply message.
struct Reply {
    ty: u16,
    seq: u32,
    payload: Vec<u8>,
}

impl NftClient {
    pub fn new() -> Result<NftClient, NftError> {
        let mut sock = Socket::new(NETLINK_NETFILTER).map_err(io("open NETLINK_NETFILTER socket"))?;
        sock.bind_auto().map_err(io("bind netlink socket"))?;
        // The *FORCE variants ignore net.core.rmem_max but need CAP_NET_ADMIN, which programming
        // nftables needs anyway; fall back to the capped option otherwise.
        if setsockopt(&sock.as_fd(), sockopt::RcvBufForce, &SO_RCVBUF_BYTES).is_err() {
            let _ = setsockopt(&sock.as_fd(), sockopt::RcvBuf, &SO_RCVBUF_BYTES);
        }
        let tv = TimeVal::new(REPLY_TIMEOUT.as_secs() as i64, 0);
        setsockopt(&sock.as_fd(), sockopt::ReceiveTimeout, &tv)
            .map_err(|e| errno_io("set SO_RCVTIMEO", e))?;
        // Seed sequence numbers from the clock so replies to an earlier client's requests are
        // never mistaken for ours.
        let seq = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_secs() as u32)
            .unwrap_or(1);
        Ok(NftClient { sock, seq, buf: Vec::with_capacity(RECV_BUF), sndbuf: 0 })
    }

    fn next_seq(&mut self, n: u32) -> u32 {
        let s = self.seq;
        self.seq = self.seq.wrapping_add(n);
        s
    }

    fn ensure_sndbuf(&mut self, len: usize) -> Result<(), NftError> {
        // Netlink refuses a datagram larger than the send buffer, and a batch must be one datagram
        // (the kernel parses one skb as the whole transaction).
        let want = len + (64 << 10);
        if want <= self.sndbuf {
            return Ok(());
        }
        if setsockopt(&self.sock.as_fd(), sockopt::SndBufForce, &want).is_err() {
            setsockopt(&self.sock.as_fd(), sockopt::SndBuf, &want)
                .map_err(|e| errno_io("set SO_SNDBUF", e))?;
        }
        self.sndbuf = want;
        Ok(())
    }

    fn send(&mut self, bytes: &[u8], what: &str) -> Result<(), NftError> {
        self.ensure_sndbuf(bytes.len())?;
        let n = self.sock.send(bytes, 0).map_err(io(what))?;
        if n != bytes.len() {
            return Err(NftError::Io {
                context: what.to_string(),
                source: std::io::Error::other(format!("sent {n} of {} bytes", bytes.len())),
            });
        }
        Ok(())
    }

    /// Sends `chunks` as ONE datagram (one `sendmsg`, one buffer per chunk): a batch must be one
    /// datagram, and need not be one buffer.
    fn send_chunks(&mut self, chunks: &[Vec<u8>], what: &str) -> Result<(), NftError> {
        let len = chunks.iter().map(Vec::len).sum();
        self.ensure_sndbuf(len)?;
        let iov: Vec<IoSlice<'_>> = chunks.iter().map(|c| IoSlice::new(c)).collect();
        let n = sendmsg::<()>(self.sock.as_raw_fd(), &iov, &[], MsgFlags::empty(), None)
            .map_err(|e| errno_io(what, e))?;
        if n != len {
            return Err(NftError::Io {
                context: what.to_string(),
                source: std::io::Error::other(format!("sent {n} of {len} bytes")),
            });
        }
        Ok(())
    }

    /// Receives one datagram and returns its messages.
    fn recv(&mut self, what: &str) -> Result<Vec<Reply>, NftError> {
        self.buf.clear();
        self.buf.reserve(RECV_BUF);
        let n = self.sock.recv(&mut self.buf, libc_msg_trunc()).map_err(|e| {
            let ctx = if e.raw_os_error() == Some(nix::errno::Errno::ENOBUFS as i32) {
                format!("{what}: replies were lost (receive buffer overflow)")
            } else {
                format!("{what}: receive")
            };
            NftError::Io { context: ctx, source: e }
        })?;
        if n > self.buf.len() {
            return Err(NftError::Malformed(format!("{what}: datagram of {n} bytes truncated")));
        }
        Ok(messages(&self.buf)?
            .into_iter()
            .map(|m| Reply { ty: m.ty, seq: m.seq, payload: m.payload.to_vec() })
            .collect())
    }

    /// Sends `changes` as one atomic batch. On error nothing was applied.
    pub fn apply(&mut self, changes: &[Change]) -> Result<ApplyStats, NftError> {
        self.apply_refs(|| changes.iter().map(Change::as_ref))
    }

    /// Replaces table inet nodelb with exactly `ruleset`, in one atomic batch: what
    /// `apply(&ruleset.full_replace())` does, encoded straight from the ruleset (no copy of its
    /// chains, rules and elements), putting back the `carried` elements of its dynamic sets
    /// ([`NftClient::read_dynamic_elements`]). Errors name the failing change the same way.
    pub fn apply_full_replace(
        &mut self,
        ruleset: &Ruleset,
        carried: &Carried,
    ) -> Result<ApplyStats, NftError> {
        self.apply_refs(|| ruleset.full_replace_carrying(carried))
    }

    /// The elements of the dynamic sets `sets` (name and key type) of table inet nodelb, each
    /// with the milliseconds until it expires; a set (or the table) that does not exist has none.
    /// Read just before a full replace, which deletes them with the table, to put them back.
    pub fn read_dynamic_elements(&mut self, sets: &[(&str, &[KeyType])]) -> Result<Carried, NftError> {
        let mut out = Carried::new();
        for (set, types) in sets {
            let name = &Table::of_name(set).name();
            let what = format!("list elements of {set}");
            let replies = match self.request(NFT_MSG_GETSETELEM, true, &what, |w| {
                w.put_str(NFTA_SET_ELEM_LIST_TABLE, name);
                w.put_str(NFTA_SET_ELEM_LIST_SET, set);
            }) {
                Ok(r) => r,
                Err(NftError::Request { errno, .. }) if errno == nix::errno::Errno::ENOENT as i32 => continue,
                Err(e) => return Err(e),
            };
            let mut elements = Vec::new();
            for p in replies {
                for (k, expires) in decode::expiring_elements(&p)? {
                    if let (Some(key), Some(ms)) = (decode::key(types, &k), expires)
                        && ms > 0
                    {
                        elements.push((key, ms));
                    }
                }
            }
            if !elements.is_empty() {
                out.insert((*set).into(), elements);
            }
        }
        Ok(out)
    }

    /// Sends the changes `changes()` yields as one atomic batch; it is called again to describe
    /// the change a kernel error points at.
    /// Has the kernel validate `changes` as one batch, and commit nothing: the error is the one
    /// [`NftClient::apply`] would return.
    pub fn check(&mut self, changes: &[Change]) -> Result<(), NftError> {
        self.send_batch(|| changes.iter().map(Change::as_ref), false).map(|_| ())
    }

    fn apply_refs<'a, I>(&mut self, changes: impl Fn() -> I) -> Result<ApplyStats, NftError>
    where
        I: Iterator<Item = ChangeRef<'a>>,
    {
        self.send_batch(changes, true)
    }

    fn send_batch<'a, I>(&mut self, changes: impl Fn() -> I, commit: bool) -> Result<ApplyStats, NftError>
    where
        I: Iterator<Item = ChangeRef<'a>>,
    {
        if changes().next().is_none() {
            return Ok(ApplyStats::default());
        }
        let first = self.seq;
        let enc = if commit {
            encode::encode_refs(changes(), first)?
        } else {
            encode::encode_check(changes(), first)?
        };
        self.seq = enc.last_seq().wrapping_add(1);
        let mut stats = ApplyStats { messages: enc.msg_change.len() + 2, bytes: enc.len(), generation: None };
        self.send_chunks(&enc.chunks, "send batch")?;
        let (errors, generation) = self.batch_errors(first, enc.last_seq())?;
        if errors.is_empty() {
            stats.generation = generation;
            return Ok(stats);
        }
        let (seq, errno) = errors[0];
        Err(kernel_error(&enc, changes(), seq, errno, errors.len() - 1))
    }

    /// The failures the kernel reports for the batch just sent (messages `first..=last`), sorted,
    /// and the ruleset generation right after it. Batch messages carry no NLM_F_ACK: the kernel
    /// answers only failures (each with the failing message's sequence number). A GETGEN sent
    /// right after is answered only once the batch has been fully processed, so its reply marks
    /// the end of the batch's replies (and tells the generation the batch left).
    fn batch_errors(&mut self, first: u32, last: u32) -> Result<BatchReplies, NftError> {
        let sentinel = self.next_seq(1);
        self.send(&gen_request(sentinel), "send generation request")?;
        let mut errors: Vec<(u32, i32)> = Vec::new();
        let mut generation = None;
        'outer: loop {
            for r in self.recv("batch replies")? {
                if r.seq == sentinel {
                    if r.ty != NLMSG_ERROR {
                        generation = decode::gen_id(&r.payload).ok();
                    }
                    break 'outer;
                }
                if r.ty == NLMSG_ERROR && (first..=last).contains(&r.seq) {
                    let errno = decode::error_code(&r.payload)?;
                    if errno != 0 {
                        errors.push((r.seq, errno));
                    }
                }
            }
        }
        errors.sort();
        Ok((errors, generation))
    }

    /// Every base chain on the forward hook of the `ip`, `ip6` and `inet` tables but ours, with
    /// the chains they jump or go to (at most [`MAX_FOREIGN_CHAINS`]), rules decoded; and the
    /// ruleset generation they were read at (read again while it changes, like `read_table`).
    /// Read-only.
    pub fn read_forward_chains(&mut self) -> Result<(u32, Vec<HostChain>), NftError> {
        let mut last = None;
        for _ in 0..5 {
            let before = self.generation()?;
            let chains = self.read_forward_chains_once()?;
            if self.generation()? == before {
                return Ok((before, chains));
            }
            last = Some((before, chains));
        }
        last.ok_or_else(|| NftError::Malformed("ruleset kept changing".into()))
    }

    fn read_forward_chains_once(&mut self) -> Result<Vec<HostChain>, NftError> {
        // One dump of every family's chains: the kernel filters chain dumps by family only, not
        // by table, so ours comes along (every Service's chains) and is skipped here.
        // The caller reads again only when the ruleset generation moved.
        let mut heads = std::collections::BTreeMap::new();
        for p in self.request_family(NFT_MSG_GETCHAIN, NFPROTO_UNSPEC, true, "list every chain", |_| {})? {
            let h = foreign::chain_head(&p)?;
            let ours = h.nfproto == NFPROTO_INET && Table::of_table_name(&h.table).is_some();
            if h.family().is_some() && !ours {
                heads.insert((h.nfproto, h.table.clone(), h.name.clone()), h);
            }
        }
        // Breadth first: every base chain is read before any chain it jumps to.
        let mut queue: std::collections::VecDeque<(u8, String, String)> =
            heads.iter().filter(|(_, h)| h.forward.is_some()).map(|(k, _)| k.clone()).collect();
        let mut seen: std::collections::BTreeSet<(u8, String, String)> = queue.iter().cloned().collect();
        let mut out = Vec::new();
        while let Some((nfproto, table_name, name)) = queue.pop_front() {
            if out.len() >= MAX_FOREIGN_CHAINS {
                break;
            }
            let what = format!("list rules of chain {name}");
            let replies = self.request_family(NFT_MSG_GETRULE, nfproto, true, &what, |w| {
                w.put_str(NFTA_RULE_TABLE, &table_name);
                w.put_str(NFTA_RULE_CHAIN, &name);
            })?;
            let mut rules = Vec::with_capacity(replies.len());
            for p in replies {
                let (chain, rule) = foreign::rule(&p)?;
                if chain == name {
                    rules.push(rule);
                }
            }
            for r in &rules {
                if let Action::Jump(t) | Action::Goto(t) = &r.action {
                    let key = (nfproto, table_name.clone(), t.clone());
                    if heads.contains_key(&key) && seen.insert(key.clone()) {
                        queue.push_back(key);
                    }
                }
            }
            let head = &heads[&(nfproto, table_name.clone(), name.clone())];
            out.push(HostChain {
                source: Source::Nftables,
                family: head.family().unwrap_or(TableFamily::Inet),
                table: table_name,
                name,
                base: head.forward.map(|(priority, policy_drop)| HostBase { priority, policy_drop }),
                rules,
            });
        }
        Ok(out)
    }

    /// Applies one change to nodelb's rules in iptables' FORWARD chain (see
    /// [`foreign::AcceptWrite`]) in one batch, refused by the kernel (ERESTART, see
    /// [`NftError::is_restart`]) when the ruleset changed since the generation the change was
    /// decided on. Touches nothing else.
    pub fn write_forward_accept(&mut self, change: &foreign::AcceptWrite<'_>) -> Result<(), NftError> {
        let n = change.messages();
        if n == 0 {
            return Ok(());
        }
        let first = self.next_seq(n + 2);
        let batch = foreign::accept_batch(first, change)?;
        self.send(&batch, "send batch")?;
        let (errors, _) = self.batch_errors(first, first + n + 1)?;
        let Some(&(seq, errno)) = errors.first() else { return Ok(()) };
        let (table, chain) = (change.table, change.chain);
        let what = match seq.checked_sub(first).map(|i| i as usize) {
            Some(0) => "commit batch".to_string(),
            Some(i) if i <= change.stale.len() => {
                format!("delete rule {} of {table} {chain}", change.stale[i - 1])
            }
            _ => format!("insert nodelb's ACCEPT into {table} {chain}"),
        };
        Err(NftError::Kernel {
            index: None,
            change: what,
            errno,
            reason: strerror(errno),
            more: errors.len() - 1,
        })
    }

    /// Sends a request and collects the replies with its sequence number until the dump ends (or the
    /// single reply of a non-dump request arrives). An error reply becomes `NftError::Request`.
    fn request(
        &mut self,
        msg: u8,
        dump: bool,
        what: &str,
        attrs: impl FnOnce(&mut Writer),
    ) -> Result<Vec<Vec<u8>>, NftError> {
        self.request_family(msg, NFPROTO_INET, dump, what, attrs)
    }

    /// [`NftClient::request`] for tables of family `nfproto` (`NFPROTO_UNSPEC`: every family).
    fn request_family(
        &mut self,
        msg: u8,
        nfproto: u8,
        dump: bool,
        what: &str,
        attrs: impl FnOnce(&mut Writer),
    ) -> Result<Vec<Vec<u8>>, NftError> {
        let seq = self.next_seq(1);
        let mut w = Writer::new();
        let flags = NLM_F_REQUEST | if dump { NLM_F_DUMP } else { NLM_F_ACK };
        w.begin_msg(msg_type(msg), flags, seq, nfproto, 0);
        attrs(&mut w);
        w.end_msg();
        self.send(&w.buf, what)?;
        let mut out = Vec::new();
        loop {
            for r in self.recv(what)? {
                if r.seq != seq {
                    continue;
                }
                match r.ty {
                    NLMSG_DONE => return Ok(out),
                    NLMSG_ERROR => {
                        let errno = decode::error_code(&r.payload)?;
                        if errno == 0 {
                            return Ok(out); // the ACK of a non-dump request
                        }
                        return Err(NftError::Request {
                            what: what.to_string(),
                            errno,
                            reason: strerror(errno),
                        });
                    }
                    _ => out.push(r.payload),
                }
            }
        }
    }

    /// The ruleset generation id of this namespace.
    pub fn generation(&mut self) -> Result<u32, NftError> {
        let seq = self.next_seq(1);
        self.send(&gen_request(seq), "get generation")?;
        loop {
            for r in self.recv("get generation")? {
                if r.seq != seq {
                    continue;
                }
                if r.ty == NLMSG_ERROR {
                    let errno = decode::error_code(&r.payload)?;
                    return Err(NftError::Request {
                        what: "get generation".into(),
                        errno,
                        reason: strerror(errno),
                    });
                }
                return decode::gen_id(&r.payload);
            }
        }
    }

    /// Reads table inet nodelb back; `None` if it does not exist. Retries when the ruleset changes
    /// while reading (generation differs before and after), so the result is one consistent view.
    pub fn read_table(&mut self) -> Result<Option<KernelTable>, NftError> {
        self.read_table_expecting(None)
    }

    /// [`NftClient::read_table`], reading the chains and counters of `expected` (the ruleset
    /// last programmed) by name. A dump of a table's chains or objects is quadratic in the
    /// kernel (each step of a netlink dump walks them from the first), a lookup by name is not.
    /// What the kernel holds beyond them shows in each
    /// table's use count (its chains, sets and objects): a table whose count is more than what
    /// was read has its chains and objects dumped after all, so the result is the same.
    /// (Counted on 6.18: chains, named sets, objects, flowtables; a kernel that counts
    /// otherwise gets the dumps, never a wrong table.)
    pub fn read_table_expecting(
        &mut self,
        expected: Option<&Ruleset>,
    ) -> Result<Option<KernelTable>, NftError> {
        let mut last = None;
        for _ in 0..5 {
            let before = self.generation()?;
            let t = self.read_table_once(expected)?;
            if self.generation()? == before {
                return Ok(t);
            }
            last = Some(t);
        }
        // Still changing after several attempts: return the last read, it is at worst stale.
        Ok(last.flatten())
    }

    /// The inet tables nodelb owns that exist: `nodelb` and its nat shards ([`Table`]).
    pub fn our_tables(&mut self) -> Result<Vec<Table>, NftError> {
        Ok(self.our_tables_in_use()?.into_iter().map(|(t, _)| t).collect())
    }

    /// [`NftClient::our_tables`], each with its use count: how many chains, named sets and
    /// objects it holds.
    fn our_tables_in_use(&mut self) -> Result<Vec<(Table, u32)>, NftError> {
        let mut out = Vec::new();
        for p in self.request(NFT_MSG_GETTABLE, true, "list tables", |_| {})? {
            if let Some(t) = Table::of_table_name(&decode::table_of(&p)?) {
                out.push((t, decode::table_use(&p)?));
            }
        }
        out.sort();
        Ok(out)
    }

    /// Every table nodelb owns, read into one view (an object's table is in its name); `None`
    /// when table `nodelb` does not exist. An object in a table its name does not belong to
    /// (made by hand) is reported as a problem, not read.
    fn read_table_once(&mut self, expected: Option<&Ruleset>) -> Result<Option<KernelTable>, NftError> {
        let tables = self.our_tables_in_use()?;
        if !tables.iter().any(|(t, _)| *t == Table::Main) {
            return Ok(None);
        }
        let mut out = KernelTable::default();
        for (t, in_use) in tables {
            let one = self.read_one_table(t, in_use, expected)?;
            let misplaced = |kind: &str, name: &str| {
                (Table::of_name(name) != t)
                    .then(|| format!("{kind} {name} in table {} is not ours", t.name()))
            };
            for (name, c) in one.chains {
                match misplaced("chain", &name) {
                    Some(p) => out.problems.push(p),
                    None => drop(out.chains.insert(name, c)),
                }
            }
            for (name, set) in one.sets {
                match misplaced("set", &name) {
                    Some(p) => out.problems.push(p),
                    None => drop(out.sets.insert(name, set)),
                }
            }
            for (name, c) in one.counters {
                match misplaced("counter", &name) {
                    Some(p) => out.problems.push(p),
                    None => drop(out.counters.insert(name, c)),
                }
            }
            out.anonymous_sets += one.anonymous_sets;
            out.dumped_tables += one.dumped_tables;
            out.other_objects.extend(one.other_objects);
            out.problems.extend(one.problems);
        }
        Ok(Some(out))
    }

    /// Table `table` ([`NftClient::read_table_expecting`]); `in_use` is its use count.
    fn read_one_table(
        &mut self,
        table: Table,
        in_use: u32,
        expected: Option<&Ruleset>,
    ) -> Result<KernelTable, NftError> {
        let name = &table.name();
        let rules =
            self.request(NFT_MSG_GETRULE, true, "list rules", |w| w.put_str(NFTA_RULE_TABLE, name))?;
        let sets = self.request(NFT_MSG_GETSET, true, "list sets", |w| w.put_str(NFTA_SET_TABLE, name))?;
        let mut by_name = None;
        if let Some(expected) = expected {
            let of_table = |n: &&str| Table::of_name(n) == table;
            let chains: Vec<&str> = expected.chains.keys().map(Name::as_str).filter(of_table).collect();
            let counters: Vec<&str> = expected.counters.keys().map(Name::as_str).filter(of_table).collect();
            let chains: Vec<Vec<u8>> = self.get_chains(&chains)?.into_iter().flatten().collect();
            let objects: Vec<Vec<u8>> = self.get_objects(&counters)?.into_iter().flatten().collect();
            if chains.len() + named_sets(&sets)? + objects.len() == in_use as usize {
                by_name = Some((chains, objects));
            }
        }
        let dumped = by_name.is_none();
        let (chains, objects) = match by_name {
            Some(read) => read,
            None => (
                self.request(NFT_MSG_GETCHAIN, true, "list chains", |w| w.put_str(NFTA_CHAIN_TABLE, name))?,
                self.request(NFT_MSG_GETOBJ, true, "list objects", |w| w.put_str(NFTA_OBJ_TABLE, name))?,
            ),
        };
        let dump = decode::TableDump { chains, rules, sets, objects };
        let mut t = decode::assemble_table(name, &dump, |set_name| {
            let what = format!("list elements of {set_name}");
            self.request(NFT_MSG_GETSETELEM, true, &what, |w| {
                w.put_str(NFTA_SET_ELEM_LIST_TABLE, name);
                w.put_str(NFTA_SET_ELEM_LIST_SET, set_name);
            })
        })?;
        t.dumped_tables = usize::from(dumped);
        Ok(t)
    }

    /// The named counters `names` of the tables nodelb owns; one that does not exist is left
    /// out. Each is asked for by name (a hash lookup in the kernel): linear in the names, where a
    /// dump of every counter object is quadratic in the kernel (each step of a netlink dump walks
    /// the objects from the first).
    pub fn read_counters<'a>(
        &mut self,
        names: impl IntoIterator<Item = &'a Name>,
    ) -> Result<CounterValues, NftError> {
        let names: Vec<&str> = names.into_iter().map(Name::as_str).collect();
        let mut out = CounterValues::new();
        for p in self.get_objects(&names)?.into_iter().flatten() {
            if let Ok(c) = decode::object(&p)? {
                out.insert(c.name, c.counter);
            }
        }
        Ok(out)
    }

    /// The counter objects `names` (each in the table its name belongs to), by name; `None` for
    /// one that does not exist.
    fn get_objects(&mut self, names: &[&str]) -> Result<Vec<Option<Vec<u8>>>, NftError> {
        self.get_each(NFT_MSG_GETOBJ, "get counter", names, |w, name| {
            w.put_str(NFTA_OBJ_TABLE, &Table::of_name(name).name());
            w.put_str(NFTA_OBJ_NAME, name);
            w.put_u32(NFTA_OBJ_TYPE, NFT_OBJECT_COUNTER);
        })
    }

    /// The chains `names` (each in the table its name belongs to), by name; `None` for one that
    /// does not exist.
    fn get_chains(&mut self, names: &[&str]) -> Result<Vec<Option<Vec<u8>>>, NftError> {
        self.get_each(NFT_MSG_GETCHAIN, "get chain", names, |w, name| {
            w.put_str(NFTA_CHAIN_TABLE, &Table::of_name(name).name());
            w.put_str(NFTA_CHAIN_NAME, name);
        })
    }

    /// One get request (message `msg`, attributes by `attrs`) per name, many to a datagram: the
    /// reply of each, in order; `None` where the kernel answered `ENOENT`. Each is a lookup by
    /// name in the kernel, so reading n things this way is linear where a dump is not.
    fn get_each(
        &mut self,
        msg: u8,
        what: &str,
        names: &[&str],
        attrs: impl Fn(&mut Writer, &str),
    ) -> Result<Vec<Option<Vec<u8>>>, NftError> {
        let mut out = Vec::with_capacity(names.len());
        for chunk in names.chunks(self.replies_that_fit()) {
            let first = self.next_seq(chunk.len() as u32);
            let mut w = Writer::new();
            for (i, name) in chunk.iter().enumerate() {
                w.begin_msg(msg_type(msg), NLM_F_REQUEST, first.wrapping_add(i as u32), NFPROTO_INET, 0);
                attrs(&mut w, name);
                w.end_msg();
            }
            self.send(&w.buf, what)?;
            let mut replies: Vec<Option<Vec<u8>>> = vec![None; chunk.len()];
            let mut answered = vec![false; chunk.len()];
            let mut left = chunk.len();
            while left > 0 {
                for r in self.recv(what)? {
                    let i = r.seq.wrapping_sub(first) as usize;
                    if i >= chunk.len() || answered[i] {
                        continue;
                    }
                    answered[i] = true;
                    left -= 1;
                    if r.ty != NLMSG_ERROR {
                        replies[i] = Some(r.payload);
                        continue;
                    }
                    let errno = decode::error_code(&r.payload)?;
                    if errno != 0 && errno != nix::errno::Errno::ENOENT as i32 {
                        return Err(NftError::Request {
                            what: format!("{what} {}", chunk[i]),
                            errno,
                            reason: strerror(errno),
                        });
                    }
                }
            }
            out.extend(replies);
        }
        Ok(out)
    }

    /// How many one-message replies the socket's receive buffer holds at once: the kernel drops a
    /// reply that does not fit (`ENOBUFS`), so no more requests go out in one datagram. A small
    /// reply's buffer costs one page and its overhead.
    fn replies_that_fit(&self) -> usize {
        let rcvbuf = nix::sys::socket::getsockopt(&self.sock.as_fd(), sockopt::RcvBuf).unwrap_or(0);
        (rcvbuf / (2 * 4096)).clamp(1, 1024)
    }

    /// One named counter of table inet nodelb; `None` when it (or the table) does not exist.
    pub fn read_counter(&mut self, counter: &str) -> Result<Option<Counter>, NftError> {
        for p in self.get_objects(&[counter])?.into_iter().flatten() {
            if let Ok(c) = decode::object(&p)? {
                return Ok(Some(c.counter));
            }
        }
        Ok(None)
    }

    /// Deletes table inet nodelb and its nat shards (and nothing else), in one batch. Returns
    /// whether table nodelb existed.
    pub fn delete_table(&mut self) -> Result<bool, NftError> {
        let existed = self.our_tables()?.contains(&Table::Main);
        // Each table created if missing, then deleted: the batch fails on no missing table.
        let changes: Vec<Change> =
            Table::all().flat_map(|t| [Change::AddTable(t), Change::DeleteTable(t)]).collect();
        self.apply(&changes)?;
        Ok(existed)
    }
}

/// How many of the sets in a set dump are named: a table's use count leaves out anonymous ones
/// (a rule's `{ tcp, udp }`).
fn named_sets(sets: &[Vec<u8>]) -> Result<usize, NftError> {
    let mut n = 0;
    for p in sets {
        n += usize::from(decode::set(p)?.flags & NFT_SET_ANONYMOUS == 0);
    }
    Ok(n)
}

fn libc_msg_trunc() -> i32 {
    nix::sys::socket::MsgFlags::MSG_TRUNC.bits()
}

fn gen_request(seq: u32) -> Vec<u8> {
    let mut w = Writer::new();
    w.begin_msg(msg_type(NFT_MSG_GETGEN), NLM_F_REQUEST, seq, NFPROTO_UNSPEC, 0);
    w.end_msg();
    w.buf
}

fn kernel_error<'a>(
    enc: &Encoded,
    mut changes: impl Iterator<Item = ChangeRef<'a>>,
    seq: u32,
    errno: i32,
    more: usize,
) -> NftError {
    let index = enc.change_of(seq);
    let change = match index.and_then(|i| changes.nth(i)) {
        Some(c) => describe_ref(c),
        None => "commit batch".to_string(),
    };
    NftError::Kernel { index, change, errno, reason: strerror(errno), more }
}
