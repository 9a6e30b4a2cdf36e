// A turn's events: the SSE parser on its own; against the real server,
// emits are appended in batches, in order, before the ending; reserved and
// malformed events are refused before anything is sent; an append whose
// answer is lost is not appended twice; a follower cut five times at random
// byte offsets (by a proxy on its side) sees every event once, in order,
// and the ending, on one node and across two nodes sharing one store.

import assert from "node:assert/strict";
import { spawn } from "node:child_process";
import { setTimeout as delay } from "node:timers/promises";
import { after, before, test } from "node:test";
import { EVENT_BATCH_MAX, Gate, InvalidRequest, NotFound, SseParser, StoreUnavailable, TransportError, turnEvent } from "../dist/index.js";
import { AGENTGATE_BIN } from "../scripts/server.mjs";
import { startServer } from "./helpers.mjs";
import { seeded, startProxy } from "./proxy.mjs";

/** How many times the follower tests cut the stream, and where at most. */
const CUTS = 5;
const CUT_MAX_BYTES = 3000;
/** Bound on a live stream's bursts. */
const BURSTS_TIMEOUT_MS = 20_000;

let server;
let gate;
before(async () => {
  server = await startServer();
  gate = new Gate({ baseUrl: server.url });
});
after(async () => { await server?.stop(); });

const bytes = (text) => new TextEncoder().encode(text);
const parse = (...chunks) => {
  const parser = new SseParser();
  return chunks.flatMap((chunk) => parser.feed(typeof chunk === "string" ? bytes(chunk) : chunk));
};

test("SSE: multi-line data is joined with newlines; comments, unknown fields and data-less blocks dispatch nothing", () => {
  const stream = ": keep-alive\n\nretry: 10\n\nid: 7\nevent: token\ndata: line one\ndata:line two\ndata\nfoo: bar\n\n";
  assert.deepEqual(parse(stream), [{ id: "7", event: "token", data: "line one\nline two\n" }]);
});

test("SSE: lines end in CRLF, LF or CR, even split between reads, and UTF-8 split between reads survives", () => {
  const stream = "id: 1\r\nevent: a\r\ndata: x\r\n\r\nid: 2\revent: b\rdata: y\r\rid: 3\nevent: c\ndata: 中午吃粉\n\n";
  const expected = [{ id: "1", event: "a", data: "x" }, { id: "2", event: "b", data: "y" }, { id: "3", event: "c", data: "中午吃粉" }];
  assert.deepEqual(parse(stream), expected);
  const all = bytes(stream);
  assert.deepEqual(parse(...Array.from(all, (_, i) => all.subarray(i, i + 1))), expected, "byte by byte");
  assert.deepEqual(parse("data: x\r", "\n\r", "\n"), [{ id: null, event: "message", data: "x" }], "a CRLF split is one line end");
});

test("SSE: a cut-off event is never dispatched; a leading BOM is dropped; an error event throws its typed error", () => {
  const parser = new SseParser();
  assert.deepEqual(parser.feed(new Uint8Array([0xef, 0xbb, 0xbf, ...bytes("id: 1\nevent: token\ndata: {}\n")])), []);
  assert.deepEqual(parser.feed(bytes("\n")), [{ id: "1", event: "token", data: "{}" }]);
  assert.deepEqual(parser.feed(bytes('id: 2\nevent: token\ndata: {"cut')), []);
  assert.throws(() => turnEvent({ id: null, event: "error", data: '{"code":"store_unavailable","message":"down"}' }), StoreUnavailable);
  assert.equal(turnEvent({ id: null, event: "end", data: '{"state":"failed","attempt":2}' }).state, "failed");
});

/** A fetch that counts the events of each append it sends. */
function counting() {
  const batches = [];
  const counted = async (url, init) => {
    if (init?.method === "POST" && new URL(url).pathname.endsWith("/events")) batches.push(JSON.parse(init.body).events.length);
    return fetch(url, init);
  };
  return { batches, fetch: counted };
}

async function followAll(from, turnId, options) {
  const events = [];
  for await (const event of from.follow(turnId, options)) events.push(event);
  return events;
}

