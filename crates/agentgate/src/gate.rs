//! [`Gate`]: the entry point. Opens a store by URL, begins turns, and runs
//! the retention sweeper in the background.

use agentgate_core::limits::SWEEP_BATCHES_PER_TICK;
use std::sync::Arc;

use agentgate_core::config::Config;
use agentgate_core::error::{Error, Result};
use agentgate_core::ids::{ClientRequestId, SessionId, TurnId, UserId};
use agentgate_core::lease::LeaseLayer;
use agentgate_core::model::{
    BeginCommand, BeginOutcome, Confirmation, Decision, JournalEntry, OnBusy, OrphanFilter,
    QueuedTurn, SessionView, TurnView,
};
use agentgate_core::store::Store;
use serde_json::Value;
use tokio_util::sync::{CancellationToken, DropGuard};

use crate::busy::BusyReport;
use crate::to_end::RunToEnd;
use crate::turn::Turn;
use crate::watchdog::LocalTurns;

/// What [`Gate::begin`] did.
#[derive(Debug)]
pub enum Begun {
    /// A lease was granted: run the turn, then end it.
    Started(Turn),
    /// The request already ended; its stored outcome. No lease was taken.
    Replay(TurnView),
    /// The request waits in its session's queue (`on_busy: enqueue` or
    /// `supersede`, or a repeat of a queued request). No lease was taken;
    /// it starts when the previous holder's caller takes it
    /// ([`Gate::take_next`]), or a recovery worker claims it.
    Queued(QueuedTurn),
}

/// An orphaned turn a recovery worker took over with [`Gate::claim_orphan`]:
/// a live [`Turn`] (watchdog running, like any start) and what resuming it
/// needs. Resume by running the turn's work again from `payload`: tool
/// calls that succeeded return their stored result from [`Turn::tool`]
/// without running, and those in the journal as `unknown` come back as
/// `Execute` with `previous_outcome: unknown`.
#[derive(Debug)]
pub struct Recovered {
    /// The turn, under a new lease: higher fence, `attempt + 1`.
    pub turn: Turn,
    /// The original request's payload.
    pub payload: Value,
    /// The turn's tool executions before the takeover, oldest first.
    pub journal: Vec<JournalEntry>,
    /// How long it had been without a live lease.
    pub orphaned_for_ms: i64,
}

/// The engine over one store. Cheap to clone; the background sweeper stops
/// when the last clone is dropped.
#[derive(Clone, Debug)]
pub struct Gate {
    store: Arc<dyn Store>,
    /// Counts the steps running now (the same store as `store`).
    to_end: Arc<RunToEnd>,
    _sweeper: Arc<DropGuard>,
    /// What this gate's sweeper ended, for metrics.
    swept: Arc<Swept>,
    /// The turns this gate holds in this process.
    local: LocalTurns,
    /// The turns whose events this gate's followers read, one feed each.
    feeds: crate::events::Feeds,
    /// Begins of this gate waiting now for a busy session (`wait`, and
    /// `interrupt` while its holder stops).
    waiting: Arc<std::sync::atomic::AtomicUsize>,
}

impl Gate {
    /// Opens the store at `url` and starts the sweeper.
    ///
    /// Supported: `sqlite://path` (created if missing),
    /// `postgres://user@host:port/db` (also `postgresql://`) and
    /// `mysql://user:password@host:port/db` (also `mariadb://`).
    ///
    /// # Errors
    /// `invalid_request` for an unknown scheme or a config out of range;
    /// `store_unavailable` when the store cannot be opened.
    pub async fn open(url: &str, config: Config) -> Result<Self> {
        Self::connect(url, None, config).await
    }

