"""Rotary position embedding applied to q and k in place, rotate-half (neox /
Hugging Face) layout (twin of ``kernels.reference.apply_rope_``); and fused with the
store of the step's keys and values into the paged KV cache (``rope_and_store_``, whose
twin is the reference's two one after the other): one launch a layer fewer, k read once.

cos/sin are the model's per-token tables, ``(T, D/2)``, already in the model
dtype: every RoPE scaling is folded into them upstream, so this kernel knows none.
Products and sums are rounded to the model dtype as the reference's do.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.triton.fp8 import cache_args, float_to_fp8
from kernels.triton.kv_store import check_store
from kernels.triton.launch import check_same, check_tensor, next_pow2, require


@triton.jit
def _turn(p1, mask, c, s, HALF: tl.constexpr):
    """Rotate-half in place: each row's first halves at ``p1``, second at ``p1 + HALF``, by the float32 ``c``
    and ``s``, products and sums rounded to the tensor's dtype as the reference's are. Returns the new halves."""
    dtype = p1.dtype.element_ty
    x1 = tl.load(p1, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(p1 + HALF, mask=mask, other=0.0).to(tl.float32)
    y1 = ((x1 * c).to(dtype).to(tl.float32) - (x2 * s).to(dtype).to(tl.float32)).to(dtype)
    y2 = ((x2 * c).to(dtype).to(tl.float32) + (x1 * s).to(dtype).to(tl.float32)).to(dtype)
    tl.store(p1, y1, mask=mask)
    tl.store(p1 + HALF, y2, mask=mask)
    return y1, y2


@triton.jit
def _turn_heads(x_ptr, stride_h, heads, cos_ptr, sin_ptr, offs_h, offs_c, HALF: tl.constexpr):
    """One token's ``heads`` heads at ``x_ptr`` turned in place by its angles; returns its (float32) cos and sin."""
    cmask = offs_c < HALF
    c = tl.load(cos_ptr + offs_c, mask=cmask, other=0.0).to(tl.float32)[None, :]
    s = tl.load(sin_ptr + offs_c, mask=cmask, other=0.0).to(tl.float32)[None, :]
    _turn(x_ptr + offs_h[:, None] * stride_h + offs_c[None, :], (offs_h[:, None] < heads) & cmask[None, :], c, s, HALF)
    return c, s


@triton.jit
def _rope_kernel(
    q_ptr, k_ptr, cos_ptr, sin_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_cos, stride_sin,
    H: tl.constexpr, HKV: tl.constexpr, HALF: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)  # one program per token: its q heads, then its k heads
    offs_h = tl.arange(0, BLOCK_H)
    offs_c = tl.arange(0, BLOCK_HALF)
    cmask = offs_c < HALF
    c, s = _turn_heads(q_ptr + t * stride_qt, stride_qh, H, cos_ptr + t * stride_cos, sin_ptr + t * stride_sin,
                       offs_h, offs_c, HALF)
    _turn(k_ptr + t * stride_kt + offs_h[:, None] * stride_kh + offs_c[None, :],
          (offs_h[:, None] < HKV) & cmask[None, :], c, s, HALF)


