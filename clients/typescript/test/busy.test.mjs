// A second message on a busy session, against the real server: an
// interrupt aborts a holder's model call within one heartbeat interval and
// ends it cancelled; queued messages run in order; supersede, a session's
// default policy, cancel and a queue wait that runs out.

import assert from "node:assert/strict";
import { setTimeout as delay } from "node:timers/promises";
import { after, before, test } from "node:test";
import { Gate, QueueTimeout, TurnCancelled, TurnNotSucceeded } from "../dist/index.js";
import { deferred, startServer } from "./helpers.mjs";

/** The lease TTL here: a heartbeat every third of it. */
const LEASE_TTL_MS = 1500;
const HEARTBEAT_INTERVAL_MS = LEASE_TTL_MS / 3;
/** The simulated model call the holder is in when the interrupt comes. */
const MODEL_CALL_MS = 10_000;
/** Past one heartbeat interval: its round trip and the ending's scheduling on a loaded 2-core machine. */
const STOP_SLACK_MS = 500;

const PARTIAL = { text: "Booked the taxi; writing the reply", amount: 18.5, done: 0 };
/** What the server stores and replays of PARTIAL: canonical JSON (sorted keys). */
const PARTIAL_STORED_KEYS = ["amount", "done", "text"];

let server;
let gate;
before(async () => {
  server = await startServer({ leaseTtlMs: LEASE_TTL_MS });
  gate = new Gate({ baseUrl: server.url });
});
after(async () => { await server?.stop(); });

const never = () => assert.fail("a replayed message ran its body");

test("interrupt: a holder in a 10 s model call stops within one heartbeat interval, ends cancelled, its retry replays cancelled, the tool ran once", async () => {
  const ids = { userId: "int-user", sessionId: "int-session" };
  let executions = 0;
  const inModelCall = deferred();
  let stoppedAt;
  let toolRefusedAfterStop = false;
  const holder = gate.run({ ...ids, clientRequestId: "msg-1", payload: { text: "taxi 18" } }, async (turn) => {
    await turn.tool("book", { amount: 18 }, { run: async () => { executions += 1; return { booked: 18 }; } });
    turn.partial = PARTIAL;
    inModelCall.resolve();
    try {
      await delay(MODEL_CALL_MS, undefined, { signal: turn.signal }); // the model call
    } catch (error) {
      stoppedAt = Date.now();
      await turn.tool("book", { amount: 19 }, { run: async () => { executions += 1; } })
        .catch((refusal) => { toolRefusedAfterStop = refusal instanceof TurnCancelled; });
      throw error;
    }
    return "the whole reply";
  });
  await inModelCall.promise;
  const sentAt = Date.now();
  const second = await gate.run({ ...ids, clientRequestId: "msg-2", payload: { text: "no, taxi 28" }, onBusy: "interrupt", busyWaitMs: 10_000 }, () => "second");
  const first = await holder;

  assert.ok(stoppedAt - sentAt < HEARTBEAT_INTERVAL_MS + STOP_SLACK_MS, `stopped ${stoppedAt - sentAt} ms after the interrupt`);
  assert.equal(first.state, "cancelled");
  assert.equal(first.replayed, false);
  assert.deepEqual(first.partial, PARTIAL);
  assert.deepEqual([second.state, second.value], ["succeeded", "second"]);
  assert.equal(toolRefusedAfterStop, true, "a tool call after the stop was refused");
  const stored = (await gate.getTurn(first.turnId)).turn;
  assert.deepEqual([stored.state, stored.attempt], ["cancelled", 1]);
  assert.deepEqual(Object.keys(stored.response), PARTIAL_STORED_KEYS);

  const retry = await gate.run({ ...ids, clientRequestId: "msg-1", payload: { text: "taxi 18" } }, never);
  assert.deepEqual([retry.state, retry.replayed], ["cancelled", true]);
  assert.deepEqual(retry.partial, PARTIAL);
  await assert.rejects(gate.turn({ ...ids, clientRequestId: "msg-1", payload: { text: "taxi 18" } }, never), TurnNotSucceeded);
  assert.equal(executions, 1, "the tool ran once");
});

test("enqueue: three queued messages on one session all complete, in order", async () => {
  const ids = { userId: "queue-user", sessionId: "queue-session" };
  const release = deferred();
  const holding = deferred();
  const holder = gate.turn({ ...ids, clientRequestId: "msg-1", payload: 1 }, async () => {
    holding.resolve();
    await release.promise;
    return "msg-1 done";
  });
  await holding.promise;
  const ran = [];
  const positions = [];
  const queued = [];
  for (const message of ["msg-2", "msg-3", "msg-4"]) {
    const reported = deferred();
    queued.push(gate.run({
      ...ids,
      clientRequestId: message,
      payload: message,
      onBusy: "enqueue",
      onQueued: (position) => { positions.push([message, position]); reported.resolve(); },
    }, () => { ran.push(message); return `${message} done`; }));
    await reported.promise;
  }
  release.resolve();
  assert.equal(await holder, "msg-1 done");
  const results = await Promise.all(queued);
  assert.deepEqual(ran, ["msg-2", "msg-3", "msg-4"]);
  assert.deepEqual(positions.slice(0, 3), [["msg-2", 1], ["msg-3", 2], ["msg-4", 3]]);
  assert.deepEqual(results.map((r) => [r.state, r.replayed, r.value]), [
    ["succeeded", false, "msg-2 done"],
    ["succeeded", false, "msg-3 done"],
    ["succeeded", false, "msg-4 done"],
  ]);
});