    /// Opens the SQL store at `store_url` with, when `redis_url` is given,
    /// the Redis lease layer (`redis://host:port/db[?key_prefix=...]`)
    /// holding session leases and permits. Durable records and fences stay
    /// in the SQL store either way.
    ///
    /// # Errors
    /// As [`Gate::open`]; also `store_unavailable` when Redis is unreachable.
    pub async fn connect(store_url: &str, redis_url: Option<&str>, config: Config) -> Result<Self> {
        config.validate()?;
        let leases = match redis_url {
            Some(url) => Some(lease_layer(url).await?),
            None => None,
        };
        open_store(store_url, leases, config)
            .await
            .map(Self::with_store)
    }

    /// Opens the SQL store at `store_url` with a caller-supplied lease layer
    /// (see [`agentgate_core::lease::LeaseLayer`]).
    ///
    /// # Errors
    /// As [`Gate::open`].
    pub async fn connect_with_layer(
        store_url: &str,
        layer: Arc<dyn LeaseLayer>,
        config: Config,
    ) -> Result<Self> {
        config.validate()?;
        open_store(store_url, Some(layer), config)
            .await
            .map(Self::with_store)
    }

    /// Wraps an opened store and starts the sweeper.
    ///
    /// Every step of `store` then runs to its end in a task of its own,
    /// whoever stops waiting for it, within
    /// [`agentgate_core::limits::STORE_STEP_DEADLINE`] ([`RunToEnd`]).
    pub fn with_store(store: Arc<dyn Store>) -> Self {
        let to_end = Arc::new(RunToEnd::new(store));
        let store: Arc<dyn Store> = Arc::clone(&to_end) as Arc<dyn Store>;
        let stop = CancellationToken::new();
        let swept = Arc::default();
        tokio::spawn(sweep_forever(
            Arc::clone(&store),
            stop.clone(),
            Arc::clone(&swept),
        ));
        Self {
            store,
            to_end,
            _sweeper: Arc::new(stop.drop_guard()),
            swept,
            local: LocalTurns::default(),
            feeds: crate::events::Feeds::default(),
            waiting: Arc::default(),
        }
    }

    /// Follows `turn_id`'s event log after the event id `after` (0: from
    /// the first): every event in id order, live while the turn runs,
    /// then [`crate::events::Followed::End`] once it ended. Any node
    /// sharing the store can follow any turn; the followers of one turn on
    /// this gate share one store read per change (see [`crate::events`]).
    /// A reader that drops the stream and follows again after the last id
    /// it saw misses nothing and sees nothing twice.
    ///
    /// # Errors
    /// `store_unavailable` when this node follows
    /// [`agentgate_core::limits::MAX_FOLLOWED_TURNS`] turns already; the
    /// stream itself yields `not_found` for no such turn, and the store's
    /// errors.
    pub fn follow(&self, turn_id: &TurnId, after: u64) -> Result<crate::events::EventStream> {
        crate::events::follow(&self.feeds, &self.store, turn_id, after)
    }

