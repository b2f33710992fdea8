//! The subcommands, wired from their parts. `main` only parses and dispatches.

use std::collections::BTreeSet;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::sync::{Arc, RwLock};
use std::time::Duration;

use anyhow::{Context, bail};
use tracing::{error, info, warn};

use crate::agent::{self, AgentConfig};
use crate::cli::{
    CommonArgs, ControllerArgs, KubeArgs, ListenArgs, PlanArgs, PolicyArgs, RunArgs, StatusArgs,
};
use crate::core::decisions::desired::{self, HostFacts, HostPolicy, Inputs};
use crate::core::decisions::endpoint_policy::EndpointPolicy;
use crate::core::domain::Family;
use crate::core::inputs::model::ModelOptions;
use crate::core::k8s::round::ControllerConfig;
use crate::core::k8s::uninstall::Exit;
use crate::core::reports::report::PortStatus;
use crate::core::ruleset::plan::NodeFacts;
use crate::encode::nft::NftClient;
use crate::k8s::controller;
use crate::k8s::installation::{Installation, Tracker};
use crate::k8s::node_lease::NodeLeaseConfig;
use crate::k8s::source::KubeSource;
use crate::observe::source::{ManifestPools, Source};
use crate::observe::state::StateFile;
use crate::observe::sysctl::Sysctls;
use crate::serve::metrics::{ControllerMetrics, Exposition, Metrics};
use crate::serve::status::{SharedStatus, Status};

/// `--node-labels` stands in for the Node object manifests mode does not have; in Kubernetes
/// mode the Node's own labels count, and a second, possibly different set would be a lie.
fn check_node_labels(common: &CommonArgs) -> anyhow::Result<()> {
    if common.manifests.is_none() && !common.node_labels.0.is_empty() {
        bail!(
            "--node-labels is for manifests mode (--manifests DIR): in Kubernetes mode pools match the labels of the Node object"
        );
    }
    Ok(())
}

fn node_name(common: &CommonArgs) -> String {
    common.node_name.clone().unwrap_or_else(|| {
        nix::unistd::gethostname()
            .ok()
            .and_then(|h| h.into_string().ok())
            .unwrap_or_else(|| "localhost".to_string())
    })
}

fn host_policy(policy: &PolicyArgs) -> HostPolicy {
    HostPolicy {
        endpoints: EndpointPolicy {
            allow_node_addresses: policy.allow_node_endpoints,
            allowed_cidrs: policy.endpoint_cidrs.iter().map(|n| n.trunc()).collect(),
        },
        ports: crate::core::decisions::port_policy::PortPolicy {
            ranges: vec![policy.port_range],
            allowed: policy.allowed_node_ports.0.clone(),
        },
    }
}

/// The mark bit of `--iptables-forward-accept`, when given; it must differ from the masquerade
/// bit, whose meaning in postrouting it would otherwise take on.
fn forward_mark(common: &CommonArgs) -> anyhow::Result<Option<u32>> {
    if !common.iptables_forward_accept {
        return Ok(None);
    }
    if common.iptables_forward_mark == common.masquerade_mark {
        bail!(
            "--iptables-forward-mark {:#x} is the masquerade mark (--masquerade-mark): choose another bit",
            common.iptables_forward_mark
        );
    }
    Ok(Some(common.iptables_forward_mark))
}

fn model_options(policy: &PolicyArgs) -> ModelOptions {
    ModelOptions {
        lb_class: policy.load_balancer_class.clone(),
        ignore_unclassed: policy.ignore_unclassed,
        servicelb_labels: policy.servicelb_labels,
    }
}

fn check_lease_duration(kube: &KubeArgs) -> anyhow::Result<()> {
    if kube.lease_duration < Duration::from_secs(3) {
        bail!("--lease-duration {:?} is too short (at least 3s)", kube.lease_duration);
    }
    Ok(())
}

