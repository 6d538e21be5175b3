"""Beam search: transformers' ``generate(num_beams=k)`` rules over the engine's top logprobs.

The engine samples one token per request; beam search is a loop around it, as vLLM runs it: each round
asks for one token of every live beam with its top logprobs (a request of ``max_tokens=1`` whose prompt
is the beam's tokens: the prefix cache holds what the beams share, so a round computes little more than
the block each beam ends in), and ``BeamSearch.advance`` keeps the best continuations. ``LLM.beam_search``
and the HTTP frontends' ``use_beam_search`` run it. Torch-free.

The rules are transformers' (``GenerationMixin._beam_search``), so that its output is the reference:
each round takes the best ``max(2, 1 + E) * k`` continuations over all live beams by summed logprob (E:
the ids that end a sequence); those that end it (an end id, a stop string, or ``max_tokens``) and rank
among the best k finish, scored ``sum / generated ** length_penalty``, and the k best finished are kept;
the k best of the others live on. ``early_stopping``: True ends the search once k have finished; False
(transformers' default) once the best live beam, scored at its current length, cannot beat the worst
kept; "never" scores it at ``max_tokens`` instead where the penalty favours length. The logprobs are the
model's own (``log_softmax`` of its logits: no temperature, penalties or bias).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

from engine.protocol import MAX_LOGPROBS

MAX_BEAM_WIDTH = 10  # vLLM's in effect (its rounds ask for 2k logprobs, at most 20)


@dataclass
class BeamSearchParams:
    """vLLM's ``BeamSearchParams`` (``temperature`` is read by nothing, there as here: beams are ranked by the
    model's own logprobs), and transformers' ``early_stopping``."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False
    early_stopping: bool | str = False
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)

    def check(self, num_end_ids: int = 1) -> None:
        """A ``ValueError`` naming the field that is out of range (``num_end_ids``: the ids that end a beam;
        each round asks for ``max(2, 1 + num_end_ids) * beam_width`` logprobs per beam, at most
        ``MAX_LOGPROBS``)."""
        if isinstance(self.beam_width, bool) or not isinstance(self.beam_width, int) or \
                not 1 <= self.beam_width <= MAX_BEAM_WIDTH:
            raise ValueError(f"beam_width must be in [1, {MAX_BEAM_WIDTH}], got {self.beam_width!r}")
        if max(2, 1 + num_end_ids) * self.beam_width > MAX_LOGPROBS:
            raise ValueError(f"beam_width must be at most {MAX_LOGPROBS // (1 + num_end_ids)} with {num_end_ids} "
                             f"ids that end a sequence (EOS and stop_token_ids), got {self.beam_width}")
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens!r}")
        if self.early_stopping not in (True, False, "never"):
            raise ValueError(f"early_stopping must be true, false or \"never\", got {self.early_stopping!r}")
        lp = self.length_penalty
        if isinstance(lp, bool) or not isinstance(lp, int | float) or not -1e3 <= lp <= 1e3:
            raise ValueError(f"length_penalty must be a number in [-1000, 1000], got {lp!r}")


@dataclass
class BeamSequence:
    """One beam: its generated tokens (the one that ended it included), each one's ``[logprob, top]`` as the
    engine gave it, their sum, and, once it has ended, how and its score."""

    tokens: list[int]
    logprobs: list = field(default_factory=list)
    cum_logprob: float = 0.0
    finish_reason: str | None = None  # "stop" (an end id or a stop string), "length", or the engine's
    stop_reason: int | str | None = None  # the end id or stop string
    score: float = 0.0


class BeamSearch:
    """One prompt's search. Each round: ``live`` (the beams to extend), then ``advance`` with each one's top
    logprobs, until ``done``; ``best()`` then. ``stop_at(tokens)``: the stop string that generated tokens
    ``tokens`` complete (None: none), for stop strings."""

    def __init__(self, params: BeamSearchParams, end_ids: frozenset[int],
                 stop_at: Callable[[list[int]], str | None] | None = None) -> None:
        self.k = params.beam_width
        self.max_tokens = params.max_tokens
        self.length_penalty = params.length_penalty
        self.early_stopping = params.early_stopping
        self.end_ids = end_ids
        self.stop_at = stop_at
        # transformers keeps (1 + E) k continuations, so that k live on though the best k all end
        self.num_logprobs = max(2, 1 + len(end_ids)) * self.k  # (check: at most MAX_LOGPROBS)
        self.live = [BeamSequence([])]
        self.finished: list[BeamSequence] = []  # the k best, best first
        self.generated = 0
        self.done = False
        self._improvable = True  # transformers' is_early_stop_heuristic_unsatisfied

    def score(self, cum_logprob: float, length: int) -> float:
        """``cum_logprob / length ** length_penalty``, saturating as float arithmetic does (a huge penalty makes
        every length's score 0 or -inf, not an error)."""
        try:
            d = math.pow(length, self.length_penalty)
        except OverflowError:
            return cum_logprob * 0.0
        return cum_logprob / d if d else (-math.inf if cum_logprob < 0 else 0.0)

    def advance(self, tops: list[list]) -> None:
        """``tops[i]``: live beam i's next-token ``[(token_id, logprob), ...]``, best first (at least
        ``num_logprobs`` of them where the vocabulary has as many)."""
        g = self.generated = self.generated + 1
        last = g >= self.max_tokens
        m = self.num_logprobs
        candidates = sorted(((b.cum_logprob + lp, i, t, lp) for i, (b, top) in enumerate(zip(self.live, tops, strict=True))
                             for t, lp in top[:m]), key=lambda c: (-c[0], c[1], c[2]))[:m]
        live, ended = [], []
        may_finish = self._improvable and not (self.early_stopping is True and len(self.finished) == self.k)
        for rank, (cum, i, t, lp) in enumerate(candidates):
            if rank >= self.k and len(live) == self.k:
                break  # (the rest can neither finish nor live on)
            parent = self.live[i]
            tokens = parent.tokens + [t]
            reason = stop = None
            if t in self.end_ids:
                reason, stop = "stop", t
            elif self.stop_at is not None and (s := self.stop_at(tokens)) is not None:
                reason, stop = "stop", s
            elif last:
                reason = "length"
            if reason is None:
                if len(live) < self.k:
                    live.append(BeamSequence(tokens, parent.logprobs + [[lp, tops[i]]], cum))
            elif rank < self.k and may_finish:
                ended.append(BeamSequence(tokens, parent.logprobs + [[lp, tops[i]]], cum, reason, stop,
                                          self.score(cum, g)))
        if ended:
            self.finished = sorted(self.finished + ended, key=lambda b: -b.score)[:self.k]
        self.live = live
        if live:  # transformers' heuristic: can the best live beam still beat the worst kept one?
            length = self.max_tokens if self.early_stopping == "never" and self.length_penalty > 0 else g
            best = self.score(live[0].cum_logprob, length)
            self._improvable = self._improvable and (len(self.finished) < self.k or best > self.finished[-1].score)
        full = self.early_stopping is True and len(self.finished) == self.k
        self.done = last or not live or not self._improvable or full

    def stop(self, reason: str) -> None:
        """End the search where it stands (a deadline): the live beams end with ``reason``."""
        for b in self.live:
            b.finish_reason, b.score = reason, self.score(b.cum_logprob, max(1, len(b.tokens)))
        self.finished = sorted(self.finished + [b for b in self.live if b.tokens], key=lambda b: -b.score)[:self.k]
        self.live, self.done = [], True

    def best(self) -> list[BeamSequence]:
        """The finished beams, best first (k of them, fewer only where the search was cut short)."""
        return self.finished
