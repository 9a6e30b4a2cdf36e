"""The Python framework examples against the real `agentgate serve`: each test
starts the binary on a scratch SQLite store and a free port, runs the
examples as worker processes (as a backend would), and reads the ledger.

    examples/python/test.sh        (or: pytest examples/python)

AGENTGATE_BIN names the binary (default target/debug/agentgate).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional

import pytest

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
sys.path.insert(0, str(HERE))
from ledger import Ledger  # noqa: E402

from agentgate import Gate  # noqa: E402

# Bounds on every wait in these tests, and on each whole test.
TEST_S = 120
SERVER_START_S = 10.0
WORKER_S = 60.0
MARKER_S = 30.0
# A short lease for the crash tests, so a killed worker's turn is taken over
# within seconds; long enough that a live worker's heartbeats (every third of
# it) survive a loaded machine. The other tests run with the default 30 s.
SHORT_LEASE_TTL_MS = 2000
DEFAULT_LEASE_TTL_MS = 30000
# A worker's heartbeat interval on the short-lease server: a third of the TTL.
SHORT_HEARTBEAT_INTERVAL_S = SHORT_LEASE_TTL_MS / 3 / 1000
# The scripted model call a message is inside when another interrupts it.
SLOW_MODEL_CALL_MS = 10000
# Past one heartbeat interval, for the interrupted turn's ending to be
# written: the heartbeat's round trip, LangGraph unwinding, the
# end-cancelled round trip, on a loaded 2-core machine.
STOP_SLACK_S = 0.5


def agentgate_bin() -> str:
    if os.environ.get("AGENTGATE_BIN"):
        return os.environ["AGENTGATE_BIN"]
    target = Path(os.environ.get("CARGO_TARGET_DIR", REPO / "target"))
    return str(target / "debug" / "agentgate")


class Server:
    def __init__(self, tmp: Path, lease_ttl_ms: int) -> None:
        self.log = open(tmp / "server.log", "w+")
        self.process = subprocess.Popen(
            [agentgate_bin(), "serve", "--listen", "127.0.0.1:0", "--no-app",
             "--store", f"sqlite://{tmp / 'gate.db'}", "--lease-ttl-ms", str(lease_ttl_ms)],
            stdout=subprocess.PIPE, stderr=self.log, text=True,
            env={k: v for k, v in os.environ.items() if not k.startswith("AGENTGATE_")} | {"RUST_LOG": "warn"},
        )
        deadline = time.monotonic() + SERVER_START_S
        line = ""
        while time.monotonic() < deadline:
            line = self.process.stdout.readline()
            if line.startswith("listening on ") or self.process.poll() is not None:
                break
        match = re.match(r"listening on (\S+)", line)
        if not match:
            self.stop()
            raise RuntimeError(f"agentgate did not start: {line!r}")
        self.url = f"http://{match.group(1)}"

    def metric(self, name: str) -> float:
        """The sum of a Prometheus counter's series."""
        with urllib.request.urlopen(f"{self.url}/metrics", timeout=5) as response:
            text = response.read().decode()
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith(name) and (line[len(name)] in " {"))

    def turn(self, turn_id: str) -> Dict:
        with urllib.request.urlopen(f"{self.url}/v1/turns/{turn_id}", timeout=5) as response:
            return json.load(response)["turn"]

    def session(self, session_id: str) -> Optional[Dict[str, Any]]:
        """The session's view (``holder``, ``queue``), ``None`` before its first turn."""
        try:
            with urllib.request.urlopen(f"{self.url}/v1/sessions/{session_id}", timeout=5) as response:
                return json.load(response)["session"]
        except urllib.error.HTTPError as error:
            if error.code == 404:
                return None
            raise

    def stop(self) -> None:
        self.process.kill()
        self.process.wait(timeout=10)
        self.log.close()


# The workers a test started; any still running when it ends are killed.
WORKERS: List[subprocess.Popen] = []


