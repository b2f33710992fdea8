//! A three-node "cluster" for Kubernetes-mode tests: a real control plane (`testkube`: etcd +
//! kube-apiserver + the EndpointSlice controller, see `kube.rs`) in its own namespace, installed
//! with `kubectl apply -f daemonset/` (or `helm install`) exactly as a user does, three node
//! namespaces each running a real `nodelb run` with the DaemonSet's arguments and environment
//! and a token of the `nodelb` ServiceAccount bound to a Pod on that node (so the real
//! authorizer enforces `daemonset/10-rbac.yaml` and the admission policy
//! `daemonset/15-admission-policy.yaml` sees the node), two controller namespaces each running a
//! `nodelb controller` replica with the Deployment's arguments and a token of the
//! `nodelb-controller` ServiceAccount bound to its Pod, a client namespace, and backend
//! namespaces, all on two bridges inside a "fabric" namespace. Only documentation addresses;
//! nothing in the host namespace.
//!
//! ```text
//!                 fabric netns: bridge br-f 203.0.113.0/24          bridge br-b 198.51.100.0/24
//!  api     eth0 203.0.113.100 ─┤   (kube-apiserver on :6443)
//!  client  eth0 203.0.113.10  ─┤
//!  ctl-K   eth0 203.0.113.20K ─┤   (K = 1, 2: controller replicas)
//!  node-N  eth0 203.0.113.N   ─┤   eth1 198.51.100.N ─┤            (N = 1..3, forwarding on)
//!                                  backend j eth0 198.51.100.(11+j) ─┤  (default via node-1)
//! ```
//!
//! Cluster policy masquerades, so replies come back through the node that DNATed. Backends route
//! via node-1, so `externalTrafficPolicy: Local` traffic (client address kept) works through node-1.
//! Everything is killed / stopped / deleted on drop, also when the test panics (agents' and the
//! control plane's logs are printed then). The request log is the API server's audit log: agents
//! and controller replicas are told apart by their client address.

use std::collections::{BTreeMap, BTreeSet};
use std::net::{IpAddr, Ipv4Addr};
use std::path::PathBuf;
use std::time::Duration;

use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::Service;
use serde_json::{Value, json};

use super::agent::{Agent, nft_list};
use super::kube::{ControlPlane, daemonset_command};
use super::manifest::{EndpointSpec, PortSpec, ServiceSpec};
use super::netns::{NetNs, veth};
use super::topology::{
    BACKEND_TCP_PORT, BACKEND_UDP_PORT, Backend, ClientError, Servers, backend_v4, backend_v6, http_get,
    wait_until,
};

pub const API_V4: Ipv4Addr = Ipv4Addr::new(203, 0, 113, 100);
pub const API_PORT: u16 = 6443;
pub const CLIENT_V4: Ipv4Addr = Ipv4Addr::new(203, 0, 113, 10);
/// The agents' namespace (Leases).
pub const AGENT_NS: &str = "nodelb-system";
pub const LEADER_LEASE: &str = "nodelb-leader";
pub const LEASE_DURATION: &str = "3s";
pub const ANNOTATION_ALLOCATED: &str = "nodelb.io/allocated-ports";

/// Controller replicas the harness runs (the Deployment's default).
pub const CONTROLLERS: usize = 2;

/// Address of controller replica `k` (0-based: 203.0.113.201, .202).
pub fn controller_v4(k: usize) -> Ipv4Addr {
    Ipv4Addr::new(203, 0, 113, 201 + k as u8)
}

/// The pod name (and leader-election identity) of controller replica `k`.
pub fn controller_name(k: usize) -> String {
    format!("nodelb-controller-{}", k + 1)
}

/// The flags of `config.*` that the controller reads too (the chart gives both workloads the
/// same environment): a test's agent flags among these go to the controller as well.
const SHARED_FLAGS: &[&str] = &[
    "--port-range",
    "--load-balancer-class",
    "--ignore-unclassed",
    "--servicelb-labels",
    "--allow-node-endpoints",
    "--allowed-node-ports",
    "--endpoint-cidrs",
    "--lease-duration",
    "--metrics-addr",
    "--metrics-token-audiences",
];

/// Address of node `i` (0-based: node-1 is 203.0.113.1).
pub fn node_v4(i: usize) -> Ipv4Addr {
    Ipv4Addr::new(203, 0, 113, 1 + i as u8)
}
/// Address of node `i` on the backend bridge.
pub fn node_backend_v4(i: usize) -> Ipv4Addr {
    Ipv4Addr::new(198, 51, 100, 1 + i as u8)
}
/// `node-1`, `node-2`, … for index 0, 1, …
pub fn node_name(i: usize) -> String {
    format!("node-{}", i + 1)
}

/// How nodelb is installed into the control plane.
#[derive(Debug, Clone)]
pub enum Install {
    /// `kubectl apply -f daemonset/`.
    Kubectl,
    /// `helm install nodelb charts/nodelb -n nodelb-system --create-namespace <args>`.
    Helm(Vec<String>),
    /// `helm install` of the previous release's chart, its agents running its binary
    /// (`scripts/build-previous.sh`): what an upgrade starts from.
    Previous,
}

/// The previous release (`scripts/build-previous.sh`): the directory with its `nodelb` binary
/// and `charts/nodelb`. `NODELB_PREVIOUS_DIR` points elsewhere.
pub fn previous_release() -> PathBuf {
    static DIR: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();
    DIR.get_or_init(|| super::kube::built_by("NODELB_PREVIOUS_DIR", "scripts/build-previous.sh")).clone()
}

