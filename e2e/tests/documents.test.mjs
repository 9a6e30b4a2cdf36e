// The documents pane (seed 003) in headless Chromium against the real
// binary: the same file dropped three times in a row is one ingestion and
// one document, its progress shows while it runs, and a search of it (and
// the agent, asked in the chat) answers from it with its name as the
// citation.

import { test, before, after } from "node:test";
import assert from "node:assert/strict";
import path from "node:path";
import { ARTIFACTS, startServer, launchBrowser, getJson, chatUrl, eventually, unique } from "../lib/harness.mjs";

let server;
let browser;

before(async () => {
  server = await startServer({ name: "documents" });
  browser = await launchBrowser();
});

after(async () => {
  await browser?.close();
  await server?.stop();
});

/** A policy long enough to take several embedding batches. */
function policy() {
  const lines = ["# Travel policy", ""];
  for (let i = 0; i < 300; i++) {
    lines.push(`Rule ${i}: taxis between the airport and the hotel are refunded up to ${20 + i} euros with a receipt.`, "");
  }
  lines.push("Lunch with a client is refunded once a week when the receipt names the client.");
  return lines.join("\n");
}

test("the same file uploaded three times fast is one document, and a search answers from it", async () => {
  const user = unique("docs");
  const page = await browser.newTab(chatUrl(server.base, user, unique("s")));
  const file = { name: "travel-policy.md", mimeType: "text/markdown", buffer: Buffer.from(policy()) };
  // Three uploads back to back, as a person clicking three times on a slow page.
  for (let i = 0; i < 3; i++) await page.setInputFiles("#file", file);
  await page.waitForSelector("#documents li.doc");
  await page.screenshot({ path: path.join(ARTIFACTS, "documents-uploading.png") });
  await page.waitForSelector("#documents li.doc[data-state=indexed]", { timeout: 30_000 });
  await page.screenshot({ path: path.join(ARTIFACTS, "documents-indexed.png") });
  assert.equal(await page.locator("#documents li.doc").count(), 1, "one ingestion listed");
  const listed = await getJson(server.base, `/app/documents?user_id=${encodeURIComponent(user)}`);
  assert.equal(listed.ingestions.length, 1, JSON.stringify(listed));
  const [only] = listed.ingestions;
  assert.equal(only.state, "indexed");
  assert.equal(only.chunks_stored, only.chunks);
  assert.ok(only.chunks > 16, `several batches: ${only.chunks} chunks`);
  assert.equal(await page.locator("#documents-notice").isHidden(), true, "no notice after the uploads");

  await page.fill("#doc-query", "lunch with a client refunded");
  await page.click("#doc-search button");
  await page.waitForSelector("#hits li .hit-source");
  const first = await page.locator("#hits li").first().innerText();
  assert.match(first, /travel-policy\.md/, "cites the document");
  assert.match(first, /Lunch with a client/, "answers from the document");
  await page.screenshot({ path: path.join(ARTIFACTS, "documents-search.png") });

  // The agent answers the same question in the chat, citing the file.
  await page.fill("#composer-input", "Is lunch with a client refunded?");
  await page.click("#send");
  const reply = page.locator("#messages li.msg.assistant[data-state=final]").last();
  await reply.waitFor({ timeout: 20_000 });
  const text = await reply.innerText();
  assert.match(text, /travel-policy\.md/, `the reply cites the document: ${text}`);
  assert.match(text, /Lunch with a client is refunded once a week when the receipt names the client\./, `the reply answers from it: ${text}`);
  await page.screenshot({ path: path.join(ARTIFACTS, "documents-answer.png") });

  // Deleted (after the person confirms): listed as deleted, found no more.
  page.once("dialog", (dialog) => dialog.accept());
  await page.click("#documents li.doc[data-state=indexed] .doc-delete");
  await page.waitForSelector("#documents li.doc[data-state=deleted]");
  assert.match(await page.locator("#documents-notice").innerText(), /travel-policy\.md was deleted/);
  await page.click("#doc-search button");
  await page.waitForSelector("#hits li.muted");
  assert.match(await page.locator("#hits").innerText(), /Nothing in your documents matches/);
  await page.screenshot({ path: path.join(ARTIFACTS, "documents-deleted.png") });
  await page.close();
});

test("a file that is not text is refused with a notice and nothing is listed", async () => {
  const user = unique("docs-bad");
  const page = await browser.newTab(chatUrl(server.base, user, unique("s")));
  await page.setInputFiles("#file", { name: "scan.txt", mimeType: "text/plain", buffer: Buffer.from([0xff, 0xfe, 0x00, 0x01]) });
  await page.waitForSelector("#documents-notice:not([hidden])");
  assert.match(await page.locator("#documents-notice").innerText(), /Not ingested: .*UTF-8/);
  await page.screenshot({ path: path.join(ARTIFACTS, "documents-refused.png") });
  const listed = await getJson(server.base, `/app/documents?user_id=${encodeURIComponent(user)}`);
  assert.equal(listed.ingestions.length, 0);
  await page.close();
});
