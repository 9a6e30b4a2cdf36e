#!/usr/bin/env bash
# The client suites' interrupt, queue, handoff and drain, recovery, crash and
# event-following tests again, on PostgreSQL: every server a test starts gets
# a database of its own (agentgate_client_<hex>, created and dropped by the
# suites' fixtures through psql). Run by crates/agentgate-cli/tests/clients.rs.
#
#   clients/postgres-subsets.sh python|typescript
#
# AGENTGATE_CLIENT_TEST_PG: the PostgreSQL server, without a database
# (default postgres://postgres@127.0.0.1:5432). AGENTGATE_BIN: the server.
# Each subset is bounded by `timeout`; fails loudly.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
export AGENTGATE_CLIENT_TEST_PG="${AGENTGATE_CLIENT_TEST_PG:-postgres://postgres@127.0.0.1:5432}"
#: Each subset's bound (they take about 35 s and 25 s).
SUBSET_TIMEOUT_S=240

case "${1:-}" in
python)
    exec "$here/python/test.sh" tests/test_busy.py tests/test_drain.py tests/test_events.py \
        tests/test_crash.py tests/test_sync.py -k "interrupt or queue or drain or recovery or follow or killed"
    ;;
typescript)
    cd "$here/typescript"
    [ -d dist ] || ./setup.sh
    exec timeout --kill-after=10 "$SUBSET_TIMEOUT_S" node --test --test-concurrency=1 \
        --test-timeout=60000 --test-reporter=spec \
        test/busy.test.mjs test/crash.test.mjs test/drain.test.mjs test/events.test.mjs
    ;;
*)
    echo "usage: $0 python|typescript" >&2
    exit 2
    ;;
esac
