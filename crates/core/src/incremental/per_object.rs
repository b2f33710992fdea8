//! Values kept per shared object (`Arc`) while the object is still seen: what the caches'
//! unchanged objects already cost once is not computed again. Kept by the object's address, not
//! by a key built from it, so that finding a value hashes one word and reads no field of the
//! object (building and hashing keys for every object would be a visible share of every round). The
//! entry holds the object, so no other object can have its address while the value is kept; an
//! object replaced by a newer version (another `Arc`) simply finds nothing.
//!
//! Used in passes: [`PerObject::begin`], then [`PerObject::get`] / [`PerObject::insert`] for each
//! object of the pass, then [`PerObject::end`] forgets the objects the pass did not see (gone, or
//! replaced by a newer version).

use foldhash::{HashMap, HashMapExt};
use std::sync::Arc;

#[derive(Debug)]
pub struct PerObject<T, V> {
    entries: HashMap<usize, Entry<T, V>>,
    /// Counts the passes; an entry remembers the last pass that saw it.
    pass: u64,
}

#[derive(Debug)]
struct Entry<T, V> {
    /// Held: while it lives, no other object has the address that keys the entry (and a pass
    /// that drops it hands it back: [`PerObject::pass_changes`]).
    object: Arc<T>,
    seen: u64,
    value: V,
}

impl<T, V> Default for PerObject<T, V> {
    fn default() -> Self {
        PerObject { entries: HashMap::new(), pass: 0 }
    }
}

fn address<T>(object: &Arc<T>) -> usize {
    Arc::as_ptr(object) as usize
}

impl<T, V> PerObject<T, V> {
    /// Starts a pass.
    pub fn begin(&mut self) {
        self.pass += 1;
    }

    /// Forgets every object this pass did not see.
    pub fn end(&mut self) {
        let pass = self.pass;
        self.entries.retain(|_, e| e.seen == pass);
    }

    /// [`PerObject::end`], handing back the objects it forgets, with their values.
    pub fn end_changes(&mut self) -> Vec<(Arc<T>, V)> {
        let pass = self.pass;
        self.entries.extract_if(|_, e| e.seen != pass).map(|(_, e)| (e.object, e.value)).collect()
    }

    /// The value kept for this very object, which this pass has now seen.
    pub fn get(&mut self, object: &Arc<T>) -> Option<&mut V> {
        let pass = self.pass;
        self.entries.get_mut(&address(object)).map(|e| {
            e.seen = pass;
            &mut e.value
        })
    }

    /// The value kept for this very object, without counting it as seen.
    pub fn peek(&self, object: &Arc<T>) -> Option<&V> {
        self.entries.get(&address(object)).map(|e| &e.value)
    }

    /// Keeps `value` for `object` (seen by this pass), replacing what was kept.
    pub fn insert(&mut self, object: &Arc<T>, value: V) -> &mut V {
        let entry = Entry { object: Arc::clone(object), seen: self.pass, value };
        match self.entries.entry(address(object)) {
            std::collections::hash_map::Entry::Occupied(mut o) => {
                o.insert(entry);
                &mut o.into_mut().value
            }
            std::collections::hash_map::Entry::Vacant(v) => &mut v.insert(entry).value,
        }
    }

    /// The value kept for `object`, computed by `compute` if there is none (seen by this pass).
    pub fn get_or_insert_with(&mut self, object: &Arc<T>, compute: impl FnOnce() -> V) -> &mut V {
        let pass = self.pass;
        let e = self.entries.entry(address(object)).or_insert_with(|| Entry {
            object: Arc::clone(object),
            seen: pass,
            value: compute(),
        });
        e.seen = pass;
        &mut e.value
    }

    /// A whole pass over `objects`: the value of each, `compute`d for those not kept, in their
    /// order; the objects not among them are forgotten.
    pub fn pass(&mut self, objects: &[Arc<T>], compute: impl Fn(&Arc<T>) -> V) -> Vec<V>
    where
        V: Clone,
    {
        self.begin();
        let out = objects.iter().map(|o| self.get_or_insert_with(o, || compute(o)).clone()).collect();
        self.end();
        out
    }

    /// [`PerObject::pass`], also saying what changed since the last pass: the values it had to
    /// compute (objects it did not keep: new, or new versions) and the objects it forgot, with
    /// their values (gone, or replaced by a newer version).
    pub fn pass_changes(&mut self, objects: &[Arc<T>], compute: impl Fn(&Arc<T>) -> V) -> PassChanges<T, V>
    where
        V: Clone,
    {
        self.begin();
        let pass = self.pass;
        let mut computed = Vec::new();
        let values = objects
            .iter()
            .map(|o| {
                let e = self.entries.entry(address(o)).or_insert_with(|| {
                    let value = compute(o);
                    computed.push((Arc::clone(o), value.clone()));
                    Entry { object: Arc::clone(o), seen: pass, value }
                });
                e.seen = pass;
                e.value.clone()
            })
            .collect();
        let mut dropped = Vec::new();
        self.entries.retain(|_, e| {
            let keep = e.seen == pass;
            if !keep {
                dropped.push((Arc::clone(&e.object), e.value.clone()));
            }
            keep
        });
        PassChanges { values, computed, dropped }
    }

