use super::*;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::MicroTime;
use serde_json::json;

fn now() -> k8s_openapi::jiff::Timestamp {
    "2026-11-29T10:00:00Z".parse().unwrap()
}

fn node(name: &str, ip: &str) -> Node {
    serde_json::from_value(json!({
        "metadata": {"name": name},
        "status": {"addresses": [{"type": "InternalIP", "address": ip}]}
    }))
    .unwrap()
}

fn lease(node: &str, renewed_secs_ago: i64, report: Option<&NodeReport>) -> Lease {
    let mut l: Lease = serde_json::from_value(json!({
        "metadata": {"name": format!("nodelb-node-{node}")},
        "spec": {"leaseDurationSeconds": 15}
    }))
    .unwrap();
    let renewed = now() - k8s_openapi::jiff::SignedDuration::from_secs(renewed_secs_ago);
    l.spec.as_mut().unwrap().renew_time = Some(MicroTime(renewed));
    if let Some(r) = report {
        l.metadata.annotations = Some([(ANNOTATION_REPORT.to_string(), r.to_annotation())].into());
    }
    l
}

fn service(ns: &str, name: &str, ports: &str, ingress: &[&str]) -> Service {
    let ingress: Vec<_> = ingress.iter().map(|ip| json!({"ip": ip, "ipMode": "Proxy"})).collect();
    serde_json::from_value(json!({
        "metadata": {"namespace": ns, "name": name, "annotations": {"nodelb.io/allocated-ports": ports}},
        "status": {"loadBalancer": {"ingress": ingress}}
    }))
    .unwrap()
}

fn report(ready: bool, refused: &[(&str, &str, &str)]) -> NodeReport {
    NodeReport {
        version: "0.1.0 (commit abc)".into(),
        ready,
        not_ready: (!ready).then(|| "last sync failed: netlink".to_string()),
        refused: refused
            .iter()
            .map(|(s, c, r)| Refused { service: s.to_string(), code: c.to_string(), reason: r.to_string() })
            .collect(),
        ..Default::default()
    }
    .bounded()
}

#[test]
fn each_node_that_does_not_serve_a_service_says_why() {
    let nodes = [
        node("node-1", "192.0.2.1"),
        node("node-2", "192.0.2.2"),
        node("node-3", "192.0.2.3"),
        node("node-4", "192.0.2.4"),
        node("node-5", "192.0.2.5"),
    ];
    let in_use = report(
        true,
        &[(
            "default/web",
            "node_port_refused",
            "80/TCP -> 20001: in use: a process listens on 0.0.0.0:20001/TCP on this node",
        )],
    );
    let leases = [
        lease("node-1", 1, Some(&report(true, &[]))),
        lease("node-2", 1, Some(&report(true, &[]))),
        lease("node-3", 2, Some(&in_use)),
        lease("node-4", 1, Some(&report(false, &[]))),
        lease("node-5", 60, Some(&report(true, &[]))),
    ];
    let services = [
        // node-3 is listed (it serves the Service's other ports) but refuses this one.
        service("default", "web", "80/TCP=20001", &["192.0.2.1", "192.0.2.2", "192.0.2.3"]),
        service("team-b", "api", "443/TCP=20002", &["192.0.2.1", "192.0.2.2", "192.0.2.3"]),
        // Not nodelb's: no annotation, no condition.
        serde_json::from_value(json!({"metadata": {"namespace": "default", "name": "other"}})).unwrap(),
    ];
    let view = assemble(&services, &nodes, &leases, now(), &Filter::default());
    let names: Vec<String> = view.services.iter().map(|s| format!("{}/{}", s.namespace, s.name)).collect();
    assert_eq!(names, ["default/web", "team-b/api"]);
    let web = &view.services[0];
    assert_eq!(web.served_on, ["node-1", "node-2"]);
    let why: Vec<(&str, &str)> = web.not_served.iter().map(|(n, w)| (n.as_str(), w.as_str())).collect();
    assert_eq!(
        why,
        [
            (
                "node-3",
                "80/TCP -> 20001: in use: a process listens on 0.0.0.0:20001/TCP on this node (node_port_refused)"
            ),
            ("node-4", "agent not ready: last sync failed: netlink"),
            ("node-5", "no agent: its node Lease is not renewed"),
        ]
    );
    assert_eq!(view.nodes.iter().filter(|n| n.agent).count(), 4);
    let text = render(&view, now().as_second() as u64);
    assert!(
        text.contains("default/web  ports 80/TCP=20001  served on 2 of 5 nodes: node-1, node-2"),
        "{text}"
    );
    assert!(text.contains("  node-3: 80/TCP -> 20001: in use"), "{text}");

    let only = Filter { namespace: Some("team-b".into()), node: Some("node-4".into()), ..Default::default() };
    let view = assemble(&services, &nodes, &leases, now(), &only);
    assert_eq!(view.services.len(), 1);
    assert!(view.services[0].served_on.is_empty());
    assert_eq!(view.services[0].not_served.keys().collect::<Vec<_>>(), ["node-4"]);
    assert_eq!(view.nodes.len(), 1);
}

#[test]
fn a_report_is_bounded_and_says_how_much_it_leaves_out() {
    let many: Vec<(String, String, String)> = (0..MAX_REFUSED + 7)
        .map(|i| (format!("ns/svc-{i:03}"), "not_selected".into(), "é".repeat(400)))
        .collect();
    let r = NodeReport {
        refused: many
            .iter()
            .map(|(s, c, r)| Refused { service: s.clone(), code: c.clone(), reason: r.clone() })
            .collect(),
        problems: (0..MAX_PROBLEMS + 3).map(|i| format!("problem {i}")).collect(),
        ..Default::default()
    }
    .bounded();
    assert_eq!((r.refused.len(), r.refused_total), (MAX_REFUSED, MAX_REFUSED + 7));
    assert!(r.refused.iter().all(|x| x.reason.len() <= MAX_TEXT && x.reason.ends_with("...")));
    assert_eq!(r.problems.len(), MAX_PROBLEMS);
    let back: NodeReport = serde_json::from_str(&r.to_annotation()).unwrap();
    assert_eq!(back, r);
}