test("emitted events are appended in batches of at most 500, in order, and before the ending", async () => {
  const { batches, fetch: counted } = counting();
  const holder = new Gate({ baseUrl: server.url, fetch: counted });
  const count = 1234;
  let turnId;
  let lastEventId;
  await holder.turn({ userId: "batch-user", sessionId: "batch-session", clientRequestId: "msg-1", payload: null }, async (turn) => {
    turnId = turn.turnId;
    for (let i = 0; i < count; i++) turn.emit("token", { i });
    lastEventId = () => turn.lastEventId;
    return "done";
  });
  const events = await followAll(gate, turnId);
  assert.deepEqual(events.slice(0, -1).map((e) => [e.id, e.name, e.data]), Array.from({ length: count }, (_, i) => [i + 1, "token", { i }]));
  assert.deepEqual(events.at(-1), { id: null, name: "end", attempt: 1, data: { state: "succeeded", attempt: 1 }, state: "succeeded" });
  assert.equal(batches.reduce((a, b) => a + b, 0), count);
  assert.ok(Math.max(...batches) <= EVENT_BATCH_MAX && batches.length <= 10, `batches: ${batches}`);
  assert.equal(lastEventId(), count);
  console.log(`${count} events in ${batches.length} appends: ${batches}`);
});

test("reserved and malformed events are refused before anything is sent", async () => {
  const { batches, fetch: counted } = counting();
  const holder = new Gate({ baseUrl: server.url, fetch: counted });
  let turnId;
  await holder.turn({ userId: "refuse-user", sessionId: "refuse-session", clientRequestId: "msg-1", payload: null }, (turn) => {
    turnId = turn.turnId;
    for (const [name, data] of [["end", {}], ["error", {}], ["has space", {}], ["x".repeat(65), {}], ["token", { text: "a".repeat(64 * 1024) }], ["token", Number.NaN], ["token", { n: Infinity }], ["token", 1n]]) {
      assert.throws(() => turn.emit(name, data), InvalidRequest, `${name}`);
    }
    return "done";
  });
  assert.deepEqual(batches, []);
  assert.deepEqual((await followAll(gate, turnId)).map((e) => e.name), ["end"]);
});

test("an append whose answer is lost is found in the log and not appended again", async () => {
  const proxy = await startProxy(server.url);
  let turnId;
  try {
    const viaProxy = new Gate({ baseUrl: proxy.url });
    await viaProxy.turn({ userId: "lost-user", sessionId: "lost-session", clientRequestId: "msg-1", payload: null }, async (turn) => {
      turnId = turn.turnId;
      turn.emit("token", "a");
      assert.equal(await turn.flush(), 1);
      turn.emit("token", "b");
      turn.emit("token", "c");
      proxy.state.loseNextAppend = true; // the append lands; its answer does not
      assert.equal(await turn.flush(), 3);
      turn.emit("token", "d");
      return "done";
    });
    assert.equal(proxy.state.lostAnswers, 1);
  } finally {
    await proxy.close();
  }
  const events = await followAll(gate, turnId);
  assert.deepEqual(events.slice(0, -1).map((e) => [e.id, e.data]), [[1, "a"], [2, "b"], [3, "c"], [4, "d"]]);
});

/**
 * A holder emitting bursts of 10 events every 20 ms until `cut()` reports
 * CUTS cuts (and at least 200 events went out), then completing; a
 * follower through `followFrom` meanwhile. Resolves what it saw.
 */
async function liveStream(sessionId, followFrom, cut, followOptions = {}) {
  const emitted = [];
  let seen;
  let follower;
  await gate.turn({ userId: "follow-user", sessionId, clientRequestId: "msg-1", payload: null }, async (turn) => {
    follower = followFrom.follow(turn.turnId, followOptions);
    seen = (async () => { const all = []; for await (const event of follower) all.push(event); return all; })();
    const deadline = Date.now() + BURSTS_TIMEOUT_MS;
    while ((cut() < CUTS || emitted.length < 200) && Date.now() < deadline) {
      for (let i = 0; i < 10; i++) {
        const data = { i: emitted.length, text: "tok".repeat(1 + Math.floor(Math.random() * 20)) };
        emitted.push(data);
        turn.emit("token", data);
      }
      await delay(20);
    }
    return { events: emitted.length };
  });
  return { emitted, seen: await seen, follower };
}

