//! The agent loop: what one turn does while it holds its lease.
//!
//! A message turn runs at most [`MAX_MODEL_ROUNDS`] model rounds. Each round
//! is itself recorded as an engine tool execution (`model_round`, keyed by
//! the round number and a hash of the model's input), so a turn that is
//! retried after a crash, a takeover or a cancellation replays the model's
//! earlier answers instead of paying for them again — and, because a real
//! LLM may not answer the same way twice, instead of inventing different
//! tool arguments that would book a second entry.
//!
//! Tools: `list_categories` is claimed and completed with no effect;
//! `create_transaction` is validated (errors go back to the model as tool
//! errors, the execution marked failed), held for confirmation above the
//! threshold, or booked with `complete_in_tx` — the entry and the success
//! mark commit together.
//!
//! A confirmation turn calls no model: on approve it books the pending
//! entries with the same same-transaction effect, on reject it books nothing.

use agentgate::{ErrorKind, Turn, TurnView};
use serde_json::{json, Value};
use tokio_util::sync::CancellationToken;

use crate::app::Inner;
use crate::date::Date;
use crate::db::{insert_entry, EntryInsert, MessageRow};
use crate::error::{LedgerError, Result};
use crate::events::{emit, AgentEvent, EventSender};
use crate::limits::{MAX_MODEL_ROUNDS, MAX_TOOL_CALLS_PER_ROUND};
use crate::model::{Message, ModelError, ModelReply, ModelRequest, ToolCallRequest};
use crate::money::format_cents;
use crate::records::{ChatOutcome, Entry, NewEntry, Reply};
use crate::tools::{self, ToolSpec, CREATE_TRANSACTION, LIST_CATEGORIES, SEARCH_DOCUMENTS};

/// The engine tool name under which model rounds are recorded.
pub(crate) const MODEL_ROUND_TOOL: &str = "model_round";

/// Why the loop stopped early.
enum Stop {
    /// The caller's token fired.
    Caller,
    /// The engine's watchdog fired: the lease is gone.
    LeaseLost,
}

/// The two cancellation sources of a turn.
struct Signals {
    lease: CancellationToken,
    caller: CancellationToken,
}

impl Signals {
    fn fired(&self) -> Option<Stop> {
        if self.lease.is_cancelled() {
            Some(Stop::LeaseLost)
        } else if self.caller.is_cancelled() {
            Some(Stop::Caller)
        } else {
            None
        }
    }

    async fn wait(&self) {
        tokio::select! {
            () = self.lease.cancelled() => {}
            () = self.caller.cancelled() => {}
        }
    }
}

/// How the loop ended before the turn's ending is recorded.
enum Failure {
    Stopped(Stop),
    Model(ModelError),
    Ledger(LedgerError),
}

impl From<LedgerError> for Failure {
    fn from(error: LedgerError) -> Self {
        Self::Ledger(error)
    }
}

impl From<agentgate::Error> for Failure {
    fn from(error: agentgate::Error) -> Self {
        Self::Ledger(LedgerError::Engine(error))
    }
}

/// What the loop produced.
enum Ending {
    Reply(Reply),
    Pending(Reply),
}

/// One turn's working context.
struct Ctx<'a> {
    inner: &'a Inner,
    turn: &'a Turn,
    events: Option<&'a EventSender>,
    signals: Signals,
    today: Date,
    chinese: bool,
}

impl Ctx<'_> {
    fn emit(&self, event: AgentEvent) {
        emit(self.events, event);
    }

    fn check(&self) -> Result<(), Failure> {
        self.signals
            .fired()
            .map_or(Ok(()), |stop| Err(Failure::Stopped(stop)))
    }
}

fn is_chinese(text: &str) -> bool {
    text.chars().any(|c| ('\u{4e00}'..='\u{9fff}').contains(&c))
}

fn tool_error(message: impl Into<String>) -> Value {
    json!({"ok": false, "error": message.into()})
}

/// A tool's answer within the loop.
struct Answer {
    result: Value,
    cached: bool,
    booked: Option<Entry>,
    pending: Option<NewEntry>,
}

