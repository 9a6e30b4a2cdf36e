#!/usr/bin/env bash
# Schema fuzzing: schemathesis (pinned, from PyPI, in a venv) against the
# debug binary on a free loopback port with a scratch SQLite store. It reads
# the OpenAPI document the server serves and sends generated requests, valid
# and invalid by it, to every operation; any of these fails the run:
#   not_a_server_error           no 5xx, ever
#   status_code_conformance      every status sent is documented
#   content_type_conformance     every content type sent is documented
#   response_schema_conformance  every body matches its documented schema
#   positive_data_acceptance     a request valid by the document is not
#                                refused (only 404/409/422 where the records'
#                                state explains it: .ci/schemathesis.toml)
# Runs locally as `.ci/schemathesis.sh` after `cargo build -p agentgate-cli`.
# Knobs: SCHEMATHESIS_MAX_EXAMPLES (per operation and phase), SCHEMATHESIS_SEED,
# AGENTGATE_BIN, SCHEMATHESIS_VENV.
set -euo pipefail
cd "$(dirname "$0")/.."
repo="$(pwd)"

version=4.32.5
max_examples=${SCHEMATHESIS_MAX_EXAMPLES:-100}
seed=${SCHEMATHESIS_SEED:-20261201}
target_dir="$(realpath -m "${CARGO_TARGET_DIR:-target}")"
bin=${AGENTGATE_BIN:-$target_dir/debug/agentgate}
venv=${SCHEMATHESIS_VENV:-$target_dir/schemathesis-venv}

fatal() { echo "schemathesis: FATAL: $*" >&2; exit 1; }

apt_updated=false
apt_install() {
    if [ "$apt_updated" = false ]; then
        apt-get update -qq
        apt_updated=true
    fi
    apt-get install -y -qq "$@" >/dev/null
}

# The pinned schemathesis in its own venv, reused when already there.
if ! "$venv/bin/schemathesis" --version 2>/dev/null | grep -qF "version $version"; then
    echo "schemathesis: installing schemathesis $version into $venv"
    rm -rf "$venv"
    if ! command -v python3 >/dev/null 2>&1 || ! python3 -m venv "$venv" >/dev/null 2>&1; then
        echo "schemathesis: installing python3-venv"
        rm -rf "$venv"
        apt_install python3 python3-venv || true
        python3 -m venv "$venv" || fatal "cannot create a Python venv (python3-venv)"
    fi
    "$venv/bin/python" -m pip install -q --disable-pip-version-check "schemathesis==$version" \
        || fatal "cannot install schemathesis $version from PyPI"
fi
"$venv/bin/schemathesis" --version | grep -qF "version $version" \
    || fatal "schemathesis $version is not what $venv runs"

[ -x "$bin" ] || cargo build -p agentgate-cli
[ -x "$bin" ] || fatal "no agentgate binary at $bin"

work="$(mktemp -d)"
server_pid=""
cleanup() {
    if [ -n "$server_pid" ]; then
        kill "$server_pid" 2>/dev/null || true
        wait "$server_pid" 2>/dev/null || true
    fi
    rm -rf "$work"
}
trap cleanup EXIT

port="$("$venv/bin/python" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')"
base="http://127.0.0.1:$port"
# Only the v1 API, no key, the largest per-user cap (429 is not a state a
# fuzzer's random ids should reach), a scratch store.
env -u AGENTGATE_API_KEY -u AGENTGATE_API_KEY_FILE -u AGENTGATE_REDIS -u AGENTGATE_USER_HEADER \
    RUST_LOG=warn "$bin" serve --listen "127.0.0.1:$port" --store "sqlite://$work/gate.db" \
    --no-app --max-turns-per-user 10000 >"$work/server.log" 2>&1 &
server_pid=$!
for _ in $(seq 100); do
    if "$venv/bin/python" -c "import urllib.request; urllib.request.urlopen('$base/healthz', timeout=1)" 2>/dev/null; then
        break
    fi
    kill -0 "$server_pid" 2>/dev/null || { cat "$work/server.log" >&2; fatal "the server exited"; }
    sleep 0.1
done
"$venv/bin/python" -c "import urllib.request; urllib.request.urlopen('$base/healthz', timeout=1)" \
    || { cat "$work/server.log" >&2; fatal "the server did not answer /healthz"; }

started=$(date +%s)
status=0
# From the scratch directory, where schemathesis keeps its cache.
(cd "$work" && "$venv/bin/schemathesis" --config-file "$repo/.ci/schemathesis.toml" --no-color run "$base/openapi.json" \
    --checks not_a_server_error,status_code_conformance,content_type_conformance,response_schema_conformance,positive_data_acceptance \
    --max-examples "$max_examples" --seed "$seed" \
    --workers 1 --request-timeout 20 \
    --report ndjson --report-ndjson-path "$work/events.ndjson" \
    >"$work/output.txt" 2>&1) || status=$?
elapsed=$(($(date +%s) - started))
cat "$work/output.txt"

# The measured number of requests sent, from the run's own event log.
cases="$("$venv/bin/python" - "$work/events.ndjson" <<'PY'
import json, sys
cases = 0
with open(sys.argv[1]) as events:
    for line in events:
        event = json.loads(line)
        for name, body in event.items():
            if name == "ScenarioFinished":
                cases += len(body.get("recorder", {}).get("cases", {}))
print(cases)
PY
)"
echo "schemathesis: $cases test cases in ${elapsed}s (seed $seed, at most $max_examples examples per operation and phase), exit $status"
if [ "$status" -ne 0 ]; then
    echo "schemathesis: server log:" >&2
    tail -50 "$work/server.log" >&2
    fatal "the API does not do what its OpenAPI document says (see above)"
fi
[ "$cases" -gt 0 ] || fatal "no test case ran"
