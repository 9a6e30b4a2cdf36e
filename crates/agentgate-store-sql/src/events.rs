//! A turn's event log, written once: the holder's fenced append and the
//! readers' pages.
//!
//! An append is one step: the caller's lease checked in the step's
//! transaction ([`StepTx::open`]), the turn's counters read, the decision
//! (`decide::check_event_append`: running, same fence, within the bounds)
//! taken, the events inserted with the ids it gives, and the counters moved
//! by an update conditioned on the fence and the count it read. A takeover
//! between the check and the update changes the turn's fence, so the update
//! misses and the step runs again, where the check refuses: a zombie's
//! events never land after a takeover. Two appends of one holder at once
//! meet on the primary key or the count, and the loser runs again.
//!
//! A page reads the turn's state first, then its events: an event appended
//! before an ending committed before the ending did, so a page whose state
//! is an ending and that is not full holds every event the turn has.

use agentgate_core::decide::{check_event_append, EventLogFacts};
use agentgate_core::error::{Error, Result};
use agentgate_core::ids::TurnId;
use agentgate_core::limits::MAX_EVENT_PAGE;
use agentgate_core::model::{EventPage, LeaseRef, NewEvent, TurnEvent, TurnState};

use crate::query::{Arg, On, Statement};
use crate::rows::Columns;
use crate::{Retry, StepTx};

/// The turn's event counters, fence, state and attempt, in the step's
/// transaction.
async fn log_facts<S: StepTx>(
    sql: &S,
    tx: &mut S::Tx,
    turn_id: &TurnId,
) -> Result<(EventLogFacts, i64)> {
    let statement = Statement::new(
        "SELECT state, fence, attempt, event_count, event_bytes FROM ag_turns WHERE turn_id = $1",
    )
    .text(turn_id.as_str());
    let row = sql.fetch_one(On::Conn(S::conn(tx)), statement).await?;
    let row = S::columns(&row);
    let state: TurnState = row.text_required("state")?.parse()?;
    let count = row.int("event_count")?.unwrap_or(0);
    let bytes = row.int("event_bytes")?.unwrap_or(0);
    let (Ok(count), Ok(bytes)) = (u64::try_from(count), u64::try_from(bytes)) else {
        return Err(Error::corrupt(format!(
            "turn {turn_id} counts {count} events of {bytes} bytes"
        )));
    };
    let facts = EventLogFacts {
        running: state == TurnState::Running,
        fence: row.int_required("fence")?,
        count,
        bytes,
    };
    Ok((facts, row.int_required("attempt")?))
}

/// One run of an append; the last new event's id.
async fn append_once<S: StepTx>(sql: &S, lease: &LeaseRef, events: &[NewEvent]) -> Result<u64> {
    let (mut tx, live) = sql.open(lease).await?;
    let (facts, attempt) = log_facts(sql, &mut tx, &lease.turn_id).await?;
    let bytes: u64 = events.iter().map(NewEvent::size).sum();
    let first = check_event_append(
        lease.turn_id.as_str(),
        facts,
        live.fence.0,
        events.len(),
        bytes,
    )?;
    let ids: Vec<i64> = (first..)
        .take(events.len())
        .map(|id| i64::try_from(id).map_err(|_| Error::corrupt("event id out of range")))
        .collect::<Result<_>>()?;
    let mut insert = Statement::new(
        "INSERT INTO ag_turn_events (turn_id, event_id, attempt, name, data, created_at_ms) VALUES ",
    );
    let mut rows = Vec::with_capacity(events.len());
    for (event, id) in events.iter().zip(&ids) {
        let placeholders = [
            insert.bind(Arg::Text(lease.turn_id.as_str())),
            insert.bind(Arg::Int(*id)),
            insert.bind(Arg::Int(attempt)),
            insert.bind(Arg::Text(&event.name)),
            insert.bind(Arg::Text(event.data.as_str())),
            insert.bind(Arg::Int(live.now_ms)),
        ];
        rows.push(format!("({})", placeholders.join(", ")));
    }
    insert.push(&rows.join(", "));
    let inserted = sql.execute(On::Conn(S::conn(&mut tx)), insert).await?;
    if inserted != events.len() as u64 {
        return Err(Error::corrupt(format!(
            "an append of {} events inserted {inserted}",
            events.len()
        )));
    }
    let count = i64::try_from(facts.count).map_err(|_| Error::corrupt("event count"))?;
    let total = i64::try_from(facts.bytes + bytes).map_err(|_| Error::corrupt("event bytes"))?;
    let moved = sql
        .execute(
            On::Conn(S::conn(&mut tx)),
            Statement::new(
                "UPDATE ag_turns SET event_count = $1, event_bytes = $2 \
                 WHERE turn_id = $3 AND state = 'running' AND fence = $4 \
                   AND COALESCE(event_count, 0) = $5",
            )
            .int(count + events.len() as i64)
            .int(total)
            .text(lease.turn_id.as_str())
            .int(live.fence.0)
            .int(count),
        )
        .await?;
    match moved {
        1 => {}
        // A takeover or another append of the same holder since the read:
        // run the step again, which decides on what is there now.
        0 => {
            return Err(Error::conflict(format!(
                "turn {} changed while its events were appended",
                lease.turn_id
            )))
        }
        n => return Err(Error::corrupt(format!("an append moved {n} turns"))),
    }
    sql.commit(tx).await?;
    Ok(first + events.len() as u64 - 1)
}

