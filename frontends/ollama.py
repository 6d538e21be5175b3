"""Ollama's own API: ``POST /api/generate``, ``/api/chat``, ``/api/embed`` (and the older ``/api/embeddings``),
``/api/show``; ``GET /api/tags``, ``/api/ps``, ``/api/version``.

So that what is written for Ollama (its Python and JavaScript clients, Open WebUI, Continue, LangChain's
``ChatOllama``, editors' and notes apps' plugins) talks to tokenmill. A chat runs as a ``/v1/chat/completions``
body does (the same template, tools, thinking, structured output); ``/api/generate`` as a chat of one user
message (``system`` before it), or with ``raw`` as a completion of the prompt as it is, or with ``suffix`` as
llama.cpp's ``/infill`` (``frontends.llamacpp``). ``OllamaFormat`` writes Ollama's answers: one object, or
streamed (the default) as newline-delimited JSON (``application/x-ndjson``), a line per update and a last one
with ``done``, ``done_reason`` ("stop" | "length"; "timeout" when the request's ``timeout`` passed) and the
durations in nanoseconds; with ``logprobs`` (``top_logprobs``), each token's as Ollama writes them.

``options`` are llama.cpp's names, read as the llama.cpp endpoints read them (``num_predict``, ``temperature``,
``top_k``, ``top_p``, ``min_p``, ``typical_p``, ``repeat_penalty`` over ``repeat_last_n``, the penalties,
``seed``, ``stop``, mirostat); what sets up the server (``num_ctx``, ``num_gpu``, ``num_thread``...) is taken
and not read: the model is loaded once, at start, with the server's flags. tokenmill's own fields (``EXTRAS``:
``priority``, ``timeout``, ``ignore_eos``...) are taken beside Ollama's. Errors: ``{"error": message}``.
"""

from __future__ import annotations

import datetime
import functools
import hashlib
import json
import os
import re
import struct
import time
from typing import Any

import orjson

from engine.protocol import SamplingParamError, embedding_floats
from frontends import openai_params as op
from frontends.embeddings import embeddings_job
from frontends.errors import ApiError
from frontends.generation import Generation, Update
from frontends.http import Request, Response
from frontends.openai_api import VERSION, OpenAIApi
from frontends.text import TextCodec

# Ollama's options as llama.cpp's names, with their types ("float32": a number)
_OPTION_TYPES = {"num_predict": "integer", "temperature": "float32", "top_k": "integer", "top_p": "float32",
                 "min_p": "float32", "typical_p": "float32", "repeat_last_n": "integer", "repeat_penalty": "float32",
                 "presence_penalty": "float32", "frequency_penalty": "float32", "seed": "integer", "stop": "array",
                 "mirostat": "integer", "mirostat_tau": "float32", "mirostat_eta": "float32", "num_keep": "integer",
                 "num_ctx": "integer", "num_batch": "integer", "num_gpu": "integer", "main_gpu": "integer",
                 "num_thread": "integer", "use_mmap": "boolean", "penalize_newline": "boolean",
                 "tfs_z": "float32", "numa": "boolean", "low_vram": "boolean", "f16_kv": "boolean",
                 "logits_all": "boolean", "vocab_only": "boolean", "use_mlock": "boolean"}
_PY_TYPES = {"integer": (int, float), "float32": (int, float), "boolean": bool, "array": list}
_DURATION = re.compile(r"[+-]?(0|((\d+(\.\d*)?|\.\d+)(ns|us|\u00b5s|\u03bcs|ms|s|m|h))+)")  # (Go's time.ParseDuration)
# the options a completion reads, under its names; the others are the server's (taken, not read)
_READ = {"temperature": "temperature", "top_k": "top_k", "top_p": "top_p", "min_p": "min_p", "typical_p": "typical_p",
         "repeat_last_n": "repeat_last_n", "repeat_penalty": "repetition_penalty",
         "presence_penalty": "presence_penalty", "frequency_penalty": "frequency_penalty",
         "mirostat": "mirostat", "mirostat_tau": "mirostat_tau", "mirostat_eta": "mirostat_eta"}
