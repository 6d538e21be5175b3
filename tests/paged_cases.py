"""Paged-attention cases that every backend's tests share (the Triton kernels', the CPU
kernels'), each checked against ``kernels.reference``: ragged lengths, lengths that end
mid-block and on a block edge, a sequence of length 1, GQA ratios 1, 3 and 4, head sizes
from 8 to 128, block sizes from 8 to 64; and caches with each sequence's blocks scattered
at random and NaN in every slot that no sequence owns.
"""

from __future__ import annotations

import torch

from kernels import reference

F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16
# fp32 to 1e-4 relative; 16-bit: a few ulps
ATTN_TOL = {F32: dict(rtol=1e-4, atol=1e-5), BF16: dict(rtol=3e-2, atol=3e-2), F16: dict(rtol=5e-3, atol=5e-3)}
_seed = iter(range(10**6))

# dtype, head_dim, block size, H, Hkv, seq_lens, num_splits (Triton's split-K; None: the launcher's choice)
DECODE_CASES = [
    (F32, 64, 16, 4, 4, [1, 17, 33, 5], None),  # MHA; length 1; ends mid-block and on a block edge
    (F32, 128, 32, 12, 4, [70, 3, 32], 3),  # GQA 3, split-K (a short sequence leaves splits empty)
    (BF16, 64, 16, 8, 2, [45, 1, 16, 100], 4),  # GQA 4, split-K
    (F16, 128, 16, 4, 1, [29, 64], None),  # one KV head for all
    (F32, 8, 8, 4, 2, [9, 3], 2),  # tiny heads (padded to 16) and blocks smaller than a tile
    (BF16, 32, 32, 9, 3, [77, 2], 2),  # SmolLM2's 3:1 grouping
    (F16, 16, 64, 6, 2, [130, 64], None),  # large blocks, several tiles per block
]

# dtype, head_dim, block size, H, Hkv, query_lens, seq_lens (cached prefix = seq_len - query_len)
PREFILL_CASES = [
    (F32, 64, 16, 4, 4, [5, 1, 37], [5, 1, 37]),  # fresh prompts, one of length 1, several query blocks
    (F32, 128, 32, 6, 2, [7, 20, 3], [40, 20, 35]),  # chunks after cached prefixes, GQA 3
    (BF16, 64, 16, 8, 2, [17, 2], [50, 18]),  # GQA 4
    (F16, 32, 16, 4, 1, [9, 24], [9, 33]),
    (F32, 16, 8, 9, 3, [3, 11], [14, 11]),  # SmolLM2's grouping, small heads and blocks
    # a step of decodes (one query each) around prompt chunks, Qwen2-0.5B's grouping of 7 (rows of a program's
    # tile that no query fills), and a run of decodes longer than a program's block of queries
    (F32, 64, 16, 14, 2, [1, 1, 9, 1, 1, 1, 1, 20, 1], [30, 1, 20, 17, 64, 5, 2, 40, 33]),
    (BF16, 64, 16, 14, 2, [1, 12, 1, 1], [50, 12, 7, 90]),
]

# sliding windows (decode, prefill) and Gemma 2's softcap: dtype, head_dim, block size, H, Hkv, query_lens,
# seq_lens, window, softcap (decode: query_lens all 1)
WINDOW_CASES = [
    (F32, 64, 16, 4, 2, [1, 1, 1, 1], [1, 17, 40, 100], 24, 0.0),  # shorter than, at and past the window
    (BF16, 64, 16, 8, 2, [1, 1], [90, 7], 33, 5.0),  # windows not on block edges; capped scores
    (F32, 32, 8, 6, 2, [30, 5, 1], [30, 50, 9], 12, 0.0),  # prompts and chunks longer than the window
    (F32, 64, 16, 4, 4, [40, 3], [70, 3], 0, 2.0),  # a cap without a window
    (BF16, 128, 32, 4, 1, [17, 2], [80, 18], 16, 3.0),
]


