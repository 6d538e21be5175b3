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

Bounded in bytes: past ``max_bytes``, the API key that holds the most gives back first, its least
recently used Responses and conversations first (continuing a chain uses every Response in it, so a
live conversation keeps its oldest turns): a key that floods the store evicts its own. One thing may
take at most a sixteenth of the bound (``max_one``). The SQLite calls, and the JSON of what they read
and write, run on one thread of their own, off the event loop; a transaction that writes takes the
write lock first (``BEGIN IMMEDIATE``), so that frontends writing at once wait their turn.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import os
import sqlite3
import time

import orjson

from frontends.errors import ApiError

log = logging.getLogger("tokenmill.frontend")

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
_ALL = ("SELECT 'responses' AS kind, id, owner, size, used FROM responses UNION ALL "
        "SELECT 'conversations', id, owner, size, used FROM conversations")  # what the bound weighs
MAX_CHAIN = 10_000  # Responses a chain may hold (a longer one is refused: its walk would be the cost)


class BrokenChain(Exception):
    """The conversation before the Response named cannot be read: one of its Responses is no longer stored
    (evicted, or deleted), or it chains more than ``MAX_CHAIN``."""


class ResponseStore:
    def __init__(self, path: str, max_bytes: int, durable: bool = False):
        """``path``: the SQLite file (made if missing, readable by its owner alone); ``durable``: commits survive
        a power loss (a file the user named), else they need only survive the process (the server's own,
        removed when it stops)."""
        self.path, self.max_bytes, self.max_one = path, max_bytes, max_bytes // 16
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="response-store")
        self._db: sqlite3.Connection | None = None
        self._durable = durable

    def _conn(self) -> sqlite3.Connection:
        if self._db is None:  # (made on the store's thread, the only one that uses it)
            self._db = connect(self.path, self._durable)
        return self._db

    async def open(self) -> None:
        """Open the file now: a path that is no SQLite file, or cannot be written, fails here (``sqlite3.Error``,
        ``OSError``)."""
        await asyncio.get_running_loop().run_in_executor(self._pool, self._conn)

    async def _call(self, fn, *args):
        try:
            return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)
        except sqlite3.Error as e:  # (a full disk, a file taken away...: this call fails, the server goes on)
            raise ApiError(503, f"The response store failed: {e}") from None

    def close(self) -> None:
        self._pool.submit(self._close)
        self._pool.shutdown(wait=True)

    # ------------------------------------------------------------------ Responses

    async def put(self, response: dict, input_items: list[dict], owner: str) -> None:
        """Store ``response`` (given ``input_items``; it continues its ``previous_response_id``); where it went on
        with a conversation (its ``conversation``), add its input items and output to that conversation's items
        (but a call cut short: its arguments may be no JSON, and no client ran it)."""
        await self._call(self._put, response, input_items, owner)

    async def get(self, response_id: str, owner: str) -> dict | None:
        return await self._call(self._row, response_id, owner, 1)

    async def input_items(self, response_id: str, owner: str) -> list[dict] | None:
        return await self._call(self._row, response_id, owner, 2)

    async def delete(self, response_id: str, owner: str) -> bool:
        return await self._call(self._delete, "responses", response_id, owner)

    async def history(self, response_id: str, owner: str) -> tuple[list[dict], str] | None:
        """The items of the chain of Responses through ``response_id``, oldest first (each Response's input items,
        then its output), and its first Response's id; None where ``owner`` has no such Response. Raises
        ``BrokenChain`` where one before it is gone."""
        return await self._call(self._history, response_id, owner)

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
        return await self._call(self._items, conversation_id, owner)

    async def add_items(self, conversation_id: str, owner: str, items: list[dict]) -> bool:
        """``items`` after the conversation's (False: ``owner`` has no such conversation)."""
        return await self._call(self._append, conversation_id, owner, items)

    async def delete_item(self, conversation_id: str, owner: str, item_id: str) -> bool | None:
        """Whether the item was there (None: ``owner`` has no such conversation)."""
        return await self._call(self._delete_item, conversation_id, owner, item_id)

    # ------------------------------------------------------------------ on the store's thread

    def _put(self, response: dict, input_items: list[dict], owner: str) -> None:
        """``response`` itself kept where its ``store`` says so (and it takes at most ``max_one``)."""
        db, blob, given = self._conn(), orjson.dumps(response), orjson.dumps(input_items)
        conversation = (response.get("conversation") or {}).get("id")
        with db:
            db.execute("BEGIN IMMEDIATE")
            if response["store"] and len(blob) + len(given) > self.max_one:
                log.warning("response %s not stored: it takes %d bytes, past the %d one may take (a sixteenth of "
                            "--responses-store-mib)", response["id"], len(blob) + len(given), self.max_one)
            elif response["store"]:
                db.execute("INSERT INTO responses VALUES (?, ?, ?, ?, ?, ?, ?)",
                           (response["id"], response.get("previous_response_id"), owner, time.time(),
                            len(blob) + len(given), blob, given))
            if conversation is not None:
                self._append_in(db, conversation, owner, [*input_items, *_replayed(response["output"])])
            self._evict(db, response["id"])

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
        """While the store holds more than ``max_bytes``: of the key that holds the most, its least recently used
        Response or conversation (never ``keep``, the one just written) deleted."""
        held = dict(db.execute(f"SELECT owner, SUM(size) FROM ({_ALL}) GROUP BY owner").fetchall())
        excess = sum(held.values()) - self.max_bytes
        rows: dict[str, sqlite3.Cursor] = {}  # each key's things, least recently used first
        victims: dict[str, list] = {"responses": [], "conversations": []}
        while excess > 0:
            owner = max(held, key=held.__getitem__)
            if owner not in rows:
                rows[owner] = db.execute(f"SELECT kind, id, size FROM ({_ALL}) WHERE owner = ? AND id != ? "
                                         "ORDER BY used", (owner, keep))
            victim = rows[owner].fetchone()
            if victim is None:  # (all it holds is ``keep``)
                del held[owner]
                if not held:
                    break
                continue
            victims[victim[0]].append((victim[1],))
            held[owner] -= victim[2]
            excess -= victim[2]
        db.executemany("DELETE FROM responses WHERE id = ?", victims["responses"])
        db.executemany("DELETE FROM conversations WHERE id = ?", victims["conversations"])
        db.executemany("DELETE FROM items WHERE conversation = ?", victims["conversations"])

    def _row(self, response_id: str, owner: str, column: int) -> dict | list | None:
        row = self._conn().execute("SELECT previous, response, input FROM responses WHERE id = ? AND owner = ?",
                                   (response_id, owner)).fetchone()
        return orjson.loads(row[column]) if row is not None else None

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
            db.execute("BEGIN IMMEDIATE")  # (it marks them used: a write, after these reads)
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

    def _history(self, response_id: str, owner: str) -> tuple[list[dict], str] | None:
        rows = self._chain(response_id, owner)
        if rows is None:
            return None
        items: list[dict] = []
        for response, given in reversed(rows):
            response = orjson.loads(response)
            if response.get("conversation") is not None:  # (its turn is one of that conversation's, not a chain's)
                raise BrokenChain(f"the response {response['id']!r} went on with the conversation "
                                  f"{response['conversation']['id']!r}: continue that conversation instead")
            items += orjson.loads(given)
            items += _replayed(response["output"])
        return items, orjson.loads(rows[-1][0])["id"]

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

    def _items(self, conversation_id: str, owner: str) -> list[dict] | None:
        db = self._conn()
        with db:
            db.execute("BEGIN IMMEDIATE")
            if db.execute("UPDATE conversations SET used = ? WHERE id = ? AND owner = ?",
                          (time.time(), conversation_id, owner)).rowcount == 0:
                return None
            rows = db.execute("SELECT item FROM items WHERE conversation = ? ORDER BY seq", (conversation_id,)).fetchall()
        return [orjson.loads(r[0]) for r in rows]

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


def connect(path: str, durable: bool = False) -> sqlite3.Connection:
    """The store's file opened (made if missing, readable by its owner alone) and its tables made: raises
    ``sqlite3.Error`` (or ``OSError``) where it is no SQLite file or cannot be written (the launcher checks a user's
    file so)."""
    if not os.path.exists(path):
        os.close(os.open(path, os.O_CREAT | os.O_WRONLY, 0o600))  # (SQLite's own files beside it: the same mode)
    db = sqlite3.connect(path, timeout=30.0, isolation_level=None)
    try:
        db.execute("PRAGMA journal_mode=WAL")  # readers never wait for the writer; frontends write in turns
        db.execute(f"PRAGMA synchronous={'NORMAL' if durable else 'OFF'}")
        db.executescript(_SCHEMA)
    except BaseException:
        db.close()
        raise
    return db


def _replayed(output: list[dict]) -> list[dict]:
    """A Response's output as the next turn reads it: a call cut short left out (its arguments may be no JSON,
    and no client ran it)."""
    return [o for o in output if not (o.get("type") == "function_call" and o.get("status") == "incomplete")]
