//! Invariants the soak and race programs check while they run.
//!
//! [`AllocationWatch`]: a watch on every Service the API server stores (admin client, its own
//! task), which keeps the latest stored version of each and, after every event, looks for a node
//! port number that two Services' `nodelb.io/allocated-ports` annotations hold (or one Service
//! twice for one protocol). Every such pair is recorded the first time it is seen, with the
//! resourceVersions that made it: "no node port is ever held by two Services in what the API
//! server stores". A watch delivers every write (one event per stored version); a relist (410,
//! reconnect) replaces the view at its end, so a double that appeared and went while the watch was
//! down is missed, which the caller can see in [`AllocationWatch::relists`].

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex};

use futures::StreamExt;
use k8s_openapi::api::core::v1::Service;
use kube::Api;
use kube::runtime::watcher;

use super::cluster::ANNOTATION_ALLOCATED;
use super::kube::ControlPlane;

/// Node port numbers of one Service's annotation: (number, protocol) per service port.
pub fn annotated_numbers(svc: &Service) -> Vec<(u16, String)> {
    let Some(value) = svc.metadata.annotations.as_ref().and_then(|a| a.get(ANNOTATION_ALLOCATED)) else {
        return Vec::new();
    };
    value
        .split(',')
        .filter_map(|item| {
            let (port, number) = item.trim().split_once('=')?;
            let protocol = port.split_once('/')?.1.to_string();
            Some((number.parse().ok()?, protocol))
        })
        .collect()
}

/// A node port held twice: the number, and the Services (namespace/name@resourceVersion).
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct Double {
    pub number: u16,
    pub holders: Vec<String>,
}

/// Numbers held twice in `services` (by two Services, or by one twice for one protocol).
pub fn doubles<'a>(services: impl IntoIterator<Item = &'a Service>) -> Vec<Double> {
    let mut owners: BTreeMap<u16, Vec<(String, String)>> = BTreeMap::new();
    for s in services {
        let key = format!(
            "{}/{}@{}",
            s.metadata.namespace.as_deref().unwrap_or_default(),
            s.metadata.name.as_deref().unwrap_or_default(),
            s.metadata.resource_version.as_deref().unwrap_or_default()
        );
        for (n, proto) in annotated_numbers(s) {
            owners.entry(n).or_default().push((key.clone(), proto));
        }
    }
    owners
        .into_iter()
        .filter(|(_, holders)| {
            let services: BTreeSet<&str> = holders.iter().map(|(k, _)| k.as_str()).collect();
            let protos: BTreeSet<&str> = holders.iter().map(|(_, p)| p.as_str()).collect();
            services.len() > 1 || protos.len() < holders.len()
        })
        .map(|(number, holders)| Double { number, holders: holders.into_iter().map(|(k, _)| k).collect() })
        .collect()
}

impl Double {
    /// The number and the Services, without their resourceVersions: one double however many
    /// writes it lasted.
    pub fn identity(&self) -> (u16, Vec<String>) {
        let mut names: Vec<String> = self
            .holders
            .iter()
            .map(|h| h.split_once('@').map_or(h.as_str(), |(n, _)| n).to_string())
            .collect();
        names.sort();
        (self.number, names)
    }
}

#[derive(Default)]
struct WatchState {
    /// uid → latest stored version.
    services: BTreeMap<String, Service>,
    relisting: Option<BTreeMap<String, Service>>,
    /// Every double seen (by [`Double::identity`]), as first seen.
    seen: BTreeMap<(u16, Vec<String>), Double>,
    events: u64,
    relists: u64,
    /// The highest resourceVersion seen (etcd revisions are numbers on this server).
    last_rv: u64,
}

impl WatchState {
    fn check(&mut self) {
        for d in doubles(self.services.values()) {
            self.seen.entry(d.identity()).or_insert(d);
        }
    }
}

/// See the module documentation. Stops when dropped.
pub struct AllocationWatch {
    state: Arc<Mutex<WatchState>>,
    task: tokio::task::JoinHandle<()>,
}

impl AllocationWatch {
    /// Watches Services in `namespace` (`None`: all) through the control plane's admin client.
    pub fn start(api: &ControlPlane, namespace: Option<&str>) -> AllocationWatch {
        let client = api.client();
        let services: Api<Service> = match namespace {
            Some(ns) => Api::namespaced(client, ns),
            None => Api::all(client),
        };
        let state = Arc::new(Mutex::new(WatchState::default()));
        let st = state.clone();
        let task = api.runtime().spawn(async move {
            let mut stream = watcher(services, watcher::Config::default()).boxed();
            while let Some(ev) = stream.next().await {
                let Ok(ev) = ev else { continue };
                let mut st = st.lock().unwrap();
                st.events += 1;
                let uid = |s: &Service| s.metadata.uid.clone().unwrap_or_default();
                let rv = |s: &Service| {
                    s.metadata.resource_version.as_deref().and_then(|v| v.parse::<u64>().ok()).unwrap_or(0)
                };
                match ev {
                    watcher::Event::Apply(s) => {
                        st.last_rv = st.last_rv.max(rv(&s));
                        st.services.insert(uid(&s), s);
                        st.check();
                    }
                    watcher::Event::Delete(s) => {
                        st.last_rv = st.last_rv.max(rv(&s));
                        st.services.remove(&uid(&s));
                    }
                    watcher::Event::Init => st.relisting = Some(BTreeMap::new()),
                    watcher::Event::InitApply(s) => {
                        st.last_rv = st.last_rv.max(rv(&s));
                        st.relisting.get_or_insert_default().insert(uid(&s), s);
                    }
                    watcher::Event::InitDone => {
                        st.relists += 1;
                        st.services = st.relisting.take().unwrap_or_default();
                        st.check();
                    }
                }
            }
        });
        AllocationWatch { state, task }
    }

    /// Every double seen so far: one per number and pair of Services, as first seen.
    pub fn doubles(&self) -> Vec<Double> {
        self.state.lock().unwrap().seen.values().cloned().collect()
    }

    /// Watch events received, and relists (the first list included).
    pub fn counts(&self) -> (u64, u64) {
        let st = self.state.lock().unwrap();
        (st.events, st.relists)
    }

    /// Waits (up to `timeout`) until the watch has delivered resourceVersion `rv` or later.
    pub fn wait_for(&self, rv: u64, timeout: std::time::Duration) -> bool {
        super::topology::wait_until(timeout, || self.state.lock().unwrap().last_rv >= rv)
    }

    /// The Services as last seen.
    pub fn services(&self) -> Vec<Service> {
        self.state.lock().unwrap().services.values().cloned().collect()
    }
}

impl Drop for AllocationWatch {
    fn drop(&mut self) {
        self.task.abort();
    }
}
