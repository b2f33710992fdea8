//! The Kubernetes source of desired state: kube-runtime reflectors over Services and
//! EndpointSlices (all namespaces), Nodes, and our Leases (agent namespace). Watch errors (API
//! down, 410 Gone → relist, disconnects) are logged and retried with kube's default backoff, never
//! fatal; a relist replaces a store atomically on `InitDone`, so the stores always hold a complete
//! view once each has finished its first list.

use super::metrics::KubeMetrics;
use std::hash::{Hash, Hasher};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::core::inputs::compact::EndpointSlice;
use futures::StreamExt;
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::{Namespace, Node, Service};
use k8s_openapi::api::networking::v1::ServiceCIDR;
use kube::runtime::reflector::{self, Store};
use kube::runtime::utils::Backoff;
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Api, Client, Resource};
use tokio::sync::watch;
use tracing::{debug, info, warn};

use crate::core::decisions::pool::NodePortPool;
use crate::core::inputs::model::Standing;
use crate::core::inputs::slim::Slim;
use crate::core::k8s::nodes::LABEL_NODE_LEASE;
use crate::locks::lock;
use crate::observe::debounce::{Burst, Events};
use crate::observe::fingerprint::Fingerprint;

/// Quiet time that ends a burst of changes, and the longest a burst may delay a sync. The watch
/// delivers one event per object change; the quiet time is paid on every change, twice on a
/// create (once before the leader allocates, once before the node programs the allocation), so
/// it is shorter than one API round trip: it does not wait for what comes after one (a
/// Service's EndpointSlice, the leader's status patch after its annotation patch; merging those
/// cost more on every create than it saved: docs/benchmarks.md, "Design decisions, measured").
/// What it splits costs little: the leader's round of an EndpointSlice waits for the next
/// change, at most a second
/// ([`crate::core::k8s::round::LeaderState::can_wait`]: a Local-policy Service's status then
/// follows its first endpoints within that second), a node's sync of a status write finds its
/// fingerprint unchanged, and the leader writes only Services whose annotation or status must
/// change, however many rounds a burst is split into.
pub const DEBOUNCE_QUIET: Duration = Duration::from_millis(2);
pub const DEBOUNCE_MAX: Duration = Duration::from_millis(250);

use crate::core::k8s::snapshot::{Journal, KubeSnapshot};

impl NodeViews {
    /// What a node programs from `snap`, in two parts ([`Fingerprint`]). `programmed` changes whenever
    /// a Service that carries the leader's decision (an allocation annotation or an `Allocated`
    /// condition saying why not), or an EndpointSlice of one, is added, removed or modified
    /// (uid + resourceVersion; a Service only in what a node reads of it,
    /// [`crate::core::inputs::slim::node_view_hash`]: not its ingress or the leader's other conditions).
    /// `pending` follows the Services that are nodelb's but wait for the leader's decision, and
    /// their EndpointSlices: no rule can come of them until it is written. Services nodelb does
    /// not serve ([`crate::core::inputs::model::is_ours`]) with no decision on them, and EndpointSlices of
    /// those or of no Service (the model reads a slice only through its Service: the slices of
    /// a deleted Service outlive it a moment), are in neither: a node computes nothing from
    /// them. A relist that brings nothing new keeps both, so nothing is recomputed.
    pub fn fingerprint(
        &mut self,
        snap: &KubeSnapshot,
        opts: &crate::core::inputs::model::ModelOptions,
    ) -> Fingerprint {
        #[derive(Default, Hash)]
        struct Part {
            services: (usize, u64),
            slices: (usize, u64),
        }
        fn add(to: &mut (usize, u64), hash: u64) {
            to.0 += 1;
            to.1 = to.1.wrapping_add(hash);
        }
        // Sums of each object's hash: the same for any order of the cache, so nothing is sorted
        // (sorting would compare uid strings on every sync). What is
        // hashed is hashed once per object version ([`NodeViews`]): a Service's standing is
        // found for each slice by its key's hash.
        let (mut programmed, mut pending) = (Part::default(), Part::default());
        let (services, slices, new_slices) = self.pass(snap, opts);
        let mut standing: foldhash::HashMap<u64, Standing> =
            foldhash::HashMap::with_capacity_and_hasher(services.len(), Default::default());
        for view in services {
            match view.standing {
                Standing::Decided => add(&mut programmed.services, view.hash),
                Standing::Undecided => add(&mut pending.services, view.hash),
                Standing::NotOurs => {}
            }
            standing.insert(view.key, view.standing);
        }
        for view in slices {
            let part = match view.service.and_then(|key| standing.get(&key)) {
                Some(Standing::Decided) => &mut programmed.slices,
                Some(Standing::Undecided) => &mut pending.slices,
                Some(Standing::NotOurs) | None => continue,
            };
            add(part, view.hash);
        }
        // A new slice version of a Service of ours: the change it carries is in the kernel once
        // a sync of a snapshot in which its Service is decided succeeds (a new Service's first
        // slice comes before the leader's allocation: it waits for it).
        for view in new_slices {
            if let (Some(t), Some(service)) = (view.trigger, view.service) {
                self.note_trigger(view.hash, service, t);
            }
        }
        let waiting = std::mem::take(&mut self.waiting);
        for (service, t) in waiting {
            match standing.get(&service) {
                Some(Standing::Decided) => self.triggers.push(t),
                Some(Standing::Undecided) => self.waiting.push((service, t)),
                Some(Standing::NotOurs) | None => {}
            }
        }
        let hash = |part: &Part| {
            let mut h = std::collections::hash_map::DefaultHasher::new();
            part.hash(&mut h);
            h.finish()
        };
        Fingerprint { programmed: hash(&programmed), pending: hash(&pending) }
    }
}

