"""The same message sent twice at once (a double-click), against the real
server: the duplicate's begin is refused ``request_in_flight``; it follows
the running turn to its end and gets the replay of its answer as soon as
it exists (well before the lease's Retry-After), and the body runs once
(sync and asyncio). A wait that runs out first raises ``RequestInFlight``
with the lease's real retry hint."""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any, Dict, List

import pytest

import agentgate
from agentgate import AsyncGate, AsyncTurn, Gate, Turn

#: How long the first send's body takes (the model call).
BODY_S = 1.0
#: The duplicate's wait: far more than the body, far less than the lease.
DUPLICATE_WAIT_S = 10.0
#: After the first send returns, the duplicate returns within this: the
#: server's follow wakes on the ending (at worst its 250 ms poll), one
#: begin round trip, scheduling on a loaded 2-core machine. Pausing on
#: Retry-After, or a 1 s poll, would miss it.
REPLAY_SLACK_S = 0.6
#: Bound on waiting for a thread or task the test started.
JOIN_TIMEOUT_S = 20.0

pytestmark = pytest.mark.timeout(30)

REPLY = {"text": "Booked 18.", "amount": 18}


def _check(first: Any, duplicate: Any, runs: List[float], first_done: float, dup_started: float, dup_done: float, ttl_ms: int) -> None:
    assert len(runs) == 1, f"the body ran {len(runs)} times"
    assert first.replayed is False and first.value == REPLY
    assert duplicate.replayed is True, "the duplicate ran instead of replaying"
    assert duplicate.state == "succeeded" and duplicate.value == REPLY
    lag = dup_done - first_done
    waited = dup_done - dup_started
    print(f"duplicate waited {waited:.3f} s; returned {lag * 1000:.0f} ms after the first (lease {ttl_ms} ms)")
    assert lag < REPLAY_SLACK_S, f"the duplicate returned {lag:.3f} s after the first"
    assert waited < BODY_S + REPLAY_SLACK_S + 0.5, f"the duplicate waited {waited:.3f} s"
    assert waited < ttl_ms / 1000 / 4, "the duplicate waited for the lease, not for the answer"


def test_sync_duplicate_gets_the_replay_as_soon_as_the_first_ends_and_the_body_runs_once(server, ids):
    user, session, message = ids("u"), ids("s"), ids("m")
    runs: List[float] = []
    running = threading.Event()
    results: Dict[str, Any] = {}
    times: Dict[str, float] = {}

    def body(turn: Turn) -> Dict[str, Any]:
        runs.append(time.monotonic())
        results["ttl_ms"] = turn.lease_ttl_ms
        running.set()
        time.sleep(BODY_S)
        return REPLY

    with Gate(server.url) as gate:

        def first() -> None:
            results["first"] = gate.run(user, session, message, {"text": "book 18"}, body, wait=DUPLICATE_WAIT_S)
            times["first_done"] = time.monotonic()

        thread = threading.Thread(target=first)
        thread.start()
        assert running.wait(JOIN_TIMEOUT_S)
        times["dup_started"] = time.monotonic()
        duplicate = gate.run(user, session, message, {"text": "book 18"}, body, wait=DUPLICATE_WAIT_S)
        times["dup_done"] = time.monotonic()
        thread.join(JOIN_TIMEOUT_S)
        assert not thread.is_alive()
    _check(results["first"], duplicate, runs, times["first_done"], times["dup_started"], times["dup_done"], results["ttl_ms"])


