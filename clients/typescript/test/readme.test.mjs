// The README's blocks marked <!-- runnable --> run as written against the
// real server (its address put in for http://127.0.0.1:7700, this build for
// "agentgate-client"), each in its own process and on its own server, with
// a short lease TTL so an interrupt is learnt within half a second.

import assert from "node:assert/strict";
import { spawnSync } from "node:child_process";
import { readFileSync, writeFileSync } from "node:fs";
import { join } from "node:path";
import { after, test } from "node:test";
import { CLIENT, startServer, tempDir } from "./helpers.mjs";

const README = new URL("../README.md", import.meta.url);
/** A block's bound: each takes about a second. */
const BLOCK_TIMEOUT_MS = 30_000;
const LEASE_TTL_MS = 1500;

const blocks = [...readFileSync(README, "utf8").matchAll(/<!-- runnable[^>]*-->\n```js\n([\s\S]*?)```/g)].map((match) => match[1]);
const servers = [];
after(async () => { await Promise.all(servers.map((server) => server.stop())); });

test("the README has runnable blocks", () => {
  assert.ok(blocks.length >= 3, `found ${blocks.length}`);
});

for (const [index, block] of blocks.entries()) {
  test(`runnable README block ${index} runs`, async () => {
    const server = await startServer({ leaseTtlMs: LEASE_TTL_MS });
    servers.push(server);
    const file = join(tempDir(), `block-${index}.mjs`);
    writeFileSync(file, block.replaceAll("http://127.0.0.1:7700", server.url).replaceAll('"agentgate-client"', JSON.stringify(CLIENT)));
    const run = spawnSync(process.execPath, [file], { encoding: "utf8", timeout: BLOCK_TIMEOUT_MS });
    assert.equal(run.status, 0, `${block}\n${run.stdout}${run.stderr}`);
  });
}
