"""Beam search (``engine.beam_search``): transformers' ``generate(num_beams=k)`` sequence for sequence (fp32),
offline (``LLM.beam_search``) and served (``use_beam_search``)."""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from engine import LLM, BeamSearchParams
from engine.beam_search import BeamSearch
from tests.conftest import TINY_KEY

PROMPTS = ["The quick brown fox jumps over the lazy dog because", "def fibonacci(n):\n    "]


@pytest.fixture(scope="module")
def llm(tiny_llama):
    return LLM(tiny_llama, device="cpu", dtype="float32", num_kv_blocks=512, max_model_len=256)


@pytest.fixture(scope="module")
def hf(tiny_llama):
    return AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()


def hf_beams(hf, ids: list[int], k: int, n: int, end: int, **kw) -> list[tuple[list[int], float]]:
    """transformers' k best sequences (generated tokens up to and with ``end``) and their scores."""
    out = hf.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long), num_beams=k,
                      num_return_sequences=k, max_new_tokens=n, do_sample=False, eos_token_id=end, pad_token_id=end,
                      output_scores=True, return_dict_in_generate=True, **kw)
    beams = []
    for seq, score in zip(out.sequences.tolist(), out.sequences_scores.tolist(), strict=True):
        gen = seq[len(ids):]
        if end in gen:
            gen = gen[:gen.index(end) + 1]
        beams.append((gen, score))
    return beams


def a_likely_token(llm, ids: list[int]) -> int:
    """A token the model's beams often choose: as the end id, it ends some beams and not others."""
    out = llm.beam_search([ids], BeamSearchParams(beam_width=4, max_tokens=12, ignore_eos=True))[0]
    counts = Counter(t for s in out.sequences for t in s.tokens[len(ids) + 2:])
    return counts.most_common(1)[0][0]


@pytest.mark.parametrize(("k", "length_penalty", "early_stopping"),
                         [(2, 1.0, False), (2, 0.5, True), (4, 1.0, False), (4, 0.0, True), (3, 2.0, "never"),
                          (5, -1.0, False)])
def test_beams_match_transformers(llm, hf, tiny_llama, k, length_penalty, early_stopping):
    tok = AutoTokenizer.from_pretrained(tiny_llama)
    for prompt in PROMPTS:
        ids = tok.encode(prompt)
        end = a_likely_token(llm, ids)
        params = BeamSearchParams(beam_width=k, max_tokens=16, ignore_eos=True, stop_token_ids=[end],
                                  length_penalty=length_penalty, early_stopping=early_stopping)
        ours = llm.beam_search([ids], params)[0].sequences
        theirs = hf_beams(hf, ids, k, 16, end, length_penalty=length_penalty, early_stopping=early_stopping)
        assert [s.tokens[len(ids):] for s in ours] == [t for t, _ in theirs], prompt
        search = BeamSearch(BeamSearchParams(k, 16, length_penalty=length_penalty), frozenset())
        for s, (tokens, score) in zip(ours, theirs, strict=True):
            assert search.score(s.cum_logprob, len(tokens)) == pytest.approx(score, rel=1e-4, abs=1e-5)
            assert s.finish_reason == ("stop" if tokens[-1] == end else "length")
        if length_penalty <= 1.0:  # (a penalty of 2 favours the longest: those max_tokens ended)
            assert any(s.finish_reason == "stop" for s in ours), prompt  # the end id did end some