/// `nodelb run`: a node agent. In Kubernetes mode it reads the cluster and writes only its
/// node's Lease and its Node's Events; `nodelb controller` allocates and writes status.
pub async fn run(args: RunArgs) -> anyhow::Result<()> {
    let kube_mode = args.common.manifests.is_none();
    check_node_labels(&args.common)?;
    if kube_mode && args.common.node_name.is_none() {
        bail!(
            "Kubernetes mode (no --manifests) needs --node-name or NODE_NAME (the downward API's spec.nodeName)"
        );
    }
    let policy = &args.common.policy;
    let cfg = AgentConfig {
        state_file: if kube_mode { None } else { Some(args.common.state_file.clone()) },
        node_name: node_name(&args.common),
        port_range: policy.port_range,
        resync_period: args.resync_period,
        enable_forwarding: args.enable_forwarding,
        masquerade_mark: args.common.masquerade_mark,
        connection_mark: args.common.connection_mark,
        forward_mark: forward_mark(&args.common)?,
        nat_shards: args.common.nat_shards,
        model: model_options(policy),
        sysctls: Sysctls::default(),
        policy: host_policy(policy),
        xtables_lockfile: crate::apply::xtables::default_lockfile(),
        bridges: crate::observe::bridge::BridgeReader::default(),
    };
    let status: SharedStatus = Arc::new(RwLock::new(Status::default()));
    let metrics =
        Arc::new(Metrics::new(args.per_service_metrics, Arc::new(crate::apply::kernel::read_counters_now))?);
    let stuck_after = (args.resync_period * 3).max(Duration::from_secs(30));
    if !kube_mode && args.listen.metrics_addr.is_some() {
        bail!(
            "--metrics-addr authenticates clients with the Kubernetes API: it needs Kubernetes mode (no --manifests)"
        );
    }
    let listen = &args.listen;
    let router = crate::serve::http::router(status.clone(), metrics.clone(), stuck_after);
    serve_http(listen.http_addr, "--http-addr", router, "serving /metrics, /status, /healthz, /readyz")
        .await?;
    let probes = Arc::new(crate::serve::http::NodeProbes { status: status.clone(), stuck_after });
    let health = crate::serve::http::health_router(probes);
    serve_http(listen.health_addr, "--health-addr", health, "serving /healthz, /readyz (reasons withheld)")
        .await?;
    let (source, tracker) = match &args.common.manifests {
        Some(dir) => {
            let pools = ManifestPools {
                node_labels: args.common.node_labels.0.clone(),
                port_range: policy.port_range,
            };
            (Source::manifests(dir.clone(), pools)?, None)
        }
        None => {
            let client = kube_client(&args.kube).await?;
            if let Some(addr) = listen.metrics_addr {
                serve_authenticated_metrics(listen, addr, &cfg.node_name, client.clone(), metrics.clone())
                    .await?;
            }
            check_lease_duration(&args.kube)?;
            let kube = KubeSource::start(client.clone(), &args.kube.namespace, metrics.kube.clone());
            info!(namespace = %args.kube.namespace, node = %cfg.node_name, "Kubernetes mode");
            let tracker = (!args.daemonset.is_empty()).then(|| {
                Tracker::start(
                    client.clone(),
                    Installation {
                        namespace: args.kube.namespace.clone(),
                        daemonset: args.daemonset.clone(),
                        node: cfg.node_name.clone(),
                    },
                )
            });
            let lease = NodeLeaseConfig {
                node_name: cfg.node_name.clone(),
                namespace: args.kube.namespace.clone(),
                lease_duration: args.kube.lease_duration,
            };
            crate::k8s::node_lease::spawn(client, lease, status.clone(), kube.clone(), metrics.kube.clone());
            (Source::kube(kube.services_only(), cfg.node_name.clone(), cfg.port_range), tracker)
        }
    };
    agent::run(cfg, source, status, metrics, shutdown_signal()).await?;
    if let Some(tracker) = tracker {
        // An uninstall may have taken the credentials: decided from what the tracker last saw.
        match tracker.decide_at_exit().await {
            Exit::Keep(why) => info!(reason = %why, "rules stay in the kernel"),
            Exit::Remove(why) => {
                warn!(reason = %why, "nodelb is gone from this node: removing its rules");
                let (removed, problems) = remove_rules();
                for r in &removed {
                    info!("{r}");
                }
                for p in &problems {
                    error!(problem = %p, "could not remove everything nodelb programmed (`nodelb cleanup` will)");
                }
            }
        }
    }
    Ok(())
}