    /// Forgets `object` now (its value no longer holds).
    pub fn remove(&mut self, object: &Arc<T>) {
        self.entries.remove(&address(object));
    }

    pub fn clear(&mut self) {
        self.entries.clear();
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }
}

/// What [`PerObject::pass_changes`] found.
#[derive(Debug)]
pub struct PassChanges<T, V> {
    /// The value of each object of the pass, in its order.
    pub values: Vec<V>,
    /// The objects whose values it computed (they were not kept), with their values.
    pub computed: Vec<(Arc<T>, V)>,
    /// The objects forgotten, with their values.
    pub dropped: Vec<(Arc<T>, V)>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_pass_keeps_what_it_saw_and_forgets_the_rest() {
        let (a, b) = (Arc::new("a".to_string()), Arc::new("b".to_string()));
        let mut kept = PerObject::default();
        kept.begin();
        kept.insert(&a, 1);
        *kept.get_or_insert_with(&b, || 2) += 10;
        kept.end();
        assert_eq!((kept.peek(&a), kept.peek(&b)), (Some(&1), Some(&12)));

        // An equal but other object (a newer version of the same thing) finds nothing.
        let a2 = Arc::new("a".to_string());
        assert_eq!(kept.peek(&a2), None);

        // Seen by get, b by nothing: b is forgotten, a kept; peek does not count as seen.
        kept.begin();
        assert_eq!(kept.get(&a).copied(), Some(1));
        assert_eq!(kept.peek(&b), Some(&12));
        assert_eq!(*kept.get_or_insert_with(&a2, || 3), 3);
        kept.end();
        assert_eq!((kept.peek(&a), kept.peek(&b), kept.peek(&a2), kept.len()), (Some(&1), None, Some(&3), 2));

        // Removed now; replaced by insert; a pass that sees nothing forgets everything.
        kept.begin();
        kept.remove(&a);
        assert_eq!(kept.get(&a), None);
        kept.insert(&a2, 4);
        assert_eq!(kept.peek(&a2), Some(&4));
        kept.begin();
        kept.end();
        assert!(kept.is_empty());
    }

    #[test]
    fn a_whole_pass_computes_only_what_it_does_not_keep() {
        let (a, b) = (Arc::new(1u32), Arc::new(2u32));
        let mut kept = PerObject::default();
        let computed = std::cell::Cell::new(0);
        let double = |o: &Arc<u32>| {
            computed.set(computed.get() + 1);
            **o * 2
        };
        assert_eq!(kept.pass(&[Arc::clone(&a), Arc::clone(&b)], double), [2, 4]);
        assert_eq!(kept.pass(&[Arc::clone(&b), Arc::clone(&a)], double), [4, 2]);
        assert_eq!(computed.get(), 2, "the second pass computed nothing");
        assert_eq!(kept.pass(std::slice::from_ref(&b), double), [4]);
        assert_eq!((kept.len(), Arc::strong_count(&a)), (1, 1), "a forgotten");
    }

    #[test]
    fn a_pass_says_what_it_computed_and_what_it_dropped() {
        let (a, b, b2) = (Arc::new(1u32), Arc::new(2u32), Arc::new(2u32));
        let mut kept = PerObject::default();
        let values = |c: &[(Arc<u32>, u32)]| c.iter().map(|(_, v)| *v).collect::<Vec<_>>();
        let first = kept.pass_changes(&[Arc::clone(&a), Arc::clone(&b)], |o| **o * 10);
        assert_eq!(
            (first.values, values(&first.computed), first.dropped.len()),
            (vec![10, 20], vec![10, 20], 0)
        );
        let same = kept.pass_changes(&[Arc::clone(&b), Arc::clone(&a)], |o| **o * 10);
        assert_eq!((same.values, values(&same.computed), same.dropped.len()), (vec![20, 10], vec![], 0));
        // b replaced by a new version, a gone.
        let next = kept.pass_changes(std::slice::from_ref(&b2), |o| **o * 10);
        assert_eq!((next.values, values(&next.computed)), (vec![20], vec![20]));
        assert!(Arc::ptr_eq(&next.computed[0].0, &b2));
        let mut dropped: Vec<(u32, u32)> = next.dropped.iter().map(|(o, v)| (**o, *v)).collect();
        dropped.sort();
        assert_eq!(dropped, [(1, 10), (2, 20)]);
        assert!(next.dropped.iter().any(|(o, _)| Arc::ptr_eq(o, &b)), "the old version is handed back");
        assert_eq!(kept.len(), 1);
    }

    #[test]
    fn a_kept_object_lives_as_long_as_its_entry() {
        let a = Arc::new(7u32);
        let mut kept = PerObject::default();
        kept.begin();
        kept.insert(&a, ());
        assert_eq!(Arc::strong_count(&a), 2);
        kept.begin();
        kept.end();
        assert_eq!(Arc::strong_count(&a), 1);
    }
}
