"""The Responses API's state: stored Responses (OpenAI's ``store``: what ``previous_response_id``
continues, what ``GET /v1/responses/{id}`` reads) and conversations (the Conversations API's, which a
Response's ``conversation`` continues and grows).

One SQLite file that every frontend of a server opens (a call may reach any of them), and in it, each
thing with the API key that made it (a digest: another key neither sees nor continues it):

- a Response as it was answered, the input items it was given, and the Response it continued. The
  conversation a ``previous_response_id`` names is the chain of Responses that ends there, each storing
  only its own turn: ``history`` walks back to the first and lays their inputs and outputs end to end
  (the first turn's instructions are not carried, as OpenAI's are not);
- a conversation (its id, ``created_at``, ``metadata``) and its items in order, each with its id.

Bounded in bytes: past ``max_bytes``, the least recently used Responses and conversations go first
(continuing a chain uses every Response in it, so a live conversation keeps its oldest turns). The
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
CREATE TABLE IF NOT EXISTS conversations (
    id TEXT PRIMARY KEY, owner TEXT NOT NULL, used REAL NOT NULL, size INTEGER NOT NULL, created_at INTEGER NOT NULL,
    metadata BLOB NOT NULL);
CREATE INDEX IF NOT EXISTS conversations_used ON conversations (used);
CREATE TABLE IF NOT EXISTS items (
    conversation TEXT NOT NULL, seq INTEGER NOT NULL, id TEXT NOT NULL, item BLOB NOT NULL,
    PRIMARY KEY (conversation, seq));
CREATE INDEX IF NOT EXISTS items_id ON items (conversation, id);
"""
MAX_CHAIN = 10_000  # Responses a chain may hold (a longer one is refused: its walk would be the cost)


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

    async def open(self) -> None:
        """Open the file now (made if missing): a path that is no SQLite file, or cannot be written, fails here."""
        await self._call(self._conn)

    async def _call(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    def close(self) -> None:
        self._pool.submit(self._close)
        self._pool.shutdown(wait=True)

    # ------------------------------------------------------------------ Responses

    async def put(self, response: dict, input_items: list[dict], owner: str) -> None:
        """Store ``response`` (given ``input_items``; it continues its ``previous_response_id``); where it went on
        with a conversation (its ``conversation``), add its input items and output to that conversation's items."""
        conversation = (response.get("conversation") or {}).get("id")
        await self._call(self._put, response["id"], response.get("previous_response_id"), owner,
                         orjson.dumps(response) if response["store"] else None, orjson.dumps(input_items),
                         conversation, [*input_items, *response["output"]] if conversation else [])

    async def get(self, response_id: str, owner: str) -> dict | None:
        row = await self._call(self._row, response_id, owner)
        return orjson.loads(row[1]) if row is not None else None

    async def input_items(self, response_id: str, owner: str) -> list[dict] | None:
        row = await self._call(self._row, response_id, owner)
        return orjson.loads(row[2]) if row is not None else None

    async def delete(self, response_id: str, owner: str) -> bool:
        return await self._call(self._delete, "responses", response_id, owner)

    async def history(self, response_id: str, owner: str) -> tuple[list[dict], str] | None:
        """The items of the chain of Responses through ``response_id``, oldest first (each Response's input items,
        then its output), and its first Response's id; None where ``owner`` has no such Response. Raises
        ``BrokenChain`` where one before it is gone."""
        rows = await self._call(self._chain, response_id, owner)
        if rows is None:
            return None
        items: list[dict] = []
        for response, given in reversed(rows):
            response = orjson.loads(response)
            if response.get("conversation") is not None:  # (its turn is one of that conversation's, not a chain's)
                raise BrokenChain(f"the response {response['id']!r} went on with the conversation "
                                  f"{response['conversation']['id']!r}: continue that conversation instead")
            items += orjson.loads(given)
            items += response["output"]
        return items, orjson.loads(rows[-1][0])["id"]

    # ------------------------------------------------------------------ conversations

    async def create_conversation(self, conversation: dict, items: list[dict], owner: str) -> None:
        await self._call(self._create, conversation, items, owner)

    async def conversation(self, conversation_id: str, owner: str) -> dict | None:
        """The conversation object (``id``, ``object``, ``created_at``, ``metadata``), None where ``owner`` has none
        of that id."""
        return await self._call(self._header, conversation_id, owner)

    async def update_conversation(self, conversation_id: str, owner: str, metadata: dict | None) -> dict | None:
        return await self._call(self._update, conversation_id, owner, orjson.dumps(metadata))

    async def delete_conversation(self, conversation_id: str, owner: str) -> bool:
        return await self._call(self._delete, "conversations", conversation_id, owner)

    async def items(self, conversation_id: str, owner: str) -> list[dict] | None:
        """A conversation's items in order (None: ``owner`` has no such conversation); it counts as used now."""
        rows = await self._call(self._items, conversation_id, owner)
        return [orjson.loads(r) for r in rows] if rows is not None else None

    async def add_items(self, conversation_id: str, owner: str, items: list[dict]) -> bool:
        """``items`` after the conversation's (False: ``owner`` has no such conversation)."""
        return await self._call(self._append, conversation_id, owner, items)

    async def delete_item(self, conversation_id: str, owner: str, item_id: str) -> bool | None:
        """Whether the item was there (None: ``owner`` has no such conversation)."""
        return await self._call(self._delete_item, conversation_id, owner, item_id)

    # ------------------------------------------------------------------ on the store's thread

    def _put(self, response_id: str, previous: str | None, owner: str, response: bytes | None, given: bytes,
             conversation: str | None, items: list[dict]) -> None:
        """``response`` None: not stored itself (``store: false``), its conversation's items added alone."""
        db = self._conn()
        with db:
            db.execute("BEGIN IMMEDIATE")
            if response is not None:
                db.execute("INSERT OR REPLACE INTO responses VALUES (?, ?, ?, ?, ?, ?, ?)",
                           (response_id, previous, owner, time.time(), len(response) + len(given), response, given))
            if conversation is not None:
                self._append_in(db, conversation, owner, items)
            self._evict(db, response_id)

    def _create(self, conversation: dict, items: list[dict], owner: str) -> None:
        db, metadata = self._conn(), orjson.dumps(conversation["metadata"])
        with db:
            db.execute("BEGIN IMMEDIATE")
            db.execute("INSERT INTO conversations VALUES (?, ?, ?, ?, ?, ?)",
                       (conversation["id"], owner, time.time(), len(metadata), conversation["created_at"], metadata))
            self._append_in(db, conversation["id"], owner, items)
            self._evict(db, conversation["id"])

    def _append(self, conversation_id: str, owner: str, items: list[dict]) -> bool:
        db = self._conn()
        with db:
            db.execute("BEGIN IMMEDIATE")
            if not self._append_in(db, conversation_id, owner, items):
                return False
            self._evict(db, conversation_id)
        return True

    @staticmethod
    def _append_in(db: sqlite3.Connection, conversation_id: str, owner: str, items: list[dict]) -> bool:
        found = db.execute("SELECT 1 FROM conversations WHERE id = ? AND owner = ?", (conversation_id, owner)).fetchone()
        if found is None:  # (deleted, or evicted, since the call began: its items go nowhere)
            return False
        last = db.execute("SELECT MAX(seq) FROM items WHERE conversation = ?", (conversation_id,)).fetchone()[0]
        rows = [(conversation_id, (last or 0) + 1 + k, item["id"], orjson.dumps(item)) for k, item in enumerate(items)]
        db.executemany("INSERT INTO items VALUES (?, ?, ?, ?)", rows)
        db.execute("UPDATE conversations SET size = size + ?, used = ? WHERE id = ?",
                   (sum(len(r[3]) for r in rows), time.time(), conversation_id))
        return True

    def _evict(self, db: sqlite3.Connection, keep: str) -> None:
        """The least recently used Responses and conversations but ``keep`` deleted while the store holds more than
        ``max_bytes``."""
        excess = db.execute("SELECT (SELECT IFNULL(SUM(size), 0) FROM responses) + "
                            "(SELECT IFNULL(SUM(size), 0) FROM conversations)").fetchone()[0] - self.max_bytes
        if excess <= 0:
            return
        victims: dict[str, list] = {"responses": [], "conversations": []}
        for table, victim, n, _ in db.execute(
                "SELECT 'responses', id, size, used FROM responses WHERE id != ?1 UNION ALL "
                "SELECT 'conversations', id, size, used FROM conversations WHERE id != ?1 ORDER BY used", (keep,)):
            victims[table].append((victim,))
            excess -= n
            if excess <= 0:
                break
        db.executemany("DELETE FROM responses WHERE id = ?", victims["responses"])
        db.executemany("DELETE FROM conversations WHERE id = ?", victims["conversations"])
        db.executemany("DELETE FROM items WHERE conversation = ?", victims["conversations"])

    def _row(self, response_id: str, owner: str) -> tuple | None:
        return self._conn().execute("SELECT previous, response, input FROM responses WHERE id = ? AND owner = ?",
                                    (response_id, owner)).fetchone()

    def _delete(self, table: str, thing_id: str, owner: str) -> bool:
        with self._conn() as db:
            db.execute("BEGIN IMMEDIATE")
            if db.execute(f"DELETE FROM {table} WHERE id = ? AND owner = ?", (thing_id, owner)).rowcount == 0:
                return False
            if table == "conversations":
                db.execute("DELETE FROM items WHERE conversation = ?", (thing_id,))
        return True

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
            db.executemany(f"UPDATE responses SET used = {time.time()!r} WHERE id = ?", ids)
        return rows

    def _header(self, conversation_id: str, owner: str) -> dict | None:
        row = self._conn().execute("SELECT created_at, metadata FROM conversations WHERE id = ? AND owner = ?",
                                   (conversation_id, owner)).fetchone()
        return {"id": conversation_id, "object": "conversation", "created_at": row[0],
                "metadata": orjson.loads(row[1])} if row is not None else None

    def _update(self, conversation_id: str, owner: str, metadata: bytes) -> dict | None:
        with self._conn() as db:
            db.execute("BEGIN IMMEDIATE")
            old = db.execute("SELECT metadata FROM conversations WHERE id = ? AND owner = ?",
                             (conversation_id, owner)).fetchone()
            if old is None:
                return None
            db.execute("UPDATE conversations SET metadata = ?, size = size + ? WHERE id = ?",
                       (metadata, len(metadata) - len(old[0]), conversation_id))
        return self._header(conversation_id, owner)

    def _items(self, conversation_id: str, owner: str) -> list[bytes] | None:
        db = self._conn()
        with db:
            db.execute("BEGIN IMMEDIATE")
            if db.execute("UPDATE conversations SET used = ? WHERE id = ? AND owner = ?",
                          (time.time(), conversation_id, owner)).rowcount == 0:
                return None
            return [r[0] for r in db.execute("SELECT item FROM items WHERE conversation = ? ORDER BY seq",
                                             (conversation_id,))]

    def _delete_item(self, conversation_id: str, owner: str, item_id: str) -> bool | None:
        with self._conn() as db:
            db.execute("BEGIN IMMEDIATE")
            if db.execute("SELECT 1 FROM conversations WHERE id = ? AND owner = ?",
                          (conversation_id, owner)).fetchone() is None:
                return None
            row = db.execute("SELECT seq, item FROM items WHERE conversation = ? AND id = ? ORDER BY seq LIMIT 1",
                             (conversation_id, item_id)).fetchone()
            if row is None:
                return False
            db.execute("DELETE FROM items WHERE conversation = ? AND seq = ?", (conversation_id, row[0]))
            db.execute("UPDATE conversations SET size = size - ? WHERE id = ?", (len(row[1]), conversation_id))
        return True

    def _close(self) -> None:
        if self._db is not None:
            self._db.close()
            self._db = None
