//! Per-Service "last good" (Kubernetes mode): a Service edited into something invalid (bad
//! annotation, bad CIDR) keeps serving its last valid spec instead of being half-applied or
//! dropped; the refusal is still reported (Warning Event, condition). A Service never seen valid
//! is simply not programmed (fail closed). Same idea as the manifests mode's per-file last good.
//! Pure.

use foldhash::HashMap;
use std::borrow::Borrow;
use std::sync::Arc;

use k8s_openapi::api::core::v1::Service;

use crate::domain::ServiceKey;
use crate::incremental::per_object::PerObject;
use crate::inputs::model::{self, ANNOTATION_ALLOCATED, ModelOptions, Refusal};

#[derive(Debug, Default)]
pub struct LastGoodServices {
    /// Last valid object per key (same uid required to reuse it: a re-created Service is new),
    /// with the last [`LastGoodServices::apply`] that saw its key. Shared with the cache it came
    /// from: remembering it copies nothing.
    good: HashMap<ServiceKey, (Arc<Service>, u64)>,
    /// The objects the last call passed on as they are (not ours, or valid: `true`): the very
    /// same object again is passed on without a look at it (no key built and hashed, no field
    /// read: in Kubernetes mode this call runs on every sync, over every Service).
    passed: PerObject<Service, bool>,
    /// The options `passed` was decided with.
    opts: Option<ModelOptions>,
    /// Counts the calls of [`LastGoodServices::apply`]: what a call did not see is forgotten.
    round: u64,
}

/// The Services to use, and the refusals that a last good version is masking.
#[derive(Debug, Default)]
pub struct Substituted {
    pub services: Vec<Arc<Service>>,
    pub masked: Vec<Refusal>,
    /// The Services of `services` that are a last good spec, not the object as it is (one per
    /// refusal of `masked`).
    pub substituted: Vec<Arc<Service>>,
}

impl LastGoodServices {
    /// The Services to use for `services`. `S`: the Services shared (`Arc`, as the reflector
    /// store holds them; passed on as they are) or owned (tests).
    ///
    /// `scoped`: `None` when `services` are every Service (what the call does not see is
    /// forgotten); `Some(gone)` when they are the Services a scoped round plans, and `gone` the
    /// objects that left the view since the last call (deleted, or replaced by a newer version):
    /// what is known of every other Service is kept, and each object of `gone` forgotten, a
    /// deleted Service's last good spec with it.
    pub fn apply<S>(
        &mut self,
        services: &[S],
        scoped: Option<&[Arc<Service>]>,
        opts: &ModelOptions,
    ) -> Substituted
    where
        S: Borrow<Service> + Clone + Into<Arc<Service>>,
    {
        let mut out = Substituted::default();
        self.round += 1;
        let round = self.round;
        if scoped.is_none() {
            self.passed.begin();
        }
        if self.opts.as_ref() != Some(opts) {
            self.passed.clear();
            self.opts = Some(opts.clone());
        }
        for shared in services {
            // Shared objects stay shared; an owned one becomes a new object (never found below).
            self.one(shared.clone().into(), opts, round, &mut out);
        }
        // Forgotten: the last good spec of a Service gone, or replaced by one never seen valid
        // (not ours any more, another uid). A valid object passed on by address is the one its
        // key remembers.
        let forgotten = |passed: &PerObject<Service, bool>, (good, seen): &(Arc<Service>, u64)| {
            *seen != round && !passed.peek(good).is_some_and(|valid| *valid)
        };
        match scoped {
            None => {
                self.passed.end();
                let passed = &self.passed;
                self.good.retain(|_, entry| !forgotten(passed, entry));
            }
            Some(gone) => {
                for object in gone {
                    self.passed.remove(object);
                }
                let keys = (services.iter().map(|s| model::service_key(s.borrow())))
                    .chain(gone.iter().map(|s| model::service_key(s)));
                for key in keys {
                    if self.good.get(&key).is_some_and(|entry| forgotten(&self.passed, entry)) {
                        self.good.remove(&key);
                    }
                }
            }
        }
        out
    }

