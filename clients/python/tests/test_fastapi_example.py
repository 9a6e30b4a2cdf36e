"""The README's FastAPI example, driven through FastAPI's TestClient
against the real server: a repeated message gets the stored reply and
books once; a second message while one runs is answered 409."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

from fastapi.testclient import TestClient

from agentgate import Gate

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def load_app(monkeypatch, url):
    monkeypatch.setenv("AGENTGATE_URL", url)
    monkeypatch.syspath_prepend(str(EXAMPLES))
    sys.modules.pop("fastapi_app", None)
    return importlib.import_module("fastapi_app")


def test_fastapi_example_replays_a_repeated_message_and_books_once(server, ids, monkeypatch):
    example = load_app(monkeypatch, server.url)
    message = {"user_id": ids("u"), "session_id": ids("s"), "message_id": "msg-1", "text": "taxi 18"}
    with TestClient(example.app) as client:
        first = client.post("/chat", json=message)
        again = client.post("/chat", json=message)
    assert first.status_code == 200 and again.status_code == 200
    assert first.json() == again.json()
    assert first.json()["text"] == "Booked 18 to taxi."
    assert len(example.LEDGER) == 1


def test_fastapi_example_answers_409_while_the_session_is_busy(server, ids, monkeypatch):
    example = load_app(monkeypatch, server.url)
    holder = Gate(server.url).turn(ids("u"), ids("s"), "held", {}).__enter__()
    try:
        with TestClient(example.app) as client:
            busy = client.post(
                "/chat", json={"user_id": ids("u"), "session_id": ids("s"), "message_id": "msg-2", "text": "lunch 35"}
            )
        assert busy.status_code == 409
        assert busy.json()["detail"] == "the previous message is still being processed"
        assert int(busy.headers["retry-after"]) >= 1
        assert example.LEDGER == {}
    finally:
        holder.complete("done")
        holder.__exit__(None, None, None)
