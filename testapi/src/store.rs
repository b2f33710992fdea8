//! The object store: one global resourceVersion counter (like etcd's revision), a bounded history of
//! changes for watches, and the write semantics of the API server's generic registry.

use std::collections::{BTreeMap, VecDeque};
use std::hash::{BuildHasher, Hasher};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use serde_json::{Map, Value, json};
use tokio::sync::broadcast;

use crate::error::ApiError;
use crate::fields::{self, Op};
use crate::resources::{NAMESPACES, RESOURCES, ResourceType};
use crate::selector::{FieldSelector, LabelSelector};

/// (resource index, namespace or "" for cluster-scoped, name); ordered like etcd keys.
pub(crate) type Key = (usize, String, String);

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum ChangeKind {
    Added,
    Modified,
    Deleted,
}

/// One committed write, as kept in the watch history and broadcast to open watches.
#[derive(Debug)]
pub(crate) struct Change {
    pub rv: u64,
    pub res: usize,
    pub kind: ChangeKind,
    /// The object after the change (for `Deleted`: the last state, carrying the deletion's resourceVersion).
    pub obj: Value,
    /// The object before the change (for selector transitions in filtered watches).
    pub prev: Option<Value>,
}

pub(crate) struct Inner {
    pub rv: u64,
    objects: BTreeMap<Key, Value>,
    history: VecDeque<Arc<Change>>,
    history_limit: usize,
    /// Watches from a resourceVersion older than this get 410 Gone.
    pub compacted: u64,
}

pub(crate) struct Store {
    inner: Mutex<Inner>,
    tx: broadcast::Sender<Arc<Change>>,
}

/// Which part of an object a write addresses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Part {
    /// The main resource: `status` changes are ignored when the type has a status subresource.
    Main,
    /// The `/status` subresource: only `status` changes.
    Status,
    /// Test setup through the handle: everything is written as given.
    All,
}

/// How a write is made: which part, by whom, with which operation.
#[derive(Debug, Clone)]
pub(crate) struct Write {
    pub part: Part,
    pub dry_run: bool,
    pub manager: String,
    pub op: Op,
    pub force: bool,
}

impl Write {
    pub fn new(part: Part, manager: &str) -> Self {
        Write { part, dry_run: false, manager: manager.to_string(), op: Op::Update, force: false }
    }
}

/// Filter of a list or watch.
#[derive(Debug, Clone, Default)]
pub(crate) struct Filter {
    pub namespace: Option<String>,
    pub labels: LabelSelector,
    pub fields: FieldSelector,
}

impl Filter {
    pub fn matches(&self, obj: &Value) -> bool {
        self.namespace.as_deref().is_none_or(|ns| meta_str(obj, "namespace") == ns)
            && self.labels.matches(obj)
            && self.fields.matches(obj)
    }
}

/// What a watch starts with.
pub(crate) enum WatchStart {
    /// Events to send first (already filtered), then follow the receiver.
    Events(Vec<(&'static str, Value)>, broadcast::Receiver<Arc<Change>>),
    /// The requested resourceVersion is compacted: send this `ERROR` and close.
    Gone(ApiError),
}

pub(crate) struct ListResult {
    pub items: Vec<Value>,
    pub resource_version: u64,
    pub continue_token: Option<String>,
    pub remaining: Option<usize>,
}

pub(crate) fn meta_str<'a>(obj: &'a Value, field: &str) -> &'a str {
    obj.get("metadata").and_then(|m| m.get(field)).and_then(Value::as_str).unwrap_or("")
}

fn meta_mut(obj: &mut Value) -> &mut Map<String, Value> {
    if !obj.get("metadata").is_some_and(Value::is_object) {
        obj["metadata"] = json!({});
    }
    obj["metadata"].as_object_mut().expect("metadata is an object")
}

static RNG_COUNTER: AtomicU64 = AtomicU64::new(0);

fn random_u64() -> u64 {
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u64(RNG_COUNTER.fetch_add(1, Ordering::Relaxed));
    h.finish()
}

