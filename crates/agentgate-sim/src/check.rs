//! The checker: replays a run's history against a model of the
//! invariants of docs/protocol.md §4 and reports the first entry that breaks one.
//!
//! The model is built from the protocol's events alone (grants, renewals,
//! releases), not from the store's rows, so a store that loses track of a
//! lease is caught: a grant is live from its grant until its expiry (moved
//! by renewals) or its release.
//!
//! Tool claims are held to docs/protocol.md §2.4 the same way, from the
//! store's answers alone ([`Claims`], in both [`check`] and
//! [`check_observed`]), never by asking `decide`: under one lease a call is
//! answered execute once per attempt (a repeat of a running claim is
//! refused `tool_in_flight`), and once it succeeded every claim is
//! answered cached with the stored result.

use std::collections::{BTreeMap, BTreeSet};

use serde_json::Value;

use crate::history::{ClaimAnswer, Entry, Event, FinishAnswer, Observed};

/// An invariant broken at a history entry.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Violation {
    /// Index of the entry that broke it.
    pub index: usize,
    /// Which invariant and how.
    pub message: String,
}

/// What the checker counted while checking.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Counts {
    /// Leases granted.
    pub grants: u64,
    /// Grants that took over a running turn whose lease expired.
    pub takeovers: u64,
    /// Lease-conditioned writes applied (all checked against the fence).
    pub writes: u64,
    /// Effects the ledger booked.
    pub effects: u64,
    /// Effects that arrived again and were deduplicated by their key.
    pub deduplicated: u64,
    /// Replays checked against the first stored success.
    pub replays: u64,
    /// Turns that succeeded.
    pub successes: u64,
    /// Claims of a call running under the caller's own lease (a holder's
    /// repeat), refused `tool_in_flight` as they must be.
    pub repeats_in_flight: u64,
    /// Claims of a succeeded call answered cached with its stored result.
    pub claims_cached: u64,
    /// Cancel requests recorded on running turns.
    pub cancels: u64,
}

#[derive(Clone, Debug)]
struct Lease {
    session: String,
    user: String,
    expires_at_ms: i64,
    released: bool,
}

impl Lease {
    fn live(&self, now: i64) -> bool {
        !self.released && self.expires_at_ms > now
    }
}

#[derive(Debug, Default)]
struct Model {
    /// Every grant by fence.
    leases: BTreeMap<i64, Lease>,
    /// Newest fence per session.
    newest: BTreeMap<String, i64>,
    /// Newest fence in the store.
    top: i64,
    caps: BTreeMap<String, u32>,
    /// Keys marked succeeded, with their stored result.
    done: BTreeMap<String, String>,
    /// Turns whose cancel was recorded.
    cancelled: std::collections::BTreeSet<String>,
    /// The ledger's booking per key.
    booked: BTreeMap<String, u64>,
    /// The turn each (session, client request) created.
    requests: BTreeMap<(String, String), String>,
    /// First stored success per turn.
    succeeded: BTreeMap<String, Value>,
    counts: Counts,
}

fn parse(text: &str) -> Value {
    serde_json::from_str(text).unwrap_or(Value::Null)
}

impl Model {
    fn live_in_session(&self, session: &str, now: i64) -> Vec<i64> {
        self.leases
            .iter()
            .filter(|(_, l)| l.session == session && l.live(now))
            .map(|(f, _)| *f)
            .collect()
    }

    fn live_of_user(&self, user: &str, now: i64) -> usize {
        self.leases
            .values()
            .filter(|l| l.user == user && l.live(now))
            .count()
    }

    /// The live, newest grant `fence` must be for a write on `session`.
    fn fenced_write(&self, what: &str, session: &str, fence: i64, now: i64) -> Result<(), String> {
        let newest = self.newest.get(session).copied().unwrap_or(0);
        if fence != newest {
            return Err(format!(
                "stale write landed: {what} on {session} under fence {fence}, the session's newest grant is fence {newest}"
            ));
        }
        match self.leases.get(&fence) {
            Some(lease) if lease.live(now) => Ok(()),
            Some(lease) => Err(format!(
                "write without a live lease landed: {what} on {session} under fence {fence} \
                 (expired at {}, released: {}, now {now})",
                lease.expires_at_ms, lease.released
            )),
            None => Err(format!(
                "write under fence {fence}, which was never granted"
            )),
        }
    }

