"""A JSON schema compiled into the small node table that ``engine.grammar`` walks.

Torch-free. ``compile_schema(schema)`` returns ``Nodes`` and the root's index: a list where a node is a tuple and
refers to others by index, so ``$ref`` cycles (recursive schemas) are plain back references.

Node shapes:
- ``(LIT, b'...')``: exactly these bytes (``const``, ``enum`` members, ``true``, ``null``);
- ``(STR, min_len, max_len)``: any JSON string, ``max_len`` -1 for no bound (characters);
- ``(NUM, integer)``: a JSON number, or an integer when ``integer``;
- ``(OBJ, ((key_bytes, node, required), ...), additional)``: the listed properties in their order
  (optional ones may be left out), then, if ``additional`` >= 0, other keys with values of that node;
- ``(ARR, item, min_items, max_items)``: ``max_items`` -1 for no bound;
- ``(ALT, (node, ...))``: any one of these;
- ``(PAT, Pattern)``: a JSON string whose text the ``engine.regex.Pattern`` matches.

What it understands: ``type`` (one or a list), ``enum``, ``const``, ``properties``,
``required``, ``additionalProperties``, ``items``, ``minItems``, ``maxItems``, ``minLength``,
``maxLength``, ``pattern`` (``engine.regex``: ``(PAT, Pattern)`` nodes), ``format`` (those of
``FORMATS``, as patterns), ``anyOf``, ``oneOf`` (as ``anyOf``), a one-member ``allOf``, ``$ref``
into ``$defs`` / ``definitions`` (or ``#``), and annotations it has nothing to enforce
(``title``, ``description``, ``default``...). Anything else (``minimum``, ``uniqueItems``...) is
refused by name with a ``SchemaError``: output that only looks constrained is worse than a clear
400. Without ``additionalProperties``, an object with ``properties`` has no other keys (as
llama.cpp and xgrammar's strict mode do); ``{"type": "object"}`` alone is any object, ``{}``
any JSON value.
"""

from __future__ import annotations

import json
from typing import Any

LIT, STR, NUM, OBJ, ARR, ALT, PAT = range(7)
Nodes = list[tuple]
ANY = 0  # node 0 of every table: any JSON value

MAX_NODES = 4096
# NFA states of a schema's distinct patterns together (each has its own cap, engine.regex.MAX_STATES): the
# engine compiles a schema on its step loop, so what one request can make it spend there stays small
MAX_PATTERN_STATES = 16384
MAX_DEPTH = 128  # schemas within schemas (each $ref one more): Python's recursion stays far from its limit
_ANNOTATIONS = frozenset({
    "title", "description", "default", "examples", "$schema", "$id", "$comment", "deprecated",
    "readOnly", "writeOnly", "discriminator", "strict", "$defs", "definitions",
})
_TYPES = ("string", "number", "integer", "boolean", "null", "object", "array")


class SchemaError(ValueError):
    """A schema this compiler refuses; the message names the keyword."""


class GrammarTooCostly(SchemaError):
    """A grammar (schema, regex, GBNF) whose automaton costs too much time or memory while it runs: the
    request that meets it ends, and later ones with the same grammar are refused."""


def compile_schema(schema: Any) -> tuple[Nodes, int]:
    """The node table of ``schema`` and its root's index."""
    c = _Compiler(schema)
    return c.nodes, c.refs["#"]


def compile_choice(choices: list[str]) -> tuple[Nodes, int]:
    """A node table whose values are exactly these strings, as raw text (no quotes)."""
    try:
        data = [c.encode() for c in choices]
    except UnicodeEncodeError:
        raise SchemaError("a choice that is not text (a lone surrogate)") from None
    return [(ALT, tuple(range(1, len(data) + 1))), *((LIT, d) for d in data)], 0


def literal(value: Any) -> bytes:
    """A JSON value as the compact bytes a literal node matches."""
    try:
        return json.dumps(value, ensure_ascii=False, separators=(",", ":"), allow_nan=False).encode()
    except (ValueError, TypeError) as e:  # (a lone surrogate, NaN: only through the Python API)
        raise SchemaError(f"a literal that is not JSON: {e}") from None


