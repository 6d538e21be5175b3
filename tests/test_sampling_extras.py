"""vLLM's sampling extras: ``allowed_token_ids``, ``bad_words`` (tokenized as vLLM tokenizes them) and
``include_stop_str_in_output``: the sampler's masks on hand-made logits, a random model held to them
(greedy, seeded, batched, asynchronous scheduling, drafts), and the HTTP fields and their refusals."""

from __future__ import annotations

import math

import pytest
import torch

from engine.protocol import SamplingParamError, SamplingParams
from engine.sampler import SamplingState, process_logits
from frontends.text import StopStrings, bad_words_token_ids


def _process(logits, params, outputs):
    return process_logits(logits, params, [SamplingState(p) for p in params], [[] for _ in params], outputs, [])


def test_allowed_token_ids_keep_only_theirs_and_bad_words_ban_a_words_last_token_after_its_others():
    logits = torch.arange(6, dtype=torch.float32).expand(3, -1).contiguous()
    allowed = SamplingParams(allowed_token_ids=[1, 4, 4])
    bad = SamplingParams(bad_words_token_ids=[[5], [2, 3]])  # 5 always; 3 only after 2
    got = _process(logits, [allowed, bad, bad], [[], [0, 2], [2, 0]])
    inf = -math.inf
    assert got[0].tolist() == [inf, 1.0, inf, inf, 4.0, inf]
    assert got[1].tolist() == [0.0, 1.0, 2.0, inf, 4.0, inf]
    assert got[2].tolist() == [0.0, 1.0, 2.0, 3.0, 4.0, inf]
    assert not SamplingState(allowed).plain_greedy and SamplingState(bad).reads_output
    # masks that leave a row nothing (only 5 allowed, 5 a bad word): the row ends, its EOS the one choice
    both = SamplingParams(allowed_token_ids=[5], bad_words_token_ids=[[5]])
    got = process_logits(logits[:1].clone(), [both], [SamplingState(both)], [[]], [[]], [2])
    assert got[0].tolist() == [inf, inf, 0.0, inf, inf, inf]


@pytest.mark.parametrize("kw, param", [
    ({"allowed_token_ids": []}, "allowed_token_ids"),
    ({"allowed_token_ids": [1, -1]}, "allowed_token_ids"),
    ({"allowed_token_ids": list(range(40000))}, "allowed_token_ids"),
    ({"bad_words": ["  "]}, "bad_words"),
    ({"bad_words": ["x"] * 65}, "bad_words"),
    ({"bad_words": ["x" * 257]}, "bad_words"),
    ({"bad_words_token_ids": [[]]}, "bad_words"),
    ({"include_stop_str_in_output": 1}, "include_stop_str_in_output"),
])
def test_bad_values_are_refused_by_name(kw, param):
    with pytest.raises(SamplingParamError) as e:
        SamplingParams(**kw)
    assert e.value.param == param
    with pytest.raises(SamplingParamError) as e:
        SamplingParams(allowed_token_ids=[5, 100]).check_vocab(100)
    assert e.value.param == "allowed_token_ids"


def test_bad_words_are_tokenized_as_vllm_tokenizes_them(smollm_tokenizer_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm_tokenizer_dir)

    def enc(t):
        return tok.encode(t, add_special_tokens=False)

    ids = bad_words_token_ids([" Paris", "New York"], enc)
    assert ids == [enc("Paris"), enc(" Paris"), enc("New York"), enc(" New York")]
    assert all(ids)


def test_include_stop_str_keeps_the_stop_string_however_the_text_arrives():
    for pieces in (["Hello END there"], ["Hel", "lo E", "N", "D there"]):
        stops = StopStrings(["END"], include=True)
        out = ""
        for p in pieces:
            text, hit = stops.feed(p)
            out += text
            if hit:
                break
        assert out == "Hello END" and stops.matched == "END"


@pytest.fixture(scope="module")
def llm(tiny_llama):
    from engine import LLM

    return LLM(tiny_llama, dtype="float32", num_kv_blocks=256, max_model_len=512, max_num_seqs=8)