    fn apply(&mut self, at: i64, event: &Event) -> Result<(), String> {
        match event {
            Event::Grant {
                session,
                user,
                turn,
                request,
                fence,
                expires_at_ms,
                cap,
                takeover,
            } => {
                self.counts.grants += 1;
                let key = (session.clone(), request.clone());
                if let Some(first) = self.requests.get(&key).filter(|t| *t != turn) {
                    return Err(format!(
                        "request {request} of {session} created a second turn {turn} (first {first})"
                    ));
                }
                self.requests.insert(key, turn.clone());
                self.counts.takeovers += u64::from(*takeover);
                if *fence <= self.top {
                    return Err(format!(
                        "fence {fence} granted after fence {} (store-wide counter went back)",
                        self.top
                    ));
                }
                self.top = *fence;
                let newest = self.newest.get(session).copied().unwrap_or(0);
                if *fence <= newest {
                    return Err(format!(
                        "fence {fence} on {session} does not exceed its previous fence {newest}"
                    ));
                }
                let live = self.live_in_session(session, at);
                if !live.is_empty() {
                    return Err(format!(
                        "two live holders of {session}: fence {fence} granted while fence {live:?} is live"
                    ));
                }
                self.caps.insert(user.clone(), *cap);
                self.newest.insert(session.clone(), *fence);
                self.leases.insert(
                    *fence,
                    Lease {
                        session: session.clone(),
                        user: user.clone(),
                        expires_at_ms: *expires_at_ms,
                        released: false,
                    },
                );
                let held = self.live_of_user(user, at);
                if held > *cap as usize {
                    return Err(format!("{user} holds {held} live leases, the cap is {cap}"));
                }
            }
            Event::Renew {
                fence,
                expires_at_ms,
            } => {
                let lease = self
                    .leases
                    .get_mut(fence)
                    .ok_or_else(|| format!("renewal of fence {fence}, never granted"))?;
                if !lease.live(at) {
                    return Err(format!("renewal of fence {fence} whose lease is not live"));
                }
                lease.expires_at_ms = *expires_at_ms;
            }
            Event::Write {
                what,
                session,
                fence,
            } => {
                self.counts.writes += 1;
                self.fenced_write(what, session, *fence, at)?;
            }
            Event::Release { fence } => {
                if let Some(lease) = self.leases.get_mut(fence) {
                    lease.released = true;
                }
            }
            Event::Abandon { fence } => {
                if self.leases.get(fence).is_some_and(|l| l.live(at)) {
                    return Err(format!(
                        "abandoned the turn of fence {fence} while its lease is live"
                    ));
                }
            }
            Event::ToolExecute {
                key, turn, fence, ..
            } => {
                if self.done.contains_key(key) {
                    return Err(format!(
                        "tool {key} claimed for running (fence {fence}) after it succeeded"
                    ));
                }
                if self.cancelled.contains(turn) {
                    return Err(format!(
                        "tool {key} of turn {turn} claimed for running (fence {fence}) after \
                         the turn's cancel was recorded"
                    ));
                }
            }
            Event::CancelRecorded { turn } => {
                self.counts.cancels += 1;
                self.cancelled.insert(turn.clone());
            }
            Event::ToolDone { key, fence, result } => {
                if self.done.contains_key(key) {
                    return Err(format!(
                        "tool {key} marked succeeded twice (again under fence {fence})"
                    ));
                }
                let booking = parse(result)["booking"].as_u64();
                let booked = self.booked.get(key).copied();
                if booking.is_none() || booking != booked {
                    return Err(format!(
                        "tool {key} stored result {result}, but the ledger's effect for it is {booked:?}"
                    ));
                }
                self.done.insert(key.clone(), result.clone());
            }
            Event::Effect {
                key,
                booking,
                first,
                ..
            } => match self.booked.get(key) {
                None if *first => {
                    self.counts.effects += 1;
                    self.booked.insert(key.clone(), *booking);
                }
                Some(b) if !*first && b == booking => self.counts.deduplicated += 1,
                other => {
                    return Err(format!(
                        "ledger booked {key} again: booking {booking} after {other:?}"
                    ))
                }
            },
            Event::Ended {
                turn,
                state,
                response,
            } => {
                if *state == "succeeded" {
                    self.counts.successes += 1;
                    if self.succeeded.contains_key(turn) {
                        return Err(format!("turn {turn} succeeded twice"));
                    }
                    let response = response.as_deref().map_or(Value::Null, parse);
                    self.succeeded.insert(turn.clone(), response);
                }
            }
            Event::Replay {
                turn,
                state,
                response,
                ..
            } => {
                if *state == "succeeded" {
                    self.counts.replays += 1;
                    let got = response.as_deref().map_or(Value::Null, parse);
                    match self.succeeded.get(turn) {
                        Some(first) if *first == got => {}
                        Some(first) => {
                            return Err(format!(
                                "replay of {turn} returned {got}, its first success stored {first}"
                            ))
                        }
                        None => {
                            return Err(format!(
                                "replay of {turn} as succeeded, but no success was stored"
                            ))
                        }
                    }
                }
            }
            Event::Facts { holders, live } => {
                for (session, fence, _) in holders {
                    if !self.leases.get(fence).is_some_and(|l| l.live(at)) {
                        return Err(format!("the store shows fence {fence} holding {session}, the protocol says it is not live"));
                    }
                }
                let sessions: BTreeSet<&String> = holders.iter().map(|(s, _, _)| s).collect();
                if sessions.len() != holders.len() {
                    return Err("the store shows two holders of one session".to_owned());
                }
                let model_live = self.leases.values().filter(|l| l.live(at)).count();
                if model_live != holders.len() {
                    return Err(format!(
                        "the store shows {} live holders, the protocol says {model_live}",
                        holders.len()
                    ));
                }
                for (user, count) in live {
                    let cap = self.caps.get(user).copied().unwrap_or(u32::MAX);
                    if *count > cap {
                        return Err(format!(
                            "the store shows {user} with {count} live permits, the cap is {cap}"
                        ));
                    }
                }
            }
            Event::Quiesced { running } => {
                if !running.is_empty() {
                    return Err(format!(
                        "turns still running after every client stopped and the orphan grace passed: {running:?}"
                    ));
                }
            }
            // Tool claims and their ends: `Claims`.
            Event::ToolClaimed { .. }
            | Event::ToolFinished { .. }
            | Event::Observed { .. }
            | Event::Call { .. }
            | Event::Fault { .. }
            | Event::Return { .. }
            | Event::Client { .. } => {}
        }
        Ok(())
    }
}

