"""Worker processes that die or freeze mid-tool, against the real server:
SIGKILL then takeover with the ``unknown`` outcome reconciled from the
ledger; SIGSTOP past the TTL, takeover, SIGCONT and the interrupted body
whose late writes the server refuses. Each runs with the sync and the
asyncio client in the worker."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Any, Dict, List

import pytest

import agentgate
from agentgate import Gate

from conftest import SHORT_TTL_MS as LEASE_TTL_MS, TTL_MARGIN_S, WORKER

#: How long a worker may take to reach the point the test waits for.
WORKER_SIGNAL_TIMEOUT_S = 20.0
#: How long a worker may take to finish once released.
WORKER_EXIT_TIMEOUT_S = 30.0


def spawn(python: str, mode: str, server_url: str, tmp: Path, ids, use_async: bool, tag: str) -> "subprocess.Popen[bytes]":
    command = [
        python,
        str(WORKER),
        mode,
        "--url", server_url,
        "--user", ids("u"),
        "--session", ids("s"),
        "--request", "msg-1",
        "--ledger", str(tmp / "ledger.jsonl"),
        "--signal", str(tmp / f"{tag}.signal"),
        "--report", str(tmp / f"{tag}.report.json"),
    ]
    if use_async:
        command.append("--async")
    return subprocess.Popen(command, stdout=open(tmp / f"{tag}.out", "w"), stderr=subprocess.STDOUT)


def wait_for_file(path: Path, process: "subprocess.Popen[bytes]", timeout_s: float) -> str:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if path.exists():
            return path.read_text()
        if process.poll() is not None:
            break
        time.sleep(0.02)
    out = path.with_name(path.name.split(".")[0] + ".out")
    pytest.fail(f"worker never wrote {path.name} (exit {process.poll()}): {out.read_text() if out.exists() else ''}")


def finish(process: "subprocess.Popen[bytes]", tmp: Path, tag: str) -> Dict[str, Any]:
    try:
        code = process.wait(WORKER_EXIT_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        process.kill()
        pytest.fail(f"worker {tag} did not finish within {WORKER_EXIT_TIMEOUT_S} s")
    report = tmp / f"{tag}.report.json"
    assert report.exists(), f"worker {tag} exited {code} without a report: {(tmp / f'{tag}.out').read_text()}"
    return json.loads(report.read_text())


def bookings(tmp: Path) -> List[Dict[str, Any]]:
    ledger = tmp / "ledger.jsonl"
    return [json.loads(line) for line in ledger.read_text().splitlines()] if ledger.exists() else []


@pytest.mark.parametrize("use_async", [False, True], ids=["sync", "async"])
def test_worker_killed_mid_tool_is_taken_over_and_the_unknown_outcome_is_reconciled_from_the_ledger_booking_once(
    start_server, ids, tmp_path, python, use_async
):
    server = start_server("--lease-ttl-ms", str(LEASE_TTL_MS))
    first = spawn(python, "book-then-hang", server.url, tmp_path, ids, use_async, "first")
    assert wait_for_file(tmp_path / "first.signal", first, WORKER_SIGNAL_TIMEOUT_S) == "booked"
    first.send_signal(signal.SIGKILL)
    first.wait(WORKER_EXIT_TIMEOUT_S)
    assert len(bookings(tmp_path)) == 1, "the killed worker's effect did not hit the ledger"

    second = spawn(python, "resume", server.url, tmp_path, ids, use_async, "second")
    resumed = finish(second, tmp_path, "second")
    assert resumed["takeover"] is True and resumed["attempt"] == 2
    assert resumed["previous_outcome"] == "unknown"
    assert resumed["reconciled"] == 1 and resumed["ran"] == 0, "the hook did not settle it, or the tool ran again"
    booked = bookings(tmp_path)
    assert len(booked) == 1, f"booked {len(booked)} times: {booked}"

    gate = Gate(server.url)
    turn = gate.get_turn(gate.run_turn(ids("u"), ids("s"), "msg-2", {}, lambda t: t.turn_id))  # session released
    assert turn["turn"]["state"] == "succeeded"
    with pytest.raises(agentgate.Replayed) as replay:
        gate.turn(ids("u"), ids("s"), "msg-1", {"text": "taxi 18"}).__enter__()
    assert replay.value.response == {"text": "booked", "result": {"booked": booked[0]["key"]}}


@pytest.mark.parametrize("use_async", [False, True], ids=["sync", "async"])
def test_lease_lost_while_the_body_runs_interrupts_it_and_the_server_refuses_its_later_writes(
    start_server, ids, tmp_path, python, use_async
):
    server = start_server("--lease-ttl-ms", str(LEASE_TTL_MS))
    frozen = spawn(python, "claim-then-wait", server.url, tmp_path, ids, use_async, "frozen")
    assert wait_for_file(tmp_path / "frozen.signal", frozen, WORKER_SIGNAL_TIMEOUT_S) == "claimed"
    frozen.send_signal(signal.SIGSTOP)
    try:
        time.sleep(LEASE_TTL_MS / 1000 + TTL_MARGIN_S)
        gate = Gate(server.url)
        ran = []

        def book(ctx):
            ran.append(ctx.previous_outcome)
            with open(tmp_path / "ledger.jsonl", "a") as ledger:
                ledger.write(json.dumps({"key": ctx.idempotency_key, "amount": 18, "pid": os.getpid()}) + "\n")
            return {"booked": ctx.idempotency_key}

        with gate.turn(ids("u"), ids("s"), "msg-1", {"text": "taxi 18"}, wait=5.0) as taker:
            assert taker.takeover and taker.attempt == 2
            result = taker.tool("book", {"amount": 18, "category": "taxi"}, run=book, reconcile=lambda ctx: None)
            taker.complete({"text": "booked by the taker", "result": result})
        assert ran == ["unknown"]
    finally:
        frozen.send_signal(signal.SIGCONT)

    state = finish(frozen, tmp_path, "frozen")
    assert state["interrupted"] == "LeaseLost", state
    assert state["effect_taken"] is False, "the interrupted body went on to take its effect"
    assert state["heartbeat_refusal"] == {"status": 409, "code": "lease_lost"}, "the server did not refuse the heartbeat"
    assert state["local_refusal"]["code"] == "lease_lost"
    assert state["server_refusals"] == [{"status": 409, "code": "lease_lost"}] * 2, state
    if use_async:
        assert state["body_s"] < 20, "the body was not cancelled"
    assert len(bookings(tmp_path)) == 1
    final = Gate(server.url).get_turn(taker.turn_id)
    assert final["turn"]["response"]["text"] == "booked by the taker"
    assert final["turn"]["fence"] == taker.fence
