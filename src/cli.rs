//! Command-line interface (clap). Every flag of `run` also reads an environment variable, so the
//! DaemonSet can configure it either way.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use clap::{Parser, Subcommand, ValueEnum};

use crate::core::decisions::port_policy::PortRange;

pub use crate::VERSION;

#[derive(Debug, Parser)]
#[command(
    name = "nodelb",
    version = VERSION,
    about = "Node agent for Kubernetes LoadBalancer Services (nftables over netlink)"
)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
    /// Log format.
    #[arg(long, global = true, value_enum, default_value = "text", env = "NODELB_LOG_FORMAT")]
    pub log_format: LogFormat,
}

#[derive(Debug, Clone, Copy, ValueEnum)]
pub enum LogFormat {
    Text,
    Json,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Program this node and keep it programmed.
    Run(Box<RunArgs>),
    /// Print the ruleset the agent would program (for a manifests directory, or for this node of
    /// the cluster as it is now), and exit.
    Plan(Box<PlanArgs>),
    /// Remove everything nodelb created in this network namespace (table inet nodelb).
    Cleanup,
    /// Allocate node ports and write Service status for the cluster (Kubernetes mode; one of
    /// the controller's replicas leads, the others stand by).
    Controller(Box<ControllerArgs>),
    /// Show the agent's Services, their node ports and why anything was refused.
    Status(StatusArgs),
    /// Print the NodePortPool CustomResourceDefinition (YAML), generated from nodelb's own types.
    Crd,
    /// Print a shell completion script (`source <(nodelb completion bash)`).
    Completion {
        #[arg(value_enum)]
        shell: clap_complete::Shell,
    },
}

/// The name under which `kubectl` runs nodelb as a plugin (`kubectl nodelb …`): a copy (or a
/// link) of the binary by that name on the PATH.
pub const KUBECTL_PLUGIN: &str = "kubectl-nodelb";

/// The command line as nodelb reads it: run as [`KUBECTL_PLUGIN`], it is `nodelb status
/// --cluster` with the plugin's arguments (`kubectl nodelb -n web --json`).
pub fn command_line(args: impl IntoIterator<Item = std::ffi::OsString>) -> Vec<std::ffi::OsString> {
    let mut args: Vec<std::ffi::OsString> = args.into_iter().collect();
    let plugin =
        args.first().and_then(|a| std::path::Path::new(a).file_name()).is_some_and(|n| n == KUBECTL_PLUGIN);
    if plugin {
        args.splice(1..1, ["status".into(), "--cluster".into()]);
    }
    args
}

/// Environment variables that no flag names and are no typo: the log filter, and the commit the
/// build reads (build.rs), which `cargo run` passes on to the binary too.
const OTHER_ENV: &[&str] = &["NODELB_LOG", "NODELB_GIT_COMMIT"];

/// The `NODELB_*` names among `names` that nodelb does not read (no flag of any subcommand, nor
/// [`OTHER_ENV`]): a misspelt variable, or a chart `config.*` key that is no flag, would otherwise
/// be ignored without a word.
pub fn unknown_env(names: impl IntoIterator<Item = String>) -> Vec<String> {
    use clap::CommandFactory;
    fn known(cmd: &clap::Command, out: &mut std::collections::BTreeSet<String>) {
        out.extend(cmd.get_arguments().filter_map(|a| a.get_env()).map(|e| e.to_string_lossy().into_owned()));
        for sub in cmd.get_subcommands() {
            known(sub, out);
        }
    }
    let mut reads: std::collections::BTreeSet<String> = OTHER_ENV.iter().map(|s| s.to_string()).collect();
    known(&Cli::command(), &mut reads);
    let mut out: Vec<String> =
        names.into_iter().filter(|n| n.starts_with("NODELB_") && !reads.contains(n)).collect();
    out.sort();
    out
}