_GGUF_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}  # a GGUF value type's bytes


@functools.lru_cache(maxsize=4)
def gguf_architecture(path: str) -> str:
    """A GGUF file's ``general.architecture`` (llama.cpp writes it first), read off its header alone ("" where
    it is not among the first keys, or the file no GGUF): a whole header takes seconds (the vocabulary is in it)."""
    try:
        with open(path, "rb") as f:
            magic, _, _, count = struct.unpack("<4sIQQ", f.read(24))
            if magic != b"GGUF":
                return ""
            for _ in range(min(count, 64)):
                key = f.read(struct.unpack("<Q", f.read(8))[0])
                kind = struct.unpack("<I", f.read(4))[0]
                if kind == 8:
                    value = f.read(struct.unpack("<Q", f.read(8))[0])
                    if key == b"general.architecture":
                        return value.decode("utf-8", "replace")
                elif kind in _GGUF_SIZES:
                    f.seek(_GGUF_SIZES[kind], 1)
                else:
                    return ""  # (an array, before it: past what this reads)
    except (OSError, struct.error, OverflowError, MemoryError):
        pass
    return ""


_NAMES = {"max_tokens": "num_predict", "repetition_penalty": "repeat_penalty", "response_format": "format",
          "n_predict": "num_predict", "repeat_penalty": "repeat_penalty"}


def error_body(e: ApiError) -> dict:
    return {"error": e.message}


def _shown(data: dict) -> Any:
    """The model as the request named it (``model``, or the older ``name``)."""
    return data.get("model", data.get("name"))


def keep_alive(data: dict) -> None:
    """``keep_alive`` checked as Ollama reads it (seconds, or a Go duration: "5m"); taken, not read: the model
    stays loaded while the server runs."""
    v = data.get("keep_alive")
    if v is None or (isinstance(v, int | float) and not isinstance(v, bool)):
        return
    if not isinstance(v, str):
        raise ApiError(400, f"Unsupported type: '{type(v).__name__}'", param="keep_alive")
    if not _DURATION.fullmatch(v):
        raise ApiError(400, f'time: invalid duration "{v}"', param="keep_alive")


def _now() -> str:
    """Ollama's ``created_at``: RFC 3339 in UTC, to the microsecond."""
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def options(data: dict) -> dict:
    """``options`` as completion fields (checked as Ollama checks them; the server's own taken and not read)."""
    opts = data.get("options")
    if opts is None:
        return {}
    if not isinstance(opts, dict):
        raise ApiError(400, "options must be an object", param="options")
    out: dict[str, Any] = {}
    for name, value in opts.items():
        kind = _OPTION_TYPES.get(name)
        if kind is None or value is None:  # (Ollama: an unknown option is logged and ignored)
            continue
        if not isinstance(value, _PY_TYPES[kind]) or (kind != "boolean" and isinstance(value, bool)) or (
                kind == "integer" and not -2**63 <= value < 2**63):  # (Go's int)
            raise ApiError(400, f"option {name!r} must be of type {kind}".replace("'", '"'), param="options")
        if name == "stop":
            if not all(isinstance(s, str) for s in value):
                raise ApiError(400, 'option "stop" must be of an array of strings', param="options")
            if not all(value):  # (the chat's refusal would name "stop", a field Ollama has not)
                raise ApiError(400, 'option "stop" must not hold an empty string', param="options")
            out["stop"] = value
        elif name == "num_predict":
            if int(value) > 0:  # (0 and below: to the end of the context)
                out["max_tokens"] = int(value)
        elif name == "seed":
            if int(value) >= 0:  # (-1: a random one)
                out["seed"] = int(value)
        elif name in _READ:
            out[_READ[name]] = int(value) if kind == "integer" else value
    if out.get("top_k", 0) < 0:
        out["top_k"] = 0
    return out


