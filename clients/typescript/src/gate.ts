/**
 * `Gate` and `Turn`: the protocol of docs/http.md written once, so callers
 * do not hand-roll the subtle parts (the heartbeat, the bounded
 * `Retry-After` wait, the queue, the `unknown` tool outcome, cancel
 * requests, lease loss).
 *
 *   begin (re-sent while queued) ─▶ heartbeat every third of the TTL (a
 *   `cancel_requested` answer aborts `turn.signal`) ─▶ per tool call:
 *   claim, run only when told to execute (reconcile an `unknown` first),
 *   complete or fail ─▶ complete the turn (end it `cancelled` with
 *   `turn.partial` when it was asked to stop, fail it, retryable, on any
 *   other throw).
 *
 * Every wait here is bounded: by the caller's `waitMs`, and by an attempt
 * count as a second fence.
 *
 * Endings may take the session's next queued message (`take_next`, the
 * handoff): `gate.drain` runs a body over a session's queue in order, and
 * `gate.recover` claims an orphan (or a queue nobody took) and drains its
 * session (the loop of `RecoveryWorker`, recovery.ts). A turn's events
 * (`turn.emit`, `gate.follow`) are in events.ts.
 */

import {
  AgentgateError,
  LeaseLost,
  QueueTimeout,
  ToolInFlight,
  TransportError,
  TurnCancelled,
  TurnNotSucceeded,
} from "./errors.js";
import { Emitter, Follower, appendLanded, checkedEvent, type FollowOptions, type Pending } from "./events.js";
import { Http, describe, isCode, type HttpOptions } from "./http.js";
import type { components } from "./openapi.js";

type Schemas = components["schemas"];
export type GrantDto = Schemas["GrantDto"];
export type TurnDto = Schemas["TurnDto"];
export type JournalEntry = Schemas["JournalEntryDto"];
export type PreviousOutcome = Schemas["PreviousOutcomeDto"];
export type Decision = Schemas["DecisionDto"];
export type ConfirmationDto = Schemas["ConfirmationDto"];
export type SessionDto = Schemas["SessionDto"];
export type TurnState = Schemas["TurnStateDto"];

/** Begin refusals worth waiting out: each ends by itself when a lease ends or a dependency returns. */
const WAITABLE_BEGIN_CODES: ReadonlySet<string> = new Set([
  "session_busy",
  "request_in_flight",
  "user_at_capacity",
  "store_unavailable",
  "overloaded",
]);
const WAITABLE_TOOL_CODES: ReadonlySet<string> = new Set(["tool_in_flight", "store_unavailable", "overloaded"]);

/**
 * Polling backoff while waiting. `Retry-After` says how long the blocking
 * lease has left if nobody renews it: the longest wait that can be useful.
 * A holder that ends early frees the session sooner, so the client asks
 * again after this backoff (25 ms doubling to 500 ms) when that is shorter.
 */
export const POLL_FIRST_MS = 25;
export const POLL_MAX_MS = 500;
/**
 * A begin refused `request_in_flight` (this very message runs elsewhere,
 * e.g. a double-click) follows that turn's events for its `end` and asks
 * again at once, so the duplicate gets the replay as soon as it exists.
 * It follows after this event id, a turn's most events (the server's
 * `MAX_TURN_EVENTS`): no event is sent, only the `end`.
 */
export const IN_FLIGHT_FOLLOW_AFTER = 20_000;
/**
 * It follows until the running turn's lease would run out (`Retry-After`)
 * plus this, then asks again: a lease that ran out means a dead holder (the
 * begin takes the turn over), a renewed one another wait.
 */
export const IN_FLIGHT_LEASE_SLACK_MS = 250;
/** A second fence on every wait loop, besides its deadline. */
export const MAX_WAIT_ATTEMPTS = 10_000;
/** How many lost answers one tool claim sends again after, before it gives up. */
export const MAX_LOST_CLAIM_ANSWERS = 4;
/** What a claim whose answer was lost is failed with: it never ran. */
const LOST_CLAIM_ERROR = {
  lost_claim: "the claim's answer was lost in transit; the tool did not run, so it is claimed again",
};
/** How long `turn.tool` waits out `tool_in_flight` by default: the same call running elsewhere under this lease. */
export const DEFAULT_TOOL_WAIT_MS = 30_000;
/** Heartbeats never come closer than this, whatever the TTL (the server's minimum TTL is 100 ms). */
const MIN_HEARTBEAT_INTERVAL_MS = 20;
/**
 * Turns one drain runs at most: a whole session queue (the server's
 * `MAX_SESSION_QUEUE`, 100) and the turn in hand. A queue that keeps
 * refilling is left, queued, for a later drain or a recovery worker.
 */
export const DRAIN_MAX_TURNS = 101;
/** Sends of one event append whose answer is lost (each lost one is checked against the log before the next). */
const MAX_APPEND_ATTEMPTS = 4;
/** First and longest pause between two sends of an append whose answer was lost. */
const APPEND_PAUSE_FIRST_MS = 100;
const APPEND_PAUSE_MAX_MS = 1000;
/** Answers after which an append's outcome is unknown. */
const APPEND_IN_DOUBT_CODES: ReadonlySet<string> = new Set(["transport", "store_unavailable", "overloaded", "request_timeout"]);

export interface GateOptions extends HttpOptions {}

export interface TurnRequest<P> {
  userId: string;
  sessionId: string;
  /** The user's message id: a repeat with the same id replays, never runs twice. */
  clientRequestId: string;
  /** The message; any JSON value. */
  payload: P;
  /**
   * How long to wait out `session_busy`, `request_in_flight`,
   * `user_at_capacity` and 503s, and how long a queued message is sent
   * again until it starts. Default: no wait for a refusal, and
   * {@link DEFAULT_QUEUE_WAIT_MS} once queued. A queued message whose wait
   * runs out is withdrawn (`QueueTimeout`).
   */
  waitMs?: number;
  /** Answer a pending confirmation of an earlier turn. */
  confirmation?: { turnId: string; decision: Decision };
  /**
   * What the server does when the session is held by another turn
   * (absent: the session's default, {@link Gate.setPolicy}, else
   * `"reject"`): `"reject"` (`SessionBusy` at once), `"wait"` (waits there
   * up to `busyWaitMs` for it to come free), `"interrupt"` (first asks the
   * running turn to stop), `"enqueue"` (joins the session's queue: the
   * client sends the same request again until it starts, calling
   * `onQueued`), `"supersede"` (as `"enqueue"`, and the messages queued
   * before it end `superseded`).
   */
  onBusy?: BusyPolicy;
  /** The server-side bound of `"wait"` and `"interrupt"` (default 12000, at most {@link MAX_BUSY_WAIT_MS}). */
  busyWaitMs?: number;
  /** With `"supersede"` only: also ask the running turn to stop, so this message runs next and soon. */
  interruptRunning?: boolean;
  /** Called when the message is queued, and again each time its position changes (1: next). */
  onQueued?: (position: number, turnId: string) => void;
}

