"""Pure-torch reference kernels: the spec every Triton kernel must match, and
what runs on the CPU. Tensors in, tensors out; nothing here knows of requests.

KV cache layout, per layer: ``(num_blocks, block_size, num_kv_heads, head_dim)``
for K and for V. A token's *slot* is ``block_id * block_size + offset``.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

# What a KV cache may hold besides the model's dtype (``--kv-cache-dtype fp8``): K and V rounded as
# ``to_cache`` rounds them, read back exactly (fp8 widens to fp32 without loss). No scale: a value is
# kept as it is (vLLM's default of 1.0 where a checkpoint gives none).
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def fp8_format(dtype: torch.dtype) -> int:
    """How the compiled kernels name a cache's dtype: 1 e4m3fn, 2 e5m2, 0 not fp8 (the model's)."""
    return FP8_DTYPES.index(dtype) + 1 if dtype in FP8_DTYPES else 0


def to_cache(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x`` as a cache of ``dtype`` keeps it: fp8 rounds to the nearest value (ties to even) and
    saturates at its largest finite one (448 for e4m3, 57344 for e5m2; a NaN stays NaN)."""
    if dtype in FP8_DTYPES:
        top = torch.finfo(dtype).max
        return x.float().clamp(-top, top).to(dtype)
    return x.to(dtype)


def store_kvcache(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  slot_mapping: torch.Tensor) -> None:
    """Write new keys/values ``(T, Hkv, D)`` into their slots ``(T,)``; an fp8 cache gets them rounded
    (``to_cache``)."""
    hkv, d = k.shape[1], k.shape[2]
    for x, cache in ((k, k_cache), (v, v_cache)):
        if cache.dtype in FP8_DTYPES:  # (index_copy_ has no fp8 kernels: the bytes go in)
            x, cache = to_cache(x, cache.dtype).view(torch.uint8), cache.view(torch.uint8)
        cache.view(-1, hkv, d).index_copy_(0, slot_mapping, x)


DECODE_GROUP = 16


