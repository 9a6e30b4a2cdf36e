"""What the sync and asyncio clients share: named limits, the retry
schedule, the tool context, the current-turn context variable and the
decorator's argument binding. No I/O here."""

from __future__ import annotations

import contextvars
import dataclasses
import inspect
import json
import math
import random
import threading
import time
from typing import Any, Awaitable, Callable, Concatenate, Dict, Generic, List, Mapping, Optional, ParamSpec, Protocol, Sequence, Tuple, TypeVar, overload

import httpx

from .errors import (
    AgentgateError,
    Overloaded,
    RequestInFlight,
    RequestTimeout,
    SessionBusy,
    StoreUnavailable,
    ToolInFlight,
    UserAtCapacity,
)

P = ParamSpec("P")
R = TypeVar("R")

# Limits (seconds unless named otherwise), each with why.

#: First pause between two begins while waiting for a busy session: short,
#: because the holder usually ends well before its lease would.
BEGIN_POLL_MIN_S = 0.05
#: Longest pause between two begins: Retry-After is the holder's remaining
#: lease (up to the TTL), but a holder that ends early should not cost a
#: waiter the rest of it; never longer than Retry-After either.
BEGIN_POLL_MAX_S = 1.0
#: A begin refused ``request_in_flight`` (this very message runs elsewhere,
#: e.g. a double-click) follows that turn's events for its ``end`` and
#: asks again at once, so the duplicate gets the replay as soon as it
#: exists, not after a pause. It follows after this event id: a turn's most
#: events (the server's ``MAX_TURN_EVENTS``), so no event is sent, only
#: ``end``.
IN_FLIGHT_FOLLOW_AFTER = 20_000
#: It follows until the running turn's lease would run out (Retry-After)
#: plus this, then asks again: a lease that ran out means a dead holder
#: (the begin takes the turn over), a renewed one another wait.
IN_FLIGHT_LEASE_SLACK_S = 0.25
#: A follow connection is reopened, to shorten its read timeout to the
#: time left, after a keep-alive comment (every 15 s) that came this long
#: after it opened.
IN_FLIGHT_REOPEN_S = 1.0
#: How long ``turn.tool`` waits, by default, for the same tool call running
#: under this turn's own lease (another thread or task of this turn) to end.
TOOL_WAIT_DEFAULT_S = 30.0
#: First and longest pause between two claims of a tool call in flight:
#: its holder is this very turn, so it ends soon; Retry-After (the lease
#: left) says nothing about that.
TOOL_POLL_MIN_S = 0.02
TOOL_POLL_MAX_S = 0.5
#: Heartbeats are never closer together than this, whatever the TTL.
HEARTBEAT_MIN_INTERVAL_S = 0.03
#: After a failed heartbeat (network, 503), the next try comes this much
#: sooner than a third of the TTL, so a short outage does not cost the lease.
HEARTBEAT_RETRY_S = 0.25
#: A heartbeat waits for its answer until the lease's local deadline, but
#: never less than this.
HEARTBEAT_MIN_TIMEOUT_S = 0.1
#: How long ending a turn waits for its heartbeat thread to stop.
HEARTBEAT_JOIN_S = 5.0
#: An exception's text sent as a turn's or a tool's error is cut to this.
ERROR_MESSAGE_MAX_CHARS = 2000

#: How many times a write under the lease (a tool's or the turn's ending)
#: is sent when its answer is lost (no answer, 408, 503): the outcome of
#: each lost one is unknown, and every such write is fenced, so repeating
#: it is safe; a repeat refused as "already ended" is checked against the
#: turn's record.
WRITE_ATTEMPTS = 4
#: First and longest pause between two sends of such a write.
WRITE_PAUSE_MIN_S = 0.1
WRITE_PAUSE_MAX_S = 1.0
#: Pages read to find one execution when checking whether a lost write
#: landed: a turn holds at most 1,000 executions, 200 a page.
EXECUTION_PAGES_MAX = 5
EXECUTION_PAGE_LIMIT = 200

