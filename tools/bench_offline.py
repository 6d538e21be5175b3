"""Offline throughput benchmark: workload W1 through tokenmill, optionally against Hugging Face.

W1: ``--num-requests`` (32) prompts of random token ids in [0, 10000), prompt lengths
uniform in [32, 256], output lengths uniform in [64, 128], greedy, EOS ignored, seed 0,
on the default model (SmolLM2-135M-Instruct Q4_1 GGUF) unless ``--model`` says otherwise.
``--prompt-len N`` makes every prompt N tokens long (long contexts); ``--hf-overrides`` is passed to
tokenmill (``'{"sliding_window": null}'``: the same model without its window, to compare).

Systems, all in this process, each warmed up with a tiny request before it is timed (tokenmill on CUDA also
with prompts of the workload's lengths: Triton builds its kernels at their first shapes):

- ``tokenmill``: ``LLM.generate`` on the whole workload at once.
- ``hf-sequential`` (``--compare hf``): transformers ``generate()`` one request at a time on the
  first ``--hf-sequential-subset`` requests; its tokens/s stands for the whole workload.
- ``hf-generate-batch`` (``--compare hf``): transformers' continuous batching. ``generate_batch()``
  takes one ``max_new_tokens`` for every request, so we drive the manager it wraps
  (``continuous_batching_context_manager``) and ``add_request`` each prompt with its own
  ``max_new_tokens`` and ``eos_token_id=-1``: the same machinery, exactly W1's token counts.

Both continuous batchers get the same budgets (``--max-num-seqs``, ``--max-num-batched-tokens``),
and HF's paged cache is sized to hold the whole workload, as tokenmill's 1 GiB CPU cache does.

The ceiling is this machine's matmul rate, measured with torch on the model's own weight
shapes in the benchmark's dtype, for M = 32 and M = 256 tokens (before and after the systems
run; the faster is kept). ``ceiling_fraction`` = tokenmill's useful model FLOPs (see
``model_flops``) ÷ its seconds ÷ the better of the two.

Inside tokenmill's run, ``StepProbe`` times every engine step by wrapping methods of the live
engine's objects (the engine's code is untouched; on CUDA each step ends with a synchronize):

- ``decode_vs_floor``: a decode-only step's time ÷ its memory floor, the bytes it must read (every
  weight once, the input embedding only if tied to the LM head, + the KV cache of every sequence in
  it, a sliding layer's only within its window) ÷ the memory bandwidth of a large copy
  (``measure_bandwidth``); the median over decode-only steps, as are ``decode_step_ms`` and
  ``decode_floor_ms``.
- ``host_share``: the steps' time on the host (scheduling, ``ModelRunner._prepare``, the host part of
  ``forward_step`` before the forward, the sampler's launches, ``update_from_output``, turning sampled
  tokens into deltas)
  ÷ their wall time, over all steps.
- ``device_idle_share`` (CUDA): the share of the steps' wall time the device did not spend on a step's
  work (each step's span between the CUDA events around its forward and sampling,
  ``Launched.seconds()``): what the host costs the device. Under asynchronous scheduling the host's work
  for one step overlaps the device's for the one before, so that ``host_share`` may be high while this
  is low; it is the figure issue "GPU path"'s goal of host overhead under 10% means. A step's span runs
  from the end of ``ModelRunner._prepare`` to its sampling's launch, so the device's waits inside it
  count as busy (for ``forward_step``'s host part, and an eager step's launches, and where grammars, bad
  words, DRY or mirostat make its sampling wait for the step before, the host's work between): a lower
  bound.

The last line of output is one JSON object.

    python tools/bench_offline.py                        # tokenmill only
    python tools/bench_offline.py --compare hf           # + transformers generate / generate_batch
    python tools/bench_offline.py --num-requests 8 --dtype bfloat16
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from dataclasses import dataclass

import torch

# Runnable as ``python tools/bench_offline.py`` from a checkout, without installing.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from engine.cli import parse_size  # noqa: E402
from engine.config import KV_CACHE_DTYPES  # noqa: E402

PROMPT_LEN = (32, 256)
OUTPUT_LEN = (64, 128)
TOKEN_ID_HIGH = 10000  # prompt ids are drawn from [0, TOKEN_ID_HIGH)
CEILING_BATCHES = (32, 256)  # M for the ceiling: a decode batch and a prefill chunk
MATMUL_MIN_SECONDS = 0.05  # each of the ceiling's matmuls timed over at least this long (tests: shorter)
BANDWIDTH_BYTES = 512 * 2**20  # the copy that measures memory bandwidth: far past any cache


@dataclass(frozen=True)
class Request:
    prompt: list[int]
    max_tokens: int


@dataclass(frozen=True)
class ModelDims:
    num_layers: int
    hidden: int
    intermediate: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab: int

    @classmethod
    def of(cls, cfg) -> ModelDims:
        """From the engine's reading of the model (``engine.loader.load_model_config``, a folder or a GGUF file
        alike). A mixture of experts' MLP counts as the width a token goes through (its top-k experts' and the
        shared one's), averaged with its dense layers'."""
        width = cfg.intermediate_size
        if cfg.moe is not None:
            m, sparse = cfg.moe, len(cfg.moe.layers)
            routed = m.top_k * m.intermediate_size + m.shared_intermediate_size
            width = round((sparse * routed + (cfg.num_layers - sparse) * cfg.intermediate_size) / cfg.num_layers)
        return cls(num_layers=cfg.num_layers, hidden=cfg.hidden_size, intermediate=width, num_heads=cfg.num_heads,
                   num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim, vocab=cfg.vocab_size)

    def layer_shapes(self) -> list[tuple[int, int]]:
        """(K, N) of each matmul in one decoder layer, q/k/v and gate/up fused."""
        h, hd = self.hidden, self.head_dim
        return [
            (h, (self.num_heads + 2 * self.num_kv_heads) * hd),  # qkv
            (self.num_heads * hd, h),  # o
            (h, 2 * self.intermediate),  # gate_up
            (self.intermediate, h),  # down
        ]

    @property
    def lm_head_shape(self) -> tuple[int, int]:
        return (self.hidden, self.vocab)

    @property
    def non_embedding_params(self) -> int:
        # Matmul weights only: the RMSNorm vectors (~35k values here) do no matmul work.
        return self.num_layers * sum(k * n for k, n in self.layer_shapes())


@dataclass
class Result:
    name: str
    seconds: float
    num_requests: int
    prompt_tokens: int
    output_tokens: int
    note: str = ""

    @property
    def out_tok_s(self) -> float:
        return self.output_tokens / self.seconds

    @property
    def total_tok_s(self) -> float:
        return (self.prompt_tokens + self.output_tokens) / self.seconds


def make_workload(num_requests: int, seed: int, prompt_lens: tuple[int, int] = PROMPT_LEN,
                  output_lens: tuple[int, int] = OUTPUT_LEN) -> list[Request]:
    rng = random.Random(seed)
    requests = []
    for _ in range(num_requests):
        prompt_len = rng.randint(*prompt_lens)
        prompt = [rng.randrange(TOKEN_ID_HIGH) for _ in range(prompt_len)]
        requests.append(Request(prompt, rng.randint(*output_lens)))
    return requests


def workload_tokens(requests: list[Request]) -> tuple[int, int]:
    return sum(len(r.prompt) for r in requests), sum(r.max_tokens for r in requests)


def check_lengths(name: str, requests: list[Request], outputs: list[list[int]]) -> None:
    for i, (r, out) in enumerate(zip(requests, outputs, strict=True)):
        if len(out) != r.max_tokens:
            raise RuntimeError(f"{name}: request {i} made {len(out)} tokens, W1 asks for {r.max_tokens}")


# ---------------------------------------------------------------- ceiling


def model_flops(requests: list[Request], dims: ModelDims) -> int:
    """Useful model FLOPs of a workload: 2·params per token fed, 2·hidden·vocab per logits row needed.

    Each request feeds its prompt plus every output token but the last, and needs one row of
    logits per output token (the last prompt position, then each decode step). Attention's
    own score/value FLOPs are left out, as are recomputations after preemption.
    """
    fed = sum(len(r.prompt) + r.max_tokens - 1 for r in requests)
    logits = sum(r.max_tokens for r in requests)
    k, n = dims.lm_head_shape
    return 2 * dims.non_embedding_params * fed + 2 * k * n * logits


def _time_matmul(x: torch.Tensor, w: torch.Tensor) -> float:
    """Seconds per ``x @ w.T``: best of 3 runs, each repeated for at least ``MATMUL_MIN_SECONDS``."""
    min_seconds = MATMUL_MIN_SECONDS
    for _ in range(2):
        x @ w.T
    reps, t = 1, 0.0
    while True:  # find a repeat count that takes long enough to time
        start = time.perf_counter()
        for _ in range(reps):
            x @ w.T
        t = time.perf_counter() - start
        if t >= min_seconds:
            break
        reps *= 2
    best = t / reps
    for _ in range(2):
        start = time.perf_counter()
        for _ in range(reps):
            x @ w.T
        best = min(best, (time.perf_counter() - start) / reps)
    return best


@torch.inference_mode()
def measure_ceiling(dims: ModelDims, dtype: torch.dtype, m: int) -> float:
    """FLOP/s of one forward pass's matmuls for a batch of ``m`` tokens: total FLOPs ÷ total time."""
    gen = torch.Generator().manual_seed(0)
    flops, seconds = 0, 0.0
    weighted = [(shape, dims.num_layers) for shape in dims.layer_shapes()] + [(dims.lm_head_shape, 1)]
    for (k, n), count in weighted:
        x = torch.randn(m, k, generator=gen).to(dtype)
        w = torch.randn(n, k, generator=gen).to(dtype)
        seconds += count * _time_matmul(x, w)
        flops += count * 2 * m * k * n
    return flops / seconds


