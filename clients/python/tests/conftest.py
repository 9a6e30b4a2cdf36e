"""Fixtures: the real ``agentgate serve`` binary on a temp SQLite store and
a free port, one server per test (it starts in well under a second), so a
test's flags (``--lease-ttl-ms``, ``--max-turns-per-user``) are its own.

With ``AGENTGATE_CLIENT_TEST_PG`` set to a PostgreSQL server URL without a
database (``postgres://postgres@127.0.0.1:5432``), each server a test starts
gets a fresh database of its own instead (``CREATE DATABASE
agentgate_client_<random>`` through ``psql``; the server makes its schema),
a second node started on another's ``store`` gets the same database URL,
and every database is dropped when the test ends, passed or failed."""

from __future__ import annotations

import os
import queue
import re
import signal
import subprocess
import sys
import threading
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator, List, Optional, Union
from urllib.parse import urlsplit, urlunsplit

import httpx
import pytest

#: The server under test: AGENTGATE_BIN, else the checkout's debug build.
AGENTGATE_BIN = os.environ.get("AGENTGATE_BIN") or str(
    Path(os.environ.get("CARGO_TARGET_DIR") or Path(__file__).resolve().parents[3] / "target")
    / "debug"
    / "agentgate"
)
#: How long a server may take to print its address.
SERVER_START_TIMEOUT_S = 15.0
#: How long a stopped server may take to exit before it is killed.
SERVER_STOP_TIMEOUT_S = 5.0
WORKER = Path(__file__).with_name("worker.py")
#: The lease TTL of tests that wait one out: long enough that a heartbeat
#: every third of it survives a loaded 2-core machine, short enough to wait.
SHORT_TTL_MS = 1000
#: Past a TTL by this much, a lease is surely expired on the store's clock.
TTL_MARGIN_S = 0.5
#: A PostgreSQL server URL without a database: each server a test starts
#: gets a database of its own there (see the module docstring); unset, SQLite.
PG_SERVER = os.environ.get("AGENTGATE_CLIENT_TEST_PG") or None
#: How long one psql command (CREATE or DROP DATABASE) may take.
PSQL_TIMEOUT_S = 30.0


def _pg_url(database: str) -> str:
    """PG_SERVER with its path set to ``/database`` (query kept)."""
    assert PG_SERVER is not None
    parts = urlsplit(PG_SERVER)
    return urlunsplit((parts.scheme, parts.netloc, "/" + database, parts.query, parts.fragment))


def _psql(sql: str) -> None:
    """Runs ``sql`` on PG_SERVER's maintenance database ``postgres``."""
    done = subprocess.run(
        ["psql", _pg_url("postgres"), "-v", "ON_ERROR_STOP=1", "-qAtc", sql],
        capture_output=True,
        text=True,
        timeout=PSQL_TIMEOUT_S,
    )
    if done.returncode != 0:
        raise RuntimeError(f"psql {sql!r} exited {done.returncode}: {done.stderr.strip()}")


@dataclass
class Server:
    url: str
    process: "subprocess.Popen[str]"
    #: The SQLite file, or (AGENTGATE_CLIENT_TEST_PG) the database URL: what
    #: ``start_server(store=...)`` takes for a second node on this store.
    store: Union[Path, str]
    args: List[str] = field(default_factory=list)

    def metric(self, name: str, **labels: str) -> float:
        """One sample of ``GET /metrics`` (0 when the series is absent)."""
        text = httpx.get(self.url + "/metrics", timeout=10).text
        want = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
        for line in text.splitlines():
            if line.startswith("#"):
                continue
            match = re.match(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)$", line)
            if not match or match.group(1) != name:
                continue
            got = ",".join(sorted((match.group(2) or "{}")[1:-1].split(","))) if match.group(2) else ""
            if got == want:
                return float(match.group(3))
        return 0.0


def _start(tmp_path: Path, args: List[str], store: Union[Path, str]) -> Server:
    """A server on ``store``: a SQLite file, or a database URL."""
    if isinstance(store, Path):
        store_url, stem = f"sqlite://{store}", store.stem
    else:
        store_url, stem = store, urlsplit(store).path.lstrip("/")
    command = [
        AGENTGATE_BIN,
        "serve",
        "--listen",
        "127.0.0.1:0",
        "--store",
        store_url,
        "--no-app",
        *args,
    ]
    log = open(tmp_path / f"{stem}-{uuid.uuid4().hex[:4]}.log", "w")
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=log, text=True)
    lines: "queue.Queue[str]" = queue.Queue()

    def pump() -> None:
        assert process.stdout is not None
        for line in process.stdout:
            lines.put(line)
        lines.put("")  # the server exited

    threading.Thread(target=pump, daemon=True).start()
    try:
        while True:
            line = lines.get(timeout=SERVER_START_TIMEOUT_S)
            if line == "":
                process.wait(SERVER_STOP_TIMEOUT_S)
                log.flush()
                raise RuntimeError(
                    f"{AGENTGATE_BIN} {' '.join(args)} exited {process.returncode}: " + Path(log.name).read_text()[-2000:]
                )
            found = re.search(r"listening on (\S+)", line)
            if found:
                return Server(f"http://{found.group(1)}", process, store, args)
    except queue.Empty:
        process.kill()
        raise RuntimeError(f"{AGENTGATE_BIN} printed no address within {SERVER_START_TIMEOUT_S} s") from None


def _stop(server: Server) -> None:
    if server.process.poll() is None:
        server.process.send_signal(signal.SIGCONT)
        server.process.terminate()
        try:
            server.process.wait(SERVER_STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            server.process.kill()
            server.process.wait(SERVER_STOP_TIMEOUT_S)


@pytest.fixture
def start_server(tmp_path: Path) -> Iterator[Callable[..., Server]]:
    """``start_server("--lease-ttl-ms", "1000")``: a fresh server (a new
    SQLite file, or a new PostgreSQL database under AGENTGATE_CLIENT_TEST_PG);
    ``start_server(store=other.store)``: a second node on another's store."""
    if not os.access(AGENTGATE_BIN, os.X_OK):
        pytest.fail(f"AGENTGATE_BIN={AGENTGATE_BIN} is not an executable; build it or point AGENTGATE_BIN at one")
    servers: List[Server] = []
    databases: List[str] = []

    def start(*args: str, store: Optional[Union[Path, str]] = None) -> Server:
        if store is None:
            if PG_SERVER:
                database = f"agentgate_client_{uuid.uuid4().hex[:12]}"
                _psql(f'CREATE DATABASE "{database}"')
                databases.append(database)
                store = _pg_url(database)
            else:
                store = tmp_path / f"agentgate-{uuid.uuid4().hex[:8]}.db"
        server = _start(tmp_path, list(args), store)
        servers.append(server)
        return server

    try:
        yield start
    finally:
        try:
            for server in servers:
                _stop(server)
        finally:
            # FORCE: a server that would not stop (or a worker's leftover
            # session) must not keep its database alive.
            failures = []
            for database in databases:
                try:
                    _psql(f'DROP DATABASE IF EXISTS "{database}" WITH (FORCE)')
                except Exception as error:  # drop the rest anyway
                    failures.append(error)
            if failures:
                raise failures[0]


@pytest.fixture
def server(start_server: Callable[..., Server]) -> Server:
    """A server with the default flags."""
    return start_server()


@pytest.fixture
def ids() -> Callable[[str], str]:
    """Unique ids per test, so nothing leaks between tests."""
    suffix = uuid.uuid4().hex[:8]
    return lambda name: f"{name}-{suffix}"


@pytest.fixture
def python() -> str:
    return sys.executable
