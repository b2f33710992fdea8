//! nodelb's pure core: no I/O, no clock but the one it is given, no async. Everything here is a
//! function of its arguments, tested table-driven; the agent (the `nodelb` crate) does the I/O
//! around it. The crate's dependencies are plain data and parsing only, so the compiler keeps it
//! that way (docs/design.md, "Module map").
//!
//! The folders, in the order a sync uses them:
//! - [`domain`]: the shared words.
//! - [`inputs`]: what the objects and files mean.
//! - [`decisions`]: pools, ports, endpoints, and one sync's decision.
//! - [`ruleset`]: the nftables ruleset the decision becomes, and what reads it.
//! - [`incremental`]: only what changed, between syncs.
//! - [`reports`]: counters and per-Service reports.
//! - [`k8s`]: Kubernetes mode's decisions, the leader's round among them.

pub mod decisions;
pub mod domain;
pub mod incremental;
pub mod inputs;
pub mod k8s;
pub mod reports;
pub mod ruleset;
