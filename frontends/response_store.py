"""Stored Responses (OpenAI's ``store``): what ``previous_response_id`` continues, ``GET`` and ``DELETE
/v1/responses/{id}`` and its ``input_items`` read.

One SQLite file that every frontend of a server opens (a call may reach any of them): each Response
as it was answered, the input items it was given, the Response it continued, and the API key that
made it (a digest: another key neither sees nor continues it). A conversation is the chain of its
Responses, each storing only its own turn: ``conversation`` walks back to the first and lays their
inputs and outputs end to end (the first turn's instructions are not carried, as OpenAI's are not).

Bounded in bytes: past ``max_bytes``, the least recently used Responses go first (continuing a
conversation uses every Response in it, so a live conversation keeps its oldest turns). The
SQLite calls run on one thread of their own, off the event loop.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import sqlite3
import time

import orjson

_SCHEMA = """
CREATE TABLE IF NOT EXISTS responses (
    id TEXT PRIMARY KEY, previous TEXT, owner TEXT NOT NULL, used REAL NOT NULL, size INTEGER NOT NULL,
    response BLOB NOT NULL, input BLOB NOT NULL);
CREATE INDEX IF NOT EXISTS responses_used ON responses (used);
"""
MAX_CHAIN = 10_000  # Responses a conversation may chain (a longer one is refused: its walk would be the cost)


class BrokenChain(Exception):
    """The conversation before the Response named cannot be read: one of its Responses is no longer stored
    (evicted, or deleted), or it chains more than ``MAX_CHAIN``."""


class ResponseStore:
    def __init__(self, path: str, max_bytes: int, durable: bool = False):
        """``path``: the SQLite file (made if missing); ``durable``: commits survive a power loss (a file the
        user named), else they need only survive the process (the server's own, removed when it stops)."""
        self.path, self.max_bytes = path, max_bytes
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="response-store")
        self._db: sqlite3.Connection | None = None
        self._durable = durable

    def _conn(self) -> sqlite3.Connection:
        if self._db is None:  # (made on the store's thread, the only one that uses it)
            db = sqlite3.connect(self.path, timeout=30.0, isolation_level=None)
            db.execute("PRAGMA journal_mode=WAL")  # readers never wait for the writer; frontends write in turns
            db.execute(f"PRAGMA synchronous={'NORMAL' if self._durable else 'OFF'}")
            db.executescript(_SCHEMA)
            self._db = db
        return self._db

    async def _call(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    # ------------------------------------------------------------------ the API's

    async def put(self, response: dict, input_items: list[dict], owner: str) -> None:
        """Store ``response`` (given ``input_items``; it continues its ``previous_response_id``), then evict the
        least recently used others while the store holds more than ``max_bytes``."""
        blobs = orjson.dumps(response), orjson.dumps(input_items)
        await self._call(self._put, response["id"], response.get("previous_response_id"), owner, *blobs)

    async def get(self, response_id: str, owner: str) -> dict | None:
        row = await self._call(self._row, response_id, owner)
        return orjson.loads(row[1]) if row is not None else None

    async def input_items(self, response_id: str, owner: str) -> list[dict] | None:
        row = await self._call(self._row, response_id, owner)
        return orjson.loads(row[2]) if row is not None else None

    async def delete(self, response_id: str, owner: str) -> bool:
        return await self._call(self._delete, response_id, owner)

    async def conversation(self, response_id: str, owner: str) -> tuple[list[dict], str] | None:
        """The items of the conversation through ``response_id``, oldest first (each Response's input items, then
        its output), and its first Response's id; None where ``owner`` has no such Response. Raises
        ``BrokenChain`` where one before it is gone."""
        rows = await self._call(self._chain, response_id, owner)
        if rows is None:
            return None
        items: list[dict] = []
        for response, given in reversed(rows):
            items += orjson.loads(given)
            items += orjson.loads(response)["output"]
        return items, orjson.loads(rows[-1][0])["id"]

    def close(self) -> None:
        self._pool.submit(self._close)
        self._pool.shutdown(wait=True)

    # ------------------------------------------------------------------ on the store's thread

    def _put(self, response_id: str, previous: str | None, owner: str, response: bytes, given: bytes) -> None:
        db, size = self._conn(), len(response) + len(given)
        with db:
            db.execute("BEGIN IMMEDIATE")
            db.execute("INSERT OR REPLACE INTO responses VALUES (?, ?, ?, ?, ?, ?, ?)",
                       (response_id, previous, owner, time.time(), size, response, given))
            excess = db.execute("SELECT SUM(size) FROM responses").fetchone()[0] - self.max_bytes
            if excess > 0:
                victims = []
                for victim, n in db.execute("SELECT id, size FROM responses WHERE id != ? ORDER BY used",
                                            (response_id,)):
                    victims.append((victim,))
                    excess -= n
                    if excess <= 0:
                        break
                db.executemany("DELETE FROM responses WHERE id = ?", victims)

    def _row(self, response_id: str, owner: str) -> tuple | None:
        return self._conn().execute("SELECT previous, response, input FROM responses WHERE id = ? AND owner = ?",
                                    (response_id, owner)).fetchone()

    def _delete(self, response_id: str, owner: str) -> bool:
        with self._conn() as db:
            return db.execute("DELETE FROM responses WHERE id = ? AND owner = ?", (response_id, owner)).rowcount > 0

    def _chain(self, response_id: str, owner: str) -> list[tuple[bytes, bytes]] | None:
        """The (response, input) of ``response_id`` and of each Response before it, newest first; each marked
        used now (a conversation being continued is evicted last)."""
        db, rows, ids = self._conn(), [], []
        with db:
            db.execute("BEGIN")
            at: str | None = response_id
            while at is not None:
                row = db.execute("SELECT previous, response, input FROM responses WHERE id = ? AND owner = ?",
                                 (at, owner)).fetchone()
                if row is None:
                    if not rows:
                        return None
                    raise BrokenChain(f"the response {at!r} it continues is no longer stored")
                if len(rows) == MAX_CHAIN:
                    raise BrokenChain(f"its conversation chains more than {MAX_CHAIN} responses")
                ids.append((at,))
                rows.append(row[1:])
                at = row[0]
            now = time.time()
            db.executemany(f"UPDATE responses SET used = {now!r} WHERE id = ?", ids)
        return rows

    def _close(self) -> None:
        if self._db is not None:
            self._db.close()
            self._db = None
