"""Typed errors: one class per error code the server sends (docs/http.md,
"Errors: what to do with each"), plus the few the client raises itself.

Every error derives from :class:`AgentgateError` and carries ``code``,
``status`` (the HTTP status, ``None`` for client-side errors), ``message``,
``retry_after_ms`` and ``active_turn_id`` (where the server sent them).
"""

from __future__ import annotations

from typing import Any, Dict, Mapping, Optional, Tuple, Type

__all__ = [
    "AgentgateError",
    "InvalidRequest",
    "Unauthorized",
    "OriginNotAllowed",
    "HostNotAllowed",
    "UserMismatch",
    "NotFound",
    "MethodNotAllowed",
    "RequestTimeout",
    "PayloadTooLarge",
    "UnsupportedMediaType",
    "SessionBusy",
    "RequestInFlight",
    "AwaitingConfirmation",
    "ConfirmationExpired",
    "ToolInFlight",
    "LeaseLost",
    "TurnCancelled",
    "UnknownToolOutcome",
    "PayloadMismatch",
    "AttemptsExhausted",
    "UserAtCapacity",
    "QueueFull",
    "EffectFailed",
    "InternalError",
    "StoreUnavailable",
    "Overloaded",
    "UnexpectedResponse",
    "TurnNotEnded",
    "NoActiveTurn",
    "QueueTimeout",
    "Replayed",
    "CLIENT_CODES",
    "SERVER_CODES",
    "error_for",
]


class AgentgateError(Exception):
    """Base of every error this client raises for the server's answers."""

    code: str = "unexpected_response"

    def __init__(
        self,
        message: str,
        *,
        code: Optional[str] = None,
        status: Optional[int] = None,
        retry_after_ms: Optional[int] = None,
        active_turn_id: Optional[str] = None,
        body: Any = None,
    ) -> None:
        super().__init__(message)
        if code is not None:
            self.code = code
        self.message = message
        self.status = status
        self.retry_after_ms = retry_after_ms
        self.active_turn_id = active_turn_id
        self.body = body

    def __str__(self) -> str:
        where = f" (HTTP {self.status})" if self.status is not None else ""
        return f"{self.code}{where}: {self.message}"

    @property
    def retry_after_s(self) -> Optional[float]:
        """``retry_after_ms`` in seconds, or ``None``."""
        return None if self.retry_after_ms is None else self.retry_after_ms / 1000.0


class InvalidRequest(AgentgateError):
    """400: malformed request; fix it."""

    code = "invalid_request"


class Unauthorized(AgentgateError):
    """401: send ``Authorization: Bearer <key>`` (``Gate(api_key=...)``)."""

    code = "unauthorized"


class OriginNotAllowed(AgentgateError):
    """403: a browser origin the server does not allow."""

    code = "origin_not_allowed"


class HostNotAllowed(AgentgateError):
    """403: a ``Host`` the server does not answer to."""

    code = "host_not_allowed"


class UserMismatch(AgentgateError):
    """403: with ``--user-header``, the request names another user."""

    code = "user_mismatch"


class NotFound(AgentgateError):
    """404: no such turn, session, execution or pending confirmation."""

    code = "not_found"


class MethodNotAllowed(AgentgateError):
    """405: the path exists but not with this method."""

    code = "method_not_allowed"


class RequestTimeout(AgentgateError):
    """408: the body did not arrive in time; sending it again is safe."""

    code = "request_timeout"


class PayloadTooLarge(AgentgateError):
    """413: the body is over the server's limit."""

    code = "payload_too_large"


class UnsupportedMediaType(AgentgateError):
    """415: the body was not sent as ``application/json``."""

    code = "unsupported_media_type"


class SessionBusy(AgentgateError):
    """409: another turn holds the session (``active_turn_id``)."""

    code = "session_busy"


class RequestInFlight(AgentgateError):
    """409: this very request runs elsewhere; repeat it after ``retry_after_ms``."""

    code = "request_in_flight"


