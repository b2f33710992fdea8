//! nodelb: a node agent that makes Kubernetes `type: LoadBalancer` Services reachable at
//! `<node-ip>:<allocated-port>` by programming nftables over netlink.
//!
//! Flow: observe (`observe`, `k8s`) → plan (the pure core, crate `nodelb-core`, re-exported
//! here) → encode (`encode`) → apply (`apply`), driven by `agent`; `serve` answers HTTP and
//! metrics. Only this crate does I/O.

pub mod agent;
pub mod apply;
pub mod cli;
pub mod commands;
pub mod encode;
pub mod k8s;
pub mod locks;
pub mod memory;
pub mod observe;
pub mod serve;

/// The pure core (`crates/core`), as one namespace: `crate::core::ruleset::plan`,
/// `nodelb::core::inputs::model` (the whole decision from nothing, the incremental one's oracle,
/// with feature `testing`; the test oracles over the ruleset are the `nodelb-oracles` crate's).
pub use nodelb_core as core;

/// `nodelb --version` and each node's report: the crate's version and the commit it was built
/// from (build.rs).
pub const VERSION: &str = concat!(env!("CARGO_PKG_VERSION"), " (commit ", env!("NODELB_GIT_COMMIT"), ")");
