"""Triton kernels, each the twin of a function in ``kernels.reference`` (the
spec) with the same signature. They run compiled on CUDA tensors, and on CPU
tensors through Triton's interpreter when ``TRITON_INTERPRET=1`` was set before
triton was imported (``kernels.triton.launch``). Every launcher checks its
arguments and raises ``ValueError`` before launching.

Importing this package imports triton; ``kernels`` imports it only when a
Triton kernel is first wanted.
"""

from kernels.triton.activation import gelu_and_mul, silu_and_mul
from kernels.triton.attention_decode import paged_decode_attention
from kernels.triton.attention_prefill import paged_prefill_attention
from kernels.triton.kv_store import store_kvcache
from kernels.triton.linear_packed import FORMATS as PACKED_FORMATS
from kernels.triton.linear_packed import dequantize, linear_packed
from kernels.triton.moe import fused_moe
from kernels.triton.norm import fused_add_rms_norm, rms_norm
from kernels.triton.rope import apply_rope_, rope_and_store_
from kernels.triton.sample import sample_race

__all__ = ["PACKED_FORMATS", "apply_rope_", "dequantize", "fused_add_rms_norm", "fused_moe", "gelu_and_mul",
           "linear_packed", "paged_decode_attention", "paged_prefill_attention", "rms_norm", "rope_and_store_",
           "sample_race", "silu_and_mul", "store_kvcache"]
