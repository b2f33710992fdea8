//! Tenants against each other, end to end: users of the cluster bound only to the built-in `edit`
//! ClusterRole in their own namespace (a RoleBinding; client certificates the real authenticator
//! knows, the real authorizer judges) try to reach another Service's traffic, against a real
//! kube-apiserver + etcd with three agents and real packets (docs/security.md maps each threat to
//! its test here).
mod common;

use std::collections::BTreeMap;
use std::net::IpAddr;
use std::path::Path;
use std::time::{Duration, Instant};

use common::cluster::{Cluster, node_v4};
use common::manifest::{EndpointSpec, PortSpec, ServiceSpec};
use common::topology::{ClientError, ClientLoop, backend_v4, parse_answer, wait_until};
use serde_json::{Value, json};

/// A Service change to allocation / rules on every node.
const CHANGE: Duration = Duration::from_secs(15);
const ALLOCATED: &str = "nodelb.io/allocated-ports";

/// `kubectl apply -f` of `obj` as the user of `kubeconfig`; the output whatever the status.
fn apply_as(c: &Cluster, kubeconfig: &Path, obj: &Value) -> std::process::Output {
    let dir = common::cleanup::temp_dir("nodelb-tenant-");
    let file = dir.path().join("object.json");
    std::fs::write(&file, obj.to_string()).unwrap();
    c.api.kubectl_as(kubeconfig, &["apply", "-f", file.to_str().unwrap()])
}

