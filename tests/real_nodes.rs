//! The user's path on real nodes: kubelets running nodelb's DaemonSet and controller Deployment
//! in real containers (containerd + runc, the image built here from the binary under test, the
//! manifests' securityContext), a backend Deployment behind a `type: LoadBalancer` Service, and
//! clients reaching it at every node's allocated port. See `tests/common/real_node.rs` for the
//! nodes.
mod common;

use std::net::IpAddr;
use std::path::Path;
use std::time::Duration;

use common::cluster::{AGENT_NS, node_name};
use common::real_node::{RealCluster, images};
use common::topology::{ClientLoop, wait_until};
use serde_json::Value;

/// A rollout on a loaded 2-core machine (image already on the node, probes included).
const ROLLOUT: Duration = Duration::from_secs(240);
/// A change reaching every node's rules and the Service's status.
const CHANGE: Duration = Duration::from_secs(30);
/// Per-request timeout where an answer is expected.
const T: Duration = Duration::from_secs(2);

fn manifests(dir: &str) -> String {
    Path::new(env!("CARGO_MANIFEST_DIR")).join(dir).to_str().unwrap().to_string()
}

/// A Deployment of `replicas` test backends (each answers `pod=<name> node=<node>`) and a
/// `type: LoadBalancer` Service in front of them, port 80.
fn backend(name: &str, replicas: usize, image: &str) -> String {
    format!(
        r#"apiVersion: apps/v1
kind: Deployment
metadata: {{name: {name}, namespace: default}}
spec:
  replicas: {replicas}
  selector: {{matchLabels: {{app: {name}}}}}
  template:
    metadata: {{labels: {{app: {name}}}}}
    spec:
      # Spread over the nodes while they are schedulable.
      topologySpreadConstraints:
      - {{maxSkew: 1, topologyKey: kubernetes.io/hostname, whenUnsatisfiable: ScheduleAnyway, labelSelector: {{matchLabels: {{app: {name}}}}}}}
      terminationGracePeriodSeconds: 10
      containers:
      - name: web
        image: {image}
        imagePullPolicy: Never
        env:
        - {{name: POD_NAME, valueFrom: {{fieldRef: {{fieldPath: metadata.name}}}}}}
        - {{name: NODE_NAME, valueFrom: {{fieldRef: {{fieldPath: spec.nodeName}}}}}}
        ports: [{{containerPort: 8080}}]
        readinessProbe: {{httpGet: {{path: /, port: 8080}}, periodSeconds: 1}}
        # Serves on while the endpoint's removal reaches the nodes, as production Deployments do.
        lifecycle: {{preStop: {{sleep: {{seconds: 5}}}}}}
---
apiVersion: v1
kind: Service
metadata: {{name: {name}, namespace: default}}
spec:
  type: LoadBalancer
  selector: {{app: {name}}}
  ports: [{{name: http, port: 80, targetPort: 8080}}]
"#
    )
}

/// The Service's allocated node port for 80/TCP (`nodelb.io/allocated-ports`).
fn allocated_port(c: &RealCluster, name: &str) -> Option<u16> {
    let svc = c.api.get("v1", "Service", "default", name)?;
    let ann = svc["metadata"]["annotations"]["nodelb.io/allocated-ports"].as_str()?.to_string();
    ann.split(',').find_map(|p| p.strip_prefix("80/TCP=")).and_then(|p| p.parse().ok())
}

/// The pid of the process running `exe` (its path inside the container) in `pod`.
fn container_process(c: &RealCluster, pod: &Value, exe: &str) -> i32 {
    let node = pod["spec"]["nodeName"].as_str().expect("scheduled");
    let node = c.nodes.iter().find(|n| n.name == node).expect("a node of the cluster");
    let uid = pod["metadata"]["uid"].as_str().expect("uid");
    let pids = node.processes_of_pod(uid);
    pids.iter()
        .copied()
        .find(|pid| std::fs::read_link(format!("/proc/{pid}/exe")).is_ok_and(|p| p == Path::new(exe)))
        .unwrap_or_else(|| panic!("no {exe} among the processes {pids:?} of pod {}", pod["metadata"]["name"]))
}

/// What the kernel says of `pid`: effective capabilities, no_new_privs, seccomp mode, real uid,
/// and whether its root file system is read-only.
fn confinement(pid: i32) -> (String, String, String, String, bool) {
    let mountinfo = std::fs::read_to_string(format!("/proc/{pid}/mountinfo")).unwrap();
    let root = mountinfo.lines().find(|l| l.split_whitespace().nth(4) == Some("/")).expect("root mount");
    let ro = root.split_whitespace().nth(5).is_some_and(|o| o.split(',').any(|o| o == "ro"));
    let uid = status_field(pid, "Uid").split_whitespace().next().unwrap_or_default().to_string();
    (status_field(pid, "CapEff"), status_field(pid, "NoNewPrivs"), status_field(pid, "Seccomp"), uid, ro)
}

