// A reply's stream survives what happens to the page and the node (issue
// 14): the reply is teed into its turn's event log in the engine, and a page
// that did not send it, or lost the stream that did, follows that log
// (`GET /v1/turns/{id}/events`, Last-Event-ID on every reconnect).
//
// Every check records each text an assistant bubble showed (a
// MutationObserver installed before the page's own script) and asserts:
// every text shown while the reply ran is a prefix of the reply the server
// stored (no fragment shown twice, none skipped and filled later), some of
// them were shown live after the reload / in the second tab / after the
// restart, and the page ends with that reply, once, with each entry booked
// once.

import { test, before, after } from "node:test";
import assert from "node:assert/strict";
import path from "node:path";
import {
  ARTIFACTS, startServer, launchBrowser, entries, getJson, chatUrl, eventually, unique, freePort, tcpProxy,
} from "../lib/harness.mjs";

/** Per model round; the reply's text then streams in up to 16 pieces, one per THINK_TIME_MS / 20. */
const THINK_TIME_MS = 3_000;
const LEASE_TTL_MS = 2_000;
/** Two entries: a reply long enough to stream in many pieces. */
const MESSAGE = "taxi 18, lunch 35";
const FINAL = "#messages li.msg.assistant[data-state=final]";
/** Recovery: lease expiry, the worker's look (2 s), the rounds run again. */
const RECOVERY_BUDGET_MS = LEASE_TTL_MS + 2_000 + 3 * THINK_TIME_MS + 10_000;

let browser;

before(async () => {
  browser = await launchBrowser();
});

after(async () => {
  await browser?.close();
});

/** Records every (turn, attempt, state, text) an assistant bubble of the page shows, from its first script on. */
function recordBubbles() {
  window.__shown = [];
  const last = new WeakMap();
  const record = () => {
    for (const li of document.querySelectorAll("#messages li.msg.assistant")) {
      const text = li.querySelector(".bubble")?.textContent || "";
      const shown = { turn: li.dataset.turnId || "", attempt: li.dataset.attempt || "", state: li.dataset.state, text };
      const key = JSON.stringify(shown);
      if (last.get(li) === key) continue;
      last.set(li, key);
      window.__shown.push(shown);
    }
  };
  new MutationObserver(record).observe(document, { subtree: true, childList: true, characterData: true, attributes: true });
}

async function newRecordedTab(url) {
  const page = await browser.context.newPage();
  page.on("pageerror", (error) => console.error(`page error: ${error.message}`));
  await page.addInitScript(recordBubbles);
  await page.goto(url);
  await page.waitForSelector("body[data-ready=true]");
  return page;
}

/** The texts the page showed for `turn` while it ran (not the placeholder of a running turn with no events yet). */
async function liveTexts(page, turn) {
  const shown = await page.evaluate(() => window.__shown);
  return shown.filter((s) => s.turn === turn && s.state === "running" && s.attempt !== "" && s.text !== "");
}

/** The conversation's one turn and its stored reply, once it ended. */
async function storedReply(base, user, session) {
  return eventually(async () => {
    const { turns } = await getJson(base, `/app/transcript?${new URLSearchParams({ user_id: user, session_id: session })}`);
    const turn = turns[0];
    return turn && turn.state === "succeeded" && turn.reply ? { turn: turn.turn_id, text: turn.reply.text } : null;
  }, { timeoutMs: RECOVERY_BUDGET_MS, what: "the stored reply" });
}

async function turnIdOf(base, user, session) {
  return eventually(async () => {
    const { turns } = await getJson(base, `/app/transcript?${new URLSearchParams({ user_id: user, session_id: session })}`);
    return turns[0]?.turn_id;
  }, { intervalMs: 20, what: "the turn id" });
}

/** Waits until the page's last assistant bubble shows some streamed text. */
async function midReply(page) {
  await page.waitForFunction(() => {
    const li = [...document.querySelectorAll("#messages li.msg.assistant")].pop();
    return li && li.dataset.state === "running" && (li.querySelector(".bubble")?.textContent || "").length > 0;
  }, null, { timeout: 4 * THINK_TIME_MS + 5_000 });
}

function assertPrefixes(texts, reply, where) {
  for (const shown of texts) {
    assert.ok(reply.startsWith(shown.text), `${where}: shown ${JSON.stringify(shown.text)} is not a prefix of the reply ${JSON.stringify(reply)}`);
  }
  const partial = texts.filter((s) => s.text.length < reply.length);
  assert.ok(partial.length >= 1, `${where}: no part of the reply was shown live (${JSON.stringify(texts)})`);
}

