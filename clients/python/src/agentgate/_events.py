"""A turn's events, the parts the sync and asyncio clients share (no I/O):
the limits, the checks an event passes before it is sent, the holder's
buffer of events not sent yet, a Server-Sent Events parser, and a
follower's bookkeeping (where to resume, which node next, how long to
pause, when to give up).

The wire (docs/http.md, "A turn's events"): the holder appends with
``POST /v1/turns/{id}/events`` under its lease; anyone allowed to read the
turn follows ``GET /v1/turns/{id}/events`` (SSE), each event ``id: n`` /
``event: name`` / ``data: {"attempt": a, "data": ...}``, the last one
``event: end`` with ``data: {"state", "attempt"}`` and no id. A stream
that closes without ``end`` was cut, not finished: resume after the last
id seen with ``Last-Event-ID``.
"""

from __future__ import annotations

import codecs
import dataclasses
import json
import re
from typing import Any, Dict, Iterator, List, Mapping, Optional, Sequence, Tuple

from .errors import AgentgateError, InvalidRequest, UnexpectedResponse, error_for

# Limits (seconds unless named otherwise), each with why.

#: The names the stream itself sends (the server refuses them in an append).
RESERVED_EVENT_NAMES = ("end", "error")
#: 1 to 64 of these characters: a name becomes an SSE ``event:`` line.
EVENT_NAME = re.compile(r"[A-Za-z0-9_.:\-]{1,64}\Z")
#: One event's data, as canonical JSON (``MAX_EVENT_DATA_BYTES``).
MAX_EVENT_DATA_BYTES = 64 * 1024
#: Events in one append (the server's ``MAX_EVENT_BATCH``).
EVENT_BATCH_MAX = 500
#: Data bytes in one append: well under the server's default body limit
#: (1 MiB), with room for the JSON around the events.
EVENT_BATCH_MAX_BYTES = 512 * 1024
#: How long an emitted event may wait in the buffer for others to share
#: its append: short, since a follower is waiting to show it.
EVENT_FLUSH_INTERVAL_S = 0.05
#: Events (and their data bytes) the holder keeps unsent at most; past
#: either, ``emit`` waits for an append (the sync client sends one itself,
#: the asyncio one awaits it), so a slow server slows the emitter down
#: instead of filling its memory.
EVENT_BUFFER_MAX = 5000
EVENT_BUFFER_MAX_BYTES = 4 * 1024 * 1024
#: After an append whose answer was lost, how long the check of whether it
#: landed waits for the turn's stored events: the server sends them at
#: once when a stream opens, and nothing while none follow.
EVENT_PROBE_IDLE_S = 2.0

#: A follower's read timeout: the server sends a comment every 15 s on an
#: idle stream (``SSE_KEEP_ALIVE``), so three missed ones mean a dead
#: connection, which is dropped and resumed.
FOLLOW_READ_TIMEOUT_S = 45.0
#: Reconnects in a row that bring no new event before a follower gives up
#: and raises the last error; each event received starts the count over,
#: so a long reply over a flaky network is followed to its end.
FOLLOW_MAX_RECONNECTS = 8
#: The pause before the n-th reconnect in a row: from the first, doubling,
#: up to the longest.
FOLLOW_BACKOFF_MIN_S = 0.05
FOLLOW_BACKOFF_MAX_S = 5.0
#: Answers to a follow request worth reconnecting after: the server is
#: busy or briefly without its store.
FOLLOW_WAITABLE_CODES = frozenset({"store_unavailable", "overloaded", "request_timeout", "internal"})


def _canonical_bytes(data: Any) -> int:
    """The size of ``data`` as the server measures it, near enough:
    compact JSON, keys sorted, UTF-8 (canonical JSON spells a few numbers
    differently; the server's check is the last word)."""
    text = json.dumps(data, ensure_ascii=False, separators=(",", ":"), sort_keys=True, allow_nan=False)
    return len(text.encode("utf-8"))


def checked_event(name: str, data: Any) -> int:
    """Check one event before it is buffered; its data's size in bytes.
    Raises :class:`~agentgate.InvalidRequest` (nothing sent) for a reserved
    or malformed name, data that is not JSON, or data over 64 KiB."""
    if not isinstance(name, str) or not EVENT_NAME.match(name):
        raise InvalidRequest(f"an event name is 1-64 of A-Z a-z 0-9 _ - . : (got {name!r})")
    if name in RESERVED_EVENT_NAMES:
        raise InvalidRequest(f"event name {name!r} is reserved: the stream itself sends end and error")
    try:
        size = _canonical_bytes(data)
    except (TypeError, ValueError) as problem:
        raise InvalidRequest(f"event {name}: its data is not JSON ({problem})") from None
    if size > MAX_EVENT_DATA_BYTES:
        raise InvalidRequest(f"event {name}: its data is {size} bytes, over {MAX_EVENT_DATA_BYTES}")
    return size


