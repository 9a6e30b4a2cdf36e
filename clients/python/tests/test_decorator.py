"""``@gate.tool`` on plain functions: argument binding, the context, and
50 concurrent callers of the same call in one turn (threads; asyncio
tasks) with one execution."""

from __future__ import annotations

import asyncio
import contextvars
import threading
import time

import pytest

import agentgate
from agentgate import AsyncGate, Gate, ToolContext

from conftest import SHORT_TTL_MS

#: Concurrent callers of one tool call.
CALLERS = 50
#: How long the one execution holds the call, so the others arrive while
#: it is in flight and meet ``tool_in_flight``.
EXECUTION_S = 0.3
#: Bound on each thread's join.
JOIN_TIMEOUT_S = 30.0


def test_decorated_function_books_once_under_50_concurrent_threads(server, ids):
    gate = Gate(server.url)
    executions = []
    lock = threading.Lock()

    @gate.tool
    def create_transaction(ctx: ToolContext, amount: int, category: str = "taxi"):
        with lock:
            executions.append(ctx.idempotency_key)
        time.sleep(EXECUTION_S)
        return {"entry": 42, "key": ctx.idempotency_key}

    results = [None] * CALLERS
    errors = []
    barrier = threading.Barrier(CALLERS)
    in_flight_before = server.metric("agentgate_conflicts_total", code="tool_in_flight")

    def caller(i):
        try:
            barrier.wait(JOIN_TIMEOUT_S)
            results[i] = create_transaction(amount=18)
        except BaseException as error:  # reported below
            errors.append(error)

    with gate.turn(ids("u"), ids("s"), "msg-1", {}) as turn:
        threads = [
            threading.Thread(target=contextvars.copy_context().run, args=(caller, i)) for i in range(CALLERS)
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(JOIN_TIMEOUT_S)
        turn.complete(results[0])
    assert not errors, errors[:3]
    assert len(executions) == 1, f"ran {len(executions)} times"
    assert results == [{"entry": 42, "key": executions[0]}] * CALLERS
    in_flight_after = server.metric("agentgate_conflicts_total", code="tool_in_flight")
    assert in_flight_after > in_flight_before, "the callers never overlapped at the server"


async def test_decorated_coroutine_books_once_under_50_concurrent_tasks(server, ids):
    gate = AsyncGate(server.url)
    executions = []

    @gate.tool(name="create_transaction")
    async def book(ctx: ToolContext, amount: int):
        executions.append(ctx.idempotency_key)
        await asyncio.sleep(EXECUTION_S)
        return {"entry": 7, "key": ctx.idempotency_key}

    async with gate.turn(ids("u"), ids("s"), "msg-1", {}) as turn:
        results = await asyncio.gather(*[book(18) for _ in range(CALLERS)])
        await turn.complete(results[0])
    assert len(executions) == 1, f"ran {len(executions)} times"
    assert results == [{"entry": 7, "key": executions[0]}] * CALLERS
    executions_page = (await gate.get_turn(turn.turn_id))["executions"]
    assert [e["tool"] for e in executions_page] == ["create_transaction"]
    await gate.aclose()


def test_decorator_binds_positional_keyword_and_default_args_to_one_call(server, ids):
    gate = Gate(server.url)
    calls = []

    @gate.tool(name="send_email")
    def send(to, subject="hi"):
        calls.append((to, subject))
        return len(calls)

    with gate.turn(ids("u"), ids("s"), "msg-1", {}) as turn:
        assert send("nora") == 1
        assert send(to="nora", subject="hi") == 1  # the same call: the stored result
        assert send("nora", "other") == 2
        turn.complete("ok")
    assert calls == [("nora", "hi"), ("nora", "other")]
    state = gate.get_turn(turn.turn_id)
    assert sorted(e["tool"] for e in state["executions"]) == ["send_email", "send_email"]


def test_decorated_function_outside_a_turn_raises_NoActiveTurn(server):
    gate = Gate(server.url)

    @gate.tool
    def book(amount):
        pytest.fail("ran outside a turn")

    with pytest.raises(agentgate.NoActiveTurn):
        book(1)


def test_decorator_reconcile_hook_settles_an_unknown_outcome(start_server, ids):
    server = start_server("--lease-ttl-ms", str(SHORT_TTL_MS))
    gate = Gate(server.url)
    downstream = {}
    looked_up, charged = [], []

    def lookup(ctx):
        looked_up.append(ctx.previous_outcome)
        return downstream.get(ctx.idempotency_key)

    @gate.tool(reconcile=lookup)
    def charge(ctx, amount):
        charged.append(amount)
        downstream[ctx.idempotency_key] = {"charged": amount}
        return downstream[ctx.idempotency_key]

    # A holder that dies mid-call: it claimed and charged, and never said so.
    _, begun = gate.request(
        "POST", "/v1/turns", {"user_id": ids("u"), "session_id": ids("s"), "client_request_id": "m", "payload": {}}
    )
    grant = begun["turn"]
    _, claim = gate.request(
        "POST", f"/v1/turns/{grant['turn_id']}/tools", {"tool": "charge", "args": {"amount": 5}},
        lease_token=grant["lease_token"],
    )
    downstream[claim["execution"]["idempotency_key"]] = {"charged": 5}

    with gate.turn(ids("u"), ids("s"), "m", {}, wait=5.0) as turn:
        assert turn.takeover
        assert charge(5) == {"charged": 5}
        turn.complete("ok")
    assert looked_up == ["unknown"]
    assert charged == [], "charged again although the hook found the charge"


def test_decorated_function_shows_its_tool_args_without_ctx_to_introspection(server):
    import inspect
    import typing

    gate = Gate(server.url)

    @gate.tool
    def create_transaction(ctx: ToolContext, amount: int, category: str = "taxi") -> dict:
        """Book an entry."""
        return {}

    assert list(inspect.signature(create_transaction).parameters) == ["amount", "category"]
    assert typing.get_type_hints(create_transaction) == {"amount": int, "category": str, "return": dict}
    assert create_transaction.__name__ == "create_transaction"
    assert create_transaction.__doc__ == "Book an entry."
