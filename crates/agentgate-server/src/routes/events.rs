//! A turn's event log over HTTP: the holder appends under its lease; anyone
//! allowed to read the turn follows it as Server-Sent Events, from any node
//! sharing the store, resuming with `Last-Event-ID`.
//!
//! Each SSE event is `id: <event id>`, `event: <name>` and `data:
//! {"attempt": n, "data": <the JSON appended>}` on one line (canonical JSON
//! has no line breaks, and names are tokens, so nothing appended can forge
//! a line). Once the turn has ended and every event was sent, one `event:
//! end` with `data: {"state", "attempt"}` and no id closes the stream (a
//! resume after the last id gets the end again). Comment lines every
//! [`SSE_KEEP_ALIVE`] keep proxies from closing an idle stream.
//!
//! A stream is bounded: it closes without `end` after
//! [`MAX_EVENT_STREAM_LIFETIME`], and when its reader takes nothing for
//! [`agentgate::limits::FOLLOW_STALL`] (the follower) or the connection
//! takes no bytes for [`crate::limits::WRITE_STALL`] (the socket); the
//! reader resumes with `Last-Event-ID` and misses nothing.

use std::convert::Infallible;
use std::future::Future as _;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};

use agentgate::events::Followed;
use agentgate::TurnId;
use axum::extract::State;
use axum::http::HeaderMap;
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::Json;
use tokio::time::Sleep;
use tokio_stream::{Stream, StreamExt as _};

use crate::dto::{AppendEventsRequest, AppendEventsResponse, EventsQuery, OwnerQuery};
use crate::error::{ApiError, EventErrors, ReadErrors};
use crate::extract::{ApiJson, ApiPath, ApiQuery, LeaseHeader};
use crate::guard::CallerUser;
use crate::limits::{MAX_EVENT_STREAM_LIFETIME, SSE_KEEP_ALIVE};
use crate::routes::views::{owned_turn, owner_filter};
use crate::AppState;

/// The header a browser's `EventSource` sends when it reconnects.
const LAST_EVENT_ID: &str = "last-event-id";

/// Append events to the turn's log (its holder only).
///
/// One step, all or none: the events get the next ids of the turn, in
/// order, and every follower on every node sees them. Fenced like every
/// write: after a takeover, expiry or ending the append is refused 409
/// `lease_lost` and none of its events is ever seen. At most 500 events an
/// append, 64 KiB of data an event, 20,000 events and 16 MiB a turn.
#[utoipa::path(
    post,
    path = "/v1/turns/{turn_id}/events",
    tag = "events",
    params(
        ("turn_id" = crate::schema::Id, Path, description = "The turn, as returned by begin"),
        ("Lease-Token" = crate::schema::LeaseTokenText, Header, description = "The lease token returned by begin"),
    ),
    request_body = AppendEventsRequest,
    security((), ("bearer" = [])),
    responses(
        (status = 200, description = "Appended: the last new event's id", body = AppendEventsResponse),
        EventErrors,
    )
)]
pub(crate) async fn append_events(
    State(state): State<AppState>,
    ApiPath(turn_id): ApiPath<String>,
    lease: LeaseHeader,
    ApiJson(request): ApiJson<AppendEventsRequest>,
) -> Result<Json<AppendEventsResponse>, ApiError> {
    let lease = lease.for_turn(turn_id)?;
    let events = request.to_engine()?;
    let last_event_id = state.gate().store().append_events(&lease, &events).await?;
    state.metrics().events_appended(events.len());
    tracing::debug!(turn_id = %lease.turn_id, count = events.len(), last_event_id, "events appended");
    Ok(Json(AppendEventsResponse { last_event_id }))
}

