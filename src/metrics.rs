//! Prometheus metrics (`/metrics`). Agent-side gauges and counters are updated by the sync loop;
//! per-Service traffic counters are read from the kernel's named counter objects at scrape time
//! (one object dump; no per-packet work in userspace). A named counter keeps counting while the
//! rules that use it are replaced; it restarts only when the table is replaced (start, repair,
//! after a failure) and is gone while its Service port is not programmed (no node port,
//! forwarding off). So the agent folds the values of counters a batch deletes into a base that is
//! added to what the kernel reports: an exported `_total` never goes down, and its series goes
//! away only with its Service port. The sync loop holds the [`CounterState`] lock from reading
//! the counters before a batch until the base is folded after it, and a scrape holds it while it
//! reads the kernel, so a scrape sees the kernel and the base of the same side of a batch.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex};

use prometheus::core::{Collector, Desc};
use prometheus::proto::{LabelPair, MetricFamily, MetricType};
use prometheus::{
    Gauge, Histogram, HistogramOpts, HistogramVec, IntCounter, IntCounterVec, IntGauge, IntGaugeVec, Opts,
    Registry,
};

use crate::model::{PortId, ServiceKey};
use crate::nft::{Counter, CounterValues, NftClient};

/// What a counter rule counts.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum CounterKind {
    /// New connections DNATed (counted in the service chain).
    Connections,
    /// Forwarded packets and bytes, both directions (counted in filter-forward-last).
    Traffic,
    /// Packets of new connections dropped by the source-range check (firewall chain).
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

pub type Series = (SeriesKey, CounterKind);

/// Which kernel counter feeds which series, and which Service ports exist; computed with the
/// desired state (`desired::compute_with`). Counters are named opaquely: the sync loop only
/// matches these names against what the kernel reports and what a batch resets.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct CounterIndex {
    /// Named counter in the kernel → the series it feeds.
    pub counters: BTreeMap<String, Series>,
    /// Every Service port of the valid Services. A series of one of these stays exported with its
    /// total while no counter feeds it; a series goes when its Service port goes.
    pub ports: BTreeSet<SeriesKey>,
}

/// The index of the ruleset in the kernel, and every exported series with the folded-in values
/// of counters that the kernel no longer holds.
#[derive(Debug, Default)]
pub struct CounterState {
    index: BTreeMap<String, Series>,
    /// Exactly the exported series.
    base: BTreeMap<Series, Totals>,
}

impl CounterState {
    /// Counters (of the installed index or of `next`) that feed a series still exported once
    /// `next` is installed: their values must be read before a batch resets them. A Service port
    /// that goes away takes its series with it, so its counters need no read (at 1,000 Services ×
    /// 5 endpoints, reading the table costs ~40 ms of a removal's reaction time).
    pub fn kept_counters(&self, next: &CounterIndex) -> BTreeSet<String> {
        self.index
            .iter()
            .chain(&next.counters)
            .filter(|(_, (key, _))| next.ports.contains(key))
            .map(|(name, _)| name.clone())
            .collect()
    }

    /// Adds the values `table` holds for the counters in `resetting` to the base of their series
    /// (a batch resets them).
    pub fn fold(&mut self, kernel: &CounterValues, resetting: &BTreeSet<String>, next: &CounterIndex) {
        for (name, &c) in kernel {
            if !resetting.contains(name) {
                continue;
            }
            if let Some(series) = next.counters.get(name).or_else(|| self.index.get(name)) {
                let t = self.base.entry(series.clone()).or_default();
                t.packets += c.packets;
                t.bytes += c.bytes;
            }
        }
    }

    /// Installs the index of the ruleset just applied: series of Service ports that are gone are
    /// forgotten, the others keep their totals, new counters start new series.
    pub fn install(&mut self, next: CounterIndex) {
        self.base.retain(|(key, _), _| next.ports.contains(key));
        for series in next.counters.values() {
            self.base.entry(series.clone()).or_default();
        }
        self.index = next.counters;
    }

