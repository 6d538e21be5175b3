"""Detokenizing token by token and stop strings, with SmolLM2's real tokenizer."""

from __future__ import annotations

import random

import pytest

from frontends.text import IncrementalDetokenizer, StopMatcher, StopStrings, TextCodec
from frontends.tokenizer import load_tokenizer


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


def byte_fallback_codec() -> TextCodec:
    """A SentencePiece vocabulary with byte fallback, decoded as Llama 2's and Mistral's are: an unfinished
    character is a U+FFFD per byte."""
    from tokenizers import Tokenizer, decoders, models, normalizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"<0x{b:02X}>": 3 + b for b in range(256)}}
    for w in ("▁", "a", "▁a", "b", "▁b"):
        vocab[w] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[("▁", "a"), ("▁", "b")], byte_fallback=True, unk_token="<unk>"))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    tok.add_special_tokens(["<s>", "</s>"])
    return TextCodec(PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>"))


@pytest.mark.parametrize("step", [1, 3])
@pytest.mark.parametrize("vocab", ["byte-level", "byte fallback"])
def test_a_prompt_cut_inside_a_character_has_it_finished_by_the_output(codec, vocab, step):
    """Token ids may end a prompt inside a character: the output tokens that finish it give it whole, and what
    follows is read from before it (SentencePiece's decoder reads bytes from inside one as U+FFFDs). A character
    left broken, or a U+FFFD of the prompt's own, stays the prompt's."""
    codec = codec if vocab == "byte-level" else byte_fallback_codec()
    text = "Hello ꙮ and 🎉 done" if vocab == "byte-level" else "a 中文 b 😀 a é"
    ids = codec.encode(text, add_special_tokens=False)
    cuts = [k for k in range(1, len(ids)) if codec.decode(ids[:k]).endswith("\ufffd")]
    assert len(cuts) >= 2  # (inside each of the characters)
    for k in range(1, len(ids)):
        detok = IncrementalDetokenizer(codec, prompt_ids=ids[:k])
        pieces = [detok.step(ids[i:i + step]) for i in range(k, len(ids), step)] + [detok.flush()]
        assert codec.decode(ids[:k]).rstrip("\ufffd") + "".join(pieces) == codec.decode(ids), k
        assert not any("\ufffd" in p for p in pieces)
    world = codec.encode(" a", add_special_tokens=False)
    for prompt in (ids[:cuts[0]], codec.encode("abc\ufffd", add_special_tokens=False)):
        detok = IncrementalDetokenizer(codec, prompt_ids=prompt)
        assert detok.step(world) + detok.flush() == codec.decode(prompt + world)[len(codec.decode(prompt)):]


@pytest.mark.parametrize("broken", ["one", "per byte"])
def test_a_character_finished_by_the_output_whatever_the_decoder_writes_for_its_start(broken):
    """A decoder writes an unfinished character as one U+FFFD (byte-level BPE, Python's) or one per byte
    (SentencePiece's byte fallback); a U+FFFD of the prompt's own before it stays the prompt's."""
    from types import SimpleNamespace

    def decode(ids, _skip):
        if broken == "one":
            return bytes(ids).decode("utf-8", "replace")
        return "".join("\ufffd" if "\udc80" <= ch <= "\udcff" else ch
                       for ch in bytes(ids).decode("utf-8", "surrogateescape"))

    codec, char = SimpleNamespace(_decode=decode), list("ꙮ".encode())
    for head in ("Hi ", "Hi \ufffd"):
        detok = IncrementalDetokenizer(codec, prompt_ids=list(head.encode()) + char[:2])
        assert detok.step(char[2:]) + detok.step(list(b" x")) + detok.flush() == "ꙮ x"
        detok = IncrementalDetokenizer(codec, prompt_ids=list(head.encode()) + char[:1])
        assert detok.step(char[1:2]) == "" and detok.step(char[2:]) == "ꙮ"


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


@pytest.mark.parametrize("skip", [True, False])
def test_the_token_that_ends_a_choice_is_no_text(codec, skip):
    """An EOS, or a stop token id (here an ordinary word), that ends the output is left out, with or
    without special tokens (vLLM's ``skip_special_tokens``); special tokens before it are kept if asked."""
    from engine.protocol import Delta
    from frontends.generation import Choice

    hi, word = codec.encode("Hi", add_special_tokens=False), codec.encode(" there", add_special_tokens=False)
    eos, start = codec.tokenizer.eos_token_id, codec.encode("<|im_start|>", add_special_tokens=False)
    choice = Choice(0, "r", [], codec, None, eos_ids=frozenset({eos}), skip_special_tokens=skip)
    text, _ = choice.consume(Delta("r", hi + start + hi, None))
    assert text + choice.consume(Delta("r", [eos], "stop"))[0] == ("HiHi" if skip else "Hi<|im_start|>Hi")
    choice = Choice(0, "r", [], codec, None, eos_ids=frozenset({eos}), skip_special_tokens=skip)
    text, _ = choice.consume(Delta("r", hi + word, "stop", stop_reason=word[-1]))
    assert text == "Hi" + codec.decode(word[:-1])


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
    assert s.feed("zabc") == ("za", True) and s.matched == "b"  # the first one completed wins
    s = StopStrings(["bc", "abc"])
    assert s.feed("zabc") == ("z", True) and s.matched == "abc"  # of those ending together, the longest


def _first_completed(text: str, stops: list[str]) -> tuple[str, str | None]:
    """The spec, by brute force: the shortest prefix that ends with a stop string (the longest one)."""
    for end in range(1, len(text) + 1):
        done = [s for s in stops if text[:end].endswith(s)]
        if done:
            s = max(done, key=len)
            return text[:end - len(s)], s
    return text, None


def test_stop_strings_match_the_spec_however_the_text_is_chunked():
    rng = random.Random(7)
    for _ in range(2000):
        stops = ["".join(rng.choice("abc") for _ in range(rng.randint(1, 4))) for _ in range(rng.randint(1, 4))]
        text = "".join(rng.choice("abcd") for _ in range(rng.randint(0, 24)))
        matcher = StopMatcher(stops)
        s = StopStrings(matcher)
        out, hit, i = "", False, 0
        while i < len(text) and not hit:
            k = rng.randint(1, 5)
            piece, hit = s.feed(text[i:i + k])
            out, i = out + piece, i + k
        if not hit:
            out += s.flush()
        assert (out, s.matched if hit else None) == _first_completed(text, stops), (stops, text)


def test_stop_string_straddling_min_tokens():
    s = StopStrings(["STOP"])
    assert s.feed("xxST", check=False) == ("xx", False)  # before min_tokens a possible start is held too...
    assert s.feed("OP and on") == ("", True) and s.matched == "STOP"  # ...so one completed after it is cut
    s = StopStrings(["STOP"])
    assert s.feed("a STOP b", check=False) == ("a STOP b", False)  # completed before min_tokens: ignored
    assert s.feed(" more") == (" more", False)


def test_long_stop_strings_are_held_until_they_complete():
    stops = [f"{i:04d}" + "z" * 1000 for i in range(64)]
    s = StopStrings(stops)
    for ch in "0001" + "z" * 999:
        out, hit = s.feed(ch)
        assert not hit and out == ""  # all of it could still become a stop string: held
    assert s.feed("z") == ("", True) and s.matched == stops[1]


def test_chat_template(codec):
    ids = codec.apply_chat_template([{"role": "system", "content": "S"}, {"role": "user", "content": "hi"}])
    text = codec.decode(ids, skip_special_tokens=False)
    assert "<|im_start|>system\nS" in text and text.endswith("<|im_start|>assistant\n")


def test_a_final_assistant_message_can_be_continued(codec):
    """vLLM's continue_final_message (Anthropic's prefill): the prompt ends inside the last message."""
    chat = [{"role": "user", "content": "Count to five."}, {"role": "assistant", "content": "1, 2, 3,"}]
    text = codec.decode(codec.apply_chat_template(chat, False, continue_final=True), skip_special_tokens=False)
    assert text.endswith("<|im_start|>assistant\n1, 2, 3,")
    closed = codec.decode(codec.apply_chat_template(chat, False), skip_special_tokens=False)
    assert closed.startswith(text) and closed.endswith("<|im_end|>\n")
    with pytest.raises(ValueError, match="nothing to continue"):
        codec.apply_chat_template([{"role": "user", "content": "x"}, {"role": "assistant", "content": "   "}], False,
                                  continue_final=True)


def test_a_tokens_text_is_decoded_once(smollm_tokenizer_dir):
    """Logprobs name the same tokens over and over (a stream's top 20, twice a token in chat): each
    vocabulary token's text is decoded once, then kept; an id past the vocabulary is never kept."""
    codec = TextCodec(load_tokenizer(smollm_tokenizer_dir))
    decoded = []
    decode = codec._decode
    codec._decode = lambda ids, skip: decoded.append(ids) or decode(ids, skip)
    hello = codec.encode("Hello", add_special_tokens=False)[0]
    assert codec.token_text(hello) == codec.token_text(hello) == decode([hello], False) == "Hello"
    assert decoded == [[hello]]
    assert codec.token_utf8(hello) is codec.token_utf8(hello) and codec.token_utf8(hello) == list(b"Hello")
    assert codec.token_bytes(hello) is codec.token_bytes(hello) == b"Hello"  # (llama.cpp's n_probs)
    past = codec.vocab_size + 5
    codec.token_text(past), codec.token_text(past)
    assert decoded == [[hello], [past], [past]]
    parts = codec.encode("世", add_special_tokens=False)  # a character in two tokens: each has its own bytes
    assert len(parts) == 2 and {codec.token_text(t) for t in parts} == {"\ufffd"}
    assert sum((codec.token_utf8(t) for t in parts), []) == list("世".encode())
    tok = load_tokenizer(smollm_tokenizer_dir)
    tok.add_tokens(["<café>"])  # an added token's entry is its text, not GPT-2's byte characters (é is 0xE9 there)
    assert TextCodec(tok).token_bytes(tok.convert_tokens_to_ids("<café>")) == "<café>".encode()
