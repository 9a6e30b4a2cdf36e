// The ledger agent's chat page. Every message goes to the server, which
// decides: a refusal (409, 429) comes back as a JSON error before any stream
// starts and is shown as it is; an accepted message streams the turn's events
// (deltas, tool calls, tool results, the final reply). Nothing is blocked on
// the client only.
//
// A message keeps one client_request_id from the moment it is first sent
// until its reply is known: a second click, Enter pressed twice, a resend
// after a lost connection or a reload all send that same id, so the server
// runs it at most once. Messages not yet answered wait in an outbox in
// localStorage and are resent with their id, with backoff, while a page of
// this browser is open. Tabs of one conversation keep each other in sync
// (BroadcastChannel, plus polling the server for other browsers).
//
// Every notice says what is true: when it says a message is in the box, it
// is; when it says a message will be resent, the outbox resends it.
//
// With the conversation's policy "queues behind the reply" (enqueue) or
// "replaces queued messages" (supersede), a message sent while a reply runs
// is answered 202: it waits in the session's queue and shows "Queued ·
// position N" with a Cancel button, from the transcript (so also after a
// reload). The server runs it when the reply before it ends (the handoff),
// whether or not this page is open; its reply then shows like any other.

import { h, getJson, getStream, postStream, postBytes, newId, money, clock, fill } from "/assets/common.js";
import { t, translatePage, category } from "/assets/i18n.js";

/** Transcript polls while a turn of this session runs, or a message of ours waits for its reply. */
const SYNC_BUSY_MS = 700;
/** Transcript polls while idle: picks up other browsers' messages. */
const SYNC_IDLE_MS = 2500;
/** Transcript polls while the tab is hidden. */
const SYNC_HIDDEN_MS = 10_000;
/**
 * Transcript polls while the page says the server is not answering: a
 * refused connection costs nothing, and the notice is gone within this
 * much of the server's return (at the idle pace it stayed over a second).
 */
const SYNC_OFFLINE_MS = 250;
/** How often the outbox is looked at. */
const OUTBOX_TICK_MS = 1000;
/** Automatic sends of one message at most (then the person decides): about ten minutes with the backoff. */
const MAX_AUTO_SENDS = 25;
const BACKOFF_FIRST_MS = 1000;
const BACKOFF_MAX_MS = 30_000;
/** Messages kept in the outbox at most; the oldest are dropped beyond. */
const MAX_OUTBOX = 50;
/**
 * How long a queued message of ours keeps the transcript polled at the busy
 * pace: a queue of ten replies of a slow model. Beyond it the idle pace
 * still shows its reply, only later.
 */
const QUEUED_FOLLOW_MS = 10 * 60_000;
/**
 * Longest a queued-policy message waits for the server's answer to the one
 * sent before it in this tab before it is sent anyway: sent in the order
 * typed, they queue in that order. An answer's headers come in
 * milliseconds; this only bounds a server that never answers.
 */
const SEND_ORDER_MAX_WAIT_MS = 10_000;
/** An outbox entry whose tab has not touched it for this long is adopted by another tab (the first was closed). */
const OWNER_STALE_MS = 10_000;
/** Re-asks of one confirmation answer while another tab's answer runs. */
const MAX_CONFIRM_FOLLOWS = 60;
/**
 * Reconnects of one running reply's event stream in a row with no event
 * between them (about four minutes with the backoff): a server restart
 * takes a few seconds; beyond it the transcript's poll takes over.
 */
const MAX_FOLLOW_RECONNECTS = 12;
const USER_STORAGE = "agentgate.user";
const OUTBOX_STORAGE = "agentgate.outbox";
const TAB_ID = newId("tab");

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
  drop: document.getElementById("drop"),
  file: document.getElementById("file"),
  versionFile: document.getElementById("version-file"),
  documents: document.getElementById("documents"),
  documentsCount: document.getElementById("documents-count"),
  documentsNotice: document.getElementById("documents-notice"),
  docSearch: document.getElementById("doc-search"),
  docQuery: document.getElementById("doc-query"),
  hits: document.getElementById("hits"),
  busyPolicy: document.getElementById("busy-policy"),
};

/** The engine's default bound on a waiting begin (`DEFAULT_BUSY_WAIT`), for the notice after it ran out. */
const BUSY_WAIT_MS = 12_000;

/** How often the documents list is read while an ingestion runs. */
const DOCUMENTS_BUSY_MS = 700;
/** How long an accepted upload is looked for in the list before it is given up on. */
const DOCUMENT_APPEAR_MS = 10_000;
/** How often the documents list is read again while the server does not answer. */
const DOCUMENTS_RETRY_MS = 2_000;

const state = {
  user: "demo-user",
  session: "",
  /** The message in the box and its id: {id, user, session, text}. Kept until the server accepts it. */
  draft: null,
  /** Streams this tab is reading; the transcript is not re-rendered under them. */
  activeStreams: 0,
  /** Whether the server said a turn of this session runs (last sync). */
  running: false,
  /** The last transcript rendered, to re-render only on change. */
  signature: "",
  /** After session_busy: the text that waits in the box for the running turn to end. */
  busyText: null,
  settings: null,
  /** An answer to a confirmation the server may not have received: {turnId, decision, session}. */
  unsureAnswer: null,
};

/** Message ids this tab has a request open for (a count: a double-click opens two). */
const sending = new Map();
/** Wakes the sync loop early (another tab changed something, this tab sent). */
let wakeSync = () => {};
/** A wake asked for while a sync ran: the next wait is skipped. */
let wakeRequested = false;

const channel = typeof BroadcastChannel === "function" ? new BroadcastChannel("agentgate.app") : null;

// ------------------------------------------------------------ helpers

// A session id belongs to the user whose message first uses it, so it must
// be unguessable: a whole UUIDv4 (122 random bits), never a counter.
function newSessionId() {
  return newId("s");
}

function readHash() {
  const params = new URLSearchParams(location.hash.slice(1));
  return { user: params.get("user"), session: params.get("session") };
}

function writeHash() {
  const params = new URLSearchParams({ user: state.user, session: state.session });
  history.replaceState(null, "", `#${params}`);
}

function sleep(ms) {
  return new Promise((resolve) => setTimeout(resolve, ms));
}

function seconds(ms) {
  return Math.max(1, Math.ceil((ms || 0) / 1000));
}

/** The conversation's policy for a message sent while a reply runs: reject, wait, interrupt, enqueue or supersede. */
function busyPolicy(user, session) {
  try {
    const saved = localStorage.getItem(`agentgate.busy.${user}.${session}`);
    return ["wait", "interrupt", "enqueue", "supersede"].includes(saved) ? saved : "reject";
  } catch {
    return "reject";
  }
}

function saveBusyPolicy(policy) {
  try {
    localStorage.setItem(`agentgate.busy.${state.user}.${state.session}`, policy);
  } catch {
    // Private mode: the choice lasts for this page only.
  }
}

/** Whether `policy` queues a message sent while a reply runs. */
function queues(policy) {
  return policy === "enqueue" || policy === "supersede";
}

/** Per conversation, the answer to this tab's last queued-policy send: the next one is sent after it. */
const sendOrder = new Map();

/** This tab's interrupting messages per session still being answered. */
const interrupting = new Map();
/** How this tab saw a reply stopped (turn id → notice key), so a re-render keeps saying it. */
const stoppedBy = new Map();

/** Tells the other tabs of this browser that this conversation changed. */
function broadcast() {
  channel?.postMessage({ type: "changed", user: state.user, session: state.session });
}

/** Notices carry a key, so a later event clears only the notice it is about. */
function showNotice(text, kind = "warn", key = "") {
  els.notice.textContent = text;
  els.notice.dataset.kind = kind;
  els.notice.dataset.key = key;
  els.notice.hidden = false;
}

function hideNotice(key) {
  if (key !== undefined && els.notice.dataset.key !== key) return;
  els.notice.hidden = true;
  els.notice.textContent = "";
  els.notice.dataset.key = "";
}

function scrollToEnd() {
  els.messages.scrollTop = els.messages.scrollHeight;
}

// ------------------------------------------------------------ the outbox

function readOutbox() {
  try {
    const list = JSON.parse(localStorage.getItem(OUTBOX_STORAGE) || "[]");
    return Array.isArray(list) ? list : [];
  } catch {
    return [];
  }
}

