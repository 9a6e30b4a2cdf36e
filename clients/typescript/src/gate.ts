/**
 * `Gate` and `Turn`: the protocol of docs/http.md written once, so callers
 * do not hand-roll the subtle parts (the heartbeat, the bounded
 * `Retry-After` wait, the `unknown` tool outcome, lease loss).
 *
 *   begin ─▶ heartbeat every third of the TTL ─▶ per tool call: claim,
 *   run only when told to execute (reconcile an `unknown` first), complete
 *   or fail ─▶ complete the turn (or fail it, retryable, on a throw).
 *
 * Every wait here is bounded: by the caller's `waitMs`, and by an attempt
 * count as a second fence.
 */

import {
  AgentgateError,
  LeaseLost,
  ToolInFlight,
  TransportError,
  TurnNotSucceeded,
} from "./errors.js";
import { Http, describe, isCode, type HttpOptions } from "./http.js";
import type { components } from "./openapi.js";

type Schemas = components["schemas"];
export type GrantDto = Schemas["GrantDto"];
export type TurnDto = Schemas["TurnDto"];
export type JournalEntry = Schemas["JournalEntryDto"];
export type PreviousOutcome = Schemas["PreviousOutcomeDto"];
export type Decision = Schemas["DecisionDto"];
export type ConfirmationDto = Schemas["ConfirmationDto"];

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

export interface GateOptions extends HttpOptions {}

export interface TurnRequest<P> {
  userId: string;
  sessionId: string;
  /** The user's message id: a repeat with the same id replays, never runs twice. */
  clientRequestId: string;
  /** The message; any JSON value. */
  payload: P;
  /** How long to wait out `session_busy`, `request_in_flight`, `user_at_capacity` and 503s (default 0: fail at once). */
  waitMs?: number;
  /** Answer a pending confirmation of an earlier turn. */
  confirmation?: { turnId: string; decision: Decision };
  /**
   * What the server does when the session is held by another turn:
   * `"reject"` (default: `SessionBusy` at once), `"wait"` (waits there up
   * to `busyWaitMs` for it to come free, woken by the store's release
   * notification), `"interrupt"` (first asks the running turn to stop).
   */
  onBusy?: BusyPolicy;
  /** The server-side bound of `"wait"` and `"interrupt"` (default 12000, at most {@link MAX_BUSY_WAIT_MS}). */
  busyWaitMs?: number;
}

/** A begin's policy for a busy session. */
export type BusyPolicy = "reject" | "wait" | "interrupt";

/** The server's bound on a waiting begin (`MAX_BUSY_WAIT`). */
export const MAX_BUSY_WAIT_MS = 20_000;

/** A begin's policy fields: `wait_ms` only beside a waiting policy, as the document says. */
type BusyFields = Record<never, never> | { on_busy: BusyPolicy } | { on_busy: "wait" | "interrupt"; wait_ms: number };

