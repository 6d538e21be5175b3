"""What the paged attention launchers share: the argument checks (the
reference's signature) and the ``tl.dot`` settings per dtype and mode."""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from kernels.reference import FP8_DTYPES
from kernels.triton.launch import FLOAT_DTYPES, INDEX_DTYPES, check_same, check_tensor, interpreting, require

LOG2E = 1.4426950408889634  # softmax runs in base 2: exp(x) = exp2(x * log2 e), exp2 is the fast one
SINK_LOG2E = tl.constexpr(LOG2E)  # (a kernel reads a module's constant only as a constexpr)


@triton.jit
def softcap_scores(qk, inv_cap, cap_log2):
    """Gemma 2's capped scores, in base 2: cap tanh(qk / cap) log2 e, tanh(y) = 1 - 2 / (1 + e^2y)
    (e^2y overflowing to inf gives 1, as tanh)."""
    return (1.0 - 2.0 / (1.0 + tl.exp(2.0 * inv_cap * qk))) * cap_log2


def score_args(scale: float, softcap: float) -> dict:
    """The kernels' score arguments: ``qk_scale`` multiplies q.k (then base 2, folded in, without a cap)."""
    require(isinstance(softcap, (int, float)) and math.isfinite(softcap) and softcap >= 0,
            f"softcap must be a finite float >= 0, got {softcap}")
    if not softcap:
        return dict(qk_scale=float(scale) * LOG2E, inv_cap=1.0, cap_log2=1.0, SOFTCAP=False)
    return dict(qk_scale=float(scale), inv_cap=1.0 / softcap, cap_log2=float(softcap) * LOG2E, SOFTCAP=True)


def check_paged_args(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                     seq_lens: torch.Tensor, max_seq_len: int, scale: float, window: int = 0) -> None:
    """q (N, H, D); caches (num_blocks, block_size, Hkv, D), q's dtype or fp8; block_tables (B, max_blocks);
    seq_lens (B,).

    Only shapes, dtypes, strides and devices are checked: looking at values
    (seq_lens within the table, block ids within the cache) would cost a sync."""
    check_tensor("q", q, 3)
    check_tensor("k_cache", k_cache, 4, FLOAT_DTYPES + FP8_DTYPES)
    check_tensor("v_cache", v_cache, 4, FLOAT_DTYPES + FP8_DTYPES)
    check_tensor("block_tables", block_tables, 2, INDEX_DTYPES)
    check_tensor("seq_lens", seq_lens, 1, INDEX_DTYPES)
    check_same("dtype", ["k_cache", "v_cache"], [k_cache.dtype, v_cache.dtype])
    require(k_cache.dtype in (q.dtype, *FP8_DTYPES), f"the caches must be q's dtype ({q.dtype}) or fp8, got "
            f"{k_cache.dtype}")
    check_same("device", ["q", "k_cache", "v_cache", "block_tables", "seq_lens"],
               [q.device, k_cache.device, v_cache.device, block_tables.device, seq_lens.device])
    check_same("shape", ["k_cache", "v_cache"], [tuple(k_cache.shape), tuple(v_cache.shape)])
    check_same("strides", ["k_cache", "v_cache"], [k_cache.stride(), v_cache.stride()])
    _, h, d = q.shape
    _, block_size, hkv, dc = k_cache.shape
    require(dc == d, f"q has head_dim {d} but the cache has {dc}")
    require(hkv > 0 and h % hkv == 0, f"num_heads {h} must be a multiple of num_kv_heads {hkv}")
    require(block_tables.shape[0] == seq_lens.shape[0],
            f"block_tables has {block_tables.shape[0]} rows but seq_lens has {seq_lens.shape[0]} entries")
    require(max_seq_len >= 0 and block_tables.shape[1] * block_size >= max_seq_len,
            f"block_tables of width {block_tables.shape[1]} x block_size {block_size} cannot hold "
            f"max_seq_len {max_seq_len}")
    require(isinstance(scale, (int, float)) and math.isfinite(scale), f"scale must be a finite float, got {scale}")
    require(isinstance(window, int) and window >= 0, f"window must be an int >= 0 (0: none), got {window!r}")


def check_sinks(sinks: torch.Tensor | None, q: torch.Tensor) -> None:
    """Attention sinks: none, or one float32 per query head, on q's device."""
    if sinks is not None:
        check_tensor("sinks", sinks, 1, (torch.float32,))
        require(sinks.shape[0] == q.shape[1] and sinks.device == q.device and sinks.is_contiguous(),
                f"sinks must be ({q.shape[1]},) contiguous on {q.device}, got {tuple(sinks.shape)} on {sinks.device}")


def key_tile(q: torch.Tensor) -> int:
    """Keys a loop step of the paged attention kernels by default: 64 (32 in fp32, whose tiles take twice the
    registers; 16 in the interpreter, which runs every program one after another)."""
    return 16 if interpreting() else (32 if q.dtype == torch.float32 else 64)


def dot_args(q: torch.Tensor) -> dict:
    """Constexprs for ``tl.dot``: fp32 stays fp32 (TF32 would miss the reference by ~1e-3); the
    interpreter multiplies bf16 as raw integers (Triton 3.x), so it gets operands upcast to fp32
    (exact, so the same result a bf16 dot with fp32 accumulation gives)."""
    return dict(PRECISION="ieee" if q.dtype == torch.float32 else "tf32", DOT_F32=interpreting())
