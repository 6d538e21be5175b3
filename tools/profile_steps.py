"""Where a busy server's steps go: decode-only steps against steps that also carry new prompts, in one
process, as a served burst makes them (new requests join as others finish: nearly every step carries a
few prompts beside the decodes).

``--num-seqs`` requests decode (their prompts prefilled first, untimed); then, over ``--steps`` timed
steps, every other step ``--join`` new requests of ``--prompt-len`` random tokens join, each asking for
one token, so that they leave once prefilled and the batch stays the same. Steps are synchronous (the
step's whole time is its own). Printed: each kind's step count and median time, then with ``--profile``
where decode-only steps spend it (on CUDA by kernel, the device's time, inside replayed graphs too:
``decode_top`` in the JSON line), and where the steps with prompts spend it, by torch.profiler (operators by
host time and by device time) and cProfile (Python functions by cumulative time). The last line is one JSON object.

    python tools/profile_steps.py --model DIR --dtype bfloat16 --profile     # on a GPU (tools/gpu_check.sh)
    python tools/profile_steps.py --model DIR --dtype bfloat16 --prompt-graph-tokens 0   # steps with prompts eager
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import random
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run as a script

import torch  # noqa: E402

from engine import LLM, SamplingParams  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="HF folder or .gguf file")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    p.add_argument("--num-seqs", type=int, default=256, help="requests decoding throughout")
    p.add_argument("--join", type=int, default=4, help="new requests in every other step")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--steps", type=int, default=60, help="timed steps")
    p.add_argument("--profile", action="store_true", help="then profile steps with prompts (torch.profiler, cProfile)")
    p.add_argument("--rows", type=int, default=25, help="rows of each profile table")
    p.add_argument("--prompt-graph-tokens", type=int, default=None, metavar="N",
                   help="the engine's (CUDA: steps with prompts of up to N tokens replay graphs; 0: none)")
    a = p.parse_args()
    rng = random.Random(0)
    graphs = {} if a.prompt_graph_tokens is None else {"prompt_graph_tokens": a.prompt_graph_tokens}
    llm = LLM(a.model, dtype=a.dtype, max_num_seqs=a.num_seqs + a.join, async_scheduling="off", **graphs)
    eng, vocab = llm.engine, min(llm.engine.runner.model_cfg.vocab_size, 10000)
    cuda = eng.runner.device.type == "cuda"
    forever = SamplingParams(max_tokens=eng.max_model_len - a.prompt_len, temperature=0.0, ignore_eos=True)
    one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    for i in range(a.num_seqs):
        eng.add_request(f"run-{i}", [rng.randrange(3, vocab) for _ in range(a.prompt_len)], forever)
    while any(eng.requests[f"run-{i}"].num_computed_tokens < a.prompt_len for i in range(a.num_seqs)):
        eng.step()
    joined = 0

    def step(with_prompts: bool) -> float:
        nonlocal joined
        if with_prompts:
            for _ in range(a.join):
                eng.add_request(f"join-{joined}", [rng.randrange(3, vocab) for _ in range(a.prompt_len)], one)
                joined += 1
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        eng.step()
        if cuda:
            torch.cuda.synchronize()
        return time.perf_counter() - start

    for i in range(6):  # warm-up: both kinds of step once or more (kernels built, graphs replayed)
        step(i % 2 == 1)
    times: dict[bool, list[float]] = {False: [], True: []}
    for i in range(a.steps):
        times[i % 2 == 1].append(step(i % 2 == 1))
    med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    graphed = eng.runner.prompt_graphs is not None
    print(f"{a.num_seqs} decoding, {a.join} prompts of {a.prompt_len} joining every other step ({eng.runner.device}, "
          f"{a.dtype}, steps with prompts {'replayed as graphs' if graphed else 'eager'}): decode-only step {med[False]:.2f} ms, step with prompts {med[True]:.2f} ms "
          f"({med[True] / med[False]:.1f}x), medians over {len(times[False])} and {len(times[True])}")
    top: list[list] = []
    if a.profile:
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if cuda else [])]
        with profile(activities=activities) as prof:
            for _ in range(5):
                step(False)
        top = decode_breakdown(prof.key_averages(), 5, a.rows, cuda)
        with profile(activities=activities) as prof:
            for i in range(10):
                step(i % 2 == 1)
        table = prof.key_averages()
        print("\n== torch.profiler, 5 steps with prompts and 5 without: operators by host (self) time")
        print(table.table(sort_by="self_cpu_time_total", row_limit=a.rows))
        if cuda:
            print("== ... by device time")
            print(table.table(sort_by="self_cuda_time_total", row_limit=a.rows))
        prof_py = cProfile.Profile()
        for _ in range(10):  # (the decode-only steps between are left out of it)
            prof_py.enable()
            step(True)
            prof_py.disable()
            step(False)
        for order in ("cumulative", "tottime"):
            out = io.StringIO()
            pstats.Stats(prof_py, stream=out).sort_stats(order).print_stats(a.rows)
            print(f"== cProfile, 10 steps with prompts: Python functions by {order}")
            print(out.getvalue())
    print(json.dumps({"num_seqs": a.num_seqs, "join": a.join, "prompt_len": a.prompt_len,
                      "device": str(eng.runner.device), "prompt_graphs": graphed, "decode_step_ms": round(med[False], 3),
                      "prompt_step_ms": round(med[True], 3), "decode_top": top}))


def decode_breakdown(table, steps: int, rows: int, cuda: bool) -> list[list]:
    """Print where ``steps`` decode-only steps spend their time, by operator or kernel (on CUDA the device's
    time, the kernels inside replayed graphs included; elsewhere the host's), in µs a step; the first eight
    as [name, µs a step] for the JSON line."""
    from torch.autograd import DeviceType

    def spent(e) -> float:
        if not cuda:
            return e.self_cpu_time_total
        # the kernels alone: an eager operator's row holds its kernel's time too (counted twice otherwise), and a
        # user annotation's spans others' (torch.profiler's name for the device's time changed in torch 2.4)
        if e.device_type != DeviceType.CUDA or getattr(e, "is_user_annotation", False):
            return 0.0
        return getattr(e, "self_device_time_total", None) or getattr(e, "self_cuda_time_total", 0.0)

    events = sorted((e for e in table if spent(e) > 0), key=spent, reverse=True)
    total = sum(spent(e) for e in events) / steps
    print(f"\n== torch.profiler, {steps} decode-only steps: {'kernels by device' if cuda else 'operators by host'} "
          f"time, {total:.0f} us a step in all")
    for e in events[:rows]:
        print(f"{spent(e) / steps:>10.1f} us {e.count / steps:>6.1f}x  {e.key[:100]}")
    return [[e.key[:80], round(spent(e) / steps, 1)] for e in events[:8]]


if __name__ == "__main__":
    main()
