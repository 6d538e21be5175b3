"""Benchmark the frontend alone: streamed tokens per second against a fake engine that costs ~nothing.

Starts the fake engine of ``tools/fake_engine.py`` in this process (one token per
request per step, sleeping ``--step-ms`` after each step), ``--api-server-count``
frontend processes sharing one port (``frontends.server.run_frontend``, as the
launcher starts them, each with its own ``frontend_id``), and ``--concurrency``
raw-socket streaming clients spread over ``--client-procs`` processes so that the
client is not the bottleneck. Each client request sends ``--prompt-len`` token ids to
``/v1/completions`` (or, with ``--endpoint chat`` / ``responses``, a text of about as
many tokens to ``/v1/chat/completions`` / ``/v1/responses``) and streams
``--max-tokens`` tokens (SSE, with usage), each on a new connection.

After a warm-up round, each of ``--rounds`` rounds starts all streams at once,
each runs ``--waves`` requests back to back, and the round is timed from the
first send to the last ``[DONE]`` (a Response's last event). Reported per round:
streamed tokens/s (from each response's usage), SSE events/s (every ``data: {``
event, the usage one included; fewer than tokens when a stream fell behind, as
the frontend then sends all its pending tokens in one event), and CPU seconds from /proc for each frontend,
the engine thread and the clients. ``tokens per frontend CPU-s`` is what one
frontend process would deliver with a core to itself, the figure to hold against
the 20k tokens/s target; the machine's other cores run the engine and the
clients, so on a small machine the wall-clock rate is a floor, not the ceiling.
``other CPU s`` is what processes outside the benchmark took meanwhile (from
/proc/stat): when it is high, the wall-clock figures are noise.
The summary takes each figure's median over the rounds. Prints a table, then
one JSON line (also written to ``--save-json``).

    python tools/bench_frontend.py                                  # 1 frontend, 1 client process
    python tools/bench_frontend.py --api-server-count 2 --client-procs 2
    python tools/bench_frontend.py --endpoint chat --logprobs 20    # each token with its top 20
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import re
import statistics
import sys
import tempfile
import time

if __package__ in (None, ""):  # run as a script: make the repository root importable, as bench_offline does
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tools.fake_engine import KEY, MAX_MODEL_LEN, MODEL, FakeEngine, free_port, start_frontend, stop_frontend

TARGET_TOKENS_PER_S = 20_000  # per frontend process (the target)
_EVENT = b"data: {"
_USAGE = re.compile(rb'"(?:completion|output)_tokens":\s*(\d+)')  # a chat's or completion's usage, or a Response's
_LAST_CHUNK = b"\r\n0\r\n\r\n"  # the chunked body's end: after [DONE], or a Response's last event
CHAT_TEMPLATE_TOKENS = 64  # room the chat template's own tokens take (SmolLM2's system prompt and markers)
ENDPOINTS = {"completions": "/v1/completions", "chat": "/v1/chat/completions", "responses": "/v1/responses"}
_CLK_TCK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(stat_path: str) -> float:
    """utime + stime of a process (``/proc/PID/stat``) or thread (``/proc/PID/task/TID/stat``)."""
    with open(stat_path) as f:
        fields = f.read().rsplit(")", 1)[1].split()  # the command name may hold spaces: split after it
    return (int(fields[11]) + int(fields[12])) / _CLK_TCK


def machine_busy_seconds() -> float:
    """CPU seconds all cores spent not idle since boot (``/proc/stat``): to see who else used the machine."""
    with open("/proc/stat") as f:
        user, nice, system, _idle, _iowait, irq, softirq, steal = (int(v) for v in f.readline().split()[1:9])
    return (user + nice + system + irq + softirq + steal) / _CLK_TCK


# ----------------------------------------------------------------------------- clients


def request_bytes(prompt_len: int, max_tokens: int, endpoint: str = "completions", logprobs: int | None = None) -> bytes:
    """A streamed request: token ids to /v1/completions; to the chat and Responses endpoints a text of
    about ``prompt_len`` tokens (one word each), through the chat template. ``logprobs``: each token's top
    that many logprobs (not the Responses API's)."""
    usage = {"stream_options": {"include_usage": True}}
    lps = {} if logprobs is None else {"completions": {"logprobs": logprobs},
                                       "chat": {"logprobs": True, "top_logprobs": logprobs}}[endpoint]
    body = json.dumps({"model": MODEL, "stream": True} | lps | {
        "completions": {"prompt": [1000 + i for i in range(prompt_len)], "max_tokens": max_tokens} | usage,
        "chat": {"messages": [{"role": "user", "content": " ".join(["word"] * prompt_len)}],
                 "max_tokens": max_tokens} | usage,
        "responses": {"input": " ".join(["word"] * prompt_len), "max_output_tokens": max_tokens},
    }[endpoint]).encode()
    return (b"POST " + ENDPOINTS[endpoint].encode() + b" HTTP/1.1\r\nHost: bench\r\nAuthorization: Bearer " + KEY.encode()
            + b"\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(body) + body)


async def stream_one(port: int, request: bytes) -> tuple[int, int, str | None]:
    """One streamed completion on its own connection: (SSE events, completion tokens, error)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(request)
        head = await reader.read(1 << 16)
        if not head.startswith(b"HTTP/1.1 200"):
            return 0, 0, head.split(b"\r\n", 1)[0].decode("latin-1") or "connection closed"
        events, prev, chunk = head.count(_EVENT), head[-(len(_EVENT) - 1):], head
        tail = head[-1024:]
        while not tail.endswith(_LAST_CHUNK):
            chunk = await reader.read(1 << 16)
            if not chunk:
                return events, 0, "closed before the last event"
            # an event marker split across two reads is counted once: prev is too short to hold a whole one
            events += (prev + chunk).count(_EVENT)
            prev, tail = chunk[-(len(_EVENT) - 1):], (tail + chunk)[-1024:]
        m = _USAGE.search(tail)
        return events, int(m.group(1)) if m else 0, None if m else "no usage in the last event"
    finally:
        writer.close()


async def client_round(port: int, request: bytes, n: int, waves: int, timeout: float) -> dict:
    async def slot() -> list:
        results = []
        for _ in range(waves):  # back to back, each on a new connection
            try:
                results.append(await asyncio.wait_for(stream_one(port, request), timeout))
            except Exception as e:  # counted, not fatal: the round goes on
                results.append(e)
        return results

    t0 = time.monotonic()
    slots = await asyncio.gather(*(slot() for _ in range(n)))
    t1 = time.monotonic()
    out = {"t0": t0, "t1": t1, "events": 0, "tokens": 0, "errors": []}
    for r in (r for s in slots for r in s):
        if isinstance(r, BaseException):
            out["errors"].append(type(r).__name__ + (f": {r}" if str(r) else ""))
            continue
        events, tokens, err = r
        out["events"] += events
        out["tokens"] += tokens
        if err:
            out["errors"].append(err)
    return out


def client_proc(conn, port: int, request: bytes, n: int, waves: int, timeout: float) -> None:
    """A client process: on each "go" from the parent, run ``n`` concurrent streams and send back the counts."""
    import uvloop

    while conn.recv() == "go":
        c0 = time.process_time()
        out = uvloop.run(client_round(port, request, n, waves, timeout))
        out["cpu_s"] = time.process_time() - c0
        conn.send(out)
    conn.close()


# ----------------------------------------------------------------------------- the run


def run_round(pipes, frontends, engine_stat: str) -> dict:
    fe0 = [cpu_seconds(f"/proc/{p.pid}/stat") for p in frontends]
    e0 = cpu_seconds(engine_stat)
    m0 = machine_busy_seconds()
    for conn in pipes:
        conn.send("go")
    outs = [conn.recv() for conn in pipes]
    fe = [cpu_seconds(f"/proc/{p.pid}/stat") - c for p, c in zip(frontends, fe0, strict=True)]
    wall = max(o["t1"] for o in outs) - min(o["t0"] for o in outs)
    tokens = sum(o["tokens"] for o in outs)
    fe_cpu = sum(fe)
    engine_cpu = cpu_seconds(engine_stat) - e0
    client_cpu = sum(o["cpu_s"] for o in outs)
    other_cpu = max(0.0, machine_busy_seconds() - m0 - fe_cpu - engine_cpu - client_cpu)
    return {
        "wall_s": wall,
        "tokens": tokens,
        "events": sum(o["events"] for o in outs),
        "tokens_per_s": tokens / wall,
        "events_per_s": sum(o["events"] for o in outs) / wall,
        "frontend_cpu_s": fe,
        "frontend_us_per_token": 1e6 * fe_cpu / max(tokens, 1),
        "tokens_per_frontend_cpu_s": tokens / fe_cpu if fe_cpu else 0.0,
        "engine_cpu_s": engine_cpu,
        "client_cpu_s": client_cpu,
        "other_cpu_s": other_cpu,  # processes outside this benchmark: noise in the wall-clock figures
        "errors": [e for o in outs for e in o["errors"]],
    }


def summarize(args, rounds: list[dict]) -> dict:
    def med(key: str) -> float:
        return statistics.median(r[key] for r in rounds)

    for r in rounds:
        r["other_cores_busy"] = r["other_cpu_s"] / r["wall_s"]
    busy = [(sum(r["frontend_cpu_s"]) + r["engine_cpu_s"] + r["client_cpu_s"]) / r["wall_s"] for r in rounds]
    return {
        "tool": "bench_frontend",
        "api_server_count": args.api_server_count,
        "client_procs": args.client_procs,
        "concurrency": args.concurrency,
        "max_tokens": args.max_tokens,
        "waves": args.waves,
        "prompt_len": args.prompt_len,
        "endpoint": args.endpoint,
        "logprobs": args.logprobs,
        "step_ms": args.step_ms,
        "rounds": len(rounds),
        "cpu_count": os.cpu_count(),
        "tokens_per_s": round(med("tokens_per_s")),
        "sse_events_per_s": round(med("events_per_s")),
        "tokens_per_frontend_cpu_s": round(med("tokens_per_frontend_cpu_s")),
        "frontend_us_per_token": round(med("frontend_us_per_token"), 2),
        "frontend_cpu_s_per_token": med("frontend_us_per_token") / 1e6,
        "engine_pace_ceiling_tokens_per_s": round(args.concurrency / (args.step_ms / 1000)) if args.step_ms else None,
        "cores_busy": round(statistics.median(busy), 2),
        "other_cores_busy": round(med("other_cores_busy"), 2),
        "target_tokens_per_s_per_frontend": TARGET_TOKENS_PER_S,
        "errors": sum(len(r["errors"]) for r in rounds),
        "per_round": [{k: (round(v, 4) if isinstance(v, float) else v) for k, v in r.items()
                       if k not in ("errors",)} | {"errors": len(r["errors"])} for r in rounds],
    }


def print_table(rounds: list[dict], s: dict) -> None:
    cols = ("round", "wall s", "tokens/s", "events/s", "fe CPU s", "tok/fe-CPU-s", "fe us/tok", "eng CPU s",
            "cli CPU s", "other CPU s", "errors")
    print(f"endpoint={s['endpoint']} frontends={s['api_server_count']} client-procs={s['client_procs']} concurrency={s['concurrency']} "
          f"max-tokens={s['max_tokens']} waves={s['waves']} step-ms={s['step_ms']} logprobs={s['logprobs']} cpus={s['cpu_count']}")
    print("".join(f"{c:>13}" for c in cols))
    for i, r in enumerate(rounds, 1):
        fe = "+".join(f"{c:.2f}" for c in r["frontend_cpu_s"])
        row = (i, f"{r['wall_s']:.2f}", f"{r['tokens_per_s']:,.0f}", f"{r['events_per_s']:,.0f}", fe,
               f"{r['tokens_per_frontend_cpu_s']:,.0f}", f"{r['frontend_us_per_token']:.1f}",
               f"{r['engine_cpu_s']:.2f}", f"{r['client_cpu_s']:.2f}", f"{r['other_cpu_s']:.2f}", len(r["errors"]))
        print("".join(f"{v!s:>13}" for v in row))
    print(f"median: {s['tokens_per_s']:,} streamed tokens/s, {s['sse_events_per_s']:,} SSE events/s, "
          f"{s['tokens_per_frontend_cpu_s']:,} tokens per frontend CPU-second "
          f"({s['frontend_us_per_token']} us/token; target {TARGET_TOKENS_PER_S:,}/s per frontend), "
          f"{s['cores_busy']} of {s['cpu_count']} cores busy with it, {s['other_cores_busy']} with other processes")
    errors = sorted({e for r in rounds for e in r["errors"]})
    for e in errors[:5]:
        print(f"error: {e}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--api-server-count", type=int, default=1, help="frontend processes sharing the port")
    p.add_argument("--concurrency", type=int, default=32, help="streams in flight at once (one per connection)")
    p.add_argument("--client-procs", type=int, default=1, help="client processes the streams are spread over")
    p.add_argument("--max-tokens", type=int, default=450, help="tokens streamed per request")
    p.add_argument("--waves", type=int, default=4,
                   help="requests each stream runs back to back per round (longer rounds, steadier CPU readings)")
    p.add_argument("--prompt-len", type=int, default=50, help="prompt length in token ids")
    p.add_argument("--endpoint", choices=tuple(ENDPOINTS), default="completions",
                   help="what the clients stream: /v1/completions (token-id prompts), /v1/chat/completions "
                        "or /v1/responses (text prompts through the chat template)")
    p.add_argument("--step-ms", type=float, default=0.5, help="the fake engine sleeps this long after each step")
    p.add_argument("--logprobs", type=int, default=None, metavar="K",
                   help="each streamed token with its top K logprobs (completions and chat)")
    p.add_argument("--rounds", type=int, default=3, help="timed rounds, after one warm-up round")
    p.add_argument("--model", default=None, help="model folder or .gguf for the tokenizer (default: the default model)")
    p.add_argument("--tokenizer-dir", default=os.path.join(tempfile.gettempdir(), "tokenmill-bench-tokenizer"),
                   help="where the tokenizer is cached for the frontends")
    p.add_argument("--timeout", type=float, default=300.0, help="per-request timeout in seconds")
    p.add_argument("--save-json", default=None, metavar="PATH", help="also write the result JSON here")
    args = p.parse_args(argv)
    template = 0 if args.endpoint == "completions" else CHAT_TEMPLATE_TOKENS
    if args.prompt_len + args.max_tokens + template > MAX_MODEL_LEN:
        p.error(f"--prompt-len + --max-tokens (+ {template} for the chat template) must be at most the fake "
                f"engine's max_model_len {MAX_MODEL_LEN}")
    if min(args.api_server_count, args.client_procs, args.concurrency, args.rounds, args.prompt_len, args.waves) < 1:
        p.error("counts must be positive")
    if args.client_procs > args.concurrency:
        p.error("--client-procs must be at most --concurrency")
    if args.logprobs is not None and args.endpoint == "responses":
        p.error("--logprobs: with completions or chat")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from engine.model_path import default_model_path
    from frontends.tokenizer import load_tokenizer

    load_tokenizer(args.model or default_model_path(), cache_dir=args.tokenizer_dir)  # frontends load the cache
    run_dir = tempfile.mkdtemp(prefix="tokenmill-bench-fe-")
    os.chmod(run_dir, 0o700)
    address = f"ipc://{run_dir}/engine.sock"
    engine = FakeEngine(address, step_delay=args.step_ms / 1000)
    if args.logprobs is not None:
        engine.alternatives = args.logprobs  # (as many as asked, each a token of its own)
    engine.start()
    engine_stat = f"/proc/self/task/{engine.native_id}/stat"
    port = free_port()
    frontends, clients, pipes = [], [], []
    ctx = mp.get_context("spawn")  # no fork: this process runs a ZMQ thread
    try:
        for i in range(args.api_server_count):
            frontends.append(start_frontend(address, args.tokenizer_dir, port, frontend_id=f"frontend-{i}"))
        request = request_bytes(args.prompt_len, args.max_tokens, args.endpoint, args.logprobs)
        for i in range(args.client_procs):
            n = args.concurrency // args.client_procs + (i < args.concurrency % args.client_procs)
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=client_proc, args=(child, port, request, n, args.waves, args.timeout), daemon=True)
            proc.start()
            clients.append(proc)
            pipes.append(parent)
        run_round(pipes, frontends, engine_stat)  # warm-up
        rounds = [run_round(pipes, frontends, engine_stat) for _ in range(args.rounds)]
    finally:
        for conn in pipes:
            conn.send("stop")
        for proc in clients:
            proc.join(10)
        codes = [stop_frontend(p) for p in frontends]
        engine.stop()
        if os.path.exists(f"{run_dir}/engine.sock"):
            os.unlink(f"{run_dir}/engine.sock")
        os.rmdir(run_dir)
    summary = summarize(args, rounds)
    summary["frontend_exit_codes"] = codes
    print_table(rounds, summary)
    line = json.dumps(summary, separators=(",", ":"))
    if args.save_json:
        with open(args.save_json, "w") as f:
            f.write(line + "\n")
    print(line, flush=True)
    return 0 if summary["errors"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
