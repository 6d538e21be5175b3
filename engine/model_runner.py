"""Turns a scheduled batch into flat tensors, runs the model, samples.

Owns the model, the KV cache tensors, the block tables and the sampler. Per step: token ids,
positions, slot mapping, block tables and sequence lengths for every scheduled token, built with
a handful of tensor ops (not a Python loop over tokens), then one forward pass, logits only for
the rows that sample, one sampler call.

The host's work per step does not grow with the context held: every running request's block
table is a row of one persistent tensor on the device (``engine.step_buffers``), written only where it
grew since the request's last step, and the step's integer inputs (token ids, the index tensors
of ``StepIndex``, those writes) reach the device together (``Staging``: on CUDA one pinned
buffer, one asynchronous copy).

On CUDA (unless ``enforce_eager``) decode-only steps replay CUDA graphs (``DecodeGraphs``)
captured at start-up for a few batch sizes (``decode_buckets``): such a step is padded to the
next size with one-token sequences that write and read only a scratch KV block, one past the
blocks the block manager hands out, and whose logits nobody asks for. Steps with prompt tokens
replay graphs of their own (``PromptGraphs``), per padded token count (``prompt_buckets``) up to
``prompt_graph_tokens``, where Triton's prefill kernel takes the whole step. On the CPU (one rank, the
C kernels built) decode-only steps of up to ``CPU_GRAPH_SEQS`` sequences replay CPU graphs
(``kernels.cpu.graph``), each recorded by the first step of its size, unpadded.

A request decoding with speculative drafts (``engine.speculative``) is ``k + 1`` one-token sequences
on its block table, its token then each draft, the i-th after i more cached positions: a step of
decodes and drafts is a decode step (its kernel, its graphs), and each of those rows is sampled, as
that token would be alone (the drafts before it counting as its output).

A step is ``launch``ed (inputs staged, forward, sampler: all queued on the device, nothing waited
for) then ``collect``ed (its ids copied to the host: the sync); ``execute`` does both. Under
asynchronous scheduling the engine launches step N+1 before collecting N: a request with a token
in flight gets it as its input from N's sampled ids, gathered on the device by row.

Under tensor parallelism (``engine.parallel``) rank 0's runner starts the other ranks,
whose runners mirror it: each step rank 0 turns the batch into a plain-data ``StepInput``,
sends it to them (``TPGroup.driving``) and every rank runs ``forward_step`` on it; rank 0
alone gets the logits (all the step's rows in one call: the gather is collective) and samples.
Each rank keeps its own block tables, written with rank 0's writes.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import time
from bisect import bisect_left
from dataclasses import dataclass, field

import torch

import kernels
from engine.attention import StepIndex, build_metadata, ints
from engine.config import EngineConfig
from engine.loader import build_model, load_model_config
from engine.lora import Adapter, AdapterError, LoraState, LoraWeights, attach, put, read_adapter
from engine.models.config import ModelConfig
from engine.models.layers import ColumnLinear, LMHead, RowLinear
from engine.models.moe import Experts
from engine.parallel import StepInput, TPGroup, local_model_config
from engine.pooling import pool, pool_rows, to_bytes
from engine.protocol import SamplingParams
from engine.request import Request
from engine.runtime import (
    RuntimeFacts,
    count_kv_blocks,
    measured_cuda_budget,
    pick_device,
    pick_dtype,
    pick_kv_dtype,
    pick_max_model_len,
    window_layers,
)
from engine.sampler import (
    Sampled,
    Sampler,
    SamplerOutput,
    SamplingState,
    logprob_entries,
    logprob_tensors,
    to_device,
)
from engine.scheduler import ScheduledBatch
from engine.step_buffers import (
    BlockTables,
    Capture,
    DecodeGraphs,
    PromptGraphs,
    Staging,
    cuda_graph_capture,
    decode_buckets,
    prompt_buckets,
)
from engine.tp_worker import launch
from kernels.cpu import graph as cpu_graph

log = logging.getLogger("tokenmill.engine")

# CPU graphs: decode steps of up to this many sequences, recordings of this many rows in all kept
CPU_GRAPH_SEQS, CPU_GRAPH_ROWS = 32, 64


@dataclass
class StepResult:
    sampled: list[Request]  # requests that got a new token this step, in row order
    output: SamplerOutput | None  # a row per sampled request, and one more per draft it had
    pooled: list[tuple[Request, bytes]] = field(default_factory=list)  # embedding requests done: their vectors
    drafts: list[list[int]] | None = None  # each sampled request's drafts (None: no request had any)

    @functools.cached_property
    def accepted(self) -> list[int]:
        """Each sampled request's drafts kept (with ``drafts``): those before the first whose row's sampled
        token, the one that follows the position before it, is not that draft."""
        kept, ids, row = [], self.output.token_ids, 0
        for drafts in self.drafts:
            n = 0
            while n < len(drafts) and ids[row + n] == drafts[n]:
                n += 1
            kept.append(n)
            row += len(drafts) + 1
        return kept


@dataclass
class Launched:
    """A step on its way: what it samples is still on the device (``collect`` waits for it)."""

    sampled: list[Request]  # in row order
    output: Sampled | None
    launch_seconds: float = 0.0  # the launch's time on the host (on the CPU, the whole step's compute)
    events: tuple[torch.cuda.Event, torch.cuda.Event] | None = None  # CUDA: around the step's device work
    # prompt logprobs still on the device: each request and (logprobs, top logprobs, top ids) of its span
    prompt_logprobs: list[tuple[Request, tuple[torch.Tensor, ...]]] = field(default_factory=list)
    pooled: list[tuple[Request, torch.Tensor]] = field(default_factory=list)  # embeddings, on the device
    drafts: list[list[int]] | None = None  # as StepResult's
    logits: torch.Tensor | None = None  # the sample rows' logits, from launch_forward until launch_sampling

    def to_host(self) -> None:
        """Start copying what ``collect`` reads to the host (pinned memory), without waiting: the copies
        are queued behind this step alone, where reading a device tensor would also wait for the steps
        queued behind it (asynchronous scheduling's next one). Done once ``events[1]``, recorded after
        them, is."""
        if self.output is not None:
            self.output = self.output.to_host()
        self.prompt_logprobs = [(r, tuple(t.to("cpu", non_blocking=True) for t in tensors))
                                for r, tensors in self.prompt_logprobs]
        self.pooled = [(r, v.to("cpu", non_blocking=True)) for r, v in self.pooled]

    def seconds(self) -> float:
        """How long the step took the device, once collected: between its CUDA events, or on the CPU
        (which computes as it launches) the launch's time."""
        if self.events is None:
            return self.launch_seconds
        # (a step that sampled nothing, a prompt's chunk, was never waited for: CUDA refuses to time a pending event)
        self.events[1].synchronize()
        return self.events[0].elapsed_time(self.events[1]) / 1e3


@dataclass
class DriverStep(StepInput):
    """Rank 0's step: what every rank gets, and (asynchronous scheduling) whether some of its tokens are
    still in flight; the rows embedding requests pool and which of them each row is summed into
    (``engine.pooling``); the rows that are images' and their embeddings (one rank only: the vision tower
    is not split)."""

    in_flight: bool = False  # some token_ids are -1: sampled by the step in flight (BlockTables.last_tokens)
    sample_table_rows: list[int] = field(default_factory=list)  # (feeds_next_step) each sampled row's table row
    pool_rows: list[int] = field(default_factory=list)
    pool_into: list[int] = field(default_factory=list)
    num_pooled: int = 0
    image_rows: list[int] = field(default_factory=list)  # rows whose input is an image's embedding...
    image_embeds: torch.Tensor | None = None  # ...these, in that order (on the device)


def check_batch_invariant(config: EngineConfig, model_cfg: ModelConfig, device: torch.device,
                          dtype: torch.dtype) -> None:
    """A ValueError that says why, where batch-invariant mode cannot hold (before the weights load): every
    step must go to the C kernels, which take CPU tensors of float32 or bfloat16 and heads of a multiple of 8 up
    to 256 wide (blocks of up to 256 tokens: every --block-size)."""
    from kernels.cpu import attention, matmul

    if device.type != "cpu" or kernels.backend() != "auto":
        why = "runs on the CPU only, with its own kernels (TOKENMILL_KERNELS=auto)"
    elif model_cfg.encoder is not None:
        why = "is for generating models: an encoder's attention pads its inputs in groups"
    elif dtype not in (torch.float32, torch.bfloat16):
        why = f"needs float32 or bfloat16, not {str(dtype).removeprefix('torch.')}"
    elif not (attention.available() and matmul.packed_available()):
        why = "needs the C kernels, which could not be built here (see the warning above)"
    elif not attention.decodes_in_c(model_cfg.head_dim, config.block_size):
        why = f"needs heads a multiple of 8 up to {attention.MAX_D} wide (this model's: {model_cfg.head_dim})"
    else:
        return
    raise ValueError(f"batch_invariant {why}")


class ModelRunner:
    def __init__(self, config: EngineConfig, model_path: str, tp: TPGroup | None = None):
        device = pick_device(config)
        dtype = pick_dtype(config, device)
        self.model_cfg = load_model_config(model_path, config.hf_overrides)
        if config.batch_invariant:
            check_batch_invariant(config, self.model_cfg, device, dtype)
        found = self.model_cfg.quant.method if self.model_cfg.quant else None
        if config.quantization and config.quantization.removesuffix("_marlin") != found:
            raise ValueError(f"--quantization {config.quantization}, but {model_path} is " + (
                f"{found.upper()} int4" if found else "a GGUF file (its own quantization)"
                if model_path.endswith(".gguf") else "not quantized"))
        max_model_len = pick_max_model_len(config, self.model_cfg, device)
        if self.model_cfg.encoder is not None and (config.tensor_parallel_size > 1 or config.lora_modules
                                                   or config.max_loras or config.speculative_config):
            raise ValueError(f"an encoder ({self.model_cfg.model_type}) is served on one rank, without LoRA adapters "
                             "or speculative decoding (--data-parallel-size runs more of them)")
        if self.model_cfg.encoder is not None and config.max_num_batched_tokens < max_model_len:
            log.info("max_num_batched_tokens raised from %d to max_model_len, %d: an encoder computes each input "
                     "whole, in one step", config.max_num_batched_tokens, max_model_len)
            config = dataclasses.replace(config, max_num_batched_tokens=max_model_len)
        self.config = config  # (an encoder's budget raised: the one the engine schedules by)
        # rank 0 starts the other ranks (one rank: a group of one); a worker brings its group
        self.tp = tp if tp is not None else launch(config, model_path, self.model_cfg, device)
        device = self.tp.device_for(device)
        self.local_cfg = local_model_config(self.model_cfg, self.tp.size)  # this rank's heads
        torch.manual_seed(config.seed)
        self.model = build_model(model_path, self.model_cfg, max_model_len, dtype, device, self.tp, config.tokenizer)
        score = self.model.score  # a sequence classifier's head: its pooled state's scores, in float32
        self._head = (lambda v: score(v.to(score.weight.dtype)).float()) if score is not None else None
        self.initial_adapters: dict[str, int] = {}  # the LoRA adapters of lora_modules -> their slots (engine.lora)
        self.lora: LoraState | None = None
        self.max_lora_rank = config.max_lora_rank
        if config.lora_modules or config.max_loras:
            adapters = [read_adapter(name, path, config.max_lora_rank, dtype)
                        for name, path in (config.lora_modules or {}).items()]
            slots = config.max_loras or len(adapters)  # (with max_loras: any adapter may come later, any rank)
            rank = config.max_lora_rank if config.max_loras else max(a.rank for a in adapters)
            self.lora = LoraState(slots, max(config.max_num_batched_tokens, config.max_num_seqs), dtype, device)
            self._lora_layers = attach(self.model, adapters, rank, self.lora, every_layer=bool(config.max_loras))
            self.initial_adapters = {a.name: slot for slot, a in enumerate(adapters)}
            log.info("LoRA: %d slots of rank %d on the device, %d taken (%s)%s", slots, rank, len(adapters),
                     ", ".join(f"{a.name}: rank {a.rank}, {len(a.weights)} matrices" for a in adapters) or "none",
                     "; the others take adapters loaded while serving" if config.max_loras else "")
        if device.type == "cpu":
            kernels.set_batch_invariant(config.batch_invariant)  # (and before every step: engines share it)
            if config.batch_invariant:
                log.info("batch-invariant mode: every linear layer in the C kernel, every prompt's attention "
                         "as decode rows (a token's logits do not depend on its step)")
        if device.type == "cpu" and not config.batch_invariant:  # which CPU GEMM serves which layer, measured
            modules = list(self.model.modules())
            kernels.tune_linear([m.weight for m in modules if isinstance(m, (ColumnLinear, RowLinear, LMHead))]
                                + [w for m in modules if isinstance(m, Experts) for w in (*m.w13, *m.w2)]
                                + [w for m in modules if isinstance(m, LoraWeights) for w in m.spans()])
        self.block_size, self.device, self.dtype = config.block_size, device, dtype
        self.kv_dtype = kv_dtype = pick_kv_dtype(config, dtype)
        self.sampler = Sampler(self.model_cfg.vocab_size, list(self.model_cfg.eos_token_ids), device, config.seed)
        cuda_budget = None
        if device.type == "cuda" and config.num_kv_blocks is None:
            # the KV cache gets what is left after the weights and the largest step's activations
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)
            # (an encoder pads a step's inputs in groups, to at most twice their tokens: measured so)
            padded = 2 if self.model_cfg.encoder is not None else 1
            profiled = padded * min(config.max_num_batched_tokens, config.max_num_seqs * max_model_len)
            forward_peak = self.profile_run(profiled, min(config.max_num_batched_tokens, config.max_step_rows),
                                            max_model_len)
            cuda_budget = measured_cuda_budget(config, device)
            # the prompt graphs' memory pool keeps their largest forward's activations for good
            cuda_budget -= forward_peak * self._prompt_graph_tokens(max_model_len) // profiled
            torch.cuda.empty_cache()
        self.window_layers = window_layers(config, self.model_cfg, max_model_len)
        num_blocks, num_window_blocks = count_kv_blocks(config, self.local_cfg, device, kv_dtype, max_model_len,
                                                        cuda_budget)
        if self.window_layers and self.tp.min_over_ranks(num_window_blocks) == 0:  # a rank keeps every block
            num_blocks, num_window_blocks = count_kv_blocks(
                dataclasses.replace(config, disable_hybrid_kv_cache_manager=True), self.local_cfg, device, kv_dtype,
                max_model_len, cuda_budget)
        num_blocks = self.tp.min_over_ranks(num_blocks)  # every rank's slice of the cache has as many blocks
        num_window_blocks = self.tp.min_over_ranks(num_window_blocks)
        if not num_window_blocks:
            self.window_layers = []
        self.facts = RuntimeFacts(model_path, device, dtype, kv_dtype, max_model_len, num_blocks, num_window_blocks,
                                  self.model_cfg.sliding_window if num_window_blocks else 0)
        if self.model_cfg.encoder is None:
            self.model.rotary.serve(min(max_model_len, num_blocks * self.block_size))  # (the engine's length)
        self._allocate_kv_cache()
        max_blocks = -(-max_model_len // self.block_size)
        self.block_tables = BlockTables(config.max_num_seqs, max_blocks, num_blocks, device,
                                        num_window_blocks if num_window_blocks else None)
        self.staging = Staging(device)
        # asynchronous scheduling (the engine's): each step's sampled tokens are kept in their rows of
        # BlockTables.last_tokens, for the next step, launched before they are known (known before the graphs
        # are captured: without it, theirs take no token from last_tokens)
        self.feeds_next_step = config.overlapped(device.type)[0]
        self._sample_table_rows = torch.empty(0, dtype=torch.int64, device=device)  # (the step's: forward_step's)
        self.decode_buckets: list[int] = []  # decode-only steps are padded to these batch sizes
        self.graphs: DecodeGraphs | None = None
        self.prompt_graphs: PromptGraphs | None = None
        # none for an encoder (no decode steps, only prompts of one token), nor with the reference kernels:
        # their decode would gather every sequence to max_model_len
        eager = config.enforce_eager or self.model_cfg.encoder is not None
        if device.type == "cuda" and not eager and kernels.backend() != "reference":
            self.decode_buckets = decode_buckets(config.max_num_seqs)
            start, capture = time.perf_counter(), cuda_graph_capture()  # (one memory pool for all: one replays at a time)
            with torch.inference_mode():
                self.graphs = DecodeGraphs(self.model, self.decode_buckets, max_model_len, self.block_tables,
                                           self.block_size, self.model_cfg.hidden_size, dtype, device, capture,
                                           in_flight=self.feeds_next_step)
            log.info("CUDA graphs: decode steps of %d batch sizes up to %d captured in %.1f s (--enforce-eager: "
                     "none)", len(self.decode_buckets), config.max_num_seqs, time.perf_counter() - start)
            self._capture_prompt_graphs(capture, self._prompt_graph_tokens(max_model_len))
        # on the CPU not where decode attention is the reference's (see above), nor for a mixture of
        # experts: its routing is read on the host, which a recording would freeze
        elif (device.type == "cpu" and not eager and kernels.backend() == "auto" and self.tp.size == 1
              and self.model_cfg.moe is None
              and kernels.cpu.decodes_in_c(self.model_cfg.head_dim, self.block_size)):
            self.graphs = DecodeGraphs(self.model, list(range(1, min(config.max_num_seqs, CPU_GRAPH_SEQS) + 1)),
                                       max_model_len, self.block_tables, self.block_size,
                                       self.model_cfg.hidden_size, dtype, device, cpu_graph.capture(), lazy=True,
                                       max_rows=CPU_GRAPH_ROWS, in_flight=self.feeds_next_step,
                                       variant=(lambda: self.lora.span) if self.lora is not None else None)

    def _prompt_graph_tokens(self, max_model_len: int) -> int:
        """The most tokens a step with prompt tokens may have to replay a graph (``PromptGraphs``; 0: none): where
        one prefill launch a layer takes such a step (Triton's kernels); at most the step budget and the model's
        length (the padding sequence's positions). With LoRA adapters too: the graphs read each token's slot from
        ``LoraState.mine``, set before the replay, and compute every slot, as the decode graphs do (a padding
        token's rows there may be an earlier step's: its outputs are dropped, and no other row reads them)."""
        c = self.config
        if (c.enforce_eager or self.model_cfg.encoder is not None
                or not kernels.prefill_takes_decodes(self.device)):
            return 0
        return min(c.prompt_graph_tokens, c.max_num_batched_tokens, max_model_len)

    def _capture_prompt_graphs(self, capture: Capture, tokens: int) -> None:
        """``PromptGraphs`` of up to ``tokens`` (``_prompt_graph_tokens``); with one rank, a capture that fails
        leaves them off (with more, it fails the start: another rank may wait in a collective for this one)."""
        if not tokens:
            return
        config, tables = self.config, self.block_tables
        start = time.perf_counter()
        try:
            with torch.inference_mode():
                self.prompt_graphs = PromptGraphs(
                    self.model, prompt_buckets(tokens), config.max_step_rows + 1, self.facts.max_model_len, tables,
                    self.block_size, self.model_cfg.hidden_size, self.dtype, self.device, capture,
                    in_flight=self.feeds_next_step)
        except Exception as e:  # noqa: BLE001 - such steps still run, eagerly
            if self.tp.size > 1:
                raise
            log.warning("CUDA graphs for steps with prompt tokens off: the capture failed (%s: %s)", type(e).__name__, e)
            return
        log.info("CUDA graphs: steps with prompt tokens of %d token counts up to %d captured in %.1f s "
                 "(--prompt-graph-tokens 0: none)", len(self.prompt_graphs.sizes), tokens, time.perf_counter() - start)

    def load_adapter(self, slot: int, name: str, path: str, adapter: Adapter | None = None) -> None:
        """LoRA adapter ``name`` (PEFT folder ``path``; ``adapter``: read already) into ``slot`` on every rank, in
        place of the slot's last one (engine.lora.put); ``AdapterError`` if it cannot be served, the slot then
        empty."""
        # refused here, no other rank hears of it
        adapter = adapter or read_adapter(name, path, self.max_lora_rank, self.dtype)
        self.tp.send_adapter(slot, name, path)
        self.put_adapter(slot, name, path, adapter)

    def put_adapter(self, slot: int, name: str, path: str, adapter: Adapter | None = None) -> None:
        """Every rank's part of ``load_adapter`` (a worker reads the folder itself): the ranks agree on whether
        each of them could, or all leave the slot empty."""
        error = None
        try:
            put(self._lora_layers, slot, adapter or read_adapter(name, path, self.max_lora_rank, self.dtype))
        except Exception as e:  # noqa: BLE001 - whatever stopped this rank, every rank must hear of it
            error = e
        if self.tp.min_over_ranks(int(error is None)) == 0:
            for layer in self._lora_layers.values():
                layer.lora.clear(slot)
            if isinstance(error, AdapterError):
                raise error
            raise AdapterError(f"LoRA adapter {name!r} ({path}): "
                               + (f"{type(error).__name__}: {error}" if error else "a tensor-parallel rank could not "
                                  "load it (its log says why)"))

    def _allocate_kv_cache(self) -> None:
        # one block more than the block manager hands out (in each pool): the scratch block of padding
        # sequences, which is also every block's window block until it has one of its own
        f = self.facts
        self.kv_cache, self.window_kv_cache = self._attach_kv_cache(
            f.num_kv_blocks + 1, f.num_window_blocks + 1 if f.num_window_blocks else 0)

    def _attach_kv_cache(self, num_blocks: int, num_window_blocks: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """The full layers' cache, and the sliding-window pool's (``num_window_blocks``; 0: every layer in
        the first), their layers pointed at them."""
        cfg = self.local_cfg
        in_pool = set(self.window_layers) if num_window_blocks else set()

        def zeros(blocks: int, layers: int) -> torch.Tensor:
            # Zeros, not empty: padded slots are read (masked) by attention, and NaN * 0 is NaN.
            shape = (2, layers, blocks, self.block_size, cfg.num_kv_heads, cfg.head_dim)
            return torch.zeros(shape, dtype=self.kv_dtype, device=self.device)

        layers = 0 if cfg.encoder is not None else cfg.num_layers - len(in_pool)  # (an encoder caches nothing)
        caches = zeros(num_blocks, layers), zeros(num_window_blocks, len(in_pool))
        self._point_layers_at(*caches)
        return caches

    def _point_layers_at(self, cache: torch.Tensor, window_cache: torch.Tensor) -> None:
        index = [0, 0]  # each layer's index in its cache
        for i, layer in enumerate(self.model.layers):
            attn = layer.self_attn.attn
            attn.in_window_pool = window_cache.shape[1] > 0 and i in self.window_layers
            c = window_cache if attn.in_window_pool else cache
            j = index[attn.in_window_pool]
            index[attn.in_window_pool] += 1
            attn.k_cache, attn.v_cache = c[0, j], c[1, j]

    @torch.inference_mode()
    def profile_run(self, num_tokens: int, num_seqs: int, max_model_len: int) -> int:
        """The step with the largest activations, run once so that CUDA can measure its peak: a forward
        of ``num_tokens`` prompt tokens (in sequences of at most ``max_model_len``), logits for all of them
        (as prompt logprobs may ask), and the sampler's heaviest path (top-k, typical, top-p and llama.cpp's
        other truncations) over ``num_seqs`` rows. Returns the forward's own peak, in bytes of activations
        (CUDA; 0 elsewhere). The KV cache is a temporary one."""
        lens = [max_model_len] * (num_tokens // max_model_len) + [num_tokens % max_model_len]
        lens = [n for n in lens if n]
        kept = (self.kv_cache, self.window_kv_cache) if hasattr(self, "kv_cache") else None
        self._attach_kv_cache(sum(-(-n // self.block_size) for n in lens))
        tables, first = [], 0
        for n in lens:
            tables.append(list(range(first, first + -(-n // self.block_size))))
            first += len(tables[-1])
        positions, meta = build_metadata(lens, [0] * len(lens), tables, self.block_size, self.device)
        cuda = self.device.type == "cuda"
        before = torch.cuda.memory_allocated(self.device) if cuda else 0
        hidden = self.model(torch.zeros(num_tokens, dtype=torch.int64, device=self.device), positions, meta)
        forward_peak = torch.cuda.max_memory_allocated(self.device) - before if cuda else 0
        logits = self.model.compute_logits(hidden) if self.model.lm_head is not None else None
        params = SamplingParams(temperature=1.0, top_k=50, top_p=0.9, typical_p=0.9, top_n_sigma=3.0,
                                xtc_probability=1.0, dynatemp_range=0.5)
        if logits is not None:  # None on tensor-parallel workers: rank 0 samples
            logits = logits[:num_seqs] if num_seqs <= num_tokens else logits[-1:].expand(num_seqs, -1)
            self.sampler(logits, [params] * num_seqs, [SamplingState(params) for _ in range(num_seqs)],
                         [[0]] * num_seqs, [[]] * num_seqs)
        if kept is not None:  # called again on a running engine (tests): put the real cache back
            self._point_layers_at(*kept)
        return forward_peak

    def execute(self, batch: ScheduledBatch) -> StepResult:
        """Run ``batch`` and wait for its tokens."""
        return self.collect(self.launch(batch))

    def launch(self, batch: ScheduledBatch) -> Launched:
        """Run ``batch`` up to its sampled ids (and prompt logprobs) on the device, without waiting for
        them: ``launch_forward`` then ``launch_sampling``."""
        return self.launch_sampling(self.launch_forward(batch))

    @torch.inference_mode()
    def launch_forward(self, batch: ScheduledBatch) -> Launched:
        """Launch ``batch``'s forward, up to its logits (and prompt logprobs, pooled vectors), without waiting:
        ``launch_sampling`` samples them. The host may collect the step before meanwhile (its rows' bad words,
        DRY, mirostat and grammars read its tokens there): the device runs this forward behind it. A request
        whose token a step still running samples (asynchronous scheduling) reads it from its row of
        ``BlockTables.last_tokens``, on the device: no host round trip."""
        start = time.perf_counter()
        events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) \
            if self.device.type == "cuda" else None
        step, sampled, drafts, logprob_spans, pool_spans = self._prepare(batch)
        if events is not None:
            events[0].record()
        with self.tp.driving(step):  # the other ranks get the step first; one that died fails it
            logits, sums = self.forward_step(step)  # (R, V): the prompt-logprob rows, then the sample rows
        n = sum(hi - lo for _, lo, hi in logprob_spans)  # the prompt-logprob rows come first
        pending = self._prompt_logprobs(logprob_spans, logits[:n]) if logprob_spans else []
        pooled = []
        if pool_spans:
            vectors = pool([(r.pool, c, r.num_tokens, final) for r, c, final in pool_spans], sums, self._head)
            pooled = [(r, v) for (r, _, _), v in zip(pool_spans, vectors, strict=True) if v is not None]
        return Launched(sampled, None, time.perf_counter() - start, events, pending, pooled, drafts,
                        logits[n:] if sampled else None)

    @torch.inference_mode()
    def launch_sampling(self, launched: Launched) -> Launched:
        """Sample ``launch_forward``'s logits on the device, from the requests' state as it is now, and start
        copying the step's results to the host (CUDA): ``collect`` waits for those copies alone, not for the
        steps queued behind."""
        start, (sampled, drafts, logits) = time.perf_counter(), (launched.sampled, launched.drafts, launched.logits)
        if logits is not None:
            if drafts is None:
                rows = sampled, [r.output_token_ids for r in sampled], [len(r.output_token_ids) + r.num_in_flight
                                                                        for r in sampled]
            else:  # a request's row at each draft, sampled as if the drafts before it were its output
                rows = [], [], []
                for r, d in zip(sampled, drafts, strict=True):
                    for i in range(len(d) + 1):
                        rows[0].append(r)
                        rows[1].append(r.output_token_ids + d[:i] if i and r.sampling_state.reads_output
                                       else r.output_token_ids)
                        rows[2].append(r.num_sampled + i)
            reqs, outputs, counts = rows
            out = self.sampler.sample(logits, [r.params for r in reqs], [r.sampling_state for r in reqs],
                                      [r.prompt_token_ids for r in reqs], outputs, counts,
                                      self._tokens_in_flight if self.feeds_next_step else None)
            if self.feeds_next_step:  # (no drafts then: one row a request)
                self.block_tables.last_tokens[self._sample_table_rows] = out.ids
            launched.output, launched.logits = out, None
        if launched.events is not None:  # (read on the device, they would wait for every step queued behind)
            launched.to_host()
            launched.events[1].record()
        for r, tensors in launched.prompt_logprobs:  # the launch has succeeded: these positions are on their way
            r.num_prompt_logprobs_in_flight += len(tensors[0])
        launched.launch_seconds += time.perf_counter() - start
        return launched

    def _tokens_in_flight(self, rows: list[int]) -> torch.Tensor:
        """The tokens in flight of these sampled rows of the step being launched (asynchronous scheduling), on
        the device: their rows of ``BlockTables.last_tokens``, not yet written by this step."""
        return self.block_tables.last_tokens[self._sample_table_rows[to_device(rows, self.device)]]

    def collect(self, launched: Launched) -> StepResult:
        """The launched step's tokens (and prompt logprobs) on the host: waits for the device."""
        if launched.events is not None:  # (CUDA: the copies to_host queued)
            launched.events[1].synchronize()
        # all converted before anything changes: should the sync raise, the step can be collected again
        done = [(r, logprob_entries(*tensors)) for r, tensors in launched.prompt_logprobs]
        vectors = to_bytes([v for _, v in launched.pooled])
        pooled = list(zip([r for r, _ in launched.pooled], vectors, strict=True))
        launched.prompt_logprobs = []
        for r, lists in done:
            r.prompt_logprobs.extend(lists)
            r.num_prompt_logprobs_in_flight -= len(lists)
        return StepResult(launched.sampled, launched.output.result() if launched.output is not None else None,
                          pooled, launched.drafts)

    @torch.inference_mode()
    def forward_step(self, step: StepInput) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The forward every rank runs (tensor-parallel workers mirror rank 0 through it): the
        (R, V) logits of ``step.logits_rows`` on rank 0 (None on the others or when R is 0), and
        there the (P, hidden) float32 sums of the rows each embedding request pools (or None)."""
        if self.device.type == "cpu" and kernels.batch_invariant() != self.config.batch_invariant:
            kernels.set_batch_invariant(self.config.batch_invariant)  # (the mode is the process's: engines share it)
        driver = isinstance(step, DriverStep)
        t, b, has_images = len(step.token_ids), len(step.query_lens), driver and bool(step.image_rows)
        cached, unsplit, graphs = step.computed_lens, False, None
        if t > b:  # prompt tokens: one prefill launch a layer takes them all, decodes too, where that is faster
            unsplit = kernels.prefill_takes_decodes(self.device, max(cached, default=0),
                                                    sum(cached) * self.local_cfg.num_kv_heads)
            if (self.prompt_graphs is not None and not has_images and (unsplit or 1 not in step.query_lens)
                    and self.prompt_graphs.serves(t, b)):
                graphs = self.prompt_graphs
        elif self.graphs is not None and not has_images and self.graphs.serves(t):
            graphs = self.graphs
        if graphs is not None:  # its inputs in one tensor, one copy in: the graph makes the metadata from them
            tensors = {"graph_inputs": graphs.inputs_of(step.token_ids, step.query_lens, cached, step.table_rows)}
        else:
            index = StepIndex.build(step.query_lens, cached, step.table_rows, split=not unsplit)
            tensors = {"token_ids": ints(step.token_ids), **index.tensors}
        pooling = {"pool_rows": ints(step.pool_rows), "pool_into": ints(step.pool_into)} \
            if driver and step.pool_rows else {}
        images = {"image_rows": ints(step.image_rows)} if has_images else {}
        lora = {"lora_slots": torch.repeat_interleave(ints(step.lora_slots), ints(step.query_lens))} \
            if self.lora is not None else {}  # each token's adapter slot
        feeds = {"sample_table_rows": ints(step.sample_table_rows)} if driver and self.feeds_next_step else {}
        # a decode step's logits rows are most often its first ones, its sequences' (not the padding's): a slice
        first = step.logits_rows == list(range(len(step.logits_rows)))  # (no index tensor, no gather)
        rows = {} if first else {"logits_rows": ints(step.logits_rows)}
        dev = self.staging({**tensors, **rows, "write_at": ints(step.write_at), "write_ids": ints(step.write_ids),
                            **pooling, **images, **lora, **feeds})
        tables = self.block_tables.write(dev["write_at"], dev["write_ids"])
        if self.lora is not None:
            self.lora.set(dev["lora_slots"])
            # (CUDA graphs, captured with every slot, compute them all whatever this says: zeros, added)
            self.lora.span = max(step.lora_slots, default=-1) + 1
        if feeds:  # where each sampled token is kept: its row's last_tokens (launch writes it)
            self._sample_table_rows = dev["sample_table_rows"]
        if graphs is not None:  # (the graph takes the tokens in flight from last_tokens itself)
            hidden = graphs.replay(dev["graph_inputs"], t)
        else:
            ids = dev["token_ids"]
            if driver and step.in_flight:
                ids = torch.where(ids < 0, self.block_tables.last_tokens[dev["token_table_rows"]], ids)
            index.tensors = dev
            positions, meta = index.metadata(tables, self.block_size, self.block_tables.window_map)
            hidden = self.model(ids, positions, meta, (dev["image_rows"], step.image_embeds) if images else None)
        sums = None
        if driver and step.num_pooled:  # (a span may pool no row: a CLS embedding's chunk after its first)
            sums = torch.zeros(step.num_pooled, hidden.shape[1], dtype=torch.float32, device=hidden.device)
            if pooling:
                sums.index_add_(0, dev["pool_into"], hidden[dev["pool_rows"]].float())
        if not step.logits_rows:  # the same on every rank: no gather to skip on one side only
            return None, sums
        return self.model.compute_logits(hidden[:len(step.logits_rows)] if first else hidden[dev["logits_rows"]]), sums

    def _prepare(self, batch: ScheduledBatch) -> tuple[
            DriverStep, list[Request], list[list[int]] | None, list[tuple[Request, int, int]],
            list[tuple[Request, int, bool]]]:
        reqs, counts, d = batch.requests, batch.num_new_tokens, batch.num_decodes
        starts = [r.num_computed_tokens for r in reqs]
        tokens: list[int] = []
        logprob_rows: list[int] = []  # rows whose logits give prompt logprobs...
        spans: list[tuple[Request, int, int]] = []  # ...of positions [lo, hi) of these requests
        pool_spans: list[tuple[Request, int, bool]] = []  # embedding requests: chunk start, whether the last
        pooled_rows: list[int] = []  # their rows to pool...
        pool_into: list[int] = []  # ...and the span each is summed into
        image_rows: list[int] = []  # rows that are images'...
        image_parts: list[tuple[Request, int, int, int]] = []  # ...each run of them: request, image, its slice
        # the decodes (the batch's first requests, most of a busy step's): the one token each samples from
        # (known, or the one a step in flight samples: -1, read on the device from BlockTables.last_tokens),
        # then its drafts; it samples at each of them
        if not batch.num_drafts and self.model.vision is None:  # (no drafts, no image's: most steps, in one go)
            tokens = [r.all_token_ids[c] if c < len(r.all_token_ids) else -1
                      for r, c in zip(reqs[:d], starts, strict=False)]
        else:
            self._decode_tokens(reqs[:d], starts, counts, tokens, image_rows, image_parts)
        in_flight = -1 in tokens
        sampled = reqs[:d]  # sequences whose every token is now computed...
        sample_rows = list(range(len(tokens)))  # ...their last token's row in the flat batch (and their drafts')
        # each one's drafts, after its last token (engine.speculative)
        drafts = ([r.draft_token_ids[:n - 1] for r, n in zip(sampled, counts, strict=False)]
                  if batch.num_drafts else None)
        finals: list[int] = []  # the prompt chunks that sample (their requests' index in the batch)
        # the prompt chunks (and an embedding's last prompt token)
        for i, (r, c, n) in enumerate(zip(reqs[d:], starts[d:], counts[d:], strict=True), d):
            row = len(tokens)
            if r.images:
                _image_runs(r, row, c, n, image_rows, image_parts)
            known = r.num_tokens + r.num_in_flight
            tokens += r.all_token_ids[c:c + n]
            if r.params.prompt_logprobs is not None and c < r.num_prompt_tokens:
                if r.prompt_logprobs is None:
                    r.prompt_logprobs = [None]  # the first token has no context
                # Position p predicts token p + 1 (stored at index p + 1); skip positions already
                # done (or on their way) before a preemption made this request recompute its prompt.
                lo = max(c, r.prompt_logprobs_end - 1)
                hi = min(c + n, r.num_prompt_tokens - 1)  # exclusive
                if hi > lo:
                    logprob_rows.extend(range(row + lo - c, row + hi - c))
                    spans.append((r, lo, hi))
            final = c + n == known
            if r.pool is not None:
                pooling = pool_rows(r.pool, row, c, n, final)
                if pooling or final:
                    pooled_rows.extend(pooling)
                    pool_into.extend([len(pool_spans)] * len(pooling))
                    pool_spans.append((r, c, final))
            elif final:
                sampled.append(r)
                sample_rows.append(row + n - 1)
                finals.append(i)
                if drafts is not None:
                    drafts.append([])
        rows, write_at, write_ids = self.block_tables.update(reqs, batch.window_writes)
        # (asynchronous scheduling, which has no drafts) the rows of the tables each sampled token is kept in
        sample_table_rows = rows[:d] + [rows[i] for i in finals] if self.feeds_next_step else []
        slots = [r.lora_slot for r in reqs] if self.lora is not None else []
        if drafts is not None:
            ks = [n - 1 for n in counts[:d]] + [0] * (len(reqs) - d)  # each request's drafts this step
            counts, starts, rows, slots = _split_drafts(ks, counts, starts, rows, slots)
        step = DriverStep(counts, starts, tokens, logprob_rows + sample_rows, rows, write_at, write_ids, slots,
                          in_flight=in_flight, sample_table_rows=sample_table_rows, pool_rows=pooled_rows,
                          pool_into=pool_into, num_pooled=len(pool_spans), image_rows=image_rows,
                          image_embeds=self._image_embeds(image_parts))
        if self.decode_buckets and max(counts) == 1 and len(counts) <= self.decode_buckets[-1]:
            self._pad(step)
        return step, sampled, drafts, spans, pool_spans

    @staticmethod
    def _decode_tokens(decodes: list[Request], starts: list[int], counts: list[int], tokens: list[int],
                       image_rows: list[int], image_parts: list[tuple[Request, int, int, int]]) -> None:
        """``_prepare``'s decodes, one at a time: each one's token (-1: in flight), then its drafts; an
        image's placeholder's decode, its run."""
        for r, c, n in zip(decodes, starts, counts, strict=False):
            if r.images:  # (the decode of a prompt's last token, an image's)
                _image_runs(r, len(tokens), c, 1, image_rows, image_parts)
            tokens.append(r.all_token_ids[c] if c < len(r.all_token_ids) else -1)
            if n > 1:
                tokens += r.draft_token_ids[:n - 1]

    def _image_embeds(self, parts: list[tuple[Request, int, int, int]]) -> torch.Tensor | None:
        """The embeddings of each (request, image, first, end) run of image rows, in order: images not yet
        encoded go through the vision tower together; each is kept on its request until its last run."""
        if not parts:
            return None
        new = list(dict.fromkeys((r, i) for r, i, _, _ in parts if i not in r.image_embeds))
        if new:
            pixels = torch.stack([torch.frombuffer(bytearray(r.images[i].pixels), dtype=torch.float32).view(
                r.images[i].shape) for r, i in new])
            pixels = to_device(pixels, self.device).to(self.dtype)  # (queued: no wait for a step in flight)
            for (r, i), e in zip(new, self.model.vision(pixels), strict=True):
                r.image_embeds[i] = e
        out = []
        for r, i, lo, hi in parts:
            out.append(r.image_embeds[i][lo:hi])
            if hi == r.images[i].length:  # its last rows: the prompt has gone past it
                del r.image_embeds[i]
        return torch.cat(out)

    def _pad(self, step: DriverStep) -> None:
        """Pad a decode-only step to the next of ``decode_buckets`` with one-token sequences that
        write and read only the scratch block (new lists: the first ones are the batch's)."""
        b = len(step.query_lens)
        n = self.decode_buckets[bisect_left(self.decode_buckets, b)] - b
        t = self.block_tables
        step.query_lens = step.query_lens + [1] * n
        step.computed_lens = step.computed_lens + [0] * n
        step.token_ids = step.token_ids + [0] * n
        step.table_rows = step.table_rows + [t.scratch_row] * n
        if self.lora is not None:
            step.lora_slots = step.lora_slots + [-1] * n

    @staticmethod
    def _prompt_logprobs(spans: list[tuple[Request, int, int]],
                         logits: torch.Tensor) -> list[tuple[Request, tuple[torch.Tensor, ...]]]:
        """Logprobs of each prompt token given the ones before it, for this chunk of each span's prompt,
        on the device (``collect`` appends them to the requests'): no host sync at launch."""
        pending, row = [], 0
        for r, lo, hi in spans:
            targets = to_device(r.prompt_token_ids[lo + 1:hi + 1], logits.device, torch.long)
            pending.append((r, logprob_tensors(logits[row:row + hi - lo], targets, r.params.prompt_logprobs)))
            row += hi - lo
        return pending

    def close(self) -> None:
        """Stop the tensor-parallel workers, if any (also done at exit)."""
        self.tp.close()


def _image_runs(r: Request, row: int, c: int, n: int, image_rows: list[int],
                image_parts: list[tuple[Request, int, int, int]]) -> None:
    """The rows of the ``n`` tokens from position ``c`` of ``r`` (the first at ``row``) that are its images',
    and each run of them: (request, image, first, end) in the image's positions."""
    for i, im in enumerate(r.images):
        lo, hi = max(c, im.offset), min(c + n, im.end)
        if lo < hi:
            image_rows.extend(range(row + lo - c, row + hi - c))
            image_parts.append((r, i, lo - im.offset, hi - im.offset))


def _split_drafts(ks: list[int], counts: list[int], starts: list[int], rows: list[int],
                  slots: list[int]) -> tuple[list[int], list[int], list[int], list[int]]:
    """The step's sequences with each request that has ``k`` drafts (its decode token and them) made
    ``k + 1`` one-token sequences on its block table, the i-th after ``i`` more cached tokens: the
    K/V of all of them are stored before attention reads the cache, so each sees the ones before it,
    and the step is a decode step (the decode kernel, CPU and CUDA graphs) rather than a prompt's."""
    q, c, t, s = [], [], [], []
    for i, k in enumerate(ks):
        q += [1] * (k + 1) if k else [counts[i]]
        c += range(starts[i], starts[i] + k + 1) if k else [starts[i]]
        t += [rows[i]] * (k + 1)
        if slots:
            s += [slots[i]] * (k + 1)
    return q, c, t, s
