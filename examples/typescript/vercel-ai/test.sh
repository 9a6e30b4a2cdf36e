#!/usr/bin/env bash
# Runs the Vercel AI SDK example's test (node:test) against the real server
# binary: AGENTGATE_BIN (default: the checkout's target/debug/agentgate).
# Installs first when node_modules is missing or from another lockfile
# (npm ci; it also builds the repo's client, linked from
# ../../../clients/typescript, through that package's prepare script).
# Exits nonzero on any failure; bounded by SUITE_TIMEOUT_S and per test.
set -euo pipefail
cd "$(dirname "$0")"

export AGENTGATE_BIN="${AGENTGATE_BIN:-${CARGO_TARGET_DIR:-$(cd ../../.. && pwd)/target}/debug/agentgate}"
if [ "${1:-}" != --setup ] && [ ! -x "$AGENTGATE_BIN" ]; then
  echo "test.sh: no agentgate binary at $AGENTGATE_BIN (set AGENTGATE_BIN)" >&2
  exit 1
fi
command -v node >/dev/null || { echo "test.sh: node is not installed (need Node 20+)" >&2; exit 1; }

lock_sum=$(sha256sum package-lock.json | cut -d' ' -f1)
if [ "$(cat node_modules/.installed-from-lock 2>/dev/null || true)" != "$lock_sum" ]; then
  timeout --kill-after=10 "${INSTALL_TIMEOUT_S:-300}" npm ci --no-audit --no-fund
  echo "$lock_sum" > node_modules/.installed-from-lock
fi
# `test.sh --setup` (.ci/run): install only, while the registry is reachable.
[ "${1:-}" = --setup ] && exit 0
# The client's dist/ is built by its prepare script during npm ci; an
# install made with --ignore-scripts (or a clean of the client) leaves none.
if [ ! -f ../../../clients/typescript/dist/index.js ]; then
  ../../../clients/typescript/setup.sh
fi

# The test takes ~3 s here; these bounds only stop a hang.
SUITE_TIMEOUT_S=${SUITE_TIMEOUT_S:-120}
TEST_TIMEOUT_MS=60000
exec timeout --kill-after=10 "$SUITE_TIMEOUT_S" \
  node --test --test-concurrency=1 --test-timeout="$TEST_TIMEOUT_MS" --test-reporter=spec test/*.test.mjs
