//! The contention storm: many concurrent duplicate begins of one request,
//! released together by a barrier. Exactly one may start the turn; every
//! other one must be told `request_in_flight`. Measured: the time until
//! every begin is answered, the 99th percentile of their latencies, and how
//! the answers split.

use std::collections::BTreeMap;
use std::sync::Arc;

use agentgate::{Begun, Gate};
use serde::Serialize;
use tokio::sync::Barrier;
use tokio::task::JoinSet;
use tokio::time::Instant;

use crate::error::{BenchError, Result};
use crate::http;
use crate::library::Bodies;
use crate::limits::STORM_TIMEOUT;
use crate::stats::{millis, Samples};
use crate::workload::next_request;

/// What a storm measured.
#[derive(Clone, Debug, Default, Serialize)]
pub struct StormReport {
    /// Duplicate begins sent.
    pub requests: usize,
    /// From the first begin sent to the last one answered, in ms.
    pub all_answered_ms: f64,
    /// 99th percentile of one begin's latency, in ms.
    pub p99_ms: f64,
    /// Begins that started the turn: must be exactly 1.
    pub started: usize,
    /// Every answer by its code (`started`, `request_in_flight`, …).
    pub outcomes: BTreeMap<String, usize>,
}

/// Runs `count` tasks that each call `begin` once, released together.
async fn storm<F, Fut, T>(count: usize, begin: F) -> Result<Vec<(Instant, Instant, T)>>
where
    F: Fn() -> Fut,
    Fut: std::future::Future<Output = T> + Send + 'static,
    T: Send + 'static,
{
    let barrier = Arc::new(Barrier::new(count));
    let mut tasks = JoinSet::new();
    for _ in 0..count {
        let barrier = Arc::clone(&barrier);
        let call = begin();
        tasks.spawn(async move {
            barrier.wait().await;
            let sent = Instant::now();
            let answer = call.await;
            (sent, Instant::now(), answer)
        });
    }
    let mut answers = Vec::with_capacity(count);
    let joined = tokio::time::timeout(STORM_TIMEOUT, async {
        while let Some(joined) = tasks.join_next().await {
            answers.push(
                joined.map_err(|e| BenchError::unexpected(format!("a storm task failed: {e}")))?,
            );
        }
        Ok::<_, BenchError>(())
    })
    .await;
    match joined {
        Ok(result) => result?,
        Err(_) => {
            return Err(BenchError::unexpected(format!(
                "the storm was not answered within {} s",
                STORM_TIMEOUT.as_secs()
            )))
        }
    }
    Ok(answers)
}

fn report<T>(answers: &[(Instant, Instant, T)], code: impl Fn(&T) -> String) -> StormReport {
    let mut latencies = Samples::default();
    let mut outcomes = BTreeMap::new();
    let first_sent = answers.iter().map(|(sent, _, _)| *sent).min();
    let last_answered = answers.iter().map(|(_, answered, _)| *answered).max();
    for (sent, answered, answer) in answers {
        latencies.push(*answered - *sent);
        *outcomes.entry(code(answer)).or_insert(0) += 1;
    }
    StormReport {
        requests: answers.len(),
        all_answered_ms: match (first_sent, last_answered) {
            (Some(first), Some(last)) => millis(last - first),
            _ => 0.0,
        },
        p99_ms: latencies.summary().p99_ms,
        started: outcomes.get("started").copied().unwrap_or(0),
        outcomes,
    }
}

/// A storm through the library.
///
/// # Errors
/// When the storm is not answered in time, or ending the started turn fails.
pub(crate) async fn library(gate: &Gate, count: usize) -> Result<StormReport> {
    let request = format!("storm-{}", next_request());
    let payload = Bodies::default().payload;
    let answers = storm(count, || {
        let (gate, request, payload) = (gate.clone(), request.clone(), payload.clone());
        async move {
            gate.begin("bench-storm-u", "bench-storm-s", &request, &payload)
                .await
        }
    })
    .await?;
    let summary = report(&answers, |answer| match answer {
        Ok(Begun::Started(_)) => "started".to_owned(),
        Ok(Begun::Replay(_)) => "replay".to_owned(),
        Ok(Begun::Queued(_)) => "queued".to_owned(),
        Err(error) => error.kind().code().to_owned(),
    });
    for (_, _, answer) in answers {
        if let Ok(Begun::Started(turn)) = answer {
            turn.succeed(&Bodies::default().response)
                .await
                .map_err(agentgate::Error::from)?;
        }
    }
    Ok(summary)
}

/// A storm over HTTP, one connection per begin.
///
/// # Errors
/// As [`library`]; `Http` when the client cannot be built.
pub(crate) async fn over_http(base: &str, count: usize) -> Result<StormReport> {
    let client = http::client(count)?;
    let request = format!("storm-{}", next_request());
    let payload = Bodies::default().payload;
    let answers = storm(count, || {
        let (client, base, request, payload) = (
            client.clone(),
            base.to_owned(),
            request.clone(),
            payload.clone(),
        );
        async move {
            http::begin(
                &client,
                &base,
                "bench-storm-u",
                "bench-storm-s",
                &request,
                &payload,
            )
            .await
        }
    })
    .await?;
    let summary = report(&answers, |answer| match answer {
        Ok(Ok(_)) => "started".to_owned(),
        Ok(Err((_, code))) => code.clone(),
        Err(error) => format!("transport: {error}"),
    });
    for (_, _, answer) in answers {
        if let Ok(Ok(lease)) = answer {
            http::succeed(&client, base, &lease, &Bodies::default().response).await?;
        }
    }
    Ok(summary)
}
