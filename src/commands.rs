//! The subcommands, wired from their parts. `main` only parses and dispatches.

use std::collections::BTreeSet;
use std::io::{Read, Write};
use std::net::TcpStream;
use std::sync::{Arc, RwLock};
use std::time::Duration;

use anyhow::{Context, bail};
use tracing::{error, info};

use crate::agent::{self, AgentConfig};
use crate::cli::{CommonArgs, KubeArgs, PlanArgs, RunArgs, StatusArgs};
use crate::desired::{self, Inputs};
use crate::ir::Family;
use crate::k8s::controller::{self, ControllerConfig};
use crate::k8s::source::KubeSource;
use crate::metrics::Metrics;
use crate::model::ModelOptions;
use crate::nft::NftClient;
use crate::plan::NodeFacts;
use crate::source::Source;
use crate::state::StateFile;
use crate::status::{SharedStatus, Status};
use crate::sysctl::Sysctls;

fn node_name(common: &CommonArgs) -> String {
    common.node_name.clone().unwrap_or_else(|| {
        nix::unistd::gethostname()
            .ok()
            .and_then(|h| h.into_string().ok())
            .unwrap_or_else(|| "localhost".to_string())
    })
}

fn model_options(common: &CommonArgs) -> ModelOptions {
    ModelOptions { lb_class: common.load_balancer_class.clone(), ignore_unclassed: common.ignore_unclassed }
}

pub async fn run(args: RunArgs) -> anyhow::Result<()> {
    let kube_mode = args.common.manifests.is_none();
    if kube_mode && args.common.node_name.is_none() {
        bail!(
            "Kubernetes mode (no --manifests) needs --node-name or NODE_NAME (the downward API's spec.nodeName)"
        );
    }
    let cfg = AgentConfig {
        state_file: if kube_mode { None } else { Some(args.common.state_file.clone()) },
        node_name: node_name(&args.common),
        port_range: args.common.port_range,
        resync_period: args.resync_period,
        enable_forwarding: args.enable_forwarding,
        masquerade_mark: args.common.masquerade_mark,
        model: model_options(&args.common),
        sysctls: Sysctls::default(),
        bridges: crate::bridge::BridgeReader::default(),
    };
    let status: SharedStatus = Arc::new(RwLock::new(Status::default()));
    let metrics = Arc::new(Metrics::new(args.per_service_metrics)?);
    let stuck_after = (args.resync_period * 3).max(Duration::from_secs(30));
    let listener = tokio::net::TcpListener::bind(args.http_addr)
        .await
        .with_context(|| format!("cannot listen on --http-addr {}", args.http_addr))?;
    info!(addr = %args.http_addr, "serving /metrics, /status, /healthz, /readyz");
    let router = crate::http::router(status.clone(), metrics.clone(), stuck_after);
    tokio::spawn(async move {
        if let Err(e) = axum::serve(listener, router).await {
            error!(error = %e, "HTTP server failed");
        }
    });
    let (source, controller) = match &args.common.manifests {
        Some(dir) => (Source::manifests(dir.clone())?, None),
        None => {
            let client = kube_client(&args.kube).await?;
            if args.kube.lease_duration < Duration::from_secs(3) {
                bail!("--lease-duration {:?} is too short (at least 3s)", args.kube.lease_duration);
            }
            let kube = KubeSource::start(client.clone(), &args.kube.namespace, metrics.clone());
            let ccfg = ControllerConfig {
                node_name: cfg.node_name.clone(),
                namespace: args.kube.namespace.clone(),
                lease_duration: args.kube.lease_duration,
                node_addresses: args.kube.node_addresses.clone(),
                port_range: cfg.port_range,
                model: cfg.model.clone(),
            };
            info!(namespace = %ccfg.namespace, node = %ccfg.node_name, "Kubernetes mode");
            let controller = controller::spawn(client, kube.clone(), ccfg, status.clone(), metrics.clone());
            (Source::kube(kube.services_only()), Some(controller))
        }
    };
    agent::run(cfg, source, status, metrics, shutdown_signal()).await?;
    if let Some(controller) = controller {
        controller.shutdown().await;
    }
    Ok(())
}

/// A client from --kubeconfig, else the in-cluster config or $KUBECONFIG (`Config::infer`).
async fn kube_client(args: &KubeArgs) -> anyhow::Result<kube::Client> {
    let config = match &args.kubeconfig {
        Some(path) => {
            let kc = kube::config::Kubeconfig::read_from(path)
                .with_context(|| format!("cannot read --kubeconfig {}", path.display()))?;
            kube::Config::from_custom_kubeconfig(kc, &kube::config::KubeConfigOptions::default())
                .await
                .with_context(|| format!("invalid kubeconfig {}", path.display()))?
        }
        None => kube::Config::infer()
            .await
            .context("no Kubernetes configuration (not in a cluster, no KUBECONFIG); use --manifests DIR without a cluster")?,
    };
    kube::Client::try_from(config).context("cannot build a Kubernetes client")
}

