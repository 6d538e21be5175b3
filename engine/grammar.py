"""A JSON schema's node table (``engine.json_schema``) run as a pushdown automaton over bytes.

Torch- and numpy-free. A *stack* is a tuple of frames (its top last) saying what comes next; a
*state* is the set of stacks still possible (an ``anyOf`` keeps several until the bytes tell
them apart), interned as a small integer. ``next(state, byte)`` is memoised; -1 is "cannot".
``engine.structured`` turns states into masks over a vocabulary.

Frames (tuples, the tag first): ``LIT`` bytes and a position; ``TRIE`` a trie of literals (an
enum's members, ``true`` / ``false``) and a node in it; ``STR`` a phase (see ``_string``) and the
count of characters so far; ``NUM`` a phase of JSON's number syntax and the digits in its current
part; ``WS`` spaces or tabs so far and whether a newline came first; ``NODE`` a value not
started; ``OBJ`` the next property and whether one was written (-1: before ``{``); ``KEY`` a
member's key must come; ``KTRIE`` inside a declared key (a trie of the keys that may come
next); ``XKEY`` inside another key (``additionalProperties``), with where it stands in the trie
of declared keys, which it may not repeat; ``ARR`` items so far (-1: before ``[``); ``PSTR`` a
string held to a ``pattern`` (see ``_pattern_string``). A finished frame is popped.

Every stack kept can be finished within ``MAX_STACK`` frames: each node knows how deep its
shallowest value goes (``_depth``, a fixpoint over the table), and an alternative, property or
item that could not finish in the room left is never started. A schema with no value that fits
(``{"required": ["next"]}`` recursing forever, or nesting too deep) is refused.

Written as the output must be: literals (``const``, ``enum``, keys) byte for byte as compact JSON
(``json.dumps(v, ensure_ascii=False, separators=(",", ":"))``); strings well-formed UTF-8, a
high surrogate escape followed by its low one; keys of ``additionalProperties`` without escapes;
numbers with at most ``MAX_DIGITS`` digits before and after the point and 2 in the exponent;
between tokens, at most one newline and then up to ``MAX_WS`` spaces or tabs (no blank lines),
nothing before ``:``; before the value one space or tab at most (``▁{`` is a SentencePiece model's
first token), nothing after it.
"""

from __future__ import annotations

import math
import time

from engine.json_schema import ALT, LIT, NUM, OBJ, PAT, STR, GrammarTooCostly, Nodes, SchemaError
from engine.regex import Pattern, intern

F_LIT, F_STR, F_NUM, F_WS, F_NODE, F_OBJ, F_KEY, F_ARR, F_TRIE, F_KTRIE, F_XKEY, F_PSTR = range(12)
MAX_WS = 20  # spaces or tabs in a row (after a newline or not)
MAX_DIGITS = 16  # digits in a number's integer part or fraction (as llama.cpp) ...
MAX_EXPONENT_DIGITS = 2  # ... and in its exponent (so that every number is a finite double)
MAX_STACK = 128  # frames: 40-60 levels of nesting
MAX_STACKS = 16  # stacks a state keeps (anyOf members not yet told apart): bounds a byte's work
_UNFINISHABLE = 1 << 30

