"""Paged attention for CPU tensors: the reference's signatures and results (fp32 to 1e-4
relative), without the reference's batch-wide gather into a padded grid.

- decode: ``paged_attention.c`` (built by ``kernels.cpu.build``) reads each sequence's K/V
  blocks where they sit, a query head at a time with an online softmax; float32 and bfloat16, the
  cache in q's dtype or fp8 (``reference.FP8_DTYPES``, widened 16 values at a time with F16C, else
  through a table).
  The reference's gather and SDPA were a third of a 32-sequence fp32 decode step on 2 cores;
  this is ~2x faster (and one sequence of 240 tokens, SmolLM2's heads: 30 us, 2 threads; its scores
  exponentiated 8 at a time, 38 us with a scalar expf each).
- prefill: one SDPA call per sequence over its own blocks, causal from its cached prefix on:
  no padding to the longest prompt, no (B, Q, S) mask; ~2x the reference's speed.
- storing a step's K/V: ``paged_attention.c`` too, one call for both (the reference's two
  ``index_copy_`` cost ~40 us a layer at one token, a tenth of a one-stream decode step); into an
  fp8 cache rounded there, as ``reference.to_cache`` rounds.

Where the library cannot be built, or for other dtypes, head sizes that are not multiples of 8 or
past 256, or blocks of more than 256 tokens, decode goes to the reference.
Arguments are checked before the C code runs, as the Triton launchers check theirs: a bad
shape is a ``ValueError``, not a crash.
"""

from __future__ import annotations

import ctypes
import functools

import torch

from kernels import reference
from kernels.cpu import graph
from kernels.cpu.build import load, status_check
from kernels.cpu.elementwise import heads_rows

_DECODE = {torch.float32: "paged_decode_f32", torch.bfloat16: "paged_decode_bf16"}
MAX_D = MAX_BS = 256  # as in paged_attention.c: head sizes (multiples of 8) and block sizes it takes


# batch-invariant mode (``kernels.set_batch_invariant``): a prompt's queries go through the decode kernel,
# each as the one query of its position's prefix, so that a query's result is the same bits whether it
# comes in a prompt, a chunk of one, after a cached prefix, or as a decode step
prefill_as_decode = False


class _Dims(ctypes.Structure):
    _fields_ = ([(name, ctypes.c_int64) for name in ("H", "HKV", "D", "BS", "W", "window")]
                + [("scale", ctypes.c_float), ("softcap", ctypes.c_float), ("kv_fp8", ctypes.c_int64),
                   ("sinks", ctypes.c_void_p)])


@functools.cache
def _library() -> ctypes.CDLL | None:
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    return load("paged_attention.c", dict.fromkeys(_DECODE.values(), [p] * 6 + [i64, ctypes.POINTER(_Dims), ctypes.c_int])
                | {"store_kv": [p, i64, p, i64, p, p, p] + [i64] * 3,
                   "store_kv_fp8": [p, i64, p, i64, p, p, p] + [i64] * 3 + [ctypes.c_int] * 2},
                restype=ctypes.c_int,
                errcheck=status_check("the C attention kernel"))


def available() -> bool:
    """Whether the compiled decode kernel runs here (building it on first call)."""
    return _library() is not None


def decodes_in_c(head_dim: int, block_size: int) -> bool:
    """Whether decode attention over heads of ``head_dim`` in blocks of ``block_size`` runs in the C
    kernel here; else the reference serves, which gathers every sequence's context."""
    return head_dim % 8 == 0 and head_dim <= MAX_D and block_size <= MAX_BS and available()


