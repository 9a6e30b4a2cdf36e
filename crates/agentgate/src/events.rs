//! Following a turn's event log: an async stream of its events from any
//! id, live until the turn ends, shared per node.
//!
//! Each [`Gate`](crate::Gate) keeps one feed per followed turn (at most
//! [`MAX_FOLLOWED_TURNS`]): a task that reads the store after its cursor
//! whenever the turn's events or its session's release may have changed
//! ([`Store::watch_events`], [`Store::watch_releases`]: in-process, and
//! from other nodes by PostgreSQL `LISTEN` or the Redis layer's pub/sub)
//! or after [`EVENT_POLL`] at the
//! latest, and broadcasts what it read to every subscriber of the turn on
//! this node. So a thousand readers of one reply cost one store read per
//! change, not a thousand.
//!
//! A subscriber joins the broadcast first, then reads what came before
//! from the store itself (its backlog, after the id it resumes from), then
//! takes the broadcast, skipping what it already has: ids only grow, so
//! nothing is repeated and nothing is skipped. One that falls behind the
//! broadcast's buffer ([`EVENT_FANOUT_BUFFER`]) reads the gap from the
//! store again. The stream ends with [`Followed::End`] once the turn has
//! ended and every event before its ending was delivered.
//!
//! Memory is bounded per follower and per feed, never by the turn's log:
//! every store read is one page of [`FOLLOW_PAGE`] events; a follower
//! holds at most [`FOLLOW_BUFFER`] events its reader has not taken; a
//! broadcast page carries at most [`MAX_FANOUT_PAGE_BYTES`] of data (a
//! larger one is announced by its last id alone, and each subscriber reads
//! it in its own pages); and a reader that takes nothing for
//! [`FOLLOW_STALL`] while events wait is cut off, to resume later with the
//! last id it saw.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};

use agentgate_core::error::{Error, Result};
use agentgate_core::ids::TurnId;
use agentgate_core::limits::{
    EVENT_FANOUT_BUFFER, EVENT_POLL, FOLLOW_BUFFER, FOLLOW_PAGE, FOLLOW_STALL,
    MAX_FANOUT_PAGE_BYTES, MAX_FOLLOWED_TURNS,
};
use agentgate_core::model::{EventPage, TurnEvent, TurnState};
use agentgate_core::store::Store;
use tokio::sync::{broadcast, mpsc};
use tokio_stream::wrappers::ReceiverStream;

/// What a follower of a turn receives.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Followed {
    /// The next event, in id order.
    Event(TurnEvent),
    /// The turn ended (`state`, never `running` or `queued`) and every
    /// event it has was delivered; the stream closes after this.
    End {
        /// The turn's ending.
        state: TurnState,
        /// Its last attempt.
        attempt: u32,
    },
}

/// A stream of a turn's events ([`crate::Gate::follow`]).
pub type EventStream = ReceiverStream<Result<Followed>>;

/// What a feed broadcasts: a page it read.
#[derive(Clone, Debug)]
struct Update {
    /// The page's events; empty when they were more than
    /// [`MAX_FANOUT_PAGE_BYTES`] (subscribers read them from the store).
    events: Arc<[TurnEvent]>,
    /// The page's last event id (the feed's cursor after it).
    through: u64,
    /// The turn's state read before the events; an ending when the page
    /// was the last.
    ended: Option<(TurnState, u32)>,
}

/// The feeds of one gate, by turn.
#[derive(Clone, Default)]
pub(crate) struct Feeds {
    by_turn: Arc<Mutex<HashMap<TurnId, broadcast::Sender<Update>>>>,
}

impl std::fmt::Debug for Feeds {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Feeds").finish_non_exhaustive()
    }
}

fn ended(state: TurnState) -> bool {
    !matches!(state, TurnState::Running | TurnState::Queued)
}

impl Feeds {
    /// A receiver of `turn_id`'s feed, starting the feed if none runs.
    fn subscribe(
        &self,
        store: &Arc<dyn Store>,
        turn_id: &TurnId,
    ) -> Result<broadcast::Receiver<Update>> {
        let mut map = self.by_turn.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(sender) = map.get(turn_id) {
            return Ok(sender.subscribe());
        }
        if map.len() >= MAX_FOLLOWED_TURNS {
            return Err(Error::store(format!(
                "this node follows {MAX_FOLLOWED_TURNS} turns already"
            )));
        }
        let (sender, receiver) = broadcast::channel(EVENT_FANOUT_BUFFER);
        map.insert(turn_id.clone(), sender.clone());
        tokio::spawn(feed(
            self.clone(),
            Arc::clone(store),
            turn_id.clone(),
            sender,
        ));
        Ok(receiver)
    }

