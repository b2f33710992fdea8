//! What every writer to the API shares: the field manager, Events, and how a failing call is
//! logged and counted. Both workloads write through these (the controller its Services,
//! registry and leader Lease; a node agent its own Lease and its Node's Events).

use std::time::Instant;

use k8s_openapi::api::core::v1::ObjectReference;
use kube::api::PostParams;
use kube::runtime::events::{Event, EventType, Recorder};
use tracing::{debug, info, warn};

/// `reportingController` of our Events.
pub const CONTROLLER_NAME: &str = "nodelb.io/nodelb";

/// `fieldManager` of every write (shows in `managedFields`; `kubectl get --show-managed-fields`).
pub const FIELD_MANAGER: &str = "nodelb";

pub(super) fn post_params() -> PostParams {
    PostParams { field_manager: Some(FIELD_MANAGER.into()), ..Default::default() }
}

/// Logs a failing API call once (warn), its repetitions at debug, and the recovery once (info):
/// an API outage is a handful of lines, not one per retry.
pub(super) struct Failing {
    what: &'static str,
    pub(super) since: Option<Instant>,
    /// `nodelb_api_errors_total{operation=…}`: every failure counts, not only the logged one.
    errors: prometheus::IntCounter,
}

impl Failing {
    pub(super) fn new(what: &'static str, errors: prometheus::IntCounter) -> Self {
        Failing { what, since: None, errors }
    }

    pub(super) fn failed(&mut self, e: &kube::Error) {
        self.errors.inc();
        if self.since.is_none() {
            warn!(error = %e, "{}; retrying", self.what);
            self.since = Some(Instant::now());
        } else {
            debug!(error = %e, "{}; still retrying", self.what);
        }
    }

    pub(super) fn ok(&mut self) {
        if let Some(t) = self.since.take() {
            info!(after = ?t.elapsed(), "recovered (earlier: {})", self.what);
        }
    }
}

pub(super) fn is_conflict(e: &kube::Error) -> bool {
    matches!(e, kube::Error::Api(s) if s.code == 409)
}

/// Records one Event; `false` (logged, counted) when the API did not accept it.
pub(super) async fn publish_event(
    recorder: &Recorder,
    errors: &prometheus::IntCounterVec,
    reference: &ObjectReference,
    warning: bool,
    reason: &str,
    note: &str,
) -> bool {
    let ev = Event {
        type_: if warning { EventType::Warning } else { EventType::Normal },
        reason: reason.to_string(),
        note: Some(crate::core::k8s::events::event_note(note)),
        action: "Reconcile".to_string(),
        secondary: None,
    };
    match recorder.publish(&ev, reference).await {
        Ok(()) => true,
        Err(e) => {
            errors.with_label_values(&["event"]).inc();
            warn!(error = %e, reason, "cannot record Event; retrying at the next round");
            false
        }
    }
}
