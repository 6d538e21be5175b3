"""BERT-style encoders (BERT, RoBERTa, XLM-R, MPNet, DistilBERT): they embed (bge, e5, all-MiniLM,
all-mpnet, multilingual-e5) and classify (bge-reranker, ms-marco cross-encoders, sentiment heads), served
by the same step loop as the decoders.

Every token attends to every other token of its prompt, so a prompt is computed whole, in one step
(``PoolState.whole``: the scheduler neither chunks it nor takes any of it from the prefix cache), and
nothing is kept after it: no KV cache (its blocks are names only, ``count_kv_blocks``). The step's
metadata says which rows are whose: prompts of several tokens are its prefill rows (padded, in groups
of similar length, for a masked attention call each: ``length_groups``), a one-token prompt is a decode
row (it attends to itself alone).

Post-norm layers as transformers' ``BertLayer``: x = LN(x + attn(x)); x = LN(x + out(act(mid(x)))).
Inputs: word + position + token type embeddings, normed. The token type of a pair's second text (after
its first [SEP], as BERT's tokenizer types a pair) is 1, where the model has two types and classifies:
a cross-encoder reads the query and the document so. MPNet and DistilBERT have no token types; MPNet
adds to each score a bias learnt per head for the distance between query and key (in buckets, as T5's).
ModernBERT, a newer body, has a module of its own (``engine/models/modernbert.py``).
"""

from __future__ import annotations

import functools
import itertools
import math
import re
from collections.abc import Callable, Iterable

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
    def __init__(self, dim: int, eps: float, bias: bool = True):
        super().__init__()
        self.eps, self.weight, self.bias = eps, _param(dim), _param(dim) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, x.shape[-1:], self.weight, self.bias, self.eps)


def activation(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """An encoder's activation by ``EncoderConfig``'s name: gelu (erf), gelu_tanh, relu."""
    return F.relu if name == "relu" else functools.partial(F.gelu, approximate="tanh") if name == "gelu_tanh" \
        else F.gelu


Groups = list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]]


def length_groups(meta: AttentionMetadata) -> Groups:
    """The step's prompts of several tokens in groups of similar length, each padded to its longest for one
    masked attention call (one long input among many short ones pads none of them to its length): a prompt
    joins the group of the longer ones before it while it is at least half as long. Per group: its tokens'
    rows of the flat batch, prompt by prompt (N,); each grid cell's token among them, N where it pads (B, Q);
    which cells hold a token (B, Q); and the attention's mask, the keys that do (B, 1, 1, Q). Made once a step
    (its lengths read on the host)."""
    p = meta.prefill
    if p is None:
        return []
    starts = p.query_start.tolist()  # (the one sync a step: an encoder's step overlaps nothing)
    lens = [b - a for a, b in itertools.pairwise(starts)]
    order = sorted(range(len(lens)), key=lambda i: -lens[i])
    groups: list[list[int]] = []
    for i in order:
        if not groups or 2 * lens[i] < lens[groups[-1][0]]:
            groups.append([])
        groups[-1].append(i)
    out, device = [], p.query_start.device
    for g in groups:
        first, n = torch.tensor([starts[i] for i in g]), torch.tensor([lens[i] for i in g])
        cell = torch.arange(lens[g[0]])[None, :]
        keep = cell < n[:, None]
        rows = (first[:, None] + cell)[keep]  # rows among the step's prompt rows
        index = torch.full(keep.shape, len(rows), dtype=torch.int64)
        index[keep] = torch.arange(len(rows))
        rows = rows.to(device)
        keep = keep.to(device)
        out.append((rows if p.token_rows is None else p.token_rows[rows], index.to(device), keep,
                    keep[:, None, None, :]))
    return out


def encoder_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata, groups: Groups,
                      scale: float) -> torch.Tensor:
    """(T, H, D) each -> (T, H, D): each prompt's tokens attending to all of its tokens (``length_groups``)."""
    out = torch.empty_like(q)
    if meta.decode is not None:  # one-token prompts: softmax over one score is 1
        rows = meta.decode.token_rows
        out[rows] = v[rows]
    for rows, index, keep, mask in groups:
        o = F.scaled_dot_product_attention(*(_grid(x, rows, index) for x in (q, k, v)), attn_mask=mask, scale=scale)
        out[rows] = o.transpose(1, 2)[keep]
    return out


