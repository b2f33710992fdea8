//! Target `objects`: Services and EndpointSlices of any JSON shape (valid ones mutated at the
//! paths nodelb reads, and raw JSON), mixed with the good world, through everything that reads
//! them: deserialization into the API types, `slim` (what the caches keep), the Kubernetes
//! path's last-good substitution, `model::build`, `desired::compute` in both modes, and the
//! leader's round (allocation, status and condition writes, Events).

use std::sync::Arc;

use arbitrary::Unstructured;
use k8s_openapi::api::core::v1::Service;
use nodelb::core::decisions::alloc::Allocations;
use nodelb::core::decisions::desired::{AllocationMode, SourceNotes};
use nodelb::core::inputs::compact::EndpointSlice;
use nodelb::core::inputs::model::{self, ModelOptions, NO_SLICES};
use nodelb::core::inputs::slim::Slim;
use nodelb::core::k8s::lastgood::LastGoodServices;
use serde_json::Value;

use super::world::{self, World};
use super::{hostile, leader};

/// Hostile objects from the fuzzer's bytes.
#[derive(Default)]
pub struct Hostile {
    pub services: Vec<Value>,
    pub slices: Vec<Value>,
    pub nodes: Vec<Value>,
    pub leases: Vec<Value>,
}

pub fn generate(u: &mut Unstructured<'_>, world: &World) -> arbitrary::Result<Hostile> {
    let mut out = Hostile::default();
    for _ in 0..u.int_in_range(1..=4)? {
        let mut v = u.choose(&world.services)?.clone();
        hostile::mutate(u, &mut v, hostile::SERVICE_PATHS)?;
        world::keep_out(&mut v);
        out.services.push(v);
    }
    for _ in 0..u.int_in_range(0..=3)? {
        let mut v = u.choose(&world.slices)?.clone();
        hostile::mutate(u, &mut v, hostile::SLICE_PATHS)?;
        world::keep_out(&mut v);
        out.slices.push(v);
    }
    if u.ratio(1, 4)? {
        let mut v = u.choose(&leader::good_nodes())?.clone();
        hostile::mutate(u, &mut v, hostile::NODE_PATHS)?;
        out.nodes.push(v);
    }
    if u.ratio(1, 4)? {
        let mut v = u.choose(&leader::good_leases())?.clone();
        hostile::mutate(u, &mut v, hostile::LEASE_PATHS)?;
        out.leases.push(v);
    }
    if u.ratio(1, 4)? {
        // Raw JSON text: shapes no mutation of a valid object reaches.
        let text: &[u8] = u.arbitrary()?;
        if let Ok(mut v) = serde_json::from_slice::<Value>(text) {
            world::keep_out(&mut v);
            out.services.push(v.clone());
            out.slices.push(v);
        }
    }
    Ok(out)
}

/// Deserializes what deserializes, as the watcher and the manifests loader do (an object that
/// does not is reported by them and never reaches the model).
pub fn typed<T: serde::de::DeserializeOwned>(values: &[Value]) -> Vec<T> {
    values.iter().filter_map(|v| serde_json::from_value(v.clone()).ok()).collect()
}

pub fn run(data: &[u8]) {
    let mut u = Unstructured::new(data);
    let world = World::new();
    let Ok(h) = generate(&mut u, &world) else { return };
    check(&world, &h);
}

pub fn check(world: &World, h: &Hostile) {
    let (good_services, good_slices) = world.typed();
    let mut services = good_services.clone();
    services.extend(typed::<Service>(&h.services));
    let mut slices = good_slices.clone();
    slices.extend(typed::<EndpointSlice>(&h.slices));
    let opts = ModelOptions::default();

    // The caches keep slimmed objects: the model must not see the difference.
    let slim_services: Vec<Service> = services
        .iter()
        .cloned()
        .map(|mut s| {
            s.slim();
            s
        })
        .collect();
    let slim_slices: Vec<EndpointSlice> = slices
        .iter()
        .cloned()
        .map(|mut s| {
            s.slim();
            s
        })
        .collect();
    let full = model::build(&services, &slices, &opts);
    let slim = model::build(&slim_services, &slim_slices, &opts);
    assert_eq!(full, slim, "model of slimmed objects differs from the model of the full objects");

    // Manifests mode: the agent allocates, the good allocations are the state file.
    let notes = SourceNotes::default();
    let (gs, ge) = (good_services.as_slice(), good_slices.as_slice());
    let alone = world::compute(AllocationMode::Allocate, gs, ge, &notes, &world.allocations);
    let with =
        world::compute(AllocationMode::Allocate, &slim_services, &slim_slices, &notes, &world.allocations);
    world::assert_good_served(world, &alone, &with, "manifests mode");
    world::assert_messages_bounded(&with, "manifests mode");
    world::assert_ruleset_sound(&alone.ruleset, &with, "manifests mode");

    // Kubernetes mode: last good first (as the node's source does), then the annotations. A
    // hostile object with an older creationTimestamp and the same annotated port would rightly
    // take the port (the older Service keeps it), so hostile objects get no age here.
    let mut ageless = slim_services.clone();
    for s in ageless.iter_mut().skip(good_services.len()) {
        s.metadata.creation_timestamp = None;
    }
    leader::check((gs, ge), (&ageless, &slim_slices), &h.nodes, &h.leases);
    let shared: Vec<Arc<Service>> = ageless.into_iter().map(Arc::new).collect();
    let mut last_good = LastGoodServices::default();
    let subst = last_good.apply(&shared, None, &opts);
    for r in &subst.masked {
        assert!(r.to_string().contains(&r.service().to_string()), "masked refusal names no Service: {r}");
    }
    let none = Allocations::new();
    let alone = world::compute(AllocationMode::Annotated, gs, ge, &notes, &none);
    let kube: Vec<Service> = subst.services.iter().map(|s| Service::clone(s)).collect();
    let with = world::compute(AllocationMode::Annotated, &kube, &slim_slices, &notes, &none);
    world::assert_good_served(world, &alone, &with, "Kubernetes mode");
    world::assert_messages_bounded(&with, "Kubernetes mode");
    world::assert_ruleset_sound(&alone.ruleset, &with, "Kubernetes mode");

    // A good Service edited into each hostile shape (same uid): served from its last good spec,
    // or valid as edited; never dropped, never half-applied.
    for (i, v) in h.services.iter().enumerate() {
        let Ok(mut edited) = serde_json::from_value::<Service>(v.clone()) else { continue };
        let good = &good_services[i % good_services.len()];
        edited.metadata.name = good.metadata.name.clone();
        edited.metadata.namespace = good.metadata.namespace.clone();
        edited.metadata.uid = good.metadata.uid.clone();
        edited.metadata.resource_version = Some("2".into());
        edited.slim();
        let mut lg = LastGoodServices::default();
        lg.apply(std::slice::from_ref(good), None, &opts);
        let out = lg.apply(&[edited.clone()], None, &opts);
        let built = model::build(&out.services, NO_SLICES, &opts);
        if model::is_ours(&edited, &opts) {
            assert_eq!(
                built.services.len(),
                1,
                "an edit of a served Service dropped it: {:?}",
                built.refused
            );
        }
    }
}
