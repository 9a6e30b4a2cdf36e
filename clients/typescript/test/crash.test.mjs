// Worker processes killed (SIGKILL) or frozen (SIGSTOP) mid-tool against the
// real server with a short lease: the booking happens exactly once.

import assert from "node:assert/strict";
import { join } from "node:path";
import { after, before, test } from "node:test";
import { Gate, LeaseLost, RequestInFlight } from "../dist/index.js";
import { Ledger, WORKER, sleep, spawnNode, startServer, tempDir } from "./helpers.mjs";

// Short enough that takeovers come quickly, long enough that a debug build
// on a busy 2-core machine renews in time (a heartbeat every ~266 ms).
const LEASE_TTL_MS = 800;

let server;
before(async () => { server = await startServer({ leaseTtlMs: LEASE_TTL_MS }); });
after(async () => { await server?.stop(); });

function worker(mode, ids, ledger, extra = {}) {
  return spawnNode(WORKER, [JSON.stringify({ baseUrl: server.url, mode, ledger: ledger.path, ...ids, ...extra })]);
}

test("a worker SIGKILLed after booking is taken over by a repeat, which reconciles unknown through the hook: one booking", async () => {
  const ledger = new Ledger(join(tempDir(), "ledger.jsonl"));
  const ids = { userId: "kill-user", sessionId: "kill-session", requestId: "kill-msg-1" };
  const first = worker("crash", ids, ledger);
  const key = await first.next("BOOKED");
  first.kill("SIGKILL");
  assert.equal((await first.exited).signal, "SIGKILL");
  assert.equal(ledger.entries().length, 1, "the killed worker's booking reached the ledger");

  // The repeat meets request_in_flight until the dead lease runs out, then takes over.
  const second = worker("takeover", ids, ledger, { waitMs: 10 * LEASE_TTL_MS });
  const turn = JSON.parse(await second.next("TURN"));
  assert.equal(turn.takeover, true);
  assert.equal(turn.attempt, 2);
  assert.deepEqual(JSON.parse(await second.next("RECONCILE")), { found: true });
  const result = JSON.parse(await second.next("RESULT"));
  await second.exited;
  assert.ok(!second.lines.some((line) => line.startsWith("RUN")), "run was not called after reconcile found the booking");
  assert.equal(result.entry.key, key);
  assert.equal(ledger.entries().length, 1, "exactly one booking");
});

test("a recovery worker claims a SIGKILLed worker's orphan and reconciles unknown through the hook: one booking", async () => {
  const ledger = new Ledger(join(tempDir(), "ledger.jsonl"));
  const ids = { userId: "orphan-user", sessionId: "orphan-session", requestId: "orphan-msg-1" };
  const first = worker("crash", ids, ledger);
  const { turnId } = JSON.parse(await first.next("TURN"));
  const key = await first.next("BOOKED");
  first.kill("SIGKILL");
  await first.exited;
  await sleep(LEASE_TTL_MS + 200);

  const recovery = worker("orphan", {}, ledger, { turnId });
  const turn = JSON.parse(await recovery.next("TURN"));
  assert.equal(turn.turnId, turnId);
  assert.equal(turn.takeover, true);
  assert.deepEqual(JSON.parse(await recovery.next("RECONCILE")), { found: true });
  const claimed = JSON.parse(await recovery.next("RESULT"));
  await recovery.exited;
  assert.ok(!recovery.lines.some((line) => line.startsWith("RUN")), "run was not called");
  assert.equal(claimed.turnId, turnId);
  assert.equal(claimed.response.entry.key, key);
  assert.equal(ledger.entries().length, 1, "exactly one booking");
  const state = await new Gate({ baseUrl: server.url }).getTurn(turnId);
  assert.equal(state.turn.state, "succeeded");
  assert.deepEqual(state.turn.response, claimed.response);
});

