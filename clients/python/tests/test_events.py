"""A turn's events: the SSE parser on its own; against the real server,
emits are appended in batches, in order, before the ending; reserved and
malformed events are refused before anything is sent; an append whose
answer is lost is not appended twice; followers cut at random byte
offsets (five times, by a proxy on their side) see every event once, in
order, and the ending (asyncio, and sync across two nodes sharing one
store); an ``error`` event raises its typed error."""

from __future__ import annotations

import asyncio
import json
import random
import threading
import time
from typing import Any, List, Optional
from urllib.parse import urlparse

import httpx
import pytest

import agentgate
from agentgate import AsyncGate, Gate, TurnEvent
from agentgate._events import EVENT_BATCH_MAX, SseEvent, SseParser, iter_sse, turn_event

from cutting_proxy import CuttingProxy
from lossy_proxy import LossyProxy

#: Bound on waiting for a thread or task the test started.
JOIN_TIMEOUT_S = 20.0
#: How many times the follower tests cut the stream, and where at most.
CUTS = 5
CUT_MAX_BYTES = 3000


def address(url: str) -> Any:
    parsed = urlparse(url)
    return (parsed.hostname, parsed.port)


# --- the parser --------------------------------------------------------


def parse(*chunks: bytes) -> List[SseEvent]:
    return list(iter_sse(iter(chunks)))


def test_sse_multi_line_data_is_joined_with_newlines_and_comments_are_ignored():
    stream = b": keep-alive\n\nid: 7\nevent: token\ndata: line one\ndata:line two\ndata\n\n"
    assert parse(stream) == [SseEvent(id="7", event="token", data="line one\nline two\n")]


def test_sse_lines_end_in_crlf_lf_or_cr_even_split_between_reads():
    stream = b"id: 1\r\nevent: a\r\ndata: x\r\n\r\nid: 2\revent: b\rdata: y\r\rid: 3\nevent: c\ndata: z\n\n"
    expected = [SseEvent("1", "a", "x"), SseEvent("2", "b", "y"), SseEvent("3", "c", "z")]
    assert parse(stream) == expected
    assert parse(*[stream[i : i + 1] for i in range(len(stream))]) == expected, "byte by byte"
    # A CRLF whose CR ends one read and LF starts the next is one line end.
    assert parse(b"data: x\r", b"\n\r", b"\n") == [SseEvent(None, "message", "x")]


def test_sse_a_cut_off_event_is_not_dispatched_and_utf8_survives_being_split():
    text = "data: 中午吃粉\n\n".encode()
    assert parse(*[text[i : i + 1] for i in range(len(text))]) == [SseEvent(None, "message", "中午吃粉")]
    parser = SseParser()
    assert parser.feed(b"\xef\xbb\xbfid: 1\nevent: token\ndata: {}\n") == [], "no blank line yet"
    assert parser.feed(b"\n") == [SseEvent("1", "token", "{}")], "the BOM is dropped"
    assert parser.feed(b"id: 2\nevent: token\ndata: {\"cut") == []  # the stream ends here


def test_sse_error_event_raises_its_typed_error():
    with pytest.raises(agentgate.StoreUnavailable):
        turn_event(SseEvent(None, "error", '{"code":"store_unavailable","message":"the store is down"}'))
    assert turn_event(SseEvent(None, "end", '{"state":"failed","attempt":2}')).state == "failed"


# --- the holder's side -------------------------------------------------


class Appends:
    """An httpx client that counts the event appends it sends."""

    def __init__(self) -> None:
        self.batches: List[int] = []

    def hook(self, request: httpx.Request) -> None:
        if request.method == "POST" and request.url.path.endswith("/events"):
            self.batches.append(len(json.loads(request.content)["events"]))