/// The refusals a holder's repeat claim of an execution still running under
/// its own lease may get: `tool_in_flight` (§2.4), or a refusal of the lease
/// (§3.0) or of a turn asked to stop (§3.3). Never execute, never cached.
const IN_FLIGHT_REFUSALS: [&str; 3] = ["tool_in_flight", "lease_lost", "turn_cancelled"];

/// The refusals a claim of a succeeded call may get instead of cached.
const LEASE_REFUSALS: [&str; 2] = ["lease_lost", "turn_cancelled"];

/// What the store said about one tool call (one idempotency key).
#[derive(Clone, Debug)]
enum ToolFact {
    /// A claim under `fence` was answered execute.
    Execute { fence: i64, attempt: u32 },
    /// A completion stored `result`.
    Succeeded { result: Value },
    /// A failure under `fence` was applied.
    Failed { fence: i64 },
    /// A completion or failure whose outcome the store did not say.
    Unsure,
}

/// A call's state as the facts recorded before some entry left it.
#[derive(Debug, Default)]
struct ToolState {
    /// The attempt answered execute and neither completed nor failed since:
    /// its fence and attempt.
    running: Option<(i64, u32)>,
    /// The stored result, once a completion succeeded.
    done: Option<Value>,
    /// An outcome the store did not say: judge no claim of it any more.
    unsure: bool,
}

/// The tool-claim checks, from the store's answers as the store wrapper
/// recorded them (`Event::ToolClaimed`, `Event::ToolFinished`), independent
/// of `decide`.
///
/// A claim is judged against the facts recorded before it was sent (its
/// `Event::Call`): those certainly were applied before it, on a simulated
/// store and on a real one alike.
#[derive(Debug, Default)]
struct Claims {
    /// The entry each call was sent at.
    sent: BTreeMap<u64, usize>,
    /// Each key's facts, with the entry that recorded them.
    facts: BTreeMap<String, Vec<(usize, ToolFact)>>,
    /// Cached answers given before any success of their key was recorded:
    /// (entry, key, result), each to match the success when it comes.
    early: Vec<(usize, String, Value)>,
    repeats_in_flight: u64,
    cached: u64,
}

