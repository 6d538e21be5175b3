"""Prefix caching, on against off, in one run: time, prompt tokens computed, and KV memory waste.

Workload (seeded): ``--num-system-prompts`` system prompts of ``--system-len`` random tokens, each
followed by ``--num-requests`` / ``--num-system-prompts`` user turns of ``--user-len`` (uniform in
[1/2, 1] of it), ``--output-len`` greedy tokens each, all submitted at once to ``LLM.generate``
with ``n`` = 1 (``--twins T`` repeats every request T times, as ``n`` = T would). Each
configuration is run ``--repeat`` times, alternating, and the faster run of each is kept: absolute
times on a shared machine swing, the ratio is what counts.

Per step the engine's STATS are sampled to report memory as PagedAttention counts it:

- ``fragmentation``: allocated KV slots holding no token ÷ allocated slots (mean over steps with
  work), the waste paging leaves: at most one partial block per request;
- ``waste_if_reserved``: what a contiguous cache reserving ``max_model_len`` per running request
  would have left empty (1 − tokens held ÷ (running × max_model_len)), for comparison;
- ``peak_kv_usage``: most blocks in use at once ÷ all blocks.

    python tools/bench_prefix_cache.py
    python tools/bench_prefix_cache.py --num-requests 32 --system-len 512 --twins 4

The last line of output is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time

# Runnable as ``python tools/bench_prefix_cache.py`` from a checkout, without installing.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from engine import LLM, SamplingParams  # noqa: E402


def workload(args) -> list[list[int]]:
    rng = random.Random(args.seed)
    systems = [[rng.randrange(3, 10000) for _ in range(args.system_len)] for _ in range(args.num_system_prompts)]
    prompts = []
    for i in range(args.num_requests):
        user = [rng.randrange(3, 10000) for _ in range(rng.randint(args.user_len // 2, args.user_len))]
        prompts += [systems[i % len(systems)] + user] * args.twins
    return prompts


def run(llm: LLM, prompts: list[list[int]], params: SamplingParams, max_model_len: int) -> tuple[dict, list]:
    """The workload through a fresh engine: its figures, and each request's output tokens."""
    eng = llm.engine
    bm, sched = eng.block_manager, eng.scheduler
    for i, p in enumerate(prompts):
        eng.add_request(str(i), p, params)
    outputs: list[list[int]] = [[] for _ in prompts]
    frag, reserved_waste, peak, steps = [], [], 0, 0
    start = time.perf_counter()
    while eng.has_work():
        s = eng.stats()
        if s.num_running:
            frag.append(s.kv_fragmentation)
            held = sum(r.num_computed_tokens for r in sched.running)
            reserved_waste.append(1 - held / (s.num_running * max_model_len))
        peak = max(peak, bm.num_used_blocks)
        for d in eng.step():
            outputs[int(d.request_id)] += d.token_ids
        steps += 1
    seconds = time.perf_counter() - start
    s = eng.stats()
    return {
        "seconds": round(seconds, 3),
        "steps": steps,
        "prompt_tokens": sched.num_prompt_tokens,
        "cached_prompt_tokens": sched.num_cached_prompt_tokens,
        "hit_rate": round(s.prefix_cache_hit_rate, 4),
        "evictions": s.num_evictions,
        "preemptions": s.num_preemptions,
        "fragmentation": round(sum(frag) / max(1, len(frag)), 4),
        "waste_if_reserved": round(sum(reserved_waste) / max(1, len(reserved_waste)), 4),
        "peak_kv_usage": round(peak / bm.num_blocks, 4),
    }, outputs


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None, help="HF folder or .gguf file (default: bundled SmolLM2-135M)")
    p.add_argument("--num-requests", type=int, default=48)
    p.add_argument("--num-system-prompts", type=int, default=2)
    p.add_argument("--system-len", type=int, default=768)
    p.add_argument("--user-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--twins", type=int, default=1, help="submit each request this many times (n > 1)")
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    p.add_argument("--repeat", type=int, default=2, help="runs per configuration, alternating; the best is kept")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()

    prompts = workload(args)
    params = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
    results: dict[str, dict] = {}
    outputs: dict[str, list] = {}
    for _ in range(args.repeat):
        for name in ("off", "on"):  # a fresh engine each run: a cold cache, counters from zero
            llm = LLM(args.model, dtype=args.dtype, max_model_len=args.max_model_len,
                      max_num_seqs=args.max_num_seqs, enable_prefix_caching=name == "on")
            llm.generate([1, 2, 3], SamplingParams(max_tokens=2))  # warm up
            r, outputs[name] = run(llm, prompts, params, args.max_model_len)
            if name not in results or r["seconds"] < results[name]["seconds"]:
                results[name] = r
            print(f"{name:>3}: {json.dumps(r)}", file=sys.stderr)
    on, off = results["on"], results["off"]
    summary = {
        "workload": {k: getattr(args, k) for k in ("num_requests", "num_system_prompts", "system_len", "user_len",
                                                    "output_len", "twins", "dtype")},
        "off": off, "on": on,
        "speedup": round(off["seconds"] / on["seconds"], 2),
        "greedy_outputs_identical": outputs["on"] == outputs["off"],
    }
    print(f"prefix caching: {off['seconds']:.1f} s off, {on['seconds']:.1f} s on ({summary['speedup']}x); "
          f"hit rate {on['hit_rate']:.0%}; fragmentation {on['fragmentation']:.1%} paged vs "
          f"{on['waste_if_reserved']:.1%} if max_model_len were reserved; peak KV usage "
          f"{off['peak_kv_usage']:.1%} off, {on['peak_kv_usage']:.1%} on")
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
