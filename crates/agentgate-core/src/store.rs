//! The [`Store`] trait: the atomic steps of the turn protocol.
//!
//! Each method is one atomic step in the backend (one SQL transaction, or one
//! Redis script plus one SQL transaction). Every method after `begin` is
//! conditioned on the caller's lease token and fence; a caller whose lease is
//! gone gets `lease_lost` and changes nothing. Expiry is judged on the store's
//! clock only.
//!
//! Architecture invariant: a store applies [`crate::decide`]'s decisions; it
//! does not make protocol decisions of its own.

use std::any::Any;
use std::future::Future;
use std::pin::Pin;

use async_trait::async_trait;
use serde_json::Value;

use crate::canonical::CanonicalJson;
use crate::config::Config;
use crate::error::{BoxError, Result};
use crate::ids::{ExecutionId, SessionId, TurnId, UserId};
use crate::model::{
    BeginCommand, BeginOutcome, ClaimedOrphan, Ending, EventPage, ExecutionView, IgnoredCancel,
    JournalEntry, LeaseRef, NewEvent, OnBusy, Orphan, OrphanFilter, Overview, SessionView,
    SweepReport, ToolCall, ToolClaim, TurnView, UserView,
};
use crate::page::{ExecutionPage, ExecutionPageRequest};

/// A boxed, sendable future.
pub type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// A side effect that runs inside the SQL transaction that marks a tool
/// execution succeeded: both commit or neither does.
///
/// `connection` is the store's native connection with the transaction open
/// (`sqlx::SqliteConnection`, `sqlx::PgConnection`, `sqlx::MySqlConnection`),
/// passed as `Any` so this crate knows no driver; the `agentgate` library
/// wraps it in a typed enum. The returned value becomes the stored result.
pub trait SqlEffect: Send {
    /// Applies the effect on `connection`.
    fn apply<'a>(
        &'a mut self,
        connection: &'a mut (dyn Any + Send),
    ) -> BoxFuture<'a, std::result::Result<Value, BoxError>>;
}

/// How a tool execution completes.
pub enum Completion<'a> {
    /// With a result computed outside the store.
    Result(CanonicalJson),
    /// With a side effect run in the same SQL transaction as the success mark.
    Effect(&'a mut dyn SqlEffect),
}

/// Lease state after a heartbeat.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LeaseStatus {
    /// Remaining lease on the store's clock.
    pub lease_expires_in_ms: i64,
    /// Whether the turn was asked to stop ([`Store::request_cancel`]): the
    /// holder should end it with [`crate::model::Ending::Cancel`].
    pub cancel_requested: bool,
}

