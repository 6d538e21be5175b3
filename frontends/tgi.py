"""Hugging Face TGI's own API: ``POST /generate``, ``/generate_stream``, ``/`` (TGI's compat route: a list of one
answer, or the stream where ``stream`` is true), ``/invocations`` and ``/tokenize`` where the body has ``inputs``,
``GET /info``.

So that what is written for text-generation-inference (``huggingface_hub.InferenceClient(url).text_generation``,
``text_generation.Client``, LangChain's and LlamaIndex's TGI classes) talks to tokenmill. A body ``{"inputs",
"parameters", "stream"}`` is checked by TGI's rules (its messages, 422 ``{"error", "error_type": "validation"}``)
and run as a ``/v1/completions`` body of the prompt's tokens; ``GenerateFormat`` writes TGI's answers:
``generated_text``, ``details`` (``finish_reason`` "length" | "eos_token" | "stop_sequence", or "timeout" when
the request's ``timeout`` passed; ``tokens``, ``prefill``, ``top_tokens``, ``best_of_sequences``), streamed as
``data:{...}`` events, one per token, the last with the whole text, no ``[DONE]`` (a stream cut by its
``timeout`` ends with TGI's ``incomplete_generation`` error event instead).

As TGI reads them: no ``parameters`` at all samples (``do_sample`` true), ``parameters`` without ``do_sample`` and
without any of temperature 1, ``top_k``, ``top_p`` < 1, ``typical_p`` < 1 is greedy; ``max_new_tokens`` null runs
to the end of the context; ``truncate`` keeps the prompt's last tokens; a stop sequence stays in the text;
``return_full_text`` puts the inputs before it (on ``/`` by default, as TGI does for a text-generation model);
``best_of`` samples that many and answers the one with the highest mean token logprob; a sampled request gets a
seed where it has none, and ``details`` shows it. ``watermark`` is refused (not built here). tokenmill's own
fields (``EXTRAS``: ``priority``, ``timeout``, ``ignore_eos``...) are taken in ``parameters``.
"""

from __future__ import annotations

import math
import secrets
import time
from typing import Any

import orjson

from engine.protocol import MAX_STOP_STRINGS
from frontends import openai_params as op
from frontends.errors import ApiError
from frontends.generation import Generation, Update
from frontends.http import Request, Response, StreamingResponse, shaped_errors
from frontends.openai_api import VERSION, OpenAIApi
from frontends.text import IncrementalDetokenizer

# tokenmill's own fields, taken in ``parameters`` as they are (the OpenAI endpoints' extras)
EXTRAS = ("ignore_eos", "min_tokens", "priority", "timeout", "cache_salt")
MAX_BEST_OF = 16  # TGI's --max-best-of is 2 by default
MAX_TOP_N_TOKENS = op.MAX_LOGPROBS  # TGI's --max-top-n-tokens is 5 by default
_NUM = (int, float)
# how TGI names what the completion it runs as refuses
_NAMES = {"max_tokens": "max_new_tokens", "logprobs": "top_n_tokens", "prompt": "inputs", "model": "adapter_id",
          "n": "best_of", "structured_outputs": "grammar"}
_ERROR_TYPES = {422: "validation", 424: "generation", 429: "overloaded", 401: "authentication", 408: "generation",
                503: "generation"}
TRUNCATED_CHARS = 2_000_000  # inputs tokenized whole before ``truncate`` cuts them (TGI's payload limit)


def error_status(e: ApiError) -> int:
    """TGI's status for a refusal: a bad request is a 422, a failure while generating a 424."""
    return {400: 422, 404: 422, 500: 424}.get(e.status, e.status)


def error_body(e: ApiError) -> dict:
    """TGI's error shape: ``{"error", "error_type"}``."""
    status = error_status(e)
    prefix = "Input validation error: " if status == 422 else ""
    kind = e.type if e.type == "incomplete_generation" else _ERROR_TYPES.get(
        status, "validation" if status < 500 else "generation")
    return {"error": prefix + e.message, "error_type": kind}


def _refuse(message: str, param: str) -> ApiError:
    return ApiError(400, message, param=param)


