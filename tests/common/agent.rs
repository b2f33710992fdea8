//! The agent under test, run as `ip netns exec <node> nodelb run …` with its manifests and state file
//! in temporary directories. Killed (SIGKILL + wait) on drop; its log is printed when the test fails.

use std::fs::File;
use std::net::{IpAddr, Ipv4Addr};
use std::path::PathBuf;
use std::process::{Child, Command, Output, Stdio};
use std::time::Duration;

use serde_json::Value;

use super::netns::NetNs;
use super::topology::{ClientError, HttpResponse, NODE_NAME, wait_until};

/// The binary under test: `NODELB_TEST_BIN` if set (e.g. a release build), else the crate's own.
pub fn bin() -> String {
    std::env::var("NODELB_TEST_BIN").unwrap_or_else(|_| env!("CARGO_BIN_EXE_nodelb").to_string())
}

/// The xtables lock of the tests: the agents they start and the iptables-legacy commands they
/// run take this one (shared by concurrent test processes, as the host's is by its tools), never
/// the host's `/run/xtables.lock`.
pub fn xtables_lockfile() -> PathBuf {
    std::env::temp_dir().join("nodelb-test-xtables.lock")
}

/// The default `--http-addr` port, on the node namespace's loopback (each namespace has its own).
pub const HTTP_PORT: u16 = 9470;
/// The default `--health-addr` port, on every address of the node namespace.
pub const HEALTH_PORT: u16 = 9471;

/// A container's args and environment (`kube::daemonset_command`).
pub type ContainerCommand = (Vec<String>, Vec<(String, String)>);

pub struct Agent {
    ns_name: String,
    ns_path: String,
    pub manifests: tempfile::TempDir,
    pub state_dir: tempfile::TempDir,
    pub extra_args: Vec<String>,
    /// Kubernetes mode: kubeconfig and node name (no `--manifests`, no state file).
    kube: Option<(PathBuf, String)>,
    /// Kubernetes mode as the DaemonSet runs it: the container's args (instead of `run
    /// --node-name … --http-addr …`) and environment.
    daemonset: Option<ContainerCommand>,
    child: Option<Child>,
    starts: usize,
    /// The binary it runs ([`bin`], unless the test says otherwise).
    binary: String,
    /// A controller replica (`nodelb controller`), not a node agent: no `--resync-period`.
    controller: bool,
}

/// `NODELB_UPGRADE_FROM`: a binary of an earlier version, which the Kubernetes tests' first agents
/// run (those started again, as an upgrade starts them, run [`bin`]): the upgrade tests then
/// upgrade from that version.
pub fn upgrade_from() -> Option<String> {
    std::env::var("NODELB_UPGRADE_FROM").ok().filter(|p| !p.is_empty())
}

impl Agent {
    /// Writes `files` (name, content) into a fresh manifests directory and starts the agent in `node`
    /// with `--resync-period 1s`, `--node-name node-1` plus `extra` (HTTP on the default addresses).
    pub fn start(node: &NetNs, files: &[(&str, String)], extra: &[&str]) -> Agent {
        let a = Agent::new(node, extra, None, None);
        for (name, content) in files {
            std::fs::write(a.manifests.path().join(name), content).unwrap();
        }
        a.started()
    }

    /// Starts the agent in `node` in Kubernetes mode: `--kubeconfig kubeconfig --node-name node_name`,
    /// `--resync-period 1s` plus `extra` (e.g. `--lease-duration 3s`; HTTP on the default addresses).
    pub fn start_kube(node: &NetNs, kubeconfig: &std::path::Path, node_name: &str, extra: &[&str]) -> Agent {
        Agent::new(node, extra, Some((kubeconfig.to_path_buf(), node_name.to_string())), None).started()
    }