/** A begin's policy for a busy session (`BusyPolicyDto`). */
export type BusyPolicy = Schemas["BusyPolicyDto"];
const BUSY_POLICIES: readonly BusyPolicy[] = ["reject", "wait", "interrupt", "enqueue", "supersede"];

/** The server's bound on a waiting begin (`MAX_BUSY_WAIT`). */
export const MAX_BUSY_WAIT_MS = 20_000;
/**
 * How long a queued message is sent again, by default, until it starts: a
 * queue drains one turn at a time, and a turn takes 2-60 s.
 */
export const DEFAULT_QUEUE_WAIT_MS = 300_000;

/** A session's default policy, for {@link Gate.setPolicy}. */
export interface SessionPolicy {
  onBusy: BusyPolicy;
  busyWaitMs?: number;
  interruptRunning?: boolean;
}

/** A begin's (or a session policy's) policy fields, checked as the server checks them. */
type BusyFields =
  | Record<never, never>
  | { on_busy: BusyPolicy }
  | { on_busy: "wait" | "interrupt"; wait_ms: number }
  | { on_busy: "supersede"; interrupt_running: true };

function busyFields(request: { onBusy?: BusyPolicy; busyWaitMs?: number; interruptRunning?: boolean }): BusyFields {
  const { onBusy, busyWaitMs: ms, interruptRunning } = request;
  if (onBusy === undefined) {
    if (ms !== undefined || interruptRunning === true) throw new RangeError("busyWaitMs and interruptRunning need an onBusy policy");
    return {};
  }
  if (!BUSY_POLICIES.includes(onBusy)) throw new RangeError(`unknown onBusy ${JSON.stringify(onBusy)}`);
  if (interruptRunning === true) {
    if (onBusy !== "supersede") throw new RangeError("interruptRunning goes only with onBusy 'supersede'");
    return { on_busy: onBusy, interrupt_running: true };
  }
  if (ms === undefined) return { on_busy: onBusy };
  if ((onBusy !== "wait" && onBusy !== "interrupt") || !Number.isInteger(ms) || ms < 0 || ms > MAX_BUSY_WAIT_MS) {
    throw new RangeError(`busyWaitMs must be an integer 0..${MAX_BUSY_WAIT_MS} with 'wait' or 'interrupt'`);
  }
  return { on_busy: onBusy, wait_ms: ms };
}

/**
 * How one message ended, from {@link Gate.run}.
 *
 * A replayed `value` (and `partial`) is what the server stored: canonical
 * JSON (RFC 8785), so `11.0` is `11`, object keys come sorted, and
 * `undefined` members are gone. So is the `value` of a turn run now: the
 * client returns the server's copy of the response.
 */
export interface TurnOutcome<R> {
  turnId: string;
  /** `succeeded`, `cancelled`, `superseded`, `failed`, `awaiting_confirmation`, … */
  state: TurnState;
  /** `true` when the body did not run in this call: the server answered with the request's stored outcome. */
  replayed: boolean;
  /** The response when `succeeded` (the body's return value, as stored); else `undefined`. */
  value: R | undefined;
  /** For `cancelled`: what the turn had produced when it stopped (`turn.partial`). */
  partial: unknown;
  /** On a replay: the whole stored turn (`error`, `retryable`, …). */
  turn: TurnDto | undefined;
}

function owned(path: string, userId: string | undefined): string {
  return userId === undefined ? path : `${path}?user_id=${encodeURIComponent(userId)}`;
}

export interface OrphanFilter {
  /** Only orphans dead at least this long, so a client's own retry comes first. */
  minOrphanedMs?: number;
  userIds?: string[];
  turnIds?: string[];
}

export interface ToolContext<A> {
  /** Stable across attempts and takeovers: forward it downstream so the effect is deduplicated there. */
  idempotencyKey: string;
  executionId: string;
  /** 1 for the first claim, +1 per re-execution. */
  attempt: number;
  /** `null` on a first claim; `"failed"` after a reported failure; `"unknown"` when a holder died mid-call. */
  previousOutcome: PreviousOutcome | null;
  args: A;
  /**
   * Fires (with a {@link LeaseLost} reason) when the turn's lease is lost.
   * Not when the turn is asked to stop: a tool call under way finishes and
   * records its result; `turn.signal` stops the body.
   */
  signal: AbortSignal;
}

export interface ToolOptions<A, R> {
  /** Takes the effect. Called only when the server says to execute. */
  run: (ctx: ToolContext<A>) => Promise<R> | R;
  /**
   * Called before `run` when the previous attempt's outcome is unknown (its
   * holder died mid-call): look the effect up downstream by
   * `ctx.idempotencyKey`. A defined result is stored as the call's result
   * and `run` is not called; `undefined` means "it did not happen": run.
   * Without a hook, `run` is called and must itself be idempotent by key.
   */
  reconcile?: (ctx: ToolContext<A>) => Promise<R | undefined> | R | undefined;
  /** How long to wait out `tool_in_flight` (default {@link DEFAULT_TOOL_WAIT_MS}). */
  waitMs?: number;
}

export interface OrphanResult<R> {
  turnId: string;
  response: R;
}

/** How a drain ({@link Gate.drain}, {@link Gate.recover}) runs. */
export interface DrainOptions<R> {
  /** At most this many turns, the first included (default {@link DRAIN_MAX_TURNS}). */
  maxTurns?: number;
  /** Once aborted, the turn in hand finishes and no next one is taken: the rest stays queued. */
  signal?: AbortSignal;
  /** With a session id: checks the session's owner. */
  userId?: string;
  /** Each turn's outcome is pushed here as it ends, so a caller keeps them when `body` throws. */
  outcomes?: TurnOutcome<R>[];
  /** Called with each turn before `body` runs on it. */
  onTurn?: (turn: Turn<unknown>) => void;
}

export class Gate {
  readonly #http: Http;

  constructor(options: GateOptions) {
    this.#http = new Http(options);
  }

  /**
   * Runs one turn: begins it (waiting up to `waitMs` while it is blocked or
   * queued), heartbeats while `body` runs, and completes it with `body`'s
   * return value. A replay (the request already ended) returns the stored
   * response without calling `body`. {@link run} also says which happened.
   *
   * Rejects with: the begin's typed error once the wait is over
   * (`SessionBusy`, `RequestInFlight`, `UserAtCapacity`, `PayloadMismatch`,
   * `QueueFull`, `QueueTimeout`, …); `TurnNotSucceeded` for a replay of a
   * turn that did not succeed (cancelled, superseded, failed, …);
   * `TurnCancelled` when the turn was asked to stop while `body` ran (it
   * ended `cancelled` with `turn.partial`); `LeaseLost` when the lease went
   * while `body` ran; else whatever `body` threw, after failing the turn as
   * retryable.
   */
  async turn<R, P = unknown>(request: TurnRequest<P>, body: (turn: Turn<P>) => Promise<R> | R): Promise<R> {
    const outcome = await this.run(request, body);
    if (outcome.replayed) {
      if (outcome.state !== "succeeded" && outcome.turn !== undefined) throw new TurnNotSucceeded(outcome.turn);
      return outcome.value as R;
    }
    if (outcome.state === "cancelled" && outcome.value === undefined) {
      throw new TurnCancelled(`turn ${outcome.turnId} was asked to stop while it ran; it ended cancelled`);
    }
    return outcome.value as R;
  }

