"""Reading OpenAI request bodies: JSON, field types, prompts, messages and sampling fields.

Every problem becomes an ``ApiError`` (400 unless said otherwise) naming the
offending ``param``; unknown fields are ignored, as OpenAI-compatible servers do.
"""

from __future__ import annotations

import hashlib
import math
import time
from collections.abc import Awaitable, Callable
from typing import Any

import orjson

from engine.protocol import (
    MAX_ALLOWED_TOKEN_IDS,
    MAX_LOGIT_BIAS,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
    STRUCTURED_FIELDS,
    SamplingParamError,
    SamplingParams,
    check_bad_words,
)
from frontends import tools
from frontends.errors import ApiError

_MISSING = object()
MAX_N = 128
MAX_LOGPROBS = 20  # a token's top logprobs (the engine's bound)
TRUNCATION_MARGIN = 16  # tokens tokenized before the kept ones of a long text cut for truncate_prompt_tokens
MAX_PROMPTS = 128  # prompts in one /v1/completions call
MAX_CHOICES = 128  # prompts x n: engine requests one call may start
MAX_MESSAGES = 4096
MAX_DETOKENIZE_TOKENS = 1 << 17  # token ids in one /detokenize call
# what one call copies into the engine, over all its choices: stop_token_ids + logit_bias entries
MAX_SAMPLING_ENTRIES = 16384
PRIORITY_RANGE = (-(2**31), 2**31 - 1)  # an int32, as vLLM's: the engine keys a heap on it
MAX_TIMEOUT_S = 1e6  # about 11.6 days: longer is a typo or an attack on the deadline arithmetic
MAX_CACHE_SALT_CHARS = 256  # the engine hashes it into every block key of the request: keep it short

# a query string's booleans
QUERY_TRUE, QUERY_FALSE = ("1", "true", "t", "yes", "y", "on"), ("", "0", "false", "f", "no", "n", "off")


def parse_json(body: bytes | bytearray) -> dict[str, Any]:
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError as e:
        raise ApiError(400, f"Malformed JSON body: {e}") from None
    if not isinstance(data, dict):
        raise ApiError(400, "The request body must be a JSON object")
    return data


def field(data: dict, name: str, types: type | tuple, default: Any = _MISSING, *, nullable: bool = True) -> Any:
    """``data[name]`` checked against ``types`` (bool is never taken for a number; a whole float is taken for an
    integer, 4.0 for 4, as vLLM's pydantic models take it)."""
    v = data.get(name, _MISSING)
    if v is _MISSING or (v is None and nullable):
        if default is _MISSING:
            raise ApiError(400, f"Missing required field: '{name}'", param=name)
        return default
    if int in _as_tuple(types) and float not in _as_tuple(types):
        v = whole(v)
    ok = isinstance(v, types) and not (isinstance(v, bool) and bool not in _as_tuple(types))
    if not ok:
        want = " or ".join(t.__name__ for t in _as_tuple(types))
        got = "a whole number outside the 64-bit range" if type(v) is float and v.is_integer() else type(v).__name__
        raise ApiError(400, f"'{name}' must be of type {want}, got {got}", param=name)
    return v


def whole(v: Any) -> Any:
    """``v``, or the integer a whole float stands for (4.0: 4; below 2**63 in size), as vLLM's pydantic models
    read one where an integer is wanted."""
    return int(v) if type(v) is float and v.is_integer() and abs(v) < 2**63 else v


def _as_tuple(types: type | tuple) -> tuple:
    return types if isinstance(types, tuple) else (types,)


def check_model(data: dict, names: tuple[str, ...], adapters: dict[str, str] | None = None) -> str:
    """A request's ``model``, if given, must be one of the served ``names`` or a LoRA adapter's (404 as
    OpenAI's); returns the adapter it names ("": the model alone)."""
    model = field(data, "model", str, None)
    if model is not None and adapters and model in adapters:
        return model
    if model is not None and model not in names:
        raise ApiError(404, f"The model '{model}' does not exist", type="not_found_error",
                       param="model", code="model_not_found")
    return ""


def check_token_ids(ids: list, vocab_size: int, param: str) -> list[int]:
    """``ids``, integers in [0, ``vocab_size``) (no bool), checked at C's pace: a body of four million ids held
    the event loop for a second, walked in Python (review); the first one that is not, named."""
    if ids and (not set(map(type, ids)) <= {int} or min(ids) < 0 or max(ids) >= vocab_size):
        for t in ids:
            if type(t) is not int or not 0 <= t < vocab_size:
                raise ApiError(400, f"Invalid token id {t!r} in '{param}': token ids must be integers "
                               f"in [0, {vocab_size})", param=param)
    return ids


