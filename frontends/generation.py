"""One API call's engine requests: fan-out, per-choice text state, and clean-up.

A ``Generation`` sends one engine request per choice (prompts x n) onto one
shared ``Stream``, turns each batch of deltas into per-choice updates (new text
through the detokenizer and stop strings, logprob entries, finish reasons),
aborts a request in the engine as soon as a stop string ends it, and aborts
whatever is unfinished when the caller goes away (``abort_unfinished``). It
also counts the call's tokens for ``usage``, the OpenAI shape every endpoint
answers with, prompt tokens served from the engine's prefix cache included.

With a ``Metrics`` it times each choice (from ``arrival``: when the call came in)
and reports it once when it ends, however it ends: the engine's finish reason,
"stop" for a stop string, "abort" when the caller went away, "error" when the
engine refused it, could not be reached or could not run it (see ``frontends.metrics``).

A choice that the engine ends with finish_reason "error" (it could not run it:
out of memory) fails the whole call, as vLLM does: ``next_updates`` raises a
500 and the other choices are aborted; no client is ever shown "error" as a
finish reason. (A 400 naming the structured-output field where the reason is the
request's grammar: it cost the engine too much to follow.)
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable

from engine.protocol import GRAMMARS_BUSY, Delta, Error, ImageInput, PoolingParams, SamplingParams
from frontends.engine_client import EngineClient, EngineUnavailable, Stream
from frontends.errors import ApiError
from frontends.metrics import Metrics
from frontends.text import IncrementalDetokenizer, StopMatcher, StopStrings, TextCodec

# one sampled token's logprobs: (token_id, logprob, [(token_id, logprob), ...] top-k)
LogprobEntry = tuple[int, float | None, list | None]


def text_ids(ids: list[int], finish_reason: str | None, stop_reason, eos_ids) -> list[int]:
    """``ids`` but the token that ended the output (one of ``eos_ids``, or the stop token id): no text,
    as vLLM leaves it out."""
    if finish_reason == "stop" and ids and (ids[-1] in eos_ids or ids[-1] == stop_reason):
        return ids[:-1]
    return ids


class Choice:
    __slots__ = ("index", "request_id", "prompt_ids", "detok", "stops", "min_tokens", "finish_reason", "stop_reason",
                 "num_tokens", "num_prompt_tokens", "num_cached_tokens", "prompt_logprobs", "text_offset",
                 "first_token_at", "last_token_at", "answered_at", "end_reason", "embedding", "eos_ids", "include_stop")

    def __init__(self, index: int, request_id: str, prompt_ids: list[int], codec: TextCodec,
                 stop: StopMatcher | None, min_tokens: int = 0, eos_ids: frozenset[int] = frozenset(),
                 skip_special_tokens: bool = True, include_stop: bool = False) -> None:
        """The token that ends the output (one of ``eos_ids``, or a stop token id) is no text, as vLLM
        leaves it out; ``skip_special_tokens`` False: the others keep their text. ``include_stop``: the
        stop string (or token) that ends it does stay (vLLM's ``include_stop_str_in_output``)."""
        self.index = index
        self.request_id = request_id
        self.prompt_ids = prompt_ids
        self.eos_ids = eos_ids
        self.detok = IncrementalDetokenizer(codec, prompt_ids, skip_special_tokens)
        self.stops = StopStrings(stop, include_stop) if stop is not None else None
        self.include_stop = include_stop
        self.min_tokens = min_tokens  # as in vLLM, stop strings are not looked for before this many tokens
        self.finish_reason: str | None = None
        self.stop_reason: str | int | None = None  # the stop string or stop token id that ended it
        self.num_tokens = 0
        self.num_prompt_tokens = len(prompt_ids)
        self.num_cached_tokens = 0
        self.prompt_logprobs: list | None = None
        self.text_offset = 0  # characters emitted so far (legacy logprobs' text_offset)
        self.first_token_at: float | None = None  # time.monotonic() of its first token
        self.last_token_at = 0.0
        self.answered_at: float | None = None  # of its first delta (a token, or an end without one)
        self.end_reason: str | None = None  # how it ended: finish_reason, or "abort" / "error"
        self.embedding: bytes | None = None  # an embedding request's vector (float32s), with its end

    def consume(self, d: Delta) -> tuple[str, bool]:
        """New text from one delta, and whether a stop string ended the choice."""
        self.num_tokens += len(d.token_ids)
        if d.num_prompt_tokens:
            self.num_prompt_tokens = d.num_prompt_tokens
            self.num_cached_tokens = d.num_cached_tokens
        if d.prompt_logprobs is not None:
            self.prompt_logprobs = d.prompt_logprobs
        if d.embedding is not None:
            self.embedding = d.embedding
        ids = d.token_ids if self.include_stop else text_ids(d.token_ids, d.finish_reason, d.stop_reason, self.eos_ids)
        text = self.detok.step(ids) if ids else ""
        if d.finish_reason is not None:
            text += self.detok.flush()
        hit = False
        if self.stops is not None:
            # before min_tokens a stop string does not count, but the matcher still sees the text:
            # one straddling the boundary counts when it completes (as in vLLM)
            text, hit = self.stops.feed(text, check=self.num_tokens >= self.min_tokens)
            if hit:
                self.finish_reason, self.stop_reason = "stop", self.stops.matched
            elif d.finish_reason is not None:
                text += self.stops.flush()
        if d.finish_reason is not None and not hit:
            self.finish_reason, self.stop_reason = d.finish_reason, d.stop_reason
        return text, hit


def one_token_each(d: Delta) -> list[Delta]:
    """``d`` as one delta per token (the first with the prompt logprobs, the last with the end)."""
    last = len(d.token_ids) - 1
    return [Delta(d.request_id, [t], d.finish_reason if i == last else None, [d.logprobs[i]] if d.logprobs else None,
                  d.num_prompt_tokens, d.num_cached_tokens, d.prompt_logprobs if i == 0 else None,
                  d.stop_reason if i == last else None)
            for i, t in enumerate(d.token_ids)]


class Update:
    """What one choice produced in one batch."""

    __slots__ = ("choice", "text", "token_ids", "logprobs", "finished")

    def __init__(self, choice: Choice) -> None:
        self.choice = choice
        self.text = ""
        self.token_ids: list[int] = []  # as the engine sent them (a stop string may cut the text short)
        self.logprobs: list[LogprobEntry] | None = None
        self.finished = False


class Generation:
    def __init__(self, client: EngineClient, codec: TextCodec, api_id: str, prompts: list[list[int]], n: int,
                 params_for: Callable[[int], SamplingParams], priority: int = 0,
                 stop: StopMatcher | None = None, deadline: float | None = None, cache_salt: str = "",
                 metrics: Metrics | None = None, arrival: float | None = None,
                 skip_special_tokens: bool = True) -> None:
        """``stop``: the stop strings' automaton, built once for every choice (they share ``params.stop``).
        ``skip_special_tokens`` False: the text keeps them (not the EOS or stop token that ends it).

        ``priority``, ``deadline`` (unix seconds; None: the engine's default) and ``cache_salt`` ("": none)
        go to every choice's request. ``arrival``: ``time.monotonic()`` when the call came in (default: now)."""
        self.client = client
        self.api_id = api_id
        self.metrics = metrics
        self.arrival = time.monotonic() if arrival is None else arrival
        self.sent_at: float | None = None  # when the ADDs went out
        self.prompts = prompts
        self.n = n  # choices p*n .. p*n+n-1 are prompt p's
        self.stream = Stream()
        self.choices: list[Choice] = []
        self._params = []
        eos_ids = frozenset(client.ready.eos_token_ids if client.ready else ())
        self.skip_special_tokens = skip_special_tokens
        for p_idx, prompt in enumerate(prompts):
            for i in range(n):
                idx = p_idx * n + i
                params = params_for(i)
                self._params.append(params)
                self.choices.append(Choice(idx, f"{api_id}-{idx}", prompt, codec, stop, params.min_tokens, eos_ids,
                                           skip_special_tokens, params.include_stop_str_in_output))
        self._by_id = {c.request_id: c for c in self.choices}
        self._priority = priority
        self.deadline = deadline
        self.cache_salt = cache_salt
        self.lora = ""  # the LoRA adapter the request's ``model`` names ("": the model alone)
        self.admitted = False  # a later part of admitted work (a beam search's next round): no 429 for a full queue
        self.refused = False  # the engine refused a choice at its door (``_fail``): the call never was requests
        self.client_id = ""  # who asked (``OpenAIApi.client_of``): the fair scheduling policy's unit
        self.want_logprobs = self._params[0].logprobs is not None
        # the request's field the engine's json_schema / choice came from: its refusals are named so
        self.schema_param = "response_format"
        self.pooling: PoolingParams | None = None  # set: every choice is an embedding request
        self.images: list[ImageInput] = []  # what the prompt's image placeholders stand for (frontends.images)
        self._num_sent = 0

    @property
    def params(self) -> SamplingParams:
        """The first choice's sampling values (the others' differ at most in their seed)."""
        return self._params[0]

    def params_of(self, index: int) -> SamplingParams:
        """Choice ``index``'s sampling values (its own seed)."""
        return self._params[index]

    def set_max_tokens(self, prompt: int, max_tokens: int) -> None:
        """Before ``start``: prompt ``prompt``'s choices generate up to ``max_tokens`` (llama.cpp's several prompts
        each run to their own end of the context)."""
        for i in range(prompt * self.n, prompt * self.n + self.n):
            self._params[i] = dataclasses.replace(self._params[i], max_tokens=max_tokens)

    def start(self, window: int | None = None) -> None:
        """Send the choices' requests: all at once, or at most ``window`` unfinished at a time (the
        next sent as one ends), so that a call of many inputs queues only a window of them ahead of
        the calls that come after it."""
        self.sent_at = time.monotonic()
        self._send(window or len(self.choices))

    def _send(self, count: int) -> None:
        """Send the next ``count`` choices' requests."""
        try:
            while count > 0 and self._num_sent < len(self.choices):
                c, params = self.choices[self._num_sent], self._params[self._num_sent]
                self.client.add(c.request_id, c.prompt_ids, params, self._priority, self.deadline,
                                stream=self.stream, cache_salt=self.cache_salt, pooling=self.pooling,
                                lora=self.lora, images=self.images, admitted=self.admitted,
                                client_id=self.client_id)
                self._num_sent += 1
                count -= 1
        except EngineUnavailable as e:
            now = time.monotonic()
            for c in self.choices:
                self._ended(c, "error", now)
            self.abort_unfinished()
            raise ApiError(503, f"Engine unavailable: {e}") from None
        except BaseException:
            self.abort_unfinished()  # never leave part of a fan-out running unattended
            raise

    @property
    def done(self) -> bool:
        return all(c.finish_reason is not None for c in self.choices)

    @property
    def any_timed_out(self) -> bool:
        return any(c.finish_reason == "timeout" for c in self.choices)

    @property
    def timed_out_empty(self) -> bool:
        """Ended by a deadline with not one token in any choice: nothing to answer with but an error."""
        return self.done and self.num_completion_tokens == 0 and self.any_timed_out

    async def next_updates(self) -> list[Update]:
        """Wait for the next batch; an engine ``Error`` is raised as an ``ApiError``."""
        updates: dict[int, Update] = {}
        items = [part for item in await self.stream.next_batch() for part in self._split(item)]
        now = time.monotonic()
        for item in items:
            if isinstance(item, Error):
                self._fail(items, now)
                # a full engine queue is a moment's congestion: tell clients when to retry, as for TokenizerBusy
                retry = [("retry-after", "1")] if item.status == 429 else None
                param, message = item.param, item.message
                if param == "response_format" and self.schema_param != param:  # a schema from another field
                    param, message = self.schema_param, message.replace("response_format", self.schema_param, 1)
                raise ApiError(item.status, message, type=item.type, param=param, headers=retry)
            choice = self._by_id.get(item.request_id)
            if choice is None or choice.finish_reason is not None:
                continue  # already ended by a stop string
            if item.finish_reason == "error":
                self._fail(items, now)
                if item.stop_reason == GRAMMARS_BUSY:  # (other requests' grammars took the step's time)
                    raise ApiError(503, f"{self.schema_param}: {item.stop_reason}", headers=[("retry-after", "1")])
                if isinstance(item.stop_reason, str):  # its grammar cost the engine too much to follow
                    raise ApiError(400, f"{self.schema_param}: {item.stop_reason}", param=self.schema_param,
                                   headers=[("x-should-retry", "false")])
                raise _engine_failed()
            up = updates.get(choice.index)
            if up is None:
                up = updates[choice.index] = Update(choice)
            text, hit = choice.consume(item)
            if text:
                up.text += text
            if choice.answered_at is None:
                choice.answered_at = now
            if item.token_ids:
                up.token_ids += item.token_ids
            if self.want_logprobs and item.logprobs:
                entries = [(t, lp[0], lp[1]) for t, lp in zip(item.token_ids, item.logprobs, strict=False)]
                up.logprobs = entries if up.logprobs is None else up.logprobs + entries
            if choice.finish_reason is not None:
                up.finished = True
                if hit and item.finish_reason is None:
                    self.client.abort([choice.request_id])
        ended = 0
        for up in updates.values():  # a batch's tokens of one choice arrived together, however many deltas
            if up.token_ids:
                self._got_tokens(up.choice, len(up.token_ids), now)
            if up.finished:
                self._ended(up.choice, up.choice.finish_reason, now)
                ended += 1
        self._send(ended)  # (a windowed start: as many more)
        return list(updates.values())

    def _split(self, item: Delta | Error) -> tuple | list[Delta]:
        """A delta of several tokens (speculative decoding's) for a choice with stop strings, as one delta
        per token: a stop string ends the output, its usage and logprobs at the token that completes it,
        as it does without drafts (the engine is aborted; the tokens after it are dropped)."""
        if not isinstance(item, Delta) or len(item.token_ids) < 2:
            return (item,)
        choice = self._by_id.get(item.request_id)
        return (item,) if choice is None or choice.stops is None else one_token_each(item)

    def _fail(self, items: list, now: float) -> None:
        """End the choices that ``items`` say the engine refused or could not run ("error"), and abort the
        others: the call fails. (An engine that went away, or one step, may fail several at once.) One the
        engine refused at its door (a 429, its queue full; a 4xx) never was an engine request: the metrics
        do not count it as one ended in error (back-pressure read as an error rate, its prompt as prompt
        tokens and prefix-cache queries: review); its HTTP status is counted. Nor were the call's other
        choices that the engine had not yet answered: the call is refused, not theirs aborted by a client."""
        for e in items:
            if (isinstance(e, Error) or e.finish_reason == "error") and (c := self._by_id.get(e.request_id)):
                if isinstance(e, Error) and e.status < 500:
                    c.end_reason = "error"  # (the access log's word: its status says which)
                    self.refused = True
                else:
                    self._ended(c, "error", now)
        if self.refused:
            for c in self.choices:
                if c.answered_at is None and c.end_reason is None:
                    c.end_reason = "abort"  # (aborted in the engine below, uncounted)
        self.abort_unfinished()

    def abort_unfinished(self) -> None:
        live = [c for c in self.choices if c.finish_reason is None]
        if live:
            now = time.monotonic()
            for c in live:
                self._ended(c, "abort", now)
            self.client.abort([c.request_id for c in live])

    # ------------------------------------------------------------------ metrics

    def _got_tokens(self, c: Choice, num: int, now: float) -> None:
        first = c.first_token_at is None
        if first:
            c.first_token_at = now
        m = self.metrics
        if m is not None:
            if first:
                m.first_token(now - self.arrival)
            m.tokens(num, None if first else now - c.last_token_at)
        c.last_token_at = now

    def _ended(self, c: Choice, reason: str, now: float) -> None:
        """Report ``c`` to the metrics, once, however it ended."""
        if c.end_reason is not None:
            return
        c.end_reason = reason
        m = self.metrics
        if m is None:
            return
        queue = prefill = decode = None
        if c.answered_at is not None and self.sent_at is not None:
            # the engine ran it from the end of the step before its first delta, at the earliest
            scheduled = max(self.sent_at, self.stream.step_before_first.get(c.request_id, 0.0))
            queue, prefill = scheduled - self.sent_at, max(0.0, c.answered_at - scheduled)
        if c.first_token_at is not None:
            decode = now - c.first_token_at
        m.request_finished(reason, c.num_prompt_tokens, c.num_cached_tokens, c.num_tokens, now - self.arrival,
                           queue, prefill, decode)

    @property
    def first_token_at(self) -> float | None:
        """When the call's first token came (any choice's), for the access log."""
        times = [c.first_token_at for c in self.choices if c.first_token_at is not None]
        return min(times) if times else None

    @property
    def num_prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)

    @property
    def num_completion_tokens(self) -> int:
        return sum(c.num_tokens for c in self.choices)

    @property
    def num_cached_tokens(self) -> int:
        """Prompt tokens served from the prefix cache, each prompt counted once as in ``num_prompt_tokens``.

        A prompt's n choices are n engine requests that may hit the cache differently (the first may
        fill what the others then hit): the least of them is what the prompt surely got, and never
        more than its length. A choice with no first delta yet counts 0."""
        n = self.n
        return sum(min(len(prompt), *(c.num_cached_tokens for c in self.choices[p * n:(p + 1) * n]))
                   for p, prompt in enumerate(self.prompts))

    def usage(self) -> dict:
        return usage_dict(self.num_prompt_tokens, self.num_completion_tokens, self.num_cached_tokens)


def _engine_failed() -> ApiError:
    # x-should-retry: the openai clients retry a 500 by default, and a request too big for the memory
    # would fail again, after making the requests in its steps start over
    return ApiError(500, "Internal server error: the engine could not run this request (out of memory)",
                    headers=[("x-should-retry", "false")])


def usage_dict(prompt_tokens: int = 0, completion_tokens: int = 0, cached_tokens: int = 0) -> dict:
    """OpenAI's ``usage`` object; ``prompt_tokens_details.cached_tokens`` is how OpenAI reports prefix-cache hits."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}