    /// Removes `turn_id`'s feed if it has no subscriber left; whether it
    /// did. Under the map's lock, so a subscriber either finds the feed
    /// before this or starts a new one after.
    fn retire_if_unwatched(&self, turn_id: &TurnId, sender: &broadcast::Sender<Update>) -> bool {
        let mut map = self.by_turn.lock().unwrap_or_else(PoisonError::into_inner);
        if sender.receiver_count() > 0 {
            return false;
        }
        map.remove(turn_id);
        true
    }

    fn retire(&self, turn_id: &TurnId) {
        self.by_turn
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .remove(turn_id);
    }

    /// Turns followed now.
    pub(crate) fn followed(&self) -> usize {
        self.by_turn
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .len()
    }
}

/// One turn's feed: read after the cursor, broadcast, wait for a change or
/// the poll; until the turn ends or nobody listens.
async fn feed(
    feeds: Feeds,
    store: Arc<dyn Store>,
    turn_id: TurnId,
    sender: broadcast::Sender<Update>,
) {
    let session = match store.turn(&turn_id).await {
        Ok(Some(view)) => Some(view.session_id),
        Ok(None) => None,
        Err(error) => {
            tracing::debug!(%turn_id, %error, "event feed could not read its turn; polling");
            None
        }
    };
    let mut cursor = 0u64;
    loop {
        if feeds.retire_if_unwatched(&turn_id, &sender) {
            return;
        }
        // Watches first, then the read: a change after the read wakes the wait.
        let mut events_watch = store.watch_events(&turn_id);
        let mut release_watch = session.as_ref().map(|s| store.watch_releases(s));
        let page = match store.events(&turn_id, cursor, FOLLOW_PAGE).await {
            Ok(Some(page)) => page,
            Ok(None) => {
                // Swept (or never was): subscribers read the store and see it.
                let _ = sender.send(Update {
                    events: Arc::from(Vec::new()),
                    through: cursor,
                    ended: Some((TurnState::Abandoned, 0)),
                });
                feeds.retire(&turn_id);
                return;
            }
            Err(error) => {
                tracing::debug!(%turn_id, %error, "event feed read failed; trying again");
                tokio::time::sleep(EVENT_POLL).await;
                continue;
            }
        };
        let full = page.events.len() >= FOLLOW_PAGE as usize;
        let last = ended(page.state) && !full;
        if let Some(event) = page.events.last() {
            cursor = event.event_id;
        }
        if !page.events.is_empty() || last {
            let bytes: usize = page.events.iter().map(|e| e.data.len()).sum();
            let events = if bytes <= MAX_FANOUT_PAGE_BYTES {
                page.events
            } else {
                Vec::new()
            };
            let _ = sender.send(Update {
                events: Arc::from(events),
                through: cursor,
                ended: last.then_some((page.state, page.attempt)),
            });
        }
        if last {
            feeds.retire(&turn_id);
            return;
        }
        if full {
            continue;
        }
        match release_watch.as_mut() {
            Some(release) => {
                tokio::select! {
                    biased;
                    _ = events_watch.wait(EVENT_POLL) => {}
                    _ = release.wait(EVENT_POLL) => {}
                }
            }
            None => {
                events_watch.wait(EVENT_POLL).await;
            }
        }
    }
}

/// Follows `turn_id`'s events after `after` (see the module docs).
pub(crate) fn follow(
    feeds: &Feeds,
    store: &Arc<dyn Store>,
    turn_id: &TurnId,
    after: u64,
) -> Result<EventStream> {
    let updates = feeds.subscribe(store, turn_id)?;
    let (sender, receiver) = mpsc::channel(FOLLOW_BUFFER);
    let follower = Follower {
        feeds: feeds.clone(),
        store: Arc::clone(store),
        turn_id: turn_id.clone(),
        out: sender,
    };
    tokio::spawn(follower.run(after, updates));
    Ok(ReceiverStream::new(receiver))
}

