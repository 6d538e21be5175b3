"""KV cache sizing: the CUDA budget's arithmetic, the profiling forward (run here on the CPU, where it
measures nothing but must work), and the facts start-up reports."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from engine import LLM, SamplingParams
from engine.runtime import cuda_kv_budget, kv_block_bytes

GiB = 1 << 30


def test_cuda_budget_is_utilization_less_the_profiled_peak_and_other_processes():
    # 140 GiB card, 0.9 of it ours; the profiling step peaked at 20 GiB (weights + activations);
    # PyTorch holds 22 GiB now, 2 GiB more are another process's and the CUDA context
    free = 140 * GiB - 22 * GiB - 2 * GiB
    assert cuda_kv_budget(140 * GiB, free, 22 * GiB, 20 * GiB, 0.9) == int(126 * GiB - 20 * GiB - 2 * GiB)
    # memory PyTorch cached (reserved but not allocated) is not lost to the KV cache
    assert cuda_kv_budget(140 * GiB, free, 22 * GiB, 20 * GiB, 0.9) == \
        cuda_kv_budget(140 * GiB, free + 2 * GiB, 20 * GiB, 20 * GiB, 0.9)


def test_the_profiling_step_runs_and_leaves_the_engine_as_it_was(tiny_llama):
    llm = LLM(tiny_llama, num_kv_blocks=64, max_model_len=256)
    greedy = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    before = llm.generate([5, 6, 7], greedy)[0].token_ids
    cache = llm.engine.runner.kv_cache
    llm.engine.runner.profile_run(600, 8, 256)  # three sequences: 256 + 256 + 88 tokens
    assert llm.engine.runner.kv_cache is cache
    assert llm.engine.runner.model.layers[0].self_attn.attn.k_cache.data_ptr() == cache[0, 0].data_ptr()
    assert llm.generate([5, 6, 7], greedy)[0].token_ids == before


def test_bytes_per_token():
    cfg = SimpleNamespace(num_layers=30, num_kv_heads=3, head_dim=64, encoder=None)
    # SmolLM2-135M: K and V x 30 layers x 3 KV heads x 64 dims
    assert kv_block_bytes(cfg, 1, torch.float32) == 2 * 30 * 3 * 64 * 4 == 46080
    assert kv_block_bytes(cfg, 16, torch.bfloat16) == 46080 // 2 * 16


def test_kv_cache_memory_sizes_the_cache_on_cuda_too():
    """--kv-cache-memory (vLLM's --kv-cache-memory-bytes) in place of gpu_memory_utilization's measured share."""
    from engine.config import EngineConfig
    from engine.runtime import count_kv_blocks

    cfg = SimpleNamespace(num_layers=30, num_kv_heads=3, head_dim=64, sliding_window=None, encoder=None)
    per_block = kv_block_bytes(cfg, 16, torch.bfloat16)
    cuda = torch.device("cuda")  # (only its type is read)
    assert count_kv_blocks(EngineConfig(), cfg, cuda, torch.bfloat16, 4096, cuda_budget=100 * per_block) == (100, 0)
    assert count_kv_blocks(EngineConfig(kv_cache_memory=7 * per_block), cfg, cuda, torch.bfloat16, 4096,
                           cuda_budget=100 * per_block) == (7, 0)


@pytest.mark.parametrize("flag", [True, False])
def test_prefix_caching_flag_reaches_the_block_manager(tiny_llama, flag):
    llm = LLM(tiny_llama, num_kv_blocks=8, max_model_len=128, enable_prefix_caching=flag)
    assert llm.engine.block_manager.enable_prefix_caching is flag
