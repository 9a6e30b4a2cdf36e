// The same message sent twice at once (a double-click), against the real
// server: the duplicate's begin is refused `request_in_flight`; it follows
// the running turn to its end and gets the replay of its answer as soon as
// it exists (well before the lease's Retry-After), and the body runs once.
// A wait that runs out first rejects with `RequestInFlight` and the lease's
// real retry hint.

import assert from "node:assert/strict";
import { setTimeout as delay } from "node:timers/promises";
import { after, before, test } from "node:test";
import { Gate, RequestInFlight } from "../dist/index.js";
import { deferred, startServer } from "./helpers.mjs";

/** How long the first send's body takes (the model call). */
const BODY_MS = 1000;
/** The duplicate's wait: far more than the body, far less than the lease (30 s). */
const DUPLICATE_WAIT_MS = 10_000;
/**
 * After the first send resolves, the duplicate resolves within this: the
 * server's follow wakes on the ending (at worst its 250 ms poll), one begin
 * round trip, scheduling on a loaded 2-core machine. Pausing on Retry-After,
 * or a 500 ms poll, would miss it.
 */
const REPLAY_SLACK_MS = 400;
const TEST_TIMEOUT_MS = 30_000;
const REPLY = { text: "Booked 18.", amount: 18 };

let server;
let gate;
before(async () => {
  server = await startServer();
  gate = new Gate({ baseUrl: server.url });
});
after(async () => { await server?.stop(); });

test("a duplicate send gets the first send's reply replayed as soon as it ends, well before the lease, and the body runs once", { timeout: TEST_TIMEOUT_MS }, async () => {
  const request = { userId: "dup-user", sessionId: "dup-session", clientRequestId: "dup-msg", payload: { text: "book 18" }, waitMs: DUPLICATE_WAIT_MS };
  let runs = 0;
  let leaseTtlMs;
  const running = deferred();
  const body = async (turn) => {
    runs += 1;
    leaseTtlMs = turn.leaseTtlMs;
    running.resolve();
    await delay(BODY_MS);
    return REPLY;
  };
  let firstDone;
  const first = gate.run(request, body).then((outcome) => { firstDone = performance.now(); return outcome; });
  await running.promise;
  const dupStarted = performance.now();
  const duplicate = await gate.run(request, body);
  const dupDone = performance.now();
  const firstOutcome = await first;
  assert.equal(runs, 1, `the body ran ${runs} times`);
  assert.equal(firstOutcome.replayed, false);
  assert.deepEqual(firstOutcome.value, REPLY);
  assert.equal(duplicate.replayed, true, "the duplicate ran instead of replaying");
  assert.equal(duplicate.state, "succeeded");
  assert.deepEqual(duplicate.value, REPLY);
  const lagMs = dupDone - firstDone;
  const waitedMs = dupDone - dupStarted;
  console.log(`duplicate waited ${waitedMs.toFixed(0)} ms; resolved ${lagMs.toFixed(0)} ms after the first (lease ${leaseTtlMs} ms)`);
  assert.ok(lagMs < REPLAY_SLACK_MS, `the duplicate resolved ${lagMs.toFixed(0)} ms after the first`);
  assert.ok(waitedMs < BODY_MS + REPLAY_SLACK_MS + 500, `the duplicate waited ${waitedMs.toFixed(0)} ms`);
  assert.ok(waitedMs < leaseTtlMs / 4, "the duplicate waited for the lease, not for the answer");
});

test("a duplicate whose wait runs out rejects with RequestInFlight and the lease's retry hint, and the body runs once", { timeout: TEST_TIMEOUT_MS }, async () => {
  const request = { userId: "dup-user-2", sessionId: "dup-session-2", clientRequestId: "dup-msg-2", payload: null };
  let runs = 0;
  let leaseTtlMs;
  const running = deferred();
  const release = deferred();
  const body = async (turn) => {
    runs += 1;
    leaseTtlMs = turn.leaseTtlMs;
    running.resolve();
    const bound = new AbortController();
    await Promise.race([release.promise, delay(TEST_TIMEOUT_MS / 2, undefined, { signal: bound.signal }).catch(() => {})]);
    bound.abort(); // so this bound keeps node alive no longer
    return REPLY;
  };
  const first = gate.run(request, body);
  await running.promise;
  const waitMs = 500;
  const started = performance.now();
  let refused;
  try {
    await gate.run({ ...request, waitMs }, body);
  } catch (error) {
    refused = error;
  }
  const waitedMs = performance.now() - started;
  release.resolve();
  await first;
  assert.ok(refused instanceof RequestInFlight, `rejected with ${refused}`);
  assert.equal(runs, 1, `the body ran ${runs} times`);
  assert.ok(waitedMs >= waitMs - 5 && waitedMs < waitMs + REPLAY_SLACK_MS, `gave up after ${waitedMs.toFixed(0)} ms`);
  assert.ok(refused.retryAfterMs > 0 && refused.retryAfterMs <= leaseTtlMs, `retry hint ${refused.retryAfterMs} ms`);
  assert.ok(refused.activeTurnId);
});
