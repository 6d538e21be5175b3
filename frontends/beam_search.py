"""vLLM's ``use_beam_search`` for completions and chats: ``n`` beams per prompt (``engine.beam_search``).

A ``BeamGeneration`` is a ``Generation`` whose choices are each prompt's n best beams. ``next_updates``
runs the whole search: a round of one-token requests per step (every live beam of every prompt, in one
batch, each asking for its top logprobs), until every search is done, then answers every choice at
once, finished. Its text goes through the choice's detokenizer and stop strings as a sampled choice's
does (a beam ends at the token that completes a stop string, as at an end id). A deadline (the request's
``timeout``, else the server's ``--request-timeout``, over the whole search) ends the search where it
stands: the best beams so far, "timeout" for those still live.

The search reads the model's own logprobs, so what would change them is refused (``beam_search_params``):
structured output, forced tool calls, penalties, logit_bias, allowed or bad words, ``min_tokens``;
temperature, top_p, top_k, min_p and seed are read by nothing, as in vLLM.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from engine.beam_search import MAX_BEAM_WIDTH, BeamSearch, BeamSearchParams, BeamSequence
from engine.protocol import Delta, SamplingParams
from frontends.errors import ApiError
from frontends.generation import Generation, Update
from frontends.openai_params import field, structured_fields
from frontends.text import IncrementalDetokenizer, StopMatcher, StopStrings, TextCodec

# fields that change the distribution beams are ranked by, and the values that leave it as it is
_PENALTIES = ("presence_penalty", "frequency_penalty", "repetition_penalty")
_NEUTRAL = {"presence_penalty": 0, "frequency_penalty": 0, "repetition_penalty": 1, "logit_bias": None,
            "allowed_token_ids": None, "bad_words": None, "min_tokens": 0}


def beam_search_params(data: dict, base: SamplingParams, n: int, eos_ids, forced_tools: bool = False
                       ) -> BeamSearchParams | None:
    """The request's beam search (None: ``use_beam_search`` is not set): ``n`` beams, ``length_penalty``,
    ``early_stopping`` and ``base``'s max_tokens, end and stop fields; a 400 naming a field it cannot honour.
    ``eos_ids``: the model's."""
    if not field(data, "use_beam_search", bool, False):
        return None
    if not 1 <= n <= MAX_BEAM_WIDTH:
        raise ApiError(400, f"beam search keeps n beams: n must be in [1, {MAX_BEAM_WIDTH}], got {n}", param="n")
    off = _PENALTIES if base.repeat_last_n == 0 else ()  # (llama.cpp's window of none: no penalty)
    refused = structured_fields(data) + ["tool_choice"] * forced_tools + [
        name for name, neutral in _NEUTRAL.items() if name not in off and data.get(name) not in (None, neutral, {}, [])
    ] + ["dry_multiplier"] * base.dry  # (llama.cpp's DRY: a penalty; its other samplers only cut what is sampled)
    if refused:
        raise ApiError(400, f"{refused[0]} cannot be used with use_beam_search: beams are ranked by the model's "
                       "own logprobs", param=refused[0])
    params = BeamSearchParams(n, base.max_tokens, base.ignore_eos, length_penalty=field(
        data, "length_penalty", (int, float), 1.0), include_stop_str_in_output=base.include_stop_str_in_output,
        early_stopping=field(data, "early_stopping", (bool, str), False), stop=list(base.stop),
        stop_token_ids=list(base.stop_token_ids))
    try:
        params.check(len(end_ids(params, eos_ids)))
    except ValueError as e:
        name = str(e).split(" ", 1)[0]
        raise ApiError(400, str(e).replace("beam_width", "n", 1), param={"beam_width": "n"}.get(name, name)) from None
    return params


def refuse_beam_search(data: dict) -> None:
    """A 400 for ``use_beam_search`` where an API has no beam search (it would be silently sampled)."""
    if data.get("use_beam_search"):
        raise ApiError(400, "use_beam_search is served by /v1/completions and /v1/chat/completions only",
                       param="use_beam_search")


def end_ids(params: BeamSearchParams, eos_ids) -> frozenset[int]:
    """The ids that end a beam: the stop token ids, and the model's EOS ids unless ``ignore_eos``."""
    return frozenset(params.stop_token_ids) | frozenset(() if params.ignore_eos else eos_ids)


def stop_finder(codec: TextCodec, prompt: list[int], stop: StopMatcher,
                skip_special_tokens: bool) -> Callable[[list[int]], str | None]:
    """What ``BeamSearch`` asks of a beam's tokens: the stop string their text completes (None: none), the
    text as a choice's detokenizer makes it (the prompt's last tokens before it)."""
    def stop_at(tokens: list[int]) -> str | None:
        detok = IncrementalDetokenizer(codec, prompt, skip_special_tokens)
        stops = StopStrings(stop)
        stops.feed(detok.step(tokens) + detok.flush())
        return stops.matched
    return stop_at


def beam_delta(request_id: str, beam: BeamSequence, stop_token_ids: list[int], num_prompt_tokens: int,
               num_cached_tokens: int, prompt_logprobs: list | None) -> Delta:
    """A finished beam as the one delta of a choice: a stop string or an id of ``stop_token_ids`` its
    stop_reason, as the engine has it (the EOS none)."""
    stop_reason = beam.stop_reason if isinstance(beam.stop_reason, str) or beam.stop_reason in stop_token_ids \
        else None
    return Delta(request_id, beam.tokens, beam.finish_reason, beam.logprobs, num_prompt_tokens, num_cached_tokens,
                 prompt_logprobs, stop_reason)


