//! The begin with a lease layer (Redis), on every SQL store: it decides
//! first and locks last, so no lock of the store is held across the
//! layer's round trip.
//!
//! A round decides on facts read without locks ([`decide_unlocked`]). A
//! refusal or a replay read from one committed snapshot is as true as one
//! read under the locks, and is the answer. A start takes a fence in its
//! own autocommit statement (durable before the layer or the caller sees
//! it), acquires the layer's lease and permit with it, and only then writes
//! the grant, if the same start still holds: the request's turn is the one
//! the round saw, the session's fence is still below the new one (fences
//! grow per session), and the layer's lease has not lapsed on this
//! process's clock meanwhile. A new request's grant is one autocommit
//! statement whose conditions are that check
//! ([`LayeredBeginSql::grant_layered_new`]); anything else opens the
//! store's begin transaction, decides again under its locks ([`decide_in`])
//! and applies the start with the lease held ([`Lease::Held`]). When the
//! state moved, the layer's lease is given back and the next round decides
//! afresh, within the step's retry budget. A lease acquired by a begin that
//! is dropped before it wrote (a caller gone, a request timeout) is given
//! back in the background ([`Unwritten`]), not left blocking the session
//! until its TTL.

use std::sync::Arc;
use std::time::Instant;

use agentgate_core::decide::{layer_acquired, BeginDecision, HolderSnapshot, StartKind};
use agentgate_core::error::{Error, Result};
use agentgate_core::ids::{Fence, LeaseToken, TurnId};
use agentgate_core::lease::{refuse_if_held, Acquired, LeaseClaim, LeaseLayer};
use agentgate_core::model::{BeginCommand, BeginOutcome, Grant};

use super::{
    apply, decide_in, decide_on, decide_unlocked, exhaust, queue_retry, queued_turn, replay,
    BeginSql, Held, Lease,
};
use crate::query::{On, Statement};
use crate::rows::Columns;
use crate::Retry;

/// What a store supplies for [`begin_layered`].
#[async_trait::async_trait]
pub trait LayeredBeginSql: BeginSql {
    /// Takes the next fence in its own autocommit statement, so no lock on
    /// the counter is held across the layer's round trip. `conn` is the
    /// round's connection, outside any transaction (SQLite writes through
    /// its single writer instead).
    async fn reserve_fence(&self, conn: &mut Self::Conn) -> Result<Fence>;

    /// The common grant as one autocommit statement: a new request, no
    /// confirmation (both checked by the caller), the layer's lease already
    /// held under `held.fence`. It writes what [`apply`] writes for that
    /// start with no row expiry, only when the locked path would write it
    /// (no turn for the request, the session free, the caller's, without a
    /// pending confirmation and with a fence below `held.fence`, the cap in
    /// range and not reached in the rows), and otherwise nothing. Its
    /// arguments: `$1` session, `$2` user, `$3` request id, `$4` the turn's
    /// id, `$5` its token's digest, `$6` fingerprint, `$7` payload, `$8`
    /// the held fence, `$9` the default cap.
    fn grant_layered_new_sql() -> String;

    /// Whether the statement's rows say it wrote the grant under `held`.
    ///
    /// # Errors
    /// `corrupt` for rows it never answers.
    fn layered_granted(rows: &[Self::Row], held: &Held) -> Result<bool>;

    /// Whether the grant runs on the store's writer ([`On::Write`]: SQLite
    /// writes through nothing else) rather than on the round's connection.
    const GRANT_ON_WRITER: bool = false;

    /// [`LayeredBeginSql::grant_layered_new_sql`] run on `conn` (or the
    /// writer): `false` when it wrote nothing.
    async fn grant_layered_new(
        &self,
        conn: &mut Self::Conn,
        command: &BeginCommand,
        held: &Held,
    ) -> Result<bool> {
        let digest = held.token.digest_hex();
        let statement = Statement::new(Self::grant_layered_new_sql())
            .text(command.session_id.as_str())
            .text(command.user_id.as_str())
            .text(command.client_request_id.as_str())
            .text(held.turn_id.as_str())
            .text(&digest)
            .text(command.fingerprint.as_hex())
            .text(command.payload.as_str())
            .int(held.fence.0)
            .int(i64::from(self.config().max_turns_per_user));
        let on = if Self::GRANT_ON_WRITER {
            On::Write
        } else {
            On::Conn(conn)
        };
        let rows = self.fetch(on, statement).await?;
        Self::layered_granted(&rows, held)
    }
}

