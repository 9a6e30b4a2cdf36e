#!/usr/bin/env bash
# Run the Python framework examples' tests (test_examples.py) against the real
# binary: AGENTGATE_BIN, default ${CARGO_TARGET_DIR:-target}/debug/agentgate. Runs setup.sh first.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
repo="$(cd "$here/../.." && pwd)"
cd "$repo"
target_dir="$(realpath -m "${CARGO_TARGET_DIR:-target}")"
"$here/setup.sh"
AGENTGATE_BIN="${AGENTGATE_BIN:-$target_dir/debug/agentgate}"
[ -x "$AGENTGATE_BIN" ] || { echo "examples/python/test.sh: FATAL: no agentgate binary at $AGENTGATE_BIN" >&2; exit 1; }
export AGENTGATE_BIN
exec "$target_dir/examples-python-venv/bin/python" -m pytest -q -p no:cacheprovider "$here/test_examples.py" "$@"
