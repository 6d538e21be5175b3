"""ModernBERT (gte-modernbert, modernbert-embed, granite-embedding-r2, their rerankers): an encoder as
``engine/models/bert.py`` serves them (whole prompts, no KV cache, the step's prompts attended in groups of
similar length), with a newer body: pre-norm layers (the first without its attention norm), RoPE, a gated
GELU MLP, no biases, and two kinds of layer: full ones, and sliding ones whose keys are those within a window
of the query, each kind turning RoPE by its own base. A classifier pools the first token's state (or the
mean) through its head (dense, activation, norm) into its classifier.
"""

from __future__ import annotations

import re

import torch
from torch import nn

import kernels
from engine.attention import AttentionMetadata
from engine.models.bert import Encoder, Groups, LayerNorm, activation, encoder_attention, length_groups
from engine.models.config import ModelConfig
from engine.models.layers import ColumnLinear, RotaryEmbedding, RowLinear, VocabEmbedding


class ModernBertLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, index: int):
        super().__init__()
        m, h, eps = cfg.encoder.modern, cfg.hidden_size, cfg.encoder.layer_norm_eps
        self.heads, self.head_dim, self.sliding = cfg.num_heads, cfg.head_dim, index in m.sliding
        self.attn_norm = LayerNorm(h, eps, m.norm_bias) if index else None  # (the first reads the embeddings' norm)
        self.qkv = ColumnLinear(h, [3 * h], bias=m.attention_bias)  # (fused in the checkpoint: one part)
        self.attn_out = RowLinear(h, h, bias=m.attention_bias)
        self.mlp_norm = LayerNorm(h, eps, m.norm_bias)
        self.mid = ColumnLinear(h, [2 * cfg.intermediate_size], bias=m.mlp_bias)  # input | gate
        self.out = RowLinear(cfg.intermediate_size, h, bias=m.mlp_bias)
        self.act = activation(cfg.encoder.hidden_act)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata,
                groups: Groups) -> torch.Tensor:
        t = x.shape[0]
        y = x if self.attn_norm is None else self.attn_norm(x)
        q, k, v = self.qkv(y).view(t, 3, self.heads, self.head_dim).unbind(1)
        q, k = q.contiguous(), k.contiguous()
        kernels.apply_rope_(q, k, *rope)
        x = x + self.attn_out(encoder_attention(q, k, v, meta, groups, self.head_dim ** -0.5).reshape(t, -1))
        up, gate = self.mid(self.mlp_norm(x)).chunk(2, dim=-1)
        return x + self.out(self.act(up) * gate)


class ModernBertHead(nn.Module):
    """A classifier's: dense, activation, norm, then the classifier. (N, hidden) -> (N, labels)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        m, h = cfg.encoder.modern, cfg.hidden_size
        self.dense = ColumnLinear(h, [h], bias=m.classifier_bias)
        self.act = activation(m.classifier_act)
        self.norm = LayerNorm(h, cfg.encoder.layer_norm_eps, m.norm_bias)
        self.out_proj = ColumnLinear(h, [len(cfg.labels)], bias=True)

    @property
    def weight(self) -> torch.Tensor:  # (its dtype is what the runner casts a pooled state to)
        return self.out_proj.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out_proj(self.norm(self.act(self.dense(x))))


class ModernBertModel(Encoder):
    """ModernBERT's encoder, and a classifier's head (``score``) where the checkpoint has one."""

    def __init__(self, cfg: ModelConfig, max_positions: int):
        super().__init__()
        e, m = cfg.encoder, cfg.encoder.modern
        self.cfg, self.window = cfg, m.window
        self.word_embeddings = VocabEmbedding(cfg.vocab_size, cfg.hidden_size)
        self.embed_norm = LayerNorm(cfg.hidden_size, e.layer_norm_eps, m.norm_bias)
        self.rotary = RotaryEmbedding(cfg.head_dim, max_positions, m.rope_theta, None)
        self.local_rotary = RotaryEmbedding(cfg.head_dim, max_positions, m.local_rope_theta, None)
        self.encoder = nn.ModuleList(ModernBertLayer(cfg, i) for i in range(cfg.num_layers))
        self.final_norm = LayerNorm(cfg.hidden_size, e.layer_norm_eps, m.norm_bias)
        self.score = ModernBertHead(cfg) if cfg.labels else None

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                embeds: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """(T,) token ids of whole prompts at (T,) positions (0 first) -> (T, hidden) final hidden states."""
        x = self.embed_norm(self.word_embeddings(input_ids))
        full = length_groups(meta)
        near = [(rows, index, keep, mask & self._near(keep.shape[1], keep.device)) for rows, index, keep, mask in full]
        rope, local = self.rotary(positions, x.dtype), self.local_rotary(positions, x.dtype)
        for layer in self.encoder:
            x = layer(x, local, meta, near) if layer.sliding else layer(x, rope, meta, full)
        return self.final_norm(x)

    def _near(self, width: int, device: torch.device) -> torch.Tensor:
        """(Q, Q): the keys a sliding layer's query sees, those at most ``window`` positions away either side."""
        cells = torch.arange(width, device=device)
        return (cells[None, :] - cells[:, None]).abs() <= self.window

    def ours(self, name: str) -> tuple[str, int, str] | None:
        """As ``BertModel.ours``: a checkpoint tensor's module here, part and kind; None: not read (an MLM head)."""
        name = name.removeprefix("model.")
        module, _, kind = name.rpartition(".")
        m = _LAYER.fullmatch(module)
        if m:
            return (f"encoder.{m[1]}.{_LAYER_NAMES[m[2]]}", 0, kind) if m[2] in _LAYER_NAMES else None
        return (_OTHER_NAMES[module], 0, kind) if module in _OTHER_NAMES else None

    def theirs(self, key: str) -> str:
        module, kind = key.split("#")[0].rsplit(".", 1)
        m = re.fullmatch(r"encoder\.(\d+)\.(\w+)", module)
        if m:
            return f"layers.{m[1]}.{next(k for k, v in _LAYER_NAMES.items() if v == m[2])}.{kind}"
        return f"{next((k for k, v in _OTHER_NAMES.items() if v == module), module)}.{kind}"


_LAYER = re.compile(r"layers\.(\d+)\.(.+)")
_LAYER_NAMES = {"attn_norm": "attn_norm", "attn.Wqkv": "qkv", "attn.Wo": "attn_out", "mlp_norm": "mlp_norm",
                "mlp.Wi": "mid", "mlp.Wo": "out"}
_OTHER_NAMES = {"embeddings.tok_embeddings": "word_embeddings", "embeddings.norm": "embed_norm",
                "final_norm": "final_norm", "head.dense": "score.dense", "head.norm": "score.norm",
                "classifier": "score.out_proj"}
