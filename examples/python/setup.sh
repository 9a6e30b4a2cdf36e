#!/usr/bin/env bash
# Create (or refresh) the venv the Python framework examples run in:
# ${CARGO_TARGET_DIR:-target}/examples-python-venv with the pinned
# requirements.txt (LangGraph, the OpenAI Agents SDK, pytest) and the
# agentgate client from clients/python, editable. Idempotent: when the
# requirements have not changed since the last run, pip is not asked again
# for them. Fails loudly. Knob: AGENTGATE_PYTHON_CLIENT (the client's
# directory; default clients/python).
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
repo="$(cd "$here/../.." && pwd)"
cd "$repo"
target_dir="$(realpath -m "${CARGO_TARGET_DIR:-target}")"
venv="$target_dir/examples-python-venv"
client="${AGENTGATE_PYTHON_CLIENT:-$repo/clients/python}"

fatal() { echo "examples/python/setup.sh: FATAL: $*" >&2; exit 1; }

[ -f "$client/pyproject.toml" ] || fatal "no agentgate Python client at $client (set AGENTGATE_PYTHON_CLIENT)"
python3 -c 'import sys; sys.exit(0 if sys.version_info >= (3, 10) else 1)' \
    || fatal "the examples need Python 3.10+ ($(python3 --version 2>&1))"
if [ ! -x "$venv/bin/python" ]; then
    echo "examples/python: creating $venv"
    mkdir -p "$target_dir"
    python3 -m venv "$venv" || fatal "cannot create a Python venv (python3-venv)"
fi
stamp="$venv/.requirements.sha256"
wanted="$(sha256sum "$here/requirements.txt" | cut -d' ' -f1)"
if [ "$(cat "$stamp" 2>/dev/null)" != "$wanted" ]; then
    echo "examples/python: installing requirements.txt into $venv"
    "$venv/bin/python" -m pip install --quiet --disable-pip-version-check -r "$here/requirements.txt" \
        || fatal "cannot install examples/python/requirements.txt from PyPI"
    echo "$wanted" >"$stamp"
fi
installed="$("$venv/bin/python" -c 'import agentgate, os; print(os.path.realpath(agentgate.__file__))' 2>/dev/null || true)"
if [ "$installed" != "$(realpath -m "$client/src/agentgate/__init__.py")" ]; then
    "$venv/bin/python" -m pip install --quiet --disable-pip-version-check --no-deps -e "$client" \
        || fatal "cannot install the agentgate client from $client"
fi
"$venv/bin/python" -c 'import agentgate, langgraph, agents, pytest; print("examples/python: venv ready: agentgate", agentgate.__version__, "from", agentgate.__file__)'
