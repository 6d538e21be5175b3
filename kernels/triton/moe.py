"""A mixture of experts' MLPs (twin of ``kernels.reference.fused_moe``), as vLLM's fused MoE does it.

Each token's K (token, expert) pairs are sorted by expert and each expert's run padded to whole
blocks of BLOCK_M pairs (``_align``, torch ops on the device: no sync, so a decode step stays
capturable as a CUDA graph); then one grouped GEMM per projection: program (i, j) multiplies block
i's pairs, all of one expert, by that expert's weight rows j * BLOCK_N.. (``_moe_gemm_kernel``),
reading each token's row of x where it lies. gate|up, SiLU-and-mul (``activation.py``), down times
each pair's router weight in float32, and a token's K rows summed.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.reference import PACKED_BLOCKS
from kernels.triton.activation import silu_and_mul
from kernels.triton.attention_common import dot_args
from kernels.triton.launch import INDEX_DTYPES, cdiv, check_same, check_tensor, interpreting, require
from kernels.triton.linear_packed import FORMATS, _expand, _quants

BLOCK_N, BLOCK_K = 64, 32


@triton.jit
def _moe_gemm_kernel(a_ptr, b_ptr, c_ptr, weight_ptr, pairs_ptr, experts_ptr, total_ptr, num_pairs, N, K,
                     stride_a, stride_be, stride_bn, stride_c, A_ROWS_PER: tl.constexpr, MUL_WEIGHT: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr,
                     DOT_F32: tl.constexpr, FMT: tl.constexpr = -1, BLOCK_BYTES: tl.constexpr = 0,
                     QUANTS: tl.constexpr = 0):
    """C[p, j * BLOCK_N..] = A[p // A_ROWS_PER] B[e]^T for the pairs p of block i (program (i, j)), e
    their expert; padding pairs (ids num_pairs and up) are skipped. MUL_WEIGHT: rounded to A's dtype,
    then times the pair's weight, in float32 (C float32). FMT (``linear_packed.FORMATS``; -1: B in A's
    dtype): B's rows are blocks in that format (strides in bytes; BLOCK_K 32, K whole blocks), each
    expanded in registers and rounded to A's dtype, as ``linear_packed`` does."""
    block = tl.program_id(0)
    if block * BLOCK_M >= tl.load(total_ptr):
        return
    pairs = tl.load(pairs_ptr + block * BLOCK_M + tl.arange(0, BLOCK_M))
    ok = pairs < num_pairs
    expert = tl.load(experts_ptr + block).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    dtype = a_ptr.dtype.element_ty
    a_rows = a_ptr + (pairs // A_ROWS_PER).to(tl.int64)[:, None] * stride_a  # (BLOCK_M, 1)
    b_rows = b_ptr + expert * stride_be + cols.to(tl.int64) * stride_bn  # (BLOCK_N,)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < K
        a = tl.load(a_rows + ks[None, :], mask=ok[:, None] & k_ok[None, :], other=0.0)  # (BLOCK_M, BLOCK_K)
        if FMT >= 0:
            b = _expand(b_rows, k0 // 32, col_ok, FMT, BLOCK_BYTES, QUANTS).to(dtype)  # (32, BLOCK_N)
        else:
            b = tl.load(b_rows[None, :] + ks[:, None], mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        if DOT_F32:  # the interpreter (``attention_common.dot_args``)
            acc += tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision=PRECISION)
        else:
            acc += tl.dot(a, b, input_precision=PRECISION)
    c = c_ptr + pairs.to(tl.int64)[:, None] * stride_c + cols[None, :]
    if MUL_WEIGHT:  # as the reference: the product in A's dtype, then times the weight in float32
        w = tl.load(weight_ptr + pairs, mask=ok, other=0.0)
        tl.store(c, acc.to(dtype).to(tl.float32) * w[:, None], mask=ok[:, None] & col_ok[None, :])
    else:
        tl.store(c, acc.to(dtype), mask=ok[:, None] & col_ok[None, :])


def _align(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The (token, slot) pairs (ids t * K + slot) sorted by expert, each expert's run padded with the
    id T K to whole blocks of ``block_m``: (pairs (blocks * block_m,), each block's expert (blocks,),
    the pairs used, padding included (1,)). ``blocks`` is an upper bound, fixed by the shapes alone;
    the blocks past the used ones are skipped by the kernel."""
    flat = topk_ids.reshape(-1).long()
    n, dev = flat.numel(), flat.device
    counts = torch.zeros(num_experts, dtype=torch.int64, device=dev).index_add_(
        0, flat, torch.ones_like(flat))  # (not bincount: on CUDA it reads its size back)
    padded = (counts + block_m - 1) // block_m * block_m
    ends = padded.cumsum(0)
    order = torch.argsort(flat, stable=True)
    by_expert = flat[order]
    rank = torch.arange(n, device=dev) - (counts.cumsum(0) - counts)[by_expert]  # each pair's place in its run
    blocks = cdiv(n, block_m) + min(n, num_experts)  # at most one part-filled block per expert used
    pairs = torch.full((blocks * block_m,), n, dtype=torch.int32, device=dev)
    pairs[(ends - padded)[by_expert] + rank] = order.to(torch.int32)
    starts = torch.arange(blocks, device=dev) * block_m
    experts = torch.searchsorted(ends, starts, right=True).clamp_(max=num_experts - 1).to(torch.int32)
    return pairs, experts, ends[-1:]


def _gemm(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, pairs: torch.Tensor, experts: torch.Tensor,
          total: torch.Tensor, num_pairs: int, rows_per: int, block_m: int, weights: torch.Tensor | None,
          fmt: str | None, k: int) -> None:
    n = b.shape[1]
    packed = {} if fmt is None else dict(FMT=FORMATS[fmt], BLOCK_BYTES=PACKED_BLOCKS[fmt][1], QUANTS=_quants(fmt))
    _moe_gemm_kernel[(len(experts), cdiv(n, BLOCK_N))](
        a, b, out, weights if weights is not None else out, pairs, experts, total, num_pairs, n, k, a.stride(0),
        b.stride(0), b.stride(1), out.stride(0), A_ROWS_PER=rows_per, MUL_WEIGHT=weights is not None,
        BLOCK_M=block_m, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, **packed, **dot_args(a))


def fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor, bias13: torch.Tensor | None = None, bias2: torch.Tensor | None = None,
              act=silu_and_mul, packed: str | None = None, packed_down: str | None = None) -> torch.Tensor:
    """x (T, H); w13 (E, 2I, H); w2 (E, H, I); topk_weights (T, K) float32; topk_ids (T, K) -> (T, H).
    GPT-OSS's ``bias13`` (E, 2I), ``bias2`` (E, H) and ``act`` (the reference's ``swiglu_oai``): each pair's
    bias rows gathered and added on the device (torch: no sync), as the reference adds them. ``packed``:
    w13's rows are uint8 blocks in that format (``FORMATS``), w2's in ``packed_down`` (default the same),
    expanded in the GEMMs' registers: the weights stay packed in memory."""
    check_tensor("x", x, 2)
    check_tensor("topk_weights", topk_weights, 2, (torch.float32,))
    check_tensor("topk_ids", topk_ids, 2, INDEX_DTYPES)
    require(packed is not None or packed_down is None, "packed_down needs packed (gate|up's format) too")
    down_fmt = packed_down or packed
    for name, w, fmt in (("w13", w13, packed), ("w2", w2, down_fmt)):
        check_tensor(name, w, 3, (x.dtype,) if fmt is None else (torch.uint8,))
        require(fmt is None or fmt in FORMATS, f"unknown packed format {fmt!r}; known: {', '.join(FORMATS)}")
    check_same("device", ["x", "w13", "w2", "topk_weights", "topk_ids"],
               [x.device, w13.device, w2.device, topk_weights.device, topk_ids.device])
    t, h = x.shape
    e, i2 = w13.shape[:2]
    i = i2 // 2
    require(i2 % 2 == 0, f"w13 must hold each expert's gate and up rows (2I), got {i2} rows")
    want13, want2 = (e, i2, _row(packed, h, "the hidden size")), (e, h, _row(down_fmt, i, "the experts' width"))
    require(tuple(w13.shape) == want13, f"w13 must be {_shape(want13, packed)}, got {tuple(w13.shape)}")
    require(tuple(w2.shape) == want2, f"w2 must be {_shape(want2, down_fmt)}, got {tuple(w2.shape)}")
    for name, bias, want in (("bias13", bias13, (e, i2)), ("bias2", bias2, (e, h))):
        if bias is not None:
            check_tensor(name, bias, 2, (x.dtype,))
            require(tuple(bias.shape) == want, f"{name} must be {want}, got {tuple(bias.shape)}")
    require(topk_ids.shape == topk_weights.shape and topk_ids.shape[0] == t,
            f"topk_ids and topk_weights must both be ({t}, K), got {tuple(topk_ids.shape)} and "
            f"{tuple(topk_weights.shape)}")
    k = topk_ids.shape[1]
    if t == 0 or k == 0:
        return torch.zeros_like(x)
    num_pairs = t * k
    block_m = 16 if interpreting() or num_pairs <= 16 * e else 64  # decode: few pairs per expert
    pairs, experts, total = _align(topk_ids, e, block_m)
    gate_up = torch.empty(num_pairs, i2, dtype=x.dtype, device=x.device)
    _gemm(x, w13, gate_up, pairs, experts, total, num_pairs, k, block_m, None, packed, h)
    flat = topk_ids.reshape(-1).long()  # each pair's expert (pair p = token p // K, slot p % K)
    if bias13 is not None:
        gate_up += bias13[flat]
    hidden = act(gate_up)  # (T K, I)
    weights = topk_weights.reshape(-1).contiguous()
    if bias2 is None:
        down = torch.empty(num_pairs, h, dtype=torch.float32, device=x.device)
        _gemm(hidden, w2, down, pairs, experts, total, num_pairs, 1, block_m, weights, down_fmt, i)
    else:  # the bias joins the product before the weighting
        down = torch.empty(num_pairs, h, dtype=x.dtype, device=x.device)
        _gemm(hidden, w2, down, pairs, experts, total, num_pairs, 1, block_m, None, down_fmt, i)
        down = (down + bias2[flat]).float() * weights[:, None]
    return down.view(t, k, h).sum(1).to(x.dtype)


def _row(fmt: str | None, k: int, what: str) -> int:
    """A weight row's last dimension: ``k`` values, or their bytes packed in ``fmt``."""
    if fmt is None:
        return k
    weights, size = PACKED_BLOCKS[fmt]
    require(k % weights == 0, f"packed experts in {fmt} need {what} in whole blocks of {weights}, got {k}")
    return k // weights * size


def _shape(want: tuple[int, ...], fmt: str | None) -> str:
    return str(want) if fmt is None else f"{want}, uint8 rows of {fmt} blocks"
