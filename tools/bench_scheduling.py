"""Scheduling benchmark: policies and the prefill cap, side by side in one run.

Starts ``tokenmill serve`` once per configuration (from this checkout, and from
``--before``, another checkout such as a ``git worktree`` of an older commit,
to compare with), runs ``tools/bench_serving.py`` workloads against it and
prints one table, then one JSON line:

- ``mixed``: ``--short`` short streams (``--concurrency`` in flight) while three
  1,800-token prompts arrive; and the same without the long prompts. Short-request
  TTFT and ITL p50/p99, the long prompts' TTFT, output tokens/s.
- ``w2``: 64 requests of 128 prompt tokens, 16 in flight (ITL p99 against p50, throughput).
- ``two-priority``: 64 requests at once into 8 seats, 10% urgent: urgent against
  normal TTFT, fcfs against priority.
- ``two-client``: one client's 48 requests at once into 8 seats, and another's 6
  short ones while they run: the light client's TTFT, fcfs against fair (both
  call from this machine: told apart by ``user``, ``--fair-client user``).
- ``long-flood``: the same, the flood 16 requests of 256 tokens each: its
  generations hold every seat for long, so a light request waits for one to end
  unless it takes a seat from the flood.

    python tools/bench_scheduling.py --before /tmp/tokenmill-before
    python tools/bench_scheduling.py --only mixed --policies priority --before-policies priority --before /tmp/old

Each configuration takes about a minute with the default model on 2 CPU cores.
"""

from __future__ import annotations

import argparse
import json
import os
import select
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH = os.path.join(HERE, "tools", "bench_serving.py")
sys.path.insert(0, HERE)  # run as a script: tools.* from the repository root

from tools.fake_engine import free_port  # noqa: E402


def serve(checkout: str, flags: list[str]) -> tuple[subprocess.Popen, str]:
    port = free_port()
    log = tempfile.TemporaryFile("w+")
    proc = subprocess.Popen([sys.executable, "-m", "engine.cli", "serve", "--port", str(port), *flags],
                            cwd=checkout, stdout=subprocess.PIPE, stderr=log, text=True,
                            env=dict(os.environ, PYTHONPATH=checkout))
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if select.select([proc.stdout], [], [], 0.5)[0] and proc.stdout.readline():
            return proc, f"http://127.0.0.1:{port}/v1"
        if proc.poll() is not None:
            break
    proc.kill()
    log.seek(0)
    raise RuntimeError(f"server in {checkout} did not start:\n{log.read()[-3000:]}")


def bench(url: str, args: list[str]) -> dict:
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        subprocess.run([sys.executable, BENCH, "--base-url", url, "--quiet", "--save-json", f.name, *args],
                       check=True, stdout=subprocess.DEVNULL)
        return json.load(open(f.name))


def run(checkout: str, flags: list[str], args: list[str]) -> dict:
    proc, url = serve(checkout, flags)
    try:
        return bench(url, args)
    finally:
        proc.terminate()
        proc.wait(60)


