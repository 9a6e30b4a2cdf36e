// The ledger agent's chat page. Every message goes to the server, which
// decides: a refusal (409, 429) comes back as a JSON error before any stream
// starts and is shown as it is; an accepted message streams the turn's events
// (deltas, tool calls, tool results, the final reply). Nothing is blocked on
// the client only.

import { h, getJson, postStream, newId, money, clock, fill } from "/assets/common.js";

/** How often a running turn's transcript is re-read (reload mid-turn, a refusal). */
const POLL_INTERVAL_MS = 700;
/** Polls per wait at most: ten minutes, far above any turn's lease. */
const MAX_POLLS = Math.ceil((10 * 60 * 1000) / POLL_INTERVAL_MS);
/** Turns whose request id this browser remembers, so a failed one can be retried as itself. */
const MAX_REMEMBERED_REQUESTS = 100;
const USER_STORAGE = "agentgate.user";
const REQUESTS_STORAGE = "agentgate.requests";

const els = {
  userForm: document.getElementById("user-form"),
  userInput: document.getElementById("user-id"),
  settings: document.getElementById("settings"),
  sessionList: document.getElementById("session-list"),
  newSession: document.getElementById("new-session"),
  sessionLabel: document.getElementById("session-label"),
  messages: document.getElementById("messages"),
  notice: document.getElementById("notice"),
  composer: document.getElementById("composer"),
  input: document.getElementById("composer-input"),
  totals: document.getElementById("totals"),
  categories: document.querySelector("#categories tbody"),
  entries: document.querySelector("#entries tbody"),
  ledgerCount: document.getElementById("ledger-count"),
};

const state = {
  user: "demo-user",
  session: "",
  /** The message being sent: {text, id, session}. Kept until the server accepts it. */
  draft: null,
  /** Messages the server refused in this view: {text, code}; shown after the transcript until the next accepted send. */
  unsent: [],
  /** Streams this tab is reading; the transcript is not re-rendered under them. */
  activeStreams: 0,
  polling: false,
  settings: null,
};

// ------------------------------------------------------------ helpers

function newSessionId() {
  return newId("s").slice(0, 14);
}

function readHash() {
  const params = new URLSearchParams(location.hash.slice(1));
  return { user: params.get("user"), session: params.get("session") };
}

function writeHash() {
  const params = new URLSearchParams({ user: state.user, session: state.session });
  history.replaceState(null, "", `#${params}`);
}

function rememberRequest(turnId, request) {
  let map = {};
  try {
    map = JSON.parse(localStorage.getItem(REQUESTS_STORAGE) || "{}");
  } catch {
    map = {};
  }
  map[turnId] = request;
  const keys = Object.keys(map);
  for (const key of keys.slice(0, Math.max(0, keys.length - MAX_REMEMBERED_REQUESTS))) delete map[key];
  localStorage.setItem(REQUESTS_STORAGE, JSON.stringify(map));
}

function rememberedRequest(turnId) {
  try {
    return JSON.parse(localStorage.getItem(REQUESTS_STORAGE) || "{}")[turnId] || null;
  } catch {
    return null;
  }
}

function showNotice(text, kind = "warn") {
  els.notice.textContent = text;
  els.notice.dataset.kind = kind;
  els.notice.hidden = false;
}

function hideNotice() {
  els.notice.hidden = true;
  els.notice.textContent = "";
}

function scrollToEnd() {
  els.messages.scrollTop = els.messages.scrollHeight;
}

function sleep(ms) {
  return new Promise((resolve) => setTimeout(resolve, ms));
}

