"""Speculative decoding by n-gram lookup (vLLM's ``--speculative-config '{"method": "ngram", ...}'``;
prompt lookup decoding).

A decoding request often says again what its context holds (code being edited, a document being
quoted, a list's keys): when its last n tokens occurred earlier in its prompt or output, the tokens
that followed them there are a good guess at what comes next. At each decode the scheduler asks
``NgramProposer.propose`` for up to k such *draft* tokens and schedules them with the decode token:
one forward computes k + 1 positions, which on a device bound by reading the weights costs little
more than one.

The runner samples each of those positions as that token would be sampled alone: the same params,
the drafts before it as its history (penalties), its seeded noise keyed by its own index. The engine
keeps the sampled tokens up to and including the first that differs from its draft (``accepted``),
and the rejected drafts' K/V, past the request's computed tokens, are overwritten by later steps. So
greedy output and seeded sampling are those of decoding without drafts, token for token, and
unseeded sampling draws from the same distribution (a draft is one token for certain: keeping it
when the sample equals it is rejection sampling's rule for such a draft).

Not for a request with structured output (the grammar's mask at a draft's position depends on the
drafts before it) or mirostat (its target moves with each token kept), nor under asynchronous
scheduling (the next step's input is known only once this step's tokens are compared with its
drafts). Torch-free.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from engine.request import Request

METHODS = ("ngram",)


@dataclass(frozen=True)
class NgramConfig:
    num_speculative_tokens: int  # k: drafts per step, at most
    prompt_lookup_min: int  # the shortest suffix looked up
    prompt_lookup_max: int  # the longest (the longest that occurs earlier wins)
    disable_by_batch_size: int | None = None  # no drafts in a step with more requests running than this

    @classmethod
    def of(cls, spec: dict) -> NgramConfig:
        """vLLM's speculative config map, checked: ``method`` "ngram", ``num_speculative_tokens``,
        ``prompt_lookup_min`` / ``prompt_lookup_max`` (one given: both that; none: both 5, as in vLLM), and
        ``disable_by_batch_size`` (where the device is busy enough without them, drafts cost more than they
        save: the batch's decodes already keep it computing)."""
        if not isinstance(spec, dict):
            raise ValueError(f"speculative_config must be a JSON object, got {spec!r}")
        method = spec.get("method", spec.get("model"))
        if method not in METHODS:
            raise ValueError(f"speculative_config: method must be one of {', '.join(METHODS)} (draft models, EAGLE "
                             f"and MTP heads are not served here), got {method!r}")
        known = {"method", "model", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max",
                 "disable_by_batch_size"}
        if set(spec) - known:
            raise ValueError(f"speculative_config: unknown keys {sorted(set(spec) - known)} for the ngram method "
                             f"(known: {', '.join(sorted(known))})")

        def count(key: str, value: object, most: int) -> int:
            if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= most:
                raise ValueError(f"speculative_config: {key} must be an integer in [1, {most}], got {value!r}")
            return value

        if "num_speculative_tokens" not in spec:
            raise ValueError("speculative_config: num_speculative_tokens is required (e.g. 4)")
        k = count("num_speculative_tokens", spec["num_speculative_tokens"], 32)
        lo, hi = spec.get("prompt_lookup_min"), spec.get("prompt_lookup_max")
        lo = count("prompt_lookup_min", lo, 64) if lo is not None else None
        hi = count("prompt_lookup_max", hi, 64) if hi is not None else None
        lo, hi = lo or hi or 5, hi or lo or 5
        if lo > hi:
            raise ValueError(f"speculative_config: prompt_lookup_min {lo} is above prompt_lookup_max {hi}")
        busy = spec.get("disable_by_batch_size")
        return cls(k, lo, hi, count("disable_by_batch_size", busy, 1 << 20) if busy is not None else None)


class NgramProposer:
    """Drafts for a decoding request from its own context. Each request's tokens are copied once into
    a growing array (``Request.draft_history``); a lookup is a few vectorized compares over it."""

    def __init__(self, config: NgramConfig, max_model_len: int):
        self.config = config
        self.max_model_len = max_model_len
        self.disable_by_batch_size = config.disable_by_batch_size

    def propose(self, req: Request, budget: int) -> list[int]:
        """Up to k drafts for ``req``'s next decode, at most ``budget``, none that ``max_tokens`` or the
        model's length would leave unused; [] for a request that may not have any."""
        k = min(self.config.num_speculative_tokens, budget, req.params.max_tokens - req.num_sampled - 1,
                self.max_model_len - req.num_tokens - 1)
        state = req.sampling_state
        if k <= 0 or req.num_in_flight or getattr(state, "grammar", None) is not None \
                or getattr(state, "mu", None) is not None:
            return []
        return find_draft(_history(req), self.config.prompt_lookup_min, self.config.prompt_lookup_max, k)


def _history(req: Request) -> np.ndarray:
    """``req``'s tokens as an int64 array, grown in place by what was appended since the last call."""
    tokens, buf = req.all_token_ids, req.draft_history
    n = len(tokens)
    if buf is None or len(buf[0]) < n:
        grown = np.empty(max(2 * n, 256), dtype=np.int64)
        done = 0 if buf is None else buf[1]
        if done:
            grown[:done] = buf[0][:done]
        buf = req.draft_history = [grown, done]
    if buf[1] < n:
        buf[0][buf[1]:n] = tokens[buf[1]:n]
        buf[1] = n
    return buf[0][:n]


def find_draft(tokens: np.ndarray, n_min: int, n_max: int, k: int) -> list[int]:
    """The up to ``k`` tokens that followed an earlier occurrence of the longest suffix of ``tokens`` of
    ``n_min``..``n_max`` tokens that occurs earlier: after its latest occurrence that ``k`` tokens
    follow, else after its earliest (the most tokens follow it); [] when no such suffix occurs."""
    size = len(tokens)
    if size < n_min + 1:
        return []
    ends = np.flatnonzero(tokens[:size - 1] == tokens[size - 1])  # where a match of the last j tokens ends
    best, j = None, 1
    while len(ends):
        if j >= n_min:
            best = ends
        if j == n_max:
            break
        ends = ends[ends >= j]
        ends = ends[tokens[ends - j] == tokens[size - 1 - j]]
        j += 1
    if best is None:
        return []
    full = best[best + k < size]
    end = int(full[-1] if len(full) else best[0])
    return tokens[end + 1:end + 1 + k].tolist()