impl Answer {
    fn plain(result: Value, cached: bool) -> Self {
        Self {
            result,
            cached,
            booked: None,
            pending: None,
        }
    }
}

/// The user's "today" for this turn: the engine's creation time of the turn
/// record (store clock), in the user's zone. Stable across takeovers and
/// restarts, so a retried "昨天" means the same day.
async fn turn_today(inner: &Inner, turn: &Turn, utc_offset_minutes: i32) -> Result<Date> {
    let view = inner
        .gate
        .store()
        .turn(turn.id())
        .await?
        .ok_or_else(|| agentgate::Error::not_found(format!("turn {}", turn.id())))?;
    Ok(Date::at_unix_ms(view.created_at_ms, utc_offset_minutes))
}

fn system_prompt(today: Date, threshold_cents: i64) -> String {
    format!(
        "You are the bookkeeping assistant of a personal ledger. Today is {today}. \
         For every expense or income the user mentions, call create_transaction once \
         (amount in yuan; type income or expense). Call list_categories first and pass a \
         listed category name when one fits, else the user's own word. Pass occur_date as \
         YYYY-MM-DD, today, yesterday, 今天 or 昨天. Entries above {} wait for the user's \
         confirmation; the system asks them. If a tool returns an error, fix the call or \
         explain the problem. Reply briefly in the user's language with what was booked.",
        format_cents(threshold_cents)
    )
}

/// Runs a message turn to its ending.
pub(crate) async fn run_message(
    inner: &Inner,
    turn: Turn,
    text: &str,
    utc_offset_minutes: i32,
    events: Option<&EventSender>,
    caller: CancellationToken,
) -> Result<ChatOutcome> {
    // Everything up to the ending is teed into the turn's event log; the
    // ending's own events (final, error) follow the log's end.
    let (log, pump) = crate::events::tee(&turn, events);
    let work = async {
        let log = log;
        started(inner, &turn, Some(&log), text, json!({})).await;
        let today = turn_today(inner, &turn, utc_offset_minutes).await?;
        let ctx = Ctx {
            inner,
            turn: &turn,
            events: Some(&log),
            signals: Signals {
                lease: turn.cancellation(),
                caller,
            },
            today,
            chinese: is_chinese(text),
        };
        rounds(&ctx, text).await
    };
    let (result, ()) = tokio::join!(work, pump);
    match result {
        Ok(Ending::Reply(reply)) => finish_reply(inner, turn, events, &reply).await,
        Ok(Ending::Pending(reply)) => finish_pending(inner, turn, events, &reply).await,
        Err(failure) => finish_failed(turn, events, failure).await,
    }
}

async fn started(
    inner: &Inner,
    turn: &Turn,
    events: Option<&EventSender>,
    text: &str,
    data: Value,
) {
    emit(
        events,
        AgentEvent::Started {
            turn_id: turn.id().to_string(),
            attempt: turn.attempt(),
            takeover: turn.is_takeover(),
        },
    );
    // Usually recorded already, when the turn was begun or queued (a
    // repeat writes nothing); a turn claimed by a recovery worker is
    // recorded here if it never was.
    // The transcript is a view; a failed write is retried by the next replay
    // or restart of this request and must not fail the turn.
    if let Err(error) = record_user_message(
        inner,
        turn.user_id().as_str(),
        turn.session_id().as_str(),
        turn.id().as_str(),
        text,
        data,
    )
    .await
    {
        tracing::warn!(turn_id = %turn.id(), %error, "could not record the user message");
    }
}

/// Records the user's side of a turn in the transcript; a second record of
/// the same turn writes nothing.
pub(crate) async fn record_user_message(
    inner: &Inner,
    user_id: &str,
    session_id: &str,
    turn_id: &str,
    text: &str,
    data: Value,
) -> Result<()> {
    let row = MessageRow {
        user_id: user_id.to_owned(),
        session_id: session_id.to_owned(),
        turn_id: turn_id.to_owned(),
        role: "user",
        content: text.to_owned(),
        data,
        created_at_ms: 0,
    };
    inner.db.insert_message(&row).await
}

