//! Leader election with `kube-lease-manager` (server-side apply on a Lease) against the test API server.

mod common;

use std::time::Duration;

use common::{client, server};
use k8s_openapi::api::coordination::v1::Lease;
use kube_lease_manager::LeaseManagerBuilder;

#[tokio::test]
async fn one_leader_then_takeover() {
    let srv = server();
    let mut rxs = Vec::new();
    let mut tasks = Vec::new();
    for id in ["node-a", "node-b", "node-c"] {
        let c = client(&srv).await;
        let m = LeaseManagerBuilder::new(c, "nodelb-allocator")
            .with_namespace("kube-system")
            .with_identity(id)
            .with_duration(2)
            .with_grace(1)
            .build()
            .await
            .unwrap();
        let (rx, task) = m.watch().await;
        rxs.push((id, rx));
        tasks.push(task);
    }
    let leaders = |rxs: &Vec<(&str, tokio::sync::watch::Receiver<bool>)>| {
        rxs.iter().filter(|(_, rx)| *rx.borrow()).map(|(id, _)| id.to_string()).collect::<Vec<_>>()
    };
    common::eventually(10, "a leader", || leaders(&rxs).len() == 1).await;
    // stays exactly one for a few renewals
    for _ in 0..20 {
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert!(leaders(&rxs).len() <= 1, "two leaders at once: {:?}", leaders(&rxs));
    }
    let first = leaders(&rxs)[0].clone();
    let lease = srv.get_typed::<Lease>("kube-system", "nodelb-allocator").unwrap();
    assert_eq!(lease.spec.unwrap().holder_identity.as_deref(), Some(first.as_str()));

    // the leader dies without releasing (its task is aborted): another one takes over after expiry
    let i = rxs.iter().position(|(id, _)| *id == first).unwrap();
    tasks.remove(i).abort();
    rxs.remove(i);
    common::eventually(15, "a new leader", || leaders(&rxs).len() == 1).await;
    let second = leaders(&rxs)[0].clone();
    assert_ne!(first, second);
    let lease = srv.get_typed::<Lease>("kube-system", "nodelb-allocator").unwrap();
    assert_eq!(lease.spec.unwrap().holder_identity.as_deref(), Some(second.as_str()));
    for t in tasks {
        t.abort();
    }
}