  /**
   * As {@link turn}, resolving how the message ended instead of only its
   * response: `replayed` when the server answered with a stored outcome
   * (and `body` did not run), `state: "cancelled"` (with `partial`) when
   * the turn was interrupted while `body` ran, `"superseded"` when a newer
   * queued message replaced it. Rejects as {@link turn} otherwise.
   */
  async run<R, P = unknown>(request: TurnRequest<P>, body: (turn: Turn<P>) => Promise<R> | R): Promise<TurnOutcome<R>> {
    const begun = await this.#beginTurn<R, P>(request);
    if (!(begun instanceof Turn)) return begun;
    const ended = await runTurn(begun, body);
    return { turnId: begun.turnId, replayed: false, turn: undefined, ...ended };
  }

  /** Begins `request`'s turn: the granted turn, or the outcome of a replay. */
  async #beginTurn<R, P>(request: TurnRequest<P>): Promise<Turn<P> | TurnOutcome<R>> {
    const beginRequest = {
      user_id: request.userId,
      session_id: request.sessionId,
      client_request_id: request.clientRequestId,
      payload: (request.payload ?? null) as Schemas["JsonValue"],
      ...(request.confirmation === undefined
        ? {}
        : { confirmation: { turn_id: request.confirmation.turnId, decision: request.confirmation.decision } }),
      ...busyFields(request),
    } satisfies Schemas["BeginRequest"];
    const answer = await this.#begin(beginRequest, request);
    if (answer.status === 200) {
      const stored = (answer.body as Schemas["ReplayResponse"]).turn;
      return {
        turnId: stored.turn_id,
        state: stored.state,
        replayed: true,
        value: stored.state === "succeeded" ? (stored.response as R) : undefined,
        partial: stored.state === "cancelled" ? stored.response : undefined,
        turn: stored,
      };
    }
    const grant = (answer.body as Schemas["BeginResponse"]).turn;
    return new Turn<P>(this.#http, grant, request.payload, []);
  }

  /**
   * Runs `body` on every message a session owes, in order, through the
   * handoff: each turn is ended as {@link run} ends it, asking for the
   * session's next queued message (`take_next`); the server starts it for
   * this caller and its payload comes with the grant (`turn.payload`),
   * until the queue is empty, the next cannot start now (a confirmation is
   * pending, the user is at its cap), `maxTurns` ran, or `signal` aborted
   * (the turn in hand finishes first). Resolves each turn's outcome,
   * oldest first.
   *
   * `from` is a session id (the drain claims the session's turn that can
   * start now: its holder if that died, else its queue's head once the
   * session is free; `[]` when a live holder has it) or a request (begun
   * as {@link run} begins it, and run first; a replay ends the drain).
   *
   * A turn asked to stop ends `cancelled` and the drain goes on. If `body`
   * throws, its turn is failed (retryable) without a handoff and the error
   * rethrown: the rest stays queued for a later drain or a recovery
   * worker. A sender still waiting for its queued message (`onBusy:
   * "enqueue"`) gets the drained turn's outcome as a replay.
   */
  async drain<R, P = unknown>(
    from: string | TurnRequest<P>,
    body: (turn: Turn<P>) => Promise<R> | R,
    options: DrainOptions<R> = {},
  ): Promise<TurnOutcome<R>[]> {
    const outcomes = options.outcomes ?? [];
    let first: Turn<P> | null;
    if (typeof from === "string") {
      const session = (await this.#http.send<Schemas["SessionResponse"]>("GET", owned(`/v1/sessions/${encodeURIComponent(from)}`, options.userId))).body.session;
      const turnIds = [session.holder?.turn_id, session.queue[0]?.turn_id].filter((id): id is string => id !== undefined);
      if (turnIds.length === 0) return outcomes;
      first = await this.#claim<P>({ minOrphanedMs: 0, turnIds, ...(options.userId === undefined ? {} : { userIds: [options.userId] }) });
    } else {
      const begun = await this.#beginTurn<R, P>(from);
      if (!(begun instanceof Turn)) {
        outcomes.push(begun);
        return outcomes;
      }
      first = begun;
    }
    if (first !== null) await this.#drainFrom(first, body, options, outcomes);
    return outcomes;
  }

  /**
   * One recovery step (what {@link RecoveryWorker} loops on): claims the
   * orphan matching `filter` that died longest ago, or else the head of a
   * queue left free (both at least `minOrphanedMs`), runs `body` on it
   * (`turn.payload`, `turn.journal` with every page; `turn.tool` returns
   * stored results and reconciles `unknown` ones) and drains its session
   * as {@link drain} does. Resolves `[]` when there was nothing to claim.
   */
  async recover<R, P = unknown>(
    filter: OrphanFilter,
    body: (turn: Turn<P>) => Promise<R> | R,
    options: DrainOptions<R> = {},
  ): Promise<TurnOutcome<R>[]> {
    const outcomes = options.outcomes ?? [];
    const turn = await this.#claim<P>(filter);
    if (turn !== null) await this.#drainFrom(turn, body, options, outcomes);
    return outcomes;
  }

  /** Runs `body` on `first`, then on each turn the endings hand over. */
  async #drainFrom<R, P>(
    first: Turn<P>,
    body: (turn: Turn<P>) => Promise<R> | R,
    options: DrainOptions<R>,
    outcomes: TurnOutcome<R>[],
  ): Promise<void> {
    const maxTurns = options.maxTurns ?? DRAIN_MAX_TURNS;
    if (!(Number.isInteger(maxTurns) && maxTurns >= 1)) throw new RangeError(`maxTurns must be an integer >= 1, got ${maxTurns}`);
    let current: Turn<P> | undefined = first;
    const stop = (): void => {
      if (current !== undefined) current.takeNext = false;
    };
    options.signal?.addEventListener("abort", stop);
    try {
      for (let ran = 1; current !== undefined; ran++) {
        current.takeNext = ran < maxTurns && options.signal?.aborted !== true;
        options.onTurn?.(current as Turn<unknown>);
        const ended = await runTurn(current, body);
        outcomes.push({ turnId: current.turnId, replayed: false, turn: undefined, ...ended });
        const handed: Schemas["NextTurnDto"] | undefined = current.handoff;
        current = handed === undefined ? undefined : new Turn<P>(this.#http, handed.turn, handed.payload as P, []);
      }
    } finally {
      options.signal?.removeEventListener("abort", stop);
    }
  }

  /**
   * Follows a turn's events: `for await (const event of gate.follow(turnId))`
   * yields each {@link TurnEvent} after `after` once, in order, live while
   * the turn runs, and last its ending (`name: "end"`, `state`). Resumes
   * with `Last-Event-ID` after a dropped connection or a server-side close
   * without `end`, on the next of `baseUrls` (any node sharing the store),
   * with bounded reconnects and backoff; an `error` event throws its typed
   * error. Break out of the loop, or abort `signal`, to stop early.
   */
  follow(turnId: string, options: FollowOptions = {}): Follower {
    return new Follower(this.#http, turnId, options);
  }

  /**
   * Sends the begin until it is granted (201) or replayed (200): again
   * while it is refused with a waitable code, and while it is queued (202:
   * the same request, until it is the head on a free session), within the
   * caller's wait. A queued message whose wait runs out is withdrawn.
   * `request_in_flight` naming a turn is not paused on: that turn is
   * followed to its `end` (within the wait and its lease's `Retry-After`),
   * then the begin is sent again at once and replays its answer; the body
   * never runs twice (the begin grants only a takeover of a dead holder).
   */
  async #begin(
    body: Schemas["BeginRequest"],
    request: TurnRequest<unknown>,
  ): Promise<{ status: number; body: Schemas["BeginResponse"] | Schemas["ReplayResponse"] | Schemas["QueuedResponse"] }> {
    const waitMs = request.waitMs;
    if (waitMs !== undefined && !(Number.isFinite(waitMs) && waitMs >= 0)) throw new RangeError(`waitMs must be >= 0, got ${waitMs}`);
    const startedMs = Date.now();
    let queued: Schemas["QueuedDto"] | undefined;
    let pollMs = POLL_FIRST_MS;
    /** Turns a follow saw end: never followed again (a repeat still in flight is paused on). */
    const ended = new Set<string>();
    for (let attempts = 1; ; attempts++) {
      let blocker: AgentgateError | undefined;
      let retryAfterMs: number | undefined;
      try {
        const answer = await this.#http.send<Schemas["BeginResponse"] | Schemas["ReplayResponse"] | Schemas["QueuedResponse"]>(
          "POST",
          "/v1/turns",
          { body },
        );
        if (answer.status !== 202) return answer;
        const now = (answer.body as Schemas["QueuedResponse"]).turn;
        if (queued?.position !== now.position) request.onQueued?.(now.position, now.turn_id);
        queued = now;
        retryAfterMs = now.retry_after_ms;
      } catch (error) {
        if (!isCode(error, WAITABLE_BEGIN_CODES)) throw error;
        blocker = error;
        retryAfterMs = error.retryAfterMs;
      }
      const remainingMs = startedMs + (waitMs ?? (queued === undefined ? 0 : DEFAULT_QUEUE_WAIT_MS)) - Date.now();
      const active = blocker?.code === "request_in_flight" ? blocker.activeTurnId : undefined;
      if (active && !ended.has(active) && remainingMs > 0 && attempts < MAX_WAIT_ATTEMPTS) {
        const boundMs = Math.min(remainingMs, retryAfterMs === undefined ? remainingMs : retryAfterMs + IN_FLIGHT_LEASE_SLACK_MS);
        const outcome = await this.#followToEnd(active, boundMs, request.userId);
        if (outcome === "end") {
          ended.add(active);
          pollMs = POLL_FIRST_MS;
        }
        // Ended: the begin replays. Timed out: it replays, takes a dead holder's turn over, or is refused with a fresh Retry-After.
        if (outcome !== "failed") continue;
      }
      if (remainingMs <= 0 || attempts >= MAX_WAIT_ATTEMPTS) {
        if (queued !== undefined) throw await this.#withdraw(queued, request.userId);
        throw blocker;
      }
      await sleep(Math.min(pollMs, retryAfterMs ?? pollMs, remainingMs));
      pollMs = Math.min(POLL_MAX_MS, pollMs * 2);
    }
  }

