//! Kubernetes mode end to end: three real `nodelb` agents, each in its own node namespace, run with
//! the DaemonSet's arguments and a ServiceAccount token, against a real kube-apiserver + etcd
//! (`testkube`, installed with `kubectl apply -f daemonset/`) in another namespace, with real
//! packets client → node → backends. See `tests/common/cluster.rs` for the topology and
//! `tests/common/kube.rs` for the control plane and its faults.
//!
//! Each test builds its own cluster (namespaces, control plane, agents) and tears it down on drop,
//! also on panic (the agents' and the control plane's logs are printed then).
mod common;

use std::collections::{BTreeMap, BTreeSet};
use std::net::IpAddr;
use std::time::{Duration, Instant};

use common::cluster::{
    AGENT_NS, CLIENT_V4, Cluster, LEADER_LEASE, Permission, Rbac, controller_name, node_name, node_v4, web,
};
use common::kube::ControlPlane;
use common::kube::Fault;
use common::manifest::{EndpointSpec, PortSpec, ServiceSpec};
use common::netns::NetNs;
use common::topology::{ClientError, ClientLoop, Servers, backend_v4, parse_answer, wait_until};

/// Per-request timeout where an answer is expected.
const T: Duration = Duration::from_secs(2);
/// A Service change to allocation / rules on every node.
const CHANGE: Duration = Duration::from_secs(15);
/// Condition type: does any node serve the Service.
const SERVING: &str = "nodelb.io/Serving";

/// The backends answering `n` requests to node `i`'s `port`.
fn backends_seen(c: &Cluster, i: usize, port: u16, n: usize) -> BTreeMap<String, usize> {
    let mut m = BTreeMap::new();
    for k in 0..n {
        let body =
            c.get(i, port, T).unwrap_or_else(|e| panic!("request {k} to node-{}:{port}: {e:?}", i + 1));
        let (b, _) = parse_answer(&body).unwrap_or_else(|| panic!("bad answer {body:?}"));
        *m.entry(b).or_insert(0) += 1;
    }
    m
}

fn names(m: &BTreeMap<String, usize>) -> Vec<&str> {
    m.keys().map(String::as_str).collect()
}

/// Waits until node `i`'s table has no rule of `default/name` nor node port `np`, and `np` is not
/// served there any more.
fn wait_rules_gone(c: &Cluster, i: usize, name: &str, np: u16) {
    let (elem, chain) = (format!(". {np} "), format!("default/{name}/"));
    let mut table = None;
    let ok = wait_until(CHANGE, || {
        table = c.nft(i);
        table.as_deref().is_some_and(|t| !t.contains(&elem) && !t.contains(&chain))
    });
    assert!(ok, "node-{}: rules of default/{name} still there: {table:?}", i + 1);
    assert!(c.get(i, np, Duration::from_millis(700)).is_err(), "node-{} still serves {np}", i + 1);
}

/// Only the leader of the moment writes Services: every Service write came from one of `leaders`.
fn assert_only_leaders_wrote(c: &Cluster, leaders: &[usize]) {
    let writers = c.service_writers();
    let allowed: BTreeSet<usize> = leaders.iter().copied().collect();
    assert!(writers.is_subset(&allowed), "Service writes from {writers:?}, leaders were {allowed:?}");
}

#[test]
fn service_is_served_on_every_node_with_status() {
    require_root!();
    let c = Cluster::new(2);
    c.create(&web("web", &[(0, 0), (1, 1)]));
    let ports = c.wait_allocated("web", 1, CHANGE);
    let np = ports["80/TCP"];
    assert!((20000..=29999).contains(&np), "{ports:?}");
    for i in 0..3 {
        c.wait_served(i, np, CHANGE);
        let seen = backends_seen(&c, i, np, 30);
        assert_eq!(names(&seen), ["be1", "be2"], "node-{}: {seen:?}", i + 1);
    }
    c.wait_ingress_nodes("web", &[0, 1, 2], CHANGE);
    for ing in c.ingress("web") {
        assert_eq!(ing["ipMode"], "Proxy", "{ing}");
        // The Service's own port, flagged as answering on its allocated node port instead.
        let port = serde_json::json!([{"port": 80, "protocol": "TCP", "error": "nodelb.io/AllocatedPort"}]);
        assert_eq!(ing["ports"], port, "{ing}");
    }
    let cond = c.allocated_condition("web").expect("condition nodelb.io/Allocated");
    assert_eq!(cond["status"], "True", "{cond}");
    c.wait_condition("web", SERVING, "True", "Serving", CHANGE);
    let leader = c.wait_leader(CHANGE);
    assert_eq!(c.service_writers(), BTreeSet::from([leader]), "only the leader writes Services");
    let managers: BTreeSet<Option<String>> = (c.api.agent_requests().into_iter())
        .chain(c.api.controller_requests())
        .filter(|r| r.is_write() && !r.path.contains("/events"))
        .map(|r| r.field_manager)
        .collect();
    assert_eq!(managers, BTreeSet::from([Some("nodelb".to_string())]), "every write names its field manager");
    assert!(!c.events("web", "NodePortsAllocated").is_empty(), "a NodePortsAllocated Event");

    // What a user looks at, with kubectl (README, "On a cluster").
    let wide = c.api.kubectl_ok(&["get", "svc", "web", "-o", "wide"]);
    let external = format!("{},{},{}", node_v4(0), node_v4(1), node_v4(2));
    assert!(wide.contains(&external), "EXTERNAL-IP is not the node addresses:\n{wide}");
    let annotation = c.api.kubectl_allocated_ports("web");
    assert_eq!(annotation, format!("80/TCP={np}"));
    let serving = c.api.kubectl_ok(&[
        "get",
        "svc",
        "web",
        "-o",
        r#"jsonpath={.status.conditions[?(@.type=="nodelb.io/Serving")].status}/{.status.conditions[?(@.type=="nodelb.io/Allocated")].reason}"#,
    ]);
    assert_eq!(serving, "True/Allocated");
    let events = c.api.kubectl_ok(&["get", "events", "--field-selector", "involvedObject.name=web"]);
    assert!(events.contains("NodePortsAllocated"), "kubectl get events:\n{events}");

    // Least privilege, both ways, for both identities: every request the node agents and the
    // controller made is granted by daemonset/10-rbac.yaml, and every grant was used (Events
    // are patched only when the same Event repeats within kube-runtime's cache time, which this
    // scenario does not do).
    c.assert_rbac_allows_every_request();
    for sa in ["nodelb", "nodelb-controller"] {
        let used: BTreeSet<Permission> = c.permissions_used(sa).into_iter().map(|(_, p, _)| p).collect();
        let unused: Vec<Permission> = Rbac::load(sa)
            .all()
            .into_iter()
            .filter(|p| !used.contains(p))
            .filter(|p| *p != ("events.k8s.io".into(), "events".into(), "patch".into()))
            // A node agent records Events only about a Node that cannot serve
            // (a_node_with_forwarding_off_leaves_the_status proves the grant is used).
            .filter(|p| sa != "nodelb" || p.1 != "events")
            // Pool status is written only when NodePortPool objects exist (tests/pools.rs).
            .filter(|p| *p != ("nodelb.io".into(), "nodeportpools/status".into(), "patch".into()))
            // Only with --metrics-addr and a scraper: kube_metrics_auth proves they are used.
            .filter(|p| !["tokenreviews", "subjectaccessreviews"].contains(&p.1.as_str()))
            .collect();
        assert!(unused.is_empty(), "{sa}: granted but never used: {unused:?}; used: {used:?}");
    }
}

/// `nodelb plan` without `--manifests`, run on a node with the agent's kubeconfig, prints what
/// that node's agent programmed (compared as listings: each loaded into the kernel and listed).
/// The soak (`benches/soak.rs`) uses it as the converged state after its faults.
#[test]
fn plan_from_the_cluster_is_what_each_agent_programmed() {
    require_root!();
    let c = Cluster::new(2);
    c.create(&web("web", &[(0, 0), (1, 1)]));
    let local = web("local", &[(0, 0)]).local_policy().source_range("203.0.113.0/24");
    c.create(&local);
    let np = c.wait_allocated("web", 1, CHANGE)["80/TCP"];
    let lp = c.wait_allocated("local", 1, CHANGE)["80/TCP"];
    for i in 0..3 {
        c.wait_served(i, np, CHANGE);
    }
    c.wait_served(0, lp, CHANGE);
    for i in 0..3 {
        let plan = c.wait_plan_is_table(i, CHANGE);
        assert!(plan.contains(&format!(" {np} ")), "node-{}: port {np} not in the plan:\n{plan}", i + 1);
    }
}

/// `kubectl auth can-i --list` rows ((group, resource, verb), resource names: "" for any) for
/// `user` in `ns`.
fn can_i(api: &ControlPlane, user: &str, ns: &str) -> BTreeSet<((String, String, String), String)> {
    let out = api.kubectl_ok(&["auth", "can-i", "--list", &format!("--as={user}"), "-n", ns]);
    let mut rows = BTreeSet::new();
    for line in out.lines().skip(1) {
        // RESOURCES  NON-RESOURCE-URLS ("[]")  RESOURCE-NAMES ("[a b]")  VERBS ("[get list]")
        let Some(resource) = line.split_whitespace().next().filter(|_| !line.starts_with(' ')) else {
            continue;
        };
        let lists: Vec<&str> =
            line.split('[').skip(1).map(|l| l.split(']').next().unwrap_or_default()).collect();
        let [_, names, verbs] = lists[..] else { panic!("kubectl auth can-i --list: {line:?}") };
        let names = names.split_whitespace().collect::<Vec<_>>().join(", ");
        let (res, group) = resource.split_once('.').unwrap_or((resource, ""));
        // A subresource of a grouped resource prints as `nodeportpools.nodelb.io/status`.
        let (group, res) = match group.split_once('/') {
            Some((g, sub)) => (g, format!("{res}/{sub}")),
            None => (group, res.to_string()),
        };
        for verb in verbs.split_whitespace() {
            rows.insert(((group.to_string(), res.clone(), verb.to_string()), names.clone()));
        }
    }
    rows
}