def response_format(fmt: Any) -> dict | None:
    """``format``: "json" (any JSON), a JSON schema, or nothing."""
    if fmt is None or fmt == "":
        return None
    if fmt == "json":
        return {"type": "json_object"}
    if isinstance(fmt, dict):
        return {"type": "json_schema", "json_schema": {"name": "format", "schema": fmt}}
    raise ApiError(400, f'invalid format: {json.dumps(fmt)}; expected "json" or a valid JSON Schema object',
                   param="format")


def _images(value: Any) -> list[str]:
    if value is None:
        return []
    if not isinstance(value, list) or not all(isinstance(x, str) for x in value):
        raise ApiError(400, "images must be a list of base64 strings", param="images")
    return value


def _image_parts(text: str, images: list[str]) -> str | list[dict]:
    """A user's text with its images (base64, as Ollama sends them) as chat content."""
    if not images:
        return text
    return [{"type": "text", "text": text}, *({"type": "image_url", "image_url": {
        "url": img if img.startswith("data:") else f"data:image/png;base64,{img}"}} for img in images)]


def _think(data: dict, chat: dict) -> None:
    """``think`` (true, false, "low" | "medium" | "high"): the template's ``enable_thinking``."""
    think = data.get("think")
    if think is None:
        return
    if isinstance(think, str) and think not in ("high", "medium", "low", "max"):
        raise ApiError(400, f'invalid think value: "{think}" (must be "high", "medium", "low", "max", true, or false)',
                       param="think")
    if not isinstance(think, bool | str):
        raise ApiError(400, 'think must be a boolean or string ("high", "medium", "low", "max", true, or false)',
                       param="think")
    chat["chat_template_kwargs"] = {"enable_thinking": think is not False,
                                    **({"reasoning_effort": think} if isinstance(think, str) else {})}


# tokenmill's own fields, taken beside Ollama's as they are (the OpenAI endpoints' extras)
EXTRAS = ("ignore_eos", "min_tokens", "priority", "timeout", "cache_salt")


def to_chat(data: dict, messages: list[dict]) -> dict:
    chat: dict[str, Any] = {"messages": messages, **options(data), **_extras(data)}
    top = top_logprobs(data)
    if top is not None:
        chat |= {"logprobs": True, "top_logprobs": top}
    fmt = response_format(data.get("format"))
    if fmt is not None:
        chat["response_format"] = fmt
    _think(data, chat)
    return chat


def _extras(data: dict) -> dict:
    return {k: data[k] for k in EXTRAS if data.get(k) is not None}


def top_logprobs(data: dict) -> int | None:
    """Ollama's ``logprobs`` (each output token's) and ``top_logprobs`` (0 to 20 likeliest at each): how many
    alternatives a token comes with, or None where none were asked for (``top_logprobs`` alone asks nothing)."""
    top = op.field(data, "top_logprobs", int, 0)
    if not 0 <= top <= 20:
        raise ApiError(400, f"top_logprobs must be between 0 and 20, got {top}", param="top_logprobs")
    return top if op.field(data, "logprobs", bool, False) else None


