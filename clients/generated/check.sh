#!/usr/bin/env bash
# Issue 15: the OpenAPI document is good enough to generate from. Against the
# real binary on a scratch SQLite store and a free loopback port:
#   1. openapi-python-client (pinned, venv) generates a Python client from the
#      served /openapi.json with no warning, and that client runs one full
#      turn (full_turn.py: begin → tool claim → tool complete → turn
#      complete → the begin again replays the stored response);
#   2. openapi-typescript (pinned in package-lock.json) generates types, and
#      use.ts, which reads and writes the turn's fields, type-checks against
#      them with tsc --noEmit;
#   3. openapi_diff.py finds no breaking change from the committed snapshot
#      openapi.snapshot.json (its own tests, test_openapi_diff.py, run first).
# `--update-snapshot` rewrites the snapshot from the served document instead
# of comparing (after an intended change); `--setup` only installs the pinned
# generators (the venv, `npm ci`) and exits. Idempotent; fails loudly.
# Knobs: AGENTGATE_BIN (default: the debug build of this tree, whose document
# is the one under test),
# CARGO_TARGET_DIR (the venv lives in $CARGO_TARGET_DIR/clients-gen-venv).
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
repo="$(cd "$here/../.." && pwd)"
cd "$repo"

python_client_version=0.29.1
pytest_version=9.2.0
target_dir="$(realpath -m "${CARGO_TARGET_DIR:-target}")"
venv="$target_dir/clients-gen-venv"
bin=${AGENTGATE_BIN:-$target_dir/debug/agentgate}
update_snapshot=false
setup_only=false
[ "${1:-}" = "--update-snapshot" ] && update_snapshot=true
[ "${1:-}" = "--setup" ] && setup_only=true

fatal() { echo "clients/generated: FATAL: $*" >&2; exit 1; }
say() { echo "clients/generated: $*"; }

command -v node >/dev/null || fatal "node is not installed (Node 20+)"
command -v npm >/dev/null || fatal "npm is not installed"

# The pinned generator in its own venv, reused when already there.
if ! "$venv/bin/openapi-python-client" --version 2>/dev/null | grep -qF "$python_client_version" \
    || ! "$venv/bin/python" -m pytest --version 2>/dev/null | grep -qF "$pytest_version"; then
    say "installing openapi-python-client $python_client_version and pytest $pytest_version into $venv"
    rm -rf "$venv"
    python3 -m venv "$venv" || fatal "cannot create a Python venv (python3-venv)"
    "$venv/bin/python" -m pip install -q --disable-pip-version-check \
        "openapi-python-client==$python_client_version" "pytest==$pytest_version" \
        || fatal "cannot install openapi-python-client from PyPI"
fi
"$venv/bin/openapi-python-client" --version | grep -qF "$python_client_version" \
    || fatal "openapi-python-client $python_client_version is not what $venv runs"

# openapi-typescript and typescript exactly as package-lock.json pins them.
if ! (cd "$here" && npm ls --depth=0 >/dev/null 2>&1); then
    say "npm ci in clients/generated"
    (cd "$here" && npm ci --no-audit --no-fund --loglevel=error) || fatal "npm ci failed"
fi

if [ "$setup_only" = true ]; then
    say "installed (--setup): the generators are ready"
    exit 0
fi

[ -x "$bin" ] || fatal "no agentgate binary at $bin (set AGENTGATE_BIN or cargo build -p agentgate-cli)"

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

# An API key, so the generated client's bearer authentication is exercised.
api_key="gen-check-$RANDOM$RANDOM"
env -u AGENTGATE_API_KEY_FILE -u AGENTGATE_REDIS -u AGENTGATE_USER_HEADER RUST_LOG=warn \
    AGENTGATE_API_KEY="$api_key" \
    "$bin" serve --listen 127.0.0.1:0 --no-app --store "sqlite://$work/gate.db" >"$work/server.log" 2>&1 &
server_pid=$!
addr=""
for _ in $(seq 100); do # at most 10 s for the server to print its address
    addr="$(sed -n 's/^listening on //p' "$work/server.log" | head -1)"
    [ -n "$addr" ] && break
    kill -0 "$server_pid" 2>/dev/null || { cat "$work/server.log" >&2; fatal "the server exited"; }
    sleep 0.1
done
[ -n "$addr" ] || { cat "$work/server.log" >&2; fatal "the server printed no address within 10 s"; }
base="http://$addr"
"$venv/bin/python" - "$base/openapi.json" "$work/openapi.json" <<'PY' || fatal "cannot fetch /openapi.json"
import json, sys, urllib.request
with urllib.request.urlopen(sys.argv[1], timeout=10) as response:
    document = json.load(response)
