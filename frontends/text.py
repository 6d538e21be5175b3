"""Text in and out: encoding and chat templates, incremental detokenizing, stop strings.

``TextCodec`` wraps a tokenizer (``frontends.tokenizer`` loads it).
``IncrementalDetokenizer`` turns streamed token ids into text the vLLM way
(prefix_offset / read_offset) and never emits a broken UTF-8 sequence.
``fim_tokens`` finds a model's fill-in-the-middle tokens, and ``TextCodec.fim_prompt`` lays a gap out with them.
``StopStrings`` cuts the text at the first stop string and, while streaming,
holds back a tail that could still become one; its ``StopMatcher`` automaton
makes that cost O(1) per character whatever the number of stop strings.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from engine.token_bytes import piece_bytes
from frontends import images

T = TypeVar("T")

# llama.cpp's FIM token texts, as src/llama-vocab.cpp looks for them (first found wins)
FIM_TEXTS = {
    "pre": ("<|fim_prefix|>", "<fim-prefix>", "<fim_prefix>", "<｜fim▁begin｜>", "<PRE>", "▁<PRE>", "<|code_prefix|>",
            "<|prefix|>"),
    "suf": ("<|fim_suffix|>", "<fim-suffix>", "<fim_suffix>", "<｜fim▁hole｜>", "<SUF>", "▁<SUF>", "<|code_suffix|>",
            "<|suffix|>"),
    "mid": ("<|fim_middle|>", "<fim-middle>", "<fim_middle>", "<｜fim▁end｜>", "<MID>", "▁<MID>", "<|code_middle|>",
            "<|middle|>"),
    "pad": ("<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]"),
    "rep": ("<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>"),
    "sep": ("<|file_sep|>",),
}


def fim_tokens(vocab: dict[str, int]) -> dict[str, int]:
    """The model's fill-in-the-middle tokens found in its ``vocab`` (token text -> id): "pre", "suf", "mid",
    and where it has them "pad", "rep" (a repository's name), "sep" (a file's)."""
    out = {}
    for kind, texts in FIM_TEXTS.items():
        found = next((vocab[t] for t in texts if t in vocab), None)
        if found is not None:
            out[kind] = found
    return out


class TextCodec:
    """The tokenizer as the frontend uses it: encode, decode, chat templates, token strings.

    Large inputs are tokenized (and chat templates rendered) on a worker thread,
    so one 1 MB prompt never freezes every other stream on the event loop (the
    Rust tokenizer releases the GIL while it works). One worker: big jobs queue
    behind each other instead of taking every core.
    """

    INLINE_CHARS = 4096  # inputs up to this size are cheaper to tokenize inline than to hand off
    # queued big work, about 5 s of it on a small CPU: beyond it a big input is refused (429) at once,
    # so a few clients posting megabytes cannot make every later big prompt wait minutes
    MAX_QUEUED = 4 << 20

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = len(tokenizer)
        backend = getattr(tokenizer, "_tokenizer", None)  # the Rust tokenizer: ~3x faster decode
        if backend is not None and hasattr(backend, "decode"):
            self._decode = lambda ids, skip: backend.decode(ids, skip_special_tokens=skip)
        else:
            self._decode = lambda ids, skip: tokenizer.decode(ids, skip_special_tokens=skip)
        # No token spells more characters than its vocabulary entry has (byte-level and
        # SentencePiece entries are at least as long as their text), so a text longer than
        # max_model_len x this cannot fit and is refused before it is tokenized.
        self.max_token_chars = max(map(len, tokenizer.get_vocab()), default=1) or 1
        self._backend = backend
        # a copy of the Rust tokenizer that reads special tokens' names as text (encode_literal; built at its first
        # use, a fifth of a second for 50k tokens: frontends.llamacpp builds it at start for a model that infills)
        self._literal = None
        self._byte_level: bool | None = None  # whether its vocabulary is GPT-2's bytes (token_bytes)
        self._added: set[int] = set()  # its added tokens, whose entries are their text (token_bytes)
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tokenize")
        self._queued = 0  # size of the work handed to the pool and not finished
        self.image_token: str | None = None  # a model that reads images: its placeholder (``use_images``)
        self._lists_contents = False
        self._texts: list[str] | None = None  # every token's text (token_texts)
        self._text_of: dict[int, str] = {}  # the texts token_text has made, by id
        self._utf8_of: dict[int, list[int]] = {}  # and their bytes (token_utf8)
        self._bytes_of: dict[int, bytes] = {}  # tokens' own bytes (token_bytes)
        self._single: dict[str, int | None] = {}  # texts that are one token's, and its id (single_token)
        self._dry: dict[tuple[str, ...], list[list[int]]] = {}  # DRY's breakers as token sequences (dry_breakers)
        self._fim: dict[str, int] | None = None
        self._bos: list[int] | None = None

    @property
    def fim(self) -> dict[str, int]:
        """The model's fill-in-the-middle tokens (``fim_tokens``), found once."""
        if self._fim is None:
            self._fim = fim_tokens(self.tokenizer.get_vocab())
        return self._fim

    @property
    def fills_in_the_middle(self) -> bool:
        """Whether the model has the three FIM tokens a gap needs (prefix, suffix, middle)."""
        return {"pre", "suf", "mid"} <= self.fim.keys()

    @property
    def fim_ends(self) -> list[int]:
        """The FIM tokens that end an infill (llama.cpp's end-of-generation set: pad, repository, file)."""
        return [self.fim[k] for k in ("pad", "rep", "sep") if k in self.fim]

    @property
    def bos(self) -> list[int]:
        """What the tokenizer starts a string prompt with (its BOS, or nothing), found once."""
        if self._bos is None:
            self._bos = self.encode("", add_special_tokens=True)
        return self._bos

    def fim_prompt(self, prefix: list[int], suffix: list[int]) -> list[int]:
        """A gap between ``prefix`` and ``suffix`` as the model's FIM tokens lay it out (llama.cpp's, PSM:
        Qwen2.5-Coder's, StarCoder's, CodeLlama's, DeepSeek-Coder's): ``[BOS] <PRE> prefix <SUF> suffix <MID>``."""
        fim = self.fim
        return [*self.bos, fim["pre"], *prefix, fim["suf"], *suffix, fim["mid"]]

    def use_images(self, token_id: int) -> None:
        """The model reads images (``frontends.images``): chat templates get them, as parts of a content list
        where the template reads those, else as the image token written before the message's text."""
        self.image_token = self.token_text(token_id)
        self._lists_contents = images.lists_contents(self.chat_template)

    def _template_messages(self, messages: list[dict]) -> list[dict]:
        """``messages`` as the chat template reads them: with images (``use_images``), each one's in its place
        (``parts``: ``frontends.openai_params.parse_messages``')."""
        if self.image_token is None:
            return messages
        out = []
        for m in messages:
            n, parts = len(m.get("images", ())), m.get("parts")
            m = {k: v for k, v in m.items() if k not in ("images", "parts")}
            if not isinstance(m.get("content"), str):  # (parts already: as given)
                pass
            elif self._lists_contents:  # the text and images in their order
                m["content"] = parts or [{"type": "text", "text": m["content"]}]
            elif n:  # the images before the text, as vLLM writes them
                m["content"] = f"{self.image_token}\n" * n + m["content"]
            out.append(m)
        return out

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._decode(ids, skip_special_tokens)

    def encode_pair(self, first: str, second: str, max_length: int | None = None) -> list[int]:
        """Two texts as the tokenizer pairs them (a cross-encoder's query and document: its template's
        special tokens around and between them, or none); ``max_length``: at most that many tokens, the
        longer text cut from its end first (transformers' ``longest_first``, as vLLM truncates pairs)."""
        tok = self.tokenizer
        if hasattr(tok, "encode_pair"):  # (frontends.tokenizer.CachedTokenizer)
            return tok.encode_pair(first, second, max_length)
        if max_length is None:
            return tok(first, second)["input_ids"]
        from frontends.tokenizer import truncated_pair

        backend = tok.backend_tokenizer
        backend.no_truncation()  # (transformers leaves a call's truncation set on it)
        return truncated_pair(backend, first, second, max_length)

    def encode_literal(self, text: str) -> list[int]:
        """``text`` as text alone: a special token's name in it is its characters, not the token (code that
        mentions ``<|endoftext|>``; llama.cpp's ``parse_special`` false). No BOS."""
        if self._backend is None or not hasattr(self._backend, "encode_special_tokens"):
            return self.tokenizer.encode(text, add_special_tokens=False, split_special_tokens=True)
        if self._literal is None:
            from tokenizers import Tokenizer

            literal = Tokenizer.from_str(self._backend.to_str())
            literal.encode_special_tokens = True
            self._literal = literal
        return self._literal.encode(text, add_special_tokens=False).ids

    def encode_offsets(self, text: str) -> list[tuple[int, int, int]]:
        """``text``'s tokens (with the tokenizer's special ones) as (id, start, end): the characters each came
        from, (0, 0) where the tokenizer cannot say (a special token it adds; a tokenizer without offsets)."""
        if self._backend is not None and hasattr(self._backend, "encode"):
            enc = self._backend.encode(text, add_special_tokens=True)
            return [(t, a, b) for t, (a, b) in zip(enc.ids, enc.offsets, strict=True)]
        return [(t, 0, 0) for t in self.encode(text)]

    def token_text(self, token_id: int) -> str:
        """One token's own text (for logprobs); special tokens keep their names. Kept once made (for the ids of
        the vocabulary): logprobs ask for the same tokens' texts over and over, a stream's top 20 twice a token
        in chat (at 256 streams, 10,000 decodes a step: 9.3 ms against 2.9 kept)."""
        text = self._text_of.get(token_id)
        return text if text is not None else self._keep(self._text_of, token_id, self._decode([token_id], False))

    def token_utf8(self, token_id: int) -> list[int]:
        """The token's own bytes (``token_bytes``) as a list, as logprobs give them: a token that is part of a
        character has those bytes, not U+FFFD's, so that a client can join them into the text (OpenAI's
        rule). Kept as the texts are (one list for every answer: never change it)."""
        utf8 = self._utf8_of.get(token_id)
        if utf8 is not None:
            return utf8
        return self._keep(self._utf8_of, token_id, list(self.token_bytes(token_id)))

    def _keep(self, kept: dict, token_id: int, value: Any) -> Any:
        """``value``, made for ``token_id``, kept in ``kept`` if the id is the vocabulary's (what a client names
        past it is not kept: the dicts hold at most a vocabulary)."""
        if 0 <= token_id < self.vocab_size:
            kept[token_id] = value
        return value

    def single_token(self, text: str) -> int | None:
        """The id of the token whose own name is ``text`` (a marker such as ``</think>``), or None where no one
        token is; looked up once per text."""
        if text not in self._single:
            tid = self.tokenizer.convert_tokens_to_ids(text)
            ok = isinstance(tid, int) and self.tokenizer.convert_ids_to_tokens(tid) == text
            self._single[text] = tid if ok else None
        return self._single[text]

    def token_texts(self) -> list[str]:
        """Every token's own text, by id (special tokens with their names); built once."""
        if self._texts is None:
            ids = [[i] for i in range(self.vocab_size)]
            if self._backend is not None and hasattr(self._backend, "decode_batch"):
                self._texts = self._backend.decode_batch(ids, skip_special_tokens=False)
            else:
                self._texts = [self.token_text(i[0]) for i in ids]
        return self._texts

    def has_dry_breakers(self, breakers: tuple[str, ...]) -> bool:
        """Whether ``dry_breakers`` has these at hand (no scan)."""
        return breakers in self._dry

    def dry_breakers(self, breakers: tuple[str, ...]) -> list[list[int]]:
        """llama.cpp's DRY sequence breakers as token sequences (``dry_breaker_token_ids``): a scan of the
        vocabulary, so kept for the last few lists asked for (most requests give llama.cpp's defaults)."""
        if breakers not in self._dry:
            if len(self._dry) >= 16:
                del self._dry[next(iter(self._dry))]
            self._dry[breakers] = dry_breaker_token_ids(list(breakers), self.token_texts(),
                                                        lambda text: self.encode(text, add_special_tokens=False))
        return self._dry[breakers]

    def token_bytes(self, token_id: int) -> bytes:
        """One token's own bytes, from its vocabulary entry: a token that is part of a character has those bytes
        (its text, U+FFFD), a SentencePiece word's first token its space (a decoded token alone drops it). Kept
        as the texts are."""
        raw = self._bytes_of.get(token_id)
        if raw is not None:
            return raw
        if self._backend is not None:
            if self._byte_level is None:
                self._byte_level = "ByteLevel" in repr(self._backend.decoder)  # (its decoders, written out)
                self._added = set(self._backend.get_added_tokens_decoder())
            piece = self._backend.id_to_token(token_id)
            raw = piece_bytes(piece, self._byte_level, token_id in self._added) if piece is not None else None
        return self._keep(self._bytes_of, token_id, raw if raw is not None else self.token_text(token_id).encode())

    @property
    def chat_template(self) -> str | None:
        """The chat template's source (None: none, or several named ones)."""
        t = getattr(self.tokenizer, "chat_template", None)
        return t if isinstance(t, str) else None

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            tools: list[dict] | None = None, extra: dict | None = None,
                            continue_final: bool = False, add_special_tokens: bool = False) -> list[int]:
        """``extra``: more template variables (``chat_template_kwargs``). ``continue_final``: the prompt ends
        inside the last (assistant) message, so the model goes on with it (vLLM's and transformers'
        ``continue_final_message``: what the template writes after its content is cut off).
        ``add_special_tokens``: the tokenizer's own (a BOS) around what the template wrote, as vLLM's field."""
        text = self.tokenizer.apply_chat_template(self._template_messages(messages), tokenize=False, tools=tools,
                                                  add_generation_prompt=add_generation_prompt, **(extra or {}))
        if continue_final:
            final = messages[-1]["content"] or ""
            if not final.strip():
                raise ValueError("the final message is empty: there is nothing to continue")
            at = text.rfind(final.strip())
            if at < 0:
                raise ValueError("the chat template does not write the final message's content as it is, so "
                                 "it cannot be continued")
            kept = len(final.lstrip()) if text[at:at + len(final.lstrip())] == final.lstrip() else len(final.strip())
            text = text[:at + kept]
        return self.encode(text, add_special_tokens=add_special_tokens)

    async def run(self, size: int, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` inline when ``size`` (characters, or token ids) is small, else on the tokenizer
        thread; ``TokenizerBusy`` when that thread already has ``MAX_QUEUED`` of work waiting."""
        if size <= self.INLINE_CHARS:
            return fn(*args)
        if self._queued + size > self.MAX_QUEUED:
            raise TokenizerBusy(f"the tokenizer has {self._queued} characters of large inputs queued; "
                                "retry shortly")
        self._queued += size
        try:
            return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)
        finally:
            self._queued -= size


def partial_suffix(text: str, marker: str) -> int:
    """The length of the longest end of ``text`` that begins ``marker``: what a stream holds back
    while it may still become the marker."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


class TokenizerBusy(Exception):
    """Too much large-input work is queued on the tokenizer thread."""


class IncrementalDetokenizer:
    """Token ids in, new text out; text ending in U+FFFD (an unfinished UTF-8 sequence) waits. A prompt that ends
    inside a character (token ids cut there) has it finished by the first output tokens, which then give it whole."""

    __slots__ = ("_codec", "_ids", "_prefix_offset", "_read_offset", "_skip", "_open", "_echoed")
    _CONTEXT = 5  # prompt tokens kept so the first output token decodes with its leading space right

    def __init__(self, codec: TextCodec, prompt_ids: list[int] | None = None,
                 skip_special_tokens: bool = True) -> None:
        self._codec = codec
        self._ids = list(prompt_ids[-self._CONTEXT:]) if prompt_ids else []
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self._skip = skip_special_tokens
        self._open = bool(self._ids)  # until the first text: the prompt's last character may be unfinished
        self._echoed = False

    def echoed(self) -> None:
        """The prompt is echoed before the output (a completion's ``echo``), as ``without_broken_end`` of its
        text: the U+FFFDs that text ends in are then the output's to give, whole where it finishes their
        character, as they are where not, so that echo and output read as the decode of both."""
        self._echoed = True

    def step(self, token_ids: list[int]) -> str:
        ids = self._ids
        ids.extend(token_ids)
        new_text = self._codec._decode(ids[self._prefix_offset:], self._skip)
        prefix_text, finished = self._prefix_text(new_text)
        if len(new_text) <= len(prefix_text) or new_text.endswith("\ufffd"):
            return ""
        if not finished:  # (else the next text is read from before the character, not from inside it)
            self._prefix_offset = self._read_offset
        self._read_offset = len(ids)
        self._open = False
        if self._prefix_offset > 256:  # keep the buffer short on long generations
            del ids[:self._prefix_offset]
            self._read_offset -= self._prefix_offset
            self._prefix_offset = 0
        return new_text[len(prefix_text):]

    def _prefix_text(self, new_text: str) -> tuple[str, bool]:
        """What was given (or is the prompt's) of ``new_text``: the prompt's text less the U+FFFDs it ends in that
        the output finished as a character (one, or one per byte as SentencePiece's byte fallback writes them;
        not where it stays broken, nor a U+FFFD of the prompt's own); and whether it is less."""
        text = self._codec._decode(self._ids[self._prefix_offset:self._read_offset], self._skip)
        kept = text
        if self._open and self._echoed:
            kept = without_broken_end(text)
        while self._open and kept.endswith("\ufffd") and not new_text.startswith(kept):
            kept = kept[:-1]
        return kept, len(kept) < len(text)

    def flush(self) -> str:
        """At the end: whatever was held back, broken or not."""
        ids = self._ids
        if self._read_offset >= len(ids):
            return ""
        new_text = self._codec._decode(ids[self._prefix_offset:], self._skip)
        prefix_text, _ = self._prefix_text(new_text)
        self._prefix_offset = self._read_offset = len(ids)
        return new_text[len(prefix_text):]


def without_broken_end(text: str) -> str:
    """``text`` less the U+FFFDs it ends in, up to 3 (as many as an unfinished character's bytes can make)."""
    return text[:max(len(text.rstrip("\ufffd")), len(text) - 3)]


DRY_TAIL_TOKENS = 20  # a breaker's tokens after the first, at most (llama.cpp's MAX_SEQ_LEN)


def dry_breaker_token_ids(breakers: list[str], texts: list[str], encode: Callable[[str], list[int]]) -> list[list[int]]:
    """llama.cpp's DRY sequence breakers as token sequences, found as llama.cpp finds them
    (``get_overlapping_token_sequences``): each token whose text holds a breaker, alone; and each token whose
    text ends in the start of one, followed by the rest of it tokenized (at most 20 tokens). ``texts``:
    every token's text, by id."""
    out: list[list[int]] = []
    seen: set[tuple[int, ...]] = set()
    rest: dict[str, list[int]] = {}
    for b in breakers:
        for tid, text in enumerate(texts):
            if b in text:
                found = [(tid,)]
            else:
                found = []
                pos = text.find(b[0])
                while pos >= 0:
                    if b.startswith(text[pos:]):  # the token ends in the breaker's start: the rest must follow
                        tail = b[len(text) - pos:]
                        if tail not in rest:
                            rest[tail] = encode(tail)[:DRY_TAIL_TOKENS]
                        found.append((tid, *rest[tail]))
                    pos = text.find(b[0], pos + 1)
            for seq in found:
                if seq not in seen:
                    seen.add(seq)
                    out.append(list(seq))
    return out


def bad_words_token_ids(words: list[str], encode: Callable[[str], list[int]]) -> list[list[int]]:
    """vLLM's ``bad_words`` as token ids, as vLLM tokenizes them: each word as it is (leading spaces
    dropped), and with one space before it where that gives other tokens of the same count (a word
    in the middle of a sentence)."""
    out: list[list[int]] = []
    for word in words:
        bare = encode(word.lstrip())
        out.append(bare)
        spaced = encode(" " + word.lstrip())
        if spaced and bare and spaced[0] != bare[0] and len(spaced) == len(bare):
            out.append(spaced)
    return [ids for ids in out if ids]


class StopMatcher:
    """A request's stop strings as an Aho-Corasick automaton: built once, shared by its choices.

    Feeding one character costs O(1) amortised however many stop strings there
    are. The state reached after a character says whether a stop string ends
    there (``hit``: the longest one, i.e. the earliest start among those ending
    there) and how long a tail of the text could still grow into one (``depth``):
    exactly what a streaming cut must hold back.
    """

    __slots__ = ("goto", "fail", "depth", "hit")

    def __init__(self, stops: list[str]) -> None:
        goto: list[dict[str, int]] = [{}]
        depth = [0]
        hit: list[str | None] = [None]
        for s in stops:  # the trie
            node = 0
            for ch in s:
                nxt = goto[node].get(ch)
                if nxt is None:
                    nxt = goto[node][ch] = len(goto)
                    goto.append({})
                    depth.append(depth[node] + 1)
                    hit.append(None)
                node = nxt
            if hit[node] is None:
                hit[node] = s
        fail = [0] * len(goto)
        queue = list(goto[0].values())  # breadth first: a fail link always points to a shallower state
        for node in queue:
            for ch, child in goto[node].items():
                f = fail[node]
                while f and ch not in goto[f]:
                    f = fail[f]
                fail[child] = goto[f].get(ch, 0) if node else 0
                if hit[child] is None:
                    hit[child] = hit[fail[child]]
                queue.append(child)
        self.goto, self.fail, self.depth, self.hit = goto, fail, depth, hit


class StopStrings:
    """Cuts streamed text where the first stop string is completed (the stop string is not returned).

    "First" is the one that ends first, and among those the longest: the same
    answer however the text arrives in pieces. While ``check`` is False (before
    ``min_tokens``) a completed stop string does not count, but the text still
    moves the automaton and its tail is still held, so one that straddles that
    boundary is found when it completes and cut where it starts (as vLLM cuts).
    """

    __slots__ = ("_m", "_state", "_held", "matched", "include")

    def __init__(self, stops: list[str] | StopMatcher, include: bool = False) -> None:
        """``include``: the stop string stays in the text (vLLM's ``include_stop_str_in_output``)."""
        self._m = stops if isinstance(stops, StopMatcher) else StopMatcher(stops)
        self._state = 0
        self._held = ""
        self.matched: str | None = None  # the stop string that hit
        self.include = include

    def feed(self, text: str, check: bool = True) -> tuple[str, bool]:
        """(text safe to emit now, whether a stop string matched)."""
        m = self._m
        goto, fail, hit = m.goto, m.fail, m.hit
        state = self._state
        held = self._held
        for i, ch in enumerate(text):
            while state and ch not in goto[state]:
                state = fail[state]
            state = goto[state].get(ch, 0)
            if check and hit[state] is not None:
                self.matched = s = hit[state]
                self._state, self._held = 0, ""
                return (held + text)[:len(held) + i + 1 - (0 if self.include else len(s))], True  # (it starts
                # within what was held)
        self._state = state
        buf = held + text if held else text
        keep = min(m.depth[state], len(buf))
        self._held = buf[len(buf) - keep:] if keep else ""
        return buf[:len(buf) - keep], False

    def flush(self) -> str:
        held, self._held = self._held, ""
        return held
