//! The authenticated metrics listener in Kubernetes mode (issue 14, point 4): an agent started
//! with `--metrics-addr` serves `/metrics` over TLS to another host only for a bearer token the
//! API server authenticates (TokenReview) and allows `get` on `/metrics` (SubjectAccessReview).
//! Against the in-process test API server, whose reviews answer from the tokens and grants this
//! test registers: the agent's side (what it asks, what it does with the answers, caching, TLS,
//! its RBAC) is what is proven here; the real authenticator and RBAC authorizer are the real
//! API server's (docs/reliability.md says what remains to prove there).

mod common;

use std::collections::BTreeSet;

use common::cluster::{Cluster, Permission, node_v4};

const METRICS_PORT: u16 = 9472;
const PROMETHEUS: &str = "system:serviceaccount:monitoring:prometheus";

/// `curl` from the client namespace (another host): (HTTP status, body); status 0 when no HTTP
/// answer came at all.
fn curl(c: &Cluster, url: &str, token: Option<&str>) -> (u16, String) {
    let header = token.map(|t| format!("Authorization: Bearer {t}"));
    let mut args = vec!["-sk", "-m", "5", "-w", "\n%{http_code}", url];
    if let Some(h) = &header {
        args.extend(["-H", h.as_str()]);
    }
    let out = c.client.exec("curl", &args);
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    let (body, code) = text.rsplit_once('\n').unwrap_or(("", &text));
    (code.trim().parse().unwrap_or(0), body.to_string())
}

#[test]
fn metrics_over_the_network_need_an_authorized_bearer_token() {
    require_root!();
    let c = Cluster::with_nodes(1, 0, &["--metrics-addr", &format!("0.0.0.0:{METRICS_PORT}")]);
    c.api.add_token(
        "t-prometheus",
        PROMETHEUS,
        &["system:serviceaccounts", "system:serviceaccounts:monitoring"],
    );
    c.api.add_token("t-other", "system:serviceaccount:default:other", &["system:serviceaccounts"]);
    c.api.grant_non_resource(PROMETHEUS, "get", "/metrics");
    let https = format!("https://{}:{METRICS_PORT}/metrics", node_v4(0));

    let (code, body) = curl(&c, &https, None);
    assert_eq!(code, 401, "no token: {body}");
    let (code, body) = curl(&c, &https, Some("forged"));
    assert_eq!(code, 401, "a token the API server does not know: {body}");
    assert!(!body.contains("forged") && !body.contains("nodelb_"), "{body}");
    let (code, body) = curl(&c, &https, Some("t-other"));
    assert_eq!(
        (code, body.as_str()),
        (403, "Forbidden: user \"system:serviceaccount:default:other\" may not get /metrics\n")
    );
    let (code, body) = curl(&c, &https, Some("t-prometheus"));
    assert_eq!(code, 200, "{body}");
    assert!(
        body.contains("nodelb_build_info") && body.contains("nodelb_leader"),
        "{}",
        &body[..body.len().min(300)]
    );
    // TLS only: the token never crosses the network in clear text.
    let (code, _) = curl(&c, &format!("http://{}:{METRICS_PORT}/metrics", node_v4(0)), Some("t-prometheus"));
    assert_ne!(code, 200, "plain HTTP on the metrics port");
    // The other listeners, from the same host: the full ones are the node's own.
    let (code, _) = curl(&c, &format!("http://{}:9470/status", node_v4(0)), None);
    assert_eq!(code, 0, "the local listener is not reachable from another host");
    let (code, body) = curl(&c, &format!("http://{}:9471/readyz", node_v4(0)), None);
    assert_eq!((code, body.as_str()), (200, "ready\n"));

    // Answers are cached: with the API server gone, the token allowed a moment ago still scrapes
    // (2 minutes), a token never reviewed cannot be checked (503, not a guess).
    let reviews = |c: &Cluster| c.api.requests().iter().filter(|r| r.path.ends_with("reviews")).count();
    let before = reviews(&c);
    c.api.set_unreachable(true);
    let (code, _) = curl(&c, &https, Some("t-prometheus"));
    assert_eq!(code, 200, "cached answer");
    let (code, body) = curl(&c, &https, Some("t-new"));
    assert_eq!(code, 503, "{body}");
    c.api.set_unreachable(false);
    let (code, _) = curl(&c, &https, Some("t-prometheus"));
    assert_eq!((code, reviews(&c)), (200, before), "no review while the answer is cached");

    // The agent's RBAC grants the reviews it made, and they were made.
    c.assert_rbac_allows_every_request();
    let used: BTreeSet<Permission> = c.agent_permissions().into_iter().map(|(_, p)| p).collect();
    for (group, resource) in
        [("authentication.k8s.io", "tokenreviews"), ("authorization.k8s.io", "subjectaccessreviews")]
    {
        assert!(
            used.contains(&(group.into(), resource.into(), "create".into())),
            "{resource} create not used: {used:?}"
        );
    }
}