/**
 * After a kill mid-reply: the page ends with the stored reply, once, every
 * text it showed a prefix of it (each attempt's bubble starts the reply
 * over: within any, no gap and no repeat), some of the resumed attempt 2
 * shown live, the turn succeeded at attempt 2 and each entry booked once.
 * `base` is a live node.
 */
async function assertResumed(page, { base, user, session, turn, where, screenshot }) {
  await page.waitForSelector(FINAL, { timeout: RECOVERY_BUDGET_MS });
  await page.screenshot({ path: path.join(ARTIFACTS, screenshot) });
  const reply = await storedReply(base, user, session);
  assert.equal(reply.turn, turn);
  const texts = await liveTexts(page, turn);
  assertPrefixes(texts, reply.text, where);
  assertPrefixes(texts.filter((s) => s.attempt === "2"), reply.text, `${where}: the resumed attempt`);
  const view = await getJson(base, `/v1/turns/${turn}`);
  assert.equal(view.turn.state, "succeeded");
  assert.equal(view.turn.attempt, 2);
  assert.equal((await page.textContent(`${FINAL} .bubble`)).trim(), reply.text);
  assert.equal(await page.locator("#messages li.msg.assistant").count(), 1);
  assert.equal((await entries(base, user)).length, 2);
}

test("a reload mid-reply resumes the reply live: the same final text, no fragment twice", async () => {
  const server = await startServer({ name: "stream-reload", thinkTimeMs: THINK_TIME_MS });
  const user = unique("reload");
  const session = "s-reload";
  const page = await newRecordedTab(chatUrl(server.base, user, session));
  try {
    await page.fill("#composer-input", MESSAGE);
    await page.click("#send");
    await midReply(page);
    const turn = await turnIdOf(server.base, user, session);
    await page.reload();
    await page.waitForSelector("body[data-ready=true]");
    await page.waitForSelector(FINAL, { timeout: 4 * THINK_TIME_MS });
    await page.screenshot({ path: path.join(ARTIFACTS, "stream-after-reload.png") });
    const reply = await storedReply(server.base, user, session);
    assert.equal(reply.turn, turn);
    assertPrefixes(await liveTexts(page, turn), reply.text, "after the reload");
    assert.equal((await page.textContent(`${FINAL} .bubble`)).trim(), reply.text);
    assert.equal(await page.locator("#messages li.msg.assistant").count(), 1);
    assert.equal((await entries(server.base, user)).length, 2);
  } finally {
    await page.close();
    await server.stop();
  }
});

test("while the reply's text streams the status says it is being written, not Thinking", async () => {
  const server = await startServer({ name: "stream-status", thinkTimeMs: THINK_TIME_MS });
  const user = unique("status");
  const page = await newRecordedTab(chatUrl(server.base, user, "s-status"));
  try {
    await page.fill("#composer-input", MESSAGE);
    await page.click("#send");
    await midReply(page);
    const status = await page.locator("#messages li.msg.assistant[data-state=running] .status").innerText();
    assert.equal(status.trim(), "Writing the reply…");
    await page.waitForSelector(FINAL, { timeout: 4 * THINK_TIME_MS });
  } finally {
    await page.close();
    await server.stop();
  }
});

test("a second tab shows the reply live while the first streams it", async () => {
  const server = await startServer({ name: "stream-tabs", thinkTimeMs: THINK_TIME_MS });
  const user = unique("tabs");
  const session = "s-tabs";
  const first = await newRecordedTab(chatUrl(server.base, user, session));
  const second = await newRecordedTab(chatUrl(server.base, user, session));
  try {
    await first.fill("#composer-input", MESSAGE);
    await first.click("#send");
    await midReply(second);
    await second.screenshot({ path: path.join(ARTIFACTS, "stream-second-tab.png") });
    await first.waitForSelector(FINAL, { timeout: 4 * THINK_TIME_MS });
    await second.waitForSelector(FINAL, { timeout: 5_000 });
    const reply = await storedReply(server.base, user, session);
    assertPrefixes(await liveTexts(second, reply.turn), reply.text, "the second tab");
    assertPrefixes(await liveTexts(first, reply.turn), reply.text, "the first tab");
    for (const page of [first, second]) {
      assert.equal((await page.textContent(`${FINAL} .bubble`)).trim(), reply.text);
      assert.equal(await page.locator("#messages li.msg.assistant").count(), 1);
    }
    assert.equal((await entries(server.base, user)).length, 2);
  } finally {
    await first.close();
    await second.close();
    await server.stop();
  }
});