/// `nodelb controller`: one replica of the controller. Its replicas elect a leader, which
/// allocates node ports and writes Service status, the registry and Events; the others stand by
/// with complete caches.
pub async fn controller(args: ControllerArgs) -> anyhow::Result<()> {
    check_lease_duration(&args.kube)?;
    let identity = args.identity.clone().filter(|i| !i.is_empty()).unwrap_or_else(|| {
        nix::unistd::gethostname()
            .ok()
            .and_then(|h| h.into_string().ok())
            .unwrap_or_else(|| "nodelb-controller".into())
    });
    let metrics = Arc::new(ControllerMetrics::new()?);
    let client = kube_client(&args.kube).await?;
    let source = KubeSource::start(client.clone(), &args.kube.namespace, metrics.kube.clone());
    let cfg = ControllerConfig {
        identity: identity.clone(),
        namespace: args.kube.namespace.clone(),
        lease_duration: args.kube.lease_duration,
        node_addresses: args.node_addresses.clone(),
        port_range: args.policy.port_range,
        model: model_options(&args.policy),
        policy: host_policy(&args.policy),
    };
    info!(namespace = %cfg.namespace, identity = %identity, "controller: electing a leader among the replicas");
    let controller = controller::spawn(client.clone(), source, cfg, metrics.clone());
    let probes = Arc::new(crate::serve::http::ControllerProbes {
        liveness: controller.liveness.clone(),
        leadership: controller.leadership.clone(),
        stuck_after: Duration::from_secs(30),
    });
    let listen = &args.listen;
    let local = crate::serve::http::local_router(metrics.clone(), probes.clone());
    serve_http(listen.http_addr, "--http-addr", local, "serving /metrics, /healthz, /readyz").await?;
    let health = crate::serve::http::health_router(probes);
    serve_http(listen.health_addr, "--health-addr", health, "serving /healthz, /readyz (reasons withheld)")
        .await?;
    if let Some(addr) = listen.metrics_addr {
        serve_authenticated_metrics(listen, addr, &identity, client, metrics).await?;
    }
    shutdown_signal().await;
    controller.shutdown().await;
    Ok(())
}

/// Binds `addr` and serves `router` on it (plain HTTP) for the life of the process.
async fn serve_http(
    addr: SocketAddr,
    flag: &str,
    router: axum::Router,
    what: &'static str,
) -> anyhow::Result<()> {
    let listener = tokio::net::TcpListener::bind(addr)
        .await
        .with_context(|| format!("cannot listen on {flag} {addr}"))?;
    info!(%addr, "{what}");
    tokio::spawn(crate::serve::conn::serve(listener, router, None, crate::serve::conn::Limits::PUBLIC));
    Ok(())
}

