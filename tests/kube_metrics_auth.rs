//! The authenticated metrics listener in Kubernetes mode: an agent started
//! with `--metrics-addr` serves `/metrics` over TLS to another host only for a bearer token the
//! real API server authenticates (TokenReview) and allows `get` on `/metrics` (SubjectAccessReview,
//! answered by the RBAC authorizer from the installed ClusterRole `nodelb-metrics-reader`).

mod common;

use std::collections::BTreeSet;

use common::cluster::{Cluster, Permission, node_v4};
use common::kube::Fault;

const METRICS_PORT: u16 = 9472;

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

/// ServiceAccount `monitoring/prometheus`, bound to the ClusterRole the manifests define for
/// scrapers (`nodelb-metrics-reader`).
fn scraper(c: &Cluster) {
    c.api.kubectl_ok(&["create", "namespace", "monitoring"]);
    c.api.kubectl_ok(&["create", "serviceaccount", "prometheus", "-n", "monitoring"]);
    c.api.kubectl_ok(&[
        "create",
        "clusterrolebinding",
        "prometheus-nodelb-metrics",
        "--clusterrole=nodelb-metrics-reader",
        "--serviceaccount=monitoring:prometheus",
    ]);
}

/// A token of ServiceAccount `ns/sa` issued by the API server (TokenRequest).
fn token(c: &Cluster, ns: &str, sa: &str) -> String {
    c.api.kubectl_ok(&["create", "token", sa, "-n", ns, "--duration=1h"]).trim().to_string()
}

#[test]
fn metrics_over_the_network_need_an_authorized_bearer_token() {
    require_root!();
    let c = Cluster::with_nodes(1, 0, &["--metrics-addr", &format!("0.0.0.0:{METRICS_PORT}")]);
    // A scraper bound to the ClusterRole the manifests define, and a ServiceAccount bound to
    // nothing: the API server's RBAC authorizer answers the agent's SubjectAccessReviews.
    scraper(&c);
    c.api.kubectl_ok(&["create", "serviceaccount", "other", "-n", "default"]);
    let prometheus = token(&c, "monitoring", "prometheus");
    let prometheus_second = token(&c, "monitoring", "prometheus");
    let other = token(&c, "default", "other");
    let https = format!("https://{}:{METRICS_PORT}/metrics", node_v4(0));

    let (code, body) = curl(&c, &https, None);
    assert_eq!(code, 401, "no token: {body}");
    // A token signed by someone else: the same shape, the API server's signature missing.
    let forged = format!("{}.forged", prometheus.rsplit_once('.').map_or("x.y", |(head, _)| head));
    let (code, body) = curl(&c, &https, Some(&forged));
    assert_eq!(code, 401, "a token the API server does not accept: {body}");
    assert!(!body.contains("forged") && !body.contains("nodelb_"), "{body}");
    let (code, body) = curl(&c, &https, Some(&other));
    assert_eq!(
        (code, body.as_str()),
        (403, "Forbidden: user \"system:serviceaccount:default:other\" may not get /metrics\n")
    );
    let (code, body) = curl(&c, &https, Some(&prometheus));
    assert_eq!(code, 200, "{body}");
    assert!(
        body.contains("nodelb_build_info") && body.contains("nodelb_sync_duration_seconds"),
        "{}",
        &body[..body.len().min(300)]
    );
    // The controller's replicas serve theirs the same way (who leads is theirs to say).
    let controller = format!("https://{}:{METRICS_PORT}/metrics", common::cluster::controller_v4(0));
    let (code, body) = curl(&c, &controller, Some(&other));
    assert_eq!(code, 403, "{body}");
    let (code, body) = curl(&c, &controller, Some(&prometheus));
    assert_eq!(code, 200, "{body}");
    assert!(body.contains("nodelb_leader "), "{}", &body[..body.len().min(300)]);
    // TLS only: the token never crosses the network in clear text.
    let (code, _) = curl(&c, &format!("http://{}:{METRICS_PORT}/metrics", node_v4(0)), Some(&prometheus));
    assert_ne!(code, 200, "plain HTTP on the metrics port");
    // The other listeners, from the same host: the full ones are the node's own.
    let (code, _) = curl(&c, &format!("http://{}:9470/status", node_v4(0)), None);
    assert_eq!(code, 0, "the local listener is not reachable from another host");
    let (code, body) = curl(&c, &format!("http://{}:9471/readyz", node_v4(0)), None);
    assert_eq!((code, body.as_str()), (200, "ready\n"));

    // Answers are cached: with the API server cut off, the token allowed a moment ago still
    // scrapes (2 minutes), a token never reviewed cannot be checked (503, not a guess).
    let reviews = |c: &Cluster| c.api.agent_requests().iter().filter(|r| r.path.ends_with("reviews")).count();
    let before = reviews(&c);
    c.api.cut(Fault::Reset);
    let (code, _) = curl(&c, &https, Some(&prometheus));
    assert_eq!(code, 200, "cached answer");
    let (code, body) = curl(&c, &https, Some(&prometheus_second));
    assert_eq!(code, 503, "{body}");
    c.api.reopen();
    let (code, _) = curl(&c, &https, Some(&prometheus));
    assert_eq!((code, reviews(&c)), (200, before), "no review while the answer is cached");
    let (code, _) = curl(&c, &https, Some(&prometheus_second));
    assert_eq!(code, 200, "reviewed once the API server answers again");

    // Both identities' RBAC grants the reviews they made, and they were made.
    c.assert_rbac_allows_every_request();
    for sa in ["nodelb", "nodelb-controller"] {
        let used: BTreeSet<Permission> = c.permissions_used(sa).into_iter().map(|(_, p, _)| p).collect();
        for (group, resource) in
            [("authentication.k8s.io", "tokenreviews"), ("authorization.k8s.io", "subjectaccessreviews")]
        {
            assert!(
                used.contains(&(group.into(), resource.into(), "create".into())),
                "{sa}: {resource} create not used: {used:?}"
            );
        }
    }
}