async def parse_prompts(data: dict, encode: Callable[[str], Awaitable[list[int]]], vocab_size: int,
                        max_chars: int, name: str = "prompt", limit: int = MAX_PROMPTS,
                        empty: bool = False) -> list[list[int]]:
    """``prompt`` (or ``name``: embeddings' ``input``) as a string, list of strings, token ids, or list
    of token id lists; a list may mix strings and token id lists, as llama.cpp's ``/embeddings`` (read here
    too) takes them, though OpenAI refuses them.

    At most ``limit`` prompts; a string longer than ``max_chars`` cannot fit the
    context and is refused before it is tokenized. ``empty``: an empty prompt is one (fill in the middle's, at
    the top of a file: the FIM tokens around it make the prompt).
    """
    p = data.get(name, _MISSING)
    if p is _MISSING or p is None:
        raise ApiError(400, f"Missing required field: '{name}'", param=name)
    kinds = set(map(type, p)) if isinstance(p, list) else set()  # (a list of millions of ids: at C's pace)
    if isinstance(p, str):
        prompts: list = [p]
    elif isinstance(p, list) and p and kinds == {int}:
        prompts = [p]
    elif isinstance(p, list) and p and kinds <= {str, list}:
        prompts = p
    elif isinstance(p, list) and not p:
        if not empty:
            raise ApiError(400, f"'{name}' must not be empty", param=name)
        prompts = [p]
    else:
        raise ApiError(400, f"'{name}' must be a string, a list of strings, a list of token ids "
                       "or a list of lists of token ids", param=name)
    if len(prompts) > limit:
        raise ApiError(400, f"At most {limit} {name}s per request, got {len(prompts)}", param=name)
    for x in prompts:
        if not x and not empty:
            raise ApiError(400, f"'{name}' must not be empty", param=name)
        if isinstance(x, str):
            check_text_length(len(x), max_chars, name)
    out = []
    for x in prompts:
        ids = (await encode(x) if x else []) if isinstance(x, str) else check_token_ids(x, vocab_size, name)
        if not ids and not empty:
            raise ApiError(400, f"'{name}' encodes to no tokens", param=name)
        out.append(ids)
    return out


def parse_truncation(data: dict, max_model_len: int) -> int | None:
    """vLLM's ``truncate_prompt_tokens``: the last k tokens of each prompt are kept (-1: as many as fit)."""
    k = field(data, "truncate_prompt_tokens", int, None)
    if k == -1:
        k = max_model_len
    if k is not None and not 1 <= k <= max_model_len:
        raise ApiError(400, f"truncate_prompt_tokens must be -1 or in [1, {max_model_len}], got {k}",
                       param="truncate_prompt_tokens")
    return k


async def parse_truncated_prompts(data: dict, encode: Callable[[str], Awaitable[list[int]]], codec, max_chars: int,
                                  max_model_len: int, name: str = "prompt", limit: int = MAX_PROMPTS,
                                  empty: bool = False) -> list[list[int]]:
    """``parse_prompts``, each prompt cut to its last ``truncate_prompt_tokens`` (k) tokens where the request
    says so. A text within ``max_chars`` is tokenized whole; of a longer one (the body's size bounds it) only
    the end: (k + TRUNCATION_MARGIN) tokens' worth of characters at least (no token is longer than
    ``codec.max_token_chars``), the window doubled until its last k tokens stay the same (BPE may group a
    long run of one character from wherever the cut falls)."""
    keep = parse_truncation(data, max_model_len)
    if keep is None:
        return await parse_prompts(data, encode, codec.vocab_size, max_chars, name, limit, empty)
    first = max(max_chars, (keep + TRUNCATION_MARGIN) * codec.max_token_chars)

    async def tail(text: str) -> list[int]:
        window, ids = first, await encode(text[-first:])
        while window < len(text):
            window *= 2
            wider = await encode(text[-window:])
            if wider[-keep:] == ids[-keep:]:
                break
            ids = wider
        return ids

    return [p[-keep:] for p in await parse_prompts(data, tail, codec.vocab_size, math.inf, name, limit, empty)]


def parse_prompt_logprobs(data: dict) -> int | None:
    """vLLM's ``prompt_logprobs``: the top k logprobs at every prompt position (and the prompt token's)."""
    k = field(data, "prompt_logprobs", int, None)
    if k is not None and not 0 <= k <= MAX_LOGPROBS:
        raise ApiError(400, f"prompt_logprobs must be in [0, {MAX_LOGPROBS}], got {k}", param="prompt_logprobs")
    return k


