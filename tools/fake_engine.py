"""A fake engine for frontend tests and benchmarks, and helpers to start real frontend processes.

The fake engine is a ZMQ ROUTER in a thread: it answers HELLO with READY and,
for each ADD, "generates" the prompt's own tokens again (cyclically) until
max_tokens or a stop token id, ``tokens_per_step`` tokens per request per step
(sleeping ``step_delay`` seconds after each step), all of one frontend's deltas
in one OUTPUTS message. A request whose ``Add.deadline`` has passed ends at its
next step with an empty delta and finish_reason "timeout", as the real engine's
does (so a deadline shorter than the generation gives part of it, one already
past gives no token). With ``fail_after`` set, a request that has produced that
many tokens ends at its next step with an empty delta and finish_reason "error",
as the real engine ends one it cannot run (out of memory; a request with structured output: its
grammar cost too much to follow, the reason in stop_reason). An embedding request (``Add.pooling``)
ends at its first step with a vector of ``EMBEDDING_DIMS`` floats (or its ``dimensions``) made
from its prompt, and no token. It records ADDs and
ABORTs so tests can assert what the frontend told the engine. No torch, no
model: the frontend is all that is measured.

Prefix caching is simulated (``PrefixCache``) so that ``num_cached_tokens`` means
something: a request's first delta reports the prompt tokens an engine with
prefix caching would have found cached, that is its longest common prefix with
earlier prompts of the same ``cache_salt`` (cached as soon as their ADD came), in
whole blocks of ``BLOCK_SIZE``, never the last prompt token (the engine computes
it for its logits). STATS carry
the hit rate since start (cached / prompt tokens), the cached blocks evicted
(least recently used past ``NUM_KV_BLOCKS``) and the fragmentation of the running
requests' blocks (empty slots in their last block / allocated slots); kv_usage
and free blocks stay fixed at 0.1 and 900.

Imported as ``tools.fake_engine`` from the repository root (tests run there;
``tools/bench_frontend.py`` puts the root on ``sys.path`` when run as a script).
"""

from __future__ import annotations

import contextlib
import os
import socket
import struct
import subprocess
import sys
import threading
import time
from collections import OrderedDict
from collections.abc import Iterator

import zmq

from engine.protocol import (
    Abort,
    Add,
    Delta,
    Error,
    Hello,
    LoraUpdate,
    Outputs,
    PrefixCacheReset,
    Ready,
    Stats,
    decode,
    encode,
)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KEY = "sk-test-key"
MODEL = "smol"
MAX_MODEL_LEN = 512
VOCAB = 49152
NUM_KV_BLOCKS = 1000  # what READY and STATS announce, and the simulated prefix cache's capacity
BLOCK_SIZE = 16
EMBEDDING_DIMS = 1024  # an embedding's floats, as Qwen3-Embedding-0.6B's


def fake_embedding(prompt: list[int], dims: int) -> bytes:
    """A vector of ``dims`` float32s that depends on ``prompt`` (not normalized: nothing checks it)."""
    return struct.pack(f"<{dims}f", *((prompt[i % len(prompt)] % 97) / 97 for i in range(dims)))


