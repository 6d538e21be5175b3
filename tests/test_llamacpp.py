"""llama.cpp's own API (``frontends.llamacpp``): ``/completion``, ``/infill``, ``/tokenize`` and ``/detokenize`` in
its shapes, ``/props``, ``/apply-template``, against ``tokenmill serve`` on a tiny random llama whose tokenizer
has Qwen2.5-Coder's FIM tokens. Greedy ``content`` equals ``/v1/completions``' text for the same prompt (whole,
streamed, several prompts, mixed prompts); the infill prompt is llama.cpp's layout token for token; answers
are compact JSON (llama.vim reads ``"content":"``), streams end without ``[DONE]``, errors are llama.cpp's."""

from __future__ import annotations

import functools
import json
import math

import pytest

from frontends.errors import ApiError
from frontends.llamacpp import LineLimits, LlamaCppApi, completion_body
from frontends.text import StopStrings, TextCodec, fim_tokens
from tests.conftest import http_call, make_tiny_model
from tests.test_server_e2e import Server

KEY = "sk-llama"
FIM = ["<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>"]


@pytest.fixture(scope="module")
def coder(tmp_path_factory, smollm_tokenizer_dir) -> str:
    """A tiny llama, SmolLM2's tokenizer with Qwen2.5-Coder's FIM tokens added (ids 49152-49157)."""
    from transformers import AutoTokenizer

    out = str(tmp_path_factory.mktemp("coder"))
    tok = AutoTokenizer.from_pretrained(smollm_tokenizer_dir)
    tok.add_special_tokens({"additional_special_tokens": FIM})
    tok_dir = str(tmp_path_factory.mktemp("coder_tokenizer"))
    tok.save_pretrained(tok_dir)
    return make_tiny_model(out, "llama", tok_dir, vocab_size=49160, max_position_embeddings=4096)


@pytest.fixture(scope="module")
def server(coder):
    s = Server("--model", coder, "--served-model-name", "coder", "--dtype", "float32", "--api-key", KEY,
               "--max-num-seqs", "8", startup=120)
    yield s
    s.close()


def call(server: Server, path: str, body: dict | None = None, key: str | None = KEY) -> tuple[int, bytes]:
    return http_call(server.port, path, body, key)[:2]


def post(server: Server, path: str, body: dict, want: int = 200):
    status, raw = call(server, path, body)
    assert status == want, raw
    return json.loads(raw)


def events(raw: bytes) -> list[dict]:
    text = raw.decode()
    assert text.endswith("\n\n") and "[DONE]" not in text
    return [json.loads(ev[len("data: "):]) for ev in text.split("\n\n") if ev]


def openai_text(server: Server, prompt, max_tokens: int) -> str:
    r = post(server, "/v1/completions", {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0})
    return r["choices"][0]["text"]


# ---------------------------------------------------------------------------- units


def test_fim_tokens_are_found_by_their_text():
    qwen = {t: i for i, t in enumerate(["a", *FIM])}
    assert fim_tokens(qwen) == {"pre": 1, "suf": 2, "mid": 3, "pad": 4, "rep": 5, "sep": 6}
    assert fim_tokens({"▁<PRE>": 7, "▁<SUF>": 8, "▁<MID>": 9}) == {"pre": 7, "suf": 8, "mid": 9}  # CodeLlama's
    assert fim_tokens({"<fim_prefix>": 1, "<fim_middle>": 2, "<fim_suffix>": 3, "<reponame>": 4}) == {
        "pre": 1, "mid": 2, "suf": 3, "rep": 4}  # StarCoder's, Granite's
    assert fim_tokens({"<|im_start|>": 1}) == {}


