//! Each Service's model as a sync serves it ([`model::build`], its allocation age, its endpoints
//! filtered by the endpoint policy), shared as `Arc<LbService>` and, in the sync loop, kept
//! between syncs (docs/design/incremental.md, "Recompute only what changed"). Pure.
//!
//! The sources hand over their objects as `Arc`s and keep the same `Arc` while an object does
//! not change, so a Service whose object, EndpointSlices (the same `Arc`s, in the same order) and
//! allocation age are the ones its model was built from has the same model: the [`ModelCache`]
//! hands the kept `Arc` out again, and the planner finds it unchanged by pointer (a new age alone
//! is set on a copy of the model, not built again). Anything every
//! model depends on (the model options, the node addresses, the endpoint policy) empties the
//! cache when it changes. The cache holds the `Arc`s it compares, so an address is never reused
//! by a new object while it is kept.

use std::collections::BTreeMap;
use std::sync::Arc;

use crate::inputs::compact::EndpointSlice;
use k8s_openapi::api::core::v1::Service;
use k8s_openapi::jiff::Timestamp;

use crate::decisions::endpoint_policy::{self, EndpointPolicy, HostAddresses, RefusedEndpoint};
use crate::domain::{Scope, ServiceKey};
use crate::inputs::model::{self, LbService, ModelOptions, ModelWarning, Refusal};

/// The models of one snapshot's Services.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Modeled {
    /// The valid Services, sorted by key.
    pub services: Vec<Arc<LbService>>,
    /// The refused ones, sorted by key.
    pub refused: Vec<Refusal>,
    /// Sorted by Service (each Service's in the order they were found).
    pub warnings: Vec<ModelWarning>,
    /// Endpoint addresses the policy refused, taken out of the Services (sorted).
    pub refused_endpoints: Vec<RefusedEndpoint>,
}

/// What every model depends on besides its own objects.
#[derive(Debug, Clone, Copy)]
pub struct ModelContext<'a> {
    pub opts: &'a ModelOptions,
    /// Manifests mode: when this node first allocated each Service (its age).
    pub since: &'a BTreeMap<ServiceKey, Timestamp>,
    pub addresses: &'a HostAddresses,
    pub policy: &'a EndpointPolicy,
}

/// Every Service's model, built now (no cache): the oracle of [`ModelCache::build`].
#[cfg(any(test, feature = "testing"))]
pub fn build<S: std::borrow::Borrow<Service>, E: std::borrow::Borrow<EndpointSlice>>(
    services: &[S],
    slices: &[E],
    ctx: &ModelContext<'_>,
) -> Modeled {
    let mut out = model::build(services, slices, ctx.opts);
    for svc in &mut out.services {
        svc.allocated_since = ctx.since.get(&svc.key).copied();
    }
    let refused_endpoints = endpoint_policy::filter(&mut out.services, ctx.addresses, ctx.policy);
    Modeled {
        services: out.services.into_iter().map(Arc::new).collect(),
        refused: out.refused,
        warnings: out.warnings,
        refused_endpoints,
    }
}

/// The last sync's models, by Service (see the module's documentation).
#[derive(Debug, Default)]
pub struct ModelCache {
    /// The options, node addresses and endpoint policy the entries were built with.
    context: Option<(ModelOptions, HostAddresses, EndpointPolicy)>,
    /// Sorted by key, each key once.
    entries: Vec<Entry>,
}

/// One Service's model and what it was built from. Kept for every Service for as long as it
/// exists, so sized for the usual one: a refusal boxed (a `Refusal` is ~100 bytes, an
/// `Arc` 8) and the rest as boxed slices, no capacity field (docs/benchmarks.md, "Memory").
#[derive(Debug)]
struct Entry {
    key: ServiceKey,
    service: Arc<Service>,
    slices: Box<[Arc<EndpointSlice>]>,
    since: Option<Timestamp>,
    model: Result<Arc<LbService>, Box<Refusal>>,
    warnings: Box<[ModelWarning]>,
    refused_endpoints: Box<[RefusedEndpoint]>,
}

