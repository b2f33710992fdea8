//! # nodelb-testapi: an in-process Kubernetes API server **test double**
//!
//! This is not a Kubernetes API server. It is a small HTTP server that speaks the parts of the real
//! Kubernetes REST API that nodelb uses, the way `kube` 5's `Client`, `Api<K>` and
//! `kube_runtime::watcher` use them, so that nodelb's control plane can be tested without a cluster.
//! For what it implements it follows the API conventions (paths, verbs, status codes, `Status` error
//! bodies, resourceVersion semantics, watch protocol); everything else is absent or simplified, as listed
//! below. Start it with [`TestApiServer::start`], point `kube` at [`TestApiServer::kubeconfig_yaml`].
//!
//! ## Served
//! - core/v1 `services` (+`/status`), `nodes` (+`/status`, cluster-scoped), `events`, `namespaces`
//!   (+`/status`); `events.k8s.io/v1` `events`; `discovery.k8s.io/v1` `endpointslices`;
//!   `coordination.k8s.io/v1` `leases`. JSON only (`application/json`; `application/yaml` bodies too).
//! - `authentication.k8s.io/v1` `tokenreviews` and `authorization.k8s.io/v1`
//!   `subjectaccessreviews` (create, non-resource attributes only), answered from tokens and
//!   grants the test registers ([`TestApiServer::add_token`], [`TestApiServer::grant_non_resource`]).
//! - Discovery: `/version`, `/api`, `/api/v1`, `/apis`, `/apis/{group}[/{version}]`; `/healthz`,
//!   `/livez`, `/readyz`. (`Api<K>` with k8s-openapi types does not use discovery.)
//! - GET, LIST (namespaced and all-namespaces), WATCH, POST, PUT, PATCH, DELETE on the paths above.
//!
//! ## Faithful
//! - One global, monotonically increasing resourceVersion (like etcd's revision), as strings; lists carry
//!   it in `metadata.resourceVersion`; every write bumps it; a write that changes nothing is a no-op
//!   (same resourceVersion, no watch event), like the real server.
//! - Create sets `uid`, `creationTimestamp`, `generation: 1`, supports `generateName`, answers 201, 409
//!   `AlreadyExists`, 404 when the namespace does not exist (`default`, `kube-system`, `kube-public`,
//!   `kube-node-lease` exist from the start), 400 when `resourceVersion` is set, 422 `Invalid` on a bad
//!   name. `generation` is bumped when anything outside `metadata`/`status` changes.
//! - PUT and PATCH: a `metadata.resourceVersion` in the body or patch is a precondition (409 `Conflict`,
//!   "the object has been modified; please apply your changes to the latest version and try again");
//!   so is `metadata.uid`. Without one, the write is unconditional.
//! - Status subresource (services, nodes, namespaces): writes to `/status` change only `status`; writes to
//!   the main resource keep the old `status`. Services get an empty `status` on create.
//! - PATCH: `application/merge-patch+json` (RFC 7386), `application/json-patch+json` (RFC 6902; a
//!   failed `test` or a bad path → 422 `Invalid`), `application/strategic-merge-patch+json`,
//!   `application/apply-patch+yaml` (server-side apply; requires `fieldManager` → 400 otherwise; creates
//!   the object when it does not exist, 201; field ownership and conflicts as simplified below).
//!   Unknown patch type → 415.
//! - DELETE: Services answer with the deleted object, other types with a `Status` of `Success`
//!   (`details.name/kind/uid`), like their real registries; `DeleteOptions.preconditions` (uid,
//!   resourceVersion) → 409; objects with `metadata.finalizers` only get `deletionTimestamp` and go when
//!   the last finalizer is removed.
//! - LIST: `labelSelector` (`a=b`, `a==b`, `a!=b`, `a`, `!a`, `a in (x,y)`, `a notin (x,y)`, ANDed by
//!   commas), `fieldSelector` on `metadata.name` / `metadata.namespace` (other fields → 400 "field label
//!   not supported", as for most real types), `limit` + `continue` (the token pins the first page's
//!   resourceVersion, 410 `Expired` once compacted; `remainingItemCount`), `resourceVersion`
//!   (`""`, `"0"`, NotOlderThan; `Exact` only for the current version, otherwise 410). List items have no
//!   `kind`/`apiVersion`, like the real server's.
//! - WATCH: `watch=true`, newline-delimited `{"type":…,"object":…}` (chunked, `application/json`);
//!   `resourceVersion` unset or `"0"` → synthetic `ADDED` for the current state first; `N` → every change
//!   after `N` from a bounded history; older than the history → HTTP 200 and one `ERROR` event carrying
//!   a `Status` with code 410 (`Expired`, "too old resource version"), which is what the real server does
//!   and what `kube_runtime::watcher` relists on (an HTTP-level 410 would make it retry the same version
//!   forever); `allowWatchBookmarks=true` → periodic `BOOKMARK`s (interval settable, 1 s default; never
//!   ahead of an unsent event); `timeoutSeconds` ends the stream; `sendInitialEvents=true` → the current
//!   state then a bookmark annotated `k8s.io/initial-events-end`. Selector transitions are visible: an
//!   object that starts matching a watch's label selector arrives as `ADDED`, one that stops as `DELETED`.
//! - Errors are `Status` objects (`kind: Status`, `status: Failure`, `code`, `reason`, `message`,
//!   `details`) with the same HTTP code; injected 429s carry `Retry-After` and `details.retryAfterSeconds`
//!   (`kube` 5 retries 429/503/504 by itself).
//!
//! ## Simplified (a test double)
//! - No authentication, authorization, admission, defaulting or schema validation: what you send is what
//!   is stored (only names are validated). No protobuf, no CBOR, no table output, no `deletecollection`.
//! - Strategic merge patch is applied as a JSON merge patch: lists are replaced, not merged by their patch
//!   merge key, and `$patch`/`$retainKeys` directives are not understood.
//! - Server-side apply keeps `metadata.managedFields` (FieldsV1, `Apply`/`Update` entries, `subresource:
//!   status`) with simplified ownership: leaf fields only, lists atomic (no list-map keys), and of
//!   `metadata` only labels/annotations/finalizers/ownerReferences. Applying a value that differs from
//!   one another manager owns is 409 `Conflict` ("Apply failed with N conflict(s): conflict with \"m\"
//!   …") unless `force=true`, which takes the field over; equal values are shared; fields an applier
//!   stops applying and nobody else owns are removed; other writes (PUT/PATCH) take ownership of what
//!   they change, under `fieldManager` or the user agent's first `/`-segment. Applied configurations are
//!   merged in with JSON-merge semantics (no schema-aware list merging).
//! - core/v1 `events` and `events.k8s.io/v1` `events` are two separate stores (the real server stores one
//!   resource and converts between the two shapes).
//! - PUT to a missing object is 404 (no create-on-update). A list `resourceVersion` newer than the
//!   current one is 504 right away (the real server waits up to a few seconds first). Watches from a
//!   future resourceVersion simply wait for it.
//! - Deleting a namespace removes its objects and the namespace at once (no `Terminating` phase).
//! - A watch that falls more than 16384 changes behind its consumer ends with a 410 `ERROR`.
//!
//! ## Knobs
//! [`TestApiServer::drop_connections`], [`set_delay`](TestApiServer::set_delay),
//! [`fail_next`](TestApiServer::fail_next) / [`fail_next_matching`](TestApiServer::fail_next_matching),
//! [`stall_matching`](TestApiServer::stall_matching) / [`release_stalled`](TestApiServer::release_stalled),
//! [`set_unreachable`](TestApiServer::set_unreachable), [`compact`](TestApiServer::compact),
//! [`set_history_limit`](TestApiServer::set_history_limit),
//! [`set_bookmark_interval`](TestApiServer::set_bookmark_interval); direct object access for setup and
//! assertions ([`create`](TestApiServer::create), [`apply`](TestApiServer::apply),
//! [`get`](TestApiServer::get), [`list`](TestApiServer::list), [`delete`](TestApiServer::delete) and
//! typed variants); and a request log ([`requests`](TestApiServer::requests)).
//!
//! ## Use from a test
//! ```no_run
//! # async fn t() -> Result<(), Box<dyn std::error::Error>> {
//! use k8s_openapi::api::core::v1::Service;
//! use kube::config::{KubeConfigOptions, Kubeconfig};
//! use nodelb_testapi::TestApiServer;
//!
//! let srv = TestApiServer::start("127.0.0.1:0".parse()?)?;
//! // in-process: a kube::Client from the kubeconfig
//! let kc = Kubeconfig::from_yaml(&srv.kubeconfig_yaml())?;
//! let client = kube::Client::try_from(kube::Config::from_custom_kubeconfig(kc, &KubeConfigOptions::default()).await?)?;
//! // agents as processes: KUBECONFIG=<file>
//! srv.write_kubeconfig(std::path::Path::new("/tmp/kubeconfig"))?;
//! // setup and assertions without HTTP
//! srv.create(serde_json::json!({"apiVersion": "v1", "kind": "Service",
//!     "metadata": {"name": "web", "namespace": "default"}, "spec": {"type": "LoadBalancer"}}))?;
//! let svc: Option<Service> = srv.get_typed("default", "web");
//! // faults
//! srv.fail_next(3, 500);
//! srv.set_unreachable(true);
//! srv.set_unreachable(false);
//! srv.compact();
//! srv.drop_connections();
//! assert!(srv.requests().iter().filter(|r| r.is_write()).all(|r| r.field_manager.as_deref() == Some("leader")));
//! # let _ = (client, svc); Ok(()) }
//! ```
//!
//! ## Network namespaces
//! The server runs on its own thread with its own tokio runtime, so it works from sync tests and from
//! any async runtime. [`TestApiServer::start`] binds on the calling thread; to serve inside a network
//! namespace, bind a `std::net::TcpListener` on a thread that has joined it (`setns`) and pass it to
//! [`TestApiServer::start_on`]: the socket stays in the namespace it was created in.