_INDENT = frozenset(b" \t")
_DIGITS = frozenset(b"0123456789")
_ESCAPES = frozenset(b'"\\/bfnrt')
_HEX = frozenset(b"0123456789abcdefABCDEF")
_HIGH_SURROGATE_2ND = frozenset(b"89abAB")  # \uD8xx-\uDBxx: half a character, counted with its other half ...
_LOW_SURROGATE = {30: b"\\", 31: b"u", 32: b"dD", 33: b"cdefCDEF"}  # ... \uDCxx-\uDFxx, which must follow
_NUM_ENDS = frozenset({2, 3, 5, 8})  # number phases where the number may end
_NUM_DIGIT_RUNS = frozenset({3, 5, 8})  # phases that repeat on a digit (their digits are counted)
# Strings hold well-formed UTF-8 (as Python's strict decoder wants it: no overlongs, no surrogates).
# A lead byte's string phase where it is not 7, 8, 9 (1, 2, 3 continuation bytes to come) ...
_UTF8_LEAD = {0xE0: 20, 0xED: 21, 0xF0: 22, 0xF4: 23}
# ... and per phase: the range of the next byte and the phase after it (1: the character is whole)
_UTF8_CONT = {7: (0x80, 0xBF, 1), 8: (0x80, 0xBF, 7), 9: (0x80, 0xBF, 8),
              20: (0xA0, 0xBF, 7), 21: (0x80, 0x9F, 7), 22: (0x90, 0xBF, 8), 23: (0x80, 0x8F, 8)}


def _num(phase: int, integer: bool, b: int) -> int:
    """JSON number syntax: the phase after byte ``b``, or -1. Phases: 0 start, 1 after '-', 2 a
    leading 0, 3 integer digits, 4 after '.', 5 fraction digits, 6 after 'e', 7 after its sign,
    8 exponent digits."""
    d = b in _DIGITS
    if phase == 0 and b == 0x2D:
        return 1
    if phase in (0, 1):
        return (2 if b == 0x30 else 3) if d else -1
    if phase in (3, 5, 8, 4, 7) and d:
        return {3: 3, 5: 5, 8: 8, 4: 5, 7: 8}[phase]
    if integer:
        return -1
    if phase in (2, 3) and b == 0x2E:
        return 4
    if phase in (2, 3, 5) and b in (0x65, 0x45):
        return 6
    if phase == 6:
        return 7 if b in (0x2B, 0x2D) else 8 if d else -1
    return -1


class Trie:
    """Literals as a byte trie: node 0 the root; ``value[node]`` the literal's index where one ends."""

    def __init__(self, literals: list[bytes]):
        self.children: list[dict[int, int]] = [{}]
        self.value = [-1]
        for index, lit in enumerate(literals):
            at = 0
            for b in lit:
                nxt = self.children[at].get(b)
                if nxt is None:
                    nxt = self.children[at][b] = len(self.children)
                    self.children.append({})
                    self.value.append(-1)
                at = nxt
            self.value[at] = index


class Automaton:
    """Byte transitions over *states*: sets of items (what an item is, a subclass says), interned as
    small integers. ``next(state, byte)`` is memoised; -1 is "cannot". At most ``max_items`` items
    are kept after a byte (the first by ``_rank``): any item kept is a way to go on, so dropping some
    only narrows the output."""

    max_items = MAX_STACKS
    deadline = math.inf  # (time.perf_counter()) past which learning a transition raises GrammarTooCostly

    def __init__(self) -> None:
        self.generation = -1
        self.forget()

    def _first(self) -> frozenset:
        """The items at the start."""
        raise NotImplementedError

    def _step(self, item: tuple, b: int, out: list) -> None:
        """Append to ``out`` every item ``item`` becomes after byte ``b``."""
        raise NotImplementedError

    def _accepts(self, item: tuple) -> bool:
        """Whether the output may end with this item."""
        raise NotImplementedError

    @staticmethod
    def _rank(item: tuple) -> tuple:
        """The order in which items are kept when there are too many (the first ones)."""
        return item

    def _step_all(self, items: frozenset, b: int) -> list[tuple]:
        out: list[tuple] = []
        for item in items:
            self._step(item, b, out)
        return out

    def forget(self) -> None:
        """Drop every state and transition learned (they are recomputed as needed): what bounds an
        automaton's memory. State ids change: ``generation`` counts the forgettings."""
        self._ids: dict[frozenset, int] = {}
        self._states: list[frozenset] = []
        self._next: dict[int, int] = {}  # state * 256 + byte -> state, -1 where the byte cannot come
        self.start = self.intern(self._first())
        self.generation += 1

    @property
    def num_transitions(self) -> int:
        return len(self._next)

    def stacks(self, state: int) -> frozenset:
        """What a state id stands for, to find it again after ``forget``."""
        return self._states[state]

    def intern(self, stacks: frozenset) -> int:
        """A state's id (new if it was not one yet): also how a matcher finds its state after ``forget``."""
        return intern(self._ids, self._states, stacks)

    def next(self, state: int, b: int) -> int:
        key = state * 256 + b
        nxt = self._next.get(key)
        if nxt is None:
            if time.perf_counter() > self.deadline:
                raise GrammarTooCostly("the output's grammar takes too long to follow: one token's choices took more "
                                       "than the time one step may give them")
            out = self._step_all(self._states[state], b)
            if len(out) > self.max_items:
                out = sorted(set(out), key=self._rank)[:self.max_items]
            nxt = self._next[key] = self.intern(frozenset(out)) if out else -1
        return nxt

    def feed(self, state: int, data: bytes) -> int:
        for b in data:
            if state < 0:
                break
            state = self.next(state, b)
        return state

    def accepting(self, state: int) -> bool:
        """Whether the output may end here."""
        return any(self._accepts(item) for item in self._states[state])


