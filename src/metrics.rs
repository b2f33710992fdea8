//! Prometheus metrics (`/metrics`). Agent-side gauges and counters are updated by the sync loop;
//! per-Service traffic counters are read from the kernel's own rule counters at scrape time
//! (no per-packet work in userspace). Kernel counters restart when a chain is flushed or the table
//! is replaced, so the agent folds the values of chains it is about to flush into a base that is
//! added to what the kernel reports: exported `_total`s only go down when the Service goes away.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex};

use prometheus::core::{Collector, Desc};
use prometheus::proto::{LabelPair, MetricFamily, MetricType};
use prometheus::{
    Gauge, Histogram, HistogramOpts, HistogramVec, IntCounter, IntCounterVec, IntGauge, IntGaugeVec, Opts,
    Registry,
};

use crate::model::{PortId, ServiceKey};
use crate::nft::{Counter, KernelTable, NftClient};

/// What a counter rule counts.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum CounterKind {
    /// New connections DNATed (service chain).
    Connections,
    /// Forwarded packets and bytes, both directions (forward chain).
    Traffic,
    /// New connections dropped by the source-range check (firewall chain).
    Refused,
}

/// One per-Service-port series (both address families summed).
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct SeriesKey {
    pub service: ServiceKey,
    pub port: PortId,
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Totals {
    pub packets: u64,
    pub bytes: u64,
}

/// Which chain's counter belongs to which series, and the folded-in values of counters that the
/// kernel no longer holds.
#[derive(Debug, Default)]
pub struct CounterState {
    pub index: BTreeMap<String, (SeriesKey, CounterKind)>,
    base: BTreeMap<(SeriesKey, CounterKind), Totals>,
}

impl CounterState {
    /// Installs the index of the ruleset just applied; forgets series of Services that are gone.
    pub fn set_index(&mut self, index: BTreeMap<String, (SeriesKey, CounterKind)>) {
        let live: BTreeSet<&(SeriesKey, CounterKind)> = index.values().collect();
        self.base.retain(|k, _| live.contains(k));
        self.index = index;
    }

    /// Adds the kernel's current values of `chains` to the base (they are about to be reset).
    pub fn fold(
        &mut self,
        table: &KernelTable,
        chains: &BTreeSet<String>,
        index: &BTreeMap<String, (SeriesKey, CounterKind)>,
    ) {
        for (name, k) in &table.counters {
            if !chains.contains(name) {
                continue;
            }
            if let Some(key) = index.get(name).or_else(|| self.index.get(name)) {
                let t = self.base.entry(key.clone()).or_default();
                t.packets += k.counter.packets;
                t.bytes += k.counter.bytes;
            }
        }
    }

    /// Base + kernel values per series. Series in the index with no kernel counter yet are 0.
    pub fn totals(&self, table: Option<&KernelTable>) -> BTreeMap<(SeriesKey, CounterKind), Totals> {
        let mut out: BTreeMap<(SeriesKey, CounterKind), Totals> =
            self.index.values().map(|k| (k.clone(), self.base.get(k).copied().unwrap_or_default())).collect();
        if let Some(table) = table {
            for (name, k) in &table.counters {
                let Counter { packets, bytes } = k.counter;
                if let Some(key) = self.index.get(name)
                    && let Some(t) = out.get_mut(key)
                {
                    t.packets += packets;
                    t.bytes += bytes;
                }
            }
        }
        out
    }
}

pub type SharedCounters = Arc<Mutex<CounterState>>;

/// Every metric the agent exports.
pub struct Metrics {
    pub registry: Registry,
    pub services: IntGaugeVec,
    pub service_ports: IntGauge,
    pub endpoints: IntGauge,
    pub allocations: IntGauge,
    pub free_ports: IntGauge,
    pub sync_duration: HistogramVec,
    pub last_success: Gauge,
    pub syncs: IntCounterVec,
    pub sync_failures: IntCounterVec,
    pub batch_messages: Histogram,
    pub repairs: IntCounter,
    pub forwarding: IntGaugeVec,
    pub family_served: IntGaugeVec,
    pub manifest_problems: IntGauge,
    /// 1 while this agent holds the leader Lease (Kubernetes mode).
    pub leader: IntGauge,
    pub leader_transitions: IntCounter,
    pub watch_errors: IntCounterVec,
    pub watch_restarts: IntCounterVec,
    pub api_errors: IntCounterVec,
    pub counters: SharedCounters,
}

#[derive(Debug, thiserror::Error)]
#[error("registering metric: {0}")]
pub struct MetricsError(#[from] prometheus::Error);

impl Metrics {
    /// `per_service`: export per-Service-port series read from the kernel (off on huge clusters).
    pub fn new(per_service: bool) -> Result<Metrics, MetricsError> {
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
        let endpoints =
            IntGauge::new("nodelb_endpoints", "Endpoints usable on this node, summed over Service ports.")?;
        let allocations = IntGauge::new(
            "nodelb_port_allocations",
            "Node port numbers allocated to Services (all ranges).",
        )?;
        let free_ports = IntGauge::new("nodelb_port_range_free", "Node ports still free in --port-range.")?;
        let sync_duration = HistogramVec::new(
            HistogramOpts::new(
                "nodelb_sync_duration_seconds",
                "Time to compute the desired ruleset and apply it in one netlink batch.",
            )
            .buckets(vec![0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0]),
            &["kind"],
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
                "Failed syncs by reason (netlink, manifests, state_file, kernel_read).",
            ),
            &["reason"],
        )?;
        let batch_messages = Histogram::with_opts(
            HistogramOpts::new("nodelb_netlink_batch_messages", "Netlink messages per nftables batch sent.")
                .buckets(vec![1.0, 5.0, 10.0, 50.0, 100.0, 500.0, 1000.0, 5000.0, 10000.0, 50000.0]),
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
        let leader = IntGauge::new(
            "nodelb_leader",
            "1 while this agent is the leader (allocates node ports, writes Service status); Kubernetes mode.",
        )?;
        let watch_errors = IntCounterVec::new(
            Opts::new(
                "nodelb_watch_errors_total",
                "Kubernetes list/watch failures per resource (retried with backoff; caches keep their last view).",
            ),
            &["resource"],
        )?;
        let watch_restarts = IntCounterVec::new(
            Opts::new(
                "nodelb_watch_restarts_total",
                "Kubernetes watches that recovered after failing, per resource (relist or resumed watch).",
            ),
            &["resource"],
        )?;
        let api_errors = IntCounterVec::new(
            Opts::new(
                "nodelb_api_errors_total",
                "Failed Kubernetes API writes/reads outside the watches, by operation (lease, node_lease, service, event).",
            ),
            &["operation"],
        )?;
        let leader_transitions = IntCounter::new(
            "nodelb_leader_transitions_total",
            "Times this agent became or stopped being the leader.",
        )?;
        let build_info = IntGaugeVec::new(
            Opts::new("nodelb_build_info", "Build of the running agent (value is always 1)."),
            &["version", "git_commit"],
        )?;
        // Known label values start at 0, so dashboards and alerts see the series before the first event.
        for reason in ["netlink", "manifests", "state_file"] {
            sync_failures.with_label_values(&[reason]).reset();
        }
        for resource in ["Service", "EndpointSlice", "Node", "Lease"] {
            watch_errors.with_label_values(&[resource]).reset();
            watch_restarts.with_label_values(&[resource]).reset();
        }
        for operation in ["lease", "node_lease", "service", "event"] {
            api_errors.with_label_values(&[operation]).reset();
        }
        for family in ["ipv4", "ipv6"] {
            forwarding.with_label_values(&[family]).set(0);
            family_served.with_label_values(&[family]).set(0);
        }
        build_info
            .with_label_values(&[
                env!("CARGO_PKG_VERSION"),
                option_env!("NODELB_GIT_COMMIT").unwrap_or("unknown"),
            ])
            .set(1);

        registry.register(Box::new(services.clone()))?;
        registry.register(Box::new(service_ports.clone()))?;
        registry.register(Box::new(endpoints.clone()))?;
        registry.register(Box::new(allocations.clone()))?;
        registry.register(Box::new(free_ports.clone()))?;
        registry.register(Box::new(sync_duration.clone()))?;
        registry.register(Box::new(last_success.clone()))?;
        registry.register(Box::new(syncs.clone()))?;
        registry.register(Box::new(sync_failures.clone()))?;
        registry.register(Box::new(batch_messages.clone()))?;
        registry.register(Box::new(repairs.clone()))?;
        registry.register(Box::new(forwarding.clone()))?;
        registry.register(Box::new(family_served.clone()))?;
        registry.register(Box::new(manifest_problems.clone()))?;
        registry.register(Box::new(leader.clone()))?;
        registry.register(Box::new(leader_transitions.clone()))?;
        registry.register(Box::new(watch_errors.clone()))?;
        registry.register(Box::new(watch_restarts.clone()))?;
        registry.register(Box::new(api_errors.clone()))?;
        registry.register(Box::new(build_info))?;
        registry.register(Box::new(prometheus::process_collector::ProcessCollector::for_self()))?;
        let counters: SharedCounters = Arc::default();
        if per_service {
            registry.register(Box::new(KernelCounters::new(counters.clone())?))?;
        }
        Ok(Metrics {
            registry,
            services,
            service_ports,
            endpoints,
            allocations,
            free_ports,
            sync_duration,
            last_success,
            syncs,
            sync_failures,
            batch_messages,
            repairs,
            forwarding,
            family_served,
            manifest_problems,
            leader,
            leader_transitions,
            watch_errors,
            watch_restarts,
            api_errors,
            counters,
        })
    }

    /// The text exposition. Blocking: reads the kernel's counters over netlink.
    pub fn render(&self) -> String {
        let families = self.registry.gather();
        prometheus::TextEncoder::new()
            .encode_to_string(&families)
            .unwrap_or_else(|e| format!("# encoding failed: {e}\n"))
    }
}

const CONNECTIONS: &str = "nodelb_service_connections_total";
const PACKETS: &str = "nodelb_service_packets_total";
const BYTES: &str = "nodelb_service_bytes_total";
const REFUSED: &str = "nodelb_service_refused_packets_total";
const SERIES_LABELS: [&str; 4] = ["namespace", "service", "port", "protocol"];

/// Reads the kernel's rule counters of table inet nodelb at scrape time.
struct KernelCounters {
    state: SharedCounters,
    descs: Vec<Desc>,
}

impl KernelCounters {
    fn new(state: SharedCounters) -> Result<KernelCounters, prometheus::Error> {
        let labels: Vec<String> = SERIES_LABELS.iter().map(|s| s.to_string()).collect();
        let desc =
            |name: &str, help: &str| Desc::new(name.into(), help.into(), labels.clone(), Default::default());
        Ok(KernelCounters {
            state,
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
                    "New connections dropped because the client is outside loadBalancerSourceRanges (kernel rule counter).",
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
        // A failed read exports the folded base only rather than nothing.
        let table = NftClient::new().and_then(|mut c| c.read_table()).ok().flatten();
        let totals = match self.state.lock() {
            Ok(st) => st.totals(table.as_ref()),
            Err(p) => p.into_inner().totals(table.as_ref()),
        };
        let mut families: BTreeMap<&str, Vec<prometheus::proto::Metric>> = BTreeMap::new();
        for name in [CONNECTIONS, PACKETS, BYTES, REFUSED] {
            families.insert(name, vec![]);
        }
        for ((key, kind), t) in totals {
            let values: Vec<(&str, u64)> = match kind {
                CounterKind::Connections => vec![(CONNECTIONS, t.packets)],
                CounterKind::Traffic => vec![(PACKETS, t.packets), (BYTES, t.bytes)],
                CounterKind::Refused => vec![(REFUSED, t.packets)],
            };
            for (name, v) in values {
                families.entry(name).or_default().push(counter_metric(&key, v));
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
        label("namespace", key.service.namespace.clone()),
        label("service", key.service.name.clone()),
        label("port", key.port.port.to_string()),
        label("protocol", key.port.protocol.k8s_name().to_string()),
    ]);
    let mut c = prometheus::proto::Counter::default();
    c.set_value(value as f64);
    m.set_counter(c);
    m
}
