//! HTTP: connections (killable), knobs, routing and the REST verbs.

use std::collections::HashMap;
use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::http::{HeaderValue, Method, Request, Response, StatusCode, header};
use hyper::body::Incoming;
use hyper_util::rt::TokioIo;
use serde_json::{Value, json};
use tokio::sync::{broadcast, mpsc, oneshot};
use tokio::task::AbortHandle;

use crate::error::ApiError;
use crate::fields::Op;
use crate::patch::{self, PatchKind};
use crate::resources::{RESOURCES, find};
use crate::selector::{FieldSelector, LabelSelector};
use crate::store::{Filter, Part, Store, WatchStart, Write, watch_event};
use crate::{RequestRecord, lock};

type FailMatcher = Box<dyn Fn(&Method, &str) -> bool + Send + Sync>;

pub(crate) struct FailRule {
    pub remaining: usize,
    pub code: u16,
    pub matcher: Option<FailMatcher>,
}

pub(crate) struct Shared {
    pub store: Store,
    pub delay: Mutex<Duration>,
    pub fail: Mutex<Vec<FailRule>>,
    /// Requests matching one of these are held before they are handled, until released.
    pub stalls: Mutex<Vec<FailMatcher>>,
    /// Bumped whenever `stalls` shrinks: held requests check again.
    pub stalls_changed: tokio::sync::watch::Sender<u64>,
    pub unreachable: AtomicBool,
    pub bookmark_interval: Mutex<Duration>,
    pub conns: Mutex<HashMap<u64, AbortHandle>>,
    pub next_conn: AtomicU64,
    pub log: Mutex<Vec<RequestRecord>>,
    /// Bumped by `drop_connections`: watch producers whose generation is older stop.
    pub generation: tokio::sync::watch::Sender<u64>,
    pub reviews: Mutex<crate::reviews::Reviews>,
}

impl Shared {
    pub fn drop_connections(&self) {
        self.generation.send_modify(|g| *g += 1);
        for (_, h) in lock(&self.conns).drain() {
            h.abort();
        }
    }

    pub fn release_stalled(&self) {
        lock(&self.stalls).clear();
        self.stalls_changed.send_modify(|g| *g += 1);
    }

    /// Waits while a stall rule matches (a request the server is slow to answer). Cancelled with
    /// the connection (`drop_connections`, `set_unreachable`).
    async fn wait_while_stalled(&self, method: &Method, path: &str) {
        loop {
            // Subscribed before checking: a release in between is not missed.
            let mut changed = self.stalls_changed.subscribe();
            if !lock(&self.stalls).iter().any(|m| m(method, path)) {
                return;
            }
            if changed.changed().await.is_err() {
                return;
            }
        }
    }

    fn take_failure(&self, method: &Method, path: &str) -> Option<ApiError> {
        let mut rules = lock(&self.fail);
        let i = rules.iter().position(|r| r.matcher.as_ref().is_none_or(|m| m(method, path)))?;
        let code = rules[i].code;
        rules[i].remaining -= 1;
        if rules[i].remaining == 0 {
            rules.remove(i);
        }
        Some(ApiError::injected(code))
    }
}

/// Accept loop: one task per connection, each abortable by `drop_connections`.
pub(crate) async fn serve(
    listener: tokio::net::TcpListener,
    shared: Arc<Shared>,
    mut stop: oneshot::Receiver<()>,
) {
    loop {
        let (stream, peer) = tokio::select! {
            _ = &mut stop => break,
            r = listener.accept() => match r {
                Ok(x) => x,
                Err(_) => { tokio::time::sleep(Duration::from_millis(10)).await; continue; }
            },
        };
        if shared.unreachable.load(Ordering::SeqCst) {
            // Reset right away: the client sees its connection refused/reset, as when the API is down.
            let _ = stream.set_zero_linger();
            drop(stream);
            continue;
        }
        let _ = stream.set_nodelay(true);
        let id = shared.next_conn.fetch_add(1, Ordering::Relaxed);
        let s = shared.clone();
        let svc = hyper::service::service_fn(move |req| {
            let s = s.clone();
            async move { Ok::<_, Infallible>(handle(s, peer, req).await) }
        });
        let s = shared.clone();
        let task = tokio::spawn(async move {
            let _ =
                hyper::server::conn::http1::Builder::new().serve_connection(TokioIo::new(stream), svc).await;
            lock(&s.conns).remove(&id);
        });
        let mut conns = lock(&shared.conns);
        if !task.is_finished() {
            conns.insert(id, task.abort_handle());
        }
    }
}

