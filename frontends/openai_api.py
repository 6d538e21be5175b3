"""The OpenAI-compatible HTTP API: routes, auth, and the response shapes.

``/v1/completions``, ``/v1/chat/completions`` and ``/v1/responses`` (plain and SSE streaming),
``/v1/embeddings`` (``frontends.embeddings``), ``/v1/rerank`` and ``/v1/score`` (``frontends.scoring``),
``/v1/models`` (and one model's card: ``/v1/models/{model}``), ``/health``, ``/tokenize``, ``/detokenize``, ``/version``.
Request bodies are read in ``openai_params``; the engine requests of one call
run in a ``generation.Generation``. Every endpoint except ``/health`` needs an
API key when keys are configured; all of them follow the origin rule of
``frontends.auth``, and the POSTs want ``Content-Type: application/json``.

Scheduling fields: ``priority`` (lower runs first) and ``timeout`` (seconds, sent
as a deadline that the engine enforces): a call it ends before any token gets a
408, otherwise its choices end with finish_reason "timeout" and the text so far.
``cache_salt`` (vLLM's field) keeps a request's prefix-cache hits among requests
with the same salt; ``usage.prompt_tokens_details.cached_tokens`` says how many
prompt tokens came from that cache.
A full engine queue is a 429 with Retry-After. A call the engine could not run
(a choice that ends with finish_reason "error": out of memory) is a 500, or,
once its stream has begun, an error event that ends the stream, as in vLLM.
Chat ``tools`` / ``tool_choice``: ``frontends.tools`` (the template sees the tools; calls
are read out of each choice's text, or the output is held to them).
``/health`` shows the engine's latest stats, as the client's liveness pings
brought them: it never waits on the engine (one that has not answered them for a
while is a 503: ``EngineClient.stalled``). ``/metrics`` (with a ``Metrics``)
is Prometheus' view of every frontend (``frontends.metrics``); it follows the
key rule unless ``metrics_no_auth``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import itertools
import logging
import os
import time
from collections.abc import AsyncIterator, Callable
from typing import Any
from urllib.parse import parse_qs, unquote

import orjson

from engine.config import env_flag
from engine.protocol import MAX_ADAPTER_NAME, MAX_DRY_BREAKER_SEQUENCES, SamplingParams, Stats
from frontends import anthropic, harmony, images, reasoning, tools
from frontends import openai_params as op
from frontends.access_log import CallInfo
from frontends.anthropic import MessagesFormat
from frontends.auth import Auth
from frontends.background import BackgroundRuns
from frontends.beam_search import BeamGeneration, beam_search_params, refuse_beam_search
from frontends.embeddings import classify_job, embeddings_job
from frontends.engine_client import EngineClient, EngineUnavailable
from frontends.errors import ApiError, shown
from frontends.generation import Generation, LogprobEntry, Update, usage_dict
from frontends.http import Request, Response, Router, StreamingResponse
from frontends.images import ImageProcessor
from frontends.media import MediaReader
from frontends.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from frontends.metrics import Metrics
from frontends.response_store import BrokenChain, Hold, Keep, Locked, ResponseStore, StillRunning
from frontends.responses import (
    RESPONSES_PARAMS,
    ResponsesFormat,
    at_sources,
    check_unique,
    conversation_id,
    new_id,
    oldest_turns_dropped,
    stored_items,
    to_chat,
)
from frontends.scoring import rerank_job, score_job
from frontends.stored_api import conversation_missing, too_large
from frontends.text import StopMatcher, TextCodec, TokenizerBusy, bad_words_token_ids, without_broken_end

VERSION = "0.1.0"
_DONE = b"data: [DONE]\n\n"
DEV_MODE_ENV = "VLLM_SERVER_DEV_MODE"  # vLLM's: its development endpoints on (here POST /reset_prefix_cache)


EMBEDDINGS_INLINE_BYTES = 1 << 18  # float32 bytes of vectors a response is written with on the event loop (~5 ms)


log = logging.getLogger("tokenmill.frontend")


def _json(obj: object, status: int = 200) -> Response:
    return Response(status, orjson.dumps(obj))


async def _kept(fmt) -> None:
    """A finished Response stored before the client reads that it is done (``ResponsesFormat.kept``)."""
    if isinstance(fmt, ResponsesFormat):
        await fmt.kept()


def _released(fmt) -> None:
    """The call has ended: the conversation lock its turn held let go of (where its items were not added)."""
    if isinstance(fmt, ResponsesFormat) and fmt.keep is not None:
        fmt.keep.release()


def _sse(obj: object) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"


def stats_fields(s: Stats) -> dict:
    """The engine's numbers as /health and the WebSocket ``stats`` message show them."""
    return {"num_waiting": s.num_waiting, "num_running": s.num_running, "kv_usage": s.kv_usage,
            "num_free_blocks": s.num_free_blocks, "num_kv_blocks": s.num_kv_blocks,
            "num_preemptions": s.num_preemptions, "num_timeouts": s.num_timeouts,
            "prefix_cache_hit_rate": s.prefix_cache_hit_rate, "num_evictions": s.num_evictions,
            "kv_fragmentation": s.kv_fragmentation, "num_spec_drafts": s.num_spec_drafts,
            "num_spec_draft_tokens": s.num_spec_draft_tokens, "num_spec_accepted_tokens": s.num_spec_accepted_tokens}


def _adapter_name(data: dict) -> str:
    name = op.field(data, "lora_name", str)
    if not 0 < len(name) <= MAX_ADAPTER_NAME:  # (the engine checks it too: here, no long name goes further)
        raise ApiError(400, f"an adapter's name must be 1 to {MAX_ADAPTER_NAME} characters", param="lora_name")
    return name


def _timed_out(started: float) -> ApiError:
    # x-should-retry: the openai clients retry a 408 by default, each time with a fresh timeout
    return ApiError(408, f"Request timed out after {time.time() - started:.3g} s before producing a token",
                    headers=[("x-should-retry", "false")])