def row(label: str, s: dict) -> dict:
    cls = s.get("classes", {})
    short = cls.get("short", s)
    out = {"run": label, "tok/s": s["output_throughput"], "failed": s["failed"],
           "TTFT p50": short["ttft_ms"]["median"], "TTFT p99": short["ttft_ms"]["p99"],
           "ITL p50": short["itl_ms"]["median"], "ITL p99": short["itl_ms"]["p99"]}
    if cls.get("long", {}).get("completed"):
        out["long TTFT p50"] = cls["long"]["ttft_ms"]["median"]
        out["long TTFT p99"] = cls["long"]["ttft_ms"]["p99"]
    for c in ("urgent", "normal", "light", "flood"):
        if c in cls:
            out[f"{c} TTFT p50"] = cls[c]["ttft_ms"]["median"]
            out[f"{c} TTFT p99"] = cls[c]["ttft_ms"]["p99"]
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--before", default=None, help="a checkout of the code to compare with (its fcfs is today's)")
    p.add_argument("--model", default=None, help="served model (default: the bundled SmolLM2)")
    p.add_argument("--short", type=int, default=24, help="short requests in the mixed workload")
    p.add_argument("--concurrency", type=int, default=8, help="short streams in flight in the mixed workload")
    p.add_argument("--long-interval", default="0.5", help="seconds between the mixed workload's long prompts (0: a burst)")
    p.add_argument("--only", default="mixed,w2,two-priority,two-client,long-flood", help="comma-separated workloads to run")
    p.add_argument("--policies", default="fcfs,short-first,priority,fair", help="policies to run after the change")
    p.add_argument("--before-policies", default="fcfs", help="policies to run before it (its flag: the checkout has it)")
    p.add_argument("--repeat", type=int, default=1, help="run the whole plan this many times (noise)")
    a = p.parse_args()
    model = ["--model", a.model] if a.model else []
    mixed = ["--workload", "mixed", "--num-prompts", str(a.short), "--input-len", "64", "--output-len", "128",
             "--max-concurrency", str(a.concurrency), "--num-long", "3", "--long-input-len", "1800",
             "--long-output-len", "16", "--long-delay", "3", "--long-interval", a.long_interval]
    w2 = ["--num-prompts", "64", "--input-len", "128", "--output-len", "64", "--max-concurrency", "16"]
    prio = ["--workload", "two-priority", "--num-prompts", "64", "--input-len", "128", "--output-len", "64",
            "--urgent-fraction", "0.1"]
    def two_client(flood: int, tokens: int) -> list[str]:  # (a flood of requests, and a light client's 6)
        return ["--workload", "two-client", "--num-prompts", str(flood), "--input-len", "64", "--output-len",
                str(tokens), "--num-light", "6", "--light-output-len", "16"]

    clients, long_flood = two_client(48, 64), two_client(16, 256)
    versions = [("before", a.before)] if a.before else []
    versions.append(("after", HERE))
    plan = []
    only = set(a.only.split(","))
    for name, checkout in versions:
        # "fcfs, no cap": the prefill cap lifted (a step may take the whole token budget), for its cost alone
        policies = a.before_policies.split(",") if name == "before" else [*a.policies.split(","), "fcfs, no cap"]
        for pol in policies:
            flags = [*model, "--scheduling-policy", pol.split(",")[0]] if pol != "fcfs" or name == "after" else model
            if pol.endswith("no cap"):
                flags += ["--long-prefill-token-threshold", "2048"]
            if "mixed" in only:
                plan.append((f"mixed {name} {pol}", checkout, flags, mixed))
                if pol == "fcfs":
                    plan.append((f"mixed {name} {pol}, no long", checkout, flags, [*mixed, "--num-long", "0"]))
            if "w2" in only:
                plan.append((f"w2 {name} {pol}", checkout, flags, w2))
            if "two-priority" in only and pol in ("fcfs", "priority"):
                plan.append((f"two-priority {name} {pol}", checkout, [*flags, "--max-num-seqs", "8"], prio))
            by_user = ["--fair-client", "user"] if pol == "fair" else []  # (both clients call from here)
            for workload, args in (("two-client", clients), ("long-flood", long_flood)):
                if workload in only and pol in ("fcfs", "fair"):
                    plan.append((f"{workload} {name} {pol}", checkout, [*flags, "--max-num-seqs", "8", *by_user], args))
    rows = []
    for label, checkout, flags, args in plan * a.repeat:
        print(f"... {label}", file=sys.stderr, flush=True)
        rows.append(row(label, run(checkout, flags, args)))
    keys = list(dict.fromkeys(k for r in rows for k in r))
    width = max(len(r["run"]) for r in rows)
    print(f"{'run':<{width}}  " + "  ".join(f"{k:>14}" for k in keys[1:]))
    for r in rows:
        cells = [f"{r[k]:14.1f}" if isinstance(r.get(k), float) else f"{r.get(k, ''):>14}" for k in keys[1:]]
        print(f"{r['run']:<{width}}  " + "  ".join(cells))
    print(json.dumps({"runs": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