fn new_uid() -> String {
    let (a, b) = (random_u64(), random_u64());
    format!(
        "{:08x}-{:04x}-4{:03x}-{:04x}-{:012x}",
        a >> 32,
        (a >> 16) & 0xffff,
        a & 0xfff,
        0x8000 | (b >> 48) & 0x3fff,
        b & 0xffff_ffff_ffff
    )
}

fn generate_suffix() -> String {
    const ALPHABET: &[u8] = b"bcdfghjklmnpqrstvwxz2456789";
    let mut r = random_u64();
    (0..5)
        .map(|_| {
            let c = ALPHABET[(r % ALPHABET.len() as u64) as usize] as char;
            r /= ALPHABET.len() as u64;
            c
        })
        .collect()
}

pub(crate) fn now_rfc3339() -> String {
    jiff::Timestamp::now().strftime("%Y-%m-%dT%H:%M:%SZ").to_string()
}

/// DNS-1123 subdomain, which is what nearly every built-in type requires of its name.
fn valid_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 253
        && name.chars().all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-' || c == '.')
        && name.starts_with(|c: char| c.is_ascii_alphanumeric())
        && name.ends_with(|c: char| c.is_ascii_alphanumeric())
}

/// The object without the parts that do not count as "spec" changes (for `metadata.generation`).
fn spec_part(obj: &Value) -> Value {
    let mut o = obj.clone();
    if let Some(m) = o.as_object_mut() {
        m.remove("metadata");
        m.remove("status");
    }
    o
}

/// The object without resourceVersion, to detect no-op writes.
fn content(obj: &Value) -> Value {
    let mut o = obj.clone();
    if let Some(m) = o.get_mut("metadata").and_then(Value::as_object_mut) {
        m.remove("resourceVersion");
    }
    o
}

impl Store {
    pub fn new(history_limit: usize) -> Self {
        let (tx, _) = broadcast::channel(16384);
        let mut objects = BTreeMap::new();
        let ts = now_rfc3339();
        let mut rv = 0;
        for ns in ["default", "kube-system", "kube-public", "kube-node-lease"] {
            rv += 1;
            objects.insert(
                (NAMESPACES, String::new(), ns.to_string()),
                json!({
                    "apiVersion": "v1", "kind": "Namespace",
                    "metadata": {
                        "name": ns, "uid": new_uid(), "resourceVersion": rv.to_string(),
                        "creationTimestamp": ts, "labels": {"kubernetes.io/metadata.name": ns},
                    },
                    "spec": {"finalizers": ["kubernetes"]},
                    "status": {"phase": "Active"},
                }),
            );
        }
        Store {
            inner: Mutex::new(Inner { rv, objects, history: VecDeque::new(), history_limit, compacted: rv }),
            tx,
        }
    }

    pub fn lock(&self) -> MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub fn set_history_limit(&self, limit: usize) {
        let mut g = self.lock();
        g.history_limit = limit.max(1);
        g.trim();
    }

    /// Forget all history: every resourceVersion before now is "too old" for a watch.
    pub fn compact(&self) {
        let mut g = self.lock();
        g.history.clear();
        g.compacted = g.rv;
    }

    pub fn get(&self, res: usize, ns: &str, name: &str) -> Result<Value, ApiError> {
        self.lock()
            .objects
            .get(&(res, ns.to_string(), name.to_string()))
            .cloned()
            .ok_or_else(|| ApiError::not_found(&RESOURCES[res], name))
    }

