// Draining a session through the handoff (take_next), against the real
// server: queued messages run in order by one worker, each handed off by
// the ending before it; senders still waiting for their queued message get
// the drained answer as a replay; a drain by session id claims the head of
// a free session's queue; a drainer SIGKILLed mid-message is finished by a
// RecoveryWorker, which drains the rest, every message booked once; a
// worker stopped mid-turn finishes it and takes no next one.

import assert from "node:assert/strict";
import { writeFileSync } from "node:fs";
import { join } from "node:path";
import { after, before, test } from "node:test";
import { Gate, RecoveryWorker, TurnCancelled } from "../dist/index.js";
import { Ledger, WORKER, deferred, spawnNode, startServer, tempDir } from "./helpers.mjs";
import { metric } from "./proxy.mjs";

/** Short, so a killed drainer's lease runs out quickly; long enough for a loaded 2-core machine. */
const LEASE_TTL_MS = 1000;
/** Bound on waiting for a worker the test started. */
const JOIN_TIMEOUT_MS = 20_000;

let server;
let gate;
before(async () => {
  server = await startServer({ leaseTtlMs: LEASE_TTL_MS });
  gate = new Gate({ baseUrl: server.url });
});
after(async () => { await server?.stop(); });

const handoffs = () => metric(server.url, "agentgate_begins_total", { outcome: "handoff" });

/** Queues `message` behind the session's holder, once (no re-send). */
async function enqueue(ids, message) {
  const answer = await fetch(`${server.url}/v1/turns`, {
    method: "POST",
    headers: { "content-type": "application/json" },
    body: JSON.stringify({ user_id: ids.userId, session_id: ids.sessionId, client_request_id: message, payload: { message }, on_busy: "enqueue" }),
  });
  assert.equal(answer.status, 202);
  return (await answer.json()).turn;
}

test("three queued messages are drained in order by one worker through the handoff", async () => {
  const ids = { userId: "drain-user", sessionId: "drain-session" };
  const before = await handoffs();
  const seen = [];
  const queued = {};
  const outcomes = await gate.drain({ ...ids, clientRequestId: "m1", payload: { message: "m1" } }, async (turn) => {
    seen.push([turn.clientRequestId, turn.payload, turn.attempt, turn.takeover]);
    if (turn.clientRequestId === "m1") {
      for (const message of ["m2", "m3", "m4"]) queued[message] = (await enqueue(ids, message)).turn_id;
    }
    return { done: turn.clientRequestId };
  });

  const messages = ["m1", "m2", "m3", "m4"];
  assert.deepEqual(seen, messages.map((m) => [m, { message: m }, 1, false]));
  assert.deepEqual(outcomes.map((o) => [o.state, o.replayed, o.value]), messages.map((m) => ["succeeded", false, { done: m }]));
  assert.deepEqual(outcomes.slice(1).map((o) => o.turnId), ["m2", "m3", "m4"].map((m) => queued[m]));
  assert.equal((await handoffs()) - before, 3, "each queued message was started by the ending before it");
  const session = await gate.getSession(ids.sessionId);
  assert.deepEqual([session.holder, session.queue], [null, []]);
});

/**
 * Three senders wait in their queue loop (`onBusy: "enqueue"`) while one
 * drainer drains the session. `holdResends`: every re-send of a begin
 * (after its first 202) waits until the drain is over, so each message
 * surely reaches the drainer first.
 */
async function sendersAndADrainer(ids, holdResends) {
  const drained = deferred();
  const queuedOnce = new Set();
  const senderGate = new Gate({
    baseUrl: server.url,
    fetch: async (url, init) => {
      const begin = init?.method === "POST" && new URL(url).pathname === "/v1/turns";
      const message = begin ? JSON.parse(init.body).client_request_id : undefined;
      if (holdResends && queuedOnce.has(message)) await drained.promise;
      const answer = await fetch(url, init);
      if (answer.status === 202) queuedOnce.add(message);
      return answer;
    },
  });
  const runs = [];
  const body = (turn, by) => { runs.push([turn.clientRequestId, by]); return { by, message: turn.clientRequestId }; };
  const senders = {};
  const outcomes = await gate.drain({ ...ids, clientRequestId: "m1", payload: { message: "m1" } }, async (turn) => {
    if (turn.clientRequestId === "m1") {
      for (const message of ["m2", "m3", "m4"]) { // one at a time, so the queue's order is known
        const queued = deferred();
        senders[message] = senderGate.run({ ...ids, clientRequestId: message, payload: { message }, onBusy: "enqueue", onQueued: () => queued.resolve() },
          (sent) => body(sent, "sender"));
        await queued.promise;
      }
    }
    return body(turn, "drainer");
  });
  drained.resolve();
  const sent = Object.fromEntries(await Promise.all(Object.entries(senders).map(async ([m, p]) => [m, await p])));
  return { runs, drained: outcomes, sent };
}

