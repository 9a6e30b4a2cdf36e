//! The documents pane's endpoints (seed 003's ingestion, through
//! `agentgate-ingest` on the server's own engine and store):
//!
//! - `POST /app/documents?user_id=&name=[&document_id=]` with the file
//!   (text, Markdown or PDF) as the body: checked at once (400 for a file
//!   that cannot be ingested, nothing written), then ingested in the
//!   background; `202` with the document id and version. Uploads of one
//!   file at once make one ingestion: the later ones find it running and
//!   end. With `document_id`, the file is a new version of that document,
//!   switched to when it is fully indexed.
//! - `GET /app/documents?user_id=`: the user's ingestions, newest first,
//!   each with its state from the engine's record and its progress.
//! - `GET /app/documents/search?user_id=&q=`: the chunks of the user's
//!   current versions closest to `q`, with their document's name.
//! - `POST /app/documents/delete?user_id=&document_id=`: deletes a document
//!   (409 with `Retry-After` while an ingestion of it runs).
//!
//! The user is the tenant. Uploads are bounded by the server's body limit
//! (`--max-body-bytes`) and by the ingestion's own limits.

use std::time::Duration;

use agentgate::UserId;
use agentgate_ingest::{Hit, IngestError, IngestionView, MediaType, Upload};
use agentgate_server::{ApiBytes, ApiError, ApiQuery, AppState, CallerUser, ErrorCode};
use axum::extract::{RawQuery, State};
use axum::http::StatusCode;
use axum::Json;
use serde::{Deserialize, Serialize};

use crate::limits::SEARCH_HITS;

/// `?user_id=&name=[&document_id=]`
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct UploadQuery {
    user_id: String,
    name: String,
    /// The document this file is a new version of (a fenced blue-green
    /// update); absent for a new document.
    #[serde(default)]
    document_id: Option<String>,
}

/// `?user_id=`
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct ListQuery {
    user_id: String,
}

/// `?user_id=&document_id=`
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct DeleteQuery {
    user_id: String,
    document_id: String,
}

/// What a delete removed.
#[derive(Debug, Serialize)]
pub(crate) struct Deleted {
    chunks: u64,
}

/// `?user_id=&q=`
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct SearchQuery {
    user_id: String,
    q: String,
}

/// What an accepted upload ingests.
#[derive(Debug, Serialize)]
pub(crate) struct Accepted {
    document_id: String,
    version: String,
    chunks: i64,
}

/// A user's ingestions.
#[derive(Debug, Serialize)]
pub(crate) struct ListResponse {
    ingestions: Vec<IngestionView>,
}

/// A search's hits.
#[derive(Debug, Serialize)]
pub(crate) struct SearchResponse {
    hits: Vec<Hit>,
}

fn ingestor(state: &AppState) -> Result<&agentgate_ingest::Ingestor, ApiError> {
    crate::ledger(state)?.documents.as_ref().ok_or_else(|| {
        ApiError::new(
            ErrorCode::NotFound,
            "documents need a SQLite or PostgreSQL store",
        )
    })
}

/// The ingestion's errors as the server's error body.
pub(crate) fn api_error(error: IngestError) -> ApiError {
    match error {
        IngestError::Invalid(message) => ApiError::invalid(message),
        IngestError::Engine(engine) => ApiError::from(engine),
        IngestError::Processing { retry_after } => {
            ApiError::new(ErrorCode::RequestInFlight, "this file is being ingested")
                .retry_after(retry_after)
        }
        other => {
            tracing::error!(error = %other, "document ingestion failed");
            ApiError::new(ErrorCode::StoreUnavailable, "ingestion failed; retry later")
        }
    }
}

