//! A simplified field manager: `metadata.managedFields` (FieldsV1) with per-manager ownership of leaf
//! fields, server-side apply conflicts and removal of fields an applier stops applying.
//!
//! Simplified against the real structured-merge-diff: lists are atomic (one owned leaf, no
//! `k:`/`v:` list-map keys), maps are owned through their leaves only (no `.` entries), and of
//! `metadata` only `labels`, `annotations`, `finalizers` and `ownerReferences` are tracked.

use std::collections::{BTreeMap, BTreeSet};

use serde_json::{Map, Value, json};

use crate::error::ApiError;
use crate::store::{Part, now_rfc3339};

pub(crate) type Path = Vec<String>;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Op {
    Update,
    Apply,
}

impl Op {
    fn as_str(self) -> &'static str {
        match self {
            Op::Update => "Update",
            Op::Apply => "Apply",
        }
    }
}

fn walk(v: &Value, prefix: &mut Path, out: &mut BTreeMap<Path, Value>) {
    match v {
        Value::Object(m) if !m.is_empty() => {
            for (k, v) in m {
                prefix.push(k.clone());
                walk(v, prefix, out);
                prefix.pop();
            }
        }
        _ => {
            out.insert(prefix.clone(), v.clone());
        }
    }
}

/// Leaf fields (with values) of the part of `obj` that a write to `part` may own.
pub(crate) fn leaves(obj: &Value, part: Part, status_subresource: bool) -> BTreeMap<Path, Value> {
    let mut out = BTreeMap::new();
    let Some(m) = obj.as_object() else { return out };
    for (k, v) in m {
        let mut p = vec![k.clone()];
        match k.as_str() {
            "apiVersion" | "kind" => {}
            "metadata" => {
                for mk in ["labels", "annotations", "finalizers", "ownerReferences"] {
                    if let Some(x) = v.get(mk) {
                        let mut p = vec![k.clone(), mk.to_string()];
                        walk(x, &mut p, &mut out);
                    }
                }
            }
            "status" if status_subresource && part == Part::Main => {}
            _ if part == Part::Status && k != "status" => {}
            _ => walk(v, &mut p, &mut out),
        }
    }
    out
}

fn dotted(p: &Path) -> String {
    p.iter().map(|s| format!(".{s}")).collect()
}

#[derive(Debug, Clone)]
struct Entry {
    manager: String,
    operation: String,
    subresource: Option<String>,
    api_version: String,
    time: String,
    fields: BTreeSet<Path>,
}

fn parse_fields(v: &Value, prefix: &mut Path, out: &mut BTreeSet<Path>) {
    let Some(m) = v.as_object() else { return };
    for (k, v) in m {
        if let Some(key) = k.strip_prefix("f:") {
            prefix.push(key.to_string());
            if v.as_object().is_none_or(|x| x.is_empty()) {
                out.insert(prefix.clone());
            } else {
                parse_fields(v, prefix, out);
            }
            prefix.pop();
        }
    }
}

fn render_fields(fields: &BTreeSet<Path>) -> Value {
    let mut root = Map::new();
    for p in fields {
        let mut cur = &mut root;
        for k in p {
            cur = cur
                .entry(format!("f:{k}"))
                .or_insert_with(|| json!({}))
                .as_object_mut()
                .expect("fieldsV1 nodes are objects");
        }
    }
    Value::Object(root)
}

fn entries(obj: &Value) -> Vec<Entry> {
    let Some(list) = obj.pointer("/metadata/managedFields").and_then(Value::as_array) else { return vec![] };
    list.iter()
        .map(|e| {
            let s = |k: &str| e.get(k).and_then(Value::as_str).unwrap_or("").to_string();
            let mut fields = BTreeSet::new();
            if let Some(f) = e.get("fieldsV1") {
                parse_fields(f, &mut vec![], &mut fields);
            }
            Entry {
                manager: s("manager"),
                operation: s("operation"),
                subresource: e.get("subresource").and_then(Value::as_str).map(str::to_string),
                api_version: s("apiVersion"),
                time: s("time"),
                fields,
            }
        })
        .collect()
}

fn subresource_of(part: Part) -> Option<String> {
    (part == Part::Status).then(|| "status".to_string())
}

