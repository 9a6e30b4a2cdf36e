"""The synchronous client against the real server: replay, refusals,
bounded waiting, endings, tools, orphans."""

from __future__ import annotations

import threading
import time

import httpx
import pytest

import agentgate
from agentgate import Gate

from conftest import SHORT_TTL_MS, TTL_MARGIN_S

#: Slack for timing assertions on a shared 2-core machine.
TIMING_SLACK_S = 1.5


def test_replay_does_not_enter_the_body_and_returns_the_same_response(server, ids):
    gate = Gate(server.url)
    entered = []
    with gate.turn(ids("u"), ids("s"), "msg-1", {"text": "taxi 18"}) as turn:
        entered.append(turn.turn_id)
        turn.complete({"text": "booked"})

    with pytest.raises(agentgate.Replayed) as replay:
        with gate.turn(ids("u"), ids("s"), "msg-1", {"text": "taxi 18"}):
            entered.append("second")
    assert replay.value.response == {"text": "booked"}
    assert replay.value.turn_id == entered[0]
    assert replay.value.state == "succeeded"

    def never(_turn):
        entered.append("run_turn")

    assert gate.run_turn(ids("u"), ids("s"), "msg-1", {"text": "taxi 18"}, never) == {"text": "booked"}
    assert entered == [entered[0]], "a replay entered the body"


def test_payload_mismatch_raises_PayloadMismatch(server, ids):
    gate = Gate(server.url)
    gate.run_turn(ids("u"), ids("s"), "msg-1", {"amount": 18}, lambda turn: "ok")
    with pytest.raises(agentgate.PayloadMismatch) as refused:
        with gate.turn(ids("u"), ids("s"), "msg-1", {"amount": 19}):
            pytest.fail("the body ran on a payload mismatch")
    assert refused.value.status == 422
    assert refused.value.code == "payload_mismatch"


def test_session_busy_gives_up_after_wait(server, ids):
    gate = Gate(server.url)
    with gate.turn(ids("u"), ids("s"), "msg-1", {}) as holder:
        wait_s = 1.0
        started = time.monotonic()
        with pytest.raises(agentgate.SessionBusy) as refused:
            with gate.turn(ids("u"), ids("s"), "msg-2", {}, wait=wait_s):
                pytest.fail("entered a busy session")
        elapsed = time.monotonic() - started
        assert wait_s <= elapsed < wait_s + TIMING_SLACK_S
        assert refused.value.active_turn_id == holder.turn_id
        assert refused.value.status == 409 and refused.value.retry_after_ms > 0
        holder.complete("done")


def test_session_busy_without_wait_is_refused_at_once(server, ids):
    gate = Gate(server.url)
    with gate.turn(ids("u"), ids("s"), "msg-1", {}) as holder:
        started = time.monotonic()
        with pytest.raises(agentgate.SessionBusy):
            gate.turn(ids("u"), ids("s"), "msg-2", {}).__enter__()
        assert time.monotonic() - started < TIMING_SLACK_S
        holder.complete("done")


def test_session_busy_wait_succeeds_when_the_holder_finishes_within_it(server, ids):
    gate = Gate(server.url)
    holder = gate.turn(ids("u"), ids("s"), "msg-1", {}).__enter__()
    busy_before = server.metric("agentgate_conflicts_total", code="session_busy")
    finisher = threading.Timer(0.6, lambda: holder.complete("first"))
    finisher.start()
    try:
        started = time.monotonic()
        with gate.turn(ids("u"), ids("s"), "msg-2", {}, wait=10.0) as second:
            elapsed = time.monotonic() - started
            assert second.attempt == 1 and not second.takeover
            second.complete("second")
    finally:
        finisher.join()
        holder.__exit__(None, None, None)
    assert 0.5 <= elapsed < 0.6 + TIMING_SLACK_S, "did not begin soon after the holder ended"
    assert server.metric("agentgate_conflicts_total", code="session_busy") > busy_before, "never waited"