# ---------------------------------------------------------------- steps against the memory floor


def measure_bandwidth(device: torch.device, nbytes: int = BANDWIDTH_BYTES, tries: int = 5) -> float:
    """Bytes/s of a large copy on ``device``, each byte counted as read and as written; best of ``tries``."""
    src = torch.ones(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)  # first touch: page faults and allocator growth, not bandwidth
    best = float("inf")
    for _ in range(tries):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            dst.copy_(src)
            end.record()
            end.synchronize()
            seconds = start.elapsed_time(end) / 1e3
        else:
            start = time.perf_counter()
            dst.copy_(src)
            seconds = time.perf_counter() - start
        best = min(best, seconds)
    return 2 * nbytes / best


@dataclass(frozen=True)
class StepReport:
    num_steps: int
    num_decode_steps: int
    decode_step_s: float | None  # medians over the decode-only steps
    decode_floor_s: float | None
    decode_vs_floor: float | None  # each step against its own floor
    host_share: float  # host seconds ÷ wall seconds, over all steps
    bandwidth: float  # bytes/s
    weight_bytes: int
    decode_batch: float | None = None  # mean sequences of a decode-only step
    preemptions: int = 0
    kv_blocks: int = 0  # the KV cache's blocks, and the sliding-window layers' own (0: none)
    kv_window_blocks: int = 0
    draft_tokens: int = 0  # speculative decoding: drafts computed, and kept
    accepted_tokens: int = 0
    device_idle_share: float | None = None  # CUDA: 1 - the steps' device seconds ÷ their wall seconds


