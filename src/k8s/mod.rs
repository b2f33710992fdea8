//! Kubernetes mode: the node agents and the controller watch Services, EndpointSlices, Nodes
//! (and nodelb's Leases); the controller's leader allocates node ports and publishes status, and
//! each node agent keeps a per-node Lease saying what its node serves.
//!
//! Pure decisions live in [`dupes`], [`nodes`], [`publish`], [`leader`], [`events`]; the edges
//! that talk to the API server are [`source`] (reflectors), [`controller`] (the leader's loop:
//! reads the registry, runs [`round`], the leader's pure round, and writes what it planned), [`election`] (the controller's leader Lease), [`node_lease`] (a
//! node's own Lease, with the report `nodelb status --cluster` reads ([`cluster_view`]), and
//! Node Events), [`api`] (what those writers share), [`review`]
//! (TokenReview + SubjectAccessReview for the authenticated metrics). [`installation`] watches what tells an uninstall from a restart, and [`uninstall`]
//! decides at SIGTERM whether the node's rules stay. See docs/design.md, "Kubernetes mode" and
//! "Install, upgrade, uninstall".

pub mod api;
pub mod controller;
pub mod election;
pub mod installation;
pub mod metrics;
pub mod node_lease;
pub mod pools;
pub mod review;
pub mod round;
pub mod source;

/// The pure decisions of Kubernetes mode (`crates/core/src/k8s`).
pub use nodelb_core::k8s::{
    claims, cluster_view, dupes, events, lastgood, leader, nodes, publish, scope, uninstall,
};