class OpenAIApi:
    def __init__(self, client: EngineClient, codec: TextCodec, served_model_name: str,
                 api_keys: list[str] | None = None, allowed_origins: list[str] | None = None,
                 metrics: Metrics | None = None, metrics_no_auth: bool = False, tool_call_parser: str = "auto",
                 reasoning_parser: str = "auto", sampling_defaults: dict | None = None,
                 max_tokens_cap: int | None = None, model_aliases: list[str] | None = None,
                 force_include_usage: bool = False, tokens_as_ids: bool = False,
                 images: ImageProcessor | str | None = None, media: MediaReader | None = None,
                 fair_client: str = "address", responses_store: ResponseStore | None = None,
                 loopback: bool = False) -> None:
        """``images``: the model's image processor (``frontends.images``), or why there is none for a model that
        reads images (None: the model reads none); ``media``: where images may come from (``frontends.media``;
        None: data: URLs only); ``fair_client``: who a client is for the fair policy (``client_of``);
        ``responses_store``: where Responses are kept (None: none are)."""
        self.client = client
        self.responses_store = responses_store
        self.background = BackgroundRuns(responses_store) if responses_store is not None else None
        self.images = images
        self.media = media or MediaReader()
        self.metrics = metrics
        self.metrics_no_auth = metrics_no_auth
        self.codec = codec
        self.model = served_model_name  # what responses say
        self.model_names = (served_model_name, *(model_aliases or ()))  # what requests may say
        self.auth = Auth(api_keys or (), allowed_origins or (), loopback)  # (loopback: listening there alone)
        self._ids = itertools.count()
        self._id_prefix = os.urandom(4).hex()
        self.created = int(time.time())
        template = codec.chat_template if codec is not None else None
        # GPT-OSS's harmony answers read into thinking, content and calls (frontends.harmony)
        self.harmony = (harmony.detect(template) if reasoning_parser == "auto" else reasoning_parser == "openai_gptoss"
                        ) or tool_call_parser == "openai"
        # the format tool_choice "auto" reads (frontends.tools); None: "auto" is refused
        fmt = (tools.detect_format(template) if tool_call_parser == "auto"
               else None if tool_call_parser == "none" else tool_call_parser)
        self.tool_format = None if fmt == "openai" and not self.harmony else fmt  # (harmony's calls: with its messages)
        self.no_tool_format = tools.no_format(template, tool_call_parser)  # (why, for the 400 of "auto")
        self.tools_shown = tools.shows_tools(template)  # (a format given for a template that shows none: warned)
        if self.tool_format is not None and not self.tools_shown:
            log.warning("--tool-call-parser %s: this model's chat template shows no tools, so the model never sees a "
                        "request's tools; give a template that does (--chat-template)", tool_call_parser)
        # whether <think>...</think> is split off into reasoning_content (frontends.reasoning)
        self.thinking = not self.harmony and (reasoning.detect(template) if reasoning_parser == "auto"
                                              else reasoning_parser != "none")
        self.sampling_defaults = sampling_defaults or {}  # the model's (engine.model_path.generation_defaults)
        self.max_tokens_cap = max_tokens_cap  # on every request's max_tokens (engine.model_path.max_tokens_cap)
        self.fair_client = fair_client  # who a client is for the fair policy (client_of)
        self.force_include_usage = force_include_usage  # every stream ends with its usage chunk
        self.tokens_as_ids = tokens_as_ids  # logprobs name tokens "token_id:N" unless a request says otherwise

    def routes(self, router: Router | None = None) -> Router:
        router = router or Router()
        routes = [
            ("GET", "/health", self.health),
            ("GET", "/ping", self.health),  # SageMaker's, as vLLM answers them
            ("POST", "/ping", self.health),
            ("POST", "/invocations", self.invocations),
            ("POST", "/v1/completions", self.completions),
            ("POST", "/v1/chat/completions", self.chat_completions),
            ("POST", "/v1/responses", self.responses),
            ("POST", "/v1/messages", self.messages),
            ("POST", "/v1/messages/count_tokens", self.count_tokens),
            ("POST", "/v1/embeddings", self.embeddings),
            *(("POST", path, self.rerank) for path in ("/v1/rerank", "/rerank", "/v2/rerank")),
            *(("POST", path, self.score) for path in ("/v1/score", "/score")),
            ("POST", "/classify", self.classify),
            ("GET", "/v1/models", self.models),
            ("GET", "/v1/models/{model}", self.model_card),
            ("POST", "/tokenize", self.tokenize),
            ("POST", "/detokenize", self.detokenize),
            ("GET", "/version", self.version),
        ]
        if self.metrics is not None:
            routes.append(("GET", "/metrics", self.prometheus))
        if self.client.ready.max_loras:  # (the engine's VLLM_ALLOW_RUNTIME_LORA_UPDATING)
            routes += [("POST", "/v1/load_lora_adapter", self.load_lora_adapter),
                       ("POST", "/v1/unload_lora_adapter", self.unload_lora_adapter)]
        if env_flag(DEV_MODE_ENV):  # vLLM's dev endpoints
            routes.append(("POST", "/reset_prefix_cache", self.reset_prefix_cache))
        open_paths = {"/health", "/ping", *(["/metrics"] if self.metrics_no_auth else [])}
        for method, path, handler in routes:
            # /health and /ping stay open for load balancers; every other POST but these two takes a JSON body
            json_body = method == "POST" and path not in ("/ping", "/reset_prefix_cache")
            key = path not in open_paths
            guarded = self.auth.guard(handler, key=key, json_body=json_body)
            router.add(method, path, guarded, errors=(anthropic.error_body,) if path.startswith("/v1/messages") else None,
                       refuses=functools.partial(self.auth.refuses, key=key))  # (from the head: its body unread)
            router.add_preflight(path, self.auth.preflight)
        router.shape_prefix("/v1/messages", (anthropic.error_body,))
        return router

    # ------------------------------------------------------------------ plumbing

    @property
    def auth_required(self) -> bool:
        return self.auth.required

    @property
    def max_model_len(self) -> int:
        return self.client.ready.max_model_len

    @property
    def request_timeout(self) -> float | None:
        """The server's ``--request-timeout`` (None: none), for requests without a timeout of their own."""
        return self.client.ready.request_timeout

    @property
    def adapters(self) -> dict[str, str]:
        """The LoRA adapters a request may name as its model, name -> folder (the engine's latest word)."""
        return dict(self.client.ready.loras)

    @property
    def max_chars(self) -> int:
        """Longest text that could still fit the context (see ``TextCodec.max_token_chars``)."""
        return self.max_model_len * self.codec.max_token_chars

    async def _offload(self, size: int, fn, *args):
        """Tokenizer work: a big input on the tokenizer thread, a 429 when that is full."""
        try:
            return await self.codec.run(size, fn, *args)
        except TokenizerBusy as e:
            raise ApiError(429, f"Server busy: {e}", headers=[("retry-after", "1")]) from None

    async def _encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return await self._offload(len(text), self.codec.encode, text, add_special_tokens)

    async def _bad_words(self, data: dict) -> list[list[int]] | None:
        """vLLM's ``bad_words`` as token ids (many of them off the event loop, as any big text)."""
        words = op.parse_bad_words(data)
        if words is None:
            return None
        return await self._offload(2 * sum(map(len, words)), bad_words_token_ids, words,
                                   lambda text: self.codec.encode(text, add_special_tokens=False))

    async def _dry_breakers(self, params: SamplingParams) -> SamplingParams:
        """``params`` with llama.cpp's DRY sequence breakers as token sequences where DRY is on: a scan of the
        vocabulary per breaker, off the event loop and weighed as such in the tokenizer's queue, unless the codec
        has these breakers' already (``TextCodec.dry_breakers``)."""
        if not params.dry_breakers_as_text:
            return params
        key = tuple(params.dry_breakers)
        size = 0 if self.codec.has_dry_breakers(key) else min(len(key) * self.codec.vocab_size // 2,
                                                               self.codec.MAX_QUEUED)
        ids = await self._offload(size, self.codec.dry_breakers, key)
        if len(ids) > MAX_DRY_BREAKER_SEQUENCES:
            raise ApiError(400, f"dry_sequence_breakers become {len(ids)} token sequences in this model's vocabulary, "
                           f"more than {MAX_DRY_BREAKER_SEQUENCES} (a breaker is every token that holds it, and "
                           "every token that ends in its start)", param="dry_sequence_breakers")
        return dataclasses.replace(params, dry_breaker_token_ids=ids)

    async def _chat_template(self, data: dict, messages: list[dict], add_generation_prompt: bool = True,
                             calls: tools.ToolRequest | None = None, continue_final: bool = False) -> list[int]:
        """The prompt: ``messages`` (and the tools) through the chat template, with the request's
        ``chat_template_kwargs``; a template that fails on them is the request's fault (400)."""
        extra = op.parse_template_kwargs(data)
        size = sum(len(m["content"]) for m in messages)
        if calls is not None:  # the tools as the template will print them: they count against the context too
            op.check_text_length(calls.size, self.max_chars, "tools")
            size += calls.size
            op.check_text_length(size, self.max_chars, "messages")
        specials = op.field(data, "add_special_tokens", bool, False)  # (vLLM's: the template writes the BOS)
        try:
            return await self._offload(size, self.codec.apply_chat_template, messages, add_generation_prompt,
                                       calls.tools if calls is not None else None, extra, continue_final, specials)
        except ApiError:
            raise
        except Exception as e:  # noqa: BLE001 - templates raise whatever they like on odd conversations
            raise ApiError(400, f"Cannot apply the chat template: {e}", param="messages") from None

    async def _shown_prompt(self, data: dict) -> list[int]:
        """A chat body's prompt as its template makes it, for counting (/tokenize, count_tokens): its tools are
        shown whatever the tool-call format (none is needed to count them)."""
        messages = op.parse_messages(data, self.max_chars)
        shown = (tools.from_functions(data) or {}).get("tools", data.get("tools"))  # (the deprecated functions too)
        calls = tools.parse_tools({"tools": shown, "tool_choice": "none"}, None)
        add_generation_prompt, continue_final = op.parse_continuation(data, messages)
        count = sum(len(m.get("images", ())) for m in messages)  # (counted, not decoded)
        if count:
            self._check_images(count)
        prompt = await self._chat_template(data, messages, add_generation_prompt, calls, continue_final)
        return self._image_runs(prompt, count)[0]

    async def _stop_matcher(self, stops: list[str]) -> StopMatcher | None:
        """Built once per call for all its choices; a big one off the event loop."""
        if not stops:
            return None
        return await self._offload(sum(map(len, stops)), StopMatcher, stops)

    def _token_names(self, data: dict) -> Callable[[int], str]:
        """How logprobs name a token: its text, or ``token_id:N`` (vLLM's ``return_tokens_as_token_ids``: the
        request's field, else the server's flag), exact where a token is no valid UTF-8 alone."""
        if op.field(data, "return_tokens_as_token_ids", bool, self.tokens_as_ids):
            return lambda t: f"token_id:{t}"
        return self.codec.token_text

    def _new_id(self, prefix: str) -> str:
        if prefix == "resp":  # a stored Response's id is all it takes to read it back: none to guess (OpenAI's too)
            return new_id("resp")
        return f"{prefix}-{self._id_prefix}{next(self._ids):x}"

    def key_of(self, tokens: list[str]) -> int | None:
        """Which API key of ``tokens`` is the caller's (its place among them; None: none, no keys, or none asked
        for: ``client_of`` reads it under ``--fair-client key``, ``place`` where several keys are served)."""
        if self.fair_client != "key" and self.auth.num_keys < 2:
            return None  # (its compares spared: the guard already checked the key)
        return self.auth.key_number(tokens)

    def client_of(self, data: dict, host: str, key: int | None) -> str:
        """Who asks, for ``--scheduling-policy fair`` (``--fair-client``): under ``key``, "key:N" for the N-th
        API key (``key_of``; a caller without one, where no keys are needed, by its address), else
        ``openai_params.client_id``'s address (``host``), or the body's user."""
        client = op.client_id(data, host, self.fair_client == "user")  # (its fields checked in every mode)
        return f"key:{key}" if key is not None and self.fair_client == "key" else client

    def place(self, gen: Generation, data: dict, host: str, key: int | None) -> None:
        """Whose ``gen`` is: its client for the fair policy (``client_of``) and, where several API keys are
        served, its key's own prefix cache: the key's place joins its cache_salt, so that no key's prompts are
        read back through another's cache hits (a tenant's salt was its clients' to choose, and guess)."""
        gen.client_id = self.client_of(data, host, key)
        if key is not None and self.auth.num_keys > 1:
            gen.cache_salt = f"\0{key}\0{gen.cache_salt}"  # (no client's salt can spell another key's)

    def _require_engine(self) -> None:
        if not self.client.accepting:
            raise ApiError(503, "Engine unavailable" if not self.client.healthy else "The engine is shutting down")

    # ------------------------------------------------------------------ small endpoints

    async def health(self, req: Request) -> Response:
        # the stats the liveness pings brought back: a load balancer's probe never waits on the engine
        # data parallel: "degraded" (still 200) while some engine is down, with each engine's state
        # a stalled engine (``EngineClient.stalled``: hung, or in a step far longer than its others): 503
        engines = self.client.engines_health() if hasattr(self.client, "engines_health") else None
        if self.client.accepting and self.client.stalled:
            raise ApiError(503, f"{'The engine has not' if engines is None else 'No engine has'} answered for "
                                f"{self.client.unanswered():.0f}s (hung, or in a step that long)")
        if self.client.accepting:
            s = self.client.last_stats
            body = {"status": "ok"} if s is None else {"status": "ok", **stats_fields(s)}
            if engines is not None:
                if any(e["status"] != "ok" for e in engines):
                    body["status"] = "degraded"
                body["engines"] = engines
            return _json(body)
        if self.client.healthy:
            raise ApiError(503, "The engine is shutting down" if engines is None else "Every engine is shutting down")
        raise ApiError(503, "Engine unavailable" if engines is None else "No engine available")

    async def prometheus(self, req: Request) -> Response:
        return Response(200, self.metrics.render(), content_type=METRICS_CONTENT_TYPE)

    async def version(self, req: Request) -> Response:
        return _json({"version": VERSION})

    def _model_cards(self) -> list[dict]:
        return [{
            "id": name, "object": "model", "created": self.created, "owned_by": "tokenmill",
            "root": self.model, "parent": None, "max_model_len": self.max_model_len,
        } for name in self.model_names] + [{  # as vLLM lists them
            "id": name, "object": "model", "created": self.created, "owned_by": "tokenmill",
            "root": path, "parent": self.model, "max_model_len": self.max_model_len,
        } for name, path in self.adapters.items()]

    async def models(self, req: Request) -> Response:
        return _json({"object": "list", "data": self._model_cards()})

    async def model_card(self, req: Request) -> Response:
        """OpenAI's ``GET /v1/models/{model}`` (the client's ``models.retrieve``): one of ``/v1/models``'s cards, by
        its id percent-encoded ('/' as %2F, as the official clients send it; a bare '/' is read as one too)."""
        name = unquote(req.path.removeprefix("/v1/models/"))
        card = next((c for c in self._model_cards() if c["id"] == name), None)
        if card is None:
            raise ApiError(404, f"The model '{shown(name)}' does not exist", type="not_found_error", param="model",
                           code="model_not_found")
        return _json(card)

    async def load_lora_adapter(self, req: Request) -> Response:
        """vLLM's: ``{"lora_name", "lora_path"}``, a PEFT folder on the engine's machine, into a free slot."""
        data = op.parse_json(req.body)
        name, path = _adapter_name(data), op.field(data, "lora_path", str)
        if name in self.model_names:
            raise ApiError(400, f"'{name}' is a name of the served model: a request could not ask for the model "
                           "alone", param="lora_name")
        await self._update_lora(name, path)
        return Response(200, f"Success: LoRA adapter '{name}' added successfully.".encode(), "text/plain")

    async def unload_lora_adapter(self, req: Request) -> Response:
        """vLLM's: ``{"lora_name"}``; the requests running with it finish with it."""
        name = _adapter_name(op.parse_json(req.body))
        await self._update_lora(name, None)
        return Response(200, f"Success: LoRA adapter '{name}' removed successfully.".encode(), "text/plain")

    async def reset_prefix_cache(self, req: Request) -> Response:
        """vLLM's (with VLLM_SERVER_DEV_MODE=1): every engine it reaches forgets its cached blocks, so that the next
        requests find none (a benchmark's rounds start cold). 200 when all did; 409 where requests hold blocks (the
        idle engines of several did forget theirs). vLLM's ``reset_running_requests=true``, which would preempt
        them first, is refused."""
        flag = parse_qs(req.query, keep_blank_values=True).get("reset_running_requests", ["false"])[-1]
        if flag.strip().lower() in op.QUERY_TRUE:
            raise ApiError(400, "reset_running_requests=true is not supported: the prefix cache is reset when no "
                           "request is running", param="reset_running_requests")
        if flag.strip().lower() not in op.QUERY_FALSE:
            raise ApiError(400, f"reset_running_requests must be a boolean, got {flag!r}",
                           param="reset_running_requests")
        try:
            done = await self.client.reset_prefix_cache()
        except EngineUnavailable as e:
            raise ApiError(503, f"Engine unavailable: {e}") from None
        if not done:
            raise ApiError(409, "the prefix cache was not reset: running requests hold cached blocks (an idle engine "
                           "of several forgot its own); reset it when the engines are idle")
        return Response(200, b"", "text/plain")

    async def _update_lora(self, name: str, path: str | None) -> None:
        try:
            answer = await self.client.update_lora(name, path)
        except EngineUnavailable as e:
            raise ApiError(503, f"Engine unavailable: {e}") from None
        if answer.status != 200:
            raise ApiError(answer.status, answer.message, param=answer.param)

    async def tokenize(self, req: Request) -> Response:
        return _json(await self.tokenized(op.parse_json(req.body)))

    async def tokenized(self, data: dict) -> dict:
        op.check_model(data, self.model_names, self.adapters)
        if "messages" in data:
            tokens = await self._shown_prompt(data)
        else:
            prompt = op.field(data, "prompt", str)
            op.check_text_length(len(prompt), self.max_chars, "prompt")
            tokens = await self._offload(len(prompt), self.codec.encode, prompt,
                                         op.field(data, "add_special_tokens", bool, True))
        out = {"tokens": tokens, "count": len(tokens), "max_model_len": self.max_model_len}
        if op.field(data, "return_token_strs", bool, False):  # vLLM's: each token as the vocabulary spells it
            out["token_strs"] = self.codec.tokenizer.convert_ids_to_tokens(tokens)
        return out

    async def detokenize(self, req: Request) -> Response:
        return _json(await self.detokenized(op.parse_json(req.body)))

    async def detokenized(self, data: dict) -> dict:
        op.check_model(data, self.model_names, self.adapters)
        tokens = op.field(data, "tokens", list)
        if len(tokens) > op.MAX_DETOKENIZE_TOKENS:
            raise ApiError(400, f"At most {op.MAX_DETOKENIZE_TOKENS} tokens per request, got {len(tokens)}",
                           param="tokens")
        op.check_token_ids(tokens, self.codec.vocab_size, "tokens")
        # (its special tokens too, as vLLM's tokenizer.decode; llama.cpp's /detokenize keeps them as well)
        return {"prompt": await self._offload(len(tokens), self.codec.decode, tokens, False)}

    # ------------------------------------------------------------------ completions

    async def invocations(self, req: Request) -> Response | StreamingResponse:
        """SageMaker's one endpoint, as vLLM serves it: the body's fields say which API it is for (the first that
        fits, in vLLM's order)."""
        data = op.parse_json(req.body)
        if "messages" in data:
            return await self._run(req, data, self.chat_job)
        if "prompt" in data:
            return await self._run(req, data, self.completion_job)
        if "input" in data:
            return await self._embed(req, data, embeddings_job, data.get("input"))
        if "text_1" in data:
            return await self._embed(req, data, score_job, data.get("text_1"))
        if "query" in data:
            return await self._embed(req, data, rerank_job, data.get("query"))
        raise ApiError(400, "An /invocations body names its API by its fields: 'messages' (chat completions), "
                       "'prompt' (completions), 'input' (embeddings), 'text_1' and 'text_2' (score), 'query' and "
                       "'documents' (rerank); this one has none of them")

    async def completions(self, req: Request) -> Response | StreamingResponse:
        return await self._run(req, op.parse_json(req.body), self.completion_job)

    async def completion_job(self, data: dict, arrival: float | None = None) -> tuple[Generation, _CompletionFormat]:
        """A /v1/completions body checked and turned into an unstarted generation (also used over WebSocket).

        ``arrival``: ``time.monotonic()`` when the call came in, where its latency metrics start."""
        lora = op.check_model(data, self.model_names, self.adapters)
        deadline, priority = op.parse_deadline(data, self.request_timeout), op.parse_priority(data)
        cache_salt, cache_key = op.parse_cache_salt(data), op.parse_prompt_cache_key(data)
        n = op.parse_n(data)
        suffix = op.field(data, "suffix", str, None)
        echo = op.field(data, "echo", bool, False)
        fim = suffix is not None and (suffix != "" or self.codec.fills_in_the_middle)  # ("": a file's end)
        if fim:  # fill in the middle: the prompt before the gap, the suffix after it
            data = self._fill_in_the_middle(data, echo)
        specials = op.field(data, "add_special_tokens", bool, True)  # (vLLM's: false, no BOS added to a text)
        encode = self._encode_code if fim else functools.partial(self._encode, add_special_tokens=specials)
        prompts = await op.parse_truncated_prompts(data, encode, self.codec, self.max_chars, self.max_model_len,
                                                   empty=fim)
        if fim:
            prompts = await self._fim_prompts(prompts, suffix)
        logprobs = op.field(data, "logprobs", int, None)
        if logprobs is not None and not 0 <= logprobs <= op.MAX_LOGPROBS:
            raise ApiError(400, f"logprobs must be in [0, {op.MAX_LOGPROBS}], got {logprobs}", param="logprobs")
        prompt_logprobs = op.parse_prompt_logprobs(data)
        asked = [k for k in (prompt_logprobs, logprobs if echo else None) if k is not None]  # (echo shows them too)
        max_tokens = op.resolve_max_tokens(data, ("max_tokens",), [len(p) for p in prompts],
                                           self.max_model_len, default=16, cap=self.max_tokens_cap)
        base = op.sampling_params(data, max_tokens=max_tokens, logprobs=logprobs, vocab_size=self.codec.vocab_size,
                                  prompt_logprobs=max(asked) if asked else None,
                                  defaults=self.sampling_defaults, bad_words=await self._bad_words(data))
        base = await self._dry_breakers(base)
        op.check_fan_out(len(prompts), n, base, self.client.ready.max_num_waiting_requests)
        stop = await self._stop_matcher(base.stop)
        self._require_engine()
        beam = beam_search_params(data, base, n, self.client.ready.eos_token_ids)
        api_id = self._new_id("cmpl")
        skip = op.field(data, "skip_special_tokens", bool, True)
        if beam is not None:
            gen = BeamGeneration(self.client, self.codec, api_id, prompts, beam, base, priority, stop, deadline,
                                 cache_salt, self.metrics, arrival, skip_special_tokens=skip)
        else:
            gen = Generation(self.client, self.codec, api_id, prompts, n, self._seeded(base), priority, stop,
                             deadline, cache_salt, self.metrics, arrival, skip_special_tokens=skip)
        gen.schema_param, gen.lora = op.structured_field(data), lora
        gen.stream.affinity = cache_key
        return gen, _CompletionFormat(self, api_id, gen, echo, logprobs, self._token_names(data),
                                      op.field(data, "return_token_ids", bool, False), prompt_logprobs)

    def _fill_in_the_middle(self, data: dict, echo: bool) -> dict:
        """A completion with a ``suffix`` checked: the model must have FIM tokens (``TextCodec.fills_in_the_middle``);
        the body with those that end an infill (``TextCodec.fim_ends``) added to its stop tokens."""
        if not self.codec.fills_in_the_middle:
            raise ApiError(400, f"suffix needs a model with fill-in-the-middle tokens (<|fim_prefix|>, <|fim_suffix|>, "
                           f"<|fim_middle|> or their like), and {self.model} has none", param="suffix")
        if echo:
            raise ApiError(400, "echo is not supported with suffix", param="echo")
        ends = self.codec.fim_ends
        return {**data, "stop_token_ids": [*op.field(data, "stop_token_ids", list, []), *ends]} if ends else data

    async def _encode_code(self, text: str) -> list[int]:
        """Code as text: a special token's name in it stays its characters (as ``/infill`` reads it), no BOS."""
        return await self._offload(len(text), self.codec.encode_literal, text)

    async def _fim_prompts(self, prompts: list[list[int]], suffix: str) -> list[list[int]]:
        """Each prompt before the gap, ``suffix`` after it (``TextCodec.fim_prompt``: llama.cpp's ``/infill`` layout
        without its extra context)."""
        op.check_text_length(len(suffix), self.max_chars, "suffix")
        tail = await self._encode_code(suffix)
        if len(self.codec.fim_prompt([], tail)) >= self.max_model_len:
            raise op.ContextExceeded(400, f"This model's maximum context length is {self.max_model_len} tokens. "
                                     f"However, the suffix has {len(tail)} tokens, leaving no room for the prompt "
                                     "and the completion. Please reduce the length of the suffix.", param="suffix")
        return [self.codec.fim_prompt(p, tail) for p in prompts]

    # ------------------------------------------------------------------ chat

    async def chat_completions(self, req: Request) -> Response | StreamingResponse:
        return await self._run(req, op.parse_json(req.body), self.chat_job)

    async def chat_job(self, data: dict, arrival: float | None = None,
                       id_prefix: str = "chatcmpl") -> tuple[Generation, _ChatFormat]:
        """A /v1/chat/completions body checked and turned into an unstarted generation; with the deprecated
        ``functions``, its refusals name them where they would name the tools they run as."""
        try:
            return await self._chat_job(data, arrival, id_prefix)
        except ApiError as e:
            if data.get("functions") is not None and data.get("tools") is None and data.get("tool_choice") is None:
                raise e.renamed(tools.LEGACY_NAMES) from None
            raise

    async def _chat_job(self, data: dict, arrival: float | None, id_prefix: str) -> tuple[Generation, _ChatFormat]:
        lora = op.check_model(data, self.model_names, self.adapters)
        deadline, priority = op.parse_deadline(data, self.request_timeout), op.parse_priority(data)
        cache_salt, cache_key = op.parse_cache_salt(data), op.parse_prompt_cache_key(data)
        messages = op.parse_messages(data, self.max_chars)
        calls = tools.parse_tools(data, self.tool_format, self.no_tool_format)
        n = op.parse_n(data)
        want_logprobs = op.field(data, "logprobs", bool, False)
        top = op.field(data, "top_logprobs", int, None)
        if top is not None and not 0 <= top <= op.MAX_LOGPROBS:
            raise ApiError(400, f"top_logprobs must be in [0, {op.MAX_LOGPROBS}], got {top}", param="top_logprobs")
        if top and not want_logprobs:
            raise ApiError(400, "top_logprobs needs logprobs set to true", param="top_logprobs")
        add_generation_prompt, continue_final = op.parse_continuation(data, messages)
        if data.get("chat_template") is not None:  # a client's Jinja is not run (vLLM refuses it by default too)
            raise ApiError(400, "chat_template in a request is not accepted: the server's template renders every "
                                "chat (--chat-template sets it)", param="chat_template")
        pixels = await self._pixels([url for m in messages for url in m.get("images", ())])
        shown = await self._chat_template(data, messages, add_generation_prompt, calls, continue_final)
        prompt, offsets = self._image_runs(shown, len(pixels))
        keep = op.parse_truncation(data, self.max_model_len)
        if keep is not None and len(prompt) > keep:
            if offsets:
                raise ApiError(400, "truncate_prompt_tokens cannot cut a prompt with images",
                               param="truncate_prompt_tokens")
            prompt = prompt[-keep:]
        image_inputs = images.inputs(offsets, pixels, self.client.ready.image_tokens)
        max_tokens = op.resolve_max_tokens(data, ("max_completion_tokens", "max_tokens"), [len(prompt)],
                                           self.max_model_len, default=self.sampling_defaults.get("max_tokens"),
                                           cap=self.max_tokens_cap)
        tool_schema = calls.schema() if calls else None
        prompt_logprobs = op.parse_prompt_logprobs(data)
        base = op.sampling_params(data, max_tokens=max_tokens, logprobs=(top or 0) if want_logprobs else None,
                                  prompt_logprobs=prompt_logprobs, vocab_size=self.codec.vocab_size,
                                  tool_schema=tool_schema,
                                  defaults=self.sampling_defaults, bad_words=await self._bad_words(data))
        base = await self._dry_breakers(base)
        if tool_schema is not None and base.stop:  # stop strings could only cut the calls' JSON short
            base = dataclasses.replace(base, stop=[])
        op.check_fan_out(1, n, base, self.client.ready.max_num_waiting_requests)
        stop = await self._stop_matcher(base.stop)
        self._require_engine()
        beam = beam_search_params(data, base, n, self.client.ready.eos_token_ids, forced_tools=tool_schema is not None)
        api_id = self._new_id(id_prefix)
        skip = op.field(data, "skip_special_tokens", bool, True) and not (calls and calls.keeps_special_tokens) \
            and not (self.harmony and not base.structured)  # (harmony's markers are special tokens)
        if beam is not None:
            gen = BeamGeneration(self.client, self.codec, api_id, [prompt], beam, base, priority, stop, deadline,
                                 cache_salt, self.metrics, arrival, skip_special_tokens=skip)
        else:
            gen = Generation(self.client, self.codec, api_id, [prompt], n, self._seeded(base), priority, stop,
                             deadline, cache_salt, self.metrics, arrival, skip_special_tokens=skip)
        gen.schema_param = ("functions" if calls.legacy else "tools") if tool_schema is not None \
            else op.structured_field(data)
        gen.lora = lora
        gen.images = image_inputs
        gen.stream.affinity = cache_key
        # vLLM's echo: an answer that goes on with the last message, an assistant's, begins with it
        echo = messages[-1]["content"] if op.field(data, "echo", bool, False) and messages[-1]["role"] == "assistant" \
            else ""
        return gen, _ChatFormat(self, api_id, gen, want_logprobs, self._answer(data, shown, base, calls),
                                self._token_names(data), op.field(data, "return_token_ids", bool, False),
                                prompt_logprobs, echo)

    def _check_images(self, count: int) -> None:
        """A 400 unless the model reads images and ``count`` of them are allowed in one request."""
        if not isinstance(self.images, ImageProcessor):
            raise ApiError(400, f"{self.model} does not read images" + (f": {self.images}" if self.images else ""),
                           param="messages")
        limit = self.client.ready.max_images
        if count > limit:
            raise ApiError(400, f"at most {limit} images per request, got {count}", param="messages")

    def _image_runs(self, prompt: list[int], count: int) -> tuple[list[int], list[int]]:
        """The templated prompt with its ``count`` images' placeholders (``frontends.images.expand``; where the
        model reads images, also for none: the image token typed in a message is refused)."""
        if not self.client.ready.image_tokens:
            return prompt, []
        try:
            return images.expand(prompt, count, self.client.ready.image_token_id, self.client.ready.image_tokens)
        except images.ImageError as e:
            raise ApiError(400, str(e), param="messages") from None

    async def _pixels(self, urls: list[str]) -> list:
        """The pixels of a chat's images (``frontends.images``), decoded off the event loop when large."""
        if not urls:
            return []
        self._check_images(len(urls))
        try:
            reads = [asyncio.ensure_future(self.media.read(u)) for u in urls]
            try:
                raws = await asyncio.gather(*reads)
            except BaseException:
                for r in reads:  # (those not started yet are dropped; a running fetch ends by its deadline)
                    r.cancel()
                raise
            pictures = [images.open_image(r) for r in raws]  # (headers only: what decoding them will cost)
            return await self._offload(images.cost(pictures, self.images),
                                       lambda: [self.images.pixels(p) for p in pictures])
        except images.ImageError as e:
            raise ApiError(400, str(e), param="messages") from None

    def _answer(self, data: dict, prompt: list[int], base, calls: tools.ToolRequest | None):
        """What makes each choice's ``_Answer`` (None: its text is all content)."""
        include = op.field(data, "include_reasoning", bool, True)
        legacy = calls is not None and calls.legacy
        if self.harmony and not base.structured:
            tail = self.codec.decode(prompt[-32:], skip_special_tokens=False)
            return lambda: _Answer(None, None, include, harmony.HarmonyReader(calls, tail), legacy)
        think = self.thinking and not base.structured  # held output cannot think
        if not (think or calls):
            return None
        opened = think and reasoning.opens_thinking(self.codec.decode(prompt[-8:], skip_special_tokens=False))

        def answer() -> _Answer:
            return _Answer(reasoning.ThinkSplitter(opened) if think else None,
                           calls.reader() if calls is not None else None, include, legacy=legacy)
        return answer

    # ------------------------------------------------------------------ responses

    async def responses(self, req: Request) -> Response | StreamingResponse:
        owner, data = self.auth.owner(Auth.given(req)), op.parse_json(req.body)
        job = functools.partial(self.responses_job, owner=owner)
        if op.field(data, "background", bool, False):
            return await self._background(req, data, job)
        return await self._run(req, data, job)

    async def responses_job(self, data: dict, arrival: float | None = None, owner: str = "") -> tuple[
            Generation, ResponsesFormat]:
        """A /v1/responses body run as the chat it amounts to (``frontends.responses``); ``owner``: whose stored
        Responses it may continue, and whose it is stored as (``Auth.owner``)."""
        refuse_beam_search(data)
        store = op.field(data, "store", bool, True) and self.responses_store is not None
        background = op.field(data, "background", bool, False)
        if background and not store:  # (its state is the store's)
            raise ApiError(400, "a background response is stored: it cannot have store false" if
                           self.responses_store is not None else "background responses need stored state, and this "
                           "server stores none (--responses-store-mib 0)", param="background")
        history, first, conversation, holds = await self._history(data, owner)
        try:  # (a turn that holds its conversation's lock lets go of it where it fails before it runs)
            sources: list[str] = []  # (where each chat message came from, for refusals that name one)
            chat = to_chat(data, sources, history)  # (its refusals name this API's fields already)
            items = stored_items(data["input"]) if store or history is not None else None
            if items is not None:  # (one the chain or conversation holds, or two of the input's own)
                check_unique(items, "input", {i["id"] for i in history or () if isinstance(i.get("id"), str)})
            if items is not None and not self.responses_store.fits(items):
                if conversation is not None or background:
                    raise too_large(self.responses_store, "input")
                store = False  # (too large to keep: the Response says it is not stored)
            if first is not None and chat.get("prompt_cache_key") is None:  # (data parallel: its turns on one engine,
                chat["prompt_cache_key"] = first                              # where their prefix is cached)
            try:
                try:
                    gen, chat_fmt = await self.chat_job(chat, arrival, id_prefix="resp")
                except op.ContextExceeded:
                    if data.get("truncation") != "auto":
                        raise
                    kept = await self._turns_that_fit(chat)
                    if kept is None:
                        raise op.ContextExceeded(400, "truncation 'auto' found no cut that fits: the last turn, the "
                                                 "instructions and system messages, and the output asked for, "
                                                 f"together exceed this model's context of {self.max_model_len} tokens",
                                                 param="input") from None
                    sources = [sources[k] for k in kept]
                    gen, chat_fmt = await self.chat_job({**chat, "messages": [chat["messages"][k] for k in kept]},
                                                        arrival, id_prefix="resp")
            except ApiError as e:  # named as this API names its fields
                raise at_sources(e, sources).renamed(RESPONSES_PARAMS) from None
            if gen.schema_param == "response_format":  # the engine's refusal of a text.format schema
                gen.schema_param = "text"
            keep = Keep(self.responses_store, items, owner, holds) if store or conversation is not None else None
            if keep is not None and not gen.stream.affinity:  # a conversation's first turn: where the next ones go
                gen.stream.affinity = gen.api_id
            return gen, ResponsesFormat(gen.lora or self.model, data, gen, chat_fmt, keep, store, conversation)
        except BaseException as e:
            if holds is not None:
                if isinstance(e, ApiError):
                    await holds.released()
                holds.release()  # (anything else: let go of in a task; nothing left to do once released)
            raise

    async def _history(self, data: dict, owner: str) -> tuple[
            list[dict] | None, str | None, str | None, Hold | None]:
        """The items of the conversation a body continues (``previous_response_id``'s chain, or a stored
        ``conversation``'s), the affinity key of that conversation (data parallel: its first Response's id, or the
        conversation's), the stored conversation's id, and the lock the turn holds on it (OpenAI's
        ``conversation_locked``: one turn at a time). (None, None, None, None: it continues none, or none is stored:
        ``to_chat`` refuses it then.)"""
        previous, conversation = data.get("previous_response_id"), conversation_id(data.get("conversation"))
        if previous is not None and conversation is not None:
            raise ApiError(400, "previous_response_id and conversation cannot both be given: a conversation's "
                           "items already hold its earlier turns", param="conversation")
        if self.responses_store is None or (previous is None and conversation is None):
            return None, None, None, None
        if conversation is not None:
            holds = self.background.hold(conversation)
            try:
                items = await self.responses_store.items(conversation, owner, holds)
            except BaseException as e:
                holds.release()
                if isinstance(e, Locked):
                    raise ApiError(400, "Another process is currently operating on this conversation. Please retry "
                                   "after a few seconds.", param="conversation", code="conversation_locked",
                                   headers=[("retry-after", "1")]) from None
                raise
            if items is None:
                holds.release()
                raise conversation_missing(conversation, "conversation")
            return items, conversation, conversation, holds
        if not isinstance(previous, str) or not previous:
            raise ApiError(400, "'previous_response_id' must be the id of a stored response",
                           param="previous_response_id")
        try:
            found = await self.responses_store.history(previous, owner)
        except StillRunning:
            raise ApiError(400, f"Previous response with id '{shown(previous)}' is still in progress: continue it "
                           "once it has ended", param="previous_response_id") from None
        except BrokenChain as e:
            raise ApiError(400, f"Previous response with id '{shown(previous)}' cannot be continued: {e}",
                           param="previous_response_id", code="previous_response_not_found") from None
        if found is None:  # (OpenAI's words and code: clients that see them send the whole conversation again)
            raise ApiError(400, f"Previous response with id '{shown(previous)}' not found.",
                           param="previous_response_id", code="previous_response_not_found")
        return found[0], found[1], None, None

    async def _turns_that_fit(self, chat: dict) -> list[int] | None:
        """``truncation: "auto"`` (``responses.oldest_turns_dropped``): which of ``chat``'s messages to keep for it to
        fit with the completion it asks for: its ``max_tokens``, else the model's default, else a quarter of the
        context (so that the input does not take all of it), as the server caps it."""
        want = chat.get("max_tokens")
        if not (type(want) is int and want > 0):  # (a bad one is the chat's 400, after)
            want = self.sampling_defaults.get("max_tokens") or self.max_model_len // 4
        if self.max_tokens_cap is not None:
            want = min(want, self.max_tokens_cap)

        async def fits(messages: list[dict]) -> bool:
            try:
                return len(await self._shown_prompt({**chat, "messages": messages})) + want <= self.max_model_len
            except op.ContextExceeded:
                return False

        return await oldest_turns_dropped(chat["messages"], fits)

    # ------------------------------------------------------------------ Anthropic's messages

    async def messages(self, req: Request) -> Response | StreamingResponse:
        return await self._run(req, op.parse_json(req.body), self.messages_job)

    async def messages_job(self, data: dict, arrival: float | None = None) -> tuple[Generation, MessagesFormat]:
        """A /v1/messages body run as the chat it amounts to (``frontends.anthropic``)."""
        try:
            refuse_beam_search(data)
            gen, chat_fmt = await self.chat_job(anthropic.to_chat(data), arrival, id_prefix="msg")
        except ApiError as e:
            raise anthropic.renamed(e) from None
        if gen.schema_param == "response_format":  # the engine's refusal of an output_config schema
            gen.schema_param = "output_config" if data.get("output_config") is not None else "output_format"
        return gen, MessagesFormat(gen.lora or self.model, gen, chat_fmt)

    async def count_tokens(self, req: Request) -> Response:
        """Anthropic's ``/v1/messages/count_tokens``: the prompt a Messages body would make, counted."""
        try:
            data = anthropic.to_chat({**op.parse_json(req.body), "max_tokens": 1})
            op.check_model(data, self.model_names, self.adapters)
            tools.parse_tools(data, self.tool_format, self.no_tool_format)  # (refused as the call would be)
            prompt = await self._shown_prompt(data)
        except ApiError as e:
            raise anthropic.renamed(e) from None
        return _json({"input_tokens": len(prompt)})

    # ------------------------------------------------------------------ embeddings

    async def embeddings(self, req: Request) -> Response:
        data = op.parse_json(req.body)
        return await self._embed(req, data, embeddings_job, data.get("input"))

    async def rerank(self, req: Request) -> Response:
        data = op.parse_json(req.body)
        return await self._embed(req, data, rerank_job, data.get("query"))

    async def score(self, req: Request) -> Response:
        data = op.parse_json(req.body)
        return await self._embed(req, data, score_job, data.get("text_1"))

    async def classify(self, req: Request) -> Response:
        data = op.parse_json(req.body)
        return await self._embed(req, data, classify_job, data.get("input"))

    async def _embed(self, req: Request, data: dict, job, logged) -> Response:
        """Run an embeddings ``job`` (``embeddings_job``, ``rerank_job``, ``score_job``): every vector in,
        then its format's body."""
        started = time.time()
        info = req.meta = CallInfo(prompt=logged)  # access log
        gen, fmt = await job(self, data, req.started)
        req.id, info.gen = gen.api_id, gen
        self.place(gen, data, req.client, self.key_of(Auth.given(req)))
        # a window of the inputs at a time: later calls queue behind that many of them, not all
        gen.start(window=2 * self.client.ready.max_num_seqs)
        try:
            while not gen.done:
                await gen.next_updates()
        finally:
            gen.abort_unfinished()
        if any(c.embedding is None for c in gen.choices):  # only a deadline ends one without its vector
            raise ApiError(408, f"Request timed out after {time.time() - started:.3g} s, before all its "
                           "inputs were read", headers=[("x-should-retry", "false")])
        if len(gen.choices) * len(gen.choices[0].embedding) < EMBEDDINGS_INLINE_BYTES:
            return Response(200, fmt.body())
        # 2048 vectors of 1024 floats are 0.16 s of Python: on a thread, the event loop keeps its streams going
        return Response(200, await asyncio.get_running_loop().run_in_executor(None, fmt.body))

    # ------------------------------------------------------------------ running a generation

    def include_usage(self, data: dict) -> tuple[bool, bool]:
        """``stream_options``: a usage chunk last (``include_usage``, or the server's flag), and with it the usage so
        far in every chunk (vLLM's ``continuous_usage_stats``); a 400 where they are not booleans."""
        opts = op.field(data, "stream_options", dict, {})
        usage = bool(op.field(opts, "include_usage", bool, False)) or self.force_include_usage
        return usage, usage and bool(op.field(opts, "continuous_usage_stats", bool, False))

    @staticmethod
    def _seeded(base):
        """n choices with one seed must differ: choice i gets seed + i (mod 2**64, msgpack's range)."""
        from dataclasses import replace

        if base.seed is None:
            return lambda i: base
        return lambda i: base if i == 0 else replace(base, seed=(base.seed + i) % 2**64)

    async def _background(self, req: Request, data: dict, job) -> Response | StreamingResponse:
        """A background Response (``frontends.background``): checked as any, then answered ``queued`` (or streamed)
        while it runs on."""
        req.meta = CallInfo(prompt=data.get("input"))  # (the access log: the call, not the run it starts)
        gen, fmt = await job(data, req.started)
        req.id = gen.api_id
        self.place(gen, data, req.client, self.key_of(Auth.given(req)))
        return await self.background.start(gen, fmt, fmt.keep, op.field(data, "stream", bool, False))

    async def _run(self, req: Request, data: dict, job) -> Response | StreamingResponse:
        """Check the body with ``job`` (completion_job or chat_job), run it, answer whole or streamed."""
        started = time.time()
        info = req.meta = CallInfo(prompt=data.get("messages", data.get("prompt", data.get("input"))))  # access log
        stream = op.field(data, "stream", bool, False)
        gen, fmt = await job(data, req.started)
        try:
            resp = await self._respond(req, info, data, gen, fmt, stream, started)
        except BaseException as e:
            if isinstance(e, ApiError) and isinstance(fmt, ResponsesFormat) and fmt.keep is not None:
                await fmt.keep.released()  # (the engine's refusal, a 429 or 400; a 408)
            _released(fmt)
            raise
        if not isinstance(resp, StreamingResponse):  # (a stream's: by its on_close, once it has ended)
            _released(fmt)
        return resp

    async def _respond(self, req: Request, info: CallInfo, data: dict, gen: Generation, fmt, stream: bool,
                       started: float) -> Response | StreamingResponse:
        include_usage = False
        if fmt.DONE and not stream and data.get("stream_options") is not None:  # (as vLLM: not for a whole answer)
            raise ApiError(400, "stream_options is only for streamed answers (stream: true)", param="stream_options")
        if stream and fmt.DONE:  # (a Response has its usage in it)
            include_usage, fmt.continuous_usage = self.include_usage(data)
        req.id, info.gen = gen.api_id, gen  # the access log and x-request-id name the call by its own id
        self.place(gen, data, req.client, self.key_of(Auth.given(req)))
        gen.start()
        try:
            first = await gen.next_updates()  # an engine refusal (429, 400) still gets its status
            # the choices share a deadline but may reach it in different steps: hold the headers until
            # a token comes or every choice has ended, so that all-timed-out still gets its 408
            while gen.num_completion_tokens == 0 and not gen.done and gen.any_timed_out:
                first += await gen.next_updates()
        except BaseException:
            gen.abort_unfinished()
            raise
        if gen.timed_out_empty:  # a stream that has nothing to send yet can still get a status
            raise _timed_out(started)
        if stream:
            def closed() -> None:
                gen.abort_unfinished()
                _released(fmt)

            return StreamingResponse(self._events(gen, fmt, first, include_usage), on_close=closed,
                                     content_type=getattr(fmt, "CONTENT_TYPE", "text/event-stream"))
        try:
            updates = first
            while True:
                fmt.collect(updates)
                if gen.done:
                    break
                updates = await gen.next_updates()
        finally:
            gen.abort_unfinished()
        if gen.timed_out_empty:
            raise _timed_out(started)
        resp = _json(fmt.response())
        await _kept(fmt)
        if hasattr(fmt, "headers"):  # (TGI's numbers about the answer)
            resp.headers += fmt.headers()
        return resp

    async def _events(self, gen: Generation, fmt, first: list[Update], include_usage: bool) -> AsyncIterator[bytes]:
        try:
            head = fmt.stream_head()
            body = fmt.chunk(first)
            await _kept(fmt)
            yield head + body if head else body
            while not gen.done:
                try:
                    updates = await gen.next_updates()
                except ApiError as e:
                    yield fmt.stream_error(e)
                    return
                chunk = fmt.chunk(updates)
                await _kept(fmt)
                if chunk:
                    yield chunk
            tail = _sse(fmt.usage_chunk()) if include_usage else b""
            yield tail + fmt.DONE
        finally:
            gen.abort_unfinished()