/** What a refusal means for the person, from the server's error code. */
function refusalText(status, error) {
  const code = error && error.code;
  const seconds = error && error.retry_after_ms ? Math.ceil(error.retry_after_ms / 1000) : null;
  switch (code) {
    case "session_busy":
    case "request_in_flight":
      return "The previous message is still being processed. Your message was not sent: send it again once the reply is in.";
    case "awaiting_confirmation":
      return "Waiting for your confirmation: approve or reject the pending entry before sending a new message.";
    case "user_at_capacity":
      return `You already have the most conversations running at once${seconds ? `; try again in ${seconds} s` : ""}.`;
    case "payload_mismatch":
      return "This message id was already used for a different text; edit the message to send it as a new one.";
    case "network":
      return "Could not reach the server. Your message was kept: send it again to retry (it will not be booked twice).";
    default:
      return `${(error && error.message) || "The server refused the message"} (HTTP ${status}).`;
  }
}

// ------------------------------------------------------------ rendering

function userBubble(text, status) {
  return h(
    "li",
    { class: "msg user" },
    h("div", { class: "bubble" }, text),
    h("div", { class: "status" }, status || ""),
  );
}

function refusedBubble(text, code) {
  const li = userBubble(text, "Not sent");
  li.classList.add("refused");
  li.dataset.code = code || "";
  return li;
}

function setStatus(li, text) {
  const status = li.querySelector(".status");
  if (status) status.textContent = text;
}

function bookedList(entries) {
  if (!entries || entries.length === 0) return null;
  return h(
    "ul",
    { class: "booked", "aria-label": "Booked entries" },
    entries.map((e) =>
      h("li", {}, `#${e.id} ${e.category} ${e.type === "income" ? "+" : "−"}${e.amount} · ${e.occur_date}`),
    ),
  );
}

function describeArgs(name, args) {
  if (!args || typeof args !== "object") return name;
  if (name === "create_transaction") {
    const parts = [args.type, args.amount, args.category_name].filter((p) => p !== undefined && p !== null);
    return `${name}(${parts.join(", ")})`;
  }
  if (name === "list_categories") return `${name}(${args.type || ""})`;
  return name;
}

/** The assistant's side of a turn being streamed. */
function liveAssistant() {
  const text = h("div", { class: "bubble working" }, "");
  const tools = h("ul", { class: "tools", "aria-label": "Tool calls" });
  const extra = h("div", {});
  const status = h("div", { class: "status" }, "Thinking…");
  const li = h("li", { class: "msg assistant", dataset: { state: "running" } }, text, tools, extra, status);
  const calls = new Map();
  let streamed = "";
  const bubble = {
    li,
    done: false,
    turnId: null,
    handle(name, data, request) {
      switch (name) {
        case "started":
          bubble.turnId = data.turn_id;
          li.dataset.turnId = data.turn_id;
          if (request) rememberRequest(data.turn_id, request);
          if (data.takeover) status.textContent = `Resumed after a crash (attempt ${data.attempt})…`;
          else if (data.attempt > 1) status.textContent = `Retrying (attempt ${data.attempt})…`;
          break;
        case "delta":
          streamed += data.text;
          text.textContent = streamed;
          break;
        case "tool_call": {
          const chip = h("li", { title: JSON.stringify(data.args) }, describeArgs(data.name, data.args));
          calls.set(data.call_id, chip);
          tools.append(chip);
          break;
        }
        case "tool_result": {
          const chip = calls.get(data.call_id) || h("li", {}, data.name);
          if (!chip.isConnected) tools.append(chip);
          const ok = data.result && data.result.ok;
          const pending = data.result && data.result.needs_confirmation;
          chip.className = ok ? "ok" : pending ? "" : "err";
          chip.append(ok ? " ✓" : pending ? " ⏸" : " ✗");
          if (data.cached) chip.append(" (cached)");
          chip.title = JSON.stringify(data.result);
          break;
        }
        case "awaiting_confirmation":
          text.classList.remove("working");
          text.textContent = data.text;
          li.dataset.state = "awaiting_confirmation";
          fill(extra, confirmCard(data.turn_id, data.pending, true));
          status.textContent = "Waiting for your confirmation";
          bubble.done = true;
          break;
        case "final":
          text.classList.remove("working");
          renderOutcome(bubble, data.outcome, { text, extra, status });
          bubble.done = true;
          break;
        case "error":
          text.classList.remove("working");
          li.classList.add("failed");
          li.dataset.state = "error";
          li.dataset.code = data.code;
          text.textContent = data.message;
          status.textContent = data.retryable
            ? "Send the message again to retry: nothing is booked twice."
            : "";
          bubble.done = true;
          break;
        default:
          break;
      }
      scrollToEnd();
    },
    broken() {
      text.classList.remove("working");
      status.textContent = "Connection lost. The turn goes on on the server; its reply appears here when it ends.";
    },
  };
  return bubble;
}

