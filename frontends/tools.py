"""Tool calling: OpenAI's ``tools`` and ``tool_choice`` on ``/v1/chat/completions``.

The request's tools are checked here and handed to the chat template, which shows them to the
model. What comes back depends on ``tool_choice``:

- ``"auto"`` (the default when tools are given): the model answers in text or calls tools in its
  own format, which ``CallReader`` reads out of the text as it streams: ``hermes``
  (``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, as Qwen2.5, Qwen3 and Hermes
  write) or ``llama3_json`` (the whole answer ``{"name": ..., "parameters": {...}}``, several
  joined by ``;``, as Llama 3.1-3.3 write) or ``mistral`` (``[TOOL_CALLS]`` and then a JSON array of
  ``{"name": ..., "arguments": {...}}``, as Mistral 7B v0.3, Nemo and Small 3 write, or ``name[ARGS]{...}``
  once per call, as their later tokenizers have it; ``[TOOL_CALLS]`` is a special token, so such a
  chat's text is decoded with its special tokens) or ``openai`` (GPT-OSS's harmony format, read with
  its thinking by ``frontends.harmony``). Which one: ``--tool-call-parser``, by default read
  off the chat template (``detect_format``). A template that shows no tools has no format: then
  "auto" is a 400, as in vLLM without a parser, since the model would never see the tools.
- ``"required"``: the output is held (structured output, ``engine.json_schema``) to a JSON array
  of calls ``[{"name": ..., "parameters": {...}}]`` of the given tools, as vLLM holds it.
- ``{"type": "function", "function": {"name": N}}``: held to N's ``parameters`` schema; the
  text is N's arguments, streamed as they come.
- ``"none"``: the template still sees the tools (as in OpenAI's API), no call is read.

A call found gets an id (``call_...``) and its arguments as a JSON string; the choice then ends
with finish_reason "tool_calls" (a named function: "stop", as OpenAI answers a forced call).
Text the reader cannot take for a call (malformed JSON, a call cut short by ``max_tokens``)
stays content: nothing the model wrote is lost.

OpenAI's deprecated ``functions`` and ``function_call`` (one call an answer, before tools) run as the
tools they amount to (``from_functions``), answered as OpenAI answers them: the call as the message's
``function_call`` (``{"name", "arguments"}``), finish_reason "function_call".
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import orjson

from frontends.errors import ApiError
from frontends.text import partial_suffix

FORMATS = ("hermes", "llama3_json", "mistral", "openai")
MAX_TOOLS = 128
MAX_REQUIRED_TOOLS = 16  # "required" holds the output to one of these: more than the grammar tells apart at once
_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")
# a "required" answer's call cut short after its name: the name, and its parameters so far (none: cut before them,
# in the key that introduces them)
_CUT_CALL = re.compile(
    rf'\{{\s*"name"\s*:\s*"({_NAME.pattern})"\s*(?:,\s*(?:"parameters"\s*:\s*(.*)|"?[a-z]*"?\s*))?\Z', re.S)
_HERMES_OPEN, _HERMES_CLOSE = "<tool_call>", "</tool_call>"
_MISTRAL_CALLS, _MISTRAL_ARGS, _MISTRAL_ID = "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"
_ID_CHARS = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789"


def detect_format(chat_template: str | None) -> str | None:
    """The call format a chat template teaches its model, or None where it shows no tools."""
    if chat_template and "<|channel|>" in chat_template and "<|message|>" in chat_template:
        return "openai"  # GPT-OSS's harmony format (frontends.harmony reads its calls)
    if not chat_template or "tools" not in chat_template:
        return None
    if _MISTRAL_CALLS in chat_template:
        return "mistral"
    if _HERMES_OPEN in chat_template:
        return "hermes"
    if "<|python_tag|>" in chat_template or "ipython" in chat_template:
        return "llama3_json"
    return None


@dataclass
class ToolRequest:
    """A request's tools (as the chat template takes them) and what its ``tool_choice`` asks."""

    tools: list[dict]
    mode: str  # "none", "auto", "required" or "named"
    name: str | None = None  # the named function
    parallel: bool = True  # parallel_tool_calls: more than one call in an answer
    fmt: str | None = None  # auto: the format the reader reads
    schemas: dict[str, dict] = field(default_factory=dict)  # each function's parameters
    size: int = 0  # bytes of the tools as JSON: they count against the context as the messages do
    legacy: bool = False  # asked as the deprecated functions: its call is answered as a function_call

    def schema(self) -> dict | None:
        """The JSON schema the output is held to (None: free text)."""
        if self.mode == "named":
            return self.schemas[self.name]
        if self.mode != "required":
            return None
        defs: dict[str, Any] = {}  # each tool's own, moved to the root its refs now resolve from
        calls = [{"type": "object", "properties": {"name": {"const": n}, "parameters": _rooted(p, i, defs)},
                  "required": ["name", "parameters"]} for i, (n, p) in enumerate(self.schemas.items())]
        return {"type": "array", "items": calls[0] if len(calls) == 1 else {"anyOf": calls},
                "minItems": 1, **({} if self.parallel else {"maxItems": 1}), **({"$defs": defs} if defs else {})}

    def reader(self) -> CallReader:
        return CallReader(self)

    @property
    def keeps_special_tokens(self) -> bool:
        """Whether the output must be decoded with its special tokens for its calls to be read."""
        return self.mode == "auto" and self.fmt == "mistral"