# ----------------------------------------------------------------------------- response shapes


class _SseFormat:
    """What completion and chat bodies share: their stream's last line, its error event, the usage chunk,
    vLLM's token fields (``return_token_ids``: ``prompt_token_ids`` and ``token_ids``; ``prompt_logprobs``)."""

    DONE = _DONE  # the stream's last line
    token_name: Callable[[int], str]
    gen: Generation
    return_token_ids = False
    prompt_logprobs: int | None = None
    continuous_usage = False  # every chunk carries the usage so far (``continuous_usage_stats``)

    def event(self, body: dict, head: bool = False) -> bytes:
        """A chunk of the stream; with continuous usage, the usage so far (in the ``head``, none generated yet, as
        vLLM counts its role chunk)."""
        if not self.continuous_usage:
            return _sse(body)
        g = self.gen
        return _sse(body | {"usage": usage_dict(g.num_prompt_tokens, 0 if head else g.num_completion_tokens,
                                                g.num_cached_tokens)})

    def prompt_lp(self, choice) -> list | None:
        """vLLM's ``prompt_logprobs`` of a choice's prompt: per token (the first None) ``{"id": {"logprob",
        "rank", "decoded_token"}}``, the prompt token's first, then the top k's (None: not asked for)."""
        k, entries = self.prompt_logprobs, choice.prompt_logprobs
        if k is None or entries is None:
            return None
        name, out = self.token_name, []
        for tid, e in zip(choice.prompt_ids, entries, strict=False):
            if e is None:
                out.append(None)
                continue
            d = {str(tid): {"logprob": e[0], "rank": e[2], "decoded_token": name(tid)}}
            for rank, (t, v) in enumerate(e[1][:k], 1):
                d.setdefault(str(t), {"logprob": v, "rank": rank, "decoded_token": name(t)})
            out.append(d)
        return out

    def prompt_fields(self, c) -> dict:
        """Of choice ``c``'s prompt, the fields the request asked for (``prompt_token_ids``, ``prompt_logprobs``)."""
        return ({"prompt_token_ids": c.prompt_ids} if self.return_token_ids else {}) | (
            {"prompt_logprobs": self.prompt_lp(c)} if self.prompt_logprobs is not None else {})

    def stream_error(self, e: ApiError) -> bytes:
        """An error once the stream has begun: an error event that ends it, as in vLLM."""
        return _sse({"error": {"message": e.message, "type": e.type, "param": e.param,
                               "code": e.code_or_status}}) + _DONE

    def usage_chunk(self) -> dict:
        return {**self.base, "choices": [], "usage": self.gen.usage()}


