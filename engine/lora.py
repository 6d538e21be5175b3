"""LoRA adapters served beside the base model (vLLM's ``--lora-modules``): a request names one by
its ``model`` (or none: the base model), and one batch mixes them.

An adapter is PEFT's folder (``adapter_config.json``, ``adapter_model.safetensors``): for some linear
layers W, matrices A (r, in) and B (out, r) and a scale s (lora_alpha / r; / sqrt(r) with rsLoRA), the
layer computing y = x W^T + s (x A^T) B^T.

Decision: every adapter is kept on the device in a slot of its own, and each layer an adapter targets
adds every slot's product in two small GEMMs over the step's tokens, each token's row masked to its
own slot (``LoraWeights``)::

    y += where(mine[:, :, None], (x @ A_all).view(T, S, P * R), 0).view(T, -1) @ B_all

A_all (in, S*P*R) holds each slot's A^T for each of the layer's fused parts (P: q|k|v is 3) padded to
R columns (the adapters' largest rank); B_all (S*P*R, out) the scaled B^T, each part's rows at its
columns of the fused output (``where``, not a product with a one-hot row: a slot's inf must not become
another token's NaN). CUDA graphs capture it as it is, with every slot (``mine`` is a persistent
buffer the runner fills before each step), no request waits for a slot, and there is no loop over
adapters. The price is arithmetic for the slots: a step computes the first ``LoraState.span`` of them,
up to the last one its tokens use (CPU graphs keep a recording for each span; a CUDA graph computes
all S), P*R columns each beside the layer's own (vLLM swaps adapters into ``--max-loras`` slots
instead: less arithmetic, and requests wait for a slot). A token without an adapter has a row of
zeros: its output is the base model's, bit for bit; a step in which no token has one skips the products
(span 0; CUDA graphs add the zeros).

Adapters come with the engine (``lora_modules``: slot i for the i-th, and the layers they target get
slots) or, with ``max_loras`` slots, while it serves (``put``, into a slot the engine picks): then every
attention and MLP projection gets slots at ``max_lora_rank``, and loading one is a copy into tensors
graphs already read.

Under tensor parallelism a rank keeps its rows of B (column-parallel layers) or its columns of A
(row-parallel ones: each rank's partial product joins the all-reduce the layer does anyway).
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass

import torch
from torch import nn

import kernels

ADAPTER_CONFIG, ADAPTER_WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
# a LoRA tensor's name in PEFT's files: layer, module (self_attn.q_proj), A or B (an adapter name
# between them in some saves)
_KEY = re.compile(r"(?:base_model\.model\.)?(?:model\.)?layers\.(\d+)\.(.+)\.lora_([AB])(?:\.[\w-]+)?\.weight")
_PARTS = {  # a checkpoint module -> (the model's layer holding it, its part there; None: every part)
    "self_attn.q_proj": ("self_attn.qkv_proj", 0), "self_attn.k_proj": ("self_attn.qkv_proj", 1),
    "self_attn.v_proj": ("self_attn.qkv_proj", 2), "self_attn.qkv_proj": ("self_attn.qkv_proj", None),
    "self_attn.o_proj": ("self_attn.o_proj", 0), "mlp.gate_proj": ("mlp.gate_up_proj", 0),
    "mlp.up_proj": ("mlp.gate_up_proj", 1), "mlp.gate_up_proj": ("mlp.gate_up_proj", None),
    "mlp.down_proj": ("mlp.down_proj", 0),
}


class AdapterError(ValueError):
    """An adapter folder this server cannot serve, and why."""


@dataclass
class Adapter:
    name: str
    rank: int  # the largest of its modules'
    # (layer, checkpoint module such as "self_attn.q_proj") -> (A (r, in), B (out, r) times the scale)
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]


def read_adapter(name: str, path: str, max_rank: int, dtype: torch.dtype = torch.float32) -> Adapter:
    """A PEFT LoRA folder, checked: refused (``AdapterError``) if it is not plain LoRA on the attention and
    MLP projections, a module's rank passes ``max_rank``, or a weight (B times its scale) is no number of the
    model's ``dtype``."""
    from safetensors.torch import load_file

    def refuse(why: str) -> AdapterError:
        return AdapterError(f"LoRA adapter {name!r} ({path}): {why}")

    try:
        with open(os.path.join(path, ADAPTER_CONFIG)) as f:
            cfg = json.load(f)
    except (OSError, ValueError) as e:
        raise refuse(f"no readable {ADAPTER_CONFIG} ({e})") from None
    if not isinstance(cfg, dict):
        raise refuse(f"{ADAPTER_CONFIG} is not a JSON object")
    if cfg.get("peft_type", "LORA") != "LORA":
        raise refuse(f"a {cfg['peft_type']} adapter; only LoRA is served")
    for key, why in (("use_dora", "DoRA"), ("modules_to_save", "whole modules saved beside the adapter"),
                     ("fan_in_fan_out", "fan_in_fan_out weights (GPT-2's Conv1D)")):
        if cfg.get(key):
            raise refuse(f"{why} ({key}) is not supported")
    if cfg.get("bias", "none") != "none":
        raise refuse(f"trained biases (bias={cfg['bias']!r}) are not supported")
    weights = os.path.join(path, ADAPTER_WEIGHTS)
    if not os.path.exists(weights):
        raise refuse(f"no {ADAPTER_WEIGHTS} (adapters saved as .bin are not read: save with safetensors)")
    try:
        tensors = load_file(weights)
    except Exception as e:  # noqa: BLE001 - safetensors' own error types: a truncated or foreign file
        raise refuse(f"{ADAPTER_WEIGHTS} cannot be read ({type(e).__name__}: {e})") from None
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, t in tensors.items():
        m = _KEY.fullmatch(key)
        if m is None or m[2] not in _PARTS:
            raise refuse(f"{key}: LoRA is served on the attention and MLP projections only (not on embeddings, "
                         "the LM head or a mixture's experts)")
        pairs.setdefault((int(m[1]), m[2]), {})[m[3]] = t
    if not pairs:
        raise refuse(f"{ADAPTER_WEIGHTS} holds no LoRA weights")
    out, rank, limit = {}, 0, torch.finfo(dtype).max
    for (layer, module), ab in sorted(pairs.items()):
        if set(ab) != {"A", "B"}:
            raise refuse(f"layer {layer} {module}: lora_A and lora_B must both be there")
        a, b = ab["A"], ab["B"]
        r = a.shape[0] if a.dim() else 0  # (a scalar has no rows: review, an IndexError and a 500)
        if a.dim() != 2 or b.dim() != 2 or b.shape[1] != r or r == 0:
            raise refuse(f"layer {layer} {module}: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} are no LoRA "
                         "of rank 1 or more")
        if r > max_rank:
            raise refuse(f"rank {r} passes --max-lora-rank {max_rank}")
        full = f"model.layers.{layer}.{module}"
        # the rank the config says (PEFT builds that, and refuses tensors of another; the scale is alpha over it)
        try:
            alpha = _pattern(cfg.get("alpha_pattern"), full, cfg.get("lora_alpha", 8))  # (PEFT's default alpha)
            said = _pattern(cfg.get("rank_pattern"), full, cfg.get("r", r))
        except (AttributeError, re.error) as e:
            raise refuse(f"{ADAPTER_CONFIG}'s alpha_pattern or rank_pattern is no map of regular expressions "
                         f"({e})") from None
        if said != r:
            raise refuse(f"layer {layer} {module}: {ADAPTER_CONFIG} says rank {said!r}, its tensors are of rank {r}")
        if isinstance(alpha, bool) or not isinstance(alpha, int | float):
            raise refuse(f"{ADAPTER_CONFIG}: the alpha of {full} is {alpha!r}, not a number")
        scale = alpha / math.sqrt(r) if cfg.get("use_rslora") else alpha / r
        a, b = a.float(), b.float() * scale
        if not all(t.abs().max() <= limit for t in (a, b) if t.numel()):  # (False for a NaN too)
            raise refuse(f"layer {layer} {module}: lora_A or lora_B (times its scale, {scale:g}) holds a NaN or a "
                         f"value past {str(dtype).removeprefix('torch.')}'s largest")
        out[layer, module] = (a, b)
        rank = max(rank, r)
    return Adapter(name, rank, out)