def chat_messages(data: dict) -> list[dict]:
    """Ollama's messages as the chat's: images beside a user's text, tool calls' arguments as JSON text."""
    messages = data.get("messages")
    if not isinstance(messages, list):
        raise ApiError(400, "messages must be a list", param="messages")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise ApiError(400, f"messages[{i}] must be an object with a role", param="messages")
        role, content = m["role"].lower(), m.get("content")
        content = "" if content is None else content
        if not isinstance(content, str):
            raise ApiError(400, f"messages[{i}].content must be a string", param="messages")
        if not isinstance(m.get("thinking", ""), str | None):
            raise ApiError(400, f"messages[{i}].thinking must be a string", param="messages")
        msg: dict[str, Any] = {"role": role, "content": _image_parts(content, _images(m.get("images")))}
        calls = m.get("tool_calls")
        if calls:
            if not isinstance(calls, list) or not all(
                    isinstance(c, dict) and isinstance(c.get("function"), dict)
                    and isinstance(c["function"].get("arguments", {}), dict | None) for c in calls):
                raise ApiError(400, f"messages[{i}].tool_calls must be a list of {{\"function\": {{\"name\", "
                               "\"arguments\": {...}}}", param="messages")
            msg["tool_calls"] = [{"id": c.get("id") or f"call_{i}_{j}", "type": "function", "function": {
                "name": c["function"].get("name"), "arguments": json.dumps(c["function"].get("arguments") or {})}}
                for j, c in enumerate(calls)]
        if role == "tool":
            msg["tool_call_id"] = m.get("tool_call_id") or m.get("tool_name") or ""
            if m.get("tool_name"):
                msg["name"] = m["tool_name"]
        if m.get("thinking") and role == "assistant":
            msg["reasoning_content"] = m["thinking"]
        out.append(msg)
    return out


