#!/usr/bin/env bash
# The clients as a user installs them: build each one's distributions, install
# them into a fresh environment, and run the client's own suite against that
# installed copy, with the source tree off the import path.
#
#   check-packages.sh setup       Registry access (pip). A venv with the pinned
#                                 build tooling (python/requirements-build.txt)
#                                 and a venv made afresh with only the Python
#                                 suite's pinned test deps. .ci/run runs this.
#   check-packages.sh python      sdist + wheel of agentgate-client
#                                 (`python -m build`: the wheel is built from
#                                 the sdist), the wheel installed into the
#                                 fresh venv, then clients/python/test.sh in
#                                 it; tests/test_installed.py asserts that
#                                 `agentgate` is the venv's site-packages copy.
#   check-packages.sh typescript  `npm pack` of a copy of the package without
#                                 dist/ (so its prepare script has to build
#                                 it), the tarball npm-installed into a fresh
#                                 project under target/, then the suite run
#                                 with ../dist resolving to that install;
#                                 test/installed.test.mjs asserts it.
#
# No registry access after setup (the TypeScript tarball has no runtime
# dependencies; its tests' dev tools are package-lock.json's, already in
# clients/typescript/node_modules from setup.sh). The server is AGENTGATE_BIN
# (default: the checkout's target/debug/agentgate). Builds never write into
# the source tree: each one works on a copy under target/.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
repo="$(cd "$here/.." && pwd)"
target="$(realpath -m "${CARGO_TARGET_DIR:-$repo/target}")"
out="$target/clients-packages"
export AGENTGATE_BIN="${AGENTGATE_BIN:-$target/debug/agentgate}"
[ "${1:-}" = setup ] || [ -x "$AGENTGATE_BIN" ] || { echo "check-packages: FATAL: no server binary at $AGENTGATE_BIN (set AGENTGATE_BIN)" >&2; exit 1; }

py_build_venv="$target/clients-python-build-venv"
py_venv="$target/clients-python-installed-venv"

say() { echo "check-packages: $*"; }
fatal() { echo "check-packages: FATAL: $*" >&2; exit 1; }
elapsed() { echo "$((SECONDS - $1)) s"; }

python311() {
    for candidate in python3.11 python3; do
        if command -v "$candidate" >/dev/null 2>&1 \
            && "$candidate" -c 'import sys; sys.exit(0 if sys.version_info[:2] == (3, 11) else 1)' 2>/dev/null; then
            echo "$candidate"
            return 0
        fi
    done
    fatal "no Python 3.11 on PATH"
}

# Copies directory $1 to $2 (made afresh), leaving out build and tool
# leftovers and node_modules/dist.
copy_tree() {
    rm -rf "$2"
    mkdir -p "$2"
    tar -C "$1" -cf - \
        --exclude=./node_modules --exclude=./dist --exclude=./build --exclude='./*.tgz' \
        --exclude='*.egg-info' --exclude=__pycache__ --exclude=.mypy_cache --exclude=.pytest_cache \
        . | tar -C "$2" -xf -
}

setup() {
    local start=$SECONDS python
    python="$(python311)"
    local pip=(-m pip install --quiet --disable-pip-version-check)
    if [ ! -x "$py_build_venv/bin/python" ]; then
        "$python" -m venv "$py_build_venv"
    fi
    "$py_build_venv/bin/python" "${pip[@]}" -r "$here/python/requirements-build.txt"
    # Made afresh each time: nothing of an earlier install survives.
    "$python" -m venv --clear "$py_venv"
    "$py_venv/bin/python" "${pip[@]}" -r "$here/python/requirements-test.txt"
    say "setup done in $(elapsed "$start"): $py_build_venv, $py_venv (no agentgate in it yet)"
}

