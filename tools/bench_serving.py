"""Benchmark an OpenAI-compatible server, in the manner of ``vllm bench serve``.

Sends ``--num-prompts`` streaming requests with random prompts of
``--input-len`` tokens asking for ``--output-len`` tokens (``ignore_eos``, so
every request generates exactly that many), either at a Poisson
``--request-rate`` or all at once, capped by ``--max-concurrency``. Reports
request and token throughput, TTFT (time to first token), TPOT (time per output
token after the first), ITL (gap between streamed chunks) and end-to-end latency
(mean, p50, p90, p99), and goodput under ``--slo-ttft-ms`` / ``--slo-tpot-ms``.
Prints a table, then one JSON line (also written to ``--save-json``).

    python tools/bench_serving.py --base-url http://127.0.0.1:8000/v1 \\
        --num-prompts 200 --input-len 256 --output-len 64 --max-concurrency 32

Prompts are random token ids decoded with ``--tokenizer`` (a model folder or
.gguf file) when given, else random common English words (about one token each).
Token counts come from the server's ``usage`` when it sends it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
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


# ----------------------------------------------------------------------------- requests


async def sse_request(client, args, prompt: str, est_tokens: int) -> RequestResult:
    """One streaming request through the official client (Server-Sent Events)."""
    r = RequestResult(prompt_tokens=est_tokens)
    extra = {"ignore_eos": True} if args.ignore_eos else {}
    common = dict(model=args.model, max_tokens=args.output_len, temperature=args.temperature, stream=True,
                  stream_options={"include_usage": True}, extra_body=extra or None)
    r.start = time.perf_counter()
    try:
        if args.endpoint == "chat":
            stream = await client.chat.completions.create(
                messages=[{"role": "user", "content": prompt}], **common)
        else:
            stream = await client.completions.create(prompt=prompt, **common)
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


async def ws_request(client, args, prompt: str, est_tokens: int) -> RequestResult:
    """One request over a shared WebSocket (``{"type": "completion" | "chat"}``, deltas until done)."""
    mux = args.__dict__.setdefault("ws_mux", WsMux(args))
    r = RequestResult(prompt_tokens=est_tokens)
    rid = f"r{next(mux.ids)}"
    req = {"type": "chat" if args.endpoint == "chat" else "completion", "id": rid, "model": args.model,
           "max_tokens": args.output_len, "temperature": args.temperature}
    if args.ignore_eos:
        req["ignore_eos"] = True
    if args.endpoint == "chat":
        req["messages"] = [{"role": "user", "content": prompt}]
    else:
        req["prompt"] = prompt
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


async def run_benchmark(args, prompts: list[tuple[str, int]]) -> tuple[list[RequestResult], float]:
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=args.base_url, api_key=args.api_key or "none", timeout=args.timeout,
                         max_retries=0)
    if args.model is None:
        args.model = (await client.models.list()).data[0].id
    send = PROTOCOLS[args.protocol]
    sem = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else None
    rng = random.Random(args.seed + 1)
    done = 0

    async def one(prompt: str, est: int) -> RequestResult:
        nonlocal done
        if sem is None:
            res = await send(client, args, prompt, est)
        else:
            async with sem:
                res = await send(client, args, prompt, est)
        done += 1
        if not args.quiet and (done % max(1, len(prompts) // 10) == 0 or done == len(prompts)):
            print(f"  {done}/{len(prompts)} done", file=sys.stderr, flush=True)
        return res

    tasks = []
    t0 = time.perf_counter()
    for i, (prompt, est) in enumerate(prompts):
        if i and math.isfinite(args.request_rate):
            await asyncio.sleep(rng.expovariate(args.request_rate))
        tasks.append(asyncio.create_task(one(prompt, est)))
    results = await asyncio.gather(*tasks)
    duration = time.perf_counter() - t0
    await client.close()
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


def summarize(args, results: list[RequestResult], duration: float) -> dict:
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
        "base_url": args.base_url, "model": args.model, "endpoint": args.endpoint, "protocol": args.protocol,
        "num_prompts": len(results), "input_len": args.input_len, "output_len": args.output_len,
        "request_rate": args.request_rate if math.isfinite(args.request_rate) else "inf",
        "max_concurrency": args.max_concurrency,
        "completed": len(ok), "failed": len(results) - len(ok), "duration_s": duration,
        "total_input_tokens": in_tokens, "total_output_tokens": out_tokens,
        "request_throughput": len(ok) / duration if duration else 0.0,
        "output_throughput": out_tokens / duration if duration else 0.0,
        "total_token_throughput": (in_tokens + out_tokens) / duration if duration else 0.0,
        "goodput": (len(good) / duration if duration else 0.0)
        if args.slo_ttft_ms is not None or args.slo_tpot_ms is not None else None,
        "slo_ttft_ms": args.slo_ttft_ms, "slo_tpot_ms": args.slo_tpot_ms,
        "ttft_ms": _dist([r.ttft for r in ok]),
        "tpot_ms": _dist(tpots),
        "itl_ms": _dist([x for r in ok for x in r.itl]),
        "e2el_ms": _dist([r.e2el for r in ok]),
        "errors": errors,
    }


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
    print(line)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base-url", default="http://127.0.0.1:8000/v1", help="the server's OpenAI base URL")
    p.add_argument("--model", default=None, help="model name to request (default: the first of /v1/models)")
    p.add_argument("--api-key", default=os.environ.get("TOKENMILL_API_KEY", "").split(",")[0] or None)
    p.add_argument("--endpoint", choices=("completions", "chat"), default="completions")
    p.add_argument("--protocol", choices=sorted(PROTOCOLS), default="sse",
                   help="how tokens are streamed back: sse (one HTTP request each) or ws (all multiplexed "
                   "over --ws-connections WebSockets to /v1/stream) (default: sse)")
    p.add_argument("--ws-connections", type=int, default=4,
                   help="WebSocket connections shared by all requests with --protocol ws (default: 4)")
    p.add_argument("--num-prompts", type=int, default=100)
    p.add_argument("--input-len", type=int, default=128, help="prompt length in tokens")
    p.add_argument("--output-len", type=int, default=64, help="tokens to generate per request")
    p.add_argument("--request-rate", type=float, default=math.inf,
                   help="Poisson arrival rate in requests/s (default: inf = all at once)")
    p.add_argument("--max-concurrency", type=int, default=None, help="most requests in flight at once")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--no-ignore-eos", dest="ignore_eos", action="store_false",
                   help="let requests stop at EOS (default: ignore EOS, generate exactly --output-len)")
    p.add_argument("--tokenizer", default=None, help="model folder or .gguf whose tokenizer makes the prompts")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=600.0, help="per-request timeout in seconds")
    p.add_argument("--slo-ttft-ms", type=float, default=None, help="goodput: TTFT must be at most this")
    p.add_argument("--slo-tpot-ms", type=float, default=None, help="goodput: TPOT must be at most this")
    p.add_argument("--save-json", default=None, metavar="PATH", help="also write the result JSON here")
    p.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    args = p.parse_args(argv)
    if args.num_prompts < 1 or args.input_len < 1 or args.output_len < 1:
        p.error("--num-prompts, --input-len and --output-len must be positive")
    if args.request_rate <= 0:
        p.error("--request-rate must be positive (inf = all at once)")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    rng = random.Random(args.seed)
    tok = load_tokenizer(args.tokenizer) if args.tokenizer else None
    prompts = make_prompts(args.num_prompts, args.input_len, rng, tok)
    results, duration = asyncio.run(run_benchmark(args, prompts))
    summary = summarize(args, results, duration)
    print_table(summary)
    line = json.dumps(summary, separators=(",", ":"))
    if args.save_json:
        with open(args.save_json, "w") as f:
            json.dump(summary, f, indent=2)
    print(line, flush=True)
    return 0 if summary["completed"] else 1


if __name__ == "__main__":
    sys.exit(main())


