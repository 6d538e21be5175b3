"""The host's work in a decode step at many sequences, the model taken out: what stands between the GPU
and a step as short as its memory floor (issue "GPU path": a step at 256 sequences is host-bound).

A tiny random model (two layers, 64 wide) whose forward and logits are stubbed out, so that what is left
of a step is the engine's Python and the few host-side tensors it builds: scheduling, ``_prepare``, the
host part of ``forward_step`` (index tensors, block tables, the inputs of a decode graph), the sampler,
``_postprocess``. As on CUDA, a decode step is padded to a graph's batch size and replays it (stubbed).
``--num-seqs`` requests run one round at a time; each round times ``--steps`` decode-only steps after
their prompts. Per stage, the minimum and the median over rounds of the mean per step (the minimum is
the steadier figure on a shared machine). Device-independent: the same Python runs before a GPU's
launches, though a CUDA launch costs more host time than a CPU tensor op.

``--eager-layers N`` times instead steps that carry prompt tokens beside the decodes, as a busy server's
are, through a model of N layers run eagerly with its Triton kernels (through the interpreter's imports)
and its GEMMs stubbed out: the host work of an eager step's launches, which a GPU cannot hide either.
``--prompt-graphs`` times such steps as CUDA runs them by default: each step with prompt tokens padded
to a prompt graph's token count and replayed (stubbed), the model stubbed out as for decode steps.

``--waiting N`` times decode steps of a full server: N requests wait behind the full seats, with the
scheduler delay CUDA's graphs get (``--scheduling-policy priority``: a waiting request may preempt).
``--long-queue`` makes them 4000-token prompts with seats free for them: each step carries a 512-token chunk
of one (the cap fixed there) beside the decodes, and the others wait for it.

``--logprobs K``: every request asks for its tokens' top K logprobs (a step's logits have 64 columns then).
Every run also times ``encode``, the engine actor's msgpack frame of a step's outputs, and ``decode``, a
frontend's reading of it back into deltas: not part of ``step``.

``--before DIR`` times another checkout (a ``git worktree`` of an older commit) the same way, in turns
with this one, and prints both side by side. The last line is one JSON object.

    python tools/bench_host.py                                  # greedy, 256 sequences
    python tools/bench_host.py --sampling top_p --before /tmp/old
    python tools/bench_host.py --sampling top_p --race          # top-p sampled as on CUDA
    python tools/bench_host.py --eager-layers 24 --before /tmp/old
    python tools/bench_host.py --prompt-graphs --before /tmp/old
    python tools/bench_host.py --waiting 1000 --scheduling-policy priority --before /tmp/old
    python tools/bench_host.py --waiting 1000 --scheduling-policy fair --clients 256 --before /tmp/old
    python tools/bench_host.py --waiting 1000 --long-queue --before /tmp/old
    python tools/bench_host.py --logprobs 20 --before /tmp/old     # every row's top 20 logprobs
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import types

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STAGES = ("schedule", "prepare", "forward_step", "model", "sample", "postprocess", "step", "encode", "decode")
SAMPLING = {"greedy": {"temperature": 0.0}, "top_p": {"temperature": 0.8, "top_p": 0.95},
            "seeded": {"temperature": 0.8, "top_p": 0.95, "seed": 7}}
HIDDEN = 64


def measure(num_seqs: int, steps: int, rounds: int, sampling: str, async_scheduling: str,
            eager_layers: int = 0, race: bool = False, prompt_graphs: bool = False, waiting: int = 0,
            policy: str = "fcfs", long_queue: bool = False, logprobs: int | None = None,
            clients: int = 8) -> dict[str, list[float]]:
    """Per stage, each round's mean seconds per decode step. ``eager_layers``: instead, steps that also carry two
    new 128-token prompts, through a model of that many layers whose Triton kernels and GEMMs are stubbed out
    (the Python of an eager step's launches, ``model``; on the CPU, through Triton's interpreter's imports).
    ``race``: non-greedy rows sample as on CUDA, through the race kernel (stubbed: its host side is timed).
    ``prompt_graphs``: steps that carry two new 128-token prompts beside the decodes, replayed through prompt
    graphs as on CUDA (stubbed). ``waiting``: that many requests wait behind the full seats (``max_num_seqs``
    is ``num_seqs``) through the timed decode steps, with CUDA's scheduler delay (a full server's steps);
    ``long_queue``: they are 4000-token prompts with seats free, each step one's 512-token chunk beside the
    decodes. ``logprobs``: every request asks for its tokens' top that many logprobs. ``clients``: under fair,
    the requests are of that many clients, in turns (the running ones' and the waiting ones'). Beside the engine's
    stages, ``encode`` (the actor's frame of a step's outputs) and ``decode`` (a frontend's: the frame read
    back into its deltas)."""
    if eager_layers:
        os.environ["TRITON_INTERPRET"] = "1"  # (before anything imports triton)
    import torch

    import kernels

    if eager_layers:
        kernels.set_backend("triton")
    if race:
        kernels.races = lambda device: True
        kernels.sample_race = lambda logits, *args, **kwargs: torch.zeros(len(logits), dtype=torch.int64)

    from engine import LLM, SamplingParams, protocol
    from engine import server as engine_server
    from engine.step_buffers import DecodeGraphs, decode_buckets
    from tools.random_model import build

    path = build(tempfile.mkdtemp(), "qwen2", torch.float32, seed=0, hidden_size=HIDDEN, intermediate_size=128,
                 num_hidden_layers=eager_layers or 2, num_attention_heads=4, num_key_value_heads=2,
                 vocab_size=4096, max_position_embeddings=8192 if long_queue else 2048)
    arrivals = 2 * steps if eager_layers or prompt_graphs else 0
    # (on the CPU wherever it runs: the stubs are host tensors, and the host's work is what is timed)
    seats = num_seqs + arrivals + (waiting if long_queue else 0)
    llm = LLM(path, dtype="float32", device="cpu", max_num_seqs=seats, num_kv_blocks=64 * (num_seqs + arrivals),
              max_model_len=8192 if long_queue else 2048 if prompt_graphs else 512, async_scheduling=async_scheduling,
              enforce_eager=bool(eager_layers), scheduling_policy=policy,
              **({"scheduler_delay_factor": 1.0, "max_num_waiting_requests": num_seqs + waiting} if waiting else {}),
              **({"long_prefill_token_threshold": 512} if long_queue else {}))
    engine, runner = llm.engine, llm.engine.runner
    if eager_layers:
        _stub_kernels()
    else:
        hidden = torch.zeros(max(num_seqs, 2048), HIDDEN)
        runner.model.forward = lambda ids, positions, meta, images=None: hidden[:len(ids)]
        # (8 columns: the argmax costs nothing; 64 random ones where logprobs are asked, the top 20 of them)
        table = torch.randn(max(num_seqs, 2048), 64) if logprobs is not None else torch.zeros(max(num_seqs, 2048), 8)
        runner.model.compute_logits = lambda h: table[:len(h)]
        # as on CUDA: every decode step padded to a graph's batch size and replayed, the replay stubbed (what is
        # left is the host's work around it)
        runner.decode_buckets = decode_buckets(num_seqs)
        runner.graphs = types.SimpleNamespace(serves=lambda b: True, inputs_of=getattr(DecodeGraphs, "inputs_of", None),
                                              replay=functools.partial(_replayed, hidden))
        if prompt_graphs:  # as on CUDA: one prefill launch a layer takes a step's prompts and decodes, padded
            from engine.step_buffers import PromptGraphs, prompt_buckets

            kernels.prefill_takes_decodes = lambda *args: True
            runner.prompt_graphs = graphs = PromptGraphs.__new__(PromptGraphs)  # (its padding, its replay stubbed)
            graphs.sizes, graphs.max_seqs = prompt_buckets(runner._prompt_graph_tokens(2048)), num_seqs + arrivals + 1
            graphs.tables, graphs.replay = runner.block_tables, lambda inputs, t: hidden[:t]
    if hasattr(engine_server, "freeze_heap"):
        engine_server.freeze_heap()  # (as the engine's process does once it has started: its heap frozen)
    spent: dict[str, list[float]] = {stage: [] for stage in STAGES}  # each round's decode steps' seconds
    timing = [False]  # (prompts and the tails of the rounds are not counted)

    def timed(obj, name: str, stage: str) -> None:
        fn = getattr(obj, name)

        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                if timing[0]:
                    spent[stage][-1] += time.perf_counter() - start

        setattr(obj, name, wrapper)

    for obj, name, stage in ((engine.scheduler, "schedule", "schedule"), (runner, "_prepare", "prepare"),
                             (runner, "forward_step", "forward_step"), (runner.sampler, "sample", "sample"),
                             (engine, "_postprocess", "postprocess"), (engine, "step", "step"),
                             (runner.model, "forward", "model")):  # (nn.Module calls self.forward)
        timed(obj, name, stage)
    arrived = 0
    # (behind full seats, none of the round's may finish while timed, however many steps their prompts took
    # beside others' decodes on a busy machine: a seat would free. As long as the context allows; aborted once
    # timed)
    full = waiting and not long_queue
    params = SamplingParams(max_tokens=512 - 64 if full else steps + (64 if waiting else 8), ignore_eos=True,
                            logprobs=logprobs, **SAMPLING[sampling])
    # fair: the requests of that many clients (a keyword the other policies' checkouts, --before's, may not know)
    who = (lambda i: {"client": f"c{i % clients}"}) if policy == "fair" else (lambda i: {})
    for k in range(rounds + 1):  # (the first round warms up)
        for i in range(num_seqs):
            engine.add_request(f"{k}-{i}", [(7 * i + 13 * k + j) % 4000 + 3 for j in range(64)], params, **who(i))
        while engine.scheduler.waiting or any(r.num_computed_tokens < r.num_prompt_tokens
                                              for r in engine.scheduler.running):
            engine.step()
        for stage in STAGES:
            spent[stage].append(0.0)
        queued = [f"{k}-w{i}" for i in range(waiting)]  # (behind the full seats, or a long queue with seats)
        for i, request_id in enumerate(queued):
            engine.add_request(request_id, [(5 * i + 17 * k + j) % 4000 + 3 for j in range(4000 if long_queue else 64)],
                               params, **who(i))
        # a long queue flowing, as a busy server's is: the scheduler delay holds a new prompt for as long as a step
        # with prompt tokens took, which a few short timed steps may not outlast (untimed)
        while long_queue and not any(r.request_id in queued for r in engine.scheduler.running):
            engine.step()
        timing[0] = True
        for _ in range(steps):
            for _ in range(2 if arrivals else 0):
                engine.add_request(f"new-{arrived}", [(11 * arrived + j) % 4000 + 3 for j in range(128)], params)
                arrived += 1
            out = engine.step()
            start = time.perf_counter()
            frame = protocol.encode(out)
            encoded = time.perf_counter()
            list(protocol.decode(frame))
            spent["encode"][-1] += encoded - start
            spent["decode"][-1] += time.perf_counter() - encoded
        timing[0] = False
        for stage in STAGES:
            spent[stage][-1] /= steps
        if not long_queue and sum(r.request_id in queued for r in engine.scheduler.running):
            sys.exit("a waiting request joined while timed: not a full server's steps")
        engine.abort(queued + ([r.request_id for r in engine.scheduler.running] if full else []))
        while engine.has_work():
            engine.step()
    return {stage: values[1:] for stage, values in spent.items()}


def _replayed(hidden, inputs, *rest):
    """A stubbed decode graph's replay: ``replay(inputs, b)``, or (``--before`` an older checkout) its
    ``replay(ids, positions, table_rows)``."""
    return hidden[:rest[0] if len(rest) == 1 else len(inputs)]


def _stub_kernels() -> None:
    """Every Triton kernel a launch that does nothing, and ``F.linear`` an empty result: what is left of a
    forward is its Python and the small host-side tensor ops."""
    import importlib
    import pkgutil

    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import KernelInterface

    import kernels.triton

    class Launch:
        def __getitem__(self, grid):
            return lambda *args, **kwargs: None

    for info in pkgutil.iter_modules(kernels.triton.__path__):
        module = importlib.import_module(f"kernels.triton.{info.name}")
        for name, value in vars(module).items():
            if isinstance(value, (KernelInterface, InterpretedFunction)):
                setattr(module, name, Launch())

    class Functional:
        def __getattr__(self, name):
            return getattr(torch_functional, name)

        @staticmethod
        def linear(x, weight, bias=None):
            return x.new_empty(*x.shape[:-1], weight.shape[0])

    torch_functional = kernels.F
    kernels.F = Functional()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--num-seqs", type=int, default=256)
    p.add_argument("--steps", type=int, default=40, help="decode-only steps timed per round")
    p.add_argument("--rounds", type=int, default=12)
    p.add_argument("--sampling", choices=sorted(SAMPLING), default="greedy")
    p.add_argument("--async-scheduling", choices=("on", "off"), default="off")
    p.add_argument("--eager-layers", type=int, default=0, metavar="N",
                   help="time steps that also carry two new 128-token prompts, run eagerly through a model of N "
                        "layers with its Triton kernels and GEMMs stubbed out (CPU only): an eager step's host work")
    p.add_argument("--prompt-graphs", action="store_true",
                   help="time steps that also carry two new 128-token prompts, replayed through prompt graphs as on "
                        "CUDA (stubbed)")
    p.add_argument("--race", action="store_true",
                   help="non-greedy rows sample as on CUDA: through the race kernel, stubbed (its host side timed)")
    p.add_argument("--waiting", type=int, default=0, metavar="N",
                   help="N requests wait behind the full seats (max_num_seqs is --num-seqs) through the decode steps, "
                        "with CUDA's scheduler delay: a full server's steps")
    p.add_argument("--long-queue", action="store_true",
                   help="with --waiting: 4000-token prompts, seats free for them, each step one's 512-token chunk "
                        "beside the decodes")
    p.add_argument("--scheduling-policy", choices=("fcfs", "priority", "short-first", "fair"), default="fcfs",
                   help="fair: the requests of --clients clients")
    p.add_argument("--clients", type=int, default=8, metavar="N",
                   help="under fair: the requests are of N clients, in turns (N = --num-seqs: a seat each)")
    p.add_argument("--logprobs", type=int, metavar="K", help="every request asks for its tokens' top K logprobs")
    p.add_argument("--before", metavar="DIR", help="another checkout to time the same way, in turns with this one")
    p.add_argument("--turns", type=int, default=3, help="with --before: runs of each checkout")
    p.add_argument("--raw", action="store_true", help=argparse.SUPPRESS)  # (a --before run's child: JSON only)
    args = p.parse_args()
    flags = ["--num-seqs", str(args.num_seqs), "--steps", str(args.steps), "--rounds", str(args.rounds),
             "--sampling", args.sampling, "--async-scheduling", args.async_scheduling,
             "--eager-layers", str(args.eager_layers), *(["--race"] if args.race else []),
             *(["--prompt-graphs"] if args.prompt_graphs else []), "--waiting", str(args.waiting),
             "--scheduling-policy", args.scheduling_policy, "--clients", str(args.clients),
             *(["--long-queue"] if args.long_queue else []),
             *(["--logprobs", str(args.logprobs)] if args.logprobs is not None else [])]
    if args.long_queue and not args.waiting:
        p.error("--long-queue needs --waiting N")
    if args.waiting and (args.eager_layers or args.prompt_graphs):
        p.error("--waiting times decode steps: not with --eager-layers or --prompt-graphs")
    if args.raw:
        print(json.dumps(measure(args.num_seqs, args.steps, args.rounds, args.sampling, args.async_scheduling,
                                 args.eager_layers, args.race, args.prompt_graphs, args.waiting,
                                 args.scheduling_policy, args.long_queue, args.logprobs, args.clients)))
        return
    checkouts = {"this": HERE, **({"before": os.path.abspath(args.before)} if args.before else {})}
    runs: dict[str, dict[str, list[float]]] = {name: {stage: [] for stage in STAGES} for name in checkouts}
    for _ in range(args.turns if args.before else 1):
        for name, checkout in reversed(checkouts.items()):  # (the older first in each turn)
            path = os.pathsep.join([checkout, *filter(None, [os.environ.get("PYTHONPATH")])])  # (the wheels' too)
            out = subprocess.run([sys.executable, os.path.abspath(__file__), *flags, "--raw"], cwd=checkout,
                                 env=dict(os.environ, PYTHONPATH=path), capture_output=True, text=True)
            if out.returncode:
                sys.exit(f"{checkout}: bench_host.py {' '.join(flags)} failed:\n{out.stderr}")
            for stage, values in json.loads(out.stdout.strip().splitlines()[-1]).items():
                runs[name][stage] += values
    what = (f"step of {args.num_seqs} decodes and two 128-token prompts, eager, {args.eager_layers} layers stubbed"
            if args.eager_layers else f"step of {args.num_seqs} decodes and two 128-token prompts, prompt graphs"
            if args.prompt_graphs else f"decode step at {args.num_seqs} sequences"
            + (f", {args.waiting} waiting" if args.waiting else "")
            + (" 4000-token prompts with seats free, one's 512-token chunk a step" if args.long_queue else ""))
    print(f"host time per {what} ({args.sampling}{', race as on CUDA' if args.race else ''}"
          f"{f', top {args.logprobs} logprobs' if args.logprobs is not None else ''}, "
          f"{args.scheduling_policy}{f' of {args.clients} clients' if args.scheduling_policy == 'fair' else ''}, "
          f"asynchronous scheduling {args.async_scheduling}), µs: min / "
          f"median over {args.rounds} rounds{f' x {args.turns} turns' if args.before else ''}")
    names = list(reversed(checkouts))
    print(f"{'stage':14s}" + "".join(f"{name:>20s}" for name in names))
    result = {}
    for stage in STAGES:
        cells = []
        for name in names:
            v = runs[name][stage]
            result.setdefault(name, {})[stage] = {"min_us": min(v) * 1e6, "median_us": statistics.median(v) * 1e6}
            cells.append(f"{min(v) * 1e6:9.1f} / {statistics.median(v) * 1e6:7.1f}")
        print(f"{stage:14s}" + "".join(f"{c:>20s}" for c in cells))
    if args.before:
        ratio = result["this"]["step"]["min_us"] / result["before"]["step"]["min_us"]
        print(f"step: this checkout's minimum is {ratio:.2f}x the other's")
    print(json.dumps({"num_seqs": args.num_seqs, "sampling": args.sampling, "race": args.race,
                      "async_scheduling": args.async_scheduling,
                      "eager_layers": args.eager_layers, "prompt_graphs": args.prompt_graphs, "waiting": args.waiting, "long_queue": args.long_queue,
                      "scheduling_policy": args.scheduling_policy, "clients": args.clients, "logprobs": args.logprobs,
                      "step_min_us": result["this"]["step"]["min_us"], **result}))


if __name__ == "__main__":
    main()
