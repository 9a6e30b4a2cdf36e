"""The synchronous client: :class:`Gate` and :class:`Turn`, on ``httpx.Client``.

A turn's heartbeat runs in a daemon thread. When the lease is lost the
thread sets ``turn.lost`` (a ``threading.Event``); from then on every call
on the turn raises :class:`~agentgate.LeaseLost` without a request. When a
heartbeat answers ``cancel_requested`` (a cancel, or another message sent
with ``on_busy="interrupt"``) it sets ``turn.cancelled``; from then on
``turn.check_cancelled()``, ``turn.sleep()`` and ``turn.tool()`` raise
:class:`~agentgate.TurnCancelled`, and that exception leaving the ``with``
block ends the turn ``cancelled``. A thread cannot be interrupted from
outside, so a long step in the body (a model call) should wait with
``turn.sleep()``, or call ``turn.check_cancelled()`` between chunks.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
import time
from types import TracebackType
from typing import Any, Callable, Dict, Generator, Generic, List, Mapping, Optional, Sequence, Tuple, Type, TypeVar, overload

import httpx

from . import _core, _events
from ._core import F, R, Tool, ToolContext, ToolDecorator, ToolSpec, TurnResult, current_turn
from ._events import TurnEvent
from .errors import (
    AgentgateError,
    LeaseLost,
    NoActiveTurn,
    Replayed,
    TurnCancelled,
    TurnNotEnded,
    UnexpectedResponse,
    error_for,
)

T = TypeVar("T")

_NO_BODY: Any = object()

log = logging.getLogger("agentgate")


def _answer_error(response: httpx.Response) -> AgentgateError:
    """The typed error of an answer that is not a success."""
    data: Any = None
    if response.content:
        try:
            data = response.json()
        except ValueError:
            data = None
    return error_for(response.status_code, data, response.headers.get("retry-after"))


class Gate:
    """A connection to ``agentgate serve``.

    ``Gate(base_url, api_key=None, timeout=35.0)``; ``timeout`` bounds each
    HTTP request in seconds (the server answers within 30 s). Thread-safe:
    share one per process. Close it with ``gate.close()`` or ``with Gate(...)``.
    """

    def __init__(
        self,
        base_url: str,
        api_key: Optional[str] = None,
        timeout: float = 35.0,
        *,
        http_client: Optional[httpx.Client] = None,
    ) -> None:
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._http = http_client or httpx.Client(
            base_url=base_url.rstrip("/"), timeout=timeout, headers=headers, limits=_core.http_limits()
        )

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> "Gate":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # --- the wire -------------------------------------------------------

    def request(
        self,
        method: str,
        path: str,
        body: Any = _NO_BODY,
        *,
        lease_token: Optional[str] = None,
        params: Optional[Mapping[str, Any]] = None,
        timeout: Optional[float] = None,
    ) -> Tuple[int, Any]:
        """One call: ``(status, parsed JSON or None)`` for a 2xx answer.

        Raises the typed :class:`~agentgate.AgentgateError` for any other
        status, and ``httpx.HTTPError`` when no answer came.
        """
        headers = {"Lease-Token": lease_token} if lease_token is not None else None
        response = self._http.request(
            method,
            path,
            json=None if body is _NO_BODY else body,
            headers=headers,
            params=params,
            timeout=httpx.USE_CLIENT_DEFAULT if timeout is None else timeout,
        )
        data: Any = None
        if response.content:
            try:
                data = response.json()
            except ValueError:
                data = None
        if response.status_code >= 300:
            raise error_for(response.status_code, data, response.headers.get("retry-after"))
        return response.status_code, data

    # --- turns ----------------------------------------------------------

    def turn(
        self,
        user_id: str,
        session_id: str,
        client_request_id: str,
        payload: Any = None,
        wait: Optional[float] = None,
        *,
        confirmation: Optional[Mapping[str, str]] = None,
        on_busy: Optional[str] = None,
        wait_ms: Optional[int] = None,
        interrupt_running: bool = False,
        on_queued: Optional[Callable[[int], Any]] = None,
    ) -> "Turn":
        """A turn, begun when its ``with`` block is entered.

        ``with gate.turn(...) as turn:`` raises :class:`~agentgate.Replayed`
        instead of entering the body when the request already has an
        outcome. ``wait`` is how many seconds to keep repeating the begin
        while it is refused ``session_busy``, ``request_in_flight``,
        ``user_at_capacity``, a 503 or a 408, or not answered at all,
        pausing at most Retry-After between tries; after that the last
        refusal is raised. (A begin whose grant was lost on the way is
        refused ``request_in_flight`` by its own lease, and taken over once
        that lease expires, if ``wait`` lasts that long.)

        ``on_busy`` asks the server instead (``None``: the session's
        default, :meth:`set_policy`, else ``"reject"``): ``"wait"`` waits
        there up to ``wait_ms`` (default 12000, at most 20000) for the
        session to come free; ``"interrupt"`` first asks the running turn
        to stop; ``"enqueue"`` joins the session's queue, and
        ``"supersede"`` does too, replacing the messages queued before it
        (with ``interrupt_running=True`` it also asks the running turn to
        stop). A queued message (202) is sent again, the same request,
        until it starts (it is the head and the session is free) or is
        replayed (superseded, cancelled); ``on_queued(position)`` is called
        each time its position changes. ``wait`` bounds that too (``None``:
        :data:`~agentgate._core.QUEUE_WAIT_DEFAULT_S` once queued, else no
        wait); when it runs out the message is withdrawn and
        :class:`~agentgate.QueueTimeout` raised.
        """
        turn = Turn(self, user_id, session_id, client_request_id, payload, wait, confirmation)
        turn.on_busy = _core.busy_policy(on_busy, wait_ms, interrupt_running)
        turn.on_queued = on_queued
        return turn

    def run(
        self,
        user_id: str,
        session_id: str,
        client_request_id: str,
        payload: Any,
        fn: Callable[["Turn"], R],
        wait: Optional[float] = None,
        *,
        confirmation: Optional[Mapping[str, str]] = None,
        on_busy: Optional[str] = None,
        wait_ms: Optional[int] = None,
        interrupt_running: bool = False,
        on_queued: Optional[Callable[[int], Any]] = None,
    ) -> TurnResult[R]:
        """Run ``fn(turn)`` in a turn and complete it with the result,
        saying how the message ended (:class:`~agentgate.TurnResult`):
        ``replayed`` when the server answered with a stored outcome and
        ``fn`` did not run; ``state == "cancelled"`` (with ``partial``)
        when the turn was interrupted while ``fn`` ran. Other arguments as
        :meth:`turn`. If ``fn`` ends the turn itself (``turn.fail``,
        ``turn.await_confirmation``), its return value is the ``value``."""
        turn = self.turn(
            user_id,
            session_id,
            client_request_id,
            payload,
            wait,
            confirmation=confirmation,
            on_busy=on_busy,
            wait_ms=wait_ms,
            interrupt_running=interrupt_running,
            on_queued=on_queued,
        )
        return self._run_turn(turn, fn)

    def _run_turn(self, turn: "Turn", fn: Callable[["Turn"], R]) -> TurnResult[R]:
        """Enter ``turn`` (begin it, unless it is granted already), run
        ``fn`` in it and end it by how ``fn`` ended: see :meth:`run`."""
        try:
            with turn:
                value = fn(turn)
                if not turn.ended:
                    turn.complete(value)
        except Replayed as replay:
            return TurnResult.of_replay(replay.turn)
        except TurnCancelled:
            if turn.state != "cancelled":
                raise
            return TurnResult(turn.turn_id, "cancelled", False, partial=turn.partial)
        return TurnResult(turn.turn_id, turn.state, False, value=value)

    def run_turn(
        self,
        user_id: str,
        session_id: str,
        client_request_id: str,
        payload: Any,
        fn: Callable[["Turn"], R],
        wait: Optional[float] = None,
        *,
        confirmation: Optional[Mapping[str, str]] = None,
        on_busy: Optional[str] = None,
        wait_ms: Optional[int] = None,
        interrupt_running: bool = False,
        on_queued: Optional[Callable[[int], Any]] = None,
    ) -> R:
        """Run ``fn(turn)`` in a turn and complete it with the result; on a
        replay return the stored response (canonical JSON, see
        :class:`~agentgate.TurnResult`) without calling ``fn``. :meth:`run`
        says which of the two happened.

        A replay of a turn that did not succeed (failed non-retryably,
        cancelled, superseded) raises :class:`~agentgate.Replayed`; a turn
        interrupted while ``fn`` ran is ended ``cancelled`` and raises
        :class:`~agentgate.TurnCancelled`. If ``fn`` ends the turn itself
        (``turn.fail``, ``turn.await_confirmation``), its result is
        returned as is.
        """
        result = self.run(
            user_id,
            session_id,
            client_request_id,
            payload,
            fn,
            wait,
            confirmation=confirmation,
            on_busy=on_busy,
            wait_ms=wait_ms,
            interrupt_running=interrupt_running,
            on_queued=on_queued,
        )
        if result.replayed and not result.succeeded:
            raise Replayed(result.turn)
        if result.state == "cancelled" and not result.replayed and result.value is None:
            raise TurnCancelled(f"turn {result.turn_id} was cancelled while it ran; it ended cancelled")
        return result.value  # type: ignore[return-value]

    def claim_orphan(
        self,
        min_orphaned_ms: Optional[int] = None,
        user_ids: Optional[Sequence[str]] = None,
        turn_ids: Optional[Sequence[str]] = None,
    ) -> Optional["Turn"]:
        """Take over the orphan whose lease died longest ago, or else the
        head of a queue left free (``min_orphaned_ms`` at least), or ``None``.

        The returned turn is already granted and heartbeating; use it as
        ``with turn:`` exactly like a begun one (or hand it to
        :meth:`drain_turn`), resuming from ``turn.payload``.
        ``turn.journal`` lists its tool calls so far, every page of them:
        a claim of a ``succeeded`` one returns its stored result without
        running it, an ``unknown`` one goes to ``reconcile``.
        """
        body = _core.claim_filter(min_orphaned_ms, user_ids, turn_ids)
        status, data = self.request("POST", "/v1/orphans/claim", body)
        if status == 204:
            return None
        grant = data["turn"]
        turn = Turn(
            self, grant["user_id"], grant["session_id"], grant["client_request_id"], data.get("payload"), 0.0, None
        )
        turn.orphaned_for_ms = data.get("orphaned_for_ms")
        turn._granted(grant)
        try:
            turn.journal = self._journal(grant["turn_id"], data)
        except BaseException:
            turn._stop_heartbeat()  # nobody will run it: let its lease run out
            raise
        return turn

    def _journal(self, turn_id: str, claimed: Mapping[str, Any]) -> List[Dict[str, Any]]:
        """A claim's journal: its first page, then the rest read in pages."""
        journal = list(claimed.get("journal") or [])
        after = claimed.get("journal_next")
        for _ in range(_core.EXECUTION_PAGES_MAX):
            if after is None:
                return journal
            params = {"after": after, "limit": _core.EXECUTION_PAGE_LIMIT}
            page = self.request("GET", f"/v1/turns/{turn_id}/executions", params=params)[1]
            journal.extend(_core.journal_entry(execution) for execution in page["executions"])
            after = page.get("executions_next")
        raise UnexpectedResponse(f"turn {turn_id}: more executions than a turn holds")

    # --- the handoff: draining a session's queue ------------------------

    def drain(
        self,
        session_id: str,
        handler: Callable[["Turn"], R],
        *,
        user_id: Optional[str] = None,
        max_turns: int = _core.DRAIN_MAX_TURNS,
    ) -> List[TurnResult[R]]:
        """Run ``handler`` on every message the session still owes, in order.

        Claims the session's turn that can start now (its holder if that
        died, else the head of its queue once the session is free) and
        hands it to :meth:`drain_turn`. Returns what each turn came to,
        oldest first; ``[]`` when there is nothing to run, or when a live
        holder has the session (it drains its own queue, or its senders
        run their messages). ``user_id`` checks the session's owner.
        """
        session = self.request("GET", f"/v1/sessions/{session_id}", params=_core.owner(user_id))[1]["session"]
        ids = _core.drain_claim_ids(session)
        if not ids:
            return []
        turn = self.claim_orphan(
            min_orphaned_ms=0, user_ids=None if user_id is None else [user_id], turn_ids=ids
        )
        if turn is None:
            return []
        return self.drain_turn(turn, handler, max_turns=max_turns)

    def drain_turn(
        self, turn: "Turn", handler: Callable[["Turn"], R], *, max_turns: int = _core.DRAIN_MAX_TURNS
    ) -> List[TurnResult[R]]:
        """Run ``handler`` on ``turn``, then on each message its session
        queued behind it, in order, through the handoff.

        ``turn`` is a granted one (from :meth:`claim_orphan`, or a
        ``turn.next``) or one not begun yet (:meth:`turn`: it is begun
        first; a replay ends the drain there). Each turn is ended as
        :meth:`run` ends it, asking for the session's next queued message
        (``take_next``): the server starts it for this caller and its
        payload comes with the grant (``turn.payload``), until the queue
        is empty, the next one cannot start now (a confirmation is
        pending, the user is at its cap), or ``max_turns`` ran. A turn
        asked to stop ends ``cancelled`` and the drain goes on with the
        next. If ``handler`` raises, its turn is failed (retryable) without
        a handoff and the exception propagates: the rest stays queued for a
        later drain or a recovery worker. A sender still waiting for its
        queued message (``on_busy="enqueue"``) gets the drained turn's
        outcome as a replay.
        """
        results: List[TurnResult[R]] = []
        self._drain(turn, handler, max_turns, lambda: False, results, lambda held: None)
        return results

    def _drain(
        self,
        turn: "Turn",
        handler: Callable[["Turn"], R],
        max_turns: int,
        stopping: Callable[[], bool],
        results: List[TurnResult[R]],
        hold: Callable[[Optional["Turn"]], None],
    ) -> None:
        """:meth:`drain_turn`, appending to ``results`` as it goes (so a
        caller keeps what ran when a handler raises), telling ``hold``
        which turn is in hand, and taking no next turn once ``stopping()``."""
        if max_turns < 1:
            raise ValueError(f"max_turns must be >= 1, not {max_turns}")
        current: Optional[Turn] = turn
        try:
            while current is not None:
                current.take_next = len(results) + 1 < max_turns and not stopping()
                hold(current)
                try:
                    results.append(self._run_turn(current, handler))
                except BaseException:
                    if current.next is not None:
                        # The body ended its turn (taking the next) and then
                        # raised: nobody runs the next one here. Its lease
                        # runs out, and its sender's repeat or a recovery
                        # worker takes it over, still first in line.
                        current.next._stop_heartbeat()
                    raise
                current = current.next
        finally:
            hold(None)

    # --- events ---------------------------------------------------------

    def follow(
        self,
        turn_id: str,
        after: int = 0,
        *,
        user_id: Optional[str] = None,
        base_urls: Optional[Sequence[str]] = None,
        max_reconnects: int = _events.FOLLOW_MAX_RECONNECTS,
    ) -> "Follower":
        """Follow a turn's events: ``for event in gate.follow(turn_id):``.

        Yields each :class:`~agentgate.TurnEvent` after id ``after`` once,
        in order, live while the turn runs, and last its ending (``name ==
        "end"``, ``event.state``), then stops. A connection that drops, or
        that the server closes without ``end`` (a stream lives at most 30
        minutes; a reader that stalls 30 s is cut off), is resumed after
        the last id seen (``Last-Event-ID``) on the next of ``base_urls``
        (any node sharing the store; default this gate's server), pausing
        50 ms doubling to 5 s; after ``max_reconnects`` in a row without a
        new event the last error is raised. An ``error`` event (the
        server's read failed) raises its typed error. ``user_id`` checks
        the turn's owner. Close it (``follower.close()``, or ``with``) to
        stop early.
        """
        urls = list(base_urls) if base_urls is not None else [str(self._http.base_url)]
        return Follower(self, turn_id, _events.FollowPlan(after, urls, max_reconnects), _core.owner(user_id))

    def _sse(
        self, url: str, headers: Mapping[str, str], params: Optional[Mapping[str, Any]], timeout: float
    ) -> Generator[_events.SseEvent, None, None]:
        """The events of one ``GET .../events`` connection, as they come."""
        with self._http.stream("GET", url, headers=headers, params=params, timeout=timeout) as response:
            if response.status_code != 200:
                response.read()
                raise _answer_error(response)
            parser = _events.SseParser()
            for chunk in response.iter_bytes():
                yield from parser.feed(chunk)

    def _follow_to_end(self, turn_id: str, seconds: float, user_id: Optional[str]) -> str:
        """Follows ``turn_id``'s events for its ``end``, at most ``seconds``
        (for a begin refused ``request_in_flight``, see
        :meth:`_core.BeginAttempts.follow`): ``"end"``, ``"timeout"`` or
        ``"failed"``. Asks for no event, only the ``end``."""
        deadline = time.monotonic() + seconds
        params: Dict[str, Any] = {"after": _core.IN_FLIGHT_FOLLOW_AFTER, **(_core.owner(user_id) or {})}
        headers = {"Accept": "text/event-stream"}
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return "timeout"
            opened = time.monotonic()
            try:
                # The read timeout is the time left when it opened: a
                # keep-alive comment restarts it, so the connection is
                # reopened after one (with the time left then).
                with self._http.stream(
                    "GET", f"/v1/turns/{turn_id}/events", headers=headers, params=params, timeout=remaining
                ) as response:
                    if response.status_code != 200:
                        return "failed"
                    parser = _events.SseParser()
                    for chunk in response.iter_bytes():
                        if any(event.event == "end" for event in parser.feed(chunk)):
                            return "end"
                        if time.monotonic() >= deadline:
                            return "timeout"
                        if time.monotonic() - opened >= _core.IN_FLIGHT_REOPEN_S:
                            break
                    else:
                        return "failed"  # closed without `end`
            except httpx.TimeoutException:
                if time.monotonic() >= deadline - 0.01:
                    return "timeout"
                return "failed"
            except httpx.TransportError:
                return "failed"

    def get_turn(self, turn_id: str) -> Dict[str, Any]:
        """``GET /v1/turns/{id}``: the turn, ``orphaned``, its first executions."""
        return dict(self.request("GET", f"/v1/turns/{turn_id}")[1])

    def request_cancel(self, turn_id: str, user_id: Optional[str] = None) -> Dict[str, Any]:
        """``POST /v1/turns/{id}/cancel``: ask a running turn to stop (no
        lease needed, idempotent). Its holder learns it on its next
        heartbeat and tool claim (:class:`~agentgate.TurnCancelled`).
        Returns the turn's view; ``user_id`` checks the owner."""
        return dict(self.request("POST", f"/v1/turns/{turn_id}/cancel", {}, params=_core.owner(user_id))[1])

    def cancel(self, turn_id: str, user_id: Optional[str] = None) -> Dict[str, Any]:
        """Ask a turn to stop (:meth:`request_cancel`): a running one ends
        ``cancelled`` once its holder learns it (its next heartbeat); a
        queued one is removed at once. Returns the turn's view."""
        return self.request_cancel(turn_id, user_id)

    def set_policy(
        self,
        session_id: str,
        user_id: str,
        on_busy: str,
        wait_ms: Optional[int] = None,
        interrupt_running: bool = False,
    ) -> Dict[str, Any]:
        """``PUT /v1/sessions/{id}/policy``: what a begin on this session
        that names no ``on_busy`` does when the session is busy (see
        :meth:`turn`). Binds a session not used yet to ``user_id``.
        Returns the session (``default_policy`` shows it)."""
        body = {"user_id": user_id, **_core.busy_policy(on_busy, wait_ms, interrupt_running)}
        data = self.request("PUT", f"/v1/sessions/{session_id}/policy", body)[1]
        return dict(data["session"])

    def release_session(self, session_id: str, user_id: Optional[str] = None) -> Optional[Dict[str, Any]]:
        """``POST /v1/sessions/{id}/release``: an operator's force-release.
        The holder (live or expired) ends ``abandoned`` and every later
        write of it is refused :class:`~agentgate.LeaseLost`; returns that
        turn, or ``None`` when the session had no holder."""
        data = self.request("POST", f"/v1/sessions/{session_id}/release", {}, params=_core.owner(user_id))[1]
        released = data["released"]
        return None if released is None else dict(released)

    def get_session(self, session_id: str) -> Dict[str, Any]:
        return dict(self.request("GET", f"/v1/sessions/{session_id}")[1])

    def get_user(self, user_id: str) -> Dict[str, Any]:
        return dict(self.request("GET", f"/v1/users/{user_id}")[1])

    # --- the decorator --------------------------------------------------

    @overload
    def tool(self, function: F) -> Tool[F]: ...

    @overload
    def tool(
        self, *, name: Optional[str] = None, reconcile: Optional[Callable[[ToolContext], Any]] = None
    ) -> ToolDecorator: ...

    def tool(
        self,
        function: Optional[Callable[..., Any]] = None,
        *,
        name: Optional[str] = None,
        reconcile: Optional[Callable[[ToolContext], Any]] = None,
    ) -> Any:
        """Make a plain function a tool booked through the current turn.

        ``@gate.tool`` or ``@gate.tool(name="x", reconcile=hook)``. Calling
        the function inside ``with gate.turn(...)`` claims ``(name, args)``
        in that turn, where args are the call's arguments by parameter name
        (defaults filled in); the function runs only when the server says
        execute, otherwise the stored result is returned. A first
        parameter named ``ctx`` (or annotated :class:`ToolContext`) receives
        the context. Outside a turn it raises :class:`~agentgate.NoActiveTurn`.
        The turn is found through a context variable: a thread you start
        inside the body must carry the context (``contextvars.copy_context().run``).
        """

        def decorate(f: Callable[..., Any]) -> Callable[..., Any]:
            spec = ToolSpec.of(f, name, reconcile)

            @functools.wraps(f)
            def wrapper(*args: Any, **kwargs: Any) -> Any:
                turn = current_turn.get()
                if not isinstance(turn, Turn):
                    raise NoActiveTurn(f"tool {spec.name} called outside a turn")
                tool_args = spec.bind(args, kwargs)
                return turn.tool(
                    spec.name,
                    tool_args,
                    run=lambda ctx: spec.call(ctx, tool_args),
                    reconcile=spec.reconcile,
                )

            spec.present(wrapper)
            return wrapper

        if function is not None:
            return decorate(function)
        return decorate