async def test_async_duplicate_gets_the_replay_as_soon_as_the_first_ends_and_the_body_runs_once(server, ids):
    user, session, message = ids("u"), ids("s"), ids("m")
    runs: List[float] = []
    running = asyncio.Event()
    ttl: List[int] = []

    async def body(turn: AsyncTurn) -> Dict[str, Any]:
        runs.append(time.monotonic())
        ttl.append(turn.lease_ttl_ms)
        running.set()
        await asyncio.sleep(BODY_S)
        return REPLY

    async with AsyncGate(server.url) as gate:

        async def first() -> Any:
            result = await gate.run(user, session, message, {"text": "book 18"}, body, wait=DUPLICATE_WAIT_S)
            return result, time.monotonic()

        task = asyncio.create_task(first())
        await asyncio.wait_for(running.wait(), JOIN_TIMEOUT_S)
        dup_started = time.monotonic()
        duplicate = await asyncio.wait_for(
            gate.run(user, session, message, {"text": "book 18"}, body, wait=DUPLICATE_WAIT_S), JOIN_TIMEOUT_S
        )
        dup_done = time.monotonic()
        first_result, first_done = await asyncio.wait_for(task, JOIN_TIMEOUT_S)
    _check(first_result, duplicate, runs, first_done, dup_started, dup_done, ttl[0])


def test_sync_duplicate_whose_wait_runs_out_raises_request_in_flight_with_the_lease_retry_hint(server, ids):
    user, session, message = ids("u"), ids("s"), ids("m")
    runs: List[float] = []
    running = threading.Event()
    release = threading.Event()
    ttl: List[int] = []

    def body(turn: Turn) -> Dict[str, Any]:
        runs.append(time.monotonic())
        ttl.append(turn.lease_ttl_ms)
        running.set()
        release.wait(JOIN_TIMEOUT_S)
        return REPLY

    wait_s = 0.5
    with Gate(server.url) as gate:
        thread = threading.Thread(target=lambda: gate.run(user, session, message, None, body))
        thread.start()
        try:
            assert running.wait(JOIN_TIMEOUT_S)
            started = time.monotonic()
            with pytest.raises(agentgate.RequestInFlight) as raised:
                gate.run(user, session, message, None, body, wait=wait_s)
            waited = time.monotonic() - started
        finally:
            release.set()
            thread.join(JOIN_TIMEOUT_S)
    assert not thread.is_alive()
    assert len(runs) == 1, f"the body ran {len(runs)} times"
    assert wait_s <= waited < wait_s + REPLAY_SLACK_S, f"gave up after {waited:.3f} s"
    # The hint is the running turn's remaining lease, read after the wait.
    assert raised.value.retry_after_ms is not None
    assert 0 < raised.value.retry_after_ms <= ttl[0]
    assert raised.value.active_turn_id is not None


async def test_async_duplicate_whose_wait_runs_out_raises_request_in_flight_with_the_lease_retry_hint(server, ids):
    user, session, message = ids("u"), ids("s"), ids("m")
    runs: List[float] = []
    running = asyncio.Event()
    release = asyncio.Event()
    ttl: List[int] = []

    async def body(turn: AsyncTurn) -> Dict[str, Any]:
        runs.append(time.monotonic())
        ttl.append(turn.lease_ttl_ms)
        running.set()
        await asyncio.wait_for(release.wait(), JOIN_TIMEOUT_S)
        return REPLY

    wait_s = 0.5
    async with AsyncGate(server.url) as gate:
        task = asyncio.create_task(gate.run(user, session, message, None, body))
        try:
            await asyncio.wait_for(running.wait(), JOIN_TIMEOUT_S)
            started = time.monotonic()
            with pytest.raises(agentgate.RequestInFlight) as raised:
                await asyncio.wait_for(gate.run(user, session, message, None, body, wait=wait_s), JOIN_TIMEOUT_S)
            waited = time.monotonic() - started
        finally:
            release.set()
            await asyncio.wait_for(task, JOIN_TIMEOUT_S)
    assert len(runs) == 1, f"the body ran {len(runs)} times"
    assert wait_s <= waited < wait_s + REPLAY_SLACK_S, f"gave up after {waited:.3f} s"
    assert raised.value.retry_after_ms is not None
    assert 0 < raised.value.retry_after_ms <= ttl[0]
    assert raised.value.active_turn_id is not None