def test_on_busy_wait_is_answered_by_the_server_when_the_holder_ends(server, ids):
    gate = Gate(server.url)
    holder = gate.turn(ids("u"), ids("s"), "msg-1", {}).__enter__()
    finisher = threading.Timer(0.6, lambda: holder.complete("first"))
    finisher.start()
    busy_before = server.metric("agentgate_conflicts_total", code="session_busy")
    try:
        with gate.turn(ids("u"), ids("s"), "msg-2", {}, on_busy="wait", wait_ms=10_000) as second:
            second.complete("second")
    finally:
        finisher.join()
        holder.__exit__(None, None, None)
    # One begin, answered by the server once the holder ended: no 409 sent.
    assert server.metric("agentgate_conflicts_total", code="session_busy") == busy_before
    assert server.metric("agentgate_busy_begins_total", policy="wait", outcome="started_after_wait") >= 1


def test_on_busy_interrupt_stops_the_holder_and_release_fences_a_stubborn_one(server, ids):
    gate = Gate(server.url)
    user, session = ids("u"), ids("s")
    holder = gate.turn(user, session, "msg-1", {}).__enter__()

    def stop_when_told():
        while not holder.lost.is_set():
            try:
                holder.claim_tool("book", {"amount": 1})
            except agentgate.TurnCancelled:
                holder.end_cancelled({"text": "stopped"})
                return
            time.sleep(0.05)

    stopper = threading.Thread(target=stop_when_told)
    stopper.start()
    with pytest.raises(agentgate.LeaseLost):
        with gate.turn(user, session, "msg-2", {}, on_busy="interrupt", wait_ms=10_000) as second:
            stopper.join(timeout=10)
            assert gate.get_turn(holder.turn_id)["turn"]["state"] == "cancelled"
            # The second holder stops answering: an operator releases it,
            # and its late ending is refused.
            released = gate.release_session(session, user_id=user)
            assert released["turn_id"] == second.turn_id and released["state"] == "abandoned"
            second.complete("late")
    assert second.lost.is_set()
    assert gate.release_session(session) is None
    with pytest.raises(ValueError):
        gate.turn(user, session, "msg-3", {}, on_busy="queue")
    with pytest.raises(ValueError):
        gate.turn(user, session, "msg-3", {}, on_busy="wait", wait_ms=60_000)


def test_user_at_capacity_raises_UserAtCapacity_and_waits_for_a_permit(start_server, ids):
    server = start_server("--max-turns-per-user", "1")
    gate = Gate(server.url)
    holder = gate.turn(ids("u"), ids("s1"), "msg-1", {}).__enter__()
    with pytest.raises(agentgate.UserAtCapacity) as refused:
        with gate.turn(ids("u"), ids("s2"), "msg-1", {}, wait=0.3):
            pytest.fail("a second turn ran over the user's cap")
    assert refused.value.status == 429 and refused.value.retry_after_ms > 0

    finisher = threading.Timer(0.4, lambda: holder.complete("first"))
    finisher.start()
    try:
        assert gate.run_turn(ids("u"), ids("s2"), "msg-1", {}, lambda turn: "second", wait=10.0) == "second"
    finally:
        finisher.join()
        holder.__exit__(None, None, None)


def test_an_exception_in_the_body_fails_the_turn_retryably_and_propagates(server, ids):
    gate = Gate(server.url)
    with pytest.raises(ZeroDivisionError):
        with gate.turn(ids("u"), ids("s"), "msg-1", {}) as turn:
            first_id = turn.turn_id
            1 / 0
    state = gate.get_turn(first_id)["turn"]
    assert state["state"] == "failed" and state["retryable"] is True
    assert state["error"]["type"] == "ZeroDivisionError"
    with gate.turn(ids("u"), ids("s"), "msg-1", {}) as again:
        assert again.turn_id == first_id and again.attempt == 2
        again.complete("ok")


def test_an_exception_saying_retryable_false_fails_the_turn_for_good(server, ids):
    class Refusal(Exception):
        retryable = False

    gate = Gate(server.url)
    with pytest.raises(Refusal):
        with gate.turn(ids("u"), ids("s"), "msg-1", {}):
            raise Refusal("no")
    with pytest.raises(agentgate.Replayed) as replay:
        gate.run_turn(ids("u"), ids("s"), "msg-1", {}, lambda turn: pytest.fail("ran again"))
    assert replay.value.state == "failed"


