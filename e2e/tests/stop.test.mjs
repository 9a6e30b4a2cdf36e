// The Stop button (issue 13's cancel) in headless Chromium against the real
// binary: a running reply stops when a person presses Stop, nothing is
// booked after it, the session takes the next message at once, and a
// reload shows the reply as stopped with no retry offered. (That a repeat
// of the stopped message replays the stop is checked in the engine's
// conformance suite and the ledger's tests.)

import { test, before, after } from "node:test";
import assert from "node:assert/strict";
import path from "node:path";
import { ARTIFACTS, startServer, launchBrowser, entries, getJson, chatUrl, eventually, unique } from "../lib/harness.mjs";

/** Per model round: a booking takes three, so a reply runs about 6 s, long enough to stop. */
const THINK_TIME_MS = 2_000;

let server;
let browser;

before(async () => {
  server = await startServer({ name: "stop", thinkTimeMs: THINK_TIME_MS });
  browser = await launchBrowser();
});

after(async () => {
  await browser?.close();
  await server?.stop();
});

test("Stop on a running reply stops it before it books; the session is free; a reload shows it stopped", async () => {
  const user = unique("stop");
  const session = unique("s");
  const page = await browser.newTab(chatUrl(server.base, user, session));
  await page.fill("#composer-input", "taxi 18 yesterday");
  await page.click("#send");
  const live = page.locator("#messages li.msg.assistant").last();
  await live.locator("button.stop").waitFor();
  await page.screenshot({ path: path.join(ARTIFACTS, "stop-running.png") });
  await live.locator("button.stop").click();
  await page.waitForSelector("#messages li.msg.assistant[data-state=cancelled]", { timeout: 10_000 });
  assert.match(await live.innerText(), /You stopped this reply\./);
  assert.equal(await live.locator("button.retry").count(), 0, "no retry offered for a stopped reply");
  await page.screenshot({ path: path.join(ARTIFACTS, "stop-stopped.png") });
  // Stopped before it booked: the turn ended cancelled without claiming
  // the booking tool (its model rounds are executions too). Ended, it is
  // fenced, so nothing can book later either: no wait needed.
  const turnId = await live.getAttribute("data-turn-id");
  assert.ok(turnId, "the stopped reply names its turn");
  const turnPath = `/v1/turns/${turnId}?user_id=${encodeURIComponent(user)}`;
  await eventually(async () => (await getJson(server.base, turnPath)).turn.state === "cancelled", {
    what: "the stopped turn to end cancelled",
  });
  const record = await getJson(server.base, turnPath);
  const bookings = record.executions.filter((execution) => execution.tool === "create_transaction");
  assert.equal(bookings.length, 0, `no booking was claimed: ${JSON.stringify(record.executions)}`);
  assert.equal((await entries(server.base, user)).length, 0);

  // The session takes the next message at once.
  await page.fill("#composer-input", "lunch 35");
  await page.click("#send");
  await page.waitForSelector("#messages li.msg.assistant[data-state=final]", { timeout: 20_000 });
  assert.equal((await entries(server.base, user)).length, 1);

  // A reload shows the stopped reply as stopped, with no retry.
  await page.reload();
  await page.waitForSelector("#messages li.msg.assistant[data-state=cancelled]");
  const stopped = page.locator("#messages li.msg.assistant[data-state=cancelled]");
  assert.match(await stopped.innerText(), /This reply was stopped before it finished\./);
  assert.equal(await stopped.locator("button.retry").count(), 0);
  await page.screenshot({ path: path.join(ARTIFACTS, "stop-after-reload.png") });
  await eventually(async () => (await entries(server.base, user)).length === 1, { what: "still one entry" });
  await page.close();
});

test("Stop after the booking committed says what was already booked, live, after a reload and in another tab", async () => {
  const user = unique("stopbooked");
  const session = unique("s");
  const page = await browser.newTab(chatUrl(server.base, user, session));
  await page.fill("#composer-input", "taxi 18 yesterday");
  await page.click("#send");
  const live = page.locator("#messages li.msg.assistant").last();
  await live.locator("button.stop").waitFor();
  // The booking commits with its tool's success; the reply's last model
  // round (THINK_TIME_MS) is still to come when Stop is pressed.
  await eventually(async () => (await entries(server.base, user)).length === 1, {
    what: "the booking to commit",
  });
  const [entry] = await entries(server.base, user);
  await live.locator("button.stop").click();
  await page.waitForSelector("#messages li.msg.assistant[data-state=cancelled]", { timeout: 10_000 });
  await eventually(async () => /Already booked/.test(await live.innerText()), {
    what: "the stopped reply to say what it booked",
  });
  const said = await live.innerText();
  assert.match(said, /You stopped this reply\./);
  assert.match(said, new RegExp(`#${entry.id}\\b`), `the booked entry #${entry.id} is listed: ${said}`);
  await page.screenshot({ path: path.join(ARTIFACTS, "stop-after-booking.png") });

  for (const view of [page, await browser.newTab(chatUrl(server.base, user, session))]) {
    if (view === page) await page.reload();
    const stopped = view.locator("#messages li.msg.assistant[data-state=cancelled]");
    await stopped.waitFor();
    const text = await stopped.innerText();
    assert.match(text, /Already booked/, text);
    assert.match(text, new RegExp(`#${entry.id}\\b`), text);
    assert.equal(await stopped.locator("button.retry").count(), 0);
  }
  assert.equal((await entries(server.base, user)).length, 1, "still exactly one entry");
  await page.close();
});
