"""The wire between frontends and the engine: typed messages, msgpack frames.

Imported by both sides, so it imports nothing of the engine (and no torch).
A frame is msgpack of ``[kind, payload]``; each message type has an explicit
``to_wire()`` / ``from_wire()`` pair, and ``tests/test_protocol.py`` pins the
bytes. No pickle and no class names ever cross the wire.

Also here: ``SamplingParams``, because it is part of the ADD payload and the
frontends validate requests with it before sending, and the size caps on its
lists (``MAX_STOP_STRINGS`` ...), so both sides refuse the same requests.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Iterator
from dataclasses import dataclass, field, fields
from enum import IntEnum
from typing import Any

import msgpack

PROTOCOL_VERSION = 19
# a token's top logprobs the engine gives at most (the APIs show at most 20; beam search asks for more)
MAX_LOGPROBS = 64


class Kind(IntEnum):
    HELLO = 1  # frontend -> engine: I am here, tell me about the model
    READY = 2  # engine -> frontend: model info and limits
    ADD = 3  # frontend -> engine: a new request
    ABORT = 4  # frontend -> engine: drop these requests
    OUTPUTS = 5  # engine -> frontend: every delta of one step for that frontend
    STATS = 6  # frontend -> engine (empty): ask; engine -> frontend: the numbers
    ERROR = 7  # engine -> frontend: a request was refused or failed
    LORA = 8  # frontend -> engine: load or unload a LoRA adapter; engine -> frontend: how that went
    RESET_PREFIX_CACHE = 9  # frontend -> engine: forget the cached blocks; engine -> frontend: whether it did


class ProtocolError(ValueError):
    """A frame that does not decode into a known, well-formed message."""


# ----------------------------------------------------------------------------- sampling

# Caps on what one request may carry (vLLM-like). Each list is turned into tensors
# once per request, but it is still stored, sent and validated per choice (n), and
# a few thousand entries already cover every real use: a stop list or a bias over a
# whole 32k+ vocabulary is an attack on the engine's step time, not a request.
MAX_STOP_STRINGS = 64
MAX_STOP_STRING_BYTES = 1024  # UTF-8 bytes per stop string
MAX_STOP_TOKEN_IDS = 2048
MAX_LOGIT_BIAS = 2048  # entries (token ids) in logit_bias
# The repetition penalty divides positive logits: 1/0.01 = 100x keeps any fp32 logit
# a model can produce far below fp32's 3.4e38, where 1e-40 (a subnormal) gives inf
# and then NaN probabilities. 10 on the other side multiplies negative logits.
MIN_REPETITION_PENALTY = 0.01
MAX_REPETITION_PENALTY = 10.0
MAX_JSON_SCHEMA_BYTES = 65536  # a schema, packed (or a regex or grammar): the engine compiles it (and caches it) per request
MAX_CHOICES = 4096  # strings in ``choice``
STRUCTURED_FIELDS = ("json_schema", "choice", "regex", "grammar")  # SamplingParams' fields that hold the output
# A request's stop_reason where its grammar's next mask ran out of the time the step had left (others' masks took
# it): finish_reason "error", but the grammar is not at fault (a frontend answers 503, to be retried)
GRAMMARS_BUSY = "the server's other grammars took this step's time for new token choices: try again"
MAX_ALLOWED_TOKEN_IDS = 32768  # entries in allowed_token_ids
MAX_BAD_WORDS = 64  # words in bad_words (each tokenized twice: with a space before it and without)
MAX_BAD_WORD_TOKENS = 64  # tokens in one of them ...
MAX_BAD_WORD_BYTES = 256  # ... and its UTF-8 bytes
# llama.cpp's DRY: sequence breakers as text (each cut to 40 bytes, as llama.cpp cuts them), and as the
# token sequences they become (every token holding one, or ending in its start: llama.cpp's four defaults are a
# few hundred to a few thousand; a common letter, tens of thousands, each checked and sent per request)
MAX_DRY_BREAKERS = 64
MAX_DRY_BREAKER_BYTES = 40
MAX_DRY_BREAKER_SEQUENCES = 16384
MAX_DRY_BREAKER_TOKENS = 21  # a sequence's head and at most 20 tokens after it (llama.cpp's MAX_SEQ_LEN)
DRY_BREAKERS = ["\n", ":", "\"", "*"]  # llama.cpp's default dry_sequence_breakers
MAX_ADAPTER_NAME = 256  # characters in a LoRA adapter's name (``LoraUpdate``)


def check_bad_words(words: Any) -> None:
    """vLLM's ``bad_words`` as text (before they are tokenized): ``SamplingParamError`` unless a list of at
    most ``MAX_BAD_WORDS`` non-blank strings of at most ``MAX_BAD_WORD_BYTES`` bytes."""
    if not isinstance(words, list) or len(words) > MAX_BAD_WORDS or not all(
            isinstance(w, str) and w.strip() and len(w.encode("utf-8", "surrogatepass")) <= MAX_BAD_WORD_BYTES
            for w in words):
        raise SamplingParamError("bad_words", f"bad_words must be a list of at most {MAX_BAD_WORDS} non-blank "
                                 f"strings of at most {MAX_BAD_WORD_BYTES} bytes")


@dataclass
class SamplingParams:
    """How to pick tokens and when to stop, for one request.

    Validated on construction (``SamplingParamError`` names the field). Sizes are
    capped: at most ``MAX_STOP_STRINGS`` (64) stop strings of at most
    ``MAX_STOP_STRING_BYTES`` (1024) UTF-8 bytes each, ``MAX_STOP_TOKEN_IDS`` (2048)
    stop_token_ids, ``MAX_LOGIT_BIAS`` (2048) logit_bias entries; repetition_penalty
    in [``MIN_REPETITION_PENALTY``, ``MAX_REPETITION_PENALTY``] = [0.01, 10]. Token
    ids are checked against a vocabulary by ``check_vocab`` where one is known.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 (or -1) = off
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    # llama.cpp's: the three penalties count the context's last repeat_last_n tokens, the prompt's among them (-1:
    # the whole context; 0: no penalty at all); None: vLLM's rules (the repetition penalty over the prompt and
    # output, presence and frequency over the output)
    repeat_last_n: int | None = None
    logit_bias: dict[int, float] | None = None
    stop: list[str] = field(default_factory=list)  # stop strings: matched by whoever detokenizes
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    min_tokens: int = 0
    logprobs: int | None = None  # top-k logprobs per sampled token (0 = only the sampled one)
    prompt_logprobs: int | None = None
    # structured output: the output must be JSON valid under this schema (engine.json_schema says
    # which keywords are understood); {"type": "object"} is OpenAI's JSON mode ...
    json_schema: dict | None = None
    choice: list[str] | None = None  # ... or exactly one of these strings (vLLM's guided_choice) ...
    regex: str | None = None  # ... or text the whole of which this regular expression matches (vLLM's) ...
    grammar: str | None = None  # ... or text of this GBNF grammar (llama.cpp's; engine.text_grammar)
    # vLLM's: only these tokens may be sampled; never a word's last token after its others (bad_words: the engine
    # reads bad_words_token_ids only, which the frontends and LLM make of the words); the stop string (or
    # stop token) that ends the output kept in its text
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    bad_words_token_ids: list[list[int]] | None = None
    include_stop_str_in_output: bool = False
    # llama.cpp's samplers (engine.sampler_llamacpp), each off at its default. DRY: a token that would make the
    # context repeat a sequence of at least dry_allowed_length tokens loses dry_multiplier * dry_base ** (length -
    # allowed) from its logit, over the context's last dry_penalty_last_n tokens (-1: all); a sequence breaker
    # ends the sequences before it (dry_sequence_breakers: the text, None for llama.cpp's defaults; the engine
    # reads dry_breaker_token_ids only, [head, tokens after it] each, which the frontends and LLM make of them)
    dry_multiplier: float = 0.0
    dry_base: float = 1.75
    dry_allowed_length: int = 2
    dry_penalty_last_n: int = -1
    dry_sequence_breakers: list[str] | None = None
    dry_breaker_token_ids: list[list[int]] | None = None
    xtc_probability: float = 0.0  # XTC: this often, the tokens above xtc_threshold go but the least likely of them
    xtc_threshold: float = 0.1
    typical_p: float = 1.0  # locally typical sampling (1: off)
    top_n_sigma: float = -1.0  # logits more than n standard deviations below the top one go (<= 0: off)
    dynatemp_range: float = 0.0  # dynamic temperature: temperature +- range by the candidates' entropy (0: off) ...
    dynatemp_exponent: float = 1.0  # ... raised to this power
    mirostat: int = 0  # 1 or 2: mirostat's version, which then takes the place of the truncations
    mirostat_tau: float = 5.0  # its target surprise (bits) ...
    mirostat_eta: float = 0.1  # ... and learning rate

    @property
    def dry(self) -> bool:
        """Whether DRY is on (llama.cpp's rule: a multiplier, a base of at least 1, a window)."""
        return self.dry_multiplier != 0.0 and self.dry_base >= 1.0 and self.dry_penalty_last_n != 0

    @property
    def xtc(self) -> bool:
        """Whether XTC is on (llama.cpp's rule: a probability, a threshold of at most 0.5)."""
        return self.xtc_probability > 0 and self.xtc_threshold <= 0.5

    @property
    def dry_breakers_as_text(self) -> bool:
        """Whether DRY is on with breakers that are text still: the engine reads their token sequences only
        (``dry_breaker_token_ids``), which the frontends and ``LLM`` make of them."""
        return self.dry and bool(self.dry_breakers) and self.dry_breaker_token_ids is None

    @property
    def dry_breakers(self) -> list[str]:
        """The sequence breakers as text: the given ones (each cut to 40 bytes of UTF-8, at a character's end, empty
        ones dropped, as llama.cpp does) or llama.cpp's defaults."""
        given = DRY_BREAKERS if self.dry_sequence_breakers is None else self.dry_sequence_breakers
        cut = [b.encode("utf-8", "surrogatepass")[:MAX_DRY_BREAKER_BYTES].decode("utf-8", "ignore") for b in given]
        return [b for b in cut if b]

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.top_k == -1:
            self.top_k = 0
        # Size first: never walk an oversized map just to refuse it.
        if self.logit_bias and isinstance(self.logit_bias, dict) and len(self.logit_bias) <= MAX_LOGIT_BIAS:
            try:
                self.logit_bias = {int(k): float(v) for k, v in self.logit_bias.items()}
            except (TypeError, ValueError, OverflowError):
                raise SamplingParamError("logit_bias", "logit_bias must map token ids to numbers") from None
        self.validate()

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5

    @property
    def structured(self) -> bool:
        """Whether the output is held to a schema, choices, a regex or a grammar."""
        return any(getattr(self, k) is not None for k in STRUCTURED_FIELDS)

    def validate(self) -> None:
        """Raise ``SamplingParamError(param, message)`` on a value no request may carry.

        Cheap for any input: a list's length is checked before its entries are.
        """

        def bad(name: str, msg: str) -> None:
            raise SamplingParamError(name, msg)

        def num(name: str) -> float:
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v):
                bad(name, f"{name} must be a finite number, got {v!r}")
            return v

        def integer(name: str) -> int:
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int):
                bad(name, f"{name} must be an integer, got {v!r}")
            return v

        if integer("max_tokens") < 1:
            bad("max_tokens", f"max_tokens must be at least 1, got {self.max_tokens}")
        if not 0.0 <= num("temperature") <= 100.0:
            bad("temperature", f"temperature must be in [0, 100], got {self.temperature}")
        if not 0.0 < num("top_p") <= 1.0:
            bad("top_p", f"top_p must be in (0, 1], got {self.top_p}")
        if integer("top_k") < 0:
            bad("top_k", f"top_k must be -1 (off) or positive, got {self.top_k}")
        if not 0.0 <= num("min_p") <= 1.0:
            bad("min_p", f"min_p must be in [0, 1], got {self.min_p}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= num(name) <= 2.0:
                bad(name, f"{name} must be in [-2, 2], got {getattr(self, name)}")
        if not MIN_REPETITION_PENALTY <= num("repetition_penalty") <= MAX_REPETITION_PENALTY:
            bad("repetition_penalty", f"repetition_penalty must be in [{MIN_REPETITION_PENALTY}, "
                f"{MAX_REPETITION_PENALTY}], got {self.repetition_penalty}")
        if self.repeat_last_n is not None and not -1 <= integer("repeat_last_n") < 2**31:
            bad("repeat_last_n", f"repeat_last_n must be -1 (the whole context), 0 (no penalties) or a number of "
                f"tokens, got {self.repeat_last_n}")
        if self.seed is not None and not -(2**63) <= integer("seed") < 2**64:
            bad("seed", f"seed must fit in 64 bits, got {self.seed}")
        if integer("min_tokens") < 0:
            bad("min_tokens", f"min_tokens must be >= 0, got {self.min_tokens}")
        if self.min_tokens > self.max_tokens:
            bad("min_tokens", f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})")
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= MAX_LOGPROBS):
                bad(name, f"{name} must be an integer in [0, {MAX_LOGPROBS}], got {v!r}")
        if not isinstance(self.stop, list):
            bad("stop", "stop must be a non-empty string or a list of non-empty strings")
        if len(self.stop) > MAX_STOP_STRINGS:
            bad("stop", f"at most {MAX_STOP_STRINGS} stop strings are allowed, got {len(self.stop)}")
        for s in self.stop:
            if not isinstance(s, str) or not s:
                bad("stop", "stop must be a non-empty string or a list of non-empty strings")
            if len(s) > MAX_STOP_STRING_BYTES or len(s.encode("utf-8", "surrogatepass")) > MAX_STOP_STRING_BYTES:
                bad("stop", f"each stop string must be at most {MAX_STOP_STRING_BYTES} bytes (UTF-8)")
        if not isinstance(self.stop_token_ids, list):
            bad("stop_token_ids", "stop_token_ids must be a list of non-negative integers")
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            bad("stop_token_ids", f"at most {MAX_STOP_TOKEN_IDS} stop_token_ids are allowed, "
                f"got {len(self.stop_token_ids)}")
        if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in self.stop_token_ids):
            bad("stop_token_ids", "stop_token_ids must be a list of non-negative integers")
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                bad("logit_bias", "logit_bias must map token ids to numbers")
            if len(self.logit_bias) > MAX_LOGIT_BIAS:
                bad("logit_bias", f"at most {MAX_LOGIT_BIAS} logit_bias entries are allowed, "
                    f"got {len(self.logit_bias)}")
            for k, v in self.logit_bias.items():
                if isinstance(k, bool) or not isinstance(k, int) or k < 0:
                    bad("logit_bias", f"logit_bias keys must be non-negative token ids, got {k!r}")
                if isinstance(v, bool) or not isinstance(v, int | float) or not -100.0 <= v <= 100.0:
                    bad("logit_bias", f"logit_bias values must be in [-100, 100], got {v!r}")

        if self.json_schema is not None:
            if not isinstance(self.json_schema, dict):
                bad("json_schema", "json_schema must be a JSON schema (an object)")
            try:
                size = len(msgpack.packb(self.json_schema))
            except (TypeError, ValueError, OverflowError):
                bad("json_schema", "json_schema must be plain JSON")
            if size > MAX_JSON_SCHEMA_BYTES:
                bad("json_schema", f"json_schema may be at most {MAX_JSON_SCHEMA_BYTES} bytes, got {size}")
        if self.allowed_token_ids is not None:
            ids = self.allowed_token_ids
            if not isinstance(ids, list) or not 0 < len(ids) <= MAX_ALLOWED_TOKEN_IDS:
                bad("allowed_token_ids", f"allowed_token_ids must be a list of 1 to {MAX_ALLOWED_TOKEN_IDS} token ids")
            if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids):
                bad("allowed_token_ids", "allowed_token_ids must be a list of non-negative integers")
        if self.bad_words is not None:
            check_bad_words(self.bad_words)
        if self.bad_words_token_ids is not None:
            words = self.bad_words_token_ids
            if not isinstance(words, list) or len(words) > 2 * MAX_BAD_WORDS:
                bad("bad_words", f"at most {MAX_BAD_WORDS} bad words are allowed")
            for w in words:
                if not isinstance(w, list) or not 0 < len(w) <= MAX_BAD_WORD_TOKENS or not all(
                        isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in w):
                    bad("bad_words", f"each bad word must be 1 to {MAX_BAD_WORD_TOKENS} tokens")
        self._validate_llamacpp(bad, num, integer)
        if not isinstance(self.include_stop_str_in_output, bool):
            bad("include_stop_str_in_output", "include_stop_str_in_output must be true or false")
        given = [k for k in STRUCTURED_FIELDS if getattr(self, k) is not None]
        if len(given) > 1:
            bad(given[1], f"give one of {' and '.join(given)}, not both")
        for name in ("regex", "grammar"):
            text = getattr(self, name)
            if text is not None:
                if not isinstance(text, str) or not text:
                    bad(name, f"{name} must be a non-empty string")
                size = len(text.encode("utf-8", "surrogatepass"))
                if size > MAX_JSON_SCHEMA_BYTES:
                    bad(name, f"{name} may be at most {MAX_JSON_SCHEMA_BYTES} bytes, got {size}")
        if self.choice is not None:
            if not isinstance(self.choice, list) or not 0 < len(self.choice) <= MAX_CHOICES:
                bad("choice", f"choice must be a list of 1 to {MAX_CHOICES} non-empty strings")
            if not all(isinstance(c, str) and c for c in self.choice):
                bad("choice", "choice must be a list of non-empty strings")
            size = sum(len(c.encode("utf-8", "surrogatepass")) for c in self.choice)
            if size > MAX_JSON_SCHEMA_BYTES:
                bad("choice", f"the choices may be at most {MAX_JSON_SCHEMA_BYTES} bytes in all, got {size}")

    def _validate_llamacpp(self, bad, num, integer) -> None:
        """llama.cpp's samplers' fields (``validate``'s helpers)."""
        if num("dry_multiplier") < 0:
            bad("dry_multiplier", f"dry_multiplier must be >= 0, got {self.dry_multiplier}")
        if not 0 <= num("dry_base") <= 100:  # (below 1: off, as in llama.cpp)
            bad("dry_base", f"dry_base must be in [0, 100], got {self.dry_base}")
        if integer("dry_allowed_length") < 0:
            bad("dry_allowed_length", f"dry_allowed_length must be >= 0, got {self.dry_allowed_length}")
        if not -1 <= integer("dry_penalty_last_n") < 2**31:
            bad("dry_penalty_last_n", "dry_penalty_last_n must be -1 (the whole context), 0 (off) or a number of "
                f"tokens, got {self.dry_penalty_last_n}")
        breakers = self.dry_sequence_breakers
        if breakers is not None and (not isinstance(breakers, list) or not 0 < len(breakers) <= MAX_DRY_BREAKERS
                                     or not all(isinstance(b, str) for b in breakers)):
            bad("dry_sequence_breakers", f"dry_sequence_breakers must be a non-empty list of at most {MAX_DRY_BREAKERS} "
                "strings")
        seqs = self.dry_breaker_token_ids
        if seqs is not None:
            if not isinstance(seqs, list) or len(seqs) > MAX_DRY_BREAKER_SEQUENCES:
                bad("dry_sequence_breakers", f"at most {MAX_DRY_BREAKER_SEQUENCES} breaker sequences are allowed")
            # (tens of thousands of short lists: checked as one flat list, the types with ``type() is``)
            if not all(type(w) is list and 0 < len(w) <= MAX_DRY_BREAKER_TOKENS for w in seqs) or not all(
                    type(t) is int and t >= 0 for w in seqs for t in w):
                bad("dry_sequence_breakers", f"each breaker sequence must be 1 to {MAX_DRY_BREAKER_TOKENS} token ids")
        if not 0 <= num("xtc_probability") <= 1:
            bad("xtc_probability", f"xtc_probability must be in [0, 1], got {self.xtc_probability}")
        if not 0 <= num("xtc_threshold") <= 1:  # (above 0.5: off, as in llama.cpp)
            bad("xtc_threshold", f"xtc_threshold must be in [0, 1], got {self.xtc_threshold}")
        if not 0 < num("typical_p") <= 1:
            bad("typical_p", f"typical_p must be in (0, 1], got {self.typical_p}")
        num("top_n_sigma")
        if not 0 <= num("dynatemp_range") <= 100:
            bad("dynatemp_range", f"dynatemp_range must be in [0, 100], got {self.dynatemp_range}")
        if not 0 <= num("dynatemp_exponent") <= 100:
            bad("dynatemp_exponent", f"dynatemp_exponent must be in [0, 100], got {self.dynatemp_exponent}")
        if integer("mirostat") not in (0, 1, 2):
            bad("mirostat", f"mirostat must be 0 (off), 1 or 2 (its version), got {self.mirostat}")
        for name in ("mirostat_tau", "mirostat_eta"):
            if not 0 <= num(name) <= 100:
                bad(name, f"{name} must be in [0, 100], got {getattr(self, name)}")

    def check_vocab(self, vocab_size: int) -> None:
        """Raise ``SamplingParamError`` if a stop id, logit_bias key or allowed or bad word's token id is not
        below ``vocab_size``."""
        for name, ids in (("allowed_token_ids", self.allowed_token_ids or ()),
                          ("bad_words", [t for w in self.bad_words_token_ids or () for t in w]),
                          ("dry_sequence_breakers", [t for w in self.dry_breaker_token_ids or () for t in w])):
            if ids and max(ids) >= vocab_size:
                raise SamplingParamError(name, f"{name} token ids must be in [0, {vocab_size}), got {max(ids)}")
        if self.stop_token_ids and max(self.stop_token_ids) >= vocab_size:
            raise SamplingParamError("stop_token_ids", f"stop_token_ids must be in [0, {vocab_size}), "
                                     f"got {max(self.stop_token_ids)}")
        if self.logit_bias and max(self.logit_bias) >= vocab_size:
            raise SamplingParamError("logit_bias", f"logit_bias token ids must be in [0, {vocab_size}), "
                                     f"got {max(self.logit_bias)}")

    def to_wire(self) -> dict[str, Any]:
        """A shallow map in field order, for packing at once: its lists are this object's own.

        No deep copy (``asdict`` would copy every list, per choice of an n > 1 request).
        """
        d = {name: getattr(self, name) for name in _SAMPLING_FIELDS}
        if self.logit_bias is not None:  # msgpack maps with int keys are fine, but be explicit
            d["logit_bias"] = [[k, v] for k, v in self.logit_bias.items()]
        return d

    @classmethod
    def from_wire(cls, d: dict[str, Any]) -> SamplingParams:
        if not isinstance(d, dict):
            raise ProtocolError("sampling params must be a map")
        kw = {k: v for k, v in d.items() if k in _SAMPLING_FIELDS}
        bias = kw.get("logit_bias")
        if bias is not None:
            if not isinstance(bias, list) or len(bias) > MAX_LOGIT_BIAS:  # refuse before walking it
                raise ProtocolError(f"bad sampling params: logit_bias must be at most {MAX_LOGIT_BIAS} "
                                    "[token_id, bias] pairs")
        try:
            if bias is not None:
                kw["logit_bias"] = {int(k): float(v) for k, v in bias}
            return cls(**kw)
        except (TypeError, ValueError, OverflowError) as e:
            raise ProtocolError(f"bad sampling params: {e}") from e


