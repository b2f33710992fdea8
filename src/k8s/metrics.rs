//! The Kubernetes API's failure counters, which the reflectors, the node Lease task and the
//! controller's writers share (registered by `serve::metrics` with the rest of a workload's).

use prometheus::{IntCounterVec, Opts, Registry};

/// The Kubernetes API's failures, as both workloads count them.
#[derive(Clone)]
pub struct KubeMetrics {
    pub watch_errors: IntCounterVec,
    pub watch_restarts: IntCounterVec,
    pub api_errors: IntCounterVec,
}

impl KubeMetrics {
    /// Registers the three counters in `registry`; `resources`: the watched kinds, `operations`:
    /// the `api_errors` label values this workload has (each series starts at 0).
    pub fn register(
        registry: &Registry,
        resources: &[&str],
        operations: &[&str],
    ) -> prometheus::Result<KubeMetrics> {
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
                "Failed Kubernetes API writes/reads outside the watches, by operation (node: node_lease, event; controller: lease, service, registry, nodeportpool, event).",
            ),
            &["operation"],
        )?;
        // Known label values start at 0, so dashboards and alerts see the series before the first event.
        for resource in resources {
            watch_errors.with_label_values(&[resource]).reset();
            watch_restarts.with_label_values(&[resource]).reset();
        }
        for operation in operations {
            api_errors.with_label_values(&[operation]).reset();
        }
        registry.register(Box::new(watch_errors.clone()))?;
        registry.register(Box::new(watch_restarts.clone()))?;
        registry.register(Box::new(api_errors.clone()))?;
        Ok(KubeMetrics { watch_errors, watch_restarts, api_errors })
    }
}
