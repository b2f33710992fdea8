//! The real Kubernetes control plane for Kubernetes-mode tests: `testkube` (embedded etcd +
//! kube-apiserver + the EndpointSlice controller, built from their Go modules by
//! `scripts/build-testkube.sh`) run as `ip netns exec <api-ns> testkube …`, an admin client, a
//! `kubectl` runner, ServiceAccount-token kubeconfigs for the agents, the audit log as the request
//! log, and the faults the tests inject: stop / restart, SIGSTOP / SIGCONT, TCP connections reset
//! or blackholed (nftables + `ss -K` inside the API namespace), etcd compaction.
//!
//! The process is stopped on drop, also when the test panics (its log is printed then); its data
//! directory is a temporary directory.

use std::collections::BTreeMap;
use std::io::{Read, Write};
use std::net::{IpAddr, Ipv4Addr, SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::sync::OnceLock;
use std::time::Duration;

use k8s_openapi::serde::de::DeserializeOwned;
use kube::api::{Api, DeleteParams, DynamicObject, Patch, PatchParams, PostParams};
use kube::core::{ApiResource, GroupVersionKind};
use serde_json::{Value, json};

use super::netns::NetNs;
use super::topology::wait_until;

/// The ServiceAccount the agents run as (`daemonset/10-rbac.yaml`).
pub const AGENT_USER: &str = "system:serviceaccount:nodelb-system:nodelb";
/// The controller's ServiceAccount, as the API server names its user.
pub const CONTROLLER_USER: &str = "system:serviceaccount:nodelb-system:nodelb-controller";
/// How long a (re)start may take to answer `/readyz` on a loaded 2-core machine.
const START_TIMEOUT: Duration = Duration::from_secs(180);

/// `target/testkube/` with `testkube` and `kubectl`, built (or found up to date) once per test
/// process by `scripts/build-testkube.sh`. `NODELB_TESTKUBE_DIR` points elsewhere.
pub fn testkube_dir() -> PathBuf {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| built_by("NODELB_TESTKUBE_DIR", "scripts/build-testkube.sh")).clone()
}

/// `target/helm/helm`, built (or found up to date) once per test process by
/// `scripts/build-helm.sh`. `NODELB_HELM` points elsewhere.
pub fn helm_bin() -> PathBuf {
    static BIN: OnceLock<PathBuf> = OnceLock::new();
    BIN.get_or_init(|| built_by("NODELB_HELM", "scripts/build-helm.sh")).clone()
}

/// `$env` if set, else what the cached build `script` prints (the path it built).
pub fn built_by(env: &str, script: &str) -> PathBuf {
    if let Some(p) = std::env::var_os(env) {
        return PathBuf::from(p);
    }
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join(script);
    let out = Command::new(&script)
        .stderr(Stdio::inherit())
        .output()
        .unwrap_or_else(|e| panic!("{}: {e}", script.display()));
    assert!(
        out.status.success(),
        "{} failed (see above): the Kubernetes tests need what it builds",
        script.display()
    );
    PathBuf::from(String::from_utf8_lossy(&out.stdout).trim())
}

/// The plural resource name of a kind the tests use.
fn plural(kind: &str) -> String {
    match kind {
        "EndpointSlice" => "endpointslices".into(),
        "ServiceCIDR" => "servicecidrs".into(),
        k if k.ends_with('s') => format!("{}es", k.to_lowercase()),
        k => format!("{}s", k.to_lowercase()),
    }
}

/// Kinds the tests use that are not namespaced.
fn cluster_scoped(kind: &str) -> bool {
    matches!(
        kind,
        "Namespace" | "Node" | "ClusterRole" | "ClusterRoleBinding" | "ServiceCIDR" | "NodePortPool"
    )
}

/// One request in the audit log (the last stage seen of its audit ID).
#[derive(Debug, Clone)]
pub struct RequestRecord {
    pub user: String,
    /// The client's address (first of `sourceIPs`).
    pub peer: IpAddr,
    /// The authorizer's verb: get, list, watch, create, update, patch, delete, …
    pub verb: String,
    /// API group ("" for core), resource and `resource/subresource`, namespace, name.
    pub group: String,
    pub resource: String,
    pub namespace: Option<String>,
    pub name: Option<String>,
    /// The request path without its query.
    pub path: String,
    pub query: String,
    pub watch: bool,
    /// Response code.
    pub status: u16,
    /// `authorization.k8s.io/decision`: "allow" or "forbid".
    pub decision: Option<String>,
    pub field_manager: Option<String>,
}

impl RequestRecord {
    pub fn is_write(&self) -> bool {
        matches!(self.verb.as_str(), "create" | "update" | "patch" | "delete" | "deletecollection")
    }

