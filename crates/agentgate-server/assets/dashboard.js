// The live dashboard: polls /app/dashboard about once a second (never two
// requests at once) and redraws. Everything but the counters is the store's
// truth on the store's clock; the counters are this server process's.

import { h, getJson, clock, fill } from "/assets/common.js";

/** Pause between the end of one refresh and the start of the next. */
const REFRESH_INTERVAL_MS = 1000;

const els = {
  status: document.getElementById("status"),
  limits: document.getElementById("limits"),
  counters: document.getElementById("counters"),
  live: document.querySelector("#live tbody"),
  liveCount: document.getElementById("live-count"),
  permits: document.querySelector("#permits tbody"),
  turns: document.querySelector("#turns tbody"),
  executions: document.querySelector("#executions tbody"),
};

function short(id) {
  return id.length > 18 ? `${id.slice(0, 16)}…` : id;
}

function sum(map) {
  return Object.values(map || {}).reduce((a, b) => a + b, 0);
}

function detail(map) {
  return Object.entries(map || {})
    .map(([k, v]) => `${k} ${v}`)
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

function emptyRow(columns, text, id) {
  return h("tr", { id }, h("td", { colspan: columns, class: "muted" }, text));
}

function stateChip(state) {
  return h("span", { class: `state ${state}` }, state.replace("_", " "));
}

function render(data) {
  const c = data.counters;
  fill(
    els.counters,
    counter("Live turns", data.live.length, `this server: ${c.live_turns}`, "live"),
    counter("Conflicts", sum(c.conflicts), detail(c.conflicts), "conflicts"),
    counter("Replays", c.replays, "stored answers sent again", "replays"),
    counter("Takeovers", c.takeovers, "expired holders replaced", "takeovers"),
    counter("Unknown tool outcomes", c.unknown_tool_outcomes, "re-run after a holder died", "unknown"),
    counter("Lease lost", c.lease_lost, "calls refused to a stale holder", "lease_lost"),
    counter("Turns ended", sum(c.turn_endings), detail(c.turn_endings), "endings"),
  );
  els.liveCount.textContent = `${data.live.length} held`;
  fill(
    els.live,
    data.live.length === 0
      ? emptyRow(5, "No session is held right now.", "live-empty")
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
              h(
                "div",
                { class: "bar", "aria-hidden": "true" },
                h("span", { style: { width: `${Math.max(0, Math.min(100, (100 * l.lease_expires_in_ms) / data.lease_ttl_ms))}%` } }),
              ),
            ),
          ),
        ),
  );
  fill(
    els.permits,
    data.permits.length === 0
      ? emptyRow(3, "No user has run a turn recently.")
      : data.permits.map((p) =>
          h(
            "tr",
            { dataset: { user: p.user_id } },
            h("td", {}, p.user_id),
            h("td", { class: "num" }, p.live_turns),
            h(
              "td",
              { class: "lease" },
              `of ${p.max_turns_per_user}`,
              h("div", { class: "bar", "aria-hidden": "true" }, h("span", { style: { width: `${(100 * p.live_turns) / Math.max(1, p.max_turns_per_user)}%` } })),
            ),
          ),
        ),
  );
  fill(
    els.turns,
    data.recent_turns.length === 0
      ? emptyRow(7, "No turns yet.")
      : data.recent_turns.map((t) =>
          h(
            "tr",
            {},
            h("td", { class: "mono", title: t.turn_id }, short(t.turn_id)),
            h("td", {}, t.user_id, h("br"), h("span", { class: "mono muted" }, t.session_id)),
            h("td", { class: "mono", title: t.client_request_id }, short(t.client_request_id)),
            h("td", {}, stateChip(t.state), t.decision ? ` ${t.decision}` : ""),
            h("td", { class: "num" }, t.attempt),
            h("td", { class: "num" }, t.fence),
            h("td", {}, clock(t.updated_at_ms)),
          ),
        ),
  );
  fill(
    els.executions,
    data.recent_executions.length === 0
      ? emptyRow(6, "No tool executions yet.")
      : data.recent_executions.map((e) =>
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
  els.limits.textContent = `· lease TTL ${Math.round(data.lease_ttl_ms / 1000)} s · default cap ${data.max_turns_per_user} turns per user`;
}

async function tick() {
  const result = await getJson("/app/dashboard");
  if (result.ok) {
    render(result.body);
    els.status.textContent = `Live · updated ${clock(Date.now())}`;
    els.status.dataset.kind = "ok";
    document.body.dataset.ready = "true";
  } else {
    const error = result.body && result.body.error;
    els.status.textContent = `Cannot refresh: ${(error && error.message) || `HTTP ${result.status}`}`;
    els.status.dataset.kind = "error";
  }
  setTimeout(tick, REFRESH_INTERVAL_MS);
}

tick();
