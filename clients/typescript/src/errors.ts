/**
 * Typed errors: one class per `error.code` the server sends (the
 * `ErrorCode` enum of its OpenAPI document, a superset of docs/http.md's
 * table), all deriving from {@link AgentgateError}. Match with
 * `instanceof` (`err instanceof SessionBusy`) or on `err.code`.
 *
 * The map from code to class is typed `Record<ErrorCode, …>`: a code added
 * to the server's document fails this package's build until it has a class.
 */

import type { components } from "./openapi.js";

export type ErrorCode = components["schemas"]["ErrorCode"];
export type ErrorDetail = components["schemas"]["ErrorDetail"];

/** Every error the server answered with, and the client's own few (see below). */
export class AgentgateError extends Error {
  /** The stable code to match on (`error.code` on the wire). */
  readonly code: ErrorCode | ClientErrorCode;
  /** The HTTP status, or 0 for an error that never got an answer. */
  readonly status: number;
  /**
   * How long to wait before repeating, from `retry_after_ms` (else the
   * `Retry-After` header): the time left on the lease or confirmation that
   * blocks you, on the store's clock; on a 503, when the server looks again.
   */
  readonly retryAfterMs: number | undefined;
  /** For `session_busy`, `request_in_flight`, `awaiting_confirmation`: the blocking turn. */
  readonly activeTurnId: string | undefined;
  /** For `tool_in_flight`: the execution running under the caller's own lease. */
  readonly executionId: string | undefined;
  /** For `tool_in_flight`: that execution's running attempt. */
  readonly attempt: number | undefined;

  constructor(
    code: ErrorCode | ClientErrorCode,
    message: string,
    options: {
      status?: number;
      retryAfterMs?: number | undefined;
      activeTurnId?: string | undefined;
      executionId?: string | undefined;
      attempt?: number | undefined;
      cause?: unknown;
    } = {},
  ) {
    super(message, options.cause === undefined ? undefined : { cause: options.cause });
    this.name = new.target.name;
    this.code = code;
    this.status = options.status ?? 0;
    this.retryAfterMs = options.retryAfterMs;
    this.activeTurnId = options.activeTurnId;
    this.executionId = options.executionId;
    this.attempt = options.attempt;
  }
}

export type AgentgateErrorOptions = ConstructorParameters<typeof AgentgateError>[2];

/** Base for the per-code classes: the code is fixed by the class. */
function codeClass<C extends ErrorCode>(code: C) {
  return class extends AgentgateError {
    static readonly code: C = code;
    declare readonly code: C;
    constructor(message: string, options?: AgentgateErrorOptions) {
      super(code, message, options);
    }
  };
}

