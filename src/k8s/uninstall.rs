//! Uninstall or restart? What an agent does with its node's rules when it stops. Pure.
//!
//! A stopping agent (SIGTERM) either leaves its table in the kernel, so the node keeps serving
//! until the next agent replaces it atomically (a pod restart, an eviction, a rolling update, a
//! node drain), or removes it with its iptables ACCEPTs, because no agent will come back to this
//! node (nodelb was uninstalled, or the DaemonSet no longer runs here). The agent cannot ask at
//! SIGTERM whether it is being uninstalled: `kubectl delete -f daemonset/` deletes the Namespace,
//! then the ServiceAccount and the RBAC, all within milliseconds, so by the time the kubelet stops
//! the pod its credentials may be gone. So it watches its own Namespace, DaemonSet and Node all the
//! time (an established watch keeps delivering after the RBAC is deleted) and decides at SIGTERM
//! from what it last saw ([`decide`]), refreshed by one last read when the API still answers.
//!
//! Remove the rules when, in this order:
//! 1. the Namespace is gone or being deleted (`kubectl delete -f daemonset/`, `kubectl delete ns`);
//! 2. the DaemonSet is gone or being deleted (`helm uninstall`, `kubectl delete ds`), and none of
//!    that name was created since (a delete and re-create keeps the rules);
//! 3. the DaemonSet would no longer run a pod on this node: its nodeSelector or required node
//!    affinity no longer matches the Node, or the Node has a `NoExecute` taint it does not
//!    tolerate (what makes the DaemonSet controller delete a pod without replacing it);
//! 4. the last read was refused with 401 Unauthorized: the ServiceAccount was deleted, which only
//!    an uninstall does (a pod's bound token stays valid for a minute after the pod's deletion,
//!    longer than its grace period).
//!
//! Keep them otherwise, and whenever the facts are unknown (never read, API unreachable, 403
//! Forbidden: a rollback to a chart whose RBAC lacks these reads must not drop traffic). Keeping
//! is the safe side: stale rules are removed by `nodelb cleanup`; removed rules drop traffic.

use std::collections::BTreeMap;

use k8s_openapi::api::apps::v1::DaemonSet;
use k8s_openapi::api::core::v1::{
    Namespace, Node, NodeSelectorRequirement, NodeSelectorTerm, Taint, Toleration,
};

/// What the agent knows about one object.
#[derive(Debug, Clone, PartialEq, Default)]
pub enum Observed<T> {
    /// Never read (watch not synced yet, or refused from the start).
    #[default]
    Unknown,
    Present(T),
    /// Read as absent (a watch's delete event, an empty list).
    Gone,
}

impl<T> Observed<T> {
    pub fn present(&self) -> Option<&T> {
        match self {
            Observed::Present(t) => Some(t),
            _ => None,
        }
    }
}

/// The agent's Namespace, as far as the decision needs it.
#[derive(Debug, Clone, PartialEq)]
pub struct NamespaceFacts {
    pub name: String,
    pub deleting: bool,
}

impl NamespaceFacts {
    pub fn of(ns: &Namespace) -> NamespaceFacts {
        NamespaceFacts {
            name: ns.metadata.name.clone().unwrap_or_default(),
            deleting: ns.metadata.deletion_timestamp.is_some(),
        }
    }
}

/// The agent's DaemonSet: whether it is being deleted, and where its pods may run.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct DaemonSetFacts {
    pub name: String,
    pub deleting: bool,
    pub node_selector: BTreeMap<String, String>,
    /// `requiredDuringSchedulingIgnoredDuringExecution` terms (ORed); empty: any node.
    pub required_terms: Vec<NodeSelectorTerm>,
    pub tolerations: Vec<Toleration>,
}