@pytest.fixture(autouse=True)
def bounded() -> Iterator[None]:
    """Each test fails after TEST_S (SIGALRM in the main thread, where pytest
    runs it), and leaves no worker behind."""

    def expire(signum: int, frame: Any) -> None:
        pytest.fail(f"the test ran past its {TEST_S} s bound")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.alarm(TEST_S)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
        while WORKERS:
            process = WORKERS.pop()
            if process.poll() is None:
                process.kill()
                process.communicate(timeout=10)


@pytest.fixture
def server(tmp_path: Path) -> Iterator[Server]:
    running = Server(tmp_path, DEFAULT_LEASE_TTL_MS)
    yield running
    running.stop()


@pytest.fixture
def short_lease_server(tmp_path: Path) -> Iterator[Server]:
    running = Server(tmp_path, SHORT_LEASE_TTL_MS)
    yield running
    running.stop()


def worker(script: str, server: Server, ledger: Path, message_id: str, text: str,
           *extra: str, env: Dict[str, str] | None = None) -> subprocess.Popen:
    """One worker process handling one user message with the example."""
    process = subprocess.Popen(
        [sys.executable, str(HERE / script), "--server", server.url, "--ledger", str(ledger),
         "--user", "alice", "--session", "chat-1", "--message-id", message_id, "--text", text, *extra],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=os.environ | (env or {}),
    )
    WORKERS.append(process)
    return process


def outcome(process: subprocess.Popen) -> Dict:
    out, err = process.communicate(timeout=WORKER_S)
    assert process.returncode == 0, f"worker failed ({process.returncode}):\n{err}"
    return json.loads(out.strip().splitlines()[-1])


def wait_for(path: Path, process: subprocess.Popen) -> None:
    deadline = time.monotonic() + MARKER_S
    while not path.exists():
        assert process.poll() is None, f"worker exited before booking: {process.communicate()}"
        assert time.monotonic() < deadline, f"no booking within {MARKER_S} s"
        time.sleep(0.02)


def entries(ledger: Path) -> List:
    return Ledger(ledger).bookings()


# -- LangGraph ----------------------------------------------------------------

def test_langgraph_double_texted_message_books_once_and_the_second_send_gets_the_replay(server, tmp_path):
    ledger = tmp_path / "ledger.db"
    # The same message id sent twice at once (a double click, a retry on a
    # slow network). The model thinks 800 ms per round, so the sends overlap (asserted below).
    first, second = (worker("langgraph_ledger.py", server, ledger, "msg-1", "taxi 18",
                            "--wait", "30", "--think-ms", "800") for _ in range(2))
    results = [outcome(first), outcome(second)]
    assert sorted(r["replayed"] for r in results) == [False, True], results
    assert results[0]["response"] == results[1]["response"], results
    # They did overlap: one begin was refused request_in_flight and waited.
    assert server.metric("agentgate_conflicts_total") >= 1
    booked = entries(ledger)
    assert len(booked) == 1, booked
    assert results[0]["response"]["entries"] == [{"entry_id": booked[0][0], "amount": 18.0, "category": "taxi"}]


def kill_mid_tool(server: Server, tmp_path: Path, ledger: Path, message_id: str) -> None:
    """Start a worker, SIGKILL it after its ledger commit and before the
    tool's completion reaches agentgate; the turn is left an orphan."""
    marker = tmp_path / f"{message_id}.booked"
    doomed = worker("langgraph_ledger.py", server, ledger, message_id, "taxi 18",
                    env={"AGENTGATE_EXAMPLE_PAUSE_AFTER_BOOKING": str(marker)})
    wait_for(marker, doomed)
    doomed.send_signal(signal.SIGKILL)
    doomed.communicate(timeout=WORKER_S)
    assert doomed.returncode == -signal.SIGKILL
    assert len(entries(ledger)) == 1, "the killed worker booked before dying"