impl Entry {
    /// Whether it was built from exactly these objects and this age.
    fn built_from(
        &self,
        service: &Arc<Service>,
        slices: &[KeyedSlice<'_>],
        since: Option<Timestamp>,
    ) -> bool {
        Arc::ptr_eq(&self.service, service)
            && self.since == since
            && self.slices.len() == slices.len()
            && self.slices.iter().zip(slices).all(|(a, (_, b))| Arc::ptr_eq(a, b))
    }
}

impl Entry {
    /// The same model with another allocation age (after the first allocation round every
    /// Service's age is stamped: a copy each, not a rebuild each).
    fn age_in_place(&mut self, since: Option<Timestamp>) {
        if let Ok(m) = &mut self.model {
            Arc::make_mut(m).allocated_since = since;
        }
        self.since = since;
    }
}

impl ModelCache {
    pub fn new() -> ModelCache {
        ModelCache::default()
    }

    /// How many Services' models are kept.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// The Services whose model was built with another allocation age than `since` gives them
    /// (manifests mode: one walk of both, in key order).
    pub fn aged(&self, since: &BTreeMap<ServiceKey, Timestamp>) -> Vec<ServiceKey> {
        let mut ages = since.iter().peekable();
        let mut out = Vec::new();
        for e in &self.entries {
            let key = (&*e.key.namespace, &*e.key.name);
            while ages.next_if(|(k, _)| (&*k.namespace, &*k.name) < key).is_some() {}
            let age = ages.peek().filter(|(k, _)| (&*k.namespace, &*k.name) == key).map(|(_, t)| **t);
            if e.since != age {
                out.push(e.key.clone());
            }
        }
        out
    }

    /// Keeps each model built from the old object of a pair (old, new) as the model of the new
    /// one: a version that reads the same to a node ([`crate::incremental::view::ViewChanges::rebased`]). The
    /// entry then holds the new object (the old one is freed) and a build finds it unchanged.
    pub fn rebase(&mut self, rebased: &[(Arc<Service>, Arc<Service>)]) {
        for (old, new) in rebased {
            let key = model::borrowed_key(&new.metadata.namespace, new.metadata.name.as_deref());
            if let Ok(i) = position(&self.entries, key)
                && Arc::ptr_eq(&self.entries[i].service, old)
            {
                self.entries[i].service = Arc::clone(new);
            }
        }
    }

    /// Whether the entries were built in `ctx`'s context (options, node addresses, endpoint
    /// policy): only then can a scoped [`ModelCache::build`] keep the others.
    pub fn has_context(&self, ctx: &ModelContext<'_>) -> bool {
        self.context.as_ref().is_some_and(|(o, a, p)| o == ctx.opts && a == ctx.addresses && p == ctx.policy)
    }

