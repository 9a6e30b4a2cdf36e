//! The history of one run: every store call and its return, every fault
//! injected, and what each applied step did to the store's state, stamped
//! with simulated time. The checker reads it; a digest of it proves a seed
//! replays exactly.

use std::fmt::Write as _;
use std::sync::{Arc, Mutex, MutexGuard};

/// One recorded fact.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Event {
    /// A client called a store step.
    Call {
        /// Call number, unique in the run.
        call: u64,
        /// The step.
        op: &'static str,
        /// The turn or session it is about.
        subject: String,
    },
    /// A fault was injected into a call.
    Fault {
        /// The call.
        call: u64,
        /// Which fault.
        fault: Fault,
    },
    /// A call returned to its client.
    Return {
        /// The call.
        call: u64,
        /// `ok ...` or the error code.
        result: String,
    },
    /// The store granted a lease.
    Grant {
        /// The session.
        session: String,
        /// Its user.
        user: String,
        /// The turn.
        turn: String,
        /// The client request the turn answers.
        request: String,
        /// The grant's fence.
        fence: i64,
        /// Store-clock expiry.
        expires_at_ms: i64,
        /// The user's cap in force.
        cap: u32,
        /// Whether it took over a running turn.
        takeover: bool,
    },
    /// A heartbeat renewed a lease.
    Renew {
        /// The grant's fence.
        fence: i64,
        /// New store-clock expiry.
        expires_at_ms: i64,
    },
    /// A write conditioned on a lease was applied.
    Write {
        /// The step.
        what: &'static str,
        /// The session written.
        session: String,
        /// The fence of the caller's grant (its token's, not the row's).
        fence: i64,
    },
    /// A lease was released (by an ending or an abandon).
    Release {
        /// The grant's fence.
        fence: i64,
    },
    /// An orphan was ended `abandoned` without a lease.
    Abandon {
        /// The orphan's grant fence.
        fence: i64,
    },
    /// A tool execution was claimed for running.
    ToolExecute {
        /// Its idempotency key.
        key: String,
        /// The turn it runs for.
        turn: String,
        /// The claimer's fence.
        fence: i64,
        /// The attempt.
        attempt: u32,
    },
    /// A cancel request was recorded on a running turn (docs/protocol.md
    /// §3.7): from here on none of its tools may run.
    CancelRecorded {
        /// The turn.
        turn: String,
    },
    /// A tool execution was marked succeeded.
    ToolDone {
        /// Its idempotency key.
        key: String,
        /// The completer's fence.
        fence: i64,
        /// The stored result.
        result: String,
    },
    /// The store's answer to a tool claim, as the store wrapper received it
    /// (before any lost reply): enough to hold any store, real or
    /// simulated, to docs/protocol.md §2.4 from outside.
    ToolClaimed {
        /// The call.
        call: u64,
        /// The claimed call's idempotency key (one per turn, tool and args).
        key: String,
        /// The fence of the caller's grant.
        fence: i64,
        /// What the store answered.
        answer: ClaimAnswer,
    },
    /// The store's answer to a tool completion or failure, as the store
    /// wrapper received it (before any lost reply).
    ToolFinished {
        /// The call.
        call: u64,
        /// The execution's idempotency key.
        key: String,
        /// The fence of the caller's grant.
        fence: i64,
        /// What the store answered.
        outcome: FinishAnswer,
    },
    /// A turn ended.
    Ended {
        /// The turn.
        turn: String,
        /// Its new state.
        state: &'static str,
        /// The stored response of a success.
        response: Option<String>,
    },
    /// A begin replayed a turn (in the store), or a client received a
    /// replay (`observed`).
    Replay {
        /// The turn.
        turn: String,
        /// Its state.
        state: &'static str,
        /// Its response, when succeeded.
        response: Option<String>,
        /// Seen by a client, not by the store.
        observed: bool,
    },
    /// The downstream ledger received a tool's effect.
    Effect {
        /// The idempotency key.
        key: String,
        /// The sender's fence.
        fence: i64,
        /// The execution attempt that sent it.
        attempt: u32,
        /// The booking id the ledger answered with.
        booking: u64,
        /// Whether this arrival booked it (false: deduplicated by the key).
        first: bool,
    },
    /// Store-internal facts after an applied step.
    Facts {
        /// Live holders: (session, fence, expiry).
        holders: Vec<(String, i64, i64)>,
        /// Live permits per user.
        live: Vec<(String, u32)>,
    },
    /// What a client received from a step, as the store wrapper saw it
    /// delivered (a lost reply is not observed): enough to check a store
    /// that records no history of its own.
    Observed {
        /// The call.
        call: u64,
        /// What it told the client.
        what: Observed,
    },
    /// The run is over and every client stopped: the turns still running.
    Quiesced {
        /// Turns left `running`.
        running: Vec<String>,
    },
    /// A client-side fault: a holder crashed or paused.
    Client {
        /// `crash` or `pause`.
        what: &'static str,
        /// The holder's fence.
        fence: i64,
    },
}

