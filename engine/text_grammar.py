"""Raw-text structured output: a GBNF grammar (llama.cpp's) or a regular expression, run over bytes.

Torch-free. ``compile_gbnf(text)`` parses llama.cpp's GBNF into ``Rules`` (refused with a
``SchemaError`` naming the rule: undefined, defined twice, left recursive, or never finishing);
``GbnfGrammar(rules)`` and ``RegexGrammar(source)`` are ``engine.grammar.Automaton`` s, so
``engine.structured`` masks tokens for them as for a JSON schema. The output is the grammar's
text exactly: no whitespace before it.

GBNF as llama.cpp reads it (its ``grammars/README.md``): ``name ::= alternatives``, ``root`` the
start; ``"literal"`` and ``[a-z]`` / ``[^...]`` with the escapes ``\\n \\r \\t \\\\ \\" \\[ \\]
\\xHH \\uHHHH \\UHHHHHHHH``; ``.`` any character; ``( )``, ``|``, ``* + ?``, ``{m}``, ``{m,}``,
``{m,n}``; ``#`` comments. A rule ends where the next ``name ::=`` begins (llama.cpp also ends one
at a newline outside parentheses: every grammar it reads reads the same here).

A rule is alternatives of sequences of *elements*: a character set (code point ranges) or a rule.
Repetitions and groups become rules of their own, as llama.cpp makes them (``x*``: ``r ::= x r |``).
Alternatives that begin alike share their beginning (``_factor``: an enum of a thousand words is a
trie). The elements are laid out flat, each alternative ended by an ``END``; an item of a state is a
*stack* of positions in that table (its top last: the character set that comes next; empty: the
text may end) and the bytes of a character begun but not finished. A reference whose alternative
ends right after it is not kept on the stack (so ``x*`` runs in constant depth); an alternative is
started only where it can finish within ``MAX_DEPTH`` positions (each knows the depth it needs), so
every stack kept can end. Left recursion (``expr ::= expr "+" term``) would expand forever and is
refused, as llama.cpp refuses it. Compiling is linear in the grammar's size (worklists, no fixpoint
passes): the engine compiles on its step loop.
"""

from __future__ import annotations

import heapq
import re
from bisect import bisect_right

from engine.grammar import Automaton
from engine.json_schema import SchemaError
from engine.regex import ALL_CHARS, Pattern, char_intersect, char_negate, char_union

MAX_GRAMMAR_ELEMENTS = 20_000  # elements after repetitions are unrolled ({m,n} copies its operand)
MAX_REPEAT = 1000  # m and n of {m,n}
MAX_DEPTH = 256  # positions on a stack
MAX_NESTING = 100  # parentheses in parentheses (the parser recurses through them)
MAX_ITEMS = 64  # stacks a state keeps (a grammar's alternatives not yet told apart)
_EXPAND_BUDGET = 1024  # stacks one byte's expansions may reach: an ambiguous grammar cannot stall a step
END = -1  # an alternative's end in the element table; a rule reference is its index (>= 0) ...
_UNFINISHABLE = 1 << 30
# (elements: a rule index or a character set; per rule its alternatives' starts; and the depth each needs)
Rules = tuple[list, list[list[int]], list[list[int]]]

_TOKEN = re.compile(r"""
    (?P<space>(?:\s|\#[^\n]*)+)
  | (?P<define>::=)
  | (?P<name>[A-Za-z0-9_-]+)
  | (?P<literal>"(?:[^"\\]|\\.)*")
  | (?P<chars>\[(?:[^\]\\]|\\.)*\])
  | (?P<repeat>\{\s*\d*\s*(?:,\s*\d*\s*)?\})
  | (?P<op>[().|*+?])
""", re.VERBOSE | re.DOTALL)
_ESCAPES = {"n": 10, "r": 13, "t": 9, "\\": 92, '"': 34, "[": 91, "]": 93, "-": 45}


