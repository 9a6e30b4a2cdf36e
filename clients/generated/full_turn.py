"""One full turn through the client openapi-python-client generated from the
served /openapi.json (check.sh): begin, a second message refused
session_busy, heartbeat, claim a tool, complete it, claim it again (the
stored result), complete the turn, and a repeat of the begin replays the
stored response.

Usage: full_turn.py BASE_URL API_KEY (the generated package on PYTHONPATH
as `agentgate_generated`). Exits non-zero, naming the step, on any surprise.
"""

import sys
import uuid

from agentgate_generated import AuthenticatedClient
from agentgate_generated.api.tools import claim_tool, complete_tool
from agentgate_generated.api.turns import begin, complete_turn, heartbeat
from agentgate_generated.models import (
    BeginRequest,
    BeginResponse,
    ClaimToolRequest,
    ErrorBody,
    ErrorCode,
    CompleteToolRequest,
    CompleteTurnRequest,
    ExecuteResponse,
    ExecutionResultResponse,
    HeartbeatResponse,
    ReplayResponse,
    TurnResponse,
    TurnStateDto,
)


def expect(step: str, response, status: int, kind: type):
    """The parsed body of `response`, which must be `status` and `kind`."""
    if response.status_code != status or not isinstance(response.parsed, kind):
        sys.exit(f"full_turn: {step}: expected {status} {kind.__name__}, got "
                 f"{int(response.status_code)} {response.content[:300]!r}")
    return response.parsed


def main() -> None:
    base_url, api_key = sys.argv[1], sys.argv[2]
    client = AuthenticatedClient(base_url=base_url, token=api_key, raise_on_unexpected_status=True)
    message = BeginRequest(user_id="alice", session_id=f"chat-{uuid.uuid4()}",
                           client_request_id="msg-1", payload={"text": "taxi 18 yesterday"})

    grant = expect("begin", begin.sync_detailed(client=client, body=message), 201, BeginResponse).turn
    assert grant.state == TurnStateDto.RUNNING and grant.attempt == 1 and not grant.takeover, grant
    token = grant.lease_token

    # A second message in the busy session: a typed refusal naming the turn.
    busy = BeginRequest(user_id="alice", session_id=message.session_id,
                        client_request_id="msg-2", payload={"text": "lunch 35"})
    refusal = expect("busy begin", begin.sync_detailed(client=client, body=busy), 409, ErrorBody).error
    assert refusal.code == ErrorCode.SESSION_BUSY and refusal.active_turn_id == grant.turn_id, refusal
    assert isinstance(refusal.retry_after_ms, int) and refusal.retry_after_ms > 0, refusal

    beat = expect("heartbeat", heartbeat.sync_detailed(grant.turn_id, client=client, lease_token=token),
                  200, HeartbeatResponse)
    assert beat.lease_expires_in_ms > 0, beat

    args = {"type": "expense", "amount": 18, "category_name": "交通"}
    claim = expect("tool claim", claim_tool.sync_detailed(
        grant.turn_id, client=client, lease_token=token,
        body=ClaimToolRequest(tool="create_transaction", args=args)), 201, ExecuteResponse)
    assert claim.execute is True and claim.execution.previous_outcome is None, claim
    assert claim.execution.idempotency_key, claim

    done = expect("tool complete", complete_tool.sync_detailed(
        grant.turn_id, claim.execution.execution_id, client=client, lease_token=token,
        body=CompleteToolRequest(result={"entry_id": 42})), 200, ExecutionResultResponse)
    assert done.execution.result == {"entry_id": 42}, done

    # The same call again (keys reordered, 18 spelled 18.0): the stored result, not a second run.
    again = expect("tool claim repeated", claim_tool.sync_detailed(
        grant.turn_id, client=client, lease_token=token,
        body=ClaimToolRequest(tool="create_transaction",
                              args={"category_name": "交通", "amount": 18.0, "type": "expense"})),
        200, ExecutionResultResponse)
    assert again.execute is False and again.execution.result == {"entry_id": 42}, again

    answer = {"text": "Booked 18 to 交通.", "entry": 42}
    ended = expect("turn complete", complete_turn.sync_detailed(
        grant.turn_id, client=client, lease_token=token,
        body=CompleteTurnRequest(response=answer)), 200, TurnResponse)
    assert ended.turn.state == TurnStateDto.SUCCEEDED, ended

    replay = expect("replay", begin.sync_detailed(client=client, body=message), 200, ReplayResponse)
    assert replay.replay is True and replay.turn.turn_id == grant.turn_id, replay
    assert replay.turn.response == answer, replay.turn.response
    print(f"full_turn: begin → session_busy → heartbeat → tool claim → tool complete → turn complete → replay: ok ({grant.turn_id})")


if __name__ == "__main__":
    main()
