//! Criterion micro-benchmarks of the engine's hot pure functions: what every
//! protocol step computes before (or without) touching the store.
//!
//! - `canonical_digest/*`: RFC 8785 canonicalisation + SHA-256
//!   (`agentgate_core::canonical::digest`), the payload fingerprint of every
//!   begin and the args hash of every tool claim, on a chat-sized payload
//!   and on a ~10 KB one.
//! - `decide_begin/*`: the begin table (docs/protocol.md §3.1) for a new request, a replay, and a
//!   refusal (session busy).
//! - `decide_tool_claim/*`: a first claim and a cached one.
//!
//! Run with `cargo bench -p agentgate-bench --bench pure`.
#![forbid(unsafe_code)]

use std::hint::black_box;

use agentgate_core::canonical::digest;
use agentgate_core::decide::{
    decide_begin, decide_tool_claim, BeginFacts, ExecutionSnapshot, HolderSnapshot,
    SessionSnapshot, TurnSnapshot, UserLoad,
};
use agentgate_core::ids::Fence;
use agentgate_core::model::{ToolState, TurnState};
use criterion::{criterion_main, Criterion, Throughput};
use serde_json::{json, Value};

/// A chat message as an agent backend sends it.
fn small_payload() -> Value {
    json!({"text": "中午吃粉花了 35", "locale": "zh-CN", "client": {"app": "web", "version": 3}})
}

/// About 10 KB: a message with a long history excerpt and tool arguments.
fn large_payload() -> Value {
    let history: Vec<Value> = (0..75)
        .map(|i| {
            json!({
                "role": if i % 2 == 0 { "user" } else { "assistant" },
                "text": format!("message {i}: taxi 18 yesterday, lunch 35 today, coffee 4.50"),
                "amount": 18.5 + f64::from(i),
                "tags": ["expense", "transport", i],
            })
        })
        .collect();
    json!({"text": "summarise my week", "history": history})
}

fn canonical(c: &mut Criterion) {
    let mut group = c.benchmark_group("canonical_digest");
    for (name, value) in [("small", small_payload()), ("10kb", large_payload())] {
        let bytes = serde_json::to_string(&value).map_or(0, |text| text.len());
        group.throughput(Throughput::Bytes(bytes as u64));
        group.bench_function(name, |b| b.iter(|| digest("payload", black_box(&value))));
    }
    group.finish();
}

const NOW_MS: i64 = 1_700_000_000_000;

fn facts<'a>(
    session: Option<&'a SessionSnapshot>,
    turn: Option<&'a TurnSnapshot>,
) -> BeginFacts<'a> {
    BeginFacts {
        now_ms: NOW_MS,
        user_id: "alice",
        session_id: "chat-1",
        fingerprint: "f1",
        confirms: None,
        session,
        turn,
        confirm_target: None,
        continuation: None,
        load: UserLoad {
            cap: 5,
            live: 1,
            soonest_expiry_ms: Some(NOW_MS + 10_000),
        },
        resume_only: false,
        queue: agentgate_core::decide::QueueFacts::default(),
        enqueue: None,
    }
}

fn begin(c: &mut Criterion) {
    let idle = SessionSnapshot {
        user_id: "alice".to_owned(),
        holder: None,
        pending: None,
    };
    let busy = SessionSnapshot {
        holder: Some(HolderSnapshot {
            turn_id: "turn_other".to_owned(),
            lease_expires_at_ms: NOW_MS + 20_000,
        }),
        ..idle.clone()
    };
    let succeeded = TurnSnapshot {
        turn_id: "turn_1".to_owned(),
        session_id: "chat-1".to_owned(),
        fingerprint: "f1".to_owned(),
        state: TurnState::Succeeded,
        attempt: 1,
        retryable: false,
        confirmed_by: None,
    };
    let mut group = c.benchmark_group("decide_begin");
    group.bench_function("new_request", |b| {
        b.iter(|| decide_begin(black_box(&facts(Some(&idle), None))))
    });
    group.bench_function("replay", |b| {
        b.iter(|| decide_begin(black_box(&facts(Some(&idle), Some(&succeeded)))))
    });
    group.bench_function("session_busy", |b| {
        b.iter(|| decide_begin(black_box(&facts(Some(&busy), None))))
    });
    group.finish();
}

fn tool_claim(c: &mut Criterion) {
    let done = ExecutionSnapshot {
        execution_id: "exec_1".to_owned(),
        state: ToolState::Succeeded,
        attempt: 1,
        fence: Fence(7),
    };
    let mut group = c.benchmark_group("decide_tool_claim");
    group.bench_function("first_claim", |b| {
        b.iter(|| decide_tool_claim(black_box(None), None, Fence(7), NOW_MS + 30_000, NOW_MS))
    });
    group.bench_function("cached", |b| {
        b.iter(|| {
            decide_tool_claim(
                black_box(Some(&done)),
                None,
                Fence(7),
                NOW_MS + 30_000,
                NOW_MS,
            )
        })
    });
    group.finish();
}

mod group {
    //! The group `criterion_main!` runs (in a module: the macro's `pub fn`
    //! is then not part of the binary's surface).
    use super::{begin, canonical, tool_claim};
    criterion::criterion_group!(pure, canonical, begin, tool_claim);
}

criterion_main!(group::pure);
