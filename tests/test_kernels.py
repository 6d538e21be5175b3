"""The reference kernels against naive per-sequence loops: the spec that every
other kernel (Triton, CPU) is checked against."""

from __future__ import annotations

import functools
import math

import pytest
import torch

import kernels
from engine.attention import Attention, build_metadata

H, HKV, D, BS = 4, 2, 8, 4


def naive_attention(q, k, v, pos0, window=0, softcap=0.0, sinks=None):
    """q (Q, H, D) at positions pos0.. over k/v (S, Hkv, D), causal, GQA; with a sliding ``window``
    over the latest ``window`` positions; ``softcap``: scores s -> softcap tanh(s / softcap); ``sinks`` (H,):
    one more score per head in each softmax, its probability dropped (GPT-OSS's, as transformers computes it)."""
    k = k.repeat_interleave(H // HKV, 1).float()
    v = v.repeat_interleave(H // HKV, 1).float()
    out = []
    for i in range(q.shape[0]):
        p = pos0 + i
        first = max(0, p + 1 - window) if window else 0
        s = torch.einsum("hd,khd->hk", q[i].float(), k[first:p + 1]) / math.sqrt(D)
        if softcap:
            s = softcap * torch.tanh(s / softcap)
        probs = s.softmax(-1) if sinks is None else torch.cat([s, sinks[:, None]], -1).softmax(-1)[:, :-1]
        out.append(torch.einsum("hk,khd->hd", probs, v[first:p + 1]))
    return torch.stack(out)


def make_batch(seq_lens, query_lens, dtype, seed=0, window=0, softcap=0.0, sinks=None, device="cpu", split=True):
    g = torch.Generator().manual_seed(seed)  # the same numbers on every device
    nblocks = sum(-(-n // BS) for n in seq_lens) + 3
    perm = torch.randperm(nblocks, generator=g).tolist()  # scattered, non-contiguous blocks
    attn = Attention(H, HKV, D, window=window, softcap=softcap, sinks=sinks is not None).to(device)
    if sinks is not None:
        attn.sinks.copy_(sinks)
    attn.k_cache = torch.zeros(nblocks, BS, HKV, D, dtype=dtype, device=device)
    attn.v_cache = torch.zeros(nblocks, BS, HKV, D, dtype=dtype, device=device)
    tables, ks, vs = [], [], []
    for n in seq_lens:
        need = -(-n // BS)
        tables.append([perm.pop() for _ in range(need)])
        ks.append(torch.randn(n, HKV, D, generator=g).to(dtype=dtype, device=device))
        vs.append(torch.randn(n, HKV, D, generator=g).to(dtype=dtype, device=device))
    # the cached part goes in through store_kvcache, as the engine would have put it
    for bt, k, v, n, ql in zip(tables, ks, vs, seq_lens, query_lens, strict=True):
        pos = torch.arange(n - ql)
        slots = (torch.tensor(bt)[pos // BS] * BS + pos % BS).to(device)
        kernels.store_kvcache(k[:n - ql], v[:n - ql], attn.k_cache, attn.v_cache, slots)
    q = torch.randn(sum(query_lens), H, D, generator=g).to(dtype=dtype, device=device)
    new_k = torch.cat([k[n - ql:] for k, n, ql in zip(ks, seq_lens, query_lens, strict=True)])
    new_v = torch.cat([v[n - ql:] for v, n, ql in zip(vs, seq_lens, query_lens, strict=True)])
    computed = [n - ql for n, ql in zip(seq_lens, query_lens, strict=True)]
    positions, meta = build_metadata(query_lens, computed, tables, BS, torch.device(device), split)
    return attn, q, new_k, new_v, ks, vs, meta, positions


@pytest.mark.parametrize("backend", ["reference", "auto"])  # auto: the CPU kernels (tests/test_cpu_kernels.py)
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
@pytest.mark.parametrize("query_lens,seq_lens", [
    ([1, 1, 1], [5, 9, 1]),  # decode only
    ([1] * 37, [(7 * i) % 23 + 1 for i in range(37)]),  # decode in several groups, sorted by length
    ([6, 3], [6, 10]),  # fresh prompt and a chunk after a cached prefix
    ([1, 7, 1, 2], [13, 7, 4, 8]),  # mixed: decodes and prompt chunks in one batch
])
# sliding windows, Gemma 2's cap, GPT-OSS's sinks (one far above every score: that head's output near 0)
@pytest.mark.parametrize("window,softcap,sinks", [(0, 0.0, None), (5, 0.0, None), (6, 1.5, None),
                                                  (0, 0.0, [0.5, -1.0, 2.0, 30.0]), (5, 0.0, [1.0, 0.0, -3.0, 0.5])])
def test_paged_attention_matches_naive(query_lens, seq_lens, dtype, tol, backend, window, softcap, sinks,
                                       monkeypatch):
    monkeypatch.setattr(kernels, "_backend", backend)
    sinks = None if sinks is None else torch.tensor(sinks)
    attn, q, new_k, new_v, ks, vs, meta, positions = make_batch(seq_lens, query_lens, dtype, window=window,
                                                                softcap=softcap, sinks=sinks)
    out = attn(q, new_k, new_v, meta)
    want, row = [], 0
    for k, v, n, ql in zip(ks, vs, seq_lens, query_lens, strict=True):
        want.append(naive_attention(q[row:row + ql], k, v, n - ql, window, softcap, sinks))
        row += ql
    assert torch.allclose(out.float(), torch.cat(want), atol=tol, rtol=tol)
    expected_pos = torch.cat([torch.arange(n - ql, n) for n, ql in zip(seq_lens, query_lens, strict=True)])
    assert torch.equal(positions, expected_pos)


def test_metadata_splits_decode_and_prefill_rows():
    _, _, _, _, _, _, meta, _ = make_batch([13, 7, 4, 8], [1, 7, 1, 2], torch.float32)
    assert meta.decode.token_rows.tolist() == [0, 8]  # longest first
    assert meta.decode.seq_lens.tolist() == [13, 4]
    assert meta.prefill.token_rows.tolist() == [1, 2, 3, 4, 5, 6, 7, 9, 10]
    assert meta.prefill.query_start.tolist() == [0, 7, 9]
    assert not meta.decode.in_order


@pytest.mark.parametrize("backend", ["reference", "auto"])
@pytest.mark.parametrize("window,sinks", [(0, None), (5, [1.0, 0.0, -3.0, 0.5])])
def test_a_mixed_step_unsplit_is_all_prefill_rows_attended_alike(backend, window, sinks, monkeypatch):
    """``split=False`` (where the prefill kernel takes one-token sequences, Triton's): a step of decodes and
    prompt chunks is one prefill over every sequence in the step's order, whose attention is the naive one."""
    monkeypatch.setattr(kernels, "_backend", backend)
    sinks = None if sinks is None else torch.tensor(sinks)
    seq_lens, query_lens = [13, 7, 4, 8, 1], [1, 7, 1, 2, 1]
    attn, q, new_k, new_v, ks, vs, meta, _ = make_batch(seq_lens, query_lens, torch.float32, window=window,
                                                         sinks=sinks, split=False)
    assert meta.decode is None and meta.prefill.token_rows is None
    assert meta.prefill.query_start.tolist() == [0, 1, 8, 9, 11, 12]
    assert meta.prefill.seq_lens.tolist() == seq_lens
    want, row = [], 0
    for k, v, n, ql in zip(ks, vs, seq_lens, query_lens, strict=True):
        want.append(naive_attention(q[row:row + ql], k, v, n - ql, window, 0.0, sinks))
        row += ql
    torch.testing.assert_close(attn(q, new_k, new_v, meta), torch.cat(want), atol=1e-5, rtol=1e-5)
    _, _, _, _, _, _, decodes, _ = make_batch([5, 9], [1, 1], torch.float32, split=False)
    assert decodes.prefill is None and decodes.decode is not None  # decodes alone: still a decode step


def test_decode_rows_already_in_order_are_attended_where_they_are():
    """A decode-only batch whose rows are longest first (one sequence, say) needs no reordering of q; the
    attention over it is the same either way."""
    def in_order(query_lens: list[int], computed: list[int]) -> bool:
        tables = [list(range(i * 8, i * 8 + 8)) for i in range(len(query_lens))]
        return build_metadata(query_lens, computed, tables, BS, torch.device("cpu"))[1].decode.in_order

    assert not in_order([1, 1], [3, 9]) and in_order([1, 1, 1], [9, 3, 3]) and not in_order([1, 2], [9, 3])
    attn, q, k, v, _, _, meta, _ = make_batch([13, 9, 4], [1, 1, 1], torch.float32)
    assert meta.decode.in_order
    fast = attn(q, k, v, meta)
    meta.decode.in_order = False
    assert torch.equal(attn(q, k, v, meta), fast)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gemma_norm_and_gelu_are_transformers(dtype):
    """Gemma's RMSNorm (x * (1 + w), rounded once: the weight kept as 1 + w in float32) and GELU-and-mul
    as transformers computes them, through whichever kernels serve CPU tensors: bf16 bit for bit (fp32's
    norm is the C kernel's, its sum in another order: to 1e-6)."""
    from transformers.activations import ACT2FN
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm

    x, w = (torch.randn(5, 64) * 3).to(dtype), (torch.randn(64) / 4).to(dtype)
    norm = Gemma3RMSNorm(64, eps=1e-6).to(dtype)
    norm.weight.data.copy_(w)
    same = torch.equal if dtype == torch.bfloat16 else functools.partial(torch.allclose, rtol=1e-6, atol=1e-6)
    with torch.no_grad():
        assert same(kernels.rms_norm(x, 1 + w.float(), 1e-6), norm(x))
        summed = x + x.flip(0)
        out, residual = kernels.fused_add_rms_norm(x, x.flip(0), 1 + w.float(), 1e-6)
        assert torch.equal(residual, summed) and same(out, norm(summed))
    gu = torch.randn(5, 128).to(dtype)
    assert torch.equal(kernels.gelu_and_mul(gu), ACT2FN["gelu_pytorch_tanh"](gu[:, :64]) * gu[:, 64:])


def test_rms_norm_silu_rope_references():
    x = torch.randn(3, 8)
    w = torch.randn(8)
    ref = w * x / torch.sqrt((x * x).mean(-1, keepdim=True) + 1e-6)
    assert torch.allclose(kernels.rms_norm(x, w, 1e-6), ref, atol=1e-6)
    gu = torch.randn(3, 8)
    assert torch.allclose(kernels.silu_and_mul(gu), torch.nn.functional.silu(gu[:, :4]) * gu[:, 4:])
    # RoPE in place, as transformers rotates: x * cos + rotate_half(x) * sin over (T, H, D)
    q, k = torch.randn(2, 4, 8), torch.randn(2, 2, 8)
    q0, k0 = q.clone(), k.clone()
    ang = torch.rand(2, 4)
    kernels.apply_rope_(q, k, ang.cos(), ang.sin())
    cos, sin = torch.cat([ang.cos()] * 2, -1)[:, None], torch.cat([ang.sin()] * 2, -1)[:, None]
    for x, x0 in ((q, q0), (k, k0)):
        rotate_half = torch.cat([-x0[..., 4:], x0[..., :4]], -1)
        assert torch.allclose(x, x0 * cos + rotate_half * sin, atol=1e-6)
    kernels.apply_rope_(q, k, ang.cos(), -ang.sin())  # and back
    assert torch.allclose(q, q0, atol=1e-6) and torch.allclose(k, k0, atol=1e-6)
