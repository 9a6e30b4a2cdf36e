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
import urllib.request
from pathlib import Path
from typing import Dict, Iterator, List

import pytest

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
sys.path.insert(0, str(HERE))
from ledger import Ledger  # noqa: E402

# Bounds on every wait in these tests.
SERVER_START_S = 10.0
WORKER_S = 60.0
MARKER_S = 30.0
# A short lease for the crash tests, so a killed worker's turn is taken over
# within seconds; long enough that a live worker's heartbeats (every third of
# it) survive a loaded machine. The other tests run with the default 30 s.
SHORT_LEASE_TTL_MS = 2000
DEFAULT_LEASE_TTL_MS = 30000


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

    def stop(self) -> None:
        self.process.kill()
        self.process.wait(timeout=10)
        self.log.close()


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
    return subprocess.Popen(
        [sys.executable, str(HERE / script), "--server", server.url, "--ledger", str(ledger),
         "--user", "alice", "--session", "chat-1", "--message-id", message_id, "--text", text, *extra],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=os.environ | (env or {}),
    )


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
    assert again == {"replayed": True, "response": retry["response"]}
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
