"""Loading the tokenizer: from a model folder or GGUF file once, then from a cache without transformers.

``load_tokenizer`` reads a Hugging Face folder or a ``.gguf`` file with
transformers: slow (~5 s, most of it importing transformers, which imports
torch). With a ``cache_dir`` it saves what it read there, and every later load
of the same model (the other frontends, a frontend restarted after a crash, and
the next runs: the launcher names one kept across runs, ``engine/cache_dir.py``)
reads the cache with ``CachedTokenizer`` instead: the Rust ``tokenizers``
library and a sandboxed jinja2 chat template, the way transformers renders it,
in a fraction of a second and without torch in the process.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
import time
from datetime import datetime
from typing import Any

from engine.cache_dir import TOKENIZERS, tokenizer_cache_dir
from engine.cache_dir import cache_dir as engine_cache_dir

_SOURCE_FILE = "tokenmill_source.txt"  # in a tokenizer cache: the model it was saved from
# the named special tokens, in transformers' order
_SPECIAL = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


def longest_first(n_first: int, n_second: int, budget: int) -> tuple[int, int]:
    """How many tokens of each of two texts the ``longest_first`` truncation of Hugging Face's tokenizers (what
    transformers' fast tokenizers, and so vLLM, run) keeps within ``budget``: the shorter text whole where it
    is at most half of it, else half (rounded down); the longer one the rest."""
    budget = max(budget, 0)
    if n_first + n_second <= budget:
        return n_first, n_second
    short = min(n_first, n_second, budget // 2)
    return (budget - short, short) if n_first > n_second else (short, budget - short)


def truncated_pair(tok: Any, first: str, second: str, max_length: int) -> list[int]:
    """Two texts paired by a ``tokenizers.Tokenizer`` in at most ``max_length`` tokens, cut as transformers'
    ``longest_first`` cuts them: each text encoded once and cut to its share (the library's own truncation
    tries every window: seconds on long texts). A ``ValueError`` where ``max_length`` leaves no token of
    either text beside the pair's special tokens (transformers would score the special tokens alone, or below
    them not cut at all)."""
    specials = tok.num_special_tokens_to_add(True)
    if max_length <= specials:
        raise ValueError(f"truncate_prompt_tokens {max_length} leaves no token of either text: a pair takes "
                         f"{specials} special tokens")
    a, b = tok.encode(first, add_special_tokens=False), tok.encode(second, add_special_tokens=False)
    keep_a, keep_b = longest_first(len(a), len(b), max_length - specials)
    return tok.post_process(_cut(tok, a, keep_a), _cut(tok, b, keep_b)).ids


def _cut(tok: Any, encoding: Any, n: int) -> Any:
    """``encoding``'s first ``n`` tokens."""
    if n == 0:
        return tok.encode("", add_special_tokens=False)  # (truncate(0) never returns)
    if n < len(encoding):
        encoding.truncate(n)
    return encoding


def load_tokenizer(model_path: str, cache_dir: str | None = None, chat_template: str | None = None) -> Any:
    """A tokenizer for a model folder or a ``.gguf`` file (``CachedTokenizer`` when ``cache_dir`` has it);
    ``chat_template``: its chat template instead of the model's."""
    tok = _load_tokenizer(os.path.abspath(model_path), cache_dir)
    if chat_template is not None:
        tok.chat_template = chat_template  # (CachedTokenizer compiles it here: a bad one fails at start)
    return tok


def _load_tokenizer(model_path: str, cache_dir: str | None) -> Any:
    cached = cache_dir is not None and _cached_for(cache_dir) == model_path
    if cached:
        try:
            return CachedTokenizer(cache_dir)
        except Exception:  # noqa: BLE001 - an odd saved tokenizer: transformers reads it below
            pass
    from transformers import AutoTokenizer  # heavy: only when there is no cache to read

    if cached:
        try:
            return AutoTokenizer.from_pretrained(cache_dir)
        except Exception:  # noqa: BLE001 - taken away as it was read (another run pruned it): the model's own
            pass
    if model_path.endswith(".gguf"):
        tok = _gguf_tokenizer(model_path)
    else:
        tok = AutoTokenizer.from_pretrained(model_path)
    if cache_dir is not None:
        _save_cache(tok, model_path, cache_dir)
    return tok