    pub fn list(
        &self,
        res: usize,
        filter: &Filter,
        limit: Option<usize>,
        continue_token: Option<&str>,
        resource_version: Option<&str>,
        exact: bool,
    ) -> Result<ListResult, ApiError> {
        let g = self.lock();
        let (snapshot_rv, start) = match continue_token.filter(|c| !c.is_empty()) {
            Some(tok) => {
                let bad = || ApiError::bad_request(format!("continue key is not valid: {tok}"));
                let mut parts = tok.splitn(3, '/');
                let rv: u64 = parts.next().and_then(|r| r.parse().ok()).ok_or_else(bad)?;
                let ns = parts.next().ok_or_else(bad)?.to_string();
                let name = parts.next().ok_or_else(bad)?.to_string();
                if rv < g.compacted {
                    return Err(ApiError::gone(
                        "The provided continue parameter is too old to display a consistent list result. \
                         You can start a new list without the continue parameter.",
                    ));
                }
                (rv, Some((ns, name)))
            }
            None => {
                if let Some(rv) = resource_version.filter(|r| !r.is_empty() && *r != "0") {
                    let n: u64 = rv
                        .parse()
                        .map_err(|_| ApiError::bad_request(format!("invalid resource version: {rv}")))?;
                    if n > g.rv {
                        return Err(ApiError::new(
                            504,
                            "Timeout",
                            format!("Too large resource version: {n}, current: {}", g.rv),
                        ));
                    }
                    if exact && n != g.rv {
                        return Err(ApiError::gone(format!("too old resource version: {n} ({})", g.rv)));
                    }
                }
                (g.rv, None)
            }
        };
        let ns_key = filter.namespace.clone();
        let lower = match (&start, &ns_key) {
            (Some((ns, name)), _) => std::ops::Bound::Excluded((res, ns.clone(), name.clone())),
            (None, Some(ns)) => std::ops::Bound::Included((res, ns.clone(), String::new())),
            (None, None) => std::ops::Bound::Included((res, String::new(), String::new())),
        };
        let mut items = Vec::new();
        let mut continue_token = None;
        let mut remaining = None;
        let mut iter = g
            .objects
            .range((lower, std::ops::Bound::Unbounded))
            .take_while(|(k, _)| k.0 == res && ns_key.as_ref().is_none_or(|ns| &k.1 == ns))
            .filter(|(_, v)| filter.matches(v));
        for (k, v) in iter.by_ref() {
            items.push(v.clone());
            if limit.is_some_and(|l| l > 0 && items.len() >= l) {
                continue_token = Some(format!("{snapshot_rv}/{}/{}", k.1, k.2));
                break;
            }
        }
        if continue_token.is_some() {
            let rest = iter.count();
            if rest == 0 {
                continue_token = None;
            } else {
                remaining = Some(rest);
            }
        }
        Ok(ListResult { items, resource_version: snapshot_rv, continue_token, remaining })
    }

    pub fn watch(
        &self,
        res: usize,
        filter: &Filter,
        resource_version: Option<&str>,
        send_initial_events: bool,
    ) -> Result<WatchStart, ApiError> {
        let g = self.lock();
        let rx = self.tx.subscribe();
        let rv = resource_version.unwrap_or("");
        let mut out = Vec::new();
        if rv.is_empty() || rv == "0" || send_initial_events {
            for (k, v) in g.objects.iter() {
                if k.0 == res && filter.matches(v) {
                    out.push(("ADDED", v.clone()));
                }
            }
            if send_initial_events {
                let rt = &RESOURCES[res];
                out.push((
                    "BOOKMARK",
                    json!({
                        "kind": rt.kind, "apiVersion": rt.api_version(),
                        "metadata": {
                            "resourceVersion": g.rv.to_string(),
                            "annotations": {"k8s.io/initial-events-end": "true"},
                        },
                    }),
                ));
            }
            return Ok(WatchStart::Events(out, rx));
        }
        let n: u64 =
            rv.parse().map_err(|_| ApiError::bad_request(format!("invalid resource version: {rv}")))?;
        if n < g.compacted {
            return Ok(WatchStart::Gone(ApiError::gone(format!(
                "too old resource version: {n} ({})",
                g.compacted + 1
            ))));
        }
        for c in g.history.iter().filter(|c| c.rv > n) {
            if let Some(ev) = watch_event(c, res, filter) {
                out.push(ev);
            }
        }
        Ok(WatchStart::Events(out, rx))
    }