def _gather_context(cache: torch.Tensor, block_tables: torch.Tensor, max_seq_len: int) -> torch.Tensor:
    """Each sequence's first ``max_seq_len`` cached tokens from its blocks: (B, S, Hkv, D)."""
    num_blocks, block_size, hkv, d = cache.shape
    nblk = -(-max_seq_len // block_size)
    bt = block_tables[:, :nblk].reshape(-1)
    # index_select over whole blocks (rows of a 2-D view) is ~3x faster than advanced indexing
    rows = cache_rows(cache).index_select(0, bt).view(cache.dtype)
    return rows.view(block_tables.shape[0], nblk * block_size, hkv, d)[:, :max_seq_len]


def cache_rows(cache: torch.Tensor) -> torch.Tensor:
    """A cache (num_blocks, block_size, Hkv, D) as one row per block to gather from: an fp8 one as its
    bytes (``.view(cache.dtype)`` after), which every torch has kernels for."""
    rows = cache.view(cache.shape[0], -1)
    return rows.view(torch.uint8) if cache.dtype in FP8_DTYPES else rows


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float,
           softcap: float = 0.0, causal: bool = False, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Attention in float32 (16-bit inputs too, as prefill's SDPA accumulates: one rule for decode and
    prefill, so a request recomputed after preemption keeps its greedy tokens). q (B, H, Q, D); k, v
    (B, Hkv, S, D); ``mask`` (broadcast to (B, H, Q, S), True: visible) or ``causal`` (Q = S). ``softcap``
    (Gemma 2): each score s becomes ``softcap * tanh(s / softcap)`` before the softmax. ``sinks`` (H,)
    (GPT-OSS's attention sinks): one more score per head in each softmax, for a key without a value."""
    q, k, v = q.float(), k.float(), v.float()
    h, hkv = q.shape[1], k.shape[1]
    if not softcap and sinks is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=hkv != h,
                                              is_causal=causal)
    if hkv != h:
        k, v = k.repeat_interleave(h // hkv, dim=1), v.repeat_interleave(h // hkv, dim=1)
    if softcap:
        s = torch.tanh(q @ k.transpose(-1, -2) * (scale / softcap)) * softcap  # (B, H, Q, S)
    else:
        s = q @ k.transpose(-1, -2) * scale
    if causal:
        mask = torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).tril()
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf"))
    if sinks is None:
        return torch.softmax(s, dim=-1) @ v
    sink = sinks.float().view(1, h, 1, 1).expand(*s.shape[:-1], 1)
    return torch.softmax(torch.cat([s, sink], dim=-1), dim=-1)[..., :-1] @ v


def window_mask(keys: int, q_pos: torch.Tensor, window: int) -> torch.Tensor:
    """(..., keys) True where key j is visible from a query at ``q_pos`` (...): causal, and with a
    sliding ``window`` (0: none) only the ``window`` latest positions, j > q_pos - window (as
    transformers' and llama.cpp's sliding-window masks)."""
    j = torch.arange(keys, device=q_pos.device)
    mask = j <= q_pos[..., None]
    return mask & (j > q_pos[..., None] - window) if window else mask


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, seq_lens: torch.Tensor, max_seq_len: int,
                           scale: float, window: int = 0, softcap: float = 0.0,
                           sinks: torch.Tensor | None = None) -> torch.Tensor:
    """One new query per sequence: q (B, H, D) attends to its ``seq_lens[b]`` cached tokens; with a
    sliding ``window``, to the latest ``window`` of them; ``softcap``, ``sinks``: as ``attend``'s.

    On the CPU, large batches run in groups of ``DECODE_GROUP`` sequences: a group's gathered context
    stays in cache (measured on 2 CPU cores: decode attention ~1.5x faster, a W1 decode step
    ~6% faster in float32), and callers that sort sequences by length cut each group's padding.
    """
    b, h, d = q.shape
    if b > DECODE_GROUP and q.device.type == "cpu":  # a cache-size trick; on GPU it would only sync
        parts = []
        for i in range(0, b, DECODE_GROUP):
            g = slice(i, i + DECODE_GROUP)
            parts.append(paged_decode_attention(q[g], k_cache, v_cache, block_tables[g], seq_lens[g],
                                                int(seq_lens[g].max()), scale, window, softcap, sinks))
        return torch.cat(parts)
    k = _gather_context(k_cache, block_tables, max_seq_len)  # (B, S, Hkv, D)
    v = _gather_context(v_cache, block_tables, max_seq_len)
    visible = window_mask(max_seq_len, seq_lens - 1, window)  # (B, S)
    out = attend(q[:, :, None], k.transpose(1, 2), v.transpose(1, 2), visible[:, None, None], scale,
                 softcap, sinks=sinks)  # (B, H, 1, D)
    return out.view(b, h, d).to(q.dtype)