class Turn:
    """One turn: begun (or claimed), heartbeating, ended exactly once.

    Attributes after the grant: ``turn_id``, ``fence``, ``attempt``,
    ``takeover``, ``lease_ttl_ms``, ``confirmation``, ``payload``,
    ``journal`` (claimed orphans), ``lost`` (a ``threading.Event`` set
    when the lease is lost), ``cancelled`` (one set when the turn was asked
    to stop) and ``state`` (``running``, then how it ended). Set
    ``partial`` to what the turn has produced so far: an interrupted turn
    ends ``cancelled`` with it. While queued: ``turn_id`` and
    ``queue_position``. Set ``take_next`` to have its ending hand over the
    session's next queued message: ``next`` is then that turn, granted
    to this caller (see :meth:`Gate.drain_turn`).
    """

    def __init__(
        self,
        gate: Gate,
        user_id: str,
        session_id: str,
        client_request_id: str,
        payload: Any,
        wait: Optional[float],
        confirmation: Optional[Mapping[str, str]],
    ) -> None:
        self.gate = gate
        self.user_id = user_id
        self.session_id = session_id
        self.client_request_id = client_request_id
        self.payload = payload
        self.wait = wait
        self._confirmation_request = dict(confirmation) if confirmation else None
        self.on_busy: Dict[str, Any] = {}
        #: Set once granted, or once queued.
        self.turn_id: str = ""
        self.fence: int = 0
        self.attempt: int = 0
        self.takeover: bool = False
        self.lease_ttl_ms: int = 0
        self.confirmation: Optional[Dict[str, Any]] = None
        self.journal: List[Dict[str, Any]] = []
        self.orphaned_for_ms: Optional[int] = None
        self.lost = threading.Event()
        self.lost_error: Optional[LeaseLost] = None
        self.cancelled = threading.Event()
        #: What an interrupted turn ends ``cancelled`` with (its response).
        self.partial: Any = None
        self.state: str = ""
        self.queue_position: Optional[int] = None
        self.on_queued: Optional[Callable[[int], Any]] = None
        #: Whether this turn's ending (``complete``, ``fail``,
        #: ``end_cancelled``, and the ``cancelled`` ending on the way out)
        #: asks for the session's next queued message.
        self.take_next = False
        #: After an ending that took it: the session's next queued message,
        #: a turn granted to this caller and heartbeating. Run it (``with
        #: turn.next:``), or its lease runs out and it becomes an orphan.
        self.next: Optional[Turn] = None
        self.ended = False
        self._lease_token: Optional[str] = None
        self._ending = False
        self._emitter: Optional[_Emitter] = None
        self._stop = threading.Event()
        #: Set with ``lost`` or ``cancelled``: what ``sleep`` waits on.
        self._stopping = threading.Event()
        self._heartbeat_thread: Optional[threading.Thread] = None
        self._context_token: Any = None
        self._executions = _core.HeldExecutions()

    def __repr__(self) -> str:
        return f"Turn(turn_id={self.turn_id!r}, attempt={self.attempt}, fence={self.fence}, takeover={self.takeover})"

    # --- begin ----------------------------------------------------------

    def _begin(self) -> None:
        body: Dict[str, Any] = {
            "user_id": self.user_id,
            "session_id": self.session_id,
            "client_request_id": self.client_request_id,
        }
        if self.payload is not None:
            body["payload"] = self.payload
        if self._confirmation_request is not None:
            body["confirmation"] = self._confirmation_request
        body.update(self.on_busy)
        attempts = _core.BeginAttempts(self.wait, self._queued)
        while True:
            try:
                status, data = self.gate.request("POST", "/v1/turns", body)
            except BaseException as refusal:
                attempts.refused(refusal)
            else:
                if attempts.answered(status, data):
                    break
            follow = attempts.follow()
            if follow is not None:
                outcome = self.gate._follow_to_end(follow[0], follow[1], self.user_id)
                if attempts.followed(follow[0], outcome):
                    continue
            pause = attempts.pause_s()
            if pause is None:
                if attempts.queued is not None:
                    raise self._withdraw(attempts.queued)
                raise attempts.give_up()
            time.sleep(pause)
        if status == 200:
            raise Replayed(data["turn"])
        if status != 201:
            raise UnexpectedResponse(f"begin answered {status}", status=status, body=data)
        self._granted(data["turn"])

    def _queued(self, queued: Mapping[str, Any]) -> None:
        self.turn_id = str(queued["turn_id"])
        self.queue_position = int(queued["position"])
        if self.on_queued is not None:
            self.on_queued(self.queue_position)

    def _withdraw(self, queued: Mapping[str, Any]) -> BaseException:
        """The wait of a queued message ran out: cancel it, so it never
        runs with no one to run it; the error to raise."""
        try:
            self.gate.request_cancel(str(queued["turn_id"]), self.user_id)
        except (AgentgateError, httpx.HTTPError):
            return _core.queue_timeout(queued, withdrawn=False)
        return _core.queue_timeout(queued, withdrawn=True)

    def _granted(self, grant: Mapping[str, Any]) -> None:
        self.turn_id = grant["turn_id"]
        self._lease_token = grant["lease_token"]
        self.fence = grant["fence"]
        self.attempt = grant["attempt"]
        self.takeover = grant["takeover"]
        self.lease_ttl_ms = grant["lease_expires_in_ms"]
        self.confirmation = grant.get("confirmation")
        self.state = "running"
        self._start_heartbeat()

    def __enter__(self) -> "Turn":
        if self._lease_token is None:
            self._begin()
        self._context_token = current_turn.set(self)
        return self

    def __exit__(
        self,
        exc_type: Optional[Type[BaseException]],
        exc: Optional[BaseException],
        traceback: Optional[TracebackType],
    ) -> Optional[bool]:
        if self._context_token is not None:
            current_turn.reset(self._context_token)
            self._context_token = None
        try:
            if exc is None:
                if self.ended:
                    return None
                self.check()
                if self.cancelled.is_set():
                    self._end_cancelled_quietly()
                    raise TurnCancelled(
                        f"turn {self.turn_id}: asked to stop, and the body exited without ending it;"
                        " it was ended cancelled with turn.partial"
                    )
                self._fail_quietly({"type": "TurnNotEnded", "message": "the turn's body exited without ending it"})
                raise TurnNotEnded(
                    f"turn {self.turn_id}: the body exited without turn.complete(...); the turn was failed (retryable)"
                )
            if self.ended or self.lost.is_set() or isinstance(exc, LeaseLost):
                return None
            if isinstance(exc, TurnCancelled) or self.cancelled.is_set():
                # Asked to stop: whatever the body raised on its way out,
                # the turn ends as the server asked, keeping what it had; a
                # repeat of the request replays that instead of running again.
                self._end_cancelled_quietly()
                return None
            self._fail_quietly(_core.error_json(exc), _core.retryable(exc))
            return None
        finally:
            self._stop_heartbeat()

    def _fail_quietly(self, error: Any, retryable: bool = True) -> None:
        """Fail the turn on the way out; a refusal must not hide the
        body's own exception (the lease may be gone already). It takes no
        next message: the exception goes to the caller, not to a drain."""
        try:
            self._end("fail", "failed", {"error": error, "retryable": retryable}, take_next=False, strict=False)
        except (AgentgateError, httpx.HTTPError):
            pass

    def _end_cancelled_quietly(self) -> None:
        """End the turn ``cancelled`` with ``partial`` on the way out."""
        partial = self.partial if _core.json_problem(self.partial) is None else None
        try:
            self._end("end-cancelled", "cancelled", {"partial": partial}, take_next=self.take_next, strict=False)
        except (AgentgateError, httpx.HTTPError):
            pass

    # --- the lease ------------------------------------------------------

    def _start_heartbeat(self) -> None:
        thread = threading.Thread(target=self._heartbeat_loop, name=f"agentgate-heartbeat-{self.turn_id}", daemon=True)
        self._heartbeat_thread = thread
        thread.start()

    def _stop_heartbeat(self) -> None:
        self._stop.set()
        thread = self._heartbeat_thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(_core.HEARTBEAT_JOIN_S)

    def _heartbeat_loop(self) -> None:
        ttl_s = self.lease_ttl_ms / 1000.0
        interval = max(ttl_s / 3, _core.HEARTBEAT_MIN_INTERVAL_S)
        renewed_at = time.monotonic()
        while not self._stop.wait(interval):
            sent_at = time.monotonic()
            # No answer past the local deadline is worth waiting for.
            timeout = max(ttl_s - (sent_at - renewed_at), _core.HEARTBEAT_MIN_TIMEOUT_S)
            try:
                _, data = self._call("POST", f"/v1/turns/{self.turn_id}/heartbeat", timeout=timeout)
            except LeaseLost:
                return  # _call marked the turn lost
            except (AgentgateError, httpx.HTTPError):
                if time.monotonic() - renewed_at >= ttl_s:
                    self._mark_lost(LeaseLost("lease could not be renewed before its local deadline"))
                    return
                interval = max(min(ttl_s / 3, _core.HEARTBEAT_RETRY_S), _core.HEARTBEAT_MIN_INTERVAL_S)
                continue
            renewed_at = sent_at
            ttl_s = data.get("lease_expires_in_ms", self.lease_ttl_ms) / 1000.0
            interval = max(ttl_s / 3, _core.HEARTBEAT_MIN_INTERVAL_S)
            if data.get("cancel_requested") is True:
                self._mark_cancel_requested()

    def _mark_lost(self, error: LeaseLost) -> None:
        if self._ending or self.ended:
            return  # our own ending raced the heartbeat: nothing is lost
        if self.lost_error is None:
            self.lost_error = error
        self.lost.set()
        self._stopping.set()
        self._stop.set()

    def _mark_cancel_requested(self) -> None:
        """The server asked the turn to stop; the heartbeat goes on (the
        lease is kept until the body's ending)."""
        self.cancelled.set()
        self._stopping.set()

    @property
    def lease_token(self) -> Optional[str]:
        """The secret every call under this lease sends as ``Lease-Token``
        (for raw calls through ``gate.request``); never log it."""
        return self._lease_token

    def check(self) -> None:
        """Raise :class:`~agentgate.LeaseLost` if the lease is known lost."""
        if self.lost.is_set():
            known = self.lost_error
            raise LeaseLost(
                f"turn {self.turn_id}: lease lost ({known.message if known else 'unknown reason'})",
                status=known.status if known else None,
            )

    @property
    def cancel_requested(self) -> bool:
        """Whether the turn was asked to stop (``turn.cancelled`` is set)."""
        return self.cancelled.is_set()

    def check_cancelled(self) -> None:
        """Raise :class:`~agentgate.TurnCancelled` if the turn was asked to
        stop; call it between the steps of a long model call. Let it
        escape the ``with`` block: the turn then ends ``cancelled`` with
        ``turn.partial``."""
        if self.cancelled.is_set():
            raise TurnCancelled(f"turn {self.turn_id}: asked to stop (cancel or interrupt)")

    def sleep(self, seconds: float) -> None:
        """Wait ``seconds``, or less: raises :class:`~agentgate.TurnCancelled`
        as soon as the turn is asked to stop and
        :class:`~agentgate.LeaseLost` as soon as the lease is lost. For
        waits in the body (a model call polled for its answer, a backoff)."""
        if self._stopping.wait(max(0.0, seconds)):
            self.check()
            self.check_cancelled()

    def _call(self, method: str, path: str, body: Any = _NO_BODY, timeout: Optional[float] = None) -> Tuple[int, Any]:
        self.check()
        try:
            return self.gate.request(method, path, body, lease_token=self._lease_token, timeout=timeout)
        except LeaseLost as error:
            self._mark_lost(error)
            raise
        except TurnCancelled:
            self._mark_cancel_requested()
            raise

    def _write(self, path: str, body: Dict[str, Any], landed: Callable[[], Optional[Dict[str, Any]]]) -> Any:
        """A write under the lease, sent again (at most ``WRITE_ATTEMPTS``
        times) while its answer is lost. A repeat refused ``lease_lost``
        after a lost answer is checked with ``landed()``: if the lost one
        took effect, its record is the answer."""
        self.check()
        pause = 0.0
        uncertain = False
        for attempt in range(1, _core.WRITE_ATTEMPTS + 1):
            try:
                return self.gate.request("POST", path, body, lease_token=self._lease_token)[1]
            except LeaseLost as error:
                found = landed() if uncertain else None
                if found is not None:
                    return found
                self._mark_lost(error)
                raise
            except _core.WRITE_TRANSIENT as error:
                if attempt == _core.WRITE_ATTEMPTS:
                    raise
                uncertain = True
                pause = _core.next_pause_s(
                    pause, error, _core.NO_DEADLINE_S, _core.WRITE_PAUSE_MIN_S, _core.WRITE_PAUSE_MAX_S
                )
                time.sleep(pause)
        raise AssertionError("unreachable: the last attempt returns or raises")

    def _ending_landed(self, state: str) -> Optional[Dict[str, Any]]:
        try:
            turn = self.gate.get_turn(self.turn_id)["turn"]
        except (AgentgateError, httpx.HTTPError):
            return None
        return {"turn": turn} if _core.landed_ending(turn, state, self.fence) else None

    def _execution_landed(self, execution_id: str, state: str) -> Optional[Dict[str, Any]]:
        after: Optional[str] = None
        for _ in range(_core.EXECUTION_PAGES_MAX):
            params: Dict[str, Any] = {"limit": _core.EXECUTION_PAGE_LIMIT}
            if after is not None:
                params["after"] = after
            try:
                page = self.gate.request("GET", f"/v1/turns/{self.turn_id}/executions", params=params)[1]
            except (AgentgateError, httpx.HTTPError):
                return None
            found = _core.landed_execution(page, execution_id, state, self.fence)
            if found is not None:
                return {"execution": {"execution_id": execution_id, "state": state}} if found else None
            after = page.get("executions_next")
            if after is None:
                return None
        return None

    def heartbeat(self) -> int:
        """Renew the lease now; returns ``lease_expires_in_ms``."""
        return int(self._call("POST", f"/v1/turns/{self.turn_id}/heartbeat")[1]["lease_expires_in_ms"])

    # --- endings --------------------------------------------------------

    def _end(
        self, path: str, state: str, body: Dict[str, Any], take_next: bool = False, strict: bool = True
    ) -> Dict[str, Any]:
        """One ending. The events emitted so far are appended first; when
        that fails, a ``strict`` ending raises (nothing ended), the others
        (on the way out of the block) end the turn anyway. With
        ``take_next`` the answer's next turn becomes ``self.next``; if the
        answer is lost and the repeat finds the ending landed, that turn is
        lost with it and becomes an orphan once its lease runs out."""
        self.check()
        try:
            self.flush()
        except (AgentgateError, httpx.HTTPError):
            if strict or self.lost.is_set():
                raise
        if take_next:
            body = {**body, "take_next": True}
        self._ending = True
        try:
            data = self._write(f"/v1/turns/{self.turn_id}/{path}", body, lambda: self._ending_landed(state))
        except LeaseLost as error:
            # Refused for good (taken over, released, expired): the lease is
            # gone, so leaving the block must not report an unended turn.
            self._ending = False
            self._mark_lost(error)
            raise
        except BaseException:
            self._ending = False
            raise
        self.ended = True
        self._stop_heartbeat()
        if self._emitter is not None:
            self._emitter.close()
        record = dict(data.get("turn", data)) if isinstance(data, Mapping) else {}
        self.state = str(record.get("state", state))
        handed = data.get("next") if isinstance(data, Mapping) else None
        if isinstance(handed, Mapping):
            self.next = self._handed_off(handed)
        return record

    def _handed_off(self, handed: Mapping[str, Any]) -> "Turn":
        """The next queued message, started for this caller by the handoff."""
        grant = handed["turn"]
        turn = Turn(
            self.gate, grant["user_id"], grant["session_id"], grant["client_request_id"], handed.get("payload"), 0.0, None
        )
        turn._granted(grant)
        return turn

    def complete(self, response: Any, take_next: Optional[bool] = None) -> Dict[str, Any]:
        """End the turn ``succeeded`` with ``response`` (what a replay
        returns). ``take_next`` (default ``turn.take_next``) asks for the
        session's next queued message: then ``turn.next``."""
        return self._end("complete", "succeeded", {"response": response}, self._taking(take_next))

    def fail(self, error: Any, retryable: bool = True, take_next: Optional[bool] = None) -> Dict[str, Any]:
        """End the turn ``failed``; a retryable failure restarts on a repeat."""
        body = {"error": error, "retryable": retryable}
        return self._end("fail", "failed", body, self._taking(take_next))

    def await_confirmation(self, pending: Any) -> Dict[str, Any]:
        """End the turn waiting for a person's decision on ``pending``
        (never a handoff: the session's queue waits behind the person)."""
        return self._end("await-confirmation", "awaiting_confirmation", {"pending": pending})

    def end_cancelled(self, partial: Any = None, take_next: Optional[bool] = None) -> Dict[str, Any]:
        """End the turn ``cancelled`` with what it had produced: the answer
        to a cancel request (or an interrupt), which a repeat replays."""
        return self._end("end-cancelled", "cancelled", {"partial": partial}, self._taking(take_next))

    def _taking(self, take_next: Optional[bool]) -> bool:
        return self.take_next if take_next is None else take_next

    # --- events ---------------------------------------------------------

    def emit(self, name: str, data: Any = None) -> None:
        """Add one event to the turn's log, for its followers
        (:meth:`Gate.follow`): a token of the reply, a status line.

        Buffered, and appended in batches (``POST /v1/turns/{id}/events``,
        at most 500 events and 512 KiB each) by a background thread at
        most 50 ms after the first waiting one, at once when a batch is
        full, and before the turn's ending, in the order emitted. Raises
        :class:`~agentgate.InvalidRequest` at once, sending nothing, for the
        reserved names ``end`` and ``error``, a name that is not 1-64 of
        ``A-Z a-z 0-9 _ - . :``, data that is not JSON or over 64 KiB. With
        5000 events (or 4 MiB) unsent, it sends a batch itself before
        returning. A background append that failed raises here (next call).
        """
        size = _events.checked_event(name, data)
        self.check()
        if self.ended or self._ending:
            raise LeaseLost(f"turn {self.turn_id}: already ended; its events are closed")
        if self._emitter is None:
            self._emitter = _Emitter(self)
        self._emitter.emit(name, data, size)

    def flush(self) -> Optional[int]:
        """Append every buffered event now; the turn's last event id this
        turn appended (``None`` before its first append). Endings flush
        first by themselves."""
        if self._emitter is None:
            return None
        return self._emitter.flush()

    @property
    def last_event_id(self) -> Optional[int]:
        """The id of the last event this turn appended, ``None`` before any."""
        return None if self._emitter is None else self._emitter.last_event_id

    def _append_events(self, batch: Sequence[_events.Pending], after: Optional[int], in_doubt: bool) -> int:
        """One append, sent again (at most ``WRITE_ATTEMPTS`` times) while
        its answer is lost. An append is not idempotent, so before sending
        again it reads the log back: the lost one landed (all of it) or not
        at all. ``in_doubt``: an earlier send of this batch got no answer.
        Returns the last id appended."""
        path = f"/v1/turns/{self.turn_id}/events"
        body = _events.append_body(batch)
        pause = 0.0
        for attempt in range(1, _core.WRITE_ATTEMPTS + 1):
            try:
                if in_doubt:
                    landed = self._events_landed(after, len(batch))
                    if landed is not None:
                        return landed
                    in_doubt = False
                return int(self._call("POST", path, body)[1]["last_event_id"])
            except _core.WRITE_TRANSIENT as error:
                if attempt == _core.WRITE_ATTEMPTS:
                    raise
                in_doubt = True
                pause = _core.next_pause_s(
                    pause, error, _core.NO_DEADLINE_S, _core.WRITE_PAUSE_MIN_S, _core.WRITE_PAUSE_MAX_S
                )
                if self.lost.wait(pause):
                    self.check()
        raise AssertionError("unreachable: the last attempt returns or raises")

    def _events_landed(self, after: Optional[int], count: int) -> Optional[int]:
        """Whether a batch of ``count`` whose answer was lost is in the
        log: its last id, or ``None``. Reads the log after ``after`` until
        this attempt's ``count`` events are in, the end, or a quiet
        :data:`~agentgate._events.EVENT_PROBE_IDLE_S`."""
        ours: List[TurnEvent] = []
        headers = {"Accept": "text/event-stream", "Last-Event-ID": str(after or 0)}
        url = f"/v1/turns/{self.turn_id}/events"
        try:
            with contextlib.closing(self.gate._sse(url, headers, None, _events.EVENT_PROBE_IDLE_S)) as stream:
                for raw in stream:
                    event = _events.turn_event(raw)
                    if event.name == "end":
                        break
                    if event.attempt == self.attempt:
                        ours.append(event)
                        if len(ours) == count:
                            break
        except httpx.ReadTimeout:
            pass
        return _events.landed_count(ours, self.attempt, count)

    # --- tools ----------------------------------------------------------

    def claim_tool(self, name: str, args: Any, wait: float = _core.TOOL_WAIT_DEFAULT_S) -> Tuple[bool, Any]:
        """Claim one tool call: ``(True, ToolContext)`` to run it, or
        ``(False, stored result)``. Waits up to ``wait`` seconds while the
        same call is in flight under this turn (``tool_in_flight``) and
        while the claim's answer is lost (sent again: a claim is safe to
        repeat). A claim of this turn's whose answer was lost is adopted,
        failed as never run and claimed again (see ``HeldExecutions``).
        Raises :class:`~agentgate.TurnCancelled`, claiming nothing, once
        the turn was asked to stop."""
        self.check_cancelled()
        claim = _core.ClaimAttempts(self._executions, wait)
        while True:
            try:
                data = self._call("POST", f"/v1/turns/{self.turn_id}/tools", {"tool": name, "args": args})[1]
            except BaseException as error:
                lost = claim.refused(error)
                if lost is not None:
                    self._fail_lost_claim(lost)
                    continue
            else:
                result = claim.answered(name, args, data, self)
                if result is not None:
                    return result
            if self.lost.wait(claim.pause_s()):
                self.check()

    def _fail_lost_claim(self, execution_id: str) -> None:
        self._write(
            f"/v1/turns/{self.turn_id}/tools/{execution_id}/fail",
            {"error": _core.LOST_CLAIM_ERROR},
            lambda: self._execution_landed(execution_id, "failed"),
        )

    def complete_tool(self, ctx: ToolContext, result: Any) -> None:
        """Record the execution's result (repeated if the answer is lost)."""
        self._write(
            f"/v1/turns/{self.turn_id}/tools/{ctx.execution_id}/complete",
            {"result": result},
            lambda: self._execution_landed(ctx.execution_id, "succeeded"),
        )

    def fail_tool(self, ctx: ToolContext, error: Any) -> None:
        """Record the execution failed; a later claim runs it again."""
        self._write(
            f"/v1/turns/{self.turn_id}/tools/{ctx.execution_id}/fail",
            {"error": error},
            lambda: self._execution_landed(ctx.execution_id, "failed"),
        )

    def tool(
        self,
        name: str,
        args: Any,
        run: Callable[[ToolContext], T],
        reconcile: Optional[Callable[[ToolContext], Any]] = None,
        wait: float = _core.TOOL_WAIT_DEFAULT_S,
    ) -> T:
        """Book one tool call exactly once.

        Claims ``(name, args)``; if the server says execute, calls
        ``run(ctx)`` and records its result, else returns the stored result
        without calling it. Once the turn was asked to stop it raises
        :class:`~agentgate.TurnCancelled` instead, claiming nothing. When an earlier attempt died mid-call
        (``ctx.previous_outcome == "unknown"``) and ``reconcile`` is given,
        ``reconcile(ctx)`` runs first: a non-``None`` answer is recorded as
        the result and ``run`` is not called. If ``run`` raises, the
        execution is recorded failed (a later claim runs it again with
        ``previous_outcome == "failed"``) and the exception propagates.
        """
        execute, claimed = self.claim_tool(name, args, wait)
        if not execute:
            return claimed  # type: ignore[no-any-return]
        ctx: ToolContext = claimed
        if ctx.previous_outcome == "unknown" and reconcile is not None:
            found = reconcile(ctx)
            if found is not None:
                self.complete_tool(ctx, found)
                return found  # type: ignore[no-any-return]
        try:
            ctx.check()
            result = run(ctx)
        except LeaseLost:
            raise
        except BaseException as error:
            try:
                self.fail_tool(ctx, _core.error_json(error))
            except (AgentgateError, httpx.HTTPError):
                pass
            raise
        problem = _core.json_problem(result)
        if problem is not None:
            self.fail_tool(ctx, _core.error_json(problem))
            raise TypeError(f"tool {name}: its result is not JSON ({problem}); the execution was failed")
        self.complete_tool(ctx, result)
        return result