    /// POST.
    pub fn create(&self, res: usize, ns: &str, obj: Value, w: &Write) -> Result<Value, ApiError> {
        self.lock().create_locked(&self.tx, res, ns, obj, w, None)
    }
    /// PUT (and the second half of every PATCH).
    pub fn update(&self, res: usize, ns: &str, name: &str, obj: Value, w: &Write) -> Result<Value, ApiError> {
        let mut g = self.lock();
        let key = (res, ns.to_string(), name.to_string());
        let old = g.objects.get(&key).cloned().ok_or_else(|| ApiError::not_found(&RESOURCES[res], name))?;
        g.update_locked(&self.tx, key, old, obj, w, None)
    }

    /// PATCH: `f` computes the new object from the current one under the store lock, so that the
    /// resourceVersion precondition the patch carries is checked against exactly what it was applied to.
    pub fn patch(
        &self,
        res: usize,
        ns: &str,
        name: &str,
        w: &Write,
        f: impl FnOnce(Option<&Value>) -> Result<PatchOutcome, ApiError>,
    ) -> Result<Value, ApiError> {
        let rt = &RESOURCES[res];
        let key = (res, ns.to_string(), name.to_string());
        let mut g = self.lock();
        let current = g.objects.get(&key).cloned();
        match (f(current.as_ref())?, current) {
            (PatchOutcome::Apply(mut applied), None) if w.part != Part::Status => {
                meta_mut(&mut applied).insert("name".into(), json!(name));
                g.create_locked(&self.tx, res, ns, applied.clone(), w, Some(&applied))
            }
            (PatchOutcome::Apply(applied), Some(now)) => {
                let av = rt.api_version();
                if !w.force {
                    fields::apply_conflicts(&now, &applied, &w.manager, w.part, rt.status_subresource, &av)?;
                }
                let mut merged = now.clone();
                json_patch::merge(&mut merged, &applied);
                for p in fields::dropped_by_applier(&now, &applied, &w.manager, w.part, rt.status_subresource)
                {
                    fields::remove_path(&mut merged, &p);
                }
                g.update_locked(&self.tx, key, now, merged, w, Some(&applied))
            }
            (PatchOutcome::Update(obj), Some(now)) => g.update_locked(&self.tx, key, now, obj, w, None),
            _ => Err(ApiError::not_found(rt, name)),
        }
    }

    /// DELETE with optional preconditions (`DeleteOptions.preconditions`).
    pub fn delete(
        &self,
        res: usize,
        ns: &str,
        name: &str,
        pre_uid: Option<&str>,
        pre_rv: Option<&str>,
        dry_run: bool,
    ) -> Result<(Value, bool), ApiError> {
        let rt = &RESOURCES[res];
        let mut g = self.lock();
        let key = (res, ns.to_string(), name.to_string());
        let old = g.objects.get(&key).cloned().ok_or_else(|| ApiError::not_found(rt, name))?;
        if let Some(uid) = pre_uid.filter(|u| *u != meta_str(&old, "uid")) {
            return Err(ApiError::conflict(
                rt,
                name,
                &format!(
                    "Precondition failed: UID in precondition: {uid}, UID in object meta: {}",
                    meta_str(&old, "uid")
                ),
            ));
        }
        if let Some(rv) = pre_rv.filter(|r| *r != meta_str(&old, "resourceVersion")) {
            return Err(ApiError::conflict(
                rt,
                name,
                &format!(
                    "Precondition failed: ResourceVersion in precondition: {rv}, ResourceVersion in object meta: {}",
                    meta_str(&old, "resourceVersion")
                ),
            ));
        }
        if dry_run {
            return Ok((old, true));
        }
        let has_finalizers =
            old.pointer("/metadata/finalizers").and_then(Value::as_array).is_some_and(|f| !f.is_empty())
                && res != NAMESPACES;
        if has_finalizers {
            if !meta_str(&old, "deletionTimestamp").is_empty() {
                return Ok((old, false));
            }
            let mut new = old.clone();
            let m = meta_mut(&mut new);
            m.insert("deletionTimestamp".into(), json!(now_rfc3339()));
            m.insert("deletionGracePeriodSeconds".into(), json!(0));
            let out = g.commit(&self.tx, key, ChangeKind::Modified, new, Some(old));
            return Ok((out, false));
        }
        if res == NAMESPACES {
            // Simplified namespace lifecycle: its objects go right away, then the namespace.
            let inside: Vec<Key> = g
                .objects
                .iter()
                .filter(|(k, _)| RESOURCES[k.0].namespaced && k.1 == name)
                .map(|(k, _)| k.clone())
                .collect();
            for k in inside {
                if let Some(o) = g.objects.get(&k).cloned() {
                    g.commit(&self.tx, k, ChangeKind::Deleted, o.clone(), Some(o));
                }
            }
        }
        let out = g.commit(&self.tx, key, ChangeKind::Deleted, old.clone(), Some(old));
        Ok((out, true))
    }

