// Test support: start the real `agentgate` binary on a free port with a temp
// SQLite store, launch Debian's Chromium through playwright-core (never a
// downloaded browser), talk to the app's JSON endpoints.

import { spawn } from "node:child_process";
import net from "node:net";
import { mkdtempSync, mkdirSync, rmSync, openSync } from "node:fs";
import { tmpdir } from "node:os";
import path from "node:path";
import { fileURLToPath } from "node:url";
import { chromium } from "playwright-core";

const here = path.dirname(fileURLToPath(import.meta.url));
/** The repository root (e2e/..). */
export const ROOT = path.resolve(here, "..", "..");
/** Screenshots and server logs land here (gitignored). */
export const ARTIFACTS = path.join(ROOT, "e2e", "artifacts");
/** The binary under test: $AGENTGATE_BIN, else the debug build. */
export const BIN = process.env.AGENTGATE_BIN || path.join(ROOT, "target", "debug", "agentgate");
/** Debian's Chromium: `apt-get install -y chromium`. */
export const CHROMIUM = process.env.AGENTGATE_CHROMIUM || "/usr/bin/chromium";

/** How long the binary may take to print its address (a debug build opening a fresh store). */
const STARTUP_TIMEOUT_MS = 15_000;

mkdirSync(ARTIFACTS, { recursive: true });

/**
 * Starts `agentgate serve` on 127.0.0.1:0 with a fresh SQLite store.
 * `thinkTimeMs` is the offline model's time per round (a turn is three rounds).
 */
export async function startServer({ name, thinkTimeMs = 400, args = [], listen = "127.0.0.1:0", dir: storeDir } = {}) {
  // A given `dir` is an earlier server's store: a restart on the same data.
  const dir = storeDir || mkdtempSync(path.join(tmpdir(), "agentgate-e2e-"));
  const log = path.join(ARTIFACTS, `${name || "server"}.log`);
  const child = spawn(
    BIN,
    [
      "serve",
      "--listen", listen,
      "--store", `sqlite://${path.join(dir, "agentgate.db")}`,
      "--think-time-ms", String(thinkTimeMs),
      ...args,
    ],
    { stdio: ["ignore", "pipe", openSync(log, "w")], env: { ...process.env, RUST_LOG: "info" } },
  );
  const base = await new Promise((resolve, reject) => {
    const timer = setTimeout(() => reject(new Error(`agentgate did not start; see ${log}`)), STARTUP_TIMEOUT_MS);
    let buffer = "";
    child.stdout.on("data", (chunk) => {
      buffer += chunk;
      const match = buffer.match(/listening on (\S+)/);
      if (match) {
        clearTimeout(timer);
        resolve(`http://${match[1]}`);
      }
    });
    child.on("exit", (code) => {
      clearTimeout(timer);
      reject(new Error(`agentgate exited with ${code}; see ${log}`));
    });
  });
  child.stdout.resume();
  return {
    base,
    dir,
    log,
    /** The port it listens on. */
    port: Number(new URL(base).port),
    /** Stops it; `keepStore` leaves the store for a restart; `signal` SIGKILL is a crash. */
    async stop({ keepStore = false, signal = "SIGTERM" } = {}) {
      if (child.exitCode === null && child.signalCode === null) {
        const exited = new Promise((resolve) => child.once("exit", resolve));
        child.kill(signal);
        await exited;
      }
      if (!keepStore) rmSync(dir, { recursive: true, force: true });
    },
  };
}

/** A Chromium context with a fresh profile directory; its pages are tabs. `locale` sets navigator.language. */
export async function launchBrowser({ locale = "en-US" } = {}) {
  const profile = mkdtempSync(path.join(tmpdir(), "agentgate-chromium-"));
  const context = await chromium.launchPersistentContext(profile, {
    executablePath: CHROMIUM,
    headless: true,
    locale,
    viewport: { width: 1360, height: 860 },
    timezoneId: "Asia/Shanghai",
    args: [
      "--headless",
      "--no-sandbox",
      "--disable-gpu",
      "--disable-quic",
      "--no-first-run",
      "--disable-background-networking",
      "--disable-component-update",
      "--disable-sync",
    ],
  });
  return {
    context,
    async newTab(url) {
      const page = await context.newPage();
      page.on("pageerror", (error) => console.error(`page error: ${error.message}`));
      if (url) {
        await page.goto(url);
        await page.waitForSelector("body[data-ready=true]");
      }
      return page;
    },
    async close() {
      await context.close();
      rmSync(profile, { recursive: true, force: true });
    },
  };
}

