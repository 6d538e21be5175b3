"""Pure-torch reference kernels: the spec every Triton kernel must match, and
what runs on the CPU. Tensors in, tensors out; nothing here knows of requests.

KV cache layout, per layer: ``(num_blocks, block_size, num_kv_heads, head_dim)``
for K and for V. A token's *slot* is ``block_id * block_size + offset``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def store_kvcache(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  slot_mapping: torch.Tensor) -> None:
    """Write new keys/values ``(T, Hkv, D)`` into their slots ``(T,)``."""
    hkv, d = k.shape[1], k.shape[2]
    k_cache.view(-1, hkv, d).index_copy_(0, slot_mapping, k)
    v_cache.view(-1, hkv, d).index_copy_(0, slot_mapping, v)


DECODE_GROUP = 16


def _gather_context(cache: torch.Tensor, block_tables: torch.Tensor, max_seq_len: int) -> torch.Tensor:
    """Each sequence's first ``max_seq_len`` cached tokens from its blocks: (B, S, Hkv, D)."""
    num_blocks, block_size, hkv, d = cache.shape
    nblk = -(-max_seq_len // block_size)
    bt = block_tables[:, :nblk].reshape(-1)
    # index_select over whole blocks (rows of a 2-D view) is ~3x faster than advanced indexing
    rows = cache.view(num_blocks, -1).index_select(0, bt)
    return rows.view(block_tables.shape[0], nblk * block_size, hkv, d)[:, :max_seq_len]


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float,
           softcap: float = 0.0, causal: bool = False) -> torch.Tensor:
    """Attention in float32 (16-bit inputs too, as prefill's SDPA accumulates: one rule for decode and
    prefill, so a request recomputed after preemption keeps its greedy tokens). q (B, H, Q, D); k, v
    (B, Hkv, S, D); ``mask`` (broadcast to (B, H, Q, S), True: visible) or ``causal`` (Q = S). ``softcap``
    (Gemma 2): each score s becomes ``softcap * tanh(s / softcap)`` before the softmax."""
    q, k, v = q.float(), k.float(), v.float()
    h, hkv = q.shape[1], k.shape[1]
    if not softcap:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=hkv != h,
                                              is_causal=causal)
    if hkv != h:
        k, v = k.repeat_interleave(h // hkv, dim=1), v.repeat_interleave(h // hkv, dim=1)
    s = torch.tanh(q @ k.transpose(-1, -2) * (scale / softcap)) * softcap  # (B, H, Q, S)
    if causal:
        mask = torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).tril()
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf"))
    return torch.softmax(s, dim=-1) @ v


