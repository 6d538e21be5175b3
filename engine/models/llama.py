"""The Llama family (Llama, Mistral, Qwen2, SmolLM) for paged attention.

One concept per class. Inputs are the flattened tokens of the whole batch:
``input_ids`` and ``positions`` are (T,), and ``AttentionMetadata`` says which
sequence each belongs to. q|k|v and gate|up are fused at load time.
"""

from __future__ import annotations

import torch
from torch import nn

import kernels
from engine.attention import Attention, AttentionMetadata
from engine.models.config import ModelConfig
from engine.models.layers import ColumnLinear, RMSNorm, RotaryEmbedding, RowLinear


class LlamaAttention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.h, self.hkv, self.d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.qkv_proj = ColumnLinear(cfg.hidden_size, [self.h * self.d, self.hkv * self.d, self.hkv * self.d],
                                     bias=cfg.attention_bias)
        self.o_proj = RowLinear(self.h * self.d, cfg.hidden_size)
        self.attn = Attention(self.h, self.hkv, self.d)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        t = x.shape[0]
        q, k, v = self.qkv_proj(x).split(self.qkv_proj.out_sizes, dim=-1)
        q, k, v = q.view(t, self.h, self.d), k.view(t, self.hkv, self.d), v.view(t, self.hkv, self.d)
        kernels.apply_rope_(q, k, cos, sin)  # in place, in the qkv projection's output
        o = self.attn(q, k, v, meta)  # (T, H, D)
        return self.o_proj(o.reshape(t, self.h * self.d))


class LlamaMLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_up_proj = ColumnLinear(cfg.hidden_size, [cfg.intermediate_size] * 2)
        self.down_proj = RowLinear(cfg.intermediate_size, cfg.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(kernels.silu_and_mul(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = LlamaAttention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = LlamaMLP(cfg)

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
    def __init__(self, cfg: ModelConfig, max_positions: int):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Parameter(torch.empty(cfg.vocab_size, cfg.hidden_size), requires_grad=False)
        self.rotary = RotaryEmbedding(cfg.head_dim, max_positions, cfg.rope_theta, cfg.rope_scaling)
        self.layers = nn.ModuleList(LlamaDecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = (self.embed_tokens if cfg.tie_word_embeddings else
                        nn.Parameter(torch.empty(cfg.vocab_size, cfg.hidden_size), requires_grad=False))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """(T,) token ids at (T,) positions -> (T, hidden) final hidden states."""
        x = self.embed_tokens[input_ids]  # (T, hidden)
        cos, sin = self.rotary(positions, x.dtype)  # (T, D/2) each
        residual = None
        for layer in self.layers:
            x, residual = layer(x, residual, cos, sin, meta)
        x, _ = self.norm(x, residual)
        return x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """(N, hidden) -> (N, vocab) float32 logits, only for the rows that need them."""
        return nn.functional.linear(hidden, self.lm_head).float()
