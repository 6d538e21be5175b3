"""Building blocks shared by the models: linear layers that shard across tensor-parallel
ranks, the gated MLP, the vocab-parallel embedding and LM head, RMSNorm, rotary embedding.

Weights are allocated uninitialised in the default dtype (the loader makes that the model's
dtype while it builds one: no float32 copy is ever made) and filled by the loader through
each layer's ``load`` method, which is where fusing (q|k|v, gate|up) and tensor-parallel
slicing happen: every rank reads the full checkpoint tensor and keeps its own slice. The
collectives go through the ``TPGroup`` each layer is given (no globals); with one rank
they are no-ops.
"""

from __future__ import annotations

import math

import torch
from torch import nn

import kernels
from engine.parallel import TPGroup

_SINGLE = TPGroup()


def _empty(*shape: int) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape), requires_grad=False)


class Packable(nn.Module):
    """A layer whose (N, K) weight may be kept packed: ``pack(fmt)`` swaps it, before loading, for
    uint8 rows of blocks (``kernels.reference.PACKED_BLOCKS``), which ``load`` then copies rows of as
    it would copy rows of floats. Slices are whole rows, or under tensor parallelism along K whole
    blocks (K a multiple of the block per rank)."""

    packed: str | None = None
    perm: torch.Tensor | None = None  # act-order int4: the input's columns in the order the weight keeps them

    def set_perm(self, perm: torch.Tensor) -> None:
        """Multiply ``x[..., perm]`` (``engine.quant.permutation``); every fused part must agree."""
        perm = perm.to(self.weight.device)
        if self.perm is not None and not torch.equal(self.perm, perm):
            raise ValueError("the fused parts of a layer must share one act-order permutation")
        self.perm = perm

    def inputs(self, x: torch.Tensor) -> torch.Tensor:
        return x if self.perm is None else x.index_select(-1, self.perm)

    def pack(self, fmt: str) -> None:
        rows, k = self.weight.shape
        self.weight = nn.Parameter(torch.empty(rows, kernels.reference.packed_row_bytes(fmt, k), dtype=torch.uint8,
                                               device=self.weight.device), requires_grad=False)
        self.packed = fmt


