//! The HTTP endpoints of a node agent, on three listeners (docs/design.md, "Who can see and
//! touch the agent"), and the controller's, on the same three with what a controller has
//! ([`local_router`]: no `/status`; its probes are [`ControllerProbes`]):
//! - [`router`] (`--http-addr`, loopback by default): `/metrics` (Prometheus text), `/status`
//!   (JSON, what `nodelb status` prints), `/healthz` (the loop is alive), `/readyz` (the node can
//!   serve; the body says why not). Unauthenticated: whoever can reach it is on the node.
//! - [`health_router`] (`--health-addr`, all addresses): `/healthz` and `/readyz` for the
//!   kubelet's probes, the status code only; why is withheld (it can name Services and files).
//! - [`metrics_router`] (`--metrics-addr`, TLS): `/metrics` for a bearer token the API server
//!   authenticates and allows `get` on `/metrics` ([`crate::serve::access`], [`crate::k8s::review`]).

use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Json};
use axum::routing::get;

use std::collections::BTreeMap;

use crate::core::domain::{PortId, ServiceKey, parse_protocol};
use crate::core::reports::counters::{CounterKind, Series, SeriesKey, Totals};
use crate::k8s::controller::Liveness;
use crate::k8s::election::Leadership;
use crate::k8s::review::Reviewer;
use crate::serve::access::{ReviewBudget, ReviewCache, Verdict, bearer_token};
use crate::serve::metrics::{Exposition, Metrics};
use crate::serve::status::{SharedStatus, Status};

/// What the probes answer: `/healthz` (the process's loop turns) and `/readyz` (it can do its
/// job), each a status code and a body saying why.
pub trait Probes: Send + Sync + 'static {
    fn health(&self) -> (StatusCode, String);
    fn readiness(&self) -> (StatusCode, String);
    /// Where the reason the public probes withhold can be read.
    fn reason_is_at(&self) -> &'static str;
}

/// A node agent's probes: its sync loop ticks; its node can serve.
pub struct NodeProbes {
    pub status: SharedStatus,
    /// The loop is considered stuck when it has not ticked for this long.
    pub stuck_after: Duration,
}

impl Probes for NodeProbes {
    fn health(&self) -> (StatusCode, String) {
        health(&self.status, self.stuck_after)
    }
    fn readiness(&self) -> (StatusCode, String) {
        readiness(&self.status)
    }
    fn reason_is_at(&self) -> &'static str {
        "run `nodelb status` on the node"
    }
}

/// The controller's probes: its allocation loop turns; its caches are complete (a standby
/// replica is ready too: it takes over the moment it is elected).
pub struct ControllerProbes {
    pub liveness: Arc<Liveness>,
    pub leadership: Arc<Leadership>,
    pub stuck_after: Duration,
}

impl Probes for ControllerProbes {
    fn health(&self) -> (StatusCode, String) {
        let since = self.liveness.since_last_turn();
        if since <= self.stuck_after {
            (StatusCode::OK, "ok\n".to_string())
        } else {
            let why = format!("allocation loop stuck: last turn {:.1}s ago\n", since.as_secs_f64());
            (StatusCode::SERVICE_UNAVAILABLE, why)
        }
    }
    fn readiness(&self) -> (StatusCode, String) {
        match (self.liveness.complete(), self.leadership.get()) {
            (false, _) => (StatusCode::SERVICE_UNAVAILABLE, "not ready: caches not listed yet\n".to_string()),
            (true, true) => (StatusCode::OK, "ready (leading)\n".to_string()),
            (true, false) => (StatusCode::OK, "ready (standby)\n".to_string()),
        }
    }
    fn reason_is_at(&self) -> &'static str {
        "the pod's own --http-addr says why"
    }
}

#[derive(Clone)]
struct AppState {
    status: SharedStatus,
    metrics: Arc<Metrics>,
    probes: Arc<dyn Probes>,
}

/// A node agent's local listener: `/metrics`, `/status`, `/healthz`, `/readyz`.
pub fn router(status: SharedStatus, metrics: Arc<Metrics>, stuck_after: Duration) -> Router {
    let probes: Arc<dyn Probes> = Arc::new(NodeProbes { status: status.clone(), stuck_after });
    Router::new()
        .route("/metrics", get(metrics_text))
        .route("/status", get(status_json))
        .route("/healthz", get(healthz))
        .route("/readyz", get(readyz))
        .with_state(AppState { status, metrics, probes })
}

