//! Release notifications for waiting begins, in-process, written once.
//!
//! Every store handle keeps one [`Wakeups`]: a map from a watched session
//! to a counter that each release of it (an ending, an abandon, a
//! force-release made through this handle, or a notification from another
//! node where the store has one) bumps. A waiting begin takes a watch
//! before its attempt, so a release between the attempt and its wait is
//! seen; the entry goes when its last watch does. At most
//! [`MAX_WATCHED_SESSIONS`] sessions are watched at once; past that a
//! waiter waits by its bounded poll alone, as it does for a release no
//! notification reports (a lease that simply expired).
//!
//! Where releases on other nodes arrive by notification (PostgreSQL), the
//! listener says when it is listening ([`Wakeups::listening`]); each time
//! it starts listening it wakes every watch, since a release announced
//! while it was not listening reached no one.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use agentgate_core::ids::SessionId;
use agentgate_core::limits::MAX_WATCHED_SESSIONS;
use agentgate_core::store::ReleaseWatch;
use tokio::sync::watch;

type Map = HashMap<String, watch::Sender<u64>>;

/// The sessions watched through one store handle. Clones share it.
#[derive(Clone, Debug, Default)]
pub struct Wakeups {
    watched: Arc<Mutex<Map>>,
    /// Whether releases on other nodes reach these watches now.
    listening: Arc<AtomicBool>,
}

fn lock(map: &Mutex<Map>) -> std::sync::MutexGuard<'_, Map> {
    // The map holds no invariant a panicking holder could break halfway.
    map.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Wakes every watch of one session.
fn wake(sender: &watch::Sender<u64>) {
    sender.send_modify(|n| *n = n.wrapping_add(1));
}

impl Wakeups {
    /// Wakes the watches of `session_id`, if any.
    pub fn released(&self, session_id: &str) {
        if let Some(sender) = lock(&self.watched).get(session_id) {
            wake(sender);
        }
    }

    /// Marks whether this handle hears other nodes' releases now. Turning
    /// it on wakes every watch: what was announced before reached no one,
    /// so each waiter tries again at once rather than after its poll.
    pub fn listening(&self, listening: bool) {
        self.listening.store(listening, Ordering::SeqCst);
        if listening {
            lock(&self.watched).values().for_each(wake);
        }
    }

    /// A watch on `session_id`'s releases from now on.
    pub fn watch(&self, session_id: &SessionId) -> Box<dyn ReleaseWatch> {
        self.watch_key(session_id.as_str())
    }

    /// A watch on whatever `key` names (a session's releases, or, in a
    /// store's second `Wakeups`, a turn's new events) from now on.
    pub fn watch_key(&self, key: &str) -> Box<dyn ReleaseWatch> {
        let mut map = lock(&self.watched);
        let receiver = match map.get(key) {
            Some(sender) => Some(sender.subscribe()),
            None if map.len() < MAX_WATCHED_SESSIONS => {
                let (sender, receiver) = watch::channel(0);
                map.insert(key.to_owned(), sender);
                Some(receiver)
            }
            None => None,
        };
        Box::new(Watch {
            receiver,
            session_id: key.to_owned(),
            watched: Arc::clone(&self.watched),
            listening: Arc::clone(&self.listening),
        })
    }

    /// How many sessions are watched now.
    pub fn watched(&self) -> usize {
        lock(&self.watched).len()
    }
}

struct Watch {
    /// `None` past [`MAX_WATCHED_SESSIONS`]: the poll alone.
    receiver: Option<watch::Receiver<u64>>,
    session_id: String,
    watched: Arc<Mutex<Map>>,
    listening: Arc<AtomicBool>,
}

#[async_trait::async_trait]
impl ReleaseWatch for Watch {
    async fn wait(&mut self, max: Duration) -> bool {
        let Some(receiver) = self.receiver.as_mut() else {
            tokio::time::sleep(max).await;
            return false;
        };
        // The sender lives while this receiver does (it is removed only
        // when its last receiver goes), so `changed` fails only if the map
        // entry was replaced, which `Drop` below never does while we live.
        matches!(
            tokio::time::timeout(max, receiver.changed()).await,
            Ok(Ok(()))
        )
    }

    fn across_nodes(&self) -> bool {
        self.receiver.is_some() && self.listening.load(Ordering::SeqCst)
    }
}

impl Drop for Watch {
    fn drop(&mut self) {
        let Some(receiver) = self.receiver.take() else {
            return;
        };
        drop(receiver);
        let mut map = lock(&self.watched);
        if map
            .get(&self.session_id)
            .is_some_and(|sender| sender.receiver_count() == 0)
        {
            map.remove(&self.session_id);
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    fn session(id: &str) -> SessionId {
        SessionId::new(id).unwrap()
    }

    #[tokio::test]
    async fn a_release_after_the_watch_wakes_it_and_another_session_does_not() {
        let wakeups = Wakeups::default();
        let mut watch = wakeups.watch(&session("s1"));
        wakeups.released("s2");
        assert!(
            !watch.wait(Duration::from_millis(20)).await,
            "another session"
        );
        // Released before the wait began, after the watch was taken: seen.
        wakeups.released("s1");
        assert!(watch.wait(Duration::from_secs(5)).await);
        assert!(!watch.wait(Duration::from_millis(20)).await, "seen once");
    }

    #[tokio::test]
    async fn starting_to_listen_wakes_every_watch_and_is_reported() {
        let wakeups = Wakeups::default();
        let mut first = wakeups.watch(&session("s1"));
        let mut second = wakeups.watch(&session("s2"));
        assert!(!first.across_nodes(), "not listening yet");
        wakeups.listening(true);
        assert!(first.across_nodes() && second.across_nodes());
        assert!(first.wait(Duration::from_secs(5)).await, "resync wake");
        assert!(second.wait(Duration::from_secs(5)).await, "resync wake");
        wakeups.listening(false);
        assert!(!first.across_nodes());
        assert!(
            !first.wait(Duration::from_millis(20)).await,
            "no wake on loss"
        );
    }

    #[tokio::test]
    async fn the_entry_goes_with_its_last_watch() {
        let wakeups = Wakeups::default();
        let first = wakeups.watch(&session("s1"));
        let second = wakeups.watch(&session("s1"));
        assert_eq!(wakeups.watched(), 1);
        drop(first);
        assert_eq!(wakeups.watched(), 1, "one watch is left");
        drop(second);
        assert_eq!(wakeups.watched(), 0);
        wakeups.released("s1");
    }
}
