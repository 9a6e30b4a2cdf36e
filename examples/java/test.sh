#!/usr/bin/env bash
# The Java example (AgentgateTurn.java) against the real server: a message
# sent twice at once books once and both get the same answer; a worker killed
# right after booking is taken over and its booking found, not repeated; a
# repeat after success replays. Binary: AGENTGATE_BIN, default
# ${CARGO_TARGET_DIR:-target}/debug/agentgate. Needs `java` (17+) on PATH.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
repo="$(cd "$here/../.." && pwd)"
cd "$repo"
target_dir="$(realpath -m "${CARGO_TARGET_DIR:-target}")"
AGENTGATE_BIN="${AGENTGATE_BIN:-$target_dir/debug/agentgate}"

# Bounds on every wait.
LEASE_TTL_MS=2000          # short, so the crashed worker's lease dies quickly
STARTUP_POLLS=100          # × 0.1 s for the server's "listening on" line
RUN_TIMEOUT_S=90           # one run of the example (the source launcher compiles first)
THINK_MS=5000              # the slow turns' "LLM" time: 2.5 leases
POLLS=300                  # × 0.1 s for a background run to begin or to end

fail() { echo "examples/java/test.sh: FAIL: $*" >&2; exit 1; }
[ -x "$AGENTGATE_BIN" ] || fail "no agentgate binary at $AGENTGATE_BIN"
command -v java >/dev/null || fail "java is not on PATH"

work="$(mktemp -d)"
server_pid=""
paused_pid=""
cleanup() {
    local pid
    for pid in $paused_pid $server_pid; do
        { kill -9 "$pid" && wait "$pid"; } 2>/dev/null || true
    done
    rm -rf "$work"
}
trap cleanup EXIT

"$AGENTGATE_BIN" serve --listen 127.0.0.1:0 --no-app --store "sqlite://$work/agentgate.db" \
    --lease-ttl-ms "$LEASE_TTL_MS" >"$work/server.out" 2>"$work/server.err" &
server_pid=$!
addr=""
for _ in $(seq "$STARTUP_POLLS"); do
    addr="$(sed -n 's/^listening on //p' "$work/server.out" | head -n1)"
    [ -n "$addr" ] && break
    kill -0 "$server_pid" 2>/dev/null || fail "the server exited: $(cat "$work/server.err")"
    sleep 0.1
done
[ -n "$addr" ] || fail "the server did not print 'listening on' within $STARTUP_POLLS polls"
url="http://$addr"
ledger="$work/ledger.txt"

# run NAME ARGS...: runs the example, its last stdout line to $work/NAME.json,
# its exit status to $work/NAME.rc.
run() {
    local name="$1"; shift
    local rc=0
    timeout "$RUN_TIMEOUT_S" java "$here/AgentgateTurn.java" --url "$url" --ledger "$ledger" "$@" \
        >"$work/$name.out" 2>"$work/$name.err" || rc=$?
    echo "$rc" >"$work/$name.rc"
    tail -n1 "$work/$name.out" >"$work/$name.json"
}
expect_ok() {
    [ "$(cat "$work/$1.rc")" = 0 ] || fail "$1 exited $(cat "$work/$1.rc"): $(cat "$work/$1.out" "$work/$1.err")"
}
field() { grep -o "\"$2\":[a-z\"_]*" "$work/$1.json" | head -n1 | cut -d: -f2 | tr -d '"'; }
response() { local line; line="$(cat "$work/$1.json")"; echo "${line#*\"response\":}"; }
key_of() { response "$1" | grep -o 'agk_[0-9a-f]*' | head -n1; }
# wait_begun NAME: until the run NAME has begun its turn (it says so on stderr).
wait_begun() {
    for _ in $(seq "$POLLS"); do
        grep -q '^begun ' "$work/$1.err" 2>/dev/null && return 0
        sleep 0.1
    done
    fail "the run $1 did not begin its turn within $POLLS polls: $(cat "$work/$1.err" 2>/dev/null)"
}
lines_with() { grep -c "^$1	" "$ledger" || true; }

