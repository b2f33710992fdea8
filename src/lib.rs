//! nodelb: a node agent that makes Kubernetes `type: LoadBalancer` Services reachable at
//! `<node-ip>:<allocated-port>` by programming nftables over netlink.
//!
//! Flow: observe (`manifests`) → validate (`model`) → allocate (`alloc`) → plan (`plan`, pure) →
//! encode and apply (`nft`). Only the edges do I/O.

pub mod access;
pub mod agent;
pub mod alloc;
pub mod bounded;
pub mod bridge;
pub mod cli;
pub mod commands;
pub mod conntrack;
pub mod counters;
pub mod dataplane;
mod debounce;
pub mod desired;
pub mod dir_watch;
pub mod domain;
pub mod endpoint_policy;
pub mod firewall;
pub mod hairpin;
pub mod hostaddrs;
pub mod hostfw;
pub mod http;
pub mod ir;
pub mod k8s;
pub mod kernel;
#[cfg(test)]
pub mod kernel_fake;
pub mod kernel_support;
pub mod listeners;
pub mod locks;
pub mod manifest_dir;
pub mod manifests;
pub mod metrics;
pub mod model;
pub mod nft;
pub mod plan;
pub mod port_policy;
pub mod report;
pub mod schedule;
#[cfg(any(test, feature = "testing"))]
pub mod simulate;
pub mod slim;
pub mod source;
pub mod state;
pub mod status;
pub mod sysctl;
pub mod tls;
#[cfg(any(test, feature = "testing"))]
pub mod trace;
pub mod xt;
pub mod xtables;