impl DaemonSetFacts {
    pub fn of(ds: &DaemonSet) -> DaemonSetFacts {
        let pod = ds.spec.template.spec.as_ref();
        DaemonSetFacts {
            name: ds.metadata.name.clone().unwrap_or_default(),
            deleting: ds.metadata.deletion_timestamp.is_some(),
            node_selector: pod.and_then(|p| p.node_selector.clone()).unwrap_or_default(),
            required_terms: pod
                .and_then(|p| p.affinity.as_ref())
                .and_then(|a| a.node_affinity.as_ref())
                .and_then(|n| n.required_during_scheduling_ignored_during_execution.as_ref())
                .map(|r| r.node_selector_terms.clone())
                .unwrap_or_default(),
            tolerations: pod.and_then(|p| p.tolerations.clone()).unwrap_or_default(),
        }
    }
}

/// This agent's Node: its name, labels and taints.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct NodeFacts {
    pub name: String,
    pub labels: BTreeMap<String, String>,
    pub taints: Vec<Taint>,
}

impl NodeFacts {
    pub fn of(node: &Node) -> NodeFacts {
        NodeFacts {
            name: node.metadata.name.clone().unwrap_or_default(),
            labels: node.metadata.labels.clone().unwrap_or_default(),
            taints: node.spec.as_ref().and_then(|s| s.taints.clone()).unwrap_or_default(),
        }
    }
}

/// How the API server answered the last read at SIGTERM.
#[derive(Debug, Clone, PartialEq, Default)]
pub enum LastRead {
    /// Not tried, or no answer (timeout, connection refused): nothing learnt.
    #[default]
    NoAnswer,
    /// Answered: the facts above are fresh.
    Answered,
    /// 401 Unauthorized: the credentials are no longer valid (ServiceAccount deleted).
    Unauthorized(String),
    /// 403 Forbidden: the RBAC no longer grants the read (not enough to conclude: see the module).
    Forbidden(String),
}

/// Everything the decision is made from.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Seen {
    pub namespace: Observed<NamespaceFacts>,
    pub daemonset: Observed<DaemonSetFacts>,
    pub node: Observed<NodeFacts>,
    pub last_read: LastRead,
}

/// What to do with the node's rules, and why (for the log).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Exit {
    Keep(String),
    Remove(String),
}

/// The decision (see the module docs for the rules and their order).
pub fn decide(seen: &Seen, namespace: &str, daemonset: &str) -> Exit {
    match &seen.namespace {
        Observed::Gone => return Exit::Remove(format!("namespace {namespace} was deleted")),
        Observed::Present(ns) if ns.deleting => {
            return Exit::Remove(format!("namespace {namespace} is being deleted"));
        }
        _ => {}
    }
    match &seen.daemonset {
        Observed::Gone => return Exit::Remove(format!("DaemonSet {namespace}/{daemonset} was deleted")),
        Observed::Present(ds) if ds.deleting => {
            return Exit::Remove(format!("DaemonSet {namespace}/{daemonset} is being deleted"));
        }
        Observed::Present(ds) => {
            if let Some(node) = seen.node.present()
                && let Some(why) = not_for_this_node(ds, node)
            {
                return Exit::Remove(format!(
                    "DaemonSet {namespace}/{daemonset} no longer runs on node {}: {why}",
                    node.name
                ));
            }
        }
        Observed::Unknown => {}
    }
    if let LastRead::Unauthorized(msg) = &seen.last_read {
        return Exit::Remove(format!(
            "the API server no longer accepts this agent's ServiceAccount token ({msg}): nodelb was uninstalled"
        ));
    }
    match (&seen.daemonset, &seen.last_read) {
        (Observed::Present(_), _) => Exit::Keep(format!(
            "DaemonSet {namespace}/{daemonset} still runs on this node (a restart, an eviction or a rolling update)"
        )),
        (_, LastRead::Forbidden(msg)) => Exit::Keep(format!(
            "cannot tell whether nodelb is being uninstalled: reading DaemonSet {namespace}/{daemonset} is forbidden ({msg})"
        )),
        _ => Exit::Keep(format!(
            "cannot tell whether nodelb is being uninstalled: DaemonSet {namespace}/{daemonset} was never read"
        )),
    }
}

