"""Rotary position embedding applied to q and k in place, rotate-half (neox /
Hugging Face) layout (twin of ``kernels.reference.apply_rope_``); and fused with the
store of the step's keys and values into the paged KV cache, after Qwen3's and Gemma 3's
per-head q/k norms where a model has them (``rope_and_store_``, whose twin is the
reference's rms_norm, apply_rope_ and store_kvcache one after the other): one launch
a layer for all of them, k read once.

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
from kernels.triton.launch import cdiv, check_same, check_tensor, next_pow2, require

HEAD_ELEMENTS = 2048  # the most head values (heads x head_dim, padded) one program of these kernels holds


@triton.jit
def _normed(x, rstd, w_ptr, mask, dtype, NORM: tl.constexpr):
    """``kernels.reference.rms_norm``'s rule for one part of the rows (``x`` float32, ``rstd`` each row's): a weight in
    the rows' dtype (NORM 1) multiplies the rounded row, a float32 one (NORM 2, Gemma's 1 + w) multiplies before
    the one rounding. Returns the values rounded to ``dtype``, as float32."""
    w = tl.load(w_ptr, mask=mask, other=0.0).to(tl.float32)
    if NORM == 1:
        y = (x * rstd).to(dtype).to(tl.float32) * w
    else:
        y = x * rstd * w
    return y.to(dtype).to(tl.float32)


@triton.jit
def _prepare_heads(x_ptr, stride_h, heads, w_ptr, eps, c, s, offs_h, offs_c, offs_r,
                   D: tl.constexpr, HALF: tl.constexpr, NORM: tl.constexpr):
    """One token's ``heads`` heads at ``x_ptr`` made ready for attention, in place: RMS-normed over each head's D
    values by the (D,) weight at ``w_ptr`` (NORM: 0 none, else ``_normed``'s rule), then their first ``2 * HALF``
    dims turned. Returns the three parts as stored (the two halves, the dims past them), in the rows' dtype."""
    dtype = x_ptr.dtype.element_ty
    rows = offs_h[:, None] < heads
    m1 = rows & (offs_c[None, :] < HALF)
    mr = rows & (offs_r[None, :] < D - 2 * HALF)
    p1 = x_ptr + offs_h[:, None] * stride_h + offs_c[None, :]
    pr = x_ptr + offs_h[:, None] * stride_h + 2 * HALF + offs_r[None, :]
    x1 = tl.load(p1, mask=m1, other=0.0).to(tl.float32)
    x2 = tl.load(p1 + HALF, mask=m1, other=0.0).to(tl.float32)
    xr = tl.load(pr, mask=mr, other=0.0).to(tl.float32)
    if NORM:
        squares = tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1) + tl.sum(xr * xr, axis=1)
        rstd = tl.rsqrt(squares / D + eps)[:, None]
        x1 = _normed(x1, rstd, w_ptr + offs_c[None, :], m1, dtype, NORM)
        x2 = _normed(x2, rstd, w_ptr + HALF + offs_c[None, :], m1, dtype, NORM)
        xr = _normed(xr, rstd, w_ptr + 2 * HALF + offs_r[None, :], mr, dtype, NORM)
        tl.store(pr, xr.to(dtype), mask=mr)
    y1 = ((x1 * c).to(dtype).to(tl.float32) - (x2 * s).to(dtype).to(tl.float32)).to(dtype)
    y2 = ((x2 * c).to(dtype).to(tl.float32) + (x1 * s).to(dtype).to(tl.float32)).to(dtype)
    tl.store(p1, y1, mask=m1)
    tl.store(p1 + HALF, y2, mask=m1)
    return y1, y2, xr.to(dtype)