class Grammar(Automaton):
    """States of one schema and their byte transitions: an item is a stack of frames."""

    def __init__(self, nodes: Nodes, root: int, json: bool = True):
        """``json``: the output is a JSON text, which may begin with whitespace (SentencePiece models
        write ``▁{``); not so for a choice of raw strings."""
        self.nodes, self._text_is_json = nodes, json
        self._depth = self._depths()
        if self._depth[root] > MAX_STACK:
            raise SchemaError("the schema has no value that can be written: it requires itself forever, or "
                              f"nests deeper than this server writes (about {MAX_STACK // 3} levels)")
        self._tries: list[Trie] = []
        self._key_tries: dict[tuple, int] = {}  # (object, first property, room) -> trie of keys that may come
        self._candidates: dict[tuple, tuple[list[int], int]] = {}  # (object, first property) -> needs, their max
        self._last_required: dict[int, int] = {}  # object -> index of its last required property
        self._all_keys: dict[int, int] = {}  # object -> trie of all its declared keys
        self._trie_ids: dict[tuple[bytes, ...], int] = {}  # an anyOf's literals -> their trie
        self._starts = self._start_frames()
        self._root = root
        super().__init__()

    def _first(self) -> frozenset:
        # before the value, one space or tab at most (a newline "came" and all but one space): the first
        # token of a SentencePiece model may be "▁{", and whitespace more is only tokens wasted
        first = ((F_NODE, self._root), (F_WS, MAX_WS - 1, True)) if self._text_is_json else ((F_NODE, self._root),)
        return frozenset({first})

    def _accepts(self, stack: tuple) -> bool:
        return all(self._may_end(f) for f in stack)

    def _may_end(self, f: tuple) -> bool:
        return (f[0] == F_WS or (f[0] == F_NUM and f[1] in _NUM_ENDS)
                or (f[0] == F_TRIE and self._tries[f[1]].value[f[2]] >= 0))

    # ------------------------------------------------------------------ compiling

    def _depths(self) -> list[int]:
        """Per node, the frames its shallowest value needs at its deepest point (counting the node's
        own frame; ``_UNFINISHABLE`` for a node with no finite value), by fixpoint."""
        depth = [_UNFINISHABLE] * len(self.nodes)
        changed = True
        while changed:
            changed = False
            for i, n in enumerate(self.nodes):
                kind = n[0]
                if kind in (LIT, STR, NUM, PAT):
                    d = 1
                elif kind == ALT:
                    d = min(depth[m] for m in n[1])
                elif kind == OBJ:  # {: OBJ WS; a member's key: OBJ WS NODE WS LIT(:) KTRIE; its value: OBJ WS value
                    required = [depth[v] for _, v, req in n[1] if req]
                    d = max([6, *(2 + r for r in required)]) if required else 2
                else:  # [: ARR WS; an item: ARR WS item; after a comma: ARR WS NODE WS
                    lo, item = n[2], n[1]
                    d = 2 if lo == 0 else max(4 if lo > 1 else 3, 2 + depth[item])
                d = min(d, _UNFINISHABLE)
                if d < depth[i]:
                    depth[i], changed = d, True
        return depth

    def _start_frames(self) -> list[dict[int, dict[tuple, int]]]:
        """Per node, the frames a value of it starts with (each with the depth it needs) by the first
        byte each can take, at most ``MAX_STACKS`` a byte (more would be dropped anyway). An anyOf's
        own literal members (an enum's, ``true`` and ``false``) share one trie frame, so that a state
        holds one stack for them, not one per member still possible; its anyOf members lend it their
        frames, by a worklist over the anyOf edges, so that a chain or a cycle of anyOf costs neither
        recursion nor a copy of everything below each link."""
        starts: list[dict[int, dict[tuple, int]]] = [{} for _ in self.nodes]
        parents: list[list[int]] = [[] for _ in self.nodes]
        for i, n in enumerate(self.nodes):
            if n[0] != ALT:
                self._add_start(starts[i], i)
                continue
            literals = tuple(self.nodes[m][1] for m in n[1] if self.nodes[m][0] == LIT)
            if len(literals) > 1:
                trie = self._trie_ids.get(literals)
                if trie is None:
                    trie = self._trie_ids[literals] = self._add_trie(list(literals))
                for b in self._tries[trie].children[0]:
                    starts[i].setdefault(b, {})[(F_TRIE, trie, 0)] = 1
            for m in n[1]:
                if self.nodes[m][0] == ALT:
                    parents[m].append(i)
                elif self.nodes[m][0] != LIT or len(literals) == 1:
                    self._add_start(starts[i], m)
        work = [m for m in range(len(self.nodes)) if parents[m]]
        while work:
            m = work.pop()
            for p in parents[m]:
                changed = False
                for b, frames in starts[m].items():
                    into = starts[p].setdefault(b, {})
                    for f, need in frames.items():
                        if f not in into and len(into) < MAX_STACKS:
                            into[f], changed = need, True
                if changed and parents[p]:
                    work.append(p)
        return starts

    def _add_start(self, by_byte: dict[int, dict[tuple, int]], node: int) -> None:
        """``node``'s own frame (not an anyOf's), under each byte it can start with."""
        need = self._depth[node]
        if need >= _UNFINISHABLE:
            return
        n = self.nodes[node]
        kind = n[0]
        frame = ((F_LIT, n[1], 0) if kind == LIT else (F_STR, 0, 0, n[1], n[2]) if kind == STR else
                 (F_NUM, 0, n[1], 0) if kind == NUM else (F_OBJ, node, -1, False) if kind == OBJ else
                 (F_PSTR, node, 0, n[1].start, 0) if kind == PAT else (F_ARR, node, -1))
        first = n[1][:1] if kind == LIT else {STR: b'"', PAT: b'"', NUM: b"-0123456789", OBJ: b"{"}.get(kind, b"[")
        for b in first:
            frames = by_byte.setdefault(b, {})
            if len(frames) < MAX_STACKS:
                frames[frame] = need

    def _keys(self, node: int, i: int, room: int) -> int:
        """The trie of the keys that may come at property ``i`` of object ``node`` (it, or a later
        one past optional ones) whose values fit in ``room`` frames; -1 if none."""
        members = self.nodes[node][1]
        candidates = self._candidates.get((node, i))
        if candidates is None:
            end = next((j for j in range(i, len(members)) if members[j][2]), len(members) - 1)
            needs = [max(6, 2 + self._depth[members[j][1]]) for j in range(i, end + 1)]
            candidates = self._candidates[node, i] = (needs, max(needs, default=0))
        needs, most = candidates
        cache_key = (node, i, room if room < most else -1)
        tid = self._key_tries.get(cache_key)
        if tid is None:
            fits = [i + k for k, need in enumerate(needs) if need <= room]
            tid = self._add_trie([members[j][0] for j in fits], fits) if fits else -1
            self._key_tries[cache_key] = tid
        return tid

    def _add_trie(self, literals: list[bytes], values: list[int] | None = None) -> int:
        """A new trie of ``literals`` (each ending with ``values[i]``, else ``i``); its id."""
        trie = Trie(literals)
        if values is not None:
            trie.value = [values[v] if v >= 0 else -1 for v in trie.value]
        self._tries.append(trie)
        return len(self._tries) - 1

    def _required_left(self, node: int, i: int) -> bool:
        """Whether a required property of ``node`` comes at ``i`` or later."""
        last = self._last_required.get(node)
        if last is None:
            last = self._last_required[node] = max((j for j, m in enumerate(self.nodes[node][1]) if m[2]), default=-1)
        return i <= last

    def _may_add(self, node: int, i: int, room: int) -> bool:
        """Whether a key not declared may come at property ``i`` of ``node`` with ``room`` frames."""
        additional = self.nodes[node][2]
        return (additional >= 0 and not self._required_left(node, i)
                and max(6, 2 + self._depth[additional]) <= room)

    # ------------------------------------------------------------------ one byte

    def _step(self, stack: tuple, b: int, out: list) -> None:
        """Append to ``out`` every stack ``stack`` becomes after byte ``b``."""
        while stack:
            top, below = stack[-1], stack[:-1]
            tag = top[0]
            if tag == F_LIT:
                data, pos = top[1], top[2]
                if data[pos] == b:
                    out.append(below if pos + 1 == len(data) else below + ((F_LIT, data, pos + 1),))
                return
            if tag == F_WS:
                spaces, newline = top[1], top[2]
                if b == 0x0A and spaces == 0 and not newline:
                    out.append(below + ((F_WS, 0, True),))
                elif b in _INDENT and spaces < MAX_WS:
                    out.append(below + ((F_WS, spaces + 1, newline),))
                stack = below  # whitespace may end anywhere: the byte may be what follows
                continue
            if tag == F_NUM:
                _, phase, integer, digits = top
                nxt = _num(phase, integer, b)
                if nxt >= 0:
                    digits = digits + 1 if nxt == phase else 1 if nxt in _NUM_DIGIT_RUNS else 0
                    if digits <= (MAX_EXPONENT_DIGITS if nxt == 8 else MAX_DIGITS):
                        out.append(below + ((F_NUM, nxt, integer, digits),))
                if phase not in _NUM_ENDS:
                    return
                stack = below
                continue
            if tag == F_TRIE:
                trie = self._tries[top[1]]
                at = trie.children[top[2]].get(b)
                if at is not None:
                    out.append(below if trie.value[at] >= 0 and not trie.children[at]
                               else below + ((F_TRIE, top[1], at),))
                if trie.value[top[2]] < 0:
                    return
                stack = below  # a whole literal that another one extends (1 and 12) may end here
                continue
            if tag == F_STR:
                _string(top, below, b, out)
            elif tag == F_NODE:
                room = MAX_STACK - len(below)
                for f, need in self._starts[top[1]].get(b, {}).items():
                    if need <= room:
                        self._step(below + (f,), b, out)
            elif tag == F_OBJ:
                self._object(top, below, b, out)
            elif tag == F_KEY:
                self._key(top[1], top[2], below, b, out)
            elif tag == F_KTRIE:
                self._declared_key(top, below, b, out)
            elif tag == F_XKEY:
                self._other_key(top, below, b, out)
            elif tag == F_PSTR:
                _pattern_string(self.nodes[top[1]][1], top, below, b, out)
            else:
                self._array(top, below, b, out)
            return

    def _object(self, top: tuple, below: tuple, b: int, out: list) -> None:
        _, node, i, written = top
        if i < 0:
            if b == 0x7B:
                out.append(below + ((F_OBJ, node, 0, False), (F_WS, 0, False)))
            return
        if b == 0x7D:
            if not self._required_left(node, i):
                out.append(below)
        elif written:
            room = MAX_STACK - len(below)
            if b == 0x2C and (self._keys(node, i, room) >= 0 or self._may_add(node, i, room)):
                out.append(below + ((F_KEY, node, i), (F_WS, 0, False)))
        else:
            self._key(node, i, below, b, out)

    def _key(self, node: int, i: int, below: tuple, b: int, out: list) -> None:
        """A member whose key starts with ``b``: a declared one (``_keys``), or another if allowed."""
        room = MAX_STACK - len(below)
        tid = self._keys(node, i, room)
        if tid >= 0:
            self._step(below + ((F_KTRIE, node, tid, 0),), b, out)
        if self._may_add(node, i, room):
            _, members, additional = self.nodes[node]
            all_keys = self._all_keys.get(node)
            if all_keys is None:
                all_keys = self._all_keys[node] = self._add_trie([m[0] for m in members])
            self._step(below + ((F_OBJ, node, len(members), True), (F_WS, 0, False), (F_NODE, additional),
                                (F_WS, 0, False), (F_LIT, b":", 0), (F_XKEY, all_keys, 0, 0)), b, out)

    def _declared_key(self, top: tuple, below: tuple, b: int, out: list) -> None:
        _, node, tid, at = top
        trie = self._tries[tid]
        at = trie.children[at].get(b)
        if at is None:
            return
        j = trie.value[at]
        if j < 0:
            out.append(below + ((F_KTRIE, node, tid, at),))
        else:  # the key's closing quote: its value next
            out.append(below + ((F_OBJ, node, j + 1, True), (F_WS, 0, False), (F_NODE, self.nodes[node][1][j][1]),
                                (F_WS, 0, False), (F_LIT, b":", 0)))

    def _other_key(self, top: tuple, below: tuple, b: int, out: list) -> None:
        """A key of ``additionalProperties``: any string without escapes but a declared key."""
        _, tid, at, phase = top
        if b == 0x5C:  # no escapes: an escaped spelling of a declared key would pass for another key
            return
        trie = self._tries[tid]
        at = trie.children[at].get(b, -1) if at >= 0 else -1
        after: list[tuple] = []
        _string((F_STR, phase, 0, 0, -1), below, b, after)
        for stack in after:
            if len(stack) == len(below):  # the string closed
                if at < 0 or trie.value[at] < 0:
                    out.append(stack)
            else:
                out.append(below + ((F_XKEY, tid, at, stack[-1][1]),))

    def _array(self, top: tuple, below: tuple, b: int, out: list) -> None:
        _, node, n = top
        _, item, lo, hi = self.nodes[node]
        if n < 0:
            if b == 0x5B:
                out.append(below + ((F_ARR, node, 0), (F_WS, 0, False)))
            return
        if b == 0x5D:
            if n >= lo:
                out.append(below)
            return
        # (the first item: ARR WS item; a later one: ARR WS NODE WS, then ARR WS item)
        more = (hi < 0 or n < hi) and len(below) + max(3 if n == 0 else 4, 2 + self._depth[item]) <= MAX_STACK
        count = n + 1 if hi >= 0 else min(n + 1, max(lo, 1))  # unbounded: count only to what matters
        if n == 0:
            if more:
                self._step(below + ((F_ARR, node, count), (F_WS, 0, False), (F_NODE, item)), b, out)
        elif b == 0x2C and more:
            out.append(below + ((F_ARR, node, count), (F_WS, 0, False), (F_NODE, item), (F_WS, 0, False)))


