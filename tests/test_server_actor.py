"""The engine actor over a real ZMQ socket, with a fake engine behind it.

``FakeEngine`` has the ``Engine`` interface and produces deterministic tokens
(one per running request per step), so these tests pin the actor's routing:
handshake, per-frontend id namespaces, one OUTPUTS frame per frontend per step,
errors, aborts, stats, malformed frames, shutdown. Hermetic and fast: no torch.
"""

from __future__ import annotations

import logging
import math
import multiprocessing as mp
import os
import signal
import threading
import time

import msgpack
import pytest
import zmq

from engine import protocol as p
from engine import server
from engine.config import EngineConfig
from engine.server import run_engine

VOCAB = 1000
MAX_LEN = 64


class FakeRequestError(Exception):
    def __init__(self, status: int, type: str, message: str, param: str | None = None):
        super().__init__(message)
        self.status, self.type, self.message, self.param = status, type, message, param


class FakeEngine:
    """Token ``i`` of a request is ``(sum(prompt) + i) % VOCAB``; finishes with "length".

    ``start_after``: has_work() stays False until that many requests were added,
    so tests can line requests up to share steps. ``fail_on_step``: step number
    that raises. ``late_aborts``: an aborted request still gets a delta in the next
    step (as a token the engine had in flight would, were it not dropped).
    """

    def __init__(self, config: EngineConfig, start_after: int = 0, max_waiting: int = 8,
                 fail_on_step: int | None = None, step_delay: float = 0.0, late_aborts: bool = False):
        self.config = config
        self.step_batch = (0, 0)
        self.start_after = start_after
        self.max_waiting = max_waiting
        self.fail_on_step = fail_on_step
        self.step_delay = step_delay
        self.late_aborts = late_aborts
        self.leaving: list[str] = []  # (late_aborts) aborted, one delta still to come
        self.running: dict[str, list] = {}  # id -> [prompt, params, num generated]
        self.added: list[str] = []
        self.aborted: list[str] = []
        self.steps: list[list[p.Delta]] = []
        self.loras: dict[str, str] = {}
        self.copying = threading.Event()  # a slow adapter copy has begun
        self.on_prompt_step = None  # (set by the actor, as on the real engine: called as a step with prompts begins)

    def ready_info(self) -> p.Ready:
        return p.Ready("fake", MAX_LEN, VOCAB, [2], 8, 100, 16, loras=[[n, path] for n, path in self.loras.items()])

    def check_lora(self, name):
        return 0

    def read_lora(self, name, path):
        if path == "/bad":
            raise FakeRequestError(400, "invalid_request_error", "no readable adapter_config.json")
        if path == "/slow":
            time.sleep(1.0)
        return path

    def load_lora(self, name, path, adapter=None):
        assert adapter == path
        if path == "/slow-copy":  # the copy into the slot, which runs between steps (on the loop)
            self.copying.set()
            time.sleep(0.3)
        self.loras[name] = path

    def unload_lora(self, name):
        if self.loras.pop(name, None) is None:
            raise FakeRequestError(404, "not_found_error", f"The LoRA adapter '{name}' is not loaded")

    def add_request(self, request_id, prompt_token_ids, params, priority=0, deadline=None, cache_salt="", pooling=None,
                    lora="", images=None, admitted=False, client=""):
        if len(prompt_token_ids) + params.max_tokens > MAX_LEN:
            raise FakeRequestError(400, "invalid_request_error", "too long", "max_tokens")
        if len(self.running) >= self.max_waiting:
            raise FakeRequestError(429, "rate_limit_error", "queue full")
        if request_id == "explode" or request_id.endswith(":explode"):
            raise RuntimeError("kaboom")
        self.running[request_id] = [list(prompt_token_ids), params, 0]
        self.added.append(request_id)

    def abort(self, request_ids):
        for rid in request_ids:
            if (self.running.get(rid) if self.late_aborts else self.running.pop(rid, None)) is not None:
                self.aborted.append(rid)
                self.leaving.append(rid)

    def has_work(self) -> bool:
        return bool(self.running) and len(self.added) >= self.start_after

    def worker_fds(self) -> list[int]:
        return []

    def check_workers(self) -> None:
        pass

    def step(self) -> p.Outputs:
        if self.fail_on_step is not None and len(self.steps) + 1 >= self.fail_on_step:
            raise RuntimeError("step exploded")
        self.step_batch = (len(self.running), sum(len(prompt) for prompt, _, n in self.running.values() if n == 0))
        if self.step_batch[1] and self.on_prompt_step is not None:
            self.on_prompt_step(self.step_batch[1])
        if self.step_delay:
            time.sleep(self.step_delay)
        out = []
        for rid, st in list(self.running.items()):
            prompt, params, n = st
            tok = (sum(prompt) + n) % VOCAB
            st[2] = n + 1
            fin = "length" if st[2] >= params.max_tokens else None
            out.append(p.Delta(rid, [tok], fin, None, len(prompt) if n == 0 else 0, 0))
            if fin or rid in self.leaving:
                del self.running[rid]
        self.leaving = [rid for rid in self.leaving if rid in self.running]
        self.steps.append([p.Delta(d.request_id, list(d.token_ids), d.finish_reason) for d in out])
        return p.Outputs.of(out)

    def stats(self) -> p.Stats:
        return p.Stats(0, len(self.running), len(self.running) / 100, 100 - len(self.running), 100)