#[derive(Debug, Clone, clap::Args)]
pub struct CommonArgs {
    /// Directory of Service + EndpointSlice manifests (YAML/JSON) to serve, without a cluster.
    /// Without it, `run` is in Kubernetes mode (in-cluster config, KUBECONFIG or --kubeconfig).
    #[arg(long, env = "NODELB_MANIFESTS")]
    pub manifests: Option<PathBuf>,
    /// This node's name: endpoints with this `nodeName` are local (externalTrafficPolicy: Local).
    /// Defaults to $NODE_NAME, else the host name (manifests mode); required in Kubernetes mode.
    #[arg(long, env = "NODE_NAME")]
    pub node_name: Option<String>,
    /// This node's labels in manifests mode (`zone=a,tier=edge`), which NodePortPool
    /// `nodeSelector`s (and the ServiceLB labels) match: manifests mode has no Node object. In
    /// Kubernetes mode the Node's own labels count and this flag is refused.
    #[arg(long, default_value = "", value_parser = parse_node_labels, env = "NODELB_NODE_LABELS")]
    pub node_labels: NodeLabels,
    /// Packet-mark bit that tells postrouting to masquerade (same meaning as kube-proxy's 0x4000).
    #[arg(long, default_value = "0x4000", value_parser = parse_mark, env = "NODELB_MASQUERADE_MARK")]
    pub masquerade_mark: u32,
    /// Conntrack-mark bit nodelb sets on the connections it DNATs: its forward chains count,
    /// mark and accept only connections carrying it (another component's DNATed flow to the same
    /// port number is not nodelb's). One bit nothing else on the node uses in the conntrack mark.
    #[arg(long, default_value = "0x100000", value_parser = parse_mark, env = "NODELB_CONNECTION_MARK")]
    pub connection_mark: u32,
    /// Spread the Services' nat chains over this many nf_tables tables (`nodelb-s0`…): 1, 2, 4, 8,
    /// 16 or 32 (a node port's table is its low bits), or `auto`: one per 1,000 Service ports
    /// (rounded up to a power of two; none up to 1,000). 1 keeps them in table `nodelb`. The
    /// kernel validates only the tables a change touches, so adding or changing one Service
    /// costs about 1/N of one table's validation; each new connection meets one
    /// masked compare per table besides (docs/design/dispatch.md, "Sharding the nat chains";
    /// docs/benchmarks.md has both measured).
    #[arg(long, default_value = "auto", value_parser = parse_nat_shards, env = "NODELB_NAT_SHARDS")]
    pub nat_shards: crate::core::ruleset::plan::NatShards,
    /// Insert an ACCEPT for nodelb's forwarded flows at the head of the host's iptables FORWARD
    /// chain (iptables-nft: table ip/ip6 filter; iptables-legacy: the x_tables filter table), for
    /// hosts whose firewall drops forwarded traffic (Docker, ufw). Removed by `nodelb cleanup` and
    /// when the agent runs without this flag.
    #[arg(long, env = "NODELB_IPTABLES_FORWARD_ACCEPT")]
    pub iptables_forward_accept: bool,
    /// Packet-mark bit nodelb's flows carry through the forward hook (set before every other
    /// forward chain, cleared after all of them); the iptables ACCEPT matches it. One bit, not the
    /// masquerade mark.
    #[arg(long, default_value = "0x2000", value_parser = parse_mark, env = "NODELB_IPTABLES_FORWARD_MARK")]
    pub iptables_forward_mark: u32,
    /// State file keeping port allocations across restarts (manifests mode).
    #[arg(long, default_value = "/var/lib/nodelb/state.json", env = "NODELB_STATE_FILE")]
    pub state_file: PathBuf,
    #[command(flatten)]
    pub policy: PolicyArgs,
}