/// `default/<name>`, `80/TCP` → backends `eps` (backend index, node index).
pub fn web(name: &str, eps: &[(usize, usize)]) -> ServiceSpec {
    ServiceSpec::new(name).port(PortSpec::tcp(80, None)).endpoints(
        eps.iter().map(|(b, n)| EndpointSpec::remote(super::topology::backend_v4(*b), &node_name(*n))),
    )
}

/// The chart, for `helm install` / `helm upgrade`.
pub fn chart_dir() -> String {
    concat!(env!("CARGO_MANIFEST_DIR"), "/charts/nodelb").to_string()
}

pub struct Cluster {
    // Drop order matters: agents and controllers first (killed), then the API server, then
    // backend servers, then the namespaces.
    pub agents: Vec<Agent>,
    pub controllers: Vec<Agent>,
    pub api: ControlPlane,
    pub backends: Vec<Backend>,
    kubeconfig_dir: tempfile::TempDir,
    /// What every agent runs with beyond the DaemonSet's args and env.
    agent_args: Vec<String>,
    pub client: NetNs,
    pub nodes: Vec<NetNs>,
    pub controller_ns: Vec<NetNs>,
    pub api_ns: NetNs,
    pub fabric: NetNs,
}

impl Cluster {
    /// Builds the namespaces, starts the API server with the `nodelb-system` namespace and Nodes
    /// node-1..3 (InternalIP 203.0.113.N), starts `backends` backends and the three agents, and waits
    /// until every agent is ready.
    pub fn new(backends: usize) -> Cluster {
        Self::with_agent_args(backends, &[])
    }

    pub fn with_agent_args(backends: usize, extra: &[&str]) -> Cluster {
        Self::with_nodes(3, backends, extra)
    }

    /// `nodes_n` nodes (node-1 … node-`nodes_n`, at most 9), each with its agent; see [`Cluster::new`].
    pub fn with_nodes(nodes_n: usize, backends: usize, extra: &[&str]) -> Cluster {
        Self::start(nodes_n, backends, extra, &[], |_| {}, true, Install::Kubectl)
    }

    /// Three nodes, with extra kube-apiserver flags (e.g. `--watch-cache=false`).
    pub fn with_apiserver_args(backends: usize, apiserver: &[&str]) -> Cluster {
        Self::start(3, backends, &[], apiserver, |_| {}, true, Install::Kubectl)
    }

    /// Three nodes, nodelb installed with `helm install` (`helm_args`: e.g. `--set …`), agents
    /// with `extra` beyond the DaemonSet's args and env.
    pub fn with_helm(backends: usize, helm_args: &[&str], extra: &[&str]) -> Cluster {
        let install = Install::Helm(helm_args.iter().map(|s| s.to_string()).collect());
        Self::start(3, backends, extra, &[], |_| {}, true, install)
    }

    /// Three nodes with the previous release installed (`helm install` of its chart, its agents
    /// running its binary, no controller: it had none), for an upgrade to start from.
    pub fn with_previous_release(backends: usize) -> Cluster {
        Self::start(3, backends, &[], &[], |_| {}, true, Install::Previous)
    }

    /// Three nodes; `setup` runs against the control plane after the install and before the
    /// agents start (objects that exist when they come up, RBAC changes), and the agents are not
    /// waited for (they may not be able to become ready).
    pub fn with_api_setup(backends: usize, setup: impl FnOnce(&ControlPlane)) -> Cluster {
        Self::start(3, backends, &[], &[], setup, false, Install::Kubectl)
    }

