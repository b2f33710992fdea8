//! nodelb's own compact forms of the Kubernetes objects it keeps for as long as they exist,
//! deserialized straight from the API's JSON (a list, a watch event) or a manifest's YAML: only
//! the fields nodelb reads, in types sized for them. The generated k8s-openapi types carry every
//! field of the API (an EndpointSlice endpoint is ~0.3 KiB before its strings: topology, hints,
//! target reference, zone, hostname); kept as those, the slices alone would be the largest part
//! of the agent's heap (docs/design/memory.md).
//!
//! The types implement the Kubernetes resource traits, so kube-runtime lists, watches and
//! reflects them like the generated ones. Fields keep the API's names and optionality, and read
//! the way the generated types read them (unknown fields ignored, `null` or a missing required
//! field as its default), so the model reads the same values. One difference, on purpose: an
//! endpoint address is parsed once, here, instead of kept as text and parsed by every sync; an
//! address that does not parse keeps its text, so the model still names it in its warning.
//! Pure.

use arcstr::ArcStr;
use std::fmt;
use std::net::IpAddr;

use k8s_openapi::api::discovery::v1::EndpointConditions;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use serde::{Deserialize, Deserializer};

/// Label linking an EndpointSlice to its Service.
pub const LABEL_SERVICE_NAME: &str = "kubernetes.io/service-name";

/// An EndpointSlice (`discovery.k8s.io/v1`) as nodelb keeps it: its metadata (slimmed like every
/// cached object's, [`crate::inputs::slim`]), the Service it belongs to, address type, ports and per
/// endpoint its addresses, conditions and node.
#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
#[serde(from = "WireSlice")]
pub struct EndpointSlice {
    /// Without labels: the one nodelb reads is [`EndpointSlice::service_name`].
    pub metadata: ObjectMeta,
    /// The `kubernetes.io/service-name` label, moved out of the label map when read (a map
    /// holding one label is a B-tree node of ~0.5 KiB per slice).
    pub service_name: Option<String>,
    pub address_type: String,
    pub endpoints: Option<Vec<Endpoint>>,
    pub ports: Option<Vec<EndpointPort>>,
    /// Annotation [`ANNOTATION_TRIGGER_TIME`], parsed when read (the annotations themselves are
    /// not kept): when the change this version carries happened, for
    /// `nodelb_network_programming_duration_seconds`.
    pub trigger_time: Option<k8s_openapi::jiff::Timestamp>,
}

/// Set by the EndpointSlice controller on each slice it writes: when the Pod or Service change
/// that the write carries happened (kube-proxy's network programming latency starts there).
pub const ANNOTATION_TRIGGER_TIME: &str = "endpoints.kubernetes.io/last-change-trigger-time";

/// An EndpointSlice as the API writes it (the fields nodelb reads).
#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct WireSlice {
    #[serde(default, deserialize_with = "nullable")]
    metadata: ObjectMeta,
    #[serde(default, deserialize_with = "nullable")]
    address_type: String,
    #[serde(default)]
    endpoints: Option<Vec<Endpoint>>,
    #[serde(default)]
    ports: Option<Vec<EndpointPort>>,
}

impl From<WireSlice> for EndpointSlice {
    fn from(wire: WireSlice) -> EndpointSlice {
        let WireSlice { mut metadata, address_type, mut endpoints, ports } = wire;
        let service_name = metadata.labels.take().and_then(|mut l| l.remove(LABEL_SERVICE_NAME));
        let trigger_time = metadata
            .annotations
            .as_ref()
            .and_then(|a| a.get(ANNOTATION_TRIGGER_TIME))
            .and_then(|t| t.parse::<k8s_openapi::jiff::Timestamp>().ok());
        share_node_names(endpoints.as_deref_mut().unwrap_or_default());
        EndpointSlice { metadata, service_name, address_type, endpoints, ports, trigger_time }
    }
}

/// Makes the endpoints of one slice that are on the same node share one copy of its name: a
/// slice's endpoints are mostly on a few nodes (all of them on one, often), and the name is kept
/// with every endpoint and again in every model built from it. Only the first
/// [`SHARED_NODE_NAMES`] distinct names are shared, so that a slice of a manifest file (which no
/// API server limits to 1,000 endpoints) with a node per endpoint costs a linear pass, not a
/// quadratic one.
fn share_node_names(endpoints: &mut [Endpoint]) {
    let mut seen: Vec<ArcStr> = Vec::new();
    for name in endpoints.iter_mut().filter_map(|e| e.node_name.as_mut()) {
        match seen.iter().find(|s| ***s == **name) {
            Some(first) => *name = first.clone(),
            None if seen.len() < SHARED_NODE_NAMES => seen.push(name.clone()),
            None => {}
        }
    }
}

/// See [`share_node_names`].
const SHARED_NODE_NAMES: usize = 16;