/// A Service version as a node's fingerprint reads it.
#[derive(Debug, Clone, Copy)]
struct NodeView {
    hash: u64,
    /// The hash of its namespace and name ([`NodeViews::keys`]).
    key: u64,
    standing: Standing,
}

/// An EndpointSlice version as a node's fingerprint reads it.
#[derive(Debug, Clone, Copy)]
struct SliceView {
    /// Of its uid and resourceVersion.
    hash: u64,
    /// The hash of its Service's namespace and name, when it names one.
    service: Option<u64>,
    /// [`EndpointSlice::trigger_time`].
    trigger: Option<k8s_openapi::jiff::Timestamp>,
}

/// Each cached Service's [`NodeView`] and EndpointSlice's [`SliceView`], computed once per object
/// version (kept while the cache holds the object); and the trigger times of the slice versions
/// not programmed yet.
#[derive(Debug)]
pub struct NodeViews {
    services: crate::core::incremental::per_object::PerObject<Service, NodeView>,
    slices: crate::core::incremental::per_object::PerObject<EndpointSlice, SliceView>,
    /// Hashes the Services' keys, the same way for both kinds.
    keys: foldhash::fast::RandomState,
    /// The trigger times of the new slice versions of programmed Services, since the last
    /// [`NodeViews::take_triggers`].
    triggers: Vec<k8s_openapi::jiff::Timestamp>,
    /// Those of slices whose Service is not decided yet, with its key's hash.
    waiting: Vec<(u64, k8s_openapi::jiff::Timestamp)>,
    /// Changes older than the agent are not its latency (the first list brings every slice).
    started: k8s_openapi::jiff::Timestamp,
    /// The slice versions whose trigger times were counted, within [`TRIGGER_WINDOW`]: a relist
    /// brings the same versions as new objects, and a change is counted once.
    counted: foldhash::HashMap<u64, k8s_openapi::jiff::Timestamp>,
}

/// How far back a slice change's trigger time is counted: further back is no programming
/// latency but a relist of an old version (or a clock far off).
const TRIGGER_WINDOW: std::time::Duration = std::time::Duration::from_secs(15 * 60);

impl Default for NodeViews {
    fn default() -> NodeViews {
        NodeViews {
            services: Default::default(),
            slices: Default::default(),
            keys: Default::default(),
            triggers: Vec::new(),
            waiting: Vec::new(),
            started: k8s_openapi::jiff::Timestamp::now(),
            counted: Default::default(),
        }
    }
}

impl NodeViews {
    /// The trigger times of the slice changes that the sync which just succeeded programmed (as
    /// kube-proxy's `network_programming_duration_seconds` counts them: from the EndpointSlice
    /// controller's `endpoints.kubernetes.io/last-change-trigger-time` to the rules in the kernel).
    pub fn take_triggers(&mut self) -> Vec<k8s_openapi::jiff::Timestamp> {
        let oldest = k8s_openapi::jiff::Timestamp::now() - TRIGGER_WINDOW;
        self.counted.retain(|_, t| *t >= oldest);
        self.waiting.retain(|(_, t)| *t >= oldest);
        std::mem::take(&mut self.triggers)
    }

