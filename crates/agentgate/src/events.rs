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

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};

use agentgate_core::error::{Error, Result};
use agentgate_core::ids::TurnId;
use agentgate_core::limits::{EVENT_FANOUT_BUFFER, EVENT_POLL, MAX_EVENT_PAGE, MAX_FOLLOWED_TURNS};
use agentgate_core::model::{EventPage, TurnEvent, TurnState};
use agentgate_core::store::Store;
use tokio::sync::{broadcast, mpsc};
use tokio_stream::wrappers::ReceiverStream;

/// Items a subscriber's channel buffers before its reader takes them.
const SUBSCRIBER_BUFFER: usize = 64;

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
    events: Arc<[TurnEvent]>,
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
        let page = match store.events(&turn_id, cursor, MAX_EVENT_PAGE).await {
            Ok(Some(page)) => page,
            Ok(None) => {
                // Swept (or never was): subscribers read the store and see it.
                let _ = sender.send(Update {
                    events: Arc::from(Vec::new()),
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
        let full = page.events.len() >= MAX_EVENT_PAGE as usize;
        let last = ended(page.state) && !full;
        if let Some(event) = page.events.last() {
            cursor = event.event_id;
        }
        if !page.events.is_empty() || last {
            let _ = sender.send(Update {
                events: Arc::from(page.events),
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
    let (sender, receiver) = mpsc::channel(SUBSCRIBER_BUFFER);
    let follower = Follower {
        feeds: feeds.clone(),
        store: Arc::clone(store),
        turn_id: turn_id.clone(),
        out: sender,
    };
    tokio::spawn(follower.run(after, updates));
    Ok(ReceiverStream::new(receiver))
}

/// Delivers the store's pages after `*cursor` until one that is not full;
/// `Some` with the ending when the turn ended and everything was delivered.
/// `Err(None)` when the reader went away.
async fn catch_up(
    store: &Arc<dyn Store>,
    turn_id: &TurnId,
    cursor: &mut u64,
    out: &mpsc::Sender<Result<Followed>>,
) -> std::result::Result<Option<(TurnState, u32)>, Option<Error>> {
    loop {
        let page: EventPage = match store.events(turn_id, *cursor, MAX_EVENT_PAGE).await {
            Ok(Some(page)) => page,
            Ok(None) => return Err(Some(Error::not_found(format!("turn {turn_id}")))),
            Err(error) => return Err(Some(error)),
        };
        let full = page.events.len() >= MAX_EVENT_PAGE as usize;
        for event in page.events {
            *cursor = event.event_id;
            out.send(Ok(Followed::Event(event)))
                .await
                .map_err(|_| None)?;
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
                let _ = self.out.send(Ok(Followed::End { state, attempt })).await;
                true
            }
            Ok(None) => false,
            Err(None) => true,
            Err(Some(error)) => {
                let _ = self.out.send(Err(error)).await;
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
                        if self
                            .out
                            .send(Ok(Followed::Event(event.clone())))
                            .await
                            .is_err()
                        {
                            return;
                        }
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
                            let _ = self.out.send(Err(error)).await;
                            return;
                        }
                    }
                }
            }
        }
    }
}