#: Connections the default HTTP client opens to the server, and keeps
#: alive: the same number. httpcore 1.0.9 can close a surplus keep-alive
#: connection it has already handed to a waiting request in another thread
#: (encode/httpcore#1110), which surfaces as a ``ReadError`` (EBADF) or a
#: read that hangs until its timeout; with no surplus, that close never
#: happens below this many threads at once.
HTTP_MAX_CONNECTIONS = 100

#: Answers after which a write's outcome is unknown and it may be repeated.
WRITE_TRANSIENT = (StoreUnavailable, Overloaded, RequestTimeout, httpx.TransportError)

#: Begin refusals worth waiting out: the blocker ends by itself. 503s and
#: lost answers are included because repeating a begin with the same ids
#: is always safe (it replays, or is refused request_in_flight by itself).
BEGIN_WAITABLE = (
    SessionBusy,
    RequestInFlight,
    UserAtCapacity,
    StoreUnavailable,
    Overloaded,
    RequestTimeout,
    httpx.TransportError,
)

#: The turn the current code runs in (``with gate.turn(...)`` sets it).
current_turn: contextvars.ContextVar[Any] = contextvars.ContextVar("agentgate_current_turn", default=None)


#: The server's bound on a waiting begin (``MAX_BUSY_WAIT``), in ms.
BUSY_WAIT_MAX_MS = 20_000

#: Every ``on_busy`` policy the server takes (``BusyPolicyDto``).
BUSY_POLICIES = ("reject", "wait", "interrupt", "enqueue", "supersede")
#: The policies that take ``wait_ms`` (a server-side wait).
WAITING_POLICIES = ("wait", "interrupt")

#: How long, by default, a queued message (answered 202) is re-sent until it
#: starts when the caller gave no ``wait``: a queue drains one turn at a
#: time, and a turn takes 2-60 s, so a few queued ones take minutes.
QUEUE_WAIT_DEFAULT_S = 300.0


def http_limits() -> httpx.Limits:
    """The default client's connection limits (:data:`HTTP_MAX_CONNECTIONS`)."""
    return httpx.Limits(max_connections=HTTP_MAX_CONNECTIONS, max_keepalive_connections=HTTP_MAX_CONNECTIONS)


def busy_policy(on_busy: Optional[str], wait_ms: Optional[int], interrupt_running: bool = False) -> Dict[str, Any]:
    """The begin's ``on_busy`` fields, checked before anything is sent
    (the server's own rules: ``wait_ms`` only with ``wait`` and
    ``interrupt``, ``interrupt_running`` only with ``supersede``)."""
    if on_busy is None:
        if wait_ms is not None or interrupt_running:
            raise ValueError("wait_ms and interrupt_running need an on_busy policy")
        return {}
    if on_busy not in BUSY_POLICIES:
        raise ValueError(f"on_busy must be one of {BUSY_POLICIES}, not {on_busy!r}")
    fields: Dict[str, Any] = {"on_busy": on_busy}
    if wait_ms is not None:
        if on_busy not in WAITING_POLICIES or not 0 <= wait_ms <= BUSY_WAIT_MAX_MS:
            raise ValueError(f"wait_ms must be 0..{BUSY_WAIT_MAX_MS} with 'wait' or 'interrupt', not {wait_ms!r}")
        fields["wait_ms"] = wait_ms
    if interrupt_running:
        if on_busy != "supersede":
            raise ValueError("interrupt_running goes only with on_busy='supersede'")
        fields["interrupt_running"] = True
    return fields


def owner(user_id: Optional[str]) -> Optional[Dict[str, str]]:
    """The owner check of a call that takes ``?user_id=``."""
    return None if user_id is None else {"user_id": user_id}


