// Shared by the chat page and the dashboard: JSON calls, server-sent events
// over a POST, the API key prompt, and a tiny DOM builder that only ever sets
// text (never HTML), so nothing a user typed can become markup.

const KEY_STORAGE = "agentgate.api_key";

/** Builds an element: h("li", {class: "x", dataset: {a: 1}}, "text", child). */
export function h(tag, attrs = {}, ...children) {
  const el = document.createElement(tag);
  for (const [name, value] of Object.entries(attrs)) {
    if (value === undefined || value === null || value === false) continue;
    if (name === "class") el.className = value;
    else if (name === "dataset") Object.assign(el.dataset, value);
    // Through the CSSOM: the content security policy forbids style attributes.
    else if (name === "style") Object.assign(el.style, value);
    else if (name.startsWith("on")) el.addEventListener(name.slice(2), value);
    else if (value === true) el.setAttribute(name, "");
    else el.setAttribute(name, String(value));
  }
  for (const child of children.flat()) {
    if (child === undefined || child === null || child === false) continue;
    el.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
  return el;
}

function authHeaders() {
  const key = sessionStorage.getItem(KEY_STORAGE);
  return key ? { Authorization: `Bearer ${key}` } : {};
}

/** Asks once for the API key when the server wants one; true if given. */
function askForKey() {
  const key = window.prompt(
    "This agentgate server requires an API key (the one configured with --api-key):",
  );
  if (!key) return false;
  sessionStorage.setItem(KEY_STORAGE, key.trim());
  return true;
}

async function fetchWithKey(path, init) {
  const send = () =>
    fetch(path, { ...init, headers: { ...(init.headers || {}), ...authHeaders() } });
  let response = await send();
  if (response.status === 401 && askForKey()) response = await send();
  return response;
}

async function readJson(response) {
  const text = await response.text();
  try {
    return JSON.parse(text);
  } catch {
    return { error: { code: "bad_response", message: text.slice(0, 200) || response.statusText } };
  }
}

/** GET a JSON endpoint: {ok, status, body}. Network failures are status 0. */
export async function getJson(path) {
  try {
    const response = await fetchWithKey(path, { method: "GET", cache: "no-store" });
    return { ok: response.ok, status: response.status, body: await readJson(response) };
  } catch (error) {
    return { ok: false, status: 0, body: { error: { code: "network", message: String(error) } } };
  }
}

/** POSTs raw bytes (a file) to a JSON endpoint: {ok, status, body}. */
export async function postBytes(path, bytes) {
  try {
    const response = await fetchWithKey(path, {
      method: "POST",
      headers: { "Content-Type": "application/octet-stream" },
      body: bytes,
    });
    return { ok: response.ok, status: response.status, body: await readJson(response) };
  } catch (error) {
    return { ok: false, status: 0, body: { error: { code: "network", message: String(error) } } };
  }
}

/**
 * POSTs `body` to an endpoint that answers either a JSON error (a refusal,
 * before any stream starts), a JSON success without a stream (202: a
 * message queued behind a running reply) or a `text/event-stream`.
 * `onOpen()` runs when the stream is accepted, `onEvent(name, data)` per
 * event. Resolves to {ok, status, error?, ended, body?}: `ended` is false
 * when the stream broke off; `body` is the JSON of a success without a
 * stream.
 */
export async function postStream(path, body, { onOpen, onEvent, signal } = {}) {
  let response;
  try {
    response = await fetchWithKey(path, {
      method: "POST",
      headers: { "Content-Type": "application/json", Accept: "text/event-stream" },
      body: JSON.stringify(body),
      signal,
    });
  } catch (error) {
    return { ok: false, status: 0, error: { code: "network", message: String(error) } };
  }
  const type = response.headers.get("content-type") || "";
  if (response.ok && type.startsWith("application/json")) {
    return { ok: true, status: response.status, ended: true, body: await readJson(response) };
  }
  if (!response.ok || !type.startsWith("text/event-stream")) {
    const parsed = await readJson(response);
    return {
      ok: false,
      status: response.status,
      error: parsed.error || { code: "bad_response", message: response.statusText },
    };
  }
  if (onOpen) onOpen();
  return readEvents(response, onEvent);
}

/**
 * GETs a `text/event-stream` (a turn's event log), resuming after
 * `lastEventId` when given. `onEvent(name, data, id)` per event. Resolves
 * like postStream: {ok, status, error?, ended}; `ended` is false when the
 * stream broke off (resume with the last id seen).
 */
export async function getStream(path, { lastEventId, onEvent, signal } = {}) {
  let response;
  try {
    const headers = { Accept: "text/event-stream" };
    if (lastEventId) headers["Last-Event-ID"] = lastEventId;
    response = await fetchWithKey(path, { method: "GET", cache: "no-store", headers, signal });
  } catch (error) {
    return { ok: false, status: 0, error: { code: "network", message: String(error) } };
  }
  const type = response.headers.get("content-type") || "";
  if (!response.ok || !type.startsWith("text/event-stream")) {
    const parsed = await readJson(response);
    return { ok: false, status: response.status, error: parsed.error || { code: "bad_response", message: response.statusText } };
  }
  return readEvents(response, onEvent);
}

/** Reads an event stream's blocks to its end, or until it breaks off. */
async function readEvents(response, onEvent) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  try {
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buffer += decoder.decode(value, { stream: true }).replace(/\r\n?/g, "\n");
      let cut;
      while ((cut = buffer.indexOf("\n\n")) >= 0) {
        const block = buffer.slice(0, cut);
        buffer = buffer.slice(cut + 2);
        dispatch(block, onEvent);
      }
    }
  } catch (error) {
    return { ok: true, status: response.status, ended: false, error: { code: "network", message: String(error) } };
  }
  return { ok: true, status: response.status, ended: true };
}

