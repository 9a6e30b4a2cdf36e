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

import functools
import threading
import time
from types import TracebackType
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple, Type, TypeVar, overload

import httpx

from . import _core
from ._core import F, R, Tool, ToolContext, ToolDecorator, ToolSpec, TurnResult, current_turn
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
        """Take over the orphan whose lease died longest ago, or ``None``.

        The returned turn is already granted and heartbeating; use it as
        ``with turn:`` exactly like a begun one, resuming from
        ``turn.payload`` (``turn.journal`` lists its tool calls so far).
        """
        body: Dict[str, Any] = {}
        if min_orphaned_ms is not None:
            body["min_orphaned_ms"] = min_orphaned_ms
        if user_ids is not None:
            body["user_ids"] = list(user_ids)
        if turn_ids is not None:
            body["turn_ids"] = list(turn_ids)
        status, data = self.request("POST", "/v1/orphans/claim", body)
        if status == 204:
            return None
        grant = data["turn"]
        turn = Turn(
            self, grant["user_id"], grant["session_id"], grant["client_request_id"], data.get("payload"), 0.0, None
        )
        turn.journal = list(data.get("journal") or [])
        turn.orphaned_for_ms = data.get("orphaned_for_ms")
        turn._granted(grant)
        return turn

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
    ``queue_position``.
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
        self.ended = False
        self._lease_token: Optional[str] = None
        self._ending = False
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
        body's own exception (the lease may be gone already)."""
        try:
            self.fail(error, retryable=retryable)
        except (AgentgateError, httpx.HTTPError):
            pass

    def _end_cancelled_quietly(self) -> None:
        """End the turn ``cancelled`` with ``partial`` on the way out."""
        partial = self.partial if _core.json_problem(self.partial) is None else None
        try:
            self.end_cancelled(partial)
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

    def _end(self, path: str, state: str, body: Dict[str, Any]) -> Dict[str, Any]:
        self.check()
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
        record = dict(data.get("turn", data)) if isinstance(data, Mapping) else {}
        self.state = str(record.get("state", state))
        return record

    def complete(self, response: Any) -> Dict[str, Any]:
        """End the turn ``succeeded`` with ``response`` (what a replay returns)."""
        return self._end("complete", "succeeded", {"response": response})

    def fail(self, error: Any, retryable: bool = True) -> Dict[str, Any]:
        """End the turn ``failed``; a retryable failure restarts on a repeat."""
        return self._end("fail", "failed", {"error": error, "retryable": retryable})

    def await_confirmation(self, pending: Any) -> Dict[str, Any]:
        """End the turn waiting for a person's decision on ``pending``."""
        return self._end("await-confirmation", "awaiting_confirmation", {"pending": pending})

    def end_cancelled(self, partial: Any = None) -> Dict[str, Any]:
        """End the turn ``cancelled`` with what it had produced: the answer
        to a cancel request (or an interrupt), which a repeat replays."""
        return self._end("end-cancelled", "cancelled", {"partial": partial})

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