def next_pause_s(
    previous_pause_s: float,
    error: BaseException,
    remaining_s: float,
    min_s: float,
    max_s: float,
) -> float:
    """The pause before the next try: doubling from ``min_s`` up to
    ``max_s``, never past Retry-After nor past the caller's deadline."""
    retry_after_s = error.retry_after_s if isinstance(error, AgentgateError) else None
    return pause_s(previous_pause_s, retry_after_s, remaining_s, min_s, max_s)


def pause_s(
    previous_pause_s: float, retry_after_s: Optional[float], remaining_s: float, min_s: float, max_s: float
) -> float:
    """As :func:`next_pause_s`, given the Retry-After (``None``: none)."""
    pause = min_s if previous_pause_s <= 0 else min(previous_pause_s * 2, max_s)
    if retry_after_s is not None:
        pause = min(pause, max(retry_after_s, min_s))
    return max(0.0, min(pause, remaining_s))


class BeginAttempts:
    """One begin's decisions, shared by the sync and async clients (which
    only send and sleep): which answers end the loop, which are waited
    out, how long to pause, and when the caller's wait is over.

    A 202 means the request joined its session's queue: it is sent again,
    the same request, until the server starts it (201: it is the head and
    the session is free) or replays it (200: it was cancelled, superseded,
    or run by someone else's handoff). ``wait`` bounds the whole loop;
    ``None`` means no wait for a refusal and :data:`QUEUE_WAIT_DEFAULT_S`
    once queued.

    A ``request_in_flight`` refusal (this very message runs elsewhere) is
    not paused on: :meth:`follow` names the running turn and how long to
    follow its events for their ``end``; after :meth:`followed` says so,
    the begin is sent again at once, and replays the stored answer. The
    body never runs a second time: the begin only grants the turn if its
    holder died (a takeover, as without the follow)."""

    def __init__(self, wait_s: Optional[float], on_queued: Callable[[Mapping[str, Any]], Any]) -> None:
        if wait_s is not None and not wait_s >= 0:
            raise ValueError(f"wait must be >= 0 seconds, not {wait_s!r}")
        self._started = time.monotonic()
        self._wait_s = wait_s
        self._on_queued = on_queued
        self._pause = 0.0
        self._blocker: Optional[BaseException] = None
        self._retry_after_s: Optional[float] = None
        #: The latest 202's queued turn (``QueuedDto``), ``None`` until queued.
        self.queued: Optional[Dict[str, Any]] = None
        #: Turns whose ``end`` a follow saw: never followed again (a begin
        #: still in flight after it names a continuation, or is paused on).
        self._ended: set[str] = set()

    def answered(self, status: int, data: Any) -> bool:
        """After a 2xx answer: ``True`` when it ends the loop (201, 200),
        ``False`` to send again (202)."""
        if status != 202:
            return True
        queued = dict(data["turn"])
        moved = self.queued is None or self.queued.get("position") != queued.get("position")
        self.queued = queued
        self._blocker = None
        self._retry_after_s = queued.get("retry_after_ms", 0) / 1000.0
        if moved:
            self._on_queued(queued)
        return False

    def refused(self, error: BaseException) -> None:
        """After a send that raised: re-raises what is not waited out."""
        if not isinstance(error, BEGIN_WAITABLE):
            raise error
        self._blocker = error
        self._retry_after_s = error.retry_after_s if isinstance(error, AgentgateError) else None

    def _deadline(self) -> float:
        if self._wait_s is not None:
            return self._started + self._wait_s
        return self._started + (QUEUE_WAIT_DEFAULT_S if self.queued is not None else 0.0)

    def pause_s(self) -> Optional[float]:
        """The pause before the next send; ``None`` once the wait is over
        (then :meth:`give_up` says what to raise)."""
        remaining = self._deadline() - time.monotonic()
        if remaining <= 0:
            return None
        self._pause = pause_s(self._pause, self._retry_after_s, remaining, BEGIN_POLL_MIN_S, BEGIN_POLL_MAX_S)
        return self._pause

    def follow(self) -> Optional[Tuple[str, float]]:
        """After a refusal: ``(turn_id, seconds)`` when it is
        ``request_in_flight`` naming a turn not seen ending, and the wait
        is not over: follow that turn's events (after
        :data:`IN_FLIGHT_FOLLOW_AFTER`) for ``end``, at most that long
        (the caller's wait left, and the lease's Retry-After plus
        :data:`IN_FLIGHT_LEASE_SLACK_S`); ``None`` to pause instead."""
        blocker = self._blocker
        if not isinstance(blocker, RequestInFlight) or not blocker.active_turn_id:
            return None
        if blocker.active_turn_id in self._ended:
            return None
        remaining = self._deadline() - time.monotonic()
        if remaining <= 0:
            return None
        if self._retry_after_s is not None:
            remaining = min(remaining, self._retry_after_s + IN_FLIGHT_LEASE_SLACK_S)
        return blocker.active_turn_id, remaining

    def followed(self, turn_id: str, outcome: str) -> bool:
        """After following ``turn_id``: ``outcome`` is ``"end"`` (the turn
        ended), ``"timeout"`` (the follow's time ran out) or ``"failed"``
        (it could not follow). ``True`` to send the begin again at once
        (it replays, grants a takeover, or is refused with a fresh
        Retry-After), ``False`` to pause first."""
        if outcome == "end":
            self._ended.add(turn_id)
            self._pause = 0.0
            return True
        return outcome == "timeout"

    def give_up(self) -> BaseException:
        """What to raise when the wait is over and nothing is queued."""
        assert self._blocker is not None, "only a refusal is waited out when nothing is queued"
        return self._blocker