/** GET a JSON endpoint of the server. */
export async function getJson(base, pathAndQuery) {
  const response = await fetch(base + pathAndQuery);
  const body = await response.json();
  if (!response.ok) throw new Error(`${pathAndQuery}: ${response.status} ${JSON.stringify(body)}`);
  return body;
}

/** The user's ledger entries, from the JSON endpoint. */
export async function entries(base, user) {
  return (await getJson(base, `/app/ledger?user_id=${encodeURIComponent(user)}`)).entries;
}

/**
 * Waits until nothing more can be booked for `user` from `page`: the page's
 * outbox is empty (no resend scheduled) and the user has no live turn. A
 * later resend of an accepted message can only replay it, so a count taken
 * then is final, with no fixed sleep.
 */
export async function settled(base, page, user) {
  await eventually(
    async () => {
      const outbox = await page.evaluate(() => JSON.parse(localStorage.getItem("agentgate.outbox") || "[]").length);
      const view = await getJson(base, `/v1/users/${encodeURIComponent(user)}`);
      return outbox === 0 && view.user.live_turns === 0;
    },
    { what: "no resend scheduled and no live turn" },
  );
}

/** The chat page of `user` in `session`. */
export function chatUrl(base, user, session) {
  return `${base}/#${new URLSearchParams({ user, session })}`;
}

/** Polls `check` until it returns a truthy value, or fails after `timeoutMs`. */
export async function eventually(check, { timeoutMs = 20_000, intervalMs = 100, what = "condition" } = {}) {
  const deadline = Date.now() + timeoutMs;
  let last;
  while (Date.now() < deadline) {
    last = await check();
    if (last) return last;
    await new Promise((resolve) => setTimeout(resolve, intervalMs));
  }
  throw new Error(`timed out waiting for ${what} (last: ${JSON.stringify(last)})`);
}

/** A unique id for this run, so tests never share users or sessions. */
export function unique(prefix) {
  return `${prefix}-${Date.now().toString(36)}-${Math.random().toString(36).slice(2, 7)}`;
}

/** A port free on 127.0.0.1 now: a server restarted on it keeps the page's address. */
export async function freePort() {
  return new Promise((resolve, reject) => {
    const probe = net.createServer();
    probe.once("error", reject);
    probe.listen(0, "127.0.0.1", () => {
      const { port } = probe.address();
      probe.close(() => resolve(port));
    });
  });
}

/**
 * A TCP proxy on 127.0.0.1 in front of one node of a cluster, as a load
 * balancer is: the page talks to the proxy's port, and `target` names the
 * node new connections go to. A node that dies breaks its connections; the
 * page's next ones reach whichever node `target` names then.
 */
export async function tcpProxy(targetPort) {
  const sockets = new Set();
  const proxy = {
    target: targetPort,
    port: 0,
    close: () => new Promise((resolve) => {
      for (const socket of sockets) socket.destroy();
      server.close(() => resolve());
    }),
  };
  const server = net.createServer((client) => {
    const upstream = net.connect(proxy.target, "127.0.0.1");
    for (const socket of [client, upstream]) {
      sockets.add(socket);
      socket.on("close", () => sockets.delete(socket));
      socket.on("error", () => {
        client.destroy();
        upstream.destroy();
      });
    }
    client.pipe(upstream).pipe(client);
  });
  await new Promise((resolve, reject) => {
    server.once("error", reject);
    server.listen(0, "127.0.0.1", resolve);
  });
  proxy.port = server.address().port;
  return proxy;
}