def store_kvcache(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  slot_mapping: torch.Tensor) -> None:
    """As ``kernels.reference.store_kvcache``: k, v (T, Hkv, D) into the slots (T,) of the caches (an fp8
    cache from fp32 or bf16, rounded as the reference rounds). A slot outside the caches is an
    IndexError (as the reference's), with nothing stored."""
    t, hkv, d = k.shape if k.dim() == 3 else (0, 0, 0)
    lib = _library()
    fp8 = k_cache.dtype in reference.FP8_DTYPES and k.dtype in _DECODE
    if (lib is None or not (k.is_cpu and v.is_cpu and k_cache.is_cpu and v_cache.is_cpu and slot_mapping.is_cpu)
            or not k.dtype == v.dtype or not k_cache.dtype == v_cache.dtype
            or not (fp8 or k.dtype == k_cache.dtype) or v.shape != k.shape
            or not (heads_rows(k) and heads_rows(v)) or k_cache.shape != v_cache.shape
            or k_cache.shape[2:] != (hkv, d) or not (k_cache.is_contiguous() and v_cache.is_contiguous())
            or slot_mapping.dtype != torch.int64 or slot_mapping.shape != (t,) or not slot_mapping.is_contiguous()):
        reference.store_kvcache(k, v, k_cache, v_cache, slot_mapping)
        return
    size = k.element_size()
    graph.hold(k_cache, v_cache)  # a replay writes into them: a recording keeps them alive
    if fp8:
        lib.store_kv_fp8(k.data_ptr(), k.stride(0) * size, v.data_ptr(), v.stride(0) * size, k_cache.data_ptr(),
                         v_cache.data_ptr(), slot_mapping.data_ptr(), t, hkv * d, k_cache.numel() // (hkv * d),
                         int(k.dtype == torch.bfloat16), int(k_cache.dtype == torch.float8_e5m2))
        return
    lib.store_kv(k.data_ptr(), k.stride(0) * size, v.data_ptr(), v.stride(0) * size, k_cache.data_ptr(),
                 v_cache.data_ptr(), slot_mapping.data_ptr(), t, hkv * d * size, k_cache.numel() // (hkv * d))


def _check(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
           seq_lens: torch.Tensor, max_seq_len: int) -> None:
    """Raise a ValueError that says what is wrong (messages are formatted only then: this runs per layer)."""
    if q.dim() != 3 or k_cache.dim() != 4:
        raise ValueError(f"q must be (T, H, D) and the caches (blocks, block_size, Hkv, D), got {tuple(q.shape)} "
                         f"and {tuple(k_cache.shape)}")
    if not q.device == k_cache.device == v_cache.device == block_tables.device == seq_lens.device:
        raise ValueError("q, the caches, block_tables and seq_lens must be on one device")
    if not k_cache.dtype == v_cache.dtype or k_cache.dtype not in (q.dtype, *reference.FP8_DTYPES):
        raise ValueError(f"the caches must have q's dtype or an fp8 one, alike, got {q.dtype}, {k_cache.dtype}, "
                         f"{v_cache.dtype}")
    if k_cache.shape != v_cache.shape or k_cache.shape[3] != q.shape[2]:
        raise ValueError(f"caches {tuple(k_cache.shape)}, {tuple(v_cache.shape)} do not fit q's head_dim {q.shape[2]}")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("the caches must be contiguous")
    if q.shape[1] % k_cache.shape[2]:
        raise ValueError(f"query heads ({q.shape[1]}) must be a multiple of KV heads ({k_cache.shape[2]})")
    if block_tables.dim() != 2 or block_tables.shape[0] != seq_lens.shape[0]:
        raise ValueError(f"block_tables {tuple(block_tables.shape)} and seq_lens {tuple(seq_lens.shape)} must have "
                         f"one row per sequence")
    if max_seq_len > block_tables.shape[1] * k_cache.shape[1]:
        raise ValueError(f"block_tables of width {block_tables.shape[1]} cannot hold {max_seq_len} tokens of "
                         f"{k_cache.shape[1]} per block")


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, seq_lens: torch.Tensor, max_seq_len: int,
                           scale: float, window: int = 0, softcap: float = 0.0,
                           sinks: torch.Tensor | None = None) -> torch.Tensor:
    """As ``kernels.reference.paged_decode_attention``: q (B, H, D), one query per sequence."""
    args = (q, k_cache, v_cache, block_tables, seq_lens, max_seq_len, scale, window, softcap, sinks)
    if not q.is_cpu or q.dtype not in _DECODE or not available() or not _sinks_fit(sinks, q.shape[1]):
        return reference.paged_decode_attention(*args)
    _check(q, k_cache, v_cache, block_tables, seq_lens, max_seq_len)
    if not decodes_in_c(q.shape[2], k_cache.shape[1]):  # shapes the C code does not take
        return reference.paged_decode_attention(*args)
    if q.shape[0] != seq_lens.shape[0]:
        raise ValueError(f"q has {q.shape[0]} rows for {seq_lens.shape[0]} sequences")
    # the C code reads this far, whatever max_seq_len says (a recording reads no values: see graph)
    longest = int(seq_lens.max()) if len(seq_lens) and not graph.recording() else 0
    if longest > block_tables.shape[1] * k_cache.shape[1]:
        raise ValueError(f"a sequence of {longest} tokens does not fit block_tables of width {block_tables.shape[1]} "
                         f"({k_cache.shape[1]} tokens per block)")
    b, h, d = q.shape
    q = q.contiguous()
    block_tables, seq_lens = block_tables.to(torch.int64).contiguous(), seq_lens.to(torch.int64).contiguous()
    out = torch.empty_like(q)
    dims = _Dims(H=h, HKV=k_cache.shape[2], D=d, BS=k_cache.shape[1], W=block_tables.shape[1], window=window,
                 scale=scale, softcap=softcap, kv_fp8=reference.fp8_format(k_cache.dtype),
                 sinks=None if sinks is None else sinks.data_ptr())
    if sinks is not None:
        graph.hold(sinks)  # a recording keeps their pointer
    kernel = getattr(_library(), _DECODE[q.dtype])
    kernel(q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), block_tables.data_ptr(), seq_lens.data_ptr(),
           out.data_ptr(), b, ctypes.byref(dims), torch.get_num_threads())
    return out


