//! Watches: raw watch protocol and `kube_runtime::watcher` under faults.

mod common;

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::{client, eventually, lb_service, server};
use futures::{StreamExt, TryStreamExt};
use k8s_openapi::api::core::v1::Service;
use kube::api::{Api, DeleteParams, Patch, PatchParams, PostParams, WatchEvent, WatchParams};
use kube::runtime::utils::Backoff;
use kube::runtime::{WatchStreamExt, watcher};
use nodelb_testapi::TestApiServer;
use serde_json::json;

/// What a watcher-driven cache holds, plus counters of what the watcher did.
#[derive(Default, Debug)]
struct Seen {
    cache: BTreeMap<String, String>, // name -> "app" label
    inits: usize,
    applies: usize,
    deletes: usize,
    errors: Vec<String>,
}

/// A short constant retry delay. kube's default backoff (0.8 s doubling to 30 s, jittered, reset only by a
/// successful event) makes the recovery time of a run depend on how many errors a dropped connection
/// happened to produce; these tests are about the server's faults and the watcher's recovery, not about
/// that schedule.
struct QuickRetry;

impl Iterator for QuickRetry {
    type Item = Duration;
    fn next(&mut self) -> Option<Duration> {
        Some(Duration::from_millis(200))
    }
}

impl Backoff for QuickRetry {
    fn reset(&mut self) {}
}

fn spawn_watcher(api: Api<Service>) -> (Arc<Mutex<Seen>>, tokio::task::JoinHandle<()>) {
    let seen = Arc::new(Mutex::new(Seen::default()));
    let s = seen.clone();
    let task = tokio::spawn(async move {
        let mut building = BTreeMap::new();
        let mut stream = watcher(api, watcher::Config::default()).backoff(QuickRetry).boxed();
        while let Some(ev) = stream.next().await {
            let mut g = s.lock().unwrap();
            let label = |svc: &Service| {
                svc.metadata.labels.as_ref().and_then(|l| l.get("app")).cloned().unwrap_or_default()
            };
            match ev {
                Ok(watcher::Event::Init) => {
                    g.inits += 1;
                    building.clear();
                }
                Ok(watcher::Event::InitApply(svc)) => {
                    building.insert(svc.metadata.name.clone().unwrap(), label(&svc));
                }
                Ok(watcher::Event::InitDone) => g.cache = std::mem::take(&mut building),
                Ok(watcher::Event::Apply(svc)) => {
                    g.applies += 1;
                    g.cache.insert(svc.metadata.name.clone().unwrap(), label(&svc));
                }
                Ok(watcher::Event::Delete(svc)) => {
                    g.deletes += 1;
                    g.cache.remove(svc.metadata.name.as_deref().unwrap());
                }
                Err(e) => g.errors.push(e.to_string()),
            }
        }
    });
    (seen, task)
}

fn lists(srv: &TestApiServer) -> usize {
    srv.requests().iter().filter(|r| r.method == "GET" && r.path.ends_with("/services") && !r.watch).count()
}

async fn relabel(api: &Api<Service>, name: &str, app: &str) {
    let p = json!({"metadata": {"labels": {"app": app}}});
    api.patch(name, &PatchParams::default(), &Patch::Merge(&p)).await.unwrap();
}

#[tokio::test]
async fn watcher_sees_added_modified_deleted() {
    let srv = server();
    let c = client(&srv).await;
    let api: Api<Service> = Api::namespaced(c, "default");
    api.create(&PostParams::default(), &lb_service("before")).await.unwrap();
    let (seen, task) = spawn_watcher(api.clone());
    eventually(5, "initial list", || seen.lock().unwrap().cache.contains_key("before")).await;
    api.create(&PostParams::default(), &lb_service("web")).await.unwrap();
    eventually(5, "ADDED", || seen.lock().unwrap().cache.contains_key("web")).await;
    relabel(&api, "web", "v2").await;
    eventually(5, "MODIFIED", || seen.lock().unwrap().cache.get("web").is_some_and(|l| l == "v2")).await;
    api.delete("web", &DeleteParams::default()).await.unwrap();
    eventually(5, "DELETED", || !seen.lock().unwrap().cache.contains_key("web")).await;
    let g = seen.lock().unwrap();
    assert_eq!((g.inits, g.applies, g.deletes), (1, 2, 1), "{g:?}");
    assert!(g.errors.is_empty(), "{:?}", g.errors);
    drop(g);
    task.abort();
}

