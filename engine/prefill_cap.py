"""How many prompt tokens one request may add to a step that carries decodes (stall-free batching).

A step that carries running streams' decodes must not cost much more than a
decode-only step, or every stream stalls while a long prompt prefills
(Sarathi-Serve). The cap lets one request's chunk make such a step cost about
``ratio`` (2) times a decode-only step of the batch the scheduler is filling,
from step costs measured online on this device (the scheduler applies it per
request: several prompts joining at once each bring their own, so that a queue
joins as fast as seats free up). Every step's time is fitted as

    seconds = a + b * decode rows + c * prompt tokens

by least squares over recent steps (exponentially forgotten, every coefficient
kept >= 0, a step far slower than predicted clipped). ``a`` is what any step costs (dispatch, weight reads, the sampler);
on a CPU it is most of a small step, so leaving it out would make a prompt
token look many times dearer than it is. Then, for ``rows`` decodes:

    decode step = a + max(b, c) * rows
    cap         = (ratio - 1) * decode step / c

``rows`` is the batch once the waiting requests have joined (the running ones
plus the waiting ones, at most ``max_num_seqs``), not the decodes already
running. Measured against the running decodes alone, the cap would shrink as
they finish, prompts would join slower still and the batch would drain to a
trickle. The floor ``(ratio - 1) * rows`` holds whatever the fit says (a prompt
token costs no more than a decode row's token), and until the fit gives prompt
tokens a cost of their own. ``fixed`` (the
``--long-prefill-token-threshold`` flag) replaces all of it. Torch-free.
"""

from __future__ import annotations

import math
from itertools import combinations

_KNOWN = 1e-3  # the prompt-step weight below which c counts as unknown (~340 steps after the last one)
OUTLIER = 4.0  # a step counts as at most this many times the fit's prediction
# the fit that clips outliers is made anew for a step it is OUTLIER times off for, at most every REFIT steps, and at
# least every STALE steps (a fit is 10 to 50 us of Python: a decode-only step need not pay for one)
REFIT, STALE = 8, 64
_MODELS = [keep for k in (3, 2, 1) for keep in combinations(range(3), k)]  # which of (a, b, c) are free


class PrefillCap:
    def __init__(self, maximum: int, fixed: int | None = None, minimum: int = 32,
                 ratio: float = 2.0, decay: float = 0.98) -> None:
        self.maximum = maximum
        self.fixed = fixed
        self.minimum = min(minimum, maximum)
        self.ratio = ratio
        self.decay = decay
        self._xx = [[0.0] * 3 for _ in range(3)]  # weighted sums of x x^T, x = (1, rows, prompt tokens)
        self._xt = [0.0] * 3  # ... of x * seconds
        self._tt = 0.0  # ... of seconds^2
        self._prompt_weight = 0.0  # ... of steps that carried prompt tokens (c is known only from them)
        self._steps = 0
        self._fit: tuple[float, float, float] | None = None
        self._clip: tuple[float, float, float] | None = None  # the fit outliers are clipped by, and when it was made
        self._clip_step = 0

    def value(self, rows: int) -> int:
        """One request's cap in a step whose batch, once the waiting requests join, holds ``rows`` decodes."""
        if self.fixed is not None:
            return self.fixed
        floor = max(self.minimum, int((self.ratio - 1.0) * rows))
        cap = float(floor)  # also while prompt tokens show no cost of their own: nothing says more is safe
        if self._prompt_weight > _KNOWN:
            a, b, c = self.fit()
            if c > 0:
                cap = (self.ratio - 1.0) * (a + max(b, c) * rows) / c
        return round(min(self.maximum, max(floor, cap)))

    def observe(self, num_decodes: int, num_prompt_tokens: int, seconds: float) -> None:
        """One step's make-up (decode rows, prompt tokens) and how long it took. A step far slower than
        the fit predicts (a pause, a first call compiling something) counts as ``OUTLIER`` times the
        prediction (of a fit up to ``REFIT`` steps old: one older, up to ``STALE``, is made anew for a step it
        is off for by that factor either way), so that one such step cannot swing the cap for the next fifty."""
        self._steps += 1
        if self._steps == 1 or not math.isfinite(seconds) or seconds < 0:
            return  # the first step pays one-time costs (allocations, kernels built on first use)
        x = (1.0, float(num_decodes), float(num_prompt_tokens))
        if self._prompt_weight > _KNOWN:
            age = self._steps - self._clip_step
            stale = self._clip is None or age >= STALE
            if not stale and age >= REFIT:  # off by OUTLIER either way (one made after a few prompt steps may
                was = _predict(self._clip, x)  # predict decodes far too slow)
                stale = not was / OUTLIER <= seconds <= OUTLIER * was
            if stale:
                self._clip, self._clip_step = self.fit(), self._steps
            predicted = _predict(self._clip, x)
            if predicted > 0:
                seconds = min(seconds, OUTLIER * predicted)
        d = self.decay
        for i in range(3):
            self._xt[i] = d * self._xt[i] + x[i] * seconds
            for j in range(3):
                self._xx[i][j] = d * self._xx[i][j] + x[i] * x[j]
        self._tt = d * self._tt + seconds * seconds
        self._prompt_weight = d * self._prompt_weight + (1.0 if num_prompt_tokens else 0.0)
        self._fit = None

    def fit(self) -> tuple[float, float, float]:
        """(a, b, c): the least-squares fit with every coefficient >= 0 (all three solved exactly, or where that
        is not feasible each subset, the feasible one with the least residual kept)."""
        if self._fit is None:
            best, best_rss = (0.0, 0.0, 0.0), self._tt
            for keep in _MODELS:
                beta = _solve([[self._xx[i][j] for j in keep] for i in keep], [self._xt[i] for i in keep])
                if beta is None or min(beta) < 0:
                    continue
                # t't - 2 b'X't + b'X'X b, where b solves X'X b = X't: t't - b'X't
                rss = self._tt - sum(v * self._xt[i] for i, v in zip(keep, beta, strict=True))
                if rss < best_rss - 1e-12 * max(self._tt, 1e-30):
                    full = [0.0] * 3
                    for i, v in zip(keep, beta, strict=True):
                        full[i] = v
                    best, best_rss = (full[0], full[1], full[2]), rss
                if len(keep) == 3:  # the least squares of all three feasible: no subset's residual is less
                    break
            self._fit = best
        return self._fit


def _predict(fit: tuple[float, float, float], x: tuple[float, float, float]) -> float:
    return fit[0] * x[0] + fit[1] * x[1] + fit[2] * x[2]


def _solve(m: list[list[float]], v: list[float]) -> list[float] | None:
    """``m x = v`` by Gaussian elimination with partial pivoting; None if ``m`` is (nearly) singular."""
    n = len(v)
    a = [row[:] + [v[i]] for i, row in enumerate(m)]
    scale = max(abs(a[i][i]) for i in range(n)) or 1.0
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(a[r][col]))
        if abs(a[pivot][col]) <= 1e-9 * scale:
            return None
        a[col], a[pivot] = a[pivot], a[col]
        for r in range(col + 1, n):
            f = a[r][col] / a[col][col]
            for k in range(col, n + 1):
                a[r][k] -= f * a[col][k]
    x = [0.0] * n
    for i in reversed(range(n)):
        x[i] = (a[i][n] - sum(a[i][k] * x[k] for k in range(i + 1, n))) / a[i][i]
    return x
