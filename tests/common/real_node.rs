//! Real Kubernetes nodes for the end-to-end tests: the control plane of `kube.rs` plus
//! kube-controller-manager and kube-scheduler, and nodes that each run Debian's containerd (runc,
//! the CNI plugins) and a kubelet built from the same `k8s.io/kubernetes` module
//! (`scripts/build-testkube.sh`), with the images `scripts/build-images.sh` makes imported into
//! the node's containerd: nodelb's own, a pause image and a test backend. No registry is involved.
//!
//! ```text
//!                 fabric netns: bridge br-f 203.0.113.0/24
//!  api     eth0 203.0.113.100 ─┤  testkube (etcd, kube-apiserver), kube-controller-manager, kube-scheduler
//!  client  eth0 203.0.113.10  ─┤
//!  node-N  eth0 203.0.113.N   ─┤  containerd + kubelet; pods on bridge cni0, 198.51.100.64·(N-1)/26
//! ```
//!
//! A node is a network namespace and a private mount namespace: tmpfs on `/run` (containerd's
//! shim sockets, the xtables lock) and `/var/log` (container logs), and read-only files over the
//! three `/proc/sys` entries a kubelet writes at start, so the host keeps its values. Its pods'
//! cgroups live under `/nodelb-<netns>` of every hierarchy. What a cluster's network add-ons do
//! for pods, the harness does in each node namespace with fixed rules (`table ip cluster-network`):
//! the kubernetes Service's address (192.0.2.1:443, what in-cluster clients dial) is sent to the
//! API server, pod traffic leaving the pod network is masqueraded, and every node routes the
//! other nodes' pod ranges. Nothing else is added: nodelb's own rules are the agents'.
//!
//! On drop (also when the test panics, then with the components' logs): kubelets stopped, every
//! process of the nodes' cgroups killed, containerd and its shims stopped, the cgroups removed,
//! the namespaces deleted. A test process ended by SIGINT, SIGTERM or SIGHUP runs no destructor:
//! its handler removes the same (`remove_own_on_signal`); one killed by SIGKILL leaves it to the
//! next [`RealCluster::start`] (`sweep_dead_nodes`), and `scripts/test.sh` fails when namespaces or
//! cgroups are left at its end.

use std::fs;
use std::net::Ipv4Addr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use serde_json::Value;

use super::cluster::{API_PORT, API_V4, CLIENT_V4, node_name, node_v4};
use super::kube::{ControlPlane, testkube_dir};
use super::netns::{NetNs, veth};
use super::topology::wait_until;

/// The pods' addresses: node `i` has `198.51.100.(64·i)/26`.
pub const POD_NETWORK: &str = "198.51.100.0/24";
/// The kubernetes Service's address and port (the first of testkube's Service range).
const KUBERNETES_SERVICE: &str = "192.0.2.1";
const KUBERNETES_SERVICE_RANGE: &str = "192.0.2.0/24";

/// Node `i`'s pod range.
pub fn pod_cidr(i: usize) -> String {
    format!("198.51.100.{}/26", 64 * i)
}

/// The images the nodes hold (`scripts/build-images.sh`, built from the binary under test).
pub struct Images {
    pub dir: PathBuf,
    /// (file stem, image reference): nodelb, pause, backend.
    pub refs: Vec<(String, String)>,
}

impl Images {
    pub fn get(&self, stem: &str) -> &str {
        &self.refs.iter().find(|(s, _)| s == stem).unwrap_or_else(|| panic!("no image {stem}")).1
    }
}

/// Built (or found up to date) once per test process.
pub fn images() -> &'static Images {
    static IMAGES: std::sync::OnceLock<Images> = std::sync::OnceLock::new();
    IMAGES.get_or_init(|| {
        let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("scripts/build-images.sh");
        let out = Command::new(&script)
            .arg(super::agent::bin())
            .stderr(Stdio::inherit())
            .output()
            .unwrap_or_else(|e| panic!("{}: {e}", script.display()));
        assert!(out.status.success(), "scripts/build-images.sh failed (see above)");
        let dir = PathBuf::from(String::from_utf8_lossy(&out.stdout).trim());
        let env = fs::read_to_string(dir.join("images.env")).expect("images.env");
        let refs = env
            .lines()
            .filter_map(|l| l.split_once('='))
            .map(|(k, v)| (k.trim_end_matches("_IMAGE").to_lowercase(), v.to_string()))
            .collect();
        Images { dir, refs }
    })
}

