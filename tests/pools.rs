//! Node port pools (`NodePortPool`) end to end: the CRD installed with
//! `kubectl apply -f daemonset/` into a real kube-apiserver + etcd, three real agents (one per
//! node namespace), real packets client → node → backends (see `tests/common/cluster.rs`).
mod common;

use std::net::{IpAddr, Ipv4Addr};
use std::time::{Duration, Instant};

use common::cluster::Cluster;
use common::manifest::{EndpointSpec, PortSpec, ServiceSpec};
use common::topology::{Servers, backend_v4, http_get, wait_until};
use serde_json::{Value, json};

/// A pool or Service change to allocation / rules on every node.
const CHANGE: Duration = Duration::from_secs(15);

fn label_node(c: &Cluster, node: &str, label: &str) {
    c.api.kubectl_ok(&["label", "node", node, label, "--overwrite"]);
}

fn pool(name: &str, ranges: &[(u32, u32)], spec: Value) -> Value {
    let mut spec = spec;
    spec["ports"] = ranges.iter().map(|(a, b)| json!({"start": a, "end": b})).collect();
    json!({"apiVersion": "nodelb.io/v1alpha1", "kind": "NodePortPool", "metadata": {"name": name}, "spec": spec})
}

fn apply(c: &Cluster, obj: &Value) {
    let out = c.api.kubectl_stdin(&["apply", "-f", "-"], &obj.to_string());
    assert!(out.status.success(), "kubectl apply {obj}: {}", String::from_utf8_lossy(&out.stderr));
}

/// Replaces a pool with the test's own client (no `kubectl` process): where a reaction time is
/// measured, `kubectl apply`'s own time (process start, discovery; 50 ms to over a second on the
/// loaded test machine) would be most of the number.
fn edit(c: &Cluster, obj: &Value) {
    c.api.replace_spec(obj).unwrap_or_else(|e| panic!("replace the spec of {obj}: {e:?}"));
}

/// `kubectl apply` refused; its message.
fn apply_refused(c: &Cluster, obj: &Value) -> String {
    let out = c.api.kubectl_stdin(&["apply", "-f", "-"], &obj.to_string());
    assert!(!out.status.success(), "kubectl apply should be refused: {obj}");
    String::from_utf8_lossy(&out.stderr).into_owned()
}

/// A Service with label `app=<name>` and one endpoint on backend `b`, its slices made by the test.
fn create_labelled(c: &Cluster, name: &str, b: usize, extra_labels: Value) {
    create_in(c, "default", name, b, extra_labels, json!({}));
}

/// [`create_labelled`] in namespace `ns`, with `annotations`.
fn create_in(c: &Cluster, ns: &str, name: &str, b: usize, extra_labels: Value, annotations: Value) {
    let mut spec = ServiceSpec::new(name)
        .port(PortSpec::tcp(80, None))
        .endpoint(EndpointSpec::remote(backend_v4(b), "node-2"));
    spec.namespace = ns.to_string();
    let mut svc = spec.service();
    svc["spec"].as_object_mut().unwrap().remove("selector");
    let mut labels = json!({"app": name});
    for (k, v) in extra_labels.as_object().into_iter().flatten() {
        labels[k] = v.clone();
    }
    svc["metadata"]["labels"] = labels;
    for (k, v) in annotations.as_object().into_iter().flatten() {
        svc["metadata"]["annotations"][k] = v.clone();
    }
    c.api.create(svc).unwrap_or_else(|e| panic!("create {name}: {e:?}"));
    for s in spec.slices() {
        c.api.create(s).unwrap_or_else(|e| panic!("create slice of {name}: {e:?}"));
    }
}

fn pool_status(c: &Cluster, name: &str) -> Value {
    c.api.get("nodelb.io/v1alpha1", "NodePortPool", "", name).map(|p| p["status"].clone()).unwrap_or_default()
}

/// `status/reason` of condition `type_` in a pool status.
fn condition(st: &Value, type_: &str) -> String {
    st["conditions"]
        .as_array()
        .and_then(|cs| cs.iter().find(|c| c["type"] == type_))
        .map(|c| format!("{}/{}", c["status"].as_str().unwrap_or(""), c["reason"].as_str().unwrap_or("")))
        .unwrap_or_default()
}

/// Waits until node `i` refuses `port` (no rule there: nothing listens, the kernel resets).
fn wait_refused(c: &Cluster, i: usize, port: u16) {
    let ok = wait_until(CHANGE, || c.get(i, port, Duration::from_millis(500)).is_err());
    assert!(ok, "node-{} still serves {port}: {:?}", i + 1, c.nft(i));
}