@dataclass
class PoolingParams:
    """An embedding request (``/v1/embeddings``): its prompt is pooled into one vector (the model's
    pooling, ``engine.pooling``), nothing is sampled. ``dimensions``: keep the first this many
    (Matryoshka) before normalizing; ``normalize``: None = the model's default (L2, usually)."""

    dimensions: int | None = None
    normalize: bool | None = None

    def __post_init__(self) -> None:
        d = self.dimensions
        if d is not None and (isinstance(d, bool) or not isinstance(d, int) or d < 1):
            raise SamplingParamError("dimensions", f"dimensions must be a positive integer, got {d!r}")
        if self.normalize is not None and not isinstance(self.normalize, bool):
            raise SamplingParamError("normalize", f"normalize must be true or false, got {self.normalize!r}")

    def to_wire(self) -> list:
        return [self.dimensions, self.normalize]

    @classmethod
    def from_wire(cls, p: list | None) -> PoolingParams | None:
        if p is None:
            return None
        try:
            dimensions, normalize = p
            return cls(dimensions, normalize)
        except (TypeError, ValueError) as e:
            raise ProtocolError(f"bad pooling params: {e}") from e


class SamplingParamError(ValueError):
    """A sampling field out of range; ``param`` names it (for OpenAI error bodies)."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


_SAMPLING_FIELDS = tuple(f.name for f in fields(SamplingParams))  # wire order: the golden bytes pin it


# ----------------------------------------------------------------------------- messages


@dataclass
class Hello:
    frontend_id: str
    version: int = PROTOCOL_VERSION
    kind = Kind.HELLO

    def to_wire(self) -> list:
        return [self.frontend_id, self.version]

    @classmethod
    def from_wire(cls, p: list) -> Hello:
        frontend_id, version = p
        return cls(str(frontend_id), int(version))


@dataclass
class Ready:
    model: str  # the served model name
    max_model_len: int
    vocab_size: int
    eos_token_ids: list[int]
    max_num_seqs: int
    num_kv_blocks: int
    block_size: int
    max_num_waiting_requests: int = 1024  # a call starting more requests than this could never be queued
    loras: list[list[str]] = field(default_factory=list)  # LoRA adapters served beside the model: [name, folder]
    max_loras: int = 0  # slots for adapters, loaded while serving too (``LoraUpdate``); 0: none loaded so
    # images (LLaVA): the placeholder token, how many of it stand for one image, at most how many images a
    # prompt holds; 0 tokens: the model takes none
    image_token_id: int = -1
    image_tokens: int = 0
    max_images: int = 0
    labels: list[str] = field(default_factory=list)  # a sequence classifier's (it classifies, nothing else)
    # ``--request-timeout``: seconds a request without a deadline of its own gets (None: no limit); a frontend
    # running one call as several requests (beam search's rounds) holds the whole call to it
    request_timeout: float | None = None
    version: int = PROTOCOL_VERSION
    kind = Kind.READY

    def to_wire(self) -> list:
        return [
            self.model, self.max_model_len, self.vocab_size, list(self.eos_token_ids),
            self.max_num_seqs, self.num_kv_blocks, self.block_size, self.max_num_waiting_requests,
            [list(a) for a in self.loras], self.max_loras, self.image_token_id, self.image_tokens, self.max_images,
            list(self.labels), self.request_timeout, self.version,
        ]

    @classmethod
    def from_wire(cls, p: list) -> Ready:
        m, mml, vs, eos, mns, nb, bs, mw, loras, ml, it, nt, mi, labels, rt, v = p
        return cls(str(m), int(mml), int(vs), [int(t) for t in eos], int(mns), int(nb), int(bs), int(mw),
                   [[str(name), str(path)] for name, path in loras], int(ml), int(it), int(nt), int(mi),
                   [str(x) for x in labels], None if rt is None else float(rt), int(v))


@dataclass
class ImageInput:
    """An image in a prompt: what its ``length`` placeholder tokens from ``offset`` stand for, as pixels the
    model's image processor made (float32, little-endian, channels first: ``shape`` (3, H, W))."""

    offset: int
    length: int
    shape: list[int]
    pixels: bytes

    def to_wire(self) -> list:
        return [self.offset, self.length, list(self.shape), self.pixels]

    @classmethod
    def from_wire(cls, p: list) -> ImageInput:
        offset, length, shape, pixels = p
        if not all(type(v) is int for v in (offset, length, *shape)) or not isinstance(pixels, bytes):
            raise ProtocolError("an image is [offset, length, shape, pixels]: ints, a list of ints, bytes")
        return cls(offset, length, list(shape), pixels)


