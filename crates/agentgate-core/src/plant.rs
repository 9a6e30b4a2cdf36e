//! Planted bugs: realistic mistakes the code can be switched to make, so a
//! test can prove that the suite's layers (the seeded simulation, the
//! oracle, the conformance checks) catch them (`agentgate-sim`'s
//! `tests/plants.rs`, issue 31).
//!
//! A bug is planted only in a build with the `plant` feature, which only the
//! simulation crate's tests turn on, and only while a test has called
//! [`set`]; in every other build [`planted`] is a constant `false` and the
//! planted branches compile away. The code that can go wrong asks
//! [`planted`] at the one place where the mistake would be made, and keeps
//! the correct line next to it, so a reader sees both.
//!
//! SQL is mutated as text by [`edit`]: the planted statement is the real
//! one with one fragment replaced. A fragment that no longer occurs (the
//! statement was rewritten since) is recorded ([`stale`]) rather than
//! silently planting nothing, and the plant test fails on it.

use std::borrow::Cow;

/// One planted bug. [`Plant::ALL`] lists them; [`Plant::describe`] says
/// what each gets wrong.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Plant {
    /// `decide::check_row_lease` accepts a lease past its expiry.
    LeaseCheckIgnoresExpiry,
    /// `decide::decide_tool_claim` answers the holder's own repeat claim
    /// (same fence) execute again instead of `tool_in_flight`.
    RepeatClaimRunsAgain,
    /// `decide::gate_start` lets a user start one turn past the cap.
    CapOffByOne,
    /// `decide::decide_existing` replays a repeat whose payload changed
    /// instead of refusing `payload_mismatch`.
    ReplayIgnoresPayload,
    /// `decide::decide_confirmation` confirms a pending turn whose
    /// confirmation TTL ran out.
    ConfirmAfterExpiry,
    /// `decide::decide_tool_claim` lets a cancelled turn claim a tool.
    ClaimIgnoresCancel,
    /// `decide::decide_queued` starts a queued turn that is not the head of
    /// its session's queue.
    QueueJump,
    /// `decide::decide_existing` never runs a turn out of attempts.
    AttemptsNeverRunOut,
    /// SQLite's one-statement begin grants while the user is at the cap.
    SqliteBeginCapOffByOne,
    /// SQLite's one-statement begin grants over a session's live holder.
    SqliteBeginOverHolder,
    /// SQLite records a pending confirmation for ten times its TTL.
    SqliteConfirmationTtlTenfold,
    /// Every SQL store's heartbeat renews a lease that already expired.
    HeartbeatRenewsExpiredLease,
    /// PostgreSQL's one-statement lease condition forgets the expiry.
    PostgresFastLeaseIgnoresExpiry,
    /// MySQL's one-statement lease condition forgets the expiry.
    MysqlFastLeaseIgnoresExpiry,
    /// The library runs a store step in its caller's future, so a caller
    /// that stops waiting cuts the step off halfway.
    StepRunsInCallersFuture,
    /// The library does not signal the turn when a tool claim is refused
    /// `turn_cancelled`.
    CancelledClaimNotSignalled,
}

/// Where a planted bug lives.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Layer {
    /// `agentgate_core::decide`: every store calls it.
    Decide,
    /// One store's SQL (or every SQL store's shared SQL).
    Store,
    /// The `agentgate` library.
    Library,
}

