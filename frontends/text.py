"""Text in and out: the tokenizer, chat templates, incremental detokenizing, stop strings.

``load_tokenizer`` reads a Hugging Face folder or a GGUF file (slow, ~5 s: so
the first frontend may save it to ``cache_dir`` and the others load from there).
``IncrementalDetokenizer`` turns streamed token ids into text the vLLM way
(prefix_offset / read_offset) and never emits a broken UTF-8 sequence.
``StopStrings`` cuts the text at the first stop string and, while streaming,
holds back a tail that could still become one.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from typing import Any

_SOURCE_FILE = "tokenmill_source.txt"  # in a tokenizer cache: the model it was saved from


def load_tokenizer(model_path: str, cache_dir: str | None = None) -> Any:
    """A transformers tokenizer for a model folder or a ``.gguf`` file."""
    from transformers import AutoTokenizer  # heavy: only the frontend process pays for it

    model_path = os.path.abspath(model_path)
    if cache_dir is not None:
        marker = os.path.join(cache_dir, _SOURCE_FILE)
        try:
            with open(marker) as f:
                cached_for = f.read().strip()
        except OSError:
            cached_for = None
        if cached_for == model_path:
            return AutoTokenizer.from_pretrained(cache_dir)
    if model_path.endswith(".gguf"):
        tok = AutoTokenizer.from_pretrained(os.path.dirname(model_path),
                                            gguf_file=os.path.basename(model_path))
    else:
        tok = AutoTokenizer.from_pretrained(model_path)
    if cache_dir is not None:
        _save_cache(tok, model_path, cache_dir)
    return tok


def _save_cache(tok: Any, model_path: str, cache_dir: str) -> None:
    """Save next to ``cache_dir`` and rename into place, so racing frontends never see half a cache."""
    parent = os.path.dirname(os.path.abspath(cache_dir))
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".tokenizer-", dir=parent)
    try:
        tok.save_pretrained(tmp)
        with open(os.path.join(tmp, _SOURCE_FILE), "w") as f:
            f.write(model_path)
        if os.path.isdir(cache_dir):
            shutil.rmtree(cache_dir, ignore_errors=True)
        os.rename(tmp, cache_dir)
    except OSError:
        pass  # another frontend won the race, or the dir is not writable: the cache is optional
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


class TextCodec:
    """The tokenizer as the frontend uses it: encode, decode, chat templates, token strings."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = len(tokenizer)
        backend = getattr(tokenizer, "_tokenizer", None)  # the Rust tokenizer: ~3x faster decode
        if backend is not None and hasattr(backend, "decode"):
            self._decode = lambda ids, skip: backend.decode(ids, skip_special_tokens=skip)
        else:
            self._decode = lambda ids, skip: tokenizer.decode(ids, skip_special_tokens=skip)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._decode(ids, skip_special_tokens)

    def token_text(self, token_id: int) -> str:
        """One token's own text (for logprobs); special tokens keep their names."""
        return self._decode([token_id], False)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
        text = self.tokenizer.apply_chat_template(messages, tokenize=False,
                                                  add_generation_prompt=add_generation_prompt)
        return self.encode(text, add_special_tokens=False)


class IncrementalDetokenizer:
    """Token ids in, new text out; text ending in U+FFFD (an unfinished UTF-8 sequence) waits."""

    __slots__ = ("_codec", "_ids", "_prefix_offset", "_read_offset", "_skip")
    _CONTEXT = 5  # prompt tokens kept so the first output token decodes with its leading space right

    def __init__(self, codec: TextCodec, prompt_ids: list[int] | None = None,
                 skip_special_tokens: bool = True) -> None:
        self._codec = codec
        self._ids = list(prompt_ids[-self._CONTEXT:]) if prompt_ids else []
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self._skip = skip_special_tokens

    def step(self, token_ids: list[int]) -> str:
        ids = self._ids
        ids.extend(token_ids)
        decode = self._codec._decode
        prefix_text = decode(ids[self._prefix_offset:self._read_offset], self._skip)
        new_text = decode(ids[self._prefix_offset:], self._skip)
        if len(new_text) <= len(prefix_text) or new_text.endswith("\ufffd"):
            return ""
        self._prefix_offset = self._read_offset
        self._read_offset = len(ids)
        if self._prefix_offset > 256:  # keep the buffer short on long generations
            del ids[:self._prefix_offset]
            self._read_offset -= self._prefix_offset
            self._prefix_offset = 0
        return new_text[len(prefix_text):]

    def flush(self) -> str:
        """At the end: whatever was held back, broken or not."""
        ids = self._ids
        if self._read_offset >= len(ids):
            return ""
        prefix_text = self._codec.decode(ids[self._prefix_offset:self._read_offset], self._skip)
        new_text = self._codec.decode(ids[self._prefix_offset:], self._skip)
        self._prefix_offset = self._read_offset = len(ids)
        return new_text[len(prefix_text):]


class StopStrings:
    """Cuts streamed text at the first stop string (which is not returned)."""

    __slots__ = ("_stops", "_held", "matched")

    def __init__(self, stops: list[str]) -> None:
        self._stops = stops
        self._held = ""
        self.matched: str | None = None  # the stop string that hit

    def feed(self, text: str) -> tuple[str, bool]:
        """(text safe to emit now, whether a stop string matched)."""
        buf = self._held + text if self._held else text
        best = -1
        for s in self._stops:
            i = buf.find(s)
            if i != -1 and (best == -1 or i < best):
                best, self.matched = i, s
        if best != -1:
            self._held = ""
            return buf[:best], True
        keep = 0  # the longest tail of buf that is the start of some stop string
        for s in self._stops:
            for k in range(min(len(s) - 1, len(buf)), keep, -1):
                if buf.endswith(s[:k]):
                    keep = k
                    break
        if keep:
            self._held = buf[-keep:]
            return buf[:-keep], False
        self._held = ""
        return buf, False

    def flush(self) -> str:
        held, self._held = self._held, ""
        return held
