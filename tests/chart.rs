//! The Helm chart `charts/nodelb`: what it renders is accepted by a real API server
//! (`helm template | kubectl apply --dry-run=server`, against `testkube`), with the default values
//! and with every optional object, and its values name every flag of `nodelb run`.
//! `helm lint` and "daemonset/ is what the chart renders" are in scripts/validate-manifests.sh.
mod common;

use std::collections::BTreeSet;
use std::net::Ipv4Addr;

use clap::CommandFactory;
use common::kube::ControlPlane;
use common::netns::NetNs;
use serde_json::Value;

/// Flags of `nodelb run` and `nodelb controller` the chart does not take as values, and why.
const NOT_VALUES: &[(&str, &str)] = &[
    ("manifests", "manifests mode only"),
    ("state-file", "manifests mode only"),
    ("node-labels", "manifests mode only (the DaemonSet's agents match their Node's labels)"),
    ("node-name", "the downward API's spec.nodeName"),
    ("namespace", "the downward API's metadata.namespace"),
    ("kubeconfig", "in-cluster configuration"),
    ("daemonset", "the chart's own name, set by uninstall.removeRules"),
    ("identity", "the downward API's metadata.name (the controller's pod)"),
];

fn values() -> Value {
    let text =
        std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/charts/nodelb/values.yaml")).unwrap();
    serde_saphyr::from_str(&text).expect("values.yaml")
}

#[test]
fn chart_values_name_every_flag_of_nodelb_run_by_its_environment_variable() {
    let cli = nodelb::cli::Cli::command();
    let run = cli.find_subcommand("run").expect("run");
    let controller = cli.find_subcommand("controller").expect("controller");
    let mut flags = BTreeSet::new();
    for arg in run.get_arguments().chain(controller.get_arguments()).chain(cli.get_arguments()) {
        let Some(long) = arg.get_long() else { continue };
        if matches!(long, "help" | "version") {
            continue;
        }
        // The chart passes a value as NODELB_<FLAG>: every flag it passes must read that.
        let env = arg.get_env().map(|e| e.to_string_lossy().into_owned());
        let want = format!("NODELB_{}", long.to_uppercase().replace('-', "_"));
        if !NOT_VALUES.iter().any(|(f, _)| *f == long) {
            assert_eq!(env.as_deref(), Some(want.as_str()), "--{long}: the chart would set {want}");
        }
        flags.insert(long.to_string());
    }
    let config: BTreeSet<String> = values()["config"].as_object().expect("config").keys().cloned().collect();
    let expected: BTreeSet<String> =
        flags.iter().filter(|f| !NOT_VALUES.iter().any(|(n, _)| n == f)).cloned().collect();
    assert_eq!(config, expected, "charts/nodelb/values.yaml config (right: the flags of run and controller)");
    for (f, why) in NOT_VALUES {
        assert!(flags.contains(*f), "--{f} ({why}) is not a flag of nodelb run or controller any more");
    }
}

/// The flags the chart takes as `config.*` values: every long flag of `nodelb run`, `nodelb
/// controller` and the global ones, but [`NOT_VALUES`], with their help.
fn config_flags() -> std::collections::BTreeMap<String, String> {
    let cli = nodelb::cli::Cli::command();
    let run = cli.find_subcommand("run").expect("run");
    let controller = cli.find_subcommand("controller").expect("controller");
    run.get_arguments()
        .chain(controller.get_arguments())
        .chain(cli.get_arguments())
        .filter_map(|a| Some((a.get_long()?.to_string(), a)))
        .filter(|(long, _)| !matches!(long.as_str(), "help" | "version"))
        .filter(|(long, _)| !NOT_VALUES.iter().any(|(n, _)| n == long))
        .map(|(long, a)| {
            let help = a.get_help().map(|h| h.to_string()).unwrap_or_default();
            let first = help.trim().trim_end_matches('.').to_string();
            let env = format!("NODELB_{}", long.to_uppercase().replace('-', "_"));
            (long, format!("--{} ({env}): {first}", a.get_long().unwrap_or_default()))
        })
        .collect()
}

