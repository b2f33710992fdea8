//! CRUD, patches, conflicts and errors through a real `kube::Client`.

mod common;

use common::{client, lb_service, server};
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::{Event, Namespace, Node, Service};
use k8s_openapi::api::discovery::v1::EndpointSlice;
use k8s_openapi::api::events::v1::Event as EventV1;
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams, PostParams};
use serde_json::json;

fn api_err(e: kube::Error) -> (u16, String) {
    match e {
        kube::Error::Api(s) => (s.code, s.reason.clone()),
        other => panic!("expected an API error, got {other:?}"),
    }
}

#[tokio::test]
async fn services_create_get_list_and_errors() {
    let srv = server();
    let c = client(&srv).await;
    let svcs: Api<Service> = Api::namespaced(c.clone(), "default");
    let created = svcs.create(&PostParams::default(), &lb_service("web")).await.unwrap();
    let meta = &created.metadata;
    assert!(meta.uid.as_deref().is_some_and(|u| u.len() == 36));
    assert!(meta.creation_timestamp.is_some());
    assert_eq!(meta.generation, Some(1));
    let rv1: u64 = meta.resource_version.as_deref().unwrap().parse().unwrap();

    // 409 AlreadyExists
    let (code, reason) = api_err(svcs.create(&PostParams::default(), &lb_service("web")).await.unwrap_err());
    assert_eq!((code, reason.as_str()), (409, "AlreadyExists"));
    // 404 NotFound
    let (code, reason) = api_err(svcs.get("nope").await.unwrap_err());
    assert_eq!((code, reason.as_str()), (404, "NotFound"));
    assert!(svcs.get_opt("nope").await.unwrap().is_none());
    // namespace must exist
    let other: Api<Service> = Api::namespaced(c.clone(), "missing");
    let (code, _) = api_err(other.create(&PostParams::default(), &lb_service("web")).await.unwrap_err());
    assert_eq!(code, 400, "body namespace differs from the URL's");
    let mut elsewhere = lb_service("web");
    elsewhere.metadata.namespace = None;
    let (code, _) = api_err(other.create(&PostParams::default(), &elsewhere).await.unwrap_err());
    assert_eq!(code, 404, "namespace does not exist");

    // generateName
    let mut g = lb_service("");
    g.metadata.name = None;
    g.metadata.generate_name = Some("gen-".into());
    let g = svcs.create(&PostParams::default(), &g).await.unwrap();
    assert!(g.metadata.name.as_deref().unwrap().starts_with("gen-"));
    assert_eq!(g.metadata.name.as_deref().unwrap().len(), 9);

    // list: resourceVersion is the current global one
    let list = svcs.list(&ListParams::default()).await.unwrap();
    assert_eq!(list.items.len(), 2);
    let list_rv: u64 = list.metadata.resource_version.as_deref().unwrap().parse().unwrap();
    assert!(list_rv > rv1);
    assert_eq!(list_rv, srv.resource_version());
    let all: Api<Service> = Api::all(c.clone());
    assert_eq!(all.list(&ListParams::default()).await.unwrap().items.len(), 2);
    let by_label = svcs.list(&ListParams::default().labels("app=web")).await.unwrap();
    assert_eq!(by_label.items.len(), 1);
    let by_field = all.list(&ListParams::default().fields("metadata.name=web")).await.unwrap();
    assert_eq!(by_field.items.len(), 1);
    let (code, _) = api_err(all.list(&ListParams::default().fields("spec.type=x")).await.unwrap_err());
    assert_eq!(code, 400);

    // pagination
    for i in 0..5 {
        svcs.create(&PostParams::default(), &lb_service(&format!("p{i}"))).await.unwrap();
    }
    let p1 = svcs.list(&ListParams::default().limit(3)).await.unwrap();
    assert_eq!(p1.items.len(), 3);
    let tok = p1.metadata.continue_.clone().unwrap();
    let p2 = svcs.list(&ListParams::default().limit(3).continue_token(&tok)).await.unwrap();
    assert_eq!(p2.items.len(), 3);
    let p3 = svcs
        .list(&ListParams::default().limit(3).continue_token(p2.metadata.continue_.as_deref().unwrap()))
        .await
        .unwrap();
    assert_eq!(p3.items.len(), 1);
    assert!(p3.metadata.continue_.is_none());
    assert_eq!(p1.metadata.resource_version, p3.metadata.resource_version);

    // status is reset on create (Services), and the handle sees the same object
    let s = srv.get_typed::<Service>("default", "web").unwrap();
    assert_eq!(s.metadata.uid, created.metadata.uid);

    // delete: Services answer with the object; a DELETED object is gone
    let d = svcs.delete("web", &DeleteParams::default()).await.unwrap();
    assert!(d.is_left());
    assert!(svcs.get_opt("web").await.unwrap().is_none());
    let (code, _) = api_err(svcs.delete("web", &DeleteParams::default()).await.unwrap_err());
    assert_eq!(code, 404);
}