def expected_tokens(prompt: list[int], n: int) -> list[int]:
    return [(sum(prompt) + i) % VOCAB for i in range(n)]


class ActorHarness:
    """run_engine in a thread (signals are the main thread's; stop() instead)."""

    def __init__(self, address: str, config: EngineConfig | None = None, **engine_kw):
        self.address = address
        self.engine: FakeEngine | None = None
        self.actor = None
        self.error: BaseException | None = None
        ready = threading.Event()

        def factory(config):
            self.engine = FakeEngine(config, **engine_kw)
            return self.engine

        def target():
            try:
                run_engine(config or EngineConfig(), address, ready=ready.set, engine_factory=factory,
                           on_actor=lambda a: setattr(self, "actor", a))
            except BaseException as e:  # noqa: BLE001 - surfaced by the test
                self.error = e
                ready.set()

        self.thread = threading.Thread(target=target, daemon=True)
        self.thread.start()
        assert ready.wait(10), "engine actor did not become ready"
        assert self.error is None, self.error
        self.ctx = zmq.Context()
        self.clients: list[zmq.Socket] = []

    def client(self, identity: bytes) -> zmq.Socket:
        s = self.ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.IDENTITY, identity)
        s.setsockopt(zmq.LINGER, 0)
        s.connect(self.address)
        self.clients.append(s)
        return s

    def close(self) -> None:
        if self.actor is not None:
            self.actor.stop()
        self.thread.join(10)
        for s in self.clients:
            s.close()
        self.ctx.term()


def send(sock: zmq.Socket, msg) -> None:
    sock.send(p.encode(msg))


def recv(sock: zmq.Socket, timeout: float = 5.0, stats: bool = False):
    """The engine actor's next frame: but for ``stats``, not a STATS (it sends them unasked as its requests come
    and go)."""
    deadline = time.monotonic() + timeout
    while True:
        assert sock.poll(max(1, int((deadline - time.monotonic()) * 1000))), "no reply from the engine actor"
        msg = p.decode(sock.recv())
        if stats or not isinstance(msg, p.Stats):
            return msg


