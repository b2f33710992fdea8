//! The k3s ServiceLB labels, honoured as ServiceLB does (pure), so a cluster moving from
//! ServiceLB keeps serving each Service on the same nodes:
//! - Node label `svccontroller.k3s.cattle.io/enablelb`: once ANY node carries it (whatever its
//!   value), only nodes where it is `true` serve;
//! - Service label `svccontroller.k3s.cattle.io/lbpool`: while the node label above is in use, a
//!   Service with a non-empty value is served only on nodes whose label of the same name has the
//!   same value (ServiceLB ignores it otherwise, and so does nodelb).
//!
//! This narrows the nodes a Service's node port pool selects (both must select a node); it
//! never changes which pool or which port a Service gets. `--servicelb-labels=false` turns it off.

use std::collections::BTreeMap;
use std::fmt;

/// The node label that switches ServiceLB's node selection on.
pub const LABEL_ENABLELB: &str = "svccontroller.k3s.cattle.io/enablelb";
/// The Service and node label that ties a Service to a group of nodes.
pub const LABEL_LBPOOL: &str = "svccontroller.k3s.cattle.io/lbpool";

/// Whether the ServiceLB node selection is in force: the flag is on and any node carries
/// [`LABEL_ENABLELB`] (ServiceLB checks the key only: `enablelb=false` on one node is enough).
pub fn in_force<'a>(enabled: bool, nodes: impl IntoIterator<Item = &'a BTreeMap<String, String>>) -> bool {
    enabled && nodes.into_iter().any(|labels| labels.contains_key(LABEL_ENABLELB))
}

/// Why a node does not serve a Service under the ServiceLB labels.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum NotServed {
    /// The node's `enablelb` label is not `true` (missing, or another value).
    NotEnabled(Option<String>),
    /// The Service asks for an lbpool the node is not in.
    OtherPool { wanted: String, node: Option<String> },
}

impl fmt::Display for NotServed {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            NotServed::NotEnabled(None) => {
                write!(f, "this node has no {LABEL_ENABLELB}=true label (other nodes carry {LABEL_ENABLELB})")
            }
            NotServed::NotEnabled(Some(v)) => {
                write!(f, "this node has {LABEL_ENABLELB}={v:?}, not \"true\"")
            }
            NotServed::OtherPool { wanted, node: None } => {
                write!(f, "the Service has {LABEL_LBPOOL}={wanted:?}, this node has no {LABEL_LBPOOL} label")
            }
            NotServed::OtherPool { wanted, node: Some(v) } => {
                write!(f, "the Service has {LABEL_LBPOOL}={wanted:?}, this node has {LABEL_LBPOOL}={v:?}")
            }
        }
    }
}

/// Whether a node with `node` labels serves a Service with `service` labels, the selection being
/// [`in_force`] (when it is not, every node serves every Service).
pub fn serves(node: &BTreeMap<String, String>, service: &BTreeMap<String, String>) -> Result<(), NotServed> {
    match node.get(LABEL_ENABLELB) {
        Some(v) if v == "true" => {}
        other => return Err(NotServed::NotEnabled(other.cloned())),
    }
    match service.get(LABEL_LBPOOL).filter(|v| !v.is_empty()) {
        Some(wanted) if node.get(LABEL_LBPOOL) != Some(wanted) => {
            Err(NotServed::OtherPool { wanted: wanted.clone(), node: node.get(LABEL_LBPOOL).cloned() })
        }
        _ => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn labels(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
        pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect()
    }

    #[test]
    fn in_force_when_any_node_carries_the_key() {
        let plain = labels(&[("kubernetes.io/hostname", "a")]);
        let on = labels(&[(LABEL_ENABLELB, "true")]);
        let off = labels(&[(LABEL_ENABLELB, "false")]);
        let pool_only = labels(&[(LABEL_LBPOOL, "x")]);
        type Labels = BTreeMap<String, String>;
        let cases: &[(bool, &[&Labels], bool)] = &[
            (true, &[], false),
            (true, &[&plain, &plain], false),
            (true, &[&plain, &on], true),
            // ServiceLB selects on the key: a node opting out switches the selection on too.
            (true, &[&plain, &off], true),
            // lbpool alone does nothing (ServiceLB reads it only under enablelb).
            (true, &[&plain, &pool_only], false),
            // The flag off: never.
            (false, &[&on, &off], false),
        ];
        for (enabled, nodes, want) in cases {
            assert_eq!(in_force(*enabled, nodes.iter().copied()), *want, "enabled={enabled} nodes={nodes:?}");
        }
    }

    #[test]
    fn which_node_serves_which_service() {
        let none = labels(&[]);
        let pool_a = labels(&[(LABEL_LBPOOL, "a")]);
        let pool_empty = labels(&[(LABEL_LBPOOL, "")]);
        let other = labels(&[("app", "web")]);
        let enabled = labels(&[(LABEL_ENABLELB, "true")]);
        let enabled_a = labels(&[(LABEL_ENABLELB, "true"), (LABEL_LBPOOL, "a")]);
        let enabled_b = labels(&[(LABEL_ENABLELB, "true"), (LABEL_LBPOOL, "b")]);
        let disabled_a = labels(&[(LABEL_ENABLELB, "false"), (LABEL_LBPOOL, "a")]);
        let upper = labels(&[(LABEL_ENABLELB, "True")]);
        type Case<'a> = (&'a BTreeMap<String, String>, &'a BTreeMap<String, String>, Result<(), NotServed>);
        let cases: Vec<Case> = vec![
            (&enabled, &none, Ok(())),
            (&enabled, &other, Ok(())),
            (&enabled_a, &none, Ok(())),
            (&enabled_a, &pool_a, Ok(())),
            // An empty lbpool is no lbpool (ServiceLB tests `!= ""`).
            (&enabled, &pool_empty, Ok(())),
            (&none, &none, Err(NotServed::NotEnabled(None))),
            (&disabled_a, &pool_a, Err(NotServed::NotEnabled(Some("false".into())))),
            // The value is compared exactly, as a nodeSelector does.
            (&upper, &none, Err(NotServed::NotEnabled(Some("True".into())))),
            (&enabled, &pool_a, Err(NotServed::OtherPool { wanted: "a".into(), node: None })),
            (&enabled_b, &pool_a, Err(NotServed::OtherPool { wanted: "a".into(), node: Some("b".into()) })),
        ];
        for (node, svc, want) in cases {
            assert_eq!(serves(node, svc), want, "node {node:?} service {svc:?}");
        }
    }

    #[test]
    fn reasons_name_the_labels_and_values() {
        let e = NotServed::OtherPool { wanted: "a".into(), node: Some("b".into()) };
        assert_eq!(
            e.to_string(),
            "the Service has svccontroller.k3s.cattle.io/lbpool=\"a\", this node has svccontroller.k3s.cattle.io/lbpool=\"b\""
        );
        assert!(NotServed::NotEnabled(None).to_string().contains("enablelb=true"));
    }
}