@dataclass
class Add:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    priority: int = 0  # lower runs first (vLLM's convention)
    deadline: float | None = None  # unix seconds; None = none
    cache_salt: str = ""  # prefix-cache blocks are shared only between requests with the same salt
    pooling: PoolingParams | None = None  # an embedding request: ``params`` are unused
    lora: str = ""  # the LoRA adapter it runs with (one of ``Ready.loras``); "": the model alone
    images: list[ImageInput] = field(default_factory=list)  # in the prompt, in order
    # a later part of work already admitted (a beam search's next round): the waiting-queue bound, which
    # refuses new work with a 429, does not apply, or a search could fail halfway with its rounds lost
    admitted: bool = False
    client: str = ""  # who asked (the fair policy shares seats and tokens per client): "addr:<host>", "key:<n>", "user:<user>"
    kind = Kind.ADD

    def to_wire(self) -> list:
        return [self.request_id, list(self.prompt_token_ids), self.params.to_wire(), self.priority, self.deadline,
                self.cache_salt, None if self.pooling is None else self.pooling.to_wire(), self.lora,
                [i.to_wire() for i in self.images], self.admitted, self.client]

    @classmethod
    def from_wire(cls, p: list) -> Add:
        rid, toks, params, prio, deadline, salt, pooling, lora, images, admitted, client = p
        if not isinstance(toks, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in toks):
            raise ProtocolError("prompt_token_ids must be a list of ints")
        return cls(str(rid), toks, SamplingParams.from_wire(params), int(prio),
                   None if deadline is None else float(deadline), str(salt), PoolingParams.from_wire(pooling),
                   str(lora), [ImageInput.from_wire(i) for i in images], bool(admitted), str(client))


