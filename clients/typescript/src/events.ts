/**
 * A turn's events (docs/http.md, "A turn's events"): the holder's side
 * (checked, buffered, appended in bounded batches, in order) and the
 * follower's (Server-Sent Events parsed as the standard says, resumed with
 * `Last-Event-ID` after a dropped connection, on any node).
 *
 * The wire: `POST /v1/turns/{id}/events` under the lease; `GET
 * /v1/turns/{id}/events` is `text/event-stream`, each event `id: n` /
 * `event: name` / `data: {"attempt": a, "data": …}`, the last one `event:
 * end` with `data: {"state", "attempt"}` and no id. A stream that closes
 * without `end` was cut, not finished.
 */

import { AgentgateError, InvalidRequest, TransportError, UnexpectedResponse, errorFromResponse } from "./errors.js";
import type { Http } from "./http.js";
import type { components } from "./openapi.js";

type TurnState = components["schemas"]["TurnStateDto"];

/** The names the stream itself sends; an append naming either is refused. */
export const RESERVED_EVENT_NAMES: readonly string[] = ["end", "error"];
/** 1 to 64 of these characters: a name becomes an SSE `event:` line. */
const EVENT_NAME = /^[A-Za-z0-9_.:-]{1,64}$/;
/** One event's data as JSON (the server's `MAX_EVENT_DATA_BYTES`, measured canonically). */
export const MAX_EVENT_DATA_BYTES = 64 * 1024;
/** Events in one append (the server's `MAX_EVENT_BATCH`). */
export const EVENT_BATCH_MAX = 500;
/** Data bytes in one append: well under the server's default 1 MiB body, with room for the JSON around it. */
export const EVENT_BATCH_MAX_BYTES = 512 * 1024;
/** How long an emitted event waits for others to share its append: short, a follower is waiting. */
export const EVENT_FLUSH_INTERVAL_MS = 50;
/**
 * Unsent events (and their bytes) a holder keeps at most: past either,
 * `turn.emit` throws `RangeError` until an append made room. Await
 * `turn.flush()` in a tight loop to go no faster than the server.
 */
export const EVENT_BUFFER_MAX = 5000;
export const EVENT_BUFFER_MAX_BYTES = 4 * 1024 * 1024;
/**
 * After an append whose answer was lost, how long the check of whether it
 * landed waits for the turn's stored events: the server sends them at
 * once when a stream opens, and nothing while none follow.
 */
export const EVENT_PROBE_IDLE_MS = 2000;
/** A follower's idle bound: the server sends a comment every 15 s on a quiet stream, so three missed mean a dead connection. */
export const FOLLOW_READ_TIMEOUT_MS = 45_000;
/** Reconnects in a row without a new event before a follower gives up; each event received starts the count over. */
export const FOLLOW_MAX_RECONNECTS = 8;
/** The pause before the n-th reconnect in a row: from the first, doubling, up to the longest. */
export const FOLLOW_BACKOFF_MIN_MS = 50;
export const FOLLOW_BACKOFF_MAX_MS = 5000;
/** Answers to a follow request worth reconnecting after. */
const FOLLOW_WAITABLE_CODES: ReadonlySet<string> = new Set(["store_unavailable", "overloaded", "request_timeout", "internal", "transport"]);

/**
 * One event of a turn as a follower sees it. `attempt` is the attempt of
 * the holder that appended it (a new one: a takeover started the reply
 * over). The last event is the ending: `name: "end"`, `id: null`, `state`
 * (how the turn ended) and `data: { state, attempt }`.
 */
export interface TurnEvent {
  id: number | null;
  name: string;
  attempt: number;
  data: unknown;
  /** For the `end` event: how the turn ended. */
  state?: TurnState;
}

const encoder = new TextEncoder();

/**
 * Sorted keys, as canonical JSON has them: the size the server measures,
 * near enough. Throws on what JSON has no spelling for (NaN, infinities,
 * a BigInt) instead of writing `null` for it.
 */
function canonical(value: unknown): string | undefined {
  return JSON.stringify(value, (_key, inner: unknown) => {
    if (typeof inner === "number" && !Number.isFinite(inner)) throw new TypeError(`${inner} is not a JSON number`);
    if (inner === null || typeof inner !== "object" || Array.isArray(inner)) return inner;
    const sorted: Record<string, unknown> = {};
    for (const key of Object.keys(inner).sort()) sorted[key] = (inner as Record<string, unknown>)[key];
    return sorted;
  });
}