class StepProbe:
    """Times the steps of a live ``LLM`` by wrapping its engine objects' methods on the instances.

    Per step: the wall time, the time on the host, and for a decode-only step the tokens of KV cache it
    reads. The host's parts are the scheduler's ``schedule``, ``launched`` and ``observe``, the runner's
    ``_prepare`` and ``forward_step`` up to the model's forward (or a CUDA graph's replay), the sampler's
    ``sample`` (on CUDA it only launches: ``Sampled.result()``, left out, is the wait for the device), and
    the engine's ``_postprocess`` (sampled tokens to deltas).
    """

    def __init__(self, llm) -> None:
        from engine.runtime import kv_block_bytes

        engine = llm.engine
        runner, scheduler = engine.runner, engine.scheduler
        self.cuda = runner.device.type == "cuda"
        self.overlapped = getattr(engine, "async_scheduling", False)
        # Every weight once; the input embedding only as the LM head (of itself a step reads a row a token).
        model = runner.model
        embed, head = model.embed_tokens.weight, model.lm_head.weight
        read = [p for p in model.parameters() if p is not embed or p is head]
        self.weight_bytes = sum(p.numel() * p.element_size() for p in read)
        # a mixture of experts' step reads the experts its tokens are routed to: (E, K, their bytes)
        moe = model.cfg.moe
        experts = [layer.mlp.experts for i, layer in enumerate(model.layers) if model.cfg.sparse(i)]
        self.moe = (moe.num_experts, moe.top_k, sum(e.w13.nbytes + e.w2.nbytes for e in experts)) if moe else None
        cfg = runner.local_cfg
        self.kv_bytes_per_layer_token = kv_block_bytes(cfg, 1, runner.kv_dtype) / cfg.num_layers  # this rank's share
        self.windows = [cfg.window(i) for i in range(cfg.num_layers)]  # a sliding layer reads its window only
        # (wall s, host s, KV bytes if decode-only, sequences)
        self.steps: list[tuple[float, float, float | None, int]] = []
        self.scheduler, self.facts, self.engine = scheduler, runner.facts, engine
        self._host, self._kv_bytes, self._seqs, self._forward_step_start = 0.0, None, 0, None
        self.device_seconds = 0.0  # CUDA: the collected steps' spans between their events

        self._step, self._forward_step = engine.step, runner.forward_step
        self._schedule = self._on_host(scheduler.schedule)
        engine.step, scheduler.schedule, runner.forward_step = self.step, self.schedule, self.forward_step
        # (update_from_output is these two; under asynchronous scheduling the engine calls them apart)
        scheduler.launched, scheduler.observe = self._on_host(scheduler.launched), self._on_host(scheduler.observe)
        engine._postprocess = self._on_host(engine._postprocess)
        runner._prepare = self._on_host(runner._prepare)
        runner.sampler.sample = self._on_host(runner.sampler.sample)
        self._collect, runner.collect = runner.collect, self.collect
        runner.model.forward = self._forward_begins(runner.model.forward)  # nn.Module calls self.forward
        for graphs in (runner.graphs, runner.prompt_graphs):  # (a replayed step calls neither forward)
            if graphs is not None:
                graphs.replay = self._forward_begins(graphs.replay)

    def step(self):
        self._host, self._kv_bytes = 0.0, None
        start = time.perf_counter()
        deltas = self._step()
        # (the sampler's .tolist() has waited already; this makes sure) Not under asynchronous scheduling:
        # a step leaves the next in flight, and a step's time is then the period between the two.
        if self.cuda and not self.overlapped:
            torch.cuda.synchronize()
        self.steps.append((time.perf_counter() - start, self._host, self._kv_bytes, self._seqs))
        return deltas

    def schedule(self):
        batch = self._schedule()
        # decode-only (no drafts either): each sequence reads its KV (windows)
        if len(batch) and batch.num_prompt_tokens == 0 and not batch.num_drafts:
            tokens = sum(min(r.num_tokens, w or r.num_tokens) for r in batch.requests for w in self.windows)
            self._kv_bytes = tokens * self.kv_bytes_per_layer_token
            self._seqs = len(batch.requests)
        return batch

    def collect(self, launched):
        result = self._collect(launched)
        if launched.events is not None:  # (CUDA: timed by its events, once its end has fired)
            self.device_seconds += launched.seconds()
        return result

    def forward_step(self, step_input):
        self._forward_step_start = time.perf_counter()
        return self._forward_step(step_input)

    def _on_host(self, fn):
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self._host += time.perf_counter() - start

        return timed

    def _forward_begins(self, fn):
        """``fn``, first ending the host part of ``forward_step`` where the model's forward begins."""

        def marked(*args, **kwargs):
            if self._forward_step_start is not None:
                self._host += time.perf_counter() - self._forward_step_start
                self._forward_step_start = None
            return fn(*args, **kwargs)

        return marked

    def step_weight_bytes(self, seqs: int) -> int:
        """The weights a decode step of ``seqs`` tokens reads: all of them, but of a mixture of experts'
        only the experts its tokens are routed to, as many as uniform routing would pick on average
        (each expert missed by a token with probability 1 - K/E)."""
        if self.moe is None:
            return self.weight_bytes
        e, k, nbytes = self.moe
        return int(self.weight_bytes - nbytes * (1 - k / e) ** seqs)

    def report(self, bandwidth: float) -> StepReport:
        seconds = sum(w for w, _, _, _ in self.steps)  # (the steps' wall time)
        decodes = [  # (wall s, floor s)
            (wall, (self.step_weight_bytes(seqs) + kv) / bandwidth)
            for wall, _, kv, seqs in self.steps
            if kv is not None
        ]

        def median(values: list[float]) -> float | None:
            return statistics.median(values) if values else None

        return StepReport(
            num_steps=len(self.steps),
            num_decode_steps=len(decodes),
            decode_batch=statistics.mean(seqs for _, _, kv, seqs in self.steps if kv is not None) if decodes else None,
            preemptions=self.scheduler.num_preemptions,
            kv_blocks=self.facts.num_kv_blocks,
            kv_window_blocks=self.facts.num_window_blocks,
            draft_tokens=self.scheduler.num_draft_tokens,
            accepted_tokens=self.scheduler.num_accepted_tokens,
            decode_step_s=median([wall for wall, _ in decodes]),
            decode_floor_s=median([floor for _, floor in decodes]),
            decode_vs_floor=median([wall / floor for wall, floor in decodes]),
            host_share=sum(h for _, h, _, _ in self.steps) / seconds,
            device_idle_share=1 - self.device_seconds / seconds if self.cuda else None,
            bandwidth=bandwidth,
            weight_bytes=self.weight_bytes,
        )


