"""A mixture of experts' MLP (Mixtral, Qwen2-MoE, Qwen3-MoE, GPT-OSS): a router picks each token's top-k
experts and ``kernels.fused_moe`` runs them. GPT-OSS's router and experts have biases, and its experts'
activation is a clamped SwiGLU (``MoEConfig.swiglu``).

Under tensor parallelism every rank keeps a 1/T slice of every expert's width (its rows of gate and
up, its columns of down), as ``GatedMLP`` splits its one width, so each rank computes a partial sum
for every token and one all-reduce adds them up; the router is replicated (every rank routes alike).
"""

from __future__ import annotations

import functools

import torch
from torch import nn

import kernels
from engine.models.config import ModelConfig
from engine.models.layers import GatedMLP
from engine.parallel import TPGroup


class Experts(nn.Module):
    """The experts' weights, stacked: ``w13`` (E, 2 W, H) each expert's gate|up rows of this rank, ``w2`` (E, H, W)
    its columns of down, W = ``width`` of the experts' width I from ``first`` on (I/T, or packed a share of whole
    blocks: ``pack``); with ``biases`` (GPT-OSS) ``b13`` (E, 2 W) gate|up's biases of this rank and ``b2`` (E, H)
    down's, which rank 0 alone holds (the others' zeros: the all-reduce adds it once)."""

    PARTS = ("gate_proj", "up_proj", "down_proj")
    packed: str | None = None  # kept as a GGUF file's blocks (``pack``): gate|up's format
    packed_down: str | None = None  # ...and down's

    def __init__(self, num_experts: int, hidden: int, intermediate: int, tp: TPGroup, biases: bool = False):
        super().__init__()
        assert intermediate % tp.size == 0
        self.tp, self.intermediate = tp, intermediate
        self.width = intermediate // tp.size
        self.first = tp.rank * self.width
        self.w13 = nn.Parameter(torch.empty(num_experts, 2 * self.width, hidden), requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden, self.width), requires_grad=False)
        self.b13 = nn.Parameter(torch.empty(num_experts, 2 * self.width), requires_grad=False) if biases else None
        self.b2 = nn.Parameter(torch.zeros(num_experts, hidden), requires_grad=False) if biases else None

    def packable(self, down: str) -> bool:
        """Whether down can be kept in format ``down``: the width whole blocks, at least one a rank."""
        size = kernels.reference.PACKED_BLOCKS[down][0]
        return self.intermediate % size == 0 and self.intermediate // size >= self.tp.size

    def pack(self, fmt: str, down: str | None = None) -> None:
        """Keep the weights as uint8 rows of blocks (``layers.Packable``'s form), gate|up's in ``fmt`` and
        down's in ``down`` (default: the same; ``packable``), which ``load`` then copies as they are. Under tensor
        parallelism a rank's columns of down must be whole blocks: where I/T is not (gpt-oss's 2880 over 4 ranks:
        720, 22.5 blocks of 32), the ranks share the blocks as evenly as they go (23, 23, 22, 22)."""
        (e, _, k), down = self.w13.shape, down or fmt
        if not self.packable(down):
            raise ValueError(f"the experts' width {self.intermediate} is not {self.tp.size} or more whole {down} "
                             f"blocks")
        size = kernels.reference.PACKED_BLOCKS[down][0]
        if self.width % size:
            each, more = divmod(self.intermediate // size, self.tp.size)
            rank = self.tp.rank
            self.first, self.width = size * (rank * each + min(rank, more)), size * (each + (rank < more))
            if self.b13 is not None:
                self.b13 = nn.Parameter(torch.empty(e, 2 * self.width, dtype=self.b13.dtype, device=self.b13.device),
                                        requires_grad=False)
        row_bytes = kernels.reference.packed_row_bytes
        device = self.w13.device
        self.w13 = nn.Parameter(torch.empty(e, 2 * self.width, row_bytes(fmt, k), dtype=torch.uint8, device=device),
                                requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(e, self.w2.shape[1], row_bytes(down, self.width), dtype=torch.uint8,
                                           device=device), requires_grad=False)
        self.packed, self.packed_down = fmt, down

    def load(self, expert: int | slice, part: int, tensor: torch.Tensor) -> None:
        """Part ``part`` (0 gate, 1 up: (I, H); 2 down: (H, I)) of one expert, or with ``expert`` a slice
        of all of them at once (tensors with the experts first)."""
        first, n, full, unit = self.first, self.width, self.intermediate, ""  # gate's, up's rows; down's columns
        if part == 2 and self.packed_down is not None:  # ...packed: bytes of whole blocks
            first, n, full = (kernels.reference.packed_row_bytes(self.packed_down, c) for c in (first, n, full))
            unit = f" bytes of {self.packed_down} blocks"
        dim = -2 if part < 2 else -1
        if tensor.shape[dim] != full:
            raise ValueError(f"an expert's {self.PARTS[part]} is {full}{unit} wide in this model's config, "
                             f"got a tensor of shape {tuple(tensor.shape)}")
        if part < 2:
            self.w13[expert, part * n:(part + 1) * n].copy_(tensor.narrow(-2, first, n))
        else:
            self.w2[expert].copy_(tensor.narrow(-1, first, n))

    def load_bias(self, part: int, tensor: torch.Tensor) -> None:
        """Every expert's bias of part ``part`` (0 gate, 1 up: (E, I); 2 down: (E, H))."""
        want = self.b13.shape[0], (self.intermediate if part < 2 else self.b2.shape[1])
        if tuple(tensor.shape) != want:
            raise ValueError(f"the experts' {self.PARTS[part]} biases must be {want} in this model's config, got a "
                             f"tensor of shape {tuple(tensor.shape)}")
        if part < 2:
            self.b13[:, part * self.width:(part + 1) * self.width].copy_(tensor.narrow(-1, self.first, self.width))
        elif self.tp.rank == 0:
            self.b2.copy_(tensor)


class SparseMoE(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TPGroup):
        super().__init__()
        moe = cfg.moe
        self.tp, self.top_k, self.renormalize = tp, moe.top_k, moe.renormalize
        self.gate = _Weight(moe.num_experts, cfg.hidden_size, bias=moe.swiglu is not None)  # the router, every rank's
        self.experts = Experts(moe.num_experts, cfg.hidden_size, moe.intermediate_size, tp, moe.swiglu is not None)
        self.act = None if moe.swiglu is None else functools.partial(kernels.swiglu_oai, alpha=moe.swiglu[0],
                                                                     limit=moe.swiglu[1])
        self.shared_expert = self.shared_expert_gate = None
        if moe.shared_intermediate_size:  # Qwen2-MoE: one more expert every token takes, gated by a sigmoid
            self.shared_expert = GatedMLP(cfg.hidden_size, moe.shared_intermediate_size, tp)
            self.shared_expert_gate = _Weight(1, cfg.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(T, hidden) -> (T, hidden)."""
        logits = kernels.linear(x, self.gate.weight, self.gate.bias).float()  # (T, E)
        if self.act is not None:  # GPT-OSS: the softmax of the top k logits (the renormalized softmax, computed so)
            top, ids = torch.topk(logits, self.top_k, dim=-1)
            weights = torch.softmax(top, dim=-1)
        else:
            weights, ids = torch.topk(torch.softmax(logits, dim=-1), self.top_k, dim=-1)  # (T, K) each
            if self.renormalize:
                weights = weights / weights.sum(dim=-1, keepdim=True)
        e = self.experts
        out = self.tp.all_reduce(kernels.fused_moe(x, e.w13, e.w2, weights, ids, e.packed, e.packed_down, e.b13, e.b2,
                                                   self.act))
        if self.shared_expert is not None:
            gate = kernels.by_rows(torch.sigmoid, kernels.linear(x, self.shared_expert_gate.weight))  # (T, 1)
            out = out + gate * self.shared_expert(x)
        return out


class _Weight(nn.Module):
    """A bare (N, K) weight (and an (N,) bias), replicated on every rank."""

    def __init__(self, n: int, k: int, bias: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(n, k), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(n), requires_grad=False) if bias else None
