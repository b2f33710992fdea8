//! What the Kubernetes source hands the decisions: everything its caches hold at one moment
//! ([`KubeSnapshot`]), and what changed in them since the last look ([`Journal`]). Plain data;
//! the agent's reflectors fill both.

use std::collections::BTreeSet;
use std::sync::Arc;

use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::{Namespace, Node, Service};
use k8s_openapi::api::networking::v1::ServiceCIDR;

use crate::decisions::pool::NodePortPool;
use crate::domain::ServiceKey;
use crate::inputs::compact::EndpointSlice;

/// Everything the caches hold right now: the very objects of the reflector stores, shared (a
/// snapshot copies pointers, not objects).
#[derive(Debug, Clone, Default)]
pub struct KubeSnapshot {
    pub services: Vec<Arc<Service>>,
    pub slices: Vec<Arc<EndpointSlice>>,
    pub nodes: Vec<Arc<Node>>,
    pub leases: Vec<Arc<Lease>>,
    pub pools: Vec<Arc<NodePortPool>>,
    pub namespaces: Vec<Arc<Namespace>>,
    /// The node-port registry's Leases ([`super::claims::LABEL`]): which Service each number
    /// belongs to, as the nodes program it (the leader reads the registry itself, with its
    /// resourceVersions, at every round).
    pub registry: Vec<Arc<Lease>>,
    /// The cluster's Service CIDRs (no endpoint may lie inside them).
    pub service_cidrs: Vec<Arc<ServiceCIDR>>,
    /// The API server's EndpointSlice (`default/kubernetes`), when there is one.
    pub api_server: Vec<Arc<EndpointSlice>>,
}

impl KubeSnapshot {
    /// Everything the endpoint policy refuses as the cluster's own
    /// ([`super::nodes::cluster_addresses`]).
    pub fn cluster_addresses(&self) -> crate::decisions::endpoint_policy::HostAddresses {
        let more = super::nodes::ClusterObjects {
            leases: &self.leases,
            api_server: &self.api_server,
            service_cidrs: &self.service_cidrs,
        };
        super::nodes::cluster_addresses(&self.nodes, more)
    }
}

/// What changed in the caches since the source was last asked: each Service written (its key and
/// resourceVersion), and which caches changed otherwise (another kind, a deletion, a relist, or
/// more Service writes than it keeps).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Journal {
    pub services: Vec<(ServiceKey, Option<String>)>,
    /// The kinds (as the source names its caches: `Service`, `Lease`, …) that changed otherwise.
    pub others: BTreeSet<&'static str>,
    /// More Service writes came than it itemizes (`services` holds the first).
    pub truncated: bool,
}

impl Journal {
    /// Service writes it keeps; past that it only says that much changed.
    pub const MAX: usize = 1024;

    /// A Service written (added or modified), with its resourceVersion.
    pub fn service_written(&mut self, key: ServiceKey, resource_version: Option<String>) {
        if self.services.len() < Journal::MAX {
            self.services.push((key, resource_version));
        } else {
            self.truncated = true;
            self.others.insert("Service");
        }
    }

    /// Something else changed in the cache of `kind`.
    pub fn changed(&mut self, kind: &'static str) {
        self.others.insert(kind);
    }
}
