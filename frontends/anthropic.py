"""Anthropic's Messages API, ``POST /v1/messages`` (and ``/v1/messages/count_tokens``): over the chat machinery.

As llama.cpp's server and vLLM serve it, so that Anthropic's SDK, and the tools built on it, talk to
an open model. A body is turned into a chat-completions one (``to_chat``) and runs as a chat does
(the same checks, template, tools and thinking); ``MessagesFormat`` then writes what the chat
produced as a Message: content blocks (``thinking``, ``text``, a ``tool_use`` per call) and a
``stop_reason``, or streamed as its events (``message_start``, ``content_block_start`` /
``_delta`` / ``_stop`` per block, ``message_delta``, ``message_stop``).

Input: ``system`` (a string or text blocks), ``messages`` (text, ``tool_use`` and ``tool_result``
blocks; earlier ``thinking`` blocks are dropped, as chat templates drop earlier thinking), ``tools``
(custom tools: ``name``, ``description``, ``input_schema``), ``tool_choice`` (``auto``, ``any``,
``tool``, ``none``; ``disable_parallel_tool_use``), ``max_tokens`` (required, as Anthropic's),
``stop_sequences``, ``temperature``, ``top_p``, ``top_k``, a last assistant message (a prefill: the
model goes on with it), ``thinking`` (``enabled`` / ``adaptive`` /
``disabled``: the template's ``enable_thinking``), ``output_config.format`` (a JSON schema the output is
held to; the beta's ``output_format`` too), ``metadata``, and the chat's own extra fields (``priority``,
``timeout``, ``cache_salt``, ``seed``...). Images, documents and server tools are a 400.
"""

from __future__ import annotations

import os
from typing import Any

import orjson

from frontends import openai_params as op
from frontends.errors import ApiError, shown
from frontends.generation import Generation, Update
from frontends.responses import ItemWriter
from frontends.tools import check_tool

# chat fields a Messages body may carry as they are (tokenmill's and vLLM's extras)
_PASSED = ("model", "temperature", "top_p", "top_k", "priority", "timeout", "cache_salt", "seed", "min_p",
           "repetition_penalty", "presence_penalty", "frequency_penalty", "repeat_last_n", "stop_token_ids",
           "chat_template_kwargs", "ignore_eos", "min_tokens", "logit_bias", "skip_special_tokens", "stream",
           "structured_outputs", "guided_json", "guided_choice", "guided_regex", "guided_grammar", "grammar",
           "json_schema", "allowed_token_ids", "bad_words", "include_stop_str_in_output", *op.LLAMACPP_SAMPLERS)
MESSAGES_PARAMS = {"stop": "stop_sequences", "max_completion_tokens": "max_tokens",  # chat -> here, in refusals
                   "response_format": "output_config"}
_WORDS = (("tool_choice 'required'", "tool_choice {'type': 'any'}"),  # the chat's words -> this API's
          ("a named function", "{'type': 'tool', 'name': ...}"), ("max_completion_tokens", "max_tokens"))
_STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}


def _new_id(prefix: str) -> str:
    return f"{prefix}_{os.urandom(12).hex()}"


