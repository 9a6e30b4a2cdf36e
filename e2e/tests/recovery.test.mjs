// Every turn ends, by itself (docs/protocol.md §4.10, §11 "recovers by
// itself"; issue 9, "Prove it — browser"). The server is SIGKILLed at four
// points of a booking turn, restarted on the same store and port, and the
// page is left alone: each turn must end within the lease TTL plus a few
// seconds with exactly one ledger row, and the page must show the reply.
//
// How each kill point is reached (the server is observed, never guessed):
//   1 before the tool claim   — the turn is running and its executions hold
//                               no `create_transaction` yet (the model's
//                               first round is thinking): polled on
//                               GET /v1/turns/{id}.
//   2 claimed, not committed  — the window between the claim's commit and
//                               the booking's commit is a few milliseconds
//                               on one connection, out of reach of timing.
//                               The test widens it with a fault: a SQLite
//                               trigger that burns seconds of CPU inside the
//                               booking's SQL transaction (before its
//                               commit). It kills on seeing the claim
//                               (`create_transaction` running), then drops
//                               the trigger while the server is dead.
//   3 booked, no reply        — `create_transaction` succeeded and the
//                               model's last round is thinking.
//   4 reply streaming         — the page's live bubble shows streamed text
//                               and the turn has no reply yet.
// What the kill actually left is read back from the restarted server before
// its recovery worker's first look (GET /v1/turns/{id}) and asserted.
// Screenshots: /tmp/h5-<point>-restart.png and /tmp/h5-<point>-recovered.png.

import { test, before, after } from "node:test";
import assert from "node:assert/strict";
import { execFileSync } from "node:child_process";
import { readFileSync } from "node:fs";
import path from "node:path";
import {
  startServer, launchBrowser, entries, getJson, chatUrl, eventually, unique, freePort,
} from "../lib/harness.mjs";

const LEASE_TTL_MS = 2000;
/** Per model round: long enough to kill inside a round, short enough to keep the file fast. */
const THINK_TIME_MS = 800;
/** The recovery worker looks every 2 s; a resumed turn reruns its unfinished rounds. */
const RECOVERY_BUDGET_MS = LEASE_TTL_MS + 2000 + 3 * THINK_TIME_MS + 4000;
const FINAL = "#messages li.msg.assistant[data-state=final]";
const MESSAGE = "taxi 18";

let browser;
const table = [];

before(async () => {
  browser = await launchBrowser();
});

after(async () => {
  await browser?.close();
  console.log("kill point                 | state at kill                  | rows | reply shown | s restart→reply | resumed by");
  for (const row of table) {
    console.log(
      `${row.point.padEnd(26)} | ${row.killed.padEnd(30)} | ${String(row.rows).padEnd(4)} | ${row.shown ? "yes" : "no "}         | ${row.seconds.toFixed(1).padEnd(15)} | ${row.resumedBy}`,
    );
  }
});

function sqlite(dir, sql) {
  execFileSync("sqlite3", ["-cmd", ".timeout 5000", path.join(dir, "agentgate.db"), sql]);
}

/** A booking trigger that computes for seconds inside the booking's SQL transaction. */
const SLOW_BOOKING =
  "CREATE TRIGGER e2e_slow_booking BEFORE INSERT ON ledger_entries BEGIN " +
  "SELECT count(*) FROM (WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM c WHERE x < 50000000) SELECT x FROM c); END;";

async function turnId(base, user, session) {
  return eventually(async () => {
    const { turns } = await getJson(base, `/app/transcript?user_id=${user}&session_id=${session}`);
    return turns[0]?.turn_id;
  }, { intervalMs: 10, what: "the turn id" });
}

function booking(view) {
  return view.executions.find((e) => e.tool === "create_transaction");
}

/** One line per execution: "model_round:succeeded,create_transaction:running". */
function describe(view) {
  return view.executions.map((e) => `${e.tool === "model_round" ? "round" : e.tool === "create_transaction" ? "booking" : "list"}:${e.state}`).join(",");
}