test("the node serving the stream is SIGKILLed mid-reply: after its restart the page shows the resumed reply live, no gap, booked once", async () => {
  const port = await freePort();
  const options = { thinkTimeMs: THINK_TIME_MS, listen: `127.0.0.1:${port}`, args: ["--lease-ttl-ms", String(LEASE_TTL_MS)] };
  const firstNode = await startServer({ name: "stream-kill-1", ...options });
  const user = unique("kill");
  const session = "s-kill";
  let secondNode;
  const page = await newRecordedTab(chatUrl(firstNode.base, user, session));
  try {
    await page.fill("#composer-input", MESSAGE);
    await page.click("#send");
    await midReply(page);
    const turn = await turnIdOf(firstNode.base, user, session);
    await firstNode.stop({ keepStore: true, signal: "SIGKILL" });
    secondNode = await startServer({ ...options, name: "stream-kill-2", dir: firstNode.dir });
    await assertResumed(page, {
      base: secondNode.base, user, session, turn, where: "across the kill", screenshot: "stream-after-kill.png",
    });
  } finally {
    await page.close();
    await secondNode?.stop();
    if (!secondNode) await firstNode.stop();
  }
});

test("Stop on a reply resumed after a reload stops it before it books", async () => {
  const server = await startServer({ name: "stream-stop", thinkTimeMs: THINK_TIME_MS });
  const user = unique("resumed-stop");
  const session = "s-stop";
  const page = await newRecordedTab(chatUrl(server.base, user, session));
  try {
    await page.fill("#composer-input", MESSAGE);
    await page.click("#send");
    await page.locator("#messages li.msg.assistant button.stop").waitFor();
    const turn = await turnIdOf(server.base, user, session);
    await page.reload();
    await page.waitForSelector("body[data-ready=true]");
    // The resumed bubble: followed from the log (its attempt came from the log's started event).
    const resumed = page.locator(`#messages li.msg.assistant[data-state=running][data-attempt="1"][data-turn-id="${turn}"]`);
    await resumed.locator("button.stop").click({ timeout: THINK_TIME_MS });
    await page.waitForSelector("#messages li.msg.assistant[data-state=cancelled]", { timeout: 2 * THINK_TIME_MS });
    await page.screenshot({ path: path.join(ARTIFACTS, "stream-stopped-after-reload.png") });
    assert.match(await page.textContent("#messages li.msg.assistant[data-state=cancelled]"), /You stopped this reply\./);
    const view = await getJson(server.base, `/v1/turns/${turn}`);
    assert.equal(view.turn.state, "cancelled");
    // Its rounds would have booked by now had it gone on.
    await new Promise((resolve) => setTimeout(resolve, 3 * THINK_TIME_MS));
    assert.equal((await entries(server.base, user)).length, 0);
  } finally {
    await page.close();
    await server.stop();
  }
});

test("two nodes behind a proxy: the node serving the stream is SIGKILLed mid-reply and the page resumes the reply from the other node", async () => {
  const options = { thinkTimeMs: THINK_TIME_MS, args: ["--lease-ttl-ms", String(LEASE_TTL_MS)] };
  const nodeA = await startServer({ name: "stream-nodes-a", ...options });
  // Node B: another process on the same store.
  const nodeB = await startServer({ name: "stream-nodes-b", ...options, dir: nodeA.dir });
  const proxy = await tcpProxy(nodeA.port);
  const user = unique("nodes");
  const session = "s-nodes";
  const page = await newRecordedTab(chatUrl(`http://127.0.0.1:${proxy.port}`, user, session));
  try {
    await page.fill("#composer-input", MESSAGE);
    await page.click("#send");
    await midReply(page);
    const turn = await turnIdOf(nodeB.base, user, session);
    // The balancer sends new connections to node B; node A dies.
    proxy.target = nodeB.port;
    await nodeA.stop({ keepStore: true, signal: "SIGKILL" });
    await assertResumed(page, {
      base: nodeB.base, user, session, turn, where: "across the nodes", screenshot: "stream-other-node.png",
    });
  } finally {
    await page.close();
    await proxy.close();
    await nodeA.stop({ keepStore: true });
    await nodeB.stop();
  }
});
