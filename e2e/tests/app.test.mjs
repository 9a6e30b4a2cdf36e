// The reference app in headless Chromium against the real binary: what a
// person double-clicking, using two tabs, approving twice or reloading
// mid-reply sees — and that the ledger books each entry exactly once.
// (retry.test.mjs: retries, notices, tab sync, languages.)

import { test, before, after } from "node:test";
import assert from "node:assert/strict";
import path from "node:path";
import {
  ARTIFACTS, startServer, launchBrowser, entries, getJson, chatUrl, eventually, unique,
} from "../lib/harness.mjs";

/** Per model round; a booking takes three, so a turn takes about 2 s: long enough to click into. */
const THINK_TIME_MS = 700;
const REPLY_TIMEOUT_MS = 20_000;
const STILL_PROCESSING = /still being processed/;

let server;
let browser;

before(async () => {
  server = await startServer({ name: "app", thinkTimeMs: THINK_TIME_MS });
  browser = await launchBrowser();
});

after(async () => {
  await browser?.close();
  await server?.stop();
});

async function finals(page) {
  return page.locator("#messages li.msg.assistant[data-state=final]").count();
}

async function send(page, text) {
  await page.fill("#composer-input", text);
  await page.click("#send");
}

test("a double-clicked send books exactly one entry and attaches to the server's 409", async () => {
  const user = unique("dbl");
  const page = await browser.newTab(chatUrl(server.base, user, "s-1"));
  const statuses = [];
  let firstAnswered;
  const answered = new Promise((resolve) => {
    firstAnswered = resolve;
  });
  page.on("response", (response) => {
    if (!response.url().endsWith("/app/messages")) return;
    statuses.push(response.status());
    firstAnswered();
  });
  // A person's two clicks are milliseconds apart, but on a loaded machine the
  // first one's answer can arrive between them; the page then empties the box
  // and the second click sends nothing. So the first request is held until
  // the second is issued, and the second until the first is answered (its
  // turn has begun): the second finds that turn running. If the page sent no
  // second request, the first goes on after SECOND_CLICK_MAX_WAIT_MS and
  // the test fails below, as it should.
  const SECOND_CLICK_MAX_WAIT_MS = 5_000;
  let secondIssued;
  const second = new Promise((resolve) => {
    secondIssued = resolve;
  });
  let seen = 0;
  await page.route("**/app/messages", async (route) => {
    seen += 1;
    if (seen === 1) {
      await Promise.race([second, new Promise((resolve) => setTimeout(resolve, SECOND_CLICK_MAX_WAIT_MS))]);
    } else {
      secondIssued();
      await answered;
    }
    await route.continue();
  });
  await page.fill("#composer-input", "中午吃粉花了 35");
  await page.dblclick("#send");
  await page.waitForSelector("#messages li.msg.assistant[data-state=final]", { timeout: REPLY_TIMEOUT_MS });
  // The second click reached the server with the same message id and was
  // told it is in flight (409 request_in_flight): the page attached to the
  // running turn instead of calling it "not sent".
  await eventually(async () => statuses.includes(409) && statuses.includes(200), {
    what: "the second click's 409 beside the first one's stream",
  });
  assert.equal(await page.locator("#messages li.msg.user.refused").count(), 0);
  assert.doesNotMatch(await page.textContent("#messages"), /Not sent/);
  const booked = await entries(server.base, user);
  assert.equal(booked.length, 1, JSON.stringify(booked));
  assert.equal(booked[0].amount_cents, 3500);
  assert.equal(booked[0].category, "餐饮");
  // One exchange on the page, nothing else.
  assert.equal(await page.locator("#messages li.msg.user").count(), 1);
  assert.equal(await page.locator("#messages li.msg.assistant").count(), 1);
  await page.close();
});

