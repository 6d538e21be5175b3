"""``y = x W^T (+ b)`` with W kept packed in blocks along K (twin of ``kernels.reference.linear_packed``):
every format the reference reads (``reference.PACKED_BLOCKS``): GGUF's blocks of 32, Q4_0, Q4_1, Q5_0, Q5_1,
Q8_0 and IQ4_NL; Q4_Z, the form AWQ and GPTQ int4 checkpoints load into (``engine/quant.py``); MXFP4, GPT-OSS's
experts (``kernels.triton.moe``); and the super-blocks of 256 of the K-quants (Q2_K, Q3_K, Q4_K, Q5_K, Q6_K)
and IQ4_XS, read a sub-block of 32 at a time.

One program per tile of BLOCK_M rows of x by BLOCK_N rows of W; each of W's blocks is read
once per tile, expanded in registers (exactly, in float32: an fp16 scale times a small integer)
and multiplied by ``tl.dot`` with float32 accumulators. In float32 the weights go in exact; in
bf16 and fp16 they are rounded to x's dtype first (as vLLM's AWQ Triton kernel does), so the
tensor cores take both operands. Steps of many rows (a prompt) expand the whole weight to x's
dtype once and use torch's GEMM, whose tiling beats this kernel's there.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from kernels import reference
from kernels.triton.attention_common import dot_args
from kernels.triton.launch import cdiv, check_tensor, interpreting, require, sm_count

FORMATS = reference.PACKED_FORMATS  # the kernel's FMT for each format
Q4_0: tl.constexpr = tl.constexpr(FORMATS["q4_0"])
Q4_1: tl.constexpr = tl.constexpr(FORMATS["q4_1"])
Q5_0: tl.constexpr = tl.constexpr(FORMATS["q5_0"])
Q5_1: tl.constexpr = tl.constexpr(FORMATS["q5_1"])
Q8_0: tl.constexpr = tl.constexpr(FORMATS["q8_0"])
IQ4_NL: tl.constexpr = tl.constexpr(FORMATS["iq4_nl"])
MXFP4: tl.constexpr = tl.constexpr(FORMATS["mxfp4"])
Q2_K: tl.constexpr = tl.constexpr(FORMATS["q2_k"])
Q3_K: tl.constexpr = tl.constexpr(FORMATS["q3_k"])
Q4_K: tl.constexpr = tl.constexpr(FORMATS["q4_k"])
Q5_K: tl.constexpr = tl.constexpr(FORMATS["q5_k"])
Q6_K: tl.constexpr = tl.constexpr(FORMATS["q6_k"])
IQ4_XS: tl.constexpr = tl.constexpr(FORMATS["iq4_xs"])
# IQ4's 16 levels, 4 to a constant in 16-bit fields (each level + 128): ``_iq4_level`` picks one, with no table
IQ4_FIELDS = [sum((v + 128) << (16 * i) for i, v in enumerate(reference.IQ4_LEVELS[at:at + 4])) for at in (0, 4, 8, 12)]
IQ4_A: tl.constexpr = tl.constexpr(IQ4_FIELDS[0])
IQ4_B: tl.constexpr = tl.constexpr(IQ4_FIELDS[1])
IQ4_C: tl.constexpr = tl.constexpr(IQ4_FIELDS[2])
IQ4_D: tl.constexpr = tl.constexpr(IQ4_FIELDS[3])
EXPAND_ROWS = 128  # past this many rows of x, the weight is expanded once for torch's GEMM
BLOCK_N = 32
MIN_SPLIT_BLOCKS = 4  # a split of K covers at least this many blocks of 32


@triton.jit
def _half(p, mask):
    """The fp16 stored little-endian at byte pointers ``p``, as float32."""
    lo = tl.load(p, mask=mask, other=0).to(tl.uint16)
    hi = tl.load(p + 1, mask=mask, other=0).to(tl.uint16)
    return (lo | (hi << 8)).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _expand(rows, b, ok, FMT: tl.constexpr, BLOCK_BYTES: tl.constexpr, QUANTS: tl.constexpr):
    """Weights b * 32.. of the rows at byte pointers ``rows`` (BLOCK_N,), where ``ok``, as float32 (32, BLOCK_N):
    exact, as ``reference.dequantize``."""
    j = tl.arange(0, 32)[:, None]  # a block's weights
    if FMT == Q2_K or FMT == Q3_K or FMT == Q4_K or FMT == Q5_K or FMT == Q6_K or FMT == IQ4_XS:
        return _expand_k(rows + (b // 8) * BLOCK_BYTES, b % 8, ok, j, FMT, QUANTS)
    blk = rows + b * BLOCK_BYTES
    if FMT == Q8_0:  # d q, q int8
        q = tl.load(blk[None, :] + QUANTS + j, mask=ok[None, :], other=0)
        return _half(blk, ok)[None, :] * q.to(tl.int8, bitcast=True).to(tl.float32)
    # 4-bit: weight j in the low half of byte j % 16 for j < 16, in the high half after
    byte = tl.load(blk[None, :] + QUANTS + j % 16, mask=ok[None, :], other=0).to(tl.int32)
    q = (byte >> (j // 16 * 4)) & 15
    if FMT == Q5_0 or FMT == Q5_1:  # the fifth bit: bit j of the 32-bit word after the scale (Q5_1: the minimum)
        word = blk[None, :] + (2 if FMT == Q5_0 else 4) + j // 8
        q = q | (((tl.load(word, mask=ok[None, :], other=0).to(tl.int32) >> (j % 8)) & 1) << 4)
    if FMT == MXFP4:  # 2^(e - 128) MXFP4_LEVELS[q]: FP4 E2M1 doubled (0, 1, 2, 3, 4, 6, 8, 12), the sign in bit 3
        e = tl.load(blk, mask=ok, other=0).to(tl.int32)[None, :]  # (1, BLOCK_N)
        # 2^(e - 128) from its float32 bits: normal from e = 2 up, subnormal below (exact either way)
        d = tl.where(e >= 2, (e - 1) << 23, 1 << (21 + tl.minimum(e, 1))).to(tl.float32, bitcast=True)
        m = q & 7
        level = tl.where(m < 2, m, ((2 + (m & 1)) << (m >> 1)) >> 1)
        return d * tl.where(q >= 8, -level, level).to(tl.float32)
    d = _half(blk, ok)[None, :]  # (1, BLOCK_N)
    if FMT == IQ4_NL:  # d IQ4_LEVELS[q]
        return d * _iq4_level(q)
    if FMT == Q4_0 or FMT == Q5_0:  # d (q - 8), d (q - 16)
        return d * (q.to(tl.float32) - (8.0 if FMT == Q4_0 else 16.0))
    if FMT == Q4_1 or FMT == Q5_1:  # d q + m
        return d * q.to(tl.float32) + _half(blk + 2, ok)[None, :]
    return d * (q.to(tl.float32) - _half(blk + 2, ok)[None, :])  # Q4_Z: d (q - z)


@triton.jit
def _iq4_level(q):
    """IQ4_LEVELS[q] (q int32, 0..15) as float32: field q % 4 of the constant for q // 4."""
    four = tl.where(q < 8, tl.where(q < 4, IQ4_A, IQ4_B), tl.where(q < 12, IQ4_C, IQ4_D))
    return (((four >> ((q & 3) * 16).to(tl.int64)) & 0xFFFF) - 128).to(tl.float32)


