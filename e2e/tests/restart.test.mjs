// What a person sees when the server goes away and comes back (issue 32).
//
// An approval whose reply is cut by a crash (issue 32: "the card says
// Approved. before the booking has committed"). The approval's
// continuation books first; the window before that commit is widened with
// a fault (a SQLite trigger that computes for seconds inside the booking's
// transaction, as tests/recovery.test.mjs does), and the server is
// SIGKILLed inside it. The card must not say "Approved." then. After a
// restart on the same store and port the continuation ends by itself,
// books once, and the page shows it.
//
// The "lost contact" notice goes within a second of the server's return
// (it polled at the idle pace and stayed 1.4-2.3 s).

import { test, before, after } from "node:test";
import assert from "node:assert/strict";
import path from "node:path";
import { execFileSync } from "node:child_process";
import {
  ARTIFACTS, startServer, launchBrowser, entries, chatUrl, eventually, unique, freePort,
} from "../lib/harness.mjs";

const LEASE_TTL_MS = 2000;
/** Per model round: the continuation's booking comes after one, so a kill lands before it. */
const THINK_TIME_MS = 1500;
const CARD = ".confirm-card";

/** A booking trigger that computes for seconds inside the booking's SQL transaction. */
const SLOW_BOOKING =
  "CREATE TRIGGER e2e_slow_booking BEFORE INSERT ON ledger_entries BEGIN " +
  "SELECT count(*) FROM (WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM c WHERE x < 50000000) SELECT x FROM c); END;";

function sqlite(dir, sql) {
  execFileSync("sqlite3", ["-cmd", ".timeout 5000", path.join(dir, "agentgate.db"), sql]);
}

let browser;

before(async () => {
  browser = await launchBrowser();
});

after(async () => {
  await browser?.close();
});

test("an approval cut off by a crash before it booked is not shown as Approved.; after the restart it books once", async () => {
  const port = await freePort();
  const options = {
    thinkTimeMs: THINK_TIME_MS,
    listen: `127.0.0.1:${port}`,
    args: ["--lease-ttl-ms", String(LEASE_TTL_MS)],
  };
  const first = await startServer({ name: "confirm-crash-1", ...options });
  const user = unique("approvekill");
  const session = "s-approve-kill";
  let second;
  const page = await browser.newTab(chatUrl(first.base, user, session));
  try {
    await page.fill("#composer-input", "salary 8000");
    await page.click("#send");
    await page.waitForSelector(`${CARD}:not(.answered) button.approve`, { timeout: 30_000 });
    sqlite(first.dir, SLOW_BOOKING);
    await page.click(`${CARD}:not(.answered) button.approve`);
    // The continuation runs: its bubble is on the page, and its booking is
    // inside the slow transaction, not committed.
    await page.locator("#messages li.msg.user", { hasText: "Approve" }).waitFor({ timeout: 10_000 });
    await first.stop({ keepStore: true, signal: "SIGKILL" });
    sqlite(first.dir, "DROP TRIGGER e2e_slow_booking;");
    assert.equal(
      execFileSync("sqlite3", [path.join(first.dir, "agentgate.db"), "SELECT count(*) FROM ledger_entries;"]).toString().trim(),
      "0",
      "killed before the booking committed",
    );

    const status = page.locator(`${CARD} .status`).first();
    await eventually(async () => (await status.textContent()) !== "Sending…", {
      what: "the card to learn its reply broke off",
    });
    const said = await status.textContent();
    assert.doesNotMatch(said, /^Approved\.$/, "nothing was booked: the card must not say Approved.");
    assert.match(said, /Answer sent/, said);
    await page.screenshot({ path: path.join(ARTIFACTS, "confirm-crash-cut.png"), fullPage: true });

    second = await startServer({ ...options, name: "confirm-crash-2", dir: first.dir });
    await eventually(async () => (await entries(second.base, user)).length === 1, {
      timeoutMs: 30_000,
      what: "the approved entry to be booked by the resumed continuation",
    });
    await page.waitForSelector("#messages li.msg.assistant[data-state=final]", { timeout: 30_000 });
    assert.match(await page.textContent("#messages li.msg.assistant[data-state=final]"), /8000\.00/);
    await page.screenshot({ path: path.join(ARTIFACTS, "confirm-crash-recovered.png"), fullPage: true });
    const booked = await entries(second.base, user);
    assert.equal(booked.length, 1, JSON.stringify(booked));
    assert.equal(booked[0].amount_cents, 800000);
  } finally {
    await page.close();
    await second?.stop();
    await first.stop();
  }
});

