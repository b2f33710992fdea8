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
      # One per node while there are nodes for them.
      topologySpreadConstraints:
      - {{maxSkew: 1, topologyKey: kubernetes.io/hostname, whenUnsatisfiable: DoNotSchedule, labelSelector: {{matchLabels: {{app: {name}}}}}}}
      containers:
      - name: web
        image: {image}
        imagePullPolicy: Never
        env:
        - {{name: POD_NAME, valueFrom: {{fieldRef: {{fieldPath: metadata.name}}}}}}
        - {{name: NODE_NAME, valueFrom: {{fieldRef: {{fieldPath: spec.nodeName}}}}}}
        ports: [{{containerPort: 8080}}]
        readinessProbe: {{httpGet: {{path: /, port: 8080}}, periodSeconds: 1}}
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

/// The pid of the process running `exe` (its path inside the container) among node `i`'s pods.
fn container_process(c: &RealCluster, i: usize, exe: &str) -> Option<i32> {
    c.nodes[i]
        .pod_processes()
        .into_iter()
        .find(|pid| std::fs::read_link(format!("/proc/{pid}/exe")).is_ok_and(|p| p == Path::new(exe)))
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
    for i in 0..2 {
        let pid = container_process(&c, i, "/usr/local/bin/nodelb").expect("the agent's process");
        assert_eq!(status_field(pid, "CapEff"), "0000000000001000", "{}: only CAP_NET_ADMIN", node_name(i));
        assert_eq!(status_field(pid, "NoNewPrivs"), "1");
        assert_eq!(status_field(pid, "Seccomp"), "2", "seccomp filter mode");
        assert!(status_field(pid, "Uid").starts_with("0\t"), "uid 0");
        let mountinfo = std::fs::read_to_string(format!("/proc/{pid}/mountinfo")).unwrap();
        let root = mountinfo.lines().find(|l| l.split_whitespace().nth(4) == Some("/")).expect("root mount");
        assert!(root.split_whitespace().nth(5).is_some_and(|o| o.split(',').any(|o| o == "ro")), "{root}");
    }

    // A backend per node behind a LoadBalancer Service.
    let out = c.api.kubectl_stdin(&["apply", "-f", "-"], &backend("web", 2, images.get("backend")));
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    c.rollout("default", "deployment/web", ROLLOUT);
    let mut port = None;
    assert!(
        wait_until(CHANGE, || {
            port = allocated_port(&c, "web");
            port.is_some()
        }),
        "no port allocated"
    );
    let port = port.unwrap();
    let wide = c.api.kubectl_ok(&["get", "svc", "web", "-o", "wide"]);
    let ingress_ok = wait_until(CHANGE, || {
        let svc = c.api.get("v1", "Service", "default", "web").unwrap();
        let ips: Vec<&str> = svc["status"]["loadBalancer"]["ingress"]
            .as_array()
            .map(|a| a.iter().filter_map(|i| i["ip"].as_str()).collect())
            .unwrap_or_default();
        ips.len() == 2
    });
    assert!(ingress_ok, "the Service's status lists both nodes:\n{wide}");

    // Every node's port reaches both backends (the one on another node too).
    let backends: std::collections::BTreeSet<String> = c
        .pods("default", "app=web")
        .iter()
        .filter_map(|p| p["metadata"]["name"].as_str().map(|n| format!("pod={n}")))
        .collect();
    for i in 0..2 {
        let mut seen = Default::default();
        wait_until(CHANGE, || {
            seen = answers(&c, i, port, 20);
            seen == backends
        });
        assert_eq!(seen, backends, "through {}:{port}", node_name(i));
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
    for i in 0..2 {
        let url = format!("https://{}:9472/metrics", common::cluster::node_v4(i));
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
    let loops: Vec<ClientLoop> = (0..2)
        .map(|i| {
            let addr = IpAddr::V4(common::cluster::node_v4(i));
            ClientLoop::http(&c.client, addr, port, Duration::from_millis(50), T)
        })
        .collect();
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
    for (i, l) in loops.into_iter().enumerate() {
        let results = l.stop();
        let failed: Vec<_> = results.iter().filter(|r| r.is_err()).collect();
        assert!(results.len() > 20, "too few requests through {}", node_name(i));
        assert!(
            failed.is_empty(),
            "{} of {} requests through {} failed during the rollout: {:?}",
            failed.len(),
            results.len(),
            node_name(i),
            &failed[..failed.len().min(5)]
        );
    }
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
        assert!(clean, "{}: nodelb's table is left: {:?}", node.name, node.nodelb_table());
    }
    assert!(
        wait_until(ROLLOUT, || c.pods(AGENT_NS, "app.kubernetes.io/name=nodelb").is_empty()),
        "agent pods left"
    );
}
