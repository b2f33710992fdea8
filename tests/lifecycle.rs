//! Install, upgrade and uninstall end to end, against a real kube-apiserver + etcd
//! (`testkube`), nodelb installed with `kubectl apply -f daemonset/` or `helm install`, three
//! real agents with the stored DaemonSet's args and env, stopped and started the way the kubelet
//! does (SIGTERM, SIGKILL after the pod's grace period, then the new pod), with clients looping
//! through every node while it happens. See `tests/common/cluster.rs` for the topology.
//!
//! No kubelet, no DaemonSet controller, no namespace controller or garbage collector run here:
//! the test plays their part, in their order (the object is deleted or updated in the API first,
//! then its pods are stopped), and as early as they could (SIGTERM right after the API call).
mod common;

use std::collections::BTreeMap;
use std::net::IpAddr;
use std::time::Duration;

use common::cluster::{AGENT_NS, Cluster, chart_dir, node_v4, web};
use common::topology::{ClientError, ClientLoop, wait_until};

/// Per-request timeout where an answer is expected.
const T: Duration = Duration::from_secs(2);
/// A change to allocation / rules on every node.
const CHANGE: Duration = Duration::from_secs(15);
/// An agent (re)start until ready.
const READY: Duration = Duration::from_secs(60);
/// The comment of nodelb's ACCEPT in iptables' FORWARD chain (`--iptables-forward-accept`).
const ACCEPT_COMMENT: &str = "nodelb-forward-accept";

/// Creates `default/<name>` and waits until every node serves it and its status lists them all;
/// returns its node port.
fn serve(c: &Cluster, name: &str, eps: &[(usize, usize)]) -> u16 {
    c.create(&web(name, eps));
    let np = c.wait_allocated(name, 1, CHANGE)["80/TCP"];
    for i in 0..c.nodes.len() {
        c.wait_served(i, np, CHANGE);
    }
    c.wait_ingress_nodes(name, &[0, 1, 2], CHANGE);
    np
}

/// A client looping through every node to every port in `ports`, one request per 50 ms each.
fn clients(c: &Cluster, ports: &[u16]) -> Vec<(String, ClientLoop)> {
    let mut loops = Vec::new();
    for i in 0..c.nodes.len() {
        for &p in ports {
            let l = ClientLoop::http(&c.client, IpAddr::V4(node_v4(i)), p, Duration::from_millis(50), T);
            loops.push((format!("node-{}:{p}", i + 1), l));
        }
    }
    loops
}

/// Stops the loops; every request of every loop was answered, and each loop made at least `min`.
fn assert_no_request_lost(loops: Vec<(String, ClientLoop)>, min: usize) {
    for (what, l) in loops {
        let results = l.stop();
        let failed: Vec<&ClientError> = results.iter().filter_map(|r| r.as_ref().err()).collect();
        assert!(results.len() >= min, "{what}: only {} requests", results.len());
        assert!(
            failed.is_empty(),
            "{what}: {} of {} requests lost: {:?}",
            failed.len(),
            results.len(),
            &failed[..failed.len().min(5)]
        );
        eprintln!("{what}: {} requests, none lost", results.len());
    }
}

/// Stops every agent as the kubelet does once its pod is deleted; each exits by itself, with
/// status 0, within the grace period.
fn stop_every_agent(c: &mut Cluster, grace: Duration) {
    for i in 0..c.nodes.len() {
        let status = c.stop_agent(i, grace);
        assert!(status.is_some_and(|s| s.success()), "node-{}: SIGTERM → {status:?}", i + 1);
    }
}

/// No node has table `inet nodelb`, nodelb's iptables ACCEPT or an answering `port`.
fn assert_nothing_left(c: &Cluster, port: u16) {
    for i in 0..c.nodes.len() {
        assert_eq!(c.nft(i), None, "node-{}: table inet nodelb left behind", i + 1);
        let fwd = c.nodes[i].exec("iptables-nft", &["-S", "FORWARD"]);
        let fwd = String::from_utf8_lossy(&fwd.stdout);
        assert!(!fwd.contains(ACCEPT_COMMENT), "node-{}: nodelb's ACCEPT left behind:\n{fwd}", i + 1);
        let r = c.get(i, port, Duration::from_millis(700));
        assert!(r.is_err(), "node-{}:{port} still answers after the uninstall: {r:?}", i + 1);
    }
}