function writeOutbox(list) {
  localStorage.setItem(OUTBOX_STORAGE, JSON.stringify(list.slice(-MAX_OUTBOX)));
}

function outboxGet(id) {
  return readOutbox().find((entry) => entry.id === id) || null;
}

/** Creates or updates the entry of message `id`; this tab owns it from now on. */
function outboxUpdate(id, change) {
  const list = readOutbox();
  const index = list.findIndex((entry) => entry.id === id);
  const entry = { ...(index >= 0 ? list[index] : {}), ...change, id, owner: TAB_ID, touched_at_ms: Date.now() };
  if (index >= 0) list[index] = entry;
  else list.push(entry);
  writeOutbox(list);
  return entry;
}

function outboxRemove(id) {
  writeOutbox(readOutbox().filter((entry) => entry.id !== id));
}

function backoffMs(attempts) {
  return Math.min(BACKOFF_MAX_MS, BACKOFF_FIRST_MS * 2 ** Math.max(0, attempts - 1));
}

/** The id to send `text` with: the box's draft, or a message of this conversation still waiting for its reply. */
function messageFor(text) {
  const draft = state.draft;
  if (draft && draft.text === text && draft.session === state.session && draft.user === state.user) return draft;
  const waiting = readOutbox().find((e) => e.user === state.user && e.session === state.session && e.text === text);
  if (waiting) return { id: waiting.id, user: waiting.user, session: waiting.session, text };
  return { id: newId("msg"), user: state.user, session: state.session, text };
}

// ------------------------------------------------------------ rendering

function userBubble(text, status, requestId) {
  return h(
    "li",
    { class: "msg user", dataset: requestId ? { requestId } : {} },
    h("div", { class: "bubble" }, text),
    h("div", { class: "status" }, status || ""),
  );
}

function setStatus(li, text) {
  const status = li && li.querySelector(".status");
  if (status) status.textContent = text;
}

/** Whether a turn of the transcript ended without ever running: cancelled while queued, or superseded. */
function unrun(turn) {
  return turn.attempt === 0 && (turn.state === "cancelled" || turn.state === "superseded");
}

/** The queue's positions by turn id, from the transcript's `queue`. */
function queuePositions(data) {
  return new Map((data.queue || []).map((entry) => [entry.turn_id, entry.position]));
}

/**
 * Shows a user bubble as waiting in its session's queue: its position (null
 * when the server's list no longer names it: it is being handed off right
 * now) and a Cancel button.
 */
function showQueued(li, turnId, position, text) {
  li.dataset.state = "queued";
  li.dataset.turnId = turnId;
  setStatus(li, position ? t("status.queued", { n: position }) : t("status.queued_next"));
  if (!li.querySelector("button.cancel-queued")) li.append(cancelButton(li, turnId, text));
}

/** Shows that a queued message ended without running: cancelled, or replaced by a newer one. */
function showUnrun(li, turnState) {
  li.dataset.state = turnState;
  li.classList.add("unrun");
  li.querySelector("button.cancel-queued")?.remove();
  setStatus(li, t(turnState === "superseded" ? "queued.superseded" : "queued.cancelled"));
}

/**
 * The Cancel button of a queued message: the engine's cancel (the Stop
 * route), which ends a queued turn at once. The page says what the server
 * found: cancelled before it ran, or too late (it had started: then the
 * cancel stops it, or it had already run).
 */
function cancelButton(li, turnId, text) {
  const button = h("button", { type: "button", class: "cancel-queued" }, t("queue.cancel"));
  button.addEventListener("click", async () => {
    button.disabled = true;
    setStatus(li, t("status.cancelling"));
    const params = new URLSearchParams({ user_id: state.user, turn_id: turnId });
    const result = await postBytes(`/app/stop?${params}`, new ArrayBuffer(0));
    if (!result.ok) {
      button.disabled = false;
      const error = (result.body && result.body.error) || {};
      setStatus(
        li,
        result.status === 0 ? t("status.cancel_offline") : t("status.cancel_refused", { message: error.message || error.code || result.status }),
      );
      return;
    }
    const found = result.body;
    if (found.attempt === 0 && (found.state === "cancelled" || found.state === "superseded")) {
      showUnrun(li, found.state);
      if (found.state === "cancelled") showNotice(t("notice.queue_cancelled", { text }), "warn", "queue-cancel");
      if (li.dataset.requestId) outboxRemove(li.dataset.requestId);
    } else if (found.state === "running") {
      // Handed off since the last look: the cancel request stops it.
      stoppedBy.set(turnId, "stopped.by_you");
      button.remove();
      setStatus(li, t("status.cancel_stopping"));
    } else {
      button.remove();
      showNotice(t("notice.queue_cancel_late", { text }), "warn", "queue-cancel");
    }
    broadcast();
    syncNow();
  });
  return button;
}

/**
 * Updates the queued bubbles in view from the transcript without redrawing
 * it (a reply of this tab is streaming): positions, and the ones that ended
 * without running. One that started shows its reply at the next redraw.
 */
function updateQueued(data) {
  const positions = queuePositions(data);
  for (const li of els.messages.querySelectorAll("li.msg.user[data-state=queued]")) {
    const turn = data.turns.find((recorded) => recorded.turn_id === li.dataset.turnId);
    if (!turn) continue;
    if (turn.state === "queued") showQueued(li, turn.turn_id, positions.get(turn.turn_id) ?? null, turn.user_text);
    else if (unrun(turn)) showUnrun(li, turn.state);
    else {
      li.dataset.state = "started";
      li.querySelector("button.cancel-queued")?.remove();
      setStatus(li, "");
    }
  }
}

function bookedList(entries) {
  if (!entries || entries.length === 0) return null;
  return h(
    "ul",
    { class: "booked", "aria-label": t("entries") },
    entries.map((e) => h("li", {}, `#${e.id} ${category(e.category)} ${money(e.amount_cents, e.type)} · ${e.occur_date}`)),
  );
}

/** What a stopped reply had already booked, said as such; nothing when it booked nothing. */
function alreadyBooked(entries) {
  if (!entries || entries.length === 0) return [];
  return [h("div", { class: "already-booked" }, t("stopped.already_booked")), bookedList(entries)];
}

/**
 * A reply stopped while this tab streamed it: what it had booked stays in
 * the ledger, so the bubble says so, from the transcript (the same the
 * reply shows after a reload or in another tab).
 */