function dispatch(block, onEvent) {
  let name = "message";
  let id = null;
  const data = [];
  for (const line of block.split("\n")) {
    if (line.startsWith(":")) continue; // keep-alive comment
    const colon = line.indexOf(":");
    const field = colon < 0 ? line : line.slice(0, colon);
    const value = colon < 0 ? "" : line.slice(colon + 1).replace(/^ /, "");
    if (field === "event") name = value;
    else if (field === "data") data.push(value);
    else if (field === "id") id = value;
  }
  if (data.length === 0 || !onEvent) return;
  let parsed;
  try {
    parsed = JSON.parse(data.join("\n"));
  } catch (error) {
    console.error("bad event", name, error);
    return;
  }
  // A handler's own error is the page's, not the stream's: the stream goes on.
  try {
    onEvent(name, parsed, id);
  } catch (error) {
    console.error("event handler", name, error);
  }
}

/** A fresh id for a message or a confirmation answer. */
export function newId(prefix) {
  const uuid = globalThis.crypto && crypto.randomUUID
    ? crypto.randomUUID()
    : `${Date.now().toString(16)}-${Math.random().toString(16).slice(2)}`;
  return `${prefix}-${uuid}`;
}

/**
 * Money from integer cents, the one way the app writes an amount: two
 * decimals, no grouping, "6999.00" — exactly as the server writes it in
 * replies and entries (`format_cents`), so the same amount never reads two
 * ways on one page. `type` "income" adds "+", "expense" adds "−".
 */
export function money(cents, type) {
  const abs = Math.abs(cents);
  const text = `${Math.floor(abs / 100)}.${String(abs % 100).padStart(2, "0")}`;
  if (type === "income") return `+${text}`;
  if (type === "expense") return `−${text}`;
  return cents < 0 ? `-${text}` : text;
}

/** A store-clock time in ms as local time. */
export function clock(ms) {
  if (!ms) return "";
  const date = new Date(ms);
  const sameDay = new Date().toDateString() === date.toDateString();
  return sameDay
    ? date.toLocaleTimeString([], { hour: "2-digit", minute: "2-digit", second: "2-digit" })
    : date.toLocaleString([], { month: "short", day: "numeric", hour: "2-digit", minute: "2-digit" });
}

/** Replaces an element's children. */
export function fill(el, ...children) {
  el.replaceChildren(...children.flat().filter((c) => c !== null && c !== undefined && c !== false));
}
