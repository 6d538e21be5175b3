"""OpenAI's Responses API, ``POST /v1/responses``, over the chat machinery.

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
``cache_salt``, ``seed``, ``stop``, ``chat_template_kwargs``...). With ``store`` (where the server
keeps Responses: ``response_store``), a finished Response is kept, and ``previous_response_id``
continues its conversation, as ``conversation`` continues (and grows) a stored conversation's items;
other tool types and item types are 400s.
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Awaitable, Callable
from typing import Any

import orjson

from frontends import openai_params as op
from frontends.errors import ApiError, shown
from frontends.generation import Generation, Update, text_ids
from frontends.openai_params import LLAMACPP_SAMPLERS, MAX_LOGPROBS
from frontends.response_store import Keep
from frontends.tools import check_tool

# chat fields a Responses body may carry as they are
_PASSED = ("model", "temperature", "top_p", "parallel_tool_calls", "user", "priority", "timeout", "cache_salt",
           "prompt_cache_key",
           "seed", "top_k", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty", "repeat_last_n",
           "stop", "stop_token_ids", "chat_template_kwargs", "include_reasoning", "ignore_eos", "min_tokens",
           "logit_bias", "skip_special_tokens", "structured_outputs", "guided_json", "guided_choice", "guided_regex",
           "guided_grammar", "grammar", "json_schema", "allowed_token_ids", "bad_words", "include_stop_str_in_output",
           *LLAMACPP_SAMPLERS)
_ROLES = ("user", "assistant", "system", "developer")  # a message item's
# what a stored input item's id begins with, by its type (OpenAI's prefixes)
_ITEM_IDS = {"message": "msg", "function_call": "fc", "function_call_output": "fco", "reasoning": "rs"}
# the chat's and completions' own fields, which would change the answer there: unknown here (as OpenAI answers)
_OTHER_APIS = {"n": "one Response is one answer", "best_of": "one Response is one answer",
               "logprobs": "include ['message.output_text.logprobs']", "max_tokens": "max_output_tokens",
               "max_completion_tokens": "max_output_tokens", "messages": "input", "response_format": "text.format",
               "echo": None, "suffix": None}
RESPONSES_PARAMS = {"max_tokens": "max_output_tokens", "max_completion_tokens": "max_output_tokens",  # chat -> here
                    "response_format": "text", "messages": "input"}
LOGPROBS = "message.output_text.logprobs"  # what ``include`` names to have each output_text's logprobs
# what else ``include`` may name (OpenAI's): accepted, with nothing of them here to include
INCLUDABLE = (LOGPROBS, "reasoning.encrypted_content", "message.input_image.image_url", "file_search_call.results",
              "web_search_call.results", "web_search_call.action.sources", "computer_call_output.output.image_url",
              "code_interpreter_call.outputs")


def new_id(prefix: str) -> str:
    """An id none can guess (a stored thing's is all it takes to read it back), in OpenAI's shape."""
    return f"{prefix}_{os.urandom(16).hex()}"


def _text_of(content: Any, where: str) -> str:
    """A message's content: a string, or a list of text parts (input_text / output_text / text, and an assistant's
    refusal: its words)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if isinstance(part, dict) and part.get("type") == "refusal" and isinstance(part.get("refusal"), str):
                texts.append(part["refusal"])
                continue
            if not (isinstance(part, dict) and part.get("type") in ("input_text", "output_text", "text")):
                raise ApiError(400, f"{where}: only text parts (input_text, output_text, refusal) are supported",
                               param=where.split("[", 1)[0])
            if not isinstance(part.get("text"), str):
                raise ApiError(400, f"{where}: {part['type']}'s 'text' must be a string",
                               param=where.split("[", 1)[0])
            texts.append(part["text"])
        return "".join(texts)
    raise ApiError(400, f"{where} must be a string or a list of text parts", param=where.split("[", 1)[0])


def _image_part(part: dict, where: str) -> dict:
    """An ``input_image`` part as the chat's ``image_url`` part (``frontends.media`` reads its URL)."""
    if not isinstance(part.get("image_url"), str):
        raise ApiError(400, f"{where}: an input_image needs its image_url (file_id is not supported)",
                       param=where.split("[", 1)[0])
    return {"type": "image_url", "image_url": {"url": part["image_url"]}}


