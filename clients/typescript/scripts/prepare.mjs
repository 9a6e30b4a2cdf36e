// npm's `prepare` script: compiles src/ to dist/ with the pinned tsc, so the
// package installs from its folder (`npm install path/to/clients/typescript`)
// and packs (`npm pack`, whose tarball ships dist/) without a manual
// setup.sh first. npm runs it after `npm install`/`npm ci` in this folder,
// before `npm pack`/`npm publish`, and for a folder dependency: that last one
// links this folder without installing its devDependencies, so when tsc is
// missing this installs them first, exactly as package-lock.json pins them
// (`npm ci --ignore-scripts`, from the registry or npm's cache). A tarball
// install never runs it: dist/ is already inside.

import { spawnSync } from "node:child_process";
import { existsSync } from "node:fs";
import { dirname, join } from "node:path";
import { fileURLToPath } from "node:url";

const root = dirname(dirname(fileURLToPath(import.meta.url)));
const tsc = join(root, "node_modules", "typescript", "bin", "tsc");

function run(command, args) {
  const result = spawnSync(command, args, { cwd: root, stdio: "inherit" });
  if (result.error) throw result.error;
  if (result.status !== 0) {
    console.error(`agentgate-client prepare: ${[command, ...args].join(" ")} failed (${result.status ?? result.signal})`);
    process.exit(1);
  }
}

if (!existsSync(tsc)) {
  console.error("agentgate-client prepare: installing the pinned devDependencies (npm ci) to compile dist/");
  // The npm running this script (npm_execpath), else npm on PATH.
  const npm = process.env.npm_execpath;
  const ci = ["ci", "--ignore-scripts", "--no-audit", "--no-fund", "--prefix", root];
  if (npm && /npm-cli\.c?js$/.test(npm)) run(process.execPath, [npm, ...ci]);
  else run(process.platform === "win32" ? "npm.cmd" : "npm", ci);
}
run(process.execPath, [tsc, "-p", join(root, "tsconfig.json")]);
