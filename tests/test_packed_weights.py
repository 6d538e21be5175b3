"""Weights kept packed as GGUF blocks (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, IQ4_NL, the K-quants, IQ4_XS) on the CPU: the
reference expansion against gguf's, the C kernel against the dense C kernel on the expanded weights (bit
for bit; its portable build too), layers whose parts mix formats, and which layers the loader packs. (The
default model served packed, greedy equal to transformers:
``test_parity.test_default_smollm2_gguf_matches_transformers``; a Q4_K_M-style file:
``test_loader.test_a_k_quant_gguf_stays_packed_on_the_cpu``.)"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize

import kernels
import kernels.reference as ref
from engine import loader
from engine.models.config import ModelConfig
from engine.models.layers import ColumnLinear
from engine.models.llama import LlamaForCausalLM
from engine.models.moe import Experts
from engine.parallel import TPGroup
from kernels.cpu import build, matmul
from kernels.cpu.build import status_check
from tools.write_gguf import quantize

FMTS = ["q4_0", "q4_1", "q5_0", "q5_1", "q8_0", "iq4_nl", "q2_k", "q3_k", "q4_k", "q5_k", "q6_k", "iq4_xs", "mxfp4"]
TYPES = {f: GGMLQuantizationType[f.upper()] for f in FMTS}


@pytest.fixture(autouse=True)
def unmeasured(monkeypatch):
    """Packed weights as ``tune`` leaves them unmeasured (an engine built earlier in this process may have
    measured them): the C kernel up to 64 rows, float32 past them."""
    monkeypatch.setattr(matmul, "_packed_rows", matmul.ROWS[-1])
    monkeypatch.setattr(matmul, "_split_rows", 0)
    monkeypatch.setattr(matmul, "_dot_rows", 0)


@pytest.fixture
def compiled():
    if not matmul.packed_available():
        pytest.skip("no C compiler here")


def packed_weight(fmt: str, n: int, k: int, seed: int = 0) -> torch.Tensor:
    w = np.random.default_rng(seed).standard_normal((n, k)).astype(np.float32)
    return torch.from_numpy(np.array(quantize(w, fmt.upper()), copy=True))


def width(fmt: str, k: int) -> int:
    """``k`` columns in whole blocks of ``fmt`` (a K-quant's are 8 times longer)."""
    return k * ref.PACKED_BLOCKS[fmt][0] // 32


def gguf_floats(packed: torch.Tensor, fmt: str) -> torch.Tensor:
    with np.errstate(invalid="ignore"):  # NaN scales (random bytes) make NaN weights, as they should
        floats = np.asarray(gguf_dequantize(packed.numpy(), TYPES[fmt]), dtype=np.float32)
    return torch.from_numpy(floats).view(packed.shape[0], -1)


@pytest.mark.parametrize("fmt", FMTS)
def test_reference_dequantize_is_gguf_exactly(fmt):
    packed = packed_weight(fmt, 9, width(fmt, 96))
    torch.testing.assert_close(ref.dequantize(packed, fmt), gguf_floats(packed, fmt), rtol=0, atol=0)
    raw = torch.randint(0, 256, packed.shape, dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    # any bytes: subnormal, infinite and NaN scales included
    torch.testing.assert_close(ref.dequantize(raw, fmt), gguf_floats(raw, fmt), rtol=0, atol=0, equal_nan=True)
    assert ref.dequantize(raw.to("meta"), fmt).device.type == "meta"  # computed where the blocks are


@pytest.mark.parametrize("fmt", FMTS)
def test_c_dequantize_matches_reference(fmt, compiled):
    packed = packed_weight(fmt, 11, width(fmt, 64))
    raw = torch.randint(0, 256, packed.shape, dtype=torch.uint8, generator=torch.Generator().manual_seed(2))
    for w in (packed, raw):
        torch.testing.assert_close(matmul.dequantize(w, fmt), ref.dequantize(w, fmt), rtol=0, atol=0, equal_nan=True)
    ids = torch.tensor([3, 0, 3, 10])
    torch.testing.assert_close(matmul.dequantize(packed, fmt, ids), ref.dequantize(packed, fmt)[ids], rtol=0, atol=0)
    with pytest.raises(IndexError):
        matmul.dequantize(packed, fmt, torch.tensor([11]))


@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("n,k", [(1, 32), (5, 64), (6, 96), (13, 576), (50, 1536)], ids=str)
def test_packed_linear_is_the_dense_kernel_on_expanded_weights(fmt, n, k, compiled, monkeypatch):
    """Bit for bit, at every row count (one, two, three, four rows at a time in registers up to 8, then
    through a buffer: different loops in matmul.c; many rows go there only for weights too large to
    expand, made so here)."""
    monkeypatch.setattr(matmul, "EXPAND_BYTES", 0)
    k = width(fmt, k)
    packed = packed_weight(fmt, n, k, seed=n * k)
    dense = ref.dequantize(packed, fmt)
    gen = torch.Generator().manual_seed(n + k)
    bias = torch.randn(n, generator=gen)
    for m in (1, 2, 3, 4, 5, 6, 7, 8, 9, 64, 200):
        x = torch.randn(m, k, generator=gen)
        for b in (None, bias):
            y = matmul.linear_packed(x, packed, fmt, b)
            assert torch.equal(y, matmul.linear_c(x, dense, b)), (m, b is None)
            torch.testing.assert_close(y, F.linear(x, dense, b), rtol=1e-4, atol=1e-4 * max(1, k / 1536) ** 0.5)


def test_packed_linear_hands_a_prompts_rows_to_torch(compiled, monkeypatch):
    """Past 64 rows torch's GEMM on the expanded weight, a slice of rows of up to EXPAND_BYTES at a time."""
    packed = packed_weight("q4_1", 30, 96)
    dense = ref.dequantize(packed, "q4_1")
    calls, linear = [], F.linear
    monkeypatch.setattr(matmul.F, "linear", lambda *a: calls.append(a) or linear(*a))
    x, bias = torch.randn(2, matmul.ROWS[-1] + 1, 96), torch.randn(30)
    want = linear(x, dense, bias)
    torch.testing.assert_close(matmul.linear_packed(x, packed, "q4_1", bias), want, rtol=1e-5, atol=1e-5 * 96 ** 0.5)
    assert len(calls) == 1 and torch.equal(calls[0][1], dense)
    matmul.linear_packed(x[0, :matmul.ROWS[-1]], packed, "q4_1")
    assert len(calls) == 1  # up to 64 rows: the C kernel
    monkeypatch.setattr(matmul, "EXPAND_BYTES", 11 * 96 * 4)  # 11 rows at a time: slices of 11, 11 and 8
    y = matmul.linear_packed(x.bfloat16(), packed, "q4_1", bias.bfloat16())
    assert [c[1].shape[0] for c in calls[1:]] == [11, 11, 8] and y.dtype == torch.bfloat16 and y.shape == (2, 65, 30)
    torch.testing.assert_close(y, linear(x.bfloat16().float(), dense, bias.bfloat16().float()).bfloat16())


def test_packed_linear_of_a_strided_weight_and_bias(compiled):
    """Copies made contiguous for the C code live until it is done with them (large ones are unmapped
    when freed: reading one after would be garbage, or a crash)."""
    packed = packed_weight("q8_0", 4096, 1024)
    strided = torch.cat([packed, packed[:, :68]], dim=1)[:, :packed.shape[1]]  # a view, not contiguous
    bias = torch.randn(4096, 2)[:, 0]
    x = torch.randn(3, 1024)
    for _ in range(3):
        assert torch.equal(matmul.linear_packed(x, strided, "q8_0", bias),
                           matmul.linear_c(x, ref.dequantize(packed, "q8_0"), bias.contiguous()))


def test_packed_linear_bf16_computes_with_the_exact_weights_at_any_row_count(compiled):
    packed = packed_weight("q8_0", 64, 256)
    x = torch.randn(matmul.ROWS[-1] + 1, 256).bfloat16()
    many = matmul.linear_packed(x, packed, "q8_0")  # torch's GEMM, in float32 on the expanded weights
    assert many.dtype == torch.bfloat16
    for i in (0, 30, matmul.ROWS[-1]):
        one = matmul.linear_packed(x[i:i + 1], packed, "q8_0")  # the C kernel, in registers
        torch.testing.assert_close(many[i].float(), one[0].float(), rtol=2**-7, atol=1e-3)  # a bf16 rounding apart
    assert torch.equal(many, F.linear(x.float(), ref.dequantize(packed, "q8_0")).bfloat16())


@pytest.mark.parametrize("fmt", FMTS)
def test_three_bf16_parts_sum_to_the_exact_weights(fmt, compiled):
    """``dequantize_split``: each weight as three bf16 numbers whose sum is its float exactly, random bytes too
    (a weight that is not finite, or past bf16's largest, is its high part alone)."""
    k = width(fmt, 96)
    raw = torch.randint(0, 256, (9, ref.packed_row_bytes(fmt, k)), dtype=torch.uint8,
                        generator=torch.Generator().manual_seed(4))
    for w in (packed_weight(fmt, 9, k), raw):
        floats, parts = ref.dequantize(w, fmt), matmul.dequantize_split(w, fmt)
        assert parts.dtype == torch.bfloat16 and parts.shape == (9, 3 * k)
        hi, mid, lo = parts.float().split(k, dim=1)
        within = floats.abs() <= torch.finfo(torch.bfloat16).max
        assert torch.equal((hi + mid + lo)[within], floats[within])
        assert torch.equal(mid[~within], lo[~within]) and not mid[~within].any()
        if not within.all():
            torch.testing.assert_close(hi[~within], floats[~within].bfloat16().float(), equal_nan=True)


@pytest.mark.parametrize("fmt", ["q4_0", "q4_1", "q8_0", "q4_k", "q6_k", "iq4_xs"])
def test_bf16_prompts_multiply_the_exact_weights_in_three_parts(fmt, compiled, monkeypatch):
    """Where tune found the CPU's bf16 GEMM fast (AMX), a bf16 prompt's rows meet [hi | mid | lo] of each
    weight in one bf16 GEMM of 3K, in even slices of up to twice EXPAND_BYTES, each ``x W^T`` or, with fewer
    weight rows than x's, ``W x^T``: the exact weights, summed in float32, rounded once, bias included, so
    within one bf16 rounding of float64's answer, as the float32 GEMM's is."""
    k, gen = width(fmt, 256), torch.Generator().manual_seed(6)
    packed, bias = packed_weight(fmt, 80, k, seed=5), torch.randn(80, generator=gen).bfloat16()
    monkeypatch.setattr(matmul, "_split_rows", 65)
    slices, split = [], matmul.dequantize_split
    monkeypatch.setattr(matmul, "dequantize_split", lambda w, *a: slices.append(len(w)) or split(w, *a))
    for m, cap, want in ((150, 7 * 6 * k // 2, [7] * 11 + [3]),  # 12 slices of up to 7 rows, W x^T
                         (70, 80 * 6 * k // 2, [80])):  # the whole weight, x W^T
        x = torch.randn(m, k, generator=gen).bfloat16()
        exact = x.double() @ ref.dequantize(packed, fmt).double().T
        monkeypatch.setattr(matmul, "EXPAND_BYTES", cap)
        for b in (None, bias):
            slices.clear()
            y = matmul.linear_packed(x[None], packed, fmt, b)[0]
            assert y.dtype == torch.bfloat16 and y.shape == (m, 80) and slices == want
            expanded = matmul._linear_expanded(x, packed, fmt, b)
            want_y = exact if b is None else exact + b.double()
            for got in (y, expanded):
                torch.testing.assert_close(got.double(), want_y, rtol=2**-8, atol=1e-6 * want_y.abs().max().item())
            assert (y != expanded).float().mean() < 0.01  # (the order of the sums: now and then the last bit)
    one = matmul.linear_packed(x[:1], packed, fmt, bias)  # up to 64 rows: the C kernel, as always
    assert torch.equal(one, matmul.linear_c(x[:1].float(), ref.dequantize(packed, fmt), bias.float()).bfloat16())


def q4_z_weight(n: int, k: int, seed: int = 0) -> torch.Tensor:
    """Q4_Z blocks (AWQ's and GPTQ's: d (q - z)) of random nibbles, scales and zeros."""
    gen = torch.Generator().manual_seed(seed)
    blocks = torch.randint(0, 256, (n, k // 32, 20), dtype=torch.uint8, generator=gen)
    blocks[:, :, :2] = (torch.rand(n, k // 32, 1, generator=gen) * 0.02 + 0.001).half().view(torch.uint8)
    blocks[:, :, 2:4] = torch.randint(0, 16, (n, k // 32, 1), generator=gen).half().view(torch.uint8)
    return blocks.view(n, -1)


@pytest.mark.parametrize("fmt", [*FMTS, "q4_z"])
def test_bf16_prompts_take_dot_products_on_the_blocks(fmt, compiled, monkeypatch):
    """Where the CPU has AVX512-BF16 and tune found it faster, a bf16 prompt's rows meet the blocks, d q + m for each
    32 or 16 weights, as d (x . q) + m sum(x): the exact weights, summed in float32, rounded once, bias included,
    so within one bf16 rounding of float64's answer, as the float32 GEMM's is, and now and then a last bit apart
    from it. Rows in passes of 32 (of 16 where no more are left) and chunks of 256, weight rows 8 at a time: shapes
    that fill neither."""
    if fmt not in matmul._dot_formats():
        pytest.skip("no AVX512-BF16 here")
    k, gen = width(fmt, 96), torch.Generator().manual_seed(8)
    for m, n in ((80, 13), (300, 8), (1, 1)):
        packed = q4_z_weight(n, k, seed=m) if fmt == "q4_z" else packed_weight(fmt, n, k, seed=m)
        bias, x = torch.randn(n, generator=gen).bfloat16(), torch.randn(m, k, generator=gen).bfloat16()
        exact = x.double() @ ref.dequantize(packed, fmt).double().T
        monkeypatch.setattr(matmul, "_dot_rows", max(1, min(m, 65)))
        monkeypatch.setattr(matmul, "_packed_rows", min(m - 1, 64))
        for b in (None, bias):
            y = matmul.linear_packed(x[None], packed, fmt, b)[0]
            want = exact if b is None else exact + b.double()
            assert y.dtype == torch.bfloat16 and y.shape == (m, n)
            torch.testing.assert_close(y.double(), want, rtol=2**-8, atol=1e-6 * want.abs().max().item())
            assert torch.equal(y, matmul._linear_dot(x, packed, fmt, b))  # (it went that way)
            assert torch.equal(y[-1:], matmul._linear_dot(x[-1:], packed, fmt, b))  # (a row's result is its own)
            if m > 1:
                assert (y != matmul._linear_expanded(x, packed, fmt, b)).float().mean() < 0.02


def test_dot_products_take_bf16_steps_of_few_rows_and_graphs_replay_them(compiled, monkeypatch):
    """Where tune measured the dot products faster than the C kernel at 32 rows (and 64), bf16 steps of 32 to 64 rows
    take them, decodes' too, and a CPU graph records them and replays them on new rows; fewer rows, float32 ones and
    batch-invariant mode's stay in the C kernel, and more rows go where tune measured past 64."""
    if "q4_k" not in matmul._dot_formats():
        pytest.skip("no AVX512-BF16 here")
    monkeypatch.setattr(matmul, "_dot_few", 32)
    packed, gen, went = packed_weight("q4_k", 24, 256), torch.Generator().manual_seed(5), []
    for name in ("_linear_dot", "_linear_blocks", "_linear_expanded"):
        monkeypatch.setattr(matmul, name, lambda *a, fn=getattr(matmul, name), name=name: went.append(name) or fn(*a))
    x = torch.randn(40, 256, generator=gen).bfloat16()
    for rows in (32, 40, 31, 1):
        want = matmul._linear_dot(x[:rows], packed, "q4_k", None)
        assert torch.equal(matmul.linear_packed(x[:rows], packed, "q4_k"), want)
    assert went[1::2] == ["_linear_dot"] * 2 + ["_linear_blocks"] * 2
    matmul.linear_packed(torch.randn(65, 256).bfloat16(), packed, "q4_k")  # (past 64 rows: _dot_rows's, here none)
    assert went[-1] == "_linear_expanded"
    matmul.linear_packed(x.float(), packed, "q4_k")
    matmul.set_every_row(True)
    try:
        matmul.linear_packed(x, packed, "q4_k")
    finally:
        matmul.set_every_row(False)
    assert went[-2:] == ["_linear_blocks"] * 2
    out = {}
    monkeypatch.setattr(matmul, "_dot_taken", {})  # (the formats first asked within the recording: not recorded, U)
    replay = matmul.graph.capture()(lambda: out.update(y=matmul.linear_packed(x, packed, "q4_k")))
    x.copy_(torch.randn(40, 256, generator=gen).bfloat16())
    replay()
    assert torch.equal(out["y"], matmul._linear_dot(x, packed, "q4_k", None))
    calls = [c.kernel for c in replay.__self__.steps if isinstance(c, matmul.graph._Call)]
    assert [k.fn.__name__ for k in calls] == ["linear_q_dot_bf16"] and calls[0].packed  # (replayed from graph.c)


def test_slices_of_a_weight_stay_within_their_bound_in_whole_64s():
    for n, most, want in ((80, 7, 7), (2048, 1365, 1024), (16384, 5461, 4096), (151936, 2730, 2688), (576, 7281, 576),
                          (40, 43690, 40), (1, 1, 1)):
        rows = matmul._slice_rows(n, most)
        assert rows == want and rows <= most and (rows <= 64 or rows % 64 == 0)
    x = torch.randn(3, 64).bfloat16()
    assert matmul._linear_split(x, packed_weight("q4_0", 0, 64), "q4_0", None).shape == (3, 0)  # (no rows at all)


def test_scratch_buffers_serve_in_and_out_of_inference_mode_until_reset(compiled, monkeypatch):
    """A step runs in inference mode, tune does not: a buffer first made in either is written by both."""
    matmul.reset()
    monkeypatch.setattr(matmul, "_split_rows", 65)
    packed, x = packed_weight("q4_0", 70, 64), torch.randn(80, 64).bfloat16()
    with torch.inference_mode():
        first = matmul.linear_packed(x, packed, "q4_0")
    assert set(matmul._scratch_buffers.__dict__) == {"x", "w"}
    assert torch.equal(matmul.linear_packed(x, packed, "q4_0"), first)
    expanded = matmul._linear_expanded(x, packed, "q4_0", None)
    assert torch.equal(matmul._linear_expanded(x, packed, "q4_0", None), expanded)
    matmul.reset()
    assert not matmul._scratch_buffers.__dict__


def test_bf16_gemms_of_many_rows_meet_few_row_counts(compiled, monkeypatch):
    """oneDNN keeps memory for each shape a bf16 GEMM meets: three parts take x 512 rows at a time, a dense bf16
    weight past 64 rows 2048, the last padded to whole 64s, whatever the step's rows; the padding changes no row."""
    monkeypatch.setattr(matmul, "_split_rows", 65)
    seen, linear, allowed = set(), F.linear, set(range(64, 2049, 64))

    def counted(a: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
        if a.dtype == torch.bfloat16:  # (not the float32 GEMM's, the reference here)
            seen.add((len(a), len(w)))
        return linear(a, w, b)
    monkeypatch.setattr(matmul.F, "linear", counted)
    packed, dense, gen = packed_weight("q8_0", 200, 64), torch.randn(96, 64).bfloat16(), torch.Generator().manual_seed(7)
    for m in (65, 129, 500, 512, 513, 1100):
        x = torch.randn(m, 64, generator=gen).bfloat16()
        torch.testing.assert_close(matmul.linear_packed(x, packed, "q8_0").double(),
                                   matmul._linear_expanded(x, packed, "q8_0", None).double(), rtol=2**-7, atol=1e-2)
        torch.testing.assert_close(matmul.linear(x, dense), linear(x, dense))
    assert all(a in allowed or w in allowed for a, w in seen), seen  # (x W^T, or W x^T with the weight first)
    assert {(128, 200), (200, 512), (1152, 96), (576, 96), (128, 96)} <= seen
    assert max(a for a, w in seen if w == 200) <= 512 and max(w for a, w in seen if a == 200) <= 512


def test_tune_measures_where_packed_weights_go(compiled, monkeypatch, caplog):
    """A model with packed weights (2-D, or a fused layer's flat bytes): tune times the ways once and logs what it
    took (the C kernel up to 64 rows or 32, three bf16 parts or dot products on the blocks from 80, 128 or 256
    bf16 rows, where faster than the float32 GEMM (and the other, the dot products at every count above too; and
    from 16, 32 or 64 rows where faster than the C kernel there and at every count above), or
    never: also where the bf16 GEMM was too slow to be timed whole); with TOKENMILL_CPU_LINEAR_ROWS set (runs that
    must not depend on a timing), or without a packed weight, up to 64 rows and never, whatever was measured
    before."""
    monkeypatch.delenv("TOKENMILL_CPU_LINEAR_ROWS", raising=False)
    times, measured = {("C", 64): 3, ("float32", 64): 2, ("float32", 256): 7, ("bf16", 256): 5, ("float32", 128): 4.1,
                       ("bf16", 128): 4}, []
    monkeypatch.setattr(matmul, "_measure_packed", lambda: measured.append(1) or dict(times))
    caplog.set_level("INFO", logger="tokenmill.kernels")
    try:
        matmul.tune([packed_weight("q4_0", 8, 64), torch.randn(8, 8)])
        assert (matmul._packed_rows, matmul._split_rows, measured) == (32, 256, [1])
        assert "packed weights take the C kernel up to 32 rows" in caplog.text and "256 rows or more" in caplog.text
        times |= {("float32", 64): 2.9, ("bf16", 128): 1}
        matmul.tune([packed_weight("q4_0", 8, 64).view(-1)])
        assert (matmul._packed_rows, matmul._split_rows, matmul._dot_rows) == (64, 128, 0)
        times |= {("dot", 256): 2, ("dot", 128): 1.2, ("float32", 80): 3, ("dot", 80): 2.7}  # (faster than both)
        matmul.tune([packed_weight("q4_0", 8, 64)])
        assert (matmul._split_rows, matmul._dot_rows) == (128, 256)
        assert "bf16 steps of 256 rows or more take dot products" in caplog.text
        times[("bf16", 128)] = 5  # (the parts lose at 128 rows: the dot products win there)
        matmul.tune([packed_weight("q4_0", 8, 64)])
        assert (matmul._split_rows, matmul._dot_rows) == (256, 128)
        few = {("C", 16): 1, ("dot", 16): 0.95, ("C", 32): 2, ("dot", 32): 1.2, ("dot", 64): 1.5}  # (up to 64 rows:
        times |= few  # against the C kernel; won at 32 and 64: from 32, beside the dot products from 128 past them)
        matmul.tune([packed_weight("q4_0", 8, 64)])
        assert (matmul._packed_rows, matmul._dot_few, matmul._dot_rows) == (64, 32, 128)
        assert "steps of 32-64 rows (the C kernel's bf16 ones: up to 31) and of 128 rows or more" in caplog.text
        times[("bf16", 256)] = 1  # (the parts win at 256 rows, as AMX's may: none past 64, still from 32 up to them,
        matmul.tune([packed_weight("q4_0", 8, 64)])  # review U)
        assert (matmul._split_rows, matmul._dot_rows, matmul._dot_few) == (256, 0, 32)
        assert "bf16 steps of 32-64 rows (the C kernel's bf16 ones: up to 31) take dot products" in caplog.text
        times[("bf16", 256)], times[("dot", 64)] = 5, 2.7  # (a loss to the C kernel's 3 at 64 rows: none up to them)
        matmul.tune([packed_weight("q4_0", 8, 64)])
        assert (matmul._dot_few, matmul._dot_rows) == (0, 128)
        for key in few:
            del times[key]
        times |= {("dot", 80): 2, ("float32", 80): 4, ("bf16", 80): 3, ("dot", 128): 5, ("dot", 256): 9}  # (won
        # at 80 rows alone: not taken past them, where the parts won, review T)
        matmul.tune([packed_weight("q4_0", 8, 64)])
        assert (matmul._split_rows, matmul._dot_rows) == (80, 0)
        for key in [("dot", 256), ("dot", 128), ("float32", 80), ("dot", 80), ("bf16", 80)]:
            del times[key]
        for key in [("bf16", 256), ("float32", 128), ("bf16", 128)]:  # (past the float32 GEMM's time: not kept)
            del times[key]
        matmul.tune([packed_weight("q4_0", 8, 64)])
        assert (matmul._packed_rows, matmul._split_rows) == (64, 0) and "do not take three bf16 parts" in caplog.text
        times |= {("float32", 64): 1, ("bf16", 256): 1}
        matmul.tune([packed_weight("q4_0", 8, 64)])
        assert (matmul._packed_rows, matmul._split_rows, len(measured)) == (32, 256, 10)
        matmul.tune([torch.randn(8, 8)])  # no packed weight: as unmeasured
        assert (matmul._packed_rows, matmul._split_rows, len(measured)) == (64, 0, 10)
        times[("dot", 256)] = 0.1
        matmul.tune([packed_weight("q4_0", 8, 64)])
        monkeypatch.setenv("TOKENMILL_CPU_LINEAR_ROWS", "64")
        matmul.tune([packed_weight("q4_0", 8, 64)])
        assert (matmul._packed_rows, matmul._split_rows, matmul._dot_rows, len(measured)) == (64, 0, 0, 11)
        monkeypatch.undo()
        real = matmul._measure_packed()  # (the real one: seconds each way, the bf16 GEMM's only where it kept up)
        assert {("C", 64), ("float32", 64), ("float32", 256)} <= real.keys() and all(0 < t < 1 for t in real.values())
        assert {("C", 16), ("dot", 16), ("C", 32)} <= real.keys() or "q4_0" not in matmul._dot_formats()
    finally:
        matmul.reset()


def test_packed_steps_past_the_measured_rows_go_to_torch_but_a_graphs_never(compiled, monkeypatch):
    """With the C kernel up to 32 rows (AVX-512's float32 GEMM measured faster at 64), 33 rows go to torch's GEMM
    on the expanded weight; a step a CPU graph records stays in the C kernel (its replays must not find a
    scratch buffer grown elsewhere)."""
    packed = packed_weight("q4_k", 16, 256)
    calls, linear = [], F.linear
    monkeypatch.setattr(matmul.F, "linear", lambda *a: calls.append(a[0].shape[0]) or linear(*a))
    monkeypatch.setattr(matmul, "_packed_rows", 32)
    x = torch.randn(33, 256)
    blocks = matmul._linear_blocks(x, packed, "q4_k", None)
    for rows in (1, 32, 33):
        y = matmul.linear_packed(x[:rows], packed, "q4_k")
        torch.testing.assert_close(y, blocks[:rows], rtol=1e-5, atol=1e-5 * 256 ** 0.5)
    assert calls == [33]
    monkeypatch.setattr(matmul.graph, "recording", lambda: True)
    assert torch.equal(matmul.linear_packed(x, packed, "q4_k"), blocks) and calls == [33]


def test_c_status_codes_become_exceptions(compiled):
    with pytest.raises(MemoryError, match="the C linear kernel could not allocate"):
        status_check("the C linear kernel")(1)
    with pytest.raises(ValueError, match="refused"):
        x, w, y = torch.randn(5, 32), packed_weight("q4_1", 6, 32), torch.empty(5, 6)
        matmul._library().linear_q_f32(x.data_ptr(), w.data_ptr(), 1, None, y.data_ptr(), 5, 6, 32, 0)
    with pytest.raises(ValueError, match="refused"):  # a K-quant's K must be whole super-blocks
        matmul._library().linear_q_f32(x.data_ptr(), w.data_ptr(), matmul.FORMATS["q4_k"], None, y.data_ptr(), 5,
                                       6, 32, 1)


def test_the_portable_build_expands_every_format_as_the_reference(compiled, monkeypatch, tmp_path):
    """Built without -march=native (no AVX2 on x86: the plain C loops other CPUs run), the C kernel
    still expands each format bit for bit as the reference, random bytes included. (At -O0: the same loops as the
    fallback's -O3 compiles, in 5 s instead of 40; without -ffast-math or FMA, optimizing changes no result.)"""
    monkeypatch.setenv("TOKENMILL_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(build, "FLAG_SETS", (["-O0"],))
    portable = matmul._library.__wrapped__()
    assert portable is not None
    monkeypatch.setattr(matmul, "_library", lambda: portable)
    gen = torch.Generator().manual_seed(3)
    for fmt in FMTS:
        packed = packed_weight(fmt, 7, width(fmt, 64))
        raw = torch.randint(0, 256, packed.shape, dtype=torch.uint8, generator=gen)
        for w in (packed, raw):
            torch.testing.assert_close(matmul.dequantize(w, fmt), ref.dequantize(w, fmt), rtol=0, atol=0,
                                       equal_nan=True)
        x = torch.randn(3, packed.shape[1] // ref.PACKED_BLOCKS[fmt][1] * ref.PACKED_BLOCKS[fmt][0], generator=gen)
        assert torch.equal(matmul.linear_packed(x, packed, fmt), matmul.linear_c(x, ref.dequantize(packed, fmt)))


@pytest.mark.parametrize("fmt", FMTS)
def test_packed_linear_bf16_and_shapes(fmt, compiled):
    k = width(fmt, 64)
    packed = packed_weight(fmt, 20, k)
    dense = ref.dequantize(packed, fmt)
    x = torch.randn(2, 3, k)  # any leading dims
    bias = torch.randn(20).bfloat16()
    y = matmul.linear_packed(x.bfloat16(), packed, fmt, bias)
    assert y.shape == (2, 3, 20) and y.dtype == torch.bfloat16
    torch.testing.assert_close(y.float(), F.linear(x.bfloat16().float(), dense, bias.float()), rtol=1e-2,
                               atol=2e-2 * k ** 0.5 / 8)
    strided = torch.randn(4, 2 * k)[:, ::2]  # not contiguous
    assert torch.equal(matmul.linear_packed(strided, packed, fmt), matmul.linear_c(strided.contiguous(), dense))


@pytest.mark.parametrize("call,error", [
    (lambda w: matmul.linear_packed(torch.randn(1, 64), w, "iq2_xs"), "unknown packed format"),
    (lambda w: matmul.linear_packed(torch.randn(1, 32), w, "q4_1"), r"x must be \(\.\.\., 64\)"),
    (lambda w: matmul.linear_packed(torch.randn(1, 64), w.float(), "q4_1"), "uint8"),
    (lambda w: matmul.linear_packed(torch.randn(1, 64), w[:, :30], "q4_1"), "whole 20-byte blocks"),
    (lambda w: matmul.linear_packed(torch.randn(1, 64), w, "q4_1", torch.randn(3)), "bias must be"),
    (lambda w: matmul.linear_packed(torch.randn(1, 64), w, "q4_1", torch.randn(4).bfloat16()), "bias must be"),
], ids=["format", "k", "weight-dtype", "blocks", "bias-shape", "bias-dtype"])
def test_packed_linear_refuses_bad_arguments(call, error, compiled):
    with pytest.raises(ValueError, match=error):
        call(packed_weight("q4_1", 4, 64))


@pytest.mark.parametrize("fmt", FMTS)
def test_kernels_dispatch_packed_weights(fmt, monkeypatch, compiled):
    k = width(fmt, 64)
    packed = packed_weight(fmt, 7, k)
    dense = ref.dequantize(packed, fmt)
    x, ids = torch.randn(3, k), torch.tensor([[6, 1], [0, 0]])
    for backend in ("auto", "reference"):
        monkeypatch.setattr(kernels, "_backend", backend)
        torch.testing.assert_close(kernels.linear(x, packed, packed=fmt), F.linear(x, dense), rtol=1e-5,
                                   atol=1e-5 * k ** 0.5)  # sums of k products of ~1
        emb = kernels.embedding(ids, packed, torch.bfloat16, fmt)
        assert emb.shape == (2, 2, k) and emb.dtype == torch.bfloat16
        assert torch.equal(emb, dense[ids].bfloat16())


@pytest.mark.parametrize("fmts", [["q4_k", "q4_k", "q6_k"], ["q6_k", "q4_k", "q6_k"], ["q5_0", "q8_0", "q8_0"]],
                         ids="-".join)
def test_a_fused_layer_whose_parts_mix_formats(fmts, compiled):
    """q|k|v with v in more bits (Q4_K_M's): each run of parts in one format multiplied on its own, the
    outputs side by side, as the parts expanded and fused would give (each row bit for bit)."""
    k, sizes = 256, [64, 32, 32]
    layer = ColumnLinear(k, sizes, bias=True)
    layer.pack_parts(fmts)
    assert layer.weight.dtype == torch.uint8 and layer.weight.dim() == 1 and layer.packed is None
    parts = [packed_weight(f, n, k, seed=i) for i, (f, n) in enumerate(zip(fmts, sizes, strict=True))]
    bias = torch.randn(sum(sizes))
    for i, p in enumerate(parts):
        layer.load(i, p)
        layer.load(i, bias[sum(sizes[:i]):sum(sizes[:i + 1])], "bias")
    dense = torch.cat([ref.dequantize(p, f) for p, f in zip(parts, fmts, strict=True)])
    for m in (1, 3, 80):
        x = torch.randn(m, k)
        y = layer(x)
        assert y.shape == (m, 128)
        torch.testing.assert_close(y, F.linear(x, dense, bias), rtol=1e-5, atol=1e-5 * k ** 0.5)  # sums of k products
        if m <= matmul.ROWS[-1]:
            assert torch.equal(y, matmul.linear_c(x, dense, bias))
    same = ColumnLinear(k, sizes)
    same.pack_parts(["q8_0"] * 3)  # one format: packed as a whole
    assert same.packed == "q8_0" and same.segments == [] and same.weight.shape == (128, 272)


def test_experts_with_down_in_another_format(compiled):
    """A mixture of experts' gate|up in one format and down in another (Q4_K_M's down in Q6_K)."""
    e, hidden, width_ = 4, 256, 256
    experts = Experts(e, hidden, width_, TPGroup())
    experts.pack("q4_k", "q6_k")
    w13 = torch.stack([packed_weight("q4_k", 2 * width_, hidden, seed=i) for i in range(e)])
    w2 = torch.stack([packed_weight("q6_k", hidden, width_, seed=10 + i) for i in range(e)])
    experts.load(slice(None), 0, w13[:, :width_])
    experts.load(slice(None), 1, w13[:, width_:])
    experts.load(slice(None), 2, w2)
    x = torch.randn(5, hidden)
    ids = torch.tensor([[0, 1], [2, 3], [1, 1], [3, 0], [2, 0]])
    weights = torch.rand(5, 2)
    got = kernels.fused_moe(x, experts.w13, experts.w2, weights, ids, experts.packed, experts.packed_down)
    want = ref.fused_moe(x, torch.stack([ref.dequantize(w, "q4_k") for w in w13]),
                         torch.stack([ref.dequantize(w, "q6_k") for w in w2]), weights, ids)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5 * float(want.abs().max()))  # sums of ~1e3


def test_tensor_parallel_ranks_share_the_experts_blocks():
    """A width of 160 (5 blocks of 32) over 4 ranks: 40 a rank is not whole blocks, so packed the ranks keep 2, 1, 1
    and 1 blocks; their rows of gate|up, columns of down and biases put together are the whole experts'. A width of
    fewer blocks than ranks cannot be packed."""
    e, hidden, width_ = 3, 64, 160
    w13 = torch.stack([packed_weight("mxfp4", 2 * width_, hidden, seed=i) for i in range(e)])
    w2 = torch.stack([packed_weight("q8_0", hidden, width_, seed=10 + i) for i in range(e)])
    biases = torch.randn(e, 2 * width_), torch.randn(e, hidden)
    ranks = [Experts(e, hidden, width_, TPGroup(rank=r, size=4), biases=True) for r in range(4)]
    for experts in ranks:
        assert experts.width == 40 and experts.packable("q8_0") and experts.packable("q4_k") is False
        experts.pack("mxfp4", "q8_0")
        experts.load(slice(None), 0, w13[:, :width_])
        experts.load(slice(None), 1, w13[:, width_:])
        experts.load(slice(None), 2, w2)
        experts.load_bias(0, biases[0][:, :width_])
        experts.load_bias(1, biases[0][:, width_:])
        experts.load_bias(2, biases[1])
    assert [(x.first, x.width) for x in ranks] == [(0, 64), (64, 32), (96, 32), (128, 32)]
    assert torch.equal(torch.cat([x.w2 for x in ranks], dim=-1), w2)
    for part in range(2):
        rows = torch.cat([x.w13[:, part * x.width:(part + 1) * x.width] for x in ranks], dim=1)
        assert torch.equal(rows, w13[:, part * width_:(part + 1) * width_])
        assert torch.equal(torch.cat([x.b13[:, part * x.width:(part + 1) * x.width] for x in ranks], dim=1),
                           biases[0][:, part * width_:(part + 1) * width_])
    assert torch.equal(ranks[0].b2, biases[1]) and not ranks[1].b2.any()
    with pytest.raises(ValueError, match=r"an expert's down_proj is 170 bytes of q8_0 blocks wide"):
        ranks[1].load(0, 2, w2[0, :, :-34])
    assert not Experts(e, hidden, 96, TPGroup(rank=0, size=4)).packable("q8_0")  # 3 blocks, 4 ranks
    with pytest.raises(ValueError, match="not 4 or more whole q8_0 blocks"):
        Experts(e, hidden, 96, TPGroup(rank=0, size=4)).pack("q8_0")


def tiny_config() -> ModelConfig:
    return ModelConfig.from_hf({"model_type": "llama", "vocab_size": 96, "hidden_size": 64, "intermediate_size": 96,
                                "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                                "tie_word_embeddings": True, "max_position_embeddings": 64}, [])


def fake_gguf(monkeypatch, types: dict[str, str]) -> None:
    tensors = [SimpleNamespace(name=n, tensor_type=SimpleNamespace(name=t.upper())) for n, t in types.items()]
    monkeypatch.setattr(loader, "_gguf_reader", lambda path: SimpleNamespace(tensors=tensors))


def test_loader_packs_layers_whose_parts_the_kernel_reads(monkeypatch, compiled):
    cfg = tiny_config()
    types = {"token_embd.weight": "q8_0"}
    for i in range(2):
        types |= {f"blk.{i}.{p}.weight": "q4_1" for p in ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate",
                                                          "ffn_up", "ffn_down")}
    types["blk.1.attn_v.weight"] = "iq2_xs"  # a part the kernel cannot read: its fused layer stays dense
    types["blk.1.ffn_down.weight"] = "f32"
    types["blk.0.attn_v.weight"] = "q8_0"  # parts in two formats the kernel reads: packed, each its own
    fake_gguf(monkeypatch, types)
    model = LlamaForCausalLM(cfg, 64)
    packed = loader._gguf_packing("m.gguf", model, torch.device("cpu"))
    first, second = model.layers
    assert [first.mlp.down_proj.packed, model.embed_tokens.packed] == ["q4_1", "q8_0"]
    assert [seg[:3] for seg in first.self_attn.qkv_proj.segments] == [("q4_1", 0, 96), ("q8_0", 96, 32)]
    assert first.mlp.gate_up_proj.weight.dtype == torch.uint8 and first.mlp.gate_up_proj.weight.shape == (192, 40)
    assert second.self_attn.qkv_proj.packed is None and second.mlp.down_proj.packed is None
    assert second.mlp.gate_up_proj.packed == "q4_1" and second.self_attn.o_proj.packed == "q4_1"
    assert "blk.1.attn_q.weight" not in packed and "blk.1.ffn_up.weight" in packed
    assert model.lm_head.weight is model.embed_tokens.weight


def test_loader_packs_on_the_gpu_the_formats_triton_reads(monkeypatch):
    """On CUDA every format the reference reads stays packed for Triton's kernels; IQ2_XS is expanded."""
    types = {"token_embd.weight": "q8_0"}
    for i in range(2):
        types |= {f"blk.{i}.{p}.weight": "q4_0" for p in ("attn_q", "attn_k", "attn_v", "attn_output")}
        types |= {f"blk.{i}.{p}.weight": "iq2_xs" for p in ("ffn_gate", "ffn_up", "ffn_down")}
    fake_gguf(monkeypatch, types)
    model = LlamaForCausalLM(tiny_config(), 64)
    packed = loader._gguf_packing("m.gguf", model, torch.device("cuda"))
    assert packed == {n for n, t in types.items() if t != "iq2_xs"}
    assert kernels.packed_formats(torch.device("cuda")) == set(ref.PACKED_BLOCKS)
    assert (model.embed_tokens.packed, model.layers[1].self_attn.qkv_proj.packed) == ("q8_0", "q4_0")
    assert model.layers[0].mlp.gate_up_proj.packed is None and model.layers[0].mlp.down_proj.packed is None


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_under_tensor_parallelism_a_rank_packs_layers_whose_share_is_whole_blocks(device, monkeypatch, compiled):
    """Rank 1 of 2: o's columns of the rank (32 of 64) are a Q4_0 block, down's (48 of 96) are not: expanded. Its
    bytes are the rank's columns of the file's rows, its other layers' rows the rank's rows (experts:
    test_tensor_parallel)."""
    types = {"token_embd.weight": "q8_0"}
    for i in range(2):
        types |= {f"blk.{i}.{p}.weight": "q4_0" for p in ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate",
                                                          "ffn_up", "ffn_down")}
    fake_gguf(monkeypatch, types)
    model = LlamaForCausalLM(tiny_config(), 64, TPGroup(rank=1, size=2))
    packed = loader._gguf_packing("m.gguf", model, torch.device(device))
    assert packed == {n for n in types if "ffn_down" not in n}
    layer = model.layers[0]
    assert (layer.self_attn.o_proj.packed, layer.mlp.gate_up_proj.packed, layer.mlp.down_proj.packed) == \
        ("q4_0", "q4_0", None)
    assert layer.self_attn.o_proj.weight.shape == (64, 18) and layer.mlp.gate_up_proj.weight.shape == (96, 36)
    assert model.embed_tokens.packed == "q8_0" and model.embed_tokens.weight.shape == (48, 68)
    rows = torch.randint(0, 256, (64, 36), dtype=torch.uint8)
    layer.self_attn.o_proj.load(rows)
    assert torch.equal(layer.self_attn.o_proj.weight, rows[:, 18:])


@pytest.mark.parametrize("why", ["cuda", "env", "backend"])
def test_loader_keeps_floats_where_packing_cannot_serve(why, monkeypatch, compiled):
    fake_gguf(monkeypatch, {"token_embd.weight": "q8_0" if why != "cuda" else "iq2_xs"})  # (CUDA: Triton's formats)
    device = torch.device("cpu")
    if why == "cuda":
        device = torch.device("cuda")
    elif why == "env":
        monkeypatch.setenv("TOKENMILL_CPU_LINEAR_ROWS", "0")
    else:
        monkeypatch.setattr(kernels, "_backend", "reference")
    model = LlamaForCausalLM(tiny_config(), 64)
    assert loader._gguf_packing("m.gguf", model, device) == set()
    assert model.embed_tokens.packed is None