function renderOutcome(bubble, outcome, parts) {
  const { text, extra, status } = parts;
  const reply = outcome.reply || {};
  bubble.li.dataset.turnId = outcome.turn_id;
  if (outcome.state === "failed") {
    bubble.li.classList.add("failed");
    bubble.li.dataset.state = "error";
    text.textContent = (outcome.error && (outcome.error.message || JSON.stringify(outcome.error))) || "This turn failed.";
    return;
  }
  bubble.li.dataset.state = "final";
  text.textContent = reply.text || "";
  const children = [bookedList(reply.entries)];
  if (outcome.state === "awaiting_confirmation") {
    children.push(confirmCard(outcome.turn_id, reply.pending || [], true));
  }
  fill(extra, children);
  status.textContent = outcome.replayed ? "Already answered: the stored reply, nothing booked again." : "";
}

/** The approve / reject card of a pending confirmation. */
function confirmCard(turnId, pending, live) {
  // One answer id per card in this tab, reused if the same answer is re-sent.
  const requestId = newId("confirm");
  const status = h("p", { class: "status muted" });
  const approve = h("button", { type: "button", class: "approve", dataset: { decision: "approve" } }, "Approve");
  const reject = h("button", { type: "button", class: "reject", dataset: { decision: "reject" } }, "Reject");
  const card = h(
    "div",
    { class: "confirm-card", role: "group", "aria-label": "Pending confirmation", dataset: { turnId } },
    h("h3", {}, live ? "Confirm before booking" : "Confirmation no longer pending"),
    h(
      "ul",
      {},
      pending.map((e) =>
        h("li", {}, `${e.category} ${e.type === "income" ? "+" : "−"}${money(e.amount_cents)}${e.note ? ` · ${e.note}` : ""} · ${e.occur_date}`),
      ),
    ),
    live ? h("div", { class: "actions" }, approve, reject) : null,
    status,
  );
  if (!live) card.classList.add("answered");
  const answer = async (decision) => {
    approve.disabled = true;
    reject.disabled = true;
    status.textContent = "Sending…";
    hideNotice();
    let assistant = null;
    state.activeStreams += 1;
    const result = await postStream(
      "/app/confirmations",
      { user_id: state.user, session_id: state.session, client_request_id: requestId, turn_id: turnId, decision },
      {
        onOpen() {
          assistant = liveAssistant();
          els.messages.append(userBubble(decision === "approve" ? "✓ Approve" : "✗ Reject"), assistant.li);
          scrollToEnd();
        },
        onEvent(name, data) {
          assistant.handle(name, data);
        },
      },
    );
    state.activeStreams -= 1;
    if (!result.ok) {
      const code = result.error && result.error.code;
      if (code === "request_in_flight" || code === "session_busy") {
        status.textContent = "Already being answered (in another tab?)…";
        showNotice("This confirmation is already being processed; its result appears here when it ends.");
        pollUntilIdle();
      } else if (code === "not_found") {
        status.textContent = "Already answered or expired.";
        refresh();
      } else {
        approve.disabled = false;
        reject.disabled = false;
        status.textContent = "";
        showNotice(refusalText(result.status, result.error), "error");
      }
      return;
    }
    card.classList.add("answered");
    status.textContent = decision === "approve" ? "Approved." : "Rejected.";
    if (!result.ended || (assistant && !assistant.done)) {
      if (assistant) assistant.broken();
      pollUntilIdle();
    }
    afterTurn();
  };
  approve.addEventListener("click", () => answer("approve"));
  reject.addEventListener("click", () => answer("reject"));
  return card;
}

