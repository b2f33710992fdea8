//! What changed in a source's view (its Services and EndpointSlices) since the last sync, found
//! by object address, and each Service's objects by key: a node's sync scoped to what changed
//! (docs/design/incremental.md, "The node's sync scoped to what changed") starts from the keys
//! this names and reads the objects of its scope from here, with no walk of the view. Pure.
//!
//! A pass looks each object up by its address ([`PerObject`]): the facts of an object it has seen
//! before (its key, the node port numbers its allocation annotation names) are kept, those of a
//! new object or a new version are read once. The objects the pass did not see are gone (deleted,
//! or replaced by a newer version). What it changes is patched into the index of each key's
//! objects and of each number's holders. A Service replaced by a version that reads the same to a
//! node ([`crate::inputs::slim::same_for_node`]: a leader's status write, a relist's equal copy) is no
//! change: the index takes the new object and the pass names the pair
//! ([`ViewChanges::rebased`]), so what was built from the old one is kept.
//!
//! The leader's round finds what changed with the same view ([`crate::k8s::claims::Holders`]),
//! keeping each Service's registry holder as its facts; for it every new version is a change
//! (it writes the statuses a node does not read).

use std::collections::BTreeSet;
use std::sync::Arc;

use foldhash::{HashMap, HashSet};
use k8s_openapi::api::core::v1::Service;

use crate::domain::ServiceKey;
use crate::incremental::per_object::PerObject;
use crate::inputs::compact::EndpointSlice;
use crate::inputs::model;

/// What a pass keeps of each Service object, read once per object version: at least the node
/// port numbers its allocation annotation names (`nodelb.io/allocated-ports`), every one the
/// model may read ([`model::annotated_numbers`]).
pub trait ServiceFacts: Clone {
    fn of(service: &Service) -> Self;
    fn numbers(&self) -> impl Iterator<Item = u16> + '_;
}

/// A node's facts of a Service object: its numbers alone.
impl ServiceFacts for Box<[u16]> {
    fn of(service: &Service) -> Self {
        model::allocated_annotation(service).map(|v| model::annotated_numbers(v).into()).unwrap_or_default()
    }

    fn numbers(&self) -> impl Iterator<Item = u16> + '_ {
        self.iter().copied()
    }
}

/// The view as the last pass left it (see the module's documentation). Kept for every object:
/// sized for the usual case (one Service object and one EndpointSlice per key, one holder per
/// number). An object's key is read from the object again when it goes, not kept with it.
#[derive(Debug, Default)]
pub struct SourceView<F = Box<[u16]>> {
    /// Each Service object's facts.
    services: PerObject<Service, F>,
    slices: PerObject<EndpointSlice, ()>,
    /// Each key's objects.
    by_key: HashMap<ServiceKey, Objects>,
    /// How many keys have more than one Service object.
    shared_keys: usize,
    /// The last pass was handed one Service object twice.
    repeated: bool,
    /// The keys whose allocation annotation names each number; not kept by a view of every
    /// version (the leader keeps its own, oldest first: `claims::HeldIndex`).
    holders: HashMap<u16, Few<ServiceKey>>,
    /// A pass has been made.
    passed: bool,
    /// Every new version of a Service is a change, even one that reads the same to a node.
    every_version: bool,
}

/// A Service object new to a pass, with its key and facts.
type NewService<F> = (Arc<Service>, ServiceKey, F);

/// The objects of one key: its Service objects (more than one only when a source hands over
/// two objects with one key, which the model refuses) and its EndpointSlices.
#[derive(Debug, Default)]
struct Objects {
    services: Few<Arc<Service>>,
    slices: Few<Arc<EndpointSlice>>,
}

/// None, one value or a few (16 bytes and a tag).
#[derive(Debug, Default)]
enum Few<T> {
    #[default]
    None,
    One(T),
    Many(Box<[T]>),
}

impl<T: Clone> Few<T> {
    fn as_slice(&self) -> &[T] {
        match self {
            Few::None => &[],
            Few::One(t) => std::slice::from_ref(t),
            Few::Many(v) => v,
        }
    }

    fn push(&mut self, t: T) {
        *self = match std::mem::take(self) {
            Few::None => Few::One(t),
            other => {
                let mut all = other.as_slice().to_vec();
                all.push(t);
                Few::Many(all.into_boxed_slice())
            }
        };
    }

