"""llama.cpp's own server API: ``POST /completion`` (and ``/completions``), ``/infill``, ``/embedding`` (and
``/embeddings``), ``/apply-template``, ``GET /props``; the ``content`` shapes of ``/tokenize`` and
``/detokenize`` (``tokenize``, ``detokenize``).

So that what is written for ``llama-server`` (code completion in editors: llama.vim, llama.vscode; chat
front ends in their llama.cpp mode) talks to tokenmill. A body is turned into a ``/v1/completions`` one and
runs as a completion does (the same checks, defaults, stop strings, structured output);
``CompletionFormat`` writes the result as llama.cpp does: ``content``, ``stop_type``, ``tokens_predicted``,
``timings``, ``completion_probabilities``... compact JSON, streamed as ``data: {...}`` events with no
``[DONE]``; errors as ``{"error": {"code", "message", "type"}}``.

Prompts as llama.cpp reads them: a string (with the tokenizer's BOS), token ids (as they are), a list
mixing both (one prompt: BOS only where it starts with a string), or a list of those without a
top-level integer (several prompts: the answer is a list). ``n_predict`` -1 (the default) runs to
the end of the context, 0 still samples one token (as llama.cpp does: next-token probabilities).
``n_indent`` and ``t_max_predict_ms`` end a completion at a line (``LineLimits``). Its samplers
(DRY, XTC, ``typical_p``, ``top_n_sigma``, dynamic temperature, mirostat) are ``engine.sampler_llamacpp``'s,
read as every endpoint reads them (``frontends.openai_params``; ``tfs_z``, which llama.cpp dropped, is taken
only at 1); ``repeat_penalty`` is the repetition penalty over the context's last
``repeat_last_n`` tokens, as there; ``cache_prompt``, ``id_slot``, ``samplers`` (the order is tokenmill's:
``SAMPLERS``), ``timings_per_token`` and ``return_progress`` are taken and not read: prefix caching is
always on, there are no slots.

``/infill`` builds llama.cpp's fill-in-the-middle prompt from the model's FIM tokens (``TextCodec.fim``:
found by their text, as llama.cpp finds them in a vocabulary): ``[extra context] [BOS] <PRE> prefix
prompt <SUF> suffix <MID>``, repository-level (``<REPO>``, ``<SEP>`` file names) where the model has those.
"""

from __future__ import annotations

import math
import time
from typing import Any

import orjson

from engine.protocol import SamplingParams, embedding_floats
from frontends import openai_params as op
from frontends.beam_search import refuse_beam_search
from frontends.embeddings import embeddings_job
from frontends.errors import ApiError
from frontends.generation import Generation, Update
from frontends.http import Request, Response
from frontends.openai_api import VERSION, OpenAIApi
from frontends.text import StopStrings, TextCodec

MAX_BIASED_TEXT = 256  # characters of a text logit_bias names (2048 of them: half a megabyte to tokenize)
N_BATCH = 2048  # llama-server's default -b: /infill takes 3/4 of it from the prefix, 1/4 from the suffix
# passed to the completion as they are (llama.cpp's names that are OpenAI's or vLLM's, and tokenmill's extras)
_PASSED = ("top_p", "min_p", "presence_penalty", "frequency_penalty", "ignore_eos", "grammar", "json_schema",
           "min_tokens", "priority", "timeout", "cache_salt", "stop_token_ids", "allowed_token_ids", "bad_words",
           "include_stop_str_in_output", "skip_special_tokens", "n", *op.LLAMACPP_SAMPLERS)
_NAMES = {"logprobs": "n_probs", "max_tokens": "n_predict", "repetition_penalty": "repeat_penalty"}  # in refusals
# tokenmill's order (engine.sampler_llamacpp), as llama.cpp names them
SAMPLERS = ["penalties", "dry", "temperature", "top_n_sigma", "top_k", "typ_p", "top_p", "min_p", "xtc"]
REPEAT_LAST_N = 64  # llama.cpp's: its penalties count the context's last 64 tokens
_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                404: "not_found_error", 500: "server_error", 501: "not_supported_error", 503: "unavailable_error"}


def samplers_settings(params: SamplingParams, n_ctx: int) -> dict:
    """llama.cpp's samplers' settings of ``params``, as its ``generation_settings`` show them (a window of -1:
    the context's size ``n_ctx``)."""
    out = {k: getattr(params, k) for k in op.LLAMACPP_SAMPLERS}
    out["dry_sequence_breakers"] = params.dry_breakers
    if params.dry_penalty_last_n == -1:
        out["dry_penalty_last_n"] = n_ctx
    return out


