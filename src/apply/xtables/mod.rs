//! iptables-legacy (x_tables) in this network namespace, without running a binary: the filter
//! tables of IPv4 and IPv6 read with `IPT_SO_GET_INFO` / `IPT_SO_GET_ENTRIES` (`IP6T_…`), and
//! nodelb's ACCEPT written the way libiptc commits: the whole table replaced
//! (`IPT_SO_SET_REPLACE`) under the xtables lock, then the old counters added back
//! (`IPT_SO_SET_ADD_COUNTERS`). The parsing and editing are pure ([`blob`]).
//!
//! Reading never creates anything: the kernel instantiates a legacy table in a namespace the
//! first time anyone asks for it (and then iptables-nft warns "iptables-legacy tables present"
//! on every listing), so a table is only read when `/proc/net/ip_tables_names` already lists
//! it. The socket options work on any AF_INET/AF_INET6 socket (a UDP one here: no
//! CAP_NET_RAW needed, unlike iptables' raw socket); they need CAP_NET_ADMIN.

pub mod blob;

use std::fs::File;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::path::PathBuf;
use std::time::{Duration, Instant};

use nix::fcntl::{Flock, FlockArg};

pub use blob::{Layout, Table};

#[derive(Debug, thiserror::Error)]
pub enum XtablesError {
    #[error("iptables-legacy {what}: {source}")]
    Io { what: String, source: std::io::Error },
    #[error(transparent)]
    Blob(#[from] blob::BlobError),
    #[error("the xtables lock {path} is held by another process (waited {waited:?}); trying again later")]
    Locked { path: PathBuf, waited: Duration },
    #[error("iptables-legacy tables are only supported on 64-bit kernels")]
    Unsupported,
}

fn io(what: impl Into<String>) -> impl FnOnce(std::io::Error) -> XtablesError {
    let what = what.into();
    move |source| XtablesError::Io { what, source }
}

/// `IPT_SO_GET_INFO` = `IP6T_SO_GET_INFO` = `IPT_SO_SET_REPLACE` = 64 (`IPT_BASE_CTL`).
const SO_GET_INFO: i32 = 64;
const SO_GET_ENTRIES: i32 = 65;
const SO_SET_REPLACE: i32 = 64;
const SO_SET_ADD_COUNTERS: i32 = 65;
/// `struct ipt_get_entries`: name[32], size, then the entries (8-aligned).
const GET_ENTRIES_HEADER: usize = 40;
/// `struct ipt_replace`: name, valid_hooks, num_entries, size, hook_entry[5], underflow[5],
/// num_counters, counters (a pointer), then the entries.
const REPLACE_HEADER: usize = 96;
/// `struct xt_counters_info`: name[32], num_counters, then the counters (8-aligned).
const COUNTERS_INFO_HEADER: usize = 40;
const TABLE: &str = "filter";
/// How long a write waits for the xtables lock before trying again at the next resync.
const LOCK_WAIT: Duration = Duration::from_secs(3);

/// The lock file iptables-legacy uses: `XTABLES_LOCKFILE`, else `/run/xtables.lock` (in a pod,
/// mount the host's; see `daemonset/`).
pub fn default_lockfile() -> PathBuf {
    match std::env::var_os("XTABLES_LOCKFILE") {
        Some(p) if !p.is_empty() => PathBuf::from(p),
        _ => PathBuf::from("/run/xtables.lock"),
    }
}

/// iptables-legacy's filter tables in the namespace of the calling thread.
#[derive(Debug, Clone)]
pub struct Xtables {
    lockfile: PathBuf,
}

fn names_file(layout: Layout) -> &'static str {
    match layout {
        Layout::V4 => "/proc/thread-self/net/ip_tables_names",
        Layout::V6 => "/proc/thread-self/net/ip6_tables_names",
    }
}

/// The socket family and the level of the socket options.
fn socket_of(layout: Layout) -> (i32, i32) {
    match layout {
        Layout::V4 => (libc::AF_INET, libc::IPPROTO_IP),
        Layout::V6 => (libc::AF_INET6, libc::IPPROTO_IPV6),
    }
}

fn table_name() -> [u8; 32] {
    let mut n = [0u8; 32];
    n[..TABLE.len()].copy_from_slice(TABLE.as_bytes());
    n
}

impl Xtables {
    pub fn new(lockfile: PathBuf) -> Xtables {
        Xtables { lockfile }
    }

