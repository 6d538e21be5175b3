"""AWQ and GPTQ int4 checkpoints: each quantized layer's tensors turned into the weight the
model's linear layer holds.

Such a checkpoint stores a linear layer (y = x W^T, W of N rows by K input columns) as
``qweight`` (int32 words of eight 4-bit integers q), ``qzeros`` (the zero points z, packed the
same way), ``scales`` (s; fp16) — one z and one s per output row and group of ``group_size``
input columns — and for GPTQ ``g_idx`` (each input column's group). A weight is ``s (q - z)``.

- AWQ (AutoAWQ's GEMM layout): qweight (K, N / 8), eight output rows to a word, in the order
  0 2 4 6 1 3 5 7; qzeros (K / G, N / 8) likewise; scales (K / G, N).
- GPTQ: qweight (K / 8, N), eight input columns to a word, in order; qzeros (K / G, N / 8) in
  order, stored minus one in the original format (``QuantConfig.zero_offset``); scales (K / G, N);
  g_idx (K).

A layer whose groups are whole blocks of 32 columns (``packs``) becomes Q4_Z blocks
(``kernels.reference.dequantize``: a block's scale and zero point as fp16, then its 32 integers):
5 bits a weight against AWQ's ~4.25, every weight exact, multiplied as it is by the CPU's and
Triton's packed kernels. Act-order GPTQ's groups are scattered over the columns: its columns are
kept sorted by group (``permutation``), and the layer gathers its input in that order. Any other
(groups of 16, act-order split over tensor-parallel ranks) is expanded to floats at load.

GPT-OSS's experts come in MXFP4: kept so where a kernel reads it (``mxfp4_to_packed``, 4.25 bits a weight: the
CPU's C kernel, Triton's fused MoE), else widened to the model's dtype at load (``mxfp4_to_float``).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from engine.models.config import QuantConfig
from kernels.reference import dequantize


def mxfp4_to_float(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """An MXFP4 weight widened (exactly, as transformers widens it): ``blocks`` (..., N, G, 16) uint8, each
    byte two FP4 values (the low nibble first), a block of 32 values along the input sharing ``scales``
    (..., N, G) uint8, a power of two's exponent plus 127. Returns (..., N, 32 G) in ``dtype``: the packed
    form's values (``kernels.reference.dequantize``, the one place MXFP4's values are defined)."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8 or blocks.shape[:-1] != scales.shape \
            or blocks.shape[-1] != 16:
        raise ValueError(f"MXFP4 blocks (..., G, 16) and scales (..., G), uint8, got {tuple(blocks.shape)} "
                         f"{blocks.dtype} and {tuple(scales.shape)} {scales.dtype}")
    packed = mxfp4_to_packed(blocks, scales)
    values = dequantize(packed.reshape(-1, packed.shape[-1]), "mxfp4")  # (rows, 32 G) float32
    return values.view(*blocks.shape[:-2], -1).to(dtype)


