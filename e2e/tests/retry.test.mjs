// Every retry the app offers is safe and every notice it shows is true
// (issue 9, item 4): a message keeps its id through double clicks, a second
// Enter and a dead server; a different message while one runs stays in the
// box; a second tab follows the conversation without a reload; an answer
// that lost to another tab's says so; the page speaks Chinese to a Chinese
// browser. Screenshots land in /tmp/h4-*.png for a person to look at.

import { test, before, after } from "node:test";
import assert from "node:assert/strict";
import {
  startServer, launchBrowser, entries, getJson, chatUrl, eventually, unique, freePort, settled,
} from "../lib/harness.mjs";

/** Per model round; a booking takes three, so a turn takes about 2 s. */
const THINK_TIME_MS = 700;
const REPLY_TIMEOUT_MS = 20_000;
const FINAL = "#messages li.msg.assistant[data-state=final]";

let server;
let browser;

before(async () => {
  server = await startServer({ name: "retry", thinkTimeMs: THINK_TIME_MS });
  browser = await launchBrowser();
});

after(async () => {
  await browser?.close();
  await server?.stop();
});

async function finals(page) {
  return page.locator(FINAL).count();
}

/** Records the status of every POST /app/messages of `page`. */
function messageStatuses(page) {
  const statuses = [];
  page.on("response", (response) => {
    if (response.url().endsWith("/app/messages")) statuses.push(response.status());
  });
  return statuses;
}

test("Enter pressed twice on one message books once, shows its reply and never 'Not sent'", async () => {
  const user = unique("enter");
  const page = await browser.newTab(chatUrl(server.base, user, "s-enter"));
  const statuses = messageStatuses(page);
  await page.fill("#composer-input", "taxi 18");
  // Two Enters as fast as a keyboard repeats: the second goes out with the
  // same message id before the first is accepted.
  await page.evaluate(() => {
    const input = document.getElementById("composer-input");
    for (let i = 0; i < 2; i += 1) {
      input.dispatchEvent(new KeyboardEvent("keydown", { key: "Enter", bubbles: true, cancelable: true }));
    }
  });
  await page.waitForSelector(FINAL, { timeout: REPLY_TIMEOUT_MS });
  await eventually(async () => statuses.length === 2, { what: "both Enters to reach the server" });
  assert.deepEqual([...statuses].sort(), [200, 409], "one stream, one request_in_flight");
  assert.match(await page.textContent(FINAL), /18\.00/);
  assert.doesNotMatch(await page.textContent("#messages"), /Not sent/);
  assert.equal(await page.locator("#messages li.msg.user").count(), 1);
  assert.equal((await entries(server.base, user)).length, 1);
  // The ledger pane shows the one row, formatted as everywhere else.
  await eventually(async () => /−18\.00/.test(await page.textContent("#entries")), { what: "the ledger row" });
  assert.equal(await page.inputValue("#composer-input"), "");
  await page.screenshot({ path: "/tmp/h4-enter-twice.png", fullPage: true });
  await page.close();
});

test("a different message while one runs stays in the box with a true notice", async () => {
  const user = unique("busy");
  const page = await browser.newTab(chatUrl(server.base, user, "s-busy"));
  await page.fill("#composer-input", "午饭 35");
  await page.click("#send");
  await page.waitForSelector("#messages li.msg.assistant[data-state=running]");
  await page.fill("#composer-input", "咖啡 25");
  await page.click("#send");
  await page.waitForSelector("#notice:not([hidden])");
  const notice = await page.textContent("#notice");
  assert.match(notice, /still being processed/);
  assert.match(notice, /still in the box/);
  assert.match(notice, /\d+ s/, "says when to retry");
  // True: the text is in the box, and no bubble claims it was sent.
  assert.equal(await page.inputValue("#composer-input"), "咖啡 25");
  assert.doesNotMatch(await page.textContent("#messages"), /咖啡 25/);
  await page.screenshot({ path: "/tmp/h4-busy.png", fullPage: true });
  // When the first reply is in, the notice says so (and the box still holds the text).
  await page.waitForSelector(FINAL, { timeout: REPLY_TIMEOUT_MS });
  await eventually(async () => /reply is in/.test(await page.textContent("#notice")), { what: "the notice to say the reply is in" });
  await page.click("#send");
  await eventually(async () => (await finals(page)) === 2, { timeoutMs: REPLY_TIMEOUT_MS, what: "the second reply" });
  const amounts = (await entries(server.base, user)).map((e) => e.amount_cents).sort((a, b) => a - b);
  assert.deepEqual(amounts, [2500, 3500]);
  await page.close();
});

