"""The examples' ledger: a small SQLite file of expense bookings, each
stamped with the agentgate idempotency key of the tool execution that made
it, and the offline "LLM" that reads an expense out of a message.

The key column is indexed but deliberately NOT unique: the ledger does not
deduplicate by itself, so a second booking of one tool call would show as a
second row. That agentgate (the claim, and the reconcile hook looking the
key up after a crash) keeps it to one row is what the tests assert.
"""

from __future__ import annotations

import re
import sqlite3
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

# How long a writer waits for SQLite's lock (two workers may book at once).
BUSY_TIMEOUT_S = 10.0


class Ledger:
    def __init__(self, path: str | Path) -> None:
        self.path = str(path)
        with self._connect() as db:
            db.execute(
                "CREATE TABLE IF NOT EXISTS bookings ("
                " entry_id INTEGER PRIMARY KEY AUTOINCREMENT,"
                " idempotency_key TEXT NOT NULL,"
                " amount REAL NOT NULL,"
                " category TEXT NOT NULL)"
            )
            db.execute("CREATE INDEX IF NOT EXISTS bookings_by_key ON bookings (idempotency_key)")

    def _connect(self) -> sqlite3.Connection:
        return sqlite3.connect(self.path, timeout=BUSY_TIMEOUT_S)

    def book(self, idempotency_key: str, amount: float, category: str) -> Dict[str, Any]:
        """Insert one booking and commit it; returns the entry."""
        with self._connect() as db:
            cursor = db.execute(
                "INSERT INTO bookings (idempotency_key, amount, category) VALUES (?, ?, ?)",
                (idempotency_key, amount, category),
            )
            entry_id = cursor.lastrowid
        return {"entry_id": entry_id, "amount": amount, "category": category}

    def find(self, idempotency_key: str) -> Optional[Dict[str, Any]]:
        """The booking made under this key, if any (the reconcile hook)."""
        with self._connect() as db:
            row = db.execute(
                "SELECT entry_id, amount, category FROM bookings WHERE idempotency_key = ? ORDER BY entry_id LIMIT 1",
                (idempotency_key,),
            ).fetchone()
        if row is None:
            return None
        return {"entry_id": row[0], "amount": row[1], "category": row[2]}

    def bookings(self) -> List[Tuple[int, str, float, str]]:
        with self._connect() as db:
            return db.execute(
                "SELECT entry_id, idempotency_key, amount, category FROM bookings ORDER BY entry_id"
            ).fetchall()


_AMOUNT = re.compile(r"(\d+(?:\.\d+)?)")


def read_expense(text: str) -> Tuple[float, str]:
    """What the offline model books for a message: its first number, and the
    first other word as the category ("taxi 18" → 18.0, "taxi")."""
    match = _AMOUNT.search(text)
    if match is None:
        raise ValueError(f"no amount in {text!r}")
    words = [w for w in re.findall(r"[^\W\d_]+", text) if w.lower() not in {"yesterday", "today"}]
    return float(match.group(1)), (words[0].lower() if words else "other")