impl Claims {
    /// Checks the entry at `index`; `Err((entry, message))` for a violation
    /// (an early cached answer is reported at its own entry).
    fn apply(&mut self, index: usize, event: &Event) -> Result<(), (usize, String)> {
        match event {
            Event::Call { call, .. } => {
                self.sent.insert(*call, index);
            }
            Event::ToolClaimed {
                call,
                key,
                fence,
                answer,
            } => {
                let sent = self.sent.get(call).copied().unwrap_or(index);
                let was = self.state_before(key, sent);
                self.judge(key, *fence, answer, &was)
                    .map_err(|message| (index, message))?;
                match answer {
                    ClaimAnswer::Execute { attempt } => self.fact(
                        index,
                        key,
                        ToolFact::Execute {
                            fence: *fence,
                            attempt: *attempt,
                        },
                    ),
                    // A cached answer with no success recorded before it
                    // was sent: a success recorded since (a concurrent
                    // completion) must match it; else the next one.
                    ClaimAnswer::Cached { result } if was.done.is_none() => {
                        let result = parse(result);
                        let now = self.state_before(key, index);
                        match now.done {
                            _ if now.unsure => {}
                            Some(stored) if stored != result => {
                                return Err((
                                    index,
                                    format!(
                                        "tool {key} answered cached {result} under fence {fence}, \
                                         its stored result is {stored}"
                                    ),
                                ))
                            }
                            Some(_) => {}
                            None => self.early.push((index, key.clone(), result)),
                        }
                    }
                    ClaimAnswer::Cached { .. } | ClaimAnswer::Refused { .. } => {}
                }
            }
            Event::ToolFinished {
                key,
                fence,
                outcome,
                ..
            } => match outcome {
                FinishAnswer::Succeeded { result } => {
                    let result = parse(result);
                    if let Some((at, _, early)) = self
                        .early
                        .iter()
                        .find(|(_, k, early)| k == key && *early != result)
                    {
                        return Err((
                            *at,
                            format!(
                                "tool {key} was answered cached {early} before its completion \
                                 stored {result}"
                            ),
                        ));
                    }
                    self.early.retain(|(_, k, _)| k != key);
                    self.fact(index, key, ToolFact::Succeeded { result });
                }
                FinishAnswer::Failed => self.fact(index, key, ToolFact::Failed { fence: *fence }),
                // Refused for the lease or the execution's state: nothing
                // changed. Anything else may have been applied or not.
                FinishAnswer::Refused { code } => {
                    if ![
                        "lease_lost",
                        "not_found",
                        "invalid_request",
                        "effect_failed",
                    ]
                    .contains(code)
                    {
                        // Its result, if it stored one, is unknown.
                        self.early.retain(|(_, k, _)| k != key);
                        self.fact(index, key, ToolFact::Unsure);
                    }
                }
            },
            _ => {}
        }
        Ok(())
    }

    /// What the end of the history leaves to report: a cached answer no
    /// completion ever explained.
    fn finish(&self) -> Result<(), (usize, String)> {
        match self.early.first() {
            Some((at, key, result)) => Err((
                *at,
                format!(
                    "tool {key} was answered cached {result}, but no completion of it succeeded"
                ),
            )),
            None => Ok(()),
        }
    }

    fn fact(&mut self, index: usize, key: &str, fact: ToolFact) {
        self.facts
            .entry(key.to_owned())
            .or_default()
            .push((index, fact));
    }

    fn state_before(&self, key: &str, before: usize) -> ToolState {
        let mut state = ToolState::default();
        for (_, fact) in self
            .facts
            .get(key)
            .into_iter()
            .flatten()
            .filter(|(at, _)| *at < before)
        {
            match fact {
                ToolFact::Execute { fence, attempt } => state.running = Some((*fence, *attempt)),
                ToolFact::Succeeded { result } => {
                    state.running = None;
                    state.done = Some(result.clone());
                }
                ToolFact::Failed { fence } => {
                    if state.running.is_some_and(|(f, _)| f == *fence) {
                        state.running = None;
                    }
                }
                ToolFact::Unsure => state.unsure = true,
            }
        }
        state
    }

