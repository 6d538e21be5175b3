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


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    block_tables: torch.Tensor, seq_lens: torch.Tensor, query_start: torch.Tensor,
                    q_index: torch.Tensor, out_index: torch.Tensor, max_seq_len: int,
                    scale: float) -> torch.Tensor:
    """Causal attention of flattened queries over each sequence's paged context.

    q: (T, H, D) new tokens of B sequences, flattened. The sequence ``b`` owns
    queries ``query_start[b]:query_start[b+1]`` and has ``seq_lens[b]`` tokens of
    context in total (cached ones plus these), the new ones last.
    ``q_index`` (B, Q) gathers each sequence's queries into a padded (B, Q) grid
    (pad entries point at row T, a zero row); ``out_index`` (T,) picks each real
    query back out of the flattened grid. Returns (T, H, D).
    """
    t, h, d = q.shape
    num_blocks, block_size, hkv, _ = k_cache.shape
    b, qmax = q_index.shape
    # Padded queries: (B, Q, H, D)
    qp = torch.cat([q, q.new_zeros(1, h, d)])[q_index]
    # Each sequence's context from its blocks: (B, S, Hkv, D), S = blocks * block_size
    nblk = -(-max_seq_len // block_size)
    bt = block_tables[:, :nblk]
    k = k_cache[bt].view(b, nblk * block_size, hkv, d)[:, :max_seq_len]
    v = v_cache[bt].view(b, nblk * block_size, hkv, d)[:, :max_seq_len]
    # Query i of sequence b sits at position seq_len - q_len + i and sees keys 0..that position.
    q_lens = query_start[1:] - query_start[:-1]
    q_pos = (seq_lens - q_lens)[:, None] + torch.arange(qmax, device=q.device)[None, :]  # (B, Q)
    k_pos = torch.arange(max_seq_len, device=q.device)
    mask = k_pos[None, None, :] <= q_pos[:, :, None]  # (B, Q, S)
    out = F.scaled_dot_product_attention(
        qp.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
        attn_mask=mask[:, None], scale=scale, enable_gqa=hkv != h,
    )  # (B, H, Q, D)
    return out.transpose(1, 2).reshape(b * qmax, h, d)[out_index]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    dtype = x.dtype
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(dtype)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """(T, 2I) gate|up fused -> (T, I)."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE (Hugging Face layout). x: (T, H, D); cos/sin: (T, D/2)."""
    x1, x2 = x.chunk(2, dim=-1)
    c, s = cos[:, None, :], sin[:, None, :]
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1).to(x.dtype)
