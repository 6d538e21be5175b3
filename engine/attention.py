"""Attention over the paged KV cache, and the metadata that describes one step's batch.

The model runner builds one ``AttentionMetadata`` per step (``build_metadata``)
and passes it down ``forward()`` (no globals). A batch mixes prompt chunks and
decodes freely; the flat new tokens are split into the decode rows (one query
per sequence) and the prefill rows (several), so that one long prompt chunk
never pads every decode row to its length.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch
from torch import nn

import kernels


def _to(obj, device: torch.device):
    """The same dataclass with every tensor moved to ``device``."""
    for f in fields(obj):
        v = getattr(obj, f.name)
        if isinstance(v, torch.Tensor):
            setattr(obj, f.name, v.to(device, non_blocking=True))
    return obj


@dataclass
class DecodeMetadata:
    token_rows: torch.Tensor  # (Bd,) rows of the flat batch, longest sequence first
    block_tables: torch.Tensor  # (Bd, max_blocks)
    seq_lens: torch.Tensor  # (Bd,) context length including the new token
    max_seq_len: int


@dataclass
class PrefillMetadata:
    token_rows: torch.Tensor | None  # (Tp,) rows of the flat batch; None = all of them
    block_tables: torch.Tensor  # (Bp, max_blocks)
    seq_lens: torch.Tensor  # (Bp,) context length after this step
    query_start: torch.Tensor  # (Bp+1,) offsets of each sequence's queries among the Tp rows
    q_index: torch.Tensor  # (Bp, Q) row (of the Tp) for each padded grid cell; Tp = padding
    out_index: torch.Tensor  # (Tp,) grid cell of each row
    max_seq_len: int
    max_query_len: int


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # (T,) cache slot of each new token
    decode: DecodeMetadata | None
    prefill: PrefillMetadata | None


def build_metadata(query_lens: list[int], computed_lens: list[int], block_tables: list[list[int]],
                   block_size: int, device: torch.device) -> tuple[torch.Tensor, AttentionMetadata]:
    """Positions (T,) and attention metadata for sequences that add ``query_lens[b]`` tokens
    after ``computed_lens[b]`` cached ones. Built on the CPU with tensor ops, then moved."""
    b = len(query_lens)
    q_lens = torch.tensor(query_lens, dtype=torch.int64)
    query_start = torch.zeros(b + 1, dtype=torch.int64)
    torch.cumsum(q_lens, 0, out=query_start[1:])
    seq_lens = torch.tensor(computed_lens, dtype=torch.int64) + q_lens
    width = max(len(bt) for bt in block_tables)
    tables = torch.tensor([bt + [0] * (width - len(bt)) for bt in block_tables], dtype=torch.int64)
    seq_of = torch.repeat_interleave(torch.arange(b), q_lens)  # (T,) sequence of each flat token
    offset = torch.arange(len(seq_of)) - query_start[:-1][seq_of]  # (T,) index within its sequence
    positions = (seq_lens - q_lens)[seq_of] + offset
    slot_mapping = tables[seq_of, positions // block_size] * block_size + positions % block_size

    is_decode = q_lens == 1
    num_decode = int(is_decode.sum())
    decode = prefill = None
    if num_decode:
        seqs = is_decode.nonzero().squeeze(1)
        seqs = seqs[torch.argsort(seq_lens[seqs], descending=True)]  # similar lengths side by side
        lens = seq_lens[seqs]
        decode = DecodeMetadata(query_start[seqs], tables[seqs], lens, int(lens[0]))
    if num_decode < b:
        seqs = (~is_decode).nonzero().squeeze(1)
        pq = q_lens[seqs]
        start = torch.zeros(len(seqs) + 1, dtype=torch.int64)
        torch.cumsum(pq, 0, out=start[1:])
        tp = int(start[-1])
        qmax = int(pq.max())
        grid = torch.arange(qmax)[None, :]
        p_seq_of = torch.repeat_interleave(torch.arange(len(seqs)), pq)
        lens = seq_lens[seqs]
        prefill = PrefillMetadata(
            token_rows=None if num_decode == 0 else (~is_decode)[seq_of].nonzero().squeeze(1),
            block_tables=tables[seqs], seq_lens=lens, query_start=start,
            q_index=torch.where(grid < pq[:, None], start[:-1, None] + grid, tp),
            out_index=p_seq_of * qmax + (torch.arange(tp) - start[:-1][p_seq_of]),
            max_seq_len=int(lens.max()), max_query_len=qmax,
        )
    meta = AttentionMetadata(slot_mapping.to(device), decode and _to(decode, device),
                             prefill and _to(prefill, device))
    return positions.to(device), meta


class Attention(nn.Module):
    """One layer's attention: store this step's K/V in the cache, attend over the cache."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = head_dim ** -0.5
        # Set by the model runner once the cache is allocated: (num_blocks, block_size, Hkv, D) each.
        self.k_cache = torch.empty(0)
        self.v_cache = torch.empty(0)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        # q: (T, H, D), k/v: (T, Hkv, D)
        kernels.store_kvcache(k, v, self.k_cache, self.v_cache, meta.slot_mapping)
        d, p = meta.decode, meta.prefill
        if d is None:
            return self._prefill(q, p)  # (T, H, D)
        out = torch.empty_like(q)
        out.index_copy_(0, d.token_rows, self._decode(q.index_select(0, d.token_rows), d))
        if p is not None:
            out.index_copy_(0, p.token_rows, self._prefill(q.index_select(0, p.token_rows), p))
        return out  # (T, H, D)

    def _decode(self, q: torch.Tensor, d: DecodeMetadata) -> torch.Tensor:
        return kernels.paged_decode_attention(q, self.k_cache, self.v_cache, d.block_tables, d.seq_lens,
                                              d.max_seq_len, self.scale)

    def _prefill(self, q: torch.Tensor, p: PrefillMetadata) -> torch.Tensor:
        return kernels.paged_prefill_attention(q, self.k_cache, self.v_cache, p.block_tables, p.seq_lens,
                                               p.query_start, p.q_index, p.out_index, p.max_seq_len,
                                               self.scale)
