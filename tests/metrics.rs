//! `/metrics` against the real kernel: per-Service counters come from the kernel's rule counters
//! and grow with real traffic, refusals and forwarding state show up, and the whole exposition
//! parses as Prometheus text with HELP and TYPE for every metric.

mod common;

use std::collections::BTreeSet;
use std::net::IpAddr;
use std::time::Duration;

use common::agent::Agent;
use common::manifest::{EndpointSpec, PortSpec, ServiceSpec};
use common::topology::{NODE_V4, Topology, backend_v4, http_get, wait_until};
use prometheus_parse::{LineInfo, Scrape, Value};

const READY: Duration = Duration::from_secs(15);
const CHANGE: Duration = Duration::from_secs(5);
const T: Duration = Duration::from_secs(2);
const SHORT: Duration = Duration::from_millis(700);

fn web(name: &str, np: u16, backends: usize) -> ServiceSpec {
    ServiceSpec::new(name)
        .port(PortSpec::tcp(80, Some(np)))
        .endpoints((0..backends).map(|j| EndpointSpec::local(backend_v4(j))))
}

fn node() -> IpAddr {
    IpAddr::V4(NODE_V4)
}

fn metrics_text(agent: &Agent) -> String {
    let r = agent.http("/metrics").expect("/metrics answers");
    assert_eq!(r.status, 200, "{}", r.body);
    r.body
}

fn scrape(agent: &Agent) -> Scrape {
    let text = metrics_text(agent);
    Scrape::parse(text.lines().map(|l| Ok(l.to_string()))).expect("valid Prometheus text")
}

/// Values of the samples `name` whose labels include all of `labels`.
fn samples<'a>(s: &'a Scrape, name: &'a str, labels: &'a [(&str, &str)]) -> impl Iterator<Item = f64> + 'a {
    s.samples
        .iter()
        .filter(move |x| x.metric == name && labels.iter().all(|(k, v)| x.labels.get(k) == Some(*v)))
        .map(|x| match x.value {
            Value::Counter(v) | Value::Gauge(v) | Value::Untyped(v) => v,
            _ => f64::NAN,
        })
}

/// Value of the sample `name` whose labels include all of `labels`; None when absent.
fn value(s: &Scrape, name: &str, labels: &[(&str, &str)]) -> Option<f64> {
    samples(s, name, labels).next()
}

/// Sum over all samples of `name` whose labels include all of `labels`.
fn sum(s: &Scrape, name: &str, labels: &[(&str, &str)]) -> f64 {
    samples(s, name, labels).sum()
}

/// `git rev-parse --short=12 HEAD` of this checkout; `None` without git or outside a checkout.
fn git_head() -> Option<String> {
    let out = std::process::Command::new("git")
        .args(["-C", env!("CARGO_MANIFEST_DIR"), "rev-parse", "--short=12", "HEAD"])
        .output()
        .ok()?;
    out.status.success().then(|| String::from_utf8_lossy(&out.stdout).trim().to_string())
}

fn svc_labels(name: &str) -> Vec<(&'static str, &str)> {
    vec![("namespace", "default"), ("service", name), ("port", "80"), ("protocol", "TCP")]
}

#[test]
fn traffic_counters_come_from_the_kernel_and_grow_with_requests() {
    require_root!();
    traffic_counters_grow_with_requests("1");
    // The connection counter in a nat shard table, the traffic counter in the main one.
    traffic_counters_grow_with_requests("4");
}

