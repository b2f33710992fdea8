//! Serving HTTP to whoever can reach a listener, with bounded resources: the health listener
//! answers on every node address, the authenticated metrics listener too, and a client that
//! opens connections and sends nothing, or headers without end, must neither grow the agent nor
//! keep the kubelet's probes out.
//!
//! Per listener: at most [`Limits::connections`] connections from other hosts at a time (more are
//! closed at once, so the kernel's backlog never fills), and as many again from the node itself
//! (a connection whose peer address is the address it reached: the kubelet probing the pod, the
//! node's own tools), so a flood from outside never takes the probes' place. Per connection: the
//! request head within [`Limits::header_timeout`] and at most [`Limits::max_head_bytes`] of it
//! buffered, one request per connection (no keep-alive to hold a slot idle), and the whole
//! connection within [`Limits::lifetime`].

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::net::TcpStream;
use tokio::sync::Semaphore;
use tokio_rustls::TlsAcceptor;
use tokio_rustls::rustls::ServerConfig;

/// What one listener allows.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    /// Connections at a time from other hosts, and as many from the node itself.
    pub connections: usize,
    /// Time for the TLS handshake and the request head.
    pub header_timeout: Duration,
    /// Time for the whole connection, the response included.
    pub lifetime: Duration,
    /// Bytes of request head buffered at most (hyper's floor is 8 KiB).
    pub max_head_bytes: usize,
}

impl Limits {
    /// The listeners on every address: the kubelet's probes, a scraper.
    pub const PUBLIC: Limits = Limits {
        connections: 64,
        header_timeout: Duration::from_secs(5),
        lifetime: Duration::from_secs(30),
        max_head_bytes: 16 * 1024,
    };
}

/// Serves `router` on `listener` (over TLS with `tls`) within `limits`, forever; one connection's
/// errors end only that connection.
pub async fn serve(
    listener: tokio::net::TcpListener,
    router: Router,
    tls: Option<Arc<ServerConfig>>,
    limits: Limits,
) {
    let outside = Arc::new(Semaphore::new(limits.connections));
    let local = Arc::new(Semaphore::new(limits.connections));
    let acceptor = tls.map(TlsAcceptor::from);
    loop {
        let (stream, peer) = match listener.accept().await {
            Ok(accepted) => accepted,
            Err(e) => {
                // Out of descriptors, for one: wait instead of spinning.
                tracing::debug!(error = %e, "accept failed");
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        let slots = if from_the_node(&stream, peer) { &local } else { &outside };
        // Over the bound: closed at once (dropped), not left waiting in the backlog.
        let Ok(slot) = Arc::clone(slots).try_acquire_owned() else { continue };
        let (acceptor, router) = (acceptor.clone(), router.clone());
        tokio::spawn(async move {
            let _slot = slot;
            let _ = tokio::time::timeout(limits.lifetime, one(stream, acceptor, router, limits)).await;
        });
    }
}

/// Whether a connection comes from the node itself: its peer is the address it reached (or a
/// loopback one).
fn from_the_node(stream: &TcpStream, peer: SocketAddr) -> bool {
    peer.ip().is_loopback() || stream.local_addr().is_ok_and(|l| l.ip() == peer.ip())
}

async fn one(stream: TcpStream, acceptor: Option<TlsAcceptor>, router: Router, limits: Limits) {
    let service = hyper_util::service::TowerToHyperService::new(router);
    let mut http = hyper::server::conn::http1::Builder::new();
    http.timer(TokioTimer::new())
        .header_read_timeout(limits.header_timeout)
        .max_buf_size(limits.max_head_bytes.max(8192))
        .keep_alive(false);
    match acceptor {
        None => {
            let _ = http.serve_connection(TokioIo::new(stream), service).await;
        }
        Some(acceptor) => {
            let Ok(Ok(tls)) = tokio::time::timeout(limits.header_timeout, acceptor.accept(stream)).await
            else {
                return;
            };
            let _ = http.serve_connection(TokioIo::new(tls), service).await;
        }
    }
}