async fn rounds(ctx: &Ctx<'_>, text: &str) -> Result<Ending, Failure> {
    let tools = tools::specs();
    let mut messages = vec![
        Message::System {
            content: system_prompt(ctx.today, ctx.inner.config.confirmation_threshold_cents),
        },
        Message::User {
            content: text.to_owned(),
        },
    ];
    let mut booked: Vec<Entry> = Vec::new();
    let mut pending: Vec<NewEntry> = Vec::new();
    let mut final_text = String::new();
    for round in 1..=MAX_MODEL_ROUNDS {
        ctx.check()?;
        let allow_tools = round < MAX_MODEL_ROUNDS;
        let reply = model_round(ctx, round, &messages, &tools, allow_tools).await?;
        if reply.tool_calls.is_empty() || !allow_tools {
            final_text = reply.text;
            break;
        }
        messages.push(Message::Assistant {
            content: reply.text.clone(),
            tool_calls: reply.tool_calls.clone(),
        });
        for (index, call) in reply.tool_calls.iter().enumerate() {
            ctx.check()?;
            let answer = if index < MAX_TOOL_CALLS_PER_ROUND {
                dispatch(ctx, call).await?
            } else {
                Answer::plain(
                    tool_error(format!(
                        "at most {MAX_TOOL_CALLS_PER_ROUND} tool calls per round; this one was not run"
                    )),
                    false,
                )
            };
            booked.extend(answer.booked);
            if let Some(entry) = answer.pending {
                if !pending.contains(&entry) {
                    pending.push(entry);
                }
            }
            // Calls past the bound are answered to the model, not shown:
            // a turn's events stay within its channel (`EVENT_BUFFER`).
            if index < MAX_TOOL_CALLS_PER_ROUND {
                ctx.emit(AgentEvent::ToolResult {
                    call_id: call.id.clone(),
                    name: call.name.clone(),
                    result: answer.result.clone(),
                    cached: answer.cached,
                });
            }
            messages.push(Message::Tool {
                tool_call_id: call.id.clone(),
                name: call.name.clone(),
                content: answer.result.to_string(),
            });
        }
        if !pending.is_empty() {
            let text = pending_text(
                ctx.chinese,
                &booked,
                &pending,
                ctx.inner.config.confirmation_threshold_cents,
            );
            ctx.emit(AgentEvent::Delta { text: text.clone() });
            return Ok(Ending::Pending(Reply {
                text,
                entries: booked,
                pending,
                chinese: Some(ctx.chinese),
            }));
        }
    }
    if final_text.trim().is_empty() {
        final_text = booked_text(ctx.chinese, &booked);
        ctx.emit(AgentEvent::Delta {
            text: final_text.clone(),
        });
    }
    Ok(Ending::Reply(Reply {
        text: final_text,
        entries: booked,
        pending: Vec::new(),
        chinese: Some(ctx.chinese),
    }))
}

/// One model round, recorded as an engine tool execution so a retry of the
/// turn reuses its answer.
async fn model_round(
    ctx: &Ctx<'_>,
    round: u32,
    messages: &[Message],
    tools: &[ToolSpec],
    allow_tools: bool,
) -> Result<ModelReply, Failure> {
    let input = json!({"messages": messages, "allow_tools": allow_tools});
    let digest = agentgate::canonical::digest("model input", &input)?;
    let args = json!({"round": round, "input_sha256": digest.as_hex()});
    let execution = match ctx.turn.tool(MODEL_ROUND_TOOL, &args).await? {
        agentgate::ToolStep::Cached(value) => {
            let reply: ModelReply = serde_json::from_value(value)
                .map_err(|e| LedgerError::database(format!("stored model round: {e}")))?;
            if !reply.text.is_empty() {
                ctx.emit(AgentEvent::Delta {
                    text: reply.text.clone(),
                });
            }
            emit_calls(ctx, &reply);
            return Ok(reply);
        }
        agentgate::ToolStep::Execute(execution) => execution,
    };
    let deltas = |text: &str| {
        ctx.emit(AgentEvent::Delta {
            text: text.to_owned(),
        });
    };
    let request = ModelRequest {
        messages,
        tools,
        allow_tools,
    };
    let outcome = tokio::select! {
        outcome = ctx.inner.model.complete(request, &deltas) => outcome,
        () = ctx.signals.wait() => Err(ModelError::Cancelled),
    };
    match outcome {
        Ok(reply) => {
            let value = serde_json::to_value(&reply)
                .map_err(|e| LedgerError::database(format!("model reply: {e}")))?;
            execution.complete(&value).await?;
            emit_calls(ctx, &reply);
            Ok(reply)
        }
        Err(error) => {
            if let Err(fail_error) = execution.fail(&json!({"message": error.to_string()})).await {
                tracing::debug!(%fail_error, "could not record the failed model round");
            }
            match ctx.signals.fired() {
                Some(stop) => Err(Failure::Stopped(stop)),
                None => Err(Failure::Model(error)),
            }
        }
    }
}

