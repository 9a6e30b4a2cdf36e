//! What a run measured: one [`Report`], printed as one JSON object
//! (`--json`, for scripts) or as a short table for people.

use std::fmt::Write as _;

use serde::Serialize;

use crate::counting::RoundTrips;
use crate::machine::Machine;
use crate::stats::StepLatency;
use crate::storm::StormReport;
use crate::Via;

/// Latencies of the engine's four steps.
#[derive(Clone, Copy, Debug, Default, Serialize)]
pub struct EngineSteps {
    /// `begin`: lease, permit and turn record.
    pub begin: StepLatency,
    /// The tool claim.
    pub tool_claim: StepLatency,
    /// The tool completion.
    pub tool_complete: StepLatency,
    /// `succeed`: the ending and the release.
    pub succeed: StepLatency,
}

/// Latencies of the raw baseline's four statements.
#[derive(Clone, Copy, Debug, Default, Serialize)]
pub struct RawSteps {
    /// Conditional-UPDATE (or `SET NX PX`) lease acquire.
    pub lease_acquire: StepLatency,
    /// Tool-row insert.
    pub tool_insert: StepLatency,
    /// Tool-row update.
    pub tool_update: StepLatency,
    /// Owner-checked release (or compare-and-delete script).
    pub lease_release: StepLatency,
}

/// Per-turn cost at a small and a large pre-populated store.
#[derive(Clone, Copy, Debug, Default, Serialize)]
pub struct Scaling {
    /// Sessions (each with one finished turn) during the main measurement.
    pub small_sessions: u64,
    /// Sessions during the scaling measurement.
    pub large_sessions: u64,
    /// Turns/s at `small_sessions` (a block of its own, just before populating).
    pub small_turns_per_s: f64,
    /// Turns/s at `large_sessions`.
    pub large_turns_per_s: f64,
    /// Per-turn cost at `large_sessions` ÷ at `small_sessions`
    /// (= small ÷ large turns/s at the same concurrency); 1.0 is flat.
    pub cost_ratio: f64,
    /// Seconds spent inserting the extra rows.
    pub populate_s: f64,
}

/// `agentgate serve`'s memory while many turns are live.
#[derive(Clone, Copy, Debug, Default, Serialize)]
pub struct Memory {
    /// Turns begun (on distinct sessions and users) and left live.
    pub live_turns: usize,
    /// `VmHWM`: the process's peak resident set, MiB.
    pub peak_rss_mib: f64,
    /// `VmRSS` with the turns live, MiB.
    pub rss_mib: f64,
    /// Seconds it took to begin them all.
    pub begin_s: f64,
}

/// Everything one run measured.
#[derive(Clone, Debug, Serialize)]
pub struct Report {
    /// `sqlite`, `postgres` or `mysql`, with `+redis` for the lease layer.
    pub store: String,
    /// The store without credentials, and the run's own database.
    pub store_label: String,
    /// How the turn loop reached the engine.
    pub via: Via,
    /// Concurrent clients, each on its own session and user.
    pub concurrency: usize,
    /// Measured seconds per loop (split over `rounds`).
    pub duration_s: f64,
    /// Alternating rounds the loops were interleaved in.
    pub rounds: u32,
    /// Turns/s of the chosen `via`.
    pub turns_per_s: f64,
    /// Turns/s of the raw baseline.
    pub raw_turns_per_s: f64,
    /// `turns_per_s` ÷ `raw_turns_per_s`.
    pub ratio: f64,
    /// Turns/s through the library (equal to `turns_per_s` for library runs).
    pub library_turns_per_s: f64,
    /// `library_turns_per_s` ÷ `raw_turns_per_s`.
    pub library_ratio: f64,
    /// HTTP turns/s ÷ library turns/s (HTTP runs).
    pub http_to_library: Option<f64>,
    /// Round trips per full turn of the engine, counted (SQL + Redis).
    pub round_trips_per_turn: Option<f64>,
    /// Round trips per raw turn, counted.
    pub raw_round_trips_per_turn: Option<f64>,
    /// The counts in detail and how they were made.
    pub round_trips: RoundTrips,
    /// Step latencies of the chosen `via`.
    pub steps: EngineSteps,
    /// Step latencies through the library (HTTP runs measure both).
    pub library_steps: EngineSteps,
    /// Step latencies of the raw baseline.
    pub raw_steps: RawSteps,
    /// Time until all duplicate begins of the storm were answered, ms.
    pub storm_ms: f64,
    /// 99th percentile of one storm begin, ms.
    pub storm_p99_ms: f64,
    /// Storm begins that started the turn (must be 1).
    pub storm_started: usize,
    /// The storm in detail.
    pub storm: StormReport,
    /// Per-turn cost ratio at `scaling.large_sessions` vs `small_sessions`.
    pub scaling_ratio: Option<f64>,
    /// The scaling measurement in detail.
    pub scaling: Option<Scaling>,
    /// Peak RSS of `agentgate serve` with `memory.live_turns` live turns (HTTP runs).
    pub peak_rss_mib: Option<f64>,
    /// The memory measurement in detail.
    pub memory: Option<Memory>,
    /// The ingestion row (SQLite and PostgreSQL).
    pub ingestion: Option<crate::ingest::Ingestion>,
    /// The wake row: a waiting begin after the holder ends.
    pub wake: Option<crate::wake::Wake>,
    /// The queue row: a conversation drained through enqueue and handoffs.
    pub queue: Option<crate::queue::QueueRow>,
    /// The events row: many followers of one turn's event log.
    pub events: Option<crate::events::EventsRow>,
    /// The machine the run was on.
    pub machine: Machine,
}