def _module(layer: nn.Module, name: str) -> nn.Module | None:
    try:
        return layer.get_submodule(name)
    except AttributeError:
        return None


def _pattern(patterns: dict | None, module: str, default):
    """PEFT's per-module override: the first key that names the end of ``module`` (a regex)."""
    for key, value in (patterns or {}).items():
        if re.match(rf"(.*\.)?({key})$", module):
            return value
    return default


class LoraState:
    """Which slot is each of the step's tokens', that every ``LoraWeights`` reads: a persistent (rows, slots)
    buffer of booleans (rows: the most tokens a step has), which the runner fills before each forward (graphs
    read it where they were captured); and the weights' dtype."""

    def __init__(self, slots: int, rows: int, dtype: torch.dtype, device: torch.device):
        self.mine = torch.zeros(rows, slots, dtype=torch.bool, device=device)
        self.slots = torch.arange(slots, device=device)
        self.dtype = dtype
        # the leading slots the step's products cover, up to the last one a token of the step uses (the host
        # knows); 0: no token has an adapter, and the layers skip the products. CPU graphs keep a recording for
        # each span; CUDA graphs are captured with every slot
        self.span = slots

    def set(self, token_slots: torch.Tensor) -> None:
        """Each of the step's tokens' slot (-1: none), (T,) on the device."""
        t = len(token_slots)
        if t > self.mine.shape[0]:
            raise ValueError(f"a step of {t} tokens, but LoRA's rows were sized for {self.mine.shape[0]}")
        self.mine[:t] = token_slots[:, None] == self.slots

    def rows(self, t: int) -> torch.Tensor:
        return self.mine[:t]


