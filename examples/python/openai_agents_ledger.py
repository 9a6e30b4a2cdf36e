"""An OpenAI Agents SDK agent that books an expense exactly once, through
agentgate, offline.

`OfflineModel` is a custom `agents.Model` (no network, no API key): asked
about a message, it calls the `book_expense` function tool with the amount
and category read from it; shown the tool's output, it answers in a
sentence. The tool is a plain async function made exactly-once by
agentgate's `@gate.tool` decorator (its turn is the enclosing `async with
gate.turn(...)`, found through contextvars; after a crash mid-booking the
reconcile hook finds the booking by its idempotency key) and handed to the
SDK with `function_tool`, which reads its signature without the `ctx`.

    python openai_agents_ledger.py --server http://127.0.0.1:7700 --ledger /tmp/ledger.db \\
        --user alice --session chat-1 --message-id msg-1 --text "lunch 35"

prints one JSON line: whether the turn was replayed, and its response. A
repeat of the same message id replays the stored response: the agent does
not run again and nothing is booked twice.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path
from typing import Any, AsyncIterator, Dict, List, Optional

from agents import Agent, RunConfig, Runner, function_tool
from agents.items import ModelResponse, TResponseInputItem, TResponseStreamEvent
from agents.models.interface import Model, ModelTracing
from agents.usage import Usage
from openai.types.responses import ResponseFunctionToolCall, ResponseOutputMessage, ResponseOutputText

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ledger import Ledger, read_expense  # noqa: E402

from agentgate import AsyncGate, Replayed, ToolContext  # noqa: E402

TOOL = "book_expense"


class OfflineModel(Model):
    """A scripted stand-in for an LLM with one tool: call it, then answer."""

    async def get_response(
        self,
        system_instructions: Optional[str],
        input: str | List[TResponseInputItem],
        model_settings: Any,
        tools: List[Any],
        output_schema: Any,
        handoffs: List[Any],
        tracing: ModelTracing,
        *,
        previous_response_id: Optional[str] = None,
        conversation_id: Optional[str] = None,
        prompt: Any = None,
        **_: Any,
    ) -> ModelResponse:
        items = [{"role": "user", "content": input}] if isinstance(input, str) else list(input)
        outputs = [i for i in items if isinstance(i, dict) and i.get("type") == "function_call_output"]
        if outputs:
            entry = json.loads(outputs[-1]["output"]) if isinstance(outputs[-1]["output"], str) else {}
            text = f"Booked {entry.get('amount', 0):g} to {entry.get('category', '?')} (entry {entry.get('entry_id')})."
            message = ResponseOutputMessage(
                id="msg_offline_1",
                type="message",
                role="assistant",
                status="completed",
                content=[ResponseOutputText(type="output_text", text=text, annotations=[])],
            )
            return ModelResponse(output=[message], usage=Usage(), response_id=None)
        said = next(i["content"] for i in reversed(items) if isinstance(i, dict) and i.get("role") == "user")
        amount, category = read_expense(said if isinstance(said, str) else json.dumps(said))
        call = ResponseFunctionToolCall(
            id="fc_offline_1",
            call_id="call_book_1",
            type="function_call",
            name=TOOL,
            arguments=json.dumps({"amount": amount, "category": category}),
            status="completed",
        )
        return ModelResponse(output=[call], usage=Usage(), response_id=None)

    def stream_response(self, *args: Any, **kwargs: Any) -> AsyncIterator[TResponseStreamEvent]:
        raise NotImplementedError("the offline model does not stream")


def bookkeeper(gate: AsyncGate, ledger: Ledger) -> Agent:
    @gate.tool(name=TOOL, reconcile=lambda ctx: ledger.find(ctx.idempotency_key))
    async def book_expense(ctx: ToolContext, amount: float, category: str) -> Dict[str, Any]:
        """Book an expense of `amount` in `category` in the user's ledger."""
        return ledger.book(ctx.idempotency_key, amount, category)

    async def as_text(amount: float, category: str) -> str:
        """Book an expense of `amount` in `category` in the user's ledger."""
        return json.dumps(await book_expense(amount, category))

    as_text.__name__ = TOOL
    return Agent(
        name="bookkeeper",
        instructions="Book the expense the user names, then say what you booked.",
        model=OfflineModel(),
        tools=[function_tool(as_text, name_override=TOOL)],
    )


async def handle_message(
    gate: AsyncGate, ledger: Ledger, user: str, session: str, message_id: str, text: str, wait_s: float
) -> Dict[str, Any]:
    """Run the agent for one user message inside its agentgate turn."""
    try:
        async with gate.turn(user, session, message_id, {"text": text}, wait=wait_s) as turn:
            # Tracing off: the SDK would otherwise export traces to OpenAI.
            result = await Runner.run(bookkeeper(gate, ledger), text, run_config=RunConfig(tracing_disabled=True))
            response = {"text": result.final_output}
            await turn.complete(response)
            return {"replayed": False, "takeover": turn.takeover, "attempt": turn.attempt, "response": response}
    except Replayed as replay:
        return {"replayed": True, "response": replay.response}


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--server", required=True)
    parser.add_argument("--api-key")
    parser.add_argument("--ledger", required=True)
    parser.add_argument("--user", default="alice")
    parser.add_argument("--session", default="chat-1")
    parser.add_argument("--message-id", required=True)
    parser.add_argument("--text", required=True)
    parser.add_argument("--wait", type=float, default=0.0, help="seconds a busy begin may wait")
    args = parser.parse_args()
    gate = AsyncGate(args.server, api_key=args.api_key)
    try:
        outcome = await handle_message(
            gate, Ledger(args.ledger), args.user, args.session, args.message_id, args.text, args.wait
        )
    finally:
        await gate.aclose()
    print(json.dumps(outcome), flush=True)


if __name__ == "__main__":
    asyncio.run(main())
