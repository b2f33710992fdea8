//! What nodelb keeps of the Kubernetes objects it caches: exactly the fields it reads, nothing
//! else. Applied once, when an object enters a cache (a manifest file is parsed, a watch event
//! arrives), so the objects kept for as long as they exist (every Service and EndpointSlice of
//! the cluster) carry no pod references, topology hints, selectors, foreign annotations or
//! spare vector capacity. Pure.
//!
//! Allow-lists, not deny-lists: a field nodelb starts reading must be added here (the tests
//! below compare the model, the leader's writes and the serving nodes computed from full and from
//! slimmed objects, so a field read but dropped fails them). The list and the reasons are in
//! docs/design/memory.md.

use std::collections::BTreeMap;

use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::{
    ClientIPConfig, Namespace, Node, NodeStatus, Service, ServicePort, ServiceSpec, SessionAffinityConfig,
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;

use crate::inputs::compact::EndpointSlice;
use crate::inputs::model::{
    ANNOTATION_ALLOCATED, ANNOTATION_IGNORE, ANNOTATION_LEGACY_SOURCE_RANGES, ANNOTATION_PORTS,
};

/// The Service annotations nodelb reads (model, leader, pool selection).
pub const SERVICE_ANNOTATIONS: [&str; 5] = [
    ANNOTATION_PORTS,
    ANNOTATION_ALLOCATED,
    ANNOTATION_IGNORE,
    ANNOTATION_LEGACY_SOURCE_RANGES,
    crate::decisions::pool::ANNOTATION_POOL,
];

/// An object nodelb caches, slimmed in place before it is kept.
pub trait Slim {
    fn slim(&mut self);
}

impl Slim for Service {
    /// Keeps: identity and versions (name, namespace, uid, resourceVersion, generation,
    /// creationTimestamp, deletionTimestamp), the annotations of [`SERVICE_ANNOTATIONS`] and of
    /// other implementations ([`crate::inputs::model::OTHER_IMPLEMENTATIONS`]), the
    /// spec fields the model validates (session affinity and its timeout included), and the whole status (the leader writes the ingress and
    /// the conditions it does not own back as they are).
    fn slim(&mut self) {
        // Labels: node port pools select Services by them (serviceSelector).
        // Another implementation's annotations say the Service is not nodelb's.
        let keep = |k: &str| {
            SERVICE_ANNOTATIONS.contains(&k) || crate::inputs::model::names_another_implementation(k)
        };
        slim_meta(&mut self.metadata, keep, |_| true);
        self.spec = self.spec.take().map(|spec| ServiceSpec {
            type_: spec.type_,
            load_balancer_class: spec.load_balancer_class,
            ports: spec.ports.map(|ports| {
                shrunk(
                    ports
                        .into_iter()
                        .map(|p| ServicePort {
                            name: p.name,
                            port: p.port,
                            protocol: p.protocol,
                            // kube-proxy's NodePort for it: a way around what nodelb enforces.
                            node_port: p.node_port,
                            ..Default::default()
                        })
                        .collect(),
                )
            }),
            ip_families: spec.ip_families.map(shrunk),
            cluster_ip: spec.cluster_ip,
            cluster_ips: spec.cluster_ips.map(shrunk),
            external_traffic_policy: spec.external_traffic_policy,
            load_balancer_source_ranges: spec.load_balancer_source_ranges.map(shrunk),
            session_affinity: spec.session_affinity,
            session_affinity_config: spec.session_affinity_config.map(|c| SessionAffinityConfig {
                client_ip: c.client_ip.map(|ip| ClientIPConfig { timeout_seconds: ip.timeout_seconds }),
            }),
            ..Default::default()
        });
    }
}

impl Slim for EndpointSlice {
    /// Its own compact type ([`crate::inputs::compact`]) reads only what nodelb uses (its Service's
    /// label moved to a field of its own); of its metadata, identity and versions stay.
    fn slim(&mut self) {
        slim_meta(&mut self.metadata, |_| false, |_| false);
        if let Some(endpoints) = &mut self.endpoints {
            endpoints.shrink_to_fit();
        }
        if let Some(ports) = &mut self.ports {
            ports.shrink_to_fit();
        }
    }
}

impl Slim for Node {
    /// Keeps: identity and versions, the labels (the exclude-from-external-load-balancers label,
    /// pools' nodeSelector), and the
    /// addresses (the leader's ingress). Drops the spec and the rest of the status (image lists,
    /// conditions, capacity: the bulk of a Node).
    fn slim(&mut self) {
        // Every label: node port pools select nodes by them (nodeSelector).
        slim_meta(&mut self.metadata, |_| false, |_| true);
        self.spec = None;
        self.status = self
            .status
            .take()
            .map(|s| NodeStatus { addresses: s.addresses.map(shrunk), ..Default::default() });
    }
}

impl Slim for Namespace {
    /// Keeps identity and labels (node port pools' namespaceSelector); drops spec and status.
    fn slim(&mut self) {
        slim_meta(&mut self.metadata, |_| false, |_| true);
        self.spec = None;
        self.status = None;
    }
}

impl Slim for k8s_openapi::api::networking::v1::ServiceCIDR {
    /// Keeps its name and CIDRs (no endpoint may lie inside them).
    fn slim(&mut self) {
        slim_meta(&mut self.metadata, |_| false, |_| false);
        self.status = None;
    }
}

impl Slim for crate::decisions::pool::NodePortPool {
    /// Our own small objects, read whole: only the managed fields go.
    fn slim(&mut self) {
        self.metadata.managed_fields = None;
    }
}

impl Slim for Lease {
    /// Our own small objects, read whole (holder, times, the families annotation): only the
    /// managed fields go.
    fn slim(&mut self) {
        self.metadata.managed_fields = None;
    }
}

/// Keeps identity, versions and timestamps; the annotations and labels `keep_*` accept (the map
/// becomes `None` when nothing is left). Drops managedFields (a JSON tree per field manager),
/// ownerReferences, finalizers, generateName, selfLink, deletionGracePeriodSeconds.
fn slim_meta(
    meta: &mut ObjectMeta,
    keep_annotation: impl Fn(&str) -> bool,
    keep_label: impl Fn(&str) -> bool,
) {
    let m = std::mem::take(meta);
    *meta = ObjectMeta {
        name: m.name,
        namespace: m.namespace,
        uid: m.uid,
        resource_version: m.resource_version,
        generation: m.generation,
        creation_timestamp: m.creation_timestamp,
        deletion_timestamp: m.deletion_timestamp,
        annotations: filtered(m.annotations, keep_annotation),
        labels: filtered(m.labels, keep_label),
        ..Default::default()
    };
}

fn filtered(
    map: Option<BTreeMap<String, String>>,
    keep: impl Fn(&str) -> bool,
) -> Option<BTreeMap<String, String>> {
    let mut map = map?;
    map.retain(|k, _| keep(k));
    (!map.is_empty()).then_some(map)
}

/// Without the spare capacity serde's growth left (a 5-endpoint list has room for 8).
fn shrunk<T>(mut v: Vec<T>) -> Vec<T> {
    v.shrink_to_fit();
    v
}

/// A hash of what a node reads of a (slimmed) Service: all of it but its resourceVersion, its
/// ingress (but whether another load balancer wrote it) and its conditions, except the leader's
/// refusal of an allocation (its message is the node's status line). The leader's status writes change none of it, so a node skips the sync
/// they would cause (a node joining or leaving makes the leader rewrite every Service's ingress).
pub fn node_view_hash(svc: &Service) -> u64 {
    use std::hash::{Hash, Hasher};
    let refused = crate::inputs::model::refused_allocation(svc).map(|c| (&c.reason, &c.message));
    let meta = ObjectMeta { resource_version: None, ..svc.metadata.clone() };
    let mut h = std::collections::hash_map::DefaultHasher::new();
    // Whether the status is another load balancer's is all a node reads of the ingress.
    crate::inputs::model::foreign_ingress(svc).is_some().hash(&mut h);
    // JSON: the k8s-openapi types are not `Hash`; maps serialize in key order.
    match serde_json::to_vec(&(&meta, &svc.spec, refused)) {
        Ok(bytes) => bytes.hash(&mut h),
        // Not serializable (never for these types): a hash no other version shares.
        Err(_) => (&svc.metadata.uid, &svc.metadata.resource_version).hash(&mut h),
    }
    h.finish()
}

/// Whether two versions of a Service read the same to a node: what [`node_view_hash`] hashes,
/// compared (no hash, no copy), and whether another load balancer wrote its status. A leader's status write (ingress, its other conditions) or an
/// equal copy from a relist gives a new version that does; a node's sync then keeps what it
/// built from the old one ([`crate::incremental::view::ViewChanges::rebased`]). Every metadata field is named,
/// so a field a new API version adds is a compile error here, not a change a node misses.
pub fn same_for_node(a: &Service, b: &Service) -> bool {
    let ObjectMeta {
        annotations,
        creation_timestamp,
        deletion_grace_period_seconds,
        deletion_timestamp,
        finalizers,
        generate_name,
        generation,
        labels,
        managed_fields,
        name,
        namespace,
        owner_references,
        resource_version: _,
        self_link,
        uid,
    } = &a.metadata;
    let m = &b.metadata;
    let refused = |s| crate::inputs::model::refused_allocation(s).map(|c| (&c.reason, &c.message));
    *name == m.name
        && *namespace == m.namespace
        && *uid == m.uid
        && *generation == m.generation
        && *annotations == m.annotations
        && *labels == m.labels
        && *creation_timestamp == m.creation_timestamp
        && *deletion_timestamp == m.deletion_timestamp
        && *deletion_grace_period_seconds == m.deletion_grace_period_seconds
        && *finalizers == m.finalizers
        && *generate_name == m.generate_name
        && *managed_fields == m.managed_fields
        && *owner_references == m.owner_references
        && *self_link == m.self_link
        && a.spec == b.spec
        && refused(a) == refused(b)
        && crate::inputs::model::foreign_ingress(a).is_some()
            == crate::inputs::model::foreign_ingress(b).is_some()
}

#[cfg(test)]
mod tests;