/// Gives every node an iptables-nft FORWARD chain (policy ACCEPT) and waits until each agent
/// (`--iptables-forward-accept`) has put its ACCEPT there.
fn with_iptables_accepts(c: &Cluster) {
    for i in 0..c.nodes.len() {
        c.nodes[i].exec_ok("iptables-nft", &["-P", "FORWARD", "ACCEPT"]);
        let mut fwd = String::new();
        let ok = wait_until(CHANGE, || {
            fwd = c.nodes[i].exec_ok("iptables-nft", &["-S", "FORWARD"]);
            fwd.contains(ACCEPT_COMMENT)
        });
        assert!(ok, "node-{}: no nodelb ACCEPT in FORWARD:\n{fwd}", i + 1);
    }
}

#[test]
fn kubectl_delete_f_daemonset_removes_the_rules_from_every_node() {
    require_root!();
    let mut c = Cluster::with_agent_args(2, &["--iptables-forward-accept"]);
    with_iptables_accepts(&c);
    let np = serve(&c, "web", &[(0, 0), (1, 1)]);
    let before = c.allocated("web");
    let grace = c.grace_period();

    // As a user uninstalls: the Namespace is deleted first, then the ServiceAccount and the RBAC
    // (file order), then the DaemonSet. `--wait=false`: no namespace controller finalizes the
    // Namespace here; the requests kubectl sends are the same.
    let manifests = concat!(env!("CARGO_MANIFEST_DIR"), "/daemonset");
    c.api.kubectl_ok(&["delete", "-f", manifests, "--wait=false"]);
    // The namespace controller deletes the pods; the kubelet stops them. At once, here: the
    // agents' credentials are already gone.
    stop_every_agent(&mut c, grace);
    assert_nothing_left(&c, np);
    for i in 0..3 {
        let logs = c.agents[i].logs();
        assert!(logs.contains("is being deleted"), "node-{}: no reason logged:\n{logs}", i + 1);
    }
    // The Service keeps its allocation (docs/design.md, "Install, upgrade, uninstall").
    assert_eq!(c.allocated("web"), before);
}

#[test]
fn helm_uninstall_removes_the_rules_and_a_reinstall_gives_the_same_ports() {
    require_root!();
    let mut c = Cluster::with_helm(2, &["--set", "config.iptables-forward-accept=true"], &[]);
    with_iptables_accepts(&c);
    let np = serve(&c, "web", &[(0, 0), (1, 1)]);
    let before = c.allocated("web").expect("allocated");
    let grace = c.grace_period();

    // helm deletes the DaemonSet first (background propagation), then the RBAC and the
    // ServiceAccount; the garbage collector deletes the pods.
    c.api.helm_ok(&["uninstall", "nodelb", "-n", AGENT_NS]);
    stop_every_agent(&mut c, grace);
    assert_nothing_left(&c, np);
    assert_eq!(c.allocated("web").as_ref(), Some(&before), "the allocation annotation stays");

    // Installed again: the Service gets the same node port back, served everywhere.
    c.api.helm_ok(&[
        "install",
        "nodelb",
        &chart_dir(),
        "-n",
        AGENT_NS,
        "--set",
        "config.iptables-forward-accept=true",
    ]);
    for i in 0..3 {
        c.start_agent(i, READY);
    }
    for i in 0..3 {
        c.wait_served(i, np, CHANGE);
    }
    c.wait_ingress_nodes("web", &[0, 1, 2], CHANGE);
    assert_eq!(c.allocated("web"), Some(before));
}