mod discovery;
mod error;
mod fields;
mod patch;
pub mod resources;
mod reviews;
mod selector;
mod server;
mod store;

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use serde::Serialize;
use serde::de::DeserializeOwned;
use serde_json::Value;
use tokio::sync::oneshot;

pub use error::ApiError;

use resources::{RESOURCES, find_by_kind};
use server::{FailRule, Shared};
use store::{Part, Store, Write, meta_str};

pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// One request as the server saw it (for assertions such as "no writes from non-leaders").
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RequestRecord {
    pub method: String,
    pub path: String,
    /// Raw query string.
    pub query: String,
    /// HTTP status of the answer (for a watch: of the stream's start).
    pub status: u16,
    pub watch: bool,
    /// `fieldManager` query parameter, if any.
    pub field_manager: Option<String>,
    pub user_agent: Option<String>,
    /// Client address: tells agents apart when each runs in its own network namespace.
    pub peer: SocketAddr,
}

impl RequestRecord {
    /// POST, PUT, PATCH or DELETE.
    pub fn is_write(&self) -> bool {
        matches!(self.method.as_str(), "POST" | "PUT" | "PATCH" | "DELETE")
    }
}

/// A running test API server. Stops (closing every connection) when dropped.
pub struct TestApiServer {
    shared: Arc<Shared>,
    addr: SocketAddr,
    stop: Option<oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

/// Default watch history: changes kept for watches resuming from an older resourceVersion.
pub const DEFAULT_HISTORY: usize = 10_000;

fn resource_of(api_version: &str, kind: &str) -> Result<usize, ApiError> {
    find_by_kind(api_version, kind)
        .ok_or_else(|| ApiError::not_found_path_for(&format!("{api_version}, Kind={kind}")))
}

impl ApiError {
    fn not_found_path_for(what: &str) -> Self {
        ApiError::new(404, "NotFound", format!("the server does not serve {what}"))
    }
}

fn from_value<K: DeserializeOwned>(v: Value) -> K {
    serde_json::from_value(v).expect("stored object deserializes into its type")
}

impl TestApiServer {
    /// Bind `addr` (port 0 picks a free port) on the calling thread and serve.
    pub fn start(addr: SocketAddr) -> std::io::Result<Self> {
        Self::start_on(std::net::TcpListener::bind(addr)?)
    }