/// Shows the calls the loop will run (at most [`MAX_TOOL_CALLS_PER_ROUND`]).
fn emit_calls(ctx: &Ctx<'_>, reply: &ModelReply) {
    for call in reply.tool_calls.iter().take(MAX_TOOL_CALLS_PER_ROUND) {
        ctx.emit(AgentEvent::ToolCall {
            call_id: call.id.clone(),
            name: call.name.clone(),
            args: call.arguments.clone(),
        });
    }
}

async fn dispatch(ctx: &Ctx<'_>, call: &ToolCallRequest) -> Result<Answer, Failure> {
    match call.name.as_str() {
        LIST_CATEGORIES => list_categories(ctx, &call.arguments).await,
        CREATE_TRANSACTION => create_transaction(ctx, &call.arguments).await,
        SEARCH_DOCUMENTS => search_documents(ctx, &call.arguments).await,
        other => Ok(Answer::plain(
            tool_error(format!(
                "unknown tool {other:?}; the tools are {LIST_CATEGORIES}, {CREATE_TRANSACTION} \
                 and {SEARCH_DOCUMENTS}"
            )),
            false,
        )),
    }
}

/// The longest passage text a search result carries to the model: a whole
/// chunk (`agentgate_ingest::limits::CHUNK_CHARS`).
const MAX_PASSAGE_CHARS: usize = agentgate_ingest::limits::CHUNK_CHARS;

/// Passages a search result carries.
const SEARCH_PASSAGES: usize = 3;

async fn search_documents(ctx: &Ctx<'_>, args: &Value) -> Result<Answer, Failure> {
    let query = match tools::search_documents_args(args) {
        Ok(query) => query,
        Err(message) => return refuse(ctx, SEARCH_DOCUMENTS, args, message).await,
    };
    let Some(documents) = ctx.inner.documents.get() else {
        return refuse(
            ctx,
            SEARCH_DOCUMENTS,
            args,
            "documents are not available on this server".to_owned(),
        )
        .await;
    };
    let execution = match ctx.turn.tool(SEARCH_DOCUMENTS, args).await? {
        agentgate::ToolStep::Cached(result) => return Ok(Answer::plain(result, true)),
        agentgate::ToolStep::Execute(execution) => execution,
    };
    match documents
        .search(ctx.turn.user_id().as_str(), &query, SEARCH_PASSAGES)
        .await
    {
        Ok(hits) => {
            let passages: Vec<Value> = hits
                .iter()
                .map(|hit| {
                    json!({
                        "name": hit.name,
                        "section": hit.chunk_index + 1,
                        "text": hit.text.chars().take(MAX_PASSAGE_CHARS).collect::<String>(),
                    })
                })
                .collect();
            let result = json!({"ok": true, "passages": passages});
            Ok(Answer::plain(execution.complete(&result).await?, false))
        }
        Err(error) => {
            let result = tool_error(format!("could not search the documents: {error}"));
            execution.fail(&result).await?;
            Ok(Answer::plain(result, false))
        }
    }
}

