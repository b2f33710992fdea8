//! Kubernetes mode: the node agents and the controller watch Services, EndpointSlices, Nodes
//! (and nodelb's Leases); the controller's leader allocates node ports and publishes status, and
//! each node agent keeps a per-node Lease saying what its node serves.
//!
//! The pure decisions live in the core ([`crate::core::k8s`]: the leader's round, what it writes,
//! the node-port registry, which nodes serve, the pools, Events once per change, the election's
//! rules, uninstall or restart). This module holds only the edges that talk to the API server:
//! [`source`] (reflectors, filling a snapshot), [`controller`] (the leader's loop: reads the
//! registry, runs the round, writes what it planned), [`pool_status`] (the pools' status
//! writes), [`election`] (the controller's leader Lease), [`node_lease`] (a node's own Lease,
//! with the report `nodelb status --cluster` reads, and Node Events),
//! [`api`] (what those writers share), [`review`] (TokenReview + SubjectAccessReview for the
//! authenticated metrics), [`installation`] (what tells an uninstall from a restart). See
//! docs/design.md, "Kubernetes mode" and "Install, upgrade, uninstall".

pub mod api;
pub mod controller;
pub mod election;
pub mod installation;
pub mod metrics;
pub mod node_lease;
pub mod pool_status;
pub mod review;
pub mod source;
