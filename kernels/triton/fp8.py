"""The fp8 KV cache's bytes (``--kv-cache-dtype fp8``), written and read with integer arithmetic:
``reference.to_cache``'s rounding, and exact reads, on any GPU (no fp8 instructions needed,
so cards before Ada read the cache too) and in the interpreter alike (whose own fp8 casts round
7.9 to 4). ``FMT``: 1 e4m3fn, 2 e5m2 (0: not fp8)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.reference import fp8_format


def cache_args(k_cache: torch.Tensor, v_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
    """The caches as a kernel takes them (fp8 ones as their bytes) and their ``FMT``."""
    fmt = fp8_format(k_cache.dtype)
    if fmt:
        return k_cache.view(torch.uint8), v_cache.view(torch.uint8), fmt
    return k_cache, v_cache, 0


@triton.jit
def fp8_to_float(x, FMT: tl.constexpr):
    """Bytes (uint8) of fp8 as float32, exactly."""
    MBITS: tl.constexpr = 3 if FMT == 1 else 2
    BIAS: tl.constexpr = 7 if FMT == 1 else 15
    SPECIAL: tl.constexpr = 0x7F if FMT == 1 else 0x7C  # NaN (e4m3fn has no infinity); e5m2: inf, then NaN
    SUB_STEP: tl.constexpr = 0.001953125 if FMT == 1 else 0.0000152587890625  # 2^-9, 2^-16
    u = x.to(tl.uint32)
    sign = (u & 0x80) << 24
    em = u & 0x7F  # exponent and mantissa
    normal = (em << (23 - MBITS)) + ((127 - BIAS) << 23)
    special = 0x7F800000 | ((em & ((1 << MBITS) - 1)) << (23 - MBITS))
    bits = tl.where(em >= SPECIAL, special, normal)
    mag = tl.where(em < (1 << MBITS), em.to(tl.float32) * SUB_STEP, bits.to(tl.float32, bitcast=True))
    return (mag.to(tl.uint32, bitcast=True) | sign).to(tl.float32, bitcast=True)


@triton.jit
def float_to_fp8(x, FMT: tl.constexpr):
    """float32 to the bytes (uint8) of fp8: to nearest, ties to even; from the largest finite value on
    (infinities too) saturated to it; NaN kept."""
    MBITS: tl.constexpr = 3 if FMT == 1 else 2
    BIAS: tl.constexpr = 7 if FMT == 1 else 15
    TOP: tl.constexpr = 448.0 if FMT == 1 else 57344.0
    TOP_CODE: tl.constexpr = 0x7E if FMT == 1 else 0x7B
    MIN_NORMAL: tl.constexpr = 0.015625 if FMT == 1 else 0.00006103515625  # 2^-6, 2^-14
    SUB_STEPS: tl.constexpr = 512.0 if FMT == 1 else 65536.0  # subnormal steps per unit
    SHIFT: tl.constexpr = 23 - MBITS
    u = x.to(tl.uint32, bitcast=True)
    sign = (u >> 24) & 0x80
    u = u & 0x7FFFFFFF
    a = u.to(tl.float32, bitcast=True)
    # the mantissa to MBITS bits, ties to even (a carry goes on into the exponent), rebiased
    normal = ((u + ((1 << (SHIFT - 1)) - 1) + ((u >> SHIFT) & 1)) >> SHIFT) - ((127 - BIAS) << MBITS)
    # subnormal: a whole number of steps, rounded to even by adding and taking away 2^23
    tiny = tl.where(a < MIN_NORMAL, a, 0.0)  # (others, NaN too, would overflow the cast below)
    sub = ((tiny * SUB_STEPS + 8388608.0) - 8388608.0).to(tl.uint32)
    code = tl.where(a >= TOP, TOP_CODE, tl.where(a < MIN_NORMAL, sub, normal))
    code = tl.where(u > 0x7F800000, 0x7F, code)
    return (code | sign).to(tl.uint8)