/// Records a call whose arguments failed validation as a failed execution
/// (visible on the dashboard) and returns the error for the model.
async fn refuse(
    ctx: &Ctx<'_>,
    tool: &str,
    args: &Value,
    message: String,
) -> Result<Answer, Failure> {
    let error = tool_error(message);
    match ctx.turn.tool(tool, args).await {
        Ok(agentgate::ToolStep::Execute(execution)) => execution.fail(&error).await?,
        Ok(agentgate::ToolStep::Cached(result)) => return Ok(Answer::plain(result, true)),
        // Arguments the engine itself refuses (too large, too deep) are
        // answered without a record.
        Err(engine) if engine.kind() == ErrorKind::InvalidRequest => {}
        Err(engine) => return Err(engine.into()),
    }
    Ok(Answer::plain(error, false))
}

async fn list_categories(ctx: &Ctx<'_>, args: &Value) -> Result<Answer, Failure> {
    let kind = match tools::list_categories_args(args) {
        Ok(kind) => kind,
        Err(message) => return refuse(ctx, LIST_CATEGORIES, args, message).await,
    };
    let execution = match ctx.turn.tool(LIST_CATEGORIES, args).await? {
        agentgate::ToolStep::Cached(result) => return Ok(Answer::plain(result, true)),
        agentgate::ToolStep::Execute(execution) => execution,
    };
    match ctx.inner.db.categories(Some(kind)).await {
        Ok(categories) => {
            let listed: Vec<Value> = categories
                .iter()
                .map(
                    |c| json!({"name": c.name, "synonyms": c.synonyms, "is_default": c.is_default}),
                )
                .collect();
            let result = json!({"ok": true, "type": kind.as_str(), "categories": listed});
            Ok(Answer::plain(execution.complete(&result).await?, false))
        }
        Err(error) => {
            let result = tool_error(format!("could not read the categories: {error}"));
            execution.fail(&result).await?;
            Ok(Answer::plain(result, false))
        }
    }
}

async fn create_transaction(ctx: &Ctx<'_>, args: &Value) -> Result<Answer, Failure> {
    let categories = ctx.inner.db.categories(None).await?;
    let valid = match tools::create_transaction_args(args, &categories, ctx.today) {
        Ok(valid) => valid,
        Err(message) => return refuse(ctx, CREATE_TRANSACTION, args, message).await,
    };
    let threshold = ctx.inner.config.confirmation_threshold_cents;
    if valid.entry.amount_cents > threshold {
        // Not claimed: nothing runs until the person approves, and then in
        // the confirmation turn, under its own execution key.
        let result = json!({
            "ok": false,
            "needs_confirmation": true,
            "entry": valid.entry,
            "error": format!("amount above {} needs the user's confirmation", format_cents(threshold)),
        });
        return Ok(Answer {
            result,
            cached: false,
            booked: None,
            pending: Some(valid.entry),
        });
    }
    let mut answer = book(ctx.inner, ctx.turn, args, valid.entry).await?;
    if let Some(result) = answer.result.as_object_mut() {
        result.insert("matched_by".into(), json!(valid.matched_by.as_str()));
    }
    Ok(answer)
}

