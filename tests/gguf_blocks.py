"""GGUF blocks for tests: ``quantize`` as llama.cpp's formats lay them out, for the K-quants too (gguf's
Python package reads them but does not write them). Round to nearest with one scale per sub-block, not
llama.cpp's search for the best scales: the layouts are what the tests need, not the quality."""

from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType
from gguf.quants import quantize as gguf_quantize

# what llama.cpp writes instead where a row is not whole super-blocks of 256 (llama-quant.cpp)
FALLBACK = {"Q4_K": "Q5_0", "Q5_K": "Q5_1", "Q6_K": "Q8_0"}


def block_type(kind: str, k: int) -> str | None:
    """The type a matrix of rows of ``k`` gets for ``kind`` (None: kept as floats)."""
    if kind in FALLBACK and k % 256:
        kind = FALLBACK[kind]
    return kind if k % 32 == 0 else None


def quantize(t: np.ndarray, kind: str) -> np.ndarray:
    """Rows of ``t`` (..., K) as ``kind`` blocks: uint8 (..., K / block weights * block bytes)."""
    if kind not in ("Q4_K", "Q5_K", "Q6_K"):
        return gguf_quantize(t.astype(np.float32), GGMLQuantizationType[kind])
    x = t.astype(np.float32).reshape(-1, 256)
    blocks = _q6_k(x) if kind == "Q6_K" else _q45_k(x, 5 if kind == "Q5_K" else 4)
    return blocks.reshape(*t.shape[:-1], -1)


def _f16(a: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """a (B, 1) as fp16 bytes (B, 2), and back as float32."""
    h = a.astype(np.float16)
    return h.view(np.uint8).reshape(-1, 2), h.astype(np.float32)


def _ratio(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return np.divide(a, b, out=np.zeros(np.broadcast(a, b).shape, np.float32), where=b != 0)


def _q45_k(x: np.ndarray, bits: int) -> np.ndarray:
    """Q4_K / Q5_K: x (B, 256) -> (B, 144 / 176): d, dmin, 12 bytes of 6-bit scales and minimums,
    (Q5_K) 32 bytes of fifth bits, 128 bytes of 4-bit halves."""
    top = (1 << bits) - 1
    sub = x.reshape(-1, 8, 32)
    lo = np.minimum(sub.min(-1), 0)
    scale, low = (sub.max(-1) - lo) / top, -lo  # (B, 8): x = scale q - low
    d_bytes, d = _f16(scale.max(-1, keepdims=True) / 63)
    m_bytes, dmin = _f16(low.max(-1, keepdims=True) / 63)
    sc = np.clip(np.round(_ratio(scale, d)), 0, 63).astype(np.uint8)
    m = np.clip(np.round(_ratio(low, dmin)), 0, 63).astype(np.uint8)
    q = np.clip(np.round(_ratio(sub + (dmin * m)[..., None], (d * sc)[..., None])), 0, top).astype(np.uint8)
    scales = np.concatenate([sc[:, :4] | (sc[:, 4:] >> 4) << 6, m[:, :4] | (m[:, 4:] >> 4) << 6,
                             (sc[:, 4:] & 15) | (m[:, 4:] & 15) << 4], axis=1)
    qs = (q[:, 0::2] & 15) | (q[:, 1::2] & 15) << 4  # (B, 4, 32): sub-blocks 2i and 2i + 1 share bytes
    parts = [d_bytes, m_bytes, scales]
    if bits == 5:
        parts.append(sum((q[:, g] >> 4) << g for g in range(8)).astype(np.uint8))
    return np.concatenate(parts + [qs.reshape(-1, 128)], axis=1)


def _q6_k(x: np.ndarray) -> np.ndarray:
    """Q6_K: x (B, 256) -> (B, 210): 128 bytes of low 4 bits, 64 of high 2 bits, 16 int8 scales, d."""
    groups = x.reshape(-1, 16, 16)
    scale = np.abs(groups).max(-1) / 31  # (B, 16), x = scale (q - 32)
    d_bytes, d = _f16(scale.max(-1, keepdims=True) / 127)
    sc = np.clip(np.round(_ratio(scale, d)), -128, 127).astype(np.int8)
    q = np.clip(np.round(_ratio(groups, (d * sc)[..., None])) + 32, 0, 63).astype(np.uint8)
    q = q.reshape(-1, 2, 4, 32)  # (B, half, r, l): sub-block 4 half + r
    ql = np.concatenate([(q[:, :, 0] & 15) | (q[:, :, 2] & 15) << 4, (q[:, :, 1] & 15) | (q[:, :, 3] & 15) << 4],
                        axis=2)  # (B, half, 64)
    qh = sum((q[:, :, r] >> 4) << (2 * r) for r in range(4)).astype(np.uint8)  # (B, half, 32)
    return np.concatenate([ql.reshape(-1, 128), qh.reshape(-1, 64), sc.view(np.uint8), d_bytes], axis=1)
