#!/usr/bin/env bash
# Runs the TypeScript client's node:test suites against the real server
# binary: AGENTGATE_BIN (default: the checkout's target/debug/agentgate). Builds first (setup.sh).
# Exits nonzero on any failure; bounded by SUITE_TIMEOUT_S and per test.
#
# On PostgreSQL: AGENTGATE_CLIENT_TEST_PG=<server URL without a database>
# gives each server started a fresh database (created through psql, dropped
# by its stop(); see scripts/server.mjs). The PostgreSQL subset (interrupt,
# enqueue, drain/handoff, recovery worker + SIGKILL, events follower; 4 files,
# 32 tests, ~22 s), from the checkout's root (after this script or ./setup.sh
# has built dist/):
#   cd clients/typescript && AGENTGATE_CLIENT_TEST_PG=postgres://postgres@127.0.0.1:5432 \
#     timeout --kill-after=10 240 node --test --test-concurrency=1 --test-timeout=60000 \
#     --test-reporter=spec test/busy.test.mjs test/crash.test.mjs test/drain.test.mjs test/events.test.mjs
set -euo pipefail
cd "$(dirname "$0")"

export AGENTGATE_BIN="${AGENTGATE_BIN:-${CARGO_TARGET_DIR:-$(cd ../.. && pwd)/target}/debug/agentgate}"
if [ ! -x "$AGENTGATE_BIN" ]; then
  echo "test.sh: no agentgate binary at $AGENTGATE_BIN (set AGENTGATE_BIN)" >&2
  exit 1
fi

# AGENTGATE_TS_NO_BUILD=1: ../dist is already what is under test
# (clients/check-packages.sh links it to the installed tarball).
if [ "${AGENTGATE_TS_NO_BUILD:-}" != 1 ]; then
  ./setup.sh
fi

# The whole suite takes ~15 s here; these bounds only stop a hang.
SUITE_TIMEOUT_S=${SUITE_TIMEOUT_S:-240}
TEST_TIMEOUT_MS=60000
# One file at a time: each starts its own servers and worker processes, and
# the crash tests' timings want the 2 cores to themselves.
exec timeout --kill-after=10 "$SUITE_TIMEOUT_S" \
  node --test --test-concurrency=1 --test-timeout="$TEST_TIMEOUT_MS" --test-reporter=spec test/*.test.mjs
