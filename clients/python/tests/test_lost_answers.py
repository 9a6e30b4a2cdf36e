"""Lost answers. Writes under the lease whose answer is lost are sent again, bounded,
and land once: the turn is not taken for lost, the record is ours. The
answers are lost two ways: the server frozen with SIGSTOP past the
client's timeout, and a proxy that delivers the request but drops the
answer (so the repeat is refused "already ended" and the client checks
the record). And heartbeats that go unanswered for a whole TTL: the turn
is taken for lost without waiting for the server to say so."""

from __future__ import annotations

import asyncio
import signal
import threading
import time

import pytest

import agentgate
from agentgate import AsyncGate, Gate

from conftest import SHORT_TTL_MS
from lossy_proxy import LossyProxy

#: The client's request timeout in these tests: shorter than the freeze.
CLIENT_TIMEOUT_S = 0.5
#: How long the server stays frozen: past one timeout, within the retries.
FREEZE_S = 0.8


def freeze_server_for(server, seconds: float) -> threading.Timer:
    server.process.send_signal(signal.SIGSTOP)
    thaw = threading.Timer(seconds, lambda: server.process.send_signal(signal.SIGCONT))
    thaw.start()
    return thaw


def test_a_turn_ending_whose_answer_is_lost_is_sent_again_and_lands(server, ids):
    gate = Gate(server.url, timeout=CLIENT_TIMEOUT_S)
    with gate.turn(ids("u"), ids("s"), "msg-1", {}) as turn:
        thaw = freeze_server_for(server, FREEZE_S)
        try:
            ended = turn.complete({"text": "done"})
        finally:
            thaw.join()
            server.process.send_signal(signal.SIGCONT)
    assert ended["state"] == "succeeded" and ended["fence"] == turn.fence
    assert not turn.lost.is_set()
    record = Gate(server.url).get_turn(turn.turn_id)["turn"]
    assert record["state"] == "succeeded" and record["response"] == {"text": "done"}


def test_a_tool_result_whose_answer_is_lost_is_sent_again_and_the_tool_runs_once(server, ids):
    gate = Gate(server.url, timeout=CLIENT_TIMEOUT_S)
    runs = []
    thaws = []

    def book(ctx):
        runs.append(ctx.idempotency_key)
        thaws.append(freeze_server_for(server, FREEZE_S))  # the result's answer will be lost
        return {"entry": 1}

    try:
        with gate.turn(ids("u"), ids("s"), "msg-1", {}) as turn:
            assert turn.tool("book", {"amount": 1}, run=book) == {"entry": 1}
            assert turn.tool("book", {"amount": 1}, run=book) == {"entry": 1}
            turn.complete("ok")
    finally:
        for thaw in thaws:
            thaw.join()
        server.process.send_signal(signal.SIGCONT)
    assert len(runs) == 1
    assert not turn.lost.is_set()


async def test_async_a_turn_ending_whose_answer_is_lost_is_sent_again_and_lands(server, ids):
    async with AsyncGate(server.url, timeout=CLIENT_TIMEOUT_S) as gate:
        async with gate.turn(ids("u"), ids("s"), "msg-1", {}) as turn:
            thaw = freeze_server_for(server, FREEZE_S)
            try:
                ended = await turn.complete({"text": "done"})
            finally:
                thaw.join()
                server.process.send_signal(signal.SIGCONT)
        assert ended["state"] == "succeeded"
        assert not turn.lost.is_set()
        assert (await gate.get_turn(turn.turn_id))["turn"]["response"] == {"text": "done"}


def test_a_write_refused_as_already_ended_without_a_lost_answer_is_lease_lost(server, ids):
    gate = Gate(server.url)
    with gate.turn(ids("u"), ids("s"), "msg-1", {}) as turn:
        turn.complete("first")
    # A second ending with the same token: nothing was lost in between, so
    # the refusal is the answer.
    turn.ended = False
    turn._ending = False
    try:
        turn.complete("second")
    except agentgate.LeaseLost as refused:
        assert refused.status == 409
    else:
        raise AssertionError("a second ending was not refused")
    assert gate.get_turn(turn.turn_id)["turn"]["response"] == "first"


