"""Checked by mypy --strict in test_typing.py, never run: what a type
checker sees of the client's public API."""

from __future__ import annotations

from typing import Any, Awaitable, Callable, Dict, List, Optional, assert_type

import agentgate
from agentgate import AsyncGate, AsyncTurn, Gate, ToolContext, Turn, TurnResult

gate = Gate("http://127.0.0.1:7700")
async_gate = AsyncGate("http://127.0.0.1:7700")


@gate.tool
def with_context(ctx: ToolContext, amount: int, note: str = "") -> str:
    return ctx.idempotency_key


@gate.tool(name="renamed", reconcile=lambda ctx: None)
def without_context(amount: int) -> float:
    return amount * 1.0


@async_gate.tool
async def async_with_context(ctx: ToolContext, amount: int) -> int:
    return amount


# The decorated functions are called without ctx (assignable only then).
called_with_context: Callable[[int, str], str] = with_context
called_without_context: Callable[[int], float] = without_context
called_async: Callable[[int], Awaitable[int]] = async_with_context
assert_type(with_context(1), str)
assert_type(with_context(amount=1, note="x"), str)


# Types that contain Any keep their shape (an overloaded decorator made
# these ``def (*Any, **Any) -> Any``).
@gate.tool
def any_result(ctx: ToolContext, amount: int) -> Dict[str, Any]:
    return {"key": ctx.idempotency_key}


@gate.tool
def any_argument(ctx: ToolContext, rows: List[Any]) -> int:
    return len(rows)


@async_gate.tool
async def async_any_result(ctx: ToolContext, amount: int) -> Dict[str, Any]:
    return {}


assert_type(any_result(1), Dict[str, Any])
assert_type(any_argument([1, "x"]), int)
called_any: Callable[[int], Dict[str, Any]] = any_result


def run_results(turn_body: Callable[[Turn], int]) -> None:
    result = gate.run("u", "s", "m", {}, turn_body, on_busy="enqueue", on_queued=lambda position: None)
    assert_type(result, TurnResult[int])
    assert_type(result.value, Optional[int])
    assert_type(result.replayed, bool)
    assert_type(result.state, str)
    assert_type(gate.run_turn("u", "s", "m", {}, turn_body, on_busy="interrupt", wait_ms=5000), int)


async def async_run_results() -> None:
    async def turn_body(turn: AsyncTurn) -> int:
        turn.check_cancelled()
        return 1

    assert_type(await async_any_result(1), Dict[str, Any])
    assert_type(await async_gate.run("u", "s", "m", {}, turn_body), TurnResult[int])
    assert_type(await async_gate.run_turn("u", "s", "m", {}, turn_body), int)
    assert_type(await async_gate.run_turn("u", "s", "m", {}, lambda turn: "plain"), str)


def body(turn: Turn) -> int:
    assert_type(turn.lost.is_set(), bool)
    assert_type(turn.cancelled.is_set(), bool)
    turn.sleep(0.1)
    turn.partial = {"text": "so far"}
    assert_type(turn.takeover, bool)
    assert_type(turn.fence, int)
    result: str = turn.tool("book", {"amount": 1}, run=lambda ctx: ctx.idempotency_key)
    turn.complete({"result": result})
    return turn.attempt


def errors(error: agentgate.AgentgateError) -> Optional[int]:
    assert_type(error.code, str)
    assert_type(error.status, Optional[int])
    assert_type(error.active_turn_id, Optional[str])
    return error.retry_after_ms


async def async_body(turn: AsyncTurn) -> Any:
    orphan = await async_gate.claim_orphan(min_orphaned_ms=5000)
    assert_type(orphan, Optional[AsyncTurn])
    return await turn.tool("book", {}, run=lambda ctx: None)
