// Test support: the real server (scripts/server.mjs), a ledger file that
// stands for the downstream system a tool books into, and worker processes
// whose output the tests read line by line. Every wait has a named bound.

import { spawn } from "node:child_process";
import { appendFileSync, existsSync, mkdtempSync, readFileSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { fileURLToPath } from "node:url";

export { startServer } from "../scripts/server.mjs";

export const WORKER = fileURLToPath(new URL("./worker.mjs", import.meta.url));
export const CLIENT = fileURLToPath(new URL("../dist/index.js", import.meta.url));

/** How long a test waits for a worker's next expected line before failing. */
export const LINE_TIMEOUT_MS = 20_000;

export function tempDir() {
  return mkdtempSync(join(tmpdir(), "agentgate-ts-test-"));
}

/** The downstream system: one JSON line per booking, found by idempotency key. */
export class Ledger {
  constructor(path) { this.path = path; }
  book(entry) {
    // One appendFileSync of one line: a process killed after it returns has
    // booked; one killed before has not. That is the window `unknown` covers.
    appendFileSync(this.path, JSON.stringify(entry) + "\n");
    return entry;
  }
  entries() {
    if (!existsSync(this.path)) return [];
    return readFileSync(this.path, "utf8").split("\n").filter(Boolean).map((line) => JSON.parse(line));
  }
  find(key) {
    return this.entries().find((entry) => entry.key === key);
  }
}

/**
 * Spawns `node script ...args` and collects its stdout lines; `next(prefix)`
 * resolves with the first line starting with `prefix` (from the beginning
 * of the output), failing after LINE_TIMEOUT_MS.
 */
export function spawnNode(script, args, env = {}, runtime = process.execPath) {
  const child = spawn(runtime, [script, ...args], {
    stdio: ["ignore", "pipe", "pipe"],
    env: { ...process.env, ...env },
  });
  const lines = [];
  const waiters = new Set();
  let buffer = "";
  let stderr = "";
  child.stdout.setEncoding("utf8");
  child.stdout.on("data", (chunk) => {
    buffer += chunk;
    let newline;
    while ((newline = buffer.indexOf("\n")) >= 0) {
      lines.push(buffer.slice(0, newline));
      buffer = buffer.slice(newline + 1);
    }
    for (const waiter of waiters) waiter();
  });
  child.stderr.on("data", (chunk) => { stderr = (stderr + chunk).slice(-4000); });
  const exited = new Promise((resolve) => child.once("exit", (code, signal) => {
    for (const waiter of waiters) waiter();
    resolve({ code, signal });
  }));
  return {
    child,
    lines,
    exited,
    get stderr() { return stderr; },
    next(prefix, timeoutMs = LINE_TIMEOUT_MS) {
      return new Promise((resolve, reject) => {
        const check = () => {
          const line = lines.find((candidate) => candidate.startsWith(prefix));
          if (line !== undefined) { finish(); resolve(line.slice(prefix.length).trim()); return true; }
          if (child.exitCode !== null || child.signalCode !== null) {
            finish();
            reject(new Error(`worker exited (${child.exitCode ?? child.signalCode}) without "${prefix}"; stdout: ${lines.join(" | ")}; stderr: ${stderr}`));
            return true;
          }
          return false;
        };
        const timer = setTimeout(() => {
          finish();
          reject(new Error(`no "${prefix}" within ${timeoutMs} ms; stdout: ${lines.join(" | ")}; stderr: ${stderr}`));
        }, timeoutMs);
        const finish = () => { clearTimeout(timer); waiters.delete(check); };
        if (!check()) waiters.add(check);
      });
    },
    kill(signal = "SIGKILL") {
      if (child.exitCode === null && child.signalCode === null) child.kill(signal);
    },
  };
}

export function sleep(ms) {
  return new Promise((resolve) => setTimeout(resolve, ms));
}

/** A promise and the functions that settle it (a latch between callbacks). */
export function deferred() {
  let resolve, reject;
  const promise = new Promise((res, rej) => { resolve = res; reject = rej; });
  return { promise, resolve, reject };
}
