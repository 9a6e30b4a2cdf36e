"""Draining a session through the handoff (``take_next``), against the real
server: queued messages run in order by one worker, each handed off by the
ending before it; senders still waiting for their queued message get the
drained answer as a replay (and those racing the drainer for their own
message run it themselves, each message once, in order); a drain of a
free session claims its head; a
turn asked to stop ends cancelled and the drain goes on; a drainer
SIGKILLed mid-message is finished by a recovery worker, which drains the
rest, every message booked once; a recovery worker stopped (or cancelled)
mid-turn finishes it and takes no next one."""

from __future__ import annotations

import asyncio
import json
import signal
import threading
import time
from pathlib import Path
from typing import Any, Dict, List, Tuple

import httpx
import pytest

import agentgate
from agentgate import AsyncGate, AsyncRecoveryWorker, AsyncTurn, Gate, RecoveryWorker, ToolContext, Turn

from conftest import SHORT_TTL_MS
from test_crash import WORKER_EXIT_TIMEOUT_S, WORKER_SIGNAL_TIMEOUT_S, spawn, wait_for_file

#: Bound on waiting for a thread or task the test started.
JOIN_TIMEOUT_S = 20.0
HANDOFFS = ("agentgate_begins_total", {"outcome": "handoff"})


def enqueue(gate: Gate, user: str, session: str, message: str) -> Dict[str, Any]:
    """Queue ``message`` behind the session's holder, once (no re-send)."""
    body = {
        "user_id": user,
        "session_id": session,
        "client_request_id": message,
        "payload": {"message": message},
        "on_busy": "enqueue",
    }
    status, data = gate.request("POST", "/v1/turns", body)
    assert status == 202, (status, data)
    return dict(data["turn"])


def handoffs(server: Any) -> float:
    return server.metric(HANDOFFS[0], **HANDOFFS[1])


def test_sync_three_queued_messages_are_drained_in_order_by_one_worker_through_the_handoff(server, ids):
    gate = Gate(server.url)
    user, session = ids("u"), ids("s")
    seen: List[Tuple[str, Any, int, bool]] = []
    queued: Dict[str, str] = {}

    def handler(turn: Turn) -> Dict[str, str]:
        seen.append((turn.client_request_id, turn.payload, turn.attempt, turn.takeover))
        if turn.client_request_id == "m1":  # three messages arrive while m1 runs
            for message in ("m2", "m3", "m4"):
                queued[message] = enqueue(gate, user, session, message)["turn_id"]
        return {"done": turn.client_request_id}

    results = gate.drain_turn(gate.turn(user, session, "m1", {"message": "m1"}), handler)

    messages = ["m1", "m2", "m3", "m4"]
    assert seen == [(m, {"message": m}, 1, False) for m in messages]
    assert [(r.state, r.replayed, r.value) for r in results] == [("succeeded", False, {"done": m}) for m in messages]
    assert [r.turn_id for r in results[1:]] == [queued[m] for m in ("m2", "m3", "m4")]
    assert handoffs(server) == 3, "each queued message was started by the ending before it"
    for message, turn_id in queued.items():
        stored = gate.get_turn(turn_id)["turn"]
        assert (stored["state"], stored["response"]) == ("succeeded", {"done": message})
    view = gate.get_session(session)["session"]
    assert (view["holder"], view["queue"]) == (None, [])


async def test_async_three_queued_messages_are_drained_in_order_by_one_worker_through_the_handoff(server, ids):
    user, session = ids("u"), ids("s")
    seen: List[Tuple[str, Any]] = []
    sync_gate = Gate(server.url)

    async def handler(turn: AsyncTurn) -> Dict[str, str]:
        seen.append((turn.client_request_id, turn.payload))
        if turn.client_request_id == "m1":
            for message in ("m2", "m3", "m4"):
                await asyncio.to_thread(enqueue, sync_gate, user, session, message)
        await asyncio.sleep(0)  # a real await in the body
        return {"done": turn.client_request_id}

    async with AsyncGate(server.url) as gate:
        results = await gate.drain_turn(gate.turn(user, session, "m1", {"message": "m1"}), handler)
        view = (await gate.get_session(session))["session"]

    messages = ["m1", "m2", "m3", "m4"]
    assert seen == [(m, {"message": m}) for m in messages]
    assert [(r.state, r.value) for r in results] == [("succeeded", {"done": m}) for m in messages]
    assert handoffs(server) == 3
    assert (view["holder"], view["queue"]) == (None, [])