    /// All objects of a resource (test accessor).
    pub fn all(&self, res: usize, ns: Option<&str>) -> Vec<Value> {
        let g = self.lock();
        g.objects
            .iter()
            .filter(|(k, _)| k.0 == res && ns.is_none_or(|ns| k.1 == ns))
            .map(|(_, v)| v.clone())
            .collect()
    }

    /// Events for a bookmark: everything already broadcast is drained from `rx` under the lock, so the
    /// returned resourceVersion is never ahead of an event the watch has yet to send.
    pub fn drain_for_bookmark(
        &self,
        rx: &mut broadcast::Receiver<Arc<Change>>,
    ) -> (Vec<Arc<Change>>, bool, u64) {
        let g = self.lock();
        let mut out = Vec::new();
        let mut lagged = false;
        loop {
            match rx.try_recv() {
                Ok(c) => out.push(c),
                Err(broadcast::error::TryRecvError::Lagged(_)) => lagged = true,
                Err(_) => break,
            }
        }
        (out, lagged, g.rv)
    }
}

pub(crate) enum PatchOutcome {
    /// Server-side apply of this configuration (creates the object when missing).
    Apply(Value),
    /// The patched object.
    Update(Value),
}

fn check_type(rt: &ResourceType, obj: &Value) -> Result<(), ApiError> {
    if !obj.is_object() {
        return Err(ApiError::bad_request("the body of the request is not a JSON object"));
    }
    let kind = obj.get("kind").and_then(Value::as_str).unwrap_or(rt.kind);
    let av = obj.get("apiVersion").and_then(Value::as_str).unwrap_or("");
    if kind != rt.kind || (!av.is_empty() && av != rt.api_version()) {
        return Err(ApiError::bad_request(format!(
            "the API version in the data ({av}) does not match the expected API version ({}) or kind {kind} is not {}",
            rt.api_version(),
            rt.kind
        )));
    }
    Ok(())
}

/// Translate a committed change into what a (filtered) watch on `res` sees, including selector
/// transitions: an object that starts matching is ADDED, one that stops matching is DELETED.
pub(crate) fn watch_event(c: &Change, res: usize, filter: &Filter) -> Option<(&'static str, Value)> {
    if c.res != res {
        return None;
    }
    let now = filter.matches(&c.obj);
    let before = c.prev.as_ref().is_some_and(|p| filter.matches(p));
    let ty = match c.kind {
        ChangeKind::Added => now.then_some("ADDED")?,
        ChangeKind::Deleted => before.then_some("DELETED")?,
        ChangeKind::Modified => match (before, now) {
            (true, true) => "MODIFIED",
            (false, true) => "ADDED",
            (true, false) => "DELETED",
            (false, false) => return None,
        },
    };
    Some((ty, c.obj.clone()))
}