@dataclass
class Abort:
    request_ids: list[str]
    kind = Kind.ABORT

    def to_wire(self) -> list:
        return list(self.request_ids)

    @classmethod
    def from_wire(cls, p: list) -> Abort:
        if not isinstance(p, list):  # a bare string would iterate into one id per character
            raise ProtocolError("abort payload must be a list of request ids")
        return cls([str(r) for r in p])


def embedding_floats(embedding: bytes) -> list[float]:
    """A ``Delta.embedding``'s float32s as Python floats."""
    return list(struct.unpack(f"<{len(embedding) // 4}f", embedding))


# per token: [logprob of the sampled token, [(token_id, logprob), ...top-k], its rank (1: the most likely)]. In
# ``Outputs`` (the engine's step, the wire) the top-k is one ``bytes`` instead, ``pack_top``'s: at 256 rows of
# 20, 5120 small lists a step were most of the engine's host work and of its frame's packing
TokenLogprobs = list
_TOP_PAIR = struct.Struct("<if")  # (token id, logprob) as int32 and float32, little-endian


def pack_top(top: list) -> bytes:
    """``[(token_id, logprob), ...]`` as ``Outputs`` carries it (float32 logprobs: what the engine computes)."""
    return b"".join([_TOP_PAIR.pack(t, v) for t, v in top])


