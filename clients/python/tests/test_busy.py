"""A second message on a busy session, against the real server: an
interrupt stops a holder in a long model call within one heartbeat
interval and ends it cancelled (sync and asyncio); queued messages run in
order; supersede, a session's default policy, cancel and a queue wait that
runs out."""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any, Dict, List

import pytest

import agentgate
from agentgate import AsyncGate, AsyncTurn, Gate, Turn

#: The lease TTL of the interrupt tests: a heartbeat every third of it.
INTERRUPT_TTL_MS = 1500
HEARTBEAT_INTERVAL_S = INTERRUPT_TTL_MS / 3 / 1000
#: The simulated model call the holder is in when the interrupt comes.
MODEL_CALL_S = 10.0
#: Past one heartbeat interval: the heartbeat's round trip and the ending's
#: scheduling on a loaded 2-core machine.
STOP_SLACK_S = 0.5
#: Bound on waiting for a thread or task the test started.
JOIN_TIMEOUT_S = 20.0

PARTIAL = {"text": "Booked the taxi; writing the reply", "amount": 18.0}
#: What the server stores and replays of PARTIAL: canonical JSON.
PARTIAL_STORED = {"amount": 18, "text": "Booked the taxi; writing the reply"}


def _never(turn: Any) -> Any:
    pytest.fail("a replayed message ran its body")


async def test_async_interrupt_stops_a_holder_in_a_long_model_call_within_one_heartbeat(start_server, ids):
    server = start_server("--lease-ttl-ms", str(INTERRUPT_TTL_MS))
    user, session = ids("u"), ids("s")
    executions: List[str] = []
    in_model_call = asyncio.Event()
    stopped_at: List[float] = []

    async def book(ctx: agentgate.ToolContext) -> Dict[str, Any]:
        executions.append(ctx.idempotency_key)
        return {"booked": 18}

    async def holder_body(turn: AsyncTurn) -> str:
        await turn.tool("book", {"amount": 18}, run=book)
        turn.partial = PARTIAL
        in_model_call.set()
        try:
            await asyncio.sleep(MODEL_CALL_S)  # the model call
        finally:
            stopped_at.append(time.monotonic())
        return "the whole reply"

    async with AsyncGate(server.url) as gate:
        holder = asyncio.create_task(gate.run(user, session, "msg-1", {"text": "taxi 18"}, holder_body))
        await asyncio.wait_for(in_model_call.wait(), JOIN_TIMEOUT_S)
        sent_at = time.monotonic()
        second = await gate.run(
            user, session, "msg-2", {"text": "no, taxi 28"}, lambda turn: "second", on_busy="interrupt", wait_ms=10_000
        )
        first = await asyncio.wait_for(holder, JOIN_TIMEOUT_S)

        assert stopped_at[0] - sent_at < HEARTBEAT_INTERVAL_S + STOP_SLACK_S, "the holder did not stop in time"
        assert (first.state, first.replayed, first.partial) == ("cancelled", False, PARTIAL)
        assert (second.state, second.value) == ("succeeded", "second")
        stored = (await gate.get_turn(first.turn_id))["turn"]
        assert (stored["state"], stored["attempt"], stored["response"]) == ("cancelled", 1, PARTIAL_STORED)

        retry = await gate.run(user, session, "msg-1", {"text": "taxi 18"}, _never)
        assert (retry.state, retry.replayed, retry.partial) == ("cancelled", True, PARTIAL_STORED)
        with pytest.raises(agentgate.Replayed) as replay:
            await gate.run_turn(user, session, "msg-1", {"text": "taxi 18"}, _never)
        assert replay.value.state == "cancelled"
    assert len(executions) == 1, "the tool ran again"


