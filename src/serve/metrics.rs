//! Prometheus metrics (`/metrics`). Agent-side gauges and counters are updated by the sync loop;
//! per-Service traffic counters are read from the kernel's named counter objects at scrape time
//! (one object dump; no per-packet work in userspace) through the [`ReadCounters`] the caller
//! hands in (the apply layer's netlink read: this module does no I/O of its own), plus the totals
//! of counters that batches reset ([`crate::core::reports::counters`]). The sync loop holds the
//! [`CounterState`] lock from reading the counters before a batch until the base is folded after
//! it, and a scrape holds it while it reads the kernel, so a scrape sees the kernel and the base
//! of the same side of a batch.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use prometheus::core::{Collector, Desc};
use prometheus::proto::{LabelPair, MetricFamily, MetricType};
use prometheus::{
    Gauge, Histogram, HistogramOpts, HistogramVec, IntCounter, IntCounterVec, IntGauge, IntGaugeVec, Opts,
    Registry,
};

use crate::core::reports::counters::{CounterKind, CounterState, CounterValues, Series, SeriesKey, Totals};
use crate::core::ruleset::ir::Name;
pub use crate::k8s::metrics::KubeMetrics;

pub type SharedCounters = Arc<Mutex<CounterState>>;

/// Reads the kernel's named counters now (`None`: the read failed): the apply layer's netlink
/// read, handed in by whoever builds the metrics, so that telemetry does no I/O of its own.
pub type ReadCounters = Arc<dyn Fn(&[&Name]) -> Option<CounterValues> + Send + Sync>;

/// The `reason` label values of `nodelb_sync_failures_total`.
pub const SYNC_FAILURE_REASONS: [&str; 4] = ["netlink", "kernel_read", "manifests", "state_file"];

/// Every metric the agent exports.
pub struct Metrics {
    pub registry: Registry,
    pub services: IntGaugeVec,
    pub service_ports: IntGauge,
    pub nat_shard_tables: IntGauge,
    pub endpoints: IntGauge,
    pub allocations: IntGauge,
    pub free_ports: IntGauge,
    pub pool_ports: IntGaugeVec,
    pub sync_duration: HistogramVec,
    /// kube-proxy's SLI: from an EndpointSlice change's trigger time to its rules in the kernel.
    pub network_programming_duration: Histogram,
    pub last_success: Gauge,
    pub syncs: IntCounterVec,
    pub sync_failures: IntCounterVec,
    pub batch_messages: Histogram,
    pub batch_bytes: Histogram,
    pub repairs: IntCounter,
    pub forwarding: IntGaugeVec,
    pub family_served: IntGaugeVec,
    pub manifest_problems: IntGauge,
    pub kube: KubeMetrics,
    /// Endpoint addresses refused by the endpoint policy, by reason.
    pub endpoints_refused: IntGaugeVec,
    /// Service ports whose node port this node does not take, by reason.
    pub node_ports_refused: IntGaugeVec,
    /// Per-Service-port series are exported (`--per-service-metrics`); when off, the sync loop
    /// builds no counter index and reads no kernel counters.
    pub per_service: bool,
    pub counters: SharedCounters,
    /// The kernel's counters as scrapes and `/status` read them (one read shared).
    pub totals: Arc<TotalsReader>,
    pub firewall: FirewallMetrics,
}

/// What the host-firewall check found (`crate::apply::firewall`).
pub struct FirewallMetrics {
    /// 1 per foreign forward chain that drops nodelb's connections of a family.
    pub drops: IntGaugeVec,
    /// 1 when a family's forwarded connections are dropped for certain (not served).
    pub blocked: IntGaugeVec,
    /// 1 when only the counters say a family's connections are dropped.
    pub evidence: IntGaugeVec,
    /// 1 per iptables FORWARD chain holding nodelb's ACCEPT.
    pub accept: IntGaugeVec,
    /// Label sets of `drops` and `accept` currently exported.
    pub exported: Mutex<(LabelSets, LabelSets)>,
}

/// The label values of the series of one metric vector.
pub type LabelSets = BTreeSet<Vec<String>>;