/// The README's RBAC table of ServiceAccount `sa`: ((group, resource, verb), names: "" for
/// any) → where: "everywhere" (every namespace, or cluster-scoped), else the one namespace.
fn readme_rbac(sa: &str) -> BTreeMap<((String, String, String), String), String> {
    let readme = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/README.md")).unwrap();
    let table = readme
        .split(&format!("<!-- rbac-table {sa}: begin -->"))
        .nth(1)
        .and_then(|t| t.split("<!-- rbac-table: end -->").next())
        .unwrap_or_else(|| panic!("README: rbac-table markers of {sa}"));
    let mut out = BTreeMap::new();
    for row in table.lines().filter(|l| l.starts_with('|')).skip(2) {
        let cells: Vec<&str> = row.trim_matches('|').split('|').map(str::trim).collect();
        let group = if cells[0] == "(core)" { "" } else { cells[0] };
        let names = if cells[4] == "any" { String::new() } else { cells[4].replace('`', "") };
        let place = match cells[3] {
            "every namespace" | "cluster" => "everywhere".to_string(),
            only => only.trim_end_matches(" only").replace('`', ""),
        };
        for verb in cells[2].split(',') {
            let key = ((group.to_string(), cells[1].to_string(), verb.trim().to_string()), names.clone());
            out.insert(key, place.clone());
        }
    }
    out
}

#[test]
fn rbac_installed_with_kubectl_is_what_the_readme_documents() {
    require_root!();
    let ns = NetNs::new("rbac");
    let api = ControlPlane::start(&ns, std::net::Ipv4Addr::LOCALHOST, 6443, &[]);
    api.kubectl_ok(&["apply", "-f", concat!(env!("CARGO_MANIFEST_DIR"), "/daemonset")]);
    // The workloads are stored (no kubelet runs them), with what the tests run them with.
    let ds = api.get("apps/v1", "DaemonSet", AGENT_NS, "nodelb").expect("DaemonSet stored");
    let (args, env) = common::kube::daemonset_command(&ds, "node-1", AGENT_NS);
    assert_eq!(args.first().map(String::as_str), Some("run"), "{args:?}");
    assert!(env.contains(&("NODE_NAME".into(), "node-1".into())), "{env:?}");
    let deploy = api.get("apps/v1", "Deployment", AGENT_NS, "nodelb-controller").expect("Deployment stored");
    let (args, env) = common::kube::controller_command(&deploy, "nodelb-controller-1", AGENT_NS);
    assert_eq!(args.first().map(String::as_str), Some("controller"), "{args:?}");
    assert!(env.contains(&("POD_NAME".into(), "nodelb-controller-1".into())), "{env:?}");

    // Beyond what any authenticated user may (a ServiceAccount with no binding), for each
    // identity, in a user namespace, in `default` and in nodelb's own.
    let nobody = "system:serviceaccount:nodelb-system:nobody";
    for sa in ["nodelb", "nodelb-controller"] {
        let user = format!("system:serviceaccount:{AGENT_NS}:{sa}");
        let own = |ns: &str| -> BTreeSet<_> {
            can_i(&api, &user, ns).difference(&can_i(&api, nobody, ns)).cloned().collect()
        };
        let (elsewhere, default, system) = (own("team-a"), own("default"), own(AGENT_NS));
        let mut got = BTreeMap::new();
        for p in elsewhere.iter().chain(&default).chain(&system) {
            let place = match (elsewhere.contains(p), default.contains(p), system.contains(p)) {
                (true, true, true) => "everywhere".to_string(),
                (false, true, false) => "default".to_string(),
                (false, false, true) => AGENT_NS.to_string(),
                other => panic!("{sa}: {p:?} granted in (team-a, default, {AGENT_NS}) = {other:?}"),
            };
            got.insert(p.clone(), place);
        }
        eprintln!("kubectl auth can-i --list --as={user} (beyond any ServiceAccount):");
        for (((group, resource, verb), names), place) in &got {
            eprintln!("  {group:>22} {resource:<22} {verb:<7} {place:<14} {names}");
        }
        assert_eq!(got, readme_rbac(sa), "{sa}: kubectl auth can-i --list (right: README's table)");
    }
}

#[test]
fn scaling_endpoints_is_followed_on_every_node() {
    require_root!();
    let c = Cluster::new(3);
    // Endpoints as a user has them: Pods (status written as a kubelet would) selected by the
    // Service, EndpointSlices made by the EndpointSlice controller.
    let mut spec = web("web", &[(0, 0), (1, 1)]);
    c.create_with_pods(&spec);
    let np = c.wait_allocated("web", 1, CHANGE)["80/TCP"];
    for i in 0..3 {
        c.wait_served(i, np, CHANGE);
    }
    let expect = |want: &[&str]| {
        for i in 0..3 {
            let mut last = BTreeMap::new();
            let ok = wait_until(CHANGE, || {
                last = backends_seen(&c, i, np, 30);
                names(&last) == want
            });
            assert!(ok, "node-{}: backends {last:?}, want {want:?}", i + 1);
        }
    };
    expect(&["be1", "be2"]);

    // Scale up: be3 on node-3.
    spec = spec.endpoint(EndpointSpec::remote(backend_v4(2), "node-3"));
    c.update_pods(&spec);
    expect(&["be1", "be2", "be3"]);

    // be2 stops being ready (its readiness probe fails): out, the Pod stays.
    spec.endpoints[1].ready = false;
    c.update_pods(&spec);
    expect(&["be1", "be3"]);
    spec.endpoints[1].ready = true;
    c.update_pods(&spec);
    expect(&["be1", "be2", "be3"]);

    // Scale down: be1's Pod is deleted.
    spec.endpoints.retain(|e| e.addr != IpAddr::V4(backend_v4(0)));
    c.update_pods(&spec);
    expect(&["be2", "be3"]);
    let slices: Vec<_> = c
        .api
        .list("discovery.k8s.io/v1", "EndpointSlice", Some("default"))
        .into_iter()
        .filter(|s| s["metadata"]["labels"]["kubernetes.io/service-name"] == "web")
        .collect();
    assert!(
        !slices.is_empty()
            && slices.iter().all(|s| s["metadata"]["labels"]["endpointslice.kubernetes.io/managed-by"]
                == "endpointslice-controller.k8s.io"),
        "slices not from the controller: {slices:#?}"
    );

    assert_eq!(c.allocated("web").unwrap()["80/TCP"], np, "scaling does not move the node port");
    let leader = c.wait_leader(CHANGE);
    assert_only_leaders_wrote(&c, &[leader]);
}

#[test]
fn local_policy_lists_only_nodes_with_a_ready_local_endpoint() {
    require_root!();
    let c = Cluster::new(2);
    let mut spec = ServiceSpec::new("local").port(PortSpec::tcp(80, None)).local_policy().endpoints([
        EndpointSpec::remote(backend_v4(0), "node-1"),
        EndpointSpec::remote(backend_v4(1), "node-2").not_ready(),
    ]);
    c.create(&spec);
    let np = c.wait_allocated("local", 1, CHANGE)["80/TCP"];
    c.wait_ingress_nodes("local", &[0], CHANGE);
    // node-1 serves from its local endpoint and keeps the client's address.
    c.wait_served(0, np, CHANGE);
    for _ in 0..10 {
        let body = c.get(0, np, T).expect("node-1 serves its local endpoint");
        let (b, peer) = parse_answer(&body).unwrap();
        assert_eq!(b, "be1");
        assert_eq!(peer.ip(), IpAddr::V4(CLIENT_V4), "Local policy keeps the client address");
    }
    // node-2 has no ready local endpoint: refused, not black-holed.
    let ok = wait_until(CHANGE, || c.get(1, np, T) == Err(ClientError::Refused));
    assert!(ok, "node-2 (no ready local endpoint) refuses: {:?}", c.get(1, np, T));

    // be2 (on node-2) becomes ready → node-2 joins the status.
    spec.endpoints[1].ready = true;
    c.update_slices(&spec);
    c.wait_ingress_nodes("local", &[0, 1], CHANGE);
    // ... and the ready endpoint on node-1 goes away → only node-2.
    spec.endpoints[0].ready = false;
    c.update_slices(&spec);
    c.wait_ingress_nodes("local", &[1], CHANGE);
    c.wait_condition("local", SERVING, "True", "Serving", CHANGE);
    // No ready endpoint on any node: nobody lists it, and the Serving condition says why (the
    // agents are ready, so this is not NoServingNode).
    spec.endpoints[1].ready = false;
    c.update_slices(&spec);
    c.wait_ingress_nodes("local", &[], CHANGE);
    c.wait_condition("local", SERVING, "False", "NoReadyLocalEndpoint", CHANGE);
    assert_eq!(c.allocated_condition("local").unwrap()["status"], "True", "still allocated");
    // The leader records a round's Events after writing its status: watch long enough for that
    // round's Events to land (rounds take milliseconds) so a wrong NoServingNode would be seen.
    let wrong = wait_until(Duration::from_secs(2), || !c.events("local", "NoServingNode").is_empty());
    assert!(!wrong, "{:#?}", c.events("local", "NoServingNode"));
    let leader = c.wait_leader(CHANGE);
    assert_only_leaders_wrote(&c, &[leader]);
}

#[test]
fn deleting_the_service_removes_rules_and_allocation_everywhere() {
    require_root!();
    let c = Cluster::new(2);
    let spec = web("web", &[(0, 0), (1, 1)]);
    c.create(&spec);
    let np = c.wait_allocated("web", 1, CHANGE)["80/TCP"];
    let elem = format!(". {np} :");
    for i in 0..3 {
        c.wait_served(i, np, CHANGE);
        let table = c.nft(i).expect("table inet nodelb");
        assert!(table.contains(&elem) && table.contains("default/web/"), "node-{}: {table}", i + 1);
    }

    c.api.delete("v1", "Service", "default", "web").unwrap();
    for s in spec.slices() {
        c.api
            .delete(
                "discovery.k8s.io/v1",
                "EndpointSlice",
                "default",
                s["metadata"]["name"].as_str().unwrap(),
            )
            .unwrap();
    }
    for i in 0..3 {
        wait_rules_gone(&c, i, "web", np);
        let st = c.agents[i].status().expect("agent /status");
        assert_eq!(st["services"], serde_json::json!([]), "node-{}: {st}", i + 1);
    }
    // The number is free again: the next Service gets it (the allocator hands out the lowest free).
    c.create(&web("next", &[(0, 0)]));
    assert_eq!(c.wait_allocated("next", 1, CHANGE)["80/TCP"], np, "released port is reused");
    let leader = c.wait_leader(CHANGE);
    assert_only_leaders_wrote(&c, &[leader]);
}