/// One endpoint of a slice.
#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Endpoint {
    /// Parsed when read; exactly as many as the API's list (usually one).
    #[serde(default, deserialize_with = "nullable")]
    pub addresses: Box<[Address]>,
    #[serde(default)]
    pub conditions: Option<EndpointConditions>,
    /// Shared by the endpoints of the slice on the same node (see [`EndpointSlice`]'s `From`) and
    /// with the models built from them.
    #[serde(default)]
    pub node_name: Option<ArcStr>,
}

/// One port of a slice: what a Service port's target port resolves through.
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize)]
pub struct EndpointPort {
    #[serde(default)]
    pub name: Option<String>,
    #[serde(default)]
    pub port: Option<i32>,
    #[serde(default)]
    pub protocol: Option<String>,
}

/// An endpoint address: an IP address, or the text that is not one (kept for the warning that
/// skips it).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Address {
    Ip(IpAddr),
    Unparsed(Box<str>),
}

impl From<&str> for Address {
    /// What `str::parse::<IpAddr>` accepts is an IP address; anything else is kept as text.
    fn from(text: &str) -> Address {
        match text.parse() {
            Ok(ip) => Address::Ip(ip),
            Err(_) => Address::Unparsed(text.into()),
        }
    }
}

impl fmt::Display for Address {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Address::Ip(ip) => ip.fmt(f),
            Address::Unparsed(text) => f.write_str(text),
        }
    }
}

impl<'de> Deserialize<'de> for Address {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Address, D::Error> {
        struct Text;
        impl serde::de::Visitor<'_> for Text {
            type Value = Address;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("an IP address (a string)")
            }
            fn visit_str<E: serde::de::Error>(self, text: &str) -> Result<Address, E> {
                Ok(Address::from(text))
            }
        }
        deserializer.deserialize_str(Text)
    }
}

/// A required field as k8s-openapi reads it: missing (with `#[serde(default)]`) or `null` is
/// its default.
fn nullable<'de, D: Deserializer<'de>, T: Default + Deserialize<'de>>(
    deserializer: D,
) -> Result<T, D::Error> {
    Ok(Option::<T>::deserialize(deserializer)?.unwrap_or_default())
}

impl k8s_openapi::Resource for EndpointSlice {
    const API_VERSION: &'static str = "discovery.k8s.io/v1";
    const GROUP: &'static str = "discovery.k8s.io";
    const KIND: &'static str = "EndpointSlice";
    const VERSION: &'static str = "v1";
    const URL_PATH_SEGMENT: &'static str = "endpointslices";
    type Scope = k8s_openapi::NamespaceResourceScope;
}

impl k8s_openapi::ListableResource for EndpointSlice {
    const LIST_KIND: &'static str = "EndpointSliceList";
}

impl k8s_openapi::Metadata for EndpointSlice {
    type Ty = ObjectMeta;

    fn metadata(&self) -> &ObjectMeta {
        &self.metadata
    }