def _messages(data: dict, sources: list[str], history: list[dict] = ()) -> list[dict]:
    """``instructions``, the ``history`` a ``previous_response_id`` or ``conversation`` continues (its items) and
    ``input``, as chat messages; ``sources`` gets where each came from ("instructions", "input[i]"), for the chat's refusals
    that name a message."""
    messages: list[dict] = []
    instructions = data.get("instructions")
    if instructions is not None:
        if not isinstance(instructions, str):
            raise ApiError(400, "'instructions' must be a string", param="instructions")
        messages.append({"role": "system", "content": instructions})
        sources.append("instructions")
    _read_items(history, "conversation" if data.get("conversation") is not None else "previous_response_id", messages,
                sources)
    items = data.get("input")
    if isinstance(items, str):
        sources.append("input")
        return [*messages, {"role": "user", "content": items}]
    if not isinstance(items, list) or not items:
        raise ApiError(400, "'input' must be a string or a non-empty list of items", param="input")
    _read_items(items, "input", messages, sources, answered=not history)
    return messages


def _read_items(items: list, name: str, messages: list[dict], sources: list[str], answered: bool = False) -> None:
    """The items of ``name`` (``input``, or the history ``previous_response_id`` or ``conversation`` continues) as
    chat messages after ``messages``; with ``answered``, a ``function_call_output`` must answer a ``function_call``
    before it, as OpenAI's API refuses one that answers none. Only where the request holds the whole conversation:
    a stored history may have lost the call (a call cut short is left out of it, and an item can be deleted), and
    a conversation's items may be added a few at a time."""
    called = {c["id"] for m in messages for c in m.get("tool_calls") or ()} if answered else None
    for i, item in enumerate(items):
        if not isinstance(item, dict):
            raise ApiError(400, f"{name}[{i}] must be an object", param=name)
        if item.get("id") is not None and not (isinstance(item["id"], str) and item["id"]):
            raise ApiError(400, f"{name}[{i}].id must be a non-empty string", param=name)
        kind = item.get("type", "message")
        if kind == "message":
            content = item.get("content")
            if isinstance(content, list) and any(isinstance(p, dict) and p.get("type") == "input_image"
                                                 for p in content):
                content = [_image_part(p, f"{name}[{i}].content[{j}]") if isinstance(p, dict)
                           and p.get("type") == "input_image" else {"type": "text", "text": _text_of([p], f"{name}[{i}]")}
                           for j, p in enumerate(content)]  # (the chat's parts: its checks do the rest)
            else:
                content = _text_of(content, f"{name}[{i}].content")
            messages.append({"role": item.get("role"), "content": content})
            sources.append(f"{name}[{i}]")
        elif kind == "function_call":
            if not all(isinstance(item.get(k), str) for k in ("call_id", "name", "arguments")):
                raise ApiError(400, f"{name}[{i}]: a function_call needs call_id, name and arguments, all strings",
                               param=name)
            try:  # (checked here, in this API's words: the chat it becomes would name its own message)
                orjson.loads(item["arguments"])
            except orjson.JSONDecodeError:
                raise ApiError(400, f"{name}[{i}].arguments is not JSON text", param=name) from None
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": item["name"], "arguments": item["arguments"]}}
            if called is not None:
                called.add(item["call_id"])
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)  # the calls of the turn that wrote them
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
                sources.append(f"{name}[{i}]")
        elif kind == "function_call_output":
            if not isinstance(item.get("call_id"), str):
                raise ApiError(400, f"{name}[{i}]: a function_call_output needs its call_id", param=name)
            if called is not None and item["call_id"] not in called:  # (a template would show an answer to no call)
                raise ApiError(400, f"{name}[{i}]: no function_call found for the function_call_output with call_id "
                               f"{shown(item['call_id'])!r}", param=name)
            messages.append({"role": "tool", "tool_call_id": item["call_id"],
                             "content": _text_of(item.get("output"), f"{name}[{i}].output")})
            sources.append(f"{name}[{i}]")
        elif kind == "reasoning":  # earlier thinking: chat templates drop it from the history anyway (it is kept)
            for part in ("summary", "content"):
                if not (item.get(part) is None or isinstance(item[part], list)
                        and all(isinstance(p, dict) for p in item[part])):
                    raise ApiError(400, f"{name}[{i}].{part} must be a list of objects", param=name)
        else:
            raise ApiError(400, f"{name}[{i}]: items of type {kind!r} are not supported (message, function_call, "
                           "function_call_output are)", param=name)