class _CompletionFormat(_SseFormat):
    """/v1/completions bodies: text choices, legacy logprobs."""

    def __init__(self, api: OpenAIApi, api_id: str, gen: Generation, echo: bool, logprobs: int | None,
                 token_name: Callable[[int], str] | None = None, return_token_ids: bool = False,
                 prompt_logprobs: int | None = None) -> None:
        """``logprobs``: the top logprobs shown per token (None: no logprobs)."""
        self.codec = api.codec
        self.token_name = token_name or api.codec.token_text  # what logprobs call a token
        self.gen = gen
        self.echo = echo
        self.logprobs = logprobs is not None
        self.top = logprobs or 0
        self.return_token_ids, self.prompt_logprobs = return_token_ids, prompt_logprobs
        self.ids: list[list[int]] = [[] for _ in gen.choices]
        # streaming: the prompt's fields (where asked for) go with a choice's first chunk
        self.headed = [not (return_token_ids or prompt_logprobs is not None)] * len(gen.choices)
        self.base = {"id": api_id, "object": "text_completion", "created": int(time.time()),
                     "model": gen.lora or api.model}
        self.texts = [""] * len(gen.choices)
        self.lps: list[dict | None] = [None] * len(gen.choices)
        self.prompt_texts: list[str] = []
        self.echoed = [not echo] * len(gen.choices)  # streaming: the echo goes out with a choice's first update
        if echo:
            decoded, lengths = {}, {}  # (once per prompt, its choices sharing it)
            for c in gen.choices:
                key = id(c.prompt_ids)
                if key not in decoded:  # (an unfinished character at its end is the output's: IncrementalDetokenizer)
                    decoded[key] = without_broken_end(self.codec.decode(c.prompt_ids, gen.skip_special_tokens))
                    # completion offsets count the echoed prompt, as its own do (token by token: a byte token is one)
                    lengths[key] = sum(map(len, map(self.codec.token_text, c.prompt_ids))) if self.logprobs else 0
                self.prompt_texts.append(decoded[key])
                c.detok.echoed()
                c.text_offset = lengths[key]

    def echo_of(self, choice) -> tuple[str, dict | None]:
        """The echoed prompt of one choice, with its prompt logprobs (offsets from 0).

        The engine sends prompt logprobs with a request's first delta: call this once
        that has arrived (a streamed echo waits for the choice's first update)."""
        lp = None
        if self.logprobs:
            plp = choice.prompt_logprobs or [None] * len(choice.prompt_ids)
            entries = [(t, e[0] if e else None, e[1][:self.top] if e else None)
                       for t, e in zip(choice.prompt_ids, plp, strict=False)]
            lp, _ = self._legacy(entries, 0)
        return self.prompt_texts[choice.index], lp

    def _legacy(self, entries: list[LogprobEntry], offset: int) -> tuple[dict, int]:
        token_text, name = self.codec.token_text, self.token_name
        tokens, token_lps, tops, offsets = [], [], [], []
        for tid, lp, top in entries:
            tokens.append(name(tid))
            token_lps.append(lp)
            # k alternatives and the sampled token, where it is not among them (OpenAI's "up to logprobs+1", as vLLM);
            # where another token has its name, the sampled one's value is the one shown
            tops.append({name(t): v for t, v in top} | {name(tid): lp} if top is not None else None)
            offsets.append(offset)
            offset += len(token_text(tid))  # (offsets into the text, whatever the tokens are called)
        return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}, offset

    def _choice_lp(self, up: Update) -> dict | None:
        if not self.logprobs:
            return None
        lp, up.choice.text_offset = self._legacy(up.logprobs or [], up.choice.text_offset)
        return lp

    @staticmethod
    def _merge(a: dict | None, b: dict | None) -> dict | None:
        if a is None or b is None:
            return a or b
        return {k: a[k] + b[k] for k in a}

    def stream_head(self) -> bytes:
        return b""

    def chunk(self, updates: list[Update]) -> bytes:
        choices = []
        for up in updates:
            i = up.choice.index
            if not (up.text or up.finished or up.logprobs or not self.echoed[i] or not self.headed[i]
                    or (self.return_token_ids and up.token_ids)):
                continue
            text, lp = up.text, self._choice_lp(up)
            if not self.echoed[i]:
                self.echoed[i] = True
                ptext, plp = self.echo_of(up.choice)
                text, lp = ptext + text, self._merge(plp, lp)
            choice = {"index": i, "text": text, "logprobs": lp,
                      "finish_reason": up.choice.finish_reason if up.finished else None,
                      "stop_reason": up.choice.stop_reason if up.finished else None}
            if not self.headed[i]:
                self.headed[i] = True
                choice |= self.prompt_fields(up.choice)
            if self.return_token_ids:
                choice["token_ids"] = up.token_ids
            choices.append(choice)
        return self.event({**self.base, "choices": choices}) if choices else b""

    def delta_logprobs(self, up: Update) -> dict | None:
        """One update's logprobs in this endpoint's shape (None when not asked for)."""
        return self._choice_lp(up)

    def collect(self, updates: list[Update]) -> None:
        for up in updates:
            i = up.choice.index
            self.texts[i] += up.text
            self.ids[i] += up.token_ids
            if self.logprobs:
                self.lps[i] = self._merge(self.lps[i], self._choice_lp(up))

    def response(self) -> dict:
        choices = []
        for c in self.gen.choices:
            text, lp = self.texts[c.index], self.lps[c.index]
            if self.logprobs and lp is None:
                lp = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
            if self.echo:
                ptext, plp = self.echo_of(c)
                text, lp = ptext + text, self._merge(plp, lp)
            choices.append({"index": c.index, "text": text, "logprobs": lp, "finish_reason": c.finish_reason,
                            "stop_reason": c.stop_reason, **self.prompt_fields(c),
                            **({"token_ids": self.ids[c.index]} if self.return_token_ids else {})})
        return {**self.base, "choices": choices, "usage": self.gen.usage()}


