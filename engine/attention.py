"""Attention over the paged KV cache, and the metadata that describes one step's batch.

The model runner builds one ``AttentionMetadata`` per step and passes it down
``forward()`` (no globals). A batch mixes prompt chunks and decodes freely:
queries are the flattened new tokens of every scheduled sequence.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

import kernels


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # (T,) cache slot of each new token
    block_tables: torch.Tensor  # (B, max_blocks) block ids, padded with 0
    seq_lens: torch.Tensor  # (B,) context length after this step
    query_start: torch.Tensor  # (B+1,) offsets of each sequence's queries in the flat batch
    q_index: torch.Tensor  # (B, Q) flat query row for each padded grid cell (T = padding)
    out_index: torch.Tensor  # (T,) grid cell of each flat query
    max_seq_len: int
    max_query_len: int


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
        return kernels.paged_attention(
            q, self.k_cache, self.v_cache, meta.block_tables, meta.seq_lens, meta.query_start,
            meta.q_index, meta.out_index, meta.max_seq_len, self.scale,
        )  # (T, H, D)
