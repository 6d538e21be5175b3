"""Structured output: which tokens keep a request's output inside its JSON schema, step by step.

A ``Grammar`` is a schema's node table (``engine.json_schema``) run as a pushdown automaton
over bytes. A *stack* is a tuple of frames (its top last) saying what comes next; a *state* is
the set of stacks still possible (an ``anyOf`` keeps several until the bytes tell them apart),
interned as a small integer. Feeding a token feeds its bytes.

Per state, ``info`` gives the mask of tokens whose bytes can follow (and the end-of-sequence
tokens where the value may end), computed once and cached:
- the bytes that leave the state as it is (a string's plain characters, a number's digits) are
  found by trying all 256; every token made only of those is allowed at once, a whole-vocabulary
  numpy test cached per such byte set (``TokenVocab.split``);
- the other tokens whose first byte outside that set can follow are run through the automaton
  in lockstep, each distinct (state, byte) pair once per position.
So a step costs a dictionary lookup once its state has been seen, and a few milliseconds the
first time (``tools/bench_structured.py`` measures it).

Frames (tuples, the tag first): ``LIT`` bytes and a position; ``TRIE`` a node of a trie of
literals (an enum's members); ``STR`` a phase (0 before the opening quote, 1 inside, 2 after a
backslash, 3-6 hex digits of a ``\\u`` escape, 7 and up inside a UTF-8 character: strings are
well-formed UTF-8) and the count of characters so far; ``NUM`` a phase of JSON's number syntax;
``WS`` whitespace so far (a newline only first, then at most ``MAX_WS`` spaces or tabs, so a
model cannot stall in blank lines); ``NODE`` a value not started;
``OBJ`` the next property and whether one was written (-1: before ``{``); ``KEY`` a key must
come (after a comma); ``ARR`` items so far (-1: before ``[``). A finished frame is popped.
"""

from __future__ import annotations

import json
import logging
import time
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

from engine.json_schema import ALT, LIT, NUM, OBJ, STR, Nodes, compile_schema
from engine.token_bytes import token_bytes

log = logging.getLogger("tokenmill.engine")

F_LIT, F_STR, F_NUM, F_WS, F_NODE, F_OBJ, F_KEY, F_ARR, F_TRIE = range(9)
MAX_WS = 20  # whitespace bytes in a row between tokens of JSON
MAX_STACK = 96  # frames: about 30 levels of nesting
MAX_STACKS = 256  # stacks a state keeps (anyOf / enum members not yet told apart): bounds a step's work
MAX_TOKEN_BYTES = 48  # longer tokens (runs of '=' or spaces) are never needed to write JSON
MASK_CACHE = 1024  # masks kept per grammar (bit-packed: vocab/8 bytes each, 19 KB for 151k tokens)
MAX_TRANSITIONS = 500_000  # (state, byte) pairs a grammar learns (~50 MB) before the next request gets a fresh one

_INDENT = frozenset(b" \t")
_DIGITS = frozenset(b"0123456789")
_ESCAPES = frozenset(b'"\\/bfnrt')
_HEX = frozenset(b"0123456789abcdefABCDEF")
_NUM_ENDS = frozenset({2, 3, 5, 8})  # number phases where the number may end
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


