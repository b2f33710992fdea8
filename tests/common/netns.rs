//! Network namespaces for root tests: created per test with unique names, deleted on drop (also when
//! the test panics). Nothing here touches the host's own namespace.

use std::fs::File;
use std::process::{Command, Output};
use std::sync::atomic::{AtomicUsize, Ordering};

use nix::sched::{CloneFlags, setns};

static COUNTER: AtomicUsize = AtomicUsize::new(0);

/// Env var set by `.ci/run`: a root test that would skip for lack of root fails instead.
pub const REQUIRE_ROOT_ENV: &str = "NODELB_REQUIRE_ROOT_TESTS";

/// Returns true when the test may run. Without root it skips (prints why), unless
/// `NODELB_REQUIRE_ROOT_TESTS=1`, which turns the skip into a failure.
pub fn have_root(test: &str) -> bool {
    if nix::unistd::Uid::effective().is_root() {
        return true;
    }
    if std::env::var(REQUIRE_ROOT_ENV).as_deref() == Ok("1") {
        panic!("{test}: needs root, and {REQUIRE_ROOT_ENV}=1 forbids skipping");
    }
    eprintln!("SKIP {test}: needs root (run as root, or set {REQUIRE_ROOT_ENV}=1 to fail instead)");
    false
}

/// Skips the calling test (returns early) when not root.
#[macro_export]
macro_rules! require_root {
    () => {
        if !$crate::common::netns::have_root(module_path!()) {
            return;
        }
    };
}

/// A named network namespace (`ip netns add`), deleted on drop.
pub struct NetNs {
    pub name: String,
}

impl NetNs {
    /// Creates `nlb-<tag>-<pid>-<n>` with loopback up.
    pub fn new(tag: &str) -> NetNs {
        let n = COUNTER.fetch_add(1, Ordering::SeqCst);
        let name = format!("nlb-{tag}-{}-{n}", std::process::id());
        run_ok("ip", &["netns", "add", &name]);
        let ns = NetNs { name };
        ns.ip(&["link", "set", "lo", "up"]);
        ns
    }

    /// `ip netns exec <ns> <program> <args>`; returns the output whatever the exit status.
    pub fn exec(&self, program: &str, args: &[&str]) -> Output {
        let mut full = vec!["netns", "exec", self.name.as_str(), program];
        full.extend_from_slice(args);
        Command::new("ip").args(&full).output().expect("spawn ip netns exec")
    }

    /// Like [`NetNs::exec`] but panics with stderr when the command fails; returns stdout.
    pub fn exec_ok(&self, program: &str, args: &[&str]) -> String {
        let out = self.exec(program, args);
        assert!(
            out.status.success(),
            "in netns {}: {program} {args:?} failed: {}",
            self.name,
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    /// `ip <args>` inside the namespace (panics on failure).
    pub fn ip(&self, args: &[&str]) -> String {
        self.exec_ok("ip", args)
    }

    /// `sysctl -w key=value` inside the namespace.
    pub fn sysctl(&self, key: &str, value: &str) {
        self.exec_ok("sysctl", &["-qw", &format!("{key}={value}")]);
    }

    /// Runs `f` on a new thread that has joined this namespace (sockets it opens live there).
    pub fn run<T: Send + 'static>(&self, f: impl FnOnce() -> T + Send + 'static) -> T {
        let path = format!("/run/netns/{}", self.name);
        std::thread::spawn(move || {
            enter(&path);
            f()
        })
        .join()
        .unwrap_or_else(|e| std::panic::resume_unwind(e))
    }

    /// Joins this namespace on the *current* thread (for threads the test spawns itself).
    pub fn enter_current_thread(&self) {
        enter(&format!("/run/netns/{}", self.name));
    }

    /// Joins the namespace called `name` on the current thread (for a thread that cannot borrow
    /// the [`NetNs`]).
    pub fn enter_path(name: &str) {
        enter(&format!("/run/netns/{name}"));
    }
}

fn enter(path: &str) {
    let file = File::open(path).unwrap_or_else(|e| panic!("open {path}: {e}"));
    setns(file, CloneFlags::CLONE_NEWNET).unwrap_or_else(|e| panic!("setns {path}: {e}"));
}

impl Drop for NetNs {
    fn drop(&mut self) {
        let _ = Command::new("ip").args(["netns", "del", &self.name]).output();
    }
}

pub fn run_ok(program: &str, args: &[&str]) -> String {
    let out = Command::new(program).args(args).output().unwrap_or_else(|e| panic!("spawn {program}: {e}"));
    assert!(out.status.success(), "{program} {args:?} failed: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// Connects two namespaces with a veth pair `a_if` (in `a`) ↔ `b_if` (in `b`), both up.
pub fn veth(a: &NetNs, a_if: &str, b: &NetNs, b_if: &str) {
    // Create inside `a` so no interface ever appears in the host namespace.
    a.ip(&["link", "add", a_if, "type", "veth", "peer", "name", b_if, "netns", &b.name]);
    a.ip(&["link", "set", a_if, "up"]);
    b.ip(&["link", "set", b_if, "up"]);
}
