"""How much one hostile request stalls everyone else, on a running server.

For each attack (the oversized requests of the hardening issue), a well-behaved
streamed completion and a ``/health`` poller run alongside it; reported per
attack: the status the attack got, the probe stream's largest gap between two
chunks, and the slowest ``/health`` answer, next to the same figures with no
attack (the baseline). Ends with one JSON line.

    python tools/bench_hardening.py --base-url http://127.0.0.1:8000 --api-key KEY

Standard library and ``websockets`` only: it also measures servers of other
versions, side by side in one run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time

# long enough to outlast any attack; only the gaps after its first token count (not its own prefill)
PROBE = {"prompt": "Once upon a time", "max_tokens": 400, "temperature": 0, "ignore_eos": True, "stream": True}


async def http(host: str, port: int, key: str, path: str, body: bytes | None, *, stream_gaps: list | None = None,
               timeout: float = 120.0) -> int:
    """One request on its own connection; the status (0: no answer). With ``stream_gaps``, the gaps
    between the chunks of the response are appended to it."""
    reader, writer = await asyncio.open_connection(host, port)
    head = f"{'POST' if body is not None else 'GET'} {path} HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n" \
           f"Authorization: Bearer {key}\r\n"
    if body is not None:
        head += f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n"
    writer.write(head.encode() + b"\r\n" + (body or b""))
    first = b""
    last = None
    try:
        async with asyncio.timeout(timeout):
            while chunk := await reader.read(65536):
                now = time.perf_counter()
                if stream_gaps is not None:
                    if last is not None:
                        stream_gaps.append(now - last)
                    if last is not None or b"data: {" in chunk:  # from the first token on
                        last = now
                first = first or chunk
    except (TimeoutError, OSError):
        pass
    finally:
        writer.close()
    return int(first[9:12]) if first.startswith(b"HTTP/1.1 ") else 0


async def watch_health(host: str, port: int, key: str, stop: asyncio.Event, worst: list[float]) -> None:
    while not stop.is_set():
        t = time.perf_counter()
        await http(host, port, key, "/health", None, timeout=30)
        worst.append(time.perf_counter() - t)
        await asyncio.sleep(0.02)


async def ws_stats_flood(url: str, key: str, count: int) -> int:
    from websockets.asyncio.client import connect
    from websockets.exceptions import ConnectionClosed

    answered = 0
    try:
        async with connect(url, additional_headers={"Authorization": f"Bearer {key}"}, max_size=None) as ws:
            msg = json.dumps({"type": "stats", "id": "s"})
            for _ in range(count):
                await ws.send(msg)
            async with asyncio.timeout(60):
                while answered < count:
                    json.loads(await ws.recv())
                    answered += 1
    except (TimeoutError, ConnectionClosed):  # the server may close a flooding socket (or stall past a ping)
        pass
    return answered


def attacks() -> dict[str, tuple[str, dict | None]]:
    """name -> (path, body); the issue's findings 1, 2 and 4 (the WebSocket flood is apart)."""
    return {
        "stop_token_ids 500k x n=8": ("/v1/completions", {"prompt": [5, 6, 7], "n": 8, "max_tokens": 5, "min_tokens": 4,
                                                         "ignore_eos": True, "stop_token_ids": [3] * 500_000}),
        "full-vocab logit_bias x n=16": ("/v1/completions", {"prompt": [5, 6, 7], "n": 16, "max_tokens": 5,
                                                            "logit_bias": {str(i): 1 for i in range(49152)}}),
        "100k stop strings x n=4": ("/v1/completions", {"prompt": "Hello", "n": 4, "max_tokens": 16,
                                                       "stop": [f"zz{i}q" for i in range(100_000)]}),
        "50k prompts of one token": ("/v1/completions", {"prompt": [[5]] * 50_000, "max_tokens": 1}),
        "7 MB string prompt": ("/v1/completions", {"prompt": "hello world " * 600_000, "max_tokens": 1}),
    }


async def run_one(host: str, port: int, key: str, model: str, attack, window: float = 3.0) -> dict:
    """Run ``attack`` while the probe streams; the probe is watched from its first token until
    ``window`` seconds after the attack began (or the attack's end, if later)."""
    gaps: list[float] = []
    health: list[float] = []
    stop = asyncio.Event()
    watcher = asyncio.ensure_future(watch_health(host, port, key, stop, health))
    probe = asyncio.ensure_future(http(host, port, key, "/v1/completions",
                                       json.dumps({"model": model, **PROBE}).encode(), stream_gaps=gaps))
    while not gaps and not probe.done():  # streaming (two tokens in)
        await asyncio.sleep(0.01)
    t = time.perf_counter()
    status = await attack()
    took = time.perf_counter() - t
    await asyncio.sleep(max(0.0, window - took))
    probe.cancel()
    await asyncio.gather(probe, return_exceptions=True)
    stop.set()
    await watcher
    return {"status": status, "attack_s": round(took, 2), "probe_max_gap_s": round(max(gaps, default=0.0), 3),
            "health_max_s": round(max(health, default=0.0), 3)}


async def main_async(args: argparse.Namespace) -> dict:
    from urllib.parse import urlsplit

    u = urlsplit(args.base_url)
    host, port = u.hostname, u.port or 80
    model = args.model
    results = {"baseline (no attack)": await run_one(host, port, args.api_key, model, lambda: asyncio.sleep(0))}
    for name, (path, body) in attacks().items():
        payload = json.dumps({"model": model, **body}).encode()
        results[name] = await run_one(host, port, args.api_key, model,
                                      lambda path=path, payload=payload: http(host, port, args.api_key, path, payload))
    ws_url = f"ws://{host}:{port}/v1/stream"
    results["60k WebSocket stats (answered)"] = await run_one(
        host, port, args.api_key, model, lambda: ws_stats_flood(ws_url, args.api_key, args.stats_messages))
    return results


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument("--api-key", default="none")
    p.add_argument("--model", default=None, help="the served model name (default: the first of /v1/models)")
    p.add_argument("--stats-messages", type=int, default=60_000)
    args = p.parse_args()
    if args.model is None:
        import urllib.request

        req = urllib.request.Request(args.base_url + "/v1/models", headers={"Authorization": f"Bearer {args.api_key}"})
        args.model = json.loads(urllib.request.urlopen(req, timeout=30).read())["data"][0]["id"]
    results = asyncio.run(main_async(args))
    print(f"{'attack':32} {'status':>7} {'attack s':>9} {'probe max gap s':>16} {'/health max s':>14}")
    for name, r in results.items():
        print(f"{name:32} {r['status']!s:>7} {r['attack_s']:>9} {r['probe_max_gap_s']:>16} {r['health_max_s']:>14}")
    print(json.dumps({"base_url": args.base_url, "results": results}))


if __name__ == "__main__":
    main()