class LoraWeights(nn.Module):
    """One linear layer's adapters, in the model's dtype: A_all^T (S*P*R, in), kept as linear layers' weights
    are and multiplied by ``kernels.linear`` as the layer's own weight is (on the CPU the C kernel for few rows),
    and B_all (S*P*R, out), so that the first slots' rows are a matrix of their own, added by torch's addmm (in
    batch-invariant mode by ``kernels.linear`` too, on B's transpose)."""

    def __init__(self, in_features: int, out_sizes: list[int], rank: int, state: LoraState):
        super().__init__()
        self.rank, self.out_sizes, self.state = rank, out_sizes, state
        self.width = len(out_sizes) * rank  # a slot's rows of A and B
        like = dict(dtype=state.dtype, device=state.mine.device)
        self.a = nn.Parameter(torch.zeros(len(state.slots) * self.width, in_features, **like), requires_grad=False)
        self.b = nn.Parameter(torch.zeros(len(state.slots) * self.width, sum(out_sizes), **like), requires_grad=False)

    def put(self, slot: int, part: int, a: torch.Tensor, b: torch.Tensor) -> None:
        """Slot ``slot``'s part ``part``: ``a`` (r, in) and ``b`` (out of that part, r), this rank's share."""
        r = a.shape[0]
        col = slot * self.width + part * self.rank
        first = sum(self.out_sizes[:part])
        self.a[col:col + r].copy_(a)
        self.b[col:col + r, first:first + b.shape[0]].copy_(b.T)

    def spans(self) -> list[torch.Tensor]:
        """A as ``forward`` multiplies it by ``kernels.linear`` for each span: the shapes to tune (copies: the
        tuner measures each tensor once)."""
        return [self.a[:n * self.width].clone() for n in range(1, len(self.state.slots) + 1)]

    def clear(self, slot: int) -> None:
        rows = slice(slot * self.width, (slot + 1) * self.width)
        self.a[rows].zero_()
        self.b[rows].zero_()

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """``y`` (T, out), the layer's output for ``x`` (T, in), plus each token's adapter's product."""
        span = self.state.span
        if not span:
            return y
        t, rows = x.shape[0], span * self.width
        u = torch.where(self.state.rows(t)[:, :span, None], kernels.linear(x, self.a[:rows]).view(t, span, -1), 0)
        if kernels.batch_invariant() and x.is_cpu:  # a row's sum as the C kernel makes it: the step's rows and
            return y.add_(kernels.linear(u.view(t, -1), self.b[:rows].T))  # span (zeros at its end) change nothing
        return y.addmm_(u.view(t, -1), self.b[:rows])


