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

use std::collections::BTreeMap;

use crate::counters::{CounterKind, Series, SeriesKey, Totals};
use crate::domain::{PortId, ServiceKey, parse_protocol};
use crate::metrics::{Metrics, read_totals};
use crate::status::{SharedStatus, Status};

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
    let mut st = crate::locks::read(&app.status).clone();
    if app.metrics.per_service {
        // The kernel's counters, read now (over netlink: off the async workers).
        let counters = app.metrics.counters.clone();
        if let Ok(totals) = tokio::task::spawn_blocking(move || read_totals(&counters)).await {
            add_counters(&mut st, &totals);
        }
    }
    Json(st)
}

/// Puts each Service port's connection and source-range refusal totals on its status line.
fn add_counters(st: &mut Status, totals: &BTreeMap<Series, Totals>) {
    for svc in &mut st.services {
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
    let last = crate::locks::read(&app.status).last_tick;
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
    let st = crate::locks::read(&app.status);
    match st.readiness() {
        Ok(None) => (StatusCode::OK, "ready\n".to_string()),
        Ok(Some(note)) => (StatusCode::OK, format!("ready ({note})\n")),
        Err(reason) => (StatusCode::SERVICE_UNAVAILABLE, format!("not ready: {reason}\n")),
    }
}

#[cfg(test)]
mod tests {
    use std::sync::RwLock;
    use std::time::Instant;

    use super::*;
    use crate::status::Status;

    async fn get_healthz(last_tick: Option<Instant>, stuck_after: Duration) -> (StatusCode, String) {
        let status = Status { last_tick, ..Default::default() };
        let metrics = Arc::new(Metrics::new(false).unwrap());
        let app = AppState { status: Arc::new(RwLock::new(status)), metrics, stuck_after };
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