    fn start(
        nodes_n: usize,
        backends: usize,
        extra: &[&str],
        apiserver: &[&str],
        setup: impl FnOnce(&ControlPlane),
        wait_ready: bool,
        install: Install,
    ) -> Cluster {
        let fabric = NetNs::new("fab");
        for br in ["br-f", "br-b"] {
            fabric.ip(&["link", "add", br, "type", "bridge"]);
            fabric.ip(&["link", "set", br, "up"]);
        }
        let attach = |ns: &NetNs, fab_if: &str, br: &str, ns_if: &str, addr: Ipv4Addr| {
            veth(&fabric, fab_if, ns, ns_if);
            fabric.ip(&["link", "set", fab_if, "master", br]);
            ns.ip(&["addr", "add", &format!("{addr}/24"), "dev", ns_if]);
        };

        let api_ns = NetNs::new("api");
        attach(&api_ns, "api", "br-f", "eth0", API_V4);
        let client = NetNs::new("kcl");
        attach(&client, "cl", "br-f", "eth0", CLIENT_V4);
        let mut nodes = Vec::new();
        for i in 0..nodes_n {
            let ns = NetNs::new(&format!("kn{}", i + 1));
            attach(&ns, &format!("n{i}f"), "br-f", "eth0", node_v4(i));
            attach(&ns, &format!("n{i}b"), "br-b", "eth1", node_backend_v4(i));
            ns.sysctl("net.ipv4.ip_forward", "1");
            ns.sysctl("net.ipv6.conf.all.forwarding", "1");
            nodes.push(ns);
        }
        let mut controller_ns = Vec::new();
        for k in 0..CONTROLLERS {
            let ns = NetNs::new(&format!("kctl{}", k + 1));
            attach(&ns, &format!("c{k}f"), "br-f", "eth0", controller_v4(k));
            controller_ns.push(ns);
        }
        let mut bs = Vec::new();
        for j in 0..backends {
            let ns = NetNs::new(&format!("kbe{}", j + 1));
            attach(&ns, &format!("b{j}"), "br-b", "eth0", backend_v4(j));
            ns.ip(&["route", "add", "default", "via", &node_backend_v4(0).to_string()]);
            let name = format!("be{}", j + 1);
            let servers = Servers::start(&ns, &name, BACKEND_TCP_PORT, BACKEND_UDP_PORT);
            bs.push(Backend { name, v4: backend_v4(j), v6: backend_v6(j), servers: Some(servers), ns });
        }

        let api = ControlPlane::start(&api_ns, API_V4, API_PORT, apiserver);
        // Installed as a user does it.
        match &install {
            Install::Kubectl => {
                let manifests = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("daemonset");
                api.kubectl_ok(&["apply", "-f", manifests.to_str().unwrap()]);
            }
            Install::Previous => {
                let chart = previous_release().join("charts/nodelb");
                let chart = chart.to_str().unwrap();
                api.helm_ok(&["install", "nodelb", chart, "-n", AGENT_NS, "--create-namespace"]);
            }
            Install::Helm(args) => {
                let chart = chart_dir();
                let mut cmd = vec!["install", "nodelb", &chart, "-n", AGENT_NS, "--create-namespace"];
                cmd.extend(args.iter().map(String::as_str));
                api.helm_ok(&cmd);
            }
        }
        for i in 0..nodes_n {
            // Registered as a kubelet does: the Node, then its status (addresses).
            api.create(json!({
                "apiVersion": "v1", "kind": "Node",
                "metadata": {"name": node_name(i), "labels": {"kubernetes.io/hostname": node_name(i)}},
            }))
            .expect("create node");
            api.patch_status(
                "v1",
                "Node",
                "",
                &node_name(i),
                json!({"status": {"addresses": [
                    {"type": "InternalIP", "address": node_v4(i).to_string()},
                    {"type": "Hostname", "address": node_name(i)},
                ]}}),
            );
        }
        setup(&api);
        let kubeconfig_dir = super::cleanup::temp_dir("nodelb-kube-");
        let mut agent_args = vec!["--lease-duration".to_string(), LEASE_DURATION.to_string()];
        agent_args.extend(extra.iter().map(|s| s.to_string()));
        let mut c = Cluster {
            agents: Vec::new(),
            controllers: Vec::new(),
            api,
            backends: bs,
            kubeconfig_dir,
            agent_args,
            client,
            nodes,
            controller_ns,
            api_ns,
            fabric,
        };
        let first = match install {
            Install::Previous => Some(previous_release().join("nodelb").to_str().unwrap().to_string()),
            _ => super::agent::upgrade_from(),
        };
        for i in 0..nodes_n {
            let a = c.new_agent(i, first.clone());
            c.agents.push(a);
        }
        // An earlier release may have had no controller.
        if c.api.get("apps/v1", "Deployment", AGENT_NS, "nodelb-controller").is_some() {
            c.start_controllers(None);
        }
        if wait_ready {
            c.wait_ready(Duration::from_secs(60));
        }
        c
    }

    /// Waits until every agent is ready and its node Lease says which families it serves (it is
    /// written a moment after readiness; until then the leader rightly sees no serving node).
    pub fn wait_ready(&mut self, timeout: Duration) {
        for a in self.agents.iter_mut().chain(&mut self.controllers) {
            a.wait_ready(timeout);
        }
        let families = |i: usize| -> Option<String> {
            let lease = self.api.get_typed::<Lease>(AGENT_NS, &format!("nodelb-node-{}", node_name(i)))?;
            lease.metadata.annotations?.get("nodelb.io/families").cloned()
        };
        let ok =
            wait_until(timeout, || (0..self.nodes.len()).all(|i| families(i).is_some_and(|f| !f.is_empty())));
        assert!(
            ok,
            "node Leases do not list served families: {:?}",
            (0..self.nodes.len()).map(families).collect::<Vec<_>>()
        );
    }

    /// The DaemonSet `nodelb-system/nodelb` as stored.
    pub fn daemonset(&self) -> Value {
        self.api.get("apps/v1", "DaemonSet", AGENT_NS, "nodelb").expect("DaemonSet nodelb-system/nodelb")
    }

    /// A new agent for node `i`, as the kubelet starts the DaemonSet's pod: the stored
    /// DaemonSet's args and env, a fresh token of the `nodelb` ServiceAccount.
    /// Starts node `i`'s agent from the DaemonSet as stored; `binary`: another binary than the
    /// one under test.
    fn new_agent(&self, i: usize, binary: Option<String>) -> Agent {
        self.new_agent_with(i, binary, &[])
    }

    /// [`Cluster::new_agent`] with `extra` arguments for this node's agent alone (a node pool
    /// whose DaemonSet runs with other flags).
    fn new_agent_with(&self, i: usize, binary: Option<String>, extra: &[&str]) -> Agent {
        let kubeconfig = self.kubeconfig(i);
        let pod = format!("nodelb-{}", node_name(i));
        self.api.write_pod_kubeconfig(AGENT_NS, "nodelb", &pod, Some(&node_name(i)), &kubeconfig);
        let cmd = daemonset_command(&self.daemonset(), &node_name(i), AGENT_NS);
        let mut args: Vec<&str> = self.agent_args.iter().map(String::as_str).collect();
        args.extend_from_slice(extra);
        Agent::start_daemonset(&self.nodes[i], &kubeconfig, &node_name(i), cmd, &args, binary)
    }

    /// The Deployment `nodelb-system/nodelb-controller` as stored.
    pub fn deployment(&self) -> Value {
        self.api
            .get("apps/v1", "Deployment", AGENT_NS, "nodelb-controller")
            .expect("Deployment nodelb-system/nodelb-controller")
    }

