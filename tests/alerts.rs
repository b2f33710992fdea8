//! The shipped alert rules (`charts/nodelb/rules/nodelb.rules.yaml`): `promtool test rules`
//! on their unit tests, and a real Prometheus (Debian's `prometheus`) scraping every agent's
//! authenticated `/metrics` over TLS with a scraper's token, loading the same rules, with
//! them going off when the test breaks what they watch (forwarding off, a host firewall's drop)
//! and every series they read present.
mod common;

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use common::cluster::{Cluster, node_v4};
use common::topology::wait_until;
use serde_json::Value;

const RULES: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/charts/nodelb/rules/nodelb.rules.yaml");
const METRICS_PORT: u16 = 9472;

/// `program`'s path, or why the test cannot run: scripts/test.sh installs Debian's `prometheus`
/// (with `promtool`); where it is missing the test says so and fails under `.ci/run`
/// (`NODELB_REQUIRE_ROOT_TESTS=1`), as a root test does.
fn tool(program: &str) -> Option<PathBuf> {
    let found = std::env::var_os("PATH")
        .iter()
        .flat_map(std::env::split_paths)
        .map(|d| d.join(program))
        .find(|p| p.is_file());
    if found.is_none() {
        assert!(
            std::env::var("NODELB_REQUIRE_ROOT_TESTS").as_deref() != Ok("1"),
            "{program} is missing: apt-get install prometheus (scripts/test.sh does)"
        );
        eprintln!("SKIP: {program} is missing (apt-get install prometheus; scripts/test.sh does)");
    }
    found
}

#[test]
fn the_rules_pass_their_promtool_tests() {
    let Some(promtool) = tool("promtool") else { return };
    let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/prometheus");
    let out = Command::new(promtool)
        .args(["test", "rules", "nodelb.rules.test.yaml"])
        .current_dir(dir)
        .output()
        .expect("promtool");
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success() && text.contains("SUCCESS"), "promtool test rules:\n{text}");
    let out =
        Command::new(tool("promtool").unwrap()).args(["check", "rules", RULES]).output().expect("promtool");
    assert!(out.status.success(), "promtool check rules: {}", String::from_utf8_lossy(&out.stderr));
}

/// The metric names a rule expression reads.
fn series_read_by_rules() -> BTreeSet<String> {
    let text = std::fs::read_to_string(RULES).unwrap();
    let rules: Value = serde_saphyr::from_str(&text).unwrap();
    let mut names = BTreeSet::new();
    for group in rules["groups"].as_array().unwrap() {
        for rule in group["rules"].as_array().unwrap() {
            let expr = rule["expr"].as_str().unwrap();
            for (i, _) in expr.match_indices("nodelb_") {
                let name: String =
                    expr[i..].chars().take_while(|c| c.is_ascii_alphanumeric() || *c == '_').collect();
                names.insert(name);
            }
        }
    }
    names
}

/// A Prometheus server in the client's network namespace (another host, as a scraper is),
/// killed on drop.
struct Prometheus {
    child: Child,
    dir: PathBuf,
}