    /// Whether iptables-legacy's filter table of this family exists here (without creating it).
    pub fn exists(&self, layout: Layout) -> Result<bool, XtablesError> {
        match std::fs::read_to_string(names_file(layout)) {
            Ok(names) => Ok(names.lines().any(|l| l.trim() == TABLE)),
            // No x_tables for this family in the kernel at all.
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(false),
            Err(e) => Err(io(format!("read {}", names_file(layout)))(e)),
        }
    }

    /// The filter table of this family, `None` when there is none here.
    pub fn read(&self, layout: Layout) -> Result<Option<Table>, XtablesError> {
        if !self.exists(layout)? {
            return Ok(None);
        }
        let sock = Socket::open(layout)?;
        sock.read_table(layout).map(Some)
    }

    /// Makes nodelb's ACCEPT for mark `insert` (with `None`: none of nodelb's entries) the
    /// state of this family's FORWARD chain; `Ok(false)` when it already was, or there is no
    /// such table (it is never created). Under the xtables lock, from a fresh read: the whole
    /// table is replaced by the same table with only nodelb's entries changed, and the counters
    /// of every other entry are added back, as `iptables-legacy` does for any change.
    pub fn write_accept(&self, layout: Layout, insert: Option<u32>) -> Result<bool, XtablesError> {
        if usize::BITS != 64 {
            return Err(XtablesError::Unsupported);
        }
        if !self.exists(layout)? {
            return Ok(false);
        }
        let _lock = self.lock()?;
        let sock = Socket::open(layout)?;
        let table = sock.read_table(layout)?;
        let Some(r) = blob::with_accept(&table, insert)? else { return Ok(false) };
        let old = sock.replace(&table, &r)?;
        sock.add_counters(&r.counters(&old))?;
        Ok(true)
    }

    /// The xtables lock, as iptables takes it (`flock` on the lock file), waiting at most
    /// [`LOCK_WAIT`].
    fn lock(&self) -> Result<Flock<File>, XtablesError> {
        let started = Instant::now();
        let mut file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(&self.lockfile)
            .map_err(io(format!("open lock file {}", self.lockfile.display())))?;
        loop {
            match Flock::lock(file, FlockArg::LockExclusiveNonblock) {
                Ok(lock) => return Ok(lock),
                Err((f, nix::errno::Errno::EWOULDBLOCK)) if started.elapsed() < LOCK_WAIT => {
                    file = f;
                    std::thread::sleep(Duration::from_millis(20));
                }
                Err((_, nix::errno::Errno::EWOULDBLOCK)) => {
                    return Err(XtablesError::Locked {
                        path: self.lockfile.clone(),
                        waited: started.elapsed(),
                    });
                }
                Err((_, e)) => {
                    return Err(io(format!("lock {}", self.lockfile.display()))(std::io::Error::from(e)));
                }
            }
        }
    }
}

struct Socket {
    fd: OwnedFd,
    level: i32,
}

impl Socket {
    fn open(layout: Layout) -> Result<Socket, XtablesError> {
        let (family, level) = socket_of(layout);
        // SAFETY: socket(2) with constant arguments; the result is checked and owned at once.
        let fd = unsafe { libc::socket(family, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, 0) };
        if fd < 0 {
            return Err(io("open a socket")(std::io::Error::last_os_error()));
        }
        // SAFETY: `fd` is a socket we just opened and nobody else owns.
        Ok(Socket { fd: unsafe { OwnedFd::from_raw_fd(fd) }, level })
    }

    fn getsockopt(&self, name: i32, buf: &mut [u8], what: &str) -> Result<usize, std::io::Error> {
        let mut len = buf.len() as libc::socklen_t;
        // SAFETY: the kernel writes at most `len` bytes into `buf`, which is that long.
        let r = unsafe {
            libc::getsockopt(self.fd.as_raw_fd(), self.level, name, buf.as_mut_ptr().cast(), &mut len)
        };
        if r < 0 {
            let e = std::io::Error::last_os_error();
            return Err(std::io::Error::new(e.kind(), format!("{what}: {e}")));
        }
        Ok(len as usize)
    }