def test_a_body_that_exits_without_completing_raises_TurnNotEnded_and_fails_the_turn(server, ids):
    gate = Gate(server.url)
    with pytest.raises(agentgate.TurnNotEnded):
        with gate.turn(ids("u"), ids("s"), "msg-1", {}) as turn:
            turn_id = turn.turn_id
    state = gate.get_turn(turn_id)["turn"]
    assert state["state"] == "failed" and state["retryable"] is True
    # The session was released: another message begins at once.
    gate.run_turn(ids("u"), ids("s"), "msg-2", {}, lambda turn: "ok")


def test_tool_runs_once_and_later_claims_return_the_stored_result(server, ids):
    gate = Gate(server.url)
    runs = []

    def book(ctx):
        runs.append(ctx.idempotency_key)
        return {"entry": len(runs), "key": ctx.idempotency_key}

    with gate.turn(ids("u"), ids("s"), "msg-1", {}) as turn:
        first = turn.tool("book", {"amount": 18, "type": "expense"}, run=book)
        # Same call in another key order and number spelling.
        second = turn.tool("book", {"type": "expense", "amount": 18.0}, run=book)
        turn.complete(first)
    assert first == second == {"entry": 1, "key": runs[0]}
    assert len(runs) == 1


def test_a_failing_run_fails_the_execution_and_the_next_claim_runs_it_again(server, ids):
    gate = Gate(server.url)
    seen = []

    def flaky(ctx):
        seen.append((ctx.attempt, ctx.previous_outcome))
        if len(seen) == 1:
            raise ConnectionError("downstream timed out")
        return "done"

    with gate.turn(ids("u"), ids("s"), "msg-1", {}) as turn:
        with pytest.raises(ConnectionError):
            turn.tool("send", {"to": "nora"}, run=flaky)
        assert turn.tool("send", {"to": "nora"}, run=flaky) == "done"
        turn.complete("ok")
    assert seen == [(1, None), (2, "failed")]


def test_heartbeats_keep_the_lease_past_its_ttl(start_server, ids):
    server = start_server("--lease-ttl-ms", str(SHORT_TTL_MS))
    gate = Gate(server.url)
    with gate.turn(ids("u"), ids("s"), "msg-1", {}) as turn:
        assert turn.lease_ttl_ms == SHORT_TTL_MS
        time.sleep(2.5 * SHORT_TTL_MS / 1000)  # past two TTLs
        assert not turn.lost.is_set()
        # Nobody could take it over meanwhile.
        with pytest.raises(agentgate.RequestInFlight):
            gate.turn(ids("u"), ids("s"), "msg-1", {}).__enter__()
        turn.complete("kept")
    assert gate.get_turn(turn.turn_id)["turn"]["state"] == "succeeded"


def test_claim_orphan_takes_over_a_dead_turn_and_resumes_it(start_server, ids):
    server = start_server("--lease-ttl-ms", str(SHORT_TTL_MS))
    gate = Gate(server.url)
    assert gate.claim_orphan(user_ids=[ids("u")]) is None
    # A holder that dies: begun and one tool run, never heartbeated again.
    _, begun = gate.request(
        "POST",
        "/v1/turns",
        {"user_id": ids("u"), "session_id": ids("s"), "client_request_id": "msg-1", "payload": {"text": "refund 40"}},
    )
    token = begun["turn"]["lease_token"]
    tid = begun["turn"]["turn_id"]
    _, claim = gate.request("POST", f"/v1/turns/{tid}/tools", {"tool": "lookup", "args": {}}, lease_token=token)
    gate.request(
        "POST",
        f"/v1/turns/{tid}/tools/{claim['execution']['execution_id']}/complete",
        {"result": {"account": 7}},
        lease_token=token,
    )
    time.sleep(SHORT_TTL_MS / 1000 + TTL_MARGIN_S)

    orphan = gate.claim_orphan(user_ids=[ids("u")])
    assert orphan is not None
    with orphan as turn:
        assert turn.turn_id == tid and turn.takeover and turn.attempt == 2
        assert turn.payload == {"text": "refund 40"}
        assert [(e["tool"], e["outcome"]) for e in turn.journal] == [("lookup", "succeeded")]
        account = turn.tool("lookup", {}, run=lambda ctx: pytest.fail("a succeeded call ran again"))
        turn.complete({"refunded": 40, "account": account["account"]})
    assert gate.get_turn(tid)["turn"]["response"] == {"refunded": 40, "account": 7}


