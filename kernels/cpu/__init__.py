"""Kernels for CPU tensors, each with the signature of its twin in ``kernels.reference``
(the spec, or ``F.linear`` for ``linear``): paged attention that reads each sequence's
blocks where they sit (decode in compiled C, prefill one SDPA per sequence; ``attention.py``),
a linear layer for steps of few rows (compiled C where measured faster) and for weights kept
packed as GGUF blocks (``matmul.py``), RMSNorm, RoPE and SiLU-and-mul in one compiled call each
(``elementwise.py``), and a step's K/V stored in one compiled call (``attention.py``).
"""

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

__all__ = ["apply_rope_", "available", "decodes_in_c", "dequantize", "fused_add_rms_norm", "linear", "linear_packed",
           "packed_available", "paged_decode_attention", "paged_prefill_attention", "rms_norm", "silu_and_mul",
           "store_kvcache", "tune_linear"]