#[test]
fn a_restart_keeps_the_rules_deleting_the_daemonset_or_leaving_a_node_removes_them() {
    require_root!();
    let mut c = Cluster::new(2);
    let np = serve(&c, "web", &[(0, 0), (1, 1)]);
    let grace = c.grace_period();

    // A pod restart (or an eviction): the DaemonSet exists, the rules stay throughout.
    let loops = clients(&c, &[np]);
    let status = c.stop_agent(0, grace);
    assert!(status.is_some_and(|s| s.success()), "SIGTERM → {status:?}");
    assert!(c.nft(0).is_some(), "node-1: the table went with the agent");
    std::thread::sleep(Duration::from_secs(1));
    c.start_agent(0, READY);
    std::thread::sleep(Duration::from_secs(1));
    assert_no_request_lost(loops, 20);

    // The DaemonSet no longer runs on node-3 (its nodeSelector changed): the DaemonSet
    // controller deletes that pod and starts none; node-1's pod (still selected) is stopped too,
    // as a control: it is a rolling update there, the rules stay.
    for i in 0..2 {
        let node = format!("node-{}", i + 1);
        c.api.kubectl_ok(&["label", "node", &node, "nodelb.io/lb=yes"]);
    }
    let patch = r#"{"spec":{"template":{"spec":{"nodeSelector":{"nodelb.io/lb":"yes"}}}}}"#;
    c.api.kubectl_ok(&["patch", "daemonset", "nodelb", "-n", AGENT_NS, "--type=merge", "-p", patch]);
    for i in [2, 0] {
        let status = c.stop_agent(i, grace);
        assert!(status.is_some_and(|s| s.success()), "node-{}: SIGTERM → {status:?}", i + 1);
    }
    assert_eq!(c.nft(2), None, "node-3: the DaemonSet no longer runs there, its rules must go");
    assert!(c.get(2, np, Duration::from_millis(700)).is_err(), "node-3 still serves");
    assert!(c.nft(0).is_some(), "node-1: still selected, its rules must stay");
    c.get(0, np, T).expect("node-1 serves");
    c.start_agent(0, READY);

    // `kubectl delete ds`: the remaining pods are stopped after the DaemonSet is gone.
    c.api.kubectl_ok(&["delete", "daemonset", "nodelb", "-n", AGENT_NS, "--wait=false"]);
    for i in 0..2 {
        let status = c.stop_agent(i, grace);
        assert!(status.is_some_and(|s| s.success()), "node-{}: SIGTERM → {status:?}", i + 1);
        assert_eq!(c.nft(i), None, "node-{}: table left after the DaemonSet was deleted", i + 1);
    }
}

/// Rolls the DaemonSet as its RollingUpdate does (maxUnavailable 1): each node's agent stopped
/// as the kubelet stops it (its table must stay), a second without agent (the new container
/// is created), the new one started from the DaemonSet as stored and waited for, then `check`.
fn roll(c: &mut Cluster, mut check: impl FnMut(&Cluster, usize)) {
    let grace = c.grace_period();
    for i in 0..c.agents.len() {
        let status = c.stop_agent(i, grace);
        assert!(status.is_some_and(|s| s.success()), "node-{}: SIGTERM → {status:?}", i + 1);
        assert!(c.nft(i).is_some(), "node-{}: the table went with the old agent", i + 1);
        std::thread::sleep(Duration::from_secs(1));
        c.start_agent(i, READY);
        check(c, i);
    }
}

#[test]
fn a_helm_upgrade_rolled_node_by_node_loses_no_request_and_keeps_every_allocation() {
    require_root!();
    let mut c = Cluster::with_helm(3, &[], &[]);
    let web = serve(&c, "web", &[(0, 0), (1, 1)]);
    let api = serve(&c, "api", &[(2, 2)]);
    let before: BTreeMap<&str, _> = [("web", c.allocated("web")), ("api", c.allocated("api"))].into();
    let loops = clients(&c, &[web, api]);

    // A new version: image and configuration change, so the pod template does.
    c.api.helm_ok(&[
        "upgrade",
        "nodelb",
        &chart_dir(),
        "-n",
        AGENT_NS,
        "--reuse-values",
        "--set",
        "image.tag=0.1.1",
        "--set",
        "config.per-service-metrics=false",
    ]);
    let ds = c.daemonset();
    let container = &ds["spec"]["template"]["spec"]["containers"][0];
    assert_eq!(container["image"], "ghcr.io/nodelb/nodelb:0.1.1", "{container}");
    roll(&mut c, |c, i| {
        // The new configuration is the one running: no per-Service series any more.
        let scrape = c.agents[i].http("/metrics").expect("/metrics");
        let series = scrape.body.lines().any(|l| l.starts_with("nodelb_service_connections_total{"));
        assert!(!series, "node-{}: still runs the old configuration", i + 1);
    });
    std::thread::sleep(Duration::from_secs(1));
    assert_no_request_lost(loops, 50);
    let after: BTreeMap<&str, _> = [("web", c.allocated("web")), ("api", c.allocated("api"))].into();
    assert_eq!(after, before, "allocations moved during the upgrade");
    c.wait_ingress_nodes("web", &[0, 1, 2], CHANGE);
    c.wait_ingress_nodes("api", &[0, 1, 2], CHANGE);
}