/// A control plane with its controllers and scheduler, `nodes` real nodes and a client.
pub struct RealCluster {
    pub nodes: Vec<RealNode>,
    /// kube-controller-manager and kube-scheduler, with their log files.
    components: Vec<(Child, PathBuf)>,
    pub api: ControlPlane,
    pub client: NetNs,
    api_ns: NetNs,
    fabric: NetNs,
    logs: tempfile::TempDir,
}

impl RealCluster {
    /// Starts everything and waits until every node is Ready.
    pub fn start(nodes: usize) -> RealCluster {
        assert!(nodes <= 4, "pod ranges are /26s of one /24");
        let images = images();
        sweep_dead_nodes();
        remove_own_on_signal();
        let fabric = NetNs::new("rfab");
        fabric.ip(&["link", "add", "br-f", "type", "bridge"]);
        fabric.ip(&["link", "set", "br-f", "up"]);
        let api_ns = NetNs::new("rapi");
        attach(&fabric, &api_ns, "api", API_V4);
        let client = NetNs::new("rcl");
        attach(&fabric, &client, "cl", CLIENT_V4);
        let api = ControlPlane::start(&api_ns, API_V4, API_PORT, &[]);
        let logs = super::cleanup::temp_dir(&format!("nodelb-components-{}-", std::process::id()));
        let mut c =
            RealCluster { nodes: Vec::new(), components: Vec::new(), api, client, api_ns, fabric, logs };
        c.start_components();
        for i in 0..nodes {
            let ns = NetNs::new(&format!("rn{}", i + 1));
            attach(&c.fabric, &ns, &format!("n{i}"), node_v4(i));
            let node = RealNode::start(&c.api, ns, i, nodes, images);
            c.nodes.push(node);
        }
        for i in 0..nodes {
            c.wait_node_ready(i, Duration::from_secs(120));
        }
        c
    }

    /// kube-controller-manager (every default controller but the two testkube runs itself:
    /// EndpointSlices and ClusterRole aggregation) and kube-scheduler, in the API namespace, as
    /// the cluster's administrator.
    fn start_components(&mut self) {
        let data = self.api.data_dir().to_path_buf();
        let kubeconfig = self.api.admin_kubeconfig();
        let kubeconfig = kubeconfig.to_str().unwrap();
        let pki = |f: &str| data.join("pki").join(f).to_str().unwrap().to_string();
        let kcm = vec![
            format!("--kubeconfig={kubeconfig}"),
            format!("--root-ca-file={}", pki("ca.crt")),
            format!("--service-account-private-key-file={}", pki("sa.key")),
            "--controllers=*,-endpointslice-controller,-clusterrole-aggregation-controller".into(),
            "--leader-elect=false".into(),
            "--secure-port=0".into(),
            // Pods of a node that stops reporting are evicted after this long.
            "--node-monitor-grace-period=20s".into(),
        ];
        let sched = vec![
            format!("--kubeconfig={kubeconfig}"),
            "--leader-elect=false".into(),
            "--secure-port=0".into(),
        ];
        for (name, args) in [("kube-controller-manager", kcm), ("kube-scheduler", sched)] {
            let log = self.logs.path().join(format!("{name}.log"));
            let file = fs::File::create(&log).unwrap();
            let child = Command::new("ip")
                .args(["netns", "exec", &self.api_ns.name])
                .arg(testkube_dir().join(name))
                .args(&args)
                .stdin(Stdio::null())
                .stdout(file.try_clone().unwrap())
                .stderr(file)
                .spawn()
                .unwrap_or_else(|e| panic!("spawn {name}: {e}"));
            self.components.push((child, log));
        }
    }