def test_langgraph_worker_killed_mid_tool_is_taken_over_and_the_booking_is_reconciled_not_repeated(
    short_lease_server, tmp_path
):
    server = short_lease_server
    ledger = tmp_path / "ledger.db"
    kill_mid_tool(server, tmp_path, ledger, "msg-1")
    unknown_before = server.metric("agentgate_unknown_tool_outcomes_total")

    # The user's retry of the same message, after the dead worker's lease
    # (2 s) runs out: it waits out request_in_flight, takes the turn over,
    # and the tool claim says previous_outcome "unknown"; the reconcile hook
    # finds the booking by its idempotency key.
    retry = outcome(worker("langgraph_ledger.py", server, ledger, "msg-1", "taxi 18", "--wait", "15"))
    assert retry["replayed"] is False and retry["takeover"] is True and retry["attempt"] == 2, retry
    assert server.metric("agentgate_unknown_tool_outcomes_total") == unknown_before + 1
    booked = entries(ledger)
    assert len(booked) == 1, booked
    assert retry["response"]["entries"][0]["entry_id"] == booked[0][0]

    # And from now on the message replays.
    again = outcome(worker("langgraph_ledger.py", server, ledger, "msg-1", "taxi 18"))
    assert (again["replayed"], again["state"], again["response"]) == (True, "succeeded", retry["response"])
    assert len(entries(ledger)) == 1


def test_without_the_reconcile_hook_the_takeover_books_a_second_time(short_lease_server, tmp_path):
    """The control: what the hook prevents is real. Without it the retry runs
    the tool again (agentgate says execute, previous_outcome "unknown") and
    the ledger, which does not deduplicate by itself, has two rows."""
    server = short_lease_server
    ledger = tmp_path / "ledger.db"
    kill_mid_tool(server, tmp_path, ledger, "msg-1")
    retry = outcome(worker("langgraph_ledger.py", server, ledger, "msg-1", "taxi 18",
                           "--wait", "15", "--no-reconcile"))
    assert retry["takeover"] is True, retry
    assert len(entries(ledger)) == 2


# -- LangGraph: a second message to a busy conversation -----------------------

def wait_until(what: str, probe, *processes: subprocess.Popen):
    """Poll ``probe()`` until it answers something truthy (bounded by MARKER_S);
    fails early if one of ``processes`` exits meanwhile."""
    deadline = time.monotonic() + MARKER_S
    while True:
        found = probe()
        if found:
            return found
        for process in processes:
            assert process.poll() is None, f"a worker exited while waiting for {what}: {process.communicate()}"
        assert time.monotonic() < deadline, f"no {what} within {MARKER_S} s"
        time.sleep(0.02)


def test_langgraph_interrupt_stops_the_first_message_within_a_heartbeat_ends_it_cancelled_and_books_once(
    short_lease_server, tmp_path
):
    """A message inside a 10 s model call; a second message to the same
    conversation with --on-busy interrupt. The first stops within one
    heartbeat interval of the interrupt and ends cancelled having booked
    nothing; the second runs and books once; the first message's retry
    replays cancelled and books nothing."""
    server = short_lease_server
    ledger = tmp_path / "ledger.db"
    first = worker("langgraph_ledger.py", server, ledger, "msg-1", "lunch 35", "--think-ms", str(SLOW_MODEL_CALL_MS))
    session = wait_until("running first message", lambda: (server.session("chat-1") or {}).get("holder"), first)
    first_turn = session["turn_id"]

    second = outcome(worker("langgraph_ledger.py", server, ledger, "msg-2", "taxi 28",
                            "--on-busy", "interrupt", "--wait-ms", "10000"))
    interrupted = outcome(first)

    # The first stopped inside its model call, within a heartbeat interval
    # of the interrupt (store-clock times of the cancel request and of the
    # cancelled ending), long before the 10 s call would have returned.
    stored = server.turn(first_turn)
    assert stored["state"] == "cancelled", stored
    stopped_after_s = (stored["updated_at_ms"] - stored["cancel_requested_at_ms"]) / 1000
    assert stopped_after_s < SHORT_HEARTBEAT_INTERVAL_S + STOP_SLACK_S, stored
    assert (stored["updated_at_ms"] - stored["created_at_ms"]) < SLOW_MODEL_CALL_MS, stored
    assert interrupted == {"replayed": False, "state": "cancelled", "turn_id": first_turn,
                           "partial": {"entries": []}, "takeover": False, "attempt": 1, "queued_at": []}

    # The second ran (attempt 1, not queued) and booked once.
    assert (second["replayed"], second["state"], second["attempt"]) == (False, "succeeded", 1), second
    booked = entries(ledger)
    assert len(booked) == 1 and booked[0][2:] == (28.0, "taxi"), booked
    assert second["response"]["entries"] == [{"entry_id": booked[0][0], "amount": 28.0, "category": "taxi"}]

    # The first message's retry replays cancelled: the graph does not run again.
    retry = outcome(worker("langgraph_ledger.py", server, ledger, "msg-1", "lunch 35"))
    assert retry == {"replayed": True, "state": "cancelled", "turn_id": first_turn, "partial": {"entries": []}}
    assert entries(ledger) == booked