    fn parse(v: &Value) -> Option<RequestRecord> {
        let s = |x: &Value| x.as_str().map(String::from);
        let uri = v["requestURI"].as_str()?;
        let (path, query) = uri.split_once('?').unwrap_or((uri, ""));
        let obj = &v["objectRef"];
        let resource = match (s(&obj["resource"]), s(&obj["subresource"])) {
            (Some(r), Some(sub)) => format!("{r}/{sub}"),
            (Some(r), None) => r,
            _ => String::new(),
        };
        let field_manager =
            query.split('&').find_map(|kv| kv.strip_prefix("fieldManager=")).map(|m| m.replace("%2F", "/"));
        let verb = s(&v["verb"])?;
        Some(RequestRecord {
            user: s(&v["user"]["username"]).unwrap_or_default(),
            peer: v["sourceIPs"][0].as_str()?.parse().ok()?,
            watch: verb == "watch",
            verb,
            group: s(&obj["apiGroup"]).unwrap_or_default(),
            resource,
            namespace: s(&obj["namespace"]),
            name: s(&obj["name"]),
            path: path.to_string(),
            query: query.to_string(),
            status: v["responseStatus"]["code"].as_u64().unwrap_or(0) as u16,
            decision: s(&v["annotations"]["authorization.k8s.io/decision"]),
            field_manager,
        })
    }
}

pub struct ControlPlane {
    ns_name: String,
    pub bind: Ipv4Addr,
    pub port: u16,
    extra: Vec<String>,
    child: Option<Child>,
    starts: usize,
    control: Option<String>,
    client: Option<kube::Client>,
    /// Audit log lines before this one are "cleared".
    audit_from: usize,
    rt: tokio::runtime::Runtime,
    data: tempfile::TempDir,
}

impl ControlPlane {
    /// Starts testkube in `ns`, the API server on `bind:port`, with extra kube-apiserver flags
    /// (e.g. `--watch-cache=false`), and waits until it is ready.
    pub fn start(ns: &NetNs, bind: Ipv4Addr, port: u16, extra: &[&str]) -> ControlPlane {
        let ns_path = format!("/run/netns/{}", ns.name);
        // The admin client's sockets are opened by this runtime's threads, which live in `ns`.
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .max_blocking_threads(2)
            .enable_all()
            .on_thread_start(move || {
                let f = std::fs::File::open(&ns_path).expect("open netns");
                nix::sched::setns(f, nix::sched::CloneFlags::CLONE_NEWNET).expect("setns");
            })
            .build()
            .expect("tokio runtime");
        let mut cp = ControlPlane {
            ns_name: ns.name.clone(),
            bind,
            port,
            extra: extra.iter().map(|s| s.to_string()).collect(),
            child: None,
            starts: 0,
            control: None,
            client: None,
            audit_from: 0,
            rt,
            // Named with this process's id: a later run removes it if this one is killed.
            data: super::cleanup::temp_dir(&format!("nodelb-testkube-{}-", std::process::id())),
        };
        cp.spawn();
        cp
    }

    pub fn data_dir(&self) -> &Path {
        self.data.path()
    }
    pub fn admin_kubeconfig(&self) -> PathBuf {
        self.data.path().join("admin.kubeconfig")
    }
    pub fn server(&self) -> String {
        format!("https://{}:{}", self.bind, self.port)
    }
    fn log_file(&self) -> PathBuf {
        self.data.path().join("testkube.log")
    }
    pub fn logs(&self) -> String {
        std::fs::read_to_string(self.log_file()).unwrap_or_default()
    }

    fn spawn(&mut self) {
        self.starts += 1;
        let log = std::fs::OpenOptions::new().create(true).append(true).open(self.log_file()).unwrap();
        let mut l = &log;
        let _ = writeln!(l, "===== test harness: testkube start #{} =====", self.starts);
        let offset = log.metadata().unwrap().len() as usize;
        let bin = testkube_dir().join("testkube");
        let mut cmd = Command::new("ip");
        cmd.args(["netns", "exec", &self.ns_name])
            .arg(&bin)
            .arg("--data-dir")
            .arg(self.data.path())
            .args(["--bind-address", &self.bind.to_string(), "--secure-port", &self.port.to_string(), "--"])
            .args(&self.extra)
            .stdin(Stdio::null())
            .stdout(log.try_clone().unwrap())
            .stderr(log);
        self.child = Some(cmd.spawn().expect("spawn testkube"));
        // READY … control=http://127.0.0.1:PORT
        let mut ready = None;
        let mut exited = None;
        let ok = wait_until(START_TIMEOUT, || {
            exited = self.child.as_mut().and_then(|c| c.try_wait().ok().flatten());
            let text = self.logs();
            ready = text
                .get(offset..)
                .and_then(|t| t.lines().find(|l| l.starts_with("READY ")).map(String::from));
            exited.is_some() || ready.is_some()
        });
        assert!(
            ok && exited.is_none(),
            "testkube not ready within {START_TIMEOUT:?} (exited: {exited:?}); log:\n{}",
            self.logs().get(offset..).unwrap_or_default()
        );
        let line = ready.unwrap();
        self.control =
            line.split_whitespace().find_map(|w| w.strip_prefix("control=http://")).map(String::from);
        if self.client.is_none() {
            let path = self.admin_kubeconfig();
            let client = self
                .rt
                .block_on(self.rt.spawn(async move {
                    let kc = kube::config::Kubeconfig::read_from(&path).expect("admin kubeconfig");
                    let cfg =
                        kube::Config::from_custom_kubeconfig(kc, &Default::default()).await.expect("config");
                    kube::Client::try_from(cfg).expect("admin client")
                }))
                .unwrap();
            self.client = Some(client);
        }
    }