test("a second tab sees the message, the reply, the confirmation card and the ledger row without reload", async () => {
  const user = unique("sync");
  const url = chatUrl(server.base, user, "s-sync");
  const tabA = await browser.newTab(url);
  const tabB = await browser.newTab(url);
  await tabA.fill("#composer-input", "taxi 18");
  await tabA.click("#send");
  // B shows A's message while it runs, then its reply and the ledger row.
  await tabB.waitForSelector("#messages li.msg.user:has-text('taxi 18')", { timeout: 5_000 });
  await tabB.waitForSelector(FINAL, { timeout: REPLY_TIMEOUT_MS });
  await eventually(async () => /18\.00/.test(await tabB.textContent("#entries")), { what: "B's ledger row" });
  // A confirmation card appears in B, live, with its deadline.
  await tabA.fill("#composer-input", "new laptop 6999");
  await tabA.click("#send");
  await tabB.waitForSelector(".confirm-card:not(.answered) button.approve", { timeout: REPLY_TIMEOUT_MS });
  assert.match(await tabB.textContent(".confirm-card:not(.answered)"), /6999\.00/);
  assert.match(await tabB.textContent(".confirm-card:not(.answered) .deadline"), /Answer by .* \(in 10 min\)/);
  await tabB.screenshot({ path: "/tmp/h4-second-tab.png", fullPage: true });
  // B approves; A's card is answered and the row shows in A's ledger.
  await tabB.click(".confirm-card:not(.answered) button.approve");
  await eventually(async () => (await tabA.locator(".confirm-card:not(.answered)").count()) === 0, {
    timeoutMs: REPLY_TIMEOUT_MS,
    what: "A's card to be answered",
  });
  await eventually(async () => /6999\.00/.test(await tabA.textContent("#entries")), {
    timeoutMs: REPLY_TIMEOUT_MS,
    what: "A's ledger to show the approved entry",
  });
  assert.deepEqual((await entries(server.base, user)).map((e) => e.amount_cents).sort((a, b) => a - b), [1800, 699_900]);
  await tabA.close();
  await tabB.close();
});

test("a reject that lost to another tab's approve says so", async () => {
  const user = unique("lost");
  const session = "s-lost";
  const url = chatUrl(server.base, user, session);
  const tabA = await browser.newTab(url);
  const tabB = await browser.newTab(url);
  await tabA.fill("#composer-input", "new phone 4999");
  await tabA.click("#send");
  await tabB.waitForSelector(".confirm-card:not(.answered) button.reject", { timeout: REPLY_TIMEOUT_MS });
  // B's view goes stale (a slow network): its reads hang until released, so
  // its card still offers Reject after A approved.
  const held = [];
  await tabB.route("**/app/transcript*", (route) => held.push(route));
  await tabA.click(".confirm-card:not(.answered) button.approve");
  await eventually(
    async () => {
      const transcript = await getJson(server.base, `/app/transcript?user_id=${user}&session_id=${session}`);
      return !transcript.running && transcript.pending === null && transcript.turns.some((t) => t.confirms);
    },
    { timeoutMs: REPLY_TIMEOUT_MS, what: "A's approval to end" },
  );
  assert.equal(await tabB.locator(".confirm-card:not(.answered) button.reject").count(), 1);
  await tabB.click(".confirm-card:not(.answered) button.reject");
  await eventually(async () => /your reject was not applied/.test((await tabB.textContent("#notice")) || ""), {
    what: "B's notice that the approve won",
  });
  assert.match(await tabB.textContent("#notice"), /Approved in another tab/);
  // No "✗ Reject" exchange was invented in B.
  assert.doesNotMatch(await tabB.textContent("#messages"), /✗ Reject/);
  await tabB.unroute("**/app/transcript*");
  for (const route of held) await route.continue().catch(() => {});
  const booked = await entries(server.base, user);
  assert.equal(booked.length, 1);
  assert.equal(booked[0].amount_cents, 499_900);
  await tabB.screenshot({ path: "/tmp/h4-reject-lost.png", fullPage: true });
  await tabA.close();
  await tabB.close();
});

