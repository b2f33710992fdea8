//! The sources of desired state behind one interface: a manifests directory, or the Kubernetes
//! API. Each gives a snapshot (Services + EndpointSlices), says whether it is complete (never
//! program from a partial view), and wakes the agent when something changed.

use std::hash::{Hash, Hasher};
use std::path::PathBuf;
use std::sync::Arc;

use crate::core::inputs::compact::EndpointSlice;
use k8s_openapi::api::core::v1::Service;

use crate::core::decisions::desired::{AllocationMode, SourceNotes};
use crate::core::decisions::pool::{LastValid, PoolContext};
use crate::core::decisions::port_policy::PortRange;
use crate::core::inputs::manifests::{IgnoredLog, LastGood};
use crate::core::inputs::model::{ModelOptions, Refusal};
use crate::core::k8s::claims::{ReadRegistry, Registry};
use crate::core::k8s::lastgood::LastGoodServices;
use crate::k8s::source::{KubeSource, NodeViews};
use crate::observe::dir_watch::{DirWatcher, WatchError};
use crate::observe::manifest_dir::{ManifestCache, ManifestError};

/// What the agent programs from. The objects are shared with the source's caches (a snapshot
/// copies pointers, not objects).
#[derive(Debug, Clone, Default)]
pub struct Snapshot {
    pub services: Vec<Arc<Service>>,
    pub slices: Vec<Arc<EndpointSlice>>,
    /// Input problems to report (manifest files, refusals masked by a last good version).
    pub problems: Vec<String>,
    /// Services refused before the model sees them, and Services served from a last good version.
    pub notes: SourceNotes,
    /// Same value ⇒ same content; `None` ⇒ always recompute.
    pub fingerprint: Option<Fingerprint>,
    /// Node port pools (`None`: the flags' range for everything).
    pub pools: Option<Box<PoolContext>>,
    /// Kubernetes mode: the node-port registry, the record of who holds each number
    /// ([`crate::core::decisions::desired::Inputs::registry`]).
    pub registry: Option<Registry>,
}

pub use super::fingerprint::Fingerprint;

/// Manifests mode's pool facts that come from flags: there is no Node object.
#[derive(Debug, Clone)]
pub struct ManifestPools {
    /// `--node-labels`: what pools' `nodeSelector`s match.
    pub node_labels: std::collections::BTreeMap<String, String>,
    /// `--port-range`: the implicit pool while the directory holds no pool object.
    pub port_range: PortRange,
}

/// What [`Source::snapshot`] found.
#[derive(Debug)]
pub enum Loaded {
    /// The source is not completely read yet (never program from a partial view).
    Waiting,
    /// The fingerprint is the one the caller already has: nothing was built.
    Unchanged,
    /// Only what the node cannot program yet changed ([`Fingerprint::pending`]), and the caller
    /// allowed that to wait: nothing was built.
    Deferred,
    Snapshot(Snapshot),
}

pub enum Source {
    Manifests {
        dir: PathBuf,
        watcher: DirWatcher,
        last_good: LastGood,
        cache: ManifestCache,
        ignored: IgnoredLog,
        pools: ManifestPools,
        pools_last_valid: LastValid,
    },
    Kube {
        source: KubeSource,
        /// Boxed: the largest part of the variant, and only ever used through a reference.
        last_good: Box<LastGoodServices>,
        /// Boxed, as `last_good`.
        views: Box<NodeViews>,
        /// This node (pools select nodes by label) and the flags' range (no pool object).
        node: String,
        port_range: PortRange,
        pools_last_valid: LastValid,
        /// The node-port registry as last read (a block at the version parsed is not parsed
        /// again), and how many times the owner of a number changed in it: what the fingerprint
        /// reads of it (a claim resolved by its leader changes its block, not its owner).
        registry: Option<ReadRegistry>,
        registry_changes: u64,
    },
}

impl Source {
    /// Watches DIR (the watch starts before the first read, so no change is lost).
    pub fn manifests(dir: PathBuf, pools: ManifestPools) -> Result<Source, WatchError> {
        let watcher = DirWatcher::new(&dir)?;
        Ok(Source::Manifests {
            dir,
            watcher,
            last_good: LastGood::default(),
            cache: ManifestCache::default(),
            ignored: IgnoredLog::default(),
            pools,
            pools_last_valid: LastValid::default(),
        })
    }