def test_bodies_become_completions():
    body = completion_body({"prompt": "x", "n_predict": 5, "temperature": -1, "top_k": -5, "repeat_penalty": 1.1,
                            "seed": -1, "stop": "END", "grammar": "", "json_schema": {"type": "object"},
                            "n_probs": 3, "typical_p": 1.0, "mirostat": 0, "dry_multiplier": 0, "model": "anything",
                            "cache_prompt": True, "id_slot": 2, "samplers": ["top_k"]}, {})
    assert body == {"temperature": 0.0, "top_k": 0, "repetition_penalty": 1.1, "repeat_last_n": 64, "stop": ["END"],
                    "json_schema": {"type": "object"}, "logprobs": 3, "typical_p": 1.0, "mirostat": 0,
                    "dry_multiplier": 0}
    # llama.cpp's samplers pass as they are (frontends.openai_params reads them as llama.cpp's server does)
    sampled = {"mirostat": 2, "mirostat_tau": 4, "dry_multiplier": 0.8, "dry_sequence_breakers": ["\n"],
               "xtc_probability": 0.5, "xtc_threshold": 0.2, "typical_p": 0.9, "top_n_sigma": 1.5,
               "dynatemp_range": 0.5, "dynatemp_exponent": 2, "dry_base": 2, "dry_allowed_length": 3,
               "dry_penalty_last_n": 64, "mirostat_eta": 0.2}
    assert completion_body(sampled, {}) == {**sampled, "repeat_last_n": 64}
    assert completion_body({"tfs_z": 1}, {}) == {"repeat_last_n": 64}
    assert completion_body({"grammar": "root ::= \"a\"", "json_schema": {}, "seed": 7, "stop": ["", "x"],
                            "repeat_last_n": -1}, {}) == {
        "grammar": "root ::= \"a\"", "seed": 7, "stop": ["x"], "repeat_last_n": -1}  # a grammar wins over a schema
    assert completion_body({"model": "sql"}, {"sql": "/adapters/sql"}) == {"model": "sql", "repeat_last_n": 64}
    with pytest.raises(ApiError, match="tfs_z 0.5 is not supported") as e:
        completion_body({"tfs_z": 0.5}, {})
    assert e.value.param == "tfs_z"
    with pytest.raises(ApiError, match="lora"):
        completion_body({"lora": [{"id": 0, "scale": 1.0}]}, {})


def test_the_infill_layout_leaves_room_for_n_predict_in_a_small_context():
    from types import SimpleNamespace

    vocab = {t: 100 + i for i, t in enumerate(FIM)}
    codec = SimpleNamespace(fim=fim_tokens(vocab), bos=[1], encode_literal=lambda text: [])  # (BOS: 1)
    codec.fim_prompt = functools.partial(TextCodec.fim_prompt, codec)
    api = LlamaCppApi(SimpleNamespace(codec=codec, max_model_len=64))
    prefix, suffix, extra = list(range(200, 300)), list(range(300, 400)), [([7], list(range(400, 500)))]
    for n_predict in (-1, 0, 1, 30):
        tokens = api._infill_prompt(prefix, suffix, [9], extra, n_predict, [8], [6], [5])
        assert len(tokens) == 64 - max(n_predict, 1)
        pre, suf = tokens.index(100), tokens.index(101)
        assert tokens[:pre] == [1] and tokens[pre + 1:suf] == [*prefix[len(prefix) - (suf - pre - 2):], 9]
        assert tokens[suf + 1:-1] == suffix[:16 - 3] and tokens[-1] == 102  # (a quarter of 64, less 2 and the prompt)
    # short code: the extra context's end, as much as llama.cpp's room beside a batch (the context less 64, plus 2)
    short = api._infill_prompt(prefix[:4], suffix[:4], [9], extra, 8, [8], [6], [5])
    assert short[:short.index(1)] == [105, 8] and short[short.index(1):] == [1, 100, *prefix[:4], 9, 101, *suffix[:4],
                                                                             102]


