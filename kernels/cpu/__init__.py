"""Kernels for CPU tensors, each with the signature of its twin in ``kernels.reference``
(the spec, or ``F.linear`` for ``linear``): paged attention that reads each sequence's
blocks where they sit (decode in compiled C, prefill one SDPA per sequence; ``attention.py``),
a linear layer for steps of few rows (compiled C where measured faster) and for weights kept
packed as GGUF blocks (``matmul.py``), and RMSNorm, RoPE and SiLU-and-mul in one compiled call each (``elementwise.py``). Storing K/V is
the reference's (one ``index_copy_`` each).
"""

from kernels.cpu.attention import available, decodes_in_c, paged_decode_attention, paged_prefill_attention
from kernels.cpu.elementwise import apply_rope_, fused_add_rms_norm, rms_norm, silu_and_mul
from kernels.cpu.matmul import dequantize, linear, linear_packed, packed_available
from kernels.cpu.matmul import tune as tune_linear
from kernels.reference import store_kvcache

__all__ = ["apply_rope_", "available", "decodes_in_c", "dequantize", "fused_add_rms_norm", "linear", "linear_packed",
           "packed_available", "paged_decode_attention", "paged_prefill_attention", "rms_norm", "silu_and_mul",
           "store_kvcache", "tune_linear"]