def recv_none(sock: zmq.Socket, timeout: float = 0.2) -> None:
    """No frame but STATS for ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while (left := deadline - time.monotonic()) > 0 and sock.poll(max(1, int(left * 1000))):
        msg = p.decode(sock.recv())
        assert isinstance(msg, p.Stats), f"unexpected frame: {msg}"


def collect(sock: zmq.Socket, request_ids: set[str], timeout: float = 5.0) -> tuple[list, dict, dict]:
    """Read frames until every id finished; returns (frames, tokens per id, finish per id)."""
    frames, toks, fin = [], {r: [] for r in request_ids}, {}
    deadline = time.monotonic() + timeout
    while set(fin) != request_ids:
        msg = recv(sock, max(0.01, deadline - time.monotonic()))
        frames.append(msg)
        assert isinstance(msg, p.Outputs), msg
        for d in msg:
            toks[d.request_id] += d.token_ids
            if d.finish_reason:
                fin[d.request_id] = d.finish_reason
    return frames, toks, fin


def hello(sock: zmq.Socket, fid: str) -> p.Ready:
    send(sock, p.Hello(fid))
    ready = recv(sock)
    assert isinstance(ready, p.Ready)
    return ready


@pytest.fixture
def address(tmp_path):
    return f"ipc://{tmp_path}/engine.sock"


@pytest.fixture
def harness(address):
    h = ActorHarness(address)
    yield h
    h.close()


def test_hello_gets_ready(harness):
    c = harness.client(b"fe0")
    assert hello(c, "fe0") == p.Ready("fake", MAX_LEN, VOCAB, [2], 8, 100, 16)


def test_add_streams_deterministic_tokens_and_finishes(harness):
    c = harness.client(b"fe0")
    hello(c, "fe0")
    send(c, p.Add("a", [1, 2, 3], p.SamplingParams(max_tokens=5)))
    frames, toks, fin = collect(c, {"a"})
    assert toks["a"] == expected_tokens([1, 2, 3], 5)
    assert fin == {"a": "length"}
    assert frames[0].num_prompt_tokens[0] == 3
    assert harness.engine.added == ["0:a"]  # namespaced inside the engine
    assert not harness.actor._owner  # finished requests are forgotten


def test_a_burst_of_work_ends_with_a_stats_line(address, caplog):
    # a line at the end of the interval that began with the burst's first step, though the engine is idle by then
    harness = ActorHarness(address, EngineConfig(log_stats_interval=0.5))
    try:
        c = harness.client(b"fe0")
        hello(c, "fe0")
        with caplog.at_level(logging.INFO, logger="tokenmill.engine"):
            start = time.monotonic()
            send(c, p.Add("a", [1, 2, 3], p.SamplingParams(max_tokens=5)))
            collect(c, {"a"})
            deadline = time.monotonic() + 5
            while not any("Avg prompt throughput" in r.getMessage() for r in caplog.records):
                assert time.monotonic() < deadline, "no stats line"
                time.sleep(0.01)
            assert time.monotonic() - start >= 0.45
            time.sleep(0.7)  # idle: no further line
    finally:
        harness.close()
    lines = [r.getMessage() for r in caplog.records if "Avg prompt throughput" in r.getMessage()]
    assert len(lines) == 1, lines
    line = lines[0]
    # 5 steps: the first computed the 3 prompt tokens, each sampled one token
    assert "Running: 0 reqs, Waiting: 0 reqs" in line and "Steps: 4 decode-only (median " in line, line
    assert ", 1 with prompt tokens (median " in line, line


def two_frontends(h: ActorHarness) -> tuple[zmq.Socket, zmq.Socket]:
    """Frontends "fe-a" and "fe-b", each greeted (its index: 0 and 1, in that order)."""
    a, b = h.client(b"fe-a"), h.client(b"fe-b")
    hello(a, "fe-a")
    hello(b, "fe-b")
    return a, b


def test_one_outputs_frame_per_frontend_per_step(address):
    h = ActorHarness(address, start_after=4)
    try:
        a, b = two_frontends(h)
        # the same request ids from two frontends must not collide
        send(a, p.Add("x", [1], p.SamplingParams(max_tokens=3)))
        send(a, p.Add("y", [2], p.SamplingParams(max_tokens=3)))
        send(b, p.Add("x", [10], p.SamplingParams(max_tokens=3)))
        send(b, p.Add("y", [20], p.SamplingParams(max_tokens=3)))
        fa, ta, _ = collect(a, {"x", "y"})
        fb, tb, _ = collect(b, {"x", "y"})
        assert len(h.engine.steps) == 3
        assert len(fa) == len(fb) == 3  # one frame per step, both requests in it
        assert all(sorted(d.request_id for d in f) == ["x", "y"] for f in fa + fb)
        assert ta == {"x": expected_tokens([1], 3), "y": expected_tokens([2], 3)}
        assert tb == {"x": expected_tokens([10], 3), "y": expected_tokens([20], 3)}
        assert sorted(h.engine.added) == ["0:x", "0:y", "1:x", "1:y"]
    finally:
        h.close()


def test_a_delta_of_a_request_aborted_meanwhile_goes_nowhere(address):
    """A step's delta for a request its frontend aborted since (the actor has forgotten it) reaches no frontend;
    the step's other deltas reach theirs, under their own ids, their ends too."""
    h = ActorHarness(address, start_after=3, step_delay=0.05, late_aborts=True)
    try:
        a, b = two_frontends(h)
        send(a, p.Add("x", [1], p.SamplingParams(max_tokens=8)))
        send(b, p.Add("x", [10], p.SamplingParams(max_tokens=40)))
        send(b, p.Add("y", [20], p.SamplingParams(max_tokens=8)))
        first = recv(b)
        assert {d.request_id for d in first} == {"x", "y"}
        send(b, p.Abort(["x"]))
        _, ta, fa = collect(a, {"x"})
        tb, fb = {"x": [], "y": []}, None
        for f in [first] + [recv(b) for _ in range(7)]:  # (y's 8 tokens, one a step)
            for d in f:
                tb[d.request_id] += d.token_ids
                fb = d.finish_reason if d.request_id == "y" else fb
        assert ta == {"x": expected_tokens([1], 8)} and fa == {"x": "length"}
        assert tb["y"] == expected_tokens([20], 8) and fb == "length"
        with_x = [step for step in h.engine.steps if any(d.request_id == "1:x" for d in step)]
        late = with_x[-1]  # the step after the abort: a delta for a request the actor no longer has
        assert {d.request_id for d in late} == {"0:x", "1:x", "1:y"}, late
        assert len(tb["x"]) == len(with_x) - 1  # every delta of x but that one
        recv_none(a)
        recv_none(b)
        assert not h.actor._owner and not h.engine.running
    finally:
        h.close()