class AwaitingConfirmation(AgentgateError):
    """409: the session waits for a person's confirmation (``active_turn_id``)."""

    code = "awaiting_confirmation"


class ConfirmationExpired(AgentgateError):
    """409: the confirmation names a turn whose pending confirmation expired;
    nothing was confirmed. Send the message again to ask anew."""

    code = "confirmation_expired"


class ToolInFlight(AgentgateError):
    """409: the same tool call is running under this turn's lease
    (``running`` names the execution and attempt)."""

    code = "tool_in_flight"

    @property
    def running(self) -> Optional[Tuple[str, int]]:
        """The execution and attempt running under the caller's own lease,
        as the server named them; ``None`` from a server that does not say."""
        detail = self.body.get("error") if isinstance(self.body, Mapping) else None
        if not isinstance(detail, Mapping):
            return None
        execution_id, attempt = detail.get("execution_id"), detail.get("attempt")
        if isinstance(execution_id, str) and isinstance(attempt, int):
            return execution_id, attempt
        return None


class LeaseLost(AgentgateError):
    """409: the turn was taken over, expired or ended; stop working on it.

    Also raised by the client itself, without a request, for every call on
    a turn whose lease is already known to be lost (``status`` is then the
    status of the answer that revealed it, or ``None`` when the lease could
    not be renewed before its local deadline).
    """

    code = "lease_lost"


class TurnCancelled(AgentgateError):
    """The turn was asked to stop (``gate.cancel(turn_id)``, or another
    message sent with ``on_busy="interrupt"``): claim no more tools.

    The server answers a tool claim with it (409); the client raises it
    itself (``status`` ``None``) once a heartbeat said ``cancel_requested``:
    from ``turn.check_cancelled()``, ``turn.sleep()`` and ``turn.tool()``,
    and the asyncio client cancels the body. Let it escape the ``with``
    block: the client then ends the turn ``cancelled`` with
    ``turn.partial``, and a repeat of the request replays that.
    """

    code = "turn_cancelled"


class UnknownToolOutcome(AgentgateError):
    """409: a tool call's earlier attempt may have taken effect."""

    code = "unknown_tool_outcome"


class PayloadMismatch(AgentgateError):
    """422: the same ``client_request_id`` with another payload (a bug)."""

    code = "payload_mismatch"


class AttemptsExhausted(AgentgateError):
    """422: the tool call or turn failed too often; fail the turn."""

    code = "attempts_exhausted"


class UserAtCapacity(AgentgateError):
    """429: the user runs ``--max-turns-per-user`` turns already."""

    code = "user_at_capacity"


class QueueFull(AgentgateError):
    """429: the session's queue holds 100 waiting messages (``on_busy:
    enqueue`` or ``supersede``); nothing was queued."""

    code = "queue_full"


class EffectFailed(AgentgateError):
    """A tool's effect failed on the server side."""

    code = "effect_failed"


class InternalError(AgentgateError):
    """500: a server bug."""

    code = "internal"


class StoreUnavailable(AgentgateError):
    """503: the store or Redis is down; retry after ``retry_after_ms``."""

    code = "store_unavailable"


class Overloaded(AgentgateError):
    """503: the server is at ``--max-connections``; retry after ``retry_after_ms``."""

    code = "overloaded"


class UnexpectedResponse(AgentgateError):
    """An answer this client does not understand (no error body, unknown code)."""

    code = "unexpected_response"


class TurnNotEnded(AgentgateError):
    """Client-side: a ``with gate.turn(...)`` body exited without ending the turn.

    The client fails the turn (retryable) before raising this, so the
    session is released and a repeat of the request restarts it.
    """

    code = "turn_not_ended"


class NoActiveTurn(AgentgateError):
    """Client-side: a ``@gate.tool`` function was called outside any turn."""

    code = "no_active_turn"