class Params:
    """A TGI body's ``parameters``, checked as TGI's router checks them (its order, its messages)."""

    def __init__(self, data: dict, stream: bool) -> None:
        inputs = data.get("inputs")
        if not isinstance(inputs, str):
            raise _refuse("`inputs` must be a string", "inputs")
        if not inputs:
            raise _refuse("`inputs` cannot be empty", "inputs")
        self.inputs, self.stream = inputs, stream
        p = data["parameters"] if "parameters" in data else {"do_sample": True}  # (none at all: TGI samples)
        if not isinstance(p, dict):
            raise _refuse("`parameters` must be an object", "parameters")
        num = lambda name: op.field(p, name, _NUM, None)  # noqa: E731
        self.temperature, self.top_p, self.typical_p = num("temperature"), num("top_p"), num("typical_p")
        self.top_k = op.field(p, "top_k", int, None)
        self.do_sample = op.field(p, "do_sample", bool, False)
        best_of = op.field(p, "best_of", int, None)
        if stream and best_of is not None and best_of != 1:
            raise _refuse("`best_of` != 1 is not supported when streaming tokens", "best_of")
        if best_of is not None and not 0 < best_of <= MAX_BEST_OF:
            raise _refuse(f"`best_of` must be > 0 and <= {MAX_BEST_OF}. Given: {best_of}", "best_of")
        self.best_of = best_of or 1
        self.decoder_input_details = op.field(p, "decoder_input_details", bool, False)
        if stream and self.decoder_input_details:
            raise _refuse("`decoder_input_details` == true is not supported when streaming tokens",
                          "decoder_input_details")
        if self.best_of > 1 and not (self.do_sample or any(v is not None for v in (
                self.temperature, self.top_k, self.top_p, self.typical_p))):
            raise _refuse("you must use sampling when `best_of` is > 1", "best_of")
        if self.temperature is not None and self.temperature <= 0:
            raise _refuse("`temperature` must be strictly positive", "temperature")
        self.repetition_penalty, self.frequency_penalty = num("repetition_penalty"), num("frequency_penalty")
        if self.repetition_penalty is not None and self.repetition_penalty <= 0:
            raise _refuse("`repetition_penalty` must be strictly positive", "repetition_penalty")
        if self.frequency_penalty is not None and not -2 <= self.frequency_penalty <= 2:
            raise _refuse("`frequency_penalty` must be >= -2.0 and <= 2.0", "frequency_penalty")
        for name in ("top_p", "typical_p"):
            v = getattr(self, name)
            if v is not None and not 0 < v < 1:
                raise _refuse(f"`{name}` must be > 0.0 and < 1.0", name)
        if self.top_k is not None and self.top_k <= 0:
            raise _refuse("`top_k` must be strictly positive", "top_k")
        self.max_new_tokens = op.field(p, "max_new_tokens", int, None)
        if self.max_new_tokens is not None and self.max_new_tokens <= 0:
            raise _refuse("`max_new_tokens` must be strictly positive", "max_new_tokens")
        stop = op.field(p, "stop", list, [])
        if not all(isinstance(s, str) for s in stop):
            raise _refuse("`stop` must be a list of strings", "stop")
        if len(stop) > MAX_STOP_STRINGS:
            raise _refuse(f"`stop` supports up to {MAX_STOP_STRINGS} stop sequences. Given: {len(stop)}", "stop")
        self.stop = [s for s in stop if s]
        self.seed = op.field(p, "seed", int, None)
        if self.seed is not None and self.best_of > 1:
            raise _refuse("`seed` must not be set when `best_of` > 1", "seed")
        if self.seed is not None and not 0 <= self.seed < 2**64:
            raise _refuse(f"`seed` must be an unsigned 64-bit integer, got {self.seed}", "seed")
        self.top_n_tokens = op.field(p, "top_n_tokens", int, None) or 0
        if not 0 <= self.top_n_tokens <= MAX_TOP_N_TOKENS:
            raise _refuse(f"`top_n_tokens` must be >= 0 and <= {MAX_TOP_N_TOKENS}. Given: {self.top_n_tokens}",
                          "top_n_tokens")
        self.truncate = op.field(p, "truncate", int, None)
        self.details = op.field(p, "details", bool, False)
        self.return_full_text = op.field(p, "return_full_text", bool, None)
        if op.field(p, "watermark", bool, False):
            raise _refuse("`watermark` is not supported by this server", "watermark")
        self.adapter_id = op.field(p, "adapter_id", str, None)
        self.extras = {k: p[k] for k in EXTRAS if p.get(k) is not None}
        self.structured = grammar(p.get("grammar"))
        # the Python server's rule: sampled where asked, or where a warper would change the distribution
        self.sampling = self.do_sample or (self.temperature is not None and self.temperature != 1) or bool(
            self.top_k) or (self.top_p is not None and self.top_p < 1) or (
            self.typical_p is not None and self.typical_p < 1)

    def completion_body(self, prompt: list[int], max_new_tokens: int, adapters: dict[str, str],
                        served: tuple[str, ...] = ()) -> dict:
        """The ``/v1/completions`` body this runs as (``prompt``: the inputs' tokens, truncated)."""
        body: dict[str, Any] = {"prompt": prompt, "max_tokens": max_new_tokens, "stop": self.stop,
                                "include_stop_str_in_output": True, "n": self.best_of}
        # TGI's defaults, not the model's generation config
        body |= {"temperature": 0.0, "top_k": self.top_k or 0, "top_p": self.top_p or 1.0, "min_p": 0.0,
                 "typical_p": self.typical_p or 1.0, "repetition_penalty": self.repetition_penalty or 1.0,
                 "frequency_penalty": self.frequency_penalty or 0.0}
        if self.sampling:
            body["temperature"] = 1.0 if self.temperature is None else self.temperature
            body["seed"] = self.seed if self.seed is not None else secrets.randbits(63)  # (details show it)
        if self.stream or self.details or self.decoder_input_details or self.best_of > 1 or self.top_n_tokens:
            body["logprobs"] = self.top_n_tokens  # (each token's own, and the top n)
        if self.decoder_input_details:
            body["prompt_logprobs"] = 0
        if self.adapter_id and self.adapter_id not in served:  # (the model's own name: no adapter)
            if self.adapter_id not in adapters:
                raise _refuse(f"adapter_id {self.adapter_id[:64]!r} is not loaded; the loaded ones: "
                              f"{sorted(adapters)[:16]}", "adapter_id")
            body["model"] = self.adapter_id
        if self.structured is not None:
            body["structured_outputs"] = self.structured
        return body | self.extras


