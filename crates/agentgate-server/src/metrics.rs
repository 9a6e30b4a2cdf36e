//! Prometheus metrics, all named `agentgate_*`, kept in a registry owned by
//! the server state (not the global one), so two servers in one process
//! (tests) do not share counters.
//!
//! What is counted where: handlers record protocol outcomes (begins, tool
//! claims, endings); the `track` middleware records latency by route
//! template and every error response by code, from the [`ErrorCode`] the
//! error response carries in its extensions.
//!
//! Every label value is drawn from a fixed set, never copied from a request
//! as sent: methods outside the standard nine are `other`, routes are
//! templates (`unmatched` when none matched), statuses are the ones this
//! server answers with, codes and outcomes are enums. A client inventing
//! methods or paths therefore cannot grow the registry.
//!
//! `agentgate_live_turns` is this process's view: grants it handed out minus
//! endings it recorded. Turns whose leases expire, or that other nodes end,
//! are not seen; the store's truth per user is `GET /v1/users/{user_id}`.

use std::collections::BTreeMap;
use std::time::Instant;

use axum::extract::{MatchedPath, Request, State};
use axum::http::Method;
use axum::middleware::Next;
use axum::response::Response;
use prometheus::core::Collector as _;
use prometheus::{
    HistogramOpts, HistogramVec, IntCounter, IntCounterVec, IntGauge, Opts, Registry, TextEncoder,
};

use crate::error::ErrorCode;
use crate::AppState;

/// Latency buckets in seconds: protocol steps are single store transactions,
/// so most answers land in the low milliseconds; the top buckets catch a
/// store under lock contention up to the request timeout.
const LATENCY_BUCKETS_SECONDS: &[f64] = &[
    0.000_5, 0.001, 0.002_5, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
];

/// The HTTP methods kept as their own label value; anything else (a client
/// may send any token as a method) is counted as `other`.
const KNOWN_METHODS: [Method; 9] = [
    Method::GET,
    Method::POST,
    Method::PUT,
    Method::DELETE,
    Method::PATCH,
    Method::HEAD,
    Method::OPTIONS,
    Method::CONNECT,
    Method::TRACE,
];

/// The `method` label of a request: one of [`KNOWN_METHODS`], or `other`.
fn method_label(method: &Method) -> &'static str {
    KNOWN_METHODS
        .iter()
        .find(|known| *known == method)
        .map_or("other", Method::as_str)
}

/// The server's metrics.
#[derive(Clone, Debug)]
pub struct Metrics {
    registry: Registry,
    begins: IntCounterVec,
    conflicts: IntCounterVec,
    errors: IntCounterVec,
    takeovers: IntCounter,
    lease_lost: IntCounter,
    replays: IntCounter,
    tool_claims: IntCounterVec,
    unknown_tool_outcomes: IntCounter,
    turn_endings: IntCounterVec,
    live_turns: IntGauge,
    orphaned_turns: IntGauge,
    abandoned_turns: IntGauge,
    cancel_releases: IntGauge,
    request_seconds: HistogramVec,
    busy_begins: IntCounterVec,
    cancel_requests: IntCounter,
    force_releases: IntCounter,
    events_appended: IntCounter,
    event_streams: IntGauge,
    waiting_begins: IntGauge,
    store_steps_in_flight: IntGauge,
    transactions_rolled_back: IntCounter,
    connections_closed: IntCounter,
}

/// The counters the dashboard shows: a snapshot of this process's metrics.
#[derive(Clone, Debug, Default, PartialEq, serde::Serialize)]
pub struct Counters {
    /// Protocol conflicts (409, 422, 429 answers) by error code.
    pub conflicts: BTreeMap<String, u64>,
    /// Begins by outcome (started, takeover, restart, replay, or the code).
    pub begins: BTreeMap<String, u64>,
    /// Begins answered with a stored outcome.
    pub replays: u64,
    /// Turns taken over after their holder's lease expired.
    pub takeovers: u64,
    /// Tool executions handed out again after their holder died mid-call.
    pub unknown_tool_outcomes: u64,
    /// Calls refused because the caller's lease was gone.
    pub lease_lost: u64,
    /// Turn endings by state.
    pub turn_endings: BTreeMap<String, u64>,
    /// Leases this process granted minus turns it ended.
    pub live_turns: i64,
    /// Begins by busy policy and outcome, keyed `"policy outcome"`.
    pub busy_begins: BTreeMap<String, u64>,
    /// Cancel requests received.
    pub cancel_requests: u64,
    /// Sessions force-released that had a holder.
    pub force_releases: u64,
    /// Begins waiting now for a busy session (`wait`, `interrupt`).
    pub waiting_begins: i64,
}