    /// SIGTERM and wait for a clean exit (status 0): the API server shuts down, then etcd.
    pub fn stop(&mut self) {
        let Some(mut c) = self.child.take() else { return };
        let pid = nix::unistd::Pid::from_raw(c.id() as i32);
        let _ = nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGCONT);
        let _ = nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM);
        let mut status = None;
        wait_until(Duration::from_secs(60), || {
            status = c.try_wait().ok().flatten();
            status.is_some()
        });
        if status.is_none() {
            let _ = c.kill();
            let _ = c.wait();
        }
        assert!(status.is_some_and(|s| s.success()), "testkube: SIGTERM → {status:?}, log:\n{}", self.logs());
    }

    /// Starts it again on the same data directory (same certificates, tokens and etcd data).
    pub fn restart(&mut self) {
        self.stop();
        self.spawn();
    }

    /// Starts it again after [`ControlPlane::stop`].
    pub fn start_again(&mut self) {
        assert!(self.child.is_none(), "still running");
        self.spawn();
    }

    /// SIGSTOP: the process keeps its sockets but answers nothing (the kernel still accepts TCP
    /// connections into the listen backlog).
    pub fn pause(&self) {
        self.signal(nix::sys::signal::Signal::SIGSTOP);
    }
    /// SIGCONT after [`ControlPlane::pause`].
    pub fn resume(&self) {
        self.signal(nix::sys::signal::Signal::SIGCONT);
    }
    fn signal(&self, sig: nix::sys::signal::Signal) {
        let c = self.child.as_ref().expect("testkube running");
        nix::sys::signal::kill(nix::unistd::Pid::from_raw(c.id() as i32), sig).expect("kill");
    }

    /// Cuts clients off at the TCP level inside the API namespace: every established connection to
    /// the API port is reset (`ss -K`), and new ones from outside the namespace are reset
    /// (`block`, `reject with tcp reset`) or dropped (`blackhole`) until [`ControlPlane::reopen`].
    /// The tests' admin client (loopback inside the namespace) is not affected.
    pub fn cut(&self, mode: Fault) {
        let verdict = match mode {
            Fault::Reset => "reject with tcp reset",
            Fault::Blackhole => "drop",
        };
        let rules = format!(
            "table inet testkube_fault {{\n chain input {{ type filter hook input priority -10; iifname != \"lo\" tcp dport {} {verdict}; }}\n}}\n",
            self.port
        );
        self.ns_exec_stdin("nft", &["-f", "-"], &rules);
        self.ns_exec_ok("ss", &["-K", "-t", "state", "established", &format!("( sport = :{} )", self.port)]);
    }

    /// Ends [`ControlPlane::cut`].
    pub fn reopen(&self) {
        self.ns_exec_ok("nft", &["delete", "table", "inet", "testkube_fault"]);
    }

    /// Compacts etcd's history up to its current revision (POST /compact); returns that revision.
    /// With the API server's watch cache off (`--watch-cache=false`), a watch resumed from an older
    /// resourceVersion gets 410 Gone from etcd; with it on, the cache answers from memory.
    pub fn compact(&self) -> i64 {
        let addr: SocketAddr = self.control.as_deref().expect("control address").parse().unwrap();
        let body = self.rt.block_on(async move {
            tokio::task::spawn_blocking(move || -> std::io::Result<String> {
                let mut s = TcpStream::connect_timeout(&addr, Duration::from_secs(5))?;
                s.set_read_timeout(Some(Duration::from_secs(30)))?;
                write!(s, "POST /compact HTTP/1.0\r\nHost: {addr}\r\nContent-Length: 0\r\n\r\n")?;
                let mut out = String::new();
                s.read_to_string(&mut out)?;
                Ok(out)
            })
            .await
            .unwrap()
        });
        let body = body.expect("POST /compact");
        let json = body.split("\r\n\r\n").nth(1).unwrap_or_default();
        let v: Value = serde_json::from_str(json).unwrap_or_else(|e| panic!("POST /compact: {e}: {body}"));
        v["revision"].as_i64().expect("revision")
    }

    fn ns_exec(&self, program: &str, args: &[&str]) -> Output {
        Command::new("ip")
            .args(["netns", "exec", &self.ns_name, program])
            .args(args)
            .output()
            .unwrap_or_else(|e| panic!("spawn {program}: {e}"))
    }
    fn ns_exec_ok(&self, program: &str, args: &[&str]) -> String {
        let out = self.ns_exec(program, args);
        assert!(out.status.success(), "{program} {args:?}: {}", String::from_utf8_lossy(&out.stderr));
        String::from_utf8_lossy(&out.stdout).into_owned()
    }
    fn ns_exec_stdin(&self, program: &str, args: &[&str], input: &str) -> String {
        let mut child = Command::new("ip")
            .args(["netns", "exec", &self.ns_name, program])
            .args(args)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap_or_else(|e| panic!("spawn {program}: {e}"));
        child.stdin.take().unwrap().write_all(input.as_bytes()).unwrap();
        let out = child.wait_with_output().unwrap();
        assert!(out.status.success(), "{program} {args:?}: {}", String::from_utf8_lossy(&out.stderr));
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    /// `kubectl --kubeconfig <admin> <args>` inside the API namespace (the kubectl built with
    /// testkube, of the same release as the server); the output whatever the exit status.
    pub fn kubectl(&self, args: &[&str]) -> Output {
        let kubectl =
            std::env::var_os("NODELB_KUBECTL").map_or_else(|| testkube_dir().join("kubectl"), PathBuf::from);
        self.admin_tool(&kubectl, args, None)
    }

    /// `helm --kubeconfig <admin> <args>` inside the API namespace ([`helm_bin`]); the output
    /// whatever the exit status.
    pub fn helm(&self, args: &[&str]) -> Output {
        self.admin_tool(&helm_bin(), args, None)
    }

    /// Like [`ControlPlane::helm`], panicking with stderr on failure; returns stdout.
    pub fn helm_ok(&self, args: &[&str]) -> String {
        let out = self.helm(args);
        assert!(out.status.success(), "helm {args:?}: {}", String::from_utf8_lossy(&out.stderr));
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    /// `kubectl <args>` reading `input` on its standard input (`-f -`).
    pub fn kubectl_stdin(&self, args: &[&str], input: &str) -> Output {
        let kubectl =
            std::env::var_os("NODELB_KUBECTL").map_or_else(|| testkube_dir().join("kubectl"), PathBuf::from);
        self.admin_tool(&kubectl, args, Some(input))
    }

    /// A kubeconfig for the user `name` in `groups` (a client certificate of the control plane's
    /// CA, `testkube user`): someone the real authenticator knows and the real authorizer judges.
    pub fn user_kubeconfig(&self, name: &str, groups: &[&str]) -> PathBuf {
        let out = self.data.path().join(format!("user-{name}.kubeconfig"));
        let mut cmd = Command::new(testkube_dir().join("testkube"));
        cmd.args(["user", "--name", name, "--out"]).arg(&out).arg("--data-dir").arg(self.data.path());
        for g in groups {
            cmd.args(["--group", g]);
        }
        let done = cmd.output().expect("testkube user");
        assert!(done.status.success(), "testkube user {name}: {}", String::from_utf8_lossy(&done.stderr));
        out
    }

    /// `kubectl --kubeconfig <kubeconfig> <args>` inside the API namespace: a user's own kubectl.
    pub fn kubectl_as(&self, kubeconfig: &Path, args: &[&str]) -> Output {
        let kubectl =
            std::env::var_os("NODELB_KUBECTL").map_or_else(|| testkube_dir().join("kubectl"), PathBuf::from);
        self.tool_with(&kubectl, kubeconfig, args, None)
    }

    /// [`ControlPlane::kubectl_as`] with `input` on its stdin (`create -f -`).
    pub fn kubectl_as_stdin(&self, kubeconfig: &Path, args: &[&str], input: &str) -> Output {
        let kubectl =
            std::env::var_os("NODELB_KUBECTL").map_or_else(|| testkube_dir().join("kubectl"), PathBuf::from);
        self.tool_with(&kubectl, kubeconfig, args, Some(input))
    }

    /// `program <args>` inside the API namespace as a user's workstation runs it: `KUBECONFIG`
    /// set to `kubeconfig` (a kubectl plugin reads it too), `dir` first on its PATH (where a
    /// kubectl plugin is found).
    pub fn tool_as(&self, program: &Path, kubeconfig: &Path, args: &[&str], dir: Option<&Path>) -> Output {
        let mut path = std::ffi::OsString::new();
        if let Some(dir) = dir {
            path.push(dir);
            path.push(":");
        }
        path.push(std::env::var_os("PATH").unwrap_or_default());
        Command::new("ip")
            .args(["netns", "exec", &self.ns_name])
            .arg(program)
            .args(args)
            .env("PATH", path)
            .env("KUBECONFIG", kubeconfig)
            .stdin(Stdio::null())
            .output()
            .unwrap_or_else(|e| panic!("spawn {}: {e}", program.display()))
    }

    /// The kubectl the tests use.
    pub fn kubectl_path(&self) -> PathBuf {
        std::env::var_os("NODELB_KUBECTL").map_or_else(|| testkube_dir().join("kubectl"), PathBuf::from)
    }

    /// `program --kubeconfig <admin> <args>` inside the API namespace.
    fn admin_tool(&self, program: &Path, args: &[&str], input: Option<&str>) -> Output {
        self.tool_with(program, &self.admin_kubeconfig(), args, input)
    }

    /// `program --kubeconfig <kubeconfig> <args>` inside the API namespace.
    fn tool_with(&self, program: &Path, kubeconfig: &Path, args: &[&str], input: Option<&str>) -> Output {
        let mut child = Command::new("ip")
            .args(["netns", "exec", &self.ns_name])
            .arg(program)
            .arg("--kubeconfig")
            .arg(kubeconfig)
            .args(args)
            .stdin(if input.is_some() { Stdio::piped() } else { Stdio::null() })
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap_or_else(|e| panic!("spawn {}: {e}", program.display()));
        if let Some(input) = input {
            child.stdin.take().unwrap().write_all(input.as_bytes()).unwrap();
        }
        child.wait_with_output().expect("wait")
    }

    /// Like [`ControlPlane::kubectl`], panicking with stderr on failure; returns stdout.
    pub fn kubectl_ok(&self, args: &[&str]) -> String {
        let out = self.kubectl(args);
        assert!(out.status.success(), "kubectl {args:?}: {}", String::from_utf8_lossy(&out.stderr));
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    /// What the README shows a user: `kubectl get svc NAME -o jsonpath=…` of the Service's
    /// allocation annotation, in the default namespace.
    pub fn kubectl_allocated_ports(&self, service: &str) -> String {
        self.kubectl_ok(&[
            "get",
            "svc",
            service,
            "-o",
            r"jsonpath={.metadata.annotations.nodelb\.io/allocated-ports}",
        ])
    }

    /// A kubeconfig with a fresh TokenRequest token of ServiceAccount `ns/sa` (`kubectl create
    /// token`), written to `path`: what the agents use, so the real authorizer judges them.
    pub fn write_sa_kubeconfig(&self, ns: &str, sa: &str, path: &Path) {
        let token = self.kubectl_ok(&["create", "token", sa, "-n", ns, "--duration=24h"]);
        self.write_token_kubeconfig(sa, token.trim(), path);
    }

    /// A kubeconfig with a token of ServiceAccount `sa` bound to Pod `ns/pod`, as the kubelet
    /// gives a pod: the API server puts the Pod's node in it (user extra
    /// `authentication.kubernetes.io/node-name`), and it dies with the Pod. The Pod is created
    /// first if absent (`node`: its spec.nodeName; nothing runs it, no kubelet here).
    pub fn write_pod_kubeconfig(&self, ns: &str, sa: &str, pod: &str, node: Option<&str>, path: &Path) {
        if self.get("v1", "Pod", ns, pod).is_none() {
            let mut spec = json!({
                "serviceAccountName": sa,
                "automountServiceAccountToken": false,
                "containers": [{"name": "nodelb", "image": "nodelb.invalid/test:0"}],
            });
            if let Some(n) = node {
                spec["nodeName"] = json!(n);
            }
            let pod_obj = json!({"apiVersion": "v1", "kind": "Pod",
                "metadata": {"name": pod, "namespace": ns}, "spec": spec});
            self.create(pod_obj).unwrap_or_else(|e| panic!("create Pod {ns}/{pod}: {e}"));
        }
        let token = self.kubectl_ok(&[
            "create",
            "token",
            sa,
            "-n",
            ns,
            "--bound-object-kind",
            "Pod",
            "--bound-object-name",
            pod,
            "--duration=24h",
        ]);
        self.write_token_kubeconfig(sa, token.trim(), path);
    }

    fn write_token_kubeconfig(&self, user: &str, token: &str, path: &Path) {
        let ca = self.data.path().join("pki/ca.crt");
        let cfg = format!(
            "apiVersion: v1\nkind: Config\nclusters:\n- name: testkube\n  cluster:\n    server: {}\n    certificate-authority: {}\nusers:\n- name: {user}\n  user:\n    token: {token}\ncontexts:\n- name: testkube\n  context:\n    cluster: testkube\n    user: {user}\ncurrent-context: testkube\n",
            self.server(),
            ca.display(),
        );
        std::fs::write(path, cfg).unwrap();
    }

    /// The admin client. Its requests must be polled on [`ControlPlane::runtime`], whose threads
    /// live in the API namespace (that is where its connections are opened).
    pub fn client(&self) -> kube::Client {
        self.client.clone().expect("admin client")
    }

    /// The runtime of the admin client (worker threads inside the API namespace).
    pub fn runtime(&self) -> &tokio::runtime::Runtime {
        &self.rt
    }

    fn dynamic(&self, api_version: &str, kind: &str, ns: Option<&str>) -> Api<DynamicObject> {
        let (group, version) = api_version.rsplit_once('/').unwrap_or(("", api_version));
        let gvk = GroupVersionKind::gvk(group, version, kind);
        let ar = ApiResource::from_gvk_with_plural(&gvk, &plural(kind));
        match ns.filter(|_| !cluster_scoped(kind)) {
            Some(ns) => Api::namespaced_with(self.client(), ns, &ar),
            None => Api::all_with(self.client(), &ar),
        }
    }

    /// Runs an admin request, retrying transport errors (a restart, a cut) for up to 20 s; API
    /// errors (status answers) are returned.
    fn call<T: Send + 'static, F>(&self, mut f: impl FnMut() -> F) -> Result<T, kube::Error>
    where
        F: std::future::Future<Output = Result<T, kube::Error>> + Send + 'static,
    {
        let deadline = std::time::Instant::now() + Duration::from_secs(20);
        loop {
            // Spawned: polled by the runtime's threads, whose sockets live in the API namespace.
            let fut = f();
            let task = self.rt.spawn(async move { tokio::time::timeout(Duration::from_secs(10), fut).await });
            let r = self.rt.block_on(task).unwrap();
            match r {
                Ok(Err(kube::Error::Api(e))) => return Err(kube::Error::Api(e)),
                Ok(Ok(v)) => return Ok(v),
                Ok(Err(e)) if std::time::Instant::now() >= deadline => return Err(e),
                Err(_) if std::time::Instant::now() >= deadline => panic!("admin request timed out"),
                _ => std::thread::sleep(Duration::from_millis(200)),
            }
        }
    }

    fn target(obj: &Value) -> (String, String, Option<String>, String) {
        let s = |v: &Value| v.as_str().unwrap_or_default().to_string();
        (
            s(&obj["apiVersion"]),
            s(&obj["kind"]),
            obj["metadata"]["namespace"].as_str().map(String::from).or(Some("default".into())),
            s(&obj["metadata"]["name"]),
        )
    }

    /// Creates `obj` (apiVersion, kind, metadata.namespace or "default").
    pub fn create(&self, obj: Value) -> Result<Value, kube::Error> {
        let (av, kind, ns, _) = Self::target(&obj);
        let api = self.dynamic(&av, &kind, ns.as_deref());
        let o: DynamicObject = serde_json::from_value(obj).expect("object");
        self.call(|| {
            let (api, o) = (api.clone(), o.clone());
            async move { api.create(&PostParams::default(), &o).await }
        })
        .map(|o| serde_json::to_value(o).unwrap())
    }

    /// Replaces `obj` unconditionally (no resourceVersion: last write wins, as `kubectl replace`
    /// of an edited object), or creates it.
    pub fn apply(&self, mut obj: Value) -> Result<Value, kube::Error> {
        let (av, kind, ns, name) = Self::target(&obj);
        if let Some(m) = obj["metadata"].as_object_mut() {
            m.remove("resourceVersion");
            m.remove("managedFields");
        }
        let api = self.dynamic(&av, &kind, ns.as_deref());
        let o: DynamicObject = serde_json::from_value(obj.clone()).expect("object");
        let r = self.call(|| {
            let (api, o, name) = (api.clone(), o.clone(), name.clone());
            async move { api.replace(&name, &PostParams::default(), &o).await }
        });
        match r {
            Err(kube::Error::Api(e)) if e.code == 404 => self.create(obj),
            r => r.map(|o| serde_json::to_value(o).unwrap()),
        }
    }

    /// Replaces the `spec` of `obj` (apiVersion, kind, metadata.name, namespace or "default") with
    /// a JSON merge patch computed against the stored object (fields gone become null), as
    /// `kubectl apply` of an edited object does: custom resources refuse a replace without a
    /// resourceVersion, and their status writers keep changing it.
    pub fn replace_spec(&self, obj: &Value) -> Result<Value, kube::Error> {
        /// The merge patch turning `from` into `to`.
        fn diff(from: &Value, to: &Value) -> Value {
            match (from, to) {
                (Value::Object(f), Value::Object(t)) => {
                    let mut out = serde_json::Map::new();
                    for k in f.keys().filter(|k| !t.contains_key(*k)) {
                        out.insert(k.clone(), Value::Null);
                    }
                    for (k, v) in t {
                        out.insert(k.clone(), f.get(k).map_or_else(|| v.clone(), |old| diff(old, v)));
                    }
                    Value::Object(out)
                }
                _ => to.clone(),
            }
        }
        let (av, kind, ns, name) = Self::target(obj);
        let current = self.get(&av, &kind, ns.as_deref().unwrap_or_default(), &name).unwrap_or_default();
        let patch = serde_json::json!({"spec": diff(&current["spec"], &obj["spec"])});
        let api = self.dynamic(&av, &kind, ns.as_deref());
        self.call(|| {
            let (api, name, patch) = (api.clone(), name.clone(), patch.clone());
            async move { api.patch(&name, &PatchParams::default(), &Patch::Merge(&patch)).await }
        })
        .map(|o| serde_json::to_value(o).unwrap())
    }

    /// JSON merge patch of `status` (the status subresource), as a kubelet or controller writes it.
    pub fn patch_status(&self, api_version: &str, kind: &str, ns: &str, name: &str, patch: Value) {
        let api = self.dynamic(api_version, kind, Some(ns));
        let name = name.to_string();
        self.call(|| {
            let (api, name, patch) = (api.clone(), name.clone(), patch.clone());
            async move { api.patch_status(&name, &PatchParams::default(), &Patch::Merge(&patch)).await }
        })
        .unwrap_or_else(|e| panic!("patch status of {kind} {ns}/{name}: {e}"));
    }

    pub fn get(&self, api_version: &str, kind: &str, namespace: &str, name: &str) -> Option<Value> {
        let api = self.dynamic(api_version, kind, Some(namespace));
        let name = name.to_string();
        self.call(|| {
            let (api, name) = (api.clone(), name.clone());
            async move { api.get_opt(&name).await }
        })
        .ok()
        .flatten()
        .map(|o| serde_json::to_value(o).unwrap())
    }

    pub fn get_typed<K: k8s_openapi::Resource + DeserializeOwned>(
        &self,
        namespace: &str,
        name: &str,
    ) -> Option<K> {
        let v = self.get(K::API_VERSION, K::KIND, namespace, name)?;
        serde_json::from_value(v).ok()
    }

    /// How long after `start` the object `namespace/name` first satisfied `done`, as seen through
    /// a watch on it (one request: its current state, then each change as it comes), or `None`
    /// if it did not within `timeout` of `start`. A poll loop of GETs instead is a quorum read
    /// of etcd each time, and loads the very API server and etcd the benchmark times.
    pub fn watch_until(
        &self,
        (api_version, kind, namespace, name): (&str, &str, &str, &str),
        start: std::time::Instant,
        timeout: Duration,
        done: impl Fn(&Value) -> bool + Send + 'static,
    ) -> Option<Duration> {
        use futures::StreamExt as _;
        let api = self.dynamic(api_version, kind, Some(namespace));
        let params = kube::api::WatchParams::default().fields(&format!("metadata.name={name}"));
        let left = timeout.checked_sub(start.elapsed())?;
        let watch = async move {
            let mut events = api.watch(&params, "0").await.ok()?.boxed();
            while let Some(event) = events.next().await {
                match event.ok()? {
                    kube::core::WatchEvent::Added(o) | kube::core::WatchEvent::Modified(o)
                        if serde_json::to_value(&o).is_ok_and(|v| done(&v)) =>
                    {
                        return Some(start.elapsed());
                    }
                    kube::core::WatchEvent::Error(_) => return None,
                    _ => {}
                }
            }
            None
        };
        // Spawned: polled by the runtime's threads, whose sockets live in the API namespace.
        let task = self.rt.spawn(async move { tokio::time::timeout(left, watch).await });
        self.rt.block_on(task).ok()?.ok()?
    }

    /// Every object of a kind (in `namespace`, or everywhere).
    pub fn list(&self, api_version: &str, kind: &str, namespace: Option<&str>) -> Vec<Value> {
        let api = self.dynamic(api_version, kind, namespace);
        self.call(|| {
            let api = api.clone();
            async move { api.list(&Default::default()).await }
        })
        .map(|l| l.items.into_iter().map(|o| serde_json::to_value(o).unwrap()).collect())
        .unwrap_or_default()
    }

    /// Deletes at once (grace period 0: `kubectl delete --force`), as for a Pod no kubelet runs.
    pub fn delete_now(
        &self,
        api_version: &str,
        kind: &str,
        namespace: &str,
        name: &str,
    ) -> Result<(), kube::Error> {
        let params = DeleteParams { grace_period_seconds: Some(0), ..Default::default() };
        self.delete_with(api_version, kind, namespace, name, params)
    }

    /// The resourceVersion of a list of every object of a kind (where a watch would start).
    pub fn list_version(&self, api_version: &str, kind: &str) -> String {
        let api = self.dynamic(api_version, kind, None);
        self.call(|| {
            let api = api.clone();
            async move { api.list(&Default::default()).await }
        })
        .expect("list")
        .metadata
        .resource_version
        .expect("list resourceVersion")
    }

    pub fn delete(
        &self,
        api_version: &str,
        kind: &str,
        namespace: &str,
        name: &str,
    ) -> Result<(), kube::Error> {
        self.delete_with(api_version, kind, namespace, name, DeleteParams::default())
    }

    fn delete_with(
        &self,
        api_version: &str,
        kind: &str,
        namespace: &str,
        name: &str,
        params: DeleteParams,
    ) -> Result<(), kube::Error> {
        let api = self.dynamic(api_version, kind, Some(namespace));
        let name = name.to_string();
        self.call(|| {
            let (api, name, params) = (api.clone(), name.clone(), params.clone());
            async move { api.delete(&name, &params).await }
        })
        .map(|_| ())
    }

    /// The requests in the audit log since the last [`ControlPlane::clear_requests`], one per
    /// audit ID (its last stage: a watch appears once it has started).
    pub fn requests(&self) -> Vec<RequestRecord> {
        let text = std::fs::read_to_string(self.data.path().join("audit.log")).unwrap_or_default();
        let mut by_id: BTreeMap<String, (usize, RequestRecord)> = BTreeMap::new();
        for (i, line) in text.lines().enumerate().skip(self.audit_from) {
            let Ok(v) = serde_json::from_str::<Value>(line) else { continue };
            let Some(r) = RequestRecord::parse(&v) else { continue };
            let id = v["auditID"].as_str().unwrap_or_default().to_string();
            let first = by_id.get(&id).map_or(i, |(f, _)| *f);
            by_id.insert(id, (first, r));
        }
        let mut out: Vec<(usize, RequestRecord)> = by_id.into_values().collect();
        out.sort_by_key(|(i, _)| *i);
        out.into_iter().map(|(_, r)| r).collect()
    }

    /// The node agents' requests ([`AGENT_USER`]) since the last clear.
    pub fn agent_requests(&self) -> Vec<RequestRecord> {
        self.requests().into_iter().filter(|r| r.user == AGENT_USER).collect()
    }

    /// The controller's requests ([`CONTROLLER_USER`]) since the last clear.
    pub fn controller_requests(&self) -> Vec<RequestRecord> {
        self.requests().into_iter().filter(|r| r.user == CONTROLLER_USER).collect()
    }

    /// Forget the requests logged so far.
    pub fn clear_requests(&mut self) {
        let text = std::fs::read_to_string(self.data.path().join("audit.log")).unwrap_or_default();
        self.audit_from = text.lines().count();
    }
}

/// How [`ControlPlane::cut`] treats new connections.
#[derive(Debug, Clone, Copy)]
pub enum Fault {
    /// Refused at once (TCP reset).
    Reset,
    /// Dropped: the client waits for its timeout.
    Blackhole,
}

impl Drop for ControlPlane {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let pid = nix::unistd::Pid::from_raw(c.id() as i32);
            let _ = nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGCONT);
            let _ = nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM);
            let done = wait_until(Duration::from_secs(20), || c.try_wait().ok().flatten().is_some());
            if !done {
                let _ = c.kill();
                let _ = c.wait();
            }
        }
        if std::thread::panicking() {
            let log = self.logs();
            let tail: Vec<&str> = log.lines().rev().take(200).collect();
            eprintln!("===== testkube log (last 200 lines, {}) =====", self.ns_name);
            for l in tail.into_iter().rev() {
                eprintln!("{l}");
            }
            eprintln!("===== end of testkube log =====");
        }
    }
}