#: One buffered event: name, data, data bytes.
Pending = Tuple[str, Any, int]


class EventBuffer:
    """The events a holder emitted and has not appended yet, in order.
    Not locked: the clients hold their own lock around it."""

    def __init__(self) -> None:
        self._events: List[Pending] = []
        self._bytes = 0

    def __len__(self) -> int:
        return len(self._events)

    def add(self, name: str, data: Any, size: int) -> None:
        self._events.append((name, data, size))
        self._bytes += size

    def batch_ready(self) -> bool:
        """A whole append's worth waits: send it now, not after the interval."""
        return len(self._events) >= EVENT_BATCH_MAX or self._bytes >= EVENT_BATCH_MAX_BYTES

    def full(self) -> bool:
        """Past the bound of unsent events: the emitter waits for an append."""
        return len(self._events) >= EVENT_BUFFER_MAX or self._bytes >= EVENT_BUFFER_MAX_BYTES

    def take_batch(self) -> List[Pending]:
        """The oldest events that fit one append (at least one, if any)."""
        count, size = 0, 0
        for _, _, bytes_ in self._events:
            if count == EVENT_BATCH_MAX or (count > 0 and size + bytes_ > EVENT_BATCH_MAX_BYTES):
                break
            count += 1
            size += bytes_
        batch, self._events = self._events[:count], self._events[count:]
        self._bytes -= size
        return batch

    def put_back(self, batch: Sequence[Pending]) -> None:
        """An append that failed: its events go first again."""
        self._events[:0] = list(batch)
        self._bytes += sum(size for _, _, size in batch)


def append_body(batch: Sequence[Pending]) -> Dict[str, Any]:
    return {"events": [{"event": name, "data": data} for name, data, _ in batch]}


@dataclasses.dataclass(frozen=True)
class TurnEvent:
    """One event of a turn, as a follower sees it.

    ``id`` is its number in the turn's log (1, 2, 3, ...), ``name`` what
    the holder emitted it as, ``attempt`` the attempt of the holder that
    appended it (a new attempt means a takeover started the reply over),
    ``data`` its JSON. The last event a follower yields is the turn's
    ending: ``name == "end"``, ``id`` ``None``, ``data`` ``{"state",
    "attempt"}`` (and :attr:`state`)."""

    id: Optional[int]
    name: str
    attempt: int
    data: Any

    @property
    def state(self) -> Optional[str]:
        """For the ``end`` event: how the turn ended; else ``None``."""
        if self.name == "end" and isinstance(self.data, Mapping):
            state = self.data.get("state")
            return state if isinstance(state, str) else None
        return None


@dataclasses.dataclass(frozen=True)
class SseEvent:
    """One dispatched Server-Sent Event: its own ``id`` field (``None``
    when the event had none), its type (``message`` by default) and its
    data lines joined with ``\\n``."""

    id: Optional[str]
    event: str
    data: str


class SseParser:
    """Server-Sent Events, parsed as the HTML standard says: lines end in
    CRLF, LF or CR (a CRLF split between two reads is one line end);
    ``:`` lines are comments; ``field: value`` drops one space after the
    colon; ``data`` lines accumulate, joined with ``\\n``; a blank line
    dispatches the event (if it has data); a leading BOM is dropped; an
    event cut off by the end of the stream is never dispatched."""

    def __init__(self) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._line = ""
        self._started = False
        self._after_cr = False
        self._data: List[str] = []
        self._event = ""
        self._id: Optional[str] = None

    def feed(self, chunk: bytes) -> List[SseEvent]:
        """The events that ``chunk`` completes, in order."""
        text = self._decoder.decode(chunk)
        if not self._started and text:
            self._started = True
            if text.startswith("\ufeff"):
                text = text[1:]
        out: List[SseEvent] = []
        start = 0
        for index, char in enumerate(text):
            if char not in "\r\n":
                continue
            if char == "\n" and self._after_cr and index == start:
                # The LF of a CRLF whose CR ended the previous piece.
                self._after_cr = False
                start = index + 1
                continue
            line, self._line = self._line + text[start:index], ""
            self._after_cr = char == "\r"
            start = index + 1
            event = self._line_done(line)
            if event is not None:
                out.append(event)
        if start < len(text):
            self._after_cr = False
            self._line += text[start:]
        return out

    def _line_done(self, line: str) -> Optional[SseEvent]:
        if line == "":
            data, event, id_ = self._data, self._event, self._id
            self._data, self._event, self._id = [], "", None
            if not data:
                return None
            return SseEvent(id=id_, event=event or "message", data="\n".join(data))
        if line.startswith(":"):
            return None
        field, colon, value = line.partition(":")
        if colon and value.startswith(" "):
            value = value[1:]
        if field == "data":
            self._data.append(value)
        elif field == "event":
            self._event = value
        elif field == "id" and "\0" not in value:
            self._id = value
        return None