async function showAlreadyBooked(turnId, extra) {
  const data = await loadTranscript();
  const turn = data && data.turns.find((x) => x.turn_id === turnId);
  const entries = turn && turn.reply ? turn.reply.entries : null;
  if (entries && entries.length > 0 && extra.isConnected) fill(extra, ...alreadyBooked(entries));
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
function liveAssistant(session = state.session) {
  const text = h("div", { class: "bubble working" }, "");
  const tools = h("ul", { class: "tools", "aria-label": "Tool calls" });
  const extra = h("div", {});
  const status = h("div", { class: "status" }, t("status.thinking"));
  const li = h("li", { class: "msg assistant", dataset: { state: "running" } }, text, tools, extra, status);
  const calls = new Map();
  let streamed = "";
  let stopRequested = false;
  const bubble = {
    li,
    done: false,
    outcome: null,
    handle(name, data) {
      switch (name) {
        case "started":
          li.dataset.turnId = data.turn_id;
          li.dataset.attempt = String(data.attempt);
          // This tab's own stream of a turn it was following (its resend
          // took the turn over): one bubble shows it, this one.
          if (!bubble.follower) unfollow(data.turn_id);
          fill(
            extra,
            stopButton(data.turn_id, status, () => {
              stopRequested = true;
            }),
          );
          // The session now has this message: its entry in the list must
          // not keep saying "no messages yet" while the reply runs.
          loadSessions();
          if (data.takeover) status.textContent = t("status.resumed", { n: data.attempt });
          else if (data.attempt > 1) status.textContent = t("status.retrying", { n: data.attempt });
          break;
        case "delta":
          streamed += data.text;
          text.textContent = streamed;
          // The model is past thinking once its text streams; a status
          // that says something else (stopping, resumed) stays.
          if (status.textContent === t("status.thinking")) status.textContent = t("status.writing");
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
          // A booked entry commits with its tool's success mark: show it
          // now, so the ledger never reads "no entries" beside a booking
          // marked done (a crash before the reply would leave it so).
          if (ok && data.name === "create_transaction") loadLedger();
          break;
        }
        case "awaiting_confirmation": {
          text.classList.remove("working");
          text.textContent = data.text;
          li.dataset.state = "awaiting_confirmation";
          const ttl = state.settings ? state.settings.confirmation_ttl_ms : null;
          fill(extra, confirmCard(data.turn_id, data.pending, true, ttl ? Date.now() + ttl : null));
          status.textContent = t("status.waiting_confirmation");
          bubble.done = true;
          break;
        }
        case "final":
          text.classList.remove("working");
          fill(extra);
          bubble.outcome = data.outcome;
          renderOutcome(bubble, data.outcome, { text, extra, status });
          bubble.done = true;
          break;
        case "error":
          text.classList.remove("working");
          fill(extra);
          bubble.done = true;
          if (data.code === "cancelled") {
            // Stopped (by this tab's Stop, by a newer message of this
            // conversation that interrupts it, or from elsewhere): the
            // turn ended cancelled, and sending the message again replays
            // that; no retry offered.
            li.dataset.state = "cancelled";
            const cause = stopRequested ? "stopped.by_you" : interrupting.has(session) ? "stopped.by_message" : "stopped";
            if (li.dataset.turnId) {
              stoppedBy.set(li.dataset.turnId, cause);
              showAlreadyBooked(li.dataset.turnId, extra);
            }
            text.textContent = t(cause);
            status.textContent = "";
            break;
          }
          li.classList.add("failed");
          li.dataset.state = "error";
          li.dataset.code = data.code;
          text.textContent = data.message;
          status.textContent = data.retryable ? t("status.retryable_error") : "";
          break;
        default:
          break;
      }
      scrollToEnd();
    },
    broken() {
      text.classList.remove("working");
      if (!streamed) text.hidden = true;
      status.textContent = t("status.broken");
    },
    /** The turn's log ended (a follower's): no Stop, no "thinking"; the transcript says how. */
    ended() {
      text.classList.remove("working");
      fill(extra);
      status.textContent = "";
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
    text.textContent = (outcome.error && (outcome.error.message || JSON.stringify(outcome.error))) || t("failed");
    return;
  }
  bubble.li.dataset.state = "final";
  text.textContent = reply.text || "";
  const children = [bookedList(reply.entries)];
  if (outcome.state === "awaiting_confirmation") {
    children.push(confirmCard(outcome.turn_id, reply.pending || [], true, null));
  }
  fill(extra, children);
  status.textContent = outcome.replayed ? t("status.replayed") : "";
}

/** One answer id per pending turn and decision in this tab: a re-sent answer is the same request. */
const answerIds = new Map();

function answerId(turnId, decision) {
  const key = `${turnId}:${decision}`;
  if (!answerIds.has(key)) answerIds.set(key, newId("confirm"));
  return answerIds.get(key);
}

/** The approve / reject card of a pending confirmation; `expiresAtMs` is its deadline on this clock. */
function confirmCard(turnId, pending, live, expiresAtMs) {
  const status = h("p", { class: "status muted" });
  const approve = h("button", { type: "button", class: "approve", dataset: { decision: "approve" } }, t("approve"));
  const reject = h("button", { type: "button", class: "reject", dataset: { decision: "reject" } }, t("reject"));
  const deadline = live && expiresAtMs
    ? h("p", { class: "deadline muted", dataset: { expiresAt: String(expiresAtMs) } }, t("card.expires", {
        time: clock(expiresAtMs),
        left: remainingText(expiresAtMs - Date.now()),
      }))
    : null;
  const card = h(
    "div",
    { class: "confirm-card", role: "group", "aria-label": t("card.title"), dataset: { turnId } },
    h("h3", {}, live ? t("card.title") : t("card.title_done")),
    h(
      "ul",
      {},
      pending.map((e) =>
        h("li", {}, `${category(e.category)} ${money(e.amount_cents, e.type)}${e.note ? ` · ${e.note}` : ""} · ${e.occur_date}`),
      ),
    ),
    deadline,
    live ? h("div", { class: "actions" }, approve, reject) : null,
    status,
  );
  if (!live) card.classList.add("answered");
  if (live && expiresAtMs) {
    // When the deadline passes, the server's word decides how the card reads.
    setTimeout(() => {
      if (card.isConnected) syncNow();
    }, Math.max(0, expiresAtMs - Date.now()) + 500);
  }
  const setButtons = (enabled) => {
    approve.disabled = !enabled;
    reject.disabled = !enabled;
  };
  approve.addEventListener("click", () => answer(card, turnId, "approve", expiresAtMs, { status, setButtons }));
  reject.addEventListener("click", () => answer(card, turnId, "reject", expiresAtMs, { status, setButtons }));
  return card;
}

/** A card no longer waiting: no buttons, no deadline (until the transcript redraws it). */
function settleCard(card) {
  card.classList.add("answered");
  card.querySelector("h3").textContent = t("card.title_done");
  card.querySelector(".deadline")?.remove();
  card.querySelector(".actions")?.remove();
}

function remainingText(ms) {
  const left = Math.max(0, ms);
  return left >= 60_000 ? t("minutes", { n: Math.round(left / 60_000) }) : t("seconds", { n: Math.ceil(left / 1000) });
}

/**
 * Sends an answer to a pending confirmation and shows what the server did
 * with it. A second answer of the same pending turn (another tab's) follows
 * the first: while the first runs the server says request_in_flight, and
 * this page asks again (same id) until it gets the first one's outcome; a
 * replay names the decision that was applied, which may not be ours.
 */
async function answer(card, turnId, decision, expiresAtMs, ui) {
  const { status, setButtons } = ui;
  setButtons(false);
  status.textContent = t("card.sending");
  hideNotice();
  const requestId = answerId(turnId, decision);
  for (let follow = 0; follow < MAX_CONFIRM_FOLLOWS; follow += 1) {
    let assistant = null;
    let replay = null;
    state.activeStreams += 1;
    const result = await postStream(
      "/app/confirmations",
      { user_id: state.user, session_id: state.session, client_request_id: requestId, turn_id: turnId, decision },
      {
        onEvent(name, data) {
          if (!assistant && name === "final" && data.outcome && data.outcome.replayed) {
            replay = data.outcome;
            return;
          }
          if (!assistant) {
            // Our answer runs: show it and its reply.
            assistant = liveAssistant();
            els.messages.append(userBubble(decision === "approve" ? t("approved_label") : t("rejected_label")), assistant.li);
            broadcast();
          }
          assistant.handle(name, data);
        },
      },
    );
    state.activeStreams -= 1;
    if (result.ok) {
      // What happened is known now, and said below.
      state.unsureAnswer = null;
      settleCard(card);
      if (replay && replay.client_request_id !== requestId) {
        // Another answer was applied first; its outcome is replayed to us.
        const applied = replay.decision || decision;
        status.textContent = applied === "approve" ? t("card.approved") : t("card.rejected");
        const same = applied === decision;
        showNotice(t(same ? `notice.confirm_same.${applied}` : `notice.confirm_lost.${applied}`), same ? "warn" : "error", "confirm");
      } else if (replay) {
        // Our own answer, sent before (a lost connection): its stored outcome.
        status.textContent = decision === "approve" ? t("card.approved") : t("card.rejected");
      } else if (result.ended && assistant && assistant.done) {
        status.textContent = decision === "approve" ? t("card.approved") : t("card.rejected");
      } else {
        // The answer's reply broke off (the server went away mid-way): the
        // answer was taken, but whether its booking committed is not known
        // yet; the transcript says so once the turn has ended.
        status.textContent = t("card.answer_sent");
        assistant?.broken();
      }
      afterTurn();
      return;
    }
    const error = result.error || {};
    switch (error.code) {
      case "request_in_flight":
        // Another tab's answer of this pending turn is running (or ours,
        // sent before a lost connection): wait for it, then ask again with
        // the same id to learn which answer was applied.
        status.textContent = t("card.other_tab");
        state.unsureAnswer = { turnId, decision, session: state.session };
        showNotice(t("notice.confirm_in_flight"), "warn", "confirm");
        await sleep(Math.min(Math.max(error.retry_after_ms || 0, SYNC_BUSY_MS), 2000));
        continue;
      case "confirmation_expired": {
        // The server says so itself: the pending confirmation's TTL ran
        // out and nothing was booked.
        settleCard(card);
        status.textContent = t("status.expired");
        showNotice(
          expiresAtMs ? t("notice.confirm_expired", { time: clock(expiresAtMs) }) : t("status.expired"),
          "warn",
          "confirm",
        );
        syncNow();
        return;
      }
      case "not_found": {
        settleCard(card);
        status.textContent = t("card.gone");
        const expired = expiresAtMs && Date.now() >= expiresAtMs;
        showNotice(expired ? t("notice.confirm_expired", { time: clock(expiresAtMs) }) : t("notice.confirm_gone"), "warn", "confirm");
        // Answered by another answer, perhaps: the transcript tells which.
        if (!expired) state.unsureAnswer = { turnId, decision, session: state.session };
        syncNow();
        return;
      }
      case "session_busy":
        setButtons(true);
        status.textContent = "";
        showNotice(t("notice.confirm_busy", { seconds: seconds(error.retry_after_ms) }), "warn", "confirm");
        return;
      case "network":
      case "bad_response":
        setButtons(true);
        status.textContent = "";
        unsureAnswer(turnId, decision);
        return;
      default:
        if (result.status >= 500) {
          setButtons(true);
          status.textContent = "";
          unsureAnswer(turnId, decision);
          return;
        }
        setButtons(true);
        status.textContent = "";
        showNotice(t("notice.confirm_refused", { message: error.message || error.code, status: result.status }), "error", "confirm");
        return;
    }
  }
  setButtons(true);
  status.textContent = "";
}

/**
 * An answer whose fate this tab does not know (the server did not answer):
 * the page asks to press it again, and keeps the question only while it
 * can still be answered (`settleUnsureAnswer`). An answer that found
 * another being answered (`confirm_in_flight`) is followed the same way,
 * should its follow-up break off with the server.
 */
function unsureAnswer(turnId, decision) {
  state.unsureAnswer = { turnId, decision, session: state.session };
  showNotice(t("notice.confirm_network"), "error", "confirm");
}

/**
 * Replaces "press it again" (or "already being answered") once the
 * transcript tells how the pending turn ended: answered (by this tab's answer, or by another's), or no longer
 * pending (expired). A notice that asks for an action never outlives the
 * action.
 */
function settleUnsureAnswer(data) {
  const unsure = state.unsureAnswer;
  if (!unsure || unsure.session !== state.session) return;
  if (els.notice.dataset.key !== "confirm") {
    state.unsureAnswer = null;
    return;
  }
  const answered = data.turns.find((turn) => turn.confirms === unsure.turnId);
  const pending = data.pending && data.pending.turn_id === unsure.turnId;
  if (!answered && pending) return;
  state.unsureAnswer = null;
  if (!answered) {
    showNotice(t("notice.confirm_gone"), "warn", "confirm");
    return;
  }
  // A confirmation turn records "确认"/"取消" or "Approve"/"Reject".
  const applied = ["确认", "Approve"].includes(answered.user_text) ? "approve" : "reject";
  if (answered.client_request_id === answerId(unsure.turnId, unsure.decision)) {
    showNotice(t(`notice.confirm_arrived.${applied}`), "warn", "confirm");
  } else {
    const same = applied === unsure.decision;
    showNotice(t(same ? `notice.confirm_same.${applied}` : `notice.confirm_lost.${applied}`), same ? "warn" : "error", "confirm");
  }
}

/** The assistant's side of a turn from the transcript. */
function recordedAssistant(turn, pending) {
  const reply = turn.reply || {};
  const text = h("div", { class: "bubble" }, reply.text || "");
  const extra = h("div", {});
  const status = h("div", { class: "status" });
  const li = h("li", { class: "msg assistant", dataset: { turnId: turn.turn_id, state: turn.state || "unknown" } }, text, extra, status);
  const retryButton = () =>
    turn.client_request_id && !turn.confirms
      ? h("button", { type: "button", class: "retry", onclick: () => retry(turn) }, t("retry"))
      : null;
  switch (turn.state) {
    case "running":
      text.classList.add("working");
      text.textContent = t("status.working");
      status.textContent = t("status.running");
      fill(extra, stopButton(turn.turn_id, status));
      break;
    case "cancelled":
      text.textContent = t(stoppedBy.get(turn.turn_id) || "stopped");
      fill(extra, ...alreadyBooked(reply.entries));
      break;
    case "awaiting_confirmation": {
      const live = Boolean(pending && pending.turn_id === turn.turn_id);
      const expiresAt = live && pending.expires_in_ms !== undefined ? Date.now() + pending.expires_in_ms : null;
      fill(extra, bookedList(reply.entries), confirmCard(turn.turn_id, reply.pending || [], live, expiresAt));
      if (!live) status.textContent = t("status.expired");
      break;
    }
    case "confirmed":
      fill(extra, bookedList(reply.entries));
      status.textContent = t("status.answered_below");
      break;
    case "failed": {
      li.classList.add("failed");
      const error = turn.error || {};
      text.textContent = error.message || error.code || t("failed");
      if (turn.retryable) {
        fill(extra, retryButton());
        status.textContent = t("status.retry_same");
      }
      break;
    }
    case "abandoned":
      li.classList.add("failed");
      text.textContent = t("abandoned");
      fill(extra, retryButton());
      status.textContent = t("status.retry_same");
      break;
    default:
      fill(extra, bookedList(reply.entries));
  }
  li.dataset.state =
    turn.state === "running" ? "running" : turn.state === "cancelled" ? "cancelled" : ["failed", "abandoned"].includes(turn.state) ? "error" : "final";
  return li;
}

/**
 * The Stop button of a running reply: asks the engine to cancel the turn
 * (its holder stops at once on this node, within a heartbeat on another)
 * and says so; the reply then shows that it was stopped.
 */
function stopButton(turnId, status, onRequested = () => {}) {
  const button = h("button", { type: "button", class: "stop" }, t("stop"));
  button.addEventListener("click", async () => {
    button.disabled = true;
    onRequested();
    status.textContent = t("status.stopping");
    const params = new URLSearchParams({ user_id: state.user, turn_id: turnId });
    const result = await postBytes(`/app/stop?${params}`, new ArrayBuffer(0));
    if (result.ok && result.body.state === "running") stoppedBy.set(turnId, "stopped.by_you");
    if (!result.ok) {
      button.disabled = false;
      const error = (result.body && result.body.error) || {};
      status.textContent =
        result.status === 0 ? t("status.stop_offline") : t("status.stop_refused", { message: error.message || error.code || result.status });
    } else if (result.body.state !== "running") {
      // It had already ended; the transcript shows how.
      loadTranscript();
    }
  });
  return button;
}

/** A retry of a recorded turn: the same request, with the same id. */
function retry(turn) {
  deliver({ id: turn.client_request_id, user: state.user, session: state.session, text: turn.user_text });
}

function renderTranscript(data) {
  const items = [];
  const recorded = new Set();
  const positions = queuePositions(data);
  for (const turn of data.turns) {
    if (turn.client_request_id) recorded.add(turn.client_request_id);
    // A confirmation turn records "确认"/"取消" or "Approve"/"Reject" (by the card's language).
    const approved = ["确认", "Approve"].includes(turn.user_text);
    const said = turn.confirms ? (approved ? t("approved_label") : t("rejected_label")) : turn.user_text;
    const user = userBubble(said, clock(turn.created_at_ms), turn.confirms ? undefined : turn.client_request_id);
    items.push(user);
    // A message that waits, or never ran, has no reply: its state is on its bubble.
    if (turn.state === "queued") showQueued(user, turn.turn_id, positions.get(turn.turn_id) ?? null, turn.user_text);
    else if (unrun(turn)) showUnrun(user, turn.state);
    else items.push(recordedAssistant(turn, data.pending));
  }
  if (data.running && !data.turns.some((turn) => turn.state === "running")) {
    // The session is held by a turn whose message is not recorded yet (or by
    // an API caller): show that something is running, ahead of what waits
    // behind it.
    const firstQueued = items.findIndex((li) => li.dataset.state === "queued");
    const placeholder = recordedAssistant({ turn_id: "", state: "running" }, null);
    if (firstQueued >= 0) items.splice(firstQueued, 0, placeholder);
    else items.push(placeholder);
  }
  // Messages of ours the server accepted but has not recorded yet.
  for (const entry of readOutbox()) {
    if (entry.accepted && entry.user === state.user && entry.session === state.session && !recorded.has(entry.id)) {
      items.push(userBubble(entry.text, t("status.accepted_waiting"), entry.id));
    }
  }
  if (items.length === 0) items.push(h("li", { class: "empty" }, t("empty")));
  fill(els.messages, items);
  scrollToEnd();
  followRunning();
}

/** The running replies this tab follows: turn id → {controller, bubble}. */
const following = new Map();
/** Turns whose event stream was refused (4xx): shown as recorded, not followed again. */
const unfollowable = new Set();

/**
 * Follows every running reply in view that no stream of this tab shows:
 * after a reload, in a second tab, after this tab's own stream broke.
 */
function followRunning() {
  for (const li of els.messages.querySelectorAll("li.msg.assistant[data-state=running]")) {
    const turnId = li.dataset.turnId;
    if (turnId && !following.has(turnId) && !unfollowable.has(turnId)) followTurn(li, turnId);
  }
}

/** Stops following (another conversation or user is shown). */
function stopFollowing() {
  for (const turnId of [...following.keys()]) unfollow(turnId);
}

/** Stops following one turn and takes its bubble away. */
function unfollow(turnId) {
  const follower = following.get(turnId);
  if (!follower) return;
  following.delete(turnId);
  follower.controller.abort();
  follower.bubble.li.remove();
  state.activeStreams -= 1;
}

/**
 * Shows a running reply live from the engine's event log of its turn
 * (`GET /v1/turns/{id}/events`, served by any node): everything from the
 * first event, then live. A broken stream resumes with the last event id
 * seen (Last-Event-ID), so no text is missed or shown twice; a new attempt
 * (the turn taken over after a crash, or restarted) starts its reply over
 * in a fresh bubble. The log ends before the turn's ending is recorded:
 * at its end the transcript, read again, shows how the reply ended.
 */
async function followTurn(placeholder, turnId) {
  const controller = new AbortController();
  const session = state.session;
  const fresh = () => {
    const bubble = liveAssistant(session);
    bubble.follower = true;
    bubble.li.dataset.turnId = turnId;
    return bubble;
  };
  const follower = { controller, bubble: fresh() };
  following.set(turnId, follower);
  state.activeStreams += 1;
  placeholder.replaceWith(follower.bubble.li);
  const path = `/v1/turns/${encodeURIComponent(turnId)}/events?${new URLSearchParams({ user_id: state.user })}`;
  let lastEventId = null;
  let attempt = null;
  let ended = false;
  for (let quiet = 0; !ended && quiet <= MAX_FOLLOW_RECONNECTS; quiet += 1) {
    if (quiet > 0) await sleep(backoffMs(quiet));
    if (controller.signal.aborted) return;
    const result = await getStream(path, {
      lastEventId,
      signal: controller.signal,
      onEvent(name, data, id) {
        if (controller.signal.aborted) return;
        if (name === "end") {
          ended = true;
          follower.bubble.ended();
          return;
        }
        // The server could not read on (the store is out): the stream
        // closes, and is resumed from the last id like a broken one.
        if (name === "error") return;
        if (attempt !== null && data.attempt !== attempt) {
          const next = fresh();
          follower.bubble.li.replaceWith(next.li);
          follower.bubble = next;
        }
        attempt = data.attempt;
        if (id) lastEventId = id;
        quiet = 0;
        follower.bubble.handle(name, data.data);
      },
    });
    if (controller.signal.aborted) return;
    // The turn is not there (or not this user's): the transcript says more.
    if (!result.ok && result.status >= 400 && result.status < 500) {
      unfollowable.add(turnId);
      break;
    }
  }
  following.delete(turnId);
  state.activeStreams -= 1;
  afterTurn();
}

function renderSessions(sessions) {
  const items = sessions.map((s) => ({
    id: s.session_id,
    title: s.title,
    meta: `${t("turns", { n: s.turns })} · ${clock(s.last_message_at_ms)}`,
  }));
  if (!items.some((s) => s.id === state.session)) {
    items.unshift({ id: state.session, title: t("new_conversation"), meta: t("no_messages") });
  }
  fill(
    els.sessionList,
    items.map((s) =>
      h(
        "li",
        {},
        h(
          "button",
          { type: "button", "aria-current": s.id === state.session ? "true" : "false", onclick: () => switchSession(s.id) },
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
    h("div", { class: "total expense" }, h("span", { class: "label" }, t("expense")), h("span", { class: "value" }, money(totals.expense_cents))),
    h("div", { class: "total income" }, h("span", { class: "label" }, t("income")), h("span", { class: "value" }, money(totals.income_cents))),
  );
  const largest = Math.max(1, ...totals.categories.map((c) => c.amount_cents));
  fill(
    els.categories,
    totals.categories.length === 0
      ? h("tr", {}, h("td", { colspan: 3, class: "muted" }, t("nothing_booked")))
      : totals.categories.map((c) =>
          h(
            "tr",
            {},
            h("td", {}, `${category(c.category)}${c.type === "income" ? t("income_suffix") : ""}`, h("div", { class: "bar", "aria-hidden": "true" }, h("span", { style: { width: `${Math.round((100 * c.amount_cents) / largest)}%` } }))),
            h("td", { class: "num" }, c.count),
            h("td", { class: `num ${c.type}` }, money(c.amount_cents)),
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
        h("td", {}, category(e.category)),
        h("td", {}, e.note),
        h("td", { class: `num ${e.type}` }, money(e.amount_cents, e.type)),
      ),
    ),
  );
  const count = ledger.entries.length;
  els.ledgerCount.textContent = t("entry_count", { n: count });
}

// ------------------------------------------------------------ documents

/** Shows a line under the drop zone; kind is "error" or "info". */
function documentsNotice(text, kind = "info") {
  els.documentsNotice.hidden = !text;
  els.documentsNotice.textContent = text || "";
  els.documentsNotice.dataset.kind = kind;
}

function renderDocuments(ingestions) {
  fill(
    els.documents,
    ingestions.length === 0
      ? h("li", { class: "muted" }, t("no_documents"))
      : ingestions.map((i) => {
          const percent = i.chunks > 0 ? Math.min(100, Math.round((100 * i.chunks_stored) / i.chunks)) : 0;
          return h(
            "li",
            { class: `doc ${i.state}`, dataset: { documentId: i.document_id, state: i.state } },
            h("span", { class: "doc-name" }, i.name),
            h("span", { class: `badge ${i.state}` }, t(i.state === "deleted" ? "doc.deleted_state" : `doc.${i.state}`)),
            i.state === "processing"
              ? h("div", { class: "bar progress", role: "progressbar", "aria-valuemin": 0, "aria-valuemax": 100, "aria-valuenow": percent }, h("span", { style: { width: `${percent}%` } }))
              : null,
            h(
              "span",
              { class: "muted doc-meta" },
              i.version_no == null
                ? t("doc.meta", { chunks: i.chunks, version: i.version.slice(0, 8) })
                : t("doc.meta_version", { chunks: i.chunks, no: i.version_no, version: i.version.slice(0, 8) }),
            ),
            i.state === "indexed"
              ? h("button", { type: "button", class: "doc-update", onclick: () => chooseVersion(i.document_id) }, t("doc.new_version"))
              : null,
            i.state === "indexed"
              ? h("button", { type: "button", class: "doc-delete", onclick: () => deleteDocument(i.document_id, i.name) }, t("doc.delete"))
              : null,
            i.state === "failed" && i.error ? h("span", { class: "doc-error" }, i.error.message || i.error.code || "") : null,
          );
        }),
  );
  const indexed = ingestions.filter((i) => i.state === "indexed").length;
  els.documentsCount.textContent = t("documents_count", { n: indexed });
}

let documentsTimer = null;

/**
 * Versions accepted by the server and not listed yet: version → {name,
 * since}. The ingestion is recorded when its background run begins, so the
 * list is read again until it shows them; one not listed within
 * DOCUMENT_APPEAR_MS never began (the server stopped first), and the person
 * is told to drop it again (safe: one ingestion per content).
 */
const awaited = new Map();
/** Whether the last list read showed an ingestion still processing. */
let documentsBusy = false;
/** Whether the notice now shown says the list could not be read. */
let listNoticeShown = false;

/** Reads the user's ingestions; reads again soon while one runs or an accepted one is not listed yet. */
async function loadDocuments() {
  clearTimeout(documentsTimer);
  const user = state.user;
  const result = await getJson(`/app/documents?${new URLSearchParams({ user_id: user })}`);
  if (user !== state.user) return;
  if (!result.ok) {
    if (result.status === 404) {
      els.drop.hidden = true;
      els.docSearch.hidden = true;
      documentsNotice(t("doc.unavailable"));
      return;
    }
    // The server did not answer (or is down): what is shown may be stale.
    // Say so, and look again while something was in progress.
    if (awaited.size > 0 || documentsBusy) {
      listNoticeShown = true;
      documentsNotice(t("doc.list_offline"), "error");
      documentsTimer = setTimeout(loadDocuments, DOCUMENTS_RETRY_MS);
    }
    return;
  }
  if (listNoticeShown) {
    listNoticeShown = false;
    documentsNotice("");
  }
  renderDocuments(result.body.ingestions);
  for (const [version, { name, since }] of awaited) {
    if (result.body.ingestions.some((i) => i.version === version)) {
      awaited.delete(version);
    } else if (Date.now() - since > DOCUMENT_APPEAR_MS) {
      awaited.delete(version);
      documentsNotice(t("doc.not_started", { name }), "error");
    }
  }
  documentsBusy = result.body.ingestions.some((i) => i.state === "processing");
  if (awaited.size > 0 || documentsBusy) {
    documentsTimer = setTimeout(loadDocuments, DOCUMENTS_BUSY_MS);
  }
}

/**
 * Uploads one file; the server checks it at once and ingests it in the
 * background. With documentId the file is that document's next version: the
 * old one stays searchable until the new one is fully indexed.
 */
async function uploadFile(file, documentId = null) {
  if (!file) return;
  documentsNotice(t("doc.uploading", { name: file.name }));
  const params = new URLSearchParams({ user_id: state.user, name: file.name });
  if (documentId) params.set("document_id", documentId);
  const result = await postBytes(`/app/documents?${params}`, await file.arrayBuffer());
  if (result.ok) {
    documentsNotice("");
    awaited.set(result.body.version, { name: file.name, since: Date.now() });
  } else {
    const error = (result.body && result.body.error) || {};
    const message =
      result.status === 0
        ? t("doc.offline")
        : result.status === 413
          ? t("doc.too_large")
          : t("doc.refused", { message: error.message || error.code || result.status });
    documentsNotice(message, "error");
  }
  loadDocuments();
}

/** The document the version chooser's file is for. */
let versionOf = null;

/** Asks for a file and uploads it as a new version of documentId. */
function chooseVersion(documentId) {
  versionOf = documentId;
  els.versionFile.value = "";
  els.versionFile.click();
}

async function deleteDocument(documentId, name) {
  if (!window.confirm(t("doc.confirm_delete", { name }))) return;
  const params = new URLSearchParams({ user_id: state.user, document_id: documentId });
  const result = await postBytes(`/app/documents/delete?${params}`, new ArrayBuffer(0));
  if (result.ok) {
    documentsNotice(t("doc.deleted", { name }));
    fill(els.hits);
  } else {
    const error = (result.body && result.body.error) || {};
    const message =
      result.status === 0
        ? t("doc.offline_delete")
        : result.status === 409
          ? t("doc.busy")
          : t("doc.refused", { message: error.message || error.code || result.status });
    documentsNotice(message, "error");
  }
  loadDocuments();
}

async function searchDocuments(query) {
  const q = query.trim();
  if (!q) return;
  const result = await getJson(`/app/documents/search?${new URLSearchParams({ user_id: state.user, q })}`);
  if (!result.ok) {
    const error = (result.body && result.body.error) || {};
    fill(els.hits, h("li", { class: "doc-error" }, t("doc.refused", { message: error.message || error.code || result.status })));
    return;
  }
  fill(
    els.hits,
    result.body.hits.length === 0
      ? h("li", { class: "muted" }, t("no_hits"))
      : result.body.hits.map((hit) =>
          h("li", {}, h("span", { class: "hit-source" }, `${hit.name} §${hit.chunk_index + 1}`), h("span", { class: "hit-text" }, hit.text)),
        ),
  );
}

function wireDocuments() {
  els.file.addEventListener("change", () => {
    const [file] = els.file.files;
    uploadFile(file);
    els.file.value = "";
  });
  els.versionFile.addEventListener("change", () => {
    const [file] = els.versionFile.files;
    if (file && versionOf) uploadFile(file, versionOf);
    versionOf = null;
    els.versionFile.value = "";
  });
  els.drop.addEventListener("dragover", (event) => {
    event.preventDefault();
    els.drop.classList.add("over");
  });
  els.drop.addEventListener("dragleave", () => els.drop.classList.remove("over"));
  els.drop.addEventListener("drop", (event) => {
    event.preventDefault();
    els.drop.classList.remove("over");
    for (const file of event.dataTransfer.files) uploadFile(file);
  });
  els.docSearch.addEventListener("submit", (event) => {
    event.preventDefault();
    searchDocuments(els.docQuery.value);
  });
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
    const error = (result.body && result.body.error) || {};
    if (result.status === 404 && error.code === "not_found" && params.get("session_id") === state.session) {
      // The link names a conversation this user does not have (another
      // user's): a new one starts, and the page says why.
      switchSession(newSessionId());
      showNotice(t("notice.session_not_found"), "warn", "session-not-found");
      return null;
    }
    // A notice about a message (kept, busy, …) says more than "offline"; keep it.
    const free = els.notice.hidden || ["offline", "load"].includes(els.notice.dataset.key);
    if (!free) return null;
    if (result.status === 0 || result.status >= 500) showNotice(t("notice.offline"), "error", "offline");
    else showNotice(t("notice.load_failed", { message: error.message || error.code, status: result.status }), "error", "load");
    return null;
  }
  hideNotice("offline");
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
  els.settings.textContent = t("settings", {
    model: s.model,
    threshold: money(s.confirmation_threshold_cents),
    ttl: remainingText(s.confirmation_ttl_ms),
    disconnect: s.on_disconnect === "cancel" ? t("settings.cancel") : t("settings.finish"),
    lease: Math.round(s.lease_ttl_ms / 1000),
    cap: s.max_turns_per_user,
  });
}

/** The transcript's shape: re-render only when it changed. */
function signatureOf(data) {
  return JSON.stringify([
    data.turns.map((turn) => [turn.turn_id, turn.state, Boolean(turn.reply)]),
    (data.queue || []).map((entry) => [entry.turn_id, entry.position]),
    data.running,
    data.pending && data.pending.turn_id,
    readOutbox().filter((e) => e.accepted && e.session === state.session).map((e) => e.id),
  ]);
}

/** Drops the outbox entries of this conversation whose turn the transcript shows as ended. */
function settleOutbox(data) {
  for (const entry of readOutbox()) {
    if (entry.user !== state.user || entry.session !== state.session || sending.has(entry.id)) continue;
    const turn = data.turns.find((recorded) => recorded.client_request_id === entry.id);
    if (!turn || !turn.state || turn.state === "running" || turn.state === "queued") continue;
    outboxRemove(entry.id);
    // It reached the server after all (only its answer was lost): it is
    // in the transcript now, no longer waiting in the box.
    if (state.draft && state.draft.id === entry.id) {
      if (els.input.value.trim() === entry.text) els.input.value = "";
      state.draft = null;
      hideNotice("kept");
    }
  }
  // "Asks again" and "already being processed" speak of a message still
  // waiting; once none of this conversation's is, its reply is on the page
  // (a crash's recovery ends a turn without any stream of this tab) and
  // they are no longer true.
  const waiting = readOutbox().some((e) => e.user === state.user && e.session === state.session);
  if (!waiting) {
    hideNotice("kept");
    hideNotice("inflight");
  }
}

/** Reads the conversation from the server and shows it if it changed. */
async function syncOnce({ force = false } = {}) {
  const user = state.user;
  const session = state.session;
  const data = await loadTranscript();
  if (!data || user !== state.user || session !== state.session) return;
  state.running = data.running;
  settleOutbox(data);
  settleUnsureAnswer(data);
  const signature = signatureOf(data);
  if ((force || signature !== state.signature) && state.activeStreams === 0) {
    state.signature = signature;
    renderTranscript(data);
    loadLedger();
    loadSessions();
  } else if (state.activeStreams > 0) {
    updateQueued(data);
  }
  if (!data.running && state.busyText !== null && els.notice.dataset.key === "busy") {
    const stillInBox = els.input.value.trim() === state.busyText;
    showNotice(stillInBox ? t("notice.busy_over") : t("notice.busy_over_empty"), "warn", "busy-over");
    state.busyText = null;
  }
}

function syncNow() {
  wakeRequested = true;
  wakeSync();
}

async function syncLoop() {
  for (;;) {
    try {
      await syncOnce();
    } catch (error) {
      console.error("sync", error);
    }
    const now = Date.now();
    const waiting = readOutbox().some(
      (e) =>
        e.accepted &&
        e.user === state.user &&
        e.session === state.session &&
        !(e.queued && now - (e.queued_at_ms || 0) > QUEUED_FOLLOW_MS),
    );
    const offline = !els.notice.hidden && els.notice.dataset.key === "offline";
    const ms = document.hidden
      ? SYNC_HIDDEN_MS
      : offline
        ? SYNC_OFFLINE_MS
        : state.running || waiting
          ? SYNC_BUSY_MS
          : SYNC_IDLE_MS;
    if (wakeRequested) {
      wakeRequested = false;
      continue;
    }
    await new Promise((resolve) => {
      const timer = setTimeout(resolve, ms);
      wakeSync = () => {
        clearTimeout(timer);
        resolve();
      };
    });
    wakeSync = () => {};
    wakeRequested = false;
  }
}

function afterTurn() {
  broadcast();
  loadLedger();
  loadSessions();
  if (state.activeStreams === 0) syncOnce({ force: true });
}

// ------------------------------------------------------------ sending

function sendFromBox() {
  const text = els.input.value.trim();
  if (!text) {
    // A second Enter after the box was emptied by the first one's acceptance.
    if (sending.size === 0) showNotice(t("notice.type_first"), "error", "type");
    return;
  }
  state.draft = messageFor(text);
  deliver(state.draft);
}

/** Puts `text` back in the box (when the box is empty or holds it); false if the box holds something else. */
function keepInBox(message) {
  const current = els.input.value.trim();
  if (current !== "" && current !== message.text) return false;
  els.input.value = message.text;
  state.draft = { id: message.id, user: message.user, session: message.session, text: message.text };
  return true;
}

/** Takes back the bubble of a message that was not sent (its text is in the box). */
function dropBubble(bubble) {
  if (!bubble || !bubble.fresh) return;
  bubble.li.remove();
  if (els.messages.children.length === 0) els.messages.append(h("li", { class: "empty" }, t("empty")));
}

/** The user bubble of message `id` in view, or a new one. */
function bubbleFor(message) {
  const selector = `#messages li.msg.user[data-request-id="${CSS.escape(message.id)}"]`;
  const existing = els.messages.querySelector(selector);
  if (existing) return { li: existing, fresh: false };
  els.messages.querySelector(".empty")?.remove();
  const li = userBubble(message.text, t("status.sending"), message.id);
  els.messages.append(li);
  scrollToEnd();
  return { li, fresh: true };
}

/**
 * Sends a message with its id and shows what came of it. Used for the
 * box's send, a retry button and the outbox's automatic resends alike.
 */
async function deliver(message, { auto = false } = {}) {
  const visible = () => message.user === state.user && message.session === state.session;
  const previous = outboxGet(message.id);
  // From now until its outcome is known, the message waits in the outbox
  // (not due before this request has had its chance).
  outboxUpdate(message.id, {
    user: message.user,
    session: message.session,
    text: message.text,
    accepted: previous ? previous.accepted : false,
    attempts: previous ? previous.attempts : 0,
    next_at_ms: Date.now() + BACKOFF_MAX_MS,
  });
  if (!auto) hideNotice();
  const bubble = visible() ? bubbleFor(message) : null;
  let assistant = null;
  sending.set(message.id, (sending.get(message.id) || 0) + 1);
  state.activeStreams += 1;
  const policy = busyPolicy(message.user, message.session);
  const running =
    visible() && (state.running || Boolean(els.messages.querySelector("li.msg.assistant[data-state=running]")));
  if (bubble && running && policy === "wait") setStatus(bubble.li, t("status.waiting_turn"));
  if (bubble && running && policy === "interrupt") setStatus(bubble.li, t("status.interrupting"));
  if (bubble && running && queues(policy)) setStatus(bubble.li, t("status.queuing"));
  if (policy === "interrupt") interrupting.set(message.session, (interrupting.get(message.session) || 0) + 1);
  // Queued messages run in the order the server received them: send them in
  // the order they were typed, each once the one before it is answered.
  let answered = () => {};
  if (queues(policy)) {
    const key = `${message.user}\n${message.session}`;
    const before = sendOrder.get(key);
    sendOrder.set(key, new Promise((resolve) => {
      answered = resolve;
    }));
    if (before) await Promise.race([before, sleep(SEND_ORDER_MAX_WAIT_MS)]);
  }
  const result = await postStream(
    "/app/messages",
    {
      user_id: message.user,
      session_id: message.session,
      client_request_id: message.id,
      text: message.text,
      utc_offset_minutes: -new Date().getTimezoneOffset(),
      on_busy: policy,
    },
    {
      onOpen() {
        answered();
        outboxUpdate(message.id, { accepted: true });
        if (state.draft && state.draft.id === message.id) state.draft = null;
        if (visible() && els.input.value.trim() === message.text) els.input.value = "";
        hideNotice("kept");
        hideNotice("inflight");
        assistant = liveAssistant(message.session);
        if (bubble && visible()) {
          setStatus(bubble.li, "");
          bubble.li.after(assistant.li);
        }
        broadcast();
        scrollToEnd();
      },
      onEvent(name, data) {
        assistant.handle(name, data);
        if (assistant.done) {
          outboxRemove(message.id);
          broadcast();
        }
      },
    },
  );
  answered();
  state.activeStreams -= 1;
  if (policy === "interrupt") {
    const n = (interrupting.get(message.session) || 1) - 1;
    if (n > 0) interrupting.set(message.session, n);
    else interrupting.delete(message.session);
  }
  const left = (sending.get(message.id) || 1) - 1;
  if (left > 0) sending.set(message.id, left);
  else sending.delete(message.id);
  if (result.ok && result.body && result.body.queued) {
    queuedAccepted(message, bubble, result.body.turn);
    return;
  }
  if (result.ok) {
    if (result.ended && assistant && assistant.done) {
      afterTurn();
      return;
    }
    // Accepted, then the connection broke: the turn goes on (or waits to be
    // resumed); ask again with the same id until its outcome is known.
    assistant?.broken();
    scheduleResend(message, 0, true);
    syncNow();
    return;
  }
  const error = result.error || {};
  const code = error.code || "";
  if (code === "request_in_flight") {
    attach(message, bubble, error);
    return;
  }
  if (code === "network" || code === "bad_response" || result.status === 0 || result.status >= 500) {
    scheduleResend(message, error.retry_after_ms || 0, false, bubble);
    return;
  }
  refused(message, bubble, result.status, error, auto);
}

/**
 * 202 for our message: it waits in the session's queue (the server has it,
 * recorded). It stays in the outbox, not to be sent again (the server runs
 * it), but so this page follows it until the transcript shows it ended.
 */
function queuedAccepted(message, bubble, turn) {
  const previous = outboxGet(message.id);
  outboxUpdate(message.id, {
    accepted: true,
    queued: true,
    queued_at_ms: (previous && previous.queued_at_ms) || Date.now(),
    turn_id: turn.turn_id,
  });
  if (state.draft && state.draft.id === message.id) state.draft = null;
  if (message.user === state.user && message.session === state.session) {
    if (els.input.value.trim() === message.text) els.input.value = "";
    hideNotice("kept");
    hideNotice("inflight");
    if (bubble && bubble.li.isConnected) showQueued(bubble.li, turn.turn_id, turn.position, message.text);
    // The session has this message now (its list counts it).
    loadSessions();
  }
  broadcast();
  syncNow();
}

/**
 * 409 request_in_flight for our own message: it is already being processed
 * (the first click's request, another tab, or the recovery worker). Not an
 * error: the reply shows when it ends, found by the sync loop.
 */
function attach(message, bubble, error) {
  // Gone from the outbox: its outcome arrived (the first click's stream) meanwhile.
  if (!outboxGet(message.id)) return;
  outboxUpdate(message.id, {
    accepted: true,
    next_at_ms: Date.now() + Math.max(error.retry_after_ms || 0, BACKOFF_FIRST_MS),
  });
  if (state.draft && state.draft.id === message.id) state.draft = null;
  if (message.user === state.user && message.session === state.session) {
    if (els.input.value.trim() === message.text) els.input.value = "";
    if (bubble) {
      const streaming = bubble.li.nextElementSibling?.classList.contains("assistant");
      if (!streaming) setStatus(bubble.li, t("status.attached"));
    }
    if (!sending.has(message.id)) showNotice(t("notice.in_flight"), "warn", "inflight");
  }
  syncNow();
}

/** No answer from the server: keep the message and send it again later, same id. */
function scheduleResend(message, retryAfterMs, accepted, bubble) {
  const entry = outboxGet(message.id) || {};
  const attempts = (entry.attempts || 0) + 1;
  const isAccepted = accepted || Boolean(entry.accepted);
  const visible = message.user === state.user && message.session === state.session;
  if (attempts > MAX_AUTO_SENDS) {
    outboxRemove(message.id);
    if (!visible) return;
    if (isAccepted) {
      showNotice(t("notice.gave_up_accepted", { n: MAX_AUTO_SENDS }), "error", "kept");
    } else if (keepInBox(message)) {
      dropBubble(bubble);
      showNotice(t("notice.gave_up", { n: MAX_AUTO_SENDS }), "error", "kept");
    } else {
      dropBubble(bubble);
      showNotice(t("notice.gave_up_other", { n: MAX_AUTO_SENDS, text: message.text }), "error", "kept");
    }
    return;
  }
  const waitMs = Math.max(retryAfterMs, backoffMs(attempts));
  outboxUpdate(message.id, { attempts, accepted: isAccepted, next_at_ms: Date.now() + waitMs });
  if (!visible) return;
  if (isAccepted) {
    showNotice(t("notice.kept_accepted", { seconds: seconds(waitMs) }), "warn", "kept");
    return;
  }
  dropBubble(bubble);
  if (keepInBox(message)) showNotice(t("notice.kept", { seconds: seconds(waitMs) }), "error", "kept");
  else showNotice(t("notice.kept_other", { text: message.text, seconds: seconds(waitMs) }), "error", "kept");
}

/** The server refused the message: it was not sent. Its text stays in the box. */
function refused(message, bubble, status, error, auto) {
  const code = error.code || "";
  const entry = outboxGet(message.id);
  const visible = message.user === state.user && message.session === state.session;
  if (entry && entry.accepted) {
    // Accepted earlier (its turn failed or was taken over since): the
    // transcript shows how it ended, with a retry of the same id.
    outboxRemove(message.id);
    syncNow();
    return;
  }
  const waits = busyPolicy(message.user, message.session) !== "reject";
  if (auto && code === "session_busy" && waits) {
    // Its conversation waits for a running reply (one a recovery worker
    // may still be resuming after a crash): keep sending it, same id.
    scheduleResend(message, error.retry_after_ms || 0, false, bubble);
    return;
  }
  if (
    auto &&
    (code === "session_busy" || code === "user_at_capacity" || code === "queue_full") &&
    !(visible && keepInBoxPossible(message))
  ) {
    // The box holds something else: keep it queued instead, honouring Retry-After.
    scheduleResend(message, error.retry_after_ms || 0, false, bubble);
    return;
  }
  outboxRemove(message.id);
  dropBubble(bubble);
  if (!visible) return;
  if (!keepInBox(message)) return;
  const secs = seconds(error.retry_after_ms);
  switch (code) {
    case "session_busy":
      state.busyText = message.text;
      if (busyPolicy(message.user, message.session) === "reject") {
        showNotice(t("notice.busy", { seconds: secs }), "warn", "busy");
      } else {
        showNotice(t("notice.busy_waited", { seconds: seconds(BUSY_WAIT_MS) }), "warn", "busy");
      }
      syncNow();
      break;
    case "awaiting_confirmation":
      showNotice(t("notice.awaiting"), "warn", "awaiting");
      syncOnce({ force: true }).then(() =>
        document.querySelector(".confirm-card:not(.answered) button.approve")?.focus(),
      );
      break;
    case "user_at_capacity":
      showNotice(t("notice.capacity", { seconds: secs }), "warn", "capacity");
      break;
    case "queue_full":
      showNotice(t("notice.queue_full", { seconds: secs }), "warn", "queue-full");
      break;
    case "payload_mismatch":
      showNotice(t("notice.mismatch"), "error", "mismatch");
      break;
    default:
      showNotice(t("notice.refused", { message: error.message || code, status }), "error", "refused");
  }
}

function keepInBoxPossible(message) {
  const current = els.input.value.trim();
  return current === "" || current === message.text;
}

/** Sends what waits in the outbox and is due, with its id. */
function pumpOutbox() {
  const now = Date.now();
  for (const entry of readOutbox()) {
    if (entry.user !== state.user) continue;
    // The server has a queued message and runs it: it is followed, never sent again.
    if (entry.queued) continue;
    const mine = entry.owner === TAB_ID;
    if (!mine && now - (entry.touched_at_ms || 0) < OWNER_STALE_MS) continue;
    if (sending.has(entry.id)) {
      outboxUpdate(entry.id, {});
      continue;
    }
    if (now < (entry.next_at_ms || 0)) {
      if (mine) outboxUpdate(entry.id, {});
      continue;
    }
    deliver({ id: entry.id, user: entry.user, session: entry.session, text: entry.text }, { auto: true });
  }
}

// ------------------------------------------------------------ navigation

async function switchSession(sessionId) {
  stopFollowing();
  state.session = sessionId;
  els.busyPolicy.value = busyPolicy(state.user, sessionId);
  state.draft = null;
  state.busyText = null;
  state.signature = "";
  writeHash();
  hideNotice();
  fill(els.messages);
  // A message of this conversation that never reached the server waits in
  // the box again (and is resent with its id).
  const unsent = readOutbox().find((e) => e.user === state.user && e.session === sessionId && !e.accepted);
  if (unsent && els.input.value.trim() === "") keepInBox(unsent);
  await syncOnce({ force: true });
}

async function switchUser(userId) {
  const user = userId.trim();
  // The server's limit: 1 to 128 characters (code points), no control ones.
  if (!user || [...user].length > 128 || /[\u0000-\u001F\u007F-\u009F]/.test(user)) {
    showNotice("A user id is 1 to 128 characters, none of them a control character.", "error", "user");
    return;
  }
  stopFollowing();
  state.user = user;
  localStorage.setItem(USER_STORAGE, user);
  els.userInput.value = user;
  fill(els.hits);
  loadDocuments();
  const sessions = await loadSessions();
  await switchSession(sessions.length ? sessions[0].session_id : newSessionId());
}

function wire() {
  els.composer.addEventListener("submit", (event) => {
    event.preventDefault();
    sendFromBox();
  });
  els.input.addEventListener("keydown", (event) => {
    if (event.key === "Enter" && !event.shiftKey && !event.isComposing) {
      event.preventDefault();
      sendFromBox();
    }
  });
  els.userForm.addEventListener("submit", (event) => {
    event.preventDefault();
    switchUser(els.userInput.value);
  });
  els.busyPolicy.addEventListener("change", () => saveBusyPolicy(els.busyPolicy.value));
  els.newSession.addEventListener("click", () => {
    switchSession(newSessionId());
    els.input.focus();
  });
  window.addEventListener("focus", () => syncNow());
  document.addEventListener("visibilitychange", () => {
    if (!document.hidden) syncNow();
  });
  window.addEventListener("hashchange", () => {
    const hash = readHash();
    if (hash.user && hash.user !== state.user) switchUser(hash.user);
    else if (hash.session && hash.session !== state.session) switchSession(hash.session);
  });
  if (channel) {
    channel.onmessage = (event) => {
      const data = event.data || {};
      if (data.type === "changed" && data.user === state.user && data.session === state.session) syncNow();
    };
  }
}

async function start() {
  translatePage();
  document.title = t("page.title");
  wire();
  wireDocuments();
  const hash = readHash();
  state.user = hash.user || localStorage.getItem(USER_STORAGE) || "demo-user";
  els.userInput.value = state.user;
  await loadSettings();
  loadDocuments();
  if (hash.session) {
    await switchSession(hash.session);
  } else {
    const sessions = await loadSessions();
    await switchSession(sessions.length ? sessions[0].session_id : newSessionId());
  }
  syncLoop();
  setInterval(pumpOutbox, OUTBOX_TICK_MS);
  document.body.dataset.ready = "true";
}

start();