test("a reject sent while another answer still runs waits for it, then says which was applied", async () => {
  const user = unique("inflight");
  const session = "s-inflight";
  const page = await browser.newTab(chatUrl(server.base, user, session));
  await page.fill("#composer-input", "new phone 4999");
  await page.click("#send");
  const card = await page.waitForSelector(".confirm-card:not(.answered)", { timeout: REPLY_TIMEOUT_MS });
  const pendingTurn = await card.getAttribute("data-turn-id");
  // Another client approves through /v1 and holds the continuation's lease
  // (as a slow agent would): the page's reject meets 409 request_in_flight.
  const begun = await fetch(`${server.base}/v1/turns`, {
    method: "POST",
    headers: { "Content-Type": "application/json" },
    body: JSON.stringify({
      user_id: user, session_id: session, client_request_id: "other-device",
      confirmation: { turn_id: pendingTurn, decision: "approve" },
    }),
  });
  assert.equal(begun.status, 201);
  const { turn } = await begun.json();
  const statuses = [];
  page.on("response", (response) => {
    if (response.url().endsWith("/app/confirmations")) statuses.push(response.status());
  });
  await page.click(".confirm-card button.reject");
  await eventually(async () => statuses.includes(409), { what: "the reject's 409 request_in_flight" });
  assert.match(await page.textContent("#notice"), /already being answered/);
  // The other answer ends; the page asks again with the same id and learns it.
  const done = await fetch(`${server.base}/v1/turns/${turn.turn_id}/complete`, {
    method: "POST",
    headers: { "Content-Type": "application/json", "Lease-Token": turn.lease_token },
    body: JSON.stringify({ response: { text: "approved elsewhere", entries: [] } }),
  });
  assert.equal(done.status, 200);
  await eventually(async () => /Approved in another tab; your reject was not applied/.test(await page.textContent("#notice")), {
    what: "the notice that the approve won",
  });
  assert.doesNotMatch(await page.textContent("#messages"), /✗ Reject/);
  await page.close();
});