fn traffic_counters_grow_with_requests(nat_shards: &str) {
    let topo = Topology::new(1, 2);
    let c = topo.client(0);
    let files = [("web.yaml", web("web", 20080, 2).render())];
    let mut agent = Agent::start(&topo.node, &files, &["--nat-shards", nat_shards]);
    agent.wait_ready(READY);
    let before = scrape(&agent);
    let l = svc_labels("web");
    let conns0 = value(&before, "nodelb_service_connections_total", &l).expect("connections series");
    let pkts0 = value(&before, "nodelb_service_packets_total", &l).expect("packets series");
    let bytes0 = value(&before, "nodelb_service_bytes_total", &l).expect("bytes series");

    const N: usize = 25;
    for i in 0..N {
        http_get(c, node(), 20080, T).unwrap_or_else(|e| panic!("request {i}: {e:?}"));
    }
    let after = scrape(&agent);
    let conns = value(&after, "nodelb_service_connections_total", &l).unwrap() - conns0;
    let pkts = value(&after, "nodelb_service_packets_total", &l).unwrap() - pkts0;
    let bytes = value(&after, "nodelb_service_bytes_total", &l).unwrap() - bytes0;
    assert!(conns >= N as f64, "connections grew by {conns}, expected ≥ {N}");
    // Every TCP exchange is several packets each way.
    assert!(pkts >= (4 * N) as f64, "packets grew by {pkts}, expected ≥ {}", 4 * N);
    assert!(bytes >= pkts * 40.0, "bytes grew by {bytes} for {pkts} packets");

    // An endpoint change rewrites the service chain; the named counter it counts in is kept, and
    // the exported total must not go down.
    agent.write_manifest("web.yaml", &web("web", 20080, 1).render());
    assert!(
        wait_until(CHANGE, || agent.status().is_some_and(|s| s["services"][0]["ports"][0]["endpoints"] == 1)),
        "endpoint change not applied"
    );
    let later = scrape(&agent);
    let conns_later = value(&later, "nodelb_service_connections_total", &l).unwrap() - conns0;
    assert!(
        conns_later >= conns,
        "connections total went down across a chain flush: {conns} → {conns_later}"
    );
}

#[test]
fn refusals_forwarding_and_bad_input_are_visible() {
    require_root!();
    let topo = Topology::new(2, 1);
    let (inside, outside) = (topo.client(0), topo.client(1));
    let ranged = web("ranged", 20080, 1).source_range(&format!("{}/32", topo.clients[0].v4));
    let bad = web("bad", 20081, 1).source_range("198.51.100.0/33");
    let mut agent =
        Agent::start(&topo.node, &[("ranged.yaml", ranged.render()), ("bad.yaml", bad.render())], &[]);
    agent.wait_ready(READY);

    http_get(inside, node(), 20080, T).expect("inside the range");
    let l = svc_labels("ranged");
    let refused0 =
        value(&scrape(&agent), "nodelb_service_refused_packets_total", &l).expect("refused series");
    for _ in 0..3 {
        assert!(http_get(outside, node(), 20080, SHORT).is_err(), "outside the range must not be served");
    }
    let refused = value(&scrape(&agent), "nodelb_service_refused_packets_total", &l).unwrap() - refused0;
    assert!(refused >= 3.0, "refused counter grew by {refused}, expected ≥ 3");

    // The invalid CIDR: a refused Service with its reason, and the value named in /status.
    let s = scrape(&agent);
    assert_eq!(
        value(&s, "nodelb_services", &[("state", "refused"), ("reason", "invalid_source_range")]),
        Some(1.0)
    );
    assert_eq!(value(&s, "nodelb_services", &[("state", "programmed")]), Some(1.0));
    let st = agent.service_status("default/bad").expect("bad service in /status");
    assert!(st["reason"].as_str().unwrap_or("").contains("198.51.100.0/33"), "{st}");
    assert_eq!(
        value(&s, "nodelb_service_packets_total", &svc_labels("bad")),
        None,
        "no series for a refused Service"
    );

    // Forwarding off: gauge flips, the family is not served, readiness says why; then back.
    assert_eq!(value(&s, "nodelb_forwarding_enabled", &[("family", "ipv4")]), Some(1.0));
    topo.node.sysctl("net.ipv4.ip_forward", "0");
    assert!(
        wait_until(CHANGE, || {
            let s = scrape(&agent);
            value(&s, "nodelb_forwarding_enabled", &[("family", "ipv4")]) == Some(0.0)
                && value(&s, "nodelb_family_served", &[("family", "ipv4")]) == Some(0.0)
        }),
        "forwarding gauge did not flip:\n{}",
        metrics_text(&agent)
    );
    let (code, body) = agent.readyz().unwrap();
    assert_eq!(code, 503, "{body}");
    assert!(body.contains("net.ipv4.ip_forward"), "{body}");
    topo.node.sysctl("net.ipv4.ip_forward", "1");
    assert!(
        wait_until(CHANGE, || value(&scrape(&agent), "nodelb_family_served", &[("family", "ipv4")])
            == Some(1.0)),
        "family not served again"
    );
    assert!(wait_until(CHANGE, || matches!(agent.readyz(), Some((200, _)))));
}

