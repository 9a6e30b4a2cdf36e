//! A begin's decision applied inside the store's transaction, written once.
//!
//! The store locks the user's row and then the session's row (creating
//! either on first use) and reads the facts under those locks
//! ([`BeginSql::lock_and_read`]); this module reads a confirmation's target
//! and its continuation when the decision needs them, asks
//! [`decide_begin`], and applies the answer through the store's SQL: a
//! replay reads nothing more, an exhausted turn is failed for good
//! ([`BeginSql::exhaust`]), a start writes the grant ([`BeginSql::start`]).
//! With a lease layer an exhausted turn whose lease the layer still holds is
//! `request_in_flight`, as on every store.

use agentgate_core::decide::{
    decide_begin, reserved_fence, BeginDecision, BeginFacts, SessionSnapshot, StartKind,
    TurnSnapshot, UserLoad,
};
use agentgate_core::error::{Error, Result};
use agentgate_core::ids::{Fence, LeaseToken};
use agentgate_core::lease::{refuse_if_held, LeaseLayer};
use agentgate_core::model::{BeginCommand, BeginOutcome, Grant, TurnView};

use crate::query::{On, Run, Statement};
use crate::rows::TURN_COLUMNS;

/// A turn row as a begin reads it: what `decide` needs and what a replay
/// answers. A store may keep more beside them (a column it copies).
pub trait TurnRecord {
    /// What the decision reads.
    fn snapshot(&self) -> &TurnSnapshot;
    /// What a replay answers.
    fn view(&self) -> &TurnView;
}

/// What a begin read under its locks.
#[derive(Debug)]
pub struct Facts<R> {
    /// The store's clock.
    pub now_ms: i64,
    /// The user's permits.
    pub load: UserLoad,
    /// The request's own turn, if recorded.
    pub turn: Option<R>,
}

/// The session's row, locked, and the facts read after the locks.
#[derive(Debug)]
pub struct Locked<R> {
    /// The session as the decision sees it.
    pub session: SessionSnapshot,
    /// The newest fence granted on the session.
    pub session_fence: i64,
    /// The clock, the permits and the request's turn.
    pub facts: Facts<R>,
}

/// What a start writes: the decision's kind and attempt, and the fence when
/// it was taken before the transaction (else the store takes it).
#[derive(Clone, Copy, Debug)]
pub struct Start {
    /// A new turn, a restart or a takeover.
    pub kind: StartKind,
    /// The turn's attempt number.
    pub attempt: u32,
    /// The fence reserved before the transaction, checked newer than the
    /// session's.
    pub fence: Option<Fence>,
}

/// The SQL a store supplies for a begin. Every method runs inside the
/// begin's transaction `tx`.
#[async_trait::async_trait]
pub trait BeginSql: Run {
    /// The store's turn row.
    type Record: TurnRecord + Send + Sync;

    /// The turn in `row` ([`TURN_COLUMNS`](crate::rows::TURN_COLUMNS)).
    ///
    /// # Errors
    /// `corrupt` for a row the engine never writes.
    fn record(row: &Self::Row) -> Result<Option<Self::Record>>;

    /// Locks the user's row, then the session's (creating either on first
    /// use, the session bound to the caller), then reads the facts.
    async fn lock_and_read(
        &self,
        tx: &mut Self::Conn,
        command: &BeginCommand,
    ) -> Result<Locked<Self::Record>>;

    /// Writes the grant: the session's lease and permit, the turn (new or
    /// restarted), a confirmation's target marked confirmed, and with a lease
    /// layer the layer's acquire.
    async fn start(
        &self,
        tx: &mut Self::Conn,
        command: &BeginCommand,
        facts: &Facts<Self::Record>,
        confirm_target: Option<&Self::Record>,
        start: Start,
    ) -> Result<Grant>;
}

/// One turn by id, inside the begin's transaction.
async fn turn_by_id<S: BeginSql>(
    sql: &S,
    tx: &mut S::Conn,
    turn_id: &str,
) -> Result<Option<S::Record>> {
    let statement = Statement::new(format!(
        "SELECT {TURN_COLUMNS} FROM ag_turns WHERE turn_id = $1"
    ))
    .text(turn_id);
    match sql.fetch_optional(On::Conn(tx), statement).await? {
        Some(row) => S::record(&row),
        None => Ok(None),
    }
}