impl Inner {
    fn create_locked(
        &mut self,
        tx: &broadcast::Sender<Arc<Change>>,
        res: usize,
        ns: &str,
        mut obj: Value,
        w: &Write,
        applied: Option<&Value>,
    ) -> Result<Value, ApiError> {
        let (part, dry_run) = (w.part, w.dry_run);
        let rt = &RESOURCES[res];
        check_type(rt, &obj)?;
        let g = self;
        let ns = if rt.namespaced {
            let body_ns = meta_str(&obj, "namespace");
            if !body_ns.is_empty() && body_ns != ns {
                return Err(ApiError::bad_request(
                    "the namespace of the provided object does not match the namespace sent on the request",
                ));
            }
            if !g.objects.contains_key(&(NAMESPACES, String::new(), ns.to_string())) {
                return Err(ApiError::not_found(&RESOURCES[NAMESPACES], ns));
            }
            ns.to_string()
        } else {
            String::new()
        };
        if !meta_str(&obj, "resourceVersion").is_empty() {
            return Err(ApiError::bad_request("resourceVersion should not be set on objects to be created"));
        }
        let mut name = meta_str(&obj, "name").to_string();
        if name.is_empty() {
            let prefix = meta_str(&obj, "generateName").to_string();
            if prefix.is_empty() {
                return Err(ApiError::invalid(
                    rt,
                    "",
                    "metadata.name: Required value: name or generateName is required",
                ));
            }
            loop {
                name = format!("{prefix}{}", generate_suffix());
                if !g.objects.contains_key(&(res, ns.clone(), name.clone())) {
                    break;
                }
            }
        }
        if !valid_name(&name) {
            return Err(ApiError::invalid(
                rt,
                &name,
                &format!(
                    "metadata.name: Invalid value: \"{name}\": a lowercase RFC 1123 subdomain must consist of lower case alphanumeric characters, '-' or '.', and must start and end with an alphanumeric character"
                ),
            ));
        }
        let key = (res, ns.clone(), name.clone());
        if g.objects.contains_key(&key) {
            return Err(ApiError::already_exists(rt, &name));
        }
        obj["apiVersion"] = json!(rt.api_version());
        obj["kind"] = json!(rt.kind);
        let m = meta_mut(&mut obj);
        m.insert("name".into(), json!(name));
        if rt.namespaced {
            m.insert("namespace".into(), json!(ns));
        } else {
            m.remove("namespace");
        }
        m.insert("uid".into(), json!(new_uid()));
        m.insert("creationTimestamp".into(), json!(now_rfc3339()));
        m.insert("generation".into(), json!(1));
        m.remove("deletionTimestamp");
        m.remove("deletionGracePeriodSeconds");
        m.remove("managedFields");
        if res == NAMESPACES {
            m.entry("labels").or_insert_with(|| json!({}))["kubernetes.io/metadata.name"] = json!(name);
            obj["status"] = json!({"phase": "Active"});
        } else if rt.reset_status_on_create && part != Part::All {
            obj["status"] = json!({});
        }
        fields::record(
            None,
            &mut obj,
            &w.manager,
            w.op,
            applied,
            Part::All,
            rt.status_subresource,
            &rt.api_version(),
        );
        if dry_run {
            return Ok(obj);
        }
        Ok(g.commit(tx, key, ChangeKind::Added, obj, None))
    }

    fn trim(&mut self) {
        while self.history.len() > self.history_limit {
            if let Some(c) = self.history.pop_front() {
                self.compacted = c.rv;
            }
        }
    }

    fn commit(
        &mut self,
        tx: &broadcast::Sender<Arc<Change>>,
        key: Key,
        kind: ChangeKind,
        mut obj: Value,
        prev: Option<Value>,
    ) -> Value {
        self.rv += 1;
        meta_mut(&mut obj).insert("resourceVersion".into(), json!(self.rv.to_string()));
        let res = key.0;
        if kind == ChangeKind::Deleted {
            self.objects.remove(&key);
        } else {
            self.objects.insert(key, obj.clone());
        }
        let change = Arc::new(Change { rv: self.rv, res, kind, obj: obj.clone(), prev });
        self.history.push_back(change.clone());
        self.trim();
        let _ = tx.send(change);
        obj
    }