def to_chat(data: dict, sources: list[str] | None = None, history: list[dict] | None = None) -> dict:
    """A Responses body as the chat-completions body that runs it (only the checks this API's own
    shapes need: the chat's checks do the rest); ``sources``: as ``_messages`` fills it. ``history``: the
    items of the conversation its ``previous_response_id`` or ``conversation`` continues (``response_store``), where
    one is read."""
    if data.get("prompt") is not None:
        raise ApiError(400, "'prompt' names a stored prompt template, which this server does not keep", param="prompt")
    for name in ("previous_response_id", "conversation"):
        if data.get(name) is not None and history is None:  # (previous_response_id: OpenAI's code for one gone,
            raise ApiError(400, f"'{name}' needs stored state, and this server stores none (--responses-store-mib 0): "
                           "send the whole conversation in 'input'", param=name,  # which clients read to send it all)
                           code="previous_response_not_found" if name == "previous_response_id" else None)
    for name, ours in _OTHER_APIS.items():
        if name in data and not (name == "n" and data[name] in (1, None) and data[name] is not True):  # (n 1: one)
            hint = f"the Responses API's: {ours}" if ours else "the Responses API has none"
            raise ApiError(400, f"Unknown parameter: '{name}' ({hint})", param=name)
    truncation = data.get("truncation")
    if truncation not in (None, "auto", "disabled"):  # (before the input is weighed: "auto" may change its answer)
        raise ApiError(400, f"truncation must be 'auto' or 'disabled', got {truncation!r}", param="truncation")
    chat: dict[str, Any] = {k: data[k] for k in _PASSED if k in data}
    chat["messages"] = _messages(data, sources if sources is not None else [], history or ())
    top = _logprobs(data)
    if top is not None:
        chat["logprobs"], chat["top_logprobs"] = True, top
    reasoning = data.get("reasoning")
    effort = reasoning.get("effort") if isinstance(reasoning, dict) else None
    if effort is not None:  # (the chat's reasoning_effort, named here as this API names it)
        op.check_reasoning_effort(effort, "reasoning.effort", "reasoning")
        chat["reasoning_effort"] = effort
    if data.get("max_output_tokens") is not None:
        chat["max_tokens"] = data["max_output_tokens"]
    tools = data.get("tools") or None  # [] (some clients send it): none
    if tools is not None:
        if not isinstance(tools, list):
            raise ApiError(400, "'tools' must be a list", param="tools")
        for i, t in enumerate(tools):
            if not isinstance(t, dict) or t.get("type") != "function":
                raise ApiError(400, f"tools[{i}]: only function tools are supported", param="tools")
            check_tool(i, t.get("name"), t.get("parameters") or {}, ("name", "parameters"))  # (null: none, as OpenAI's)
        chat["tools"] = [{"type": "function", "function": {k: t[k] for k in ("name", "description", "parameters")
                                                           if t.get(k) is not None}} for t in tools]
    choice = data.get("tool_choice")
    if isinstance(choice, dict):  # (allowed_tools, a hosted tool's, a custom tool's: not here)
        if choice.get("type") != "function":
            raise ApiError(400, f"tool_choice of type {choice.get('type')!r} is not supported here: 'none', 'auto', "
                           "'required' or {'type': 'function', 'name': ...}", param="tool_choice")
        if not isinstance(choice.get("name"), str):  # (a chat's {'function': {'name'}} too: not this API's shape)
            raise ApiError(400, "tool_choice {'type': 'function'} needs name, a string (this API's shape: "
                           "{'type': 'function', 'name': ...})", param="tool_choice")
        choice = {"type": "function", "function": {"name": choice["name"]}}
    if choice is not None and (tools is not None or choice not in ("none", "auto")):
        chat["tool_choice"] = choice
    text = data.get("text")
    fmt = text.get("format") if isinstance(text, dict) else None
    if fmt is not None:
        if not isinstance(fmt, dict):
            raise ApiError(400, "text.format must be an object", param="text")
        if fmt.get("type") == "json_schema":
            if not isinstance(fmt.get("schema"), dict):  # (this API's shape, not chat's 'json_schema': {...})
                raise ApiError(400, "text.format of type 'json_schema' needs its 'schema', a JSON object: "
                               "{'type': 'json_schema', 'name': ..., 'schema': {...}}", param="text")
            if not isinstance(fmt.get("name"), str):  # (required, as OpenAI's; written back in the Response as it came)
                raise ApiError(400, "text.format of type 'json_schema' needs its 'name', a string", param="text")
            chat["response_format"] = {"type": "json_schema", "json_schema": {"name": fmt.get("name"),
                                                                              "schema": fmt.get("schema")}}
        else:
            chat["response_format"] = fmt
    return chat


# what a stored item keeps, by its type (OpenAI's fields; anything else a client sent is not kept), and of a part
_ITEM_FIELDS = {"message": ("id", "type", "role", "content", "status"),
                "function_call": ("id", "type", "call_id", "name", "arguments", "status"),
                "function_call_output": ("id", "type", "call_id", "output", "status"),
                "reasoning": ("id", "type", "summary", "content", "encrypted_content", "status")}
_PART_FIELDS = ("type", "text", "refusal", "image_url", "detail", "annotations", "logprobs")