class ContextExceeded(ApiError):
    """A 400: the input (with the completion asked for) does not fit the model's context. The Responses API's
    ``truncation: "auto"`` answers it by dropping the oldest turns."""


def check_text_length(num_chars: int, max_chars: int, param: str) -> None:
    if num_chars > max_chars:
        verb = "are" if param.endswith("s") else "is"  # (the messages, the prompt)
        raise ContextExceeded(400, f"The {param} {verb} {num_chars} characters long: more than fits this model's "
                              f"context (at most {max_chars} characters). Please reduce the length of the {param}.",
                              param=param)


_ROLES = ("system", "developer", "user", "assistant", "tool")


def parse_messages(data: dict, max_chars: int | None = None) -> list[dict[str, Any]]:
    """Chat messages: their text, a user's images (``images``: their URLs, in order, and ``parts``: the text and
    images in order, for the chat template; ``frontends.images``), an
    assistant's ``tool_calls`` and a tool's ``tool_call_id`` kept (``frontends.tools``), an assistant's
    ``reasoning_content`` (or ``reasoning``) as ``reasoning_content`` and ``thinking``; with ``max_chars``,
    their texts (and calls) together must fit in it."""
    msgs = field(data, "messages", list)
    if not msgs:
        raise ApiError(400, "'messages' must not be empty", param="messages")
    roles = (*_ROLES, "function") if data.get("functions") is not None else _ROLES  # (the deprecated functions')
    out: list[dict[str, Any]] = []
    size = 0  # characters, and bytes of tool calls
    for i, m in enumerate(msgs):
        if not isinstance(m, dict):
            raise ApiError(400, f"messages[{i}] must be an object", param="messages")
        role = m.get("role")
        if role not in roles:
            raise ApiError(400, f"messages[{i}].role must be one of {', '.join(roles)}, got {role!r}",
                           param="messages")
        content = m.get("content")
        images = []
        parts = []  # the template's parts, in order (frontends.text)
        if content is None:
            content = ""
        elif isinstance(content, list):  # content parts: text, and a user's images
            texts = []
            for part in content:
                kind = part.get("type") if isinstance(part, dict) else None
                if kind == "text" and isinstance(part.get("text"), str):
                    texts.append(part["text"])
                    parts.append({"type": "text", "text": part["text"]})
                elif kind == "text":
                    raise ApiError(400, f"messages[{i}].content: a text part needs text, a string", param="messages")
                elif kind == "image_url" and role == "user":
                    url = part.get("image_url")
                    url = url.get("url") if isinstance(url, dict) else url
                    if not isinstance(url, str):
                        raise ApiError(400, f"messages[{i}].content: an image_url part needs image_url.url, a "
                                       f"string", param="messages")
                    images.append(url)
                    parts.append({"type": "image"})
                else:
                    raise ApiError(400, f"messages[{i}].content: only text parts (and a user's image_url parts) "
                                   f"are supported", param="messages")
            content = "".join(texts)
        elif not isinstance(content, str):
            raise ApiError(400, f"messages[{i}].content must be a string or a list of content parts",
                           param="messages")
        msg = {"role": {"developer": "system", "function": "tool"}.get(role, role), "content": content}
        if images:
            msg |= {"images": images, "parts": parts}
        thought = m.get("reasoning_content", m.get("reasoning")) if role == "assistant" else None
        if isinstance(thought, str) and thought:  # an earlier answer's thinking, sent back: as templates read it
            msg |= {"reasoning_content": thought, "thinking": thought}  # (Qwen3's name; GPT-OSS's)
            size += len(thought)
        if role == "assistant" and m.get("tool_calls") and m.get("function_call") is not None:
            raise ApiError(400, f"messages[{i}] has tool_calls and a function_call: one or the other",
                           param="messages")
        if role == "assistant" and m.get("tool_calls"):
            msg["tool_calls"] = tools.template_tool_calls(m["tool_calls"], i)
            size += sum(len(c["function"]["arguments"]) for c in m["tool_calls"])
        elif role == "assistant" and m.get("function_call") is not None:  # (the deprecated functions' one call)
            fn = tools.template_function(m["function_call"], f"messages[{i}].function_call")
            if fn is None:
                raise ApiError(400, f"messages[{i}].function_call must be {{'name': string, 'arguments': JSON text}}",
                               param="messages")
            msg["tool_calls"] = [{"id": "", "type": "function", "function": fn}]
            size += len(m["function_call"]["arguments"])
        elif role == "function":  # (a deprecated function's result: named, as the tool messages of some templates)
            if not isinstance(m.get("name"), str):
                raise ApiError(400, f"messages[{i}].name must be a string: the function whose result this is",
                               param="messages")
            msg["name"] = m["name"]
        elif role == "tool" and m.get("tool_call_id") is not None:
            if not isinstance(m["tool_call_id"], str):
                raise ApiError(400, f"messages[{i}].tool_call_id must be a string", param="messages")
            msg["tool_call_id"] = m["tool_call_id"]
        out.append(msg)
        size += len(content)
        if len(out) > MAX_MESSAGES:
            raise ApiError(400, f"At most {MAX_MESSAGES} messages per request, got {len(msgs)}", param="messages")
    if max_chars is not None:
        check_text_length(size, max_chars, "messages")
    return out