def unpack_top(packed: bytes) -> list[tuple[int, float]]:
    """``pack_top``'s bytes back as ``[(token_id, logprob), ...]`` (tuples: a third cheaper than lists)."""
    return list(_TOP_PAIR.iter_unpack(packed))


def _packed(entries: list[TokenLogprobs | None] | None) -> list | None:
    return entries if entries is None else [e if e is None else [e[0], pack_top(e[1]), *e[2:]] for e in entries]


def _unpacked(entries: list | None) -> list[TokenLogprobs | None] | None:
    return entries if entries is None else [e if e is None else [e[0], unpack_top(e[1]), *e[2:]] for e in entries]


def _valid_packed(entries: Any, first_may_be_none: bool) -> bool:
    if entries is None:
        return True
    if type(entries) is not list:
        return False
    return all((e is None and first_may_be_none) or (type(e) is list and len(e) >= 2 and type(e[1]) is bytes
                                                      and not len(e[1]) % _TOP_PAIR.size) for e in entries)


@dataclass(slots=True)  # (one per request per step)
class Delta:
    """What one request produced in one engine step."""

    request_id: str
    token_ids: list[int]
    # "stop" | "length" | "abort" | "timeout" | "error" (could not run: out of memory, or its grammar cost too
    # much to follow) | None while running
    finish_reason: str | None = None
    logprobs: list[TokenLogprobs] | None = None  # one entry per token in token_ids
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    prompt_logprobs: list[TokenLogprobs | None] | None = None  # once, with the first delta
    stop_reason: int | str | None = None  # the stop token id that ended it, if any; with "error", why (text)
    embedding: bytes | None = None  # an embedding request's vector: little-endian float32s, with its end