/// Refuses a file name the query decodes lossily (bytes that are not
/// UTF-8 become U+FFFD without a word) or that holds a control character
/// (NUL, a line break): it is shown in pages and logs, and kept.
fn check_file_name(raw_query: Option<&str>) -> Result<(), ApiError> {
    let raw = raw_query.unwrap_or("");
    for pair in raw.split('&') {
        let (key, value) = pair.split_once('=').unwrap_or((pair, ""));
        if key != "name" {
            continue;
        }
        let plus_as_space = value.replace('+', " ");
        let bytes: Vec<u8> = percent_encoding::percent_decode_str(&plus_as_space).collect();
        let name = std::str::from_utf8(&bytes)
            .map_err(|_| ApiError::invalid("the file name is not UTF-8"))?;
        if name.chars().any(char::is_control) {
            return Err(ApiError::invalid(
                "the file name holds a control character (NUL, a line break…)",
            ));
        }
    }
    Ok(())
}

/// Checks the upload, then ingests it in the background.
pub(crate) async fn upload(
    State(state): State<AppState>,
    caller: CallerUser,
    RawQuery(raw_query): RawQuery,
    ApiQuery(query): ApiQuery<UploadQuery>,
    ApiBytes(body): ApiBytes,
) -> Result<(StatusCode, Json<Accepted>), ApiError> {
    check_file_name(raw_query.as_deref())?;
    caller.check(&query.user_id)?;
    let user_id = UserId::new(query.user_id)?;
    let ingestor = ingestor(&state)?.clone();
    let upload = Upload {
        tenant: user_id.as_str().to_owned(),
        media_type: MediaType::detect(&query.name, &body),
        name: query.name,
        content: body,
        document_id: query.document_id,
    };
    let accepted = ingestor.accept(&upload).await.map_err(api_error)?;
    // In the background, so the page shows progress and a closed tab does
    // not cut an ingestion short. A second upload of the same file while
    // the first runs waits for nothing: it finds it running and ends.
    tokio::spawn(async move {
        match ingestor.ingest_waiting(&upload, Duration::ZERO).await {
            Ok(_) | Err(IngestError::Processing { .. }) => {}
            Err(error) => tracing::warn!(%error, "a document's ingestion failed"),
        }
    });
    Ok((
        StatusCode::ACCEPTED,
        Json(Accepted {
            document_id: accepted.document_id,
            version: accepted.version,
            chunks: accepted.chunks,
        }),
    ))
}

/// The user's ingestions.
pub(crate) async fn list(
    State(state): State<AppState>,
    caller: CallerUser,
    ApiQuery(query): ApiQuery<ListQuery>,
) -> Result<Json<ListResponse>, ApiError> {
    caller.check(&query.user_id)?;
    let user_id = UserId::new(query.user_id)?;
    let ingestions = ingestor(&state)?
        .ingestions(user_id.as_str())
        .await
        .map_err(api_error)?;
    Ok(Json(ListResponse { ingestions }))
}

/// Deletes one of the user's documents (a fenced turn of its session).
pub(crate) async fn delete(
    State(state): State<AppState>,
    caller: CallerUser,
    ApiQuery(query): ApiQuery<DeleteQuery>,
) -> Result<Json<Deleted>, ApiError> {
    caller.check(&query.user_id)?;
    let user_id = UserId::new(query.user_id)?;
    let chunks = ingestor(&state)?
        .delete(user_id.as_str(), &query.document_id)
        .await
        .map_err(api_error)?;
    Ok(Json(Deleted { chunks }))
}

/// The closest chunks of the user's current versions.
pub(crate) async fn search(
    State(state): State<AppState>,
    caller: CallerUser,
    ApiQuery(query): ApiQuery<SearchQuery>,
) -> Result<Json<SearchResponse>, ApiError> {
    caller.check(&query.user_id)?;
    let user_id = UserId::new(query.user_id)?;
    let hits = ingestor(&state)?
        .search(user_id.as_str(), &query.q, SEARCH_HITS)
        .await
        .map_err(api_error)?;
    Ok(Json(SearchResponse { hits }))
}
