"""SiLU-and-mul and GELU-and-mul of a fused gate|up projection (twins of
``kernels.reference.silu_and_mul`` and ``gelu_and_mul``)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.triton.launch import cdiv, check_tensor, next_pow2, require

BLOCK = 1024


@triton.jit
def _act_and_mul_kernel(x_ptr, out_ptr, stride_x, stride_out, n_cols, GELU: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)  # one program per (token, column block)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    dtype = out_ptr.dtype.element_ty
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + n_cols + cols, mask=mask, other=0.0).to(tl.float32)
    # the activation rounded to the model dtype before the multiply, as torch's two ops round
    if GELU:  # tanh approximation: 0.5 g (1 + tanh(sqrt(2 / pi) (g + 0.044715 g^3))), tanh(y) = 2 sigmoid(2y) - 1
        inner = 0.7978845608028654 * (gate + 0.044715 * gate * gate * gate)
        act = gate * (1.0 - 1.0 / (1.0 + tl.exp(2.0 * inner)))
    else:
        act = gate / (1.0 + tl.exp(-gate))
    act = act.to(dtype).to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, (act * up).to(dtype), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """(T, 2I) gate|up fused -> (T, I)."""
    return _act_and_mul(x, gelu=False)


def gelu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """(T, 2I) gate|up fused -> (T, I), GELU's tanh approximation."""
    return _act_and_mul(x, gelu=True)


def _act_and_mul(x: torch.Tensor, gelu: bool) -> torch.Tensor:
    check_tensor("x", x, 2)
    require(x.shape[1] % 2 == 0, f"x must have an even number of columns (gate|up), got {x.shape[1]}")
    t, n = x.shape[0], x.shape[1] // 2
    out = torch.empty(t, n, dtype=x.dtype, device=x.device)
    if t == 0 or n == 0:
        return out
    block = min(BLOCK, next_pow2(n))
    _act_and_mul_kernel[(t, cdiv(n, block))](x, out, x.stride(0), out.stride(0), n, GELU=gelu, BLOCK=block)
    return out