class BeamGeneration(Generation):
    def __init__(self, client, codec: TextCodec, api_id: str, prompts: list[list[int]], beam: BeamSearchParams,
                 base: SamplingParams, priority: int = 0, stop: StopMatcher | None = None,
                 deadline: float | None = None, cache_salt: str = "", metrics=None, arrival: float | None = None,
                 skip_special_tokens: bool = True) -> None:
        """``base``: the request's sampling fields (its logprobs and prompt_logprobs: what the answer shows)."""
        super().__init__(client, codec, api_id, prompts, beam.beam_width, lambda i: base, priority, stop, deadline,
                         cache_salt, metrics, arrival, skip_special_tokens)
        self.codec = codec
        self.stop_token_ids = beam.stop_token_ids
        self.ends = end_ids(beam, client.ready.eos_token_ids)
        self.searches = [BeamSearch(beam, self.ends, stop_finder(codec, p, stop, skip_special_tokens)
                                    if stop is not None else None) for p in prompts]
        self._round: Generation | None = None  # the round in flight
        self._rounds = 0
        self._first_at: float | None = None  # when the first round ended: the beams' first tokens

    def start(self, window: int | None = None) -> None:
        self.sent_at = time.monotonic()  # (the rounds are sent by next_updates)

    async def next_updates(self) -> list[Update]:
        """Run every search to its end; every choice's one update."""
        cached: list[int] = [0] * len(self.prompts)
        prompt_lps: list = [None] * len(self.prompts)
        shown = self.params.logprobs or 0
        while live := [p for p, s in enumerate(self.searches) if not s.done]:
            first = self._rounds == 0
            asked = max(shown, *(self.searches[p].num_logprobs for p in live))
            params = SamplingParams(max_tokens=1, temperature=0.0, logprobs=asked,
                                    prompt_logprobs=self.params.prompt_logprobs if first else None)
            owners = [p for p in live for _ in self.searches[p].live]
            beams = [self.prompts[p] + b.tokens for p in live for b in self.searches[p].live]
            tops, timed_out = await self._next_tokens(beams, params)
            if first:
                self._first_at = time.monotonic()
            for p in live:
                mine = [(top, i) for i, (o, top) in enumerate(zip(owners, tops, strict=True)) if o == p]
                if first:
                    i = mine[0][1]
                    cached[p], prompt_lps[p] = self._round.choices[i].num_cached_tokens, \
                        self._round.choices[i].prompt_logprobs
                if timed_out:
                    self.searches[p].stop("timeout")
                else:
                    self.searches[p].advance([top for top, _ in mine])
            self._round = None
        return self._answer(cached, prompt_lps, shown)

    async def _next_tokens(self, beams: list[list[int]], params: SamplingParams) -> tuple[list, bool]:
        """One round: each beam's next-token top logprobs, and whether the deadline ended the round."""
        self._rounds += 1
        r = self._round = Generation(self.client, self.codec, f"{self.api_id}-beam{self._rounds}", beams, 1,
                                     lambda i: params, self._priority, None, self.deadline, self.cache_salt,
                                     skip_special_tokens=self.skip_special_tokens)
        r.lora, r.images, r.client_id = self.lora, self.images, self.client_id
        r.admitted = self._rounds > 1  # the first round took the queue's room; the search must not fail halfway
        # data parallel: every round on the first one's engine (its beams' prefixes are cached there), chosen by
        # the search's prompt_cache_key where it has one
        r.stream.engine, r.stream.affinity = self.stream.engine, self.stream.affinity
        tops: list = [None] * len(beams)
        r.start()
        self.stream.engine = r.stream.engine
        try:
            while not r.done:
                for up in await r.next_updates():
                    if up.logprobs:
                        tops[up.choice.index] = up.logprobs[0][2]
        finally:
            r.abort_unfinished()
        if any(c.finish_reason == "timeout" for c in r.choices):
            return tops, True
        if any(t is None for t in tops):  # (ended without its token: only an abort or an error do)
            raise ApiError(500, "Internal server error: a beam search round ended without its tokens")
        return tops, False

    def _answer(self, cached: list[int], prompt_lps: list, shown: int) -> list[Update]:
        now = time.monotonic()
        updates = []
        for p, search in enumerate(self.searches):
            best = search.best()
            for i in range(self.n):
                c = self.choices[p * self.n + i]
                up = Update(c)
                beam = best[i] if i < len(best) else BeamSequence([], finish_reason="timeout")
                up.text, _ = c.consume(beam_delta(c.request_id, beam, self.stop_token_ids, len(self.prompts[p]),
                                                  cached[p], prompt_lps[p]))
                up.token_ids = beam.tokens
                if self.want_logprobs:
                    up.logprobs = [(t, lp, top[:shown]) for t, (lp, top) in zip(beam.tokens, beam.logprobs,
                                                                                strict=True)]
                up.finished = True
                if beam.tokens:  # (its first token came with the first round: that is its TTFT)
                    c.first_token_at, c.last_token_at = self._first_at or now, now
                    if self.metrics is not None:
                        self.metrics.first_token(c.first_token_at - self.arrival)
                        self.metrics.tokens(len(beam.tokens), None)
                self._ended(c, c.finish_reason, now)
                updates.append(up)
        return updates

    def abort_unfinished(self) -> None:
        # a first round the engine refused at its door: the search never was requests (Generation._fail)
        refused = self._round is not None and self._round.refused and self._first_at is None
        if self._round is not None:
            self._round.abort_unfinished()
            self._round = None
        now = time.monotonic()
        for c in self.choices:  # (never sent to the engine: only the rounds were)
            if c.finish_reason is None:
                if refused:
                    c.end_reason = c.end_reason or "abort"
                else:
                    self._ended(c, "abort", now)