impl Drop for Prometheus {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

impl Prometheus {
    fn start(binary: &Path, netns: &str, token: &str, targets: &[(String, String)]) -> Prometheus {
        let dir = std::env::temp_dir().join(format!("nodelb-prometheus-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(dir.join("data")).unwrap();
        std::fs::write(dir.join("token"), token).unwrap();
        let static_configs: Vec<String> = targets
            .iter()
            .map(|(node, target)| {
                format!("      - targets: ['{target}']\n        labels: {{node: '{node}'}}\n")
            })
            .collect();
        let config = format!(
            "global: {{scrape_interval: 1s, evaluation_interval: 1s}}\nrule_files: ['{RULES}']\nscrape_configs:\n  - job_name: nodelb\n    scheme: https\n    tls_config: {{insecure_skip_verify: true}}\n    authorization: {{credentials_file: '{}'}}\n    static_configs:\n{}",
            dir.join("token").display(),
            static_configs.concat()
        );
        std::fs::write(dir.join("prometheus.yml"), config).unwrap();
        let log = std::fs::File::create(dir.join("log")).unwrap();
        let child = Command::new("ip")
            .args(["netns", "exec", netns])
            .arg(binary)
            .arg(format!("--config.file={}", dir.join("prometheus.yml").display()))
            .arg(format!("--storage.tsdb.path={}", dir.join("data").display()))
            .arg("--web.listen-address=127.0.0.1:9090")
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .expect("start prometheus");
        Prometheus { child, dir }
    }

    fn log(&self) -> String {
        std::fs::read_to_string(self.dir.join("log")).unwrap_or_default()
    }
}

/// `GET /api/v1/query?query=…` of the Prometheus in `c`'s client namespace: the result vector.
fn query(c: &Cluster, promql: &str) -> Vec<Value> {
    let out = c.client.exec(
        "curl",
        &[
            "-s",
            "-m",
            "5",
            "-G",
            "http://127.0.0.1:9090/api/v1/query",
            "--data-urlencode",
            &format!("query={promql}"),
        ],
    );
    let body: Value = serde_json::from_slice(&out.stdout).unwrap_or_default();
    body["data"]["result"].as_array().cloned().unwrap_or_default()
}

#[test]
fn a_real_prometheus_scrapes_every_agent_and_the_rules_go_off() {
    require_root!();
    let Some(prometheus) = tool("prometheus") else { return };
    let c = Cluster::with_nodes(3, 1, &["--metrics-addr", &format!("0.0.0.0:{METRICS_PORT}")]);
    // The shipped scraper RBAC (daemonset/monitoring/scraper-rbac.yaml) and its token.
    c.api.kubectl_ok(&[
        "apply",
        "-f",
        concat!(env!("CARGO_MANIFEST_DIR"), "/daemonset/monitoring/scraper-rbac.yaml"),
    ]);
    let token = c.api.kubectl_ok(&["-n", "nodelb-system", "create", "token", "nodelb-metrics-scraper"]);
    // A pool, so that the pool series exist; a Service, so that the Service series do.
    c.api.kubectl_stdin(
        &["apply", "-f", "-"],
        r#"{"apiVersion": "nodelb.io/v1alpha1", "kind": "NodePortPool", "metadata": {"name": "all"}, "spec": {"ports": [{"start": 20000, "end": 20099}]}}"#,
    );
    c.create(&common::cluster::web("web", &[(0, 0)]));
    let np = c.wait_allocated("web", 1, Duration::from_secs(20))["80/TCP"];
    let targets: Vec<(String, String)> =
        (0..3).map(|i| (format!("node-{}", i + 1), format!("{}:{METRICS_PORT}", node_v4(i)))).collect();
    let p = Prometheus::start(&prometheus, &c.client.name, token.trim(), &targets);

    // Every agent scraped, as the real scraper's token allows.
    let ok = wait_until(Duration::from_secs(30), || query(&c, "up{job=\"nodelb\"} == 1").len() == 3);
    assert!(ok, "not every agent is up in Prometheus: {:?}\n{}", query(&c, "up"), p.log());
    // Every series a rule reads is one the agents export (nodelb_leader: the controller's).
    for name in series_read_by_rules() {
        if name == "nodelb_leader" {
            let sum: f64 = (0..c.controllers.len()).map(|k| c.controller_metric_sum(k, &name)).sum();
            assert_eq!(sum, 1.0, "one controller replica leads (nodelb_leader)");
            continue;
        }
        let ok = wait_until(Duration::from_secs(10), || !query(&c, &format!("count({name})")).is_empty());
        assert!(ok, "{name}: read by a rule, exported by no agent");
    }

    // node-2 serves no family once its forwarding is off; node-3's host firewall drops what
    // nodelb forwards: each rule goes off (pending: their `for` is minutes) for its node only.
    c.wait_served(1, np, Duration::from_secs(20));
    c.nodes[1].sysctl("net.ipv4.ip_forward", "0");
    c.nodes[1].sysctl("net.ipv6.conf.all.forwarding", "0");
    c.nodes[2].exec_ok("iptables-nft", &["-P", "FORWARD", "DROP"]);
    let alert = |name: &str| -> Vec<String> {
        query(&c, &format!("ALERTS{{alertname=\"{name}\"}}"))
            .iter()
            .filter_map(|a| a["metric"]["node"].as_str().map(String::from))
            .collect()
    };
    let ok = wait_until(Duration::from_secs(40), || alert("NodelbAgentNotServing") == ["node-2"]);
    assert!(ok, "NodelbAgentNotServing: {:?}", query(&c, "ALERTS"));
    let ok = wait_until(Duration::from_secs(40), || {
        alert("NodelbForwardedTrafficDropped").contains(&"node-3".to_string())
    });
    assert!(ok, "NodelbForwardedTrafficDropped: {:?}", query(&c, "ALERTS"));
    assert!(!alert("NodelbForwardedTrafficDropped").contains(&"node-1".to_string()));
    c.nodes[2].exec_ok("iptables-nft", &["-P", "FORWARD", "ACCEPT"]);
}