fn percent_decode(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        match b[i] {
            b'+' => out.push(b' '),
            b'%' if i + 2 < b.len() => {
                match u8::from_str_radix(std::str::from_utf8(&b[i + 1..i + 3]).unwrap_or("zz"), 16) {
                    Ok(v) => {
                        out.push(v);
                        i += 2;
                    }
                    Err(_) => out.push(b'%'),
                }
            }
            c => out.push(c),
        }
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

fn parse_query(q: Option<&str>) -> HashMap<String, String> {
    q.unwrap_or("")
        .split('&')
        .filter(|p| !p.is_empty())
        .map(|p| {
            let (k, v) = p.split_once('=').unwrap_or((p, ""));
            (percent_decode(k), percent_decode(v))
        })
        .collect()
}

fn json_response(code: u16, v: &Value) -> Response<Body> {
    let mut r = Response::new(Body::from(serde_json::to_vec(v).expect("json")));
    *r.status_mut() = StatusCode::from_u16(code).unwrap_or(StatusCode::OK);
    r.headers_mut().insert(header::CONTENT_TYPE, HeaderValue::from_static("application/json"));
    r
}

fn error_response(e: ApiError) -> Response<Body> {
    let mut r = json_response(e.code, &e.to_status());
    if let Some(s) = e.retry_after_seconds {
        r.headers_mut().insert(header::RETRY_AFTER, HeaderValue::from(s));
    }
    r
}

async fn handle(shared: Arc<Shared>, peer: SocketAddr, req: Request<Incoming>) -> Response<Body> {
    let method = req.method().clone();
    let path = req.uri().path().to_string();
    let query = req.uri().query().unwrap_or("").to_string();
    let user_agent = req.headers().get(header::USER_AGENT).and_then(|v| v.to_str().ok()).map(str::to_string);
    let delay = *lock(&shared.delay);
    if !delay.is_zero() {
        tokio::time::sleep(delay).await;
    }
    shared.wait_while_stalled(&method, &path).await;
    let resp = match shared.take_failure(&method, &path) {
        Some(e) => error_response(e),
        None => route(&shared, req).await.unwrap_or_else(error_response),
    };
    let q = parse_query(Some(&query));
    lock(&shared.log).push(RequestRecord {
        method: method.to_string(),
        path,
        watch: matches!(q.get("watch").map(String::as_str), Some("true" | "1")),
        field_manager: q.get("fieldManager").cloned(),
        query,
        status: resp.status().as_u16(),
        user_agent,
        peer,
    });
    resp
}

/// A parsed resource path.
struct Target {
    res: usize,
    ns: Option<String>,
    name: Option<String>,
    sub: Option<String>,
}

fn parse_path(path: &str) -> Result<Option<Target>, ApiError> {
    let segs: Vec<&str> = path.trim_matches('/').split('/').collect();
    let (group, version, rest) = match segs.as_slice() {
        ["api", v, rest @ ..] if !rest.is_empty() => ("", *v, rest),
        ["apis", g, v, rest @ ..] if !rest.is_empty() => (*g, *v, rest),
        _ => return Ok(None),
    };
    let (ns, rest) = match rest {
        ["namespaces", ns, plural, rest @ ..]
            if !(rest.is_empty() && matches!(*plural, "status" | "finalize")) =>
        {
            (Some(ns.to_string()), [&[*plural][..], rest].concat())
        }
        _ => (None, rest.to_vec()),
    };
    let Some(res) = find(group, version, rest[0]) else { return Err(ApiError::not_found_path()) };
    let rt = &RESOURCES[res];
    if rt.namespaced != ns.is_some() && !(rt.namespaced && rest.len() == 1) {
        return Err(ApiError::not_found_path());
    }
    if rest.len() > 3 {
        return Err(ApiError::not_found_path());
    }
    let name = rest.get(1).map(|s| s.to_string());
    let sub = rest.get(2).map(|s| s.to_string());
    if let Some(s) = &sub
        && !(s == "status" && rt.status_subresource)
    {
        return Err(ApiError::not_found_path());
    }
    Ok(Some(Target { res, ns, name, sub }))
}

async fn read_body(req: Request<Incoming>) -> Result<(Option<String>, Bytes), ApiError> {
    let ct = req.headers().get(header::CONTENT_TYPE).and_then(|v| v.to_str().ok()).map(str::to_string);
    let body = axum::body::to_bytes(Body::new(req.into_body()), 64 << 20)
        .await
        .map_err(|e| ApiError::bad_request(format!("reading request body: {e}")))?;
    Ok((ct, body))
}

fn json_body(ct: Option<&str>, body: &[u8]) -> Result<Value, ApiError> {
    let ct = ct.unwrap_or("application/json");
    let mime = ct.split(';').next().unwrap_or("").trim();
    match mime {
        "application/json" | "" => serde_json::from_slice(body)
            .map_err(|e| ApiError::bad_request(format!("the body of the request could not be decoded: {e}"))),
        "application/yaml" => serde_yaml::from_slice(body)
            .map_err(|e| ApiError::bad_request(format!("the body of the request could not be decoded: {e}"))),
        other => Err(ApiError::new(
            415,
            "UnsupportedMediaType",
            format!(
                "the body of the request was in an unknown format - accepted media types include: application/json, application/yaml (got {other})"
            ),
        )),
    }
}

fn strip_type(mut v: Value) -> Value {
    if let Some(m) = v.as_object_mut() {
        m.remove("kind");
        m.remove("apiVersion");
    }
    v
}

async fn route(shared: &Arc<Shared>, req: Request<Incoming>) -> Result<Response<Body>, ApiError> {
    let path = req.uri().path().to_string();
    let q = parse_query(req.uri().query());
    if let Some(v) = crate::discovery::discovery(&path) {
        return if req.method() == Method::GET {
            Ok(json_response(200, &v))
        } else {
            Err(ApiError::method_not_allowed())
        };
    }
    if matches!(path.as_str(), "/healthz" | "/livez" | "/readyz") {
        let mut r = Response::new(Body::from("ok"));
        r.headers_mut().insert(header::CONTENT_TYPE, HeaderValue::from_static("text/plain; charset=utf-8"));
        return Ok(r);
    }
    if path.contains("reviews") && req.method() == Method::POST {
        let (ct, body) = read_body(req).await?;
        let value = json_body(ct.as_deref(), &body)?;
        if let Some(answer) = lock(&shared.reviews).answer(&path, &value) {
            return answer.map(|v| json_response(201, &v));
        }
        return Err(ApiError::not_found_path());
    }
    let Some(t) = parse_path(&path)? else { return Err(ApiError::not_found_path()) };
    let rt = &RESOURCES[t.res];
    let store = &shared.store;
    let ns = t.ns.clone().unwrap_or_default();
    let dry_run = q.get("dryRun").is_some_and(|d| d == "All");
    let part = if t.sub.is_some() { Part::Status } else { Part::Main };
    // Default field manager: the user agent up to its first '/', as the real server does.
    let ua = req.headers().get(header::USER_AGENT).and_then(|v| v.to_str().ok()).unwrap_or("unknown");
    let manager = q
        .get("fieldManager")
        .filter(|m| !m.is_empty())
        .cloned()
        .unwrap_or_else(|| ua.split('/').next().unwrap_or("unknown").to_string());
    let mut w = Write::new(part, &manager);
    w.dry_run = dry_run;
    w.force = q.get("force").is_some_and(|f| f == "true");
    let method = req.method().clone();
    match (method, &t.name) {
        (Method::GET, Some(name)) => Ok(json_response(200, &store.get(t.res, &ns, name)?)),
        (Method::GET, None) => {
            let filter = Filter {
                namespace: t.ns.clone(),
                labels: LabelSelector::parse(q.get("labelSelector").map(String::as_str).unwrap_or(""))?,
                fields: FieldSelector::parse(q.get("fieldSelector").map(String::as_str).unwrap_or(""))?,
            };
            if matches!(q.get("watch").map(String::as_str), Some("true" | "1")) {
                return watch(shared, t.res, filter, &q);
            }
            let limit = match q.get("limit") {
                Some(l) => Some(
                    l.parse::<usize>().map_err(|_| ApiError::bad_request(format!("invalid limit: {l}")))?,
                ),
                None => None,
            };
            let exact = q.get("resourceVersionMatch").is_some_and(|m| m == "Exact");
            let r = store.list(
                t.res,
                &filter,
                limit,
                q.get("continue").map(String::as_str),
                q.get("resourceVersion").map(String::as_str),
                exact,
            )?;
            let mut meta = json!({"resourceVersion": r.resource_version.to_string()});
            if let Some(c) = r.continue_token {
                meta["continue"] = json!(c);
            }
            if let Some(n) = r.remaining {
                meta["remainingItemCount"] = json!(n);
            }
            let items: Vec<Value> = r.items.into_iter().map(strip_type).collect();
            Ok(json_response(
                200,
                &json!({"kind": rt.list_kind(), "apiVersion": rt.api_version(), "metadata": meta, "items": items}),
            ))
        }
        (Method::POST, None) if t.ns.is_some() || !rt.namespaced => {
            let (ct, body) = read_body(req).await?;
            let obj = json_body(ct.as_deref(), &body)?;
            Ok(json_response(201, &store.create(t.res, &ns, obj, &w)?))
        }
        (Method::PUT, Some(name)) => {
            let (ct, body) = read_body(req).await?;
            let obj = json_body(ct.as_deref(), &body)?;
            Ok(json_response(200, &store.update(t.res, &ns, name, obj, &w)?))
        }
        (Method::PATCH, Some(name)) => {
            let (ct, body) = read_body(req).await?;
            let ct = ct.unwrap_or_default();
            let kind =
                PatchKind::from_content_type(&ct).ok_or_else(|| ApiError::unsupported_media_type(&ct))?;
            let field_manager = q.get("fieldManager").cloned();
            if kind == PatchKind::Apply && field_manager.as_deref().is_none_or(str::is_empty) {
                return Err(ApiError::bad_request(
                    "PATCH, application/apply-patch+yaml requires fieldManager to be set",
                ));
            }
            if kind == PatchKind::Apply {
                w.op = Op::Apply;
            }
            let mut created = false;
            let out = store.patch(t.res, &ns, name, &w, |cur| {
                created = cur.is_none();
                patch::apply(kind, cur, &body)
            })?;
            Ok(json_response(if created { 201 } else { 200 }, &out))
        }
        (Method::DELETE, Some(name)) => {
            let (_, body) = read_body(req).await?;
            let opts: Value =
                if body.is_empty() { json!({}) } else { serde_json::from_slice(&body).unwrap_or(json!({})) };
            let dry_run = dry_run
                || opts.get("dryRun").and_then(Value::as_array).is_some_and(|d| d.iter().any(|x| x == "All"));
            let pre_uid = opts.pointer("/preconditions/uid").and_then(Value::as_str);
            let pre_rv = opts.pointer("/preconditions/resourceVersion").and_then(Value::as_str);
            let (obj, gone) = store.delete(t.res, &ns, name, pre_uid, pre_rv, dry_run)?;
            if !gone || rt.return_deleted_object {
                return Ok(json_response(200, &obj));
            }
            let mut details =
                json!({"name": name, "kind": rt.plural, "uid": crate::store::meta_str(&obj, "uid")});
            if !rt.group.is_empty() {
                details["group"] = json!(rt.group);
            }
            Ok(json_response(
                200,
                &json!({"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Success", "details": details}),
            ))
        }
        _ => Err(ApiError::method_not_allowed()),
    }
}

fn line(ty: &str, obj: &Value) -> Bytes {
    let mut v = serde_json::to_vec(&json!({"type": ty, "object": obj})).expect("json");
    v.push(b'\n');
    Bytes::from(v)
}

fn watch(
    shared: &Arc<Shared>,
    res: usize,
    filter: Filter,
    q: &HashMap<String, String>,
) -> Result<Response<Body>, ApiError> {
    let send_initial = q.get("sendInitialEvents").is_some_and(|v| v == "true");
    let bookmarks = q.get("allowWatchBookmarks").is_some_and(|v| v == "true");
    let timeout = match q.get("timeoutSeconds") {
        Some(t) => Duration::from_secs(
            t.parse::<u64>().map_err(|_| ApiError::bad_request(format!("invalid timeoutSeconds: {t}")))?,
        ),
        // The real server picks a random timeout between 30 and 60 minutes.
        None => Duration::from_secs(1800),
    };
    let start =
        shared.store.watch(res, &filter, q.get("resourceVersion").map(String::as_str), send_initial)?;
    let (tx, mut rx_out) = mpsc::channel::<Bytes>(64);
    let shared = shared.clone();
    let mut generation = shared.generation.subscribe();
    generation.mark_unchanged();
    tokio::spawn(async move {
        let mut rx = match start {
            WatchStart::Gone(e) => {
                let _ = tx.send(line("ERROR", &e.to_status())).await;
                return;
            }
            WatchStart::Events(events, rx) => {
                for (ty, obj) in events {
                    if tx.send(line(ty, &obj)).await.is_err() {
                        return;
                    }
                }
                rx
            }
        };
        let deadline = tokio::time::sleep(timeout);
        tokio::pin!(deadline);
        let interval = *lock(&shared.bookmark_interval);
        let mut tick = tokio::time::interval_at(tokio::time::Instant::now() + interval, interval);
        let rt = &RESOURCES[res];
        loop {
            tokio::select! {
                _ = &mut deadline => return,
                _ = tx.closed() => return,
                _ = generation.changed() => return,
                r = rx.recv() => match r {
                    Ok(c) => if let Some((ty, obj)) = watch_event(&c, res, &filter)
                        && tx.send(line(ty, &obj)).await.is_err() {
                        return;
                    },
                    Err(broadcast::error::RecvError::Lagged(_)) => {
                        let _ = tx.send(line("ERROR", &ApiError::gone("too old resource version: watch fell behind").to_status())).await;
                        return;
                    }
                    Err(broadcast::error::RecvError::Closed) => return,
                },
                _ = tick.tick(), if bookmarks => {
                    let (pending, lagged, rv) = shared.store.drain_for_bookmark(&mut rx);
                    for c in pending {
                        if let Some((ty, obj)) = watch_event(&c, res, &filter)
                            && tx.send(line(ty, &obj)).await.is_err() {
                            return;
                        }
                    }
                    if lagged {
                        let _ = tx.send(line("ERROR", &ApiError::gone("too old resource version: watch fell behind").to_status())).await;
                        return;
                    }
                    let bm = json!({"kind": rt.kind, "apiVersion": rt.api_version(), "metadata": {"resourceVersion": rv.to_string()}});
                    if tx.send(line("BOOKMARK", &bm)).await.is_err() {
                        return;
                    }
                }
            }
        }
    });
    let stream =
        futures_util::stream::poll_fn(move |cx| rx_out.poll_recv(cx).map(|o| o.map(Ok::<_, Infallible>)));
    let mut r = Response::new(Body::from_stream(stream));
    r.headers_mut().insert(header::CONTENT_TYPE, HeaderValue::from_static("application/json"));
    r.headers_mut().insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache, private"));
    Ok(r)
}