def stored_items(items: str | list[dict]) -> list[dict]:
    """``input`` (or a conversation's new ``items``, checked as ``input``'s are) as stored items, in OpenAI's
    shape: text as one user message, a message's text as its one text part, OpenAI's fields alone (of an item and
    of its parts), each item with an id (one made for an item that came without) and a status."""
    if isinstance(items, str):
        items = [{"type": "message", "role": "user", "content": items}]
    out = []
    for item in items:
        kind = item.get("type", "message")
        kept = {k: item[k] for k in _ITEM_FIELDS[kind] if k in item}
        kept["type"] = kind
        if kept.get("id") is None:
            kept["id"] = new_id(_ITEM_IDS[kind])
        content = kept.get("content")
        if kind == "message" and isinstance(content, str):
            kept["content"] = [{"type": "output_text" if item.get("role") == "assistant" else "input_text",
                                "text": content}]
        for part in ("content", "summary", "output"):  # (lists of parts, checked: their fields as a part's)
            if isinstance(kept.get(part), list):
                kept[part] = [{k: p[k] for k in _PART_FIELDS if k in p} for p in kept[part]]
        if not isinstance(kept.get("encrypted_content", ""), str):
            del kept["encrypted_content"]
        if kept.get("status") is None:
            kept["status"] = "completed"
        out.append(kept)
    return out


def check_items(items: Any, name: str, most: int | None = None) -> list[dict]:
    """``items`` given to a conversation: a list of the items ``input`` may hold (at most ``most``), checked as
    ``input``'s are, and as the chat will read them (a message's role, an assistant's text parts alone): an item
    no Response could read is refused here, not at every turn after."""
    if not isinstance(items, list) or (most is not None and len(items) > most):
        raise ApiError(400, f"'{name}' must be a list of at most {most} items" if most else f"'{name}' must be a list",
                       param=name)
    _read_items(items, name, [], [])
    for i, item in enumerate(items):
        if item.get("status") not in (None, "in_progress", "completed", "incomplete"):
            raise ApiError(400, f"{name}[{i}].status must be in_progress, completed or incomplete", param=name)
        if item.get("type", "message") != "message":
            continue
        if item.get("role") not in _ROLES:
            raise ApiError(400, f"{name}[{i}].role must be one of {', '.join(_ROLES)}, got {item.get('role')!r}",
                           param=name)
        if item["role"] == "assistant" and isinstance(item.get("content"), list) and any(
                p.get("type") == "input_image" for p in item["content"]):
            raise ApiError(400, f"{name}[{i}]: an assistant's message holds text parts alone", param=name)
    return items


def check_unique(items: list[dict], name: str, seen: set[str] | None = None) -> None:
    """No two of ``items`` (stored items: each with its id), nor one of them and one of ``seen``, share an id: OpenAI's
    400 (a client that sends an earlier output again with a ``previous_response_id`` or ``conversation`` would
    show the model that turn twice)."""
    seen = set(seen or ())
    for item in items:
        if item["id"] in seen:
            raise duplicate_item(item["id"], name)
        seen.add(item["id"])


def duplicate_item(item_id: str, name: str) -> ApiError:
    return ApiError(400, f"Duplicate item found with id {shown(item_id)}. Remove duplicate items from your input and "
                    "try again.", param=name)


def conversation_id(value: Any) -> str | None:
    """A Response body's ``conversation``: an id, or ``{"id": ...}`` (None: none given)."""
    if value is None:
        return None
    found = value.get("id") if isinstance(value, dict) else value
    if not isinstance(found, str) or not found:
        raise ApiError(400, "'conversation' must be a conversation's id, or {'id': ...}", param="conversation")
    return found


def check_metadata(metadata: Any) -> None:
    if metadata is not None and not (isinstance(metadata, dict) and len(metadata) <= 16 and all(
            isinstance(k, str) and len(k) <= 64 and isinstance(v, str) and len(v) <= 512 for k, v in metadata.items())):
        raise ApiError(400, "metadata must be an object of at most 16 string values (keys of at most 64 "
                       "characters, values of at most 512)", param="metadata")