def test_sentencepiece_token_bytes_keep_a_word_s_space():
    from tokenizers import Tokenizer, decoders, models, normalizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"<0x{b:02X}>": 3 + b for b in range(256)}}
    for w in ("▁", "a", "▁a"):
        vocab[w] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[("▁", "a")], byte_fallback=True, unk_token="<unk>"))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])  # (Llama 2's and Mistral's)
    tok.add_special_tokens(["<s>", "</s>"])
    codec = TextCodec(PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>"))
    ids = codec.encode("a 😀", False)
    assert [codec.token_bytes(t) for t in ids] == [b" a", b" ", b"\xf0", b"\x9f", b"\x98", b"\x80"]
    assert codec.encode_literal("a</s>") != codec.encode("a</s>", False) and 2 not in codec.encode_literal("a</s>")


def feed_all(limits: LineLimits, pieces: list[str]) -> tuple[str, bool]:
    out = ""
    for p in pieces:
        text, hit = limits.feed(p)
        out += text
        if hit:
            return out, True
    return out + limits.flush(), False


def test_line_limits_end_a_completion_as_llama_cpp_does():
    code = "x = 1\n    if x:\n        y()\n  z()\n"
    whole = LineLimits(None, 4, 0)
    # the line indented less than 4 is cut after its indentation, as llama.cpp erases it
    assert feed_all(whole, [code]) == ("x = 1\n    if x:\n        y()\n  ", True)
    assert whole.limited and whole.matched is None
    # piece by piece, the indentation split across pieces: the same cut; the first line is never checked
    assert feed_all(LineLimits(None, 4, 0), list(code)) == ("x = 1\n    if x:\n        y()\n  ", True)
    assert feed_all(LineLimits(None, 2, 0), ["a\n", "  b\n", "  "]) == ("a\n  b\n  ", False)  # (nothing after)
    assert feed_all(LineLimits(None, 2, 0), ["a\n  b\n\n  c"]) == ("a\n  b\n", True)  # an empty line ends it too
    # a stop string inside the kept lines still ends it, as a word
    words = LineLimits(StopStrings(["y("]), 4, 0)
    assert feed_all(words, [code]) == ("x = 1\n    if x:\n        ", True)
    assert words.matched == "y(" and not words.limited
    # time is up (counted from the first token): only a token holding a newline ends it (it is kept)
    late = LineLimits(None, 0, 1e-9)
    assert late.feed("a") == ("a", False) and late.feed("b c") == ("b c", False)
    assert late.feed("d\ne") == ("d\ne", True) and late.limited


# ---------------------------------------------------------------------------- served


def test_completion_matches_the_openai_completion_and_is_compact(server):
    status, raw = call(server, "/completion", {"prompt": "def fibonacci(n):", "n_predict": 8, "temperature": 0,
                                               "return_tokens": True})
    assert status == 200 and raw.startswith(b'{"index":0,"content":"')  # compact, as llama.vim reads it
    r = json.loads(raw)
    assert r["content"] == openai_text(server, "def fibonacci(n):", 8)
    assert len(r["tokens"]) == r["tokens_predicted"] == 8 and r["stop"] is True and r["stop_type"] == "limit"
    assert r["tokens_evaluated"] == len(post(server, "/tokenize", {"content": "def fibonacci(n):",
                                                                   "add_special": True})["tokens"])
    assert r["prompt"] == "def fibonacci(n):" and r["model"] == "coder" and not r["truncated"]
    assert r["tokens_cached"] == r["tokens_evaluated"] + 8
    t = r["timings"]
    assert t["predicted_n"] == 8 and t["prompt_n"] + t["cache_n"] == r["tokens_evaluated"] and t["prompt_ms"] > 0
    assert r["generation_settings"]["n_predict"] == 8 and r["generation_settings"]["temperature"] == 0
    assert post(server, "/completions", {"prompt": "def fibonacci(n):", "n_predict": 8, "temperature": 0})[
        "content"] == r["content"]


def test_streamed_content_adds_up_and_ends_without_done(server):
    whole = post(server, "/completion", {"prompt": "import numpy", "n_predict": 12, "temperature": 0})
    status, raw = call(server, "/completion", {"prompt": "import numpy", "n_predict": 12, "temperature": 0,
                                               "stream": True, "n_probs": 2})
    assert status == 200
    evs = events(raw)
    parts, final = evs[:-1], evs[-1]
    assert all(not e["stop"] and e["index"] == 0 for e in parts) and final["stop"] is True
    assert "".join(e["content"] for e in parts) == whole["content"]
    assert sum(len(e["tokens"]) for e in parts) == 12 == final["tokens_predicted"]
    assert all(len(e["completion_probabilities"]) == len(e["tokens"]) for e in parts)
    assert final["content"] == "" and final["stop_type"] == "limit" and "completion_probabilities" not in final


def test_prompt_forms_several_prompts_and_mixed_ones(server):
    ids = post(server, "/tokenize", {"content": "class Stack:"})["tokens"]
    one = post(server, "/completion", {"prompt": "class Stack:", "n_predict": 4, "temperature": 0})
    both = post(server, "/completion", {"prompt": ["class Stack:", ids], "n_predict": 4, "temperature": 0})
    assert [r["index"] for r in both] == [0, 1] and both[0]["content"] == one["content"]
    assert both[1]["content"] == openai_text(server, ids, 4)
    mixed = post(server, "/completion", {"prompt": [*ids, " # push"], "n_predict": 4, "temperature": 0,
                                         "return_tokens": True})
    more = post(server, "/tokenize", {"content": " # push"})["tokens"]
    assert mixed["tokens_evaluated"] == len(ids) + len(more)
    assert mixed["content"] == openai_text(server, ids + more, 4)
    for n_predict in (-1, 100):  # to the end of the context: 6 tokens, truncated
        r = post(server, "/completion", {"prompt": [17] * 4090, "n_predict": n_predict, "ignore_eos": True})
        assert r["tokens_predicted"] == 6 and r["truncated"] and r["stop_type"] == "limit"
    short, long = post(server, "/completion", {"prompt": ["a", [17] * 4090], "n_predict": 20, "ignore_eos": True})
    assert (short["tokens_predicted"], short["truncated"]) == (20, False)  # each prompt to its own end
    assert (long["tokens_predicted"], long["truncated"]) == (6, True)
    n2 = post(server, "/completion", {"prompt": "x", "n_predict": 3, "n": 2, "temperature": 0})
    assert [r["index"] for r in n2] == [0, 1] and n2[0]["content"] == n2[1]["content"]


def test_probabilities_fields_and_next_token_only(server):
    r = post(server, "/completion", {"prompt": "for i in range(", "n_predict": 0, "n_probs": 3, "temperature": 0,
                                     "return_tokens": True})
    assert r["tokens_predicted"] == 1  # llama.cpp samples one token at n_predict 0
    (entry,) = r["completion_probabilities"]
    assert entry["id"] == r["tokens"][0] and len(entry["top_logprobs"]) == 3
    assert entry["top_logprobs"][0]["id"] == entry["id"] and entry["logprob"] <= 0  # greedy: the likeliest
    assert entry["bytes"] == list(entry["token"].encode())
    post_ = post(server, "/completion", {"prompt": "for i in range(", "n_predict": 0, "n_probs": 3, "temperature": 0,
                                         "post_sampling_probs": True})
    (p,) = post_["completion_probabilities"]
    assert math.isclose(p["prob"], math.exp(entry["logprob"]), rel_tol=1e-4) and len(p["top_probs"]) == 3
    assert post(server, "/completion", {"prompt": "x", "n_predict": 2, "response_fields": [
        "content", "timings/predicted_n", "nope/x"]}).keys() == {"content", "timings/predicted_n"}
    assert post(server, "/completion", {"prompt": "x", "n_predict": 0, "response_fields": [""]}) == {}
    # OpenAI's logprobs where n_probs is not given: a number of them, or (false, 1.0) none, as llama.cpp reads it
    assert "completion_probabilities" not in post(server, "/completion", {"prompt": "x", "n_predict": 1,
                                                                           "logprobs": False})


def test_stop_words_logit_bias_grammar_and_indentation(server):
    whole = post(server, "/completion", {"prompt": "while True:", "n_predict": 16, "temperature": 0,
                                         "return_tokens": True})
    text = whole["content"]
    stop = next(text[i:i + 2] for i in range(2, len(text) - 2) if text[i:i + 2].strip() == text[i:i + 2])
    cut = post(server, "/completion", {"prompt": "while True:", "n_predict": 16, "temperature": 0, "stop": [stop],
                                       "logprobs": 1})  # (OpenAI's name for n_probs, where that is not given)
    assert cut["content"] == text[:text.index(stop)] and cut["stop_type"] == "word" and cut["stopping_word"] == stop
    word_tokens = len(post(server, "/tokenize", {"content": stop})["tokens"])
    assert len(cut["completion_probabilities"]) == cut["tokens_predicted"] - word_tokens  # (less the stop word's)
    first = whole["tokens"][0]
    for bias in ([[first, False]], {str(first): False}, [[first, -100]]):
        r = post(server, "/completion", {"prompt": "while True:", "n_predict": 1, "temperature": 0,
                                         "return_tokens": True, "logit_bias": bias})
        assert r["tokens"] != [first], bias
    hello = post(server, "/tokenize", {"content": "Hello world"})["tokens"]
    r = post(server, "/completion", {"prompt": "x", "n_predict": 1, "logit_bias": [
        ["Hello world", False], ["99999999", 5], [5, True], [7, "x"], ["-3", 1], ["9" * 200, 1]]})
    nines = post(server, "/tokenize", {"content": "9" * 200})["tokens"]  # (no integer: a text)
    assert r["generation_settings"]["logit_bias"] == [*({"token": t, "bias": -100.0} for t in hello),
                                                      *({"token": t, "bias": 1.0} for t in dict.fromkeys(nines))]
    grammar = 'root ::= "a\\n" "  b\\n" "  c\\n" "d\\n"'
    held = post(server, "/completion", {"prompt": "x", "n_predict": 30, "grammar": grammar, "temperature": 0})
    assert held["content"] == "a\n  b\n  c\nd\n"
    block = post(server, "/completion", {"prompt": "x", "n_predict": 30, "grammar": grammar, "n_indent": 2})
    assert block["content"] == "a\n  b\n  c\n" and block["stop_type"] == "limit"
    assert post(server, "/completion", {"prompt": "x", "n_predict": 30, "grammar": grammar,
                                        "json_schema": {"type": "object"}})["content"] == held["content"]


def test_infill_builds_llamacpp_s_prompt(server):
    r = post(server, "/infill", {"input_prefix": "def add(a, b):\n    return ", "input_suffix": "\n\nprint(add(1, 2))",
                                 "input_extra": [{"filename": "util.py", "text": "X = 1\n"}], "prompt": "a",
                                 "n_predict": 6, "temperature": 0, "return_tokens": True})
    assert r["prompt"] == ("<|repo_name|>myproject\n<|file_sep|>util.py\nX = 1\n<|file_sep|>filename\n"
                           "<|fim_prefix|>def add(a, b):\n    return a<|fim_suffix|>\n\nprint(add(1, 2))<|fim_middle|>")
    pre, suf, mid, rep, sep = 49152, 49153, 49154, 49156, 49157

    def tok(text, literal=False):
        return post(server, "/tokenize", {"content": text, "parse_special": not literal})["tokens"]
    ids = [rep, *tok("myproject\n"), sep, *tok("util.py\n"), *tok("X = 1\n"), sep, *tok("filename\n"), pre,
           *tok("def add(a, b):\n    return "), *tok("a"), suf, *tok("\n\nprint(add(1, 2))"), mid]  # piece by piece
    assert r["tokens_evaluated"] == len(ids) and r["content"] == openai_text(server, ids, r["tokens_predicted"])
    # the code's own text stays text: a special token's name in it is no FIM token
    odd = post(server, "/infill", {"input_prefix": "s = '<|fim_middle|>'\n", "input_suffix": "<|endoftext|>",
                                   "n_predict": 1, "input_extra": [{"text": "<|file_sep|>"}]})
    assert odd["tokens_evaluated"] == len([rep, *tok("myproject\n"), sep, *tok("tmp\n"), *tok("<|file_sep|>", True),
                                           sep, *tok("filename\n"), pre, *tok("s = '<|fim_middle|>'\n", True), suf,
                                           *tok("<|endoftext|>", True), mid])
    # long code everywhere: the prefix's end, the suffix's start and the extra context's end, in the context with
    # room for n_predict (at least the one token of a cache-warming n_predict 0)
    code = "".join(f"def f{i}(x):\n    return x + {i}\n" for i in range(600))
    for n_predict, room in ((0, 1), (128, 128)):
        r = post(server, "/infill", {"input_prefix": code, "input_suffix": code, "input_extra": [{"text": code}] * 3,
                                     "n_predict": n_predict, "ignore_eos": True})
        assert r["tokens_evaluated"] == 4096 - room and r["tokens_predicted"] == room
    status, raw = call(server, "/infill", {"input_prefix": "x"})
    assert status == 400 and json.loads(raw) == {"error": {"code": 400, "message": "'input_suffix' is required",
                                                           "type": "invalid_request_error"}}
    # Ollama's suffix is this infill; its logprobs too, each token's own at top_logprobs 0 (n_probs 0 is none)
    body = {"model": "coder", "prompt": "def add(a, b):\n    return ", "suffix": "\n", "stream": False,
            "options": {"temperature": 0, "num_predict": 4}, "logprobs": True}
    for top in (0, 2):
        r = post(server, "/api/generate", {**body, "top_logprobs": top})
        assert len(r["logprobs"]) == r["eval_count"] and all(len(e.get("top_logprobs", ())) == top
                                                            for e in r["logprobs"])
        assert "".join(e["token"] for e in r["logprobs"]).startswith(r["response"])


def test_openai_s_suffix_fills_in_the_middle(server):
    """/v1/completions' ``suffix`` (OpenAI's, as code completion clients send it): the prompt before the gap and
    the suffix after it in the model's FIM layout, ``[BOS] <PRE> prompt <SUF> suffix <MID>``, read as code (a
    special token's name in it stays text), the FIM tokens that end an infill as stop tokens; plain, streamed,
    from token ids. A model without FIM tokens refuses it (``test_server_default_model``)."""
    import openai

    client = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)
    pre, suf, mid, pad = 49152, 49153, 49154, 49155
    bos = post(server, "/tokenize", {"prompt": "", "add_special_tokens": True})["tokens"]

    def code(text):
        return post(server, "/tokenize", {"content": text, "parse_special": False})["tokens"]
    prefix, suffix = "s = '<|fim_middle|>'\ndef add(a, b):\n    return ", "\n\nprint(add(1, 2))"
    ids = [*bos, pre, *code(prefix), suf, *code(suffix), mid]
    r = client.completions.create(model="coder", prompt=prefix, suffix=suffix, max_tokens=6, temperature=0,
                                  extra_body={"ignore_eos": True})
    assert r.usage.prompt_tokens == len(ids) and r.choices[0].text == openai_text(server, ids, r.usage.completion_tokens)
    streamed = client.completions.create(model="coder", prompt=prefix, suffix=suffix, max_tokens=6, temperature=0,
                                         stream=True, extra_body={"ignore_eos": True})
    assert "".join(c.choices[0].text for c in streamed if c.choices) == r.choices[0].text
    by_ids = client.completions.create(model="coder", prompt=code(prefix), suffix=suffix, max_tokens=6, temperature=0,
                                       extra_body={"ignore_eos": True})
    assert by_ids.usage.prompt_tokens == len(ids) - len(bos) and by_ids.choices[0].text == r.choices[0].text
    # <|fim_pad|> ends an infill, as in llama.cpp's: the token it samples first, made certain, stops it
    ended = client.completions.create(model="coder", prompt=prefix, suffix=suffix, max_tokens=6,
                                      logit_bias={str(pad): 100}, temperature=0)
    assert (ended.choices[0].finish_reason, ended.choices[0].text, ended.usage.completion_tokens) == ("stop", "", 1)
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="coder", prompt=prefix, suffix=suffix, echo=True, max_tokens=1)
    assert e.value.body["param"] == "echo"
    # the second review: the top of a file (no prompt) and its end ("" suffix) are gaps too
    for prompt, tail, want in (("", suffix, [*bos, pre, suf, *code(suffix), mid]),
                               ([], suffix, [*bos, pre, suf, *code(suffix), mid]),
                               (prefix, "", [*bos, pre, *code(prefix), suf, mid])):
        r = client.completions.create(model="coder", prompt=prompt, suffix=tail, max_tokens=1,
                                      extra_body={"return_token_ids": True})
        assert r.choices[0].prompt_token_ids == want
    with pytest.raises(openai.BadRequestError) as e:  # (named: not the prompt's length)
        client.completions.create(model="coder", prompt="a", suffix="word " * 5000, max_tokens=1)
    assert e.value.body["param"] == "suffix" and "the suffix has" in e.value.body["message"]


