//! Many objects, several watchers: paged initial lists (watcher's default page size is 500) and fan-out.

mod common;

use std::collections::BTreeSet;
use std::sync::{Arc, Mutex};

use common::{client, eventually, lb_service, server};
use futures::StreamExt;
use k8s_openapi::api::core::v1::Service;
use kube::api::{Api, PostParams};
use kube::runtime::{WatchStreamExt, watcher};

#[tokio::test]
async fn paged_lists_and_many_watchers() {
    let srv = server();
    for i in 0..1200 {
        srv.create_typed(&lb_service(&format!("pre-{i:04}"))).unwrap();
    }
    let mut caches = Vec::new();
    for _ in 0..3 {
        let c = client(&srv).await;
        let api: Api<Service> = Api::all(c);
        let names = Arc::new(Mutex::new(BTreeSet::new()));
        let n = names.clone();
        tokio::spawn(async move {
            let mut s = watcher(api, watcher::Config::default()).default_backoff().applied_objects().boxed();
            while let Some(Ok(svc)) = s.next().await {
                n.lock().unwrap().insert(svc.metadata.name.unwrap());
            }
        });
        caches.push(names);
    }
    eventually(20, "initial lists", || caches.iter().all(|c| c.lock().unwrap().len() == 1200)).await;
    let paged = srv.requests().iter().filter(|r| r.query.contains("continue=")).count();
    assert_eq!(paged, 3 * 2, "1200 objects in pages of 500: two continued pages per watcher");

    // 500 created at once through the API
    let c = client(&srv).await;
    let api: Api<Service> = Api::namespaced(c, "default");
    let creates = (0..500).map(|i| {
        let api = api.clone();
        async move { api.create(&PostParams::default(), &lb_service(&format!("burst-{i:03}"))).await }
    });
    let results = futures::future::join_all(creates).await;
    assert!(results.iter().all(Result::is_ok));
    eventually(20, "burst seen by every watcher", || caches.iter().all(|c| c.lock().unwrap().len() == 1700))
        .await;
    let rvs: BTreeSet<String> =
        results.into_iter().map(|r| r.unwrap().metadata.resource_version.unwrap()).collect();
    assert_eq!(rvs.len(), 500, "every write has its own resourceVersion");
}
