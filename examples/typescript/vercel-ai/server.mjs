#!/usr/bin/env node
// A chat backend on the Vercel AI SDK whose replies run as agentgate turns.
//
//   POST /api/chat {sessionId, messageId, text}  -> 202 {turnId, state}
//        runs the message as a turn keyed by messageId (a double-sent
//        message replays, the model is not called twice), books one side
//        effect through turn.tool (a line in a ledger file, keyed by the
//        execution's idempotency key), streams the model's reply with
//        streamText and appends every text delta to the turn's event log
//        (turn.emit("delta", ...)), then completes the turn with the text.
//        It answers as soon as the turn has begun: the reply streams below.
//   GET  /api/chat/:turnId/stream                -> text/event-stream
//        proxies agentgate's GET /v1/turns/{id}/events, passing
//        Last-Event-ID through, so a reload (or a dropped connection) resumes
//        the reply after the last event it saw, on any node of this app.
//   GET  /                                       -> a small page using both
//
// The model is the AI SDK's MockLanguageModelV3 (from "ai/test") with a
// scripted reply streamed token by token with small delays: no provider, no
// network. Swap in a real one (e.g. openai("gpt-4o-mini")) in createModel.
//
//   AGENTGATE_URL=http://127.0.0.1:7700 PORT=3000 LEDGER=ledger.jsonl node server.mjs

import { appendFileSync, existsSync, readFileSync } from "node:fs";
import { createServer } from "node:http";
import { fileURLToPath } from "node:url";
import { Gate } from "agentgate-client";
import { simulateReadableStream, streamText } from "ai";
import { MockLanguageModelV3 } from "ai/test";

/** Pause between two streamed tokens of the mock model, so the stream is really a stream. */
export const TOKEN_DELAY_MS = 60;

/** The mock model's reply to `text`, token by token (what a test compares against). */
export function scriptedReply(text) {
  const words = `Booked "${text}" in the ledger. Anything else I can note for you today?`.split(" ");
  return words.map((word, index) => (index === 0 ? word : ` ${word}`));
}

/** The user message's text in an AI SDK (LanguageModelV3) prompt. */
function lastUserText(prompt) {
  const user = prompt.filter((message) => message.role === "user").at(-1);
  return (user?.content ?? []).filter((part) => part.type === "text").map((part) => part.text).join("");
}

/**
 * A provider-free stand-in for a real model: streams scriptedReply(text).
 * `model.doStreamCalls.length` counts the calls.
 */
export function createModel({ tokenDelayMs = TOKEN_DELAY_MS } = {}) {
  return new MockLanguageModelV3({
    doStream: async ({ prompt }) => {
      const tokens = scriptedReply(lastUserText(prompt));
      return {
        stream: simulateReadableStream({
          initialDelayInMs: tokenDelayMs,
          chunkDelayInMs: tokenDelayMs,
          chunks: [
            { type: "stream-start", warnings: [] },
            { type: "text-start", id: "t1" },
            ...tokens.map((delta) => ({ type: "text-delta", id: "t1", delta })),
            { type: "text-end", id: "t1" },
            {
              type: "finish",
              finishReason: { unified: "stop", raw: "stop" },
              usage: {
                inputTokens: { total: 1, noCache: 1, cacheRead: 0, cacheWrite: 0 },
                outputTokens: { total: tokens.length, text: tokens.length, reasoning: 0 },
              },
            },
          ],
        }),
      };
    },
  });
}

/** The downstream system the tool books into: one JSON line per booking, found by idempotency key. */
export class Ledger {
  constructor(path) { this.path = path; }
  book(entry) {
    appendFileSync(this.path, JSON.stringify(entry) + "\n");
    return entry;
  }
  entries() {
    if (!existsSync(this.path)) return [];
    return readFileSync(this.path, "utf8").split("\n").filter(Boolean).map((line) => JSON.parse(line));
  }
  find(key) {
    return this.entries().find((entry) => entry.key === key);
  }
}