def test_a_lora_update_reaches_every_frontend_before_its_answer(harness):
    a, b = harness.client(b"fe-a"), harness.client(b"fe-b")
    hello(a, "fe-a")
    hello(b, "fe-b")
    send(a, p.LoraUpdate("c1", "sql", "/adapters/sql"))
    assert recv(a).loras == recv(b).loras == [["sql", "/adapters/sql"]]
    assert recv(a) == p.LoraUpdate("c1", "sql", "/adapters/sql", 200)
    send(b, p.LoraUpdate("c2", "chat", "/bad"))
    assert recv(b) == p.LoraUpdate("c2", "chat", "/bad", 400, "no readable adapter_config.json")
    send(b, p.LoraUpdate("c3", "sql", None))
    assert recv(a).loras == recv(b).loras == []
    assert recv(b) == p.LoraUpdate("c3", "sql", None, 200)
    send(a, p.LoraUpdate("c4", "sql", None))
    assert recv(a) == p.LoraUpdate("c4", "sql", None, 404, "The LoRA adapter 'sql' is not loaded")
    recv_none(b)
    assert hello(b, "fe-b").loras == []  # (and a frontend connecting later hears the latest list)


def test_requests_step_while_an_adapters_folder_is_read(harness):
    """A load reads its folder on a thread: a request added after it runs to its end meanwhile; an unload sent
    after the load is answered after it (one update at a time, in order)."""
    c = harness.client(b"fe0")
    hello(c, "fe0")
    send(c, p.LoraUpdate("c1", "sql", "/slow"))
    send(c, p.LoraUpdate("c2", "sql", None))
    send(c, p.Add("a", [1, 2, 3], p.SamplingParams(max_tokens=3)))
    _, toks, fin = collect(c, {"a"}, timeout=0.9)
    assert fin == {"a": "length"}
    assert recv(c).loras == [["sql", "/slow"]]
    assert recv(c) == p.LoraUpdate("c1", "sql", "/slow", 200)
    assert recv(c).loras == []
    assert recv(c) == p.LoraUpdate("c2", "sql", None, 200)


def test_a_frame_that_comes_during_an_adapters_copy_is_read(harness):
    """The copy runs on the loop while the engine idles; a request another frontend sends meanwhile is read once
    the answers are out (their sends may have taken the socket's edge for it)."""
    a, b = harness.client(b"fe-a"), harness.client(b"fe-b")
    hello(a, "fe-a")
    hello(b, "fe-b")
    send(a, p.LoraUpdate("c1", "sql", "/slow-copy"))
    assert harness.engine.copying.wait(10)  # (after the folder's read on its thread: a loaded machine's 0.1 s was
    send(b, p.Add("r", [1, 2, 3], p.SamplingParams(max_tokens=3)))  # not always enough, and the Add came first)
    assert recv(a).loras == [["sql", "/slow-copy"]] and recv(a).status == 200
    assert recv(b).loras == [["sql", "/slow-copy"]]
    assert collect(b, {"r"}, timeout=2)[2] == {"r": "length"}