def _tokens(text: str) -> list[tuple[str, str, int]]:
    out, at = [], 0
    while at < len(text):
        m = _TOKEN.match(text, at)
        if m is None:
            raise SchemaError(f"the grammar has an unexpected {text[at:at + 20]!r} at character {at}")
        if m.lastgroup != "space":
            out.append((m.lastgroup, m.group(), at))
        at = m.end()
    return out


def _char(body: str, i: int, at: int) -> tuple[int, int]:
    """The character at ``body[i]`` (an escape read) and where the next one starts."""
    if body[i] != "\\":
        return ord(body[i]), i + 1
    e = body[i + 1]
    width = {"x": 2, "u": 4, "U": 8}.get(e)
    if width is None:
        if e not in _ESCAPES:
            raise SchemaError(f"the grammar has an unknown escape '\\{e}' at character {at + i}")
        return _ESCAPES[e], i + 2
    digits = body[i + 2:i + 2 + width]
    if len(digits) != width or not all(d in "0123456789abcdefABCDEF" for d in digits):
        raise SchemaError(f"'\\{e}' needs {width} hex digits at character {at + i}")
    cp = int(digits, 16)
    if cp > 0x10FFFF or 0xD800 <= cp <= 0xDFFF:
        raise SchemaError(f"'\\{e}{digits}' at character {at + i} is not a character")
    return cp, i + 2 + width


def _literal(body: str, at: int) -> list[int]:
    out, i = [], 0
    while i < len(body):
        cp, i = _char(body, i, at)
        out.append(cp)
    return out


def _char_class(token: str, at: int) -> tuple:
    """``[...]`` or ``[^...]`` as code point ranges; a ``-`` between two characters (not escaped) is a range."""
    negated = token.startswith("[^")
    body, at = token[2 if negated else 1:-1], at + (2 if negated else 1)
    ranges, i = [], 0
    while i < len(body):
        lo, i = _char(body, i, at)
        hi = lo
        if body[i:i + 1] == "-" and i + 1 < len(body):
            hi, i = _char(body, i + 1, at)
            if hi < lo:
                raise SchemaError(f"the range in {token!r} at character {at} is backwards")
        ranges.append((lo, hi))
    chars = char_negate(tuple(ranges)) if negated else char_intersect(char_union(tuple(ranges)), ALL_CHARS)
    if not chars:
        raise SchemaError(f"{token!r} at character {at} matches no character")
    return chars