async fn shutdown_signal() {
    use tokio::signal::unix::{SignalKind, signal};
    let mut term = match signal(SignalKind::terminate()) {
        Ok(s) => s,
        Err(_) => return std::future::pending().await,
    };
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        _ = term.recv() => {}
    }
}

pub fn plan(args: PlanArgs) -> anyhow::Result<()> {
    let Some(dir) = &args.common.manifests else {
        bail!("plan needs --manifests DIR");
    };
    let loaded = crate::manifests::load_dir(dir)?;
    for p in &loaded.problems {
        eprintln!("problem: {p}");
    }
    let previous = StateFile::new(args.common.state_file.clone()).load().unwrap_or_default();
    let node = NodeFacts {
        node_name: node_name(&args.common),
        families: Family::ALL.into_iter().collect::<BTreeSet<_>>(),
        masquerade_mark: args.common.masquerade_mark,
    };
    let desired = desired::compute(&Inputs {
        mode: desired::AllocationMode::Allocate,
        services: &loaded.services,
        slices: &loaded.slices,
        previous: &previous,
        range: &args.common.port_range,
        model: &model_options(&args.common),
        node: &node,
    });
    for r in &desired.refusals {
        eprintln!("refused: {r}");
    }
    for p in &desired.alloc_problems {
        eprintln!("allocation: {p}");
    }
    print!("{}", desired.ruleset.render());
    Ok(())
}

pub fn cleanup() -> anyhow::Result<()> {
    let mut nft = NftClient::new().context("cannot open a netfilter netlink socket")?;
    if nft.delete_table()? {
        println!("removed table inet {}", crate::ir::TABLE_NAME);
    } else {
        println!("nothing to remove: table inet {} does not exist", crate::ir::TABLE_NAME);
    }
    Ok(())
}

pub fn status(args: StatusArgs) -> anyhow::Result<()> {
    let body = http_get(args.http_addr, "/status").with_context(|| {
        format!("cannot reach the agent at {} (is `nodelb run` running?)", args.http_addr)
    })?;
    if args.json {
        println!("{body}");
        return Ok(());
    }
    let st: Status = serde_json::from_str(&body).context("agent sent invalid /status JSON")?;
    println!("node {}", st.node_name);
    for (fam, f) in &st.families {
        let served = if f.programmed { "served" } else { "NOT served" };
        println!("  {fam}: forwarding {}, {served}", if f.forwarding { "on" } else { "off" });
        if let Some(r) = &f.reason {
            println!("    {r}");
        }
    }
    println!("{:<40} {:<13} {:<30} REASON", "SERVICE", "STATE", "PORTS (port/proto->node port)");
    for s in &st.services {
        let ports: Vec<String> = s
            .ports
            .iter()
            .map(|p| match p.node_port {
                Some(np) => format!("{}/{}->{np}", p.port, p.protocol),
                None => format!("{}/{}->none", p.port, p.protocol),
            })
            .collect();
        let state =
            serde_json::to_value(s.state).ok().and_then(|v| v.as_str().map(String::from)).unwrap_or_default();
        println!(
            "{:<40} {:<13} {:<30} {}",
            format!("{}/{}", s.namespace, s.name),
            state,
            ports.join(","),
            s.reason.as_deref().unwrap_or("")
        );
        for p in s.ports.iter().filter_map(|p| p.problem.as_ref()) {
            println!("    {p}");
        }
        if let Some(t) = s.session_affinity_seconds {
            println!("    session affinity: ClientIP, timeout {t}s");
        }
    }
    for p in &st.problems {
        println!("problem: {p}");
    }
    for w in &st.hairpin {
        println!("hairpin: {}", w.message);
    }
    match st.readiness() {
        Ok(None) => println!("READY"),
        Ok(Some(note)) => println!("READY ({note})"),
        Err(r) => println!("NOT READY: {r}"),
    }
    Ok(())
}

/// A minimal HTTP/1.0 GET for the local status endpoint.
fn http_get(addr: std::net::SocketAddr, path: &str) -> anyhow::Result<String> {
    let mut stream = TcpStream::connect_timeout(&addr, Duration::from_secs(3))?;
    stream.set_read_timeout(Some(Duration::from_secs(5)))?;
    write!(stream, "GET {path} HTTP/1.0\r\nHost: {addr}\r\nConnection: close\r\n\r\n")?;
    let mut resp = String::new();
    stream.read_to_string(&mut resp)?;
    let (head, body) = resp.split_once("\r\n\r\n").unwrap_or((&resp, ""));
    let status_line = head.lines().next().unwrap_or("");
    if !status_line.contains(" 200 ") {
        bail!("GET {path}: {status_line}");
    }
    Ok(body.to_string())
}