test("an English page names the ledger's categories in English, in its panes and in the reply; the ledger keeps the names it booked", async () => {
  const user = unique("en-category");
  const page = await browser.newTab(chatUrl(server.base, user, unique("s")));
  await send(page, "taxi 18");
  await page.waitForSelector("#messages li.msg.assistant[data-state=final]", { timeout: REPLY_TIMEOUT_MS });
  const reply = await page.textContent("#messages li.msg.assistant[data-state=final]");
  assert.match(reply, /Booked: Transport 18\.00/, reply);
  assert.doesNotMatch(reply, /交通/, reply);
  await eventually(async () => /Transport/.test(await page.textContent("#entries")), { what: "the ledger pane's category" });
  assert.match(await page.textContent("#categories"), /Transport/);
  for (const pane of ["#entries", "#categories"]) assert.doesNotMatch(await page.textContent(pane), /交通/, pane);
  const booked = await entries(server.base, user);
  assert.equal(booked.length, 1, JSON.stringify(booked));
  assert.equal(booked[0].category, "交通");
  await page.close();
});

test("a link naming another user's conversation starts a new one and says so; a send then books for this user", async () => {
  const owner = unique("owner");
  const theirs = unique("s-theirs");
  const first = await browser.newTab(chatUrl(server.base, owner, theirs));
  await send(first, "taxi 18");
  await first.waitForSelector("#messages li.msg.assistant[data-state=final]", { timeout: REPLY_TIMEOUT_MS });
  await first.close();
  const visitor = unique("visitor");
  const page = await browser.newTab(chatUrl(server.base, visitor, theirs));
  await eventually(async () => /not one of yours/.test(await page.textContent("#notice")), { what: "the notice that the conversation is not theirs" });
  assert.ok(!page.url().includes(theirs), `the page left the other user's session: ${page.url()}`);
  await page.screenshot({ path: path.join(ARTIFACTS, "foreign-session.png") });
  assert.equal(await page.locator("#messages li.msg").count(), 0);
  await send(page, "lunch 35");
  await page.waitForSelector("#messages li.msg.assistant[data-state=final]", { timeout: REPLY_TIMEOUT_MS });
  assert.doesNotMatch(await page.textContent("#messages"), /not found/);
  assert.equal((await entries(server.base, visitor)).length, 1);
  assert.equal((await entries(server.base, owner)).length, 1);
  await page.close();
});

test("two tabs on one session: the second is told to wait, the ledger stays consistent", async () => {
  const user = unique("tabs");
  const url = chatUrl(server.base, user, "s-shared");
  const tabA = await browser.newTab(url);
  const tabB = await browser.newTab(url);
  await send(tabA, "taxi 18");
  await tabA.waitForSelector("#messages li.msg.assistant[data-state=running]");
  await send(tabB, "咖啡 25");
  await tabB.waitForSelector("#notice:not([hidden])");
  assert.match(await tabB.textContent("#notice"), STILL_PROCESSING);
  // B's text is kept in the box for a resend; A's reply arrives in A, and B (syncing) shows it too.
  assert.equal(await tabB.inputValue("#composer-input"), "咖啡 25");
  await tabA.waitForSelector("#messages li.msg.assistant[data-state=final]", { timeout: REPLY_TIMEOUT_MS });
  await eventually(async () => (await finals(tabB)) === 1, { what: "tab B to show tab A's reply" });
  assert.deepEqual((await entries(server.base, user)).map((e) => e.amount_cents), [1800]);
  // Once idle, B's resend goes through: two entries, each once.
  await tabB.click("#send");
  await eventually(async () => (await finals(tabB)) === 2, { timeoutMs: REPLY_TIMEOUT_MS, what: "B's reply" });
  const amounts = (await entries(server.base, user)).map((e) => e.amount_cents).sort((a, b) => a - b);
  assert.deepEqual(amounts, [1800, 2500]);
  // The ledger pane refreshes after the reply; wait for it rather than race it.
  await eventually(async () => /25\.00/.test(await tabB.textContent("#entries")), {
    what: "tab B's ledger pane to show the second entry",
  });
  await tabA.close();
  await tabB.close();
});