    /// Serve on an already bound listener (e.g. one created inside a network namespace).
    pub fn start_on(listener: std::net::TcpListener) -> std::io::Result<Self> {
        listener.set_nonblocking(true)?;
        let addr = listener.local_addr()?;
        let shared = Arc::new(Shared {
            store: Store::new(DEFAULT_HISTORY),
            delay: Mutex::new(Duration::ZERO),
            fail: Mutex::new(Vec::new()),
            stalls: Mutex::new(Vec::new()),
            stalls_changed: tokio::sync::watch::channel(0).0,
            unreachable: AtomicBool::new(false),
            bookmark_interval: Mutex::new(Duration::from_secs(1)),
            conns: Mutex::new(HashMap::new()),
            next_conn: AtomicU64::new(0),
            log: Mutex::new(Vec::new()),
            generation: tokio::sync::watch::channel(0).0,
            reviews: Mutex::new(reviews::Reviews::default()),
        });
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .thread_name("testapi")
            .enable_all()
            .build()?;
        let listener = {
            let _g = rt.enter();
            tokio::net::TcpListener::from_std(listener)?
        };
        let (stop, stopped) = oneshot::channel();
        let s = shared.clone();
        let thread = std::thread::Builder::new().name("testapi".into()).spawn(move || {
            rt.block_on(server::serve(listener, s, stopped));
            rt.shutdown_timeout(Duration::from_secs(1));
        })?;
        Ok(TestApiServer { shared, addr, stop: Some(stop), thread: Some(thread) })
    }

    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// `http://IP:PORT` (IPv6 in brackets).
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// A kubeconfig for this server (plain HTTP, no credentials; context namespace `default`), accepted
    /// by `kube::config::Kubeconfig::from_yaml` and by `KUBECONFIG`.
    pub fn kubeconfig_yaml(&self) -> String {
        format!(
            "apiVersion: v1\nkind: Config\nclusters:\n- name: testapi\n  cluster:\n    server: {}\n\
             contexts:\n- name: testapi\n  context:\n    cluster: testapi\n    user: testapi\n    namespace: default\n\
             current-context: testapi\nusers:\n- name: testapi\n  user: {{}}\n",
            self.url()
        )
    }

