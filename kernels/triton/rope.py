"""Rotary position embedding applied to q and k in place, rotate-half (neox /
Hugging Face) layout (twin of ``kernels.reference.apply_rope_``).

cos/sin are the model's per-token tables, ``(T, D/2)``, already in the model
dtype: every RoPE scaling is folded into them upstream, so this kernel knows none.
Products and sums are rounded to the model dtype as the reference's do.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.triton.launch import check_same, check_tensor, next_pow2, require


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
    dtype = q_ptr.dtype.element_ty
    c = tl.load(cos_ptr + t * stride_cos + offs_c, mask=cmask, other=0.0).to(tl.float32)[None, :]
    s = tl.load(sin_ptr + t * stride_sin + offs_c, mask=cmask, other=0.0).to(tl.float32)[None, :]

    mask = (offs_h[:, None] < H) & cmask[None, :]
    p1 = q_ptr + t * stride_qt + offs_h[:, None] * stride_qh + offs_c[None, :]
    x1 = tl.load(p1, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(p1 + HALF, mask=mask, other=0.0).to(tl.float32)
    y1 = (x1 * c).to(dtype).to(tl.float32) - (x2 * s).to(dtype).to(tl.float32)
    y2 = (x2 * c).to(dtype).to(tl.float32) + (x1 * s).to(dtype).to(tl.float32)
    tl.store(p1, y1.to(dtype), mask=mask)
    tl.store(p1 + HALF, y2.to(dtype), mask=mask)

    mask = (offs_h[:, None] < HKV) & cmask[None, :]
    p1 = k_ptr + t * stride_kt + offs_h[:, None] * stride_kh + offs_c[None, :]
    x1 = tl.load(p1, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(p1 + HALF, mask=mask, other=0.0).to(tl.float32)
    y1 = (x1 * c).to(dtype).to(tl.float32) - (x2 * s).to(dtype).to(tl.float32)
    y2 = (x2 * c).to(dtype).to(tl.float32) + (x1 * s).to(dtype).to(tl.float32)
    tl.store(p1, y1.to(dtype), mask=mask)
    tl.store(p1 + HALF, y2.to(dtype), mask=mask)


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