test("a confirmation approved in two tabs books once; a new message meanwhile must wait", async () => {
  const user = unique("confirm");
  const url = chatUrl(server.base, user, "s-big");
  const tabA = await browser.newTab(url);
  await send(tabA, "new laptop 6999");
  await tabA.waitForSelector(".confirm-card:not(.answered) button.approve", { timeout: REPLY_TIMEOUT_MS });
  const tabB = await browser.newTab(url);
  await tabB.waitForSelector(".confirm-card:not(.answered) button.approve");
  assert.equal((await entries(server.base, user)).length, 0, "nothing booked before approval");
  // A new message while the confirmation is pending gets the server's 409.
  await send(tabB, "午饭 20");
  await tabB.waitForSelector("#notice:not([hidden])");
  assert.match(await tabB.textContent("#notice"), /[Ww]aiting for your confirmation/);
  assert.equal(await tabB.inputValue("#composer-input"), "午饭 20");
  // Both tabs approve at once: the buttons are taken first and pressed
  // together, since a tab that learns of the other's approval (the tabs keep
  // in sync) redraws its card as answered, with no button left to press.
  const live = ".confirm-card:not(.answered) button.approve";
  const [buttonA, buttonB] = await Promise.all([tabA.$(live), tabB.$(live)]);
  await Promise.all([buttonA.evaluate((b) => b.click()), buttonB.evaluate((b) => b.click())]);
  await eventually(
    async () => {
      const transcript = await getJson(server.base, `/app/transcript?user_id=${user}&session_id=s-big`);
      return !transcript.running && transcript.pending === null && transcript.turns.some((t) => t.confirms);
    },
    { timeoutMs: REPLY_TIMEOUT_MS, what: "the confirmation turn to end" },
  );
  const booked = await entries(server.base, user);
  assert.equal(booked.length, 1, JSON.stringify(booked));
  assert.equal(booked[0].amount_cents, 699_900);
  for (const tab of [tabA, tabB]) {
    await eventually(async () => (await tab.locator(".confirm-card:not(.answered) button.approve").count()) === 0, {
      what: "the card to be answered in every tab",
    });
  }
  await tabA.close();
  await tabB.close();
});

test("reloading mid-reply shows the running turn, then its reply", async () => {
  const user = unique("reload");
  const page = await browser.newTab(chatUrl(server.base, user, "s-reload"));
  await send(page, "地铁 4 块");
  await page.waitForSelector("#messages li.msg.assistant[data-state=running]");
  await page.reload();
  await page.waitForSelector("body[data-ready=true]");
  // The transcript says the turn is still running ...
  await page.waitForSelector("#messages li.msg.assistant[data-state=running]", { timeout: 2_000 });
  // ... and the reply replaces it when the turn ends, without another send.
  await page.waitForSelector("#messages li.msg.assistant[data-state=final]", { timeout: REPLY_TIMEOUT_MS });
  assert.match(await page.textContent("#messages li.msg.assistant[data-state=final]"), /4\.00/);
  assert.equal((await entries(server.base, user)).length, 1);
  await page.close();
});