class ColumnLinear(Packable):
    """y = x W^T (+ b), W = [W_0; W_1; ...] fused along the output dim.

    Under tensor parallelism each rank keeps a slice of every part's rows, so outputs
    stay split and no communication is needed. ``replicas[i]`` ranks share each slice of
    part ``i`` (1: a plain split; more: KV heads fewer than ranks, each kept by
    ``tp.size / num_kv_heads`` ranks).
    """

    def __init__(self, in_features: int, out_sizes: list[int], bias: bool = False, tp: TPGroup = _SINGLE,
                 replicas: list[int] | None = None):
        super().__init__()
        replicas = replicas or [1] * len(out_sizes)
        self.full_sizes = out_sizes  # each part's rows in the checkpoint
        shards = [tp.size // r for r in replicas]
        assert all(tp.size % r == 0 for r in replicas) and all(s % n == 0 for s, n in zip(out_sizes, shards, strict=True))
        self.out_sizes = [s // n for s, n in zip(out_sizes, shards, strict=True)]  # this rank's rows of each part
        self.starts = [tp.rank // r * n for r, n in zip(replicas, self.out_sizes, strict=True)]  # ...from this row
        self.in_features = in_features
        self.lora: nn.Module | None = None  # LoRA adapters' products added to the output (``engine.lora``)
        self.weight = _empty(sum(self.out_sizes), in_features)
        self.bias = _empty(sum(self.out_sizes)) if bias else None
        # parts packed in formats of their own (``pack_parts``): (format, first row, rows, first byte, row bytes)
        self.segments: list[tuple[str, int, int, int, int]] = []

    def pack_parts(self, fmts: list[str]) -> None:
        """Keep part ``i`` packed in ``fmts[i]``. One format: ``pack``. Several (a GGUF file's q|k|v where
        v has more bits, as Q4_K_M's in half its layers): ``weight`` becomes the parts' rows as flat bytes,
        each run of parts sharing a format one ``segment`` that ``forward`` multiplies on its own (on one
        rank)."""
        if len(set(fmts)) == 1:
            return self.pack(fmts[0])
        k, rows, at = self.weight.shape[1], 0, 0
        for part, fmt in enumerate(fmts):
            n, width = self.out_sizes[part], kernels.reference.packed_row_bytes(fmt, k)
            if self.segments and self.segments[-1][0] == fmt:
                f, first, count, start, _ = self.segments[-1]
                self.segments[-1] = (f, first, count + n, start, width)
            else:
                self.segments.append((fmt, rows, n, at, width))
            rows, at = rows + n, at + n * width
        self.weight = nn.Parameter(torch.empty(at, dtype=torch.uint8, device=self.weight.device), requires_grad=False)

    def load(self, part: int, tensor: torch.Tensor, kind: str = "weight") -> None:
        """Copy this rank's rows of part ``part`` (``kind`` "weight" or "bias")."""
        if tensor.shape[0] != self.full_sizes[part]:  # (a narrower one would be silently cut)
            raise ValueError(f"part {part} of this layer has {self.full_sizes[part]} rows in the model's config, got "
                             f"a {kind} of shape {tuple(tensor.shape)}")
        n = self.out_sizes[part]
        start = sum(self.out_sizes[:part])
        rows = tensor.narrow(0, self.starts[part], n)
        if kind == "weight" and self.segments:
            _, first, _, at, width = next(seg for seg in reversed(self.segments) if seg[1] <= start)
            at += (start - first) * width
            self.weight[at:at + n * width].view(n, width).copy_(rows)
        else:
            getattr(self, kind)[start:start + n].copy_(rows)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.segments:
            xp = self.inputs(x)
            y = torch.cat([kernels.linear(xp, self.weight[at:at + n * width].view(n, width),
                                          None if self.bias is None else self.bias[first:first + n], fmt)
                           for fmt, first, n, at, width in self.segments], dim=-1)
        else:
            y = kernels.linear(self.inputs(x), self.weight, self.bias, self.packed)
        return y if self.lora is None else self.lora(x, y)


class RowLinear(Packable):
    """y = x W^T (+ b) with W split along the input dim under tensor parallelism: each rank
    multiplies its slice of x (the column-parallel layer's output) and the partial sums are
    all-reduced; the bias is added once, after."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False, tp: TPGroup = _SINGLE):
        super().__init__()
        assert in_features % tp.size == 0
        self.tp = tp
        self.in_per_rank, self.out_features = in_features // tp.size, out_features
        self.lora: nn.Module | None = None  # as ColumnLinear's
        self.weight = _empty(out_features, self.in_per_rank)
        self.bias = _empty(out_features) if bias else None

    def load(self, tensor: torch.Tensor, kind: str = "weight") -> None:
        if kind == "weight" and self.tp.size > 1:
            width = self.weight.shape[1]  # this rank's columns: floats, or bytes of whole packed blocks
            if tensor.shape[1] != width * self.tp.size:
                raise ValueError(f"this layer has {width * self.tp.size} columns in the model's config, got a "
                                 f"weight of shape {tuple(tensor.shape)}")
            tensor = tensor.narrow(1, self.tp.rank * width, width)
        getattr(self, kind).copy_(tensor)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = kernels.linear(self.inputs(x), self.weight, packed=self.packed)
        y = self.tp.all_reduce(y if self.lora is None else self.lora(x, y))  # (a rank's share of A: a partial sum)
        return y if self.bias is None else y + self.bias


class GatedMLP(nn.Module):
    """``down(act(gate x) * up x)``, gate|up fused, ``act`` SiLU (or Gemma's GELU, ``gelu_tanh``); under
    tensor parallelism each rank keeps a 1/T slice of its width and the down projection all-reduces."""

    def __init__(self, hidden: int, intermediate: int, tp: TPGroup = _SINGLE, act: str = "silu"):
        super().__init__()
        self.gate_up_proj = ColumnLinear(hidden, [intermediate] * 2, tp=tp)
        self.down_proj = RowLinear(intermediate, hidden, tp=tp)
        self.act_and_mul = kernels.gelu_and_mul if act == "gelu_tanh" else kernels.silu_and_mul

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_and_mul(self.gate_up_proj(x)))


class VocabEmbedding(Packable):
    """Token embeddings, vocab-parallel: rank r keeps rows [r * n, (r + 1) * n), n = ceil(V / T)
    (the last rank's tail past V is zero padding). Each rank looks up the ids in its range,
    zeros for the others, and the all-reduce sums the one nonzero row of each token."""

    def __init__(self, vocab_size: int, hidden_size: int, tp: TPGroup = _SINGLE):
        super().__init__()
        self.tp, self.vocab_size, self.dtype = tp, vocab_size, torch.get_default_dtype()
        self.rows = -(-vocab_size // tp.size)
        self.first = tp.rank * self.rows
        self.weight = _empty(self.rows, hidden_size)

    def load(self, tensor: torch.Tensor) -> None:
        """This rank's rows of the full (V, hidden) ``tensor``; padding rows become zeros."""
        if tensor.shape[0] != self.vocab_size:  # (one of more rows was cut to vocab_size's, silently: review)
            raise ValueError(f"an embedding of {tensor.shape[0]} rows, but the config's vocab_size is "
                             f"{self.vocab_size}")
        n = max(0, min(self.vocab_size - self.first, self.rows))
        self.weight[:n].copy_(tensor.narrow(0, self.first, n))
        self.weight[n:].zero_()

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return kernels.embedding(input_ids, self.weight, self.dtype, self.packed)  # (T, hidden)
        local = input_ids - self.first
        outside = (local < 0) | (local >= self.rows)
        x = kernels.embedding(local.masked_fill(outside, 0), self.weight, self.dtype, self.packed)  # (T, hidden)
        return self.tp.all_reduce(x.masked_fill_(outside[:, None], 0.0))


class LMHead(nn.Module):
    """Logits, vocab-parallel like ``VocabEmbedding`` (and sharing its weight when tied).

    Decision: rank 0 gathers the logits (each rank's (N, V/T) columns, concatenated) and
    samples alone, rather than every rank sampling with the same generator. Sampling state
    (per-request seeded generators, penalties over each request's history, logit bias) then
    lives in rank 0 only and workers never see a request; the gather moves N * V floats per
    step for the N rows that need logits (sample rows and prompt-logprob rows), small beside
    the forward. So every rank must ask for the same rows in one call: the gather is
    collective. Returns (N, V) in the model's dtype on rank 0, None on the other ranks: a
    greedy step's argmax reads them as they are (the same token as in float32, which holds
    each value exactly), at half the bytes of a float32 copy written and read again; the
    sampler and logprobs read them in float32 where they compute more.
    """

    def __init__(self, vocab_size: int, hidden_size: int, tp: TPGroup = _SINGLE,
                 tied: VocabEmbedding | None = None):
        super().__init__()
        self.tp, self.vocab_size = tp, vocab_size
        self.shard = tied or VocabEmbedding(vocab_size, hidden_size, tp)  # the same row split

    @property
    def weight(self) -> torch.Tensor:
        return self.shard.weight

    def load(self, tensor: torch.Tensor) -> None:
        self.shard.load(tensor)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor | None:
        logits = kernels.linear(hidden, self.shard.weight, packed=self.shard.packed)  # (N, V/T)
        if self.tp.size == 1:
            return logits
        full = self.tp.gather_last_dim(logits)
        return None if full is None else full[:, :self.vocab_size]  # (N, V)


class RMSNorm(nn.Module):
    """``gemma``: Gemma's, x (1 + w) rounded once, so the weight is kept as 1 + w in float32
    (``kernels.rms_norm``'s rule for a float32 weight). ``float32``: the weight kept in float32 too, and
    multiplied before the one rounding (OLMo's, as transformers computes it)."""

    def __init__(self, dim: int, eps: float, gemma: bool = False, float32: bool = False, start: int = 0):
        """``start``: where this rank's ``dim`` values begin in the checkpoint's weight (OLMo's q/k norms
        under tensor parallelism: the rank's heads)."""
        super().__init__()
        self.eps, self.gemma, self.start = eps, gemma, start
        self.weight = nn.Parameter(torch.empty(dim, dtype=torch.float32), requires_grad=False) \
            if gemma or float32 else _empty(dim)

    def load(self, tensor: torch.Tensor) -> None:
        """(Gemma's: 1 + w summed exactly, in float64, and rounded once, as transformers' float32 sum is.)"""
        tensor = tensor[self.start:self.start + self.weight.shape[0]]
        self.weight.copy_(1 + tensor.double() if self.gemma else tensor)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """With ``residual``: returns (norm(x + residual), x + residual), the fused pre-norm step."""
        if residual is None:
            return kernels.rms_norm(x, self.weight, self.eps)
        return kernels.fused_add_rms_norm(x, residual, self.weight, self.eps)


class RotaryEmbedding(nn.Module):
    """cos/sin tables for every position, indexed once per forward and shared by all layers."""

    def __init__(self, head_dim: int, max_positions: int, theta: float, scaling: dict | None):
        super().__init__()
        powers = theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim)
        self.register_buffer("powers", powers, persistent=False)  # theta^(2i/D): 1 / each pair's frequency
        self.scaling, self.theta = scaling, theta
        cos, sin = self._tables(max_positions, max_positions)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def serve(self, length: int) -> None:
        """The tables for a served length of ``length`` (the KV cache may hold less than they span), in
        place: only LongRoPE's depend on it."""
        if self.scaling and self.scaling["rope_type"] == "longrope":
            cos, sin = self._tables(self.cos.shape[0], length)
            self.cos.copy_(cos)
            self.sin.copy_(sin)

    def _tables(self, positions: int, served: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(positions, D/2) float32 cos and sin."""
        s = self.scaling
        inv_freq, scale = 1.0 / self.powers, 1.0
        if s and s["rope_type"] == "llama3":
            inv_freq = _llama3_inv_freq(inv_freq, s)
        elif s and s["rope_type"] == "linear":
            inv_freq = inv_freq / float(s["factor"])
        elif s and s["rope_type"] == "yarn":
            inv_freq, scale = _yarn_inv_freq(self.powers, self.theta, s), s["attention_factor"]
        elif s and s["rope_type"] == "longrope":
            # Decision: the long factors for every position when the served length passes the original one,
            # else the short ones (as llama.cpp picks by its context size). transformers switches per forward
            # by the longest sequence in it, which would make a token depend on its batch; the two agree
            # whenever the served length is at most the original one, or the prompt is longer.
            long = served > s["original_max_position_embeddings"]
            ext = torch.tensor(s["long_factor" if long else "short_factor"], device=self.powers.device)
            inv_freq, scale = 1.0 / (ext * self.powers), s["attention_factor"]
        freqs = torch.outer(torch.arange(positions, dtype=torch.float32, device=self.powers.device), inv_freq)
        return freqs.cos() * scale, freqs.sin() * scale

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Tables are kept in float32 and cast once per step (as transformers casts per layer)."""
        return self.cos[positions].to(dtype), self.sin[positions].to(dtype)


def _yarn_inv_freq(powers: torch.Tensor, base: float, s: dict) -> torch.Tensor:
    """YaRN's frequencies (as in transformers): each pair's own where it turns often over the original
    positions (more than beta_fast times), stretched by the factor where it turns rarely (fewer than
    beta_slow), and a linear ramp between the two. ``powers``: base^(2i/D)."""
    dim, original, factor = 2 * len(powers), s["original_max_position_embeddings"], s["factor"]

    def dim_of(rotations: float) -> float:  # the dimension that turns ``rotations`` times over the original
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = dim_of(s["beta_fast"]), dim_of(s["beta_slow"])
    if s["truncate"]:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # (transformers' guard against a zero-width ramp)
    ramp = ((torch.arange(dim // 2, dtype=torch.float32, device=powers.device) - low) / (high - low)).clamp(0, 1)
    own = 1 - ramp  # the share of each pair's own frequency
    return 1.0 / (factor * powers) * (1 - own) + 1.0 / powers * own


def _llama3_inv_freq(inv_freq: torch.Tensor, s: dict) -> torch.Tensor:
    """Llama 3.1's frequency-dependent RoPE stretch (as in transformers)."""
    factor, low, high = float(s["factor"]), float(s["low_freq_factor"]), float(s["high_freq_factor"])
    old_len = float(s["original_max_position_embeddings"])
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)
