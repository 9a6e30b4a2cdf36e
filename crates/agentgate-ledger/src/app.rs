//! [`LedgerApp`]: the facade the server calls.
//!
//! A message or a confirmation is two steps, so the HTTP layer can answer a
//! refusal with its real status before it opens an event stream:
//!
//! 1. [`LedgerApp::start_message`] / [`LedgerApp::start_confirmation`] begin
//!    the turn in the engine: an engine refusal (`session_busy`,
//!    `awaiting_confirmation`, …) comes back as an error, a repeat of an
//!    ended request as [`Started::Replay`], and a granted lease as
//!    [`Started::Running`];
//! 2. [`RunningTurn::run`] runs the agent to the turn's ending, streaming
//!    [`AgentEvent`]s, until done or until the caller's
//!    cancellation token fires (the "client went away → cancel" policy; to
//!    let the turn finish instead, never fire it).
//!
//! A message sent with `on_busy` `enqueue` or `supersede` while a reply
//! runs is [`Started::Queued`] instead: recorded in the transcript, it waits
//! in the session's queue. Whoever ends a turn of the session then takes the
//! queue's head and runs it ([`LedgerApp::drain_queue`], the engine's
//! handoff), so one worker drains a conversation in order; the recovery
//! worker ([`LedgerApp::recover_once`]) claims a head nobody took and drains
//! the rest the same way.
//!
//! [`LedgerApp::chat`] and [`LedgerApp::confirm`] do both steps at once. The
//! queries (sessions, transcript, entries, totals, pending confirmation)
//! serve the page.

use std::sync::Arc;

use agentgate::model::{BeginCommand, QueuedTurn};
use agentgate::{
    Begun, BusyReport, ClientRequestId, Decision, Gate, OnBusy, Recovered, SessionId, Turn,
    TurnState, TurnView, UserId,
};
use serde::Serialize;
use serde_json::{json, Value};
use tokio_util::sync::CancellationToken;

use crate::agent;
use crate::config::{check_utc_offset, LedgerConfig};
use crate::db::LedgerDb;
use crate::error::{LedgerError, Result};
use crate::events::{emit, AgentEvent, EventSender};
use crate::limits::{
    MAX_HANDOFFS_PER_DRAIN, MAX_MESSAGE_CHARS, RECOVERIES_PER_TICK, RECOVERY_CANDIDATES,
    RECOVERY_INTERVAL,
};
use crate::model::Model;
use crate::records::{Category, ChatOutcome, Entry, Reply, SessionSummary, Totals, TranscriptTurn};

/// What the app shares between turns.
pub(crate) struct Inner {
    pub(crate) gate: Gate,
    pub(crate) db: LedgerDb,
    pub(crate) model: Arc<dyn Model>,
    pub(crate) config: LedgerConfig,
    /// The user's documents, for the `search_documents` tool (set once).
    pub(crate) documents: std::sync::OnceLock<agentgate_ingest::Ingestor>,
}

/// The ledger agent over one engine. Cheap to clone.
#[derive(Clone)]
pub struct LedgerApp {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for LedgerApp {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LedgerApp")
            .field("model", &self.inner.model.name())
            .field("config", &self.inner.config)
            .finish_non_exhaustive()
    }
}

/// A person's chat message.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct UserMessage {
    /// Who sends it.
    pub user_id: String,
    /// The conversation.
    pub session_id: String,
    /// The client's id for this message; reused on retry.
    pub client_request_id: String,
    /// The text, at most [`MAX_MESSAGE_CHARS`] characters.
    pub text: String,
    /// The sender's time zone (minutes east of UTC, as the browser knows it);
    /// `None` uses the app's default.
    pub utc_offset_minutes: Option<i32>,
    /// What to do when a reply of this conversation is still running:
    /// refuse (`session_busy`), wait for it, interrupt it, or queue behind
    /// it (`enqueue`; `supersede` also replaces the queued messages that
    /// have not started).
    pub on_busy: OnBusy,
}

/// A person's answer to a pending confirmation.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ConfirmRequest {
    /// Who answers.
    pub user_id: String,
    /// The conversation.
    pub session_id: String,
    /// The client's id for this answer (each tab its own).
    pub client_request_id: String,
    /// The turn awaiting confirmation.
    pub pending_turn_id: String,
    /// Approve or reject.
    pub decision: Decision,
}