test("the dashboard shows the holder while a turn runs and none after", async () => {
  const user = unique("dash");
  const session = "s-dash";
  const chat = await browser.newTab(chatUrl(server.base, user, session));
  // Some history for the screenshot: a booking and a pending confirmation.
  await send(chat, "中午吃粉花了 35, taxi 18 yesterday");
  await chat.waitForSelector("#messages li.msg.assistant[data-state=final]", { timeout: REPLY_TIMEOUT_MS });
  const dashboard = await browser.newTab(`${server.base}/dashboard`);
  await send(chat, "房租 3500");
  const holder = `#live tbody tr[data-session="${session}"]`;
  await dashboard.waitForSelector(holder, { timeout: 5_000 });
  const cells = await dashboard.locator(`${holder} td`).allTextContents();
  assert.equal(cells[0], user);
  assert.match(cells[3], /^\d+$/, "a fence");
  assert.match(cells[4], /s$/, "remaining lease");
  assert.match(await dashboard.textContent(`#permits tbody tr[data-user="${user}"]`), /1/);
  await dashboard.screenshot({ path: path.join(ARTIFACTS, "dashboard.png"), fullPage: true });
  await chat.waitForSelector(".confirm-card:not(.answered)", { timeout: REPLY_TIMEOUT_MS });
  await dashboard.waitForSelector("#live-empty", { timeout: 5_000 });
  assert.equal(await dashboard.locator(holder).count(), 0);
  await chat.screenshot({ path: path.join(ARTIFACTS, "chat.png"), fullPage: true });
  const counters = await dashboard.textContent("#counters");
  assert.match(counters, /Conflicts/);
  await chat.close();
  await dashboard.close();
});

test("the dashboard speaks the page's language, lists only users holding turns, and keeps its controls inside their cards at 800 px and on a phone", async () => {
  // A turn that ended: its user holds nothing and is one line of the permits pane.
  const user = unique("dash-idle");
  const chat = await browser.newTab(chatUrl(server.base, user, unique("s")));
  await send(chat, "taxi 18");
  await chat.waitForSelector("#messages li.msg.assistant[data-state=final]", { timeout: REPLY_TIMEOUT_MS });
  await chat.close();

  const en = await browser.newTab(`${server.base}/dashboard`);
  assert.equal(await en.locator(`#permits tbody tr[data-user="${user}"]`).count(), 0, "an idle user has no row");
  assert.match(await en.textContent("#permits"), /more users? with no live turn/);
  await en.close();

  const zh = await launchBrowser({ locale: "zh-CN" });
  try {
    const page = await zh.newTab(`${server.base}/dashboard`);
    assert.equal(await page.getAttribute("html", "lang"), "zh-CN");
    assert.equal(await page.title(), "agentgate · 仪表盘");
    const text = await page.textContent("main");
    for (const english of ["Live sessions", "Permits per user", "Recent turns", "this node", "Older", "No session is held", "succeeded", "awaiting"]) {
      assert.ok(!text.includes(english), `untranslated on the Chinese dashboard: ${english}`);
    }
    assert.match(text, /最近的轮次/);
    assert.match(await page.textContent("#status"), /实时/);
    await page.screenshot({ path: path.join(ARTIFACTS, "dashboard-zh.png"), fullPage: true });
    await page.close();
  } finally {
    await zh.close();
  }

  // Narrow screens: nothing sticks out of the page sideways.
  for (const [width, name] of [[800, "800"], [390, "phone"]]) {
    for (const url of [`${server.base}/dashboard`, chatUrl(server.base, user, unique("s"))]) {
      const page = await browser.newTab();
      await page.setViewportSize({ width, height: 860 });
      await page.goto(url);
      await page.waitForSelector("body[data-ready=true]");
      const overflow = await page.evaluate(() => document.documentElement.scrollWidth - window.innerWidth);
      const which = url.includes("dashboard") ? "dashboard" : "chat";
      await page.screenshot({ path: path.join(ARTIFACTS, `${which}-${name}.png`), fullPage: true });
      assert.ok(overflow <= 0, `the ${which} page is ${overflow} px wider than a ${width} px screen`);
      // Nor out of its card: every control and table ends inside the pane that holds it.
      const outside = await page.evaluate(() =>
        [...document.querySelectorAll(".pane select, .pane input, .pane button, .pane textarea, .pane .table-wrap")]
          .filter((el) => el.offsetParent !== null)
          .filter((el) => el.getBoundingClientRect().right > el.closest(".pane").getBoundingClientRect().right + 0.5)
          .map((el) => el.id || el.className || el.tagName),
      );
      assert.deepEqual(outside, [], `the ${which} page at ${width} px: sticking out of their card`);
      await page.close();
    }
  }
});