@triton.jit
def _expand_k(sup, s, ok, j, FMT: tl.constexpr, QUANTS: tl.constexpr):
    """Sub-block ``s`` (of 8) of the super-blocks at ``sup`` (``reference._k_quants``' and ``_low_bit_k_quants``'
    layouts) as float32 (32, BLOCK_N): Q2_K, Q4_K and Q5_K (d sc) q - dmin m, Q3_K (d sc) q, Q6_K (d sc) (q - 32),
    each product exact, rounded once; IQ4_XS (d (sc - 32)) IQ4_LEVELS[q], exact (24 bits at most)."""
    mask = ok[None, :]
    if FMT == Q2_K or FMT == Q3_K:  # 2-bit weights: bytes 32 (s // 4).., bits 2 (s % 4); a scale per 16 weights
        q = (tl.load(sup[None, :] + QUANTS + 32 * (s // 4) + j, mask=mask, other=0).to(tl.int32) >> (2 * (s % 4))) & 3
        g = 2 * s + j // 16  # (32, 1): each weight's group of 16
        if FMT == Q2_K:  # scale in the low 4 bits of byte g, minimum in the high 4; d, dmin at 80, 82
            sc = tl.load(sup[None, :] + g, mask=mask, other=0).to(tl.int32)
            return (_half(sup + 80, ok)[None, :] * (sc & 15).to(tl.float32)) * q.to(tl.float32) - \
                _half(sup + 82, ok)[None, :] * (sc >> 4).to(tl.float32)
        # Q3_K: a high bit (bit s of byte j) clear takes 4 off; scale g: its low 4 bits in byte 96 + g % 8 (half
        # g // 8), its high 2 in byte 104 + g % 4 (bits 2 (g // 4)), less 32; d at 108
        q = q - (((tl.load(sup[None, :] + j, mask=mask, other=0).to(tl.int32) >> s) & 1) ^ 1) * 4
        low = (tl.load(sup[None, :] + 96 + g % 8, mask=mask, other=0).to(tl.int32) >> (4 * (g // 8))) & 15
        high = (tl.load(sup[None, :] + 104 + g % 4, mask=mask, other=0).to(tl.int32) >> (2 * (g // 4))) & 3
        return (_half(sup + 108, ok)[None, :] * ((low | (high << 4)) - 32).to(tl.float32)) * q.to(tl.float32)
    if FMT == IQ4_XS:  # d; 2 high scale bits a sub-block (bytes 2..3), 4 low (bytes 4..7); IQ4_NL's nibbles from 8
        high = (tl.load(sup + 2 + s // 4, mask=ok, other=0).to(tl.int32) >> (2 * (s % 4))) & 3
        low = (tl.load(sup + 4 + s // 2, mask=ok, other=0).to(tl.int32) >> (4 * (s % 2))) & 15
        dl = _half(sup, ok) * ((low | (high << 4)) - 32).to(tl.float32)
        byte = tl.load(sup[None, :] + QUANTS + 16 * s + j % 16, mask=mask, other=0).to(tl.int32)
        return dl[None, :] * _iq4_level((byte >> (j // 16 * 4)) & 15)
    if FMT == Q6_K:  # low 4 bits: bytes 64 (s // 4) + 32 (s & 1).., half (s % 4) >> 1; high 2: bytes 32 (s // 4).., bits 2 (s % 4)
        h, r = s // 4, s % 4
        low = tl.load(sup[None, :] + 64 * h + 32 * (r & 1) + j, mask=mask, other=0).to(tl.int32)
        high = tl.load(sup[None, :] + 128 + 32 * h + j, mask=mask, other=0).to(tl.int32)
        q = ((low >> (4 * (r >> 1))) & 15) | (((high >> (2 * r)) & 3) << 4)
        sc = tl.load(sup[None, :] + 192 + 2 * s + j // 16, mask=mask, other=0).to(tl.int8, bitcast=True)
        return (_half(sup + 208, ok)[None, :] * sc.to(tl.float32)) * (q - 32).to(tl.float32)
    # 6-bit scale and minimum of sub-block s: s < 4: the low 6 bits of bytes 4 + s and 8 + s; s >= 4: the halves of
    # byte 12 + (s - 4), above them the top 2 bits of bytes 4 + (s - 4) and 8 + (s - 4)
    lo = s % 4
    a = tl.load(sup + 4 + lo, mask=ok, other=0).to(tl.int32)  # scales' byte 0..3
    m_byte = tl.load(sup + 8 + lo, mask=ok, other=0).to(tl.int32)  # 4..7
    c = tl.load(sup + 12 + lo, mask=ok, other=0).to(tl.int32)  # 8..11
    sc = tl.where(s < 4, a & 63, (c & 15) | ((a >> 6) << 4))
    mn = tl.where(s < 4, m_byte & 63, (c >> 4) | ((m_byte >> 6) << 4))
    # 4-bit weights: sub-blocks 2i and 2i + 1 in the low and high halves of the last 128 bytes' 32i..
    qs = tl.load(sup[None, :] + QUANTS + 32 * (s // 2) + j, mask=mask, other=0).to(tl.int32)
    q = (qs >> (4 * (s % 2))) & 15
    if FMT == Q5_K:  # fifth bits: bit s of byte 16 + l for weight l
        qh = tl.load(sup[None, :] + 16 + j, mask=mask, other=0).to(tl.int32)
        q = q | (((qh >> s) & 1) << 4)
    d1 = _half(sup, ok) * sc.to(tl.float32)
    m1 = _half(sup + 2, ok) * mn.to(tl.float32)
    return d1[None, :] * q.to(tl.float32) - m1[None, :]


@triton.jit
def _dequantize_kernel(w_ptr, out_ptr, N, K, row_bytes, FMT: tl.constexpr, BLOCK_BYTES: tl.constexpr,
                       QUANTS: tl.constexpr, BLOCK_N: tl.constexpr):
    """Block tl.program_id(1) of BLOCK_N rows of W, expanded into out (N, K) in out's dtype."""
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    b = tl.program_id(1)
    ok = cols < N
    w = _expand(w_ptr + cols.to(tl.int64) * row_bytes, b, ok, FMT, BLOCK_BYTES, QUANTS)  # (32, BLOCK_N)
    k = b * 32 + tl.arange(0, 32)[:, None]
    out = out_ptr + cols.to(tl.int64)[None, :] * K + k
    tl.store(out, w.to(out_ptr.dtype.element_ty), mask=ok[None, :])


@triton.jit
def _linear_packed_kernel(x_ptr, w_ptr, b_ptr, y_ptr, part_ptr, M, N, K, stride_x, stride_y, row_bytes,
                          blocks_per_split, FMT: tl.constexpr, BLOCK_BYTES: tl.constexpr, QUANTS: tl.constexpr,
                          HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                          PRECISION: tl.constexpr, DOT_F32: tl.constexpr, SPLIT: tl.constexpr):
    """Program (i, j, s): y's rows i * BLOCK_M.., columns j * BLOCK_N.., over K's blocks of split s;
    with SPLIT its float32 sum goes to part (splits, M, N), to be added up after."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # W's rows: y's columns
    row_ok, col_ok = rows < M, cols < N
    j = tl.arange(0, 32)  # a block's weights
    dtype = x_ptr.dtype.element_ty
    x_rows = x_ptr + rows.to(tl.int64)[:, None] * stride_x  # (BLOCK_M, 1)
    blocks = w_ptr + cols.to(tl.int64) * row_bytes  # (BLOCK_N,): each W row's first block
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    first = tl.program_id(2) * blocks_per_split
    for b in range(first, tl.minimum(first + blocks_per_split, K // 32)):
        w = _expand(blocks, b, col_ok, FMT, BLOCK_BYTES, QUANTS)  # (32, BLOCK_N)
        x = tl.load(x_rows + b * 32 + j[None, :], mask=row_ok[:, None], other=0.0)  # (BLOCK_M, 32)
        w = w.to(dtype)
        if DOT_F32:  # the interpreter (``attention_common.dot_args``)
            acc += tl.dot(x.to(tl.float32), w.to(tl.float32), input_precision=PRECISION)
        else:
            acc += tl.dot(x, w, input_precision=PRECISION)
    mask = row_ok[:, None] & col_ok[None, :]
    if SPLIT:
        part = part_ptr + (tl.program_id(2) * M + rows.to(tl.int64))[:, None] * N + cols[None, :]
        tl.store(part, acc, mask=mask)
    else:
        if HAS_BIAS:
            acc += tl.load(b_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        tl.store(y_ptr + rows.to(tl.int64)[:, None] * stride_y + cols[None, :], acc.to(dtype), mask=mask)


def linear_packed(x: torch.Tensor, weight: torch.Tensor, fmt: str, bias: torch.Tensor | None = None, *,
                  num_splits: int | None = None) -> torch.Tensor:
    """x (..., K) float, weight (N, K / block weights * block bytes) uint8 rows of ``fmt`` blocks, bias (N) of x's
    dtype or None -> y (..., N) of x's dtype. ``num_splits``: K's blocks split over that many programs
    per tile (default ``_auto_splits``), their float32 sums added up after."""
    n, k, block = _packed_shape(weight, fmt)
    require(x.dim() >= 1 and x.shape[-1] == k, f"x must be (..., {k}) for this weight, got {tuple(x.shape)}")
    x2 = x.reshape(-1, k)
    check_tensor("x", x2, 2)
    require(x2.device == weight.device, f"x is on {x2.device} but weight on {weight.device}")
    if bias is not None:
        check_tensor("bias", bias, 1, (x.dtype,))
        require(bias.shape == (n,), f"bias must be ({n},), got {tuple(bias.shape)}")
    m = x2.shape[0]
    if m > EXPAND_ROWS:  # the weight expanded once, straight into x's dtype
        return F.linear(x, dequantize(weight, fmt, x.dtype), bias)
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return y.view(*x.shape[:-1], n)
    block_m = 16 if m <= 16 or interpreting() else 32
    splits = num_splits if num_splits is not None else _auto_splits(m, n, k, x.device)
    require(splits >= 1, f"num_splits must be positive, got {splits}")
    per_split = cdiv(k // 32, splits)
    splits = cdiv(k // 32, per_split)  # none empty
    part = torch.empty(splits, m, n, dtype=torch.float32, device=x.device) if splits > 1 else y
    _linear_packed_kernel[(cdiv(m, block_m), cdiv(n, BLOCK_N), splits)](
        x2, weight, bias if bias is not None else weight, y, part, m, n, k, x2.stride(0), y.stride(0),
        weight.shape[1], per_split, FMT=FORMATS[fmt], BLOCK_BYTES=block, QUANTS=_quants(fmt),
        HAS_BIAS=bias is not None, BLOCK_M=block_m, BLOCK_N=BLOCK_N, SPLIT=splits > 1, **dot_args(x))
    if splits > 1:  # the splits' sums in a fixed order: the same result every run
        total = part.sum(0) if bias is None else part.sum(0) + bias.float()
        y.copy_(total)
    return y.view(*x.shape[:-1], n)


def dequantize(weight: torch.Tensor, fmt: str, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Packed (N, K / block weights * block bytes) uint8 rows -> (N, K) in ``dtype``: the exact weights
    (``reference.dequantize``), rounded once to ``dtype``. On the device, without a sync (an embedding's rows in a
    captured decode step)."""
    n, k, block = _packed_shape(weight, fmt)
    dense = torch.empty(n, k, dtype=dtype, device=weight.device)
    if n and k:
        _dequantize_kernel[(cdiv(n, BLOCK_N), k // 32)](
            weight, dense, n, k, weight.shape[1], FMT=FORMATS[fmt], BLOCK_BYTES=block, QUANTS=_quants(fmt),
            BLOCK_N=BLOCK_N)
    return dense


def _packed_shape(weight: torch.Tensor, fmt: str) -> tuple[int, int, int]:
    """(N, K, block bytes) of a packed weight, after checking it is one Triton reads."""
    require(fmt in FORMATS, f"unknown packed format {fmt!r}; known: {', '.join(FORMATS)}")
    weights_per, block = reference.PACKED_BLOCKS[fmt]
    check_tensor("weight", weight, 2, (torch.uint8,))
    require(weight.shape[1] > 0, f"a {fmt} weight needs at least one block a row, got {tuple(weight.shape)}")
    require(weight.shape[1] % block == 0 and weight.stride(0) == weight.shape[1],
            f"a {fmt} weight must be contiguous rows of whole {block}-byte blocks, got {tuple(weight.shape)} "
            f"with strides {weight.stride()}")
    return weight.shape[0], weight.shape[1] // block * weights_per, block


def _auto_splits(m: int, n: int, k: int, device: torch.device) -> int:
    """Split K when W's tiles alone would leave SMs idle (a decode step's narrow layers: Qwen2-0.5B's
    attention output, 896 x 896, is 28 tiles for an H200's 132 SMs): about two programs per SM, each
    over MIN_SPLIT_BLOCKS blocks at least, and the float32 partial sums (8 m n bytes a split, written
    and read) at most a quarter of the weight's bytes (5 n k / 8 for Q4_Z)."""
    if interpreting() or device.type != "cuda":
        return 1
    want = cdiv(2 * sm_count(device), cdiv(m, 16) * cdiv(n, BLOCK_N))
    return max(1, min(want, k // 32 // MIN_SPLIT_BLOCKS, 5 * k // (256 * m)))


def _quants(fmt: str) -> int:
    """Where a block's integers start: after its scale (MXFP4's: a byte), and Q4_1's minimum or Q4_Z's zero
    point, and Q5's fifth bits; a K-quant super-block's 4-bit (2-bit) weights, after its scales (and Q5_K's
    fifth bits, Q3_K's high bits); IQ4_XS's after its scales."""
    return {"mxfp4": 1, "q4_0": 2, "q8_0": 2, "iq4_nl": 2, "q5_0": 6, "q5_1": 8, "q4_k": 16, "q5_k": 48,
            "q6_k": 0, "q2_k": 16, "q3_k": 32, "iq4_xs": 8}.get(fmt, 4)