#[test]
fn killing_the_leader_hands_over_without_moving_allocations() {
    require_root!();
    let mut c = Cluster::new(2);
    c.create(&web("web", &[(0, 0), (1, 1)]));
    let before = c.wait_allocated("web", 1, CHANGE);
    let np = before["80/TCP"];
    for i in 0..3 {
        c.wait_served(i, np, CHANGE);
    }
    c.wait_ingress_nodes("web", &[0, 1, 2], CHANGE);
    let old = c.wait_leader(CHANGE);
    assert_only_leaders_wrote(&c, &[old]);
    // `nodelb_leader` says who leads: 1 on the Lease holder only.
    let leading: Vec<f64> = (0..2).map(|k| c.controller_metric_sum(k, "nodelb_leader")).collect();
    assert_eq!(leading, (0..2).map(|k| if k == old { 1.0 } else { 0.0 }).collect::<Vec<_>>());

    // The leader replica and node-1's agent die at once (their node is lost).
    c.controllers[old].kill9();
    c.agents[0].kill9();
    c.api.clear_requests();
    let killed = Instant::now();
    let mut new = None;
    // Lease 3 s: a successor may take over one full duration after the last renewal it saw.
    let ok = wait_until(Duration::from_secs(12), || {
        new = c.leader_index().filter(|l| *l != old);
        new.is_some()
    });
    assert!(ok, "no successor within 12 s; leader is still {:?}", c.leader());
    let new = new.unwrap();
    eprintln!("leader {} → {} in {:?}", controller_name(old), controller_name(new), killed.elapsed());
    let survivors: Vec<usize> = vec![1, 2];

    // The dead node leaves the status once its node Lease expires; the allocation does not move.
    c.wait_ingress_nodes("web", &survivors, CHANGE);
    assert_eq!(c.allocated("web").unwrap(), before, "allocation unchanged across the leader change");

    // The new leader allocates a new Service, served by the surviving nodes.
    c.create(&web("after", &[(0, 0)]));
    let np2 = c.wait_allocated("after", 1, CHANGE)["80/TCP"];
    assert_ne!(np2, np);
    for &i in &survivors {
        c.wait_served(i, np2, CHANGE);
        c.wait_served(i, np, CHANGE);
    }
    c.wait_ingress_nodes("after", &survivors, CHANGE);
    assert_eq!(c.allocated("web").unwrap(), before);
    assert_only_leaders_wrote(&c, &[new]);
    assert_eq!(c.controller_metric_sum(new, "nodelb_leader"), 1.0, "the successor reports itself leader");
    assert!(
        c.controller_metric_sum(new, "nodelb_leader_transitions_total") >= 1.0,
        "its transition is counted"
    );
}

#[test]
fn two_services_asking_for_the_same_port_older_wins() {
    require_root!();
    let c = Cluster::new(3);
    let want = |name: &str, b: usize| {
        ServiceSpec::new(name)
            .port(PortSpec::tcp(80, Some(20080)))
            .endpoint(EndpointSpec::remote(backend_v4(b), "node-1"))
    };
    // The older one sorts last by name, so age (not name) must decide.
    c.create(&want("zz-old", 0));
    assert_eq!(c.wait_allocated("zz-old", 1, CHANGE)["80/TCP"], 20080);
    std::thread::sleep(Duration::from_millis(1100)); // creationTimestamp has 1 s resolution
    c.create(&want("aa-new", 1));
    // Also younger than zz-old, and asking for no port in particular.
    c.create(&web("mm-auto", &[(2, 0)]));
    let auto_before = c.wait_allocated("mm-auto", 1, CHANGE)["80/TCP"];
    assert_ne!(auto_before, 20080);
    let ok = wait_until(CHANGE, || {
        c.allocated_condition("aa-new").is_some_and(|cond| cond["reason"] == "PortConflict")
    });
    assert!(ok, "aa-new: no PortConflict condition: {:#}", c.service_json("aa-new").unwrap());
    assert_eq!(c.allocated_condition("aa-new").unwrap()["status"], "False");
    let ok = wait_until(CHANGE, || !c.events("aa-new", "NodePortConflict").is_empty());
    assert!(ok, "no NodePortConflict Event for aa-new");
    assert_ne!(c.allocated("aa-new").unwrap_or_default().get("80/TCP"), Some(&20080));
    assert_eq!(c.allocated("zz-old").unwrap()["80/TCP"], 20080);
    for i in 0..3 {
        c.wait_served(i, 20080, CHANGE);
        let seen = backends_seen(&c, i, 20080, 10);
        assert_eq!(names(&seen), ["be1"], "node-{}: 20080 is zz-old's: {seen:?}", i + 1);
    }

    // A human copies the number onto the younger Service: repaired from the node-port
    // registry, the holder keeps it (tests/tenants.rs: the same by a tenant, in both age orders).
    let mut svc = c.service_json("aa-new").unwrap();
    svc["metadata"]["annotations"]["nodelb.io/allocated-ports"] = "80/TCP=20080".into();
    svc["metadata"].as_object_mut().unwrap().remove("resourceVersion");
    c.api.apply(svc).unwrap();
    let ok = wait_until(CHANGE, || c.allocated("aa-new").unwrap_or_default().get("80/TCP") != Some(&20080));
    assert!(ok, "forged annotation not repaired: {:#}", c.service_json("aa-new").unwrap());
    assert_eq!(c.allocated("zz-old").unwrap()["80/TCP"], 20080, "the holder keeps the port");
    let ok = wait_until(CHANGE, || !c.events("aa-new", "NodePortNotOwned").is_empty());
    assert!(ok, "no NodePortNotOwned Event for aa-new");
    for i in 0..3 {
        let seen = backends_seen(&c, i, 20080, 10);
        assert_eq!(names(&seen), ["be1"], "node-{}: {seen:?}", i + 1);
    }

    // The same on a Service without a port request: it gets its own port back.
    let mut svc = c.service_json("mm-auto").unwrap();
    svc["metadata"]["annotations"]["nodelb.io/allocated-ports"] = "80/TCP=20080".into();
    svc["metadata"].as_object_mut().unwrap().remove("resourceVersion");
    c.api.apply(svc).unwrap();
    let mut moved = None;
    let ok = wait_until(CHANGE, || {
        moved = c.allocated("mm-auto").and_then(|a| a.get("80/TCP").copied()).filter(|p| *p != 20080);
        moved.is_some()
    });
    assert!(ok, "mm-auto still on 20080: {:#}", c.service_json("mm-auto").unwrap());
    let moved = moved.unwrap();
    let taken: Vec<u16> = ["zz-old", "aa-new"]
        .iter()
        .filter_map(|n| c.allocated(n).and_then(|a| a.get("80/TCP").copied()))
        .collect();
    assert!(!taken.contains(&moved), "mm-auto's new port {moved} is not unique: {taken:?}");
    assert_eq!(moved, auto_before, "mm-auto's annotation is written again from the registry");
    assert_eq!(c.allocated("zz-old").unwrap()["80/TCP"], 20080, "the holder keeps the port");
    let ok = wait_until(CHANGE, || !c.events("mm-auto", "NodePortNotOwned").is_empty());
    assert!(ok, "no NodePortNotOwned Event for mm-auto");
    eprintln!("mm-auto: {auto_before} → (hand-copied 20080) → {moved}");
    for i in 0..3 {
        c.wait_served(i, moved, CHANGE);
        let seen = backends_seen(&c, i, moved, 10);
        assert_eq!(names(&seen), ["be3"], "node-{}: {moved} is mm-auto's: {seen:?}", i + 1);
        let seen = backends_seen(&c, i, 20080, 10);
        assert_eq!(names(&seen), ["be1"], "node-{}: 20080 is still zz-old's: {seen:?}", i + 1);
    }
    let leader = c.wait_leader(CHANGE);
    assert_only_leaders_wrote(&c, &[leader]);
}

/// In Kubernetes mode: an allocation that exists (the annotation) beats an
/// explicit request made later, even by a Service older by creationTimestamp. (Two existing
/// claims on one number are still settled "older keeps it":
/// `two_services_asking_for_the_same_port_older_wins`.)
#[test]
fn an_existing_allocation_beats_an_older_service_asking_later() {
    require_root!();
    let c = Cluster::new(2);
    c.create(&web("old", &[(0, 0)]));
    let old_port = c.wait_allocated("old", 1, CHANGE)["80/TCP"];
    std::thread::sleep(Duration::from_millis(1100)); // creationTimestamp has 1 s resolution
    c.create(&web("young", &[(1, 0)]));
    let port = c.wait_allocated("young", 1, CHANGE)["80/TCP"];
    assert_ne!(port, old_port);
    for i in 0..3 {
        c.wait_served(i, port, CHANGE);
    }

    // The older Service now asks for the younger one's number.
    let mut svc = c.service_json("old").unwrap();
    svc["metadata"]["annotations"]["nodelb.io/ports"] = format!("80/TCP={port}").into();
    svc["metadata"].as_object_mut().unwrap().remove("resourceVersion");
    c.api.apply(svc).unwrap();
    c.wait_condition("old", "nodelb.io/Allocated", "False", "PortConflict", CHANGE);
    let cond = c.allocated_condition("old").unwrap();
    let msg = cond["message"].as_str().unwrap_or_default();
    assert!(msg.contains(&port.to_string()) && msg.contains("default/young"), "{cond}");
    let ok = wait_until(CHANGE, || !c.events("old", "NodePortConflict").is_empty());
    assert!(ok, "no NodePortConflict Event for old");
    assert_eq!(c.allocated("young").unwrap()["80/TCP"], port, "the serving Service moved");
    for i in 0..3 {
        let seen = backends_seen(&c, i, port, 10);
        assert_eq!(names(&seen), ["be2"], "node-{}: {port} is still young's: {seen:?}", i + 1);
    }
    let leader = c.wait_leader(CHANGE);
    assert_only_leaders_wrote(&c, &[leader]);
}