    pub fn kube(source: KubeSource, node: String, port_range: PortRange) -> Source {
        Source::Kube {
            source,
            last_good: Box::default(),
            views: Box::default(),
            node,
            port_range,
            pools_last_valid: LastValid::default(),
            registry: None,
            registry_changes: 0,
        }
    }

    /// The trigger times of the EndpointSlice changes the last successful sync programmed
    /// ([`NodeViews::take_triggers`]); manifests have none.
    pub fn take_programming_triggers(&mut self) -> Vec<k8s_openapi::jiff::Timestamp> {
        match self {
            Source::Manifests { .. } => Vec::new(),
            Source::Kube { views, .. } => views.take_triggers(),
        }
    }

    pub fn mode(&self) -> AllocationMode {
        match self {
            Source::Manifests { .. } => AllocationMode::Allocate,
            Source::Kube { .. } => AllocationMode::Annotated,
        }
    }

    pub fn describe(&self) -> String {
        match self {
            Source::Manifests { dir, .. } => format!("manifests {}", dir.display()),
            Source::Kube { .. } => "kubernetes".to_string(),
        }
    }

    /// The current desired state. When its fingerprint equals `known` (what the caller built its
    /// last state from), [`Loaded::Unchanged`]: the object lists are not even assembled (the
    /// periodic resync of an unchanged cluster); when only its pending part differs and `may_defer`,
    /// [`Loaded::Deferred`]. An error means the source could not be read at all (keep the kernel
    /// as it is).
    pub fn snapshot(
        &mut self,
        opts: &ModelOptions,
        known: Option<Fingerprint>,
        may_defer: bool,
    ) -> Result<Loaded, ManifestError> {
        match self {
            Source::Manifests { dir, last_good, cache, ignored, pools, pools_last_valid, .. } => {
                // Only files whose stamp changed are parsed again.
                cache.refresh(dir)?;
                let fingerprint = Fingerprint { programmed: cache.fingerprint(), pending: 0 };
                if known == Some(fingerprint) {
                    return Ok(Loaded::Unchanged);
                }
                let loaded = last_good.apply(cache.merged());
                // Not a problem (manifests often hold a whole app), but say so once, so a
                // misspelled `kind: Service` does not vanish silently.
                for o in ignored.newly_ignored(&loaded.ignored) {
                    tracing::info!(
                        "{o}: nodelb uses only v1 Service, discovery.k8s.io/v1 EndpointSlice and nodelb.io/v1alpha1 NodePortPool"
                    );
                }
                let (ctx, pool_problems) = crate::core::inputs::manifests::pool_context(
                    &loaded,
                    pools_last_valid,
                    pools.port_range,
                    &pools.node_labels,
                    opts.servicelb_labels,
                );
                let refused = loaded
                    .invalid_services
                    .iter()
                    .map(|i| Refusal::Invalid { service: i.key.clone(), reason: i.problem.to_string() })
                    .collect();
                Ok(Loaded::Snapshot(Snapshot {
                    services: loaded.services,
                    slices: loaded.slices,
                    problems: loaded.problems.iter().map(|p| p.to_string()).chain(pool_problems).collect(),
                    notes: SourceNotes { refused, stale: loaded.stale },
                    fingerprint: Some(fingerprint),
                    pools: Some(Box::new(ctx)),
                    registry: None,
                }))
            }
            Source::Kube {
                source,
                last_good,
                views,
                node,
                port_range,
                pools_last_valid,
                registry,
                registry_changes,
            } => {
                if !source.complete() {
                    return Ok(Loaded::Waiting);
                }
                let snap = source.snapshot();
                let before = registry.take();
                let (mut read, problems) = ReadRegistry::read(&snap.registry, before.clone());
                // A deleted registry Lease does not take the record with it: the claims last
                // seen stay in force until the leader writes the block again.
                if let Some(before) = &before {
                    for b in read.keep_lost(before) {
                        tracing::warn!(
                            lease = %crate::core::k8s::claims::lease_name(b),
                            "node-port registry Lease gone: programming by its last claims until the leader writes it again"
                        );
                    }
                }
                let changed = before.is_none_or(|b| !read.registry.owners_changed(&b.registry).is_empty());
                if changed {
                    *registry_changes += 1;
                    for p in &problems {
                        tracing::debug!(problem = %p, "node-port registry");
                    }
                }
                let recorded = read.registry.clone();
                *registry = Some(read);
                let (pools, invalid) = crate::core::k8s::pools::context(
                    &snap,
                    pools_last_valid,
                    *port_range,
                    Some(node),
                    opts.servicelb_labels,
                );
                let fingerprint = {
                    let objects = views.fingerprint(&snap, opts);
                    let mut h = std::collections::hash_map::DefaultHasher::new();
                    (objects.programmed, &pools, *registry_changes).hash(&mut h);
                    Fingerprint { programmed: h.finish(), pending: objects.pending }
                };
                if known == Some(fingerprint) {
                    return Ok(Loaded::Unchanged);
                }
                if may_defer && known.is_some_and(|k| k.programmed == fingerprint.programmed) {
                    return Ok(Loaded::Deferred);
                }
                let subst = last_good.apply(&snap.services, None, opts);
                let stale = subst
                    .masked
                    .iter()
                    .map(|r| (r.service().clone(), format!("served from its last valid spec: {r}")))
                    .collect();
                Ok(Loaded::Snapshot(Snapshot {
                    services: subst.services,
                    slices: snap.slices,
                    problems: subst
                        .masked
                        .iter()
                        .map(|r| format!("{r}; keeping its last valid spec until this is fixed"))
                        .chain(invalid.iter().map(|p| p.to_string()))
                        .collect(),
                    notes: SourceNotes { refused: vec![], stale },
                    fingerprint: Some(fingerprint),
                    pools: Some(Box::new(pools)),
                    registry: Some(recorded),
                }))
            }
        }
    }

