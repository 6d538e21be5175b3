"""JSON schema's ``pattern`` (and vLLM's ``regex``): a regular expression compiled to an automaton over code points.

Torch-free. ``Pattern(source)`` parses the ECMA-262 subset a schema's patterns use: literals and
escapes (``\\d \\w \\s``, their negations, ``\\t \\n \\r \\f \\v \\0 \\xHH \\uHHHH``, escaped
punctuation), classes (``[a-z]``, ``[^...]``), ``.`` (no line terminator), groups (``(...)``,
``(?:...)``, ``(?<name>...)``), ``|``, ``* + ? {n} {n,} {n,m}`` (lazy ones match the same
strings), and ``^`` / ``$`` at the ends. Lookarounds and backreferences are refused
(``SchemaError``). As in JSON schema, a pattern matches anywhere in the string unless anchored
(``full``: the whole string, as vLLM's ``regex``).

It is a Thompson NFA with its dead states removed, run as sets of states (interned as ids):
``step(state, code_point)`` -> state or -1, ``accepting(state)``, and ``allows(state, lo, hi)``:
whether any code point in ``[lo, hi]`` can come next, so that a string written byte by byte
(UTF-8, or a ``\\u`` escape digit by digit) never starts a character that cannot be finished.
"""

from __future__ import annotations

import re
from bisect import bisect_right

from engine.json_schema import GrammarTooCostly, SchemaError

MAX_STATES = 4096  # NFA states (a {n,m} copies its operand: a pattern can grow fast)
MAX_MEMO = 200_000  # remembered steps (and ``allows`` answers) before they are dropped and recomputed
MAX_HELD = 1_000_000  # NFA states in the state sets a pattern has met (tens of MB): past it, GrammarTooCostly
_MAX = 0x10FFFF
ALL_CHARS = ((0, 0xD7FF), (0xE000, _MAX))  # every character (surrogates are never one)
_LINE_ENDS = ((0x0A, 0x0A), (0x0D, 0x0D), (0x2028, 0x2029))
_DIGIT = ((0x30, 0x39),)
_WORD = ((0x30, 0x39), (0x41, 0x5A), (0x5F, 0x5F), (0x61, 0x7A))
_SPACE = ((0x09, 0x0D), (0x20, 0x20), (0xA0, 0xA0), (0x1680, 0x1680), (0x2000, 0x200A), (0x2028, 0x2029),
          (0x202F, 0x202F), (0x205F, 0x205F), (0x3000, 0x3000), (0xFEFF, 0xFEFF))
_CONTROL_ESCAPES = {"t": 9, "n": 10, "v": 11, "f": 12, "r": 13, "0": 0}


# Character sets: sorted tuples of (lo, hi) code point ranges (engine.text_grammar builds its classes with these).
def char_union(*sets: tuple) -> tuple:
    ranges = sorted(r for s in sets for r in s)
    out: list[list[int]] = []
    for lo, hi in ranges:
        if out and lo <= out[-1][1] + 1:
            out[-1][1] = max(out[-1][1], hi)
        else:
            out.append([lo, hi])
    return tuple((lo, hi) for lo, hi in out)


def char_negate(s: tuple) -> tuple:
    out, at = [], 0
    for lo, hi in char_union(s):
        if lo > at:
            out.append((at, lo - 1))
        at = hi + 1
    if at <= _MAX:
        out.append((at, _MAX))
    return char_intersect(tuple(out), ALL_CHARS)


def char_intersect(a: tuple, b: tuple) -> tuple:
    out = []
    for lo1, hi1 in a:
        for lo2, hi2 in b:
            lo, hi = max(lo1, lo2), min(hi1, hi2)
            if lo <= hi:
                out.append((lo, hi))
    return char_union(tuple(out))