_DATA = frozenset({"const", "enum", "default", "examples"})  # keywords whose values are data, not schemas
_NAMED = frozenset({"properties", "patternProperties", "$defs", "definitions", "dependentSchemas"})  # name -> schema
_DEFS = {"$defs": "defs_", "definitions": "definitions_"}  # (one name in both: two definitions)


def _rooted(params: dict, i: int, defs: dict[str, Any]) -> dict:
    """Tool ``i``'s ``params`` as it reads inside "required"'s array of calls: its ``$defs`` (and ``definitions``)
    moved into ``defs`` as ``tool{i}_defs_NAME`` (``tool{i}_definitions_NAME``) and its refs to them, or to its own root
    ``#``, rewritten (pydantic's schemas refer so: the call's array is the root now). One that refers to nothing
    is as it was."""
    own = {f"#/{key}/{name}": f"#/$defs/tool{i}_{tag}{name}" for key, tag in _DEFS.items()
           for name in (params.get(key) if isinstance(params.get(key), dict) else {})}
    own["#"] = f"#/$defs/tool{i}"
    renamed: list[str] = []

    def rename(ref: str) -> str:
        if ref in own:
            renamed.append(ref)
        return own.get(ref, ref)

    moved = {f"tool{i}_{tag}{name}": _with_refs(sub, rename) for key, tag in _DEFS.items()
             if isinstance(params.get(key), dict) for name, sub in params[key].items()}
    root = _with_refs({k: v for k, v in params.items() if k not in _DEFS}, rename)
    if not renamed:
        return params
    defs.update(moved)
    defs[f"tool{i}"] = root
    return {"$ref": f"#/$defs/tool{i}"}


def _with_refs(s: Any, new: Callable[[str], str]) -> Any:
    """Schema ``s`` with each ``$ref`` as ``new(ref)`` says (data left as it is: ``const``, ``enum``...)."""
    if isinstance(s, list):
        return [_with_refs(v, new) for v in s]
    if not isinstance(s, dict):
        return s
    return {k: new(v) if k == "$ref" and isinstance(v, str) else v if k in _DATA
            else {name: _with_refs(sub, new) for name, sub in v.items()} if k in _NAMED and isinstance(v, dict)
            else _with_refs(v, new) for k, v in s.items()}


