/**
 * `@agentgate/client`: the agentgate HTTP service from TypeScript or
 * JavaScript (ESM, the runtime's `fetch`, no dependencies).
 *
 * - `gate.ts`: {@link Gate} (`turn`, `run`, `claimOrphan`, `cancel`, `setPolicy`, `releaseSession`) and {@link Turn} (`tool`, `signal`, `partial`, `endCancelled`).
 * - `errors.ts`: one error class per server error code, under `AgentgateError`.
 * - `http.ts`: one request and its answer; the only module that knows headers.
 * - `openapi.ts`: wire types GENERATED from the server's `/openapi.json` (`npm run gen`).
 */

export {
  Gate,
  Turn,
  DEFAULT_QUEUE_WAIT_MS,
  DEFAULT_TOOL_WAIT_MS,
  MAX_BUSY_WAIT_MS,
  MAX_WAIT_ATTEMPTS,
  POLL_FIRST_MS,
  POLL_MAX_MS,
  type BusyPolicy,
  type ConfirmationDto,
  type Decision,
  type GateOptions,
  type GrantDto,
  type JournalEntry,
  type OrphanFilter,
  type OrphanResult,
  type PreviousOutcome,
  type SessionDto,
  type SessionPolicy,
  type ToolContext,
  type ToolOptions,
  type TurnDto,
  type TurnOutcome,
  type TurnRequest,
  type TurnState,
} from "./gate.js";
export * from "./errors.js";
export { DEFAULT_REQUEST_TIMEOUT_MS } from "./http.js";
export type { components, paths, JsonValue } from "./openapi.js";