/// `/metrics` over TLS on `addr`, for bearer tokens the API server authenticates and authorizes.
async fn serve_authenticated_metrics(
    args: &ListenArgs,
    addr: SocketAddr,
    name: &str,
    client: kube::Client,
    metrics: Arc<dyn Exposition>,
) -> anyhow::Result<()> {
    let files = args.metrics_tls_cert_file.as_deref().zip(args.metrics_tls_key_file.as_deref());
    let names = [name.to_string(), "localhost".to_string()];
    let tls = crate::serve::tls::server_config(files, &names).context("--metrics-addr")?;
    let listener = tokio::net::TcpListener::bind(addr)
        .await
        .with_context(|| format!("cannot listen on --metrics-addr {addr}"))?;
    let audiences = args.metrics_token_audiences.iter().filter(|a| !a.is_empty()).cloned().collect();
    let reviewer = Arc::new(crate::k8s::review::KubeReviewer::new(client, audiences));
    let auth = Arc::new(crate::serve::http::MetricsAuth::new(reviewer));
    let router = crate::serve::http::metrics_router(metrics, auth);
    let certificate = if files.is_some() { "from --metrics-tls-cert-file" } else { "self-signed" };
    info!(%addr, certificate, "serving /metrics over TLS to authorized bearer tokens (TokenReview + SubjectAccessReview)");
    tokio::spawn(crate::serve::conn::serve(listener, router, Some(tls), crate::serve::conn::Limits::PUBLIC));
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

/// The pool context a Kubernetes-mode agent on `--node-name` builds (`k8s::pools::context`),
/// from NodePortPools and Namespaces listed once. A missing CRD (404) is "no pool object", as for
/// the agent. A pool refused is printed as a problem; there is no last valid version to keep.
async fn plan_pools(
    client: &kube::Client,
    common: &CommonArgs,
    nodes: Vec<k8s_openapi::api::core::v1::Node>,
) -> anyhow::Result<crate::core::decisions::pool::PoolContext> {
    let lp = kube::api::ListParams::default();
    let pools =
        match kube::Api::<crate::core::decisions::pool::NodePortPool>::all(client.clone()).list(&lp).await {
            Ok(l) => l.items,
            Err(kube::Error::Api(e)) if e.code == 404 => vec![],
            Err(e) => return Err(e).context("cannot list NodePortPools"),
        };
    let namespaces = kube::Api::<k8s_openapi::api::core::v1::Namespace>::all(client.clone())
        .list(&lp)
        .await
        .context("cannot list Namespaces")?
        .items;
    let snap = crate::core::k8s::snapshot::KubeSnapshot {
        nodes: nodes.into_iter().map(Arc::new).collect(),
        pools: pools.into_iter().map(Arc::new).collect(),
        namespaces: namespaces.into_iter().map(Arc::new).collect(),
        ..Default::default()
    };
    let (ctx, invalid) = crate::core::k8s::pools::context(
        &snap,
        &mut Default::default(),
        common.policy.port_range,
        Some(&node_name(common)),
        common.policy.servicelb_labels,
    );
    for p in &invalid {
        eprintln!("problem: {p}");
    }
    Ok(ctx)
}

/// `nodelb plan`: what `run` would program on this node, printed in nft syntax (refusals on
/// stderr). From a manifests directory (allocating as the agent does, from its state file), or
/// without one from the cluster as it is now (the allocations the leader wrote on the Services,
/// as a Kubernetes-mode node uses them). Run it inside the node's network namespace: the node's
/// addresses and listening sockets count, as they do for the agent.
pub async fn plan(args: PlanArgs) -> anyhow::Result<()> {
    check_node_labels(&args.common)?;
    let host_addresses = crate::observe::hostaddrs::read().unwrap_or_default();
    let pools: Option<crate::core::decisions::pool::PoolContext>;
    let mut registry = None;
    let (services, slices, notes, mode, previous, cluster_addresses) = match &args.common.manifests {
        Some(dir) => {
            let loaded = crate::observe::manifest_dir::load_dir(dir)?;
            for p in &loaded.problems {
                eprintln!("problem: {p}");
            }
            let (ctx, pool_problems) = crate::core::inputs::manifests::pool_context(
                &loaded,
                &mut Default::default(),
                args.common.policy.port_range,
                &args.common.node_labels.0,
                args.common.policy.servicelb_labels,
            );
            for p in &pool_problems {
                eprintln!("problem: {p}");
            }
            pools = Some(ctx);
            // A state file the agent could not read would stop it; `plan` must not print ports
            // the agent would not use.
            let previous = StateFile::new(args.common.state_file.clone()).load()?;
            let notes = desired::SourceNotes {
                refused: loaded
                    .invalid_services
                    .iter()
                    .map(|i| crate::core::inputs::model::Refusal::Invalid {
                        service: i.key.clone(),
                        reason: i.problem.to_string(),
                    })
                    .collect(),
                stale: Default::default(),
            };
            (
                loaded.services.clone(),
                loaded.slices.clone(),
                notes,
                desired::AllocationMode::Allocate,
                previous,
                Default::default(),
            )
        }
        None => {
            if args.common.node_name.is_none() {
                bail!(
                    "plan without --manifests plans a node of the cluster: it needs --node-name or NODE_NAME"
                );
            }
            let client = kube_client(&args.kube).await?;
            let lp = kube::api::ListParams::default();
            let services =
                kube::Api::<k8s_openapi::api::core::v1::Service>::all(client.clone()).list(&lp).await;
            let slices =
                kube::Api::<crate::core::inputs::compact::EndpointSlice>::all(client.clone()).list(&lp).await;
            let nodes = kube::Api::<k8s_openapi::api::core::v1::Node>::all(client.clone()).list(&lp).await;
            let (services, slices, nodes) = (
                services.context("cannot list Services")?.items.into_iter().map(Arc::new).collect(),
                slices.context("cannot list EndpointSlices")?.items.into_iter().map(Arc::new).collect(),
                nodes.context("cannot list Nodes")?.items,
            );
            let namespace = &args.kube.namespace;
            let node_leases =
                kube::Api::<k8s_openapi::api::coordination::v1::Lease>::namespaced(client.clone(), namespace)
                    .list(&kube::api::ListParams::default().labels(crate::core::k8s::nodes::LABEL_NODE_LEASE))
                    .await
                    .context("cannot list the node Leases")?
                    .items;
            let (api_ns, api_name) = crate::core::k8s::nodes::API_SERVER_SERVICE;
            let api_server =
                kube::Api::<crate::core::inputs::compact::EndpointSlice>::namespaced(client.clone(), api_ns)
                    .list(
                        &kube::api::ListParams::default()
                            .labels(&format!("kubernetes.io/service-name={api_name}")),
                    )
                    .await
                    .context("cannot list the API server's EndpointSlices")?
                    .items;
            // An API server without ServiceCIDRs (before Kubernetes 1.33) has none.
            let service_cidrs =
                kube::Api::<k8s_openapi::api::networking::v1::ServiceCIDR>::all(client.clone())
                    .list(&lp)
                    .await
                    .map(|l| l.items)
                    .or_else(|e| match e {
                        kube::Error::Api(s) if s.code == 404 => Ok(Vec::new()),
                        e => Err(e),
                    })
                    .context("cannot list ServiceCIDRs")?;
            let more = crate::core::k8s::nodes::ClusterObjects {
                leases: &node_leases,
                api_server: &api_server,
                service_cidrs: &service_cidrs,
            };
            let mut addresses = crate::core::k8s::nodes::cluster_addresses(&nodes, more);
            let own = args.common.node_name.as_deref();
            if let Some(n) = nodes.iter().find(|n| n.metadata.name.as_deref() == own) {
                addresses.own.types = crate::core::k8s::nodes::address_types(n);
            }
            pools = Some(plan_pools(&client, &args.common, nodes).await?);
            let leases = kube::Api::<k8s_openapi::api::coordination::v1::Lease>::namespaced(
                client.clone(),
                &args.kube.namespace,
            )
            .list(&kube::api::ListParams::default().labels(crate::core::k8s::claims::LABEL))
            .await
            .context("cannot list the node-port registry's Leases")?;
            let (read, problems) = crate::core::k8s::claims::ReadRegistry::read(&leases.items, None);
            for p in problems {
                eprintln!("node-port registry: {p}");
            }
            registry = Some(read.registry);
            let mode = desired::AllocationMode::Annotated;
            (services, slices, Default::default(), mode, Default::default(), addresses)
        }
    };
    let node = NodeFacts {
        node_name: node_name(&args.common),
        families: Family::ALL.into_iter().collect::<BTreeSet<_>>(),
        masquerade_mark: args.common.masquerade_mark,
        connection_mark: args.common.connection_mark,
        forward_mark: forward_mark(&args.common)?,
        nat_shards: match args.common.nat_shards {
            crate::core::ruleset::plan::NatShards::Fixed(k) => k,
            crate::core::ruleset::plan::NatShards::Auto => crate::core::ruleset::plan::auto_nat_shards(
                crate::agent::lb_service_ports(services.iter().map(|s| &**s)),
                1,
            ),
        },
    };
    let host = HostFacts {
        addresses: host_addresses.merged(&cluster_addresses),
        listeners: crate::core::decisions::port_policy::Listeners::from_sockets(
            crate::observe::listeners::read().unwrap_or_default(),
        ),
    };
    let (desired, _) = desired::compute(
        &Inputs {
            mode,
            services: &services,
            slices: &slices,
            notes: &notes,
            previous: &previous.allocations,
            since: &previous.since,
            range: &args.common.policy.port_range,
            model: &model_options(&args.common.policy),
            node: &node,
            pools: pools.as_ref(),
            policy: &host_policy(&args.common.policy),
            host: &host,
            registry: registry.as_ref(),
        },
        true,
        &mut desired::Kept::default(),
        None,
    );
    for r in &desired.refusals {
        eprintln!("refused: {r}");
    }
    for p in &desired.alloc_problems {
        eprintln!("allocation: {p}");
    }
    for r in &desired.refused_endpoints {
        eprintln!("refused: {r}");
    }
    for r in &desired.refused_ports {
        eprintln!("refused: {r}");
    }
    for s in desired.services.iter().filter(|s| s.pool.is_some()) {
        eprintln!("pool: {}/{} → {}", s.namespace, s.name, s.pool.as_deref().unwrap_or_default());
    }
    let crate::core::incremental::replan::Planned::Full(ruleset) = desired.ruleset else {
        bail!("the planner gave a patch where nothing was applied");
    };
    print!("{}", ruleset.render());
    Ok(())
}

pub fn cleanup() -> anyhow::Result<()> {
    let (removed, problems) = remove_rules();
    for r in &removed {
        println!("{r}");
    }
    if !problems.is_empty() {
        bail!("could not remove everything nodelb programmed:\n  {}", problems.join("\n  "));
    }
    Ok(())
}

/// Removes everything nodelb programmed in this network namespace (`nodelb cleanup`, and an
/// agent that stops because nodelb was uninstalled): what was removed, and what could not be.
fn remove_rules() -> (Vec<String>, Vec<String>) {
    let mut nft = match NftClient::new() {
        Ok(n) => n,
        Err(e) => return (Vec::new(), vec![format!("cannot open a netfilter netlink socket: {e}")]),
    };
    // nodelb's ACCEPTs in iptables' FORWARD chains first: they match a mark only our table sets.
    let xtables = crate::apply::xtables::Xtables::new(crate::apply::xtables::default_lockfile());
    let (mut removed, mut problems) = crate::apply::firewall::remove_accepts(&mut nft, &xtables);
    let tables = nft.our_tables().unwrap_or_default();
    match nft.delete_table() {
        Ok(_) if !tables.is_empty() => {
            let names: Vec<String> = tables.iter().map(|t| t.name()).collect();
            removed.push(format!("removed table inet {}", names.join(", ")));
        }
        Ok(_) => removed.push(format!(
            "nothing to remove: table inet {} does not exist",
            crate::core::ruleset::ir::TABLE_NAME
        )),
        Err(e) => problems.push(format!("table inet {}: {e}", crate::core::ruleset::ir::TABLE_NAME)),
    }
    (removed, problems)
}

/// `nodelb status --cluster` (and `kubectl nodelb`): lists Services, Nodes and the node Leases
/// once and prints [`crate::core::k8s::cluster_view`]'s view of them.
pub async fn status_cluster(args: StatusArgs) -> anyhow::Result<()> {
    use k8s_openapi::api::coordination::v1::Lease;
    use k8s_openapi::api::core::v1::{Node, Service};
    use kube::api::{Api, ListParams};
    let client = kube_client(&KubeArgs {
        kubeconfig: args.kubeconfig.clone(),
        namespace: args.nodelb_namespace.clone(),
        lease_duration: Duration::from_secs(15),
    })
    .await?;
    let services: Api<Service> = match &args.namespace {
        Some(ns) => Api::namespaced(client.clone(), ns),
        None => Api::all(client.clone()),
    };
    let list = ListParams::default();
    let services = services.list(&list).await.context("cannot list Services")?.items;
    let nodes = Api::<Node>::all(client.clone()).list(&list).await.context("cannot list Nodes")?.items;
    let leases = Api::<Lease>::namespaced(client, &args.nodelb_namespace)
        .list(&ListParams::default().labels(&format!("{}=true", crate::core::k8s::nodes::LABEL_NODE_LEASE)))
        .await
        .with_context(|| format!("cannot list the node Leases in namespace {}", args.nodelb_namespace))?
        .items;
    let filter = crate::core::k8s::cluster_view::Filter {
        namespace: args.namespace.clone(),
        service: args.service.clone(),
        node: args.node.clone(),
    };
    let now = k8s_openapi::jiff::Timestamp::now();
    let view = crate::core::k8s::cluster_view::assemble(&services, &nodes, &leases, now, &filter);
    match args.json {
        true => println!("{}", serde_json::to_string_pretty(&view)?),
        false => print!("{}", crate::core::k8s::cluster_view::render(&view, now.as_second().max(0) as u64)),
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
        let served = if f.served() { "served" } else { "NOT served" };
        println!("  {fam}: forwarding {}, {served}", if f.forwarding { "on" } else { "off" });
        for r in [&f.reason, &f.firewall, &f.evidence].into_iter().flatten() {
            println!("    {r}");
        }
    }
    print_host_firewall(&st.host_firewall);
    println!(
        "{:<40} {:<13} {:<30} {:>8} {:>8} REASON",
        "SERVICE", "STATE", "PORTS (port/proto->node port)", "CONNS", "REFUSED"
    );
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
        // Kernel counters (absent with --per-service-metrics=false): new connections, and
        // packets of connections refused by loadBalancerSourceRanges (dropped, so a refused
        // client only sees a timeout: this column is where the refusal shows).
        let total = |f: fn(&PortStatus) -> Option<u64>| {
            let values: Vec<u64> = s.ports.iter().filter_map(f).collect();
            if values.is_empty() { "-".to_string() } else { values.iter().sum::<u64>().to_string() }
        };
        println!(
            "{:<40} {:<13} {:<30} {:>8} {:>8} {}",
            format!("{}/{}", s.namespace, s.name),
            state,
            ports.join(","),
            total(|p| p.connections),
            total(|p| p.refused_packets),
            s.reason.as_deref().unwrap_or("")
        );
        if let Some(pool) = &s.pool {
            println!("    pool: {pool}");
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

/// The host-firewall part of `nodelb status`: chains that drop forwarded connections (and
/// whether for certain), where nodelb's ACCEPT is, what the forward counters say.
fn print_host_firewall(fw: &crate::serve::status::HostFirewallStatus) {
    if fw.checked_at == 0 {
        return;
    }
    println!("host firewall (forward path):");
    if fw.drops.is_empty() {
        println!("  no chain of another table drops nodelb's forwarded connections");
    }
    for d in &fw.drops {
        let how = if d.certain { "DROPS" } else { "may drop" };
        println!("  {} {how} {} connections: {}", d.finding.location(), d.finding.family, d.finding.drop);
        for p in &d.finding.partial {
            println!("    unless accepted by {p}");
        }
        println!("    fix: {}", d.fix);
    }
    for a in &fw.accept_rules {
        println!("  nodelb's ACCEPT is in {a}");
    }
    for (fam, c) in &fw.counters {
        let state = match fw.evidence.get(fam) {
            Some(crate::core::ruleset::hostfw::EvidenceState::Dropping { connections, .. }) => {
                format!(", DROPPING: {connections} entered without leaving")
            }
            Some(crate::core::ruleset::hostfw::EvidenceState::Passing) => ", passing".to_string(),
            None => String::new(),
        };
        println!(
            "  {fam}: {} new connections entered the forward path, {} left it{state}",
            c.entered, c.passed
        );
    }
    for p in &fw.problems {
        println!("  problem: {p}");
    }
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
