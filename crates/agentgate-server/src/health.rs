//! The health of the server's dependencies (the SQL store, and the Redis
//! lease layer when configured): the background probe, the fail-fast guard
//! in front of every route that needs them, and the reports of `/healthz`
//! and `/readyz`.
//!
//! Without this, a request arriving while the store is down waits out the
//! store's acquire timeout (`agentgate::limits::STORE_ACQUIRE_TIMEOUT`,
//! 10 s) before its 503, and a server whose Redis is gone still looks
//! healthy. Now a probe reads from each dependency every
//! [`HEALTH_PROBE_INTERVAL`], bounded by [`HEALTH_PROBE_TIMEOUT`]; after
//! [`PROBE_FAILURES_TO_TRIP`] failures in a row the dependency counts as
//! down and [`require_dependencies`] answers 503 `store_unavailable` with
//! `Retry-After` at once, until a probe succeeds again.
//!
//! A request already waiting on the store when a dependency is marked down
//! gets the same 503 at that moment (its response not yet started; a
//! stream already flowing is left alone).
//!
//! What this module does not do: decide anything about leases.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU8, Ordering};
use std::sync::Arc;
use std::time::Instant;

use agentgate::SessionId;
use agentgate_core::lease::LeaseLayer;
use agentgate_core::store::Store;
use axum::extract::{Request, State};
use axum::middleware::Next;
use axum::response::Response;
use tokio::sync::watch;
use tokio_util::sync::{CancellationToken, DropGuard};

use crate::dto::{DependencyHealth, HealthResponse};
use crate::error::{ApiError, ErrorCode};
use crate::limits::{
    HEALTH_PROBE_INTERVAL, HEALTH_PROBE_TIMEOUT, PROBE_FAILURES_TO_TRIP, UNAVAILABLE_RETRY_AFTER,
};
use crate::AppState;

/// The id the probes read. A read neither creates nor changes a session or
/// lease, so any valid id serves.
const PROBE_ID: &str = "agentgate-healthz";

/// The dependency names used in reports and messages.
const STORE: &str = "store";
const REDIS: &str = "redis";

/// One dependency's probe result.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Probe {
    Up,
    /// The dependency answered with an error.
    Failed,
    /// It did not answer within [`HEALTH_PROBE_TIMEOUT`].
    TimedOut,
}

impl Probe {
    fn to_u8(self) -> u8 {
        match self {
            Self::Up => 0,
            Self::Failed => 1,
            Self::TimedOut => 2,
        }
    }

    fn from_u8(value: u8) -> Self {
        match value {
            0 => Self::Up,
            1 => Self::Failed,
            _ => Self::TimedOut,
        }
    }
}

/// What the background probe last saw of one dependency.
#[derive(Debug, Default)]
struct Tracked {
    down: AtomicBool,
    failures_in_a_row: AtomicU32,
    last_latency_ms: AtomicU32,
    /// The last failed probe's kind, to report why it is down.
    last_failure: AtomicU8,
}

impl Tracked {
    fn record(&self, probe: Probe, latency_ms: u32) {
        self.last_latency_ms.store(latency_ms, Ordering::Relaxed);
        if probe != Probe::Up {
            self.last_failure.store(probe.to_u8(), Ordering::Relaxed);
        }
        if probe == Probe::Up {
            self.failures_in_a_row.store(0, Ordering::Relaxed);
            if self.down.swap(false, Ordering::SeqCst) {
                tracing::info!("dependency is back");
            }
            return;
        }
        let failures = self.failures_in_a_row.fetch_add(1, Ordering::Relaxed) + 1;
        if failures >= PROBE_FAILURES_TO_TRIP && !self.down.swap(true, Ordering::SeqCst) {
            tracing::warn!(
                ?probe,
                failures,
                "dependency is down; refusing requests until it is back"
            );
        }
    }

    fn is_down(&self) -> bool {
        self.down.load(Ordering::SeqCst)
    }
}

/// The dependencies and what the probe last saw of them. Cheap to clone.
#[derive(Clone, Debug)]
pub struct Health {
    inner: Arc<HealthInner>,
}

