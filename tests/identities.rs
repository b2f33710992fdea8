//! Two identities against the real API server: a node agent's own token (bound to its pod and
//! node, as the kubelet gives it) is refused every write beyond its node's Lease and Events
//! about its Node, by the real authorizer (daemonset/10-rbac.yaml) or the shipped admission
//! policy (daemonset/15-admission-policy.yaml); the controller's token writes what it needs.
//! The node agent is replaced by a script (kubectl with its token), as root on a compromised
//! node would: every attempt is refused, and every other node keeps serving.
mod common;

use std::path::Path;
use std::process::Output;
use std::time::Duration;

use common::cluster::{AGENT_NS, Cluster, node_name, web};
use common::topology::{parse_answer, wait_until};
use serde_json::json;

const CHANGE: Duration = Duration::from_secs(15);
const T: Duration = Duration::from_secs(2);

/// The attempt was refused, by RBAC ("forbidden") or by the admission policy ("denied request").
fn refused(what: &str, out: &Output) -> String {
    let err = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(!out.status.success(), "{what}: allowed\n{}", String::from_utf8_lossy(&out.stdout));
    assert!(
        err.contains("forbidden") || err.contains("Forbidden") || err.contains("denied request"),
        "{what}: refused for another reason: {err}"
    );
    err
}

fn allowed(what: &str, out: &Output) {
    assert!(out.status.success(), "{what}: refused: {}", String::from_utf8_lossy(&out.stderr));
}

/// An events.k8s.io Event in `ns` about `kind`/`name`, reported by node-1 as its agent reports.
fn event(ns: &str, kind: &str, name: &str) -> String {
    let mut regarding = json!({"apiVersion": "v1", "kind": kind, "name": name});
    if kind != "Node" {
        regarding["namespace"] = json!(ns);
    }
    json!({"apiVersion": "events.k8s.io/v1", "kind": "Event",
        "metadata": {"generateName": "probe-", "namespace": ns},
        "eventTime": "2026-01-01T00:00:00.000000Z", "action": "Reconcile", "reason": "ForwardingDisabled",
        "type": "Warning", "note": "probe", "reportingController": "nodelb.io/nodelb",
        "reportingInstance": "node-1", "regarding": regarding})
    .to_string()
}

/// `kubectl replace` of Lease `name` (as read now, changed by `change`) with the token of `kc`:
/// an update, the verb the node agents hold for Leases.
fn replace_lease(c: &Cluster, kc: &Path, name: &str, change: impl FnOnce(&mut serde_json::Value)) -> Output {
    let mut lease = c.api.get("coordination.k8s.io/v1", "Lease", AGENT_NS, name).expect("Lease");
    change(&mut lease);
    // Unconditional: the agents renew their Leases every second.
    lease["metadata"].as_object_mut().unwrap().remove("resourceVersion");
    c.api.kubectl_as_stdin(kc, &["replace", "-f", "-"], &lease.to_string())
}

