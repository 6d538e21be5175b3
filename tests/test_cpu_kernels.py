"""The CPU kernels (``kernels.cpu``: paged attention reading each sequence's K/V blocks where
they sit, decode in compiled C) against their reference twins on the shared cases
(``tests/paged_cases.py``), with NaN in every cache slot no sequence owns; the argument checks;
the dispatch; and the clean fall back to the reference where no C compiler works. The C linear
kernel for steps of few rows against torch, its tuning and dispatch.
"""

from __future__ import annotations

import logging

import pytest
import torch

import kernels
import kernels.cpu as cpu
import kernels.reference as ref
from engine.cache_dir import private
from kernels.cpu import attention, build, elementwise, matmul
from tests.paged_cases import (
    ATTN_TOL,
    BF16,
    DECODE_CASES,
    E4M3,
    E5M2,
    F16,
    F32,
    FP8_CASES,
    FP8_EDGES,
    PREFILL_CASES,
    SINK_CASES,
    WINDOW_CASES,
    against_reference,
    case_id,
    check_fp8_store,
    fp8_caches,
    paged_cache,
    prefill_indices,
    randn,
    sinks_for,
)

COMPILED = [c for c in DECODE_CASES if c[0] in (F32, BF16)]
COMPILED_PREFILL = [c for c in PREFILL_CASES if c[0] in (F32, BF16)]


@pytest.fixture
def compiled():
    if not cpu.available():
        pytest.skip("no working C compiler here: CPU decode falls back to the reference")


@pytest.mark.parametrize("dtype,d,page,h,hkv,seq_lens,splits", COMPILED, ids=map(case_id, COMPILED))
def test_cpu_paged_decode_matches_reference(dtype, d, page, h, hkv, seq_lens, splits, compiled):
    kc, vc, kp, vp, tables = paged_cache(seq_lens, page, hkv, d, dtype)
    q = randn(len(seq_lens), h, d, dtype=dtype)
    lens = torch.tensor(seq_lens)
    out = cpu.paged_decode_attention(q, kp, vp, tables, lens, max(seq_lens), d ** -0.5)
    want = ref.paged_decode_attention(q, kc, vc, tables.long(), lens, max(seq_lens), d ** -0.5)
    assert out.dtype == dtype
    torch.testing.assert_close(out.float(), want.float(), **ATTN_TOL[dtype])


@pytest.mark.parametrize("dtype,d,page,h,hkv,query_lens,seq_lens", COMPILED_PREFILL,
                         ids=map(case_id, COMPILED_PREFILL))
def test_cpu_paged_prefill_matches_reference(dtype, d, page, h, hkv, query_lens, seq_lens):
    kc, vc, kp, vp, tables = paged_cache(seq_lens, page, hkv, d, dtype)
    qkv = randn(sum(query_lens), (h + 2 * hkv) * d, dtype=dtype)
    q = qkv[:, :h * d].view(-1, h, d)  # a strided view, as the model passes it
    lens = torch.tensor(seq_lens)
    start, q_index, out_index = prefill_indices(query_lens)
    out = cpu.paged_prefill_attention(q, kp, vp, tables, lens, start, q_index, out_index, max(seq_lens), d ** -0.5)
    want = ref.paged_prefill_attention(q, kc, vc, tables.long(), lens, start, q_index, out_index, max(seq_lens),
                                       d ** -0.5)
    torch.testing.assert_close(out.float(), want.float(), **ATTN_TOL[dtype])


@pytest.mark.parametrize("dtype,d,page,h,hkv,query_lens,seq_lens,window,softcap", WINDOW_CASES,
                         ids=map(case_id, WINDOW_CASES))
def test_cpu_windows_and_softcap_match_reference(dtype, d, page, h, hkv, query_lens, seq_lens, window, softcap,
                                                 compiled):
    """A sliding window and Gemma 2's cap: decode in C (it reads only the window's blocks: NaN in the
    others would show), prefill per sequence; both against the reference."""
    *caches, tables = paged_cache(seq_lens, page, hkv, d, dtype)
    q = randn(sum(query_lens), h, d, dtype=dtype)
    out, want = against_reference(cpu, q, caches, tables, seq_lens, query_lens, d ** -0.5, window, softcap)
    torch.testing.assert_close(out.float(), want.float(), **ATTN_TOL[dtype])


