"""Every Triton kernel (``kernels.triton``) against its reference twin
(``kernels.reference``, the spec), its launcher's argument checks, and the
engine's greedy outputs with the Triton kernels against the references.

On CUDA the kernels run compiled; elsewhere through Triton's interpreter
(``tests/conftest.py`` turns it on before triton is imported). Each case draws
fresh random inputs, and fresh outputs come back full of NaN (``poison``), so an
element a kernel forgets to write cannot pass.
"""

from __future__ import annotations

import functools
import os
import re
import subprocess
import sys

import pytest
import torch

pytest.importorskip("triton")

import engine.attention as engine_attention  # noqa: E402
import kernels  # noqa: E402
import kernels.reference as ref  # noqa: E402
import kernels.triton as tri  # noqa: E402
from kernels.triton.launch import interpreting  # noqa: E402
from tests.paged_cases import (  # noqa: E402
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
    sinks_for,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu" and not interpreting():
    raise RuntimeError("Triton kernels on the CPU need TRITON_INTERPRET=1 before triton is imported "
                       "(tests/conftest.py sets it where nvidia-smi is missing)")

# fp32 to 1e-4 relative; 16-bit: a few ulps (the interpreter also rounds to bf16 by truncation)
TOL = {F32: dict(rtol=1e-4, atol=1e-5), BF16: dict(rtol=2e-2, atol=2e-2), F16: dict(rtol=2e-3, atol=2e-3)}
_seed = iter(range(10**6))


def gen() -> torch.Generator:
    """A fresh generator per input, so every case sees new numbers yet reruns alike."""
    return torch.Generator().manual_seed(next(_seed))


def randn(*shape: int, dtype: torch.dtype = F32) -> torch.Tensor:
    return torch.randn(*shape, generator=gen()).to(dtype=dtype, device=DEVICE)


@pytest.fixture
def poison(monkeypatch):
    """torch.empty / empty_like hand out NaN-filled float tensors while the test runs."""
    empty, empty_like = torch.empty, torch.empty_like

    def fill(t: torch.Tensor) -> torch.Tensor:
        return t.fill_(float("nan")) if t.is_floating_point() else t

    monkeypatch.setattr(torch, "empty", lambda *a, **k: fill(empty(*a, **k)))
    monkeypatch.setattr(torch, "empty_like", lambda *a, **k: fill(empty_like(*a, **k)))


# ---------------------------------------------------------------- paged attention


@pytest.mark.parametrize("dtype,d,page,h,hkv,seq_lens,splits", DECODE_CASES, ids=map(case_id, DECODE_CASES))
def test_triton_paged_decode_matches_reference(dtype, d, page, h, hkv, seq_lens, splits, poison):
    kc, vc, kp, vp, tables = paged_cache(seq_lens, page, hkv, d, dtype, DEVICE)
    q = randn(len(seq_lens), h, d, dtype=dtype)
    lens = torch.tensor(seq_lens, device=DEVICE)
    scale = d ** -0.5
    out = tri.paged_decode_attention(q, kp, vp, tables, lens, max(seq_lens), scale, num_splits=splits)
    want = ref.paged_decode_attention(q, kc, vc, tables.long(), lens, max(seq_lens), scale)
    torch.testing.assert_close(out.float(), want.float(), **ATTN_TOL[dtype])


@pytest.mark.parametrize("dtype,d,page,h,hkv,query_lens,seq_lens", PREFILL_CASES, ids=map(case_id, PREFILL_CASES))
def test_triton_paged_prefill_matches_reference(dtype, d, page, h, hkv, query_lens, seq_lens, poison):
    kc, vc, kp, vp, tables = paged_cache(seq_lens, page, hkv, d, dtype, DEVICE)
    qkv = randn(sum(query_lens), (h + 2 * hkv) * d, dtype=dtype)
    q = qkv[:, :h * d].view(-1, h, d)  # a strided view, as the model passes it
    lens = torch.tensor(seq_lens, device=DEVICE)
    start, q_index, out_index = prefill_indices(query_lens, DEVICE)
    scale = d ** -0.5
    out = tri.paged_prefill_attention(q, kp, vp, tables, lens, start, q_index, out_index, max(seq_lens), scale)
    want = ref.paged_prefill_attention(q, kc, vc, tables.long(), lens, start, q_index, out_index,
                                       max(seq_lens), scale)
    torch.testing.assert_close(out.float(), want.float(), **ATTN_TOL[dtype])


@pytest.mark.parametrize("dtype,d,page,h,hkv,query_lens,seq_lens,window,softcap", WINDOW_CASES,
                         ids=map(case_id, WINDOW_CASES))
def test_triton_windows_and_softcap_match_reference(dtype, d, page, h, hkv, query_lens, seq_lens, window, softcap,
                                                    poison):
    """A sliding window (decode split along its keys too) and Gemma 2's cap, against the reference."""
    *caches, tables = paged_cache(seq_lens, page, hkv, d, dtype, DEVICE)
    q = randn(sum(query_lens), h, d, dtype=dtype)
    for splits in (1, 3) if set(query_lens) == {1} else (None,):
        out, want = against_reference(tri, q, caches, tables, seq_lens, query_lens, d ** -0.5, window, softcap,
                                      **({"num_splits": splits} if splits else {}))
        torch.testing.assert_close(out.float(), want.float(), **ATTN_TOL[dtype])


@pytest.mark.parametrize("dtype,d,page,h,hkv,query_lens,seq_lens,window", SINK_CASES, ids=map(case_id, SINK_CASES))
def test_triton_attention_sinks_match_reference(dtype, d, page, h, hkv, query_lens, seq_lens, window, poison):
    """GPT-OSS's sinks in decode (one pass, and split along the keys: the merge adds the sink's term) and
    prefill, against the reference; a head whose sink is far above its scores gives ~0."""
    *caches, tables = paged_cache(seq_lens, page, hkv, d, dtype, DEVICE)
    q = randn(sum(query_lens), h, d, dtype=dtype)
    sinks = sinks_for(h, DEVICE)
    for splits in (1, 3) if set(query_lens) == {1} else (None,):
        out, want = against_reference(tri, q, caches, tables, seq_lens, query_lens, d ** -0.5, window, sinks=sinks,
                                      **({"num_splits": splits} if splits else {}))
        torch.testing.assert_close(out.float(), want.float(), **ATTN_TOL[dtype])
        assert out[:, 1].abs().max() < 1e-6


def test_triton_splits_agree_with_one_pass(poison):
    kc, vc, _, _, tables = paged_cache([300, 41, 1], 16, 2, 64, F32, DEVICE)
    q = randn(3, 4, 64)
    lens = torch.tensor([300, 41, 1], device=DEVICE)
    one = tri.paged_decode_attention(q, kc, vc, tables, lens, 300, 0.125, num_splits=1)
    for splits in (2, 5, 19):  # 19: more splits than 16-token tiles in the shorter sequences
        many = tri.paged_decode_attention(q, kc, vc, tables, lens, 300, 0.125, num_splits=splits)
        torch.testing.assert_close(many, one, rtol=1e-5, atol=1e-6)


def test_triton_attention_module_mixed_batch(monkeypatch):
    """The engine's Attention layer on a batch of decodes and prompt chunks, Triton kernels
    behind it, against naive per-sequence attention (tests/test_kernels.py's spec)."""
    from tests.test_kernels import make_batch, naive_attention

    monkeypatch.setattr(kernels, "_backend", "triton")
    query_lens, seq_lens = [1, 7, 1, 2, 5], [13, 7, 4, 8, 5]
    attn, q, new_k, new_v, ks, vs, meta, _ = make_batch(seq_lens, query_lens, F32, seed=3, device=DEVICE)
    out = attn(q, new_k, new_v, meta)
    want, row = [], 0
    for k, v, n, ql in zip(ks, vs, seq_lens, query_lens, strict=True):
        want.append(naive_attention(q[row:row + ql], k, v, n - ql))
        row += ql
    torch.testing.assert_close(out, torch.cat(want), rtol=1e-4, atol=1e-5)


# ---------------------------------------------------------------- KV store, norms, RoPE, activation


@pytest.mark.parametrize("dtype,hkv,d", [(F32, 2, 64), (BF16, 3, 128), (F16, 1, 8)])
def test_triton_store_kvcache_matches_reference(dtype, hkv, d):
    nblocks, page, t = 6, 16, 21
    cache = torch.full((nblocks, page, hkv, d), float("nan"), dtype=dtype, device=DEVICE)
    slots = torch.randperm(nblocks * page, generator=gen())[:t].to(DEVICE)
    kv = randn(t, 2 * hkv, d, dtype=dtype)
    k, v = kv[:, :hkv], kv[:, hkv:]  # strided views of one (T, 2Hkv, D) tensor
    kc, vc, kw, vw = cache.clone(), cache.clone(), cache.clone(), cache.clone()
    tri.store_kvcache(k, v, kc, vc, slots)
    ref.store_kvcache(k, v, kw, vw, slots)
    assert torch.equal(kc.isnan(), kw.isnan()) and torch.equal(kc.nan_to_num(), kw.nan_to_num())
    assert torch.equal(vc.isnan(), vw.isnan()) and torch.equal(vc.nan_to_num(), vw.nan_to_num())


@pytest.mark.parametrize("dtype,cache_dtype,d,page,h,hkv,query_lens,seq_lens,window,softcap", FP8_CASES,
                         ids=map(case_id, FP8_CASES))
def test_triton_attention_over_an_fp8_cache_matches_reference(dtype, cache_dtype, d, page, h, hkv, query_lens,
                                                              seq_lens, window, softcap, poison):
    """An fp8 cache (``--kv-cache-dtype fp8``), read as bytes and widened with integer arithmetic
    (``kernels.triton.fp8``); NaN in unowned slots would show."""
    *caches, tables = fp8_caches(seq_lens, page, hkv, d, cache_dtype, DEVICE)
    q = randn(sum(query_lens), h, d, dtype=dtype)
    out, want = against_reference(tri, q, caches, tables, seq_lens, query_lens, d ** -0.5, window, softcap,
                                  **({"num_splits": 2} if set(query_lens) == {1} else {}))
    torch.testing.assert_close(out.float(), want.float(), **TOL[dtype])


@pytest.mark.parametrize("dtype,cache_dtype", [(F32, E4M3), (BF16, E5M2), (F16, E4M3)])
def test_triton_store_kvcache_into_fp8_rounds_as_the_reference(dtype, cache_dtype):
    """Byte for byte as ``reference.to_cache`` (torch's rounding): values of every size, the largest and
    past it, infinities, NaN, signed zeros, subnormals and the halfway points between them (and 7.9,
    which Triton's own fp8 cast in the interpreter rounds to 4)."""
    n = 4096 - len(FP8_EDGES)
    spread = torch.randn(n, generator=gen()) * torch.logspace(-12, 6, n)
    values = torch.cat([torch.tensor(FP8_EDGES), spread]).to(dtype).view(-1, 4, 32).to(DEVICE)
    check_fp8_store(tri.store_kvcache, values, cache_dtype)


def test_triton_store_kvcache_skips_padding_slots():
    cache = torch.zeros(2, 4, 1, 16, device=DEVICE)
    k = randn(3, 1, 16)
    tri.store_kvcache(k, k, cache, cache.clone(), torch.tensor([5, -1, 0], device=DEVICE))
    flat = cache.view(8, 16)
    assert torch.equal(flat[5], k[0, 0]) and torch.equal(flat[0], k[2, 0])
    assert flat[[1, 2, 3, 4, 6, 7]].abs().sum() == 0


@pytest.mark.parametrize("dtype,t,n", [(F32, 5, 64), (BF16, 3, 576), (F16, 4, 40), (F32, 1, 1000)])
def test_triton_rms_norms_match_reference(dtype, t, n, poison):
    x, res, w = randn(t, n, dtype=dtype), randn(t, n, dtype=dtype), randn(n, dtype=dtype)
    torch.testing.assert_close(tri.rms_norm(x, w, 1e-6), ref.rms_norm(x, w, 1e-6), **TOL[dtype])
    out, new_res = tri.fused_add_rms_norm(x, res, w, 1e-5)
    want, want_res = ref.fused_add_rms_norm(x, res, w, 1e-5)
    torch.testing.assert_close(out, want, **TOL[dtype])
    torch.testing.assert_close(new_res, want_res, **TOL[dtype])
    w32 = 1 + randn(n) / 8  # Gemma's: a float32 weight (1 + w), multiplied before the one rounding
    torch.testing.assert_close(tri.rms_norm(x, w32, 1e-6), ref.rms_norm(x, w32, 1e-6), **TOL[dtype])
    out, new_res = tri.fused_add_rms_norm(x, res, w32, 1e-6)
    want, want_res = ref.fused_add_rms_norm(x, res, w32, 1e-6)
    torch.testing.assert_close(out, want, **TOL[dtype])
    torch.testing.assert_close(new_res, want_res, **TOL[dtype])


@pytest.mark.parametrize("dtype,t,h,hkv,d", [(F32, 6, 4, 2, 16), (BF16, 3, 9, 3, 64), (F16, 2, 4, 1, 128),
                                               (BF16, 2, 36, 20, 128)])  # (q's heads in 3 programs, k's in 2)
def test_triton_rope_in_place_matches_reference(dtype, t, h, hkv, d):
    qkv = randn(t, (h + 2 * hkv) * d, dtype=dtype)
    q, k = qkv[:, :h * d].view(t, h, d), qkv[:, h * d:(h + hkv) * d].view(t, hkv, d)  # views, as the model's
    ang = torch.rand(t, d // 2, generator=gen()).to(DEVICE) * 100
    cos, sin = ang.cos().to(dtype), ang.sin().to(dtype)
    q2, k2 = q.clone(), k.clone()
    v_before = qkv[:, (h + hkv) * d:].clone()
    tri.apply_rope_(q, k, cos, sin)
    ref.apply_rope_(q2, k2, cos, sin)
    torch.testing.assert_close(q, q2, **TOL[dtype])
    torch.testing.assert_close(k, k2, **TOL[dtype])
    assert torch.equal(qkv[:, (h + hkv) * d:], v_before)  # v, beside them, untouched


def test_triton_rope_on_the_first_dims_of_each_head():
    """Partial rotary (Phi-4-mini): q and k views of each head's first 12 of 16 dims; the rest untouched."""
    qkv = randn(5, 6 * 16)
    q, k = qkv[:, :64].view(5, 4, 16), qkv[:, 64:].view(5, 2, 16)
    angle = torch.rand(5, 6, generator=gen()).to(DEVICE) * 6.3
    want_q, want_k = q.clone(), k.clone()
    ref.apply_rope_(want_q[..., :12], want_k[..., :12], angle.cos(), angle.sin())
    tri.apply_rope_(q[..., :12], k[..., :12], angle.cos(), angle.sin())
    torch.testing.assert_close(q, want_q, **TOL[F32])
    torch.testing.assert_close(k, want_k, **TOL[F32])


@pytest.mark.parametrize("dtype,cache_dtype,h,hkv,d,rot,norm", [
    (F32, F32, 4, 2, 16, 16, None), (BF16, BF16, 9, 3, 64, 64, None), (F16, E4M3, 4, 1, 32, 32, None),
    (F32, F32, 4, 2, 16, 12, None), (BF16, E5M2, 7, 1, 64, 48, None), (BF16, BF16, 8, 2, 64, 64, BF16),
    (BF16, BF16, 5, 3, 32, 32, F32), (F32, F32, 4, 2, 16, 12, F32), (F16, E4M3, 6, 2, 32, 24, F16),
    (F16, F16, 36, 20, 128, 128, F16), (F32, E4M3, 40, 18, 128, 96, F32)])
def test_triton_rope_and_store_matches_the_reference_ones(dtype, cache_dtype, h, hkv, d, rot, norm):
    """``rope_and_store_``: q and k (with ``norm``: first each head RMS-normed, Qwen3's weight in the model's dtype
    or Gemma 3's float32 one) turned in place and k, v stored, as the reference's ``rms_norm``, ``apply_rope_`` (on
    each head's first ``rot`` dims: partial rotary) then ``store_kvcache`` (an fp8 cache too); a padding slot (-1)
    stores nothing, its token is made ready all the same. The last two: q's and k's heads over several programs
    a token, the last of each partly filled."""
    t, nblocks, page = 7, 4, 8
    qkv = randn(t, (h + 2 * hkv) * d, dtype=dtype)
    views = lambda x: (x[:, :h * d].view(t, h, d), x[:, h * d:(h + hkv) * d].view(t, hkv, d),  # noqa: E731
                       x[:, (h + hkv) * d:].view(t, hkv, d))
    ang = torch.rand(t, rot // 2, generator=gen()).to(DEVICE) * 100
    cos, sin = ang.cos().to(dtype), ang.sin().to(dtype)
    norms = None if norm is None else (1 + randn(d, dtype=norm) / 4, 1 + randn(d, dtype=norm) / 4, 1e-6)
    slots = torch.randperm(nblocks * page, generator=gen())[:t].to(DEVICE)
    slots[3] = -1
    cache = torch.zeros(nblocks, page, hkv, d, dtype=dtype, device=DEVICE).to(cache_dtype)
    got, want = qkv.clone(), qkv.clone()
    caches, want_caches = (cache.clone(), cache.clone()), (cache.clone(), cache.clone())
    tri.rope_and_store_(*views(got), cos, sin, *caches, slots, rot, norms)
    q, k, v = views(want)
    if norms is not None:
        for x, w in zip((q, k), norms[:2], strict=True):
            x.copy_(ref.rms_norm(x.reshape(-1, d), w, norms[2]).view(x.shape))
    ref.apply_rope_(q[..., :rot], k[..., :rot], cos, sin)
    torch.testing.assert_close(got, want, **TOL[dtype])
    keep = slots >= 0  # the keys it made, stored as the reference stores them: the same bytes
    _, k, v = views(got)
    ref.store_kvcache(k[keep], v[keep], *want_caches, slots[keep])
    for c, w in zip(caches, want_caches, strict=True):
        assert torch.equal(c.view(torch.uint8), w.view(torch.uint8))
    assert torch.equal(got[:, (h + hkv) * d:], qkv[:, (h + hkv) * d:])  # v untouched
    stored = torch.zeros(nblocks * page, dtype=torch.bool)
    stored[slots[keep].cpu()] = True
    assert not caches[0].float().view(-1, hkv, d)[~stored.to(DEVICE)].any()  # nothing stored for the padding


@pytest.mark.parametrize("dtype,t,i", [(F32, 3, 48), (BF16, 2, 1536), (F16, 4, 100)])
def test_triton_silu_and_mul_matches_reference(dtype, t, i, poison):
    x = randn(t, 2 * i, dtype=dtype) * 3
    torch.testing.assert_close(tri.silu_and_mul(x), ref.silu_and_mul(x), **TOL[dtype])
    torch.testing.assert_close(tri.gelu_and_mul(x), ref.gelu_and_mul(x), **TOL[dtype])


# ---------------------------------------------------------------- mixture of experts

# (dtype, tokens, hidden, expert width, experts, top k): one token; more pairs than an expert's block; an
# odd width; every expert at once
MOE_CASES = [(F32, 1, 64, 32, 8, 2), (F32, 13, 48, 40, 4, 2), (BF16, 7, 64, 24, 8, 3), (F16, 5, 32, 16, 3, 3)]


@pytest.mark.parametrize("dtype,t,h,i,e,k", MOE_CASES, ids=map(case_id, MOE_CASES))
def test_triton_fused_moe_matches_reference(dtype, t, h, i, e, k, poison):
    x = randn(t, h, dtype=dtype)
    w13, w2 = randn(e, 2 * i, h, dtype=dtype) * 0.3, randn(e, h, i, dtype=dtype) * 0.3
    weights, ids = torch.softmax(randn(t, e), dim=-1).topk(k, dim=-1)
    out = tri.fused_moe(x, w13, w2, weights, ids)
    if dtype == F32:
        torch.testing.assert_close(out, ref.fused_moe(x, w13, w2, weights, ids), **TOL[dtype])
    else:  # two GEMMs and an activation each rounded to 16 bits (by truncation in the interpreter):
        # within 2.5% of the output's scale of the exact (float64) result, as the reference is
        exact = ref.fused_moe(x.double(), w13.double(), w2.double(), weights, ids)
        for got in (out, ref.fused_moe(x, w13, w2, weights, ids)):
            assert (got.double() - exact).abs().max() <= 0.025 * exact.abs().max()


@pytest.mark.parametrize("dtype,t,h,i,e,k", MOE_CASES[:3], ids=map(case_id, MOE_CASES[:3]))
def test_triton_fused_moe_with_gpt_oss_biases_and_activation_matches_reference(dtype, t, h, i, e, k, poison):
    """GPT-OSS's experts: a bias on each projection and the clamped SwiGLU (values past its limit of 1.5)."""
    x = randn(t, h, dtype=dtype)
    w13, w2 = randn(e, 2 * i, h, dtype=dtype) * 0.5, randn(e, h, i, dtype=dtype) * 0.3
    b13, b2 = randn(e, 2 * i, dtype=dtype), randn(e, h, dtype=dtype)
    weights, ids = torch.softmax(randn(t, e), dim=-1).topk(k, dim=-1)
    act = functools.partial(ref.swiglu_oai, alpha=1.702, limit=1.5)
    out = tri.fused_moe(x, w13, w2, weights, ids, b13, b2, act)
    want = ref.fused_moe(x, w13, w2, weights, ids, bias13=b13, bias2=b2, act=act)
    if dtype == F32:
        torch.testing.assert_close(out, want, **TOL[dtype])
    else:
        exact = ref.fused_moe(x.double(), w13.double(), w2.double(), weights, ids, bias13=b13.double(),
                              bias2=b2.double(), act=act)
        for got in (out, want):
            assert (got.double() - exact).abs().max() <= 0.025 * exact.abs().max()
    assert not torch.allclose(want, ref.fused_moe(x, w13, w2, weights, ids), atol=1e-2)  # (biases, act: used)


# (gate|up's format, down's, then MOE_CASES' fields): GPT-OSS's MXFP4 on each case; a GGUF file's two formats,
# K-quants' super-blocks of 256 among them (in the interpreter, slow: few experts); an AWQ/GPTQ checkpoint's Q4_Z;
# the rarer GGUF formats
PACKED_MOE_CASES = [("mxfp4", "mxfp4", *c) for c in MOE_CASES[:3]] + [
    ("q4_0", "q8_0", *MOE_CASES[2]), ("q4_z", "q4_z", *MOE_CASES[2]), ("q5_1", "iq4_nl", *MOE_CASES[2]),
    ("q4_k", "q6_k", F32, 5, 256, 256, 2, 2), ("q5_k", "q4_k", F32, 3, 256, 256, 2, 1),
    ("q3_k", "q2_k", F32, 3, 256, 256, 2, 1)]


@pytest.mark.parametrize("fmt,down,dtype,t,h,i,e,k", PACKED_MOE_CASES, ids=map(case_id, PACKED_MOE_CASES))
def test_triton_fused_moe_packed_matches_reference(fmt, down, dtype, t, h, i, e, k, poison):
    """Experts kept packed (GPT-OSS's MXFP4; a GGUF file's gate|up and down in two formats), expanded in the
    GEMMs' registers: as the reference's loop over experts multiplies them (``linear_packed``), with and without
    GPT-OSS's biases and activation."""
    size = ref.PACKED_BLOCKS[fmt][0]  # (whole blocks along K)
    h, i = (h + size - 1) // size * size, (i + size - 1) // size * size
    w13 = packed_weight(fmt, e * 2 * i, h).view(e, 2 * i, -1)
    w2 = packed_weight(down, e * h, i).view(e, h, -1)
    x = randn(t, h, dtype=dtype)
    weights, ids = torch.softmax(randn(t, e), dim=-1).topk(k, dim=-1)
    act = functools.partial(ref.swiglu_oai, alpha=1.702, limit=1.5)
    dense13, dense2 = (torch.stack([ref.dequantize(w, f) for w in ws]) for ws, f in ((w13, fmt), (w2, down)))
    for extra in ({}, dict(bias13=randn(e, 2 * i, dtype=dtype), bias2=randn(e, h, dtype=dtype), act=act)):
        out = tri.fused_moe(x, w13, w2, weights, ids, packed=fmt, packed_down=down, **extra)
        want = ref.fused_moe(x, w13, w2, weights, ids, linear=lambda a, w: ref.linear_packed(a, w, fmt),
                             linear_down=lambda a, w: ref.linear_packed(a, w, down), **extra)
        if dtype == F32:  # (sums over K of 256 and more: compared at the largest output's scale)
            torch.testing.assert_close(out, want, rtol=1e-4, atol=1e-5 * float(want.abs().max()))
            continue
        # 16-bit: each GEMM's operands and output rounded, Triton's weights too (by truncation in the interpreter:
        # up to 2.9% seen), within 4% of the output's scale of the exact (float64) result, as the reference is
        exact = ref.fused_moe(x.double(), dense13.double(), dense2.double(), weights, ids,
                              **{k: v.double() if torch.is_tensor(v) else v for k, v in extra.items()})
        for got in (out, want):
            assert (got.double() - exact).abs().max() <= 0.04 * exact.abs().max()


def test_triton_fused_moe_align_pads_each_expert_to_blocks():
    from kernels.triton.moe import _align

    ids = torch.tensor([[2, 0], [2, 1], [2, 0]], device=DEVICE)  # pairs 0..5: expert 0 has 1, 5; 1 has 3; 2 has 0, 2, 4
    pairs, experts, total = _align(ids, 4, 2)
    used = int(total)
    assert used == 8  # 2 + 2 + 4: each run padded to whole blocks of 2; expert 3 has none
    assert pairs[:used].tolist() == [1, 5, 3, 6, 0, 2, 4, 6]  # 6 (T K): padding
    assert experts[:used // 2].tolist() == [0, 1, 2, 2]
    assert len(experts) == 6 // 2 + 4  # the bound, from shapes alone: whole blocks, one part-filled per expert


def test_triton_fused_moe_refuses():
    x, w13, w2 = randn(3, 8), randn(4, 6, 8), randn(4, 8, 3)
    weights, ids = torch.rand(3, 2, device=DEVICE), torch.zeros(3, 2, dtype=torch.long, device=DEVICE)
    with pytest.raises(ValueError, match="w2 must be"):
        tri.fused_moe(x, w13, randn(4, 8, 4), weights, ids)
    with pytest.raises(ValueError, match="topk_weights must be one of"):
        tri.fused_moe(x, w13, w2, weights.half(), ids)
    with pytest.raises(ValueError, match="both be"):
        tri.fused_moe(x, w13, w2, weights[:2], ids[:2])
    packed13, packed2 = packed_weight("mxfp4", 4 * 64, 32).view(4, 64, 17), packed_weight("mxfp4", 4 * 32, 32)
    packed2 = packed2.view(4, 32, 17)  # (E, H, I / 32 * 17) for H = I = 32
    assert tri.fused_moe(randn(3, 32), packed13, packed2, weights, ids, packed="mxfp4").shape == (3, 32)
    with pytest.raises(ValueError, match=r"w2 must be \(4, 32, 17\), uint8 rows of mxfp4 blocks"):
        tri.fused_moe(randn(3, 32), packed13, packed_weight("mxfp4", 4 * 32, 64).view(4, 32, 34), weights, ids,
                      packed="mxfp4")
    with pytest.raises(ValueError, match="unknown packed format 'iq2_xs'"):
        tri.fused_moe(randn(3, 32), packed13, packed2, weights, ids, packed="iq2_xs")
    with pytest.raises(ValueError, match="in mxfp4 need the hidden size in whole blocks of 32, got 48"):
        tri.fused_moe(randn(3, 48), packed13, packed2, weights, ids, packed="mxfp4")
    with pytest.raises(ValueError, match=r"w13 must hold each expert's gate and up rows \(2I\), got 63"):
        tri.fused_moe(randn(3, 32), packed_weight("mxfp4", 4 * 63, 32).view(4, 63, 17), packed2, weights, ids,
                      packed="mxfp4")
    with pytest.raises(ValueError, match="packed_down needs packed"):
        tri.fused_moe(x, w13, w2, weights, ids, packed_down="mxfp4")
    with pytest.raises(ValueError, match=r"bias13 must be \(4, 6\)"):
        tri.fused_moe(x, w13, w2, weights, ids, bias13=randn(4, 3))
    with pytest.raises(ValueError, match="bias2 must be one of torch.float32"):
        tri.fused_moe(x, w13, w2, weights, ids, bias2=randn(4, 8).double())
    with pytest.raises(ValueError, match="w13 must be one of torch.uint8"):
        tri.fused_moe(randn(3, 32), packed13.float(), packed2, weights, ids, packed="mxfp4")


# ---------------------------------------------------------------- packed linear


def packed_weight(fmt: str, n: int, k: int) -> torch.Tensor:
    """Random (N, K / block weights * block bytes) rows of ``fmt`` blocks with sensible fp16 scales (and Q4_1 and
    Q5_1 minima, Q4_Z zero points from 0 to 16; MXFP4's scales 2^-7..2^-3; the K-quants' and IQ4_XS's sub-block
    scales and minima random bytes, their super-block's d and dmin, small)."""
    weights, size = ref.PACKED_BLOCKS[fmt]
    blocks = torch.randint(0, 256, (n, k // weights, size), generator=gen(), dtype=torch.uint8)
    if weights == 256:
        for at in {"q6_k": (208,), "q2_k": (80, 82), "q3_k": (108,), "iq4_xs": (0,)}.get(fmt, (0, 2)):
            blocks[..., at:at + 2] = (torch.rand(n, k // 256, 1, generator=gen()) * 1e-3 + 1e-4).half().view(torch.uint8)
        return blocks.reshape(n, -1).to(DEVICE)
    if fmt == "mxfp4":
        blocks[..., 0] = torch.randint(121, 126, (n, k // 32), generator=gen(), dtype=torch.uint8)
        return blocks.reshape(n, -1).to(DEVICE)
    blocks[..., 0:2] = (torch.rand(n, k // 32, 1, generator=gen()) * 0.1 + 0.01).half().view(torch.uint8)
    if fmt in ("q4_1", "q5_1"):
        blocks[..., 2:4] = (torch.rand(n, k // 32, 1, generator=gen()) - 0.5).half().view(torch.uint8)
    elif fmt == "q4_z":
        blocks[..., 2:4] = torch.randint(0, 17, (n, k // 32, 1), generator=gen()).half().view(torch.uint8)
    return blocks.reshape(n, -1).to(DEVICE)


# the last two: more rows than EXPAND_ROWS (the weight expanded once, then torch's GEMM)
PACKED_CASES = [(F32, 1, 40, 64), (F32, 17, 33, 96), (BF16, 5, 64, 32), (F16, 3, 31, 64), (F32, 130, 8, 32),
                (BF16, 140, 40, 64)]


# every format on every case, the rarer ones (in GGUF files alone) on three (the expanded path: the exactness tests)
LINEAR_PACKED_CASES = [(fmt, *c) for fmt in ("q4_0", "q4_1", "q8_0", "q4_z", "mxfp4", "q4_k", "q5_k", "q6_k")
                       for c in PACKED_CASES]
LINEAR_PACKED_CASES += [(fmt, *c) for fmt in ("q5_0", "q5_1", "iq4_nl", "q2_k", "q3_k", "iq4_xs") for c in PACKED_CASES[1:4]]


@pytest.mark.parametrize("fmt,dtype,m,n,k", LINEAR_PACKED_CASES, ids=map(case_id, LINEAR_PACKED_CASES))
def test_triton_linear_packed_matches_reference(fmt, dtype, m, n, k, poison):
    """Against F.linear on the exact weights in float32; 16-bit: the weights rounded to x's dtype
    (so an output near cancellation is compared to the largest one's scale). K-quants: K whole super-blocks."""
    k = k if ref.PACKED_BLOCKS[fmt][0] == 32 else k // 32 * 256
    w, x, bias = packed_weight(fmt, n, k), randn(m, k, dtype=dtype), randn(n, dtype=dtype)
    for b in (None, bias):
        out = tri.linear_packed(x, w, fmt, b)
        assert out.shape == (m, n) and out.dtype == dtype
        want = ref.linear_packed(x, w, fmt, b).float()
        scale = float(want.abs().max())  # (sums over up to 768 weights near 1: at the largest output's scale)
        tol = dict(rtol=1e-4, atol=1e-6 * scale) if dtype == F32 else dict(rtol=TOL[dtype]["rtol"], atol=1e-2 * scale)
        torch.testing.assert_close(out.float(), want, **tol)
    assert tri.linear_packed(x.view(1, m, k), w, fmt).shape == (1, m, n)  # leading dims kept


@pytest.mark.parametrize("fmt", ["q2_k", "q3_k", "q4_k", "q5_k", "q6_k", "iq4_xs"])
def test_triton_linear_packed_expands_k_quants_exactly(fmt):
    """The K-quants' and IQ4_XS's weights bit for bit as the reference's (``_k_quants``: each sub-block's scale and
    minimum, all but d and dmin random bytes): x one-hot, so y is the weights, through the register path
    (sub-blocks 0..3 of the first super-block; 4..7 of the second, K split) and the expanded one (every weight)."""
    w = packed_weight(fmt, 4, 512)
    dense = ref.dequantize(w, fmt)  # (4, 512)
    for cols, splits in ((slice(0, 128), 1), (slice(384, 512), 3), (slice(0, 512), 1)):
        x = torch.eye(512, device=DEVICE)[cols]
        assert torch.equal(tri.linear_packed(x, w, fmt, num_splits=splits), dense[:, cols].t())


@pytest.mark.parametrize("fmt", ["q8_0", "mxfp4", "q6_k"])
def test_triton_packed_embedding_rows_expanded_on_the_device(fmt, monkeypatch):
    """``kernels.embedding`` of a packed table where Triton's kernels serve (CUDA): the rows gathered and expanded
    by Triton's dequantize (no host copy: a captured decode step holds it), exactly the reference's, rounded once."""
    table = packed_weight(fmt, 50, 256)
    ids = torch.tensor([[3, 49, 3], [0, 7, 12]], device=DEVICE)
    monkeypatch.setattr(kernels, "_backend", "triton")
    calls = []
    monkeypatch.setattr(tri, "dequantize", lambda *a, _real=tri.dequantize: calls.append(a[1]) or _real(*a))
    want = ref.dequantize(table, fmt)[ids]
    for dtype in (F32, BF16):
        got = kernels.embedding(ids, table, dtype, fmt)
        assert got.shape == (2, 3, 256) and got.dtype == dtype
        if dtype == F32:
            assert torch.equal(got, want)
        else:  # (the interpreter rounds to bf16 by truncation: within one ulp)
            torch.testing.assert_close(got.float(), want, rtol=2**-7, atol=0)
    assert calls == [fmt, fmt]
    assert kernels.embedding(ids[:0], table, F32, fmt).shape == (0, 3, 256)  # (no rows, still that wide)


@pytest.mark.parametrize("fmt", ["q4_0", "q4_1", "q5_0", "q5_1", "q8_0", "iq4_nl"])
def test_triton_linear_packed_expands_blocks_of_32_exactly(fmt):
    """Every block of 32 format's weights bit for bit as the reference's, all bytes but the scales random (Q5's fifth
    bits, IQ4_NL's levels: every nibble): x one-hot, so y is the weights, through both paths."""
    w = packed_weight(fmt, 40, 128)
    dense = ref.dequantize(w, fmt)  # (40, 128)
    for rows in (1, 2):  # 128 rows, 256 (expanded)
        x = torch.eye(128, device=DEVICE).repeat(rows, 1)
        assert torch.equal(tri.linear_packed(x, w, fmt), dense.t().repeat(rows, 1))


def test_triton_linear_packed_expands_mxfp4_exactly():
    """MXFP4's weights 2^(e - 128) MXFP4_LEVELS[q] bit for bit as the reference's, for every scale byte but those
    whose 12 overflows float32 (subnormal scales included; -0 a 0), and every nibble: x one-hot, so y is the weights
    themselves, through the register path and the expanded one (more rows than EXPAND_ROWS)."""
    w = packed_weight("mxfp4", 251, 32)  # row e: one block of scale byte e
    w[:, 0] = torch.arange(251, dtype=torch.uint8, device=DEVICE)
    w[128, 1:] = torch.arange(16, dtype=torch.uint8, device=DEVICE) * 17  # every nibble, in both halves
    dense = ref.dequantize(w, "mxfp4")  # (251, 32)
    assert dense[128, :16].tolist() == [*range(4), 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12]
    for rows in (1, 5):  # 32 rows, 160 (expanded)
        x = torch.eye(32, device=DEVICE).repeat(rows, 1)
        assert torch.equal(tri.linear_packed(x, w, "mxfp4"), dense.t().repeat(rows, 1))


@pytest.mark.parametrize("dtype", [F32, BF16])
def test_triton_linear_packed_split_k_agrees(dtype, poison):
    """K's blocks split over several programs per tile (their float32 sums added after), as a decode
    step's narrow layers are on a large GPU: the same result as one pass, to float32 rounding."""
    w, x, bias = packed_weight("q4_z", 40, 224), randn(3, 224, dtype=dtype), randn(40, dtype=dtype)
    one = tri.linear_packed(x, w, "q4_z", bias, num_splits=1)
    torch.testing.assert_close(one.float(), ref.linear_packed(x, w, "q4_z", bias).float(),
                               **(TOL[dtype] if dtype == F32 else dict(rtol=2e-2, atol=1e-2 * float(one.abs().max()))))
    for splits in (2, 3, 7, 50):  # 50: more splits than the 7 blocks, so fewer are made
        many = tri.linear_packed(x, w, "q4_z", bias, num_splits=splits)
        torch.testing.assert_close(many, one, rtol=1e-5 if dtype == F32 else 1e-2, atol=1e-5 if dtype == F32 else 1e-2)


def test_triton_linear_packed_refuses():
    w = packed_weight("q4_z", 4, 64)
    with pytest.raises(ValueError, match="unknown packed format"):
        tri.linear_packed(randn(2, 64), w, "iq2_xs")
    with pytest.raises(ValueError, match="needs at least one block a row"):
        tri.linear_packed(randn(2, 0), w[:, :0], "q4_z")
    with pytest.raises(ValueError, match=r"x must be \(\.\.\., 64\)"):
        tri.linear_packed(randn(2, 32), w, "q4_z")
    with pytest.raises(ValueError, match="whole 20-byte blocks"):
        tri.linear_packed(randn(2, 64), w[:, :30], "q4_z")
    with pytest.raises(ValueError, match="bias must be"):
        tri.linear_packed(randn(2, 64), w, "q4_z", randn(3))
    with pytest.raises(ValueError, match="weight must be one of"):
        tri.linear_packed(randn(2, 64), w.float(), "q4_z")


# ---------------------------------------------------------------- launcher checks


def _attn_args() -> dict:
    return dict(q=randn(2, 4, 16), k_cache=randn(4, 8, 2, 16), v_cache=randn(4, 8, 2, 16),
                block_tables=torch.zeros(2, 2, dtype=torch.int32, device=DEVICE),
                seq_lens=torch.tensor([3, 9], device=DEVICE), max_seq_len=9, scale=0.25)


BAD_CALLS = {
    "q not 3-D": (tri.paged_decode_attention, lambda a: a.update(q=randn(2, 64)), "q must have 3 dims"),
    "int q": (tri.paged_decode_attention, lambda a: a.update(q=a["q"].long()), "q must be one of"),
    "mixed dtypes": (tri.paged_decode_attention, lambda a: a.update(k_cache=a["k_cache"].half()), "same dtype"),
    "head_dim mismatch": (tri.paged_decode_attention, lambda a: a.update(q=randn(2, 4, 32)), "head_dim"),
    "heads not a multiple": (tri.paged_decode_attention, lambda a: a.update(q=randn(2, 3, 16)), "multiple"),
    "strided head_dim": (tri.paged_decode_attention, lambda a: a.update(q=randn(2, 4, 32)[..., ::2]),
                         "contiguous in its last dim"),
    "float block table": (tri.paged_decode_attention, lambda a: a.update(block_tables=a["block_tables"].float()),
                          "block_tables must be one of"),
    "table too narrow": (tri.paged_decode_attention, lambda a: a.update(max_seq_len=17), "cannot hold"),
    "seq_lens rows": (tri.paged_decode_attention, lambda a: a.update(seq_lens=a["seq_lens"][:1]), "rows"),
}


@pytest.mark.parametrize("case", BAD_CALLS)
def test_triton_attention_launcher_refuses(case):
    fn, spoil, message = BAD_CALLS[case]
    args = _attn_args()
    spoil(args)
    with pytest.raises(ValueError, match=message):
        fn(**args)


def test_triton_other_launchers_refuse():
    x = randn(3, 8)
    with pytest.raises(ValueError, match="same shape"):
        tri.fused_add_rms_norm(x, randn(3, 4), randn(8), 1e-6)
    with pytest.raises(ValueError, match="weight must have 8"):
        tri.rms_norm(x, randn(4), 1e-6)
    with pytest.raises(ValueError, match="contiguous in its last dim"):
        tri.rms_norm(randn(8, 3).t(), randn(8), 1e-6)
    with pytest.raises(ValueError, match="even number of columns"):
        tri.silu_and_mul(randn(3, 7))
    with pytest.raises(ValueError, match="cos must be"):
        tri.apply_rope_(randn(3, 2, 8), randn(3, 1, 8), randn(3, 8), randn(3, 4))
    with pytest.raises(ValueError, match="same dtype"):
        tri.apply_rope_(randn(3, 2, 8), randn(3, 1, 8), randn(3, 4, dtype=BF16), randn(3, 4))
    cache = randn(2, 4, 1, 8)
    with pytest.raises(ValueError, match="slot_mapping must have 3"):
        tri.store_kvcache(randn(3, 1, 8), randn(3, 1, 8), cache, cache, torch.zeros(2, dtype=torch.long, device=DEVICE))
    with pytest.raises(ValueError, match="k_cache must be"):
        tri.store_kvcache(randn(3, 2, 8), randn(3, 2, 8), cache, cache, torch.zeros(3, dtype=torch.long, device=DEVICE))
    with pytest.raises(ValueError, match="query_start must have 3"):
        a = _attn_args()
        tri.paged_prefill_attention(a["q"], a["k_cache"], a["v_cache"], a["block_tables"], a["seq_lens"],
                                    torch.tensor([0, 2], device=DEVICE), None, None, 9, 0.25)


def test_triton_backend_choice_and_bad_name(monkeypatch):
    monkeypatch.setattr(kernels, "_backend", "auto")
    x = torch.ones(2, 4)  # a CPU tensor: auto means the CPU kernels
    assert kernels._pick(x) is kernels.cpu
    monkeypatch.setattr(kernels, "_backend", "reference")
    assert kernels._pick(x) is ref
    monkeypatch.setattr(kernels, "_backend", "triton")
    assert kernels._pick(x) is tri
    with pytest.raises(ValueError, match="TOKENMILL_KERNELS must be one of"):
        kernels.set_backend("cuda")


def test_triton_kernels_compile_for_cuda():
    """What only the compiler catches, caught without a GPU: each kernel compiled for sm_90 in processes
    without the interpreter (one a core; a minute or more the first time, then Triton's cache answers); and
    again as launches specialize it, its registers and spills read from the cubin (``--resources``): none
    spills."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, "-m", "kernels.triton.compile_check", "--resources"], env=env,
                         capture_output=True, text=True, timeout=900,
                         cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert run.returncode == 0, run.stdout + run.stderr
    used = re.findall(r"compiled in [\d.]+s: (\d+) registers, (\d+) bytes spilled", run.stdout)
    assert len(used) == len(run.stdout.strip().splitlines()) > 20
    assert all(0 < int(regs) <= 255 and spilled == "0" for regs, spilled in used), run.stdout


# ---------------------------------------------------------------- the engine on Triton kernels


@pytest.mark.parametrize("kv", ["auto", "fp8"])
def test_triton_engine_greedy_equals_reference(tiny_llama, kv, monkeypatch):
    """A tiny model's greedy tokens with every kernel Triton equal those with the references
    (fp32), over prompts long enough for several blocks, chunked prefill and mixed batches (one prefill
    launch a layer, its decodes among its sequences); with the model's cache and an fp8 one."""
    from engine import LLM, SamplingParams

    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    prompts = [[(7 * i + 3 * j) % 5000 + 3 for j in range(n)] for i, n in enumerate([5, 23, 40])]
    outs, calls = {}, []
    for name in ("reference", "triton"):
        monkeypatch.setattr(kernels, "_backend", name)
        if name == "triton":
            for fn in ("paged_decode_attention", "paged_prefill_attention", "fused_add_rms_norm"):
                real = getattr(tri, fn)
                monkeypatch.setattr(tri, fn, lambda *a, _real=real, _fn=fn, **k: calls.append(_fn) or _real(*a, **k))
        llm = LLM(tiny_llama, device=DEVICE, dtype="float32", num_kv_blocks=64, max_model_len=128, max_num_batched_tokens=16,
                  kv_cache_dtype=kv)
        outs[name] = [o.token_ids for o in llm.generate(prompts, params)]
    assert outs["triton"] == outs["reference"]
    assert {"paged_decode_attention", "paged_prefill_attention", "fused_add_rms_norm"} <= set(calls)
    real, mixed = tri.paged_prefill_attention, []  # each prefill call's query lengths
    monkeypatch.setattr(tri, "paged_prefill_attention", lambda q, k, v, t, lens, start, *a, **kw: mixed.append(
        start.diff().tolist()) or real(q, k, v, t, lens, start, *a, **kw))
    assert [o.token_ids for o in llm.generate(prompts, params)] == outs["triton"]
    assert any(1 in lens and max(lens) > 1 for lens in mixed), mixed


@pytest.mark.parametrize("arch", ["llama", "gemma2"])
def test_triton_engine_prompt_graphs_give_the_eager_tokens(arch, tmp_path, smollm_tokenizer_dir, monkeypatch):
    """Steps with prompt tokens replayed through ``PromptGraphs`` (as CUDA captures them at start-up; here each
    "replay" runs the captured forward again over the static inputs, which is all a graph reads): padded to each
    token count, beside decodes or alone, after larger steps left their inputs behind, with sliding-window
    layers in a pool of their own (Gemma 2: two layers, one of each kind, through Triton's interpreter half the
    time of four), the same greedy tokens as every step run eagerly (fp32, through the reference kernels, which
    the Triton ones match)."""
    from engine import LLM, SamplingParams
    from tests.conftest import make_tiny_model

    path = make_tiny_model(str(tmp_path / arch), arch, smollm_tokenizer_dir,
                           **({"sliding_window": 8, "num_hidden_layers": 2} if arch == "gemma2" else {}))
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    prompts = [[(13 * i + 7 * j) % 5000 + 3 for j in range(n)] for i, n in enumerate([5, 23, 40, 3, 17, 30])]
    kw = dict(device=DEVICE, dtype="float32", num_kv_blocks=96, max_model_len=128, max_num_batched_tokens=40,
              max_num_seqs=4)
    monkeypatch.setattr(kernels, "_backend", "reference")  # (eager and no interpreter: quicker on the CPU)
    want = [o.token_ids for o in LLM(path, prompt_graph_tokens=0, **kw).generate(prompts, params)]
    monkeypatch.setattr(kernels, "_backend", "triton")
    llm = LLM(path, **kw)
    runner, replays = llm.engine.runner, []

    def capture(forward):
        def replay():  # (the step's sequences: its inputs' nonzero lengths, the padding's among them)
            n, m = forward.args[0], runner.prompt_graphs.max_seqs
            replays.append(int((runner.prompt_graphs.inputs[n][3 * n + m:3 * n + 2 * m] > 0).sum()))
            forward()
        return replay

    if runner.prompt_graphs is None:  # (on CUDA the runner has captured its own)
        runner._capture_prompt_graphs(capture, runner._prompt_graph_tokens(128))
        assert runner.prompt_graphs.sizes == [16, 24, 32, 40]
    assert [o.token_ids for o in llm.generate(prompts, params)] == want
    assert DEVICE == "cuda" or len(replays) >= 4 and max(replays) > 2, replays  # several sequences a step


def test_triton_engine_prompt_graphs_with_lora_adapters_give_the_eager_tokens(lora_tiny, monkeypatch):
    """Steps with prompt tokens of requests with different LoRA adapters, and none, replayed through
    ``PromptGraphs`` (each "replay" runs the captured forward again, as in the test above): each token's slot is
    set before the replay, so the same greedy tokens as every step run eagerly through the reference kernels."""
    from engine import LLM, SamplingParams

    model, a, b = lora_tiny
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    prompts = [[(17 * i + 5 * j) % 5000 + 3 for j in range(n)] for i, n in enumerate([9, 20, 4, 14, 11])]
    loras = ["a", None, "b", "a", "b"]
    kw = dict(device=DEVICE, dtype="float32", num_kv_blocks=64, max_model_len=64, max_num_batched_tokens=24,
              max_num_seqs=4, lora_modules={"a": a, "b": b})
    monkeypatch.setattr(kernels, "_backend", "reference")
    eager = LLM(model, prompt_graph_tokens=0, **kw)
    want = [o.token_ids for o in eager.generate(prompts, params, lora_request=loras)]
    assert want != [o.token_ids for o in eager.generate(prompts, params)]  # (the adapters change the tokens)
    monkeypatch.setattr(kernels, "_backend", "triton")
    llm = LLM(model, **kw)
    runner, replays = llm.engine.runner, []
    assert runner._prompt_graph_tokens(64) == 24
    if runner.prompt_graphs is None:  # (on CUDA the runner has captured its own)
        runner._capture_prompt_graphs(lambda forward: lambda: replays.append(forward.args[0]) or forward(), 24)
    assert [o.token_ids for o in llm.generate(prompts, params, lora_request=loras)] == want
    assert DEVICE == "cuda" or len(replays) >= 2, replays


def test_triton_engine_prompt_graphs_stop_at_the_models_length_and_long_contexts(tiny_llama, monkeypatch):
    """The prompt graphs' largest size is at most the model's length (their padding sequence's positions), and a
    step where a sequence has more than ``kernels.UNSPLIT_CONTEXT`` tokens cached keeps its decodes apart (the
    decode kernel splits long contexts over the device), unless every multiprocessor streams as many keys anyway."""
    from engine import LLM, SamplingParams

    monkeypatch.setattr(kernels, "_backend", "triton")
    llm = LLM(tiny_llama, device=DEVICE, dtype="float32", num_kv_blocks=64, max_model_len=32, max_num_batched_tokens=64)
    runner = llm.engine.runner
    assert runner._prompt_graph_tokens(32) == 32 and runner._prompt_graph_tokens(1000) == 64
    if runner.prompt_graphs is None:
        runner._capture_prompt_graphs(lambda forward: forward, runner._prompt_graph_tokens(32))
    assert runner.prompt_graphs.sizes[-1] == 32
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    prompts, fresh = ([[(k * i + 3 * j + k) % 5000 + 3 for j in range(n)] for i, n in enumerate([20, 7])] for k in (5, 11))
    monkeypatch.setattr(kernels, "_backend", "reference")  # (eager and no interpreter: quicker on the CPU)
    eager = LLM(tiny_llama, device=DEVICE, dtype="float32", num_kv_blocks=64, max_model_len=32,
                max_num_batched_tokens=64, prompt_graph_tokens=0)
    want, want_fresh = ([o.token_ids for o in eager.generate(p, params)] for p in (prompts, fresh))
    monkeypatch.setattr(kernels, "_backend", "triton")
    assert [o.token_ids for o in llm.generate(prompts, params)] == want
    device, long = torch.device(DEVICE), kernels.UNSPLIT_CONTEXT + 1
    sms = kernels.multiprocessors(device)
    assert kernels.prefill_takes_decodes(device, kernels.UNSPLIT_CONTEXT)
    assert not kernels.prefill_takes_decodes(device, long) and not kernels.prefill_takes_decodes(device, long, long * sms - 1)
    assert kernels.prefill_takes_decodes(device, long, long * sms)  # (many long sequences: each SM streams as much)
    monkeypatch.setattr(kernels, "UNSPLIT_CONTEXT", 4)  # a step with a sequence past 4 tokens...
    monkeypatch.setattr(kernels, "multiprocessors", lambda device: 1000)  # ...on a device it does not fill: decodes apart
    index = []
    monkeypatch.setattr(runner, "prompt_graphs", None)
    real = engine_attention.StepIndex.build
    def build(query_lens, *a, **kw):  # (a step with prompt tokens: decodes alone are decode rows anyway)
        if max(query_lens) > 1:
            index.append(kw["split"])
        return real(query_lens, *a, **kw)

    monkeypatch.setattr(engine_attention.StepIndex, "build", build)
    assert [o.token_ids for o in llm.generate(fresh, params)] == want_fresh
    assert index and all(index[1:]) and not index[0]  # (the first step: fresh prompts, nothing cached)
    index.clear()
    monkeypatch.setattr(kernels, "multiprocessors", lambda device: 1)  # one it fills: one launch again
    assert [o.token_ids for o in llm.generate(fresh, params)] == want_fresh
    assert index and not any(index)


def greedy_by_backend(monkeypatch, path: str, lengths: list[int], max_tokens: int, check=None,
                      **kw) -> tuple[dict[str, list[list[int]]], list[dict]]:
    """Greedy tokens of ``path`` with the reference kernels and with every kernel Triton (fp32, chunked prefill):
    {backend: tokens}, and the keyword arguments of each Triton fused MoE call; ``check(llm, backend)`` looks at
    the model loaded under each."""
    from engine import LLM, SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    prompts = [[(11 * i + 5 * j) % 5000 + 3 for j in range(n)] for i, n in enumerate(lengths)]
    outs, calls = {}, []
    for name in ("reference", "triton"):
        monkeypatch.setattr(kernels, "_backend", name)
        if name == "triton":
            monkeypatch.setattr(tri, "fused_moe", lambda *a, _real=tri.fused_moe, **k: calls.append(k) or _real(*a, **k))
        llm = LLM(path, device=DEVICE, dtype="float32", num_kv_blocks=64, max_model_len=128, max_num_batched_tokens=16,
                  **kw)
        if check is not None:
            check(llm, name)
        outs[name] = [o.token_ids for o in llm.generate(prompts, params)]
    return outs, calls


def test_triton_engine_gpt_oss_mxfp4_kept_packed_greedy_equals_reference(tmp_path, smollm_tokenizer_dir, monkeypatch):
    """GPT-OSS's MXFP4 experts kept packed where Triton's fused MoE multiplies them (as on CUDA): the same greedy
    tokens as the reference kernels on the experts widened at load."""
    from tests.conftest import make_tiny_mxfp4_gpt_oss

    def check(llm, backend):
        assert llm.engine.runner.model.layers[0].mlp.experts.packed == (None if backend == "reference" else "mxfp4")

    outs, calls = greedy_by_backend(monkeypatch, make_tiny_mxfp4_gpt_oss(str(tmp_path / "mx"), smollm_tokenizer_dir),
                                    [3, 20], 3, check)
    assert outs["triton"] == outs["reference"]
    assert calls and all(k["packed"] == "mxfp4" for k in calls)


def test_triton_engine_gguf_kept_packed_greedy_equals_reference(tmp_path, smollm_tokenizer_dir, monkeypatch):
    """A GGUF file's matrices in formats Triton reads kept packed (as on CUDA): GPT-OSS's MXFP4 experts through
    the fused MoE, its attention through ``linear_packed`` (q and k in Q5_1, v in IQ4_NL, o in Q5_0); the same
    greedy tokens as the reference kernels on the matrices expanded at load."""
    from tests.conftest import make_tiny_model
    from tools.write_gguf import write_gguf

    path = make_tiny_model(str(tmp_path / "gpt_oss"), "gpt_oss", smollm_tokenizer_dir, seed=5, intermediate_size=64,
                           swiglu_limit=7.0)
    gguf = str(tmp_path / "mx.gguf")
    types = {"attn_q": "Q5_1", "attn_k": "Q5_1", "attn_v": "IQ4_NL", "attn_output": "Q5_0"}
    write_gguf(path, gguf, "gpt-oss", lambda name: "MXFP4" if "_exps." in name else types.get(name.split(".")[-2]))

    def check(llm, backend):
        layer = llm.engine.runner.model.layers[0]
        assert (layer.mlp.experts.packed, layer.self_attn.o_proj.packed) == (
            (None, None) if backend == "reference" else ("mxfp4", "q5_0"))
        assert [seg[0] for seg in layer.self_attn.qkv_proj.segments] == ([] if backend == "reference" else
                                                                         ["q5_1", "iq4_nl"])

    outs, _ = greedy_by_backend(monkeypatch, gguf, [3, 20], 3, check, tokenizer=path)
    assert outs["triton"] == outs["reference"]


@pytest.mark.parametrize("arch", ["qwen3", "gemma3_text", "phi3"])
def test_triton_engine_head_norms_and_partial_rotary_greedy_equal_reference(arch, tmp_path, smollm_tokenizer_dir,
                                                                           monkeypatch):
    """Qwen3's per-head q/k norms (Gemma 3's with their float32 1 + w weights) and Phi-3's partial rotary (a quarter
    of each head's dims left unturned), made in ``rope_and_store_``'s one Triton launch with the store: the same
    greedy tokens as the reference kernels'."""
    from tests.conftest import make_tiny_model

    extra = {"head_dim": 24} if arch == "qwen3" else {"partial_rotary_factor": 0.75}
    path = make_tiny_model(str(tmp_path / arch), arch, smollm_tokenizer_dir, seed=5, **extra)
    calls = []
    monkeypatch.setattr(tri, "rope_and_store_", lambda *a, _real=tri.rope_and_store_: calls.append(a[-1]) or _real(*a))
    outs, _ = greedy_by_backend(monkeypatch, path, [3, 30], 4)
    assert outs["triton"] == outs["reference"]
    assert calls and all((norms is not None) == (arch != "phi3") for norms in calls)


def test_triton_engine_moe_greedy_equals_reference(tmp_path, smollm_tokenizer_dir, monkeypatch):
    """A mixture of experts (Qwen2-MoE: routed experts, and a shared one) with every kernel Triton: the same greedy
    tokens as the reference kernels', the Triton fused MoE serving every sparse layer."""
    from tests.conftest import make_tiny_model

    path = make_tiny_model(str(tmp_path / "moe"), "qwen2_moe", smollm_tokenizer_dir, seed=4)
    outs, calls = greedy_by_backend(monkeypatch, path, [3, 30], 4)
    assert outs["triton"] == outs["reference"]
    assert calls


# ----------------------------------------------------------------------------- sampling


def _race_inputs(n: int, vocab: int, dtype: torch.dtype, spread: float, seed: int):
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(n, vocab, generator=g) * spread).to(dtype)
    logits[0, : vocab // 3] = float("-inf")  # (a row whose processing forbade a third of its tokens)
    temperature = torch.tensor([0.7, 1.0, 1.5] * n)[:n]
    top_k = torch.tensor([0, 0, 0, 5, 0, 0, 40, 1] * n)[:n]
    top_p = torch.tensor([1.0, 0.9, 0.5, 0.05, 0.95, 1.0] * n)[:n]
    min_p = torch.tensor([0.0, 0.0, 0.05, 0.0, 0.3] * n)[:n]
    keys = torch.randint(0, 1 << 32, (n, 2), generator=g)
    return [t.to(DEVICE) for t in (logits, temperature, top_k, top_p, min_p, keys)] + [int(top_k.max())]


@pytest.mark.parametrize("dtype,vocab,spread", [(F32, 2500, 3.0), (BF16, 777, 3.0), (F32, 2100, 0.05)],
                         ids=["fp32-peaked", "bf16", "fp32-flat"])
def test_sample_race_matches_reference(dtype, vocab, spread):
    """The race over what top-k, top-p and min-p keep, without a sort, picks the reference's token (same draws,
    masked first) in every row, bf16's ties in probability included; in these inputs the masks change 9 to 13
    rows' tokens of 30 (against the race over the whole row), those of top-p 0.05 and 0.5 by later races."""
    args = _race_inputs(30, vocab, dtype, spread, seed=5)
    got, want = tri.sample_race(*args), ref.sample_race(*args)
    assert got.dtype == torch.int64 and got.shape == (30,)
    assert got.tolist() == want.tolist()
    assert not (args[0].gather(1, got.unsqueeze(1)) == float("-inf")).any()


def test_sample_race_keeps_tied_tokens_and_tells_close_scores_apart():
    """Top-p's cut never splits tokens tied in probability (eight equal logits at top-p 0.3: the race over all
    eight, as the reference and the sampler's torch path keep them), nor top-k's (top-k 3 of the eight: the same
    tokens), and at a small temperature two equal large logits still race by their draws (scores taken from the
    row's largest logit, not from 50 / 0.01)."""
    n = 16
    keys = torch.randint(0, 1 << 32, (n, 2), generator=torch.Generator().manual_seed(3)).to(DEVICE)
    ones, zeros = torch.ones(n, device=DEVICE), torch.zeros(n, device=DEVICE)
    no_k, p = torch.zeros(n, dtype=torch.int64, device=DEVICE), torch.full((n,), 0.3, device=DEVICE)
    tied = torch.zeros(n, 8, dtype=BF16, device=DEVICE)
    got = tri.sample_race(tied, ones, no_k, p, zeros, keys)
    assert got.tolist() == ref.sample_race(tied, ones, no_k, p, zeros, keys).tolist()
    assert len(set(got.tolist())) > 3  # (not the first three of a sort: all eight race)
    three = torch.full((n,), 3, device=DEVICE)  # (top-k 3 of eight tied: all eight tie with the third)
    assert tri.sample_race(tied, ones, three, ones, zeros, keys, 3).tolist() == got.tolist()
    close = torch.full((n, 2), 50.0, device=DEVICE)
    cold = torch.full((n,), 0.01, device=DEVICE)
    got = tri.sample_race(close, cold, no_k, ones, zeros, keys)
    assert got.tolist() == ref.sample_race(close, cold, no_k, ones, zeros, keys).tolist() and 0 < sum(got.tolist()) < n


def test_sample_race_checks_its_arguments():
    logits, temperature, top_k, top_p, min_p, keys, _ = _race_inputs(4, 100, F32, 1.0, seed=1)
    with pytest.raises(ValueError, match="keys"):
        tri.sample_race(logits, temperature, top_k, top_p, min_p, keys[:, :1].contiguous())
    with pytest.raises(ValueError, match="top_p"):
        tri.sample_race(logits, temperature, top_k, top_p[:3], min_p, keys)
    with pytest.raises(ValueError, match="temperature"):
        tri.sample_race(logits, temperature.double(), top_k, top_p, min_p, keys)
    with pytest.raises(ValueError, match="top_k"):
        tri.sample_race(logits, temperature, top_k.int(), top_p, min_p, keys)
    # (no max_k: each row's k-th largest is looked for among all the logits, and found)
    assert tri.sample_race(logits, temperature, top_k, top_p, min_p, keys).tolist() == \
        ref.sample_race(logits, temperature, top_k, top_p, min_p, keys).tolist()


def test_sampler_races_on_triton_as_it_masks_on_torch(monkeypatch):
    """The sampler's non-greedy rows through ``kernels.sample_race`` (Triton's) give a seeded row the tokens the
    torch path (top-k, top-p and min-p masks, then the race) gives it, step after step; a row of llama.cpp's
    samplers (typical) keeps the torch path, and in a step with other rows it alone does: they still race."""
    from engine.protocol import SamplingParams
    from engine.sampler import Sampler, SamplingState

    g = torch.Generator().manual_seed(2)
    logits = (torch.randn(8, 300, generator=g) * 3).to(DEVICE)
    params = [SamplingParams(temperature=0.8, top_p=0.9, seed=11), SamplingParams(temperature=1.0, seed=5),
              SamplingParams(temperature=0.6, top_p=0.5, min_p=0.1, seed=7), SamplingParams(temperature=0.0),
              SamplingParams(temperature=0.9, top_p=0.3, seed=3), SamplingParams(temperature=1.2, min_p=0.2, seed=9),
              SamplingParams(temperature=0.8, top_k=20, top_p=0.9, seed=4), SamplingParams(temperature=1.0, top_k=3)]
    every_k = [SamplingParams(temperature=0.7, top_k=k, top_p=0.8, seed=k) for k in (1, 4, 30)]  # (torch: topk)

    def steps(backend: str, params: list[SamplingParams]) -> list[list[int]]:
        monkeypatch.setattr(kernels, "_backend", backend)
        sampler, states, n = Sampler(300, [2], DEVICE), [SamplingState(p) for p in params], len(params)
        return [sampler(logits[:n], params, states, [[1]] * n, [[]] * n, [k] * n).token_ids for k in range(4)]

    raced = steps("triton", params)
    assert kernels.races(logits.device)
    masked = steps("reference", params)
    assert not kernels.races(logits.device)
    assert [ids[:7] for ids in raced] == [ids[:7] for ids in masked]  # (the last row is unseeded: other draws)
    assert steps("triton", every_k) == steps("reference", every_k)
    race, raced = kernels.sample_race, []
    monkeypatch.setattr(kernels, "_backend", "triton")
    typical = [SamplingParams(temperature=0.8, typical_p=0.5, seed=1)]
    monkeypatch.setattr(kernels, "sample_race", lambda *a: pytest.fail("llama.cpp's samplers take the torch path"))
    Sampler(300, [2], DEVICE)(logits[:1], typical, [SamplingState(typical[0])], [[1]], [[]], [0])
    monkeypatch.setattr(kernels, "sample_race", lambda logits, *a: raced.append(len(logits)) or race(logits, *a))
    llama = typical + [SamplingParams(temperature=0.8, mirostat=2, seed=13)]  # (mirostat's target moves a step)
    mixed = steps("triton", params[:6] + llama)
    assert raced == [5] * 4  # (one of the six is greedy)
    assert [ids[:6] for ids in mixed] == [ids[:6] for ids in masked]
    assert [ids[6:] for ids in mixed] == [ids[6:] for ids in steps("reference", params[:6] + llama)]