def queue_timeout(queued: Mapping[str, Any], withdrawn: bool) -> BaseException:
    """The error of a queued message whose wait ran out."""
    from .errors import QueueTimeout

    turn_id = str(queued.get("turn_id", ""))
    position = queued.get("position")
    how = "withdrawn (cancelled)" if withdrawn else "NOT withdrawn: it may still be queued"
    return QueueTimeout(
        f"turn {turn_id} was still queued (position {position}) when the wait ran out; {how}",
        turn_id=turn_id,
        position=position if isinstance(position, int) else None,
        withdrawn=withdrawn,
    )


@dataclasses.dataclass(frozen=True)
class TurnResult(Generic[R]):
    """What ``gate.run(...)`` answers: how the message ended, and whether
    this call ran it or the server replayed a stored outcome.

    A replay's ``value`` is the stored response as the server keeps it:
    canonical JSON (RFC 8785), so ``11.0`` comes back ``11`` and object
    keys sorted, and a non-JSON type (a dataclass, a tuple) comes back as
    the JSON it was sent as, not as ``R``.
    """

    turn_id: str
    #: ``succeeded``, ``cancelled``, ``superseded``, ``failed``,
    #: ``awaiting_confirmation``, ``confirmed`` or ``abandoned``.
    state: str
    #: ``True`` when the body did not run in this call: the server answered
    #: with the request's stored outcome.
    replayed: bool
    #: The body's return value when it ran in this call; on a replay the
    #: stored response when ``state == "succeeded"``; else ``None``.
    value: Optional[R] = None
    #: For ``cancelled``: what the turn had produced when it stopped
    #: (``turn.partial``, or the stored one on a replay).
    partial: Any = None
    #: On a replay: the whole stored turn (``error``, ``retryable``, ...).
    turn: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    @property
    def succeeded(self) -> bool:
        return self.state == "succeeded"

    @classmethod
    def of_replay(cls, turn: Mapping[str, Any]) -> "TurnResult[Any]":
        state = str(turn.get("state", ""))
        response = turn.get("response")
        return TurnResult(
            turn_id=str(turn.get("turn_id", "")),
            state=state,
            replayed=True,
            value=response if state == "succeeded" else None,
            partial=response if state == "cancelled" else None,
            turn=dict(turn),
        )


