"""Attention over the paged KV cache, and the metadata that describes one step's batch.

The model runner builds one ``AttentionMetadata`` per step and passes it down
``forward()`` (no globals): ``StepIndex`` computes its index tensors on the host
from the sequence lengths, then looks the block ids up on the device, in the
runner's persistent block tables (``build_metadata`` does both from lists).
A batch mixes prompt chunks and decodes freely. Where the prefill kernel takes
one-token sequences as cheaply as the decode kernel (Triton's), a step with prompt
tokens is all prefill rows: one launch a layer. Elsewhere the flat new tokens are
split into the decode rows (one query per sequence) and the prefill rows (several),
so that one long prompt chunk never pads every decode row to its length.
"""

from __future__ import annotations

import array
import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import nn

import kernels
from kernels import reference


def ints(values) -> torch.Tensor:
    """An int64 tensor of ``values`` (ints), through an ``array``: a third of ``torch.tensor``'s time."""
    packed = array.array("q", values)
    return torch.frombuffer(packed, dtype=torch.int64) if packed else torch.empty(0, dtype=torch.int64)


@dataclass
class DecodeMetadata:
    token_rows: torch.Tensor  # (Bd,) rows of the flat batch, longest sequence first
    block_tables: torch.Tensor  # (Bd, max_blocks)
    seq_lens: torch.Tensor  # (Bd,) context length including the new token
    max_seq_len: int
    in_order: bool = False  # token_rows is 0, 1, ... Bd - 1 and no prefill rows follow: q needs no reordering