/// `/proc/<pid>/status` field `key`.
fn status_field(pid: i32, key: &str) -> String {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix(&format!("{key}:")))
        .map(|v| v.trim().to_string())
        .unwrap_or_else(|| panic!("no {key} in /proc/{pid}/status"))
}

/// Which backend pods answered through `node`'s port, over `n` requests.
fn answers(c: &RealCluster, node: usize, port: u16, n: usize) -> std::collections::BTreeSet<String> {
    let addr = common::cluster::node_v4(node).to_string();
    let url = format!("http://{addr}:{port}/");
    (0..n)
        .filter_map(|_| {
            let (ok, body) = c.curl(&["-sS", "-m", "2", &url]);
            ok.then(|| body.split_whitespace().next().unwrap_or_default().to_string())
        })
        .collect()
}

/// Applies [`backend`] and waits until its pods are Ready, its port allocated and every node's
/// port reaches every backend pod; returns the port.
fn serve_backend(c: &RealCluster, name: &str, replicas: usize) -> u16 {
    let out = c.api.kubectl_stdin(&["apply", "-f", "-"], &backend(name, replicas, images().get("backend")));
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    c.rollout("default", &format!("deployment/{name}"), ROLLOUT);
    let mut port = None;
    assert!(
        wait_until(CHANGE, || {
            port = allocated_port(c, name);
            port.is_some()
        }),
        "no port allocated"
    );
    let port = port.unwrap();
    let backends: std::collections::BTreeSet<String> = c
        .pods("default", &format!("app={name}"))
        .iter()
        .filter_map(|p| p["metadata"]["name"].as_str().map(|n| format!("pod={n}")))
        .collect();
    for i in 0..c.nodes.len() {
        let mut seen = Default::default();
        wait_until(CHANGE, || {
            seen = answers(c, i, port, 20);
            seen == backends
        });
        assert_eq!(seen, backends, "through {}:{port}", node_name(i));
    }
    port
}

/// The addresses in the Service's `status.loadBalancer.ingress`.
fn ingress(c: &RealCluster, name: &str) -> Vec<String> {
    let svc = c.api.get("v1", "Service", "default", name).expect("Service");
    let mut ips: Vec<String> = svc["status"]["loadBalancer"]["ingress"]
        .as_array()
        .map(|a| a.iter().filter_map(|i| i["ip"].as_str().map(String::from)).collect())
        .unwrap_or_default();
    ips.sort();
    ips
}

/// Clients looping through every node's `port` (one new connection each).
fn client_loops(c: &RealCluster, port: u16) -> Vec<ClientLoop> {
    (0..c.nodes.len())
        .map(|i| ClientLoop::http(&c.client, IpAddr::V4(c.nodes[i].v4), port, Duration::from_millis(50), T))
        .collect()
}

/// Stops the loops; panics when any request failed (or too few were sent).
fn assert_no_failure(loops: Vec<ClientLoop>, during: &str) {
    for (i, l) in loops.into_iter().enumerate() {
        let results = l.stop();
        let failed: Vec<_> = results.iter().filter(|r| r.is_err()).collect();
        assert!(results.len() > 20, "too few requests through {} during {during}", node_name(i));
        assert!(
            failed.is_empty(),
            "{} of {} requests through {} failed during {during}: {:?}",
            failed.len(),
            results.len(),
            node_name(i),
            &failed[..failed.len().min(5)]
        );
    }
}

