//! Discovery documents (`/version`, `/api`, `/apis`, group/version resource lists). `Api<K>` with
//! k8s-openapi types needs none of them; they are here for `Discovery` users and `kubectl`-like tools.

use std::collections::BTreeMap;

use serde_json::{Value, json};

use crate::resources::RESOURCES;

fn resource_list(group: &str, version: &str) -> Option<Value> {
    let mut resources = Vec::new();
    for r in RESOURCES.iter().filter(|r| r.group == group && r.version == version) {
        resources.push(json!({
            "name": r.plural, "singularName": r.singular(), "namespaced": r.namespaced, "kind": r.kind,
            "verbs": ["create", "delete", "get", "list", "patch", "update", "watch"],
            "shortNames": r.short_names,
        }));
        if r.status_subresource {
            resources.push(json!({
                "name": format!("{}/status", r.plural), "singularName": "", "namespaced": r.namespaced,
                "kind": r.kind, "verbs": ["get", "patch", "update"],
            }));
        }
    }
    if resources.is_empty() {
        return None;
    }
    let gv = if group.is_empty() { version.to_string() } else { format!("{group}/{version}") };
    Some(json!({"kind": "APIResourceList", "apiVersion": "v1", "groupVersion": gv, "resources": resources}))
}

fn groups() -> Vec<Value> {
    let mut g: BTreeMap<&str, Vec<&str>> = BTreeMap::new();
    for r in RESOURCES.iter().filter(|r| !r.group.is_empty()) {
        let v = g.entry(r.group).or_default();
        if !v.contains(&r.version) {
            v.push(r.version);
        }
    }
    g.into_iter()
        .map(|(name, versions)| {
            let vs: Vec<Value> = versions
                .iter()
                .map(|v| json!({"groupVersion": format!("{name}/{v}"), "version": v}))
                .collect();
            json!({"name": name, "versions": vs, "preferredVersion": vs[0]})
        })
        .collect()
}

/// The discovery document for `path`, if it is a discovery path.
pub(crate) fn discovery(path: &str) -> Option<Value> {
    let segs: Vec<&str> = path.trim_matches('/').split('/').collect();
    match segs.as_slice() {
        ["version"] => Some(json!({
            "major": "1", "minor": "34", "gitVersion": "v1.34.0-nodelb-testapi", "gitCommit": "",
            "gitTreeState": "clean", "buildDate": "2025-01-01T00:00:00Z", "goVersion": "go1.24",
            "compiler": "gc", "platform": "linux/amd64",
        })),
        ["api"] => Some(json!({
            "kind": "APIVersions", "versions": ["v1"],
            "serverAddressByClientCIDRs": [{"clientCIDR": "0.0.0.0/0", "serverAddress": ""}],
        })),
        ["apis"] => Some(json!({"kind": "APIGroupList", "apiVersion": "v1", "groups": groups()})),
        ["api", v] => resource_list("", v),
        ["apis", g] => groups().into_iter().find(|x| x["name"] == *g).map(|mut x| {
            x["kind"] = json!("APIGroup");
            x["apiVersion"] = json!("v1");
            x
        }),
        ["apis", g, v] => resource_list(g, v),
        _ => None,
    }
}