    /// Starts controller replica `k` from the Deployment as stored, with a token bound to its
    /// Pod; the test's flags that the controller shares with the agents ([`SHARED_FLAGS`]) too.
    fn new_controller(&self, k: usize, binary: Option<String>) -> Agent {
        let kubeconfig = self.kubeconfig_dir.path().join(format!("{}.kubeconfig", controller_name(k)));
        self.api.write_pod_kubeconfig(AGENT_NS, "nodelb-controller", &controller_name(k), None, &kubeconfig);
        let cmd = super::kube::controller_command(&self.deployment(), &controller_name(k), AGENT_NS);
        let mut shared = Vec::new();
        let mut it = self.agent_args.iter().peekable();
        while let Some(a) = it.next() {
            let flag = a.split('=').next().unwrap_or(a);
            if !SHARED_FLAGS.contains(&flag) {
                continue;
            }
            shared.push(a.as_str());
            let takes_value = !a.contains('=') && it.peek().is_some_and(|v| !v.starts_with("--"));
            if takes_value {
                shared.push(it.next().unwrap().as_str());
            }
        }
        Agent::start_controller(
            &self.controller_ns[k],
            &kubeconfig,
            &controller_name(k),
            cmd,
            &shared,
            binary,
        )
    }

    /// Starts every controller replica from the Deployment as stored (after an upgrade that
    /// brought it, or at the start), without waiting; `binary`: another binary than the one
    /// under test.
    pub fn start_controllers(&mut self, binary: Option<String>) {
        for k in 0..CONTROLLERS {
            let ctl = self.new_controller(k, binary.clone());
            match self.controllers.get_mut(k) {
                Some(old) => *old = ctl,
                None => self.controllers.push(ctl),
            }
        }
    }

    /// Stops controller replica `k` as the kubelet stops its pod (SIGTERM, SIGKILL after `grace`).
    pub fn stop_controller(&mut self, k: usize, grace: Duration) -> Option<std::process::ExitStatus> {
        self.controllers[k].terminate(grace)
    }

    /// Starts controller replica `k` again from the Deployment as stored now, and waits until
    /// it is ready.
    pub fn start_controller(&mut self, k: usize, timeout: Duration) {
        self.controllers[k] = self.new_controller(k, None);
        self.controllers[k].wait_ready(timeout);
    }

    /// Stops agent `i` as the kubelet stops a pod: SIGTERM, then SIGKILL after `grace` (the
    /// pod's terminationGracePeriodSeconds). The exit status, if it exited by itself.
    pub fn stop_agent(&mut self, i: usize, grace: Duration) -> Option<std::process::ExitStatus> {
        self.agents[i].terminate(grace)
    }

    /// Starts node `i`'s agent again after [`Cluster::stop_agent`], from the DaemonSet as it is
    /// stored now (a rolling update's new template), and waits until it is ready (the readiness
    /// probe the DaemonSet controller waits for before the next node).
    pub fn start_agent(&mut self, i: usize, timeout: Duration) {
        self.agents[i] = self.new_agent(i, None);
        self.agents[i].wait_ready(timeout);
    }

    /// Replaces node `i`'s agent with one run with `extra` arguments besides everyone's, and
    /// waits until it is ready.
    pub fn restart_agent_with(&mut self, i: usize, extra: &[&str], timeout: Duration) {
        let grace = self.grace_period();
        self.stop_agent(i, grace);
        self.agents[i] = self.new_agent_with(i, None, extra);
        self.agents[i].wait_ready(timeout);
    }

    /// The DaemonSet's terminationGracePeriodSeconds.
    pub fn grace_period(&self) -> Duration {
        let ds = self.daemonset();
        let secs = ds["spec"]["template"]["spec"]["terminationGracePeriodSeconds"].as_u64().unwrap_or(30);
        Duration::from_secs(secs)
    }

    /// The kubeconfig (ServiceAccount token) agent `i` runs with.
    pub fn kubeconfig(&self, i: usize) -> PathBuf {
        self.kubeconfig_dir.path().join(format!("{}.kubeconfig", node_name(i)))
    }

    /// Creates the Service and its EndpointSlices in the API server. The Service has no selector:
    /// its slices are the test's own (a selector would make the EndpointSlice controller add its
    /// own, empty, slice; see [`Cluster::create_with_pods`]).
    pub fn create(&self, spec: &ServiceSpec) {
        let mut svc = spec.service();
        svc["spec"].as_object_mut().unwrap().remove("selector");
        self.api.create(svc).unwrap_or_else(|e| panic!("create {}: {e:?}", spec.key()));
        for s in spec.slices() {
            self.api.create(s).unwrap_or_else(|e| panic!("create slice of {}: {e:?}", spec.key()));
        }
    }

    /// Creates the Service with its selector and, instead of EndpointSlices, one Pod per endpoint
    /// on its node, whose status the test writes as a kubelet would (IP, Running, Ready): the
    /// EndpointSlice controller makes the slices. See [`Cluster::update_pods`].
    pub fn create_with_pods(&self, spec: &ServiceSpec) {
        // The ServiceAccount admission plugin wants `default` (kube-controller-manager's
        // ServiceAccount controller, not run here, would create it).
        if self.api.get("v1", "ServiceAccount", &spec.namespace, "default").is_none() {
            self.api
                .create(json!({"apiVersion": "v1", "kind": "ServiceAccount",
                    "metadata": {"name": "default", "namespace": spec.namespace}}))
                .expect("ServiceAccount default");
        }
        self.api.create(spec.service()).unwrap_or_else(|e| panic!("create {}: {e:?}", spec.key()));
        self.update_pods(spec);
    }