/// Claims `create_transaction` with `args` and books `entry` in the same SQL
/// transaction as the execution's success mark; a claim that finds it done
/// returns the stored result and books nothing.
async fn book(
    inner: &Inner,
    turn: &Turn,
    args: &Value,
    entry: NewEntry,
) -> Result<Answer, Failure> {
    let execution = match turn.tool(CREATE_TRANSACTION, args).await? {
        agentgate::ToolStep::Cached(result) => {
            let booked = serde_json::from_value(result["entry"].clone()).ok();
            return Ok(Answer {
                result,
                cached: true,
                booked,
                pending: None,
            });
        }
        agentgate::ToolStep::Execute(execution) => execution,
    };
    // An unknown previous outcome cannot hide a booking here: the entry and
    // the success mark commit together, so a dead attempt booked nothing.
    // Reconcile anyway, by the execution's idempotency key, before booking:
    // the check is one indexed read, and it keeps the rule "look before you
    // re-run an unknown" true even for an entry written by other means.
    if execution.previous_outcome() == Some(agentgate::PreviousOutcome::Unknown) {
        let found = inner
            .db
            .entry_by_key(execution.idempotency_key())
            .await
            .map_err(Failure::Ledger)?;
        if let Some(entry) = found {
            tracing::info!(turn_id = %turn.id(), entry_id = entry.id, "an unknown booking was found by its key");
            let result = json!({"ok": true, "entry": entry});
            let result = execution.complete(&result).await?;
            let booked = serde_json::from_value(result["entry"].clone()).ok();
            return Ok(Answer {
                result,
                cached: true,
                booked,
                pending: None,
            });
        }
    }
    let insert = EntryInsert {
        user_id: turn.user_id().to_string(),
        session_id: turn.session_id().to_string(),
        turn_id: turn.id().to_string(),
        idempotency_key: execution.idempotency_key().to_owned(),
        entry,
    };
    match execution.complete_in_tx(insert_entry(insert)).await {
        Ok(result) => {
            let booked = serde_json::from_value(result["entry"].clone()).ok();
            Ok(Answer {
                result,
                cached: false,
                booked,
                pending: None,
            })
        }
        Err(agentgate::Error::Effect(cause)) => Ok(Answer::plain(
            tool_error(format!("the entry could not be booked: {cause}")),
            false,
        )),
        Err(engine) => Err(engine.into()),
    }
}

fn describe(entry_category: &str, cents: i64, note: &str, date: &str, chinese: bool) -> String {
    let amount = format_cents(cents);
    let entry_category = if chinese {
        entry_category
    } else {
        crate::category::english_name(entry_category)
    };
    match (chinese, note.is_empty()) {
        (true, false) => format!("{entry_category} {amount} 元（{note}，{date}）"),
        (true, true) => format!("{entry_category} {amount} 元（{date}）"),
        (false, false) => format!("{entry_category} {amount} ({note}, {date})"),
        (false, true) => format!("{entry_category} {amount} ({date})"),
    }
}

fn booked_text(chinese: bool, booked: &[Entry]) -> String {
    if booked.is_empty() {
        return if chinese {
            "这次没有记账。".to_owned()
        } else {
            "Nothing was booked.".to_owned()
        };
    }
    let lines: Vec<String> = booked
        .iter()
        .map(|e| {
            let what = describe(&e.category, e.amount_cents, &e.note, &e.occur_date, chinese);
            if chinese {
                format!("已记账：{what}")
            } else {
                format!("Booked: {what}")
            }
        })
        .collect();
    lines.join("\n")
}

fn pending_text(
    chinese: bool,
    booked: &[Entry],
    pending: &[NewEntry],
    threshold_cents: i64,
) -> String {
    let mut lines = Vec::new();
    if !booked.is_empty() {
        lines.push(booked_text(chinese, booked));
    }
    let threshold = format_cents(threshold_cents);
    for entry in pending {
        let what = describe(
            &entry.category,
            entry.amount_cents,
            &entry.note,
            &entry.occur_date,
            chinese,
        );
        lines.push(if chinese {
            format!("待确认：{what} 超过 {threshold} 元，确认后才会记账。")
        } else {
            format!("Needs your confirmation: {what} is above {threshold}; it is booked only once you approve.")
        });
    }
    lines.join("\n")
}

/// Runs a confirmation turn: books the pending entries on approve, nothing
/// on reject.
pub(crate) async fn run_confirmation(
    inner: &Inner,
    turn: Turn,
    events: Option<&EventSender>,
    caller: CancellationToken,
) -> Result<ChatOutcome> {
    let Some(context) = turn.confirmation().cloned() else {
        let error = LedgerError::invalid("not a confirmation turn");
        return finish_failed(turn, events, Failure::Ledger(error)).await;
    };
    let asked = Reply::from_value(&context.pending).unwrap_or_default();
    let chinese = asked.chinese.unwrap_or_else(|| is_chinese(&asked.text));
    let approve = context.decision == agentgate::Decision::Approve;
    let user_text = match (approve, chinese) {
        (true, true) => "确认",
        (false, true) => "取消",
        (true, false) => "Approve",
        (false, false) => "Reject",
    };
    let data = json!({"confirms": context.turn_id, "decision": context.decision});
    let (log, pump) = crate::events::tee(&turn, events);
    let work = async {
        let log = log;
        started(inner, &turn, Some(&log), user_text, data).await;
        book_confirmed(
            inner,
            &turn,
            Some(&log),
            caller,
            &asked.pending,
            approve,
            chinese,
        )
        .await
    };
    let (result, ()) = tokio::join!(work, pump);
    match result {
        Ok(reply) => finish_reply(inner, turn, events, &reply).await,
        Err(failure) => finish_failed(turn, events, failure).await,
    }
}