/// What starting a message or confirmation did.
#[derive(Debug)]
pub enum Started {
    /// The request already ended: its stored outcome. Nothing ran.
    Replay(ChatOutcome),
    /// A lease was granted: run it.
    Running(RunningTurn),
    /// The message waits in its session's queue (`enqueue` or
    /// `supersede`), recorded in the transcript; nothing ran yet. The
    /// caller that ends the session's running turn runs it
    /// ([`LedgerApp::drain_queue`]), or the recovery worker does.
    Queued(QueuedMessage),
}

/// What [`LedgerApp::drain_queue`] reports of each queued turn it runs.
#[derive(Debug)]
pub enum Handoff {
    /// The turn was taken from the head of the queue and runs now.
    Started {
        /// The turn.
        turn_id: String,
    },
    /// The turn ended: its outcome, or why it did not finish.
    Ended {
        /// The turn.
        turn_id: String,
        /// As [`RunningTurn::run`] returned it.
        result: Result<ChatOutcome>,
    },
}

/// A message waiting in its session's queue.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct QueuedMessage {
    /// Its turn, in state `queued` (cancel it with the engine's cancel).
    pub turn_id: String,
    /// The client's id of the message.
    pub client_request_id: String,
    /// 1 for the head of the queue, gap-free behind it.
    pub position: u32,
    /// Store-clock time it was queued, ms since the Unix epoch.
    pub enqueued_at_ms: i64,
    /// When to look again: the running turn's remaining lease.
    pub retry_after_ms: u64,
}

impl From<&QueuedTurn> for QueuedMessage {
    fn from(queued: &QueuedTurn) -> Self {
        Self {
            turn_id: queued.turn_id.to_string(),
            client_request_id: queued.client_request_id.as_str().to_owned(),
            position: queued.position,
            enqueued_at_ms: queued.enqueued_at_ms,
            retry_after_ms: u64::try_from(queued.retry_after.as_millis()).unwrap_or(u64::MAX),
        }
    }
}

/// What kind of turn is running.
#[derive(Debug)]
enum Work {
    Message {
        text: String,
        utc_offset_minutes: i32,
    },
    Confirmation,
}

/// A turn that holds its lease and waits to be run. Dropping it without
/// running releases the lease (the engine fails it as retryable).
#[derive(Debug)]
pub struct RunningTurn {
    app: LedgerApp,
    turn: Turn,
    work: Work,
}

impl RunningTurn {
    /// The turn's id.
    pub fn turn_id(&self) -> String {
        self.turn.id().to_string()
    }

    /// 1 for the first start, +1 per takeover or restart.
    pub fn attempt(&self) -> u32 {
        self.turn.attempt()
    }

    /// The turn's session.
    pub fn session_id(&self) -> String {
        self.turn.session_id().to_string()
    }

    /// Runs the turn to its ending, sending events to `events` (if any).
    /// When `cancel` fires, the turn stops at its next step and is failed as
    /// retryable (a repeat of the request resumes it without booking twice).
    ///
    /// # Errors
    /// `Cancelled`; `Model` when the model failed after its retries; `Engine`
    /// (`lease_lost` when the lease was lost or taken over, or
    /// `store_unavailable`); `Database`. On every error the lease is released
    /// or left to expire, and an `error` event is sent.
    pub async fn run(
        self,
        events: Option<EventSender>,
        cancel: CancellationToken,
    ) -> Result<ChatOutcome> {
        let inner = &self.app.inner;
        match self.work {
            Work::Message {
                text,
                utc_offset_minutes,
            } => {
                agent::run_message(
                    inner,
                    self.turn,
                    &text,
                    utc_offset_minutes,
                    events.as_ref(),
                    cancel,
                )
                .await
            }
            Work::Confirmation => {
                agent::run_confirmation(inner, self.turn, events.as_ref(), cancel).await
            }
        }
    }
}

fn message_payload(text: &str, utc_offset_minutes: Option<i32>) -> Value {
    match utc_offset_minutes {
        Some(offset) => json!({"text": text, "utc_offset_minutes": offset}),
        None => json!({"text": text}),
    }
}

