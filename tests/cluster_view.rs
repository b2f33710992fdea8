//! Where each Service is served across the cluster, and why not, as an operator asks it from a
//! workstation: `nodelb status --cluster` and `kubectl nodelb` (the binary copied as
//! `kubectl-nodelb` on the PATH) run as a user bound only to the shipped read-only roles
//! (`<release>-viewer`), against the real API server and three real agents, each refusing for
//! its own reasons: a pool that does not select the node, a process on the port, every endpoint
//! refused, forwarding off.
mod common;

use std::time::Duration;

use common::cluster::{AGENT_NS, Cluster, web};
use common::topology::{Servers, wait_until};
use serde_json::Value;

const CHANGE: Duration = Duration::from_secs(20);

#[test]
fn the_cluster_view_says_where_each_service_is_served_and_why_not() {
    require_root!();
    let mut c = Cluster::new(2);
    c.create(&web("web", &[(0, 0), (1, 1)]));
    let np = c.wait_allocated("web", 1, CHANGE)["80/TCP"];
    for i in 0..3 {
        c.wait_served(i, np, CHANGE);
    }
    // A second Service in a pool that selects node-1 and node-2 only (a catch-all pool keeps
    // `web` where it is).
    for (node, zone) in [("node-1", "edge"), ("node-2", "edge"), ("node-3", "core")] {
        c.api.kubectl_ok(&["label", "node", node, &format!("zone={zone}")]);
    }
    let pools = r#"[
        {"apiVersion": "nodelb.io/v1alpha1", "kind": "NodePortPool", "metadata": {"name": "all"},
         "spec": {"ports": [{"start": 20000, "end": 20099}], "priority": 10}},
        {"apiVersion": "nodelb.io/v1alpha1", "kind": "NodePortPool", "metadata": {"name": "edge"},
         "spec": {"ports": [{"start": 21000, "end": 21009}], "nodeSelector": {"matchLabels": {"zone": "edge"}},
                  "serviceSelector": {"matchLabels": {"tier": "edge"}}}}]"#;
    for pool in serde_json::from_str::<Vec<Value>>(pools).unwrap() {
        c.api.create(pool).expect("create a pool");
    }
    let edge_spec = web("edge", &[(0, 0)]);
    let mut edge = edge_spec.service();
    edge["spec"].as_object_mut().unwrap().remove("selector");
    edge["metadata"]["labels"] = serde_json::json!({"tier": "edge"});
    c.api.create(edge).expect("create edge");
    for s in edge_spec.slices() {
        c.api.create(s).expect("create its slice");
    }
    let edge_np = c.wait_allocated("edge", 1, CHANGE)["80/TCP"];
    assert!((21000..=21009).contains(&edge_np), "edge: {edge_np}");
    // node-2: IPv4 forwarding off (its agent is not ready); node-3: a process listens on the
    // Service's node port (its agent leaves the port to it).
    c.nodes[1].sysctl("net.ipv4.ip_forward", "0");
    let _listener = Servers::start(&c.nodes[2], "node-3", np, np);
    // node-3's agent DNATs only to endpoints inside a range its backends are not in (a node
    // pool whose DaemonSet runs with other flags): every endpoint of `internal` is refused there.
    c.restart_agent_with(2, &["--endpoint-cidrs", "192.0.2.0/24"], CHANGE);
    c.create(&web("internal", &[(0, 0)]));
    let internal_np = c.wait_allocated("internal", 1, CHANGE)["80/TCP"];

    // A user bound to the viewer roles only.
    let alice = c.api.user_kubeconfig("alice", &[]);
    c.api.kubectl_ok(&[
        "create",
        "clusterrolebinding",
        "alice-nodelb",
        "--clusterrole=nodelb-viewer",
        "--user=alice",
    ]);
    c.api.kubectl_ok(&[
        "-n",
        AGENT_NS,
        "create",
        "rolebinding",
        "alice-nodelb",
        "--role=nodelb-viewer",
        "--user=alice",
    ]);
    for (verb, what) in
        [("create", "services"), ("get", "secrets"), ("create", "pods/exec"), ("update", "leases")]
    {
        let out = c.api.kubectl_as(&alice, &["auth", "can-i", verb, what, "-A"]);
        assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "no", "alice may {verb} {what}");
    }

    let bin = std::path::PathBuf::from(env!("CARGO_BIN_EXE_nodelb"));
    let view = |args: &[&str]| -> Value {
        let mut all = vec!["status", "--cluster", "--nodelb-namespace", AGENT_NS, "--json"];
        all.extend_from_slice(args);
        let out = c.api.tool_as(&bin, &alice, &all, None);
        assert!(out.status.success(), "nodelb status --cluster: {}", String::from_utf8_lossy(&out.stderr));
        // The JSON form's schema: the view's types, unknown fields refused.
        let typed: nodelb::core::k8s::cluster_view::ClusterView =
            serde_json::from_slice(&out.stdout).unwrap_or_else(|e| panic!("not the view's schema: {e}"));
        serde_json::to_value(typed).unwrap()
    };
    let mut last = Value::Null;
    let ok = wait_until(CHANGE, || {
        last = view(&[]);
        let web = named(&last, "web");
        web["servedOn"] == serde_json::json!(["node-1"])
            && web["notServed"]["node-2"].as_str().is_some_and(|w| w.contains("forwarding is off"))
            && web["notServed"]["node-3"].as_str().is_some_and(|w| w.contains("in use"))
    });
    assert!(ok, "{last:#}");
    // edge: node-1 serves it, node-2 does not (forwarding), node-3 is not in its pool.
    let ok = wait_until(CHANGE, || {
        last = view(&[]);
        let edge = named(&last, "edge");
        edge["servedOn"] == serde_json::json!(["node-1"])
            && edge["notServed"]["node-3"].as_str().is_some_and(|w| {
                w.contains("pool edge does not select this node") && w.ends_with("(node_port_refused)")
            })
    });
    assert!(ok, "{last:#}");
    // internal: node-1 serves it, node-3 refuses its every endpoint.
    let ok = wait_until(CHANGE, || {
        last = view(&[]);
        let internal = named(&last, "internal");
        internal["servedOn"] == serde_json::json!(["node-1"])
            && internal["notServed"]["node-3"].as_str().is_some_and(|w| {
                w.contains("198.51.100.11") && w.contains("endpoint") && w.ends_with("(endpoints_refused)")
            })
    });
    assert!(ok, "{last:#}");
    assert_eq!(named(&last, "internal")["ports"], format!("80/TCP={internal_np}"));
    let web = named(&last, "web");
    assert_eq!((web["namespace"].as_str(), web["name"].as_str()), (Some("default"), Some("web")));
    assert_eq!(web["ports"], format!("80/TCP={np}"));
    let node3 = web["notServed"]["node-3"].as_str().unwrap();
    assert!(node3.contains(&format!("{np}/TCP")) && node3.ends_with("(node_port_refused)"), "{node3}");
    let node2 = web["notServed"]["node-2"].as_str().unwrap();
    assert!(node2.ends_with("(forwarding_off)"), "{node2}");
    // The nodes, as their agents report them.
    let nodes = last["nodes"].as_array().unwrap();
    assert_eq!(nodes.len(), 3, "{last:#}");
    for n in nodes {
        let r = &n["report"];
        assert!(n["agent"] == true && r["version"].as_str().is_some_and(|v| v.contains("(commit ")), "{n}");
        assert!(r["lastSync"]["ok"] == true, "{n}");
    }
    assert_eq!(nodes[1]["report"]["ready"], false);
    let why = nodes[1]["report"]["notReady"].as_str().unwrap_or_default();
    assert!(why.contains("net.ipv4.ip_forward is 0"), "{why}");
    assert_eq!(nodes[1]["report"]["families"]["ipv4"]["forwarding"], false);
    assert_eq!(
        nodes[2]["report"]["refusedTotal"], 3,
        "web (in use), edge (not selected) and internal (endpoints refused)"
    );

    // The Service's Serving condition says as much, bounded (node-2 has no ready agent for IPv4:
    // it is not among the nodes that could serve).
    let ok = wait_until(CHANGE, || {
        c.condition("web", "nodelb.io/Serving").is_some_and(|cond| {
            let m = cond["message"].as_str().unwrap_or_default();
            m.starts_with("served on 1 of 2 nodes")
                && m.contains("; node-3: port 80/TCP: ")
                && m.contains("in use")
        })
    });
    assert!(ok, "Serving: {:?}", c.condition("web", "nodelb.io/Serving"));
    let ok = wait_until(CHANGE, || {
        c.condition("internal", "nodelb.io/Serving").is_some_and(|cond| {
            let m = cond["message"].as_str().unwrap_or_default();
            m.starts_with("served on 1 of 2 nodes")
                && m.contains("; node-3: ")
                && m.contains("every endpoint refused")
        })
    });
    assert!(ok, "Serving: {:?}", c.condition("internal", "nodelb.io/Serving"));

    // Filters.
    let only = view(&["--node", "node-3", "-n", "default", "--service", "web"]);
    assert_eq!(only["services"].as_array().map(Vec::len), Some(1));
    assert_eq!(only["nodes"].as_array().map(Vec::len), Some(1));
    assert_eq!(only["services"][0]["notServed"].as_object().map(|o| o.len()), Some(1));
    assert!(view(&["-n", "other"])["services"].as_array().unwrap().is_empty());

    // `kubectl nodelb`: the same binary, as a kubectl plugin on the PATH.
    let dir = tempfile_dir();
    std::fs::copy(&bin, dir.join("kubectl-nodelb")).expect("copy the plugin");
    let out =
        c.api.tool_as(&c.api.kubectl_path(), &alice, &["nodelb", "--nodelb-namespace", AGENT_NS], Some(&dir));
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(out.status.success(), "kubectl nodelb: {}", String::from_utf8_lossy(&out.stderr));
    eprintln!("kubectl nodelb:\n{text}");
    assert!(
        text.contains(&format!("default/web  ports 80/TCP={np}  served on 1 of 3 nodes: node-1")),
        "{text}"
    );
    assert!(text.contains("  node-2: forwarding is off on this node"), "{text}");
    assert!(text.contains("  node-3: ") && text.contains("in use"), "{text}");
    assert!(text.contains("every endpoint refused") && text.contains("(endpoints_refused)"), "{text}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// The row of Service `default/name` in a view.
fn named(view: &Value, name: &str) -> Value {
    view["services"].as_array().into_iter().flatten().find(|s| s["name"] == name).cloned().unwrap_or_default()
}

fn tempfile_dir() -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("nodelb-plugin-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}