class _Parser:
    def __init__(self, text: str):
        self.tokens = _tokens(text)
        self.at = 0
        self.names: dict[str, int] = {}  # rule name -> index (referred to before defined too)
        self.defined: set[str] = set()
        self.rules: list[list[list] | None] = []  # per rule its alternatives: lists of elements
        self.size = self.nesting = 0
        while self.at < len(self.tokens):
            kind, name, pos = self.tokens[self.at]
            if kind != "name" or self._peek(1)[0] != "define":
                raise SchemaError(f"expected 'name ::=' at character {pos}, got {name!r}")
            if name in self.defined:
                raise SchemaError(f"rule '{name}' is defined twice")
            self.defined.add(name)
            self.at += 2
            self.rules[self._rule(name)] = self._alternatives()
        if "root" not in self.defined:
            raise SchemaError("the grammar has no 'root' rule (where the text starts)")
        undefined = sorted(set(self.names) - self.defined)
        if undefined:
            raise SchemaError(f"rule '{undefined[0]}' is used but not defined")

    def _peek(self, ahead: int = 0) -> tuple[str, str, int]:
        i = self.at + ahead
        return self.tokens[i] if i < len(self.tokens) else ("end", "", -1)

    def _rule(self, name: str | None = None) -> int:
        if name is not None and name in self.names:
            return self.names[name]
        self.rules.append(None)
        if name is not None:
            self.names[name] = len(self.rules) - 1
        return len(self.rules) - 1

    def _new(self, alternatives: list[list]) -> int:
        r = self._rule()
        self.rules[r] = alternatives
        return r

    def _grow(self, n: int) -> None:
        self.size += n
        if self.size > MAX_GRAMMAR_ELEMENTS:
            raise SchemaError(f"the grammar is too large (more than {MAX_GRAMMAR_ELEMENTS} elements once repetitions "
                              "are unrolled)")

    def _alternatives(self) -> list[list]:
        alts = [self._sequence()]
        while self._peek()[1] == "|" and self._peek()[0] == "op":
            self.at += 1
            alts.append(self._sequence())
        return alts

    def _sequence(self) -> list:
        seq: list = []
        while True:
            kind, value, pos = self._peek()
            if kind == "name" and self._peek(1)[0] == "define" or kind == "end" or value in ("|", ")"):
                return seq
            atom = self._atom()
            while self._peek()[0] == "repeat" or self._peek()[1] in ("*", "+", "?"):
                atom = self._repeat(atom, *self._peek()[1:])
                self.at += 1
            self._grow(len(atom))
            seq.extend(atom)

    def _atom(self) -> list:
        kind, value, pos = self._peek()
        self.at += 1
        if kind == "literal":
            return [((cp, cp),) for cp in _literal(value[1:-1], pos + 1)]
        if kind == "chars":
            return [_char_class(value, pos)]
        if kind == "name":
            return [self._rule(value)]
        if value == ".":
            return [ALL_CHARS]
        if value == "(":
            self.nesting += 1
            if self.nesting > MAX_NESTING:
                raise SchemaError(f"the grammar nests parentheses deeper than {MAX_NESTING} levels")
            alts = self._alternatives()
            self.nesting -= 1
            if self._peek()[1] != ")":
                raise SchemaError(f"'(' at character {pos} is not closed")
            self.at += 1
            return [self._new(alts)]
        raise SchemaError(f"the grammar has an unexpected {value!r} at character {pos}")

    def _repeat(self, atom: list, op: str, pos: int) -> list:
        one = atom if len(atom) == 1 else [self._new([atom])]
        if op in ("*", "+", "?"):
            lo, hi = {"*": (0, -1), "+": (1, -1), "?": (0, 1)}[op]
        else:
            parts = [p.strip() for p in op[1:-1].split(",")]
            if parts[0] == "" and (len(parts) == 1 or parts[1] == ""):
                raise SchemaError(f"{op!r} at character {pos} gives no count")
            lo = int(parts[0] or 0)
            hi = lo if len(parts) == 1 else int(parts[1]) if parts[1] else -1
            if max(lo, hi) > MAX_REPEAT or -1 < hi < lo:
                raise SchemaError(f"{op!r} at character {pos}: counts are 0 <= m <= n <= {MAX_REPEAT}")
        self._grow(lo + max(hi - lo, 1))
        seq = one * lo
        if hi < 0:  # then any number: r ::= x r |
            r = self._rule()
            self.rules[r] = [one + [r], []]
            return seq + [r]
        tail: list = []  # hi - lo optional ones, nested: r ::= x tail |
        for _ in range(hi - lo):
            tail = [self._new([one + tail, []])]
        return seq + tail


def compile_gbnf(text: str) -> tuple[Rules, int]:
    """A GBNF grammar's element table and its root rule's index; ``SchemaError`` if it is refused."""
    if not isinstance(text, str) or not text.strip():
        raise SchemaError("a grammar must be GBNF text with a 'root' rule")
    p = _Parser(text)
    rules = p.rules
    names = {i: n for n, i in p.names.items()}

    def called(r: int) -> str:
        return f"rule '{names[r]}'" if r in names else f"a group or repetition in the rule before it (#{r})"

    rules = _factor(rules)
    nullable = _nullable(rules)
    depth, needs = _depths(rules)
    reachable, todo = {p.names["root"]}, [p.names["root"]]
    while todo:
        for a in rules[todo.pop()]:
            for e in a:
                if isinstance(e, int) and e not in reachable:
                    reachable.add(e)
                    todo.append(e)
    for r in sorted(reachable):
        if depth[r] >= _UNFINISHABLE:
            raise SchemaError(f"{called(r)} can never finish (every alternative needs itself again)")
    # left recursion: a rule that can come first in itself (past rules that may match nothing). Through a
    # reference with more of its alternative after it, each round grows the stack: refused. Through
    # references that end their alternatives only (``(x?)*``: r ::= x r |), the stack stays as it was,
    # and an expansion stops where it has been before (``GbnfGrammar._expand``).
    edges = [[edge for a in alts for edge in _leading_rules(a, nullable)] for alts in rules]
    component = _components([[e for e, _ in out] for out in edges])
    for r in sorted(reachable):
        for e, last in edges[r]:
            if not last and component[e] == component[r]:
                raise SchemaError(f"{called(e)} is left recursive (it can begin with itself), which GBNF "
                                  "cannot run: write the repetition with '*' instead")
    root = p.names["root"]
    if depth[root] > MAX_DEPTH:
        raise SchemaError(f"the grammar nests deeper than {MAX_DEPTH} levels on every way to finish")
    elements: list = []
    starts: list[list[int]] = []
    for alts in rules:
        starts.append([])
        for a in alts:
            starts[-1].append(len(elements))
            elements.extend(a)
            elements.append(END)
    return (elements, starts, needs), root