impl FirewallMetrics {
    fn register(registry: &Registry) -> Result<FirewallMetrics, prometheus::Error> {
        let drops = IntGaugeVec::new(
            Opts::new(
                "nodelb_host_firewall_drops",
                "1 per foreign forward chain that drops nodelb's new connections of a family (table: \"ip filter\", \"inet firewalld\", \"iptables-legacy filter\", …; certain: every connection, or unless a rule nodelb cannot judge accepts it).",
            ),
            &["family", "table", "chain", "certain"],
        )?;
        let blocked = IntGaugeVec::new(
            Opts::new(
                "nodelb_forward_blocked",
                "1 when a host firewall drops this family's forwarded connections for certain: the node does not serve the family.",
            ),
            &["family"],
        )?;
        let evidence = IntGaugeVec::new(
            Opts::new(
                "nodelb_forward_drop_evidence",
                "1 when nodelb's forward counters show new connections entering the forward path and none leaving it, with no chain nodelb can read to blame.",
            ),
            &["family"],
        )?;
        let accept = IntGaugeVec::new(
            Opts::new(
                "nodelb_iptables_forward_accept",
                "1 per iptables FORWARD chain holding nodelb's ACCEPT (--iptables-forward-accept).",
            ),
            &["family", "table"],
        )?;
        for f in ["ipv4", "ipv6"] {
            blocked.with_label_values(&[f]).set(0);
            evidence.with_label_values(&[f]).set(0);
        }
        registry.register(Box::new(drops.clone()))?;
        registry.register(Box::new(blocked.clone()))?;
        registry.register(Box::new(evidence.clone()))?;
        registry.register(Box::new(accept.clone()))?;
        Ok(FirewallMetrics { drops, blocked, evidence, accept, exported: Mutex::default() })
    }

    /// Sets `drops` (label values: family, table, chain, certain) and `accept` (family, table)
    /// to exactly these series, removing those that are gone.
    pub fn set_chains(&self, drops: LabelSets, accept: LabelSets) {
        let mut exported = crate::locks::lock(&self.exported);
        for (vec, now, before) in [(&self.drops, &drops, &exported.0), (&self.accept, &accept, &exported.1)] {
            for gone in before.difference(now) {
                let labels: Vec<&str> = gone.iter().map(String::as_str).collect();
                let _ = vec.remove_label_values(&labels);
            }
            for series in now {
                let labels: Vec<&str> = series.iter().map(String::as_str).collect();
                vec.with_label_values(&labels).set(1);
            }
        }
        *exported = (drops, accept);
    }
}

