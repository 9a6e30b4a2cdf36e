"""A LangGraph agent that books an expense exactly once, through agentgate.

The graph is the usual tool-calling loop: an `agent` node asks the chat model,
a `tools` node runs the tool calls it made, and back to the agent until it
answers in text. The chat model is LangChain's `GenericFakeChatModel`, fed
what a real model would say for the message (a `book_expense` tool call,
then a sentence), so the example runs offline. The only agentgate code is:

  - the turn around the graph run (`gate.run(...)`), keyed by the user's
    message id: a double-sent message waits and gets the stored reply
    instead of running the graph again;
  - `turn.tool(...)` in the tool node: the booking runs only when agentgate
    says execute, and after a crash mid-booking (`previous_outcome:
    "unknown"`) the reconcile hook looks the booking up in the ledger by the
    execution's idempotency key instead of booking again;
  - the model call waits with `turn.sleep(...)`, so a message sent with
    `--on-busy interrupt` stops this one within a heartbeat interval: the
    graph run raises `TurnCancelled`, the turn ends `cancelled` with
    `turn.partial` (the bookings made so far), and a retry of this message
    replays that instead of running the graph again. (A sync graph cannot be
    interrupted inside a blocking HTTP call: with a real model, stream it and
    call `turn.check_cancelled()` between chunks.)

Run one message (prints one JSON line: replayed or not, how the turn ended,
the response):

    python langgraph_ledger.py --server http://127.0.0.1:7700 --ledger /tmp/ledger.db \\
        --user alice --session chat-1 --message-id msg-1 --text "taxi 18"

A second message to a busy conversation is refused `session_busy` unless it
says what to do (`--wait` seconds retries it): `--on-busy enqueue` queues it
behind the running one (first in, first out; it runs when its turn comes),
`--on-busy interrupt` asks the running one to stop and runs as soon as it
has (`--wait-ms`: how long the server waits for that).

For the crash test, AGENTGATE_EXAMPLE_PAUSE_AFTER_BOOKING=PATH makes the tool
write PATH right after its ledger commit and then pause (at most
PAUSE_AFTER_BOOKING_S), so a test can SIGKILL the worker between the effect
and its completion; `--no-reconcile` leaves the hook out (the control that
shows what the hook prevents).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional

from langchain_core.language_models.fake_chat_models import GenericFakeChatModel
from langchain_core.messages import AIMessage, HumanMessage, ToolMessage
from langgraph.graph import END, START, MessagesState, StateGraph

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ledger import Ledger, read_expense  # noqa: E402

from agentgate import Gate, ToolContext, Turn  # noqa: E402

TOOL = "book_expense"
# The longest the crash hook pauses for its SIGKILL before going on.
PAUSE_AFTER_BOOKING_S = 60.0
PAUSE_ENV = "AGENTGATE_EXAMPLE_PAUSE_AFTER_BOOKING"


def offline_model(text: str) -> GenericFakeChatModel:
    """What an LLM with a `book_expense` tool says to `text`, scripted: one
    tool call with the amount and category read from it, then a sentence."""
    amount, category = read_expense(text)
    return GenericFakeChatModel(
        messages=iter(
            [
                AIMessage(
                    content="",
                    tool_calls=[
                        {"name": TOOL, "args": {"amount": amount, "category": category}, "id": "call_book_1"}
                    ],
                ),
                AIMessage(content=f"Booked {amount:g} to {category}."),
            ]
        )
    )


def booking_tool(ledger: Ledger) -> Callable[[ToolContext], Dict[str, Any]]:
    """The tool's effect: one ledger row under the execution's idempotency key."""

    def run(ctx: ToolContext) -> Dict[str, Any]:
        entry = ledger.book(ctx.idempotency_key, float(ctx.args["amount"]), str(ctx.args["category"]))
        pause_marker = os.environ.get(PAUSE_ENV)
        if pause_marker:
            # Crash-test hook: the effect is committed, its completion not sent.
            Path(pause_marker).write_text(json.dumps(entry))
            time.sleep(PAUSE_AFTER_BOOKING_S)
        return entry

    return run


def build_graph(model: GenericFakeChatModel, turn: Turn, ledger: Ledger, think_s: float, reconcile: bool):
    run = booking_tool(ledger)
    booked: List[Dict[str, Any]] = []
    turn.partial = {"entries": booked}

    def find(ctx: ToolContext) -> Optional[Dict[str, Any]]:
        return ledger.find(ctx.idempotency_key)

    def agent(state: MessagesState) -> Dict[str, Any]:
        # The model call: a real model takes seconds (lets two sends
        # overlap). Waited with turn.sleep, which raises TurnCancelled as
        # soon as the turn is asked to stop (another message's interrupt).
        turn.sleep(think_s)
        return {"messages": [model.invoke(state["messages"])]}

    def tools(state: MessagesState) -> Dict[str, Any]:
        last = state["messages"][-1]
        results = []
        for call in last.tool_calls:
            if call["name"] != TOOL:
                raise ValueError(f"unknown tool {call['name']}")
            entry = turn.tool(call["name"], call["args"], run=run, reconcile=find if reconcile else None)
            booked.append(entry)
            turn.partial = {"entries": booked}  # what an interrupted turn ends with
            results.append(ToolMessage(content=json.dumps(entry), tool_call_id=call["id"]))
        return {"messages": results}

    def route(state: MessagesState) -> str:
        last = state["messages"][-1]
        return "tools" if isinstance(last, AIMessage) and last.tool_calls else END

    graph = StateGraph(MessagesState)
    graph.add_node("agent", agent)
    graph.add_node("tools", tools)
    graph.add_edge(START, "agent")
    graph.add_conditional_edges("agent", route, ["tools", END])
    graph.add_edge("tools", "agent")
    return graph.compile()


def handle_message(
    gate: Gate,
    ledger: Ledger,
    user: str,
    session: str,
    message_id: str,
    text: str,
    wait_s: Optional[float],
    think_s: float = 0.0,
    reconcile: bool = True,
    on_busy: Optional[str] = None,
    wait_ms: Optional[int] = None,
) -> Dict[str, Any]:
    """Run the graph for one user message inside its agentgate turn.

    Returns how the message ended: ``state`` (``succeeded``, ``cancelled``
    when another message interrupted it, ...), ``replayed`` (the server
    answered with the stored outcome and the graph did not run), the
    ``response`` (succeeded) or ``partial`` (cancelled), and when the graph
    ran: ``takeover``, ``attempt``, and ``queued_at`` (the positions the
    message held in the conversation's queue, with ``on_busy="enqueue"``).
    """
    ran: Dict[str, Any] = {}
    queued_at: List[int] = []

    def run_graph(turn: Turn) -> Dict[str, Any]:
        ran.update(takeover=turn.takeover, attempt=turn.attempt)
        graph = build_graph(offline_model(text), turn, ledger, think_s, reconcile)
        final = graph.invoke({"messages": [HumanMessage(content=text)]})
        entries = [json.loads(m.content) for m in final["messages"] if isinstance(m, ToolMessage)]
        return {"text": final["messages"][-1].content, "entries": entries}

    result = gate.run(
        user, session, message_id, {"text": text}, run_graph, wait=wait_s,
        on_busy=on_busy, wait_ms=wait_ms, on_queued=queued_at.append,
    )
    outcome: Dict[str, Any] = {"replayed": result.replayed, "state": result.state, "turn_id": result.turn_id}
    if result.state == "succeeded":
        outcome["response"] = result.value
    if result.state == "cancelled":
        outcome["partial"] = result.partial
    if not result.replayed:
        outcome.update(ran, queued_at=queued_at)
    return outcome


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--server", required=True)
    parser.add_argument("--api-key")
    parser.add_argument("--ledger", required=True)
    parser.add_argument("--user", default="alice")
    parser.add_argument("--session", default="chat-1")
    parser.add_argument("--message-id", required=True)
    parser.add_argument("--text", required=True)
    parser.add_argument("--wait", type=float, default=None,
                        help="seconds a refused begin is retried (a queued one: default 300)")
    parser.add_argument("--on-busy", choices=["enqueue", "interrupt"],
                        help="if the conversation is busy: queue behind it, or interrupt it "
                             "(default: refused session_busy, retried for --wait)")
    parser.add_argument("--wait-ms", type=int, help="with --on-busy interrupt: how long the server "
                                                    "waits for the interrupted turn to end (default 12000)")
    parser.add_argument("--think-ms", type=int, default=0, help="the fake model's think time per round")
    parser.add_argument("--no-reconcile", action="store_true", help="leave out the reconcile hook")
    args = parser.parse_args()
    if args.wait_ms is not None and args.on_busy != "interrupt":
        parser.error("--wait-ms goes with --on-busy interrupt")
    with Gate(args.server, api_key=args.api_key) as gate:
        outcome = handle_message(
            gate,
            Ledger(args.ledger),
            args.user,
            args.session,
            args.message_id,
            args.text,
            args.wait,
            args.think_ms / 1000,
            reconcile=not args.no_reconcile,
            on_busy=args.on_busy,
            wait_ms=args.wait_ms,
        )
    print(json.dumps(outcome), flush=True)


if __name__ == "__main__":
    main()
