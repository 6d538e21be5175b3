"""llama.cpp's samplers that vLLM has not, batched: DRY, XTC, locally typical sampling, top-n-sigma, dynamic
temperature and mirostat (versions 1 and 2), as llama.cpp's ``src/llama-sampling.cpp`` defines them.

So that the settings people tune in llama.cpp's server (and front ends that speak to it: SillyTavern, text
generation web UIs, Ollama's options) mean the same here. ``engine.sampler`` calls these on the rows that ask,
in tokenmill's order:

    penalties -> DRY -> grammar mask -> (greedy rows: argmax) -> temperature -> top-n-sigma -> top-k
    -> typical -> top-p -> min-p -> XTC -> dynamic temperature -> mirostat -> sample

llama.cpp scales by the temperature last, vLLM (and tokenmill) first; a row with a dynamic temperature
takes llama.cpp's place for it, since its temperature is read from the entropy of what the truncations
leave. Top-n-sigma does not care (scaling moves the top logit and the deviation alike). Mirostat takes the
place of top-k, top-p, min-p, typical, XTC and top-n-sigma (llama.cpp's chain with mirostat is the
temperature and mirostat alone); penalties, DRY, biases and grammars still apply.

Each sampler keeps at least one token, as llama.cpp's do (its ``min_keep`` is not read). Where llama.cpp
cuts a sorted list at a position, ties across the cut are kept here (XTC keeps every token as likely as
the least likely above the threshold). DRY's penalties are computed on the host from the token history
(``dry_penalties``): a request using it, or mirostat (whose target moves with each sampled token), makes
its steps wait for the one before (no asynchronous overlap), as penalties do. Torch and numpy.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

import numpy as np
import torch

FLOAT_MAX_LOG = 88.7228391  # log of float32's largest value: DRY's exponent is clamped below it, as in llama.cpp
DRY_MAX_PENALTY = 1e30  # and its penalty kept finite (a token it bans must stay above those a mask took out)
LINEAR_STEPS = 16  # DRY's repeats compared a token at a time this far (most end sooner), then bisected on hashes
# two primes below 2**31 (every product fits in int64), with bases drawn at start: a window built to collide
# would have to be built against this process's
_HASHES = tuple((p, random.SystemRandom().randrange(1 << 16, p - 1)) for p in (2147483647, 2147483629))
MIROSTAT_M = 100  # mirostat 1's estimate of the Zipf exponent reads the top 100 tokens (llama.cpp's m)

@dataclass
class Breakers:
    """DRY's sequence breakers of a request, built once from the wire's ``[head, tokens after it]`` lists."""

    single: np.ndarray  # the one-token breakers: never penalised
    heads: dict[int, np.ndarray]  # length (2 to 21) -> the heads of the breakers of that length ...
    longer: dict[int, np.ndarray]  # ... and the breakers, as rows (``_rows``)

    @classmethod
    def of(cls, sequences: list[list[int]] | None) -> Breakers:
        by_length: dict[int, list[list[int]]] = {}
        for seq in sequences or ():
            by_length.setdefault(len(seq), []).append(seq)
        single = np.unique(np.array([seq[0] for seq in by_length.pop(1, ())], np.int64))
        arrays = {k: np.array(v, np.int64) for k, v in by_length.items()}
        return cls(single, {k: np.unique(a[:, 0]) for k, a in arrays.items()},
                   {k: _rows(a) for k, a in arrays.items()})

    def limit(self, window: np.ndarray) -> int:
        """The tokens after the last breaker in ``window`` (the one nearest its end; of those that start there,
        the longest): what DRY's repeats are capped at. The window's length where none is in it. Each length
        of breaker is looked for at once (its heads' positions, then their spans as rows)."""
        n = len(window)
        pos, length = -1, 0
        hits = np.flatnonzero(np.isin(window, self.single))
        if len(hits):
            pos, length = int(hits[-1]), 1
        for k, rows in self.longer.items():
            starts = np.flatnonzero(np.isin(window[:n - k + 1], self.heads[k])) if n >= k else ()
            if len(starts):
                spans = window[starts[:, None] + np.arange(k)]
                hits = starts[np.isin(_rows(spans), rows)]
                if len(hits) and (hits[-1], k) > (pos, length):
                    pos, length = int(hits[-1]), k
        return n if pos < 0 else n - pos - length


def _rows(a: np.ndarray) -> np.ndarray:
    """The rows of an int64 (m, k) array as m opaque values of 8k bytes: ``np.isin`` then compares whole rows."""
    a = np.ascontiguousarray(a, np.int64)
    return a.view(np.dtype((np.void, 8 * a.shape[1]))).ravel()


def dry_penalties(window: np.ndarray, breakers: Breakers, multiplier: float, base: float,
                  allowed_length: int) -> tuple[np.ndarray, np.ndarray]:
    """DRY (llama.cpp's ``llama_sampler_dry_apply``): the (tokens, penalties) to subtract from a row's logits.

    ``window``: the context's last ``dry_penalty_last_n`` tokens (int64). A token that would extend a
    sequence of at least ``allowed_length`` tokens ending the window, seen earlier in it, loses
    ``multiplier * base ** (length - allowed_length)`` (the longest such sequence counts; the exponent is
    clamped where the power would overflow float32, the penalty at ``DRY_MAX_PENALTY``). The last sequence
    breaker in the window (a head and its tokens after it) caps the lengths at the tokens after it; a token
    that is a breaker by itself is never penalised. The lengths: ``repeat_lengths``.
    """
    none = np.empty(0, np.int64), np.empty(0)
    n = len(window)
    if n <= allowed_length:
        return none
    rep_limit = breakers.limit(window)
    if rep_limit < allowed_length:
        return none
    length = repeat_lengths(window, rep_limit)
    ends = np.flatnonzero(length >= allowed_length)
    if not len(ends):
        return none
    tokens, where = np.unique(window[ends + 1], return_inverse=True)  # the token after each repeat extends it
    longest = np.zeros(len(tokens), np.int64)
    np.maximum.at(longest, where, length[ends])
    keep = ~np.isin(tokens, breakers.single)
    exponent = longest[keep] - allowed_length
    if base > 1.000001:
        exponent = np.minimum(exponent, int(FLOAT_MAX_LOG / math.log(base)))
    penalty = multiplier * np.power(float(base), exponent.astype(np.float64))
    return tokens[keep], np.minimum(penalty, DRY_MAX_PENALTY)


def repeat_lengths(window: np.ndarray, limit: int) -> np.ndarray:
    """``length[i]`` for each position ``i < n - 1`` of the window: the longest suffix of the window that also ends
    at ``i``, at most ``limit`` (what llama.cpp's Z-algorithm finds). The candidates are compared a token at a
    time for ``LINEAR_STEPS`` tokens, dropping out as they stop matching; those still matching then (a
    repeated passage, a loop) are bisected on prefix hashes, so a window of n tokens costs O(n log n) at worst."""
    n = len(window)
    length = np.zeros(n - 1, np.int64)
    alive = np.arange(n - 1)
    steps = min(limit, n - 1)
    for k in range(min(steps, LINEAR_STEPS)):
        alive = alive[alive >= k]
        alive = alive[window[alive - k] == window[n - 1 - k]]
        if not len(alive):
            return length
        length[alive] += 1
    if steps > LINEAR_STEPS:
        length[alive] = _bisect(window, alive, length[alive], np.minimum(alive + 1, limit))
    return length


def _powers(base: int, p: int, n: int, _kept: dict = {}) -> np.ndarray:  # noqa: B006 (the cache, grown)
    """``base ** j % p`` for ``j < n``, int64."""
    have = _kept.get((base, p), np.ones(1, np.int64))
    while len(have) < n:
        have = np.concatenate((have, have * pow(base, len(have), p) % p))
    _kept[(base, p)] = have
    return have[:n]


def _bisect(window: np.ndarray, ends: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    """For each end position, the longest ``L`` in [``lo``, ``hi``] with ``window[end - L + 1:end + 1]`` equal to
    the window's last ``L`` tokens (``lo`` known to match), by comparing polynomial hashes modulo two primes."""
    n = len(window)
    tables = []
    for p, b in _HASHES:  # prefix[x]: sum of (token + 1) * b**-j over j < x; a span's hash, that times b**start
        prefix = np.concatenate(([0], np.cumsum((window + 1) * _powers(pow(b, p - 2, p), p, n) % p) % p))
        tables.append((p, prefix, _powers(b, p, n + 1)))

    def same(length: np.ndarray) -> np.ndarray:
        start, tail = ends - length + 1, n - length
        out = np.ones(len(ends), bool)
        for p, prefix, power in tables:
            out &= (prefix[ends + 1] - prefix[start]) % p * power[start] % p == \
                (prefix[n] - prefix[tail]) % p * power[tail] % p
        return out

    while (open_ := lo < hi).any():
        mid = np.where(open_, (lo + hi + 1) // 2, lo)
        ok = same(mid)
        lo, hi = np.where(ok, mid, lo), np.where(ok, hi, mid - 1)
    return lo


def _entropy(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each row's log-probabilities, probabilities and (rows,) entropy (a masked token adds nothing)."""
    logp = logits.log_softmax(dim=-1)
    probs = logp.exp()
    return logp, probs, -(probs * torch.where(probs > 0, logp, 0.0)).sum(dim=-1)


def apply_top_n_sigma(logits: torch.Tensor, n: torch.Tensor) -> torch.Tensor:
    """Top-n-sigma: mask the logits below the row's top one less ``n`` standard deviations of its logits
    (the finite ones, as a population). (rows,) ``n``, every one positive."""
    finite = torch.isfinite(logits)
    count = finite.sum(dim=-1, keepdim=True).clamp_min(1)
    values = torch.where(finite, logits, 0.0)
    mean = values.sum(dim=-1, keepdim=True) / count
    std = (torch.where(finite, logits - mean, 0.0).square().sum(dim=-1, keepdim=True) / count).sqrt()
    top = logits.amax(dim=-1, keepdim=True)
    return logits.masked_fill(logits < top - n.unsqueeze(1) * std, -math.inf)


def apply_typical(logits: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """Locally typical sampling: the tokens whose surprise is nearest the distribution's entropy, in that
    order, until their mass passes ``p`` (the token that passes it kept). (rows,) ``p``, each below 1."""
    logp, probs, entropy = _entropy(logits)
    shifted = (-logp - entropy.unsqueeze(1)).abs()  # inf for a masked token: last
    order = shifted.argsort(dim=-1, stable=True)
    sorted_probs = probs.gather(1, order)
    drop = (sorted_probs.cumsum(dim=-1) - sorted_probs) > p.unsqueeze(1)  # the mass before it already passed p
    drop[:, 0] = False
    return logits.masked_fill(torch.zeros_like(drop).scatter_(1, order, drop), -math.inf)


def apply_xtc(logits: torch.Tensor, threshold: torch.Tensor, fire: torch.Tensor) -> torch.Tensor:
    """XTC ("exclude top choices"), on the rows whose draw came up (``fire``): where at least two tokens are
    at least ``threshold`` likely, every one of them but the least likely goes. (rows,) each."""
    probs = logits.softmax(dim=-1)
    above = (probs >= threshold.unsqueeze(1)) & (probs > 0)  # (a threshold of 0: not the tokens already out)
    least = torch.where(above, probs, 2.0).amin(dim=-1, keepdim=True)
    fire = fire.unsqueeze(1) & (above.sum(dim=-1, keepdim=True) >= 2)
    return logits.masked_fill(fire & above & (probs > least), -math.inf)


def apply_dynamic_temperature(logits: torch.Tensor, temperature: torch.Tensor, spread: torch.Tensor,
                              exponent: torch.Tensor) -> torch.Tensor:
    """Dynamic temperature (llama.cpp's ``temp-ext``): ``temperature`` +- ``spread``, placed by the candidates'
    entropy over its largest possible value (the log of their count) raised to ``exponent``; at a temperature
    of 0 only the most likely token stays. A row with one candidate is left as it is. (rows,) each."""
    count = torch.isfinite(logits).sum(dim=-1)
    entropy = _entropy(logits)[2]
    normalized = entropy / count.clamp_min(2).log()
    low = (temperature - spread).clamp_min(0.0)
    t = low + (temperature + spread - low) * normalized.pow(exponent)
    t = torch.where(count > 1, t, 1.0).unsqueeze(1)
    top = logits == logits.amax(dim=-1, keepdim=True)
    return torch.where(t > 0, logits / t.clamp_min(1e-30), logits.masked_fill(~top, -math.inf))


def apply_mirostat(logits: torch.Tensor, mu: torch.Tensor, version: int, vocab: int) -> torch.Tensor:
    """Mirostat's truncation, each row by its ``mu`` (its surprise target moved by what it sampled, in bits).
    Version 2: the tokens more surprising than mu go (the most likely one stays). Version 1: the top k stay,
    k from mu and the Zipf exponent estimated on the top 100 probabilities (over the whole ``vocab``), as
    llama.cpp computes it (a k it cannot compute is the whole vocabulary)."""
    probs = logits.softmax(dim=-1)
    if version == 2:
        drop = (-torch.log2(probs) > mu.unsqueeze(1)) & (probs < probs.amax(dim=-1, keepdim=True))
        return logits.masked_fill(drop, -math.inf)
    top = probs.topk(min(MIROSTAT_M, logits.shape[1]), dim=-1).values  # (rows, m), descending
    i = torch.arange(1, top.shape[1], device=logits.device, dtype=probs.dtype)
    t = torch.log((i + 1) / i)  # llama.cpp's log((i + 2) / (i + 1)), i from 0
    b = torch.log(top[:, :-1] / top[:, 1:])
    valid = torch.isfinite(b)  # (a masked token's 0: llama.cpp's list would not hold it)
    s_hat = torch.where(valid, t * b, 0.0).sum(dim=-1) / torch.where(valid, t * t, 0.0).sum(dim=-1).clamp_min(1e-30)
    eps = s_hat - 1
    k = ((eps * torch.pow(2.0, mu)) / (1 - torch.pow(float(vocab), -eps))).pow(1 / s_hat)
    k = torch.nan_to_num(k, nan=vocab, posinf=vocab).clamp(1, logits.shape[1]).long()
    kth = probs.sort(dim=-1, descending=True).values.gather(1, (k - 1).unsqueeze(1))
    return logits.masked_fill(probs < kth, -math.inf)


def mirostat_mu(logits: torch.Tensor, ids: torch.Tensor, mu: torch.Tensor, tau: torch.Tensor,
                eta: torch.Tensor) -> torch.Tensor:
    """Each row's next mu: moved by ``eta`` towards ``tau`` by the surprise (bits) of the token it sampled,
    ``ids``, under the distribution it was sampled from (``logits``, truncated)."""
    surprise = -logits.log_softmax(dim=-1).gather(1, ids.unsqueeze(1)).squeeze(1) / math.log(2)
    return mu - eta * (surprise - tau)
