#!/usr/bin/env bash
# Run the Python client's tests against the real server binary
# (AGENTGATE_BIN; else the checkout's
# target/debug/agentgate, which `cargo build` or `cargo test` makes), in the
# venv AGENTGATE_PY_VENV (default target/clients-python-venv). Creates that
# venv first if it is missing (setup.sh). Every test has a timeout (pytest-timeout, 60 s)
# and the whole run one more; exits nonzero on any failure.
#
# On PostgreSQL: AGENTGATE_CLIENT_TEST_PG=<server URL without a database>
# gives each server a test starts a fresh database (created through psql and
# dropped when the test ends; see tests/conftest.py). The PostgreSQL subset
# (interrupt, queue/enqueue, drain/handoff, recovery worker + SIGKILL, events
# follower; 26 tests, ~35 s), from the checkout's root:
#   AGENTGATE_CLIENT_TEST_PG=postgres://postgres@127.0.0.1:5432 bash clients/python/test.sh \
#     tests/test_busy.py tests/test_drain.py tests/test_events.py tests/test_crash.py tests/test_sync.py \
#     -k "interrupt or queue or drain or recovery or follow or killed"
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
repo="$(cd "$here/../.." && pwd)"
venv="${AGENTGATE_PY_VENV:-$repo/target/clients-python-venv}"
#: The whole suite's bound (it takes about 25 s).
SUITE_TIMEOUT_S="${AGENTGATE_PY_SUITE_TIMEOUT_S:-300}"

AGENTGATE_BIN="${AGENTGATE_BIN:-${CARGO_TARGET_DIR:-$repo/target}/debug/agentgate}"
export AGENTGATE_BIN
if [ ! -x "$AGENTGATE_BIN" ]; then
    echo "clients/python/test.sh: FATAL: no server binary at $AGENTGATE_BIN (set AGENTGATE_BIN)" >&2
    exit 1
fi
if [ ! -x "$venv/bin/python" ]; then
    if [ "${AGENTGATE_PY_EXPECT_INSTALLED:-}" = 1 ]; then
        echo "clients/python/test.sh: FATAL: no venv at $venv (clients/check-packages.sh setup makes it)" >&2
        exit 1
    fi
    "$here/setup.sh"
fi
echo "clients/python: testing against $AGENTGATE_BIN"
cd "$here"
# -P: the working directory stays off sys.path, so `agentgate` is whatever
# the venv has (the editable source tree from setup.sh, or the wheel that
# clients/check-packages.sh installed, AGENTGATE_PY_EXPECT_INSTALLED=1).
exec timeout --kill-after=10 "$SUITE_TIMEOUT_S" "$venv/bin/python" -P -m pytest -p no:cacheprovider -q "$@"