    /// Write [`kubeconfig_yaml`](Self::kubeconfig_yaml) to `path` (for agents run as processes).
    pub fn write_kubeconfig(&self, path: &std::path::Path) -> std::io::Result<()> {
        std::fs::write(path, self.kubeconfig_yaml())
    }

    // ---- knobs ----

    /// Close every open connection now (watches end mid-stream, keep-alive connections go away).
    pub fn drop_connections(&self) {
        self.shared.drop_connections();
    }

    /// Delay every request by `d` before it is handled (zero: no delay).
    pub fn set_delay(&self, d: Duration) {
        *lock(&self.shared.delay) = d;
    }

    /// Answer the next `n` requests with `code` (500, 429 with `Retry-After: 1`, 503, ...) and a `Status`.
    pub fn fail_next(&self, n: usize, code: u16) {
        if n > 0 {
            lock(&self.shared.fail).push(FailRule { remaining: n, code, matcher: None });
        }
    }

    /// Like [`fail_next`](Self::fail_next), for requests whose method and path match `pred` only.
    pub fn fail_next_matching(
        &self,
        n: usize,
        code: u16,
        pred: impl Fn(&axum::http::Method, &str) -> bool + Send + Sync + 'static,
    ) {
        if n > 0 {
            lock(&self.shared.fail).push(FailRule { remaining: n, code, matcher: Some(Box::new(pred)) });
        }
    }