    /// A claim of `key` under `fence`, answered `answer`, against the
    /// call's state `was` when the claim was sent.
    fn judge(
        &mut self,
        key: &str,
        fence: i64,
        answer: &ClaimAnswer,
        was: &ToolState,
    ) -> Result<(), String> {
        // `store_unavailable` decided nothing; an unsure outcome leaves
        // nothing to judge by.
        if was.unsure
            || matches!(
                answer,
                ClaimAnswer::Refused {
                    code: "store_unavailable"
                }
            )
        {
            return Ok(());
        }
        if let Some(stored) = &was.done {
            return match answer {
                ClaimAnswer::Execute { attempt } => Err(format!(
                    "tool {key} answered execute (attempt {attempt}) under fence {fence} after it \
                     succeeded with {stored}: every claim of a succeeded call is answered cached"
                )),
                ClaimAnswer::Cached { result } if parse(result) == *stored => {
                    self.cached += 1;
                    Ok(())
                }
                ClaimAnswer::Cached { result } => Err(format!(
                    "tool {key} answered cached {result} under fence {fence}, its stored result is {stored}"
                )),
                ClaimAnswer::Refused { code } if LEASE_REFUSALS.contains(code) => Ok(()),
                ClaimAnswer::Refused { code } => Err(format!(
                    "a claim of succeeded tool {key} under fence {fence} was refused {code}, \
                     not answered cached {stored}"
                )),
            };
        }
        let Some((running, first)) = was.running else {
            return Ok(());
        };
        if running == fence {
            return match answer {
                ClaimAnswer::Execute { attempt } => Err(format!(
                    "tool {key} answered execute twice under one lease (fence {fence}): attempt \
                     {first} was still running (neither completed nor failed) when the holder's \
                     repeat claim got attempt {attempt}; a repeat of a running claim must be \
                     refused tool_in_flight"
                )),
                ClaimAnswer::Cached { result } => Err(format!(
                    "tool {key} answered cached {result} to a repeat claim under fence {fence} \
                     while attempt {first} was still running, never completed"
                )),
                ClaimAnswer::Refused { code } if IN_FLIGHT_REFUSALS.contains(code) => {
                    if *code == "tool_in_flight" {
                        self.repeats_in_flight += 1;
                    }
                    Ok(())
                }
                ClaimAnswer::Refused { code } => Err(format!(
                    "a repeat claim of tool {key} under fence {fence}, attempt {first} still \
                     running, was refused {code}, not tool_in_flight"
                )),
            };
        }
        match answer {
            ClaimAnswer::Execute { attempt } if fence < running => Err(format!(
                "tool {key} answered execute (attempt {attempt}) under fence {fence} while \
                 attempt {first} runs under the newer fence {running}"
            )),
            _ => Ok(()),
        }
    }
}

/// Checks `history`; the counts on success, the first violation otherwise.
///
/// # Errors
/// The first entry that breaks an invariant.
pub fn check(history: &[Entry]) -> Result<Counts, Violation> {
    let mut model = Model::default();
    let mut claims = Claims::default();
    let broke = |(index, message)| Violation { index, message };
    for (index, entry) in history.iter().enumerate() {
        model
            .apply(entry.at_ms, &entry.event)
            .map_err(|message| Violation { index, message })?;
        claims.apply(index, &entry.event).map_err(broke)?;
    }
    claims.finish().map_err(broke)?;
    model.counts.repeats_in_flight = claims.repeats_in_flight;
    model.counts.claims_cached = claims.cached;
    Ok(model.counts)
}

/// What [`check_observed`] counted.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ObservedCounts {
    /// Grants clients received.
    pub grants: u64,
    /// Successful lease-conditioned writes clients received.
    pub writes: u64,
    /// Tool completions clients received.
    pub completions: u64,
    /// Succeeded turns clients received more than once, all equal.
    pub repeats: u64,
    /// Claims of a call running under the caller's own lease, refused
    /// `tool_in_flight`.
    pub repeats_in_flight: u64,
    /// Claims of a succeeded call answered cached with its stored result.
    pub claims_cached: u64,
}

