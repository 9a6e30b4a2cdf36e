"""The asyncio client: :class:`AsyncGate` and :class:`AsyncTurn`, on
``httpx.AsyncClient``.

A turn's heartbeat is an asyncio task. When the lease is lost it sets
``turn.lost`` (an ``asyncio.Event``) and cancels the task that entered
``async with gate.turn(...)``; the block then raises
:class:`~agentgate.LeaseLost` instead of the ``CancelledError``.

When a heartbeat answers ``cancel_requested`` (a cancel, or another
message sent with ``on_busy="interrupt"``) it sets ``turn.cancelled`` and
cancels that task too, so a body awaiting a long model call stops within
one heartbeat interval; a tool call in progress is let finish and record
its result first (the body is cancelled when no tool runs). The turn then
ends ``cancelled`` with ``turn.partial`` and the block raises
:class:`~agentgate.TurnCancelled`.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from types import TracebackType
from typing import (
    Any,
    AsyncGenerator,
    Awaitable,
    Callable,
    Dict,
    Generic,
    List,
    Mapping,
    Optional,
    Sequence,
    Tuple,
    Type,
    TypeVar,
    overload,
)

import httpx

from . import _core, _events
from ._core import AF, AsyncTool, AsyncToolDecorator, R, ToolContext, ToolSpec, TurnResult, current_turn
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
    """The typed error of an answer that is not a success (body read)."""
    data: Any = None
    if response.content:
        try:
            data = response.json()
        except ValueError:
            data = None
    return error_for(response.status_code, data, response.headers.get("retry-after"))


async def _maybe_await(value: Any) -> Any:
    return await value if asyncio.iscoroutine(value) or isinstance(value, asyncio.Future) else value


class AsyncGate:
    """The asyncio twin of :class:`~agentgate.Gate`; every call is awaited.

    ``AsyncGate(base_url, api_key=None, timeout=35.0)``. Close it with
    ``await gate.aclose()`` or ``async with AsyncGate(...)``.
    """

    def __init__(
        self,
        base_url: str,
        api_key: Optional[str] = None,
        timeout: float = 35.0,
        *,
        http_client: Optional[httpx.AsyncClient] = None,
    ) -> None:
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._http = http_client or httpx.AsyncClient(
            base_url=base_url.rstrip("/"), timeout=timeout, headers=headers, limits=_core.http_limits()
        )

    async def aclose(self) -> None:
        await self._http.aclose()

    async def __aenter__(self) -> "AsyncGate":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.aclose()

    async def request(
        self,
        method: str,
        path: str,
        body: Any = _NO_BODY,
        *,
        lease_token: Optional[str] = None,
        params: Optional[Mapping[str, Any]] = None,
        timeout: Optional[float] = None,
    ) -> Tuple[int, Any]:
        """One call: ``(status, parsed JSON or None)`` for a 2xx answer;
        raises the typed error otherwise (see :meth:`Gate.request`)."""
        headers = {"Lease-Token": lease_token} if lease_token is not None else None
        response = await self._http.request(
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
    ) -> "AsyncTurn":
        """``async with gate.turn(...) as turn:``; see :meth:`Gate.turn`."""
        turn = AsyncTurn(self, user_id, session_id, client_request_id, payload, wait, confirmation)
        turn.on_busy = _core.busy_policy(on_busy, wait_ms, interrupt_running)
        turn.on_queued = on_queued
        return turn

    @overload
    async def run(
        self,
        user_id: str,
        session_id: str,
        client_request_id: str,
        payload: Any,
        fn: Callable[["AsyncTurn"], Awaitable[R]],
        wait: Optional[float] = None,
        *,
        confirmation: Optional[Mapping[str, str]] = None,
        on_busy: Optional[str] = None,
        wait_ms: Optional[int] = None,
        interrupt_running: bool = False,
        on_queued: Optional[Callable[[int], Any]] = None,
    ) -> TurnResult[R]: ...

    @overload
    async def run(
        self,
        user_id: str,
        session_id: str,
        client_request_id: str,
        payload: Any,
        fn: Callable[["AsyncTurn"], R],
        wait: Optional[float] = None,
        *,
        confirmation: Optional[Mapping[str, str]] = None,
        on_busy: Optional[str] = None,
        wait_ms: Optional[int] = None,
        interrupt_running: bool = False,
        on_queued: Optional[Callable[[int], Any]] = None,
    ) -> TurnResult[R]: ...

    async def run(
        self,
        user_id: str,
        session_id: str,
        client_request_id: str,
        payload: Any,
        fn: Callable[["AsyncTurn"], Any],
        wait: Optional[float] = None,
        *,
        confirmation: Optional[Mapping[str, str]] = None,
        on_busy: Optional[str] = None,
        wait_ms: Optional[int] = None,
        interrupt_running: bool = False,
        on_queued: Optional[Callable[[int], Any]] = None,
    ) -> TurnResult[Any]:
        """Run ``fn(turn)`` (a coroutine function, or a plain one) in a turn
        and complete it with the result, saying how the message ended; see
        :meth:`Gate.run`."""
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
        return await self._run_turn(turn, fn)

    async def _run_turn(self, turn: "AsyncTurn", fn: Callable[["AsyncTurn"], Any]) -> TurnResult[Any]:
        """See :meth:`Gate._run_turn`."""
        try:
            async with turn:
                value = await _maybe_await(fn(turn))
                if not turn.ended:
                    await turn.complete(value)
        except Replayed as replay:
            return TurnResult.of_replay(replay.turn)
        except TurnCancelled:
            if turn.state != "cancelled":
                raise
            return TurnResult(turn.turn_id, "cancelled", False, partial=turn.partial)
        return TurnResult(turn.turn_id, turn.state, False, value=value)

    @overload
    async def run_turn(
        self,
        user_id: str,
        session_id: str,
        client_request_id: str,
        payload: Any,
        fn: Callable[["AsyncTurn"], Awaitable[R]],
        wait: Optional[float] = None,
        *,
        confirmation: Optional[Mapping[str, str]] = None,
        on_busy: Optional[str] = None,
        wait_ms: Optional[int] = None,
        interrupt_running: bool = False,
        on_queued: Optional[Callable[[int], Any]] = None,
    ) -> R: ...

    @overload
    async def run_turn(
        self,
        user_id: str,
        session_id: str,
        client_request_id: str,
        payload: Any,
        fn: Callable[["AsyncTurn"], R],
        wait: Optional[float] = None,
        *,
        confirmation: Optional[Mapping[str, str]] = None,
        on_busy: Optional[str] = None,
        wait_ms: Optional[int] = None,
        interrupt_running: bool = False,
        on_queued: Optional[Callable[[int], Any]] = None,
    ) -> R: ...

    async def run_turn(
        self,
        user_id: str,
        session_id: str,
        client_request_id: str,
        payload: Any,
        fn: Callable[["AsyncTurn"], Any],
        wait: Optional[float] = None,
        *,
        confirmation: Optional[Mapping[str, str]] = None,
        on_busy: Optional[str] = None,
        wait_ms: Optional[int] = None,
        interrupt_running: bool = False,
        on_queued: Optional[Callable[[int], Any]] = None,
    ) -> Any:
        """Run ``fn(turn)`` (a coroutine function, or a plain one) in a turn
        and complete it with the result; on a replay return the stored
        response without calling ``fn``. See :meth:`Gate.run_turn`."""
        result = await self.run(
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
        return result.value

    async def claim_orphan(
        self,
        min_orphaned_ms: Optional[int] = None,
        user_ids: Optional[Sequence[str]] = None,
        turn_ids: Optional[Sequence[str]] = None,
    ) -> Optional["AsyncTurn"]:
        """Take over the oldest orphan (or a queue head left free), or
        ``None``; use the turn as ``async with turn:`` or hand it to
        :meth:`drain_turn` (see :meth:`Gate.claim_orphan`)."""
        body = _core.claim_filter(min_orphaned_ms, user_ids, turn_ids)
        status, data = await self.request("POST", "/v1/orphans/claim", body)
        if status == 204:
            return None
        grant = data["turn"]
        turn = AsyncTurn(
            self, grant["user_id"], grant["session_id"], grant["client_request_id"], data.get("payload"), 0.0, None
        )
        turn.orphaned_for_ms = data.get("orphaned_for_ms")
        turn._granted(grant)
        try:
            turn.journal = await self._journal(grant["turn_id"], data)
        except BaseException:
            turn._stop_heartbeat()  # nobody will run it: let its lease run out
            raise
        return turn

    async def _journal(self, turn_id: str, claimed: Mapping[str, Any]) -> List[Dict[str, Any]]:
        """See :meth:`Gate._journal`."""
        journal = list(claimed.get("journal") or [])
        after = claimed.get("journal_next")
        for _ in range(_core.EXECUTION_PAGES_MAX):
            if after is None:
                return journal
            params = {"after": after, "limit": _core.EXECUTION_PAGE_LIMIT}
            page = (await self.request("GET", f"/v1/turns/{turn_id}/executions", params=params))[1]
            journal.extend(_core.journal_entry(execution) for execution in page["executions"])
            after = page.get("executions_next")
        raise UnexpectedResponse(f"turn {turn_id}: more executions than a turn holds")

    async def drain(
        self,
        session_id: str,
        handler: Callable[["AsyncTurn"], Any],
        *,
        user_id: Optional[str] = None,
        max_turns: int = _core.DRAIN_MAX_TURNS,
    ) -> List[TurnResult[Any]]:
        """Run ``handler`` (a coroutine function, or a plain one) on every
        message the session still owes, in order; see :meth:`Gate.drain`."""
        session = (await self.request("GET", f"/v1/sessions/{session_id}", params=_core.owner(user_id)))[1]["session"]
        ids = _core.drain_claim_ids(session)
        if not ids:
            return []
        turn = await self.claim_orphan(
            min_orphaned_ms=0, user_ids=None if user_id is None else [user_id], turn_ids=ids
        )
        if turn is None:
            return []
        return await self.drain_turn(turn, handler, max_turns=max_turns)

    async def drain_turn(
        self, turn: "AsyncTurn", handler: Callable[["AsyncTurn"], Any], *, max_turns: int = _core.DRAIN_MAX_TURNS
    ) -> List[TurnResult[Any]]:
        """Run ``handler`` on ``turn``, then on each message queued behind
        it, through the handoff; see :meth:`Gate.drain_turn`."""
        results: List[TurnResult[Any]] = []
        await self._drain(turn, handler, max_turns, lambda: False, results, lambda held: None)
        return results

    async def _drain(
        self,
        turn: "AsyncTurn",
        handler: Callable[["AsyncTurn"], Any],
        max_turns: int,
        stopping: Callable[[], bool],
        results: List[TurnResult[Any]],
        hold: Callable[[Optional["AsyncTurn"]], None],
    ) -> None:
        """See :meth:`Gate._drain`."""
        if max_turns < 1:
            raise ValueError(f"max_turns must be >= 1, not {max_turns}")
        current: Optional[AsyncTurn] = turn
        try:
            while current is not None:
                current.take_next = len(results) + 1 < max_turns and not stopping()
                hold(current)
                try:
                    results.append(await self._run_turn(current, handler))
                except BaseException:
                    if current.next is not None:
                        current.next._stop_heartbeat()  # see Gate._drain
                    raise
                current = current.next
        finally:
            hold(None)

    def follow(
        self,
        turn_id: str,
        after: int = 0,
        *,
        user_id: Optional[str] = None,
        base_urls: Optional[Sequence[str]] = None,
        max_reconnects: int = _events.FOLLOW_MAX_RECONNECTS,
    ) -> "AsyncFollower":
        """Follow a turn's events: ``async for event in gate.follow(turn_id):``;
        see :meth:`Gate.follow`. ``await follower.aclose()`` (or ``async
        with``) stops it early."""
        urls = list(base_urls) if base_urls is not None else [str(self._http.base_url)]
        return AsyncFollower(self, turn_id, _events.FollowPlan(after, urls, max_reconnects), _core.owner(user_id))

    async def _follow_to_end(self, turn_id: str, seconds: float, user_id: Optional[str]) -> str:
        """Follows ``turn_id``'s events for its ``end``, at most ``seconds``
        (for a begin refused ``request_in_flight``, see
        :meth:`_core.BeginAttempts.follow`): ``"end"``, ``"timeout"`` or
        ``"failed"``. Asks for no event, only the ``end``."""
        params: Dict[str, Any] = {"after": _core.IN_FLIGHT_FOLLOW_AFTER, **(_core.owner(user_id) or {})}
        headers = {"Accept": "text/event-stream"}

        async def follow() -> str:
            async with self._http.stream(
                "GET", f"/v1/turns/{turn_id}/events", headers=headers, params=params, timeout=seconds + 1.0
            ) as response:
                if response.status_code != 200:
                    return "failed"
                parser = _events.SseParser()
                async for chunk in response.aiter_bytes():
                    if any(event.event == "end" for event in parser.feed(chunk)):
                        return "end"
            return "failed"  # closed without `end`

        try:
            return await asyncio.wait_for(follow(), seconds)
        except asyncio.TimeoutError:
            return "timeout"
        except httpx.TransportError:
            return "failed"

    async def get_turn(self, turn_id: str) -> Dict[str, Any]:
        return dict((await self.request("GET", f"/v1/turns/{turn_id}"))[1])

    async def request_cancel(self, turn_id: str, user_id: Optional[str] = None) -> Dict[str, Any]:
        """``POST /v1/turns/{id}/cancel``; see :meth:`Gate.request_cancel`."""
        return dict((await self.request("POST", f"/v1/turns/{turn_id}/cancel", {}, params=_core.owner(user_id)))[1])

    async def cancel(self, turn_id: str, user_id: Optional[str] = None) -> Dict[str, Any]:
        """Ask a turn to stop; see :meth:`Gate.cancel`."""
        return await self.request_cancel(turn_id, user_id)

    async def set_policy(
        self,
        session_id: str,
        user_id: str,
        on_busy: str,
        wait_ms: Optional[int] = None,
        interrupt_running: bool = False,
    ) -> Dict[str, Any]:
        """``PUT /v1/sessions/{id}/policy``; see :meth:`Gate.set_policy`."""
        body = {"user_id": user_id, **_core.busy_policy(on_busy, wait_ms, interrupt_running)}
        data = (await self.request("PUT", f"/v1/sessions/{session_id}/policy", body))[1]
        return dict(data["session"])

    async def release_session(self, session_id: str, user_id: Optional[str] = None) -> Optional[Dict[str, Any]]:
        """``POST /v1/sessions/{id}/release``; see :meth:`Gate.release_session`."""
        data = (await self.request("POST", f"/v1/sessions/{session_id}/release", {}, params=_core.owner(user_id)))[1]
        released = data["released"]
        return None if released is None else dict(released)

    async def get_session(self, session_id: str) -> Dict[str, Any]:
        return dict((await self.request("GET", f"/v1/sessions/{session_id}"))[1])

    async def get_user(self, user_id: str) -> Dict[str, Any]:
        return dict((await self.request("GET", f"/v1/users/{user_id}"))[1])

    @overload
    def tool(self, function: AF) -> AsyncTool[AF]: ...

    @overload
    def tool(
        self, *, name: Optional[str] = None, reconcile: Optional[Callable[[ToolContext], Any]] = None
    ) -> AsyncToolDecorator: ...

    def tool(
        self,
        function: Optional[Callable[..., Any]] = None,
        *,
        name: Optional[str] = None,
        reconcile: Optional[Callable[[ToolContext], Any]] = None,
    ) -> Any:
        """``@gate.tool`` for ``async def`` functions (``reconcile`` may be
        sync or async); see :meth:`Gate.tool`. Tasks started inside the
        body (``asyncio.gather``, ``create_task``) inherit the turn."""

        def decorate(f: Callable[..., Any]) -> Callable[..., Any]:
            spec = ToolSpec.of(f, name, reconcile)

            @functools.wraps(f)
            async def wrapper(*args: Any, **kwargs: Any) -> Any:
                turn = current_turn.get()
                if not isinstance(turn, AsyncTurn):
                    raise NoActiveTurn(f"tool {spec.name} called outside a turn")
                tool_args = spec.bind(args, kwargs)
                return await turn.tool(
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


class AsyncTurn:
    """One turn under asyncio; the attributes of :class:`~agentgate.Turn`,
    with ``lost`` and ``cancelled`` each an ``asyncio.Event``."""

    def __init__(
        self,
        gate: AsyncGate,
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
        self.turn_id: str = ""
        self.fence: int = 0
        self.attempt: int = 0
        self.takeover: bool = False
        self.lease_ttl_ms: int = 0
        self.confirmation: Optional[Dict[str, Any]] = None
        self.journal: List[Dict[str, Any]] = []
        self.orphaned_for_ms: Optional[int] = None
        self.lost = asyncio.Event()
        self.lost_error: Optional[LeaseLost] = None
        self.cancelled = asyncio.Event()
        #: What an interrupted turn ends ``cancelled`` with (its response).
        self.partial: Any = None
        self.state: str = ""
        self.queue_position: Optional[int] = None
        self.on_queued: Optional[Callable[[int], Any]] = None
        #: See :attr:`Turn.take_next` and :attr:`Turn.next`.
        self.take_next = False
        self.next: Optional[AsyncTurn] = None
        self.ended = False
        self._lease_token: Optional[str] = None
        self._ending = False
        self._emitter: Optional[_AsyncEmitter] = None
        self._exiting = False
        self._heartbeat_task: Optional["asyncio.Task[None]"] = None
        self._body_task: Optional["asyncio.Task[Any]"] = None
        #: How many times this turn cancelled its body task (each is taken
        #: back with ``uncancel`` on the way out), and why the first time.
        self._body_cancels = 0
        self._body_cancelled_for = ""
        #: Tool calls in progress: a cancel request waits for them to end.
        self._tools_running = 0
        self._context_token: Any = None
        self._executions = _core.HeldExecutions()

    def __repr__(self) -> str:
        return (
            f"AsyncTurn(turn_id={self.turn_id!r}, attempt={self.attempt}, fence={self.fence}, takeover={self.takeover})"
        )

    async def _begin(self) -> None:
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
                status, data = await self.gate.request("POST", "/v1/turns", body)
            except BaseException as refusal:
                attempts.refused(refusal)
            else:
                if attempts.answered(status, data):
                    break
            follow = attempts.follow()
            if follow is not None:
                outcome = await self.gate._follow_to_end(follow[0], follow[1], self.user_id)
                if attempts.followed(follow[0], outcome):
                    continue
            pause = attempts.pause_s()
            if pause is None:
                if attempts.queued is not None:
                    raise await self._withdraw(attempts.queued)
                raise attempts.give_up()
            await asyncio.sleep(pause)
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

    async def _withdraw(self, queued: Mapping[str, Any]) -> BaseException:
        """See :meth:`Turn._withdraw`."""
        try:
            await self.gate.request_cancel(str(queued["turn_id"]), self.user_id)
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
        self._heartbeat_task = asyncio.get_running_loop().create_task(
            self._heartbeat_loop(), name=f"agentgate-heartbeat-{self.turn_id}"
        )

    async def __aenter__(self) -> "AsyncTurn":
        if self._lease_token is None:
            await self._begin()
        self._body_task = asyncio.current_task()
        self._context_token = current_turn.set(self)
        return self

    async def __aexit__(
        self,
        exc_type: Optional[Type[BaseException]],
        exc: Optional[BaseException],
        traceback: Optional[TracebackType],
    ) -> Optional[bool]:
        self._exiting = True
        if self._context_token is not None:
            current_turn.reset(self._context_token)
            self._context_token = None
        if self._body_cancels:
            await self._absorb_our_cancellation(exc)
            if self._body_cancelled_for == "lost" or self.lost.is_set():
                self._stop_heartbeat()
                raise self._lost_exception() from exc
            if self.ended and not isinstance(exc, asyncio.CancelledError):
                # The body took the cancellation and ended the turn itself.
                self._stop_heartbeat()
                return None
            try:
                if not self.ended:
                    await self._end_cancelled_quietly()
            finally:
                self._stop_heartbeat()
            raise TurnCancelled(
                f"turn {self.turn_id}: asked to stop (cancel or interrupt); the body was cancelled"
                " and the turn ended cancelled with turn.partial"
            ) from exc
        try:
            if exc is None:
                if self.ended:
                    return None
                self.check()
                if self.cancelled.is_set():
                    await self._end_cancelled_quietly()
                    raise TurnCancelled(
                        f"turn {self.turn_id}: asked to stop, and the body exited without ending it;"
                        " it was ended cancelled with turn.partial"
                    )
                await self._fail_quietly({"type": "TurnNotEnded", "message": "the turn's body exited without ending it"})
                raise TurnNotEnded(
                    f"turn {self.turn_id}: the body exited without turn.complete(...); the turn was failed (retryable)"
                )
            if self.ended or self.lost.is_set() or isinstance(exc, LeaseLost):
                return None
            if isinstance(exc, TurnCancelled) or self.cancelled.is_set():
                # See Turn.__exit__: asked to stop, the turn ends as asked.
                await self._end_cancelled_quietly()
                return None
            await self._fail_quietly(_core.error_json(exc), _core.retryable(exc))
            return None
        finally:
            self._stop_heartbeat()

    async def _absorb_our_cancellation(self, exc: Optional[BaseException]) -> None:
        """The heartbeat cancelled the body (a lost lease, a cancel
        request): take that cancellation back so it does not leak past the
        ``async with``."""
        task = self._body_task
        if not isinstance(exc, asyncio.CancelledError):
            # Requested but not delivered yet (the body ended first): let it
            # arrive here rather than at the caller's next await.
            try:
                await asyncio.sleep(0)
            except asyncio.CancelledError:
                pass
        uncancel = getattr(task, "uncancel", None)
        if uncancel is not None:
            for _ in range(self._body_cancels):
                uncancel()

    async def _fail_quietly(self, error: Any, retryable: bool = True) -> None:
        try:
            await self._end("fail", "failed", {"error": error, "retryable": retryable}, take_next=False, strict=False)
        except (AgentgateError, httpx.HTTPError):
            pass

    async def _end_cancelled_quietly(self) -> None:
        partial = self.partial if _core.json_problem(self.partial) is None else None
        try:
            await self._end("end-cancelled", "cancelled", {"partial": partial}, take_next=self.take_next, strict=False)
        except (AgentgateError, httpx.HTTPError):
            pass

    def _stop_heartbeat(self) -> None:
        task = self._heartbeat_task
        if task is not None and task is not asyncio.current_task():
            task.cancel()

    async def _heartbeat_loop(self) -> None:
        ttl_s = self.lease_ttl_ms / 1000.0
        interval = max(ttl_s / 3, _core.HEARTBEAT_MIN_INTERVAL_S)
        renewed_at = time.monotonic()
        while True:
            await asyncio.sleep(interval)
            if self._ending or self.ended:
                return
            sent_at = time.monotonic()
            # No answer past the local deadline is worth waiting for.
            timeout = max(ttl_s - (sent_at - renewed_at), _core.HEARTBEAT_MIN_TIMEOUT_S)
            try:
                _, data = await self._call(
                    "POST", f"/v1/turns/{self.turn_id}/heartbeat", from_heartbeat=True, timeout=timeout
                )
            except LeaseLost:
                return
            except (AgentgateError, httpx.HTTPError):
                if time.monotonic() - renewed_at >= ttl_s:
                    self._mark_lost(LeaseLost("lease could not be renewed before its local deadline"), True)
                    return
                interval = max(min(ttl_s / 3, _core.HEARTBEAT_RETRY_S), _core.HEARTBEAT_MIN_INTERVAL_S)
                continue
            renewed_at = sent_at
            ttl_s = data.get("lease_expires_in_ms", self.lease_ttl_ms) / 1000.0
            interval = max(ttl_s / 3, _core.HEARTBEAT_MIN_INTERVAL_S)
            if data.get("cancel_requested") is True:
                self._mark_cancel_requested()

    def _mark_lost(self, error: LeaseLost, from_heartbeat: bool) -> None:
        if self._ending or self.ended:
            return
        if self.lost_error is None:
            self.lost_error = error
        self.lost.set()
        if from_heartbeat:
            self._cancel_body("lost")

    def _mark_cancel_requested(self) -> None:
        """A heartbeat said the turn was asked to stop: cancel the body now,
        or, while a tool call runs, as soon as none does (``tool``)."""
        if self.cancelled.is_set():
            return
        self.cancelled.set()
        if self._tools_running == 0:
            self._cancel_body("cancelled")

    def _cancel_body(self, why: str) -> None:
        body = self._body_task
        if self._ending or self.ended or self._exiting or body is None or body.done():
            return
        if not self._body_cancels:
            self._body_cancelled_for = why
        self._body_cancels += 1
        body.cancel(f"agentgate: turn {why}")

    def _lost_exception(self) -> LeaseLost:
        known = self.lost_error
        return LeaseLost(
            f"turn {self.turn_id}: lease lost ({known.message if known else 'unknown reason'})",
            status=known.status if known else None,
        )

    @property
    def lease_token(self) -> Optional[str]:
        """The secret every call under this lease sends as ``Lease-Token``
        (for raw calls through ``gate.request``); never log it."""
        return self._lease_token

    def check(self) -> None:
        """Raise :class:`~agentgate.LeaseLost` if the lease is known lost."""
        if self.lost.is_set():
            raise self._lost_exception()

    @property
    def cancel_requested(self) -> bool:
        """Whether the turn was asked to stop (``turn.cancelled`` is set)."""
        return self.cancelled.is_set()

    def check_cancelled(self) -> None:
        """Raise :class:`~agentgate.TurnCancelled` if the turn was asked to stop."""
        if self.cancelled.is_set():
            raise TurnCancelled(f"turn {self.turn_id}: asked to stop (cancel or interrupt)")

    async def _call(
        self,
        method: str,
        path: str,
        body: Any = _NO_BODY,
        *,
        from_heartbeat: bool = False,
        timeout: Optional[float] = None,
    ) -> Tuple[int, Any]:
        self.check()
        try:
            return await self.gate.request(method, path, body, lease_token=self._lease_token, timeout=timeout)
        except LeaseLost as error:
            self._mark_lost(error, from_heartbeat)
            raise
        except TurnCancelled:
            # Raised to the caller (a tool claim): no need to cancel the body too.
            self.cancelled.set()
            raise

    async def _write(
        self, path: str, body: Dict[str, Any], landed: Callable[[], Awaitable[Optional[Dict[str, Any]]]]
    ) -> Any:
        """See :meth:`Turn._write`."""
        self.check()
        pause = 0.0
        uncertain = False
        for attempt in range(1, _core.WRITE_ATTEMPTS + 1):
            try:
                return (await self.gate.request("POST", path, body, lease_token=self._lease_token))[1]
            except LeaseLost as error:
                found = await landed() if uncertain else None
                if found is not None:
                    return found
                self._mark_lost(error, False)
                raise
            except _core.WRITE_TRANSIENT as error:
                if attempt == _core.WRITE_ATTEMPTS:
                    raise
                uncertain = True
                pause = _core.next_pause_s(
                    pause, error, _core.NO_DEADLINE_S, _core.WRITE_PAUSE_MIN_S, _core.WRITE_PAUSE_MAX_S
                )
                await asyncio.sleep(pause)
        raise AssertionError("unreachable: the last attempt returns or raises")

    async def _ending_landed(self, state: str) -> Optional[Dict[str, Any]]:
        try:
            turn = (await self.gate.get_turn(self.turn_id))["turn"]
        except (AgentgateError, httpx.HTTPError):
            return None
        return {"turn": turn} if _core.landed_ending(turn, state, self.fence) else None

    async def _execution_landed(self, execution_id: str, state: str) -> Optional[Dict[str, Any]]:
        after: Optional[str] = None
        for _ in range(_core.EXECUTION_PAGES_MAX):
            params: Dict[str, Any] = {"limit": _core.EXECUTION_PAGE_LIMIT}
            if after is not None:
                params["after"] = after
            try:
                page = (await self.gate.request("GET", f"/v1/turns/{self.turn_id}/executions", params=params))[1]
            except (AgentgateError, httpx.HTTPError):
                return None
            found = _core.landed_execution(page, execution_id, state, self.fence)
            if found is not None:
                return {"execution": {"execution_id": execution_id, "state": state}} if found else None
            after = page.get("executions_next")
            if after is None:
                return None
        return None

    async def heartbeat(self) -> int:
        return int((await self._call("POST", f"/v1/turns/{self.turn_id}/heartbeat"))[1]["lease_expires_in_ms"])

    async def _end(
        self, path: str, state: str, body: Dict[str, Any], take_next: bool = False, strict: bool = True
    ) -> Dict[str, Any]:
        """See :meth:`Turn._end`."""
        self.check()
        try:
            await self.flush()
        except (AgentgateError, httpx.HTTPError):
            if strict or self.lost.is_set():
                raise
        if take_next:
            body = {**body, "take_next": True}
        self._ending = True
        try:
            data = await self._write(f"/v1/turns/{self.turn_id}/{path}", body, lambda: self._ending_landed(state))
        except LeaseLost as error:
            # Refused for good (taken over, released, expired): the lease is
            # gone, so leaving the block must not report an unended turn.
            self._ending = False
            self._mark_lost(error, False)
            raise
        except BaseException:
            self._ending = False
            raise
        self.ended = True
        self._stop_heartbeat()
        if self._emitter is not None:
            await self._emitter.close()
        record = dict(data.get("turn", data)) if isinstance(data, Mapping) else {}
        self.state = str(record.get("state", state))
        handed = data.get("next") if isinstance(data, Mapping) else None
        if isinstance(handed, Mapping):
            self.next = self._handed_off(handed)
        return record

    def _handed_off(self, handed: Mapping[str, Any]) -> "AsyncTurn":
        grant = handed["turn"]
        turn = AsyncTurn(
            self.gate, grant["user_id"], grant["session_id"], grant["client_request_id"], handed.get("payload"), 0.0, None
        )
        turn._granted(grant)
        return turn

    async def complete(self, response: Any, take_next: Optional[bool] = None) -> Dict[str, Any]:
        """See :meth:`Turn.complete`."""
        return await self._end("complete", "succeeded", {"response": response}, self._taking(take_next))

    async def fail(self, error: Any, retryable: bool = True, take_next: Optional[bool] = None) -> Dict[str, Any]:
        body = {"error": error, "retryable": retryable}
        return await self._end("fail", "failed", body, self._taking(take_next))

    async def end_cancelled(self, partial: Any = None, take_next: Optional[bool] = None) -> Dict[str, Any]:
        return await self._end("end-cancelled", "cancelled", {"partial": partial}, self._taking(take_next))

    def _taking(self, take_next: Optional[bool]) -> bool:
        return self.take_next if take_next is None else take_next

    async def emit(self, name: str, data: Any = None) -> None:
        """Add one event to the turn's log (see :meth:`Turn.emit`):
        buffered, appended in batches by a background task at most 50 ms
        after the first waiting one, at once when a batch is full, and
        before the ending. Returns at once, unless 5000 events (or 4 MiB)
        are unsent: then it awaits an append. Raises
        :class:`~agentgate.InvalidRequest`, sending nothing, for a reserved
        or malformed name or data that is not JSON or over 64 KiB."""
        size = _events.checked_event(name, data)
        self.check()
        if self.ended or self._ending:
            raise LeaseLost(f"turn {self.turn_id}: already ended; its events are closed")
        if self._emitter is None:
            self._emitter = _AsyncEmitter(self)
        await self._emitter.emit(name, data, size)

    async def flush(self) -> Optional[int]:
        """See :meth:`Turn.flush`."""
        if self._emitter is None:
            return None
        return await self._emitter.flush()

    @property
    def last_event_id(self) -> Optional[int]:
        return None if self._emitter is None else self._emitter.last_event_id

    async def _append_events(self, batch: Sequence[_events.Pending], after: Optional[int], in_doubt: bool) -> int:
        """See :meth:`Turn._append_events`."""
        path = f"/v1/turns/{self.turn_id}/events"
        body = _events.append_body(batch)
        pause = 0.0
        for attempt in range(1, _core.WRITE_ATTEMPTS + 1):
            try:
                if in_doubt:
                    landed = await self._events_landed(after, len(batch))
                    if landed is not None:
                        return landed
                    in_doubt = False
                return int((await self._call("POST", path, body))[1]["last_event_id"])
            except _core.WRITE_TRANSIENT as error:
                if attempt == _core.WRITE_ATTEMPTS:
                    raise
                in_doubt = True
                pause = _core.next_pause_s(
                    pause, error, _core.NO_DEADLINE_S, _core.WRITE_PAUSE_MIN_S, _core.WRITE_PAUSE_MAX_S
                )
                await asyncio.sleep(pause)
                self.check()
        raise AssertionError("unreachable: the last attempt returns or raises")

    async def _events_landed(self, after: Optional[int], count: int) -> Optional[int]:
        """See :meth:`Turn._events_landed`."""
        ours: List[TurnEvent] = []
        headers = {"Accept": "text/event-stream", "Last-Event-ID": str(after or 0)}
        url = f"/v1/turns/{self.turn_id}/events"
        try:
            async with self.gate._http.stream(
                "GET", url, headers=headers, timeout=_events.EVENT_PROBE_IDLE_S
            ) as response:
                if response.status_code != 200:
                    await response.aread()
                    raise _answer_error(response)
                parser = _events.SseParser()
                done = False
                async for chunk in response.aiter_bytes():
                    for raw in parser.feed(chunk):
                        event = _events.turn_event(raw)
                        if event.name == "end":
                            done = True
                            break
                        if event.attempt == self.attempt:
                            ours.append(event)
                            if len(ours) == count:
                                done = True
                                break
                    if done:
                        break
        except httpx.ReadTimeout:
            pass
        return _events.landed_count(ours, self.attempt, count)

    async def await_confirmation(self, pending: Any) -> Dict[str, Any]:
        return await self._end("await-confirmation", "awaiting_confirmation", {"pending": pending})

    async def claim_tool(self, name: str, args: Any, wait: float = _core.TOOL_WAIT_DEFAULT_S) -> Tuple[bool, Any]:
        """See :meth:`Turn.claim_tool`."""
        self.check_cancelled()
        claim = _core.ClaimAttempts(self._executions, wait)
        while True:
            try:
                data = (await self._call("POST", f"/v1/turns/{self.turn_id}/tools", {"tool": name, "args": args}))[1]
            except BaseException as error:
                lost = claim.refused(error)
                if lost is not None:
                    await self._fail_lost_claim(lost)
                    continue
            else:
                result = claim.answered(name, args, data, self)
                if result is not None:
                    return result
            await asyncio.sleep(claim.pause_s())
            self.check()

    async def _fail_lost_claim(self, execution_id: str) -> None:
        await self._write(
            f"/v1/turns/{self.turn_id}/tools/{execution_id}/fail",
            {"error": _core.LOST_CLAIM_ERROR},
            lambda: self._execution_landed(execution_id, "failed"),
        )

    async def complete_tool(self, ctx: ToolContext, result: Any) -> None:
        await self._write(
            f"/v1/turns/{self.turn_id}/tools/{ctx.execution_id}/complete",
            {"result": result},
            lambda: self._execution_landed(ctx.execution_id, "succeeded"),
        )

    async def fail_tool(self, ctx: ToolContext, error: Any) -> None:
        await self._write(
            f"/v1/turns/{self.turn_id}/tools/{ctx.execution_id}/fail",
            {"error": error},
            lambda: self._execution_landed(ctx.execution_id, "failed"),
        )

    async def tool(
        self,
        name: str,
        args: Any,
        run: Callable[[ToolContext], Any],
        reconcile: Optional[Callable[[ToolContext], Any]] = None,
        wait: float = _core.TOOL_WAIT_DEFAULT_S,
    ) -> Any:
        """See :meth:`Turn.tool`; ``run`` and ``reconcile`` may be sync or
        async. A cancel request that arrives while it runs waits for it: the
        body is cancelled once no tool call of the turn is in progress."""
        self._tools_running += 1
        told = False
        try:
            return await self._tool(name, args, run, reconcile, wait)
        except TurnCancelled:
            told = True  # the body learns it from this very exception
            raise
        finally:
            self._tools_running -= 1
            if not told and self._tools_running == 0 and self.cancelled.is_set():
                self._cancel_body("cancelled")

    async def _tool(
        self,
        name: str,
        args: Any,
        run: Callable[[ToolContext], Any],
        reconcile: Optional[Callable[[ToolContext], Any]],
        wait: float,
    ) -> Any:
        execute, claimed = await self.claim_tool(name, args, wait)
        if not execute:
            return claimed
        ctx: ToolContext = claimed
        if ctx.previous_outcome == "unknown" and reconcile is not None:
            found = await _maybe_await(reconcile(ctx))
            if found is not None:
                await self.complete_tool(ctx, found)
                return found
        try:
            ctx.check()
            result = await _maybe_await(run(ctx))
        except LeaseLost:
            raise
        except asyncio.CancelledError:
            raise  # the lease went (or the caller gave up): the execution stays unknown
        except BaseException as error:
            try:
                await self.fail_tool(ctx, _core.error_json(error))
            except (AgentgateError, httpx.HTTPError):
                pass
            raise
        problem = _core.json_problem(result)
        if problem is not None:
            await self.fail_tool(ctx, _core.error_json(problem))
            raise TypeError(f"tool {name}: its result is not JSON ({problem}); the execution was failed")
        await self.complete_tool(ctx, result)
        return result


class _AsyncEmitter:
    """See :class:`~agentgate._sync._Emitter`: the same, with a task."""

    def __init__(self, turn: AsyncTurn) -> None:
        self._turn = turn
        self._sending = asyncio.Lock()
        self._buffer = _events.EventBuffer()
        self._wake = asyncio.Event()
        self._task: Optional["asyncio.Task[None]"] = None
        self._closed = False
        self._error: Optional[BaseException] = None
        self._in_doubt = False
        self.last_event_id: Optional[int] = None

    async def emit(self, name: str, data: Any, size: int) -> None:
        if self._error is not None:
            error, self._error = self._error, None
            raise error
        self._buffer.add(name, data, size)
        if self._buffer.full():
            await self.flush()
            return
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(
                self._loop(), name=f"agentgate-events-{self._turn.turn_id}"
            )
        self._wake.set()

    async def _loop(self) -> None:
        while not self._closed:
            await self._wake.wait()
            self._wake.clear()
            if not self._buffer.batch_ready():
                await asyncio.sleep(_events.EVENT_FLUSH_INTERVAL_S)
            if self._closed:
                return  # the ending appended what was left
            try:
                await self.flush()
            except Exception as error:
                self._error = error  # raised by the next emit
                return
            if self._buffer:
                self._wake.set()

    async def flush(self) -> Optional[int]:
        async with self._sending:
            while True:
                batch = self._buffer.take_batch()
                if not batch:
                    self._error = None
                    return self.last_event_id
                try:
                    self.last_event_id = await self._turn._append_events(batch, self.last_event_id, self._in_doubt)
                    self._in_doubt = False
                except BaseException as error:
                    # A cancelled append (the body was interrupted) may
                    # have landed too: the next flush reads the log first.
                    if isinstance(error, (_core.WRITE_TRANSIENT, asyncio.CancelledError)):
                        self._in_doubt = True
                    if not isinstance(error, LeaseLost):
                        self._buffer.put_back(batch)
                    raise

    async def close(self) -> None:
        self._closed = True
        self._wake.set()
        task = self._task
        if task is not None and not task.done() and task is not asyncio.current_task():
            try:
                await asyncio.wait_for(asyncio.shield(task), _core.HEARTBEAT_JOIN_S)
            except (asyncio.TimeoutError, Exception):
                task.cancel()


class AsyncFollower:
    """A turn's events, from :meth:`AsyncGate.follow`: ``async for`` it;
    see :class:`~agentgate.Follower`. ``await follower.aclose()`` (or
    ``async with``) stops it early."""

    def __init__(
        self, gate: AsyncGate, turn_id: str, plan: _events.FollowPlan, params: Optional[Mapping[str, Any]]
    ) -> None:
        self._gate = gate
        self._path = f"/v1/turns/{turn_id}/events"
        self._plan = plan
        self._params = params
        self._events = self._generate()

    def __aiter__(self) -> "AsyncFollower":
        return self

    async def __anext__(self) -> TurnEvent:
        return await self._events.__anext__()

    async def aclose(self) -> None:
        await self._events.aclose()

    async def __aenter__(self) -> "AsyncFollower":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.aclose()

    @property
    def last_event_id(self) -> int:
        return self._plan.last_id

    @property
    def reconnects(self) -> int:
        return self._plan.reconnects

    @property
    def end(self) -> Optional[TurnEvent]:
        return self._plan.end

    async def _generate(self) -> AsyncGenerator[TurnEvent, None]:
        plan = self._plan
        http = self._gate._http
        while True:
            failure: Optional[BaseException] = None
            try:
                async with http.stream(
                    "GET",
                    plan.url() + self._path,
                    headers=plan.headers(),
                    params=self._params,
                    timeout=_events.FOLLOW_READ_TIMEOUT_S,
                ) as response:
                    if response.status_code != 200:
                        await response.aread()
                        raise _answer_error(response)
                    parser = _events.SseParser()
                    async for chunk in response.aiter_bytes():
                        for raw in parser.feed(chunk):
                            try:
                                event = plan.accept(raw)
                            except AgentgateError as error:
                                failure = error  # an `error` event: raised, not resumed
                                break
                            if event is not None:
                                yield event
                                if event.name == "end":
                                    return
                        if failure is not None:
                            break
            except (httpx.TransportError, AgentgateError) as error:
                plan.dropped(error)
            else:
                if failure is not None:
                    raise failure
                plan.dropped(None)
            await asyncio.sleep(plan.pause_s())


class AsyncRecoveryWorker(Generic[R]):
    """The asyncio twin of :class:`~agentgate.RecoveryWorker`: ``await
    worker.run()``; ``handler`` may be a coroutine function or a plain one.

    Stops on ``worker.stop()``, or when the task running ``run()`` is
    cancelled: either way the turn in hand finishes first (it runs in a
    task of its own, shielded) and no next one is taken; a cancelled
    ``run()`` then raises ``CancelledError``."""

    def __init__(
        self,
        gate: AsyncGate,
        handler: Callable[[AsyncTurn], Any],
        *,
        min_orphaned_ms: int = _core.RECOVERY_MIN_ORPHANED_MS,
        user_ids: Optional[Sequence[str]] = None,
        turn_ids: Optional[Sequence[str]] = None,
        drain: bool = True,
        on_error: Optional[Callable[[AsyncTurn, BaseException], Any]] = None,
    ) -> None:
        self.gate = gate
        self.handler = handler
        self._filter = (min_orphaned_ms, user_ids, turn_ids)
        self._drain = drain
        self._on_error = on_error
        self._stopping = asyncio.Event()
        self._in_hand: Optional[AsyncTurn] = None
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

    def _hold(self, turn: Optional[AsyncTurn]) -> None:
        self._in_hand = turn
        if turn is not None and self._stopping.is_set():
            turn.take_next = False

    async def run_once(self, max_turns: int = _core.DRAIN_MAX_TURNS) -> List[TurnResult[Any]]:
        """See :meth:`RecoveryWorker.run_once`."""
        turn = await self.gate.claim_orphan(*self._filter)
        if turn is None:
            return []
        self.claims += 1
        results: List[TurnResult[Any]] = []
        try:
            await self.gate._drain(
                turn, self.handler, max_turns if self._drain else 1, self._stopping.is_set, results, self._hold
            )
        except Exception as error:
            failed = self._in_hand or turn
            results.append(TurnResult(failed.turn_id, failed.state or "running", False))
            self.errors += 1
            if self._on_error is not None:
                await _maybe_await(self._on_error(failed, error))
            else:
                log.exception("agentgate recovery: turn %s failed in its handler", failed.turn_id)
        finally:
            self._in_hand = None
            self.turns += len(results)
        return results

    async def run(self, max_turns: Optional[int] = None, until_idle: bool = False) -> int:
        """See :meth:`RecoveryWorker.run`."""
        ran = 0
        pause = 0.0
        while not self._stopping.is_set():
            budget = _core.DRAIN_MAX_TURNS if max_turns is None else min(_core.DRAIN_MAX_TURNS, max_turns - ran)
            unit = asyncio.ensure_future(self.run_once(budget))
            try:
                results = await asyncio.shield(unit)
            except asyncio.CancelledError:
                if unit.done():
                    raise
                self.stop()
                await unit  # finish the turn in hand, then give in
                raise
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
            try:
                await asyncio.wait_for(self._stopping.wait(), jittered)
            except asyncio.TimeoutError:
                pass
        return ran
