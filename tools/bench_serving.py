"""Benchmark an OpenAI-compatible server, in the manner of ``vllm bench serve``.

Sends ``--num-prompts`` streaming requests with random prompts of
``--input-len`` tokens asking for ``--output-len`` tokens (``ignore_eos``, so
every request generates exactly that many), either at a Poisson
``--request-rate`` or all at once, capped by ``--max-concurrency``. Reports
request and token throughput, TTFT (time to first token), TPOT (time per output
token after the first), ITL (gap between streamed chunks) and end-to-end latency
(mean, p50, p90, p99), and goodput under ``--slo-ttft-ms`` / ``--slo-tpot-ms``.
Prints a table, then one JSON line (also written to ``--save-json``). ``--endpoint`` picks
``/v1/completions`` (the default), ``/v1/chat/completions`` (``chat``), or another server's own API:
llama.cpp's ``/completion`` (``llamacpp``), TGI's ``/generate_stream`` (``tgi``), Ollama's ``/api/generate``
(``ollama``, raw), each read as its own events with the openai package's HTTP client rather than the
openai client itself (compare them with the others on prompts of different ``--seed``s: the same
prompts again are prefix-cache hits).

``--workload`` shapes the requests. ``random`` (the default) is the above:

    python tools/bench_serving.py --base-url http://127.0.0.1:8000/v1 \\
        --num-prompts 200 --input-len 256 --output-len 64 --max-concurrency 32

``mixed`` asks whether a few long prompts stall the streams already running.
The requests above are the "short" class; ``--num-long`` "long" requests of
``--long-input-len`` tokens asking for ``--long-output-len`` go out while they
stream: the first ``--long-delay`` seconds after the start, then one every
``--long-interval`` seconds, outside ``--max-concurrency``. Compare the short
class's ITL and TPOT with a baseline run at ``--num-long 0`` (a warning says
when a long request went out with no short one in flight):

    python tools/bench_serving.py --workload mixed --num-prompts 64 --input-len 128 \\
        --output-len 256 --max-concurrency 16 --num-long 3 --long-input-len 1800

``edit``: each request asks to rewrite a short piece of Python (one of a few, its names random words)
with one name changed, so that the answer repeats most of the prompt (``--input-len`` is unused):
what speculative decoding's n-gram lookup (``--speculative-config``) is for. Compare a server with
and without it, chat endpoint, stopping at EOS (both give the same greedy text):

    python tools/bench_serving.py --workload edit --endpoint chat --no-ignore-eos \\
        --num-prompts 16 --output-len 256 --max-concurrency 4

``two-priority``: ``--urgent-fraction`` of the requests (picked from ``--seed``,
spread evenly through the sequence) send ``"priority": --urgent-priority``, the
rest ``--normal-priority`` (lower runs first), as classes "urgent" and
"normal". Priority only reorders the server's queue, so send more at once than
it runs (no ``--max-concurrency``, or one above its batch size):

    python tools/bench_serving.py --workload two-priority --num-prompts 200 \\
        --input-len 256 --output-len 64 --urgent-fraction 0.1

``two-client``: one client (``"user": "flood"``) sends the ``--num-prompts``
requests at once, as class "flood"; another (``"user": "light"``) sends
``--num-light`` requests asking for ``--light-output-len`` tokens, the first
``--light-delay`` seconds after the start, then one every ``--light-interval``
seconds, as class "light": how long the flood keeps the light client waiting
(compare ``--scheduling-policy fcfs`` with ``fair``; from one machine, ``--fair-client user``):

    python tools/bench_serving.py --workload two-client --num-prompts 48 \
        --input-len 64 --output-len 64 --num-light 6 --light-output-len 16

The JSON names the workload (``workload``, ``workload_params``); for ``mixed``,
``two-priority`` and ``two-client`` its ``classes`` key has, per class, the same metrics as the
overall run, computed from that class's requests only (throughputs over the
whole run's duration), and the table a section per class.

Prompts are random token ids decoded with ``--tokenizer`` (a model folder or
.gguf file) when given, else random common English words (about one token each).
Token counts come from the server's ``usage`` when it sends it.

Pictures (matplotlib, ``tools/bench_plot.py``): ``--plot run.png`` draws this
run's TTFT and ITL distributions and output tokens/s over time. ``--save-json``
keeps, besides the JSON line's figures, every request's timings (``requests``),
so that ``--compare a.json b.json [--plot cmp.png]`` can draw saved runs side by
side without running anything (default file: compare.png)::

    python tools/bench_serving.py --num-prompts 200 --save-json before.json --plot before.png
    python tools/bench_serving.py --compare before.json after.json --plot before_after.png
"""

from __future__ import annotations

import argparse
import asyncio
import json
import keyword
import math
import os
import random
import statistics
import sys
import time
from dataclasses import dataclass, field