impl Plant {
    /// Every planted bug, in the order of the enum.
    pub const ALL: &'static [Plant] = &[
        Plant::LeaseCheckIgnoresExpiry,
        Plant::RepeatClaimRunsAgain,
        Plant::CapOffByOne,
        Plant::ReplayIgnoresPayload,
        Plant::ConfirmAfterExpiry,
        Plant::ClaimIgnoresCancel,
        Plant::QueueJump,
        Plant::AttemptsNeverRunOut,
        Plant::SqliteBeginCapOffByOne,
        Plant::SqliteBeginOverHolder,
        Plant::SqliteConfirmationTtlTenfold,
        Plant::HeartbeatRenewsExpiredLease,
        Plant::PostgresFastLeaseIgnoresExpiry,
        Plant::MysqlFastLeaseIgnoresExpiry,
        Plant::StepRunsInCallersFuture,
        Plant::CancelledClaimNotSignalled,
    ];

    /// Where the bug lives.
    pub fn layer(self) -> Layer {
        match self {
            Plant::LeaseCheckIgnoresExpiry
            | Plant::RepeatClaimRunsAgain
            | Plant::CapOffByOne
            | Plant::ReplayIgnoresPayload
            | Plant::ConfirmAfterExpiry
            | Plant::ClaimIgnoresCancel
            | Plant::QueueJump
            | Plant::AttemptsNeverRunOut => Layer::Decide,
            Plant::SqliteBeginCapOffByOne
            | Plant::SqliteBeginOverHolder
            | Plant::SqliteConfirmationTtlTenfold
            | Plant::HeartbeatRenewsExpiredLease
            | Plant::PostgresFastLeaseIgnoresExpiry
            | Plant::MysqlFastLeaseIgnoresExpiry => Layer::Store,
            Plant::StepRunsInCallersFuture | Plant::CancelledClaimNotSignalled => Layer::Library,
        }
    }

    /// What the bug gets wrong, in a line.
    pub fn describe(self) -> &'static str {
        match self {
            Plant::LeaseCheckIgnoresExpiry => "decide's lease check ignores expiry",
            Plant::RepeatClaimRunsAgain => {
                "decide: the holder's own repeat claim runs the tool again"
            }
            Plant::CapOffByOne => "decide: the per-user cap off by one",
            Plant::ReplayIgnoresPayload => "decide: a changed payload replays the old answer",
            Plant::ConfirmAfterExpiry => "decide: an expired confirmation still confirms",
            Plant::ClaimIgnoresCancel => "decide: a cancelled turn still claims tools",
            Plant::QueueJump => "decide: a queued turn jumps the head of its queue",
            Plant::AttemptsNeverRunOut => "decide: a turn never runs out of attempts",
            Plant::SqliteBeginCapOffByOne => "SQLite's begin fast path: the cap off by one",
            Plant::SqliteBeginOverHolder => "SQLite's begin fast path grants over a live holder",
            Plant::SqliteConfirmationTtlTenfold => "SQLite: a confirmation stored 10x too long",
            Plant::HeartbeatRenewsExpiredLease => "SQL heartbeat renews an expired lease",
            Plant::PostgresFastLeaseIgnoresExpiry => {
                "PostgreSQL's one-statement lease check ignores expiry"
            }
            Plant::MysqlFastLeaseIgnoresExpiry => {
                "MySQL's one-statement lease check ignores expiry"
            }
            Plant::StepRunsInCallersFuture => {
                "library: a step runs in its caller's future (a hang-up cuts it)"
            }
            Plant::CancelledClaimNotSignalled => {
                "library: a turn_cancelled claim does not signal the turn"
            }
        }
    }
}

#[cfg(feature = "plant")]
mod switch {
    use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

    use super::Plant;

    /// 0: nothing planted; `i + 1`: `Plant::ALL[i]`.
    static PLANTED: AtomicUsize = AtomicUsize::new(0);
    static STALE: AtomicBool = AtomicBool::new(false);

    pub fn planted(plant: Plant) -> bool {
        let at = PLANTED.load(Ordering::Relaxed);
        at != 0 && Plant::ALL[at - 1] == plant
    }

    pub fn set(plant: Option<Plant>) {
        let at = plant.map_or(0, |p| {
            1 + Plant::ALL
                .iter()
                .position(|q| *q == p)
                .unwrap_or_else(|| unreachable!("Plant::ALL lists every plant"))
        });
        STALE.store(false, Ordering::SeqCst);
        PLANTED.store(at, Ordering::SeqCst);
    }

    pub fn mark_stale() {
        STALE.store(true, Ordering::SeqCst);
    }

    pub fn stale() -> bool {
        STALE.load(Ordering::SeqCst)
    }
}

/// Whether `plant` is the bug planted now. Always `false` without the
/// `plant` feature.
#[inline]
pub fn planted(plant: Plant) -> bool {
    #[cfg(feature = "plant")]
    {
        switch::planted(plant)
    }
    #[cfg(not(feature = "plant"))]
    {
        let _ = plant;
        false
    }
}

/// Plants `plant` (or, with `None`, nothing) for the whole process, and
/// clears [`stale`]. A test that calls it must be the only one running in
/// its process: every store and library call sees the switch.
#[cfg(feature = "plant")]
pub fn set(plant: Option<Plant>) {
    switch::set(plant);
}

/// Whether an [`edit`] of the planted bug found nothing to replace since the
/// last [`set`].
#[cfg(feature = "plant")]
pub fn stale() -> bool {
    switch::stale()
}

/// `sql`, or, while `plant` is planted, `sql` with `from` replaced by `to`.
pub fn edit<'a>(plant: Plant, sql: impl Into<Cow<'a, str>>, from: &str, to: &str) -> Cow<'a, str> {
    let sql = sql.into();
    if !planted(plant) {
        return sql;
    }
    if !sql.contains(from) {
        #[cfg(feature = "plant")]
        switch::mark_stale();
        return sql;
    }
    Cow::Owned(sql.replace(from, to))
}