@dataclass(slots=True)
class Outputs:
    """Deltas in columns, as the engine's step makes them and the wire carries them: request ids, token lists,
    prompt and cached token counts, then ``[index, finish_reason, logprobs, prompt_logprobs, stop_reason,
    embedding]`` for the few deltas that have any of those (most deltas of a step are one token of a running
    request), their logprobs' top-k packed (``pack_top``). Iterating gives the ``Delta`` of each, in order,
    its logprobs unpacked. No object a request: at 256 one-token deltas, the engine's ``_postprocess`` takes
    96 µs instead of 135 and the actor's sending 57 instead of 83 (a ``Delta`` each, then columns for the wire,
    on this project's CPU)."""

    request_ids: list[str] = field(default_factory=list)
    token_ids: list[list[int]] = field(default_factory=list)
    num_prompt_tokens: list[int] = field(default_factory=list)
    num_cached_tokens: list[int] = field(default_factory=list)
    rare: list[list] = field(default_factory=list)
    kind = Kind.OUTPUTS

    @classmethod
    def of(cls, deltas: list[Delta]) -> Outputs:
        """``deltas`` in columns (a fake engine's, a test's)."""
        out = cls()
        for d in deltas:
            out.add(d.request_id, d.token_ids, d.num_prompt_tokens, d.num_cached_tokens, d.finish_reason,
                    _packed(d.logprobs), _packed(d.prompt_logprobs), d.stop_reason, d.embedding)
        return out

    def add(self, request_id: str, token_ids: list[int], num_prompt_tokens: int, num_cached_tokens: int,
            finish_reason: str | None = None, logprobs: list | None = None, prompt_logprobs: list | None = None,
            stop_reason: int | str | None = None, embedding: bytes | None = None) -> None:
        """One more delta (``Delta``'s fields, in its order but the counts'; the logprobs' top-k packed)."""
        if finish_reason is not None or logprobs is not None or prompt_logprobs is not None:
            self.rare.append([len(self.request_ids), finish_reason, logprobs, prompt_logprobs, stop_reason, embedding])
        self.request_ids.append(request_id)
        self.token_ids.append(token_ids)
        self.num_prompt_tokens.append(num_prompt_tokens)
        self.num_cached_tokens.append(num_cached_tokens)

    def take(self, rows: list[int], request_ids: list[str]) -> Outputs:
        """The deltas at ``rows`` (ascending), renamed ``request_ids``."""
        rare = []
        if self.rare:
            at = {row: i for i, row in enumerate(rows)}
            rare = [[at[r[0]], *r[1:]] for r in self.rare if r[0] in at]
        tokens, prompts, cached = self.token_ids, self.num_prompt_tokens, self.num_cached_tokens
        return Outputs(request_ids, [tokens[i] for i in rows], [prompts[i] for i in rows], [cached[i] for i in rows],
                       rare)

    def __len__(self) -> int:
        return len(self.request_ids)

    def __iter__(self) -> Iterator[Delta]:
        deltas = [Delta(r, t, None, None, n, c) for r, t, n, c in
                  zip(self.request_ids, self.token_ids, self.num_prompt_tokens, self.num_cached_tokens, strict=True)]
        for i, fin, lps, plp, sr, emb in self.rare:
            d = deltas[i]
            d.finish_reason, d.stop_reason, d.embedding = fin, sr, emb
            d.logprobs, d.prompt_logprobs = _unpacked(lps), _unpacked(plp)
        return iter(deltas)

    def to_wire(self) -> list:
        return [self.request_ids, self.token_ids, self.num_prompt_tokens, self.num_cached_tokens, self.rare]

    @classmethod
    def from_wire(cls, p: list) -> Outputs:
        rids, tokens, prompts, cached, rare = p
        n = len(rids)
        if not len(tokens) == len(prompts) == len(cached) == n:
            raise ProtocolError("delta columns must be of one length")
        if not set(map(type, tokens)) <= {list}:
            raise ProtocolError("delta token_ids must be a list")
        if not (set(map(type, rids)) <= {str} and set(map(type, prompts)) | set(map(type, cached)) <= {int}):
            raise ProtocolError("delta ids must be strings, its counts integers")
        for row in rare:
            i, _, lps, plp, _, emb = row
            if type(i) is not int or not 0 <= i < n:
                raise ProtocolError(f"no delta {i!r} for its end or logprobs")
            if not (_valid_packed(lps, False) and _valid_packed(plp, True)):
                raise ProtocolError("delta logprobs must be [logprob, packed top-k, ...] lists")
            if emb is not None and (not isinstance(emb, bytes) or len(emb) % 4):
                raise ProtocolError("delta embedding must be float32 bytes")
        return cls(rids, tokens, prompts, cached, rare)