function busyFields(request: { onBusy?: BusyPolicy; busyWaitMs?: number }): BusyFields {
  if (request.onBusy === undefined) {
    if (request.busyWaitMs !== undefined) throw new RangeError("busyWaitMs needs onBusy 'wait' or 'interrupt'");
    return {};
  }
  if (!["reject", "wait", "interrupt"].includes(request.onBusy)) throw new RangeError(`unknown onBusy ${JSON.stringify(request.onBusy)}`);
  if (request.busyWaitMs === undefined) return { on_busy: request.onBusy };
  const ms = request.busyWaitMs;
  if (request.onBusy === "reject" || !Number.isInteger(ms) || ms < 0 || ms > MAX_BUSY_WAIT_MS) {
    throw new RangeError(`busyWaitMs must be an integer 0..${MAX_BUSY_WAIT_MS} with 'wait' or 'interrupt'`);
  }
  return { on_busy: request.onBusy, wait_ms: ms };
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
  /** Fires (with a {@link LeaseLost} reason) when the turn's lease is lost. */
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

export class Gate {
  readonly #http: Http;

  constructor(options: GateOptions) {
    this.#http = new Http(options);
  }

  /**
   * Runs one turn: begins it (waiting up to `waitMs` while it is blocked),
   * heartbeats while `body` runs, and completes it with `body`'s return
   * value. A replay (the request already ended) returns the stored
   * response without calling `body`.
   *
   * Rejects with: the begin's typed error once the wait is over
   * (`SessionBusy`, `RequestInFlight`, `UserAtCapacity`, `PayloadMismatch`,
   * …); `TurnNotSucceeded` for a replay of a turn that did not succeed;
   * `LeaseLost` when the lease went while `body` ran (`turn.signal` fired);
   * else whatever `body` threw, after failing the turn as retryable.
   */
  async turn<R, P = unknown>(request: TurnRequest<P>, body: (turn: Turn<P>) => Promise<R> | R): Promise<R> {
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
    const answer = await waitOut(request.waitMs ?? 0, WAITABLE_BEGIN_CODES, undefined, () =>
      this.#http.send<Schemas["BeginResponse"] | Schemas["ReplayResponse"]>("POST", "/v1/turns", { body: beginRequest }),
    );
    if (answer.status === 200) {
      const replay = answer.body as Schemas["ReplayResponse"];
      if (replay.turn.state !== "succeeded") throw new TurnNotSucceeded(replay.turn);
      return replay.turn.response as R;
    }
    const grant = (answer.body as Schemas["BeginResponse"]).turn;
    return runTurn(new Turn<P>(this.#http, grant, request.payload, []), body);
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
    const turn = new Turn<P>(this.#http, claimed.turn, claimed.payload as P, journal);
    const response = await runTurn(turn, body);
    return { turnId: turn.turnId, response };
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

  readonly #http: Http;
  readonly #controller = new AbortController();
  #ended = false;
  #heartbeatTimer: ReturnType<typeof setTimeout> | undefined;
  /** Set once the turn ends or is lost: a heartbeat answering after that schedules no next one. */
  #heartbeatStopped = false;
  /** The highest attempt of each execution a caller here took, to run or as adopted (see `#claim`). */
  readonly #attempts = new Map<string, number>();
  /** Answers to this turn's claims lost and not yet accounted for by an adoption. */
  #lostClaims = 0;
  /** Local time by which the lease has certainly expired unless renewed: answer time + remaining lease. */
  #leaseDeadlineMs: number;

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

  /** Fires when the lease is lost (taken over, expired, ended); its `reason` is the {@link LeaseLost}. */
  get signal(): AbortSignal {
    return this.#controller.signal;
  }

  /** Whether the lease is known lost; then every call on this turn rejects with `LeaseLost`. */
  get lost(): boolean {
    return this.#controller.signal.aborted;
  }

  /**
   * Runs a tool call at most once across retries, takeovers and concurrent
   * callers: claims it; returns the stored result without running when it
   * already succeeded; waits (bounded) while the same call runs elsewhere
   * under this lease; else runs it (reconciling an `unknown` previous
   * attempt first) and stores the result. A throw from `run` is reported
   * as the execution's failure (the next claim runs it again) and rethrown.
   */
  async tool<R, A = unknown>(name: string, args: A, options: ToolOptions<A, R>): Promise<R> {
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
      signal: this.signal,
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
      this.signal.throwIfAborted();
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
    const answer = await this.#send<Schemas["TurnResponse"]>(`/v1/turns/${encodeURIComponent(this.turnId)}/await-confirmation`, body);
    this.#ended = true;
    this.#stopHeartbeat();
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
  }

  /** @internal */
  get ended(): boolean {
    return this.#ended;
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

  /** @internal */
  async end(ending: { complete: unknown } | { fail: unknown }): Promise<TurnDto> {
    this.#stopHeartbeat();
    const base = `/v1/turns/${encodeURIComponent(this.turnId)}`;
    const answer =
      "complete" in ending
        ? await this.#send<Schemas["TurnResponse"]>(`${base}/complete`, {
            response: (ending.complete ?? null) as Schemas["JsonValue"],
          } satisfies Schemas["CompleteTurnRequest"])
        : await this.#send<Schemas["TurnResponse"]>(`${base}/fail`, {
            error: ending.fail as Schemas["JsonValue"],
            retryable: true,
          } satisfies Schemas["FailTurnRequest"]);
    this.#ended = true;
    return answer.body.turn;
  }

  /** @internal */
  stop(): void {
    this.#stopHeartbeat();
  }

  /** Every call under the lease: refused locally once the lease is known lost; a `lease_lost` answer aborts the signal. */
  async #send<T>(path: string, body?: unknown, timeoutMs?: number): Promise<{ status: number; body: T }> {
    this.signal.throwIfAborted();
    try {
      return await this.#http.send<T>("POST", path, {
        leaseToken: this.leaseToken,
        ...(body === undefined ? {} : { body }),
        ...(timeoutMs === undefined ? {} : { timeoutMs }),
      });
    } catch (error) {
      if (error instanceof LeaseLost) this.#markLost(error);
      throw error;
    }
  }

  #markLost(error: LeaseLost): void {
    this.#stopHeartbeat();
    if (!this.#controller.signal.aborted) this.#controller.abort(error);
  }

  #stopHeartbeat(): void {
    this.#heartbeatStopped = true;
    if (this.#heartbeatTimer !== undefined) clearTimeout(this.#heartbeatTimer);
    this.#heartbeatTimer = undefined;
  }
}