/// A backend that keeps agentgate's records and leases.
#[async_trait]
pub trait Store: Send + Sync + std::fmt::Debug + 'static {
    /// The settings this store was opened with.
    fn config(&self) -> &Config;

    /// Begins a turn: docs/protocol.md §3.1, atomically.
    ///
    /// # Errors
    /// `payload_mismatch`, `request_in_flight`, `awaiting_confirmation`,
    /// `session_busy`, `user_at_capacity`, `not_found` (another user's
    /// session, or no such pending confirmation), `store_unavailable`.
    async fn begin(&self, command: &BeginCommand) -> Result<BeginOutcome>;

    /// Renews the session lease, the permit and the turn together.
    ///
    /// # Errors
    /// `lease_lost`, `not_found`, `store_unavailable`.
    async fn heartbeat(&self, lease: &LeaseRef) -> Result<LeaseStatus>;

    /// Claims a tool execution for the lease holder.
    ///
    /// # Errors
    /// `lease_lost`, `tool_in_flight`, `attempts_exhausted`, `not_found`,
    /// `store_unavailable`.
    async fn claim_tool(&self, lease: &LeaseRef, call: &ToolCall) -> Result<ToolClaim>;

    /// Marks a claimed execution succeeded, running `completion`'s effect in
    /// the same transaction when given. Returns the stored result.
    ///
    /// # Errors
    /// `lease_lost` (also when the execution was re-claimed by a newer lease
    /// or is not running), `not_found`, `effect_failed` (rolled back),
    /// `invalid_request` (result over limits), `store_unavailable`.
    async fn complete_tool(
        &self,
        lease: &LeaseRef,
        execution_id: &ExecutionId,
        completion: Completion<'_>,
    ) -> Result<Value>;

    /// Marks a claimed execution failed; the next claim executes it again.
    ///
    /// # Errors
    /// As [`Store::complete_tool`].
    async fn fail_tool(
        &self,
        lease: &LeaseRef,
        execution_id: &ExecutionId,
        error: &CanonicalJson,
    ) -> Result<()>;

    /// Ends the turn and releases its session lease and permit atomically.
    ///
    /// # Errors
    /// `lease_lost`, `not_found`, `store_unavailable`.
    async fn end_turn(&self, lease: &LeaseRef, ending: &Ending) -> Result<TurnView>;

    /// A turn's view.
    ///
    /// # Errors
    /// `store_unavailable`.
    async fn turn(&self, turn_id: &TurnId) -> Result<Option<TurnView>>;

    /// Asks a running turn to stop, cooperatively: records the request on
    /// the turn (once; a repeat changes nothing) without a lease token. Its
    /// holder learns it on its next heartbeat (`cancel_requested`) and tool
    /// claim (`turn_cancelled`), and ends it [`crate::model::Ending::Cancel`].
    /// A turn that already ended is left as it is. Returns the turn's view
    /// after the request; `None` when there is no such turn.
    ///
    /// # Errors
    /// `store_unavailable`.
    async fn request_cancel(&self, turn_id: &TurnId) -> Result<Option<TurnView>>;

    /// An operator's force-release of `session_id`: ends the turn its row
    /// names as holder (live or expired) `abandoned`, with
    /// [`crate::decide::RELEASED_ERROR`], frees the session and the permit,
    /// and bumps the session's fence, in one atomic step; with a lease
    /// layer, then revokes the holder's lease there. Every later write of
    /// the old holder is refused (`lease_lost`); a repeat of its request
    /// restarts it. Returns the released turn's view; `None` when the
    /// session has no holder (or does not exist), or `only` names another
    /// turn than its holder, and nothing was written.
    ///
    /// # Errors
    /// `store_unavailable`; `corrupt` for a holder that is not a running
    /// turn.
    async fn force_release(
        &self,
        session_id: &SessionId,
        only: Option<&TurnId>,
    ) -> Result<Option<TurnView>>;

    /// Running turns asked to stop at least `config().cancel_grace` ago
    /// (store clock), the longest-asked first, at most `limit` (capped at
    /// [`crate::limits::MAX_ORPHAN_SCAN`]).
    ///
    /// # Errors
    /// `store_unavailable`.
    async fn ignored_cancels(&self, limit: u32) -> Result<Vec<IgnoredCancel>>;

    /// Force-releases ([`Store::force_release`], of that holder only) the
    /// running turns that were asked to stop and did not end within the
    /// cancel grace, at most [`crate::limits::MAX_ORPHAN_SCAN`] per call;
    /// returns how many. A turn that ended meanwhile, or whose session has
    /// passed to another turn, is left as it is. A turn whose lease lapsed
    /// is released all the same: it was asked to stop, so no one is to
    /// take it over.
    ///
    /// # Errors
    /// `store_unavailable`.
    async fn release_ignored_cancels(&self) -> Result<u64> {
        let mut released = 0;
        for ignored in self.ignored_cancels(crate::limits::MAX_ORPHAN_SCAN).await? {
            if self
                .force_release(&ignored.session_id, Some(&ignored.turn_id))
                .await?
                .is_some()
            {
                released += 1;
            }
        }
        Ok(released)
    }

    /// A watch on releases of `session_id` (an ending, an abandon, a
    /// force-release), taken before a begin attempt so that a release
    /// between the attempt and the wait is not missed. How far it reaches
    /// is the store's: in-process on every store, across nodes where the
    /// store has a notification. A waiter never relies on it alone: it
    /// waits at most its poll.
    fn watch_releases(&self, session_id: &SessionId) -> Box<dyn ReleaseWatch>;

    /// One page of a turn's tool executions, oldest first: those after
    /// `page.after` in (claim number, id) order, read with a keyset query,
    /// at most `page.limit()` of them and at most
    /// [`crate::limits::MAX_EXECUTION_PAGE_BYTES`] of results and errors
    /// (see [`crate::page`]). [`all_executions`] walks every page.
    ///
    /// # Errors
    /// `store_unavailable`.
    async fn executions(
        &self,
        turn_id: &TurnId,
        page: &ExecutionPageRequest,
    ) -> Result<ExecutionPage>;

    /// A session's view.
    ///
    /// # Errors
    /// `store_unavailable`.
    async fn session(&self, session_id: &SessionId) -> Result<Option<SessionView>>;

    /// A user's view: cap in force and live holders.
    ///
    /// # Errors
    /// `store_unavailable`.
    async fn user(&self, user_id: &UserId) -> Result<UserView>;

    /// Sets (or with `None` clears) a user's cap override.
    ///
    /// # Errors
    /// `invalid_request` for a cap out of range, `store_unavailable`.
    async fn set_user_cap(&self, user_id: &UserId, cap: Option<u32>) -> Result<()>;

    /// Appends `events` to the turn's log under the caller's lease, in
    /// one step, and wakes its followers ([`Store::watch_events`]); the
    /// last new event's id. Refused whole, nothing written, as
    /// [`crate::decide::check_event_append`] says.
    ///
    /// # Errors
    /// `lease_lost`, `not_found`, `invalid_request`, `store_unavailable`.
    async fn append_events(&self, lease: &LeaseRef, events: &[NewEvent]) -> Result<u64>;

    /// The turn's events after `after` (0: from the first), at most
    /// `limit` (capped at [`crate::limits::MAX_EVENT_PAGE`]), with the
    /// turn's state read first; `None` when there is no such turn.
    ///
    /// # Errors
    /// `store_unavailable`.
    async fn events(&self, turn_id: &TurnId, after: u64, limit: u32) -> Result<Option<EventPage>>;

    /// A watch that wakes when `turn_id`'s log may have grown or the turn
    /// may have ended, through this handle or (where the store notifies
    /// across nodes) another node; a follower still re-reads at least every
    /// [`crate::limits::EVENT_POLL`].
    fn watch_events(&self, turn_id: &TurnId) -> Box<dyn ReleaseWatch>;

    /// Sets `session_id`'s default busy policy, the one a begin that names
    /// none follows; a session not yet used is created, bound to
    /// `user_id`. Returns the session's view. Setting it keeps the session
    /// from the sweeper for a retention, as a begin does.
    ///
    /// # Errors
    /// `not_found` when the session is bound to another user;
    /// `store_unavailable`.
    async fn set_session_policy(
        &self,
        user_id: &UserId,
        session_id: &SessionId,
        on_busy: OnBusy,
    ) -> Result<SessionView>;

    /// Live leases and the latest turns and tool executions, at most `limit`
    /// of each (capped at [`crate::limits::MAX_OVERVIEW_ROWS`]).
    ///
    /// # Errors
    /// `store_unavailable`.
    async fn overview(&self, limit: u32) -> Result<Overview>;

    /// Ends orphans whose grace ran out `abandoned` (see
    /// [`Store::abandon_orphans`]), force-releases turns that ignored their
    /// cancel past its grace ([`Store::release_ignored_cancels`]), then
    /// deletes up to `config().sweep_batch`
    /// records that ended more than `result_retention` ago (store clock).
    ///
    /// # Errors
    /// `store_unavailable`.
    async fn sweep(&self) -> Result<SweepReport>;

    /// Orphans: running turns whose lease is gone without an ending, the
    /// longest-orphaned first, at most `limit` (capped at
    /// [`crate::limits::MAX_ORPHAN_SCAN`]), filtered by `filter`.
    ///
    /// Where the lease layer keeps no expiry (Redis), a turn's orphan time
    /// is when a listing first found it unheld, recorded on its row.
    ///
    /// # Errors
    /// `invalid_request` for a filter over its limits, `store_unavailable`.
    async fn orphans(&self, filter: &OrphanFilter, limit: u32) -> Result<Vec<Orphan>>;

    /// The heads of session queues, as turns a repeat of their own request
    /// starts ([`Orphan::resume_command`]; the begin decides whether the
    /// head may start now): of `session` alone when given (the caller just
    /// ended its holder: [`take_next`]), else of every session that names
    /// no holder and has been free for `filter.min_orphaned_ms` (a caller
    /// that declined its handoff, or died before taking it), longest-free
    /// first, at most `limit` (capped at
    /// [`crate::limits::MAX_ORPHAN_SCAN`]).
    ///
    /// # Errors
    /// `invalid_request` for a filter over its limits, `store_unavailable`.
    async fn queue_heads(
        &self,
        session: Option<&SessionId>,
        filter: &OrphanFilter,
        limit: u32,
    ) -> Result<Vec<Orphan>>;

    /// Ends `orphan` `abandoned` and releases its session, in one atomic
    /// step, if it is still that orphan: running under `orphan.fence` with no
    /// live lease. Returns whether it did; `false` means someone took it
    /// over or ended it meanwhile, and nothing was written.
    ///
    /// # Errors
    /// `store_unavailable`.
    async fn abandon(&self, orphan: &Orphan) -> Result<bool>;

    /// Takes over the longest-orphaned turn that passes `filter`, exactly
    /// like a takeover (new token, higher fence, `attempt + 1`), and returns
    /// what resuming it needs. `None` when there is no orphan to claim.
    ///
    /// A claim is a begin that repeats the orphan's own request, so the
    /// store's one atomic begin step decides it: many workers racing for one
    /// orphan get one grant, the others pass to the next orphan; an orphan
    /// past its attempts is recorded failed (`attempts_exhausted`) and
    /// passed over.
    ///
    /// # Errors
    /// `invalid_request` for a bad filter, `store_unavailable`.
    async fn claim_orphan(&self, filter: &OrphanFilter) -> Result<Option<ClaimedOrphan>> {
        Ok(claim_orphan_timed(self, filter, || (), JournalRead::All)
            .await?
            .map(|(claimed, ())| claimed))
    }

    /// [`Store::claim_orphan`] reading only the first page of the journal
    /// (`ExecutionPageRequest::default()`: at most
    /// [`crate::limits::DEFAULT_EXECUTION_PAGE`] executions and
    /// [`crate::limits::MAX_EXECUTION_PAGE_BYTES`] of results), the cursor
    /// of the rest in [`ClaimedOrphan::journal_next`]: for an answer that
    /// goes over the wire, so a turn of many large results never makes one
    /// huge answer.
    ///
    /// # Errors
    /// As [`Store::claim_orphan`].
    async fn claim_orphan_first_page(
        &self,
        filter: &OrphanFilter,
    ) -> Result<Option<ClaimedOrphan>> {
        Ok(
            claim_orphan_timed(self, filter, || (), JournalRead::FirstPage)
                .await?
                .map(|(claimed, ())| claimed),
        )
    }

    /// Ends `abandoned` the orphans whose grace
    /// ([`Config::orphan_grace_ms`]) ran out, at most
    /// [`crate::limits::MAX_ORPHAN_SCAN`] per call; returns how many.
    ///
    /// # Errors
    /// `store_unavailable`.
    async fn abandon_orphans(&self) -> Result<u64> {
        let grace_ms = self.config().orphan_grace_ms();
        let filter = OrphanFilter {
            min_orphaned_ms: u64::try_from(grace_ms).unwrap_or(u64::MAX),
            ..OrphanFilter::default()
        };
        let mut abandoned = 0;
        for orphan in self
            .orphans(&filter, crate::limits::MAX_ORPHAN_SCAN)
            .await?
        {
            assert!(
                crate::decide::abandon_due(0, orphan.orphaned_for_ms, grace_ms),
                "orphans() returned an orphan younger than the filter's age"
            );
            if self.abandon(&orphan).await? {
                abandoned += 1;
            }
        }
        Ok(abandoned)
    }
}

