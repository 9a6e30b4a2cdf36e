//! The OpenAI-compatible embedder against a real HTTP server on loopback:
//! answers decoded in order and normalised, a failing API asked again
//! inside the ingestion, and answers that break their bounds refused.

#![allow(clippy::unwrap_used)]

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use agentgate::Config;
use agentgate_conformance::targets;
use agentgate_ingest::{Embedder, HttpEmbedder, Ingestor, MediaType, Upload};
use axum::extract::State;
use axum::http::StatusCode;
use axum::routing::post;
use axum::{Json, Router};
use serde_json::{json, Value};

/// How the fake API answers.
#[derive(Clone, Copy)]
enum Mode {
    /// 503 on the first call, then embeddings.
    FailFirst,
    /// Vectors of two lengths in one answer.
    MixedDimensions,
    /// An answer far over any batch's bound.
    Huge,
}

#[derive(Clone)]
struct Api {
    mode: Mode,
    calls: Arc<AtomicUsize>,
}

async fn embeddings(State(api): State<Api>, Json(body): Json<Value>) -> (StatusCode, String) {
    let call = api.calls.fetch_add(1, Ordering::SeqCst);
    let inputs = body["input"].as_array().cloned().unwrap_or_default();
    match api.mode {
        Mode::FailFirst if call == 0 => (StatusCode::SERVICE_UNAVAILABLE, "busy".into()),
        Mode::Huge => (
            StatusCode::OK,
            format!("{{\"data\":[{}]}}", " ".repeat(50_000_000)),
        ),
        mode => {
            // Listed out of order: the client sorts by index.
            let data: Vec<Value> = inputs
                .iter()
                .enumerate()
                .rev()
                .map(|(i, _)| {
                    let len = if matches!(mode, Mode::MixedDimensions) && i == 1 {
                        3
                    } else {
                        4
                    };
                    json!({ "index": i, "embedding": vec![2.0; len] })
                })
                .collect();
            (StatusCode::OK, json!({ "data": data }).to_string())
        }
    }
}

async fn serve(mode: Mode) -> (String, Arc<AtomicUsize>) {
    let calls = Arc::new(AtomicUsize::new(0));
    let app = Router::new()
        .route("/v1/embeddings", post(embeddings))
        .with_state(Api {
            mode,
            calls: calls.clone(),
        });
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let address = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    (format!("http://{address}/v1"), calls)
}

#[tokio::test]
async fn answers_are_ordered_and_normalised() {
    let (url, calls) = serve(Mode::FailFirst).await;
    let embedder = HttpEmbedder::new(&url, "test-model", Some("key".into())).unwrap();
    let first = embedder.embed(&["a".into(), "b".into()]).await;
    assert!(first.is_err(), "the API's 503 is an error: {first:?}");
    let vectors = embedder.embed(&["a".into(), "b".into()]).await.unwrap();
    assert_eq!(vectors.len(), 2);
    for vector in &vectors {
        let norm: f32 = vector.iter().map(|x| x * x).sum::<f32>().sqrt();
        assert!((norm - 1.0).abs() < 1e-6, "{vector:?}");
    }
    assert_eq!((embedder.calls(), embedder.texts()), (2, 4));
    assert_eq!(calls.load(Ordering::SeqCst), 2);
}

#[tokio::test]
async fn answers_over_their_bounds_are_refused() {
    let (url, _) = serve(Mode::MixedDimensions).await;
    let embedder = HttpEmbedder::new(&url, "m", None).unwrap();
    let mixed = embedder.embed(&["a".into(), "b".into()]).await;
    assert!(
        mixed
            .as_ref()
            .is_err_and(|e| e.to_string().contains("dimensions")),
        "{mixed:?}"
    );
    let (url, _) = serve(Mode::Huge).await;
    let embedder = HttpEmbedder::new(&url, "m", None).unwrap();
    let huge = embedder.embed(&["a".into()]).await;
    assert!(
        huge.as_ref()
            .is_err_and(|e| e.to_string().contains("bytes")),
        "{huge:?}"
    );
}

/// An embedding API that fails once does not fail the ingestion: the call
/// is asked again inside it, and the document is indexed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_ingestion_rides_out_a_failing_embedding_call() {
    let (url, calls) = serve(Mode::FailFirst).await;
    let target = targets::sqlite().await.unwrap();
    let embedder = Arc::new(HttpEmbedder::new(&url, "m", None).unwrap());
    let ingestor = Ingestor::open(
        target.gate(Config::default()).await,
        &target.store_url,
        embedder,
    )
    .await
    .unwrap();
    let content = (0..40)
        .map(|i| format!("paragraph {i} of a travel policy, taxis are refunded"))
        .collect::<Vec<_>>()
        .join("\n\n");
    let done = ingestor
        .ingest(&Upload {
            tenant: "http".into(),
            name: "policy.txt".into(),
            media_type: MediaType::Text,
            content: content.into_bytes(),
            document_id: None,
        })
        .await
        .unwrap();
    let batches = usize::try_from(done.chunks).unwrap().div_ceil(16);
    assert_eq!(
        calls.load(Ordering::SeqCst),
        batches + 1,
        "one call asked again"
    );
    assert_eq!(
        ingestor.reconcile().await.unwrap().current_chunks,
        done.chunks
    );
}