with open(sys.argv[2], "w", encoding="utf-8") as out:
    json.dump(document, out, indent=2, ensure_ascii=False)
    out.write("\n")
PY
say "served document fetched from $base"

if [ "$update_snapshot" = true ]; then
    # Keys sorted, so the snapshot's diffs show only what changed.
    "$venv/bin/python" -c 'import json, sys; json.dump(json.load(open(sys.argv[1], encoding="utf-8")), open(sys.argv[2], "w", encoding="utf-8"), indent=2, sort_keys=True, ensure_ascii=False); open(sys.argv[2], "a").write("\n")' \
        "$work/openapi.json" "$here/openapi.snapshot.json"
    say "snapshot updated: clients/generated/openapi.snapshot.json"
    exit 0
fi

# 1. The Python client, and one full turn through it.
"$venv/bin/openapi-python-client" generate --path "$work/openapi.json" \
    --config "$here/openapi-python-client.yaml" --meta none \
    --output-path "$work/python/agentgate_generated" >"$work/python-gen.log" 2>&1 \
    || { cat "$work/python-gen.log" >&2; fatal "openapi-python-client failed on the served document"; }
if grep -qi "warning\|unable to\|could not" "$work/python-gen.log"; then
    cat "$work/python-gen.log" >&2
    fatal "openapi-python-client warned about the served document (above): parts of the client are missing"
fi
say "python client generated (openapi-python-client $python_client_version, no warnings)"
PYTHONPATH="$work/python" "$venv/bin/python" "$here/full_turn.py" "$base" "$api_key" \
    || { tail -20 "$work/server.log" >&2; fatal "the generated Python client could not run a full turn"; }

# 2. The TypeScript types, and use.ts type-checked against them.
mkdir -p "$work/ts"
"$here/node_modules/.bin/openapi-typescript" "$work/openapi.json" -o "$work/ts/openapi.ts" \
    >"$work/ts-gen.log" 2>&1 || { cat "$work/ts-gen.log" >&2; fatal "openapi-typescript failed on the served document"; }
cp "$here/use.ts" "$work/ts/use.ts"
"$here/node_modules/.bin/tsc" --noEmit --strict --target es2022 --module nodenext --moduleResolution nodenext \
    "$work/ts/openapi.ts" "$work/ts/use.ts" \
    || fatal "use.ts does not type-check against the types generated from the served document"
# use.ts is not vacuous: against types from the document with one field it
# reads removed (GrantDto.lease_token), it must fail to type-check.
mkdir -p "$work/ts-doctored"
"$venv/bin/python" - "$work/openapi.json" "$work/ts-doctored/openapi.json" <<'PY'
import json, sys
document = json.load(open(sys.argv[1], encoding="utf-8"))
grant = document["components"]["schemas"]["GrantDto"]
del grant["properties"]["lease_token"]
grant["required"].remove("lease_token")
json.dump(document, open(sys.argv[2], "w", encoding="utf-8"))
PY
"$here/node_modules/.bin/openapi-typescript" "$work/ts-doctored/openapi.json" -o "$work/ts-doctored/openapi.ts" \
    >/dev/null 2>&1 || fatal "openapi-typescript failed on the doctored document"
cp "$here/use.ts" "$work/ts-doctored/use.ts"
if "$here/node_modules/.bin/tsc" --noEmit --strict --target es2022 --module nodenext --moduleResolution nodenext \
    "$work/ts-doctored/openapi.ts" "$work/ts-doctored/use.ts" >"$work/ts-doctored/tsc.log" 2>&1; then
    fatal "use.ts type-checks even without GrantDto.lease_token: it no longer guards the fields it names"
fi
grep -q "lease_token" "$work/ts-doctored/tsc.log" \
    || { cat "$work/ts-doctored/tsc.log" >&2; fatal "use.ts failed on the doctored types, but not on lease_token"; }
say "typescript types generated ($("$here/node_modules/.bin/openapi-typescript" --version 2>/dev/null | tr -d '\n' || true)) and use.ts type-checks (and fails without GrantDto.lease_token)"

# 3. No breaking change from the committed snapshot (the checker's own tests first).
(cd "$here" && "$venv/bin/python" -m pytest -q -p no:cacheprovider test_openapi_diff.py) \
    || fatal "the breaking-change checker's own tests failed"
"$venv/bin/python" "$here/openapi_diff.py" "$here/openapi.snapshot.json" "$work/openapi.json" \
    || fatal "the served document breaks clients generated from clients/generated/openapi.snapshot.json (above)"
say "ok"
