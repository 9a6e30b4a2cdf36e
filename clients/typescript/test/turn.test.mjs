// gate.turn against the real server: replay, payload_mismatch, bounded
// waiting on session_busy and user_at_capacity, failure, API keys.

import assert from "node:assert/strict";
import { after, before, describe, test } from "node:test";
import {
  AgentgateError, AwaitingConfirmation, Gate, PayloadMismatch, SessionBusy, TurnNotSucceeded, Unauthorized, UserAtCapacity,
} from "../dist/index.js";
import { deferred, sleep, startServer } from "./helpers.mjs";

describe("one server (default lease TTL, 30 s)", () => {
  let server;
  let gate;
  before(async () => {
    server = await startServer();
    gate = new Gate({ baseUrl: server.url });
  });
  after(async () => { await server?.stop(); });

  test("a replay returns the stored response without calling the callback", async () => {
    const request = { userId: "replay-user", sessionId: "replay-session", clientRequestId: "msg-1", payload: { text: "taxi 18" } };
    let calls = 0;
    const first = await gate.turn(request, async (turn) => {
      calls += 1;
      assert.equal(turn.attempt, 1);
      assert.equal(turn.takeover, false);
      assert.deepEqual(turn.payload, { text: "taxi 18" });
      return { text: "booked", n: calls };
    });
    assert.deepEqual(first, { text: "booked", n: 1 });
    const replayed = await gate.turn(request, async () => {
      calls += 1;
      return { text: "must not run" };
    });
    assert.equal(calls, 1, "the callback ran once");
    assert.deepEqual(replayed, first);
  });

  test("payload_mismatch: the same clientRequestId with another payload rejects with PayloadMismatch, callback not called", async () => {
    const ids = { userId: "mismatch-user", sessionId: "mismatch-session", clientRequestId: "msg-1" };
    await gate.turn({ ...ids, payload: { text: "taxi 18" } }, async () => ({ text: "ok" }));
    let called = false;
    const error = await gate.turn({ ...ids, payload: { text: "lunch 35" } }, async () => { called = true; })
      .then(() => assert.fail("resolved"), (rejection) => rejection);
    assert.ok(error instanceof PayloadMismatch);
    assert.ok(error instanceof AgentgateError);
    assert.equal(error.code, "payload_mismatch");
    assert.equal(error.status, 422);
    assert.equal(called, false);
  });

  test("onBusy wait: the server answers the begin once the holder ends; releaseSession fences a stuck holder", async () => {
    const holding = deferred();
    const release = deferred();
    const ids = { userId: "onbusy-user", sessionId: "onbusy-session" };
    const holder = gate.turn({ ...ids, clientRequestId: "msg-1", payload: 1 }, async (turn) => {
      holding.resolve(turn.turnId);
      await release.promise;
      return "first";
    });
    await holding.promise;
    const order = [];
    const waiter = gate.turn({ ...ids, clientRequestId: "msg-2", payload: 2, onBusy: "wait", busyWaitMs: 10_000 }, async () => {
      order.push("second ran");
      return "second";
    });
    await sleep(300);
    order.push("first ends");
    release.resolve();
    assert.equal(await holder, "first");
    assert.equal(await waiter, "second");
    assert.deepEqual(order, ["first ends", "second ran"], "the waiter started only after the holder ended");
    // A holder that stops answering, released by an operator.
    const stuck = deferred();
    const unblock = deferred();
    const lost = gate.turn({ ...ids, clientRequestId: "msg-3", payload: 3 }, async (turn) => {
      stuck.resolve(turn.turnId);
      await unblock.promise;
      return "late";
    }).then(() => "resolved", (error) => error.code);
    const stuckTurn = await stuck.promise;
    const released = await gate.releaseSession(ids.sessionId, ids.userId);
    assert.equal(released.turn_id, stuckTurn);
    assert.equal(released.state, "abandoned");
    unblock.resolve();
    assert.equal(await lost, "lease_lost", "the released holder's ending is refused");
    assert.equal(await gate.releaseSession(ids.sessionId), null);
    await assert.rejects(gate.turn({ ...ids, clientRequestId: "x", payload: 0, onBusy: "wait", busyWaitMs: 60_000 }, () => 0), RangeError);
  });

  test("session_busy: a waiter gives up after waitMs with SessionBusy naming the holder", async () => {
    const holding = deferred();
    const release = deferred();
    const holder = gate.turn({ userId: "busy-user", sessionId: "busy-session", clientRequestId: "msg-1", payload: 1 }, async (turn) => {
      holding.resolve(turn.turnId);
      await release.promise;
      return "held";
    });
    const holderTurnId = await holding.promise;
    try {
      const waitMs = 700;
      const started = Date.now();
      const error = await gate.turn({ userId: "busy-user", sessionId: "busy-session", clientRequestId: "msg-2", payload: 2, waitMs }, async () => "ran")
        .then(() => assert.fail("resolved"), (rejection) => rejection);
      const elapsed = Date.now() - started;
      assert.ok(error instanceof SessionBusy, String(error));
      assert.equal(error.status, 409);
      assert.equal(error.activeTurnId, holderTurnId);
      assert.ok(error.retryAfterMs > waitMs, `retryAfterMs ${error.retryAfterMs} is the holder's lease`);
      assert.ok(elapsed >= waitMs, `gave up after ${elapsed} ms, not before waitMs`);
      assert.ok(elapsed < waitMs + 2_000, `gave up after ${elapsed} ms, not much after waitMs`);

      const atOnce = Date.now();
      await assert.rejects(
        gate.turn({ userId: "busy-user", sessionId: "busy-session", clientRequestId: "msg-3", payload: 3 }, async () => "ran"),
        SessionBusy,
      );
      assert.ok(Date.now() - atOnce < 500, "without waitMs it fails at once");
    } finally {
      release.resolve();
      assert.equal(await holder, "held");
    }
  });

  test("session_busy: a waiter succeeds when the holder ends within waitMs, long before Retry-After", async () => {
    const holding = deferred();
    let holderEndedAt;
    const holder = gate.turn({ userId: "wait-user", sessionId: "wait-session", clientRequestId: "msg-1", payload: 1 }, async () => {
      holding.resolve();
      await sleep(400);
      holderEndedAt = Date.now();
      return "first";
    });
    await holding.promise;
    const started = Date.now();
    let ranAt;
    const response = await gate.turn(
      { userId: "wait-user", sessionId: "wait-session", clientRequestId: "msg-2", payload: 2, waitMs: 10_000 },
      async () => { ranAt = Date.now(); return "second"; },
    );
    assert.equal(await holder, "first");
    assert.equal(response, "second");
    assert.ok(ranAt >= holderEndedAt, "the waiter ran after the holder ended");
    assert.ok(Date.now() - started < 5_000, "it did not sleep out the holder's 30 s lease");
  });

  test("a callback that throws fails the turn retryable and rethrows; a repeat restarts it as attempt 2", async () => {
    const request = { userId: "fail-user", sessionId: "fail-session", clientRequestId: "msg-1", payload: "x" };
    let turnId;
    await assert.rejects(
      gate.turn(request, async (turn) => { turnId = turn.turnId; throw new RangeError("model timed out"); }),
      (error) => error instanceof RangeError && error.message === "model timed out",
    );
    const failed = await gate.getTurn(turnId);
    assert.equal(failed.turn.state, "failed");
    assert.equal(failed.turn.retryable, true);
    assert.deepEqual(failed.turn.error, { name: "RangeError", message: "RangeError: model timed out" });
    const response = await gate.turn(request, async (turn) => {
      assert.equal(turn.turnId, turnId);
      assert.equal(turn.attempt, 2);
      return "second try";
    });
    assert.equal(response, "second try");
  });

  test("awaitConfirmation: a repeat rejects with AwaitingConfirmation, the approval's turn gets the pending action, then a repeat rejects with TurnNotSucceeded", async () => {
    const ids = { userId: "confirm-user", sessionId: "confirm-session" };
    const request = { ...ids, clientRequestId: "msg-1", payload: "refund 4000" };
    let askingTurnId;
    await gate.turn(request, async (turn) => {
      askingTurnId = turn.turnId;
      await turn.awaitConfirmation({ refund: 4000 });
      return "unused: the turn already ended awaiting confirmation";
    });
    const waiting = await gate.turn(request, async () => "must not run").then(() => assert.fail("resolved"), (rejection) => rejection);
    assert.ok(waiting instanceof AwaitingConfirmation, String(waiting));
    assert.equal(waiting.activeTurnId, askingTurnId);

    const approved = await gate.turn(
      { ...ids, clientRequestId: "msg-2", payload: "yes", confirmation: { turnId: askingTurnId, decision: "approve" } },
      async (turn) => {
        assert.deepEqual(turn.confirmation, { turn_id: askingTurnId, decision: "approve", pending: { refund: 4000 } });
        return "refunded";
      },
    );
    assert.equal(approved, "refunded");

    const replay = await gate.turn(request, async () => "must not run").then(() => assert.fail("resolved"), (rejection) => rejection);
    assert.ok(replay instanceof TurnNotSucceeded, String(replay));
    assert.equal(replay.turn.turn_id, askingTurnId);
    assert.equal(replay.turn.state, "confirmed");
  });
});

