"""The frontend's side of the engine wire: one asyncio ZMQ DEALER per frontend process.

Owns the handshake (HELLO -> READY), sending ADD / ABORT / STATS, and one reader
task that hands each OUTPUTS' deltas to the per-request ``Stream`` they belong
to. A ``tcp://`` engine is reached with ZMQ CURVE keys derived from the shared
``engine_key`` (``protocol.curve_keys``). It also owns the engine's health: the connection dropping (a ZMQ socket
monitor sees it at once) or no message for ``liveness_timeout`` seconds while it
is pinged with STATS marks the engine unhealthy and fails every in-flight request
with a 503 ``Error``, so a client never hangs on a dead engine. Long before that, an
engine unanswered for ``stall_after`` is ``stalled``: a sixth of that timeout (10 s of
60; at least three pings), or ``STALL_STEPS`` times the longest it was quiet within the
timeout, if more (an engine answers between its steps: a long prompt's chunks, each up
to about three times the one before as its context grows, are not taken for a hang;
review W), nor, before four times what it said it may take (``Stats.step_s``: a first
long prompt after short ones, whose length nothing here can tell), a step the engine
said it begins, until it says anything else. ``/health`` says so and the router sends
new calls elsewhere, while its requests wait on. The answers to those pings, and the
STATS the engine sends unasked as its requests come and go, are kept (``last_stats``)
for ``/health`` to show without a round trip.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import logging
import time
from collections.abc import Callable

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from engine.protocol import (
    ENGINE_KEY_ENV,
    Abort,
    Add,
    Delta,
    Error,
    Hello,
    ImageInput,
    LoraUpdate,
    Outputs,
    PoolingParams,
    PrefixCacheReset,
    ProtocolError,
    Ready,
    SamplingParams,
    Stats,
    curve_keys,
    decode,
    encode,
    wants_ipv6,
)

log = logging.getLogger("tokenmill.engine_client")

_STATS_PING = encode(Stats())
STALL_PART = 6  # an engine unanswered for this part of the liveness timeout is stalled (``EngineClient.stalled``)
STALL_STEPS = 4  # ... or for this many times its longest step within it, if more


class EngineUnavailable(Exception):
    """The engine cannot take requests now (gone, unreachable or not answering)."""


class Stream:
    """Deltas and errors for one or more engine requests, in arrival order.

    ``next_batch()`` returns everything that arrived since the last call, so a
    consumer that fell behind catches up in one go (one SSE event per batch).
    ``step_before_first[request_id]``: when (``time.monotonic()``) the engine step
    before the one that brought the request's first delta ended, as far as this
    frontend saw (its metrics estimate queue time from it).
    """

    __slots__ = ("_items", "_waiter", "step_before_first", "engine", "affinity")

    def __init__(self) -> None:
        self._items: list[Delta | Error] = []
        self._waiter: asyncio.Future | None = None
        self.step_before_first: dict[str, float] = {}
        self.engine: int | None = None  # data parallel: the engine its requests went to (all to one)
        self.affinity = ""  # data parallel: its calls' key (OpenAI's prompt_cache_key): one engine while it can

    def push(self, item: Delta | Error) -> None:
        self._items.append(item)
        w = self._waiter
        if w is not None and not w.done():
            w.set_result(None)

    async def next_batch(self) -> list[Delta | Error]:
        while not self._items:
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        items, self._items = self._items, []
        return items


def _gone(request_id: str, message: str) -> Error:
    return Error(request_id, 503, "service_unavailable_error", message)


def _retrieved(fut: asyncio.Future) -> None:
    if not fut.cancelled():
        fut.exception()


def _terms(r: Ready) -> tuple:
    """What a frontend set itself up for at its start: the model, its tokenizer's ids, its context, its images."""
    return r.model, r.vocab_size, sorted(r.eos_token_ids), r.max_model_len, r.image_token_id, r.image_tokens, r.labels


def _unlike(first: Ready | None, ready: Ready, address: str) -> str | None:
    """Why an engine that came back (restarted, a remote one above all) with ``ready`` cannot be served by a frontend
    that started with ``first``, or None. (Its adapters, memory and queues may differ.)"""
    if first is None or _terms(first) == _terms(ready):
        return None
    return (f"the engine at {address} came back serving {ready.model!r} (vocabulary {ready.vocab_size}, context "
            f"{ready.max_model_len}), not {first.model!r} (vocabulary {first.vocab_size}, context "
            f"{first.max_model_len}) or otherwise unlike it as this frontend started: not served; restart it as it "
            "was, or restart the frontends")