def _factor(rules: list[list[list]]) -> list[list[list]]:
    """Alternatives that begin alike share their beginning (``"item1" | "item2"``: ``"item" ("1" | "2")``),
    so that a state holds one stack for them while the text does not tell them apart, not one each
    (an enum of a thousand words would otherwise overflow ``MAX_ITEMS``). The language is the same."""
    todo = list(range(len(rules)))
    while todo:
        r = todo.pop()
        alts = rules[r]
        groups: dict = {}
        for alt in alts:
            if alt:
                groups.setdefault(alt[0], []).append(alt)
        if all(len(g) == 1 for g in groups.values()) and sum(not a for a in alts) <= 1:
            continue
        out: list[list] = []
        for alt in alts:
            group = groups.get(alt[0]) if alt else None
            if group is None:  # (the first of several empty alternatives: one is enough)
                if not alt and [] not in out:
                    out.append(alt)
                continue
            if len(group) == 1:
                out.append(alt)
                continue
            if group[0] is not alt:  # (the group is written where its first member was)
                continue
            k = 1  # the longest beginning the group shares
            while all(len(g) > k and g[k] == group[0][k] for g in group):
                k += 1
            rests = list(dict.fromkeys(tuple(g[k:]) for g in group))
            rules.append([list(rest) for rest in rests])
            todo.append(len(rules) - 1)
            out.append(group[0][:k] + [len(rules) - 1])
        rules[r] = out
    return rules


def _users(rules: list[list[list]], alternatives: list[tuple[int, int]]) -> list[list[tuple[int, int]]]:
    """Per rule, the (rule, alternative) pairs among ``alternatives`` that refer to it, once per reference."""
    users: list[list[tuple[int, int]]] = [[] for _ in rules]
    for r, a in alternatives:
        for e in rules[r][a]:
            if isinstance(e, int):
                users[e].append((r, a))
    return users


def _nullable(rules: list[list[list]]) -> list[bool]:
    """Which rules may match nothing: a worklist over the alternatives made of rules only."""
    candidates = [(r, a) for r, alts in enumerate(rules) for a, alt in enumerate(alts)
                  if all(isinstance(e, int) for e in alt)]
    left = {(r, a): len(rules[r][a]) for r, a in candidates}  # references not yet known to match nothing
    users = _users(rules, candidates)
    nullable = [False] * len(rules)
    todo = []
    for r, a in candidates:
        if not rules[r][a] and not nullable[r]:
            nullable[r] = True
            todo.append(r)
    while todo:
        for r, a in users[todo.pop()]:
            left[r, a] -= 1
            if left[r, a] == 0 and not nullable[r]:
                nullable[r] = True
                todo.append(r)
    return nullable


