"""Time each Triton kernel of ``kernels/`` on CUDA against a torch equivalent and against its memory floor.

Each kernel's median time (``triton.testing.do_bench``, launched from Python; and for the dense cases again
replayed from a CUDA graph, ``graphed``: the kernel's own time, as decode and prompt graphs run it) beside:
torch's (SDPA over the same context stored contiguously for attention, the eager reference twin in
``kernels.reference`` for the rest), and
the floor, the bytes the kernel must move ÷ the device's copy bandwidth (the best of a few 1 GiB
device-to-device copies, as ``bench_offline`` measures it). ``bw`` is floor ÷ kernel time (the graphed one where
there is one): the share of the bandwidth the kernel reaches.
Shapes: SmolLM2-135M's and Qwen2-0.5B's heads (head_dim 64), bf16, KV blocks of 16 tokens scattered
as in a busy cache; decode at ``--batch`` sequences for each ``--contexts`` length (and at the longest,
through a sliding window of 1024: SDPA then over the window's keys alone, and over an fp8 cache), prefill of
``--prefill`` fresh prompts, a mixed step (the batch decoding beside a 128-token chunk: one prefill launch against
the decode and prefill kernels on rows split apart), the other kernels at the decode batch's and the prefill's token counts;
the shortest context's decode in other launch shapes (warps, keys a loop step) against the default launch;
the MLP's gate|up projection as Q4_Z blocks (an int4 checkpoint) at 1 row, the batch's and the prefill's,
and its down projection as Q4_K super-blocks (a Q4_K_M GGUF file's);
a mixture of experts' layer (Qwen3-30B-A3B's: 128 experts, 8 a token) at the same token counts, and
gpt-oss-20b's (32 experts of 2880, 4 a token) with its experts in MXFP4 against them widened to bf16.
Last, the sampler's step at the decode batch over Qwen2's vocabulary (``Sampler.sample``: greedy, top-p, seeded
top-p, top-k, top-p with one row of llama.cpp's typical sampling), as the engine runs it (Triton's race,
``kernels.sample_race``, for the non-greedy rows but llama.cpp's) and with the torch operators that sort each
row, against the logits read once (JSON ``sampler_us``, ``sampler``).
Prints a table, then one JSON line. Without CUDA there is nothing to time: it says so (JSON too).

    python3 tools/bench_kernels.py [--batch 256] [--contexts 512,2048,8192] [--prefill 4x1024]
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F

# Runnable as ``python3 tools/bench_kernels.py`` from a checkout, without installing.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tools.bench_offline import measure_bandwidth  # noqa: E402

MODELS = {  # attention heads, KV heads, hidden size, MLP size
    "smollm2-135m": (9, 3, 576, 1536),
    "qwen2-0.5b": (14, 2, 896, 4864),
}
# a mixture of experts' layer: name, hidden, experts, their width, top k, the experts' packed format (or None)
MOE = ("qwen3-30b-a3b", 2048, 128, 768, 8, None)
MOE_MXFP4 = ("gpt-oss-20b", 2880, 32, 2880, 4, "mxfp4")  # (its experts as OpenAI ships them)
HEAD_DIM, PAGE, DTYPE, ELT = 64, 16, torch.bfloat16, 2
# the decode kernel's other launch shapes timed (num_warps, keys a loop step): compiled for sm_90 at Qwen2-0.5B's
# heads (as launched: aligned), the default (4, 64) takes 66 registers a thread, (8, 64) 58, (4, 32) 59, (8, 32) 54,
# (2, 64) 144
LAUNCHES = ((8, 64), (4, 32), (8, 32), (2, 64))
DEVICE = "cuda"  # (tests build the cases on the CPU, for Triton's interpreter)
VOCAB = 151936  # Qwen2's: the sampler's step reads and sorts rows this long
# the sampler's step, every row of the batch one kind of request (the OpenAI API's default is temperature 1)
SAMPLING = {"greedy": {"temperature": 0.0}, "top_p": {"temperature": 0.8, "top_p": 0.95},
            "seeded_top_p": {"temperature": 0.8, "top_p": 0.95, "seed": 7}, "top_k": {"temperature": 0.8, "top_k": 50},
            "top_p_one_typical": {"temperature": 0.8, "top_p": 0.95}}
FIRST_ROW = {"top_p_one_typical": {"typical_p": 0.5}}  # one row of llama.cpp's samplers: its own path


@dataclass
class Case:
    kernel: str
    model: str
    shape: str
    nbytes: int  # what the kernel must read and write at least
    triton: Callable[[], object]
    torch: Callable[[], object]
    baseline: str


def randn(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, device=DEVICE, dtype=DTYPE)


def paged(tokens_per_seq: int, seqs: int, hkv: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """K and V caches holding ``seqs`` contexts in scattered blocks, and their block tables."""
    nblk = -(-tokens_per_seq // PAGE)
    tables = torch.randperm(seqs * nblk, device=DEVICE, dtype=torch.int32).view(seqs, nblk)
    return randn(seqs * nblk, PAGE, hkv, HEAD_DIM), randn(seqs * nblk, PAGE, hkv, HEAD_DIM), tables


def mixed_case(model: str, batch: int, ctx: int) -> Case:
    """A busy server's step with a prompt: ``batch`` sequences decoding at ``ctx`` beside one 128-token chunk
    (after a cached prefix, to the same context), in one launch of the prefill kernel, against the split it
    replaced: decode rows to the decode kernel, the chunk to the prefill kernel, gathered and put back."""
    import kernels.triton as tri

    h, hkv, _, _ = MODELS[model]
    d, scale, chunk = HEAD_DIM, HEAD_DIM ** -0.5, min(128, ctx)
    k_cache, v_cache, tables = paged(ctx, batch + 1, hkv)
    lens = torch.full((batch + 1,), ctx, device=DEVICE, dtype=torch.int32)
    start = torch.arange(batch + 2, device=DEVICE, dtype=torch.int32)
    start[-1] = batch + chunk
    q = randn(batch + chunk, h, d)
    rows = torch.arange(batch + chunk, device=DEVICE)
    dec_rows, chunk_rows, chunk_start = rows[:batch], rows[batch:], start[-2:] - batch

    def split() -> torch.Tensor:
        out = torch.empty_like(q)
        out.index_copy_(0, dec_rows, tri.paged_decode_attention(q.index_select(0, dec_rows), k_cache, v_cache,
                                                                tables[:batch], lens[:batch], ctx, scale))
        out.index_copy_(0, chunk_rows, tri.paged_prefill_attention(
            q.index_select(0, chunk_rows), k_cache, v_cache, tables[batch:], lens[batch:], chunk_start, None, None,
            ctx, scale))
        return out

    return Case("paged_prefill_attention", model, f"mixed: B={batch} ctx={ctx} + {chunk}-token chunk",
                2 * (batch + 1) * ctx * hkv * d * ELT + 2 * q.numel() * ELT + tables.numel() * 4,
                lambda: tri.paged_prefill_attention(q, k_cache, v_cache, tables, lens, start, None, None, ctx, scale),
                split, "decode + prefill kernels, rows split")


def cases(model: str, batch: int, contexts: list[int], prefill: tuple[int, int]) -> Iterator[Case]:
    import kernels.reference as ref
    import kernels.triton as tri

    h, hkv, hidden, inter = MODELS[model]
    d, scale = HEAD_DIM, HEAD_DIM ** -0.5
    sdpa, eager = "torch SDPA, contiguous KV", "torch eager (kernels.reference)"
    # each context's decode, and at the longest a sliding layer's (Gemma 3's window), which reads its keys only,
    # and the longest over an fp8 cache (--kv-cache-dtype fp8: a byte a value to read)
    decodes = [(ctx, 0, False) for ctx in contexts] + [(contexts[-1], 1024, False)] * (contexts[-1] > 1024)
    for ctx, window, fp8 in decodes + [(contexts[-1], 0, True)]:
        span = window or ctx  # the keys a query reads (SDPA gets them alone, contiguous)
        k_cache, v_cache, tables = paged(ctx, batch, hkv)
        if fp8:
            k_cache, v_cache = ref.to_cache(k_cache, torch.float8_e4m3fn), ref.to_cache(v_cache, torch.float8_e4m3fn)
        lens = torch.full((batch,), ctx, device=DEVICE, dtype=torch.int32)
        q, k, v = randn(batch, h, d), randn(batch, hkv, span, d), randn(batch, hkv, span, d)
        nbytes = 2 * k.numel() * k_cache.element_size() + 2 * q.numel() * ELT + tables.numel() * 4
        default = lambda q=q, kc=k_cache, vc=v_cache, bt=tables, sl=lens, n=ctx, w=window: (  # noqa: E731
            tri.paged_decode_attention(q, kc, vc, bt, sl, n, scale, w))
        yield Case("paged_decode_attention", model, f"B={batch} ctx={ctx}" + (f" window={window}" if window else "")
                   + (" fp8 cache" if fp8 else ""), nbytes, default,
                   lambda q=q, k=k, v=v: F.scaled_dot_product_attention(q[:, :, None], k, v, scale=scale,
                                                                        enable_gqa=True), sdpa)
        if (ctx, window, fp8) != (contexts[0], 0, False):
            continue
        # the shortest context's decode in other launch shapes (num_warps, keys a loop step), each against the
        # default (4 warps, 64 keys): "torch us" is the default's here, so torch/triton above 1 means that shape wins
        for warps, tile in LAUNCHES:
            yield Case("paged_decode_attention", model, f"launch: ctx={ctx} w{warps} n{tile}", nbytes,
                       lambda q=q, kc=k_cache, vc=v_cache, bt=tables, sl=lens, n=ctx, w=warps, tl=tile:
                       tri.paged_decode_attention(q, kc, vc, bt, sl, n, scale, num_warps=w, tile=tl),
                       default, "the default launch (4 warps, 64 keys a step)")

    seqs, plen = prefill
    t = seqs * plen
    k_cache, v_cache, tables = paged(plen, seqs, hkv)
    lens = torch.full((seqs,), plen, device=DEVICE, dtype=torch.int32)
    start = torch.arange(0, t + 1, plen, device=DEVICE, dtype=torch.int32)
    q_index = start[:-1, None] + torch.arange(plen, device=DEVICE)  # (B, Q): every prompt is plen long
    q, k, v = randn(seqs, h, plen, d), randn(seqs, hkv, plen, d), randn(seqs, hkv, plen, d)
    q_flat = q.transpose(1, 2).reshape(t, h, d)
    yield Case("paged_prefill_attention", model, f"{seqs}x{plen}", (2 * q.numel() + 2 * k.numel()) * ELT,
               lambda: tri.paged_prefill_attention(q_flat, k_cache, v_cache, tables, lens, start, q_index,
                                                   None, plen, scale),
               lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True),
               sdpa)

    yield mixed_case(model, batch, contexts[0])

    for n in (batch, t):
        kv = randn(n, hkv, d), randn(n, hkv, d)
        caches = randn(n * 2, PAGE, hkv, d), randn(n * 2, PAGE, hkv, d)
        slots = torch.randperm(n * 2 * PAGE, device=DEVICE)[:n]
        yield Case("store_kvcache", model, f"T={n}", 4 * kv[0].numel() * ELT + n * 8,
                   lambda kv=kv, c=caches, s=slots: tri.store_kvcache(*kv, *c, s),
                   lambda kv=kv, c=caches, s=slots: ref.store_kvcache(*kv, *c, s), eager)
        x, res, w = randn(n, hidden), randn(n, hidden), randn(hidden)
        yield Case("rms_norm", model, f"T={n}", 2 * x.numel() * ELT,
                   lambda x=x, w=w: tri.rms_norm(x, w, 1e-6),
                   lambda x=x, w=w: ref.rms_norm(x, w, 1e-6), eager)
        yield Case("fused_add_rms_norm", model, f"T={n}", 4 * x.numel() * ELT,
                   lambda x=x, r=res, w=w: tri.fused_add_rms_norm(x, r, w, 1e-6),
                   lambda x=x, r=res, w=w: ref.fused_add_rms_norm(x, r, w, 1e-6), eager)
        qkv = randn(n, (h + 2 * hkv) * d)
        # views of a fused qkv projection, as the model passes them
        qr, kr = qkv[:, :h * d].view(n, h, d), qkv[:, h * d:(h + hkv) * d].view(n, hkv, d)
        angle = torch.rand(n, d // 2, device=DEVICE) * 6.3
        cos, sin = angle.cos().to(DTYPE), angle.sin().to(DTYPE)
        yield Case("apply_rope_", model, f"T={n}", (2 * n * (h + hkv) * d + 2 * cos.numel()) * ELT,
                   lambda q=qr, k=kr, c=cos, s=sin: tri.apply_rope_(q, k, c, s),
                   lambda q=qr, k=kr, c=cos, s=sin: ref.apply_rope_(q, k, c, s), eager)
        # the two above in one launch, as a layer runs them (the new keys turned and stored from registers)
        vr = qkv[:, (h + hkv) * d:].view(n, hkv, d)
        yield Case("rope_and_store_", model, f"T={n}", (n * (2 * h + 5 * hkv) * d + 2 * cos.numel()) * ELT + n * 8,
                   lambda q=qr, k=kr, v=vr, c=cos, s=sin, kc=caches, sl=slots: tri.rope_and_store_(q, k, v, c, s, *kc,
                                                                                                 sl, d),
                   lambda q=qr, k=kr, v=vr, c=cos, s=sin, kc=caches, sl=slots: (tri.apply_rope_(q, k, c, s),
                                                                                tri.store_kvcache(k, v, *kc, sl)),
                   "apply_rope_ then store_kvcache (Triton)")
        # and with Qwen3's per-head q/k norms first, against the four launches the model made for them
        norms = (1 + randn(d) / 4, 1 + randn(d) / 4, 1e-6)

        def apart(q=qr, k=kr, v=vr, c=cos, s=sin, kc=caches, sl=slots, w=norms):
            qn = tri.rms_norm(q.reshape(-1, d), w[0], w[2]).view(q.shape)
            kn = tri.rms_norm(k.reshape(-1, d), w[1], w[2]).view(k.shape)
            tri.apply_rope_(qn, kn, c, s)
            tri.store_kvcache(kn, v, *kc, sl)

        yield Case("rope_and_store_", model, f"T={n}, head norms",
                   (n * (2 * h + 5 * hkv) * d + 2 * cos.numel() + 2 * d) * ELT + n * 8,
                   lambda q=qr, k=kr, v=vr, c=cos, s=sin, kc=caches, sl=slots, w=norms: tri.rope_and_store_(
                       q, k, v, c, s, *kc, sl, d, w), apart, "rms_norm x2, apply_rope_, store_kvcache (Triton)")
        gate_up = randn(n, 2 * inter)
        yield Case("silu_and_mul", model, f"T={n}", 3 * n * inter * ELT,
                   lambda x=gate_up: tri.silu_and_mul(x), lambda x=gate_up: ref.silu_and_mul(x), eager)

    # the MLP's gate|up projection and the attention output kept as Q4_Z blocks (an int4 checkpoint), against
    # the bf16 dense GEMM; the narrow one at decode sizes only (where the kernel splits K to fill the SMs)
    for n_out, rows in ((2 * inter, (1, batch, t)), (hidden, (1, batch))):
        packed = _random_blocks("q4_z", 1, n_out, hidden)[0]
        dense = ref.dequantize(packed, "q4_z").to(DTYPE)
        for n in rows:
            x = randn(n, hidden)
            yield Case("linear_packed q4_z", model, f"T={n} {n_out}x{hidden}",
                       packed.numel() + (x.numel() + n * n_out) * ELT,
                       lambda x=x, w=packed: tri.linear_packed(x, w, "q4_z"), lambda x=x, w=dense: F.linear(x, w),
                       "torch bf16 GEMM, dense weights")
    # the down projection as a Q4_K_M GGUF file holds it (Q4_K super-blocks: its K, the MLP's width, is whole ones)
    packed = _random_blocks("q4_k", 1, hidden, inter)[0]
    dense = ref.dequantize(packed, "q4_k").to(DTYPE)
    for n in (1, batch, t):
        x = randn(n, inter)
        yield Case("linear_packed q4_k", model, f"T={n} {hidden}x{inter}", packed.numel() + (x.numel() + n * hidden) * ELT,
                   lambda x=x, w=packed: tri.linear_packed(x, w, "q4_k"), lambda x=x, w=dense: F.linear(x, w),
                   "torch bf16 GEMM, dense weights")


def moe_cases(batch: int, tokens: int, layers: tuple = (MOE, MOE_MXFP4)) -> Iterator[Case]:
    """``fused_moe`` on one layer of each of ``layers`` at 1 token, the decode batch and the prefill's tokens,
    routed at random; its floor reads the experts the tokens were routed to (and x, out). Experts in bf16
    against torch eager, expert by expert; packed (GPT-OSS's MXFP4) against Triton's own on them widened."""
    for layer in layers:
        yield from _moe_layer_cases(batch, tokens, *layer)


def _moe_layer_cases(batch: int, tokens: int, name: str, hidden: int, experts: int, width: int, top_k: int,
                     fmt: str | None) -> Iterator[Case]:
    import kernels.reference as ref
    import kernels.triton as tri

    if fmt is None:
        w13, w2 = randn(experts, 2 * width, hidden) * 0.02, randn(experts, hidden, width) * 0.02
        elt = ELT
    else:  # random blocks (widened an expert at a time)
        w13, w2 = _random_blocks(fmt, experts, 2 * width, hidden), _random_blocks(fmt, experts, hidden, width)
        wide13, wide2 = (torch.stack([ref.dequantize(e, fmt).to(DTYPE) for e in w]) for w in (w13, w2))
        elt = ref.PACKED_BLOCKS[fmt][1] / ref.PACKED_BLOCKS[fmt][0]
    for n in (1, batch, tokens):
        x = randn(n, hidden)
        weights, ids = torch.softmax(torch.randn(n, experts, device=DEVICE), -1).topk(top_k, -1)
        nbytes = int(ids.unique().numel() * 3 * hidden * width * elt) + 2 * x.numel() * ELT
        if fmt is None:
            yield Case("fused_moe", name, f"T={n} E={experts}", nbytes,
                       lambda x=x, w=weights, i=ids: tri.fused_moe(x, w13, w2, w, i),
                       lambda x=x, w=weights, i=ids: ref.fused_moe(x, w13, w2, w, i), "torch eager, expert by expert")
        else:
            yield Case(f"fused_moe {fmt}", name, f"T={n} E={experts}", nbytes,
                       lambda x=x, w=weights, i=ids: tri.fused_moe(x, w13, w2, w, i, packed=fmt),
                       lambda x=x, w=weights, i=ids: tri.fused_moe(x, wide13, wide2, w, i),
                       "Triton, the experts widened to bf16")


def _random_blocks(fmt: str, experts: int, n: int, k: int) -> torch.Tensor:
    """(experts, n, k / block weights * block bytes) random ``fmt`` blocks (MXFP4's scale bytes 120..124, 2^-8..2^-4;
    Q4_Z's scales below 0.01, its zero points 8; Q4_K's d and dmin 2^-12: its weights within about ±1)."""
    import kernels.reference as ref

    weights, size = ref.PACKED_BLOCKS[fmt]
    blocks = torch.randint(0, 256, (experts, n, k // weights, size), device=DEVICE, dtype=torch.uint8)
    if fmt == "mxfp4":
        blocks[..., 0] = torch.randint(120, 125, blocks.shape[:-1], device=DEVICE, dtype=torch.uint8)
    elif fmt == "q4_z":
        blocks[..., 0:2] = (torch.rand(*blocks.shape[:-1], 1, device=DEVICE) * 0.01).half().view(torch.uint8)
        blocks[..., 2:4] = torch.full((*blocks.shape[:-1], 1), 8.0, device=DEVICE).half().view(torch.uint8)
    else:
        blocks[..., 0:4] = torch.full((*blocks.shape[:-1], 2), 2.0**-12, device=DEVICE).half().view(torch.uint8)
    return blocks.view(experts, n, -1)


def sampler_steps(batch: int, vocab: int = VOCAB) -> Iterator[tuple[str, Callable[[], torch.Tensor]]]:
    """For each kind of ``SAMPLING``: a step's sampling of ``batch`` rows of bf16 logits, every row of that kind, up
    to its ids on the device (``Sampler.sample``, eager, as a step runs it: no host sync)."""
    from engine.protocol import SamplingParams
    from engine.sampler import Sampler, SamplingState

    sampler, logits = Sampler(vocab, [0], DEVICE), randn(batch, vocab)
    for kind, knobs in SAMPLING.items():
        params = [SamplingParams(**knobs, **FIRST_ROW.get(kind, {}) if i == 0 else {}) for i in range(batch)]
        states = [SamplingState(p) for p in params]
        yield kind, functools.partial(_sample, sampler, logits, params, states)


def _sample(sampler, logits: torch.Tensor, params: list, states: list) -> torch.Tensor:
    n = len(params)
    return sampler.sample(logits, params, states, [[1]] * n, [[]] * n, [0] * n).ids


def time_sampler(batch: int, bw: float) -> dict[str, dict[str, float]]:
    """Each kind's sampling step timed and printed: its median time back to back (``do_bench``: the device's time
    where it is the longer) as the engine runs it (non-greedy rows: ``kernels.sample_race``), again
    with the torch operators that sort each row (the ``reference`` backend's path, in the torch column), the host's
    time a call (its launches, measured without waiting for them) and the floor, the logits read once. A decode
    step of Qwen2-0.5B at 256 sequences has a floor of about 0.36 ms."""
    from triton.testing import do_bench

    import kernels

    floor_ms = batch * VOCAB * ELT / bw * 1e3
    out = {}
    for kind, step in sampler_steps(batch, VOCAB):
        ms = do_bench(step, return_mode="median")
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(10):
            step()
        host_ms = (time.perf_counter() - start) / 10 * 1e3
        torch.cuda.synchronize()
        backend = kernels.backend()
        kernels.set_backend("reference")  # (only the sampler runs here: its torch path)
        try:
            torch_ms = do_bench(step, return_mode="median")
        finally:
            kernels.set_backend(backend)
        print(f"{'sampler ' + kind:<24}{'qwen2-0.5b':<14}{f'{batch}x{VOCAB}':<16}{ms * 1e3:>10.1f}"
              f"{'host ' + format(host_ms * 1e3, '.0f'):>9}{torch_ms * 1e3:>10.1f}{floor_ms * 1e3:>10.1f}"
              f"{floor_ms / ms:>6.0%}{torch_ms / ms:>14.2f}", flush=True)
        out[kind] = {"us": round(ms * 1e3, 1), "torch_us": round(torch_ms * 1e3, 1), "host_us": round(host_ms * 1e3, 1),
                     "floor_us": round(floor_ms * 1e3, 1)}
    return out


def time_case(c: Case, bw: float, graphed: bool) -> dict:
    """One case timed and printed: Triton's median and torch's (``do_bench``: each launch from Python, as an eager
    step makes it); ``graphed``: both again replayed from a CUDA graph (``do_bench_cudagraph``), the kernels' own
    time as decode and prompt graphs run them (a launcher slower than its kernel makes ``do_bench`` time the
    launcher). ``bw`` and ``torch/triton`` read the graphed times where both sides were captured; a side that
    cannot be captured keeps its eager time."""
    from triton.testing import do_bench, do_bench_cudagraph

    def replayed(fn) -> float | None:
        try:
            return do_bench_cudagraph(fn, rep=10, return_mode="median")
        except Exception as e:  # noqa: BLE001 - a case that cannot be captured is still timed, eagerly
            print(f"({c.kernel} {c.shape}: no CUDA graph, {type(e).__name__}: {e})")
            return None

    tri_ms = do_bench(c.triton, return_mode="median")
    torch_ms = do_bench(c.torch, return_mode="median")
    tri_graph = replayed(c.triton) if graphed else None
    torch_graph = replayed(c.torch) if tri_graph else None
    own_ms = tri_graph or tri_ms
    ratio = torch_graph / tri_graph if tri_graph and torch_graph else torch_ms / tri_ms
    floor_ms = c.nbytes / bw * 1e3
    print(f"{c.kernel:<24}{c.model:<14}{c.shape:<16}{tri_ms * 1e3:>10.1f}"
          f"{tri_graph * 1e3 if tri_graph else float('nan'):>9.1f}{torch_ms * 1e3:>10.1f}"
          f"{floor_ms * 1e3:>10.1f}{floor_ms / own_ms:>6.0%}{ratio:>14.2f}", flush=True)
    us = lambda ms: round(ms * 1e3, 2) if ms else None  # noqa: E731
    return dict(kernel=c.kernel, model=c.model, shape=c.shape, bytes=c.nbytes, triton_us=us(tri_ms),
                graphed_us=us(tri_graph), torch_us=us(torch_ms), torch_graphed_us=us(torch_graph),
                floor_us=us(floor_ms), bw_fraction=round(floor_ms / own_ms, 3), torch_over_triton=round(ratio, 3),
                baseline=c.baseline)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, default=256, help="decode batch (sequences)")
    p.add_argument("--contexts", default="512,2048,8192", help="decode context lengths, comma-separated")
    p.add_argument("--prefill", default="4x1024", help="prefill: prompts x tokens each")
    p.add_argument("--models", default=",".join(MODELS), help="comma-separated, of: " + ", ".join(MODELS))
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to time (bench_kernels times the Triton kernels on a GPU)")
        print(json.dumps({"device": "cpu", "nothing_to_time": True, "results": []}))
        return
    contexts = [int(c) for c in args.contexts.split(",")]
    prefill = tuple(int(x) for x in args.prefill.split("x"))
    bw = measure_bandwidth(torch.device("cuda"), 1 << 30)
    device = torch.cuda.get_device_name()
    print(f"{device}: copy bandwidth {bw / 1e9:.0f} GB/s; bf16, head_dim {HEAD_DIM}, KV blocks of {PAGE}")
    print(f"{'kernel':<24}{'model':<14}{'shape':<16}{'triton us':>10}{'graphed':>9}{'torch us':>10}{'floor us':>10}"
          f"{'bw':>6}{'torch/triton':>14}")
    dense = (c for model in args.models.split(",") for c in cases(model, args.batch, contexts, prefill))
    results = [time_case(c, bw, graphed=True) for c in dense]  # (each case made when timed)
    results += [time_case(c, bw, graphed=False) for c in moe_cases(args.batch, prefill[0] * prefill[1])]
    sampling = time_sampler(args.batch, bw)
    decode = [r["bw_fraction"] for r in results if r["kernel"] == "paged_decode_attention"
              and not r["shape"].startswith("launch:")]
    launches = [r for r in results if r["shape"].startswith("launch:")]
    best = max(launches, key=lambda r: r["torch_over_triton"], default=None)
    mixed = [r["torch_over_triton"] for r in results if r["shape"].startswith("mixed:")]
    fused = [r["torch_over_triton"] for r in results if r["kernel"] == "rope_and_store_"]
    print(json.dumps({"device": device, "dtype": "bfloat16", "copy_bandwidth_gb_s": round(bw / 1e9, 1),
                      "decode_batch": args.batch, "decode_min_bw_fraction": min(decode, default=None),
                      "mixed_split_over_one_launch": round(min(mixed), 2) if mixed else None,
                      "rope_store_apart_over_fused": round(min(fused), 2) if fused else None,
                      "decode_best_launch": None if best is None else
                      {"shape": best["shape"], "model": best["model"],
                       "default_over_it": round(best["torch_over_triton"], 2)},
                      "sampler_us": {kind: r["us"] for kind, r in sampling.items()}, "sampler": sampling,
                      "results": results}))


if __name__ == "__main__":
    main()