    /// One Service of a call: passed on as it is, or its last good spec in its place.
    fn one(&mut self, object: Arc<Service>, opts: &ModelOptions, round: u64, out: &mut Substituted) {
        if self.passed.get(&object).is_some() {
            out.services.push(object);
            return;
        }
        let svc: &Service = &object;
        if !model::is_ours(svc, opts) {
            self.passed.insert(&object, false);
            out.services.push(object);
            return;
        }
        let key = model::service_key(svc);
        // The very object that was found valid last time needs no check (nor copy) again:
        // the per-Service check would be a good part of every sync.
        let unchanged = svc.metadata.resource_version.is_some()
            && self.good.get_mut(&key).is_some_and(|(g, seen)| {
                let same = g.metadata.uid == svc.metadata.uid
                    && g.metadata.resource_version == svc.metadata.resource_version;
                if same {
                    // The same version, maybe another object after a relist: the one
                    // remembered is the one passed on by address.
                    *g = Arc::clone(&object);
                    *seen = round;
                }
                same
            });
        let refusal = if unchanged {
            None
        } else {
            model::build(std::slice::from_ref(svc), model::NO_SLICES, opts).refused.into_iter().next()
        };
        match refusal {
            None => {
                if !unchanged {
                    self.good.insert(key, (Arc::clone(&object), round));
                }
                self.passed.insert(&object, true);
                out.services.push(object);
            }
            Some(refusal) => {
                match self.good.get_mut(&key).filter(|(g, _)| g.metadata.uid == svc.metadata.uid) {
                    Some((good, seen)) => {
                        *seen = round;
                        // The one copy: the last good spec with the current allocation and status.
                        let mut kept = Service::clone(good);
                        let current = crate::inputs::model::allocated_annotation(svc);
                        let ann = kept.metadata.annotations.get_or_insert_default();
                        match current {
                            Some(v) => ann.insert(ANNOTATION_ALLOCATED.to_string(), v.clone()),
                            None => ann.remove(ANNOTATION_ALLOCATED),
                        };
                        kept.metadata.resource_version = svc.metadata.resource_version.clone();
                        kept.status = svc.status.clone();
                        let kept = Arc::new(kept);
                        out.substituted.push(Arc::clone(&kept));
                        out.services.push(kept);
                        out.masked.push(refusal);
                    }
                    None => out.services.push(object),
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn svc(uid: &str, ranges: &[&str], allocated: Option<&str>) -> Service {
        let mut v = json!({
            "metadata": {"name": "web", "namespace": "default", "uid": uid, "annotations": {}},
            "spec": {"type": "LoadBalancer", "ports": [{"port": 80}], "loadBalancerSourceRanges": ranges}
        });
        if let Some(a) = allocated {
            v["metadata"]["annotations"][ANNOTATION_ALLOCATED] = json!(a);
        }
        serde_json::from_value(v).unwrap()
    }

    fn ranges(s: &Service) -> Vec<String> {
        s.spec.as_ref().unwrap().load_balancer_source_ranges.clone().unwrap()
    }

    #[test]
    fn table() {
        let opts = ModelOptions::default();
        let mut lg = LastGoodServices::default();
        // Never valid: passed through (the model refuses it: fail closed), nothing masked.
        let out = lg.apply(&[svc("u1", &["bad"], None)], None, &opts);
        assert_eq!((ranges(&out.services[0]), out.masked.len()), (vec!["bad".to_string()], 0));
        // Valid: remembered.
        let out = lg.apply(&[svc("u1", &["10.0.0.0/8"], Some("80/TCP=20001"))], None, &opts);
        assert!(out.masked.is_empty());
        // Broken edit: the last good spec is used, with the current allocation; refusal reported.
        let out = lg.apply(&[svc("u1", &["10.0.0.0/33"], Some("80/TCP=20002"))], None, &opts);
        assert_eq!(ranges(&out.services[0]), vec!["10.0.0.0/8"]);
        assert_eq!(out.masked.len(), 1);
        assert!(out.masked[0].to_string().contains("10.0.0.0/33"));
        let ann = out.services[0].metadata.annotations.as_ref().unwrap();
        assert_eq!(ann[ANNOTATION_ALLOCATED], "80/TCP=20002");
        // Still broken: still masked (the memory survives rounds).
        assert_eq!(lg.apply(&[svc("u1", &["10.0.0.0/33"], None)], None, &opts).masked.len(), 1);
        // Re-created (new uid) while broken: not the same Service, fail closed.
        let out = lg.apply(&[svc("u2", &["10.0.0.0/33"], None)], None, &opts);
        assert!(out.masked.is_empty());
        assert_eq!(ranges(&out.services[0]), vec!["10.0.0.0/33"]);
        // Deleted: forgotten.
        lg.apply(&[] as &[Service], None, &opts);
        assert!(lg.good.is_empty());
    }

    /// Shared objects seen again are passed on by address, and the memory of the last good
    /// spec survives that (also across a relist that brings a new object of the same version).
    #[test]
    fn objects_seen_again_keep_their_last_good_spec() {
        let opts = ModelOptions::default();
        let mut lg = LastGoodServices::default();
        let versioned = |ranges: &[&str], rv: &str| {
            let mut s = svc("u1", ranges, Some("80/TCP=20001"));
            s.metadata.resource_version = Some(rv.into());
            Arc::new(s)
        };
        let mut other = svc("u9", &["10.0.0.0/8"], None);
        other.metadata.name = Some("other".into());
        other.spec.as_mut().unwrap().type_ = Some("ClusterIP".into());
        let other = Arc::new(other);
        let good = versioned(&["10.0.0.0/8"], "1");
        for _ in 0..3 {
            let out = lg.apply(&[Arc::clone(&good), Arc::clone(&other)], None, &opts);
            assert!(out.masked.is_empty());
            assert!(Arc::ptr_eq(&out.services[0], &good) && Arc::ptr_eq(&out.services[1], &other));
        }
        assert_eq!(lg.passed.len(), 2);
        // A relist: a new object of the same version, then seen again by address.
        let relisted = versioned(&["10.0.0.0/8"], "1");
        for _ in 0..2 {
            let out = lg.apply(&[Arc::clone(&relisted)], None, &opts);
            assert!(Arc::ptr_eq(&out.services[0], &relisted));
        }
        assert_eq!(lg.passed.len(), 1, "the objects no call saw are let go");
        // A broken edit: the last good spec, as with owned objects.
        let broken = versioned(&["10.0.0.0/33"], "2");
        for _ in 0..2 {
            let out = lg.apply(&[Arc::clone(&broken)], None, &opts);
            assert_eq!(out.masked.len(), 1);
            assert_eq!(ranges(&out.services[0]), vec!["10.0.0.0/8"]);
        }
        // Other options decide again: not ours under them, its last good spec is forgotten (as
        // for any Service that stops being ours), so the broken edit is not masked after it.
        let valid = versioned(&["10.0.0.0/8"], "3");
        assert!(lg.apply(&[Arc::clone(&valid)], None, &opts).masked.is_empty());
        let other_class =
            ModelOptions { lb_class: "example.com/other".into(), ignore_unclassed: true, ..opts.clone() };
        assert!(lg.apply(&[Arc::clone(&valid)], None, &other_class).masked.is_empty());
        assert!(lg.good.is_empty());
        assert!(lg.apply(&[Arc::clone(&broken)], None, &opts).masked.is_empty(), "fail closed");
        lg.apply(&[] as &[Arc<Service>], None, &opts);
        assert!(lg.good.is_empty() && lg.passed.is_empty());
    }

    #[test]
    fn invalid_ignore_value_keeps_the_last_good_spec() {
        let opts = ModelOptions::default();
        let mut lg = LastGoodServices::default();
        let valid = svc("u1", &["10.0.0.0/8"], Some("80/TCP=20001"));
        assert!(lg.apply(std::slice::from_ref(&valid), None, &opts).masked.is_empty());
        // `nodelb.io/ignore: "yes"` is neither an opt-out nor ignored: the Service keeps its last
        // valid spec (and its allocation), and the refusal names the annotation and the value.
        let mut typo = valid.clone();
        typo.metadata
            .annotations
            .get_or_insert_default()
            .insert(model::ANNOTATION_IGNORE.into(), "yes".into());
        let out = lg.apply(&[typo], None, &opts);
        assert_eq!(out.masked.len(), 1);
        let msg = out.masked[0].to_string();
        assert!(msg.contains("nodelb.io/ignore=\"yes\""), "{msg}");
        let kept = &out.services[0];
        assert!(model::is_ours(kept, &opts));
        assert_eq!(ranges(kept), vec!["10.0.0.0/8"]);
        let ann = kept.metadata.annotations.as_ref().unwrap();
        assert_eq!(ann.get(model::ANNOTATION_IGNORE), None, "the last good spec, not the typo");
        assert_eq!(ann[ANNOTATION_ALLOCATED], "80/TCP=20001");
        // Never seen valid with the typo: fail closed (the model refuses it, nothing programmed).
        let mut fresh = svc("u2", &["10.0.0.0/8"], None);
        fresh
            .metadata
            .annotations
            .get_or_insert_default()
            .insert(model::ANNOTATION_IGNORE.into(), "yes".into());
        let out = LastGoodServices::default().apply(std::slice::from_ref(&fresh), None, &opts);
        assert!(out.masked.is_empty());
        let built = model::build(&out.services, model::NO_SLICES, &opts);
        assert!(built.services.is_empty());
        assert_eq!(built.refused.len(), 1, "{:?}", built.refused);
    }
}
