"""Building blocks shared by the models: linear layers that know how they would
shard across tensor-parallel ranks, RMSNorm, rotary embedding.

Weights are allocated uninitialised and filled by the loader through each
layer's ``load`` method, which is where fusing (q|k|v, gate|up) and, later,
tensor-parallel slicing happen.
"""

from __future__ import annotations

import math

import torch
from torch import nn

import kernels


def _empty(*shape: int) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape), requires_grad=False)


class ColumnLinear(nn.Module):
    """y = x W^T (+ b), W = [W_0; W_1; ...] fused along the output dim.

    Under tensor parallelism each rank keeps a slice of every part's rows
    (``tp_rank``/``tp_size``), so outputs stay split and no communication is needed.
    """

    def __init__(self, in_features: int, out_sizes: list[int], bias: bool = False,
                 tp_rank: int = 0, tp_size: int = 1):
        super().__init__()
        assert all(s % tp_size == 0 for s in out_sizes)
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.out_sizes = [s // tp_size for s in out_sizes]
        self.weight = _empty(sum(self.out_sizes), in_features)
        self.bias = _empty(sum(self.out_sizes)) if bias else None

    def load(self, part: int, tensor: torch.Tensor, kind: str = "weight") -> None:
        """Copy this rank's rows of part ``part`` (``kind`` "weight" or "bias")."""
        n = self.out_sizes[part]
        start = sum(self.out_sizes[:part])
        getattr(self, kind)[start:start + n].copy_(tensor.narrow(0, self.tp_rank * n, n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.linear(x, self.weight, self.bias)


class RowLinear(nn.Module):
    """y = x W^T with W split along the input dim under tensor parallelism
    (each rank's partial sums are then all-reduced by the caller's group)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False,
                 tp_rank: int = 0, tp_size: int = 1):
        super().__init__()
        assert in_features % tp_size == 0
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.in_per_rank = in_features // tp_size
        self.weight = _empty(out_features, self.in_per_rank)
        self.bias = _empty(out_features) if bias else None

    def load(self, tensor: torch.Tensor, kind: str = "weight") -> None:
        if kind == "weight":
            tensor = tensor.narrow(1, self.tp_rank * self.in_per_rank, self.in_per_rank)
        getattr(self, kind).copy_(tensor)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = nn.functional.linear(x, self.weight)
        # TODO(tensor parallel): all_reduce(y) here when tp_size > 1.
        return y if self.bias is None else y + self.bias


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = _empty(dim)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """With ``residual``: returns (norm(x + residual), x + residual), the fused pre-norm step."""
        if residual is None:
            return kernels.rms_norm(x, self.weight, self.eps)
        return kernels.fused_add_rms_norm(x, residual, self.weight, self.eps)


class RotaryEmbedding(nn.Module):
    """cos/sin tables for every position, indexed once per forward and shared by all layers."""

    def __init__(self, head_dim: int, max_positions: int, theta: float, scaling: dict | None):
        super().__init__()
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
        if scaling and scaling["rope_type"] == "llama3":
            inv_freq = _llama3_inv_freq(inv_freq, scaling)
        elif scaling and scaling["rope_type"] == "linear":
            inv_freq = inv_freq / float(scaling["factor"])
        t = torch.arange(max_positions, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq)  # (P, D/2)
        self.register_buffer("cos", freqs.cos(), persistent=False)
        self.register_buffer("sin", freqs.sin(), persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Tables are kept in float32 and cast once per step (as transformers casts per layer)."""
        return self.cos[positions].to(dtype), self.sin[positions].to(dtype)


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