async def oldest_turns_dropped(msgs: list[dict], fits: Callable[[list[dict]], Awaitable[bool]]) -> list[int] | None:
    """``truncation: "auto"``: the indices of the chat messages ``msgs`` to keep, the fewest oldest turns dropped
    for what is kept to ``fits``. The system and developer messages stay, wherever they stand. A turn starts at a
    user message, and a cut never parts a tool's result from the call it answers (the nearest one before it of
    that id: clients reuse ids); the last turn is always kept. None where even that does not fit. Found from the
    newest turn back, twice as many turns each time, then halving the gap: a few calls of ``fits``, each on about
    what fits, however long the conversation (a binary search from the middle templated half of 4000 messages
    first)."""
    rules = [m.get("role") in ("system", "developer") for m in msgs]
    parted = [0] * (len(msgs) + 1)  # cuts in (call, result] would part them: counted over that span
    called: dict[Any, int] = {}  # each call id's latest call so far
    for j, m in enumerate(msgs):
        for c in m.get("tool_calls") or () if isinstance(m.get("tool_calls"), list) else ():
            if isinstance(c, dict):
                called[c.get("id")] = j
        i = called.get(m.get("tool_call_id")) if m.get("role") == "tool" else None
        if i is not None:
            parted[i + 1] += 1
            parted[j + 1] -= 1
    starts, inside, turns = [], 0, False  # (turns: a message before that is no rule, so that a cut drops one)
    for k, m in enumerate(msgs):
        inside += parted[k]
        if m.get("role") == "user" and not inside and turns:
            starts.append(k)
        turns = turns or not rules[k]

    async def kept_if_fits(i: int) -> list[int] | None:  # what a cut at starts[i] keeps, if it fits
        kept = [k for k in range(len(msgs)) if k >= starts[i] or rules[k]]
        return kept if await fits([msgs[k] for k in kept]) else None

    hi = len(starts) - 1
    fitted = await kept_if_fits(hi) if starts else None
    step = 1
    while fitted is not None and hi > 0:
        lo = max(0, hi - step)
        more = await kept_if_fits(lo)
        if more is None:
            break
        fitted, hi, step = more, lo, 2 * step
    else:
        return fitted
    while lo + 1 < hi:  # starts[lo] does not fit, starts[hi] does
        mid = (lo + hi) // 2
        more = await kept_if_fits(mid)
        if more is None:
            lo = mid
        else:
            fitted, hi = more, mid
    return fitted


def at_sources(e: ApiError, sources: list[str]) -> ApiError:
    """``e`` with the chat messages it names (``messages[k]``) named as the body has them (``sources``): the
    instructions are the chat's first message, and an item's calls join the assistant turn before them."""
    e.message = re.sub(r"\bmessages\[(\d+)\]", lambda m: sources[int(m[1])] if int(m[1]) < len(sources) else m[0],
                       e.message)
    return e


def _logprobs(data: dict) -> int | None:
    """The top logprobs each output token shows (0: its own only), where ``include`` asks for logprobs, else
    None. ``top_logprobs`` alone asks for none, as in vLLM."""
    include, top = data.get("include"), op.field(data, "top_logprobs", int, None)
    if include is not None and not (isinstance(include, list) and all(isinstance(v, str) for v in include)):
        raise ApiError(400, "'include' must be a list of strings", param="include")
    for v in include or ():
        if v not in INCLUDABLE:
            raise ApiError(400, f"include: {v!r} is not one of {', '.join(INCLUDABLE)}", param="include")
    if top is not None and not 0 <= top <= MAX_LOGPROBS:
        raise ApiError(400, f"top_logprobs must be an integer in [0, {MAX_LOGPROBS}]", param="top_logprobs")
    return (top or 0) if LOGPROBS in (include or ()) else None


def _echoed(data: dict) -> dict:
    """The request's fields a Response repeats, checked (they are written back as they came)."""
    metadata = data.get("metadata")
    check_metadata(metadata)
    for name, kind in (("user", str), ("text", dict), ("reasoning", dict)):
        if data.get(name) is not None and not isinstance(data[name], kind):
            raise ApiError(400, f"'{name}' must be {'a string' if kind is str else 'an object'}", param=name)
    reasoning = data.get("reasoning")
    if reasoning is not None and not all(isinstance(v, str | None) for v in reasoning.values()):
        raise ApiError(400, "reasoning's settings must be strings", param="reasoning")
    fmt = (data.get("text") or {}).get("format") or {"type": "text"}
    tools = [{"type": "function", "name": t.get("name"), "description": t.get("description"),
              "parameters": t.get("parameters"), "strict": t.get("strict") is True} for t in data.get("tools") or ()]
    choice = data.get("tool_choice")
    return {"instructions": data.get("instructions"), "metadata": metadata, "user": data.get("user"),
            "parallel_tool_calls": data.get("parallel_tool_calls") is not False,
            "tools": tools, "tool_choice": choice if choice is not None else "auto" if tools else "none",
            "text": {"format": fmt}, "reasoning": reasoning, "top_logprobs": op.whole(data.get("top_logprobs")) or 0,
            "truncation": data.get("truncation") or "disabled"}


def _whole(call: dict) -> bool:
    """Whether a call's arguments are whole JSON (not those of a call cut short)."""
    try:
        orjson.loads(call["function"]["arguments"])
    except orjson.JSONDecodeError:
        return False
    return True