const ID = /^[A-Za-z0-9_.:-]{1,128}$/;
const PAGE = fileURLToPath(new URL("./public/index.html", import.meta.url));

function sendJson(res, status, body) {
  res.writeHead(status, { "content-type": "application/json" });
  res.end(JSON.stringify(body));
}

async function readJson(req) {
  let body = "";
  for await (const chunk of req) {
    body += chunk;
    if (body.length > 64 * 1024) throw new Error("body too large");
  }
  return JSON.parse(body);
}

/**
 * Starts one node of the app. Several nodes may share one agentgate (and
 * one ledger): any of them streams any reply.
 * @returns {Promise<{ url: string, model: MockLanguageModelV3, ledger: Ledger, close: () => Promise<void> }>}
 */
export async function startApp({
  agentgateUrl,
  ledgerPath,
  port = 0,
  host = "127.0.0.1",
  userId = "demo-user", // in a real app: the signed-in user
  model = createModel(),
  log = (...args) => console.error(...args),
}) {
  const gate = new Gate({ baseUrl: agentgateUrl });
  const ledger = new Ledger(ledgerPath);

  // The turn's body: book once, then stream the model's reply into the turn's log.
  async function reply(turn, { sessionId, messageId, text }) {
    const booked = await turn.tool("book", { sessionId, messageId, text }, {
      run: (ctx) => ledger.book({ key: ctx.idempotencyKey, ...ctx.args }),
      // A worker died mid-booking (`unknown`): look before booking again.
      reconcile: (ctx) => ledger.find(ctx.idempotencyKey),
    });
    turn.emit("booked", { key: booked.key, text: booked.text });
    const result = streamText({ model, prompt: text, abortSignal: turn.signal });
    let reply = "";
    for await (const part of result.fullStream) {
      if (part.type === "text-delta") {
        reply += part.text;
        turn.emit("delta", part.text); // buffered; appended in batches of what arrived within 50 ms
        turn.partial = { text: reply }; // what a cancelled turn keeps
      } else if (part.type === "error") {
        throw part.error;
      }
    }
    return { text: reply }; // the rest of the events are appended before the completion
  }

  // Begins the turn and resolves as soon as it is known which turn answers
  // this message: {turnId, state} ("started", "running" elsewhere, "replayed").
  function send(message) {
    const request = { userId, sessionId: message.sessionId, clientRequestId: message.messageId, payload: { text: message.text } };
    return new Promise((resolve, reject) => {
      let answered = false;
      const answer = (value) => { answered = true; resolve(value); };
      gate.run(request, (turn) => {
        answer({ turnId: turn.turnId, state: "started" });
        return reply(turn, message);
      }).then(
        (outcome) => {
          if (!answered) answer({ turnId: outcome.turnId, state: outcome.replayed ? "replayed" : outcome.state });
        },
        (error) => {
          if (answered) {
            log(`turn of message ${message.messageId} ended with an error:`, error); // the stream says how it ended
          } else if (error.code === "request_in_flight" && error.activeTurnId) {
            // The same message is running now (a double-send, maybe on another node): follow that one.
            answer({ turnId: error.activeTurnId, state: "running" });
          } else {
            reject(error);
          }
        },
      );
    });
  }

  async function chat(req, res) {
    let message;
    try {
      message = await readJson(req);
    } catch {
      return sendJson(res, 400, { error: "a JSON body {sessionId, messageId, text} is required" });
    }
    const { sessionId, messageId, text } = message ?? {};
    if (!ID.test(sessionId ?? "") || !ID.test(messageId ?? "") || typeof text !== "string" || !text || text.length > 4000) {
      return sendJson(res, 400, { error: "sessionId and messageId are 1-128 of A-Z a-z 0-9 _ . : -, text is 1-4000 characters" });
    }
    try {
      sendJson(res, 202, await send({ sessionId, messageId, text }));
    } catch (error) {
      // session_busy (another message of this chat is still being answered), user_at_capacity, ...
      const status = error.status >= 400 && error.status < 500 ? error.status : 502;
      sendJson(res, status, { error: error.code ?? "error", message: error.message, activeTurnId: error.activeTurnId });
    }
  }

  // The reply's events, straight from agentgate: ids, names and data
  // unchanged, so the browser's Last-Event-ID is agentgate's.
  async function stream(req, res, turnId, url) {
    const after = req.headers["last-event-id"] ?? url.searchParams.get("lastEventId") ?? "";
    if (after && !/^\d{1,19}$/.test(after)) return sendJson(res, 400, { error: "Last-Event-ID is an event id" });
    const upstreamUrl = `${agentgateUrl}/v1/turns/${encodeURIComponent(turnId)}/events?user_id=${encodeURIComponent(userId)}`;
    const abort = new AbortController();
    res.on("close", () => abort.abort()); // the browser went away: stop reading upstream
    let upstream;
    try {
      upstream = await fetch(upstreamUrl, {
        headers: { accept: "text/event-stream", ...(after ? { "last-event-id": after } : {}) },
        signal: abort.signal,
      });
    } catch (error) {
      if (!res.destroyed) sendJson(res, 502, { error: "agentgate_unreachable", message: String(error) });
      return;
    }
    if (!upstream.ok) {
      res.writeHead(upstream.status, { "content-type": upstream.headers.get("content-type") ?? "application/json" });
      return res.end(await upstream.text().catch(() => ""));
    }
    res.writeHead(200, {
      "content-type": "text/event-stream",
      "cache-control": "no-cache, no-transform",
      "x-accel-buffering": "no", // a buffering proxy in front would hold the tokens back
    });
    res.flushHeaders();
    try {
      for await (const chunk of upstream.body) res.write(chunk);
    } catch {
      // Cut (the browser left, or agentgate closed without `end`): the
      // browser reconnects with Last-Event-ID and gets the rest.
    }
    res.end();
  }

  const server = createServer((req, res) => {
    const url = new URL(req.url, "http://app");
    const streamRoute = /^\/api\/chat\/([^/]+)\/stream$/.exec(url.pathname);
    let handled;
    if (req.method === "POST" && url.pathname === "/api/chat") handled = chat(req, res);
    else if (req.method === "GET" && streamRoute && ID.test(decodeURIComponent(streamRoute[1]))) {
      handled = stream(req, res, decodeURIComponent(streamRoute[1]), url);
    } else if (req.method === "GET" && url.pathname === "/") {
      res.writeHead(200, { "content-type": "text/html; charset=utf-8" });
      res.end(readFileSync(PAGE));
      return;
    } else {
      return sendJson(res, 404, { error: "not found" });
    }
    handled.catch((error) => {
      log("request failed:", error);
      if (!res.headersSent) sendJson(res, 500, { error: "internal" });
      else res.destroy();
    });
  });
  await new Promise((resolve, reject) => {
    server.once("error", reject);
    server.listen(port, host, resolve);
  });
  const address = server.address();
  return {
    url: `http://${address.address}:${address.port}`,
    model,
    ledger,
    async close() {
      server.closeAllConnections();
      await new Promise((resolve) => server.close(resolve));
    },
  };
}

if (process.argv[1] && fileURLToPath(import.meta.url) === process.argv[1]) {
  const app = await startApp({
    agentgateUrl: process.env.AGENTGATE_URL ?? "http://127.0.0.1:7700",
    ledgerPath: process.env.LEDGER ?? "ledger.jsonl",
    port: Number(process.env.PORT ?? 3000),
  });
  console.log(`listening on ${app.url}`);
  for (const signal of ["SIGINT", "SIGTERM"]) process.once(signal, () => app.close().then(() => process.exit(0)));
}
