"""OpenAI's Responses API, ``POST /v1/responses``, stateless: over the chat machinery.

A body is turned into a chat-completions one (``to_chat``) and runs as a chat does (the same
checks, template, tools and thinking); ``ResponsesFormat`` then writes what the chat produced as
a Response: output items (a ``reasoning`` item for the thinking, a ``message`` with one
``output_text``, a ``function_call`` item per call), or streamed as Response events
(``response.created`` ... ``response.output_text.delta`` ... ``response.completed``).

Input: ``input`` as text or a list of items (messages with text content, ``function_call`` and
``function_call_output`` items; ``reasoning`` items are dropped), ``instructions`` (a system
message first), ``tools`` (function tools, flat as this API writes them), ``tool_choice``,
``parallel_tool_calls``, ``text.format`` (structured output), ``max_output_tokens``,
``temperature``, ``top_p`` and the chat's own extra fields (``priority``, ``timeout``,
``cache_salt``, ``seed``, ``stop``, ``chat_template_kwargs``...). Nothing is stored: a
``previous_response_id`` or ``conversation`` is a 400, as are other tool types and item types.
"""

from __future__ import annotations

import os
import time
from typing import Any

import orjson

from frontends.errors import ApiError
from frontends.generation import Generation, Update

# chat fields a Responses body may carry as they are
_PASSED = ("model", "temperature", "top_p", "parallel_tool_calls", "user", "priority", "timeout", "cache_salt",
           "seed", "top_k", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty", "stop",
           "stop_token_ids", "chat_template_kwargs", "include_reasoning", "ignore_eos", "min_tokens", "logit_bias")
_UNSTORED = ("previous_response_id", "conversation", "prompt")  # they name state this server does not keep


def _new_id(prefix: str) -> str:
    return f"{prefix}_{os.urandom(12).hex()}"


