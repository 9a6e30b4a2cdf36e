#!/usr/bin/env bash
# Create (or update) the venv the Python client's tests run in: Python 3.11
# from this machine, the client installed editable, the pinned test deps.
# Idempotent; fails loudly if anything cannot be installed.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
repo="$(cd "$here/../.." && pwd)"
venv="${AGENTGATE_PY_VENV:-$repo/target/clients-python-venv}"

python=""
for candidate in python3.11 python3; do
    if command -v "$candidate" >/dev/null 2>&1 \
        && "$candidate" -c 'import sys; sys.exit(0 if sys.version_info[:2] == (3, 11) else 1)' 2>/dev/null; then
        python="$candidate"
        break
    fi
done
if [ -z "$python" ]; then
    echo "clients/python/setup.sh: FATAL: no Python 3.11 on PATH" >&2
    exit 1
fi

if [ ! -x "$venv/bin/python" ]; then
    echo "clients/python: creating venv $venv"
    mkdir -p "$(dirname "$venv")"
    "$python" -m venv "$venv"
fi
# The pip flags keep the output short; a failure still prints pip's error
# and, through set -e, fails this script.
"$venv/bin/python" -m pip install --quiet --disable-pip-version-check -r "$here/requirements-test.txt"
# The distribution was called `agentgate` before it became `agentgate-client`
# (that name is another project's on PyPI); a venv made then still has the
# old editable install, which would claim the `agentgate` import too, and
# src/ the old name's metadata (src/agentgate.egg-info, which pip would still
# list as a distribution `agentgate` while src/ is on sys.path).
rm -rf "$here/src/agentgate.egg-info"
if "$venv/bin/python" -m pip show --quiet agentgate >/dev/null 2>&1; then
    "$venv/bin/python" -m pip uninstall --quiet --disable-pip-version-check -y agentgate
fi
"$venv/bin/python" -m pip install --quiet --disable-pip-version-check -e "$here"
"$venv/bin/python" -c 'import agentgate, httpx, pytest; print("clients/python: venv ready,", "agentgate", agentgate.__version__, "httpx", httpx.__version__, "pytest", pytest.__version__)'