  /** Follows `turnId`'s events for its `end`, at most `ms` (for a begin refused `request_in_flight`): asks for no event, only the `end`. */
  async #followToEnd(turnId: string, ms: number, userId: string): Promise<"end" | "timeout" | "failed"> {
    const stop = new AbortController();
    const timer = setTimeout(() => stop.abort(), ms);
    try {
      const follower = this.follow(turnId, { after: IN_FLIGHT_FOLLOW_AFTER, userId, signal: stop.signal, maxReconnects: 0 });
      for await (const event of follower) {
        if (event.name === "end") return "end";
      }
      return stop.signal.aborted ? "timeout" : "failed";
    } catch {
      return stop.signal.aborted ? "timeout" : "failed";
    } finally {
      clearTimeout(timer);
    }
  }

  /** A queued message's wait ran out: cancel it so it never runs with no one to run it; the error to throw. */
  async #withdraw(queued: Schemas["QueuedDto"], userId: string): Promise<QueueTimeout> {
    const withdrawn = await this.cancel(queued.turn_id, userId).then(
      () => true,
      () => false,
    );
    return new QueueTimeout(queued.turn_id, queued.position, withdrawn);
  }

  /**
   * For recovery workers: takes over the orphan (a running turn whose
   * worker died) matching `filter` that died longest ago, and runs it like
   * {@link turn}: `body` gets a turn with the original `payload` and the
   * `journal` of its tool executions; claim its tool calls again through
   * `turn.tool` (succeeded ones return their result, interrupted ones come
   * back `unknown` for your reconcile hook). Resolves `null` when there is
   * no such orphan.
   */
  async claimOrphan<R, P = unknown>(filter: OrphanFilter, body: (turn: Turn<P>) => Promise<R> | R): Promise<OrphanResult<R> | null> {
    const turn = await this.#claim<P>(filter);
    if (turn === null) return null;
    const ended = await runTurn(turn, body);
    if (ended.state === "cancelled" && ended.value === undefined) {
      throw new TurnCancelled(`turn ${turn.turnId} was asked to stop while it ran; it ended cancelled`);
    }
    return { turnId: turn.turnId, response: ended.value as R };
  }

  /** `POST /v1/orphans/claim`: the claimed turn (its whole journal read), or `null`. */
  async #claim<P>(filter: OrphanFilter): Promise<Turn<P> | null> {
    const request = {
      ...(filter.minOrphanedMs === undefined ? {} : { min_orphaned_ms: filter.minOrphanedMs }),
      ...(filter.userIds === undefined ? {} : { user_ids: filter.userIds }),
      ...(filter.turnIds === undefined ? {} : { turn_ids: filter.turnIds }),
    } satisfies Schemas["ClaimOrphanRequest"];
    const answer = await this.#http.send<Schemas["ClaimOrphanResponse"] | undefined>("POST", "/v1/orphans/claim", { body: request });
    if (answer.status === 204 || answer.body === undefined) return null;
    const claimed = answer.body;
    // The claim carries the journal's first page; the rest is read in
    // pages, so the body sees every execution of the turn.
    const journal = [...claimed.journal];
    let next = claimed.journal_next ?? null;
    while (next !== null) {
      const path = `/v1/turns/${encodeURIComponent(claimed.turn.turn_id)}/executions?after=${encodeURIComponent(next)}`;
      const page = (await this.#http.send<Schemas["ExecutionPageResponse"]>("GET", path)).body;
      journal.push(...page.executions.map(journalEntry));
      next = page.executions_next ?? null;
    }
    return new Turn<P>(this.#http, claimed.turn, claimed.payload as P, journal);
  }

  /**
   * `POST /v1/turns/{id}/cancel`: asks a running turn to stop (no lease
   * needed, idempotent). Its holder learns it on its next heartbeat and
   * tool claim (`TurnCancelled`). `userId` checks the owner.
   */
  async requestCancel(turnId: string, userId?: string): Promise<TurnDto> {
    const path = owned(`/v1/turns/${encodeURIComponent(turnId)}/cancel`, userId);
    return (await this.#http.send<Schemas["TurnResponse"]>("POST", path, { body: {} })).body.turn;
  }

  /**
   * Asks a turn to stop ({@link requestCancel}): a running one ends
   * `cancelled` once its holder learns it (its next heartbeat: the body's
   * `turn.signal` fires); a queued one is removed at once.
   */
  async cancel(turnId: string, userId?: string): Promise<TurnDto> {
    return this.requestCancel(turnId, userId);
  }

  /**
   * `PUT /v1/sessions/{id}/policy`: what a begin on this session that
   * names no `onBusy` does when the session is busy. Binds a session not
   * used yet to `userId`. Resolves the session (`default_policy` shows it).
   */
  async setPolicy(sessionId: string, userId: string, policy: SessionPolicy): Promise<SessionDto> {
    const body = { user_id: userId, on_busy: policy.onBusy, ...busyFields(policy) } satisfies Schemas["SessionPolicyRequest"];
    const path = `/v1/sessions/${encodeURIComponent(sessionId)}/policy`;
    return (await this.#http.send<Schemas["SessionResponse"]>("PUT", path, { body })).body.session;
  }

  /** `GET /v1/sessions/{id}`: the holder, the queue, the default policy. */
  async getSession(sessionId: string): Promise<SessionDto> {
    return (await this.#http.send<Schemas["SessionResponse"]>("GET", `/v1/sessions/${encodeURIComponent(sessionId)}`)).body.session;
  }

  /**
   * `POST /v1/sessions/{id}/release`: an operator's force-release. The
   * holder (live or expired) ends `abandoned` and its every later write is
   * refused `LeaseLost`; resolves that turn, or `null` when the session had
   * no holder.
   */
  async releaseSession(sessionId: string, userId?: string): Promise<TurnDto | null> {
    const path = owned(`/v1/sessions/${encodeURIComponent(sessionId)}/release`, userId);
    return (await this.#http.send<Schemas["ReleaseResponse"]>("POST", path, { body: {} })).body.released ?? null;
  }

  /** `GET /v1/turns/{id}`: the turn, whether it is orphaned, and its first page of executions. */
  async getTurn(turnId: string): Promise<Schemas["TurnStateResponse"]> {
    return (await this.#http.send<Schemas["TurnStateResponse"]>("GET", `/v1/turns/${encodeURIComponent(turnId)}`)).body;
  }
}

/**
 * A running turn under a lease. Handed to the body of `gate.turn` and
 * `gate.claimOrphan`; the gate ends it.
 */
export class Turn<P = unknown> {
  readonly turnId: string;
  readonly sessionId: string;
  readonly userId: string;
  readonly clientRequestId: string;
  /** This grant's fencing token; strictly higher than any earlier grant. */
  readonly fence: number;
  /** 1 for the first start, +1 per takeover or restart. */
  readonly attempt: number;
  /** This start took over a turn whose holder died: its tool calls may have run; `turn.tool` finds out. */
  readonly takeover: boolean;
  readonly payload: P;
  /** On a confirmation turn: the pending action and the person's decision. */
  readonly confirmation: ConfirmationDto | undefined;
  /** On a claimed orphan: its tool executions before the takeover, oldest first. */
  readonly journal: readonly JournalEntry[];
  /** The lease's TTL as granted (ms); heartbeats go every third of it. */
  readonly leaseTtlMs: number;
  /**
   * The secret this client sends as `Lease-Token`, for calls it does not
   * wrap. Never log it.
   */
  readonly leaseToken: string;

  /**
   * What the turn has produced so far (say, the reply streamed up to now):
   * a turn asked to stop ends `cancelled` with it, and repeats of its
   * request replay it. Any JSON value.
   */
  partial: unknown = null;

  /**
   * Whether this turn's ending (its completion, `endCancelled`) asks for
   * the session's next queued message (the handoff). {@link Gate.drain}
   * sets it and runs what is handed over.
   */
  takeNext = false;

  readonly #http: Http;
  /** Aborted when the lease is lost: every call under it is refused locally from then on. */
  readonly #lease = new AbortController();
  /** Aborted when the body is to stop: the lease is lost, or the turn was asked to stop. */
  readonly #stop = new AbortController();
  #cancelRequested = false;
  #ended = false;
  #endedState: TurnState | undefined;
  #heartbeatTimer: ReturnType<typeof setTimeout> | undefined;
  /** Set once the turn ends or is lost: a heartbeat answering after that schedules no next one. */
  #heartbeatStopped = false;
  /** The highest attempt of each execution a caller here took, to run or as adopted (see `#claim`). */
  readonly #attempts = new Map<string, number>();
  /** Answers to this turn's claims lost and not yet accounted for by an adoption. */
  #lostClaims = 0;
  /** Local time by which the lease has certainly expired unless renewed: answer time + remaining lease. */
  #leaseDeadlineMs: number;
  /** The events emitted and not appended yet (made at the first `emit`). */
  #emitter: Emitter | undefined;
  /** After an ending that took it: the session's next queued message, granted to this caller. */
  #handoff: Schemas["NextTurnDto"] | undefined;

  /** @internal Built by the Gate from a grant. */
  constructor(http: Http, grant: GrantDto, payload: P, journal: readonly JournalEntry[]) {
    this.#http = http;
    this.turnId = grant.turn_id;
    this.sessionId = grant.session_id;
    this.userId = grant.user_id;
    this.clientRequestId = grant.client_request_id;
    this.fence = grant.fence;
    this.attempt = grant.attempt;
    this.takeover = grant.takeover;
    this.payload = payload;
    this.confirmation = grant.confirmation ?? undefined;
    this.journal = journal;
    this.leaseTtlMs = grant.lease_expires_in_ms;
    this.leaseToken = grant.lease_token;
    this.#leaseDeadlineMs = Date.now() + grant.lease_expires_in_ms;
  }

  /**
   * Fires when the body is to stop: with a {@link TurnCancelled} reason
   * when the turn was asked to stop (a cancel, or another message sent
   * with `onBusy: "interrupt"`; learnt on the next heartbeat, a third of
   * the TTL away at most), or a {@link LeaseLost} one when the lease is
   * lost (taken over, expired, ended). Pass it to the model call.
   */
  get signal(): AbortSignal {
    return this.#stop.signal;
  }

  /** Whether the lease is known lost; then every call on this turn rejects with `LeaseLost`. */
  get lost(): boolean {
    return this.#lease.signal.aborted;
  }

  /** Whether the turn was asked to stop; then `turn.tool` rejects with `TurnCancelled` without claiming. */
  get cancelRequested(): boolean {
    return this.#cancelRequested;
  }

  /** Throws {@link TurnCancelled} if the turn was asked to stop (and {@link LeaseLost} if the lease is lost). */
  checkCancelled(): void {
    this.#lease.signal.throwIfAborted();
    if (this.#cancelRequested) throw new TurnCancelled(`turn ${this.turnId}: asked to stop (cancel or interrupt)`);
  }

  /**
   * Runs a tool call at most once across retries, takeovers and concurrent
   * callers: claims it; returns the stored result without running when it
   * already succeeded; waits (bounded) while the same call runs elsewhere
   * under this lease; else runs it (reconciling an `unknown` previous
   * attempt first) and stores the result. A throw from `run` is reported
   * as the execution's failure (the next claim runs it again) and rethrown.
   * Once the turn was asked to stop it rejects with {@link TurnCancelled}
   * instead, claiming nothing; a call already running finishes.
   */
  async tool<A, R>(name: string, args: A, options: ToolOptions<A, R>): Promise<R> {
    this.checkCancelled();
    const path = `/v1/turns/${encodeURIComponent(this.turnId)}/tools`;
    const claimBody = { tool: name, args: (args ?? null) as Schemas["JsonValue"] } satisfies Schemas["ClaimToolRequest"];
    const answer = await this.#claim(path, claimBody, options.waitMs ?? DEFAULT_TOOL_WAIT_MS);
    if (answer.status === 200) return (answer.body as Schemas["ExecutionResultResponse"]).execution.result as R;
    const execution = (answer.body as Schemas["ExecuteResponse"]).execution;
    const ctx: ToolContext<A> = {
      idempotencyKey: execution.idempotency_key,
      executionId: execution.execution_id,
      attempt: execution.attempt,
      previousOutcome: execution.previous_outcome,
      args,
      signal: this.#lease.signal,
    };
    const executionPath = `${path}/${encodeURIComponent(execution.execution_id)}`;
    let result: R | undefined;
    try {
      if (execution.previous_outcome === "unknown" && options.reconcile !== undefined) {
        result = await options.reconcile(ctx);
      }
      if (result === undefined) result = await options.run(ctx);
    } catch (error) {
      if (!this.lost) {
        const failBody = { error: { name: errorName(error), message: describe(error) } } satisfies Schemas["FailToolRequest"];
        await this.#send(`${executionPath}/fail`, failBody).catch(() => undefined);
      }
      throw error;
    }
    const completeBody = { result: (result ?? null) as Schemas["JsonValue"] } satisfies Schemas["CompleteToolRequest"];
    const done = await this.#send<Schemas["ExecutionResultResponse"]>(`${executionPath}/complete`, completeBody);
    return done.body.execution.result as R;
  }

  /**
   * Claims one call, waiting up to `waitMs` while it is in flight under
   * this turn and sending it again while its answer is lost (a claim is
   * safe to repeat).
   *
   * A claim whose answer was lost leaves its attempt running with no one to
   * run it: every later claim of that call is refused `tool_in_flight`
   * (naming the execution and attempt) until the lease ends. Each lost
   * answer lets one caller adopt one such attempt that no caller here took:
   * it fails it as never run and claims again. A caller handed an attempt
   * takes it first (`#take`); the server grants each attempt once, so a
   * caller is refused only an attempt that was adopted, and no two callers
   * here ever run one attempt.
   */
  async #claim(
    path: string,
    body: Schemas["ClaimToolRequest"],
    waitMs: number,
  ): Promise<{ status: number; body: Schemas["ExecuteResponse"] | Schemas["ExecutionResultResponse"] }> {
    if (!(Number.isFinite(waitMs) && waitMs >= 0)) throw new RangeError(`waitMs must be >= 0, got ${waitMs}`);
    const deadlineMs = Date.now() + waitMs;
    let pollMs = POLL_FIRST_MS;
    let lostAnswers = 0;
    for (let attempts = 1; ; attempts++) {
      let blocker: AgentgateError;
      try {
        const answer = await this.#send<Schemas["ExecuteResponse"] | Schemas["ExecutionResultResponse"]>(path, body);
        if (answer.status === 200) return answer;
        const execution = (answer.body as Schemas["ExecuteResponse"]).execution;
        if (this.#take(execution.execution_id, execution.attempt, false)) return answer;
        // This attempt was adopted as lost and failed: a later one runs.
        blocker = new ToolInFlight(`tool execution ${execution.execution_id} attempt was failed as lost`, { status: 409 });
      } catch (error) {
        if (error instanceof ToolInFlight && error.executionId !== undefined && error.attempt !== undefined) {
          if (this.#take(error.executionId, error.attempt, true)) {
            const failBody = { error: LOST_CLAIM_ERROR } satisfies Schemas["FailToolRequest"];
            await this.#send(`${path}/${encodeURIComponent(error.executionId)}/fail`, failBody);
            continue;
          }
        }
        if (!(error instanceof AgentgateError) || error.status === 0) {
          // No answer: the claim may have landed.
          this.#lostClaims += 1;
          lostAnswers += 1;
          if (!(error instanceof TransportError) || lostAnswers >= MAX_LOST_CLAIM_ANSWERS) throw error;
        } else if (!isCode(error, WAITABLE_TOOL_CODES)) {
          throw error;
        }
        blocker = error as AgentgateError;
      }
      const remainingMs = deadlineMs - Date.now();
      if (remainingMs <= 0 || attempts >= MAX_WAIT_ATTEMPTS) throw blocker;
      await sleep(Math.min(pollMs, blocker.retryAfterMs ?? pollMs, remainingMs));
      this.#lease.signal.throwIfAborted();
      pollMs = Math.min(POLL_MAX_MS, pollMs * 2);
    }
  }

  /**
   * Takes `attempt` of `executionId` for one caller: to run it (`false` if
   * it was adopted), or with `adopting`, as a lost claim of this turn's
   * (only while a lost answer is unaccounted for and no caller took it).
   */
  #take(executionId: string, attempt: number, adopting: boolean): boolean {
    if ((this.#attempts.get(executionId) ?? 0) >= attempt) return false;
    if (adopting) {
      if (this.#lostClaims === 0) return false;
      this.#lostClaims -= 1;
    }
    this.#attempts.set(executionId, attempt);
    return true;
  }

  /**
   * Ends the turn waiting for a person to approve `pending`; the gate then
   * does not complete it. The answer comes as a begin with `confirmation`.
   */
  async awaitConfirmation(pending: unknown): Promise<TurnDto> {
    const body = { pending: (pending ?? null) as Schemas["JsonValue"] } satisfies Schemas["AwaitConfirmationRequest"];
    await this.flush();
    const answer = await this.#send<Schemas["TurnResponse"]>(`/v1/turns/${encodeURIComponent(this.turnId)}/await-confirmation`, body);
    this.#ended = true;
    this.#endedState = answer.body.turn.state;
    this.#stopHeartbeat();
    this.#emitter?.close();
    return answer.body.turn;
  }

  /**
   * Renews the lease now (the gate also does this every third of the TTL).
   * Bounded by two thirds of the TTL: an answer later than that is of no
   * use, and a hung request must not hold up noticing the lease is gone.
   */
  async heartbeat(): Promise<void> {
    const timeoutMs = Math.max(MIN_HEARTBEAT_INTERVAL_MS, Math.floor((2 * this.leaseTtlMs) / 3));
    const answer = await this.#send<Schemas["HeartbeatResponse"]>(`/v1/turns/${encodeURIComponent(this.turnId)}/heartbeat`, undefined, timeoutMs);
    this.#leaseDeadlineMs = Date.now() + answer.body.lease_expires_in_ms;
    if (answer.body.cancel_requested) this.#markCancelRequested();
  }

  /**
   * Ends the turn `cancelled` with `partial` (default `turn.partial`): the
   * answer to a cancel request, or the body's own decision to stop. The
   * gate then does not complete it; repeats of the request replay it.
   * `takeNext` (default `turn.takeNext`) asks for the session's next
   * queued message. The events emitted so far are appended first.
   */
  async endCancelled(partial: unknown = this.partial, takeNext: boolean = this.takeNext): Promise<TurnDto> {
    return this.#endCancelled(partial, takeNext, true);
  }

  /** @internal `strict: false`: end it even when its events cannot be appended (on the way out). */
  async #endCancelled(partial: unknown, takeNext: boolean, strict: boolean): Promise<TurnDto> {
    await this.#flushBeforeEnding(strict);
    const body = {
      partial: (partial ?? null) as Schemas["JsonValue"],
      ...(takeNext ? { take_next: true } : {}),
    } satisfies Schemas["EndCancelledRequest"];
    const answer = await this.#send<Schemas["TurnResponse"]>(`/v1/turns/${encodeURIComponent(this.turnId)}/end-cancelled`, body);
    this.#ended = true;
    this.#endedState = answer.body.turn.state;
    this.#handoff = answer.body.next ?? undefined;
    this.#stopHeartbeat();
    this.#emitter?.close();
    return answer.body.turn;
  }

  /** @internal The cancelled ending on the way out of `body`: its events best effort. */
  endCancelledQuietly(): Promise<TurnDto> {
    return this.#endCancelled(this.partial, this.takeNext, false);
  }

  async #flushBeforeEnding(strict: boolean): Promise<void> {
    try {
      await this.flush();
    } catch (error) {
      if (strict || this.lost) throw error;
    }
  }

  /**
   * Adds one event to the turn's log, for its followers (`gate.follow`): a
   * token of the reply, a status line. Buffered and appended in batches
   * (`POST /v1/turns/{id}/events`, at most 500 events and 512 KiB each) at
   * most 50 ms after the first waiting one, at once when a batch is full,
   * and before the turn's ending, in the order emitted. Throws
   * `InvalidRequest` at once, sending nothing, for the reserved names
   * `end` and `error`, a name that is not 1-64 of `A-Z a-z 0-9 _ - . :`, or
   * data that is not JSON or over 64 KiB; `RangeError` with 5000 events (or
   * 4 MiB) unsent (`await turn.flush()` first); and, at the next call, the
   * error of a background append that failed.
   */
  emit(name: string, data?: unknown): void {
    const size = checkedEvent(name, data);
    this.#lease.signal.throwIfAborted();
    if (this.#ended) throw new LeaseLost(`turn ${this.turnId}: already ended; its events are closed`);
    this.#emitter ??= new Emitter((batch, after, inDoubt) => this.#appendEvents(batch, after, inDoubt));
    this.#emitter.emit(name, data, size);
  }

  /** Appends every buffered event now; resolves the last event id this turn appended (`undefined` before its first). */
  async flush(): Promise<number | undefined> {
    return this.#emitter === undefined ? undefined : this.#emitter.flush();
  }

  /** The id of the last event this turn appended (`undefined` before any). */
  get lastEventId(): number | undefined {
    return this.#emitter?.lastEventId;
  }

  /**
   * One append, sent again while its answer is lost. An append is not
   * idempotent, so before sending again it reads the log back: the lost
   * one landed (all of it) or not at all.
   */
  async #appendEvents(batch: readonly Pending[], after: number | undefined, inDoubt: boolean): Promise<number> {
    const path = `/v1/turns/${encodeURIComponent(this.turnId)}/events`;
    const body = {
      events: batch.map((event) => ({ event: event.name, data: event.data as Schemas["JsonValue"] })),
    } satisfies Schemas["AppendEventsRequest"];
    let pauseMs = APPEND_PAUSE_FIRST_MS;
    let doubt = inDoubt;
    for (let attempt = 1; ; attempt++) {
      try {
        if (doubt) {
          const landed = await appendLanded(this.#http, this.turnId, after, this.attempt, batch.length);
          if (landed !== undefined) return landed;
          doubt = false;
        }
        return (await this.#send<Schemas["AppendEventsResponse"]>(path, body)).body.last_event_id;
      } catch (error) {
        if (!isCode(error, APPEND_IN_DOUBT_CODES) || attempt >= MAX_APPEND_ATTEMPTS) throw error;
        doubt = true;
        await sleep(Math.min(pauseMs, error.retryAfterMs ?? pauseMs));
        this.#lease.signal.throwIfAborted();
        pauseMs = Math.min(APPEND_PAUSE_MAX_MS, pauseMs * 2);
      }
    }
  }

  /** @internal */
  get ended(): boolean {
    return this.#ended;
  }

  /** @internal The `LeaseLost` that lost the lease (once `lost`). */
  get lostReason(): LeaseLost {
    return this.#lease.signal.reason as LeaseLost;
  }

  /** @internal How the turn ended (`undefined` while it runs). */
  get endedState(): TurnState | undefined {
    return this.#endedState;
  }

  /** @internal After an ending that took it: the next queued message's grant and payload. */
  get handoff(): Schemas["NextTurnDto"] | undefined {
    return this.#handoff;
  }

  /** @internal Starts the heartbeat loop: one at a time, every third of the TTL. */
  startHeartbeat(): void {
    const intervalMs = Math.max(MIN_HEARTBEAT_INTERVAL_MS, Math.floor(this.leaseTtlMs / 3));
    const tick = async (): Promise<void> => {
      if (this.#heartbeatStopped) return;
      try {
        await this.heartbeat();
      } catch (error) {
        // LeaseLost already aborted the signal in #send. Anything else (no
        // answer, a 503) is tried again next tick, until the lease has
        // certainly run out on its own.
        if (!this.lost && Date.now() > this.#leaseDeadlineMs) {
          this.#markLost(new LeaseLost(`lease presumed lost: not renewed for its TTL (${describe(error)})`));
        }
      }
      if (!this.#heartbeatStopped) this.#heartbeatTimer = setTimeout(tick, intervalMs);
    };
    this.#heartbeatTimer = setTimeout(tick, intervalMs);
  }

  /**
   * @internal Completes the turn (asking for the next queued message when
   * `takeNext`), or fails it (retryable, never a handoff: the error goes
   * to the caller). The events are appended first: a completion whose
   * events cannot be appended throws instead; a failure ends anyway.
   */
  async end(ending: { complete: unknown } | { fail: unknown }): Promise<TurnDto> {
    await this.#flushBeforeEnding("complete" in ending);
    this.#stopHeartbeat();
    const base = `/v1/turns/${encodeURIComponent(this.turnId)}`;
    const answer =
      "complete" in ending
        ? await this.#send<Schemas["TurnResponse"]>(`${base}/complete`, {
            response: (ending.complete ?? null) as Schemas["JsonValue"],
            ...(this.takeNext ? { take_next: true } : {}),
          } satisfies Schemas["CompleteTurnRequest"])
        : await this.#send<Schemas["TurnResponse"]>(`${base}/fail`, {
            error: ending.fail as Schemas["JsonValue"],
            retryable: true,
          } satisfies Schemas["FailTurnRequest"]);
    this.#ended = true;
    this.#endedState = answer.body.turn.state;
    this.#handoff = answer.body.next ?? undefined;
    this.#emitter?.close();
    return answer.body.turn;
  }

  /** @internal */
  stop(): void {
    this.#stopHeartbeat();
  }

  /** Every call under the lease: refused locally once the lease is known lost; a `lease_lost` answer aborts the signals. */
  async #send<T>(path: string, body?: unknown, timeoutMs?: number): Promise<{ status: number; body: T }> {
    this.#lease.signal.throwIfAborted();
    try {
      return await this.#http.send<T>("POST", path, {
        leaseToken: this.leaseToken,
        ...(body === undefined ? {} : { body }),
        ...(timeoutMs === undefined ? {} : { timeoutMs }),
      });
    } catch (error) {
      if (error instanceof LeaseLost) this.#markLost(error);
      if (error instanceof TurnCancelled) this.#markCancelRequested();
      throw error;
    }
  }

  #markLost(error: LeaseLost): void {
    this.#stopHeartbeat();
    if (!this.#lease.signal.aborted) this.#lease.abort(error);
    if (!this.#stop.signal.aborted) this.#stop.abort(error);
  }

  /** The turn was asked to stop: the body's signal fires; the heartbeat goes on until the ending. */
  #markCancelRequested(): void {
    if (this.#cancelRequested || this.#ended) return;
    this.#cancelRequested = true;
    if (!this.#stop.signal.aborted) {
      this.#stop.abort(new TurnCancelled(`turn ${this.turnId}: asked to stop (cancel or interrupt)`));
    }
  }

  #stopHeartbeat(): void {
    this.#heartbeatStopped = true;
    if (this.#heartbeatTimer !== undefined) clearTimeout(this.#heartbeatTimer);
    this.#heartbeatTimer = undefined;
  }
}

/** How `runTurn` left the turn. */
interface Ended<R> {
  state: TurnState;
  value: R | undefined;
  partial: unknown;
}

/**
 * Runs `body` under the turn's heartbeat and ends the turn by how `body`
 * ended: completed with its value; `cancelled` with `turn.partial` when it
 * threw after the turn was asked to stop (or threw `TurnCancelled`); else
 * failed, retryable, and the throw passed on.
 */
async function runTurn<R, P>(turn: Turn<P>, body: (turn: Turn<P>) => Promise<R> | R): Promise<Ended<R>> {
  turn.startHeartbeat();
  let result: R;
  try {
    result = await body(turn);
  } catch (error) {
    turn.stop();
    if (turn.lost) throw turn.lostReason;
    if (turn.ended) throw error;
    if (turn.cancelRequested || error instanceof TurnCancelled) {
      const ended = await turn.endCancelledQuietly();
      return { state: ended.state, value: undefined, partial: ended.response ?? null };
    }
    const failure = { name: errorName(error), message: describe(error) };
    await turn.end({ fail: failure }).catch((endError: unknown) => {
      if (endError instanceof LeaseLost) throw endError;
    });
    throw error;
  }
  try {
    if (turn.ended) return { state: turn.endedState ?? "succeeded", value: result, partial: undefined };
    if (turn.lost) throw turn.lostReason;
    try {
      await turn.flush();
    } catch (error) {
      // Its events could not be appended: it does not complete as if they were.
      if (!turn.lost) await turn.end({ fail: { name: errorName(error), message: describe(error) } }).catch(() => undefined);
      throw error;
    }
    const ended = await turn.end({ complete: result });
    return { state: ended.state, value: ended.response as R, partial: undefined };
  } finally {
    turn.stop();
  }
}

/**
 * No abort listener here: 50 callers waiting on one turn's signal would
 * each add one. A wait is at most POLL_MAX_MS, and the signal is checked
 * right after it.
 */
function sleep(ms: number): Promise<void> {
  return new Promise((resolve) => setTimeout(resolve, Math.max(0, ms)));
}

function errorName(error: unknown): string {
  return error instanceof AgentgateError ? error.code : error instanceof Error ? error.name : typeof error;
}

/** A page's execution as a claim's journal names it (as the server's
 * `JournalEntry::from_view` does: a running one's outcome is unknown). */
function journalEntry(execution: Schemas["ExecutionDto"]): Schemas["JournalEntryDto"] {
  const outcome = execution.state === "running" ? "unknown" : execution.state;
  return {
    execution_id: execution.execution_id,
    tool: execution.tool,
    attempt: execution.attempt,
    outcome,
    ...(execution.state === "succeeded" ? { result: execution.result } : {}),
    ...(execution.state === "failed" ? { error: execution.error } : {}),
  };
}