/// Hands `item` to the reader, waiting at most [`FOLLOW_STALL`] for room;
/// `Err` when the reader went away or stalled (the stream then closes, and
/// the reader resumes after the last id it took).
async fn deliver(
    out: &mpsc::Sender<Result<Followed>>,
    item: Result<Followed>,
) -> std::result::Result<(), ()> {
    match tokio::time::timeout(FOLLOW_STALL, out.send(item)).await {
        Ok(Ok(())) => Ok(()),
        Ok(Err(_)) => Err(()),
        Err(_) => {
            tracing::info!("event follower cut off: its reader took nothing for {FOLLOW_STALL:?}");
            Err(())
        }
    }
}

/// Delivers the store's pages after `*cursor` until one that is not full;
/// `Some` with the ending when the turn ended and everything was delivered.
/// `Err(None)` when the reader went away or stalled.
async fn catch_up(
    store: &Arc<dyn Store>,
    turn_id: &TurnId,
    cursor: &mut u64,
    out: &mpsc::Sender<Result<Followed>>,
) -> std::result::Result<Option<(TurnState, u32)>, Option<Error>> {
    loop {
        let page: EventPage = match store.events(turn_id, *cursor, FOLLOW_PAGE).await {
            Ok(Some(page)) => page,
            Ok(None) => return Err(Some(Error::not_found(format!("turn {turn_id}")))),
            Err(error) => return Err(Some(error)),
        };
        let full = page.events.len() >= FOLLOW_PAGE as usize;
        for event in page.events {
            *cursor = event.event_id;
            deliver(out, Ok(Followed::Event(event)))
                .await
                .map_err(|()| None)?;
        }
        if !full {
            return Ok(ended(page.state).then_some((page.state, page.attempt)));
        }
    }
}

/// One subscriber's task: its backlog, then the feed.
struct Follower {
    feeds: Feeds,
    store: Arc<dyn Store>,
    turn_id: TurnId,
    out: mpsc::Sender<Result<Followed>>,
}

impl Follower {
    /// Reads the store after `*cursor`; whether the stream is over (it
    /// ended, failed, or its reader went away).
    async fn catch_up_or_end(&self, cursor: &mut u64) -> bool {
        match catch_up(&self.store, &self.turn_id, cursor, &self.out).await {
            Ok(Some((state, attempt))) => {
                let _ = deliver(&self.out, Ok(Followed::End { state, attempt })).await;
                true
            }
            Ok(None) => false,
            Err(None) => true,
            Err(Some(error)) => {
                let _ = deliver(&self.out, Err(error)).await;
                true
            }
        }
    }

    async fn run(self, after: u64, mut updates: broadcast::Receiver<Update>) {
        let mut cursor = after;
        let mut stale = true; // the backlog is not read yet
        loop {
            if stale {
                if self.catch_up_or_end(&mut cursor).await {
                    return;
                }
                stale = false;
            }
            let update = tokio::select! {
                biased;
                update = updates.recv() => update,
                () = self.out.closed() => return,
            };
            match update {
                Ok(update) => {
                    for event in update.events.iter() {
                        if event.event_id <= cursor {
                            continue;
                        }
                        if event.event_id != cursor + 1 {
                            // A page this subscriber did not see: read the gap.
                            stale = true;
                            break;
                        }
                        cursor = event.event_id;
                        if deliver(&self.out, Ok(Followed::Event(event.clone())))
                            .await
                            .is_err()
                        {
                            return;
                        }
                    }
                    // A page announced without its events (or one this
                    // subscriber skipped part of): read it from the store.
                    if update.through > cursor {
                        stale = true;
                    }
                    // The ending: the store, read once more, says whether
                    // anything is left and how the turn ended.
                    if update.ended.is_some() {
                        stale = true;
                    }
                }
                Err(broadcast::error::RecvError::Lagged(_)) => stale = true,
                Err(broadcast::error::RecvError::Closed) => {
                    // The feed retired: the turn ended (or is gone). Unless
                    // a repeat restarted it meanwhile, this ends the stream;
                    // if it did, follow the new attempt.
                    if self.catch_up_or_end(&mut cursor).await {
                        return;
                    }
                    match self.feeds.subscribe(&self.store, &self.turn_id) {
                        Ok(receiver) => updates = receiver,
                        Err(error) => {
                            let _ = deliver(&self.out, Err(error)).await;
                            return;
                        }
                    }
                }
            }
        }
    }
}
