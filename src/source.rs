//! The sources of desired state behind one interface: a manifests directory, or the Kubernetes
//! API. Each gives a snapshot (Services + EndpointSlices), says whether it is complete (never
//! program from a partial view), and wakes the agent when something changed.

use std::path::PathBuf;

use k8s_openapi::api::core::v1::Service;
use k8s_openapi::api::discovery::v1::EndpointSlice;

use crate::desired::AllocationMode;
use crate::k8s::lastgood::LastGoodServices;
use crate::k8s::source::KubeSource;
use crate::manifests::{self, DirWatcher, IgnoredLog, LastGood, ManifestCache, ManifestError};
use crate::model::ModelOptions;

/// What the agent programs from.
#[derive(Debug, Clone, Default)]
pub struct Snapshot {
    pub services: Vec<Service>,
    pub slices: Vec<EndpointSlice>,
    /// Input problems to report (manifest files, refusals masked by a last good version).
    pub problems: Vec<String>,
    /// Same value ⇒ same content (Kubernetes mode); `None` ⇒ always recompute.
    pub fingerprint: Option<u64>,
}

pub enum Source {
    Manifests {
        dir: PathBuf,
        watcher: DirWatcher,
        last_good: LastGood,
        cache: ManifestCache,
        ignored: IgnoredLog,
    },
    Kube {
        source: KubeSource,
        last_good: LastGoodServices,
    },
}

impl Source {
    /// Watches DIR (the watch starts before the first read, so no change is lost).
    pub fn manifests(dir: PathBuf) -> Result<Source, ManifestError> {
        let watcher = DirWatcher::new(&dir)?;
        Ok(Source::Manifests {
            dir,
            watcher,
            last_good: LastGood::default(),
            cache: ManifestCache::default(),
            ignored: IgnoredLog::default(),
        })
    }

    pub fn kube(source: KubeSource) -> Source {
        Source::Kube { source, last_good: LastGoodServices::default() }
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

    /// The current desired state; `Ok(None)` while the source is not complete yet. An error
    /// means it could not be read at all (keep the kernel as it is).
    pub fn snapshot(&mut self, opts: &ModelOptions) -> Result<Option<Snapshot>, ManifestError> {
        match self {
            Source::Manifests { dir, last_good, cache, ignored, .. } => {
                // Only files whose stamp changed are parsed again.
                let loaded = last_good.apply(manifests::load_dir_cached(dir, cache)?);
                // Not a problem (manifests often hold a whole app), but say so once, so a
                // misspelled `kind: Service` does not vanish silently.
                for o in ignored.newly_ignored(&loaded.ignored) {
                    tracing::info!("{o}: nodelb uses only v1 Service and discovery.k8s.io/v1 EndpointSlice");
                }
                Ok(Some(Snapshot {
                    services: loaded.services,
                    slices: loaded.slices,
                    problems: loaded.problems.iter().map(|p| p.to_string()).collect(),
                    fingerprint: Some(cache.fingerprint()),
                }))
            }
            Source::Kube { source, last_good } => {
                if !source.complete() {
                    return Ok(None);
                }
                let snap = source.snapshot();
                let fingerprint = Some(snap.fingerprint());
                let subst = last_good.apply(&snap.services, opts);
                Ok(Some(Snapshot {
                    services: subst.services,
                    slices: snap.slices,
                    problems: subst
                        .masked
                        .iter()
                        .map(|r| format!("{r}; keeping its last valid spec until this is fixed"))
                        .collect(),
                    fingerprint,
                }))
            }
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