impl LedgerApp {
    /// Opens the app on the engine `gate`, whose store is at `store_url`
    /// (the app keeps its tables in the same database), creating its tables
    /// and seeding the default categories if needed.
    ///
    /// # Errors
    /// `Invalid` for a bad config or a store the app cannot run on;
    /// `Database` when the tables cannot be created.
    pub async fn open(
        gate: Gate,
        store_url: &str,
        model: Arc<dyn Model>,
        config: LedgerConfig,
    ) -> Result<Self> {
        config.validate()?;
        let db = LedgerDb::open(store_url).await?;
        Ok(Self {
            inner: Arc::new(Inner {
                gate,
                db,
                model,
                config,
                documents: std::sync::OnceLock::new(),
            }),
        })
    }

    /// Gives the agent the user's documents: its `search_documents` tool
    /// answers from them. Set once; a second call changes nothing.
    pub fn set_documents(&self, documents: agentgate_ingest::Ingestor) {
        let _ = self.inner.documents.set(documents);
    }

    /// The engine.
    pub fn gate(&self) -> &Gate {
        &self.inner.gate
    }

    /// The settings in force.
    pub fn config(&self) -> &LedgerConfig {
        &self.inner.config
    }

    /// The model's name.
    pub fn model_name(&self) -> &str {
        self.inner.model.name()
    }

    /// Begins the turn of a chat message.
    ///
    /// # Errors
    /// `Invalid` for an empty or over-long text or a bad time zone; the
    /// engine's refusals as `Engine` (`session_busy`, `request_in_flight`,
    /// `awaiting_confirmation`, `user_at_capacity`, `payload_mismatch`,
    /// `not_found`, `invalid_request`, `store_unavailable`).
    pub async fn start_message(&self, message: &UserMessage) -> Result<Started> {
        Ok(self.start_message_reporting(message).await?.0)
    }

    /// [`LedgerApp::start_message`], with how its busy policy went (how
    /// many begins it took, whether it interrupted a running reply).
    ///
    /// # Errors
    /// As [`LedgerApp::start_message`].
    pub async fn start_message_reporting(
        &self,
        message: &UserMessage,
    ) -> Result<(Started, BusyReport)> {
        let text = message.text.trim();
        if text.is_empty() {
            return Err(LedgerError::invalid("text must not be empty"));
        }
        let chars = text.chars().count();
        if chars > MAX_MESSAGE_CHARS {
            return Err(LedgerError::invalid(format!(
                "text is {chars} characters, the limit is {MAX_MESSAGE_CHARS}"
            )));
        }
        if let Some(offset) = message.utc_offset_minutes {
            check_utc_offset(offset)?;
        }
        let payload = message_payload(text, message.utc_offset_minutes);
        let command = BeginCommand::new(
            UserId::new(message.user_id.as_str())?,
            SessionId::new(message.session_id.as_str())?,
            ClientRequestId::new(message.client_request_id.as_str())?,
            &payload,
            None,
        )?;
        let (begun, report) = self
            .inner
            .gate
            .begin_on_busy(&command, message.on_busy)
            .await?;
        if let Some(interrupted) = &report.interrupted {
            tracing::info!(%interrupted, session_id = %message.session_id, "a new message interrupted the running reply");
        }
        let started = match begun {
            Begun::Replay(view) => {
                agent::record_replay(&self.inner, &view, text, json!({})).await;
                Started::Replay(ChatOutcome::from_view(&view, true))
            }
            // Recorded before it is acknowledged: the page shows it queued
            // from the transcript (after a reload too), and the recovery
            // worker, which resumes only turns this app recorded, can claim
            // it when no handoff does. A failed write fails the request; its
            // repeat (same id) finds the turn queued and writes again.
            Begun::Queued(queued) => {
                agent::record_user_message(
                    &self.inner,
                    &message.user_id,
                    &message.session_id,
                    queued.turn_id.as_str(),
                    text,
                    json!({}),
                )
                .await?;
                Started::Queued(QueuedMessage::from(&queued))
            }
            Begun::Started(turn) => {
                // Recorded now, not when the turn's task gets to it: a
                // message queued right behind this one is recorded after
                // it, so the transcript lists them in the order they run.
                if let Err(error) = agent::record_user_message(
                    &self.inner,
                    &message.user_id,
                    &message.session_id,
                    turn.id().as_str(),
                    text,
                    json!({}),
                )
                .await
                {
                    tracing::warn!(turn_id = %turn.id(), %error, "could not record the user message");
                }
                Started::Running(RunningTurn {
                    app: self.clone(),
                    turn,
                    work: Work::Message {
                        text: text.to_owned(),
                        utc_offset_minutes: message
                            .utc_offset_minutes
                            .unwrap_or(self.inner.config.utc_offset_minutes),
                    },
                })
            }
        };
        Ok((started, report))
    }

