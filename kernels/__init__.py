"""Kernels: tensors in, tensors out. CUDA tensors take the Triton kernels (when
they exist for that op); everything else takes the pure-torch reference in
``kernels.reference``, which is also the spec the Triton kernels are tested against.
"""

from kernels.reference import (
    apply_rope,
    paged_decode_attention,
    paged_prefill_attention,
    rms_norm,
    silu_and_mul,
    store_kvcache,
)

__all__ = ["apply_rope", "paged_decode_attention", "paged_prefill_attention", "rms_norm", "silu_and_mul",
           "store_kvcache"]
