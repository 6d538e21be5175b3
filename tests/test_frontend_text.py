"""Detokenizing token by token and stop strings, with SmolLM2's real tokenizer."""

from __future__ import annotations

import pytest

from frontends.text import IncrementalDetokenizer, StopStrings, TextCodec, load_tokenizer


@pytest.fixture(scope="module")
def codec(smollm_tokenizer_dir):
    return TextCodec(load_tokenizer(smollm_tokenizer_dir))


@pytest.mark.parametrize("text", ["Hello, world! How are you?", "中文测试 and 日本語", "emoji 🎉🚀 done", "  spaces\n\tnew"])
def test_token_by_token_matches_decode_and_never_breaks_utf8(codec, text):
    ids = codec.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(codec, prompt_ids=codec.encode("Say:", add_special_tokens=False))
    pieces = [detok.step([t]) for t in ids]
    pieces.append(detok.flush())
    assert "".join(pieces) == codec.decode(ids)
    assert not any("\ufffd" in p for p in pieces)


def test_multi_token_steps(codec):
    text = "中文 🎉 streaming in bigger steps"
    ids = codec.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(codec)
    pieces = [detok.step(ids[i:i + 3]) for i in range(0, len(ids), 3)] + [detok.flush()]
    assert "".join(pieces) == text


def test_special_tokens_skipped(codec):
    detok = IncrementalDetokenizer(codec)
    eos = codec.tokenizer.eos_token_id
    out = detok.step(codec.encode("Hi", add_special_tokens=False)) + detok.step([eos]) + detok.flush()
    assert out == "Hi"


def test_stop_strings():
    s = StopStrings(["STOP", "end."])
    assert s.feed("hello ST") == ("hello ", False)  # "ST" could start STOP: held
    assert s.feed("ART") == ("START", False)  # no tail of "START" begins a stop string
    assert s.feed(" the en") == (" the ", False)
    assert s.feed("d. more") == ("", True)
    s = StopStrings(["abc"])
    assert s.feed("xxab") == ("xx", False)
    assert s.flush() == "ab"
    s = StopStrings(["b", "abc"])
    assert s.feed("zabc") == ("z", True)  # the match that starts first wins ("abc", not "b")


def test_tokenizer_cache_dir(tmp_path, smollm_tokenizer_dir):
    cache = str(tmp_path / "cache")
    first = load_tokenizer(smollm_tokenizer_dir, cache)
    second = load_tokenizer(smollm_tokenizer_dir, cache)
    assert (tmp_path / "cache" / "tokenmill_source.txt").read_text() == smollm_tokenizer_dir
    assert first.encode("hello") == second.encode("hello")


def test_chat_template(codec):
    ids = codec.apply_chat_template([{"role": "system", "content": "S"}, {"role": "user", "content": "hi"}])
    text = codec.decode(ids, skip_special_tokens=False)
    assert "<|im_start|>system\nS" in text and text.endswith("<|im_start|>assistant\n")