test("a worker SIGSTOPped past the TTL mid-tool loses its lease: its signal fires on SIGCONT, its later writes are refused by the server, one booking", async () => {
  const ledger = new Ledger(join(tempDir(), "ledger.jsonl"));
  const ids = { userId: "stop-user", sessionId: "stop-session", requestId: "stop-msg-1" };
  const stalled = worker("stall", ids, ledger);
  const firstTurn = JSON.parse(await stalled.next("TURN"));
  await stalled.next("IN_RUN");
  stalled.kill("SIGSTOP");
  try {
    const taker = worker("takeover", ids, ledger, { waitMs: 10 * LEASE_TTL_MS });
    const turn = JSON.parse(await taker.next("TURN"));
    assert.equal(turn.takeover, true);
    assert.ok(turn.fence > firstTurn.fence);
    assert.deepEqual(JSON.parse(await taker.next("RECONCILE")), { found: false });
    await taker.next("RUN");
    const response = JSON.parse(await taker.next("RESULT"));
    await taker.exited;
    assert.equal(response.entry.by, "takeover");
  } finally {
    stalled.kill("SIGCONT");
  }
  assert.deepEqual(JSON.parse(await stalled.next("ABORTED")), { aborted: true, code: "lease_lost" });
  assert.deepEqual(JSON.parse(await stalled.next("SERVER_ANSWER")), { status: 409, code: "lease_lost" });
  assert.deepEqual(JSON.parse(await stalled.next("TURN_REJECTED")), { name: "LeaseLost", code: "lease_lost" });
  await stalled.exited;

  // The stalled worker's writes changed nothing: the turn and the tool
  // call hold the taker's results, and the ledger one booking.
  const state = await new Gate({ baseUrl: server.url }).getTurn(firstTurn.turnId);
  assert.equal(state.turn.state, "succeeded");
  assert.equal(state.turn.response.entry.by, "takeover");
  assert.equal(state.executions.length, 1);
  assert.equal(state.executions[0].result.by, "takeover");
  const heartbeat = await fetch(`${server.url}/v1/turns/${firstTurn.turnId}/heartbeat`, {
    method: "POST", headers: { "lease-token": firstTurn.leaseToken },
  });
  assert.equal(heartbeat.status, 409, "the stalled worker's token renews nothing");
  assert.equal(ledger.entries().length, 1, "exactly one booking");
});

test("heartbeats keep a lease alive for several TTLs: a repeat meanwhile gets RequestInFlight, not a takeover", async () => {
  const gate = new Gate({ baseUrl: server.url });
  const request = { userId: "beat-user", sessionId: "beat-session", clientRequestId: "msg-1", payload: null };
  const response = await gate.turn(request, async (turn) => {
    await sleep(3 * LEASE_TTL_MS);
    const error = await gate.turn(request, async () => "taken over").then(() => assert.fail("resolved"), (rejection) => rejection);
    assert.ok(error instanceof RequestInFlight, String(error));
    assert.equal(error.activeTurnId, turn.turnId);
    assert.equal(turn.signal.aborted, false);
    return "kept";
  });
  assert.equal(response, "kept");
});

test("claimOrphan resolves null and calls nothing when no orphan matches (a live turn is not one)", async () => {
  const gate = new Gate({ baseUrl: server.url });
  await gate.turn({ userId: "live-user", sessionId: "live-session", clientRequestId: "msg-1", payload: null }, async (turn) => {
    let called = false;
    const claimed = await gate.claimOrphan({ turnIds: [turn.turnId] }, async () => { called = true; });
    assert.equal(claimed, null);
    assert.equal(called, false);
    assert.equal(turn.signal.aborted, false, "the live turn keeps its lease");
  });
});

test("a server frozen (SIGSTOP) past the TTL: the client presumes the lease lost, turn.signal fires, and gate.turn rejects with LeaseLost", async () => {
  const frozen = await startServer({ leaseTtlMs: LEASE_TTL_MS });
  try {
    const gate = new Gate({ baseUrl: frozen.url });
    let reason;
    const outcome = gate.turn({ userId: "freeze-user", sessionId: "freeze-session", clientRequestId: "msg-1", payload: null }, async (turn) => {
      frozen.process.kill("SIGSTOP");
      const stoppedAt = Date.now();
      // Bounded: the signal must fire within a few TTLs, or the test fails.
      await Promise.race([new Promise((resolve) => turn.signal.addEventListener("abort", resolve, { once: true })), sleep(6 * LEASE_TTL_MS)]);
      reason = { aborted: turn.signal.aborted, afterMs: Date.now() - stoppedAt, error: turn.signal.reason };
      frozen.process.kill("SIGCONT");
      return "unreachable: the lease is gone";
    });
    const error = await outcome.then(() => assert.fail("resolved"), (rejection) => rejection);
    assert.equal(reason.aborted, true, "turn.signal fired while the server was frozen");
    // The lease runs out a TTL after the begin answered, just before the freeze.
    assert.ok(reason.afterMs >= LEASE_TTL_MS - 100, `not before the lease could have run out (${reason.afterMs} ms)`);
    assert.ok(reason.afterMs <= 4 * LEASE_TTL_MS, `within a few TTLs (${reason.afterMs} ms)`);
    assert.ok(reason.error instanceof LeaseLost);
    assert.match(reason.error.message, /presumed lost/);
    assert.equal(error, reason.error, "gate.turn rejects with the same LeaseLost");
  } finally {
    frozen.process.kill("SIGCONT");
    await frozen.stop();
  }
});
