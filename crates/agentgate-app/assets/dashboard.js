// The live dashboard: polls /app/dashboard about once a second (never two
// requests at once) and redraws. Everything but the counters is the store's
// truth on the store's clock, across every node on the store; the counters
// are this server process's ("this node"). The recent lists are paged. Each
// session's queue (messages sent with "queues behind the reply") is listed
// head first beside its holder.

import { h, getJson, clock, fill } from "/assets/common.js";
import { t, translatePage } from "/assets/i18n.js";

/** Pause between the end of one refresh and the start of the next. */
const REFRESH_INTERVAL_MS = 1000;
/** Rows per page of the recent lists. */
const PAGE_ROWS = 10;

/** The page shown of each recent list, 0 first. */
const pages = { turns: 0, executions: 0, ingestions: 0 };
/** The last data drawn, to redraw on a page change without waiting. */
let last = null;

const els = {
  status: document.getElementById("status"),
  limits: document.getElementById("limits"),
  counters: document.getElementById("counters"),
  live: document.querySelector("#live tbody"),
  liveCount: document.getElementById("live-count"),
  permits: document.querySelector("#permits tbody"),
  queues: document.querySelector("#queues tbody"),
  queuesCount: document.getElementById("queues-count"),
  turns: document.querySelector("#turns tbody"),
  executions: document.querySelector("#executions tbody"),
  turnsPager: document.getElementById("turns-pager"),
  executionsPager: document.getElementById("executions-pager"),
  ingestionsPane: document.getElementById("ingestions-pane"),
  ingestions: document.querySelector("#ingestions tbody"),
  ingestionsPager: document.getElementById("ingestions-pager"),
};

function short(id) {
  return id.length > 18 ? `${id.slice(0, 16)}…` : id;
}

function sum(map) {
  return Object.values(map || {}).reduce((a, b) => a + b, 0);
}

/** A code or policy word the server counts by (`session_busy`, `wait`), in the page's language. */
function word(key) {
  return named("dash.word", key);
}

/** A count per code, in the page's language: "session busy 2 · wait started 1". */
function detail(map) {
  return Object.entries(map || {})
    .map(([k, v]) => `${k.split(" ").map(word).join(" ")} ${v}`)
    .join(" · ");
}

function counter(label, value, more, key) {
  return h(
    "div",
    { class: "counter", dataset: { counter: key } },
    h("span", { class: "label" }, label),
    h("span", { class: "value" }, value),
    h("span", { class: "detail" }, more || ""),
  );
}

/** A progress bar filled to `percent` (clamped to 0–100). */
function bar(percent) {
  const width = Math.max(0, Math.min(100, percent));
  return h("div", { class: "bar", "aria-hidden": "true" }, h("span", { style: { width: `${width}%` } }));
}

function emptyRow(columns, text, id) {
  return h("tr", { id }, h("td", { colspan: columns, class: "muted" }, text));
}

/** `key` under `prefix` in the page's language; untranslated, the key with spaces. */
function named(prefix, key) {
  const name = t(`${prefix}.${key}`);
  return name === `${prefix}.${key}` ? key.replaceAll("_", " ") : name;
}

/** A turn's or execution's state in the page's language. */
function stateName(state) {
  return named("dash.state", state);
}

function stateChip(state) {
  return h("span", { class: `state ${state}` }, stateName(state));
}

/** A turn's state as a person should read it: a running turn nobody holds is an orphan. */
function turnChip(turn) {
  if (turn.state === "running" && turn.orphaned) {
    return h("span", { class: "state orphaned", title: t("dash.orphaned.title") }, t("dash.orphaned"));
  }
  if (turn.state === "running" && turn.cancel_requested) {
    return h("span", { class: "state cancel-requested", title: t("dash.cancel_requested.title") }, t("dash.stop_requested"));
  }
  return stateChip(turn.state);
}

/** The rows of page `key` of `rows`, and the pager's buttons. */
function paged(key, rows, pager) {
  const pageCount = Math.max(1, Math.ceil(rows.length / PAGE_ROWS));
  pages[key] = Math.min(pages[key], pageCount - 1);
  const first = pages[key] * PAGE_ROWS;
  const shown = rows.slice(first, first + PAGE_ROWS);
  const go = (delta) => () => {
    pages[key] = Math.max(0, Math.min(pageCount - 1, pages[key] + delta));
    if (last) render(last);
  };
  fill(
    pager,
    h("span", { class: "muted" }, rows.length === 0 ? "" : t("dash.page", { first: first + 1, last: first + shown.length, total: rows.length })),
    h("button", { type: "button", class: "prev", disabled: pages[key] === 0, onclick: go(-1), "aria-label": t("dash.newer.label") }, t("dash.newer")),
    h("button", { type: "button", class: "next", disabled: pages[key] >= pageCount - 1, onclick: go(1), "aria-label": t("dash.older.label") }, t("dash.older")),
  );
  return shown;
}

