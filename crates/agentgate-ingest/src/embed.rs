//! Embedders: an offline deterministic one (the default: no network, the
//! same text always the same vector) and an OpenAI-compatible
//! `/v1/embeddings` client. Both count their calls and the texts they
//! embedded, which is what the ingestion's tests measure: the API is paid at
//! most once per chunk.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use sha2::{Digest, Sha256};

use crate::limits::{MAX_DIMENSIONS, OFFLINE_DIMENSIONS};
use crate::IngestError;

/// How long one embedding request may take.
pub const EMBED_TIMEOUT: Duration = Duration::from_secs(30);

/// Turns texts into vectors.
#[async_trait::async_trait]
pub trait Embedder: Send + Sync + std::fmt::Debug {
    /// One vector per text, in order.
    ///
    /// # Errors
    /// `embedding` when the embedder fails.
    async fn embed(&self, texts: &[String]) -> Result<Vec<Vec<f32>>, IngestError>;

    /// Calls made so far.
    fn calls(&self) -> u64;

    /// Texts embedded so far.
    fn texts(&self) -> u64;
}

/// What an embedder has been asked: calls and texts.
#[derive(Debug, Default)]
struct Counts {
    calls: AtomicU64,
    texts: AtomicU64,
}

impl Counts {
    fn record(&self, texts: usize) {
        self.calls.fetch_add(1, Ordering::SeqCst);
        self.texts
            .fetch_add(u64::try_from(texts).unwrap_or(u64::MAX), Ordering::SeqCst);
    }
}

/// The offline embedder: a hashed bag of words, L2-normalised. Texts that
/// share words get close vectors, which is enough for retrieval over
/// receipts and policies without a network.
#[derive(Debug, Default)]
pub struct OfflineEmbedder {
    counts: Counts,
}

impl OfflineEmbedder {
    /// A fresh embedder with its counts at zero.
    pub fn new() -> Self {
        Self::default()
    }

    /// The vector of one text.
    pub fn vector(text: &str) -> Vec<f32> {
        let mut vector = vec![0f32; OFFLINE_DIMENSIONS];
        for word in text
            .split(|c: char| !c.is_alphanumeric())
            .filter(|w| !w.is_empty())
        {
            let digest = Sha256::digest(word.to_lowercase().as_bytes());
            let slot = usize::from(digest[0]) % OFFLINE_DIMENSIONS;
            let sign = if digest[1] & 1 == 0 { 1.0 } else { -1.0 };
            vector[slot] += sign;
        }
        normalise(&mut vector);
        vector
    }
}

#[async_trait::async_trait]
impl Embedder for OfflineEmbedder {
    async fn embed(&self, texts: &[String]) -> Result<Vec<Vec<f32>>, IngestError> {
        self.counts.record(texts.len());
        Ok(texts.iter().map(|t| Self::vector(t)).collect())
    }

    fn calls(&self) -> u64 {
        self.counts.calls.load(Ordering::SeqCst)
    }

    fn texts(&self) -> u64 {
        self.counts.texts.load(Ordering::SeqCst)
    }
}

/// An OpenAI-compatible `/v1/embeddings` client.
#[derive(Debug)]
pub struct HttpEmbedder {
    client: reqwest::Client,
    url: String,
    model: String,
    api_key: Option<String>,
    counts: Counts,
}

impl HttpEmbedder {
    /// A client of `base_url` (`https://host/v1`), `model`, with an optional
    /// bearer key.
    ///
    /// # Errors
    /// `embedding` when the HTTP client cannot be built.
    pub fn new(base_url: &str, model: &str, api_key: Option<String>) -> Result<Self, IngestError> {
        let client = reqwest::Client::builder()
            .timeout(EMBED_TIMEOUT)
            .build()
            .map_err(|e| IngestError::Embedding(e.to_string()))?;
        Ok(Self {
            client,
            url: format!("{}/embeddings", base_url.trim_end_matches('/')),
            model: model.to_owned(),
            api_key,
            counts: Counts::default(),
        })
    }
}

#[derive(serde::Deserialize)]
struct EmbeddingsResponse {
    data: Vec<EmbeddingRow>,
}

#[derive(serde::Deserialize)]
struct EmbeddingRow {
    index: usize,
    embedding: Vec<f32>,
}