def full_queue(server: Server, length: int) -> Optional[List[Dict[str, Any]]]:
    queue = server.session("chat-1")["queue"]
    return queue if len(queue) == length else None


def test_langgraph_three_enqueued_messages_to_a_busy_conversation_all_complete_in_order_each_booking_once(
    server, tmp_path
):
    """The conversation is busy (the test holds msg-1's turn); three messages
    sent at once with --on-busy enqueue are queued, nothing runs while it is
    busy, then each runs in its queue order and books once."""
    ledger = tmp_path / "ledger.db"
    texts = {"msg-2": "taxi 11", "msg-3": "lunch 12", "msg-4": "hotel 13"}
    with Gate(server.url) as gate:
        holder = gate.turn("alice", "chat-1", "msg-1", {"text": "coffee 4"}).__enter__()
        queued = {m: worker("langgraph_ledger.py", server, ledger, m, text, "--on-busy", "enqueue", "--wait", "60")
                  for m, text in texts.items()}
        queue = wait_until("three queued messages", lambda: full_queue(server, 3), *queued.values())
        order = [q["client_request_id"] for q in sorted(queue, key=lambda q: q["position"])]
        assert sorted(order) == sorted(texts), queue
        assert entries(ledger) == [], "a queued message ran while the conversation was busy"
        holder.complete({"text": "coffee booked elsewhere"})
        holder.__exit__(None, None, None)
        results = {m: outcome(process) for m, process in queued.items()}

    for position, message in enumerate(order, start=1):
        result = results[message]
        assert (result["replayed"], result["state"], result["attempt"]) == (False, "succeeded", 1), result
        assert result["queued_at"][0] == position, (message, result)
    # In order: the ledger's rows, oldest first, are the queue's messages.
    booked = entries(ledger)
    assert [(row[2], row[3]) for row in booked] == [
        (float(texts[m].split()[1]), texts[m].split()[0]) for m in order
    ], (order, booked)
    assert len({row[1] for row in booked}) == 3, "two bookings under one idempotency key"
    for message, row in zip(order, booked):
        assert results[message]["response"]["entries"] == [
            {"entry_id": row[0], "amount": row[2], "category": row[3]}
        ]


# -- OpenAI Agents SDK --------------------------------------------------------

def test_openai_agents_runs_once_and_the_repeat_replays_with_one_booking(server, tmp_path):
    ledger = tmp_path / "ledger.db"
    first = outcome(worker("openai_agents_ledger.py", server, ledger, "msg-1", "lunch 35"))
    assert first["replayed"] is False, first
    booked = entries(ledger)
    assert len(booked) == 1 and booked[0][2:] == (35.0, "lunch"), booked
    assert first["response"] == {"text": f"Booked 35 to lunch (entry {booked[0][0]})."}

    repeat = outcome(worker("openai_agents_ledger.py", server, ledger, "msg-1", "lunch 35"))
    assert repeat == {"replayed": True, "response": first["response"]}
    assert entries(ledger) == booked

    # Another message is another turn, and books.
    other = outcome(worker("openai_agents_ledger.py", server, ledger, "msg-2", "taxi 12"))
    assert other["replayed"] is False
    assert len(entries(ledger)) == 2