# ---------------------------------------------------------------- systems


def run_tokenmill(
    path: str, requests: list[Request], dtype: str, max_num_seqs: int, max_num_batched_tokens: int,
    async_scheduling: str = "auto", enforce_eager: bool = False, hf_overrides: dict | None = None, **config,
) -> tuple[Result, list, StepReport]:
    """``config``: more of ``EngineConfig`` (kv_cache_memory, kv_cache_dtype, disable_hybrid_kv_cache_manager,
    lora_modules, speculative_config)."""
    from engine import LLM, SamplingParams

    llm = LLM(
        model=path, dtype=dtype, max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
        async_scheduling=async_scheduling, enforce_eager=enforce_eager, hf_overrides=hf_overrides, **config,
    )
    warm = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    llm.generate([[1, 2, 3, 4]], warm)
    if llm.engine.runner.facts.device.type == "cuda":
        # Triton builds a kernel per shape at its first call: prompts of the workload's lengths (other tokens:
        # no prefix-cache hits for the run) build the prefill steps' kernels before the clock starts, or the
        # first system timed pays them (the H200 run of 2026-12-04: 8.9 s against 1.7 s, its decode steps alike)
        llm.generate([[1 + i % 50] * len(r.prompt) for i, r in enumerate(requests[:32])], warm)
    params = [SamplingParams(max_tokens=r.max_tokens, temperature=0.0, ignore_eos=True) for r in requests]
    adapters = list(config.get("lora_modules") or ())  # request i runs with adapter i % len(adapters)
    loras = [adapters[i % len(adapters)] for i in range(len(requests))] if adapters else None
    probe = StepProbe(llm)
    start = time.perf_counter()
    outputs = llm.generate([r.prompt for r in requests], params, lora_request=loras)
    seconds = time.perf_counter() - start
    token_ids = [list(o.token_ids) for o in outputs]
    check_lengths("tokenmill", requests, token_ids)
    report = probe.report(measure_bandwidth(llm.engine.runner.device))
    return Result("tokenmill", seconds, len(requests), *workload_tokens(requests)), token_ids, report