test("senders still waiting in their queue loop get the drained answer as a replay", async () => {
  const ids = { userId: "replay-user", sessionId: "replay-session" };
  const before = await handoffs();
  const { runs, drained, sent } = await sendersAndADrainer(ids, true);
  assert.deepEqual(runs, [["m1", "drainer"], ["m2", "drainer"], ["m3", "drainer"], ["m4", "drainer"]]);
  assert.equal(drained.length, 4);
  for (const message of ["m2", "m3", "m4"]) {
    const outcome = sent[message];
    assert.deepEqual([outcome.state, outcome.replayed, outcome.value], ["succeeded", true, { by: "drainer", message }]);
  }
  assert.equal((await handoffs()) - before, 3);
});

test("senders racing a drainer for their own messages: each message runs once, in order, and every sender gets its outcome", async () => {
  const ids = { userId: "race-user", sessionId: "race-session" };
  const before = await handoffs();
  const { runs, drained, sent } = await sendersAndADrainer(ids, false);
  // A sender's re-send that reaches the store during the ending's commit
  // starts its message itself; the handoff then finds it running and hands
  // over nothing (the drain ends), and that sender runs it.
  assert.deepEqual(runs.map(([m]) => m), ["m1", "m2", "m3", "m4"]);
  const by = Object.fromEntries(runs);
  for (const message of ["m2", "m3", "m4"]) {
    const outcome = sent[message];
    assert.deepEqual([outcome.state, outcome.value], ["succeeded", { by: by[message], message }]);
    assert.equal(outcome.replayed, by[message] === "drainer", "a drained message's sender got its answer replayed");
  }
  const replays = Object.values(sent).filter((o) => o.replayed).length;
  assert.equal(replays, drained.length - 1);
  assert.equal((await handoffs()) - before, replays);
  console.log(`handed off to the drainer (and replayed to their senders): ${replays} of 3; run by their senders: ${3 - replays}`);
});

test("a drain by session id claims the head of a free session's queue and hands off the rest; a live holder's session is left alone", async () => {
  const ids = { userId: "free-user", sessionId: "free-session" };
  await gate.turn({ ...ids, clientRequestId: "m1", payload: null }, async () => {
    for (const message of ["m2", "m3", "m4"]) await enqueue(ids, message);
    assert.deepEqual(await gate.drain(ids.sessionId, () => assert.fail("ran while a live holder has the session")), []);
    return "m1 done"; // no handoff: the queue waits on a free session
  });
  const claims = await metric(server.url, "agentgate_begins_total", { outcome: "orphan_claim" });
  const before = await handoffs();
  const handled = [];
  const outcomes = await gate.drain(ids.sessionId, (turn) => { handled.push(turn.clientRequestId); return turn.payload; }, { userId: ids.userId });

  assert.deepEqual(handled, ["m2", "m3", "m4"]);
  assert.deepEqual(outcomes.map((o) => o.value), ["m2", "m3", "m4"].map((message) => ({ message })));
  assert.equal((await metric(server.url, "agentgate_begins_total", { outcome: "orphan_claim" })) - claims, 1, "the head was claimed");
  assert.equal((await handoffs()) - before, 2, "the rest were handed off");
});

test("a drained turn asked to stop ends cancelled and the drain goes on", async () => {
  const ids = { userId: "stop-user", sessionId: "stop-session" };
  const outcomes = await gate.drain({ ...ids, clientRequestId: "m1", payload: null }, async (turn) => {
    if (turn.clientRequestId === "m1") { await enqueue(ids, "m2"); await enqueue(ids, "m3"); }
    if (turn.clientRequestId === "m2") {
      turn.partial = "m2 so far";
      await gate.cancel(turn.turnId); // a person presses stop
      await turn.tool("book", {}, { run: () => assert.fail("a tool ran after the stop") });
    }
    return `${turn.clientRequestId} done`;
  });
  assert.deepEqual(outcomes.map((o) => [o.state, o.value, o.partial]), [
    ["succeeded", "m1 done", undefined],
    ["cancelled", undefined, "m2 so far"],
    ["succeeded", "m3 done", undefined],
  ]);
});

