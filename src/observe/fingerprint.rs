//! What identifies a source's snapshot, for both sources (the manifests directory and the
//! Kubernetes caches, `crate::k8s::source`), so that an unchanged input is not decided again.

/// Identifies a snapshot's content: equal values, the same desired state. In two parts, so that
/// a change of what the node cannot program yet (Kubernetes mode: Services waiting for the
/// leader's node ports, [`crate::k8s::source::NodeViews::fingerprint`]) can be told from one
/// that changes its rules. Manifests mode allocates by itself: all of it is `programmed`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Fingerprint {
    pub programmed: u64,
    pub pending: u64,
}
