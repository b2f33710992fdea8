//! Target `annotations`: every annotation value nodelb reads, on a valid Service next to the
//! good world: `nodelb.io/ports`, `nodelb.io/allocated-ports`, `nodelb.io/ignore`, the legacy
//! source-range annotation and `spec.loadBalancerSourceRanges` entries; and on node Leases, what
//! other agents publish (`nodelb.io/families`, `nodelb.io/listening-ports`). A refusal must name
//! the Service and the annotation (or field); the good Services keep being planned.

use std::collections::BTreeMap;

use arbitrary::Unstructured;
use k8s_openapi::api::coordination::v1::Lease;
use nodelb::core::decisions::port_policy::Listeners;
use nodelb::core::inputs::model::{self, Refusal};
use nodelb::core::k8s::nodes;
use serde_json::{Value, json};

use super::hostile;
use super::objects::{self, Hostile};
use super::world::{self, World};

const ANNOTATIONS: &[&str] = &[
    model::ANNOTATION_PORTS,
    model::ANNOTATION_ALLOCATED,
    model::ANNOTATION_IGNORE,
    model::ANNOTATION_LEGACY_SOURCE_RANGES,
];

pub fn run(data: &[u8]) {
    let mut u = Unstructured::new(data);
    let world = World::new();
    let Ok((service, annotations, ranges)) = hostile_service(&mut u) else { return };
    check_refusal_names(&service, &annotations, &ranges);
    objects::check(&world, &Hostile { services: vec![service], ..Hostile::default() });
    if let Ok(lease) = hostile_lease(&mut u) {
        check_lease(&lease);
    }
}

fn hostile_service(
    u: &mut Unstructured<'_>,
) -> arbitrary::Result<(Value, BTreeMap<String, String>, Vec<String>)> {
    let mut annotations = BTreeMap::new();
    for name in ANNOTATIONS {
        if u.ratio(1, 2)? {
            annotations.insert(name.to_string(), hostile::string(u)?);
        }
    }
    let ranges: Vec<String> =
        (0..u.int_in_range(0..=3)?).map(|_| hostile::string(u)).collect::<arbitrary::Result<_>>()?;
    let service = json!({
        "apiVersion": "v1", "kind": "Service",
        "metadata": {"name": "annotated", "namespace": "hostile", "uid": "uid-annotated", "annotations": annotations},
        "spec": {
            "type": "LoadBalancer",
            "ports": [{"name": "http", "port": 80}, {"name": "dns", "port": 53, "protocol": "UDP"}],
            "loadBalancerSourceRanges": ranges,
        }
    });
    Ok((service, annotations, ranges))
}

/// A refusal of the annotated Service names it, and names the annotation or field whose value
/// is wrong.
fn check_refusal_names(service: &Value, annotations: &BTreeMap<String, String>, ranges: &[String]) {
    let svc: k8s_openapi::api::core::v1::Service =
        serde_json::from_value(service.clone()).expect("a valid shape");
    let out = model::build(&[svc], model::NO_SLICES, &model::ModelOptions::default());
    for r in &out.refused {
        let msg = r.to_string();
        assert!(
            msg.starts_with("Service hostile/annotated: "),
            "refusal names no Service: {}",
            world::head(&msg)
        );
        match r {
            Refusal::InvalidAnnotation { annotation, .. } => {
                assert!(
                    annotations.contains_key(annotation),
                    "refusal names an annotation not set: {annotation}"
                );
                assert!(
                    msg.contains(annotation.as_str()),
                    "refusal does not name {annotation}: {}",
                    world::head(&msg)
                );
            }
            Refusal::InvalidSourceRange { value, .. } => {
                assert!(ranges.contains(value), "refusal names a range not given: {value:?}");
                assert!(msg.contains("loadBalancerSourceRanges"), "{}", world::head(&msg));
            }
            Refusal::Invalid { .. } => {
                // Bounds (too many source ranges × ports): the message says which field.
                assert!(
                    msg.contains("loadBalancerSourceRanges") || msg.contains("annotation"),
                    "{}",
                    world::head(&msg)
                );
            }
            other => panic!("unexpected refusal of a Service whose ports and spec are valid: {other}"),
        }
    }
}

fn hostile_lease(u: &mut Unstructured<'_>) -> arbitrary::Result<Value> {
    let mut v = json!({
        "apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
        "metadata": {"name": "nodelb-node-node-2", "namespace": "nodelb-system",
                     "annotations": {"nodelb.io/families": "ipv4", "nodelb.io/listening-ports": "22/TCP"}},
        "spec": {"holderIdentity": "node-2", "leaseDurationSeconds": 15, "renewTime": "2030-01-01T00:00:00.000000Z"}
    });
    hostile::mutate(u, &mut v, hostile::LEASE_PATHS)?;
    Ok(v)
}

/// What another agent published is parsed without panicking, into what could have been
/// published: ports of known protocols, families of known names.
fn check_lease(v: &Value) {
    let Ok(lease) = serde_json::from_value::<Lease>(v.clone()) else { return };
    let ports = nodes::listening_ports(std::slice::from_ref(&lease));
    for (proto, port) in ports.keys() {
        let _ = (proto, port);
    }
    let _ = nodes::lease_families(&lease, Some(k8s_openapi::jiff::Timestamp::now()));
    let _ = nodes::lease_families(&lease, None);
    if let Some(value) = lease.metadata.annotations.as_ref().and_then(|a| a.get(nodes::ANNOTATION_LISTENING))
    {
        // Round trip: what parses, formats back into something that parses the same.
        let parsed = Listeners::parse_published(value);
        let text: Vec<String> = parsed.iter().map(|(p, n)| format!("{n}/{p}")).collect();
        assert_eq!(Listeners::parse_published(&text.join(",")), parsed);
    }
}