/// What decides which Services are nodelb's and which node ports and endpoints they may have.
/// The node agents and the controller must read the same values (the chart gives both the same
/// environment).
#[derive(Debug, Clone, clap::Args)]
pub struct PolicyArgs {
    /// Node ports are allocated from this range (inclusive). The default overlaps neither the
    /// NodePort range (30000-32767) nor the ephemeral range (32768-60999).
    #[arg(long, default_value = "20000-29999", env = "NODELB_PORT_RANGE")]
    pub port_range: PortRange,
    /// spec.loadBalancerClass served by this agent (Services without a class are served too,
    /// unless --ignore-unclassed).
    #[arg(long, default_value = crate::core::inputs::model::DEFAULT_LB_CLASS, env = "NODELB_LOAD_BALANCER_CLASS")]
    pub load_balancer_class: String,
    /// Do not serve Services that have no spec.loadBalancerClass.
    #[arg(long, env = "NODELB_IGNORE_UNCLASSED")]
    pub ignore_unclassed: bool,
    /// Honour the k3s ServiceLB labels (Kubernetes mode): once any node carries
    /// svccontroller.k3s.cattle.io/enablelb, only nodes with it set to true serve, and a Service
    /// labelled svccontroller.k3s.cattle.io/lbpool only on nodes with the same lbpool label.
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set, env = "NODELB_SERVICELB_LABELS")]
    pub servicelb_labels: bool,
    /// Allow a node's own addresses (this node's, and every Node object's) as endpoints, for
    /// hostNetwork backends. Risk: whoever can write an EndpointSlice (or a manifest) can then
    /// expose any port of any node through a Service.
    #[arg(long, env = "NODELB_ALLOW_NODE_ENDPOINTS")]
    pub allow_node_endpoints: bool,
    /// Node ports Services may ask for beyond --port-range (`nodelb.io/ports`, or `service`):
    /// comma-separated ports and ranges, e.g. `80,443,8000-8100`. Risk: a Service given port 22,
    /// 6443 or 10250 would take over SSH, the API server or the kubelet on every node where
    /// nothing listens on it yet. A port a process on the node listens on is never taken.
    #[arg(long, default_value = "", value_parser = parse_port_list, env = "NODELB_ALLOWED_NODE_PORTS")]
    pub allowed_node_ports: crate::core::decisions::port_policy::PortList,
    /// Only endpoints inside these CIDRs are DNATed to (comma-separated; e.g. the pod and host
    /// networks). Default: any address the fixed rules allow.
    #[arg(long, value_delimiter = ',', env = "NODELB_ENDPOINT_CIDRS")]
    pub endpoint_cidrs: Vec<ipnet::IpNet>,
}

#[derive(Debug, clap::Args)]
pub struct RunArgs {
    #[command(flatten)]
    pub common: CommonArgs,
    /// How often the kernel is checked against what we programmed (and repaired).
    #[arg(long, default_value = "10s", value_parser = humantime::parse_duration, env = "NODELB_RESYNC_PERIOD")]
    pub resync_period: Duration,
    #[command(flatten)]
    pub listen: ListenArgs,
    /// Switch net.ipv4.ip_forward / net.ipv6.conf.all.forwarding on when they are off, instead
    /// of leaving that family unserved.
    #[arg(long, env = "NODELB_ENABLE_FORWARDING")]
    pub enable_forwarding: bool,
    /// Export per-Service-port traffic series (read from the kernel's rule counters at scrape
    /// time). Turn off on clusters with very many Services to bound /metrics cardinality.
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set, env = "NODELB_PER_SERVICE_METRICS")]
    pub per_service_metrics: bool,
    #[command(flatten)]
    pub kube: KubeArgs,
    /// The DaemonSet running this agent (in --namespace), set by the shipped manifests. When
    /// nodelb is uninstalled (that Namespace or DaemonSet deleted) or the DaemonSet no longer runs
    /// on this node, the agent removes its rules as it stops; a restart, an eviction or a rolling
    /// update keeps them. Empty: the rules always stay.
    #[arg(long, default_value = "", env = "NODELB_DAEMONSET")]
    pub daemonset: String,
}