    /// A new version (`hash`) of a slice of the Service whose key hashes to `service`, its change
    /// triggered at `t`.
    fn note_trigger(&mut self, hash: u64, service: u64, t: k8s_openapi::jiff::Timestamp) {
        let oldest = k8s_openapi::jiff::Timestamp::now() - TRIGGER_WINDOW;
        if t >= self.started && t >= oldest && self.counted.insert(hash, t).is_none() {
            self.waiting.push((service, t));
        }
    }

    fn pass(
        &mut self,
        snap: &KubeSnapshot,
        opts: &crate::core::inputs::model::ModelOptions,
    ) -> (Vec<NodeView>, Vec<SliceView>, Vec<SliceView>) {
        use std::hash::BuildHasher;
        let keys = &self.keys;
        let services = self.services.pass(&snap.services, |s| NodeView {
            hash: crate::core::inputs::slim::node_view_hash(s),
            key: keys.hash_one(crate::core::inputs::model::borrowed_key(
                &s.metadata.namespace,
                s.metadata.name.as_deref(),
            )),
            standing: Standing::of(s, opts),
        });
        let slices = self.slices.pass_changes(&snap.slices, |s| {
            let mut h = std::collections::hash_map::DefaultHasher::new();
            (s.metadata.uid.as_deref(), s.metadata.resource_version.as_deref()).hash(&mut h);
            SliceView {
                hash: h.finish(),
                service: crate::core::inputs::model::slice_service(s).map(|k| keys.hash_one(k)),
                trigger: s.trigger_time,
            }
        });
        (services, slices.values, slices.computed.into_iter().map(|(_, v)| v).collect())
    }
}

/// Whether a reflector's watch works, and since when.
#[derive(Debug, Clone, Copy, Default)]
struct Health {
    failing: bool,
    /// When it last recovered from a failure (`None`: never failed).
    recovered_at: Option<Instant>,
}

/// Index of the Lease reflector in `synced` / `health`.
const LEASES: usize = 3;
/// Index of the NodePortPool reflector.
const POOLS: usize = 4;
/// Index of the ServiceCIDR reflector.
const SERVICE_CIDRS: usize = 7;
/// Number of reflectors: Services, EndpointSlices, Nodes, node Leases, NodePortPools,
/// Namespaces, the node-port registry's Leases, ServiceCIDRs.
const N: usize = 8;
/// The reflectors' kinds, by index (the `kind` label of the watch metrics).
pub const KINDS: [&str; N] = [
    "Service",
    "EndpointSlice",
    "Node",
    "Lease",
    "NodePortPool",
    "Namespace",
    "RegistryLease",
    "ServiceCIDR",
];

/// Handle on the running reflectors. Cheap to clone; every clone has its own change cursor.
#[derive(Clone)]
pub struct KubeSource {
    services: Store<Service>,
    slices: Store<EndpointSlice>,
    nodes: Store<Node>,
    leases: Store<Lease>,
    pools: Store<NodePortPool>,
    namespaces: Store<Namespace>,
    registry: Store<Lease>,
    service_cidrs: Store<ServiceCIDR>,
    synced: Arc<[AtomicBool; N]>,
    health: Arc<Mutex<[Health; N]>>,
    /// The changes of the reflectors, as this handle follows them.
    cursor: Cursor,
    /// The burst of changes not yet reported ([`KubeSource::changed`]).
    burst: Burst,
    /// What changed, for the one handle that takes it ([`KubeSource::take_changes`]).
    journal: Arc<Mutex<Option<Journal>>>,
}

/// Notes one reflector event in `journal` (`index`: the reflector, as [`KINDS`] names them).
fn note<K: Resource>(journal: &mut Journal, index: usize, event: &watcher::Event<K>) {
    match event {
        watcher::Event::Apply(o) if index == 0 => {
            let meta = o.meta();
            let key = crate::core::domain::ServiceKey::new(
                meta.namespace.as_deref().unwrap_or_default(),
                meta.name.as_deref().unwrap_or_default(),
            );
            journal.service_written(key, meta.resource_version.clone());
        }
        // Only fills the relist buffer; the store changes on InitDone.
        watcher::Event::Init | watcher::Event::InitApply(_) => {}
        _ => journal.changed(KINDS[index]),
    }
}