/**
 * Checks one event before it is buffered; its data's size in bytes.
 * Throws {@link InvalidRequest} (nothing sent) for a reserved or malformed
 * name, data that is not JSON, or data over {@link MAX_EVENT_DATA_BYTES}.
 */
export function checkedEvent(name: string, data: unknown): number {
  if (typeof name !== "string" || !EVENT_NAME.test(name)) {
    throw new InvalidRequest(`an event name is 1-64 of A-Z a-z 0-9 _ - . : (got ${JSON.stringify(name)})`);
  }
  if (RESERVED_EVENT_NAMES.includes(name)) {
    throw new InvalidRequest(`event name ${JSON.stringify(name)} is reserved: the stream itself sends end and error`);
  }
  let text: string | undefined;
  try {
    text = canonical(data === undefined ? null : data);
  } catch (error) {
    throw new InvalidRequest(`event ${name}: its data is not JSON (${String(error)})`);
  }
  if (text === undefined) throw new InvalidRequest(`event ${name}: its data is not JSON`);
  const size = encoder.encode(text).length;
  if (size > MAX_EVENT_DATA_BYTES) throw new InvalidRequest(`event ${name}: its data is ${size} bytes, over ${MAX_EVENT_DATA_BYTES}`);
  return size;
}

/** One buffered event. */
export interface Pending {
  name: string;
  data: unknown;
  size: number;
}

/** Appends one batch: resolves its last id. `inDoubt`: an earlier send of it got no answer. */
export type AppendBatch = (batch: readonly Pending[], after: number | undefined, inDoubt: boolean) => Promise<number>;

/**
 * A turn's events not appended yet, and the timer that appends them: at
 * most {@link EVENT_FLUSH_INTERVAL_MS} after the first one waits, at once
 * when a batch is full, and before the ending (the turn calls `flush`).
 * One append at a time, so the log holds them in the order emitted.
 */
export class Emitter {
  readonly #append: AppendBatch;
  #events: Pending[] = [];
  #bytes = 0;
  #timer: ReturnType<typeof setTimeout> | undefined;
  /** The append in flight (and every one queued behind it): flushes chain on it. */
  #sending: Promise<void> = Promise.resolve();
  #inDoubt = false;
  /** A background append's failure, thrown by the next `emit`. */
  #error: unknown;
  #closed = false;
  lastEventId: number | undefined;

  constructor(append: AppendBatch) {
    this.#append = append;
  }

  emit(name: string, data: unknown, size: number): void {
    if (this.#error !== undefined) {
      const error = this.#error;
      this.#error = undefined;
      throw error;
    }
    if (this.#events.length >= EVENT_BUFFER_MAX || this.#bytes >= EVENT_BUFFER_MAX_BYTES) {
      throw new RangeError(`${this.#events.length} events (${this.#bytes} bytes) wait to be appended: await turn.flush() first`);
    }
    this.#events.push({ name, data: data === undefined ? null : data, size });
    this.#bytes += size;
    if (this.#events.length >= EVENT_BATCH_MAX || this.#bytes >= EVENT_BATCH_MAX_BYTES) {
      this.#background(0);
    } else {
      this.#background(EVENT_FLUSH_INTERVAL_MS);
    }
  }

