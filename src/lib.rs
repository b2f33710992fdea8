//! nodelb: a node agent that makes Kubernetes `type: LoadBalancer` Services reachable at
//! `<node-ip>:<allocated-port>` by programming nftables over netlink.
//!
//! Flow: observe (`manifests`) → validate (`model`) → allocate (`alloc`) → plan (`plan`, pure) →
//! encode and apply (`nft`). Only the edges do I/O.

pub mod ir;
pub mod model;
pub mod nft;
pub mod plan;
pub mod status;
pub mod sysctl;
pub mod trace;