const POINTS = [
  {
    name: "1 before the tool claim",
    async reach({ base, turn }) {
      return eventually(async () => {
        const view = await getJson(base, `/v1/turns/${turn}`);
        return !booking(view) && view.turn.state === "running" ? view : null;
      }, { intervalMs: 10, what: "a running turn before its booking claim" });
    },
    check(view) {
      assert.equal(booking(view), undefined, describe(view));
    },
  },
  {
    name: "2 claimed, not committed",
    slowBooking: true,
    async reach({ base, turn }) {
      return eventually(async () => {
        const view = await getJson(base, `/v1/turns/${turn}`);
        return booking(view) ? view : null;
      }, { intervalMs: 10, what: "the booking claim" });
    },
    check(view, rows) {
      assert.equal(booking(view)?.state, "running", describe(view));
      assert.equal(rows, 0, "nothing was booked before the kill");
    },
  },
  {
    name: "3 booked, no reply",
    async reach({ base, turn }) {
      return eventually(async () => {
        const view = await getJson(base, `/v1/turns/${turn}`);
        return booking(view)?.state === "succeeded" ? view : null;
      }, { intervalMs: 10, what: "the booking's success" });
    },
    check(view, rows) {
      assert.equal(booking(view)?.state, "succeeded", describe(view));
      assert.equal(rows, 1);
    },
  },
  {
    name: "4 reply streaming",
    async reach({ page }) {
      await page.waitForFunction(
        () => (document.querySelector("#messages li.msg.assistant[data-state=running] .bubble")?.textContent || "").length > 0,
        null,
        { polling: 10, timeout: 20_000 },
      );
      return null;
    },
    check(view, rows) {
      assert.equal(booking(view)?.state, "succeeded", describe(view));
      assert.equal(rows, 1);
    },
  },
];

for (const point of POINTS) {
  test(`killed at ${point.name}: the turn ends by itself, booked once, and the page shows the reply`, async () => {
    const port = await freePort();
    const slug = point.name.split(" ")[0];
    const options = {
      thinkTimeMs: THINK_TIME_MS,
      listen: `127.0.0.1:${port}`,
      args: ["--lease-ttl-ms", String(LEASE_TTL_MS)],
    };
    const first = await startServer({ name: `recovery-${slug}-1`, ...options });
    const user = unique("recover");
    const session = "s-recover";
    let second;
    const page = await browser.newTab(chatUrl(first.base, user, session));
    try {
      if (point.slowBooking) sqlite(first.dir, SLOW_BOOKING);
      await page.fill("#composer-input", MESSAGE);
      await page.click("#send");
      const turn = await turnId(first.base, user, session);
      await point.reach({ base: first.base, turn, page });
      await first.stop({ keepStore: true, signal: "SIGKILL" });
      if (point.slowBooking) sqlite(first.dir, "DROP TRIGGER e2e_slow_booking;");

      second = await startServer({ ...options, name: `recovery-${slug}-2`, dir: first.dir });
      const restartedAt = Date.now();
      // What the kill left, read before the worker's first look (2 s after start).
      const view = await getJson(second.base, `/v1/turns/${turn}`);
      const rowsAtKill = (await entries(second.base, user)).length;
      assert.equal(view.turn.state, "running", "the killed turn is still running");
      assert.equal(view.turn.attempt, 1, "nobody took it over yet");
      point.check(view, rowsAtKill);
      await page.screenshot({ path: `/tmp/h5-${slug}-restart.png`, fullPage: true });

      // Hands off the page: the turn must end and the reply show by itself.
      await page.waitForSelector(FINAL, { timeout: RECOVERY_BUDGET_MS });
      const seconds = (Date.now() - restartedAt) / 1000;
      assert.match(await page.textContent(FINAL), /18\.00/);
      const ended = await getJson(second.base, `/v1/turns/${turn}`);
      assert.equal(ended.turn.state, "succeeded", describe(ended));
      const booked = await entries(second.base, user);
      assert.equal(booked.length, 1, JSON.stringify(booked));
      assert.equal(booked[0].amount_cents, 1800);
      assert.equal(await page.locator("#messages li.msg.user").count(), 1);
      assert.equal(await page.locator(FINAL).count(), 1);
      // Every notice left on the page is true: the reply is in, so none
      // saying it is still being processed or will be asked for again.
      await eventually(async () => !(await page.isVisible("#notice")), {
        timeoutMs: 2000,
        what: `the notice to go (it says: ${await page.textContent("#notice")})`,
      });
      await page.screenshot({ path: `/tmp/h5-${slug}-recovered.png`, fullPage: true });
      const log = readFileSync(second.log, "utf8");
      table.push({
        point: point.name,
        killed: `${describe(view)}; rows ${rowsAtKill}`,
        rows: booked.length,
        shown: true,
        seconds,
        resumedBy: log.includes("resuming an orphaned turn") ? "recovery worker" : "page's resend",
      });
    } finally {
      await page.close();
      await second?.stop();
      if (!second) await first.stop();
    }
  });
}
