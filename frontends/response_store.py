"""The Responses API's state: stored Responses (OpenAI's ``store``: what ``previous_response_id``
continues, what ``GET /v1/responses/{id}`` reads) and conversations (the Conversations API's, which a
Response's ``conversation`` continues and grows).

One SQLite file that every frontend of a server opens (a call may reach any of them), and in it, each
thing with the API key that made it (a digest: another key neither sees nor continues it):

- a Response as it was answered, the input items it was given, and the Response it continued. The
  conversation a ``previous_response_id`` names is the chain of Responses that ends there, each storing
  only its own turn: ``history`` walks back to the first and lays their inputs and outputs end to end
  (no earlier turn's instructions are carried, as OpenAI's are not);
- a conversation (its id, ``created_at``, ``metadata``) and its items in order, each with its id;
- a background Response while it runs (``frontends.background``): which frontend runs it and when that frontend last
  said so (one silent for ``STALE`` seconds died: its Response has failed), and, where it was created streamed,
  its events, kept with it (to be streamed again).

Bounded in bytes (``max_bytes``): one thing may take a sixteenth of it (``max_one``: a larger Response is
not kept; a conversation keeps its newest items within it). Past the bound, the API key that holds the
most gives back first, its least recently used things first (continuing a chain uses every Response in
it, so a live conversation keeps its oldest turns): a key that floods the store evicts its own. A background
Response that runs is neither evicted nor counted until it ends; a key's runs may take a quarter of the bound
together (``max_running``). What
each key holds is kept by the schema's triggers, so that a write weighs the bound without a scan.

The SQLite calls, and the JSON of what they read back, run on one thread of each store's own, off the
event loop. A write takes the write lock first (``BEGIN IMMEDIATE``): frontends writing at once wait
their turn; reads take none (WAL).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
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
CREATE INDEX IF NOT EXISTS responses_used ON responses (owner, used);
CREATE TABLE IF NOT EXISTS conversations (
    id TEXT PRIMARY KEY, owner TEXT NOT NULL, used REAL NOT NULL, size INTEGER NOT NULL, created_at INTEGER NOT NULL,
    metadata BLOB NOT NULL);
CREATE INDEX IF NOT EXISTS conversations_used ON conversations (owner, used);
CREATE TABLE IF NOT EXISTS items (
    conversation TEXT NOT NULL, seq INTEGER NOT NULL, id TEXT NOT NULL, kind TEXT, call_id TEXT, item BLOB NOT NULL,
    PRIMARY KEY (conversation, seq));
CREATE INDEX IF NOT EXISTS items_id ON items (conversation, id);
-- what each key holds, kept up to date by the writes themselves
CREATE TABLE IF NOT EXISTS owners (owner TEXT PRIMARY KEY, size INTEGER NOT NULL);
CREATE TRIGGER IF NOT EXISTS responses_in AFTER INSERT ON responses BEGIN
    INSERT INTO owners VALUES (NEW.owner, NEW.size) ON CONFLICT (owner) DO UPDATE SET size = size + NEW.size; END;
CREATE TRIGGER IF NOT EXISTS responses_out AFTER DELETE ON responses BEGIN
    UPDATE owners SET size = size - OLD.size WHERE owner = OLD.owner; END;
CREATE TRIGGER IF NOT EXISTS conversations_in AFTER INSERT ON conversations BEGIN
    INSERT INTO owners VALUES (NEW.owner, NEW.size) ON CONFLICT (owner) DO UPDATE SET size = size + NEW.size; END;
CREATE TRIGGER IF NOT EXISTS conversations_out AFTER DELETE ON conversations BEGIN
    UPDATE owners SET size = size - OLD.size WHERE owner = OLD.owner;
    DELETE FROM items WHERE conversation = OLD.id; END;
CREATE TRIGGER IF NOT EXISTS conversations_size AFTER UPDATE OF size ON conversations BEGIN
    UPDATE owners SET size = size + NEW.size - OLD.size WHERE owner = NEW.owner; END;
-- background Responses: those running (the frontend running each, when it last said so, whether its events are
-- kept, the lock it holds on its conversation), and the events of those created streamed (counted in their
-- Response's size)
CREATE TABLE IF NOT EXISTS background (id TEXT PRIMARY KEY, runner TEXT NOT NULL, alive REAL NOT NULL,
    events INTEGER NOT NULL, holds TEXT);
CREATE INDEX IF NOT EXISTS background_runner ON background (runner);
CREATE TABLE IF NOT EXISTS events (response TEXT NOT NULL, seq INTEGER NOT NULL, event BLOB NOT NULL,
    PRIMARY KEY (response, seq));
CREATE TRIGGER IF NOT EXISTS responses_size AFTER UPDATE OF size ON responses BEGIN
    UPDATE owners SET size = size + NEW.size - OLD.size WHERE owner = NEW.owner; END;
CREATE TRIGGER IF NOT EXISTS responses_gone AFTER DELETE ON responses BEGIN
    DELETE FROM events WHERE response = OLD.id; DELETE FROM background WHERE id = OLD.id; END;
-- a conversation a turn runs on (OpenAI's conversation_locked): the turn, and until when its frontend holds it
CREATE TABLE IF NOT EXISTS locks (conversation TEXT PRIMARY KEY, holder TEXT NOT NULL, until REAL NOT NULL);
CREATE INDEX IF NOT EXISTS locks_holder ON locks (holder);
CREATE TRIGGER IF NOT EXISTS conversations_unlocked AFTER DELETE ON conversations BEGIN
    DELETE FROM locks WHERE conversation = OLD.id; END;
CREATE TRIGGER IF NOT EXISTS background_over AFTER DELETE ON background BEGIN  -- (ended, cancelled, failed...)
    DELETE FROM locks WHERE holder = OLD.holds; END;
"""
RUNNING = ("queued", "in_progress")  # a background Response's statuses until it ends
# seconds a conversation's lock lasts unless its frontend renews it (every second, while the turn runs): what a
# frontend that died holds it for
LEASE = 10.0
BUSY = 30.0  # seconds a store waits for the file's write lock (then "database is locked")
# seconds a running background Response's frontend may not say it runs before it counts as failed (twice the
# write lock's longest wait, BUSY: a frontend waiting its turn is no dead one)
STALE = 60.0
MAX_CHAIN = 10_000  # Responses a chain may hold (a longer one is refused: its walk would be the cost)


