"""Beam search (``engine.beam_search``): transformers' ``generate(num_beams=k)`` sequence for sequence (fp32),
offline (``LLM.beam_search``) and served (``use_beam_search``)."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from engine import LLM, BeamSearchParams
from engine.beam_search import BeamSearch

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