def _sinks_fit(sinks: torch.Tensor | None, heads: int) -> bool:
    """Whether the C kernel can read these sinks: none, or (H,) float32 contiguous on the CPU."""
    return sinks is None or (sinks.is_cpu and sinks.dtype == torch.float32 and sinks.shape == (heads,)
                             and sinks.is_contiguous())


def paged_prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            block_tables: torch.Tensor, seq_lens: torch.Tensor, query_start: torch.Tensor,
                            q_index: torch.Tensor, out_index: torch.Tensor, max_seq_len: int,
                            scale: float, window: int = 0, softcap: float = 0.0,
                            sinks: torch.Tensor | None = None) -> torch.Tensor:
    """As ``kernels.reference.paged_prefill_attention``; ``q_index`` / ``out_index`` (the
    reference's padded grid) are not needed here."""
    _check(q, k_cache, v_cache, block_tables, seq_lens, max_seq_len)
    if query_start.shape != (seq_lens.shape[0] + 1,):
        raise ValueError(f"query_start {tuple(query_start.shape)} must have one more row than seq_lens "
                         f"{tuple(seq_lens.shape)}")
    if prefill_as_decode and q.dtype in _DECODE and decodes_in_c(q.shape[2], k_cache.shape[1]) and _sinks_fit(
            sinks, q.shape[1]):
        return _as_decode_rows(q, k_cache, v_cache, block_tables, seq_lens, query_start, max_seq_len, scale, window,
                               softcap, sinks)
    _, bs, hkv, d = k_cache.shape
    keys, values = reference.cache_rows(k_cache), reference.cache_rows(v_cache)  # a block per row (fp8: bytes)
    out = q.new_empty(q.shape)
    starts, lens = query_start.tolist(), seq_lens.tolist()
    for b, s in enumerate(lens):
        first, end = starts[b], starts[b + 1]
        blocks = block_tables[b, :-(-s // bs)]
        k = keys.index_select(0, blocks).view(k_cache.dtype).view(-1, hkv, d)[:s].transpose(0, 1)  # (Hkv, S, D)
        v = values.index_select(0, blocks).view(v_cache.dtype).view(-1, hkv, d)[:s].transpose(0, 1)
        if end - first == s and not window:  # a whole prompt
            mask = None
        else:  # a window, or a chunk after a cached prefix: the context's last tokens, query i at s - q_len + i
            mask = reference.window_mask(s, torch.arange(s - (end - first), s, device=q.device), window)
        # in float32 as decode (and the reference): one rule, so a recomputed request keeps its tokens
        o = reference.attend(q[first:end].transpose(0, 1)[None], k[None], v[None], mask, scale, softcap,
                             causal=mask is None, sinks=sinks)  # (1, H, Q, D)
        out[first:end] = o[0].transpose(0, 1)
    return out


def _as_decode_rows(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                    seq_lens: torch.Tensor, query_start: torch.Tensor, max_seq_len: int, scale: float, window: int,
                    softcap: float, sinks: torch.Tensor | None) -> torch.Tensor:
    """Prefill as decode rows: query i of a sequence of S keys whose last Q are its queries attends as the
    one query of a sequence of S - Q + i + 1 keys, through that sequence's block table. The rows of one
    table sit side by side, so the C kernel reads their blocks once for all of them (as it reads a request's
    speculative rows)."""
    q_lens = query_start[1:] - query_start[:-1]
    seq_of = torch.repeat_interleave(torch.arange(len(q_lens)), q_lens)
    lens = (seq_lens - q_lens)[seq_of] + torch.arange(q.shape[0]) - query_start[:-1][seq_of] + 1
    return paged_decode_attention(q, k_cache, v_cache, block_tables[seq_of], lens, max_seq_len, scale, window, softcap,
                                  sinks)