  #background(delayMs: number): void {
    if (this.#closed) return;
    if (this.#timer !== undefined) {
      if (delayMs > 0) return;
      clearTimeout(this.#timer);
    }
    this.#timer = setTimeout(() => {
      this.#timer = undefined;
      this.flush().catch((error: unknown) => {
        this.#error = error;
      });
    }, delayMs);
  }

  /** Appends everything buffered; resolves the last id this turn appended (`undefined` before the first). */
  flush(): Promise<number | undefined> {
    if (this.#timer !== undefined) {
      clearTimeout(this.#timer);
      this.#timer = undefined;
    }
    const run = this.#sending.then(() => this.#drain());
    this.#sending = run.then(
      () => undefined,
      () => undefined,
    );
    return run;
  }

  async #drain(): Promise<number | undefined> {
    while (this.#events.length > 0) {
      let count = 0;
      let size = 0;
      for (const event of this.#events) {
        if (count === EVENT_BATCH_MAX || (count > 0 && size + event.size > EVENT_BATCH_MAX_BYTES)) break;
        count += 1;
        size += event.size;
      }
      const batch = this.#events.slice(0, count);
      try {
        this.lastEventId = await this.#append(batch, this.lastEventId, this.#inDoubt);
        this.#inDoubt = false;
      } catch (error) {
        if (error instanceof AgentgateError && (error.code === "transport" || error.code === "store_unavailable" || error.code === "overloaded" || error.code === "request_timeout")) {
          this.#inDoubt = true;
        }
        if (error instanceof AgentgateError && error.code === "lease_lost") {
          this.#events = this.#events.slice(count);
          this.#bytes -= size;
        }
        throw error;
      }
      this.#events = this.#events.slice(count);
      this.#bytes -= size;
    }
    this.#error = undefined;
    return this.lastEventId;
  }

  /** After the ending: no more background appends. */
  close(): void {
    this.#closed = true;
    if (this.#timer !== undefined) clearTimeout(this.#timer);
    this.#timer = undefined;
  }
}

/** One dispatched Server-Sent Event: its own `id` field (`null` when it had none), its type, its data lines joined with `\n`. */
export interface SseEvent {
  id: string | null;
  event: string;
  data: string;
}

/**
 * Server-Sent Events, parsed as the HTML standard says: lines end in
 * CRLF, LF or CR (a CRLF split between two reads is one line end); `:`
 * lines are comments; `field: value` drops one space after the colon;
 * `data` lines accumulate, joined with `\n`; a blank line dispatches the
 * event (if it has data); a leading BOM is dropped; an event cut off by
 * the end of the stream is never dispatched.
 */
export class SseParser {
  readonly #decoder = new TextDecoder("utf-8", { ignoreBOM: false });
  #line = "";
  #afterCr = false;
  #data: string[] = [];
  #event = "";
  #id: string | null = null;

  /** The events that `chunk` completes, in order. */
  feed(chunk: Uint8Array): SseEvent[] {
    const text = this.#decoder.decode(chunk, { stream: true });
    const out: SseEvent[] = [];
    let start = 0;
    for (let index = 0; index < text.length; index++) {
      const char = text[index];
      if (char !== "\r" && char !== "\n") continue;
      if (char === "\n" && this.#afterCr && index === start) {
        // The LF of a CRLF whose CR ended the previous piece.
        this.#afterCr = false;
        start = index + 1;
        continue;
      }
      const line = this.#line + text.slice(start, index);
      this.#line = "";
      this.#afterCr = char === "\r";
      start = index + 1;
      const event = this.#lineDone(line);
      if (event !== undefined) out.push(event);
    }
    if (start < text.length) {
      this.#afterCr = false;
      this.#line += text.slice(start);
    }
    return out;
  }

  #lineDone(line: string): SseEvent | undefined {
    if (line === "") {
      const event = { id: this.#id, event: this.#event === "" ? "message" : this.#event, data: this.#data.join("\n") };
      const had = this.#data.length > 0;
      this.#data = [];
      this.#event = "";
      this.#id = null;
      return had ? event : undefined;
    }
    if (line.startsWith(":")) return undefined;
    const colon = line.indexOf(":");
    const field = colon < 0 ? line : line.slice(0, colon);
    let value = colon < 0 ? "" : line.slice(colon + 1);
    if (value.startsWith(" ")) value = value.slice(1);
    if (field === "data") this.#data.push(value);
    else if (field === "event") this.#event = value;
    else if (field === "id" && !value.includes("\0")) this.#id = value;
    return undefined;
  }
}

/** A dispatched SSE event as a {@link TurnEvent}; an `error` event throws its typed error. */
export function turnEvent(raw: SseEvent): TurnEvent {
  let body: unknown;
  try {
    body = JSON.parse(raw.data);
  } catch {
    throw new UnexpectedResponse(`event ${raw.event}: data is not JSON: ${raw.data.slice(0, 200)}`, 200);
  }
  if (raw.event === "error") throw errorFromResponse(200, { error: body }, null);
  const fields = body as { attempt?: unknown; data?: unknown; state?: unknown } | null;
  if (fields === null || typeof fields !== "object" || typeof fields.attempt !== "number") {
    throw new UnexpectedResponse(`event ${raw.event}: data without an attempt: ${raw.data.slice(0, 200)}`, 200);
  }
  if (raw.event === "end") {
    return { id: null, name: "end", attempt: fields.attempt, data: body, state: fields.state as TurnState };
  }
  if (raw.id === null || !/^\d+$/.test(raw.id)) throw new UnexpectedResponse(`event ${raw.event} without a numeric id`, 200);
  return { id: Number(raw.id), name: raw.event, attempt: fields.attempt, data: fields.data };
}