def _gguf_tokenizer(path: str) -> Any:
    """transformers reads a GGUF file's tokenizer (its ``tokenizer.ggml.*`` keys) only for the architectures
    it loads as models; Granite's and OLMo 2's files, which tokenmill serves, are read as any other."""
    from transformers import AutoTokenizer
    from transformers import modeling_gguf_pytorch_utils as gguf_utils

    folder, name = os.path.dirname(path), os.path.basename(path)
    try:
        return AutoTokenizer.from_pretrained(folder, gguf_file=name)
    except ValueError as e:
        arch = re.fullmatch(r"GGUF model with architecture (\S+) is not supported yet\.", str(e))
        if not arch:
            raise
    supported = gguf_utils.GGUF_SUPPORTED_ARCHITECTURES
    supported.append(arch[1])
    try:
        return AutoTokenizer.from_pretrained(folder, gguf_file=name)
    finally:
        supported.remove(arch[1])


def _cached_for(cache_dir: str) -> str | None:
    try:
        with open(os.path.join(cache_dir, _SOURCE_FILE)) as f:
            return f.read().strip()
    except OSError:
        return None


def _save_cache(tok: Any, model_path: str, cache_dir: str) -> None:
    """Save next to ``cache_dir`` and rename into place, so racing frontends never see half a cache."""
    parent = os.path.dirname(os.path.abspath(cache_dir))
    tmp = None
    try:
        os.makedirs(parent, exist_ok=True)
        tmp = tempfile.mkdtemp(prefix=".tokenizer-", dir=parent)
        tok.save_pretrained(tmp)
        with open(os.path.join(tmp, _SOURCE_FILE), "w") as f:
            f.write(model_path)
        if _cached_for(cache_dir) == model_path:
            return  # (another frontend saved it meanwhile: left as it is, for whoever reads it now)
        if os.path.isdir(cache_dir):
            shutil.rmtree(cache_dir, ignore_errors=True)
        os.rename(tmp, cache_dir)
        if parent == os.path.join(engine_cache_dir(), TOKENIZERS):
            _prune(parent)
    except OSError:
        pass  # another frontend won the race, or the dir is not writable: the cache is optional
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)


STALE = 24 * 3600  # seconds an entry for a model's older files is kept (another install may still read it)


def _prune(parent: str) -> None:
    """Drop the tokenizers kept across runs (``engine.cache_dir``) whose model is gone, and after a day those
    whose model has changed since (a newer one is saved under another name; an install with another transformers
    names the same files otherwise)."""
    for d in os.scandir(parent):
        source = None if d.name.startswith(".") else _cached_for(d.path)  # (not one being saved)
        if source is None or tokenizer_cache_dir(source) == d.path:
            continue
        if not os.path.exists(source) or d.stat().st_mtime < time.time() - STALE:
            shutil.rmtree(d.path, ignore_errors=True)