class BrokenChain(Exception):
    """The conversation before the Response named cannot be read: one of its Responses is no longer stored
    (evicted, or deleted), it chains more than ``MAX_CHAIN``, or it went on with a stored conversation."""


class DuplicateItem(Exception):
    """An item added to a conversation has the id of one it holds already."""


class StillRunning(Exception):
    """The Response named is a background Response still running: it has no output to continue yet."""


class NotBackground(Exception):
    """Only a background Response can be cancelled."""


class Locked(Exception):
    """Another turn runs on the conversation (it holds its lock)."""


class RunsFull(Exception):
    """A key's background Responses that run take what they may (``max_running``): no other starts."""


class Keep:
    """How a Response is stored (``ResponsesFormat.keep``): with its input ``items``, as ``owner``'s; in a
    conversation, the lock its turn ``holds`` (``ResponseStore.items``), let go of as the turn's items are added, or
    as the turn ends without them (``release``)."""

    def __init__(self, store: ResponseStore, items: list[dict], owner: str, holds: Hold | None = None) -> None:
        self.store, self.items, self.owner, self.holds = store, items, owner, holds

    async def __call__(self, response: dict) -> None:
        try:
            await self.store.put(response, self.items, self.owner, self.holds)
        except ApiError as e:  # (the store failed: the answer is still given, only continuing it will fail)
            log.warning("response %s not stored: %s", response["id"], e.message)
        else:
            if self.holds is not None:
                self.holds.let_go()

    def release(self) -> None:
        """The turn ended without its items added: let go of the lock it holds, if any."""
        if self.holds is not None:
            self.holds.release()

    async def released(self) -> None:
        """``release``, done when it returns (a refused turn: see ``Hold.released``)."""
        if self.holds is not None:
            await self.holds.released()


class Hold:
    """A turn's lock on a conversation (``ResponseStore.items``), held while the turn runs: its frontend renews it
    (``ResponseStore.renew``) while it is in ``held`` (the frontend's); ``release`` lets go of it (once, whatever
    ends the turn)."""

    def __init__(self, store: ResponseStore, conversation: str, held: dict[str, Hold]) -> None:
        self.store, self.conversation, self.holder, self.held = store, conversation, os.urandom(16).hex(), held
        held[self.holder] = self

    def let_go(self) -> None:
        """The store let go of it already (in the write that added the turn's items, or ended its run)."""
        self.held.pop(self.holder, None)

    def release(self) -> None:
        self._released()  # (a task: called where nothing may be awaited)

    async def released(self) -> None:
        """``release``, done when it returns: a refused turn is answered with its conversation free again (in a
        task all the same: a client gone meanwhile cancels the wait, not the release; a store that fails meanwhile
        leaves the lock to its lease, and the refusal is still the answer)."""
        task = self._released()
        if task is not None:
            with contextlib.suppress(ApiError):
                await asyncio.shield(task)

    def _released(self) -> asyncio.Task | None:
        if self.held.pop(self.holder, None) is None:
            return None
        task = asyncio.get_running_loop().create_task(self.store.release(self.conversation, self.holder))
        task.add_done_callback(lambda t: t.cancelled() or t.exception())
        return task