# chat_template_kwargs may not use the names of apply_chat_template's own arguments (nor the template's)
_TEMPLATE_ARGS = frozenset({"conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
                            "continue_final_message", "tokenize", "sanitize_control_tokens", "padding", "truncation",
                            "max_length", "return_tensors", "return_dict", "return_assistant_tokens_mask",
                            "tokenizer_kwargs"})
MAX_TEMPLATE_KWARGS_BYTES = 1 << 16


def parse_bad_words(data: dict) -> list[str] | None:
    """vLLM's ``bad_words``, checked before they are tokenized (``frontends.text.bad_words_token_ids``)."""
    words = field(data, "bad_words", list, None)
    if words:
        try:
            check_bad_words(words)
        except SamplingParamError as e:
            raise ApiError(400, str(e), param=e.param) from None
    return words or None


def parse_continuation(data: dict, messages: list[dict]) -> tuple[bool, bool]:
    """vLLM's ``add_generation_prompt`` (true: the template opens the assistant's turn) and
    ``continue_final_message`` (true: the model goes on with the last message, an assistant's: a prefill)."""
    add = field(data, "add_generation_prompt", bool, True)
    cont = field(data, "continue_final_message", bool, False)
    if cont and add:
        raise ApiError(400, "continue_final_message needs add_generation_prompt set to false",
                       param="continue_final_message")
    if cont and messages[-1]["role"] != "assistant":
        raise ApiError(400, "continue_final_message needs the last message to be the assistant's",
                       param="continue_final_message")
    return add, cont


# OpenAI's reasoning efforts (``reasoning_effort``; the Responses API's ``reasoning.effort``)
REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh")


def check_reasoning_effort(effort: Any, name: str = "reasoning_effort", param: str = "reasoning_effort") -> None:
    """400 unless ``effort`` (the field ``name``, refused as ``param``) is None or one of OpenAI's efforts."""
    if effort is not None and effort not in REASONING_EFFORTS:
        raise ApiError(400, f"{name} must be one of {', '.join(REASONING_EFFORTS)}, got {effort!r}", param=param)


def parse_template_kwargs(data: dict) -> dict[str, Any]:
    """vLLM's ``chat_template_kwargs``: more variables for the chat template (Qwen3's
    ``enable_thinking``, say); they override the tokenizer's special tokens of the same name, as
    in transformers. OpenAI's ``reasoning_effort`` is the template's variable of that name (gpt-oss's
    template writes it in the system message, "Reasoning: high"), unless ``chat_template_kwargs`` sets it,
    as in vLLM. {} when neither is given."""
    effort = field(data, "reasoning_effort", str, None)
    check_reasoning_effort(effort)
    kw = field(data, "chat_template_kwargs", dict, None)
    if effort is not None:
        kw = {"reasoning_effort": effort, **(kw or {})}
    if not kw:
        return {}
    for k in kw:
        if not k.isidentifier() or k in _TEMPLATE_ARGS:
            raise ApiError(400, f"chat_template_kwargs may not set {k!r}: the chat template's own arguments "
                           "have their own fields", param="chat_template_kwargs")
    try:
        size = len(orjson.dumps(kw))
    except orjson.JSONEncodeError:  # nested past orjson's 254 levels, or an integer past 64 bits
        raise ApiError(400, "chat_template_kwargs nests too deeply or holds an integer too large",
                       param="chat_template_kwargs") from None
    if size > MAX_TEMPLATE_KWARGS_BYTES:
        raise ApiError(400, f"chat_template_kwargs may be at most {MAX_TEMPLATE_KWARGS_BYTES} bytes as JSON",
                       param="chat_template_kwargs")
    return kw