/** 400: fix the request (malformed JSON, an id outside the limits, a missing `Lease-Token`). */
export class InvalidRequest extends codeClass("invalid_request") {}
/** 401: send `Authorization: Bearer <key>` (the `apiKey` option). */
export class Unauthorized extends codeClass("unauthorized") {}
/** 403: a browser page on another origin sent it. */
export class OriginNotAllowed extends codeClass("origin_not_allowed") {}
/** 403: the `Host` is not one the server answers to. */
export class HostNotAllowed extends codeClass("host_not_allowed") {}
/** 403: with `--user-header`, the request names another user than the header's. */
export class UserMismatch extends codeClass("user_mismatch") {}
/** 404: no such turn, session, execution or pending confirmation for this user. */
export class NotFound extends codeClass("not_found") {}
/** 405: the path exists, the method does not. */
export class MethodNotAllowed extends codeClass("method_not_allowed") {}
/** 408: the body did not arrive within 10 s of the headers; safe to send again. */
export class RequestTimeout extends codeClass("request_timeout") {}
/** 413: the body is over `--max-body-bytes`. */
export class PayloadTooLarge extends codeClass("payload_too_large") {}
/** 415: a JSON body without `Content-Type: application/json`. */
export class UnsupportedMediaType extends codeClass("unsupported_media_type") {}
/** 409: another turn holds the session (`activeTurnId`); wait `retryAfterMs` or tell the user. */
export class SessionBusy extends codeClass("session_busy") {}
/** 409: this very request runs elsewhere; repeat it later to get the replay or take it over. */
export class RequestInFlight extends codeClass("request_in_flight") {}
/** 409: the session waits for a person's answer to `activeTurnId`'s pending confirmation. */
export class AwaitingConfirmation extends codeClass("awaiting_confirmation") {}
/** 409: the confirmation names a turn whose pending confirmation expired; nothing was confirmed. */
export class ConfirmationExpired extends codeClass("confirmation_expired") {}
/** 409: the same tool call is running under this lease; wait and claim again. */
export class ToolInFlight extends codeClass("tool_in_flight") {}
/**
 * The turn was asked to stop (`gate.cancel`, or another message sent with
 * `onBusy: "interrupt"`): claim no more tools. The server answers a tool
 * claim with it (409); the client throws it itself (status 0) once a
 * heartbeat said `cancel_requested`, as `turn.signal`'s reason, from
 * `turn.tool` and `turn.checkCancelled()`, and from `gate.turn` for a turn
 * it ended `cancelled`.
 */
export class TurnCancelled extends codeClass("turn_cancelled") {}
/** 409: the turn was taken over, expired or ended: stop, nothing sent under this lease can change it. */
export class LeaseLost extends codeClass("lease_lost") {}
/** 409: a tool execution's outcome is unknown and must be settled first. */
export class UnknownToolOutcome extends codeClass("unknown_tool_outcome") {}
/** 422: the same `clientRequestId` with another payload: a bug in the caller. */
export class PayloadMismatch extends codeClass("payload_mismatch") {}
/** 422: the tool call failed too often; fail the turn. */
export class AttemptsExhausted extends codeClass("attempts_exhausted") {}
/** 429: the user runs `--max-turns-per-user` turns already; retry after `retryAfterMs`. */
export class UserAtCapacity extends codeClass("user_at_capacity") {}
/** 429: the session's queue holds 100 waiting messages (`on_busy: enqueue` or `supersede`); nothing was queued. */
export class QueueFull extends codeClass("queue_full") {}
/** A side effect the server runs itself (the reference app's) failed. */
export class EffectFailed extends codeClass("effect_failed") {}
/** 500: a server bug. */
export class Internal extends codeClass("internal") {}
/** 503: the store or the Redis lease layer is down; retry after `retryAfterMs` with backoff. */
export class StoreUnavailable extends codeClass("store_unavailable") {}
/** 503: the server is at `--max-connections`; retry after `retryAfterMs`. */
export class Overloaded extends codeClass("overloaded") {}

const CLASS_BY_CODE: Record<ErrorCode, new (message: string, options?: AgentgateErrorOptions) => AgentgateError> = {
  invalid_request: InvalidRequest,
  unauthorized: Unauthorized,
  origin_not_allowed: OriginNotAllowed,
  host_not_allowed: HostNotAllowed,
  user_mismatch: UserMismatch,
  not_found: NotFound,
  method_not_allowed: MethodNotAllowed,
  request_timeout: RequestTimeout,
  payload_too_large: PayloadTooLarge,
  unsupported_media_type: UnsupportedMediaType,
  session_busy: SessionBusy,
  request_in_flight: RequestInFlight,
  awaiting_confirmation: AwaitingConfirmation,
  confirmation_expired: ConfirmationExpired,
  tool_in_flight: ToolInFlight,
  turn_cancelled: TurnCancelled,
  lease_lost: LeaseLost,
  unknown_tool_outcome: UnknownToolOutcome,
  payload_mismatch: PayloadMismatch,
  attempts_exhausted: AttemptsExhausted,
  user_at_capacity: UserAtCapacity,
  queue_full: QueueFull,
  effect_failed: EffectFailed,
  internal: Internal,
  store_unavailable: StoreUnavailable,
  overloaded: Overloaded,
};