    /// Addresses of the cluster's nodes (Kubernetes mode: every Node object's, which endpoints
    /// must not be, and this node's own by type, which pools select); manifests mode knows none
    /// beyond this node's own.
    pub fn node_addresses(&self) -> crate::core::decisions::endpoint_policy::HostAddresses {
        match self {
            Source::Manifests { .. } => Default::default(),
            Source::Kube { source, node, .. } => source.node_addresses(node),
        }
    }

    /// Resolves when the source changed (bursts coalesced).
    pub async fn changed(&mut self) {
        match self {
            Source::Manifests { watcher, .. } => {
                if let Err(e) = watcher.changed().await {
                    tracing::warn!(error = %e, "manifests watch failed; relying on the resync period");
                    std::future::pending::<()>().await;
                }
            }
            Source::Kube { source, .. } => source.changed().await,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SVC: &str = "apiVersion: v1\nkind: Service\nmetadata:\n  name: web\nspec:\n  type: LoadBalancer\n  ports:\n  - port: 80\n";

    fn snapshot(source: &mut Source, known: Option<Fingerprint>) -> Snapshot {
        match source.snapshot(&ModelOptions::default(), known, true).expect("readable") {
            Loaded::Snapshot(s) => s,
            other => panic!("expected a snapshot, got {other:?}"),
        }
    }

    /// A resync with the fingerprint the agent already has builds nothing; an edited file gives a
    /// new snapshot in which the objects of untouched files are the very same (shared) objects.
    #[tokio::test]
    async fn manifests_snapshots_share_objects_and_skip_unchanged_input() {
        let dir = tempfile::tempdir().expect("tempdir");
        std::fs::write(dir.path().join("a.yaml"), SVC).unwrap();
        std::fs::write(dir.path().join("b.yaml"), SVC.replace("name: web", "name: db")).unwrap();
        let pools = ManifestPools { node_labels: Default::default(), port_range: PortRange::default() };
        let mut source = Source::manifests(dir.path().to_path_buf(), pools).expect("watch");
        let first = snapshot(&mut source, None);
        let fp = first.fingerprint.expect("manifests have a fingerprint");
        assert!(matches!(source.snapshot(&ModelOptions::default(), Some(fp), true), Ok(Loaded::Unchanged)));
        let again = snapshot(&mut source, None);
        assert_eq!(again.fingerprint, Some(fp), "same files, same fingerprint");
        assert!(first.services.iter().zip(&again.services).all(|(a, b)| Arc::ptr_eq(a, b)));

        std::fs::write(dir.path().join("b.yaml"), SVC.replace("name: web", "name: db2")).unwrap();
        let edited = snapshot(&mut source, Some(fp));
        assert_ne!(edited.fingerprint, Some(fp));
        let names: Vec<_> = edited.services.iter().map(|s| s.metadata.name.clone().unwrap()).collect();
        assert_eq!(names, ["web", "db2"]);
        assert!(Arc::ptr_eq(&first.services[0], &edited.services[0]), "a.yaml was not parsed again");
    }
}
