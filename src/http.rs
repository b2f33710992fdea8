//! The agent's HTTP endpoints: `/status` (JSON, what `nodelb status` prints), `/healthz` (the
//! loop is alive), `/readyz` (the node can serve; the body says why not).

use std::net::SocketAddr;
use std::time::Duration;

use axum::Router;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Json};
use axum::routing::get;

use crate::status::SharedStatus;

#[derive(Clone)]
struct AppState {
    status: SharedStatus,
    /// The loop is considered stuck when it has not ticked for this long.
    stuck_after: Duration,
}

pub fn router(status: SharedStatus, stuck_after: Duration) -> Router {
    Router::new()
        .route("/status", get(status_json))
        .route("/healthz", get(healthz))
        .route("/readyz", get(readyz))
        .with_state(AppState { status, stuck_after })
}

/// Serves until the listener fails. Binding errors are returned so `main` can report the address.
pub async fn serve(addr: SocketAddr, status: SharedStatus, stuck_after: Duration) -> std::io::Result<()> {
    let listener = tokio::net::TcpListener::bind(addr).await?;
    axum::serve(listener, router(status, stuck_after)).await
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