    /// Starts the agent in `node` the way the DaemonSet's container runs it: `args` and `env` from
    /// the DaemonSet (see `kube::daemonset_command`), plus `--kubeconfig kubeconfig` (standing in
    /// for the in-cluster config), `--resync-period 1s` and `extra`.
    pub fn start_daemonset(
        node: &NetNs,
        kubeconfig: &std::path::Path,
        node_name: &str,
        command: ContainerCommand,
        extra: &[&str],
        binary: Option<String>,
    ) -> Agent {
        let kube = Some((kubeconfig.to_path_buf(), node_name.to_string()));
        let mut a = Agent::new(node, extra, kube, Some(command));
        if let Some(b) = binary {
            a.binary = b;
        }
        a.started()
    }

    /// Starts a controller replica in `ns` the way the Deployment's container runs it: `command`
    /// from the Deployment (see `kube::controller_command`), plus `--kubeconfig kubeconfig`
    /// and `extra`. `pod`: its pod name (its leader-election identity).
    pub fn start_controller(
        ns: &NetNs,
        kubeconfig: &std::path::Path,
        pod: &str,
        command: ContainerCommand,
        extra: &[&str],
        binary: Option<String>,
    ) -> Agent {
        let kube = Some((kubeconfig.to_path_buf(), pod.to_string()));
        let mut a = Agent::new(ns, extra, kube, Some(command));
        a.controller = true;
        if let Some(b) = binary {
            a.binary = b;
        }
        a.started()
    }

    /// An agent of `node` not started yet, with fresh manifests and state directories.
    fn new(
        node: &NetNs,
        extra: &[&str],
        kube: Option<(PathBuf, String)>,
        daemonset: Option<ContainerCommand>,
    ) -> Agent {
        Agent {
            ns_name: node.name.clone(),
            ns_path: format!("/run/netns/{}", node.name),
            manifests: super::cleanup::temp_dir("nodelb-manifests-"),
            state_dir: super::cleanup::temp_dir("nodelb-state-"),
            extra_args: extra.iter().map(|s| s.to_string()).collect(),
            kube,
            daemonset,
            child: None,
            starts: 0,
            binary: bin(),
            controller: false,
        }
    }

    fn started(mut self) -> Agent {
        self.spawn();
        self
    }

    /// The `--node-name` this agent runs with (a controller's: its pod name).
    pub fn node_name(&self) -> &str {
        self.kube.as_ref().map_or(NODE_NAME, |(_, n)| n.as_str())
    }

    pub fn state_file(&self) -> PathBuf {
        self.state_dir.path().join("state.json")
    }

    /// The manifests directory (manifests mode).
    pub fn manifests_dir(&self) -> &std::path::Path {
        self.manifests.path()
    }

    pub fn log_file(&self) -> PathBuf {
        self.state_dir.path().join("agent.log")
    }

    fn spawn(&mut self) {
        self.starts += 1;
        let log = std::fs::OpenOptions::new().create(true).append(true).open(self.log_file()).unwrap();
        use std::io::Write;
        let mut l = &log;
        let _ = writeln!(l, "===== test harness: agent start #{} =====", self.starts);
        let mut cmd = Command::new("ip");
        cmd.args(["netns", "exec", &self.ns_name, &self.binary]);
        if let Some((args, env)) = &self.daemonset {
            cmd.args(args).envs(env.iter().map(|(k, v)| (k, v)));
        } else {
            cmd.arg("run");
        }
        match (&self.kube, &self.daemonset) {
            (None, _) => {
                cmd.arg("--manifests")
                    .arg(self.manifests.path())
                    .arg("--state-file")
                    .arg(self.state_file())
                    .args(["--node-name", NODE_NAME]);
            }
            (Some((kubeconfig, _)), Some(_)) => {
                cmd.arg("--kubeconfig").arg(kubeconfig);
            }
            (Some((kubeconfig, node_name)), None) => {
                cmd.arg("--kubeconfig").arg(kubeconfig).args(["--node-name", node_name]);
            }
        }
        // `--http-addr` is left at its default (127.0.0.1:9470, `HTTP_PORT`), and so is
        // `--health-addr` (0.0.0.0:9471): every test runs the addresses a user gets.
        if !self.controller && !self.extra_args.iter().any(|a| a == "--resync-period") {
            cmd.args(["--resync-period", "1s"]);
        }
        cmd.args(&self.extra_args);
        cmd.env("XTABLES_LOCKFILE", xtables_lockfile());
        // The agent's log filter is NODELB_LOG (RUST_LOG is not read).
        if std::env::var_os("NODELB_LOG").is_none() {
            cmd.env("NODELB_LOG", "info,nodelb=debug");
        }
        cmd.stdin(Stdio::null()).stdout(log.try_clone().unwrap()).stderr(log);
        self.child = Some(cmd.spawn().expect("spawn nodelb run"));
    }

