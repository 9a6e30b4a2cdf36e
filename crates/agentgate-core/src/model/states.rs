//! The states and policies the protocol names: turn, tool, previous-outcome
//! and decision states as stored and sent, and what a begin does on a busy
//! session.

use super::*;

macro_rules! wire_enum {
    ($(#[$doc:meta])* $name:ident { $($(#[$vdoc:meta])* $variant:ident => $text:literal),+ $(,)? }) => {
        $(#[$doc])*
        #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
        pub enum $name {
            $($(#[$vdoc])* #[serde(rename = $text)] $variant),+
        }

        impl $name {
            /// Every value, in declaration order.
            pub const ALL: &'static [Self] = &[$(Self::$variant),+];

            /// The name stored and sent on the wire.
            pub fn as_str(self) -> &'static str {
                match self { $(Self::$variant => $text),+ }
            }
        }

        impl FromStr for $name {
            type Err = Error;
            fn from_str(text: &str) -> Result<Self> {
                match text {
                    $($text => Ok(Self::$variant),)+
                    other => Err(Error::store(format!(concat!("unknown ", stringify!($name), " {:?} in store"), other))),
                }
            }
        }
    };
}

wire_enum!(
    /// Where a turn is in its life.
    TurnState {
        /// Under a lease (live, or dead and waiting for a takeover).
        Running => "running",
        /// Ended with a response; repeats replay it.
        Succeeded => "succeeded",
        /// Ended with an error; retryable ones restart on a repeat.
        Failed => "failed",
        /// Ended waiting for a person to approve or reject `pending`.
        AwaitingConfirmation => "awaiting_confirmation",
        /// Was awaiting confirmation; a continuation turn took the decision.
        Confirmed => "confirmed",
        /// Orphaned (its lease expired without an ending) and claimed by no
        /// one within the orphan grace: ended by the sweeper, its session
        /// and permit released. A repeat of its request restarts it.
        Abandoned => "abandoned",
        /// Asked to stop, and ended so by its holder, with what it had done
        /// so far; a repeat of its request replays it (a person who stopped
        /// a reply does not want it run again by a retry).
        Cancelled => "cancelled",
        /// Waiting in its session's queue (`on_busy: enqueue`): no lease,
        /// no attempt yet. It starts when it is the head of the queue and
        /// the session is free: handed to the previous holder's caller
        /// ([`crate::store::Store::take_next`]), a repeat of its request,
        /// or a recovery worker's claim.
        Queued => "queued",
        /// Replaced, before it started, by a newer message sent with
        /// `on_busy: supersede`; a repeat of its request replays it.
        Superseded => "superseded",
    }
);

wire_enum!(
    /// Where a tool execution is in its life.
    ToolState {
        /// Claimed for execution by the holder of `fence`.
        Running => "running",
        /// Done; its result is returned to every later claim.
        Succeeded => "succeeded",
        /// Failed; the next claim executes it again.
        Failed => "failed",
    }
);

wire_enum!(
    /// What became of the previous attempt of a tool execution.
    PreviousOutcome {
        /// It reported failure.
        Failed => "failed",
        /// Its holder died mid-call: it may or may not have taken effect.
        Unknown => "unknown",
    }
);

wire_enum!(
    /// A person's answer to a pending confirmation.
    Decision {
        /// Go ahead with the pending action.
        Approve => "approve",
        /// Drop it.
        Reject => "reject",
    }
);

wire_enum!(
    /// What a begin does when its session is held by another turn.
    BusyPolicy {
        /// Refuse at once with `session_busy` (the default).
        Reject => "reject",
        /// Wait, up to a bound, for the session to come free, woken by the
        /// store's release notification, then start.
        Wait => "wait",
        /// Ask the running turn to stop (a cancel request), wait for it to
        /// end, up to a bound, then start.
        Interrupt => "interrupt",
        /// Join the session's durable FIFO queue (bounded,
        /// [`crate::limits::MAX_SESSION_QUEUE`]) and answer at once with the
        /// queued turn and its position.
        Enqueue => "enqueue",
        /// Join the queue as [`BusyPolicy::Enqueue`], and end every turn
        /// queued before it, unstarted, `superseded`.
        Supersede => "supersede",
    }
);

/// What a begin on a busy session asks the store to queue.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum QueueMode {
    /// Append the turn to the session's queue.
    Enqueue,
    /// Append it, and supersede every turn queued before it.
    Supersede,
}

impl BusyPolicy {
    /// The queue mode this policy asks the store for (`None`: the policy
    /// never queues).
    pub fn queue_mode(self) -> Option<QueueMode> {
        match self {
            Self::Enqueue => Some(QueueMode::Enqueue),
            Self::Supersede => Some(QueueMode::Supersede),
            Self::Reject | Self::Wait | Self::Interrupt => None,
        }
    }
}

/// A begin's policy for a busy session, with its bound.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct OnBusy {
    /// What to do.
    pub policy: BusyPolicy,
    /// How long `wait` and `interrupt` wait at most; zero for `reject`.
    pub wait: std::time::Duration,
    /// `supersede` only: also ask the running turn to stop once this
    /// request is queued, so the newest message runs next and soon (a
    /// correction typed mid-reply).
    pub interrupt: bool,
}

impl OnBusy {
    /// Refuse a busy session at once.
    pub const REJECT: Self = Self {
        policy: BusyPolicy::Reject,
        wait: std::time::Duration::ZERO,
        interrupt: false,
    };

    /// Validates a policy and its bound: `wait_ms` defaults to
    /// [`crate::limits::DEFAULT_BUSY_WAIT`] for `wait` and `interrupt`.
    ///
    /// # Errors
    /// `invalid_request` for a bound over
    /// [`crate::limits::MAX_BUSY_WAIT`], or any bound with `reject`.
    pub fn new(policy: BusyPolicy, wait_ms: Option<u64>) -> Result<Self> {
        let max = crate::limits::MAX_BUSY_WAIT;
        let wait = match (policy, wait_ms) {
            (BusyPolicy::Reject | BusyPolicy::Enqueue | BusyPolicy::Supersede, None) => {
                std::time::Duration::ZERO
            }
            (BusyPolicy::Reject | BusyPolicy::Enqueue | BusyPolicy::Supersede, Some(_)) => {
                return Err(Error::invalid(format!(
                    "wait_ms applies to the wait and interrupt policies, not {}",
                    policy.as_str()
                )))
            }
            (_, None) => crate::limits::DEFAULT_BUSY_WAIT,
            (_, Some(ms)) if u128::from(ms) > max.as_millis() => {
                return Err(Error::invalid(format!(
                    "wait_ms is {ms}, the limit is {}",
                    max.as_millis()
                )))
            }
            (_, Some(ms)) => std::time::Duration::from_millis(ms),
        };
        Ok(Self {
            policy,
            wait,
            interrupt: false,
        })
    }

    /// This `supersede` policy, also interrupting the running turn.
    ///
    /// # Errors
    /// `invalid_request` for any other policy: `interrupt` stops the
    /// holder by itself, and the others never stop a running turn.
    pub fn interrupting(self) -> Result<Self> {
        if self.policy != BusyPolicy::Supersede {
            return Err(Error::invalid(format!(
                "interrupt_running applies to the supersede policy, not {}",
                self.policy.as_str()
            )));
        }
        Ok(Self {
            interrupt: true,
            ..self
        })
    }
}

impl Default for OnBusy {
    fn default() -> Self {
        Self::REJECT
    }
}
