// Starts the real `agentgate serve` on a fresh SQLite store and a free port,
// for the tests and for `npm run gen`. Not part of the published package.
//
// With AGENTGATE_CLIENT_TEST_PG set to a PostgreSQL server URL without a
// database (postgres://postgres@127.0.0.1:5432), each server started gets a
// fresh database of its own instead (CREATE DATABASE agentgate_client_<random>
// through psql; the server makes its schema), `server.store` is its URL (a
// second node on the same store passes it to --store), and stop() drops it;
// any not dropped by then (a run cut short) are dropped as node exits.

import { execFile, spawn, spawnSync } from "node:child_process";
import { randomBytes } from "node:crypto";
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

/** A PostgreSQL server URL without a database; unset, each server gets a SQLite file. */
export const PG_SERVER = process.env.AGENTGATE_CLIENT_TEST_PG || undefined;
/** How long one psql command (CREATE or DROP DATABASE) may take. */
const PSQL_TIMEOUT_MS = 30_000;

/** PG_SERVER with its path set to `/database` (query kept). */
function pgUrl(database) {
  const url = new URL(PG_SERVER);
  url.pathname = `/${database}`;
  return url.toString();
}

function psqlArgs(sql) {
  return [pgUrl("postgres"), "-v", "ON_ERROR_STOP=1", "-qAtc", sql];
}

/** Runs `sql` on PG_SERVER's maintenance database `postgres`. */
function psql(sql) {
  return new Promise((resolve, reject) => {
    execFile("psql", psqlArgs(sql), { timeout: PSQL_TIMEOUT_MS }, (error, _stdout, stderr) => {
      if (error) reject(new Error(`psql ${JSON.stringify(sql)} failed: ${stderr.trim() || error.message}`));
      else resolve();
    });
  });
}

// FORCE: a server that would not stop (or a worker's leftover session) must
// not keep its database alive.
const dropSql = (database) => `DROP DATABASE IF EXISTS "${database}" WITH (FORCE)`;
/** Databases created and not yet dropped: dropped as node exits, whatever ends it. */
const liveDatabases = new Set();
/** Servers on them not yet stopped: killed first, or they would outlive node. */
const liveServers = new Set();
function dropLiveDatabases() {
  for (const child of liveServers) child.kill("SIGKILL");
  for (const database of liveDatabases) {
    spawnSync("psql", psqlArgs(dropSql(database)), { timeout: PSQL_TIMEOUT_MS, stdio: "ignore" });
  }
  liveDatabases.clear();
}
if (PG_SERVER) {
  process.on("exit", dropLiveDatabases);
  // A run cut short by a signal fires no "exit": drop, then die of the signal.
  for (const signal of ["SIGINT", "SIGTERM"]) {
    process.once(signal, () => {
      dropLiveDatabases();
      process.kill(process.pid, signal);
    });
  }
}

async function dropDatabase(database) {
  await psql(dropSql(database));
  liveDatabases.delete(database);
}

/**
 * `store` is the store URL (a second node on the same store passes it to --store).
 * @param {{ leaseTtlMs?: number, maxTurnsPerUser?: number, extraArgs?: string[] }} [options]
 * @returns {Promise<{ url: string, dir: string, store: string, process: import("node:child_process").ChildProcess, stop: () => Promise<void> }>}
 */
export async function startServer(options = {}) {
  const dir = mkdtempSync(join(tmpdir(), "agentgate-ts-"));
  let database;
  let store = `sqlite://${join(dir, "agentgate.db")}`;
  if (PG_SERVER) {
    database = `agentgate_client_${randomBytes(6).toString("hex")}`;
    await psql(`CREATE DATABASE "${database}"`);
    liveDatabases.add(database);
    store = pgUrl(database);
  }
  try {
    return await spawnServer(options, dir, store, database);
  } catch (error) {
    rmSync(dir, { recursive: true, force: true });
    if (database) await dropDatabase(database);
    throw error;
  }
}

async function spawnServer(options, dir, store, database) {
  const args = [
    "serve",
    "--listen", "127.0.0.1:0",
    "--no-app",
    "--store", store,
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
  if (database) {
    liveServers.add(child);
    child.once("exit", () => liveServers.delete(child));
  }
  return {
    url: `http://${address}`,
    dir,
    store,
    process: child,
    async stop() {
      if (child.exitCode === null && child.signalCode === null) child.kill("SIGKILL");
      await exited;
      rmSync(dir, { recursive: true, force: true });
      if (database) await dropDatabase(database);
    },
  };
}
