"""A worker process for the crash tests: it runs one turn through the
client, against a ledger file that stands for the downstream system a tool
books into (one JSON line per booking, carrying the idempotency key).

    python worker.py MODE --url URL --user U --session S --request R
                     --ledger PATH --signal PATH --report PATH [--async]

Modes:
  book-then-hang   book (the effect hits the ledger), signal "booked", then
                   hang before completing the tool call (the test SIGKILLs it)
  resume           repeat the same begin (waiting out the dead lease), book
                   with a reconcile hook that looks the key up in the ledger
  claim-then-wait  claim the tool, signal "claimed", wait in the tool for the
                   lease (the test SIGSTOPs it past the TTL); write a report
                   of what happened once interrupted
  drain-then-hang  begin REQUEST, signal "holding", wait for SIGNAL.go (the
                   test queues messages behind it meanwhile), then drain the
                   session through the handoff, booking one ledger line per
                   message; in the second message, after its booking,
                   signal "booked <request>" and hang before the tool's
                   result is recorded (the test SIGKILLs it)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import time
from typing import Any, Dict, List, Optional

import agentgate
from agentgate import AsyncGate, AsyncTurn, Gate, ToolContext, Turn

#: How long a worker hangs or waits before giving up on being killed,
#: stopped or interrupted (the test's own bounds are shorter).
HANG_S = 60.0
#: How long ``resume`` repeats its begin while the dead holder's lease runs out.
RESUME_WAIT_S = 20.0


def book(ledger: str, ctx: ToolContext) -> Dict[str, Any]:
    line = json.dumps({"key": ctx.idempotency_key, "amount": ctx.args["amount"], "pid": os.getpid()})
    fd = os.open(ledger, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, (line + "\n").encode())
        os.fsync(fd)
    finally:
        os.close(fd)
    return {"booked": ctx.idempotency_key}


def find(ledger: str, key: str) -> Optional[Dict[str, Any]]:
    if not os.path.exists(ledger):
        return None
    with open(ledger) as lines:
        for line in lines:
            if json.loads(line)["key"] == key:
                return {"booked": key}
    return None


def book_message(ledger: str, ctx: ToolContext) -> Dict[str, Any]:
    """One booking of a drained message: a ledger line naming it."""
    line = json.dumps({"key": ctx.idempotency_key, "message": ctx.args["message"], "pid": os.getpid()})
    fd = os.open(ledger, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, (line + "\n").encode())
        os.fsync(fd)
    finally:
        os.close(fd)
    return {"booked": ctx.args["message"]}


def wait_for(path: str) -> None:
    deadline = time.monotonic() + HANG_S
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise TimeoutError(f"no {path} within {HANG_S} s")
        time.sleep(0.01)


def signal(path: str, what: str) -> None:
    with open(path + ".tmp", "w") as out:
        out.write(what)
    os.replace(path + ".tmp", path)


def report(path: str, what: Dict[str, Any]) -> None:
    with open(path + ".tmp", "w") as out:
        json.dump(what, out)
    os.replace(path + ".tmp", path)


ARGS = {"amount": 18, "category": "taxi"}


def run_sync(a: argparse.Namespace) -> None:
    gate = Gate(a.url)
    payload = {"text": "taxi 18"}
    if a.mode == "drain-then-hang":
        drain_sync(a, gate)
    elif a.mode == "book-then-hang":
        with gate.turn(a.user, a.session, a.request, payload) as turn:

            def effect_then_hang(ctx: ToolContext) -> Any:
                book(a.ledger, ctx)
                signal(a.signal, "booked")
                time.sleep(HANG_S)
                return None

            turn.tool("book", ARGS, run=effect_then_hang)
    elif a.mode == "resume":
        seen: Dict[str, Any] = {"ran": 0, "reconciled": 0}

        def reconcile(ctx: ToolContext) -> Any:
            seen["reconciled"] += 1
            seen["previous_outcome"] = ctx.previous_outcome
            return find(a.ledger, ctx.idempotency_key)

        def run(ctx: ToolContext) -> Any:
            seen["ran"] += 1
            seen["previous_outcome"] = ctx.previous_outcome
            return book(a.ledger, ctx)

        with gate.turn(a.user, a.session, a.request, payload, wait=RESUME_WAIT_S) as turn:
            result = turn.tool("book", ARGS, run=run, reconcile=reconcile)
            turn.complete({"text": "booked", "result": result})
        report(a.report, {**seen, "takeover": turn.takeover, "attempt": turn.attempt, "fence": turn.fence})
    elif a.mode == "claim-then-wait":
        state: Dict[str, Any] = {"interrupted": None, "effect_taken": False}
        turn = gate.turn(a.user, a.session, a.request, payload)

        def wait_for_lease(ctx: ToolContext) -> Any:
            state["execution_id"] = ctx.execution_id
            signal(a.signal, "claimed")
            turn.lost.wait(HANG_S)
            ctx.check()  # raises LeaseLost once the heartbeat learnt it
            state["effect_taken"] = True
            return book(a.ledger, ctx)

        try:
            with turn:
                turn.tool("book", ARGS, run=wait_for_lease)
                turn.complete("worker A finished")
        except agentgate.LeaseLost as lost:
            state["interrupted"] = type(lost).__name__
        # What the interrupted worker tries next, and who refuses it.
        known = turn.lost_error
        state["heartbeat_refusal"] = None if known is None else {"status": known.status, "code": known.code}
        try:
            turn.complete("worker A late reply")
            state["local_refusal"] = None
        except agentgate.LeaseLost as refused:
            state["local_refusal"] = {"status": refused.status, "code": refused.code}
        state["server_refusals"] = []
        for path, body in late_writes(turn.turn_id, state.get("execution_id")):
            try:
                gate.request("POST", path, body, lease_token=turn.lease_token)
                state["server_refusals"].append(None)
            except agentgate.AgentgateError as refused:
                state["server_refusals"].append({"status": refused.status, "code": refused.code})
        report(a.report, state)


def drain_sync(a: argparse.Namespace, gate: Gate) -> None:
    handled: List[str] = []

    def handler(turn: Turn) -> Dict[str, Any]:
        handled.append(turn.client_request_id)
        if len(handled) == 1:
            signal(a.signal, "holding")
            wait_for(a.signal + ".go")

        def run(ctx: ToolContext) -> Dict[str, Any]:
            booked = book_message(a.ledger, ctx)
            if len(handled) == 2:
                signal(a.signal, "booked " + turn.client_request_id)
                time.sleep(HANG_S)
            return booked

        return {"reply": turn.tool("book", {"message": turn.client_request_id}, run=run)}

    gate.drain_turn(gate.turn(a.user, a.session, a.request, {"message": a.request}), handler)


async def drain_async(a: argparse.Namespace, gate: AsyncGate) -> None:
    handled: List[str] = []

    async def handler(turn: AsyncTurn) -> Dict[str, Any]:
        handled.append(turn.client_request_id)
        if len(handled) == 1:
            signal(a.signal, "holding")
            await asyncio.to_thread(wait_for, a.signal + ".go")

        async def run(ctx: ToolContext) -> Dict[str, Any]:
            booked = book_message(a.ledger, ctx)
            if len(handled) == 2:
                signal(a.signal, "booked " + turn.client_request_id)
                await asyncio.sleep(HANG_S)
            return booked

        return {"reply": await turn.tool("book", {"message": turn.client_request_id}, run=run)}

    await gate.drain_turn(gate.turn(a.user, a.session, a.request, {"message": a.request}), handler)


def late_writes(turn_id: str, execution_id: Any) -> Any:
    """The writes a worker that lost its lease would still send, raw,
    bypassing the client's own refusal, so the server's answer shows."""
    return (
        (f"/v1/turns/{turn_id}/tools/{execution_id}/complete", {"result": "late"}),
        (f"/v1/turns/{turn_id}/complete", {"response": "worker A late reply"}),
    )


async def run_async(a: argparse.Namespace) -> None:
    gate = AsyncGate(a.url)
    payload = {"text": "taxi 18"}
    if a.mode == "drain-then-hang":
        await drain_async(a, gate)
    elif a.mode == "book-then-hang":
        async with gate.turn(a.user, a.session, a.request, payload) as turn:

            async def effect_then_hang(ctx: ToolContext) -> Any:
                book(a.ledger, ctx)
                signal(a.signal, "booked")
                await asyncio.sleep(HANG_S)

            await turn.tool("book", ARGS, run=effect_then_hang)
    elif a.mode == "resume":
        seen: Dict[str, Any] = {"ran": 0, "reconciled": 0}

        async def reconcile(ctx: ToolContext) -> Any:
            seen["reconciled"] += 1
            seen["previous_outcome"] = ctx.previous_outcome
            return find(a.ledger, ctx.idempotency_key)

        async def run(ctx: ToolContext) -> Any:
            seen["ran"] += 1
            seen["previous_outcome"] = ctx.previous_outcome
            return book(a.ledger, ctx)

        async with gate.turn(a.user, a.session, a.request, payload, wait=RESUME_WAIT_S) as turn:
            result = await turn.tool("book", ARGS, run=run, reconcile=reconcile)
            await turn.complete({"text": "booked", "result": result})
        report(a.report, {**seen, "takeover": turn.takeover, "attempt": turn.attempt, "fence": turn.fence})
    elif a.mode == "claim-then-wait":
        state: Dict[str, Any] = {"interrupted": None, "effect_taken": False}
        turn = gate.turn(a.user, a.session, a.request, payload)

        async def wait_in_the_tool(ctx: ToolContext) -> Any:
            state["execution_id"] = ctx.execution_id
            signal(a.signal, "claimed")
            await asyncio.sleep(HANG_S)  # no cooperation: the body is cancelled
            state["effect_taken"] = True
            return book(a.ledger, ctx)

        started = time.monotonic()
        try:
            async with turn:
                await turn.tool("book", ARGS, run=wait_in_the_tool)
                await turn.complete("worker A finished")
        except agentgate.LeaseLost as lost:
            state["interrupted"] = type(lost).__name__
        state["body_s"] = time.monotonic() - started
        known = turn.lost_error
        state["heartbeat_refusal"] = None if known is None else {"status": known.status, "code": known.code}
        try:
            await turn.complete("worker A late reply")
            state["local_refusal"] = None
        except agentgate.LeaseLost as refused:
            state["local_refusal"] = {"status": refused.status, "code": refused.code}
        state["server_refusals"] = []
        for path, body in late_writes(turn.turn_id, state.get("execution_id")):
            try:
                await gate.request("POST", path, body, lease_token=turn.lease_token)
                state["server_refusals"].append(None)
            except agentgate.AgentgateError as refused:
                state["server_refusals"].append({"status": refused.status, "code": refused.code})
        report(a.report, state)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=["book-then-hang", "resume", "claim-then-wait", "drain-then-hang"])
    for name in ("url", "user", "session", "request", "ledger", "signal", "report"):
        parser.add_argument(f"--{name}", required=True)
    parser.add_argument("--async", dest="use_async", action="store_true")
    a = parser.parse_args()
    if a.use_async:
        asyncio.run(run_async(a))
    else:
        run_sync(a)


if __name__ == "__main__":
    main()