class EngineClient:
    def __init__(self, address: str, frontend_id: str, *, handshake_timeout: float = 60.0,
                 liveness_interval: float | None = None, liveness_timeout: float = 60.0,
                 engine_key: str | None = None) -> None:
        self.address = address
        self._curve = curve_keys(engine_key) if engine_key else None
        if self._curve is None and address.startswith("tcp://"):
            raise ValueError(f"the engine at {address} needs the engine key (--engine-key or ${ENGINE_KEY_ENV})")
        self.frontend_id = frontend_id
        self.handshake_timeout = handshake_timeout
        # pings every 2 s, more often under a liveness timeout shorter than 16 s (each timeout sees 8 of them)
        self.liveness_interval = min(2.0, liveness_timeout / 8) if liveness_interval is None else liveness_interval
        self.liveness_timeout = liveness_timeout
        self._stall_floor = max(liveness_timeout / STALL_PART, 3 * self.liveness_interval)
        self._quiet_spells: collections.deque[tuple[float, float]] = collections.deque()  # (when it ended, seconds)
        # (time.monotonic()) when the engine said a step begins, and what it said it may take (``stall_after``)
        self._step_said_at, self._step_said_s = -1.0, 0.0
        self.ready: Ready | None = None
        self.healthy = False
        self.draining = False  # the engine is stopping: its requests run on, it takes no new ones (``accepting``)
        self._ctx = zmq.asyncio.Context()
        self._sock: zmq.asyncio.Socket | None = None
        self._monitor: zmq.asyncio.Socket | None = None  # the socket's connection events
        self._streams: dict[str, Stream] = {}
        self._stats_waiters: list[asyncio.Future] = []
        self._calls: dict[str, asyncio.Future] = {}  # call id -> the engine's answer (a LoRA update, a cache reset)
        self._num_calls = 0
        self.last_stats: Stats | None = None  # the engine's latest numbers (liveness pings keep them fresh)
        self.last_stats_at = 0.0  # time.monotonic() when they arrived
        self.in_flight_at_stats = 0  # our own requests in flight then (the rest of its load is others')
        self.on_stats: Callable[[Stats], None] | None = None  # called with every STATS (the metrics)
        self.on_unhealthy: Callable[[], None] | None = None  # called as it is marked unhealthy (the metrics)
        self.on_back: Callable[[], None] | None = None  # called when an engine that came back is served (the router)
        self._last_outputs_at = 0.0  # time.monotonic() of the latest OUTPUTS: the end of an engine step
        self._tasks: list[asyncio.Task] = []
        self._last_seen = 0.0
        self._connected = False
        self._unlike: str | None = None  # why the engine that came back is not served (``_unlike``)
        self._awaiting_ready = False  # reconnected: no READY yet (``_greet``)
        self._greeting: asyncio.Task | None = None

    # ------------------------------------------------------------------ lifecycle

    async def connect(self) -> Ready:
        """Connect and handshake; raises ``EngineUnavailable`` when no READY comes in time."""
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.IDENTITY, self.frontend_id.encode())
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.IMMEDIATE, 1)  # never queue for a peer that is not connected
        sock.setsockopt(zmq.IPV6, wants_ipv6(self.address))
        sock.setsockopt(zmq.SNDHWM, 0)
        sock.setsockopt(zmq.RCVHWM, 0)
        if self._curve is not None:
            sock.setsockopt(zmq.CURVE_SERVERKEY, self._curve.server_public)
            sock.setsockopt(zmq.CURVE_PUBLICKEY, self._curve.client_public)
            sock.setsockopt(zmq.CURVE_SECRETKEY, self._curve.client_secret)
        monitor = None
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.handshake_timeout
        hello = encode(Hello(self.frontend_id))
        ready = None
        try:
            monitor = sock.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
            sock.connect(self.address)
            self._sock = sock
            # the engine may still be binding: resend HELLO until it answers
            while ready is None:
                left = deadline - loop.time()
                if left <= 0:
                    why = " (is its engine key the same?)" if self._curve is not None else ""
                    raise EngineUnavailable(f"no READY from the engine at {self.address} "
                                            f"within {self.handshake_timeout:g}s{why}")
                try:
                    await sock.send(hello, zmq.NOBLOCK)
                except zmq.Again:
                    await asyncio.sleep(min(0.05, left))
                    continue
                if await sock.poll(min(1000, int(left * 1000) + 1), zmq.POLLIN):
                    msg = decode(await sock.recv())
                    if isinstance(msg, Ready):
                        ready = msg
                    elif isinstance(msg, Error):
                        raise EngineUnavailable(f"engine refused the handshake: {msg.message}")
        except BaseException:  # (open sockets would make term(), or a GC of the context, wait forever)
            for s in (sock, monitor):
                if s is not None:
                    s.close(0)
            raise
        self.ready = ready
        self.healthy = self._connected = True
        self._last_seen = time.monotonic()
        self._monitor = monitor
        self._tasks = [loop.create_task(self._read()), loop.create_task(self._watch(monitor)),
                       loop.create_task(self._liveness())]
        self._post(_STATS_PING)  # numbers for /health now, not at the first liveness tick
        return ready

    async def close(self) -> None:
        tasks = [*self._tasks, *([self._greeting] if self._greeting is not None else [])]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        # (here, not in the watcher's ``finally``: a task cancelled before its first step never runs it, and
        # term() waits for every socket)
        for sock in (self._sock, self._monitor):
            if sock is not None:
                sock.close(0)
        self._ctx.term()

    # ------------------------------------------------------------------ requests

    def add(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
            priority: int = 0, deadline: float | None = None, stream: Stream | None = None,
            cache_salt: str = "", pooling: PoolingParams | None = None, lora: str = "",
            images: list[ImageInput] | None = None, admitted: bool = False, client_id: str = "") -> Stream:
        """Send one request; its deltas (or an ``Error``) arrive on the returned stream.

        Several requests may share a ``stream`` (the n choices of one API call). ``cache_salt``: the
        request shares prefix-cache blocks only with requests of the same salt ("" for none).
        ``pooling``: an embedding request (its one delta carries the vector). ``lora``: the LoRA adapter it
        runs with (one of ``ready.loras``; "": the model alone). ``images``: its prompt's (``frontends.images``).
        ``admitted``: a later part of work the engine already took (``protocol.Add.admitted``). ``client_id``:
        who asked (``protocol.Add.client``).
        """
        if self.draining and not admitted:
            raise EngineUnavailable("the engine is shutting down")
        if stream is None:
            stream = Stream()
        self._streams[request_id] = stream
        try:
            self._send(encode(Add(request_id, prompt_token_ids, params, priority, deadline, cache_salt, pooling, lora,
                                  images or [], admitted, client_id)))
        except EngineUnavailable:
            del self._streams[request_id]
            raise
        return stream

    def abort(self, request_ids: list[str]) -> None:
        """Drop these requests; nothing more is delivered for them."""
        live = [r for r in request_ids if self._streams.pop(r, None) is not None]
        if live and self.healthy:
            try:
                self._send(encode(Abort(live)))
            except EngineUnavailable:
                pass

    async def stats(self, timeout: float = 5.0) -> Stats:
        fut = asyncio.get_running_loop().create_future()
        self._stats_waiters.append(fut)
        try:
            self._send(_STATS_PING)
            return await asyncio.wait_for(fut, timeout)
        finally:
            if fut in self._stats_waiters:
                self._stats_waiters.remove(fut)

    async def update_lora(self, name: str, path: str | None, timeout: float = 120.0) -> LoraUpdate:
        """Load LoRA adapter ``name`` from folder ``path`` (None: unload it); the engine's answer (its ``status``
        200, or the HTTP status of its refusal). ``ready.loras`` is the new list by the time it returns."""
        return await self._call(LoraUpdate(self._call_id(), name, path), timeout, "a LoRA update")

    async def reset_prefix_cache(self, timeout: float = 30.0) -> bool:
        """vLLM's: the engine forgets its cached blocks; whether it did (not while a request holds a block)."""
        return (await self._call(PrefixCacheReset(self._call_id()), timeout, "a prefix cache reset")).reset

    def _call_id(self) -> str:
        self._num_calls += 1
        return f"{self.frontend_id}:{self._num_calls}"

    async def _call(self, call: LoraUpdate | PrefixCacheReset, timeout: float, what: str):
        """Send ``call``; the engine's answer, the same message with its ``status`` set."""
        fut = self._calls[call.call_id] = asyncio.get_running_loop().create_future()
        try:
            self._send(encode(call))
            return await asyncio.wait_for(fut, timeout)
        except TimeoutError:
            raise EngineUnavailable(f"the engine did not answer {what} within {timeout:g}s") from None
        finally:
            self._calls.pop(call.call_id, None)

    @property
    def num_in_flight(self) -> int:
        return len(self._streams)

    @property
    def accepting(self) -> bool:
        """Healthy, and taking new requests."""
        return self.healthy and not self.draining

    def unanswered(self) -> float:
        """Seconds since the engine last said anything, while it is healthy (and so pinged); else 0."""
        return time.monotonic() - self._last_seen if self.healthy and self._connected else 0.0

    @property
    def stall_after(self) -> float:
        """Seconds unanswered past which the engine is ``stalled`` (module doc)."""
        spells, now = self._quiet_spells, time.monotonic()
        while spells and spells[0][0] < now - self.liveness_timeout:
            spells.popleft()
        longest = max((quiet for _, quiet in spells), default=0.0)
        if self._step_said_at == self._last_seen:  # (nothing heard since it said a step begins)
            longest = max(longest, self._step_said_s)
        return min(self.liveness_timeout, max(self._stall_floor, STALL_STEPS * longest))

    @property
    def stalled(self) -> bool:
        """Healthy but unanswered for over ``stall_after`` (module doc)."""
        return self.unanswered() > self.stall_after

    def _send(self, frame: bytes) -> None:
        if not self.healthy or self._sock is None:
            raise EngineUnavailable("the engine is not available")
        if (error := self._post(frame)) is not None:
            raise EngineUnavailable(f"cannot reach the engine: {error!r}")

    def _post(self, frame: bytes) -> BaseException | None:
        """Send without waiting: None, or why the frame could not go now (no connection yet, above all)."""
        try:
            fut = self._sock.send(frame, zmq.NOBLOCK)
        except zmq.ZMQError as e:
            return e
        if fut.done():
            return fut.exception()
        fut.add_done_callback(_retrieved)  # (a failure found later needs no "never retrieved" traceback)
        return None

    # ------------------------------------------------------------------ background tasks

    async def _read(self) -> None:
        sock = self._sock
        streams = self._streams
        while True:
            frame = await sock.recv()
            now = time.monotonic()
            if now - self._last_seen > self._stall_floor / STALL_STEPS and self.healthy:  # (pinged: a step's time)
                self._quiet_spells.append((now, now - self._last_seen))
            self._last_seen = now
            try:
                msg = decode(frame)
            except ProtocolError as e:
                log.error("dropping a malformed frame from the engine: %s", e)
                continue
            if isinstance(msg, Outputs):
                step_before, self._last_outputs_at = self._last_outputs_at, self._last_seen
                for d in msg:
                    s = streams.get(d.request_id)
                    if s is not None:
                        s.step_before_first.setdefault(d.request_id, step_before)
                        s.push(d)
                        if d.finish_reason is not None:
                            del streams[d.request_id]
            elif isinstance(msg, Error):
                if msg.request_id is None and self._awaiting_ready and self._connected:  # (its answer to HELLO)
                    self._awaiting_ready = False  # greeted enough: it said why not
                    self._refuse(f"the engine at {self.address} refused this frontend: {msg.message}")
                elif msg.request_id is None and msg.status == 503:  # it stops: its requests run on, no new ones
                    if not self.draining:
                        log.warning("the engine at %s: %s", self.address, msg.message)
                        self.draining = True
                        self._tell_stats()  # (the metrics show it draining at once, not at its next STATS: V)
                elif msg.request_id is None:
                    log.error("engine error: %s", msg.message)
                elif (s := streams.pop(msg.request_id, None)) is not None:
                    s.push(msg)
            elif isinstance(msg, Stats):
                if msg.step_s > 0:
                    self._step_said_at, self._step_said_s = self._last_seen, msg.step_s
                self.last_stats, self.last_stats_at = msg, self._last_seen
                self.in_flight_at_stats = len(streams)
                self._tell_stats()
                if self._stats_waiters:
                    fut = self._stats_waiters.pop(0)
                    if not fut.done():
                        fut.set_result(msg)
            elif isinstance(msg, Ready) and self._connected:  # an engine that came back (not a late word of one gone)
                back, self._awaiting_ready, self.draining = self._awaiting_ready, False, False
                if (why := _unlike(self.ready, msg, self.address)) is None:
                    self._unlike, self.ready = None, msg
                    if back and self.on_back is not None:
                        asyncio.get_running_loop().call_soon(self.on_back)  # (once it is healthy: below)
                else:
                    self._refuse(why)
            elif isinstance(msg, (LoraUpdate, PrefixCacheReset)):
                fut = self._calls.get(msg.call_id)
                if fut is not None and not fut.done():
                    fut.set_result(msg)
            if not self.healthy and self._connected and not self._awaiting_ready and self._unlike is None:
                log.warning("engine is answering again")
                self.healthy = True

    def _tell_stats(self) -> None:
        """``on_stats`` (the metrics) with the engine's latest numbers, unless it went (a late frame of one gone)."""
        if self.on_stats is not None and self._connected and self.last_stats is not None:
            try:
                self.on_stats(self.last_stats)
            except Exception:  # noqa: BLE001 - a metrics bug must not stop the reader
                log.exception("stats callback failed")

    async def _watch(self, monitor: zmq.asyncio.Socket) -> None:
        hello = encode(Hello(self.frontend_id))
        while True:
            event = parse_monitor_message(await monitor.recv_multipart())["event"]
            if event == zmq.EVENT_DISCONNECTED:
                stopped, self._connected, self.draining = self.draining, False, False
                self._awaiting_ready = True  # (whoever answers next is an engine new to us)
                self._mark_unhealthy("the engine stopped, as it said it would" if stopped else
                                     "the engine closed the connection", logging.INFO if stopped else logging.ERROR)
            elif event == zmq.EVENT_CONNECTED:
                self._connected = True
                if self._greeting is None or self._greeting.done():
                    self._greeting = asyncio.get_running_loop().create_task(self._greet(hello))

    async def _greet(self, hello: bytes) -> None:
        """A restarted engine learns who we are: HELLO until its READY comes (one sent as the connection is made
        may not go), and no answer of its counts as health before that READY (``_read``)."""
        for i in itertools.count():
            if not (self._connected and self._awaiting_ready):
                return
            self._post(hello)
            await asyncio.sleep(min(1.0, 0.1 * 2 ** i))

    async def _liveness(self) -> None:
        while True:
            await asyncio.sleep(self.liveness_interval)
            quiet = time.monotonic() - self._last_seen
            if quiet > self.liveness_timeout and self.healthy:
                self._mark_unhealthy(f"the engine has not answered for {quiet:.0f}s")
            # every tick, even while outputs flow: /health shows the answers, so they must stay fresh
            if self._connected and self._sock is not None:
                self._post(_STATS_PING)

    def fail_all(self, message: str) -> None:
        """Every request in flight ends with a 503 saying ``message`` (a stream's error event, then its end) and is
        aborted at the engine."""
        # emptied in place: the reader task holds this very dict, and the requests sent once the
        # engine answers again must be found in it (a new dict would strand them forever)
        streams = dict(self._streams)
        self._streams.clear()
        if streams and self._sock is not None:
            # We answer 503 for these now; an engine that is only slow must not go on generating them
            # for nobody. (A dead one never reads this; it aborts our orphans on our next HELLO.)
            self._post(encode(Abort(list(streams))))
        for rid, s in streams.items():
            s.push(_gone(rid, message))

    def _refuse(self, why: str) -> None:
        """The engine that answered is not served (``why``: once in the log, however many times it says so)."""
        if why != self._unlike:
            log.error("%s", why)
        self._unlike = why
        self._mark_unhealthy(why)

    def _mark_unhealthy(self, why: str, level: int = logging.ERROR) -> None:
        was, self.healthy = self.healthy, False
        if was:
            log.log(level, "engine unhealthy: %s", why)
            if self.on_unhealthy is not None:
                try:
                    self.on_unhealthy()
                except Exception:  # noqa: BLE001 - a metrics bug must not keep the requests below from failing
                    log.exception("unhealthy callback failed")
        self.fail_all(f"Engine unavailable: {why}")
        for fut in [*self._stats_waiters, *self._calls.values()]:
            if not fut.done():
                fut.set_exception(EngineUnavailable(why))
        self._stats_waiters.clear()
        self._calls.clear()