    fn update_locked(
        &mut self,
        tx: &broadcast::Sender<Arc<Change>>,
        key: Key,
        old: Value,
        new: Value,
        w: &Write,
        applied: Option<&Value>,
    ) -> Result<Value, ApiError> {
        let (part, dry_run) = (w.part, w.dry_run);
        let rt = &RESOURCES[key.0];
        let name = key.2.clone();
        check_type(rt, &new)?;
        let body_name = meta_str(&new, "name");
        if !body_name.is_empty() && body_name != name {
            return Err(ApiError::bad_request(format!(
                "the name of the object ({body_name}) does not match the name on the URL ({name})"
            )));
        }
        if rt.namespaced {
            let body_ns = meta_str(&new, "namespace");
            if !body_ns.is_empty() && body_ns != key.1 {
                return Err(ApiError::bad_request(
                    "the namespace of the provided object does not match the namespace sent on the request",
                ));
            }
        }
        let rv = meta_str(&new, "resourceVersion");
        if !rv.is_empty() && rv != meta_str(&old, "resourceVersion") {
            return Err(ApiError::stale(rt, &name));
        }
        let uid = meta_str(&new, "uid");
        if !uid.is_empty() && uid != meta_str(&old, "uid") {
            return Err(ApiError::conflict(
                rt,
                &name,
                &format!(
                    "Precondition failed: UID in precondition: {uid}, UID in object meta: {}",
                    meta_str(&old, "uid")
                ),
            ));
        }
        let mut result = match part {
            Part::Status => {
                let mut r = old.clone();
                match new.get("status") {
                    Some(s) => r["status"] = s.clone(),
                    None => {
                        r.as_object_mut().map(|m| m.remove("status"));
                    }
                }
                r
            }
            Part::Main | Part::All => {
                let mut r = new;
                if part == Part::Main && rt.status_subresource {
                    match old.get("status") {
                        Some(s) => r["status"] = s.clone(),
                        None => {
                            r.as_object_mut().map(|m| m.remove("status"));
                        }
                    }
                }
                r
            }
        };
        result["apiVersion"] = json!(rt.api_version());
        result["kind"] = json!(rt.kind);
        let old_meta = old.get("metadata").cloned().unwrap_or_default();
        let generation = old_meta.get("generation").and_then(Value::as_i64).unwrap_or(1);
        let spec_changed = spec_part(&result) != spec_part(&old);
        let m = meta_mut(&mut result);
        m.insert("name".into(), json!(name));
        if rt.namespaced {
            m.insert("namespace".into(), json!(key.1));
        }
        for f in
            ["uid", "creationTimestamp", "deletionTimestamp", "deletionGracePeriodSeconds", "managedFields"]
        {
            match old_meta.get(f) {
                Some(v) => m.insert(f.into(), v.clone()),
                None => m.remove(f),
            };
        }
        m.insert("generation".into(), json!(if spec_changed { generation + 1 } else { generation }));
        m.remove("resourceVersion");
        fields::record(
            Some(&old),
            &mut result,
            &w.manager,
            w.op,
            applied,
            part,
            rt.status_subresource,
            &rt.api_version(),
        );
        if content(&result) == content(&old) {
            // A no-op write: no new resourceVersion, no watch event (etcd is not written).
            return Ok(old);
        }
        if dry_run {
            return Ok(result);
        }
        let finalized = !meta_str(&result, "deletionTimestamp").is_empty()
            && result.pointer("/metadata/finalizers").and_then(Value::as_array).is_none_or(|f| f.is_empty());
        if finalized {
            return Ok(self.commit(tx, key, ChangeKind::Deleted, result, Some(old)));
        }
        Ok(self.commit(tx, key, ChangeKind::Modified, result, Some(old)))
    }
}
