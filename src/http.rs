//! The agent's HTTP endpoints: `/metrics` (Prometheus text), `/status` (JSON, what
//! `nodelb status` prints), `/healthz` (the loop is alive), `/readyz` (the node can serve; the
//! body says why not).

use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Json};
use axum::routing::get;

use crate::metrics::Metrics;
use crate::status::SharedStatus;

#[derive(Clone)]
struct AppState {
    status: SharedStatus,
    metrics: Arc<Metrics>,
    /// The loop is considered stuck when it has not ticked for this long.
    stuck_after: Duration,
}

pub fn router(status: SharedStatus, metrics: Arc<Metrics>, stuck_after: Duration) -> Router {
    Router::new()
        .route("/metrics", get(metrics_text))
        .route("/status", get(status_json))
        .route("/healthz", get(healthz))
        .route("/readyz", get(readyz))
        .with_state(AppState { status, metrics, stuck_after })
}

async fn metrics_text(State(app): State<AppState>) -> impl IntoResponse {
    // Gathering reads the kernel's counters over netlink: keep it off the async workers.
    let metrics = app.metrics.clone();
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
    let st = app.status.read().unwrap_or_else(|e| e.into_inner()).clone();
    Json(st)
}

async fn healthz(State(app): State<AppState>) -> impl IntoResponse {
    let last = app.status.read().unwrap_or_else(|e| e.into_inner()).last_tick;
    match last {
        Some(t) if t.elapsed() <= app.stuck_after => (StatusCode::OK, "ok\n".to_string()),
        Some(t) => (
            StatusCode::SERVICE_UNAVAILABLE,
            format!("sync loop stuck: last tick {:.1}s ago\n", t.elapsed().as_secs_f64()),
        ),
        None => (StatusCode::SERVICE_UNAVAILABLE, "sync loop not started\n".to_string()),
    }
}

async fn readyz(State(app): State<AppState>) -> impl IntoResponse {
    let st = app.status.read().unwrap_or_else(|e| e.into_inner());
    match st.readiness() {
        Ok(None) => (StatusCode::OK, "ready\n".to_string()),
        Ok(Some(note)) => (StatusCode::OK, format!("ready ({note})\n")),
        Err(reason) => (StatusCode::SERVICE_UNAVAILABLE, format!("not ready: {reason}\n")),
    }
}