/// Node `i` keeps refusing `port` for a while (not a moment between two syncs).
fn stays_refused(c: &Cluster, i: usize, port: u16) {
    for _ in 0..3 {
        assert!(c.get(i, port, Duration::from_millis(500)).is_err(), "node-{} serves {port}", i + 1);
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// Waits until `default/name` is allocated, with its numbers all in `range`.
fn wait_allocated_in(c: &Cluster, name: &str, range: (u16, u16)) -> u16 {
    let mut got = None;
    let ok = wait_until(CHANGE, || {
        got = c.allocated(name).and_then(|a| a.get("80/TCP").copied());
        got.is_some_and(|n| (range.0..=range.1).contains(&n))
    });
    assert!(ok, "default/{name}: {got:?} not in {range:?}: {:#}", c.service_json(name).unwrap_or_default());
    got.unwrap()
}

#[test]
fn pools_choose_ports_nodes_and_follow_edits_without_restart() {
    require_root!();
    let c = Cluster::new(2);
    label_node(&c, "node-1", "zone=a");
    label_node(&c, "node-2", "zone=b");
    label_node(&c, "node-3", "zone=b");

    // The schema refuses what it can express (API server, not nodelb).
    let reversed = apply_refused(&c, &pool("reversed", &[(20500, 20400)], json!({})));
    assert!(reversed.contains("start must not be greater than end"), "{reversed}");
    let nodeports = apply_refused(&c, &pool("nodeports", &[(30000, 30010)], json!({})));
    assert!(nodeports.contains("NodePort range"), "{nodeports}");
    let out_of_range = apply_refused(&c, &pool("big", &[(1, 65536)], json!({})));
    assert!(out_of_range.contains("65535"), "{out_of_range}");
    // nodelb refuses what the schema cannot (a bad selector operator): the pool does not exist
    // for selection, and the agents log why.
    apply(
        &c,
        &pool(
            "bad-selector",
            &[(20900, 20909)],
            json!({"serviceSelector": {"matchExpressions": [{"key": "x", "operator": "Gt", "values": ["1"]}]}}),
        ),
    );

    // Two pools on disjoint nodes, each for its own Services.
    let zone = |z: &str| json!({"matchLabels": {"zone": z}});
    apply(
        &c,
        &pool(
            "zone-a",
            &[(20100, 20199)],
            json!({"nodeSelector": zone("a"), "serviceSelector": {"matchLabels": {"app": "web-a"}}}),
        ),
    );
    apply(
        &c,
        &pool(
            "zone-b",
            &[(20200, 20299)],
            json!({"nodeSelector": zone("b"), "serviceSelector": {"matchLabels": {"app": "web-b"}}}),
        ),
    );
    create_labelled(&c, "web-a", 0, json!({}));
    create_labelled(&c, "web-b", 1, json!({}));
    let np_a = wait_allocated_in(&c, "web-a", (20100, 20199));
    let np_b = wait_allocated_in(&c, "web-b", (20200, 20299));
    // Served on the selected nodes, refused on the others (real packets), and the status lists
    // only the selected nodes.
    c.wait_served(0, np_a, CHANGE);
    c.wait_served(1, np_b, CHANGE);
    c.wait_served(2, np_b, CHANGE);
    stays_refused(&c, 1, np_a);
    stays_refused(&c, 2, np_a);
    stays_refused(&c, 0, np_b);
    c.wait_ingress_nodes("web-a", &[0], CHANGE);
    c.wait_ingress_nodes("web-b", &[1, 2], CHANGE);
    // `nodelb plan` on each node applies the pools as its agent does.
    for i in 0..3 {
        let plan = c.wait_plan_is_table(i, CHANGE);
        assert_eq!(
            plan.contains(&format!(" {np_a} ")),
            i == 0,
            "node-{}: {np_a} in the plan:\n{plan}",
            i + 1
        );
    }

    // The leader's status on each pool, and kubectl's columns.
    let ok = wait_until(CHANGE, || {
        let st = pool_status(&c, "zone-a");
        st["observedGeneration"] == 1
            && st["nodes"] == json!(["node-1"])
            && st["allocated"] == 1
            && st["portRanges"] == "20100-20199"
            && condition(&st, "Ready") == "True/InForce"
            && condition(&st, "Conflict") == "False/NoOverlap"
    });
    assert!(ok, "zone-a status: {:#}", pool_status(&c, "zone-a"));
    let table = c.api.kubectl_ok(&["get", "npp", "-o", "wide"]);
    assert!(table.contains("PORTS") && table.contains("CONFLICT"), "{table}");
    let row = table
        .lines()
        .find(|l| l.starts_with("zone-a"))
        .unwrap_or_default()
        .split_whitespace()
        .collect::<Vec<_>>();
    assert_eq!(row[..7], ["zone-a", "20100-20199", "0", "1", "99", "1", "True"], "{table}");
    // A newer pool overlapping zone-b on nodes both select: Conflict on the newer, naming the
    // older; it takes only its part outside the overlap.
    apply(&c, &pool("overlap", &[(20290, 20309)], json!({"nodeSelector": zone("b"), "autoAssign": false})));
    let ok = wait_until(CHANGE, || {
        let st = pool_status(&c, "overlap");
        condition(&st, "Conflict") == "True/Overlap"
            && st["conditions"].to_string().contains("zone-b")
            && st["portRanges"] == "20300-20309"
    });
    assert!(ok, "overlap status: {:#}", pool_status(&c, "overlap"));
    assert_eq!(condition(&pool_status(&c, "zone-b"), "Conflict"), "False/NoOverlap");
    c.api.kubectl_ok(&["delete", "nodeportpool", "overlap"]);
    // An invalid pool (nodelb's check) says why on its status.
    let ok = wait_until(CHANGE, || condition(&pool_status(&c, "bad-selector"), "Ready") == "False/Invalid");
    assert!(ok, "bad-selector status: {:#}", pool_status(&c, "bad-selector"));

    // A Service no pool accepts is refused with a reason (condition + Event), not allocated.
    create_labelled(&c, "orphan", 0, json!({}));
    c.wait_condition("orphan", "nodelb.io/Allocated", "False", "NoPool", CHANGE);
    assert!(c.allocated("orphan").is_none());
    let ok = wait_until(CHANGE, || !c.events("orphan", "NoNodePortPool").is_empty());
    assert!(ok, "no NoNodePortPool Event for orphan");

    // Hot reload, nodeSelector: zone-a now selects every zone. No restart; measured.
    let started = Instant::now();
    edit(
        &c,
        &pool(
            "zone-a",
            &[(20100, 20199)],
            json!({"nodeSelector": {"matchExpressions": [{"key": "zone", "operator": "In", "values": ["a", "b"]}]}, "serviceSelector": {"matchLabels": {"app": "web-a"}}}),
        ),
    );
    c.wait_served(1, np_a, CHANGE);
    c.wait_served(2, np_a, CHANGE);
    eprintln!("pool nodeSelector edit → served on a newly selected node: {:?}", started.elapsed());
    c.wait_ingress_nodes("web-a", &[0, 1, 2], CHANGE);
    // And back to zone b only: node-1 removes its rules, nodes 2 and 3 keep serving.
    apply(
        &c,
        &pool(
            "zone-a",
            &[(20100, 20199)],
            json!({"nodeSelector": zone("b"), "serviceSelector": {"matchLabels": {"app": "web-a"}}}),
        ),
    );
    wait_refused(&c, 0, np_a);
    c.wait_served(1, np_a, CHANGE);
    c.wait_ingress_nodes("web-a", &[1, 2], CHANGE);
    assert_eq!(c.allocated("web-a").unwrap()["80/TCP"], np_a, "a nodeSelector edit does not move the port");

    // Shrinking a range reallocates exactly the Services outside it, with an Event.
    let started = Instant::now();
    edit(
        &c,
        &pool(
            "zone-b",
            &[(20250, 20299)],
            json!({"nodeSelector": zone("b"), "serviceSelector": {"matchLabels": {"app": "web-b"}}}),
        ),
    );
    let moved = wait_allocated_in(&c, "web-b", (20250, 20299));
    c.wait_served(1, moved, CHANGE);
    eprintln!("pool range shrink → reallocated and served: {:?}", started.elapsed());
    wait_refused(&c, 1, np_b);
    assert_eq!(c.allocated("web-a").unwrap()["80/TCP"], np_a, "web-a was inside its pool: untouched");
    let ok = wait_until(CHANGE, || !c.events("web-b", "NodePortReallocated").is_empty());
    assert!(ok, "no NodePortReallocated Event for web-b");

    // Deleting every pool object brings back the flags' pool (every node, --port-range).
    for p in ["zone-a", "zone-b", "bad-selector"] {
        c.api.kubectl_ok(&["delete", "nodeportpool", p]);
    }
    let orphan = wait_allocated_in(&c, "orphan", (20000, 29999));
    for i in 0..3 {
        c.wait_served(i, orphan, CHANGE);
    }
}

#[test]
fn servicelb_labels_choose_the_nodes_as_k3s_does() {
    require_root!();
    let c = Cluster::new(2);
    const ENABLELB: &str = "svccontroller.k3s.cattle.io/enablelb";
    const LBPOOL: &str = "svccontroller.k3s.cattle.io/lbpool";
    create_labelled(&c, "plain", 0, json!({}));
    create_labelled(&c, "edge", 1, json!({LBPOOL: "edge"}));
    let plain = wait_allocated_in(&c, "plain", (20000, 29999));
    let edge = wait_allocated_in(&c, "edge", (20000, 29999));
    // No node carries enablelb: every node serves everything (lbpool alone means nothing).
    for i in 0..3 {
        c.wait_served(i, plain, CHANGE);
        c.wait_served(i, edge, CHANGE);
    }

    // node-1 and node-2 opt in, node-1 in lbpool "edge"; node-3 opts out explicitly.
    label_node(&c, "node-1", &format!("{ENABLELB}=true"));
    label_node(&c, "node-1", &format!("{LBPOOL}=edge"));
    label_node(&c, "node-2", &format!("{ENABLELB}=true"));
    label_node(&c, "node-3", &format!("{ENABLELB}=false"));
    wait_refused(&c, 2, plain);
    wait_refused(&c, 1, edge);
    wait_refused(&c, 2, edge);
    c.wait_served(0, plain, CHANGE);
    c.wait_served(1, plain, CHANGE);
    c.wait_served(0, edge, CHANGE);
    stays_refused(&c, 2, plain);
    c.wait_ingress_nodes("plain", &[0, 1], CHANGE);
    c.wait_ingress_nodes("edge", &[0], CHANGE);
    // The allocation does not move: ServiceLB labels choose nodes, never ports.
    assert_eq!(c.allocated("edge").unwrap()["80/TCP"], edge);

    // A pool's nodeSelector and the ServiceLB labels must both select a node.
    label_node(&c, "node-2", "zone=b");
    apply(&c, &pool("zone-b", &[(20000, 29999)], json!({"nodeSelector": {"matchLabels": {"zone": "b"}}})));
    wait_refused(&c, 0, plain);
    c.wait_served(1, plain, CHANGE);
    stays_refused(&c, 2, plain);
    c.wait_ingress_nodes("plain", &[1], CHANGE);
    // edge: its lbpool node (node-1) is outside zone b, so no node serves it.
    wait_refused(&c, 0, edge);
    c.wait_ingress_nodes("edge", &[], CHANGE);
    c.api.kubectl_ok(&["delete", "nodeportpool", "zone-b"]);

    // Removing the label from every node switches the selection off: all nodes serve again.
    for n in ["node-1", "node-2", "node-3"] {
        label_node(&c, n, &format!("{ENABLELB}-"));
    }
    for i in 0..3 {
        c.wait_served(i, plain, CHANGE);
        c.wait_served(i, edge, CHANGE);
    }
}

/// node-1's second address, on a link of its own (`edge0`), published in its Node
/// object as its ExternalIP; the client reaches it through node-1.
const SECOND_V4: Ipv4Addr = Ipv4Addr::new(192, 0, 2, 1);
/// node-2's ExternalIP in the `types` step: on no interface of any node (NATed by a cloud).
const NATED_V4: Ipv4Addr = Ipv4Addr::new(198, 51, 100, 200);

/// `GET /` from the client to `addr:port` served, within `CHANGE`.
fn wait_served_at(c: &Cluster, addr: Ipv4Addr, port: u16) {
    let mut last = None;
    let ok = wait_until(CHANGE, || {
        last = Some(http_get(&c.client, IpAddr::V4(addr), port, Duration::from_millis(500)));
        last.as_ref().is_some_and(|r| r.is_ok())
    });
    assert!(ok, "{addr}:{port} not served: {last:?}: {:?}", c.nft(0));
}

/// `addr:port` refused (waited for, then for a while: not a moment between two syncs).
fn refused_at(c: &Cluster, addr: Ipv4Addr, port: u16) {
    let get = || http_get(&c.client, IpAddr::V4(addr), port, Duration::from_millis(500));
    let ok = wait_until(CHANGE, || get().is_err());
    assert!(ok, "{addr}:{port} still served: {:?}", c.nft(0));
    for _ in 0..3 {
        assert!(get().is_err(), "{addr}:{port} served");
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// Waits until the ingress IPs of `default/name` are exactly `want`.
fn wait_ingress(c: &Cluster, name: &str, want: &[Ipv4Addr]) {
    let mut want: Vec<String> = want.iter().map(|a| a.to_string()).collect();
    want.sort();
    let ok = wait_until(CHANGE, || c.ingress_ips(name) == want);
    assert!(ok, "default/{name}: ingress {:?}, want {want:?}", c.ingress_ips(name));
}

/// Only node-1's second address answers on `port` (every node's first address refuses), the
/// Service `edge` lists only it, and the `edge` pool's status only node-1.
fn served_only_at_second_address(c: &Cluster, port: u16, nodes: &[Ipv4Addr]) {
    wait_served_at(c, SECOND_V4, port);
    for n in nodes {
        refused_at(c, *n, port);
    }
    wait_ingress(c, "edge", &[SECOND_V4]);
    let ok = wait_until(CHANGE, || pool_status(c, "edge")["nodes"] == json!(["node-1"]));
    assert!(ok, "edge pool status: {:#}", pool_status(c, "edge"));
}

/// Gives node-1 a second address, [`SECOND_V4`], on a link of its own (`edge0`), routed from
/// the client, and lists it as node-1's ExternalIP.
fn add_second_address(c: &Cluster) {
    let node1 = &c.nodes[0];
    // This kernel has no dummy links: a veth pair inside the node is a link of its own.
    node1.ip(&["link", "add", "edge0", "type", "veth", "peer", "name", "edge0p"]);
    node1.ip(&["addr", "add", &format!("{SECOND_V4}/32"), "dev", "edge0"]);
    node1.ip(&["link", "set", "edge0p", "up"]);
    node1.ip(&["link", "set", "edge0", "up"]);
    c.client.ip(&[
        "route",
        "add",
        &format!("{SECOND_V4}/32"),
        "via",
        &common::cluster::node_v4(0).to_string(),
    ]);
    c.api.patch_status(
        "v1",
        "Node",
        "",
        "node-1",
        json!({"status": {"addresses": [
            {"type": "InternalIP", "address": common::cluster::node_v4(0).to_string()},
            {"type": "ExternalIP", "address": SECOND_V4.to_string()},
            {"type": "Hostname", "address": "node-1"},
        ]}}),
    );
}

#[test]
fn pool_addresses_choose_which_node_address_answers() {
    require_root!();
    let c = Cluster::new(1);
    add_second_address(&c);
    let nodes: Vec<Ipv4Addr> = (0..3).map(common::cluster::node_v4).collect();
    let edge = |addresses: Value| {
        pool(
            "edge",
            &[(20300, 20399)],
            json!({"addresses": addresses, "serviceSelector": {"matchLabels": {"app": "edge"}}}),
        )
    };

    // cidrs: only node-1's second address answers; its first address and the other nodes
    // (no address in the CIDR) refuse; the status lists that address only.
    apply(&c, &edge(json!({"cidrs": ["192.0.2.0/24"]})));
    create_labelled(&c, "edge", 0, json!({}));
    let port = wait_allocated_in(&c, "edge", (20300, 20399));
    served_only_at_second_address(&c, port, &nodes);
    // A process on node-1's first address, on the same port: it answers there, node-1 keeps
    // serving the pool's address, and, though node-1's Lease lists the port as listened on, no
    // Event says the Service's port is in use.
    let first = common::cluster::node_v4(0);
    let squatter = Servers::start_at(&c.nodes[0], "squatter", first.into(), port, port);
    let get = |addr: Ipv4Addr| http_get(&c.client, IpAddr::V4(addr), port, Duration::from_millis(500));
    assert!(
        wait_until(CHANGE, || get(first).is_ok_and(|b| b.contains("backend=squatter"))),
        "{:?}",
        get(first)
    );
    let listed = || {
        let lease =
            c.api.get("coordination.k8s.io/v1", "Lease", common::cluster::AGENT_NS, "nodelb-node-node-1");
        lease.is_some_and(|l| {
            l["metadata"]["annotations"]["nodelb.io/listening-ports"]
                .as_str()
                .is_some_and(|v| v.split(',').any(|p| p == format!("{port}/TCP")))
        })
    };
    assert!(wait_until(CHANGE, listed), "node-1's Lease does not list {port}/TCP");
    // Rounds after the Lease changed, for an Event to have been recorded if one were due.
    std::thread::sleep(Duration::from_secs(3));
    assert!(get(SECOND_V4).is_ok_and(|b| b.contains("backend=be")), "{:?}", get(SECOND_V4));
    let in_use: Vec<Value> = c
        .api
        .list("v1", "Event", Some("default"))
        .into_iter()
        .filter(|e| e["reason"] == "NodePortInUse" && e["involvedObject"]["name"] == "edge")
        .collect();
    assert!(in_use.is_empty(), "{in_use:#?}");
    drop(squatter);

    // Hot reload: the CIDR of the first addresses moves it there, on every node.
    let started = Instant::now();
    edit(&c, &edge(json!({"cidrs": ["203.0.113.0/24"]})));
    for n in &nodes {
        wait_served_at(&c, *n, port);
    }
    eprintln!("pool addresses edit → served on the newly selected addresses: {:?}", started.elapsed());
    refused_at(&c, SECOND_V4, port);
    wait_ingress(&c, "edge", &nodes);
    let sorted_nodes = || {
        let mut n: Vec<String> =
            serde_json::from_value(pool_status(&c, "edge")["nodes"].clone()).unwrap_or_default();
        n.sort();
        n
    };
    let ok = wait_until(CHANGE, || sorted_nodes() == ["node-1", "node-2", "node-3"]);
    assert!(ok, "edge pool status: {:#}", pool_status(&c, "edge"));

    // types: the Node object's ExternalIP (node-1's second address). node-2's Node object has
    // an ExternalIP no interface of node-2 has (a cloud's NATed address): node-2 serves nothing,
    // so the status must not list it.
    c.api.patch_status(
        "v1",
        "Node",
        "",
        "node-2",
        json!({"status": {"addresses": [
            {"type": "InternalIP", "address": nodes[1].to_string()},
            {"type": "ExternalIP", "address": NATED_V4.to_string()},
            {"type": "Hostname", "address": "node-2"},
        ]}}),
    );
    apply(&c, &edge(json!({"types": ["ExternalIP"]})));
    served_only_at_second_address(&c, port, &nodes);
    // interfaces: node-1's edge0 (its second address); the other nodes have no edge0, and the
    // Node objects' addresses are not on it: the status lists the second address only.
    apply(&c, &edge(json!({"interfaces": ["edge0"]})));
    wait_ingress(&c, "edge", &[SECOND_V4]);
    wait_served_at(&c, SECOND_V4, port);
    for n in &nodes {
        refused_at(&c, *n, port);
    }
    // interfaces: node-1's eth0 (its first address), nobody else's edge0.
    apply(&c, &edge(json!({"interfaces": ["eth0"], "cidrs": ["203.0.113.1/32"]})));
    wait_served_at(&c, nodes[0], port);
    refused_at(&c, SECOND_V4, port);
    refused_at(&c, nodes[1], port);
    wait_ingress(&c, "edge", &nodes[..1]);
    assert_eq!(c.allocated("edge").unwrap()["80/TCP"], port, "an addresses edit does not move the port");
}

/// Manifests mode (no cluster): NodePortPool files in the manifests directory go through the
/// same decisions, the node's labels come from `--node-labels`, and edits are hot-reloaded.
/// Real packets from a client namespace through the node namespace to a backend.
#[test]
fn manifests_mode_pools_restrict_ports_and_nodes_with_hot_reload() {
    use common::agent::{Agent, nodelb};
    use common::topology::{NODE_V4, Topology, http_get};
    require_root!();
    const T: Duration = Duration::from_secs(5);
    let topo = Topology::new(1, 1);
    let client = topo.client(0);
    let get = |port: u16| http_get(client, NODE_V4.into(), port, Duration::from_millis(700));
    let pool_file = |ranges: &[(u32, u32)], zone: &str| {
        let p = pool("edge", ranges, json!({"nodeSelector": {"matchLabels": {"zone": zone}}}));
        serde_saphyr::to_string(&p).unwrap()
    };
    let web =
        ServiceSpec::new("web").port(PortSpec::tcp(80, None)).endpoint(EndpointSpec::local(backend_v4(0)));
    let files = [("pool.yaml", pool_file(&[(21000, 21009)], "a")), ("web.yaml", web.render())];
    let mut agent = Agent::start(&topo.node, &files, &["--node-labels", "zone=a"]);
    agent.wait_ready(Duration::from_secs(15));
    agent.wait_state("default/web", "programmed", T);
    let np = agent.node_port("default/web", 80, "TCP").unwrap();
    assert!((21000..=21009).contains(&np), "allocated from the pool: {np}");
    assert_eq!(agent.service_status("default/web").unwrap()["pool"], "edge");
    assert!(wait_until(T, || get(np).is_ok()), "not served on {np}");

    // `nodelb plan` shows the pool each Service got, and refuses what the pool's nodeSelector
    // does not select on this node.
    let dir = agent.manifests_dir().to_str().unwrap().to_string();
    let state = agent.state_file().to_str().unwrap().to_string();
    let plan = |labels: &str| {
        let out = nodelb(
            &topo.node,
            &[
                "plan",
                "--manifests",
                &dir,
                "--state-file",
                &state,
                "--node-name",
                "node-1",
                "--node-labels",
                labels,
            ],
        );
        assert!(out.status.success(), "plan: {}", String::from_utf8_lossy(&out.stderr));
        (String::from_utf8_lossy(&out.stdout).into_owned(), String::from_utf8_lossy(&out.stderr).into_owned())
    };
    let (rules, notes) = plan("zone=a");
    assert!(notes.contains("pool: default/web → edge"), "{notes}");
    assert!(rules.contains(&np.to_string()), "{rules}");
    let (rules, notes) = plan("zone=b");
    assert!(notes.contains("does not select this node (nodeSelector)"), "{notes}");
    assert!(!rules.contains(&np.to_string()), "{rules}");

    // Hot reload: the pool's range moves; the Service is reallocated inside it, the old port
    // stops answering, the new one answers. No restart.
    let started = Instant::now();
    agent.write_manifest("pool.yaml", &pool_file(&[(21100, 21109)], "a"));
    let mut moved = None;
    let ok = wait_until(T, || {
        moved = agent.node_port("default/web", 80, "TCP").filter(|p| (21100..=21109).contains(p));
        moved.is_some_and(|p| get(p).is_ok())
    });
    assert!(ok, "not reallocated into 21100-21109: {:?}", agent.status());
    eprintln!("manifests pool range edit → reallocated and served: {:?}", started.elapsed());
    let moved = moved.unwrap();
    assert!(get(np).is_err(), "the old port {np} still answers");
    // Never silently: no API to record an Event on, so the agent says it in its log.
    let logs = agent.logs();
    assert!(
        logs.lines().any(|l| l.contains("node port reallocated")
            && l.contains(&np.to_string())
            && l.contains(&moved.to_string())),
        "no log line for {np} → {moved}"
    );
    // How full the pool is, on /metrics (manifests mode has no pool status): its one Service
    // holds one number of the ten.
    let body = agent.http("/metrics").expect("/metrics").body;
    for want in [
        r#"nodelb_pool_ports{pool="edge",state="allocated"} 1"#,
        r#"nodelb_pool_ports{pool="edge",state="free"} 9"#,
    ] {
        assert!(body.lines().any(|l| l == want), "no `{want}` on /metrics:\n{body}");
    }
    let out = nodelb(&topo.node, &["status", "--http-addr", "127.0.0.1:9470"]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("    pool: edge"), "`nodelb status` does not name the pool:\n{text}");

    // An invalid edit: the problem names the file, the pool and the value; the last valid
    // version stays in force (still served).
    let bad = pool(
        "edge",
        &[(21100, 21109)],
        json!({"nodeSelector": {"matchExpressions": [{"key": "zone", "operator": "Gt", "values": ["1"]}]}}),
    );
    agent.write_manifest("pool.yaml", &serde_saphyr::to_string(&bad).unwrap());
    let ok = wait_until(T, || {
        agent.status().is_some_and(|s| {
            s["problems"].as_array().into_iter().flatten().any(|p| {
                let p = p.as_str().unwrap_or("");
                p.contains("pool.yaml: NodePortPool edge: spec.nodeSelector") && p.contains("\"Gt\"")
            })
        })
    });
    assert!(ok, "no problem naming pool.yaml / edge / Gt: {:?}", agent.status());
    assert!(get(moved).is_ok(), "the last valid pool stays in force");

    // A nodeSelector that does not match --node-labels: this node stops serving the Service.
    agent.write_manifest("pool.yaml", &pool_file(&[(21100, 21109)], "b"));
    assert!(wait_until(T, || get(moved).is_err()), "still served with nodeSelector zone=b");
    let st = agent.service_status("default/web").unwrap();
    assert!(st.to_string().contains("does not select this node"), "{st}");
    assert_eq!(agent.node_port("default/web", 80, "TCP"), Some(moved), "the allocation stays");
    // Back on zone a: served again on the same port.
    agent.write_manifest("pool.yaml", &pool_file(&[(21100, 21109)], "a"));
    assert!(wait_until(T, || get(moved).is_ok()), "not served again on {moved}");
    // Restarted with other labels (the flags are read at start): not served.
    agent.extra_args = vec!["--node-labels".into(), "zone=b".into()];
    agent.restart();
    agent.wait_ready(Duration::from_secs(15));
    assert!(wait_until(T, || get(moved).is_err()), "served with --node-labels zone=b");
}

/// Manifests mode reads `portMode` through the same decisions: a `ServicePort` pool serves the
/// Services it selects on their own ports (no annotation), the catch-all pool allocates the
/// rest from its range, and a port the pool does not permit is refused with the pool named.
#[test]
fn manifests_mode_serves_a_service_port_pool_on_the_services_own_ports() {
    use common::agent::Agent;
    use common::manifest::render_docs;
    use common::topology::{NODE_V4, Topology};
    require_root!();
    const T: Duration = Duration::from_secs(5);
    let topo = Topology::new(1, 1);
    let client = topo.client(0);
    let get = |port: u16| http_get(client, NODE_V4.into(), port, Duration::from_millis(700));
    let pools = render_docs(&[
        pool(
            "ingress",
            &[(80, 80), (443, 443)],
            json!({"portMode": "ServicePort", "serviceSelector": {"matchLabels": {"tier": "ingress"}}, "priority": 1}),
        ),
        pool("rest", &[(21000, 21009)], json!({"priority": 10})),
    ]);
    let labelled = |spec: &ServiceSpec| {
        let mut svc = spec.service();
        svc["metadata"]["labels"] = json!({"tier": "ingress"});
        let mut docs = vec![svc];
        docs.extend(spec.slices());
        render_docs(&docs)
    };
    let ingress = ServiceSpec::new("ingress")
        .port(PortSpec::tcp(80, None))
        .port(PortSpec::tcp(443, None))
        .endpoint(EndpointSpec::local(backend_v4(0)));
    let odd =
        ServiceSpec::new("odd").port(PortSpec::tcp(8443, None)).endpoint(EndpointSpec::local(backend_v4(0)));
    let web =
        ServiceSpec::new("web").port(PortSpec::tcp(80, None)).endpoint(EndpointSpec::local(backend_v4(0)));
    let files = [
        ("pools.yaml", pools),
        ("ingress.yaml", labelled(&ingress)),
        ("odd.yaml", labelled(&odd)),
        ("web.yaml", web.render()),
    ];
    let mut agent = Agent::start(&topo.node, &files, &[]);
    agent.wait_ready(Duration::from_secs(15));
    agent.wait_state("default/ingress", "programmed", T);
    assert_eq!(agent.node_port("default/ingress", 80, "TCP"), Some(80), "{:#?}", agent.status());
    assert_eq!(agent.node_port("default/ingress", 443, "TCP"), Some(443));
    assert_eq!(agent.service_status("default/ingress").unwrap()["pool"], "ingress");
    for port in [80, 443] {
        assert!(wait_until(T, || get(port).is_ok_and(|b| b.contains("backend=be"))), "not served on {port}");
    }
    agent.wait_state("default/web", "programmed", T);
    let np = agent.node_port("default/web", 80, "TCP").unwrap();
    assert!((21000..=21009).contains(&np), "web is allocated from the catch-all pool: {np}");
    let st = agent.service_status("default/odd").unwrap();
    assert!(
        st.to_string()
            .contains("asks for node port 8443, which is not allowed (allowed: pool ingress 80,443)"),
        "{st}"
    );
}

/// A process bound to one node address keeps that address's port; a pool that serves the node's
/// other address takes the same port there, and leaves it when a process binds that address too.
#[test]
fn a_listener_on_one_address_leaves_the_port_to_a_pool_on_the_others() {
    use common::agent::Agent;
    use common::manifest::render_docs;
    use common::topology::{NODE_BACKEND_V4, NODE_V4, Topology};
    require_root!();
    const T: Duration = Duration::from_secs(10);
    let topo = Topology::new(1, 1);
    let client = topo.client(0);
    let get = |addr: Ipv4Addr| http_get(client, addr.into(), 443, Duration::from_millis(700));
    // A process of the node on its backend-side address only.
    let _elsewhere = Servers::start_at(&topo.node, "node-elsewhere", NODE_BACKEND_V4.into(), 443, 443);
    let pools = render_docs(&[pool(
        "edge",
        &[(443, 443)],
        json!({"portMode": "ServicePort", "serviceSelector": {"matchLabels": {"tier": "edge"}},
               "addresses": {"cidrs": [format!("{NODE_V4}/32")]}, "priority": 1}),
    )]);
    let edge =
        ServiceSpec::new("edge").port(PortSpec::tcp(443, None)).endpoint(EndpointSpec::local(backend_v4(0)));
    let mut svc = edge.service();
    svc["metadata"]["labels"] = json!({"tier": "edge"});
    let mut docs = vec![svc];
    docs.extend(edge.slices());
    let files = [("pools.yaml", pools), ("edge.yaml", render_docs(&docs))];
    let mut agent = Agent::start(&topo.node, &files, &["--resync-period", "1s"]);
    agent.wait_ready(Duration::from_secs(15));
    agent.wait_state("default/edge", "programmed", T);
    assert_eq!(agent.node_port("default/edge", 443, "TCP"), Some(443), "{:#?}", agent.status());
    assert!(
        wait_until(T, || get(NODE_V4).is_ok_and(|b| b.contains("backend=be"))),
        "not served at the pool's address"
    );
    let other = get(NODE_BACKEND_V4);
    assert!(
        other.as_ref().is_ok_and(|b| b.contains("backend=node-elsewhere")),
        "the process keeps its address: {other:?}"
    );

    // A process binds the pool's address too: the node leaves the port to it and says why.
    let _here = Servers::start_at(&topo.node, "node-here", NODE_V4.into(), 443, 443);
    let ok = wait_until(T, || get(NODE_V4).is_ok_and(|b| b.contains("backend=node-here")));
    assert!(ok, "the process on the pool's address does not answer: {:?}", get(NODE_V4));
    let st = agent.service_status("default/edge").unwrap();
    assert!(st.to_string().contains(&format!("a process listens on {NODE_V4}:443/TCP")), "{st}");
}

/// The chart's default pool (`pools.defaultPool`): created by the same `helm install` that
/// installs the CRD (Helm applies crds/ first and waits for them), its ranges from
/// `config.port-range`; Services are allocated from it and served, and it reports Ready.
#[test]
fn the_charts_default_pool_is_installed_with_the_release_and_used() {
    require_root!();
    let c = Cluster::with_helm(
        1,
        &["--set", "pools.defaultPool.enabled=true", "--set", "config.port-range=21000-21999"],
        &[],
    );
    let obj = c.api.get("nodelb.io/v1alpha1", "NodePortPool", "", "default").expect("pool default");
    assert_eq!(obj["spec"]["ports"], json!([{"start": 21000, "end": 21999}]), "{obj:#}");
    assert_eq!(obj["metadata"]["labels"]["app.kubernetes.io/managed-by"], "Helm", "a release object");
    create_labelled(&c, "web", 0, json!({}));
    let np = wait_allocated_in(&c, "web", (21000, 21999));
    for i in 0..3 {
        c.wait_served(i, np, CHANGE);
    }
    let ok = wait_until(CHANGE, || {
        let st = pool_status(&c, "default");
        condition(&st, "Ready") == "True/InForce" && st["allocated"] == 1 && st["nodeCount"] == 3
    });
    assert!(ok, "default pool status: {:#}", pool_status(&c, "default"));
}

/// The node port of `ns/name` port 80/TCP as the leader wrote it.
fn allocated_in(c: &Cluster, ns: &str, name: &str) -> Option<u16> {
    let svc = c.api.get("v1", "Service", ns, name)?;
    let value = svc["metadata"]["annotations"]["nodelb.io/allocated-ports"].as_str()?.to_string();
    value.split(',').find_map(|e| e.strip_prefix("80/TCP=")).and_then(|n| n.parse().ok())
}

/// Waits until `ns/name` is allocated inside `range`.
fn wait_in(c: &Cluster, ns: &str, name: &str, range: (u16, u16)) -> u16 {
    let mut got = None;
    let ok = wait_until(CHANGE, || {
        got = allocated_in(c, ns, name);
        got.is_some_and(|n| (range.0..=range.1).contains(&n))
    });
    assert!(
        ok,
        "{ns}/{name}: {got:?} not in {range:?}: {:#}",
        c.api.get("v1", "Service", ns, name).unwrap_or_default()
    );
    got.unwrap()
}

/// What is only unit-tested elsewhere, against the real API server with real packets:
/// `namespaceSelector` follows Namespace labels, `disabled` drains (allocations stay and are
/// served, nothing new is allocated), `nodelb.io/pool` picks an `autoAssign: false` pool that
/// nothing else gets, and editing a pool's `nodeSelector` moves a Service with 0 failed
/// requests on the node that keeps it.
#[test]
fn pool_selectors_drain_by_name_and_a_node_move_without_loss() {
    use common::cluster::node_v4;
    use common::topology::ClientLoop;
    require_root!();
    let c = Cluster::new(2);
    for (i, rack) in ["r1", "r2", "r3"].iter().enumerate() {
        label_node(&c, &format!("node-{}", i + 1), &format!("rack={rack}"));
    }
    c.api.kubectl_ok(&["create", "namespace", "team-a"]);
    c.api.kubectl_ok(&["create", "namespace", "team-b"]);
    c.api.kubectl_ok(&["label", "namespace", "team-a", "team=a"]);
    apply(
        &c,
        &pool("team-a", &[(20300, 20309)], json!({"namespaceSelector": {"matchLabels": {"team": "a"}}})),
    );
    apply(&c, &pool("rest", &[(20400, 20409)], json!({"priority": 10})));

    // namespaceSelector: by the Namespace's labels.
    create_in(&c, "team-a", "svc", 0, json!({}), json!({}));
    create_in(&c, "team-b", "svc", 0, json!({}), json!({}));
    let a = wait_in(&c, "team-a", "svc", (20300, 20309));
    let b = wait_in(&c, "team-b", "svc", (20400, 20409));
    c.wait_served(0, a, CHANGE);
    c.wait_served(0, b, CHANGE);
    // The Namespace loses its label: its Service no longer matches and is reallocated, with
    // an Event; team-b's Service is untouched.
    c.api.kubectl_ok(&["label", "namespace", "team-a", "team-"]);
    let moved = wait_in(&c, "team-a", "svc", (20400, 20409));
    c.wait_served(0, moved, CHANGE);
    wait_refused(&c, 0, a);
    let ok = wait_until(CHANGE, || {
        c.api
            .list("events.k8s.io/v1", "Event", Some("team-a"))
            .iter()
            .any(|e| e["reason"] == "NodePortReallocated")
    });
    assert!(ok, "no NodePortReallocated Event in team-a");
    assert_eq!(allocated_in(&c, "team-b", "svc"), Some(b));

    // disabled (drain): what it holds stays allocated and served; nothing new is allocated.
    apply(&c, &pool("rest", &[(20400, 20409)], json!({"priority": 10, "disabled": true})));
    let ok = wait_until(CHANGE, || condition(&pool_status(&c, "rest"), "Ready") == "True/Draining");
    assert!(ok, "rest status: {:#}", pool_status(&c, "rest"));
    create_labelled(&c, "late", 1, json!({}));
    c.wait_condition("late", "nodelb.io/Allocated", "False", "NoPool", CHANGE);
    assert!(c.allocated("late").is_none());
    for port in [b, moved] {
        for i in 0..3 {
            c.wait_served(i, port, CHANGE);
        }
    }
    assert_eq!(allocated_in(&c, "team-b", "svc"), Some(b), "a drained pool keeps its allocations");
    // Enabled again: the waiting Service is allocated.
    apply(&c, &pool("rest", &[(20400, 20409)], json!({"priority": 10})));
    let late = wait_allocated_in(&c, "late", (20400, 20409));
    c.wait_served(1, late, CHANGE);

    // nodelb.io/pool: by name, the only way into an autoAssign: false pool.
    apply(&c, &pool("special", &[(20500, 20509)], json!({"autoAssign": false})));
    create_in(&c, "default", "named", 1, json!({}), json!({"nodelb.io/pool": "special"}));
    create_labelled(&c, "unnamed", 1, json!({}));
    let named = wait_allocated_in(&c, "named", (20500, 20509));
    wait_allocated_in(&c, "unnamed", (20400, 20409));
    c.wait_served(2, named, CHANGE);
    create_in(&c, "default", "typo", 1, json!({}), json!({"nodelb.io/pool": "spceial"}));
    c.wait_condition("typo", "nodelb.io/Allocated", "False", "NoPool", CHANGE);
    let why = c.allocated_condition("typo").unwrap()["message"].to_string();
    assert!(why.contains("spceial") && why.contains("does not exist"), "{why}");

    // A nodeSelector edit moves a Service from racks r2,r3 to r1,r2: node-2 keeps serving it
    // without a single failed request, node-1 starts, node-3 stops.
    let racks = |r: [&str; 2]| json!({"nodeSelector": {"matchExpressions": [{"key": "rack", "operator": "In", "values": r}]}, "serviceSelector": {"matchLabels": {"app": "mover"}}});
    apply(&c, &pool("movable", &[(20600, 20609)], racks(["r2", "r3"])));
    create_labelled(&c, "mover", 0, json!({}));
    let np = wait_allocated_in(&c, "mover", (20600, 20609));
    c.wait_served(1, np, CHANGE);
    c.wait_served(2, np, CHANGE);
    stays_refused(&c, 0, np);
    c.wait_ingress_nodes("mover", &[1, 2], CHANGE);
    let kept =
        ClientLoop::http(&c.client, node_v4(1).into(), np, Duration::from_millis(20), Duration::from_secs(2));
    std::thread::sleep(Duration::from_millis(300));
    let started = Instant::now();
    edit(&c, &pool("movable", &[(20600, 20609)], racks(["r1", "r2"])));
    c.wait_served(0, np, CHANGE);
    eprintln!("pool nodeSelector edit → served on the newly selected node: {:?}", started.elapsed());
    wait_refused(&c, 2, np);
    c.wait_ingress_nodes("mover", &[0, 1], CHANGE);
    std::thread::sleep(Duration::from_millis(500));
    let results = kept.stop();
    let failed: Vec<_> = results.iter().enumerate().filter(|(_, r)| r.is_err()).collect();
    assert!(results.len() >= 10, "only {} requests to the kept node", results.len());
    assert!(
        failed.is_empty(),
        "{} of {} requests to node-2 failed during the move: {:?}",
        failed.len(),
        results.len(),
        &failed[..failed.len().min(5)]
    );
    eprintln!("node-2 during the move: {} requests, 0 failed", results.len());
    assert_eq!(c.allocated("mover").unwrap()["80/TCP"], np, "a nodeSelector edit does not move the port");
}

/// A `NodePortReallocated` Event the API refuses (Event writes 403 for a while: the ClusterRole
/// loses events.k8s.io) is recorded once it can be, although the next rounds no longer see the
/// move (the annotation was written), and only once.
#[test]
fn a_refused_reallocation_event_is_retried_until_recorded_once() {
    require_root!();
    let c = Cluster::new(1);
    apply(&c, &pool("p", &[(20700, 20709)], json!({})));
    create_labelled(&c, "web", 0, json!({}));
    let np = wait_allocated_in(&c, "web", (20700, 20709));
    let ok = wait_until(CHANGE, || !c.events("web", "NodePortsAllocated").is_empty());
    assert!(ok, "no NodePortsAllocated Event");

    c.revoke("events.k8s.io", "events");
    let refused = |c: &Cluster| {
        let reqs = c.api.controller_requests();
        reqs.iter().filter(|r| r.resource == "events" && r.verb == "create" && r.status == 403).count()
    };
    let before = refused(&c);
    apply(&c, &pool("p", &[(20750, 20759)], json!({})));
    let moved = wait_allocated_in(&c, "web", (20750, 20759));
    let ok = wait_until(CHANGE, || refused(&c) > before);
    assert!(ok, "the Event write was not refused");
    // Rounds after the annotation was written (every 2 s) no longer compute the move.
    std::thread::sleep(Duration::from_secs(3));
    assert!(c.events("web", "NodePortReallocated").is_empty(), "recorded although refused");

    c.restore_rbac();
    let ok = wait_until(CHANGE, || !c.events("web", "NodePortReallocated").is_empty());
    assert!(ok, "the NodePortReallocated Event was lost");
    std::thread::sleep(Duration::from_secs(3));
    let events = c.events("web", "NodePortReallocated");
    assert_eq!(events.len(), 1, "{events:#?}");
    let note = events[0]["note"].as_str().unwrap_or_default();
    assert!(note.contains(&format!("{np} → {moved}")), "{note}");
    assert!(events[0]["series"].is_null(), "sent more than once: {:#}", events[0]);
}

/// The Service k3s' HelmChart creates for its bundled Traefik: `kube-system/traefik`, its
/// labels, ports 80 and 443 (both to the backends' HTTP server here), endpoints on backends
/// `0` and `1`; no nodelb annotation.
fn k3s_traefik(name: &str) -> (Value, Vec<Value>) {
    let mut web = PortSpec::tcp(80, None);
    web.name = "web".into();
    let mut websecure = PortSpec::tcp(443, None);
    websecure.name = "websecure".into();
    let spec = ServiceSpec::new(name)
        .in_namespace("kube-system")
        .port(web)
        .port(websecure)
        .endpoint(EndpointSpec::remote(backend_v4(0), "node-1"))
        .endpoint(EndpointSpec::remote(backend_v4(1), "node-2"));
    let mut svc = spec.service();
    svc["spec"]["selector"] =
        json!({"app.kubernetes.io/name": "traefik", "app.kubernetes.io/instance": "traefik-kube-system"});
    svc["metadata"]["labels"] = json!({
        "app.kubernetes.io/instance": "traefik-kube-system",
        "app.kubernetes.io/managed-by": "Helm",
        "app.kubernetes.io/name": "traefik",
        "helm.sh/chart": "traefik-34.2.1_up34.2.0",
    });
    (svc, spec.slices())
}

/// The k3s case, as docs/migrating-from-servicelb.md walks it: the chart's k3s preset
/// (`pools.k3sTraefik.enabled`) selects k3s' Traefik Service by its labels and serves it on
/// every node's own 80 and 443 with no change to the Service; its status lists the nodes with
/// those ports, as `kubectl get svc -o wide` shows them; everything else is allocated from the
/// default pool as before. A second Service the preset selects cannot take 443 (the reason is on
/// it), a process listening on 443 on one node keeps that node's 443 (the others serve), and a
/// Service asking the preset pool for a port it does not permit is refused.
#[test]
fn the_k3s_preset_serves_traefik_on_its_own_ports_with_no_annotation() {
    require_root!();
    let c = Cluster::with_helm(2, &["--set", "pools.k3sTraefik.enabled=true"], &[]);
    let preset =
        c.api.get("nodelb.io/v1alpha1", "NodePortPool", "", "k3s-traefik").expect("pool k3s-traefik");
    assert_eq!(preset["spec"]["portMode"], "ServicePort", "{preset:#}");
    // The CRD's category: `kubectl get nodelb` lists nodelb's objects (`-o wide`: the Mode).
    let listed = c.api.kubectl_ok(&["get", "nodelb", "-o", "wide"]);
    assert!(listed.contains("k3s-traefik") && listed.contains("ServicePort"), "{listed}");
    let (svc, slices) = k3s_traefik("traefik");
    c.api.create(svc).expect("create kube-system/traefik");
    for s in slices {
        c.api.create(s).expect("create its slices");
    }
    create_labelled(&c, "plain", 0, json!({}));

    let ok = wait_until(CHANGE, || {
        c.allocated_in("kube-system", "traefik")
            .is_some_and(|a| a.get("80/TCP") == Some(&80) && a.get("443/TCP") == Some(&443))
    });
    assert!(ok, "traefik: {:#}", c.service_json_in("kube-system", "traefik").unwrap_or_default());
    wait_allocated_in(&c, "plain", (20000, 29999));
    for i in 0..3 {
        for port in [80, 443] {
            let ok = wait_until(CHANGE, || {
                c.get(i, port, Duration::from_millis(500)).is_ok_and(|b| b.contains("backend=be"))
            });
            assert!(ok, "node-{} does not serve traefik on {port}: {:?}", i + 1, c.nft(i));
        }
    }

    // The status says where clients go: every node's address, ports 80 and 443 with no error;
    // kubectl shows the same.
    let nodes: Vec<String> = (0..3).map(|i| common::cluster::node_v4(i).to_string()).collect();
    let ingress = |c: &Cluster| {
        c.service_json_in("kube-system", "traefik")
            .and_then(|s| s["status"]["loadBalancer"]["ingress"].as_array().cloned())
            .unwrap_or_default()
    };
    let ok = wait_until(CHANGE, || {
        let mut ips: Vec<String> =
            ingress(&c).iter().filter_map(|i| i["ip"].as_str().map(String::from)).collect();
        ips.sort();
        ips == nodes
    });
    assert!(ok, "traefik ingress: {:?}", ingress(&c));
    let own = json!([{"port": 80, "protocol": "TCP"}, {"port": 443, "protocol": "TCP"}]);
    for ing in ingress(&c) {
        assert_eq!(ing["ports"], own, "{ing}");
    }
    let wide =
        c.api.kubectl_ok(&["get", "svc", "-n", "kube-system", "traefik", "-o", "wide", "--no-headers"]);
    assert!(wide.contains(&nodes.join(",")), "EXTERNAL-IP is not the nodes: {wide}");
    assert!(wide.contains("80:") && wide.contains("443:"), "PORT(S): {wide}");
    assert_eq!(
        c.service_json_in("kube-system", "traefik").unwrap()["metadata"]["annotations"]
            .get("nodelb.io/ports"),
        None
    );

    // Another Service the preset selects, on 443 too: refused with the reason, traefik keeps it.
    let (mut second, slices) = k3s_traefik("traefik-internal");
    second["spec"]["ports"] =
        json!([{"name": "websecure", "port": 443, "protocol": "TCP", "targetPort": 8080}]);
    c.api.create(second).expect("create kube-system/traefik-internal");
    for mut s in slices {
        s["ports"] = json!([{"name": "websecure", "port": 8080, "protocol": "TCP"}]);
        c.api.create(s).expect("create its slices");
    }
    let reason = |name: &str| {
        c.service_json_in("kube-system", name)
            .and_then(|s| s["status"]["conditions"].as_array().cloned())
            .and_then(|cs| cs.into_iter().find(|c| c["type"] == "nodelb.io/Allocated"))
            .map(|c| {
                (
                    c["reason"].as_str().unwrap_or("").to_string(),
                    c["message"].as_str().unwrap_or("").to_string(),
                )
            })
    };
    let ok = wait_until(CHANGE, || reason("traefik-internal").is_some_and(|(r, _)| r == "PortConflict"));
    assert!(ok, "traefik-internal: {:?}", reason("traefik-internal"));
    let (_, msg) = reason("traefik-internal").unwrap();
    assert!(msg.contains("asks for node port 443, which Service kube-system/traefik holds"), "{msg}");

    // A process on node-3 listening on 443: node-3 leaves 443 to it, the others serve traefik.
    let _n3 = Servers::start(&c.nodes[2], "node-3", 443, 443);
    let ok = wait_until(CHANGE, || {
        c.get(2, 443, Duration::from_millis(500)).is_ok_and(|b| b.contains("backend=node-3"))
    });
    assert!(ok, "node-3's own listener does not answer on 443");
    for i in 0..2 {
        assert!(
            c.get(i, 443, Duration::from_millis(700)).is_ok_and(|b| b.contains("backend=be")),
            "node-{}",
            i + 1
        );
    }
    assert!(
        c.get(2, 80, Duration::from_millis(700)).is_ok_and(|b| b.contains("backend=be")),
        "node-3 keeps 80"
    );
    assert_eq!(c.allocated_in("kube-system", "traefik").unwrap()["443/TCP"], 443, "the hold moved");

    // A port the preset does not permit: refused, naming what it permits.
    let (mut odd, slices) = k3s_traefik("traefik-odd");
    odd["spec"]["ports"] = json!([{"name": "admin", "port": 9000, "protocol": "TCP", "targetPort": 8080}]);
    c.api.create(odd).expect("create kube-system/traefik-odd");
    for mut s in slices {
        s["ports"] = json!([{"name": "admin", "port": 8080, "protocol": "TCP"}]);
        c.api.create(s).expect("create its slices");
    }
    let ok = wait_until(CHANGE, || reason("traefik-odd").is_some_and(|(r, _)| r == "PortNotAllowed"));
    assert!(ok, "traefik-odd: {:?}", reason("traefik-odd"));
    let (_, msg) = reason("traefik-odd").unwrap();
    assert!(msg.contains("node port 9000, which is not allowed (allowed: pool k3s-traefik 80,443)"), "{msg}");

    // docs/migrating-from-servicelb.md, "Services a chart or a gateway creates": the Service
    // Envoy Gateway generates for a Gateway whose `spec.infrastructure.labels` carry the label a
    // ServicePort pool selects, applied by hand. Traefik is removed first: its 443 is freed.
    drop(_n3);
    for name in ["traefik", "traefik-internal", "traefik-odd"] {
        c.api.kubectl_ok(&["delete", "svc", "-n", "kube-system", name]);
    }
    c.api.kubectl_ok(&["create", "namespace", "envoy-gateway-system"]);
    apply(
        &c,
        &pool(
            "gateways",
            &[(80, 80), (443, 443)],
            json!({"portMode": "ServicePort", "serviceSelector": {"matchLabels": {"nodelb.io/serve": "service-ports"}}, "priority": 100}),
        ),
    );
    let mut https = PortSpec::tcp(443, None);
    https.name = "https-443".into();
    let spec = ServiceSpec::new("envoy-web-public-6a5f1e2b")
        .in_namespace("envoy-gateway-system")
        .port(https)
        .endpoint(EndpointSpec::remote(backend_v4(0), "node-1"));
    let mut envoy = spec.service();
    let owner = json!({"app.kubernetes.io/component": "proxy", "app.kubernetes.io/managed-by": "envoy-gateway",
        "app.kubernetes.io/name": "envoy", "gateway.envoyproxy.io/owning-gateway-name": "public",
        "gateway.envoyproxy.io/owning-gateway-namespace": "web"});
    envoy["spec"]["selector"] = owner.clone();
    let mut labels = owner;
    labels["nodelb.io/serve"] = json!("service-ports");
    envoy["metadata"]["labels"] = labels;
    c.api.create(envoy).expect("create the gateway's Service");
    for s in spec.slices() {
        c.api.create(s).expect("create its slices");
    }
    let ok = wait_until(CHANGE, || {
        c.allocated_in("envoy-gateway-system", "envoy-web-public-6a5f1e2b")
            .is_some_and(|a| a.get("443/TCP") == Some(&443))
    });
    let got = c.service_json_in("envoy-gateway-system", "envoy-web-public-6a5f1e2b");
    assert!(ok, "the gateway's Service: {:#}", got.unwrap_or_default());
    for i in 0..3 {
        let ok = wait_until(CHANGE, || {
            c.get(i, 443, Duration::from_millis(500)).is_ok_and(|b| b.contains("backend=be1"))
        });
        assert!(ok, "node-{} does not serve the gateway on 443", i + 1);
    }
}

/// Waits until `<ns>/ingress` holds 443 for each of `namespaces`.
fn wait_holds_443(c: &Cluster, namespaces: &[&str]) {
    for ns in namespaces {
        let ok = wait_until(CHANGE, || {
            c.allocated_in(ns, "ingress").is_some_and(|a| a.get("443/TCP") == Some(&443))
        });
        assert!(ok, "{ns}/ingress: {:#}", c.service_json_in(ns, "ingress").unwrap_or_default());
    }
}

/// The ingress IPs of `<ns>/ingress`, sorted.
fn ingress_ips_in(c: &Cluster, ns: &str) -> Vec<String> {
    let mut ips: Vec<String> = (c.service_json_in(ns, "ingress"))
        .and_then(|s| s["status"]["loadBalancer"]["ingress"].as_array().cloned())
        .unwrap_or_default()
        .iter()
        .filter_map(|i| i["ip"].as_str().map(String::from))
        .collect();
    ips.sort();
    ips
}

/// A `port: 443` Service in namespace `ns` labelled `app=<app>`, its endpoint backend `b`.
fn create_on_443(c: &Cluster, ns: &str, app: &str, b: usize) {
    let spec = ServiceSpec::new("ingress")
        .in_namespace(ns)
        .port(PortSpec::tcp(443, None))
        .endpoint(EndpointSpec::remote(backend_v4(b), "node-2"));
    let mut svc = spec.service();
    svc["metadata"]["labels"] = json!({"app": app});
    c.api.create(svc).unwrap_or_else(|e| panic!("create {ns}/ingress: {e:?}"));
    for s in spec.slices() {
        c.api.create(s).unwrap_or_else(|e| panic!("create the slices of {ns}/ingress: {e:?}"));
    }
}

/// Waits until node `i` answers on `port` from backend `be` (`be1`: backend 0).
fn wait_answers(c: &Cluster, i: usize, port: u16, be: &str) {
    let mut last = None;
    let ok = wait_until(CHANGE, || {
        last = Some(c.get(i, port, Duration::from_millis(500)));
        last.as_ref().is_some_and(|r| r.as_ref().is_ok_and(|b| b.contains(&format!("backend={be}"))))
    });
    assert!(ok, "node-{} does not answer {port} from {be}: {last:?}\n{:?}", i + 1, c.nft(i));
}

/// Two ingress controllers on 443 in two tenants' namespaces, one served by the edge nodes, one
/// by the internal nodes: pools whose node selectors exclude each other share the number. Each
/// is served on 443 only on its own nodes (real packets), its status lists those nodes, and the
/// registry records both holders with their pools. A pool that may meet either cannot take 443;
/// a node relabelled from internal to edge serves the edge one; and the internal pool edited to
/// select every node moves nobody: both keep 443, the edge nodes keep serving the Service they
/// served and say why they do not serve the other, and each status lists where it answers.
#[test]
fn pools_apart_serve_one_port_each_on_its_own_nodes() {
    require_root!();
    let mut c = Cluster::new(3);
    label_node(&c, "node-1", "tier=edge");
    label_node(&c, "node-2", "tier=internal");
    label_node(&c, "node-3", "tier=internal");
    for ns in ["edge", "internal", "gpu"] {
        c.api.kubectl_ok(&["create", "namespace", ns]);
    }
    let tier = |t: &str| json!({"matchLabels": {"tier": t}});
    let service_port = |app: &str, nodes: Option<Value>| {
        let mut spec = json!({"portMode": "ServicePort", "serviceSelector": {"matchLabels": {"app": app}}});
        if let Some(nodes) = nodes {
            spec["nodeSelector"] = nodes;
        }
        spec
    };
    apply(&c, &pool("edge", &[(443, 443)], service_port("edge-ingress", Some(tier("edge")))));
    apply(&c, &pool("internal", &[(443, 443)], service_port("internal-ingress", Some(tier("internal")))));
    apply(
        &c,
        &pool(
            "gpu",
            &[(443, 443)],
            service_port("gpu-ingress", Some(json!({"matchLabels": {"gpu": "yes"}}))),
        ),
    );
    create_on_443(&c, "edge", "edge-ingress", 0);
    create_on_443(&c, "internal", "internal-ingress", 1);
    wait_holds_443(&c, &["edge", "internal"]);
    wait_answers(&c, 0, 443, "be1");
    wait_answers(&c, 1, 443, "be2");
    wait_answers(&c, 2, 443, "be2");
    // The status lists the nodes that answer.
    let ingress_ips = |ns: &str| ingress_ips_in(&c, ns);
    let node = |i: usize| common::cluster::node_v4(i).to_string();
    let ok = wait_until(CHANGE, || {
        ingress_ips("edge") == [node(0)] && ingress_ips("internal") == [node(1), node(2)]
    });
    assert!(ok, "edge: {:?}, internal: {:?}", ingress_ips("edge"), ingress_ips("internal"));
    // The registry records both holders, each with its pool.
    let registry = c
        .api
        .get("coordination.k8s.io/v1", "Lease", common::cluster::AGENT_NS, "nodelb-node-ports-0")
        .map(|l| l["metadata"]["annotations"]["nodelb.io/claims"].as_str().unwrap_or_default().to_string())
        .unwrap_or_default();
    let entry = registry.split(',').find(|e| e.starts_with("443=")).unwrap_or_default().to_string();
    assert!(entry.contains("@edge") && entry.contains("@internal") && entry.contains(';'), "{registry}");

    // A pool that may meet either on a node (a GPU node can be an edge node) cannot take it.
    create_on_443(&c, "gpu", "gpu-ingress", 2);
    let reason = || c.condition_in("gpu", "ingress", "nodelb.io/Allocated").map(|c| c["reason"].clone());
    let ok = wait_until(CHANGE, || reason().is_some_and(|r| r == "PortConflict"));
    assert!(ok, "gpu/ingress: {:#}", c.service_json_in("gpu", "ingress").unwrap_or_default());

    // node-3 moves to the edge: it serves the edge Service now.
    label_node(&c, "node-3", "tier=edge");
    wait_answers(&c, 2, 443, "be1");
    wait_answers(&c, 1, 443, "be2");

    // The internal pool edited to select every node: nobody moves. node-1 and node-3 keep
    // serving the edge Service (its pool is the one recorded, and recorded first); node-2 the
    // internal one, which says why node-1 and node-3 do not serve it.
    edit(&c, &pool("internal", &[(443, 443)], service_port("internal-ingress", None)));
    let ok = wait_until(CHANGE, || {
        let st = pool_status(&c, "internal");
        st["observedGeneration"] == 2 && condition(&st, "Conflict") == "True/Overlap"
    });
    assert!(ok, "internal pool: {:#}", pool_status(&c, "internal"));
    // node-1's agent says why it does not serve it (`nodelb status --cluster` shows it), without
    // naming the other Service.
    let report = || {
        c.api
            .get("coordination.k8s.io/v1", "Lease", common::cluster::AGENT_NS, "nodelb-node-node-1")
            .and_then(|l| l["metadata"]["annotations"]["nodelb.io/node-report"].as_str().map(String::from))
            .unwrap_or_default()
    };
    let ok = wait_until(CHANGE * 3, || {
        let r = report();
        r.contains("internal/ingress") && r.contains("keeps it on this node") && !r.contains("edge/ingress")
    });
    assert!(ok, "node-1 reports {}", report());
    // Its status lists only the node where it answers; the edge Service's lists its two.
    let ok = wait_until(CHANGE, || {
        ingress_ips("internal") == [node(1)] && ingress_ips("edge") == [node(0), node(2)]
    });
    assert!(ok, "edge: {:?}, internal: {:?}", ingress_ips("edge"), ingress_ips("internal"));
    for _ in 0..3 {
        wait_answers(&c, 0, 443, "be1");
        wait_answers(&c, 2, 443, "be1");
        wait_answers(&c, 1, 443, "be2");
        std::thread::sleep(Duration::from_millis(300));
    }
    for ns in ["edge", "internal"] {
        assert_eq!(c.allocated_in(ns, "ingress").unwrap()["443/TCP"], 443, "{ns}/ingress moved");
    }

    // The leader stops: the next one reads the shared entry and keeps both holds.
    let first = c.wait_leader(CHANGE);
    c.stop_controller(first, Duration::from_secs(5));
    let ok = wait_until(CHANGE * 3, || c.leader_index().is_some_and(|k| k != first));
    assert!(ok, "no other leader after controller {first} stopped");
    // A round of the new leader: a Service no pool accepts, which it says so on.
    create_labelled(&c, "after-failover", 0, json!({}));
    c.wait_condition("after-failover", "nodelb.io/Allocated", "False", "NoPool", CHANGE);
    let registry = c
        .api
        .get("coordination.k8s.io/v1", "Lease", common::cluster::AGENT_NS, "nodelb-node-ports-0")
        .map(|l| l["metadata"]["annotations"]["nodelb.io/claims"].as_str().unwrap_or_default().to_string())
        .unwrap_or_default();
    assert!(registry.split(',').any(|e| e.starts_with("443=") && e.contains(';')), "{registry}");
    for ns in ["edge", "internal"] {
        assert_eq!(c.allocated_in(ns, "ingress").unwrap()["443/TCP"], 443, "{ns}/ingress after the failover");
    }
    wait_answers(&c, 0, 443, "be1");
    wait_answers(&c, 1, 443, "be2");
    c.start_controller(first, CHANGE);
}

/// Pools apart by address on the same nodes: one ingress Service on node-1's second address
/// (192.0.2.0/24), another on every node's first address (203.0.113.0/24), both on 443. Each
/// address answers from its own Service (real packets), and each status lists its addresses.
#[test]
fn pools_apart_by_address_serve_one_port_on_each_address() {
    require_root!();
    let c = Cluster::new(2);
    add_second_address(&c);
    for ns in ["public", "private"] {
        c.api.kubectl_ok(&["create", "namespace", ns]);
    }
    let on = |app: &str, cidr: &str| {
        json!({"portMode": "ServicePort", "serviceSelector": {"matchLabels": {"app": app}},
               "addresses": {"cidrs": [cidr]}})
    };
    apply(&c, &pool("public", &[(443, 443)], on("public-ingress", "192.0.2.0/24")));
    apply(&c, &pool("private", &[(443, 443)], on("private-ingress", "203.0.113.0/24")));
    create_on_443(&c, "public", "public-ingress", 0);
    create_on_443(&c, "private", "private-ingress", 1);
    wait_holds_443(&c, &["public", "private"]);
    let mut last = None;
    let ok = wait_until(CHANGE, || {
        last = Some(http_get(&c.client, IpAddr::V4(SECOND_V4), 443, Duration::from_millis(500)));
        last.as_ref().is_some_and(|r| r.as_ref().is_ok_and(|b| b.contains("backend=be1")))
    });
    assert!(ok, "{SECOND_V4}:443 does not answer from the public Service: {last:?}\n{:?}", c.nft(0));
    for i in 0..3 {
        wait_answers(&c, i, 443, "be2");
    }
    let ips = |ns: &str| ingress_ips_in(&c, ns);
    let nodes: Vec<String> = (0..3).map(|i| common::cluster::node_v4(i).to_string()).collect();
    let ok = wait_until(CHANGE, || ips("public") == [SECOND_V4.to_string()] && ips("private") == nodes);
    assert!(ok, "public: {:?}, private: {:?}", ips("public"), ips("private"));
    // Apart by address is no overlap: neither pool is in conflict.
    let ok = wait_until(CHANGE, || {
        ["public", "private"].iter().all(|p| condition(&pool_status(&c, p), "Conflict") == "False/NoOverlap")
    });
    assert!(ok, "private: {:#}", pool_status(&c, "private"));
}