def test_request_error_becomes_error_frame(harness):
    c = harness.client(b"fe0")
    hello(c, "fe0")
    send(c, p.Add("long", list(range(60)), p.SamplingParams(max_tokens=10)))
    assert recv(c) == p.Error("long", 400, "invalid_request_error", "too long", "max_tokens")
    send(c, p.Add("explode", [1], p.SamplingParams()))
    err = recv(c)
    assert (err.request_id, err.status, err.type) == ("explode", 500, "internal_server_error")
    assert not harness.actor._owner


def test_queue_full_is_429(address):
    h = ActorHarness(address, start_after=100, max_waiting=2)
    try:
        c = h.client(b"fe0")
        hello(c, "fe0")
        for rid in ("a", "b", "c"):
            send(c, p.Add(rid, [1], p.SamplingParams()))
        err = recv(c)
        assert (err.request_id, err.status, err.type) == ("c", 429, "rate_limit_error")
    finally:
        h.close()


def test_duplicate_request_id_is_refused(address):
    h = ActorHarness(address, start_after=100)
    try:
        c = h.client(b"fe0")
        hello(c, "fe0")
        send(c, p.Add("a", [1], p.SamplingParams()))
        send(c, p.Add("a", [1], p.SamplingParams()))
        err = recv(c)
        assert (err.request_id, err.status) == ("a", 400)
        assert h.engine.added == ["0:a"]
    finally:
        h.close()


def test_abort_stops_a_request(address):
    h = ActorHarness(address, start_after=2, step_delay=0.01)
    try:
        c = h.client(b"fe0")
        hello(c, "fe0")
        send(c, p.Add("long", [1], p.SamplingParams(max_tokens=60)))
        send(c, p.Add("short", [2], p.SamplingParams(max_tokens=3)))
        first = recv(c)
        assert {d.request_id for d in first} == {"long", "short"}
        send(c, p.Abort(["long", "never-existed"]))
        deadline = time.monotonic() + 5
        while h.engine.aborted != ["0:long"]:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        while c.poll(200):  # whatever was in flight; then silence
            c.recv()
        recv_none(c)
        assert not h.actor._owner and not h.engine.running
    finally:
        h.close()


def test_stats_request_gets_stats(address):
    h = ActorHarness(address, start_after=100)
    try:
        c = h.client(b"fe0")
        hello(c, "fe0")
        send(c, p.Add("a", [1], p.SamplingParams()))
        c.send(msgpack.packb([int(p.Kind.STATS), []]))
        assert recv(c, stats=True) == p.Stats(0, 1, 0.01, 99, 100)
    finally:
        h.close()


