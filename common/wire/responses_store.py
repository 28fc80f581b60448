"""The stored responses (`store`, default true): what `previous_response_id`, `GET` and `DELETE
/v1/responses/{id}` read. Bounded: at most `capacity` responses (`--responses-store-size`), the oldest
evicted first; an id evicted, deleted or never stored is a 404 naming it.

One SQLite database: in memory for a server or a router alone (a restart keeps nothing), a file in the
group's shared directory for the processes of a `tandem router --processes N` group (router/processes.py), so
that every process reads what any of them stored; the group's directory, and the store, go with the group.
A cancel asked of a process of the group other than the one streaming the response is a flag in its row,
which the streaming one reads (at most every CANCEL_POLL_S). Each row is a response and the conversation's
items up to it (its input, a previous response's history
first): a continuation prepends them, so its prompt starts with the earlier one's (the prefix cache hits).
"""

from __future__ import annotations

import json
import sqlite3
import threading
from typing import Any

from common.wire.errors import NotFound

SCHEMA = """CREATE TABLE IF NOT EXISTS responses (
    seq INTEGER PRIMARY KEY AUTOINCREMENT, id TEXT UNIQUE NOT NULL, response TEXT NOT NULL, items TEXT NOT NULL,
    cancel INTEGER NOT NULL DEFAULT 0)"""


class ResponsesStore:
    def __init__(self, capacity: int, path: str | None = None):
        self.capacity, self.path = capacity, path
        self._db = sqlite3.connect(path or ":memory:", check_same_thread=False, isolation_level=None, timeout=10)
        self._lock = threading.Lock()
        if path is not None:
            self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute(SCHEMA)

    def put(self, response: dict[str, Any], items: list[dict[str, Any]]) -> None:
        """Store (or replace: an in-progress one once it ended) `response`, after `items` (its conversation's
        input items); the oldest beyond the capacity go."""
        with self._lock:
            self._db.execute(
                "INSERT INTO responses (id, response, items) VALUES (?, ?, ?) ON CONFLICT(id) DO UPDATE SET "
                "response = excluded.response",
                (response["id"], json.dumps(response), json.dumps(items)),
            )
            self._db.execute(
                "DELETE FROM responses WHERE seq <= (SELECT MAX(seq) FROM responses) - ?", (self.capacity,)
            )

    def get(self, rid: str, param: str = "response_id") -> dict[str, Any]:
        """The stored response `rid`, or a 404 naming `param`."""
        return json.loads(self._row(rid, param)[0])

    def history(self, rid: str) -> list[dict[str, Any]]:
        """The conversation a continuation of `rid` goes on from: its input items and its output items."""
        response, items = self._row(rid, "previous_response_id")
        return json.loads(items) + json.loads(response)["output"]

    @property
    def shared(self) -> bool:
        """Whether other processes use this store too (a router group's)."""
        return self.path is not None

    def request_cancel(self, rid: str) -> None:
        """Ask the process that streams `rid` to cancel it (it reads cancel_requested as it streams)."""
        with self._lock:
            self._db.execute("UPDATE responses SET cancel = 1 WHERE id = ?", (rid,))

    def cancel_requested(self, rid: str) -> bool:
        with self._lock:
            row = self._db.execute("SELECT cancel FROM responses WHERE id = ?", (rid,)).fetchone()
        return bool(row and row[0])

    def delete(self, rid: str) -> None:
        with self._lock:
            gone = self._db.execute("DELETE FROM responses WHERE id = ?", (rid,)).rowcount
        if not gone:
            raise self._missing(rid, "response_id")

    def __len__(self) -> int:
        with self._lock:
            return self._db.execute("SELECT COUNT(*) FROM responses").fetchone()[0]

    def _row(self, rid: str, param: str) -> tuple[str, str]:
        with self._lock:
            row = self._db.execute("SELECT response, items FROM responses WHERE id = ?", (rid,)).fetchone()
        if row is None:
            raise self._missing(rid, param)
        return row

    def _missing(self, rid: str, param: str) -> NotFound:
        return NotFound(
            f"{param}: no stored response {rid!r} (never stored, deleted, or evicted: this server keeps the "
            f"{self.capacity} newest, --responses-store-size)",
            param=param,
        )
