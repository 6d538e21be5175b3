"""BERT-style encoders (BERT, RoBERTa, XLM-R): they embed (bge, e5, all-MiniLM, multilingual-e5) and
classify (bge-reranker, ms-marco cross-encoders, sentiment heads), served by the same step loop as the
decoders.

Every token attends to every other token of its prompt, so a prompt is computed whole, in one step
(``PoolState.whole``: the scheduler neither chunks it nor takes any of it from the prefix cache), and
nothing is kept after it: no KV cache (its blocks are names only, ``count_kv_blocks``). The step's
metadata says which rows are whose: a prompt of several tokens is a prefill row group (its grid,
``q_index``, pads the prompts to the longest for one masked attention call), a one-token prompt is a
decode row (it attends to itself alone).

Post-norm layers as transformers' ``BertLayer``: x = LN(x + attn(x)); x = LN(x + out(act(mid(x)))).
Inputs: word + position + token type embeddings, normed. The token type of a pair's second text (after
its first [SEP], as BERT's tokenizer types a pair) is 1, where the model has two types and classifies:
a cross-encoder reads the query and the document so.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from engine.attention import AttentionMetadata
from engine.models.config import ModelConfig
from engine.models.layers import ColumnLinear, RowLinear, VocabEmbedding


def _param(*shape: int) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape), requires_grad=False)


class Table(nn.Module):
    """Position or token type embeddings: rows looked up by index."""

    def __init__(self, rows: int, dim: int):
        super().__init__()
        self.weight = _param(rows, dim)


class LayerNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps, self.weight, self.bias = eps, _param(dim), _param(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, x.shape[-1:], self.weight, self.bias, self.eps)


def encoder_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata,
                      scale: float) -> torch.Tensor:
    """(T, H, D) each -> (T, H, D): each prompt's tokens attending to all of its tokens."""
    out = torch.empty_like(q)
    if meta.decode is not None:  # one-token prompts: softmax over one score is 1
        rows = meta.decode.token_rows
        out[rows] = v[rows]
    p = meta.prefill
    if p is not None:
        if p.token_rows is not None:
            q, k, v = q[p.token_rows], k[p.token_rows], v[p.token_rows]
        b, n = p.q_index.shape
        keep = p.q_index < len(q)  # (B, Q): the grid's cells that hold a token (the others pad)

        def grid(x: torch.Tensor) -> torch.Tensor:  # (Tp, H, D) -> (B, H, Q, D), padded with zeros
            return torch.cat([x, x.new_zeros(1, *x.shape[1:])])[p.q_index].transpose(1, 2)

        o = F.scaled_dot_product_attention(grid(q), grid(k), grid(v), attn_mask=keep[:, None, None, :], scale=scale)
        o = o.transpose(1, 2).reshape(b * n, *q.shape[1:])[p.out_index]
        if p.token_rows is None:
            return o
        out[p.token_rows] = o
    return out


