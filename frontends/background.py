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
from frontends.response_store import ResponseStore
from frontends.responses import ResponsesFormat

log = logging.getLogger("tokenmill.frontend")

WATCH = 1.0  # seconds between a frontend's looks at its runs (cancelled elsewhere?) and its word that it runs them
FLUSH = 0.05  # seconds at least between two writes of a run's events
POLL = 0.05  # seconds between a reader's looks for more events


class Run:
    __slots__ = ("gen", "fmt", "head", "keep", "task", "listeners")

    def __init__(self, gen: Generation, fmt: ResponsesFormat, head: dict, keep) -> None:
        self.gen, self.fmt, self.head, self.keep = gen, fmt, head, keep  # (keep: its input items, whose it is)
        self.task: asyncio.Task | None = None
        self.listeners: set[asyncio.Queue] = set()  # the creating call's stream, while it reads


class BackgroundRuns:
    """The background Responses this frontend runs."""

    def __init__(self, store: ResponseStore) -> None:
        self.store = store
        self.runner = f"{socket.gethostname()}-{os.getpid()}-{os.urandom(4).hex()}"  # (this process: not a restarted one)
        self.runs: dict[str, Run] = {}
        self._watcher: asyncio.Task | None = None

    async def start(self, gen: Generation, fmt: ResponsesFormat, stream: bool) -> Response | StreamingResponse:
        """Keep ``gen``'s Response as it begins and run it on: the Response, ``queued``, or (``stream``) a stream of
        its events for as long as the caller reads it."""
        run = Run(gen, fmt, {**fmt.base, "status": "queued", "output": [], "usage": None}, fmt.keep)
        fmt.keep = None  # (kept here, over its running state)
        if stream:
            fmt.log = []
        await self.store.start(run.head, run.keep.items, run.keep.owner, self.runner, stream)
        gen.start()
        self.runs[run.head["id"]] = run
        run.task = asyncio.create_task(self._run(run))
        if self._watcher is None or self._watcher.done():
            self._watcher = asyncio.create_task(self._watch())
        if not stream:
            return Response(200, orjson.dumps(run.head))
        queue: asyncio.Queue = asyncio.Queue()
        run.listeners.add(queue)
        return StreamingResponse(_listen(queue), on_close=lambda: run.listeners.discard(queue))

    def stop(self, response_id: str) -> None:
        """Abort a run of this frontend's (cancelled or deleted: its state in the store says so already)."""
        run = self.runs.get(response_id)
        if run is not None and run.task is not None:
            run.task.cancel()

    async def close(self) -> None:
        """The frontend stops: its runs are aborted and count as failed."""
        tasks = [t for t in (self._watcher, *(r.task for r in self.runs.values())) if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        with contextlib.suppress(ApiError):
            await self.store.abandon(self.runner)

    async def _run(self, run: Run) -> None:
        """Run ``run`` to its end, writing its progress as it goes (``_flush``); the chunk that ends it is told
        once the store has the Response whole (a client that continues it at once finds it)."""
        gen, fmt, response_id = run.gen, run.fmt, run.head["id"]
        flushing: asyncio.Task | None = None
        try:
            last = fmt.stream_head() if fmt.log is not None else b""
            while not gen.done:
                self._tell(run, last)
                try:
                    updates = await gen.next_updates()
                except ApiError as e:
                    last = fmt.stream_error(e)
                    break
                if fmt.log is not None:
                    last = fmt.chunk(updates)
                else:
                    last = b""
                    fmt.collect(updates)
                if (run.head["status"] == "queued" or fmt.log) and (flushing is None or flushing.done()) \
                        and not gen.done:  # (while one is under way, what comes goes with the next)
                    if flushing is not None and not flushing.result():
                        return  # (no longer this frontend's to run)
                    flushing = asyncio.create_task(self._flush(run))
            if flushing is not None and not await flushing:
                return
            events, fmt.log = fmt.log or [], None
            with contextlib.suppress(ApiError):  # (the store failed: it counts as failed once it is stale)
                if not await self.store.finish(fmt.final(), run.keep.items, run.keep.owner, events):
                    return
            self._tell(run, last)
        except asyncio.CancelledError:
            if flushing is not None:
                flushing.cancel()
            raise
        except Exception:
            log.exception("background response %s failed", response_id)
        finally:
            gen.abort_unfinished()
            for queue in run.listeners:
                queue.put_nowait(None)
            self.runs.pop(response_id, None)

    async def _flush(self, run: Run) -> bool:
        """Write what the run made since the last write (its events, and its status once it has begun), then again
        while more comes, at most every ``FLUSH`` seconds. False: it is no longer this frontend's to run."""
        while True:
            fmt, started = run.fmt, time.monotonic()
            events = fmt.log or []
            if fmt.log:
                fmt.log = []
            began = run.head["status"] == "queued"
            if not events and not began:
                return True
            if began:
                run.head = {**run.head, "status": "in_progress"}
            try:
                if not await self.store.progress(run.head["id"], self.runner, events, run.head if began else None):
                    return False
            except ApiError as e:
                log.warning("background response %s: its progress not kept: %s", run.head["id"], e.message)
            await asyncio.sleep(max(0.0, FLUSH - (time.monotonic() - started)))

    @staticmethod
    def _tell(run: Run, chunk: bytes | None) -> None:
        if chunk != b"":
            for queue in run.listeners:
                queue.put_nowait(chunk)

    async def _watch(self) -> None:
        """While this frontend runs any: every ``WATCH`` seconds, say so, and stop those no longer its to run."""
        while self.runs:
            await asyncio.sleep(WATCH)
            try:
                ours = await self.store.heartbeat(self.runner)
            except ApiError as e:
                log.warning("background responses: the store failed: %s", e.message)
                continue
            for response_id in [r for r in self.runs if r not in ours]:
                self.stop(response_id)

    def resume(self, response_id: str, owner: str, after: int) -> StreamingResponse:
        """A stored background Response's events past ``after``, as they come, until it has ended."""
        return StreamingResponse(self._tail(response_id, owner, after))

    async def _tail(self, response_id: str, owner: str, after: int) -> AsyncIterator[bytes]:
        while True:
            found = await self.store.events(response_id, owner, after)
            if found is None:  # (deleted meanwhile)
                return
            events, ended, kept = found
            if not kept:
                yield (b"event: error\ndata: " + orjson.dumps({
                    "type": "error", "code": "events_not_kept", "sequence_number": after + 1,
                    "message": "this response's events are no longer kept (they took more than the store keeps of "
                               "one response): retrieve it whole"}) + b"\n\n")
                return
            if events:
                after = events[-1][0]
                yield b"".join(e for _, e in events)
            elif ended:
                return
            else:
                await asyncio.sleep(POLL)


async def _listen(queue: asyncio.Queue) -> AsyncIterator[bytes]:
    while (chunk := await queue.get()) is not None:
        yield chunk
