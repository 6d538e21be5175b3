"""RMSNorm (with the residual add), RoPE and SiLU-and-mul for CPU tensors: ``elementwise.c``, one
call each instead of the reference's chain of torch operators, with the reference's signatures and
results (bf16 rounded after each step as the reference's operators round; fp32 to 1e-6 relative).

Where the library cannot be built, or for other dtypes or layouts, the reference runs.
"""

from __future__ import annotations

import ctypes
import functools

import torch

from kernels import reference
from kernels.cpu.build import load

_SUFFIX = {torch.float32: "f32", torch.bfloat16: "bf16"}
_P, _I, _F, _N = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_int
_SIGNATURES = {
    "rms_norm": [_P, _P, _P, _P, _P, _I, _I, _F, _N],
    "rope": [_P, _I, _I, _P, _I, _I, _I, _P, _P, _I, _N],
    "silu_and_mul": [_P, _P, _I, _I, _N],
}


@functools.cache
def _library() -> ctypes.CDLL | None:
    return load("elementwise.c", {f"{name}_{suffix}": argtypes for name, argtypes in _SIGNATURES.items()
                                  for suffix in _SUFFIX.values()})


def _kernel(name: str, *tensors: torch.Tensor):
    """The C function for these tensors, or None where the reference must serve: another dtype or
    device, a tensor not contiguous, or no library. (Runs a few times per layer: kept cheap.)"""
    dtype = tensors[0].dtype
    for t in tensors:
        if t.dtype != dtype or not t.is_cpu or not t.is_contiguous():
            return None
    return _functions().get((name, dtype))


@functools.cache
def _functions() -> dict[tuple[str, torch.dtype], ctypes._CFuncPtr]:
    lib = _library()
    return {} if lib is None else {(name, dtype): getattr(lib, f"{name}_{suffix}") for name in _SIGNATURES
                                   for dtype, suffix in _SUFFIX.items()}


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    fn = _kernel("rms_norm", x, weight)
    if fn is None or x.dim() != 2 or weight.shape != x.shape[1:]:
        return reference.rms_norm(x, weight, eps)
    out = torch.empty_like(x)
    fn(x.data_ptr(), None, weight.data_ptr(), out.data_ptr(), None, x.shape[0], x.shape[1], eps,
       torch.get_num_threads())
    return out


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                       eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    fn = _kernel("rms_norm", x, residual, weight)
    if fn is None or x.dim() != 2 or residual.shape != x.shape or weight.shape != x.shape[1:]:
        return reference.fused_add_rms_norm(x, residual, weight, eps)
    out, summed = torch.empty_like(x), torch.empty_like(x)
    fn(x.data_ptr(), residual.data_ptr(), weight.data_ptr(), out.data_ptr(), summed.data_ptr(), x.shape[0],
       x.shape[1], eps, torch.get_num_threads())
    return out, summed


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    fn = _kernel("silu_and_mul", x)
    if fn is None or x.dim() != 2 or x.shape[1] % 2:
        return reference.silu_and_mul(x)
    t, i = x.shape[0], x.shape[1] // 2
    out = x.new_empty(t, i)
    fn(x.data_ptr(), out.data_ptr(), t, i, torch.get_num_threads())
    return out


def heads_rows(x: torch.Tensor) -> bool:
    """(T, heads, D) with each head's D numbers in a row and the heads of a token side by side: a
    view of the fused qkv projection's output is (its rows apart)."""
    return x.dim() == 3 and x.stride(2) == 1 and x.stride(1) == x.shape[2]


def apply_rope_(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    fn = _kernel("rope", cos, sin)
    t, h, d = q.shape if q.dim() == 3 else (0, 0, 0)
    if (fn is None or not (heads_rows(q) and heads_rows(k)) or q.dtype != cos.dtype or k.dtype != cos.dtype
            or k.shape[0] != t or k.shape[2] != d or d % 2 or cos.shape != (t, d // 2) or sin.shape != cos.shape):
        reference.apply_rope_(q, k, cos, sin)
        return
    fn(q.data_ptr(), q.stride(0), h, k.data_ptr(), k.stride(0), k.shape[1], d, cos.data_ptr(), sin.data_ptr(), t,
       torch.get_num_threads())