/// Where a [`KubeSource`] handle is in the stream of reflector changes.
#[derive(Clone)]
struct Cursor {
    synced: Arc<[AtomicBool; N]>,
    /// Per reflector (index as in `synced`), how many changes it has seen.
    changes: watch::Receiver<[u64; N]>,
    /// The reflectors whose changes [`KubeSource::changed`] reports, and their counts last seen.
    interest: [bool; N],
    seen: [u64; N],
    /// The caches were complete at a change already reported.
    was_complete: bool,
}

impl KubeSource {
    /// Starts the reflectors on the current Tokio runtime.
    pub fn start(client: Client, namespace: &str, metrics: KubeMetrics) -> KubeSource {
        let (tx, changes) = watch::channel([0u64; N]);
        let tx = Arc::new(tx);
        let synced: Arc<[AtomicBool; N]> = Arc::new(Default::default());
        let health: Arc<Mutex<[Health; N]>> = Arc::default();
        let journal: Arc<Mutex<Option<Journal>>> = Arc::default();
        let shared =
            Shared { synced: synced.clone(), journal: journal.clone(), health: health.clone(), tx, metrics };
        let services =
            spawn_reflector(Api::all(client.clone()), watcher::Config::default(), 0, "Service", &shared);
        let slices = spawn_reflector(
            Api::all(client.clone()),
            watcher::Config::default(),
            1,
            "EndpointSlice",
            &shared,
        );
        let nodes = spawn_reflector(Api::all(client.clone()), watcher::Config::default(), 2, "Node", &shared);
        let pools = spawn_reflector(
            Api::all(client.clone()),
            watcher::Config::default(),
            POOLS,
            "NodePortPool",
            &shared,
        );
        let namespaces =
            spawn_reflector(Api::all(client.clone()), watcher::Config::default(), 5, "Namespace", &shared);
        let leases = spawn_reflector(
            Api::namespaced(client.clone(), namespace),
            watcher::Config::default().labels(LABEL_NODE_LEASE),
            LEASES,
            "Lease",
            &shared,
        );
        let service_cidrs = spawn_reflector(
            Api::all(client.clone()),
            watcher::Config::default(),
            SERVICE_CIDRS,
            "ServiceCIDR",
            &shared,
        );
        let registry = spawn_reflector(
            Api::namespaced(client, namespace),
            watcher::Config::default().labels(crate::core::k8s::claims::LABEL),
            6,
            "RegistryLease",
            &shared,
        );
        KubeSource {
            services,
            slices,
            nodes,
            leases,
            pools,
            namespaces,
            registry,
            service_cidrs,
            synced: synced.clone(),
            health,
            cursor: Cursor { synced, changes, interest: [true; N], seen: [0; N], was_complete: false },
            burst: Burst::new(DEBOUNCE_QUIET, DEBOUNCE_MAX),
            journal,
        }
    }

    /// What changed since the last call ([`Journal`]). The first call starts the record and says
    /// that anything may have changed. For one consumer: every call takes what the last left.
    pub fn take_changes(&self) -> Journal {
        let mut journal = lock(&self.journal);
        journal.replace(Journal::default()).unwrap_or(Journal {
            services: vec![],
            others: KINDS.into(),
            truncated: true,
        })
    }

    /// A handle whose [`KubeSource::changed`] reports what a node programs from (Services,
    /// EndpointSlices, pools, Namespaces and Nodes: pools select by their labels; the node-port
    /// registry), not node-Lease renewals (every node renews every `lease/3`). A Node change
    /// that alters no label leaves the agent's input fingerprint as it was: nothing is
    /// recomputed.
    pub fn services_only(&self) -> KubeSource {
        let mut handle = self.clone();
        handle.cursor.interest = [true, true, true, false, true, true, true, true];
        handle
    }

    /// How long the node-Lease cache has been known to be current: `None` while its watch is
    /// failing (or before the first list), `Duration::MAX` when it never failed, else the time
    /// since it recovered. After an API outage nobody could renew, and the first renewals reach
    /// the cache only some time after it recovers: expiry is judged only once this exceeds a lease
    /// duration (see [`crate::core::k8s::nodes::serving_nodes`]).
    pub fn leases_current_for(&self) -> Option<Duration> {
        if !self.synced[LEASES].load(Ordering::Acquire) {
            return None;
        }
        let h = lock(&self.health)[LEASES];
        if h.failing {
            return None;
        }
        Some(h.recovered_at.map_or(Duration::MAX, |t| t.elapsed()))
    }