    /// Takes out the first value `is` holds for.
    fn remove(&mut self, is: impl Fn(&T) -> bool) {
        let mut all = self.as_slice().to_vec();
        if let Some(i) = all.iter().position(is) {
            all.remove(i);
        }
        *self = match all.len() {
            0 => Few::None,
            1 => Few::One(all.pop().expect("one")),
            _ => Few::Many(all.into_boxed_slice()),
        };
    }
}

impl Objects {
    fn is_empty(&self) -> bool {
        matches!((&self.services, &self.slices), (Few::None, Few::None))
    }
}

/// Changes the objects of `key` (kept while it has any); returns the key as the map holds it.
fn objects_of_key(
    map: &mut HashMap<ServiceKey, Objects>,
    key: ServiceKey,
    change: impl FnOnce(&mut Objects),
) -> ServiceKey {
    match map.entry(key) {
        std::collections::hash_map::Entry::Occupied(mut o) => {
            change(o.get_mut());
            if o.get().is_empty() { o.remove_entry().0 } else { o.key().clone() }
        }
        std::collections::hash_map::Entry::Vacant(v) => {
            let key = v.key().clone();
            let mut objects = Objects::default();
            change(&mut objects);
            if !objects.is_empty() {
                v.insert(objects);
            }
            key
        }
    }
}

/// Adds `value` under `key`.
fn add<K: std::hash::Hash + Eq, T: Clone>(map: &mut HashMap<K, Few<T>>, key: K, value: T) {
    map.entry(key).or_default().push(value);
}

/// Takes the first value `is` holds for out from under `key`.
fn take<K: std::hash::Hash + Eq, T: Clone>(map: &mut HashMap<K, Few<T>>, key: &K, is: impl Fn(&T) -> bool) {
    if let Some(few) = map.get_mut(key) {
        few.remove(is);
        if matches!(few, Few::None) {
            map.remove(key);
        }
    }
}

/// What a pass found changed since the one before.
#[derive(Debug, PartialEq)]
pub struct ViewChanges<F = Box<[u16]>> {
    /// There was no pass before this one.
    pub first: bool,
    /// The facts of the Service objects new to the pass (new Services, new versions).
    pub added: Vec<F>,
    /// The Service objects no longer in it (deleted, or replaced by a newer version), with
    /// their facts.
    pub dropped: Vec<(Arc<Service>, F)>,
    /// The keys of the Services and EndpointSlices that came, went or are new versions.
    pub keys: HashSet<ServiceKey>,
    /// The numbers named by the allocation annotations of the Service objects that came or went.
    pub numbers: BTreeSet<u16>,
    /// The Service objects replaced by a version that reads the same to a node, each with its
    /// replacement (old, new): their keys are not in `keys` for it. After a node joins or
    /// leaves, the leader rewrites every Service's ingress; without this, a node's next sync
    /// decided every Service again.
    pub rebased: Vec<(Arc<Service>, Arc<Service>)>,
}

impl<F> Default for ViewChanges<F> {
    fn default() -> Self {
        ViewChanges {
            first: false,
            added: Vec::new(),
            dropped: Vec::new(),
            keys: HashSet::default(),
            numbers: BTreeSet::new(),
            rebased: Vec::new(),
        }
    }
}

impl<F: ServiceFacts> SourceView<F> {
    /// A view for which every new version of a Service is a change.
    pub fn every_version() -> Self {
        SourceView {
            services: PerObject::default(),
            slices: PerObject::default(),
            by_key: HashMap::default(),
            shared_keys: 0,
            repeated: false,
            holders: HashMap::default(),
            passed: false,
            every_version: true,
        }
    }

