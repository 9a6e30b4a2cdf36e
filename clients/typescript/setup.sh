#!/usr/bin/env bash
# Installs the pinned dev dependencies (npm ci, from package-lock.json) and
# compiles src/ to dist/ with tsc (which `npm install` in this folder, or of
# this folder, and `npm pack` also do, through the prepare script). Idempotent; fails loudly.
set -euo pipefail
cd "$(dirname "$0")"

command -v node >/dev/null || { echo "setup.sh: node is not installed (need Node 20+)" >&2; exit 1; }
major=$(node -p 'process.versions.node.split(".")[0]')
if [ "$major" -lt 20 ]; then echo "setup.sh: Node $(node --version) is too old (need 20+)" >&2; exit 1; fi

# npm ci installs the lockfile's exact tree (deleting node_modules first);
# skip it when node_modules was installed from this very lockfile.
lock_sum=$(sha256sum package-lock.json | cut -d' ' -f1)
if [ "$(cat node_modules/.installed-from-lock 2>/dev/null || true)" != "$lock_sum" ]; then
  npm ci --no-audit --no-fund   # its prepare script (scripts/prepare.mjs) compiles dist/
  echo "$lock_sum" > node_modules/.installed-from-lock
else
  npm run --silent build
fi
echo "setup.sh: agentgate-client built in $(pwd)/dist"