WORDS = (
    "the of and to in is was for on are with as at by be this from have or one had not but what all were "
    "when we there can an your which their said if do will each about how up out them then she many some "
    "so these would other into has more her two like him see time could no make than first been its who "
    "now people my made over did down only way find use may water long little very after words called just "
    "where most know get through back much go good new write our me man too any day same right look think "
    "also around another came come work three word must because does part even place well such here take "
    "why things help put years different away again off went old number great tell men say small every "
    "found still between name should home big give air line set own under read last never us left end "
    "along while might next sound below saw something thought both few those always looked show large often "
    "together asked house world going want school important until form food keep children feet land side "
    "without boy once animals life enough took sometimes four head above kind began almost live page got "
    "earth need far hand high year mother light parts country father let night following picture being study "
    "second eyes soon times story boys since white days ever paper hard near sentence better best across "
    "during today others however sure means knew try told young miles sun ways thing whole hear example heard "
    "several change answer room sea against top turned learn point city play toward five using himself usually"
).split()


WORKLOADS = ("random", "mixed", "two-priority", "two-client", "edit")
CLASSES = {"random": (), "mixed": ("short", "long"), "two-priority": ("urgent", "normal"),  # report order
           "two-client": ("light", "flood"), "edit": ()}

# the edit workload's code, its names filled from WORDS: a function whose answer repeats it nearly whole
EDIT_CODE = (
    "def {f}({a}, {b}):\n    {c} = []\n    for {d} in {a}:\n        if {d} in {b}:\n            {c}.append({d})\n"
    "        else:\n            {c}.append(None)\n    return {c}\n\n\ndef {e}({a}):\n    return len({f}({a}, {a}))\n",
    "class {F}:\n    def __init__(self, {a}, {b}):\n        self.{a} = {a}\n        self.{b} = {b}\n\n"
    "    def {f}(self):\n        return self.{a} + self.{b}\n\n    def {e}(self, {c}):\n"
    "        return {F}(self.{a} * {c}, self.{b} * {c})\n",
    "def {f}({a}):\n    {b} = {{}}\n    for {c} in {a}:\n        {b}[{c}] = {b}.get({c}, 0) + 1\n"
    "    {d} = sorted({b}.items(), key=lambda {e}: {e}[1], reverse=True)\n    return [{c} for {c}, _ in {d}]\n",
)


@dataclass
class Job:
    """One request to send: its prompt, the tokens it asks for, its class and priority."""

    prompt: str
    est_tokens: int
    max_tokens: int
    cls: str = ""
    priority: int | None = None  # sent in the body when set
    at: float | None = None  # send this many seconds after the start, outside --max-concurrency; None: in turn
    user: str | None = None  # sent in the body when set: who asks (--scheduling-policy fair's client)


@dataclass
class RequestResult:
    ok: bool = False
    error: str = ""
    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft: float = 0.0  # seconds
    e2el: float = 0.0
    itl: list[float] = field(default_factory=list)
    start: float = 0.0  # perf_counter() when the request went out
    chunks: int = 0  # streamed chunks that carried text
    last: float = 0.0  # when the latest of them arrived
    cls: str = ""  # the Job's class
    in_flight: int = 0  # timed (Job.at) requests: in-turn ones not yet finished when it went out

    @property
    def tpot(self) -> float | None:
        if self.output_tokens < 2:
            return None
        return (self.e2el - self.ttft) / (self.output_tokens - 1)

    def got_chunk(self, now: float) -> None:
        """The first text chunk sets TTFT; each later one adds an ITL gap."""
        if self.chunks == 0:
            self.ttft = now - self.start
        else:
            self.itl.append(now - self.last)
        self.chunks += 1
        self.last = now

    def finish(self, error: Exception | None = None) -> None:
        """End-to-end latency, and ok only if text was streamed and nothing failed."""
        self.e2el = time.perf_counter() - self.start
        self.ok = error is None and self.chunks > 0
        if error is not None:
            self.error = f"{type(error).__name__}: {error}"
        elif not self.ok:
            self.error = "no tokens streamed"


# ----------------------------------------------------------------------------- prompts


def load_tokenizer(path: str):
    from transformers import AutoTokenizer

    path = os.path.expanduser(path)
    if path.endswith(".gguf"):
        return AutoTokenizer.from_pretrained(os.path.dirname(path) or ".", gguf_file=os.path.basename(path))
    return AutoTokenizer.from_pretrained(path)


def make_prompts(n: int, input_len: int, rng: random.Random, tokenizer=None) -> list[tuple[str, int]]:
    """``n`` random prompts of about ``input_len`` tokens: (text, estimated tokens)."""
    prompts = []
    for _ in range(n):
        if tokenizer is not None:
            special = set(tokenizer.all_special_ids)
            ids = []
            while len(ids) < input_len:
                t = rng.randrange(tokenizer.vocab_size)
                if t not in special:
                    ids.append(t)
            text = tokenizer.decode(ids)
            prompts.append((text, len(tokenizer.encode(text, add_special_tokens=False))))
        else:
            prompts.append((" ".join(rng.choice(WORDS) for _ in range(input_len)), input_len))
    return prompts