#[test]
fn exposition_is_complete_and_service_series_go_with_the_service() {
    require_root!();
    let topo = Topology::new(1, 1);
    let files = [("a.yaml", web("a", 20080, 1).render()), ("b.yaml", web("b", 20081, 1).render())];
    let mut agent = Agent::start(&topo.node, &files, &[]);
    agent.wait_ready(READY);
    http_get(topo.client(0), node(), 20080, T).expect("a served");

    let text = metrics_text(&agent);
    // Every metric family has HELP and TYPE, and every sample belongs to a declared family.
    let mut helped = BTreeSet::new();
    let mut typed = BTreeSet::new();
    let mut sampled = BTreeSet::new();
    for line in text.lines() {
        let words: Vec<&str> = line.split_whitespace().collect();
        match words.as_slice() {
            ["#", "HELP", name, help @ ..] => {
                assert!(!help.is_empty(), "empty HELP for {name}");
                helped.insert(name.to_string());
            }
            ["#", "TYPE", name, _] => {
                typed.insert(name.to_string());
            }
            _ => {
                if let LineInfo::Sample { metric_name, .. } = LineInfo::parse(line) {
                    let base = ["_bucket", "_sum", "_count"]
                        .iter()
                        .find_map(|suf| metric_name.strip_suffix(suf).filter(|b| typed.contains(*b)))
                        .unwrap_or(metric_name);
                    sampled.insert(base.to_string());
                }
            }
        }
    }
    assert_eq!(helped, typed, "HELP and TYPE must come together");
    for name in &sampled {
        assert!(typed.contains(name), "sample {name} has no TYPE/HELP");
    }
    for required in [
        "nodelb_services",
        "nodelb_service_ports",
        "nodelb_endpoints",
        "nodelb_port_allocations",
        "nodelb_port_range_free",
        "nodelb_sync_duration_seconds",
        "nodelb_last_successful_sync_timestamp_seconds",
        "nodelb_syncs_total",
        "nodelb_sync_failures_total",
        "nodelb_table_repairs_total",
        "nodelb_watch_errors_total",
        "nodelb_watch_restarts_total",
        "nodelb_api_errors_total",
        "nodelb_netlink_batch_messages",
        "nodelb_netlink_batch_bytes",
        "nodelb_forwarding_enabled",
        "nodelb_family_served",
        "nodelb_build_info",
        "nodelb_service_connections_total",
        "nodelb_service_packets_total",
        "nodelb_service_bytes_total",
        "process_resident_memory_bytes",
        "process_cpu_seconds_total",
    ] {
        assert!(sampled.contains(required), "metric {required} missing from /metrics:\n{text}");
    }
    // Every batch is counted in both batch histograms; the first, a full replace of a table with
    // two Services, is kilobytes.
    let plain = |name: &str| {
        text.lines().find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.trim().parse::<f64>().ok())
    };
    let batches = plain("nodelb_netlink_batch_bytes_count").expect("batch bytes count");
    assert!(batches >= 1.0, "no batch in nodelb_netlink_batch_bytes:\n{text}");
    assert_eq!(Some(batches), plain("nodelb_netlink_batch_messages_count"), "{text}");
    assert!(plain("nodelb_netlink_batch_bytes_sum").is_some_and(|b| b > 1_000.0), "{text}");
    let s = scrape(&agent);
    let build = s.samples.iter().find(|x| x.metric == "nodelb_build_info").expect("build info");
    assert_eq!(build.labels.get("version"), Some(env!("CARGO_PKG_VERSION")));
    match (git_head(), std::env::var_os("NODELB_TEST_BIN")) {
        (Some(head), None) => assert_eq!(build.labels.get("git_commit"), Some(head.as_str())),
        // A binary built elsewhere, or no git: the commit cannot be checked here.
        (head, bin) => eprintln!("git_commit not compared (git HEAD {head:?}, NODELB_TEST_BIN {bin:?})"),
    }
    assert_eq!(value(&s, "nodelb_port_allocations", &[]), Some(2.0));
    assert_eq!(value(&s, "nodelb_port_range_free", &[]), Some(9_998.0), "20080 and 20081 are in 20000-29999");
    assert!(value(&s, "nodelb_service_packets_total", &svc_labels("b")).is_some());

    agent.remove_manifest("b.yaml");
    assert!(
        wait_until(CHANGE, || value(&scrape(&agent), "nodelb_service_packets_total", &svc_labels("b"))
            .is_none()),
        "series of the deleted Service b still exported"
    );
    let s = scrape(&agent);
    assert!(value(&s, "nodelb_service_packets_total", &svc_labels("a")).unwrap_or(0.0) > 0.0);
    assert_eq!(value(&s, "nodelb_port_allocations", &[]), Some(1.0));
    assert_eq!(value(&s, "nodelb_port_range_free", &[]), Some(9_999.0));

    // Turning per-Service series off removes them.
    agent.terminate(Duration::from_secs(5));
    let quiet = Agent::start(
        &topo.node,
        &[("a.yaml", web("a", 20080, 1).render())],
        &["--per-service-metrics=false"],
    );
    assert!(wait_until(READY, || quiet.readyz().is_some_and(|(c, _)| c == 200)));
    let text = metrics_text(&quiet);
    assert!(!text.contains("nodelb_service_packets_total"), "{text}");
    assert!(text.contains("nodelb_services"));
    // Without the counter index the agent still serves and follows changes (endpoint flush, a new
    // Service) and counts them as good syncs.
    http_get(topo.client(0), node(), 20080, T).expect("a served without per-Service metrics");
    let synced = sum(&scrape(&quiet), "nodelb_syncs_total", &[("result", "success")]);
    quiet.write_manifest("a.yaml", &web("a", 20080, 0).render());
    quiet.write_manifest("b.yaml", &web("b", 20081, 1).render());
    quiet.wait_state("default/a", "no-endpoints", CHANGE);
    quiet.wait_state("default/b", "programmed", CHANGE);
    http_get(topo.client(0), node(), 20081, T).expect("b served without per-Service metrics");
    let s = scrape(&quiet);
    assert!(sum(&s, "nodelb_syncs_total", &[("result", "success")]) > synced);
    assert_eq!(sum(&s, "nodelb_syncs_total", &[("result", "error")]), 0.0);
    assert_eq!(value(&s, "nodelb_services", &[("state", "no-endpoints")]), Some(1.0));
    assert_eq!(value(&s, "nodelb_service_connections_total", &svc_labels("a")), None);
}