class BertLayer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        h, eps = cfg.hidden_size, cfg.encoder.layer_norm_eps
        self.heads, self.head_dim = cfg.num_heads, cfg.head_dim
        self.qkv = ColumnLinear(h, [h] * 3, bias=True)
        self.attn_out = RowLinear(h, h, bias=True)
        self.attn_norm = LayerNorm(h, eps)
        self.mid = ColumnLinear(h, [cfg.intermediate_size], bias=True)
        self.out = RowLinear(cfg.intermediate_size, h, bias=True)
        self.out_norm = LayerNorm(h, eps)
        act = cfg.encoder.hidden_act
        self.act = F.relu if act == "relu" else (lambda x: F.gelu(x, approximate="tanh")) if act == "gelu_tanh" \
            else F.gelu

    def forward(self, x: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        t = x.shape[0]
        q, k, v = (y.view(t, self.heads, self.head_dim) for y in self.qkv(x).chunk(3, dim=-1))
        a = encoder_attention(q, k, v, meta, self.head_dim ** -0.5).reshape(t, -1)
        x = self.attn_norm(x + self.attn_out(a))
        return self.out_norm(x + self.out(self.act(self.mid(x))))


class ClassifierHead(nn.Module):
    """A ``*ForSequenceClassification``'s head over the first token's state: RoBERTa's dense, tanh, out_proj;
    BERT's pooler (dense, tanh) then its classifier. (N, hidden) -> (N, labels)."""

    def __init__(self, hidden: int, labels: int):
        super().__init__()
        self.dense = ColumnLinear(hidden, [hidden], bias=True)
        self.out_proj = ColumnLinear(hidden, [labels], bias=True)

    @property
    def weight(self) -> torch.Tensor:  # (its dtype is what the runner casts a pooled state to)
        return self.out_proj.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out_proj(torch.tanh(self.dense(x)))


class BertModel(nn.Module):
    """The encoder, and a classifier's head (``score``) where the checkpoint has one. As ``LlamaForCausalLM``
    to the runner: ``forward`` gives the final hidden states; no ``lm_head``, no ``layers`` with a cache."""

    lm_head = vision = None
    layers: tuple = ()  # (none holds a KV cache)

    def __init__(self, cfg: ModelConfig, max_positions: int):
        super().__init__()
        e = cfg.encoder
        self.cfg, self.roberta, self.pad = cfg, e.roberta, e.pad_token_id
        self.word_embeddings = VocabEmbedding(cfg.vocab_size, cfg.hidden_size)
        offset = (e.pad_token_id + 1) if e.roberta else 0
        self.position_embeddings = Table(max_positions + offset, cfg.hidden_size)
        self.token_type_embeddings = Table(e.type_vocab_size, cfg.hidden_size)
        self.embed_norm = LayerNorm(cfg.hidden_size, e.layer_norm_eps)
        self.encoder = nn.ModuleList(BertLayer(cfg) for _ in range(cfg.num_layers))
        self.score = ClassifierHead(cfg.hidden_size, len(cfg.labels)) if cfg.labels else None
        self.sep_token_id: int | None = None  # set by the loader where pairs are typed (two types, a classifier)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                embeds: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """(T,) token ids of whole prompts at (T,) positions (0 first) -> (T, hidden) final hidden states."""
        first = positions == 0
        if self.roberta:  # transformers' create_position_ids_from_input_ids: padding tokens skipped
            real = input_ids != self.pad
            positions = torch.where(real, _count_in_prompt(real, first) + self.pad, self.pad)
        x = self.word_embeddings(input_ids) + self.position_embeddings.weight[positions]
        if self.sep_token_id is not None:  # 1 after the prompt's first [SEP]
            sep = input_ids == self.sep_token_id
            types = (_count_in_prompt(sep, first) - sep.long() > 0).long()
            x = x + self.token_type_embeddings.weight[types]
        else:
            x = x + self.token_type_embeddings.weight[0]
        x = self.embed_norm(x)
        for layer in self.encoder:
            x = layer(x, meta)
        return x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("an encoder has no language-model head: it can embed and classify, not generate")


def _count_in_prompt(flags: torch.Tensor, first: torch.Tensor) -> torch.Tensor:
    """(T,) how many of each prompt's tokens so far (this one included) are ``flags``; ``first`` marks
    each prompt's first token (prompts are whole and in order in the flat batch)."""
    total = flags.long().cumsum(0)
    before = total - flags.long()  # the count before each token, over the whole batch
    prompt = first.long().cumsum(0) - 1  # each token's prompt
    return total - before[first][prompt]


_LAYER_NAMES = {  # a checkpoint's module in a layer (past ``encoder.layer.N.``) -> ours, and its part of a fused one
    "attention.self.query": ("qkv", 0), "attention.self.key": ("qkv", 1), "attention.self.value": ("qkv", 2),
    "attention.output.dense": ("attn_out", 0), "attention.output.LayerNorm": ("attn_norm", 0),
    "intermediate.dense": ("mid", 0), "output.dense": ("out", 0), "output.LayerNorm": ("out_norm", 0),
}
_OTHER_NAMES = {
    "embeddings.word_embeddings": "word_embeddings", "embeddings.position_embeddings": "position_embeddings",
    "embeddings.token_type_embeddings": "token_type_embeddings", "embeddings.LayerNorm": "embed_norm",
    "classifier.dense": "score.dense", "classifier.out_proj": "score.out_proj",  # RoBERTa's head
    "pooler.dense": "score.dense", "classifier": "score.out_proj",  # BERT's
}
_LAYER = re.compile(r"encoder\.layer\.(\d+)\.(.+)")


def _ours(name: str) -> tuple[str, int, str] | None:
    """A checkpoint tensor's module here, its part (of a fused one) and kind (weight, bias); None: not read."""
    name = name.removeprefix("bert.").removeprefix("roberta.").removeprefix("model.")
    module, _, kind = name.rpartition(".")
    kind = {"gamma": "weight", "beta": "bias"}.get(kind, kind)
    m = _LAYER.fullmatch(module)
    if m:
        ours, part = _LAYER_NAMES.get(m[2], (None, 0))
        return None if ours is None else (f"encoder.{m[1]}.{ours}", part, kind)
    return (_OTHER_NAMES[module], 0, kind) if module in _OTHER_NAMES else None  # (an MLM head, position_ids...)


def load_encoder_weights(model: BertModel, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Copy each checkpoint tensor (transformers' names, with or without ``bert.`` / ``roberta.``; old
    checkpoints' LayerNorm ``gamma`` and ``beta`` too) into place; check that nothing is missing."""
    expected = {f"{m}.{kind}#{part}" for m, module in model.named_modules()
                for kind, p in module.named_parameters(recurse=False)
                for part in range(len(module.out_sizes) if isinstance(module, ColumnLinear) else 1)}
    seen: set[str] = set()
    with torch.no_grad():
        for name, w in weights:
            found = _ours(name)
            if found is None or found[0].startswith("score.") and model.score is None:
                continue  # (an embedding model's pooler: not one it runs)
            module, part, kind = found
            key = f"{module}.{kind}#{part}"
            if key not in expected:
                raise ValueError(f"{name}: no such tensor in a {model.cfg.model_type} of this config")
            target = model.get_submodule(module)
            if isinstance(target, ColumnLinear):
                target.load(part, w, kind)
            elif isinstance(target, RowLinear):
                target.load(w, kind)
            else:
                param = getattr(target, kind)
                w = w[:param.shape[0]] if module == "position_embeddings" else w  # (past the length served)
                if param.shape != w.shape:
                    raise ValueError(f"{name}: shape {tuple(w.shape)}, but the config says {tuple(param.shape)}")
                param.copy_(w)
            seen.add(key)
    missing = sorted(k.split("#")[0] for k in expected - seen)
    if missing:
        raise ValueError(f"the checkpoint lacks {len(missing)} of the model's tensors: {', '.join(missing[:4])}...")