    fn setsockopt(&self, name: i32, buf: &[u8]) -> Result<(), std::io::Error> {
        // SAFETY: the kernel reads `buf.len()` bytes from `buf` (and, for SET_REPLACE, writes
        // the old counters through the pointer in it, to a buffer the caller keeps alive).
        let r = unsafe {
            libc::setsockopt(
                self.fd.as_raw_fd(),
                self.level,
                name,
                buf.as_ptr().cast(),
                buf.len() as libc::socklen_t,
            )
        };
        if r < 0 { Err(std::io::Error::last_os_error()) } else { Ok(()) }
    }

    /// GET_INFO then GET_ENTRIES; again if the table changed in between (EAGAIN).
    fn read_table(&self, layout: Layout) -> Result<Table, XtablesError> {
        let mut last = None;
        for _ in 0..5 {
            let mut info = [0u8; blob::GETINFO_SIZE];
            info[..32].copy_from_slice(&table_name());
            self.getsockopt(SO_GET_INFO, &mut info, "get info").map_err(io("read table filter"))?;
            let info = blob::Info::parse(&info)?;
            let mut buf = vec![0u8; GET_ENTRIES_HEADER + info.size as usize];
            buf[..32].copy_from_slice(&table_name());
            buf[32..36].copy_from_slice(&info.size.to_ne_bytes());
            match self.getsockopt(SO_GET_ENTRIES, &mut buf, "get entries") {
                Ok(_) => {
                    buf.drain(..GET_ENTRIES_HEADER);
                    return Ok(Table::parse(layout, TABLE, info, buf)?);
                }
                Err(e)
                    if e.raw_os_error() == Some(libc::EAGAIN)
                        || e.kind() == std::io::ErrorKind::WouldBlock =>
                {
                    last = Some(e);
                }
                Err(e) => return Err(io("read table filter")(e)),
            }
        }
        Err(io("read table filter (kept changing)")(last.unwrap_or_else(|| std::io::Error::other("EAGAIN"))))
    }

    /// SET_REPLACE of `old` by `r`; returns the counters of `old`'s entries as the kernel had
    /// them when it switched. The kernel refuses (EAGAIN) when the table no longer has `old`'s
    /// number of entries: someone changed it without the lock.
    fn replace(&self, old: &Table, r: &blob::Replacement) -> Result<Vec<(u64, u64)>, XtablesError> {
        let n_old = old.info.num_entries as usize;
        let mut counters = vec![0u8; 16 * n_old];
        let mut buf = vec![0u8; REPLACE_HEADER + r.blob.len()];
        buf[..32].copy_from_slice(&table_name());
        let put = |b: &mut Vec<u8>, at: usize, v: u32| b[at..at + 4].copy_from_slice(&v.to_ne_bytes());
        put(&mut buf, 32, r.info.valid_hooks);
        put(&mut buf, 36, r.info.num_entries);
        put(&mut buf, 40, r.info.size);
        for h in 0..5 {
            put(&mut buf, 44 + 4 * h, r.info.hook_entry[h]);
            put(&mut buf, 64 + 4 * h, r.info.underflow[h]);
        }
        put(&mut buf, 84, n_old as u32);
        buf[88..96].copy_from_slice(&(counters.as_mut_ptr() as usize as u64).to_ne_bytes());
        buf[REPLACE_HEADER..].copy_from_slice(&r.blob);
        self.setsockopt(SO_SET_REPLACE, &buf).map_err(io("replace table filter"))?;
        Ok(counters
            .chunks_exact(16)
            .map(|c| {
                let pk = u64::from_ne_bytes(c[..8].try_into().unwrap_or_default());
                let by = u64::from_ne_bytes(c[8..].try_into().unwrap_or_default());
                (pk, by)
            })
            .collect())
    }

    fn add_counters(&self, counters: &[(u64, u64)]) -> Result<(), XtablesError> {
        let mut buf = vec![0u8; COUNTERS_INFO_HEADER + 16 * counters.len()];
        buf[..32].copy_from_slice(&table_name());
        buf[32..36].copy_from_slice(&(counters.len() as u32).to_ne_bytes());
        for (i, (pk, by)) in counters.iter().enumerate() {
            let at = COUNTERS_INFO_HEADER + 16 * i;
            buf[at..at + 8].copy_from_slice(&pk.to_ne_bytes());
            buf[at + 8..at + 16].copy_from_slice(&by.to_ne_bytes());
        }
        self.setsockopt(SO_SET_ADD_COUNTERS, &buf).map_err(io("restore the counters of table filter"))
    }
}