@dataclass
class PrefillMetadata:
    token_rows: torch.Tensor | None  # (Tp,) rows of the flat batch; None = all of them
    block_tables: torch.Tensor  # (Bp, max_blocks)
    seq_lens: torch.Tensor  # (Bp,) context length after this step
    query_start: torch.Tensor  # (Bp+1,) offsets of each sequence's queries among the Tp rows
    # the reference's gather indices (kernels.reference.prefill_gather); None: it makes them (a step built unsplit)
    q_index: torch.Tensor | None  # (Bp, Q) row (of the Tp) for each padded grid cell; Tp = padding
    out_index: torch.Tensor | None  # (Tp,) grid cell of each row
    max_seq_len: int


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # (T,) cache slot of each new token
    decode: DecodeMetadata | None
    prefill: PrefillMetadata | None
    # each block's window block (engine.window_blocks), for layers whose cache is the sliding-window pool
    window_map: torch.Tensor | None = None
    _windowed: AttentionMetadata | None = field(default=None, repr=False)

    def windowed(self, block_size: int) -> AttentionMetadata:
        """The same step in the sliding-window pool's blocks (looked up once a step, by its first layer)."""
        if self._windowed is None:
            m, slot, d, p = self.window_map, self.slot_mapping, self.decode, self.prefill
            self._windowed = AttentionMetadata(
                m[slot // block_size] * block_size + slot % block_size,
                dataclasses.replace(d, block_tables=m[d.block_tables]) if d is not None else None,
                dataclasses.replace(p, block_tables=m[p.block_tables]) if p is not None else None)
        return self._windowed


def decode_order(seq_lens: Sequence[int], table_rows: Sequence[int]) -> list[int]:
    """The order of a step's decode rows: longest first, so that similar lengths sit side by side (the
    reference's groups pad less); but the rows of one block table (a request's decode row and its
    speculative drafts) together, longest first, where the longest of them sorts the group, so that the
    CPU kernel walks their blocks once. Ties keep the step's order."""
    if len(set(table_rows)) == len(table_rows):  # no drafts: a row per table (the usual step, kept lean)
        return sorted(range(len(seq_lens)), key=seq_lens.__getitem__, reverse=True)  # (stable, as argsort's)
    longest, first = {}, {}
    for i, (n, row) in enumerate(zip(seq_lens, table_rows, strict=True)):
        longest[row] = max(longest.get(row, 0), n)
        first.setdefault(row, i)
    return sorted(range(len(seq_lens)), key=lambda i: (-longest[table_rows[i]], first[table_rows[i]], -seq_lens[i]))


def prefill_index(query_lens: list[int], computed_lens: list[int], table_rows: Sequence[int]) -> tuple[
        np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Sequences that add ``query_lens[b]`` tokens after ``computed_lens[b]`` cached ones, as one prefill: each
    token's position and row of the tables, each sequence's length, and its first token's index (B + 1); int64
    arrays, made in a few operations a step, not a few a sequence (a step of hundreds of decodes beside its
    prompts is most of a busy server's)."""
    q, cached, rows = (np.array(v, dtype=np.int64) for v in (query_lens, computed_lens, table_rows))
    start = np.zeros(len(q) + 1, dtype=np.int64)
    np.cumsum(q, out=start[1:])
    positions = np.arange(start[-1]) + np.repeat(cached - start[:-1], q)
    return positions, np.repeat(rows, q), cached + q, start


@dataclass
class StepIndex:
    """One step's metadata before its block ids: index tensors that the host computes from the
    sequence lengths and each sequence's row of the block tables (a few per sequence or token,
    none per block), so that they reach the device in one copy with the step's other inputs
    (``tensors`` is then replaced by their device twins); ``metadata`` looks the block ids up there."""

    tensors: dict[str, torch.Tensor]
    max_decode_len: int  # 0: no decode rows
    max_prefill_len: int  # 0: no prefill rows
    mixed: bool  # decode and prefill rows both: each part says which rows of the flat batch are its
    decode_in_order: bool  # decode rows only, already longest first (one sequence, say)

    @classmethod
    def build(cls, query_lens: list[int], computed_lens: list[int], table_rows: Sequence[int],
              split: bool = True) -> StepIndex:
        """Sequence b adds ``query_lens[b]`` tokens after ``computed_lens[b]`` cached ones; its block
        table is row ``table_rows[b]`` of the tables ``metadata`` will be given. ``split=False``: in a step
        with prompt tokens, the one-token sequences are prefill rows too, so that one prefill kernel takes
        the whole step (``kernels.prefill_takes_decodes``); a step of decodes alone stays a decode step. (A
        step that replays a decode graph needs none of this: the graph makes its metadata, ``DecodeGraphs``.)"""
        b = len(query_lens)
        if b and query_lens.count(1) == b:
            return cls._decode_only(computed_lens, table_rows)
        if b and not split:
            return cls._unsplit(query_lens, computed_lens, table_rows)
        q_lens = torch.tensor(query_lens, dtype=torch.int64)
        query_start = torch.zeros(b + 1, dtype=torch.int64)
        torch.cumsum(q_lens, 0, out=query_start[1:])
        seq_lens = torch.tensor(computed_lens, dtype=torch.int64) + q_lens
        rows = torch.tensor(table_rows, dtype=torch.int64)
        seq_of = torch.repeat_interleave(torch.arange(b), q_lens)  # (T,) sequence of each flat token
        offset = torch.arange(len(seq_of)) - query_start[:-1][seq_of]  # (T,) index within its sequence
        t = {"positions": (seq_lens - q_lens)[seq_of] + offset, "token_table_rows": rows[seq_of]}

        is_decode = q_lens == 1
        num_decode = int(is_decode.sum())
        max_decode = max_prefill = 0
        in_order = False
        if num_decode:
            seqs = is_decode.nonzero().squeeze(1)
            seqs = seqs[decode_order(seq_lens[seqs].tolist(), rows[seqs].tolist())]
            in_order = num_decode == b and bool((seqs == torch.arange(b)).all())
            t["decode_token_rows"], t["decode_table_rows"] = query_start[seqs], rows[seqs]
            t["decode_seq_lens"] = seq_lens[seqs]
            max_decode = int(seq_lens[seqs[0]])
        if num_decode < b:
            seqs = (~is_decode).nonzero().squeeze(1)
            pq = q_lens[seqs]
            start = torch.zeros(len(seqs) + 1, dtype=torch.int64)
            torch.cumsum(pq, 0, out=start[1:])
            if num_decode:
                t["prefill_token_rows"] = (~is_decode)[seq_of].nonzero().squeeze(1)
            t["prefill_table_rows"], t["prefill_seq_lens"], t["prefill_query_start"] = rows[seqs], seq_lens[seqs], start
            t["prefill_q_index"], t["prefill_out_index"] = reference.prefill_gather(start)
            max_prefill = int(seq_lens[seqs].max())
        return cls(t, max_decode, max_prefill, 0 < num_decode < b, in_order)

    @classmethod
    def _unsplit(cls, query_lens: list[int], computed_lens: list[int], table_rows: Sequence[int]) -> StepIndex:
        """``build(split=False)`` for a step with prompt tokens: every sequence a prefill one, in the step's
        order, made from lists; without the reference's gather indices (Triton's kernel, which takes such
        steps, reads none; the reference makes them where it is given none)."""
        positions, token_rows, seq_lens, start = prefill_index(query_lens, computed_lens, table_rows)
        t = {"positions": torch.from_numpy(positions), "token_table_rows": torch.from_numpy(token_rows),
             "prefill_table_rows": ints(table_rows), "prefill_seq_lens": torch.from_numpy(seq_lens),
             "prefill_query_start": torch.from_numpy(start)}
        return cls(t, 0, int(seq_lens.max()), False, False)

    @classmethod
    def _decode_only(cls, computed_lens: list[int], table_rows: Sequence[int]) -> StepIndex:
        """``build`` for a step of one new token per sequence (most steps): the same tensors, made from
        lists (a few operators, not the general case's ~25: ~0.3 ms a step on a CPU)."""
        seq_lens = [c + 1 for c in computed_lens]
        seqs = decode_order(seq_lens, table_rows)
        in_order = seqs == list(range(len(seqs)))
        if in_order:  # the step's own lists
            seqs, rows, lens = range(len(seq_lens)), table_rows, seq_lens
        else:
            rows, lens = [table_rows[i] for i in seqs], [seq_lens[i] for i in seqs]
        t = {"positions": ints(computed_lens), "token_table_rows": ints(table_rows), "decode_token_rows": ints(seqs),
             "decode_table_rows": ints(rows), "decode_seq_lens": ints(lens)}
        return cls(t, max(seq_lens), 0, False, in_order)

    def metadata(self, tables: torch.Tensor, block_size: int,
                 window_map: torch.Tensor | None = None) -> tuple[torch.Tensor, AttentionMetadata]:
        """Positions (T,) and the attention metadata, on the device of ``tables`` (num_rows, max_blocks)
        and of ``tensors``: only the rows and columns the step reads are gathered. ``window_map``: each
        block's window block, where sliding-window layers have a pool of their own."""
        t = self.tensors
        pos = t["positions"]
        slot_mapping = tables[t["token_table_rows"], pos // block_size] * block_size + pos % block_size
        decode = prefill = None
        if self.max_decode_len:
            width = -(-self.max_decode_len // block_size)
            decode = DecodeMetadata(t["decode_token_rows"], tables[t["decode_table_rows"], :width],
                                    t["decode_seq_lens"], self.max_decode_len, self.decode_in_order)
        if self.max_prefill_len:
            width = -(-self.max_prefill_len // block_size)
            prefill = PrefillMetadata(
                token_rows=t["prefill_token_rows"] if self.mixed else None,
                block_tables=tables[t["prefill_table_rows"], :width], seq_lens=t["prefill_seq_lens"],
                query_start=t["prefill_query_start"], q_index=t.get("prefill_q_index"),
                out_index=t.get("prefill_out_index"), max_seq_len=self.max_prefill_len,
            )
        return pos, AttentionMetadata(slot_mapping, decode, prefill, window_map)


def build_metadata(query_lens: list[int], computed_lens: list[int], block_tables: list[list[int]],
                   block_size: int, device: torch.device, split: bool = True) -> tuple[torch.Tensor, AttentionMetadata]:
    """Positions (T,) and attention metadata for sequences that add ``query_lens[b]`` tokens after
    ``computed_lens[b]`` cached ones, their block tables given as lists (padded here: for tests and
    the profiling run; the model runner keeps its tables in one persistent tensor instead); ``split``:
    ``StepIndex.build``'s."""
    width = max(len(bt) for bt in block_tables)
    tables = torch.tensor([bt + [0] * (width - len(bt)) for bt in block_tables], dtype=torch.int64)
    index = StepIndex.build(query_lens, computed_lens, range(len(block_tables)), split)
    index.tensors = {k: v.to(device) for k, v in index.tensors.items()}
    return index.metadata(tables.to(device), block_size)


class Attention(nn.Module):
    """One layer's attention: store this step's K/V in the cache, attend over the cache. ``scale``
    multiplies q.k (None: 1 / sqrt(head_dim)); ``window``: a sliding window's length, each query seeing
    its latest ``window`` positions (0: all); ``softcap``: Gemma 2's cap on the scores (0: none); ``sinks``:
    a learnt score per head that every softmax also counts, for a key without a value (GPT-OSS's). A
    windowed layer whose cache is the sliding-window pool (``in_window_pool``, set with the cache) finds
    its blocks through the step's ``window_map``."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float | None = None,
                 window: int = 0, softcap: float = 0.0, sinks: bool = False):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = head_dim ** -0.5 if scale is None else scale
        self.window, self.softcap = window, softcap
        # (float32 whatever the model's dtype: the kernels add them to float32 sums)
        self.sinks = nn.Parameter(torch.zeros(num_heads, dtype=torch.float32), requires_grad=False) if sinks else None
        # Set by the model runner once the cache is allocated: (num_blocks, block_size, Hkv, D) each.
        self.k_cache = torch.empty(0)
        self.v_cache = torch.empty(0)
        self.in_window_pool = False

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata,
                rope: tuple[torch.Tensor, torch.Tensor, int] | None = None,
                norms: tuple[torch.Tensor, torch.Tensor, float] | None = None) -> torch.Tensor:
        """q: (T, H, D), k/v: (T, Hkv, D) -> (T, H, D). ``rope``: (cos, sin, rot), RoPE still to turn the first
        rot dims of each head of q and k by, in place, as k goes into the cache; ``norms``: (q's weight, k's, eps),
        an RMSNorm of each head of q and k before it, with ``rope`` only (``kernels.rope_and_store_``)."""
        if self.in_window_pool:
            meta = meta.windowed(self.k_cache.shape[1])
        if rope is None:
            kernels.store_kvcache(k, v, self.k_cache, self.v_cache, meta.slot_mapping)
        else:
            kernels.rope_and_store_(q, k, v, *rope[:2], self.k_cache, self.v_cache, meta.slot_mapping, rope[2], norms)
        d, p = meta.decode, meta.prefill
        if d is None:
            return self._prefill(q, p)  # (T, H, D)
        if d.in_order:
            return self._decode(q, d)
        out = torch.empty_like(q)
        out.index_copy_(0, d.token_rows, self._decode(q.index_select(0, d.token_rows), d))
        if p is not None:
            out.index_copy_(0, p.token_rows, self._prefill(q.index_select(0, p.token_rows), p))
        return out  # (T, H, D)

    def _decode(self, q: torch.Tensor, d: DecodeMetadata) -> torch.Tensor:
        return kernels.paged_decode_attention(q, self.k_cache, self.v_cache, d.block_tables, d.seq_lens,
                                              d.max_seq_len, self.scale, self.window, self.softcap, self.sinks)

    def _prefill(self, q: torch.Tensor, p: PrefillMetadata) -> torch.Tensor:
        return kernels.paged_prefill_attention(q, self.k_cache, self.v_cache, p.block_tables, p.seq_lens,
                                               p.query_start, p.q_index, p.out_index, p.max_seq_len,
                                               self.scale, self.window, self.softcap, self.sinks)
