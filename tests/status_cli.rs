//! `nodelb status` as an operator reads it: one line per Service, with its state and the reason
//! on that line (root: a real agent programs a node namespace; real packets for the counters).
mod common;

use std::time::Duration;

use common::agent::{Agent, nodelb};
use common::manifest::{EndpointSpec, PortSpec, ServiceSpec};
use common::topology::{NODE_V4, Topology, backend_v4, http_get, wait_until};

const READY: Duration = Duration::from_secs(15);
const CHANGE: Duration = Duration::from_secs(5);

/// The line of `nodelb status` for `key` (`namespace/name`), if any.
fn line_of<'a>(out: &'a str, key: &str) -> Option<&'a str> {
    out.lines().find(|l| l.split_whitespace().next() == Some(key))
}

fn status_text(agent: &Agent, node: &common::netns::NetNs) -> String {
    let _ = agent;
    let out = nodelb(node, &["status", "--http-addr", "127.0.0.1:9470"]);
    assert!(out.status.success(), "nodelb status failed: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8_lossy(&out.stdout).into_owned()
}

#[test]
fn status_has_one_line_per_service_with_its_reason() {
    require_root!();
    let topo = Topology::new(1, 2);
    let be = |j| EndpointSpec::local(backend_v4(j));
    // `old` holds 20080; `young` (a later file) asks for it too: a conflict, named on its line.
    let old = ServiceSpec::new("old").port(PortSpec::tcp(80, Some(20080))).endpoint(be(0));
    let young = ServiceSpec::new("young").port(PortSpec::tcp(80, Some(20080))).endpoint(be(1));
    // A wrongly typed field: the document names the Service, but it is not one.
    let typo = "apiVersion: v1\nkind: Service\nmetadata:\n  name: typo\nspec:\n  type: LoadBalancer\n  ports:\n  - port: eighty\n";
    // Only terminating (still serving) endpoints: served, and the line says it is a fallback.
    let draining =
        ServiceSpec::new("draining").port(PortSpec::tcp(80, Some(20082))).endpoint(be(0).terminating());
    // Source ranges that leave the client out: its connections are dropped (a timeout for it),
    // so the status must count them.
    let ranged = ServiceSpec::new("ranged")
        .port(PortSpec::tcp(80, Some(20083)))
        .endpoint(be(0))
        .source_range("192.0.2.0/24");
    let files = [
        ("a-old.yaml", old.render()),
        ("b-young.yaml", young.render()),
        ("c-typo.yaml", typo.to_string()),
        ("d-draining.yaml", draining.render()),
        ("e-ranged.yaml", ranged.render()),
    ];
    let mut agent = Agent::start(&topo.node, &files, &[]);
    agent.wait_ready(READY);
    agent.wait_state("default/draining", "programmed", CHANGE);

    let client = topo.client(0);
    assert!(
        http_get(client, NODE_V4.into(), 20082, Duration::from_secs(2)).is_ok(),
        "terminating endpoint serves"
    );
    for _ in 0..2 {
        assert!(
            http_get(client, NODE_V4.into(), 20083, Duration::from_millis(500)).is_err(),
            "outside the ranges"
        );
    }

    let mut out = String::new();
    assert!(
        wait_until(CHANGE, || {
            out = status_text(&agent, &topo.node);
            line_of(&out, "default/ranged")
                .and_then(|l| l.split_whitespace().nth(4))
                .and_then(|n| n.parse::<u64>().ok())
                .is_some_and(|n| n >= 2)
        }),
        "refused packets of default/ranged counted on its line:\n{out}"
    );
    let young_line = line_of(&out, "default/young").unwrap_or_else(|| panic!("no line for young:\n{out}"));
    assert!(young_line.contains("refused"), "{young_line}");
    assert!(
        young_line.contains("20080") && young_line.contains("default/old"),
        "the conflict (wanted port, holder) is on young's line: {young_line}"
    );
    let typo_line =
        line_of(&out, "default/typo").unwrap_or_else(|| panic!("no line for the typo Service:\n{out}"));
    assert!(typo_line.contains("refused") && typo_line.contains("c-typo.yaml"), "{typo_line}");
    assert!(
        typo_line.contains("eighty") || typo_line.contains("invalid"),
        "names the bad value: {typo_line}"
    );
    let draining_line = line_of(&out, "default/draining").expect("draining line");
    assert!(
        draining_line.contains("programmed") && draining_line.contains("terminating"),
        "a terminating fallback says so: {draining_line}"
    );
    let old_line = line_of(&out, "default/old").expect("old line");
    assert!(old_line.contains("programmed"), "{old_line}");

    // The typo is fixed: the Service is served and its line is plain.
    agent.write_manifest(
        "c-typo.yaml",
        &ServiceSpec::new("typo").port(PortSpec::tcp(80, Some(20084))).endpoint(be(1)).render(),
    );
    agent.wait_state("default/typo", "programmed", CHANGE);
    // Broken again after it was good: served from the last good version, and its line says why.
    agent.write_manifest("c-typo.yaml", typo);
    assert!(
        wait_until(CHANGE, || {
            out = status_text(&agent, &topo.node);
            line_of(&out, "default/typo").is_some_and(|l| l.contains("programmed") && l.contains("last good"))
        }),
        "served from its last good version, said on its line:\n{out}"
    );
}

/// The small conventions of a command-line tool: `--version` names the commit it was built
/// from, `completion` prints a script for each shell, and a `NODELB_*` variable nodelb does not
/// read (a misspelt flag) is named in a warning.
#[test]
fn version_completion_and_unknown_variables() {
    let bin = env!("CARGO_BIN_EXE_nodelb");
    let out = std::process::Command::new(bin).arg("--version").output().expect("nodelb --version");
    let version = String::from_utf8_lossy(&out.stdout).into_owned();
    let commit = std::process::Command::new("git")
        .args(["rev-parse", "--short=12", "HEAD"])
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
        .unwrap_or_default();
    assert!(!commit.is_empty() && version.contains(&format!("(commit {commit})")), "{version} ({commit})");
    for (shell, marker) in
        [("bash", "complete -F _nodelb"), ("zsh", "#compdef nodelb"), ("fish", "complete -c nodelb")]
    {
        let out = std::process::Command::new(bin).args(["completion", shell]).output().expect("completion");
        let script = String::from_utf8_lossy(&out.stdout);
        assert!(out.status.success() && script.contains(marker), "{shell}: {script:.200}");
        assert!(script.contains("controller") && script.contains("status"), "{shell}: no subcommands");
    }
    let out = std::process::Command::new(bin)
        .args(["completion", "bash"])
        .env("NODELB_PROT_RANGE", "21000-21999")
        .output()
        .expect("completion");
    let log = String::from_utf8_lossy(&out.stderr);
    assert!(log.contains("environment variable NODELB_PROT_RANGE is not read by nodelb"), "{log}");
}