/// "Decide afresh": the state moved between a round's guess and its write.
fn moved() -> Error {
    Error::conflict("begin: the session's state kept changing while its lease was being taken")
}

/// A lease the layer granted to a begin that has not written it yet. Given
/// back when the begin writes nothing ([`Unwritten::give_back`]), or, when
/// the begin is dropped before it settles, by a task spawned on drop.
struct Unwritten {
    layer: Option<Arc<dyn LeaseLayer>>,
    turn_id: String,
    digest: String,
}

impl Unwritten {
    /// The grant is durable: nothing to give back.
    fn written(mut self) {
        self.layer = None;
    }

    /// Gives the lease back now. A failure only leaves a lease that expires
    /// by itself; the caller still learns what happened to the begin.
    async fn give_back(mut self) {
        if let Some(layer) = self.layer.take() {
            release(layer.as_ref(), &self.turn_id, &self.digest).await;
        }
    }
}

impl Drop for Unwritten {
    fn drop(&mut self) {
        let Some(layer) = self.layer.take() else {
            return;
        };
        let (turn_id, digest) = (
            std::mem::take(&mut self.turn_id),
            std::mem::take(&mut self.digest),
        );
        match tokio::runtime::Handle::try_current() {
            Ok(runtime) => {
                runtime.spawn(async move { release(layer.as_ref(), &turn_id, &digest).await });
            }
            Err(_) => tracing::warn!(%turn_id, "a dropped begin's lease expires by itself"),
        }
    }
}

async fn release(layer: &dyn LeaseLayer, turn_id: &str, digest: &str) {
    if let Err(error) = layer.release(turn_id, digest).await {
        tracing::warn!(%error, %turn_id, "could not give back an unwritten grant");
    }
}

/// A begin with a lease layer: see the module documentation.
///
/// # Errors
/// The decision's refusal, the layer's or the store's error, or a
/// `conflict` when the state kept moving for the whole retry budget.
pub async fn begin_layered<S: LayeredBeginSql>(
    sql: &S,
    layer: Arc<dyn LeaseLayer>,
    command: &BeginCommand,
) -> Result<BeginOutcome> {
    let mut retry = Retry::new();
    loop {
        // The layer's answer when the round found its holder's row not yet
        // written: the round runs again (a twin's grant may be in flight),
        // but if the budget runs out first, that answer stands, not the
        // round's `conflict` (a lease whose begin died between its acquire
        // and its write holds the session until its TTL: `session_busy`).
        let mut busy = None;
        match round(sql, &layer, command, &mut busy).await {
            Err(error) => {
                if let Err(error) = retry.after(error).await {
                    return Err(busy.unwrap_or(error));
                }
            }
            done => return done,
        }
    }
}