/// Follow the turn's events as Server-Sent Events.
///
/// From the first event, or after `Last-Event-ID` (the header an
/// `EventSource` sends when it reconnects) or `after`: every event once,
/// in id order, live while the turn runs, then `event: end` with the
/// turn's ending. Any node sharing the store serves any turn. With
/// `on_disconnect=cancel`, a client that goes away before the end asks the
/// turn to stop (a cancel request, as `POST /v1/turns/{id}/cancel`).
#[utoipa::path(
    get,
    path = "/v1/turns/{turn_id}/events",
    tag = "events",
    params(
        ("turn_id" = crate::schema::Id, Path, description = "The turn"),
        ("Last-Event-ID" = Option<String>, Header, pattern = "^[0-9]{0,19}$", description = "Resume after this event id (digits, at most 20000; empty: none); wins over `after`"),
        EventsQuery,
    ),
    security((), ("bearer" = [])),
    responses(
        (status = 200, description = "The event stream: `id`, `event` and `data: {\"attempt\", \"data\"}` per event; `event: end` with `data: {\"state\", \"attempt\"}` last", content_type = "text/event-stream", body = String),
        ReadErrors,
    )
)]
pub(crate) async fn follow_events(
    State(state): State<AppState>,
    ApiPath(turn_id): ApiPath<String>,
    caller: CallerUser,
    headers: HeaderMap,
    ApiQuery(query): ApiQuery<EventsQuery>,
) -> Result<Response, ApiError> {
    // An empty `Last-Event-ID` is no id (an `EventSource` that saw none).
    let after = match headers
        .get(LAST_EVENT_ID)
        .map(|v| v.to_str().map(str::trim))
    {
        Some(Ok("")) | None => query.after.unwrap_or(0),
        Some(Ok(text)) => text
            .parse::<u64>()
            .map_err(|_| ApiError::invalid("Last-Event-ID is an event id: digits"))?,
        Some(Err(_)) => return Err(ApiError::invalid("Last-Event-ID is an event id: digits")),
    };
    let most = agentgate::limits::MAX_TURN_EVENTS;
    if after > most {
        return Err(ApiError::invalid(format!(
            "an event id is at most {most} (a turn's most events)"
        )));
    }
    let turn_id = TurnId::new(turn_id)?;
    let owner = OwnerQuery {
        user_id: query.user_id.clone(),
    };
    let owner = owner_filter(owner, &caller)?;
    // Exists and may be read by this caller: 404 before any stream opens.
    owned_turn(state.gate().store().as_ref(), &turn_id, &owner).await?;
    let stream = state.gate().follow(&turn_id, after)?;
    let metrics = state.metrics().clone();
    metrics.event_stream_opened();
    let guard = Arc::new(StreamGuard {
        state: state.clone(),
        turn_id,
        cancel: query.on_disconnect == Some(crate::dto::OnDisconnectDto::Cancel),
        ended: AtomicBool::new(false),
    });
    let events = stream.map(move |item| {
        let event = match item {
            Ok(Followed::Event(event)) => Event::default()
                .id(event.event_id.to_string())
                .event(event.name)
                .data(format!(
                    r#"{{"attempt":{},"data":{}}}"#,
                    event.attempt, event.data
                )),
            Ok(Followed::End { state, attempt }) => {
                guard.ended.store(true, Ordering::SeqCst);
                Event::default().event("end").data(format!(
                    r#"{{"state":"{}","attempt":{attempt}}}"#,
                    state.as_str()
                ))
            }
            Err(error) => {
                guard.ended.store(true, Ordering::SeqCst);
                let error = ApiError::from(error);
                Event::default().event("error").data(
                    serde_json::json!({"code": error.code().as_str(), "message": error.message()})
                        .to_string(),
                )
            }
        };
        Ok::<_, Infallible>(event)
    });
    Ok(Sse::new(Lifetime::new(events, MAX_EVENT_STREAM_LIFETIME))
        .keep_alive(KeepAlive::new().interval(SSE_KEEP_ALIVE))
        .into_response())
}

/// A stream that ends at a deadline: whatever it would still yield, it
/// yields nothing after `lifetime`.
struct Lifetime<S> {
    inner: S,
    deadline: Pin<Box<Sleep>>,
}

impl<S> Lifetime<S> {
    fn new(inner: S, lifetime: std::time::Duration) -> Self {
        Self {
            inner,
            deadline: Box::pin(tokio::time::sleep(lifetime)),
        }
    }
}

impl<S: Stream + Unpin> Stream for Lifetime<S> {
    type Item = S::Item;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<S::Item>> {
        if self.deadline.as_mut().poll(cx).is_ready() {
            return Poll::Ready(None);
        }
        Pin::new(&mut self.inner).poll_next(cx)
    }
}

/// Lives as long as one stream's response: counts it closed, and under
/// `on_disconnect=cancel` asks the turn to stop when the client went away
/// before the end.
struct StreamGuard {
    state: AppState,
    turn_id: TurnId,
    cancel: bool,
    ended: AtomicBool,
}

impl Drop for StreamGuard {
    fn drop(&mut self) {
        self.state.metrics().event_stream_closed();
        if !self.cancel || self.ended.load(Ordering::SeqCst) {
            return;
        }
        let (state, turn_id) = (self.state.clone(), self.turn_id.clone());
        tokio::spawn(async move {
            match state.gate().request_cancel(&turn_id).await {
                Ok(_) => tracing::info!(%turn_id, "event stream closed early: turn asked to stop"),
                Err(error) => {
                    tracing::warn!(%turn_id, %error, "event stream closed early; the cancel request failed")
                }
            }
        });
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use std::time::Duration;

    use super::*;

    /// A stream that would yield forever ends at its lifetime, after
    /// yielding what came before it.
    #[tokio::test(start_paused = true)]
    async fn a_stream_ends_at_its_lifetime() {
        let ticks =
            tokio_stream::StreamExt::throttle(tokio_stream::iter(0u64..), Duration::from_secs(1));
        let mut bounded = Lifetime::new(Box::pin(ticks), Duration::from_millis(3_500));
        let mut seen = Vec::new();
        while let Some(tick) = bounded.next().await {
            seen.push(tick);
        }
        assert_eq!(seen, vec![0, 1, 2, 3]);
    }
}
