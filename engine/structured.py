"""Structured output: which tokens keep a request's output inside its JSON schema (or choices,
regex, GBNF grammar), step by step.

``Grammars`` (one per engine) compiles each schema once (``engine.json_schema`` then
``engine.grammar``; a regex or grammar by ``engine.text_grammar``) over the model's vocabulary (``engine.token_bytes``) and hands each request
a ``GrammarMatcher``: its state, advanced with every token it samples. The sampler asks the
matcher for the state's ``StateInfo``: the mask of the tokens whose bytes can follow (and the
end-of-sequence tokens where the value may end), computed once per state and cached:
- the bytes that leave the state as it is (a string's plain characters, a number's digits) are
  found by trying all 256; every token made only of those is allowed at once, a whole-vocabulary
  numpy test cached per such byte set (``TokenVocab.split``);
- the other tokens whose first byte outside that set can follow are run through the automaton
  in lockstep, each distinct (state, byte) pair once per position (``_allowed``).
So a step costs a dictionary lookup once its state has been seen, and a few milliseconds the
first time (``tools/bench_structured.py`` measures both).
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from engine.grammar import Automaton, Grammar
from engine.json_schema import GrammarTooCostly, SchemaError, compile_choice, compile_schema
from engine.protocol import GRAMMARS_BUSY, STRUCTURED_FIELDS, SamplingParams
from engine.text_grammar import GbnfGrammar, RegexGrammar, compile_gbnf
from engine.token_bytes import token_bytes

log = logging.getLogger("tokenmill.engine")

MAX_TOKEN_BYTES = 48  # longer tokens (runs of '=' or spaces) are never needed: shorter ones write the same text
MASK_CACHE = 1024  # masks kept per grammar (bit-packed: vocab/8 bytes each, 19 KB for 151k tokens)
MAX_TRANSITIONS = 500_000  # (state, byte) pairs a grammar learns (~50 MB) before it forgets them all
# The step loop's time one request's grammar may take: a new state's mask at most MASK_SECONDS, all of them
# together at most REQUEST_SECONDS. Past either, the request ends with finish_reason "error" and the grammar
# is refused from then on (GrammarTooCostly): a regex whose automaton keeps hundreds of states open, say.
MASK_SECONDS = 0.5
REQUEST_SECONDS = 20.0
# ... and all of one step's new masks together at most STEP_SECONDS (a request's first step makes two): past it,
# a new mask gets MASK_FLOOR_SECONDS (a few milliseconds is the usual), so that several requests' costly grammars
# stall every stream for about STEP_SECONDS a step, not MASK_SECONDS each. A request whose mask that cuts short ends
# with finish_reason "error" and GRAMMARS_BUSY (a 503): its grammar is not refused.
STEP_SECONDS = 1.0
MASK_FLOOR_SECONDS = 0.1
SPLITS_CACHE = 64  # byte sets' token splits kept (TokenVocab.split: 10 bytes a token each, 0.5 MB for 49k tokens)


@dataclass(frozen=True)
class StateInfo:
    packed_mask: np.ndarray  # np.packbits of the (vocab_size,) bool mask of allowed tokens
    accepting: bool  # the value may end here (the end-of-sequence tokens are allowed)
    terminal: bool  # the value has ended: nothing may follow

    def mask(self, vocab_size: int) -> np.ndarray:
        return np.unpackbits(self.packed_mask, count=vocab_size).view(bool)


class TokenVocab:
    """The vocabulary as arrays: each usable token's bytes (zero-padded), length and id. The
    end-of-sequence tokens are not text, whatever bytes they have."""

    def __init__(self, pieces: list[bytes | None], size: int, eos_token_ids: list[int]):
        eos = {t for t in eos_token_ids if 0 <= t < size}
        usable = [(i, p) for i, p in enumerate(pieces[:size]) if p and len(p) <= MAX_TOKEN_BYTES and i not in eos]
        self.size = size
        self.eos = np.array(sorted(eos), dtype=np.int64)
        self.ids = np.array([i for i, _ in usable], dtype=np.int64)
        self.lens = np.array([len(p) for _, p in usable], dtype=np.int64)
        width = max(self.lens, default=1)
        self.bytes = np.zeros((len(usable), width), dtype=np.uint8)
        for r, (_, p) in enumerate(usable):
            self.bytes[r, :len(p)] = np.frombuffer(p, dtype=np.uint8)
        self._splits: OrderedDict[bytes, tuple[np.ndarray, np.ndarray, np.ndarray]] = OrderedDict()

    def token(self, token_id: int) -> bytes | None:
        r = np.searchsorted(self.ids, token_id)
        return self.bytes[r, :self.lens[r]].tobytes() if r < len(self.ids) and self.ids[r] == token_id else None

    def split(self, keep: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """For a set of bytes (``keep``, (256,) bool): which tokens are made only of them, and for
        the others the position and value of their first byte outside it. Cached per set."""
        key = np.packbits(keep).tobytes()
        hit = self._splits.get(key)
        if hit is not None:
            self._splits.move_to_end(key)
            return hit
        inside = keep[self.bytes] | (np.arange(self.bytes.shape[1]) >= self.lens[:, None])
        first = np.argmin(inside, axis=1)
        hit = self._splits[key] = (inside.all(axis=1), first, self.bytes[np.arange(len(first)), first])
        if len(self._splits) > SPLITS_CACHE:  # (every grammar's sets, the ones gone too: a client makes new ones)
            self._splits.popitem(last=False)
        return hit


class MaskClock:
    """The step loop's time spent on new masks this step, shared by an engine's grammars (``Grammars.new_step``
    starts each step's at zero)."""

    __slots__ = ("spent",)

    def __init__(self) -> None:
        self.spent = 0.0

    def allowance(self) -> float:
        """What the next new mask may take: ``MASK_SECONDS``, less once the step has spent ``STEP_SECONDS``."""
        return min(MASK_SECONDS, max(MASK_FLOOR_SECONDS, STEP_SECONDS - self.spent))


class TokenGrammar:
    """A grammar over one vocabulary: its states' masks."""

    def __init__(self, grammar: Automaton, vocab: TokenVocab, clock: MaskClock | None = None):
        self.grammar: Automaton | None = grammar  # None once failed
        self.vocab, self.clock = vocab, clock or MaskClock()
        self._info: OrderedDict[int, StateInfo] = OrderedDict()
        self.failed: str | None = None  # why it costs too much to follow (GrammarTooCostly): refused from then on

    @property
    def ended(self) -> StateInfo:
        """What a failed matcher allows: the end of sequence only."""
        mask = np.zeros(self.vocab.size, dtype=bool)
        mask[self.vocab.eos] = True
        return StateInfo(np.packbits(mask), False, True)

    def forget(self) -> None:
        """Drop the grammar's states and their masks (``Grammar.forget``)."""
        log.info("structured output: a grammar forgets its states (it had learned %d transitions)",
                 self.grammar.num_transitions)
        self.grammar.forget()
        self._info.clear()

    def info(self, state: int) -> StateInfo:
        """The state's mask over the vocabulary (bit-packed), whether it may end, whether it must."""
        info = self._info.get(state)
        if info is not None:
            self._info.move_to_end(state)
            return info
        g, start, allowance = self.grammar, time.perf_counter(), self.clock.allowance()
        g.deadline = start + allowance
        try:
            row = np.array([g.next(state, b) for b in range(256)], dtype=np.int64)
            allowed = self._allowed(state, row)
        except GrammarTooCostly as e:
            if allowance < MASK_SECONDS and time.perf_counter() > g.deadline:  # (the step's budget cut it short:
                raise GrammarTooCostly(GRAMMARS_BUSY) from None  # the grammar is not refused, what it learned kept)
            self.failed = str(e)
            self.grammar = None  # refused from then on: the automaton and what it learned (tens of MB, for a
            self._info.clear()  # costly one: a regex's state sets too) are of no more use; no matcher reads them
            raise
        finally:
            g.deadline = math.inf
            self.clock.spent += time.perf_counter() - start
        accepting = g.accepting(state)
        mask = np.zeros(self.vocab.size, dtype=bool)
        mask[self.vocab.ids[allowed]] = True
        if accepting or not mask.any():  # (nothing allowed: a vocabulary without a byte the value needs)
            mask[self.vocab.eos] = True
        info = self._info[state] = StateInfo(np.packbits(mask), accepting, accepting and not (row >= 0).any())
        if len(self._info) > MASK_CACHE:
            self._info.popitem(last=False)
        return info

    def _allowed(self, state: int, row: np.ndarray) -> np.ndarray:
        """Which of the vocabulary's rows can follow ``state`` (``row``: its next state per byte).

        The tokens that leave the state are run in lockstep, a byte position at a time, each token
        holding the index of its state in a short list of the states reached so far (``reached``): a
        position's distinct (state, byte) pairs are found with a table of ``len(reached) * 256``
        entries, no sort of the tokens."""
        v, g = self.vocab, self.grammar
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
            nxt = np.array([g.next(int(reached[k >> 8]), int(k & 255)) for k in pairs], dtype=np.int64)
            reached, index = np.unique(nxt, return_inverse=True)
            table = np.empty(len(seen), dtype=np.int64)
            table[pairs] = index
            local = table[keys]
            alive = reached[local] >= 0
            rows, local, pos = rows[alive], local[alive], pos[alive] + 1
        return allowed


class GrammarMatcher:
    """One request's place in its grammar; advanced by the engine with each token it samples.

    Holds the state's stacks as well as its id: a grammar that has learned ``MAX_TRANSITIONS``
    forgets everything (``TokenGrammar.forget``), and the matcher finds its state again. A grammar
    that costs too much to follow (``GrammarTooCostly``, or more than ``REQUEST_SECONDS`` of masks for
    this request) sets ``failed``: from then on only the end of sequence may come, and the engine
    ends the request with finish_reason "error"."""

    __slots__ = ("tokens", "state", "stacks", "generation", "failed", "seconds")

    def __init__(self, tokens: TokenGrammar):
        g = tokens.grammar
        self.tokens, self.state, self.stacks, self.generation = tokens, g.start, g.stacks(g.start), g.generation
        self.failed: str | None = None
        self.seconds = 0.0  # spent on this request's new masks

    def info(self) -> StateInfo:
        if self.failed is None and self.tokens.failed is not None:
            self.failed = self.tokens.failed
        if self.failed is not None or self.state < 0:  # (past the end: its request ended, a token in flight)
            return self.tokens.ended
        self._sync()
        start = time.perf_counter()
        try:
            return self.tokens.info(self.state)
        except GrammarTooCostly as e:
            self.failed = str(e)
            return self.tokens.ended
        finally:
            self.seconds += time.perf_counter() - start
            if self.seconds > REQUEST_SECONDS and self.failed is None:
                self.failed = (f"the output's grammar takes too long to follow: this request's token choices took "
                               f"more than {REQUEST_SECONDS:g} s")

    def advance(self, token: int) -> None:
        """Move past ``token`` (state -1: a token the mask did not allow, e.g. an end-of-sequence)."""
        if self.failed is None and self.tokens.failed is not None:  # (another request's mask failed it)
            self.failed = self.tokens.failed
        if self.failed is not None:
            self.state = -1
            return
        self._sync()
        data = self.tokens.vocab.token(token)
        g = self.tokens.grammar
        try:
            self.state = -1 if data is None or self.state < 0 else g.feed(self.state, data)
        except GrammarTooCostly as e:
            self.failed, self.state = str(e), -1
        self.stacks = g.stacks(self.state) if self.state >= 0 else None

    @property
    def finished(self) -> bool:
        """Whether the value is complete and nothing may follow (or the output left the grammar)."""
        return self.state < 0 or self.info().terminal

    def _sync(self) -> None:
        g = self.tokens.grammar
        if g.num_transitions > MAX_TRANSITIONS:
            self.tokens.forget()
        if self.generation != g.generation:
            self.state = g.intern(self.stacks) if self.stacks is not None else -1
            self.generation = g.generation


class Grammars:
    """The engine's compiled grammars, by schema (the most recently used ``CACHE`` kept), over the
    model's vocabulary, read from its files on first use."""

    CACHE = 16

    def __init__(self, model_path: str, vocab_size: int, eos_token_ids: list[int]):
        self.model_path, self.vocab_size, self.eos_token_ids = model_path, vocab_size, eos_token_ids
        self._vocab: TokenVocab | None = None
        self._cache: OrderedDict[str, TokenGrammar] = OrderedDict()
        self._refused: OrderedDict[str, str] = OrderedDict()  # the last grammars refused, and why
        self.on_vocabulary: Callable[[], None] | None = None  # called once the vocabulary has been read
        self.clock = MaskClock()

    def new_step(self) -> None:
        """A step begins: its new masks share ``STEP_SECONDS`` afresh."""
        self.clock.spent = 0.0

    def matcher(self, params: SamplingParams) -> GrammarMatcher:
        """A matcher at the start of what ``params`` hold the output to (a JSON schema, choices, a
        regex or a GBNF grammar); ``SchemaError`` or ``VocabularyError`` if it cannot be."""
        kind = next(k for k in STRUCTURED_FIELDS if getattr(params, k) is not None)
        value = getattr(params, kind)
        key = kind + ":" + (value if isinstance(value, str) else json.dumps(value, separators=(",", ":")))
        tokens = self._cache.get(key)
        if tokens is not None and tokens.failed is not None:
            raise GrammarTooCostly(tokens.failed)
        refused = self._refused.get(key)
        if refused is not None:  # (refusing again costs what compiling did: a client could resend it forever)
            raise SchemaError(refused)
        if tokens is None:
            try:
                grammar = (Grammar(*compile_schema(value)) if kind == "json_schema" else
                           Grammar(*compile_choice(value), json=False) if kind == "choice" else
                           RegexGrammar(value) if kind == "regex" else GbnfGrammar(*compile_gbnf(value)))
            except (SchemaError, RecursionError) as e:  # (every step is iterative or bounded: RecursionError
                message = str(e) if isinstance(e, SchemaError) else f"the {kind} nests too deep"  # is a last guard)
                self._refused[key] = message
                if len(self._refused) > self.CACHE:
                    self._refused.popitem(last=False)
                raise SchemaError(message) from None
            if self._vocab is None:
                start = time.perf_counter()
                self._vocab = TokenVocab(token_bytes(self.model_path), self.vocab_size, self.eos_token_ids)
                log.info("structured output: read %d tokens' bytes in %.1f s", len(self._vocab.ids),
                         time.perf_counter() - start)
                if self.on_vocabulary is not None:
                    self.on_vocabulary()
            tokens = self._cache[key] = TokenGrammar(grammar, self._vocab, self.clock)
            if len(self._cache) > self.CACHE:
                self._cache.popitem(last=False)
        self._cache.move_to_end(key)
        return GrammarMatcher(tokens)