class ItemWriter:
    """An answer's parts in the order the model wrote them (``_Answer.parts``: thinking, text, tool-call
    deltas) as items opened, grown and closed: a Response's output items, a Message's content blocks.
    ``_take`` makes them and their events; a subclass says what an item is (``TYPES``, ``_new_item``,
    ``_call_item``) and writes the events (``_open``, ``_grow``, ``_close``)."""

    TYPES: dict[str, str] = {}  # an answer part's kind ("reasoning", "text") -> its item's type
    items: list[dict]  # done, in order
    open: dict | None  # the one being written
    named: bool  # the call of a named function: its arguments grow across batches
    answer: Any  # the chat's _Answer (thinking and calls read out), or None: all its text is text

    def _parts(self, text: str, finished: bool) -> list[tuple[str, Any]]:
        if self.answer is not None:
            return self.answer.parts(text, finished)
        return [("text", text)] if text else []

    def _take(self, parts: list[tuple[str, Any]], finished: bool) -> bytes:
        """Parts of the answer into items, in order; their events."""
        out = b""
        for k, (kind, value) in enumerate(parts):
            if kind == "call" and "id" not in value:  # a named function's further arguments
                out += self._grow(value["function"]["arguments"])
            elif kind == "call":
                out += self._close() + self._open(self._call_item(value)) + self._grow(value["function"]["arguments"])
                if not self.named:  # a whole call, or the one an answer was cut short in ("required")
                    out += self._close(last=finished and k == len(parts) - 1 and not _whole(value))
            else:
                kind = self.TYPES[kind]
                if self.open is None or self.open["type"] != kind:
                    out += self._close() + self._open(self._new_item(kind))
                out += self._grow(value)
        if finished:
            out += self._close(last=True)
            if not self.items:  # an empty answer is still a text item
                out += self._open(self._new_item(self.TYPES["text"])) + self._close(last=True)
        return out

    def _new_item(self, kind: str) -> dict:
        raise NotImplementedError

    def _call_item(self, call: dict) -> dict:
        raise NotImplementedError

    def _open(self, item: dict) -> bytes:
        raise NotImplementedError

    def _grow(self, text: str) -> bytes:
        raise NotImplementedError

    def _close(self, last: bool = False) -> bytes:
        raise NotImplementedError


def sequenced_event(kind: str, seq: int, **fields) -> bytes:
    """One event of a Responses stream, numbered ``seq``."""
    return b"event: " + kind.encode() + b"\ndata: " + orjson.dumps(
        {"type": kind, "sequence_number": seq, **fields}) + b"\n\n"


