#!/usr/bin/env node
// A small agent loop on agentgate, offline: a scripted fake model reads the
// user's message, decides to call a booking tool, then answers. The booking
// goes through `turn.tool`, so a double-text, a retry or a crashed worker
// books once; the ledger is a JSON-lines file standing in for your system.
//
//   agentgate serve --no-app &        # prints: listening on 127.0.0.1:7700
//   node examples/typescript/agent-loop.mjs --url http://127.0.0.1:7700 \
//        --ledger /tmp/ledger.jsonl --message-id msg-1 "taxi 18 yesterday"
//
// Build the client first: clients/typescript/setup.sh. In your application:
// import { Gate } from "agentgate-client".

import { appendFileSync, existsSync, readFileSync } from "node:fs";
import { parseArgs } from "node:util";
import { Gate } from "../../clients/typescript/dist/index.js";

const { values: options, positionals } = parseArgs({
  allowPositionals: true,
  options: {
    url: { type: "string", default: process.env.AGENTGATE_URL ?? "http://127.0.0.1:7700" },
    ledger: { type: "string", default: "ledger.jsonl" },
    user: { type: "string", default: "alice" },
    session: { type: "string", default: "chat-1" },
    "message-id": { type: "string" },
    "think-ms": { type: "string", default: "300" },
    "wait-ms": { type: "string", default: "15000" },
  },
});
const text = positionals.join(" ") || "taxi 18 yesterday";
const messageId = options["message-id"] ?? `msg-${Date.now()}`;
const thinkMs = Number(options["think-ms"]);
/** A turn never runs more model rounds than this, whatever the model says. */
const MAX_ROUNDS = 4;

// ------------------------------------------------------------ the "model"

/** Scripted stand-in for an LLM: the first round calls a tool, the next answers. */
async function fakeModel(messages, signal) {
  await new Promise((resolve) => setTimeout(resolve, thinkMs));
  signal.throwIfAborted(); // a real model call would take the signal too
  const last = messages.at(-1);
  if (last.role === "tool") {
    const entry = JSON.parse(last.content);
    return { content: `Booked ${entry.amount} to ${entry.category} (entry ${entry.entry_id}).` };
  }
  const match = /([a-z]+)\D*(\d+(?:\.\d+)?)/i.exec(last.content);
  if (!match) return { content: "I could not find an amount in that." };
  return { toolCall: { name: "book_expense", args: { category: match[1].toLowerCase(), amount: Number(match[2]) } } };
}

// ------------------------------------------------------------ the "ledger"

function ledgerEntries() {
  if (!existsSync(options.ledger)) return [];
  return readFileSync(options.ledger, "utf8").split("\n").filter(Boolean).map((line) => JSON.parse(line));
}

const tools = {
  book_expense: {
    run: async ({ args, idempotencyKey }) => {
      const entry = { entry_id: ledgerEntries().length + 1, key: idempotencyKey, ...args };
      appendFileSync(options.ledger, JSON.stringify(entry) + "\n");
      return entry;
    },
    // A crashed worker may have booked it: look it up by the key first.
    reconcile: async ({ idempotencyKey }) => ledgerEntries().find((entry) => entry.key === idempotencyKey),
  },
};

// ------------------------------------------------------------ the loop

const gate = new Gate({ baseUrl: options.url, apiKey: process.env.AGENTGATE_API_KEY });
let ran = false;
const reply = await gate.turn(
  { userId: options.user, sessionId: options.session, clientRequestId: messageId, payload: { text }, waitMs: Number(options["wait-ms"]) },
  async (turn) => {
    ran = true;
    const messages = [{ role: "user", content: turn.payload.text }];
    for (let round = 0; round < MAX_ROUNDS; round++) {
      const answer = await fakeModel(messages, turn.signal);
      if (!answer.toolCall) return { text: answer.content };
      const { name, args } = answer.toolCall;
      const result = await turn.tool(name, args, tools[name]);
      messages.push({ role: "assistant", toolCall: answer.toolCall }, { role: "tool", content: JSON.stringify(result) });
    }
    return { text: "I gave up after too many steps." };
  },
);
console.log(JSON.stringify({ reply: reply.text, ran }));