    /// From now on, hold every request whose method and path match `pred` before it is handled,
    /// until [`release_stalled`](Self::release_stalled):
    /// an API server that is slow to answer one kind of request, e.g. the list of one resource
    /// (`GET` on `/apis/discovery.k8s.io/v1/endpointslices`), while everything else is answered.
    /// Held requests are not answered at all (no error, no timeout of the server's own); a
    /// client's timeout, [`drop_connections`](Self::drop_connections) or
    /// [`set_unreachable`](Self::set_unreachable) ends them like any open request. They appear in
    /// [`requests`](Self::requests) once answered.
    pub fn stall_matching(&self, pred: impl Fn(&axum::http::Method, &str) -> bool + Send + Sync + 'static) {
        lock(&self.shared.stalls).push(Box::new(pred));
    }

    /// Remove every [`stall_matching`](Self::stall_matching) rule; held requests are handled now.
    pub fn release_stalled(&self) {
        self.shared.release_stalled();
    }

    /// TokenReviews of `token` authenticate it as `user` in `groups`.
    pub fn add_token(&self, token: &str, user: &str, groups: &[&str]) {
        lock(&self.shared.reviews).add_token(token, user, groups);
    }

    /// SubjectAccessReviews allow `subject` (a user name or a group) `verb` on the non-resource
    /// URL `path` (what a ClusterRole rule with `nonResourceURLs` grants).
    pub fn grant_non_resource(&self, subject: &str, verb: &str, path: &str) {
        lock(&self.shared.reviews).grant(subject, verb, path);
    }

    /// While unreachable, every open connection is closed and new ones are reset as soon as they are
    /// accepted (clients see connection reset/closed); the listener stays bound, so the server comes back
    /// on the same address.
    pub fn set_unreachable(&self, unreachable: bool) {
        self.shared.unreachable.store(unreachable, Ordering::SeqCst);
        if unreachable {
            self.shared.drop_connections();
        }
    }

    /// Forget the watch history: watches (and list continue tokens) from any resourceVersion before
    /// now get 410.
    pub fn compact(&self) {
        self.shared.store.compact();
    }

    /// Keep at most `n` changes of history (older resourceVersions then get 410).
    pub fn set_history_limit(&self, n: usize) {
        self.shared.store.set_history_limit(n);
    }

    /// Interval between BOOKMARK events on watches that allow them (applies to new watches).
    pub fn set_bookmark_interval(&self, d: Duration) {
        *lock(&self.shared.bookmark_interval) = d.max(Duration::from_millis(10));
    }

    /// The current global resourceVersion.
    pub fn resource_version(&self) -> u64 {
        self.shared.store.lock().rv
    }

    /// Number of open client connections.
    pub fn open_connections(&self) -> usize {
        lock(&self.shared.conns).values().filter(|h| !h.is_finished()).count()
    }

    /// Every request so far, in order of completion.
    pub fn requests(&self) -> Vec<RequestRecord> {
        lock(&self.shared.log).clone()
    }

    pub fn clear_requests(&self) {
        lock(&self.shared.log).clear();
    }

    // ---- direct object access (test setup and assertions; same semantics as the HTTP API) ----

    /// Create `obj` (its `apiVersion`/`kind` pick the resource) as a POST would, except that the given
    /// `status` is kept (test setup may create a Service with a status).
    pub fn create(&self, obj: Value) -> Result<Value, ApiError> {
        let (res, ns) = resource_and_namespace(&obj)?;
        self.shared.store.create(res, &ns, obj, &Write::new(Part::All, "testapi"))
    }

    /// Create or replace `obj` unconditionally, `status` included (a `resourceVersion` in `obj`, if any,
    /// is still a precondition).
    pub fn apply(&self, obj: Value) -> Result<Value, ApiError> {
        let (res, ns) = resource_and_namespace(&obj)?;
        let name = meta_str(&obj, "name").to_string();
        match self.shared.store.update(res, &ns, &name, obj.clone(), &Write::new(Part::All, "testapi")) {
            Err(e) if e.code == 404 && e.reason == "NotFound" => {
                let mut obj = obj;
                if let Some(m) = obj.get_mut("metadata").and_then(Value::as_object_mut) {
                    m.remove("resourceVersion");
                }
                self.shared.store.create(res, &ns, obj, &Write::new(Part::All, "testapi"))
            }
            r => r,
        }
    }