def test_a_model_held_to_allowed_tokens_and_kept_from_bad_words(llm):
    prompts = [[1, 2, 3, 4], [5, 6, 7], [8, 9, 10, 11, 12]]
    free = llm.generate(prompts, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
    allowed = [100, 200, 300, 400, free[0].token_ids[3]]
    for temperature in (0.0, 1.0):
        outs = llm.generate(prompts, SamplingParams(max_tokens=12, temperature=temperature, seed=7, ignore_eos=True,
                                                    allowed_token_ids=allowed))
        assert all(set(o.token_ids) <= set(allowed) for o in outs)
    # ban each prompt's greedy pair of tokens 2-3: the output turns elsewhere there, and never holds the pair
    for prompt, out in zip(prompts, free, strict=True):
        pair = out.token_ids[2:4]
        got = llm.generate([prompt], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True,
                                                    bad_words_token_ids=[pair]))[0].token_ids
        assert got[:3] == out.token_ids[:3] and got[3] != out.token_ids[3]
        assert all(got[i:i + 2] != pair for i in range(len(got) - 1))
    # as words: one of the output's tokens whose text, tokenized as vLLM tokenizes bad words, is that token
    def enc(text):
        return llm.tokenizer.encode(text, add_special_tokens=False)

    word = next((w for t in free[1].token_ids if [t] in bad_words_token_ids([w := llm.tokenizer.decode([t])], enc)),
                None)
    assert word is not None
    got = llm.generate(prompts[1:2], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True,
                                                    bad_words=[word]))[0].token_ids
    for ids in bad_words_token_ids([word], enc):
        assert all(got[i:i + len(ids)] != ids for i in range(len(got)))


def test_bad_words_hold_under_asynchronous_scheduling_and_drafts(tiny_llama, llm):
    from engine import LLM

    prompts = [[1, 2, 3, 1, 2, 3, 1, 2], [5, 6, 7]]
    free = llm.generate(prompts, SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True,
                            bad_words_token_ids=[free[0].token_ids[4:6], free[1].token_ids[1:2]])
    want = [o.token_ids for o in llm.generate(prompts, params)]
    for kw in ({"async_scheduling": "on"},
               {"speculative_config": {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2,
                                       "prompt_lookup_min": 1}}):
        other = LLM(tiny_llama, dtype="float32", num_kv_blocks=256, max_model_len=512, **kw)
        assert [o.token_ids for o in other.generate(prompts, params)] == want, kw


def test_masks_that_leave_nothing_end_the_request_and_words_come_as_tokens(llm):
    from engine.engine import RequestError

    free = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))[0].token_ids
    t = free[0]
    out = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, min_tokens=4,
                                                   allowed_token_ids=[t], bad_words_token_ids=[[t]]))[0]
    assert out.finish_reason == "stop" and len(out.token_ids) == 1  # (its EOS: ignore_eos, min_tokens or not)
    with pytest.raises(RequestError) as e:  # words the engine cannot read: only token ids reach it
        llm.engine.add_request("words", [1, 2], SamplingParams(bad_words=["x"]))
    assert e.value.status == 400 and e.value.param == "bad_words"


def test_include_stop_str_in_output_offline(llm):
    prompt = [3, 1, 4, 1, 5]
    free = llm.generate([prompt], SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True))[0]
    stop = free.text[len(free.text) // 2:len(free.text) // 2 + 2]
    if not stop.strip():
        pytest.skip("the random model's text has no stop string to pick there")
    cut = llm.generate([prompt], SamplingParams(max_tokens=10, temperature=0.0, stop=[stop]))[0]
    kept = llm.generate([prompt], SamplingParams(max_tokens=10, temperature=0.0, stop=[stop],
                                                 include_stop_str_in_output=True))[0]
    assert kept.text == cut.text + stop and cut.stop_reason == kept.stop_reason == stop
    # a stop token's text stays too, as vLLM keeps it
    t = free.token_ids[3]
    cut, kept = (llm.generate([prompt], SamplingParams(max_tokens=10, temperature=0.0, stop_token_ids=[t],
                                                       include_stop_str_in_output=inc))[0] for inc in (False, True))
    assert cut.stop_reason == kept.stop_reason == t and kept.text == cut.text + llm.tokenizer.decode([t])