class PrefixCache:
    """Which whole prompt blocks an engine with prefix caching would find cached; no KV, only keys.

    A block's key is a hash chained over the salt and every token up to the block's end, as the real
    block manager's, so equal keys mean an equal prefix. Blocks are kept least recently used first,
    a prompt's tail before its prefix, up to ``num_blocks``; older ones are evicted (and counted).
    """

    def __init__(self, num_blocks: int = NUM_KV_BLOCKS, block_size: int = BLOCK_SIZE) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.reset()

    def reset(self) -> None:
        self.blocks: OrderedDict[int, None] = OrderedDict()
        self.num_evictions = 0
        self.num_prompt_tokens = 0  # since start (or reset): the hit rate's denominator
        self.num_cached_tokens = 0

    def admit(self, prompt: list[int], salt: str = "") -> int:
        """Cache ``prompt``'s whole blocks; return how many of its tokens were cached already."""
        bs = self.block_size
        keys, h = [], hash(salt)
        for end in range(bs, len(prompt) + 1, bs):
            h = hash((h, tuple(prompt[end - bs:end])))
            keys.append(h)
        hit = 0
        while hit < len(keys) and keys[hit] in self.blocks:
            hit += 1
        cached = min(hit * bs, (len(prompt) - 1) // bs * bs)  # the last token is always computed
        for k in reversed(keys):  # the prefix ends up most recently used: the tail is evicted first
            self.blocks[k] = None
            self.blocks.move_to_end(k)
        while len(self.blocks) > self.num_blocks:
            self.blocks.popitem(last=False)
            self.num_evictions += 1
        self.num_prompt_tokens += len(prompt)
        self.num_cached_tokens += cached
        return cached

    @property
    def hit_rate(self) -> float:
        return self.num_cached_tokens / self.num_prompt_tokens if self.num_prompt_tokens else 0.0


class FakeEngine(threading.Thread):
    """A ZMQ ROUTER in a thread that speaks the engine side of ``engine/protocol.py``."""

    def __init__(self, address: str, step_delay: float = 0.0, tokens_per_step: int = 1) -> None:
        super().__init__(daemon=True)
        self.address = address
        self.step_delay = step_delay
        self.tokens_per_step = tokens_per_step
        self.alternatives = 2  # a token's top logprobs: at most this many (a benchmark's: as many as asked)
        self.refuse: Error | None = None  # answer every ADD with this error
        self.room: int | None = None  # new work taken before the waiting queue counts as full: later ADDs get
        # a 429, but for those marked ``admitted`` (a beam search's later rounds), as the real scheduler does
        self.loras: list[list[str]] = []  # the LoRA adapters its READY names ([name, path]); LORA updates change it
        self.lora_refusal: str | None = None  # answer every LoRA load with this (a 400); unloads still work
        self.max_loras = 0  # what READY announces: LoRA slots (0: none loaded while serving)
        self.adds: list[Add] = []
        self.aborts: list[str] = []
        self.running: dict[str, list] = {}  # request id -> [identity, Add, produced, cached prompt tokens]
        self.prefix_cache = PrefixCache()
        self.num_stats = 0  # STATS requests received
        self.num_timeouts = 0  # requests ended by their deadline
        self.num_preemptions = 0  # reported in STATS as is (nothing is ever preempted here)
        self.max_num_waiting_requests = 1024  # what READY announces
        self.request_timeout: float | None = None  # and this: the server's --request-timeout
        self.vocab_size = VOCAB  # and this: the model's vocabulary
        self.fail_after: int | None = None  # end every request with "error" once it has this many tokens
        self.fail_reason = "its grammar cost too much"  # ... the stop_reason of one with structured output
        self.mute = False  # a hung engine: it reads (and records) frames but answers nothing and never steps
        self.lost_hellos = 0  # HELLOs to drop, as if they never came
        self.hello_refusal: str | None = None  # answer every HELLO with this error (a protocol version mismatch)
        self.hellos = 0  # HELLOs received
        self._halt = threading.Event()
        self.bound = threading.Event()

    def start(self) -> None:
        """Start the thread and return once the socket is bound, so a frontend can connect at once."""
        super().start()
        self.bound.wait(5)

    def run(self) -> None:
        ctx = zmq.Context()
        sock = ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        # as the real engine: a frontend that reconnects under its identity before its old connection is gone
        # takes it over (without this, the new connection is never read and its HELLO waits for nothing)
        sock.setsockopt(zmq.ROUTER_HANDOVER, 1)
        sock.bind(self.address)
        self.bound.set()
        while not self._halt.is_set():
            timeout = 0 if self.running and not self.mute else 20
            while sock.poll(timeout):
                timeout = 0
                ident, frame = sock.recv_multipart()
                self.handle(sock, ident, decode(frame))
            if self.running and not self.mute:
                self.step(sock)
                if self.step_delay:
                    time.sleep(self.step_delay)
        sock.close(0)
        ctx.term()

    def handle(self, sock, ident: bytes, msg) -> None:
        if isinstance(msg, Hello):
            self.hellos += 1
        if isinstance(msg, Hello) and self.lost_hellos:  # (one sent as its connection was still being made)
            self.lost_hellos -= 1
        elif isinstance(msg, Hello) and self.hello_refusal is not None:
            sock.send_multipart([ident, encode(Error(None, 500, "internal_server_error", self.hello_refusal))])
        elif isinstance(msg, Hello):
            sock.send_multipart([ident, encode(self.ready())])
        elif isinstance(msg, LoraUpdate):
            status, message = 200, ""
            if msg.path is None and msg.name not in dict(self.loras):
                status, message = 404, f"The LoRA adapter '{msg.name}' is not loaded"
            elif msg.path is not None and self.lora_refusal:
                status, message = 400, self.lora_refusal
            else:
                self.loras = [a for a in self.loras if a[0] != msg.name] + ([[msg.name, msg.path]] if msg.path else [])
                sock.send_multipart([ident, encode(self.ready())])
            sock.send_multipart([ident, encode(LoraUpdate(msg.call_id, msg.name, msg.path, status, message))])
        elif isinstance(msg, PrefixCacheReset):  # (forgotten when nothing runs, as the real block manager does)
            if not self.running:
                self.prefix_cache.blocks.clear()
            sock.send_multipart([ident, encode(PrefixCacheReset(msg.call_id, 200, not self.running))])
        elif isinstance(msg, Add):
            self.adds.append(msg)
            full = False
            if self.room is not None and not msg.admitted:
                full = self.room <= 0
                self.room -= 1
            if self.refuse is not None or full:
                err = self.refuse or Error("", 429, "rate_limit_error", "server busy: the waiting queue is full")
                sock.send_multipart([ident, encode(Error(msg.request_id, err.status, err.type, err.message))])
            else:
                cached = self.prefix_cache.admit(msg.prompt_token_ids, msg.cache_salt)
                self.running[msg.request_id] = [ident, msg, 0, cached]
        elif isinstance(msg, Abort):
            self.aborts.extend(msg.request_ids)
            for rid in msg.request_ids:
                self.running.pop(rid, None)
        elif isinstance(msg, Stats):
            self.num_stats += 1
            if not self.mute:
                pc = self.prefix_cache
                stats = Stats(0, len(self.running), 0.1, 900, NUM_KV_BLOCKS, self.num_preemptions,
                              self.num_timeouts, pc.hit_rate, pc.num_evictions, self.kv_fragmentation())
                sock.send_multipart([ident, encode(stats)])

    def ready(self) -> Ready:
        return Ready(MODEL, MAX_MODEL_LEN, self.vocab_size, [2], 64, NUM_KV_BLOCKS, BLOCK_SIZE,
                     self.max_num_waiting_requests, self.loras, self.max_loras, request_timeout=self.request_timeout)

    def kv_fragmentation(self) -> float:
        """Empty slots in the running requests' blocks / their allocated slots."""
        used = [len(add.prompt_token_ids) + produced for _, add, produced, _ in self.running.values()]
        allocated = sum(-(-u // BLOCK_SIZE) * BLOCK_SIZE for u in used)
        return (allocated - sum(used)) / allocated if allocated else 0.0

    def step(self, sock) -> None:
        by_ident: dict[bytes, list[Delta]] = {}
        now = time.time()
        for rid, entry in list(self.running.items()):
            ident, add, produced, cached = entry
            prompt, p = add.prompt_token_ids, add.params
            timed_out = add.deadline is not None and now >= add.deadline
            if add.pooling is not None and not timed_out:
                del self.running[rid]
                by_ident.setdefault(ident, []).append(
                    Delta(rid, [], "stop", num_prompt_tokens=len(prompt), num_cached_tokens=cached,
                          embedding=fake_embedding(prompt, add.pooling.dimensions or EMBEDDING_DIMS)))
                continue
            if timed_out or (self.fail_after is not None and produced >= self.fail_after):
                del self.running[rid]
                self.num_timeouts += timed_out
                by_ident.setdefault(ident, []).append(
                    Delta(rid, [], "timeout" if timed_out else "error",
                          num_prompt_tokens=len(prompt) if produced == 0 else 0,
                          num_cached_tokens=cached if produced == 0 else 0,
                          stop_reason=None if timed_out or not p.structured else self.fail_reason))
                continue
            toks, lps, finish, stop_reason = [], [], None, None
            for _ in range(self.tokens_per_step):
                t = prompt[(produced + len(toks)) % len(prompt)]
                toks.append(t)
                top = min(max(p.logprobs or 0, 1), self.alternatives)
                lps.append([-0.5, [[(t + j) % VOCAB, -0.5 - j] for j in range(top)]])
                if t in p.stop_token_ids:
                    finish, stop_reason = "stop", t  # (the stop token's id, as the engine says it)
                    break
                if produced + len(toks) >= p.max_tokens:
                    finish = "length"
                    break
            d = Delta(rid, toks, finish, lps if p.logprobs is not None else None, stop_reason=stop_reason)
            if produced == 0:
                d.num_prompt_tokens, d.num_cached_tokens = len(prompt), cached
                if p.prompt_logprobs is not None:
                    d.prompt_logprobs = [None] + [[-1.0, [[t, -1.0]]] for t in prompt[1:]]
            entry[2] = produced + len(toks)
            if finish:
                del self.running[rid]
            by_ident.setdefault(ident, []).append(d)
        for ident, deltas in by_ident.items():
            sock.send_multipart([ident, encode(Outputs.of(deltas))])

    def stop(self) -> None:
        self._halt.set()
        self.join(5)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_frontend(engine_address: str, tokenizer_dir: str, port: int, api_keys=(KEY,),
                   frontend_id: str = "fe-test", env: dict | None = None, stderr=None,
                   **extra) -> subprocess.Popen:
    """A frontend process (``run_frontend``, as the launcher starts it); returns once it printed READY.

    ``env``: variables to add (``PROMETHEUS_MULTIPROC_DIR`` for frontends that share metrics);
    ``stderr``: where its log goes (default: this process's stderr)."""
    code = (
        "import sys; from frontends.server import FrontendArgs, run_frontend\n"
        "from frontends.http import HttpConfig  # for an http= override (its repr)\n"
        f"args = FrontendArgs(engine_address={engine_address!r}, tokenizer_path={tokenizer_dir!r}, "
        f"served_model_name={MODEL!r}, host='127.0.0.1', port={port}, api_keys={list(api_keys)!r}, "
        f"frontend_id={frontend_id!r}, **{extra!r})\n"
        "run_frontend(args, ready=lambda: print('READY', flush=True))\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, stdout=subprocess.PIPE, text=True,
                            env={**os.environ, **(env or {})}, stderr=stderr)
    line = proc.stdout.readline()
    assert line.strip() == "READY", f"frontend did not start: {line!r}"
    return proc


@contextlib.contextmanager
def fake_stack(sock_dir: str, tokenizer_dir: str, step_delay: float = 0.0, **frontend_kw) -> Iterator[tuple]:
    """A fake engine with one frontend process before it (``start_frontend``'s keywords): yields
    (engine, port); the frontend must then shut down cleanly (exit status 0)."""
    addr = f"ipc://{sock_dir}/engine.sock"
    engine = FakeEngine(addr, step_delay=step_delay)
    engine.start()
    try:
        port = free_port()
        proc = start_frontend(addr, tokenizer_dir, port, **frontend_kw)
        try:
            yield engine, port
        except BaseException:
            stop_frontend(proc)  # (a failing test leaves no frontend behind)
            raise
        assert stop_frontend(proc) == 0
    finally:
        engine.stop()


def stop_frontend(proc: subprocess.Popen) -> int:
    """SIGTERM, then the exit status (0 after a graceful shutdown)."""
    proc.terminate()
    return proc.wait(15)