/// Fails a turn that used all its attempts, for good; its view after.
async fn exhaust<S: BeginSql>(
    sql: &S,
    tx: &mut S::Conn,
    turn_id: &str,
    now: i64,
) -> Result<TurnView> {
    let failed = sql
        .execute(
            On::Conn(tx),
            Statement::new(
                "UPDATE ag_turns SET state = 'failed', retryable = FALSE, \
                 error = '{\"code\":\"attempts_exhausted\"}', updated_at_ms = $1, ended_at_ms = $1 \
                 WHERE turn_id = $2",
            )
            .int(now)
            .text(turn_id),
        )
        .await?;
    Error::expect_rows(failed, 1, "the exhausted turn")?;
    let turn = turn_by_id(sql, tx, turn_id)
        .await?
        .ok_or_else(|| Error::corrupt(format!("turn {turn_id} vanished while it was failed")))?;
    Ok(turn.view().clone())
}

/// Runs one begin inside `tx`; the flag says whether it wrote anything (a
/// replay or a refusal writes nothing, so the caller rolls back).
/// `reserved` is the fence taken before the transaction, if the store takes
/// it there.
///
/// # Errors
/// The decision's refusal, or the store's error.
pub async fn begin_in<S: BeginSql>(
    sql: &S,
    tx: &mut S::Conn,
    command: &BeginCommand,
    reserved: Option<Fence>,
) -> Result<(BeginOutcome, bool)> {
    let Locked {
        session,
        session_fence,
        facts,
    } = sql.lock_and_read(tx, command).await?;
    let confirms = command.confirmation.as_ref().map(|c| c.turn_id.as_str());
    let confirm_target = match (confirms, &facts.turn) {
        (Some(target), None) => turn_by_id(sql, tx, target).await?,
        _ => None,
    };
    let continuation = match confirm_target
        .as_ref()
        .and_then(|t| t.snapshot().confirmed_by.as_deref())
    {
        Some(next) => turn_by_id(sql, tx, next).await?,
        None => None,
    };
    let decision = decide_begin(&BeginFacts {
        now_ms: facts.now_ms,
        user_id: command.user_id.as_str(),
        session_id: command.session_id.as_str(),
        fingerprint: command.fingerprint.as_hex(),
        confirms,
        session: Some(&session),
        turn: facts.turn.as_ref().map(TurnRecord::snapshot),
        confirm_target: confirm_target.as_ref().map(TurnRecord::snapshot),
        continuation: continuation.as_ref().map(TurnRecord::snapshot),
        load: facts.load,
        resume_only: command.resume_only,
    });
    match decision {
        BeginDecision::Reject(error) => Err(error),
        BeginDecision::Replay { turn_id } => {
            let known = [&facts.turn, &continuation]
                .into_iter()
                .flatten()
                .find(|t| t.view().turn_id.as_str() == turn_id)
                .map(|t| t.view().clone());
            let view = match known {
                Some(view) => view,
                None => turn_by_id(sql, tx, &turn_id)
                    .await?
                    .ok_or_else(|| Error::corrupt(format!("replayed turn {turn_id} vanished")))?
                    .view()
                    .clone(),
            };
            Ok((BeginOutcome::Replay(view), false))
        }
        BeginDecision::Exhaust => {
            let turn_id = facts
                .turn
                .as_ref()
                .map(|t| t.snapshot().turn_id.as_str())
                .ok_or_else(|| Error::corrupt("exhausting a begin that has no turn"))?;
            if let Some(layer) = sql.leases() {
                refuse_if_held(layer, command.session_id.as_str(), turn_id).await?;
            }
            let view = exhaust(sql, tx, turn_id, facts.now_ms).await?;
            Ok((BeginOutcome::Replay(view), true))
        }
        BeginDecision::Start { kind, attempt } => {
            let start = Start {
                kind,
                attempt,
                fence: reserved_fence(reserved, session_fence)?,
            };
            let grant = sql
                .start(tx, command, &facts, confirm_target.as_ref(), start)
                .await?;
            Ok((BeginOutcome::Started(grant), true))
        }
    }
}

/// Gives the lease layer's lease back when its grant did not become durable
/// (the commit failed). A failure only leaves a lease that expires by
/// itself, so it is logged, not returned.
pub async fn give_back(leases: Option<&dyn LeaseLayer>, turn_id: &str, token: &LeaseToken) {
    if let Some(layer) = leases {
        if let Err(error) = layer.release(turn_id, &token.digest_hex()).await {
            tracing::warn!(%error, turn_id, "could not give back an undurable lease");
        }
    }
}