async fn metrics_text(State(app): State<AppState>) -> impl IntoResponse {
    render_metrics(app.metrics).await
}

#[derive(Clone)]
struct LocalState {
    metrics: Arc<dyn Exposition>,
    probes: Arc<dyn Probes>,
}

/// The controller's local listener: `/metrics`, `/healthz`, `/readyz` with their reasons.
pub fn local_router(metrics: Arc<dyn Exposition>, probes: Arc<dyn Probes>) -> Router {
    Router::new()
        .route("/metrics", get(|State(l): State<LocalState>| render_metrics(l.metrics)))
        .route("/healthz", get(|State(l): State<LocalState>| async move { l.probes.health() }))
        .route("/readyz", get(|State(l): State<LocalState>| async move { l.probes.readiness() }))
        .with_state(LocalState { metrics, probes })
}

async fn render_metrics<E: Exposition + ?Sized>(
    metrics: Arc<E>,
) -> (StatusCode, [(header::HeaderName, &'static str); 1], String) {
    // Gathering reads the kernel's counters over netlink: keep it off the async workers.
    match tokio::task::spawn_blocking(move || metrics.render()).await {
        Ok(text) => (StatusCode::OK, [(header::CONTENT_TYPE, "text/plain; version=0.0.4")], text),
        Err(e) => (
            StatusCode::INTERNAL_SERVER_ERROR,
            [(header::CONTENT_TYPE, "text/plain")],
            format!("metrics collection failed: {e}\n"),
        ),
    }
}

async fn status_json(State(app): State<AppState>) -> impl IntoResponse {
    let mut st = crate::locks::read(&app.status).clone();
    if app.metrics.per_service {
        // The kernel's counters, read now (over netlink: off the async workers).
        let reader = app.metrics.totals.clone();
        if let Ok(totals) = tokio::task::spawn_blocking(move || reader.read()).await {
            add_counters(&mut st, &totals);
        }
    }
    Json(st)
}

/// Puts each Service port's connection and source-range refusal totals on its status line.
fn add_counters(st: &mut Status, totals: &BTreeMap<Series, Totals>) {
    for svc in &mut st.services {
        let svc = Arc::make_mut(svc);
        let service = ServiceKey::new(svc.namespace.clone(), svc.name.clone());
        for port in &mut svc.ports {
            let Ok(protocol) = parse_protocol(&port.protocol) else { continue };
            let key = SeriesKey { service: service.clone(), port: PortId { port: port.port, protocol } };
            let get = |kind| totals.get(&(key.clone(), kind)).map(|t: &Totals| t.packets);
            port.connections = get(CounterKind::Connections);
            port.refused_packets = get(CounterKind::Refused);
        }
    }
}

async fn healthz(State(app): State<AppState>) -> impl IntoResponse {
    app.probes.health()
}

/// `/healthz`: 200 while the sync loop ticks; 503 saying since when it did not.
fn health(status: &SharedStatus, stuck_after: Duration) -> (StatusCode, String) {
    let last = crate::locks::read(status).last_tick;
    match last {
        Some(t) if t.elapsed() <= stuck_after => (StatusCode::OK, "ok\n".to_string()),
        Some(t) => (
            StatusCode::SERVICE_UNAVAILABLE,
            format!("sync loop stuck: last tick {:.1}s ago\n", t.elapsed().as_secs_f64()),
        ),
        None => (StatusCode::SERVICE_UNAVAILABLE, "sync loop not started\n".to_string()),
    }
}

async fn readyz(State(app): State<AppState>) -> impl IntoResponse {
    readiness(&app.status)
}

/// `/readyz`: 200 when the node can serve (the body notes a degraded family), 503 and why not.
fn readiness(status: &SharedStatus) -> (StatusCode, String) {
    let st = crate::locks::read(status);
    match st.readiness() {
        Ok(None) => (StatusCode::OK, "ready\n".to_string()),
        Ok(Some(note)) => (StatusCode::OK, format!("ready ({note})\n")),
        Err(reason) => (StatusCode::SERVICE_UNAVAILABLE, format!("not ready: {reason}\n")),
    }
}

#[derive(Clone)]
struct HealthState {
    probes: Arc<dyn Probes>,
}

/// The probes, for anyone who can reach the node or pod: the status code of the local
/// listener's, with the reason withheld (it can name Services, files and sysctls; the local
/// listener, or `nodelb status` on a node, says why), as kube-apiserver's `/readyz` withholds
/// its failed checks.
pub fn health_router(probes: Arc<dyn Probes>) -> Router {
    Router::new()
        .route("/healthz", get(public_healthz))
        .route("/readyz", get(public_readyz))
        .with_state(HealthState { probes })
}

async fn public_healthz(State(h): State<HealthState>) -> impl IntoResponse {
    withheld(h.probes.health().0, "ok\n", "unhealthy", h.probes.reason_is_at())
}

async fn public_readyz(State(h): State<HealthState>) -> impl IntoResponse {
    withheld(h.probes.readiness().0, "ready\n", "not ready", h.probes.reason_is_at())
}

fn withheld(code: StatusCode, ok: &'static str, bad: &str, at: &str) -> (StatusCode, String) {
    match code {
        StatusCode::OK => (code, ok.to_string()),
        _ => (code, format!("{bad} (reason withheld here: {at})\n")),
    }
}

/// The authenticated metrics listener's gate: the reviewer, its answers' cache, and a bound on
/// the reviews in flight (each is two API requests; a flood of tokens waits instead of
/// multiplying them).
pub struct MetricsAuth {
    reviewer: Arc<dyn Reviewer>,
    cache: std::sync::Mutex<ReviewCache>,
    in_flight: tokio::sync::Semaphore,
    budget: std::sync::Mutex<ReviewBudget>,
}

/// Reviews in flight at most.
const MAX_REVIEWS_IN_FLIGHT: usize = 4;

impl MetricsAuth {
    pub fn new(reviewer: Arc<dyn Reviewer>) -> MetricsAuth {
        MetricsAuth {
            reviewer,
            cache: std::sync::Mutex::new(ReviewCache::default()),
            in_flight: tokio::sync::Semaphore::new(MAX_REVIEWS_IN_FLIGHT),
            budget: std::sync::Mutex::new(ReviewBudget::default()),
        }
    }

    /// The verdict on `authorization` (the header's value) for `path`: cached, or reviewed now.
    pub async fn verdict(&self, authorization: Option<&str>, path: &str) -> Verdict {
        let Some(token) = bearer_token(authorization) else {
            return Verdict::Unauthenticated { reason: "no bearer token".to_string() };
        };
        let cached = |now| crate::locks::lock(&self.cache).get(token, path, now);
        if let Some(v) = cached(std::time::Instant::now()) {
            return v;
        }
        let Ok(_permit) = self.in_flight.acquire().await else {
            return Verdict::Unavailable { reason: "shutting down".to_string() };
        };
        // Another request may have asked about the same token meanwhile.
        if let Some(v) = cached(std::time::Instant::now()) {
            return v;
        }
        if !crate::locks::lock(&self.budget).take(std::time::Instant::now()) {
            return Verdict::Unavailable { reason: "too many new tokens to review: try again".to_string() };
        }
        let v = self.reviewer.review(token, path).await;
        let mut cache = crate::locks::lock(&self.cache);
        cache.put(token, path, v.clone(), std::time::Instant::now());
        v
    }
}

#[derive(Clone)]
struct MetricsState {
    metrics: Arc<dyn Exposition>,
    auth: Arc<MetricsAuth>,
}

/// `/metrics` for authenticated, authorized clients only (see [`crate::serve::access`]).
pub fn metrics_router(metrics: Arc<dyn Exposition>, auth: Arc<MetricsAuth>) -> Router {
    Router::new().route("/metrics", get(authorized_metrics)).with_state(MetricsState { metrics, auth })
}

async fn authorized_metrics(
    State(m): State<MetricsState>,
    headers: axum::http::HeaderMap,
) -> axum::response::Response {
    let authorization = headers.get(header::AUTHORIZATION).and_then(|v| v.to_str().ok());
    match m.auth.verdict(authorization, "/metrics").await {
        Verdict::Allowed { .. } => render_metrics(m.metrics).await.into_response(),
        v => {
            match &v {
                Verdict::Unavailable { reason } => {
                    tracing::warn!(%reason, "cannot review a /metrics client's token")
                }
                Verdict::Forbidden { user } => tracing::debug!(%user, "refused /metrics: not allowed"),
                other => tracing::debug!(verdict = ?other, "refused /metrics"),
            }
            let code = StatusCode::from_u16(v.status()).unwrap_or(StatusCode::FORBIDDEN);
            let mut response = (code, v.message("/metrics")).into_response();
            if code == StatusCode::UNAUTHORIZED {
                response
                    .headers_mut()
                    .insert(header::WWW_AUTHENTICATE, header::HeaderValue::from_static("Bearer"));
            }
            response
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::RwLock;
    use std::time::Instant;

    use super::*;
    use crate::serve::status::Status;

    async fn get_healthz(last_tick: Option<Instant>, stuck_after: Duration) -> (StatusCode, String) {
        let status = Status { last_tick, ..Default::default() };
        let metrics =
            Arc::new(Metrics::new(false, Arc::new(|_: &[&crate::core::ruleset::ir::Name]| None)).unwrap());
        let status = Arc::new(RwLock::new(status));
        let probes = Arc::new(NodeProbes { status: status.clone(), stuck_after });
        let app = AppState { status, metrics, probes };
        let response = healthz(State(app)).await.into_response();
        let code = response.status();
        let body = axum::body::to_bytes(response.into_body(), 1 << 16).await.unwrap();
        (code, String::from_utf8_lossy(&body).into_owned())
    }

    #[tokio::test]
    async fn healthz_is_ok_while_the_loop_ticks_and_names_a_stuck_loop() {
        let stuck_after = Duration::from_millis(100);
        let (code, body) = get_healthz(None, stuck_after).await;
        assert_eq!((code, body.as_str()), (StatusCode::SERVICE_UNAVAILABLE, "sync loop not started\n"));
        let (code, body) = get_healthz(Some(Instant::now()), stuck_after).await;
        assert_eq!((code, body.as_str()), (StatusCode::OK, "ok\n"));
        // Real time, no fake clock: a tick older than `stuck_after`.
        let tick = Instant::now();
        tokio::time::sleep(Duration::from_millis(250)).await;
        let (code, body) = get_healthz(Some(tick), stuck_after).await;
        assert_eq!(code, StatusCode::SERVICE_UNAVAILABLE, "{body}");
        assert!(body.starts_with("sync loop stuck: last tick ") && body.ends_with("s ago\n"), "{body}");
    }
}

#[cfg(test)]
mod access_tests {
    use std::sync::RwLock;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::time::Instant;

    use futures::future::BoxFuture;

    use super::*;
    use crate::serve::status::{Status, SyncStatus};

    /// A reviewer that knows two tokens: `good` (allowed) and `reader` (authenticated, not
    /// allowed); `down` makes it fail as an unreachable API would. Counts the reviews.
    struct Fake(AtomicUsize);

    impl Reviewer for Fake {
        fn review<'a>(&'a self, token: &'a str, _path: &'a str) -> BoxFuture<'a, Verdict> {
            self.0.fetch_add(1, Ordering::SeqCst);
            let v = match token {
                "good" => Verdict::Allowed { user: "system:serviceaccount:monitoring:prometheus".into() },
                "reader" => Verdict::Forbidden { user: "alice".into() },
                "down" => Verdict::Unavailable { reason: "connection refused".into() },
                _ => Verdict::Unauthenticated { reason: "invalid bearer token".into() },
            };
            Box::pin(async move { v })
        }
    }

    async fn scrape(
        state: &MetricsState,
        authorization: Option<&str>,
    ) -> (StatusCode, Option<String>, String) {
        let mut headers = axum::http::HeaderMap::new();
        if let Some(a) = authorization {
            headers.insert(header::AUTHORIZATION, a.parse().expect("header"));
        }
        let response = authorized_metrics(State(state.clone()), headers).await;
        let code = response.status();
        let challenge =
            response.headers().get(header::WWW_AUTHENTICATE).map(|v| v.to_str().unwrap().to_string());
        let body = axum::body::to_bytes(response.into_body(), 1 << 20).await.expect("body");
        (code, challenge, String::from_utf8_lossy(&body).into_owned())
    }

    /// Only an authenticated and authorized token gets the metrics; answers are cached (one
    /// review for two scrapes), failures are not; refusals say what is missing and never echo
    /// the token.
    #[tokio::test]
    async fn metrics_need_an_authorized_bearer_token() {
        let fake = Arc::new(Fake(AtomicUsize::new(0)));
        let auth = Arc::new(MetricsAuth::new(fake.clone()));
        let state = MetricsState {
            metrics: Arc::new(
                Metrics::new(false, Arc::new(|_: &[&crate::core::ruleset::ir::Name]| None)).expect("metrics"),
            ),
            auth,
        };
        let reviews = || fake.0.load(Ordering::SeqCst);

        let (code, challenge, body) = scrape(&state, None).await;
        assert_eq!((code, challenge.as_deref()), (StatusCode::UNAUTHORIZED, Some("Bearer")), "{body}");
        let (code, _, _) = scrape(&state, Some("Basic dXNlcjpwYXNz")).await;
        assert_eq!(code, StatusCode::UNAUTHORIZED);
        assert_eq!(reviews(), 0, "no token, no review");

        let (code, challenge, body) = scrape(&state, Some("Bearer forged-token")).await;
        assert_eq!((code, challenge.as_deref()), (StatusCode::UNAUTHORIZED, Some("Bearer")));
        assert!(!body.contains("forged-token") && !body.contains("nodelb_"), "{body}");

        let (code, _, body) = scrape(&state, Some("Bearer reader")).await;
        assert_eq!(code, StatusCode::FORBIDDEN);
        assert_eq!(body, "Forbidden: user \"alice\" may not get /metrics\n");

        let (code, _, body) = scrape(&state, Some("Bearer good")).await;
        assert_eq!(code, StatusCode::OK);
        assert!(body.contains("nodelb_build_info"), "{body}");
        let before = reviews();
        let (code, _, _) = scrape(&state, Some("bearer good")).await;
        assert_eq!((code, reviews()), (StatusCode::OK, before), "the second scrape uses the cached answer");

        let (code, _, body) = scrape(&state, Some("Bearer down")).await;
        assert_eq!(code, StatusCode::SERVICE_UNAVAILABLE, "{body}");
        scrape(&state, Some("Bearer down")).await;
        assert_eq!(reviews(), before + 2, "a failure is asked again");
    }

    /// From outside the node the probes get the status code; the reason (a file, a sysctl, a
    /// Service named in a sync error) is withheld. The local listener still says it.
    #[tokio::test]
    async fn public_probes_withhold_the_reason() {
        let failing = Status {
            source_synced: true,
            last_tick: Some(Instant::now()),
            last_sync: Some(SyncStatus {
                ok: false,
                error: Some("cannot write state file /var/lib/nodelb/state.json".into()),
                ..Default::default()
            }),
            ..Default::default()
        };
        let status: SharedStatus = Arc::new(RwLock::new(failing));
        let probes = NodeProbes { status: status.clone(), stuck_after: Duration::from_secs(30) };
        let h = HealthState { probes: Arc::new(probes) };
        let (code, body) = public_readyz(State(h.clone())).await.into_response().into_parts();
        let body = axum::body::to_bytes(body, 1 << 16).await.expect("body");
        let body = String::from_utf8_lossy(&body);
        assert_eq!(code.status, StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(body, "not ready (reason withheld here: run `nodelb status` on the node)\n");
        let (local_code, local_body) = readiness(&status);
        assert_eq!(local_code, StatusCode::SERVICE_UNAVAILABLE);
        assert!(local_body.contains("/var/lib/nodelb/state.json"), "{local_body}");
        let (code, body) = public_healthz(State(h.clone())).await.into_response().into_parts();
        assert_eq!(code.status, StatusCode::OK);
        assert_eq!(axum::body::to_bytes(body, 1 << 16).await.expect("body"), "ok\n");
        status.write().unwrap().last_sync.as_mut().unwrap().ok = true;
        let (code, body) = public_readyz(State(h)).await.into_response().into_parts();
        assert_eq!(code.status, StatusCode::OK);
        assert_eq!(axum::body::to_bytes(body, 1 << 16).await.expect("body"), "ready\n");
    }
}