started=$SECONDS

# 0. The example's own JSON codec: escapes, surrogate pairs, numbers beyond a
# long, nesting; malformed documents refused (the last one holds a literal tab).
codec_in="$(cat <<'JSON'
{"s":"\u00e9\ud83d\ude95\"\\\/\b\f\n\r\t\u0001 交通", "n":[-1.5e3, 0, 12345678901234567890, 2.50, true, false, null], "o":{}, "a":[[]]}
[1,]
"\x"
01
{"a" 1}
"\u12g4"
tru
"tab	in a string"
JSON
)"
codec_want="$(cat <<'JSON'
{"s":"é🚕\"\\/\b\f\n\r\t\u0001 交通","n":[-1.5E+3,0,12345678901234567890,2.50,true,false,null],"o":{},"a":[[]]}
refused: JSON: unexpected character ']' at offset 3
refused: JSON: bad escape \x at offset 3
refused: JSON: trailing characters at offset 1
refused: JSON: expected ':' at offset 5
refused: JSON: bad \u escape at offset 5
refused: JSON: unexpected character 't' at offset 0
refused: JSON: control character in a string at offset 5
JSON
)"
codec_got="$(printf '%s\n' "$codec_in" | timeout "$RUN_TIMEOUT_S" java "$here/AgentgateTurn.java" --json-roundtrip)" ||
    fail "the JSON codec check did not run"
[ "$codec_got" = "$codec_want" ] || fail "the JSON codec: got
$codec_got
want
$codec_want"
echo "ok: the JSON codec round-trips escapes and numbers and refuses malformed documents"

# 1. The same message twice at once (a double-click): one booking, one answer.
# The text carries quotes, a backslash, a tab and non-ASCII through the JSON codec.
text='taxi 18 "交通" \ 🚕	ok'
run double_a --message-id msg-double --text "$text" &
a_pid=$!
run double_b --message-id msg-double --text "$text" &
b_pid=$!
wait "$a_pid" "$b_pid"
expect_ok double_a
expect_ok double_b
[ "$(response double_a)" = "$(response double_b)" ] ||
    fail "the double text got two answers: $(response double_a) vs $(response double_b)"
outcomes="$(printf '%s\n' "$(field double_a outcome)" "$(field double_b outcome)" | sort | tr '\n' ' ')"
[ "$outcomes" = "completed replayed " ] || fail "expected one completed and one replayed run, got: $outcomes"
key="$(key_of double_a)"
[ -n "$key" ] || fail "no idempotency key in the answer: $(cat "$work/double_a.json")"
[ "$(wc -l <"$ledger")" = 1 ] || fail "the double text booked $(wc -l <"$ledger") times: $(cat "$ledger")"
[ "$(lines_with "$key")" = 1 ] || fail "the ledger line is not the answer's key $key: $(cat "$ledger")"
grep -qF '"text":"Booked 18 for: taxi 18 \"交通\" \\ 🚕\tok"' "$work/double_a.json" ||
    fail "the text did not survive the JSON round trip: $(cat "$work/double_a.json")"
echo "ok: double text booked once, both runs answered $(response double_a)"

# 2. Killed right after booking, before telling the server; the retry (run at
# once: it waits out the dead lease, bounded) takes over and reconciles.
run crash --message-id msg-crash --text "lunch 35" --crash-after-effect
[ "$(cat "$work/crash.rc")" = 137 ] ||
    fail "the crashing run exited $(cat "$work/crash.rc"), not 137: $(cat "$work/crash.out" "$work/crash.err")"