class CachedTokenizer:
    """What a frontend needs of a saved (``save_pretrained``) fast tokenizer, without transformers.

    The same calls as a transformers tokenizer (``encode``, ``decode``,
    ``apply_chat_template(..., tokenize=False)``, ``get_vocab``, ``len``,
    ``convert_tokens_to_ids`` and back; ``bos_token``, ``eos_token``, ``all_special_ids``), the
    same Rust tokenizer underneath, and the chat template rendered as
    transformers renders it (``tests/test_frontend_tokenizer.py`` pins both).
    """

    def __init__(self, folder: str) -> None:
        from tokenizers import Tokenizer

        self._tokenizer = Tokenizer.from_file(os.path.join(folder, "tokenizer.json"))
        # a tokenizer.json may set truncation or padding (cross-encoder exports do); transformers turns them off
        # unless a call asks, and so does this
        self._tokenizer.no_truncation()
        self._tokenizer.no_padding()
        with open(os.path.join(folder, "tokenizer_config.json")) as f:
            config = json.load(f)
        self.special_tokens = {k: v["content"] if isinstance(v, dict) else v
                               for k in _SPECIAL if isinstance(v := config.get(k), str | dict)}
        template = config.get("chat_template")
        path = os.path.join(folder, "chat_template.jinja")
        if template is None and os.path.exists(path):
            with open(path) as f:
                template = f.read()
        if not isinstance(template, str):  # absent, or a dict of named templates: leave those to transformers
            raise ValueError("no single chat template")
        self.chat_template = template
        self.bos_token, self.eos_token, self.unk_token = (self.special_tokens.get(k) for k in _SPECIAL[:3])
        self.eos_token_id = self._tokenizer.token_to_id(self.eos_token) if self.eos_token else None
        self.unk_token_id = self._tokenizer.token_to_id(self.unk_token) if self.unk_token else None
        # transformers' all_special_tokens: the named ones (a model's own names too), then the extra ones
        own = config.get("model_specific_special_tokens") or {}  # (as transformers saves them: image_token...)
        extra = config.get("extra_special_tokens", config.get("additional_special_tokens")) or []
        extra = [*extra.values()] if isinstance(extra, dict) else extra  # (a dict: a model's own names, as named)
        tokens = [t["content"] if isinstance(t, dict) else t
                  for t in [*self.special_tokens.values(), *own.values(), *extra]]
        self.all_special_tokens = list(dict.fromkeys(tokens))
        self.all_special_ids = self.convert_tokens_to_ids(self.all_special_tokens)

    @property
    def chat_template(self) -> str:
        return self._source

    @chat_template.setter
    def chat_template(self, template: str) -> None:
        self._template, self._source = compile_chat_template(template), template

    def __len__(self) -> int:
        return self._tokenizer.get_vocab_size(with_added_tokens=True)

    def get_vocab(self) -> dict[str, int]:
        return self._tokenizer.get_vocab(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def convert_tokens_to_ids(self, tokens: str | list[str]) -> int | None | list[int | None]:
        if isinstance(tokens, str):
            tid = self._tokenizer.token_to_id(tokens)
            return self.unk_token_id if tid is None else tid
        return [self.convert_tokens_to_ids(t) for t in tokens]

    def convert_ids_to_tokens(self, ids: int | list[int], skip_special_tokens: bool = False) -> str | None | list:
        if isinstance(ids, int):
            return self._tokenizer.id_to_token(ids)
        skip = set(self.all_special_ids) if skip_special_tokens else set()
        return [self._tokenizer.id_to_token(i) for i in ids if i not in skip]

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def encode_pair(self, first: str, second: str, max_length: int | None = None) -> list[int]:
        if max_length is None:
            return self._tokenizer.encode(first, second).ids
        return truncated_pair(self._tokenizer, first, second, max_length)

    def apply_chat_template(self, messages: list[dict], tokenize: bool = True, add_generation_prompt: bool = False,
                            tools: list[dict] | None = None, **kwargs: Any) -> str | list[int]:
        text = self._template.render(messages=messages, tools=tools, documents=None,
                                     add_generation_prompt=add_generation_prompt, **{**self.special_tokens, **kwargs})
        return self.encode(text, add_special_tokens=False) if tokenize else text


def compile_chat_template(template: str) -> Any:
    """A chat template in the environment transformers gives it: sandboxed, trim/lstrip blocks,
    loop controls, a ``tojson`` that does not escape HTML, ``raise_exception`` and ``strftime_now``."""
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
               sort_keys: bool = False) -> str:
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(template)  # a {% generation %} template fails here: transformers takes it