class _Emitter:
    """A turn's events not appended yet, and the thread that appends them:
    at most :data:`~agentgate._events.EVENT_FLUSH_INTERVAL_S` after the
    first one waits, at once when a batch is full. One append at a time,
    so the log holds them in the order emitted."""

    def __init__(self, turn: Turn) -> None:
        self._turn = turn
        self._cond = threading.Condition()
        #: One append at a time (the background thread, ``flush``, the ending).
        self._sending = threading.Lock()
        self._buffer = _events.EventBuffer()
        self._thread: Optional[threading.Thread] = None
        self._closed = False
        #: A background append's failure, raised by the next ``emit``.
        self._error: Optional[BaseException] = None
        #: An append of the buffer's first batch got no answer: it may be in.
        self._in_doubt = False
        self.last_event_id: Optional[int] = None

    def emit(self, name: str, data: Any, size: int) -> None:
        with self._cond:
            if self._error is not None:
                error, self._error = self._error, None
                raise error
            self._buffer.add(name, data, size)
            full = self._buffer.full()
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._loop, name=f"agentgate-events-{self._turn.turn_id}", daemon=True
                )
                self._thread.start()
            self._cond.notify_all()
        if full:
            self.flush()

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._buffer and not self._closed:
                    self._cond.wait()
                deadline = time.monotonic() + _events.EVENT_FLUSH_INTERVAL_S
                while not self._closed and not self._buffer.batch_ready():
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        break
                    self._cond.wait(remaining)
                if self._closed:
                    return  # the ending appended what was left
            try:
                self.flush()
            except BaseException as error:
                with self._cond:
                    # Raised by the next emit; the thread stops until then
                    # (a lost lease would fail every try).
                    self._error = error
                    self._thread = None
                return

    def flush(self) -> Optional[int]:
        with self._sending:
            while True:
                with self._cond:
                    batch = self._buffer.take_batch()
                if not batch:
                    with self._cond:
                        self._error = None
                    return self.last_event_id
                try:
                    self.last_event_id = self._turn._append_events(batch, self.last_event_id, self._in_doubt)
                    self._in_doubt = False
                except BaseException as error:
                    if isinstance(error, _core.WRITE_TRANSIENT):
                        self._in_doubt = True
                    if not isinstance(error, LeaseLost):
                        with self._cond:
                            self._buffer.put_back(batch)
                    raise

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(_core.HEARTBEAT_JOIN_S)