#[test]
fn service_series_keep_their_totals_while_the_service_has_no_endpoints() {
    require_root!();
    let topo = Topology::new(1, 1);
    let c = topo.client(0);
    let mut agent = Agent::start(&topo.node, &[("web.yaml", web("web", 20080, 1).render())], &[]);
    agent.wait_ready(READY);
    const N: usize = 10;
    for i in 0..N {
        http_get(c, node(), 20080, T).unwrap_or_else(|e| panic!("request {i}: {e:?}"));
    }
    let l = svc_labels("web");
    let read = |s: &Scrape| {
        ["nodelb_service_connections_total", "nodelb_service_packets_total", "nodelb_service_bytes_total"]
            .map(|m| value(s, m, &l).unwrap_or_else(|| panic!("{m} of web missing")))
    };
    let served = read(&scrape(&agent));
    assert!(served[0] >= N as f64, "{served:?}");

    // No endpoints: the Service's chains are gone from the kernel, its series stay. New
    // connections are counted exactly; late packets of the finished ones may still add a few.
    agent.write_manifest("web.yaml", &web("web", 20080, 0).render());
    agent.wait_state("default/web", "no-endpoints", CHANGE);
    let idle = read(&scrape(&agent));
    assert_eq!(idle[0], served[0], "connections changed while no endpoints: {served:?} → {idle:?}");
    assert!(idle[1] >= served[1] && idle[2] >= served[2], "went down: {served:?} → {idle:?}");
    assert!(http_get(c, node(), 20080, SHORT).is_err(), "no endpoints: refused");
    std::thread::sleep(Duration::from_millis(1500));
    assert_eq!(read(&scrape(&agent)), idle, "series must stay constant while no chain feeds them");

    // Endpoints back: the series continue from there.
    agent.write_manifest("web.yaml", &web("web", 20080, 1).render());
    agent.wait_state("default/web", "programmed", CHANGE);
    let back = read(&scrape(&agent));
    assert!((0..3).all(|i| back[i] >= idle[i]), "went down: {idle:?} → {back:?}");
    for i in 0..N {
        http_get(c, node(), 20080, T).unwrap_or_else(|e| panic!("request {i} after: {e:?}"));
    }
    let after = read(&scrape(&agent));
    assert!(after[0] >= idle[0] + N as f64, "connections {idle:?} → {after:?}");
    assert!(after[1] >= idle[1] + (4 * N) as f64, "packets {idle:?} → {after:?}");
}

