"""A chat endpoint on FastAPI whose turns go through agentgate.

    AGENTGATE_URL=http://127.0.0.1:7700 uvicorn fastapi_app:app

POST /chat {"user_id", "session_id", "message_id", "text"}: the browser's
message id is the turn's client_request_id, so a double-click or a retry
gets the stored reply, and the booking happens once. A second message
while one runs is answered 409 with the server's Retry-After.
"""

from __future__ import annotations

import os
import re
from contextlib import asynccontextmanager
from typing import Any, AsyncIterator, Dict, Optional, TypedDict

from fastapi import FastAPI, HTTPException
from pydantic import BaseModel

import agentgate
from agentgate import AsyncGate, AsyncTurn, ToolContext

gate = AsyncGate(os.environ.get("AGENTGATE_URL", "http://127.0.0.1:7700"), api_key=os.environ.get("AGENTGATE_API_KEY"))

class Entry(TypedDict):
    entry_id: int
    amount: float
    category: str


#: Stands for the system the tool books into; it remembers each booking's
#: idempotency key, as a payment or ledger API would.
LEDGER: Dict[str, Entry] = {}


def find_booking(ctx: ToolContext) -> Optional[Entry]:
    """Reconcile hook: did a crashed attempt of this call book already?"""
    return LEDGER.get(ctx.idempotency_key)


@gate.tool(reconcile=find_booking)
async def create_transaction(ctx: ToolContext, amount: float, category: str) -> Entry:
    entry: Entry = {"entry_id": len(LEDGER) + 1, "amount": amount, "category": category}
    LEDGER[ctx.idempotency_key] = entry
    return entry


async def agent(turn: AsyncTurn, text: str) -> Dict[str, Any]:
    """The LLM loop (here, one regular expression)."""
    found = re.search(r"(\d+(?:\.\d+)?)", text)
    if not found:
        return {"text": "How much was it?"}
    entry = await create_transaction(amount=float(found.group(1)), category="taxi" if "taxi" in text else "other")
    return {"text": f"Booked {entry['amount']:g} to {entry['category']}.", "entry": entry}


class Message(BaseModel):
    user_id: str
    session_id: str
    message_id: str
    text: str


@asynccontextmanager
async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
    yield
    await gate.aclose()


app = FastAPI(lifespan=lifespan)


def retry_after(error: agentgate.AgentgateError) -> Dict[str, str]:
    seconds = max(1, -(-(error.retry_after_ms or 1000) // 1000))
    return {"Retry-After": str(seconds)}


@app.post("/chat")
async def chat(message: Message) -> Dict[str, Any]:
    try:
        reply: Dict[str, Any] = await gate.run_turn(
            message.user_id,
            message.session_id,
            message.message_id,
            {"text": message.text},
            lambda turn: agent(turn, message.text),
            wait=2.0,  # a short wait hides most double-sends; then say busy
        )
        return reply
    except agentgate.SessionBusy as busy:
        raise HTTPException(409, "the previous message is still being processed", headers=retry_after(busy))
    except (agentgate.RequestInFlight, agentgate.UserAtCapacity, agentgate.StoreUnavailable) as later:
        raise HTTPException(503 if isinstance(later, agentgate.StoreUnavailable) else 429, later.message, headers=retry_after(later))
    except agentgate.AwaitingConfirmation:
        raise HTTPException(409, "answer the pending confirmation first")
    except agentgate.PayloadMismatch:
        raise HTTPException(422, "this message id was already used for another message")