/// In Kubernetes mode: an EndpointSlice naming another node's address
/// (node-2's InternalIP: a DNAT to it from node-1 would expose node-2's ports) and the cloud
/// metadata address is refused on every node, the valid endpoint serves everywhere, and the
/// leader says so: `nodelb.io/EndpointsAllowed=False/EndpointRefused` naming both with their
/// reasons, and an `EndpointRefused` Warning Event. Fixed → `True`.
#[test]
fn refused_endpoints_are_named_on_the_service_and_never_reached() {
    require_root!();
    let c = Cluster::new(1);
    let bad = web("web", &[(0, 0)])
        .endpoint(EndpointSpec::remote(IpAddr::V4(node_v4(1)), "node-2"))
        // The API server itself refuses loopback, link-local (169.254.169.254 included) and
        // unspecified EndpointSlice addresses (422), so a metadata address it accepts: Alibaba
        // Cloud's. Node addresses it accepts too: only nodelb refuses them.
        .endpoint(EndpointSpec::remote("100.100.100.200".parse::<IpAddr>().unwrap(), "node-3"));
    c.create(&bad);
    let np = c.wait_allocated("web", 1, CHANGE)["80/TCP"];
    for i in 0..3 {
        c.wait_served(i, np, CHANGE);
        let seen = backends_seen(&c, i, np, 20);
        assert_eq!(names(&seen), ["be1"], "node-{}: {seen:?}", i + 1);
        let st = c.agents[i].service_status("default/web").expect("status");
        let refused: Vec<&str> = st["refusedEndpoints"]
            .as_array()
            .unwrap_or_else(|| panic!("node-{}: {st}", i + 1))
            .iter()
            .filter_map(|r| r["address"].as_str())
            .collect();
        assert_eq!(refused, ["100.100.100.200", "203.0.113.2"], "node-{}: {st}", i + 1);
    }
    c.wait_condition("web", "nodelb.io/EndpointsAllowed", "False", "EndpointRefused", CHANGE);
    let cond = c.condition("web", "nodelb.io/EndpointsAllowed").unwrap();
    let msg = cond["message"].as_str().unwrap_or_default();
    assert!(
        msg.contains("203.0.113.2 (address of Node node-2")
            && msg.contains("100.100.100.200 (cloud metadata"),
        "{cond}"
    );
    let ok = wait_until(CHANGE, || !c.events("web", "EndpointRefused").is_empty());
    assert!(ok, "no EndpointRefused Event");
    c.wait_condition("web", SERVING, "True", "Serving", CHANGE);

    c.update_slices(&web("web", &[(0, 0)]));
    c.wait_condition("web", "nodelb.io/EndpointsAllowed", "True", "EndpointsAllowed", CHANGE);
    let leader = c.wait_leader(CHANGE);
    assert_only_leaders_wrote(&c, &[leader]);
}

/// In Kubernetes mode: the leader cannot see other nodes' sockets, so every
/// agent publishes the ports processes on its node listen on (node Lease annotation
/// `nodelb.io/listening-ports`) and the leader treats them as taken: a new allocation skips a
/// port in use on node-2, a request for it is `PortInUse` (+ `NodePortInUse` Event naming node-2),
/// a request for 22 is `PortNotAllowed` (+ `NodePortNotAllowed`). A listener that appears later on
/// node-3 on an allocated port: node-3 stops DNATing it (its listener answers, its `/status` says
/// why), the other nodes keep serving, the allocation does not move.
#[test]
fn node_ports_in_use_or_not_allowed_are_refused_by_the_leader_and_every_node() {
    require_root!();
    let c = Cluster::new(1);
    let _n2 = Servers::start(&c.nodes[1], "node-2", 20000, 20000);
    let lease = |i: usize| {
        c.api
            .get_typed::<k8s_openapi::api::coordination::v1::Lease>(
                "nodelb-system",
                &format!("nodelb-node-{}", node_name(i)),
            )
            .and_then(|l| l.metadata.annotations?.get("nodelb.io/listening-ports").cloned())
    };
    let ok = wait_until(CHANGE, || lease(1).is_some_and(|v| v.contains("20000/TCP")));
    assert!(ok, "node-2's Lease does not publish its listener: {:?}", lease(1));

    c.create(&web("auto", &[(0, 0)]));
    let port = c.wait_allocated("auto", 1, CHANGE)["80/TCP"];
    assert_eq!(port, 20001, "the leader skips the port node-2 listens on");
    let want = ServiceSpec::new("want")
        .port(PortSpec::tcp(80, Some(20000)))
        .endpoint(EndpointSpec::remote(backend_v4(0), "node-1"));
    c.create(&want);
    c.wait_condition("want", "nodelb.io/Allocated", "False", "PortInUse", CHANGE);
    let msg = c.allocated_condition("want").unwrap()["message"].as_str().unwrap_or_default().to_string();
    assert!(msg.contains("node port 20000/TCP, which is in use: a process listens on it on node-2"), "{msg}");
    assert!(wait_until(CHANGE, || !c.events("want", "NodePortInUse").is_empty()), "no NodePortInUse Event");
    let ssh = ServiceSpec::new("ssh")
        .port(PortSpec::tcp(22, Some(22)))
        .endpoint(EndpointSpec::remote(backend_v4(0), "node-1"));
    c.create(&ssh);
    c.wait_condition("ssh", "nodelb.io/Allocated", "False", "PortNotAllowed", CHANGE);
    assert!(
        wait_until(CHANGE, || !c.events("ssh", "NodePortNotAllowed").is_empty()),
        "no NodePortNotAllowed Event"
    );
    for i in 0..3 {
        c.wait_served(i, port, CHANGE);
        let r = c.get(i, 20000, Duration::from_millis(700));
        assert!(
            !r.as_ref().is_ok_and(|b| b.contains("backend=be")),
            "node-{}: 20000 is served: {r:?}",
            i + 1
        );
    }

    // A listener appears later on node-3, on the allocated port.
    let _n3 = Servers::start(&c.nodes[2], "node-3", port, port);
    let ok = wait_until(CHANGE, || {
        c.agents[2].service_status("default/auto").is_some_and(|s| s["reasonCode"] == "node_port_refused")
    });
    assert!(ok, "node-3 still takes {port}: {:?}", c.agents[2].service_status("default/auto"));
    let ok = wait_until(CHANGE, || c.get(2, port, T).is_ok_and(|b| b.contains("backend=node-3")));
    assert!(ok, "node-3's own listener does not answer on {port}");
    for i in 0..2 {
        let seen = backends_seen(&c, i, port, 5);
        assert_eq!(names(&seen), ["be1"], "node-{}: {seen:?}", i + 1);
    }
    assert_eq!(c.allocated("auto").unwrap()["80/TCP"], port, "the allocation moved");
    let ok = wait_until(CHANGE, || {
        c.events("auto", "NodePortInUse")
            .iter()
            .any(|e| e["note"].as_str().is_some_and(|n| n.contains("on node-3")))
    });
    assert!(ok, "no NodePortInUse Event naming node-3 for auto");
    let leader = c.wait_leader(CHANGE);
    assert_only_leaders_wrote(&c, &[leader]);
}

/// An agent that starts (restarted, installed into a cluster whose Services wait for numbers)
/// runs before it has read its node's sockets; its health and metrics listeners (0.0.0.0:9471
/// and :9472 here) are in the range. The leader hands out no number a running agent has not
/// said is free: a restarted agent's Lease keeps what its predecessor published until it has
/// read its own. A node whose agent has never run (no Lease at all) is unknown to the
/// controller: a number handed out meanwhile that a process there holds is refused by that node
/// alone (its listener answers, its `/status` says why), and the allocation does not move.
#[test]
fn a_starting_agent_reports_its_listeners_before_the_leader_hands_out_a_number() {
    require_root!();
    let mut c = Cluster::with_nodes(1, 1, &["--port-range", "9471-9474"]);
    let lease = |c: &Cluster| {
        c.api
            .get_typed::<k8s_openapi::api::coordination::v1::Lease>("nodelb-system", "nodelb-node-node-1")
            .and_then(|l| l.metadata.annotations?.get("nodelb.io/listening-ports").cloned())
    };
    let ok =
        wait_until(CHANGE, || lease(&c).is_some_and(|v| v.contains("9471/TCP") && v.contains("9472/TCP")));
    assert!(ok, "the agent does not publish its own listeners: {:?}", lease(&c));

    // Restarted: the Service created meanwhile is allocated by the new agent at its first round.
    c.stop_agent(0, Duration::from_secs(10));
    c.create(&web("restart", &[(0, 0)]));
    c.start_agent(0, CHANGE);
    let port = c.wait_allocated("restart", 1, CHANGE)["80/TCP"];
    assert_eq!(port, 9473, "allocated a port the agent listens on");
    c.wait_served(0, port, CHANGE);

    // A new node: no Lease at all, and no agent yet, when the Service comes.
    c.stop_agent(0, Duration::from_secs(10));
    c.api
        .delete("coordination.k8s.io/v1", "Lease", "nodelb-system", "nodelb-node-node-1")
        .expect("delete the node Lease");
    c.create(&web("new-node", &[(0, 0)]));
    let port = c.wait_allocated("new-node", 1, CHANGE)["80/TCP"];
    assert_eq!(port, 9471, "the lowest number no known node holds");
    c.start_agent(0, CHANGE);
    let ok = wait_until(CHANGE, || {
        c.agents[0].service_status("default/new-node").is_some_and(|s| s["reasonCode"] == "node_port_refused")
    });
    assert!(
        ok,
        "node-1 takes {port}, which its own listener holds: {:?}",
        c.agents[0].service_status("default/new-node")
    );
    let ok = wait_until(CHANGE, || lease(&c).is_some_and(|v| v.contains("9471/TCP")));
    assert!(ok, "{:?}", lease(&c));
    let r = c.get(0, 9473, T);
    assert!(r.as_ref().is_ok_and(|b| b.contains("backend=be1")), "restart is still served: {r:?}");
    assert_eq!(c.allocated("new-node").unwrap()["80/TCP"], port, "the allocation moved");
}

