"""Checked by mypy --strict in test_typing.py, never run: what a type
checker sees of the client's public API."""

from __future__ import annotations

from typing import Any, Awaitable, Callable, Optional, assert_type

import agentgate
from agentgate import AsyncGate, AsyncTurn, Gate, ToolContext, Turn

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


def body(turn: Turn) -> int:
    assert_type(turn.lost.is_set(), bool)
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