def load_hf(path: str, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM

    if path.endswith(".gguf"):
        model = AutoModelForCausalLM.from_pretrained(
            os.path.dirname(path), gguf_file=os.path.basename(path), dtype=dtype
        )
    else:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    return model.eval()


@torch.inference_mode()
def run_hf_sequential(model, requests: list[Request]) -> tuple[Result, list]:
    from transformers import GenerationConfig

    def generate(prompt: list[int], n: int) -> list[int]:
        config = GenerationConfig(do_sample=False, max_new_tokens=n, pad_token_id=0)
        ids = torch.tensor([prompt])
        out = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config)
        return out[0, ids.shape[1] :].tolist()

    # With no EOS anywhere, generate() runs every request to max_new_tokens (EOS ignored).
    # (eos_token_id=-1 does the same but warns on every call.)
    saved_eos, model.generation_config.eos_token_id = model.generation_config.eos_token_id, None
    try:
        generate([1, 2, 3, 4], 4)  # warm-up
        start = time.perf_counter()
        token_ids = [generate(r.prompt, r.max_tokens) for r in requests]
        seconds = time.perf_counter() - start
    finally:
        model.generation_config.eos_token_id = saved_eos
    check_lengths("hf-sequential", requests, token_ids)
    note = f"generate() one at a time, first {len(requests)} requests"
    return Result("hf-sequential", seconds, len(requests), *workload_tokens(requests), note), token_ids