def prefill_gather(query_start: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``paged_prefill_attention``'s ``q_index`` (B, Q) and ``out_index`` (T,) for B sequences whose new tokens
    start at ``query_start`` (B + 1,) offsets (T of them in all, Q the most)."""
    q_lens = query_start[1:] - query_start[:-1]
    t, qmax = int(query_start[-1]), int(q_lens.max()) if len(q_lens) else 0
    grid = torch.arange(qmax, device=q_lens.device)[None, :]
    seq_of = torch.repeat_interleave(torch.arange(len(q_lens), device=q_lens.device), q_lens)  # (T,) each one's
    q_index = torch.where(grid < q_lens[:, None], query_start[:-1, None] + grid, t)
    return q_index, seq_of * qmax + (torch.arange(t, device=q_lens.device) - query_start[:-1][seq_of])


def paged_prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            block_tables: torch.Tensor, seq_lens: torch.Tensor, query_start: torch.Tensor,
                            q_index: torch.Tensor | None, out_index: torch.Tensor | None, max_seq_len: int,
                            scale: float, window: int = 0, softcap: float = 0.0,
                            sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention of several new tokens per sequence over each one's paged context (``window``,
    ``softcap``, ``sinks``: as decode's).

    q: (T, H, D) new tokens of B sequences, flattened. Sequence ``b`` owns queries
    ``query_start[b]:query_start[b+1]`` and has ``seq_lens[b]`` tokens of context in
    total (cached ones plus these), the new ones last: a prompt chunk after a
    prefix. ``q_index`` (B, Q) gathers each sequence's queries into a padded grid
    (pad cells point at row T, a zero row); ``out_index`` (T,) picks each real query
    back out of the flattened grid (None: made here, ``prefill_gather``). Returns (T, H, D).
    """
    if q_index is None or out_index is None:
        q_index, out_index = prefill_gather(query_start)
    t, h, d = q.shape
    b, qmax = q_index.shape
    qp = torch.cat([q, q.new_zeros(1, h, d)])[q_index]  # (B, Q, H, D)
    k = _gather_context(k_cache, block_tables, max_seq_len)  # (B, S, Hkv, D)
    v = _gather_context(v_cache, block_tables, max_seq_len)
    # Query i of sequence b sits at position seq_len - q_len + i and sees keys 0..that position.
    q_lens = query_start[1:] - query_start[:-1]
    # (padding cells are put at the last position: they see keys, so no row of the softmax is empty)
    q_pos = (seq_lens - q_lens)[:, None] + torch.arange(qmax, device=q.device)[None, :]  # (B, Q)
    mask = window_mask(max_seq_len, torch.minimum(q_pos, seq_lens[:, None] - 1), window)  # (B, Q, S)
    out = attend(qp.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), mask[:, None], scale,
                 softcap, sinks=sinks)  # (B, H, Q, D)
    return out.transpose(1, 2).reshape(b * qmax, h, d)[out_index].to(q.dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x / rms(x) * weight, computed in float32. The weight's dtype says where it is rounded to x's dtype:
    a weight in x's dtype multiplies the rounded row (transformers' Llama); a float32 weight with 16-bit
    x multiplies before the one rounding (Gemma's, whose weight is kept as 1 + w). In float32 both are one."""
    dtype = x.dtype
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if weight.dtype == torch.float32 and dtype != torch.float32:
        return (xf * weight).to(dtype)
    return weight * xf.to(dtype)


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                       eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """A pre-norm decoder's residual add and the next norm: (norm(x + residual), x + residual)."""
    x = x + residual
    return rms_norm(x, weight, eps), x


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """(T, 2I) gate|up fused -> (T, I)."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate).mul_(up)  # in place: one (T, I) tensor fewer, 4x faster for a 2048-token chunk


def gelu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """(T, 2I) gate|up fused -> (T, I): GELU (tanh approximation, Gemma's) of gate, times up."""
    gate, up = x.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh").mul_(up)


def swiglu_oai(x: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """(T, 2I) gate|up fused -> (T, I): GPT-OSS's clamped SwiGLU, as transformers computes it: gate capped at
    ``limit``, up clamped to [-limit, limit], then (up + 1) gate sigmoid(alpha gate)."""
    gate, up = x.chunk(2, dim=-1)
    gate, up = gate.clamp(max=limit), up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


def fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor, linear=F.linear, linear_down=None, bias13: torch.Tensor | None = None,
              bias2: torch.Tensor | None = None, act=silu_and_mul) -> torch.Tensor:
    """A mixture of experts' MLPs: token t goes through experts ``topk_ids[t]`` (each a gated MLP,
    ``down(silu(gate x) * up x)``) and their outputs are summed, weighted by ``topk_weights[t]``.

    x (T, H); w13 (E, 2I, H) each expert's gate|up; w2 (E, H, I) its down projection; topk_weights
    (T, K) float32; topk_ids (T, K) -> (T, H) in x's dtype. Each expert multiplies its tokens at once;
    a token's K outputs are weighted and added in float32 in the order of their experts' ids (as
    transformers adds them in float32; in bf16 it rounds the weights or each product to bf16). Reads
    the experts' token counts on the host: not for a captured graph. ``linear``: the ``F.linear`` each
    expert's projections go through (``kernels.cpu`` passes its own, ``kernels`` a packed one);
    ``linear_down``: down's, where it differs (packed in another format). GPT-OSS's experts: ``bias13`` (E, 2I)
    and ``bias2`` (E, H) added to each projection's product (before the weighting), and its activation ``act``
    (``swiglu_oai``) in place of SiLU-and-mul."""
    linear_down = linear_down or linear
    t, k = topk_ids.shape
    flat = topk_ids.reshape(-1)
    order = torch.argsort(flat, stable=True)  # (T K,) each expert's (token, slot) pairs together
    counts = torch.bincount(flat, minlength=w13.shape[0]).tolist()
    weights = topk_weights.reshape(-1)
    out = torch.zeros(t, x.shape[1], dtype=torch.float32, device=x.device)
    start = 0
    for e, n in enumerate(counts):
        if n:
            pairs = order[start:start + n]
            rows = pairs // k
            h = linear(x[rows], w13[e])
            h = act(h if bias13 is None else h + bias13[e])
            h = linear_down(h, w2[e])
            if bias2 is not None:
                h = h + bias2[e]
            out.index_add_(0, rows, h.float() * weights[pairs, None])
            start += n
    return out.to(x.dtype)


def apply_rope_(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """Rotate-half RoPE (Hugging Face layout) on q (T, H, D) and k (T, Hkv, D), written back in
    place (they may be views of a fused qkv projection). cos/sin: (T, D/2)."""
    c, s = cos[:, None, :], sin[:, None, :]
    for x in (q, k):
        x1, x2 = x.chunk(2, dim=-1)
        r1, r2 = (x1 * c - x2 * s).to(x.dtype), (x2 * c + x1 * s).to(x.dtype)
        x1.copy_(r1)
        x2.copy_(r2)


# GGUF block formats (the packed weights kernels.cpu multiplies without expanding them in memory):
# name -> (weights per block, bytes per block). Blocks of 32: an fp16 scale d; Q4_1 and Q5_1 then an fp16
# minimum m; Q5_0 and Q5_1 then the weights' fifth bits (32, little-endian); then the weights: 4-bit
# (weight j in the low half of byte j, weight j + 16 in its high half) or signed 8-bit. K-quants: super-blocks
# of 256 in sub-blocks of 32 (Q2_K, Q3_K, Q6_K: 16) with scales of their own (``_k_quants``). IQ4_NL is
# Q4_0's layout with its 4 bits an index into ``IQ4_LEVELS``; IQ4_XS super-blocks of those (``_k_quants``). MXFP4
# (GPT-OSS's experts, as ggml lays it out): a byte e, then IQ4_NL's nibbles, each an index into ``MXFP4_LEVELS``,
# the weight 2^(e - 128) MXFP4_LEVELS[q] (FP4 E2M1's values doubled).
PACKED_BLOCKS = {"q4_0": (32, 18), "q4_1": (32, 20), "q8_0": (32, 34), "q4_z": (32, 20), "q5_0": (32, 22),
                 "q5_1": (32, 24), "q4_k": (256, 144), "q5_k": (256, 176), "q6_k": (256, 210), "q2_k": (256, 84),
                 "q3_k": (256, 110), "iq4_nl": (32, 18), "iq4_xs": (256, 136), "mxfp4": (32, 17)}
# IQ4_NL's and IQ4_XS's 16 levels (llama.cpp's kvalues_iq4nl): a 4-bit weight q is d * IQ4_LEVELS[q]
IQ4_LEVELS = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)
MXFP4_LEVELS = (0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12)
# each format's number in the packed kernels (matmul.c's enum, the Triton kernel's FMT): their order above
PACKED_FORMATS = {fmt: i for i, fmt in enumerate(PACKED_BLOCKS)}


def packed_row_bytes(fmt: str, k: int) -> int:
    """Bytes of a row of ``k`` weights packed in ``fmt`` (whole blocks only)."""
    if fmt not in PACKED_BLOCKS:
        raise ValueError(f"unknown packed format {fmt!r}; known: {', '.join(PACKED_BLOCKS)}")
    weights, size = PACKED_BLOCKS[fmt]
    if k % weights:
        raise ValueError(f"a {fmt} row needs whole blocks of {weights} weights, got {k}")
    return k // weights * size


_SHIFTS_2 = torch.tensor([0, 2, 4, 6], dtype=torch.uint8).view(4, 1)  # 2-bit fields of a byte


def _half(blocks: torch.Tensor, at: int) -> torch.Tensor:
    """The fp16 at byte ``at`` of each block, as float32 (..., 1)."""
    return blocks[..., at:at + 2].contiguous().view(torch.float16).float()


def _bits(b: torch.Tensor, count: int) -> torch.Tensor:
    """Bits 0..count-1 of each byte of ``b`` (..., n) as (..., count, n): bit i of every byte in row i."""
    shifts = torch.arange(count, dtype=torch.uint8, device=b.device).view(-1, 1)
    return (b.unsqueeze(-2) >> shifts) & 1


def dequantize(weight: torch.Tensor, fmt: str) -> torch.Tensor:
    """Packed (N, K / block weights * block bytes) uint8 rows -> float32 (N, K), each format as gguf's
    ``dequantize`` computes it: Q4_0 d (q - 8), Q5_0 d (q - 16), Q4_1 and Q5_1 d q + m, Q8_0 d q, IQ4_NL
    d IQ4_LEVELS[q], MXFP4 2^(e - 128) MXFP4_LEVELS[q] (the products are exact; a sum is rounded once); the
    super-blocks in ``_k_quants``. Q4_Z (not GGUF's: AWQ's
    and GPTQ's int4 groups, ``engine/quant.py``) is Q4_1's layout with an fp16 zero point z in place of
    the minimum, d (q - z), exact."""
    n = weight.shape[0]
    if PACKED_BLOCKS[fmt][0] == 256:
        return _k_quants(weight.reshape(n, -1, PACKED_BLOCKS[fmt][1]), fmt).reshape(n, -1)
    blocks = weight.reshape(n, -1, PACKED_BLOCKS[fmt][1])  # (N, K / 32, block)
    if fmt == "mxfp4":
        q = torch.cat([blocks[..., 1:] & 15, blocks[..., 1:] >> 4], dim=-1).long()  # (N, K / 32, 32)
        levels = torch.tensor(MXFP4_LEVELS, dtype=torch.float32, device=q.device)[q]
        return torch.ldexp(levels, blocks[..., :1].to(torch.int32) - 128).reshape(n, -1)
    d = _half(blocks, 0)  # (N, K / 32, 1)
    if fmt == "q8_0":
        return (d * blocks[..., 2:].contiguous().view(torch.int8).float()).reshape(n, -1)
    qs = blocks[..., {"q4_0": 2, "q5_0": 6, "q5_1": 8, "iq4_nl": 2}.get(fmt, 4):]
    q = torch.cat([qs & 15, qs >> 4], dim=-1)  # (N, K / 32, 32)
    if fmt == "iq4_nl":
        return (d * torch.tensor(IQ4_LEVELS, dtype=torch.float32, device=q.device)[q.long()]).reshape(n, -1)
    q = q.float()
    if fmt in ("q5_0", "q5_1"):  # the fifth bits: bit j of the 32-bit word for weight j
        at = 2 if fmt == "q5_0" else 4
        q = q + 16 * _bits(blocks[..., at:at + 4], 8).transpose(-1, -2).reshape(n, -1, 32).float()
    if fmt in ("q4_0", "q5_0"):
        return (d * (q - (8 if fmt == "q4_0" else 16))).reshape(n, -1)
    m = _half(blocks, 2)
    if fmt == "q4_z":
        return (d * (q - m)).reshape(n, -1)
    return (d * q + m).reshape(n, -1)


def _k_quants(blocks: torch.Tensor, fmt: str) -> torch.Tensor:
    """(N, B, block bytes) super-blocks of 256 -> float32 (N, B, 256), as llama.cpp's ``dequantize_row_*``.
    Q4_K and Q5_K: d and dmin (fp16), 12 bytes of 6-bit scales and minimums for 8 sub-blocks of 32
    (Q5_K: then 32 bytes of fifth bits, bit g of byte l for sub-block g's weight l), 128 bytes of 4-bit
    weights (sub-blocks 2i and 2i + 1 in the low and high halves of bytes 32i..32i+31); weight
    (d sc) q - dmin m, the products exact, the difference rounded once. Q6_K: 128 bytes of low 4 bits
    (sub-block 4h + r in bytes 64h + 32 (r & 1).., half r >> 1), 64 of high 2 bits (bytes 32h.., bits 2r),
    16 signed 8-bit scales (one per 16 weights), d (fp16) last; weight (d sc) (q - 32), rounded once."""
    n, b = blocks.shape[:2]
    if fmt in ("q2_k", "q3_k", "iq4_xs"):
        return _low_bit_k_quants(blocks, fmt)
    if fmt == "q6_k":
        ql, qh = blocks[..., :128].reshape(n, b, 2, 2, 32), blocks[..., 128:192].reshape(n, b, 2, 1, 32)
        low = torch.stack([ql & 15, ql >> 4], dim=-3).reshape(n, b, 8, 32)  # (half, nibble, byte group)
        high = ((qh >> _SHIFTS_2.to(qh.device)) & 3).reshape(n, b, 8, 32)
        q = (low | high << 4).float() - 32
        ds = _half(blocks, 208) * blocks[..., 192:208].contiguous().view(torch.int8).float()  # (N, B, 16)
        return (ds.view(n, b, 8, 2, 1) * q.view(n, b, 8, 2, 16)).reshape(n, b, 256)
    s = blocks[..., 4:16].reshape(n, b, 3, 4)
    sc = torch.cat([s[..., 0, :] & 63, (s[..., 2, :] & 15) | (s[..., 0, :] >> 6) << 4], dim=-1)
    mins = torch.cat([s[..., 1, :] & 63, (s[..., 2, :] >> 4) | (s[..., 1, :] >> 6) << 4], dim=-1)
    qs = blocks[..., -128:].reshape(n, b, 4, 1, 32)
    q = torch.cat([qs & 15, qs >> 4], dim=-2).reshape(n, b, 8, 32)  # sub-block 2i: low halves, 2i + 1: high
    if fmt == "q5_k":
        q = q | _bits(blocks[..., 16:48], 8) << 4
    d1 = (_half(blocks, 0) * sc.float()).unsqueeze(-1)  # (N, B, 8, 1)
    m1 = (_half(blocks, 2) * mins.float()).unsqueeze(-1)
    return (d1 * q.float() - m1).reshape(n, b, 256)


def _low_bit_k_quants(blocks: torch.Tensor, fmt: str) -> torch.Tensor:
    """Q2_K, Q3_K and IQ4_XS super-blocks, as llama.cpp's ``dequantize_row_*``. Q2_K: 16 bytes of scales
    (low 4 bits) and minimums (high 4) per 16 weights, 64 bytes of 2-bit weights (32-weight piece 4h + s
    in bytes 16 + 32h.., bits 2s), d, dmin; weight (d sc) q - dmin m, rounded once. Q3_K: 32 bytes of
    high bits (piece p: bit p of byte l; a bit *clear* takes 4 off), 64 bytes of 2-bit weights (as
    Q2_K's), 12 bytes of 6-bit scales less 32 (scale i: low 4 bits from byte i mod 8, half i // 8; high 2
    from byte 8 + i mod 4, bits 2 (i // 4)), d; weight (d sc) q, exact. IQ4_XS: d, 16 bits of high scale
    bits (2 per 32 weights), 4 bytes of low scale bits (4 per 32), then 32-weight blocks as IQ4_NL's;
    weight (d (sc - 32)) IQ4_LEVELS[q], exact (24 bits at most)."""
    n, b = blocks.shape[:2]
    if fmt == "iq4_xs":
        sh = blocks[..., 2:4].contiguous().view(torch.int16).to(torch.int32) & 0xFFFF  # (N, B, 1)
        sl = blocks[..., 4:8]
        low = torch.stack([sl & 15, sl >> 4], dim=-1).reshape(n, b, 8).to(torch.int32)
        high = (sh >> torch.arange(0, 16, 2, dtype=torch.int32, device=sh.device)) & 3
        dl = _half(blocks, 0) * ((low | high << 4) - 32).float()  # (N, B, 8)
        qs = blocks[..., 8:].reshape(n, b, 8, 16)
        q = torch.cat([qs & 15, qs >> 4], dim=-1)  # (N, B, 8, 32)
        levels = torch.tensor(IQ4_LEVELS, dtype=torch.float32, device=q.device)[q.long()]
        return (dl.unsqueeze(-1) * levels).reshape(n, b, 256)
    qs = blocks[..., 16:80] if fmt == "q2_k" else blocks[..., 32:96]
    shifts = _SHIFTS_2.to(blocks.device)
    q = ((qs.reshape(n, b, 2, 1, 32) >> shifts) & 3).reshape(n, b, 16, 16)  # (N, B, group of 16, 16)
    if fmt == "q2_k":
        sc = blocks[..., :16]
        dl = (_half(blocks, 80) * (sc & 15).float()).unsqueeze(-1)  # (N, B, 16, 1)
        ml = (_half(blocks, 82) * (sc >> 4).float()).unsqueeze(-1)
        return (dl * q.float() - ml).reshape(n, b, 256)
    high = _bits(blocks[..., :32], 8).reshape(n, b, 16, 16)  # piece p's weights' high bits
    q = q.to(torch.int8) - ((high ^ 1) << 2).to(torch.int8)
    s = blocks[..., 96:108]
    low = torch.cat([s[..., :8] & 15, s[..., :8] >> 4], dim=-1)  # (N, B, 16)
    hi = ((s[..., 8:12].unsqueeze(-2) >> shifts) & 3).reshape(n, b, 16)
    sc = (low | hi << 4).to(torch.int8) - 32
    dl = (_half(blocks, 108) * sc.float()).unsqueeze(-1)
    return (dl * q.float()).reshape(n, b, 256)


def linear_packed(x: torch.Tensor, weight: torch.Tensor, fmt: str, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear`` with ``weight`` packed (``dequantize``): computed in float32 on the exact weights,
    then cast back to x's dtype."""
    return F.linear(x.float(), dequantize(weight, fmt), None if bias is None else bias.float()).to(x.dtype)


# ----------------------------------------------------------------------------- sampling

_MASK32 = (1 << 32) - 1


def _mix32_(x: torch.Tensor) -> torch.Tensor:
    """In place: a 32-bit integer hash (hash-prospector's ``[16 21f0aaad 15 735a2d97 15]``) of int64
    lanes holding 32-bit values. Both multipliers are below 2**31, so no product leaves int64: every
    device computes the same bits, without relying on overflow."""
    x ^= x >> 16
    x.mul_(0x21F0AAAD).bitwise_and_(_MASK32)
    x ^= x >> 15
    x.mul_(0x735A2D97).bitwise_and_(_MASK32)
    x ^= x >> 15
    return x


def exponentials(keys: torch.Tensor, vocab: int) -> torch.Tensor:
    """Exp(1) noise (n, ``vocab``) float32 from (n, 2) int64 row keys (two 32-bit values each), on ``keys``' device.

    Token ``v`` of a row gets ``mix(mix(v ^ k0) ^ k1)``; its top 23 bits, centred in their
    bucket, are a uniform ``u`` in (0, 1), exact in float32 (so never 0 nor 1, and ``-log(u)`` is
    finite and positive).
    """
    x = torch.arange(vocab, device=keys.device) ^ keys[:, :1]  # (n, V) int64, 32-bit values
    _mix32_(x)
    x ^= keys[:, 1:]
    _mix32_(x)
    return x.bitwise_right_shift_(9).float().add_(0.5).mul_(2.0 ** -23).log_().neg_()


def top_p_cut(sorted_probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Which tokens top-p drops, for each row's (n, V) probabilities sorted likeliest first: a token goes when the
    tokens above it already hold ``top_p`` (n,) of the mass (>= 1: none goes), but never the likeliest, nor one
    tied in probability with the last kept (the same set in whatever order the sort left ties)."""
    p = torch.where(top_p >= 1.0, 2.0, top_p).to(sorted_probs.dtype).unsqueeze(1)  # (a bound no round-off reaches)
    drop = (sorted_probs.cumsum(dim=-1) - sorted_probs) >= p
    drop[:, 0] = False
    return drop & (sorted_probs < sorted_probs.masked_fill(drop, math.inf).amin(dim=-1, keepdim=True))


def sample_race(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                min_p: torch.Tensor, keys: torch.Tensor, max_k: int | None = None) -> torch.Tensor:
    """One token a row, (n,) int64: the exponential race ``argmax(p / E)`` (``E`` from ``exponentials(keys)``)
    over the tokens that top-k, top-p and min-p keep, under ``softmax(logits / temperature)``. Per row: top-k
    (int64, 0: off) keeps the tokens at least as likely as the k-th (ties kept; ``max_k``, the largest k where
    the caller knows it, spares Triton's launcher a search over the whole vocabulary; unused here); top-p
    (float32, >= 1: off) the smallest prefix of the sorted distribution that top-k leaves, renormalised, whose
    mass reaches ``top_p`` (the likeliest always), and the tokens tied with its last (``top_p_cut``); min-p the
    tokens at least ``min_p`` times as likely as the likeliest (0: every one)."""
    x = logits.float() / temperature.unsqueeze(1)
    sorted_x, order = x.sort(dim=-1, descending=True)
    k = torch.where(top_k > 0, top_k, x.shape[1]).clamp(max=x.shape[1])
    in_k = sorted_x >= sorted_x.gather(1, (k - 1).unsqueeze(1))
    drop = top_p_cut(sorted_x.masked_fill(~in_k, -math.inf).softmax(dim=-1), top_p)
    kept = torch.empty_like(drop).scatter_(1, order, in_k & ~drop)
    kept &= x >= x.amax(dim=-1, keepdim=True) + torch.log(min_p).unsqueeze(1)
    probs = x.softmax(dim=-1)  # (the race's order: the same over the kept tokens as their renormalised one's)
    return probs.masked_fill_(~kept, 0.0).div_(exponentials(keys, x.shape[1])).argmax(dim=-1)
