//! What a begin carries and what it answers: the command, the lease handed
//! out, the grant and the queued place.

use super::*;

/// A begin that answers a pending confirmation.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Confirmation {
    /// The turn that is awaiting confirmation.
    pub turn_id: TurnId,
    /// Approve or reject.
    pub decision: Decision,
}

/// A validated request to begin a turn.
#[derive(Clone, Debug)]
pub struct BeginCommand {
    /// Who the turn runs for.
    pub user_id: UserId,
    /// The conversation.
    pub session_id: SessionId,
    /// The client's id for this message.
    pub client_request_id: ClientRequestId,
    /// The message, canonical.
    pub payload: CanonicalJson,
    /// Set when this begin answers a pending confirmation.
    pub confirmation: Option<Confirmation>,
    /// SHA-256 over payload and confirmation: a repeat must match it.
    pub fingerprint: Digest,
    /// Set by a recovery worker's claim ([`Orphan::resume_command`]): the
    /// begin may only take over a turn that is still `running`; a turn that
    /// ended meanwhile (even retryably, or `abandoned`) replays instead of
    /// restarting, so a stale orphan list never re-runs an ended turn.
    pub resume_only: bool,
    /// Set by a begin under `on_busy: enqueue` or `supersede`: a busy
    /// session queues the request instead of refusing it.
    pub queue: Option<QueueMode>,
}

impl BeginCommand {
    /// The same begin, queued when its session is busy.
    #[must_use]
    pub fn queued(mut self, queue: Option<QueueMode>) -> Self {
        self.queue = queue;
        self
    }

    /// Validates a begin. The fingerprint covers the payload and the
    /// confirmation, so the same request id with another decision is a mismatch.
    ///
    /// # Errors
    /// `invalid_request` when the payload is over the JSON limits or not
    /// I-JSON (an integer beyond ±(2^53−1)).
    pub fn new(
        user_id: UserId,
        session_id: SessionId,
        client_request_id: ClientRequestId,
        payload: &Value,
        confirmation: Option<Confirmation>,
    ) -> Result<Self> {
        crate::canonical::check_i_json("payload", payload)?;
        // The limits are the payload's own: checked on it, not on the
        // wrapper the fingerprint hashes (one level deeper, a few bytes
        // longer), which made a payload exactly at the depth limit fail.
        let canonical = CanonicalJson::new("payload", payload)?;
        let fingerprint = crate::canonical::digest_unchecked(
            &serde_json::json!({ "payload": payload, "confirmation": confirmation }),
        )?;
        let payload = canonical;
        Ok(Self {
            user_id,
            session_id,
            client_request_id,
            payload,
            confirmation,
            fingerprint,
            resume_only: false,
            queue: None,
        })
    }
}

/// The proof a post-grant call carries: which turn, and its secret token.
#[derive(Clone, Debug)]
pub struct LeaseRef {
    /// The turn the lease was granted to.
    pub turn_id: TurnId,
    /// The lease's secret.
    pub token: LeaseToken,
}

/// What a confirmation turn carries over from the turn it answers.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ConfirmationContext {
    /// The turn that awaited confirmation.
    pub turn_id: TurnId,
    /// The person's decision.
    pub decision: Decision,
    /// The pending action that turn recorded.
    pub pending: Value,
}

/// A granted lease on a session, with the turn it runs.
#[derive(Clone, Debug)]
pub struct Grant {
    /// The turn.
    pub turn_id: TurnId,
    /// Its session.
    pub session_id: SessionId,
    /// Its user.
    pub user_id: UserId,
    /// Its request id.
    pub client_request_id: ClientRequestId,
    /// The secret; only the holder ever sees it.
    pub lease_token: LeaseToken,
    /// This grant's fence.
    pub fence: Fence,
    /// 1 for the first start, +1 per takeover or restart.
    pub attempt: u32,
    /// Whether this start took over a running turn whose lease expired.
    pub takeover: bool,
    /// Remaining lease on the store's clock when granted.
    pub lease_expires_in_ms: i64,
    /// Present on a confirmation turn.
    pub confirmation: Option<ConfirmationContext>,
}

impl Grant {
    /// The grant of a new turn's first attempt (no takeover, no
    /// confirmation) under `fence`, for a lease of `lease_ttl_ms`: what a
    /// store's one-statement begin hands out.
    pub fn first(
        command: &BeginCommand,
        turn_id: TurnId,
        lease_token: LeaseToken,
        fence: Fence,
        lease_ttl_ms: i64,
    ) -> Self {
        Self {
            turn_id,
            session_id: command.session_id.clone(),
            user_id: command.user_id.clone(),
            client_request_id: command.client_request_id.clone(),
            lease_token,
            fence,
            attempt: 1,
            takeover: false,
            lease_expires_in_ms: lease_ttl_ms,
            confirmation: None,
        }
    }
}

/// What `begin` did.
#[derive(Clone, Debug)]
pub enum BeginOutcome {
    /// A lease was granted; run the turn.
    Started(Grant),
    /// The request already ended; here is its stored outcome. No lease taken.
    Replay(TurnView),
    /// The request waits in its session's queue (queued now, or by an
    /// earlier begin of the same request). No lease taken.
    Queued(QueuedTurn),
}

/// A turn waiting in its session's queue, as a begin answers it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct QueuedTurn {
    /// The queued turn.
    pub turn_id: TurnId,
    /// Its session.
    pub session_id: SessionId,
    /// Its user.
    pub user_id: UserId,
    /// Its request id.
    pub client_request_id: ClientRequestId,
    /// 1 for the head of the queue, gap-free behind it.
    pub position: u32,
    /// Store-clock time it was queued, ms since the Unix epoch.
    pub enqueued_at_ms: i64,
    /// When to look again: the holder's remaining lease (the queue moves
    /// at the latest then), at least 1 ms.
    #[serde(skip)]
    pub retry_after: std::time::Duration,
}
