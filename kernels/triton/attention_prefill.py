"""Paged prefill attention over a flat batch of sequences, each with any number of new tokens (a
prompt, a prompt chunk after a cached prefix, or one token: a decode), causal among themselves and
attending to the whole cached context read in place through the block table (twin of
``kernels.reference.paged_prefill_attention``).

One program per (block of ``BLOCK_Q`` queries of one sequence, KV head), flash-attention style: the
``G`` query heads that share the KV head ride as rows of the same tiles (row ``r`` is query
``r // G``, head ``r % G``), so each K/V tile is read once per group, and a one-token sequence
costs what it costs the decode kernel, not G times that. K/V tiles stream through an online
softmax; a program reads only the keys its queries can see (up to its last query's position; with
a sliding window, from its first query's window on).

The grid depends only on the number of tokens and sequences (``T // BLOCK_Q + B`` blocks, sequence
``b``'s first at ``query_start[b] // BLOCK_Q + b``, found by a binary search in each program), not
on the longest query: a step that mixes decodes with prompt chunks is one launch, with no host-side
figure the device would have to wait for, and the launch can be captured in a CUDA graph.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.triton.attention_common import (
    SINK_LOG2E,
    check_paged_args,
    check_sinks,
    dot_args,
    key_tile,
    score_args,
    softcap_scores,
)
from kernels.triton.fp8 import cache_args, fp8_to_float
from kernels.triton.launch import INDEX_DTYPES, check_tensor, next_pow2, require


@triton.jit
def _sequence_of(query_start_ptr, block, nseq, BLOCK_Q: tl.constexpr):
    """The sequence that owns flat query block ``block``: the last ``b`` whose first block,
    ``query_start[b] // BLOCK_Q + b``, is at or before it (a binary search)."""
    lo = 0
    hi = nseq
    while lo < hi:
        mid = (lo + hi) // 2
        if tl.load(query_start_ptr + mid) // BLOCK_Q + mid <= block:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit(do_not_specialize=["nseq"])  # (one compiled kernel for one sequence or many)