def _string(top: tuple, below: tuple, b: int, out: list) -> None:
    """A string's byte. Phases: 0 before the opening quote; 1 inside; 2 after a backslash; 3-6 the
    hex digits of a ``\\u`` escape still to come (4..1), 10 the second of a ``\\uD...`` escape,
    11-12 the last two of a high surrogate's, whose low surrogate must follow: 30 its backslash, 31
    its u, 32-35 its digits (``DC``-``DF`` first); 7 and up inside a UTF-8 character. ``count``
    counts characters (an escape when it ends, a surrogate pair once); without a maximum it counts
    only up to the minimum, so that states stay few."""
    _, phase, count, lo, hi = top

    def to(phase: int, chars: int = 0) -> None:
        n = count + chars if hi >= 0 else min(count + chars, lo)
        out.append(below + ((F_STR, phase, n, lo, hi),))

    if phase == 1:
        if b == 0x22:
            if count >= lo:
                out.append(below)
        elif b < 0x20 or 0x80 <= b < 0xC2 or b > 0xF4 or (hi >= 0 and count >= hi):
            return  # a control character, not a UTF-8 lead byte, or one character too many
        elif b == 0x5C:
            to(2)
        else:
            to(1 if b < 0x80 else _UTF8_LEAD.get(b, 7 if b < 0xE0 else 8 if b < 0xF0 else 9), 1)
    elif phase == 0:
        if b == 0x22:
            to(1)
    elif phase == 2:
        if b in _ESCAPES:
            to(1, 1)
        elif b == 0x75:  # \u and four hex digits
            to(3)
    elif phase <= 6 or 10 <= phase <= 12:  # hex digits
        if b in _HEX:
            if phase == 3 and b in b"dD":  # \uD...: perhaps a high surrogate
                to(10)
            elif phase == 10:  # (\uDC..-\uDF..: a low surrogate alone is no character)
                if b not in _LOW_SURROGATE[33]:
                    to(11 if b in _HIGH_SURROGATE_2ND else 5)
            else:
                to({4: 5, 5: 6, 6: 1, 11: 12, 12: 30}.get(phase, 4), 1 if phase == 6 else 0)
    elif phase >= 30:  # a high surrogate's low surrogate: backslash, u, D, C-F, two hex digits
        if b in _LOW_SURROGATE.get(phase, _HEX):
            to(phase + 1 if phase < 35 else 1, 1 if phase == 35 else 0)
    else:  # inside a UTF-8 character: 7-9 continuation bytes left, 20-23 a first one of a narrower range
        first, last, after = _UTF8_CONT[phase]
        if first <= b <= last:
            to(after)