/// Server-side apply conflicts: fields in `applied` owned by another manager whose current value differs.
pub(crate) fn apply_conflicts(
    current: &Value,
    applied: &Value,
    manager: &str,
    part: Part,
    status_subresource: bool,
    api_version: &str,
) -> Result<(), ApiError> {
    let want = leaves(applied, part, status_subresource);
    let have = leaves(current, Part::All, status_subresource);
    let mut conflicts: Vec<(String, Path)> = Vec::new();
    for e in entries(current).iter().filter(|e| e.manager != manager) {
        for p in &e.fields {
            if let Some(v) = want.get(p)
                && have.get(p) != Some(v)
            {
                conflicts.push((e.manager.clone(), p.clone()));
            }
        }
    }
    if conflicts.is_empty() {
        return Ok(());
    }
    let n = conflicts.len();
    let lines: Vec<String> = conflicts
        .iter()
        .map(|(m, p)| format!("conflict with \"{m}\" using {api_version}: {}", dotted(p)))
        .collect();
    Err(ApiError::new(
        409,
        "Conflict",
        format!("Apply failed with {n} conflict{}: {}", if n == 1 { "" } else { "s" }, lines.join("; ")),
    ))
}

/// Fields `manager` applied before but not in `applied`, and that nobody else owns: they go.
pub(crate) fn dropped_by_applier(
    current: &Value,
    applied: &Value,
    manager: &str,
    part: Part,
    status_sub: bool,
) -> Vec<Path> {
    let sub = subresource_of(part);
    let all = entries(current);
    let want = leaves(applied, part, status_sub);
    let Some(mine) =
        all.iter().find(|e| e.manager == manager && e.operation == "Apply" && e.subresource == sub)
    else {
        return vec![];
    };
    mine.fields
        .iter()
        .filter(|p| !want.contains_key(*p))
        .filter(|p| {
            !all.iter().any(|e| !(e.manager == manager && e.operation == "Apply") && e.fields.contains(*p))
        })
        .cloned()
        .collect()
}

pub(crate) fn remove_path(obj: &mut Value, p: &Path) {
    let Some((last, parents)) = p.split_last() else { return };
    let mut cur = obj;
    for k in parents {
        match cur.get_mut(k) {
            Some(next) => cur = next,
            None => return,
        }
    }
    if let Some(m) = cur.as_object_mut() {
        m.remove(last);
    }
}

/// Update `new.metadata.managedFields` for a write by `manager`: changed fields move to the writer;
/// an applier owns exactly what it applied (`applied`).
#[allow(clippy::too_many_arguments)]
pub(crate) fn record(
    old: Option<&Value>,
    new: &mut Value,
    manager: &str,
    op: Op,
    applied: Option<&Value>,
    part: Part,
    status_sub: bool,
    api_version: &str,
) {
    let lo = old.map(|o| leaves(o, Part::All, status_sub)).unwrap_or_default();
    let ln = leaves(new, Part::All, status_sub);
    let writable = leaves(new, part, status_sub);
    let changed: BTreeSet<Path> =
        lo.keys().chain(ln.keys()).filter(|p| lo.get(*p) != ln.get(*p)).cloned().collect();
    let sub = subresource_of(part);
    let mut all = old.map(entries).unwrap_or_default();
    let is_mine = |e: &Entry| e.manager == manager && e.operation == op.as_str() && e.subresource == sub;
    for e in all.iter_mut().filter(|e| !is_mine(e)) {
        e.fields.retain(|p| !changed.contains(p) && ln.contains_key(p));
    }
    let prev: BTreeSet<Path> = all.iter().find(|e| is_mine(e)).map(|e| e.fields.clone()).unwrap_or_default();
    let mine: BTreeSet<Path> = match (op, applied) {
        (Op::Apply, Some(a)) => {
            leaves(a, part, status_sub).into_keys().filter(|p| ln.contains_key(p)).collect()
        }
        _ => prev
            .iter()
            .chain(changed.iter().filter(|p| writable.contains_key(*p)))
            .filter(|p| ln.contains_key(*p))
            .cloned()
            .collect(),
    };
    let touched = mine != prev || (op == Op::Update && !changed.is_empty());
    match all.iter_mut().find(|e| is_mine(e)) {
        Some(e) => {
            if touched {
                e.time = now_rfc3339();
            }
            e.fields = mine;
        }
        None => all.push(Entry {
            manager: manager.to_string(),
            operation: op.as_str().to_string(),
            subresource: sub,
            api_version: api_version.to_string(),
            time: now_rfc3339(),
            fields: mine,
        }),
    }
    all.retain(|e| !e.fields.is_empty());
    let rendered: Vec<Value> = all
        .iter()
        .map(|e| {
            let mut v = json!({
                "manager": e.manager, "operation": e.operation, "apiVersion": e.api_version,
                "time": e.time, "fieldsType": "FieldsV1", "fieldsV1": render_fields(&e.fields),
            });
            if let Some(s) = &e.subresource {
                v["subresource"] = json!(s);
            }
            v
        })
        .collect();
    if let Some(m) = new.get_mut("metadata").and_then(Value::as_object_mut) {
        if rendered.is_empty() {
            m.remove("managedFields");
        } else {
            m.insert("managedFields".into(), Value::Array(rendered));
        }
    }
}