def landed_ending(turn: Mapping[str, Any], state: str, fence: int) -> bool:
    """Did our own ending (to ``state``, under ``fence``) land?"""
    return turn.get("state") == state and turn.get("fence") == fence


def landed_execution(page: Mapping[str, Any], execution_id: str, state: str, fence: int) -> Optional[bool]:
    """In one page of executions: ``True``/``False`` once the execution is
    found (did our write to ``state`` under ``fence`` land?), ``None`` if it
    is not on this page."""
    for execution in page.get("executions") or []:
        if execution.get("execution_id") == execution_id:
            return bool(execution.get("state") == state and execution.get("fence") == fence)
    return None


NO_DEADLINE_S = math.inf


def json_problem(value: Any) -> Optional[BaseException]:
    """Why ``value`` cannot be sent as a JSON value (the server takes
    I-JSON: no NaN or infinities), or ``None`` if it can."""
    try:
        json.dumps(value, allow_nan=False)
    except (TypeError, ValueError) as problem:
        return problem
    return None


def error_json(error: BaseException) -> Dict[str, Any]:
    """How an exception is recorded as a turn's or a tool's error."""
    return {"type": type(error).__name__, "message": str(error)[:ERROR_MESSAGE_MAX_CHARS]}


def retryable(error: BaseException) -> bool:
    """An exception fails its turn retryably unless it says otherwise
    with a ``retryable = False`` attribute."""
    value = getattr(error, "retryable", True)
    return value if isinstance(value, bool) else True


#: What a claim whose answer was lost is failed with: it never ran.
LOST_CLAIM_ERROR = {
    "lost_claim": "the claim's answer was lost in transit; the tool did not run, so it is claimed again"
}


class HeldExecutions:
    """The attempts one turn's callers took, for telling a lost claim of
    this turn's from a sibling's (sync threads and async tasks alike:
    nothing here waits while holding the lock).

    A claim whose answer was lost leaves its attempt running on the server
    with no one to run it: every later claim of that call is refused
    ``tool_in_flight`` (naming the execution and attempt) until the lease
    ends. Each lost claim answer (``lost_answer``) lets one caller adopt
    one such attempt that no caller here took (``adopt``): it fails it as
    never run and claims again. A caller handed an attempt to run takes it
    first (``take``); the server grants each attempt once, so a caller is
    refused only an attempt that was adopted (it is dead: its grant arrived
    after it was failed). No two callers here ever run one attempt, and a
    later attempt (after a recorded failure) is always taken."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        #: The highest attempt of each execution a caller here took, to run or as adopted.
        self._attempts: Dict[str, int] = {}
        self._lost = 0

    def lost_answer(self) -> None:
        """A claim of this turn's went unanswered: it may have landed."""
        with self._lock:
            self._lost += 1

    def take(self, execution_id: str, attempt: int) -> bool:
        """Take ``attempt`` to run it; ``False`` if it was adopted."""
        with self._lock:
            if self._attempts.get(execution_id, 0) >= attempt:
                return False
            self._attempts[execution_id] = attempt
            return True

    def adopt(self, execution_id: str, attempt: int) -> bool:
        """Take running ``attempt`` as a lost claim of this turn's, if an
        answer is still unaccounted for and no caller here took it."""
        with self._lock:
            if self._lost == 0 or self._attempts.get(execution_id, 0) >= attempt:
                return False
            self._attempts[execution_id] = attempt
            self._lost -= 1
            return True


@dataclasses.dataclass(frozen=True)
class ToolContext:
    """What ``run`` and ``reconcile`` receive for one tool execution.

    Forward ``idempotency_key`` to the system that takes the effect: it is
    the same on every attempt of this call, takeovers included, so that
    system can refuse a second effect and ``reconcile`` can look it up.
    """

    tool: str
    args: Any
    execution_id: str
    idempotency_key: str
    attempt: int
    #: ``None`` on a first claim, ``"failed"`` after a reported failure,
    #: ``"unknown"`` when an earlier holder died mid-call.
    previous_outcome: Optional[str]
    turn: Any = dataclasses.field(repr=False, compare=False)

    def check(self) -> None:
        """Raise :class:`~agentgate.LeaseLost` if the turn's lease is lost,
        :class:`~agentgate.TurnCancelled` if it was asked to stop; call it
        before taking an effect."""
        self.turn.check()
        self.turn.check_cancelled()