def check_tool(i: int, name: Any, params: Any, fields: tuple[str, str] = ("function.name", "function.parameters")
               ) -> None:
    """``tools[i]``'s name and parameters' schema, which must be an object's (a call's arguments are an object, as
    OpenAI and Anthropic refuse others); ``fields``: where the API keeps them, as its refusals name them."""
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise ApiError(400, f"tools[{i}].{fields[0]} must be 1 to 64 letters, digits, '_', '-' or '.', got {name!r}",
                       param="tools")
    if not _is_object(params, params):
        got = f"of type {params['type']!r}" if isinstance(params, dict) and "type" in params else "another"
        raise ApiError(400, f"tools[{i}].{fields[1]} must be a JSON schema of type 'object' (a call's arguments are "
                       f"an object), got {got}", param="tools")


_OBJECT_WORDS = frozenset({"properties", "required", "additionalProperties"})  # (engine.json_schema's, implying it)
_NOT_OBJECT = frozenset({"items", "prefixItems", "minItems", "maxItems", "minLength", "maxLength", "pattern", "format",
                         "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf", "enum", "const"})


def _is_object(s: Any, root: dict, depth: int = 0) -> bool:
    """Whether every value of schema ``s`` is an object: its type is, or no type and no other type's keywords
    (``as_object`` then says so), or a local ``$ref`` to such a schema, or alternatives that all are."""
    if not isinstance(s, dict) or depth > 8:
        return False
    if "type" in s:
        return s["type"] == "object"
    ref = s.get("$ref")
    if ref is not None:  # (pydantic's recursive models: {"$ref": "#/$defs/Model", "$defs": {...}})
        where, _, name = ref.removeprefix("#/").partition("/") if isinstance(ref, str) else ("", "", "")
        defs = root.get(where) if where in ("$defs", "definitions") else None
        return isinstance(defs, dict) and "/" not in name and _is_object(defs.get(name), root, depth + 1)
    alts = s.get("anyOf", s.get("oneOf", s.get("allOf")))
    if alts is not None:
        return isinstance(alts, list) and bool(alts) and all(_is_object(a, root, depth + 1) for a in alts)
    # no type: an object's keywords make it one (below the root; there ``as_object`` says so)
    return not _NOT_OBJECT & s.keys() and (depth == 0 or bool(_OBJECT_WORDS & s.keys()))


def as_object(params: dict) -> dict:
    """A tool's parameters as the schema its calls are held to: one without a type (``{}``, properties alone)
    is an object's (else it would hold them to any JSON value)."""
    plain = "type" not in params and not {"$ref", "anyOf", "oneOf", "allOf"} & params.keys()
    return {**params, "type": "object"} if plain else params


def shows_tools(chat_template: str | None) -> bool:
    """Whether a chat template shows its model a request's tools at all (in some format)."""
    return bool(chat_template) and ("tools" in chat_template or detect_format(chat_template) is not None)


def no_format(chat_template: str | None, parser: str) -> str:
    """Why a server has no call format for tool_choice "auto" (``--tool-call-parser`` ``parser``), and what to do
    instead or about it, for its 400."""
    if parser == "none":
        return "the server reads none (--tool-call-parser none): "
    if shows_tools(chat_template):
        return ("this model's chat template shows tools in a format not read off it: start the server with "
                f"--tool-call-parser ({', '.join(FORMATS)}), or ")
    return ("this model's chat template shows no tools: start the server with a template that does (--chat-template), "
            "or ")