#[test]
fn five_hundred_services_at_once() {
    require_root!();
    let c = Cluster::new(1);
    let n = 500;
    // Every Service takes a cluster IP; the server's IPv4 range (192.0.2.0/24) has 253 free, so
    // two more documentation-range ServiceCIDRs (halves no test host uses) make room for 500.
    for (name, cidr) in [("more-1", "198.51.100.128/25"), ("more-2", "203.0.113.128/25")] {
        c.api
            .create(serde_json::json!({
                "apiVersion": "networking.k8s.io/v1", "kind": "ServiceCIDR",
                "metadata": {"name": name}, "spec": {"cidrs": [cidr]},
            }))
            .unwrap_or_else(|e| panic!("ServiceCIDR {cidr}: {e}"));
    }
    let started = Instant::now();
    let specs: Vec<ServiceSpec> = (0..n).map(|k| web(&format!("s{k:03}"), &[(0, k % 3)])).collect();
    for s in &specs {
        c.create(s);
    }
    let mut allocated = BTreeMap::new();
    let ok = wait_until(Duration::from_secs(60), || {
        allocated = c
            .api
            .list("v1", "Service", Some("default"))
            .into_iter()
            .filter_map(|s| {
                let name = s["metadata"]["name"].as_str()?.to_string();
                let v = s["metadata"]["annotations"]["nodelb.io/allocated-ports"].as_str()?.to_string();
                Some((name, common::cluster::parse_ports(&v)["80/TCP"]))
            })
            .collect::<BTreeMap<String, u16>>();
        allocated.len() == n
    });
    assert!(ok, "only {} of {n} Services allocated", allocated.len());
    eprintln!("{n} Services allocated in {:?}", started.elapsed());
    let unique: BTreeSet<u16> = allocated.values().copied().collect();
    assert_eq!(unique.len(), n, "allocations are unique");

    // Every node programs all of them.
    for (i, a) in c.agents.iter().enumerate() {
        let mut programmed = 0;
        let ok = wait_until(Duration::from_secs(60), || {
            programmed = a.status().map_or(0, |st| {
                st["services"]
                    .as_array()
                    .map_or(0, |s| s.iter().filter(|s| s["state"] == "programmed").count())
            });
            programmed == n
        });
        assert!(ok, "node-{}: {programmed} of {n} programmed", i + 1);
    }
    eprintln!("{n} Services programmed on 3 nodes in {:?}", started.elapsed());
    for i in 0..3 {
        for k in (0..n).step_by(37) {
            let port = allocated[&format!("s{k:03}")];
            let body = c.get(i, port, T).unwrap_or_else(|e| panic!("node-{}:{port} (s{k:03}): {e:?}", i + 1));
            assert_eq!(parse_answer(&body).unwrap().0, "be1");
        }
    }
    c.wait_ingress_nodes(&format!("s{:03}", n - 1), &[0, 1, 2], Duration::from_secs(30));
    let leader = c.wait_leader(CHANGE);
    assert_only_leaders_wrote(&c, &[leader]);
}

#[test]
fn api_unreachable_for_30s_traffic_keeps_flowing_and_agents_recover() {
    require_root!();
    let mut c = Cluster::new(2);
    c.create(&web("web", &[(0, 0), (1, 1)]));
    let np = c.wait_allocated("web", 1, CHANGE)["80/TCP"];
    for i in 0..3 {
        c.wait_served(i, np, CHANGE);
    }
    c.wait_ingress_nodes("web", &[0, 1, 2], CHANGE);
    let pids: Vec<Option<u32>> = c.agents.iter().map(|a| a.pid()).collect();

    let loops: Vec<ClientLoop> = (0..3)
        .map(|i| ClientLoop::http(&c.client, IpAddr::V4(node_v4(i)), np, Duration::from_millis(100), T))
        .collect();
    // The API server process goes away (as in an upgrade of the control plane): connections
    // reset, new ones refused; it comes back on the same data (etcd, certificates, tokens).
    c.api.stop();
    let down = Instant::now();
    std::thread::sleep(Duration::from_secs(30));
    c.api.clear_requests();
    c.api.start_again();
    eprintln!("API was unreachable for {:?}", down.elapsed());
    for (i, l) in loops.into_iter().enumerate() {
        let results = l.stop();
        let failed: Vec<_> = results.iter().filter(|r| r.is_err()).collect();
        assert!(results.len() > 100, "node-{}: only {} requests", i + 1, results.len());
        assert!(
            failed.is_empty(),
            "node-{}: {} of {} failed: {:?}",
            i + 1,
            failed.len(),
            results.len(),
            &failed[..failed.len().min(5)]
        );
    }

    // Recovery without restarts: a Service created now is allocated and served everywhere.
    let back = Instant::now();
    c.create(&web("after", &[(0, 0)]));
    let np2 = c.wait_allocated("after", 1, Duration::from_secs(60))["80/TCP"];
    for i in 0..3 {
        c.wait_served(i, np2, Duration::from_secs(60));
    }
    c.wait_ingress_nodes("after", &[0, 1, 2], Duration::from_secs(30));
    eprintln!("recovered {:?} after the API came back", back.elapsed());
    c.wait_ingress_nodes("web", &[0, 1, 2], CHANGE);
    assert_eq!(c.allocated("web").unwrap()["80/TCP"], np);
    // Nothing changed for `web`: coming back must not rewrite it (e.g. drop the nodes from its status
    // because the node Leases look expired in a cache that has not caught up yet, then add them back).
    let rewrites: Vec<_> = c
        .api
        .agent_requests()
        .into_iter()
        .filter(|r| r.is_write() && r.path.contains("/services/web"))
        .collect();
    assert!(rewrites.is_empty(), "web rewritten after the outage: {rewrites:#?}");
    for (i, a) in c.agents.iter_mut().enumerate() {
        assert!(a.is_running(), "node-{}: agent exited", i + 1);
        assert_eq!(a.pid(), pids[i], "node-{}: agent restarted", i + 1);
    }
}

/// `ForwardingDisabled` Events on Node `node`.
fn forwarding_events(c: &Cluster, node: &str) -> Vec<serde_json::Value> {
    c.api
        .list("events.k8s.io/v1", "Event", None)
        .into_iter()
        .filter(|e| {
            e["reason"] == "ForwardingDisabled"
                && e["regarding"]["kind"] == "Node"
                && e["regarding"]["name"] == node
        })
        .collect()
}

#[test]
fn a_node_with_forwarding_off_leaves_the_status() {
    require_root!();
    let mut c = Cluster::new(1);
    c.create(&web("web", &[(0, 0)]));
    c.wait_allocated("web", 1, CHANGE);
    c.wait_ingress_nodes("web", &[0, 1, 2], CHANGE);
    // The leader's Service Event is out before Event writes are made to fail below.
    let ok = wait_until(CHANGE, || !c.events("web", "NodePortsAllocated").is_empty());
    assert!(ok, "no NodePortsAllocated Event");

    // IPv6 forwarding off on node-2, where no Service needs IPv6: no Warning Event for it.
    c.nodes[1].sysctl("net.ipv6.conf.all.forwarding", "0");
    // Event writes are refused for a while (the ClusterRole loses events.k8s.io: 403 from the
    // real authorizer): the ForwardingDisabled Event of node-3 is retried until it is recorded,
    // not forgotten.
    c.revoke("events.k8s.io", "events");
    c.nodes[2].sysctl("net.ipv4.ip_forward", "0");
    let off = Instant::now();
    // Written to the node Lease at once (not at the next renewal), then the leader's round.
    c.wait_ingress_nodes("web", &[0, 1], Duration::from_secs(5));
    eprintln!("node-3 left the status {:?} after forwarding went off", off.elapsed());
    let refused = |c: &Cluster| {
        c.api
            .agent_requests()
            .into_iter()
            .filter(|r| r.resource == "events" && r.verb == "create" && r.status == 403)
            .count()
    };
    let ok = wait_until(CHANGE, || refused(&c) >= 2);
    assert!(ok, "the agents' Event writes were not refused: {}", refused(&c));
    assert!(forwarding_events(&c, "node-3").is_empty(), "recorded although refused");
    c.restore_rbac();
    let ok = wait_until(CHANGE, || !forwarding_events(&c, "node-3").is_empty());
    assert!(ok, "no ForwardingDisabled Event on Node node-3 after the RBAC came back");
    // The refusals are the fault; what follows must be granted.
    c.api.clear_requests();
    let ev = &forwarding_events(&c, "node-3")[0];
    assert!(ev["note"].as_str().unwrap_or_default().contains("net.ipv4.ip_forward"), "{ev}");
    assert_eq!(ev["type"], "Warning", "{ev}");
    // node-2's IPv6 went off before node-3's IPv4 did, and another renewal period has passed.
    std::thread::sleep(Duration::from_millis(1500));
    assert_eq!(
        forwarding_events(&c, "node-2"),
        Vec::<serde_json::Value>::new(),
        "IPv6 is needed by no Service"
    );
    c.wait_condition("web", SERVING, "True", "Serving", CHANGE);

    // Forwarding off everywhere: no node can serve. The allocation stands (Allocated stays
    // True); the Serving condition carries the state of the NoServingNode Event.
    for i in 0..2 {
        c.nodes[i].sysctl("net.ipv4.ip_forward", "0");
    }
    c.wait_ingress_nodes("web", &[], Duration::from_secs(5));
    c.wait_condition("web", SERVING, "False", "NoServingNode", CHANGE);
    assert_eq!(c.allocated_condition("web").unwrap()["reason"], "Allocated");
    let ok = wait_until(CHANGE, || !c.events("web", "NoServingNode").is_empty());
    assert!(ok, "no NoServingNode Event");
    let msg = c.condition("web", SERVING).unwrap()["message"].clone();
    assert_eq!(c.events("web", "NoServingNode")[0]["note"], msg, "Event and condition say the same");

    for i in 0..3 {
        c.nodes[i].sysctl("net.ipv4.ip_forward", "1");
    }
    c.wait_ingress_nodes("web", &[0, 1, 2], Duration::from_secs(5));
    c.wait_condition("web", SERVING, "True", "Serving", CHANGE);
    c.assert_rbac_allows_every_request();
}

/// A node whose host firewall drops forwarded traffic (iptables-nft's FORWARD policy, as Docker
/// or ufw leave it) is not listed: the agent reports the family as not served in its node Lease
/// within a resync period, the leader drops the node from the Services' status, and a Warning
/// Event `ForwardedTrafficDropped` on the Node names the chain and the fix. Lifted: listed and
/// served again.
#[test]
fn a_node_whose_firewall_drops_forwarded_traffic_leaves_the_status() {
    require_root!();
    let c = Cluster::new(1);
    c.create(&web("web", &[(0, 0)]));
    let np = c.wait_allocated("web", 1, CHANGE).into_values().next().expect("a node port");
    c.wait_ingress_nodes("web", &[0, 1, 2], CHANGE);
    c.wait_served(2, np, CHANGE);

    c.nodes[2].exec_ok("iptables-nft", &["-P", "FORWARD", "DROP"]);
    let dropped = Instant::now();
    // The agents check every resync period (1 s here), then the node Lease and the leader's round.
    c.wait_ingress_nodes("web", &[0, 1], Duration::from_secs(5));
    eprintln!("node-3 left the status {:?} after its FORWARD policy went to drop", dropped.elapsed());
    let ok = wait_until(CHANGE, || !c.events("node-3", "ForwardedTrafficDropped").is_empty());
    assert!(ok, "no ForwardedTrafficDropped Event on Node node-3");
    let ev = &c.events("node-3", "ForwardedTrafficDropped")[0];
    assert_eq!((&ev["type"], &ev["regarding"]["kind"]), (&"Warning".into(), &"Node".into()), "{ev}");
    let note = ev["note"].as_str().unwrap_or_default();
    assert!(
        note.contains("table ip filter chain FORWARD") && note.contains("--iptables-forward-accept"),
        "{ev}"
    );
    assert!(
        c.events("node-1", "ForwardedTrafficDropped").is_empty()
            && c.events("node-2", "ForwardedTrafficDropped").is_empty()
    );
    c.wait_condition("web", SERVING, "True", "Serving", CHANGE);

    c.nodes[2].exec_ok("iptables-nft", &["-P", "FORWARD", "ACCEPT"]);
    c.wait_ingress_nodes("web", &[0, 1, 2], Duration::from_secs(5));
    c.wait_served(2, np, CHANGE);
    c.assert_rbac_allows_every_request();
}