#[derive(Debug, thiserror::Error)]
#[error("registering metric: {0}")]
pub struct MetricsError(#[from] prometheus::Error);

impl Metrics {
    /// `per_service`: export per-Service-port series read from the kernel (off on huge clusters),
    /// through `read_counters` at scrape time.
    pub fn new(per_service: bool, read_counters: ReadCounters) -> Result<Metrics, MetricsError> {
        let registry = Registry::new();
        let services = IntGaugeVec::new(
            Opts::new(
                "nodelb_services",
                "Services by state on this node: programmed, no-endpoints (clients are refused), refused (not programmed; reason says why).",
            ),
            &["state", "reason"],
        )?;
        let service_ports =
            IntGauge::new("nodelb_service_ports", "Service ports with an allocated node port on this node.")?;
        let nat_shard_tables = IntGauge::new(
            "nodelb_nat_shard_tables",
            "Tables the Services' nat chains are spread over (--nat-shards); 1: all in table nodelb.",
        )?;
        let endpoints =
            IntGauge::new("nodelb_endpoints", "Endpoints usable on this node, summed over Service ports.")?;
        let allocations = IntGauge::new(
            "nodelb_port_allocations",
            "Node port numbers allocated to Services (all ranges).",
        )?;
        let free_ports = IntGauge::new("nodelb_port_range_free", "Node ports still free in --port-range.")?;
        let pool_ports = IntGaugeVec::new(
            Opts::new(
                "nodelb_pool_ports",
                "Node port numbers of each NodePortPool in force: allocated (held by its Services) and free (left in its ranges for new allocations; none while draining).",
            ),
            &["pool", "state"],
        )?;
        let sync_duration = HistogramVec::new(
            HistogramOpts::new(
                "nodelb_sync_duration_seconds",
                "Time to compute the desired ruleset and apply it in one netlink batch.",
            )
            .buckets(vec![0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0]),
            &["kind"],
        )?;
        let network_programming_duration = Histogram::with_opts(
            HistogramOpts::new(
                "nodelb_network_programming_duration_seconds",
                "Time from an EndpointSlice change (its endpoints.kubernetes.io/last-change-trigger-time, set by the EndpointSlice controller) to this node's rules for it in the kernel, as kube-proxy's network_programming_duration_seconds (Kubernetes mode; changes of Services this node programs).",
            )
            .buckets(vec![0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0]),
        )?;
        let last_success = Gauge::new(
            "nodelb_last_successful_sync_timestamp_seconds",
            "Unix time of the last sync whose netlink batch the kernel accepted.",
        )?;
        let syncs = IntCounterVec::new(
            Opts::new(
                "nodelb_syncs_total",
                "Syncs by kind (full: table replaced atomically; incremental: diff) and result.",
            ),
            &["kind", "result"],
        )?;
        let sync_failures = IntCounterVec::new(
            Opts::new(
                "nodelb_sync_failures_total",
                "Failed syncs by reason: netlink (the kernel refused the batch), kernel_read (reading the ruleset generation or table back failed), manifests (the manifests could not be read), state_file (the allocations could not be saved).",
            ),
            &["reason"],
        )?;
        let batch_messages = Histogram::with_opts(
            HistogramOpts::new("nodelb_netlink_batch_messages", "Netlink messages per nftables batch sent.")
                .buckets(vec![1.0, 5.0, 10.0, 50.0, 100.0, 500.0, 1000.0, 5000.0, 10000.0, 50000.0]),
        )?;
        // A batch is one datagram, in the agent's memory whole while the kernel takes it: a full
        // replace's is the agent's largest allocation (docs/benchmarks.md, "Memory").
        let batch_bytes = Histogram::with_opts(
            HistogramOpts::new(
                "nodelb_netlink_batch_bytes",
                "Bytes per nftables batch sent (one datagram, held in memory whole while the kernel takes it).",
            )
            .buckets(vec![1e3, 1e4, 1e5, 1e6, 1e7, 3e7, 1e8, 3e8]),
        )?;
        let repairs = IntCounter::new(
            "nodelb_table_repairs_total",
            "Times table inet nodelb was found changed behind the agent's back and replaced.",
        )?;
        let forwarding = IntGaugeVec::new(
            Opts::new(
                "nodelb_forwarding_enabled",
                "1 when the family's forwarding sysctl is on (net.ipv4.ip_forward, net.ipv6.conf.all.forwarding).",
            ),
            &["family"],
        )?;
        let family_served = IntGaugeVec::new(
            Opts::new("nodelb_family_served", "1 when the agent programs this address family on this node."),
            &["family"],
        )?;
        let manifest_problems = IntGauge::new(
            "nodelb_manifest_problems",
            "Manifest files or documents that could not be used (manifests mode).",
        )?;
        // Known label values start at 0, so dashboards and alerts see the series before the first event.
        for reason in SYNC_FAILURE_REASONS {
            sync_failures.with_label_values(&[reason]).reset();
        }
        for family in ["ipv4", "ipv6"] {
            forwarding.with_label_values(&[family]).set(0);
            family_served.with_label_values(&[family]).set(0);
        }

        registry.register(Box::new(services.clone()))?;
        registry.register(Box::new(service_ports.clone()))?;
        registry.register(Box::new(nat_shard_tables.clone()))?;
        registry.register(Box::new(endpoints.clone()))?;
        registry.register(Box::new(allocations.clone()))?;
        registry.register(Box::new(free_ports.clone()))?;
        registry.register(Box::new(pool_ports.clone()))?;
        registry.register(Box::new(sync_duration.clone()))?;
        registry.register(Box::new(network_programming_duration.clone()))?;
        registry.register(Box::new(last_success.clone()))?;
        registry.register(Box::new(syncs.clone()))?;
        registry.register(Box::new(sync_failures.clone()))?;
        registry.register(Box::new(batch_messages.clone()))?;
        registry.register(Box::new(batch_bytes.clone()))?;
        registry.register(Box::new(repairs.clone()))?;
        registry.register(Box::new(forwarding.clone()))?;
        registry.register(Box::new(family_served.clone()))?;
        registry.register(Box::new(manifest_problems.clone()))?;
        let kube = KubeMetrics::register(&registry, &crate::k8s::source::KINDS, &["node_lease", "event"])?;
        let endpoints_refused = IntGaugeVec::new(
            Opts::new(
                "nodelb_endpoints_refused",
                "Endpoint addresses named by Services that this node does not DNAT to (loopback, link-local, cloud metadata, a node's own address, outside --endpoint-cidrs, ...), by reason.",
            ),
            &["reason"],
        )?;
        for reason in crate::core::decisions::endpoint_policy::REASON_CODES {
            endpoints_refused.with_label_values(&[reason]).set(0);
        }
        let node_ports_refused = IntGaugeVec::new(
            Opts::new(
                "nodelb_node_ports_refused",
                "Service ports whose node port this node does not take: not_allowed (outside --port-range and --allowed-node-ports), in_use (a process on the node listens on it), not_selected (its pool does not serve it here), not_recorded (the node-port registry does not give the number to the Service).",
            ),
            &["reason"],
        )?;
        for reason in ["not_allowed", "in_use", "not_selected", "not_recorded"] {
            node_ports_refused.with_label_values(&[reason]).set(0);
        }
        registry.register(Box::new(endpoints_refused.clone()))?;
        registry.register(Box::new(node_ports_refused.clone()))?;
        register_build_info(&registry)?;
        let firewall = FirewallMetrics::register(&registry)?;
        let counters: SharedCounters = Arc::default();
        let totals = Arc::new(TotalsReader::new(counters.clone(), read_counters));
        if per_service {
            registry.register(Box::new(KernelCounters::new(totals.clone())?))?;
        }
        Ok(Metrics {
            registry,
            services,
            service_ports,
            nat_shard_tables,
            endpoints,
            allocations,
            free_ports,
            pool_ports,
            sync_duration,
            network_programming_duration,
            last_success,
            syncs,
            sync_failures,
            batch_messages,
            batch_bytes,
            repairs,
            forwarding,
            family_served,
            manifest_problems,
            kube,
            endpoints_refused,
            node_ports_refused,
            per_service,
            counters,
            totals,
            firewall,
        })
    }

    /// The text exposition. Blocking: reads the kernel's counters (`ReadCounters`).
    pub fn render(&self) -> String {
        let families = self.registry.gather();
        prometheus::TextEncoder::new()
            .encode_to_string(&families)
            .unwrap_or_else(|e| format!("# encoding failed: {e}\n"))
    }
}

/// What renders as a Prometheus text exposition: the node agent's metrics, the controller's.
pub trait Exposition: Send + Sync + 'static {
    /// The text exposition. Blocking (the node's reads the kernel's counters).
    fn render(&self) -> String;
}