test("Chinese browser: Chinese notices, Chinese numerals booked, amounts one way", async () => {
  const zh = await launchBrowser({ locale: "zh-CN" });
  try {
    const user = unique("zh");
    const page = await zh.newTab(chatUrl(server.base, user, "s-zh"));
    assert.equal(await page.getAttribute("html", "lang"), "zh-CN");
    assert.equal(await page.textContent("#send"), "发送");
    assert.equal((await page.textContent("header h1 span")).trim(), "· 记账助手");
    await page.fill("#composer-input", "打车花了二十五");
    await page.click("#send");
    await page.waitForSelector("#messages li.msg.assistant[data-state=running]");
    await page.fill("#composer-input", "午饭三十五");
    await page.click("#send");
    await page.waitForSelector("#notice:not([hidden])");
    assert.match(await page.textContent("#notice"), /上一条消息仍在处理中/);
    assert.equal(await page.inputValue("#composer-input"), "午饭三十五");
    await page.screenshot({ path: "/tmp/h4-zh-busy.png", fullPage: true });
    await page.waitForSelector(FINAL, { timeout: REPLY_TIMEOUT_MS });
    await eventually(async () => /回复已经出来了/.test(await page.textContent("#notice")), { what: "the Chinese 'reply is in' notice" });
    await page.click("#send");
    await eventually(async () => (await finals(page)) === 2, { timeoutMs: REPLY_TIMEOUT_MS, what: "the second reply" });
    const amounts = (await entries(server.base, user)).map((e) => e.amount_cents).sort((a, b) => a - b);
    assert.deepEqual(amounts, [2500, 3500]);
    await eventually(async () => /−35\.00/.test(await page.textContent("#entries")), { what: "the ledger pane" });
    assert.match(await page.textContent("#totals"), /60\.00/);
    await page.fill("#composer-input", "新电脑 两千");
    await page.click("#send");
    await page.waitForSelector(".confirm-card:not(.answered) .deadline", { timeout: REPLY_TIMEOUT_MS });
    assert.match(await page.textContent(".confirm-card:not(.answered)"), /2000\.00/);
    assert.match(await page.textContent(".confirm-card:not(.answered) .deadline"), /请在 .* 前答复/);
    await page.screenshot({ path: "/tmp/h4-zh.png", fullPage: true });
    // A second tab, its view stale, rejects after the first approved: told so in Chinese.
    const other = await zh.newTab(chatUrl(server.base, user, "s-zh"));
    await other.waitForSelector(".confirm-card:not(.answered) button.reject");
    const held = [];
    await other.route("**/app/transcript*", (route) => held.push(route));
    await page.click(".confirm-card:not(.answered) button.approve");
    await eventually(async () => (await entries(server.base, user)).length === 3, { what: "the approved entry" });
    await other.click(".confirm-card:not(.answered) button.reject");
    await eventually(async () => /已在另一个标签页批准；你的拒绝没有生效/.test((await other.textContent("#notice")) || ""), {
      what: "the Chinese notice that the approve won",
    });
    await other.screenshot({ path: "/tmp/h4-zh-reject-lost.png", fullPage: true });
    await other.unroute("**/app/transcript*");
    for (const route of held) await route.continue().catch(() => {});
    assert.equal((await entries(server.base, user)).length, 3);
    await other.close();
    await page.close();
  } finally {
    await zh.close();
  }
});

test("the dashboard pages its recent lists and labels what is this node's", async () => {
  const dashboard = await browser.newTab(`${server.base}/dashboard`);
  await dashboard.waitForSelector("#turns tbody tr");
  assert.ok((await dashboard.locator("#turns tbody tr").count()) <= 10, "one page of turns");
  assert.match(await dashboard.textContent("#counters"), /Live turns · all nodes/);
  assert.match(await dashboard.textContent("#counters"), /this node/);
  assert.match(await dashboard.textContent("#turns-pager"), /of \d+ newest/);
  const height = await dashboard.evaluate(() => document.documentElement.scrollHeight);
  assert.ok(height < 2500, `the page is ${height} px tall`);
  await dashboard.screenshot({ path: "/tmp/h4-dashboard.png", fullPage: true });
  await dashboard.close();
});

test("with the server down, a message stays in the box and is sent by itself, once, when it is back", async () => {
  const port = await freePort();
  let first = await startServer({ name: "restart-1", thinkTimeMs: 300, listen: `127.0.0.1:${port}` });
  const user = unique("down");
  const page = await browser.newTab(chatUrl(first.base, user, "s-down"));
  await first.stop({ keepStore: true });
  await page.fill("#composer-input", "地铁 4 块");
  await page.click("#send");
  await page.waitForSelector("#notice:not([hidden])");
  assert.match(await page.textContent("#notice"), /kept in the box and will be sent again automatically with the same id/);
  assert.equal(await page.inputValue("#composer-input"), "地铁 4 块");
  // Pressing Send again meanwhile is the same message, not a second one.
  await page.click("#send");
  await page.screenshot({ path: "/tmp/h4-server-down.png", fullPage: true });
  const second = await startServer({ name: "restart-2", thinkTimeMs: 300, listen: `127.0.0.1:${port}`, dir: first.dir });
  try {
    await page.waitForSelector(FINAL, { timeout: 60_000 });
    assert.match(await page.textContent(FINAL), /4\.00/);
    await eventually(async () => (await page.inputValue("#composer-input")) === "", { what: "the box to empty once sent" });
    // Once nothing can book any more (no resend scheduled, no live turn), count.
    await settled(second.base, page, user);
    assert.equal((await entries(second.base, user)).length, 1);
    assert.equal(await page.evaluate(() => JSON.parse(localStorage.getItem("agentgate.outbox") || "[]").length), 0);
  } finally {
    await page.close();
    await second.stop();
  }
  first = null;
});

