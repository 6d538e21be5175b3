"""Facts found at start-up, kept apart from the user's ``EngineConfig``:
the device and dtype chosen for "auto", the model's usable length, and how
many KV blocks fit in the memory given to the cache."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from engine.config import EngineConfig
from engine.models.config import ModelConfig
from engine.window_blocks import pool_needed, window_span

CPU_MAX_MODEL_LEN = 8192
CPU_KV_CACHE_BYTES = 1 << 30

log = logging.getLogger("tokenmill.engine")

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_KV_DTYPES = {"fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}


@dataclass(frozen=True)
class RuntimeFacts:
    model_path: str
    device: torch.device
    dtype: torch.dtype
    kv_dtype: torch.dtype  # what the KV cache holds: dtype, or fp8 (pick_kv_dtype)
    max_model_len: int
    num_kv_blocks: int
    num_window_blocks: int = 0  # the sliding-window layers' own pool (engine.window_blocks); 0: none
    kv_window: int = 0  # the window of that pool's layers


def pick_device(config: EngineConfig) -> torch.device:
    if config.device == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda' was asked for, but no CUDA device is available")
    if config.device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(config.device)


def cpu_has_native_bf16() -> bool:
    """AVX512-BF16 or AMX: bf16 matmuls run natively (elsewhere torch emulates them, slower than fp32)."""
    probes = [getattr(torch.cpu, name, None) for name in ("_is_avx512_bf16_supported", "_is_amx_tile_supported")]
    return any(probe() for probe in probes if probe is not None)


def pick_dtype(config: EngineConfig, device: torch.device) -> torch.dtype:
    """``auto``: bfloat16 on CUDA and on CPUs with native bf16 (measured on 2 avx512_bf16 cores:
    2.9x fp32's throughput), float32 on other CPUs. The choice is logged."""
    if config.dtype != "auto":
        return _DTYPES[config.dtype]
    if device.type == "cuda":
        dtype, why = torch.bfloat16, "CUDA"
    elif cpu_has_native_bf16():
        dtype, why = torch.bfloat16, "this CPU has native bf16 (AVX512-BF16 or AMX)"
    else:
        dtype, why = torch.float32, "this CPU has no native bf16; --dtype bfloat16 would be emulated"
    log.info("dtype auto: %s (%s)", str(dtype).removeprefix("torch."), why)
    return dtype


def pick_kv_dtype(config: EngineConfig, dtype: torch.dtype) -> torch.dtype:
    """The KV cache's dtype: the model's (``auto``), or fp8 (``fp8`` is e4m3: 3 mantissa bits, values up
    to 448; e5m2 has 2, up to 57344), K and V rounded as ``kernels.reference.to_cache`` rounds them."""
    return _KV_DTYPES.get(config.kv_cache_dtype, dtype)


def pick_max_model_len(config: EngineConfig, model_cfg: ModelConfig, device: torch.device) -> int:
    """The model's length (on the CPU at most ``CPU_MAX_MODEL_LEN``), or the one asked for, up to it."""
    limit = model_cfg.max_position_embeddings
    if config.max_model_len is not None:
        if config.max_model_len > limit:
            raise ValueError(f"max_model_len {config.max_model_len} exceeds the model's "
                             f"max_position_embeddings ({limit})")
        return config.max_model_len
    return min(limit, CPU_MAX_MODEL_LEN) if device.type == "cpu" else limit


def kv_block_bytes(model_cfg: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    """K and V for ``block_size`` tokens across all layers."""
    elt = torch.tensor([], dtype=dtype).element_size()
    return 2 * model_cfg.num_layers * block_size * model_cfg.num_kv_heads * model_cfg.head_dim * elt


def cuda_kv_budget(total: int, free: int, reserved: int, peak: int, utilization: float) -> int:
    """Bytes for the KV cache on a card of ``total`` bytes with ``free`` free, after a profiling forward
    whose peak allocation (weights + activations) was ``peak``, with ``reserved`` held by PyTorch now:
    ``utilization`` of the card, less that peak, less what other processes (and the CUDA context) hold."""
    others = total - free - reserved
    return int(total * utilization - peak - others)


def measured_cuda_budget(config: EngineConfig, device: torch.device) -> int:
    """``cuda_kv_budget`` with the numbers of now (call right after the profiling forward)."""
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()  # what PyTorch caches but no tensor holds goes back: ``free`` sees it as free
    free, total = torch.cuda.mem_get_info(device)
    return cuda_kv_budget(total, free, torch.cuda.memory_reserved(device), torch.cuda.max_memory_allocated(device),
                          config.gpu_memory_utilization)


def window_layers(config: EngineConfig, model_cfg: ModelConfig, max_model_len: int) -> list[int]:
    """The sliding-window layers that get a KV pool of their own (``engine.window_blocks``): none when
    the model has none, when their window spans the whole length, or when the user keeps every block
    (``disable_hybrid_kv_cache_manager``)."""
    window = model_cfg.sliding_window or 0
    if config.disable_hybrid_kv_cache_manager or not 0 < window < max_model_len:
        return []
    return [i for i in range(model_cfg.num_layers) if model_cfg.window(i)]


def count_kv_blocks(config: EngineConfig, model_cfg: ModelConfig, device: torch.device, dtype: torch.dtype,
                    max_model_len: int, cuda_budget: int | None = None) -> tuple[int, int]:
    """(blocks, window blocks) that fit in the cache's memory: ``kv_cache_memory`` where given (on CUDA
    too, in place of ``gpu_memory_utilization``'s share, as vLLM's ``--kv-cache-memory-bytes``), else on
    CUDA ``cuda_budget`` (``measured_cuda_budget``) and on the CPU 1 GiB.

    A model with sliding-window layers (``window_layers``) gives them a pool of their own, as large as
    every sequence's window could ever take at once (``max_num_seqs`` sequences each holding its window
    and a few blocks of slack, and one step's tokens more); the full layers get the rest. When that
    pool would be no smaller than the full layers' (a small cache and many sequences), every layer
    keeps every block instead (0 window blocks): the split is never worse than none. Without full
    layers at all (or in an encoder, which caches nothing) the blocks are only names (no memory): as many
    as every sequence at full length."""
    bs, layers = config.block_size, model_cfg.num_layers
    max_blocks = -(-max_model_len // bs)
    if model_cfg.encoder is not None:  # nothing is cached: the blocks are names
        return config.max_num_seqs * max_blocks, 0
    sliding = len(window_layers(config, model_cfg, max_model_len))
    window_need = least = 0
    if sliding:
        window_need = pool_needed(model_cfg.sliding_window, bs, config.max_num_seqs, config.max_num_batched_tokens)
        least = window_span(model_cfg.sliding_window, bs) + 1  # one request's window and a block of a step
    if config.num_kv_blocks is not None:  # the full layers' blocks; if all slide, the window pool's (at most)
        if sliding == layers:
            return config.max_num_seqs * max_blocks, min(window_need, max(least, config.num_kv_blocks))
        return config.num_kv_blocks, window_need
    layer_block = kv_block_bytes(model_cfg, bs, dtype) // layers  # one layer's K and V for a block
    if config.kv_cache_memory is not None:
        budget = config.kv_cache_memory
    else:
        budget = cuda_budget if device.type == "cuda" else CPU_KV_CACHE_BYTES
    units = int(budget // layer_block)
    # More than every sequence at full length could use is memory wasted, unless it keeps prefixes
    # cached; on the CPU the cache's memory is the host's, so take no more than that either way.
    cap = config.max_num_seqs * max_blocks if device.type == "cpu" or not config.enable_prefix_caching else units
    blocks, window_blocks = min(units // layers, cap), 0
    if sliding == layers:
        window_blocks = min(window_need, units // layers)
        blocks = config.max_num_seqs * max_blocks
    elif sliding and (units - sliding * window_need) // (layers - sliding) > blocks:
        window_blocks = window_need
        blocks = min((units - sliding * window_need) // (layers - sliding), cap)
    if blocks < 1 or (sliding == layers and window_blocks < least):
        raise ValueError("no memory is left for the KV cache: raise gpu_memory_utilization / kv_cache_memory")
    return blocks, window_blocks
