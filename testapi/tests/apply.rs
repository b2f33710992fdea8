//! Server-side apply: field ownership, conflicts, force, and removal of fields an applier drops.

mod common;

use common::{client, server};
use k8s_openapi::api::coordination::v1::Lease;
use kube::api::{Api, Patch, PatchParams, PostParams};
use serde_json::json;

fn lease(holder: &str) -> serde_json::Value {
    json!({"apiVersion": "coordination.k8s.io/v1", "kind": "Lease", "metadata": {"name": "lock"},
           "spec": {"holderIdentity": holder, "leaseDurationSeconds": 15}})
}

#[tokio::test]
async fn apply_conflicts_force_and_ownership() {
    let srv = server();
    let c = client(&srv).await;
    let leases: Api<Lease> = Api::namespaced(c, "default");
    let l =
        leases.patch("lock", &PatchParams::apply("node-a"), &Patch::Apply(lease("node-a"))).await.unwrap();
    let mf = l.metadata.managed_fields.as_ref().unwrap();
    assert_eq!(mf.len(), 1);
    assert_eq!(mf[0].manager.as_deref(), Some("node-a"));
    assert_eq!(mf[0].operation.as_deref(), Some("Apply"));
    assert_eq!(mf[0].fields_type.as_deref(), Some("FieldsV1"));
    assert!(mf[0].fields_v1.as_ref().unwrap().0["f:spec"]["f:holderIdentity"].is_object());

    // re-applying the same configuration is a no-op
    let again =
        leases.patch("lock", &PatchParams::apply("node-a"), &Patch::Apply(lease("node-a"))).await.unwrap();
    assert_eq!(again.metadata.resource_version, l.metadata.resource_version);

    // another manager applying a different value conflicts...
    let err = leases
        .patch("lock", &PatchParams::apply("node-b"), &Patch::Apply(lease("node-b")))
        .await
        .unwrap_err();
    let kube::Error::Api(s) = err else { panic!() };
    assert_eq!((s.code, s.reason.as_str()), (409, "Conflict"));
    assert!(
        s.message.contains("conflict with \"node-a\"") && s.message.contains(".spec.holderIdentity"),
        "{}",
        s.message
    );
    // ...the same value is shared ownership, no conflict
    let shared =
        leases.patch("lock", &PatchParams::apply("node-b"), &Patch::Apply(lease("node-a"))).await.unwrap();
    assert_eq!(shared.metadata.managed_fields.as_ref().unwrap().len(), 2);
    // ...and force takes the field over
    let l = leases
        .patch("lock", &PatchParams::apply("node-b").force(), &Patch::Apply(lease("node-b")))
        .await
        .unwrap();
    assert_eq!(l.spec.as_ref().unwrap().holder_identity.as_deref(), Some("node-b"));
    // now node-a conflicts
    assert!(
        leases.patch("lock", &PatchParams::apply("node-a"), &Patch::Apply(lease("node-a"))).await.is_err()
    );

    // an Update (merge patch) takes ownership of what it changes: node-b loses holderIdentity
    let p = json!({"spec": {"holderIdentity": null}});
    let l = leases.patch("lock", &PatchParams::default(), &Patch::Merge(&p)).await.unwrap();
    assert!(l.spec.as_ref().unwrap().holder_identity.is_none());
    // so node-a can apply again without conflict
    leases.patch("lock", &PatchParams::apply("node-a"), &Patch::Apply(lease("node-a"))).await.unwrap();

    // fields an applier stops applying (and nobody else owns) are removed
    let l = leases
        .patch(
            "lock",
            &PatchParams::apply("node-a").force(),
            &Patch::Apply(
                json!({"apiVersion": "coordination.k8s.io/v1", "kind": "Lease", "metadata": {"name": "lock"},
                                 "spec": {"holderIdentity": "node-a"}}),
            ),
        )
        .await
        .unwrap();
    // leaseDurationSeconds is co-owned by node-b (shared apply) so it stays
    assert_eq!(l.spec.as_ref().unwrap().lease_duration_seconds, Some(15));
    let l = leases
        .patch(
            "lock",
            &PatchParams::apply("node-b").force(),
            &Patch::Apply(json!({"apiVersion": "coordination.k8s.io/v1", "kind": "Lease", "metadata": {"name": "lock"}})),
        )
        .await
        .unwrap();
    assert_eq!(l.spec.as_ref().unwrap().lease_duration_seconds, None, "no owner left: removed");
    assert_eq!(l.spec.as_ref().unwrap().holder_identity.as_deref(), Some("node-a"));

    // PUT with a field manager records an Update entry
    let mut cur = leases.get("lock").await.unwrap();
    cur.spec.as_mut().unwrap().lease_transitions = Some(3);
    let l = leases
        .replace("lock", &PostParams { field_manager: Some("human".into()), ..Default::default() }, &cur)
        .await
        .unwrap();
    let mf = l.metadata.managed_fields.unwrap();
    assert!(
        mf.iter().any(|e| e.manager.as_deref() == Some("human") && e.operation.as_deref() == Some("Update"))
    );
}