def test_tokenize_detokenize_props_and_apply_template(server):
    toks = post(server, "/tokenize", {"content": "Hello world"})
    assert toks == {"tokens": post(server, "/tokenize", {"prompt": "Hello world", "add_special_tokens": False})[
        "tokens"]}
    pieces = post(server, "/tokenize", {"content": "Hello world", "with_pieces": True})["tokens"]
    assert [p["id"] for p in pieces] == toks["tokens"] and "".join(p["piece"] for p in pieces) == "Hello world"
    assert post(server, "/tokenize", {"content": [*toks["tokens"], "<|fim_pad|>"]})["tokens"] == [*toks["tokens"],
                                                                                                  49155]
    literal = post(server, "/tokenize", {"content": "a<|fim_pad|>", "parse_special": False})["tokens"]
    assert 49155 not in literal and post(server, "/detokenize", {"tokens": literal})["content"] == "a<|fim_pad|>"
    emoji = post(server, "/tokenize", {"content": "😀 é", "with_pieces": True})["tokens"]
    assert b"".join(bytes(p["piece"]) if isinstance(p["piece"], list) else p["piece"].encode() for p in emoji) == \
        "😀 é".encode() and isinstance(emoji[0]["piece"], list)  # (a piece of a character: its bytes)
    de = post(server, "/detokenize", {"tokens": [*toks["tokens"], 49155]})
    assert de["content"] == de["prompt"] == "Hello world<|fim_pad|>"  # (vLLM's field: as its decode, review AA)
    status, raw = call(server, "/props")
    props = json.loads(raw)
    assert status == 200 and props["default_generation_settings"]["n_ctx"] == 4096 and props["total_slots"] == 8
    assert props["model_alias"] == "coder" and props["modalities"] == {"vision": False, "audio": False}
    assert "im_start" in props["chat_template"]
    shown = post(server, "/apply-template", {"messages": [{"role": "user", "content": "Hi"}]})
    assert shown["prompt"].endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")


