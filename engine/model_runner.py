"""Turns a scheduled batch into flat tensors, runs the model, samples.

Owns the model, the KV cache tensors and the sampler. Per step: token ids,
positions, slot mapping, block tables and sequence lengths for every scheduled
token, built with a handful of tensor ops (not a Python loop over tokens),
then one forward pass, logits only for the rows that sample, one sampler call.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.attention import build_metadata
from engine.config import EngineConfig
from engine.loader import build_model, load_model_config
from engine.protocol import SamplingParams
from engine.request import Request
from engine.runtime import (
    RuntimeFacts,
    count_kv_blocks,
    measured_cuda_budget,
    pick_device,
    pick_dtype,
    pick_max_model_len,
)
from engine.sampler import Sampler, SamplerOutput, SamplingState, compute_logprobs
from engine.scheduler import ScheduledBatch


@dataclass
class StepResult:
    sampled: list[Request]  # requests that got a new token this step, in row order
    output: SamplerOutput | None


class ModelRunner:
    def __init__(self, config: EngineConfig, model_path: str):
        device = pick_device(config)
        dtype = pick_dtype(config, device)
        self.model_cfg = load_model_config(model_path)
        max_model_len = pick_max_model_len(config, self.model_cfg, device)
        torch.manual_seed(config.seed)
        self.model = build_model(model_path, self.model_cfg, max_model_len, dtype, device)
        self.block_size, self.device, self.dtype = config.block_size, device, dtype
        self.sampler = Sampler(self.model_cfg.vocab_size, list(self.model_cfg.eos_token_ids), device, config.seed)
        cuda_budget = None
        if device.type == "cuda" and config.num_kv_blocks is None:
            # the KV cache gets what is left after the weights and the largest step's activations
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)
            self.profile_run(min(config.max_num_batched_tokens, config.max_num_seqs * max_model_len),
                             config.max_num_seqs, max_model_len)
            cuda_budget = measured_cuda_budget(config, device)
            torch.cuda.empty_cache()
        num_blocks = count_kv_blocks(config, self.model_cfg, device, dtype, max_model_len, cuda_budget)
        self.facts = RuntimeFacts(model_path, device, dtype, max_model_len, num_blocks)
        self._allocate_kv_cache()

    def _allocate_kv_cache(self) -> None:
        self.kv_cache = self._attach_kv_cache(self.facts.num_kv_blocks)

    def _attach_kv_cache(self, num_blocks: int) -> torch.Tensor:
        cfg = self.model_cfg
        shape = (2, cfg.num_layers, num_blocks, self.block_size, cfg.num_kv_heads, cfg.head_dim)
        # Zeros, not empty: padded slots are read (masked) by attention, and NaN * 0 is NaN.
        cache = torch.zeros(shape, dtype=self.dtype, device=self.device)
        for i, layer in enumerate(self.model.layers):
            layer.self_attn.attn.k_cache = cache[0, i]
            layer.self_attn.attn.v_cache = cache[1, i]
        return cache

    @torch.inference_mode()
    def profile_run(self, num_tokens: int, num_seqs: int, max_model_len: int) -> None:
        """The step with the largest activations, run once so that CUDA can measure its peak: a forward
        of ``num_tokens`` prompt tokens (in sequences of at most ``max_model_len``) and the sampler's
        heaviest path (top-k, top-p) over ``num_seqs`` rows. The KV cache is a temporary one."""
        lens = [max_model_len] * (num_tokens // max_model_len) + [num_tokens % max_model_len]
        lens = [n for n in lens if n]
        kept = getattr(self, "kv_cache", None)
        self._attach_kv_cache(sum(-(-n // self.block_size) for n in lens))
        tables, first = [], 0
        for n in lens:
            tables.append(list(range(first, first + -(-n // self.block_size))))
            first += len(tables[-1])
        positions, meta = build_metadata(lens, [0] * len(lens), tables, self.block_size, self.device)
        hidden = self.model(torch.zeros(num_tokens, dtype=torch.int64, device=self.device), positions, meta)
        logits = self.model.compute_logits(hidden[-1:].expand(num_seqs, -1))
        params = SamplingParams(temperature=1.0, top_k=50, top_p=0.9)
        self.sampler(logits, [params] * num_seqs, [SamplingState(params) for _ in range(num_seqs)],
                     [[0]] * num_seqs, [[]] * num_seqs)
        if kept is not None:  # called again on a running engine (tests): put the real cache back
            self.kv_cache = kept
            for i, layer in enumerate(self.model.layers):
                layer.self_attn.attn.k_cache, layer.self_attn.attn.v_cache = kept[0, i], kept[1, i]

    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch) -> StepResult:
        input_ids, positions, meta, sample_rows, sampled = self._prepare(batch)
        hidden = self.model(input_ids, positions, meta)  # (T, hidden)
        if any(r.params.prompt_logprobs is not None for r in batch.requests):
            self._prompt_logprobs(batch, hidden)
        if not sampled:
            return StepResult([], None)
        logits = self.model.compute_logits(hidden[sample_rows])  # (B', V)
        out = self.sampler(
            logits,
            [r.params for r in sampled],
            [r.sampling_state for r in sampled],
            [r.prompt_token_ids for r in sampled],
            [r.output_token_ids for r in sampled],
        )
        return StepResult(sampled, out)

    def _prepare(self, batch: ScheduledBatch):
        reqs, counts = batch.requests, batch.num_new_tokens
        starts = [r.num_computed_tokens for r in reqs]
        tokens: list[int] = []
        sampled: list[Request] = []  # sequences whose every token is now computed
        sample_rows: list[int] = []  # their last token's row in the flat batch
        for r, c, n in zip(reqs, starts, counts, strict=True):
            tokens.extend(r.all_token_ids[c:c + n])
            if c + n == r.num_tokens:
                sampled.append(r)
                sample_rows.append(len(tokens) - 1)
        dev = self.facts.device
        positions, meta = build_metadata(counts, starts, [r.block_table for r in reqs], self.block_size, dev)
        input_ids = torch.tensor(tokens, dtype=torch.int64, device=dev)
        return input_ids, positions, meta, torch.tensor(sample_rows, device=dev), sampled

    def _prompt_logprobs(self, batch: ScheduledBatch, hidden: torch.Tensor) -> None:
        """Logprobs of each prompt token given the ones before it, gathered chunk by chunk."""
        row = 0
        for r, n in zip(batch.requests, batch.num_new_tokens, strict=True):
            c = r.num_computed_tokens
            k = r.params.prompt_logprobs
            if k is not None and c < r.num_prompt_tokens:
                if r.prompt_logprobs is None:
                    r.prompt_logprobs = [None]  # the first token has no context
                # Position p predicts token p + 1 (stored at index p + 1); skip positions already
                # done before a preemption made this request recompute its prompt.
                lo = max(c, len(r.prompt_logprobs) - 1)
                hi = min(c + n, r.num_prompt_tokens - 1)  # exclusive
                if hi > lo:
                    logits = self.model.compute_logits(hidden[row + lo - c:row + hi - c])
                    targets = torch.tensor(r.prompt_token_ids[lo + 1:hi + 1], device=logits.device)
                    r.prompt_logprobs.extend(compute_logprobs(logits, targets, k))
            row += n