def senders_and_a_drainer(server: Any, ids: Any, hold_resends: bool) -> Tuple[List[Tuple[str, str]], List[Any], Dict[str, Any]]:
    """Three senders wait in their queue loop (``on_busy="enqueue"``, each
    in a thread) while one drainer drains the session. ``hold_resends``:
    every re-send of a begin (after its first 202) waits until the drain is
    over, so each message surely reaches the drainer first."""
    user, session = ids("u"), ids("s")
    drained_done = threading.Event()
    queued_once: set = set()

    def hold(request: httpx.Request) -> None:
        if request.method == "POST" and request.url.path == "/v1/turns":
            if hold_resends and json.loads(request.content)["client_request_id"] in queued_once:
                assert drained_done.wait(JOIN_TIMEOUT_S)

    def note(response: httpx.Response) -> None:
        if response.status_code == 202:
            queued_once.add(json.loads(response.request.content)["client_request_id"])

    sender_gate = Gate(server.url, http_client=httpx.Client(base_url=server.url, event_hooks={"request": [hold], "response": [note]}))
    gate = Gate(server.url)
    runs: List[Tuple[str, str]] = []
    runs_lock = threading.Lock()
    sent: Dict[str, agentgate.TurnResult[Any]] = {}
    threads: List[threading.Thread] = []

    def body(turn: Turn, by: str) -> Dict[str, str]:
        with runs_lock:
            runs.append((turn.client_request_id, by))
        return {"by": by, "message": turn.client_request_id}

    def send(message: str, queued: threading.Event) -> None:
        sent[message] = sender_gate.run(
            user, session, message, {"message": message}, lambda turn: body(turn, "sender"),
            on_busy="enqueue", on_queued=lambda position: queued.set(),
        )

    def drainer(turn: Turn) -> Dict[str, str]:
        if turn.client_request_id == "m1":
            for message in ("m2", "m3", "m4"):  # one at a time, so the queue's order is known
                queued = threading.Event()
                thread = threading.Thread(target=send, args=(message, queued))
                thread.start()
                threads.append(thread)
                assert queued.wait(JOIN_TIMEOUT_S)
        return body(turn, "drainer")

    drained = gate.drain_turn(gate.turn(user, session, "m1", {"message": "m1"}), drainer)
    drained_done.set()
    for thread in threads:
        thread.join(JOIN_TIMEOUT_S)
    return runs, drained, sent


def test_senders_still_waiting_in_their_queue_loop_get_the_drained_answer_as_a_replay(server, ids):
    runs, drained, sent = senders_and_a_drainer(server, ids, hold_resends=True)
    assert runs == [("m1", "drainer"), ("m2", "drainer"), ("m3", "drainer"), ("m4", "drainer")]
    assert len(drained) == 4
    for message in ("m2", "m3", "m4"):
        outcome = sent[message]
        assert (outcome.state, outcome.replayed, outcome.value) == ("succeeded", True, {"by": "drainer", "message": message})
    assert handoffs(server) == 3


def test_senders_racing_a_drainer_for_their_own_messages_each_runs_once_in_order_and_every_sender_gets_its_outcome(server, ids):
    runs, drained, sent = senders_and_a_drainer(server, ids, hold_resends=False)
    # A sender's re-send that reaches the store during the ending's commit
    # starts its message itself; the handoff then finds it running and hands
    # over nothing (the drain ends), and that sender runs it.
    assert [message for message, _ in runs] == ["m1", "m2", "m3", "m4"]
    by = dict(runs)
    for message in ("m2", "m3", "m4"):
        outcome = sent[message]
        assert (outcome.state, outcome.value) == ("succeeded", {"by": by[message], "message": message})
        assert outcome.replayed == (by[message] == "drainer"), "a drained message's sender got its answer replayed"
    replays = sum(outcome.replayed for outcome in sent.values())
    assert replays == len(drained) - 1 == handoffs(server)
    print(f"handed off to the drainer (and replayed to their senders): {replays} of 3; run by their senders: {3 - replays}")


def test_a_drain_of_a_free_sessions_queue_claims_its_head_and_hands_off_the_rest(server, ids):
    gate = Gate(server.url)
    user, session = ids("u"), ids("s")
    with gate.turn(user, session, "m1", {}) as holder:
        for message in ("m2", "m3", "m4"):
            enqueue(gate, user, session, message)
        assert gate.drain(session, lambda turn: pytest.fail("ran while a live holder has the session")) == []
        holder.complete("m1 done")  # no handoff: the queue waits on a free session
    assert [entry["client_request_id"] for entry in gate.get_session(session)["session"]["queue"]] == ["m2", "m3", "m4"]

    handled: List[str] = []
    results = gate.drain(session, lambda turn: handled.append(turn.client_request_id) or turn.payload, user_id=user)

    assert handled == ["m2", "m3", "m4"]
    assert [r.value for r in results] == [{"message": m} for m in ("m2", "m3", "m4")]
    assert server.metric("agentgate_begins_total", outcome="orphan_claim") == 1, "the head was claimed"
    assert handoffs(server) == 2, "the rest were handed off"
    assert gate.drain(session, lambda turn: pytest.fail("ran with nothing queued")) == []