#[test]
fn a_failing_state_file_makes_the_node_not_ready_until_fixed() {
    require_root!();
    let topo = Topology::new(1, 1);
    let mut agent = Agent::start(&topo.node, &[("a.yaml", web("a", 20080, 1).render())], &[]);
    agent.wait_ready(READY);
    let state = agent.state_file();
    assert!(state.is_file(), "the first sync saved {}", state.display());
    let s = scrape(&agent);
    let failed0 = value(&s, "nodelb_sync_failures_total", &[("reason", "state_file")]).expect("reason at 0");
    let errors0 = sum(&s, "nodelb_syncs_total", &[("result", "error")]);

    // A directory where the file goes: saving the next allocation fails (root ignores modes).
    std::fs::remove_file(&state).unwrap();
    std::fs::create_dir(&state).unwrap();
    agent.write_manifest("b.yaml", &web("b", 20081, 1).render());
    assert!(
        wait_until(CHANGE, || agent.readyz().is_some_and(|(code, body)| code == 503
            && body.contains("state file")
            && body.contains(&state.display().to_string()))),
        "/readyz does not name the state file: {:?}",
        agent.readyz()
    );
    let s = scrape(&agent);
    assert!(value(&s, "nodelb_sync_failures_total", &[("reason", "state_file")]).unwrap() > failed0);
    assert!(sum(&s, "nodelb_syncs_total", &[("result", "error")]) > errors0);
    assert_eq!(value(&s, "nodelb_family_served", &[("family", "ipv4")]), Some(0.0));
    let st = agent.status().unwrap();
    assert_eq!(st["lastSync"]["ok"], false, "{st}");

    std::fs::remove_dir(&state).unwrap();
    agent.wait_ready(READY);
    agent.wait_state("default/b", "programmed", CHANGE);
    let saved = std::fs::read_to_string(&state).unwrap();
    assert!(saved.contains("default/b"), "{saved}");
    http_get(topo.client(0), node(), 20081, T).expect("b served once the state file is writable");
}

#[test]
fn json_logs_and_refusals_logged_once() {
    require_root!();
    let topo = Topology::new(1, 2);
    let bad = web("bad", 20081, 1).source_range("198.51.100.0/33");
    let files = [("bad.yaml", bad.render()), ("other.yaml", web("other", 20080, 1).render())];
    let mut agent = Agent::start(&topo.node, &files, &["--log-format", "json"]);
    agent.wait_ready(READY);
    agent.wait_state("default/bad", "refused", CHANGE);
    let synced = |a: &Agent| sum(&scrape(a), "nodelb_syncs_total", &[("result", "success")]);
    let before = synced(&agent);
    // Changes to an unrelated manifest: each one a sync that sees the bad Service again.
    for round in 1..=4 {
        let backends = 1 + round % 2;
        agent.write_manifest("other.yaml", &web("other", 20080, backends).render());
        assert!(
            wait_until(CHANGE, || agent
                .service_status("default/other")
                .is_some_and(|s| s["ports"][0]["endpoints"] == backends)),
            "round {round} not applied"
        );
    }
    assert!(synced(&agent) >= before + 4.0, "4 more syncs expected");

    let log = agent.logs();
    let mut refusals = 0;
    for line in log.lines().filter(|l| !l.starts_with("===== test harness")) {
        let v: serde_json::Value =
            serde_json::from_str(line).unwrap_or_else(|e| panic!("not JSON ({e}): {line}"));
        assert!(v["level"].is_string(), "no level: {line}");
        assert!(v["fields"].is_object(), "no fields: {line}");
        if v["fields"]["refusal"].as_str().is_some_and(|r| r.contains("default/bad")) {
            assert_eq!(v["level"], "WARN", "{line}");
            assert!(line.contains("198.51.100.0/33"), "the refusal names the value: {line}");
            refusals += 1;
        }
    }
    assert_eq!(refusals, 1, "the refusal of default/bad must be logged once:\n{log}");
}

/// A log written to a file (or a pipe: `kubectl logs`, journald) carries no terminal colour
/// escapes; the default text format is plain text there.
#[test]
fn text_logs_to_a_file_have_no_colour_escapes() {
    require_root!();
    let topo = Topology::new(1, 1);
    let bad = web("bad", 20081, 1).source_range("198.51.100.0/33");
    let mut agent = Agent::start(&topo.node, &[("bad.yaml", bad.render())], &[]);
    agent.wait_ready(READY);
    agent.wait_state("default/bad", "refused", CHANGE);
    let log = agent.logs();
    assert!(log.contains("WARN") && log.contains("198.51.100.0/33"), "the refusal is logged:\n{log}");
    assert!(!log.contains('\u{1b}'), "ANSI escape sequences in a log file:\n{log:?}");
}
