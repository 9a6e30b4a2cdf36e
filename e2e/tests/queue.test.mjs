// The second message's queue (issue 13) in headless Chromium against the
// real binary. With "queues behind the reply" (enqueue), messages typed
// while a reply runs show "Queued · position N" and are answered in order,
// each booked once, by the server's handoff; a queued message cancelled
// never runs and says so; with "replaces queued messages" (supersede) the
// middle of three messages shows it was replaced and never runs; a reload
// while a message waits still shows it queued, then answered. The
// dashboard lists the session's queue.

import { test, before, after } from "node:test";
import assert from "node:assert/strict";
import { readFileSync } from "node:fs";
import path from "node:path";
import { ARTIFACTS, startServer, launchBrowser, entries, getJson, chatUrl, unique, freePort } from "../lib/harness.mjs";

/** Per model round: a booking takes three, so a reply runs about 4.5 s: long enough to queue behind, reload and cancel. */
const THINK_TIME_MS = 1_500;
/** Three replies one after another, with room. */
const ALL_ANSWERED_MS = 40_000;

let server;
let browser;

before(async () => {
  server = await startServer({ name: "queue", thinkTimeMs: THINK_TIME_MS });
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

/** The user bubble of `text`. */
function bubble(page, text) {
  return page.locator("#messages li.msg.user", { hasText: text });
}

/** Waits until the user bubble of `text` has a status matching `pattern` (a RegExp source). */
async function statusOf(page, text, pattern, timeout = 10_000) {
  await page.waitForFunction(
    ([text, pattern]) =>
      [...document.querySelectorAll("#messages li.msg.user")].some(
        (li) => li.querySelector(".bubble")?.textContent === text && new RegExp(pattern).test(li.querySelector(".status")?.textContent || ""),
      ),
    [text, pattern],
    { timeout },
  );
}

async function finals(page, n) {
  await page.waitForFunction(
    (n) => document.querySelectorAll("#messages li.msg.assistant[data-state=final]").length === n,
    n,
    { timeout: ALL_ANSWERED_MS },
  );
}

/** Amounts booked for `user`, in the order they were booked. */
async function booked(user) {
  return (await entries(server.base, user)).sort((a, b) => a.id - b.id).map((e) => e.amount_cents);
}

/** "user" / "assistant" for each message of the page, top to bottom. */
async function roles(page) {
  return page.$$eval("#messages li.msg", (items) => items.map((li) => (li.classList.contains("user") ? "user" : "assistant")));
}

async function transcript(user, session) {
  return getJson(server.base, `/app/transcript?${new URLSearchParams({ user_id: user, session_id: session })}`);
}

test("'queues behind the reply': three messages typed fast are queued, answered in order, each booked once", async () => {
  const user = unique("enqueue");
  const session = unique("s");
  const page = await browser.newTab(chatUrl(server.base, user, session));
  const dashboard = await browser.newTab(`${server.base}/dashboard`);
  await page.bringToFront();
  await page.selectOption("#busy-policy", "enqueue");
  await send(page, "lunch 35");
  await send(page, "taxi 18");
  await send(page, "coffee 12");
  await statusOf(page, "taxi 18", "^Queued · position 1$");
  await statusOf(page, "coffee 12", "^Queued · position 2$");
  assert.equal(await bubble(page, "coffee 12").locator("button.cancel-queued").count(), 1, "a queued message can be cancelled");
  await page.screenshot({ path: path.join(ARTIFACTS, "queue-three-queued.png") });

  // The dashboard lists the session's queue, head first, behind its holder.
  const row = dashboard.locator(`#queues tbody tr[data-session="${session}"]`);
  await dashboard.waitForSelector(`#queues tbody tr[data-session="${session}"][data-length="2"]`, { timeout: 5_000 });
  const queued = await row.locator(".queue-list li").evaluateAll((items) => items.map((li) => li.dataset.position));
  assert.deepEqual(queued, ["1", "2"]);
  const holder = await dashboard.locator(`#live tbody tr[data-session="${session}"] td`).nth(2).getAttribute("title");
  assert.equal(await row.locator("td").nth(2).getAttribute("title"), holder, "the queue waits behind the session's holder");
  await dashboard.screenshot({ path: path.join(ARTIFACTS, "queue-dashboard.png"), fullPage: true });
  await dashboard.close();

  // While the second runs, the third moves up.
  await statusOf(page, "coffee 12", "^Queued · position 1$", 15_000);
  await page.screenshot({ path: path.join(ARTIFACTS, "queue-moved-up.png") });
  await finals(page, 3);
  assert.deepEqual(await booked(user), [3500, 1800, 1200], "each booked once, in the order typed");
  assert.deepEqual(await roles(page), ["user", "assistant", "user", "assistant", "user", "assistant"]);
  const replies = await page.$$eval("#messages li.msg.assistant", (items) => items.map((li) => li.innerText));
  assert.match(replies[0], /35/);
  assert.match(replies[1], /18/);
  assert.match(replies[2], /12/);
  assert.equal(await page.locator("button.cancel-queued").count(), 0, "nothing is left to cancel");
  await page.screenshot({ path: path.join(ARTIFACTS, "queue-all-answered.png") });
  // Each message is one turn, started once.
  const { turns } = await transcript(user, session);
  assert.deepEqual(turns.map((turn) => [turn.user_text, turn.state, turn.attempt]), [
    ["lunch 35", "succeeded", 1],
    ["taxi 18", "succeeded", 1],
    ["coffee 12", "succeeded", 1],
  ]);
  await page.close();
});

test("a queued message cancelled is never run or booked, the notice says so, and the others still run", async () => {
  const user = unique("cancel");
  const session = unique("s");
  const page = await browser.newTab(chatUrl(server.base, user, session));
  await page.selectOption("#busy-policy", "enqueue");
  await send(page, "lunch 35");
  await page.locator("#messages li.msg.assistant button.stop").waitFor();
  await send(page, "taxi 18");
  await send(page, "coffee 12");
  await statusOf(page, "coffee 12", "^Queued · position 2$");
  await bubble(page, "taxi 18").locator("button.cancel-queued").click();
  await page.waitForSelector("#notice:not([hidden])");
  assert.equal(await page.innerText("#notice"), "Cancelled before it ran: “taxi 18” was never run and nothing was booked for it.");
  await statusOf(page, "taxi 18", "^Cancelled before it ran: nothing was booked\\.$");
  await statusOf(page, "coffee 12", "^Queued · position 1$");
  await page.screenshot({ path: path.join(ARTIFACTS, "queue-cancelled.png") });
  await finals(page, 2);
  assert.deepEqual(await booked(user), [3500, 1200]);
  // The cancelled message never started, and nothing runs after the others.
  const { turns, queue, running } = await transcript(user, session);
  assert.deepEqual(turns.map((turn) => [turn.user_text, turn.state, turn.attempt]), [
    ["lunch 35", "succeeded", 1],
    ["taxi 18", "cancelled", 0],
    ["coffee 12", "succeeded", 1],
  ]);
  assert.deepEqual([queue, running], [[], false]);
  // A reload says the same, with nothing to retry or cancel.
  await page.reload();
  await page.waitForSelector("#messages li.msg.user.unrun");
  assert.deepEqual(await roles(page), ["user", "assistant", "user", "user", "assistant"]);
  const cancelled = bubble(page, "taxi 18");
  assert.equal(await cancelled.locator(".status").innerText(), "Cancelled before it ran: nothing was booked.");
  assert.equal(await page.locator("button.cancel-queued, button.retry").count(), 0);
  await page.screenshot({ path: path.join(ARTIFACTS, "queue-cancelled-reloaded.png") });
  assert.deepEqual(await booked(user), [3500, 1200]);
  await page.close();
});

test("'replaces queued messages': of two sent while a reply runs, the newer replaces the older; only the first and the newest are booked", async () => {
  const user = unique("supersede");
  const session = unique("s");
  const page = await browser.newTab(chatUrl(server.base, user, session));
  await page.selectOption("#busy-policy", "supersede");
  await send(page, "lunch 35");
  await page.locator("#messages li.msg.assistant button.stop").waitFor();
  await send(page, "taxi 18");
  await send(page, "coffee 12");
  await statusOf(page, "taxi 18", "^Replaced by a newer message before it ran: never run, nothing booked\\.$");
  await statusOf(page, "coffee 12", "^Queued · position 1$");
  assert.equal(await bubble(page, "taxi 18").locator("button").count(), 0, "nothing to cancel on a replaced message");
  await page.screenshot({ path: path.join(ARTIFACTS, "queue-superseded.png") });
  await finals(page, 2);
  assert.deepEqual(await booked(user), [3500, 1200]);
  const { turns } = await transcript(user, session);
  assert.deepEqual(turns.map((turn) => [turn.user_text, turn.state, turn.attempt]), [
    ["lunch 35", "succeeded", 1],
    ["taxi 18", "superseded", 0],
    ["coffee 12", "succeeded", 1],
  ]);
  await page.reload();
  await statusOf(page, "taxi 18", "^Replaced by a newer message before it ran");
  assert.deepEqual(await roles(page), ["user", "assistant", "user", "user", "assistant"]);
  await page.screenshot({ path: path.join(ARTIFACTS, "queue-superseded-reloaded.png") });
  await page.close();
});

test("a reload while a message waits still shows it queued (position, Cancel), then its reply", async () => {
  const user = unique("reload");
  const session = unique("s");
  const page = await browser.newTab(chatUrl(server.base, user, session));
  await page.selectOption("#busy-policy", "enqueue");
  await send(page, "lunch 35");
  await page.locator("#messages li.msg.assistant button.stop").waitFor();
  await send(page, "taxi 18");
  await statusOf(page, "taxi 18", "^Queued · position 1$");
  await page.reload();
  await page.waitForSelector("body[data-ready=true]");
  // Read from the server's transcript: the queued message, its position and its Cancel.
  await statusOf(page, "taxi 18", "^Queued · position 1$", 3_000);
  assert.equal(await bubble(page, "taxi 18").locator("button.cancel-queued").count(), 1);
  assert.equal(await page.inputValue("#busy-policy"), "enqueue", "the conversation keeps its policy");
  await page.screenshot({ path: path.join(ARTIFACTS, "queue-reloaded-queued.png") });
  await finals(page, 2);
  assert.deepEqual(await booked(user), [3500, 1800]);
  assert.deepEqual(await roles(page), ["user", "assistant", "user", "assistant"]);
  assert.match(await page.locator("#messages li.msg.assistant").last().innerText(), /18/);
  assert.ok(await page.locator("#notice").isHidden(), "no notice left over");
  await page.screenshot({ path: path.join(ARTIFACTS, "queue-reloaded-answered.png") });
  await page.close();
});

test("a Chinese browser reads the queue in Chinese", async () => {
  const zh = await launchBrowser({ locale: "zh-CN" });
  try {
    const user = unique("zh");
    const page = await zh.newTab(chatUrl(server.base, user, unique("s")));
    const options = await page.$$eval("#busy-policy option", (items) => items.map((o) => o.textContent));
    assert.ok(options.includes("排在当前回复后面") && options.includes("替换尚未开始的排队消息"), options.join(" | "));
    await page.selectOption("#busy-policy", "enqueue");
    await send(page, "午饭 35");
    await page.locator("#messages li.msg.assistant button.stop").waitFor();
    await send(page, "打车 18");
    await statusOf(page, "打车 18", "^排队中 · 第 1 位$");
    assert.equal(await bubble(page, "打车 18").locator("button.cancel-queued").innerText(), "取消");
    await page.screenshot({ path: path.join(ARTIFACTS, "queue-zh.png") });
    await finals(page, 2);
    assert.deepEqual(await booked(user), [3500, 1800]);
  } finally {
    await zh.close();
  }
});

test("a server killed mid-reply with two messages queued: after a restart the reply resumes and the queue drains in order, each booked once, hands off the page", async () => {
  const LEASE_TTL_MS = 2_000;
  const port = await freePort();
  const options = { thinkTimeMs: THINK_TIME_MS, listen: `127.0.0.1:${port}`, args: ["--lease-ttl-ms", String(LEASE_TTL_MS)] };
  const first = await startServer({ name: "queue-killed-1", ...options });
  let second;
  const user = unique("killed");
  const session = unique("s");
  const page = await browser.newTab(chatUrl(first.base, user, session));
  try {
    await page.selectOption("#busy-policy", "enqueue");
    await send(page, "lunch 35");
    await page.locator("#messages li.msg.assistant button.stop").waitFor();
    await send(page, "taxi 18");
    await send(page, "coffee 12");
    await statusOf(page, "coffee 12", "^Queued · position 2$");
    await first.stop({ keepStore: true, signal: "SIGKILL" });

    second = await startServer({ ...options, name: "queue-killed-2", dir: first.dir });
    // Read back before the recovery worker's first look (2 s after the
    // start) and before the dead reply's lease ran out: both still queued
    // behind it.
    const left = await getJson(second.base, `/app/transcript?${new URLSearchParams({ user_id: user, session_id: session })}`);
    assert.deepEqual(left.turns.map((turn) => turn.state), ["running", "queued", "queued"]);
    assert.deepEqual(left.queue.map((q) => q.position), [1, 2]);
    // Hands off the page: the turn is taken over (by the recovery worker, or
    // the page asking again with the same id), then the queue is handed off.
    await finals(page, 3);
    const amounts = (await entries(second.base, user)).sort((a, b) => a.id - b.id).map((e) => e.amount_cents);
    assert.deepEqual(amounts, [3500, 1800, 1200], "each booked once, in the order typed");
    assert.deepEqual(await roles(page), ["user", "assistant", "user", "assistant", "user", "assistant"]);
    const { turns } = await getJson(second.base, `/app/transcript?${new URLSearchParams({ user_id: user, session_id: session })}`);
    assert.deepEqual(turns.map((turn) => [turn.user_text, turn.state, turn.attempt]), [
      ["lunch 35", "succeeded", 2],
      ["taxi 18", "succeeded", 1],
      ["coffee 12", "succeeded", 1],
    ], "the killed reply ran again once (attempt 2), the queued ones once");
    await page.screenshot({ path: path.join(ARTIFACTS, "queue-killed-recovered.png") });
    const log = readFileSync(second.log, "utf8");
    console.log(`after the restart: ${log.includes("resuming an orphaned turn") ? "the recovery worker resumed the reply" : "the page's resend took the reply over"}; handoffs logged: ${(log.match(/running a queued message/g) || []).length}`);
  } finally {
    await page.close();
    await second?.stop();
    if (!second) await first.stop();
  }
});

// Last in this file: it leaves a full queue behind an API holder that never ends.
test("a message sent to a full queue is not sent: it stays in the box with a true notice (429 queue_full)", async () => {
  const user = unique("full");
  const session = unique("s");
  const post = async (pathname, body) => {
    const response = await fetch(server.base + pathname, {
      method: "POST",
      headers: { "Content-Type": "application/json" },
      body: JSON.stringify(body),
    });
    return { status: response.status, body: await response.json() };
  };
  // An API caller holds the session; the app's messages queue behind it up to the engine's limit.
  const holder = await post("/v1/turns", { user_id: user, session_id: session, client_request_id: "api-holder", payload: { text: "held" } });
  assert.equal(holder.status, 201, JSON.stringify(holder.body));
  const QUEUE_LIMIT = 100;
  for (let n = 1; n <= QUEUE_LIMIT; n += 1) {
    const queued = await post("/app/messages", {
      user_id: user, session_id: session, client_request_id: `m${n}`, text: `tea ${n}`, on_busy: "enqueue",
    });
    assert.deepEqual([queued.status, queued.body.turn.position], [202, n]);
  }
  const page = await browser.newTab(chatUrl(server.base, user, session));
  await page.selectOption("#busy-policy", "enqueue");
  await send(page, "coffee 12");
  await page.waitForSelector("#notice:not([hidden])");
  assert.match(
    await page.innerText("#notice"),
    /^This conversation already has the most messages waiting\. Yours was not sent; it is still in the box\. Send it again in about \d+ s\.$/,
  );
  assert.equal(await page.inputValue("#composer-input"), "coffee 12");
  assert.equal(await bubble(page, "coffee 12").count(), 0, "no bubble for a message that was not sent");
  const order = await roles(page);
  assert.deepEqual([order[0], order.length], ["assistant", QUEUE_LIMIT + 1], "the holder's running turn shows ahead of the queue");
  const { turns, queue } = await transcript(user, session);
  assert.equal(queue.length, QUEUE_LIMIT);
  assert.ok(turns.every((turn) => turn.user_text !== "coffee 12"), "the refused message was not recorded");
  await page.screenshot({ path: path.join(ARTIFACTS, "queue-full.png") });
  await page.close();
});