class _Compiler:
    def __init__(self, root: Any) -> None:
        if not isinstance(root, dict):
            raise SchemaError("a JSON schema must be an object")
        self.root = root
        self.defs = {}
        for key in ("$defs", "definitions"):
            d = root.get(key, {})
            if not isinstance(d, dict):
                raise SchemaError(f"'{key}' must be an object")
            self.defs.update({f"#/{key}/{name}": s for name, s in d.items()})
        self.refs: dict[str, int] = {}
        self.patterns: dict[str, Any] = {}  # source -> its engine.regex.Pattern: one each, however often used
        self.pattern_states = 0
        self.nodes: Nodes = [None]  # ANY, filled once its parts exist
        parts = [(STR, 0, -1), (NUM, False), (OBJ, (), ANY), (ARR, ANY, 0, -1)]
        parts += [(LIT, literal(v)) for v in (True, False, None)]
        self.nodes[ANY] = (ALT, tuple(self._add(p) for p in parts))
        self._copies: list[tuple[int, int]] = []  # (slot, node): a $ref's slot is that node, once it is known
        self.refs["#"] = self._add(None)  # the root's slot, filled below (so "#" can refer to it)
        try:
            self._copies.append((self.refs["#"], self._schema(root)))
        except RecursionError:
            raise SchemaError("the schema nests too deep") from None
        while self._copies:  # a slot copies one that may itself be waiting for a copy
            waiting = [(slot, node) for slot, node in self._copies if self.nodes[node] is None]
            if len(waiting) == len(self._copies):
                raise SchemaError("a '$ref' refers to itself with nothing in between")
            for slot, node in self._copies:
                if self.nodes[node] is not None:
                    self.nodes[slot] = self.nodes[node]
            self._copies = waiting

    def _add(self, node: tuple | None) -> int:
        if len(self.nodes) >= MAX_NODES:
            raise SchemaError(f"the schema is too large (more than {MAX_NODES} nodes)")
        self.nodes.append(node)
        return len(self.nodes) - 1

    def _pattern(self, source: Any) -> Any:
        from engine.regex import Pattern  # (a cycle: regex raises this module's SchemaError)

        if isinstance(source, str) and source in self.patterns:
            return self.patterns[source]
        p = Pattern(source)
        self.pattern_states += len(p.eps)
        if self.pattern_states > MAX_PATTERN_STATES:
            raise SchemaError(f"the schema's patterns are too large together (more than {MAX_PATTERN_STATES} states)")
        self.patterns[source] = p
        return p

    def _schema(self, s: Any, depth: int = 0) -> int:
        if depth > MAX_DEPTH:
            raise SchemaError(f"the schema nests more than {MAX_DEPTH} levels deep (counting each $ref)")
        if s is True or s == {}:
            return ANY
        if not isinstance(s, dict):
            raise SchemaError(f"a schema must be an object, got {json.dumps(s)[:80]}")
        unknown = sorted(set(s) - _ANNOTATIONS - _KNOWN)
        if unknown:
            raise SchemaError(f"the JSON schema keyword '{unknown[0]}' is not supported (supported: "
                              f"{', '.join(sorted(_KNOWN))})")
        for key in ("$ref", "anyOf", "oneOf"):  # what sits beside these would go unenforced: refused
            beside = sorted(set(s) - _ANNOTATIONS - {key}) if key in s else []
            if beside:
                raise SchemaError(f"'{beside[0]}' beside '{key}' is not supported: move it into the alternatives")
        if "$ref" in s:
            return self._ref(s["$ref"], depth)
        if "allOf" in s:
            parts = s["allOf"]
            if not isinstance(parts, list) or len(parts) != 1 or len(s) - len(_ANNOTATIONS & set(s)) > 1:
                raise SchemaError("'allOf' is supported only with a single schema and nothing beside it")
            return self._schema(parts[0], depth + 1)
        for key in ("anyOf", "oneOf"):
            if key in s:
                alts = s[key]
                if not isinstance(alts, list) or not alts:
                    raise SchemaError(f"'{key}' must be a non-empty list of schemas")
                return self._alt([self._schema(a, depth + 1) for a in alts])
        if "const" in s or "enum" in s:
            return self._literals(s)
        t = s.get("type")
        if "type" not in s:  # the type its keywords are for (as a schema without one would check them)
            implied = [k for k, words in _KEYWORDS_OF.items() if words & set(s)]
            if len(implied) > 1:
                raise SchemaError(f"keywords of {implied[0]}s and of {implied[1]}s without a 'type'")
            if not implied:
                return ANY
            t = implied[0]
        types = t if isinstance(t, list) else [t]
        if not types or any(x not in _TYPES for x in types):
            raise SchemaError(f"'type' must be one of {', '.join(_TYPES)} (or a list of them), got {t!r}")
        return self._alt([self._typed(x, s, depth) for x in types])

    def _literals(self, s: dict) -> int:
        """``const`` or ``enum``; beside them only ``type``, which keeps the members of its types."""
        key = "const" if "const" in s else "enum"
        values = [s["const"]] if key == "const" else s["enum"]
        if not isinstance(values, list) or not values:
            raise SchemaError("'enum' must be a non-empty list")
        beside = sorted(set(s) - _ANNOTATIONS - {key, "type"})
        if beside:
            raise SchemaError(f"'{beside[0]}' beside '{key}' is not supported")
        if "type" in s:
            types = s["type"] if isinstance(s["type"], list) else [s["type"]]
            values = [v for v in values if any(_is_type(v, t) for t in types)]
            if not values:
                raise SchemaError(f"no member of '{key}' has the schema's 'type'")
            if "integer" in types and "number" not in types:  # 1.0 written as the integer it is (strict clients)
                values = [int(v) if isinstance(v, float) else v for v in values]
        return self._alt([self._add((LIT, literal(v))) for v in values])

    def _typed(self, t: str, s: dict, depth: int) -> int:
        if t == "string" and ("pattern" in s or "format" in s):
            if "pattern" in s and "format" in s or "minLength" in s or "maxLength" in s:
                raise SchemaError(f"'{'pattern' if 'pattern' in s else 'format'}' goes with no 'format', 'minLength' "
                                  "or 'maxLength' here")
            if "format" in s and (not isinstance(s["format"], str) or s["format"] not in FORMATS):
                raise SchemaError(f"the string 'format' {s['format']!r} is not supported (supported: "
                                  f"{', '.join(FORMATS)})")
            return self._add((PAT, self._pattern(s["pattern"] if "pattern" in s else FORMATS[s["format"]])))
        if t == "string":
            lo, hi = _count(s, "minLength", 0), _count(s, "maxLength", -1)
            if hi >= 0 and lo > hi:
                raise SchemaError("'minLength' is larger than 'maxLength'")
            return self._add((STR, lo, hi))
        if t in ("number", "integer"):
            return self._add((NUM, t == "integer"))
        if t == "boolean":
            return self._alt([self._add((LIT, b"true")), self._add((LIT, b"false"))])
        if t == "null":
            return self._add((LIT, b"null"))
        if t == "array":
            lo, hi = _count(s, "minItems", 0), _count(s, "maxItems", -1)
            if hi >= 0 and lo > hi:
                raise SchemaError("'minItems' is larger than 'maxItems'")
            return self._add((ARR, self._schema(s.get("items", True), depth + 1), lo, hi))
        return self._object(s, depth)

    def _object(self, s: dict, depth: int) -> int:
        props = s.get("properties", {})
        required = s.get("required", [])
        if not isinstance(props, dict):
            raise SchemaError("'properties' must be an object")
        if not isinstance(required, list) or not all(isinstance(r, str) for r in required):
            raise SchemaError("'required' must be a list of property names")
        missing = [r for r in required if r not in props]
        if missing:
            raise SchemaError(f"'required' names '{missing[0]}', which is not in 'properties'")
        extra = s.get("additionalProperties", "properties" not in s)
        if extra is False:
            additional = -1
        else:
            additional = self._schema(True if extra is True else extra, depth + 1)
        slot = self._add(None)
        members = tuple((literal(name), self._schema(sub, depth + 1), name in required)
                        for name, sub in props.items())
        self.nodes[slot] = (OBJ, members, additional)
        return slot

    def _ref(self, ref: Any, depth: int) -> int:
        if isinstance(ref, str) and ref in self.refs:
            return self.refs[ref]
        if not isinstance(ref, str) or ref not in self.defs:
            raise SchemaError(f"'$ref' {ref!r} is not supported: only '#', '#/$defs/NAME' and "
                              "'#/definitions/NAME' of this schema")
        slot = self.refs[ref] = self._add(None)  # filled at the end: a recursive reference finds this slot
        self._copies.append((slot, self._schema(self.defs[ref], depth + 1)))
        return slot

    def _alt(self, options: list[int]) -> int:
        return options[0] if len(options) == 1 else self._add((ALT, tuple(options)))