    /// Begins the confirmation turn answering a pending one. Of two tabs
    /// approving at once, one starts and the other gets `request_in_flight`,
    /// then (once done) a replay of the first one's outcome.
    ///
    /// # Errors
    /// `Engine(not_found)` when the turn awaits no live confirmation;
    /// otherwise as [`LedgerApp::start_message`].
    pub async fn start_confirmation(&self, request: &ConfirmRequest) -> Result<Started> {
        let begun = self
            .inner
            .gate
            .confirm(
                &request.user_id,
                &request.session_id,
                &request.client_request_id,
                &request.pending_turn_id,
                request.decision,
            )
            .await?;
        Ok(match begun {
            Begun::Replay(view) => {
                let approve = view
                    .confirmation
                    .as_ref()
                    .is_none_or(|c| c.decision == Decision::Approve);
                let text = if approve { "确认" } else { "取消" };
                let data =
                    json!({"confirms": request.pending_turn_id, "decision": request.decision});
                agent::record_replay(&self.inner, &view, text, data).await;
                Started::Replay(ChatOutcome::from_view(&view, true))
            }
            Begun::Started(turn) => Started::Running(RunningTurn {
                app: self.clone(),
                turn,
                work: Work::Confirmation,
            }),
            // A confirmation is never queued: its request id names a queued
            // message of the API's, whose payload differs.
            Begun::Queued(queued) => {
                return Err(agentgate::Error::SessionBusy {
                    active_turn_id: queued.turn_id.to_string(),
                    retry_after: queued.retry_after,
                }
                .into())
            }
        })
    }

    /// Starts and runs a chat message; a replay is returned as it is (and
    /// sent as a `final` event). A message queued behind a running reply
    /// (`enqueue`, `supersede`) is returned in state `queued`, with no
    /// event: it runs when the session's holder hands it off.
    ///
    /// # Errors
    /// As [`LedgerApp::start_message`] and [`RunningTurn::run`].
    pub async fn chat(
        &self,
        message: &UserMessage,
        events: Option<EventSender>,
        cancel: CancellationToken,
    ) -> Result<ChatOutcome> {
        let started = self.start_message(message).await;
        finish(started, events, cancel).await
    }

    /// Starts and runs a confirmation.
    ///
    /// # Errors
    /// As [`LedgerApp::start_confirmation`] and [`RunningTurn::run`].
    pub async fn confirm(
        &self,
        request: &ConfirmRequest,
        events: Option<EventSender>,
        cancel: CancellationToken,
    ) -> Result<ChatOutcome> {
        let started = self.start_confirmation(request).await;
        finish(started, events, cancel).await
    }