    /// Waits until Node `i` reports Ready.
    pub fn wait_node_ready(&self, i: usize, timeout: Duration) {
        let name = node_name(i);
        let ready = || {
            self.api.get("v1", "Node", "", &name).is_some_and(|n| {
                n["status"]["conditions"]
                    .as_array()
                    .is_some_and(|cs| cs.iter().any(|c| c["type"] == "Ready" && c["status"] == "True"))
            })
        };
        assert!(wait_until(timeout, ready), "{name} not Ready within {timeout:?}:\n{}", self.nodes[i].logs());
    }

    /// `kubectl rollout status <what> -n <ns>` until done (panics with the pods' state if not).
    pub fn rollout(&self, ns: &str, what: &str, timeout: Duration) {
        let t = format!("--timeout={}s", timeout.as_secs());
        let out = self.api.kubectl(&["rollout", "status", what, "-n", ns, &t]);
        if !out.status.success() {
            let pods = self.api.kubectl(&["get", "pods", "-A", "-o", "wide"]);
            let events = self.api.kubectl(&["get", "events", "-n", ns, "--sort-by=.lastTimestamp"]);
            panic!(
                "rollout of {ns}/{what}: {}\n{}\n{}",
                String::from_utf8_lossy(&out.stderr),
                String::from_utf8_lossy(&pods.stdout),
                String::from_utf8_lossy(&events.stdout)
            );
        }
    }

    /// The Pods of `ns` matching `selector`, as stored.
    pub fn pods(&self, ns: &str, selector: &str) -> Vec<Value> {
        let out = self.api.kubectl_ok(&["get", "pods", "-n", ns, "-l", selector, "-o", "json"]);
        let list: Value = serde_json::from_str(&out).expect("pod list");
        list["items"].as_array().cloned().unwrap_or_default()
    }

    /// `curl <args>` from the client namespace; (exit success, stdout).
    pub fn curl(&self, args: &[&str]) -> (bool, String) {
        let out = self.client.exec("curl", args);
        (out.status.success(), String::from_utf8_lossy(&out.stdout).into_owned())
    }

    fn dump_logs(&self) {
        for (_, log) in &self.components {
            print_tail(log, 60);
        }
    }
}