    /// The Service cache has completed its first list and its watch works now (what the
    /// leader's node-port registry needs before it frees a number on what the cache no longer
    /// shows, see [`crate::core::k8s::claims::Keeper::expired`]).
    pub fn services_current(&self) -> bool {
        self.synced[0].load(Ordering::Acquire) && !lock(&self.health)[0].failing
    }

    /// Every cache has completed its initial list (never program from a partial view).
    pub fn complete(&self) -> bool {
        self.synced.iter().all(|s| s.load(Ordering::Acquire))
    }

    /// The cached Node called `name` (a store lookup; no snapshot of every cache).
    pub fn node(&self, name: &str) -> Option<Arc<Node>> {
        self.nodes.get(&reflector::ObjectRef::new(name))
    }

    /// The cached Nodes and node Leases (what [`crate::core::k8s::round::LeaseView`] reads).
    pub fn nodes_and_leases(&self) -> (Vec<Arc<Node>>, Vec<Arc<Lease>>) {
        (self.nodes.state(), self.leases.state())
    }

    /// The cached Service `key` (a hash lookup: no snapshot).
    pub fn service(&self, key: &crate::core::domain::ServiceKey) -> Option<Arc<Service>> {
        self.services.get(&reflector::ObjectRef::new(&key.name).within(&key.namespace))
    }

    /// The API server's EndpointSlice (`default/kubernetes`), when cached.
    fn api_server(&self) -> Vec<Arc<EndpointSlice>> {
        let (namespace, name) = crate::core::k8s::nodes::API_SERVER_SERVICE;
        self.slices.get(&reflector::ObjectRef::new(name).within(namespace)).into_iter().collect()
    }

    /// Everything the endpoint policy refuses as the cluster's own
    /// ([`crate::core::k8s::nodes::cluster_addresses`]), and the typed addresses of `own`'s Node object
    /// ([`crate::core::k8s::nodes::address_types`]).
    pub fn node_addresses(&self, own: &str) -> crate::core::decisions::endpoint_policy::HostAddresses {
        let more = crate::core::k8s::nodes::ClusterObjects {
            leases: &self.leases.state(),
            api_server: &self.api_server(),
            service_cidrs: &self.service_cidrs.state(),
        };
        let mut out = crate::core::k8s::nodes::cluster_addresses(&self.nodes.state(), more);
        if let Some(node) = self.node(own) {
            out.own.types = crate::core::k8s::nodes::address_types(&node);
        }
        out
    }

    pub fn snapshot(&self) -> KubeSnapshot {
        KubeSnapshot {
            services: self.services.state(),
            slices: self.slices.state(),
            nodes: self.nodes.state(),
            leases: self.leases.state(),
            pools: self.pools.state(),
            namespaces: self.namespaces.state(),
            registry: self.registry.state(),
            service_cidrs: self.service_cidrs.state(),
            api_server: self.api_server(),
        }
    }

    /// Waits for a change, then for the burst to settle (`DEBOUNCE_QUIET`, at most `DEBOUNCE_MAX`).
    /// Never returns if the reflectors are gone (they live as long as the runtime). Cancel-safe
    /// ([`Burst`]): `watch::Receiver::changed` marks a change seen as soon as it returns, so the
    /// burst is kept in the handle, not in this call.
    pub async fn changed(&mut self) {
        match self.burst.settle(&mut self.cursor).await {
            Ok(()) => {}
            Err(never) => match never {},
        }
    }
}

impl Cursor {
    fn complete(&self) -> bool {
        self.synced.iter().all(|s| s.load(Ordering::Acquire))
    }
}

impl Events for Cursor {
    type Error = std::convert::Infallible;

    /// Waits for a change of a reflector of interest (or the caches becoming complete). What was
    /// seen is recorded without an await in between.
    async fn wait(&mut self, burst: &mut Burst) -> Result<(), Self::Error> {
        loop {
            if self.changes.changed().await.is_err() {
                // The reflectors are gone: nothing will ever change again.
                return std::future::pending().await;
            }
            let now = *self.changes.borrow_and_update();
            // Becoming complete matters whichever reflector finished last.
            let completed = !self.was_complete && self.complete();
            self.was_complete |= completed;
            let relevant = completed || (0..now.len()).any(|i| self.interest[i] && now[i] != self.seen[i]);
            self.seen = now;
            if relevant {
                burst.note();
                return Ok(());
            }
        }
    }
}

