/**
 * A recovery worker (docs/protocol.md §8): claims orphans (turns whose
 * worker died) and queue heads nobody took, runs a body on each and drains
 * its session's queue (`gate.recover`), sleeps with backoff when there is
 * nothing, and stops gracefully: the turn in hand finishes, no next one is
 * taken.
 */

import { AgentgateError } from "./errors.js";
import { pause } from "./events.js";
import { DRAIN_MAX_TURNS, type Gate, type OrphanFilter, type Turn, type TurnOutcome } from "./gate.js";

/**
 * A worker claims only orphans dead (and queue heads left free) at least
 * this long by default, so a client's own retry and a holder's handoff
 * usually come first; 0 claims at once.
 */
export const RECOVERY_MIN_ORPHANED_MS = 2000;
/**
 * The pause when there was nothing to claim (or the server did not
 * answer): from the first, doubling to the longest, each jittered into its
 * upper half so many workers do not ask in step.
 */
export const RECOVERY_IDLE_MIN_MS = 200;
export const RECOVERY_IDLE_MAX_MS = 5000;
/** Claim refusals a worker waits out rather than throwing: the server or its store is briefly unavailable, or no answer came. */
const RECOVERY_WAITABLE_CODES: ReadonlySet<string> = new Set(["transport", "store_unavailable", "overloaded", "request_timeout"]);

export interface RecoveryOptions extends OrphanFilter {
  /** Drain each claimed turn's session after it (default `true`). */
  drain?: boolean;
  /** Aborting it is `worker.stop()`. */
  signal?: AbortSignal;
  /** A body that threw (its turn was failed, retryable); default: `console.error`. */
  onError?: (error: unknown, turnId: string) => void;
}

export interface RecoveryRun {
  /** Stop once this many turns ran. */
  maxTurns?: number;
  /** Stop at the first claim that finds nothing. */
  untilIdle?: boolean;
}

/**
 * `new RecoveryWorker(gate, body, { minOrphanedMs, userIds, turnIds, drain,
 * signal, onError })`; `await worker.run()` loops until `worker.stop()` (or
 * `signal` aborts), `maxTurns` turns ran, or (`untilIdle`) a claim found
 * nothing. `body(turn)` resumes from `turn.payload` and `turn.journal`;
 * `turn.tool` returns the stored result of a call that already succeeded
 * and hands an `unknown` one to `reconcile`. Its return value completes
 * the turn; a throw fails it (retryable), goes to `onError`, and the
 * worker carries on.
 */
export class RecoveryWorker<R, P = unknown> {
  readonly #gate: Gate;
  readonly #body: (turn: Turn<P>) => Promise<R> | R;
  readonly #filter: OrphanFilter;
  readonly #drain: boolean;
  readonly #onError: (error: unknown, turnId: string) => void;
  readonly #stop = new AbortController();
  /** Claims that found a turn. */
  claims = 0;
  /** Turns run (claimed and handed off). */
  turns = 0;
  /** Bodies that threw. */
  errors = 0;

  constructor(gate: Gate, body: (turn: Turn<P>) => Promise<R> | R, options: RecoveryOptions = {}) {
    this.#gate = gate;
    this.#body = body;
    this.#filter = {
      minOrphanedMs: options.minOrphanedMs ?? RECOVERY_MIN_ORPHANED_MS,
      ...(options.userIds === undefined ? {} : { userIds: options.userIds }),
      ...(options.turnIds === undefined ? {} : { turnIds: options.turnIds }),
    };
    this.#drain = options.drain ?? true;
    this.#onError = options.onError ?? ((error, turnId) => console.error(`agentgate recovery: turn ${turnId} failed in its body`, error));
    if (options.signal?.aborted) this.stop();
    options.signal?.addEventListener("abort", () => this.stop(), { once: true });
  }

  /** Stop after the turn in hand (it ends without a handoff; what is queued stays for another worker). */
  stop(): void {
    this.#stop.abort();
  }

  get stopping(): boolean {
    return this.#stop.signal.aborted;
  }

  /**
   * One claim and the drain of its session: what each turn came to (a body
   * that threw as its turn's state, `failed`); `[]` when there was nothing
   * to claim. Claim refusals reject.
   */
  async runOnce(maxTurns: number = DRAIN_MAX_TURNS): Promise<TurnOutcome<R>[]> {
    const outcomes: TurnOutcome<R>[] = [];
    let inHand: Turn<unknown> | undefined;
    try {
      await this.#gate.recover(this.#filter, this.#body, {
        maxTurns: this.#drain ? maxTurns : 1,
        signal: this.#stop.signal,
        outcomes,
        onTurn: (turn) => {
          if (inHand === undefined) this.claims += 1;
          inHand = turn;
        },
      });
    } catch (error) {
      if (inHand === undefined) throw error; // the claim itself
      const failed: Turn<unknown> = inHand;
      outcomes.push({ turnId: failed.turnId, state: failed.endedState ?? "running", replayed: false, value: undefined, partial: undefined, turn: undefined });
      this.errors += 1;
      this.#onError(error, failed.turnId);
    } finally {
      this.turns += outcomes.length;
    }
    return outcomes;
  }

  /** Claims and runs until stopped; resolves the number of turns run. */
  async run(options: RecoveryRun = {}): Promise<number> {
    let ran = 0;
    let pauseMs = 0;
    while (!this.stopping) {
      const budget = options.maxTurns === undefined ? DRAIN_MAX_TURNS : Math.min(DRAIN_MAX_TURNS, options.maxTurns - ran);
      let outcomes: TurnOutcome<R>[];
      try {
        outcomes = await this.runOnce(budget);
      } catch (error) {
        if (!(error instanceof AgentgateError && RECOVERY_WAITABLE_CODES.has(error.code))) throw error;
        outcomes = [];
      }
      if (outcomes.length > 0) {
        ran += outcomes.length;
        pauseMs = 0;
        if (options.maxTurns !== undefined && ran >= options.maxTurns) break;
        continue;
      }
      if (options.untilIdle === true) break;
      pauseMs = pauseMs === 0 ? RECOVERY_IDLE_MIN_MS : Math.min(RECOVERY_IDLE_MAX_MS, pauseMs * 2);
      await pause(pauseMs * (0.5 + Math.random() / 2), this.#stop.signal);
    }
    return ran;
  }
}