/// A labelled counter's values by its one label.
fn by_label(vec: &IntCounterVec) -> BTreeMap<String, u64> {
    let mut values = BTreeMap::new();
    for family in vec.collect() {
        for metric in family.get_metric() {
            let label = metric
                .get_label()
                .first()
                .map(|pair| pair.value().to_owned())
                .unwrap_or_default();
            // Counters are integers kept as f64 by the exposition format.
            #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
            let value = metric.get_counter().get_value() as u64;
            values.insert(label, value);
        }
    }
    values
}

/// The outcome label of a begin that succeeded under its busy policy:
/// `queued` when the store queued it, `started` when the session was free
/// at once, `started_after_wait` when it waited (or interrupted) first.
pub fn busy_outcome(queued: bool, report: &agentgate::BusyReport) -> &'static str {
    if queued {
        "queued"
    } else if report.attempts > 1 || report.interrupted.is_some() {
        "started_after_wait"
    } else {
        "started"
    }
}

/// A counter with several labels by its label values joined with spaces.
fn by_labels(vec: &IntCounterVec) -> BTreeMap<String, u64> {
    let mut values = BTreeMap::new();
    for family in vec.collect() {
        for metric in family.get_metric() {
            let labels: Vec<&str> = metric.get_label().iter().map(|p| p.value()).collect();
            // Counters are integers kept as f64 by the exposition format.
            #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
            let value = metric.get_counter().get_value() as u64;
            values.insert(labels.join(" "), value);
        }
    }
    values
}

/// How a begin ended, as a metric label.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BeginLabel {
    /// A new turn was started.
    Started,
    /// A running turn whose lease expired was taken over.
    Takeover,
    /// A retryably failed turn was started again.
    Restart,
    /// A stored outcome was replayed.
    Replay,
    /// A recovery worker claimed an orphan (a takeover by another caller).
    OrphanClaim,
    /// The request joined its session's queue (`on_busy: enqueue` or
    /// `supersede`), or a repeat found it still queued.
    Queued,
    /// An ending's caller took the head of its session's queue.
    Handoff,
    /// Refused with this code.
    Refused(ErrorCode),
}

