"""``y = x W^T (+ b)`` for CPU tensors: torch's GEMM, or ``matmul.c`` for steps of few rows.

Decoding multiplies a handful of rows by every weight of the model, once per token. There
torch's GEMM (MKL) is far from the memory floor: on a 2-core AVX2 EPYC, fp32, it read the
weights at 7-8 GB/s for one row and at 2-3 GB/s for 2 to 32 rows, against 17 GB/s measured
for a copy, and bf16 without native bf16 instructions ran at 15 GFLOP/s whatever the rows.
``matmul.c`` streams each weight once and multiplies it by every row from registers.

Which is faster depends on the CPU and the row count (on one with AMX or avx512_bf16, oneDNN's
bf16 GEMM beats any widening loop; here torch's bf16 matrix-vector product is fine at one row),
so it is measured, not assumed: ``tune`` times both on the model's own weights (the weights of a
shape, up to 64 MiB of them, so that they stream from memory as in a step) at 1, 2, 4, ... 64 rows.
A step of ``m`` rows goes where the smallest measured row count ``>= m`` went faster (the C kernel
by 15% at least); past 64 rows, or past the first loss at 16 rows or more (the GEMM's turf), to
torch. ``TOKENMILL_CPU_LINEAR_ROWS=n`` skips the measuring: the C kernel up to ``n`` rows for every
shape (0: never), for runs that must not depend on a timing. A shape never tuned goes to torch.

Within the C kernel a row's result does not depend on how many rows share the step.

Weights kept packed as blocks (``FORMATS``: GGUF's of 32 and its super-blocks of 256, 2.6 to 8.5 bits a
weight, as llama.cpp keeps them; Q4_Z, 5 bits, for AWQ/GPTQ checkpoints)
go to ``linear_packed``: the C kernel multiplies the blocks as they are (their expansion to floats
is exact, so a row's result is the dense C kernel's on ``reference.dequantize``'s weights, bit for
bit), except past 64 rows (a prompt; past 32 where ``tune`` measured torch faster at 64), where the weight
is expanded, ``EXPAND_BYTES`` of floats at a time, and torch's float32 GEMM runs (then cast back: bf16 too
computes with the exact weights). A bf16 step of many rows may instead meet each weight as three bf16 parts
that sum to it exactly, in torch's bf16 GEMM (``_linear_split``), where ``tune`` measured that faster (AMX), or
AVX512-BF16's dot products on the blocks' integers (``_linear_dot``: every format's weights are ``d q + m`` for
each 32 or 16, so per group ``d (x . q) + m sum(x)``, the exact weights again, summed in float32), where ``tune``
measured that faster (about twice float32's GEMM on the AVX-512 EPYC); those take bf16 steps of 16 to 64 rows too,
decodes' included, where ``tune`` measured them faster than the C kernel there (1.7-2.5x on that EPYC).
"""

from __future__ import annotations

import ctypes
import functools
import logging
import math
import os
import threading
import time
from bisect import bisect_left
from collections import defaultdict
from collections.abc import Callable

import torch
import torch.nn.functional as F

from kernels import reference
from kernels.cpu import graph
from kernels.cpu.build import load, status_check
from kernels.reference import PACKED_BLOCKS, PACKED_FORMATS

log = logging.getLogger("tokenmill.kernels")