    /// [`build`] of the Services in `scope`, rebuilding only those whose objects or age changed.
    /// `services` are the objects of the scope in the view (all of them for [`Scope::All`]),
    /// `slices` their EndpointSlices, each in the view's order. A whole build leaves the cache
    /// holding this snapshot's Services; a scoped one (the leader's scoped round, the node's
    /// scoped sync: docs/design/incremental.md) keeps every entry outside the scope as it is and
    /// drops that of a scope key with no Service of ours now. Returns the scope's models, sorted
    /// as [`build`] sorts them; `None` for a scoped build when the context is not the one the
    /// entries were built with (then only a whole build will do). The Services are walked in key
    /// order, with keys borrowed from the objects: an unchanged Service costs no allocation.
    pub fn build(
        &mut self,
        scope: Scope<'_>,
        services: &[Arc<Service>],
        slices: &[Arc<EndpointSlice>],
        ctx: &ModelContext<'_>,
    ) -> Option<Modeled> {
        if !self.has_context(ctx) {
            if matches!(scope, Scope::Keys(_)) {
                return None;
            }
            self.entries.clear();
            self.context = Some((ctx.opts.clone(), ctx.addresses.clone(), ctx.policy.clone()));
        }
        let ours = ours_in_key_order(services, ctx.opts);
        let keyed = slices_in_key_order(slices);
        let mut keyed = keyed.as_slice();
        // A whole build walks the ages in key order next to the Services; a scoped one looks up
        // its few (none at all in Kubernetes mode, which has no ages).
        let mut ages = ctx.since.iter().peekable();
        let mut age_of = |key: (&str, &str)| match scope {
            Scope::All => {
                while ages.next_if(|(k, _)| (&*k.namespace, &*k.name) < key).is_some() {}
                ages.peek().filter(|(k, _)| (&*k.namespace, &*k.name) == key).map(|(_, t)| **t)
            }
            Scope::Keys(_) if ctx.since.is_empty() => None,
            Scope::Keys(_) => ctx.since.get(&ServiceKey::new(key.0, key.1)).copied(),
        };
        let mut out = Modeled::default();
        // New entries, in key order: merged into the kept ones at the end.
        let mut fresh: Vec<Entry> = Vec::new();
        let mut last: Option<(&str, &str)> = None;
        for &(key, svc) in &ours {
            if last == Some(key) {
                let service = ServiceKey::new(key.0, key.1);
                out.refused
                    .push(Refusal::Invalid { service, reason: "duplicate Service object".to_string() });
                continue;
            }
            last = Some(key);
            // Both in key order: slices of keys before this one belong to no Service of ours.
            let skip = keyed.iter().take_while(|(k, _)| *k < key).count();
            let take = keyed[skip..].iter().take_while(|(k, _)| *k == key).count();
            let svc_slices = &keyed[skip..skip + take];
            keyed = &keyed[skip + take..];
            let since = age_of(key);
            let entry = match position(&self.entries, key) {
                Ok(i) => {
                    let e = &mut self.entries[i];
                    if !e.built_from(svc, svc_slices, e.since) {
                        *e = build_entry(svc, svc_slices, ServiceKey::new(key.0, key.1), since, ctx);
                    } else if e.since != since {
                        e.age_in_place(since);
                    }
                    &self.entries[i]
                }
                Err(_) => {
                    fresh.push(build_entry(svc, svc_slices, ServiceKey::new(key.0, key.1), since, ctx));
                    fresh.last().expect("just pushed")
                }
            };
            match &entry.model {
                Ok(m) => out.services.push(m.clone()),
                Err(r) => out.refused.push(Refusal::clone(r)),
            }
            out.warnings.extend(entry.warnings.iter().cloned());
            out.refused_endpoints.extend(entry.refused_endpoints.iter().cloned());
        }
        // What goes: a whole build's entries whose Service is not in the snapshot (both in key
        // order), a scoped build's scope keys with no Service of ours now.
        match scope {
            Scope::All => {
                let mut present = ours.iter().map(|(k, _)| *k).peekable();
                self.entries.retain(|e| {
                    let key = (&*e.key.namespace, &*e.key.name);
                    while present.next_if(|k| *k < key).is_some() {}
                    present.peek() == Some(&key)
                });
            }
            Scope::Keys(keys) => {
                for key in keys {
                    let borrowed = (&*key.namespace, &*key.name);
                    let present = ours.binary_search_by(|(k, _)| k.cmp(&borrowed)).is_ok();
                    if !present && let Ok(i) = position(&self.entries, borrowed) {
                        self.entries.remove(i);
                    }
                }
            }
        }
        if !fresh.is_empty() {
            // Kept for as long as the Services exist: sized once, no growth's spare capacity.
            let mut merged = Vec::with_capacity(self.entries.len() + fresh.len());
            let mut kept = std::mem::take(&mut self.entries).into_iter().peekable();
            for e in fresh {
                merged.extend(std::iter::from_fn(|| kept.next_if(|k| k.key < e.key)));
                merged.push(e);
            }
            merged.extend(kept);
            self.entries = merged;
        } else if matches!(scope, Scope::All) {
            self.entries.shrink_to_fit();
        }
        // Walked in key order: these are sorted already (kept as the contract of `build`).
        out.refused.sort_by(|a, b| a.service().cmp(b.service()));
        out.warnings.sort_by(|a, b| a.service.cmp(&b.service));
        out.refused_endpoints.sort();
        Some(out)
    }
}

/// Where the entry of `key` is, or would go, in the sorted entries.
fn position(entries: &[Entry], key: (&str, &str)) -> Result<usize, usize> {
    entries.binary_search_by(|e| (&*e.key.namespace, &*e.key.name).cmp(&key))
}

/// The Services of `services` that are ours, each with its key, in key order: as a stable sort
/// (of two objects with one key the first is served, as `model::build` does). The references
/// point into `services`, so their addresses are the input order: the unstable sort with that
/// tie-break gives the stable order, without the stable sort's buffer and merges (the
/// Kubernetes source hands over a reflector's hash order).
fn ours_in_key_order<'a>(
    services: &'a [Arc<Service>],
    opts: &ModelOptions,
) -> Vec<((&'a str, &'a str), &'a Arc<Service>)> {
    let mut ours: Vec<((&str, &str), &Arc<Service>)> = services
        .iter()
        .filter(|s| model::is_ours(s, opts))
        .map(|s| (model::borrowed_key(&s.metadata.namespace, s.metadata.name.as_deref()), s))
        .collect();
    if !ours.is_sorted_by(|a, b| a.0 <= b.0) {
        ours.sort_unstable_by(|a, b| {
            a.0.cmp(&b.0).then_with(|| std::ptr::from_ref(a.1).cmp(&std::ptr::from_ref(b.1)))
        });
    }
    ours
}