    /// Base + kernel values of every exported series.
    pub fn totals(&self, kernel: &CounterValues) -> BTreeMap<Series, Totals> {
        let mut out = self.base.clone();
        for (name, &Counter { packets, bytes }) in kernel {
            if let Some(series) = self.index.get(name)
                && let Some(t) = out.get_mut(series)
            {
                t.packets += packets;
                t.bytes += bytes;
            }
        }
        out
    }
}

pub type SharedCounters = Arc<Mutex<CounterState>>;

/// The `reason` label values of `nodelb_sync_failures_total`.
pub const SYNC_FAILURE_REASONS: [&str; 4] = ["netlink", "kernel_read", "manifests", "state_file"];

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
    /// Endpoint addresses refused by the endpoint policy, by reason.
    pub endpoints_refused: IntGaugeVec,
    /// Service ports whose node port this node does not take, by reason.
    pub node_ports_refused: IntGaugeVec,
    /// Per-Service-port series are exported (`--per-service-metrics`); when off, the sync loop
    /// builds no counter index and reads no kernel counters.
    pub per_service: bool,
    pub counters: SharedCounters,
    pub firewall: FirewallMetrics,
}

/// What the host-firewall check found (`crate::firewall`).
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
        let mut exported = self.exported.lock().unwrap_or_else(|e| e.into_inner());
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
                "Failed syncs by reason: netlink (the kernel refused the batch), kernel_read (reading the ruleset generation or table back failed), manifests (the manifests could not be read), state_file (the allocations could not be saved).",
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
        for reason in SYNC_FAILURE_REASONS {
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
        let endpoints_refused = IntGaugeVec::new(
            Opts::new(
                "nodelb_endpoints_refused",
                "Endpoint addresses named by Services that this node does not DNAT to (loopback, link-local, cloud metadata, a node's own address, outside --endpoint-cidrs, ...), by reason.",
            ),
            &["reason"],
        )?;
        for reason in crate::endpoint_policy::REASON_CODES {
            endpoints_refused.with_label_values(&[reason]).set(0);
        }
        let node_ports_refused = IntGaugeVec::new(
            Opts::new(
                "nodelb_node_ports_refused",
                "Service ports whose node port this node does not take: not_allowed (outside --port-range and --allowed-node-ports), in_use (a process on the node listens on it).",
            ),
            &["reason"],
        )?;
        for reason in ["not_allowed", "in_use"] {
            node_ports_refused.with_label_values(&[reason]).set(0);
        }
        registry.register(Box::new(endpoints_refused.clone()))?;
        registry.register(Box::new(node_ports_refused.clone()))?;
        registry.register(Box::new(build_info))?;
        registry.register(Box::new(prometheus::process_collector::ProcessCollector::for_self()))?;
        let firewall = FirewallMetrics::register(&registry)?;
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
            endpoints_refused,
            node_ports_refused,
            per_service,
            counters,
            firewall,
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

/// Every per-Service-port series with its total now: the kernel's named counters read over
/// netlink, plus what earlier batches reset. Blocking. The lock is held across the read, so no
/// batch (and its fold) happens in between. A failed read gives no series at all (the base alone
/// would look like a counter reset); no table (deleted behind our back) does hold 0.
pub fn read_totals(state: &SharedCounters) -> BTreeMap<Series, Totals> {
    let st = state.lock().unwrap_or_else(|e| e.into_inner());
    match NftClient::new().and_then(|mut c| c.read_counters()) {
        Ok(kernel) => st.totals(&kernel),
        Err(_) => BTreeMap::new(),
    }
}

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
        let totals = read_totals(&self.state);
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ir::Protocol;

    fn key(name: &str) -> SeriesKey {
        SeriesKey {
            service: ServiceKey { namespace: "default".into(), name: name.into() },
            port: PortId { port: 80, protocol: Protocol::Tcp },
        }
    }

    /// The kernel's named counters `(name, packets, bytes)`.
    fn kernel(counters: &[(&str, u64, u64)]) -> CounterValues {
        counters
            .iter()
            .map(|&(name, packets, bytes)| (name.to_string(), Counter { packets, bytes }))
            .collect()
    }

    fn index(counters: &[(&str, &str, CounterKind)], ports: &[&str]) -> CounterIndex {
        CounterIndex {
            counters: counters.iter().map(|&(c, s, k)| (c.to_string(), (key(s), k))).collect(),
            ports: ports.iter().map(|p| key(p)).collect(),
        }
    }

    /// One batch as the sync loop does it: read what it resets, fold, install.
    fn sync(st: &mut CounterState, before: &CounterValues, resetting: &[&str], next: CounterIndex) {
        let kept = st.kept_counters(&next);
        let resetting: BTreeSet<String> =
            resetting.iter().map(|s| s.to_string()).filter(|s| kept.contains(s)).collect();
        st.fold(before, &resetting, &next);
        st.install(next);
    }

    fn exported(st: &CounterState, now: &CounterValues) -> Vec<(String, CounterKind, u64, u64)> {
        st.totals(now).into_iter().map(|((k, kind), t)| (k.service.name, kind, t.packets, t.bytes)).collect()
    }

    use CounterKind::{Connections as C, Refused as R, Traffic as T};

    #[test]
    fn series_keep_their_totals_while_chains_come_and_go_and_go_with_the_service() {
        let mut st = CounterState::default();
        let full = || index(&[("svc-a", "a", C), ("fwd-a", "a", T), ("fw-b", "b", R)], &["a", "b"]);
        sync(&mut st, &kernel(&[]), &[], full());
        let k1 = kernel(&[("svc-a", 3, 180), ("fwd-a", 10, 1000), ("fw-b", 2, 120)]);
        let first = vec![("a".into(), C, 3, 180), ("a".into(), T, 10, 1000), ("b".into(), R, 2, 120)];
        assert_eq!(exported(&st, &k1), first);

        // a's endpoints go: its chains are deleted, its series stay with the same values.
        let no_endpoints = index(&[("fw-b", "b", R)], &["a", "b"]);
        assert_eq!(st.kept_counters(&no_endpoints), ["fw-b", "fwd-a", "svc-a"].map(String::from).into());
        sync(&mut st, &k1, &["svc-a", "fwd-a"], no_endpoints);
        let k2 = kernel(&[("fw-b", 2, 120)]);
        assert_eq!(exported(&st, &k2), first);

        // They come back: new chains start at 0 in the kernel, the series continue.
        sync(&mut st, &k2, &[], full());
        let k3 = kernel(&[("svc-a", 1, 60), ("fwd-a", 4, 400), ("fw-b", 2, 120)]);
        let later = vec![("a".into(), C, 4, 240), ("a".into(), T, 14, 1400), ("b".into(), R, 2, 120)];
        assert_eq!(exported(&st, &k3), later);

        // A flush (endpoint change) folds the old value in.
        sync(&mut st, &k3, &["svc-a"], full());
        let k4 = kernel(&[("svc-a", 0, 0), ("fwd-a", 4, 400), ("fw-b", 2, 120)]);
        assert_eq!(exported(&st, &k4), later);

        // Service a goes: its series go, its chains need no read; b stays.
        let only_b = index(&[("fw-b", "b", R)], &["b"]);
        assert_eq!(st.kept_counters(&only_b), BTreeSet::from(["fw-b".to_string()]));
        sync(&mut st, &k4, &["svc-a", "fwd-a"], only_b);
        assert_eq!(exported(&st, &k2), vec![("b".into(), R, 2, 120)]);

        // Without our table in the kernel, the folded base.
        assert_eq!(st.totals(&kernel(&[])).values().copied().collect::<Vec<_>>(), vec![Totals::default()]);
    }

    #[test]
    fn a_port_without_counters_has_no_series() {
        let mut st = CounterState::default();
        sync(&mut st, &kernel(&[]), &[], index(&[], &["a"]));
        assert!(st.totals(&kernel(&[])).is_empty());
    }
}