class ResponsesFormat(ItemWriter):
    """What a chat generation produced, as a Response (``response``) or its events (``chunk``): both
    built by ``_take`` from the same ordered parts of the answer, so they hold the same items."""

    TYPES = {"reasoning": "reasoning", "text": "message"}

    DONE = b""  # no [DONE] line: the stream ends after response.completed (or .incomplete)

    def __init__(self, api_model: str, data: dict, gen: Generation, chat_fmt,
                 keep: Keep | None = None, stored: bool = False,
                 conversation: str | None = None) -> None:
        """``keep``: stores the finished Response (where it is ``stored``) and adds its items to its ``conversation``'s,
        awaited before the client may read that it is done (``kept``): a call that continues it at once finds it."""
        self.gen, self.chat = gen, chat_fmt
        self.keep, self._done = keep, None
        self.answer = chat_fmt.answers[0] if chat_fmt.answers is not None else None
        self.named = self.answer is not None and self.answer.calls is not None and self.answer.calls.mode == "named"
        self.seq = 0
        self.log: list[tuple[int, bytes]] | None = None  # each event as it is made, with its number: where kept
        self.reasoning_tokens = 0  # output tokens of the thinking (of the batches that carried it, or held it back)
        # the token that ends the thinking, where one token does (Qwen3's </think>, harmony's <|end|>)
        self._end_id = chat_fmt.codec.single_token(self.answer.thinking_end) if self.answer is not None else None
        # where it takes several: its bytes, found across the thinking's last bytes (``_tail``) and the tokens after
        self._end = self.answer.thinking_end.encode() if self.answer is not None and self._end_id is None else b""
        self._tail = b""
        self._ended = False  # the last update was taken
        self._unshown = 0  # tokens of the batches that showed nothing yet: the opening "<think>" in several tokens
        # with the chat's logprobs asked for, each output_text carries those of the tokens that wrote it
        self._lps: list[dict] = []  # of the answer's tokens whose text is not out yet (those of a call: dropped)
        self.items: list[dict] = []  # output items done, in order
        self.open: dict | None = None  # the reasoning item, message or named call being written
        self.base = {"id": gen.api_id, "object": "response", "created_at": int(time.time()), "model": api_model,
                     "store": stored, "background": op.field(data, "background", bool, False), "error": None,
                     "incomplete_details": None,
                     "previous_response_id": data.get("previous_response_id"),
                     "conversation": {"id": conversation} if conversation is not None else None, **_echoed(data),
                     # what it samples with: the request's values, else the model's (or OpenAI's) defaults
                     "temperature": gen.params.temperature, "top_p": gen.params.top_p,
                     "max_output_tokens": gen.params.max_tokens}
        try:  # what a client sent nested too deep for orjson to write back
            orjson.dumps(self.base)
        except orjson.JSONEncodeError:
            raise ApiError(400, "the request nests too deeply to be written back in its Response") from None

    @property
    def _cut(self) -> bool:
        return self.gen.choices[0].finish_reason in ("length", "timeout")

    # ------------------------------------------------------------------ whole

    def collect(self, updates: list[Update]) -> None:
        self.chat.collect(updates)
        for up in updates:  # the items as a stream makes them (the events are not sent), reasoning tokens counted
            self._take(self._counted(up), up.finished)

    def final(self) -> dict:
        """The Response as it ended (streamed: as its last event says; collected: made now)."""
        return self._done if self._done is not None else self.response()

    def response(self) -> dict:
        if not self._ended:
            self._take(self._parts("", True), finished=True)
        self._done = self._response("incomplete" if self._cut else "completed")
        return self._done

    async def kept(self) -> None:
        """The finished Response stored, where it is to be (once)."""
        done, self._done = self._done, None
        if done is not None and self.keep is not None:
            await self.keep(done)

    def _counted(self, up: Update) -> list[tuple[str, Any]]:
        """``up``'s parts of the answer; its tokens count as reasoning where it carried thinking, or left the
        answer inside it: the batch that ends the thinking up to the token that ends it (as vLLM counts), and the
        batch that opens it with those before it that showed nothing (``<think>`` in several tokens, whatever
        batches they came in). The logprobs of its other tokens wait for the text that shows them."""
        a, self._ended = self.answer, self._ended or up.finished
        was_thinking, thought = (a.thinking, len(a.reasoning)) if a is not None else (False, 0)
        parts = self._parts(up.text, up.finished)
        ids: list[int] = []  # this batch's tokens of the thinking
        unshown, self._unshown = self._unshown, 0
        if a is not None and (was_thinking or a.thinking or len(a.reasoning) > thought):
            ids = up.token_ids if a.thinking else up.token_ids[:self._through_end(up.token_ids)]
            if a.thinking and self._end:
                self._tail = (self._tail + b"".join(map(self.chat.codec.token_bytes, ids)))[-len(self._end):]
            if not was_thinking and not thought:  # (it opened here)
                self.reasoning_tokens += unshown
        elif not parts:
            self._unshown = unshown + len(up.token_ids)
        self.reasoning_tokens += len(ids)
        if self.chat.logprobs:
            if ids:  # (what waited, since no text showed it, opened the thinking: "<think>" in several tokens)
                self._lps = []
            c, shown = up.choice, up.token_ids
            if up.finished and not c.include_stop:  # (the token that ends the output is no text)
                shown = text_ids(shown, c.finish_reason, c.stop_reason, c.eos_ids)
            self._lps += self.chat.delta_logprobs(up)[len(ids):len(shown)]
        return parts

    def _through_end(self, ids: list[int]) -> int:
        """How many of ``ids``, the batch that ended the thinking, are the thinking's: up to the token that ends
        it (all of them where none does: the output ended inside it)."""
        if self._end_id is not None:
            return ids.index(self._end_id) + 1 if self._end_id in ids else len(ids)
        seen = self._tail
        for i, t in enumerate(ids):
            seen += self.chat.codec.token_bytes(t)
            if self._end in seen:
                return i + 1
        return len(ids)

    def _response(self, status: str, error: dict | None = None) -> dict:
        reason = self.gen.choices[0].finish_reason
        usage = self.gen.usage()
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
        return {**self.base, "status": status, "completed_at": int(time.time()), "error": error,
                "incomplete_details": {"reason": "max_output_tokens" if reason == "length" else reason}
                if status == "incomplete" else None,
                "output": self.items, "usage": {
                    "input_tokens": usage["prompt_tokens"], "output_tokens": usage["completion_tokens"],
                    "total_tokens": usage["total_tokens"],
                    "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": 0},
                    "output_tokens_details": {"reasoning_tokens": self.reasoning_tokens}}}

    # ------------------------------------------------------------------ streamed

    def _event(self, kind: str, **fields) -> bytes:
        self.seq += 1
        event = sequenced_event(kind, self.seq - 1, **fields)
        if self.log is not None:
            self.log.append((self.seq - 1, event))
        return event

    def stream_head(self, queued: bool = False) -> bytes:
        """The stream's first events; ``queued``: a background Response's, whose ``response.in_progress`` comes when
        it begins (``begun``)."""
        if queued:
            head = self.head("queued")
            return self._event("response.created", response=head) + self._event("response.queued", response=head)
        return self._event("response.created", response=self.head()) + self.begun()

    def begun(self) -> bytes:
        return self._event("response.in_progress", response=self.head())

    def head(self, status: str = "in_progress") -> dict:
        """The Response before its output: as it begins, or runs."""
        return {**self.base, "status": status, "output": [], "usage": None}

    def chunk(self, updates: list[Update]) -> bytes:
        out = b""
        for up in updates:
            out += self._take(self._counted(up), up.finished)
            if up.finished:
                kind = "incomplete" if self._cut else "completed"
                self._done = self._response(kind)
                out += self._event(f"response.{kind}", response=self._done)
        return out

    def stream_error(self, e: ApiError) -> bytes:
        """An engine failure mid-stream: what the readers held back, the open item closed incomplete, the
        error, then the Response as it stood, failed."""
        # (the Response's error.code is one of OpenAI's: the error event keeps this server's own)
        code = "server_error" if e.status >= 500 else "rate_limit_exceeded" if e.status == 429 else "invalid_prompt"
        error = {"code": code, "message": e.message}
        out = self._take(self._parts("", True), finished=False) + self._close(last=True, status="incomplete")
        self._done = self._response("failed", error)  # (kept by a background Response)
        return (out + self._event("error", code=str(e.code_or_status), message=e.message, param=e.param)
                + self._event("response.failed", response=self._done))

    def _open(self, item: dict) -> bytes:
        self.open = item
        index = len(self.items)
        if item["type"] == "function_call":
            return self._event("response.output_item.added", output_index=index, item=item)
        # added with no content (as OpenAI's are): the part comes in its own event
        return (self._event("response.output_item.added", output_index=index, item={**item, "content": []})
                + self._event("response.content_part.added", item_id=item["id"], output_index=index,
                              content_index=0, part=item["content"][0]))

    def _grow(self, text: str) -> bytes:
        """More text for the open item: its content's, or a call's arguments."""
        item, index = self.open, len(self.items)
        if not text:
            return b""
        if item["type"] == "function_call":
            self._lps = []
            item["arguments"] += text
            return self._event("response.function_call_arguments.delta", item_id=item["id"], output_index=index,
                               delta=text)
        item["content"][0]["text"] += text
        if item["type"] == "reasoning":
            return self._event("response.reasoning_text.delta", item_id=item["id"], output_index=index,
                               content_index=0, delta=text)
        lps, self._lps = self._lps, []
        item["content"][0]["logprobs"] += lps
        return self._event("response.output_text.delta", item_id=item["id"], output_index=index, content_index=0,
                           delta=text, logprobs=lps)

    def _close(self, last: bool = False, status: str | None = None) -> bytes:
        """The open item done (``last``: the one the generation ended in, incomplete if it was cut short):
        its done events."""
        item, self.open = self.open, None
        if item is None:
            return b""
        index = len(self.items)
        item["status"] = status or ("incomplete" if last and self._cut else "completed")
        self.items.append(item)
        if item["type"] == "function_call":
            out = self._event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                              arguments=item["arguments"])
        else:
            part = item["content"][0]
            if item["type"] == "reasoning":
                out = self._event("response.reasoning_text.done", item_id=item["id"], output_index=index,
                                  content_index=0, text=part["text"])
            else:
                out = self._event("response.output_text.done", item_id=item["id"], output_index=index,
                                  content_index=0, text=part["text"], logprobs=part["logprobs"])
            out += self._event("response.content_part.done", item_id=item["id"], output_index=index,
                               content_index=0, part=part)
        return out + self._event("response.output_item.done", output_index=index, item=item)

    def _new_item(self, kind: str) -> dict:
        return self._reasoning() if kind == "reasoning" else self._message()

    def _call_item(self, call: dict) -> dict:
        return self._function_call(call)

    @staticmethod
    def _reasoning() -> dict:
        return {"id": new_id("rs"), "type": "reasoning", "summary": [], "status": "in_progress",
                "content": [{"type": "reasoning_text", "text": ""}]}

    @staticmethod
    def _message() -> dict:
        return {"id": new_id("msg"), "type": "message", "role": "assistant", "status": "in_progress",
                "content": [{"type": "output_text", "text": "", "annotations": [], "logprobs": []}]}

    @staticmethod
    def _function_call(call: dict) -> dict:
        return {"id": new_id("fc"), "type": "function_call", "call_id": call["id"],
                "name": call["function"]["name"], "arguments": "", "status": "in_progress"}