class OllamaApi:
    """Ollama's routes beside the OpenAI ones, run through ``OpenAIApi``'s chats and completions."""

    def __init__(self, api: OpenAIApi, llamacpp, model_path: str = "") -> None:
        self.api, self.llamacpp, self.model_path = api, llamacpp, model_path

    def routes(self, router) -> None:
        auth = self.api.auth
        for method, path, handler in (("POST", "/api/generate", self.generate), ("POST", "/api/chat", self.chat),
                                      ("POST", "/api/embed", self.embed), ("POST", "/api/embeddings", self.embed),
                                      ("POST", "/api/show", self.show), ("GET", "/api/tags", self.tags),
                                      ("GET", "/api/ps", self.ps), ("GET", "/api/version", self.version)):
            router.add(method, path, auth.guard(handler, json_body=method == "POST"), errors=(error_body,),
                       refuses=auth.refuses)
            router.add_preflight(path, auth.preflight)
        router.shape_prefix("/api/", (error_body,))

    # ------------------------------------------------------------------ models

    def _model(self, data: dict) -> str:
        """The request's ``model`` (a served name or an adapter's; ``:latest`` as Ollama tags it), or the refusal."""
        name = data.get("model", data.get("name"))
        if not isinstance(name, str) or not name.strip():
            raise ApiError(400, "model is required", param="model")
        base = name.removesuffix(":latest")
        if base not in self.api.model_names and base not in self.api.adapters:
            raise ApiError(404, f"model '{name}' not found", param="model")
        return base

    def _files(self) -> list[str]:
        path = self.model_path
        if os.path.isfile(path):
            return [path]
        if os.path.isdir(path):
            return [os.path.join(path, f) for f in os.listdir(path) if f.endswith((".safetensors", ".gguf", ".bin"))]
        return []

    def _entry(self, name: str) -> dict:
        files = self._files()
        size = sum(os.path.getsize(f) for f in files)
        mtime = max((os.path.getmtime(f) for f in files), default=0.0)
        digest = hashlib.sha256(f"{name}\0{self.model_path}\0{size}\0{mtime}".encode()).hexdigest()
        return {"name": name, "model": name, "modified_at": datetime.datetime.fromtimestamp(mtime, datetime.UTC)
                .isoformat().replace("+00:00", "Z"), "size": size, "digest": digest, "details": self._details()}

    def _details(self) -> dict:
        family = ""
        config = os.path.join(self.model_path, "config.json") if os.path.isdir(self.model_path) else ""
        if config and os.path.isfile(config):
            try:
                with open(config) as f:
                    family = str(json.load(f).get("model_type", ""))
            except (OSError, ValueError):
                pass
        elif os.path.isfile(self.model_path):
            family = gguf_architecture(self.model_path)
        fmt = "gguf" if self.model_path.endswith(".gguf") else "safetensors"
        return {"parent_model": "", "format": fmt, "family": family, "families": [family] if family else None,
                "parameter_size": "", "quantization_level": "", "context_length": self.api.max_model_len}

    async def tags(self, req: Request) -> Response:
        names = [*self.api.model_names, *self.api.adapters]
        return Response(200, orjson.dumps({"models": [self._entry(n) for n in names]}))

    async def ps(self, req: Request) -> Response:
        """The served models, loaded for as long as the server runs."""
        models = []
        for n in [*self.api.model_names, *self.api.adapters]:
            e = self._entry(n)
            models.append({k: e[k] for k in ("name", "model", "size", "digest", "details")} | {
                "expires_at": "9999-12-31T23:59:59Z", "size_vram": 0, "context_length": self.api.max_model_len})
        return Response(200, orjson.dumps({"models": models}))

    async def version(self, req: Request) -> Response:
        return Response(200, orjson.dumps({"version": VERSION}))

    async def show(self, req: Request) -> Response:
        data = op.parse_json(req.body)
        name = self._model(data)
        caps = ["completion"] + (["tools"] if self.api.tool_format and self.api.tools_shown else []) + (
            ["vision"] if self.api.client.ready.image_tokens else []) + (
            ["thinking"] if self.api.thinking or self.api.harmony else []) + (
            ["insert"] if self.api.codec.fills_in_the_middle else [])
        template = self.api.codec.chat_template or ""
        entry = self._entry(name)  # (the model's files and config.json, read once)
        return Response(200, orjson.dumps({
            "modelfile": f"FROM {self.model_path}\n", "parameters": "", "template": template,
            "details": entry["details"], "model_info": {  # (clients read "<architecture>.context_length", as Ollama's)
                "general.architecture": (arch := entry["details"]["family"]),
                f"{arch or 'general'}.context_length": self.api.max_model_len},
            "capabilities": caps, "modified_at": entry["modified_at"]}))

    # ------------------------------------------------------------------ generation

    async def chat(self, req: Request):
        return await self._run(req, op.parse_json(req.body), self.chat_job, "messages")

    async def generate(self, req: Request):
        return await self._run(req, op.parse_json(req.body), self.generate_job, "prompt")

    async def _run(self, req: Request, data: dict, job, logged: str):
        name = self._model(data)
        stream = op.field(data, "stream", bool, True)  # (Ollama's default: streamed)
        if data.get("think") not in (None, False) and not (self.api.thinking or self.api.harmony):
            raise ApiError(400, f'"{_shown(data)}" does not support thinking', param="think")  # (Ollama's refusal)
        keep_alive(data)
        given = op.field(data, logged, str if logged == "prompt" else list, None)
        if not given and not (logged == "prompt" and data.get("suffix")):  # Ollama's "load" (or "unload") call
            reason = "unload" if data.get("keep_alive") in (0, "0", "0s", "0m") else "load"
            body = {"model": _shown(data), "created_at": _now(), "done": True, "done_reason": reason}
            body |= {"message": {"role": "assistant", "content": ""}} if logged == "messages" else {"response": ""}
            return Response(200, orjson.dumps(body))

        async def run(_, arrival):
            return await job(data, name, arrival)
        return await self.api._run(req, {"stream": stream, "prompt": data.get(logged)}, run)

    async def chat_job(self, data: dict, name: str, arrival: float | None) -> tuple[Generation, OllamaFormat]:
        chat = to_chat(data, chat_messages(data)) | {"model": name}
        tools = op.field(data, "tools", list, None)
        if tools:
            if self.api.tool_format is None:  # (Ollama's refusal: Ollama has no tool_choice for the chat's to name)
                raise ApiError(400, f'"{_shown(data)}" does not support tools', param="tools")
            chat["tools"] = tools
        try:
            gen, chat_fmt = await self._chat(chat, arrival)
        except ApiError as e:
            raise e.renamed(_NAMES) from None
        gen.schema_param = _NAMES.get(gen.schema_param, gen.schema_param)
        return gen, OllamaFormat(_shown(data), gen, chat_fmt.answers, chat=True, codec=self.api.codec)

    async def _chat(self, chat: dict, arrival: float | None):
        """``chat`` run with ``max_tokens`` as Ollama's ``num_predict``: at most that many, up to the context's end
        (not refused past it)."""
        limit = chat.pop("max_tokens", None)
        gen, chat_fmt = await self.api.chat_job(chat, arrival)
        if limit is not None:
            try:
                gen.set_max_tokens(0, min(limit, gen.params.max_tokens))
            except SamplingParamError as e:  # (min_tokens past it)
                raise ApiError(400, str(e), param="num_predict") from None  # (max_tokens named num_predict: _NAMES)
        return gen, chat_fmt

    async def generate_job(self, data: dict, name: str, arrival: float | None) -> tuple[Generation, OllamaFormat]:
        prompt = op.field(data, "prompt", str, "")
        system = op.field(data, "system", str, None)
        if op.field(data, "template", str, ""):
            raise ApiError(400, "template is not supported here: the model's own chat template is used",
                           param="template")
        context = op.field(data, "context", list, None)
        raw, suffix = op.field(data, "raw", bool, False), op.field(data, "suffix", str, "")
        if raw and (system or context):
            raise ApiError(400, "raw mode does not support template, system, or context", param="raw")
        if (raw or context or suffix) and _images(data.get("images")):
            raise ApiError(400, "images go with a templated prompt here (not with raw, context or suffix)",
                           param="images")
        if suffix and (system or context):
            raise ApiError(400, "suffix does not support system or context here", param="suffix")
        if suffix and not self.api.codec.fills_in_the_middle:
            raise ApiError(400, f'"{_shown(data)}" does not support insert', param="suffix")
        try:
            if suffix:
                fields = {"input_prefix": prompt, "input_suffix": suffix, **_llamacpp_fields(data, name)}
                gen, _ = await self.llamacpp.infill_job(fields, arrival, top_logprobs(data))
                answers = None
            elif raw or context:  # (context: an earlier answer's tokens, this prompt's after them)
                op.check_text_length(len(prompt), self.api.max_chars, "prompt")
                if context:
                    op.check_token_ids(context, self.api.codec.vocab_size, "context")
                    ids = context + (await self.api._offload(len(prompt), self.api.codec.encode, prompt, False) if raw
                                     else await self.api._shown_prompt({"messages": self._messages(data, prompt)}))
                else:
                    ids = await self.api._encode(prompt)
                body = {"prompt": ids, **options(data), **_extras(data), "model": name}
                top = top_logprobs(data)
                if top is not None:
                    body["logprobs"] = top
                room = max(1, self.api.max_model_len - len(ids))  # (none: the completion's refusal)
                body["max_tokens"] = min(body.get("max_tokens", room), room)
                fmt = response_format(data.get("format"))
                if fmt is not None:
                    body["response_format"] = fmt
                gen, _ = await self.api.completion_job(body, arrival)
                answers = None
            else:  # (run as a chat, whose refusal of a long text would name messages, not the prompt)
                op.check_text_length(len(prompt), self.api.max_chars, "prompt")
                gen, chat_fmt = await self._chat(to_chat(data, self._messages(data, prompt)) | {"model": name},
                                                 arrival)
                answers = chat_fmt.answers
        except ApiError as e:
            raise e.renamed(_NAMES) from None
        gen.schema_param = _NAMES.get(gen.schema_param, gen.schema_param)  # (the engine's refusal of a format)
        return gen, OllamaFormat(_shown(data), gen, answers, chat=False, context=not raw, codec=self.api.codec)

    def _messages(self, data: dict, prompt: str) -> list[dict]:
        """/api/generate's prompt as a chat: ``system`` (where given), then the prompt (and its images) as the user's."""
        system = op.field(data, "system", str, None)
        op.check_text_length(len(system or ""), self.api.max_chars, "system")  # (the chat's refusal says messages)
        return ([{"role": "system", "content": system}] if system else []) + [
            {"role": "user", "content": _image_parts(prompt, _images(data.get("images")))}]

    # ------------------------------------------------------------------ embeddings

    async def embed(self, req: Request) -> Response:
        """``/api/embed`` (``input``: a string or a list; L2-normalised vectors) and the older ``/api/embeddings``
        (``prompt``: one vector, as the model pools it)."""
        data = op.parse_json(req.body)
        name = self._model(data)
        keep_alive(data)
        options(data)  # (checked, as a generation's; a model's options do not change its vectors)
        legacy = req.path == "/api/embeddings"
        given = data.get("prompt") if legacy else data.get("input")
        if legacy and not isinstance(given, str):
            raise ApiError(400, "prompt must be a string", param="prompt")
        if not legacy and not (isinstance(given, str) or (isinstance(given, list)
                                                            and all(isinstance(x, str) for x in given))):
            raise ApiError(400, "invalid input type", param="input")
        if given in ("", []):
            return Response(200, orjson.dumps({"embedding": []} if legacy else {"model": _shown(data),
                                                                                  "embeddings": []}))
        body = {"model": name, "input": given, "normalize": not legacy}
        if op.field(data, "truncate", bool, True):
            body["truncate_prompt_tokens"] = -1  # (Ollama's default: cut to the context)
        if data.get("dimensions") is not None:
            body["dimensions"] = data["dimensions"]

        async def job(api, body, arrival):
            gen, _ = await embeddings_job(api, body, arrival)
            return gen, _Embeddings(gen, _shown(data), legacy)
        return await self.api._embed(req, body, job, given)


