"""The Llama family (Llama, Mistral, Qwen2, Qwen3, SmolLM, Phi-3) for paged attention, and its mixtures
of experts (Mixtral, Qwen2-MoE, Qwen3-MoE: ``engine/models/moe.py``).

One concept per class. Inputs are the flattened tokens of the whole batch:
``input_ids`` and ``positions`` are (T,), and ``AttentionMetadata`` says which
sequence each belongs to. q|k|v and gate|up are fused at load time.

Under tensor parallelism (``tp``, see ``engine.parallel``) every module holds its rank's
share: ``h``/``hkv`` are this rank's query/KV heads, the MLP's width (each expert's) is a 1/T slice.
"""

from __future__ import annotations

import torch
from torch import nn

import kernels
from engine.attention import Attention, AttentionMetadata
from engine.models.config import ModelConfig
from engine.models.layers import (
    ColumnLinear,
    GatedMLP,
    LMHead,
    RMSNorm,
    RotaryEmbedding,
    RowLinear,
    VocabEmbedding,
)
from engine.models.moe import SparseMoE
from engine.parallel import TPGroup, kv_replicas


class LlamaAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TPGroup):
        super().__init__()
        h, hkv, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        r = kv_replicas(hkv, tp.size)  # ranks sharing each KV head (fewer KV heads than ranks)
        self.qkv_proj = ColumnLinear(cfg.hidden_size, [h * d, hkv * d, hkv * d], bias=cfg.attention_bias, tp=tp,
                                     replicas=[1, r, r])
        self.o_proj = RowLinear(h * d, cfg.hidden_size, tp=tp)
        self.h, self.hkv, self.d = h // tp.size, hkv * r // tp.size, d  # this rank's heads
        self.rot = cfg.rotary_dim or d  # RoPE's share of each head (Phi-4-mini: 96 of 128)
        self.attn = Attention(self.h, self.hkv, self.d)
        # Qwen3: q and k normed per head before RoPE, by (D,) weights every head and so every rank shares
        self.q_norm = RMSNorm(d, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(d, cfg.rms_norm_eps) if cfg.qk_norm else None

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        t = x.shape[0]
        q, k, v = self.qkv_proj(x).split(self.qkv_proj.out_sizes, dim=-1)
        q, k, v = q.view(t, self.h, self.d), k.view(t, self.hkv, self.d), v.view(t, self.hkv, self.d)
        if self.q_norm is not None:  # each head's D values normed as rows: (T * H, D)
            q = self.q_norm(q.reshape(t * self.h, self.d)).view(t, self.h, self.d)
            k = self.k_norm(k.reshape(t * self.hkv, self.d)).view(t, self.hkv, self.d)
        if self.rot == self.d:
            kernels.apply_rope_(q, k, cos, sin)  # in place, in the qkv projection's output
        else:  # the first rot dims of each head turned, the others left as they are
            kernels.apply_rope_(q[..., :self.rot], k[..., :self.rot], cos, sin)
        o = self.attn(q, k, v, meta)  # (T, H, D)
        return self.o_proj(o.reshape(t, self.h * self.d))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TPGroup, index: int):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = LlamaAttention(cfg, tp)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = SparseMoE(cfg, tp) if cfg.sparse(index) else GatedMLP(cfg.hidden_size, cfg.intermediate_size, tp)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor,
                meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            x, residual = self.input_layernorm(x), x
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(x, cos, sin, meta)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class LlamaForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig, max_positions: int, tp: TPGroup | None = None):
        super().__init__()
        tp = tp if tp is not None else TPGroup()
        self.cfg = cfg
        self.embed_tokens = VocabEmbedding(cfg.vocab_size, cfg.hidden_size, tp)
        self.rotary = RotaryEmbedding(cfg.rotary_dim or cfg.head_dim, max_positions, cfg.rope_theta, cfg.rope_scaling)
        self.layers = nn.ModuleList(LlamaDecoderLayer(cfg, tp, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = LMHead(cfg.vocab_size, cfg.hidden_size, tp,
                              tied=self.embed_tokens if cfg.tie_word_embeddings else None) if cfg.lm_head else None

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """(T,) token ids at (T,) positions -> (T, hidden) final hidden states."""
        x = self.embed_tokens(input_ids)  # (T, hidden)
        cos, sin = self.rotary(positions, x.dtype)  # (T, D/2) each
        residual = None
        for layer in self.layers:
            x, residual = layer(x, residual, cos, sin, meta)
        x, _ = self.norm(x, residual)
        return x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """(N, hidden) -> (N, vocab) float32 logits, only for the rows that need them; under tensor
        parallelism on rank 0 only (None on the others), and collective: every rank calls it."""
        if self.lm_head is None:
            raise RuntimeError("this checkpoint has no lm_head: it can embed, not generate")
        return self.lm_head(hidden)
