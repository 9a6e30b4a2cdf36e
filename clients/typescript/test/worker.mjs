// A worker process for the crash and lease-loss tests: runs one turn of
// "book a taxi" through the client, booking into a ledger file, and prints
// what happened as lines the test reads (TURN, BOOKED, RESULT, ...).
//
//   node test/worker.mjs '{"baseUrl":…,"mode":…,"ledger":…,…}'
//
// modes: crash    books, prints BOOKED, then hangs (the test SIGKILLs it)
//        takeover repeats the request (takes the turn over), reconciling
//        orphan   claims the orphan with turnIds: [turnId], reconciling
//        stall    prints IN_RUN and waits for turn.signal (the test
//                 SIGSTOPs it past the TTL, then SIGCONTs it)
//        drain    drains the session from requestId through the handoff,
//                 booking one ledger line per message: prints HOLDING in the
//                 first and waits for the file config.go (the test queues
//                 messages meanwhile); in the second, after its booking,
//                 prints BOOKED and hangs before the result is recorded (the
//                 test SIGKILLs it)

import { existsSync } from "node:fs";
import { Gate } from "../dist/index.js";
import { Ledger } from "./helpers.mjs";

const config = JSON.parse(process.argv[2]);
const gate = new Gate({ baseUrl: config.baseUrl });
const ledger = new Ledger(config.ledger);
const ARGS = { amount: 18, category: "taxi" };
/** crash mode hangs at most this long if nobody kills it; stall mode waits this long for the signal. */
const HANG_MS = 20_000;

const say = (tag, value = "") => process.stdout.write(`${tag} ${typeof value === "string" ? value : JSON.stringify(value)}\n`);
const sleep = (ms, signal) => new Promise((resolve) => {
  const timer = setTimeout(resolve, ms);
  signal?.addEventListener("abort", () => { clearTimeout(timer); resolve(); }, { once: true });
});

function book(ctx) {
  say("RUN", { previousOutcome: ctx.previousOutcome });
  return ledger.book({ key: ctx.idempotencyKey, ...ctx.args, by: config.mode, pid: process.pid });
}

function reconcile(ctx) {
  const found = ledger.find(ctx.idempotencyKey);
  say("RECONCILE", { found: found !== undefined });
  return found;
}

async function body(turn) {
  say("TURN", { turnId: turn.turnId, attempt: turn.attempt, takeover: turn.takeover, fence: turn.fence, leaseToken: turn.leaseToken });
  const entry = await turn.tool("create_transaction", ARGS, {
    reconcile,
    run: async (ctx) => {
      if (config.mode === "crash") {
        book(ctx);
        say("BOOKED", ctx.idempotencyKey);
        await sleep(HANG_MS);
        throw new Error("crash worker was not killed");
      }
      if (config.mode === "stall") {
        say("IN_RUN", { executionId: ctx.executionId });
        await sleep(HANG_MS, ctx.signal);
        say("ABORTED", { aborted: ctx.signal.aborted, code: ctx.signal.reason?.code });
        // Deliberately carry on as a worker that ignores its signal would:
        // write to the server with this lease's token, bypassing the client.
        const answer = await fetch(`${config.baseUrl}/v1/turns/${turn.turnId}/tools/${ctx.executionId}/complete`, {
          method: "POST",
          headers: { "content-type": "application/json", "lease-token": turn.leaseToken },
          body: JSON.stringify({ result: { by: "stalled worker" } }),
        });
        say("SERVER_ANSWER", { status: answer.status, code: (await answer.json()).error?.code });
        return { by: "stalled worker" };
      }
      return book(ctx);
    },
  });
  return { text: `booked ${entry.amount} to ${entry.category}`, entry };
}

async function drain() {
  let handled = 0;
  await gate.drain({ userId: config.userId, sessionId: config.sessionId, clientRequestId: config.requestId, payload: { message: config.requestId } }, async (turn) => {
    handled += 1;
    const mine = handled;
    if (mine === 1) {
      say("HOLDING", turn.turnId);
      for (const deadline = Date.now() + HANG_MS; !existsSync(config.go);) {
        if (Date.now() > deadline) throw new Error(`no ${config.go}`);
        await sleep(10);
      }
    }
    const reply = await turn.tool("book", { message: turn.clientRequestId }, {
      run: async (ctx) => {
        ledger.book({ key: ctx.idempotencyKey, message: ctx.args.message, pid: process.pid });
        if (mine === 2) {
          say("BOOKED", turn.clientRequestId);
          await sleep(HANG_MS);
        }
        return { booked: ctx.args.message };
      },
    });
    return { reply };
  });
  say("DRAINED");
}

try {
  if (config.mode === "drain") {
    await drain();
  } else if (config.mode === "orphan") {
    const claimed = await gate.claimOrphan({ turnIds: [config.turnId] }, body);
    say(claimed === null ? "NO_ORPHAN" : "RESULT", claimed ?? "");
  } else {
    const response = await gate.turn(
      { userId: config.userId, sessionId: config.sessionId, clientRequestId: config.requestId, payload: { text: "taxi 18" }, waitMs: config.waitMs ?? 0 },
      body,
    );
    say("RESULT", response);
  }
} catch (error) {
  say("TURN_REJECTED", { name: error.name, code: error.code });
}
