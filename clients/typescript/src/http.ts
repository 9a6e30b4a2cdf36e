/**
 * One HTTP exchange with the server: JSON in, JSON out, an error answer
 * turned into its typed error. Knows the wire (headers, statuses), nothing
 * of turns. Uses the runtime's global `fetch`; no dependencies.
 */

import { AgentgateError, TransportError, UnexpectedResponse, errorFromResponse } from "./errors.js";

/** The server bounds each request at 30 s (then 503); a little more than that, so its answer wins. */
export const DEFAULT_REQUEST_TIMEOUT_MS = 35_000;

export interface HttpOptions {
  /** The server, e.g. `http://127.0.0.1:7700`. */
  baseUrl: string;
  /** Sent as `Authorization: Bearer <apiKey>` when the server has `--api-key`. */
  apiKey?: string | undefined;
  /** Per request, including the body; default {@link DEFAULT_REQUEST_TIMEOUT_MS}. */
  timeoutMs?: number | undefined;
  /** Another `fetch` (a test double, an instrumented one); default the global one. */
  fetch?: typeof fetch | undefined;
}

export interface Answer<T> {
  status: number;
  body: T;
}

export class Http {
  readonly #baseUrl: string;
  readonly #apiKey: string | undefined;
  readonly #timeoutMs: number;
  readonly #fetch: typeof fetch;

  constructor(options: HttpOptions) {
    if (typeof options.baseUrl !== "string" || !/^https?:\/\//.test(options.baseUrl)) {
      throw new TypeError(`baseUrl must be an http(s) URL, got ${String(options.baseUrl)}`);
    }
    const timeoutMs = options.timeoutMs ?? DEFAULT_REQUEST_TIMEOUT_MS;
    if (!(Number.isFinite(timeoutMs) && timeoutMs > 0)) throw new RangeError(`timeoutMs must be > 0, got ${timeoutMs}`);
    this.#baseUrl = options.baseUrl.replace(/\/+$/, "");
    this.#apiKey = options.apiKey;
    this.#timeoutMs = timeoutMs;
    const fetchFunction = options.fetch ?? globalThis.fetch;
    if (typeof fetchFunction !== "function") throw new TypeError("no global fetch: use Node 20+ or pass options.fetch");
    this.#fetch = fetchFunction;
  }

  /**
   * Sends one request. Resolves with any 2xx answer (a 204's body is
   * `undefined`); rejects with the typed {@link AgentgateError} of an error
   * answer, {@link TransportError} when no answer came, or
   * {@link UnexpectedResponse} for an answer that is not JSON.
   */
  /** The server this client talks to, without a trailing slash. */
  get baseUrl(): string {
    return this.#baseUrl;
  }

  /**
   * Opens a `GET` whose answer is a stream (Server-Sent Events) on
   * `baseUrl` (this server, or another node sharing its store). Resolves
   * the 200 response with its body unread; rejects with the typed error of
   * any other answer, or {@link TransportError} when none came. No time
   * bound of its own: `signal` ends it (the caller times reads out).
   */
  async openStream(baseUrl: string, path: string, headers: Record<string, string>, signal: AbortSignal): Promise<Response> {
    const all: Record<string, string> = { accept: "text/event-stream", ...headers };
    if (this.#apiKey !== undefined) all.authorization = `Bearer ${this.#apiKey}`;
    let response: Response;
    try {
      response = await this.#fetch(baseUrl.replace(/\/+$/, "") + path, { method: "GET", headers: all, signal });
    } catch (error) {
      throw new TransportError(`GET ${path}: no answer (${describe(error)})`, error);
    }
    if (response.status === 200 && response.body !== null) return response;
    let parsed: unknown;
    try {
      const text = await response.text();
      parsed = text.length > 0 ? JSON.parse(text) : undefined;
    } catch {
      parsed = undefined;
    }
    if (response.status >= 400) throw errorFromResponse(response.status, parsed, response.headers.get("retry-after"));
    throw new UnexpectedResponse(`GET ${path}: unexpected HTTP ${response.status} for an event stream`, response.status);
  }

  async send<T>(
    method: "GET" | "POST" | "PUT",
    path: string,
    options: { body?: unknown; leaseToken?: string; timeoutMs?: number } = {},
  ): Promise<Answer<T>> {
    const headers: Record<string, string> = { accept: "application/json" };
    if (this.#apiKey !== undefined) headers.authorization = `Bearer ${this.#apiKey}`;
    if (options.leaseToken !== undefined) headers["lease-token"] = options.leaseToken;
    let body: string | undefined;
    if ("body" in options) {
      headers["content-type"] = "application/json";
      body = JSON.stringify(options.body ?? null);
    }
    let response: Response;
    let text: string;
    try {
      response = await this.#fetch(this.#baseUrl + path, {
        method,
        headers,
        ...(body === undefined ? {} : { body }),
        signal: AbortSignal.timeout(options.timeoutMs ?? this.#timeoutMs),
      });
      text = await response.text();
    } catch (error) {
      throw new TransportError(`${method} ${path}: no answer (${describe(error)})`, error);
    }
    let parsed: unknown;
    if (text.length > 0) {
      try {
        parsed = JSON.parse(text);
      } catch {
        throw new UnexpectedResponse(`${method} ${path}: HTTP ${response.status} with a body that is not JSON`, response.status);
      }
    }
    if (response.status >= 400) throw errorFromResponse(response.status, parsed, response.headers.get("retry-after"));
    if (response.status < 200 || response.status > 299) {
      throw new UnexpectedResponse(`${method} ${path}: unexpected HTTP ${response.status}`, response.status);
    }
    return { status: response.status, body: parsed as T };
  }
}

/** A short description of anything thrown, for messages and for a failed turn's `error`. */
export function describe(error: unknown): string {
  if (error instanceof Error) return error.message === "" ? error.name : `${error.name}: ${error.message}`;
  return String(error);
}

export function isCode(error: unknown, codes: ReadonlySet<string>): error is AgentgateError {
  return error instanceof AgentgateError && codes.has(error.code);
}
