// The second message (issue 13) in headless Chromium against the real
// binary: with the conversation's policy set to "waits", two messages typed
// fast are both answered, in order, each booked once; with "stops the
// reply", a correction typed while the first reply runs stops it before it
// books, and only the correction is booked; with "is refused" (the default)
// the second message stays in the box with the notice it always had; the
// dashboard counts a waiting message while it waits.

import { test, before, after } from "node:test";
import assert from "node:assert/strict";
import path from "node:path";
import { ARTIFACTS, startServer, launchBrowser, entries, chatUrl, unique } from "../lib/harness.mjs";

/** Per model round: a booking takes three, so a reply runs about 3 s. */
const THINK_TIME_MS = 1_000;

let server;
let browser;

before(async () => {
  server = await startServer({ name: "second-message", thinkTimeMs: THINK_TIME_MS });
  browser = await launchBrowser();
});

after(async () => {
  await browser?.close();
  await server?.stop();
});

async function send(page, text) {
  await page.fill("#composer-input", text);
  await page.click("#send");
}

test("'waits': two messages typed fast are both answered in order, each booked once", async () => {
  const user = unique("wait");
  const page = await browser.newTab(chatUrl(server.base, user, unique("s")));
  await page.selectOption("#busy-policy", "wait");
  await send(page, "lunch 35");
  await page.locator("#messages li.msg.assistant button.stop").waitFor();
  await send(page, "taxi 18");
  const second = page.locator("#messages li.msg.user").nth(1);
  await page.waitForFunction(
    () => document.querySelectorAll("#messages li.msg.user")[1]?.innerText.includes("Waiting for the reply above"),
    null,
    { timeout: 5_000 },
  );
  await page.screenshot({ path: path.join(ARTIFACTS, "second-message-waiting.png") });
  assert.match(await second.innerText(), /taxi 18/);
  // The dashboard shows the waiter while it waits.
  const dashboard = await browser.newTab(`${server.base}/dashboard`);
  await dashboard.waitForFunction(
    () => document.querySelector('[data-counter="waiting"] .value')?.textContent === "1",
    null,
    { timeout: 5_000 },
  );
  await dashboard.screenshot({ path: path.join(ARTIFACTS, "second-message-dashboard-waiting.png") });
  await page.waitForFunction(
    () => document.querySelectorAll("#messages li.msg.assistant[data-state=final]").length === 2,
    null,
    { timeout: 20_000 },
  );
  const booked = await entries(server.base, user);
  assert.deepEqual(booked.map((e) => e.amount_cents).sort((a, b) => a - b), [1800, 3500], JSON.stringify(booked));
  // Nobody waits any more.
  await dashboard.waitForFunction(
    () => document.querySelector('[data-counter="waiting"] .value')?.textContent === "0",
    null,
    { timeout: 10_000 },
  );
  await dashboard.close();
  // In order: the transcript alternates user, assistant, user, assistant.
  const order = await page.$$eval("#messages li.msg", (items) => items.map((li) => (li.classList.contains("user") ? "user" : "assistant")));
  assert.deepEqual(order, ["user", "assistant", "user", "assistant"]);
  const replies = await page.$$eval("#messages li.msg.assistant", (items) => items.map((li) => li.innerText));
  assert.match(replies[0], /35/);
  assert.match(replies[1], /18/);
  await page.screenshot({ path: path.join(ARTIFACTS, "second-message-both-answered.png") });
  // The choice is the conversation's: a reload keeps it.
  await page.reload();
  assert.equal(await page.inputValue("#busy-policy"), "wait");
  await page.close();
});

test("'stops the reply': a correction typed mid-reply stops the first before it books; only the correction is booked", async () => {
  const user = unique("interrupt");
  const page = await browser.newTab(chatUrl(server.base, user, unique("s")));
  await page.selectOption("#busy-policy", "interrupt");
  await send(page, "taxi 18 yesterday");
  await page.locator("#messages li.msg.assistant button.stop").waitFor();
  await send(page, "no, taxi 28 yesterday");
  const first = page.locator("#messages li.msg.assistant").first();
  await page.waitForSelector("#messages li.msg.assistant[data-state=cancelled]", { timeout: 15_000 });
  assert.match(await first.innerText(), /Your newer message interrupted this reply\./);
  assert.equal(await first.locator("button.retry").count(), 0, "no retry offered for an interrupted reply");
  await page.waitForSelector("#messages li.msg.assistant[data-state=final]", { timeout: 20_000 });
  await page.screenshot({ path: path.join(ARTIFACTS, "second-message-interrupted.png") });
  const booked = await entries(server.base, user);
  assert.deepEqual(booked.map((e) => e.amount_cents), [2800], JSON.stringify(booked));
  // The dashboard counts the interrupt and shows the stopped turn.
  const dashboard = await browser.newTab(`${server.base}/dashboard`);
  const busy = dashboard.locator('[data-counter="busy"] .detail');
  await dashboard.waitForFunction(
    () => /interrupt started [1-9]/.test(document.querySelector('[data-counter="busy"] .detail')?.textContent || ""),
    null,
    { timeout: 5_000 },
  );
  assert.match(await busy.innerText(), /wait started [1-9]/, "the first test's waiter is counted too");
  assert.ok(await dashboard.locator("#turns tbody tr[data-state=cancelled]").count() >= 1);
  await dashboard.screenshot({ path: path.join(ARTIFACTS, "second-message-dashboard.png") });
  await dashboard.close();
  // After a reload the first reply still reads as stopped, with no retry.
  await page.reload();
  await page.waitForSelector("#messages li.msg.assistant[data-state=cancelled]");
  const stopped = page.locator("#messages li.msg.assistant[data-state=cancelled]");
  assert.match(await stopped.innerText(), /This reply was stopped before it finished\./);
  assert.equal(await stopped.locator("button.retry").count(), 0);
  await page.close();
});

test("'is refused' (the default): the second message stays in the box with the busy notice", async () => {
  const user = unique("reject");
  const page = await browser.newTab(chatUrl(server.base, user, unique("s")));
  assert.equal(await page.inputValue("#busy-policy"), "reject");
  await send(page, "lunch 35");
  await page.locator("#messages li.msg.assistant button.stop").waitFor();
  await send(page, "taxi 18");
  await page.waitForSelector("#notice:not([hidden])");
  assert.match(await page.innerText("#notice"), /still being processed/);
  assert.equal(await page.inputValue("#composer-input"), "taxi 18");
  await page.waitForSelector("#messages li.msg.assistant[data-state=final]", { timeout: 20_000 });
  assert.deepEqual((await entries(server.base, user)).map((e) => e.amount_cents), [3500]);
  await page.close();
});