#[tokio::test]
async fn watcher_survives_dropped_connections_compaction_and_errors() {
    let srv = server();
    let c = client(&srv).await;
    let api: Api<Service> = Api::namespaced(c, "default");
    let (seen, task) = spawn_watcher(api.clone());
    eventually(5, "initial list", || seen.lock().unwrap().inits == 1 && lists(&srv) == 1).await;
    // give the watch time to be established
    eventually(5, "watch open", || srv.requests().iter().any(|r| r.watch)).await;

    // 1. connections dropped: the watcher resumes from its resourceVersion, no relist
    srv.drop_connections();
    api.create(&PostParams::default(), &lb_service("a")).await.unwrap();
    eventually(10, "a after drop", || seen.lock().unwrap().cache.contains_key("a")).await;
    assert_eq!(lists(&srv), 1, "a dropped watch resumes without relisting");

    // 2. compaction while disconnected: the resume gets 410 Gone and the watcher relists
    srv.set_unreachable(true);
    api.create(&PostParams::default(), &lb_service("b")).await.ok(); // fails: unreachable
    srv.set_unreachable(false);
    srv.create(serde_json::to_value(lb_service("b")).unwrap()).unwrap();
    srv.compact();
    srv.drop_connections();
    eventually(10, "b after compaction", || seen.lock().unwrap().cache.contains_key("b")).await;
    assert!(lists(&srv) >= 2, "410 Gone makes the watcher relist");
    assert!(seen.lock().unwrap().errors.iter().any(|e| e.contains("410") || e.contains("too old")));
    assert_eq!(seen.lock().unwrap().inits, 2);

    // 3. injected 500s on the next requests: the watcher backs off and recovers
    srv.fail_next(3, 500);
    srv.drop_connections();
    srv.create(serde_json::to_value(lb_service("c")).unwrap()).unwrap();
    eventually(20, "c after 500s", || seen.lock().unwrap().cache.contains_key("c")).await;
    assert_eq!(srv.requests().iter().filter(|r| r.status == 500).count(), 3);

    // 4. unreachable for a while, changes meanwhile, then back on the same address
    srv.set_unreachable(true);
    tokio::time::sleep(Duration::from_millis(300)).await;
    srv.create(serde_json::to_value(lb_service("d")).unwrap()).unwrap();
    srv.delete("v1", "Service", "default", "a").unwrap();
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert!(!seen.lock().unwrap().cache.contains_key("d"));
    srv.set_unreachable(false);
    eventually(30, "d and no a after unreachable", || {
        let g = seen.lock().unwrap();
        g.cache.contains_key("d") && !g.cache.contains_key("a")
    })
    .await;
    let g = seen.lock().unwrap();
    assert_eq!(g.cache.keys().cloned().collect::<Vec<_>>(), ["b", "c", "d"]);
    drop(g);
    task.abort();
}

#[tokio::test]
async fn raw_watch_protocol() {
    let srv = server();
    srv.set_bookmark_interval(Duration::from_millis(100));
    let c = client(&srv).await;
    let api: Api<Service> = Api::namespaced(c, "default");
    let s = api.create(&PostParams::default(), &lb_service("web")).await.unwrap();
    let rv = s.metadata.resource_version.clone().unwrap();

    // from a resourceVersion: only later changes, with bookmarks
    let wp = WatchParams::default().timeout(10);
    let mut w = api.watch(&wp, &rv).await.unwrap().boxed();
    relabel(&api, "web", "v2").await;
    match w.try_next().await.unwrap().unwrap() {
        WatchEvent::Modified(s) => assert_eq!(s.metadata.labels.unwrap()["app"], "v2"),
        other => panic!("expected MODIFIED, got {other:?}"),
    }
    let bm = loop {
        if let WatchEvent::Bookmark(b) = w.try_next().await.unwrap().unwrap() {
            break b;
        }
    };
    assert_eq!(bm.metadata.resource_version, srv.resource_version().to_string());

    // "0": synthetic ADDED of the current state first
    let mut w0 = api.watch(&WatchParams::default().disable_bookmarks(), "0").await.unwrap().boxed();
    assert!(matches!(w0.try_next().await.unwrap().unwrap(), WatchEvent::Added(_)));

    // label-selector transitions: leaving the selection is DELETED, entering is ADDED
    let sel = WatchParams::default().labels("app=v2").disable_bookmarks();
    let mut ws = api.watch(&sel, &srv.resource_version().to_string()).await.unwrap().boxed();
    relabel(&api, "web", "v3").await;
    assert!(matches!(ws.try_next().await.unwrap().unwrap(), WatchEvent::Deleted(_)));
    relabel(&api, "web", "v2").await;
    assert!(matches!(ws.try_next().await.unwrap().unwrap(), WatchEvent::Added(_)));

    // too old: HTTP 200 and an ERROR event with a 410 Status
    srv.compact();
    let mut old = api.watch(&WatchParams::default(), &rv).await.unwrap().boxed();
    match old.try_next().await.unwrap().unwrap() {
        WatchEvent::Error(e) => {
            assert_eq!(e.code, 410);
            assert_eq!(e.reason, "Expired");
        }
        other => panic!("expected ERROR 410, got {other:?}"),
    }
    assert!(old.try_next().await.unwrap().is_none(), "the stream ends after the error");

    // timeoutSeconds ends the stream
    let mut short = api
        .watch(&WatchParams::default().timeout(1), &srv.resource_version().to_string())
        .await
        .unwrap()
        .boxed();
    let started = std::time::Instant::now();
    while short.try_next().await.unwrap().is_some() {}
    assert!(started.elapsed() < Duration::from_secs(3));
}

