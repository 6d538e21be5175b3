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
from engine.request import Request
from engine.runtime import RuntimeFacts, count_kv_blocks, pick_device, pick_dtype, pick_max_model_len
from engine.sampler import Sampler, SamplerOutput, compute_logprobs
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
        num_blocks = count_kv_blocks(config, self.model_cfg, device, dtype, max_model_len)
        self.facts = RuntimeFacts(model_path, device, dtype, max_model_len, num_blocks)
        self.block_size = config.block_size
        self._allocate_kv_cache()
        self.sampler = Sampler(self.model_cfg.vocab_size, list(self.model_cfg.eos_token_ids), device, config.seed)

    def _allocate_kv_cache(self) -> None:
        cfg, f = self.model_cfg, self.facts
        shape = (2, cfg.num_layers, f.num_kv_blocks, self.block_size, cfg.num_kv_heads, cfg.head_dim)
        # Zeros, not empty: padded slots are read (masked) by attention, and NaN * 0 is NaN.
        self.kv_cache = torch.zeros(shape, dtype=f.dtype, device=f.device)
        for i, layer in enumerate(self.model.layers):
            layer.self_attn.attn.k_cache = self.kv_cache[0, i]
            layer.self_attn.attn.v_cache = self.kv_cache[1, i]

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