def _prefill_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr, query_start_ptr, out_ptr, sinks_ptr,
    qk_scale, inv_cap, cap_log2, window, nseq,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_cb, stride_ct, stride_ch, stride_bt,
    G: tl.constexpr, D: tl.constexpr, PAGE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_D: tl.constexpr, TILE_N: tl.constexpr,
    SOFTCAP: tl.constexpr, PRECISION: tl.constexpr, DOT_F32: tl.constexpr,
    KV_FP8: tl.constexpr, SINKS: tl.constexpr,
):
    block = tl.program_id(0)
    kvh = tl.program_id(1)
    b = _sequence_of(query_start_ptr, block, nseq, BLOCK_Q)
    q_start = tl.load(query_start_ptr + b)
    q_len = tl.load(query_start_ptr + b + 1) - q_start
    seq_len = tl.load(seq_lens_ptr + b)
    first = (block - q_start // BLOCK_Q - b) * BLOCK_Q  # this program's first query, within its sequence
    last = tl.minimum(first + BLOCK_Q, q_len) - 1  # and its last (first > last: a block past the sequence's end)
    # Query i sits at position (seq_len - q_len) + i and sees keys 0..that position (with a window, the
    # latest ``window`` of them); rows past the last query are put at its position, so they see keys.
    offs_m = tl.arange(0, BLOCK_M)
    query = first + offs_m // G
    heads = kvh * G + offs_m % G
    rows_ok = (offs_m < BLOCK_Q * G) & (query <= last)
    q_pos = seq_len - q_len + tl.minimum(query, last)
    hi = tl.where(first <= last, seq_len - q_len + last + 1, 0)  # keys past the last query's position: never seen
    lo = tl.where(window > 0, tl.maximum(seq_len - q_len + first - window + 1, 0), 0)  # its first query's first

    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, TILE_N)
    dmask = offs_d < D
    mmask = rows_ok[:, None] & dmask[None, :]
    rows_q = (q_start + query).to(tl.int64)
    q = tl.load(q_ptr + rows_q[:, None] * stride_qt + heads[:, None] * stride_qh + offs_d[None, :], mask=mmask,
                other=0.0)
    if DOT_F32:
        q = q.to(tl.float32)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    table = block_tables_ptr + b.to(tl.int64) * stride_bt
    for start in range(lo, hi, TILE_N):
        tok = start + offs_n
        valid = tok < hi
        blk = tl.load(table + tok // PAGE, mask=valid, other=0).to(tl.int64)
        rows = blk * stride_cb + (tok % PAGE) * stride_ct + kvh * stride_ch
        kv_mask = valid[:, None] & dmask[None, :]
        k = tl.load(k_cache_ptr + rows[:, None] + offs_d[None, :], mask=kv_mask, other=0)
        v = tl.load(v_cache_ptr + rows[:, None] + offs_d[None, :], mask=kv_mask, other=0)
        if KV_FP8:  # the cache's bytes, widened exactly to q's dtype
            k = fp8_to_float(k, KV_FP8).to(q_ptr.dtype.element_ty)
            v = fp8_to_float(v, KV_FP8).to(q_ptr.dtype.element_ty)
        if DOT_F32:
            k = k.to(tl.float32)
        qk = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale  # (BLOCK_M, TILE_N), base 2
        if SOFTCAP:
            qk = softcap_scores(qk, inv_cap, cap_log2)
        visible = valid[None, :] & (tok[None, :] <= q_pos[:, None])
        visible &= (window == 0) | (tok[None, :] > q_pos[:, None] - window)
        qk = tl.where(visible, qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(qk - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        p = p.to(v.dtype)
        if DOT_F32:
            p = p.to(tl.float32)
            v = v.to(tl.float32)
        acc = acc * alpha[:, None] + tl.dot(p, v, input_precision=PRECISION)
        m_i = m_new

    if SINKS:  # one more term in each head's softmax sum (base 2, as the scores)
        l_i += tl.exp2(tl.load(sinks_ptr + heads) * SINK_LOG2E - m_i)
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(out_ptr + rows_q[:, None] * stride_ot + heads[:, None] * stride_oh + offs_d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=mmask)


def paged_prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            block_tables: torch.Tensor, seq_lens: torch.Tensor, query_start: torch.Tensor,
                            q_index: torch.Tensor | None, out_index: torch.Tensor | None, max_seq_len: int,
                            scale: float, window: int = 0, softcap: float = 0.0,
                            sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention of any number of new tokens per sequence over each one's paged context
    (``window``, ``softcap``, ``sinks``: as decode's).

    The reference's signature: q (T, H, D) holds the new tokens of B sequences,
    sequence ``b`` owning rows ``query_start[b]:query_start[b+1]`` and having
    ``seq_lens[b]`` tokens of context including them. ``q_index`` and
    ``out_index`` (the reference's gather indices) are not read. Returns (T, H, D).
    """
    check_paged_args(q, k_cache, v_cache, block_tables, seq_lens, max_seq_len, scale, window)
    scores = score_args(scale, softcap)
    check_sinks(sinks, q)
    check_tensor("query_start", query_start, 1, INDEX_DTYPES)
    t, h, d = q.shape
    _, page, hkv, _ = k_cache.shape
    nseq = seq_lens.shape[0]
    require(query_start.shape[0] == nseq + 1,
            f"query_start must have {nseq + 1} entries (one more than seq_lens), got {query_start.shape[0]}")
    require(query_start.device == q.device, f"query_start is on {query_start.device}, q on {q.device}")
    out = torch.empty(t, h, d, dtype=q.dtype, device=q.device)
    if t == 0 or nseq == 0:
        return out
    g = h // hkv
    tile = key_tile(q)
    block_m = max(tile, next_pow2(g))  # a program's rows: its queries x the G heads of its KV head
    block_q = block_m // g
    k_cache, v_cache, fmt = cache_args(k_cache, v_cache)
    _prefill_kernel[(t // block_q + nseq, hkv)](
        q, k_cache, v_cache, block_tables, seq_lens, query_start, out, sinks if sinks is not None else out,
        scores["qk_scale"], scores["inv_cap"], scores["cap_log2"], window, nseq,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
        G=g, D=d, PAGE=page, BLOCK_M=block_m, BLOCK_Q=block_q, BLOCK_D=next_pow2(d, 16), TILE_N=tile,
        SOFTCAP=scores["SOFTCAP"], num_warps=4, KV_FP8=fmt, SINKS=sinks is not None, **dot_args(q),
    )
    return out