/// `charts/nodelb/values.schema.json` as the flags and values.yaml make it: every top-level
/// key of values.yaml and every flag under `config`, nothing else, so `helm install`, `helm
/// upgrade` and `helm lint --strict` refuse a misspelt key by name instead of passing it on as
/// an environment variable nobody reads.
fn values_schema() -> Value {
    let mut top = serde_json::Map::new();
    let values = values();
    let mut keys: Vec<&String> = values.as_object().expect("values").keys().collect();
    keys.push(&GLOBAL);
    keys.sort();
    keys.dedup();
    for key in keys {
        let schema = match key.as_str() {
            "config" => {
                let flags: serde_json::Map<String, Value> = config_flags()
                    .into_iter()
                    .map(|(flag, description)| (flag, serde_json::json!({"description": description})))
                    .collect();
                serde_json::json!({
                    "description": "Flags of nodelb run and nodelb controller, passed as NODELB_<FLAG> (README, \"CLI\"); null: the flag's default.",
                    "type": "object",
                    "additionalProperties": false,
                    "properties": flags,
                })
            }
            _ => serde_json::json!({}),
        };
        top.insert(key.clone(), schema);
    }
    serde_json::json!({
        "$schema": "http://json-schema.org/draft-07/schema#",
        "title": "nodelb chart values (generated by tests/chart.rs from values.yaml and nodelb's flags; UPDATE_GOLDEN=1 rewrites it)",
        "type": "object",
        "additionalProperties": false,
        "properties": top,
    })
}

/// Helm hands a chart `global` values whether or not it has any.
static GLOBAL: std::sync::LazyLock<String> = std::sync::LazyLock::new(|| "global".to_string());

#[test]
fn the_values_schema_is_generated_from_the_values_and_the_flags() {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/charts/nodelb/values.schema.json");
    let want = format!("{}\n", serde_json::to_string_pretty(&values_schema()).unwrap());
    if std::env::var("UPDATE_GOLDEN").as_deref() == Ok("1") {
        std::fs::write(path, &want).unwrap();
    }
    let got = std::fs::read_to_string(path).unwrap_or_default();
    assert!(got == want, "{path} is not what the values and the flags make (UPDATE_GOLDEN=1 rewrites it)");
}

/// `helm template nodelb charts/nodelb -n nodelb-system <args>`.
fn render(api: &ControlPlane, args: &[&str]) -> String {
    let chart = concat!(env!("CARGO_MANIFEST_DIR"), "/charts/nodelb");
    let mut cmd = vec!["template", "nodelb", chart, "-n", "nodelb-system"];
    cmd.extend_from_slice(args);
    api.helm_ok(&cmd)
}