    /// Begins of this gate waiting now for a busy session to be released
    /// (`wait`, and `interrupt` while its holder stops).
    pub fn waiting_begins(&self) -> usize {
        self.waiting.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Counts one waiting begin until the guard drops.
    pub(crate) fn waiting_guard(&self) -> WaitingGuard {
        self.waiting
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        WaitingGuard(Arc::clone(&self.waiting))
    }

    /// Store steps running now, their callers waiting or not: a step whose
    /// caller stopped waiting still runs to its end ([`RunToEnd`]).
    pub fn steps_in_flight(&self) -> usize {
        self.to_end.steps_in_flight()
    }

    /// Turns this gate's followers follow now (one feed each).
    pub fn followed_turns(&self) -> usize {
        self.feeds.followed()
    }

    /// How many orphans this gate's background sweeper has ended
    /// `abandoned` since it started.
    pub fn abandoned_total(&self) -> u64 {
        self.swept
            .abandoned
            .load(std::sync::atomic::Ordering::Relaxed)
    }

    /// How many turns this gate's background sweeper has force-released
    /// since it started because they ignored their cancel past the grace
    /// ([`Config::cancel_grace`]).
    pub fn released_total(&self) -> u64 {
        self.swept
            .released
            .load(std::sync::atomic::Ordering::Relaxed)
    }

    /// The store, for callers that drive the protocol by lease token (the
    /// HTTP service) rather than through a [`Turn`] guard.
    pub fn store(&self) -> &Arc<dyn Store> {
        &self.store
    }

    /// The settings in force.
    pub fn config(&self) -> &Config {
        self.store.config()
    }

    /// Begins a turn for `user` in `session`, keyed by `client_request_id`.
    /// A busy session is handled by the session's default policy
    /// ([`Gate::set_session_policy`]; `reject` when none was set).
    ///
    /// # Errors
    /// `invalid_request` for bad ids or payload; `payload_mismatch`;
    /// `request_in_flight`, `session_busy`, `awaiting_confirmation` and
    /// `user_at_capacity` with a `retry_after`; `not_found` for another
    /// user's session; `store_unavailable`.
    pub async fn begin(
        &self,
        user: &str,
        session: &str,
        client_request_id: &str,
        payload: &Value,
    ) -> Result<Begun> {
        let command = BeginCommand::new(
            UserId::new(user)?,
            SessionId::new(session)?,
            ClientRequestId::new(client_request_id)?,
            payload,
            None,
        )?;
        Ok(self.begin_by_session(&command).await?.0)
    }

    /// Begins the confirmation turn that answers `pending_turn`'s pending
    /// action with `decision`. A second confirmation of the same pending turn
    /// replays the first one's outcome or gets `request_in_flight`.
    ///
    /// # Errors
    /// `not_found` when `pending_turn` awaits no live confirmation; otherwise
    /// as [`Gate::begin`].
    pub async fn confirm(
        &self,
        user: &str,
        session: &str,
        client_request_id: &str,
        pending_turn: &str,
        decision: Decision,
    ) -> Result<Begun> {
        let confirmation = Confirmation {
            turn_id: TurnId::new(pending_turn)?,
            decision,
        };
        let command = BeginCommand::new(
            UserId::new(user)?,
            SessionId::new(session)?,
            ClientRequestId::new(client_request_id)?,
            &Value::Null,
            Some(confirmation),
        )?;
        self.begin_command(&command).await
    }

    /// Asks the running turn `turn_id` to stop (no lease needed; a repeat,
    /// or a turn that already ended, changes nothing). A holder in this
    /// process on this gate is signalled at once; one elsewhere when its
    /// next heartbeat (at most a third of the TTL away) or tool claim
    /// reports it. Either way its [`crate::Turn::cancellation`] fires, and
    /// it ends the turn `cancelled`. Returns the turn's view; `None` when
    /// there is no such turn.
    ///
    /// # Errors
    /// `store_unavailable`.
    pub async fn request_cancel(&self, turn_id: &TurnId) -> Result<Option<TurnView>> {
        let view = self.store.request_cancel(turn_id).await?;
        if view.as_ref().is_some_and(|v| {
            v.cancel_requested_at_ms.is_some()
                && v.state == agentgate_core::model::TurnState::Running
        }) {
            self.local.fire(turn_id);
        }
        Ok(view)
    }

    /// Force-releases `session_id` (an operator's call): see
    /// [`Store::force_release`]. A holder in this process on this gate is
    /// signalled at once; its every later write is refused either way.
    /// Returns the released turn (`abandoned`), or `None` when the session
    /// had no holder.
    ///
    /// # Errors
    /// `store_unavailable`.
    pub async fn force_release(&self, session_id: &SessionId) -> Result<Option<TurnView>> {
        let released = self.store.force_release(session_id, None).await?;
        if let Some(view) = &released {
            tracing::warn!(%session_id, turn_id = %view.turn_id, "session force-released");
            self.local.fire(&view.turn_id);
        }
        Ok(released)
    }

    /// Begins `command` under `on_busy` when its session is held by
    /// another turn: `reject` answers `session_busy` at once (as
    /// [`Gate::begin_command`]), `wait` waits up to `on_busy.wait` for the
    /// session to come free, `interrupt` first asks the holder to stop (a
    /// cancel request). See [`crate::busy`].
    ///
    /// # Errors
    /// As [`Gate::begin`]; `session_busy` when the bound ran out.
    pub async fn begin_on_busy(
        &self,
        command: &BeginCommand,
        on_busy: OnBusy,
    ) -> Result<(Begun, BusyReport)> {
        let done = crate::busy::begin(self, command, on_busy).await?;
        Ok((self.begun(done.outcome, done.requested_at), done.report))
    }

    /// [`Gate::begin_on_busy`] for a caller that runs no [`Turn`] here (the
    /// HTTP service: its caller heartbeats): the store's outcome, with no
    /// watchdog started.
    ///
    /// # Errors
    /// As [`Gate::begin_on_busy`].
    pub async fn begin_outcome_on_busy(
        &self,
        command: &BeginCommand,
        on_busy: OnBusy,
    ) -> Result<(BeginOutcome, BusyReport)> {
        let done = crate::busy::begin(self, command, on_busy).await?;
        Ok((done.outcome, done.report))
    }

    /// Begins `command`, which names no busy policy, under its session's
    /// default ([`Gate::set_session_policy`]; `reject` when none was set).
    /// The default is read only when the session is found busy.
    ///
    /// # Errors
    /// As [`Gate::begin_on_busy`].
    pub async fn begin_by_session(&self, command: &BeginCommand) -> Result<(Begun, BusyReport)> {
        let done = crate::busy::begin_by_session(self, command).await?;
        Ok((self.begun(done.outcome, done.requested_at), done.report))
    }

    /// [`Gate::begin_by_session`] for a caller that runs no [`Turn`] here
    /// (the HTTP service).
    ///
    /// # Errors
    /// As [`Gate::begin_on_busy`].
    pub async fn begin_outcome_by_session(
        &self,
        command: &BeginCommand,
    ) -> Result<(BeginOutcome, BusyReport)> {
        let done = crate::busy::begin_by_session(self, command).await?;
        Ok((done.outcome, done.report))
    }

    /// Sets `session`'s default busy policy: what a begin that names none
    /// does when the session is busy. A session not used yet is bound to
    /// `user`. Returns the session's view.
    ///
    /// # Errors
    /// `invalid_request` for bad ids; `not_found` for another user's
    /// session; `store_unavailable`.
    pub async fn set_session_policy(
        &self,
        user: &str,
        session: &str,
        on_busy: OnBusy,
    ) -> Result<SessionView> {
        let (user, session) = (UserId::new(user)?, SessionId::new(session)?);
        self.store
            .set_session_policy(&user, &session, on_busy)
            .await
    }

    /// Takes over the longest-orphaned turn that `filter` admits (a running
    /// turn whose lease expired without an ending), exactly like a takeover,
    /// for a recovery worker to resume. `None` when there is none. Many
    /// workers on many nodes never claim the same orphan.
    ///
    /// # Errors
    /// `invalid_request` for a filter over its limits; `store_unavailable`.
    pub async fn claim_orphan(&self, filter: &OrphanFilter) -> Result<Option<Recovered>> {
        let claim = agentgate_core::store::claim_orphan_timed(
            self.store.as_ref(),
            filter,
            tokio::time::Instant::now,
            agentgate_core::store::JournalRead::All,
        );
        let Some((claimed, requested_at)) = claim.await? else {
            return Ok(None);
        };
        tracing::info!(
            turn_id = %claimed.grant.turn_id,
            fence = %claimed.grant.fence,
            attempt = claimed.grant.attempt,
            orphaned_for_ms = claimed.orphaned_for_ms,
            "orphan claimed"
        );
        Ok(Some(self.recovered(claimed, requested_at)))
    }

    /// The handoff: after ending a turn of `session_id`, starts the head of
    /// the session's queue for this caller (see
    /// [`agentgate_core::store::take_next_timed`]), a live [`Turn`] with
    /// its payload, so one worker drains a conversation in order. `None`
    /// when nothing is queued, or the head cannot start now (it stays
    /// queued for a later handoff or a recovery worker's claim).
    ///
    /// # Errors
    /// `store_unavailable`.
    pub async fn take_next(&self, session_id: &SessionId) -> Result<Option<Recovered>> {
        let taken = agentgate_core::store::take_next_timed(
            self.store.as_ref(),
            session_id,
            tokio::time::Instant::now,
        );
        let Some((claimed, requested_at)) = taken.await? else {
            return Ok(None);
        };
        tracing::info!(
            %session_id,
            turn_id = %claimed.grant.turn_id,
            fence = %claimed.grant.fence,
            "queued turn handed off"
        );
        Ok(Some(self.recovered(claimed, requested_at)))
    }

    /// A claimed turn as a live [`Turn`] and what resuming it needs.
    fn recovered(
        &self,
        claimed: agentgate_core::model::ClaimedOrphan,
        requested_at: tokio::time::Instant,
    ) -> Recovered {
        Recovered {
            turn: Turn::start(
                Arc::clone(&self.store),
                claimed.grant,
                requested_at,
                self.local.clone(),
            ),
            payload: claimed.payload,
            journal: claimed.journal,
            orphaned_for_ms: claimed.orphaned_for_ms,
        }
    }

    /// Begins a turn from a validated command.
    ///
    /// # Errors
    /// As [`Gate::begin`].
    pub async fn begin_command(&self, command: &BeginCommand) -> Result<Begun> {
        let requested_at = tokio::time::Instant::now();
        let outcome = self.store.begin(command).await?;
        Ok(self.begun(outcome, requested_at))
    }

    /// A store's begin outcome as a [`Begun`], a start's watchdog deadline
    /// counted from `requested_at`.
    fn begun(&self, outcome: BeginOutcome, requested_at: tokio::time::Instant) -> Begun {
        match outcome {
            BeginOutcome::Replay(view) => Begun::Replay(view),
            BeginOutcome::Queued(queued) => Begun::Queued(queued),
            BeginOutcome::Started(grant) => {
                tracing::debug!(turn_id = %grant.turn_id, fence = %grant.fence, attempt = grant.attempt, "turn started");
                Begun::Started(Turn::start(
                    Arc::clone(&self.store),
                    grant,
                    requested_at,
                    self.local.clone(),
                ))
            }
        }
    }
}

/// Opens the store at `store_url` (with the Redis lease layer at
/// `redis_url`, when given) bare: without a [`Gate`], so without
/// [`RunToEnd`]. Each step then runs in its caller's task, and a caller
/// that stops waiting cuts it off halfway. That is what the conformance
/// suite attacks (a cut-off step must leave no transaction open and change
/// all or nothing); an application wants [`Gate::connect`].
///
/// # Errors
/// As [`Gate::connect`].
pub async fn open_bare_store(
    store_url: &str,
    redis_url: Option<&str>,
    config: Config,
) -> Result<Arc<dyn Store>> {
    config.validate()?;
    let leases = match redis_url {
        Some(url) => Some(lease_layer(url).await?),
        None => None,
    };
    open_store(store_url, leases, config).await
}

/// What became of SQL step transactions dropped open (a step cut off
/// half-way on a bare store, or a step that failed before its commit),
/// counted process-wide; the service exports both as metrics.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DroppedTransactions {
    /// Rolled back, their connection pooled again.
    pub rolled_back: u64,
    /// Their connection closed instead: the rollback failed or took past
    /// its bound.
    pub closed: u64,
}