class Follower:
    """A turn's events, from :meth:`Gate.follow`: iterate it, each
    :class:`~agentgate.TurnEvent` once and in order, then the ``end``.

    ``last_event_id`` (where a resume starts), ``reconnects`` (connections
    that ended without ``end``) and ``end`` (the ending, once seen) say
    how it went. ``close()`` (or ``with``) stops it early."""

    def __init__(
        self, gate: Gate, turn_id: str, plan: _events.FollowPlan, params: Optional[Mapping[str, Any]]
    ) -> None:
        self._gate = gate
        self._path = f"/v1/turns/{turn_id}/events"
        self._plan = plan
        self._params = params
        self._events = self._generate()

    def __iter__(self) -> "Follower":
        return self

    def __next__(self) -> TurnEvent:
        return next(self._events)

    def close(self) -> None:
        self._events.close()

    def __enter__(self) -> "Follower":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    @property
    def last_event_id(self) -> int:
        return self._plan.last_id

    @property
    def reconnects(self) -> int:
        return self._plan.reconnects

    @property
    def end(self) -> Optional[TurnEvent]:
        return self._plan.end

    def _generate(self) -> Generator[TurnEvent, None, None]:
        plan = self._plan
        while True:
            failure: Optional[BaseException] = None
            try:
                url = plan.url() + self._path
                with contextlib.closing(
                    self._gate._sse(url, plan.headers(), self._params, _events.FOLLOW_READ_TIMEOUT_S)
                ) as stream:
                    for raw in stream:
                        try:
                            event = plan.accept(raw)
                        except AgentgateError as error:
                            failure = error  # an `error` event: raised, not resumed
                            break
                        if event is not None:
                            yield event
                            if event.name == "end":
                                return
            except (httpx.TransportError, AgentgateError) as error:
                plan.dropped(error)
            else:
                if failure is not None:
                    raise failure
                plan.dropped(None)
            time.sleep(plan.pause_s())


