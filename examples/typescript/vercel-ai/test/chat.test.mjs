// The example against the real `agentgate serve` (AGENTGATE_BIN, else the
// checkout's target/debug/agentgate) on a temp SQLite store, with two nodes
// of the app on free ports sharing it and one ledger file.

import assert from "node:assert/strict";
import { join } from "node:path";
import { after, before, test } from "node:test";
import { startServer } from "../../../../clients/typescript/scripts/server.mjs";
import { scriptedReply, startApp } from "../server.mjs";

/** Each test's bound: a reply streams in about 1 s. */
const TEST_TIMEOUT_MS = 20_000;

let agentgate, nodeA, nodeB;

before(async () => {
  // The client suite's launcher: a fresh SQLite store in a temp dir of its
  // own (AGENTGATE_BIN, else the checkout's debug build), removed by stop().
  agentgate = await startServer();
  const ledgerPath = join(agentgate.dir, "ledger.jsonl");
  const log = () => {}; // a turn's errors show in its stream's `end`
  nodeA = await startApp({ agentgateUrl: agentgate.url, ledgerPath, log });
  nodeB = await startApp({ agentgateUrl: agentgate.url, ledgerPath, log });
});

after(async () => {
  await nodeA?.close();
  await nodeB?.close();
  await agentgate?.stop();
});

const modelCalls = () => nodeA.model.doStreamCalls.length + nodeB.model.doStreamCalls.length;

async function send(node, message) {
  const answer = await fetch(`${node.url}/api/chat`, {
    method: "POST",
    headers: { "content-type": "application/json" },
    body: JSON.stringify(message),
  });
  const body = await answer.json();
  assert.equal(answer.status, 202, JSON.stringify(body));
  return body;
}

/**
 * Reads a reply's SSE stream from a node: `onEvent({id, event, data})` for
 * each event until it returns true (then the connection is dropped) or the
 * stream ends.
 */
async function read(node, turnId, { lastEventId, until = () => false } = {}) {
  const abort = new AbortController();
  const answer = await fetch(`${node.url}/api/chat/${turnId}/stream`, {
    headers: lastEventId ? { "last-event-id": String(lastEventId) } : {},
    signal: abort.signal,
  });
  assert.equal(answer.status, 200);
  assert.match(answer.headers.get("content-type"), /^text\/event-stream/);
  const events = [];
  const decoder = new TextDecoder();
  let buffer = "";
  try {
    for await (const chunk of answer.body) {
      buffer += decoder.decode(chunk, { stream: true });
      let blank;
      while ((blank = buffer.indexOf("\n\n")) >= 0) {
        const block = buffer.slice(0, blank);
        buffer = buffer.slice(blank + 2);
        const event = { id: null, event: "message", data: "" };
        for (const line of block.split("\n")) {
          if (line.startsWith(":")) continue; // keep-alive comment
          const colon = line.indexOf(":");
          const [field, value] = [line.slice(0, colon), line.slice(colon + 1).replace(/^ /, "")];
          if (field === "id") event.id = Number(value);
          else if (field === "event") event.event = value;
          else if (field === "data") event.data += value;
        }
        if (!event.data) continue;
        event.data = JSON.parse(event.data);
        events.push(event);
        if (event.event === "end") return events;
        if (until(events)) {
          abort.abort(); // the page reloads: the connection drops mid-reply
          return events;
        }
      }
    }
  } catch (error) {
    if (!abort.signal.aborted) throw error;
  }
  return events;
}

const deltas = (events) => events.filter((e) => e.event === "delta").map((e) => e.data.data).join("");

test("a reload resumes the reply where it was, on another node: no duplicate, no gap", { timeout: TEST_TIMEOUT_MS }, async () => {
  const callsBefore = modelCalls();
  const { turnId, state } = await send(nodeA, { sessionId: "chat-1", messageId: "msg-1", text: "taxi 18" });
  assert.equal(state, "started");

  const first = await read(nodeA, turnId, { until: (events) => events.filter((e) => e.event === "delta").length >= 3 });
  const lastEventId = first.at(-1).id;
  assert.equal(first.at(-1).event, "delta");
  // The drop really happened mid-reply: the turn is still running.
  const { turn } = await (await fetch(`${agentgate.url}/v1/turns/${turnId}`)).json();
  assert.equal(turn.state, "running", "the reply ended before the reload; the test proves nothing");

  const rest = await read(nodeB, turnId, { lastEventId });
  const end = rest.at(-1);
  assert.equal(end.event, "end");
  assert.equal(end.data.state, "succeeded");

  const events = [...first, ...rest.slice(0, -1)];
  assert.deepEqual(events.map((e) => e.id), events.map((_, index) => index + 1), "event ids 1..n: none twice, none missing");
  assert.ok(rest.some((e) => e.event === "delta"), "the second connection carried part of the reply");
  const full = scriptedReply("taxi 18").join("");
  assert.equal(deltas(events), full);
  assert.equal(events.filter((e) => e.event === "booked").length, 1);

  // The turn completed with the same text, the model ran once, the ledger has the one booking.
  const { turn: ended } = await (await fetch(`${agentgate.url}/v1/turns/${turnId}`)).json();
  assert.deepEqual(ended.response, { text: full });
  assert.equal(modelCalls() - callsBefore, 1);
  assert.equal(nodeA.ledger.entries().filter((entry) => entry.messageId === "msg-1").length, 1);
});

test("a message sent twice at once, to two nodes, calls the model once and books once", { timeout: TEST_TIMEOUT_MS }, async () => {
  const callsBefore = modelCalls();
  const message = { sessionId: "chat-2", messageId: "msg-2", text: "lunch 35" };
  const [a, b] = await Promise.all([send(nodeA, message), send(nodeB, message)]);
  assert.equal(a.turnId, b.turnId, "both senders follow the same turn");
  assert.deepEqual([a.state, b.state].sort(), ["running", "started"]);

  const [streamA, streamB] = await Promise.all([read(nodeA, a.turnId), read(nodeB, b.turnId)]);
  const full = scriptedReply("lunch 35").join("");
  for (const events of [streamA, streamB]) {
    assert.deepEqual(events.at(-1), { id: null, event: "end", data: { state: "succeeded", attempt: 1 } });
    assert.equal(deltas(events), full);
  }

  // A third send, after the end, replays: same turn, no model call.
  const again = await send(nodeB, message);
  assert.deepEqual(again, { turnId: a.turnId, state: "replayed" });
  assert.equal(deltas(await read(nodeA, again.turnId)), full);

  assert.equal(modelCalls() - callsBefore, 1, "the model was called once");
  assert.equal(nodeA.ledger.entries().filter((entry) => entry.messageId === "msg-2").length, 1, "one line in the ledger");
});