impl Exposition for Metrics {
    fn render(&self) -> String {
        Metrics::render(self)
    }
}

/// `nodelb_build_info` and the process collector, which both workloads export.
fn register_build_info(registry: &Registry) -> prometheus::Result<()> {
    let build_info = IntGaugeVec::new(
        Opts::new("nodelb_build_info", "Build of the running agent or controller (value is always 1)."),
        &["version", "git_commit"],
    )?;
    build_info
        .with_label_values(&[
            env!("CARGO_PKG_VERSION"),
            option_env!("NODELB_GIT_COMMIT").unwrap_or("unknown"),
        ])
        .set(1);
    registry.register(Box::new(build_info))?;
    registry.register(Box::new(prometheus::process_collector::ProcessCollector::for_self()))?;
    Ok(())
}

/// Every metric the controller exports: leadership and the API's failures.
pub struct ControllerMetrics {
    pub registry: Registry,
    /// 1 while this replica holds the leader Lease.
    pub leader: IntGauge,
    pub leader_transitions: IntCounter,
    pub kube: KubeMetrics,
}

impl ControllerMetrics {
    pub fn new() -> prometheus::Result<ControllerMetrics> {
        let registry = Registry::new();
        let leader = IntGauge::new(
            "nodelb_leader",
            "1 while this controller replica is the leader (allocates node ports, writes Service status).",
        )?;
        let leader_transitions = IntCounter::new(
            "nodelb_leader_transitions_total",
            "Times this controller replica became or stopped being the leader.",
        )?;
        registry.register(Box::new(leader.clone()))?;
        registry.register(Box::new(leader_transitions.clone()))?;
        let kube = KubeMetrics::register(
            &registry,
            &crate::k8s::source::KINDS,
            &["lease", "service", "registry", "nodeportpool", "event"],
        )?;
        register_build_info(&registry)?;
        Ok(ControllerMetrics { registry, leader, leader_transitions, kube })
    }
}