def make_edit_prompts(n: int, rng: random.Random, tokenizer=None) -> list[tuple[str, int]]:
    """``n`` requests to rewrite a short piece of code with one name changed: an answer that repeats its
    prompt nearly whole, where speculative decoding's n-gram drafts are right (text, estimated tokens)."""
    prompts = []
    for _ in range(n):
        names = rng.sample([w for w in WORDS if len(w) > 3 and not keyword.iskeyword(w)], 7)
        code = rng.choice(EDIT_CODE).format(F=names[0].title(), f=names[0], a=names[1], b=names[2], c=names[3],
                                            d=names[4], e=names[5])
        text = (f"Rename {names[1]} to {names[6]} everywhere in this Python code. Reply with the whole new code "
                f"and nothing else.\n\n```python\n{code}```")
        prompts.append((text, len(tokenizer.encode(text, add_special_tokens=False)) if tokenizer else len(text) // 4))
    return prompts


def pick_urgent(n: int, fraction: float, rng: random.Random) -> set[int]:
    """``round(n * fraction)`` (at least one if ``fraction`` > 0) of ``range(n)``: one at random
    from each of that many equal stretches, so they are spread through the sequence."""
    m = min(n, max(1, round(n * fraction))) if fraction > 0 else 0
    return {rng.randrange(k * n // m, (k + 1) * n // m) for k in range(m)}


def make_jobs(args, rng: random.Random, tokenizer=None) -> list[Job]:
    """The requests of ``args.workload``, in-turn ones first, in the order they go out."""
    if args.workload == "edit":
        return [Job(p, n, args.output_len) for p, n in make_edit_prompts(args.num_prompts, rng, tokenizer)]
    prompts = make_prompts(args.num_prompts, args.input_len, rng, tokenizer)
    if args.workload == "mixed":
        longs = make_prompts(args.num_long, args.long_input_len, rng, tokenizer)
        return ([Job(p, n, args.output_len, "short") for p, n in prompts]
                + [Job(p, n, args.long_output_len, "long", at=args.long_delay + i * args.long_interval)
                   for i, (p, n) in enumerate(longs)])
    if args.workload == "two-priority":
        urgent = pick_urgent(args.num_prompts, args.urgent_fraction, random.Random(args.seed + 2))
        return [Job(p, n, args.output_len, "urgent", args.urgent_priority) if i in urgent
                else Job(p, n, args.output_len, "normal", args.normal_priority)
                for i, (p, n) in enumerate(prompts)]
    if args.workload == "two-client":
        lights = make_prompts(args.num_light, args.input_len, rng, tokenizer)
        return ([Job(p, n, args.output_len, "flood", user="flood") for p, n in prompts]
                + [Job(p, n, args.light_output_len, "light", at=args.light_delay + i * args.light_interval,
                       user="light") for i, (p, n) in enumerate(lights)])
    return [Job(p, n, args.output_len) for p, n in prompts]


# ----------------------------------------------------------------------------- requests


def extra_fields(args, job: Job) -> dict:
    """Body fields beyond the basics: ``ignore_eos``, ``priority``, and ``--logprobs`` in the endpoint's words."""
    extra: dict = {"ignore_eos": True} if args.ignore_eos else {}
    if job.priority is not None:
        extra["priority"] = job.priority
    if job.user is not None:
        extra["user"] = job.user
    if args.logprobs is not None:
        asked = {"logprobs": True, "top_logprobs": args.logprobs}
        extra |= {"chat": asked, "ollama": asked, "llamacpp": {"n_probs": args.logprobs},
                  "tgi": {"top_n_tokens": args.logprobs}}.get(args.endpoint, {"logprobs": args.logprobs})
    return extra


async def sse_request(client, args, job: Job) -> RequestResult:
    """One streaming request through the official client (Server-Sent Events)."""
    r = RequestResult(prompt_tokens=job.est_tokens, cls=job.cls)
    extra = extra_fields(args, job)
    common = dict(model=args.model, max_tokens=job.max_tokens, temperature=args.temperature, stream=True,
                  stream_options={"include_usage": True}, extra_body=extra or None)
    r.start = time.perf_counter()
    try:
        if args.endpoint == "chat":
            stream = await client.chat.completions.create(
                messages=[{"role": "user", "content": job.prompt}], **common)
        else:
            stream = await client.completions.create(prompt=job.prompt, **common)
        async for chunk in stream:
            now = time.perf_counter()
            if chunk.choices:
                c = chunk.choices[0]
                text = c.delta.content if args.endpoint == "chat" else c.text
                if text:
                    r.got_chunk(now)
            if getattr(chunk, "usage", None):
                r.prompt_tokens = chunk.usage.prompt_tokens
                r.output_tokens = chunk.usage.completion_tokens
        if not r.output_tokens:
            r.output_tokens = r.chunks  # no usage: one chunk is about one token
        r.finish()
    except Exception as e:  # noqa: BLE001 - a failed request is a result, not a crash
        r.finish(e)
    return r


def native_body(args, job: Job) -> tuple[str, dict]:
    """``--endpoint llamacpp | tgi | ollama``: the path and streamed body of another server's own API."""
    extra = extra_fields(args, job)
    if args.endpoint == "llamacpp":
        return "/completion", {"prompt": job.prompt, "n_predict": job.max_tokens, "temperature": args.temperature,
                               "stream": True, **extra}
    if args.endpoint == "tgi":  # (greedy: no sampling parameter at all)
        sampling = {"do_sample": True, "temperature": args.temperature} if args.temperature > 0 else {}
        return "/generate_stream", {"inputs": job.prompt, "parameters": {
            "max_new_tokens": job.max_tokens, "details": True, **sampling, **extra}}
    return "/api/generate", {"model": args.model, "prompt": job.prompt, "raw": True, "stream": True, **extra,
                             "options": {"num_predict": job.max_tokens, "temperature": args.temperature}}


def native_event(args, line: str) -> tuple[bool, bool, int, int] | None:
    """One line of a native stream: (has text, last, prompt tokens, output tokens), or None (no event)."""
    if args.endpoint == "ollama":
        event = json.loads(line) if line else None
    elif line.startswith("data:"):
        event = json.loads(line[len("data:"):])
    else:
        return None
    if event is None:
        return None
    if "error" in event:
        raise RuntimeError(event["error"]["message"] if isinstance(event["error"], dict) else event["error"])
    if args.endpoint == "llamacpp":
        return bool(event["content"]) and not event["stop"], event["stop"], event.get(
            "tokens_evaluated", 0), event.get("tokens_predicted", 0)
    if args.endpoint == "tgi":
        details = event.get("details") or {}
        return bool(event["token"]["text"]), event["generated_text"] is not None, details.get(
            "input_length", 0), details.get("generated_tokens", 0)
    return bool(event.get("response")), event["done"], event.get("prompt_eval_count", 0), event.get("eval_count", 0)


async def native_request(client, args, job: Job) -> RequestResult:
    """``--endpoint llamacpp | tgi | ollama``: one streamed request to llama.cpp's ``/completion``, TGI's
    ``/generate_stream`` or Ollama's ``/api/generate`` (raw), each read as its own events."""
    r = RequestResult(prompt_tokens=job.est_tokens, cls=job.cls)
    base = args.base_url.rstrip("/")
    base = base[:-3] if base.endswith("/v1") else base
    path, body = native_body(args, job)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    r.start = time.perf_counter()
    try:
        async with args.http.stream("POST", base + path, json=body, headers=headers) as resp:
            if resp.status_code != 200:
                raise RuntimeError(f"HTTP {resp.status_code}: {(await resp.aread())[:200]!r}")
            async for line in resp.aiter_lines():
                got = native_event(args, line)
                if got is None:
                    continue
                text, last, prompt_tokens, output_tokens = got
                if text:
                    r.got_chunk(time.perf_counter())
                if last:
                    r.prompt_tokens, r.output_tokens = prompt_tokens or r.prompt_tokens, output_tokens
        r.finish()
    except Exception as e:  # noqa: BLE001 - a failed request is a result, not a crash
        r.finish(e)
    return r


class WsMux:
    """``--protocol ws``: requests multiplexed over ``--ws-connections`` sockets to ``/v1/stream``."""

    def __init__(self, args) -> None:
        base = args.base_url.rstrip("/")
        base = base[:-3] if base.endswith("/v1") else base
        self.url = "ws" + base[len("http"):] + "/v1/stream" if base.startswith("http") else base + "/v1/stream"
        self.headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
        self.size = max(1, args.ws_connections)
        self.conns: list = []
        self.queues: dict[str, asyncio.Queue] = {}
        self.readers: list[asyncio.Task] = []
        self.ids = iter(range(1 << 62))  # request ids
        self.turn = iter(range(1 << 62))  # round robin
        self.lock = asyncio.Lock()

    async def conn(self):
        """The next connection, round robin; opened on first use."""
        async with self.lock:
            if len(self.conns) < self.size:
                from websockets.asyncio.client import connect

                ws = await connect(self.url, additional_headers=self.headers, max_size=None)
                self.conns.append(ws)
                self.readers.append(asyncio.create_task(self._read(ws)))
                return ws
        return self.conns[next(self.turn) % self.size]

    async def _read(self, ws) -> None:
        try:
            async for raw in ws:
                now = time.perf_counter()
                msg = json.loads(raw)
                q = self.queues.get(msg.get("id"))
                if q is not None:
                    q.put_nowait((now, msg))
        except Exception:  # noqa: BLE001 - a dropped socket fails its requests below
            pass
        for q in self.queues.values():
            q.put_nowait((time.perf_counter(), {"type": "error", "error": {"message": "connection closed"}}))

    async def close(self) -> None:
        for ws in self.conns:
            await ws.close()
        for t in self.readers:
            t.cancel()


async def ws_request(client, args, job: Job) -> RequestResult:
    """One request over a shared WebSocket (``{"type": "completion" | "chat"}``, deltas until done)."""
    mux = args.__dict__.setdefault("ws_mux", WsMux(args))
    r = RequestResult(prompt_tokens=job.est_tokens, cls=job.cls)
    rid = f"r{next(mux.ids)}"
    req = {"type": "chat" if args.endpoint == "chat" else "completion", "id": rid, "model": args.model,
           "max_tokens": job.max_tokens, "temperature": args.temperature, **extra_fields(args, job)}
    if args.endpoint == "chat":
        req["messages"] = [{"role": "user", "content": job.prompt}]
    else:
        req["prompt"] = job.prompt
    q = mux.queues[rid] = asyncio.Queue()
    r.start = time.perf_counter()
    try:
        ws = await mux.conn()
        r.start = time.perf_counter()
        await ws.send(json.dumps(req))
        while True:
            now, msg = await asyncio.wait_for(q.get(), args.timeout)
            if msg["type"] == "delta":
                if msg["text"]:
                    r.got_chunk(now)
            elif msg["type"] == "done":
                r.prompt_tokens = msg["usage"]["prompt_tokens"]
                r.output_tokens = msg["usage"]["completion_tokens"]
                break
            else:
                raise RuntimeError(msg["error"]["message"])
        r.finish()
    except Exception as e:  # noqa: BLE001 - a failed request is a result, not a crash
        r.finish(e)
    finally:
        mux.queues.pop(rid, None)
    return r


PROTOCOLS = {"sse": sse_request, "ws": ws_request}


async def run_benchmark(args, jobs: list[Job]) -> tuple[list[RequestResult], float]:
    """Send ``jobs``: in-turn ones at ``--request-rate`` under ``--max-concurrency``, timed ones
    (``Job.at``) at their time regardless. Results come back in the order of ``jobs``."""
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=args.base_url, api_key=args.api_key or "none", timeout=args.timeout,
                         max_retries=0)
    if args.model is None:
        args.model = (await client.models.list()).data[0].id
    native = args.endpoint in ("llamacpp", "tgi", "ollama")
    send = native_request if native else PROTOCOLS[args.protocol]
    if native:
        try:  # the HTTP client the openai package brings (httpx, httpx2 in its later releases)
            import httpx
        except ImportError:
            import httpx2 as httpx
        args.http = httpx.AsyncClient(timeout=args.timeout, limits=httpx.Limits(max_connections=1000))
    sem = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else None
    rng = random.Random(args.seed + 1)
    done = 0
    pending = 0  # in-turn requests sent or waiting for --max-concurrency, not yet finished

    async def in_turn(job: Job) -> RequestResult:
        nonlocal pending
        try:
            if sem is None:
                res = await send(client, args, job)
            else:
                async with sem:
                    res = await send(client, args, job)
        finally:
            pending -= 1
        return progress(res)

    async def timed(job: Job) -> RequestResult:
        await asyncio.sleep(max(0.0, t0 + job.at - time.perf_counter()))
        busy = pending
        res = await send(client, args, job)
        res.in_flight = busy
        return progress(res)

    def progress(res: RequestResult) -> RequestResult:
        nonlocal done
        done += 1
        if not args.quiet and (done % max(1, len(jobs) // 10) == 0 or done == len(jobs)):
            print(f"  {done}/{len(jobs)} done", file=sys.stderr, flush=True)
        return res

    t0 = time.perf_counter()
    tasks: list[asyncio.Task | None] = [None] * len(jobs)
    for n, i in enumerate(i for i, job in enumerate(jobs) if job.at is None):
        if n and math.isfinite(args.request_rate):
            await asyncio.sleep(rng.expovariate(args.request_rate))
        pending += 1
        tasks[i] = asyncio.create_task(in_turn(jobs[i]))
        if n == 0:  # the clock for timed requests runs from the first in-turn one
            for k, job in enumerate(jobs):
                if job.at is not None:
                    tasks[k] = asyncio.create_task(timed(job))
    results = await asyncio.gather(*tasks)
    duration = time.perf_counter() - t0
    await client.close()
    if (http := getattr(args, "http", None)) is not None:
        await http.aclose()
    if (mux := getattr(args, "ws_mux", None)) is not None:
        await mux.close()
    return results, duration


# ----------------------------------------------------------------------------- report


def _dist(values: list[float], scale: float = 1000.0) -> dict[str, float]:
    if not values:
        return {"mean": 0.0, "median": 0.0, "std": 0.0, "p90": 0.0, "p99": 0.0}
    v = sorted(x * scale for x in values)

    def pct(q: float) -> float:  # linear interpolation, as numpy's default
        k = (len(v) - 1) * q
        lo, hi = math.floor(k), math.ceil(k)
        return v[lo] + (v[hi] - v[lo]) * (k - lo)

    return {"mean": statistics.fmean(v), "median": pct(0.5), "std": statistics.pstdev(v),
            "p90": pct(0.9), "p99": pct(0.99)}


def metrics(args, results: list[RequestResult], duration: float) -> dict:
    """Counts, throughputs (over ``duration``), latency distributions and errors of ``results``."""
    ok = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.prompt_tokens for r in ok)
    tpots = [t for r in ok if (t := r.tpot) is not None]
    good = [r for r in ok
            if (args.slo_ttft_ms is None or r.ttft * 1000 <= args.slo_ttft_ms)
            and (args.slo_tpot_ms is None or (r.tpot or 0.0) * 1000 <= args.slo_tpot_ms)]
    errors: dict[str, int] = {}
    for r in results:
        if not r.ok:
            errors[r.error[:200]] = errors.get(r.error[:200], 0) + 1
    return {
        "completed": len(ok), "failed": len(results) - len(ok), "duration_s": duration,
        "total_input_tokens": in_tokens, "total_output_tokens": out_tokens,
        "request_throughput": len(ok) / duration if duration else 0.0,
        "output_throughput": out_tokens / duration if duration else 0.0,
        "total_token_throughput": (in_tokens + out_tokens) / duration if duration else 0.0,
        "goodput": (len(good) / duration if duration else 0.0)
        if args.slo_ttft_ms is not None or args.slo_tpot_ms is not None else None,
        "ttft_ms": _dist([r.ttft for r in ok]),
        "tpot_ms": _dist(tpots),
        "itl_ms": _dist([x for r in ok for x in r.itl]),
        "e2el_ms": _dist([r.e2el for r in ok]),
        "errors": errors,
    }


def request_samples(results: list[RequestResult]) -> list[dict]:
    """Each request's timings in seconds from the first request's start: what ``--plot`` and
    ``--compare`` draw from (kept in the ``--save-json`` file, not in the JSON line)."""
    t0 = min((r.start for r in results if r.start), default=0.0)
    return [{"start_s": round(r.start - t0, 6), "ok": r.ok, "cls": r.cls, "output_tokens": r.output_tokens,
             "ttft_s": round(r.ttft, 6) if r.chunks else None, "e2el_s": round(r.e2el, 6),
             "itl_s": [round(x, 6) for x in r.itl]} for r in results]


def plotting():
    """``tools/bench_plot.py``, imported as a module or from beside this script."""
    try:
        from tools import bench_plot
    except ImportError:
        import bench_plot
    return bench_plot


def workload_params(args) -> dict:
    if args.workload == "mixed":
        return {"num_short": args.num_prompts, "num_long": args.num_long, "long_input_len": args.long_input_len,
                "long_output_len": args.long_output_len, "long_delay_s": args.long_delay,
                "long_interval_s": args.long_interval}
    if args.workload == "two-priority":
        return {"urgent_fraction": args.urgent_fraction, "urgent_priority": args.urgent_priority,
                "normal_priority": args.normal_priority}
    if args.workload == "two-client":
        return {"num_flood": args.num_prompts, "num_light": args.num_light, "light_output_len": args.light_output_len,
                "light_delay_s": args.light_delay, "light_interval_s": args.light_interval}
    return {}


def summarize(args, results: list[RequestResult], duration: float) -> dict:
    """The overall metrics with the run's settings, and per class for workloads that have classes."""
    s = {
        "base_url": args.base_url, "model": args.model, "endpoint": args.endpoint, "protocol": args.protocol,
        "logprobs": args.logprobs,
        "num_prompts": len(results), "input_len": args.input_len, "output_len": args.output_len,
        "request_rate": args.request_rate if math.isfinite(args.request_rate) else "inf",
        "max_concurrency": args.max_concurrency,
    }
    for k, v in metrics(args, results, duration).items():
        s[k] = v
        if k == "goodput":
            s["slo_ttft_ms"], s["slo_tpot_ms"] = args.slo_ttft_ms, args.slo_tpot_ms
    s["workload"] = args.workload
    if args.workload != "random":
        s["workload_params"] = workload_params(args)
        s["classes"] = {c: metrics(args, [r for r in results if r.cls == c], duration)
                        for c in CLASSES[args.workload]}
    if args.workload == "mixed":
        s["long_sent_during_short"] = sum(1 for r in results if r.cls == "long" and r.in_flight)
    return s


def print_table(s: dict) -> None:
    w = 50
    line = "=" * w
    print(f"{' Serving Benchmark Result ':=^{w}}")
    rows = [
        ("Successful requests:", s["completed"]),
        ("Failed requests:", s["failed"]),
        ("Maximum request concurrency:", s["max_concurrency"] or "-"),
        ("Request rate (req/s):", s["request_rate"]),
        ("Benchmark duration (s):", f"{s['duration_s']:.2f}"),
        ("Total input tokens:", s["total_input_tokens"]),
        ("Total generated tokens:", s["total_output_tokens"]),
        ("Request throughput (req/s):", f"{s['request_throughput']:.2f}"),
        ("Output token throughput (tok/s):", f"{s['output_throughput']:.2f}"),
        ("Total token throughput (tok/s):", f"{s['total_token_throughput']:.2f}"),
    ]
    if s["goodput"] is not None:
        rows.append(("Request goodput (req/s):", f"{s['goodput']:.2f}"))
    if s.get("workload", "random") != "random":
        rows.insert(0, ("Workload:", s["workload"]))
    for k, v in rows:
        print(f"{k:<38}{v!s:>12}")
    for key, title in (("ttft_ms", "Time to First Token"), ("tpot_ms", "Time per Output Token (excl. 1st token)"),
                       ("itl_ms", "Inter-token Latency"), ("e2el_ms", "End-to-end Latency")):
        print(f"{' ' + title + ' ':-^{w}}")
        d = s[key]
        short = key.split("_")[0].upper()
        for stat, label in (("mean", "Mean"), ("median", "Median"), ("p90", "P90"), ("p99", "P99")):
            print(f"{label + ' ' + short + ' (ms):':<38}{d[stat]:>12.2f}")
    if s["errors"]:
        print(f"{' Errors ':-^{w}}")
        for e, n in s["errors"].items():
            print(f"{n:>5} x {e}")
    for name, c in s.get("classes", {}).items():
        print(f"{' Class ' + name + ' ':=^{w}}")
        for k, v in (("Successful requests:", c["completed"]), ("Failed requests:", c["failed"]),
                     ("Request throughput (req/s):", f"{c['request_throughput']:.2f}"),
                     ("Output token throughput (tok/s):", f"{c['output_throughput']:.2f}")):
            print(f"{k:<38}{v!s:>12}")
        print(f"{'(ms)':<10}" + "".join(f"{h:>10}" for h in ("Mean", "Median", "P90", "P99")))
        for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2el_ms"):
            d = c[key]
            print(f"{key.split('_')[0].upper():<10}"
                  + "".join(f"{d[stat]:>10.2f}" for stat in ("mean", "median", "p90", "p99")))
    print(line)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base-url", default="http://127.0.0.1:8000/v1", help="the server's OpenAI base URL")
    p.add_argument("--model", default=None, help="model name to request (default: the first of /v1/models)")
    p.add_argument("--api-key", default=os.environ.get("TOKENMILL_API_KEY", "").split(",")[0] or None)
    p.add_argument("--endpoint", choices=("completions", "chat", "llamacpp", "tgi", "ollama"), default="completions",
                   help="llamacpp: llama.cpp's /completion; tgi: TGI's /generate_stream; ollama: Ollama's /api/generate "
                        "(raw); each streamed (--protocol sse only)")
    p.add_argument("--protocol", choices=sorted(PROTOCOLS), default="sse",
                   help="how tokens are streamed back: sse (one HTTP request each) or ws (all multiplexed "
                   "over --ws-connections WebSockets to /v1/stream) (default: sse)")
    p.add_argument("--ws-connections", type=int, default=4,
                   help="WebSocket connections shared by all requests with --protocol ws (default: 4)")
    p.add_argument("--workload", choices=WORKLOADS, default="random",
                   help="random: --num-prompts alike; mixed: with --num-long long prompts among them; "
                   "two-priority: --urgent-fraction of them urgent; edit: code to repeat with a name changed "
                   "(default: random)")
    p.add_argument("--num-prompts", type=int, default=100,
                   help="requests (mixed: the short ones)")
    p.add_argument("--input-len", type=int, default=128, help="prompt length in tokens")
    p.add_argument("--output-len", type=int, default=64, help="tokens to generate per request")
    p.add_argument("--request-rate", type=float, default=math.inf,
                   help="Poisson arrival rate in requests/s (default: inf = all at once)")
    p.add_argument("--max-concurrency", type=int, default=None, help="most requests in flight at once")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--logprobs", type=int, default=None, metavar="K",
                   help="each token with its top K logprobs")
    p.add_argument("--no-ignore-eos", dest="ignore_eos", action="store_false",
                   help="let requests stop at EOS (default: ignore EOS, generate exactly --output-len)")
    p.add_argument("--tokenizer", default=None, help="model folder or .gguf whose tokenizer makes the prompts")
    g = p.add_argument_group("--workload mixed")
    g.add_argument("--num-long", type=int, default=3, help="long requests (0: the baseline) (default: 3)")
    g.add_argument("--long-input-len", type=int, default=1800, help="their prompt length (default: 1800)")
    g.add_argument("--long-output-len", type=int, default=16, help="their tokens to generate (default: 16)")
    g.add_argument("--long-delay", type=float, default=2.0,
                   help="seconds from the start to the first long request (default: 2)")
    g.add_argument("--long-interval", type=float, default=0.5,
                   help="seconds between long requests (default: 0.5)")
    g = p.add_argument_group("--workload two-priority")
    g.add_argument("--urgent-fraction", type=float, default=0.1,
                   help="share of the requests that are urgent (default: 0.1)")
    g.add_argument("--urgent-priority", type=int, default=-1,
                   help="the urgent requests' priority; lower runs first (default: -1)")
    g.add_argument("--normal-priority", type=int, default=0, help="the others' priority (default: 0)")
    g = p.add_argument_group("--workload two-client")
    g.add_argument("--num-light", type=int, default=6, help="the light client's requests (default: 6)")
    g.add_argument("--light-output-len", type=int, default=16, help="their tokens to generate (default: 16)")
    g.add_argument("--light-delay", type=float, default=2.0,
                   help="seconds after the start the first goes out (default: 2)")
    g.add_argument("--light-interval", type=float, default=1.0, help="seconds between them (default: 1)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=600.0, help="per-request timeout in seconds")
    p.add_argument("--slo-ttft-ms", type=float, default=None, help="goodput: TTFT must be at most this")
    p.add_argument("--slo-tpot-ms", type=float, default=None, help="goodput: TPOT must be at most this")
    p.add_argument("--save-json", default=None, metavar="PATH",
                   help="also write the result JSON here, with every request's timings (for --compare)")
    p.add_argument("--plot", default=None, metavar="PNG",
                   help="draw TTFT and ITL distributions and tokens/s over time into this PNG (with --compare: "
                   "the comparison's file, default compare.png)")
    p.add_argument("--compare", nargs="+", default=None, metavar="JSON",
                   help="run nothing: draw two or more --save-json results side by side into --plot")
    p.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    args = p.parse_args(argv)
    if args.compare is not None and len(args.compare) < 2:
        p.error("--compare needs at least two saved results")
    if args.num_prompts < 1 or args.input_len < 1 or args.output_len < 1:
        p.error("--num-prompts, --input-len and --output-len must be positive")
    if args.request_rate <= 0:
        p.error("--request-rate must be positive (inf = all at once)")
    if args.num_long < 0 or args.long_input_len < 1 or args.long_output_len < 1:
        p.error("--num-long must be at least 0, --long-input-len and --long-output-len positive")
    if args.long_delay < 0 or args.long_interval < 0:
        p.error("--long-delay and --long-interval must be at least 0")
    if not 0 <= args.urgent_fraction <= 1:
        p.error("--urgent-fraction must be between 0 and 1")
    if args.endpoint in ("llamacpp", "tgi", "ollama") and args.protocol != "sse":
        p.error(f"--endpoint {args.endpoint} streams its own events: --protocol ws serves the OpenAI endpoints")
    return args


def compare(args) -> int:
    bench_plot = plotting()
    runs = []
    for path in args.compare:
        label = os.path.splitext(os.path.basename(path))[0]
        runs.append((label, bench_plot.load(path)))
    out = args.plot or "compare.png"
    bench_plot.plot_compare(runs, out)
    print(f"wrote {out}", flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.compare:
        return compare(args)
    rng = random.Random(args.seed)
    tok = load_tokenizer(args.tokenizer) if args.tokenizer else None
    jobs = make_jobs(args, rng, tok)
    results, duration = asyncio.run(run_benchmark(args, jobs))
    summary = summarize(args, results, duration)
    print_table(summary)
    if args.workload == "mixed" and summary["long_sent_during_short"] < args.num_long:
        print(f"warning: {args.num_long - summary['long_sent_during_short']} of {args.num_long} long requests "
              "went out with no short one in flight; send more or longer short requests, or lower "
              "--long-delay", file=sys.stderr, flush=True)
    line = json.dumps(summary, separators=(",", ":"))
    saved = {**summary, "requests": request_samples(results)}
    if args.save_json:
        with open(args.save_json, "w") as f:
            json.dump(saved, f, indent=1)
    if args.plot:
        plotting().plot_run(saved, args.plot)
        print(f"wrote {args.plot}", file=sys.stderr, flush=True)
    print(line, flush=True)
    return 0 if summary["completed"] else 1


if __name__ == "__main__":
    sys.exit(main())