describe("a server with --max-turns-per-user 1", () => {
  let server;
  let gate;
  before(async () => {
    server = await startServer({ maxTurnsPerUser: 1 });
    gate = new Gate({ baseUrl: server.url });
  });
  after(async () => { await server?.stop(); });

  test("user_at_capacity: a second session of the user rejects with UserAtCapacity, and succeeds when waiting past the first turn", async () => {
    const holding = deferred();
    const release = deferred();
    const holder = gate.turn({ userId: "cap-user", sessionId: "cap-a", clientRequestId: "msg-1", payload: 1 }, async () => {
      holding.resolve();
      await release.promise;
      return "first";
    });
    await holding.promise;
    const error = await gate.turn({ userId: "cap-user", sessionId: "cap-b", clientRequestId: "msg-2", payload: 2 }, async () => "ran")
      .then(() => assert.fail("resolved"), (rejection) => rejection);
    assert.ok(error instanceof UserAtCapacity, String(error));
    assert.equal(error.status, 429);
    assert.ok(error.retryAfterMs > 0);

    const other = await gate.turn({ userId: "other-user", sessionId: "cap-c", clientRequestId: "msg-1", payload: 3 }, async () => "other");
    assert.equal(other, "other", "the cap is per user");

    setTimeout(() => release.resolve(), 300);
    const second = await gate.turn(
      { userId: "cap-user", sessionId: "cap-b", clientRequestId: "msg-2", payload: 2, waitMs: 10_000 },
      async () => "second",
    );
    assert.equal(await holder, "first");
    assert.equal(second, "second");
  });
});

describe("a server with an API key", () => {
  let server;
  before(async () => { server = await startServer({ extraArgs: ["--api-key", "test-key-0123456789abcdef"] }); });
  after(async () => { await server?.stop(); });

  test("without apiKey a turn rejects with Unauthorized; with it, it runs", async () => {
    const request = { userId: "key-user", sessionId: "key-session", clientRequestId: "msg-1", payload: null };
    const error = await new Gate({ baseUrl: server.url }).turn(request, async () => "ran").then(() => assert.fail("resolved"), (rejection) => rejection);
    assert.ok(error instanceof Unauthorized);
    assert.equal(error.status, 401);
    assert.equal(await new Gate({ baseUrl: server.url, apiKey: "test-key-0123456789abcdef" }).turn(request, async () => "ran"), "ran");
  });
});