/// The HTTP listeners, of a node agent and of the controller alike.
#[derive(Debug, Clone, clap::Args)]
pub struct ListenArgs {
    /// Address of the unauthenticated HTTP endpoints (/metrics, /status, /healthz, /readyz).
    /// Loopback by default: /status names every Service, endpoint and allocation, so only the
    /// node itself (`nodelb status`) may read it. Anything else exposes that to whoever can
    /// reach the address.
    #[arg(long, default_value = "127.0.0.1:9470", env = "NODELB_HTTP_ADDR")]
    pub http_addr: SocketAddr,
    /// Address of /healthz and /readyz for probes from outside the node (the kubelet's, on the
    /// node address with hostNetwork): the status code only, the reason withheld.
    #[arg(long, default_value = "0.0.0.0:9471", env = "NODELB_HEALTH_ADDR")]
    pub health_addr: SocketAddr,
    /// Address of /metrics over TLS for clients with a bearer token the API server authenticates
    /// and allows `get` on the non-resource URL /metrics (TokenReview + SubjectAccessReview, as
    /// kube-rbac-proxy does). Off by default; Kubernetes mode only.
    #[arg(long, env = "NODELB_METRICS_ADDR")]
    pub metrics_addr: Option<SocketAddr>,
    /// PEM certificate (chain) for --metrics-addr; without it a self-signed one is generated at
    /// start (kept in memory only).
    #[arg(long, env = "NODELB_METRICS_TLS_CERT_FILE", requires = "metrics_tls_key_file")]
    pub metrics_tls_cert_file: Option<PathBuf>,
    /// PEM private key of --metrics-tls-cert-file.
    #[arg(long, env = "NODELB_METRICS_TLS_KEY_FILE", requires = "metrics_tls_cert_file")]
    pub metrics_tls_key_file: Option<PathBuf>,
    /// Audiences a --metrics-addr bearer token must be meant for (the TokenReview's `audiences`,
    /// comma-separated), e.g. `nodelb-metrics`: the scraper then uses a token requested for that
    /// audience (`kubectl create token --audience`, a projected token), which the API server
    /// itself does not accept, so a token seen on a node is no API token. Empty: the API
    /// server's own audiences (any token of the cluster).
    #[arg(long, value_delimiter = ',', env = "NODELB_METRICS_TOKEN_AUDIENCES")]
    pub metrics_token_audiences: Vec<String>,
}

#[derive(Debug, clap::Args)]
pub struct ControllerArgs {
    #[command(flatten)]
    pub policy: PolicyArgs,
    /// This replica's name in leader election (the holder of Lease `nodelb-leader`) and in its
    /// Events. Defaults to $POD_NAME (the downward API's metadata.name), else the host name.
    #[arg(long, env = "POD_NAME")]
    pub identity: Option<String>,
    /// Only node addresses in these CIDRs are published in Service status (comma-separated;
    /// like kube-proxy's --nodeport-addresses). Default: all ExternalIP / InternalIP addresses.
    #[arg(long, value_delimiter = ',', env = "NODELB_NODE_ADDRESSES")]
    pub node_addresses: Vec<ipnet::IpNet>,
    #[command(flatten)]
    pub listen: ListenArgs,
    #[command(flatten)]
    pub kube: KubeArgs,
}

/// Kubernetes mode (`run` without `--manifests`, and `controller`).
#[derive(Debug, Clone, clap::Args)]
pub struct KubeArgs {
    /// Kubeconfig file to use instead of the in-cluster config / $KUBECONFIG / ~/.kube/config.
    #[arg(long, env = "NODELB_KUBECONFIG")]
    pub kubeconfig: Option<PathBuf>,
    /// nodelb's namespace: the leader Lease `nodelb-leader`, the node-port registry and the
    /// per-node Leases live here.
    #[arg(long, default_value = "nodelb-system", env = "POD_NAMESPACE")]
    pub namespace: String,
    /// Duration of the leader and node Leases (renewed every third of it).
    #[arg(long, default_value = "15s", value_parser = humantime::parse_duration, env = "NODELB_LEASE_DURATION")]
    pub lease_duration: Duration,
}

#[derive(Debug, clap::Args)]
pub struct PlanArgs {
    #[command(flatten)]
    pub common: CommonArgs,
    /// Without --manifests: the Services, EndpointSlices and Nodes of the cluster (read once),
    /// planned as the agent of --node-name programs them.
    #[command(flatten)]
    pub kube: KubeArgs,
}