@pytest.fixture(scope="module")
def hf_coder(coder):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(coder, torch_dtype="float32").eval()


def test_penalties_count_the_last_n_tokens_as_llama_cpp_s(server, hf_coder):
    """repeat_penalty, presence_penalty and frequency_penalty over the context's last ``repeat_last_n`` tokens
    (64 by default, -1 all, 0 none), the prompt's among them: greedy tokens equal transformers' greedy ones under
    llama.cpp's penalties sampler (tests.test_sampler's), step by step; ``/v1/completions`` reads it too."""
    import torch

    from tests.test_sampler import _llama_cpp_penalties

    prompt = "the cat sat on the mat, the cat sat on the mat, the cat"
    ids = post(server, "/tokenize", {"content": prompt, "add_special": True})["tokens"]
    pen = {"repeat_penalty": 1.8, "presence_penalty": 0.6, "frequency_penalty": 0.4}
    got = {}
    for last_n in (3, 64, -1, 0, None):
        body = {"prompt": prompt, "n_predict": 20, "temperature": 0, "return_tokens": True, "ignore_eos": True, **pen,
                **({} if last_n is None else {"repeat_last_n": last_n})}
        got[last_n] = post(server, "/completion", body)["tokens"]
        context = list(ids)
        with torch.no_grad():
            for _ in range(20):
                logits = hf_coder(torch.tensor([context])).logits[0, -1].tolist()
                logits = _llama_cpp_penalties(logits, context, 64 if last_n is None else last_n,
                                              pen["repeat_penalty"], pen["frequency_penalty"], pen["presence_penalty"])
                context.append(max(range(len(logits)), key=logits.__getitem__))
        assert got[last_n] == context[len(ids):], last_n
    assert len({tuple(t) for t in got.values()}) >= 3  # (the window matters)
    body = {"prompt": prompt, "n_predict": 20, "temperature": 0, "return_tokens": True, "ignore_eos": True, **pen}
    nulled = post(server, "/completion", {**body, "repeat_last_n": None})  # (null: the default, as llama.cpp)
    assert nulled["tokens"] == got[None] and nulled["generation_settings"]["repeat_last_n"] == 64
    whole = post(server, "/completion", {**body, "repeat_last_n": -1})["generation_settings"]
    assert whole["repeat_last_n"] == 4096 and whole["repeat_penalty"] == 1.8  # (-1: the context's size, as there)
    assert post(server, "/completion", {**body, "repeat_last_n": 0})["generation_settings"]["repeat_penalty"] == 1.8
    openai = post(server, "/v1/completions", {"prompt": ids, "max_tokens": 20, "temperature": 0, "repeat_last_n": 3,
                                              "repetition_penalty": 1.8, "presence_penalty": 0.6,
                                              "frequency_penalty": 0.4, "return_token_ids": True})
    assert openai["choices"][0]["token_ids"] == got[3]
    status, raw = call(server, "/completion", {"prompt": "x", "repeat_last_n": -2})
    assert status == 400 and "repeat_last_n must be -1" in json.loads(raw)["error"]["message"]