class Pattern:
    def __init__(self, source: str, full: bool = False, name: str = "pattern"):
        """``full``: the whole string must match (as vLLM's ``regex``), anchored or not; ``name``:
        what refusals call the source."""
        self.name, self.full = f"'{name}'", full
        if not isinstance(source, str):
            raise SchemaError(f"{self.name} must be a string")
        self.source = source
        self.eps: list[list[int]] = []  # epsilon edges per NFA state
        self.edges: list[list[tuple[tuple, int]]] = []  # (character set, target) per NFA state
        self._at = 0
        try:
            start, end = self._alternation(top=True)
        except RecursionError:
            raise SchemaError(f"{self.name} {_shown(source)} nests too deep") from None
        if self._at != len(source):
            raise SchemaError(f"{self.name} {_shown(source)}: unexpected {source[self._at]!r} at {self._at}")
        self.accept = end
        self._trim()
        self._ids: dict[frozenset, int] = {}
        self._sets: list[frozenset] = []
        self._held = 0  # NFA states in all the sets interned (what they cost in memory)
        self._steps: dict[tuple[int, int], int] = {}
        self._allows: dict[tuple[int, int, int], bool] = {}
        closure = self._closure({start})
        if not closure & self._live:
            raise SchemaError(f"{self.name} {_shown(source)} matches nothing")
        self.start = self._intern(frozenset(closure & self._live))

    # ------------------------------------------------------------------ running

    def step(self, state: int, cp: int) -> int:
        key = (state, cp)
        nxt = self._steps.get(key)
        if nxt is None:
            if len(self._steps) > MAX_MEMO:  # (memos only: the state ids stay)
                self._steps.clear()
            targets = {t for s in self._sets[state] for cs, t in self.edges[s] if _contains(cs, cp)}
            targets = self._closure(targets) & self._live if targets else set()
            nxt = self._steps[key] = self._intern(frozenset(targets)) if targets else -1
        return nxt

    def accepting(self, state: int) -> bool:
        return self.accept in self._sets[state]

    def allows(self, state: int, lo: int, hi: int) -> bool:
        """Whether some character in ``[lo, hi]`` can come next."""
        key = (state, lo, hi)
        hit = self._allows.get(key)
        if hit is None:
            if len(self._allows) > MAX_MEMO:
                self._allows.clear()
            hit = self._allows[key] = any(char_intersect(cs, ((lo, hi),)) for s in self._sets[state]
                                          for cs, _ in self.edges[s])
        return hit

    def _intern(self, states: frozenset) -> int:
        index = intern(self._ids, self._sets, states)
        if index == len(self._sets) - 1:  # (new)
            self._held += len(states)
            if self._held > MAX_HELD:
                raise GrammarTooCostly(f"{self.name} {_shown(self.source)} keeps too many states open at once "
                                       f"(its automaton grew past {MAX_HELD} NFA states in its state sets)")
        return index

    def _closure(self, states: set) -> set:
        return self._closure_of(self.eps, states)

    def _trim(self) -> None:
        """The states from which the accepting one can be reached (the others are dead ends)."""
        back: list[list[int]] = [[] for _ in self.eps]
        for s in range(len(self.eps)):
            for t in self.eps[s]:
                back[t].append(s)
            for _, t in self.edges[s]:
                back[t].append(s)
        self._live = self._closure_of(back, {self.accept})

    @staticmethod
    def _closure_of(graph: list[list[int]], states: set) -> set:
        todo, seen = list(states), set(states)
        while todo:
            for t in graph[todo.pop()]:
                if t not in seen:
                    seen.add(t)
                    todo.append(t)
        return seen

    # ------------------------------------------------------------------ building

    def _state(self) -> int:
        if len(self.eps) >= MAX_STATES:
            raise SchemaError(f"{self.name} {_shown(self.source)} is too large (more than {MAX_STATES} states)")
        self.eps.append([])
        self.edges.append([])
        return len(self.eps) - 1

    def _any_prefix(self, start: int) -> int:
        s = self._state()
        self.edges[s].append((ALL_CHARS, s))
        self.eps[s].append(start)
        return s

    def _any_suffix(self, end: int) -> int:
        s = self._state()
        self.eps[end].append(s)
        self.edges[s].append((ALL_CHARS, s))
        return s

    def _peek(self) -> str | None:
        return self.source[self._at] if self._at < len(self.source) else None

    def _alternation(self, top: bool = False) -> tuple[int, int]:
        """Alternatives; at the top, each may begin with ``^`` and end with ``$``, and one without
        may match anywhere in the string: any characters before it, or after it."""
        start, end = self._state(), self._state()
        while True:
            anchored = top and self._peek() == "^"
            self._at += anchored
            s, e = self._sequence(top)
            if top and not anchored and not self.full:
                s = self._any_prefix(s)
            if top and self._anchor_end():
                self._at += 1
            elif top and not self.full:
                e = self._any_suffix(e)
            self.eps[start].append(s)
            self.eps[e].append(end)
            if self._peek() != "|":
                return start, end
            self._at += 1

    def _anchor_end(self) -> bool:
        """Whether a ``$`` that ends a top-level alternative is next."""
        return self.source[self._at:self._at + 1] == "$" and self.source[self._at + 1:self._at + 2] in ("", "|")

    def _sequence(self, top: bool = False) -> tuple[int, int]:
        start = end = self._state()
        while self._peek() not in (None, "|", ")") and not (top and self._anchor_end()):
            s, e = self._repeat()
            self.eps[end].append(s)
            end = e
        return start, end

    def _repeat(self) -> tuple[int, int]:
        begin = self._at
        first = self._atom()
        c = self._peek()
        if c not in ("*", "+", "?", "{"):
            return first
        if c == "{":
            close = self.source.find("}", self._at)
            parts = self.source[self._at + 1:close].split(",") if close > 0 else []
            number = re.compile("[0-9]{1,4}")
            if not 1 <= len(parts) <= 2 or not all(number.fullmatch(p) for p in parts if p) or not parts[0]:
                raise SchemaError(f"{self.name} {_shown(self.source)}: a bad repetition at {self._at}")
            lo = int(parts[0])
            hi = lo if len(parts) == 1 else int(parts[1]) if parts[1] else -1
            if 0 <= hi < lo or max(lo, hi) > 1000:
                raise SchemaError(f"{self.name} {_shown(self.source)}: a bad repetition {{{','.join(parts)}}}")
            self._at = close + 1
        else:
            lo, hi = {"*": (0, -1), "+": (1, -1), "?": (0, 1)}[c]
            self._at += 1
        if self._peek() == "?":  # lazy: the same strings
            self._at += 1
        after = self._at
        copies = [first]
        for _ in range((hi if hi >= 0 else max(lo, 1)) - 1):  # a fresh fragment per copy: parse it again
            self._at = begin
            copies.append(self._atom())
        self._at = after
        start, final = self._state(), self._state()
        at = start
        for i, (s, e) in enumerate(copies if hi != 0 else []):
            if i >= lo:  # optional from here on
                self.eps[at].append(final)
            self.eps[at].append(s)
            at = e
        self.eps[at].append(final)
        if hi < 0:  # unbounded: the last copy again and again
            self.eps[copies[-1][1]].append(copies[-1][0])
        return start, final

    def _atom(self) -> tuple[int, int]:
        c = self._peek()
        if c == "(":
            self._at += 1
            if self.source.startswith("?:", self._at):
                self._at += 2
            elif self.source.startswith("?<", self._at) and not self.source.startswith("?<=", self._at) \
                    and not self.source.startswith("?<!", self._at):
                close = self.source.find(">", self._at)
                if close < 0:
                    raise SchemaError(f"{self.name} {_shown(self.source)}: an unfinished group name")
                self._at = close + 1
            elif self._peek() == "?":
                raise SchemaError(f"{self.name} {_shown(self.source)}: lookarounds are not supported")
            s, e = self._alternation()
            if self._peek() != ")":
                raise SchemaError(f"{self.name} {_shown(self.source)}: a '(' without its ')'")
            self._at += 1
            return s, e
        if c in ("*", "+", "?", "{", ")"):
            raise SchemaError(f"{self.name} {_shown(self.source)}: nothing to repeat at {self._at}")
        if c in ("^", "$"):
            raise SchemaError(f"{self.name} {_shown(self.source)}: '^' and '$' are supported only at the ends of its "
                              "alternatives")
        if c == "[":
            chars = self._class()
        elif c == ".":
            self._at += 1
            chars = char_intersect(char_negate(_LINE_ENDS), ALL_CHARS)
        elif c == "\\":
            chars = self._escape(in_class=False)
        else:
            self._at += 1
            chars = ((ord(c), ord(c)),)
        s, e = self._state(), self._state()
        chars = char_intersect(chars, ALL_CHARS)  # (a surrogate is never a character)
        if chars:  # an empty set is no edge: nothing passes it
            self.edges[s].append((chars, e))
        return s, e

    def _escape(self, in_class: bool) -> tuple:
        self._at += 1
        c = self._peek()
        if c is None:
            raise SchemaError(f"{self.name} {_shown(self.source)} ends with a backslash")
        self._at += 1
        classes = {"d": _DIGIT, "w": _WORD, "s": _SPACE}
        if c in classes:
            return classes[c]
        if c.lower() in classes:
            return char_negate(classes[c.lower()])
        if c in _CONTROL_ESCAPES:
            return ((_CONTROL_ESCAPES[c],) * 2,)
        if c in ("x", "u"):
            n = 2 if c == "x" else 4
            digits = self.source[self._at:self._at + n]
            if not re.fullmatch(f"[0-9a-fA-F]{{{n}}}", digits):
                raise SchemaError(f"{self.name} {_shown(self.source)}: a bad \\{c} escape")
            self._at += n
            cp = int(digits, 16)
            low = re.match(r"\\u(d[c-f][0-9a-f]{2})", self.source[self._at:self._at + 6], re.IGNORECASE)
            if 0xD800 <= cp <= 0xDBFF and low:  # a surrogate pair: one character
                self._at += 6
                cp = 0x10000 + ((cp - 0xD800) << 10) + int(low.group(1), 16) - 0xDC00
            return ((cp, cp),)
        if c == "b" and in_class:
            return ((8, 8),)
        if c.isalnum():
            raise SchemaError(f"{self.name} {_shown(self.source)}: the escape \\{c} is not supported")
        return ((ord(c), ord(c)),)

    def _class(self) -> tuple:
        self._at += 1
        negated = self._peek() == "^"
        if negated:
            self._at += 1
        parts: list[tuple] = []
        while self._peek() != "]":
            c = self._peek()
            if c is None:
                raise SchemaError(f"{self.name} {_shown(self.source)}: a '[' without its ']'")
            lo_set = self._escape(in_class=True) if c == "\\" else self._char()
            if self._peek() == "-" and self.source[self._at + 1:self._at + 2] not in ("]", ""):
                self._at += 1
                hi_set = self._escape(in_class=True) if self._peek() == "\\" else self._char()
                if len(lo_set) != 1 or len(hi_set) != 1 or lo_set[0][0] != lo_set[0][1] \
                        or hi_set[0][0] != hi_set[0][1] or lo_set[0][0] > hi_set[0][0]:
                    raise SchemaError(f"{self.name} {_shown(self.source)}: a bad range in a class")
                parts.append(((lo_set[0][0], hi_set[0][0]),))
            else:
                parts.append(lo_set)
        self._at += 1
        chars = char_intersect(char_union(*parts), ALL_CHARS)
        return char_negate(chars) if negated else chars

    def _char(self) -> tuple:
        c = self.source[self._at]
        self._at += 1
        return ((ord(c), ord(c)),)


def _shown(source: str) -> str:
    """A source as refusals quote it: its first 80 characters."""
    return repr(source) if len(source) <= 80 else repr(source[:80]) + "..."


def _contains(chars: tuple, cp: int) -> bool:
    i = bisect_right(chars, (cp, _MAX + 1)) - 1
    return i >= 0 and chars[i][0] <= cp <= chars[i][1]


def intern(ids: dict, items: list, key) -> int:
    """``key``'s index in ``items``, appended if new (``ids`` maps each key to its index)."""
    index = ids.get(key)
    if index is None:
        index = ids[key] = len(items)
        items.append(key)
    return index