impl Drop for RealCluster {
    fn drop(&mut self) {
        let panicking = std::thread::panicking();
        if panicking {
            let pods = self.api.kubectl(&["get", "pods", "-A", "-o", "wide"]);
            eprintln!("===== pods =====\n{}", String::from_utf8_lossy(&pods.stdout));
            self.dump_logs();
        }
        // Nodes first: their kubelets talk to the API server until they stop.
        self.nodes.clear();
        for (mut child, _) in self.components.drain(..) {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// One node: its network namespace, the process holding its mount namespace, containerd and the
/// kubelet.
pub struct RealNode {
    pub name: String,
    pub v4: Ipv4Addr,
    holder: Option<Child>,
    containerd: Option<Child>,
    kubelet: Option<Child>,
    /// The directory under every cgroup hierarchy that holds its pods.
    cgroup: String,
    dir: tempfile::TempDir,
    pub ns: NetNs,
}

impl RealNode {
    /// Node `i` of `n`: namespace `ns` (attached to the fabric), containerd with `images`
    /// imported, a kubelet registered with `api`.
    fn start(api: &ControlPlane, ns: NetNs, i: usize, n: usize, images: &Images) -> RealNode {
        let name = node_name(i);
        let v4 = node_v4(i);
        ns.sysctl("net.ipv4.ip_forward", "1");
        ns.ip(&["route", "add", KUBERNETES_SERVICE_RANGE, "dev", "eth0"]);
        for j in (0..n).filter(|&j| j != i) {
            ns.ip(&["route", "add", &pod_cidr(j), "via", &node_v4(j).to_string()]);
        }
        // Named after the namespace (and so the test process): see `sweep_dead_nodes`.
        let dir = super::cleanup::temp_dir(&format!("nodelb-node-{}-", ns.name));
        let d = dir.path().to_str().unwrap().to_string();
        let rules = format!(
            "table ip cluster-network {{\n\
             chain output {{ type nat hook output priority -100; ip daddr {KUBERNETES_SERVICE} tcp dport 443 dnat to {API_V4}:{API_PORT}; }}\n\
             chain prerouting {{ type nat hook prerouting priority -100; ip daddr {KUBERNETES_SERVICE} tcp dport 443 dnat to {API_V4}:{API_PORT}; }}\n\
             chain postrouting {{ type nat hook postrouting priority 100; ip saddr {pods} ip daddr != {POD_NETWORK} masquerade; }}\n\
             }}\n",
            pods = pod_cidr(i)
        );
        fs::write(dir.path().join("cluster-network.nft"), rules).unwrap();
        ns.exec_ok("nft", &["-f", &format!("{d}/cluster-network.nft")]);

        for sub in ["cni/net.d", "cni/ipam", "kubelet", "kubelet-pki", "volume-plugins"] {
            fs::create_dir_all(dir.path().join(sub)).unwrap();
        }
        fs::write(dir.path().join("containerd.toml"), containerd_config(&d)).unwrap();
        fs::write(
            dir.path().join("cni/net.d/10-pods.conflist"),
            serde_json::to_string_pretty(&serde_json::json!({
                "cniVersion": "0.4.0", "name": "pods",
                "plugins": [{
                    "type": "bridge", "bridge": "cni0", "isGateway": true, "hairpinMode": true,
                    "ipam": {"type": "host-local", "ranges": [[{"subnet": pod_cidr(i)}]],
                             "routes": [{"dst": "0.0.0.0/0"}], "dataDir": format!("{d}/cni/ipam")},
                }],
            }))
            .unwrap(),
        )
        .unwrap();
        let cgroup = format!("nodelb-{}", ns.name);
        fs::write(dir.path().join("kubelet.yaml"), kubelet_config(&d, &cgroup, v4, api)).unwrap();
        make_cgroup(&cgroup);
        // The values a kubelet wants to see in /proc/sys (else it writes them).
        for (file, value) in [("overcommit_memory", "1"), ("panic", "10"), ("panic_on_oops", "1")] {
            fs::write(dir.path().join(file), format!("{value}\n")).unwrap();
        }

        let mut node = RealNode { name, v4, holder: None, containerd: None, kubelet: None, cgroup, dir, ns };
        node.holder = Some(node.hold_mount_namespace());
        node.containerd =
            Some(node.spawn_in("containerd", "containerd", &["--config", &format!("{d}/containerd.toml")]));
        let sock = format!("{d}/containerd.sock");
        assert!(
            wait_until(Duration::from_secs(30), || Path::new(&sock).exists()),
            "{}: containerd did not start:\n{}",
            node.name,
            node.logs()
        );
        for (stem, reference) in &images.refs {
            let base = reference.rsplit_once(':').map_or(reference.as_str(), |(b, _)| b);
            let tar = images.dir.join(format!("{stem}.tar"));
            node.ctr(&["images", "import", "--base-name", base, &tar.to_string_lossy()]);
        }
        node.start_kubelet(api);
        node
    }

    /// `sleep infinity` in a private mount namespace (in the node's network namespace) with the
    /// node's own `/run`, `/var/log` and kernel tunables mounted.
    fn hold_mount_namespace(&self) -> Child {
        let d = self.dir.path().to_str().unwrap();
        let script = format!(
            "set -e\n\
             mount -t tmpfs -o mode=0755 node-run /run\n\
             mount -t tmpfs -o mode=0755 node-log /var/log\n\
             for f in vm/overcommit_memory kernel/panic kernel/panic_on_oops; do\n\
               mount --bind {d}/${{f#*/}} /proc/sys/$f\n\
               mount -o remount,bind,ro /proc/sys/$f\n\
             done\n\
             touch {d}/mounted\n\
             exec sleep infinity\n"
        );
        let log = fs::File::create(self.dir.path().join("holder.log")).unwrap();
        let child = Command::new("nsenter")
            .arg(format!("--net=/run/netns/{}", self.ns.name))
            .args(["--", "unshare", "--mount", "--propagation", "private", "--", "sh", "-c", &script])
            .stdin(Stdio::null())
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .expect("spawn nsenter");
        let mounted = self.dir.path().join("mounted");
        assert!(
            wait_until(Duration::from_secs(10), || mounted.exists()),
            "{}: the mount namespace was not set up: {}",
            self.name,
            fs::read_to_string(self.dir.path().join("holder.log")).unwrap_or_default()
        );
        child
    }

    /// `program args` inside the node's namespaces, its output in `<log>.log`.
    fn spawn_in(&self, log: &str, program: &str, args: &[&str]) -> Child {
        let holder = self.holder.as_ref().expect("mount namespace").id();
        let file = fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.dir.path().join(format!("{log}.log")))
            .unwrap();
        Command::new("nsenter")
            .args(["--target", &holder.to_string(), "--mount", "--net", "--"])
            .arg(program)
            .args(args)
            .stdin(Stdio::null())
            .stdout(file.try_clone().unwrap())
            .stderr(file)
            .spawn()
            .unwrap_or_else(|e| panic!("spawn {program}: {e}"))
    }

    /// Starts the kubelet (again), with a client certificate of `system:node:<name>`.
    pub fn start_kubelet(&mut self, api: &ControlPlane) {
        assert!(self.kubelet.is_none(), "{}: kubelet already running", self.name);
        let kubeconfig = api.user_kubeconfig(&format!("system:node:{}", self.name), &["system:nodes"]);
        let d = self.dir.path().to_str().unwrap().to_string();
        let kubelet = testkube_dir().join("kubelet");
        let args = [
            format!("--config={d}/kubelet.yaml"),
            format!("--kubeconfig={}", kubeconfig.display()),
            format!("--root-dir={d}/kubelet"),
            format!("--cert-dir={d}/kubelet-pki"),
            format!("--hostname-override={}", self.name),
            format!("--node-ip={}", self.v4),
            "--v=1".into(),
        ];
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        self.kubelet = Some(self.spawn_in("kubelet", kubelet.to_str().unwrap(), &args));
    }

    /// Stops the kubelet (SIGTERM); its pods keep running, as on a real node.
    pub fn stop_kubelet(&mut self) {
        if let Some(c) = self.kubelet.take() {
            stop_child(c, Duration::from_secs(10));
        }
    }

    /// `nft list table inet nodelb` in the node: the rules nodelb programmed (None: no table).
    pub fn nodelb_table(&self) -> Option<String> {
        let out = self.ns.exec("nft", &["list", "table", "inet", "nodelb"]);
        out.status.success().then(|| String::from_utf8_lossy(&out.stdout).into_owned())
    }

    /// The last lines of the kubelet's and containerd's logs.
    pub fn logs(&self) -> String {
        let mut s = String::new();
        for f in ["containerd", "kubelet"] {
            let text = fs::read_to_string(self.dir.path().join(format!("{f}.log"))).unwrap_or_default();
            let lines: Vec<&str> = text.lines().collect();
            s += &format!("===== {} {f} (last 40 lines) =====\n", self.name);
            for l in &lines[lines.len().saturating_sub(40)..] {
                s += l;
                s.push('\n');
            }
        }
        s
    }

    /// `ctr images tag`: `reference` also as `tag` in the node's image store.
    pub fn tag_image(&self, reference: &str, tag: &str) {
        self.ctr(&["images", "tag", "--force", reference, tag]);
    }

    /// `ctr` against the node's containerd, in the kubelet's namespace; fails the test if it fails.
    fn ctr(&self, args: &[&str]) {
        let sock = format!("{}/containerd.sock", self.dir.path().display());
        let out =
            Command::new("ctr").args(["--address", &sock, "-n", "k8s.io"]).args(args).output().expect("ctr");
        assert!(out.status.success(), "ctr {args:?}: {}", String::from_utf8_lossy(&out.stderr));
    }

    /// Every process in the node's cgroups (its pods' containers).
    pub fn pod_processes(&self) -> Vec<i32> {
        self.processes_where(|_| true)
    }

    /// The processes of the pod with this UID (the kubelet's cgroup `pod<uid>`).
    pub fn processes_of_pod(&self, uid: &str) -> Vec<i32> {
        let dir = format!("pod{uid}");
        self.processes_where(|p| p.components().any(|c| c.as_os_str() == dir.as_str()))
    }

    fn processes_where(&self, keep: impl Fn(&Path) -> bool) -> Vec<i32> {
        cgroup_processes(&self.cgroup, keep)
    }
}

impl Drop for RealNode {
    fn drop(&mut self) {
        if std::thread::panicking() {
            eprintln!("{}", self.logs());
        }
        self.stop_kubelet();
        let kill = |pid: i32| {
            let _ =
                nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), nix::sys::signal::Signal::SIGKILL);
        };
        wait_until(Duration::from_secs(20), || {
            let pids = self.pod_processes();
            pids.iter().for_each(|&p| kill(p));
            pids.is_empty()
        });
        // The shims of this node's containerd (they name its socket).
        let sock = format!("{}/containerd.sock", self.dir.path().display());
        processes_naming(&sock).into_iter().filter(|&p| p != std::process::id() as i32).for_each(kill);
        if let Some(c) = self.containerd.take() {
            stop_child(c, Duration::from_secs(10));
        }
        if let Some(mut c) = self.holder.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
        let gone = wait_until(Duration::from_secs(10), || remove_cgroup(&self.cgroup));
        if !gone {
            eprintln!("{}: cgroups /{} not removed", self.name, self.cgroup);
        }
    }
}

