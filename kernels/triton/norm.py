"""RMSNorm, alone and fused with the residual add that precedes it in a
pre-norm decoder (twins of ``kernels.reference.rms_norm`` / ``fused_add_rms_norm``).

Rounding follows the reference step for step (the sum rounded to the model
dtype, the normalized row rounded before the weight multiply; a float32 weight
with 16-bit x, Gemma's, multiplied before it), so the 16-bit results match
transformers' RMSNorm, not just come close.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.triton.launch import check_same, check_tensor, next_pow2, require


@triton.jit
def _rms_norm_kernel(
    x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr,
    stride_x, stride_res, stride_out, stride_res_out, n_cols, eps,
    HAS_RESIDUAL: tl.constexpr, ROUND_FIRST: tl.constexpr, BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)  # one program per token row
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    dtype = out_ptr.dtype.element_ty
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * stride_res + cols, mask=mask, other=0.0).to(tl.float32)
        s = (x + r).to(dtype)
        tl.store(res_out_ptr + row * stride_res_out + cols, s, mask=mask)
        x = s.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x * x, axis=0) / n_cols + eps)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    if ROUND_FIRST:
        y = (x * rstd).to(dtype).to(tl.float32) * w
    else:
        y = x * rstd * w
    tl.store(out_ptr + row * stride_out + cols, y.to(dtype), mask=mask)


def _launch(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
            eps: float) -> tuple[torch.Tensor, torch.Tensor | None]:
    check_tensor("x", x, 2)
    check_tensor("weight", weight, 1)
    names, tensors = ["x", "weight"], [x, weight]
    if residual is not None:
        check_tensor("residual", residual, 2)
        check_same("shape", ["x", "residual"], [tuple(x.shape), tuple(residual.shape)])
        names, tensors = names + ["residual"], tensors + [residual]
    check_same("dtype", names[::2], [t.dtype for t in tensors[::2]])
    require(weight.dtype in (x.dtype, torch.float32), f"weight must be {x.dtype} or float32, got {weight.dtype}")
    check_same("device", names, [t.device for t in tensors])
    require(weight.shape[0] == x.shape[1], f"weight must have {x.shape[1]} entries, got {weight.shape[0]}")
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    res_out = None if residual is None else torch.empty_like(out)
    if x.shape[0] == 0:
        return out, res_out
    block = next_pow2(x.shape[1])
    _rms_norm_kernel[(x.shape[0],)](
        x, x if residual is None else residual, weight, out, out if res_out is None else res_out,
        x.stride(0), 0 if residual is None else residual.stride(0), out.stride(0), out.stride(0),
        x.shape[1], float(eps),
        HAS_RESIDUAL=residual is not None, ROUND_FIRST=weight.dtype == x.dtype, BLOCK=block, num_warps=min(16, max(1, block // 256)),
    )
    return out, res_out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x (T, N), weight (N,) -> (T, N)."""
    return _launch(x, None, weight, eps)[0]


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                       eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(norm(x + residual), x + residual), both (T, N), in one pass over memory."""
    out, res_out = _launch(x, residual, weight, eps)
    assert res_out is not None
    return out, res_out