    fn metadata_mut(&mut self) -> &mut ObjectMeta {
        &mut self.metadata
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    /// A slice as the API server returns it, with the fields nodelb does not read filled in.
    fn full() -> serde_json::Value {
        json!({
            "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
            "metadata": {"name": "web-abc", "namespace": "prod", "uid": "u-1", "resourceVersion": "7",
                         "labels": {"kubernetes.io/service-name": "web"}},
            "addressType": "IPv4",
            "endpoints": [
                {"addresses": ["198.51.100.11"], "conditions": {"ready": true, "serving": true, "terminating": false},
                 "nodeName": "n1", "zone": "z", "hostname": "h", "hints": {"forZones": [{"name": "z"}]},
                 "targetRef": {"kind": "Pod", "name": "web-1", "namespace": "prod", "uid": "p"},
                 "deprecatedTopology": {"a": "b"}},
                {"addresses": ["2001:db8::1", "not-an-ip", "198.51.100.012"]}
            ],
            "ports": [{"name": "http", "port": 8080, "protocol": "TCP", "appProtocol": "http"}]
        })
    }

    #[test]
    fn reads_what_the_generated_type_reads() {
        let generated: k8s_openapi::api::discovery::v1::EndpointSlice =
            serde_json::from_value(full()).expect("generated");
        let compact: EndpointSlice = serde_json::from_value(full()).expect("compact");
        let mut metadata = generated.metadata.clone();
        let mut labels = metadata.labels.take().unwrap_or_default();
        assert_eq!(compact.metadata, metadata);
        assert_eq!(compact.service_name, labels.remove(LABEL_SERVICE_NAME));
        assert_eq!(compact.service_name.as_deref(), Some("web"));
        assert_eq!(compact.address_type, generated.address_type);
        let ports: Vec<_> = generated
            .ports
            .iter()
            .flatten()
            .map(|p| EndpointPort { name: p.name.clone(), port: p.port, protocol: p.protocol.clone() })
            .collect();
        assert_eq!(compact.ports, Some(ports));
        let endpoints = generated.endpoints.iter().flatten();
        let compact_endpoints = compact.endpoints.iter().flatten();
        assert_eq!(endpoints.clone().count(), 2);
        for (g, c) in endpoints.zip(compact_endpoints) {
            let texts: Vec<String> = c.addresses.iter().map(Address::to_string).collect();
            assert_eq!(texts, g.addresses);
            assert_eq!(c.conditions, g.conditions);
            assert_eq!(c.node_name.as_deref(), g.node_name.as_deref());
        }
        let second = &compact.endpoints.as_ref().unwrap()[1].addresses;
        assert_eq!(second[0], Address::Ip("2001:db8::1".parse().unwrap()));
        assert_eq!(second[1], Address::Unparsed("not-an-ip".into()));
        // A leading zero is not an IPv4 address to Rust (nor to Kubernetes' validation).
        assert_eq!(second[2], Address::Unparsed("198.51.100.012".into()));
    }

    #[test]
    fn missing_or_null_fields_read_as_the_generated_type_reads_them() {
        for text in [
            json!({}),
            json!({"metadata": null, "addressType": null, "endpoints": null, "ports": null}),
            json!({"endpoints": [{"addresses": null, "conditions": null, "nodeName": null}], "ports": [{}]}),
        ] {
            let generated: k8s_openapi::api::discovery::v1::EndpointSlice =
                serde_json::from_value(text.clone()).expect("generated");
            let compact: EndpointSlice = serde_json::from_value(text.clone()).expect("compact");
            assert_eq!(compact.metadata, generated.metadata, "{text}");
            assert_eq!(compact.address_type, generated.address_type, "{text}");
            assert_eq!(compact.endpoints.as_ref().map(Vec::len), generated.endpoints.as_ref().map(Vec::len));
            assert_eq!(compact.ports.as_ref().map(Vec::len), generated.ports.as_ref().map(Vec::len));
        }
    }

    #[test]
    fn wrong_types_are_errors_that_say_what_was_expected() {
        for (text, expected) in [
            (json!({"endpoints": [{"addresses": "198.51.100.1"}]}), "a sequence"),
            (json!({"endpoints": [{"addresses": [7]}]}), "an IP address"),
            (json!({"ports": [{"port": "http"}]}), "i32"),
            (json!({"addressType": 4}), "a string"),
        ] {
            let err = serde_json::from_value::<EndpointSlice>(text.clone()).expect_err("refused");
            assert!(err.to_string().contains(expected), "{text}: {err}");
            serde_json::from_value::<k8s_openapi::api::discovery::v1::EndpointSlice>(text)
                .expect_err("the generated type refuses it too");
        }
    }

    #[test]
    fn an_endpoint_is_a_fraction_of_the_generated_one() {
        // What the scale benchmark keeps 50,000 of; the heap parts come on top (one address
        // allocation here, a vector and a string per address there).
        let compact = std::mem::size_of::<Endpoint>();
        let generated = std::mem::size_of::<k8s_openapi::api::discovery::v1::Endpoint>();
        assert!(compact * 4 <= generated, "compact {compact} B, generated {generated} B");
    }

    #[test]
    fn endpoints_on_one_node_share_its_name() {
        let ep = |a: &str, node: Option<&str>| json!({"addresses": [a], "nodeName": node});
        let slice: EndpointSlice = serde_json::from_value(json!({"endpoints": [
            ep("198.51.100.1", Some("node-a")),
            ep("198.51.100.2", Some("node-b")),
            ep("198.51.100.3", Some("node-a")),
            ep("198.51.100.4", None),
            ep("198.51.100.5", Some("node-a")),
        ]}))
        .expect("slice");
        let names: Vec<Option<&ArcStr>> =
            slice.endpoints.iter().flatten().map(|e| e.node_name.as_ref()).collect();
        let text: Vec<Option<&str>> = names.iter().map(|n| n.map(|n| &**n)).collect();
        assert_eq!(text, [Some("node-a"), Some("node-b"), Some("node-a"), None, Some("node-a")]);
        let (a, b) = (names[0].unwrap(), names[1].unwrap());
        assert!(ArcStr::ptr_eq(a, names[2].unwrap()) && ArcStr::ptr_eq(a, names[4].unwrap()));
        assert!(!ArcStr::ptr_eq(a, b));

        // Past the first 16 distinct nodes, names are kept as read (values unchanged).
        let mut eps: Vec<_> =
            (0..20).map(|i| ep(&format!("198.51.100.{i}"), Some(&format!("n{i}")))).collect();
        eps.extend([ep("198.51.100.100", Some("n0")), ep("198.51.100.119", Some("n19"))]);
        let slice: EndpointSlice = serde_json::from_value(json!({ "endpoints": eps })).expect("slice");
        let names: Vec<&ArcStr> =
            slice.endpoints.iter().flatten().filter_map(|e| e.node_name.as_ref()).collect();
        let text: Vec<&str> = names.iter().map(|n| &***n).collect();
        let want: Vec<String> = (0..20).map(|i| format!("n{i}")).chain(["n0".into(), "n19".into()]).collect();
        assert_eq!(text, want);
        assert!(ArcStr::ptr_eq(names[0], names[20]), "one of the first 16 is shared");
        assert!(!ArcStr::ptr_eq(names[19], names[21]), "the 20th distinct name is not looked for");
    }
}