    /// One look of the recovery worker: takes over up to
    /// [`RECOVERIES_PER_TICK`] of this app's orphaned turns (a message or
    /// confirmation whose worker died before its reply) and runs each to its
    /// ending. Resuming runs the agent again from the stored request: tools
    /// that succeeded return their stored result, a booking whose outcome is
    /// unknown is looked up by its idempotency key before anything is
    /// booked, and the reply is stored, so the page that was waiting shows
    /// it. Only turns this app recorded are claimed: other callers of the
    /// same store resume their own.
    ///
    /// The engine's claim also starts the head of a queue whose session is
    /// free (its worker died before the handoff, or ended without one):
    /// queued messages are recorded when queued, so they are candidates.
    /// After each resumed turn its session's queue is drained
    /// ([`LedgerApp::drain_queue`]), so the messages queued behind a dead
    /// worker run in order. Returns the outcomes, the drained ones included.
    ///
    /// # Errors
    /// `Database` or `Engine` when the look-up or a claim fails; a resumed
    /// turn's own failure is its outcome, not an error here.
    pub async fn recover_once(&self) -> Result<Vec<ChatOutcome>> {
        let turn_ids = self
            .inner
            .db
            .unanswered_turns(RECOVERY_CANDIDATES)
            .await?
            .into_iter()
            .filter_map(|id| agentgate::TurnId::new(id).ok())
            .collect::<Vec<_>>();
        if turn_ids.is_empty() {
            return Ok(Vec::new());
        }
        let filter = agentgate::OrphanFilter {
            turn_ids,
            ..agentgate::OrphanFilter::default()
        };
        // Claim first, then run the claimed turns together: run one after
        // another, a tick of real model turns (3 rounds of 2-10 s each) took
        // minutes, and a backlog after a crash outlived the orphan grace and
        // was abandoned instead of resumed.
        // Dropping a JoinSet aborts its tasks: a failed claim ends the
        // claiming, and is reported once the turns already claimed ended.
        let mut resumed = tokio::task::JoinSet::new();
        let mut claim_error = None;
        for _ in 0..RECOVERIES_PER_TICK {
            let recovered = match self.inner.gate.claim_orphan(&filter).await {
                Ok(Some(recovered)) => recovered,
                Ok(None) => break,
                // A failing claim ends this look's claims; the turns already
                // claimed still run, and the next look tries again.
                Err(error) => {
                    claim_error = Some(error);
                    break;
                }
            };
            tracing::info!(
                turn_id = %recovered.turn.id(),
                attempt = recovered.turn.attempt(),
                orphaned_for_ms = recovered.orphaned_for_ms,
                unknown_tools = recovered
                    .journal
                    .iter()
                    .filter(|e| e.outcome == agentgate::JournalOutcome::Unknown)
                    .count(),
                "resuming an orphaned turn"
            );
            let Some(running) = self.resume(recovered).await else {
                continue;
            };
            let app = self.clone();
            resumed.spawn(async move {
                let session_id = running.session_id();
                let mut results = vec![running.run(None, CancellationToken::new()).await];
                let drained = app
                    .drain_queue(&session_id, |handoff| {
                        if let Handoff::Ended { result, .. } = handoff {
                            results.push(result);
                        }
                    })
                    .await;
                if let Err(error) = drained {
                    tracing::warn!(%session_id, %error, "could not hand off the queue; the next look claims it");
                }
                results
            });
        }
        let mut outcomes = Vec::new();
        while let Some(joined) = resumed.join_next().await {
            match joined {
                Ok(results) => {
                    for result in results {
                        match result {
                            Ok(outcome) => outcomes.push(outcome),
                            Err(error) => tracing::warn!(%error, "a resumed turn did not finish"),
                        }
                    }
                }
                Err(error) => tracing::warn!(%error, "a resumed turn's task died"),
            }
        }
        match claim_error {
            Some(error) => Err(error.into()),
            None => Ok(outcomes),
        }
    }

    /// A claimed or handed-off turn as a [`RunningTurn`], its work read back
    /// from the stored payload. `None` for a message turn whose payload was
    /// not kept (recorded before payloads were): it is ended retryable, so
    /// the person's own resend (same id) restarts it.
    async fn resume(&self, recovered: Recovered) -> Option<RunningTurn> {
        let text = recovered.payload["text"].as_str().map(str::to_owned);
        let work = match (recovered.turn.confirmation(), text) {
            (Some(_), _) => Work::Confirmation,
            (None, None) => {
                let error = json!({
                    "code": "no_stored_payload",
                    "message": "the turn's message was not kept; send it again",
                });
                if let Err(error) = recovered.turn.fail(&error, true).await {
                    tracing::warn!(error = %error.error, "could not end a turn without a payload");
                }
                return None;
            }
            (None, Some(text)) => Work::Message {
                text,
                utc_offset_minutes: recovered.payload["utc_offset_minutes"]
                    .as_i64()
                    .and_then(|m| i32::try_from(m).ok())
                    .unwrap_or(self.inner.config.utc_offset_minutes),
            },
        };
        Some(RunningTurn {
            app: self.clone(),
            turn: recovered.turn,
            work,
        })
    }