/// Why the DaemonSet controller would delete this node's pod without replacing it, if it would:
/// the pod's node selector or required node affinity no longer matches the Node, or the Node has
/// a `NoExecute` taint the pod does not tolerate.
pub fn not_for_this_node(ds: &DaemonSetFacts, node: &NodeFacts) -> Option<String> {
    for (k, v) in &ds.node_selector {
        if node.labels.get(k) != Some(v) {
            return Some(format!("nodeSelector {k}={v} does not match the Node's labels"));
        }
    }
    if !ds.required_terms.is_empty() && !ds.required_terms.iter().any(|t| term_matches(t, node)) {
        return Some("its required node affinity does not match the Node".to_string());
    }
    node.taints
        .iter()
        .filter(|t| t.effect == "NoExecute")
        .find(|t| !ds.tolerations.iter().chain(daemonset_tolerations().iter()).any(|tol| tolerates(tol, t)))
        .map(|t| {
            format!(
                "the Node has taint {}{}:NoExecute, not tolerated",
                t.key,
                t.value.as_deref().map(|v| format!("={v}")).unwrap_or_default()
            )
        })
}

/// The `NoExecute` tolerations the DaemonSet controller adds to every pod it creates
/// (`util.AddOrUpdateDaemonPodTolerations`): a node that is not ready or unreachable keeps its pod.
fn daemonset_tolerations() -> [Toleration; 2] {
    let exists = |key: &str| Toleration {
        key: Some(key.to_string()),
        operator: Some("Exists".to_string()),
        effect: Some("NoExecute".to_string()),
        ..Default::default()
    };
    [exists("node.kubernetes.io/not-ready"), exists("node.kubernetes.io/unreachable")]
}

/// `Toleration.ToleratesTaint` of k8s.io/api: an empty effect matches every effect, an empty key
/// with `Exists` every taint; `Exists` matches any value, `Equal` (the default) the same value.
/// `tolerationSeconds` is not looked at: the pod is tolerated while the DaemonSet controller
/// decides (it keeps pods whose toleration has not run out).
pub fn tolerates(tol: &Toleration, taint: &Taint) -> bool {
    if tol.effect.as_deref().is_some_and(|e| !e.is_empty() && e != taint.effect) {
        return false;
    }
    let key = tol.key.as_deref().unwrap_or("");
    if !key.is_empty() && key != taint.key {
        return false;
    }
    match tol.operator.as_deref().unwrap_or("Equal") {
        "Exists" => true,
        "Equal" | "" => {
            !key.is_empty() && tol.value.as_deref().unwrap_or("") == taint.value.as_deref().unwrap_or("")
        }
        _ => false,
    }
}

/// A node selector term: every requirement (label expressions, and `metadata.name` fields) holds.
/// A term with no requirement matches nothing (as in the scheduler).
fn term_matches(term: &NodeSelectorTerm, node: &NodeFacts) -> bool {
    let exprs = term.match_expressions.as_deref().unwrap_or_default();
    let fields = term.match_fields.as_deref().unwrap_or_default();
    if exprs.is_empty() && fields.is_empty() {
        return false;
    }
    let name = BTreeMap::from([("metadata.name".to_string(), node.name.clone())]);
    exprs.iter().all(|r| requirement_matches(r, &node.labels))
        && fields.iter().all(|r| requirement_matches(r, &name))
}

