"""The engine actor: the process that owns the ``Engine`` and talks to frontends.

Its mailbox is a ZMQ ROUTER socket (``ipc://`` in the launcher's private runtime
dir, or ``tcp://`` for ``tokenmill engine --listen``: then an ``engine_key`` is
required and the socket is a ZMQ CURVE server that lets in only frontends holding
the same key, see ``protocol.curve_keys``). One uvloop loop, one thread:

    drain every pending frame without blocking -> engine.step() -> one OUTPUTS
    frame per frontend with all of its deltas -> repeat

and await the socket only when the engine has nothing to do. ``step()`` runs
directly on the loop: it is the only thing this process exists to do, and
everything slow (HTTP, JSON, tokenizers) lives in the frontends. The one slow
thing here, reading a LoRA adapter's folder (``LoraUpdate``), runs on a thread
while steps go on; updates run one at a time, each as a task of its own.

Whenever its requests come or go, the engine sends every frontend its STATS unasked, at most every
``LOAD_S``: with several frontends and engines, each frontend ranks the engines by their load
(``frontends.engine_router``), and so sees another frontend's burst at once (their pings come every 2 s).
And as a step with prompt tokens begins that may take over ``SAY_STEP_S`` (``PromptRate``: its prompt tokens
at the most seconds a prompt token took in the last steps with prompts; a first one, before any was measured,
too), it tells them that time (``Stats.step_s``): it answers no ping until the step ends, and they are not to
take it for hung meanwhile (``EngineClient.stalled``); a STATS once it has ended takes the word back. With
asynchronous scheduling the word is said again after the outputs of the step in flight (on a GPU the new one
runs on after them; on the CPU it ran as it was launched), and taken back a step later.

Request ids are namespaced per frontend (``"<n>:<id>"``, ``n`` a small number
given to each frontend identity) so two frontends can never collide; replies
carry the frontend's own id again. A malformed frame is logged and dropped.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import dataclasses
import gc
import logging
import math
import signal
import threading
import time
from collections import deque
from collections.abc import Callable
from operator import itemgetter
from typing import Any

import zmq

from engine import protocol
from engine.config import EngineConfig
from engine.request import RequestError
from engine.stats_log import StatsLog

log = logging.getLogger("tokenmill.engine")

EngineFactory = Callable[[EngineConfig], Any]
# after these steps the heap is frozen again (``freeze_heap``): the first decodes import and record what the
# process keeps for good (torch's compiler, sympy, CPU graphs: ~130k objects on the default model)
FREEZE_AT_STEPS = frozenset({4, 64, 1024})
# an adapter folder not read by then (a stalled network mount, a FIFO) is the caller's 400, well inside the
# frontends' wait for the answer (120 s), and the updates queued behind it go on
LORA_READ_SECONDS = 60.0


def _default_engine_factory(config: EngineConfig) -> Any:
    from engine.engine import Engine  # torch: only in the engine process

    engine = Engine(config)
    # structured output reads the tokens' bytes on first use, which imports ~180k objects more: frozen too
    engine.grammars.on_vocabulary = freeze_heap
    return engine


def freeze_heap() -> None:
    """Keep everything made so far for good (the engine process's start-up: the model's modules, torch's,
    transformers' and triton's imports, ~860k objects for the default model): frozen, a full garbage
    collection no longer walks it. Unfrozen, one took ~280 ms of the step loop whenever enough objects had
    survived since the last (a grammar's memos, many requests' state): a stall of every stream. At exit they
    go as they would have, so that native modules that check for leaks then find none."""
    gc.collect()
    gc.freeze()
    atexit.unregister(gc.unfreeze)
    atexit.register(gc.unfreeze)


async def _read_in_time(read: Callable[[str, str], Any], name: str, path: str) -> Any:
    """``read(name, path)`` on a thread of its own (one that never returns holds no pool's worker), given up after
    ``LORA_READ_SECONDS`` as a 400: its result, if it ever comes, is dropped, so nothing is loaded after the caller
    was told it failed."""
    loop = asyncio.get_running_loop()
    done = loop.create_future()

    def settle(result: Any, error: BaseException | None) -> None:
        if not done.done():
            if error is not None:
                done.set_exception(error)
            else:
                done.set_result(result)

    def run() -> None:
        try:
            result, error = read(name, path), None
        except BaseException as e:  # noqa: BLE001 - the caller's to see
            result, error = None, e
        with contextlib.suppress(RuntimeError):  # (a read that ends after the engine's loop closed: nobody asks)
            loop.call_soon_threadsafe(settle, result, error)

    threading.Thread(target=run, name=f"lora-read-{name}", daemon=True).start()
    try:
        return await asyncio.wait_for(done, LORA_READ_SECONDS)
    except TimeoutError:
        log.warning("LoRA adapter %r: %s not read within %gs, given up", name, path, LORA_READ_SECONDS)
        raise RequestError(400, "invalid_request_error", f"{path} could not be read within {LORA_READ_SECONDS:g}s "
                           "(a stalled filesystem?)", "lora_path") from None


class EngineActor:
    """Routes frames between a ROUTER socket and an ``Engine`` (see module doc)."""

    def __init__(self, engine: Any, sock: zmq.Socket, log_stats_interval: float = 0.0, shutdown_grace: float = 0.0):
        self.engine = engine
        self.shutdown_grace = shutdown_grace  # ``--shutdown-timeout``: what a stop gives the requests under way
        self._draining_since: float | None = None  # (loop time) a stop asked: its frontends told, no new requests
        self._idle_since = math.inf  # (loop time) while draining: since when nothing has run
        self.stats_log = StatsLog(log_stats_interval) if log_stats_interval > 0 else None
        self.sock = sock
        self._ready_frame = protocol.encode(engine.ready_info())
        self._frontend_index: dict[bytes, int] = {}  # ZMQ identity -> n in "<n>:<id>"
        self._owner: dict[str, tuple[bytes, str]] = {}  # internal id -> (identity, frontend's id)
        self._owned: dict[bytes, set[str]] = {}  # identity -> its live internal ids
        self._stopping = False
        self._lora_updates = asyncio.Lock()
        self._lora_tasks: set[asyncio.Task] = set()  # (held: the loop keeps only weak references to tasks)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wakeup: asyncio.Future | None = None
        self.num_steps = 0
        self._load_changed = False  # a request came or went since the last unasked STATS (``_say_load``)...
        self._load_said_at = -math.inf  # (loop time) ... which was sent then
        self._heard: dict[bytes, float] = {}  # frontend identity -> (loop time) its last frame: the ones told
        self.on_drain: Callable[[], None] | None = None  # called as a drain begins (the launcher's: ``serve``'s stop)
        self.prompt_rate = PromptRate()  # what a step with prompt tokens may take (``_step_begins``)
        self._after_step: bytes | None = None  # (asynchronous scheduling) a step's word, said again after outputs
        self._unsay_at: int | None = None  # the step count after which the word is taken back (``_step``)
        engine.on_prompt_step = self._step_begins

    # ------------------------------------------------------------------ loop

    async def run(self) -> None:
        loop = self._loop = asyncio.get_running_loop()
        self._install_signal_handlers(loop)
        fd = self.sock.getsockopt(zmq.FD)
        try:
            while not self._stopping:
                self._drain()
                self._say_load(loop.time())
                if self._draining_since is not None and self._drained(loop.time()):
                    self._fail_outstanding(503, "service_unavailable_error", SHUTTING_DOWN)  # (past the grace)
                    await asyncio.sleep(GOODBYE_S)  # the last frames reach their frontends before the socket closes
                    break
                if self.engine.has_work():
                    self._step()
                    await asyncio.sleep(0)  # lets signal handlers and stop() in while busy
                else:  # (until a frame comes, a worker dies, the stats line of the steps just run is due...)
                    self.engine.check_workers()
                    wait = self.stats_log.remaining() if self.stats_log is not None else None
                    if self._draining_since is not None:  # (and the end of a drain's quiet)
                        wait = QUIET_S if wait is None else min(wait, QUIET_S)
                    if self._load_changed:  # (and the load's next word)
                        due = max(0.0, self._load_said_at + LOAD_S - loop.time())
                        wait = due if wait is None else min(wait, due)
                    try:
                        await asyncio.wait_for(self._wait_readable(loop, fd), wait)
                    except TimeoutError:
                        if self.stats_log is not None and self.stats_log.due():
                            self._log_stats()
        except Exception as e:
            log.exception("engine failure; going down")
            self._fail_outstanding(500, "internal_server_error", f"engine failure: {e}")
            raise
        finally:
            self._fail_outstanding(503, "service_unavailable_error", SHUTTING_DOWN)

    def stop(self) -> None:
        """Ask the loop to exit; safe from any thread and from signal handlers."""
        loop = self._loop
        if loop is None or loop.is_closed():
            self._stopping = True
            return
        try:
            loop.call_soon_threadsafe(self._request_stop)
        except RuntimeError:  # loop closing
            self._stopping = True

    def _request_stop(self) -> None:
        """Stop now; or, the first time with a ``shutdown_grace``, drain: every frontend is told to send its new
        requests elsewhere, and the requests under way run on until nothing has run for ``QUIET_S`` (a beam
        search's next round, or the requests sent before its frontend heard, come within it) or the grace ends."""
        if self.shutdown_grace > 0 and self._draining_since is None:
            self._draining_since = self._loop.time()
            log.info("shutting down: the requests under way (%d) get up to %gs; no new ones", len(self._owner),
                     self.shutdown_grace)
            for ident in self._frontend_index:
                self._send(ident, DRAINING)
            if self.on_drain is not None:
                self.on_drain()
        else:
            if self._draining_since is not None:
                log.info("asked again: stopping now (%d requests under way)", len(self._owner))
            self._stopping = True
        self._wake()

    def _drained(self, now: float) -> bool:
        if self.engine.has_work():
            self._idle_since = math.inf
        else:
            self._idle_since = min(self._idle_since, now)
        return now - self._idle_since >= QUIET_S or now - self._draining_since >= self.shutdown_grace

    def _say_load(self, now: float) -> None:
        """Every live frontend (heard from within ``ALIVE_S``: it pings every 2 s) hears this engine's STATS when a
        request came or went (not more often than ``LOAD_S``; one frontend's leaving as another's came too): their
        routers rank the engines by it, less their own requests; ``/health`` and the metrics' gauges show it."""
        if self._load_changed and now - self._load_said_at >= LOAD_S:
            self._load_changed, self._load_said_at = False, now
            self._tell_live(protocol.encode(self.engine.stats()), now)

    def _tell_live(self, frame: bytes, now: float) -> None:
        for ident, heard in list(self._heard.items()):
            if now - heard < ALIVE_S:
                self._send(ident, frame)
            else:  # (a frontend gone: a remote engine meets a new identity at each restart of its frontends)
                del self._heard[ident]

    def _step_begins(self, prompt_tokens: int) -> None:
        """(``engine.on_prompt_step``) A step with ``prompt_tokens`` is scheduled: the live frontends hear what it
        may take, if that is over ``SAY_STEP_S`` (module doc)."""
        seconds = self.prompt_rate.predict(prompt_tokens)
        if seconds <= SAY_STEP_S or self._loop is None:
            return
        frame = protocol.encode(dataclasses.replace(self.engine.stats(), step_s=seconds))
        self._tell_live(frame, self._loop.time())
        overlapped = getattr(self.engine, "async_scheduling", False)
        if overlapped:
            self._after_step = frame
        self._unsay_at = self.num_steps + 1 + overlapped

    def _wake(self) -> None:
        """Have a wait for frames look at the socket again."""
        if self._wakeup is not None and not self._wakeup.done():
            self._wakeup.set_result(None)

    def _install_signal_handlers(self, loop: asyncio.AbstractEventLoop) -> None:
        if threading.current_thread() is not threading.main_thread():
            return  # in-process tests run the actor in a thread and call stop()
        loop.add_signal_handler(signal.SIGTERM, self._request_stop)
        # The launcher makes its children ignore SIGINT (Ctrl-C reaches the whole
        # process group; the launcher decides the shutdown order): respect that.
        if signal.getsignal(signal.SIGINT) is not signal.SIG_IGN:
            loop.add_signal_handler(signal.SIGINT, self._request_stop)

    async def _wait_readable(self, loop: asyncio.AbstractEventLoop, fd: int) -> None:
        # ZMQ's FD is edge-triggered: wait on it only while EVENTS says nothing is
        # pending (a send may have consumed the edge of a frame that arrived).
        # (a tensor-parallel worker's death wakes it too: the loop then checks the workers)
        # (a drain begun meanwhile, by a signal, goes back to run(), whose wait ends at the drain's quiet: with no
        # frame coming, an idle engine without frontends would drain until a second signal, review V)
        watched, draining = [fd, *self.engine.worker_fds()], self._draining_since
        while not self._stopping and self._draining_since == draining and not (
                self.sock.getsockopt(zmq.EVENTS) & zmq.POLLIN):
            fut = self._wakeup = loop.create_future()
            for w in watched:
                loop.add_reader(w, _resolve, fut)
            try:
                await fut
            finally:
                for w in watched:
                    loop.remove_reader(w)
                self._wakeup = None
            if len(watched) > 1:
                return

    # ------------------------------------------------------------------ inbound

    def _drain(self) -> None:
        while True:
            try:
                frames = self.sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            self._handle(frames)

    def _handle(self, frames: list[bytes]) -> None:
        if len(frames) < 2:
            log.warning("dropping a frame without an identity")
            return
        ident, payload = frames[0], frames[-1]  # tolerate REQ-style empty delimiters
        self._heard[ident] = self._loop.time()
        try:
            msg = protocol.decode(payload)
        except protocol.ProtocolError as e:
            log.warning("dropping malformed frame from frontend %r: %s", ident, e)
            return
        if isinstance(msg, protocol.Add):
            self._add(ident, msg)
        elif isinstance(msg, protocol.Abort):
            self._abort(ident, msg.request_ids)
        elif isinstance(msg, protocol.Stats):
            self._send(ident, protocol.encode(self.engine.stats()))
        elif isinstance(msg, protocol.Hello):
            self._hello(ident, msg)
        elif isinstance(msg, protocol.PrefixCacheReset) and not msg.status:  # (between two steps: the actor's turn)
            msg.status, msg.reset = 200, self.engine.reset_prefix_cache()
            self._send(ident, protocol.encode(msg))
        elif isinstance(msg, protocol.LoraUpdate) and not msg.status:
            task = self._loop.create_task(self._update_lora(ident, msg))  # (steps go on while it reads the folder)
            self._lora_tasks.add(task)
            task.add_done_callback(self._lora_tasks.discard)
        else:
            log.warning("dropping %s frame from frontend %r: not for the engine", msg.kind.name, ident)

    def _hello(self, ident: bytes, msg: protocol.Hello) -> None:
        if msg.version != protocol.PROTOCOL_VERSION:
            log.error("frontend %r speaks protocol %d, engine %d", ident, msg.version, protocol.PROTOCOL_VERSION)
            self._send(ident, protocol.encode(protocol.Error(
                None, 500, "internal_server_error",
                f"protocol version mismatch: frontend {msg.version}, engine {protocol.PROTOCOL_VERSION}")))
            return
        # A HELLO from a known identity is a restarted frontend: what its previous
        # life asked for has nobody waiting for it any more.
        stale = self._owned.get(ident)
        if stale:
            log.info("frontend %r reconnected: aborting %d orphaned requests", ident, len(stale))
            self._abort_internal(list(stale))
        if ident not in self._frontend_index:  # (a frontend says HELLO each second until answered: once is news)
            log.info("frontend %r connected", msg.frontend_id)
        self._index(ident)
        self._send(ident, self._ready_frame)
        if self._draining_since is not None:
            self._send(ident, DRAINING)

    def _add(self, ident: bytes, msg: protocol.Add) -> None:
        iid = f"{self._index(ident)}:{msg.request_id}"
        if (self._draining_since is not None and not msg.admitted  # (a later part of a call taken still runs)
                and self._loop.time() - self._draining_since > HEARD_S):  # (sent before its frontend heard: taken)
            self._send_error(ident, msg.request_id, 503, "service_unavailable_error", SHUTTING_DOWN)
            return
        if iid in self._owner:
            self._send_error(ident, msg.request_id, 400, "invalid_request_error",
                             f"request id {msg.request_id!r} is already running")
            return
        try:
            self.engine.add_request(iid, msg.prompt_token_ids, msg.params, msg.priority, msg.deadline,
                                    msg.cache_salt, msg.pooling, msg.lora, msg.images, msg.admitted, msg.client)
        except Exception as e:  # noqa: BLE001 - RequestError carries status; anything else is a 500
            status = getattr(e, "status", None)
            if isinstance(status, int):
                self._send_error(ident, msg.request_id, status, getattr(e, "type", "invalid_request_error"),
                                 getattr(e, "message", str(e)), getattr(e, "param", None))
            else:
                log.exception("add_request(%s) failed", iid)
                self._send_error(ident, msg.request_id, 500, "internal_server_error", f"engine error: {e}")
            return
        self._owner[iid] = (ident, msg.request_id)
        self._owned.setdefault(ident, set()).add(iid)
        self._load_changed = True

    def _abort(self, ident: bytes, request_ids: list[str]) -> None:
        n = self._frontend_index.get(ident)
        if n is None:
            return
        self._abort_internal([iid for rid in request_ids if (iid := f"{n}:{rid}") in self._owner])

    def _abort_internal(self, iids: list[str]) -> None:
        if not iids:
            return
        self.engine.abort(iids)
        self._load_changed = True
        for iid in iids:
            ident, _ = self._owner.pop(iid)
            self._owned[ident].discard(iid)

    async def _update_lora(self, ident: bytes, msg: protocol.LoraUpdate) -> None:
        """Load or unload an adapter, one update at a time, in the order they came: a load's folder is read on
        a thread while the engine steps, then copied into its slot between two steps. On success every frontend
        hears the new list (a READY) before the caller hears the answer, so a request naming a loaded adapter
        finds it at any frontend."""
        async with self._lora_updates:
            try:
                if msg.path is None:
                    self.engine.unload_lora(msg.name)
                else:
                    self.engine.check_lora(msg.name)  # (refused before the folder is read)
                    adapter = await _read_in_time(self.engine.read_lora, msg.name, msg.path)
                    self.engine.load_lora(msg.name, msg.path, adapter)
            except asyncio.CancelledError:  # the engine is going down
                msg.status, msg.message = 503, "the engine is shutting down"
                self._send(ident, protocol.encode(msg))
                raise
            except Exception as e:  # noqa: BLE001 - RequestError carries status; anything else is a 500
                status = getattr(e, "status", None)
                if not isinstance(status, int):
                    log.exception("LoRA update %r failed", msg.name)
                msg.status, msg.message, msg.param = (status, e.message, getattr(e, "param", None)) \
                    if isinstance(status, int) else (500, f"engine error: {e}", None)
            else:
                self._ready_frame = protocol.encode(self.engine.ready_info())
                for frontend in self._frontend_index:
                    self._send(frontend, self._ready_frame)
                msg.status = 200
            self._send(ident, protocol.encode(msg))
            self._wake()  # (a send may have taken the edge of a frame that came meanwhile: see _wait_readable)

    def _index(self, ident: bytes) -> int:
        n = self._frontend_index.get(ident)
        if n is None:
            n = self._frontend_index[ident] = len(self._frontend_index)
        return n

    # ------------------------------------------------------------------ outbound

    def _step(self) -> None:
        start = time.perf_counter()
        out = self.engine.step()
        seconds = time.perf_counter() - start
        self.num_steps += 1
        scheduled, prompt_tokens = self.engine.step_batch
        self.prompt_rate.observe(prompt_tokens, seconds)
        if self.stats_log is not None:
            self.stats_log.step(seconds, prompt_tokens, sum(map(len, out.token_ids)), scheduled > 0)
            if self.stats_log.due():
                self._log_stats()
        if self.num_steps in FREEZE_AT_STEPS:
            freeze_heap()
        if out:
            self._deliver(out)
        if self._after_step is not None:  # (said again: the outputs just sent took the word back)
            frame, self._after_step = self._after_step, None
            self._tell_live(frame, self._loop.time())
        elif self._unsay_at is not None and self.num_steps >= self._unsay_at:  # the step said has ended
            self._unsay_at = None
            self._tell_live(protocol.encode(self.engine.stats()), self._loop.time())

    def _deliver(self, out: protocol.Outputs) -> None:
        """One step's deltas to their frontends."""
        iids = out.request_ids
        whos = list(map(self._owner.get, iids))  # (frontend, its id); None: aborted by it since it was scheduled
        for i, finish_reason, *_ in out.rare:
            if finish_reason is not None and self._owner.pop(iids[i], None) is not None:
                self._owned[whos[i][0]].discard(iids[i])
                self._load_changed = True
        aborted = None in whos
        idents = list(map(itemgetter(0), filter(None, whos) if aborted else whos))
        if not aborted and len(set(idents)) == 1:  # the usual step: one frontend's requests
            out.request_ids = list(map(itemgetter(1), whos))
            self._send(idents[0], protocol.encode(out))
            return
        rows = {ident: [] for ident in idents}
        for i, who in enumerate(whos):
            if who is not None:
                rows[who[0]].append(i)
        for ident, at in rows.items():
            self._send(ident, protocol.encode(out.take(at, [whos[i][1] for i in at])))

    def _log_stats(self) -> None:
        line = self.stats_log.line(self.engine.stats()) if self.stats_log is not None else None
        if line is not None:
            log.info("%s", line)

    def _send_error(self, ident: bytes, rid: str | None, status: int, typ: str, message: str,
                    param: str | None = None) -> None:
        self._send(ident, protocol.encode(protocol.Error(rid, status, typ, message, param)))

    def _send(self, ident: bytes, frame: bytes) -> None:
        try:
            self.sock.send_multipart([ident, frame], zmq.NOBLOCK)
        except zmq.ZMQError as e:  # a vanished peer: its requests get aborted on its next HELLO
            log.warning("could not send to frontend %r: %s", ident, e)

    def _fail_outstanding(self, status: int, typ: str, message: str) -> None:
        """Tell every frontend its requests are over (shutdown or a broken engine)."""
        for ident, rid in list(self._owner.values()):
            self._send_error(ident, rid, status, typ, message)
        iids = list(self._owner)
        self._owner.clear()
        self._owned.clear()
        if iids:
            try:
                self.engine.abort(iids)
            except Exception:  # noqa: BLE001 - best effort on the way out
                log.exception("abort on shutdown failed")


SHUTTING_DOWN = "The engine is shutting down"
GOODBYE_S = 0.2  # (a frontend may see the disconnect before frames sent just ahead of it, and fail what they ended)
QUIET_S = 0.5  # a drain ends once nothing has run for this long
LOAD_S = 0.05  # the most often an engine tells its frontends that its load changed (unasked STATS)...
ALIVE_S = 10.0  # ... those heard from this recently (frontends ping every 2 s)
SAY_STEP_S = 1.0  # a step with prompt tokens that may take longer is said to the frontends as it begins
RATE_STEPS = 32  # ... from the most seconds a prompt token took in the last this many steps with prompt tokens
HEARD_S = 1.0  # a drain takes the new requests that come this soon: sent before their frontends heard of it
# what a draining engine tells its frontends (``EngineClient`` reads an engine-wide 503 so): send it nothing new
DRAINING = protocol.encode(protocol.Error(None, 503, "service_unavailable_error", f"{SHUTTING_DOWN}: no new requests"))


class PromptRate:
    """What a step with prompt tokens may take: its prompt tokens times the most seconds a prompt token took in the
    last ``RATE_STEPS`` steps with prompt tokens, a step's whole time counted as its prompt tokens' (its decodes' and
    its fixed cost too: a step of few tokens makes the rate high, so that the guess errs long; attention's growth
    with a prompt's length makes a step of more tokens than any measured take up to about twice the guess). The
    process's first step (one-time costs) is not measured: until one is, the guess is inf."""

    def __init__(self) -> None:
        self._rates: deque[float] = deque(maxlen=RATE_STEPS)
        self._steps = 0

    def observe(self, prompt_tokens: int, seconds: float) -> None:
        self._steps += 1
        if prompt_tokens and self._steps > 1 and math.isfinite(seconds):
            self._rates.append(max(0.0, seconds) / prompt_tokens)

    def predict(self, prompt_tokens: int) -> float:
        return prompt_tokens * max(self._rates) if self._rates else math.inf


def _resolve(fut: asyncio.Future) -> None:
    if not fut.done():
        fut.set_result(None)


_AUTHENTICATORS: dict[int, Any] = {}  # id(ROUTER socket) -> its ZAP ThreadAuthenticator


class _OneClient:
    """ZAP credentials: the one client public key that the shared engine key gives."""

    def __init__(self, client_public: bytes) -> None:
        self.client_public = client_public

    def callback(self, domain: str, key: bytes) -> bool:
        import hmac

        ok = hmac.compare_digest(key, self.client_public)
        if not ok:
            log.warning("refused a connection: its CURVE key is not the engine key's")
        return ok


def bind_router(ctx: zmq.Context, address: str, engine_key: str | None = None) -> zmq.Socket:
    """The engine's ROUTER. With ``engine_key``: a CURVE server (its ZAP handler runs in a thread of ``ctx``)."""
    if address.startswith("tcp://") and not engine_key:
        raise ValueError(f"an engine listening on {address} needs an engine key (--engine-key or "
                         f"${protocol.ENGINE_KEY_ENV}): an open engine port would take work from anyone")
    sock = ctx.socket(zmq.ROUTER)
    if engine_key:
        from zmq.auth.thread import ThreadAuthenticator

        keys = protocol.curve_keys(engine_key)
        auth = ThreadAuthenticator(ctx, log=logging.getLogger("tokenmill.engine.auth"))
        auth.start()
        auth.configure_curve_callback("*", credentials_provider=_OneClient(keys.client_public))
        _AUTHENTICATORS[id(sock)] = auth  # stopped with the socket (close_router)
        sock.setsockopt(zmq.CURVE_SERVER, 1)
        sock.setsockopt(zmq.CURVE_SECRETKEY, keys.server_secret)
        sock.setsockopt(zmq.CURVE_PUBLICKEY, keys.server_public)
    # Unbounded queues: a dropped OUTPUTS frame would hang a request forever, and
    # memory is bounded by the number of admitted requests anyway.
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.setsockopt(zmq.RCVHWM, 0)
    sock.setsockopt(zmq.ROUTER_HANDOVER, 1)  # a restarted frontend reuses its identity
    sock.setsockopt(zmq.IPV6, protocol.wants_ipv6(address))
    sock.setsockopt(zmq.LINGER, 1000)  # flush the shutdown errors, but never hang on exit
    try:
        sock.bind(address)
    except zmq.ZMQError as e:
        close_router(sock)
        raise ValueError(f"cannot listen on {address}: {e}") from e
    return sock


def close_router(sock: zmq.Socket) -> None:
    sock.close()
    auth = _AUTHENTICATORS.pop(id(sock), None)
    if auth is not None:
        auth.stop()


def _new_loop() -> asyncio.AbstractEventLoop:
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency; keep working without it
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()


def run_engine(
    config: EngineConfig,
    address: str,
    ready: Callable[[], None] | None = None,
    engine_factory: EngineFactory | None = None,
    on_actor: Callable[[EngineActor], None] | None = None,
    engine_key: str | None = None,
    shutdown_grace: float = 0.0,
) -> None:
    """Serve ``config``'s model on ``address`` until SIGTERM/SIGINT (or ``actor.stop()``).

    ``ready()`` is called once the socket is bound and the model is loaded.
    ``engine_factory`` (tests) replaces ``Engine``; ``on_actor`` hands out the
    actor, e.g. so that a test running this in a thread can stop it. ``engine_key``: CURVE
    authentication and encryption (required for ``tcp://``). ``shutdown_grace``: see ``EngineActor._request_stop``.
    """
    ctx = zmq.Context()
    try:
        sock = bind_router(ctx, address, engine_key)  # bind before the slow load: a bad address fails fast
    except BaseException:
        ctx.term()
        raise
    try:
        engine = (engine_factory or _default_engine_factory)(config)
        actor = EngineActor(engine, sock, config.log_stats_interval, shutdown_grace)
        freeze_heap()  # the model and torch live as long as the process: keep them out of every GC pass
        if on_actor is not None:
            on_actor(actor)
        if ready is not None:
            ready()
        log.info("engine serving on %s", address)
        with asyncio.Runner(loop_factory=_new_loop) as runner:
            runner.run(actor.run())
        log.info("engine stopped after %d steps", actor.num_steps)
    finally:
        close_router(sock)
        ctx.term()