@triton.jit
def _rope_kernel(
    q_ptr, k_ptr, cos_ptr, sin_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_cos, stride_sin,
    H: tl.constexpr, HKV: tl.constexpr, HALF: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)  # one program per (token, ``BLOCK_H`` of its heads): q's, then k's
    j = tl.program_id(1)
    offs_h = tl.arange(0, BLOCK_H)
    offs_c = tl.arange(0, BLOCK_HALF)
    offs_r = tl.arange(0, 1)  # (no dims past the turned ones: the caller's views end there)
    cmask = offs_c < HALF
    c = tl.load(cos_ptr + t * stride_cos + offs_c, mask=cmask, other=0.0).to(tl.float32)[None, :]
    s = tl.load(sin_ptr + t * stride_sin + offs_c, mask=cmask, other=0.0).to(tl.float32)[None, :]
    nq = tl.cdiv(H, BLOCK_H)
    if j < nq:
        _prepare_heads(q_ptr + t * stride_qt + j * BLOCK_H * stride_qh, stride_qh, H - j * BLOCK_H, q_ptr, 0.0,
                       c, s, offs_h, offs_c, offs_r, 2 * HALF, HALF, 0)
    else:
        first = (j - nq) * BLOCK_H
        _prepare_heads(k_ptr + t * stride_kt + first * stride_kh, stride_kh, HKV - first, k_ptr, 0.0,
                       c, s, offs_h, offs_c, offs_r, 2 * HALF, HALF, 0)