/// A flood of made-up bearer tokens cannot turn the agent into a load on the API server: 10,000
/// requests, each with a token never seen before, cause at most the review budget's burst plus
/// its rate over the flood's time in TokenReviews (the rest answer 503 without asking), and a
/// real scraper gets its metrics again once the flood is over.
#[test]
fn random_tokens_cause_a_bounded_number_of_reviews() {
    require_root!();
    let c = Cluster::with_nodes(1, 0, &["--metrics-addr", &format!("0.0.0.0:{METRICS_PORT}")]);
    scraper(&c);
    let https = format!("https://{}:{METRICS_PORT}/metrics", node_v4(0));
    let reviews =
        |c: &Cluster| c.api.agent_requests().iter().filter(|r| r.path.ends_with("tokenreviews")).count();
    let before = reviews(&c);
    // One curl, 10,000 requests, 50 at a time, each with its own token (`next` starts the
    // options of the next URL).
    let dir = common::cleanup::temp_dir("nodelb-tokens-");
    let config = dir.path().join("curl.conf");
    let mut text = String::new();
    for i in 0..10_000u32 {
        let token = format!("flood.{:08x}{:08x}.x", i.wrapping_mul(2_654_435_761), i);
        text += &format!(
            "url = \"{https}\"\nheader = \"Authorization: Bearer {token}\"\ninsecure\nsilent\noutput = /dev/null\nwrite-out = \"%{{http_code}}\\n\"\nmax-time = 5\nnext\n"
        );
    }
    std::fs::write(&config, text).unwrap();
    let started = std::time::Instant::now();
    let out = c.client.exec("curl", &["--parallel", "--parallel-max", "50", "-K", config.to_str().unwrap()]);
    let took = started.elapsed();
    let codes: Vec<String> = String::from_utf8_lossy(&out.stdout).lines().map(str::to_string).collect();
    let count = |code: &str| codes.iter().filter(|c| *c == code).count();
    let made = reviews(&c) - before;
    // The agent's budget (serve::access): a burst of 20, then 5 a second.
    let bound = 20 + (5.0 * took.as_secs_f64()).ceil() as usize + 5;
    eprintln!(
        "{} requests in {took:?}: {} answered 401, {} 503, {} closed at once; {made} TokenReviews (bound {bound})",
        codes.len(),
        count("401"),
        count("503"),
        count("000")
    );
    assert_eq!(codes.len(), 10_000, "every request answered: {}", String::from_utf8_lossy(&out.stderr));
    assert!(made <= bound, "{made} TokenReviews for 10,000 made-up tokens in {took:?}");
    // 000: closed at once, the listener's connections from other hosts being at their bound.
    assert!(count("401") > 0 && count("401") + count("503") + count("000") == 10_000, "refused, every one");
    // The flood over, a real scraper gets in.
    std::thread::sleep(std::time::Duration::from_secs(1));
    let (code, _) = curl(&c, &https, Some(&token(&c, "monitoring", "prometheus")));
    assert_eq!(code, 200);
}

/// `--metrics-token-audiences nodelb-metrics`: a token requested for that audience scrapes; a
/// token of the API server's own audience (one an attacker could harvest and use as an API
/// token) does not, even the authorized scraper's.
#[test]
fn audience_bound_tokens_only() {
    require_root!();
    let c = Cluster::with_nodes(
        1,
        0,
        &[
            "--metrics-addr",
            &format!("0.0.0.0:{METRICS_PORT}"),
            "--metrics-token-audiences",
            "nodelb-metrics",
        ],
    );
    scraper(&c);
    let https = format!("https://{}:{METRICS_PORT}/metrics", node_v4(0));
    let api_token = token(&c, "monitoring", "prometheus");
    let (code, body) = curl(&c, &https, Some(&api_token));
    assert_eq!(code, 401, "an API server token: {body}");
    let bound = c
        .api
        .kubectl_ok(&[
            "create",
            "token",
            "prometheus",
            "-n",
            "monitoring",
            "--audience",
            "nodelb-metrics",
            "--duration=1h",
        ])
        .trim()
        .to_string();
    let (code, body) = curl(&c, &https, Some(&bound));
    assert_eq!(code, 200, "{}", &body[..body.len().min(200)]);
}