#[test]
fn a_leader_shut_down_gracefully_hands_over_at_once() {
    require_root!();
    let mut c = Cluster::new(1);
    c.create(&web("web", &[(0, 0)]));
    let before = c.wait_allocated("web", 1, CHANGE);
    let old = c.wait_leader(CHANGE);
    let term = Instant::now();
    let status = c.stop_controller(old, Duration::from_secs(10));
    assert!(status.is_some_and(|s| s.success()), "SIGTERM: clean exit, got {status:?}");
    let mut new = None;
    // Released, not expired: a successor takes it at its next poll (lease/3 = 1 s), well before
    // the 3 s a SIGKILLed leader costs.
    let ok = wait_until(Duration::from_secs(3), || {
        new = c.leader_index();
        new.is_some_and(|n| n != old)
    });
    assert!(ok, "no successor within 3 s of SIGTERM; holder {:?}", c.leader());
    eprintln!(
        "leader {} → {} {:?} after SIGTERM",
        controller_name(old),
        controller_name(new.unwrap()),
        term.elapsed()
    );
    c.create(&web("after", &[(0, 0)]));
    c.wait_allocated("after", 1, CHANGE);
    assert_eq!(c.allocated("web").unwrap(), before);
    assert_only_leaders_wrote(&c, &[old, new.unwrap()]);
}

/// Now, as a Lease's `renewTime` (RFC 3339, microseconds).
fn micro_time_now() -> String {
    let out = std::process::Command::new("date").args(["-u", "+%Y-%m-%dT%H:%M:%S.%6NZ"]).output().unwrap();
    String::from_utf8(out.stdout).unwrap().trim().to_string()
}

#[test]
fn the_leader_lease_deleted_or_stolen_by_hand() {
    require_root!();
    // A resync recomputes everything: a long period, so that what is checked below is the
    // node's own bound on a Service waiting for the leader.
    let mut c = Cluster::with_agent_args(1, &["--resync-period", "60s"]);
    c.create(&web("web", &[(0, 0)]));
    let before = c.wait_allocated("web", 1, CHANGE);
    c.wait_leader(CHANGE);

    // Deleted with kubectl: an agent creates it again; allocations stay, allocation goes on.
    c.api.kubectl_ok(&["delete", "lease", LEADER_LEASE, "-n", AGENT_NS]);
    let again = c.wait_leader(CHANGE);
    eprintln!("after the delete: {} leads", controller_name(again));
    c.create(&web("after-delete", &[(0, 0)]));
    c.wait_allocated("after-delete", 1, CHANGE);
    // Its status write follows its annotation write in the same round: done before the requests
    // below are counted, which start while this replica still leads.
    c.wait_ingress_nodes("after-delete", &[0, 1, 2], CHANGE);
    assert_eq!(c.allocated("web").unwrap(), before);

    // Stolen by hand: another holder, renewed now, for 10 s. Every replica stops acting as
    // leader (the holder is not them) and none writes a Service while the intruder's Lease is
    // valid; once it has not changed for its whole duration, a replica takes it over and
    // allocates what was created meanwhile.
    c.api.clear_requests();
    let patch = format!(
        r#"{{"spec":{{"holderIdentity":"intruder","leaseDurationSeconds":10,"renewTime":"{}"}}}}"#,
        micro_time_now()
    );
    // Before the request: no agent can have seen the change earlier.
    let stolen = Instant::now();
    c.api.kubectl_ok(&["patch", "lease", LEADER_LEASE, "-n", AGENT_NS, "--type=merge", "-p", &patch]);
    let ok = wait_until(Duration::from_secs(5), || {
        (0..2).all(|k| c.controller_metric_sum(k, "nodelb_leader") == 0.0)
    });
    assert!(ok, "a replica still acts as leader after the Lease was stolen");
    c.create(&web("during", &[(0, 0)]));
    // Nobody decides for it, yet each node reports it, and why it is not served, within the
    // second a node leaves a Service that waits for the leader (plus a sync; UNDECIDED_WAIT).
    for (i, a) in c.agents.iter().enumerate() {
        a.wait_state("default/during", "refused", Duration::from_secs(3));
        let reason = a.service_status("default/during").unwrap()["reason"].to_string();
        assert!(reason.contains("written by the leader"), "node-{}: {reason}", i + 1);
    }
    std::thread::sleep(Duration::from_secs(7).saturating_sub(stolen.elapsed()));
    assert_eq!(c.allocated("during"), None, "allocated while the intruder held the Lease");
    assert_eq!(c.service_writers(), BTreeSet::new(), "Services written while the intruder held the Lease");
    let mut new = None;
    let ok = wait_until(Duration::from_secs(20), || {
        new = c.leader_index();
        new.is_some()
    });
    assert!(ok, "nobody took the stolen Lease over: holder {:?}", c.leader());
    let took = stolen.elapsed();
    eprintln!("{} took the stolen Lease over after {took:?}", controller_name(new.unwrap()));
    assert!(took >= Duration::from_secs(10), "taken over before the intruder's 10 s ran out: {took:?}");
    c.wait_allocated("during", 1, CHANGE);
    assert_eq!(c.allocated("web").unwrap(), before);
    assert_only_leaders_wrote(&c, &[new.unwrap()]);
}

/// Creates `default/web` (backends be1 on node-1, be2 on node-2) and waits until every node serves
/// it, its status lists every node and says Serving; returns its node port.
fn serve_web(c: &Cluster) -> u16 {
    c.create(&web("web", &[(0, 0), (1, 1)]));
    let np = c.wait_allocated("web", 1, CHANGE)["80/TCP"];
    for i in 0..3 {
        c.wait_served(i, np, CHANGE);
        let table = c.nft(i).expect("table inet nodelb");
        assert!(
            table.contains(&format!(". {np} ")) && table.contains("default/web/"),
            "node-{}: {table}",
            i + 1
        );
    }
    c.wait_ingress_nodes("web", &[0, 1, 2], CHANGE);
    c.wait_condition("web", SERVING, "True", "Serving", CHANGE);
    np
}

/// Replaces `default/name` (unconditionally) with its current object changed by `f`.
fn edit(c: &Cluster, name: &str, f: impl FnOnce(&mut serde_json::Value)) {
    let mut svc = c.service_json(name).unwrap_or_else(|| panic!("no Service default/{name}"));
    f(&mut svc);
    svc["metadata"].as_object_mut().unwrap().remove("resourceVersion");
    c.api.apply(svc).unwrap();
}

#[test]
fn a_service_that_stops_being_ours_loses_its_rules_and_allocation_everywhere() {
    require_root!();
    let c = Cluster::new(2);
    let np = serve_web(&c);

    // A typo in nodelb.io/ignore is neither an opt-out nor "not ignored": refused, with a Warning
    // Event naming annotation and value; the Service stays as it was (rules, port, status).
    edit(&c, "web", |v| v["metadata"]["annotations"]["nodelb.io/ignore"] = "yes".into());
    let ok = wait_until(CHANGE, || {
        c.events("web", "InvalidInput")
            .iter()
            .any(|e| e["note"].as_str().is_some_and(|n| n.contains("nodelb.io/ignore=\"yes\"")))
    });
    assert!(
        ok,
        "no InvalidInput Event naming nodelb.io/ignore=\"yes\": {:#?}",
        c.events("web", "InvalidInput")
    );
    c.wait_condition("web", "nodelb.io/Allocated", "False", "InvalidInput", CHANGE);
    assert_eq!(c.allocated("web").unwrap()["80/TCP"], np, "allocation kept");
    assert_eq!(c.ingress_ips("web").len(), 3, "status kept");
    for i in 0..3 {
        c.get(i, np, T).unwrap_or_else(|e| panic!("node-{}: old rules kept, got {e:?}", i + 1));
    }

    // type: ClusterIP (the typo fixed at the same time): no longer ours. Its rules go on every
    // node, and our annotation, ingress and conditions go from the Service.
    edit(&c, "web", |v| {
        v["metadata"]["annotations"].as_object_mut().unwrap().remove("nodelb.io/ignore");
        v["spec"]["type"] = "ClusterIP".into();
    });
    for i in 0..3 {
        wait_rules_gone(&c, i, "web", np);
    }
    let ok = wait_until(CHANGE, || {
        c.allocated("web").is_none()
            && c.ingress("web").is_empty()
            && c.allocated_condition("web").is_none()
            && c.condition("web", SERVING).is_none()
    });
    assert!(ok, "our marks still on default/web: {:#}", c.service_json("web").unwrap());
    // The port is free again.
    c.create(&web("next", &[(0, 0)]));
    assert_eq!(c.wait_allocated("next", 1, CHANGE)["80/TCP"], np);
    let leader = c.wait_leader(CHANGE);
    assert_only_leaders_wrote(&c, &[leader]);
}