    /// The handoff: starts the head of `session_id`'s queue for this
    /// caller, who has just ended the session's running turn
    /// ([`Gate::take_next`]). `None` when nothing waits or the head cannot
    /// start now (the session is held again, a confirmation is pending, the
    /// user is at its cap): it stays queued for a later handoff or the
    /// recovery worker.
    ///
    /// # Errors
    /// `Engine` (`invalid_request` for a bad session id,
    /// `store_unavailable`).
    pub async fn take_next(&self, session_id: &str) -> Result<Option<RunningTurn>> {
        let session_id = SessionId::new(session_id)?;
        match self.inner.gate.take_next(&session_id).await? {
            Some(recovered) => Ok(self.resume(recovered).await),
            None => Ok(None),
        }
    }

    /// Runs the messages queued in `session_id`, head first, each to its
    /// ending before the next is taken ([`LedgerApp::take_next`]): call it
    /// after ending a turn of the session, so the worker that ran the
    /// conversation's reply also runs what was queued behind it, in order,
    /// whether or not the pages that sent them are still open. The engine
    /// starts each queued turn once: a head taken by someone else (a
    /// recovery worker's claim, a repeat of its request) is not taken here.
    /// `report` is told when each turn starts and how it ended. At most
    /// [`MAX_HANDOFFS_PER_DRAIN`] turns; the rest stays queued for the
    /// recovery worker. Returns how many turns ran.
    ///
    /// # Errors
    /// As [`LedgerApp::take_next`]; the queue is then left to the recovery
    /// worker. A drained turn's own failure is its result, not an error.
    pub async fn drain_queue<F>(&self, session_id: &str, mut report: F) -> Result<u32>
    where
        F: FnMut(Handoff) + Send,
    {
        let mut ran = 0;
        while ran < MAX_HANDOFFS_PER_DRAIN {
            let Some(next) = self.take_next(session_id).await? else {
                return Ok(ran);
            };
            let turn_id = next.turn_id();
            tracing::info!(%turn_id, %session_id, "running a queued message");
            report(Handoff::Started {
                turn_id: turn_id.clone(),
            });
            // No page streams a handed-off turn: its page shows the reply
            // from the transcript, and a closed page must not stop it.
            let result = next.run(None, CancellationToken::new()).await;
            report(Handoff::Ended { turn_id, result });
            ran += 1;
        }
        tracing::info!(%session_id, ran, "handoff bound reached; the recovery worker takes the rest");
        Ok(ran)
    }

    /// Runs [`LedgerApp::recover_once`] every [`RECOVERY_INTERVAL`] until
    /// `stop` fires: the app's recovery worker. Every node may run one;
    /// the engine hands each orphan to one of them.
    pub async fn recover_forever(self, stop: CancellationToken) {
        loop {
            tokio::select! {
                () = stop.cancelled() => return,
                () = tokio::time::sleep(RECOVERY_INTERVAL) => {}
            }
            if let Err(error) = self.recover_once().await {
                tracing::warn!(%error, "orphan recovery failed; trying again later");
            }
        }
    }

    /// The categories, in display order.
    ///
    /// # Errors
    /// `Database`.
    pub async fn categories(&self) -> Result<Vec<Category>> {
        self.inner.db.categories(None).await
    }

    /// A user's sessions, most recent first (at most
    /// [`MAX_LIST_ROWS`](crate::limits::MAX_LIST_ROWS)).
    ///
    /// # Errors
    /// `Database`.
    pub async fn sessions(&self, user_id: &str) -> Result<Vec<SessionSummary>> {
        self.inner.db.sessions(user_id).await
    }