def test_emitted_events_are_appended_in_batches_in_order_and_before_the_ending(server, ids):
    appends = Appends()
    gate = Gate(server.url, http_client=httpx.Client(base_url=server.url, event_hooks={"request": [appends.hook]}))
    count = 1234
    with gate.turn(ids("u"), ids("s"), "msg-1", {}) as turn:
        for index in range(count):
            turn.emit("token", {"i": index})
        turn.complete("done")
    events = list(Gate(server.url).follow(turn.turn_id))

    assert [(e.id, e.name, e.data) for e in events[:-1]] == [(i + 1, "token", {"i": i}) for i in range(count)]
    assert events[-1] == TurnEvent(None, "end", 1, {"state": "succeeded", "attempt": 1})
    assert sum(appends.batches) == count and max(appends.batches) <= EVENT_BATCH_MAX
    assert len(appends.batches) <= 10, f"not batched: {appends.batches}"
    assert turn.last_event_id == count
    print(f"{count} events in {len(appends.batches)} appends: {appends.batches}")


def test_reserved_and_malformed_events_are_refused_before_anything_is_sent(server, ids):
    appends = Appends()
    gate = Gate(server.url, http_client=httpx.Client(base_url=server.url, event_hooks={"request": [appends.hook]}))
    with gate.turn(ids("u"), ids("s"), "msg-1", {}) as turn:
        for name, data in (
            ("end", {}),
            ("error", {}),
            ("has space", {}),
            ("x" * 65, {}),
            ("token", {"text": "a" * (64 * 1024)}),
            ("token", float("nan")),
            ("token", object()),
        ):
            with pytest.raises(agentgate.InvalidRequest):
                turn.emit(name, data)
        turn.complete("done")
    assert appends.batches == []
    assert [e.name for e in Gate(server.url).follow(turn.turn_id)] == ["end"]


def test_an_append_whose_answer_is_lost_is_found_in_the_log_and_not_appended_again(server, ids):
    proxy = LossyProxy(address(server.url))
    try:
        gate = Gate(proxy.url)
        with gate.turn(ids("u"), ids("s"), "msg-1", {}) as turn:
            turn.emit("token", "a")
            assert turn.flush() == 1
            turn.emit("token", "b")
            turn.emit("token", "c")
            proxy.lose_next_answer()  # the append lands; its answer does not
            assert turn.flush() == 3
            turn.emit("token", "d")
            turn.complete("done")
        assert len(proxy.lost_answers) == 1
    finally:
        proxy.close()
    events = list(Gate(server.url).follow(turn.turn_id))
    assert [(e.id, e.data) for e in events[:-1]] == [(1, "a"), (2, "b"), (3, "c"), (4, "d")]


async def test_async_emit_appends_in_the_background_while_the_body_runs(server, ids):
    async with AsyncGate(server.url) as gate:
        async with gate.turn(ids("u"), ids("s"), "msg-1", {}) as turn:
            await turn.emit("status", {"step": "thinking"})
            deadline = time.monotonic() + JOIN_TIMEOUT_S
            while turn.last_event_id is None and time.monotonic() < deadline:
                await asyncio.sleep(0.01)  # no flush asked for
            assert turn.last_event_id == 1
            await turn.complete("done")
        events = [event async for event in gate.follow(turn.turn_id)]
    assert [(e.id, e.name, e.data) for e in events] == [
        (1, "status", {"step": "thinking"}),
        (None, "end", {"state": "succeeded", "attempt": 1}),
    ]


# --- followers, cut ----------------------------------------------------


