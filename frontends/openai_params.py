"""Reading OpenAI request bodies: JSON, field types, prompts, messages and sampling fields.

Every problem becomes an ``ApiError`` (400 unless said otherwise) naming the
offending ``param``; unknown fields are ignored, as OpenAI-compatible servers do.
"""

from __future__ import annotations

from typing import Any

import orjson

from engine.protocol import SamplingParamError, SamplingParams
from frontends.errors import ApiError

_MISSING = object()
MAX_N = 128


def parse_json(body: bytes | bytearray) -> dict[str, Any]:
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError as e:
        raise ApiError(400, f"Malformed JSON body: {e}") from None
    if not isinstance(data, dict):
        raise ApiError(400, "The request body must be a JSON object")
    return data


def field(data: dict, name: str, types: type | tuple, default: Any = _MISSING, *, nullable: bool = True) -> Any:
    """``data[name]`` checked against ``types`` (bool is never taken for a number)."""
    v = data.get(name, _MISSING)
    if v is _MISSING or (v is None and nullable):
        if default is _MISSING:
            raise ApiError(400, f"Missing required field: '{name}'", param=name)
        return default
    ok = isinstance(v, types) and not (isinstance(v, bool) and bool not in _as_tuple(types))
    if not ok:
        want = " or ".join(t.__name__ for t in _as_tuple(types))
        raise ApiError(400, f"'{name}' must be of type {want}, got {type(v).__name__}", param=name)
    return v


def _as_tuple(types: type | tuple) -> tuple:
    return types if isinstance(types, tuple) else (types,)


def check_model(data: dict, served_model_name: str) -> None:
    model = field(data, "model", str, None)
    if model is not None and model != served_model_name:
        raise ApiError(404, f"The model '{model}' does not exist", type="not_found_error",
                       param="model", code="model_not_found")


def check_token_ids(ids: list, vocab_size: int, param: str) -> list[int]:
    for t in ids:
        if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab_size:
            raise ApiError(400, f"Invalid token id {t!r} in '{param}': token ids must be integers "
                           f"in [0, {vocab_size})", param=param)
    return ids


def parse_prompts(data: dict, encode, vocab_size: int) -> list[list[int]]:
    """``prompt`` as a string, list of strings, token ids, or list of token id lists."""
    p = data.get("prompt", _MISSING)
    if p is _MISSING or p is None:
        raise ApiError(400, "Missing required field: 'prompt'", param="prompt")
    if isinstance(p, str):
        prompts: list = [p]
    elif isinstance(p, list) and p and all(isinstance(x, int) and not isinstance(x, bool) for x in p):
        prompts = [p]
    elif isinstance(p, list) and p and all(isinstance(x, str | list) for x in p):
        prompts = p
    elif isinstance(p, list) and not p:
        raise ApiError(400, "'prompt' must not be empty", param="prompt")
    else:
        raise ApiError(400, "'prompt' must be a string, a list of strings, a list of token ids "
                       "or a list of lists of token ids", param="prompt")
    out = []
    for x in prompts:
        if isinstance(x, str):
            if not x:
                raise ApiError(400, "'prompt' must not be empty", param="prompt")
            ids = encode(x)
        else:
            if not x:
                raise ApiError(400, "'prompt' must not be empty", param="prompt")
            ids = check_token_ids(x, vocab_size, "prompt")
        if not ids:
            raise ApiError(400, "'prompt' encodes to no tokens", param="prompt")
        out.append(ids)
    return out


_ROLES = ("system", "developer", "user", "assistant", "tool")


def parse_messages(data: dict) -> list[dict[str, str]]:
    msgs = field(data, "messages", list)
    if not msgs:
        raise ApiError(400, "'messages' must not be empty", param="messages")
    out = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict):
            raise ApiError(400, f"messages[{i}] must be an object", param="messages")
        role = m.get("role")
        if role not in _ROLES:
            raise ApiError(400, f"messages[{i}].role must be one of {', '.join(_ROLES)}, got {role!r}",
                           param="messages")
        content = m.get("content")
        if content is None:
            content = ""
        elif isinstance(content, list):  # content parts: only text ones
            texts = []
            for part in content:
                if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise ApiError(400, f"messages[{i}].content: only text parts are supported",
                                   param="messages")
                texts.append(part["text"])
            content = "".join(texts)
        elif not isinstance(content, str):
            raise ApiError(400, f"messages[{i}].content must be a string or a list of text parts",
                           param="messages")
        out.append({"role": "system" if role == "developer" else role, "content": content})
    return out


