// A TCP proxy on the client's side of the real server, for the event
// tests. It can cut event streams: the next `cuts` responses to a `GET
// .../events` forward a random number of bytes (mid-event, mid-line,
// anywhere) and then the client's connection is closed. And it can lose
// the answer to the next event append: the request reaches the server and
// takes effect, the answer is thrown away and the connection closed.
// Requests are recognised by the chunk that starts them (the client sends
// one request at a time per connection).

import net from "node:net";

/** A request line at the start of a chunk. */
const REQUEST_LINE = /^(GET|POST|PUT) (\S+) HTTP\/1\.1\r\n/;

/**
 * @param {string} upstreamUrl the server's base URL
 * @param {{ cuts?: number, maxBytes?: number, random?: () => number }} options
 */
export async function startProxy(upstreamUrl, { cuts = 0, maxBytes = 3000, random = Math.random } = {}) {
  const { hostname, port } = new URL(upstreamUrl);
  const state = { cutsLeft: cuts, cutAfter: [], loseNextAppend: false, lostAnswers: 0 };
  const sockets = new Set();
  const server = net.createServer((client) => {
    const upstream = net.connect(Number(port), hostname);
    sockets.add(client);
    sockets.add(upstream);
    let budget = null; // bytes of the current answer still to forward before the cut
    let lose = false;
    const close = () => { client.destroy(); upstream.destroy(); };
    client.on("data", (chunk) => {
      const line = REQUEST_LINE.exec(chunk.subarray(0, 512).toString("latin1"));
      if (line !== null) {
        const [, method, path] = line;
        budget = null;
        if (method === "GET" && path.includes("/events") && state.cutsLeft > 0) {
          state.cutsLeft -= 1;
          budget = 1 + Math.floor(random() * maxBytes);
        }
        if (method === "POST" && path.endsWith("/events") && state.loseNextAppend) {
          state.loseNextAppend = false;
          lose = true;
        }
      }
      upstream.write(chunk);
    });
    upstream.on("data", (chunk) => {
      if (lose) {
        state.lostAnswers += 1;
        close();
        return;
      }
      if (budget !== null && chunk.length >= budget) {
        state.cutAfter.push(budget);
        client.write(chunk.subarray(0, budget), close);
        budget = null;
        return;
      }
      if (budget !== null) budget -= chunk.length;
      client.write(chunk);
    });
    for (const socket of [client, upstream]) {
      socket.on("error", () => undefined);
      socket.on("close", () => { sockets.delete(socket); close(); });
    }
  });
  await new Promise((resolve) => server.listen(0, "127.0.0.1", resolve));
  return {
    url: `http://127.0.0.1:${server.address().port}`,
    state,
    get cuts() { return state.cutAfter.length; },
    async close() {
      for (const socket of sockets) socket.destroy();
      await new Promise((resolve) => server.close(resolve));
    },
  };
}

/** A small seeded generator (mulberry32), so a failing run can be repeated. */
export function seeded(seed) {
  let a = seed >>> 0;
  return () => {
    a = (a + 0x6d2b79f5) >>> 0;
    let t = a;
    t = Math.imul(t ^ (t >>> 15), t | 1);
    t ^= t + Math.imul(t ^ (t >>> 7), t | 61);
    return ((t ^ (t >>> 14)) >>> 0) / 4294967296;
  };
}

/** One sample of GET /metrics (0 when the series is absent). */
export async function metric(serverUrl, name, labels = {}) {
  const text = await (await fetch(`${serverUrl}/metrics`)).text();
  const want = Object.entries(labels).map(([k, v]) => `${k}="${v}"`).sort().join(",");
  for (const line of text.split("\n")) {
    const match = /^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)$/.exec(line);
    if (match === null || match[1] !== name) continue;
    const got = match[2] === undefined ? "" : match[2].slice(1, -1).split(",").sort().join(",");
    if (got === want) return Number(match[3]);
  }
  return 0;
}