def heads_per_program(h: int, hkv: int, d: int) -> int:
    """How many heads (a power of two) one program of the RoPE kernels takes: all of a token's q heads, and all
    its k heads, up to ``HEAD_ELEMENTS`` values. A decode step's few tokens get several programs each (Qwen3-32B's
    64 query heads of 128 and 8 KV heads: 5, not 1), and a program's registers stay bounded (compiled for sm_90,
    bf16 with their norms: 40-64 a thread at any head count, where one program a token took 69 at 64 heads of
    128, 132 at 128, 255 at head dim 256)."""
    return min(next_pow2(max(h, hkv)), max(1, HEAD_ELEMENTS // next_pow2(d)))


def _grid(t: int, h: int, hkv: int, per: int) -> tuple[int, int]:
    return t, cdiv(h, per) + cdiv(hkv, per)


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
    per = heads_per_program(h, k.shape[1], d)
    _rope_kernel[_grid(t, h, k.shape[1], per)](
        q, k, cos, sin,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), cos.stride(0), sin.stride(0),
        H=h, HKV=k.shape[1], HALF=d // 2, BLOCK_H=per, BLOCK_HALF=next_pow2(d // 2),
    )


@triton.jit
def _rope_store_kernel(
    q_ptr, k_ptr, v_ptr, cos_ptr, sin_ptr, k_cache_ptr, v_cache_ptr, slot_ptr, qw_ptr, kw_ptr, eps,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_cos, stride_sin,
    stride_cache_slot, stride_cache_h,
    H: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, HALF: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_REST: tl.constexpr,
    BLOCK_D: tl.constexpr, NORM: tl.constexpr, FMT: tl.constexpr,
):
    """One program per (token, ``BLOCK_H`` of its heads): ``_prepare_heads`` of q's heads (normed by their weight
    where NORM, turned), or of k's, then ``_store_kvcache_kernel``'s store of those k heads (as made, from
    registers) and of their v heads."""
    t = tl.program_id(0).to(tl.int64)
    j = tl.program_id(1)
    offs_h = tl.arange(0, BLOCK_H)
    offs_c = tl.arange(0, BLOCK_HALF)
    offs_r = tl.arange(0, BLOCK_REST)
    cmask = offs_c < HALF
    c = tl.load(cos_ptr + t * stride_cos + offs_c, mask=cmask, other=0.0).to(tl.float32)[None, :]
    s = tl.load(sin_ptr + t * stride_sin + offs_c, mask=cmask, other=0.0).to(tl.float32)[None, :]
    nq = tl.cdiv(H, BLOCK_H)
    if j < nq:
        _prepare_heads(q_ptr + t * stride_qt + j * BLOCK_H * stride_qh, stride_qh, H - j * BLOCK_H, qw_ptr, eps,
                       c, s, offs_h, offs_c, offs_r, D, HALF, NORM)
    else:
        first = (j - nq) * BLOCK_H
        y1, y2, yr = _prepare_heads(k_ptr + t * stride_kt + first * stride_kh, stride_kh, HKV - first, kw_ptr, eps,
                                    c, s, offs_h, offs_c, offs_r, D, HALF, NORM)
        slot = tl.load(slot_ptr + t).to(tl.int64)
        # a negative slot marks a padding token (vLLM's convention): made ready, not stored (as a head count: see
        # _store_kvcache_kernel)
        rows = offs_h[:, None] < tl.where(slot >= 0, HKV - first, 0)
        if FMT:
            y1, y2, yr = float_to_fp8(y1.to(tl.float32), FMT), float_to_fp8(y2.to(tl.float32), FMT), \
                float_to_fp8(yr.to(tl.float32), FMT)
        dst = k_cache_ptr + slot * stride_cache_slot + (first + offs_h)[:, None] * stride_cache_h
        tl.store(dst + offs_c[None, :], y1, mask=rows & cmask[None, :])
        tl.store(dst + HALF + offs_c[None, :], y2, mask=rows & cmask[None, :])
        tl.store(dst + 2 * HALF + offs_r[None, :], yr, mask=rows & (offs_r[None, :] < D - 2 * HALF))
        offs_d = tl.arange(0, BLOCK_D)
        mask = rows & (offs_d[None, :] < D)
        v = tl.load(v_ptr + t * stride_vt + (first + offs_h)[:, None] * stride_vh + offs_d[None, :], mask=mask)
        if FMT:
            v = float_to_fp8(v.to(tl.float32), FMT)
        tl.store(v_cache_ptr + slot * stride_cache_slot + (first + offs_h)[:, None] * stride_cache_h + offs_d[None, :],
                 v, mask=mask)


def rope_and_store_(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                    k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor, rot: int,
                    norms: tuple[torch.Tensor, torch.Tensor, float] | None = None) -> None:
    """``norms`` (q's (D,) weight, k's, eps): ``rms_norm`` of each head of q (T, H, D) and k (T, Hkv, D) first, in
    place (Qwen3's, Gemma 3's); then ``apply_rope_`` on the first ``rot`` dims of each head, then ``store_kvcache``
    of k and v into their slots: one launch (twin: ``kernels.reference``'s three, one after the other)."""
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
    qw, kw, eps = norms if norms is not None else (q, q, 0.0)  # (no norm: pointers never read)
    if norms is not None:
        for name, w in (("q_norm", qw), ("k_norm", kw)):
            check_tensor(name, w, 1)
            require(tuple(w.shape) == (d,), f"{name} must have {d} entries, got {tuple(w.shape)}")
        check_same("dtype", ["q_norm", "k_norm"], [qw.dtype, kw.dtype])
        require(qw.dtype in (q.dtype, torch.float32), f"the norms' weights must be {q.dtype} or float32, got {qw.dtype}")
        check_same("device", ["q", "q_norm", "k_norm"], [q.device, qw.device, kw.device])
    if t == 0:
        return
    k_cache, v_cache, fmt = cache_args(k_cache, v_cache)
    per = heads_per_program(h, k.shape[1], d)
    _rope_store_kernel[_grid(t, h, k.shape[1], per)](
        q, k, v, cos, sin, k_cache, v_cache, slot_mapping, qw, kw, float(eps),
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), cos.stride(0), sin.stride(0),
        k_cache.stride(1), k_cache.stride(2),
        H=h, HKV=k.shape[1], D=d, HALF=rot // 2, BLOCK_H=per, BLOCK_HALF=next_pow2(rot // 2),
        BLOCK_REST=next_pow2(max(d - rot, 1)), BLOCK_D=next_pow2(d),
        NORM=0 if norms is None else 1 if qw.dtype == q.dtype else 2, FMT=fmt,
    )
