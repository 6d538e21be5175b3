"""The tokenizer cache: what transformers read once, every later load reads without it, identically."""

from __future__ import annotations

import shutil
import subprocess
import sys

import pytest

from frontends.tokenizer import CachedTokenizer, load_tokenizer
from tools.fake_engine import ROOT

TEXTS = ["Hello, world!", "  spaces\n\tand tabs", "中文 and emoji 🎉", "<|im_start|>user\nhi<|im_end|>", ""]
CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Count to five."}],
    [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"},
     {"role": "user", "content": "Tell me a story about a dragon. {{ not a template }}"}],
]
# the environment transformers gives templates: loop controls, tojson without HTML escaping, namespaces
TEMPLATE = ("{% set ns = namespace(n=0) %}{% for m in messages %}{% if m.role == 'system' %}{% continue %}{% endif %}"
            "{% set ns.n = ns.n + 1 %}[{{ ns.n }}] {{ m | tojson }}\n{% endfor %}"
            "{% if add_generation_prompt %}{{ bos_token }}assistant{% endif %}")


@pytest.fixture(scope="module")
def pair(tmp_path_factory, smollm_tokenizer_dir):
    cache = str(tmp_path_factory.mktemp("tok") / "cache")
    hf = load_tokenizer(smollm_tokenizer_dir, cache)  # reads with transformers, saves the cache
    cached = load_tokenizer(smollm_tokenizer_dir, cache)
    assert isinstance(cached, CachedTokenizer) and not isinstance(hf, CachedTokenizer)
    return hf, cached, cache


def test_cached_tokenizer_encodes_and_decodes_as_transformers(pair):
    hf, cached, _ = pair
    assert len(cached) == len(hf) and cached.get_vocab() == hf.get_vocab()
    assert cached.eos_token_id == hf.eos_token_id
    for text in TEXTS:
        for special in (True, False):
            ids = hf.encode(text, add_special_tokens=special)
            assert cached.encode(text, add_special_tokens=special) == ids, text
            for skip in (True, False):
                assert cached.decode(ids, skip_special_tokens=skip) == hf.decode(ids, skip_special_tokens=skip)


@pytest.mark.parametrize("gen", [True, False])
def test_cached_chat_template_renders_as_transformers(pair, gen):
    hf, cached, _ = pair
    for msgs in CONVERSATIONS:
        want = hf.apply_chat_template(msgs, tokenize=False, add_generation_prompt=gen)
        assert cached.apply_chat_template(msgs, tokenize=False, add_generation_prompt=gen) == want
        assert cached.apply_chat_template(msgs, add_generation_prompt=gen) == hf.encode(want, add_special_tokens=False)


@pytest.mark.parametrize("extra", [None, ["<image>"], {"image_token": "<image>"}])
def test_cached_special_tokens_and_token_lookups_as_transformers(smollm_tokenizer_dir, tmp_path, extra):
    """What the frontends ask of a tokenizer besides text: special tokens and ids (TGI's, llama.cpp's /props),
    tokens to ids and back (the Responses API's thinking end, ``token_strs``); with extra special tokens as a list
    (transformers 4's ``additional_special_tokens``) and as a model's own names."""
    from transformers import AutoTokenizer

    folder = str(tmp_path / "tok")
    hf = AutoTokenizer.from_pretrained(smollm_tokenizer_dir, **({} if extra is None else {"extra_special_tokens": extra}))
    hf.save_pretrained(folder)
    hf = AutoTokenizer.from_pretrained(folder)
    cached = CachedTokenizer(folder)
    for name in ("bos_token", "eos_token", "unk_token", "eos_token_id", "unk_token_id", "all_special_tokens",
                 "all_special_ids"):
        assert getattr(cached, name) == getattr(hf, name), name
    assert extra is None or "<image>" in cached.all_special_tokens
    tokens = ["<|im_end|>", "Hello", "<image>", "not a token at all", "\u0120the"]
    assert cached.convert_tokens_to_ids(tokens) == hf.convert_tokens_to_ids(tokens)
    assert cached.convert_tokens_to_ids(tokens[0]) == hf.convert_tokens_to_ids(tokens[0])
    ids = hf.encode("<|im_start|>user\nHello <image> world<|im_end|>", add_special_tokens=True)
    for skip in (False, True):
        assert cached.convert_ids_to_tokens(ids, skip_special_tokens=skip) == hf.convert_ids_to_tokens(ids, skip)
    assert cached.convert_ids_to_tokens(ids[1]) == hf.convert_ids_to_tokens(ids[1])


def test_template_environment_matches_transformers(pair, tmp_path):
    from transformers import AutoTokenizer

    _, _, cache = pair
    folder = tmp_path / "custom"
    shutil.copytree(cache, folder)
    (folder / "chat_template.jinja").write_text(TEMPLATE)
    hf, cached = AutoTokenizer.from_pretrained(folder), CachedTokenizer(str(folder))
    msgs = [*CONVERSATIONS[1], {"role": "user", "content": "<b>é</b> \"quoted\""}]
    assert cached.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True) == \
        hf.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)