/// Connects `ns` to the fabric's bridge as `eth0` with `addr`/24.
fn attach(fabric: &NetNs, ns: &NetNs, fab_if: &str, addr: Ipv4Addr) {
    veth(fabric, fab_if, ns, "eth0");
    fabric.ip(&["link", "set", fab_if, "master", "br-f"]);
    ns.ip(&["addr", "add", &format!("{addr}/24"), "dev", "eth0"]);
}

/// Removes what a test process that no longer runs left behind (one killed by SIGKILL runs no
/// destructor and no handler): see [`sweep`].
fn sweep_dead_nodes() {
    let own = std::process::id();
    sweep(|pid| pid != own && !Path::new(&format!("/proc/{pid}")).exists());
}

/// On SIGINT, SIGTERM or SIGHUP (a Ctrl-C, a runner's timeout), this process's nodes and
/// namespaces are removed ([`sweep`]) before it exits with 130: its destructors would not run.
/// Installed once per process; the handler only writes to a pipe that a thread waits on.
fn remove_own_on_signal() {
    use nix::sys::signal::{SaFlags, SigAction, SigHandler, SigSet, Signal, sigaction};
    use std::os::fd::{IntoRawFd, OwnedFd};
    static PIPE: std::sync::atomic::AtomicI32 = std::sync::atomic::AtomicI32::new(-1);
    static ONCE: std::sync::Once = std::sync::Once::new();
    extern "C" fn handler(_: nix::libc::c_int) {
        let fd = PIPE.load(std::sync::atomic::Ordering::SeqCst);
        // SAFETY: write(2) is async-signal-safe; the fd stays open for the process's life.
        let _ = unsafe { nix::libc::write(fd, b"x".as_ptr().cast(), 1) };
    }
    ONCE.call_once(|| {
        let (read, write): (OwnedFd, OwnedFd) = nix::unistd::pipe().expect("pipe");
        PIPE.store(write.into_raw_fd(), std::sync::atomic::Ordering::SeqCst);
        std::thread::spawn(move || {
            let mut byte = [0u8; 1];
            if nix::unistd::read(&read, &mut byte).is_ok() {
                eprintln!("signal: removing this test process's real nodes and namespaces");
                let own = std::process::id();
                sweep(|pid| pid == own);
                std::process::exit(130);
            }
        });
        let action = SigAction::new(SigHandler::Handler(handler), SaFlags::SA_RESTART, SigSet::empty());
        for sig in [Signal::SIGINT, Signal::SIGTERM, Signal::SIGHUP] {
            // SAFETY: the handler only calls write(2).
            unsafe { sigaction(sig, &action) }.expect("sigaction");
        }
    });
}