/** Runs `body` under the turn's heartbeat and ends the turn by how `body` ended. */
async function runTurn<R, P>(turn: Turn<P>, body: (turn: Turn<P>) => Promise<R> | R): Promise<R> {
  turn.startHeartbeat();
  let result: R;
  try {
    result = await body(turn);
  } catch (error) {
    turn.stop();
    if (turn.lost) throw turn.signal.reason as LeaseLost;
    if (!turn.ended) {
      const failure = { name: errorName(error), message: describe(error) };
      await turn.end({ fail: failure }).catch((endError: unknown) => {
        if (endError instanceof LeaseLost) throw endError;
      });
    }
    throw error;
  }
  try {
    if (turn.ended) return result;
    if (turn.lost) throw turn.signal.reason as LeaseLost;
    const ended = await turn.end({ complete: result });
    return ended.response as R;
  } finally {
    turn.stop();
  }
}

/**
 * Repeats `attempt` while it rejects with one of `codes`, sleeping the
 * shorter of the polling backoff and the error's `retryAfterMs`, until
 * `waitMs` is spent (then the last error is thrown), `signal` fires, or
 * {@link MAX_WAIT_ATTEMPTS} attempts were made.
 */
async function waitOut<T>(waitMs: number, codes: ReadonlySet<string>, signal: AbortSignal | undefined, attempt: () => Promise<T>): Promise<T> {
  if (!(Number.isFinite(waitMs) && waitMs >= 0)) throw new RangeError(`waitMs must be >= 0, got ${waitMs}`);
  const deadlineMs = Date.now() + waitMs;
  let pollMs = POLL_FIRST_MS;
  for (let attempts = 1; ; attempts++) {
    try {
      return await attempt();
    } catch (error) {
      const remainingMs = deadlineMs - Date.now();
      if (!isCode(error, codes) || remainingMs <= 0 || attempts >= MAX_WAIT_ATTEMPTS) throw error;
      await sleep(Math.min(pollMs, error.retryAfterMs ?? pollMs, remainingMs));
      signal?.throwIfAborted();
      pollMs = Math.min(POLL_MAX_MS, pollMs * 2);
    }
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