    /// SIGKILL (no chance to clean up) and reap. The kernel keeps whatever the agent programmed.
    pub fn kill9(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// SIGTERM and wait up to `timeout` for exit (then SIGKILL). Returns the exit status if it exited.
    pub fn terminate(&mut self, timeout: Duration) -> Option<std::process::ExitStatus> {
        let mut c = self.child.take()?;
        let pid = nix::unistd::Pid::from_raw(c.id() as i32);
        let _ = nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM);
        let mut status = None;
        wait_until(timeout, || {
            status = c.try_wait().ok().flatten();
            status.is_some()
        });
        if status.is_none() {
            let _ = c.kill();
            let _ = c.wait();
        }
        status
    }

    /// Kills (SIGKILL) the running agent, if any, and starts it again with the same manifests, state
    /// file and flags.
    pub fn restart(&mut self) {
        self.kill9();
        self.spawn();
    }

    /// The agent's process id (`ip netns exec` execs the binary, so this is nodelb itself).
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(|c| c.id())
    }

    /// Starts measuring the agent's peak memory anew (`/proc/<pid>/clear_refs`): what
    /// [`Agent::peak_rss_kib`] says next is the peak since.
    pub fn reset_peak_rss(&self) {
        let pid = self.pid().expect("the agent runs");
        std::fs::write(format!("/proc/{pid}/clear_refs"), "5").expect("reset the peak RSS");
    }

    /// The agent's peak resident memory (`VmHWM`), in KiB.
    pub fn peak_rss_kib(&self) -> u64 {
        let pid = self.pid().expect("the agent runs");
        let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("process status");
        let line = status.lines().find(|l| l.starts_with("VmHWM")).expect("VmHWM");
        line.split_whitespace().nth(1).and_then(|v| v.parse().ok()).expect("a number")
    }

    /// Still running?
    pub fn is_running(&mut self) -> bool {
        match self.child.as_mut() {
            Some(c) => c.try_wait().ok().flatten().is_none(),
            None => false,
        }
    }

    pub fn write_manifest(&self, name: &str, content: &str) {
        // Write then rename, so the agent never reads a half-written file.
        let tmp = self.manifests.path().join(format!(".{name}.tmp"));
        std::fs::write(&tmp, content).unwrap();
        std::fs::rename(&tmp, self.manifests.path().join(name)).unwrap();
    }

    pub fn remove_manifest(&self, name: &str) {
        std::fs::remove_file(self.manifests.path().join(name)).unwrap();
    }

    pub fn logs(&self) -> String {
        std::fs::read_to_string(self.log_file()).unwrap_or_default()
    }

    /// `GET path` on the agent's HTTP server (inside the node namespace).
    pub fn http(&self, path: &str) -> Result<HttpResponse, ClientError> {
        let ns = NetNsRef(self.ns_path.clone());
        let path = path.to_string();
        ns.run(move || {
            super::topology::http_request_here(
                IpAddr::V4(Ipv4Addr::LOCALHOST),
                HTTP_PORT,
                &path,
                Duration::from_secs(2),
            )
        })
    }

    /// `GET /status` parsed, or `None` when the agent does not answer (yet).
    pub fn status(&self) -> Option<Value> {
        let r = self.http("/status").ok()?;
        if r.status != 200 {
            return None;
        }
        serde_json::from_str(&r.body).ok()
    }

    /// The `/status` entry of `namespace/name`.
    pub fn service_status(&self, key: &str) -> Option<Value> {
        let (ns, name) = key.split_once('/').unwrap();
        let st = self.status()?;
        st["services"].as_array()?.iter().find(|s| s["namespace"] == ns && s["name"] == name).cloned()
    }

    /// The `state` of `namespace/name` in `/status`.
    pub fn service_state(&self, key: &str) -> Option<String> {
        Some(self.service_status(key)?["state"].as_str()?.to_string())
    }

    /// The allocated node port of `namespace/name` port `port`/`protocol`, from `/status`.
    pub fn node_port(&self, key: &str, port: u16, protocol: &str) -> Option<u16> {
        let s = self.service_status(key)?;
        s["ports"].as_array()?.iter().find(|p| p["port"] == port && p["protocol"] == protocol)?["nodePort"]
            .as_u64()
            .map(|p| p as u16)
    }

    /// `GET /readyz` status code and body.
    pub fn readyz(&self) -> Option<(u16, String)> {
        self.http("/readyz").ok().map(|r| (r.status, r.body))
    }

    /// Waits until `/readyz` answers 200; panics with the agent's log otherwise.
    pub fn wait_ready(&mut self, timeout: Duration) {
        let mut exited = None;
        let ok = wait_until(timeout, || {
            if let Some(c) = self.child.as_mut() {
                exited = c.try_wait().ok().flatten();
            }
            exited.is_some() || matches!(self.readyz(), Some((200, _)))
        });
        if let Some(status) = exited {
            panic!("agent exited ({status}) before becoming ready");
        }
        if !ok {
            panic!(
                "agent not ready within {timeout:?} (running: {}), last /readyz: {:?}",
                self.is_running(),
                self.readyz()
            );
        }
    }

    /// Waits until `namespace/name` has `state` in `/status`.
    pub fn wait_state(&self, key: &str, state: &str, timeout: Duration) {
        let ok = wait_until(timeout, || self.service_state(key).as_deref() == Some(state));
        assert!(ok, "{key} not {state:?} within {timeout:?}; /status: {:?}", self.status());
    }
}