/** The assistant's side of a turn from the transcript. */
function recordedAssistant(turn, pending) {
  const reply = turn.reply || {};
  const text = h("div", { class: "bubble" }, reply.text || "");
  const extra = h("div", {});
  const status = h("div", { class: "status" });
  const li = h("li", { class: "msg assistant", dataset: { turnId: turn.turn_id, state: turn.state || "unknown" } }, text, extra, status);
  switch (turn.state) {
    case "running":
      text.classList.add("working");
      text.textContent = "Working on it…";
      status.textContent = "Still running: the reply appears here when the turn ends.";
      break;
    case "awaiting_confirmation": {
      const live = Boolean(pending && pending.turn_id === turn.turn_id);
      fill(extra, bookedList(reply.entries), confirmCard(turn.turn_id, reply.pending || [], live));
      if (!live) status.textContent = "The confirmation expired.";
      break;
    }
    case "confirmed":
      fill(extra, bookedList(reply.entries));
      status.textContent = "Answered below.";
      break;
    case "failed": {
      li.classList.add("failed");
      const error = turn.error || {};
      text.textContent = error.message || error.code || "This turn failed.";
      const request = rememberedRequest(turn.turn_id);
      if (request && request.text) {
        fill(
          extra,
          h("button", { type: "button", onclick: () => sendMessage(request.text, request.id) }, "Retry"),
        );
        status.textContent = "Retrying resumes it: nothing is booked twice.";
      }
      break;
    }
    default:
      fill(extra, bookedList(reply.entries));
  }
  li.dataset.state = turn.state === "running" ? "running" : turn.state === "failed" ? "error" : "final";
  return li;
}

function renderTranscript(data) {
  const items = [];
  for (const turn of data.turns) {
    const said = turn.confirms ? (turn.user_text === "确认" ? "✓ Approve" : "✗ Reject") : turn.user_text;
    items.push(userBubble(said, clock(turn.created_at_ms)));
    items.push(recordedAssistant(turn, data.pending));
  }
  if (data.running && !data.turns.some((turn) => turn.state === "running")) {
    // The session is held by a turn whose message is not recorded yet (or by
    // an API caller): show that something is running.
    items.push(recordedAssistant({ turn_id: "", state: "running" }, null));
  }
  for (const message of state.unsent) items.push(refusedBubble(message.text, message.code));
  if (items.length === 0) {
    items.push(
      h("li", { class: "empty" }, "No messages yet. Tell the agent what you spent or earned: “午饭 35”, “taxi 18 yesterday”."),
    );
  }
  fill(els.messages, items);
  scrollToEnd();
}

function renderSessions(sessions) {
  const items = sessions.map((s) => ({ id: s.session_id, title: s.title, meta: `${s.turns} turn${s.turns === 1 ? "" : "s"} · ${clock(s.last_message_at_ms)}` }));
  if (!items.some((s) => s.id === state.session)) {
    items.unshift({ id: state.session, title: "New conversation", meta: "no messages yet" });
  }
  fill(
    els.sessionList,
    items.map((s) =>
      h(
        "li",
        {},
        h(
          "button",
          {
            type: "button",
            "aria-current": s.id === state.session ? "true" : "false",
            onclick: () => switchSession(s.id),
          },
          h("span", { class: "title" }, s.title),
          h("span", { class: "meta" }, s.meta),
        ),
      ),
    ),
  );
  els.sessionLabel.textContent = state.session;
}