def parse_tools(data: dict, fmt: str | None, why: str = "") -> ToolRequest | None:
    """``tools``, ``tool_choice`` and ``parallel_tool_calls`` checked (None: no tools given), or the deprecated
    ``functions`` and ``function_call`` as such tools. ``fmt``: the server's call format for "auto"
    (``detect_format`` or ``--tool-call-parser``); ``why``: why there is none (``no_format``), for the 400."""
    legacy = from_functions(data)
    if legacy is not None:
        if legacy.get("tools") and legacy["tool_choice"] in (None, "auto") and fmt is None:
            raise ApiError(400, "function_call 'auto' (the default with functions) needs a tool-call format, and "
                           f"{why}name the function (function_call {{'name': ...}})", param="function_call")
        try:
            req = parse_tools(legacy, fmt, why)
        except ApiError as e:
            raise e.renamed(LEGACY_NAMES) from None
        if req is not None:
            req.legacy = True
        return req
    tools = data.get("tools")
    choice = data.get("tool_choice")
    parallel = data.get("parallel_tool_calls")
    if parallel is None:  # (null: the default, as everywhere)
        parallel = True
    if not isinstance(parallel, bool):  # (without tools too, as vLLM's)
        raise ApiError(400, "parallel_tool_calls must be true or false", param="parallel_tool_calls")
    if tools is None:
        if choice not in (None, "none"):
            raise ApiError(400, "tool_choice needs 'tools'", param="tool_choice")
        return None
    if not isinstance(tools, list) or not 0 < len(tools) <= MAX_TOOLS:
        raise ApiError(400, f"'tools' must be a list of 1 to {MAX_TOOLS} tools", param="tools")
    schemas: dict[str, dict] = {}
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) and tool.get("type") == "function" else None
        if not isinstance(fn, dict):
            raise ApiError(400, f"tools[{i}] must be {{'type': 'function', 'function': {{'name': ...}}}}",
                           param="tools")
        name, params = fn.get("name"), fn.get("parameters", {"type": "object"})
        check_tool(i, name, params)
        if name in schemas:
            raise ApiError(400, f"two tools are named {name!r}", param="tools")
        schemas[name] = as_object(params)
    try:
        size = len(orjson.dumps(tools))
    except orjson.JSONEncodeError:  # nested past orjson's 254 levels, or an integer past 64 bits
        raise ApiError(400, "'tools' nests too deeply or holds an integer too large", param="tools") from None
    req = ToolRequest(tools, "auto", parallel=parallel, fmt=fmt, schemas=schemas, size=size)
    if choice in ("none", "required"):
        req.mode = choice
    elif isinstance(choice, dict):
        fn = choice.get("function") if choice.get("type") == "function" else None
        name = fn.get("name") if isinstance(fn, dict) else None
        if not isinstance(name, str) or name not in schemas:
            raise ApiError(400, f"tool_choice names no tool of 'tools': {name!r}" if isinstance(name, str) else
                           "tool_choice {'type': 'function'} needs function.name, a string", param="tool_choice")
        req.mode, req.name = "named", name
    elif choice not in (None, "auto"):
        raise ApiError(400, "tool_choice must be 'none', 'auto', 'required' or {'type': 'function', "
                       "'function': {'name': ...}}", param="tool_choice")
    if req.mode == "auto" and fmt is None:
        raise ApiError(400, f"tool_choice 'auto' needs a tool-call format, and {why}use tool_choice 'required' or a "
                       "named function", param="tool_choice")
    if req.mode == "required" and len(schemas) > MAX_REQUIRED_TOOLS:
        raise ApiError(400, f"tool_choice 'required' takes at most {MAX_REQUIRED_TOOLS} tools, got {len(schemas)}",
                       param="tools")
    return req


LEGACY_NAMES = {"tools": "functions", "tool_choice": "function_call"}  # (for ApiError.renamed)