@pytest.fixture
def proxy(server):
    host, port = server.url.removeprefix("http://").rsplit(":", 1)
    lossy = LossyProxy((host, int(port)))
    yield lossy
    lossy.close()


def test_a_turn_ending_that_landed_but_whose_answer_was_dropped_is_confirmed_from_the_record(server, proxy, ids):
    gate = Gate(proxy.url)
    lease_lost_before = server.metric("agentgate_lease_lost_total")
    with gate.turn(ids("u"), ids("s"), "msg-1", {}) as turn:
        proxy.lose_next_answer()
        ended = turn.complete({"text": "done"})
    assert proxy.lost_answers == ["HTTP/1.1 200 OK"], "the first send did not land"
    assert server.metric("agentgate_lease_lost_total") > lease_lost_before, "the repeat was not refused"
    assert ended["state"] == "succeeded" and ended["response"] == {"text": "done"}
    assert not turn.lost.is_set()


def test_a_tool_result_that_landed_but_whose_answer_was_dropped_is_confirmed_and_not_run_again(server, proxy, ids):
    gate = Gate(proxy.url)
    runs = []

    def book(ctx):
        runs.append(ctx.idempotency_key)
        proxy.lose_next_answer()  # the result's answer
        return {"entry": 1}

    with gate.turn(ids("u"), ids("s"), "msg-1", {}) as turn:
        assert turn.tool("book", {"amount": 1}, run=book) == {"entry": 1}
        assert turn.tool("book", {"amount": 1}, run=book) == {"entry": 1}
        turn.complete("ok")
    assert proxy.lost_answers == ["HTTP/1.1 200 OK"]
    assert len(runs) == 1 and not turn.lost.is_set()


def executions_of(server, turn_id):
    page = Gate(server.url).request("GET", f"/v1/turns/{turn_id}/executions")[1]
    return [(e["state"], e["attempt"]) for e in page["executions"]]


def test_a_tool_claim_whose_answer_was_dropped_is_failed_as_never_run_and_claimed_again(server, proxy, ids):
    # The claim lands (the execution is running under this lease) and its
    # answer is lost: sent again, it is refused tool_in_flight, naming the
    # execution no caller of this turn holds. It is failed as never run and
    # claimed again; before, the turn could not run that call until its
    # lease ran out.
    gate = Gate(proxy.url)
    runs = []

    def book(ctx):
        runs.append((ctx.attempt, ctx.previous_outcome))
        return {"entry": 1}

    with gate.turn(ids("u"), ids("s"), "msg-1", {}) as turn:
        proxy.lose_next_answer()  # the claim's
        assert turn.tool("book", {"amount": 1}, run=book) == {"entry": 1}
        turn.complete("ok")
    assert proxy.lost_answers == ["HTTP/1.1 201 Created"]
    assert runs == [(2, "failed")], "run once, on the claim after the lost one was failed"
    assert executions_of(server, turn.turn_id) == [("succeeded", 2)]