def test_a_drained_turn_asked_to_stop_ends_cancelled_and_the_drain_goes_on(server, ids):
    gate = Gate(server.url)
    user, session = ids("u"), ids("s")

    def handler(turn: Turn) -> str:
        if turn.client_request_id == "m1":
            enqueue(gate, user, session, "m2")
            enqueue(gate, user, session, "m3")
        if turn.client_request_id == "m2":
            turn.partial = "m2 so far"
            gate.cancel(turn.turn_id)  # a person presses stop
            turn.tool("book", {}, run=lambda ctx: pytest.fail("a tool ran after the stop"))
        return f"{turn.client_request_id} done"

    results = gate.drain_turn(gate.turn(user, session, "m1", {}), handler)

    assert [(r.state, r.value, r.partial) for r in results] == [
        ("succeeded", "m1 done", None),
        ("cancelled", None, "m2 so far"),
        ("succeeded", "m3 done", None),
    ]
    assert handoffs(server) == 2, "the cancelled ending handed off m3"


@pytest.mark.parametrize("use_async", [False, True], ids=["sync", "async"])
def test_a_drainer_SIGKILLed_mid_message_is_finished_by_a_recovery_worker_which_drains_the_rest_each_booked_once(
    start_server, ids, tmp_path: Path, python: str, use_async: bool
):
    server = start_server("--lease-ttl-ms", str(SHORT_TTL_MS))
    gate = Gate(server.url)
    user, session = ids("u"), ids("s")
    drainer = spawn(python, "drain-then-hang", server.url, tmp_path, ids, use_async, "drainer")
    assert wait_for_file(tmp_path / "drainer.signal", drainer, WORKER_SIGNAL_TIMEOUT_S) == "holding"
    for message in ("msg-2", "msg-3", "msg-4"):
        enqueue(gate, user, session, message)
    (tmp_path / "drainer.signal.go").write_text("go")
    assert wait_for_booked(tmp_path / "drainer.signal", drainer) == "booked msg-2"
    drainer.send_signal(signal.SIGKILL)
    drainer.wait(WORKER_EXIT_TIMEOUT_S)
    assert ledger_counts(tmp_path) == {"msg-1": 1, "msg-2": 1}, "msg-1 done, msg-2 booked but not recorded"

    recovered: List[Dict[str, Any]] = []

    def book(ctx: ToolContext) -> Dict[str, Any]:
        with open(tmp_path / "ledger.jsonl", "a") as ledger:
            ledger.write(json.dumps({"key": ctx.idempotency_key, "message": ctx.args["message"]}) + "\n")
        return {"booked": ctx.args["message"]}

    def find(ctx: ToolContext) -> Any:
        for line in (tmp_path / "ledger.jsonl").read_text().splitlines():
            if json.loads(line)["key"] == ctx.idempotency_key:
                return {"booked": ctx.args["message"]}
        return None

    def record(turn: Any, outcomes: List[Any]) -> None:
        recovered.append(
            {"message": turn.client_request_id, "takeover": turn.takeover, "attempt": turn.attempt,
             "journal": [e["outcome"] for e in turn.journal], "outcomes": outcomes}
        )

    def handler(turn: Turn) -> Any:
        outcomes: List[Any] = []

        def reconcile(ctx: ToolContext) -> Any:
            outcomes.append(("reconciled", ctx.previous_outcome))
            return find(ctx)

        def run(ctx: ToolContext) -> Any:
            outcomes.append(("ran", ctx.previous_outcome))
            return book(ctx)

        reply = turn.tool("book", {"message": turn.client_request_id}, run=run, reconcile=reconcile)
        record(turn, outcomes)
        return reply

    async def async_handler(turn: AsyncTurn) -> Any:
        outcomes: List[Any] = []

        async def reconcile(ctx: ToolContext) -> Any:
            outcomes.append(("reconciled", ctx.previous_outcome))
            return find(ctx)

        async def run(ctx: ToolContext) -> Any:
            outcomes.append(("ran", ctx.previous_outcome))
            return book(ctx)

        reply = await turn.tool("book", {"message": turn.client_request_id}, run=run, reconcile=reconcile)
        record(turn, outcomes)
        return reply

    if use_async:

        async def recover() -> Tuple[int, int]:
            async with AsyncGate(server.url) as async_gate:
                worker = AsyncRecoveryWorker(async_gate, async_handler, min_orphaned_ms=0, user_ids=[user])
                ran = await asyncio.wait_for(worker.run(max_turns=3), JOIN_TIMEOUT_S)
                return ran, worker.claims

        ran, claims = asyncio.run(recover())
    else:
        worker = RecoveryWorker(gate, handler, min_orphaned_ms=0, user_ids=[user])
        ran, claims = worker.run(max_turns=3), worker.claims

    assert (ran, claims) == (3, 1), "one claim (the orphan), then two handoffs"
    assert recovered == [
        {"message": "msg-2", "takeover": True, "attempt": 2, "journal": ["unknown"], "outcomes": [("reconciled", "unknown")]},
        {"message": "msg-3", "takeover": False, "attempt": 1, "journal": [], "outcomes": [("ran", None)]},
        {"message": "msg-4", "takeover": False, "attempt": 1, "journal": [], "outcomes": [("ran", None)]},
    ]
    assert ledger_counts(tmp_path) == {"msg-1": 1, "msg-2": 1, "msg-3": 1, "msg-4": 1}, "each message's tool ran once"
    assert handoffs(server) == 3, "msg-1 to msg-2 by the drainer, then msg-3 and msg-4 by the recovery worker"
    view = gate.get_session(session)["session"]
    assert (view["holder"], view["queue"]) == (None, [])