def _grid(x: torch.Tensor, rows: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """(T, H, D) -> a group's (B, H, Q, D), padded with zeros."""
    x = x[rows]
    return torch.cat([x, x.new_zeros(1, *x.shape[1:])])[index].transpose(1, 2)


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
        self.act = activation(cfg.encoder.hidden_act)

    def forward(self, x: torch.Tensor, meta: AttentionMetadata, groups: Groups) -> torch.Tensor:
        t = x.shape[0]
        q, k, v = (y.view(t, self.heads, self.head_dim) for y in self.qkv(x).chunk(3, dim=-1))
        a = encoder_attention(q, k, v, meta, groups, self.head_dim ** -0.5).reshape(t, -1)
        x = self.attn_norm(x + self.attn_out(a))
        return self.out_norm(x + self.out(self.act(self.mid(x))))


class ClassifierHead(nn.Module):
    """A ``*ForSequenceClassification``'s head over the first token's state: RoBERTa's dense, tanh, out_proj;
    BERT's pooler (dense, tanh) then its classifier; DistilBERT's the same with a ReLU. (N, hidden) -> (N,
    labels)."""

    def __init__(self, hidden: int, labels: int, relu: bool = False):
        super().__init__()
        self.dense = ColumnLinear(hidden, [hidden], bias=True)
        self.out_proj = ColumnLinear(hidden, [labels], bias=True)
        self.act = torch.relu if relu else torch.tanh

    @property
    def weight(self) -> torch.Tensor:  # (its dtype is what the runner casts a pooled state to)
        return self.out_proj.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out_proj(self.act(self.dense(x)))


class Encoder(nn.Module):
    """What every encoder is to the runner, as ``LlamaForCausalLM`` is: ``forward`` gives the final hidden
    states; no ``lm_head`` or vision tower, no ``layers`` with a cache; a classifier's head is ``score``. To
    the loader (``load_encoder_weights``): ``ours`` and ``theirs`` map the checkpoint's names."""

    lm_head = vision = None
    layers: tuple = ()  # (none holds a KV cache)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("an encoder has no language-model head: it can embed and classify, not generate")


class BertModel(Encoder):
    """BERT, RoBERTa, XLM-R, MPNet, DistilBERT: the encoder, and a classifier's head (``score``) where the
    checkpoint has one."""

    def __init__(self, cfg: ModelConfig, max_positions: int):
        super().__init__()
        e = cfg.encoder
        self.cfg, self.roberta, self.pad = cfg, e.roberta, e.pad_token_id
        self.word_embeddings = VocabEmbedding(cfg.vocab_size, cfg.hidden_size)
        offset = (e.pad_token_id + 1) if e.roberta else 0
        self.position_embeddings = Table(max_positions + offset, cfg.hidden_size)
        self.token_type_embeddings = Table(e.type_vocab_size, cfg.hidden_size) if e.type_vocab_size else None
        self.relative_attention_bias = Table(e.relative_buckets, cfg.num_heads) if e.relative_buckets else None
        self.embed_norm = LayerNorm(cfg.hidden_size, e.layer_norm_eps)
        self.encoder = nn.ModuleList(BertLayer(cfg) for _ in range(cfg.num_layers))
        self.score = ClassifierHead(cfg.hidden_size, len(cfg.labels), e.head == "distilbert") if cfg.labels else None
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
        elif self.token_type_embeddings is not None:
            x = x + self.token_type_embeddings.weight[0]
        x = self.embed_norm(x)
        groups = length_groups(meta)
        if self.relative_attention_bias is not None:
            groups = [(rows, index, keep, self._biased(keep, x.dtype)) for rows, index, keep, _ in groups]
        for layer in self.encoder:
            x = layer(x, meta, groups)
        return x

    def _biased(self, keep: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """MPNet's mask for a group of width Q: each head's bias for each (query, key) distance, -inf at the
        keys that pad (B, H, Q, Q); as transformers' ``compute_position_bias`` (its 32 buckets, whatever the
        config's number)."""
        cells = torch.arange(keep.shape[1], device=keep.device)
        bias = self.relative_attention_bias.weight[_bucket(cells[None, :] - cells[:, None])]  # (Q, Q, H)
        return bias.permute(2, 0, 1)[None].to(dtype).masked_fill(~keep[:, None, None, :], float("-inf"))

    def ours(self, name: str) -> tuple[str, int, str] | None:
        """A checkpoint tensor's module here, its part (of a fused one) and kind (weight, bias); None: not read."""
        return _ours(name, self.cfg.encoder.head)

    def theirs(self, key: str) -> str:
        """The checkpoint's name (less its prefix) of ``ours``' ``module.kind#part`` (for messages)."""
        return _theirs(key, self.cfg.model_type, self.cfg.encoder.head)


def _bucket(distance: torch.Tensor, buckets: int = 32, max_distance: int = 128) -> torch.Tensor:
    """T5's and MPNet's bucket of each key-minus-query distance: half the buckets for each direction, exact up
    to a quarter of them, then logarithmic up to ``max_distance``."""
    n, half = -distance, buckets // 2
    out = (n < 0).long() * half
    n, exact = n.abs(), half // 2
    large = exact + (torch.log(n.float() / exact) / math.log(max_distance / exact) * (half - exact)).long()
    return out + torch.where(n < exact, n, large.clamp(max=half - 1))


def _count_in_prompt(flags: torch.Tensor, first: torch.Tensor) -> torch.Tensor:
    """(T,) how many of each prompt's tokens so far (this one included) are ``flags``; ``first`` marks
    each prompt's first token (prompts are whole and in order in the flat batch)."""
    total = flags.long().cumsum(0)
    before = total - flags.long()  # the count before each token, over the whole batch
    prompt = first.long().cumsum(0) - 1  # each token's prompt
    return total - before[first][prompt]


# a checkpoint's module in a layer (past ``encoder.layer.N.``) -> ours, and its part of a fused one: BERT's names,
# MPNet's for its attention, DistilBERT's (past ``transformer.layer.N.``)
_BERT_LAYER = {
    "attention.self.query": ("qkv", 0), "attention.self.key": ("qkv", 1), "attention.self.value": ("qkv", 2),
    "attention.output.dense": ("attn_out", 0), "attention.output.LayerNorm": ("attn_norm", 0),
    "intermediate.dense": ("mid", 0), "output.dense": ("out", 0), "output.LayerNorm": ("out_norm", 0),
}
_MPNET_LAYER = {"attention.attn.q": ("qkv", 0), "attention.attn.k": ("qkv", 1), "attention.attn.v": ("qkv", 2),
                "attention.attn.o": ("attn_out", 0), "attention.LayerNorm": ("attn_norm", 0)}
_DISTILBERT_LAYER = {
    "attention.q_lin": ("qkv", 0), "attention.k_lin": ("qkv", 1), "attention.v_lin": ("qkv", 2),
    "attention.out_lin": ("attn_out", 0), "sa_layer_norm": ("attn_norm", 0), "ffn.lin1": ("mid", 0),
    "ffn.lin2": ("out", 0), "output_layer_norm": ("out_norm", 0),
}
_LAYER_NAMES = _BERT_LAYER | _MPNET_LAYER | _DISTILBERT_LAYER
_EMBEDDINGS = {"embeddings.word_embeddings": "word_embeddings", "embeddings.position_embeddings": "position_embeddings",
               "embeddings.token_type_embeddings": "token_type_embeddings", "embeddings.LayerNorm": "embed_norm",
               "encoder.relative_attention_bias": "relative_attention_bias"}
# a classifier's head (EncoderConfig.head): RoBERTa's (dense, tanh, out_proj; a pooler some checkpoints still
# hold is not read, as transformers reads none), BERT's (its pooler's dense and tanh, then its classifier),
# DistilBERT's (pre_classifier, ReLU, classifier)
_HEADS = {"roberta": {"classifier.dense": "score.dense", "classifier.out_proj": "score.out_proj"},
          "bert": {"pooler.dense": "score.dense", "classifier": "score.out_proj"},
          "distilbert": {"pre_classifier": "score.dense", "classifier": "score.out_proj"}}
_LAYER = re.compile(r"(?:encoder|transformer)\.layer\.(\d+)\.(.+)")


def _ours(name: str, head: str) -> tuple[str, int, str] | None:
    """A checkpoint tensor's module here, its part (of a fused one) and kind (weight, bias); None: not read."""
    for prefix in ("bert.", "roberta.", "mpnet.", "distilbert.", "model."):
        name = name.removeprefix(prefix)
    module, _, kind = name.rpartition(".")
    kind = {"gamma": "weight", "beta": "bias"}.get(kind, kind)
    m = _LAYER.fullmatch(module)
    if m:
        ours, part = _LAYER_NAMES.get(m[2], (None, 0))
        return None if ours is None else (f"encoder.{m[1]}.{ours}", part, kind)
    ours = _EMBEDDINGS.get(module) or _HEADS[head].get(module)
    return None if ours is None else (ours, 0, kind)  # (None: an MLM head, position_ids...)


def _theirs(key: str, model_type: str, head: str) -> str:
    """The checkpoint's name for ``_ours``' ``module.kind#part`` (for messages), as ``model_type`` spells it."""
    module, part = key.split("#")
    module, kind = module.rsplit(".", 1)
    layer = re.fullmatch(r"encoder\.(\d+)\.(\w+)", module)
    names = {"mpnet": _MPNET_LAYER | _BERT_LAYER, "distilbert": _DISTILBERT_LAYER}.get(model_type, _BERT_LAYER)
    stack = "transformer" if model_type == "distilbert" else "encoder"
    for theirs, (ours, p) in names.items():
        if layer and ours == layer[2] and p == int(part):
            return f"{stack}.layer.{layer[1]}.{theirs}.{kind}"
    flat = {v: k for k, v in (_EMBEDDINGS | _HEADS[head]).items()}
    return f"{flat.get(module, module)}.{kind}"


def load_encoder_weights(model: Encoder, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Copy each checkpoint tensor (transformers' names, with or without ``bert.`` / ``roberta.``; old
    checkpoints' LayerNorm ``gamma`` and ``beta`` too) into place, as the model's ``ours`` names them; check
    that each is read once and that nothing is missing."""
    expected = {f"{m}.{kind}#{part}" for m, module in model.named_modules()
                for kind, p in module.named_parameters(recurse=False)
                for part in range(len(module.out_sizes) if isinstance(module, ColumnLinear) else 1)}
    seen: dict[str, str] = {}  # ours -> the checkpoint's name
    prefix = ""  # the checkpoint's (bert., roberta., ...: for messages)
    with torch.no_grad():
        for name, w in weights:
            found = model.ours(name)
            if found is None or found[0].startswith("score.") and model.score is None:
                continue  # (an embedding model's pooler: not one it runs)
            module, part, kind = found
            key = f"{module}.{kind}#{part}"
            if key in seen:
                raise ValueError(f"{seen[key]} and {name} are the same tensor: the checkpoint holds it twice")
            if key not in expected:
                raise ValueError(f"{name}: no such tensor in a {model.cfg.model_type} of this config")
            prefix = prefix or name[:max(0, name.find("embeddings."))]
            target = model.get_submodule(module)
            param = getattr(target, kind)
            if module == "position_embeddings":
                w = w[:param.shape[0]]  # (past the length served)
            want = (target.full_sizes[part], *param.shape[1:]) if isinstance(target, ColumnLinear) else param.shape
            if tuple(w.shape) != tuple(want):
                raise ValueError(f"{name}: shape {tuple(w.shape)}, but the config says {tuple(want)}")
            if isinstance(target, ColumnLinear):
                target.load(part, w, kind)
            elif isinstance(target, RowLinear):
                target.load(w, kind)
            else:
                param.copy_(w)
            seen[key] = name
    missing = [model.theirs(k) for k in expected - set(seen)]
    # (a head's names are bare, the body's prefixed)
    missing = sorted(m if m.startswith(("classifier", "pre_classifier", "head.")) else prefix + m for m in missing)
    if missing:
        raise ValueError(f"the checkpoint lacks {len(missing)} of the model's tensors: {', '.join(missing[:4])}"
                         + (", ..." if len(missing) > 4 else ""))