def test_concurrent_claims_of_one_call_with_one_answer_dropped_run_it_once(server, proxy, ids):
    # Whichever request's answer is lost (the claim that started the
    # execution, or a sibling's tool_in_flight), every caller gets the one
    # result and the tool runs once: only one caller of the turn can hold
    # the execution, whether it was handed it or adopted it as lost.
    gate = Gate(proxy.url)
    callers = 8
    runs = []
    lock = threading.Lock()
    barrier = threading.Barrier(callers)

    def book(ctx):
        with lock:
            runs.append(ctx.attempt)
        time.sleep(0.05)
        return {"entry": 1}

    with gate.turn(ids("u"), ids("s"), "msg-1", {}) as turn:
        results = []
        errors = []

        def call():
            barrier.wait()
            try:
                results.append(turn.tool("book", {"amount": 1}, run=book))
            except Exception as error:  # noqa: BLE001 - reported below
                errors.append(error)

        proxy.lose_next_answer()
        threads = [threading.Thread(target=call) for _ in range(callers)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        turn.complete("ok")
    assert errors == []
    assert results == [{"entry": 1}] * callers
    assert len(proxy.lost_answers) == 1
    assert len(runs) == 1, runs
    assert [state for state, _ in executions_of(server, turn.turn_id)] == ["succeeded"]


async def test_async_a_tool_claim_whose_answer_was_dropped_is_failed_and_claimed_again(server, proxy, ids):
    runs = []

    async def book(ctx):
        runs.append((ctx.attempt, ctx.previous_outcome))
        return {"entry": 1}

    async with AsyncGate(proxy.url) as gate:
        async with gate.turn(ids("u"), ids("s"), "msg-1", {}) as turn:
            proxy.lose_next_answer()
            assert await turn.tool("book", {"amount": 1}, run=book) == {"entry": 1}
            await turn.complete("ok")
    assert proxy.lost_answers == ["HTTP/1.1 201 Created"]
    assert runs == [(2, "failed")]
    assert executions_of(server, turn.turn_id) == [("succeeded", 2)]


async def test_async_a_turn_ending_that_landed_but_whose_answer_was_dropped_is_confirmed(server, proxy, ids):
    async with AsyncGate(proxy.url) as gate:
        async with gate.turn(ids("u"), ids("s"), "msg-1", {}) as turn:
            proxy.lose_next_answer()
            ended = await turn.complete({"text": "done"})
        assert proxy.lost_answers == ["HTTP/1.1 200 OK"]
        assert ended["state"] == "succeeded" and not turn.lost.is_set()


def test_a_begin_whose_grant_was_dropped_waits_out_its_own_lost_lease_and_takes_it_over(start_server, ids):
    server = start_server("--lease-ttl-ms", str(SHORT_TTL_MS))
    host, port = server.url.removeprefix("http://").rsplit(":", 1)
    lossy = LossyProxy((host, int(port)))
    try:
        gate = Gate(lossy.url)
        lossy.lose_next_answer()
        with gate.turn(ids("u"), ids("s"), "msg-1", {}, wait=SHORT_TTL_MS / 1000 * 5) as turn:
            assert lossy.lost_answers == ["HTTP/1.1 201 Created"]
            assert turn.takeover and turn.attempt == 2
            turn.complete("ok")
    finally:
        lossy.close()


def test_a_lease_that_cannot_be_renewed_before_its_ttl_is_taken_for_lost(start_server, ids):
    server = start_server("--lease-ttl-ms", str(SHORT_TTL_MS))
    gate = Gate(server.url)  # the default 35 s timeout: the heartbeat bounds its own wait
    with pytest.raises(agentgate.LeaseLost):
        with gate.turn(ids("u"), ids("s"), "msg-1", {}) as turn:
            thaw = freeze_server_for(server, SHORT_TTL_MS / 1000 * 2)
            try:
                assert turn.lost.wait(SHORT_TTL_MS / 1000 * 3), "the loss was not noticed"
                assert turn.lost_error is not None and turn.lost_error.status is None  # judged locally
            finally:
                thaw.join()
                server.process.send_signal(signal.SIGCONT)
            turn.complete("too late")  # refused without a request


async def test_async_a_lease_that_cannot_be_renewed_before_its_ttl_cancels_the_body(start_server, ids):
    server = start_server("--lease-ttl-ms", str(SHORT_TTL_MS))
    async with AsyncGate(server.url) as gate:
        thaw = None
        started = time.monotonic()
        try:
            with pytest.raises(agentgate.LeaseLost):
                async with gate.turn(ids("u"), ids("s"), "msg-1", {}) as turn:
                    thaw = freeze_server_for(server, SHORT_TTL_MS / 1000 * 2)
                    await asyncio.sleep(30)  # cancelled by the heartbeat
                    pytest.fail("the body was not interrupted")
        finally:
            if thaw is not None:
                await asyncio.to_thread(thaw.join)
            server.process.send_signal(signal.SIGCONT)
        assert time.monotonic() - started < 10
        assert turn.lost.is_set() and turn.lost_error is not None and turn.lost_error.status is None