/// A confirmation turn's work up to its ending: books `pending` on approve
/// (each as its own tool execution), and the reply saying what was done.
async fn book_confirmed(
    inner: &Inner,
    turn: &Turn,
    events: Option<&EventSender>,
    caller: CancellationToken,
    pending: &[NewEntry],
    approve: bool,
    chinese: bool,
) -> Result<Reply, Failure> {
    let signals = Signals {
        lease: turn.cancellation(),
        caller,
    };
    let mut booked = Vec::new();
    let mut errors = Vec::new();
    if approve {
        for (index, entry) in pending.iter().enumerate() {
            if let Some(stop) = signals.fired() {
                return Err(Failure::Stopped(stop));
            }
            let args = tools::canonical_create_args(entry);
            let call_id = format!("confirm_{index}");
            emit(
                events,
                AgentEvent::ToolCall {
                    call_id: call_id.clone(),
                    name: CREATE_TRANSACTION.into(),
                    args: args.clone(),
                },
            );
            let answer = book(inner, turn, &args, entry.clone()).await?;
            emit(
                events,
                AgentEvent::ToolResult {
                    call_id,
                    name: CREATE_TRANSACTION.into(),
                    result: answer.result.clone(),
                    cached: answer.cached,
                },
            );
            match answer.booked {
                Some(entry) => booked.push(entry),
                None => errors.push(
                    answer.result["error"]
                        .as_str()
                        .unwrap_or("not booked")
                        .to_owned(),
                ),
            }
        }
    }
    let mut text = if approve {
        booked_text(chinese, &booked)
    } else if chinese {
        "已取消，这笔没有记账。".to_owned()
    } else {
        "Rejected; nothing was booked.".to_owned()
    };
    for error in errors {
        text.push('\n');
        text.push_str(&if chinese {
            format!("没有记账：{error}")
        } else {
            format!("Not booked: {error}")
        });
    }
    emit(events, AgentEvent::Delta { text: text.clone() });
    Ok(Reply {
        text,
        entries: booked,
        pending: Vec::new(),
        chinese: Some(chinese),
    })
}

async fn record_reply(inner: &Inner, view: &TurnView, reply: &Reply) {
    let row = MessageRow {
        user_id: view.user_id.to_string(),
        session_id: view.session_id.to_string(),
        turn_id: view.turn_id.to_string(),
        role: "assistant",
        content: reply.text.clone(),
        data: serde_json::to_value(reply).unwrap_or(Value::Null),
        created_at_ms: 0,
    };
    if let Err(error) = inner.db.insert_message(&row).await {
        tracing::warn!(turn_id = %view.turn_id, %error, "could not record the reply");
    }
}

/// Writes the transcript rows of an ended turn that a replay returns, so a
/// reply lost between the turn's ending and its transcript write reappears.
pub(crate) async fn record_replay(
    inner: &Inner,
    view: &TurnView,
    user_text: &str,
    user_data: Value,
) {
    let row = MessageRow {
        user_id: view.user_id.to_string(),
        session_id: view.session_id.to_string(),
        turn_id: view.turn_id.to_string(),
        role: "user",
        content: user_text.to_owned(),
        data: user_data,
        created_at_ms: 0,
    };
    if let Err(error) = inner.db.insert_message(&row).await {
        tracing::warn!(turn_id = %view.turn_id, %error, "could not record the user message");
    }
    if let Some(reply) = ChatOutcome::from_view(view, true).reply {
        record_reply(inner, view, &reply).await;
    }
}