/// Removes what the test processes `owner` picks (by pid) made: the processes in their
/// namespaces (`nlb-<tag>-<pid>-<n>`), which are control planes, kubelets, containerds and
/// their shims, and the namespaces; the processes in their nodes' cgroups (pods in their own
/// network namespaces) and the cgroups; their temporary directories (nodes' are named after
/// their namespace, the control plane's and its components' carry the pid).
fn sweep(owner: impl Fn(u32) -> bool) {
    let own = std::process::id() as i32;
    let made_by = |name: &str| {
        let pid = name.strip_prefix("nlb-").and_then(|r| r.split('-').nth(1));
        pid.and_then(|p| p.parse::<u32>().ok()).is_some_and(&owner)
    };
    let kill = |pid: i32| {
        if pid != own {
            let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), nix::sys::signal::SIGKILL);
        }
    };
    let entries = |dir: &Path| -> Vec<String> {
        fs::read_dir(dir)
            .into_iter()
            .flatten()
            .flatten()
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .collect()
    };
    for ns in entries(Path::new("/run/netns")).into_iter().filter(|n| made_by(n)) {
        eprintln!("removing namespace {ns} and what runs in it");
        if let Ok(out) = Command::new("ip").args(["netns", "pids", &ns]).output() {
            String::from_utf8_lossy(&out.stdout)
                .split_whitespace()
                .filter_map(|p| p.parse().ok())
                .for_each(kill);
        }
        let _ = Command::new("ip").args(["netns", "del", &ns]).output();
    }
    let mut cgroups: Vec<String> = entries(Path::new("/sys/fs/cgroup"))
        .into_iter()
        .flat_map(|h| entries(&Path::new("/sys/fs/cgroup").join(h)))
        .filter(|n| n.strip_prefix("nodelb-").is_some_and(made_by))
        .collect();
    cgroups.sort();
    cgroups.dedup();
    for name in cgroups {
        wait_until(Duration::from_secs(10), || {
            let pids = cgroup_processes(&name, |_| true);
            pids.iter().copied().for_each(kill);
            pids.is_empty()
        });
        wait_until(Duration::from_secs(10), || remove_cgroup(&name));
    }
    let made_by_pid = |rest: &str| made_by(&format!("nlb-x-{rest}"));
    let tmp = std::env::temp_dir();
    for dir in entries(&tmp) {
        let ours = dir.strip_prefix("nodelb-node-").is_some_and(made_by)
            || ["nodelb-testkube-", "nodelb-components-"]
                .iter()
                .any(|p| dir.strip_prefix(p).is_some_and(made_by_pid));
        if ours {
            let _ = fs::remove_dir_all(tmp.join(dir));
        }
    }
}