def _json_response(obj: Any) -> Response:
    return Response(200, orjson.dumps(obj))


class ExceedContextSize(ApiError):
    """A prompt with no room left in the context: llama.cpp's ``exceed_context_size_error``, with its numbers."""

    def __init__(self, n_prompt_tokens: int, n_ctx: int) -> None:
        super().__init__(400, "the request exceeds the available context size, try increasing it",
                         type="exceed_context_size_error", param="prompt")
        self.n_prompt_tokens, self.n_ctx = n_prompt_tokens, n_ctx


def error(e: ApiError) -> dict:
    if isinstance(e, ExceedContextSize):
        return {"code": 400, "message": e.message, "type": e.type, "n_prompt_tokens": e.n_prompt_tokens,
                "n_ctx": e.n_ctx}
    return {"code": e.status, "message": e.message, "type": _ERROR_TYPES.get(e.status, e.type)}


def error_body(e: ApiError) -> dict:
    """llama.cpp's error shape: ``{"error": {"code", "message", "type"}}`` (``frontends.http.shaped_errors``)."""
    return {"error": error(e)}


def _number(data: dict, name: str, default: float | None = None) -> float | None:
    return op.field(data, name, (int, float), default)


def completion_body(data: dict, adapters: dict[str, str]) -> dict:
    """The ``/v1/completions`` fields of a llama.cpp body (the prompt and ``max_tokens`` come later: they
    need the prompt's tokens)."""
    tfs_z = _number(data, "tfs_z")
    if tfs_z is not None and tfs_z < 1:
        raise ApiError(400, f"tfs_z {tfs_z:g} is not supported (llama.cpp has dropped tail-free sampling)",
                       param="tfs_z")
    lora = data.get("lora")
    if lora:
        raise ApiError(400, "lora: name an adapter as the request's model instead", param="lora")
    body: dict[str, Any] = {k: data[k] for k in _PASSED if data.get(k) is not None}
    if isinstance(data.get("model"), str) and data["model"] in adapters:  # (llama.cpp reads no model: another is no error)
        body["model"] = data["model"]
    if "n_cmpl" in data:
        body["n"] = data["n_cmpl"]
    temperature = _number(data, "temperature")
    if temperature is not None:
        body["temperature"] = max(temperature, 0.0)  # (<= 0: greedy)
    top_k = op.field(data, "top_k", int, None)
    if top_k is not None:
        body["top_k"] = max(top_k, 0)  # (<= 0: off)
    if data.get("repeat_penalty") is not None:
        body["repetition_penalty"] = data["repeat_penalty"]
    last_n = data.get("repeat_last_n")  # (checked with the others)
    body["repeat_last_n"] = REPEAT_LAST_N if last_n is None else last_n
    seed = op.field(data, "seed", int, None)
    if seed is not None and seed != -1 and seed != 0xFFFFFFFF:  # (-1: a random one)
        body["seed"] = seed
    stop = op.field(data, "stop", (list, str), None)
    if stop is not None:
        body["stop"] = [s for s in ([stop] if isinstance(stop, str) else stop) if s != ""]
    if body.get("grammar") == "":  # (llama.cpp's "no grammar")
        del body["grammar"]
    if "grammar" in body:  # a grammar, where both are given, as llama.cpp takes it
        body.pop("json_schema", None)
    n_probs = op.field(data, "n_probs", int, None)
    if n_probs is None:  # OpenAI's name, as llama.cpp reads it where n_probs is not given (an integer; else none)
        lp = op.whole(data.get("logprobs"))
        n_probs = lp if isinstance(lp, int) and not isinstance(lp, bool) else 0
    if n_probs < 0:
        raise ApiError(400, f"n_probs must be at least 0, got {n_probs}", param="n_probs")
    if n_probs:
        body["logprobs"] = n_probs
    return body