@dataclass
class Stats:
    num_waiting: int = 0
    num_running: int = 0
    kv_usage: float = 0.0  # fraction of KV blocks in use
    num_free_blocks: int = 0
    num_kv_blocks: int = 0
    num_preemptions: int = 0  # since start
    num_timeouts: int = 0  # requests ended by their deadline, since start
    prefix_cache_hit_rate: float = 0.0  # prompt tokens served from the prefix cache / prompt tokens, since start
    num_evictions: int = 0  # cached blocks reused for other tokens, since start
    kv_fragmentation: float = 0.0  # allocated KV slots holding no token / allocated slots
    # speculative decoding (engine.speculative), since start: decodes with drafts, their drafts, those accepted
    num_spec_drafts: int = 0
    num_spec_draft_tokens: int = 0
    num_spec_accepted_tokens: int = 0
    # unasked, as a step with prompt tokens begins that may take this long (seconds, at most; inf: nothing measured
    # yet): no ping is answered until it ends, and its frontends are not to take it for hung meanwhile (else 0)
    step_s: float = 0.0
    kind = Kind.STATS

    def to_wire(self) -> list:
        return [self.num_waiting, self.num_running, self.kv_usage, self.num_free_blocks, self.num_kv_blocks,
                self.num_preemptions, self.num_timeouts, self.prefix_cache_hit_rate, self.num_evictions,
                self.kv_fragmentation, self.num_spec_drafts, self.num_spec_draft_tokens, self.num_spec_accepted_tokens,
                self.step_s]

    @classmethod
    def from_wire(cls, p: list) -> Stats:
        if not p:  # a request for stats
            return cls()
        w, r, u, f, n, pre, to, hit, ev, frag, drafts, draft_tokens, accepted, step_s = p
        return cls(int(w), int(r), float(u), int(f), int(n), int(pre), int(to), float(hit), int(ev), float(frag),
                   int(drafts), int(draft_tokens), int(accepted), float(step_s))