/// The process's [`DroppedTransactions`] so far.
pub fn dropped_transactions() -> DroppedTransactions {
    let hygiene = &agentgate_store_sql::tx::HYGIENE;
    DroppedTransactions {
        rolled_back: hygiene.rolled_back(),
        closed: hygiene.poisoned_closed(),
    }
}

/// As [`open_bare_store`], with a lease layer of the caller's (a test's
/// layer that blocks at a chosen point, say).
///
/// # Errors
/// As [`Gate::connect`].
pub async fn open_bare_store_with_layer(
    store_url: &str,
    layer: Arc<dyn LeaseLayer>,
    config: Config,
) -> Result<Arc<dyn Store>> {
    config.validate()?;
    open_store(store_url, Some(layer), config).await
}

/// Opens the SQL store named by `store_url`'s scheme.
async fn open_store(
    store_url: &str,
    leases: Option<Arc<dyn LeaseLayer>>,
    config: Config,
) -> Result<Arc<dyn Store>> {
    let scheme = store_url.split(':').next().unwrap_or_default();
    Ok(match scheme {
        #[cfg(feature = "sqlite")]
        "sqlite" => Arc::new(
            agentgate_store_sqlite::SqliteStore::open_with_leases(store_url, config, leases)
                .await?,
        ),
        #[cfg(feature = "postgres")]
        "postgres" | "postgresql" => Arc::new(
            agentgate_store_postgres::PostgresStore::open_with_leases(store_url, config, leases)
                .await?,
        ),
        #[cfg(feature = "mysql")]
        "mysql" | "mariadb" => Arc::new(
            agentgate_store_mysql::MySqlStore::open_with_leases(store_url, config, leases).await?,
        ),
        other => {
            return Err(Error::invalid(format!(
                "unsupported store scheme {other:?}; expected sqlite://, postgres:// or mysql:// \
                 (each behind its cargo feature)"
            )))
        }
    })
}