fn ok(out: std::process::Output, what: &str) -> String {
    assert!(out.status.success(), "{what}: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// `kubectl annotate --overwrite` of `namespace/name`'s allocation annotation as the user.
fn forge(c: &Cluster, kubeconfig: &Path, namespace: &str, name: &str, value: &str) -> std::process::Output {
    let annotation = format!("{ALLOCATED}={value}");
    c.api.kubectl_as(kubeconfig, &["annotate", "--overwrite", "-n", namespace, "service", name, &annotation])
}

/// The Service as its tenant creates it (no selector: the slices are the test's, written by the
/// administrator as the EndpointSlice controller would: `edit` cannot write EndpointSlices).
fn create_as(c: &Cluster, kubeconfig: &Path, spec: &ServiceSpec, annotations: &[(&str, &str)]) {
    let mut svc = spec.service();
    svc["spec"].as_object_mut().unwrap().remove("selector");
    for (k, v) in annotations {
        svc["metadata"]["annotations"][*k] = json!(v);
    }
    ok(apply_as(c, kubeconfig, &svc), &format!("create {}", spec.key()));
    for s in spec.slices() {
        c.api.create(s).unwrap_or_else(|e| panic!("create slice of {}: {e:?}", spec.key()));
    }
}

fn wait_allocated_in(c: &Cluster, namespace: &str, name: &str) -> u16 {
    let mut got = None;
    let ok = wait_until(CHANGE, || {
        got = c.allocated_in(namespace, name).and_then(|a| a.get("80/TCP").copied());
        got.is_some()
    });
    assert!(
        ok,
        "{namespace}/{name} not allocated: {:#}",
        c.service_json_in(namespace, name).unwrap_or_default()
    );
    got.unwrap()
}

/// Waits until `namespace/name`'s annotation gives 80/TCP a number other than `not`; returns it.
fn wait_repaired(c: &Cluster, namespace: &str, name: &str, not: u16) -> u16 {
    let mut got = None;
    let ok = wait_until(CHANGE, || {
        got = c.allocated_in(namespace, name).and_then(|a| a.get("80/TCP").copied()).filter(|n| *n != not);
        got.is_some()
    });
    assert!(
        ok,
        "{namespace}/{name}'s forged annotation not written again from the registry: {:#}",
        c.service_json_in(namespace, name).unwrap_or_default()
    );
    got.unwrap()
}

/// Every request answered, and by `backend` only.
fn assert_all_reached(results: &[Result<String, ClientError>], backend: &str, what: &str) {
    let mut seen: BTreeMap<String, usize> = BTreeMap::new();
    for r in results {
        let key = match r {
            Ok(body) => parse_answer(body).map_or_else(|| format!("bad answer {body:?}"), |(b, _)| b),
            Err(e) => format!("error {e:?}"),
        };
        *seen.entry(key).or_default() += 1;
    }
    assert!(results.len() > 20, "{what}: only {} requests", results.len());
    assert_eq!(
        seen.keys().map(String::as_str).collect::<Vec<_>>(),
        [backend],
        "{what}: every request must reach {backend}: {seen:?}"
    );
}

/// What the Services of `namespace` (their conditions, their Events) say, for a look at what a
/// tenant of that namespace learns.
fn recorded_in(c: &Cluster, namespace: &str) -> String {
    let mut text = String::new();
    for svc in c.api.list("v1", "Service", Some(namespace)) {
        text += &svc["status"].to_string();
    }
    for e in c.api.list("events.k8s.io/v1", "Event", Some(namespace)) {
        text += &e["note"].to_string();
    }
    text
}

/// The forged allocation annotation, in both age orders, with and without an explicit request,
/// across namespaces, at creation and during a leader change: requests to the victims' ports
/// always reach the victims' backends on every node (0 misrouted, 0 failed), their annotations
/// and claims stay, each forger's annotation is written again from the registry (its own number
/// back, or a new one), it gets a `NodePortNotOwned` Warning, and nothing recorded in the
/// forgers' namespace names the victims.
#[test]
fn a_tenant_cannot_take_another_services_port_with_an_annotation() {
    require_root!();
    let mut c = Cluster::new(3);
    let alice = c.tenant("alice", "team-a");
    let svc = |name: &str, ns: &str, backend: usize, request: Option<u16>| {
        ServiceSpec::new(name)
            .in_namespace(ns)
            .port(PortSpec::tcp(80, request))
            .endpoint(EndpointSpec::remote(backend_v4(backend), "node-1"))
    };
    // Older than the victims (the registry, not age, decides: the old rule gave the older the
    // number).
    create_as(&c, &alice, &svc("thief", "team-a", 2, None), &[]);
    let thief_own = wait_allocated_in(&c, "team-a", "thief");
    std::thread::sleep(Duration::from_millis(1100)); // creationTimestamp has 1 s resolution
    c.create(&svc("victim", "default", 0, Some(20080)));
    c.create(&svc("victim-auto", "default", 1, None));
    assert_eq!(wait_allocated_in(&c, "default", "victim"), 20080);
    let auto = wait_allocated_in(&c, "default", "victim-auto");
    std::thread::sleep(Duration::from_millis(1100));
    // Younger than the victims.
    create_as(&c, &alice, &svc("late-thief", "team-a", 2, None), &[]);
    let late_own = wait_allocated_in(&c, "team-a", "late-thief");
    for i in 0..3 {
        c.wait_served(i, 20080, CHANGE);
        c.wait_served(i, auto, CHANGE);
        c.wait_served(i, thief_own, CHANGE);
    }

    // The real authorizer: alice may annotate her own Services, never another namespace's.
    let denied = forge(&c, &alice, "default", "victim", &format!("80/TCP={thief_own}"));
    assert!(!denied.status.success(), "alice annotated default/victim");
    assert!(String::from_utf8_lossy(&denied.stderr).contains("forbidden"), "{denied:?}");

    let loops: Vec<(ClientLoop, u16, &str, usize)> = (0..3)
        .flat_map(|i| [(i, 20080, "be1"), (i, auto, "be2")])
        .map(|(i, port, backend)| {
            let l = ClientLoop::http(
                &c.client,
                IpAddr::V4(node_v4(i)),
                port,
                Duration::from_millis(50),
                Duration::from_secs(2),
            );
            (l, port, backend, i)
        })
        .collect();

    // The older Service takes the explicitly requested number; the younger one the allocated
    // one; a new Service is created with the number already on it.
    ok(forge(&c, &alice, "team-a", "thief", "80/TCP=20080"), "forge thief");
    ok(forge(&c, &alice, "team-a", "late-thief", &format!("80/TCP={auto}")), "forge late-thief");
    create_as(&c, &alice, &svc("born-thief", "team-a", 2, None), &[(ALLOCATED, "80/TCP=20080")]);
    assert_eq!(wait_repaired(&c, "team-a", "thief", 20080), thief_own, "thief gets its own number back");
    assert_eq!(wait_repaired(&c, "team-a", "late-thief", auto), late_own, "late-thief gets its own back");
    let born = wait_repaired(&c, "team-a", "born-thief", 20080);
    assert!(![20080, auto, thief_own, late_own].contains(&born), "born-thief's new number {born} is unique");
    // The Warnings, recorded once the repair is written (a leader stopped before it records them
    // does not pass them on: the repair is done, nothing is left to warn about).
    let warned = |c: &Cluster, name: &str| {
        wait_until(CHANGE, || !c.events_in("team-a", name, "NodePortNotOwned").is_empty())
    };
    for name in ["thief", "late-thief", "born-thief"] {
        assert!(warned(&c, name), "no NodePortNotOwned Event for team-a/{name}");
    }

    // Again while the leader changes: the controller replica leading is stopped as a pod is,
    // and the forgery comes before anyone leads again.
    let leader = c.wait_leader(CHANGE);
    c.stop_controller(leader, c.grace_period());
    ok(forge(&c, &alice, "team-a", "thief", "80/TCP=20080"), "forge thief during the leader change");
    ok(forge(&c, &alice, "team-a", "late-thief", &format!("80/TCP={auto}")), "forge late-thief again");
    let started = Instant::now();
    assert_eq!(wait_repaired(&c, "team-a", "thief", 20080), thief_own, "repaired by the next leader");
    assert_eq!(wait_repaired(&c, "team-a", "late-thief", auto), late_own);
    eprintln!("repaired {:?} after the forgery without a leader", started.elapsed());
    c.start_controller(leader, CHANGE);
    for i in 0..3 {
        c.wait_served(i, born, CHANGE);
    }
    std::thread::sleep(Duration::from_secs(2));

    for (l, port, backend, i) in loops {
        let results = l.stop();
        assert_all_reached(&results, backend, &format!("node-{}:{port}", i + 1));
    }
    assert_eq!(c.allocated("victim").unwrap()["80/TCP"], 20080, "the victim keeps its number");
    assert_eq!(c.allocated("victim-auto").unwrap()["80/TCP"], auto);
    for (name, port) in [("thief", thief_own), ("late-thief", late_own), ("born-thief", born)] {
        for i in 0..3 {
            c.wait_served(i, port, CHANGE);
            let body = c.get(i, port, Duration::from_secs(2)).expect("the forger's own port answers");
            assert_eq!(parse_answer(&body).unwrap().0, "be3", "node-{}: {name} on {port}", i + 1);
        }
        let events = c.events_in("team-a", name, "NodePortNotOwned");
        assert!(events.iter().all(|e| e["type"] == "Warning"), "{events:?}");
    }
    // What alice can read of her namespace names nothing of another.
    let text = recorded_in(&c, "team-a");
    for secret in ["victim", "default/"] {
        assert!(!text.contains(secret), "team-a learns {secret:?}: {text}");
    }
}

/// Node port pools are access control: naming a pool gets a Service nothing the pool's selectors
/// refuse it; a number outside every range (443) is available only through a pool that lists it
/// in `requestablePorts`, to the namespaces it selects (not through `--allowed-node-ports`,
/// which is everyone's); and `maxPortsPerNamespace` bounds what one namespace holds: a Service
/// past it is refused with a Warning, the pool's status names the namespace, and another
/// namespace is not affected.
#[test]
fn pools_decide_which_namespaces_get_which_ports_and_how_many() {
    require_root!();
    let c = Cluster::new(3);
    let alice = c.tenant("alice", "team-a");
    let bob = c.tenant("bob", "team-b");
    c.api.kubectl_ok(&["label", "namespace", "team-a", "team=a"]);
    let pool = |name: &str, spec: Value| json!({"apiVersion": "nodelb.io/v1alpha1", "kind": "NodePortPool", "metadata": {"name": name}, "spec": spec});
    for p in [
        pool(
            "team-a",
            json!({"ports": [{"start": 20300, "end": 20309}], "requestablePorts": [{"start": 443, "end": 443}],
                   "maxPortsPerNamespace": 2, "namespaceSelector": {"matchLabels": {"team": "a"}}}),
        ),
        pool("rest", json!({"ports": [{"start": 20400, "end": 20409}], "priority": 10})),
    ] {
        c.api.create(p).expect("create the pool");
    }
    let svc = |name: &str, ns: &str, backend: usize| {
        ServiceSpec::new(name)
            .in_namespace(ns)
            .port(PortSpec::tcp(80, None))
            .endpoint(EndpointSpec::remote(backend_v4(backend), "node-1"))
    };
    let allocated_condition = |ns: &str, name: &str, reason: &str| {
        let mut cond = None;
        let ok = wait_until(CHANGE, || {
            cond = c.condition_in(ns, name, "nodelb.io/Allocated");
            cond.as_ref().is_some_and(|c| c["reason"] == reason)
        });
        assert!(ok, "{ns}/{name}: Allocated not {reason}: {cond:?}");
        cond.unwrap()["message"].as_str().unwrap_or_default().to_string()
    };

    // bob names alice's pool, then asks for 443 in his own: both refused, named.
    create_as(&c, &bob, &svc("sneaky", "team-b", 1), &[("nodelb.io/pool", "team-a")]);
    let why = allocated_condition("team-b", "sneaky", "NoPool");
    assert!(why.contains("does not admit it"), "{why}");
    create_as(&c, &bob, &svc("https", "team-b", 1), &[("nodelb.io/ports", "80/TCP=443")]);
    let why = allocated_condition("team-b", "https", "PortNotAllowed");
    assert!(why.contains("443") && why.contains("pool rest"), "{why}");
    assert!(c.allocated_in("team-b", "sneaky").is_none() && c.allocated_in("team-b", "https").is_none());

    // alice's pool lets her ask for 443: served on every node.
    create_as(&c, &alice, &svc("https", "team-a", 0), &[("nodelb.io/ports", "80/TCP=443")]);
    assert_eq!(wait_allocated_in(&c, "team-a", "https"), 443);
    for i in 0..3 {
        c.wait_served(i, 443, CHANGE);
        let body = c.get(i, 443, Duration::from_secs(2)).expect("443 answers");
        assert_eq!(parse_answer(&body).unwrap().0, "be1", "node-{}", i + 1);
    }
    // Her namespace may hold two numbers of the pool: the third Service is refused.
    create_as(&c, &alice, &svc("second", "team-a", 0), &[]);
    let second = wait_allocated_in(&c, "team-a", "second");
    assert!((20300..=20309).contains(&second), "{second}");
    create_as(&c, &alice, &svc("third", "team-a", 0), &[]);
    let why = allocated_condition("team-a", "third", "QuotaExceeded");
    assert!(why.contains("maxPortsPerNamespace is 2"), "{why}");
    let ok = wait_until(CHANGE, || !c.events_in("team-a", "third", "NodePortQuotaExceeded").is_empty());
    assert!(ok, "no NodePortQuotaExceeded Event for team-a/third");
    let ok = wait_until(CHANGE, || {
        c.api
            .get("nodelb.io/v1alpha1", "NodePortPool", "", "team-a")
            .is_some_and(|p| p["status"]["namespacesAtLimit"] == json!(["team-a"]))
    });
    assert!(
        ok,
        "pool status: {:#}",
        c.api.get("nodelb.io/v1alpha1", "NodePortPool", "", "team-a").unwrap_or_default()
    );
    // bob's namespace is not bounded by alice's: his Services keep coming from his pool.
    create_as(&c, &bob, &svc("plain", "team-b", 1), &[]);
    assert!((20400..=20409).contains(&wait_allocated_in(&c, "team-b", "plain")));
}