#[async_trait::async_trait]
impl Embedder for HttpEmbedder {
    async fn embed(&self, texts: &[String]) -> Result<Vec<Vec<f32>>, IngestError> {
        self.counts.record(texts.len());
        let mut request = self
            .client
            .post(&self.url)
            .json(&serde_json::json!({ "model": self.model, "input": texts }));
        if let Some(key) = &self.api_key {
            request = request.bearer_auth(key);
        }
        let mut response = request
            .send()
            .await
            .and_then(reqwest::Response::error_for_status)
            .map_err(|e| IngestError::Embedding(e.to_string()))?;
        // Read at most the bytes a batch of the largest vectors can take.
        let cap = max_answer_bytes(texts.len());
        let mut bytes = Vec::new();
        while let Some(piece) = response
            .chunk()
            .await
            .map_err(|e| IngestError::Embedding(e.to_string()))?
        {
            if bytes.len() + piece.len() > cap {
                return Err(IngestError::Embedding(format!(
                    "an embeddings answer over {cap} bytes"
                )));
            }
            bytes.extend_from_slice(&piece);
        }
        let mut body: EmbeddingsResponse = serde_json::from_slice(&bytes)
            .map_err(|e| IngestError::Embedding(format!("a bad embeddings answer: {e}")))?;
        body.data.sort_by_key(|row| row.index);
        if body.data.len() != texts.len()
            || body.data.iter().enumerate().any(|(i, row)| row.index != i)
        {
            return Err(IngestError::Embedding(format!(
                "asked for {} embeddings, got {}",
                texts.len(),
                body.data.len()
            )));
        }
        let dimensions = body.data.first().map_or(0, |row| row.embedding.len());
        body.data
            .into_iter()
            .map(|row| {
                if row.embedding.len() != dimensions {
                    return Err(IngestError::Embedding(format!(
                        "embeddings of {} and {dimensions} dimensions in one answer",
                        row.embedding.len()
                    )));
                }
                if row.embedding.is_empty() || row.embedding.len() > MAX_DIMENSIONS {
                    return Err(IngestError::Embedding(format!(
                        "an embedding of {} dimensions; 1 to {MAX_DIMENSIONS}",
                        row.embedding.len()
                    )));
                }
                let mut vector = row.embedding;
                normalise(&mut vector);
                Ok(vector)
            })
            .collect()
    }

    fn calls(&self) -> u64 {
        self.counts.calls.load(Ordering::SeqCst)
    }

    fn texts(&self) -> u64 {
        self.counts.texts.load(Ordering::SeqCst)
    }
}

/// The most bytes an answer for `texts` embeddings may have: each of
/// [`MAX_DIMENSIONS`] numbers at most [`MAX_NUMBER_BYTES`] long, plus
/// [`ANSWER_OVERHEAD_BYTES`] per embedding and for the envelope.
fn max_answer_bytes(texts: usize) -> usize {
    (texts + 1) * (MAX_DIMENSIONS * MAX_NUMBER_BYTES + ANSWER_OVERHEAD_BYTES)
}

/// The longest number an embeddings answer writes (`-0.123456789e-10,`).
const MAX_NUMBER_BYTES: usize = 24;

/// An embedding's fields besides its numbers, and the answer's envelope.
const ANSWER_OVERHEAD_BYTES: usize = 4_096;

/// Scales `vector` to length 1 (a zero vector stays zero).
fn normalise(vector: &mut [f32]) {
    let norm = vector.iter().map(|x| x * x).sum::<f32>().sqrt();
    if norm > 0.0 {
        for x in vector.iter_mut() {
            *x /= norm;
        }
    }
}

/// A vector as stored: little-endian `f32`s.
pub fn to_bytes(vector: &[f32]) -> Vec<u8> {
    vector.iter().flat_map(|x| x.to_le_bytes()).collect()
}

/// A stored vector.
///
/// # Errors
/// `corrupt` for a length that is not a whole number of `f32`s.
pub fn from_bytes(bytes: &[u8]) -> Result<Vec<f32>, IngestError> {
    if !bytes.chunks_exact(4).remainder().is_empty() {
        return Err(IngestError::Corrupt(format!(
            "a stored vector of {} bytes",
            bytes.len()
        )));
    }
    Ok(bytes
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect())
}

/// The cosine of two unit vectors (their dot product); vectors of other
/// dimensions score nothing.
pub fn cosine(a: &[f32], b: &[f32]) -> f32 {
    if a.len() != b.len() {
        return f32::MIN;
    }
    a.iter().zip(b).map(|(x, y)| x * y).sum()
}