def test_a_step_that_may_be_long_is_said_as_it_begins_and_taken_back_after(harness):
    """Before a step with prompt tokens that may take over SAY_STEP_S (its prompt tokens at the most seconds a prompt
    token took lately; a first one, before any was measured: inf), every frontend hears that time (``Stats.step_s``),
    and a STATS once the step has ended takes it back. Under asynchronous scheduling it is said again after the
    outputs of the step in flight (on a GPU the new step runs on after them)."""
    a, b = harness.client(b"fe-a"), harness.client(b"fe-b")
    hello(a, "fe-a")
    hello(b, "fe-b")

    def one(rid, prompt_len, n=1):  # every frame fe-a gets for the request: "said" (and what), "out", "stats"
        send(a, p.Add(rid, list(range(1, prompt_len + 1)), p.SamplingParams(max_tokens=n)))
        frames = []
        while sum(isinstance(f, p.Outputs) for f in frames) < n:
            frames.append(recv(a, stats=True))
        while a.poll(200):  # (an unasked load STATS as it leaves, or the word said after the outputs)
            frames.append(p.decode(a.recv()))
        return [("said", f.step_s) if isinstance(f, p.Stats) and f.step_s else "stats" if isinstance(f, p.Stats)
                else "out" for f in frames]

    def said(frames):
        return [f for f in frames if f[0] == "said"]

    first = one("first", 10)  # (the process's first step is not measured: nothing known yet)
    assert said(first) == [("said", math.inf)] and first.index(("said", math.inf)) < first.index("out")
    assert said(one("second", 10)) == [("said", math.inf)]
    assert said(one("quick", 60)) == []  # (60 tokens at a quick step's rate: far under a second)
    harness.engine.step_delay = 0.2
    assert said(one("slow", 10)) == []  # (10 tokens, 0.02 s a token: 0.2 s)
    harness.engine.step_delay = 0.01
    frames = one("long", 60, n=2)  # 60 tokens at 0.02 s: 1.2 s, said; then taken back before the next step's
    (step_s,) = [s for _, s in said(frames)]
    assert 1.2 <= step_s < 1.5 and frames.index(("said", step_s)) < frames.index("out")
    assert "stats" in frames[frames.index("out"):frames.index("out", frames.index("out") + 1)], frames
    heard = [m.step_s for m in iter(lambda: recv(b, 0.5, stats=True) if b.poll(100) else None, None) if m.step_s]
    assert heard == [math.inf, math.inf, step_s]  # (fe-b heard them too)
    harness.engine.async_scheduling = True
    frames = one("async", 60)
    assert [f if f == "out" else f[0] for f in frames if f != "stats"] == ["said", "out", "said"], frames


def test_every_frontend_hears_the_engines_load_as_requests_come_and_go(address):
    """Unasked STATS, at most every ``LOAD_S``, to every frontend: each ranks the engines by their load (the other
    frontends' requests too), which it heard of only at its liveness pings (every 2 s)."""
    h = ActorHarness(address, step_delay=0.01, max_waiting=100)
    try:
        a, b = h.client(b"fe0"), h.client(b"fe1")
        hello(a, "fe0")
        hello(b, "fe1")
        for _ in range(2):  # (steps measured quick: none is said to be long, a STATS of its own, here)
            h.actor.prompt_rate.observe(1, 0.0)
        t0 = time.monotonic()
        for i in range(20):  # (as fast as they go)
            send(a, p.Add(f"r{i}", [1], p.SamplingParams(max_tokens=30)))
        seen = []
        while not seen or seen[-1][1].num_running:
            seen.append((time.monotonic() - t0, recv(b, stats=True)))
        assert all(isinstance(m, p.Stats) for _, m in seen)  # (b runs nothing: no outputs)
        assert seen[0][0] < 0.3 and seen[0][1].num_running >= 1  # (at once)
        assert max(m.num_running for _, m in seen) == 20
        assert len(seen) <= (seen[-1][0] / server.LOAD_S) + 2  # (not one a request)
        assert not b.poll(300)  # (and none while it stays)
        # one request leaving as another comes: the number stays, the frontends' shares do not (review S)
        send(a, p.Add("long", [1], p.SamplingParams(max_tokens=60)))
        assert recv(b, stats=True).num_running == 1
        assert not b.poll(300)
        send(a, p.Abort(["long"]))
        send(a, p.Add("next", [1], p.SamplingParams(max_tokens=60)))
        assert recv(b, 1.0, stats=True).num_running == 1
        # a frontend not heard from for ALIVE_S is told nothing (a remote engine meets a new one at each restart)
        c = h.client(b"fe2")
        hello(c, "fe2")
        h.actor._heard[b"fe2"] -= server.ALIVE_S
        send(a, p.Abort(["next"]))
        assert recv(b, stats=True).num_running == 0
        assert not c.poll(300) and b"fe2" not in h.actor._heard
    finally:
        h.close()


def test_malformed_frames_are_dropped_not_fatal(harness):
    c = harness.client(b"fe0")
    for junk in (b"", b"\xc1", msgpack.packb([3, ["r", "not tokens", {}, 0, None]]), msgpack.packb([99, []]),
                 p.encode(p.Ready("m", 1, 1, [], 1, 1, 1)), p.encode(p.Outputs([]))):
        c.send(junk)
    c.send_multipart([b"", b"two", b"parts"])
    recv_none(c)
    hello(c, "fe0")  # still serving
    send(c, p.Add("a", [4], p.SamplingParams(max_tokens=2)))
    assert collect(c, {"a"})[1]["a"] == expected_tokens([4], 2)


