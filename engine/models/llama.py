"""The Llama family (Llama, Mistral, Qwen2, Qwen3, SmolLM, Phi-3, Gemma, Granite, OLMo) for paged attention,
and its mixtures of experts (Mixtral, Qwen2-MoE, Qwen3-MoE, GPT-OSS: ``engine/models/moe.py``; GPT-OSS's
attention sinks and o_proj bias are flags of the config too). Gemma's,
Granite's and OLMo's differences are flags of the config (Gemma's norms, GELU, embedding scale, score
caps, RoPE base for the sliding layers; Granite's scales; OLMo's q/k norms across heads) and, in Gemma 2
and 3 and in OLMo, a layer of their own (``GemmaDecoderLayer``, ``OlmoDecoderLayer``).

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
from engine.models.vision import LlavaVision
from engine.parallel import TPGroup, kv_replicas


def pre_norm(norm: RMSNorm, x: torch.Tensor, residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """A layer's input: (norm(x + residual), x + residual); the first layer's has no residual yet."""
    return (norm(x), x) if residual is None else norm(x, residual)


class LlamaAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TPGroup, index: int):
        super().__init__()
        h, hkv, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        r = kv_replicas(hkv, tp.size)  # ranks sharing each KV head (fewer KV heads than ranks)
        self.qkv_proj = ColumnLinear(cfg.hidden_size, [h * d, hkv * d, hkv * d], bias=cfg.attention_bias, tp=tp,
                                     replicas=[1, r, r])
        self.o_proj = RowLinear(h * d, cfg.hidden_size, bias=cfg.gpt_oss, tp=tp)
        self.h, self.hkv, self.d = h // tp.size, hkv * r // tp.size, d  # this rank's heads
        self.rank, self.rank_count = tp.rank, tp.size
        self.rot = cfg.rotary_dim or d  # RoPE's share of each head (Phi-4-mini: 96 of 128)
        self.attn = Attention(self.h, self.hkv, self.d, cfg.attn_scale, cfg.window(index), cfg.attn_softcap,
                              sinks=cfg.gpt_oss)
        # Qwen3, Gemma 3: q and k normed per head before RoPE, by (D,) weights every head and so every rank shares;
        # OLMo: across all heads at once, each rank holding its heads' share of the weights (``_across``)
        self.across = cfg.olmo
        if cfg.olmo:
            p = self.qkv_proj
            self.q_norm, self.k_norm = (RMSNorm(p.out_sizes[i], cfg.rms_norm_eps, float32=True, start=p.starts[i])
                                        for i in (0, 1))
            self.tp, self.full, self.replicas = tp, (h * d, hkv * d), r
        else:
            self.q_norm = RMSNorm(d, cfg.rms_norm_eps, cfg.gemma > 0) if cfg.qk_norm else None
            self.k_norm = RMSNorm(d, cfg.rms_norm_eps, cfg.gemma > 0) if cfg.qk_norm else None

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        t = x.shape[0]
        q, k, v = self.qkv_proj(x).split(self.qkv_proj.out_sizes, dim=-1)
        if self.across:
            q, k = self._across(q, self.q_norm, 0, 1), self._across(k, self.k_norm, 1, self.replicas)
        q, k, v = q.view(t, self.h, self.d), k.view(t, self.hkv, self.d), v.view(t, self.hkv, self.d)
        # each head's D values normed (Qwen3, Gemma 3), then RoPE (the first rot dims of each head turned), in
        # place, in the qkv projection's output, as k is stored
        norms = (self.q_norm.weight, self.k_norm.weight, self.q_norm.eps) \
            if self.q_norm is not None and not self.across else None
        o = self.attn(q, k, v, meta, (cos, sin, self.rot), norms)  # (T, H, D)
        return self.o_proj(o.reshape(t, self.h * self.d))

    def load_sinks(self, w: torch.Tensor) -> None:
        """GPT-OSS's attention sinks, one per query head: this rank's heads'."""
        if w.shape != (self.h * self.rank_count,):
            raise ValueError(f"self_attn.sinks must hold one value per query head ({self.h * self.rank_count}), "
                             f"got shape {tuple(w.shape)}")
        self.attn.sinks.copy_(w[self.rank * self.h:(self.rank + 1) * self.h])

    def _across(self, x: torch.Tensor, norm: RMSNorm, part: int, replicas: int) -> torch.Tensor:
        """OLMo's norm of every head's values at once; under tensor parallelism the ranks' sums of squares
        are added (a KV head kept by several ranks counted once), then each rank scales its own share."""
        if self.tp.size == 1:
            return norm(x.contiguous())
        xf = x.float()
        squares = self.tp.all_reduce(xf.square().sum(-1, keepdim=True)) / replicas
        return (xf * torch.rsqrt(squares / self.full[part] + norm.eps) * norm.weight).to(x.dtype)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TPGroup, index: int):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.gemma > 0, cfg.gpt_oss)
        self.self_attn = LlamaAttention(cfg, tp, index)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.gemma > 0, cfg.gpt_oss)
        self.mlp = SparseMoE(cfg, tp) if cfg.sparse(index) else GatedMLP(cfg.hidden_size, cfg.intermediate_size, tp,
                                                                          cfg.hidden_act)
        self.residual_multiplier = cfg.residual_multiplier

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor,
                meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        x, residual = pre_norm(self.input_layernorm, x, residual)
        x = self.scaled(self.self_attn(x, cos, sin, meta))
        x, residual = self.post_attention_layernorm(x, residual)
        return self.scaled(self.mlp(x)), residual

    def scaled(self, x: torch.Tensor) -> torch.Tensor:
        """A sublayer's output as it joins the residual stream (Granite scales it, in the model's dtype)."""
        return x if self.residual_multiplier == 1.0 else x * self.residual_multiplier