#[derive(Debug, clap::Args)]
pub struct StatusArgs {
    /// Address of a running agent's HTTP endpoint.
    #[arg(long, default_value = "127.0.0.1:9470", env = "NODELB_HTTP_ADDR")]
    pub http_addr: SocketAddr,
    /// Print the raw JSON.
    #[arg(long)]
    pub json: bool,
    /// The whole cluster, from a workstation: per Service its node ports, the nodes that serve it
    /// and why each other node does not; per node its agent (from the API server: Services,
    /// Nodes and the agents' node Leases; read-only, no exec).
    #[arg(long)]
    pub cluster: bool,
    /// With --cluster: kubeconfig file (else $KUBECONFIG, ~/.kube/config, in-cluster).
    #[arg(long, requires = "cluster")]
    pub kubeconfig: Option<PathBuf>,
    /// With --cluster: nodelb's namespace, where the node Leases are.
    #[arg(long, default_value = "nodelb-system", requires = "cluster")]
    pub nodelb_namespace: String,
    /// With --cluster: only Services of this namespace.
    #[arg(short = 'n', long, requires = "cluster")]
    pub namespace: Option<String>,
    /// With --cluster: only the Service of this name.
    #[arg(long, requires = "cluster")]
    pub service: Option<String>,
    /// With --cluster: only this node.
    #[arg(long, requires = "cluster")]
    pub node: Option<String>,
}

fn parse_port_list(s: &str) -> Result<crate::core::decisions::port_policy::PortList, String> {
    s.parse()
}

/// `--node-labels`: label key to value.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct NodeLabels(pub BTreeMap<String, String>);

/// `k=v,k2=v2` with Kubernetes' label syntax: a key is an optional DNS-subdomain prefix and `/`,
/// then a name of at most 63 characters (alphanumeric at both ends, `-_.` inside); a value is
/// empty or such a name. Empty: no labels.
fn parse_node_labels(s: &str) -> Result<NodeLabels, String> {
    fn name_ok(n: &str) -> bool {
        let inner = |c: char| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.');
        n.len() <= 63
            && n.chars().all(inner)
            && n.starts_with(|c: char| c.is_ascii_alphanumeric())
            && n.ends_with(|c: char| c.is_ascii_alphanumeric())
    }
    fn prefix_ok(p: &str) -> bool {
        p.len() <= 253 && p.split('.').all(|l| crate::core::domain::check_dns_label(l).is_ok())
    }
    let mut out = BTreeMap::new();
    for item in s.split(',').map(str::trim).filter(|i| !i.is_empty()) {
        let Some((key, value)) = item.split_once('=') else {
            return Err(format!("{item:?} is not key=value"));
        };
        let (prefix, name) = key.rsplit_once('/').map_or((None, key), |(p, n)| (Some(p), n));
        if !name_ok(name) || prefix.is_some_and(|p| !prefix_ok(p)) {
            return Err(format!("{key:?} is not a label key ([prefix/]name, name at most 63 characters)"));
        }
        if !value.is_empty() && !name_ok(value) {
            return Err(format!("label {key}: {value:?} is not a label value (at most 63 characters)"));
        }
        if out.insert(key.to_string(), value.to_string()).is_some() {
            return Err(format!("label {key} is given twice"));
        }
    }
    Ok(NodeLabels(out))
}

fn parse_nat_shards(s: &str) -> Result<crate::core::ruleset::plan::NatShards, String> {
    use crate::core::ruleset::plan::NatShards;
    match s.parse::<u8>() {
        _ if s == "auto" => Ok(NatShards::Auto),
        Ok(k) if k.is_power_of_two() && k <= crate::core::ruleset::ir::MAX_NAT_SHARDS => {
            Ok(NatShards::Fixed(k))
        }
        _ => Err(format!("invalid nat shard count {s:?}: auto, 1, 2, 4, 8, 16 or 32")),
    }
}