    /// Makes the Pods of `spec` what it says now: one per endpoint (created, status written as a
    /// kubelet would, ready or not), others deleted (force: no kubelet confirms a deletion).
    pub fn update_pods(&self, spec: &ServiceSpec) {
        let pod_name = |addr: &IpAddr| format!("{}-{}", spec.name, addr.to_string().replace(['.', ':'], "-"));
        let want: BTreeSet<String> = spec.endpoints.iter().map(|e| pod_name(&e.addr)).collect();
        for pod in self.api.list("v1", "Pod", Some(&spec.namespace)) {
            let name = pod["metadata"]["name"].as_str().unwrap_or_default().to_string();
            if pod["metadata"]["labels"]["app"] == spec.name.as_str() && !want.contains(&name) {
                self.api.delete_now("v1", "Pod", &spec.namespace, &name).expect("delete pod");
            }
        }
        let ports: Vec<Value> = spec
            .ports
            .iter()
            .map(|p| json!({"containerPort": p.target_port, "protocol": p.protocol}))
            .collect();
        for e in &spec.endpoints {
            let name = pod_name(&e.addr);
            if self.api.get("v1", "Pod", &spec.namespace, &name).is_none() {
                self.api
                    .create(json!({
                        "apiVersion": "v1", "kind": "Pod",
                        "metadata": {"name": name, "namespace": spec.namespace, "labels": {"app": spec.name}},
                        "spec": {"nodeName": e.node, "containers": [{"name": "backend", "image": "backend", "ports": ports}]},
                    }))
                    .unwrap_or_else(|err| panic!("create pod {name}: {err:?}"));
            }
            let ready = if e.ready { "True" } else { "False" };
            self.api.patch_status(
                "v1",
                "Pod",
                &spec.namespace,
                &name,
                json!({"status": {
                    "phase": "Running",
                    "podIP": e.addr.to_string(),
                    "podIPs": [{"ip": e.addr.to_string()}],
                    "conditions": [{"type": "Ready", "status": ready}],
                }}),
            );
        }
    }

    /// Replaces the EndpointSlices of `spec` (unconditionally) with what `spec` says now.
    pub fn update_slices(&self, spec: &ServiceSpec) {
        for s in spec.slices() {
            self.api.apply(s).unwrap_or_else(|e| panic!("update slice of {}: {e:?}", spec.key()));
        }
    }

    pub fn service(&self, name: &str) -> Option<Service> {
        self.api.get_typed::<Service>("default", name)
    }

    /// The raw Service object (JSON).
    pub fn service_json(&self, name: &str) -> Option<Value> {
        self.service_json_in("default", name)
    }

    /// The raw Service object `namespace/name` (JSON).
    pub fn service_json_in(&self, namespace: &str, name: &str) -> Option<Value> {
        self.api.get("v1", "Service", namespace, name)
    }

    /// `nodelb.io/allocated-ports` of `default/name`, parsed (`"80/TCP" → 20001`).
    pub fn allocated(&self, name: &str) -> Option<BTreeMap<String, u16>> {
        self.allocated_in("default", name)
    }

    /// `nodelb.io/allocated-ports` of `namespace/name`, parsed.
    pub fn allocated_in(&self, namespace: &str, name: &str) -> Option<BTreeMap<String, u16>> {
        let svc = self.service_json_in(namespace, name)?;
        let value = svc["metadata"]["annotations"][ANNOTATION_ALLOCATED].as_str()?.to_string();
        Some(parse_ports(&value))
    }