def test_refusals_in_llamacpp_s_shape(server):
    for body, words in (({"prompt": "x", "mirostat": 3}, "mirostat must be 0 (off), 1 or 2"),
                        ({"prompt": "x", "dry_sequence_breakers": []}, "dry_sequence_breakers must be a non-empty"),
                        ({"prompt": "x", "tfs_z": 0.9}, "tfs_z 0.9 is not supported"),
                        ({"prompt": "x", "dry_multiplier": 0.8, "dry_sequence_breakers": list("abcdefghijklmnopqrstuvwxyz")},
                         "token sequences in this model's vocabulary, more than 16384"),
                        ({"prompt": []}, "'prompt' must not be empty"),
                        ({"prompt": [1, 2.5]}, "must be a string, a list of token ids"),
                        ({"prompt": [1, 10**9]}, "Invalid token id"),
                        ({"prompt": "x", "n_probs": 99}, "n_probs must be in [0, 20]"),
                        ({"prompt": "x", "n_predict": 3, "min_tokens": 10}, "must not exceed n_predict (3)"),
                        ({"prompt": "x", "logit_bias": [["y" * 257, 1]]}, "at most 256 characters"),
                        ({"prompt": "x", "logit_bias": [[t, 1] for t in range(2049)]}, "at most 2048 entries"),
                        ({"prompt": "x", "logit_bias": {str(t): 1 for t in range(2049)}}, "at most 2048 entries"),
                        ):
        status, raw = call(server, "/completion", body)
        err = json.loads(raw)["error"]
        assert status == 400 and words in err["message"] and err["type"] == "invalid_request_error", raw
        assert err["code"] == 400 and set(err) == {"code", "message", "type"}
    assert post(server, "/completion", {"prompt": "x", "n_predict": 1, "model": ["not", "a", "name"]})["stop"]
    status, raw = call(server, "/tokenize", {"content": [17] * 131073, "with_pieces": True})
    assert status == 400 and "at most 131072 tokens" in json.loads(raw)["error"]["message"]
    assert json.loads(raw)["error"]["code"] == 400  # (llama.cpp's body: its shape; review: OpenAI's was given)
    status, raw = call(server, "/tokenize", {"content": 5})
    assert status == 400 and set(json.loads(raw)["error"]) == {"code", "message", "type"}
    assert len(post(server, "/tokenize", {"content": [17] * 5000, "with_pieces": True})["tokens"]) == 5000
    status, raw = call(server, "/completion", {"prompt": [17] * 4096})
    assert status == 400 and json.loads(raw) == {"error": {
        "code": 400, "message": "the request exceeds the available context size, try increasing it",
        "type": "exceed_context_size_error", "n_prompt_tokens": 4096, "n_ctx": 4096}}
    status, raw = call(server, "/completion", {"prompt": "x"}, key=None)
    assert status == 401 and json.loads(raw)["error"]["type"] == "authentication_error"