/// Everything a stolen node-1 token might try, each refused; `kc` is that token's kubeconfig.
fn attempts(c: &Cluster, kc: &Path) {
    let k = |args: &[&str]| c.api.kubectl_as(kc, args);
    let patch = |res: &str, name: &str, ns: &str, body: &str| {
        k(&["patch", res, name, "-n", ns, "--type=merge", "-p", body])
    };
    // The Service: its spec, the allocation annotation, its status.
    refused(
        "patch spec.externalIPs",
        &patch("service", "web", "default", r#"{"spec":{"externalIPs":["203.0.113.99"]}}"#),
    );
    refused(
        "rewrite the allocation",
        &patch(
            "service",
            "web",
            "default",
            r#"{"metadata":{"annotations":{"nodelb.io/allocated-ports":"80/TCP=20999"}}}"#,
        ),
    );
    refused(
        "replace status.loadBalancer.ingress",
        &k(&[
            "patch",
            "service",
            "web",
            "-n",
            "default",
            "--subresource=status",
            "--type=merge",
            "-p",
            r#"{"status":{"loadBalancer":{"ingress":[{"ip":"203.0.113.99"}]}}}"#,
        ]),
    );
    refused("create a Service", &k(&["create", "service", "clusterip", "evil", "--tcp=80", "-n", "default"]));
    // Another node's Lease, the leader's, a registry Lease, its own turned into a registry block,
    // its own deleted.
    let by_policy = |what: &str, out: &Output| {
        let err = refused(what, out);
        assert!(err.contains("ValidatingAdmissionPolicy"), "{what}: refused by the admission policy: {err}");
    };
    by_policy(
        "update node-2's Lease",
        &replace_lease(c, kc, "nodelb-node-node-2", |l| {
            l["metadata"]["annotations"]["nodelb.io/pool-addresses"] = json!("p=203.0.113.99");
        }),
    );
    by_policy(
        "take the leader Lease",
        &replace_lease(c, kc, "nodelb-leader", |l| l["spec"]["holderIdentity"] = json!("node-1")),
    );
    by_policy(
        "label its own Lease as a registry block",
        &replace_lease(c, kc, "nodelb-node-node-1", |l| {
            l["metadata"]["labels"]["nodelb.io/node-port-claims"] = json!("0");
        }),
    );
    by_policy(
        "hold its own Lease as another node",
        &replace_lease(c, kc, "nodelb-node-node-1", |l| l["spec"]["holderIdentity"] = json!("node-2")),
    );
    let block = json!({"apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
        "metadata": {"name": "nodelb-ports-99", "namespace": AGENT_NS, "labels": {"nodelb.io/node-port-claims": "99"}},
        "spec": {"holderIdentity": "node-1"}});
    by_policy(
        "create a registry Lease",
        &c.api.kubectl_as_stdin(kc, &["create", "-f", "-"], &block.to_string()),
    );
    refused(
        "patch its own Lease (no patch verb)",
        &patch("lease", "nodelb-node-node-1", AGENT_NS, r#"{"metadata":{"labels":{"x":"y"}}}"#),
    );
    refused("delete its own Lease", &k(&["delete", "lease", "nodelb-node-node-1", "-n", AGENT_NS]));
    // Events: in a user namespace (RBAC), about a Service or another Node in `default` (policy).
    let create =
        |what: &str, body: String| refused(what, &c.api.kubectl_as_stdin(kc, &["create", "-f", "-"], &body));
    create("an Event in a user namespace", event("team-a", "Service", "web"));
    create("an Event about a Service", event("default", "Service", "web"));
    create("an Event about node-2", event("default", "Node", "node-2"));
    // Reading Secrets, or anything it does not need.
    refused("list Secrets", &k(&["get", "secrets", "-A"]));
    refused("list Pods", &k(&["get", "pods", "-A"]));
}

#[test]
fn a_node_agents_token_writes_its_own_node_only() {
    require_root!();
    let mut c = Cluster::new(2);
    c.api.kubectl_ok(&["create", "namespace", "team-a"]);
    c.create(&web("web", &[(0, 0), (1, 1)]));
    let np = c.wait_allocated("web", 1, CHANGE)["80/TCP"];
    for i in 0..3 {
        c.wait_served(i, np, CHANGE);
    }
    c.wait_ingress_nodes("web", &[0, 1, 2], CHANGE);

    // What node-1's agent may do, with the token it runs with: its own Lease, an Event about its
    // own Node.
    let node1 = c.kubeconfig(0);
    allowed(
        "update its own Lease",
        &replace_lease(&c, &node1, "nodelb-node-node-1", |l| {
            l["metadata"]["annotations"]["probe"] = json!("1")
        }),
    );
    allowed(
        "an Event about its own Node",
        &c.api.kubectl_as_stdin(&node1, &["create", "-f", "-"], &event("default", "Node", "node-1")),
    );
    // A token of the same ServiceAccount that no pod holds names no node: it writes nothing.
    let unbound = c.api.data_dir().join("unbound.kubeconfig");
    c.api.write_sa_kubeconfig(AGENT_NS, "nodelb", &unbound);
    let err = refused(
        "a token bound to no pod writes the node Lease",
        &replace_lease(&c, &unbound, "nodelb-node-node-1", |l| {
            l["metadata"]["annotations"]["probe"] = json!("2")
        }),
    );
    assert!(err.contains("authentication.kubernetes.io/node-name"), "{err}");

    let ctl = c.api.data_dir().join("controller.kubeconfig");
    c.api.write_pod_kubeconfig(AGENT_NS, "nodelb-controller", "nodelb-controller-1", None, &ctl);
    // The controller's token does what it needs (the allocation and status above are its
    // writes: `Cluster::service_writers` refuses any other writer).
    for (verb, resource, sub) in [("patch", "services", ""), ("patch", "services", "status")] {
        let mut args = vec!["auth", "can-i", verb, resource, "-n", "team-a"];
        if !sub.is_empty() {
            args.push("--subresource=status");
        }
        let out = c.api.kubectl_as(&ctl, &args);
        assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "yes", "controller: {args:?}");
    }
    assert!(!c.service_writers().is_empty(), "the controller wrote no Service");
    refused("the controller reads Secrets", &c.api.kubectl_as(&ctl, &["get", "secrets", "-A"]));

    // Compromised: node-1's agent is replaced by a script holding its token.
    c.agents[0].kill9();
    let before = c.service_json("web").unwrap();
    attempts(&c, &node1);
    let after = c.service_json("web").unwrap();
    assert_eq!(before["spec"], after["spec"], "the Service spec changed");
    assert_eq!(c.allocated("web").unwrap()["80/TCP"], np, "the allocation changed");
    for i in 1..3 {
        let body = c.get(i, np, T).unwrap_or_else(|e| panic!("{}: {e:?}", node_name(i)));
        assert!(parse_answer(&body).is_some(), "{}: {body}", node_name(i));
    }
    let lease2 = c.api.get("coordination.k8s.io/v1", "Lease", AGENT_NS, "nodelb-node-node-2").unwrap();
    assert!(
        !lease2["metadata"]["annotations"]["nodelb.io/pool-addresses"]
            .as_str()
            .unwrap_or_default()
            .contains("203.0.113.99"),
        "{lease2}"
    );
    // node-1 leaves the status once its Lease expires; the others keep serving.
    c.wait_ingress_nodes("web", &[1, 2], CHANGE);
    let ok = wait_until(CHANGE, || c.get(1, np, T).is_ok() && c.get(2, np, T).is_ok());
    assert!(ok, "the other nodes stopped serving");
    c.start_agent(0, CHANGE);
    c.wait_ingress_nodes("web", &[0, 1, 2], CHANGE);
}
