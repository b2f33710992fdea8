//! Kubernetes mode: watch Services, EndpointSlices, Nodes (and our Leases), let one leader
//! allocate node ports and publish status, and keep a per-node Lease saying what this node serves.
//!
//! Pure decisions live in [`dupes`], [`nodes`], [`publish`], [`leader`], [`events`]; the edges
//! that talk to the API server are [`source`] (reflectors), [`controller`] (leader election, node
//! Lease, writes, Events), [`review`] (TokenReview + SubjectAccessReview for the authenticated
//! metrics). [`installation`] watches what tells an uninstall from a restart, and [`uninstall`]
//! decides at SIGTERM whether the node's rules stay. See docs/design.md, "Kubernetes mode" and
//! "Install, upgrade, uninstall".

pub mod controller;
pub mod installation;
pub mod pools;
pub mod review;
pub mod source;

/// The pure decisions of Kubernetes mode (`crates/core/src/k8s`).
pub use nodelb_core::k8s::{claims, dupes, events, lastgood, leader, nodes, publish, scope, uninstall};