def grammar(g: Any) -> dict | None:
    """TGI's ``grammar`` as vLLM's ``structured_outputs``: ``{"type": "json" | "json_object", "value": schema (or
    its text)}``, ``{"type": "json_schema", "value": {"name", "schema"}}``, ``{"type": "regex", "value": text}``."""
    if g is None:
        return None
    if not isinstance(g, dict) or "value" not in g:
        raise _refuse("grammar must be {\"type\": \"json\" | \"json_schema\" | \"regex\", \"value\": ...}", "grammar")
    kind, value = g.get("type"), g["value"]
    if kind == "regex":
        if not isinstance(value, str):
            raise _refuse("grammar is not valid: a regex grammar's value is a string", "grammar")
        return {"regex": value}
    if kind not in ("json", "json_object", "json_schema"):
        raise _refuse(f"grammar type {kind!r} is not supported (json, json_schema, regex)", "grammar")
    if isinstance(value, str):
        try:
            value = orjson.loads(value)
        except orjson.JSONDecodeError as e:
            raise _refuse(f"grammar is not valid: {e}", "grammar") from None
    if kind == "json_schema":
        value = value.get("schema") if isinstance(value, dict) else None
    if not isinstance(value, dict):
        raise _refuse("grammar is not supported: its value must be a JSON schema object", "grammar")
    return {"json": value}


