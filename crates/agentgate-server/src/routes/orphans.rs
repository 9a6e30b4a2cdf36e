//! Recovery: claiming an orphaned turn (a running turn whose holder died
//! without an ending) to resume it.

use agentgate::{OrphanFilter, TurnId, UserId};
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::{Extension, Json};

use crate::auth::RecoveryRole;
use crate::dto::{ClaimOrphanRequest, ClaimOrphanResponse, GrantDto, JournalEntryDto};
use crate::error::{ApiError, OrphanErrors};
use crate::extract::ApiJson;
use crate::guard::CallerUser;
use crate::metrics::BeginLabel;
use crate::AppState;

/// Claim the longest-orphaned turn, to resume it.
///
/// An orphan is a `running` turn whose lease expired without an ending: its
/// worker crashed or vanished. The claim takes it over exactly like a
/// takeover (new lease token, higher fence, `attempt + 1`) in one atomic
/// step, and returns what resuming it needs: the original payload and the
/// tool journal. Succeeded tool calls return their stored result when
/// claimed again; `unknown` ones may have taken effect — reconcile them
/// (e.g. look the booking up by its `idempotency_key`) before acting. The
/// journal is the first page of the turn's executions, as `GET
/// /v1/turns/{turn_id}` carries them; when `journal_next` is not `null`,
/// read the rest with `GET /v1/turns/{turn_id}/executions?after=`. Many
/// workers calling this at once never get the same orphan. 204 when there
/// is none. An orphan past its attempts is ended `failed` instead.
///
/// Where callers are bound to users (`--user-header`), a caller claims
/// only its own user's orphans (an empty `user_ids` means them; naming
/// another user is 403 `user_mismatch`), unless its bearer is a recovery
/// key (`--recovery-key`), which claims any user's.
#[utoipa::path(
    post,
    path = "/v1/orphans/claim",
    tag = "recovery",
    request_body(content = ClaimOrphanRequest, description = "Filters; `{}` claims any orphan"),
    security((), ("bearer" = [])),
    responses(
        (status = 201, description = "An orphan, taken over: run it to its end like a begun turn", body = ClaimOrphanResponse),
        (status = 204, description = "No orphan to claim"),
        OrphanErrors,
    )
)]
pub(crate) async fn claim(
    State(state): State<AppState>,
    recovery: Option<Extension<RecoveryRole>>,
    headers: HeaderMap,
    ApiJson(request): ApiJson<ClaimOrphanRequest>,
) -> Result<Response, ApiError> {
    let user_ids = if recovery.is_some() {
        request.user_ids
    } else {
        CallerUser::from_headers(&headers, &state)?.orphan_users(request.user_ids)?
    };
    let filter = OrphanFilter {
        min_orphaned_ms: request.min_orphaned_ms,
        user_ids: user_ids
            .into_iter()
            .map(UserId::new)
            .collect::<Result<_, _>>()?,
        turn_ids: request
            .turn_ids
            .into_iter()
            .map(TurnId::new)
            .collect::<Result<_, _>>()?,
    };
    let store = state.gate().store();
    let Some(claimed) = store.claim_orphan_first_page(&filter).await? else {
        return Ok(StatusCode::NO_CONTENT.into_response());
    };
    state.metrics().begin(BeginLabel::OrphanClaim);
    tracing::info!(
        turn_id = %claimed.grant.turn_id,
        fence = %claimed.grant.fence,
        attempt = claimed.grant.attempt,
        orphaned_for_ms = claimed.orphaned_for_ms,
        "orphan claimed"
    );
    let body = ClaimOrphanResponse {
        turn: GrantDto::from(claimed.grant),
        payload: claimed.payload,
        journal: claimed
            .journal
            .into_iter()
            .map(JournalEntryDto::from)
            .collect(),
        journal_next: claimed.journal_next.map(|cursor| cursor.to_string()),
        orphaned_for_ms: claimed.orphaned_for_ms,
    };
    Ok((StatusCode::CREATED, Json(body)).into_response())
}