def mxfp4_to_packed(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The same MXFP4 weight as rows of ggml's blocks (``kernels.reference.PACKED_BLOCKS["mxfp4"]``: the scale
    byte, then value j in the low half of byte j and value j + 16 in its high half), which the CPU's packed kernel
    multiplies as they are: (..., N, G, 16), (..., N, G) -> (..., N, 17 G) uint8, the same values."""
    values = torch.stack([blocks & 0x0F, blocks >> 4], dim=-1).flatten(-2)  # (..., G, 32), in order
    return torch.cat([scales[..., None], values[..., :16] | values[..., 16:] << 4], dim=-1).flatten(-2)


FORMAT = "q4_z"  # the packed format a quantized layer is kept in
PARTS = ("qweight", "qzeros", "scales", "g_idx")
_AWQ_UNDO = [0, 4, 1, 5, 2, 6, 3, 7]  # output row j of a word sits at nibble _AWQ_UNDO[j]
_SHIFTS = torch.arange(0, 32, 4, dtype=torch.int32)


def packs(q: QuantConfig, k: int, scales: torch.Tensor | None = None, g_idx: torch.Tensor | None = None,
          permutable: bool = True) -> bool:
    """Whether a layer of ``k`` input columns can be kept as Q4_Z blocks: its groups are whole blocks
    of 32 in column order (``g_idx``, where given, agrees), or under act-order (whose ``g_idx`` must be
    given, and the layer ``permutable``: its whole input on this rank) in the order of ``permutation``;
    and its ``scales``, where given, are float16 values (a bf16 or float32 checkpoint's may not be)."""
    group = q.group_size or k
    if k % 32 or group % 32 or q.act_order and g_idx is None:
        return False
    blocks = torch.arange(k) // group  # every group `group` columns, in order
    if g_idx is not None and not torch.equal(g_idx.long(), blocks) and not (
            q.act_order and permutable and torch.equal(g_idx.long().sort().values, blocks)):
        return False
    return scales is None or torch.equal(scales.to(torch.float16).to(scales.dtype), scales)


def permutation(g_idx: torch.Tensor) -> torch.Tensor:
    """Act-order's columns sorted by group (stable): the kept layer's column i is the checkpoint's
    column perm[i], so the layer multiplies x[..., perm]."""
    return torch.sort(g_idx.long(), stable=True).indices


def weights(stream: Iterator[tuple[str, torch.Tensor]], q: QuantConfig, names: set[str],
            packed: set[str]) -> Iterator[tuple[str, torch.Tensor]]:
    """``stream`` with each quantized layer's parts replaced by one ``PREFIX.weight``: Q4_Z rows
    (N, K / 32 * 20) uint8 for the prefixes in ``packed`` (act-order ones followed by their
    ``PREFIX.g_perm``, ``permutation``), else float32 (N, K). ``names``: every tensor name in the
    checkpoint (to know when a layer's parts are all in)."""
    pending: dict[str, dict[str, torch.Tensor]] = {}
    for name, t in stream:
        prefix, _, part = name.rpartition(".")
        if part not in PARTS:
            yield name, t
            continue
        if f"{prefix}.qweight" not in names:
            raise ValueError(f"{prefix}: qweight missing (its {part} is in the checkpoint)")
        parts = pending.setdefault(prefix, {})
        parts[part] = t
        if all(f"{prefix}.{p}" not in names or p in parts for p in PARTS):
            del pending[prefix]
            yield f"{prefix}.weight", convert(prefix, q, parts, prefix in packed)
            if prefix in packed and q.act_order:
                perm = permutation(parts["g_idx"])
                if not torch.equal(perm, torch.arange(len(perm))):  # columns already in group order: none
                    yield f"{prefix}.g_perm", perm
    if pending:
        raise ValueError(f"{next(iter(pending))}: qweight, qzeros and scales must all be in the checkpoint")


def convert(layer: str, q: QuantConfig, parts: dict[str, torch.Tensor], pack: bool) -> torch.Tensor:
    """One layer's parts -> Q4_Z rows (``pack``; act-order's columns in ``permutation``'s order) or
    float32 (N, K)."""
    ints, zeros, scales, group_of = unpack(layer, q, parts)
    if not pack:
        return ((ints - zeros[group_of]) * scales[group_of].float()).t().contiguous()  # (N, K)
    k, n = ints.shape
    group = q.group_size or k
    if not packs(q, k, scales, group_of):
        raise ValueError(f"{layer}: cannot be kept as Q4_Z blocks (its g_idx or scales say so); expand it")
    if q.act_order:
        perm = permutation(group_of)
        ints, group_of = ints[perm], group_of[perm]
    per_block = torch.arange(k // 32) * 32 // group  # each block's group
    d = scales[per_block].t().to(torch.float16)  # (N, K / 32)
    z = zeros[per_block].t().to(torch.float16)  # (N, K / 32); small integers: exact
    blocks = ints.t().reshape(n, k // 32, 32).to(torch.uint8)  # (N, K / 32, 32)
    nibbles = blocks[..., :16] | blocks[..., 16:] << 4  # weight j in the low half of byte j, j + 16 in its high
    head = torch.stack([d, z], dim=-1).view(torch.uint8)  # (N, K / 32, 4): d then z, little-endian fp16
    return torch.cat([head, nibbles], dim=-1).reshape(n, -1)


def unpack(layer: str, q: QuantConfig, parts: dict[str, torch.Tensor]
           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q (K, N), z (groups, N), s (groups, N), each column's group (K,)): q and z as float32
    integers, s as stored."""
    missing = [p for p in PARTS[:3] if p not in parts]
    if missing:
        raise ValueError(f"{layer}: {', '.join(missing)} missing")
    qweight, qzeros, scales = parts["qweight"], parts["qzeros"], parts["scales"]
    words = [f"{p} is {t.dtype}" for p, t in (("qweight", qweight), ("qzeros", qzeros)) if t.dtype != torch.int32]
    if words:  # (floats were cast to words: other weights, silently; review)
        raise ValueError(f"{layer}: {' and '.join(words)}, not int32 words of eight 4-bit integers")
    if q.method == "awq":
        k, n = qweight.shape[0], qweight.shape[1] * 8
        ints = _awq_order(_nibbles(qweight))  # (K, N)
    else:
        k, n = qweight.shape[0] * 8, qweight.shape[1]
        ints = _nibbles(qweight.t()).t()  # (N, K) -> (K, N)
    zeros = _nibbles(qzeros)  # (groups, N)
    if q.method == "awq":
        zeros = _awq_order(zeros)
    group = q.group_size or k
    groups = -(-k // group)
    if scales.shape != (groups, n) or zeros.shape != (groups, n):
        raise ValueError(f"{layer}: qweight says K={k}, N={n} (groups of {group}), so scales and qzeros must be "
                         f"({groups}, {n}) and ({groups}, {n // 8}); got {tuple(scales.shape)} and "
                         f"{tuple(qzeros.shape)}")
    if q.act_order and "g_idx" not in parts:  # (column order would silently give other weights)
        raise ValueError(f"{layer}: g_idx missing, which an act-order (desc_act) checkpoint's groups follow")
    group_of = parts["g_idx"].long() if "g_idx" in parts else torch.arange(k) // group
    if group_of.shape != (k,) or (k and not 0 <= int(group_of.min()) <= int(group_of.max()) < groups):
        raise ValueError(f"{layer}: g_idx must give each of {k} columns a group in [0, {groups})")
    return ints.float(), zeros.float() + q.zero_offset, scales, group_of


def _nibbles(words: torch.Tensor) -> torch.Tensor:
    """int32 (R, C) -> (R, 8 C): nibble i of word c at column 8 c + i."""
    return ((words.to(torch.int32)[..., None] >> _SHIFTS) & 15).reshape(words.shape[0], -1)


def _awq_order(t: torch.Tensor) -> torch.Tensor:
    """AWQ's nibble order within each word undone: column 8 c + j from nibble _AWQ_UNDO[j]."""
    return t.reshape(t.shape[0], -1, 8)[..., _AWQ_UNDO].reshape(t.shape[0], -1)