def test_bench_serving_streams_from_completion(server):
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    r = subprocess.run([sys.executable, os.path.join(root, "tools", "bench_serving.py"), "--base-url",
                        server.url + "/v1", "--endpoint", "llamacpp", "--api-key", KEY, "--num-prompts", "4",
                        "--input-len", "16", "--output-len", "8", "--max-concurrency", "2", "--quiet"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    result = json.loads(r.stdout.strip().splitlines()[-1])
    assert result["endpoint"] == "llamacpp" and result["completed"] == 4 and result["failed"] == 0
    assert result["total_output_tokens"] == 4 * 8 and result["ttft_ms"]["median"] > 0  # (ignore_eos)


def test_dry_is_llama_cpps_over_the_served_context(server, hf_coder, coder):
    """DRY with llama.cpp's default breakers: greedy tokens equal transformers' greedy ones with DRY's penalties
    (``tests.test_sampler_llamacpp``'s definition) over the prompt and output, step by step; the settings as
    llama.cpp shows them."""
    import torch
    from transformers import AutoTokenizer

    from tests.test_sampler_llamacpp import _dry_reference

    prompt = "the cat sat on the mat, the cat sat on the mat, the cat"
    ids = post(server, "/tokenize", {"content": prompt, "add_special": True})["tokens"]
    dry = {"dry_multiplier": 3.0, "dry_base": 1.75, "dry_allowed_length": 1}
    body = {"prompt": prompt, "n_predict": 16, "temperature": 0, "return_tokens": True, "ignore_eos": True}
    got = post(server, "/completion", {**body, **dry})
    plain = post(server, "/completion", body)["tokens"]
    breakers = TextCodec(AutoTokenizer.from_pretrained(coder)).dry_breakers(("\n", ":", "\"", "*"))
    context = list(ids)
    with torch.no_grad():
        for _ in range(16):
            logits = hf_coder(torch.tensor([context])).logits[0, -1]
            for tok, pen in _dry_reference(context, breakers, 3.0, 1.75, 1).items():
                logits[tok] -= pen
            context.append(int(logits.argmax()))
    assert got["tokens"] == context[len(ids):] and got["tokens"] != plain
    settings = got["generation_settings"]
    assert settings["dry_multiplier"] == 3.0 and settings["dry_penalty_last_n"] == 4096  # (-1: the context's size)
    assert settings["dry_sequence_breakers"] == ["\n", ":", "\"", "*"] and settings["samplers"][:3] == [
        "penalties", "dry", "temperature"]
    props = call(server, "/props")[1]
    assert json.loads(props)["default_generation_settings"]["params"]["xtc_threshold"] == 0.1


def test_llama_cpps_samplers_on_the_openai_endpoints(server):
    """The official openai client sends them as extra fields: a seed gives the same text again, another seed
    another; a bad value is a 400 naming it."""
    import openai

    client = openai.OpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key=KEY, max_retries=0)
    extra = {"xtc_probability": 0.5, "xtc_threshold": 0.05, "mirostat": 2, "mirostat_tau": 3.0, "top_n_sigma": 2.0,
             "dry_multiplier": 0.8, "dry_sequence_breakers": ["\n", "."], "typical_p": 0.9, "dynatemp_range": 0.3}

    def chat(seed, **more):
        return client.chat.completions.create(model="coder", messages=[{"role": "user", "content": "Hi"}],
                                              max_tokens=12, seed=seed, extra_body={**extra, **more})

    first = chat(1).choices[0].message.content
    assert chat(1).choices[0].message.content == first
    assert chat(1, dry_sequence_breakers='["\\n", "."]').choices[0].message.content == first  # (as JSON, as llama.cpp)
    assert client.completions.create(model="coder", prompt="Hello", max_tokens=8, seed=2,
                                     extra_body=extra).choices[0].text
    with pytest.raises(openai.BadRequestError) as e:  # DRY moves the logprobs beams are ranked by
        client.completions.create(model="coder", prompt="Hello", max_tokens=4, n=2,
                                  extra_body={"use_beam_search": True, "dry_multiplier": 0.8})
    assert e.value.body["param"] == "dry_multiplier"
    for bad, param in (({"mirostat_eta": -1}, "mirostat_eta"), ({"dry_sequence_breakers": "[oops"}, "dry_sequence_breakers"),
                       ({"dry_sequence_breakers": "{}"}, "dry_sequence_breakers")):
        with pytest.raises(openai.BadRequestError) as e:
            chat(1, **bad)
        assert e.value.body["param"] == param