_UTF8_LEFT = {7: 1, 8: 2, 9: 3, 20: 2, 21: 2, 22: 3, 23: 3}  # continuation bytes still to come, per phase
_SIMPLE_ESCAPES = {0x22: 0x22, 0x5C: 0x5C, 0x2F: 0x2F, 0x62: 8, 0x66: 12, 0x6E: 10, 0x72: 13, 0x74: 9}


def _pattern_string(pattern: Pattern, top: tuple, below: tuple, b: int, out: list) -> None:
    """A byte of a string that must match ``pattern`` (``engine.regex``). The frame holds the string
    phase (as in ``_string``; 30-35 a high surrogate's low half) and the pattern's state, and ``acc``
    the character being read (UTF-8 bits, hex digits). No character is begun that the pattern cannot
    take: each byte of it must leave some code point it could still be that the pattern allows."""
    _, node, phase, state, acc = top

    def to(phase: int, state: int = state, acc: int = 0) -> None:
        out.append(below + ((F_PSTR, node, phase, state, acc),))

    def char(cp: int) -> None:
        nxt = pattern.step(state, cp)
        if nxt >= 0:
            to(1, nxt)

    if phase == 0:
        if b == 0x22:
            to(1)
    elif phase == 1:
        if b == 0x22:
            if pattern.accepting(state):
                out.append(below)
        elif b == 0x5C:
            if pattern.allows(state, 0, 0x10FFFF):  # (any character can be escaped)
                to(2)
        elif 0x20 <= b < 0x80:
            char(b)
        elif 0xC2 <= b <= 0xF4:
            after = _UTF8_LEAD.get(b, 7 if b < 0xE0 else 8 if b < 0xF0 else 9)
            bits = b & (0x1F if b < 0xE0 else 0x0F if b < 0xF0 else 0x07)
            left = _UTF8_LEFT[after]
            lo, hi = {0xE0: (0x800, 0xFFF), 0xED: (0xD000, 0xD7FF), 0xF0: (0x10000, 0x3FFFF),
                      0xF4: (0x100000, 0x10FFFF)}.get(b, (bits << 6 * left, ((bits + 1) << 6 * left) - 1))
            if pattern.allows(state, lo, hi):
                to(after, acc=bits)
    elif phase == 2:
        if b in _SIMPLE_ESCAPES:
            char(_SIMPLE_ESCAPES[b])
        elif b == 0x75:
            to(3)
    elif 3 <= phase <= 6 or 32 <= phase <= 35:
        if b not in _HEX:
            return
        high, value = (acc >> 16, acc & 0xFFFF) if phase >= 32 else (0, acc)
        value = value * 16 + int(chr(b), 16)
        left = (6 if phase <= 6 else 35) - phase  # hex digits still to come
        lo, hi = value << 4 * left, ((value + 1) << 4 * left) - 1
        if phase >= 32:  # the low half of a pair: DC00-DFFF, and the character it makes must be allowed
            lo, hi = max(lo, 0xDC00), min(hi, 0xDFFF)
            pair = 0x10000 + ((high - 0xD800) << 10)
            if lo <= hi and pattern.allows(state, pair + lo - 0xDC00, pair + hi - 0xDC00):
                if left:
                    to(phase + 1, acc=high << 16 | value)
                else:
                    char(pair + value - 0xDC00)
        elif left == 0:
            if 0xD800 <= value <= 0xDBFF:  # a high surrogate: its low half must follow, making a character taken
                pair = 0x10000 + ((value - 0xD800) << 10)
                if pattern.allows(state, pair, pair + 0x3FF):
                    to(30, acc=value)
            elif not 0xDC00 <= value <= 0xDFFF:
                char(value)
        elif _escape_may_be(pattern, state, lo, hi):
            to(phase + 1, acc=value)
    elif phase == 30:
        if b == 0x5C:
            to(31, acc=acc)
    elif phase == 31:
        if b == 0x75:
            to(32, acc=acc << 16)  # the high half above, the low half's digits below
    else:  # inside a UTF-8 character
        first, last, after = _UTF8_CONT[phase]
        if first <= b <= last:
            acc = acc << 6 | b & 0x3F
            left = _UTF8_LEFT[phase] - 1
            if left == 0:
                char(acc)
            elif pattern.allows(state, acc << 6 * left, ((acc + 1) << 6 * left) - 1):
                to(after, acc=acc)


def _escape_may_be(pattern: Pattern, state: int, lo: int, hi: int) -> bool:
    """Whether a \\u escape whose value will lie in ``[lo, hi]`` can make a character the pattern
    takes: a code point outside the surrogates, or (a high surrogate) one of the pairs it begins."""
    for a, z in ((lo, min(hi, 0xD7FF)), (max(lo, 0xE000), hi)):
        if a <= z and pattern.allows(state, a, z):
            return True
    a, z = max(lo, 0xD800), min(hi, 0xDBFF)
    return a <= z and pattern.allows(state, 0x10000 + ((a - 0xD800) << 10), 0x10000 + ((z - 0xD800) << 10) + 0x3FF)