/// Appends `events` under `lease` (see the module docs); the last new
/// event's id.
///
/// # Errors
/// `lease_lost`, `invalid_request` (as `decide::check_event_append`), the
/// store's.
pub async fn append<S: StepTx>(sql: &S, lease: &LeaseRef, events: &[NewEvent]) -> Result<u64> {
    let mut retry = Retry::new();
    loop {
        match append_once(sql, lease, events).await {
            Ok(last) => return Ok(last),
            Err(error) => retry.after(error).await?,
        }
    }
}

/// The turn's events after `after`, at most `limit` (capped at
/// [`MAX_EVENT_PAGE`]), after its state; `None` for no such turn.
///
/// # Errors
/// The store's; `corrupt` for a row the engine never writes.
pub async fn page<S: crate::query::Run>(
    sql: &S,
    turn_id: &TurnId,
    after: u64,
    limit: u32,
) -> Result<Option<EventPage>> {
    let turn = sql
        .fetch_optional(
            On::Read,
            Statement::new("SELECT state, attempt FROM ag_turns WHERE turn_id = $1")
                .text(turn_id.as_str()),
        )
        .await?;
    let Some(turn) = turn else {
        return Ok(None);
    };
    let (state, attempt) = {
        let row = S::columns(&turn);
        let state: TurnState = row.text_required("state")?.parse()?;
        (state, row.int_required("attempt")?)
    };
    // No id reaches 2^63: after one past that, there is nothing.
    let after = i64::try_from(after).unwrap_or(i64::MAX);
    let rows = sql
        .fetch(
            On::Read,
            Statement::new(
                "SELECT event_id, attempt, name, data FROM ag_turn_events \
                 WHERE turn_id = $1 AND event_id > $2 ORDER BY event_id LIMIT $3",
            )
            .text(turn_id.as_str())
            .int(after)
            .int(i64::from(limit.clamp(1, MAX_EVENT_PAGE))),
        )
        .await?;
    let mut events = Vec::with_capacity(rows.len());
    let mut previous = after;
    for row in &rows {
        let row = S::columns(row);
        let event_id = row.int_required("event_id")?;
        if event_id <= previous {
            return Err(Error::corrupt(format!(
                "turn {turn_id}'s events out of order at {event_id}"
            )));
        }
        previous = event_id;
        events.push(TurnEvent {
            event_id: u64::try_from(event_id).map_err(|_| Error::corrupt("event id"))?,
            attempt: u32::try_from(row.int_required("attempt")?)
                .map_err(|_| Error::corrupt("event attempt"))?,
            name: row.text_required("name")?,
            data: row.text_required("data")?,
        });
    }
    Ok(Some(EventPage {
        state,
        attempt: u32::try_from(attempt).map_err(|_| Error::corrupt("turn attempt"))?,
        events,
    }))
}