/** Every code the server may send, in the document's order. */
export const ERROR_CODES = Object.keys(CLASS_BY_CODE) as readonly ErrorCode[];

// ------------------------------------------------------------- client-side

/** Codes of errors this client raises itself, with no server answer behind them. */
export type ClientErrorCode = "transport" | "unexpected_response" | "turn_not_succeeded" | "queue_timeout";

/** Every {@link ClientErrorCode}: none of them is a code the server sends. */
export const CLIENT_ERROR_CODES: readonly ClientErrorCode[] = ["transport", "unexpected_response", "turn_not_succeeded", "queue_timeout"];

/** The request never got an HTTP answer: connection refused, reset, or `timeoutMs` passed. Its effect is unknown: repeat it with the same ids. */
export class TransportError extends AgentgateError {
  constructor(message: string, cause: unknown) {
    super("transport", message, { cause });
  }
}

/** An answer this client does not understand (a status or body the document does not allow). */
export class UnexpectedResponse extends AgentgateError {
  constructor(message: string, status: number) {
    super("unexpected_response", message, { status });
  }
}

/**
 * A begin replayed a turn that ended without a response: failed (not
 * retryable), awaiting or past a confirmation, or abandoned. `turn` is the
 * stored turn (its `state`, `error`, `pending`).
 */
export class TurnNotSucceeded extends AgentgateError {
  readonly turn: components["schemas"]["TurnDto"];
  constructor(turn: components["schemas"]["TurnDto"]) {
    super("turn_not_succeeded", `turn ${turn.turn_id} replayed in state ${turn.state}`, { status: 200 });
    this.turn = turn;
  }
}

/**
 * A queued message (`onBusy: "enqueue"` or `"supersede"`, or a session
 * default that queues) did not start within the caller's `waitMs`. The
 * client withdrew it (a cancel of a queued turn ends it `cancelled`), so it
 * never runs unobserved; a repeat of the request replays that. `withdrawn`
 * is `false` when the withdrawal itself failed: it may still be queued.
 */
export class QueueTimeout extends AgentgateError {
  readonly turnId: string;
  /** Its last reported position (1: next). */
  readonly position: number;
  readonly withdrawn: boolean;
  constructor(turnId: string, position: number, withdrawn: boolean) {
    const how = withdrawn ? "withdrawn (cancelled)" : "NOT withdrawn: it may still be queued";
    super("queue_timeout", `turn ${turnId} was still queued (position ${position}) when the wait ran out; ${how}`);
    this.turnId = turnId;
    this.position = position;
    this.withdrawn = withdrawn;
  }
}

/** The typed error for an error answer (status >= 400) with its body and headers. */
export function errorFromResponse(status: number, body: unknown, retryAfterHeader: string | null): AgentgateError {
  const detail = (body as { error?: Partial<ErrorDetail> } | null)?.error;
  const headerMs = retryAfterHeader !== null && /^\d+$/.test(retryAfterHeader) ? Number(retryAfterHeader) * 1000 : undefined;
  const retryAfterMs = typeof detail?.retry_after_ms === "number" ? detail.retry_after_ms : headerMs;
  const Class = detail?.code !== undefined ? CLASS_BY_CODE[detail.code] : undefined;
  if (Class === undefined || typeof detail?.message !== "string") {
    return new UnexpectedResponse(`HTTP ${status} without a known error body: ${JSON.stringify(body)?.slice(0, 200)}`, status);
  }
  return new Class(detail.message, {
    status,
    retryAfterMs,
    activeTurnId: detail.active_turn_id ?? undefined,
    executionId: detail.execution_id ?? undefined,
    attempt: detail.attempt ?? undefined,
  });
}
