//! nodelb: a node agent that makes Kubernetes `type: LoadBalancer` Services reachable at
//! `<node-ip>:<allocated-port>` by programming nftables over netlink.
//!
//! Flow: observe (`source`) → validate (`model`) → allocate (`alloc`) → plan (`plan`, pure) →
//! encode and apply (`nft`). Only the edges do I/O.

pub mod alloc;
pub mod ir;
pub mod manifests;
pub mod model;
pub mod state;
