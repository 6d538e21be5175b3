"""Paged decode attention: one new query per sequence over its cached K/V,
read in place through the block table (twin of
``kernels.reference.paged_decode_attention``).

One program per (sequence, KV head, split): the G query heads that share the
KV head ride together as the rows of one ``tl.dot``, so each K/V tile is read
once per group. A sliding window reads only its keys. Long contexts (or windows)
with few sequences are split along the keys
(flash-decoding): each split writes its partial softmax state (max, sum,
unnormalized output) and a second kernel merges the splits.
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
from kernels.triton.launch import cdiv, interpreting, next_pow2, require, sm_count

MIN_SPLIT_TOKENS = 256  # below this a split's setup and merge cost more than its parallelism gains
MAX_SPLITS = 64


@triton.jit
def _decode_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr,
    out_ptr, part_acc_ptr, part_m_ptr, part_l_ptr, sinks_ptr,
    qk_scale, inv_cap, cap_log2, window, tokens_per_split, num_splits,
    stride_qb, stride_qh, stride_ob, stride_oh,
    stride_cb, stride_ct, stride_ch, stride_bt,
    G: tl.constexpr, D: tl.constexpr, PAGE: tl.constexpr,
    BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, TILE_N: tl.constexpr,
    SPLIT: tl.constexpr, SOFTCAP: tl.constexpr, PRECISION: tl.constexpr, DOT_F32: tl.constexpr,
    KV_FP8: tl.constexpr, SINKS: tl.constexpr,
):
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + b)
    first_key = tl.where(window > 0, tl.maximum(seq_len - window, 0), 0)  # a sliding window's first
    lo = first_key + split * tokens_per_split
    hi = tl.minimum(seq_len, lo + tokens_per_split)

    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, TILE_N)
    gmask = offs_g < G
    dmask = offs_d < D
    heads = kvh * G + offs_g
    qmask = gmask[:, None] & dmask[None, :]
    q = tl.load(q_ptr + b.to(tl.int64) * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
                mask=qmask, other=0.0)
    if DOT_F32:
        q = q.to(tl.float32)

    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    table = block_tables_ptr + b.to(tl.int64) * stride_bt
    for start in range(lo, hi, TILE_N):
        tok = start + offs_n
        valid = tok < hi
        # each token finds its block: tiles need not align with blocks, so any block size works
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
        qk = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale  # (BLOCK_G, TILE_N), base 2
        if SOFTCAP:
            qk = softcap_scores(qk, inv_cap, cap_log2)
        qk = tl.where(valid[None, :], qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(qk - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        p = p.to(v.dtype)  # probabilities in the model dtype for the tensor-core dot, as prefill rounds them
        if DOT_F32:
            p = p.to(tl.float32)
            v = v.to(tl.float32)
        acc = acc * alpha[:, None] + tl.dot(p, v, input_precision=PRECISION)
        m_i = m_new

    if SPLIT:
        # partial state of this split; a split past the sequence's end leaves max -inf, sum 0
        part = (b.to(tl.int64) * G * tl.num_programs(1) + heads) * num_splits + split  # (BLOCK_G,)
        tl.store(part_m_ptr + part, m_i, mask=gmask)
        tl.store(part_l_ptr + part, l_i, mask=gmask)
        tl.store(part_acc_ptr + part[:, None] * D + offs_d[None, :], acc, mask=qmask)
    else:
        if SINKS:  # one more term in each head's softmax sum (base 2, as the scores)
            l_i += tl.exp2(tl.load(sinks_ptr + heads, mask=gmask, other=0.0) * SINK_LOG2E - m_i)
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(out_ptr + b.to(tl.int64) * stride_ob + heads[:, None] * stride_oh + offs_d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=qmask)


@triton.jit
def _merge_splits_kernel(
    part_acc_ptr, part_m_ptr, part_l_ptr, out_ptr, sinks_ptr, num_splits, stride_ob, stride_oh,
    H: tl.constexpr, D: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr, SINKS: tl.constexpr,
):
    b = tl.program_id(0)  # one program per (sequence, query head)
    h = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    smask = offs_s < num_splits
    dmask = offs_d < D
    part = (b.to(tl.int64) * H + h) * num_splits + offs_s
    m = tl.load(part_m_ptr + part, mask=smask, other=float("-inf"))
    l_s = tl.load(part_l_ptr + part, mask=smask, other=0.0)
    # split 0 always holds the first key seen, so the global max is finite and empty splits weigh 0
    top = tl.max(m, 0)
    w = tl.exp2(m - top)
    acc = tl.load(part_acc_ptr + part[:, None] * D + offs_d[None, :], mask=smask[:, None] & dmask[None, :],
                  other=0.0)
    total = tl.sum(l_s * w, 0)
    if SINKS:
        total += tl.exp2(tl.load(sinks_ptr + h) * SINK_LOG2E - top)
    out = tl.sum(acc * w[:, None], 0) / total
    tl.store(out_ptr + b.to(tl.int64) * stride_ob + h * stride_oh + offs_d, out.to(out_ptr.dtype.element_ty),
             mask=dmask)


def _auto_splits(batch: int, kv_heads: int, max_seq_len: int, device: torch.device) -> int:
    """Enough splits to give every SM about two programs, none shorter than MIN_SPLIT_TOKENS."""
    if interpreting():
        return 1  # programs run one after another: splitting only adds the merge
    want = cdiv(2 * sm_count(device), batch * kv_heads)
    return max(1, min(want, cdiv(max_seq_len, MIN_SPLIT_TOKENS), MAX_SPLITS))


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, seq_lens: torch.Tensor, max_seq_len: int,
                           scale: float, window: int = 0, softcap: float = 0.0,
                           sinks: torch.Tensor | None = None, *, num_splits: int | None = None,
                           tile: int | None = None, num_warps: int = 4) -> torch.Tensor:
    """One new query per sequence: q (B, H, D) attends to its ``seq_lens[b]`` cached tokens (with a
    sliding ``window``, the latest ``window`` of them; ``softcap``, ``sinks``: the reference's).

    ``num_splits`` splits each context along the keys (None: chosen from the batch
    shape and the device); the result does not depend on it beyond rounding. ``tile`` (keys a
    loop step, a power of two from 16; None: 64, fp32's 32) and ``num_warps`` shape the launch
    (``tools/bench_kernels.py`` times the choices)."""
    check_paged_args(q, k_cache, v_cache, block_tables, seq_lens, max_seq_len, scale, window)
    scores = score_args(scale, softcap)
    check_sinks(sinks, q)
    b, h, d = q.shape
    _, page, hkv, _ = k_cache.shape
    require(seq_lens.shape[0] == b, f"seq_lens must have {b} entries (one per query), got {seq_lens.shape[0]}")
    out = torch.empty(b, h, d, dtype=q.dtype, device=q.device)
    if b == 0 or max_seq_len == 0:
        return out
    tile = tile or key_tile(q)
    require(tile >= 16 and tile & (tile - 1) == 0, f"tile must be a power of two from 16, got {tile}")
    span = min(max_seq_len, window) if window else max_seq_len  # the most keys a query sees
    splits = num_splits if num_splits is not None else _auto_splits(b, hkv, span, q.device)
    require(splits >= 1, f"num_splits must be positive, got {splits}")
    tokens_per_split = cdiv(cdiv(span, splits), tile) * tile
    splits = cdiv(span, tokens_per_split)  # no split left wholly past the last key
    g = h // hkv
    if splits > 1:
        part_acc = torch.empty(b, h, splits, d, dtype=torch.float32, device=q.device)
        part_m = torch.empty(b, h, splits, dtype=torch.float32, device=q.device)
        part_l = torch.empty_like(part_m)
    else:
        part_acc = part_m = part_l = out  # unused: the kernel writes the output itself
    k_cache, v_cache, fmt = cache_args(k_cache, v_cache)
    _decode_kernel[(b, hkv, splits)](
        q, k_cache, v_cache, block_tables, seq_lens, out, part_acc, part_m, part_l,
        sinks if sinks is not None else out, scores["qk_scale"], scores["inv_cap"], scores["cap_log2"], window, tokens_per_split, splits,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
        G=g, D=d, PAGE=page, BLOCK_G=next_pow2(g, 16), BLOCK_D=next_pow2(d, 16), TILE_N=tile,
        SPLIT=splits > 1, SOFTCAP=scores["SOFTCAP"], num_warps=num_warps, KV_FP8=fmt, SINKS=sinks is not None,
        **dot_args(q),
    )
    if splits > 1:
        _merge_splits_kernel[(b, h)](
            part_acc, part_m, part_l, out, sinks if sinks is not None else out, splits, out.stride(0), out.stride(1),
            H=h, D=d, BLOCK_S=next_pow2(splits, 2), BLOCK_D=next_pow2(d, 16), SINKS=sinks is not None, num_warps=4,
        )
    return out