/// The kubectl path: install, the pods' securityContext, serving through every node, logs,
/// /metrics, a rolling update, uninstall.
#[test]
fn daemonset_in_real_pods_serves_rolls_and_uninstalls() {
    require_root!();
    let c = RealCluster::start(2);
    let images = images();

    // Installed as a user does it; the pods start and pass their own probes.
    c.api.kubectl_ok(&["apply", "-f", &manifests("daemonset")]);
    c.rollout(AGENT_NS, "daemonset/nodelb", ROLLOUT);
    c.rollout(AGENT_NS, "deployment/nodelb-controller", ROLLOUT);
    let agents = c.pods(AGENT_NS, "app.kubernetes.io/name=nodelb");
    let nodes: std::collections::BTreeSet<&str> =
        agents.iter().filter_map(|p| p["spec"]["nodeName"].as_str()).collect();
    assert_eq!(nodes.len(), 2, "one agent per node: {nodes:?}");

    // The agent runs with exactly the DaemonSet's securityContext: uid 0, CAP_NET_ADMIN alone,
    // no new privileges, the runtime's seccomp filter, a read-only root file system.
    let cap_net_admin = "0000000000001000".to_string();
    let none = "0000000000000000".to_string();
    for pod in &agents {
        let pid = container_process(&c, pod, "/usr/local/bin/nodelb");
        let want = (cap_net_admin.clone(), "1".into(), "2".into(), "0".into(), true);
        assert_eq!(confinement(pid), want, "agent {}", pod["metadata"]["name"]);
    }
    // The controller: no capability at all, uid 65532.
    for pod in c.pods(AGENT_NS, "app.kubernetes.io/name=nodelb-controller") {
        let pid = container_process(&c, &pod, "/usr/local/bin/nodelb");
        let want = (none.clone(), "1".into(), "2".into(), "65532".into(), true);
        assert_eq!(confinement(pid), want, "controller {}", pod["metadata"]["name"]);
    }

    // Backends behind a LoadBalancer Service, reached through every node; its status names both.
    let port = serve_backend(&c, "web", 2);
    let nodes_v4: Vec<String> = c.nodes.iter().map(|n| n.v4.to_string()).collect();
    assert!(wait_until(CHANGE, || ingress(&c, "web") == nodes_v4), "status lists both nodes");
    // What the README's commands show: EXTERNAL-IP the node addresses, the allocated port.
    let wide = c.api.kubectl_ok(&["get", "svc", "web", "-o", "wide"]);
    let row = wide.lines().find(|l| l.starts_with("web ")).expect("a row for web");
    let mut external: Vec<&str> = row.split_whitespace().nth(3).unwrap_or_default().split(',').collect();
    external.sort();
    assert_eq!(external, nodes_v4, "{wide}");
    let annotation = c.api.kubectl_allocated_ports("web");
    assert_eq!(annotation, format!("80/TCP={port}"));
    for node in &c.nodes {
        let url = format!("http://{}:9471/readyz", node.v4);
        let (_, code) = c.curl(&["-s", "-m", "5", "-o", "/dev/null", "-w", "%{http_code}", &url]);
        assert_eq!(code, "200", "{url}");
    }

    // The agent's log, as `kubectl logs` shows it, is JSON, one object a line.
    let logs = c.api.kubectl_ok(&["logs", "-n", AGENT_NS, "daemonset/nodelb"]);
    assert!(logs.lines().count() > 3, "{logs}");
    for line in logs.lines() {
        let v: Value = serde_json::from_str(line).unwrap_or_else(|e| panic!("not JSON ({e}): {line}"));
        assert!(v["level"].is_string(), "{line}");
    }

    // /metrics from outside the node: TLS and the scraper's token.
    c.api.kubectl_ok(&["apply", "-f", &manifests("daemonset/monitoring/scraper-rbac.yaml")]);
    let token = c.api.kubectl_ok(&["create", "token", "nodelb-metrics-scraper", "-n", AGENT_NS]);
    let auth = format!("Authorization: Bearer {}", token.trim());
    for node in &c.nodes {
        let url = format!("https://{}:9472/metrics", node.v4);
        let (ok, body) = c.curl(&["-sS", "-k", "-m", "5", "-H", &auth, &url]);
        assert!(ok && body.contains("nodelb_services"), "{url}: {body}");
        let (_, code) = c.curl(&["-s", "-k", "-m", "5", "-o", "/dev/null", "-w", "%{http_code}", &url]);
        assert_eq!(code, "401", "{url} without a token");
    }

    // A new image tag rolls the DaemonSet one node at a time; clients through both nodes see no
    // failure. (The same image under a second tag: what changes is the pods, not the binary.)
    for node in &c.nodes {
        node.tag_image(images.get("nodelb"), "ghcr.io/nodelb/nodelb:rolled");
    }
    let loops = client_loops(&c, port);
    let before: Vec<String> =
        agents.iter().filter_map(|p| p["metadata"]["uid"].as_str().map(String::from)).collect();
    c.api.kubectl_ok(&[
        "set",
        "image",
        "-n",
        AGENT_NS,
        "daemonset/nodelb",
        "nodelb=ghcr.io/nodelb/nodelb:rolled",
    ]);
    c.rollout(AGENT_NS, "daemonset/nodelb", ROLLOUT);
    std::thread::sleep(Duration::from_secs(2));
    assert_no_failure(loops, "the rollout");
    let after = c.pods(AGENT_NS, "app.kubernetes.io/name=nodelb");
    assert!(
        after.iter().all(|p| {
            p["spec"]["containers"][0]["image"] == "ghcr.io/nodelb/nodelb:rolled"
                && !before.iter().any(|u| Some(u.as_str()) == p["metadata"]["uid"].as_str())
        }),
        "every agent pod replaced"
    );

    // Uninstalled as a user does it: the agents remove their rules from every node.
    let out = c.api.kubectl(&["delete", "-f", &manifests("daemonset"), "--wait=true", "--timeout=120s"]);
    assert!(out.status.success(), "kubectl delete: {}", String::from_utf8_lossy(&out.stderr));
    for node in &c.nodes {
        let clean = wait_until(CHANGE, || node.nodelb_table().is_none());
        assert!(clean, "{}: nodelb's table is left", node.name);
    }
    assert!(
        wait_until(ROLLOUT, || c.pods(AGENT_NS, "app.kubernetes.io/name=nodelb").is_empty()),
        "agent pods left"
    );
}