fn build() -> prometheus::Result<Metrics> {
    let registry = Registry::new_custom(Some("agentgate".to_owned()), None)?;
    let begins = IntCounterVec::new(
        Opts::new(
            "begins_total",
            "Begins by outcome: started, takeover, restart, replay, orphan_claim, queued, handoff, or the refusal code",
        ),
        &["outcome"],
    )?;
    let conflicts = IntCounterVec::new(
        Opts::new(
            "conflicts_total",
            "Protocol conflicts (409, 422, 429 answers) by error code",
        ),
        &["code"],
    )?;
    let errors = IntCounterVec::new(
        Opts::new("errors_total", "Every error answer by error code"),
        &["code"],
    )?;
    let takeovers = IntCounter::new(
        "takeovers_total",
        "Turns taken over after their holder's lease expired",
    )?;
    let lease_lost = IntCounter::new(
        "lease_lost_total",
        "Calls refused because the caller's lease was gone",
    )?;
    let replays = IntCounter::new("replays_total", "Begins answered with a stored outcome")?;
    let tool_claims = IntCounterVec::new(
        Opts::new(
            "tool_claims_total",
            "Tool claims by outcome: execute or cached",
        ),
        &["outcome"],
    )?;
    let unknown_tool_outcomes = IntCounter::new(
        "unknown_tool_outcomes_total",
        "Tool executions handed out again after their holder died mid-call (previous_outcome unknown)",
    )?;
    let turn_endings = IntCounterVec::new(
        Opts::new(
            "turn_endings_total",
            "Turn endings by state: succeeded, failed, awaiting_confirmation",
        ),
        &["state"],
    )?;
    let live_turns = IntGauge::new(
        "live_turns",
        "Leases granted by this process minus turns it ended (expired leases are not seen)",
    )?;
    let request_seconds = HistogramVec::new(
        HistogramOpts::new(
            "http_request_duration_seconds",
            "Request latency by route template",
        )
        .buckets(LATENCY_BUCKETS_SECONDS.to_vec()),
        &["method", "route", "status"],
    )?;
    registry.register(Box::new(begins.clone()))?;
    registry.register(Box::new(conflicts.clone()))?;
    registry.register(Box::new(errors.clone()))?;
    registry.register(Box::new(takeovers.clone()))?;
    registry.register(Box::new(lease_lost.clone()))?;
    registry.register(Box::new(replays.clone()))?;
    registry.register(Box::new(tool_claims.clone()))?;
    registry.register(Box::new(unknown_tool_outcomes.clone()))?;
    registry.register(Box::new(turn_endings.clone()))?;
    registry.register(Box::new(live_turns.clone()))?;
    let orphaned_turns = IntGauge::new(
        "orphaned_turns",
        "Running turns whose lease expired without an ending, as the store lists them at scrape (at most 128)",
    )?;
    registry.register(Box::new(orphaned_turns.clone()))?;
    let abandoned_turns = IntGauge::new(
        "turns_abandoned",
        "Orphans this node's sweeper ended abandoned (unclaimed past the orphan grace) since it started",
    )?;
    registry.register(Box::new(abandoned_turns.clone()))?;
    let cancel_releases = IntGauge::new(
        "turns_released_after_ignored_cancel",
        "Running turns this node's sweeper force-released because they were asked to stop and did not end within the cancel grace, since it started",
    )?;
    registry.register(Box::new(cancel_releases.clone()))?;
    registry.register(Box::new(request_seconds.clone()))?;
    let busy_begins = IntCounterVec::new(
        Opts::new(
            "busy_begins_total",
            "Begins by busy policy (reject, wait, interrupt, enqueue, supersede) and outcome: started (or replayed) with the session free, started_after_wait, queued, timed_out (session_busy after waiting, or at once for reject), refused (another error: queue_full among them)",
        ),
        &["policy", "outcome"],
    )?;
    registry.register(Box::new(busy_begins.clone()))?;
    let cancel_requests = IntCounter::new(
        "cancel_requests_total",
        "Cancel requests received (POST /v1/turns/{id}/cancel), repeats included",
    )?;
    registry.register(Box::new(cancel_requests.clone()))?;
    let force_releases = IntCounter::new(
        "force_releases_total",
        "Sessions force-released (POST /v1/sessions/{id}/release) that had a holder",
    )?;
    registry.register(Box::new(force_releases.clone()))?;
    let events_appended = IntCounter::new(
        "events_appended_total",
        "Turn events appended (POST /v1/turns/{id}/events)",
    )?;
    registry.register(Box::new(events_appended.clone()))?;
    let event_streams = IntGauge::new(
        "event_streams",
        "Event streams open now on this node (GET /v1/turns/{id}/events)",
    )?;
    registry.register(Box::new(event_streams.clone()))?;
    let waiting_begins = IntGauge::new(
        "waiting_begins",
        "Begins waiting now on this node for a busy session to be released (on_busy wait, or interrupt while the holder stops)",
    )?;
    registry.register(Box::new(waiting_begins.clone()))?;
    let store_steps_in_flight = IntGauge::new(
        "store_steps_in_flight",
        "Store steps running now on this node, their callers waiting or not (a step runs to its end whoever stops waiting)",
    )?;
    registry.register(Box::new(store_steps_in_flight.clone()))?;
    let transactions_rolled_back = IntCounter::new(
        "store_transactions_dropped_rolled_back_total",
        "SQL step transactions dropped open (a failed or cut-off step) whose connection was rolled back and pooled again",
    )?;
    registry.register(Box::new(transactions_rolled_back.clone()))?;
    let connections_closed = IntCounter::new(
        "store_transactions_dropped_closed_total",
        "SQL step transactions dropped open whose connection was closed because its rollback failed or took too long",
    )?;
    registry.register(Box::new(connections_closed.clone()))?;
    Ok(Metrics {
        registry,
        begins,
        conflicts,
        errors,
        takeovers,
        lease_lost,
        replays,
        tool_claims,
        unknown_tool_outcomes,
        turn_endings,
        live_turns,
        orphaned_turns,
        abandoned_turns,
        cancel_releases,
        request_seconds,
        busy_begins,
        cancel_requests,
        force_releases,
        events_appended,
        event_streams,
        waiting_begins,
        store_steps_in_flight,
        transactions_rolled_back,
        connections_closed,
    })
}

impl Metrics {
    /// A fresh registry with every metric registered.
    pub fn new() -> Self {
        build().expect("metric names and labels are static and valid, registered once each")
    }