fn parse_mark(s: &str) -> Result<u32, String> {
    let v = match s.strip_prefix("0x").or_else(|| s.strip_prefix("0X")) {
        Some(hex) => u32::from_str_radix(hex, 16),
        None => s.parse(),
    }
    .map_err(|e| format!("invalid mark {s:?}: {e}"))?;
    if v.count_ones() != 1 {
        return Err(format!("mark {s:?} must be a single bit (e.g. 0x4000)"));
    }
    Ok(v)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn as_a_kubectl_plugin_it_is_status_cluster() {
        let line = |args: &[&str]| -> Vec<String> {
            command_line(args.iter().map(std::ffi::OsString::from))
                .iter()
                .map(|a| a.to_string_lossy().into())
                .collect()
        };
        assert_eq!(
            line(&["/usr/local/bin/kubectl-nodelb", "-n", "web"]),
            ["/usr/local/bin/kubectl-nodelb", "status", "--cluster", "-n", "web"]
        );
        assert_eq!(line(&["nodelb", "status"]), ["nodelb", "status"]);
        let cli = Cli::try_parse_from(line(&["kubectl-nodelb", "--json", "--node", "node-2"])).unwrap();
        let Command::Status(s) = cli.command else { panic!("not status") };
        assert!(s.cluster && s.json && s.node.as_deref() == Some("node-2"));
    }

    #[test]
    fn unknown_nodelb_variables_are_named() {
        let names =
            ["NODELB_PORT_RANGE", "NODELB_PROT_RANGE", "NODELB_LOG", "NODELB_HEALTH_ADDR", "PATH", "NODELB_"];
        let got = unknown_env(names.iter().map(|s| s.to_string()));
        assert_eq!(got, ["NODELB_", "NODELB_PROT_RANGE"]);
    }

    #[test]
    fn mark_must_be_one_bit() {
        assert_eq!(parse_mark("0x4000"), Ok(0x4000));
        assert_eq!(parse_mark("16384"), Ok(0x4000));
        assert!(parse_mark("0x6000").unwrap_err().contains("single bit"));
        assert!(parse_mark("zz").unwrap_err().contains("\"zz\""));
    }

    #[test]
    fn nat_shards_are_a_power_of_two_up_to_32() {
        use crate::core::ruleset::plan::NatShards;
        for k in [1u8, 2, 4, 8, 16, 32] {
            assert_eq!(parse_nat_shards(&k.to_string()), Ok(NatShards::Fixed(k)));
        }
        assert_eq!(parse_nat_shards("auto"), Ok(NatShards::Auto));
        for bad in ["0", "3", "64", "-1", "x", "", "Auto"] {
            let e = parse_nat_shards(bad).unwrap_err();
            assert!(
                e.contains(&format!("{bad:?}")) && e.contains("auto, 1, 2, 4, 8, 16 or 32"),
                "{bad}: {e}"
            );
        }
    }

    #[test]
    fn node_labels_parse_as_kubernetes_labels() {
        let ok = |s: &str, want: &[(&str, &str)]| {
            let want = want.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
            assert_eq!(parse_node_labels(s), Ok(NodeLabels(want)), "{s}");
        };
        ok("", &[]);
        ok("zone=a", &[("zone", "a")]);
        ok(
            "zone=a, topology.kubernetes.io/region=eu-1,empty=",
            &[("zone", "a"), ("topology.kubernetes.io/region", "eu-1"), ("empty", "")],
        );
        let bad = |s: &str, why: &str| {
            let e = parse_node_labels(s).unwrap_err();
            assert!(e.contains(why), "{s}: {e}");
        };
        bad("zone", "\"zone\" is not key=value");
        bad("=a", "\"\" is not a label key");
        bad("-zone=a", "\"-zone\" is not a label key");
        bad("Bad_Prefix/zone=a", "\"Bad_Prefix/zone\" is not a label key");
        bad("zone=a b", "label zone: \"a b\" is not a label value");
        bad(&format!("zone={}", "x".repeat(64)), "is not a label value");
        bad("zone=a,zone=b", "label zone is given twice");
    }

    #[test]
    fn cli_parses() {
        use clap::CommandFactory;
        Cli::command().debug_assert();
    }
}