/// One round: decide on a snapshot, then act on it. A start keeps the
/// round's connection (no transaction, no lock) for its fence and its
/// one-statement grant, so the common case takes one connection from the
/// pool, not three; it gives it back before it opens the locked path. A
/// round that waits for a holder's row leaves the layer's answer in `busy`.
async fn round<S: LayeredBeginSql>(
    sql: &S,
    layer: &Arc<dyn LeaseLayer>,
    command: &BeginCommand,
    busy: &mut Option<Error>,
) -> Result<BeginOutcome> {
    let mut reader = sql.reader().await?;
    let seen = decide_unlocked(sql, &mut reader, command).await?;
    let seen_turn = seen
        .read
        .facts
        .turn
        .as_ref()
        .map(|t| t.view.turn_id.clone());
    match seen.decision {
        BeginDecision::Reject(error) => {
            S::release(reader);
            Err(error)
        }
        BeginDecision::Replay { turn_id } => {
            let view = replay(sql, &mut reader, &seen.read, &turn_id).await?;
            S::release(reader);
            Ok(BeginOutcome::Replay(view))
        }
        BeginDecision::Queued { turn_id } => {
            // Read on the same snapshot's connection; a turn that left the
            // queue meanwhile is decided afresh.
            let queued = queued_turn(sql, &mut *reader, &turn_id, queue_retry(&seen.read)).await?;
            S::release(reader);
            queued.map(BeginOutcome::Queued).ok_or_else(moved)
        }
        BeginDecision::Enqueue { .. } => {
            S::release(reader);
            queue_locked(sql, command, None).await
        }
        BeginDecision::Exhaust => {
            S::release(reader);
            // A turn whose lease is live in the layer is in flight, not
            // exhausted; ask before taking any lock. No new lease can
            // appear for it meanwhile: its attempts are used up.
            let turn_id =
                seen_turn.ok_or_else(|| Error::corrupt("exhausting a begin that has no turn"))?;
            refuse_if_held(
                layer.as_ref(),
                command.session_id.as_str(),
                turn_id.as_str(),
            )
            .await?;
            let mut tx = sql.transaction().await?;
            let decided = decide_in(sql, S::conn(&mut tx), command).await?;
            if !matches!(decided.decision, BeginDecision::Exhaust) {
                S::abandon(tx);
                return Err(moved());
            }
            let now = decided.read.facts.now_ms;
            let view = exhaust(sql, S::conn(&mut tx), turn_id.as_str(), now).await?;
            sql.commit(tx).await?;
            Ok(BeginOutcome::Replay(view))
        }
        BeginDecision::Start { kind, .. } => {
            let fence = sql.reserve_fence(&mut *reader).await?;
            let turn_id = seen_turn.clone().unwrap_or_else(TurnId::generate);
            let token = LeaseToken::generate();
            let digest = token.digest_hex();
            let claim = LeaseClaim::for_begin(
                command,
                turn_id.as_str(),
                &digest,
                fence,
                sql.config().lease_ttl_ms(),
                seen.read.facts.load.cap,
            );
            let asked = Instant::now();
            let acquired = layer.acquire(&claim).await?;
            let mut unwritten_holder = false;
            if let Acquired::Busy { holder_turn_id, .. } = &acquired {
                // The holder's grant may be newer than the snapshot this
                // round decided on (a twin of this request, or the turn
                // that answered the same confirmation): the answer is the
                // one `decide` gives on a snapshot that shows it. Decide
                // again once its row is written.
                if holder_turn_id != claim.turn_id {
                    match fence_of(sql, &mut *reader, holder_turn_id).await? {
                        Some(holder) if holder > seen.read.session_fence => {
                            S::release(reader);
                            return Err(moved());
                        }
                        Some(_) => {}
                        None => unwritten_holder = true,
                    }
                }
            }
            // The rows cannot show a layer's holder as live: a queued head
            // that found the session held waits its turn, and a request
            // that asked to queue is queued behind that holder.
            if let (
                Acquired::Busy {
                    holder_turn_id,
                    expires_in_ms,
                },
                false,
            ) = (&acquired, unwritten_holder)
            {
                if holder_turn_id != claim.turn_id {
                    if kind == StartKind::Dequeue {
                        let retry = agentgate_core::decide::retry_after_ms(*expires_in_ms);
                        let queued =
                            queued_turn(sql, &mut *reader, turn_id.as_str(), retry).await?;
                        S::release(reader);
                        return queued.map(BeginOutcome::Queued).ok_or_else(moved);
                    }
                    if command.queue.is_some() && seen_turn.is_none() {
                        S::release(reader);
                        let holder = (holder_turn_id.clone(), *expires_in_ms);
                        return queue_locked(sql, command, Some(holder)).await;
                    }
                }
            }
            if unwritten_holder {
                S::release(reader);
                *busy = layer_acquired(acquired, claim.turn_id, claim.cap).err();
                return Err(moved());
            }
            // The layer's refusal (busy, at capacity) is the common answer
            // under contention: the reader goes back, not closed.
            let lease_expires_in_ms = match layer_acquired(acquired, claim.turn_id, claim.cap) {
                Ok(ms) => ms,
                Err(refused) => {
                    S::release(reader);
                    return Err(refused);
                }
            };
            let held = Held {
                lease_expires_in_ms,
                turn_id,
                token,
                fence,
            };
            let unwritten = Unwritten {
                layer: Some(Arc::clone(layer)),
                turn_id: held.turn_id.to_string(),
                digest,
            };
            let seen_turn = seen_turn.as_ref();
            let written = write_layered(sql, reader, command, seen_turn, held, asked).await;
            match &written {
                Ok(_) => unwritten.written(),
                Err(_) => unwritten.give_back().await,
            }
            written
        }
    }
}