def iter_sse(chunks: Iterator[bytes]) -> Iterator[SseEvent]:
    """Every event of a byte stream (for tests and simple readers)."""
    parser = SseParser()
    for chunk in chunks:
        yield from parser.feed(chunk)


def turn_event(raw: SseEvent) -> TurnEvent:
    """A dispatched SSE event as a :class:`TurnEvent`; an ``error`` event
    raises its typed error (``code`` and ``message`` from its data)."""
    try:
        body = json.loads(raw.data)
    except ValueError:
        raise UnexpectedResponse(f"event {raw.event}: data is not JSON: {raw.data[:200]!r}") from None
    if raw.event == "error":
        detail = body if isinstance(body, Mapping) else {}
        # The stream's own answer was 200; the error is the read's.
        raise error_for(200, {"error": detail}, None)
    if not isinstance(body, Mapping) or not isinstance(body.get("attempt"), int):
        raise UnexpectedResponse(f"event {raw.event}: data without an attempt: {raw.data[:200]!r}")
    if raw.event == "end":
        return TurnEvent(id=None, name="end", attempt=body["attempt"], data=dict(body))
    if raw.id is None or not raw.id.isdigit():
        raise UnexpectedResponse(f"event {raw.event} without a numeric id ({raw.id!r})")
    return TurnEvent(id=int(raw.id), name=raw.event, attempt=body["attempt"], data=body.get("data"))


class FollowPlan:
    """One follower's bookkeeping across its connections: where to resume
    (the last id seen), which node to ask next (round robin over
    ``base_urls``), how many reconnects in a row brought nothing, how long
    to pause before the next, and when to give up."""

    def __init__(self, after: int, base_urls: Sequence[str], max_reconnects: int) -> None:
        if after < 0:
            raise ValueError(f"after must be >= 0, not {after}")
        if not base_urls:
            raise ValueError("base_urls must name at least one server")
        if max_reconnects < 0:
            raise ValueError(f"max_reconnects must be >= 0, not {max_reconnects}")
        self.last_id = after
        self._urls = [url.rstrip("/") for url in base_urls]
        self._next_url = 0
        self._max = max_reconnects
        self._in_a_row = 0
        self._last_error: Optional[BaseException] = None
        #: Connections that ended without ``end`` (cut, closed, refused).
        self.reconnects = 0
        #: The ``end`` event, once seen.
        self.end: Optional[TurnEvent] = None

    def url(self) -> str:
        """The node to connect to now (then the next one, next time)."""
        url = self._urls[self._next_url % len(self._urls)]
        self._next_url += 1
        return url

    def headers(self) -> Dict[str, str]:
        return {"Accept": "text/event-stream", "Last-Event-ID": str(self.last_id)}

    def accept(self, raw: SseEvent) -> Optional[TurnEvent]:
        """The event to yield, or ``None`` for one seen already; raises the
        typed error of an ``error`` event."""
        event = turn_event(raw)
        if event.name == "end":
            self.end = event
            return event
        assert event.id is not None
        if event.id <= self.last_id:
            return None
        self.last_id = event.id
        self._in_a_row = 0
        return event

    def dropped(self, error: Optional[BaseException]) -> None:
        """The connection ended without ``end``: cut (``error``), or closed
        by the server (``None``: its stream lifetime, a stalled reader)."""
        self.reconnects += 1
        self._in_a_row += 1
        if error is not None:
            self._last_error = error
        if isinstance(error, AgentgateError) and error.code not in FOLLOW_WAITABLE_CODES:
            raise error

    def pause_s(self) -> float:
        """The pause before the next connection; raises once
        ``max_reconnects`` in a row brought no event."""
        if self._in_a_row > self._max:
            if self._last_error is not None:
                raise self._last_error
            raise UnexpectedResponse(f"the event stream closed {self._in_a_row} times in a row without an event or its end")
        return float(min(FOLLOW_BACKOFF_MAX_S, FOLLOW_BACKOFF_MIN_S * 2.0 ** (self._in_a_row - 1)))


def landed_count(events: Sequence[TurnEvent], attempt: int, count: int) -> Optional[int]:
    """After an append whose answer was lost: the events read back past
    the last id known (``events``, in order). Appends are all or none and
    only this attempt's holder appends, so this attempt's events there are
    either none (it did not land: ``None``) or exactly the batch (it did:
    the last id). Anything else is not this client's doing."""
    ours = [event for event in events if event.attempt == attempt and event.name != "end"]
    if not ours:
        return None
    if len(ours) != count or ours[-1].id is None:
        raise UnexpectedResponse(f"after a lost append of {count} events, {len(ours)} of this attempt's were found")
    return ours[-1].id