def window_mask(keys: int, q_pos: torch.Tensor, window: int) -> torch.Tensor:
    """(..., keys) True where key j is visible from a query at ``q_pos`` (...): causal, and with a
    sliding ``window`` (0: none) only the ``window`` latest positions, j > q_pos - window (as
    transformers' and llama.cpp's sliding-window masks)."""
    j = torch.arange(keys, device=q_pos.device)
    mask = j <= q_pos[..., None]
    return mask & (j > q_pos[..., None] - window) if window else mask


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, seq_lens: torch.Tensor, max_seq_len: int,
                           scale: float, window: int = 0, softcap: float = 0.0) -> torch.Tensor:
    """One new query per sequence: q (B, H, D) attends to its ``seq_lens[b]`` cached tokens; with a
    sliding ``window``, to the latest ``window`` of them; ``softcap``: as ``attend``'s.

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
                                                int(seq_lens[g].max()), scale, window, softcap))
        return torch.cat(parts)
    k = _gather_context(k_cache, block_tables, max_seq_len)  # (B, S, Hkv, D)
    v = _gather_context(v_cache, block_tables, max_seq_len)
    visible = window_mask(max_seq_len, seq_lens - 1, window)  # (B, S)
    out = attend(q[:, :, None], k.transpose(1, 2), v.transpose(1, 2), visible[:, None, None], scale,
                 softcap)  # (B, H, 1, D)
    return out.view(b, h, d).to(q.dtype)


def paged_prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            block_tables: torch.Tensor, seq_lens: torch.Tensor, query_start: torch.Tensor,
                            q_index: torch.Tensor, out_index: torch.Tensor, max_seq_len: int,
                            scale: float, window: int = 0, softcap: float = 0.0) -> torch.Tensor:
    """Causal attention of several new tokens per sequence over each one's paged context (``window``,
    ``softcap``: as decode's).

    q: (T, H, D) new tokens of B sequences, flattened. Sequence ``b`` owns queries
    ``query_start[b]:query_start[b+1]`` and has ``seq_lens[b]`` tokens of context in
    total (cached ones plus these), the new ones last: a prompt chunk after a
    prefix. ``q_index`` (B, Q) gathers each sequence's queries into a padded grid
    (pad cells point at row T, a zero row); ``out_index`` (T,) picks each real query
    back out of the flattened grid. Returns (T, H, D).
    """
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
                 softcap)  # (B, H, Q, D)
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


def fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor, linear=F.linear) -> torch.Tensor:
    """A mixture of experts' MLPs: token t goes through experts ``topk_ids[t]`` (each a gated MLP,
    ``down(silu(gate x) * up x)``) and their outputs are summed, weighted by ``topk_weights[t]``.

    x (T, H); w13 (E, 2I, H) each expert's gate|up; w2 (E, H, I) its down projection; topk_weights
    (T, K) float32; topk_ids (T, K) -> (T, H) in x's dtype. Each expert multiplies its tokens at once;
    a token's K outputs are weighted and added in float32 in the order of their experts' ids (as
    transformers adds them in float32; in bf16 it rounds the weights or each product to bf16). Reads
    the experts' token counts on the host: not for a captured graph. ``linear``: the ``F.linear`` each
    expert's projections go through (``kernels.cpu`` passes its own, ``kernels`` a packed one)."""
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
            h = linear(silu_and_mul(linear(x[rows], w13[e])), w2[e])
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


# GGUF block formats of 32 weights (the packed weights kernels.cpu multiplies without expanding them
# in memory): name -> bytes per block. An fp16 scale d; Q4_1 then an fp16 minimum m; then the weights:
# 4-bit (weight j in the low half of byte j, weight j + 16 in its high half) or signed 8-bit.
PACKED_BLOCK_BYTES = {"q4_0": 18, "q4_1": 20, "q8_0": 34, "q4_z": 20}
# each format's number in the packed kernels (matmul.c's enum, the Triton kernel's FMT): their order above
PACKED_FORMATS = {fmt: i for i, fmt in enumerate(PACKED_BLOCK_BYTES)}


def dequantize(weight: torch.Tensor, fmt: str) -> torch.Tensor:
    """Packed (N, K / 32 * block bytes) uint8 rows -> float32 (N, K): Q4_0 d (q - 8), Q4_1 d q + m,
    Q8_0 d q, each as gguf's ``dequantize`` computes it (the products are exact; Q4_1's sum is
    rounded once); Q4_Z (not GGUF's: AWQ's and GPTQ's int4 groups, ``engine/quant.py``) is Q4_1's
    layout with an fp16 zero point z in place of the minimum, d (q - z), exact."""
    blocks = weight.reshape(weight.shape[0], -1, PACKED_BLOCK_BYTES[fmt])  # (N, K / 32, block)
    d = blocks[..., 0:2].contiguous().view(torch.float16).float()  # (N, K / 32, 1)
    if fmt == "q8_0":
        return (d * blocks[..., 2:].contiguous().view(torch.int8).float()).reshape(weight.shape[0], -1)
    qs = blocks[..., 2:] if fmt == "q4_0" else blocks[..., 4:]
    q = torch.cat([qs & 15, qs >> 4], dim=-1).float()  # (N, K / 32, 32)
    if fmt == "q4_0":
        return (d * (q - 8)).reshape(weight.shape[0], -1)
    m = blocks[..., 2:4].contiguous().view(torch.float16).float()
    if fmt == "q4_z":
        return (d * (q - m)).reshape(weight.shape[0], -1)
    return (d * q + m).reshape(weight.shape[0], -1)


def linear_packed(x: torch.Tensor, weight: torch.Tensor, fmt: str, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear`` with ``weight`` packed (``dequantize``): computed in float32 on the exact weights,
    then cast back to x's dtype."""
    return F.linear(x.float(), dequantize(weight, fmt), None if bias is None else bias.float()).to(x.dtype)