function renderLedger(ledger) {
  const totals = ledger.totals;
  fill(
    els.totals,
    h("div", { class: "total expense" }, h("span", { class: "label" }, "Expense"), h("span", { class: "value" }, totals.expense)),
    h("div", { class: "total income" }, h("span", { class: "label" }, "Income"), h("span", { class: "value" }, totals.income)),
  );
  const largest = Math.max(1, ...totals.categories.map((c) => c.amount_cents));
  fill(
    els.categories,
    totals.categories.length === 0
      ? h("tr", {}, h("td", { colspan: 3, class: "muted" }, "Nothing booked yet."))
      : totals.categories.map((c) =>
          h(
            "tr",
            {},
            h("td", {}, `${c.category}${c.type === "income" ? " (income)" : ""}`, h("div", { class: "bar", "aria-hidden": "true" }, h("span", { style: { width: `${Math.round((100 * c.amount_cents) / largest)}%` } }))),
            h("td", { class: "num" }, c.count),
            h("td", { class: `num ${c.type}` }, c.amount),
          ),
        ),
  );
  fill(
    els.entries,
    ledger.entries.map((e) =>
      h(
        "tr",
        { dataset: { entryId: e.id } },
        h("td", { class: "mono" }, e.occur_date),
        h("td", {}, e.category),
        h("td", {}, e.note),
        h("td", { class: `num ${e.type}` }, `${e.type === "income" ? "+" : "−"}${e.amount}`),
      ),
    ),
  );
  els.ledgerCount.textContent = `${ledger.entries.length} entr${ledger.entries.length === 1 ? "y" : "ies"}`;
}

// ------------------------------------------------------------ loading

async function loadSessions() {
  const result = await getJson(`/app/sessions?${new URLSearchParams({ user_id: state.user })}`);
  if (result.ok) renderSessions(result.body.sessions);
  return result.ok ? result.body.sessions : [];
}

async function loadTranscript() {
  const params = new URLSearchParams({ user_id: state.user, session_id: state.session });
  const result = await getJson(`/app/transcript?${params}`);
  if (!result.ok) {
    showNotice(refusalText(result.status, result.body.error), "error");
    return null;
  }
  return result.body;
}

async function loadLedger() {
  const result = await getJson(`/app/ledger?${new URLSearchParams({ user_id: state.user })}`);
  if (result.ok) renderLedger(result.body);
}

async function loadSettings() {
  const result = await getJson("/app/settings");
  if (!result.ok) return;
  const s = result.body;
  state.settings = s;
  els.settings.textContent =
    `Model: ${s.model} · entries above ${money(s.confirmation_threshold_cents)} need confirmation · ` +
    `closing the tab ${s.on_disconnect === "cancel" ? "cancels the turn" : "lets the turn finish"} · ` +
    `lease ${Math.round(s.lease_ttl_ms / 1000)} s · ${s.max_turns_per_user} turns per user at once`;
}

/** Re-reads the transcript (unless this tab is streaming), then the side panes. */
async function refresh() {
  const data = await loadTranscript();
  if (data && state.activeStreams === 0) renderTranscript(data);
  loadLedger();
  loadSessions();
  return data;
}

/** Polls the transcript until no turn of this session runs, then shows it. */
async function pollUntilIdle() {
  if (state.polling) return;
  state.polling = true;
  const session = state.session;
  try {
    for (let i = 0; i < MAX_POLLS && session === state.session; i += 1) {
      const data = await loadTranscript();
      if (data && !data.running && state.activeStreams === 0) {
        renderTranscript(data);
        break;
      }
      await sleep(POLL_INTERVAL_MS);
    }
  } finally {
    state.polling = false;
  }
  loadLedger();
  loadSessions();
}

function afterTurn() {
  loadLedger();
  loadSessions();
  if (state.activeStreams === 0) refresh();
}

// ------------------------------------------------------------ actions