def test_stop_strings_end_beams_and_are_cut(llm, tiny_llama):
    """A stop string ends a beam at the token that completes it (the text cut before it, or kept with
    include_stop_str_in_output), as a sampled output's."""
    ids = AutoTokenizer.from_pretrained(tiny_llama).encode(PROMPTS[0])
    free = llm.beam_search([ids], BeamSearchParams(beam_width=3, max_tokens=12, ignore_eos=True))[0].sequences
    prompt_text = llm.tokenizer.decode(ids, skip_special_tokens=True)
    out = free[0].text[len(prompt_text):]
    stop = out[len(out) // 2:len(out) // 2 + 3]
    for include in (False, True):  # (no length penalty: a beam that ends early keeps its higher sum)
        seqs = llm.beam_search([ids], BeamSearchParams(beam_width=3, max_tokens=12, ignore_eos=True, stop=[stop],
                                                       include_stop_str_in_output=include, length_penalty=0.0))
        seqs = seqs[0].sequences
        assert len(seqs) == 3
        ended = [s for s in seqs if s.finish_reason == "stop"]
        assert ended and all(s.stop_reason == stop for s in ended)
        for s in ended:
            text = s.text[len(prompt_text):]
            assert text.count(stop) == include and (text.endswith(stop) if include else stop not in text)
        for s in seqs:
            if s.finish_reason == "length":
                assert stop not in s.text[len(prompt_text):] and len(s.tokens) == len(ids) + 12


def _tops(*rows):
    """A round's top lists from (token, probability) pairs per beam."""
    import math

    return [[[t, math.log(p)] for t, p in row] for row in rows]


def test_early_stopping_true_ends_once_k_have_finished():
    s = BeamSearch(BeamSearchParams(2, 10, early_stopping=True), frozenset({0}))
    s.advance(_tops([(1, .5), (2, .3), (0, .1), (3, .05)]))
    assert [b.tokens for b in s.live] == [[1], [2]] and not s.done
    s.advance(_tops([(0, .9), (4, .05), (5, .02), (6, .01)], [(0, .8), (7, .1), (8, .05), (9, .01)]))
    assert [b.tokens for b in s.best()] == [[1, 0], [2, 0]] and s.done
    assert all(b.finish_reason == "stop" and b.stop_reason == 0 for b in s.best())


def test_an_end_ranked_below_k_does_not_finish():
    """transformers' rule: only the best k continuations may finish; an end id ranked lower is dropped."""
    s = BeamSearch(BeamSearchParams(2, 10), frozenset({0}))
    s.advance(_tops([(1, .5), (2, .3), (0, .15), (3, .05)]))
    assert s.finished == [] and [b.tokens for b in s.live] == [[1], [2]]


def test_a_deadline_keeps_the_best_so_far():
    s = BeamSearch(BeamSearchParams(3, 10), frozenset({0}))
    s.advance(_tops([(0, .5), (1, .3), (2, .1), (3, .05), (4, .03), (5, .02)]))
    s.stop("timeout")
    assert s.done and [(b.tokens, b.finish_reason) for b in s.best()] == [
        ([0], "stop"), ([1], "timeout"), ([2], "timeout")]


# ---------------------------------------------------------------------------- served

def offline(llm, ids: list[int], **kw) -> list:
    return llm.beam_search([ids], BeamSearchParams(**kw))[0].sequences


def test_served_completions_are_the_offline_beams(llm, tiny_client):
    ids = llm.tokenizer.encode(PROMPTS[1])
    end = a_likely_token(llm, ids)
    prompt_text = llm.tokenizer.decode(ids, skip_special_tokens=True)
    want = offline(llm, ids, beam_width=3, max_tokens=14, ignore_eos=True, stop_token_ids=[end])
    r = tiny_client.completions.create(model="tiny", prompt=ids, n=3, max_tokens=14, temperature=0.9, seed=3,
                                  logprobs=2, extra_body={"use_beam_search": True, "ignore_eos": True,
                                                          "stop_token_ids": [end]})
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert [c.text for c in r.choices] == [s.text[len(prompt_text):] for s in want]
    assert [c.finish_reason for c in r.choices] == [s.finish_reason for s in want]
    assert any(c.finish_reason == "stop" for c in r.choices)
    for c, s in zip(r.choices, want, strict=True):
        generated = s.tokens[len(ids):]
        assert len(c.logprobs.tokens) == len(generated)  # (the end id's entry too: it was sampled)
        assert c.logprobs.token_logprobs == pytest.approx([lp for lp, _ in s.logprobs], abs=1e-5)
        assert sum(c.logprobs.token_logprobs) == pytest.approx(s.cum_logprob, abs=1e-4)
        # the 2 likeliest, and the beam's token where it is not among them (a completion's logprobs, as vLLM's)
        assert all(token in top and len(top) == 2 + (token not in list(top)[:2])
                   for token, top in zip(c.logprobs.tokens, c.logprobs.top_logprobs, strict=True))
    assert r.usage.prompt_tokens == len(ids)
    assert r.usage.completion_tokens == sum(len(s.tokens) - len(ids) for s in want)

    chunks = tiny_client.completions.create(model="tiny", prompt=ids, n=3, max_tokens=14, stream=True,
                                       stream_options={"include_usage": True}, extra_body={
                                           "use_beam_search": True, "ignore_eos": True, "stop_token_ids": [end]})
    texts, reasons, usage = [""] * 3, [None] * 3, None
    for ch in chunks:
        usage = ch.usage or usage
        for c in ch.choices:
            texts[c.index] += c.text
            reasons[c.index] = c.finish_reason or reasons[c.index]
    assert texts == [c.text for c in r.choices] and reasons == [c.finish_reason for c in r.choices]
    assert usage.completion_tokens == r.usage.completion_tokens


def test_served_chat_and_echo(llm, tiny_client):
    messages = [{"role": "user", "content": "Name three colours."}]
    ids = llm._codec.apply_chat_template(messages, True, None, None, False)  # (the server's template call)
    want = offline(llm, ids, beam_width=2, max_tokens=10, length_penalty=0.5)
    prompt_text = llm.tokenizer.decode(ids, skip_special_tokens=True)
    r = tiny_client.chat.completions.create(model="tiny", messages=messages, n=2, max_tokens=10, logprobs=True,
                                       top_logprobs=1, extra_body={"use_beam_search": True, "length_penalty": 0.5})
    assert [c.message.content for c in r.choices] == [s.text[len(prompt_text):] for s in want]
    assert [len(c.logprobs.content) for c in r.choices] == [len(s.tokens) - len(ids) for s in want]

    prompt = PROMPTS[0]
    r = tiny_client.completions.create(model="tiny", prompt=prompt, n=2, max_tokens=6, echo=True, logprobs=0,
                                  extra_body={"use_beam_search": True})
    n_prompt = len(llm.tokenizer.encode(prompt))
    for c in r.choices:
        assert c.text.startswith(prompt)
        assert len(c.logprobs.tokens) == n_prompt + 6 and c.logprobs.token_logprobs[0] is None
        assert all(lp is not None for lp in c.logprobs.token_logprobs[1:])


@pytest.mark.parametrize(("extra", "param"), [
    ({"n": 11}, "n"), ({"presence_penalty": 0.5}, "presence_penalty"), ({"logit_bias": {"5": 1}}, "logit_bias"),
    ({"response_format": {"type": "json_object"}}, "response_format"), ({"min_tokens": 2}, "min_tokens"),
    ({"length_penalty": "long"}, "length_penalty"), ({"early_stopping": "sometimes"}, "early_stopping"),
    ({"use_beam_search": "yes"}, "use_beam_search"),
    ({"n": 7, "stop_token_ids": list(range(5, 15))}, "n")])  # (11+ end ids: (1 + 11) x 7 > 64 logprobs a round)
def test_what_beam_search_cannot_honour_is_a_400(tiny_client, extra, param):
    import openai

    body = {"use_beam_search": True, "n": 2, **extra}
    with pytest.raises(openai.BadRequestError) as e:
        tiny_client.completions.create(model="tiny", prompt="Hi", max_tokens=4, extra_body=body)
    assert e.value.body["param"] == param, e.value.body
    r = tiny_client.completions.create(model="tiny", prompt="Hi", max_tokens=4, n=2, extra_body={  # neutral values pass
        "use_beam_search": True, "presence_penalty": 0, "repetition_penalty": 1.0, "min_tokens": 0,
        "logit_bias": {}, "bad_words": []})
    assert len(r.choices) == 2
    r = tiny_client.completions.create(model="tiny", prompt="Hi", max_tokens=4, n=2, extra_body={  # penalties off
        "use_beam_search": True, "presence_penalty": 1, "repeat_last_n": 0})
    assert len(r.choices) == 2


@pytest.mark.parametrize("penalty", [1000, 1000.0, -1000, 400.5, -60])
def test_extreme_length_penalties_saturate(tiny_client, penalty):
    """A penalty whose power overflows (or underflows) scores as float arithmetic does: no error."""
    r = tiny_client.completions.create(model="tiny", prompt="Hi", max_tokens=6, n=2,
                                  extra_body={"use_beam_search": True, "length_penalty": penalty})
    assert len(r.choices) == 2
    s = BeamSearch(BeamSearchParams(2, 10, length_penalty=penalty), frozenset())
    assert s.score(-3.0, 7) in (0.0, -math.inf) or math.isfinite(s.score(-3.0, 7))


def test_other_apis_refuse_beam_search(tiny_server):
    """Where an API has no beam search, asking for it is a 400, not a sampled answer."""
    import json
    import urllib.error
    import urllib.request

    for path, body in (("/v1/responses", {"model": "tiny", "input": "Hi"}),
                       ("/v1/messages", {"model": "tiny", "max_tokens": 4,
                                         "messages": [{"role": "user", "content": "Hi"}]}),
                       ("/completion", {"prompt": "Hi", "n_predict": 4})):
        req = urllib.request.Request(tiny_server.url + path, json.dumps({**body, "use_beam_search": True}).encode(),
                                     {"Content-Type": "application/json", "Authorization": f"Bearer {TINY_KEY}",
                                      "x-api-key": TINY_KEY})
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(req, timeout=60)
        assert e.value.code == 400 and "use_beam_search" in e.value.read().decode(), path


def test_a_deadline_answers_the_best_so_far(tiny_client):
    """A search cut by its deadline answers its best beams so far, "timeout" for those still live."""
    r = tiny_client.completions.create(model="tiny", prompt="Once upon a time", n=4, max_tokens=240,  # (~1 s of rounds)
                                  extra_body={"use_beam_search": True, "ignore_eos": True, "timeout": 0.5})
    assert len(r.choices) == 4 and all(c.finish_reason == "timeout" for c in r.choices)
    assert 0 < r.usage.completion_tokens < 4 * 240


def test_the_servers_request_timeout_holds_the_whole_search(tiny_llama):
    """``--request-timeout`` ends a search without a timeout of its own as a whole (each round used to get it
    anew: the search ran on for as long as it liked)."""
    import openai

    from tests.test_server_e2e import Server

    s = Server("--model", tiny_llama, "--served-model-name", "tiny", "--dtype", "float32", "--max-model-len", "256",
               "--request-timeout", "0.5", startup=120)
    try:
        client = openai.OpenAI(base_url=f"{s.url}/v1", api_key="x", max_retries=0)
        r = client.completions.create(model="tiny", prompt="Once upon a time", n=4, max_tokens=240,  # (~1 s of rounds)
                                      extra_body={"use_beam_search": True, "ignore_eos": True})
        assert len(r.choices) == 4 and all(c.finish_reason == "timeout" for c in r.choices)
        assert 0 < r.usage.completion_tokens < 4 * 240
    finally:
        s.close()


def test_a_client_that_goes_away_ends_the_search(tiny_server):
    """The rounds stop when the caller disconnects mid-search (no engine request runs after)."""
    import json
    import socket
    import time

    body = json.dumps({"prompt": "Once upon a time", "n": 4, "max_tokens": 240, "use_beam_search": True,
                       "ignore_eos": True}).encode()
    s = socket.create_connection(("127.0.0.1", tiny_server.port))
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
              b"Authorization: Bearer " + TINY_KEY.encode() + b"\r\nContent-Length: " + str(len(body)).encode() +
              b"\r\n\r\n" + body)
    busy = 0
    for _ in range(40):  # the rounds run
        st = tiny_server.engine_stats()
        busy += st.num_running + st.num_waiting > 0
        time.sleep(0.005)
    assert busy
    s.close()
    time.sleep(0.3)
    samples = [tiny_server.engine_stats() for _ in range(40)]
    assert all(st.num_running + st.num_waiting == 0 for st in samples)
    assert samples[-1].num_free_blocks == samples[-1].num_kv_blocks


def test_bench_beam_search_runs_and_agrees(tiny_llama, capsys):
    import json

    from tools.bench_beam_search import main

    main(["--model", tiny_llama, "--num-prompts", "2", "--prompt-len", "8", "--beam-width", "3", "--max-tokens", "5"])
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["same_sequences"] == result["sequences"] == 6 and result["same_best"] == 2
    assert result["tokenmill_s"] > 0 and result["hf_s"] > 0