@dataclass
class Error:
    """A refused or failed request (``request_id`` None: about the frame itself)."""

    request_id: str | None
    status: int  # the HTTP status a frontend should answer with (400, 429, 500, 503)
    type: str  # OpenAI error type, e.g. "invalid_request_error"
    message: str
    param: str | None = None
    kind = Kind.ERROR

    def to_wire(self) -> list:
        return [self.request_id, self.status, self.type, self.message, self.param]

    @classmethod
    def from_wire(cls, p: list) -> Error:
        rid, status, typ, msg, param = p
        return cls(rid, int(status), str(typ), str(msg), param)


@dataclass
class LoraUpdate:
    """A frontend's call to load LoRA adapter ``name`` from folder ``path`` (None: to unload it), and the engine's
    answer to it, the same message with ``status`` (200, or the HTTP status of its refusal) and ``message``. The
    engine sends every frontend a new ``Ready`` (its ``loras``) before it answers."""

    call_id: str
    name: str
    path: str | None
    status: int = 0  # 0: a call
    message: str = ""
    param: str | None = None  # the field a refusal is about
    kind = Kind.LORA

    def to_wire(self) -> list:
        return [self.call_id, self.name, self.path, self.status, self.message, self.param]

    @classmethod
    def from_wire(cls, p: list) -> LoraUpdate:
        call_id, name, path, status, message, param = p
        if not isinstance(name, str) or not (path is None or isinstance(path, str)):
            raise ProtocolError("a LoRA update names an adapter and a folder (or none)")
        return cls(str(call_id), name, path, int(status), str(message), None if param is None else str(param))


@dataclass
class PrefixCacheReset:
    """A frontend's call to forget the engine's cached blocks (vLLM's ``/reset_prefix_cache``), and the engine's
    answer, the same message with ``status`` 200 and ``reset``: whether it did (not while a request holds one)."""

    call_id: str
    status: int = 0  # 0: a call
    reset: bool = False
    kind = Kind.RESET_PREFIX_CACHE

    def to_wire(self) -> list:
        return [self.call_id, self.status, self.reset]

    @classmethod
    def from_wire(cls, p: list) -> PrefixCacheReset:
        call_id, status, reset = p
        return cls(str(call_id), int(status), bool(reset))


Message = Hello | Ready | Add | Abort | Outputs | Stats | Error | LoraUpdate | PrefixCacheReset
_DECODERS = {Kind.HELLO: Hello, Kind.READY: Ready, Kind.ADD: Add, Kind.ABORT: Abort,
             Kind.OUTPUTS: Outputs, Kind.STATS: Stats, Kind.ERROR: Error, Kind.LORA: LoraUpdate,
             Kind.RESET_PREFIX_CACHE: PrefixCacheReset}


def encode(msg: Message) -> bytes:
    return msgpack.packb([int(msg.kind), msg.to_wire()], use_bin_type=True)


def decode(frame: bytes) -> Message:
    """Decode one frame; anything malformed raises ``ProtocolError``."""
    try:
        kind, payload = msgpack.unpackb(frame, raw=False, strict_map_key=False)
        cls = _DECODERS[Kind(kind)]
        return cls.from_wire(payload)
    except ProtocolError:
        raise
    except Exception as e:  # noqa: BLE001 - any shape error is the peer's fault, not ours
        raise ProtocolError(f"malformed frame: {e!r}") from e


# ----------------------------------------------------------------------------- engines on other hosts

ENGINE_KEY_ENV = "TOKENMILL_ENGINE_KEY"
MIN_ENGINE_KEY_CHARS = 16


def tcp_host_port(address: str) -> tuple[str, str]:
    """tcp://HOST:PORT's HOST and PORT as written ("" and "" for an address of another kind)."""
    host, _, port = address.removeprefix("tcp://").rpartition(":") if address.startswith("tcp://") else ("", "", "")
    return host, port


def wants_ipv6(address: str) -> bool:
    """Whether a ZMQ socket for ``address`` needs ``zmq.IPV6``: an IPv6 literal (tcp://[::1]:PORT), or ``*`` to
    listen on both families. Not for a host name: with the option ZMQ resolves names to IPv6 alone, and a name
    with both families (localhost, often) would take the one nothing listens on."""
    host = tcp_host_port(address)[0]
    return host.startswith("[") or host == "*"


@dataclass(frozen=True)
class CurveKeys:
    """ZMQ CURVE key pairs (Z85 bytes) both sides derive from one shared ``--engine-key``.

    A ``tcp://`` engine is a CURVE server with ``server_secret``; it lets in (ZAP) only the
    client whose public key is ``client_public``. A frontend needs ``server_public`` to even
    finish the handshake and ``client_secret`` to be let in: whoever lacks the shared key
    can do neither, and the traffic is encrypted on the way.
    """

    server_secret: bytes
    server_public: bytes
    client_secret: bytes
    client_public: bytes


def curve_keys(engine_key: str) -> CurveKeys:
    """Both key pairs from ``engine_key`` (at least ``MIN_ENGINE_KEY_CHARS`` characters)."""
    import hashlib

    import zmq
    from zmq.utils import z85

    if len(engine_key) < MIN_ENGINE_KEY_CHARS:
        raise ValueError(f"the engine key must be at least {MIN_ENGINE_KEY_CHARS} characters "
                         f"(got {len(engine_key)}); `openssl rand -hex 32` makes a good one")
    if not zmq.has("curve"):
        raise ValueError("this libzmq has no CURVE support: cannot authenticate a tcp:// engine")

    def pair(role: str) -> tuple[bytes, bytes]:
        secret = z85.encode(hashlib.sha256(f"tokenmill-engine-{role}:{engine_key}".encode()).digest())
        return secret, zmq.curve_public(secret)

    (ss, sp), (cs, cp) = pair("server"), pair("client")
    return CurveKeys(ss, sp, cs, cp)