/** Begins that found the session busy and waited or interrupted, by what came of them ("interrupt started": 1); refusals of the default policy are the conflicts. */
function busyDetail(busy) {
  const shown = {};
  for (const [key, n] of Object.entries(busy || {})) {
    const [outcome, policy] = key.split(" ");
    // A begin that found the session free is no second message.
    if (policy === "reject" || outcome === "started") continue;
    shown[`${policy} ${outcome === "started_after_wait" ? "started" : outcome}`] = n;
  }
  return shown;
}

function render(data) {
  last = data;
  const c = data.counters;
  // One count of live turns, from the store: every node's. The list is cut
  // at rows_limit, so a full list means "at least".
  const liveCount = data.live.length >= data.rows_limit ? `${data.live.length}+` : String(data.live.length);
  const orphans = data.recent_turns.filter((t) => t.state === "running" && t.orphaned).length;
  fill(
    els.counters,
    counter(t("dash.c.live"), liveCount, t("dash.c.live.detail", { n: c.live_turns }), "live"),
    counter(t("dash.c.orphaned"), orphans, t("dash.c.orphaned.detail"), "orphaned"),
    counter(t("dash.c.conflicts"), sum(c.conflicts), detail(c.conflicts), "conflicts"),
    counter(t("dash.c.replays"), c.replays, t("dash.c.replays.detail"), "replays"),
    counter(t("dash.c.takeovers"), c.takeovers, t("dash.c.takeovers.detail"), "takeovers"),
    counter(t("dash.c.unknown"), c.unknown_tool_outcomes, t("dash.c.unknown.detail"), "unknown"),
    counter(t("dash.c.lease_lost"), c.lease_lost, t("dash.c.lease_lost.detail"), "lease_lost"),
    counter(
      t("dash.c.endings"),
      sum(c.turn_endings),
      detail(Object.fromEntries(Object.entries(c.turn_endings || {}).map(([state, n]) => [stateName(state), n]))),
      "endings",
    ),
    counter(t("dash.c.busy"), sum(busyDetail(c.busy_begins)), detail(busyDetail(c.busy_begins)) || t("dash.c.busy.none"), "busy"),
    counter(t("dash.c.waiting"), c.waiting_begins, t("dash.c.waiting.detail"), "waiting"),
    counter(t("dash.c.stops"), c.cancel_requests, t("dash.c.stops.detail", { n: c.force_releases }), "stops"),
  );
  els.liveCount.textContent = t("dash.held", { n: liveCount });
  fill(
    els.live,
    data.live.length === 0
      ? emptyRow(5, t("dash.empty.live"), "live-empty")
      : data.live.map((l) =>
          h(
            "tr",
            { dataset: { session: l.session_id } },
            h("td", {}, l.user_id),
            h("td", { class: "mono" }, l.session_id),
            h("td", { class: "mono", title: l.turn_id }, short(l.turn_id)),
            h("td", { class: "num" }, l.fence),
            h(
              "td",
              { class: "lease" },
              `${(l.lease_expires_in_ms / 1000).toFixed(1)} s`,
              bar((100 * l.lease_expires_in_ms) / data.lease_ttl_ms),
              l.cancel_requested
                ? h("span", { class: "badge failed", title: t("dash.stop_requested.title") }, t("dash.stop_requested"))
                : null,
            ),
          ),
        ),
  );
  const queues = data.queues || [];
  const waiting = queues.reduce((n, q) => n + q.queue.length, 0);
  els.queuesCount.textContent = t("dash.queued_in", { n: waiting, sessions: queues.length });
  fill(
    els.queues,
    queues.length === 0
      ? emptyRow(5, t("dash.empty.queues"), "queues-empty")
      : queues.map((q) =>
          h(
            "tr",
            { dataset: { session: q.session_id, length: q.queue.length } },
            h("td", {}, q.user_id),
            h("td", { class: "mono" }, q.session_id),
            h(
              "td",
              { class: "mono", title: q.holder_turn_id || "" },
              q.holder_turn_id
                ? short(q.holder_turn_id)
                : h("span", { class: "muted", title: t("dash.no_holder.title") }, t("dash.no_holder")),
              q.cancel_requested ? h("span", { class: "badge failed" }, ` ${t("dash.stop_requested")}`) : null,
            ),
            h("td", { class: "num" }, q.queue.length),
            h(
              "td",
              {},
              h(
                "ol",
                { class: "queue-list" },
                q.queue.map((entry) =>
                  h(
                    "li",
                    { class: "mono", title: t("dash.queued_at", { turn: entry.turn_id, time: clock(entry.enqueued_at_ms) }), dataset: { turnId: entry.turn_id, position: entry.position } },
                    `${short(entry.client_request_id)} · ${short(entry.turn_id)}`,
                  ),
                ),
              ),
            ),
          ),
        ),
  );
  // Users holding turns now; the others are one line, so the list never
  // fills the page.
  const holding = data.permits.filter((p) => p.live_turns > 0);
  const idle = data.permits.length - holding.length;
  fill(
    els.permits,
    data.permits.length === 0
      ? emptyRow(3, t("dash.empty.permits"))
      : holding.map((p) =>
          h(
            "tr",
            { dataset: { user: p.user_id } },
            h("td", {}, p.user_id),
            h("td", { class: "num" }, p.live_turns),
            h(
              "td",
              { class: "lease" },
              t("dash.of_cap", { cap: p.max_turns_per_user }),
              bar((100 * p.live_turns) / Math.max(1, p.max_turns_per_user)),
            ),
          ),
        ),
    idle > 0 ? emptyRow(3, t("dash.idle_users", { n: idle }), "permits-idle") : null,
  );
  fill(
    els.turns,
    data.recent_turns.length === 0
      ? emptyRow(7, t("dash.empty.turns"))
      : paged("turns", data.recent_turns, els.turnsPager).map((t) =>
          h(
            "tr",
            { dataset: { turnId: t.turn_id, state: t.state === "running" && t.orphaned ? "orphaned" : t.state } },
            h("td", { class: "mono", title: t.turn_id }, short(t.turn_id)),
            h("td", {}, t.user_id, h("br"), h("span", { class: "mono muted" }, t.session_id)),
            h("td", { class: "mono", title: t.client_request_id }, short(t.client_request_id)),
            h("td", {}, turnChip(t), t.decision ? ` ${t.decision}` : ""),
            h("td", { class: "num" }, t.attempt),
            h("td", { class: "num" }, t.fence),
            h("td", {}, clock(t.updated_at_ms)),
          ),
        ),
  );
  fill(
    els.executions,
    data.recent_executions.length === 0
      ? emptyRow(6, t("dash.empty.executions"))
      : paged("executions", data.recent_executions, els.executionsPager).map((e) =>
          h(
            "tr",
            {},
            h("td", { class: "mono", title: e.execution_id }, short(e.execution_id)),
            h("td", { class: "mono", title: e.turn_id }, short(e.turn_id)),
            h("td", {}, e.tool),
            h("td", {}, stateChip(e.state)),
            h("td", { class: "num" }, e.attempt),
            h("td", { class: "num" }, e.fence),
          ),
        ),
  );
  // Ingestions (seed 003) are turns of their document's session; shown when
  // the server ingests documents, with the engine's state and the progress.
  els.ingestionsPane.hidden = !data.ingestions;
  if (data.ingestions) {
    fill(
      els.ingestions,
      data.ingestions.length === 0
        ? emptyRow(6, t("dash.empty.ingestions"))
        : paged("ingestions", data.ingestions, els.ingestionsPager).map((i) =>
            h(
              "tr",
              { dataset: { turnId: i.turn_id, state: i.state } },
              h("td", {}, i.name, h("br"), h("span", { class: "mono muted", title: i.document_id }, short(i.document_id))),
              h("td", {}, i.tenant),
              h("td", { class: "mono", title: i.turn_id }, short(i.turn_id)),
              h("td", {}, stateChip(i.state)),
              h(
                "td",
                { class: "lease" },
                t("dash.chunks_of", { stored: i.chunks_stored, chunks: i.chunks }),
                bar(i.chunks > 0 ? (100 * i.chunks_stored) / i.chunks : 0),
              ),
              h("td", { class: "num" }, i.version_no == null ? "–" : `v${i.version_no}`),
            ),
          ),
    );
  }
  els.limits.textContent = t("dash.limits", { ttl: Math.round(data.lease_ttl_ms / 1000), cap: data.max_turns_per_user });
}

async function tick() {
  const result = await getJson("/app/dashboard");
  if (result.ok) {
    render(result.body);
    els.status.textContent = t("dash.status.live", { time: clock(Date.now()) });
    els.status.dataset.kind = "ok";
    document.body.dataset.ready = "true";
  } else {
    const error = result.body && result.body.error;
    els.status.textContent = t("dash.status.error", { message: (error && error.message) || `HTTP ${result.status}` });
    els.status.dataset.kind = "error";
  }
  setTimeout(tick, REFRESH_INTERVAL_MS);
}

document.title = t("dash.title");
translatePage();
tick();