#[tokio::test]
async fn patches_and_status_subresource() {
    let srv = server();
    let c = client(&srv).await;
    let svcs: Api<Service> = Api::namespaced(c.clone(), "default");
    let s = svcs.create(&PostParams::default(), &lb_service("web")).await.unwrap();
    let rv0 = s.metadata.resource_version.clone().unwrap();

    // merge patch
    let p = json!({"metadata": {"annotations": {"nodelb.io/allocated-ports": "80/TCP=20001"}}});
    let s = svcs.patch("web", &PatchParams::default(), &Patch::Merge(&p)).await.unwrap();
    assert_eq!(s.metadata.annotations.as_ref().unwrap()["nodelb.io/allocated-ports"], "80/TCP=20001");
    assert_ne!(s.metadata.resource_version.as_deref().unwrap(), rv0);
    assert_eq!(s.metadata.generation, Some(1), "metadata changes do not bump generation");

    // a no-op patch keeps the resourceVersion
    let same = svcs.patch("web", &PatchParams::default(), &Patch::Merge(&p)).await.unwrap();
    assert_eq!(same.metadata.resource_version, s.metadata.resource_version);

    // JSON patch; spec change bumps generation
    let jp: json_patch::Patch = serde_json::from_value(json!([
        {"op": "test", "path": "/spec/type", "value": "LoadBalancer"},
        {"op": "add", "path": "/spec/loadBalancerClass", "value": "nodelb.io/nodelb"},
    ]))
    .unwrap();
    let s = svcs.patch("web", &PatchParams::default(), &Patch::Json::<()>(jp)).await.unwrap();
    assert_eq!(s.spec.as_ref().unwrap().load_balancer_class.as_deref(), Some("nodelb.io/nodelb"));
    assert_eq!(s.metadata.generation, Some(2));
    // failing test op → 422
    let jp: json_patch::Patch =
        serde_json::from_value(json!([{"op": "test", "path": "/spec/type", "value": "ClusterIP"}])).unwrap();
    let (code, reason) =
        api_err(svcs.patch("web", &PatchParams::default(), &Patch::Json::<()>(jp)).await.unwrap_err());
    assert_eq!((code, reason.as_str()), (422, "Invalid"));

    // strategic merge patch (applied as a merge patch)
    let sp = json!({"metadata": {"labels": {"tier": "front"}}});
    let s = svcs.patch("web", &PatchParams::default(), &Patch::Strategic(&sp)).await.unwrap();
    assert_eq!(s.metadata.labels.as_ref().unwrap()["tier"], "front");

    // server-side apply with a field manager
    let ap = json!({"apiVersion": "v1", "kind": "Service", "metadata": {"name": "web", "annotations": {"x": "y"}}});
    let s = svcs.patch("web", &PatchParams::apply("nodelb").force(), &Patch::Apply(&ap)).await.unwrap();
    assert_eq!(s.metadata.annotations.as_ref().unwrap()["x"], "y");
    assert_eq!(s.metadata.labels.as_ref().unwrap()["tier"], "front");
    // apply creates a missing object
    let ap2 = json!({"apiVersion": "v1", "kind": "Service", "metadata": {"name": "applied"},
                     "spec": {"type": "LoadBalancer", "ports": [{"port": 53, "protocol": "UDP"}]}});
    let created = svcs.patch("applied", &PatchParams::apply("nodelb"), &Patch::Apply(&ap2)).await.unwrap();
    assert!(created.metadata.uid.is_some());
    // apply without a field manager → 400
    let (code, _) =
        api_err(svcs.patch("web", &PatchParams::default(), &Patch::Apply(&ap)).await.unwrap_err());
    assert_eq!(code, 400);

    // status on the main resource is ignored
    let p = json!({"status": {"loadBalancer": {"ingress": [{"ip": "10.0.0.1"}]}}});
    let s = svcs.patch("web", &PatchParams::default(), &Patch::Merge(&p)).await.unwrap();
    assert!(
        s.status
            .as_ref()
            .and_then(|st| st.load_balancer.as_ref())
            .and_then(|lb| lb.ingress.as_ref())
            .is_none()
    );

    // patch_status changes only status
    let p = json!({
        "metadata": {"labels": {"ignored": "yes"}},
        "spec": {"type": "ClusterIP"},
        "status": {"loadBalancer": {"ingress": [{"ip": "10.0.0.1", "ipMode": "Proxy", "ports": [{"port": 20001, "protocol": "TCP"}]}]}},
    });
    let s = svcs.patch_status("web", &PatchParams::default(), &Patch::Merge(&p)).await.unwrap();
    let ing = &s.status.as_ref().unwrap().load_balancer.as_ref().unwrap().ingress.as_ref().unwrap()[0];
    assert_eq!(ing.ip.as_deref(), Some("10.0.0.1"));
    assert_eq!(ing.ip_mode.as_deref(), Some("Proxy"));
    assert_eq!(s.spec.as_ref().unwrap().type_.as_deref(), Some("LoadBalancer"));
    assert!(s.metadata.labels.as_ref().unwrap().get("ignored").is_none());
    // apply on status
    let ap = json!({"apiVersion": "v1", "kind": "Service", "metadata": {"name": "web"},
                    "status": {"loadBalancer": {"ingress": [{"ip": "10.0.0.2"}]}}});
    let s =
        svcs.patch_status("web", &PatchParams::apply("nodelb").force(), &Patch::Apply(&ap)).await.unwrap();
    assert_eq!(s.status.unwrap().load_balancer.unwrap().ingress.unwrap()[0].ip.as_deref(), Some("10.0.0.2"));
    // replace_status with a stale version
    let mut stale = srv.get_typed::<Service>("default", "web").unwrap();
    svcs.patch("web", &PatchParams::default(), &Patch::Merge(json!({"metadata": {"labels": {"bump": "1"}}})))
        .await
        .unwrap();
    stale.status = None;
    let (code, reason) =
        api_err(svcs.replace_status("web", &PostParams::default(), &stale).await.unwrap_err());
    assert_eq!((code, reason.as_str()), (409, "Conflict"));
}