impl Drop for Agent {
    fn drop(&mut self) {
        self.kill9();
        if std::thread::panicking() {
            eprintln!(
                "===== nodelb agent log ({}, netns {}) =====\n{}",
                self.node_name(),
                self.ns_name,
                self.logs()
            );
            eprintln!("===== end of agent log =====");
        }
    }
}

/// A namespace by path, for running closures there without holding a `NetNs` (which would delete it).
struct NetNsRef(String);

impl NetNsRef {
    fn run<T: Send + 'static>(&self, f: impl FnOnce() -> T + Send + 'static) -> T {
        let path = self.0.clone();
        std::thread::spawn(move || {
            let file = File::open(&path).unwrap_or_else(|e| panic!("open {path}: {e}"));
            nix::sched::setns(file, nix::sched::CloneFlags::CLONE_NEWNET).expect("setns");
            f()
        })
        .join()
        .unwrap_or_else(|e| std::panic::resume_unwind(e))
    }
}

/// Runs `nodelb <args>` inside `ns` and returns its output.
pub fn nodelb(ns: &NetNs, args: &[&str]) -> Output {
    ns.exec(&bin(), args)
}

/// `nft list table inet nodelb` in `ns`; `None` when the table does not exist.
pub fn nft_list(ns: &NetNs) -> Option<String> {
    nft_list_table(ns, "inet", "nodelb")
}

pub fn nft_list_table(ns: &NetNs, family: &str, table: &str) -> Option<String> {
    let out = ns.exec("nft", &["list", "table", family, table]);
    out.status.success().then(|| String::from_utf8_lossy(&out.stdout).into_owned())
}

/// `nft <args>` in `ns`, panicking on failure.
pub fn nft(ns: &NetNs, args: &[&str]) -> String {
    ns.exec_ok("nft", args)
}

