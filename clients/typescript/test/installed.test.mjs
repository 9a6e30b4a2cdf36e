// When clients/check-packages.sh runs this suite against the npm-installed
// tarball (AGENTGATE_TS_EXPECT_INSTALLED: the installed package's folder),
// what the tests import as ../dist/index.js, the README blocks' CLIENT and
// the example's import of the client all resolve into that installed copy,
// never a source-tree build. Skipped in the ordinary (source-tree) run.

import assert from "node:assert/strict";
import { readFileSync, realpathSync } from "node:fs";
import { join, sep } from "node:path";
import { test } from "node:test";
import { fileURLToPath } from "node:url";
import * as client from "../dist/index.js";
import { CLIENT } from "./helpers.mjs";

const INSTALLED = process.env.AGENTGATE_TS_EXPECT_INSTALLED;
const AGENT_LOOP = new URL("../../../examples/typescript/agent-loop.mjs", import.meta.url);
const skip = !INSTALLED && "the source-tree run; clients/check-packages.sh typescript runs this against the installed tarball";

test("the client under test is the installed tarball, not the source tree", { skip }, () => {
  const root = realpathSync(INSTALLED) + sep;
  assert.ok(root.includes(`${sep}node_modules${sep}agentgate-client${sep}`), root);
  const inside = (path) => assert.ok(realpathSync(path).startsWith(root), `${path} -> ${realpathSync(path)}, not in ${root}`);
  inside(fileURLToPath(import.meta.resolve("../dist/index.js")));
  inside(CLIENT);
  const imports = [...readFileSync(AGENT_LOOP, "utf8").matchAll(/^import .* from "([^"]*dist\/index\.js)";$/gm)];
  assert.ok(imports.length > 0, "the example imports the client");
  for (const [, specifier] of imports) inside(fileURLToPath(new URL(specifier, AGENT_LOOP)));
  const manifest = JSON.parse(readFileSync(join(root, "package.json"), "utf8"));
  assert.equal(manifest.name, "agentgate-client");
  assert.equal(typeof client.Gate, "function");
});