#[derive(Debug)]
struct HealthInner {
    store: Arc<dyn Store>,
    leases: Option<Arc<dyn LeaseLayer>>,
    store_state: Tracked,
    leases_state: Tracked,
    /// Stops the probe task when the last clone goes.
    _probe: DropGuard,
    /// Whether any dependency is down, for requests waiting to learn it.
    any_down: watch::Sender<bool>,
}

/// Reads one session from the store.
async fn probe_store(store: &dyn Store) -> (Probe, u32) {
    let Ok(id) = SessionId::new(PROBE_ID) else {
        return (Probe::Failed, 0);
    };
    timed(async { store.session(&id).await.map(|_| ()) }).await
}

/// Reads one session's holder from the lease layer.
async fn probe_leases(leases: &dyn LeaseLayer) -> (Probe, u32) {
    timed(async { leases.holder(PROBE_ID).await.map(|_| ()) }).await
}

async fn timed(call: impl std::future::Future<Output = agentgate::Result<()>>) -> (Probe, u32) {
    let started = Instant::now();
    let probe = match tokio::time::timeout(HEALTH_PROBE_TIMEOUT, call).await {
        Ok(Ok(())) => Probe::Up,
        Ok(Err(error)) => {
            tracing::debug!(%error, "health probe failed");
            Probe::Failed
        }
        Err(_) => Probe::TimedOut,
    };
    let latency_ms = u32::try_from(started.elapsed().as_millis()).unwrap_or(u32::MAX);
    (probe, latency_ms)
}

impl Health {
    /// Tracks `store` and, when given, the lease layer, probing both in a
    /// background task until the last clone is dropped. Must be called
    /// inside a Tokio runtime.
    pub fn start(store: Arc<dyn Store>, leases: Option<Arc<dyn LeaseLayer>>) -> Self {
        let stop = CancellationToken::new();
        let health = Self {
            inner: Arc::new(HealthInner {
                store,
                leases,
                store_state: Tracked::default(),
                leases_state: Tracked::default(),
                _probe: stop.clone().drop_guard(),
                any_down: watch::Sender::new(false),
            }),
        };
        // The task holds only a weak reference, so dropping the state
        // stops it even between ticks.
        let weak = Arc::downgrade(&health.inner);
        tokio::spawn(async move {
            loop {
                tokio::select! {
                    () = stop.cancelled() => return,
                    () = tokio::time::sleep(HEALTH_PROBE_INTERVAL) => {}
                }
                let Some(inner) = weak.upgrade() else { return };
                inner.probe_all().await;
            }
        });
        health
    }

    /// The dependency that is down, if any, as the probe last saw it.
    fn first_down(&self) -> Option<&'static str> {
        if self.inner.store_state.is_down() {
            Some(STORE)
        } else if self.inner.leases.is_some() && self.inner.leases_state.is_down() {
            Some(REDIS)
        } else {
            None
        }
    }

    /// Completes when the probe marks a dependency down (at once if one is).
    async fn tripped(&self) {
        let mut down = self.inner.any_down.subscribe();
        // The sender lives as long as `self`, so this cannot fail; if it
        // somehow did, never completing is the safe answer.
        if down.wait_for(|down| *down).await.is_err() {
            std::future::pending::<()>().await;
        }
    }

    /// Probes every dependency now and reports, for `/healthz`.
    pub(crate) async fn check_now(&self) -> HealthResponse {
        let (store, leases) = self.inner.probe_all().await;
        report(store, leases)
    }

    /// The probe's last view, for `/readyz`: no I/O.
    pub(crate) fn last_seen(&self) -> HealthResponse {
        let inner = &self.inner;
        let seen = |tracked: &Tracked| {
            let probe = if tracked.is_down() {
                Probe::from_u8(tracked.last_failure.load(Ordering::Relaxed))
            } else {
                Probe::Up
            };
            (probe, tracked.last_latency_ms.load(Ordering::Relaxed))
        };
        report(
            seen(&inner.store_state),
            inner.leases.as_ref().map(|_| seen(&inner.leases_state)),
        )
    }
}