class ClaimAttempts:
    """One ``claim_tool`` call's decisions, shared by the sync and async
    clients (which only send and sleep): what an answer or a refusal means,
    and how long to pause before the next send. Bounded by the caller's
    ``wait`` and by ``WRITE_ATTEMPTS`` lost answers."""

    def __init__(self, executions: HeldExecutions, wait_s: float) -> None:
        self._executions = executions
        self._deadline = time.monotonic() + max(0.0, wait_s)
        self._pause = 0.0
        self._lost_answers = 0
        self._blocker: Optional[BaseException] = None

    def answered(self, name: str, args: Any, data: Mapping[str, Any], turn: Any) -> Optional[Tuple[bool, Any]]:
        """The claim's result, or ``None`` to claim again: this attempt was
        adopted as lost and failed, and a later one runs."""
        execution = data["execution"]
        if not data.get("execute"):
            return False, execution.get("result")
        if self._executions.take(execution["execution_id"], execution["attempt"]):
            return True, tool_context(name, args, execution, turn)
        self._blocker = ToolInFlight(
            f"tool execution {execution['execution_id']} attempt was failed as lost", status=409
        )
        return None

    def refused(self, error: BaseException) -> Optional[str]:
        """After a send that raised: the execution to fail as a lost claim
        of this turn's (then claim again at once), or ``None`` to wait and
        claim again; re-raises what is not to be waited out."""
        if isinstance(error, ToolInFlight):
            running = error.running
            if running is not None and self._executions.adopt(*running):
                return running[0]
        elif isinstance(error, AgentgateError):
            # Answered: a 503 or 408 is waited out like tool_in_flight.
            if not isinstance(error, WRITE_TRANSIENT):
                raise error
        else:
            # No answer (a transport error, or this caller interrupted
            # mid-claim): the claim may have landed.
            self._executions.lost_answer()
            self._lost_answers += 1
            if self._lost_answers == WRITE_ATTEMPTS or not isinstance(error, httpx.TransportError):
                raise error
        self._blocker = error
        return None

    def pause_s(self) -> float:
        """The pause before the next send; raises what blocked the last one
        once the wait is over."""
        assert self._blocker is not None, "a pause follows a refusal or a declined attempt"
        remaining = self._deadline - time.monotonic()
        if remaining <= 0:
            raise self._blocker
        self._pause = next_pause_s(self._pause, self._blocker, remaining, TOOL_POLL_MIN_S, TOOL_POLL_MAX_S)
        return self._pause


def tool_context(name: str, args: Any, execution: Mapping[str, Any], turn: Any) -> ToolContext:
    """The context of a claim answered ``execute: true``."""
    return ToolContext(
        tool=name,
        args=args,
        execution_id=execution["execution_id"],
        idempotency_key=execution["idempotency_key"],
        attempt=execution["attempt"],
        previous_outcome=execution.get("previous_outcome"),
        turn=turn,
    )