def test_sync_interrupt_stops_a_holder_in_a_long_model_call_within_one_heartbeat(start_server, ids):
    server = start_server("--lease-ttl-ms", str(INTERRUPT_TTL_MS))
    gate = Gate(server.url)
    user, session = ids("u"), ids("s")
    executions: List[str] = []
    in_model_call = threading.Event()
    stopped_at: List[float] = []
    results: List[agentgate.TurnResult[str]] = []
    refused_after_stop: List[bool] = []

    def book(ctx: agentgate.ToolContext) -> Dict[str, Any]:
        executions.append(ctx.idempotency_key)
        return {"booked": 18}

    def holder_body(turn: Turn) -> str:
        turn.tool("book", {"amount": 18}, run=book)
        turn.partial = PARTIAL
        in_model_call.set()
        try:
            turn.sleep(MODEL_CALL_S)  # the model call, waiting cooperatively
        except agentgate.TurnCancelled:
            stopped_at.append(time.monotonic())
            try:  # a tool call after the stop is refused before it is claimed
                turn.tool("book", {"amount": 19}, run=book)
            except agentgate.TurnCancelled:
                refused_after_stop.append(True)
            raise
        return "the whole reply"

    holder = threading.Thread(
        target=lambda: results.append(gate.run(user, session, "msg-1", {"text": "taxi 18"}, holder_body))
    )
    holder.start()
    assert in_model_call.wait(JOIN_TIMEOUT_S)
    sent_at = time.monotonic()
    second = gate.run(user, session, "msg-2", {"text": "no"}, lambda turn: "second", on_busy="interrupt", wait_ms=10_000)
    holder.join(JOIN_TIMEOUT_S)

    assert stopped_at[0] - sent_at < HEARTBEAT_INTERVAL_S + STOP_SLACK_S, "the holder did not stop in time"
    [first] = results
    assert (first.state, first.replayed, first.partial) == ("cancelled", False, PARTIAL)
    assert (second.state, second.value) == ("succeeded", "second")
    stored = gate.get_turn(first.turn_id)["turn"]
    assert (stored["state"], stored["response"]) == ("cancelled", PARTIAL_STORED)

    retry = gate.run(user, session, "msg-1", {"text": "taxi 18"}, _never)
    assert (retry.state, retry.replayed, retry.partial) == ("cancelled", True, PARTIAL_STORED)
    assert refused_after_stop == [True]
    assert len(executions) == 1, "the tool ran again"


async def test_async_three_queued_messages_all_complete_in_order(server, ids):
    user, session = ids("u"), ids("s")
    ran: List[str] = []
    positions: Dict[str, List[int]] = {}

    async with AsyncGate(server.url) as gate:
        holder = await gate.turn(user, session, "msg-1", {}).__aenter__()
        queued = []
        for message in ("msg-2", "msg-3", "msg-4"):
            reported = asyncio.Event()

            def on_queued(position: int, message: str = message, reported: asyncio.Event = reported) -> None:
                positions.setdefault(message, []).append(position)
                reported.set()

            async def body(turn: AsyncTurn, message: str = message) -> str:
                ran.append(message)
                return f"{message} done"

            queued.append(
                asyncio.create_task(gate.run(user, session, message, {"m": message}, body, on_busy="enqueue", on_queued=on_queued))
            )
            await asyncio.wait_for(reported.wait(), JOIN_TIMEOUT_S)
        await holder.complete("msg-1 done")
        await holder.__aexit__(None, None, None)
        results = await asyncio.wait_for(asyncio.gather(*queued), JOIN_TIMEOUT_S)

    assert ran == ["msg-2", "msg-3", "msg-4"]
    assert [positions[m][0] for m in ("msg-2", "msg-3", "msg-4")] == [1, 2, 3]
    assert [(r.state, r.replayed, r.value) for r in results] == [
        ("succeeded", False, "msg-2 done"),
        ("succeeded", False, "msg-3 done"),
        ("succeeded", False, "msg-4 done"),
    ]


def test_supersede_replaces_the_queued_message_which_replays_superseded(server, ids):
    gate = Gate(server.url)
    user, session = ids("u"), ids("s")
    holder = gate.turn(user, session, "msg-1", {}).__enter__()
    queued = threading.Event()
    results: Dict[str, agentgate.TurnResult[str]] = {}

    def send(message: str, policy: str) -> None:
        results[message] = gate.run(
            user, session, message, {}, lambda turn: message, on_busy=policy, on_queued=lambda p: queued.set()
        )

    older = threading.Thread(target=send, args=("msg-2", "enqueue"))
    older.start()
    assert queued.wait(JOIN_TIMEOUT_S)
    queued.clear()
    newer = threading.Thread(target=send, args=("msg-3", "supersede"))
    newer.start()
    assert queued.wait(JOIN_TIMEOUT_S)
    holder.complete("msg-1")
    holder.__exit__(None, None, None)
    older.join(JOIN_TIMEOUT_S)
    newer.join(JOIN_TIMEOUT_S)

    assert (results["msg-2"].state, results["msg-2"].replayed, results["msg-2"].value) == ("superseded", True, None)
    assert (results["msg-3"].state, results["msg-3"].replayed, results["msg-3"].value) == ("succeeded", False, "msg-3")


def test_a_sessions_default_policy_queues_a_message_that_names_none(server, ids):
    gate = Gate(server.url)
    user, session = ids("u"), ids("s")
    policy = gate.set_policy(session, user, "enqueue")
    assert policy["default_policy"] == {"on_busy": "enqueue", "wait_ms": None, "interrupt_running": False}
    with pytest.raises(ValueError):
        gate.set_policy(session, user, "reject", wait_ms=100)
    holder = gate.turn(user, session, "msg-1", {}).__enter__()
    positions: List[int] = []
    finisher = threading.Timer(0.3, lambda: holder.complete("first"))
    finisher.start()
    try:
        # No on_busy: the session's default queues it (202), and it starts
        # once the holder ends.
        assert gate.run_turn(user, session, "msg-2", {}, lambda turn: "second", on_queued=positions.append) == "second"
    finally:
        finisher.join()
        holder.__exit__(None, None, None)
    assert positions == [1]