impl Exposition for ControllerMetrics {
    fn render(&self) -> String {
        prometheus::TextEncoder::new()
            .encode_to_string(&self.registry.gather())
            .unwrap_or_else(|e| format!("# encoding failed: {e}\n"))
    }
}

const CONNECTIONS: &str = "nodelb_service_connections_total";
const PACKETS: &str = "nodelb_service_packets_total";
const BYTES: &str = "nodelb_service_bytes_total";
const REFUSED: &str = "nodelb_service_refused_packets_total";
const SERIES_LABELS: [&str; 4] = ["namespace", "service", "port", "protocol"];

/// Every per-Service-port series with its total now: the kernel's named counters (`read`), plus
/// what earlier batches reset. Blocking. The lock is held across the read, so no batch (and its
/// fold) happens in between. A failed read gives no series at all (the base alone would look like
/// a counter reset); no table (deleted behind our back) does hold 0.
fn read_totals(state: &SharedCounters, read: &ReadCounters) -> BTreeMap<Series, Totals> {
    let st = crate::locks::lock(state);
    let names: Vec<&Name> = st.counter_names().collect();
    match read(&names) {
        Some(kernel) => st.totals(&kernel),
        None => BTreeMap::new(),
    }
}

/// Every per-Service-port series with its total.
pub type AllTotals = BTreeMap<Series, Totals>;

/// [`read_totals`] shared: one kernel read at a time, its result handed to every request that
/// came while it ran. A dump of the counter objects is quadratic in the kernel (each step of a
/// netlink dump walks the objects from the first): with many Services it keeps a core busy long.
/// Without this, clients that gave up and asked again pile up blocking reads that each dump every
/// counter, queued on the counter lock the sync loop takes too (docs/benchmarks.md, "Counter
/// reads and the tamper check"). A request that comes after a read ended reads again: a scrape
/// after traffic sees it.
/// Blocking.
pub struct TotalsReader {
    state: SharedCounters,
    read: ReadCounters,
    /// The last read: when it ended, and what it gave.
    last: Mutex<Option<(Instant, Arc<AllTotals>)>>,
}

impl TotalsReader {
    pub fn new(state: SharedCounters, read: ReadCounters) -> TotalsReader {
        TotalsReader { state, read, last: Mutex::new(None) }
    }

    /// Every per-Service-port series with its total, read by this request or by the read that
    /// ran when it came.
    pub fn read(&self) -> Arc<AllTotals> {
        self.read_asked_at(Instant::now())
    }

    fn read_asked_at(&self, asked: Instant) -> Arc<AllTotals> {
        let mut last = crate::locks::lock(&self.last);
        if let Some((ended, totals)) = &*last
            && *ended > asked
        {
            return totals.clone();
        }
        let totals = Arc::new(read_totals(&self.state, &self.read));
        *last = Some((Instant::now(), totals.clone()));
        totals
    }
}

