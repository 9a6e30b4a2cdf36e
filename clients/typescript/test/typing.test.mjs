// What a TypeScript caller sees: test/typing/usage.ts (turn.tool<A, R> in
// the order of ToolOptions<A, R>, TurnOutcome, the busy policies, the
// error classes) compiles under the package's own strict tsconfig.

import assert from "node:assert/strict";
import { spawnSync } from "node:child_process";
import { createRequire } from "node:module";
import { fileURLToPath } from "node:url";
import { test } from "node:test";

const TSC = createRequire(import.meta.url).resolve("typescript/bin/tsc");
const PROJECT = fileURLToPath(new URL("./typing/tsconfig.json", import.meta.url));
/** tsc on one small file takes about 4 s here. */
const TSC_TIMEOUT_MS = 60_000;

test("tsc --strict passes on typed usage of the client (and its @ts-expect-error lines are errors)", () => {
  const run = spawnSync(process.execPath, [TSC, "-p", PROJECT], { encoding: "utf8", timeout: TSC_TIMEOUT_MS });
  assert.equal(run.status, 0, run.stdout + run.stderr);
});
