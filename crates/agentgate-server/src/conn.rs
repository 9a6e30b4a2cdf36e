//! Connections: the accept loop, the per-connection limits and the graceful
//! drain on shutdown.
//!
//! `axum::serve` offers none of the limits a server facing slow or hostile
//! clients needs, so connections are served here with hyper's HTTP/1.1
//! connection builder directly:
//!
//! - a header-read timeout ([`HEADER_READ_TIMEOUT`]): a client that opens a
//!   connection and never finishes a request head is cut off. hyper starts
//!   the same timer when a kept-alive connection waits for its next request,
//!   so it is also the idle keep-alive timeout;
//! - a connection cap (a semaphore of [`ServeConfig::max_connections`]
//!   permits): a connection over the cap is answered `503 overloaded` with
//!   `Retry-After` and closed at once, so file descriptors never run out and
//!   `/healthz` keeps answering;
//! - a cap per client (peer IP address,
//!   [`ServeConfig::max_connections_per_client`]), answered the same way, so
//!   one client's idle streams or half-open connections never take every
//!   place. This is a count of open connections at accept time, below any
//!   request: a request-rate limiter (`governor`/`tower_governor`) sees
//!   requests, not the idle and half-open connections that exhaust the cap;
//! - a write bound ([`crate::stall`]): a client that takes no bytes for
//!   [`crate::limits::WRITE_STALL`] while a write waits is cut off, and one
//!   that vanished without closing is dropped by the kernel
//!   (`TCP_USER_TIMEOUT`);
//! - on shutdown, accepting stops, every open connection is told to finish
//!   its request in flight and close, and the drain waits at most
//!   [`SHUTDOWN_GRACE`].
//!
//! What this module does not own: request-level limits (body size and read
//! time, request timeout, concurrency), which are the router's.
//!
//! [`ServeConfig::max_connections`]: crate::ServeConfig::max_connections

use std::future::Future;
use std::sync::{Arc, LazyLock};

use axum::Router;
use hyper::server::conn::http1;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::service::TowerToHyperService;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Semaphore;
use tokio_util::sync::CancellationToken;

use crate::limits::{
    ACCEPT_ERROR_BACKOFF, HEADER_READ_TIMEOUT, OVERLOADED_RETRY_AFTER, SHUTDOWN_GRACE,
};

/// What a connection over the cap is told before it is closed: a complete
/// HTTP/1.1 answer in one write, so a client that reads it learns to retry.
fn overloaded_response() -> &'static [u8] {
    static RESPONSE: LazyLock<Vec<u8>> = LazyLock::new(|| {
        let body = serde_json::json!({"error": {
            "code": "overloaded",
            "message": "the server is at its connection limit; retry later",
            "retry_after_ms": OVERLOADED_RETRY_AFTER.as_millis() as u64,
        }})
        .to_string();
        format!(
            "HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\n\
             retry-after: {}\r\nconnection: close\r\ncontent-length: {}\r\n\r\n{body}",
            OVERLOADED_RETRY_AFTER.as_secs().max(1),
            body.len()
        )
        .into_bytes()
    });
    &RESPONSE
}

/// The HTTP/1.1 connection settings every connection gets.
fn connection_builder() -> http1::Builder {
    let mut builder = http1::Builder::new();
    builder
        .timer(TokioTimer::new())
        .header_read_timeout(HEADER_READ_TIMEOUT)
        .keep_alive(true);
    builder
}

/// Tells a connection over the cap to come back later, without waiting on
/// it: one non-blocking write (a fresh socket's send buffer takes it whole),
/// then close.
fn refuse(stream: &TcpStream) {
    if let Err(error) = stream.try_write(overloaded_response()) {
        tracing::debug!(%error, "could not tell a refused connection why");
    }
}

/// The connections each client (peer IP address) holds open, bounded by
/// `limit`; an address leaves the map when its last connection closes, so
/// the map never holds more entries than there are open connections.
#[derive(Debug)]
struct PerClient {
    limit: usize,
    open: std::sync::Mutex<std::collections::HashMap<std::net::IpAddr, usize>>,
}

/// One open connection of a client; gives its place back when dropped.
struct ClientSlot {
    clients: Arc<PerClient>,
    address: std::net::IpAddr,
}