test("a server crash mid-reply: the page asks again with the same id and the reply arrives, booked once", async () => {
  const port = await freePort();
  const options = { thinkTimeMs: 700, listen: `127.0.0.1:${port}`, args: ["--lease-ttl-ms", "3000"] };
  const first = await startServer({ name: "crash-1", ...options });
  const user = unique("crash");
  const page = await browser.newTab(chatUrl(first.base, user, "s-crash"));
  await page.fill("#composer-input", "打车花了二十五");
  await page.click("#send");
  await page.waitForSelector("#messages li.msg.assistant[data-state=running]");
  // Mid-turn: the model is thinking, a tool may have run.
  await new Promise((resolve) => setTimeout(resolve, 1200));
  await first.stop({ keepStore: true, signal: "SIGKILL" });
  await page.waitForSelector("#notice:not([hidden])");
  const notice = await page.textContent("#notice");
  // True: the message was accepted, so it is not "in the box"; the page asks again itself.
  assert.match(notice, /asks again with the same id/);
  assert.equal(await page.inputValue("#composer-input"), "");
  await page.screenshot({ path: "/tmp/h4-crash.png", fullPage: true });
  const second = await startServer({ ...options, name: "crash-2", dir: first.dir });
  try {
    await page.waitForSelector(FINAL, { timeout: 60_000 });
    assert.match(await page.textContent(FINAL), /25\.00/);
    await settled(second.base, page, user);
    const booked = await entries(second.base, user);
    assert.equal(booked.length, 1, JSON.stringify(booked));
    assert.equal(booked[0].amount_cents, 2500);
    assert.equal(await page.locator("#messages li.msg.user").count(), 1);
    assert.equal(await page.evaluate(() => JSON.parse(localStorage.getItem("agentgate.outbox") || "[]").length), 0);
    await page.screenshot({ path: "/tmp/h4-crash-recovered.png", fullPage: true });
  } finally {
    await page.close();
    await second.stop();
  }
});

test("the dashboard shows a running turn whose holder vanished as orphaned", async () => {
  const short = await startServer({ name: "orphan", args: ["--lease-ttl-ms", "500"] });
  try {
    // A /v1 caller begins a turn and vanishes: no heartbeat, no ending.
    const response = await fetch(`${short.base}/v1/turns`, {
      method: "POST",
      headers: { "Content-Type": "application/json" },
      body: JSON.stringify({ user_id: "ghost", session_id: "s-ghost", client_request_id: "r-1", payload: {} }),
    });
    assert.equal(response.status, 201);
    const { turn } = await response.json();
    const dashboard = await browser.newTab(`${short.base}/dashboard`);
    const row = `#turns tbody tr[data-turn-id="${turn.turn_id}"]`;
    await dashboard.waitForSelector(`${row}[data-state=orphaned]`, { timeout: 10_000 });
    assert.equal(await dashboard.textContent(`${row} .state`), "orphaned");
    assert.match(await dashboard.textContent("[data-counter=orphaned] .value"), /^1$/);
    assert.match(await dashboard.textContent("[data-counter=live] .value"), /^0$/);
    await dashboard.screenshot({ path: "/tmp/h4-dashboard-orphan.png", fullPage: true });
    await dashboard.close();
  } finally {
    await short.stop();
  }
});