/// The Helm path: install, an upgrade to a new image tag while clients loop through every node,
/// a node drained, a node leaving the cluster, uninstall.
#[test]
fn helm_install_upgrade_drain_node_leaving_and_uninstall() {
    require_root!();
    let mut c = RealCluster::start(2);
    let chart = common::cluster::chart_dir();
    c.api.helm_ok(&[
        "install",
        "nodelb",
        &chart,
        "-n",
        AGENT_NS,
        "--create-namespace",
        "--wait",
        "--timeout=4m",
    ]);
    c.rollout(AGENT_NS, "daemonset/nodelb", ROLLOUT);
    let port = serve_backend(&c, "shop", 2);

    // helm upgrade to a new tag (the same image tagged again on the nodes, as a registry holds a
    // release under its tag): one node at a time, no request fails.
    for node in &c.nodes {
        node.tag_image(images().get("nodelb"), "ghcr.io/nodelb/nodelb:0.1.1");
    }
    let loops = client_loops(&c, port);
    c.api.helm_ok(&[
        "upgrade",
        "nodelb",
        &chart,
        "-n",
        AGENT_NS,
        "--reuse-values",
        "--set",
        "image.tag=0.1.1",
    ]);
    c.rollout(AGENT_NS, "daemonset/nodelb", ROLLOUT);
    c.rollout(AGENT_NS, "deployment/nodelb-controller", ROLLOUT);
    std::thread::sleep(Duration::from_secs(2));
    assert_no_failure(loops, "helm upgrade");
    let agents = c.pods(AGENT_NS, "app.kubernetes.io/name=nodelb");
    assert!(
        agents.iter().all(|p| p["spec"]["containers"][0]["image"] == "ghcr.io/nodelb/nodelb:0.1.1"),
        "every agent runs the new tag"
    );

    // kubectl drain node-2: its backend moves to node-1; both nodes keep serving (node-2's agent
    // is a DaemonSet pod, not evicted, and forwards to node-1), with no failed request.
    let loops = client_loops(&c, port);
    let out = c.api.kubectl(&["drain", &node_name(1), "--ignore-daemonsets", "--timeout=120s"]);
    assert!(out.status.success(), "kubectl drain: {}", String::from_utf8_lossy(&out.stderr));
    c.rollout("default", "deployment/shop", ROLLOUT);
    std::thread::sleep(Duration::from_secs(2));
    assert_no_failure(loops, "kubectl drain");
    let shop = c.pods("default", "app=shop");
    assert!(shop.iter().all(|p| p["spec"]["nodeName"] == node_name(0)), "backends left node-2");
    assert_eq!(ingress(&c, "shop"), vec![c.nodes[0].v4.to_string(), c.nodes[1].v4.to_string()]);

    // node-2 leaves: the machine stops (everything on it) and its Node is deleted. The Service's
    // status then names node-1 alone, which keeps serving.
    let gone = c.nodes.pop().expect("node-2");
    drop(gone);
    c.api.kubectl_ok(&["delete", "node", &node_name(1)]);
    let only_first =
        wait_until(Duration::from_secs(60), || ingress(&c, "shop") == vec![c.nodes[0].v4.to_string()]);
    assert!(only_first, "ingress after node-2 left: {:?}", ingress(&c, "shop"));
    assert!(!answers(&c, 0, port, 5).is_empty(), "node-1 serves on");

    // helm uninstall: the agent removes its rules before it goes.
    c.api.helm_ok(&["uninstall", "nodelb", "-n", AGENT_NS, "--wait", "--timeout=2m"]);
    let clean = wait_until(CHANGE, || c.nodes[0].nodelb_table().is_none());
    assert!(clean, "node-1: nodelb's table is left");
}