def from_functions(data: dict) -> dict | None:
    """The ``tools``, ``tool_choice`` and ``parallel_tool_calls`` (one call) that OpenAI's deprecated ``functions``
    and ``function_call`` amount to, for ``parse_tools``; None where the request has neither."""
    functions, choice = data.get("functions"), data.get("function_call")
    if functions is None and choice is None:
        return None
    if data.get("tools") is not None or data.get("tool_choice") is not None:
        raise ApiError(400, "give 'tools' (and tool_choice) or the deprecated 'functions' (and function_call), "
                       "not both", param="functions")
    if functions is None:
        if choice != "none":
            raise ApiError(400, "function_call needs 'functions'", param="function_call")
        return {}
    parallel = data.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):  # (checked as with tools; functions make one)
        raise ApiError(400, "parallel_tool_calls must be true or false", param="parallel_tool_calls")
    if not isinstance(functions, list) or not 0 < len(functions) <= MAX_TOOLS:
        raise ApiError(400, f"'functions' must be a list of 1 to {MAX_TOOLS} functions", param="functions")
    for i, fn in enumerate(functions):
        if not isinstance(fn, dict):
            raise ApiError(400, f"functions[{i}] must be {{'name': ..., 'parameters': {{...}}}}", param="functions")
        try:
            check_tool(i, fn.get("name"), fn.get("parameters", {"type": "object"}), ("name", "parameters"))
        except ApiError as e:
            raise e.renamed(LEGACY_NAMES) from None
    names = [fn["name"] for fn in functions]
    if isinstance(choice, dict) and isinstance(choice.get("name"), str) and choice["name"] in names:
        choice = {"type": "function", "function": {"name": choice["name"]}}
    elif isinstance(choice, dict):
        raise ApiError(400, f"function_call names no function of 'functions': {choice.get('name')!r}",
                       param="function_call")
    elif choice not in (None, "none", "auto"):
        raise ApiError(400, "function_call must be 'none', 'auto' or {'name': ...}", param="function_call")
    return {"tools": [{"type": "function", "function": fn} for fn in functions], "tool_choice": choice,
            "parallel_tool_calls": False}


def template_tool_calls(calls: Any, i: int) -> list[dict]:
    """An assistant message's ``tool_calls`` (``messages[i]``) checked and made as chat templates
    want them: arguments as objects, not the JSON text OpenAI's API sends (as transformers and
    vLLM hand them over)."""
    where = f"messages[{i}].tool_calls"
    if not isinstance(calls, list):
        raise ApiError(400, f"{where} must be a list", param="messages")
    out = []
    for j, c in enumerate(calls):
        shaped = isinstance(c, dict) and isinstance(c.get("id", ""), str) and c.get("type", "function") == "function"
        fn = template_function(c.get("function"), f"{where}[{j}].function") if shaped else None
        if fn is None:
            raise ApiError(400, f"{where}[{j}] must be {{'id': string, 'type': 'function', 'function': "
                           "{'name': string, 'arguments': JSON text}}", param="messages")
        out.append({"id": c.get("id", ""), "type": "function", "function": fn})
    return out


def template_function(fn: Any, where: str) -> dict | None:
    """A call's function, ``{"name", "arguments"}`` (``where`` in the request: a tool call's, or an assistant's
    deprecated ``function_call``), as chat templates want it: its arguments an object. None where it is no such
    pair; a 400 where its arguments are not JSON text."""
    if not (isinstance(fn, dict) and isinstance(fn.get("name"), str) and isinstance(fn.get("arguments"), str)):
        return None
    try:
        arguments = orjson.loads(fn["arguments"])
    except orjson.JSONDecodeError:
        raise ApiError(400, f"{where}.arguments is not JSON text", param="messages") from None
    return {"name": fn["name"], "arguments": arguments}


def new_call(name: str, arguments: str, fmt: str | None = None) -> dict:
    """A call, with an id as OpenAI's look; in the mistral format 9 letters or digits, the only ids
    Mistral's chat templates take back in the conversation that follows."""
    if fmt == "mistral":
        call_id = "".join(_ID_CHARS[b % len(_ID_CHARS)] for b in os.urandom(9))
    else:
        call_id = f"call_{os.urandom(12).hex()}"
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):  # 1e400: it would be written back as Infinity
        raise ValueError(f"{text} overflows a double")
    return value


# NaN and Infinity are Python's, not JSON's: a call's arguments must be JSON that any client reads back
_DECODER = json.JSONDecoder(parse_constant=_no_constant, parse_float=_finite)


