//! Serve: what the agent tells the outside. `/status`, `/healthz`, `/readyz` and `/metrics`
//! (`http`, with `access` and `tls` deciding who may read them), the Prometheus registry
//! (`metrics`) and the shared status they read (`status`).

pub mod access;
pub mod conn;
pub mod http;
pub mod metrics;
pub mod status;
pub mod tls;