/// Services without a `loadBalancerClass` that another load balancer serves are left to it
/// (docs/design.md, "Which Services"): one annotated for MetalLB is never taken; one nodelb
/// serves whose status MetalLB then writes is given up (rules gone everywhere, nodelb's
/// annotation and conditions removed, MetalLB's ingress kept, nothing written after); one that
/// names nodelb's class stays nodelb's whatever its status says.
#[test]
fn unclassed_services_another_load_balancer_serves_are_left_to_it() {
    require_root!();
    let c = Cluster::new(2);
    let np = serve_web(&c);
    let create = |spec: ServiceSpec, f: fn(&mut serde_json::Value)| {
        let mut svc = spec.service();
        svc["spec"].as_object_mut().unwrap().remove("selector");
        f(&mut svc);
        c.api.create(svc).expect("create the Service");
        for s in spec.slices() {
            c.api.create(s).expect("create its slice");
        }
    };
    create(web("metal", &[(0, 0)]), |v| {
        v["metadata"]["annotations"]["metallb.universe.tf/address-pool"] = "public".into()
    });
    create(web("classed", &[(1, 1)]), |v| v["spec"]["loadBalancerClass"] = "nodelb.io/nodelb".into());
    let classed_np = c.wait_allocated("classed", 1, CHANGE)["80/TCP"];

    // MetalLB publishes its address on `web` (and on `classed`), as its controller does.
    let metallb = serde_json::json!({"status": {"loadBalancer": {"ingress": [{"ip": "198.51.100.200"}]}}});
    for name in ["web", "classed"] {
        c.api.patch_status("v1", "Service", "default", name, metallb.clone());
    }
    for i in 0..3 {
        wait_rules_gone(&c, i, "web", np);
    }
    let ok = wait_until(CHANGE, || {
        c.allocated("web").is_none()
            && c.allocated_condition("web").is_none()
            && c.condition("web", SERVING).is_none()
    });
    assert!(ok, "nodelb's marks still on default/web: {:#}", c.service_json("web").unwrap());
    assert_eq!(c.ingress_ips("web"), ["198.51.100.200"], "MetalLB's ingress is kept");
    // Named by its class: still nodelb's, its status nodelb's again.
    c.wait_ingress_nodes("classed", &[0, 1, 2], CHANGE);
    for i in 0..3 {
        c.wait_served(i, classed_np, CHANGE);
    }
    // Never taken: no annotation, no condition, no Event, nothing written to it.
    std::thread::sleep(Duration::from_secs(2));
    let metal = c.service_json("metal").unwrap();
    assert!(c.allocated("metal").is_none() && metal["status"]["conditions"].is_null(), "{metal:#}");
    let before = c.service_json("web").unwrap()["metadata"]["resourceVersion"].clone();
    std::thread::sleep(Duration::from_secs(3));
    assert_eq!(c.service_json("web").unwrap()["metadata"]["resourceVersion"], before, "no fight over web");
    let writes: Vec<String> = (c.api.agent_requests().into_iter())
        .filter(|r| r.is_write() && r.path.contains("/services/metal"))
        .map(|r| r.path)
        .collect();
    assert!(writes.is_empty(), "nodelb wrote default/metal: {writes:?}");
}

/// The cluster's own addresses are never endpoints, whoever names them: an address node-2's
/// agent reads on its node after start (not on its Node object: published on its node Lease),
/// Azure's platform address, an address in the cluster's Service CIDR (a ClusterIP: the
/// `ServiceCIDR` object) and the API server's endpoint (`default/kubernetes`). Every node refuses
/// each with its reason and never reaches them (a server listens on node-2's new address); the
/// valid endpoint serves.
#[test]
fn the_clusters_own_addresses_are_never_endpoints() {
    require_root!();
    let c = Cluster::new(1);
    let added = "198.51.100.250";
    c.nodes[1].ip(&["addr", "add", &format!("{added}/32"), "dev", "eth1"]);
    let _secret = common::topology::Servers::start(
        &c.nodes[1],
        "node-2-itself",
        common::topology::BACKEND_TCP_PORT,
        common::topology::BACKEND_UDP_PORT,
    );
    // The agents publish what they read: wait for node-2's Lease to carry it.
    let published = wait_until(CHANGE, || {
        c.api.get("coordination.k8s.io/v1", "Lease", AGENT_NS, "nodelb-node-node-2").is_some_and(|l| {
            l["metadata"]["annotations"]["nodelb.io/addresses"].as_str().is_some_and(|a| a.contains(added))
        })
    });
    assert!(published, "node-2's agent did not publish {added}");
    let addresses = ["168.63.129.16", "192.0.2.77", "203.0.113.100", added];
    let mut bad = web("web", &[(0, 0)]);
    for a in addresses {
        bad = bad.endpoint(EndpointSpec::remote(a.parse::<IpAddr>().unwrap(), "node-2"));
    }
    c.create(&bad);
    let np = c.wait_allocated("web", 1, CHANGE)["80/TCP"];
    let want = [
        ("168.63.129.16", "cloud_metadata"),
        ("192.0.2.77", "service_cidr"),
        (added, "node_address"),
        ("203.0.113.100", "api_server"),
    ];
    for i in 0..3 {
        let mut refused = Vec::new();
        let ok = wait_until(CHANGE, || {
            let st = c.agents[i].service_status("default/web").unwrap_or_default();
            refused = (st["refusedEndpoints"].as_array().cloned().unwrap_or_default().iter())
                .map(|r| {
                    (
                        r["address"].as_str().unwrap_or("").to_string(),
                        r["reasonCode"].as_str().unwrap_or("").to_string(),
                    )
                })
                .collect::<Vec<_>>();
            refused.len() == want.len()
        });
        assert!(ok, "node-{}: refused {refused:?}", i + 1);
        let refused: Vec<(&str, &str)> = refused.iter().map(|(a, r)| (a.as_str(), r.as_str())).collect();
        assert_eq!(refused, want, "node-{}", i + 1);
        c.wait_served(i, np, CHANGE);
        let seen = backends_seen(&c, i, np, 20);
        assert_eq!(names(&seen), ["be1"], "node-{}: {seen:?}", i + 1);
    }
    c.wait_condition("web", "nodelb.io/EndpointsAllowed", "False", "EndpointRefused", CHANGE);
    let cond = c.condition("web", "nodelb.io/EndpointsAllowed").unwrap();
    let msg = cond["message"].as_str().unwrap_or_default();
    for part in [
        "192.0.2.77 (inside ServiceCIDR kubernetes",
        "203.0.113.100 (an endpoint of the API server",
        "node node-2 (its agent)",
    ] {
        assert!(msg.contains(part), "{part:?} not in {cond}");
    }
}

/// kube-proxy's NodePorts are a side door: a Service with source ranges (or refused endpoints, or
/// a pool restricting nodes or addresses) that still has Kubernetes NodePorts says so
/// (`KubeNodePortsClosed=False/KubeNodePortsOpen` naming the NodePort, a Warning Event); one
/// created with `allocateLoadBalancerNodePorts: false` is `True`; one with nothing to get
/// around has no such condition.
#[test]
fn kube_node_ports_that_bypass_nodelb_are_named_on_the_service() {
    require_root!();
    const CONDITION: &str = "nodelb.io/KubeNodePortsClosed";
    let c = Cluster::new(1);
    let ranged = |name: &str| web(name, &[(0, 0)]).source_range(&format!("{CLIENT_V4}/32"));
    c.create(&ranged("open"));
    c.create(&ranged("closed").without_kube_node_ports());
    c.create(&web("plain", &[(0, 0)]));
    c.wait_condition("open", CONDITION, "False", "KubeNodePortsOpen", CHANGE);
    let node_port =
        c.service_json("open").unwrap()["spec"]["ports"][0]["nodePort"].as_u64().expect("a NodePort");
    let cond = c.condition("open", CONDITION).unwrap();
    let msg = cond["message"].as_str().unwrap_or_default();
    assert!(msg.contains(&node_port.to_string()) && msg.contains("loadBalancerSourceRanges"), "{cond}");
    let ok = wait_until(CHANGE, || !c.events("open", "KubeNodePortsOpen").is_empty());
    assert!(ok, "no KubeNodePortsOpen Event for default/open");
    c.wait_condition("closed", CONDITION, "True", "KubeNodePortsClosed", CHANGE);
    c.wait_condition("plain", SERVING, "True", "Serving", CHANGE);
    assert!(c.condition("plain", CONDITION).is_none(), "{:#}", c.service_json("plain").unwrap());
}

#[test]
fn nothing_is_programmed_or_allocated_before_the_caches_are_complete() {
    require_root!();
    // When the agents start, `old` carries an allocation (as after a restart of every agent) and
    // `new` none; both have endpoints. The installed ClusterRole lacks EndpointSlices (an
    // operator's broken RBAC, refused by the real authorizer): every other cache completes, that
    // one does not.
    let old = web("old", &[(0, 0)]);
    let new = web("new", &[(1, 1)]);
    let mut c = Cluster::with_api_setup(2, |api| {
        for spec in [&old, &new] {
            let mut svc = spec.service();
            svc["spec"].as_object_mut().unwrap().remove("selector");
            if spec.name == "old" {
                svc["metadata"]["annotations"]["nodelb.io/allocated-ports"] = "80/TCP=20080".into();
            }
            api.create(svc).unwrap();
        }
        for s in old.slices().into_iter().chain(new.slices()) {
            api.create(s).unwrap();
        }
        common::cluster::revoke(api, "discovery.k8s.io", "endpointslices");
    });
    let listed_by_all = |path: &str| {
        let by: BTreeSet<IpAddr> = c
            .api
            .requests()
            .iter()
            .filter(|r| r.path == path && !r.watch && r.status == 200)
            .map(|r| r.peer)
            .collect();
        by.len() == 3 + common::cluster::CONTROLLERS
    };
    let ok = wait_until(CHANGE, || {
        ["/api/v1/services", "/api/v1/nodes", "/apis/coordination.k8s.io/v1/namespaces/nodelb-system/leases"]
            .iter()
            .all(|p| listed_by_all(p))
    });
    assert!(ok, "the agents and the controller replicas did not list Services, Nodes and Leases");
    let leader = c.wait_leader(CHANGE);
    // A few allocation rounds (every 2 s and on every change) and resyncs (every 1 s).
    std::thread::sleep(Duration::from_secs(5));
    assert_eq!(c.allocated("new"), None, "allocated from a partial view");
    assert!(c.service_writers().is_empty(), "Services written from a partial view");
    let old_status = &c.service_json("old").unwrap()["status"];
    assert!(
        old_status["loadBalancer"]["ingress"].is_null() && old_status["conditions"].is_null(),
        "{old_status}"
    );
    for i in 0..3 {
        let table = c.nft(i).unwrap_or_default();
        assert!(
            !table.contains("20080") && !table.contains("default/"),
            "node-{}: programmed from a partial view: {table}",
            i + 1
        );
        let st = c.agents[i].status().expect("/status answers");
        assert_eq!(
            (&st["sourceSynced"], &st["services"]),
            (&false.into(), &serde_json::json!([])),
            "node-{}",
            i + 1
        );
        assert_ne!(
            c.agents[i].readyz().map(|r| r.0),
            Some(200),
            "node-{} ready before its caches are complete",
            i + 1
        );
    }

    // The slices were refused, not served from a partial list.
    let refused: BTreeSet<IpAddr> = c
        .api
        .agent_requests()
        .iter()
        .filter(|r| r.resource == "endpointslices" && r.status == 403)
        .map(|r| r.peer)
        .collect();
    assert_eq!(refused.len(), 3, "every agent was refused EndpointSlices");

    // RBAC fixed: the lists complete; `old` is served on the port it had, `new` gets another.
    c.restore_rbac();
    // The watchers back off (up to ~30 s) after the refusals.
    c.wait_ready(Duration::from_secs(60));
    for i in 0..3 {
        c.wait_served(i, 20080, CHANGE);
    }
    let np = c.wait_allocated("new", 1, CHANGE)["80/TCP"];
    assert_ne!(np, 20080);
    for i in 0..3 {
        c.wait_served(i, np, CHANGE);
    }
    assert_eq!(c.allocated("old").unwrap()["80/TCP"], 20080, "the allocation from before is kept");
    c.wait_ingress_nodes("old", &[0, 1, 2], CHANGE);
    let now = c.wait_leader(CHANGE);
    assert_only_leaders_wrote(&c, &[leader, now]);
}