    /// One pass over the view: what changed since the last one.
    pub fn pass(&mut self, services: &[Arc<Service>], slices: &[Arc<EndpointSlice>]) -> ViewChanges<F> {
        let mut changes =
            ViewChanges { first: !std::mem::replace(&mut self.passed, true), ..Default::default() };
        let mut computed: Vec<NewService<F>> = Vec::new();
        self.services.begin();
        for s in services {
            if self.services.get(s).is_none() {
                let facts = F::of(s);
                self.services.insert(s, facts.clone());
                computed.push((Arc::clone(s), model::service_key(s), facts));
            }
        }
        let gone = self.services.end_changes();
        self.repeated = self.services.len() != services.len();
        if !self.every_version {
            changes.rebased = self.rebase(&mut computed);
        }
        let rebased: HashSet<*const Service> =
            changes.rebased.iter().map(|(old, _)| Arc::as_ptr(old)).collect();
        for (object, facts) in gone {
            if rebased.contains(&Arc::as_ptr(&object)) {
                continue;
            }
            let mut before = 0;
            let key = objects_of_key(&mut self.by_key, model::service_key(&object), |o| {
                before = o.services.as_slice().len();
                o.services.remove(|s| Arc::ptr_eq(s, &object));
            });
            if before == 2 {
                self.shared_keys -= 1;
            }
            for n in facts.numbers().filter(|_| !self.every_version) {
                take(&mut self.holders, &n, |k| *k == key);
            }
            changes.numbers.extend(facts.numbers());
            changes.keys.insert(key);
            changes.dropped.push((object, facts));
        }
        for (object, key, facts) in computed {
            let mut after = 0;
            let key = objects_of_key(&mut self.by_key, key, |o| {
                o.services.push(object);
                after = o.services.as_slice().len();
            });
            if after == 2 {
                self.shared_keys += 1;
            }
            for n in facts.numbers().filter(|_| !self.every_version) {
                add(&mut self.holders, n, key.clone());
            }
            changes.numbers.extend(facts.numbers());
            changes.keys.insert(key);
            changes.added.push(facts);
        }
        self.slices.begin();
        for slice in slices {
            if self.slices.get(slice).is_none() {
                self.slices.insert(slice, ());
                if let Some((ns, name)) = model::slice_service(slice) {
                    let key = objects_of_key(&mut self.by_key, ServiceKey::new(ns, name), |o| {
                        o.slices.push(Arc::clone(slice))
                    });
                    changes.keys.insert(key);
                }
            }
        }
        for (object, ()) in self.slices.end_changes() {
            let Some((ns, name)) = model::slice_service(&object) else { continue };
            let key = objects_of_key(&mut self.by_key, ServiceKey::new(ns, name), |o| {
                o.slices.remove(|s| Arc::ptr_eq(s, &object))
            });
            changes.keys.insert(key);
        }
        changes
    }

    /// Takes out of `computed` (the Service objects new to this pass, each with its key and
    /// numbers) each that replaces its key's only object with a version that reads the same
    /// ([`crate::inputs::slim::same_for_node`]), the one object of its key in this pass; the index holds
    /// it instead of the old one (the same key, the same annotation: the same numbers). Returns
    /// the pairs (old, new).
    fn rebase(&mut self, computed: &mut Vec<NewService<F>>) -> Vec<(Arc<Service>, Arc<Service>)> {
        let mut count: HashMap<&ServiceKey, u32> = HashMap::default();
        for (_, key, _) in computed.iter() {
            *count.entry(key).or_default() += 1;
        }
        let alone: HashSet<ServiceKey> =
            count.into_iter().filter(|(_, n)| *n == 1).map(|(k, _)| k.clone()).collect();
        let mut rebased = Vec::new();
        let (by_key, seen) = (&mut self.by_key, &self.services);
        computed.retain(|(object, key, _)| {
            if !alone.contains(key) {
                return true;
            }
            let Some(Objects { services: Few::One(old), .. }) = by_key.get_mut(key) else { return true };
            // The old object is gone from this pass (not seen again: a new version came).
            if seen.peek(old).is_some() || !crate::inputs::slim::same_for_node(old, object) {
                return true;
            }
            rebased.push((std::mem::replace(old, Arc::clone(object)), Arc::clone(object)));
            false
        });
        rebased
    }

    /// Whether some key has more than one Service object, or one object came twice (then only
    /// a whole sync takes them in the order the model serves them).
    pub fn has_shared_keys(&self) -> bool {
        self.shared_keys > 0 || self.repeated
    }