/// The processes of node cgroup `name` (under every hierarchy), in the cgroups `keep` accepts.
fn cgroup_processes(name: &str, keep: impl Fn(&Path) -> bool) -> Vec<i32> {
    let mut pids = Vec::new();
    for dir in cgroup_dirs(name) {
        for entry in walk(&dir).into_iter().filter(|p| keep(p)) {
            if let Ok(text) = fs::read_to_string(entry.join("cgroup.procs")) {
                pids.extend(text.lines().filter_map(|l| l.trim().parse::<i32>().ok()));
            }
        }
    }
    pids.sort_unstable();
    pids.dedup();
    pids
}

/// Processes whose command line contains `text`.
fn processes_naming(text: &str) -> Vec<i32> {
    let Ok(procs) = fs::read_dir("/proc") else { return Vec::new() };
    procs
        .flatten()
        .filter_map(|p| {
            let pid = p.file_name().to_string_lossy().parse::<i32>().ok()?;
            let cmdline = fs::read(p.path().join("cmdline")).ok()?;
            String::from_utf8_lossy(&cmdline).contains(text).then_some(pid)
        })
        .collect()
}

/// SIGTERM, then SIGKILL after `grace`.
fn stop_child(mut c: Child, grace: Duration) {
    let pid = nix::unistd::Pid::from_raw(c.id() as i32);
    let _ = nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM);
    if !wait_until(grace, || c.try_wait().ok().flatten().is_some()) {
        let _ = c.kill();
    }
    let _ = c.wait();
}

