// Starts the real `agentgate serve` on a fresh SQLite store and a free port,
// for the tests and for `npm run gen`. Not part of the published package.

import { spawn } from "node:child_process";
import { mkdtempSync, rmSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { fileURLToPath } from "node:url";

/** The server under test: AGENTGATE_BIN, else the checkout's debug build. */
export const AGENTGATE_BIN =
  process.env.AGENTGATE_BIN ||
  join(process.env.CARGO_TARGET_DIR || fileURLToPath(new URL("../../../target", import.meta.url)), "debug", "agentgate");

// A debug build on a busy 2-core machine can take a few seconds to open the
// store and bind; longer than this means it is not going to.
const STARTUP_TIMEOUT_MS = 15_000;

/**
 * @param {{ leaseTtlMs?: number, maxTurnsPerUser?: number, extraArgs?: string[] }} [options]
 * @returns {Promise<{ url: string, dir: string, process: import("node:child_process").ChildProcess, stop: () => Promise<void> }>}
 */
export async function startServer(options = {}) {
  const dir = mkdtempSync(join(tmpdir(), "agentgate-ts-"));
  const args = [
    "serve",
    "--listen", "127.0.0.1:0",
    "--no-app",
    "--store", `sqlite://${join(dir, "agentgate.db")}`,
  ];
  if (options.leaseTtlMs !== undefined) args.push("--lease-ttl-ms", String(options.leaseTtlMs));
  if (options.maxTurnsPerUser !== undefined) args.push("--max-turns-per-user", String(options.maxTurnsPerUser));
  args.push(...(options.extraArgs ?? []));
  const child = spawn(AGENTGATE_BIN, args, {
    stdio: ["ignore", "pipe", "pipe"],
    env: { ...process.env, RUST_LOG: process.env.RUST_LOG ?? "warn" },
  });
  let stderr = "";
  child.stderr.on("data", (chunk) => { stderr = (stderr + chunk).slice(-4000); });
  const address = await new Promise((resolve, reject) => {
    let stdout = "";
    const timer = setTimeout(() => {
      child.kill("SIGKILL");
      reject(new Error(`agentgate did not print "listening on" within ${STARTUP_TIMEOUT_MS} ms: ${stderr}`));
    }, STARTUP_TIMEOUT_MS);
    child.stdout.on("data", (chunk) => {
      stdout += chunk;
      const match = /listening on (\S+)/.exec(stdout);
      if (match) { clearTimeout(timer); resolve(match[1]); }
    });
    child.on("error", (error) => { clearTimeout(timer); reject(error); });
    child.on("exit", (code, signal) => {
      clearTimeout(timer);
      reject(new Error(`agentgate exited (${code ?? signal}) before listening: ${stderr}`));
    });
  });
  const exited = new Promise((resolve) => child.once("exit", resolve));
  return {
    url: `http://${address}`,
    dir,
    process: child,
    async stop() {
      if (child.exitCode === null && child.signalCode === null) child.kill("SIGKILL");
      await exited;
      rmSync(dir, { recursive: true, force: true });
    },
  };
}