# llama.cpp's samplers' fields (engine.sampler_llamacpp), taken by every endpoint as llama.cpp's server takes them
_NUM = (int, float)
LLAMACPP_SAMPLERS = {"dry_multiplier": _NUM, "dry_base": _NUM, "dry_allowed_length": int, "dry_penalty_last_n": int,
                     "dry_sequence_breakers": list, "xtc_probability": _NUM, "xtc_threshold": _NUM,
                     "typical_p": _NUM, "top_n_sigma": _NUM, "dynatemp_range": _NUM, "dynatemp_exponent": _NUM,
                     "mirostat": int, "mirostat_tau": _NUM, "mirostat_eta": _NUM}


_LLAMACPP_EDGES = (("dry_base", lambda v: v < 1, 1.75), ("typical_p", lambda v: v > 1, 1.0),
                   ("dry_multiplier", lambda v: v < 0, 0.0), ("xtc_probability", lambda v: v < 0, 0.0),
                   ("xtc_threshold", lambda v: v > 1, 1.0), ("dynatemp_range", lambda v: v < 0, 0.0))


def _llamacpp_server_values(data: dict) -> dict:
    """``data`` with llama.cpp's samplers' values as its server reads them: a ``dry_base`` below 1 is its default
    1.75, and a value past the edge where one turns off is that edge's (a ``typical_p`` above 1 is 1; a negative
    ``dry_multiplier``, which llama.cpp would apply as a reward for repeating, is off too). Also DRY's breakers
    written as text-generation-webui's API (and SillyTavern for it) sends them: quoted JSON strings in one
    string, with or without the brackets of an array."""
    for name, past, edge in _LLAMACPP_EDGES:
        v = data.get(name)
        if isinstance(v, int | float) and not isinstance(v, bool) and past(v):
            data = data | {name: edge}
    breakers = data.get("dry_sequence_breakers")
    if isinstance(breakers, str):
        text = breakers.strip()
        try:
            data = data | {"dry_sequence_breakers": orjson.loads(text if text.startswith("[") else f"[{text}]")}
        except orjson.JSONDecodeError:
            raise ApiError(400, "dry_sequence_breakers must be an array of strings (or quoted strings in one string)",
                           param="dry_sequence_breakers") from None
    return data


def sampling_params(data: dict, *, max_tokens: int, logprobs: int | None, vocab_size: int,
                    prompt_logprobs: int | None = None, tool_schema: dict | None = None,
                    defaults: dict | None = None, bad_words: list[list[int]] | None = None) -> SamplingParams:
    """The sampling fields shared by both endpoints (``max_tokens`` already resolved). ``tool_schema``:
    what tool calling holds the output to (``frontends.tools``), in place of the structured-output fields.
    ``defaults``: the model's values (temperature, top_p, top_k, min_p, repetition_penalty) for fields the
    request leaves out, in place of OpenAI's. ``bad_words``: vLLM's, tokenized (``parse_bad_words``)."""
    d = {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0, "repetition_penalty": 1.0} | (defaults or {})
    stop = field(data, "stop", (str, list), [])
    if isinstance(stop, str):
        stop = [stop]
    bias = field(data, "logit_bias", dict, None)
    stop_token_ids = field(data, "stop_token_ids", list, [])
    # sizes before contents: an oversized list is refused without being walked
    for name, value, cap in (("stop", stop, MAX_STOP_STRINGS), ("logit_bias", bias or (), MAX_LOGIT_BIAS),
                             ("stop_token_ids", stop_token_ids, MAX_STOP_TOKEN_IDS)):
        if len(value) > cap:
            raise ApiError(400, f"'{name}' may have at most {cap} entries, got {len(value)}", param=name)
    logit_bias = None
    if bias:
        logit_bias = {}
        for k, v in bias.items():
            if not (k.isascii() and k.isdigit()):  # int() would also take "1_0", " 5 " and "٣"
                raise ApiError(400, f"logit_bias keys must be token ids, got {k!r}", param="logit_bias")
            tid = int(k)
            if not 0 <= tid < vocab_size:
                raise ApiError(400, f"logit_bias token id {tid} is outside [0, {vocab_size})", param="logit_bias")
            if isinstance(v, bool) or not isinstance(v, int | float):
                raise ApiError(400, "logit_bias values must be numbers", param="logit_bias")
            logit_bias[tid] = float(v)
    check_token_ids(stop_token_ids, vocab_size, "stop_token_ids")
    allowed = field(data, "allowed_token_ids", list, None)
    if allowed is not None:
        if len(allowed) > MAX_ALLOWED_TOKEN_IDS:  # (before walking it; the rest: SamplingParams)
            raise ApiError(400, f"'allowed_token_ids' may have at most {MAX_ALLOWED_TOKEN_IDS} entries, got "
                           f"{len(allowed)}", param="allowed_token_ids")
        check_token_ids(allowed, vocab_size, "allowed_token_ids")
    if tool_schema is not None and (given := structured_fields(data)):
        raise ApiError(400, f"tool_choice holds the output to tool calls: it cannot be combined with {given[0]}",
                       param=given[0])
    held, held_by = ({"json_schema": tool_schema}, "tools") if tool_schema is not None else parse_structured(data)
    data = _llamacpp_server_values(data)
    try:
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=field(data, "temperature", _NUM, d["temperature"]),
            top_p=field(data, "top_p", _NUM, d["top_p"]),
            top_k=field(data, "top_k", int, d["top_k"]),
            min_p=field(data, "min_p", _NUM, d["min_p"]),
            seed=field(data, "seed", int, None),
            presence_penalty=field(data, "presence_penalty", _NUM, 0.0),
            frequency_penalty=field(data, "frequency_penalty", _NUM, 0.0),
            repetition_penalty=field(data, "repetition_penalty", _NUM, d["repetition_penalty"]),
            repeat_last_n=field(data, "repeat_last_n", int, None),  # llama.cpp's (absent: vLLM's rules)
            logit_bias=logit_bias,
            stop=stop,
            stop_token_ids=stop_token_ids,
            ignore_eos=field(data, "ignore_eos", bool, False),
            min_tokens=field(data, "min_tokens", int, 0),
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            **held,
            allowed_token_ids=allowed,
            bad_words_token_ids=bad_words,
            include_stop_str_in_output=field(data, "include_stop_str_in_output", bool, False),
            **{k: field(data, k, t) for k, t in LLAMACPP_SAMPLERS.items() if data.get(k) is not None},
        )
    except SamplingParamError as e:
        param = held_by if e.param in STRUCTURED_FIELDS else e.param
        raise ApiError(400, str(e), param=param) from None
    except (TypeError, ValueError) as e:
        raise ApiError(400, f"Invalid sampling parameters: {e}") from None


