"""Each token's bytes, as the model's tokenizer writes them: what structured output matches.

Read straight from the model's files (``tokenizer.json`` in a Hugging Face folder, the
``tokenizer.ggml.*`` fields of a GGUF file), without loading a tokenizer: the engine holds
no tokenizer. Two vocabularies are understood: byte-level BPE (GPT-2's byte-to-character map:
Llama 3, Qwen2, SmolLM) and SentencePiece-style (``▁`` for a space, ``<0xNN>`` byte tokens:
Llama 2, Mistral). Special and control tokens have no bytes (``None``): they never match text.
"""

from __future__ import annotations

import functools
import json
import os
import re

_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")


class VocabularyError(ValueError):
    """A tokenizer whose tokens cannot be read as bytes here."""


def token_bytes(model_path: str) -> list[bytes | None]:
    """Bytes per token id for a model folder or ``.gguf`` file."""
    if model_path.endswith(".gguf"):
        return _from_gguf(model_path)
    path = os.path.join(model_path, "tokenizer.json")
    if not os.path.exists(path):
        raise VocabularyError(f"no tokenizer.json in {model_path}")
    with open(path, encoding="utf-8") as f:
        return _from_tokenizer_json(json.load(f))


def _from_tokenizer_json(tj: dict) -> list[bytes | None]:
    model = tj.get("model") or {}
    vocab = model.get("vocab")
    if isinstance(vocab, list):  # Unigram: [[piece, score], ...]
        pieces = {piece: i for i, (piece, _) in enumerate(vocab)}
    elif isinstance(vocab, dict):
        pieces = vocab
    else:
        raise VocabularyError(f"unsupported tokenizer model {model.get('type')!r}")
    special = {}
    for a in tj.get("added_tokens") or []:
        pieces.setdefault(a["content"], a["id"])
        special[a["id"]] = a.get("special", False)
    byte_level = "ByteLevel" in json.dumps(tj.get("decoder"))
    out: list[bytes | None] = [None] * (max(pieces.values(), default=-1) + 1)
    for piece, i in pieces.items():
        if special.get(i):
            continue
        out[i] = piece_bytes(piece, byte_level, added=i in special)
    return out


def _from_gguf(path: str) -> list[bytes | None]:
    from engine.loader import _gguf_field, _gguf_reader

    r = _gguf_reader(path)
    kind = _gguf_field(r, "tokenizer.ggml.model")
    if kind not in ("gpt2", "llama"):
        raise VocabularyError(f"unsupported GGUF tokenizer model {kind!r}")
    pieces = _gguf_field(r, "tokenizer.ggml.tokens")
    types = _gguf_field(r, "tokenizer.ggml.token_type") or [1] * len(pieces)
    # token types: 1 normal, 2 unknown, 3 control, 4 user-defined, 5 unused, 6 byte
    return [piece_bytes(p, kind == "gpt2", added=t == 4) if t in (1, 4, 6) else None
            for p, t in zip(pieces, types, strict=True)]


def piece_bytes(piece: str, byte_level: bool, added: bool = False) -> bytes | None:
    """A vocabulary entry's bytes: GPT-2's characters mapped back (``byte_level``), else SentencePiece's
    ``<0xNN>`` and ``▁``."""
    if added:  # an added (not special) token is plain text
        return piece.encode()
    if byte_level:
        table = _unicode_to_byte()
        try:
            return bytes(table[c] for c in piece)
        except KeyError:
            return piece.encode()
    m = _BYTE_TOKEN.fullmatch(piece)
    if m:
        return bytes([int(m.group(1), 16)])
    return piece.replace("\u2581", " ").encode()


@functools.cache
def _unicode_to_byte() -> dict[str, int]:
    """GPT-2's map from the printable characters byte-level BPE writes back to bytes."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, n = list(keep), 0
    for b in range(256):
        if b not in keep:
            keep.append(b)
            chars.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(keep, chars, strict=True)}
