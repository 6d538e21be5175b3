"""Background Responses (OpenAI's ``background: true``): a Response answered at once, ``queued``, and run on
by the frontend that took it whether or not anyone is connected; polled with ``GET /v1/responses/{id}``,
cancelled with ``POST /v1/responses/{id}/cancel``, and, where it was created streamed, its events read again
from any frontend with ``GET /v1/responses/{id}?stream=true&starting_after=N``.

Its state is the store's (``frontends.response_store``), shared by the frontends: the running Response as it
began, its events (written in batches as the run makes them), and which frontend runs it. That frontend says so
every ``WATCH`` seconds; a run whose frontend stops saying so for ``STALE`` seconds is counted as failed (a
frontend that died). A cancel or delete, on any frontend, takes the run out of the store; the frontend running it
sees that at its next look and aborts it in the engine (at once where the cancel came to it).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import time
from collections.abc import AsyncIterator

import orjson

from frontends.errors import ApiError
from frontends.generation import Generation
from frontends.http import Response, StreamingResponse
from frontends.response_store import RUNNING, Hold, Keep, ResponseStore, RunsFull
from frontends.responses import ResponsesFormat, sequenced_event
from frontends.stored_api import too_large

log = logging.getLogger("tokenmill.frontend")

WATCH = 1.0  # seconds between a frontend's looks at its runs (cancelled elsewhere?) and its word that it runs them
FLUSH = 0.05  # seconds at least between two writes of a run's events
POLL = 0.05, 0.5  # seconds between a reader's looks for more events: at first, and at most (it waits longer and
# longer while none comes: a thousand readers idle are no thousand looks every 50 ms)


class Run:
    __slots__ = ("gen", "fmt", "head", "keep", "task", "listeners", "ended", "begun", "keeping")

    def __init__(self, gen: Generation, fmt: ResponsesFormat, keep: Keep) -> None:
        self.gen, self.fmt, self.keep = gen, fmt, keep  # (keep: its input items, whose it is)
        self.head = fmt.head("queued")  # (as the store has it)
        self.task: asyncio.Task | None = None
        self.listeners: set[asyncio.Queue] = set()  # the creating call's stream, while it reads
        self.ended = False  # its last update is in: what is left is for ``finish`` alone
        self.begun = False  # it has begun (in_progress), which the store is yet to be told
        self.keeping = fmt.log is not None  # its events are kept (streamed, and not past what one may take)


class BackgroundRuns:
    """The background Responses this frontend runs, and the conversation locks its turns hold (OpenAI's
    ``conversation_locked``: one turn on a conversation at a time), both kept up to date in the store by one
    watcher."""

    def __init__(self, store: ResponseStore) -> None:
        self.store = store
        self.runner = f"{socket.gethostname()}-{os.getpid()}-{os.urandom(4).hex()}"  # (this process: not a restarted one)
        self.runs: dict[str, Run] = {}
        self.holds: dict[str, Hold] = {}  # the conversation locks this frontend's turns hold (renewed here too)
        self._watcher: asyncio.Task | None = None
        self._closed = False

    def hold(self, conversation: str) -> Hold:
        """A turn's lock on ``conversation`` (taken with its items: ``ResponseStore.items``), renewed while the
        turn holds it."""
        holds = Hold(self.store, conversation, self.holds)
        self._watching()
        return holds

    def _watching(self) -> None:
        if self._watcher is None or self._watcher.done():
            self._watcher = asyncio.create_task(self._watch())

    async def start(self, gen: Generation, fmt: ResponsesFormat, keep: Keep,
                    stream: bool) -> Response | StreamingResponse:
        """Keep ``gen``'s Response as it begins and run it on: the Response, ``queued``, or (``stream``) a stream of
        its events for as long as the caller reads it."""
        if self._closed:
            await keep.released()
            raise ApiError(503, "The server is stopping: no background response starts")
        if stream:
            fmt.log = []  # (its events, to be kept: its first two, kept as it begins)
        run = Run(gen, fmt, keep)
        queue: asyncio.Queue = asyncio.Queue()
        if stream:
            run.listeners.add(queue)
            queue.put_nowait(fmt.stream_head(queued=True))
        begun = asyncio.ensure_future(self._begin(run))
        begun.add_done_callback(lambda f: f.cancelled() or f.exception())  # (read, where nobody waits any more)
        await asyncio.shield(begun)  # (a caller that goes away meanwhile stops it neither half-begun nor at all)
        if not stream:
            return Response(200, orjson.dumps(run.head))
        return StreamingResponse(_listen(queue), on_close=lambda: run.listeners.discard(queue))

    async def _begin(self, run: Run) -> None:
        """Keep the run as it begins, then start it in the engine and run it on (or let go of its conversation, where
        it cannot)."""
        try:
            await self._begun(run)
        except BaseException as e:
            if isinstance(e, ApiError):  # (refused: answered with its conversation free again)
                await run.keep.released()
            run.keep.release()
            raise

    async def _begun(self, run: Run) -> None:
        response_id, stream = run.head["id"], run.fmt.log is not None
        head_events, run.fmt.log = run.fmt.log, [] if stream else None
        try:
            if not await self.store.start(run.head, run.keep.items, run.keep.owner, self.runner, head_events,
                                          run.keep.holds):
                raise too_large(self.store, "input")
        except RunsFull as e:
            raise ApiError(429, f"This key's background responses that run take {e.args[0]} bytes of the response "
                           f"store, and may take {self.store.max_running} together (a quarter of "
                           "--responses-store-mib): retry once one has ended", headers=[("retry-after", "1")]) from None
        try:
            run.gen.start()
        except BaseException as e:  # (the engine cannot be reached): it has failed, not queued
            with contextlib.suppress(ApiError):
                await self.store.fail(response_id, self.runner, getattr(e, "message", None) or repr(e))
            raise
        self.runs[response_id] = run
        run.task = asyncio.create_task(self._run(run))
        self._watching()

    def stop(self, response_id: str) -> None:
        """Abort a run of this frontend's, cancelled or deleted (the store says so already), unless it has ended."""
        run = self.runs.get(response_id)
        if run is not None and run.task is not None and not run.ended:
            run.task.cancel()

    async def close(self) -> None:
        """The frontend stops: its runs are aborted and count as failed; none starts any more."""
        self._closed = True
        tasks = [t for t in (self._watcher, *(r.task for r in self.runs.values())) if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        with contextlib.suppress(ApiError):
            await self.store.abandon(self.runner)

    async def _run(self, run: Run) -> None:
        """Run ``run`` to its end, writing its progress as it goes (``_flush``). What ends it, its last events and
        the Response whole, the store gets in one write, and the caller's stream its last chunk after that: a client
        that reads it has ended, anywhere, finds it ended."""
        gen, fmt, response_id = run.gen, run.fmt, run.head["id"]
        streamed, flushing = fmt.log is not None, None
        try:
            last = b""  # (its head was told as it began)
            while not gen.done:
                self._tell(run, last)
                try:
                    updates = await gen.next_updates()
                except ApiError as e:
                    run.ended = True
                    last = fmt.stream_error(e)
                    break
                run.ended = gen.done  # (before its events are made: no flush takes them)
                last = b""
                if run.head["status"] == "queued":
                    run.head, run.begun = {**run.head, "status": "in_progress"}, True
                    last = fmt.begun() if streamed else b""
                if streamed:
                    last += fmt.chunk(updates)
                else:
                    fmt.collect(updates)
                if not run.ended and (run.begun or fmt.log) and (flushing is None or flushing.done()):
                    if flushing is not None and not flushing.result():
                        return  # (no longer this frontend's to run)
                    flushing = asyncio.create_task(self._flush(run))  # (while one runs, what comes waits for it)
            if flushing is not None and not await flushing:
                return
            events = fmt.log if run.keeping else []
            try:
                finished = await self.store.finish(fmt.final(), run.keep.items, run.keep.owner, events, run.keep.holds)
                if run.keep.holds is not None:  # (let go of with its items, or with its running state)
                    run.keep.holds.let_go()
                if not finished:
                    return  # (cancelled or deleted meanwhile)
            except ApiError as e:  # (the store failed: no frontend says it runs, it reads as failed once stale)
                log.warning("background response %s: not kept as it ended: %s", response_id, e.message)
                return
            self._tell(run, last)
        except asyncio.CancelledError:
            if flushing is not None:
                flushing.cancel()
            raise
        except Exception:
            log.exception("background response %s failed", response_id)
            with contextlib.suppress(ApiError):
                await self.store.fail(response_id, self.runner, "the server failed running it")
        finally:
            gen.abort_unfinished()
            run.keep.release()  # (its items added, or not to be)
            for queue in run.listeners:
                queue.put_nowait(None)
            self.runs.pop(response_id, None)

    async def _flush(self, run: Run) -> bool:
        """Write what the run made since the last write (that it has begun, its events), then again while more comes,
        at most every ``FLUSH`` seconds, until it has ended. False: it is no longer this frontend's to run. What the
        store failed to take is taken again by the next write."""
        fmt = run.fmt
        while not run.ended:
            started = time.monotonic()
            events, head = (fmt.log or []) if run.keeping else [], run.head if run.begun else None
            if fmt.log:
                fmt.log = []
            if not events and head is None:
                return True
            run.begun = False
            try:
                ours, run.keeping = await self.store.progress(run.head["id"], self.runner, events, head)
                if not ours:
                    return False
            except ApiError as e:
                log.warning("background response %s: its progress not kept yet: %s", run.head["id"], e.message)
                if events:
                    fmt.log[:0] = events
                run.begun = run.begun or head is not None
            await asyncio.sleep(max(0.0, FLUSH - (time.monotonic() - started)))
        return True

    @staticmethod
    def _tell(run: Run, chunk: bytes) -> None:
        if chunk:
            for queue in run.listeners:
                queue.put_nowait(chunk)

    async def _watch(self) -> None:
        """While this frontend runs any, or holds a conversation's lock: every ``WATCH`` seconds, say so (the runs it
        runs, the locks it holds), and stop the runs no longer its to run."""
        while self.runs or self.holds:
            await asyncio.sleep(WATCH)
            try:
                if self.holds:
                    await self.store.renew(list(self.holds))
                if self.runs:
                    ours = await self.store.heartbeat(self.runner, list(self.runs))
                    for response_id in [r for r in self.runs if r not in ours]:
                        self.stop(response_id)
            except ApiError as e:
                log.warning("background responses: the store failed: %s", e.message)

    def resume(self, response_id: str, owner: str, after: int) -> StreamingResponse:
        """A stored background Response's events past ``after``, as they come, until it has ended."""
        return StreamingResponse(self._tail(response_id, owner, after))

    async def _tail(self, response_id: str, owner: str, after: int) -> AsyncIterator[bytes]:
        """(One that ended without its last event, failed where it ran: that event made from it as it is stored.)"""
        last = b""  # the last event read (or the one at ``after``)
        if after >= 0:
            found = await self.store.events(response_id, owner, after - 1, limit=1)
            last = found[0][0][1] if found is not None and found[0] else b""
        wait = POLL[0]
        while True:
            found = await self.store.events(response_id, owner, after)
            if found is None:  # (deleted meanwhile)
                return
            events, response, kept = found
            if not kept:
                yield sequenced_event("error", after + 1, code="events_not_kept", message="this response's events "
                                      "are no longer kept (they took more than the store keeps of one response): "
                                      "retrieve it whole")
                return
            if events:
                after, last, wait = events[-1][0], events[-1][1], POLL[0]
                yield b"".join(e for _, e in events)
            elif response["status"] not in RUNNING:
                if response["status"] == "failed" and not last.startswith(b"event: response.failed\n"):
                    yield sequenced_event("response.failed", after + 1, response=response)
                return
            else:
                await asyncio.sleep(wait)
                wait = min(POLL[1], wait * 1.5)


async def _listen(queue: asyncio.Queue) -> AsyncIterator[bytes]:
    while (chunk := await queue.get()) is not None:
        yield chunk
