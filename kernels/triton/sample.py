"""Sampling by the exponential race over what top-k, top-p and min-p keep, without sorting the
vocabulary (the twin of ``kernels.reference.sample_race``).

The race picks ``argmax(p_i / E_i)`` with one Exp(1) draw ``E_i`` a token (``reference.exponentials``,
a hash of the row's keys and the token id, computed here as it is read). The tokens the three keep are
an upper set of the distribution (a token kept, every one at least as likely is), and with the same
draws the race gives the same winner as masking first: the race over a larger upper set either lands
in the kept set, and then it is that set's winner too, or on a token that is not kept, and then no
token as likely or less is, so the race runs again over those likelier. Top-k and min-p are floors on
a token's logit (the k-th largest, found by ``topk`` before the launch; the largest plus
``log(min_p)``), so only the tokens above both race; top-p's cut is the one a race can miss.

One program a row: a pass for the row's largest logit (and one for its mass where top-p truncates),
then a pass for the race and one for the mass above its winner, once in most rows (the winner is kept
with at least probability ``top_p``), at most ``ROUNDS`` times; past that, the likeliest token (a row's
misses count the records of a random order, about ln(candidates / kept) of them: 64 lies far in their
tail). Three or four reads of a row where the sort-based path sorts it and makes a dozen passes.

A token is kept by top-k when its logit is at least the k-th largest (ties kept); by top-p when the
mass strictly above it is below ``top_p`` of what top-k keeps, so the cut never splits tokens tied in
probability (as ``engine.sampler.apply_top_k_top_p``'s); by min-p when its logit is at least the
largest plus ``log(min_p)``. Divisions are rounded as torch's; the exponential is Triton's (a few ulps
on CUDA): scores a rounding apart may pick another of two near-tied tokens.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.triton.launch import check_tensor, require

BLOCK = 1024  # tokens a loop step
ROUNDS = 64  # races at most a row (misses run about ln(candidates / kept) times: ~12 at 151936 tokens)


@triton.jit
def _mix32(x):
    # hash-prospector's [16 21f0aaad 15 735a2d97 15] on uint32 lanes (reference._mix32_'s, which masks int64)
    x ^= x >> 16
    x *= 0x21F0AAAD
    x ^= x >> 15
    x *= 0x735A2D97
    x ^= x >> 15
    return x


@triton.jit
def _scaled(base, cols, V, t):
    # (rounded as torch divides: a compiled ``/`` is an approximate division)
    return tl.math.div_rn(tl.load(base + cols, mask=cols < V, other=float("-inf")).to(tl.float32), t)


@triton.jit
def _sample_race_kernel(logits_ptr, stride, temp_ptr, k_floor_ptr, top_p_ptr, min_p_ptr, keys_ptr, out_ptr, V,
                        BLOCK: tl.constexpr, ROUNDS: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    base = logits_ptr + row * stride
    t = tl.load(temp_ptr + row)
    k_floor = tl.load(k_floor_ptr + row)  # top-k's: the k-th largest scaled logit (-inf: no top-k)
    top_p = tl.load(top_p_ptr + row)
    min_p = tl.load(min_p_ptr + row)
    k0 = tl.load(keys_ptr + 2 * row).to(tl.uint32)
    k1 = tl.load(keys_ptr + 2 * row + 1).to(tl.uint32)
    lanes = tl.arange(0, BLOCK)
    # the row's largest scaled logit and its token: the scores are taken from it (exp(x - m), as a softmax's),
    # and min-p measures against it
    mv = tl.full([BLOCK], float("-inf"), tl.float32)
    iv = tl.zeros([BLOCK], tl.int32)
    for start in range(0, V, BLOCK):
        x = _scaled(base, start + lanes, V, t)
        iv = tl.where(x > mv, start + lanes, iv)
        mv = tl.maximum(mv, x)
    m = tl.max(mv)
    top = tl.min(tl.where(mv == m, iv, V))
    z = tl.full([], 0.0, tl.float32)  # the mass top-k keeps (of exp(x - m)), where top-p measures against it
    if top_p < 1.0:
        zv = tl.zeros([BLOCK], tl.float32)
        for start in range(0, V, BLOCK):
            x = _scaled(base, start + lanes, V, t)
            zv += tl.where(x >= k_floor, tl.exp(x - m), 0.0)
        z = tl.sum(zv)
    # no token below top-k's floor or min-p's is kept: none races (min_p 0: every token)
    floor = tl.maximum(k_floor, tl.where(min_p > 0.0, m + tl.log(tl.maximum(min_p, 1e-30)), float("-inf")))
    pivot = tl.full([], float("-inf"), tl.float32)  # the race runs over the tokens above it
    best = top
    done = tl.full([], 0, tl.int32)
    for _ in range(ROUNDS):
        if done == 0:
            sv = tl.full([BLOCK], -1.0, tl.float32)
            iv = tl.zeros([BLOCK], tl.int32)
            for start in range(0, V, BLOCK):
                cols = start + lanes
                x = _scaled(base, cols, V, t)
                u = ((_mix32(_mix32(cols.to(tl.uint32) ^ k0) ^ k1) >> 9).to(tl.float32) + 0.5) * 1.1920928955078125e-07
                racing = (x > pivot) & (x >= floor)
                s = tl.where(racing, tl.math.div_rn(tl.exp(x - m), -tl.log(u)), -1.0)  # p / E, but the 1 / Z
                iv = tl.where(s > sv, cols, iv)
                sv = tl.maximum(sv, s)
            won = tl.max(sv)
            best = tl.min(tl.where(sv == won, iv, V))
            best_x = tl.math.div_rn(tl.load(base + best).to(tl.float32), t)
            kept = best_x >= floor
            if top_p < 1.0:  # (the tokens above a kept one: top-k keeps them all)
                av = tl.zeros([BLOCK], tl.float32)
                for start in range(0, V, BLOCK):
                    x = _scaled(base, start + lanes, V, t)
                    av += tl.where(x > best_x, tl.exp(x - m), 0.0)
                kept = kept & (tl.sum(av) < top_p * z)
            done = kept.to(tl.int32)
            pivot = best_x
    best = tl.where(done != 0, best, top)
    tl.store(out_ptr + row, best.to(tl.int64))


def sample_race(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                min_p: torch.Tensor, keys: torch.Tensor, max_k: int | None = None) -> torch.Tensor:
    """``reference.sample_race``. ``max_k``: the largest of ``top_k`` where the caller knows it without asking the
    device (0: no row has a top-k); None: every row's k-th largest logit is looked for among all of them."""
    check_tensor("logits", logits, 2)
    n, vocab = logits.shape
    require(logits.stride(1) == 1, "logits must be contiguous in their last dimension")
    for name, t in (("temperature", temperature), ("top_p", top_p), ("min_p", min_p)):
        check_tensor(name, t, 1, (torch.float32,))
        require(t.shape[0] == n and t.is_contiguous(), f"{name} must be ({n},) and contiguous")
    require(top_k.dtype == torch.int64 and tuple(top_k.shape) == (n,) and top_k.device == logits.device,
            f"top_k must be ({n},) int64, on the logits' device")
    require(keys.dtype == torch.int64 and tuple(keys.shape) == (n, 2) and keys.is_contiguous(),
            f"keys must be ({n}, 2) int64 and contiguous")
    require(vocab < 2 ** 31, "the vocabulary must have fewer than 2**31 tokens")
    k_floor = torch.full((n,), float("-inf"), dtype=torch.float32, device=logits.device)
    max_k = vocab if max_k is None else min(max_k, vocab)
    if max_k > 0 and n:  # each row's k-th largest logit, scaled as the kernel scales it (ties at it are kept)
        top = logits.topk(max_k, dim=-1).values
        kth = top.gather(1, (top_k.clamp(1, top.shape[1]) - 1).unsqueeze(1)).squeeze(1).float() / temperature
        k_floor = torch.where(top_k > 0, kth, k_floor)
    out = torch.empty(n, dtype=torch.int64, device=logits.device)
    if n:
        _sample_race_kernel[(n,)](logits, logits.stride(0), temperature, k_floor, top_p, min_p, keys, out, vocab,
                                  BLOCK=BLOCK, ROUNDS=ROUNDS)
    return out
