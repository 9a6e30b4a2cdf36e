"""agentgate: the Python client of ``agentgate serve``.

One turn per conversation, exactly-once tool calls, leases that heartbeat
themselves::

    from agentgate import Gate

    gate = Gate("http://127.0.0.1:7700")
    with gate.turn("alice", "chat-1", "msg-1", {"text": "taxi 18"}) as turn:
        entry = turn.tool("book", {"amount": 18}, run=lambda ctx: ledger.book(18, key=ctx.idempotency_key))
        turn.complete({"text": "booked", "entry": entry})

Modules: ``_sync`` (:class:`Gate`, :class:`Turn`, :class:`Follower`,
:class:`RecoveryWorker`), ``_async`` (:class:`AsyncGate`,
:class:`AsyncTurn`, :class:`AsyncFollower`, :class:`AsyncRecoveryWorker`),
``errors`` (one class per error code), ``_core`` (limits,
:class:`TurnResult` and what both share), ``_events`` (event limits, the
SSE parser, :class:`TurnEvent`).
"""

from ._async import AsyncFollower, AsyncGate, AsyncRecoveryWorker, AsyncTurn
from ._core import ToolContext, TurnResult
from ._events import TurnEvent
from ._sync import Follower, Gate, RecoveryWorker, Turn
from .errors import (
    AgentgateError,
    AttemptsExhausted,
    AwaitingConfirmation,
    ConfirmationExpired,
    EffectFailed,
    HostNotAllowed,
    InternalError,
    InvalidRequest,
    LeaseLost,
    MethodNotAllowed,
    NoActiveTurn,
    NotFound,
    OriginNotAllowed,
    Overloaded,
    PayloadMismatch,
    PayloadTooLarge,
    QueueTimeout,
    Replayed,
    RequestInFlight,
    RequestTimeout,
    SessionBusy,
    StoreUnavailable,
    ToolInFlight,
    TurnCancelled,
    TurnNotEnded,
    Unauthorized,
    UnexpectedResponse,
    UnknownToolOutcome,
    UnsupportedMediaType,
    UserAtCapacity,
    QueueFull,
    UserMismatch,
)

__version__ = "0.1.0"

__all__ = [
    "Gate",
    "Turn",
    "Follower",
    "RecoveryWorker",
    "AsyncGate",
    "AsyncTurn",
    "AsyncFollower",
    "AsyncRecoveryWorker",
    "ToolContext",
    "TurnResult",
    "TurnEvent",
    "AgentgateError",
    "AttemptsExhausted",
    "AwaitingConfirmation",
    "ConfirmationExpired",
    "EffectFailed",
    "HostNotAllowed",
    "InternalError",
    "InvalidRequest",
    "LeaseLost",
    "MethodNotAllowed",
    "NoActiveTurn",
    "NotFound",
    "OriginNotAllowed",
    "Overloaded",
    "PayloadMismatch",
    "PayloadTooLarge",
    "QueueTimeout",
    "Replayed",
    "RequestInFlight",
    "RequestTimeout",
    "SessionBusy",
    "StoreUnavailable",
    "ToolInFlight",
    "TurnCancelled",
    "TurnNotEnded",
    "Unauthorized",
    "UnexpectedResponse",
    "UnknownToolOutcome",
    "UnsupportedMediaType",
    "UserAtCapacity",
    "QueueFull",
    "UserMismatch",
]