class LineLimits:
    """llama.cpp's ``n_indent`` and ``t_max_predict_ms``, over a choice's stop strings (``inner``), with
    ``StopStrings``' face for ``frontends.generation.Choice``. From the output's second line on, a line
    indented less than ``n_indent`` (spaces and tabs; an empty line too) ends it, cut after that line's
    indentation (the end of a code block); once ``max_ms`` have passed since the first token, a token that
    holds a newline is the last."""

    __slots__ = ("inner", "n_indent", "max_s", "started", "line_start", "indent", "matched", "limited")

    def __init__(self, inner: StopStrings | None, n_indent: int, max_ms: float) -> None:
        self.inner, self.n_indent, self.max_s = inner, n_indent, max_ms / 1000
        self.started: float | None = None
        self.line_start = False  # in the indentation of a line after the first
        self.indent = 0  # its width so far
        self.matched: str | None = None  # the stop string that ended it
        self.limited = False  # these limits ended it (llama.cpp's stop_type "limit")

    def feed(self, text: str, check: bool = True) -> tuple[str, bool]:
        now = time.monotonic()
        if self.started is None:
            self.started = now
        newline, hit = "\n" in text, False
        if self.inner is not None:
            text, hit = self.inner.feed(text, check)
        text, cut = self._lines(text)
        if cut or (not hit and newline and self.max_s > 0 and now - self.started > self.max_s):
            self.limited = True
            return text, True
        if hit:
            self.matched = self.inner.matched
        return text, hit

    def _lines(self, text: str) -> tuple[str, bool]:
        """(``text`` up to a line indented too little, whether there was one)."""
        if self.n_indent <= 0:
            return text, False
        for i, ch in enumerate(text):
            if self.line_start:
                if ch in " \t":
                    self.indent += 1
                    continue
                if self.indent < self.n_indent:
                    return text[:i], True
                self.line_start = False
            if ch == "\n":
                self.line_start, self.indent = True, 0
        return text, False

    def flush(self) -> str:
        return self._lines(self.inner.flush() if self.inner is not None else "")[0]


def _pick(obj: dict, paths: list[str]) -> dict:
    """llama.cpp's ``response_fields``: only these paths (``timings/prompt_n``), each under its path."""
    out = {}
    for path in paths:
        v: Any = obj
        for key in path.split("/"):
            if not (isinstance(v, dict) and key in v):
                break
            v = v[key]
        else:
            out[path] = v
    return out


def _rate(n: int, ms: float) -> tuple[float | None, float | None]:
    """(ms per token, tokens per second), None where undefined (llama.cpp writes its NaNs as null)."""
    return (ms / n if n else None), (1e3 * n / ms if ms > 0 else None)