    /// The Service objects of `keys`, and their EndpointSlices.
    pub fn objects_of<'a>(
        &self,
        keys: impl IntoIterator<Item = &'a ServiceKey>,
    ) -> (Vec<Arc<Service>>, Vec<Arc<EndpointSlice>>) {
        let (mut services, mut slices) = (Vec::new(), Vec::new());
        for objects in keys.into_iter().filter_map(|key| self.by_key.get(key)) {
            services.extend(objects.services.as_slice().iter().cloned());
            slices.extend(objects.slices.as_slice().iter().cloned());
        }
        (services, slices)
    }

    /// The keys whose allocation annotation names `number` (none in a view of every version).
    pub fn holders_of(&self, number: u16) -> &[ServiceKey] {
        self.holders.get(&number).map_or(&[], Few::as_slice)
    }

    /// The facts kept of `object`, if the last pass saw it.
    pub fn facts(&self, object: &Arc<Service>) -> Option<&F> {
        self.services.peek(object)
    }

    /// The numbers `key`'s allocation annotations name.
    pub fn numbers_of<'a>(&'a self, key: &ServiceKey) -> impl Iterator<Item = u16> + use<'a, F> {
        self.facts_of(key).flat_map(|(_, facts)| facts.numbers())
    }

    /// The Service objects of `key`, with their facts.
    pub fn facts_of<'a>(
        &'a self,
        key: &ServiceKey,
    ) -> impl Iterator<Item = (&'a Arc<Service>, &'a F)> + use<'a, F> {
        let objects = self.by_key.get(key).into_iter().flat_map(|o| o.services.as_slice());
        objects.filter_map(|o| Some((o, self.services.peek(o)?)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn service(name: &str, annotation: Option<&str>, rv: &str) -> Arc<Service> {
        let mut v = serde_json::json!({
            "apiVersion": "v1", "kind": "Service",
            "metadata": {"name": name, "namespace": "default", "resourceVersion": rv},
            "spec": {"type": "LoadBalancer", "ports": [{"port": 80}]}
        });
        if let Some(a) = annotation {
            v["metadata"]["annotations"] = serde_json::json!({model::ANNOTATION_ALLOCATED: a});
        }
        Arc::new(serde_json::from_value(v).expect("service"))
    }

    fn slice(service: &str, name: &str) -> Arc<EndpointSlice> {
        let v = serde_json::json!({
            "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
            "metadata": {"name": name, "namespace": "default",
                         "labels": {"kubernetes.io/service-name": service}},
            "addressType": "IPv4", "endpoints": []
        });
        Arc::new(serde_json::from_value(v).expect("slice"))
    }

    fn key(name: &str) -> ServiceKey {
        ServiceKey::new("default", name)
    }

    fn names(keys: &HashSet<ServiceKey>) -> BTreeSet<String> {
        keys.iter().map(|k| k.name.to_string()).collect()
    }

    /// Each pass names the keys of the objects that came, went or changed version, and the
    /// numbers their annotations named; the index of holders and of each key's objects follows.
    #[test]
    fn a_pass_names_what_changed_and_the_index_follows() {
        let mut view: SourceView = SourceView::default();
        let a = service("a", Some("80/TCP=20001"), "1");
        let b = service("b", Some("80/TCP=20002"), "1");
        let (sa, sb1, sb2) = (slice("a", "a-1"), slice("b", "b-1"), slice("b", "b-2"));
        let first = view.pass(&[a.clone(), b.clone()], &[sb2.clone(), sa.clone(), sb1.clone()]);
        assert!(first.first);
        assert_eq!(names(&first.keys), ["a", "b"].map(String::from).into());
        assert_eq!(first.numbers, [20001, 20002].into());

        // Nothing changed (another order).
        let same = view.pass(&[b.clone(), a.clone()], &[sa.clone(), sb1.clone(), sb2.clone()]);
        assert_eq!(same, ViewChanges::default());
        let (objects, slices) = view.objects_of([&key("b")]);
        assert!(objects.len() == 1 && Arc::ptr_eq(&objects[0], &b));
        assert_eq!(slices.len(), 2);

        // b re-annotated with a's number, a slice of a gone, c new without an annotation.
        let b2 = service("b", Some("80/TCP=20001"), "2");
        let c = service("c", None, "1");
        let changed = view.pass(&[a.clone(), b2.clone(), c.clone()], &[sb1.clone(), sb2.clone()]);
        assert_eq!(names(&changed.keys), ["a", "b", "c"].map(String::from).into());
        assert_eq!(changed.numbers, [20001, 20002].into());
        let mut holders = view.holders_of(20001).to_vec();
        holders.sort();
        assert_eq!(holders, [key("a"), key("b")]);
        assert!(view.holders_of(20002).is_empty());
        assert_eq!(view.numbers_of(&key("b")).collect::<Vec<_>>(), [20001]);
        // Hand-written forms: every number the model may read (no protocol, a port twice).
        let b3 = service("b", Some("80=20005,80/TCP=20006,bad"), "3");
        view.pass(&[a.clone(), b3.clone(), c.clone()], &[sb1.clone(), sb2.clone()]);
        assert_eq!(view.numbers_of(&key("b")).collect::<Vec<_>>(), [20005, 20006]);
        assert_eq!(view.holders_of(20005), [key("b")]);
        view.pass(&[a.clone(), b2.clone(), c.clone()], &[sb1.clone(), sb2.clone()]);
        assert!(view.objects_of([&key("a")]).1.is_empty(), "a's slice is gone");

        // Two objects with one key; then one of them gone.
        assert!(!view.has_shared_keys());
        let c2 = service("c", None, "2");
        let both = view.pass(&[a.clone(), b2.clone(), c.clone(), c2.clone()], &[]);
        assert_eq!(names(&both.keys), ["b", "c"].map(String::from).into(), "c's new object, b's slices gone");
        assert!(view.has_shared_keys());
        assert_eq!(view.objects_of([&key("c")]).0.len(), 2);
        let gone = view.pass(&[a, b2, c2], &[]);
        assert!(!view.has_shared_keys());
        assert_eq!(names(&gone.keys), ["c"].map(String::from).into());
        assert_eq!(view.objects_of([&key("c")]).0.len(), 1);
    }

    /// A new version that reads the same to a node (another resourceVersion, the leader's
    /// ingress) is no change: the index holds it, the pass names the pair. A version that reads
    /// otherwise, or one that comes while the old one is still there, is a change.
    #[test]
    fn a_version_that_reads_the_same_is_no_change() {
        let mut view: SourceView = SourceView::default();
        let a = service("a", Some("80/TCP=20001"), "1");
        let sa = slice("a", "a-1");
        view.pass(std::slice::from_ref(&a), std::slice::from_ref(&sa));

        let mut written = Service::clone(&a);
        written.metadata.resource_version = Some("2".into());
        written.status = Some(
            serde_json::from_value(serde_json::json!(
                {"loadBalancer": {"ingress": [{"ip": "192.0.2.10", "ipMode": "Proxy"}]}}
            ))
            .expect("status"),
        );
        let written = Arc::new(written);
        let same = view.pass(std::slice::from_ref(&written), std::slice::from_ref(&sa));
        assert!(same.keys.is_empty() && same.numbers.is_empty(), "{same:?}");
        assert_eq!(same.rebased.len(), 1);
        assert!(Arc::ptr_eq(&same.rebased[0].0, &a) && Arc::ptr_eq(&same.rebased[0].1, &written));
        let (objects, _) = view.objects_of([&key("a")]);
        assert!(objects.len() == 1 && Arc::ptr_eq(&objects[0], &written), "the index holds the new one");
        assert_eq!(view.holders_of(20001), [key("a")]);
        assert_eq!(
            view.pass(std::slice::from_ref(&written), std::slice::from_ref(&sa)),
            ViewChanges::default()
        );

        // Another number: a change.
        let moved = service("a", Some("80/TCP=20002"), "3");
        let changed = view.pass(std::slice::from_ref(&moved), std::slice::from_ref(&sa));
        assert_eq!(names(&changed.keys), ["a"].map(String::from).into());
        assert_eq!(changed.numbers, [20001, 20002].into());
        assert!(changed.rebased.is_empty());

        // The old object still there next to its copy: two objects of one key, a change.
        let copy = service("a", Some("80/TCP=20002"), "4");
        let both = view.pass(&[moved.clone(), copy.clone()], std::slice::from_ref(&sa));
        assert_eq!(names(&both.keys), ["a"].map(String::from).into());
        assert!(both.rebased.is_empty() && view.has_shared_keys());
    }
}