#[cfg(feature = "redis")]
async fn lease_layer(url: &str) -> Result<Arc<dyn LeaseLayer>> {
    Ok(Arc::new(
        agentgate_store_redis::RedisLeases::open(url).await?,
    ))
}

#[cfg(not(feature = "redis"))]
async fn lease_layer(_url: &str) -> Result<Arc<dyn LeaseLayer>> {
    Err(Error::invalid(
        "this build has no Redis lease layer (feature `redis`)",
    ))
}

/// What a gate's sweeper ended since it started.
#[derive(Debug, Default)]
struct Swept {
    abandoned: std::sync::atomic::AtomicU64,
    released: std::sync::atomic::AtomicU64,
}

async fn sweep_forever(store: Arc<dyn Store>, stop: CancellationToken, swept: Arc<Swept>) {
    let config = store.config().clone();
    loop {
        tokio::select! {
            // Stop first, and in a fixed order (see the watchdog).
            biased;
            () = stop.cancelled() => return,
            () = tokio::time::sleep(config.sweep_interval) => {}
        }
        for _ in 0..SWEEP_BATCHES_PER_TICK {
            match store.sweep().await {
                Ok(report) if report.abandoned + report.released > 0 => {
                    use std::sync::atomic::Ordering::Relaxed;
                    swept.abandoned.fetch_add(report.abandoned, Relaxed);
                    swept.released.fetch_add(report.released, Relaxed);
                    if report.abandoned > 0 {
                        tracing::info!(
                            abandoned = report.abandoned,
                            "orphans past their grace ended abandoned"
                        );
                    }
                    if report.released > 0 {
                        tracing::warn!(
                            released = report.released,
                            "turns that ignored their cancel past the grace force-released"
                        );
                    }
                    if report.turns + report.sessions < u64::from(config.sweep_batch) {
                        break;
                    }
                }
                Ok(report) if report.turns + report.sessions < u64::from(config.sweep_batch) => {
                    break
                }
                Ok(_) => {}
                Err(error) => {
                    tracing::warn!(%error, "sweep failed");
                    break;
                }
            }
        }
    }
}

/// One begin counted in [`Gate::waiting_begins`] while it lives.
pub(crate) struct WaitingGuard(Arc<std::sync::atomic::AtomicUsize>);

impl Drop for WaitingGuard {
    fn drop(&mut self) {
        self.0.fetch_sub(1, std::sync::atomic::Ordering::Relaxed);
    }
}
