//! What changed in a source's view (its Services and EndpointSlices) since the last sync, found
//! by object address, and each Service's objects by key: a node's sync scoped to what changed
//! (docs/design.md, "The node's sync scoped to what changed") starts from the keys this names and
//! reads the objects of its scope from here, with no walk of the view. Pure.
//!
//! A pass looks each object up by its address ([`PerObject`]): the facts of an object it has seen
//! before (its key, the node port numbers its allocation annotation names) are kept, those of a
//! new object or a new version are read once. The objects the pass did not see are gone (deleted,
//! or replaced by a newer version). What it changes is patched into the index of each key's
//! objects and of each number's holders.

use std::collections::BTreeSet;
use std::sync::Arc;

use foldhash::{HashMap, HashSet};
use k8s_openapi::api::core::v1::Service;

use crate::compact::EndpointSlice;
use crate::domain::ServiceKey;
use crate::model;
use crate::per_object::PerObject;

/// A Service object as the view keeps it.
#[derive(Debug, Clone)]
struct ServiceFacts {
    key: ServiceKey,
    /// Every number its allocation annotation names (`nodelb.io/allocated-ports`) as the model
    /// may read it ([`model::annotated_numbers`]).
    numbers: Box<[u16]>,
}

/// The view as the last pass left it (see the module's documentation). Kept for every object:
/// sized for the usual case (one object per key, one holder per number).
#[derive(Debug, Default)]
pub struct SourceView {
    services: PerObject<Service, ServiceFacts>,
    /// Each EndpointSlice's Service.
    slices: PerObject<EndpointSlice, Option<ServiceKey>>,
    /// The Service objects of each key (more than one only when a source hands over two objects
    /// with one key, which the model refuses).
    services_by_key: HashMap<ServiceKey, Few<Arc<Service>>>,
    /// How many keys have more than one Service object.
    shared_keys: usize,
    /// The last pass was handed one Service object twice.
    repeated: bool,
    slices_by_key: HashMap<ServiceKey, Few<Arc<EndpointSlice>>>,
    /// The keys whose allocation annotation names each number.
    holders: HashMap<u16, Few<ServiceKey>>,
    /// A pass has been made.
    passed: bool,
}

/// One value or a few (16 bytes and a tag).
#[derive(Debug)]
enum Few<T> {
    One(T),
    Many(Box<[T]>),
}

impl<T: Clone> Few<T> {
    fn as_slice(&self) -> &[T] {
        match self {
            Few::One(t) => std::slice::from_ref(t),
            Few::Many(v) => v,
        }
    }

    fn push(&mut self, t: T) {
        let mut all = self.as_slice().to_vec();
        all.push(t);
        *self = Few::Many(all.into_boxed_slice());
    }

    /// Takes out the first value `is` holds for; `false` when none is left.
    fn remove(&mut self, is: impl Fn(&T) -> bool) -> bool {
        let mut all = self.as_slice().to_vec();
        if let Some(i) = all.iter().position(is) {
            all.remove(i);
        }
        *self = match all.len() {
            0 => return false,
            1 => Few::One(all.pop().expect("one")),
            _ => Few::Many(all.into_boxed_slice()),
        };
        true
    }
}

/// Adds `value` under `key`.
fn add<K: std::hash::Hash + Eq, T: Clone>(map: &mut HashMap<K, Few<T>>, key: K, value: T) {
    match map.entry(key) {
        std::collections::hash_map::Entry::Occupied(mut o) => o.get_mut().push(value),
        std::collections::hash_map::Entry::Vacant(v) => {
            v.insert(Few::One(value));
        }
    }
}

/// Takes the first value `is` holds for out from under `key`.
fn take<K: std::hash::Hash + Eq, T: Clone>(map: &mut HashMap<K, Few<T>>, key: &K, is: impl Fn(&T) -> bool) {
    if let Some(few) = map.get_mut(key)
        && !few.remove(is)
    {
        map.remove(key);
    }
}

/// What a pass found changed since the one before.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct ViewChanges {
    /// There was no pass before this one.
    pub first: bool,
    /// The keys of the Services and EndpointSlices that came, went or are new versions.
    pub keys: HashSet<ServiceKey>,
    /// The numbers named by the allocation annotations of the Service objects that came or went.
    pub numbers: BTreeSet<u16>,
}

impl SourceView {
    /// One pass over the view: what changed since the last one.
    pub fn pass(&mut self, services: &[Arc<Service>], slices: &[Arc<EndpointSlice>]) -> ViewChanges {
        let mut changes =
            ViewChanges { first: !std::mem::replace(&mut self.passed, true), ..Default::default() };
        let mut computed = Vec::new();
        self.services.begin();
        for s in services {
            if self.services.get(s).is_none() {
                let facts = ServiceFacts {
                    key: model::service_key(s),
                    numbers: model::allocated_annotation(s)
                        .map(|v| model::annotated_numbers(v).into())
                        .unwrap_or_default(),
                };
                computed.push((Arc::clone(s), facts.clone()));
                self.services.insert(s, facts);
            }
        }
        let changed = self.services.end_changes();
        self.repeated = self.services.len() != services.len();
        for (object, facts) in changed {
            let before = self.services_by_key.get(&facts.key).map_or(0, |f| f.as_slice().len());
            take(&mut self.services_by_key, &facts.key, |o| Arc::ptr_eq(o, &object));
            if before == 2 {
                self.shared_keys -= 1;
            }
            for n in facts.numbers.iter() {
                take(&mut self.holders, n, |k| *k == facts.key);
            }
            changes.numbers.extend(facts.numbers.iter().copied());
            changes.keys.insert(facts.key);
        }
        for (object, facts) in computed {
            add(&mut self.services_by_key, facts.key.clone(), object);
            if self.services_by_key.get(&facts.key).map_or(0, |f| f.as_slice().len()) == 2 {
                self.shared_keys += 1;
            }
            for n in facts.numbers.iter() {
                add(&mut self.holders, *n, facts.key.clone());
            }
            changes.numbers.extend(facts.numbers.iter().copied());
            changes.keys.insert(facts.key);
        }
        self.slices.begin();
        for slice in slices {
            if self.slices.get(slice).is_none() {
                let service = model::slice_service(slice).map(|(ns, n)| ServiceKey::new(ns, n));
                if let Some(key) = &service {
                    add(&mut self.slices_by_key, key.clone(), Arc::clone(slice));
                    changes.keys.insert(key.clone());
                }
                self.slices.insert(slice, service);
            }
        }
        for (object, service) in self.slices.end_changes() {
            let Some(key) = service else { continue };
            take(&mut self.slices_by_key, &key, |o| Arc::ptr_eq(o, &object));
            changes.keys.insert(key);
        }
        changes
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
        for key in keys {
            services.extend(self.services_by_key.get(key).into_iter().flat_map(Few::as_slice).cloned());
            slices.extend(self.slices_by_key.get(key).into_iter().flat_map(Few::as_slice).cloned());
        }
        (services, slices)
    }

    /// The keys whose allocation annotation names `number`.
    pub fn holders_of(&self, number: u16) -> &[ServiceKey] {
        self.holders.get(&number).map_or(&[], Few::as_slice)
    }

    /// The numbers `key`'s allocation annotations name.
    pub fn numbers_of(&self, key: &ServiceKey) -> impl Iterator<Item = u16> + '_ {
        let objects = self.services_by_key.get(key).into_iter().flat_map(Few::as_slice);
        objects.filter_map(|o| self.services.peek(o)).flat_map(|f| f.numbers.iter().copied())
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
        let mut view = SourceView::default();
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
}