async def test_async_follower_cut_five_times_at_random_points_sees_every_event_once_in_order_and_the_end(server, ids):
    seed = random.randrange(2**32)
    print(f"seed {seed}")
    proxy = CuttingProxy(address(server.url), CUTS, CUT_MAX_BYTES, random.Random(seed))
    emitted: List[Any] = []
    try:
        async with AsyncGate(server.url) as gate, AsyncGate(proxy.url) as via_proxy:
            async with gate.turn(ids("u"), ids("s"), "msg-1", {}) as turn:
                seen: List[TurnEvent] = []

                async def follow() -> None:
                    async for event in via_proxy.follow(turn.turn_id):
                        seen.append(event)

                follower = asyncio.create_task(follow())
                # A live stream: bursts until the proxy has cut it five times.
                deadline = time.monotonic() + JOIN_TIMEOUT_S
                while (proxy.cuts < CUTS or len(emitted) < 200) and time.monotonic() < deadline:
                    for _ in range(10):
                        data = {"i": len(emitted), "text": "tok" * random.randint(1, 20)}
                        emitted.append(data)
                        await turn.emit("token", data)
                    await asyncio.sleep(0.02)
                await turn.complete({"events": len(emitted)})
            await asyncio.wait_for(follower, JOIN_TIMEOUT_S)
    finally:
        proxy.close()

    assert proxy.cuts == CUTS, f"the stream was cut {proxy.cuts} times"
    assert [e.id for e in seen[:-1]] == list(range(1, len(emitted) + 1)), "every event once, in order"
    assert [e.data for e in seen[:-1]] == emitted
    assert seen[-1].name == "end" and seen[-1].state == "succeeded"
    print(f"{len(emitted)} events, cut after {proxy.cut_after} bytes")


def test_sync_follower_cut_five_times_resumes_on_either_of_two_nodes_sharing_the_store(start_server, ids):
    node_a = start_server()
    node_b = start_server(store=node_a.store)
    seed = random.randrange(2**32)
    print(f"seed {seed}")
    rng = random.Random(seed)
    # Five cuts between them: three on A's side, two on B's.
    proxies = [CuttingProxy(address(node.url), cuts, CUT_MAX_BYTES, rng) for node, cuts in ((node_a, 3), (node_b, 2))]
    gate = Gate(node_a.url)
    seen: List[TurnEvent] = []
    failures: List[BaseException] = []
    emitted = 0
    try:
        with gate.turn(ids("u"), ids("s"), "msg-1", {}) as turn:
            follower = Gate(proxies[0].url).follow(turn.turn_id, base_urls=[p.url for p in proxies])

            def follow() -> None:
                try:
                    seen.extend(follower)
                except BaseException as error:  # reported below
                    failures.append(error)

            thread = threading.Thread(target=follow)
            thread.start()
            deadline = time.monotonic() + JOIN_TIMEOUT_S
            while (sum(p.cuts for p in proxies) < CUTS or emitted < 200) and time.monotonic() < deadline:
                for _ in range(10):
                    emitted += 1
                    turn.emit("token", emitted)
                time.sleep(0.02)
            turn.complete("done")
        thread.join(JOIN_TIMEOUT_S)
    finally:
        for proxy in proxies:
            proxy.close()

    assert failures == []
    cuts = [p.cuts for p in proxies]
    assert cuts == [3, 2], f"cuts per node: {cuts}"
    assert follower.reconnects == CUTS
    assert [(e.id, e.data) for e in seen[:-1]] == [(i, i) for i in range(1, emitted + 1)]
    assert seen[-1].state == "succeeded"


def test_a_follower_of_a_missing_turn_raises_NotFound_without_retrying(server):
    with pytest.raises(agentgate.NotFound):
        next(iter(Gate(server.url).follow("turn_does_not_exist")))


def test_a_follower_resumes_after_an_id_and_gives_up_on_a_dead_node_after_its_reconnects(server, ids):
    gate = Gate(server.url)
    with gate.turn(ids("u"), ids("s"), "msg-1", {}) as turn:
        for index in range(5):
            turn.emit("token", index)
        turn.complete("done")
    assert [e.id for e in gate.follow(turn.turn_id, after=3)] == [4, 5, None]
    dead = "http://127.0.0.1:9"  # nothing listens on the discard port
    started = time.monotonic()
    with pytest.raises(httpx.TransportError):
        list(gate.follow(turn.turn_id, base_urls=[dead], max_reconnects=3))
    assert time.monotonic() - started < JOIN_TIMEOUT_S