@pytest.mark.parametrize("dtype,d,page,h,hkv,query_lens,seq_lens,window", SINK_CASES, ids=map(case_id, SINK_CASES))
def test_cpu_attention_sinks_match_reference(dtype, d, page, h, hkv, query_lens, seq_lens, window, compiled):
    """GPT-OSS's sinks: decode in C (the sink's term added to each head's sum at the end), prefill per sequence;
    a head whose sink is far above its scores gives ~0."""
    *caches, tables = paged_cache(seq_lens, page, hkv, d, dtype)
    q = randn(sum(query_lens), h, d, dtype=dtype)
    out, want = against_reference(cpu, q, caches, tables, seq_lens, query_lens, d ** -0.5, window, sinks=sinks_for(h))
    torch.testing.assert_close(out.float(), want.float(), **ATTN_TOL[dtype])
    assert out[:, 1].abs().max() < 1e-6 and want[:, 0].abs().max() > 1e-3
    plain = against_reference(cpu, q, caches, tables, seq_lens, query_lens, d ** -0.5, window)[0]
    assert not torch.allclose(out.float(), plain.float(), atol=1e-3)  # (the sinks change every head)


@pytest.mark.parametrize("dtype,cache_dtype,d,page,h,hkv,query_lens,seq_lens,window,softcap", FP8_CASES,
                         ids=map(case_id, FP8_CASES))
def test_cpu_attention_over_an_fp8_cache_matches_reference(dtype, cache_dtype, d, page, h, hkv, query_lens, seq_lens,
                                                           window, softcap, compiled):
    """An fp8 cache (``--kv-cache-dtype fp8``) under fp32 and bf16 queries: decode in C (widening 16
    values at a time; NaN in unowned slots would show), prefill per sequence."""
    *caches, tables = fp8_caches(seq_lens, page, hkv, d, cache_dtype)
    q = randn(sum(query_lens), h, d, dtype=dtype)
    assert attention.decodes_in_c(d, page)
    out, want = against_reference(cpu, q, caches, tables, seq_lens, query_lens, d ** -0.5, window, softcap)
    assert out.dtype == dtype
    torch.testing.assert_close(out.float(), want.float(), **ATTN_TOL[dtype])
    # the reference reads an fp8 cache as its values, widened: attention over a cache of those values
    widened = (caches[0].float().to(dtype), caches[1].float().to(dtype)) * 2
    assert torch.equal(want, against_reference(ref, q, widened, tables, seq_lens, query_lens, d ** -0.5, window,
                                               softcap)[1])


@pytest.mark.parametrize("dtype", [F32, BF16])
@pytest.mark.parametrize("cache_dtype", [E4M3, E5M2])
def test_cpu_decode_reads_every_fp8_byte_as_torch_does(dtype, cache_dtype, compiled):
    """One key: the output is its value row, widened. Rows of 72 (16 at a time, then a table for the last
    8), each of the 256 bytes in both parts, come out as torch reads them, NaN and infinities included."""
    rows = [[(64 * r + i) % 256 for i in range(64)] + [8 * r + i for i in range(8)] for r in range(32)]
    v = torch.tensor(rows, dtype=torch.uint8).view(32, 1, 1, 72).view(cache_dtype)
    out = cpu.paged_decode_attention(torch.zeros(32, 1, 72, dtype=dtype), torch.zeros_like(v), v,
                                     torch.arange(32).view(32, 1), torch.ones(32, dtype=torch.int64), 1, 1.0)
    want = v.float().view(32, 1, 72).to(dtype)
    assert torch.equal(out.isnan(), want.isnan()) and torch.equal(out.nan_to_num(), want.nan_to_num())


def test_cpu_fp8_widening_without_avx2_matches_reference(monkeypatch, compiled):
    """Built for a CPU without AVX2 and F16C (-O3 alone, the last flags ``build`` tries): fp8 caches are
    widened through a table of the 256 values instead, to the same values."""
    monkeypatch.setattr(build, "FLAG_SETS", [["-O3"]])
    attention._library.cache_clear()
    try:
        for cache_dtype in (E4M3, E5M2):
            kc, vc, kp, vp, tables = fp8_caches([1, 17, 40, 100], 16, 2, 64, cache_dtype)
            lens, q = torch.tensor([1, 17, 40, 100]), randn(4, 8, 64)
            out = cpu.paged_decode_attention(q, kp, vp, tables, lens, 100, 0.125)
            want = ref.paged_decode_attention(q, kc, vc, tables.long(), lens, 100, 0.125)
            torch.testing.assert_close(out, want, **ATTN_TOL[F32])
    finally:
        attention._library.cache_clear()


@pytest.mark.parametrize("dtype,cache_dtype,window,softcap", [(F32, F32, 0, 0.0), (BF16, BF16, 20, 0.0),
                                                             (BF16, E4M3, 0, 3.0), (F32, E5M2, 0, 0.0)])