#[tokio::test]
async fn stale_resource_version_conflicts() {
    let srv = server();
    let c = client(&srv).await;
    let svcs: Api<Service> = Api::namespaced(c.clone(), "default");
    let s = svcs.create(&PostParams::default(), &lb_service("web")).await.unwrap();
    let mut a = s.clone();
    let mut b = s.clone();
    a.metadata.labels.get_or_insert_default().insert("writer".into(), "a".into());
    let a = svcs.replace("web", &PostParams::default(), &a).await.unwrap();
    b.metadata.labels.get_or_insert_default().insert("writer".into(), "b".into());
    let err = svcs.replace("web", &PostParams::default(), &b).await.unwrap_err();
    let kube::Error::Api(status) = err else { panic!("not an API error") };
    assert_eq!(status.code, 409);
    assert_eq!(status.reason, "Conflict");
    assert!(status.message.contains("the object has been modified"), "{}", status.message);

    // a patch carrying a stale resourceVersion is a precondition failure too
    let p = json!({"metadata": {"resourceVersion": s.metadata.resource_version, "annotations": {"k": "v"}}});
    let (code, _) = api_err(svcs.patch("web", &PatchParams::default(), &Patch::Merge(&p)).await.unwrap_err());
    assert_eq!(code, 409);
    let p = json!({"metadata": {"resourceVersion": a.metadata.resource_version, "annotations": {"k": "v"}}});
    svcs.patch("web", &PatchParams::default(), &Patch::Merge(&p)).await.unwrap();
    // delete precondition
    let dp = DeleteParams {
        preconditions: Some(kube::api::Preconditions {
            resource_version: a.metadata.resource_version.clone(),
            uid: None,
        }),
        ..Default::default()
    };
    let (code, _) = api_err(svcs.delete("web", &dp).await.unwrap_err());
    assert_eq!(code, 409);
}