_STRUCTURED = ("response_format", "json_schema", "structured_outputs", "guided_json", "guided_choice",
               "guided_regex", "guided_grammar", "grammar")
_KINDS = {"json": "json_schema", "choice": "choice", "regex": "regex", "grammar": "grammar"}  # structured_outputs'


def structured_fields(data: dict) -> list[str]:
    """The structured-output fields a request gives (``response_format`` of type text is none)."""
    rf = data.get("response_format")
    return [k for k in _STRUCTURED if data.get(k) is not None
            and not (k == "response_format" and isinstance(rf, dict) and rf.get("type") == "text")]


def structured_field(data: dict) -> str:
    """The field a request's output schema, choices, regex or grammar come from (``response_format`` when none)."""
    return (structured_fields(data) or ["response_format"])[0]


def parse_structured(data: dict) -> tuple[dict, str]:
    """({SamplingParams field: value}, the request's field it came from): what the output is held
    to, from whichever one field of OpenAI's ``response_format``, llama.cpp's ``json_schema`` or
    ``grammar`` (GBNF), vLLM's ``structured_outputs`` (``json``, ``choice``, ``regex``, ``grammar``
    or ``json_object``) or its older ``guided_json`` / ``guided_choice`` / ``guided_regex`` /
    ``guided_grammar`` the request gives (two of them: a 400)."""
    given = structured_fields(data)
    if len(given) > 1:
        raise ApiError(400, f"give one of {' and '.join(given)}", param=given[1])
    if not given or given[0] == "response_format":
        schema = parse_response_format(data)
        return ({} if schema is None else {"json_schema": schema}), "response_format"
    name = given[0]
    value = data[name]
    if name == "structured_outputs":
        if value == {"json_object": True}:
            return {"json_schema": {"type": "object"}}, name
        if not isinstance(value, dict) or len(value) != 1 or next(iter(value)) not in _KINDS:
            raise ApiError(400, "structured_outputs must be one of {'json': schema}, {'choice': [strings]}, "
                           "{'regex': string}, {'grammar': GBNF string} or {'json_object': true} here", param=name)
        kind, value = next(iter(value.items()))
        kind = _KINDS[kind]
    else:
        kind = {"guided_choice": "choice", "guided_regex": "regex", "guided_grammar": "grammar",
                "grammar": "grammar"}.get(name, "json_schema")
    if kind == "choice":
        if not isinstance(value, list):
            raise ApiError(400, f"'{name}' must give a list of strings", param=name)
        return {"choice": value}, name
    if kind in ("regex", "grammar"):
        if not isinstance(value, str):
            raise ApiError(400, f"'{name}' must give a {'regular expression' if kind == 'regex' else 'GBNF grammar'} "
                           "as a string", param=name)
        return {kind: value}, name
    if isinstance(value, str):  # vLLM takes a schema as a JSON string too
        try:
            value = orjson.loads(value)
        except orjson.JSONDecodeError:
            raise ApiError(400, f"'{name}' is not valid JSON", param=name) from None
    if not isinstance(value, dict):
        raise ApiError(400, f"'{name}' must be a JSON schema (an object)", param=name)
    return {"json_schema": value}, name