/// Checks what the clients observed, with no help from the store: the part
/// of docs/protocol.md §4 that a real store on a real clock can be held to from outside.
///
/// - Fences are never reused, and a grant's fence exceeds every fence of
///   its session that a client had received before the begin was sent.
/// - No stale write lands: a write sent after a client received a newer
///   grant of the session does not succeed.
/// - A tool key is completed at most once, with the ledger's booking.
/// - Every answer of a succeeded turn clients received is the same.
/// - Tool claims keep docs/protocol.md §2.4 ([`Claims`]): under one lease a
///   call is answered execute at most once until that attempt fails (a
///   repeat of a running claim is refused `tool_in_flight`), a claim after a
///   success is answered cached with the stored result, and nothing is
///   answered cached that no completion stored.
///
/// # Errors
/// The first entry that breaks one.
pub fn check_observed(history: &[Entry]) -> Result<ObservedCounts, Violation> {
    let mut sent: BTreeMap<u64, usize> = BTreeMap::new();
    let mut granted: BTreeMap<String, Vec<(usize, i64)>> = BTreeMap::new();
    let mut fences: BTreeSet<i64> = BTreeSet::new();
    let mut completed: BTreeMap<String, String> = BTreeMap::new();
    let mut booked: BTreeMap<String, u64> = BTreeMap::new();
    let mut answers: BTreeMap<String, Value> = BTreeMap::new();
    let mut counts = ObservedCounts::default();
    let mut claims = Claims::default();
    let newest_before =
        |granted: &BTreeMap<String, Vec<(usize, i64)>>, session: &str, index: usize| {
            granted
                .get(session)
                .into_iter()
                .flatten()
                .filter(|(at, _)| *at < index)
                .map(|(_, fence)| *fence)
                .max()
                .unwrap_or(0)
        };
    for (index, entry) in history.iter().enumerate() {
        let fail = |message: String| Err(Violation { index, message });
        claims
            .apply(index, &entry.event)
            .map_err(|(index, message)| Violation { index, message })?;
        match &entry.event {
            Event::Call { call, .. } => {
                sent.insert(*call, index);
            }
            Event::Effect {
                key,
                booking,
                first: true,
                ..
            } => {
                booked.insert(key.clone(), *booking);
            }
            Event::Observed { call, what } => {
                let began = sent.get(call).copied().unwrap_or(0);
                match what {
                    Observed::Granted { session, fence } => {
                        counts.grants += 1;
                        if !fences.insert(*fence) {
                            return fail(format!("fence {fence} granted twice"));
                        }
                        let newest = newest_before(&granted, session, began);
                        if *fence <= newest {
                            return fail(format!(
                                "fence {fence} granted on {session} after a client had fence {newest} of it"
                            ));
                        }
                        granted
                            .entry(session.clone())
                            .or_default()
                            .push((index, *fence));
                    }
                    Observed::Wrote {
                        what,
                        session,
                        fence,
                    } => {
                        counts.writes += 1;
                        let newest = newest_before(&granted, session, began);
                        if *fence < newest {
                            return fail(format!(
                                "stale write landed: {what} on {session} under fence {fence}, \
                                 sent after a client received fence {newest}"
                            ));
                        }
                    }
                    Observed::Completed {
                        session,
                        key,
                        fence,
                        result,
                    } => {
                        counts.completions += 1;
                        let newest = newest_before(&granted, session, began);
                        if *fence < newest {
                            return fail(format!(
                                "stale write landed: complete_tool on {session} under fence {fence}, \
                                 sent after a client received fence {newest}"
                            ));
                        }
                        if let Some(first) = completed.get(key) {
                            return fail(format!(
                                "tool {key} completed twice (fence {fence}: {result}; before: {first})"
                            ));
                        }
                        let booking = parse(result)["booking"].as_u64();
                        if booking.is_none() || booking != booked.get(key).copied() {
                            return fail(format!(
                                "tool {key} stored {result}, the ledger booked {:?}",
                                booked.get(key)
                            ));
                        }
                        completed.insert(key.clone(), result.clone());
                    }
                }
            }
            Event::Replay {
                turn,
                state: "succeeded",
                response,
                observed: true,
            } => {
                let got = response.as_deref().map_or(Value::Null, parse);
                match answers.get(turn) {
                    Some(first) if *first != got => {
                        return fail(format!("{turn} answered {got}, earlier {first}"))
                    }
                    Some(_) => counts.repeats += 1,
                    None => {
                        answers.insert(turn.clone(), got);
                    }
                }
            }
            _ => {}
        }
    }
    claims
        .finish()
        .map_err(|(index, message)| Violation { index, message })?;
    counts.repeats_in_flight = claims.repeats_in_flight;
    counts.claims_cached = claims.cached;
    Ok(counts)
}