#[tokio::test]
async fn leases_with_conflicts() {
    let srv = server();
    let c = client(&srv).await;
    let ns: Api<Namespace> = Api::all(c.clone());
    ns.create(
        &PostParams::default(),
        &serde_json::from_value(json!({"metadata": {"name": "nodelb-system"}})).unwrap(),
    )
    .await
    .unwrap();
    let leases: Api<Lease> = Api::namespaced(c.clone(), "nodelb-system");
    let lease: Lease = serde_json::from_value(json!({
        "metadata": {"name": "nodelb-allocator"},
        "spec": {"holderIdentity": "node-a", "leaseDurationSeconds": 15, "acquireTime": "2025-01-01T00:00:00.000000Z",
                 "renewTime": "2025-01-01T00:00:00.000000Z", "leaseTransitions": 0},
    }))
    .unwrap();
    let l = leases.create(&PostParams::default(), &lease).await.unwrap();
    let (code, reason) = api_err(leases.create(&PostParams::default(), &lease).await.unwrap_err());
    assert_eq!((code, reason.as_str()), (409, "AlreadyExists"));

    // two candidates race on the same version: exactly one wins
    let mut a = l.clone();
    a.spec.as_mut().unwrap().holder_identity = Some("node-b".into());
    let mut b = l.clone();
    b.spec.as_mut().unwrap().holder_identity = Some("node-c".into());
    let pp = PostParams::default();
    let (ra, rb) = tokio::join!(
        leases.replace("nodelb-allocator", &pp, &a),
        leases.replace("nodelb-allocator", &pp, &b)
    );
    assert!(ra.is_ok() != rb.is_ok(), "exactly one replace wins: {ra:?} / {rb:?}");
    let loser = ra.err().or(rb.err()).unwrap();
    assert_eq!(api_err(loser).0, 409);
    let now = leases.get("nodelb-allocator").await.unwrap();
    assert!(matches!(now.spec.unwrap().holder_identity.as_deref(), Some("node-b" | "node-c")));
    // Lease Status delete answers a Status (not the object)
    let d = leases.delete("nodelb-allocator", &DeleteParams::default()).await.unwrap();
    assert!(d.is_right());
}