/// From the previous release (one DaemonSet whose agents elected a leader and wrote the
/// Services, `scripts/build-previous.sh`) to this one with `helm upgrade`: the new RBAC and
/// admission policy take the writes from the old agents at once (their leader's renewals are
/// refused, its Lease expires), the controller's replicas start and one takes the leader Lease
/// over, the DaemonSet rolls node by node. No request is lost, no allocation moves, and a
/// Service created after is allocated by the controller.
#[test]
fn a_helm_upgrade_from_the_one_daemonset_release_keeps_every_allocation_and_request() {
    require_root!();
    let mut c = Cluster::with_previous_release(3);
    assert!(c.controllers.is_empty(), "the previous release had no controller");
    let old_leader = c.leader().expect("an old agent leads");
    assert!(old_leader.starts_with("node-"), "{old_leader}");
    let web = serve(&c, "web", &[(0, 0), (1, 1)]);
    let api = serve(&c, "api", &[(2, 2)]);
    let before: BTreeMap<&str, _> = [("web", c.allocated("web")), ("api", c.allocated("api"))].into();
    let loops = clients(&c, &[web, api]);

    c.api.helm_ok(&["upgrade", "nodelb", &chart_dir(), "-n", AGENT_NS]);
    // The Deployment's pods start while the DaemonSet rolls.
    c.start_controllers(None);
    roll(&mut c, |_, _| {});
    let leader = c.wait_leader(CHANGE);
    eprintln!("leader {old_leader} → {}", common::cluster::controller_name(leader));
    // The old agents' refused writes are the upgrade's; from here on everything is granted.
    c.api.clear_requests();
    std::thread::sleep(Duration::from_secs(1));
    assert_no_request_lost(loops, 50);
    let after: BTreeMap<&str, _> = [("web", c.allocated("web")), ("api", c.allocated("api"))].into();
    assert_eq!(after, before, "allocations moved during the upgrade");
    let np = serve(&c, "after", &[(0, 1)]);
    assert!(!after.values().flatten().any(|a| a.values().any(|p| *p == np)), "{np} is taken");
    c.wait_ingress_nodes("web", &[0, 1, 2], CHANGE);
    c.wait_ingress_nodes("after", &[0, 1, 2], CHANGE);
    c.assert_rbac_allows_every_request();
}

#[test]
fn a_new_version_replaces_an_older_rule_layout_atomically_under_traffic() {
    require_root!();
    let mut c = Cluster::new(2);
    let np = serve(&c, "web", &[(0, 0), (1, 1)]);
    let grace = c.grace_period();
    let status = c.stop_agent(0, grace);
    assert!(status.is_some_and(|s| s.success()), "SIGTERM → {status:?}");

    // What an older nodelb left in node-1's kernel: its own layout for the same Service
    // (tests/fixtures/web-layout-eb61413.nft), replacing the current table in one transaction.
    let fixture = include_str!("fixtures/web-layout-eb61413.nft").replace("20001", &np.to_string());
    let script = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(script.path(), format!("table inet nodelb\ndelete table inet nodelb\n{fixture}")).unwrap();
    c.nodes[0].exec_ok("nft", &["-f", script.path().to_str().unwrap()]);
    let old = c.nft(0).expect("old table");
    assert!(old.contains("chain ep4-") && !old.contains("filter-forward-last"), "not the old layout:\n{old}");
    for _ in 0..10 {
        c.get(0, np, T).expect("the old layout serves");
    }

    // The new agent starts while clients loop through node-1: its first sync replaces the
    // table in the same transaction that builds the new one.
    let l = ClientLoop::http(&c.client, IpAddr::V4(node_v4(0)), np, Duration::from_millis(10), T);
    std::thread::sleep(Duration::from_millis(500));
    c.start_agent(0, READY);
    let mut table = None;
    let ok = wait_until(CHANGE, || {
        table = c.nft(0);
        table.as_deref().is_some_and(|t| !t.contains("chain ep4-") && t.contains("filter-forward-last"))
    });
    assert!(ok, "node-1: the old layout is still there: {table:?}");
    std::thread::sleep(Duration::from_millis(500));
    assert_no_request_lost(vec![("node-1 (old layout → new)".to_string(), l)], 50);
}
