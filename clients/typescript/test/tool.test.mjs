// turn.tool against the real server: once-only under concurrency, cached
// results, failures reported and retried.

import assert from "node:assert/strict";
import { after, before, test } from "node:test";
import { Gate } from "../dist/index.js";
import { sleep, startServer } from "./helpers.mjs";

const CONCURRENT_CALLERS = 50;
/** How long the one execution waits for the others to meet it in flight. */
const HOLD_BOUND_MS = 15_000;

let server;
let gate;
before(async () => {
  server = await startServer();
  gate = new Gate({ baseUrl: server.url });
});
after(async () => { await server?.stop(); });

/** A counter from the server's /metrics, 0 when absent. */
async function metric(name) {
  const text = await (await fetch(`${server.url}/metrics`)).text();
  const line = text.split("\n").find((candidate) => candidate.startsWith(name + " "));
  return line === undefined ? 0 : Number(line.slice(name.length + 1));
}

test("50 concurrent callers of the same tool call in one turn: run executes once and every caller gets its result", async () => {
  const counters = ['agentgate_tool_claims_total{outcome="execute"}', 'agentgate_tool_claims_total{outcome="cached"}', 'agentgate_conflicts_total{code="tool_in_flight"}'];
  const before = await Promise.all(counters.map(metric));
  let runs = 0;
  const results = await gate.turn({ userId: "many-user", sessionId: "many-session", clientRequestId: "msg-1", payload: null }, async (turn) => {
    const callers = Array.from({ length: CONCURRENT_CALLERS }, (_, index) =>
      // Same call, args spelled differently: key order and 18 vs 18.0.
      turn.tool("create_transaction", index % 2 === 0 ? { amount: 18, category: "taxi" } : { category: "taxi", amount: 18.0 }, {
        run: async (ctx) => {
          runs += 1;
          // Hold the execution open until the server has answered the
          // others "in flight" 49 times, so they meet it running rather
          // than after it, however slow the machine.
          const heldSince = Date.now();
          while ((await metric(counters[2])) - before[2] < CONCURRENT_CALLERS - 1) {
            if (Date.now() - heldSince > HOLD_BOUND_MS) throw new Error(`no ${CONCURRENT_CALLERS - 1} tool_in_flight answers within ${HOLD_BOUND_MS} ms`);
            await sleep(50);
          }
          return { entry_id: 42, key: ctx.idempotencyKey };
        },
      }));
    return Promise.all(callers);
  });
  assert.equal(runs, 1, "run executed once");
  assert.equal(results.length, CONCURRENT_CALLERS);
  for (const result of results) assert.deepEqual(result, results[0]);
  assert.equal(results[0].entry_id, 42);
  const [executed, cached, inFlight] = (await Promise.all(counters.map(metric))).map((value, index) => value - before[index]);
  assert.equal(executed, 1, "the server told one caller to execute");
  assert.equal(cached, CONCURRENT_CALLERS - 1, "and the others the stored result");
  assert.ok(inFlight >= CONCURRENT_CALLERS - 1, `the others met it in flight (${inFlight} tool_in_flight answers)`);
});

test("a later claim of the same call returns the stored result without running", async () => {
  let runs = 0;
  const run = async (ctx) => { runs += 1; return { entry_id: runs, key: ctx.idempotencyKey }; };
  const [first, second, other] = await gate.turn({ userId: "cache-user", sessionId: "cache-session", clientRequestId: "msg-1", payload: null }, async (turn) => [
    await turn.tool("create_transaction", { amount: 18, category: "taxi" }, { run }),
    await turn.tool("create_transaction", { category: "taxi", amount: 18 }, { run }),
    await turn.tool("create_transaction", { amount: 35, category: "lunch" }, { run }),
  ]);
  assert.equal(runs, 2, "the repeat did not run; the other call did");
  assert.deepEqual(second, first);
  assert.notEqual(other.key, first.key, "another call has another idempotency key");
});

