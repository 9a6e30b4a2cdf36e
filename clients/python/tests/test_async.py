"""The asyncio client against the real server: the main paths of
test_sync.py, awaited."""

from __future__ import annotations

import asyncio
import time

import pytest

import agentgate
from agentgate import AsyncGate

from conftest import SHORT_TTL_MS, TTL_MARGIN_S

TIMING_SLACK_S = 1.5


@pytest.fixture
async def gate(server):
    async with AsyncGate(server.url) as gate:
        yield gate


async def test_async_replay_does_not_enter_the_body_and_returns_the_same_response(gate, ids):
    entered = []
    async with gate.turn(ids("u"), ids("s"), "msg-1", {"text": "taxi 18"}) as turn:
        entered.append(turn.turn_id)
        await turn.complete({"text": "booked"})
    with pytest.raises(agentgate.Replayed) as replay:
        async with gate.turn(ids("u"), ids("s"), "msg-1", {"text": "taxi 18"}):
            entered.append("second")
    assert replay.value.response == {"text": "booked"}

    async def never(_turn):
        entered.append("run_turn")

    assert await gate.run_turn(ids("u"), ids("s"), "msg-1", {"text": "taxi 18"}, never) == {"text": "booked"}
    assert entered == [entered[0]]


async def test_async_payload_mismatch_raises_PayloadMismatch(gate, ids):
    async def ok(_turn):
        return "ok"

    await gate.run_turn(ids("u"), ids("s"), "msg-1", {"amount": 18}, ok)
    with pytest.raises(agentgate.PayloadMismatch) as refused:
        await gate.run_turn(ids("u"), ids("s"), "msg-1", {"amount": 19}, ok)
    assert refused.value.status == 422


async def test_async_session_busy_gives_up_after_wait(gate, ids):
    async with gate.turn(ids("u"), ids("s"), "msg-1", {}) as holder:
        started = time.monotonic()
        with pytest.raises(agentgate.SessionBusy) as refused:
            async with gate.turn(ids("u"), ids("s"), "msg-2", {}, wait=1.0):
                pytest.fail("entered a busy session")
        assert 1.0 <= time.monotonic() - started < 1.0 + TIMING_SLACK_S
        assert refused.value.active_turn_id == holder.turn_id
        await holder.complete("done")


async def test_async_session_busy_wait_succeeds_when_the_holder_finishes_within_it(server, gate, ids):
    busy_before = server.metric("agentgate_conflicts_total", code="session_busy")

    async def holder_turn():
        async with gate.turn(ids("u"), ids("s"), "msg-1", {}) as holder:
            await asyncio.sleep(SHORT_TTL_MS / 1000 + TTL_MARGIN_S)
            await holder.complete("first")

    holding = asyncio.create_task(holder_turn())
    await asyncio.sleep(0.1)
    started = time.monotonic()

    async def second(turn):
        return turn.attempt

    assert await gate.run_turn(ids("u"), ids("s"), "msg-2", {}, second, wait=10.0) == 1
    elapsed = time.monotonic() - started
    await holding
    assert 0.4 <= elapsed < 0.5 + TIMING_SLACK_S
    assert server.metric("agentgate_conflicts_total", code="session_busy") > busy_before, "never waited"


async def test_async_user_at_capacity_raises_UserAtCapacity(start_server, ids):
    server = start_server("--max-turns-per-user", "1")
    async with AsyncGate(server.url) as gate:
        async with gate.turn(ids("u"), ids("s1"), "msg-1", {}) as holder:
            with pytest.raises(agentgate.UserAtCapacity) as refused:
                async with gate.turn(ids("u"), ids("s2"), "msg-1", {}):
                    pytest.fail("a second turn ran over the user's cap")
            assert refused.value.status == 429 and refused.value.retry_after_ms > 0
            await holder.complete("done")


async def test_async_exception_in_the_body_fails_the_turn_retryably_and_propagates(gate, ids):
    with pytest.raises(ZeroDivisionError):
        async with gate.turn(ids("u"), ids("s"), "msg-1", {}) as turn:
            1 / 0
    state = (await gate.get_turn(turn.turn_id))["turn"]
    assert state["state"] == "failed" and state["retryable"] is True


async def test_async_body_exiting_without_completing_raises_TurnNotEnded(gate, ids):
    with pytest.raises(agentgate.TurnNotEnded):
        async with gate.turn(ids("u"), ids("s"), "msg-1", {}) as turn:
            pass
    assert (await gate.get_turn(turn.turn_id))["turn"]["state"] == "failed"


async def test_async_tool_runs_once_and_reconciles_nothing_on_a_first_claim(gate, ids):
    runs, hooks = [], []

    async def book(ctx):
        runs.append(ctx.previous_outcome)
        return {"key": ctx.idempotency_key}

    async def hook(ctx):
        hooks.append(ctx)

    async with gate.turn(ids("u"), ids("s"), "msg-1", {}) as turn:
        first = await turn.tool("book", {"amount": 18}, run=book, reconcile=hook)
        again = await turn.tool("book", {"amount": 18}, run=book, reconcile=hook)
        await turn.complete(first)
    assert first == again and runs == [None] and hooks == []


async def test_async_heartbeats_keep_the_lease_past_its_ttl(start_server, ids):
    server = start_server("--lease-ttl-ms", str(SHORT_TTL_MS))
    async with AsyncGate(server.url) as gate:
        async with gate.turn(ids("u"), ids("s"), "msg-1", {}) as turn:
            await asyncio.sleep(2.5 * SHORT_TTL_MS / 1000)  # past two TTLs
            assert not turn.lost.is_set()
            await turn.complete("kept")


async def test_async_claim_orphan_takes_over_a_dead_turn(start_server, ids):
    server = start_server("--lease-ttl-ms", str(SHORT_TTL_MS))
    async with AsyncGate(server.url) as gate:
        assert await gate.claim_orphan(user_ids=[ids("u")]) is None
        _, begun = await gate.request(
            "POST",
            "/v1/turns",
            {"user_id": ids("u"), "session_id": ids("s"), "client_request_id": "m", "payload": {"n": 1}},
        )
        await asyncio.sleep(SHORT_TTL_MS / 1000 + TTL_MARGIN_S)
        orphan = await gate.claim_orphan(min_orphaned_ms=100, user_ids=[ids("u")])
        assert orphan is not None
        async with orphan as turn:
            assert turn.turn_id == begun["turn"]["turn_id"] and turn.takeover and turn.payload == {"n": 1}
            await turn.complete("resumed")
        assert (await gate.get_turn(turn.turn_id))["turn"]["response"] == "resumed"