def test_protocol_version_mismatch_is_refused(harness):
    c = harness.client(b"fe0")
    send(c, p.Hello("fe0", version=999))
    err = recv(c)
    assert isinstance(err, p.Error) and err.request_id is None and "version" in err.message


def test_reconnecting_frontend_orphans_are_aborted(address):
    h = ActorHarness(address, start_after=100)
    try:
        old = h.client(b"fe0")
        hello(old, "fe0")
        send(old, p.Add("a", [1], p.SamplingParams()))
        send(old, p.Add("b", [1], p.SamplingParams()))
        old.send(msgpack.packb([int(p.Kind.STATS), []]))
        while recv(old, stats=True).num_running != 2:  # (the answer; one sent unasked may come first)
            pass
        old.close()
        new = h.client(b"fe0")  # a restarted frontend keeps its identity
        hello(new, "fe0")
        assert sorted(h.engine.aborted) == ["0:a", "0:b"]
        assert not h.actor._owner
    finally:
        h.close()


def test_stop_fails_outstanding_requests_with_503(address):
    h = ActorHarness(address, start_after=100)
    c = h.client(b"fe0")
    hello(c, "fe0")
    send(c, p.Add("a", [1], p.SamplingParams()))
    c.send(msgpack.packb([int(p.Kind.STATS), []]))
    recv(c, stats=True)
    h.actor.stop()
    h.thread.join(5)
    assert not h.thread.is_alive()
    err = recv(c)
    assert (err.request_id, err.status) == ("a", 503)
    h.close()


def test_step_failure_fails_requests_and_raises(address):
    h = ActorHarness(address, fail_on_step=2)
    c = h.client(b"fe0")
    hello(c, "fe0")
    send(c, p.Add("a", [1], p.SamplingParams(max_tokens=10)))
    assert isinstance(recv(c), p.Outputs)
    err = recv(c)
    assert (err.request_id, err.status, err.type) == ("a", 500, "internal_server_error")
    h.thread.join(5)
    assert isinstance(h.error, RuntimeError)
    h.close()


def _serve_fake(address: str, conn, stacks: str) -> None:
    # As a foreground process gets it: a child inherits what its parent holds when it is made, and in each of three
    # full runs of the suite (2026-12-07) this one had SIGINT ignored (SIGQUIT too; /proc's SigIgn 0x1001006; the
    # culprit in the test process not found), which the engine respects (as a shell's background job would want)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    import faulthandler  # SIGUSR1 writes every thread's stack to ``stacks`` (a test's view of a hung engine)

    faulthandler.register(signal.SIGUSR1, file=open(stacks, "w"), all_threads=True)
    run_engine(EngineConfig(), address, ready=lambda: conn.send("ready"), engine_factory=FakeEngine)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_process_exits_cleanly_on_signal(address, sig, tmp_path):
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe(duplex=False)
    stacks = tmp_path / "stacks.txt"
    proc = ctx.Process(target=_serve_fake, args=(address, child, str(stacks)))
    proc.start()
    child.close()
    zctx = zmq.Context()
    try:
        assert parent.poll(30) and parent.recv() == "ready"
        c = zctx.socket(zmq.DEALER)
        c.setsockopt(zmq.IDENTITY, b"fe0")
        c.setsockopt(zmq.LINGER, 0)
        c.connect(address)
        hello(c, "fe0")
        os.kill(proc.pid, sig)
        proc.join(10)
        if proc.exitcode is None:  # (seen once in a full run, never alone: what was it doing?)
            with open(f"/proc/{proc.pid}/status") as f:  # blocked, ignored, caught, pending (SIGINT is 0x2)
                masks = "".join(line for line in f if line.startswith(("Sig", "ShdPnd")))
            os.kill(proc.pid, signal.SIGUSR1)
            time.sleep(1)
            raise AssertionError(f"the engine is still up 10 s after signal {sig}:\n{masks}{stacks.read_text()}")
        assert proc.exitcode == 0
    finally:
        # (left to the GC, a context in a cycle with its socket (a failed test's frame) would hang in term())
        zctx.destroy(linger=0)
        if proc.is_alive():
            proc.kill()
            proc.join()