impl HealthInner {
    async fn probe_all(&self) -> ((Probe, u32), Option<(Probe, u32)>) {
        let leases = async {
            match &self.leases {
                Some(layer) => Some(probe_leases(layer.as_ref()).await),
                None => None,
            }
        };
        let (store, leases) = tokio::join!(probe_store(self.store.as_ref()), leases);
        self.store_state.record(store.0, store.1);
        if let Some((probe, latency_ms)) = leases {
            self.leases_state.record(probe, latency_ms);
        }
        let down =
            self.store_state.is_down() || (self.leases.is_some() && self.leases_state.is_down());
        self.any_down
            .send_if_modified(|was| std::mem::replace(was, down) != down);
        (store, leases)
    }
}

fn dependency(probe: Probe, latency_ms: u32) -> DependencyHealth {
    DependencyHealth {
        status: if probe == Probe::Up { "up" } else { "down" }.to_owned(),
        latency_ms,
        reason: match probe {
            Probe::Up => None,
            Probe::Failed => Some("error".to_owned()),
            Probe::TimedOut => Some("timeout".to_owned()),
        },
    }
}

fn report(store: (Probe, u32), leases: Option<(Probe, u32)>) -> HealthResponse {
    let mut dependencies = BTreeMap::new();
    dependencies.insert(STORE.to_owned(), dependency(store.0, store.1));
    if let Some((probe, latency_ms)) = leases {
        dependencies.insert(REDIS.to_owned(), dependency(probe, latency_ms));
    }
    let down: Vec<&str> = dependencies
        .iter()
        .filter(|(_, d)| d.status != "up")
        .map(|(name, _)| name.as_str())
        .collect();
    HealthResponse {
        status: if down.is_empty() { "ok" } else { "unavailable" }.to_owned(),
        error: (!down.is_empty()).then(|| unavailable(&down.join(", ")).detail()),
        dependencies,
    }
}

/// The 503 of a request refused because `what` is down.
pub(crate) fn unavailable(what: &str) -> ApiError {
    ApiError::new(
        ErrorCode::StoreUnavailable,
        format!("{what} unavailable; retry later"),
    )
    .retry_after(UNAVAILABLE_RETRY_AFTER)
}

/// Middleware on every route that needs the store: 503 `store_unavailable`
/// with `Retry-After` at once while the probe sees a dependency down,
/// instead of letting the request wait out the store's timeouts. A request
/// already waiting on the store when the probe marks it down is answered
/// the same 503 then, not after the store's 10 s acquire timeout: its
/// outcome is as unknown to the caller as after any 503, and a retry with
/// the same ids is safe (begins replay, steps are fenced).
pub async fn require_dependencies(
    State(state): State<AppState>,
    request: Request,
    next: Next,
) -> Result<Response, ApiError> {
    let health = state.health();
    if let Some(down) = health.first_down() {
        return Err(unavailable(down));
    }
    tokio::select! {
        response = next.run(request) => Ok(response),
        () = health.tripped() => Err(unavailable(health.first_down().unwrap_or(STORE))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_dependency_trips_after_failures_in_a_row_and_recovers_at_once() {
        let tracked = Tracked::default();
        for _ in 1..PROBE_FAILURES_TO_TRIP {
            tracked.record(Probe::TimedOut, 1000);
            assert!(!tracked.is_down(), "one slow probe is not an outage");
        }
        tracked.record(Probe::Failed, 3);
        assert!(tracked.is_down());
        tracked.record(Probe::Up, 2);
        assert!(!tracked.is_down());
        tracked.record(Probe::Failed, 2);
        assert!(!tracked.is_down(), "the count restarts after a success");
    }

    #[test]
    fn reports_name_what_is_down() {
        let ok = report((Probe::Up, 1), Some((Probe::Up, 1)));
        assert_eq!(ok.status, "ok");
        assert!(ok.error.is_none());
        let down = report((Probe::Up, 1), Some((Probe::TimedOut, 1000)));
        assert_eq!(down.status, "unavailable");
        assert_eq!(
            down.dependencies["redis"].reason.as_deref(),
            Some("timeout")
        );
        let error = down.error.expect("an error for a 503");
        assert_eq!(error.code, ErrorCode::StoreUnavailable);
        assert!(error.message.contains("redis"));
        assert_eq!(error.retry_after_ms, Some(1000));
    }
}