/// Queues the request (or answers what else the locked path decides that
/// takes no lease) in the store's begin transaction, deciding under its
/// locks. `layer_holder` is the holder the layer just refused the request
/// for, with its remaining lease: it counts as the session's live holder
/// only while the session's row still names it, since its ending clears
/// the row under the lock this transaction holds, so a request is never
/// queued behind a turn that has already ended (no handoff would follow).
/// A start decided here is the next round's: `conflict`.
///
/// # Errors
/// The decision's refusal, the store's error, or `conflict`.
async fn queue_locked<S: LayeredBeginSql>(
    sql: &S,
    command: &BeginCommand,
    layer_holder: Option<(String, i64)>,
) -> Result<BeginOutcome> {
    let mut tx = sql.transaction().await?;
    let conn = S::conn(&mut tx);
    let mut locked = sql.lock_and_read(conn, command).await?;
    if let Some((turn_id, expires_in_ms)) = layer_holder {
        let row = sql
            .fetch_optional(
                On::Conn(conn),
                Statement::new("SELECT holder_turn_id FROM ag_sessions WHERE session_id = $1")
                    .text(command.session_id.as_str()),
            )
            .await?;
        let named = match row {
            Some(row) => S::columns(&row).text("holder_turn_id")?,
            None => None,
        };
        let now = locked.facts.now_ms;
        match (&mut locked.session, named) {
            (Some(session), Some(named)) if named == turn_id => {
                session.holder = Some(HolderSnapshot {
                    turn_id,
                    lease_expires_at_ms: now.saturating_add(expires_in_ms.max(1)),
                });
            }
            _ => {
                S::abandon(tx);
                return Err(moved());
            }
        }
    }
    let decided = decide_on(sql, conn, command, locked).await?;
    if matches!(
        decided.decision,
        BeginDecision::Start { .. } | BeginDecision::Exhaust
    ) {
        S::abandon(tx);
        return Err(moved());
    }
    let answer = apply(sql, conn, command, decided, Lease::Take).await;
    crate::begin::commit_if_wrote(sql, tx, answer).await
}

/// The fence of `turn_id`'s latest grant, if its row is written.
async fn fence_of<S: BeginSql>(sql: &S, conn: &mut S::Conn, turn_id: &str) -> Result<Option<i64>> {
    let row = sql
        .fetch_optional(
            On::Conn(conn),
            Statement::new("SELECT fence FROM ag_turns WHERE turn_id = $1").text(turn_id),
        )
        .await?;
    row.map(|row| S::columns(&row).int_required("fence"))
        .transpose()
}

/// Whether a lease the layer granted `asked` ago, for `granted_ms`, has
/// lapsed on this process's clock.
fn lapsed(granted_ms: i64, asked: Instant) -> bool {
    u128::try_from(granted_ms).map_or(true, |ms| ms <= asked.elapsed().as_millis())
}

/// Writes the start whose lease the layer already holds, if the same start
/// still holds; the round's `conflict` (decide afresh) when it wrote
/// nothing. The round's connection serves the one-statement grant and goes
/// back to the pool before the locked path takes its own.
async fn write_layered<S: LayeredBeginSql>(
    sql: &S,
    mut reader: S::Reader,
    command: &BeginCommand,
    seen_turn: Option<&TurnId>,
    held: Held,
    asked: Instant,
) -> Result<BeginOutcome> {
    if lapsed(held.lease_expires_in_ms, asked) {
        S::release(reader);
        return Err(moved());
    }
    if seen_turn.is_none()
        && command.confirmation.is_none()
        && sql.grant_layered_new(&mut *reader, command, &held).await?
    {
        S::release(reader);
        return Ok(BeginOutcome::Started(Grant::first(
            command,
            held.turn_id,
            held.token,
            held.fence,
            held.lease_expires_in_ms,
        )));
    }
    S::release(reader);
    let mut tx = sql.transaction().await?;
    let decided = decide_in(sql, S::conn(&mut tx), command).await?;
    let same_turn = decided.read.facts.turn.as_ref().map(|t| &t.view.turn_id) == seen_turn;
    if !matches!(decided.decision, BeginDecision::Start { .. })
        || !same_turn
        || decided.read.session_fence >= held.fence.0
        || lapsed(held.lease_expires_in_ms, asked)
    {
        S::abandon(tx);
        return Err(moved());
    }
    let (outcome, _) = apply(sql, S::conn(&mut tx), command, decided, Lease::Held(held)).await?;
    sql.commit(tx).await?;
    Ok(outcome)
}