def test_loading_the_cache_imports_neither_transformers_nor_torch(pair, smollm_tokenizer_dir):
    _, _, cache = pair
    code = ("import sys; from frontends.tokenizer import load_tokenizer, CachedTokenizer\n"
            f"tok = load_tokenizer({smollm_tokenizer_dir!r}, {cache!r})\n"
            "assert isinstance(tok, CachedTokenizer)\n"
            "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]"


def test_a_cache_for_another_model_is_replaced(smollm_tokenizer_dir, tmp_path):
    cache = str(tmp_path / "cache")
    load_tokenizer(smollm_tokenizer_dir, cache)
    other = shutil.copytree(smollm_tokenizer_dir, tmp_path / "other-model")
    assert not isinstance(load_tokenizer(str(other), cache), CachedTokenizer)  # read from its own folder...
    assert isinstance(load_tokenizer(str(other), cache), CachedTokenizer)  # ...and cached for next time
    assert not isinstance(load_tokenizer(smollm_tokenizer_dir, cache), CachedTokenizer)


def test_a_chat_template_given_replaces_the_models_loaded_or_cached(tmp_path, smollm_tokenizer_dir):
    cache = str(tmp_path / "cache")
    first = load_tokenizer(smollm_tokenizer_dir, cache, "X{{ messages[-1]['content'] }}Y")  # transformers, then saved
    again = load_tokenizer(smollm_tokenizer_dir, cache, "A{{ messages[-1]['content'] }}B")  # from the cache
    assert isinstance(again, CachedTokenizer) and not isinstance(first, CachedTokenizer)
    hi = [{"role": "user", "content": "hi"}]
    assert first.apply_chat_template(hi, tokenize=False) == "XhiY"
    assert again.apply_chat_template(hi, tokenize=False) == "AhiB"
    assert "<|im_start|>" in load_tokenizer(smollm_tokenizer_dir, cache).apply_chat_template(hi, tokenize=False)


def test_cached_pairs_as_transformers_and_ignores_a_saved_truncation(pair, tmp_path):
    """Pairs (a cross-encoder's query and document) encode as transformers pairs them, truncated alike
    (``longest_first``); a tokenizer.json that sets truncation or padding is read as transformers reads
    it: not applied unless a call asks."""
    import json
    import shutil
    import time

    from frontends.text import TextCodec

    hf, cached, cache = pair
    long = "the cat sat on the mat " * 40
    for a, b in (("Where do cats sleep?", "In boxes."), (TEXTS[0], TEXTS[-1]), (long, "short one"),
                 ("short one", long), (long, long[:-30])):
        assert cached.encode_pair(a, b) == hf(a, b)["input_ids"]
        for k in (1, 5, 6, 11, 17, 64):  # (odd ones: which text is the longer decides the last token)
            want = hf(a, b, truncation="longest_first", max_length=k)["input_ids"]
            assert cached.encode_pair(a, b, k) == want == TextCodec(hf).encode_pair(a, b, k), (a, b, k)
    digits = "0123456789" * 2000  # (a truncating tokenizer that tries every window takes seconds on these)
    start = time.perf_counter()
    assert len(cached.encode_pair(digits, digits, 1)) == 1
    assert time.perf_counter() - start < 1.0
    folder = tmp_path / "truncating"
    shutil.copytree(cache, folder)
    with open(folder / "tokenizer.json") as f:
        spec = json.load(f)
    spec["truncation"] = {"direction": "Right", "max_length": 4, "strategy": "LongestFirst", "stride": 0}
    with open(folder / "tokenizer.json", "w") as f:
        json.dump(spec, f)
    text = "one two three four five six seven"
    assert CachedTokenizer(str(folder)).encode(text) == hf.encode(text)


def test_a_tokenizer_is_kept_across_runs_until_its_files_change(tmp_path, monkeypatch, smollm_tokenizer_dir):
    """The launcher's cache (``engine.cache_dir``): a folder per model as its files are; an edited template
    reads the folder afresh; the cache of a model gone is dropped as another is saved, that of its old files a day
    later (another install, with another transformers, may read the same files under another name)."""
    import os
    import time

    from engine.cache_dir import tokenizer_cache_dir
    from frontends.tokenizer import STALE

    monkeypatch.setenv("TOKENMILL_CACHE_DIR", str(tmp_path / "cache"))
    model, gone = (shutil.copytree(smollm_tokenizer_dir, tmp_path / name) for name in ("model", "gone"))
    first = tokenizer_cache_dir(str(model))
    assert first == tokenizer_cache_dir(str(model)) != tokenizer_cache_dir(str(gone))
    assert tokenizer_cache_dir(str(tmp_path / "nowhere")) is None
    assert not isinstance(load_tokenizer(str(gone), tokenizer_cache_dir(str(gone))), CachedTokenizer)
    shutil.rmtree(gone)
    assert not isinstance(load_tokenizer(str(model), first), CachedTokenizer)  # (the next run's start...)
    assert os.listdir(os.path.dirname(first)) == [os.path.basename(first)]  # (...drops the one of "gone")
    assert isinstance(load_tokenizer(str(model), tokenizer_cache_dir(str(model))), CachedTokenizer)

    (model / "chat_template.jinja").write_text("<{{ messages[-1]['content'] }}>")
    edited = tokenizer_cache_dir(str(model))
    assert edited != first
    tok = load_tokenizer(str(model), edited)
    assert not isinstance(tok, CachedTokenizer)
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False) == "<hi>"
    assert sorted(os.listdir(os.path.dirname(first))) == sorted(map(os.path.basename, (first, edited)))
    os.utime(first, (0, time.time() - 2 * STALE))  # (the old files' entry: a day old, dropped as the next is saved)
    shutil.rmtree(edited)
    load_tokenizer(str(model), edited)
    assert os.listdir(os.path.dirname(first)) == [os.path.basename(edited)]
    cached = load_tokenizer(str(model), tokenizer_cache_dir(str(model)))
    assert isinstance(cached, CachedTokenizer)
    assert cached.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False) == "<hi>"


def test_a_served_models_tokenizer_is_kept_in_the_cache_folder(tiny_server, tiny_llama):
    import os

    from engine.cache_dir import tokenizer_cache_dir
    from frontends.tokenizer import _cached_for

    assert _cached_for(tokenizer_cache_dir(tiny_llama)) == os.path.abspath(tiny_llama)