def _depths(rules: list[list[list]]) -> tuple[list[int], list[list[int]]]:
    """Per rule, the stack depth its shallowest finish needs (``_UNFINISHABLE``: it cannot finish), and per
    alternative the depth it needs (its own position, and below a reference not at its end the
    referenced rule's depth, one more). Knuth's generalisation of Dijkstra: a rule's depth is final when
    it is the least one waiting."""
    everything = [(r, a) for r, alts in enumerate(rules) for a in range(len(alts))]
    left = {(r, a): sum(isinstance(e, int) for e in rules[r][a]) for r, a in everything}
    users = _users(rules, everything)
    depth = [_UNFINISHABLE] * len(rules)
    needs = [[_UNFINISHABLE] * len(alts) for alts in rules]

    def need(r: int, a: int) -> int:
        alt = rules[r][a]
        return max([1] + [depth[e] + (i < len(alt) - 1) for i, e in enumerate(alt) if isinstance(e, int)])

    heap = [(1, r, a) for r, a in everything if left[r, a] == 0]
    heapq.heapify(heap)
    while heap:
        d, r, a = heapq.heappop(heap)
        needs[r][a] = d
        if depth[r] < _UNFINISHABLE:
            continue
        depth[r] = d
        for r2, a2 in users[r]:
            left[r2, a2] -= 1
            if left[r2, a2] == 0:
                heapq.heappush(heap, (need(r2, a2), r2, a2))
    return depth, needs


def _leading_rules(seq: list, nullable: list[bool]) -> list[tuple[int, bool]]:
    """The rules that can begin ``seq``, each with whether it ends ``seq``."""
    out = []
    for i, e in enumerate(seq):
        if not isinstance(e, int):
            break
        out.append((e, i == len(seq) - 1))
        if not nullable[e]:
            break
    return out


def _components(graph: list[list[int]]) -> list[int]:
    """Each node's strongly connected component (Tarjan's, without recursion)."""
    n = len(graph)
    index, low, component, on_stack = [-1] * n, [0] * n, [-1] * n, [False] * n
    stack: list[int] = []
    counter = found = 0
    for root in range(n):
        if index[root] >= 0:
            continue
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack[root] = True
        work = [(root, 0)]
        while work:
            v, i = work[-1]
            if i < len(graph[v]):
                work[-1] = (v, i + 1)
                w = graph[v][i]
                if index[w] < 0:
                    index[w] = low[w] = counter
                    counter += 1
                    stack.append(w)
                    on_stack[w] = True
                    work.append((w, 0))
                elif on_stack[w]:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                while True:
                    w = stack.pop()
                    on_stack[w] = False
                    component[w] = found
                    if w == v:
                        break
                found += 1
    return component


def _utf8(data: bytes) -> tuple[int, int, bool] | None:
    """The code points a character's first bytes may be: (lowest, highest, whether it is whole);
    None if no well-formed UTF-8 character begins so."""
    b0 = data[0]
    n = 1 if b0 < 0x80 else 2 if 0xC2 <= b0 <= 0xDF else 3 if 0xE0 <= b0 <= 0xEF else 4 if 0xF0 <= b0 <= 0xF4 else 0
    if n == 0 or len(data) > n or any(not 0x80 <= c <= 0xBF for c in data[1:]):
        return None
    value = b0 & (0x7F, 0x1F, 0x0F, 0x07)[n - 1]
    for c in data[1:]:
        value = value << 6 | c & 0x3F
    rest = 6 * (n - len(data))
    lo, hi = value << rest, (value << rest) | ((1 << rest) - 1)
    lo, hi = max(lo, (0, 0x80, 0x800, 0x10000)[n - 1]), min(hi, (0x7F, 0x7FF, 0xFFFF, 0x10FFFF)[n - 1])
    if n == 3 and 0xD800 <= lo and hi <= 0xDFFF:  # surrogates are no characters
        return None
    return (lo, hi, rest == 0) if lo <= hi else None


def _overlaps(chars: tuple, lo: int, hi: int) -> bool:
    i = bisect_right(chars, (lo, 0x110000)) - 1
    return (i >= 0 and chars[i][1] >= lo) or (i + 1 < len(chars) and chars[i + 1][0] <= hi)


