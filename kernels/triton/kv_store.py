"""Writing a step's new keys and values into the paged KV cache through the
slot mapping (twin of ``kernels.reference.store_kvcache``; an fp8 cache gets them
rounded by ``kernels.triton.fp8``)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.reference import FP8_DTYPES
from kernels.triton.fp8 import cache_args, float_to_fp8
from kernels.triton.launch import FLOAT_DTYPES, INDEX_DTYPES, check_same, check_tensor, next_pow2, require


@triton.jit
def _store_kvcache_kernel(
    k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_cache_slot, stride_cache_h,
    HKV: tl.constexpr, D: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, FMT: tl.constexpr,
):
    t = tl.program_id(0)  # one program per new token, all its heads
    slot = tl.load(slot_ptr + t).to(tl.int64)
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    # A negative slot marks a padding token (vLLM's convention): nothing to store. (As a head
    # count, not `& (slot >= 0)`: the interpreter turns a vector & scalar mask into int32.)
    num_heads = tl.where(slot >= 0, HKV, 0)
    mask = (offs_h[:, None] < num_heads) & (offs_d[None, :] < D)
    src = offs_h[:, None] * stride_kh + offs_d[None, :]
    k = tl.load(k_ptr + t.to(tl.int64) * stride_kt + src, mask=mask)
    v = tl.load(v_ptr + t.to(tl.int64) * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :], mask=mask)
    if FMT:
        k = float_to_fp8(k.to(tl.float32), FMT)
        v = float_to_fp8(v.to(tl.float32), FMT)
    dst = slot * stride_cache_slot + offs_h[:, None] * stride_cache_h + offs_d[None, :]
    tl.store(k_cache_ptr + dst, k, mask=mask)
    tl.store(v_cache_ptr + dst, v, mask=mask)


def store_kvcache(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  slot_mapping: torch.Tensor) -> None:
    """Write new keys/values ``(T, Hkv, D)`` into their slots ``(T,)`` of the caches
    ``(num_blocks, block_size, Hkv, D)``: of their dtype, or fp8."""
    check_store(k, v, k_cache, v_cache, slot_mapping)
    t, hkv, d = k.shape
    if t == 0:
        return
    k_cache, v_cache, fmt = cache_args(k_cache, v_cache)
    _store_kvcache_kernel[(t,)](
        k, v, k_cache, v_cache, slot_mapping,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(1), k_cache.stride(2),
        HKV=hkv, D=d, BLOCK_H=next_pow2(hkv), BLOCK_D=next_pow2(d), FMT=fmt,
    )


def check_store(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                slot_mapping: torch.Tensor) -> None:
    """``store_kvcache``'s arguments (and ``rope_and_store_``'s) as its kernel takes them, or ValueError."""
    check_tensor("k", k, 3)
    check_tensor("v", v, 3)
    check_tensor("k_cache", k_cache, 4, FLOAT_DTYPES + FP8_DTYPES)
    check_tensor("v_cache", v_cache, 4, FLOAT_DTYPES + FP8_DTYPES)
    check_tensor("slot_mapping", slot_mapping, 1, INDEX_DTYPES)
    check_same("dtype", ["k", "v"], [k.dtype, v.dtype])
    check_same("dtype", ["k_cache", "v_cache"], [k_cache.dtype, v_cache.dtype])
    require(k_cache.dtype in (k.dtype, *FP8_DTYPES), f"the caches must be k's dtype or fp8, got {k_cache.dtype}")
    check_same("device", ["k", "v", "k_cache", "v_cache", "slot_mapping"],
               [k.device, v.device, k_cache.device, v_cache.device, slot_mapping.device])
    check_same("shape", ["k", "v"], [tuple(k.shape), tuple(v.shape)])
    check_same("shape", ["k_cache", "v_cache"], [tuple(k_cache.shape), tuple(v_cache.shape)])
    t, hkv, d = k.shape
    require(tuple(k_cache.shape[2:]) == (hkv, d),
            f"k_cache must be (num_blocks, block_size, {hkv}, {d}), got {tuple(k_cache.shape)}")
    require(slot_mapping.shape[0] == t, f"slot_mapping must have {t} entries, got {slot_mapping.shape[0]}")
    # One slot index addresses both caches, so they must be laid out alike, slots evenly spaced.
    require(k_cache.is_contiguous() and v_cache.is_contiguous(), "k_cache and v_cache must be contiguous")