@dataclasses.dataclass(frozen=True)
class ToolSpec:
    """A function made into a tool by ``@gate.tool``."""

    name: str
    function: Callable[..., Any]
    signature: inspect.Signature
    wants_context: bool
    reconcile: Optional[Callable[[ToolContext], Any]]

    @classmethod
    def of(
        cls,
        function: Callable[..., Any],
        name: Optional[str],
        reconcile: Optional[Callable[[ToolContext], Any]],
    ) -> "ToolSpec":
        signature = inspect.signature(function)
        params = list(signature.parameters.values())
        wants_context = bool(params) and (
            params[0].name == "ctx" or params[0].annotation in (ToolContext, "ToolContext")
        )
        if wants_context:
            signature = signature.replace(parameters=params[1:])
        return cls(name or function.__name__, function, signature, wants_context, reconcile)

    def present(self, wrapper: Callable[..., Any]) -> None:
        """Make the wrapper look like the tool it is to introspection
        (``inspect.signature``, ``typing.get_type_hints``, frameworks that
        build a tool schema from them): the function's own signature and
        annotations without the ``ctx`` parameter."""
        wrapper.__signature__ = self.signature  # type: ignore[attr-defined]
        own = dict(getattr(self.function, "__annotations__", {}))
        if self.wants_context:
            own.pop(next(iter(inspect.signature(self.function).parameters)), None)
        wrapper.__annotations__ = own

    def bind(self, args: Tuple[Any, ...], kwargs: Mapping[str, Any]) -> Dict[str, Any]:
        """The call's arguments by name, defaults included: the tool's args
        (so ``f(1)`` and ``f(amount=1)`` are the same call)."""
        bound = self.signature.bind(*args, **kwargs)
        bound.apply_defaults()
        out: Dict[str, Any] = {}
        for name, value in bound.arguments.items():
            kind = self.signature.parameters[name].kind
            if kind is inspect.Parameter.VAR_KEYWORD:
                out.update(value)
            elif kind is inspect.Parameter.VAR_POSITIONAL:
                out[name] = list(value)
            else:
                out[name] = value
        return out

    def call(self, ctx: ToolContext, tool_args: Mapping[str, Any]) -> Any:
        """Call the function with the bound args (and ``ctx`` if it takes it)."""
        params = self.signature.parameters
        has_var_positional = any(p.kind is inspect.Parameter.VAR_POSITIONAL for p in params.values())
        positional = []
        keywords: Dict[str, Any] = {}
        for name, param in params.items():
            if param.kind is inspect.Parameter.VAR_KEYWORD:
                keywords.update({k: v for k, v in tool_args.items() if k not in params})
            elif param.kind is inspect.Parameter.VAR_POSITIONAL:
                positional.extend(tool_args.get(name, []))
            elif param.kind is inspect.Parameter.POSITIONAL_ONLY or (
                param.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD and has_var_positional
            ):
                positional.append(tool_args[name])
            elif name in tool_args:
                keywords[name] = tool_args[name]
        if self.wants_context:
            return self.function(ctx, *positional, **keywords)
        return self.function(*positional, **keywords)



#: A decorated tool's function type, for :class:`Tool` and :class:`AsyncTool`.
F = TypeVar("F", bound=Callable[..., Any])
F_co = TypeVar("F_co", bound=Callable[..., Any], covariant=True)
AF = TypeVar("AF", bound=Callable[..., Awaitable[Any]])
AF_co = TypeVar("AF_co", bound=Callable[..., Awaitable[Any]], covariant=True)
_P = ParamSpec("_P")
_R = TypeVar("_R")


class Tool(Protocol[F_co]):
    """What a type checker sees of a ``@gate.tool`` function: called like
    the function without its ``ctx: ToolContext`` first parameter (if it
    has one), returning what the function returns.

    Typed per call, not per decoration: an overloaded decorator that
    stripped ``ctx`` made mypy give up (``def (*Any, **Any) -> Any``) on
    every function whose types contain ``Any`` (``-> Dict[str, Any]``),
    since ``Any`` matches both of its forms."""

    @overload
    def __call__(self: "Tool[Callable[Concatenate[ToolContext, _P], _R]]", *args: _P.args, **kwargs: _P.kwargs) -> _R: ...

    @overload
    def __call__(self: "Tool[Callable[_P, _R]]", *args: _P.args, **kwargs: _P.kwargs) -> _R: ...