check_python() {
    local start=$SECONDS
    [ -x "$py_build_venv/bin/python" ] && [ -x "$py_venv/bin/python" ] \
        || fatal "no $py_build_venv or $py_venv: run $0 setup"
    local stage="$target/clients-python-stage" dist="$out/python"
    copy_tree "$here/python" "$stage"
    rm -rf "$dist"
    mkdir -p "$out"
    # sdist first, then the wheel built from the unpacked sdist: a file
    # missing from the sdist is missing from the wheel the tests import.
    "$py_build_venv/bin/python" -m build --no-isolation --outdir "$dist" "$stage" >"$dist.log" 2>&1 \
        || { cat "$dist.log" >&2; fatal "python -m build failed"; }
    local wheels=("$dist"/agentgate_client-*-py3-none-any.whl) sdists=("$dist"/agentgate_client-*.tar.gz)
    [ ${#wheels[@]} -eq 1 ] && [ -f "${wheels[0]}" ] && [ ${#sdists[@]} -eq 1 ] && [ -f "${sdists[0]}" ] \
        || fatal "expected one agentgate_client wheel and sdist in $dist, found: $(ls "$dist")"
    say "built $(basename "${sdists[0]}") and $(basename "${wheels[0]}") in $(elapsed "$start")"
    # The venv holds the pinned test deps (setup); the wheel replaces any
    # earlier one. --no-deps --no-index: nothing comes from a registry here,
    # and `pip check` then proves the wheel's declared requirements are met.
    "$py_venv/bin/python" -m pip install --quiet --disable-pip-version-check \
        --no-index --no-deps --force-reinstall "${wheels[0]}"
    "$py_venv/bin/python" -m pip check --disable-pip-version-check >/dev/null \
        || { "$py_venv/bin/python" -m pip check; fatal "the installed wheel's requirements are not met"; }
    say "installed into $py_venv in $(elapsed "$start"); running the suite against it"
    env -u PYTHONPATH AGENTGATE_PY_VENV="$py_venv" AGENTGATE_PY_EXPECT_INSTALLED=1 \
        bash "$here/python/test.sh" "$@"
    say "python: the installed wheel passed; $(elapsed "$start") in all"
}

check_typescript() {
    local start=$SECONDS
    command -v node >/dev/null || fatal "node is not on PATH"
    local modules="$here/typescript/node_modules"
    [ -x "$modules/typescript/bin/tsc" ] || fatal "no $modules: run clients/typescript/setup.sh"
    local stage="$target/clients-typescript-stage" dist="$out/typescript"
    local project="$target/clients-typescript-installed"
    # The package as a fresh clone has it (no dist/), with the pinned dev
    # tools linked in (hard links: a later `npm ci` in the source tree cannot
    # pull them away mid-run).
    copy_tree "$here/typescript" "$stage"
    cp -al "$modules" "$stage/node_modules" 2>/dev/null || cp -a "$modules" "$stage/node_modules"
    rm -rf "$dist"
    mkdir -p "$dist"
    (cd "$stage" && npm pack --silent --pack-destination "$dist" >"$dist.log" 2>&1) \
        || { cat "$dist.log" >&2; fatal "npm pack failed"; }
    local tarballs=("$dist"/agentgate-client-*.tgz)
    [ ${#tarballs[@]} -eq 1 ] && [ -f "${tarballs[0]}" ] || fatal "expected one agentgate-client tarball in $dist"
    local listing
    listing="$(tar -tzf "${tarballs[0]}")"
    for file in package/package.json package/dist/index.js package/dist/index.d.ts; do
        grep -qx "$file" <<<"$listing" || fatal "$(basename "${tarballs[0]}") has no $file"
    done
    if grep -q '^package/\(test\|scripts\|node_modules\)/' <<<"$listing"; then
        fatal "$(basename "${tarballs[0]}") ships test/, scripts/ or node_modules/"
    fi
    say "packed $(basename "${tarballs[0]}") ($(grep -c . <<<"$listing") files) in $(elapsed "$start")"

    # A fresh npm project that installs the tarball, as a user's would.
    rm -rf "$project"
    mkdir -p "$project"
    printf '{ "name": "agentgate-client-installed-check", "private": true, "type": "module" }\n' >"$project/package.json"
    (cd "$project" && npm install --no-audit --no-fund --silent "${tarballs[0]}") \
        || fatal "npm install of the tarball failed"
    local installed="$project/node_modules/agentgate-client"
    [ -f "$installed/dist/index.js" ] && [ ! -L "$installed" ] || fatal "no installed copy at $installed"

    # The suite, laid out as in the repository (its relative paths hold:
    # ../README.md, ../scripts, ../../../examples), with dist/ the installed
    # package's and no source dist/ anywhere in reach.
    local tree="$project/repo"
    copy_tree "$here/typescript" "$tree/clients/typescript"
    copy_tree "$repo/examples/typescript" "$tree/examples/typescript"
    ln -s "$installed/dist" "$tree/clients/typescript/dist"
    cp -al "$modules" "$tree/clients/typescript/node_modules" 2>/dev/null \
        || cp -a "$modules" "$tree/clients/typescript/node_modules"
    say "installed into $project in $(elapsed "$start"); running the suite against it"
    AGENTGATE_TS_EXPECT_INSTALLED="$installed" AGENTGATE_TS_NO_BUILD=1 \
        bash "$tree/clients/typescript/test.sh" "$@"
    say "typescript: the installed tarball passed; $(elapsed "$start") in all"
}

case "${1:-}" in
    setup) setup ;;
    python) shift; check_python "$@" ;;
    typescript) shift; check_typescript "$@" ;;
    *) echo "usage: $0 setup|python|typescript" >&2; exit 2 ;;
esac