/// A step's answer as a client received it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Observed {
    /// A begin granted a lease.
    Granted {
        /// The session.
        session: String,
        /// The grant's fence.
        fence: i64,
    },
    /// A lease-conditioned write succeeded.
    Wrote {
        /// The step.
        what: &'static str,
        /// The session.
        session: String,
        /// The caller's fence.
        fence: i64,
    },
    /// A tool completion succeeded.
    Completed {
        /// The session.
        session: String,
        /// The idempotency key.
        key: String,
        /// The caller's fence.
        fence: i64,
        /// The stored result.
        result: String,
    },
}

/// A store's answer to a tool claim.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ClaimAnswer {
    /// Run the tool: this attempt.
    Execute {
        /// The attempt.
        attempt: u32,
    },
    /// Do not run it: the stored result.
    Cached {
        /// The stored result.
        result: String,
    },
    /// Refused, with this error code.
    Refused {
        /// The error code.
        code: &'static str,
    },
}

/// A store's answer to a tool completion or failure.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum FinishAnswer {
    /// Marked succeeded, with this stored result.
    Succeeded {
        /// The stored result.
        result: String,
    },
    /// Marked failed.
    Failed,
    /// Refused, with this error code.
    Refused {
        /// The error code.
        code: &'static str,
    },
}

/// Faults the store wrapper injects.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Fault {
    /// `store_unavailable` before the step: nothing applied.
    Unavailable,
    /// The step applied, its reply was lost: the caller gets an error.
    LostReply,
    /// The caller is crashed or paused: the call never reaches the store.
    Partitioned,
    /// A delay before or after the step.
    Latency,
}

/// One history entry.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Entry {
    /// Simulated milliseconds since the run started.
    pub at_ms: i64,
    /// What happened.
    pub event: Event,
}

/// A run's shared, append-only history.
#[derive(Clone, Debug, Default)]
pub struct History(Arc<Mutex<Vec<Entry>>>);

impl History {
    /// Appends `event` at `at_ms`.
    pub fn push(&self, at_ms: i64, event: Event) {
        self.lock().push(Entry { at_ms, event });
    }

    /// A copy of the entries so far.
    pub fn entries(&self) -> Vec<Entry> {
        self.lock().clone()
    }

    fn lock(&self) -> MutexGuard<'_, Vec<Entry>> {
        // A panic while holding the lock poisons it; the history is still
        // what was recorded, so read it anyway.
        self.0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

/// FNV-1a over the entries' debug text: equal histories, equal digests.
pub fn digest(entries: &[Entry]) -> u64 {
    let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
    let mut text = String::new();
    for entry in entries {
        text.clear();
        let _ = write!(text, "{entry:?}");
        for byte in text.bytes() {
            hash ^= u64::from(byte);
            hash = hash.wrapping_mul(0x0000_0100_0000_01b3);
        }
    }
    hash
}