test("supersede: the newer message replaces the queued one, which replays superseded", async () => {
  const ids = { userId: "sup-user", sessionId: "sup-session" };
  const release = deferred();
  const holding = deferred();
  const holder = gate.turn({ ...ids, clientRequestId: "msg-1", payload: 1 }, async () => { holding.resolve(); await release.promise; return 1; });
  await holding.promise;
  const older = deferred();
  const olderRun = gate.run({ ...ids, clientRequestId: "msg-2", payload: 2, onBusy: "enqueue", onQueued: () => older.resolve() }, () => "msg-2");
  await older.promise;
  const newer = deferred();
  const newerRun = gate.run({ ...ids, clientRequestId: "msg-3", payload: 3, onBusy: "supersede", onQueued: () => newer.resolve() }, () => "msg-3");
  await newer.promise;
  release.resolve();
  await holder;
  const [superseded, ran] = await Promise.all([olderRun, newerRun]);
  assert.deepEqual([superseded.state, superseded.replayed, superseded.value], ["superseded", true, undefined]);
  assert.deepEqual([ran.state, ran.replayed, ran.value], ["succeeded", false, "msg-3"]);
});

test("setPolicy: a session's default queues a message that names no onBusy", async () => {
  const ids = { userId: "pol-user", sessionId: "pol-session" };
  const session = await gate.setPolicy(ids.sessionId, ids.userId, { onBusy: "enqueue" });
  assert.deepEqual(session.default_policy, { on_busy: "enqueue", wait_ms: null, interrupt_running: false });
  await assert.rejects(gate.setPolicy(ids.sessionId, ids.userId, { onBusy: "reject", busyWaitMs: 100 }), RangeError);
  const release = deferred();
  const holding = deferred();
  const holder = gate.turn({ ...ids, clientRequestId: "msg-1", payload: 1 }, async () => { holding.resolve(); await release.promise; return 1; });
  await holding.promise;
  const positions = [];
  const second = gate.turn({ ...ids, clientRequestId: "msg-2", payload: 2, onQueued: (position) => { positions.push(position); release.resolve(); } }, () => "second");
  await holder;
  assert.equal(await second, "second");
  assert.deepEqual(positions, [1]);
});

test("a queued message whose waitMs runs out is withdrawn: QueueTimeout, and its retry replays cancelled", async () => {
  const ids = { userId: "qt-user", sessionId: "qt-session" };
  const release = deferred();
  const holding = deferred();
  const holder = gate.turn({ ...ids, clientRequestId: "msg-1", payload: 1 }, async () => { holding.resolve(); await release.promise; return 1; });
  await holding.promise;
  const error = await gate.turn({ ...ids, clientRequestId: "msg-2", payload: 2, onBusy: "enqueue", waitMs: 300 }, never)
    .then(() => assert.fail("resolved"), (rejection) => rejection);
  assert.ok(error instanceof QueueTimeout);
  assert.deepEqual([error.withdrawn, error.position], [true, 1]);
  assert.equal((await gate.getTurn(error.turnId)).turn.state, "cancelled");
  assert.deepEqual((await gate.getSession(ids.sessionId)).queue, []);
  release.resolve();
  await holder;
  const retry = await gate.run({ ...ids, clientRequestId: "msg-2", payload: 2 }, never);
  assert.deepEqual([retry.state, retry.replayed], ["cancelled", true]);
});

test("gate.cancel of a running turn aborts turn.signal; gate.turn rejects TurnCancelled and the turn ends cancelled with turn.partial", async () => {
  const ids = { userId: "cancel-user", sessionId: "cancel-session" };
  const started = deferred();
  const running = gate.turn({ ...ids, clientRequestId: "msg-1", payload: 1 }, async (turn) => {
    turn.partial = "half";
    started.resolve(turn.turnId);
    await delay(MODEL_CALL_MS, undefined, { signal: turn.signal });
    return "whole";
  });
  const turnId = await started.promise;
  assert.ok((await gate.cancel(turnId)).cancel_requested_at_ms > 0);
  await assert.rejects(running, TurnCancelled);
  const stored = (await gate.getTurn(turnId)).turn;
  assert.deepEqual([stored.state, stored.response], ["cancelled", "half"]);
});

test("a tool call under way when the interrupt comes finishes and records its result; the body stops at its next signal check", async () => {
  const ids = { userId: "tool-int-user", sessionId: "tool-int-session" };
  const booking = deferred();
  let executions = 0;
  let afterTool;
  const holder = gate.run({ ...ids, clientRequestId: "msg-1", payload: 1 }, async (turn) => {
    afterTool = await turn.tool("book", { amount: 18 }, {
      run: async (ctx) => {
        booking.resolve();
        await delay(3 * HEARTBEAT_INTERVAL_MS, undefined, { signal: ctx.signal }); // the interrupt is learnt meanwhile
        executions += 1;
        return { booked: 18 };
      },
    });
    await delay(MODEL_CALL_MS, undefined, { signal: turn.signal });
    return "the whole reply";
  });
  await booking.promise;
  await gate.run({ ...ids, clientRequestId: "msg-2", payload: 2, onBusy: "interrupt", busyWaitMs: 10_000 }, () => "second");
  const first = await holder;
  const record = await gate.getTurn(first.turnId);
  assert.deepEqual([first.state, record.turn.state], ["cancelled", "cancelled"]);
  assert.deepEqual(afterTool, { booked: 18 }, "the tool call was cut short");
  assert.deepEqual(record.executions.map((e) => [e.tool, e.state, e.result]), [["book", "succeeded", { booked: 18 }]]);
  assert.equal(executions, 1);
});