/// `nodelb_syncs_total` (every recompute) and `nodelb_netlink_batch_messages_count` (every batch
/// sent to the kernel) per node, once they stop moving (2 s without change).
fn quiet_counters(c: &Cluster) -> Vec<(f64, f64)> {
    let read = || -> Vec<(f64, f64)> {
        (0..c.nodes.len())
            .map(|i| {
                (
                    c.metric_sum(i, "nodelb_syncs_total"),
                    c.metric_sum(i, "nodelb_netlink_batch_messages_count"),
                )
            })
            .collect()
    };
    let mut last = read();
    for _ in 0..10 {
        std::thread::sleep(Duration::from_secs(2));
        let now = read();
        if now == last {
            return now;
        }
        last = now;
    }
    panic!("sync counters keep moving: {last:?}");
}

/// Most of a cluster's Services are not nodelb's (ClusterIP, another class): their changes and
/// their endpoints' cost a node no recompute (docs/design/incremental.md, "Nothing computed for
/// what no rule can come of"); a LoadBalancer Service created after them is served everywhere as
/// before.
#[test]
fn services_nodelb_does_not_serve_cost_the_nodes_no_sync() {
    require_root!();
    let c = Cluster::new(2);
    serve_web(&c);
    let before = quiet_counters(&c);

    // A ClusterIP Service: created with its EndpointSlice, its endpoints changed, its labels
    // edited, then deleted with its slice.
    let mut spec = web("internal", &[(0, 0)]);
    let mut svc = spec.service();
    svc["spec"]["type"] = serde_json::json!("ClusterIP");
    for field in ["selector", "externalTrafficPolicy", "allocateLoadBalancerNodePorts"] {
        svc["spec"].as_object_mut().unwrap().remove(field);
    }
    c.api.create(svc).expect("ClusterIP Service");
    for s in spec.slices() {
        c.api.create(s).expect("its EndpointSlice");
    }
    spec = spec.endpoint(EndpointSpec::remote(backend_v4(1), "node-2"));
    for s in spec.slices() {
        c.api.apply(s).expect("its EndpointSlice, scaled");
    }
    c.api.kubectl_ok(&["label", "service", "internal", "-n", "default", "tier=backend"]);
    c.api.delete_now("v1", "Service", "default", "internal").expect("delete");
    for s in spec.slices() {
        let name = s["metadata"]["name"].as_str().unwrap().to_string();
        c.api.delete_now("discovery.k8s.io/v1", "EndpointSlice", "default", &name).expect("delete slice");
    }
    let after = quiet_counters(&c);
    assert_eq!(after, before, "(syncs, kernel batches) per node moved for a Service nodelb does not serve");

    // A LoadBalancer Service is served on every node as soon as the leader has decided for it,
    // which moves the counters.
    c.create(&web("after", &[(0, 0)]));
    let np = c.wait_allocated("after", 1, CHANGE)["80/TCP"];
    for (i, (syncs, _)) in before.iter().enumerate() {
        c.wait_served(i, np, CHANGE);
        assert!(c.metric_sum(i, "nodelb_syncs_total") > *syncs, "node-{}", i + 1);
    }
}

#[test]
fn a_relist_after_410_gone_reprograms_nothing_and_later_changes_are_served() {
    require_root!();
    // Without the watch cache, a watch resumes from etcd, so etcd's compaction is what answers
    // 410 Gone (with it, the cache answers from its in-memory window, whatever etcd compacted).
    let mut c = Cluster::with_apiserver_args(2, &["--watch-cache=false"]);
    serve_web(&c);
    let before = quiet_counters(&c);
    let restarts: Vec<f64> = (0..3).map(|i| c.metric_sum(i, "nodelb_watch_restarts_total")).collect();
    let old_rv = c.api.list_version("v1", "Service");
    c.api.clear_requests();

    // Every watch connection is reset and, while new ones are refused, the history is compacted
    // past every watch's resourceVersion: each resumes into 410 Gone and relists everything.
    c.api.cut(Fault::Reset);
    // Two writes, so the compacted revision is past the one after every resourceVersion seen.
    for name in ["bump-1", "bump-2"] {
        c.api.create(common::kube::namespace(name)).unwrap();
    }
    let rev = c.api.compact();
    eprintln!("etcd compacted at revision {rev} (Services listed at {old_rv})");
    // The fault is real: a watch from before the compaction is answered 410 Gone.
    let gone = c.api.kubectl_ok(&[
        "get",
        "--raw",
        &format!("/api/v1/services?watch=true&resourceVersion={old_rv}&timeoutSeconds=1"),
    ]);
    assert!(gone.contains("\"code\":410"), "a watch from {old_rv} after compaction: {gone}");
    c.api.reopen();
    let lists = ["/api/v1/services", "/apis/discovery.k8s.io/v1/endpointslices", "/api/v1/nodes"];
    let ok = wait_until(Duration::from_secs(30), || {
        let log = c.api.agent_requests();
        lists.iter().all(|p| {
            let by: BTreeSet<IpAddr> =
                log.iter().filter(|r| r.path == *p && !r.watch && r.status == 200).map(|r| r.peer).collect();
            by.len() == 3
        }) && (0..3).all(|i| c.metric_sum(i, "nodelb_watch_restarts_total") > restarts[i])
    });
    assert!(ok, "not every agent relisted: {:#?}", c.api.agent_requests());
    // Time for what a relist could trigger: the debounce, a resync (1 s), an allocation round (2 s).
    std::thread::sleep(Duration::from_secs(3));
    let after = quiet_counters(&c);
    assert_eq!(after, before, "(syncs, kernel batches) per node changed although nothing did");
    let rewrites: Vec<_> = c
        .api
        .agent_requests()
        .into_iter()
        .filter(|r| r.is_write() && r.path.contains("/services/"))
        .collect();
    assert!(rewrites.is_empty(), "Services rewritten after the relist: {rewrites:#?}");

    // The watches work again: a change is served everywhere (and does move the counters).
    c.create(&web("after", &[(0, 0)]));
    let np2 = c.wait_allocated("after", 1, CHANGE)["80/TCP"];
    for (i, (_, batches)) in before.iter().enumerate() {
        c.wait_served(i, np2, CHANGE);
        assert!(c.metric_sum(i, "nodelb_netlink_batch_messages_count") > *batches, "node-{}", i + 1);
    }
    c.wait_ingress_nodes("after", &[0, 1, 2], CHANGE);
    let leader = c.wait_leader(CHANGE);
    assert_only_leaders_wrote(&c, &[leader]);
}

/// kube-proxy's programming-latency SLI, `nodelb_network_programming_duration_seconds`: from
/// the EndpointSlice controller's `endpoints.kubernetes.io/last-change-trigger-time` on a slice
/// to this node's rules for it in the kernel, once per slice change of a Service the node
/// programs (on every node); a slice of a Service that is not nodelb's is not counted.
#[test]
fn network_programming_latency_runs_from_the_slices_trigger_time_to_the_kernel() {
    require_root!();
    let c = Cluster::new(1);
    const METRIC: &str = "nodelb_network_programming_duration_seconds";
    let create = |spec: &ServiceSpec, cluster_ip: bool| {
        let mut svc = spec.service();
        svc["spec"].as_object_mut().unwrap().remove("selector");
        if cluster_ip {
            svc["spec"] = serde_json::json!({"type": "ClusterIP", "ports": svc["spec"]["ports"].clone()});
        }
        c.api.create(svc).expect("create the Service");
        let triggered = k8s_openapi::jiff::Timestamp::now();
        for mut s in spec.slices() {
            s["metadata"]["annotations"] = serde_json::json!({"endpoints.kubernetes.io/last-change-trigger-time": triggered.to_string()});
            c.api.create(s).expect("create its slice");
        }
        triggered
    };
    let triggered = create(&web("web", &[(0, 0)]), false);
    let np = c.wait_allocated("web", 1, CHANGE)["80/TCP"];
    for i in 0..3 {
        c.wait_served(i, np, CHANGE);
    }
    let served = k8s_openapi::jiff::Timestamp::now().duration_since(triggered).as_secs_f64();
    for i in 0..3 {
        let ok = wait_until(CHANGE, || c.metric_sum(i, &format!("{METRIC}_count")) >= 1.0);
        assert!(ok, "node-{}: no {METRIC} sample", i + 1);
        let (count, sum) =
            (c.metric_sum(i, &format!("{METRIC}_count")), c.metric_sum(i, &format!("{METRIC}_sum")));
        assert_eq!(count, 1.0, "node-{}: one slice change, one sample", i + 1);
        assert!(
            sum > 0.0 && sum <= served,
            "node-{}: {sum} s, but it was served {served} s after the change",
            i + 1
        );
    }
    create(&ServiceSpec::new("internal").port(PortSpec::tcp(80, None)), true);
    std::thread::sleep(Duration::from_secs(2));
    assert_eq!(c.metric_sum(0, &format!("{METRIC}_count")), 1.0, "a ClusterIP Service's slice counted");
}