test("a follower cut five times at random points sees every event once, in order, and the end", async () => {
  const seed = Math.floor(Math.random() * 2 ** 32);
  console.log(`seed ${seed}`);
  const proxy = await startProxy(server.url, { cuts: CUTS, maxBytes: CUT_MAX_BYTES, random: seeded(seed) });
  try {
    const { emitted, seen, follower } = await liveStream("cut-session", new Gate({ baseUrl: proxy.url }), () => proxy.cuts);
    assert.equal(proxy.cuts, CUTS, `the stream was cut ${proxy.cuts} times`);
    assert.equal(follower.reconnects, CUTS);
    assert.deepEqual(seen.slice(0, -1).map((e) => e.id), Array.from({ length: emitted.length }, (_, i) => i + 1), "every event once, in order");
    assert.deepEqual(seen.slice(0, -1).map((e) => e.data), emitted);
    assert.equal(seen.at(-1).state, "succeeded");
    console.log(`${emitted.length} events, cut after ${proxy.state.cutAfter} bytes`);
  } finally {
    await proxy.close();
  }
});

/** A second `agentgate serve` on `server`'s store: another node. */
async function secondNode() {
  const child = spawn(AGENTGATE_BIN, ["serve", "--listen", "127.0.0.1:0", "--no-app", "--store", server.store], {
    stdio: ["ignore", "pipe", "ignore"],
  });
  const url = await new Promise((resolve, reject) => {
    let out = "";
    const timer = setTimeout(() => reject(new Error("the second node printed no address")), 15_000);
    child.stdout.on("data", (chunk) => {
      out += chunk;
      const match = /listening on (\S+)/.exec(out);
      if (match) { clearTimeout(timer); resolve(`http://${match[1]}`); }
    });
    child.once("exit", (code) => { clearTimeout(timer); reject(new Error(`the second node exited ${code}`)); });
  });
  const exited = new Promise((resolve) => child.once("exit", resolve));
  return { url, async stop() { child.kill("SIGKILL"); await exited; } };
}

test("a follower cut five times resumes on either of two nodes sharing the store: every event once, in order, and the end", async () => {
  const nodeB = await secondNode();
  const seed = Math.floor(Math.random() * 2 ** 32);
  console.log(`seed ${seed}`);
  const random = seeded(seed);
  // Five cuts between them: three on A's side, two on B's.
  const proxies = [await startProxy(server.url, { cuts: 3, maxBytes: CUT_MAX_BYTES, random }), await startProxy(nodeB.url, { cuts: 2, maxBytes: CUT_MAX_BYTES, random })];
  try {
    const { emitted, seen, follower } = await liveStream("nodes-session", gate, () => proxies[0].cuts + proxies[1].cuts, { baseUrls: proxies.map((p) => p.url) });
    assert.deepEqual(proxies.map((p) => p.cuts), [3, 2]);
    assert.equal(follower.reconnects, CUTS);
    assert.deepEqual(seen.slice(0, -1).map((e) => [e.id, e.data]), emitted.map((data, i) => [i + 1, data]));
    assert.equal(seen.at(-1).state, "succeeded");
  } finally {
    for (const proxy of proxies) await proxy.close();
    await nodeB.stop();
  }
});

test("a follower of a missing turn rejects with NotFound at once; one of a dead node gives up after its reconnects", async () => {
  await assert.rejects(followAll(gate, "turn_does_not_exist"), NotFound);
  let turnId;
  await gate.turn({ userId: "dead-user", sessionId: "dead-session", clientRequestId: "msg-1", payload: null }, (turn) => {
    turnId = turn.turnId;
    for (let i = 0; i < 5; i++) turn.emit("token", i);
    return "done";
  });
  assert.deepEqual((await followAll(gate, turnId, { after: 3 })).map((e) => e.id), [4, 5, null]);
  const started = Date.now();
  await assert.rejects(followAll(gate, turnId, { baseUrls: ["http://127.0.0.1:9"], maxReconnects: 3 }), TransportError);
  assert.ok(Date.now() - started < BURSTS_TIMEOUT_MS);
});

test("breaking out of a follow, or aborting its signal, stops it", async () => {
  let turnId;
  const controller = new AbortController();
  const seen = [];
  await gate.turn({ userId: "break-user", sessionId: "break-session", clientRequestId: "msg-1", payload: null }, async (turn) => {
    turnId = turn.turnId;
    turn.emit("token", 1);
    await turn.flush();
    for await (const event of gate.follow(turnId)) { seen.push(event.id); break; }
    const stopped = followAll(gate, turnId, { signal: controller.signal });
    await delay(100);
    controller.abort();
    assert.deepEqual((await stopped).map((e) => e.id), [1], "the aborted follower ended quietly before the end");
    return "done";
  });
  assert.deepEqual(seen, [1]);
});