[ "$(wc -l <"$ledger")" = 2 ] || fail "the crashing run did not book: $(cat "$ledger")"
run retry --message-id msg-crash --text "lunch 35"
expect_ok retry
[ "$(field retry takeover)" = true ] || fail "the retry did not take over: $(cat "$work/retry.json")"
[ "$(field retry tool)" = reconciled ] || fail "the retry did not reconcile: $(cat "$work/retry.json")"
crash_key="$(key_of retry)"
[ "$(lines_with "$crash_key")" = 1 ] || fail "the crashed booking $crash_key is in the ledger $(lines_with "$crash_key") times: $(cat "$ledger")"
[ "$(wc -l <"$ledger")" = 2 ] || fail "the retry booked again: $(cat "$ledger")"
echo "ok: killed after booking, the takeover found $crash_key in the ledger and did not book again"

# 3. A repeat after success replays the stored answer and books nothing.
run repeat --message-id msg-double --text "$text"
expect_ok repeat
[ "$(field repeat outcome)" = replayed ] || fail "the repeat did not replay: $(cat "$work/repeat.json")"
[ "$(response repeat)" = "$(response double_a)" ] || fail "the replay answered otherwise: $(response repeat)"
[ "$(wc -l <"$ledger")" = 2 ] || fail "the repeat booked: $(cat "$ledger")"
echo "ok: the repeat replayed the stored answer"

# 4. A turn that thinks for 2.5 leases keeps its lease by heartbeating: a
# repeat sent meanwhile waits (bounded) and gets its answer, no takeover.
run slow --message-id msg-slow --text "hotel 120" --think-ms "$THINK_MS" &
slow_pid=$!
wait_begun slow
run slow_repeat --message-id msg-slow --text "hotel 120"
wait "$slow_pid"
expect_ok slow
expect_ok slow_repeat
[ "$(field slow outcome)" = completed ] && [ "$(field slow takeover)" = false ] ||
    fail "the heartbeating turn did not complete on its own lease: $(cat "$work/slow.json")"
[ "$(field slow_repeat outcome)" = replayed ] || fail "the repeat did not replay: $(cat "$work/slow_repeat.json")"
[ "$(response slow)" = "$(response slow_repeat)" ] || fail "the repeat answered otherwise: $(response slow_repeat)"
[ "$(wc -l <"$ledger")" = 3 ] || fail "the slow turn booked other than once: $(cat "$ledger")"
echo "ok: a turn thinking $THINK_MS ms kept its lease by heartbeating; the repeat replayed it"

# 5. A worker paused (SIGSTOP) past its lease is taken over; resumed, its
# heartbeat hears 409 lease_lost and it stops without booking.
java "$here/AgentgateTurn.java" --url "$url" --ledger "$ledger" --message-id msg-paused --text "train 7" \
    --think-ms "$THINK_MS" >"$work/paused.out" 2>"$work/paused.err" &
paused_pid=$!
wait_begun paused
kill -STOP "$paused_pid"
run takeover --message-id msg-paused --text "train 7"
expect_ok takeover
[ "$(field takeover takeover)" = true ] && [ "$(field takeover tool)" = executed ] ||
    fail "the paused worker's turn was not taken over and run: $(cat "$work/takeover.json")"
kill -CONT "$paused_pid"
for _ in $(seq "$POLLS"); do
    kill -0 "$paused_pid" 2>/dev/null || break
    sleep 0.1
done
kill -0 "$paused_pid" 2>/dev/null && fail "the resumed worker did not stop within $POLLS polls"
paused_rc=0
wait "$paused_pid" || paused_rc=$?
paused_pid=""
[ "$paused_rc" = 3 ] && grep -q '"outcome":"lease_lost"' "$work/paused.out" ||
    fail "the resumed worker did not stop on lease_lost (exit $paused_rc): $(cat "$work/paused.out" "$work/paused.err")"
[ "$(lines_with "$(key_of takeover)")" = 1 ] && [ "$(wc -l <"$ledger")" = 4 ] ||
    fail "the paused message booked other than once: $(cat "$ledger")"
echo "ok: the paused worker, taken over, stopped on lease_lost and booked nothing"

echo "examples/java/test.sh: all passed in $((SECONDS - started)) s"