async function sendMessage(rawText, retryId) {
  const text = rawText.trim();
  if (!text) {
    showNotice("Type a message first.", "error");
    return;
  }
  if (retryId) {
    state.draft = { text, id: retryId, session: state.session };
  } else if (!state.draft || state.draft.text !== text || state.draft.session !== state.session) {
    state.draft = { text, id: newId("msg"), session: state.session };
  }
  const draft = state.draft;
  hideNotice();
  els.messages.querySelector(".empty")?.remove();
  const userLi = userBubble(text, "Sending…");
  els.messages.append(userLi);
  scrollToEnd();
  let assistant = null;
  state.activeStreams += 1;
  const result = await postStream(
    "/app/messages",
    {
      user_id: state.user,
      session_id: draft.session,
      client_request_id: draft.id,
      text,
      utc_offset_minutes: -new Date().getTimezoneOffset(),
    },
    {
      onOpen() {
        setStatus(userLi, "");
        state.unsent = [];
        if (state.draft === draft) {
          state.draft = null;
          if (els.input.value.trim() === text) els.input.value = "";
        }
        assistant = liveAssistant();
        if (draft.session === state.session) els.messages.append(assistant.li);
        scrollToEnd();
      },
      onEvent(name, data) {
        assistant.handle(name, data, { id: draft.id, text });
      },
    },
  );
  state.activeStreams -= 1;
  if (!result.ok) {
    const code = (result.error && result.error.code) || "";
    userLi.replaceWith(refusedBubble(text, code));
    state.unsent.push({ text, code });
    showNotice(refusalText(result.status, result.error), result.status === 409 || result.status === 429 ? "warn" : "error");
    if (code === "session_busy" || code === "request_in_flight") pollUntilIdle();
    if (code === "awaiting_confirmation") {
      const data = await loadTranscript();
      if (data && state.activeStreams === 0 && !document.querySelector(".confirm-card:not(.answered)")) renderTranscript(data);
      document.querySelector(".confirm-card:not(.answered) button.approve")?.focus();
    }
    return;
  }
  if (!result.ended || (assistant && !assistant.done)) {
    if (assistant) assistant.broken();
    pollUntilIdle();
    return;
  }
  afterTurn();
}

async function switchSession(sessionId) {
  state.session = sessionId;
  state.draft = null;
  state.unsent = [];
  writeHash();
  hideNotice();
  fill(els.messages);
  const data = await refresh();
  if (data && data.running) pollUntilIdle();
}

async function switchUser(userId) {
  const user = userId.trim();
  if (!user || new TextEncoder().encode(user).length > 128) {
    showNotice("A user id is 1 to 128 bytes.", "error");
    return;
  }
  state.user = user;
  localStorage.setItem(USER_STORAGE, user);
  els.userInput.value = user;
  const sessions = await loadSessions();
  await switchSession(sessions.length ? sessions[0].session_id : newSessionId());
}

function wire() {
  els.composer.addEventListener("submit", (event) => {
    event.preventDefault();
    sendMessage(els.input.value);
  });
  els.input.addEventListener("keydown", (event) => {
    if (event.key === "Enter" && !event.shiftKey && !event.isComposing) {
      event.preventDefault();
      sendMessage(els.input.value);
    }
  });
  els.userForm.addEventListener("submit", (event) => {
    event.preventDefault();
    switchUser(els.userInput.value);
  });
  els.newSession.addEventListener("click", () => {
    switchSession(newSessionId());
    els.input.focus();
  });
  window.addEventListener("focus", () => {
    loadLedger();
    loadSessions();
  });
  window.addEventListener("hashchange", () => {
    const hash = readHash();
    if (hash.user && hash.user !== state.user) switchUser(hash.user);
    else if (hash.session && hash.session !== state.session) switchSession(hash.session);
  });
}

async function start() {
  wire();
  const hash = readHash();
  state.user = hash.user || localStorage.getItem(USER_STORAGE) || "demo-user";
  els.userInput.value = state.user;
  loadSettings();
  if (hash.session) {
    state.session = hash.session;
    await switchSession(hash.session);
  } else {
    const sessions = await loadSessions();
    await switchSession(sessions.length ? sessions[0].session_id : newSessionId());
  }
  document.body.dataset.ready = "true";
}

start();