class Grammar:
    """A compiled schema over one vocabulary: states, their transitions and their masks."""

    def __init__(self, nodes: Nodes, root: int, vocab: TokenVocab):
        self.nodes, self.vocab = nodes, vocab
        self._tries: list[tuple[list[dict[int, int]], list[bool]]] = []  # (children, terminal) per node
        self._starts = [self._first_frames(i) for i in range(len(nodes))]
        self._ids: dict[frozenset, int] = {}
        self._states: list[frozenset] = []
        self._next: dict[int, int] = {}  # state * 256 + byte -> state, -1 where the byte cannot come
        self._info: OrderedDict[int, StateInfo] = OrderedDict()
        self.start = self._intern(frozenset({((F_NODE, root),)}))

    @property
    def num_transitions(self) -> int:
        return len(self._next)

    # ------------------------------------------------------------------ bytes

    def next(self, state: int, b: int) -> int:
        key = state * 256 + b
        nxt = self._next.get(key)
        if nxt is None:
            out: list[tuple] = []
            for stack in self._states[state]:
                self._step(stack, b, out)
            out = [s for s in out if len(s) <= MAX_STACK]
            if len(out) > MAX_STACKS:  # any stack left is a way to finish: dropping some only narrows the output
                out = sorted(set(out))[:MAX_STACKS]
            nxt = self._next[key] = self._intern(frozenset(out)) if out else -1
        return nxt

    def feed(self, state: int, data: bytes) -> int:
        for b in data:
            if state < 0:
                break
            state = self.next(state, b)
        return state

    def accepting(self, state: int) -> bool:
        """Whether the value may end here."""
        return any(all(f[0] == F_WS or (f[0] == F_NUM and f[1] in _NUM_ENDS)
                       or (f[0] == F_TRIE and self._tries[f[1]][1][f[2]]) for f in stack)
                   for stack in self._states[state])

    def _intern(self, stacks: frozenset) -> int:
        sid = self._ids.get(stacks)
        if sid is None:
            sid = self._ids[stacks] = len(self._states)
            self._states.append(stacks)
        return sid

    def _first_frames(self, node: int) -> tuple:
        """The frames a value of ``node`` starts with, one per alternative; its literals (an enum's
        members, ``true`` and ``false``...) share one trie frame, so that a state holds one stack
        for them, not one per member still possible."""
        frames = self._expand(node, set())
        literals = [f[1] for f in frames if f[0] == F_LIT]
        if len(literals) < 2:
            return frames
        children: list[dict[int, int]] = [{}]
        terminal = [False]
        for lit in literals:
            at = 0
            for b in lit:
                nxt = children[at].get(b)
                if nxt is None:
                    nxt = children[at][b] = len(children)
                    children.append({})
                    terminal.append(False)
                at = nxt
            terminal[at] = True
        self._tries.append((children, terminal))
        return tuple(f for f in frames if f[0] != F_LIT) + ((F_TRIE, len(self._tries) - 1, 0),)

    def _expand(self, node: int, seen: set) -> tuple:
        """The frames a value of ``node`` starts with (one per alternative)."""
        kind = self.nodes[node][0]
        if kind == ALT:
            if node in seen:  # an anyOf that contains itself adds nothing
                return ()
            seen.add(node)
            return tuple(f for m in self.nodes[node][1] for f in self._expand(m, seen))
        n = self.nodes[node]
        return ((F_LIT, n[1], 0),) if kind == LIT else ((F_STR, 0, 0, n[1], n[2]),) if kind == STR else \
            ((F_NUM, 0, n[1]),) if kind == NUM else ((F_OBJ, node, -1, False),) if kind == OBJ else \
            ((F_ARR, node, -1),)

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
            if tag == F_TRIE:
                children, terminal = self._tries[top[1]]
                at = children[top[2]].get(b)
                if at is not None:
                    out.append(below if terminal[at] and not children[at] else below + ((F_TRIE, top[1], at),))
                if not terminal[top[2]]:
                    return
                stack = below  # a whole literal that another one extends (1 and 12) may end here
                continue
            if tag == F_WS:  # a space, or a newline and an indent (llama.cpp's rule): no blank lines
                n = top[1]
                if (b == 0x0A and n == 0) or (b in _INDENT and n < MAX_WS):
                    out.append(below + ((F_WS, n + 1),))
                stack = below  # whitespace may end anywhere: the byte may be what follows
                continue
            if tag == F_NUM:
                phase = _num(top[1], top[2], b)
                if phase >= 0:
                    out.append(below + ((F_NUM, phase, top[2]),))
                if top[1] not in _NUM_ENDS:
                    return
                stack = below
                continue
            if tag == F_STR:
                self._string(top, below, b, out)
            elif tag == F_NODE:
                for f in self._starts[top[1]]:
                    self._step(below + (f,), b, out)
            elif tag == F_OBJ:
                self._object(top, below, b, out)
            elif tag == F_KEY:
                self._key(top[1], top[2], below, b, out)
            else:
                self._array(top, below, b, out)
            return

    @staticmethod
    def _string(top: tuple, below: tuple, b: int, out: list) -> None:
        _, phase, count, lo, hi = top
        if phase == 0:
            if b == 0x22:
                out.append(below + ((F_STR, 1, 0, lo, hi),))
            return
        if phase == 1:
            if b == 0x22:
                if count >= lo:
                    out.append(below)
                return
            if b < 0x20 or 0x80 <= b < 0xC2 or b > 0xF4 or (hi >= 0 and count >= hi):
                return  # a control character, not a UTF-8 lead byte, or one character too many
            phase = 2 if b == 0x5C else 1 if b < 0x80 else _UTF8_LEAD.get(b, 7 if b < 0xE0 else 8 if b < 0xF0 else 9)
            count = count + 1 if hi >= 0 else min(count + 1, lo)  # unbounded: count only up to lo
            out.append(below + ((F_STR, phase, count, lo, hi),))
        elif phase == 2:
            if b in _ESCAPES:
                out.append(below + ((F_STR, 1, count, lo, hi),))
            elif b == 0x75:  # \u and four hex digits
                out.append(below + ((F_STR, 3, count, lo, hi),))
        elif phase <= 6:
            if b in _HEX:
                out.append(below + ((F_STR, 1 if phase == 6 else phase + 1, count, lo, hi),))
        else:  # inside a UTF-8 character: 7-9 continuation bytes left, 20-23 a first one of a narrower range
            first, last, after = _UTF8_CONT[phase]
            if first <= b <= last:
                out.append(below + ((F_STR, after, count, lo, hi),))

    def _object(self, top: tuple, below: tuple, b: int, out: list) -> None:
        _, node, i, written = top
        members = self.nodes[node][1]
        if i < 0:
            if b == 0x7B:
                out.append(below + ((F_OBJ, node, 0, False), (F_WS, 0)))
            return
        if b == 0x7D:
            if not any(m[2] for m in members[i:]):  # no required property left
                out.append(below)
        elif written:
            if b == 0x2C and (i < len(members) or self.nodes[node][2] >= 0):  # (another key can come)
                out.append(below + ((F_KEY, node, i), (F_WS, 0)))
        else:
            self._key(node, i, below, b, out)

    def _key(self, node: int, i: int, below: tuple, b: int, out: list) -> None:
        """A member whose key starts with ``b``: property ``i``, or a later one past optional ones,
        or (all properties passed or optional) another key if the object allows them."""
        _, members, additional = self.nodes[node]
        for j in range(i, len(members)):
            key, value, required = members[j]
            self._step(below + ((F_OBJ, node, j + 1, True), (F_WS, 0), (F_NODE, value), (F_WS, 0),
                                (F_LIT, b":", 0), (F_LIT, key, 0)), b, out)
            if required:
                return
        if additional >= 0:
            self._step(below + ((F_OBJ, node, len(members), True), (F_WS, 0), (F_NODE, additional), (F_WS, 0),
                                (F_LIT, b":", 0), (F_STR, 0, 0, 0, -1)), b, out)

    def _array(self, top: tuple, below: tuple, b: int, out: list) -> None:
        _, node, n = top
        _, item, lo, hi = self.nodes[node]
        if n < 0:
            if b == 0x5B:
                out.append(below + ((F_ARR, node, 0), (F_WS, 0)))
            return
        if b == 0x5D:
            if n >= lo:
                out.append(below)
            return
        more = hi < 0 or n < hi
        count = n + 1 if hi >= 0 else min(n + 1, max(lo, 1))  # unbounded: count only to what matters
        if n == 0:
            if more:
                self._step(below + ((F_ARR, node, count), (F_WS, 0), (F_NODE, item)), b, out)
        elif b == 0x2C and more:
            out.append(below + ((F_ARR, node, count), (F_WS, 0), (F_NODE, item), (F_WS, 0)))

    # ------------------------------------------------------------------ tokens

    def info(self, state: int) -> StateInfo:
        """The state's mask over the vocabulary (bit-packed), whether it may end, whether it must."""
        info = self._info.get(state)
        if info is not None:
            self._info.move_to_end(state)
            return info
        row = np.array([self.next(state, b) for b in range(256)], dtype=np.int64)
        allowed = self._allowed(state, row)
        accepting = self.accepting(state)
        terminal = accepting and not (row >= 0).any()
        mask = np.zeros(self.vocab.size, dtype=bool)
        mask[self.vocab.ids[allowed]] = True
        if accepting or not mask.any():  # (nothing allowed: only a vocabulary without the bytes needed)
            mask[self.vocab.eos] = True
        info = self._info[state] = StateInfo(np.packbits(mask), accepting, terminal)
        if len(self._info) > MASK_CACHE:
            self._info.popitem(last=False)
        return info

    def _allowed(self, state: int, row: np.ndarray) -> np.ndarray:
        """Which of the vocabulary's rows can follow ``state`` (``row``: its next state per byte).

        The tokens that leave the state are run in lockstep, a byte position at a time, each token
        holding the index of its state in a short list of the states reached so far (``reached``): a
        position's distinct (state, byte) pairs are found with a table of ``len(reached) * 256``
        entries, no sort of the tokens."""
        v = self.vocab
        stay, first, first_byte = v.split(row == state)
        allowed = stay.copy()
        # every other token: from its first byte that changes the state, if that byte can come at all
        rows = np.flatnonzero(~stay & (row[first_byte] >= 0))
        reached, local = np.unique(row, return_inverse=True)
        local, pos = local[first_byte[rows]], first[rows] + 1
        while rows.size:
            done = pos >= v.lens[rows]
            allowed[rows[done]] = True
            rows, local, pos = rows[~done], local[~done], pos[~done]
            if not rows.size:
                break
            keys = local * 256 + v.bytes[rows, pos]
            seen = np.zeros(len(reached) * 256, dtype=bool)
            seen[keys] = True
            pairs = np.flatnonzero(seen)
            nxt = np.array([self.next(int(reached[k >> 8]), int(k & 255)) for k in pairs], dtype=np.int64)
            reached, index = np.unique(nxt, return_inverse=True)
            table = np.empty(len(seen), dtype=np.int64)
            table[pairs] = index
            local = table[keys]
            alive = reached[local] >= 0
            rows, local, pos = rows[alive], local[alive], pos[alive] + 1
        return allowed