/** After an append whose answer was lost: this attempt's events read back past the last id known. The last id if the batch landed, `undefined` if not. */
export function landedCount(ours: readonly TurnEvent[], count: number): number | undefined {
  if (ours.length === 0) return undefined;
  const last = ours[ours.length - 1];
  if (ours.length !== count || last === undefined || last.id === null) {
    throw new UnexpectedResponse(`after a lost append of ${count} events, ${ours.length} of this attempt's were found`, 200);
  }
  return last.id;
}

export interface FollowOptions {
  /** Resume after this event id (0: from the first). */
  after?: number;
  /** Checks the turn's owner (`?user_id=`). */
  userId?: string;
  /** Nodes sharing the store, tried in turn on each reconnect (default: the gate's server). */
  baseUrls?: readonly string[];
  /** Reconnects in a row without a new event before giving up (default {@link FOLLOW_MAX_RECONNECTS}). */
  maxReconnects?: number;
  /** Stops following (the iteration ends quietly). */
  signal?: AbortSignal;
}

/**
 * A turn's events, from `gate.follow(turnId)`: `for await (const event of
 * follower)`, each once and in order, live while the turn runs, then the
 * `end`. A connection that drops, or closes without `end` (a stream lives
 * at most 30 minutes; a reader that stalls 30 s is cut off; no byte for
 * {@link FOLLOW_READ_TIMEOUT_MS} counts as dropped), is resumed after the
 * last id seen with `Last-Event-ID`, on the next of `baseUrls`, pausing
 * 50 ms doubling to 5 s; after `maxReconnects` in a row without a new
 * event the last error is thrown. An `error` event throws its typed error.
 */
export class Follower implements AsyncIterable<TurnEvent> {
  readonly #http: Http;
  readonly #path: string;
  readonly #urls: string[];
  readonly #max: number;
  readonly #signal: AbortSignal | undefined;
  #next = 0;
  #inARow = 0;
  /** The last event id seen: where a resume starts. */
  lastEventId: number;
  /** Connections that ended without `end` (cut, closed, refused). */
  reconnects = 0;
  /** The `end` event, once seen. */
  end: TurnEvent | undefined;

  /** @internal Built by `gate.follow`. */
  constructor(http: Http, turnId: string, options: FollowOptions) {
    const after = options.after ?? 0;
    if (!(Number.isInteger(after) && after >= 0)) throw new RangeError(`after must be an integer >= 0, got ${after}`);
    const max = options.maxReconnects ?? FOLLOW_MAX_RECONNECTS;
    if (!(Number.isInteger(max) && max >= 0)) throw new RangeError(`maxReconnects must be an integer >= 0, got ${max}`);
    const urls = [...(options.baseUrls ?? [http.baseUrl])].map((url) => url.replace(/\/+$/, ""));
    if (urls.length === 0) throw new RangeError("baseUrls must name at least one server");
    this.#http = http;
    const query = options.userId === undefined ? "" : `?user_id=${encodeURIComponent(options.userId)}`;
    this.#path = `/v1/turns/${encodeURIComponent(turnId)}/events${query}`;
    this.#urls = urls;
    this.#max = max;
    this.#signal = options.signal;
    this.lastEventId = after;
  }

