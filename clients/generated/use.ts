// Type-checked (tsc --noEmit, by check.sh) against the types openapi-typescript
// generates from the served /openapi.json, copied beside this file as
// openapi.ts. It names the fields a client reads and writes in a turn, so a
// renamed or removed field, or one that loses its type, fails the check.
import type { components, paths } from "./openapi.js";

type Schemas = components["schemas"];

export const beginRequest: Schemas["BeginRequest"] = {
  user_id: "alice",
  session_id: "chat-1",
  client_request_id: "msg-1",
  payload: { text: "taxi 18 yesterday" },
};

// @ts-expect-error a begin refuses unknown fields (additionalProperties: false)
export const beginWithUnknownField: Schemas["BeginRequest"] = { ...beginRequest, tenant: "x" };

// @ts-expect-error client_request_id is required
export const beginWithoutRequestId: Schemas["BeginRequest"] = { user_id: "alice", session_id: "chat-1" };

type Operation<P extends keyof paths, M extends keyof paths[P]> = paths[P][M];
type BeginResponses = Operation<"/v1/turns", "post"> extends { responses: infer R } ? R : never;
type Json<R> = R extends { content: { "application/json": infer B } } ? B : never;

export function granted(response: Json<BeginResponses[201]>): {
  turnId: string;
  leaseToken: string;
  fence: number;
  attempt: number;
  takeover: boolean;
  heartbeatEveryMs: number;
} {
  const turn: Schemas["GrantDto"] = response.turn;
  const state: Schemas["TurnStateDto"] = turn.state;
  if (state !== "running") throw new Error(`a grant is running, not ${state}`);
  return {
    turnId: turn.turn_id,
    leaseToken: turn.lease_token,
    fence: turn.fence,
    attempt: turn.attempt,
    takeover: turn.takeover,
    heartbeatEveryMs: turn.lease_expires_in_ms / 3,
  };
}

export function replayed(response: Json<BeginResponses[200]>): unknown {
  const replay: boolean = response.replay;
  return replay ? response.turn.response : undefined;
}

export function refused(response: Json<BeginResponses[409]>): [Schemas["ErrorCode"], number | null | undefined] {
  const code = response.error.code;
  if (code === "session_busy" || code === "request_in_flight" || code === "awaiting_confirmation") {
    return [code, response.error.retry_after_ms];
  }
  return [code, null];
}

export const claimRequest: Schemas["ClaimToolRequest"] = {
  tool: "create_transaction",
  args: { type: "expense", amount: 18, category_name: "交通" },
};

type ClaimResponses = Operation<"/v1/turns/{turn_id}/tools", "post"> extends { responses: infer R } ? R : never;

export function mustRun(response: Json<ClaimResponses[201]>): {
  executionId: string;
  idempotencyKey: string;
  attempt: number;
  reconcile: boolean;
} {
  const previous: "failed" | "unknown" | null | undefined = response.execution.previous_outcome;
  return {
    executionId: response.execution.execution_id,
    idempotencyKey: response.execution.idempotency_key,
    attempt: response.execution.attempt,
    reconcile: previous === "unknown",
  };
}

export function cached(response: Json<ClaimResponses[200]>): unknown {
  const state: "succeeded" | "failed" | "running" = response.execution.state;
  return state === "succeeded" ? response.execution.result : undefined;
}

export const completeTool: Schemas["CompleteToolRequest"] = { result: { entry_id: 42 } };
export const completeTurn: Schemas["CompleteTurnRequest"] = { response: { text: "Booked 18 to 交通." } };