/// What the reflector tasks report into.
struct Shared {
    synced: Arc<[AtomicBool; N]>,
    journal: Arc<Mutex<Option<Journal>>>,
    health: Arc<Mutex<[Health; N]>>,
    tx: Arc<watch::Sender<[u64; N]>>,
    metrics: KubeMetrics,
}

/// Whether a watch error is answered by relisting at once instead of after the backoff: a 410 Gone
/// is the API server answering (it no longer has our resourceVersion: etcd compacted it, or it
/// restarted with an empty watch cache), so the relist it asks for is due now. Waiting would add
/// the backoff grown while the server was unreachable (up to 30 s) to every outage.
pub fn relist_at_once(e: &watcher::Error) -> bool {
    matches!(e, watcher::Error::WatchError(status) if status.code == 410)
}

/// The API server does not know the resource (its CRD is not installed): 404 on the list.
fn crd_missing(e: &watcher::Error) -> bool {
    match e {
        watcher::Error::InitialListFailed(kube::Error::Api(s))
        | watcher::Error::WatchStartFailed(kube::Error::Api(s)) => s.code == 404,
        watcher::Error::WatchError(s) => s.code == 404,
        _ => false,
    }
}

fn spawn_reflector<K>(
    api: Api<K>,
    config: watcher::Config,
    index: usize,
    kind: &'static str,
    shared: &Shared,
) -> Store<K>
where
    K: Resource + Slim + Clone + std::fmt::Debug + serde::de::DeserializeOwned + Send + Sync + 'static,
    K::DynamicType: Eq + std::hash::Hash + Clone + Default + Send + Sync,
{
    let (reader, writer) = reflector::store();
    // Only the fields nodelb reads are cached (managedFields alone, a JSON tree per field manager,
    // would weigh on every copy and walk of the cached objects).
    // Backed off here rather than with `default_backoff()`: a 410 Gone retries at once (see
    // `relist_at_once`), everything else waits kube-runtime's default backoff.
    let objects = watcher(api, config).modify(|o: &mut K| o.slim());
    let stream = reflector::reflector(writer, objects);
    let synced = shared.synced.clone();
    let journal = shared.journal.clone();
    let health = shared.health.clone();
    let tx = shared.tx.clone();
    let errors = shared.metrics.watch_errors.with_label_values(&[kind]);
    let restarts = shared.metrics.watch_restarts.with_label_values(&[kind]);
    tokio::spawn(async move {
        let mut stream = std::pin::pin!(stream);
        let mut failing = false;
        let mut backoff = watcher::DefaultBackoff::default();
        while let Some(item) = stream.next().await {
            match item {
                // A retry starts with `Init` before its list request: only data means recovery.
                Ok(watcher::Event::Init) => {}
                Ok(ev) => {
                    backoff.reset();
                    if failing {
                        restarts.inc();
                        info!(kind, "watch recovered");
                        failing = false;
                        lock(&health)[index] = Health { failing: false, recovered_at: Some(Instant::now()) };
                    }
                    if matches!(ev, watcher::Event::InitDone) && !synced[index].swap(true, Ordering::AcqRel) {
                        info!(kind, "initial list complete");
                    }
                    if let Some(j) = lock(&journal).as_mut() {
                        note(j, index, &ev);
                    }
                    // InitApply only fills the relist buffer; the store changes on InitDone.
                    if !matches!(ev, watcher::Event::InitApply(_)) {
                        tx.send_modify(|n| n[index] = n[index].wrapping_add(1));
                    }
                }
                Err(e) if [POOLS, SERVICE_CIDRS].contains(&index) && crd_missing(&e) => {
                    // No NodePortPool CRD installed, or an API server without ServiceCIDRs: no
                    // such objects, not a partial view. Checked again with backoff, so
                    // installing it later works.
                    if !synced[index].swap(true, Ordering::AcqRel) {
                        info!(kind, "not served by this API server: none");
                        tx.send_modify(|n| n[index] = n[index].wrapping_add(1));
                    }
                    if let Some(delay) = backoff.next() {
                        tokio::time::sleep(delay).await;
                    }
                }
                Err(e) => {
                    errors.inc();
                    if !failing {
                        warn!(kind, error = %e, "watch failed; retrying with backoff (the caches keep their last view)");
                        failing = true;
                        lock(&health)[index].failing = true;
                    } else {
                        debug!(kind, error = %e, "watch still failing");
                    }
                    if !relist_at_once(&e)
                        && let Some(delay) = backoff.next()
                    {
                        tokio::time::sleep(delay).await;
                    }
                }
            }
        }
    });
    reader
}

