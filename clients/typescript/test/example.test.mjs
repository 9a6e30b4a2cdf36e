// examples/typescript/agent-loop.mjs, run as a person would run it, against
// the real server.

import assert from "node:assert/strict";
import { join } from "node:path";
import { fileURLToPath } from "node:url";
import { after, before, test } from "node:test";
import { Ledger, spawnNode, startServer, tempDir } from "./helpers.mjs";

const AGENT_LOOP = fileURLToPath(new URL("../../../examples/typescript/agent-loop.mjs", import.meta.url));

let server;
before(async () => { server = await startServer(); });
after(async () => { await server?.stop(); });

test("the agent loop double-texted (the same message id twice at once) books once and both get the same reply", async () => {
  const ledger = new Ledger(join(tempDir(), "ledger.jsonl"));
  const args = ["--url", server.url, "--ledger", ledger.path, "--user", "dt-user", "--session", "dt-chat", "--message-id", "msg-1", "--think-ms", "300", "taxi 18 yesterday"];
  const loops = [spawnNode(AGENT_LOOP, args), spawnNode(AGENT_LOOP, args)];
  const outputs = await Promise.all(loops.map(async (loop) => {
    const { code } = await loop.exited;
    assert.equal(code, 0, loop.stderr);
    return JSON.parse(loop.lines.at(-1));
  }));
  assert.equal(outputs[0].reply, "Booked 18 to taxi (entry 1).");
  assert.equal(outputs[1].reply, outputs[0].reply);
  assert.deepEqual(outputs.map((output) => output.ran).sort(), [false, true], "one ran the turn, the other got its replay");
  const entries = ledger.entries();
  assert.equal(entries.length, 1, "exactly one booking");
  assert.deepEqual({ amount: entries[0].amount, category: entries[0].category }, { amount: 18, category: "taxi" });
});

const BUN_BIN = process.env.BUN_BIN;

test("the agent loop runs under Bun: a booking, then its repeat replays", { skip: BUN_BIN ? false : "set BUN_BIN to a bun binary to run it" }, async () => {
  const ledger = new Ledger(join(tempDir(), "ledger.jsonl"));
  const args = ["--url", server.url, "--ledger", ledger.path, "--user", "bun-user", "--session", "bun-chat", "--message-id", "msg-1", "lunch 35"];
  const outputs = [];
  for (const expectRan of [true, false]) {
    const loop = spawnNode(AGENT_LOOP, args, {}, BUN_BIN);
    assert.equal((await loop.exited).code, 0, loop.stderr);
    outputs.push(JSON.parse(loop.lines.at(-1)));
    assert.equal(outputs.at(-1).ran, expectRan);
  }
  assert.equal(outputs[0].reply, "Booked 35 to lunch (entry 1).");
  assert.equal(outputs[1].reply, outputs[0].reply);
  assert.equal(ledger.entries().length, 1);
});