test("the offline notice goes within a second of the server's return", async () => {
  const port = await freePort();
  const options = { listen: `127.0.0.1:${port}` };
  const first = await startServer({ name: "offline-1", ...options });
  const page = await browser.newTab(chatUrl(first.base, unique("offline"), "s-offline"));
  let second;
  try {
    await page.waitForSelector("#composer-input");
    await first.stop({ keepStore: true, signal: "SIGKILL" });
    await page.waitForSelector("#notice:not([hidden])", { timeout: 10_000 });
    assert.match(await page.textContent("#notice"), /Lost contact with the server/);
    second = await startServer({ ...options, name: "offline-2", dir: first.dir });
    const back = Date.now();
    await page.waitForSelector("#notice", { state: "hidden", timeout: 10_000 });
    const stayed = Date.now() - back;
    console.log(`offline notice stayed ${stayed} ms after the server answered again`);
    assert.ok(stayed < 1000, `the notice stayed ${stayed} ms after the server was back`);
  } finally {
    await page.close();
    await second?.stop();
    await first.stop();
  }
});

/** The race rounds of the next test: each races approve and reject, then kills the server. */
const RACE_ROUNDS = 3;
/** How long after the two answers the server is killed (the issue saw this at ~120 ms). */
const KILL_AFTER_MS = 120;
/** How long the server stays down: past a losing tab's next ask (at most 2 s after its first). */
const DOWN_MS = 2500;

test("approve and reject race in two tabs and the server dies: after the restart no tab asks to press again, and what they say is what happened (3 rounds)", async () => {
  const port = await freePort();
  const options = { thinkTimeMs: 300, listen: `127.0.0.1:${port}`, args: ["--lease-ttl-ms", "2000"] };
  let server = await startServer({ name: "race-kill-0", ...options });
  const seen = [];
  try {
    for (let round = 1; round <= RACE_ROUNDS; round += 1) {
      const user = unique(`racekill${round}`);
      const session = `s-race-${round}`;
      const tabA = await browser.newTab(chatUrl(server.base, user, session));
      const tabB = await browser.newTab(chatUrl(server.base, user, session));
      try {
        await tabA.fill("#composer-input", "salary 8000");
        await tabA.click("#send");
        const live = `${CARD}:not(.answered)`;
        await tabA.waitForSelector(`${live} button.approve`, { timeout: 30_000 });
        await tabB.waitForSelector(`${live} button.reject`, { timeout: 30_000 });
        // Taken first and pressed together: a tab that learns of the other's
        // answer redraws its card with no button left to press.
        const [approve, reject] = await Promise.all([tabA.$(`${live} button.approve`), tabB.$(`${live} button.reject`)]);
        await Promise.all([approve.evaluate((b) => b.click()), reject.evaluate((b) => b.click())]);
        await new Promise((resolve) => setTimeout(resolve, KILL_AFTER_MS));
        await server.stop({ keepStore: true, signal: "SIGKILL" });
        // Down long enough for a tab's follow-up of its answer to fail.
        await new Promise((resolve) => setTimeout(resolve, DOWN_MS));
        server = await startServer({ ...options, name: `race-kill-${round}`, dir: server.dir });

        // The answer that won runs to its end (resumed if the kill cut it).
        await eventually(async () => {
          const data = await (await fetch(`${server.base}/app/transcript?user_id=${user}&session_id=${session}`)).json();
          return !data.running && !data.pending && data.turns.some((turn) => turn.confirms);
        }, { timeoutMs: 30_000, what: "the winning answer to end" });
        const booked = (await entries(server.base, user)).length;
        const won = booked === 1 ? "approve" : "reject";
        for (const [name, tab] of [["A", tabA], ["B", tabB]]) {
          await eventually(async () => (await tab.locator(`${live} button`).count()) === 0, {
            timeoutMs: 15_000,
            what: `tab ${name}'s card to have no buttons left`,
          });
          // Within a transcript poll the notice says what happened, not "press again".
          await eventually(async () => !/may not have reached|Press it again|already being answered|Lost contact/.test((await tab.textContent("#notice")) || ""), {
            timeoutMs: 10_000,
            what: `tab ${name}'s notice to stop asking for a press (it says: ${await tab.textContent("#notice")})`,
          });
          const notice = (await tab.isVisible("#notice")) ? await tab.textContent("#notice") : "";
          seen.push(`round ${round}, ${won} won, tab ${name}: ${notice || "(no notice)"}`);
          if (won === "approve") assert.doesNotMatch(notice, /Rejected in another tab|reject reached/, notice);
          else assert.doesNotMatch(notice, /Approved in another tab|approval reached/, notice);
          // The tab whose answer lost is told which answer won.
          const lost = (name === "A") === (won === "reject");
          if (lost) assert.match(notice, won === "approve" ? /Approved in another tab/ : /Rejected in another tab/, notice);
        }
        assert.ok(booked <= 1, `booked ${booked} times`);
        await tabB.screenshot({ path: path.join(ARTIFACTS, `race-kill-${round}-B.png`), fullPage: true });
      } finally {
        await tabA.close();
        await tabB.close();
      }
    }
  } finally {
    console.log(seen.join("\n"));
    await server.stop();
  }
});