#[cfg(test)]
mod tests {
    use super::*;
    use kube::core::Status;

    #[test]
    fn only_410_gone_relists_at_once() {
        let status = |code: u16| {
            let mut s = Status::failure("x", "y");
            s.code = code;
            s.boxed()
        };
        let cases: Vec<(&str, watcher::Error, bool)> = vec![
            ("410 Gone during a watch", watcher::Error::WatchError(status(410)), true),
            ("403 Forbidden during a watch", watcher::Error::WatchError(status(403)), false),
            ("500 during a watch", watcher::Error::WatchError(status(500)), false),
            ("no watch-list bookmark", watcher::Error::NoResourceVersion, false),
        ];
        for (name, err, want) in cases {
            assert_eq!(relist_at_once(&err), want, "{name}");
        }
    }

    /// The fingerprint's programmed part follows every add, removal and modification a node
    /// reads, and not the cache's order nor a new resourceVersion alone (the leader's status
    /// write); its pending part follows the Services waiting for the leader's decision and their
    /// EndpointSlices; Services that are not nodelb's, with their EndpointSlices, are in neither.
    #[test]
    fn fingerprint_parts_follow_what_a_node_programs_and_what_waits_for_the_leader() {
        use crate::core::inputs::model::ANNOTATION_ALLOCATED;
        use serde_json::json;
        // `version`: the generation (a spec change); each object its own resourceVersion.
        let rv = std::sync::atomic::AtomicU64::new(1);
        let next_rv = || rv.fetch_add(1, Ordering::Relaxed).to_string();
        // `kind`: "decided" (annotated), "undecided" (a LoadBalancer without it), "not-ours" (a
        // ClusterIP), "not-ours-annotated" (a ClusterIP the leader has not cleared yet).
        let svc = |name: &str, version: i64, kind: &str| {
            let mut v = json!({
                "metadata": {"name": name, "namespace": "ns", "uid": format!("uid-{name}"),
                             "generation": version, "resourceVersion": next_rv()},
                "spec": {"type": "LoadBalancer", "ports": [{"port": 80}]}
            });
            match kind {
                "decided" => v["metadata"]["annotations"] = json!({ANNOTATION_ALLOCATED: "80/TCP=20080"}),
                "undecided" => {}
                "not-ours" => v["spec"]["type"] = json!("ClusterIP"),
                _ => {
                    v["metadata"]["annotations"] = json!({ANNOTATION_ALLOCATED: "80/TCP=20080"});
                    v["spec"]["type"] = json!("ClusterIP");
                }
            }
            Arc::new(serde_json::from_value::<Service>(v).expect("test Service"))
        };
        let slice = |name: &str, service: &str| {
            let mut s = EndpointSlice::default();
            s.metadata.namespace = Some("ns".into());
            s.metadata.uid = Some(format!("uid-{name}"));
            s.metadata.resource_version = Some(next_rv());
            s.service_name = Some(service.into());
            Arc::new(s)
        };
        let snap = |services: Vec<Arc<Service>>, slices: Vec<Arc<EndpointSlice>>| KubeSnapshot {
            services,
            slices,
            ..Default::default()
        };
        let (views, opts) = (&mut NodeViews::default(), &crate::core::inputs::model::ModelOptions::default());
        let (a, b, sa) = (svc("a", 1, "decided"), svc("b", 2, "decided"), slice("sa", "a"));
        let base = views.fingerprint(&snap(vec![a.clone(), b.clone()], vec![sa.clone()]), opts);
        let mut fp = |services, slices| views.fingerprint(&snap(services, slices), opts);

        // (name, services, slices, programmed part the same, pending part the same)
        type Case = (&'static str, Vec<Arc<Service>>, Vec<Arc<EndpointSlice>>, bool, bool);
        let unlabeled = {
            let mut s = EndpointSlice::clone(&slice("sl", "a"));
            s.service_name = None;
            Arc::new(s)
        };
        let mut written = Service::clone(&b);
        written.metadata.resource_version = Some(next_rv());
        written.status.get_or_insert_default().load_balancer = Some(Default::default());
        let cases: Vec<Case> = vec![
            (
                "order, new versions",
                vec![svc("b", 2, "decided"), svc("a", 1, "decided")],
                vec![sa.clone()],
                true,
                true,
            ),
            ("a status write", vec![a.clone(), Arc::new(written)], vec![sa.clone()], true, true),
            ("modified", vec![a.clone(), svc("b", 3, "decided")], vec![sa.clone()], false, true),
            ("removed", vec![a.clone()], vec![sa.clone()], false, true),
            ("added", vec![a.clone(), b.clone(), svc("c", 1, "decided")], vec![sa.clone()], false, true),
            ("re-created", vec![a.clone(), svc("b2", 2, "decided")], vec![sa.clone()], false, true),
            (
                "two swapped versions",
                vec![svc("a", 2, "decided"), svc("b", 1, "decided")],
                vec![sa.clone()],
                false,
                true,
            ),
            ("its slice modified", vec![a.clone(), b.clone()], vec![slice("sa", "a")], false, true),
            (
                "a slice of no Service",
                vec![a.clone(), b.clone()],
                vec![sa.clone(), slice("sx", "x")],
                true,
                true,
            ),
            (
                "a slice without its label",
                vec![a.clone(), b.clone()],
                vec![sa.clone(), unlabeled],
                true,
                true,
            ),
            ("the slice of a Service deleted", vec![b.clone()], vec![], false, true),
            ("the Service deleted, its slice left", vec![b.clone()], vec![sa.clone()], false, true),
            (
                "undecided added",
                vec![a.clone(), b.clone(), svc("u", 1, "undecided")],
                vec![sa.clone()],
                true,
                false,
            ),
            (
                "undecided and its slice",
                vec![a.clone(), b.clone(), svc("u", 1, "undecided")],
                vec![sa.clone(), slice("su", "u")],
                true,
                false,
            ),
            (
                "the same decided",
                vec![a.clone(), b.clone(), svc("u", 1, "decided")],
                vec![sa.clone()],
                false,
                true,
            ),
            (
                "the same decided, with its slice",
                vec![a.clone(), b.clone(), svc("u", 1, "decided")],
                vec![sa.clone(), slice("su", "u")],
                false,
                true,
            ),
            (
                "not ours added",
                vec![a.clone(), b.clone(), svc("n", 1, "not-ours")],
                vec![sa.clone()],
                true,
                true,
            ),
            (
                "not ours and its slice",
                vec![a.clone(), b.clone(), svc("n", 1, "not-ours")],
                vec![sa.clone(), slice("sn", "n")],
                true,
                true,
            ),
            (
                "a decided one turned ClusterIP, still annotated",
                vec![a.clone(), svc("b", 2, "not-ours-annotated")],
                vec![sa.clone()],
                false,
                true,
            ),
        ];
        // An undecided Service's slice changed: the pending part only; decided, it moves over.
        let (u, su) = (svc("u", 1, "undecided"), slice("su", "u"));
        let with = |s: &Arc<EndpointSlice>| vec![sa.clone(), s.clone()];
        let undecided = fp(vec![a.clone(), b.clone(), u.clone()], with(&su));
        let changed = fp(vec![a.clone(), b.clone(), u.clone()], with(&slice("su", "u")));
        assert_eq!(changed.programmed, undecided.programmed, "an undecided Service's slice changed");
        assert_ne!(changed.pending, undecided.pending, "an undecided Service's slice changed");
        let decided = fp(vec![a.clone(), b.clone(), svc("u", 1, "decided")], with(&su));
        let decided_alone = fp(vec![a.clone(), b.clone(), svc("u", 1, "decided")], vec![sa.clone()]);
        assert_ne!(decided.programmed, decided_alone.programmed, "a decided Service's slice is programmed");
        assert_eq!(decided.pending, base.pending, "nothing pending once decided");
        for (name, services, slices, programmed, pending) in cases {
            let got = fp(services, slices);
            assert_eq!(
                (got.programmed == base.programmed, got.pending == base.pending),
                (programmed, pending),
                "{name}"
            );
        }
    }
}