class AsyncTool(Protocol[AF_co]):
    """:class:`Tool` for ``@async_gate.tool`` (``async def``) functions."""

    @overload
    def __call__(
        self: "AsyncTool[Callable[Concatenate[ToolContext, _P], Awaitable[_R]]]", *args: _P.args, **kwargs: _P.kwargs
    ) -> Awaitable[_R]: ...

    @overload
    def __call__(
        self: "AsyncTool[Callable[_P, Awaitable[_R]]]", *args: _P.args, **kwargs: _P.kwargs
    ) -> Awaitable[_R]: ...


class ToolDecorator(Protocol):
    """What ``@gate.tool(name=..., reconcile=...)`` returns."""

    def __call__(self, function: F) -> Tool[F]: ...


class AsyncToolDecorator(Protocol):
    """What ``@async_gate.tool(name=..., reconcile=...)`` returns."""

    def __call__(self, function: AF) -> AsyncTool[AF]: ...


# --- the handoff and recovery -------------------------------------------

#: Turns one drain runs at most: a whole session queue (the server's
#: ``MAX_SESSION_QUEUE``, 100) and the turn in hand. A queue that keeps
#: refilling is left, queued, for a later drain or a recovery worker.
DRAIN_MAX_TURNS = 101

#: A recovery worker claims only orphans dead (and queue heads left free)
#: at least this long by default, so a client's own retry and a holder's
#: handoff usually come first; 0 claims at once.
RECOVERY_MIN_ORPHANED_MS = 2000
#: A recovery worker's pause when there was nothing to claim (or the
#: server did not answer): from the first, doubling to the longest, each
#: jittered into its upper half so many workers do not ask in step.
RECOVERY_IDLE_MIN_S = 0.2
RECOVERY_IDLE_MAX_S = 5.0
#: Claim refusals a recovery worker waits out rather than raising: the
#: server or its store is briefly unavailable, or no answer came.
RECOVERY_WAITABLE = (StoreUnavailable, Overloaded, RequestTimeout, httpx.TransportError)


def recovery_pause_s(previous_s: float) -> Tuple[float, float]:
    """The next idle pause of a recovery worker: ``(pause, jittered)``;
    pass ``pause`` back next time, sleep ``jittered``."""
    pause = RECOVERY_IDLE_MIN_S if previous_s <= 0 else min(previous_s * 2, RECOVERY_IDLE_MAX_S)
    return pause, pause * random.uniform(0.5, 1.0)


def claim_filter(
    min_orphaned_ms: Optional[int], user_ids: Optional[Sequence[str]], turn_ids: Optional[Sequence[str]]
) -> Dict[str, Any]:
    """The body of ``POST /v1/orphans/claim``."""
    body: Dict[str, Any] = {}
    if min_orphaned_ms is not None:
        body["min_orphaned_ms"] = min_orphaned_ms
    if user_ids is not None:
        body["user_ids"] = list(user_ids)
    if turn_ids is not None:
        body["turn_ids"] = list(turn_ids)
    return body


def journal_entry(execution: Mapping[str, Any]) -> Dict[str, Any]:
    """A page's execution as a claim's journal names it (as the server's
    ``JournalEntry::from_view`` does: a running one's outcome is unknown)."""
    state = execution.get("state")
    entry: Dict[str, Any] = {
        "execution_id": execution["execution_id"],
        "tool": execution["tool"],
        "attempt": execution["attempt"],
        "outcome": "unknown" if state == "running" else state,
    }
    if state == "succeeded":
        entry["result"] = execution.get("result")
    if state == "failed":
        entry["error"] = execution.get("error")
    return entry


def drain_claim_ids(session: Mapping[str, Any]) -> List[str]:
    """What a drain of ``session`` claims (``GET /v1/sessions/{id}``'s
    ``session``): its holder, if that is an orphan, else its queue's head
    once the session is free (the claim decides which may start)."""
    ids: List[str] = []
    holder = session.get("holder")
    if isinstance(holder, Mapping) and holder.get("turn_id"):
        ids.append(str(holder["turn_id"]))
    queue = session.get("queue") or []
    if queue:
        ids.append(str(queue[0]["turn_id"]))
    return ids