    /// Sets the orphan gauges before a scrape: `orphaned` as the store
    /// lists them now, `abandoned` and `released` (after an ignored cancel)
    /// as this node's sweeper counted them.
    pub fn set_orphans(&self, orphaned: usize, abandoned: u64, released: u64) {
        self.orphaned_turns
            .set(i64::try_from(orphaned).unwrap_or(i64::MAX));
        self.abandoned_turns
            .set(i64::try_from(abandoned).unwrap_or(i64::MAX));
        self.cancel_releases
            .set(i64::try_from(released).unwrap_or(i64::MAX));
    }

    /// Sets the waiting begins' gauge (the gate's count) before a scrape
    /// or a dashboard read.
    pub fn set_waiting_begins(&self, waiting: usize) {
        self.waiting_begins
            .set(i64::try_from(waiting).unwrap_or(i64::MAX));
    }

    /// Sets the store's step gauges before a scrape: steps in flight (the
    /// gate's count) and the process's dropped transactions, whose counters
    /// only ever move up to the process-wide totals.
    pub fn set_store_steps(&self, in_flight: usize, dropped: agentgate::gate::DroppedTransactions) {
        self.store_steps_in_flight
            .set(i64::try_from(in_flight).unwrap_or(i64::MAX));
        for (counter, total) in [
            (&self.transactions_rolled_back, dropped.rolled_back),
            (&self.connections_closed, dropped.closed),
        ] {
            counter.inc_by(total.saturating_sub(counter.get()));
        }
    }

    /// Records a begin's outcome.
    pub fn begin(&self, label: BeginLabel) {
        let outcome = match label {
            BeginLabel::Started => "started",
            BeginLabel::Takeover => "takeover",
            BeginLabel::Restart => "restart",
            BeginLabel::Replay => "replay",
            BeginLabel::OrphanClaim => "orphan_claim",
            BeginLabel::Queued => "queued",
            BeginLabel::Handoff => "handoff",
            BeginLabel::Refused(code) => code.as_str(),
        };
        self.begins.with_label_values(&[outcome]).inc();
        match label {
            BeginLabel::Started | BeginLabel::Restart | BeginLabel::Handoff => {
                self.live_turns.inc()
            }
            BeginLabel::Takeover | BeginLabel::OrphanClaim => {
                self.takeovers.inc();
                self.live_turns.inc();
            }
            BeginLabel::Replay => self.replays.inc(),
            BeginLabel::Queued | BeginLabel::Refused(_) => {}
        }
    }

    /// Records a tool claim: `cached`, or `execute` with whether the previous
    /// attempt's outcome is unknown.
    pub fn tool_claim(&self, executed: bool, unknown_previous: bool) {
        let outcome = if executed { "execute" } else { "cached" };
        self.tool_claims.with_label_values(&[outcome]).inc();
        if unknown_previous {
            self.unknown_tool_outcomes.inc();
        }
    }

    /// Records a turn ending in `state`.
    pub fn turn_ended(&self, state: &str) {
        self.turn_endings.with_label_values(&[state]).inc();
        self.live_turns.dec();
    }

    /// Records a begin's outcome under its busy policy.
    pub fn busy_begin(&self, policy: agentgate::BusyPolicy, outcome: &str) {
        self.busy_begins
            .with_label_values(&[policy.as_str(), outcome])
            .inc();
    }

    /// Records a cancel request.
    pub fn cancel_requested(&self) {
        self.cancel_requests.inc();
    }

    /// Records a force-release that ended a holder.
    pub fn force_released(&self) {
        self.force_releases.inc();
    }

    /// Records `count` events appended.
    pub fn events_appended(&self, count: usize) {
        self.events_appended.inc_by(count as u64);
    }

    /// Records an event stream opened.
    pub fn event_stream_opened(&self) {
        self.event_streams.inc();
    }

    /// Records an event stream closed.
    pub fn event_stream_closed(&self) {
        self.event_streams.dec();
    }

    fn error(&self, code: ErrorCode) {
        self.errors.with_label_values(&[code.as_str()]).inc();
        if code.is_conflict() {
            self.conflicts.with_label_values(&[code.as_str()]).inc();
        }
        if code == ErrorCode::LeaseLost {
            self.lease_lost.inc();
        }
    }