impl PerClient {
    /// A place for one more connection of `address`, unless it holds
    /// `limit` already.
    fn enter(self: &Arc<Self>, address: std::net::IpAddr) -> Option<ClientSlot> {
        let mut open = self
            .open
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let count = open.entry(address).or_insert(0);
        if *count >= self.limit {
            return None;
        }
        *count += 1;
        Some(ClientSlot {
            clients: Arc::clone(self),
            address,
        })
    }
}

impl Drop for ClientSlot {
    fn drop(&mut self) {
        let mut open = self
            .clients
            .open
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if let Some(count) = open.get_mut(&self.address) {
            *count -= 1;
            if *count == 0 {
                open.remove(&self.address);
            }
        }
    }
}

/// Accepts connections on `listener` and serves `router` on each, at most
/// `max_connections` at once and `per_client` of one peer address, until
/// `shutdown` completes; then drains.
pub(crate) async fn serve_connections(
    listener: TcpListener,
    router: Router,
    max_connections: usize,
    per_client: usize,
    shutdown: impl Future<Output = ()> + Send + 'static,
) {
    let clients = Arc::new(PerClient {
        limit: per_client,
        open: std::sync::Mutex::default(),
    });
    let permits = Arc::new(Semaphore::new(max_connections));
    let stop = CancellationToken::new();
    let builder = Arc::new(connection_builder());
    tokio::pin!(shutdown);
    loop {
        let (stream, peer) = tokio::select! {
            () = &mut shutdown => break,
            accepted = listener.accept() => match accepted {
                Ok(accepted) => accepted,
                Err(error) => {
                    // EMFILE and friends: back off instead of spinning on an
                    // accept that fails until a descriptor frees up.
                    tracing::warn!(%error, "accept failed");
                    tokio::time::sleep(ACCEPT_ERROR_BACKOFF).await;
                    continue;
                }
            },
        };
        let Some(slot) = clients.enter(peer.ip()) else {
            tracing::warn!(
                per_client,
                client = %peer.ip(),
                "connection refused: the client holds its most connections"
            );
            refuse(&stream);
            continue;
        };
        let Ok(permit) = Arc::clone(&permits).try_acquire_owned() else {
            tracing::warn!(
                max_connections,
                "connection refused: at the connection limit"
            );
            refuse(&stream);
            continue;
        };
        let service = TowerToHyperService::new(router.clone());
        let (builder, stop) = (Arc::clone(&builder), stop.clone());
        tokio::spawn(async move {
            let (_permit, _slot) = (permit, slot);
            if let Err(error) = stream.set_nodelay(true) {
                tracing::debug!(%error, "cannot set TCP_NODELAY");
            }
            crate::stall::limit_unacked(&stream);
            let stream = crate::stall::StallBounded::new(stream);
            let connection = builder.serve_connection(TokioIo::new(stream), service);
            tokio::pin!(connection);
            let result = tokio::select! {
                result = connection.as_mut() => result,
                () = stop.cancelled() => {
                    connection.as_mut().graceful_shutdown();
                    connection.await
                }
            };
            if let Err(error) = result {
                // Header timeouts, resets and malformed requests: the
                // client's doing, worth a debug line, never an error.
                tracing::debug!(%error, "connection ended");
            }
        });
    }
    drop(listener);
    stop.cancel();
    let all = u32::try_from(max_connections).unwrap_or(u32::MAX);
    if tokio::time::timeout(SHUTDOWN_GRACE, permits.acquire_many(all))
        .await
        .is_err()
    {
        tracing::warn!(
            grace_s = SHUTDOWN_GRACE.as_secs(),
            "connections still open after the shutdown grace; closing them"
        );
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn the_overloaded_answer_is_well_formed() {
        let text = std::str::from_utf8(overloaded_response()).unwrap();
        let (head, body) = text.split_once("\r\n\r\n").unwrap();
        let length: usize = head
            .lines()
            .find_map(|line| line.strip_prefix("content-length: "))
            .unwrap()
            .parse()
            .unwrap();
        assert_eq!(body.len(), length);
        let json: serde_json::Value = serde_json::from_str(body).unwrap();
        assert_eq!(json["error"]["code"], "overloaded");
        assert_eq!(json["error"]["retry_after_ms"], 1000);
    }
}