/// The container `nodelb` of the DaemonSet as stored by the server: its args and its environment,
/// with `fieldRef`s resolved for a Pod on `node` in `namespace` (what the kubelet would do).
pub fn daemonset_command(ds: &Value, node: &str, namespace: &str) -> super::agent::ContainerCommand {
    container_command(ds, &[("spec.nodeName", node), ("metadata.namespace", namespace)])
}

/// The args and environment of the controller's container in `deployment`, as its pod `pod`
/// in `namespace` runs them (fieldRefs metadata.name and metadata.namespace resolved).
pub fn controller_command(deployment: &Value, pod: &str, namespace: &str) -> super::agent::ContainerCommand {
    container_command(deployment, &[("metadata.name", pod), ("metadata.namespace", namespace)])
}

/// Container `nodelb` of a workload's pod template: its args, and its environment with the
/// downward API's `fields` (fieldPath → value) resolved.
fn container_command(workload: &Value, fields: &[(&str, &str)]) -> super::agent::ContainerCommand {
    let containers = workload["spec"]["template"]["spec"]["containers"].as_array().expect("containers");
    let c = containers.iter().find(|c| c["name"] == "nodelb").expect("container nodelb");
    let args: Vec<String> =
        c["args"].as_array().into_iter().flatten().filter_map(|a| a.as_str().map(String::from)).collect();
    let mut env = Vec::new();
    for e in c["env"].as_array().into_iter().flatten() {
        let name = e["name"].as_str().expect("env name").to_string();
        let value = if let Some(v) = e["value"].as_str() {
            v.to_string()
        } else {
            let path = e["valueFrom"]["fieldRef"]["fieldPath"].as_str();
            match fields.iter().find(|(f, _)| Some(*f) == path) {
                Some((_, v)) => v.to_string(),
                None => panic!("env {name}: fieldRef {path:?} not understood by the test harness"),
            }
        };
        env.push((name, value));
    }
    (args, env)
}

/// `{"apiVersion": "v1", "kind": "Namespace", …}`
pub fn namespace(name: &str) -> Value {
    json!({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name}})
}