class GemmaDecoderLayer(nn.Module):
    """Gemma 2 and 3's: each sublayer's output is normed too before it joins the residual stream (four
    RMSNorms a layer, each Gemma's x (1 + w))."""

    def __init__(self, cfg: ModelConfig, tp: TPGroup, index: int):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, gemma=True)
        self.self_attn = LlamaAttention(cfg, tp, index)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, gemma=True)
        self.pre_feedforward_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, gemma=True)
        self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size, tp, cfg.hidden_act)
        self.post_feedforward_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, gemma=True)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor,
                meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """As ``LlamaDecoderLayer``'s: x is the last sublayer's output, not yet added to ``residual``."""
        x, residual = pre_norm(self.input_layernorm, x, residual)
        x = self.post_attention_layernorm(self.self_attn(x, cos, sin, meta))
        x, residual = self.pre_feedforward_layernorm(x, residual)
        return self.post_feedforward_layernorm(self.mlp(x)), residual


class OlmoDecoderLayer(nn.Module):
    """OLMo 2 and 3's: no norm before a sublayer, one after each, on its output before it joins the
    residual stream (float32 weights, multiplied before the one rounding, as transformers computes them)."""

    def __init__(self, cfg: ModelConfig, tp: TPGroup, index: int):
        super().__init__()
        self.self_attn = LlamaAttention(cfg, tp, index)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, float32=True)
        self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size, tp, cfg.hidden_act)
        self.post_feedforward_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, float32=True)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor,
                meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """As ``LlamaDecoderLayer``'s: x is the last sublayer's output, not yet added to ``residual``."""
        stream = x if residual is None else residual + x
        stream = stream + self.post_attention_layernorm(self.self_attn(stream, cos, sin, meta))
        return self.post_feedforward_layernorm(self.mlp(stream)), stream


class LlamaForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig, max_positions: int, tp: TPGroup | None = None):
        super().__init__()
        tp = tp if tp is not None else TPGroup()
        self.cfg = cfg
        self.embed_tokens = VocabEmbedding(cfg.vocab_size, cfg.hidden_size, tp)
        # Gemma scales its embeddings by sqrt(hidden), rounded to the model's dtype as transformers rounds it
        self.register_buffer("embed_scale", torch.tensor(cfg.hidden_size ** 0.5 if cfg.gemma else 1.0,
                                                         dtype=torch.float32), persistent=False)
        self.rotary = RotaryEmbedding(cfg.rotary_dim or cfg.head_dim, max_positions, cfg.rope_theta, cfg.rope_scaling)
        # Gemma 3's sliding layers turn by their own base, unscaled
        self.local_rotary = None if cfg.local_rope_theta is None else RotaryEmbedding(
            cfg.rotary_dim or cfg.head_dim, max_positions, cfg.local_rope_theta, None)
        layer = GemmaDecoderLayer if cfg.gemma >= 2 else OlmoDecoderLayer if cfg.olmo else LlamaDecoderLayer
        self.layers = nn.ModuleList(layer(cfg, tp, i) for i in range(cfg.num_layers))
        self.local = [self.local_rotary is not None and cfg.sliding(i) for i in range(cfg.num_layers)]
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.gemma > 0, cfg.olmo or cfg.gpt_oss)
        self.lm_head = LMHead(cfg.vocab_size, cfg.hidden_size, tp,
                              tied=self.embed_tokens if cfg.tie_word_embeddings else None) if cfg.lm_head else None
        # a sequence classifier's head (every rank holds it whole: it is small, and rank 0 runs it)
        self.score = nn.Linear(cfg.hidden_size, len(cfg.labels), bias=False) if cfg.labels else None
        # LLaVA's vision tower and projector (one rank only: under tensor parallelism it serves text)
        self.vision = LlavaVision(cfg.vision, cfg.hidden_size) if cfg.vision is not None and tp.size == 1 else None

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                embeds: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """(T,) token ids at (T,) positions -> (T, hidden) final hidden states. ``embeds``: (E,) rows whose
        input is (E, hidden) given embeddings instead of their token's (an image's, ``LlavaVision``)."""
        x = self.embed_tokens(input_ids)  # (T, hidden)
        if self.cfg.gemma:
            x = x * self.embed_scale.to(x.dtype)
        elif self.cfg.embedding_multiplier != 1.0:  # Granite's, a Python float as transformers multiplies
            x = x * self.cfg.embedding_multiplier
        if embeds is not None:
            x[embeds[0]] = embeds[1].to(x.dtype)
        rope = self.rotary(positions, x.dtype)  # cos, sin: (T, D/2) each
        local = rope if self.local_rotary is None else self.local_rotary(positions, x.dtype)
        residual = None
        for layer, is_local in zip(self.layers, self.local, strict=True):
            x, residual = layer(x, residual, *(local if is_local else rope), meta)
        x, _ = self.norm(x, residual)
        return x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """(N, hidden) -> (N, vocab) logits in the model's dtype (``LMHead``'s; Granite's scaling and Gemma 2's
        cap computed in it too, as transformers does), only for the rows that need them; under tensor
        parallelism on rank 0 only (None on the others), and collective: every rank calls it."""
        if self.lm_head is None:
            raise RuntimeError("this checkpoint has no lm_head: it can embed, not generate")
        logits = self.lm_head(hidden)
        if logits is None:
            return None
        if self.cfg.logits_scaling != 1.0:  # Granite's
            logits = logits / self.cfg.logits_scaling
        cap = self.cfg.final_softcap  # Gemma 2's cap on the logits
        return logits if not cap else kernels.by_rows(lambda rows: torch.tanh(rows / cap).mul_(cap), logits)