/// Reads the kernel's rule counters of table inet nodelb at scrape time.
struct KernelCounters {
    totals: Arc<TotalsReader>,
    descs: Vec<Desc>,
}

impl KernelCounters {
    fn new(totals: Arc<TotalsReader>) -> Result<KernelCounters, prometheus::Error> {
        let labels: Vec<String> = SERIES_LABELS.iter().map(|s| s.to_string()).collect();
        let desc =
            |name: &str, help: &str| Desc::new(name.into(), help.into(), labels.clone(), Default::default());
        Ok(KernelCounters {
            totals,
            descs: vec![
                desc(
                    CONNECTIONS,
                    "New connections to the Service port DNATed on this node (kernel rule counter).",
                )?,
                desc(
                    PACKETS,
                    "Packets of the Service port's connections forwarded by this node, both directions (kernel rule counter).",
                )?,
                desc(
                    BYTES,
                    "Bytes of the Service port's connections forwarded by this node, both directions (kernel rule counter).",
                )?,
                desc(
                    REFUSED,
                    "Packets of new connections dropped because the client is outside loadBalancerSourceRanges; every retransmitted SYN counts again (kernel rule counter).",
                )?,
            ],
        })
    }
}

impl Collector for KernelCounters {
    fn desc(&self) -> Vec<&Desc> {
        self.descs.iter().collect()
    }

    fn collect(&self) -> Vec<MetricFamily> {
        let totals = self.totals.read();
        let mut families: BTreeMap<&str, Vec<prometheus::proto::Metric>> = BTreeMap::new();
        for name in [CONNECTIONS, PACKETS, BYTES, REFUSED] {
            families.insert(name, vec![]);
        }
        for ((key, kind), t) in totals.iter() {
            let values: Vec<(&str, u64)> = match kind {
                CounterKind::Connections => vec![(CONNECTIONS, t.packets)],
                CounterKind::Traffic => vec![(PACKETS, t.packets), (BYTES, t.bytes)],
                CounterKind::Refused => vec![(REFUSED, t.packets)],
            };
            for (name, v) in values {
                families.entry(name).or_default().push(counter_metric(key, v));
            }
        }
        self.descs
            .iter()
            .map(|d| {
                let mut mf = MetricFamily::default();
                mf.set_name(d.fq_name.clone());
                mf.set_help(d.help.clone());
                mf.set_field_type(MetricType::COUNTER);
                mf.set_metric(families.remove(d.fq_name.as_str()).unwrap_or_default());
                mf
            })
            .collect()
    }
}

fn counter_metric(key: &SeriesKey, value: u64) -> prometheus::proto::Metric {
    let label = |name: &str, value: String| {
        let mut l = LabelPair::default();
        l.set_name(name.into());
        l.set_value(value);
        l
    };
    let mut m = prometheus::proto::Metric::default();
    m.set_label(vec![
        label("namespace", key.service.namespace.to_string()),
        label("service", key.service.name.to_string()),
        label("port", key.port.port.to_string()),
        label("protocol", key.port.protocol.k8s_name().to_string()),
    ]);
    let mut c = prometheus::proto::Counter::default();
    c.set_value(value as f64);
    m.set_counter(c);
    m
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    /// A request that came while a read ran takes its result; one that comes after it ended
    /// reads again. (The read itself finds no table here: what is shared is what is tested.)
    #[test]
    fn one_read_answers_the_requests_that_came_while_it_ran() {
        let reader = TotalsReader::new(SharedCounters::default(), Arc::new(|_: &[&Name]| None));
        let asked = Instant::now();
        let ran = Arc::new(AllTotals::new());
        *reader.last.lock().unwrap() = Some((asked + Duration::from_millis(5), ran.clone()));
        assert!(Arc::ptr_eq(&reader.read_asked_at(asked), &ran), "came while it ran");
        let after = reader.read_asked_at(asked + Duration::from_millis(10));
        assert!(!Arc::ptr_eq(&after, &ran), "came after it ended: read again");
        assert!(!Arc::ptr_eq(&reader.read(), &after), "the next request reads again");
    }
}
