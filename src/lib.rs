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
pub mod desired;
pub mod endpoint_policy;
pub mod firewall;
pub mod hairpin;
pub mod hostaddrs;
pub mod hostfw;
pub mod http;
pub mod ir;
pub mod k8s;
pub mod listeners;
pub mod manifests;
pub mod metrics;
pub mod model;
pub mod nft;
pub mod plan;
pub mod pool;
pub mod port_policy;
pub mod servicelb;
pub mod slim;
pub mod source;
pub mod state;
pub mod status;
pub mod sysctl;
pub mod tls;
pub mod trace;
pub mod xt;
pub mod xtables;