def apply_rope_(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """Rotate q (T, H, D) and k (T, Hkv, D) in place by cos/sin (T, D/2).

    q and k may be strided views (e.g. of a fused qkv projection) as long as each
    head's D values are contiguous."""
    for name, x, nd in (("q", q, 3), ("k", k, 3), ("cos", cos, 2), ("sin", sin, 2)):
        check_tensor(name, x, nd)
    check_same("dtype", ["q", "k", "cos", "sin"], [q.dtype, k.dtype, cos.dtype, sin.dtype])
    check_same("device", ["q", "k", "cos", "sin"], [q.device, k.device, cos.device, sin.device])
    t, h, d = q.shape
    require(d % 2 == 0, f"head_dim must be even for RoPE, got {d}")
    require(k.shape[0] == t and k.shape[2] == d, f"k must be ({t}, Hkv, {d}), got {tuple(k.shape)}")
    for name, x in (("cos", cos), ("sin", sin)):
        require(tuple(x.shape) == (t, d // 2), f"{name} must be ({t}, {d // 2}), got {tuple(x.shape)}")
    if t == 0:
        return
    _rope_kernel[(t,)](
        q, k, cos, sin,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), cos.stride(0), sin.stride(0),
        H=h, HKV=k.shape[1], HALF=d // 2, BLOCK_H=next_pow2(max(h, k.shape[1])), BLOCK_HALF=next_pow2(d // 2),
    )


@triton.jit
def _rope_store_kernel(
    q_ptr, k_ptr, v_ptr, cos_ptr, sin_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_cos, stride_sin,
    stride_cache_slot, stride_cache_h,
    H: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, HALF: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_HKV: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_D: tl.constexpr,
    FMT: tl.constexpr,
):
    """``_rope_kernel``'s rotation of each head's first ``2 * HALF`` dims, then ``_store_kvcache_kernel``'s
    store of the token's k (as rotated, from registers) and v, in one program per token."""
    t = tl.program_id(0).to(tl.int64)
    offs_h = tl.arange(0, BLOCK_H)
    offs_c = tl.arange(0, BLOCK_HALF)
    cmask = offs_c < HALF
    c, s = _turn_heads(q_ptr + t * stride_qt, stride_qh, H, cos_ptr + t * stride_cos, sin_ptr + t * stride_sin,
                       offs_h, offs_c, HALF)

    slot = tl.load(slot_ptr + t).to(tl.int64)
    # a negative slot marks a padding token (vLLM's convention): rotated, not stored (as a head count: see
    # _store_kvcache_kernel)
    stored = tl.where(slot >= 0, HKV, 0)
    offs_g = tl.arange(0, BLOCK_HKV)
    y1, y2 = _turn(k_ptr + t * stride_kt + offs_g[:, None] * stride_kh + offs_c[None, :],
                   (offs_g[:, None] < HKV) & cmask[None, :], c, s, HALF)
    dst = k_cache_ptr + slot * stride_cache_slot + offs_g[:, None] * stride_cache_h + offs_c[None, :]
    mask = (offs_g[:, None] < stored) & cmask[None, :]
    if FMT:
        y1 = float_to_fp8(y1.to(tl.float32), FMT)
        y2 = float_to_fp8(y2.to(tl.float32), FMT)
    tl.store(dst, y1, mask=mask)
    tl.store(dst + HALF, y2, mask=mask)

    # the rest of k (dims past the rotated ones: partial rotary), and v, as they are
    offs_d = tl.arange(0, BLOCK_D)
    heads = offs_g[:, None] < stored
    rest = heads & (offs_d[None, :] >= 2 * HALF) & (offs_d[None, :] < D)
    k = tl.load(k_ptr + t * stride_kt + offs_g[:, None] * stride_kh + offs_d[None, :], mask=rest)
    mask = heads & (offs_d[None, :] < D)
    v = tl.load(v_ptr + t * stride_vt + offs_g[:, None] * stride_vh + offs_d[None, :], mask=mask)
    if FMT:
        k = float_to_fp8(k.to(tl.float32), FMT)
        v = float_to_fp8(v.to(tl.float32), FMT)
    dst = slot * stride_cache_slot + offs_g[:, None] * stride_cache_h + offs_d[None, :]
    tl.store(k_cache_ptr + dst, k, mask=rest)
    tl.store(v_cache_ptr + dst, v, mask=mask)


def rope_and_store_(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                    k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor, rot: int) -> None:
    """``apply_rope_`` on the first ``rot`` dims of each head of q (T, H, D) and k (T, Hkv, D), then
    ``store_kvcache`` of k and v into their slots: one launch (twin: ``kernels.reference``'s ``apply_rope_``, then
    its ``store_kvcache``)."""
    check_store(k, v, k_cache, v_cache, slot_mapping)
    for name, x, nd in (("q", q, 3), ("cos", cos, 2), ("sin", sin, 2)):
        check_tensor(name, x, nd)
    check_same("dtype", ["q", "k", "cos", "sin"], [q.dtype, k.dtype, cos.dtype, sin.dtype])
    check_same("device", ["q", "k", "cos", "sin"], [q.device, k.device, cos.device, sin.device])
    t, h, d = q.shape
    require(k.shape[0] == t and k.shape[2] == d, f"k must be ({t}, Hkv, {d}), got {tuple(k.shape)}")
    require(0 < rot <= d and rot % 2 == 0, f"rot must be even, in 1..{d}, got {rot}")
    for name, x in (("cos", cos), ("sin", sin)):
        require(tuple(x.shape) == (t, rot // 2), f"{name} must be ({t}, {rot // 2}), got {tuple(x.shape)}")
    if t == 0:
        return
    k_cache, v_cache, fmt = cache_args(k_cache, v_cache)
    _rope_store_kernel[(t,)](
        q, k, v, cos, sin, k_cache, v_cache, slot_mapping,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), cos.stride(0), sin.stride(0),
        k_cache.stride(1), k_cache.stride(2),
        H=h, HKV=k.shape[1], D=d, HALF=rot // 2, BLOCK_H=next_pow2(h), BLOCK_HKV=next_pow2(k.shape[1]),
        BLOCK_HALF=next_pow2(rot // 2), BLOCK_D=next_pow2(d), FMT=fmt,
    )