/// A watch taken by [`Store::watch_releases`].
#[async_trait]
pub trait ReleaseWatch: Send {
    /// Resolves when the session may have been released since the watch
    /// was taken, or after `max`; whether a release woke it.
    async fn wait(&mut self, max: std::time::Duration) -> bool;

    /// Whether a release made on another node reaches this watch now: its
    /// store has a notification and this node is listening to it. `false`
    /// means a release elsewhere is found by the waiter's poll alone.
    fn across_nodes(&self) -> bool {
        false
    }
}

/// How much of a claimed orphan's journal a claim reads.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum JournalRead {
    /// Every execution, page by page ([`all_executions`]): a worker in this
    /// process resuming the turn.
    All,
    /// The first page, and the cursor of the rest
    /// ([`Store::claim_orphan_first_page`]).
    FirstPage,
}

/// [`Store::claim_orphan`], also returning `mark()` as taken just before the
/// begin that made the claim: a caller that runs a local lease deadline (the
/// library's watchdog) measures it from there, not from before a scan that
/// may have lost several races first. The core reads no clock; the caller
/// passes one in.
///
/// # Errors
/// As [`Store::claim_orphan`].
pub async fn claim_orphan_timed<S, T>(
    store: &S,
    filter: &OrphanFilter,
    mark: impl Fn() -> T + Send + Sync,
    journal: JournalRead,
) -> Result<Option<(ClaimedOrphan, T)>>
where
    S: Store + ?Sized,
    T: Send,
{
    filter.validate()?;
    let orphans = store
        .orphans(filter, crate::limits::MAX_ORPHAN_SCAN)
        .await?;
    let orphans = orphans.into_iter().filter(|o| !o.superseded);
    if let Some(claimed) = claim_first(store, orphans, &mark, journal).await? {
        return Ok(Some(claimed));
    }
    let heads = store
        .queue_heads(None, filter, crate::limits::MAX_ORPHAN_SCAN)
        .await?;
    claim_first(store, heads, &mark, journal).await
}