def parse_response_format(data: dict) -> dict | None:
    """OpenAI's ``response_format`` as the JSON schema the engine holds the output to: None for
    ``text`` (or none given), any JSON object for ``json_object``, ``json_schema.schema`` for
    ``json_schema`` (which keywords the engine understands: ``engine.json_schema``; it refuses the others)."""
    rf = field(data, "response_format", dict, None)
    if rf is None:
        return None
    kind = rf.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "object"}
    if kind == "json_schema":
        spec = rf.get("json_schema")
        schema = spec.get("schema", {}) if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            raise ApiError(400, "response_format of type 'json_schema' needs 'json_schema': {'name': ..., "
                           "'schema': {...}}, the schema a JSON object", param="response_format")
        if not isinstance(spec.get("name"), str):  # (OpenAI's and vLLM's required field; the schema may be left out)
            raise ApiError(400, "response_format.json_schema needs its 'name', a string", param="response_format")
        return schema
    raise ApiError(400, f"response_format 'type' must be 'text', 'json_object' or 'json_schema', got {kind!r}",
                   param="response_format")


def client_id(data: dict, host: str, by_user: bool = False) -> str:
    """Who asks, for ``--scheduling-policy fair``: the caller's ``host`` (an HTTP request's or a WebSocket's
    ``client``: behind a trusted proxy, the one it names); ``by_user`` (``--fair-client user``, behind a gateway
    that sets it): the body's end user (OpenAI's ``user``, or its successor ``safety_identifier``; Anthropic's
    ``metadata.user_id``), else that host. A caller names its user as it likes: by address, one that sends each
    request under another name is still one client. A name past 256 characters is kept as its first 224 and a
    digest of it all (the engine holds one count each). OpenAI's two fields are strings, whatever the mode
    (400 otherwise, as OpenAI's and vLLM's: a number was taken silently for none: review)."""
    for name in ("user", "safety_identifier"):
        if data.get(name) is not None and not isinstance(data[name], str):
            raise ApiError(400, f"'{name}' must be a string", param=name)
    if by_user:
        metadata = data.get("metadata")
        for user in (data.get("user"), data.get("safety_identifier"),
                     metadata.get("user_id") if isinstance(metadata, dict) else None):
            if isinstance(user, str) and user:
                if len(user) > 256:
                    user = user[:224] + hashlib.blake2b(user.encode(errors="replace"), digest_size=16).hexdigest()
                return "user:" + user
    return "addr:" + host


def parse_priority(data: dict) -> int:
    """``priority`` (vLLM's extra field): lower runs first, 0 by default."""
    p = field(data, "priority", int, 0)
    lo, hi = PRIORITY_RANGE
    if not lo <= p <= hi:
        raise ApiError(400, f"priority must be an integer in [{lo}, {hi}], got {p}", param="priority")
    return p


def parse_deadline(data: dict, default: float | None = None) -> float | None:
    """``timeout`` in seconds, turned into the unix time the engine must end the request by; where absent, the
    server's ``default`` (``--request-timeout``, from the engine's READY), else None.

    Taken now, as the body is read: the client's clock started when it sent the request,
    so tokenizing and queueing count against it, the server's default's too (the engine applied it from the
    request's arrival there, after the frontend's tokenizing and queueing: review).
    """
    t = field(data, "timeout", (int, float), None)
    if t is None:
        return None if default is None else time.time() + default
    if not 0 < t <= MAX_TIMEOUT_S:  # also refuses NaN and inf (every comparison with NaN is false)
        raise ApiError(400, f"timeout must be a positive number of seconds, at most {MAX_TIMEOUT_S:.0f}, "
                       f"got {t!r}", param="timeout")
    return time.time() + t