_KEYWORDS_OF = {"object": {"properties", "required", "additionalProperties"}, "array": {"items", "minItems", "maxItems"},
                "string": {"minLength", "maxLength", "pattern", "format"}}
_DATE = r"\d{4}-(0[1-9]|1[0-2])-(0[1-9]|[12]\d|3[01])"
_TIME = r"([01]\d|2[0-3]):[0-5]\d:[0-5]\d(\.\d{1,9})?([Zz]|[+-]([01]\d|2[0-3]):[0-5]\d)"
_IPV4_PART = r"(25[0-5]|2[0-4]\d|1\d\d|[1-9]?\d)"
FORMATS = {  # string formats, as the patterns they are held to (RFC 3339 dates and times)
    "date": f"^{_DATE}$",
    "time": f"^{_TIME}$",
    "date-time": f"^{_DATE}[Tt]{_TIME}$",
    "uuid": r"^[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}$",
    "email": r"^[A-Za-z0-9._%+-]{1,64}@[A-Za-z0-9-]{1,63}(\.[A-Za-z0-9-]{1,63})+$",
    "ipv4": f"^({_IPV4_PART}\\.){{3}}{_IPV4_PART}$",
}
_KNOWN = frozenset({
    "type", "enum", "const", "properties", "required", "additionalProperties", "items", "minItems",
    "maxItems", "minLength", "maxLength", "pattern", "format", "anyOf", "oneOf", "allOf", "$ref",
})


def _count(s: dict, key: str, default: int) -> int:
    if key not in s:
        return default
    v = s[key]
    if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= 1 << 20:
        raise SchemaError(f"'{key}' must be a non-negative integer, got {v!r}")
    return v


def _is_type(value: Any, t: Any) -> bool:
    kinds = {"string": str, "integer": int, "number": (int, float), "boolean": bool, "null": type(None),
             "object": dict, "array": list}
    if not isinstance(t, str) or t not in kinds:
        raise SchemaError(f"'type' must be one of {', '.join(_TYPES)} (or a list of them), got {t!r}")
    if t == "integer" and isinstance(value, float):
        return value.is_integer()  # (1.0 is an integer to JSON Schema)
    return isinstance(value, kinds[t]) and (t == "boolean" or not isinstance(value, bool))