/// The handoff of the second message (docs/protocol.md §3.8): starts the head of
/// `session_id`'s queue for the caller that just ended its holder (a
/// repeat of the head's own request, so the store's one atomic begin
/// decides it), with its payload. `None` when the queue is empty, or its
/// head is not startable now (another caller took it first, the session
/// is held again or awaits a confirmation, the user is at its cap): the
/// head then stays queued for a later handoff or claim. A new request
/// never jumps a waiting queue (`decide`), so nothing can slip in between
/// the ending and this begin but the head's own start.
///
/// # Errors
/// As [`Store::begin`], except the refusals that mean "not now".
pub async fn take_next_timed<S, T>(
    store: &S,
    session_id: &SessionId,
    mark: impl Fn() -> T + Send + Sync,
) -> Result<Option<(ClaimedOrphan, T)>>
where
    S: Store + ?Sized,
    T: Send,
{
    // The head is read before its begin, outside any lock: a supersede or
    // a cancel can change it in between (the begin then replays it), so the
    // head is read again, until a head refuses to start or none is left.
    // Each pass ends one queued turn or stops: bounded by the queue's bound.
    let mut refused: Option<TurnId> = None;
    for _ in 0..=crate::limits::MAX_SESSION_QUEUE {
        let heads = store
            .queue_heads(Some(session_id), &OrphanFilter::default(), 1)
            .await?;
        let Some(head) = heads.into_iter().next() else {
            return Ok(None);
        };
        if refused.as_ref() == Some(&head.turn_id) {
            return Ok(None);
        }
        refused = Some(head.turn_id.clone());
        if let Some(claimed) = claim_first(store, [head], &mark, JournalRead::All).await? {
            return Ok(Some(claimed));
        }
    }
    Ok(None)
}