    /// A session's turns, oldest first, each with the engine's state (so a
    /// page reloaded mid-turn sees `running`, then the reply). Another
    /// user's session reads as empty.
    ///
    /// # Errors
    /// `Database`; `Engine(store_unavailable)`.
    pub async fn transcript(&self, user_id: &str, session_id: &str) -> Result<Vec<TranscriptTurn>> {
        let rows = self.inner.db.messages(user_id, session_id).await?;
        let mut turns: Vec<TranscriptTurn> = Vec::new();
        for row in rows {
            let index = match turns.iter().position(|t| t.turn_id == row.turn_id) {
                Some(index) => index,
                None => {
                    turns.push(TranscriptTurn {
                        turn_id: row.turn_id.clone(),
                        client_request_id: None,
                        user_text: String::new(),
                        confirms: None,
                        reply: None,
                        state: None,
                        error: None,
                        retryable: None,
                        attempt: None,
                        created_at_ms: row.created_at_ms,
                    });
                    turns.len() - 1
                }
            };
            let turn = &mut turns[index];
            if row.role == "user" {
                turn.user_text = row.content;
                turn.confirms = row.data["confirms"].as_str().map(str::to_owned);
                turn.created_at_ms = row.created_at_ms;
            } else {
                turn.reply = Reply::from_value(&row.data);
            }
        }
        for turn in &mut turns {
            let turn_id = agentgate::TurnId::new(turn.turn_id.as_str())?;
            if let Some(view) = self.inner.gate.store().turn(&turn_id).await? {
                turn.state = Some(view.state);
                turn.error = view.error.clone();
                turn.retryable = view.retryable;
                turn.attempt = Some(view.attempt);
                turn.client_request_id = Some(view.client_request_id.as_str().to_owned());
                if turn.reply.is_none() {
                    turn.reply = ChatOutcome::from_view(&view, true).reply;
                }
                if view.state == agentgate::TurnState::Cancelled {
                    // Stopped: what it had booked stays booked (each entry
                    // committed with its tool's success), so the reply says
                    // so, in every tab and after a reload.
                    let booked = self
                        .inner
                        .db
                        .entries_of_turn(user_id, &turn.turn_id)
                        .await?;
                    match &mut turn.reply {
                        Some(reply) if reply.entries.is_empty() => reply.entries = booked,
                        Some(_) => {}
                        None if booked.is_empty() => {}
                        None => {
                            turn.reply = Some(Reply {
                                text: String::new(),
                                entries: booked,
                                pending: Vec::new(),
                                chinese: None,
                            })
                        }
                    }
                }
            }
        }
        Ok(turns)
    }

    /// A user's entries, newest first (at most
    /// [`MAX_LIST_ROWS`](crate::limits::MAX_LIST_ROWS)).
    ///
    /// # Errors
    /// `Database`.
    pub async fn entries(&self, user_id: &str) -> Result<Vec<Entry>> {
        self.inner.db.entries(user_id).await
    }

    /// A user's totals per category and overall.
    ///
    /// # Errors
    /// `Database`.
    pub async fn totals(&self, user_id: &str) -> Result<Totals> {
        self.inner.db.totals(user_id).await
    }

    /// The session's live pending confirmation, if any: the turn to name in
    /// a [`ConfirmRequest`] and what it waits for. `None` also for another
    /// user's session.
    ///
    /// # Errors
    /// `Engine` (`invalid_request` for a bad session id, `store_unavailable`).
    pub async fn pending_confirmation(
        &self,
        user_id: &str,
        session_id: &str,
    ) -> Result<Option<(String, Reply)>> {
        let store = self.inner.gate.store();
        let Some(session) = store
            .session(&agentgate::SessionId::new(session_id)?)
            .await?
        else {
            return Ok(None);
        };
        if session.user_id.as_str() != user_id {
            return Ok(None);
        }
        let Some(pending) = session.pending_confirmation else {
            return Ok(None);
        };
        let view: Option<TurnView> = store.turn(&pending.turn_id).await?;
        Ok(view
            .filter(|v| v.state == TurnState::AwaitingConfirmation)
            .and_then(|v| v.pending.as_ref().and_then(Reply::from_value))
            .map(|reply| (pending.turn_id.to_string(), reply)))
    }
}

async fn finish(
    started: Result<Started>,
    events: Option<EventSender>,
    cancel: CancellationToken,
) -> Result<ChatOutcome> {
    match started {
        Ok(Started::Running(turn)) => turn.run(events, cancel).await,
        Ok(Started::Queued(queued)) => Ok(ChatOutcome {
            turn_id: queued.turn_id,
            client_request_id: queued.client_request_id,
            state: TurnState::Queued,
            replayed: false,
            reply: None,
            error: None,
            confirmed_by: None,
            decision: None,
        }),
        Ok(Started::Replay(outcome)) => {
            emit(
                events.as_ref(),
                AgentEvent::Final {
                    outcome: outcome.clone(),
                },
            );
            Ok(outcome)
        }
        Err(error) => {
            emit(
                events.as_ref(),
                AgentEvent::Error {
                    code: error.code().to_owned(),
                    message: error.to_string(),
                    retryable: error.is_retryable(),
                },
            );
            Err(error)
        }
    }
}