#[tokio::test]
async fn events_nodes_and_endpointslices() {
    let srv = server();
    let c = client(&srv).await;
    // core/v1 Event
    let events: Api<Event> = Api::namespaced(c.clone(), "default");
    let ev: Event = serde_json::from_value(json!({
        "metadata": {"generateName": "web."},
        "involvedObject": {"kind": "Service", "namespace": "default", "name": "web", "apiVersion": "v1"},
        "reason": "AllocationFailed", "message": "port range exhausted", "type": "Warning",
    }))
    .unwrap();
    let ev = events.create(&PostParams::default(), &ev).await.unwrap();
    assert!(ev.metadata.name.unwrap().starts_with("web."));
    // events.k8s.io/v1 Event through kube_runtime's Recorder
    let recorder = kube::runtime::events::Recorder::new(c.clone(), "nodelb".into());
    let svc = srv.create_typed(&lb_service("web")).unwrap();
    recorder
        .publish(
            &kube::runtime::events::Event {
                type_: kube::runtime::events::EventType::Warning,
                reason: "PortConflict".into(),
                note: Some("port 20001 taken".into()),
                action: "Allocate".into(),
                secondary: None,
            },
            &kube::Resource::object_ref(&svc, &()),
        )
        .await
        .unwrap();
    let evs = srv.list_typed::<EventV1>(Some("default"));
    assert_eq!(evs.len(), 1);
    assert_eq!(evs[0].reason.as_deref(), Some("PortConflict"));
    // a second publish of the same event patches it (series)
    recorder
        .publish(
            &kube::runtime::events::Event {
                type_: kube::runtime::events::EventType::Warning,
                reason: "PortConflict".into(),
                note: Some("port 20001 taken".into()),
                action: "Allocate".into(),
                secondary: None,
            },
            &kube::Resource::object_ref(&svc, &()),
        )
        .await
        .unwrap();
    assert_eq!(srv.list_typed::<EventV1>(Some("default")).len(), 1);

    // Nodes are cluster-scoped and keep status on create; status writes via the main resource are ignored
    let nodes: Api<Node> = Api::all(c.clone());
    let node: Node = serde_json::from_value(json!({
        "metadata": {"name": "node-a", "labels": {"kubernetes.io/hostname": "node-a"}},
        "status": {"addresses": [{"type": "InternalIP", "address": "10.0.0.1"}]},
    }))
    .unwrap();
    let n = nodes.create(&PostParams::default(), &node).await.unwrap();
    assert_eq!(n.status.unwrap().addresses.unwrap()[0].address, "10.0.0.1");
    let p = json!({"status": {"addresses": [{"type": "InternalIP", "address": "10.9.9.9"}]}});
    let n = nodes.patch("node-a", &PatchParams::default(), &Patch::Merge(&p)).await.unwrap();
    assert_eq!(n.status.unwrap().addresses.unwrap()[0].address, "10.0.0.1");
    let n = nodes.patch_status("node-a", &PatchParams::default(), &Patch::Merge(&p)).await.unwrap();
    assert_eq!(n.status.unwrap().addresses.unwrap()[0].address, "10.9.9.9");

    // EndpointSlices by the service-name label
    let slices: Api<EndpointSlice> = Api::namespaced(c.clone(), "default");
    for (name, svc) in [("web-abc", "web"), ("web-def", "web"), ("db-xyz", "db")] {
        let s: EndpointSlice = serde_json::from_value(json!({
            "metadata": {"name": name, "labels": {"kubernetes.io/service-name": svc, "endpointslice.kubernetes.io/managed-by": "test"}},
            "addressType": "IPv4",
            "endpoints": [{"addresses": ["10.1.0.1"], "conditions": {"ready": true}}],
            "ports": [{"name": "http", "port": 8080, "protocol": "TCP"}],
        }))
        .unwrap();
        slices.create(&PostParams::default(), &s).await.unwrap();
    }
    let web = slices.list(&ListParams::default().labels("kubernetes.io/service-name=web")).await.unwrap();
    assert_eq!(web.items.len(), 2);
    let not_web =
        slices.list(&ListParams::default().labels("kubernetes.io/service-name!=web")).await.unwrap();
    assert_eq!(not_web.items.len(), 1);
    let all: Api<EndpointSlice> = Api::all(c.clone());
    assert_eq!(
        all.list(&ListParams::default().labels("kubernetes.io/service-name")).await.unwrap().items.len(),
        3
    );
}

#[tokio::test]
async fn discovery_and_version() {
    let srv = server();
    let c = client(&srv).await;
    let v = c.apiserver_version().await.unwrap();
    assert_eq!(v.major, "1");
    let d = kube::Discovery::new(c.clone()).run().await.unwrap();
    assert!(d.has_group("coordination.k8s.io"));
    assert!(d.has_group("discovery.k8s.io"));
}