  async *[Symbol.asyncIterator](): AsyncGenerator<TurnEvent, void, undefined> {
    let lastError: unknown;
    for (;;) {
      if (this.#signal?.aborted) return;
      const url = this.#urls[this.#next++ % this.#urls.length] as string;
      const stream = new AbortController();
      const stop = (): void => stream.abort();
      this.#signal?.addEventListener("abort", stop, { once: true });
      let idle: ReturnType<typeof setTimeout> | undefined;
      const arm = (): void => {
        if (idle !== undefined) clearTimeout(idle);
        idle = setTimeout(() => stream.abort(new TransportError(`no byte for ${FOLLOW_READ_TIMEOUT_MS} ms`, undefined)), FOLLOW_READ_TIMEOUT_MS);
      };
      let failure: unknown;
      let dropped: unknown = null;
      try {
        arm();
        const response = await this.#http.openStream(url, this.#path, { "last-event-id": String(this.lastEventId) }, stream.signal);
        const reader = (response.body as ReadableStream<Uint8Array>).getReader();
        const parser = new SseParser();
        try {
          reading: for (;;) {
            const { done, value } = await reader.read();
            if (done) break;
            arm();
            for (const raw of parser.feed(value)) {
              let event: TurnEvent;
              try {
                event = turnEvent(raw);
              } catch (error) {
                failure = error; // an `error` event: thrown, not resumed
                break reading;
              }
              if (event.name === "end") {
                this.end = event;
                yield event;
                return;
              }
              if ((event.id as number) <= this.lastEventId) continue;
              this.lastEventId = event.id as number;
              this.#inARow = 0;
              yield event;
            }
          }
        } finally {
          reader.cancel().catch(() => undefined);
        }
      } catch (error) {
        dropped = error instanceof AgentgateError ? error : new TransportError(`GET ${this.#path}: the stream broke`, error);
      } finally {
        if (idle !== undefined) clearTimeout(idle);
        this.#signal?.removeEventListener("abort", stop);
        stream.abort();
      }
      if (failure !== undefined) throw failure;
      if (this.#signal?.aborted) return;
      this.reconnects += 1;
      this.#inARow += 1;
      if (dropped !== null) {
        lastError = dropped;
        if (dropped instanceof AgentgateError && !FOLLOW_WAITABLE_CODES.has(dropped.code)) throw dropped;
      }
      if (this.#inARow > this.#max) {
        throw lastError ?? new UnexpectedResponse(`the event stream closed ${this.#inARow} times in a row without an event or its end`, 200);
      }
      await pause(Math.min(FOLLOW_BACKOFF_MAX_MS, FOLLOW_BACKOFF_MIN_MS * 2 ** (this.#inARow - 1)), this.#signal);
    }
  }
}

/** After an append whose answer was lost: this attempt's events in the log after `after` (until `count`, the end, or a quiet {@link EVENT_PROBE_IDLE_MS}); the batch's last id if it landed, `undefined` if not. */
export async function appendLanded(http: Http, turnId: string, after: number | undefined, attempt: number, count: number): Promise<number | undefined> {
  const ours: TurnEvent[] = [];
  const stream = new AbortController();
  let idle: ReturnType<typeof setTimeout> | undefined;
  const arm = (): void => {
    if (idle !== undefined) clearTimeout(idle);
    idle = setTimeout(() => stream.abort(), EVENT_PROBE_IDLE_MS);
  };
  try {
    arm();
    const path = `/v1/turns/${encodeURIComponent(turnId)}/events`;
    const response = await http.openStream(http.baseUrl, path, { "last-event-id": String(after ?? 0) }, stream.signal);
    const reader = (response.body as ReadableStream<Uint8Array>).getReader();
    const parser = new SseParser();
    try {
      reading: for (;;) {
        const { done, value } = await reader.read();
        if (done) break;
        arm();
        for (const raw of parser.feed(value)) {
          const event = turnEvent(raw);
          if (event.name === "end") break reading;
          if (event.attempt === attempt) ours.push(event);
          if (ours.length === count) break reading;
        }
      }
    } finally {
      reader.cancel().catch(() => undefined);
    }
  } catch (error) {
    if (!stream.signal.aborted) throw error;
  } finally {
    if (idle !== undefined) clearTimeout(idle);
    stream.abort();
  }
  return landedCount(ours, count);
}

/** Sleeps `ms`, or less if `signal` aborts. */
export function pause(ms: number, signal?: AbortSignal): Promise<void> {
  return new Promise((resolve) => {
    if (signal?.aborted) {
      resolve();
      return;
    }
    const done = (): void => {
      clearTimeout(timer);
      signal?.removeEventListener("abort", done);
      resolve();
    };
    const timer = setTimeout(done, Math.max(0, ms));
    signal?.addEventListener("abort", done, { once: true });
  });
}