class ResponseStore:
    def __init__(self, path: str, max_bytes: int, durable: bool = False):
        """``path``: the SQLite file (made if missing, readable by its owner alone); ``durable``: commits survive
        a power loss (a file the user named), else they need only survive the process (the server's own,
        removed when it stops)."""
        self.path, self.max_bytes, self.max_one = path, max_bytes, max_bytes // 16
        # what one key's running background Responses may take together (they are not counted in the bound: this is
        # what bounds them)
        self.max_running = max_bytes // 4
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="response-store")
        self._db: sqlite3.Connection | None = None
        self._durable = durable
        self._closed = False

    def _conn(self) -> sqlite3.Connection:
        if self._db is None:  # (made on the store's thread, the only one that uses it)
            self._db = connect(self.path, self._durable)
        return self._db

    async def open(self) -> None:
        """Open the file now: a path that is no SQLite file, or cannot be written, fails here (``sqlite3.Error``,
        ``OSError``)."""
        await asyncio.get_running_loop().run_in_executor(self._pool, self._conn)

    async def close(self) -> None:
        if not self._closed:
            self._closed = True
            await asyncio.get_running_loop().run_in_executor(self._pool, self._close)
            self._pool.shutdown(wait=False)

    async def _call(self, fn, *args):
        if self._closed:  # (a call that comes as the frontend stops)
            raise ApiError(503, "The response store is closed: the server is stopping")
        try:
            return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)
        except sqlite3.Error as e:  # (a full disk, a file taken away...: this call fails, the server goes on)
            raise ApiError(503, f"The response store failed: {e}") from None

    def fits(self, items: list[dict]) -> bool:
        """Whether ``items`` take at most what one thing may (``max_one``)."""
        return len(orjson.dumps(items)) <= self.max_one

    # ------------------------------------------------------------------ Responses

    async def put(self, response: dict, input_items: list[dict], owner: str, holds: Hold | None = None) -> None:
        """Store ``response`` (given ``input_items``; it continues its ``previous_response_id``) where its ``store``
        says so and it fits; where it went on with a conversation (its ``conversation``), add its input items and
        output to that conversation's items (but a call cut short: its arguments may be no JSON, and no client
        ran it), letting go of the lock its turn ``holds``."""
        await self._call(self._put, response, input_items, owner, _holder(holds))

    async def get(self, response_id: str, owner: str) -> dict | None:
        """The Response as it stands (a background one that is running: as it began, ``queued`` or
        ``in_progress``; one whose frontend stopped saying it runs, ``failed``)."""
        return await self._call(self._response, response_id, owner)

    async def input_items(self, response_id: str, owner: str) -> list[dict] | None:
        row = await self._call(self._read, "SELECT input FROM responses WHERE id = ? AND owner = ?", response_id, owner)
        return orjson.loads(row[0]) if row is not None else None

    async def delete(self, response_id: str, owner: str) -> bool:
        return await self._call(self._delete, "responses", response_id, owner)

    async def history(self, response_id: str, owner: str) -> tuple[list[dict], str] | None:
        """The items of the chain of Responses through ``response_id``, oldest first (each Response's input items,
        then its output), and its first Response's id; None where ``owner`` has no such Response. Raises
        ``BrokenChain`` where one before it is gone, or it went on with a stored conversation."""
        return await self._call(self._history, response_id, owner)

    # ------------------------------------------------------------------ background Responses

    async def start(self, response: dict, input_items: list[dict], owner: str, runner: str,
                    events: list[tuple[int, bytes]] | None, holds: Hold | None = None) -> bool:
        """Store a background Response as it begins (``queued``), run by the frontend ``runner`` (which says so:
        ``heartbeat``); ``events``: its first events, where they are kept (``progress``) to be streamed again. False:
        it takes more than ``max_one`` (not stored). While it runs it is neither evicted nor counted against the
        bound, but with its key's other runs it may take no more than ``max_running`` (``RunsFull``: not started; its
        events are no longer kept past it). It ``holds`` its conversation's lock until it is no longer running."""
        return await self._call(self._start, response, input_items, owner, runner, events,
                                _holder(holds))

    async def progress(self, response_id: str, runner: str, events: list[tuple[int, bytes]],
                       response: dict | None = None) -> tuple[bool, bool]:
        """Keep a running background Response's new ``events`` and its ``response`` as it stands now, if given.
        Whether it is still ``runner``'s to run (False: cancelled, deleted, or counted as failed: its run should
        stop), and whether its events are still kept (past ``max_one`` with its Response, or ``max_running`` with its
        key's runs, none is any more)."""
        return await self._call(self._progress, response_id, runner, events, response)

    async def finish(self, response: dict, input_items: list[dict], owner: str, events: list[tuple[int, bytes]],
                     holds: Hold | None = None) -> bool:
        """A background Response ended: stored as ``put`` stores one, over its running state, with its last
        ``events`` (False: it was cancelled or deleted meanwhile, and stays so). Should it take more than
        ``max_one``, its events go, then its output (``failed``, saying so)."""
        return await self._call(self._finish, response, input_items, owner, events,
                                _holder(holds))

    async def cancel(self, response_id: str, owner: str) -> dict | None:
        """A running background Response ``cancelled`` (one that has ended is left as it is): the Response; None
        where ``owner`` has none of that id; ``NotBackground`` where it is no background Response."""
        return await self._call(self._cancel, response_id, owner)

    async def heartbeat(self, runner: str, running: list[str]) -> set[str]:
        """``runner`` still runs these background Responses: the ids of those still its to run."""
        return await self._call(self._heartbeat, runner, running)

    async def fail(self, response_id: str, runner: str, why: str) -> None:
        """A background Response ``runner`` could not run on has ``failed`` (where it is still its to run)."""
        await self._call(self._fail, response_id, runner, why)

    async def abandon(self, runner: str) -> None:
        """``runner`` stops: the background Responses it was running have ``failed``."""
        await self._call(self._abandon, runner)

    async def events(self, response_id: str, owner: str, after: int, limit: int = 256) -> tuple[
            list[tuple[int, bytes]], dict, bool] | None:
        """Up to ``limit`` of a background Response's events with a sequence number past ``after``, the Response as it
        stands (as ``get`` reads it: read first, so that one that has ended has all its events there), and whether its
        events are kept (False: it was not created streamed, or they took too much); None where ``owner`` has no
        Response of that id."""
        return await self._call(self._events, response_id, owner, after, limit)

    # ------------------------------------------------------------------ conversations

    async def create_conversation(self, conversation: dict, items: list[dict], owner: str) -> None:
        await self._call(self._create, conversation, items, owner)

    async def conversation(self, conversation_id: str, owner: str) -> dict | None:
        """The conversation object (``id``, ``object``, ``created_at``, ``metadata``), None where ``owner`` has none
        of that id."""
        return await self._call(self._header, conversation_id, owner)

    async def update_conversation(self, conversation_id: str, owner: str, metadata: dict) -> dict | None:
        return await self._call(self._update, conversation_id, owner, metadata)

    async def delete_conversation(self, conversation_id: str, owner: str) -> bool:
        return await self._call(self._delete, "conversations", conversation_id, owner)

    async def items(self, conversation_id: str, owner: str, holds: Hold | None = None) -> list[dict] | None:
        """A conversation's items in order (None: ``owner`` has no such conversation); it counts as used now. A turn
        that ``holds`` takes its lock, held until its items are added (``put``, ``finish``) or it is let go of:
        ``Locked`` where another turn holds it."""
        return await self._call(self._items, conversation_id, owner, _holder(holds))

    async def release(self, conversation_id: str, holder: str) -> None:
        await self._call(self._release, conversation_id, holder)

    async def renew(self, holders: list[str]) -> None:
        """These locks held on: for ``LEASE`` seconds more."""
        await self._call(self._renew, holders)

    async def items_page(self, conversation_id: str, owner: str, limit: int, descending: bool,
                         after: str | None) -> tuple[list[dict], bool] | None:
        """Up to ``limit`` of a conversation's items, newest first where ``descending``, from after the item
        ``after`` (``KeyError`` where it has none of that id), and whether more follow; None: no such conversation."""
        return await self._call(self._page, conversation_id, owner, limit, descending, after)

    async def item(self, conversation_id: str, owner: str, item_id: str) -> dict | None:
        """One of a conversation's items (``KeyError`` where it has none of that id); None: no such conversation."""
        return await self._call(self._item, conversation_id, owner, item_id)

    async def add_items(self, conversation_id: str, owner: str, items: list[dict]) -> bool:
        """``items`` after the conversation's (False: ``owner`` has no such conversation; ``DuplicateItem``: one has
        the id of one it holds); its oldest go where it would take more than ``max_one``."""
        return await self._call(self._append, conversation_id, owner, items)

    async def delete_item(self, conversation_id: str, owner: str, item_id: str) -> dict | None:
        """The conversation, without the item (``KeyError`` where it had none of that id); None: no such
        conversation."""
        return await self._call(self._delete_item, conversation_id, owner, item_id)

    # ------------------------------------------------------------------ on the store's thread

    def _put(self, response: dict, input_items: list[dict], owner: str, holder: str | None = None) -> None:
        db, blob, given = self._conn(), orjson.dumps(response), orjson.dumps(input_items)
        conversation = (response.get("conversation") or {}).get("id")
        with db:
            db.execute("BEGIN IMMEDIATE")
            if response["store"] and len(blob) + len(given) > self.max_one:  # (its output made it so)
                self._too_large(response["id"], "not stored")
            elif response["store"]:
                db.execute("INSERT INTO responses VALUES (?, ?, ?, ?, ?, ?, ?)",
                           (response["id"], response.get("previous_response_id"), owner, time.time(),
                            len(blob) + len(given), blob, given))
            if conversation is not None:
                self._append_in(db, conversation, owner, [*input_items, *_replayed(response["output"])])
                db.execute("DELETE FROM locks WHERE conversation = ? AND holder = ?", (conversation, holder))
            self._evict(db, (response["id"], conversation))

    def _create(self, conversation: dict, items: list[dict], owner: str) -> None:
        db, metadata = self._conn(), orjson.dumps(conversation["metadata"])
        with db:
            db.execute("BEGIN IMMEDIATE")
            db.execute("INSERT INTO conversations VALUES (?, ?, ?, ?, ?, ?)",
                       (conversation["id"], owner, time.time(), len(metadata), conversation["created_at"], metadata))
            self._append_in(db, conversation["id"], owner, items)
            self._evict(db, (conversation["id"],))

    def _append(self, conversation_id: str, owner: str, items: list[dict]) -> bool:
        db = self._conn()
        with db:
            db.execute("BEGIN IMMEDIATE")
            if not self._append_in(db, conversation_id, owner, items, clash=DuplicateItem):
                return False
            self._evict(db, (conversation_id,))
        return True

    def _append_in(self, db: sqlite3.Connection, conversation_id: str, owner: str, items: list[dict],
                   clash: type[Exception] | None = None) -> bool:
        """``items`` after the conversation's, its oldest dropped while it takes more than ``max_one`` (and the
        results of the calls dropped: none is left without its call). An item whose id it holds already raises
        ``clash``, or gets a new id where ``clash`` is None (a turn that came in while another added that id)."""
        found = db.execute("SELECT size FROM conversations WHERE id = ? AND owner = ?",
                           (conversation_id, owner)).fetchone()
        if found is None:  # (deleted, or evicted, since the call began: its items go nowhere)
            return False
        ids = [item["id"] for item in items]
        held = {r[0] for r in db.execute(f"SELECT id FROM items WHERE conversation = ? AND id IN "
                                         f"({', '.join('?' * len(ids))})", (conversation_id, *ids))}
        if held and clash is not None:
            raise clash(next(i for i in ids if i in held))
        items = [{**item, "id": f"{item['id']}_{os.urandom(4).hex()}"} if item["id"] in held else item
                 for item in items]
        last = db.execute("SELECT MAX(seq) FROM items WHERE conversation = ?", (conversation_id,)).fetchone()[0]
        rows = [(conversation_id, (last or 0) + 1 + k, item["id"], item.get("type"), item.get("call_id"),
                 orjson.dumps(item)) for k, item in enumerate(items)]
        db.executemany("INSERT INTO items VALUES (?, ?, ?, ?, ?, ?)", rows)
        size = found[0] + sum(len(r[5]) for r in rows)
        if size > self.max_one:
            dropped, calls = [], []
            for seq, n, kind, call_id in db.execute("SELECT seq, LENGTH(item), kind, call_id FROM items WHERE "
                                                    "conversation = ? ORDER BY seq", (conversation_id,)):
                if size <= self.max_one:
                    break
                dropped.append((conversation_id, seq))
                calls += [(conversation_id, call_id)] if kind == "function_call" else []
                size -= n
            db.executemany("DELETE FROM items WHERE conversation = ? AND seq = ?", dropped)
            for call in calls:  # (their results, wherever they stand)
                size -= sum(r[0] for r in db.execute(
                    "SELECT LENGTH(item) FROM items WHERE conversation = ? AND kind = 'function_call_output' AND "
                    "call_id = ?", call))
                db.execute("DELETE FROM items WHERE conversation = ? AND kind = 'function_call_output' AND call_id = ?",
                           call)
        db.execute("UPDATE conversations SET size = ?, used = ? WHERE id = ?", (size, time.time(), conversation_id))
        return True

    def _evict(self, db: sqlite3.Connection, keep: tuple[str | None, ...]) -> None:
        """While the store holds more than ``max_bytes``: of the key that holds the most, its least recently used
        Response or conversation deleted (never one of ``keep``, those just written). A background Response that
        runs (its frontend said so lately) is neither counted nor evicted: a key's runs evict nobody's things."""
        live = time.time() - STALE  # (a background Response running: its frontend said so since)
        running = dict(db.execute("SELECT owner, SUM(size) FROM responses WHERE id IN (SELECT id FROM background WHERE "
                                  "alive >= ?) GROUP BY owner", (live,)).fetchall())
        held = {owner: size - running.get(owner, 0) for owner, size in db.execute(
            "SELECT owner, size FROM owners WHERE size > 0").fetchall()}
        excess = sum(held.values()) - self.max_bytes
        kept = [k for k in keep if k is not None]
        spared = f"AND id NOT IN ({', '.join('?' * len(kept))})"
        lru: dict[str, list] = {}  # a key's next things to go, the least recently used last (popped)
        while excess > 0 and held:
            owner = max(held, key=held.__getitem__)
            if not lru.get(owner):  # (64 of each table at a time: most writes evict one thing, or none)
                lru[owner] = sorted([(used, "responses", i, n) for i, n, used in db.execute(
                    f"SELECT id, size, used FROM responses WHERE owner = ? {spared} AND id NOT IN (SELECT id FROM "
                    "background WHERE alive >= ?) ORDER BY used LIMIT 64", (owner, *kept, live))] + [
                    (used, "conversations", i, n) for i, n, used in db.execute(
                        f"SELECT id, size, used FROM conversations WHERE owner = ? {spared} ORDER BY used LIMIT 64",
                        (owner, *kept))], reverse=True)
                if not lru[owner]:  # (all it holds is what was just written)
                    del held[owner]
                    continue
            _, table, victim, n = lru[owner].pop()
            db.execute(f"DELETE FROM {table} WHERE id = ?", (victim,))
            held[owner] -= n
            excess -= n

    def _read(self, sql: str, *args) -> tuple | None:
        return self._conn().execute(sql, args).fetchone()

    def _response(self, response_id: str, owner: str) -> dict | None:
        """The Response as it stands: one running whose frontend has not said so for ``STALE`` seconds is
        ``failed`` first (a frontend that died, or a server stopped, while it ran)."""
        db = self._conn()
        row = db.execute("SELECT response FROM responses WHERE id = ? AND owner = ?", (response_id, owner)).fetchone()
        response = orjson.loads(row[0]) if row is not None else None
        if response is None or response.get("status") not in RUNNING or self._alive(db, response_id):
            return response
        with db:  # (looked at again under the write lock: it may have ended meanwhile)
            db.execute("BEGIN IMMEDIATE")
            row = db.execute("SELECT response FROM responses WHERE id = ?", (response_id,)).fetchone()
            response = orjson.loads(row[0]) if row is not None else None
            if response is not None and response.get("status") in RUNNING and not self._alive(db, response_id):
                db.execute("DELETE FROM background WHERE id = ?", (response_id,))
                response = _failed(response, "the server stopped running it before it ended")
                self._set(db, response_id, response)
                self._evict(db, (response_id,))  # (counted again)
        return response

    @staticmethod
    def _alive(db: sqlite3.Connection, response_id: str) -> bool:
        row = db.execute("SELECT alive FROM background WHERE id = ?", (response_id,)).fetchone()
        return row is not None and row[0] >= time.time() - STALE

    @staticmethod
    def _set(db: sqlite3.Connection, response_id: str, response: dict) -> None:
        """(In a write) the stored Response replaced by ``response``, its size with it."""
        blob = orjson.dumps(response)
        db.execute("UPDATE responses SET size = size + ? - LENGTH(response), response = ? WHERE id = ?",
                   (len(blob), blob, response_id))

    def _start(self, response: dict, input_items: list[dict], owner: str, runner: str,
               events: list[tuple[int, bytes]] | None, holder: str | None = None) -> bool:
        db, blob, given = self._conn(), orjson.dumps(response), orjson.dumps(input_items)
        if len(blob) + len(given) > self.max_one:
            return False
        with db:
            db.execute("BEGIN IMMEDIATE")
            running = self._running(db, owner)
            if running + len(blob) + len(given) > self.max_running:
                raise RunsFull(running)
            now = time.time()
            db.execute("INSERT INTO responses VALUES (?, ?, ?, ?, ?, ?, ?)",
                       (response["id"], response.get("previous_response_id"), owner, now, len(blob) + len(given),
                        blob, given))
            db.execute("INSERT INTO background VALUES (?, ?, ?, ?, ?)",
                       (response["id"], runner, now, int(events is not None), holder))
            if events:
                self._add_events(db, response["id"], events)
            self._evict(db, (response["id"],))
        return True

    def _progress(self, response_id: str, runner: str, events: list[tuple[int, bytes]],
                  response: dict | None) -> tuple[bool, bool]:
        with self._conn() as db:
            db.execute("BEGIN IMMEDIATE")
            row = db.execute("SELECT events, owner FROM background JOIN responses USING (id) WHERE id = ? AND "
                             "runner = ?", (response_id, runner)).fetchone()
            if row is None:
                return False, False
            if response is not None:
                self._set(db, response_id, response)
            if row[0] and events:
                self._add_events(db, response_id, events)
                if self._size(db, response_id) > self.max_one or self._running(db, row[1]) > self.max_running:
                    log.warning("response %s: its events are no longer kept, they take more than one Response may (a "
                                "sixteenth of --responses-store-mib), or its key's runs more than they may together "
                                "(a quarter)", response_id)
                    self._drop_events(db, response_id)
                    db.execute("UPDATE background SET events = 0 WHERE id = ?", (response_id,))
                    return True, False
        return True, bool(row[0])

    @staticmethod
    def _running(db: sqlite3.Connection, owner: str) -> int:
        """What ``owner``'s background Responses that run (their frontend said so lately) take."""
        return db.execute("SELECT COALESCE(SUM(size), 0) FROM responses WHERE owner = ? AND id IN (SELECT id FROM "
                          "background WHERE alive >= ?)", (owner, time.time() - STALE)).fetchone()[0]

    @staticmethod
    def _size(db: sqlite3.Connection, response_id: str) -> int:
        return db.execute("SELECT size FROM responses WHERE id = ?", (response_id,)).fetchone()[0]

    def _too_large(self, response_id: str, what: str) -> None:
        log.warning("response %s: %s, it takes more than the %d bytes one Response may (a sixteenth of "
                    "--responses-store-mib)", response_id, what, self.max_one)

    @staticmethod
    def _add_events(db: sqlite3.Connection, response_id: str, events: list[tuple[int, bytes]]) -> None:
        db.executemany("INSERT INTO events VALUES (?, ?, ?)", [(response_id, k, e) for k, e in events])
        db.execute("UPDATE responses SET size = size + ? WHERE id = ?", (sum(len(e) for _, e in events), response_id))

    @staticmethod
    def _drop_events(db: sqlite3.Connection, response_id: str) -> None:
        n = db.execute("SELECT COALESCE(SUM(LENGTH(event)), 0) FROM events WHERE response = ?", (response_id,))
        db.execute("UPDATE responses SET size = size - ? WHERE id = ?", (n.fetchone()[0], response_id))
        db.execute("DELETE FROM events WHERE response = ?", (response_id,))

    def _finish(self, response: dict, input_items: list[dict], owner: str, events: list[tuple[int, bytes]],
                holder: str | None = None) -> bool:
        db, response_id = self._conn(), response["id"]
        conversation = (response.get("conversation") or {}).get("id")
        with db:
            db.execute("BEGIN IMMEDIATE")
            kept = db.execute("SELECT events FROM background WHERE id = ?", (response_id,)).fetchone()
            if kept is None:
                return False
            db.execute("DELETE FROM background WHERE id = ?", (response_id,))
            if kept[0] and events:
                self._add_events(db, response_id, events)
            self._set(db, response_id, response)
            if self._size(db, response_id) > self.max_one:
                self._too_large(response_id, "its events are not kept")
                self._drop_events(db, response_id)
                if self._size(db, response_id) > self.max_one:
                    self._too_large(response_id, "its output is not kept")
                    self._set(db, response_id, _failed({**response, "output": []}, "its output took more than the "
                                                       "store keeps of one response"))
            if conversation is not None:
                self._append_in(db, conversation, owner, [*input_items, *_replayed(response["output"])])
                db.execute("DELETE FROM locks WHERE conversation = ? AND holder = ?", (conversation, holder))
            db.execute("UPDATE responses SET used = ? WHERE id = ?", (time.time(), response_id))
            self._evict(db, (response_id, conversation))
        return True

    def _cancel(self, response_id: str, owner: str) -> dict | None:
        response = self._response(response_id, owner)
        if response is None or response.get("status") not in RUNNING:
            if response is not None and not response.get("background"):
                raise NotBackground(response_id)
            return response
        with self._conn() as db:
            db.execute("BEGIN IMMEDIATE")
            if db.execute("DELETE FROM background WHERE id = ?", (response_id,)).rowcount:
                self._set(db, response_id, {**response, "status": "cancelled"})
                self._evict(db, (response_id,))  # (counted again)
        return self._response(response_id, owner)  # (cancelled, or as it ended meanwhile)

    def _heartbeat(self, runner: str, running: list[str]) -> set[str]:
        """(Those of ``running`` alone: one it no longer runs, whatever befell it, goes stale.)"""
        marks = ", ".join("?" * len(running))
        with self._conn() as db:
            db.execute("BEGIN IMMEDIATE")
            db.execute(f"UPDATE background SET alive = ? WHERE runner = ? AND id IN ({marks})",
                       (time.time(), runner, *running))
            return {r[0] for r in db.execute(f"SELECT id FROM background WHERE runner = ? AND id IN ({marks})",
                                             (runner, *running))}

    def _fail(self, response_id: str, runner: str, why: str) -> None:
        with self._conn() as db:
            db.execute("BEGIN IMMEDIATE")
            row = db.execute("SELECT response FROM responses WHERE id = ? AND id IN (SELECT id FROM background WHERE "
                             "runner = ?)", (response_id, runner)).fetchone()
            if row is not None:
                db.execute("DELETE FROM background WHERE id = ?", (response_id,))
                self._set(db, response_id, _failed(orjson.loads(row[0]), why))
                self._evict(db, (response_id,))  # (counted again)

    def _abandon(self, runner: str) -> None:
        with self._conn() as db:
            db.execute("BEGIN IMMEDIATE")
            for response_id, blob in db.execute("SELECT id, response FROM responses WHERE id IN (SELECT id FROM "
                                                "background WHERE runner = ?)", (runner,)).fetchall():
                self._set(db, response_id, _failed(orjson.loads(blob), "the server stopped before it ended"))
            db.execute("DELETE FROM background WHERE runner = ?", (runner,))
            self._evict(db, ())  # (counted again)

    def _events(self, response_id: str, owner: str, after: int, limit: int) -> tuple[
            list[tuple[int, bytes]], dict, bool] | None:
        response = self._response(response_id, owner)
        if response is None:
            return None
        db = self._conn()
        kept = db.execute("SELECT events FROM background WHERE id = ?", (response_id,)).fetchone()
        rows = db.execute("SELECT seq, event FROM events WHERE response = ? AND seq > ? ORDER BY seq LIMIT ?",
                          (response_id, after, limit)).fetchall()
        if kept is None:  # (ended: its events are kept where it has any)
            kept = (rows or db.execute("SELECT 1 FROM events WHERE response = ? LIMIT 1", (response_id,)).fetchone(),)
        return rows, response, bool(kept[0])

    def _delete(self, table: str, thing_id: str, owner: str) -> bool:
        with self._conn() as db:
            db.execute("BEGIN IMMEDIATE")
            return db.execute(f"DELETE FROM {table} WHERE id = ? AND owner = ?", (thing_id, owner)).rowcount > 0

    def _history(self, response_id: str, owner: str) -> tuple[list[dict], str] | None:
        """(Read first, then marked used in a write of its own: a read takes no lock.)"""
        db, rows = self._conn(), []
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
            rows.append((at, *row[1:]))
            at = row[0]
        items: list[dict] = []
        for k, (_, response, given) in enumerate(reversed(rows)):
            response = orjson.loads(response)
            if k == len(rows) - 1 and response.get("status") in RUNNING:  # (a background Response: it may have ended)
                response = self._response(response_id, owner) or response
                if response.get("status") in RUNNING:
                    raise StillRunning(response_id)
            if response.get("conversation") is not None:  # (its turn is one of that conversation's, not a chain's)
                raise BrokenChain(f"the response {response['id']!r} went on with the conversation "
                                  f"{response['conversation']['id']!r}: continue that conversation instead")
            items += orjson.loads(given)
            items += _replayed(response["output"])
        with db:
            db.execute("BEGIN IMMEDIATE")
            now = time.time()
            db.executemany("UPDATE responses SET used = ? WHERE id = ?", [(now, r[0]) for r in rows])
        return items, rows[-1][0]

    def _header(self, conversation_id: str, owner: str) -> dict | None:
        row = self._conn().execute("SELECT created_at, metadata FROM conversations WHERE id = ? AND owner = ?",
                                   (conversation_id, owner)).fetchone()
        return {"id": conversation_id, "object": "conversation", "created_at": row[0],
                "metadata": orjson.loads(row[1])} if row is not None else None

    def _update(self, conversation_id: str, owner: str, metadata: dict) -> dict | None:
        blob = orjson.dumps(metadata)
        with self._conn() as db:
            db.execute("BEGIN IMMEDIATE")
            old = db.execute("SELECT metadata FROM conversations WHERE id = ? AND owner = ?",
                             (conversation_id, owner)).fetchone()
            if old is None:
                return None
            db.execute("UPDATE conversations SET metadata = ?, size = size + ? WHERE id = ?",
                       (blob, len(blob) - len(old[0]), conversation_id))
        return self._header(conversation_id, owner)

    def _touch(self, conversation_id: str, owner: str, holder: str | None = None) -> bool:
        """Mark a conversation used (False: ``owner`` has none of that id), and take its lock for ``holder``."""
        with self._conn() as db:
            db.execute("BEGIN IMMEDIATE")
            now = time.time()
            if not db.execute("UPDATE conversations SET used = ? WHERE id = ? AND owner = ?",
                              (now, conversation_id, owner)).rowcount:
                return False
            if holder is not None:
                lock = db.execute("SELECT holder, until FROM locks WHERE conversation = ?", (conversation_id,)).fetchone()
                if lock is not None and lock[0] != holder and lock[1] >= now:
                    raise Locked(conversation_id)
                db.execute("INSERT OR REPLACE INTO locks VALUES (?, ?, ?)", (conversation_id, holder, now + LEASE))
            return True

    def _release(self, conversation_id: str, holder: str) -> None:
        with self._conn() as db:
            db.execute("BEGIN IMMEDIATE")
            db.execute("DELETE FROM locks WHERE conversation = ? AND holder = ?", (conversation_id, holder))

    def _renew(self, holders: list[str]) -> None:
        with self._conn() as db:
            db.execute("BEGIN IMMEDIATE")
            db.execute(f"UPDATE locks SET until = ? WHERE holder IN ({', '.join('?' * len(holders))})",
                       (time.time() + LEASE, *holders))

    def _items(self, conversation_id: str, owner: str, holder: str | None = None) -> list[dict] | None:
        if not self._touch(conversation_id, owner, holder):
            return None
        rows = self._conn().execute("SELECT item FROM items WHERE conversation = ? ORDER BY seq",
                                    (conversation_id,)).fetchall()
        return [orjson.loads(r[0]) for r in rows]

    def _page(self, conversation_id: str, owner: str, limit: int, descending: bool,
              after: str | None) -> tuple[list[dict], bool] | None:
        if self._header(conversation_id, owner) is None:
            return None
        db, order, beyond = self._conn(), "DESC" if descending else "ASC", "<" if descending else ">"
        start = ""
        if after is not None:
            seq = db.execute("SELECT seq FROM items WHERE conversation = ? AND id = ? ORDER BY seq LIMIT 1",
                             (conversation_id, after)).fetchone()
            if seq is None:
                raise KeyError(after)
            start = f"AND seq {beyond} {int(seq[0])}"
        rows = db.execute(f"SELECT item FROM items WHERE conversation = ? {start} ORDER BY seq {order} LIMIT ?",
                          (conversation_id, limit + 1)).fetchall()
        return [orjson.loads(r[0]) for r in rows[:limit]], len(rows) > limit

    def _item(self, conversation_id: str, owner: str, item_id: str) -> dict | None:
        if self._header(conversation_id, owner) is None:
            return None
        row = self._conn().execute("SELECT item FROM items WHERE conversation = ? AND id = ? ORDER BY seq LIMIT 1",
                                   (conversation_id, item_id)).fetchone()
        if row is None:
            raise KeyError(item_id)
        return orjson.loads(row[0])

    def _delete_item(self, conversation_id: str, owner: str, item_id: str) -> dict | None:
        with self._conn() as db:
            db.execute("BEGIN IMMEDIATE")
            if db.execute("SELECT 1 FROM conversations WHERE id = ? AND owner = ?",
                          (conversation_id, owner)).fetchone() is None:
                return None
            row = db.execute("SELECT seq, LENGTH(item) FROM items WHERE conversation = ? AND id = ? ORDER BY seq "
                             "LIMIT 1", (conversation_id, item_id)).fetchone()
            if row is None:
                raise KeyError(item_id)
            db.execute("DELETE FROM items WHERE conversation = ? AND seq = ?", (conversation_id, row[0]))
            db.execute("UPDATE conversations SET size = size - ? WHERE id = ?", (row[1], conversation_id))
        return self._header(conversation_id, owner)

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
    db = sqlite3.connect(path, timeout=BUSY, isolation_level=None)
    try:
        _wal(db)
        db.execute(f"PRAGMA synchronous={'NORMAL' if durable else 'OFF'}")
        db.executescript(_SCHEMA)
        with db:  # (a file whose background table came before its column did: the frontends of a server, in turn)
            db.execute("BEGIN IMMEDIATE")
            if "holds" not in {r[1] for r in db.execute("PRAGMA table_info(background)")}:
                db.execute("ALTER TABLE background ADD COLUMN holds TEXT")
    except BaseException:
        db.close()
        raise
    return db


def _holder(holds: Hold | None) -> str | None:
    return None if holds is None else holds.holder


def _wal(db: sqlite3.Connection) -> None:
    """WAL journal mode (readers never wait for the writer; frontends write in turns). Its switch does not wait
    as other statements do (SQLite answers "database is locked" at once while another connection opens the
    file: a server's frontends starting together, one failed in 1 of 10 starts of three), so it is tried again
    for as long as a write would wait (``BUSY``)."""
    deadline = time.monotonic() + BUSY
    while True:
        try:
            db.execute("PRAGMA journal_mode=WAL")
            return
        except sqlite3.OperationalError as e:
            if "locked" not in str(e) or time.monotonic() > deadline:
                raise
            time.sleep(0.01)


def _failed(response: dict, why: str) -> dict:
    return {**response, "status": "failed", "error": {"code": "server_error", "message": why}}


def _replayed(output: list[dict]) -> list[dict]:
    """A Response's output as the next turn reads it: a call cut short left out (its arguments may be no JSON,
    and no client ran it)."""
    return [o for o in output if not (o.get("type") == "function_call" and o.get("status") == "incomplete")]