fn containerd_config(d: &str) -> String {
    format!(
        r#"version = 2
root = "{d}/containerd/root"
state = "{d}/containerd/state"
# Plugins that would write outside these directories or look for storage this node lacks.
disabled_plugins = ["io.containerd.internal.v1.opt", "io.containerd.snapshotter.v1.btrfs",
  "io.containerd.snapshotter.v1.zfs", "io.containerd.snapshotter.v1.devmapper",
  "io.containerd.snapshotter.v1.aufs", "io.containerd.tracing.processor.v1.otlp"]
[grpc]
  address = "{d}/containerd.sock"
[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "localhost/pause:3.10"
  # No process here may lower its oom_score_adj (no CAP_SYS_RESOURCE).
  restrict_oom_score_adj = true
  netns_mounts_under_state_dir = true
  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "overlayfs"
    default_runtime_name = "runc"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
        SystemdCgroup = false
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "/usr/lib/cni"
    conf_dir = "{d}/cni/net.d"
"#
    )
}

fn kubelet_config(d: &str, cgroup: &str, v4: Ipv4Addr, api: &ControlPlane) -> String {
    let ca = api.data_dir().join("pki/ca.crt");
    format!(
        r#"apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
# These machines' cgroups are v1 (hybrid); kubelet 1.37 refuses them unless told not to.
failCgroupV1: false
cgroupDriver: cgroupfs
cgroupRoot: /{cgroup}
# No process here may lower its oom_score_adj.
oomScoreAdj: 0
containerRuntimeEndpoint: unix://{d}/containerd.sock
address: {v4}
readOnlyPort: 0
healthzBindAddress: 127.0.0.1
authentication:
  anonymous: {{enabled: false}}
  webhook: {{enabled: true}}
  x509: {{clientCAFile: {ca}}}
authorization: {{mode: Webhook}}
failSwapOn: false
# Nothing deleted could be pulled again: no image is collected, nothing evicted for disk.
imageGCHighThresholdPercent: 100
imageGCLowThresholdPercent: 99
evictionHard: {{memory.available: "1Mi", nodefs.available: "1%", imagefs.available: "1%", nodefs.inodesFree: "1%"}}
volumePluginDir: {d}/volume-plugins
rotateCertificates: false
serializeImagePulls: false
syncFrequency: 10s
"#,
        ca = ca.display()
    )
}

/// `/sys/fs/cgroup/<hierarchy>/<name>` for every hierarchy that has it.
fn cgroup_dirs(name: &str) -> Vec<PathBuf> {
    let Ok(rd) = fs::read_dir("/sys/fs/cgroup") else { return Vec::new() };
    rd.flatten().map(|e| e.path().join(name)).filter(|p| p.is_dir()).collect()
}

/// Creates the node's cgroup in every v1 hierarchy (a kubelet's `cgroupRoot` must exist); a
/// new cpuset gets its parent's CPUs and memory nodes, without which no task may join it.
fn make_cgroup(name: &str) {
    let Ok(rd) = fs::read_dir("/sys/fs/cgroup") else { return };
    for h in rd.flatten().map(|e| e.path()) {
        if h.join("cgroup.procs").exists() {
            let _ = fs::create_dir_all(h.join(name));
        }
    }
    let cpuset = Path::new("/sys/fs/cgroup/cpuset");
    for f in ["cpuset.cpus", "cpuset.mems"] {
        if let Ok(v) = fs::read_to_string(cpuset.join(f)) {
            let _ = fs::write(cpuset.join(name).join(f), v.trim());
        }
    }
}

/// Removes the node's cgroups, deepest first; true when none is left.
fn remove_cgroup(name: &str) -> bool {
    for dir in cgroup_dirs(name) {
        let mut all = walk(&dir);
        all.sort_by_key(|p| std::cmp::Reverse(p.components().count()));
        for p in all {
            let _ = fs::remove_dir(&p);
        }
    }
    cgroup_dirs(name).is_empty()
}

/// `dir` and every directory below it.
fn walk(dir: &Path) -> Vec<PathBuf> {
    let mut out = vec![dir.to_path_buf()];
    let mut i = 0;
    while i < out.len() {
        if let Ok(rd) = fs::read_dir(&out[i]) {
            out.extend(rd.flatten().filter(|e| e.file_type().is_ok_and(|t| t.is_dir())).map(|e| e.path()));
        }
        i += 1;
    }
    out
}

fn print_tail(path: &Path, n: usize) {
    let text = fs::read_to_string(path).unwrap_or_default();
    let lines: Vec<&str> = text.lines().collect();
    eprintln!("===== {} (last {n} lines) =====", path.display());
    for l in &lines[lines.len().saturating_sub(n)..] {
        eprintln!("{l}");
    }
}