/// A ruleset listing with counter values and handles blanked, whitespace normalised and the items of
/// set/map element lists sorted (hash sets list in no fixed order), for comparing listings taken at
/// different times or from re-created tables.
pub fn normalize_ruleset(listing: &str) -> String {
    // Join multi-line `elements = { … }` blocks into one line first.
    let mut lines: Vec<String> = Vec::new();
    let mut open: Option<String> = None;
    for line in listing.lines() {
        let line = match line.find("# handle") {
            Some(i) => &line[..i],
            None => line,
        };
        match open.as_mut() {
            Some(acc) => {
                acc.push(' ');
                acc.push_str(line.trim());
                if line.contains('}') {
                    lines.push(open.take().unwrap());
                }
            }
            None if line.contains('{') && !line.contains('}') && line.contains("elements") => {
                open = Some(line.trim().to_string());
            }
            None => lines.push(line.to_string()),
        }
    }
    lines.extend(open);
    let mut out = String::new();
    for line in lines {
        let line = sort_brace_items(&line);
        let mut words: Vec<&str> = line.split_whitespace().collect();
        for i in 1..words.len() {
            if matches!(words[i - 1], "packets" | "bytes") && words[i].chars().all(|c| c.is_ascii_digit()) {
                words[i] = "N";
            }
        }
        if !words.is_empty() {
            out.push_str(&words.join(" "));
            out.push('\n');
        }
    }
    out
}

/// [`normalize_ruleset`], with the table's objects (counters, sets, maps, chains) sorted: the
/// kernel lists objects in the order they were added, so a table built up change by change lists
/// them in another order than the same ruleset loaded at once. Rules inside a chain keep their
/// order (it matters).
pub fn canonical_ruleset(listing: &str) -> String {
    let normalized = normalize_ruleset(listing);
    let mut head = Vec::new();
    let mut blocks: Vec<String> = Vec::new();
    let mut tail = Vec::new();
    let mut depth = 0usize;
    for line in normalized.lines() {
        let opens = line.matches('{').count();
        let closes = line.matches('}').count();
        match depth {
            0 => head.push(line),
            1 if opens > closes => blocks.push(format!("{line}\n")),
            1 if line == "}" => tail.push(line),
            1 => blocks.push(format!("{line}\n")),
            _ => blocks.last_mut().expect("inside a block").push_str(&format!("{line}\n")),
        }
        depth = (depth + opens).saturating_sub(closes);
    }
    blocks.sort();
    let mut out = String::new();
    for l in head {
        out.push_str(l);
        out.push('\n');
    }
    for b in blocks {
        out.push_str(&b);
    }
    for l in tail {
        out.push_str(l);
        out.push('\n');
    }
    out
}

/// Sorts the comma-separated items of every innermost `{ … }` on one line.
fn sort_brace_items(line: &str) -> String {
    let mut out = String::new();
    let mut rest = line;
    while let Some(close) = rest.find('}') {
        match rest[..close].rfind('{') {
            Some(open) => {
                let mut items: Vec<String> = rest[open + 1..close]
                    .split(',')
                    .map(|s| s.split_whitespace().collect::<Vec<_>>().join(" "))
                    .collect();
                items.sort();
                out.push_str(&rest[..open]);
                out.push_str("{ ");
                out.push_str(&items.join(", "));
                out.push_str(" }");
            }
            None => out.push_str(&rest[..=close]),
        }
        rest = &rest[close + 1..];
    }
    out.push_str(rest);
    out
}

/// The names of the chains in a `nft list table` listing.
pub fn chain_names(listing: &str) -> Vec<String> {
    listing
        .lines()
        .filter_map(|l| l.trim().strip_prefix("chain ")?.strip_suffix(" {").map(|s| s.trim().to_string()))
        .collect()
}

/// Reads a sysctl inside `ns` (e.g. `net.ipv4.ip_forward`).
pub fn sysctl_get(ns: &NetNs, key: &str) -> String {
    ns.exec_ok("sysctl", &["-n", key]).trim().to_string()
}