    /// The dashboard's counters, as of now.
    pub fn counters(&self) -> Counters {
        Counters {
            conflicts: by_label(&self.conflicts),
            begins: by_label(&self.begins),
            replays: self.replays.get(),
            takeovers: self.takeovers.get(),
            unknown_tool_outcomes: self.unknown_tool_outcomes.get(),
            lease_lost: self.lease_lost.get(),
            turn_endings: by_label(&self.turn_endings),
            live_turns: self.live_turns.get(),
            busy_begins: by_labels(&self.busy_begins),
            cancel_requests: self.cancel_requests.get(),
            force_releases: self.force_releases.get(),
            waiting_begins: self.waiting_begins.get(),
        }
    }

    /// The Prometheus text exposition of every metric.
    pub fn render(&self) -> String {
        let mut text = String::new();
        if let Err(error) = TextEncoder::new().encode_utf8(&self.registry.gather(), &mut text) {
            tracing::error!(%error, "cannot encode metrics");
        }
        text
    }
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

/// The content type of [`Metrics::render`].
pub const CONTENT_TYPE: &str = prometheus::TEXT_FORMAT;

/// Middleware: latency by route template and errors by code.
pub(crate) async fn track(State(state): State<AppState>, request: Request, next: Next) -> Response {
    let started = Instant::now();
    let method = method_label(request.method());
    // The template (`/v1/turns/{turn_id}`), never the raw path: ids in
    // labels would grow the registry without bound.
    let route = request
        .extensions()
        .get::<MatchedPath>()
        .map_or("unmatched", MatchedPath::as_str)
        .to_owned();
    let response = next.run(request).await;
    let metrics = state.metrics();
    if let Some(code) = response.extensions().get::<ErrorCode>() {
        metrics.error(*code);
    }
    let status = response.status();
    metrics
        .request_seconds
        .with_label_values(&[method, route.as_str(), status.as_str()])
        .observe(started.elapsed().as_secs_f64());
    tracing::debug!(%method, %route, status = status.as_u16(), elapsed_ms = started.elapsed().as_millis() as u64, "request");
    response
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    /// The dropped-transaction counters follow the process-wide totals
    /// they are given, and the steps gauge is set as given.
    #[test]
    fn store_step_metrics_follow_the_totals() {
        let metrics = Metrics::new();
        let totals = |rolled_back, closed| agentgate::gate::DroppedTransactions {
            rolled_back,
            closed,
        };
        metrics.set_store_steps(3, totals(5, 1));
        metrics.set_store_steps(2, totals(7, 1));
        let text = metrics.render();
        assert!(
            text.contains("\nagentgate_store_steps_in_flight 2\n"),
            "{text}"
        );
        assert!(
            text.contains("\nagentgate_store_transactions_dropped_rolled_back_total 7\n"),
            "{text}"
        );
        assert!(
            text.contains("\nagentgate_store_transactions_dropped_closed_total 1\n"),
            "{text}"
        );
    }

    #[test]
    fn counters_snapshot_what_was_recorded() {
        let metrics = Metrics::new();
        assert_eq!(metrics.counters(), Counters::default());
        metrics.begin(BeginLabel::Started);
        metrics.begin(BeginLabel::Takeover);
        metrics.begin(BeginLabel::Replay);
        metrics.begin(BeginLabel::Refused(ErrorCode::SessionBusy));
        metrics.error(ErrorCode::SessionBusy);
        metrics.error(ErrorCode::SessionBusy);
        metrics.error(ErrorCode::NotFound);
        metrics.tool_claim(true, true);
        metrics.turn_ended("succeeded");
        let counters = metrics.counters();
        assert_eq!(counters.conflicts.get("session_busy"), Some(&2));
        assert_eq!(counters.conflicts.get("not_found"), None, "not a conflict");
        assert_eq!(counters.begins.get("takeover"), Some(&1));
        assert_eq!((counters.replays, counters.takeovers), (1, 1));
        assert_eq!(counters.unknown_tool_outcomes, 1);
        assert_eq!(counters.turn_endings.get("succeeded"), Some(&1));
        assert_eq!(counters.live_turns, 1, "two grants, one ending");
        metrics.busy_begin(agentgate::BusyPolicy::Wait, "started");
        metrics.cancel_requested();
        let counters = metrics.counters();
        // Labels in the registry's order: outcome, then policy.
        assert_eq!(counters.busy_begins.get("started wait"), Some(&1));
        assert_eq!(counters.cancel_requests, 1);
    }

    #[test]
    fn invented_methods_share_one_label() {
        assert_eq!(method_label(&Method::POST), "POST");
        assert_eq!(method_label(&Method::OPTIONS), "OPTIONS");
        let invented = Method::from_bytes(b"BREW").unwrap();
        assert_eq!(method_label(&invented), "other");
    }
}