test("a run that throws fails the execution and rethrows; the next claim runs it again with previousOutcome failed and the same key", async () => {
  const seen = [];
  const run = async (ctx) => {
    seen.push({ attempt: ctx.attempt, previousOutcome: ctx.previousOutcome, key: ctx.idempotencyKey });
    if (seen.length === 1) throw new Error("ledger unreachable");
    return { entry_id: 7 };
  };
  let reconciled = false;
  const reconcile = async () => { reconciled = true; return undefined; };
  const result = await gate.turn({ userId: "retry-user", sessionId: "retry-session", clientRequestId: "msg-1", payload: null }, async (turn) => {
    await assert.rejects(turn.tool("export", { month: 11 }, { run, reconcile }), /ledger unreachable/);
    return turn.tool("export", { month: 11 }, { run, reconcile });
  });
  assert.deepEqual(result, { entry_id: 7 });
  assert.equal(seen.length, 2);
  assert.deepEqual(seen[0], { attempt: 1, previousOutcome: null, key: seen[0].key });
  assert.deepEqual(seen[1], { attempt: 2, previousOutcome: "failed", key: seen[0].key });
  assert.equal(reconciled, false, "reconcile is only for an unknown outcome");
});

/**
 * A fetch that delivers every request to the real server and, while
 * `dropNext` matches one, throws its answer away: the claim lands (its
 * execution runs under the lease) and the client never hears of it.
 */
function lossyFetch() {
  const state = { dropNext: undefined, dropped: [] };
  const fetchFunction = async (input, init) => {
    const response = await fetch(input, init);
    const url = typeof input === "string" ? input : input.url;
    if (state.dropNext !== undefined && state.dropNext(init?.method ?? "GET", url)) {
      state.dropNext = undefined;
      state.dropped.push(`${response.status} ${new URL(url).pathname}`);
      await response.arrayBuffer();
      throw new TypeError("fetch failed: the answer was lost");
    }
    return response;
  };
  return { state, fetchFunction };
}

const isClaim = (method, url) => method === "POST" && new URL(url).pathname.endsWith("/tools");

test("a tool claim whose answer was lost is failed as never run, claimed again, and the tool runs once", async () => {
  const { state, fetchFunction } = lossyFetch();
  const lossy = new Gate({ baseUrl: server.url, fetch: fetchFunction });
  const runs = [];
  let turnId;
  await lossy.turn({ userId: "lossy-user", sessionId: "lossy-session", clientRequestId: "msg-1", payload: null }, async (turn) => {
    turnId = turn.turnId;
    state.dropNext = isClaim;
    const result = await turn.tool("book", { amount: 1 }, {
      run: async (ctx) => {
        runs.push([ctx.attempt, ctx.previousOutcome]);
        return { entry: 1 };
      },
    });
    assert.deepEqual(result, { entry: 1 });
    return "ok";
  });
  assert.equal(state.dropped.length, 1);
  assert.match(state.dropped[0], /^201 /, "the lost answer was the claim's grant");
  assert.deepEqual(runs, [[2, "failed"]], "run once, on the claim after the lost one was failed");
  const page = await (await fetch(`${server.url}/v1/turns/${turnId}/executions`)).json();
  assert.deepEqual(page.executions.map((e) => [e.state, e.attempt]), [["succeeded", 2]]);
});

test("concurrent callers of one call with one claim answer lost: the tool runs once and every caller gets its result", async () => {
  const { state, fetchFunction } = lossyFetch();
  const lossy = new Gate({ baseUrl: server.url, fetch: fetchFunction });
  let runs = 0;
  const results = await lossy.turn({ userId: "lossy-many", sessionId: "lossy-many-session", clientRequestId: "msg-1", payload: null }, async (turn) => {
    state.dropNext = isClaim;
    return Promise.all(Array.from({ length: 8 }, () =>
      turn.tool("book", { amount: 1 }, {
        run: async () => {
          runs += 1;
          await sleep(50);
          return { entry: 1 };
        },
      })));
  });
  assert.equal(state.dropped.length, 1);
  assert.equal(runs, 1, "run executed once");
  assert.deepEqual(results, Array.from({ length: 8 }, () => ({ entry: 1 })));
});