/// Each slice with its Service's key, in key order and each Service's in [`model::slice_order`],
/// as `model::build` takes them (two of one name in input order: the references point into
/// `slices`, so their addresses are the input order): one vector walked next to the Services,
/// no map or list per Service.
fn slices_in_key_order(slices: &[Arc<EndpointSlice>]) -> Vec<KeyedSlice<'_>> {
    let mut keyed: Vec<KeyedSlice<'_>> =
        slices.iter().filter_map(|s| Some((model::slice_service(s)?, s))).collect();
    let order = |a: &KeyedSlice<'_>, b: &KeyedSlice<'_>| {
        (a.0.cmp(&b.0))
            .then_with(|| model::slice_order(a.1, b.1))
            .then_with(|| std::ptr::from_ref(a.1).cmp(&std::ptr::from_ref(b.1)))
    };
    if !keyed.is_sorted_by(|a, b| order(a, b).is_le()) {
        keyed.sort_unstable_by(order);
    }
    keyed
}

/// An EndpointSlice with the key of its Service.
type KeyedSlice<'a> = ((&'a str, &'a str), &'a Arc<EndpointSlice>);

fn build_entry(
    svc: &Arc<Service>,
    slices: &[KeyedSlice<'_>],
    key: ServiceKey,
    since: Option<Timestamp>,
    ctx: &ModelContext<'_>,
) -> Entry {
    let objects: Vec<&EndpointSlice> = slices.iter().map(|(_, s)| s.as_ref()).collect();
    let mut warnings = Vec::new();
    let mut refused_endpoints = Vec::new();
    let model = model::build_one(svc, key.clone(), &objects, &mut warnings)
        .map(|mut m| {
            m.allocated_since = since;
            refused_endpoints =
                endpoint_policy::filter(std::slice::from_mut(&mut m), ctx.addresses, ctx.policy);
            Arc::new(m)
        })
        .map_err(Box::new);
    Entry {
        service: svc.clone(),
        slices: slices.iter().map(|(_, s)| Arc::clone(s)).collect(),
        key,
        since,
        model,
        warnings: warnings.into(),
        refused_endpoints: refused_endpoints.into(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// One entry is kept per Service for as long as it exists, so every byte of it counts once
    /// per Service: the refusal is boxed and the lists are boxed slices.
    #[test]
    fn entries_stay_small() {
        assert!(size_of::<Entry>() <= 112, "Entry is {} bytes", size_of::<Entry>());
    }

    fn objects(name: &str, endpoint: &str) -> (Arc<Service>, Arc<EndpointSlice>) {
        (service(name, 80), slice(name, &format!("{name}-1"), endpoint))
    }

    fn service(name: &str, port: u16) -> Arc<Service> {
        Arc::new(
            serde_json::from_value(serde_json::json!({
                "metadata": {"name": name, "namespace": "default"},
                "spec": {"type": "LoadBalancer", "ports": [{"name": "p", "port": port}]}
            }))
            .expect("service"),
        )
    }

    fn slice(service: &str, name: &str, endpoint: &str) -> Arc<EndpointSlice> {
        Arc::new(
            serde_json::from_value(serde_json::json!({
                "metadata": {"name": name, "namespace": "default",
                             "labels": {model::LABEL_SERVICE_NAME: service}},
                "addressType": "IPv4",
                "ports": [{"name": "p", "port": 8080}],
                "endpoints": [{"addresses": [endpoint]}]
            }))
            .expect("slice"),
        )
    }

    /// Inputs out of key order (the Kubernetes source hands over a reflector's hash order) are
    /// taken as [`build`] takes them: of two objects with one key the first is served, whichever
    /// of the two it is, and each Service's slices are taken in input order.
    #[test]
    fn inputs_out_of_key_order_are_taken_as_build_takes_them() {
        let opts = ModelOptions::default();
        let (policy, addresses, since) =
            (EndpointPolicy::default(), HostAddresses::default(), BTreeMap::new());
        let ctx = ModelContext { opts: &opts, since: &since, addresses: &addresses, policy: &policy };
        let (a80, a81, b, c) = (service("a", 80), service("a", 81), service("b", 80), service("c", 80));
        let (a_1, a_2) = (slice("a", "a-1", "198.51.100.11"), slice("a", "a-2", "198.51.100.12"));
        let (b_1, c_1) = (slice("b", "b-1", "198.51.100.13"), slice("c", "c-1", "198.51.100.14"));
        let mut cache = ModelCache::new();
        let cases = [
            (vec![&c, &a80, &b, &a81], vec![&b_1, &a_2, &c_1, &a_1], 80),
            (vec![&c, &a81, &b, &a80], vec![&a_1, &c_1, &b_1, &a_2], 81),
            (vec![&a80, &c, &a81, &b], vec![&c_1, &a_1, &a_2, &b_1], 80),
        ];
        for (services, slices, served) in cases {
            let services: Vec<Arc<Service>> = services.into_iter().cloned().collect();
            let slices: Vec<Arc<EndpointSlice>> = slices.into_iter().cloned().collect();
            let got = cache.build(Scope::All, &services, &slices, &ctx).expect("a whole build");
            assert_eq!(got, super::build(&services, &slices, &ctx), "{served}: as built afresh");
            let a = got.services.iter().find(|m| m.key == ServiceKey::new("default", "a")).expect("a");
            assert_eq!(a.ports[0].id.port, served, "the first object of the key is served");
        }
        // Above 32 elements, where the standard library's unstable sort stops keeping ties in
        // order by itself: 40 Services, every fourth twice (50 objects; ports 80 and 81, in turn
        // first), out of key order.
        let mut services = Vec::new();
        for i in 0..40u16 {
            let name = format!("s{:02}", (i * 17) % 40);
            let twice = i % 4 == 0;
            let first = if twice && i % 8 == 0 { 81 } else { 80 };
            services.push(service(&name, first));
            if twice {
                services.push(service(&name, 161 - first));
            }
        }
        services.rotate_left(7);
        let no_slices: [Arc<EndpointSlice>; 0] = [];
        let got = cache.build(Scope::All, &services, &no_slices, &ctx).expect("a whole build");
        assert_eq!(got, super::build(&services, &no_slices, &ctx), "50 objects: as built afresh");
        for m in &got.services {
            let first = services.iter().find(|s| s.metadata.name.as_deref() == Some(&*m.key.name)).unwrap();
            let port = first.spec.as_ref().unwrap().ports.as_ref().unwrap()[0].port;
            assert_eq!(i32::from(m.ports[0].id.port), port, "{}: the first object of the key", m.key);
        }
    }

    /// A scoped build touches the scope's entries only: it builds what changed in the scope,
    /// drops the entries of scope keys that are gone (or no longer ours), keeps every other
    /// entry (even one whose objects changed: not its to see), and leaves the cache as a whole
    /// build of the same view would.
    #[test]
    fn a_scoped_build_keeps_every_entry_outside_its_scope() {
        let opts = ModelOptions::default();
        let (policy, addresses, since) =
            (EndpointPolicy::default(), HostAddresses::default(), BTreeMap::new());
        let ctx = ModelContext { opts: &opts, since: &since, addresses: &addresses, policy: &policy };
        let (a, a_1) = objects("a", "198.51.100.11");
        let (b, b_1) = objects("b", "198.51.100.12");
        let (c, c_1) = objects("c", "198.51.100.13");
        let mut cache = ModelCache::new();
        let keys = |names: &[&str]| -> foldhash::HashSet<ServiceKey> {
            names.iter().map(|n| ServiceKey::new("default", *n)).collect()
        };
        assert!(
            cache.build(Scope::Keys(&keys(&["a"])), &[], &[], &ctx).is_none(),
            "no context yet: only a whole build"
        );
        let first = cache
            .build(
                Scope::All,
                &[a.clone(), b.clone(), c.clone()],
                &[a_1.clone(), b_1.clone(), c_1.clone()],
                &ctx,
            )
            .expect("a whole build");
        let mut moved = addresses.clone();
        moved.add("198.51.100.99".parse().unwrap(), "Node node-9");
        assert!(!cache.has_context(&ModelContext { addresses: &moved, ..ctx }), "another context");
        // b gets a new slice, c is deleted, d is new, a is not in the scope.
        let b_2 = slice("b", "b-1", "198.51.100.22");
        let (d, d_1) = objects("d", "198.51.100.14");
        let got = cache
            .build(
                Scope::Keys(&keys(&["b", "c", "d"])),
                &[d.clone(), b.clone()],
                &[b_2.clone(), d_1.clone()],
                &ctx,
            )
            .expect("same context");
        let names: Vec<&str> = got.services.iter().map(|m| &*m.key.name).collect();
        assert_eq!(names, ["b", "d"], "the scope's models, in key order");
        assert_eq!(got.services[0].ports[0].endpoints[0].addr.to_string(), "198.51.100.22");
        let kept: Vec<&str> = cache.entries.iter().map(|e| &*e.key.name).collect();
        assert_eq!(kept, ["a", "b", "d"], "c dropped, a kept");
        assert!(Arc::ptr_eq(cache.entries[0].model.as_ref().unwrap(), &first.services[0]), "a untouched");
        // What a whole build of the view now gives, with every model kept.
        let services = [a.clone(), b.clone(), d.clone()];
        let slices = [a_1.clone(), b_2.clone(), d_1.clone()];
        let whole = cache.build(Scope::All, &services, &slices, &ctx).expect("a whole build");
        assert_eq!(whole, super::build(&services, &slices, &ctx));
        assert!(
            Arc::ptr_eq(&whole.services[1], &got.services[0])
                && Arc::ptr_eq(&whole.services[2], &got.services[1])
        );
        // A Service of the scope that is no longer ours goes too.
        let mut cluster_ip = (*b).clone();
        cluster_ip.spec.as_mut().unwrap().type_ = Some("ClusterIP".into());
        let got = cache.build(Scope::Keys(&keys(&["b"])), &[Arc::new(cluster_ip)], &[b_2], &ctx).unwrap();
        assert!(got.services.is_empty());
        assert_eq!(cache.entries.iter().map(|e| &*e.key.name).collect::<Vec<_>>(), ["a", "d"]);
    }

    /// Each reason to build a Service's model again, and only those: the cache hands out the
    /// kept `Arc` otherwise, and always what [`build`] gives.
    #[test]
    fn a_model_is_rebuilt_exactly_when_what_it_is_built_from_changes() {
        let opts = ModelOptions::default();
        let (policy, mut addresses) = (EndpointPolicy::default(), HostAddresses::default());
        let mut since = BTreeMap::new();
        let (a, a_slice) = objects("a", "198.51.100.11");
        let (b, b_slice) = objects("b", "198.51.100.12");
        let mut services = vec![a.clone(), b.clone()];
        let mut slices = vec![a_slice, b_slice];
        let mut cache = ModelCache::new();
        let mut last: Option<Modeled> = None;
        // (what changes, whether a's model is new, whether b's is)
        let steps: Vec<(&str, bool, bool)> = vec![
            ("first build", true, true),
            ("nothing", false, false),
            ("a's Service object (an equal copy)", true, false),
            ("b's EndpointSlice", false, true),
            ("a's allocation age", true, false),
            ("the node addresses", true, true),
            ("nothing again", false, false),
        ];
        for (what, a_new, b_new) in steps {
            match what {
                "a's Service object (an equal copy)" => services[0] = Arc::new((*a).clone()),
                "b's EndpointSlice" => slices[1] = objects("b", "198.51.100.13").1,
                "a's allocation age" => {
                    since.insert(
                        ServiceKey::new("default", "a"),
                        Timestamp::from_second(1_700_000_000).unwrap(),
                    );
                }
                "the node addresses" => addresses.add("198.51.100.11".parse().unwrap(), "Node node-2"),
                _ => {}
            }
            let ctx = ModelContext { opts: &opts, since: &since, addresses: &addresses, policy: &policy };
            let got = cache.build(Scope::All, &services, &slices, &ctx).expect("a whole build");
            assert_eq!(got, super::build(&services, &slices, &ctx), "{what}: as built afresh");
            if let Some(last) = &last {
                let renewed: Vec<bool> =
                    got.services.iter().zip(&last.services).map(|(g, l)| !Arc::ptr_eq(g, l)).collect();
                assert_eq!(renewed, [a_new, b_new], "{what}: which models are new");
            }
            last = Some(got);
        }
        let last = last.unwrap();
        assert_eq!(
            last.services[0].allocated_since.map(|t| t.to_string()).as_deref(),
            Some("2023-11-14T22:13:20Z")
        );
        assert_eq!(last.services[0].ports[0].endpoints, [], "a's endpoint is a node's address now");
        assert_eq!(last.refused_endpoints.len(), 1);
    }
}