# HTTP status -> Anthropic's error type (the others: invalid_request_error below 500, api_error from it)
_ERROR_TYPES = {401: "authentication_error", 403: "permission_error", 404: "not_found_error", 408: "timeout_error",
                413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error"}


def error(e: ApiError) -> dict:
    """``e`` as Anthropic's error object (its ``param`` kept: a client may show where)."""
    kind = _ERROR_TYPES.get(e.status, "invalid_request_error" if e.status < 500 else "api_error")
    return {"type": kind, "message": e.message, "param": e.param}


def error_body(e: ApiError) -> dict:
    """Anthropic's error shape, ``{"type": "error", "error": {"type", "message"}}``, as vLLM answers on these
    routes (``frontends.http.shaped_errors``)."""
    return {"type": "error", "error": error(e)}


def renamed(e: ApiError) -> ApiError:
    """A chat's refusal, named as this API names its fields."""
    e.renamed(MESSAGES_PARAMS)
    for chat, here in _WORDS:
        e.message = e.message.replace(chat, here)
    return e


def _text_of(content: Any, where: str, param: str = "messages") -> str:
    """A string, or a list of text blocks, as text."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for block in content:
            if not (isinstance(block, dict) and block.get("type") == "text" and isinstance(block.get("text"), str)):
                raise ApiError(400, f"{where}: only text blocks are supported here", param=param)
            texts.append(block["text"])
        return "".join(texts)
    raise ApiError(400, f"{where} must be a string or a list of text blocks", param=param)


def _messages(data: dict) -> list[dict]:
    """``system`` and ``messages`` as chat messages."""
    out: list[dict] = []
    system = data.get("system")
    if system is not None:
        out.append({"role": "system", "content": _text_of(system, "system", "system")})
    messages = data.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "'messages' must be a non-empty list", param="messages")
    # the tool_use ids of the turn before (a tool_result's id must be one), and of this one: consecutive messages of
    # one role are one turn, as Anthropic's API combines them
    before: set = set()
    used: set = set()
    last_role = None
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ("user", "assistant"):
            raise ApiError(400, f"messages[{i}] must be an object with the role 'user' or 'assistant'",
                           param="messages")
        role, content = m["role"], m.get("content")
        if role != last_role:
            before, used, last_role = used, set(), role
        if isinstance(content, str):
            out.append({"role": role, "content": content})
            continue
        if not isinstance(content, list) or not content:
            raise ApiError(400, f"messages[{i}].content must be a string or a non-empty list of blocks",
                           param="messages")
        texts: list[str] = []
        parts: list[dict] = []  # texts and images, in order, where the message holds images
        calls: list[dict] = []
        for j, block in enumerate(content):
            where = f"messages[{i}].content[{j}]"
            kind = block.get("type") if isinstance(block, dict) else None
            if kind == "text":
                if not isinstance(block.get("text"), str):  # (it fell through to "text blocks are not supported")
                    raise ApiError(400, f"{where}: a text block needs its text, a string", param="messages")
                texts.append(block["text"])
                parts.append({"type": "text", "text": block["text"]})
            elif kind == "image" and role == "user":
                parts.append({"type": "image_url", "image_url": {"url": _image_url(block.get("source"), where)}})
            elif kind == "tool_use" and role == "assistant":
                if not (isinstance(block.get("id"), str) and isinstance(block.get("name"), str)
                        and isinstance(block.get("input"), dict)):
                    raise ApiError(400, f"{where}: a tool_use block needs id, name and an input object",
                                   param="messages")
                try:
                    arguments = orjson.dumps(block["input"]).decode()
                except orjson.JSONEncodeError:  # (nested past orjson's 254 levels, an integer past 64 bits)
                    raise ApiError(400, f"{where}.input cannot be written as JSON (nested too deep?)",
                                   param="messages") from None
                calls.append({"id": block["id"], "type": "function", "function": {"name": block["name"],
                                                                                  "arguments": arguments}})
                used.add(block["id"])
            elif kind == "tool_result" and role == "user":
                if not isinstance(block.get("tool_use_id"), str):
                    raise ApiError(400, f"{where}: a tool_result block needs its tool_use_id", param="messages")
                if block["tool_use_id"] not in before:  # (as Anthropic's API: the template would answer no call)
                    raise ApiError(400, f"{where}: unexpected tool_use_id {shown(block['tool_use_id'])!r}: each "
                                   "tool_result block must answer a tool_use block of the turn before",
                                   param="messages")
                result = block.get("content", "")
                text = _text_of(result, f"{where}.content")
                if block.get("is_error") is True:
                    text = f"Error: {text}"
                out.append({"role": "tool", "tool_call_id": block["tool_use_id"], "content": text})
            elif kind not in ("thinking", "redacted_thinking") or role != "assistant":
                raise ApiError(400, f"{where}: blocks of type {kind!r} are not supported in a {role} message here "
                               "(text, tool_use from the assistant, tool_result and image from the user are)",
                               param="messages")
        if len(parts) > len(texts):  # (a user's: text and images)
            out.append({"role": role, "content": parts})
        elif texts or calls or role == "assistant":  # (an assistant's turn of thinking only: still its turn)
            msg: dict = {"role": role, "content": "".join(texts)}
            if calls:
                msg |= {"content": msg["content"] or None, "tool_calls": calls}
            out.append(msg)
    return out


def _image_url(source: Any, where: str) -> str:
    """An image block's ``source`` as the chat's image URL: base64 data as a ``data:`` URL (``frontends.media``
    reads them, and URLs where the server allows)."""
    if isinstance(source, dict) and source.get("type") == "base64" and isinstance(source.get("data"), str) \
            and isinstance(source.get("media_type"), str):
        return f"data:{source['media_type']};base64,{source['data']}"
    if isinstance(source, dict) and source.get("type") == "url" and isinstance(source.get("url"), str):
        return source["url"]
    raise ApiError(400, f"{where}: an image's source must be base64 data (type, media_type, data) or a url",
                   param="messages")


def to_chat(data: dict) -> dict:
    """A Messages body as the chat-completions body that runs it (only the checks this API's own
    shapes need: the chat's checks do the rest)."""
    if data.get("mcp_servers"):
        raise ApiError(400, "MCP servers are not supported here", param="mcp_servers")
    chat: dict[str, Any] = {k: data[k] for k in _PASSED if k in data}
    chat["messages"] = _messages(data)
    last = chat["messages"][-1]
    if last["role"] == "assistant" and last["content"] and not last.get("tool_calls"):  # a prefill: go on with it
        chat |= {"continue_final_message": True, "add_generation_prompt": False}
    max_tokens = op.whole(data.get("max_tokens"))
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
        raise ApiError(400, "max_tokens: a positive integer is required", param="max_tokens")
    chat["max_tokens"] = max_tokens
    if data.get("stop_sequences") is not None:
        chat["stop"] = data["stop_sequences"]
    tools = data.get("tools")
    if tools is not None and not isinstance(tools, list):  # ({}, 0, "" and false too: they passed as none)
        raise ApiError(400, "'tools' must be a list", param="tools")
    tools = tools or None
    if tools is not None:
        for i, t in enumerate(tools):
            if not isinstance(t, dict) or t.get("type", "custom") != "custom" or "input_schema" not in t:
                raise ApiError(400, f"tools[{i}]: only custom tools (name, description, input_schema) are "
                               "supported here", param="tools")
            check_tool(i, t.get("name"), t["input_schema"], ("name", "input_schema"))
        chat["tools"] = [{"type": "function", "function": {"name": t.get("name"), "parameters": t["input_schema"],
                                                           **({"description": t["description"]}
                                                              if "description" in t else {})}} for t in tools]
    choice = data.get("tool_choice")
    if choice is not None:
        kind = choice.get("type") if isinstance(choice, dict) else None
        if kind not in ("auto", "any", "tool", "none"):
            raise ApiError(400, "tool_choice must be {'type': 'auto' | 'any' | 'tool' | 'none'}", param="tool_choice")
        if tools is None and kind in ("any", "tool"):
            raise ApiError(400, f"tool_choice {{'type': '{kind}'}} needs tools", param="tool_choice")
        if tools is not None or kind == "none":
            chat["tool_choice"] = ({"type": "function", "function": {"name": choice.get("name")}} if kind == "tool"
                                   else "required" if kind == "any" else kind)
        parallel = choice.get("disable_parallel_tool_use")
        if parallel is not None and not isinstance(parallel, bool):
            raise ApiError(400, "tool_choice.disable_parallel_tool_use must be true or false", param="tool_choice")
        if parallel:
            chat["parallel_tool_calls"] = False
    thinking = data.get("thinking")
    if thinking is not None:
        kind = thinking.get("type") if isinstance(thinking, dict) else None
        if kind not in ("enabled", "adaptive", "between_tools", "disabled"):
            raise ApiError(400, "thinking must be {'type': 'enabled' | 'adaptive' | 'disabled'}", param="thinking")
        budget = thinking.get("budget_tokens")  # (not read: the template's switch is all there is)
        if budget is not None and (isinstance(budget, bool) or not isinstance(budget, int) or budget < 1):
            raise ApiError(400, "thinking.budget_tokens must be a positive integer", param="thinking")
        kwargs = chat.get("chat_template_kwargs")
        if kwargs is not None and not isinstance(kwargs, dict):
            raise ApiError(400, "chat_template_kwargs must be an object", param="chat_template_kwargs")
        chat["chat_template_kwargs"] = {"enable_thinking": kind != "disabled", **(kwargs or {})}
    for name in ("output_config", "output_format"):  # structured output: today's field, and its beta's
        config = data.get(name)
        if config is None:
            continue
        if not isinstance(config, dict):
            raise ApiError(400, f"{name} must be an object", param=name)
        fmt = config.get("format") if name == "output_config" else config
        if fmt is not None:
            if not (isinstance(fmt, dict) and fmt.get("type") == "json_schema" and isinstance(fmt.get("schema"), dict)):
                raise ApiError(400, f"{name}: a format must be {{'type': 'json_schema', 'schema': {{...}}}}", param=name)
            chat["response_format"] = {"type": "json_schema", "json_schema": {"name": "output", "schema": fmt["schema"]}}
    metadata = data.get("metadata")
    if metadata is not None and not isinstance(metadata, dict):
        raise ApiError(400, "metadata must be an object", param="metadata")
    if chat.get("continue_final_message"):  # a format or forced tool would hold only what follows the prefill
        held = op.structured_fields(chat)
        if held or isinstance(chat.get("tool_choice"), dict) or chat.get("tool_choice") == "required":
            name = (held or ["tool_choice"])[0]
            if name == "response_format":
                name = "output_config" if data.get("output_config") is not None else "output_format"
            raise ApiError(400, f"a prefilled answer (a last assistant message) cannot be held to {name}: it would "
                           "hold only what follows the prefill", param=name)
    return chat


class MessagesFormat(ItemWriter):
    """What a chat generation produced, as a Message (``response``) or its events (``chunk``): both
    built by ``_take`` from the same ordered parts of the answer, so they hold the same blocks."""

    TYPES = {"reasoning": "thinking", "text": "text"}

    DONE = b""  # no [DONE] line: the stream ends after message_stop

    def __init__(self, api_model: str, gen: Generation, chat_fmt) -> None:
        self.gen, self.chat = gen, chat_fmt
        self.answer = chat_fmt.answers[0] if chat_fmt.answers is not None else None
        self.named = self.answer is not None and self.answer.calls is not None and self.answer.calls.mode == "named"
        self.items: list[dict] = []  # content blocks done, in order
        self.open: dict | None = None  # the block being written
        self.base = {"id": gen.api_id.replace("-", "_"), "type": "message", "role": "assistant", "model": api_model}

    def _stop(self) -> dict:
        choice = self.gen.choices[0]
        reason = self.chat.finish_reason(choice)
        if reason == "stop" and any(b["type"] == "tool_use" for b in self.items):  # (a named tool: "stop")
            reason = "tool_calls"
        if reason == "stop" and isinstance(choice.stop_reason, str):
            return {"stop_reason": "stop_sequence", "stop_sequence": choice.stop_reason}
        return {"stop_reason": _STOP_REASONS.get(reason, reason), "stop_sequence": None}

    def _usage(self, final: bool = True) -> dict:
        usage = self.gen.usage()
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
        return {"input_tokens": usage["prompt_tokens"] - cached, "cache_read_input_tokens": cached,
                "cache_creation_input_tokens": 0, "output_tokens": usage["completion_tokens"] if final else 0}

    # ------------------------------------------------------------------ whole

    def collect(self, updates: list[Update]) -> None:
        self.chat.collect(updates)

    def response(self) -> dict:
        self._take(self._parts(self.chat.texts[0], True), finished=True)  # the events are not sent
        return {**self.base, "content": self.items, **self._stop(), "usage": self._usage()}

    # ------------------------------------------------------------------ streamed

    @staticmethod
    def _event(kind: str, **fields) -> bytes:
        return b"event: " + kind.encode() + b"\ndata: " + orjson.dumps({"type": kind, **fields}) + b"\n\n"

    def stream_head(self) -> bytes:
        return self._event("message_start", message={**self.base, "content": [], "stop_reason": None,
                                                      "stop_sequence": None, "usage": self._usage(final=False)})

    def chunk(self, updates: list[Update]) -> bytes:
        out = b""
        for up in updates:
            out += self._take(self._parts(up.text, up.finished), up.finished)
            if up.finished:
                out += (self._event("message_delta", delta=self._stop(), usage=self._usage())
                        + self._event("message_stop"))
        return out

    def stream_error(self, e: ApiError) -> bytes:
        """An engine failure mid-stream: the open block closed, then Anthropic's error event."""
        return self._close() + self._event("error", error=error(e))

    def _new_item(self, kind: str) -> dict:
        return {"type": "thinking", "thinking": "", "signature": ""} if kind == "thinking" else {"type": "text", "text": ""}

    def _call_item(self, call: dict) -> dict:
        return {"type": "tool_use", "id": _new_id("toolu"), "name": call["function"]["name"], "input": {}}

    def _open(self, block: dict) -> bytes:
        self.open = block
        return self._event("content_block_start", index=len(self.items), content_block=block)

    def _grow(self, text: str) -> bytes:
        """More text for the open block: its text or thinking, or a call's arguments (JSON so far)."""
        block = self.open
        if block["type"] == "tool_use" and not block.get("arguments"):
            text = text.lstrip()  # (clients parse the JSON so far at each delta: whitespace alone is none)
        if not text:
            return b""
        if block["type"] == "tool_use":
            block["arguments"] = block.get("arguments", "") + text
            delta = {"type": "input_json_delta", "partial_json": text}
        elif block["type"] == "thinking":
            block["thinking"] += text
            delta = {"type": "thinking_delta", "thinking": text}
        else:
            block["text"] += text
            delta = {"type": "text_delta", "text": text}
        return self._event("content_block_delta", index=len(self.items), delta=delta)

    def _close(self, last: bool = False) -> bytes:
        block, self.open = self.open, None
        if block is None:
            return b""
        if block["type"] == "tool_use":
            arguments = block.pop("arguments", "")
            try:
                block["input"] = orjson.loads(arguments) if arguments else {}
            except orjson.JSONDecodeError:  # (cut short by max_tokens)
                block["input"] = {}
        self.items.append(block)
        return self._event("content_block_stop", index=len(self.items) - 1)