    /// The object, if it exists. `namespace` is ignored for cluster-scoped kinds.
    pub fn get(&self, api_version: &str, kind: &str, namespace: &str, name: &str) -> Option<Value> {
        let res = resource_of(api_version, kind).ok()?;
        let ns = if RESOURCES[res].namespaced { namespace } else { "" };
        self.shared.store.get(res, ns, name).ok()
    }

    /// All objects of a kind (`namespace: None`: in every namespace), ordered by namespace and name.
    pub fn list(&self, api_version: &str, kind: &str, namespace: Option<&str>) -> Vec<Value> {
        match resource_of(api_version, kind) {
            Ok(res) => self.shared.store.all(res, namespace.filter(|_| RESOURCES[res].namespaced)),
            Err(_) => Vec::new(),
        }
    }

    /// Delete an object (finalizers are honoured as by DELETE).
    pub fn delete(&self, api_version: &str, kind: &str, namespace: &str, name: &str) -> Result<(), ApiError> {
        let res = resource_of(api_version, kind)?;
        let ns = if RESOURCES[res].namespaced { namespace } else { "" };
        self.shared.store.delete(res, ns, name, None, None, false).map(|_| ())
    }

    /// Typed [`create`](Self::create).
    pub fn create_typed<K>(&self, obj: &K) -> Result<K, ApiError>
    where
        K: k8s_openapi::Resource + Serialize + DeserializeOwned,
    {
        self.create(typed_value(obj)).map(from_value)
    }

    /// Typed [`apply`](Self::apply).
    pub fn apply_typed<K>(&self, obj: &K) -> Result<K, ApiError>
    where
        K: k8s_openapi::Resource + Serialize + DeserializeOwned,
    {
        self.apply(typed_value(obj)).map(from_value)
    }

    /// Typed [`get`](Self::get).
    pub fn get_typed<K>(&self, namespace: &str, name: &str) -> Option<K>
    where
        K: k8s_openapi::Resource + DeserializeOwned,
    {
        self.get(K::API_VERSION, K::KIND, namespace, name).map(from_value)
    }

    /// Typed [`list`](Self::list).
    pub fn list_typed<K>(&self, namespace: Option<&str>) -> Vec<K>
    where
        K: k8s_openapi::Resource + DeserializeOwned,
    {
        self.list(K::API_VERSION, K::KIND, namespace).into_iter().map(from_value).collect()
    }

    /// Typed [`delete`](Self::delete).
    pub fn delete_typed<K: k8s_openapi::Resource>(
        &self,
        namespace: &str,
        name: &str,
    ) -> Result<(), ApiError> {
        self.delete(K::API_VERSION, K::KIND, namespace, name)
    }
}

fn typed_value<K: k8s_openapi::Resource + Serialize>(obj: &K) -> Value {
    let mut v = serde_json::to_value(obj).expect("k8s-openapi objects serialize");
    v["apiVersion"] = Value::from(K::API_VERSION);
    v["kind"] = Value::from(K::KIND);
    v
}

impl Drop for TestApiServer {
    fn drop(&mut self) {
        self.shared.drop_connections();
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// The resource an object's `apiVersion`/`kind` name, and its namespace (`default` when unset;
/// empty for cluster-scoped resources).
fn resource_and_namespace(obj: &Value) -> Result<(usize, String), ApiError> {
    let res = resource_of(
        obj.get("apiVersion").and_then(Value::as_str).unwrap_or(""),
        obj.get("kind").and_then(Value::as_str).unwrap_or(""),
    )?;
    let ns = if RESOURCES[res].namespaced {
        let ns = meta_str(obj, "namespace");
        if ns.is_empty() { "default".to_string() } else { ns.to_string() }
    } else {
        String::new()
    };
    Ok((res, ns))
}