def json_values(text: str) -> list[tuple[Any, int]] | None:
    """``text`` as JSON values joined by ``;`` or whitespace (Llama 3's parallel calls), each with
    where it ends; None if it is not that."""
    values, i = [], 0
    while True:
        while i < len(text) and text[i] in " \t\r\n;":
            i += 1
        if i == len(text):
            return values or None
        try:
            value, i = _DECODER.raw_decode(text, i)
        except (RecursionError, ValueError):
            return None
        values.append((value, i))


Segment = tuple[str, Any]  # ("text", str) or ("call", a tool-call delta), in the order the model wrote them


class CallReader:
    """One choice's text split into content and tool calls, as it streams: ``feed`` each piece of
    text and ``finish`` at the end; each returns the segments it can let out now, in order: text, and
    tool-call deltas (a whole call; a named function's first piece with its id, then its further
    pieces). ``content`` and ``calls`` hold the whole answer. A call is a tool of the request's with
    arguments that are a JSON object; anything else the model wrote stays text."""

    def __init__(self, req: ToolRequest) -> None:
        self.req = req
        self.mode = req.mode if req.mode != "auto" else req.fmt
        self.content = ""
        self.calls: list[dict] = []
        self._held = ""  # text not yet known to be content or call
        self._in_call = False  # hermes: inside <tool_call>...; mistral: past [TOOL_CALLS]
        self._scanned = 0  # hermes: where in _held the search for the call's </tool_call> goes on
        self._json_at, self._in_str, self._escaped = 0, False, False  # hermes: the call's JSON read so far
        # whitespace at the start and after a call is held: dropped if a call or the end follows
        self._after_call = self.mode in ("hermes", "mistral")
        self._blank = ""
        self._began = False  # named: some text came (a call is due, even cut short before its "{")

    def feed(self, text: str) -> list[Segment]:
        if self.mode == "none" or not text:
            return self._text(text)
        if self.mode == "named":  # the text is the arguments: streamed as they come
            if self.calls:
                self.calls[0]["function"]["arguments"] += text
                return [("call", {"index": 0, "function": {"arguments": text}})]
            text = text.lstrip()  # (the grammar lets a space come first: OpenAI's arguments start at the "{")
            self._began = True  # (the call is due, however little came: ``finish``)
            if not text:
                return []
            self.calls.append(new_call(self.req.name, text, self.req.fmt))
            return self._named_call()
        self._held += text
        if self.mode == "hermes":
            return self._hermes(final=False)
        if self.mode == "mistral" and not self._in_call:  # words stream up to [TOOL_CALLS]; the calls wait
            at = self._held.find(_MISTRAL_CALLS)
            cut = at if at >= 0 else len(self._held) - partial_suffix(self._held, _MISTRAL_CALLS)
            text, self._held, self._in_call = self._held[:cut], self._held[cut:], at >= 0
            return self._text(text)
        if self.mode == "llama3_json" and self._held.lstrip() and not self._held.lstrip().startswith("{"):
            self.mode = "none"  # an answer in words: no call to look for
            text, self._held = self._held, ""
            return self._text(text)
        return []  # required, or calls: read whole at the end

    def _named_call(self) -> list[Segment]:
        """The named call's first segment: the whole call as it stands (its arguments a copy: more come)."""
        return [("call", {"index": 0, **self.calls[0], "function": dict(self.calls[0]["function"])})]

    def finish(self) -> list[Segment]:
        if self.mode == "named" and not self.calls and self._began:  # cut short before its "{": its call, empty
            self.calls.append(new_call(self.req.name, "", self.req.fmt))
            return self._named_call()
        if self.mode == "hermes":
            return self._hermes(final=True)
        held, self._held = self._held, ""
        if self.mode == "mistral":
            return self._mistral(held)
        values = json_values(held) if self.mode in ("required", "llama3_json") and held else None
        if not values:
            return self._cut_calls(held) if self.mode == "required" else self._text(held)
        if self.mode == "required":  # one array of {"name", "parameters"}
            items = values[0][0] if len(values) == 1 and isinstance(values[0][0], list) else []
            calls = [self._as_call(c, "parameters") for c in items]
        else:
            calls = [self._as_call(v, "parameters") or self._as_call(v, "arguments") for v, _ in values]
        if not calls or not all(calls):
            return self._text(held)
        if not self.req.parallel and len(calls) > 1:  # one call; the others stay text
            return self._call(calls[0]) + self._text(held[values[0][1]:].lstrip(" \t\r\n;"))
        return [seg for c in calls for seg in self._call(c)]

    def _cut_calls(self, held: str) -> list[Segment]:
        """A "required" array cut short (by ``max_tokens`` or a stop): its whole calls, then the one it was
        writing, if its name is whole, with its arguments so far (as a named function's cut short); all of it
        text if it is not that."""
        i = held.find("[")
        if i < 0 or held[:i].strip():
            return self._text(held)
        calls, i = [], i + 1
        while True:
            while i < len(held) and held[i] in " \t\r\n,":
                i += 1
            try:
                value, i = _DECODER.raw_decode(held, i)
            except (RecursionError, ValueError):
                break
            call = self._as_call(value, "parameters")
            if call is None:
                return self._text(held)
            calls.append(call)
        cut = _CUT_CALL.match(held, i)
        if cut is not None and cut[1] in self.req.schemas:
            calls.append(new_call(cut[1], cut[2] or "", self.req.fmt))
        if not calls:
            return self._text(held)
        return [seg for c in calls[:None if self.req.parallel else 1] for seg in self._call(c)]

    def _mistral(self, held: str) -> list[Segment]:
        """What follows ``[TOOL_CALLS]`` (words before it have streamed): a JSON array of ``{"name": ...,
        "arguments": {...}}``, or ``name[ARGS]{...}`` (``name[CALL_ID]id[ARGS]{...}``) a call, each after its
        own ``[TOOL_CALLS]``: the calls, if every one is a call (else all of it stays text)."""
        self._in_call = False
        if not held.startswith(_MISTRAL_CALLS):
            return self._text(held)
        body = held[len(_MISTRAL_CALLS):]
        if body.lstrip().startswith("["):  # one JSON array
            values = json_values(body)
            items = values[0][0] if values and len(values) == 1 and isinstance(values[0][0], list) else []
            calls = [self._as_call({"arguments": {}, **item} if isinstance(item, dict) else item, "arguments")
                     for item in items]
            rest = _MISTRAL_CALLS + json.dumps(items[1:], ensure_ascii=False)  # (for one call: the others)
        else:
            calls, ends = self._mistral_args_calls(body)
            rest = body[ends[0]:].lstrip() if ends else ""
        if not calls or not all(calls):
            return self._text(held)
        if not self.req.parallel and len(calls) > 1:  # one call; the others stay text
            return self._call(calls[0]) + self._text(rest)
        return [seg for c in calls for seg in self._call(c)]

    def _mistral_args_calls(self, body: str) -> tuple[list, list[int]]:
        """``name[ARGS]{...}`` calls joined by ``[TOOL_CALLS]``, read in order (a ``[TOOL_CALLS]`` inside a
        JSON string is the string's): the calls and where each ends, or ([], []) unless all of it is calls."""
        calls, ends, i = [], [], 0
        while True:
            j = body.find(_MISTRAL_ARGS, i)
            if j < 0:
                return [], []
            name = body[i:j].partition(_MISTRAL_ID)[0].strip()
            k = j + len(_MISTRAL_ARGS)
            while k < len(body) and body[k].isspace():
                k += 1
            try:
                value, end = _DECODER.raw_decode(body, k)
            except (RecursionError, ValueError):
                return [], []
            calls.append(self._as_call({"name": name, "arguments": value}, "arguments"))
            ends.append(end)
            rest = body[end:].lstrip()
            if not rest:
                return calls, ends
            if not rest.startswith(_MISTRAL_CALLS):
                return [], []
            i = len(body) - len(rest) + len(_MISTRAL_CALLS)

    def _hermes(self, final: bool) -> list[Segment]:
        out: list[Segment] = []
        while True:
            if not self._in_call:
                at = self._held.find(_HERMES_OPEN)
                cut = at if at >= 0 else len(self._held) - (0 if final else partial_suffix(self._held, _HERMES_OPEN))
                out += self._text(self._held[:cut])
                self._held = self._held[cut:]
                if at < 0:
                    break
                self._held, self._in_call = self._held[len(_HERMES_OPEN):], True
                self._scanned, self._json_at, self._in_str, self._escaped = 0, 0, False, False
            end = self._call_end()
            if end < 0 and not final:
                break
            if end < 0:  # the end of the text: its first </tool_call>, or none
                end = self._held.find(_HERMES_CLOSE)
            body = self._held if end < 0 else self._held[:end]
            call = self._hermes_call(body)
            if call is None or not self.req.parallel and self.calls:
                out += self._text(_HERMES_OPEN + body + ("" if end < 0 else _HERMES_CLOSE))
            else:
                out += self._call(call)
            self._held = "" if end < 0 else self._held[end + len(_HERMES_CLOSE):]
            self._in_call = False
        if final:
            self._blank = ""  # whitespace after the last call
        return out

    def _call_end(self) -> int:
        """Where the ``</tool_call>`` that ends the call is in ``_held`` (-1: not yet): one inside the
        call's JSON strings is passed over (well-formed or not, the call ends at the first outside)."""
        end = self._held.find(_HERMES_CLOSE, self._scanned)
        while end >= 0 and self._inside_string(end):
            end = self._held.find(_HERMES_CLOSE, end + 1)
        if end < 0:  # what was searched need not be again: a long call is not rescanned
            self._scanned = max(0, len(self._held) - len(_HERMES_CLOSE) + 1)
        return end

    def _inside_string(self, end: int) -> bool:
        """Whether the call's JSON, up to ``end``, stops inside a string: read on from where it was
        last read, so a long call is read once."""
        inside, escaped = self._in_str, self._escaped
        for ch in self._held[self._json_at:end]:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = inside
            elif ch == '"':
                inside = not inside
        self._json_at, self._in_str, self._escaped = max(self._json_at, end), inside, escaped
        return inside

    def _hermes_call(self, body: str) -> dict | None:
        values = json_values(body)
        return self._as_call(values[0][0], "arguments") if values and len(values) == 1 else None

    def _as_call(self, obj: Any, args_key: str) -> dict | None:
        """``{"name": one of the tools, args_key: object}`` as a call (arguments as JSON text), else None."""
        name = obj.get("name") if isinstance(obj, dict) else None
        if not (isinstance(name, str) and name in self.req.schemas and isinstance(obj.get(args_key), dict)):
            return None
        try:
            arguments = json.dumps(obj[args_key], ensure_ascii=False)
            arguments.encode()  # a lone surrogate (an escape the model wrote) has no UTF-8
        except (RecursionError, ValueError):  # (UnicodeEncodeError is one)
            return None
        return new_call(obj["name"], arguments, self.req.fmt)

    def _text(self, text: str) -> list[Segment]:
        """Text as content; at the start and after a call, whitespace waits to see whether words or
        text that was no call (it goes with them), or a call or the end (it is dropped) come next."""
        if self._after_call:
            if not text.strip():
                self._blank += text
                return []
            text, self._blank, self._after_call = self._blank + text, "", False
        if not text:
            return []
        self.content += text
        return [("text", text)]

    def _call(self, call: dict) -> list[Segment]:
        self._after_call, self._blank = True, ""
        self.calls.append(call)
        return [("call", {"index": len(self.calls) - 1, **call})]