class _Answer:
    """One choice's text as an assistant message, as it streams: thinking split off into
    ``reasoning_content`` (``frontends.reasoning``), tool calls read out (``frontends.tools``); or both
    read out of GPT-OSS's harmony messages (``frontends.harmony``)."""

    def __init__(self, think: reasoning.ThinkSplitter | None, calls: tools.CallReader | None,
                 include_reasoning: bool, harmony_reader: harmony.HarmonyReader | None = None,
                 legacy: bool = False) -> None:
        self.think, self.calls, self.include_reasoning = think, calls, include_reasoning
        self.harmony = harmony_reader
        self.legacy = legacy  # the call is a function_call (the deprecated functions): one, without an id
        self._reader = calls if calls is not None else harmony_reader  # what reads the answer's tool calls
        self.reasoning = self.content = ""

    @property
    def thinking(self) -> bool:
        """Whether the answer stands inside its thinking (what comes next is reasoning, or its end)."""
        if self.harmony is not None:
            return self.harmony.thinking
        return self.think is not None and self.think.state == "think"

    @property
    def thinking_end(self) -> str:
        """The marker that ends the thinking: harmony's analysis message's end, or ``</think>``."""
        return harmony.END if self.harmony is not None else reasoning.CLOSE

    def parts(self, text: str, finished: bool) -> list[tuple[str, Any]]:
        """What of ``text`` (and, once ``finished``, of what was held back) can be sent now, in the
        order the model wrote it: ("reasoning", text), ("text", content), ("call", a tool-call delta)."""
        if self.harmony is not None:
            out = self.harmony.feed(text) + (self.harmony.finish() if finished else [])
            self.reasoning += "".join(v for k, v in out if k == "reasoning")
            self.content += "".join(v for k, v in out if k == "text")
            return [p for p in out if p[0] != "reasoning" or self.include_reasoning]
        thought, content = "", text
        if self.think is not None:
            thought, content = self.think.feed(text)
            if finished:
                more = self.think.finish()
                thought, content = thought + more[0], content + more[1]
        out: list[tuple[str, Any]] = [("reasoning", thought)] if thought and self.include_reasoning else []
        self.reasoning += thought
        if self.calls is None:
            out += [("text", content)] if content else []
        else:
            out += self.calls.feed(content) + (self.calls.finish() if finished else [])
        self.content += "".join(v for k, v in out if k == "text")
        return out

    def delta(self, text: str, finished: bool) -> dict:
        """``parts`` as a chat delta."""
        parts = self.parts(text, finished)
        joined = {k: "".join(v for kind, v in parts if kind == k) for k in ("reasoning", "text")}
        calls = [v for k, v in parts if k == "call"]
        return (({"reasoning_content": joined["reasoning"]} if joined["reasoning"] else {})
                | ({"content": joined["text"]} if joined["text"] else {}) | (self._calls(calls) if calls else {}))

    def message(self) -> dict:
        msg: dict = {"role": "assistant", "content": self.content}
        if self.reasoning and self.include_reasoning:
            msg["reasoning_content"] = self.reasoning
        if self._reader is not None and self._reader.calls:
            msg |= {"content": self.content or None, **self._calls(self._reader.calls)}
        return msg

    def _calls(self, calls: list[dict]) -> dict:
        """Calls (or their deltas) as the message's field: ``tool_calls``, or the deprecated ``function_call``."""
        return {"function_call": _function_call(calls)} if self.legacy else {"tool_calls": calls}

    def finish_reason(self, reason: str | None) -> str | None:
        """"tool_calls" ("function_call") for an answer that called tools and ended of itself (a named function:
        "stop")."""
        reader = self._reader
        if reader is not None and reader.calls and reason == "stop" and reader.mode != "named":
            return "function_call" if self.legacy else "tool_calls"
        return reason