#[tokio::test]
async fn retries_delay_and_request_log() {
    let srv = server();
    let c = client(&srv).await;
    let api: Api<Service> = Api::namespaced(c, "default");
    // 429s carry Retry-After; kube retries them on its own
    srv.fail_next(2, 429);
    let t = std::time::Instant::now();
    api.create(&PostParams::default(), &lb_service("web")).await.unwrap();
    assert!(t.elapsed() >= Duration::from_secs(1), "kube honoured Retry-After");
    let log = srv.requests();
    assert_eq!(log.iter().map(|r| r.status).collect::<Vec<_>>(), [429, 429, 201]);
    assert!(log.iter().all(|r| r.is_write()));
    // 500 is not retried by kube
    srv.fail_next_matching(1, 500, |m, _| m == "PATCH");
    api.get("web").await.unwrap();
    let err = api.patch("web", &PatchParams::default(), &Patch::Merge(json!({}))).await.unwrap_err();
    assert!(matches!(err, kube::Error::Api(s) if s.code == 500 && s.reason == "InternalError"));
    // delay
    srv.set_delay(Duration::from_millis(300));
    let t = std::time::Instant::now();
    api.get("web").await.unwrap();
    assert!(t.elapsed() >= Duration::from_millis(300));
    srv.set_delay(Duration::ZERO);
    // the log tells writers apart by field manager
    api.patch(
        "web",
        &PatchParams::apply("leader").force(),
        &Patch::Apply(json!({"apiVersion": "v1", "kind": "Service"})),
    )
    .await
    .unwrap();
    assert!(srv.requests().iter().any(|r| r.field_manager.as_deref() == Some("leader") && r.status == 200));
}

#[test]
fn sync_start_drop_and_listener() {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap();
    let srv = TestApiServer::start_on(l).unwrap();
    assert_eq!(srv.addr(), addr);
    assert!(srv.kubeconfig_yaml().contains(&format!("server: http://{addr}")));
    drop(srv);
    // the port is free again once dropped
    std::net::TcpListener::bind(addr).unwrap();
}

#[tokio::test]
async fn stalled_requests_wait_for_release_others_are_answered() {
    let srv = server();
    srv.create(serde_json::to_value(lb_service("web")).unwrap()).unwrap();
    let c = client(&srv).await;
    let services: Api<Service> = Api::all(c.clone());
    let slices: Api<k8s_openapi::api::discovery::v1::EndpointSlice> = Api::all(c);
    srv.stall_matching(|m, p| m == "GET" && p == "/api/v1/services");
    let held = tokio::spawn(async move { services.list(&Default::default()).await });
    // Other requests are answered meanwhile; the stalled list is not, and not logged yet.
    slices.list(&Default::default()).await.unwrap();
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(!held.is_finished(), "the stalled list was answered");
    assert!(srv.requests().iter().all(|r| r.path != "/api/v1/services"));
    srv.release_stalled();
    let list = tokio::time::timeout(Duration::from_secs(5), held).await.expect("answered once released");
    assert_eq!(list.unwrap().unwrap().items.len(), 1);
    assert!(srv.requests().iter().any(|r| r.path == "/api/v1/services" && r.status == 200));
}