class TgiApi:
    """TGI's routes beside the OpenAI ones, run through ``OpenAIApi``'s completions."""

    def __init__(self, api: OpenAIApi) -> None:
        self.api = api
        self.codec = api.codec
        self.special = frozenset(getattr(self.codec.tokenizer, "all_special_ids", ()))

    def routes(self, router, tokenize, invocations) -> None:
        """TGI's paths; ``/tokenize`` and ``/invocations`` go to TGI's where the body has ``inputs``, else to
        ``tokenize`` and ``invocations`` (the handlers there before)."""
        auth = self.api.auth
        for path, handler in (("/generate", self.generate), ("/generate_stream", self.generate_stream),
                              ("/", self.compat)):
            router.add("POST", path, auth.guard(handler, json_body=True), errors=(error_body, error_status),
                       refuses=auth.refuses)
            router.add_preflight(path, auth.preflight)
        router.add("GET", "/info", auth.guard(self.info), errors=(error_body, error_status))
        router.add_preflight("/info", auth.preflight)
        # (a missing key is refused from the head, its body unread: in OpenAI's shape, as vLLM refuses it)
        for path, other, mine in (("/tokenize", tokenize, self.tokenize), ("/invocations", invocations, self.compat)):
            router.add("POST", path, self._or(auth.guard(other, json_body=True), shaped_errors(
                auth.guard(mine, json_body=True), error_body, error_status)), refuses=auth.refuses)

    @staticmethod
    def _or(other, mine):
        """``mine`` for a body with ``inputs`` (its refusals in TGI's shape), else ``other``."""
        async def handle(req: Request):
            try:
                ours = "inputs" in op.parse_json(req.body)
            except ApiError:
                ours = False  # (other's refusal)
            return await (mine if ours else other)(req)
        return handle

    # ------------------------------------------------------------------ routes

    async def generate(self, req: Request) -> Response:
        return await self._run(req, op.parse_json(req.body), stream=False, full_text=False, listed=False)

    async def generate_stream(self, req: Request) -> StreamingResponse:
        return await self._run(req, op.parse_json(req.body), stream=True, full_text=False, listed=False)

    async def compat(self, req: Request) -> Response | StreamingResponse:
        """TGI's ``POST /``: ``stream`` picks; a whole answer is a list of one; ``return_full_text`` is true unless
        given (as TGI's for a model whose pipeline is text generation)."""
        data = op.parse_json(req.body)
        return await self._run(req, data, stream=op.field(data, "stream", bool, False), full_text=True, listed=True)

    async def _run(self, req: Request, data: dict, stream: bool, full_text: bool, listed: bool):
        async def job(_, arrival):
            return await self.job(data, arrival, stream, full_text, listed)
        return await self.api._run(req, {"stream": stream, "prompt": data.get("inputs")}, job)

    async def job(self, data: dict, arrival: float | None, stream: bool, full_text: bool,
                  listed: bool) -> tuple[Generation, GenerateFormat]:
        api = self.api
        p = Params(data, stream)
        max_input = api.max_model_len - 1
        if p.truncate is not None and not 0 < p.truncate <= max_input:
            raise _refuse(f"`truncate` must be strictly positive and less than {max_input}. Given: {p.truncate}",
                          "truncate")
        op.check_text_length(len(p.inputs), api.max_chars if p.truncate is None else max(api.max_chars, TRUNCATED_CHARS),
                             "inputs")
        ids = await api._offload(len(p.inputs), self.codec.encode, p.inputs, True)
        if p.truncate is not None:
            ids = ids[-p.truncate:]
        if len(ids) > max_input:
            raise _refuse(f"`inputs` must have less than {api.max_model_len} tokens. Given: {len(ids)}", "inputs")
        new = p.max_new_tokens or min(api.max_model_len - len(ids), api.max_tokens_cap or api.max_model_len)
        if len(ids) + new > api.max_model_len:
            raise _refuse(f"`inputs` tokens + `max_new_tokens` must be <= {api.max_model_len}. Given: {len(ids)} "
                          f"`inputs` tokens and {new} `max_new_tokens`", "max_new_tokens")
        try:
            gen, _ = await api.completion_job(p.completion_body(ids, new, api.adapters, api.model_names), arrival)
        except ApiError as e:
            raise e.renamed(_NAMES) from None
        gen.schema_param = _NAMES.get(gen.schema_param, gen.schema_param)  # (the engine's refusal of a grammar)
        full_text = p.return_full_text if p.return_full_text is not None else full_text
        return gen, GenerateFormat(self, gen, p, p.inputs if full_text else "", listed)

    async def info(self, req: Request) -> Response:
        api = self.api
        return Response(200, orjson.dumps({
            "model_id": api.model, "model_sha": None, "model_pipeline_tag": "text-generation",
            "max_concurrent_requests": api.client.ready.max_num_waiting_requests, "max_best_of": MAX_BEST_OF,
            "max_stop_sequences": MAX_STOP_STRINGS, "max_input_tokens": api.max_model_len - 1,
            "max_total_tokens": api.max_model_len, "validation_workers": 1, "max_client_batch_size": op.MAX_PROMPTS,
            "router": "tokenmill", "version": VERSION, "sha": None, "docker_label": None}))

    async def tokenize(self, req: Request) -> Response:
        """TGI's ``/tokenize``: ``[{"id", "text", "start", "stop"}]``, the offsets in characters of ``inputs``."""
        data = op.parse_json(req.body)
        inputs = data.get("inputs")
        if not isinstance(inputs, str):
            raise _refuse("`inputs` must be a string", "inputs")
        op.check_text_length(len(inputs), self.api.max_chars, "inputs")
        pieces = await self.api._offload(len(inputs), self.codec.encode_offsets, inputs)
        return Response(200, orjson.dumps([{"id": t, "text": inputs[a:b], "start": a, "stop": b}
                                           for t, a, b in pieces]))

    def token(self, tid: int, logprob: float | None, text: str | None = None) -> dict:
        return {"id": tid, "text": self.codec.token_text(tid) if text is None else text, "logprob": _lp(logprob),
                "special": tid in self.special}