def _llamacpp_fields(data: dict, name: str) -> dict:
    """Ollama's options as a llama.cpp body's fields (its names are llama.cpp's)."""
    opts = options(data)
    out = {k: v for k, v in opts.items() if k not in ("max_tokens", "repetition_penalty")}
    if "max_tokens" in opts:
        out["n_predict"] = opts["max_tokens"]
    if "repetition_penalty" in opts:
        out["repeat_penalty"] = opts["repetition_penalty"]
    fmt = response_format(data.get("format"))
    if fmt is not None:
        out["json_schema"] = fmt.get("json_schema", {}).get("schema", {})
    return out | _extras(data) | {"model": name}


class _Embeddings:
    def __init__(self, gen: Generation, model: str, legacy: bool) -> None:
        self.gen, self.model, self.legacy = gen, model, legacy

    def body(self) -> bytes:
        vectors = [embedding_floats(c.embedding) for c in self.gen.choices]
        if self.legacy:
            return orjson.dumps({"embedding": vectors[0]})
        return orjson.dumps({"model": self.model, "embeddings": vectors,
                             "total_duration": int((time.monotonic() - self.gen.arrival) * 1e9),
                             "prompt_eval_count": sum(c.num_prompt_tokens for c in self.gen.choices)})


class OllamaFormat:
    """What a generation produced, as Ollama's answers: one object, or a JSON line per update and a last one with
    ``done``, its reason and the durations (nanoseconds). Asked for, each line has its tokens' ``logprobs``
    (``token``, ``logprob``, ``bytes``, ``top_logprobs``), those of tokens whose text is still held back (part of
    a character, a stop string's start) with the next line that has text."""

    DONE = b""
    CONTENT_TYPE = "application/x-ndjson"

    def __init__(self, model: str, gen: Generation, answers: list | None, chat: bool, context: bool = False,
                 codec: TextCodec | None = None) -> None:
        self.model, self.gen, self.chat, self.codec = model, gen, chat, codec
        self.answer = answers[0] if answers else None  # thinking and tool calls read out of the text
        self.context = context  # /api/generate's: the prompt's and the output's tokens, last
        self.content = self.thinking = ""
        self.calls: list[dict] = []
        self.ids: list[int] = []
        self.logprobs: list[dict] = []  # those not sent yet (streamed), or all (whole)

    def _parts(self, up: Update) -> tuple[str, str, list[dict]]:
        """(text, thinking, whole tool calls) of one update."""
        self.ids += up.token_ids
        if up.logprobs:
            self.logprobs += [self._logprob(tid, lp, top) for tid, lp, top in up.logprobs]
        if self.answer is None:
            return up.text, "", []
        parts = self.answer.parts(up.text, up.finished)
        text = "".join(v for k, v in parts if k == "text")
        thinking = "".join(v for k, v in parts if k == "reasoning")
        calls = []
        for _, call in (p for p in parts if p[0] == "call"):
            fn = call["function"]
            try:
                arguments = orjson.loads(fn.get("arguments") or "{}")
            except orjson.JSONDecodeError:  # (cut short)
                arguments = {}
            calls.append({"id": call.get("id"), "function": {"index": len(self.calls) + len(calls),
                                                               "name": fn.get("name"), "arguments": arguments}})
        return text, thinking, calls

    def _logprob(self, tid: int, lp: float | None, top: list | None) -> dict:
        codec = self.codec
        out = {"token": codec.token_text(tid), "logprob": lp, "bytes": codec.token_utf8(tid)}
        if top:
            out["top_logprobs"] = [{"token": codec.token_text(t), "logprob": v, "bytes": codec.token_utf8(t)}
                                   for t, v in top]
        return out

    def _line(self, text: str, thinking: str, calls: list[dict], done: bool) -> dict:
        out: dict[str, Any] = {"model": self.model, "created_at": _now()}
        if self.chat:
            msg: dict[str, Any] = {"role": "assistant", "content": text}
            if thinking:
                msg["thinking"] = thinking
            if calls:
                msg["tool_calls"] = calls
            out["message"] = msg
        else:
            out["response"] = text
            if thinking:
                out["thinking"] = thinking
        if self.logprobs:
            out["logprobs"], self.logprobs = self.logprobs, []
        out["done"] = done
        if done:
            out |= self._stats()
        return out

    def _stats(self) -> dict:
        c, now = self.gen.choices[0], time.monotonic()
        sent = self.gen.sent_at or self.gen.arrival
        first = c.first_token_at or now
        out = {"done_reason": c.finish_reason if c.finish_reason in ("stop", "timeout") else "length",
               "total_duration": int((now - self.gen.arrival) * 1e9), "load_duration": 0,
               "prompt_eval_count": c.num_prompt_tokens - c.num_cached_tokens,
               "prompt_eval_duration": int(max(0.0, first - sent) * 1e9), "eval_count": c.num_tokens,
               "eval_duration": int(max(0.0, (c.last_token_at or first) - first) * 1e9)}
        if self.context:
            out["context"] = [*c.prompt_ids, *self.ids]
        return out

    # ------------------------------------------------------------------ whole

    def collect(self, updates: list[Update]) -> None:
        for up in updates:
            text, thinking, calls = self._parts(up)
            self.content += text
            self.thinking += thinking
            self.calls += calls

    def response(self) -> dict:
        return self._line(self.content, self.thinking, self.calls, done=True)

    # ------------------------------------------------------------------ streamed

    def stream_head(self) -> bytes:
        return b""

    def chunk(self, updates: list[Update]) -> bytes:
        out = b""
        for up in updates:
            text, thinking, calls = self._parts(up)
            self.calls += calls
            if text or thinking or calls:
                out += orjson.dumps(self._line(text, thinking, calls, done=False)) + b"\n"
            if up.finished:
                out += orjson.dumps(self._line("", "", [], done=True)) + b"\n"
        return out

    def stream_error(self, e: ApiError) -> bytes:
        return orjson.dumps({"error": e.message}) + b"\n"