def test_a_queued_message_whose_wait_runs_out_is_withdrawn(server, ids):
    gate = Gate(server.url)
    user, session = ids("u"), ids("s")
    with gate.turn(user, session, "msg-1", {}) as holder:
        with pytest.raises(agentgate.QueueTimeout) as timed_out:
            gate.run_turn(user, session, "msg-2", {}, _never, wait=0.3, on_busy="enqueue")
        assert timed_out.value.withdrawn and timed_out.value.position == 1
        assert gate.get_turn(timed_out.value.turn_id)["turn"]["state"] == "cancelled"
        assert gate.get_session(session)["session"]["queue"] == []
        holder.complete("first")
    replay = gate.run(user, session, "msg-2", {}, _never)
    assert (replay.state, replay.replayed) == ("cancelled", True)


async def test_async_cancel_of_a_running_turn_cancels_its_body_and_ends_it_cancelled(start_server, ids):
    server = start_server("--lease-ttl-ms", str(INTERRUPT_TTL_MS))
    async with AsyncGate(server.url) as gate:
        started = asyncio.Event()

        async def body(turn: AsyncTurn) -> str:
            turn.partial = "half"
            started.set()
            await asyncio.sleep(MODEL_CALL_S)
            return "whole"

        running = asyncio.create_task(gate.run_turn(ids("u"), ids("s"), "msg-1", {}, body))
        await asyncio.wait_for(started.wait(), JOIN_TIMEOUT_S)
        turn_id = (await gate.get_session(ids("s")))["session"]["holder"]["turn_id"]
        assert (await gate.cancel(turn_id))["turn"]["cancel_requested_at_ms"] > 0
        with pytest.raises(agentgate.TurnCancelled):
            await asyncio.wait_for(running, JOIN_TIMEOUT_S)
        stored = (await gate.get_turn(turn_id))["turn"]
        assert (stored["state"], stored["response"]) == ("cancelled", "half")


def test_TurnCancelled_raised_by_the_body_ends_the_turn_cancelled_not_failed(server, ids):
    gate = Gate(server.url)
    with pytest.raises(agentgate.TurnCancelled):
        with gate.turn(ids("u"), ids("s"), "msg-1", {}) as turn:
            turn.partial = {"so_far": 1}
            raise agentgate.TurnCancelled("the user pressed stop")
    stored = gate.get_turn(turn.turn_id)["turn"]
    assert (stored["state"], stored["response"]) == ("cancelled", {"so_far": 1})
    assert gate.run(ids("u"), ids("s"), "msg-1", {}, _never).state == "cancelled"


async def test_async_a_tool_call_under_way_when_the_interrupt_comes_finishes_and_records_its_result(start_server, ids):
    server = start_server("--lease-ttl-ms", str(INTERRUPT_TTL_MS))
    user, session = ids("u"), ids("s")
    executions: List[str] = []
    booking = asyncio.Event()
    after_tool: List[str] = []

    async def slow_book(ctx: agentgate.ToolContext) -> Dict[str, Any]:
        booking.set()
        await asyncio.sleep(3 * HEARTBEAT_INTERVAL_S)  # the interrupt is learnt meanwhile
        executions.append(ctx.idempotency_key)
        return {"booked": 18}

    async def holder_body(turn: AsyncTurn) -> str:
        entry = await turn.tool("book", {"amount": 18}, run=slow_book)
        after_tool.append(str(entry))
        await asyncio.sleep(MODEL_CALL_S)  # cancelled here, at the first await after the tool
        return "the whole reply"

    async with AsyncGate(server.url) as gate:
        holder = asyncio.create_task(gate.run(user, session, "msg-1", {}, holder_body))
        await asyncio.wait_for(booking.wait(), JOIN_TIMEOUT_S)
        await gate.run(user, session, "msg-2", {}, lambda turn: "second", on_busy="interrupt", wait_ms=10_000)
        first = await asyncio.wait_for(holder, JOIN_TIMEOUT_S)
        record = await gate.get_turn(first.turn_id)

    assert first.state == "cancelled" and record["turn"]["state"] == "cancelled"
    assert after_tool == ["{'booked': 18}"], "the tool call was cut short"
    assert [(e["tool"], e["state"], e["result"]) for e in record["executions"]] == [("book", "succeeded", {"booked": 18})]
    assert len(executions) == 1