test("a drainer SIGKILLed mid-message is finished by a RecoveryWorker, which drains the rest: every message's tool ran once", async () => {
  const dir = tempDir();
  const ledger = new Ledger(join(dir, "ledger.jsonl"));
  const ids = { userId: "kill-drain-user", sessionId: "kill-drain-session" };
  const go = join(dir, "go");
  const before = await handoffs();
  const drainer = spawnNode(WORKER, [JSON.stringify({ baseUrl: server.url, mode: "drain", ledger: ledger.path, go, ...ids, requestId: "msg-1" })]);
  await drainer.next("HOLDING");
  for (const message of ["msg-2", "msg-3", "msg-4"]) await enqueue(ids, message);
  writeFileSync(go, "go");
  assert.equal(await drainer.next("BOOKED"), "msg-2");
  drainer.kill("SIGKILL");
  assert.equal((await drainer.exited).signal, "SIGKILL");
  const counts = () => ledger.entries().reduce((all, entry) => ({ ...all, [entry.message]: (all[entry.message] ?? 0) + 1 }), {});
  assert.deepEqual(counts(), { "msg-1": 1, "msg-2": 1 }, "msg-1 done, msg-2 booked but not recorded");

  const recovered = [];
  const worker = new RecoveryWorker(gate, async (turn) => {
    const outcomes = [];
    const reply = await turn.tool("book", { message: turn.clientRequestId }, {
      reconcile: (ctx) => { outcomes.push(["reconciled", ctx.previousOutcome]); return ledger.find(ctx.idempotencyKey) && { booked: ctx.args.message }; },
      run: (ctx) => { outcomes.push(["ran", ctx.previousOutcome]); ledger.book({ key: ctx.idempotencyKey, message: ctx.args.message }); return { booked: ctx.args.message }; },
    });
    recovered.push({ message: turn.clientRequestId, takeover: turn.takeover, attempt: turn.attempt, journal: turn.journal.map((e) => e.outcome), outcomes });
    return reply;
  }, { minOrphanedMs: 0, userIds: [ids.userId] });
  const ran = await worker.run({ maxTurns: 3 });

  assert.deepEqual([ran, worker.claims, worker.turns], [3, 1, 3], "one claim (the orphan), then two handoffs");
  assert.deepEqual(recovered, [
    { message: "msg-2", takeover: true, attempt: 2, journal: ["unknown"], outcomes: [["reconciled", "unknown"]] },
    { message: "msg-3", takeover: false, attempt: 1, journal: [], outcomes: [["ran", null]] },
    { message: "msg-4", takeover: false, attempt: 1, journal: [], outcomes: [["ran", null]] },
  ]);
  assert.deepEqual(counts(), { "msg-1": 1, "msg-2": 1, "msg-3": 1, "msg-4": 1 }, "each message's tool ran once");
  assert.equal((await handoffs()) - before, 3, "msg-1 to msg-2 by the drainer, msg-3 and msg-4 by the recovery worker");
  const session = await gate.getSession(ids.sessionId);
  assert.deepEqual([session.holder, session.queue], [null, []]);
});

/** A free session with `messages` queued (their holder ended without a handoff). */
async function freeSessionWithQueue(ids, messages) {
  await gate.turn({ ...ids, clientRequestId: "m0", payload: null }, async () => {
    for (const message of messages) await enqueue(ids, message);
    return "m0 done";
  });
}

for (const how of ["stop()", "its AbortSignal"]) {
  test(`a RecoveryWorker stopped by ${how} mid-turn finishes that turn and leaves the rest queued`, async () => {
    const ids = { userId: `rw-${how.length}-user`, sessionId: `rw-${how.length}-session` };
    await freeSessionWithQueue(ids, ["m1", "m2", "m3"]);
    const inBody = deferred();
    const release = deferred();
    const handled = [];
    const controller = new AbortController();
    const worker = new RecoveryWorker(gate, async (turn) => {
      handled.push(turn.clientRequestId);
      inBody.resolve();
      await release.promise;
      return `${turn.clientRequestId} done`;
    }, { minOrphanedMs: 0, userIds: [ids.userId], signal: controller.signal });
    const running = worker.run();
    await inBody.promise;
    if (how === "stop()") worker.stop(); else controller.abort();
    release.resolve();
    let timer;
    const ran = await Promise.race([running, new Promise((_, reject) => { timer = setTimeout(() => reject(new Error("run() did not stop")), JOIN_TIMEOUT_MS); })])
      .finally(() => clearTimeout(timer));

    assert.deepEqual([ran, handled], [1, ["m1"]]);
    const first = await gate.run({ ...ids, clientRequestId: "m1", payload: { message: "m1" } }, () => assert.fail("m1 ran again"));
    assert.deepEqual([first.state, first.replayed, first.value], ["succeeded", true, "m1 done"]);
    const session = await gate.getSession(ids.sessionId);
    assert.equal(session.holder, null);
    assert.deepEqual(session.queue.map((entry) => entry.client_request_id), ["m2", "m3"], "no next turn was taken");
  });
}

test("a body that throws mid-drain fails its turn without a handoff; the error reaches the caller, the rest stays queued", async () => {
  const ids = { userId: "throw-user", sessionId: "throw-session" };
  const error = await gate.drain({ ...ids, clientRequestId: "m1", payload: null }, async (turn) => {
    await enqueue(ids, "m2");
    throw new Error("the model is down");
  }).then(() => assert.fail("resolved"), (rejection) => rejection);
  assert.equal(error.message, "the model is down");
  assert.ok(!(error instanceof TurnCancelled));
  const session = await gate.getSession(ids.sessionId);
  assert.deepEqual([session.holder, session.queue.map((entry) => entry.client_request_id)], [null, ["m2"]]);
});
