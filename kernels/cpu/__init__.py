"""Kernels for CPU tensors, each with the signature of its twin in ``kernels.reference``
(the spec, or ``F.linear`` for ``linear``): paged attention that reads each sequence's
blocks where they sit (decode in compiled C, prefill one SDPA per sequence; ``attention.py``),
a linear layer for steps of few rows (compiled C where measured faster) and for weights kept
packed as GGUF blocks (``matmul.py``), RMSNorm, RoPE and SiLU-and-mul in one compiled call each
(``elementwise.py``; GELU-and-mul is the reference's), a step's K/V stored in one compiled call
(``attention.py``), and a mixture of experts as the reference runs it, its experts' few rows each
through that linear layer.
"""

from kernels.cpu import attention, matmul
from kernels.cpu.attention import (
           available,
           decodes_in_c,
           paged_decode_attention,
           paged_prefill_attention,
           store_kvcache,
)
from kernels.cpu.elementwise import apply_rope_, fused_add_rms_norm, rms_norm, silu_and_mul
from kernels.cpu.matmul import dequantize, linear, linear_packed, packed_available
from kernels.cpu.matmul import tune as tune_linear
from kernels.reference import fused_moe as _reference_moe
from kernels.reference import gelu_and_mul


def fused_moe(x, w13, w2, topk_weights, topk_ids, bias13=None, bias2=None, act=silu_and_mul):
    """The reference's, each expert's projections through ``linear`` (the C kernel for its few rows)."""
    return _reference_moe(x, w13, w2, topk_weights, topk_ids, linear=linear, bias13=bias13, bias2=bias2, act=act)


def set_batch_invariant(on: bool) -> None:
    """Batch-invariant mode: every linear layer's rows through the C kernel (``matmul.set_every_row``), every
    prompt's queries through the decode kernel (``attention.prefill_as_decode``), so that a token's numbers
    depend on its own sequence alone, never on the step that computes it (the other kernels already work row by
    row). RuntimeError where those kernels do not build."""
    if on and not available():
        raise RuntimeError("batch-invariant mode needs the C attention kernel, which could not be built here "
                           "(see the warning above)")
    matmul.set_every_row(on)
    attention.prefill_as_decode = on


__all__ = ["apply_rope_", "available", "decodes_in_c", "dequantize", "fused_add_rms_norm", "fused_moe", "gelu_and_mul",
           "linear", "linear_packed", "packed_available", "paged_decode_attention", "paged_prefill_attention", "rms_norm",
           "set_batch_invariant", "silu_and_mul", "store_kvcache", "tune_linear"]