@dataclass(frozen=True)
class StateInfo:
    packed_mask: np.ndarray  # np.packbits of the (vocab_size,) bool mask of allowed tokens
    accepting: bool  # the value may end here (the end-of-sequence tokens are allowed)
    terminal: bool  # the value has ended: nothing may follow

    def mask(self, vocab_size: int) -> np.ndarray:
        return np.unpackbits(self.packed_mask, count=vocab_size).view(bool)


class TokenVocab:
    """The vocabulary as arrays: each usable token's bytes (zero-padded), length and id."""

    def __init__(self, pieces: list[bytes | None], size: int, eos_token_ids: list[int]):
        usable = [(i, p) for i, p in enumerate(pieces[:size]) if p and len(p) <= MAX_TOKEN_BYTES]
        self.size = size
        self.eos = np.array([t for t in eos_token_ids if 0 <= t < size], dtype=np.int64)
        self.ids = np.array([i for i, _ in usable], dtype=np.int64)
        self.lens = np.array([len(p) for _, p in usable], dtype=np.int64)
        width = max(self.lens, default=1)
        self.bytes = np.zeros((len(usable), width), dtype=np.uint8)
        for r, (_, p) in enumerate(usable):
            self.bytes[r, :len(p)] = np.frombuffer(p, dtype=np.uint8)
        self._splits: dict[bytes, tuple[np.ndarray, np.ndarray, np.ndarray]] = {}

    def split(self, keep: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """For a set of bytes (``keep``, (256,) bool): which tokens are made only of them, and for
        the others the position and value of their first byte outside it. Cached per set."""
        key = np.packbits(keep).tobytes()
        hit = self._splits.get(key)
        if hit is None:
            inside = keep[self.bytes] | (np.arange(self.bytes.shape[1]) >= self.lens[:, None])
            first = np.argmin(inside, axis=1)
            hit = self._splits[key] = (inside.all(axis=1), first, self.bytes[np.arange(len(first)), first])
        return hit


class GrammarMatcher:
    """One request's place in its grammar; advanced by the engine with each token it samples."""

    __slots__ = ("grammar", "state")

    def __init__(self, grammar: Grammar):
        self.grammar, self.state = grammar, grammar.start

    def info(self) -> StateInfo:
        return self.grammar.info(self.state)

    def advance(self, token: int) -> None:
        """Move past ``token`` (state -1: a token the mask did not allow, e.g. an end-of-sequence)."""
        v = self.grammar.vocab
        r = np.searchsorted(v.ids, token)
        if self.state >= 0 and r < len(v.ids) and v.ids[r] == token:
            self.state = self.grammar.feed(self.state, v.bytes[r, :v.lens[r]].tobytes())
        else:
            self.state = -1

    @property
    def finished(self) -> bool:
        """Whether the value is complete and nothing may follow (or the output left the grammar)."""
        return self.state < 0 or self.grammar.info(self.state).terminal


class Grammars:
    """The engine's compiled grammars, by schema (the most recently used ``CACHE`` kept), over the
    model's vocabulary, read from its files on first use."""

    CACHE = 16

    def __init__(self, model_path: str, vocab_size: int, eos_token_ids: list[int]):
        self.model_path, self.vocab_size, self.eos_token_ids = model_path, vocab_size, eos_token_ids
        self._vocab: TokenVocab | None = None
        self._cache: OrderedDict[str, Grammar] = OrderedDict()

    def matcher(self, schema: dict) -> GrammarMatcher:
        """A matcher at the start of ``schema``; ``SchemaError`` or ``VocabularyError`` if it cannot be."""
        key = json.dumps(schema, separators=(",", ":"))
        grammar = self._cache.get(key)
        if grammar is None or grammar.num_transitions > MAX_TRANSITIONS:  # (afresh: memory stays bounded)
            nodes, root = compile_schema(schema)
            if self._vocab is None:
                start = time.perf_counter()
                self._vocab = TokenVocab(token_bytes(self.model_path), self.vocab_size, self.eos_token_ids)
                log.info("structured output: read %d tokens' bytes in %.1f s", len(self._vocab.ids),
                         time.perf_counter() - start)
            grammar = self._cache[key] = Grammar(nodes, root, self._vocab)
            if len(self._cache) > self.CACHE:
                self._cache.popitem(last=False)
        self._cache.move_to_end(key)
        return GrammarMatcher(grammar)