    /// A user of the cluster who may do, in `namespace` (created if need be), what the built-in
    /// `edit` ClusterRole allows (a RoleBinding there), and nothing else: the kubeconfig of a
    /// client certificate the real authenticator and authorizer judge.
    pub fn tenant(&self, user: &str, namespace: &str) -> PathBuf {
        if self.api.get("v1", "Namespace", "", namespace).is_none() {
            self.api.create(super::kube::namespace(namespace)).expect("tenant namespace");
        }
        self.api
            .create(json!({
                "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
                "metadata": {"name": format!("{user}-edit"), "namespace": namespace},
                "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": "edit"},
                "subjects": [{"apiGroup": "rbac.authorization.k8s.io", "kind": "User", "name": user}],
            }))
            .expect("RoleBinding to edit");
        let kubeconfig = self.api.user_kubeconfig(user, &[]);
        // `edit` is aggregated from other roles by a controller: wait until it grants what it does.
        let granted = super::topology::wait_until(Duration::from_secs(30), || {
            let out =
                self.api.kubectl_as(&kubeconfig, &["auth", "can-i", "patch", "services", "-n", namespace]);
            String::from_utf8_lossy(&out.stdout).trim() == "yes"
        });
        assert!(granted, "{user} may not patch Services in {namespace} through the edit ClusterRole");
        kubeconfig
    }

    /// Waits until `default/name` has an allocation covering `ports` ports; returns it.
    pub fn wait_allocated(&self, name: &str, ports: usize, timeout: Duration) -> BTreeMap<String, u16> {
        let mut got = None;
        let ok = wait_until(timeout, || {
            got = self.allocated(name).filter(|a| a.len() == ports);
            got.is_some()
        });
        assert!(
            ok,
            "default/{name} not allocated within {timeout:?}: {:#}",
            self.service_json(name).unwrap_or_default()
        );
        got.unwrap()
    }

    /// `status.loadBalancer.ingress` of `default/name`.
    pub fn ingress(&self, name: &str) -> Vec<Value> {
        self.service_json(name)
            .and_then(|s| s["status"]["loadBalancer"]["ingress"].as_array().cloned())
            .unwrap_or_default()
    }

    /// The ingress IPs of `default/name`, sorted.
    pub fn ingress_ips(&self, name: &str) -> Vec<String> {
        let mut ips: Vec<String> =
            self.ingress(name).iter().filter_map(|i| i["ip"].as_str().map(String::from)).collect();
        ips.sort();
        ips
    }

    /// Waits until the ingress IPs of `default/name` are exactly `want` (node indexes).
    pub fn wait_ingress_nodes(&self, name: &str, want: &[usize], timeout: Duration) {
        let mut want: Vec<String> = want.iter().map(|i| node_v4(*i).to_string()).collect();
        want.sort();
        let ok = wait_until(timeout, || self.ingress_ips(name) == want);
        assert!(
            ok,
            "default/{name}: ingress not {want:?} within {timeout:?}: {:#}",
            self.service_json(name).unwrap_or_default()
        );
    }

    /// The condition `nodelb.io/Allocated` of `default/name`.
    pub fn allocated_condition(&self, name: &str) -> Option<Value> {
        self.condition(name, "nodelb.io/Allocated")
    }

    /// The condition of type `type_` of `default/name`.
    pub fn condition(&self, name: &str, type_: &str) -> Option<Value> {
        self.condition_in("default", name, type_)
    }

    /// The condition of type `type_` of `namespace/name`.
    pub fn condition_in(&self, namespace: &str, name: &str, type_: &str) -> Option<Value> {
        let svc = self.service_json_in(namespace, name)?;
        svc["status"]["conditions"].as_array()?.iter().find(|c| c["type"] == type_).cloned()
    }

    /// Waits until condition `type_` of `default/name` has `status` and `reason`.
    pub fn wait_condition(&self, name: &str, type_: &str, status: &str, reason: &str, timeout: Duration) {
        let ok = wait_until(timeout, || {
            self.condition(name, type_).is_some_and(|c| c["status"] == status && c["reason"] == reason)
        });
        assert!(
            ok,
            "default/{name}: condition {type_} not {status}/{reason} within {timeout:?}: {:#}",
            self.service_json(name).unwrap_or_default()
        );
    }

    /// Holder of Lease `nodelb-leader`.
    pub fn leader(&self) -> Option<String> {
        self.api.get_typed::<Lease>(AGENT_NS, LEADER_LEASE)?.spec?.holder_identity
    }

    /// Index of the controller replica holding the leader Lease now, if one does.
    pub fn leader_index(&self) -> Option<usize> {
        self.leader().and_then(|h| (0..self.controllers.len()).find(|k| controller_name(*k) == h))
    }

    /// Index of the controller replica holding the leader Lease (waits up to `timeout`).
    pub fn wait_leader(&self, timeout: Duration) -> usize {
        let mut idx = None;
        let ok = wait_until(timeout, || {
            idx = self.leader_index();
            idx.is_some()
        });
        assert!(ok, "no leader within {timeout:?}");
        idx.unwrap()
    }

    /// Controller replicas (by client address) that wrote to a Service (object or status) so
    /// far. Only the controller may: a node agent's write would have been refused.
    pub fn service_writers(&self) -> BTreeSet<usize> {
        let writes = |r: &super::kube::RequestRecord| r.is_write() && r.path.contains("/services/");
        let from_nodes: Vec<_> = self.api.agent_requests().into_iter().filter(writes).collect();
        assert!(from_nodes.is_empty(), "a node agent tried to write a Service: {from_nodes:?}");
        self.api
            .controller_requests()
            .iter()
            .filter(|r| writes(r))
            .map(|r| {
                (0..self.controllers.len())
                    .find(|k| IpAddr::V4(controller_v4(*k)) == r.peer)
                    .unwrap_or_else(|| panic!("Service write from a non-controller address: {r:?}"))
            })
            .collect()
    }

    fn node_of(&self, peer: IpAddr) -> Option<usize> {
        (0..self.nodes.len()).find(|i| peer == IpAddr::V4(node_v4(*i)))
    }

    /// Events (events.k8s.io/v1) about `default/name` with `reason`.
    pub fn events(&self, name: &str, reason: &str) -> Vec<Value> {
        self.events_in("default", name, reason)
    }

    /// Events (events.k8s.io/v1) about `namespace/name` with `reason` (any, when empty).
    pub fn events_in(&self, namespace: &str, name: &str, reason: &str) -> Vec<Value> {
        self.api
            .list("events.k8s.io/v1", "Event", Some(namespace))
            .into_iter()
            .filter(|e| e["regarding"]["name"] == name && (reason.is_empty() || e["reason"] == reason))
            .collect()
    }

    /// `GET /` from the client to node `i`'s `port`.
    pub fn get(&self, i: usize, port: u16, timeout: Duration) -> Result<String, ClientError> {
        http_get(&self.client, IpAddr::V4(node_v4(i)), port, timeout)
    }

    /// Waits until node `i` answers on `port` (any backend).
    pub fn wait_served(&self, i: usize, port: u16, timeout: Duration) {
        let mut last = None;
        let ok = wait_until(timeout, || {
            let r = self.get(i, port, Duration::from_millis(500));
            let ok = r.is_ok();
            last = Some(r);
            ok
        });
        assert!(ok, "node-{} does not serve port {port} within {timeout:?}: {last:?}", i + 1);
    }

    /// `nft list table inet nodelb` in node `i` (`None`: no table).
    pub fn nft(&self, i: usize) -> Option<String> {
        nft_list(&self.nodes[i])
    }

    /// `nodelb plan` for node `i` from the cluster as it is now (run inside node `i`'s namespace,
    /// with its agent's kubeconfig): the ruleset in nft syntax.
    pub fn plan(&self, i: usize) -> String {
        let kubeconfig = self.kubeconfig(i);
        let out = super::agent::nodelb(
            &self.nodes[i],
            &["plan", "--kubeconfig", kubeconfig.to_str().unwrap(), "--node-name", &node_name(i)],
        );
        assert!(
            out.status.success(),
            "nodelb plan for node-{}: {}",
            i + 1,
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    /// [`Cluster::plan`] of node `i` loaded into a scratch namespace with `nft -f` and listed
    /// back, in canonical form ([`super::agent::canonical_ruleset`]): comparable with node `i`'s
    /// table in that form.
    pub fn planned_listing(&self, i: usize) -> String {
        planned_listing(&self.plan(i))
    }

    /// Waits until [`Cluster::planned_listing`] of node `i` equals its table (canonical forms);
    /// returns the plan, panicking with both when they still differ after `timeout`.
    pub fn wait_plan_is_table(&self, i: usize, timeout: Duration) -> String {
        let mut last = (String::new(), String::new());
        let same = wait_until(timeout, || {
            last =
                (self.planned_listing(i), super::agent::canonical_ruleset(&self.nft(i).unwrap_or_default()));
            last.0 == last.1
        });
        assert!(same, "node-{}: plan and table differ:\nplan:\n{}\ntable:\n{}", i + 1, last.0, last.1);
        last.0
    }

    /// Sum of every sample of metric `name` (all label sets) on node `i`'s `/metrics`.
    pub fn metric_sum(&self, i: usize, name: &str) -> f64 {
        metric_sum(&self.agents[i], name)
    }

    /// Sum of every sample of metric `name` on controller replica `k`'s `/metrics`.
    pub fn controller_metric_sum(&self, k: usize, name: &str) -> f64 {
        metric_sum(&self.controllers[k], name)
    }
}

/// Sum of every sample of metric `name` (all label sets) on `a`'s `/metrics`.
fn metric_sum(a: &Agent, name: &str) -> f64 {
    let r = a.http("/metrics").unwrap_or_else(|e| panic!("{} /metrics: {e:?}", a.node_name()));
    assert_eq!(r.status, 200, "{} /metrics: {}", a.node_name(), r.body);
    r.body
        .lines()
        .filter(|l| !l.starts_with('#'))
        .filter_map(|l| {
            let (metric, value) = l.rsplit_once(' ')?;
            let metric_name = metric.split('{').next()?;
            (metric_name == name).then(|| value.parse::<f64>().ok()).flatten()
        })
        .sum()
}

impl Cluster {
    /// What the node agents (`sa` "nodelb") or the controller (`sa` "nodelb-controller") asked
    /// the API server for so far, as RBAC permissions (namespace, (group, resource[/subresource],
    /// verb), the object's name if the request named one), as the server's authorizer saw them
    /// (from its audit log; a list or watch with a `metadata.name` field selector is named too).
    pub fn permissions_used(&self, sa: &str) -> Vec<(Option<String>, Permission, Option<String>)> {
        self.requests_of(sa)
            .iter()
            .filter(|r| !r.resource.is_empty())
            .map(|r| {
                (r.namespace.clone(), (r.group.clone(), r.resource.clone(), r.verb.clone()), r.name.clone())
            })
            .collect()
    }

    /// The requests of ServiceAccount `sa` of nodelb's namespace since the last clear.
    pub fn requests_of(&self, sa: &str) -> Vec<super::kube::RequestRecord> {
        let user = format!("system:serviceaccount:{AGENT_NS}:{sa}");
        self.api.requests().into_iter().filter(|r| r.user == user).collect()
    }

    /// Takes `resource` of `group` out of every role the install made (as an operator's broken
    /// RBAC would): both identities' requests for it are refused (403) from now on.
    pub fn revoke(&self, group: &str, resource: &str) {
        revoke(&self.api, group, resource);
    }

    /// Re-applies `daemonset/10-rbac.yaml` (after [`Cluster::revoke`]).
    pub fn restore_rbac(&self) {
        let rbac = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("daemonset/10-rbac.yaml");
        self.api.kubectl_ok(&["apply", "-f", rbac.to_str().unwrap()]);
    }

    /// Every request of both identities was allowed by the server (RBAC as installed from
    /// `daemonset/10-rbac.yaml`, and the admission policy) and is granted by that file's rules
    /// for that identity: the least-privilege RBAC is not too tight.
    pub fn assert_rbac_allows_every_request(&self) {
        for sa in ["nodelb", "nodelb-controller"] {
            let rbac = Rbac::load(sa);
            let requests = self.requests_of(sa);
            assert!(!requests.is_empty(), "no request of {sa} in the audit log");
            for r in &requests {
                assert!(
                    r.decision.as_deref() == Some("allow") && r.status != 403,
                    "the API server refused a request of {sa}: {r:?}"
                );
            }
            for (ns, p, name) in self.permissions_used(sa) {
                assert!(
                    rbac.allows(ns.as_deref(), &p, name.as_deref()),
                    "{p:?} of {name:?} in namespace {ns:?} is not granted to {sa} by daemonset/10-rbac.yaml"
                );
            }
        }
    }
}

/// See [`Cluster::revoke`] (also usable in a [`Cluster::with_api_setup`] closure).
pub fn revoke(api: &ControlPlane, group: &str, resource: &str) {
    let roles = [
        ("ClusterRole", "", "nodelb"),
        ("ClusterRole", "", "nodelb-controller"),
        ("Role", AGENT_NS, "nodelb"),
        ("Role", AGENT_NS, "nodelb-controller"),
        ("Role", "default", "nodelb-node-events"),
    ];
    let mut changed = 0;
    for (kind, ns, name) in roles {
        let Some(mut role) = api.get("rbac.authorization.k8s.io/v1", kind, ns, name) else { continue };
        let has = |rule: &Value, key: &str, want: &str| {
            rule[key].as_array().is_some_and(|a| a.iter().any(|x| x == want))
        };
        let Some(rules) = role["rules"].as_array_mut() else { continue };
        let mut touched = false;
        for rule in rules.iter_mut().filter(|r| has(r, "apiGroups", group) && has(r, "resources", resource)) {
            rule["resources"].as_array_mut().unwrap().retain(|r| r != resource);
            touched = true;
        }
        rules.retain(|r| r["resources"].as_array().is_none_or(|a| !a.is_empty()));
        if touched {
            api.apply(role).unwrap_or_else(|e| panic!("replace {kind} {name}: {e}"));
            changed += 1;
        }
    }
    assert!(changed > 0, "no role grants {group}/{resource}");
}

/// One RBAC permission: (apiGroup, resource or resource/subresource, verb).
pub type Permission = (String, String, String);

/// The rules of `daemonset/10-rbac.yaml` for one ServiceAccount: its ClusterRoles' (any
/// namespace) and its Roles' (their namespace only), each permission with the names it is
/// restricted to (`resourceNames`; `None`: any). No wildcards are used there, so none are
/// understood here.
pub struct Rbac {
    pub cluster: BTreeMap<Permission, Option<BTreeSet<String>>>,
    pub namespaced: BTreeMap<(String, Permission), Option<BTreeSet<String>>>,
}

impl Rbac {
    /// What `daemonset/10-rbac.yaml` grants ServiceAccount `sa` of nodelb's namespace: the
    /// rules of the roles its bindings there name.
    pub fn load(sa: &str) -> Rbac {
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("daemonset/10-rbac.yaml");
        let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        let docs: Vec<Value> = serde_saphyr::from_multiple(&text).expect("YAML documents");
        // The roles bound to `sa`: (kind, binding namespace, role name).
        let mut bound = BTreeSet::new();
        for b in &docs {
            let kind = b["kind"].as_str().unwrap_or_default();
            if !matches!(kind, "ClusterRoleBinding" | "RoleBinding") {
                continue;
            }
            let to_sa = b["subjects"]
                .as_array()
                .into_iter()
                .flatten()
                .any(|s| s["kind"] == "ServiceAccount" && s["name"] == sa && s["namespace"] == AGENT_NS);
            if to_sa {
                let ns = b["metadata"]["namespace"].as_str().map(String::from);
                let role = b["roleRef"]["name"].as_str().expect("roleRef").to_string();
                bound.insert((b["roleRef"]["kind"].as_str().expect("roleRef kind").to_string(), ns, role));
            }
        }
        let mut rbac = Rbac { cluster: BTreeMap::new(), namespaced: BTreeMap::new() };
        for v in &docs {
            let ns = v["metadata"]["namespace"].as_str().map(String::from);
            let kind = v["kind"].as_str().unwrap_or_default().to_string();
            let name = v["metadata"]["name"].as_str().unwrap_or_default().to_string();
            if !matches!(kind.as_str(), "ClusterRole" | "Role")
                || !bound.contains(&(kind.clone(), ns.clone(), name))
            {
                continue;
            }
            let strs = |x: &Value| -> Vec<String> {
                x.as_array().into_iter().flatten().filter_map(|s| s.as_str().map(String::from)).collect()
            };
            for rule in v["rules"].as_array().into_iter().flatten() {
                let names = rule.get("resourceNames").map(|n| strs(n).into_iter().collect::<BTreeSet<_>>());
                for g in strs(&rule["apiGroups"]) {
                    for r in strs(&rule["resources"]) {
                        for verb in strs(&rule["verbs"]) {
                            assert!(g != "*" && r != "*" && verb != "*", "wildcards not understood: {rule}");
                            let p = (g.clone(), r.clone(), verb);
                            let old = match kind.as_str() {
                                "ClusterRole" => rbac.cluster.insert(p, names.clone()),
                                _ => rbac
                                    .namespaced
                                    .insert((ns.clone().expect("Role namespace"), p), names.clone()),
                            };
                            assert!(old.is_none(), "a permission granted twice: {rule}");
                        }
                    }
                }
            }
        }
        assert!(!bound.is_empty(), "daemonset/10-rbac.yaml binds nothing to {sa}");
        rbac
    }

    /// Whether `p` is granted in `ns` (`None`: cluster-scoped) for the object called `name`
    /// (`None`: a request naming no object, which a `resourceNames` rule does not grant).
    pub fn allows(&self, ns: Option<&str>, p: &Permission, name: Option<&str>) -> bool {
        let fits = |names: &Option<BTreeSet<String>>| {
            names.as_ref().is_none_or(|names| name.is_some_and(|n| names.contains(n)))
        };
        self.cluster.get(p).is_some_and(fits)
            || ns.is_some_and(|ns| self.namespaced.get(&(ns.to_string(), p.clone())).is_some_and(fits))
    }

    /// Every permission granted, wherever.
    pub fn all(&self) -> BTreeSet<Permission> {
        self.cluster.keys().cloned().chain(self.namespaced.keys().map(|(_, p)| p.clone())).collect()
    }
}

/// `"80/TCP=20001,53/UDP=20002"` → {"80/TCP": 20001, "53/UDP": 20002}.
pub fn parse_ports(value: &str) -> BTreeMap<String, u16> {
    value
        .split(',')
        .filter(|s| !s.trim().is_empty())
        .filter_map(|item| {
            let (k, v) = item.trim().split_once('=')?;
            Some((k.to_string(), v.parse().ok()?))
        })
        .collect()
}

/// An nft ruleset (`nodelb plan` output) loaded into a scratch namespace and listed back, in
/// canonical form ([`super::agent::canonical_ruleset`]).
pub fn planned_listing(plan: &str) -> String {
    let ns = NetNs::new("plan-ref");
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("plan.nft");
    std::fs::write(&file, plan).unwrap();
    ns.exec_ok("nft", &["-f", file.to_str().unwrap()]);
    super::agent::canonical_ruleset(&nft_list(&ns).unwrap_or_default())
}