def wait_for_booked(path: Path, process: Any) -> str:
    """The drainer's signal once it moved past "holding"."""
    deadline = time.monotonic() + WORKER_SIGNAL_TIMEOUT_S
    while time.monotonic() < deadline:
        text = wait_for_file(path, process, WORKER_SIGNAL_TIMEOUT_S)
        if text != "holding":
            return text
        time.sleep(0.02)
    pytest.fail("the drainer never booked its second message")


def ledger_counts(tmp: Path) -> Dict[str, int]:
    counts: Dict[str, int] = {}
    ledger = tmp / "ledger.jsonl"
    for line in ledger.read_text().splitlines() if ledger.exists() else []:
        message = json.loads(line)["message"]
        counts[message] = counts.get(message, 0) + 1
    return counts


def free_session_with_queue(gate: Gate, user: str, session: str, messages: List[str]) -> None:
    with gate.turn(user, session, "m0", {}) as holder:
        for message in messages:
            enqueue(gate, user, session, message)
        holder.complete("m0 done")


def test_a_recovery_worker_stopped_mid_turn_finishes_it_and_leaves_the_rest_queued(server, ids):
    gate = Gate(server.url)
    user, session = ids("u"), ids("s")
    free_session_with_queue(gate, user, session, ["m1", "m2", "m3"])
    in_handler, release = threading.Event(), threading.Event()
    handled: List[str] = []

    def handler(turn: Turn) -> str:
        handled.append(turn.client_request_id)
        in_handler.set()
        assert release.wait(JOIN_TIMEOUT_S)
        return f"{turn.client_request_id} done"

    worker = RecoveryWorker(gate, handler, min_orphaned_ms=0, user_ids=[user])
    ran: List[int] = []
    thread = threading.Thread(target=lambda: ran.append(worker.run()))
    thread.start()
    assert in_handler.wait(JOIN_TIMEOUT_S)
    worker.stop()
    release.set()
    thread.join(JOIN_TIMEOUT_S)

    assert not thread.is_alive() and ran == [1] and handled == ["m1"]
    view = gate.get_session(session)["session"]
    assert view["holder"] is None
    assert [entry["client_request_id"] for entry in view["queue"]] == ["m2", "m3"], "no next turn was taken"
    first = gate.run(user, session, "m1", {"message": "m1"}, lambda turn: pytest.fail("m1 ran again"))
    assert (first.state, first.replayed, first.value) == ("succeeded", True, "m1 done")


async def test_async_a_recovery_worker_whose_task_is_cancelled_mid_turn_finishes_it_then_raises_CancelledError(server, ids):
    user, session = ids("u"), ids("s")
    await asyncio.to_thread(free_session_with_queue, Gate(server.url), user, session, ["m1", "m2", "m3"])
    in_handler, release = asyncio.Event(), asyncio.Event()
    handled: List[str] = []

    async def handler(turn: AsyncTurn) -> str:
        handled.append(turn.client_request_id)
        in_handler.set()
        await release.wait()
        return f"{turn.client_request_id} done"

    async with AsyncGate(server.url) as gate:
        worker = AsyncRecoveryWorker(gate, handler, min_orphaned_ms=0, user_ids=[user])
        running = asyncio.create_task(worker.run())
        await asyncio.wait_for(in_handler.wait(), JOIN_TIMEOUT_S)
        running.cancel()
        await asyncio.sleep(0.1)
        assert not running.done(), "run() gave in before the turn in hand finished"
        release.set()
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(running, JOIN_TIMEOUT_S)
        view = (await gate.get_session(session))["session"]
        first = await gate.run(user, session, "m1", {"message": "m1"}, lambda turn: pytest.fail("m1 ran again"))

    assert handled == ["m1"]
    assert (first.state, first.replayed, first.value) == ("succeeded", True, "m1 done")
    assert view["holder"] is None
    assert [entry["client_request_id"] for entry in view["queue"]] == ["m2", "m3"], "no next turn was taken"