def test_api_key_is_sent_and_a_missing_one_raises_Unauthorized(start_server, ids):
    server = start_server("--api-key", "sekrit-key-0123456789")
    with pytest.raises(agentgate.Unauthorized) as refused:
        Gate(server.url).run_turn(ids("u"), ids("s"), "msg-1", {}, lambda turn: "ok")
    assert refused.value.status == 401
    assert Gate(server.url, api_key="sekrit-key-0123456789").run_turn(ids("u"), ids("s"), "msg-1", {}, lambda t: "ok") == "ok"


def test_a_stale_lease_token_is_refused_by_the_server_with_LeaseLost(server, ids):
    gate = Gate(server.url)
    with gate.turn(ids("u"), ids("s"), "msg-1", {}) as turn:
        turn.complete("done")
    with pytest.raises(agentgate.LeaseLost) as refused:
        gate.request("POST", f"/v1/turns/{turn.turn_id}/heartbeat", lease_token=turn._lease_token)
    assert refused.value.status == 409


def test_no_answer_raises_httpx_errors_not_silence(ids):
    gate = Gate("http://127.0.0.1:9", timeout=2.0)
    with pytest.raises(httpx.HTTPError):
        gate.run_turn(ids("u"), ids("s"), "msg-1", {}, lambda turn: "ok")


def test_await_confirmation_blocks_the_session_until_a_confirmation_turn_carries_the_decision(server, ids):
    gate = Gate(server.url)
    with gate.turn(ids("u"), ids("s"), "msg-1", {"text": "rent 3000"}) as turn:
        turn.await_confirmation({"tool": "book", "amount": 3000})
    with pytest.raises(agentgate.AwaitingConfirmation) as blocked:
        gate.run_turn(ids("u"), ids("s"), "msg-2", {"text": "lunch 35"}, lambda t: pytest.fail("ran"))
    assert blocked.value.active_turn_id == turn.turn_id and blocked.value.status == 409

    decision = {"turn_id": turn.turn_id, "decision": "approve"}
    with gate.turn(ids("u"), ids("s"), "msg-3", None, confirmation=decision) as follow_up:
        assert follow_up.confirmation is not None
        assert follow_up.confirmation["pending"] == {"tool": "book", "amount": 3000}
        assert follow_up.confirmation["decision"] == "approve"
        follow_up.complete("booked 3000")
    gate.run_turn(ids("u"), ids("s"), "msg-2", {"text": "lunch 35"}, lambda t: "free again")


def test_run_turn_returns_what_fn_returns_when_fn_ends_the_turn_itself(server, ids):
    gate = Gate(server.url)

    def refuse(turn):
        turn.fail({"reason": "not a booking"}, retryable=False)
        return "told the user"

    assert gate.run_turn(ids("u"), ids("s"), "msg-1", {}, refuse) == "told the user"
    with pytest.raises(agentgate.Replayed) as replay:
        gate.run_turn(ids("u"), ids("s"), "msg-1", {}, refuse)
    assert replay.value.state == "failed" and replay.value.error == {"reason": "not a booking"}


def test_a_result_that_is_not_json_fails_the_execution_and_raises_TypeError(server, ids):
    gate = Gate(server.url)
    with gate.turn(ids("u"), ids("s"), "msg-1", {}) as turn:
        with pytest.raises(TypeError, match="not JSON"):
            turn.tool("measure", {}, run=lambda ctx: float("nan"))
        # The execution was failed, not left running: the next claim runs it.
        assert turn.tool("measure", {}, run=lambda ctx: 1.5) == 1.5
        turn.complete("ok")
