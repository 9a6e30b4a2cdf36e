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