class CompletionFormat:
    """What a generation produced, as llama.cpp's results: one object per choice (a list of them for several),
    or streamed: a ``data:`` event per update of a choice, and its whole result (less the text) at its end."""

    DONE = b""  # no [DONE] line

    def __init__(self, model: str, gen: Generation, settings: dict, prompt_texts: list[str], n_probs: int,
                 post_sampling: bool, return_tokens: bool, fields: list[str] | None, codec: TextCodec) -> None:
        self.model, self.gen, self.settings = model, gen, settings
        self.prompt_texts = prompt_texts  # per prompt ("" where no one asked for it)
        self.n_probs, self.post_sampling, self.return_tokens, self.fields = n_probs, post_sampling, return_tokens, fields
        self.codec = codec
        k = len(gen.choices)
        self.texts, self.ids = [""] * k, [[] for _ in range(k)]
        self.probs: list[list[dict]] = [[] for _ in range(k)]
        self.new_line = [False] * k

    def _token(self, tid: int) -> dict:
        """A token as llama.cpp writes one: its bytes, and its text but a character it holds only part of."""
        raw = self.codec.token_bytes(tid)
        return {"id": tid, "token": raw.decode(errors="ignore"), "bytes": list(raw)}

    def _entry(self, tid: int, lp: float | None, top: list | None) -> dict:
        key = "prob" if self.post_sampling else "logprob"

        def value(v: float | None) -> float:
            v = -3.4028234663852886e38 if v is None or v == -math.inf else v  # (llama.cpp's lowest float)
            return math.exp(v) if self.post_sampling else v
        tops = [{**self._token(t), key: value(v)} for t, v in (top or [])[:self.n_probs]]
        return {**self._token(tid), key: value(lp), "top_probs" if self.post_sampling else "top_logprobs": tops}

    def _take(self, up: Update) -> list[dict]:
        i = up.choice.index
        self.texts[i] += up.text
        self.ids[i] += up.token_ids
        self.new_line[i] = self.new_line[i] or "\n" in up.text
        probs = [self._entry(*e) for e in up.logprobs or ()] if self.n_probs else []
        self.probs[i] += probs
        return probs

    def _stop_type(self, c) -> tuple[str, str]:
        if c.finish_reason == "stop":
            if isinstance(c.stop_reason, str):
                return "word", c.stop_reason
            if not getattr(c.stops, "limited", False):
                return "eos", ""
        return "limit", ""

    def _result(self, c, streamed: bool) -> dict:
        stop_type, word = self._stop_type(c)
        now = time.monotonic()
        first = c.first_token_at or c.answered_at or now
        prompt_ms, predicted_ms = 1e3 * (first - self.gen.arrival), 1e3 * ((c.last_token_at or first) - first)
        prompt_n = c.num_prompt_tokens - c.num_cached_tokens
        out = {
            "index": c.index, "content": "" if streamed else self.texts[c.index],
            "tokens": [] if streamed or not self.return_tokens else self.ids[c.index], "id_slot": 0, "stop": True,
            "model": self.model, "tokens_predicted": c.num_tokens, "tokens_evaluated": c.num_prompt_tokens,
            "generation_settings": {**self.settings, "max_tokens": self.settings["max_tokens"][c.index // self.gen.n]},
            "prompt": self.prompt_texts[c.index // self.gen.n],
            "has_new_line": self.new_line[c.index], "truncated": c.finish_reason == "length"
            and c.num_prompt_tokens + c.num_tokens >= self.settings["n_ctx"],  # (the context ended it)
            "stop_type": stop_type, "stopping_word": word,
            "tokens_cached": c.num_prompt_tokens + c.num_tokens,
            "timings": {"cache_n": c.num_cached_tokens, "prompt_n": prompt_n, "prompt_ms": prompt_ms,
                        **dict(zip(("prompt_per_token_ms", "prompt_per_second"), _rate(prompt_n, prompt_ms),
                                   strict=True)),
                        "predicted_n": c.num_tokens, "predicted_ms": predicted_ms,
                        **dict(zip(("predicted_per_token_ms", "predicted_per_second"),
                                   _rate(c.num_tokens, predicted_ms), strict=True))},
        }
        if self.n_probs and not streamed:  # (less the stop word's tokens, as llama.cpp counts them)
            probs = self.probs[c.index]
            out["completion_probabilities"] = probs[:max(0, len(probs) - len(self.codec.encode(word, False)))] \
                if word else probs
        return _pick(out, self.fields) if self.fields is not None else out

    # ------------------------------------------------------------------ whole

    def collect(self, updates: list[Update]) -> None:
        for up in updates:
            self._take(up)

    def response(self) -> dict | list:
        results = [self._result(c, streamed=False) for c in self.gen.choices]
        return results[0] if len(results) == 1 else results

    # ------------------------------------------------------------------ streamed

    def stream_head(self) -> bytes:
        return b""

    def chunk(self, updates: list[Update]) -> bytes:
        out = b""
        for up in updates:
            c = up.choice
            probs = self._take(up)
            if up.text or up.token_ids:
                event = {"index": c.index, "content": up.text, "tokens": up.token_ids, "stop": False, "id_slot": -1,
                         "tokens_predicted": c.num_tokens, "tokens_evaluated": c.num_prompt_tokens}
                if self.n_probs:
                    event["completion_probabilities"] = probs
                out += b"data: " + orjson.dumps(event) + b"\n\n"
            if up.finished:
                out += b"data: " + orjson.dumps(self._result(c, streamed=True)) + b"\n\n"
        return out

    def stream_error(self, e: ApiError) -> bytes:
        return b"data: " + orjson.dumps({"error": error(e)}) + b"\n\n"


async def encode_all(api: OpenAIApi, texts: list[str], specials: list[bool] | None = None,
                     literal: bool = False) -> list[list[int]]:
    """Each of ``texts`` encoded (with the tokenizer's BOS where ``specials`` says; ``literal``: special tokens'
    names read as text, llama.cpp's ``parse_special`` false), in one piece of tokenizer work: many small strings
    cost the event loop one call, or go to the tokenizer thread together."""
    codec = api.codec
    specials = specials or [False] * len(texts)

    def encode() -> list[list[int]]:
        if not literal:
            return [codec.encode(t, s) for t, s in zip(texts, specials, strict=True)]
        return [[*(codec.bos if s else ()), *codec.encode_literal(t)] for t, s in zip(texts, specials, strict=True)]
    return await api._offload(sum(map(len, texts)) + 16 * len(texts), encode)  # (a call's own cost as 16 characters)


async def tokens_of(api: OpenAIApi, value: Any, param: str, add_special: bool, literal: bool = False) -> list[int]:
    """A string, token ids, or a list of both (llama.cpp's mixed prompt) as ids; the string that starts
    it with the tokenizer's BOS where ``add_special``; ``literal``: as ``encode_all``."""
    parts = [value] if isinstance(value, str) else value
    kinds = set(map(type, parts)) if isinstance(parts, list) else {None}  # (a list of millions of ids: at C's pace)
    if kinds == {int}:  # token ids alone
        return op.check_token_ids(parts, api.codec.vocab_size, param)
    if not kinds <= {str, int}:
        raise ApiError(400, f"'{param}' must be a string, a list of token ids, or a list mixing strings and "
                       "token ids", param=param)
    texts = [x for x in parts if isinstance(x, str)]
    op.check_text_length(sum(map(len, texts)), api.max_chars, param)
    encoded = iter(await encode_all(api, texts, [add_special and i == 0 for i, x in enumerate(parts)
                                                 if isinstance(x, str)], literal))
    ids: list[int] = []
    for x in parts:
        if isinstance(x, str):
            ids += next(encoded)
        else:
            ids.append(x)
    return op.check_token_ids(ids, api.codec.vocab_size, param)


class LlamaCppApi:
    """The routes above, over an ``OpenAIApi``'s engine client, tokenizer and completion checks."""

    def __init__(self, api: OpenAIApi, model_path: str = "") -> None:
        self.api, self.codec, self.model_path = api, api.codec, model_path
        self.fim = api.codec.fim
        if "pre" in self.fim:  # /infill reads code literally: the tokenizer that does, made now, not in a request
            api.codec.encode_literal("")

    def routes(self, router) -> None:
        auth = self.api.auth
        for method, path, handler in (("POST", "/completion", self.completion), ("POST", "/completions", self.completion),
                                      ("POST", "/infill", self.infill), ("POST", "/apply-template", self.apply_template),
                                      ("GET", "/props", self.props), ("POST", "/embedding", self.embedding),
                                      ("POST", "/embeddings", self.embedding)):
            router.add(method, path, auth.guard(handler, json_body=method == "POST"), errors=(error_body,),
                       refuses=auth.refuses)
            router.add_preflight(path, auth.preflight)
        # the OpenAI frontend's, which take llama.cpp's shapes too (a llama.cpp-shaped /tokenize is refused in its shape)
        router.add("POST", "/tokenize", auth.guard(self.tokenize, json_body=True), refuses=auth.refuses)
        router.add("POST", "/detokenize", auth.guard(self.detokenize, json_body=True), refuses=auth.refuses)

    # ------------------------------------------------------------------ prompts

    async def _prompts(self, p: Any, name: str = "prompt") -> list[list[int]]:
        if p is None:
            raise ApiError(400, f"Missing required field: '{name}'", param=name)
        if isinstance(p, list) and not p:
            raise ApiError(400, f"'{name}' must not be empty", param=name)
        several = isinstance(p, list) and not any(isinstance(x, int) and not isinstance(x, bool) for x in p)
        items = p if several else [p]
        if len(items) > op.MAX_PROMPTS:
            raise ApiError(400, f"At most {op.MAX_PROMPTS} prompts per request, got {len(items)}", param=name)
        out = []
        for x in items:
            if isinstance(x, dict):  # llama.cpp's {"prompt_string", "multimodal_data"}
                if x.get("multimodal_data"):
                    raise ApiError(400, "images go through /v1/chat/completions here", param=name)
                x = x.get("prompt_string")
            out.append(await tokens_of(self.api, x, name, add_special=True))
        return out

    def _infill_prompt(self, prefix: list[int], suffix: list[int], prompt: list[int],
                       extra: list[tuple[list[int], list[int]]], n_predict: int, sep_name: list[int],
                       repo_name: list[int], snippet: list[int]) -> list[int]:
        """llama.cpp's ``format_prompt_infill``: ``[extra] [BOS] <PRE> prefix prompt <SUF> suffix <MID>``,
        the end of the prefix, the start of the suffix and the end of the extra context kept where long."""
        fim = self.fim
        context: list[int] = [fim["rep"], *repo_name] if "rep" in fim else []
        for name, text in extra:
            context += [fim["sep"], *name] if "sep" in fim else snippet
            context += text
        if "sep" in fim:
            context += [fim["sep"], *sep_name]
        ctx = self.api.max_model_len
        batch = min(N_BATCH, ctx)
        take_suffix = min(len(suffix), max(0, batch // 4 - (2 + len(prompt))))
        rest = len(self.codec.bos) + len(prompt) + take_suffix + 3  # (and the 3 FIM tokens)
        # llama.cpp's 3/4 of a batch, less what leaves no room for n_predict (or one token) in a context that small
        take_prefix = max(0, min(len(prefix), 3 * (batch // 4), ctx - rest - max(n_predict, 1)))
        rest += take_prefix
        # llama.cpp's room beside a batch, less what leaves no room for n_predict (or one token)
        take_extra = max(0, min(len(context), ctx - batch + 2, ctx - rest - max(n_predict, 1)))
        return [*context[len(context) - take_extra:],
                *self.codec.fim_prompt([*prefix[len(prefix) - take_prefix:], *prompt], suffix[:take_suffix])]

    # ------------------------------------------------------------------ routes

    async def completion(self, req: Request):
        return await self.api._run(req, op.parse_json(req.body), self.completion_job)

    async def infill(self, req: Request):
        return await self.api._run(req, op.parse_json(req.body), self.infill_job)

    async def completion_job(self, data: dict, arrival: float | None = None,
                             prompts: list[list[int]] | None = None,
                             stop_token_ids: list[int] = (), logprobs: int | None = None
                             ) -> tuple[Generation, CompletionFormat]:
        """A llama.cpp body checked and run as a completion (``prompts``: already made, for /infill;
        ``logprobs``: the top logprobs of each token, given in place of ``n_probs``, where 0 is none)."""
        api = self.api
        try:
            refuse_beam_search(data)
            body = completion_body(data, api.adapters)
            if logprobs is not None:  # (Ollama's: 0 is each token's own logprob)
                body["logprobs"] = logprobs
            if prompts is None:
                prompts = await self._prompts(data.get("prompt"))
            if stop_token_ids:
                body["stop_token_ids"] = [*op.field(body, "stop_token_ids", list, []), *stop_token_ids]
            body["logit_bias"] = await self._logit_bias(data)
            n_predict = op.field(data, "n_predict", int, None)
            if n_predict is None:
                n_predict = op.field(data, "max_completion_tokens", int, op.field(data, "max_tokens", int, -1))
            longest = max(map(len, prompts))
            if longest >= api.max_model_len:
                raise ExceedContextSize(longest, api.max_model_len)

            def budget(prompt: list[int]) -> int:
                """-1: to the end of the context; 0: one token (llama.cpp samples one before it looks); past the
                context: up to its end (truncated)."""
                room = api.max_model_len - len(prompt)
                return min(room if n_predict < 0 else max(n_predict, 1), room, api.max_tokens_cap or room)
            budgets = [budget(p) for p in prompts]
            body["max_tokens"], body["prompt"] = min(budgets), prompts
            gen, _ = await api.completion_job(body, arrival)
        except ApiError as e:
            raise e.renamed(_NAMES) from None
        for i, b in enumerate(budgets):  # each prompt to its own end of the context
            gen.set_max_tokens(i, b)
        n_indent, max_ms = op.field(data, "n_indent", int, 0), _number(data, "t_max_predict_ms", 0)
        if n_indent > 0 or max_ms > 0:
            for c in gen.choices:
                c.stops = LineLimits(c.stops, n_indent, max_ms)
        fields = op.field(data, "response_fields", list, None) or None
        if fields is not None and not all(isinstance(f, str) for f in fields):
            raise ApiError(400, "response_fields must be a list of strings", param="response_fields")
        texts = [""] * len(prompts)
        if fields is None or "prompt" in fields:  # the prompt as text, special tokens written
            texts = [await api._offload(len(p), self.codec.decode, p, False) for p in prompts]
        params = gen.params
        settings = {"n_ctx": api.max_model_len, "n_predict": n_predict, "max_tokens": budgets,  # (one's, per prompt)
                    "seed": params.seed if params.seed is not None else 0xFFFFFFFF,
                    "temperature": params.temperature, "top_k": params.top_k, "top_p": params.top_p,
                    "min_p": params.min_p, "repeat_penalty": params.repetition_penalty,
                    "repeat_last_n": api.max_model_len if params.repeat_last_n == -1 else params.repeat_last_n,
                    "presence_penalty": params.presence_penalty, "frequency_penalty": params.frequency_penalty,
                    "stop": params.stop, "ignore_eos": params.ignore_eos, "stream": bool(data.get("stream")),
                    "logit_bias": [{"token": t, "bias": b} for t, b in (params.logit_bias or {}).items()],
                    "n_probs": params.logprobs or 0, "grammar": params.grammar or "", "samplers": SAMPLERS,
                    **samplers_settings(params, api.max_model_len)}
        return gen, CompletionFormat(gen.lora or api.model, gen, settings, texts, params.logprobs or 0,
                                     op.field(data, "post_sampling_probs", bool, False),
                                     op.field(data, "return_tokens", bool, False), fields, self.codec)

    async def _logit_bias(self, data: dict) -> dict[str, float] | None:
        """llama.cpp's ``logit_bias``, ``[[token, bias], ...]`` or ``{token: bias}``, a token an id or a text (each of
        its tokens), ``false`` for never: as OpenAI's (ids outside the vocabulary and other values skipped, as there)."""
        given = data.get("logit_bias")
        if given is None:
            return None
        if isinstance(given, dict):
            pairs = list(given.items())
        elif isinstance(given, list) and all(isinstance(p, list) and len(p) == 2 for p in given):
            pairs = [tuple(p) for p in given]
        else:
            raise ApiError(400, "logit_bias must be [[token, bias], ...] or {token: bias}", param="logit_bias")
        if len(pairs) > op.MAX_LOGIT_BIAS:
            raise ApiError(400, f"'logit_bias' may have at most {op.MAX_LOGIT_BIAS} entries, got {len(pairs)}",
                           param="logit_bias")
        biases: list[tuple[list[int] | str, float]] = []
        for token, bias in pairs:
            if bias is False:
                bias = -100.0  # (the least a bias may be: never sampled)
            elif isinstance(bias, bool) or not isinstance(bias, int | float):
                continue
            if isinstance(token, str) and len(token) < 20 and token.lstrip("-").isascii() and token.lstrip("-").isdigit():
                token = int(token)  # (a key that is an integer is an id; a longer one is none)
            if isinstance(token, int) and not isinstance(token, bool):
                biases.append(([token], bias))
            elif isinstance(token, str):
                if len(token) > MAX_BIASED_TEXT:
                    raise ApiError(400, f"logit_bias: a text of at most {MAX_BIASED_TEXT} characters, got {len(token)}",
                                   param="logit_bias")
                biases.append((token, bias))
        texts = [t for t, _ in biases if isinstance(t, str)]
        encoded = iter(await encode_all(self.api, texts))
        out: dict[str, float] = {}
        for token, bias in biases:
            for t in token if isinstance(token, list) else next(encoded):
                if 0 <= t < self.codec.vocab_size:
                    out[str(t)] = max(-100.0, min(100.0, float(bias)))
        return out or None  # (its size: the completion's check, as OpenAI's logit_bias)

    async def infill_job(self, data: dict, arrival: float | None = None,
                         logprobs: int | None = None) -> tuple[Generation, CompletionFormat]:
        missing = [f"{name} token is missing. " for name, kind in (("prefix", "pre"), ("suffix", "suf"),
                                                                   ("middle", "mid")) if kind not in self.fim]
        if missing:
            raise ApiError(501, "Infill is not supported by this model: " + "".join(missing), type="not_supported_error")
        for name in ("input_prefix", "input_suffix"):
            if name not in data:
                raise ApiError(400, f"'{name}' is required", param=name)
        # the code as text: a special token's name in it stays its characters (llama.cpp's parse_special false)
        prefix = await tokens_of(self.api, data["input_prefix"], "input_prefix", add_special=False, literal=True)
        suffix = await tokens_of(self.api, data["input_suffix"], "input_suffix", add_special=False, literal=True)
        prompt = op.field(data, "prompt", str, "")
        chunks = op.field(data, "input_extra", list, [])
        if len(chunks) > op.MAX_PROMPTS:
            raise ApiError(400, f"At most {op.MAX_PROMPTS} input_extra chunks, got {len(chunks)}", param="input_extra")
        op.check_text_length(len(prompt), self.api.max_chars, "prompt")
        texts = ["filename\n", "myproject\n", "\n\n--- snippet ---\n\n"]
        for chunk in chunks:
            if not (isinstance(chunk, dict) and isinstance(chunk.get("text"), str)
                    and isinstance(chunk.get("filename", ""), str)):
                raise ApiError(400, "input_extra must be a list of {\"filename\": string, \"text\": string}",
                               param="input_extra")
            texts += [chunk.get("filename", "tmp") + "\n", chunk["text"]]
        op.check_text_length(sum(map(len, texts)), self.api.max_chars, "input_extra")
        (prompt_ids,) = await encode_all(self.api, [prompt])  # (its special tokens' names are the tokens)
        sep_name, repo_name, snippet, *extra = await encode_all(self.api, texts, literal=True)
        tokens = self._infill_prompt(prefix, suffix, prompt_ids, list(zip(extra[::2], extra[1::2], strict=True)),
                                     op.field(data, "n_predict", int, -1), sep_name, repo_name, snippet)
        ends = self.codec.fim_ends
        return await self.completion_job(data, arrival, prompts=[tokens], stop_token_ids=ends, logprobs=logprobs)

    async def embedding(self, req: Request) -> Response:
        """llama.cpp's ``/embedding``: ``content`` (or ``input``) in its prompt forms, ``embd_normalize`` 2 (L2, the
        default) or -1 (none), answered ``[{"index", "embedding": [[...]]}]``; run as ``/v1/embeddings`` runs."""
        data = op.parse_json(req.body)
        content = data.get("content", data.get("input"))
        norm = op.field(data, "embd_normalize", int, 2)
        if norm not in (-1, 2):
            raise ApiError(400, f"embd_normalize {norm} is not supported here (2: Euclidean, -1: none)",
                           param="embd_normalize")
        body = {k: data[k] for k in ("priority", "timeout", "cache_salt") if k in data}
        body |= {"input": await self._prompts(content, "content"), "normalize": norm == 2}
        return await self.api._embed(req, body, _embeddings_job, content)

    async def apply_template(self, req: Request) -> Response:
        """A chat body's prompt as its template writes it: ``{"prompt": text}``."""
        data = op.parse_json(req.body)
        ids = await self.api._shown_prompt({k: v for k, v in data.items() if k != "model"})
        text = await self.api._offload(len(ids), self.codec.decode, ids, False)
        return _json_response({"prompt": text})

    async def props(self, req: Request) -> Response:
        api, ready = self.api, self.api.client.ready
        tok = self.codec.tokenizer
        params = {"n_predict": -1, "temperature": 1.0, "top_k": 0, "top_p": 1.0, "min_p": 0.0,
                  "repeat_penalty": 1.0, "repeat_last_n": REPEAT_LAST_N, "presence_penalty": 0.0,
                  "frequency_penalty": 0.0, "seed": 0xFFFFFFFF, "stop": [], "ignore_eos": False, "n_probs": 0,
                  "grammar": "", "samplers": SAMPLERS, **samplers_settings(SamplingParams(), api.max_model_len)}
        params |= {("repeat_penalty" if k == "repetition_penalty" else k): v for k, v in api.sampling_defaults.items()
                   if k in ("temperature", "top_k", "top_p", "min_p", "repetition_penalty")}
        return Response(200, orjson.dumps({
            "default_generation_settings": {"n_ctx": api.max_model_len, "params": params},
            "total_slots": ready.max_num_seqs, "model_alias": api.model, "model_path": self.model_path,
            "modalities": {"vision": bool(ready.image_tokens), "audio": False},
            "chat_template": self.codec.chat_template or "", "bos_token": getattr(tok, "bos_token", None) or "",
            "eos_token": getattr(tok, "eos_token", None) or "", "build_info": f"tokenmill {VERSION}"}))

    async def tokenize(self, req: Request) -> Response:
        """vLLM's ``/tokenize``, or llama.cpp's: ``content`` (a string, or ids and strings), ``add_special`` (False),
        ``with_pieces``: ``{"tokens": [id, ...]}`` or ``[{"id", "piece"}, ...]`` (a piece no whole UTF-8: its bytes)."""
        data = op.parse_json(req.body)
        if "content" not in data or "prompt" in data or "messages" in data:
            return _json_response(await self.api.tokenized(data))
        try:
            return await self._tokenize(data)
        except ApiError as e:  # (llama.cpp's body: its error shape)
            return Response(e.status, orjson.dumps(error_body(e)), headers=list(e.headers))

    async def _tokenize(self, data: dict) -> Response:
        ids = await tokens_of(self.api, data["content"], "content", op.field(data, "add_special", bool, False),
                              literal=not op.field(data, "parse_special", bool, True))
        if not op.field(data, "with_pieces", bool, False):
            return _json_response({"tokens": ids})
        if len(ids) > op.MAX_DETOKENIZE_TOKENS:
            raise ApiError(400, f"with_pieces: at most {op.MAX_DETOKENIZE_TOKENS} tokens, got {len(ids)}",
                           param="content")
        return _json_response({"tokens": await self.api._offload(len(ids), self._pieces, ids)})

    def _pieces(self, ids: list[int]) -> list[dict]:
        out = []
        for t in ids:
            raw = self.codec.token_bytes(t)
            try:
                out.append({"id": t, "piece": raw.decode()})
            except UnicodeDecodeError:  # (part of a character: its bytes)
                out.append({"id": t, "piece": list(raw)})
        return out

    async def detokenize(self, req: Request) -> Response:
        """vLLM's ``/detokenize`` (``prompt``: the text), with llama.cpp's ``content`` (special tokens written)."""
        data = op.parse_json(req.body)
        out = await self.api.detokenized(data)
        return _json_response(out | {"content": await self.api._offload(len(data["tokens"]), self.codec.decode,
                                                              data["tokens"], False)})


async def _embeddings_job(api: OpenAIApi, data: dict, arrival: float | None = None):
    gen, _ = await embeddings_job(api, data, arrival)
    return gen, _Embeddings(gen)


class _Embeddings:
    """llama.cpp's ``/embedding`` answer: a pooled vector per input, each in a list of one (as there)."""

    def __init__(self, gen: Generation) -> None:
        self.gen = gen

    def body(self) -> bytes:
        return orjson.dumps([{"index": c.index, "embedding": [embedding_floats(c.embedding)]}
                             for c in self.gen.choices])