def _function_call(calls: list[dict]) -> dict:
    """Tool-call deltas (of one call: the deprecated functions make one) as a ``function_call`` delta: its name
    where one has it, its arguments joined."""
    fns = [c["function"] for c in calls]
    name = next((f["name"] for f in fns if "name" in f), None)
    return ({"name": name} if name is not None else {}) | {"arguments": "".join(f.get("arguments", "") for f in fns)}


class _ChatFormat(_SseFormat):
    """/v1/chat/completions bodies: messages and deltas, chat logprobs."""

    def __init__(self, api: OpenAIApi, api_id: str, gen: Generation, logprobs: bool,
                 answer: Callable[[], _Answer] | None = None, token_name: Callable[[int], str] | None = None,
                 return_token_ids: bool = False, prompt_logprobs: int | None = None, echo: str = "") -> None:
        self.codec = api.codec
        self.echo_text = echo  # what each choice's content begins with (vLLM's echo of the last message)
        self.token_name = token_name or api.codec.token_text  # what logprobs call a token
        self.gen = gen
        self.logprobs = logprobs
        self.return_token_ids, self.prompt_logprobs = return_token_ids, prompt_logprobs
        self.ids: list[list[int]] = [[] for _ in gen.choices]
        self.base = {"id": api_id, "object": "chat.completion.chunk", "created": int(time.time()),
                     "model": gen.lora or api.model}
        self.texts = [""] * len(gen.choices)
        self.lps: list[list] = [[] for _ in gen.choices]
        # with tools or thinking, each choice's text goes through its own _Answer
        self.answers = [answer() for _ in gen.choices] if answer is not None else None

    def _chat_lp(self, entries: list[LogprobEntry] | None) -> list[dict]:
        utf8, name = self.codec.token_utf8, self.token_name
        out = []
        for tid, lp, top in entries or ():
            out.append({"token": name(tid), "logprob": lp, "bytes": utf8(tid),
                        "top_logprobs": [{"token": name(i), "logprob": v, "bytes": utf8(i)} for i, v in (top or ())]})
        return out

    def _prompt_fields(self) -> dict:
        """The prompt's fields, once per call (the prompt is every choice's; any that has its logprobs)."""
        return self.prompt_fields(next((c for c in self.gen.choices if c.prompt_logprobs is not None),
                                       self.gen.choices[0]))

    def stream_head(self) -> bytes:
        return self.event({**self.base, **self._prompt_fields(), "choices": [
            {"index": c.index, "delta": {"role": "assistant", "content": self.echo_text}, "logprobs": None,
             "finish_reason": None} for c in self.gen.choices]}, head=True)

    def chunk(self, updates: list[Update]) -> bytes:
        choices = []
        for up in updates:
            ids = self.return_token_ids and up.token_ids
            if not (up.text or up.finished or up.logprobs or ids):
                continue
            delta: dict = {"content": up.text} if up.text else {}
            if self.answers is not None:
                delta = self.answers[up.choice.index].delta(up.text, up.finished)
                if not (delta or up.finished or self.logprobs or ids):
                    continue  # text held back: it may be a tag or a call
            choice = {"index": up.choice.index, "delta": delta,
                      "logprobs": {"content": self._chat_lp(up.logprobs)} if self.logprobs else None,
                      "finish_reason": self.finish_reason(up.choice) if up.finished else None,
                      "stop_reason": up.choice.stop_reason if up.finished else None}
            if self.return_token_ids:
                choice["token_ids"] = up.token_ids
            choices.append(choice)
        return self.event({**self.base, "choices": choices}) if choices else b""

    def finish_reason(self, choice) -> str | None:
        if self.answers is None:
            return choice.finish_reason
        return self.answers[choice.index].finish_reason(choice.finish_reason)

    def delta_logprobs(self, up: Update) -> list[dict] | None:
        return self._chat_lp(up.logprobs) if self.logprobs else None

    def collect(self, updates: list[Update]) -> None:
        for up in updates:
            self.texts[up.choice.index] += up.text
            self.ids[up.choice.index] += up.token_ids
            if self.logprobs:
                self.lps[up.choice.index] += self._chat_lp(up.logprobs)

    def response(self) -> dict:
        return {**self.base, "object": "chat.completion", **self._prompt_fields(), "choices": [
            {"index": c.index, "message": self._message(c.index),
             "logprobs": {"content": self.lps[c.index]} if self.logprobs else None,
             "finish_reason": self.finish_reason(c), "stop_reason": c.stop_reason,
             **({"token_ids": self.ids[c.index]} if self.return_token_ids else {})}
            for c in self.gen.choices], "usage": self.gen.usage()}

    def _message(self, index: int) -> dict:
        if self.answers is None:
            return self.echoed({"role": "assistant", "content": self.texts[index]})
        answer = self.answers[index]
        answer.parts(self.texts[index], True)
        return self.echoed(answer.message())

    def echoed(self, msg: dict) -> dict:
        """An answer's message, its content after the echo (where the request asked for one)."""
        return msg | {"content": self.echo_text + (msg["content"] or "")} if self.echo_text else msg