class RecoveryWorker(Generic[R]):
    """A recovery worker (docs/protocol.md §8): claims orphans (turns whose
    worker died) and queue heads nobody took, and runs ``handler`` on each,
    then on the rest of its session's queue (:meth:`Gate.drain_turn`).

    ``handler(turn)`` gets the claimed turn: ``turn.payload``,
    ``turn.journal`` (its tool calls so far, every page) and ``turn.tool``,
    which returns the stored result of a call that already succeeded and
    hands an ``unknown`` one to ``reconcile``. Its return value completes
    the turn; an exception fails it (retryable) and goes to ``on_error``
    (default: logged), and the worker carries on.

    ``worker.run()`` loops until ``worker.stop()`` (from another thread, a
    signal handler), or ``max_turns`` turns ran, or (``until_idle``) a claim
    found nothing; with nothing to claim it sleeps 0.2 s doubling to 5 s.
    ``stop()`` lets the turn in hand finish and takes no next one: what is
    still queued stays for another worker. ``run_once()`` is one claim and
    its drain.
    """

    def __init__(
        self,
        gate: Gate,
        handler: Callable[[Turn], R],
        *,
        min_orphaned_ms: int = _core.RECOVERY_MIN_ORPHANED_MS,
        user_ids: Optional[Sequence[str]] = None,
        turn_ids: Optional[Sequence[str]] = None,
        drain: bool = True,
        on_error: Optional[Callable[[Turn, BaseException], Any]] = None,
    ) -> None:
        self.gate = gate
        self.handler = handler
        self._filter = (min_orphaned_ms, user_ids, turn_ids)
        self._drain = drain
        self._on_error = on_error
        self._stopping = threading.Event()
        self._in_hand: Optional[Turn] = None
        #: Claims that found a turn; turns run (claimed and handed off);
        #: handler errors.
        self.claims = 0
        self.turns = 0
        self.errors = 0

    def stop(self) -> None:
        """Stop after the turn in hand (it ends without a handoff)."""
        self._stopping.set()
        held = self._in_hand
        if held is not None:
            held.take_next = False

    @property
    def stopping(self) -> bool:
        return self._stopping.is_set()

    def _hold(self, turn: Optional[Turn]) -> None:
        self._in_hand = turn
        if turn is not None and self._stopping.is_set():
            turn.take_next = False

    def run_once(self, max_turns: int = _core.DRAIN_MAX_TURNS) -> List[TurnResult[R]]:
        """One claim, and the drain of its session: what each turn came to
        (a handler's failure as ``state == "failed"``); ``[]`` when there
        was nothing to claim. Claim refusals raise."""
        turn = self.gate.claim_orphan(*self._filter)
        if turn is None:
            return []
        self.claims += 1
        results: List[TurnResult[R]] = []
        try:
            self.gate._drain(
                turn, self.handler, max_turns if self._drain else 1, self._stopping.is_set, results, self._hold
            )
        except Exception as error:
            failed = self._in_hand or turn
            results.append(TurnResult(failed.turn_id, failed.state or "running", False))
            self.errors += 1
            if self._on_error is not None:
                self._on_error(failed, error)
            else:
                log.exception("agentgate recovery: turn %s failed in its handler", failed.turn_id)
        finally:
            self._in_hand = None
            self.turns += len(results)
        return results

    def run(self, max_turns: Optional[int] = None, until_idle: bool = False) -> int:
        """Claim and run until stopped; the number of turns run."""
        ran = 0
        pause = 0.0
        while not self._stopping.is_set():
            budget = _core.DRAIN_MAX_TURNS if max_turns is None else min(_core.DRAIN_MAX_TURNS, max_turns - ran)
            try:
                results = self.run_once(budget)
            except _core.RECOVERY_WAITABLE as error:
                log.info("agentgate recovery: claim not answered (%s); trying again", error)
                results = []
            else:
                if not results and until_idle:
                    break
            if results:
                ran += len(results)
                pause = 0.0
                if max_turns is not None and ran >= max_turns:
                    break
                continue
            pause, jittered = _core.recovery_pause_s(pause)
            self._stopping.wait(jittered)
        return ran