fn status(state: &str, code: Option<&str>, ports: &[(&str, &str)]) -> ServiceStatus {
    let ports: Vec<_> = ports
        .iter()
        .enumerate()
        .map(|(i, (code, problem))| {
            let mut p = json!({"port": 80 + i, "protocol": "TCP", "nodePort": 20000 + i, "endpoints": 1});
            if !code.is_empty() {
                p["problem"] = json!(problem);
                p["problemCode"] = json!(code);
            }
            p
        })
        .collect();
    serde_json::from_value(json!({
        "namespace": "shop", "name": "web", "state": state,
        "reasonCode": code, "reason": code.map(|c| format!("why: {c}")), "ports": ports
    }))
    .unwrap()
}

#[test]
fn a_node_reports_only_the_refusals_that_are_its_own() {
    let ok = ("", "");
    let in_use = ("in_use", "in use: a process listens on 0.0.0.0:20000/TCP on this node");
    let pending = ("not_recorded", "not in the node-port registry yet");
    let conflict = ("port_conflict", "asks for node port 20001, which another Service holds");
    // (what, the node's status line, the refusal it reports: code and reason)
    type Case<'a> = (&'a str, ServiceStatus, Option<(&'a str, &'a str)>);
    let cases: &[Case<'_>] = &[
        ("served plainly", status("programmed", None, &[ok]), None),
        (
            "served, one port taken by a process here",
            status("programmed", Some("node_port_refused"), &[ok, in_use]),
            Some(("port_refused", in_use.1)),
        ),
        (
            "served, one port the leader refused",
            status("programmed", Some("port_conflict"), &[ok, conflict]),
            None,
        ),
        (
            "served, one port waiting for the registry",
            status("programmed", Some("node_port_refused"), &[ok, pending]),
            None,
        ),
        (
            "served, one port the leader refused and one taken here",
            status("programmed", Some("port_conflict"), &[conflict, in_use]),
            Some(("port_refused", in_use.1)),
        ),
        ("not allocated", status("refused", Some("port_conflict"), &[conflict]), None),
        ("no node port yet", status("refused", Some("no_allocation"), &[ok]), None),
        (
            "every port waiting for the registry",
            status("refused", Some("node_port_refused"), &[pending, pending]),
            None,
        ),
        (
            "a port taken here, one waiting",
            status("refused", Some("node_port_refused"), &[in_use, pending]),
            Some(("node_port_refused", in_use.1)),
        ),
        (
            "forwarding off",
            status("refused", Some("forwarding_off"), &[ok]),
            Some(("forwarding_off", "why: forwarding_off")),
        ),
        (
            "no endpoints",
            status("no-endpoints", Some("no_endpoints"), &[ok]),
            Some(("no_endpoints", "why: no_endpoints")),
        ),
    ];
    for (what, s, want) in cases {
        let got = refused_on_node(std::slice::from_ref(s));
        let want: Vec<Refused> = want
            .iter()
            .map(|(c, r)| Refused { service: "shop/web".into(), code: c.to_string(), reason: r.to_string() })
            .collect();
        assert_eq!(got, want, "{what}");
    }
}

#[test]
fn the_leaders_codes_are_those_the_allocation_and_the_registry_say() {
    use crate::decisions::alloc::AllocProblem;
    use crate::decisions::port_policy::PortRefusal;
    use crate::domain::{PortId, ServiceKey};
    let (service, port, holder) = (ServiceKey::new("a", "b"), PortId::tcp(80), ServiceKey::new("c", "d"));
    let s = || service.clone();
    let leaders = [
        AllocProblem::Conflict { service: s(), port, wanted: 1, holder },
        AllocProblem::Exhausted { service: s(), port, range: "r".into() },
        AllocProblem::NoPool { service: s(), port, why: "w".into() },
        AllocProblem::QuotaExceeded { service: s(), port, pool: "p".into(), max: 1, why: "w".into() },
        AllocProblem::NotAllowed { service: s(), port, wanted: 1, allowed: "a".into() },
        AllocProblem::InUse { service: s(), port, wanted: 1, by: "b".into() },
    ];
    for p in &leaders {
        // Every variant is listed above: a new one fails to compile here until it is.
        match p {
            AllocProblem::Conflict { .. }
            | AllocProblem::Exhausted { .. }
            | AllocProblem::NoPool { .. }
            | AllocProblem::QuotaExceeded { .. }
            | AllocProblem::NotAllowed { .. }
            | AllocProblem::InUse { .. } => {}
        }
        assert!(LEADERS_CODES.contains(&p.code()), "{p}: {}", p.code());
    }
    for another in [false, true] {
        assert!(LEADERS_CODES.contains(&PortRefusal::NotRecorded { another }.code()));
    }
    for own in [
        PortRefusal::InUse("x".into()),
        PortRefusal::NotAllowed("x".into()),
        PortRefusal::NotSelected("x".into()),
        PortRefusal::Shared,
    ] {
        assert!(!LEADERS_CODES.contains(&own.code()), "{own}");
    }
    assert!(LASTING.iter().all(|c| !LEADERS_CODES.contains(c)));
}