# GPT-OSS's attention sinks (one per query head): dtype, head_dim, block size, H, Hkv, query_lens, seq_lens, window
# (query_lens all 1: decode); ``sinks_for`` gives each head's, one of them far above every score
SINK_CASES = [
    (F32, 64, 16, 8, 2, [1, 1, 1], [1, 40, 300], 0),  # decode, GQA 4 (its 300 keys split 3 ways in Triton)
    (BF16, 64, 16, 8, 1, [1, 1], [90, 7], 24),  # a window
    (F32, 64, 16, 4, 2, [30, 5, 1], [30, 50, 9], 12),  # prefill: prompts, a chunk after a prefix, a window
    (BF16, 128, 32, 4, 4, [17, 2], [80, 18], 0),
]


def sinks_for(h: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """(h,) float32 sinks: small ones of both signs, and one (head 1) far above any score (its output ~0)."""
    s = torch.linspace(-2.0, 2.0, h)
    s[1] = 40.0
    return s.to(device)


E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
# fp8 caches (--kv-cache-dtype fp8): q's dtype, the caches', head_dim, block size, H, Hkv, query_lens, seq_lens,
# window, softcap (query_lens all 1: decode)
FP8_CASES = [
    (F32, E4M3, 64, 16, 9, 3, [1, 1, 1], [1, 17, 40], 0, 0.0),  # SmolLM2's heads
    (BF16, E4M3, 128, 16, 8, 2, [1, 1], [33, 70], 0, 0.0),
    (F32, E5M2, 64, 16, 4, 4, [1, 1], [90, 7], 24, 5.0),  # a window and a cap
    (BF16, E5M2, 32, 8, 4, 1, [1, 1], [20, 9], 0, 0.0),  # head size neither 64 nor 128
    (F32, E4M3, 64, 16, 9, 3, [5, 12], [5, 40], 0, 0.0),  # prefill: a prompt, a chunk after a prefix
    (BF16, E5M2, 32, 8, 6, 2, [9, 3], [30, 14], 12, 0.0),
]

# values a store into an fp8 cache must round right: the largest and past it, infinities, NaN, signed zeros,
# subnormals and the halfway points between them, and 7.9 (which Triton's own fp8 cast in the interpreter
# rounds to 4)
_INF = float("inf")
FP8_EDGES = [448., 464., 480., 57344., 61440., 1e30, _INF, -_INF, float("nan"), 0., -0., 2 ** -6, 2 ** -9, 2 ** -10,
             3 * 2 ** -11, 2 ** -14, 2 ** -16, 2 ** -17, 3 * 2 ** -18, -3 * 2 ** -18, 7.9, -7.9]


def check_fp8_store(store, values: torch.Tensor, cache_dtype: torch.dtype) -> None:
    """``store`` (a backend's ``store_kvcache``) puts ``values`` (T, Hkv, D) as K and their negatives as V
    into an fp8 cache byte for byte as the reference does (torch's rounding), slot 0 left alone."""
    t, hkv, d = values.shape
    kc = torch.zeros(t + 1, 1, hkv, d, dtype=cache_dtype, device=values.device)
    vc, want_k, want_v = kc.clone(), kc.clone(), kc.clone()
    slots = torch.arange(t, device=values.device) + 1
    store(values, -values, kc, vc, slots)
    reference.store_kvcache(values, -values, want_k, want_v, slots)
    assert torch.equal(kc.view(torch.uint8), want_k.view(torch.uint8))
    assert torch.equal(vc.view(torch.uint8), want_v.view(torch.uint8))
    assert not kc.view(torch.uint8)[0].any()


def fp8_caches(seq_lens: list[int], page: int, hkv: int, d: int, dtype: torch.dtype, device: str = "cpu"):
    """``paged_cache``'s five, the caches rounded to the fp8 ``dtype`` as a store rounds them (NaN kept)."""
    *caches, tables = paged_cache(seq_lens, page, hkv, d, F32, device)
    return *(reference.to_cache(c, dtype) for c in caches), tables


def case_id(case: tuple) -> str:
    """Readable test ids: f32-64-16-4-4-1,17,33,5-None."""
    def one(x) -> str:
        if isinstance(x, torch.dtype):
            return {F32: "f32", BF16: "bf16", F16: "f16", E4M3: "e4m3", E5M2: "e5m2"}[x]
        return ",".join(map(str, x)) if isinstance(x, list) else str(x)
    return "-".join(map(one, case))


def gen() -> torch.Generator:
    """A fresh generator per input, so every case sees new numbers yet reruns alike."""
    return torch.Generator().manual_seed(next(_seed))


def randn(*shape: int, dtype: torch.dtype = F32, device: str = "cpu") -> torch.Tensor:
    return torch.randn(*shape, generator=gen()).to(dtype=dtype, device=device)


def paged_cache(seq_lens: list[int], page: int, hkv: int, d: int, dtype: torch.dtype, device: str = "cpu"):
    """Caches with each sequence's blocks scattered at random, and block tables padded with junk
    ids. Returns (clean k, clean v, poisoned k, poisoned v, block_tables): the poisoned caches
    hold NaN in every slot no sequence owns, which a kernel that reads past a sequence's end
    turns into NaN output; the references read whole blocks, so they get the clean ones."""
    nblk = [-(-n // page) for n in seq_lens]
    total = sum(nblk) + 3
    perm = torch.randperm(total, generator=gen()).tolist()
    width = max(nblk) + 1
    tables = torch.full((len(seq_lens), width), total - 1, dtype=torch.int32)  # junk past the end
    owned = torch.zeros(total * page, dtype=torch.bool)
    for b, (n, k) in enumerate(zip(seq_lens, nblk, strict=True)):
        ids = [perm.pop() for _ in range(k)]
        tables[b, :k] = torch.tensor(ids)
        pos = torch.arange(n)
        owned[torch.tensor(ids)[pos // page] * page + pos % page] = True
    k = randn(total, page, hkv, d, dtype=dtype, device=device)
    v = randn(total, page, hkv, d, dtype=dtype, device=device)
    hole = (~owned).view(total, page).to(device)
    clean_k, clean_v = k.masked_fill(hole[..., None, None], 0), v.masked_fill(hole[..., None, None], 0)
    nan = float("nan")
    return clean_k, clean_v, k.masked_fill(hole[..., None, None], nan), v.masked_fill(hole[..., None, None], nan), \
        tables.to(device)


def prefill_indices(query_lens: list[int], device: str = "cpu") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """query_start, and the reference's q_index / out_index (as engine.attention builds them)."""
    q_lens = torch.tensor(query_lens)
    start = torch.zeros(len(query_lens) + 1, dtype=torch.int64)
    torch.cumsum(q_lens, 0, out=start[1:])
    q_index, out_index = reference.prefill_gather(start)
    return start.to(device), q_index.to(device), out_index.to(device)


def against_reference(kernels, q: torch.Tensor, caches: tuple, tables: torch.Tensor, seq_lens: list[int],
                      query_lens: list[int], scale: float, window: int = 0, softcap: float = 0.0,
                      sinks: torch.Tensor | None = None, **decode_kw):
    """(``kernels``' attention over the poisoned caches, the reference's over the clean ones): decode where
    each sequence has one query, else prefill. ``caches``: ``paged_cache``'s (or ``fp8_caches``') first four;
    ``decode_kw``: more for ``kernels``' decode (Triton's num_splits)."""
    clean_k, clean_v, k, v = caches
    lens, n = torch.tensor(seq_lens, device=q.device), max(seq_lens)
    if set(query_lens) == {1}:
        return (kernels.paged_decode_attention(q, k, v, tables, lens, n, scale, window, softcap, sinks, **decode_kw),
                reference.paged_decode_attention(q, clean_k, clean_v, tables.long(), lens, n, scale, window, softcap,
                                                 sinks))
    start, q_index, out_index = prefill_indices(query_lens, q.device)
    return (kernels.paged_prefill_attention(q, k, v, tables, lens, start, q_index, out_index, n, scale, window,
                                            softcap, sinks),
            reference.paged_prefill_attention(q, clean_k, clean_v, tables.long(), lens, start, q_index, out_index, n,
                                              scale, window, softcap, sinks))