_KERNELS = {torch.float32: "linear_f32", torch.bfloat16: "linear_bf16"}
_PACKED_KERNELS = {torch.float32: "linear_q_f32", torch.bfloat16: "linear_q_bf16"}
FORMATS = PACKED_FORMATS  # the block formats matmul.c reads, by its enum's numbering
# Past ``_packed_rows`` rows, a packed weight is expanded for torch's GEMM, whose blocking beats the C kernel's
# tiles there (on the AVX2 EPYC, 109 GFLOP/s at 256 rows against ~75; the expansion costs about 3% of such a
# multiply), a slice of rows of up to this many bytes as floats at a time (0: never, the C kernel: tests)
EXPAND_BYTES = 32 << 20
ROWS = (1, 2, 4, 8, 16, 32, 64)  # the row counts tune tries; more rows go to torch
PAST = (80, 128, 256)  # the bf16 row counts past them tune tries for a packed weight's other ways
DOT_FEW = (16, 32, 64)  # ... and those of them it tries the dot products at, against the C kernel
STREAM_BYTES = 64 << 20  # weights timed per shape: more than a CPU's last-level cache
# the C kernel must be this much faster to be chosen: a near tie is noise, and its Python wrapper costs
# more per call than torch's (measured: bf16 at 1 row was a tie here, and lost in the model)
MARGIN = 1.15
# (N, K, dtype) -> for each of ROWS, whether the C kernel takes steps of up to that many rows (and
# more than the one before)
_use_c: dict[tuple[int, int, torch.dtype], tuple[bool, ...]] = {}
# batch-invariant mode (``set_every_row``): the C kernel takes every step, whatever its rows, so that a
# row's result never depends on what else the step holds
_every_row = False
# Packed weights, as ``tune`` measured them (``_measure_packed``): the C kernel takes steps of up to this many
# rows (64, or 32 where torch's float32 GEMM on the expanded weight ran faster at 64: AVX-512's, against the C
# kernel's 8 lanes; never fewer than a CPU graph's 32 sequences)...
_packed_rows = ROWS[-1]
# ... and bf16 steps of at least this many rows (past those) meet the exact weights in three bf16 parts in
# torch's bf16 GEMM (``_linear_split``) rather than in its float32 GEMM, where that ran faster (AMX's); 0: never
_split_rows = 0
# ... and bf16 steps of at least this many rows (past those) go to the dot products on the blocks (``_linear_dot``;
# where ``_dot_formats`` names the format) rather than to either GEMM, where that ran faster than both
# (AVX512-BF16's); 0: never...
_dot_rows = 0
# ... as do bf16 steps of this many rows up to 64, rather than the C kernel, where that ran faster (from 16 rows
# on the AVX-512 EPYC, against the C kernel's 8 float32 lanes), graphs' steps too; 0: never
_dot_few = 0
_scratch_buffers = threading.local()  # (``_scratch``)
SCRATCH_BYTES = 64 << 20  # the most a scratch buffer keeps
# oneDNN keeps what it builds for each shape of a bf16 GEMM (MBs each), so a server whose prompt steps came in
# every row count grew with each new one (about 5 MB a prompt of 130-1500 tokens, without end): a bf16 GEMM of
# many rows takes x SPLIT_ROWS rows at a time, the last of them padded to whole SPLIT_CHUNKs (``_by_chunks``),
# so that a weight meets 8 row counts at most
SPLIT_ROWS, SPLIT_CHUNK = 512, 64
DENSE_ROWS = 2048  # (a dense weight's, 32 row counts at most: 512 at a time cost its prompts 10%)


@functools.cache
def _library() -> ctypes.CDLL | None:
    p, i64, i = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    return load("matmul.c", dict.fromkeys(_KERNELS.values(), [p] * 4 + [i64] * 3 + [i])
                | dict.fromkeys(_PACKED_KERNELS.values(), [p, p, i, p, p] + [i64] * 3 + [i])
                | {"dequantize_rows": [p, i, p, p, i64, i64, i], "dequantize_split": [p, i, p, i64, i64, i],
                   "linear_q_dot_bf16": [p, p, i, p, p] + [i64] * 3 + [i], "q_dot_formats": [p]},
                restype=ctypes.c_int,
                errcheck=status_check("the C linear kernel"))


def _dot_formats() -> frozenset[str]:
    """The formats ``_linear_dot`` multiplies here (none without AVX512-BF16), as the library built says (kept per
    library: a test may build another)."""
    library = _library()
    if library is None:
        return frozenset()
    formats = _dot_taken.get(id(library))
    if formats is None:  # (no tensor, and the ctypes function itself: a first ask within a graph's recording is
        taken = (ctypes.c_int32 * len(FORMATS))()  # not recorded, nor read on the host through torch)
        library.q_dot_formats.args[0].fn(ctypes.addressof(taken))
        formats = _dot_taken[id(library)] = frozenset(f for f, i in FORMATS.items() if taken[i])
    return formats


_dot_taken: dict[int, frozenset[str]] = {}


def packed_available() -> bool:
    """Whether packed weights can be multiplied here (the C kernel builds)."""
    return _library() is not None