async fn finish_reply(
    inner: &Inner,
    turn: Turn,
    events: Option<&EventSender>,
    reply: &Reply,
) -> Result<ChatOutcome> {
    let value = serde_json::to_value(reply).map_err(|e| LedgerError::database(e.to_string()))?;
    let view = match turn.succeed(&value).await {
        Ok(view) => view,
        Err(end) => return Err(report(events, LedgerError::Engine(end.into()))),
    };
    record_reply(inner, &view, reply).await;
    let outcome = ChatOutcome::from_view(&view, false);
    emit(
        events,
        AgentEvent::Final {
            outcome: outcome.clone(),
        },
    );
    Ok(outcome)
}

async fn finish_pending(
    inner: &Inner,
    turn: Turn,
    events: Option<&EventSender>,
    reply: &Reply,
) -> Result<ChatOutcome> {
    let value = serde_json::to_value(reply).map_err(|e| LedgerError::database(e.to_string()))?;
    let view = match turn.await_confirmation(&value).await {
        Ok(view) => view,
        Err(end) => return Err(report(events, LedgerError::Engine(end.into()))),
    };
    record_reply(inner, &view, reply).await;
    let outcome = ChatOutcome::from_view(&view, false);
    emit(
        events,
        AgentEvent::AwaitingConfirmation {
            turn_id: view.turn_id.to_string(),
            pending: reply.pending.clone(),
            text: reply.text.clone(),
        },
    );
    emit(
        events,
        AgentEvent::Final {
            outcome: outcome.clone(),
        },
    );
    Ok(outcome)
}

fn report(events: Option<&EventSender>, error: LedgerError) -> LedgerError {
    emit(
        events,
        AgentEvent::Error {
            code: error.code().to_owned(),
            message: error.to_string(),
            retryable: error.is_retryable(),
        },
    );
    error
}

/// Ends a turn that could not finish: failed as retryable (a repeat of the
/// request restarts it and replays its recorded rounds and tools), or left to
/// the engine when the lease is already gone.
async fn finish_failed(
    turn: Turn,
    events: Option<&EventSender>,
    failure: Failure,
) -> Result<ChatOutcome> {
    // Asked to stop through the engine (`POST /v1/turns/{id}/cancel`): the
    // turn ends cancelled, which a repeat of the message replays instead of
    // running the turn again; what ran is in its journal.
    if turn.cancel_requested() {
        if let Err(end_error) = turn.end_cancelled(&Value::Null).await {
            tracing::warn!(%end_error, "could not record the turn's cancellation; the lease will expire");
        }
        return Err(report(events, LedgerError::Cancelled));
    }
    let (error, ending) = match failure {
        Failure::Stopped(Stop::Caller) => (
            LedgerError::Cancelled,
            Some(json!({"code": "cancelled", "message": "the caller cancelled the turn"})),
        ),
        Failure::Stopped(Stop::LeaseLost) => (
            LedgerError::Engine(agentgate::Error::LeaseLost {
                reason: "the lease was lost while the turn ran",
            }),
            None,
        ),
        Failure::Model(error) => {
            let ending = json!({"code": "model_unavailable", "message": error.to_string()});
            (LedgerError::Model(error), Some(ending))
        }
        Failure::Ledger(LedgerError::Engine(error))
            if matches!(error.kind(), ErrorKind::LeaseLost) =>
        {
            (LedgerError::Engine(error), None)
        }
        Failure::Ledger(error) => {
            let ending = json!({"code": error.code(), "message": error.to_string()});
            (error, Some(ending))
        }
    };
    match ending {
        Some(ending) => {
            if let Err(end_error) = turn.fail(&ending, true).await {
                tracing::warn!(%end_error, "could not record the turn's failure; the lease will expire");
            }
        }
        // Nothing this holder writes would be accepted; dropping the guard
        // stops its watchdog.
        None => drop(turn),
    }
    Err(report(events, error))
}