def parse_cache_salt(data: dict) -> str:
    """``cache_salt`` (vLLM's extra field): prefix-cache blocks are shared only between requests with the
    same salt, so a tenant's prompts cannot be probed through another's cache hits. "" (no salt) when absent."""
    salt = field(data, "cache_salt", str, None)
    if salt is None:
        return ""
    if not 0 < len(salt) <= MAX_CACHE_SALT_CHARS:
        raise ApiError(400, f"cache_salt must be a non-empty string of at most {MAX_CACHE_SALT_CHARS} characters, "
                       f"got {len(salt)} characters", param="cache_salt")
    return salt


def parse_prompt_cache_key(data: dict) -> str:
    """OpenAI's ``prompt_cache_key``: requests that share a prefix say so with one key (a conversation's, a
    tenant's); with data parallel they go to one engine while it is not much busier than the others, so that
    each finds its prefix in that engine's cache (``frontends.engine_router``). "" when absent."""
    key = field(data, "prompt_cache_key", str, None)
    if key is not None and len(key) > MAX_CACHE_SALT_CHARS:
        raise ApiError(400, f"prompt_cache_key must be at most {MAX_CACHE_SALT_CHARS} characters, got {len(key)}",
                       param="prompt_cache_key")
    return key or ""


def parse_n(data: dict) -> int:
    n = field(data, "n", int, 1)
    if not 1 <= n <= MAX_N:
        raise ApiError(400, f"n must be in [1, {MAX_N}], got {n}", param="n")
    # OpenAI's legacy best_of: that many samples, the n most likely answered. As vLLM V1, only its no-op
    # values are taken (n, or 1: LangChain's default beside any n); anything else is a 400, not ignored
    best_of = field(data, "best_of", int, None)
    if best_of not in (None, 1, n):
        if best_of < n:
            raise ApiError(400, f"best_of must be at least n ({n}), got {best_of}", param="best_of")
        raise ApiError(400, f"best_of above n is not supported (as in vLLM V1), got {best_of} for n = {n}: ask "
                       "for n choices with logprobs and keep the likeliest", param="best_of")
    return n


def check_fan_out(num_prompts: int, n: int, params: SamplingParams, max_queued: int = MAX_CHOICES) -> None:
    """Bound what one call asks of the engine: its requests, and the lists each one carries.

    ``max_queued``: the engine's waiting queue; a call starting more requests could never be queued,
    so it gets a 400, not a 429 that retrying can never cure.
    """
    choices = num_prompts * n
    limit = min(MAX_CHOICES, max_queued)
    if choices > limit:
        raise ApiError(400, f"A request may start at most {limit} generations (prompts x n) on this server, got "
                       f"{num_prompts} x {n} = {choices}", param="prompt" if n == 1 or num_prompts > limit else "n")
    entries = choices * (len(params.stop_token_ids) + len(params.logit_bias or ()))
    if entries > MAX_SAMPLING_ENTRIES:
        raise ApiError(400, f"stop_token_ids and logit_bias entries times the number of generations must be at "
                       f"most {MAX_SAMPLING_ENTRIES}, got {entries}: lower n or shorten the lists",
                       param="stop_token_ids" if params.stop_token_ids else "logit_bias")


def resolve_max_tokens(data: dict, names: tuple[str, ...], prompt_lens: list[int], max_model_len: int,
                       default: int | None, cap: int | None = None) -> int:
    """The requested completion length, checked against the context window.

    ``default`` None means: whatever room the longest prompt leaves (vLLM's chat default). ``cap``: the
    server's limit on any request's (``--override-generation-config``'s max_new_tokens, as vLLM's).
    """
    requested, given = None, names[0]
    for name in names:
        v = field(data, name, int, None)
        if v is not None:
            if v < 1:
                raise ApiError(400, f"{name} must be at least 1, got {v}", param=name)
            requested, given = v, name
            break
    longest = max(prompt_lens)
    if longest >= max_model_len:
        raise ContextExceeded(400, f"This model's maximum context length is {max_model_len} tokens. However, "
                              f"your prompt has {longest} tokens, leaving no room for the completion. "
                              "Please reduce the length of the prompt.", param="prompt")
    if cap is not None:
        requested = min(requested, cap) if requested is not None else None
        default = cap if default is None else min(default, cap)
    if requested is None:
        return max_model_len - longest if default is None else min(default, max_model_len - longest)
    if longest + requested > max_model_len:
        raise ContextExceeded(400, f"This model's maximum context length is {max_model_len} tokens. However, you "
                              f"requested {longest + requested} tokens ({longest} in the prompt, {requested} in "
                              "the completion). Please reduce the length of the prompt or the completion.",
                              param=given)
    return requested