def _lp(v: float | None) -> float | None:
    return None if v is None or math.isnan(v) else max(v, -3.4028234663852886e38)  # (-inf as f32's lowest, as TGI)


# TGI's finish reasons, and this server's "timeout" (a request's ``timeout`` passed: TGI has no deadlines), never
# passed off as "length", which says max_new_tokens was reached
_FINISH = {"length": "length", "timeout": "timeout", "abort": "length"}
_CUT = ("timeout", "abort")  # a stream these end says so with TGI's incomplete_generation error event


class GenerateFormat:
    """What a generation produced, as TGI's answers: ``{"generated_text", "details"}`` (a list of one on ``/``), or
    a ``data:`` event per token, the last with the whole text and (where asked) the details."""

    DONE = b""  # no [DONE]

    def __init__(self, tgi: TgiApi, gen: Generation, p: Params, prefix: str, listed: bool) -> None:
        self.tgi, self.gen, self.p, self.prefix, self.listed = tgi, gen, p, prefix, listed
        k = len(gen.choices)
        self.texts = [""] * k
        # each token's own text as TGI shows it: what it adds to the text, special tokens by name
        self.detoks = [IncrementalDetokenizer(tgi.codec, c.prompt_ids, skip_special_tokens=False)
                       for c in gen.choices]
        self.tokens: list[list[dict]] = [[] for _ in range(k)]
        self.tops: list[list[list[dict]]] = [[] for _ in range(k)]
        self.index = 0  # the stream's events so far
        self.best = gen.choices[0]  # the answer (of best_of's)

    def _take(self, up: Update) -> list[tuple[dict, list[dict]]]:
        c = up.choice
        i = c.index
        self.texts[i] += up.text
        entries = up.logprobs or [(t, None, None) for t in up.token_ids]
        out = []
        for tid, lp, top in entries:
            tok = self.tgi.token(tid, lp, self.detoks[i].step([tid]))
            tops = [self.tgi.token(t, v) for t, v in (top or [])[:self.p.top_n_tokens]]
            self.tokens[i].append(tok)
            self.tops[i].append(tops)
            out.append((tok, tops))
        if up.finished and out and isinstance(c.stop_reason, str):  # a stop sequence may end inside the last token:
            before = sum(len(t["text"]) for t in self.tokens[i][:-1] if not t["special"])  # its text as the text was
            # cut (the special tokens' names are not in the text)
            out[-1][0]["text"] = self.texts[i][before:]
        elif up.finished and out:  # an unfinished character at the end is the last token's, as the text has it
            out[-1][0]["text"] += self.detoks[i].flush()
        return out

    def _finish_reason(self, c) -> str:
        if c.finish_reason == "stop":
            return "stop_sequence" if isinstance(c.stop_reason, str) else "eos_token"
        return _FINISH.get(c.finish_reason, "length")

    def _seed(self, c) -> int | None:
        return self.gen.params_of(c.index).seed if self.p.sampling else None

    def _sequence(self, c) -> dict:
        i = c.index
        out = {"generated_text": self.prefix + self.texts[i], "finish_reason": self._finish_reason(c),
               "generated_tokens": c.num_tokens, "seed": self._seed(c), "prefill": self._prefill(c),
               "tokens": self.tokens[i]}
        if self.p.top_n_tokens:
            out["top_tokens"] = self.tops[i]
        return out

    def _prefill(self, c) -> list[dict]:
        if not self.p.decoder_input_details or c.prompt_logprobs is None:
            return []
        return [{"id": t, "text": self.tgi.codec.token_text(t), "logprob": None if e is None else _lp(e[0])}
                for t, e in zip(c.prompt_ids, c.prompt_logprobs, strict=False)]

    def _mean_logprob(self, c) -> float:
        lps = [t["logprob"] for t in self.tokens[c.index]]
        return sum(v if v is not None else -math.inf for v in lps) / len(lps) if lps else -math.inf

    # ------------------------------------------------------------------ whole

    def collect(self, updates: list[Update]) -> None:
        for up in updates:
            self._take(up)

    def response(self) -> dict | list:
        choices = self.gen.choices
        best = self.best = max(choices, key=self._mean_logprob) if len(choices) > 1 else choices[0]
        out: dict[str, Any] = {"generated_text": self.prefix + self.texts[best.index]}
        if self.p.details or self.p.decoder_input_details:
            seq = self._sequence(best)
            del seq["generated_text"]
            if len(choices) > 1:
                seq["best_of_sequences"] = [self._sequence(c) for c in choices if c is not best]
            out["details"] = seq
        return [out] if self.listed else out

    def headers(self) -> list[tuple[str, str]]:
        """TGI's numbers about the answer."""
        total, c = time.monotonic() - self.gen.arrival, self.best
        return [("x-compute-time", f"{total:.6f}"), ("x-compute-characters", str(len(self.p.inputs))),
                ("x-total-time", str(int(total * 1e3))), ("x-prompt-tokens", str(c.num_prompt_tokens)),
                ("x-generated-tokens", str(c.num_tokens))]

    # ------------------------------------------------------------------ streamed

    def stream_head(self) -> bytes:
        return b""

    def chunk(self, updates: list[Update]) -> bytes:
        out = b""
        for up in updates:
            c = up.choice
            taken = self._take(up)
            cut = up.finished and c.finish_reason in _CUT
            for j, (tok, tops) in enumerate(taken):
                self.index += 1
                last = up.finished and j == len(taken) - 1 and not cut
                out += self._event(c, tok, tops, last)
            # a deadline ends the stream the same way whether or not a token came with it (TGI never sends a
            # token event without a token, and a final one would pass the cut off as a normal end)
            if up.finished and (cut or not taken):
                out += self.stream_error(ApiError(500, f"Incomplete generation: the request ended ({c.finish_reason}) "
                                                       f"after {c.num_tokens} tokens", type="incomplete_generation"))
        return out

    def _event(self, c, tok: dict, tops: list[dict], last: bool) -> bytes:
        event: dict[str, Any] = {"index": self.index, "token": tok}
        if self.p.top_n_tokens:
            event["top_tokens"] = tops
        event["generated_text"] = self.prefix + self.texts[c.index] if last else None
        event["details"] = None
        if last and self.p.details:
            event["details"] = {"finish_reason": self._finish_reason(c), "generated_tokens": c.num_tokens,
                                "seed": self._seed(c), "input_length": c.num_prompt_tokens}
        return b"data:" + orjson.dumps(event) + b"\n\n"

    def stream_error(self, e: ApiError) -> bytes:
        return b"data:" + orjson.dumps(error_body(e)) + b"\n\n"
