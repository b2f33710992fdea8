//! The resource types the test API server serves.

/// One served resource type (group/version/plural) and the storage strategy facts we emulate.
#[derive(Debug, PartialEq, Eq)]
pub struct ResourceType {
    /// API group; `""` for the core group.
    pub group: &'static str,
    pub version: &'static str,
    pub plural: &'static str,
    pub kind: &'static str,
    pub namespaced: bool,
    /// Has a `/status` subresource: the main resource ignores `status` changes and `/status` ignores
    /// everything but `status`.
    pub status_subresource: bool,
    /// `status` is cleared on create (Services do this; Nodes keep what the kubelet sends).
    pub reset_status_on_create: bool,
    /// DELETE answers with the deleted object (Services) rather than a `Status` of success.
    pub return_deleted_object: bool,
    pub short_names: &'static [&'static str],
}

impl ResourceType {
    /// `v1` or `group/version`.
    pub fn api_version(&self) -> String {
        if self.group.is_empty() {
            self.version.to_string()
        } else {
            format!("{}/{}", self.group, self.version)
        }
    }

    /// The list kind, e.g. `ServiceList`.
    pub fn list_kind(&self) -> String {
        format!("{}List", self.kind)
    }

    pub(crate) fn singular(&self) -> String {
        self.kind.to_ascii_lowercase()
    }
}

const fn rt(
    group: &'static str,
    version: &'static str,
    plural: &'static str,
    kind: &'static str,
    namespaced: bool,
) -> ResourceType {
    ResourceType {
        group,
        version,
        plural,
        kind,
        namespaced,
        status_subresource: false,
        reset_status_on_create: false,
        return_deleted_object: false,
        short_names: &[],
    }
}

/// Everything served. The index into this table is the resource's identity inside the store.
pub static RESOURCES: &[ResourceType] = &[
    ResourceType {
        status_subresource: true,
        reset_status_on_create: true,
        return_deleted_object: true,
        short_names: &["svc"],
        ..rt("", "v1", "services", "Service", true)
    },
    ResourceType { status_subresource: true, short_names: &["no"], ..rt("", "v1", "nodes", "Node", false) },
    ResourceType { short_names: &["ev"], ..rt("", "v1", "events", "Event", true) },
    ResourceType {
        status_subresource: true,
        short_names: &["ns"],
        ..rt("", "v1", "namespaces", "Namespace", false)
    },
    ResourceType { short_names: &["ev"], ..rt("events.k8s.io", "v1", "events", "Event", true) },
    rt("discovery.k8s.io", "v1", "endpointslices", "EndpointSlice", true),
    rt("coordination.k8s.io", "v1", "leases", "Lease", true),
];

/// Index of the `namespaces` resource.
pub(crate) const NAMESPACES: usize = 3;

pub(crate) fn find(group: &str, version: &str, plural: &str) -> Option<usize> {
    RESOURCES.iter().position(|r| r.group == group && r.version == version && r.plural == plural)
}

pub(crate) fn find_by_kind(api_version: &str, kind: &str) -> Option<usize> {
    RESOURCES.iter().position(|r| r.api_version() == api_version && r.kind == kind)
}