fn requirement_matches(r: &NodeSelectorRequirement, labels: &BTreeMap<String, String>) -> bool {
    let value = labels.get(&r.key);
    let values = r.values.as_deref().unwrap_or_default();
    let number = |s: &str| s.parse::<i64>().ok();
    match r.operator.as_str() {
        "In" => value.is_some_and(|v| values.contains(v)),
        "NotIn" => value.is_none_or(|v| !values.contains(v)),
        "Exists" => value.is_some(),
        "DoesNotExist" => value.is_none(),
        "Gt" | "Lt" => {
            let (Some(have), Some(want)) =
                (value.and_then(|v| number(v)), values.first().and_then(|v| number(v)))
            else {
                return false;
            };
            if r.operator == "Gt" { have > want } else { have < want }
        }
        // An operator this version does not know: the API server would have refused the
        // DaemonSet, so this is a newer one; assume it matches (keep the rules).
        _ => true,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ns(deleting: bool) -> Observed<NamespaceFacts> {
        Observed::Present(NamespaceFacts { name: "nodelb-system".into(), deleting })
    }
    fn ds(deleting: bool) -> DaemonSetFacts {
        DaemonSetFacts { name: "nodelb".into(), deleting, ..Default::default() }
    }
    fn node(labels: &[(&str, &str)], taints: &[(&str, &str)]) -> NodeFacts {
        NodeFacts {
            name: "node-1".into(),
            labels: labels.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect(),
            taints: taints
                .iter()
                .map(|(k, e)| Taint { key: k.to_string(), effect: e.to_string(), ..Default::default() })
                .collect(),
        }
    }
    fn expr(key: &str, op: &str, values: &[&str]) -> NodeSelectorRequirement {
        NodeSelectorRequirement {
            key: key.into(),
            operator: op.into(),
            values: Some(values.iter().map(|v| v.to_string()).collect()),
        }
    }
    fn tol(key: Option<&str>, op: Option<&str>, value: Option<&str>, effect: Option<&str>) -> Toleration {
        Toleration {
            key: key.map(Into::into),
            operator: op.map(Into::into),
            value: value.map(Into::into),
            effect: effect.map(Into::into),
            ..Default::default()
        }
    }

    #[test]
    fn decisions() {
        let present = Observed::Present(ds(false));
        let on_node = Observed::Present(node(&[("role", "lb")], &[]));
        let selected = Observed::Present(DaemonSetFacts {
            node_selector: BTreeMap::from([("role".into(), "lb".into())]),
            ..ds(false)
        });
        let seen = |namespace, daemonset, node, last_read| Seen { namespace, daemonset, node, last_read };
        let cases: Vec<(&str, Seen, bool)> = vec![
            (
                "restart: namespace and DaemonSet there",
                seen(ns(false), present.clone(), on_node.clone(), LastRead::Answered),
                false,
            ),
            (
                "kubectl delete -f: namespace being deleted",
                seen(ns(true), present.clone(), on_node.clone(), LastRead::Unauthorized("x".into())),
                true,
            ),
            (
                "namespace gone",
                seen(Observed::Gone, Observed::Unknown, Observed::Unknown, LastRead::NoAnswer),
                true,
            ),
            (
                "helm uninstall: DaemonSet deleted",
                seen(ns(false), Observed::Gone, on_node.clone(), LastRead::Forbidden("x".into())),
                true,
            ),
            (
                "DaemonSet deleted with foreground propagation",
                seen(ns(false), Observed::Present(ds(true)), on_node.clone(), LastRead::Answered),
                true,
            ),
            (
                "nodeSelector still matches",
                seen(ns(false), selected.clone(), on_node.clone(), LastRead::Answered),
                false,
            ),
            (
                "nodeSelector no longer matches",
                seen(
                    ns(false),
                    selected.clone(),
                    Observed::Present(node(&[("role", "web")], &[])),
                    LastRead::Answered,
                ),
                true,
            ),
            (
                "Node unknown: selector not judged",
                seen(ns(false), selected, Observed::Unknown, LastRead::Answered),
                false,
            ),
            (
                "token refused, nothing else seen",
                seen(
                    Observed::Unknown,
                    Observed::Unknown,
                    Observed::Unknown,
                    LastRead::Unauthorized("401".into()),
                ),
                true,
            ),
            (
                "forbidden, nothing seen: keep",
                seen(
                    Observed::Unknown,
                    Observed::Unknown,
                    Observed::Unknown,
                    LastRead::Forbidden("403".into()),
                ),
                false,
            ),
            ("API unreachable, nothing seen: keep", Seen::default(), false),
            (
                "API unreachable, last seen present: keep",
                seen(ns(false), present, on_node, LastRead::NoAnswer),
                false,
            ),
        ];
        for (name, seen, remove) in cases {
            let got = decide(&seen, "nodelb-system", "nodelb");
            assert_eq!(matches!(got, Exit::Remove(_)), remove, "{name}: {got:?}");
        }
    }

    #[test]
    fn the_reason_names_what_was_seen() {
        let seen = Seen { namespace: ns(true), ..Default::default() };
        assert_eq!(
            decide(&seen, "nodelb-system", "nodelb"),
            Exit::Remove("namespace nodelb-system is being deleted".into())
        );
        let seen = Seen { namespace: ns(false), daemonset: Observed::Gone, ..Default::default() };
        assert_eq!(
            decide(&seen, "nodelb-system", "nodelb"),
            Exit::Remove("DaemonSet nodelb-system/nodelb was deleted".into())
        );
    }

    #[test]
    fn node_affinity_and_taints() {
        let n = node(&[("zone", "a"), ("cpus", "8")], &[("dedicated", "NoExecute")]);
        let with = |terms: Vec<NodeSelectorTerm>, tolerations: Vec<Toleration>| DaemonSetFacts {
            required_terms: terms,
            tolerations,
            ..ds(false)
        };
        let term = |exprs: Vec<NodeSelectorRequirement>| NodeSelectorTerm {
            match_expressions: Some(exprs),
            match_fields: None,
        };
        let all = vec![tol(None, Some("Exists"), None, None)];
        let cases: Vec<(&str, DaemonSetFacts, bool)> = vec![
            ("tolerates everything, no affinity", with(vec![], all.clone()), true),
            ("untolerated NoExecute taint", with(vec![], vec![]), false),
            (
                "tolerated by key",
                with(vec![], vec![tol(Some("dedicated"), Some("Exists"), None, Some("NoExecute"))]),
                true,
            ),
            (
                "toleration for another effect",
                with(vec![], vec![tol(Some("dedicated"), Some("Exists"), None, Some("NoSchedule"))]),
                false,
            ),
            (
                "Equal needs the same value",
                with(vec![], vec![tol(Some("dedicated"), None, Some("x"), None)]),
                false,
            ),
            ("In matches", with(vec![term(vec![expr("zone", "In", &["a", "b"])])], all.clone()), true),
            ("In does not match", with(vec![term(vec![expr("zone", "In", &["b"])])], all.clone()), false),
            (
                "terms are ORed",
                with(
                    vec![term(vec![expr("zone", "In", &["b"])]), term(vec![expr("cpus", "Gt", &["4"])])],
                    all.clone(),
                ),
                true,
            ),
            (
                "expressions are ANDed",
                with(vec![term(vec![expr("zone", "In", &["a"]), expr("cpus", "Lt", &["4"])])], all.clone()),
                false,
            ),
            (
                "NotIn and DoesNotExist",
                with(
                    vec![term(vec![expr("zone", "NotIn", &["b"]), expr("gpu", "DoesNotExist", &[])])],
                    all.clone(),
                ),
                true,
            ),
            ("Exists", with(vec![term(vec![expr("gpu", "Exists", &[])])], all.clone()), false),
            ("an empty term matches nothing", with(vec![term(vec![])], all.clone()), false),
            (
                "matchFields metadata.name",
                with(
                    vec![NodeSelectorTerm {
                        match_expressions: None,
                        match_fields: Some(vec![expr("metadata.name", "In", &["node-1"])]),
                    }],
                    all.clone(),
                ),
                true,
            ),
        ];
        for (name, facts, runs) in cases {
            let got = not_for_this_node(&facts, &n);
            assert_eq!(got.is_none(), runs, "{name}: {got:?}");
        }
        // The DaemonSet controller's own tolerations: a node that is not ready keeps its pod.
        let not_ready = node(&[], &[("node.kubernetes.io/not-ready", "NoExecute")]);
        assert_eq!(not_for_this_node(&ds(false), &not_ready), None);
        // NoSchedule taints do not evict a running pod.
        let cordoned = node(&[], &[("node.kubernetes.io/unschedulable", "NoSchedule")]);
        assert_eq!(not_for_this_node(&ds(false), &cordoned), None);
    }
}