/// Begins each candidate's own request in turn until one is granted; that
/// one with its payload and journal, and `mark()` taken just before its
/// begin.
async fn claim_first<S, T>(
    store: &S,
    candidates: impl IntoIterator<Item = Orphan> + Send,
    mark: &(impl Fn() -> T + Send + Sync),
    journal: JournalRead,
) -> Result<Option<(ClaimedOrphan, T)>>
where
    S: Store + ?Sized,
    T: Send,
{
    for orphan in candidates {
        let marked = mark();
        let outcome = store.begin(&orphan.resume_command()).await;
        let Some(grant) = crate::decide::orphan_claim_step(outcome)? else {
            continue;
        };
        let (executions, journal_next) = match journal {
            JournalRead::All => (all_executions(store, &grant.turn_id).await?, None),
            JournalRead::FirstPage => {
                let page = store
                    .executions(&grant.turn_id, &ExecutionPageRequest::default())
                    .await?;
                (page.executions, page.next)
            }
        };
        let journal = executions
            .into_iter()
            .map(JournalEntry::from_view)
            .collect::<Result<Vec<_>>>()?;
        let payload = match &orphan.payload {
            Some(json) => serde_json::from_str(json.as_str())
                .map_err(|e| crate::error::Error::corrupt(format!("stored payload: {e}")))?,
            None => Value::Null,
        };
        let claimed = ClaimedOrphan {
            grant,
            payload,
            journal,
            journal_next,
            orphaned_for_ms: orphan.orphaned_for_ms,
        };
        return Ok(Some((claimed, marked)));
    }
    Ok(None)
}

/// Every tool execution of a turn, oldest first, read page by page (at most
/// [`crate::limits::MAX_EXECUTIONS_PER_TURN`] of them, so a bounded walk).
/// For callers that need the whole journal, such as a resuming worker.
///
/// # Errors
/// `store_unavailable`.
pub async fn all_executions<S>(store: &S, turn_id: &TurnId) -> Result<Vec<ExecutionView>>
where
    S: Store + ?Sized,
{
    let mut request = ExecutionPageRequest::largest();
    let mut all = Vec::new();
    loop {
        let page = store.executions(turn_id, &request).await?;
        if page.executions.is_empty() && page.next.is_some() {
            return Err(crate::error::Error::corrupt(
                "an empty page of executions with a next",
            ));
        }
        all.extend(page.executions);
        match page.next {
            Some(next) => request = request.after(next),
            None => return Ok(all),
        }
    }
}