@torch.inference_mode()
def run_hf_generate_batch(model, requests: list[Request], max_num_seqs: int, max_batch_tokens: int):
    from transformers import ContinuousBatchingConfig, GenerationConfig
    from transformers.generation.continuous_batching.utils import WorkloadHints

    generation_config = GenerationConfig(
        do_sample=False, eos_token_id=-1, max_new_tokens=max(r.max_tokens for r in requests)
    )
    # Size the paged cache to hold the whole workload (no preemption) and give it the same
    # sequence and token budgets as tokenmill; left alone, it sizes itself from free memory.
    page_size = 256
    num_blocks = sum(-(-(len(r.prompt) + r.max_tokens) // page_size) for r in requests) + 2
    cb_config = ContinuousBatchingConfig(
        page_size=page_size,
        num_blocks=num_blocks,
        max_batch_tokens=max_batch_tokens,
        max_requests_per_batch=max_num_seqs,
    )
    hints = WorkloadHints(
        max_prompt_length=max(len(r.prompt) for r in requests),
        max_generated_length=max(r.max_tokens for r in requests),
        num_requests=len(requests),
    )

    def run(manager, batch: list[Request]) -> list[list[int]]:
        ids = [manager.add_request(r.prompt, max_new_tokens=r.max_tokens, eos_token_id=-1) for r in batch]
        results = {}
        while len(results) < len(ids):
            result = manager.get_result(timeout=1)
            if result is None:
                if not manager.is_running():
                    raise RuntimeError("transformers' continuous batching loop stopped")
                continue
            if result.is_finished():
                if result.error is not None:
                    raise RuntimeError(f"transformers' continuous batching: {result.error}")
                results[result.request_id] = result
        return [list(results[i].generated_tokens) for i in ids]

    with model.continuous_batching_context_manager(
        generation_config=generation_config,
        continuous_batching_config=cb_config,
        workload_hints=hints,
    ) as manager:
        run(manager, [Request([1, 2, 3, 4], 4)])  # warm-up
        start = time.perf_counter()
        token_ids = run(manager, requests)
        seconds = time.perf_counter() - start
    check_lengths("hf-generate-batch", requests, token_ids)
    note = "continuous batching manager, per-request max_new_tokens"
    return Result("hf-generate-batch", seconds, len(requests), *workload_tokens(requests), note), token_ids


# ---------------------------------------------------------------- report


def agreement(a: list[list[int]], b: list[list[int]]) -> float:
    """Mean fraction of each output that two systems share as a common prefix (greedy parity)."""
    fractions = []
    for x, y in zip(a, b, strict=False):
        same = 0
        for s, t in zip(x, y, strict=False):
            if s != t:
                break
            same += 1
        fractions.append(same / max(len(x), 1))
    return sum(fractions) / max(len(fractions), 1)


def print_table(results: list[Result]) -> None:
    print(f"{'system':<20}{'out tok/s':>12}{'total tok/s':>14}{'seconds':>10}{'requests':>10}  note")
    for r in results:
        print(
            f"{r.name:<20}{r.out_tok_s:>12.1f}{r.total_tok_s:>14.1f}{r.seconds:>10.2f}"
            f"{r.num_requests:>10}  {r.note}"
        )


def print_steps(s: StepReport) -> None:
    print(
        f"tokenmill steps: {s.num_steps}, {s.num_decode_steps} decode-only"
        + (f" of {s.decode_batch:.1f} sequences on average" if s.decode_batch else "")
        + f"; {s.preemptions} preemptions; host {s.host_share:.0%} of the step time"
        + (f", device idle {s.device_idle_share:.0%} of it" if s.device_idle_share is not None else "")
        + "; memory "
        f"{s.bandwidth / 1e9:.1f} GB/s (copy); KV cache {s.kv_blocks} blocks"
        + (f", sliding-window layers {s.kv_window_blocks}" if s.kv_window_blocks else "")
        + (f"; drafts: {s.accepted_tokens} of {s.draft_tokens} accepted" if s.draft_tokens else "")
    )
    if s.decode_step_s is not None:
        print(
            f"decode step {s.decode_step_s * 1e3:.2f} ms, floor {s.decode_floor_s * 1e3:.2f} ms "
            f"(weights {s.weight_bytes / 2**20:.1f} MiB + KV): {s.decode_vs_floor:.2f}x the floor (medians)"
        )


def step_summary(s: StepReport | None) -> dict:
    """The step figures of the JSON line: None without a tokenmill run (or without a decode-only step)."""

    def get(name: str, scale: float = 1.0, digits: int = 4) -> float | None:
        value = getattr(s, name, None)
        return None if value is None else round(value * scale, digits)

    return {
        "num_steps": getattr(s, "num_steps", None),
        "num_decode_steps": getattr(s, "num_decode_steps", None),
        "decode_batch": get("decode_batch", digits=2),
        "preemptions": getattr(s, "preemptions", None),
        "kv_blocks": getattr(s, "kv_blocks", None),
        "kv_window_blocks": getattr(s, "kv_window_blocks", None),
        "draft_tokens": getattr(s, "draft_tokens", None),
        "accepted_tokens": getattr(s, "accepted_tokens", None),
        "decode_step_ms": get("decode_step_s", 1e3),
        "decode_floor_ms": get("decode_floor_s", 1e3),
        "decode_vs_floor": get("decode_vs_floor", digits=3),
        "host_share": get("host_share"),
        "device_idle_share": get("device_idle_share"),
        "mem_bandwidth_gb_s": get("bandwidth", 1e-9, 2),
        "weight_bytes": getattr(s, "weight_bytes", None),
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="HF folder or .gguf file (default: bundled SmolLM2-135M)")
    p.add_argument("--num-requests", type=int, default=32)
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=2048,
        help="token budget per step (chunked prefill), for tokenmill and HF continuous batching",
    )
    p.add_argument("--async-scheduling", choices=("auto", "on", "off"), default="auto",
                   help="tokenmill's steps overlapped with the next one's scheduling (auto: on CUDA)")
    p.add_argument("--enforce-eager", action="store_true",
                   help="tokenmill's decode steps without CUDA or CPU graphs")
    p.add_argument("--compare", choices=("none", "hf"), default="none")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--hf-sequential-subset",
        type=int,
        default=4,
        help="requests run through HF generate() one at a time (0 = skip)",
    )
    p.add_argument("--skip-tokenmill", action="store_true", help="run only the HF systems and the ceiling")
    p.add_argument("--prompt-len", type=int, default=None, metavar="N",
                   help="every prompt N tokens long instead of W1's 32 to 256 (long contexts: a sliding window's "
                        "effect, say)")
    p.add_argument("--output-len", type=int, default=None, metavar="N",
                   help="every request N output tokens instead of W1's 64 to 128 (decode-heavy runs)")
    p.add_argument("--hf-overrides", type=json.loads, default=None, metavar="JSON",
                   help="tokenmill's --hf-overrides, e.g. '{\"sliding_window\": null}' (the HF systems read the "
                        "folder as it is)")
    p.add_argument("--kv-cache-memory", type=parse_size, default=None, metavar="BYTES",
                   help="tokenmill's KV cache memory (512M, 2GiB; default: its own, 1 GiB on the CPU)")
    p.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default="auto",
                   help="what tokenmill's KV cache holds (fp8: a quarter of fp32's bytes per token)")
    p.add_argument("--lora-modules", nargs="+", default=None, metavar="NAME=PATH",
                   type=lambda text: tuple(text.split("=", 1)),
                   help="LoRA adapters (PEFT folders, tools/random_lora.py): request i runs with the (i mod N)th")
    p.add_argument("--max-loras", type=int, default=None, metavar="N",
                   help="tokenmill's LoRA slots, as with adapters loaded while serving: every projection ready at "
                        "--max-lora-rank 16 (--lora-modules take the first)")
    p.add_argument("--speculative-config", type=json.loads, default=None, metavar="JSON",
                   help="tokenmill's speculative decoding, e.g. '{\"method\": \"ngram\", \"num_speculative_tokens\": 4}' "
                        "(W1's random prompts: what drafts cost where they are rarely right)")
    p.add_argument("--disable-hybrid-kv-cache-manager", action="store_true",
                   help="tokenmill's sliding-window layers keep every block (no pool of their own)")
    p.add_argument("--batch-invariant", action="store_true",
                   help="tokenmill's batch-invariant mode (CPU): what making greedy output independent of the batch costs")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    from engine.model_path import resolve_model_path

    path = resolve_model_path(args.model)
    dtype = getattr(torch, args.dtype)
    prompt_lens = (args.prompt_len, args.prompt_len) if args.prompt_len else PROMPT_LEN
    output_lens = (args.output_len, args.output_len) if args.output_len else OUTPUT_LEN
    requests = make_workload(args.num_requests, args.seed, prompt_lens, output_lens)
    prompt_tokens, output_tokens = workload_tokens(requests)
    print(
        f"W1: {len(requests)} requests, {prompt_tokens} prompt + {output_tokens} output tokens, "
        f"{args.dtype}, {torch.get_num_threads()} threads, model {path}",
        flush=True,
    )

    from engine.loader import load_model_config

    dims = ModelDims.of(load_model_config(path))
    ceilings = {m: measure_ceiling(dims, dtype, m) for m in CEILING_BATCHES}
    print("ceiling: " + ", ".join(f"M={m} {f / 1e9:.1f} GFLOP/s" for m, f in ceilings.items()), flush=True)

    results: list[Result] = []
    outputs: dict[str, list[list[int]]] = {}
    steps: StepReport | None = None
    if not args.skip_tokenmill:
        result, outputs["tokenmill"], steps = run_tokenmill(
            path, requests, args.dtype, args.max_num_seqs, args.max_num_batched_tokens, args.async_scheduling,
            args.enforce_eager, args.hf_overrides, kv_cache_memory=args.kv_cache_memory,
            kv_cache_dtype=args.kv_cache_dtype,
            disable_hybrid_kv_cache_manager=args.disable_hybrid_kv_cache_manager,
            lora_modules=dict(args.lora_modules) if args.lora_modules else None, max_loras=args.max_loras,
            speculative_config=args.speculative_config, batch_invariant=args.batch_invariant,
        )
        results.append(result)
        print(f"tokenmill: {result.out_tok_s:.1f} out tok/s", flush=True)
    if args.compare == "hf":
        model = load_hf(path, dtype)
        if args.hf_sequential_subset > 0:
            subset = requests[: args.hf_sequential_subset]
            result, outputs["hf-sequential"] = run_hf_sequential(model, subset)
            results.append(result)
            print(f"hf-sequential: {result.out_tok_s:.1f} out tok/s", flush=True)
        result, outputs["hf-generate-batch"] = run_hf_generate_batch(
            model, requests, args.max_num_seqs, args.max_num_batched_tokens
        )
        results.append(result)
        print(f"hf-generate-batch: {result.out_tok_s:.1f} out tok/s", flush=True)

    # Measured again at the end, keeping the faster: a ceiling should not sag because
    # something else had the cores for a moment (2-core machines are often shared).
    ceilings = {m: max(f, measure_ceiling(dims, dtype, m)) for m, f in ceilings.items()}
    ceiling = max(ceilings.values())
    print()
    print_table(results)
    print("ceiling: " + ", ".join(f"M={m} {f / 1e9:.1f} GFLOP/s" for m, f in ceilings.items()))
    if steps:
        print_steps(steps)
    by_name = {r.name: r for r in results}

    def rate(name: str) -> float | None:
        return round(by_name[name].out_tok_s, 2) if name in by_name else None

    tm = by_name.get("tokenmill")
    hf_batch = by_name.get("hf-generate-batch")
    flops = model_flops(requests, dims)
    summary = {
        "workload": "W1",
        "num_requests": len(requests),
        "prompt_len_range": list(prompt_lens),
        "hf_overrides": args.hf_overrides,
        "kv_cache_memory": args.kv_cache_memory,
        "kv_cache_dtype": args.kv_cache_dtype,
        "disable_hybrid_kv_cache_manager": args.disable_hybrid_kv_cache_manager,
        "speculative_config": args.speculative_config,
        "batch_invariant": args.batch_invariant,
        "output_len_range": list(output_lens),
        "token_id_high": TOKEN_ID_HIGH,
        "prompt_tokens": prompt_tokens,
        "output_tokens": output_tokens,
        "seed": args.seed,
        "greedy": True,
        "ignore_eos": True,
        "model": path,
        "dtype": args.dtype,
        "async_scheduling": args.async_scheduling,
        "enforce_eager": args.enforce_eager,
        "max_num_seqs": args.max_num_seqs,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "threads": torch.get_num_threads(),
        "tokenmill_out_tok_s": rate("tokenmill"),
        "tokenmill_total_tok_s": round(tm.total_tok_s, 2) if tm else None,
        "tokenmill_seconds": round(tm.seconds, 3) if tm else None,
        "hf_sequential_out_tok_s": rate("hf-sequential"),
        "hf_sequential_subset": args.hf_sequential_subset if "hf-sequential" in by_name else None,
        "hf_generate_batch_out_tok_s": rate("hf-generate-batch"),
        "ratio_vs_hf_generate_batch": round(tm.out_tok_s / hf_batch.out_tok_s, 3)
        if tm and hf_batch
        else None,
        "ratio_vs_hf_sequential": (
            round(tm.out_tok_s / by_name["hf-sequential"].out_tok_s, 3)
            if tm and "hf-sequential" in by_name
            else None
        ),
        "model_gflop": round(flops / 1e9, 2),
        "ceiling_gflop_s": round(ceiling / 1e9, 2),
        **{f"ceiling_gflop_s_m{m}": round(f / 1e9, 2) for m, f in ceilings.items()},
        "ceiling_fraction": round(flops / tm.seconds / ceiling, 4) if tm else None,
        **step_summary(steps),
    }
    if "tokenmill" in outputs:
        for other in ("hf-sequential", "hf-generate-batch"):
            if other in outputs:
                key = "greedy_agreement_vs_" + other.replace("-", "_")
                summary[key] = round(agreement(outputs["tokenmill"], outputs[other]), 4)
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