/// `kubectl apply --dry-run=server --validate=strict -f -` of `manifests`: the server runs its
/// validation and admission (RBAC escalation checks, defaulting, field validation) and stores
/// nothing.
fn dry_run(api: &ControlPlane, what: &str, manifests: &str) -> String {
    let out = api.kubectl_stdin(&["apply", "--dry-run=server", "--validate=strict", "-f", "-"], manifests);
    assert!(
        out.status.success(),
        "{what}: the API server refused it: {}\n{manifests}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

#[test]
fn what_the_chart_renders_is_accepted_by_a_real_api_server() {
    require_root!();
    let ns = NetNs::new("chart");
    let api = ControlPlane::start(&ns, Ipv4Addr::LOCALHOST, 6443, &[]);
    // The release namespace exists (`helm install --create-namespace`).
    api.kubectl_ok(&["create", "namespace", "nodelb-system"]);

    let defaults = dry_run(&api, "the default values", &render(&api, &[]));
    // A misspelt key is refused by name (values.schema.json), by install as by template.
    let chart = concat!(env!("CARGO_MANIFEST_DIR"), "/charts/nodelb");
    for (args, key) in [
        (
            vec![
                "install",
                "nodelb",
                chart,
                "-n",
                "nodelb-system",
                "--dry-run",
                "--set",
                "config.prot-range=21000-21999",
            ],
            "prot-range",
        ),
        (vec!["template", "nodelb", chart, "--set", "imag.tag=0.1.1"], "imag"),
    ] {
        let out = api.helm(&args);
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            !out.status.success() && err.contains(&format!("'{key}' not allowed")),
            "helm {args:?}: {err}"
        );
    }
    for kind in [
        "serviceaccount/",
        "clusterrole.rbac.authorization.k8s.io/",
        "clusterrolebinding.rbac.authorization.k8s.io/",
        "role.rbac.authorization.k8s.io/",
        "rolebinding.rbac.authorization.k8s.io/",
        "daemonset.apps/",
    ] {
        assert!(
            defaults.contains(&format!("{kind}nodelb created (server dry run)")),
            "no {kind} in:\n{defaults}"
        );
    }
    // Every option a user may set (the PodMonitor needs the Prometheus operator's CRD, which
    // this API server does not have; validate-manifests.sh checks it against the DaemonSet).
    let all = render(
        &api,
        &[
            "--set",
            "grafanaDashboard.enabled=true",
            "--set",
            "config.iptables-forward-accept=true",
            "--set",
            "config.endpoint-cidrs={10.0.0.0/8,192.168.0.0/16}",
            "--set",
            "config.port-range=21000-21999",
            "--set",
            "nodeSelector.kubernetes\\.io/os=linux",
            "--set",
            "image.digest=sha256:0000000000000000000000000000000000000000000000000000000000000000",
            "--set",
            "uninstall.removeRules=false",
        ],
    );
    assert!(all.contains("NODELB_ENDPOINT_CIDRS") && all.contains("\"10.0.0.0/8,192.168.0.0/16\""), "{all}");
    assert!(!all.contains("NODELB_DAEMONSET") && !all.contains("daemonsets"), "removeRules=false:\n{all}");
    let out = dry_run(&api, "every option", &all);
    assert!(out.contains("configmap/nodelb-dashboard"), "{out}");
    // The plain manifests (generated from the chart, with the Namespace), as a user applies them.
    let manifests = concat!(env!("CARGO_MANIFEST_DIR"), "/daemonset");
    let out = api.kubectl(&["apply", "--dry-run=server", "--validate=strict", "-f", manifests]);
    assert!(out.status.success(), "daemonset/: {}", String::from_utf8_lossy(&out.stderr));
    // The default pool: its ranges from config.port-range, accepted by the API server once the
    // CRD (crds/, which `helm install` applies first) is served.
    api.kubectl_ok(&["apply", "-f", concat!(env!("CARGO_MANIFEST_DIR"), "/charts/nodelb/crds")]);
    api.kubectl_ok(&["wait", "--for=condition=Established", "crd/nodeportpools.nodelb.io", "--timeout=30s"]);
    let pool =
        render(&api, &["--set", "pools.defaultPool.enabled=true", "--set", "config.port-range=21000-21999"]);
    let out = dry_run(&api, "the default pool", &pool);
    assert!(out.contains("nodeportpool.nodelb.io/default created (server dry run)"), "{out}");
    let docs: Vec<Value> = serde_saphyr::from_multiple::<Value>(&pool)
        .expect("the rendered chart")
        .into_iter()
        .filter(|d| d["kind"] == "NodePortPool")
        .collect();
    assert_eq!(docs.len(), 1, "{pool}");
    assert_eq!(docs[0]["spec"]["ports"], serde_json::json!([{"start": 21000, "end": 21999}]), "{pool}");
    assert_eq!(docs[0]["spec"]["priority"], 1000, "{pool}");
    assert!(!render(&api, &[]).contains("kind: NodePortPool"), "no pool object unless asked for");
}