@pytest.mark.parametrize("h,hkv", [(9, 3), (20, 2), (9, 1)], ids=["3_per_kv", "10_per_kv", "9_on_one"])
def test_cpu_decode_heads_of_one_kv_head_walk_it_together_each_to_its_own_bits(dtype, cache_dtype, window, softcap,
                                                                               h, hkv, compiled):
    """A KV head's query heads walk its blocks together (up to 8 at a time: 10 go as 8 and 2): each head's
    output is, to the bit, what it gets from a cache where it has a KV head of its own (so walks alone); with
    a window, a cap, bf16 and fp8, on one thread and two (two split one sequence's KV heads)."""
    lens = [1, 40, 16, 203]
    *caches, tables = paged_cache(lens, 16, hkv, 64, F32)
    k, v = (ref.to_cache(c, cache_dtype) for c in caches[2:])
    own_k, own_v = (c.repeat_interleave(h // hkv, dim=2) for c in (k, v))  # KV head i for query head i
    q, lens = randn(len(lens), h, 64, dtype=dtype), torch.tensor(lens)
    threads = torch.get_num_threads()
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            together = cpu.paged_decode_attention(q, k, v, tables, lens, 203, 0.125, window, softcap)
            alone = cpu.paged_decode_attention(q, own_k, own_v, tables, lens, 203, 0.125, window, softcap)
            assert torch.equal(together, alone), n
            # and one sequence alone (two threads: a KV head each)
            assert torch.equal(together, _each_row_alone(q, k, v, tables, lens, window, softcap)), n
    finally:
        torch.set_num_threads(threads)
    _assert_near_reference(together, q, caches, cache_dtype, tables, lens, window, softcap)


def _each_row_alone(q, k, v, tables, lens, window, softcap):
    """Each row's decode (scale 0.125) in a call of its own, the rows stacked."""
    return torch.cat([cpu.paged_decode_attention(q[i:i + 1], k, v, tables[i:i + 1], lens[i:i + 1], int(lens[i]),
                                                 0.125, window, softcap) for i in range(len(lens))])


def _assert_near_reference(out, q, caches, cache_dtype, tables, lens, window, softcap):
    """out is the reference's decode (scale 0.125) over the clean caches in cache_dtype, to q's tolerance."""
    k, v = (ref.to_cache(c, cache_dtype) for c in caches[:2])
    want = ref.paged_decode_attention(q, k, v, tables.long(), lens, int(lens.max()), 0.125, window, softcap)
    torch.testing.assert_close(out.float(), want.float(), **ATTN_TOL[q.dtype])


@pytest.mark.parametrize("dtype,cache_dtype,window,softcap", [(F32, F32, 0, 0.0), (BF16, BF16, 600, 0.0),
                                                             (F32, E4M3, 0, 3.0), (BF16, E5M2, 0, 0.0)])
def test_cpu_decode_rows_on_one_block_table_walk_it_together_to_the_same_results(dtype, cache_dtype, window, softcap,
                                                                                 compiled):
    """A request's decode row and its drafts (tables that agree where they read, one more key each), beside
    other sequences: walked together a span of blocks at a time, each row's output is, to the bit, what it
    gets alone;
    with a window, a cap, bf16 and fp8, contexts of several spans, on one thread and two."""
    lens = [1100, 1101, 1102, 1103, 300, 1050, 1051]  # a request with three drafts, another sequence, one with a draft
    rows = [0, 0, 0, 0, 1, 2, 2]  # (spans of 256 tokens in fp32, 512 in bf16, 1024 in fp8)
    *caches, tables = paged_cache([1103, 300, 1051], 16, 3, 64, F32)
    k, v = (ref.to_cache(c, cache_dtype) for c in caches[2:])
    tables, lens = tables[rows], torch.tensor(lens)
    tables[1, -1] = 0  # past what its row reads a table may hold anything (CPU graphs leave old ids there)
    q = randn(len(lens), 9, 64, dtype=dtype)
    threads = torch.get_num_threads()
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            together = cpu.paged_decode_attention(q, k, v, tables, lens, 1103, 0.125, window, softcap)
            assert torch.equal(together, _each_row_alone(q, k, v, tables, lens, window, softcap)), n
    finally:
        torch.set_num_threads(threads)
    _assert_near_reference(together, q, caches, cache_dtype, tables, lens, window, softcap)


def test_cpu_attention_w1_shapes(compiled):
    """SmolLM2's heads on W1-sized batches: 37 decodes (several of the reference's groups; each
    sequence is one thread's work, so 1 and 2 threads agree to the bit), and a long prompt beside
    a chunk after a cached prefix."""
    seq_lens = [(37 * i) % 300 + 1 for i in range(37)]
    kc, vc, kp, vp, tables = paged_cache(seq_lens, 16, 3, 64, F32)
    q = randn(37, 9, 64)
    lens = torch.tensor(seq_lens)
    threads = torch.get_num_threads()
    try:
        outs = []
        for n in (1, 2):
            torch.set_num_threads(n)
            outs.append(cpu.paged_decode_attention(q, kp, vp, tables, lens, 300, 0.125))
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(outs[0], outs[1])
    want = ref.paged_decode_attention(q, kc, vc, tables.long(), lens, 300, 0.125)
    torch.testing.assert_close(outs[0], want, **ATTN_TOL[F32])

    query_lens, seq_lens = [300, 40], [300, 150]
    kc, vc, kp, vp, tables = paged_cache(seq_lens, 16, 3, 64, F32)
    q = randn(340, 9, 64)
    lens = torch.tensor(seq_lens)
    start, q_index, out_index = prefill_indices(query_lens)
    out = cpu.paged_prefill_attention(q, kp, vp, tables, lens, start, q_index, out_index, 300, 0.125)
    want = ref.paged_prefill_attention(q, kc, vc, tables.long(), lens, start, q_index, out_index, 300, 0.125)
    torch.testing.assert_close(out, want, **ATTN_TOL[F32])


def test_cpu_attention_module_mixed_batch(monkeypatch, compiled):
    """The engine's Attention layer on a batch of decodes and prompt chunks, the CPU kernels
    behind it (``auto``), against naive per-sequence attention (tests/test_kernels.py's spec)."""
    from tests.test_kernels import make_batch, naive_attention

    monkeypatch.setattr(kernels, "_backend", "auto")
    calls = []
    for fn in ("paged_decode_attention", "paged_prefill_attention"):
        real = getattr(cpu, fn)
        monkeypatch.setattr(cpu, fn, lambda *a, _real=real, _fn=fn, **k: calls.append(_fn) or _real(*a, **k))
    query_lens, seq_lens = [1, 7, 1, 2, 5], [13, 7, 4, 8, 5]
    attn, q, new_k, new_v, ks, vs, meta, _ = make_batch(seq_lens, query_lens, F32, seed=3)
    out = attn(q, new_k, new_v, meta)
    want, row = [], 0
    for k, v, n, ql in zip(ks, vs, seq_lens, query_lens, strict=True):
        want.append(naive_attention(q[row:row + ql], k, v, n - ql))
        row += ql
    torch.testing.assert_close(out, torch.cat(want), rtol=1e-4, atol=1e-5)
    assert sorted(calls) == ["paged_decode_attention", "paged_prefill_attention"]


def test_cpu_dispatch(monkeypatch):
    x = torch.ones(2, 4)
    monkeypatch.setattr(kernels, "_backend", "auto")
    assert kernels._pick(x) is cpu
    monkeypatch.setattr(kernels, "_backend", "reference")  # TOKENMILL_KERNELS=reference
    assert kernels._pick(x) is ref


@pytest.mark.parametrize("dtype,d", [(F16, 32), (F32, 12), (F32, 264)], ids=["float16", "head-12", "head-264"])
def test_cpu_decode_sends_what_its_c_code_does_not_take_to_the_reference(dtype, d):
    kc, vc, _, _, tables = paged_cache([9, 20], 16, 2, d, dtype)
    q = randn(2, 4, d, dtype=dtype)
    lens = torch.tensor([9, 20])
    out = cpu.paged_decode_attention(q, kc, vc, tables.long(), lens, 20, 0.2)
    assert torch.equal(out, ref.paged_decode_attention(q, kc, vc, tables.long(), lens, 20, 0.2))


def _args() -> dict:
    return dict(q=randn(2, 4, 16), k_cache=randn(4, 8, 2, 16), v_cache=randn(4, 8, 2, 16),
                block_tables=torch.zeros(2, 2, dtype=torch.int64), seq_lens=torch.tensor([3, 9]), max_seq_len=9,
                scale=0.25)


BAD_CALLS = {
    "head_dim mismatch": (lambda a: a.update(q=randn(2, 4, 32)), "head_dim"),
    "mixed dtypes": (lambda a: a.update(k_cache=a["k_cache"].to(BF16)), "q.s dtype or an fp8 one"),
    "heads not a multiple": (lambda a: a.update(q=randn(2, 3, 16)), "multiple"),
    "strided cache": (lambda a: a.update(k_cache=randn(4, 8, 4, 16)[:, :, ::2]), "contiguous"),
    "table too narrow": (lambda a: a.update(max_seq_len=17), "cannot hold"),
    "seq_lens rows": (lambda a: a.update(block_tables=a["block_tables"][:1]), "one row per sequence"),
}


@pytest.mark.parametrize("case", BAD_CALLS)
def test_cpu_attention_refuses_bad_arguments(case, compiled):
    spoil, message = BAD_CALLS[case]
    args = _args()
    spoil(args)
    with pytest.raises(ValueError, match=message):
        cpu.paged_decode_attention(**args)
    start = torch.arange(args["seq_lens"].shape[0] + 1)
    with pytest.raises(ValueError, match=message):
        cpu.paged_prefill_attention(args["q"], args["k_cache"], args["v_cache"], args["block_tables"],
                                    args["seq_lens"], start, None, None, args["max_seq_len"], args["scale"])


def test_cpu_kernels_fall_back_without_a_compiler(monkeypatch, tmp_path, caplog):
    monkeypatch.setenv("TOKENMILL_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(build, "_compiler", lambda: None)
    with caplog.at_level(logging.WARNING, "tokenmill.kernels"):
        assert build.load("paged_attention.c") is None
    assert "no C compiler" in caplog.text

    monkeypatch.setattr(build, "_compiler", lambda: ["cc"])
    monkeypatch.setattr(build, "FLAG_SETS", (["-no-such-flag"],))
    caplog.clear()
    with caplog.at_level(logging.WARNING, "tokenmill.kernels"):
        assert build.load("paged_attention.c") is None
    assert "could not build paged_attention.c" in caplog.text and not list(tmp_path.iterdir())

    monkeypatch.setattr(attention, "_library", lambda: None)  # what the engine sees then: the reference
    args = _args()
    assert torch.equal(cpu.paged_decode_attention(**args), ref.paged_decode_attention(**args))


@pytest.mark.parametrize("backend", ["reference", "cpu"])
def test_bf16_decode_and_prefill_compute_alike(backend):
    """One accumulation rule (float32) for decode and prefill: the last token of a context attends
    the same whether decoded or recomputed as a prefill (a preempted request's), so recompute cannot
    change a bf16 greedy output. Rounding scores to bf16 in decode once made 2/3 of these differ."""
    mod = ref if backend == "reference" else cpu
    seq_lens, d, h, hkv = [40, 77, 130], 64, 9, 3
    kc, vc, _, _, tables = paged_cache(seq_lens, 16, hkv, d, BF16)
    q = (randn(len(seq_lens), h, d) * 3).to(BF16)  # scores of a few units: bf16 rounding would show
    lens = torch.tensor(seq_lens)
    start, q_index, out_index = prefill_indices([1] * len(seq_lens))
    decoded = mod.paged_decode_attention(q, kc, vc, tables.long(), lens, max(seq_lens), d ** -0.5)
    prefilled = mod.paged_prefill_attention(q, kc, vc, tables.long(), lens, start, q_index, out_index,
                                            max(seq_lens), d ** -0.5)
    assert (decoded != prefilled).float().mean() < 0.01  # summation order may move a rare last bit
    torch.testing.assert_close(decoded.float(), prefilled.float(), rtol=0, atol=1e-2)


def test_cpu_kernel_build_takes_a_compiler_with_arguments_and_a_private_folder(monkeypatch, tmp_path):
    monkeypatch.setenv("CC", "env gcc")  # as ``ccache gcc`` would be
    assert build._compiler()[:2] == ["env", "gcc"]
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o777)
    shared.chmod(0o777)  # others could plant a library here: not used
    assert not private(str(shared))
    shared.chmod(0o700)
    assert private(str(shared))


def test_cpu_decode_refuses_a_sequence_longer_than_its_table(compiled):
    args = _args()
    args["seq_lens"] = args["seq_lens"].clone().fill_(10**5)
    with pytest.raises(ValueError, match="does not fit"):
        cpu.paged_decode_attention(**args)


@pytest.mark.parametrize("dtype", [F32, BF16])
@pytest.mark.parametrize("t", [1, 5])
def test_cpu_store_kvcache_matches_reference_from_the_qkv_output(dtype, t, compiled):
    hkv, d, h = 2, 16, 4
    qkv = randn(t, (h + 2 * hkv) * d, dtype=dtype)  # k and v are views of the fused projection, rows apart
    k, v = qkv[:, h * d:(h + hkv) * d].view(t, hkv, d), qkv[:, (h + hkv) * d:].view(t, hkv, d)
    slots = torch.randperm(6 * 4)[:t]
    kc, vc = torch.full((6, 4, hkv, d), float("nan"), dtype=dtype), torch.full((6, 4, hkv, d), float("nan"), dtype=dtype)
    want_k, want_v = kc.clone(), vc.clone()
    cpu.store_kvcache(k, v, kc, vc, slots)
    ref.store_kvcache(k, v, want_k, want_v, slots)
    assert torch.equal(kc.nan_to_num(7), want_k.nan_to_num(7)) and torch.equal(vc.nan_to_num(7), want_v.nan_to_num(7))
    assert kc.isnan().sum() == (6 * 4 - t) * hkv * d  # nothing else written


@pytest.mark.parametrize("dtype", [F32, BF16])
@pytest.mark.parametrize("cache_dtype", [E4M3, E5M2])
def test_cpu_store_kvcache_into_fp8_rounds_as_the_reference(dtype, cache_dtype, compiled):
    """Every float16 value, random ones from 1e-12 to 1e6, and the edges (the largest value and past it,
    infinities, NaN, signed zeros, subnormals and the halfway points between them) go in byte for byte
    as ``reference.to_cache`` (torch's rounding) puts them, the unused slot left alone."""
    halves = torch.arange(-2 ** 15, 2 ** 15, dtype=torch.int32).to(torch.int16).view(torch.float16).float()
    g = torch.Generator().manual_seed(5)
    spread = torch.randn(20000, generator=g) * torch.logspace(-12, 6, 20000)
    values = torch.cat([halves, spread, torch.tensor(FP8_EDGES)])
    values = torch.cat([values, values.new_zeros(-len(values) % 32)]).to(dtype).view(-1, 2, 16)
    check_fp8_store(cpu.store_kvcache, values, cache_dtype)


def test_cpu_store_kvcache_refuses_a_slot_outside_the_cache_and_stores_nothing(compiled):
    k = randn(3, 2, 8)
    kc, vc = torch.zeros(2, 4, 2, 8), torch.zeros(2, 4, 2, 8)
    for bad in (8, -1):
        with pytest.raises(IndexError, match="slot past the KV cache"):
            cpu.store_kvcache(k, k, kc, vc, torch.tensor([0, 1, bad]))
        assert not kc.any() and not vc.any()


# ---------------------------------------------------------------- linear (kernels/cpu/matmul.c)

LINEAR_SHAPES = [  # (M, N, K): N past a whole block of 6 rows, K not a multiple of 8, 1 row, many rows
    (1, 7, 13), (1, 96, 64), (2, 6, 16), (3, 12, 24), (4, 31, 40), (5, 64, 72), (7, 33, 8), (17, 50, 100),
    (64, 96, 64),
]
LINEAR_TOL = {F32: dict(rtol=1e-5, atol=1e-5), BF16: dict(rtol=1e-2, atol=1e-2)}


@pytest.fixture
def c_linear():
    if matmul._library() is None:
        pytest.skip("no working C compiler here: linear stays with torch")
    yield
    matmul.reset()


@pytest.mark.parametrize("dtype", [F32, BF16], ids=str)
@pytest.mark.parametrize("bias", [False, True], ids=["", "bias"])
@pytest.mark.parametrize("m,n,k", LINEAR_SHAPES, ids=lambda v: str(v))
def test_cpu_linear_matches_torch(m, n, k, bias, dtype, c_linear):
    x, w = randn(m, k, dtype=dtype), randn(n, k, dtype=dtype)
    b = randn(n, dtype=dtype) if bias else None
    out = matmul.linear_c(x, w, b)
    want = torch.nn.functional.linear(x.float(), w.float(), None if b is None else b.float())
    assert out.dtype == dtype and out.shape == (m, n) and not out.isnan().any()
    torch.testing.assert_close(out.float(), want, **LINEAR_TOL[dtype])


@pytest.mark.parametrize("dtype", [F32, BF16], ids=str)
def test_cpu_linear_row_results_do_not_depend_on_the_batch(dtype, c_linear):
    """A row computes the same bits alone or among others (one row takes another tile shape)."""
    x, w = randn(11, 72, dtype=dtype), randn(37, 72, dtype=dtype)
    together = matmul.linear_c(x, w)
    for i in range(len(x)):
        assert torch.equal(matmul.linear_c(x[i:i + 1], w)[0], together[i])


def test_cpu_linear_takes_strided_and_3d_inputs(monkeypatch, c_linear):
    monkeypatch.setenv("TOKENMILL_CPU_LINEAR_ROWS", "8")
    w = randn(20, 16)
    matmul.tune([w])
    x = randn(2, 3, 32)[..., ::2]  # (2, 3, 16), not contiguous: 6 rows
    torch.testing.assert_close(kernels.linear(x, w), torch.nn.functional.linear(x, w), rtol=1e-5, atol=1e-5)


def test_cpu_linear_dispatch_follows_the_tuning(monkeypatch, c_linear):
    calls = []
    real = matmul.linear_c
    monkeypatch.setattr(matmul, "linear_c", lambda *a: calls.append(a[0].shape[0]) or real(*a))
    w, other = randn(12, 16), randn(12, 24)
    monkeypatch.setenv("TOKENMILL_CPU_LINEAR_ROWS", "4")
    assert matmul.tune([w, w]) == {(12, 16, F32): (1, 2, 4)}  # logged and returned once per shape
    for rows in (1, 3, 4, 5, 40):
        kernels.linear(randn(rows, 16), w)
    kernels.linear(randn(2, 24), other)  # a shape never tuned: torch
    monkeypatch.setattr(kernels, "_backend", "reference")  # TOKENMILL_KERNELS=reference: torch everywhere
    kernels.linear(randn(2, 16), w)
    assert calls == [1, 3, 4]

    monkeypatch.setattr(kernels, "_backend", "auto")
    monkeypatch.setenv("TOKENMILL_CPU_LINEAR_ROWS", "0")
    matmul.tune([w])
    kernels.linear(randn(1, 16), w)
    assert calls == [1, 3, 4]

    monkeypatch.setenv("TOKENMILL_CPU_LINEAR_ROWS", "lots")
    with pytest.raises(ValueError, match="TOKENMILL_CPU_LINEAR_ROWS"):
        matmul.tune([w])


def test_cpu_linear_measured_tuning(monkeypatch, c_linear):
    monkeypatch.delenv("TOKENMILL_CPU_LINEAR_ROWS", raising=False)
    ws = [randn(64, 32) for _ in range(3)] + [randn(8, 8, dtype=BF16)]
    taken = matmul.tune(ws)
    assert set(taken) == {(64, 32, F32), (8, 8, BF16)}
    for shape, rows in taken.items():
        assert set(rows) <= set(matmul.ROWS)
        use = matmul._use_c[shape]
        assert 1 <= len(use) <= len(matmul.ROWS) and rows == tuple(m for m, c in zip(matmul.ROWS, use, strict=False) if c)


def test_cpu_linear_without_a_compiler_stays_with_torch(monkeypatch):
    monkeypatch.delenv("TOKENMILL_CPU_LINEAR_ROWS", raising=False)
    monkeypatch.setattr(matmul, "_library", lambda: None)
    w = randn(12, 16)
    try:
        assert matmul.tune([w]) == {(12, 16, F32): ()}
        x = randn(2, 16)
        assert torch.equal(kernels.linear(x, w), torch.nn.functional.linear(x, w))
        with pytest.raises(RuntimeError, match="could not be built"):
            matmul.linear_c(x, w)
    finally:
        matmul.reset()


BAD_LINEAR = {
    "K mismatch": ((randn(2, 8), randn(4, 9), None), "must be"),
    "1-D x": ((randn(8), randn(4, 8), None), "must be"),
    "mixed dtypes": ((randn(2, 8), randn(4, 8, dtype=BF16), None), "one dtype"),
    "float16": ((randn(2, 8, dtype=F16), randn(4, 8, dtype=F16), None), "one dtype"),
    "bias length": ((randn(2, 8), randn(4, 8), randn(5)), r"bias must be \(4,\)"),
}


@pytest.mark.parametrize("case", BAD_LINEAR)
def test_cpu_linear_refuses_bad_arguments(case, c_linear):
    args, message = BAD_LINEAR[case]
    with pytest.raises(ValueError, match=message):
        matmul.linear_c(*args)


# ---------------------------------------------------------------- RMSNorm, RoPE, SiLU-and-mul (elementwise.c)


@pytest.fixture
def c_elementwise():
    if elementwise._library() is None:
        pytest.skip("no working C compiler here: the reference serves")


def _rope_inputs(t: int, h: int, hkv: int, d: int, dtype: torch.dtype):
    """A fused qkv projection's output, q and k as the model views it, and cos/sin of random positions."""
    qkv = randn(t, (h + 2 * hkv) * d, dtype=dtype)
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
    freqs = torch.outer(torch.randint(0, 4096, (t,)).float(), inv)
    return qkv, freqs.cos().to(dtype), freqs.sin().to(dtype)


def _q_k(qkv: torch.Tensor, h: int, hkv: int, d: int) -> tuple[torch.Tensor, torch.Tensor]:
    t = qkv.shape[0]
    return qkv[:, :h * d].view(t, h, d), qkv[:, h * d:(h + hkv) * d].view(t, hkv, d)


@pytest.mark.parametrize("dtype", [F32, BF16], ids=str)
@pytest.mark.parametrize("t,dim", [(1, 64), (3, 576), (40, 100), (300, 576)])
def test_cpu_norms_and_silu_match_reference(t, dim, dtype, c_elementwise):
    """bf16 bit for bit (each step rounded where torch rounds) but for a rare last bit that the order
    of the sum of squares moves; fp32 to that order."""
    x, res, w = randn(t, dim, dtype=dtype), randn(t, dim, dtype=dtype), randn(dim, dtype=dtype)
    gate_up = randn(t, 2 * dim, dtype=dtype)
    got = [elementwise.rms_norm(x, w, 1e-6), *elementwise.fused_add_rms_norm(x, res, w, 1e-6),
           elementwise.silu_and_mul(gate_up)]
    want = [ref.rms_norm(x, w, 1e-6), *ref.fused_add_rms_norm(x, res, w, 1e-6), ref.silu_and_mul(gate_up)]
    for g, r in zip(got, want, strict=True):
        assert g.dtype == dtype and g.shape == r.shape
        if dtype == BF16:
            assert (g != r).float().mean() < 1e-3
            torch.testing.assert_close(g, r, rtol=1e-2, atol=1e-2)
        else:
            torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-6)


def test_cpu_silu_far_out(c_elementwise):
    """fp32 SiLU runs 8 at a time with its own exp: large and tiny gates, NaN and a tail past the 8s."""
    gate = torch.tensor([-200.0, -88.5, -87.0, -20.0, -1e-3, 0.0, 1e-3, 20.0, 87.0, 88.5, 200.0, float("nan"), 1.5])
    up = torch.linspace(-2.0, 3.0, len(gate))
    got = elementwise.silu_and_mul(torch.cat([gate, up])[None])[0]
    want = ref.silu_and_mul(torch.cat([gate, up])[None])[0]
    assert got[11].isnan() and want[11].isnan()
    keep = ~want.isnan()
    torch.testing.assert_close(got[keep], want[keep], rtol=1e-6, atol=1e-30)


def test_cpu_silu_bf16_is_torchs_bit_for_bit_far_out_too(c_elementwise):
    """bf16 SiLU runs 8 at a time with that exp, rounded where torch rounds: the same bits as torch's on a
    million random gates, and on gates far out (below -88, where that exp clamps, 8 at a time as expf), NaN,
    infinities, signed zeros, and a tail past the 8s."""
    gen = torch.Generator().manual_seed(0)
    gate_up = (torch.randn(256, 2 * 2052, generator=gen) * 4).to(BF16)
    far = [-float("inf"), -200.0, -100.0, -88.5, -88.0, -87.0, -1e-30, -0.0, 0.0, 88.5, 200.0, float("inf"),
           float("nan")]
    gate_up[0, :len(far)] = torch.tensor(far)
    gate_up[1, 2052 - len(far):2052] = torch.tensor(far)  # (the tail: 2052 is 4 past a multiple of 8)
    got, want = elementwise.silu_and_mul(gate_up), ref.silu_and_mul(gate_up)
    assert torch.equal(got.isnan(), want.isnan()) and torch.equal(got.nan_to_num(), want.nan_to_num())
    assert torch.equal(got.signbit() | got.isnan(), want.signbit() | want.isnan())  # (-0 where torch has it)


@pytest.mark.parametrize("dtype", [F32, BF16], ids=str)
@pytest.mark.parametrize("t,h,hkv,d", [(1, 9, 3, 64), (7, 4, 4, 128), (33, 6, 2, 32), (300, 9, 3, 64)])
def test_cpu_rope_matches_reference_in_place_in_the_qkv_output(t, h, hkv, d, dtype, c_elementwise):
    qkv, cos, sin = _rope_inputs(t, h, hkv, d, dtype)
    want = qkv.clone()
    elementwise.apply_rope_(*_q_k(qkv, h, hkv, d), cos, sin)
    ref.apply_rope_(*_q_k(want, h, hkv, d), cos, sin)
    assert torch.equal(qkv, want)  # v untouched, q and k rotated exactly as the reference rotates


def test_cpu_elementwise_leaves_what_it_does_not_take_to_the_reference(c_elementwise):
    x16, w16 = randn(3, 64, dtype=F16), randn(64, dtype=F16)
    assert torch.equal(elementwise.rms_norm(x16, w16, 1e-6), ref.rms_norm(x16, w16, 1e-6))
    strided = randn(3, 128)[:, ::2]
    w = randn(64)
    assert torch.equal(elementwise.rms_norm(strided, w, 1e-6), ref.rms_norm(strided, w, 1e-6))
    qkv, cos, sin = _rope_inputs(4, 2, 2, 16, F32)
    q, k = qkv.view(4, 6, 16).transpose(0, 1)[:2].transpose(0, 1), _q_k(qkv, 2, 2, 16)[1]  # heads not side by side
    want = qkv.clone()
    wq, wk = want.view(4, 6, 16).transpose(0, 1)[:2].transpose(0, 1), _q_k(want, 2, 2, 16)[1]
    elementwise.apply_rope_(q, k, cos, sin)
    ref.apply_rope_(wq, wk, cos, sin)
    assert torch.equal(qkv, want)
