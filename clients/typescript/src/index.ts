/**
 * `@agentgate/client`: the agentgate HTTP service from TypeScript or
 * JavaScript (ESM, the runtime's `fetch`, no dependencies).
 *
 * - `gate.ts`: {@link Gate} (`turn`, `run`, `drain`, `recover`, `follow`, `claimOrphan`, `cancel`, `setPolicy`, `releaseSession`) and {@link Turn} (`tool`, `emit`, `signal`, `partial`, `takeNext`, `endCancelled`).
 * - `events.ts`: a turn's events: the holder's buffer, the SSE parser, {@link Follower}.
 * - `recovery.ts`: {@link RecoveryWorker}.
 * - `errors.ts`: one error class per server error code, under `AgentgateError`.
 * - `http.ts`: one request and its answer; the only module that knows headers.
 * - `openapi.ts`: wire types GENERATED from the server's `/openapi.json` (`npm run gen`).
 */

export {
  Gate,
  Turn,
  DEFAULT_QUEUE_WAIT_MS,
  DEFAULT_TOOL_WAIT_MS,
  DRAIN_MAX_TURNS,
  MAX_BUSY_WAIT_MS,
  MAX_WAIT_ATTEMPTS,
  POLL_FIRST_MS,
  POLL_MAX_MS,
  type BusyPolicy,
  type ConfirmationDto,
  type Decision,
  type DrainOptions,
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
export {
  EVENT_BATCH_MAX,
  EVENT_BATCH_MAX_BYTES,
  EVENT_BUFFER_MAX,
  EVENT_BUFFER_MAX_BYTES,
  EVENT_FLUSH_INTERVAL_MS,
  EVENT_PROBE_IDLE_MS,
  FOLLOW_BACKOFF_MAX_MS,
  FOLLOW_BACKOFF_MIN_MS,
  FOLLOW_MAX_RECONNECTS,
  FOLLOW_READ_TIMEOUT_MS,
  MAX_EVENT_DATA_BYTES,
  RESERVED_EVENT_NAMES,
  Follower,
  SseParser,
  turnEvent,
  type FollowOptions,
  type SseEvent,
  type TurnEvent,
} from "./events.js";
export {
  RECOVERY_IDLE_MAX_MS,
  RECOVERY_IDLE_MIN_MS,
  RECOVERY_MIN_ORPHANED_MS,
  RecoveryWorker,
  type RecoveryOptions,
  type RecoveryRun,
} from "./recovery.js";
export * from "./errors.js";
export { DEFAULT_REQUEST_TIMEOUT_MS } from "./http.js";
export type { components, paths, JsonValue } from "./openapi.js";