class GbnfGrammar(Automaton):
    """A GBNF grammar's states: items are (stack of positions, bytes of a character begun)."""

    max_items = MAX_ITEMS

    def __init__(self, rules: Rules, root: int):
        self.elements, self.starts, needs = rules
        # per rule, its alternatives' starts and the depth each needs to finish, shallowest first
        self.alternatives = [sorted(zip(need, start, strict=True)) for start, need in zip(self.starts, needs,
                                                                                            strict=True)]
        self.root = root
        super().__init__()

    def _first(self) -> frozenset:
        out: list = []
        self._push((), self.root, out, [_EXPAND_BUDGET])
        if not out:
            raise SchemaError(f"the grammar's start needs more than {_EXPAND_BUDGET} steps through its rules before "
                              "its first character")
        return frozenset((stack, b"") for stack in out)

    def _accepts(self, item: tuple) -> bool:
        return not item[0]

    @staticmethod
    def _rank(item: tuple) -> tuple:
        return len(item[0]), item  # shallow stacks first: the nearest to the end of the text

    def _step_all(self, items: frozenset, b: int) -> list[tuple]:
        self._budget = [_EXPAND_BUDGET]  # one byte's expansions, over all its items, in a fixed order
        out: list[tuple] = []
        for item in sorted(items, key=self._rank):
            self._step(item, b, out)
        return out

    def _step(self, item: tuple, b: int, out: list) -> None:
        stack, begun = item
        if not stack:
            return
        data = begun + bytes((b,))
        cp = _utf8(data)
        chars = self.elements[stack[-1]]
        if cp is None or not _overlaps(chars, cp[0], cp[1]):
            return
        if not cp[2]:
            out.append((stack, data))
            return
        stacks: list = []
        self._expand(stack[:-1] + (stack[-1] + 1,), stacks, self._budget)
        out.extend((s, b"") for s in stacks)

    def _expand(self, stack: tuple, out: list, budget: list[int]) -> None:
        """Every stack ``stack`` is once its top is a character set (or it is empty), into ``out``;
        each stack visited costs one of ``budget``, and none is visited once it is spent."""
        todo, seen = [stack], set()
        while todo and budget[0] > 0:
            stack = todo.pop()
            if stack in seen:  # (a rule that may match nothing, repeated: ``(x?)*``)
                continue
            seen.add(stack)
            budget[0] -= 1
            while stack and self.elements[stack[-1]] == END:  # an alternative is done: its caller's position is below
                stack = stack[:-1]
            rule = self.elements[stack[-1]] if stack else None
            if not isinstance(rule, int):
                out.append(stack)
                continue
            after = stack[-1] + 1  # a rule: its alternatives on top of what follows it (nothing, at its end)
            self._push(stack[:-1] if self.elements[after] == END else stack[:-1] + (after,), rule, todo)

    def _push(self, below: tuple, rule: int, into: list, budget: list[int] | None = None) -> None:
        """``rule``'s alternatives on top of ``below``, those that can finish within ``MAX_DEPTH`` only (so
        that every stack kept can end: none is ever left with nowhere to go), onto ``into`` (with a
        ``budget``: expanded into it)."""
        fits = [below + (start,) for need, start in self.alternatives[rule] if len(below) + need <= MAX_DEPTH]
        if budget is None:
            into.extend(reversed(fits))
            return
        for stack in fits:
            self._expand(stack, into, budget)


class RegexGrammar(Automaton):
    """A regular expression the whole text must match (as vLLM's ``regex``): items are (the
    pattern's state, bytes of a character begun)."""

    def __init__(self, source: str):
        self.pattern = Pattern(source, full=True, name="regex")
        super().__init__()

    def _first(self) -> frozenset:
        return frozenset({(self.pattern.start, b"")})

    def _accepts(self, item: tuple) -> bool:
        return not item[1] and self.pattern.accepting(item[0])

    def _step(self, item: tuple, b: int, out: list) -> None:
        state, begun = item
        data = begun + bytes((b,))
        cp = _utf8(data)
        if cp is None:
            return
        if not cp[2]:
            if self.pattern.allows(state, cp[0], cp[1]):
                out.append((state, data))
            return
        nxt = self.pattern.step(state, cp[0])
        if nxt >= 0:
            out.append((nxt, b""))
