"""The client against the served OpenAPI document: every error code the
server can send has its own exception class, and every field the client
reads is one the document says is always there. A server change that
breaks the client fails here."""

from __future__ import annotations

import httpx
import pytest

import agentgate
from agentgate.errors import CLIENT_CODES, SERVER_CODES, UnexpectedResponse, error_for

#: Fields the client reads without a default, per schema.
FIELDS_READ = {
    "GrantDto": {"turn_id", "user_id", "session_id", "client_request_id", "lease_token", "fence", "attempt", "takeover", "lease_expires_in_ms"},
    "ReplayResponse": {"turn"},
    "TurnDto": {"turn_id", "state"},
    "ExecuteResponse": {"execute", "execution"},
    "ExecuteDto": {"execution_id", "idempotency_key", "attempt", "previous_outcome"},
    "ExecutionResultResponse": {"execution"},
    "HeartbeatResponse": {"lease_expires_in_ms", "cancel_requested"},
    "QueuedResponse": {"turn"},
    "QueuedDto": {"turn_id", "position", "retry_after_ms"},
    "SessionResponse": {"session"},
    "ClaimOrphanResponse": {"turn", "payload", "journal", "orphaned_for_ms"},
    "TurnResponse": {"turn"},
    "NextTurnDto": {"turn", "payload"},
    "SessionDto": {"queue"},
    "QueueEntryDto": {"turn_id"},
    "HolderDto": {"turn_id"},
    "ExecutionPageResponse": {"executions"},
    "ExecutionDto": {"execution_id", "tool", "attempt", "state"},
    "AppendEventsResponse": {"last_event_id"},
    "ErrorDetail": {"code", "message"},
}


@pytest.fixture
def document(server):
    return httpx.get(server.url + "/openapi.json", timeout=10).json()


def test_every_served_error_code_has_its_own_exception_class(document):
    codes = document["components"]["schemas"]["ErrorCode"]["enum"]
    assert "session_busy" in codes and "lease_lost" in codes
    for code in codes:
        error = error_for(409, {"error": {"code": code, "message": "m"}}, None)
        assert not isinstance(error, UnexpectedResponse), f"no class for {code}"
        assert error.code == code and type(error).code == code
        assert isinstance(error, agentgate.AgentgateError)
        assert type(error).__name__ in agentgate.__all__, f"{type(error).__name__} is not exported"


def test_the_clients_error_classes_are_exactly_the_documents_error_codes(document):
    codes = set(document["components"]["schemas"]["ErrorCode"]["enum"])
    assert SERVER_CODES == codes, f"missing: {sorted(codes - SERVER_CODES)}, extra: {sorted(SERVER_CODES - codes)}"
    assert not CLIENT_CODES & codes, "a client-side code is also one the server sends"


def test_every_field_the_client_reads_is_required_by_the_document(document):
    schemas = document["components"]["schemas"]
    for schema, fields in FIELDS_READ.items():
        required = set(schemas[schema].get("required", []))
        assert fields <= required, f"{schema} does not promise {sorted(fields - required)}"


def test_retry_after_comes_from_the_body_else_from_the_header():
    from_body = error_for(409, {"error": {"code": "session_busy", "message": "m", "retry_after_ms": 1234}}, "2")
    assert from_body.retry_after_ms == 1234
    from_header = error_for(503, {"error": {"code": "overloaded", "message": "m"}}, "2")
    assert isinstance(from_header, agentgate.Overloaded) and from_header.retry_after_ms == 2000
    unknown = error_for(502, None, None)
    assert isinstance(unknown, UnexpectedResponse) and unknown.status == 502


def test_a_missing_turn_raises_NotFound(server):
    with pytest.raises(agentgate.NotFound) as missing:
        agentgate.Gate(server.url).get_turn("turn_does_not_exist")
    assert missing.value.status == 404