def attach(model: nn.Module, adapters: list[Adapter], rank: int, state: LoraState,
           every_layer: bool = False) -> dict[tuple[int, str], nn.Module]:
    """Give each linear layer some adapter targets ``LoraWeights`` (``lora``), and put adapter i in slot i (its
    share of each layer under tensor parallelism). ``every_layer``: every attention and MLP projection gets
    them, for adapters loaded later (``put``). Returns the layers that have them, by (layer, module)."""
    from engine.models.layers import ColumnLinear, RowLinear

    wanted = {(layer, _PARTS[module][0]) for a in adapters for layer, module in a.weights}
    if every_layer:
        wanted |= {(i, name) for i, layer in enumerate(model.layers) for name, _ in _PARTS.values()
                   if isinstance(_module(layer, name), ColumnLinear | RowLinear)}
    targets = {}  # (layer, the model's module) -> that linear layer
    for layer, name in sorted(wanted):
        if layer >= len(model.layers):
            raise AdapterError(f"LoRA adapter for layer {layer}, but the model has {len(model.layers)} layers")
        target = _module(model.layers[layer], name)
        if not isinstance(target, ColumnLinear | RowLinear):
            raise AdapterError(f"LoRA adapter for layer {layer}'s {name}, which is no plain linear layer here (a "
                               "mixture of experts' layer takes no LoRA)")
        out_sizes = target.out_sizes if isinstance(target, ColumnLinear) else [target.out_features]
        in_features = target.in_features if isinstance(target, ColumnLinear) else target.in_per_rank
        target.lora = LoraWeights(in_features, out_sizes, rank, state)
        targets[layer, name] = target
    for slot, adapter in enumerate(adapters):
        put(targets, slot, adapter)
    return targets


def put(targets: dict[tuple[int, str], nn.Module], slot: int, adapter: Adapter) -> None:
    """``adapter`` into ``slot`` of ``targets`` (``attach``'s), in place of whatever the slot held (graphs read
    the same tensors); ``AdapterError`` if it does not fit the model, the slot then left empty."""
    for target in targets.values():
        target.lora.clear(slot)
    try:
        _put(targets, slot, adapter)
    except AdapterError as e:
        for target in targets.values():
            target.lora.clear(slot)
        raise AdapterError(f"LoRA adapter {adapter.name!r}: {e}") from None


def _put(targets: dict[tuple[int, str], nn.Module], slot: int, adapter: Adapter) -> None:
    from engine.models.layers import RowLinear

    for (layer, module), (a, b) in adapter.weights.items():
        name, part = _PARTS[module]
        target = targets.get((layer, name))
        if target is None:
            raise AdapterError(f"layer {layer}'s {name} takes no LoRA here (no such layer, or a mixture of experts' "
                               "layer)")
        if adapter.rank > target.lora.rank:
            raise AdapterError(f"rank {adapter.rank} passes the slots' {target.lora.rank}")
        if isinstance(target, RowLinear):
            if a.shape[1] != target.in_per_rank * target.tp.size or b.shape[0] != target.out_features:
                raise AdapterError(f"layer {layer} {module}'s lora_A and lora_B are {tuple(a.shape)} and "
                                   f"{tuple(b.shape)}, for a layer of {target.in_per_rank * target.tp.size} inputs "
                                   f"and {target.out_features} outputs")
            a = a.narrow(1, target.tp.rank * target.in_per_rank, target.in_per_rank)
            target.lora.put(slot, 0, a, b)
            continue
        if a.shape[1] != target.in_features:
            raise AdapterError(f"layer {layer} {module}'s lora_A has {a.shape[1]} columns, the model's layer "
                               f"{target.in_features}")
        parts = range(len(target.full_sizes)) if part is None else [part]
        want = sum(target.full_sizes[p] for p in parts)
        if b.shape[0] != want:
            raise AdapterError(f"layer {layer} {module}'s lora_B has {b.shape[0]} rows, the model's layer {want}")
        for p, rows in zip(parts, b.split([target.full_sizes[p] for p in parts]), strict=True):
            target.lora.put(slot, p, a, rows.narrow(0, target.starts[p], target.out_sizes[p]))