class QueueTimeout(AgentgateError):
    """Client-side: a queued message (``on_busy="enqueue"`` or
    ``"supersede"``, or a session default that queues) did not start
    within the caller's ``wait``.

    The client then withdrew it (``POST /v1/turns/{id}/cancel`` on a queued
    turn ends it ``cancelled``), so it never runs unobserved; a repeat of
    the request replays that. ``turn_id`` and ``position`` (the last one
    reported) say which; ``withdrawn`` is ``False`` when the withdrawal
    itself failed (the message may still be queued).
    """

    code = "queue_timeout"

    def __init__(self, message: str, *, turn_id: str, position: Optional[int], withdrawn: bool) -> None:
        super().__init__(message)
        self.turn_id = turn_id
        self.position = position
        self.withdrawn = withdrawn


class Replayed(Exception):
    """Not a failure: the begin was answered with the stored outcome (200).

    Raised by ``with gate.turn(...)`` instead of entering the body, because
    a ``with`` statement cannot skip its body. ``response`` is the stored
    response (``None`` unless ``state == "succeeded"``); ``turn`` is the
    whole stored turn (``state``, ``error``, ``retryable``, ...).
    """

    def __init__(self, turn: Mapping[str, Any]) -> None:
        self.turn: Dict[str, Any] = dict(turn)
        self.turn_id: str = str(turn.get("turn_id", ""))
        self.state: str = str(turn.get("state", ""))
        self.response: Any = turn.get("response")
        self.error: Any = turn.get("error")
        super().__init__(f"turn {self.turn_id} replayed with state {self.state}")


_BY_CODE: Dict[str, Type[AgentgateError]] = {
    cls.code: cls
    for cls in (
        InvalidRequest,
        Unauthorized,
        OriginNotAllowed,
        HostNotAllowed,
        UserMismatch,
        NotFound,
        MethodNotAllowed,
        RequestTimeout,
        PayloadTooLarge,
        UnsupportedMediaType,
        SessionBusy,
        RequestInFlight,
        AwaitingConfirmation,
        ConfirmationExpired,
        ToolInFlight,
        LeaseLost,
        TurnCancelled,
        UnknownToolOutcome,
        PayloadMismatch,
        AttemptsExhausted,
        UserAtCapacity,
        QueueFull,
        EffectFailed,
        InternalError,
        StoreUnavailable,
        Overloaded,
    )
}


#: Every code the server sends, each with its class (the ``ErrorCode``
#: enum of the OpenAPI document; tests/test_contract.py holds them equal).
SERVER_CODES = frozenset(_BY_CODE)
#: The codes of errors this client raises itself, with no answer behind them.
CLIENT_CODES = frozenset({UnexpectedResponse.code, TurnNotEnded.code, NoActiveTurn.code, QueueTimeout.code})


def error_for(status: int, body: Any, retry_after_header: Optional[str]) -> AgentgateError:
    """The typed error for one non-2xx answer.

    ``retry_after_ms`` comes from the body, else from the ``Retry-After``
    header (seconds).
    """
    detail: Mapping[str, Any] = {}
    if isinstance(body, Mapping) and isinstance(body.get("error"), Mapping):
        detail = body["error"]
    code = str(detail.get("code", "unexpected_response"))
    message = str(detail.get("message", f"HTTP {status} without an error body"))
    retry_after_ms = detail.get("retry_after_ms")
    if not isinstance(retry_after_ms, int) and retry_after_header:
        try:
            retry_after_ms = int(float(retry_after_header) * 1000)
        except ValueError:
            retry_after_ms = None
    if not isinstance(retry_after_ms, int):
        retry_after_ms = None
    active = detail.get("active_turn_id")
    cls = _BY_CODE.get(code, UnexpectedResponse)
    return cls(
        message,
        code=code,
        status=status,
        retry_after_ms=retry_after_ms,
        active_turn_id=active if isinstance(active, str) else None,
        body=body,
    )