fn latency(name: &str, step: &StepLatency) -> String {
    format!(
        "  {name:<16} p50 {:>8.3} ms   p99 {:>8.3} ms\n",
        step.p50_ms, step.p99_ms
    )
}

fn optional(value: Option<f64>, digits: usize) -> String {
    value.map_or_else(|| "n/a".to_owned(), |v| format!("{v:.digits$}"))
}

impl Report {
    /// The report as a short text for people.
    pub fn to_text(&self) -> String {
        let mut text = String::new();
        let via = match self.via {
            Via::Library => "library",
            Via::Http => "http",
        };
        let _ = writeln!(
            text,
            "agentgate bench: {} via {via}, {} clients, {:.1} s per loop in {} rounds",
            self.store_label, self.concurrency, self.duration_s, self.rounds
        );
        let _ = writeln!(text, "  machine: {}", self.machine.summary());
        let _ = writeln!(
            text,
            "\nturns/s   {via}: {:.0}   raw baseline: {:.0}   ratio: {:.2}",
            self.turns_per_s, self.raw_turns_per_s, self.ratio
        );
        if let Some(http_to_library) = self.http_to_library {
            let _ = writeln!(
                text,
                "          library: {:.0} (ratio {:.2})   http / library: {http_to_library:.2}",
                self.library_turns_per_s, self.library_ratio
            );
        }
        let counts = &self.round_trips;
        let _ = writeln!(
            text,
            "round trips per turn   engine: {} (sql {} incl. {} pool pings, redis {}, sqlx statements {})   raw: {} (incl. {} pool pings)",
            optional(counts.engine.round_trips_per_turn, 1),
            optional(counts.engine.sql_round_trips_per_turn, 1),
            optional(counts.engine.sql_pings_per_turn, 1),
            optional(counts.engine.redis_round_trips_per_turn, 1),
            optional(counts.engine.statements_per_turn, 1),
            optional(counts.raw.round_trips_per_turn, 1),
            optional(counts.raw.sql_pings_per_turn, 1),
        );
        let _ = writeln!(text, "  counted by: {}", counts.method);
        let _ = writeln!(text, "\nengine steps ({via}):");
        for (name, step) in [
            ("begin", &self.steps.begin),
            ("tool claim", &self.steps.tool_claim),
            ("tool complete", &self.steps.tool_complete),
            ("succeed", &self.steps.succeed),
        ] {
            text.push_str(&latency(name, step));
        }
        let _ = writeln!(text, "raw steps:");
        for (name, step) in [
            ("lease acquire", &self.raw_steps.lease_acquire),
            ("tool insert", &self.raw_steps.tool_insert),
            ("tool update", &self.raw_steps.tool_update),
            ("lease release", &self.raw_steps.lease_release),
        ] {
            text.push_str(&latency(name, step));
        }
        let _ = writeln!(
            text,
            "\nstorm: {} duplicate begins answered in {:.1} ms (p99 {:.1} ms), started {} {:?}",
            self.storm.requests,
            self.storm_ms,
            self.storm_p99_ms,
            self.storm_started,
            self.storm.outcomes
        );
        match &self.scaling {
            Some(s) => {
                let _ = writeln!(
                    text,
                    "scaling: {} -> {} sessions: {:.0} -> {:.0} turns/s, cost ratio {:.2} (populated in {:.1} s)",
                    s.small_sessions,
                    s.large_sessions,
                    s.small_turns_per_s,
                    s.large_turns_per_s,
                    s.cost_ratio,
                    s.populate_s
                );
            }
            None => text.push_str("scaling: skipped\n"),
        }
        match &self.memory {
            Some(m) => {
                let _ = writeln!(
                    text,
                    "memory: agentgate serve with {} live turns: peak RSS {:.1} MiB (now {:.1} MiB; begun in {:.1} s)",
                    m.live_turns, m.peak_rss_mib, m.rss_mib, m.begin_s
                );
            }
            None => text.push_str("memory: measured on --via http runs only\n"),
        }
        match &self.ingestion {
            Some(i) => {
                let _ = writeln!(
                    text,
                    "ingestion: {} documents of {} chunks: {:.0} chunks/s, raw loop {:.0} chunks/s, ratio {:.2}; {} texts embedded",
                    i.documents, i.chunks_per_document, i.chunks_per_s, i.raw_chunks_per_s, i.ratio, i.texts_embedded
                );
            }
            None => text.push_str("ingestion: skipped (0 documents, or MySQL)\n"),
        }
        match &self.wake {
            Some(w) => {
                let raw = w.raw_notify.as_ref().map_or_else(
                    || "no raw notification on this store".to_owned(),
                    |r| {
                        format!(
                            "raw notification p50 {:.2} / p99 {:.2} ms",
                            r.p50_ms, r.p99_ms
                        )
                    },
                );
                let _ = writeln!(
                    text,
                    "wake ({} rounds): ending → waiter granted, same node p50 {:.2} / p99 {:.2} ms, other node p50 {:.2} / p99 {:.2} ms ({} woken by a notification); {raw}",
                    w.rounds,
                    w.same_node.p50_ms,
                    w.same_node.p99_ms,
                    w.other_node.p50_ms,
                    w.other_node.p99_ms,
                    w.other_node_woken
                );
            }
            None => text.push_str("wake: skipped (0 rounds)\n"),
        }
        match &self.queue {
            Some(q) => {
                let _ = writeln!(
                    text,
                    "queue ({} messages): drained through handoffs {:.0} turns/s, plain begins {:.0} turns/s, ratio {:.2}; enqueue p50 {:.2} / p99 {:.2} ms",
                    q.messages,
                    q.drained_turns_per_s,
                    q.plain_turns_per_s,
                    q.ratio,
                    q.enqueue.p50_ms,
                    q.enqueue.p99_ms
                );
            }
            None => text.push_str("queue: skipped (0 messages)\n"),
        }
        match &self.events {
            Some(e) => {
                let mib = |v: Option<f64>| v.map_or("n/a".to_owned(), |v| format!("{v:.1} MiB"));
                let _ = writeln!(
                    text,
                    "events ({} followers on another node, {} events): delivery p50 {:.2} / p99 {:.2} ms{}; RSS {} before, {} following; store connections {}; feeds {}",
                    e.subscribers,
                    e.events,
                    e.delivery.p50_ms,
                    e.delivery.p99_ms,
                    match (&e.raw_notify, e.delivery_to_raw_p50) {
                        (Some(raw), Some(ratio)) => format!(
                            " (raw notify p50 {:.2} ms, ratio {ratio:.1})",
                            raw.p50_ms
                        ),
                        _ => " (no raw notification on this store)".to_owned(),
                    },
                    mib(e.rss_before_mib),
                    mib(e.rss_following_mib),
                    e.store_connections
                        .map_or("n/a".to_owned(), |c| c.to_string()),
                    e.feeds
                );
            }
            None => text.push_str("events: skipped (0 followers)\n"),
        }
        text
    }
}