def sampling_params(data: dict, *, max_tokens: int, logprobs: int | None, vocab_size: int,
                    prompt_logprobs: int | None = None) -> SamplingParams:
    """The sampling fields shared by both endpoints (``max_tokens`` already resolved)."""
    stop = field(data, "stop", (str, list), [])
    if isinstance(stop, str):
        stop = [stop]
    bias = field(data, "logit_bias", dict, None)
    logit_bias = None
    if bias:
        logit_bias = {}
        for k, v in bias.items():
            try:
                tid = int(k)
            except ValueError:
                raise ApiError(400, f"logit_bias keys must be token ids, got {k!r}", param="logit_bias") from None
            if not 0 <= tid < vocab_size:
                raise ApiError(400, f"logit_bias token id {tid} is outside [0, {vocab_size})", param="logit_bias")
            if isinstance(v, bool) or not isinstance(v, int | float):
                raise ApiError(400, "logit_bias values must be numbers", param="logit_bias")
            logit_bias[tid] = float(v)
    stop_token_ids = field(data, "stop_token_ids", list, [])
    check_token_ids(stop_token_ids, vocab_size, "stop_token_ids")
    num = (int, float)
    try:
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=field(data, "temperature", num, 1.0),
            top_p=field(data, "top_p", num, 1.0),
            top_k=field(data, "top_k", int, 0),
            min_p=field(data, "min_p", num, 0.0),
            seed=field(data, "seed", int, None),
            presence_penalty=field(data, "presence_penalty", num, 0.0),
            frequency_penalty=field(data, "frequency_penalty", num, 0.0),
            repetition_penalty=field(data, "repetition_penalty", num, 1.0),
            logit_bias=logit_bias,
            stop=stop,
            stop_token_ids=stop_token_ids,
            ignore_eos=field(data, "ignore_eos", bool, False),
            min_tokens=field(data, "min_tokens", int, 0),
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
        )
    except SamplingParamError as e:
        raise ApiError(400, str(e), param=e.param) from None
    except (TypeError, ValueError) as e:
        raise ApiError(400, f"Invalid sampling parameters: {e}") from None


def parse_n(data: dict) -> int:
    n = field(data, "n", int, 1)
    if not 1 <= n <= MAX_N:
        raise ApiError(400, f"n must be in [1, {MAX_N}], got {n}", param="n")
    return n


def resolve_max_tokens(data: dict, names: tuple[str, ...], prompt_lens: list[int], max_model_len: int,
                       default: int | None) -> int:
    """The requested completion length, checked against the context window.

    ``default`` None means: whatever room the longest prompt leaves (vLLM's chat default).
    """
    requested = None
    for name in names:
        v = field(data, name, int, None)
        if v is not None:
            if v < 1:
                raise ApiError(400, f"{name} must be at least 1, got {v}", param=name)
            requested = v
            break
    longest = max(prompt_lens)
    if longest >= max_model_len:
        raise ApiError(400, f"This model's maximum context length is {max_model_len} tokens. However, "
                       f"your prompt has {longest} tokens, leaving no room for the completion. "
                       "Please reduce the length of the prompt.", param="prompt")
    if requested is None:
        return max_model_len - longest if default is None else min(default, max_model_len - longest)
    if longest + requested > max_model_len:
        raise ApiError(400, f"This model's maximum context length is {max_model_len} tokens. However, you "
                       f"requested {longest + requested} tokens ({longest} in the prompt, {requested} in "
                       "the completion). Please reduce the length of the prompt or the completion.",
                       param=names[0])
    return requested