def _text_of(content: Any, where: str) -> str:
    """A message's content: a string, or a list of text parts (input_text / output_text / text)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if not (isinstance(part, dict) and part.get("type") in ("input_text", "output_text", "text")
                    and isinstance(part.get("text"), str)):
                raise ApiError(400, f"{where}: only text parts (input_text, output_text) are supported", param="input")
            texts.append(part["text"])
        return "".join(texts)
    raise ApiError(400, f"{where} must be a string or a list of text parts", param="input")


def _messages(data: dict) -> list[dict]:
    """``instructions`` and ``input`` as chat messages."""
    messages: list[dict] = []
    instructions = data.get("instructions")
    if instructions is not None:
        if not isinstance(instructions, str):
            raise ApiError(400, "'instructions' must be a string", param="instructions")
        messages.append({"role": "system", "content": instructions})
    items = data.get("input")
    if isinstance(items, str):
        return [*messages, {"role": "user", "content": items}]
    if not isinstance(items, list) or not items:
        raise ApiError(400, "'input' must be a string or a non-empty list of items", param="input")
    for i, item in enumerate(items):
        if not isinstance(item, dict):
            raise ApiError(400, f"input[{i}] must be an object", param="input")
        kind = item.get("type", "message")
        if kind == "message":
            messages.append({"role": item.get("role"), "content": _text_of(item.get("content"), f"input[{i}].content")})
        elif kind == "function_call":
            call = {"id": item.get("call_id"), "type": "function",
                    "function": {"name": item.get("name"), "arguments": item.get("arguments")}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and "tool_calls" in last:
                last["tool_calls"].append(call)  # parallel calls: one assistant turn
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            messages.append({"role": "tool", "tool_call_id": item.get("call_id"),
                             "content": _text_of(item.get("output"), f"input[{i}].output")})
        elif kind != "reasoning":  # earlier thinking: chat templates drop it from the history anyway
            raise ApiError(400, f"input[{i}]: items of type {kind!r} are not supported (message, function_call, "
                           "function_call_output are)", param="input")
    return messages


def to_chat(data: dict) -> dict:
    """A Responses body as the chat-completions body that runs it (only the checks this API's own
    shapes need: the chat's checks do the rest)."""
    for name in _UNSTORED:
        if data.get(name) is not None:
            raise ApiError(400, f"'{name}' needs stored responses, and this server stores none: send the whole "
                           "conversation in 'input'", param=name)
    if data.get("background"):
        raise ApiError(400, "background responses are not supported", param="background")
    chat: dict[str, Any] = {k: data[k] for k in _PASSED if k in data}
    chat["messages"] = _messages(data)
    if data.get("max_output_tokens") is not None:
        chat["max_tokens"] = data["max_output_tokens"]
    tools = data.get("tools")
    if tools is not None:
        if not isinstance(tools, list):
            raise ApiError(400, "'tools' must be a list", param="tools")
        for i, t in enumerate(tools):
            if not isinstance(t, dict) or t.get("type") != "function":
                raise ApiError(400, f"tools[{i}]: only function tools are supported", param="tools")
        chat["tools"] = [{"type": "function", "function": {k: t[k] for k in ("name", "description", "parameters")
                                                           if k in t}} for t in tools]
    choice = data.get("tool_choice")
    if isinstance(choice, dict) and choice.get("type") == "function":
        choice = {"type": "function", "function": {"name": choice.get("name")}}
    if choice is not None and (tools is not None or choice != "none"):
        chat["tool_choice"] = choice
    text = data.get("text")
    fmt = text.get("format") if isinstance(text, dict) else None
    if fmt is not None:
        if not isinstance(fmt, dict):
            raise ApiError(400, "text.format must be an object", param="text")
        if fmt.get("type") == "json_schema":
            chat["response_format"] = {"type": "json_schema", "json_schema": {"name": fmt.get("name"),
                                                                              "schema": fmt.get("schema")}}
        else:
            chat["response_format"] = fmt
    return chat


class ResponsesFormat:
    """What a chat generation produced, as a Response (``response``) or its events (``chunk``)."""

    DONE = b""  # no [DONE] line: the stream ends after response.completed (or .incomplete)
    include_usage = False

    def __init__(self, api_model: str, data: dict, gen: Generation, chat_fmt) -> None:
        self.gen, self.chat = gen, chat_fmt
        self.answer = chat_fmt.answers[0] if chat_fmt.answers is not None else None
        self.text = ""  # the whole text, when there is no answer to split it
        self.seq = 0
        self.items: list[dict] = []  # output items, in order
        self.open: dict | None = None  # the reasoning item or message being written (streaming)
        self.open_text = ""  # ... and its text so far
        self.calls: dict[int, dict] = {}  # tool-call index -> its function_call item
        tools = data.get("tools") or []
        self.base = {
            "id": gen.api_id, "object": "response", "created_at": int(time.time()), "model": api_model,
            "instructions": data.get("instructions"), "metadata": data.get("metadata"),
            "max_output_tokens": data.get("max_output_tokens"), "parallel_tool_calls": data.get("parallel_tool_calls", True),
            "temperature": data.get("temperature"), "top_p": data.get("top_p"), "tools": tools,
            "tool_choice": data.get("tool_choice", "auto" if tools else "none"), "store": False,
            "text": data.get("text") or {"format": {"type": "text"}}, "truncation": "disabled", "error": None,
            "incomplete_details": None, "previous_response_id": None, "reasoning": data.get("reasoning"),
            "user": data.get("user"),
        }

    # ------------------------------------------------------------------ whole

    def collect(self, updates: list[Update]) -> None:
        self.chat.collect(updates)

    def response(self) -> dict:
        choice = self.gen.choices[0]
        if self.answer is not None:
            self.answer.delta(self.chat.texts[0], True)
            thought, content, calls = self.answer.reasoning, self.answer.content, self._answer_calls()
        else:
            thought, content, calls = "", self.chat.texts[0], []
        items = []
        if thought:
            items.append(self._reasoning(thought))
        if content or not calls:
            items.append(self._message(content, choice.finish_reason))
        items += [self._function_call(c, "completed") for c in calls]
        return self._response(items)

    def _answer_calls(self) -> list[dict]:
        return self.answer.calls.calls if self.answer.calls is not None else []

    def _response(self, items: list[dict]) -> dict:
        reason = self.gen.choices[0].finish_reason
        usage = self.gen.usage()
        return {**self.base, "status": "incomplete" if reason in ("length", "timeout") else "completed",
                "completed_at": int(time.time()),
                "incomplete_details": ({"reason": "max_output_tokens" if reason == "length" else reason}
                                       if reason in ("length", "timeout") else None),
                "output": items, "usage": {
                    "input_tokens": usage["prompt_tokens"], "output_tokens": usage["completion_tokens"],
                    "total_tokens": usage["total_tokens"],
                    "input_tokens_details": {"cached_tokens": (usage.get("prompt_tokens_details") or {}).get(
                        "cached_tokens", 0)},
                    "output_tokens_details": {"reasoning_tokens": 0}}}

    @staticmethod
    def _reasoning(text: str, item_id: str | None = None) -> dict:
        return {"id": item_id or _new_id("rs"), "type": "reasoning", "summary": [], "status": "completed",
                "content": [{"type": "reasoning_text", "text": text}]}

    @staticmethod
    def _message(text: str, reason: str | None, item_id: str | None = None) -> dict:
        return {"id": item_id or _new_id("msg"), "type": "message", "role": "assistant",
                "status": "incomplete" if reason in ("length", "timeout") else "completed",
                "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]}

    @staticmethod
    def _function_call(call: dict, status: str, item_id: str | None = None) -> dict:
        return {"id": item_id or _new_id("fc"), "type": "function_call", "call_id": call["id"],
                "name": call["function"]["name"], "arguments": call["function"]["arguments"], "status": status}

    # ------------------------------------------------------------------ streamed

    def _event(self, kind: str, **fields) -> bytes:
        self.seq += 1
        return b"event: " + kind.encode() + b"\ndata: " + orjson.dumps(
            {"type": kind, "sequence_number": self.seq - 1, **fields}) + b"\n\n"

    def stream_head(self) -> bytes:
        head = {**self.base, "status": "in_progress", "output": [], "usage": None}
        return self._event("response.created", response=head) + self._event("response.in_progress", response=head)

    def chunk(self, updates: list[Update]) -> bytes:
        out = []
        for up in updates:
            if self.answer is not None:
                delta = self.answer.delta(up.text, up.finished)
            else:
                self.text += up.text
                delta = {"content": up.text} if up.text else {}
            if delta.get("reasoning_content"):
                out.append(self._write("reasoning", delta["reasoning_content"]))
            if delta.get("content"):
                out.append(self._write("message", delta["content"]))
            for d in delta.get("tool_calls", ()):
                out.append(self._call_delta(d))
            if up.finished:
                out.append(self._close())
                out += [self._finish_call(c) for c in self.calls.values() if c["status"] != "completed"]
                if not any(i["type"] == "message" for i in self.items) and not self.calls:
                    out.append(self._write("message", "") + self._close())  # an empty answer is still a message
                done = "response.incomplete" if up.choice.finish_reason in ("length", "timeout") else "response.completed"
                out.append(self._event(done, response=self._response(self.items)))
        return b"".join(out)

    def _write(self, kind: str, text: str) -> bytes:
        """``text`` into the open item of ``kind`` (a reasoning item or a message), opening it first."""
        out = b""
        if self.open is None or self.open["type"] != kind:
            out += self._close()
            item = self._reasoning("") if kind == "reasoning" else self._message("", None)
            item["status"], item["content"] = "in_progress", []
            self.open, self.open_text = item, ""
            out += self._event("response.output_item.added", output_index=len(self.items), item=item)
            part = {"type": "reasoning_text", "text": ""} if kind == "reasoning" else {
                "type": "output_text", "text": "", "annotations": [], "logprobs": []}
            out += self._event("response.content_part.added", item_id=item["id"], output_index=len(self.items),
                               content_index=0, part=part)
        self.open_text += text
        kind_delta = "response.reasoning_text.delta" if kind == "reasoning" else "response.output_text.delta"
        extra = {} if kind == "reasoning" else {"logprobs": []}
        return out + self._event(kind_delta, item_id=self.open["id"], output_index=len(self.items), content_index=0,
                                 delta=text, **extra)

    def _close(self) -> bytes:
        """Finish the open reasoning item or message: its done events."""
        item, self.open = self.open, None
        if item is None:
            return b""
        index, text = len(self.items), self.open_text
        if item["type"] == "reasoning":
            done = self._reasoning(text, item["id"])
            part = done["content"][0]
            out = self._event("response.reasoning_text.done", item_id=item["id"], output_index=index,
                              content_index=0, text=text)
        else:
            done = self._message(text, self.gen.choices[0].finish_reason, item["id"])
            part = done["content"][0]
            out = self._event("response.output_text.done", item_id=item["id"], output_index=index, content_index=0,
                              text=text, logprobs=[])
        out += self._event("response.content_part.done", item_id=item["id"], output_index=index, content_index=0,
                           part=part)
        self.items.append(done)
        return out + self._event("response.output_item.done", output_index=index, item=done)

    def _call_delta(self, d: dict) -> bytes:
        """A chat tool-call delta: a whole call (its item added and done at once), or a named function's
        first piece (the item opens) or a later one (its arguments grow)."""
        out = b""
        if "id" in d:  # a new call
            out += self._close()
            item = self._function_call(d, "in_progress")
            item["arguments"] = ""
            self.calls[d["index"]] = item
            out += self._event("response.output_item.added", output_index=len(self.items), item=item)
        item = self.calls[d["index"]]
        piece = d["function"].get("arguments", "")
        item["arguments"] += piece
        index = len(self.items)
        if piece:
            out += self._event("response.function_call_arguments.delta", item_id=item["id"], output_index=index,
                               delta=piece)
        named = self.answer is not None and self.answer.calls is not None and self.answer.calls.mode == "named"
        if not named:  # whole already: done at once
            out += self._finish_call(item)
        return out

    def _finish_call(self, item: dict) -> bytes:
        index = len(self.items)
        item["status"] = "completed"
        self.items.append(item)
        return (self._event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                            arguments=item["arguments"])
                + self._event("response.output_item.done", output_index=index, item=item))

    def stream_error(self, e: ApiError) -> bytes:
        return self._event("error", code=str(e.code or e.status), message=e.message, param=e.param)