def keep_packed() -> bool:
    """Whether a loader should keep weights packed: they can be multiplied here, and the C kernel is not
    turned off (``TOKENMILL_CPU_LINEAR_ROWS=0``: torch's GEMM only, on dequantized weights)."""
    return _fixed_rows() != 0 and packed_available()


def _packed_k(weight: torch.Tensor, fmt: str) -> int:
    """K of a packed (N, K / block weights * block bytes) uint8 weight, after checking it is one."""
    if fmt not in FORMATS:
        raise ValueError(f"unknown packed format {fmt!r}; known: {', '.join(FORMATS)}")
    weights, block = PACKED_BLOCKS[fmt]
    if weight.dtype != torch.uint8 or weight.dim() != 2 or weight.shape[1] % block or not weight.is_cpu:
        raise ValueError(f"a {fmt} weight must be a 2-D uint8 CPU tensor of whole {block}-byte blocks per row, got "
                         f"{weight.dtype} {tuple(weight.shape)} on {weight.device}")
    return weight.shape[1] // block * weights


def linear_packed(x: torch.Tensor, weight: torch.Tensor, fmt: str, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``y = x W^T (+ b)`` with W packed in ``fmt`` blocks: weight (N, K / block weights * block bytes) uint8 rows,
    x (..., K) on the CPU, bias (N) of x's dtype or None; y (..., N) of x's dtype. Where the C kernel
    does not build, or for float16, the reference's."""
    k = _packed_k(weight, fmt)
    if x.shape[-1] != k or not x.is_cpu:
        raise ValueError(f"x must be (..., {k}) on the CPU, got {x.dtype} {tuple(x.shape)} on {x.device}")
    if x.dtype not in _PACKED_KERNELS or _library() is None:
        return reference.linear_packed(x, weight, fmt, bias)
    n = weight.shape[0]
    if bias is not None and (bias.shape != (n,) or bias.dtype != x.dtype):
        raise ValueError(f"bias must be ({n},) {x.dtype}, got {bias.dtype} {tuple(bias.shape)}")
    x2 = x if x.dim() == 2 and x.is_contiguous() else x.reshape(-1, k).contiguous()  # (runs per layer: lean)
    rows, how, bf16 = x2.shape[0], _linear_blocks, x.dtype == torch.bfloat16  # few: the C kernel
    if _every_row:
        pass
    elif bf16 and (0 < _dot_few <= rows <= ROWS[-1] or 0 < _dot_rows <= rows) and fmt in _dot_formats():
        how = _linear_dot  # the dot products (one C call: graphs too)
    elif rows > _packed_rows and EXPAND_BYTES and not graph.recording():  # many: torch's GEMM (a graph's: never)
        how = _linear_split if bf16 and 0 < _split_rows <= rows else _linear_expanded
    y = how(x2, weight, fmt, bias)
    return y if x.dim() == 2 else y.view(*x.shape[:-1], n)


def _linear_blocks(x: torch.Tensor, weight: torch.Tensor, fmt: str, bias: torch.Tensor | None) -> torch.Tensor:
    """``x W^T (+ b)`` (x (M, K)) by the C kernel, each block expanded as it is multiplied."""
    weight = weight.contiguous()  # (held: the C code reads them)
    bias = None if bias is None else bias.contiguous()
    (m, k), n = x.shape, weight.shape[0]
    y = torch.empty(m, n, dtype=x.dtype)
    getattr(_library(), _PACKED_KERNELS[x.dtype])(x.data_ptr(), weight.data_ptr(), FORMATS[fmt],
                                                  None if bias is None else bias.data_ptr(), y.data_ptr(), m, n, k,
                                                  torch.get_num_threads())
    return y


def _linear_expanded(x: torch.Tensor, weight: torch.Tensor, fmt: str, bias: torch.Tensor | None) -> torch.Tensor:
    """A prompt's ``x W^T (+ b)`` (x (M, K)) by torch's float32 GEMM on the expanded weight, ``EXPAND_BYTES`` of
    floats at a time, rounded once to x's dtype."""
    k, n = x.shape[1], weight.shape[0]
    rows, xf = max(1, EXPAND_BYTES // (4 * k)), x.float()
    bf = None if bias is None else bias.float()
    if rows >= n:
        y = F.linear(xf, dequantize(weight, fmt, out=_scratch("w", (n, k), torch.float32)), bf)
    else:  # (a large MLP's, or the LM head's for prompt logprobs)
        y = torch.empty(x.shape[0], n)
        for r in range(0, n, rows):
            w = weight[r:r + rows]
            y[:, r:r + rows] = F.linear(xf, dequantize(w, fmt, out=_scratch("w", (len(w), k), torch.float32)),
                                        None if bf is None else bf[r:r + rows])
    return y.to(x.dtype)


def _linear_dot(x: torch.Tensor, weight: torch.Tensor, fmt: str, bias: torch.Tensor | None) -> torch.Tensor:
    """A bf16 prompt's ``x W^T (+ b)`` by AVX512-BF16's dot products on the blocks' integers (``matmul.c``'s
    ``linear_q_dot_bf16``; ``fmt`` one of ``_dot_formats``): the exact weights, summed in float32, rounded once."""
    weight = weight.contiguous()
    bias = None if bias is None else bias.contiguous()
    (m, k), n = x.shape, weight.shape[0]
    y = torch.empty(m, n, dtype=torch.bfloat16)
    _library().linear_q_dot_bf16(x.data_ptr(), weight.data_ptr(), FORMATS[fmt],
                                 None if bias is None else bias.data_ptr(), y.data_ptr(), m, n, k,
                                 torch.get_num_threads())
    return y


def _linear_split(x: torch.Tensor, weight: torch.Tensor, fmt: str, bias: torch.Tensor | None) -> torch.Tensor:
    """A bf16 prompt's ``x W^T (+ b)`` by torch's bf16 GEMM on the exact weights: each packed row expanded into
    three bf16 rows that sum to its floats (``dequantize_split``), against ``[x | x | x]``. Three times the
    multiplies of one bf16 GEMM, which sums in float32 and rounds once, bias included; where that runs several
    times float32's rate (AMX), about twice as fast as expanding to floats. Slices of up to twice
    ``EXPAND_BYTES`` (``_slice_rows``); a slice of fewer weight rows than x has goes the other way round,
    ``W x^T`` (as ``x W^T`` it ran no faster than float32)."""
    (m, k), n = x.shape, weight.shape[0]
    x3 = _padded(x, 3)
    y, rows = x.new_empty(m, n), _slice_rows(n, max(1, 2 * EXPAND_BYTES // (6 * k)))
    for r in range(0, n, rows):
        w = weight[r:r + rows]
        parts = dequantize_split(w, fmt, _scratch("w", (len(w), 3 * k), torch.bfloat16))
        b = None if bias is None else bias[r:r + rows]

        def gemm(xs: torch.Tensor, parts: torch.Tensor = parts, b: torch.Tensor | None = b) -> torch.Tensor:
            if len(parts) < len(xs):
                return (F.linear(parts, xs) if b is None else torch.addmm(b[:, None], parts, xs.T)).T
            return F.linear(xs, parts, b)
        _by_chunks(x3, gemm, m, y[:, r:r + rows])
    return y


def _padded(x: torch.Tensor, times: int = 1, name: str = "x") -> torch.Tensor:
    """x (M, K) as ``[x | x ...]`` (``times`` of it along K) in the scratch buffer ``name``, its rows padded
    with zeros to whole SPLIT_CHUNKs (``_by_chunks``)."""
    (m, k), padded = x.shape, -(-x.shape[0] // SPLIT_CHUNK) * SPLIT_CHUNK
    xp = _scratch(name, (padded, times, k), x.dtype)
    xp[:m] = x[:, None].expand(m, times, k)
    xp[m:] = 0
    return xp.view(padded, times * k)


def _by_chunks(x: torch.Tensor, gemm: Callable[[torch.Tensor], torch.Tensor], m: int, out: torch.Tensor | None = None,
               chunk: int = SPLIT_ROWS) -> torch.Tensor:
    """``gemm`` of x's first ``m`` rows (x contiguous), ``chunk`` at a time, a last one of fewer padded to whole
    SPLIT_CHUNKs (copied, unless x is padded already: ``_padded``): a bf16 GEMM meets few row counts. Into
    ``out`` (M, N) if given; else one chunk's answer is returned as it is (its first m rows), not copied."""
    for i in range(0, m, chunk):
        xs = x[i:i + chunk]
        y = gemm(xs if len(xs) % SPLIT_CHUNK == 0 else _padded(xs, name="tail"))[:m - i]
        if out is None and i == 0 and m <= chunk:
            return y
        if out is None:
            out = y.new_empty(m, y.shape[1])
        out[i:i + chunk] = y
    return out


def _slice_rows(n: int, most: int) -> int:
    """Rows per slice of a weight of ``n`` rows, at most ``most`` (at least 1): the whole weight where it fits,
    else slices as even as whole 64s of rows allow (oneDNN's bf16 GEMM ran at half its rate on slices of 682
    rows of 8192, at full on 1024)."""
    if n <= most:
        return max(n, 1)
    rows = -(-n // -(-n // most))
    if rows > 64:
        up = -(-rows // 64) * 64
        rows = up if up <= most else rows // 64 * 64
    return rows


def _scratch(name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A ``shape`` tensor in this thread's buffer ``name``, kept from call to call and grown as needed: a
    prompt's expanded weights (and ``[x | x | x]``) are tens of MB, and a fresh tensor that large costs its
    page faults each time (allocating and filling 50 MB took 11 ms here, as long as expanding into it). So
    a thread that ran a long prompt keeps up to ``SCRATCH_BYTES`` for each name (``reset`` lets them go)."""
    size, buffers = math.prod(shape) * dtype.itemsize, _scratch_buffers.__dict__
    if size > SCRATCH_BYTES:  # (not kept: the page faults are a small part of what uses that much)
        return torch.empty(shape, dtype=dtype)
    if name not in buffers or buffers[name].numel() < size:
        with torch.inference_mode(False):  # (a plain tensor, so that a step in inference mode and tune both write it)
            buffers[name] = torch.empty(size, dtype=torch.uint8)
    return buffers[name][:size].view(dtype).view(shape)


def dequantize_split(weight: torch.Tensor, fmt: str, out: torch.Tensor | None = None) -> torch.Tensor:
    """A packed weight (N, K) as bf16 (N, 3K), into ``out`` if given: each row's floats as three bf16 parts,
    high to low, that sum to them exactly (``matmul.c``; only where it builds)."""
    k = _packed_k(weight, fmt)
    if _library() is None:
        raise RuntimeError("the C linear kernel could not be built here (see the warning above)")
    weight = weight.contiguous()
    if out is None:
        out = torch.empty(weight.shape[0], 3 * k, dtype=torch.bfloat16)
    if out.shape != (weight.shape[0], 3 * k) or out.dtype != torch.bfloat16 or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous ({weight.shape[0]}, {3 * k}) bf16 tensor")
    _library().dequantize_split(weight.data_ptr(), FORMATS[fmt], out.data_ptr(), weight.shape[0], k,
                                torch.get_num_threads())
    return out


def dequantize(weight: torch.Tensor, fmt: str, rows: torch.Tensor | None = None,
               out: torch.Tensor | None = None) -> torch.Tensor:
    """Rows ``rows`` (int64 ids; all rows when None) of a packed weight as float32 (len(rows), K), into ``out``
    if given (contiguous): an embedding lookup, a prompt's slice of a weight, or the whole matrix (tests)."""
    k = _packed_k(weight, fmt)
    weight = weight.contiguous()
    if rows is not None:
        rows = rows.to(torch.int64).contiguous()
        if rows.numel() and not graph.recording() and not (0 <= int(rows.min()) and int(rows.max()) < weight.shape[0]):
            raise IndexError(f"row ids must lie in [0, {weight.shape[0]})")
    if _library() is None:
        floats = reference.dequantize(weight if rows is None else weight[rows], fmt)
        return floats if out is None else out.copy_(floats)
    count = weight.shape[0] if rows is None else rows.numel()
    if out is None:
        out = torch.empty(count, k)
    if out.shape != (count, k) or out.dtype != torch.float32 or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous ({count}, {k}) float32 tensor")
    _library().dequantize_rows(weight.data_ptr(), FORMATS[fmt], None if rows is None else rows.data_ptr(),
                               out.data_ptr(), count, k, torch.get_num_threads())
    return out


def _fixed_rows() -> int | None:
    value = os.environ.get("TOKENMILL_CPU_LINEAR_ROWS")
    if value is None:
        return None
    try:
        return max(0, int(value))
    except ValueError:
        raise ValueError(f"TOKENMILL_CPU_LINEAR_ROWS must be a whole number, got {value!r}") from None


def linear_c(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The C kernel, always: x (M, K), weight (N, K), bias (N) or None; one dtype, fp32 or bf16."""
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"x must be (M, K) and weight (N, K), got {tuple(x.shape)} and {tuple(weight.shape)}")
    if x.dtype not in _KERNELS or weight.dtype != x.dtype or (bias is not None and bias.dtype != x.dtype):
        raise ValueError(f"x, weight and bias must share one dtype of {', '.join(map(str, _KERNELS))}, got "
                         f"{x.dtype}, {weight.dtype}, {None if bias is None else bias.dtype}")
    if bias is not None and bias.shape != (weight.shape[0],):
        raise ValueError(f"bias must be ({weight.shape[0]},), got {tuple(bias.shape)}")
    if not all(t.device.type == "cpu" for t in (x, weight) + (() if bias is None else (bias,))):
        raise ValueError("the C linear kernel takes CPU tensors only")
    if _library() is None:
        raise RuntimeError("the C linear kernel could not be built here (see the warning above)")
    x, weight = x.contiguous(), weight.contiguous()
    bias = None if bias is None else bias.contiguous()
    (m, k), n = x.shape, weight.shape[0]
    y = x.new_empty(m, n)
    getattr(_library(), _KERNELS[x.dtype])(x.data_ptr(), weight.data_ptr(), None if bias is None else bias.data_ptr(),
                                           y.data_ptr(), m, n, k, torch.get_num_threads())
    return y


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear``, by the C kernel where ``tune`` found it faster for this many rows (every step in
    batch-invariant mode: ``set_every_row``)."""
    rows = x.numel() // x.shape[-1] if x.dim() and x.shape[-1] else 0
    if not 0 < rows or weight.dim() != 2 or x.dtype != weight.dtype or x.device.type != "cpu":
        return F.linear(x, weight, bias)
    if not (_every_row and x.dtype in _KERNELS):
        use, bucket = _use_c.get((weight.shape[0], weight.shape[1], weight.dtype), ()), bisect_left(ROWS, rows)
        if bucket >= len(use) or not use[bucket]:
            if x.dtype != torch.bfloat16 or rows <= ROWS[-1] or graph.recording():
                return F.linear(x, weight, bias)
            y = _by_chunks(x.reshape(rows, x.shape[-1]).contiguous(), lambda xs: F.linear(xs, weight, bias), rows,
                           chunk=DENSE_ROWS)  # (many bf16 rows: oneDNN's memory per shape)
            return y.view(*x.shape[:-1], weight.shape[0])
    return linear_c(x.reshape(rows, x.shape[-1]), weight, bias).view(*x.shape[:-1], weight.shape[0])


def tune(weights: list[torch.Tensor]) -> dict[tuple[int, int, torch.dtype], tuple[int, ...]]:
    """Decide, per (N, K, dtype) among ``weights`` (2-D, on the CPU), for which row counts the C
    kernel takes a step; returns, per shape, the ``ROWS`` buckets it takes (also logged). Costs about
    2 s for a model of 135M parameters on 2 cores. Packed weights among them (uint8): ``_tune_packed``."""
    start = time.perf_counter()
    by_shape: dict[tuple[int, int, torch.dtype], list[torch.Tensor]] = defaultdict(list)
    seen = set()
    for w in weights:
        if w.dim() == 2 and w.device.type == "cpu" and w.dtype in _KERNELS and w.data_ptr() not in seen:
            seen.add(w.data_ptr())  # a tied embedding is the LM head's weight: timed once
            by_shape[(w.shape[0], w.shape[1], w.dtype)].append(w.contiguous())
    fixed = _fixed_rows()
    if fixed is None and by_shape and _library() is None:
        fixed = 0
    _tune_packed(any(w.dtype == torch.uint8 for w in weights), measure=fixed is None and _library() is not None)
    for shape, ws in by_shape.items():
        _use_c[shape] = tuple(m <= fixed for m in ROWS) if fixed is not None else _measure(ws)
    taken = {s: tuple(m for m, c in zip(ROWS, _use_c[s], strict=False) if c) for s in by_shape}
    if by_shape:
        log.info("CPU linear: the C kernel takes steps of %s rows, torch the others (%s in %.1f s)", "; ".join(
            f"{_spans(_use_c[s])} for {s[0]}x{s[1]}" for s in by_shape),
            "TOKENMILL_CPU_LINEAR_ROWS" if fixed is not None else "measured", time.perf_counter() - start)
    return taken


def _tune_packed(packed: bool, measure: bool) -> None:
    """Where packed weights go (``_packed_rows``, ``_split_rows``, ``_dot_rows``, ``_dot_few``): measured
    (``_measure_packed``) where the model has some and ``measure``, else as unmeasured (64 rows, float32: what a run
    that must not depend on a timing, ``TOKENMILL_CPU_LINEAR_ROWS``, gets, whatever an engine before it in this
    process measured)."""
    global _packed_rows, _split_rows, _dot_rows, _dot_few
    _packed_rows, _split_rows, _dot_rows, _dot_few = ROWS[-1], 0, 0, 0
    if not (packed and measure):
        return
    ms = {key: seconds * 1e3 for key, seconds in _measure_packed().items()}
    _packed_rows = ROWS[-2] if ms["float32", 64] * MARGIN < ms["C", 64] else ROWS[-1]

    def faster(way: str, m: int, *than: str) -> bool:
        return (way, m) in ms and ms[way, m] * MARGIN < min(ms.get((t, m), math.inf) for t in than)
    _split_rows = next((m for m in PAST if faster("bf16", m, "float32")), 0)
    # (from the fewest rows they won at and at every count above it, up to 64 rows and past them apart: the C kernel
    # may gain on them with the rows, and the bf16 GEMM past them, AMX's)
    _dot_rows = next((m for m in PAST if all(faster("dot", a, "float32", "bf16") for a in PAST if a >= m)), 0)
    _dot_few = next((m for m in DOT_FEW if all(faster("dot", a, "C", "float32") for a in DOT_FEW if a >= m)), 0)
    split = (f", its bf16 GEMM on three exact parts for bf16 steps of {_split_rows} rows or more" if _split_rows
             else "; bf16 steps do not take three bf16 parts")
    dots = [f"of {_dot_few}-{ROWS[-1]} rows (the C kernel's bf16 ones: up to {_dot_few - 1})" if _dot_few < ROWS[-1]
            else f"of {ROWS[-1]} rows"] * bool(_dot_few) + [f"of {_dot_rows} rows or more"] * bool(_dot_rows)
    if dots:
        split += f"; bf16 steps {' and '.join(dots)} take dot products on the blocks where they can"
    times = ", ".join(f"{m} rows {way} {t:.2f}" for (way, m), t in sorted(ms.items(), key=lambda kv: kv[0][1]))
    log.info("CPU linear: packed weights take the C kernel up to %d rows and torch's float32 GEMM past them%s (ms by "
             "a 2048x2048 Q4_0: %s)", _packed_rows, split, times)


def _spans(use: tuple[bool, ...]) -> str:
    """The row counts ``use`` sends to the C kernel, as ranges: "1-16, 33-64", or "no"."""
    spans: list[list[int]] = []
    for i, c in enumerate(use):
        lo = ROWS[i - 1] + 1 if i else 1
        if c and spans and spans[-1][1] == lo - 1:
            spans[-1][1] = ROWS[i]
        elif c:
            spans.append([lo, ROWS[i]])
    return ", ".join(f"{a}-{b}" if a < b else str(a) for a, b in spans) or "no"


def _measure(ws: list[torch.Tensor]) -> tuple[bool, ...]:
    """For each of ``ROWS`` in turn, whether the C kernel beat torch by ``MARGIN`` on ``ws`` (on its first
    ``STREAM_BYTES``: enough to stream from memory); cut short by a loss at 16 rows or more."""
    ws = ws[:max(1, STREAM_BYTES // (ws[0].numel() * ws[0].element_size()))]
    wins = []
    gen = torch.Generator().manual_seed(0)
    for m in ROWS:
        x = torch.randn(m, ws[0].shape[1], generator=gen).to(ws[0].dtype)
        seconds = _time(linear_c, x, ws, math.inf) * MARGIN
        wins.append(_time(F.linear, x, ws, seconds) > seconds)
        if m >= 16 and not wins[-1]:
            break
    return tuple(wins)


def _measure_packed() -> dict[tuple[str, int], float]:
    """Seconds by way and rows of x, the best of three each, for a Q4_0 weight of 2048 x 2048: the C kernel and
    torch's float32 GEMM at 64 rows; where AVX512-BF16 has them, the dot products on the blocks and the C kernel at
    16, 32 and 64 bf16 rows (64's C kernel: float32's, the same but for x's widening); at 256 bf16 rows, then at
    128 and 80 while either won, the float32 GEMM, the bf16 GEMM on three parts and the dot products on the blocks
    (where AVX512-BF16 has them), the last two stopped once past four times the float32 GEMM's time (without AMX,
    torch emulates bf16 some twenty times slower: left out)."""
    gen = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (2048, 64, 18), dtype=torch.uint8, generator=gen)
    blocks[:, :, :2] = torch.tensor([0.01], dtype=torch.float16).view(torch.uint8)  # (finite scales)
    weight, x = blocks.view(2048, -1), torch.randn(256, 2048, generator=gen)

    def best(fn: Callable, rows: torch.Tensor, limit: float = math.inf) -> float:
        times = []
        for _ in range(3):
            times.append(_time(lambda a, w: fn(a, w, "q4_0", None), rows, [weight] * 3, limit * 3) / 3)
            if times[-1] == math.inf:
                break
        return min(times)

    ms = {("C", 64): best(_linear_blocks, x[:64]), ("float32", 64): best(_linear_expanded, x[:64])}
    for m in DOT_FEW if "q4_0" in _dot_formats() else ():
        if ("C", m) not in ms:  # (64 rows': float32's, a tie with bf16's)
            ms["C", m] = best(_linear_blocks, x[:m].bfloat16())
        ms["dot", m] = best(_linear_dot, x[:m].bfloat16(), 4 * ms["C", m])
    for m in reversed(PAST):
        ms["float32", m] = best(_linear_expanded, x[:m].bfloat16())
        ms["bf16", m] = best(_linear_split, x[:m].bfloat16(), 4 * ms["float32", m])  # (a slow sample is no loss)
        if "q4_0" in _dot_formats():
            ms["dot", m] = best(_linear_dot, x[:m].bfloat16(), 4 * ms["float32", m])
        if all(ms.get((way, m), math.inf) * MARGIN >= ms["float32", m] for way in ("bf16", "dot")):
            break
    return {key: t for key, t in ms.items() if t < math.inf}


def _time(fn: Callable, x: torch.Tensor, ws: list[torch.Tensor], limit: float) -> float:
    """Seconds for ``fn(x, w)`` over ``ws``, or inf once past ``limit`` (the other kernel's)."""
    fn(x, ws[0])  # warm: page faults, the library loaded
    start = time.perf_counter()
    for w in ws:
        fn(x, w)
        if time.perf_counter() - start > limit:
            return math.inf
    return time.perf_counter() - start


def set_every_row(on: bool) -> None:
    """Batch-invariant mode (``kernels.set_batch_invariant``): the C kernel multiplies every step, dense
    and packed, prompts too (about 30% slower than torch's GEMM past 64 rows), so that a row's result
    depends on nothing but the row. Raises RuntimeError where the C kernel does not build."""
    global _every_row
    if on and _library() is None:
        raise RuntimeError("batch-invariant mode needs the C linear kernel, which could not be built here "
                           "(see the warning above)")
    _every_row = on


def reset() -> None:
    """Forget every decision, and this thread's scratch buffers (tests)."""
    global _packed_rows, _split_rows, _dot_rows, _dot_few
    _use_c.clear()
    _packed_rows, _split_rows, _dot_rows, _dot_few = ROWS[-1], 0, 0, 0
    _scratch_buffers.__dict__.clear()
