"""Speculative decoding by n-gram lookup (``engine.speculative``): the lookup and its config, greedy output
token for token that of transformers (fp32; CPU graphs and eager), and sampled output (seeded, with
penalties, logprobs, min_tokens, stops inside accepted drafts), preemption, a tight token budget and
tensor parallelism all giving the tokens of decoding without drafts; the scheduler never preempts for
a draft; the server's flag and its /metrics."""

from __future__ import annotations

import itertools
import json

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from engine import LLM, SamplingParams
from engine.block_manager import BlockManager
from engine.request import Request
from engine.scheduler import Scheduler
from engine.speculative import NgramConfig, find_draft
from tests.conftest import make_tiny_model

SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
# repetitive prompts, so that drafts are found from the start, and one that is not
PROMPTS = [[1, 5, 6, 7, 8, 5, 6, 7, 8, 5, 6], [1, 822, 18755, 29898, 29876], [1, 3681, 338, 263] * 3]
KW = dict(device="cpu", dtype="float32", num_kv_blocks=128, max_model_len=256)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, smollm_tokenizer_dir):
    # (this seed's greedy output repeats itself now and then: drafts are both accepted and rejected)
    return make_tiny_model(str(tmp_path_factory.mktemp("spec")), "llama", smollm_tokenizer_dir, seed=3)


def run(model: str, prompts, params, spec: dict | None = None, **kw):
    """Each prompt's output, and the engine's (drafts, draft tokens, accepted tokens)."""
    with LLM(model, **(KW | kw), speculative_config=spec) as llm:
        outs = llm.generate(prompts, params)
        s = llm.engine.scheduler
        return outs, (s.num_drafts, s.num_draft_tokens, s.num_accepted_tokens)


def test_find_draft_takes_the_longest_suffix_seen_before():
    t = np.array([9, 1, 2, 3, 4, 7, 2, 3, 5, 1, 2, 3])
    assert find_draft(t, 1, 3, 2) == [4, 7]  # "1 2 3" occurred at 1..3: what followed it
    assert find_draft(t, 1, 2, 2) == [5, 1]  # "2 3" last occurred at 6..7 with two tokens after it
    assert find_draft(t, 4, 5, 2) == []  # no 4-token suffix occurred before
    loop = np.array([5, 6, 5, 6, 5])
    assert find_draft(loop, 1, 2, 3) == [6, 5]  # "6 5" ends only at 2: two tokens follow it
    assert find_draft(loop, 1, 1, 3) == [6, 5, 6]  # "5": the latest with three tokens after it
    assert find_draft(np.array([1, 2, 3]), 1, 3, 2) == []
    assert find_draft(np.array([4]), 1, 1, 2) == []


@pytest.mark.parametrize(("spec", "want"), [
    ({"method": "ngram", "num_speculative_tokens": 3}, NgramConfig(3, 5, 5)),  # vLLM's defaults
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 4}, NgramConfig(2, 4, 4)),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 2}, NgramConfig(2, 2, 2)),
    ({"model": "ngram", "num_speculative_tokens": 1, "prompt_lookup_min": 1, "prompt_lookup_max": 3},
     NgramConfig(1, 1, 3)),
    ({"method": "ngram", "num_speculative_tokens": 4, "disable_by_batch_size": 2}, NgramConfig(4, 5, 5, 2)),
])
def test_config_of(spec, want):
    assert NgramConfig.of(spec) == want


@pytest.mark.parametrize(("spec", "match"), [
    ({"method": "eagle", "num_speculative_tokens": 3}, "method must be one of ngram"),
    ({"method": "ngram"}, "num_speculative_tokens is required"),
    ({"method": "ngram", "num_speculative_tokens": 0}, r"num_speculative_tokens must be an integer in \[1, 32\]"),
    ({"method": "ngram", "num_speculative_tokens": True}, "num_speculative_tokens must be an integer"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2},
     "prompt_lookup_min 4 is above prompt_lookup_max 2"),
    ({"method": "ngram", "num_speculative_tokens": 2, "draft_tensor_parallel_size": 1}, "unknown keys"),
    ([1], "must be a JSON object"),
    ({"method": "ngram", "num_speculative_tokens": 2, "disable_by_batch_size": 0}, "disable_by_batch_size must be"),
])
def test_bad_configs_are_refused(spec, match):
    with pytest.raises(ValueError, match=match):
        NgramConfig.of(spec)


@pytest.mark.parametrize("eager", [False, True], ids=["cpu-graphs", "eager"])
def test_greedy_matches_transformers(tiny, eager):
    n = 40
    outs, (drafts, draft_tokens, accepted) = run(tiny, PROMPTS, SamplingParams(max_tokens=n, temperature=0.0,
                                                                               ignore_eos=True), SPEC,
                                                 enforce_eager=eager)
    assert drafts and 0 < accepted < draft_tokens  # drafts were both kept and rejected
    hf = AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32).eval()
    for p, o in zip(PROMPTS, outs, strict=True):
        want = hf.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                           max_new_tokens=n, do_sample=False, pad_token_id=0)[0, len(p):].tolist()
        assert o.token_ids == want


def test_sampling_penalties_logprobs_and_stops_are_unchanged(tiny):
    """Seeded sampling draws each token's noise from its own index: the same tokens with drafts as without,
    with penalties counting the drafts before each position, the same logprobs, min_tokens, and a stop token
    or max_tokens that falls inside a run of accepted drafts ending the request there."""
    base = dict(max_tokens=30, ignore_eos=True, logprobs=2)
    params = [SamplingParams(temperature=0.0, **base),
              SamplingParams(temperature=0.8, seed=11, repetition_penalty=1.3, presence_penalty=0.4, **base),
              SamplingParams(temperature=0.7, top_k=20, seed=5, min_tokens=8, **base),
              SamplingParams(temperature=0.0, max_tokens=7, ignore_eos=True)]
    prompts = [PROMPTS[2]] * 4
    plain, _ = run(tiny, prompts, params)
    # a stop token the plain greedy run reaches after 12 tokens: with drafts it may come in a step's middle
    stop = plain[0].token_ids[12]
    params.append(SamplingParams(temperature=0.0, max_tokens=30, stop_token_ids=[stop]))
    prompts.append(PROMPTS[2])
    plain, _ = run(tiny, prompts, params)
    spec, (_, _, accepted) = run(tiny, prompts, params, SPEC)
    assert accepted
    for a, b in zip(plain, spec, strict=True):
        assert a.token_ids == b.token_ids and a.finish_reason == b.finish_reason
        if a.logprobs is not None:
            assert len(a.logprobs) == len(b.logprobs) == len(a.token_ids)
            for x, y in zip(a.logprobs, b.logprobs, strict=True):
                assert x[0] == pytest.approx(y[0], abs=1e-4)
    assert len(spec[3].token_ids) == 7
    assert spec[4].token_ids[-1] == stop and len(spec[4].token_ids) <= 13


STOP_PROMPT = "one two three one two three one two three one two"


def with_deltas(model: str, prompt, n: int, **kw):
    """The greedy output of ``n`` tokens with drafts, the token lists of its deltas (one a step), the tokenizer."""
    with LLM(model, **(KW | kw), speculative_config=SPEC) as llm:
        deltas, step = [], llm.engine.step
        llm.engine.step = lambda: [d for d in step() if not deltas.append(d.token_ids)]
        out = llm.generate([prompt], SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))[0]
        return out, deltas, llm.tokenizer


def mid_delta_stop(model: str) -> tuple[str, int]:
    """A stop string whose first occurrence in ``STOP_PROMPT``'s greedy output (40 tokens) ends with a token
    in the middle of one step's accepted drafts, and the tokens up to it."""
    out, deltas, tokenizer = with_deltas(model, STOP_PROMPT, 40)
    decode = tokenizer.decode
    # a stop string whose first occurrence ends with the first token of a delta of several (the token i)
    for i, d in zip(itertools.accumulate(len(d) for d in deltas), deltas[1:], strict=False):
        head = decode(out.token_ids[:i + 1])
        if len(d) < 2 or decode(out.token_ids[:i]) == head:  # (that token must add text)
            continue
        for size in range(3, len(head)):
            if out.text.find(head[-size:]) + size == len(head):
                return head[-size:], i + 1
    raise AssertionError(f"no such stop string: {deltas}")


def test_stop_strings_cut_where_they_do_without_drafts(tiny):
    """A stop string completed by a token in the middle of a step's accepted drafts ends the output there: the
    same text, tokens and logprobs as without drafts (the tokens after it dropped)."""
    stop, n = mid_delta_stop(tiny)
    prompt = STOP_PROMPT
    params = [SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, logprobs=1, stop=[stop])]
    plain, _ = run(tiny, [prompt], params)
    spec, (_, _, accepted) = run(tiny, [prompt], params, SPEC)
    assert accepted
    a, b = plain[0], spec[0]
    assert (a.text, a.token_ids, a.finish_reason, a.stop_reason) == (b.text, b.token_ids, b.finish_reason, b.stop_reason)
    assert b.finish_reason == "stop" and len(b.logprobs) == len(b.token_ids) == n


def test_preemption_a_small_budget_and_the_prefix_cache_keep_the_tokens(tiny):
    """A KV cache too small for every request at once (preemptions, prefix-cache hits when they come back)
    and a token budget of 3 (drafts trimmed to what is left of it): the tokens of a run without drafts."""
    prompts = [PROMPTS[0], PROMPTS[2], PROMPTS[0] + [9], PROMPTS[1] * 2]
    greedy = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)
    small = dict(num_kv_blocks=9, block_size=8, max_num_batched_tokens=64)
    plain, _ = run(tiny, prompts, greedy, **small)
    with LLM(tiny, **(KW | small), speculative_config=SPEC) as llm:
        assert [o.token_ids for o in llm.generate(prompts, greedy)] == [o.token_ids for o in plain]
        assert llm.engine.scheduler.num_preemptions and llm.engine.scheduler.num_accepted_tokens
    tight, _ = run(tiny, prompts[:2], greedy, max_num_batched_tokens=3)
    spec, (drafts, draft_tokens, _) = run(tiny, prompts[:2], greedy, SPEC, max_num_batched_tokens=3)
    assert [o.token_ids for o in spec] == [o.token_ids for o in tight] == [o.token_ids for o in plain[:2]]
    assert drafts and draft_tokens <= 2 * drafts  # a decode's token and two drafts at most


class FixedDrafts:
    disable_by_batch_size = None

    def __init__(self, drafts: list[int]):
        self.drafts = drafts

    def propose(self, req: Request, budget: int) -> list[int]:
        return self.drafts[:budget]


def test_no_one_is_preempted_for_a_draft():
    bm = BlockManager(num_blocks=3, block_size=4)
    s = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=64, proposer=FixedDrafts([7, 7, 7, 7, 7]))
    a, b = Request("a", [1, 2, 3], SamplingParams(max_tokens=20)), Request("b", [4, 5, 6], SamplingParams(max_tokens=20))
    for r in (a, b):
        s.add(r)
    batch = s.schedule()  # both prompts, a block each
    s.update_from_output(batch, 0.01)
    for r in (a, b):
        r.append_token(9)
    batch = s.schedule()  # a's drafts need two more blocks, one is free: no drafts, and b keeps its block
    assert batch.num_new_tokens == [1, 1] and not batch.preempted and a.draft_token_ids == []
    s.update_from_output(batch, 0.01)
    for r in (a, b):
        r.append_token(9)
    s.finish(b, "stop")
    batch = s.schedule()  # now they fit: the decode token and five drafts
    assert batch.num_new_tokens == [6] and a.draft_token_ids == [7] * 5 and batch.num_drafts == 5
    assert batch.num_prompt_tokens == 0
    s.update_from_output(batch, 0.01, {"a": 3})  # two accepted: their K/V count, the other three's do not
    assert a.num_computed_tokens == 4 + 1 + 2


def test_no_drafts_while_more_requests_run_than_disable_by_batch_size():
    proposer = FixedDrafts([7, 7])
    proposer.disable_by_batch_size = 1
    s = Scheduler(BlockManager(num_blocks=16, block_size=4), max_num_seqs=4, max_num_batched_tokens=64,
                  proposer=proposer)
    a, b = Request("a", [1, 2, 3], SamplingParams(max_tokens=20)), Request("b", [4, 5, 6], SamplingParams(max_tokens=20))
    for r in (a, b):
        s.add(r)
    s.update_from_output(s.schedule(), 0.01)
    for r in (a, b):
        r.append_token(9)
    batch = s.schedule()
    assert batch.num_new_tokens == [1, 1] and batch.num_drafts == 0  # two running: no drafts
    s.update_from_output(batch, 0.01)
    for r in (a, b):
        r.append_token(9)
    s.finish(b, "stop")
    assert s.schedule().num_new_tokens == [3]  # one running: a's token and two drafts


def test_drafts_come_after_prompts_and_preempt_no_one():
    """A prompt chunk gets the budget and the blocks before any draft: drafts never make the scheduler
    preempt a request (nor delay a prompt)."""
    for proposer in (None, FixedDrafts([7] * 4)):
        s = Scheduler(BlockManager(num_blocks=4, block_size=4), max_num_seqs=4, max_num_batched_tokens=11,
                      proposer=proposer)
        a, b = Request("a", [1, 2, 3], SamplingParams(max_tokens=20)), Request("b", list(range(10, 22)),
                                                                               SamplingParams(max_tokens=4))
        for r in (a, b):
            s.add(r)
        batch = s.schedule()  # a's prompt, 8 of b's
        s.update_from_output(batch, 0.01)
        a.append_token(9)
        batch = s.schedule()
        assert [r.request_id for r in batch.requests] == ["a", "b"] and batch.num_new_tokens == [1, 4]
        assert not batch.preempted and a.draft_token_ids == []  # (no block was left for them)


class Oracle:
    """Drafts that are the output to come (of a run without drafts): every one is kept."""

    disable_by_batch_size = None

    def __init__(self, tokens: list[int], k: int):
        self.tokens, self.k = tokens, k

    def propose(self, req: Request, budget: int) -> list[int]:
        n = req.num_sampled
        return self.tokens[n:n + min(self.k, budget, req.params.max_tokens - n - 1)]


def test_blocks_filled_by_kept_drafts_reach_the_prefix_cache(tiny):
    """A request whose last step kept drafts that filled a block: that block is findable when it ends, as a
    decode's is; a request whose prompt is its prompt and output finds all of it."""
    prompt, n = PROMPTS[2], 6  # 12 tokens, 1 from the prompt's step, then 5 in one: positions 12..16 (block 1 full)
    greedy = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
    with LLM(tiny, **KW, block_size=8) as llm:
        want = llm.generate([prompt], greedy)[0].token_ids
    for spec in (False, True):
        with LLM(tiny, **KW, block_size=8) as llm:
            llm.engine.scheduler.proposer = Oracle(want, 4) if spec else None
            assert llm.generate([prompt], greedy)[0].token_ids == want
            assert llm.engine.scheduler.num_accepted_tokens == (4 if spec else 0)
            again = llm.generate([prompt + want], SamplingParams(max_tokens=1))[0]
            assert again.num_cached_tokens == (len(prompt) + n - 1) // 8 * 8 == 16  # all but the last token's


def test_tensor_parallel_gives_one_ranks_tokens(tiny):
    greedy = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    one, _ = run(tiny, PROMPTS, greedy)
    two, (_, _, accepted) = run(tiny, PROMPTS, greedy, SPEC, tensor_parallel_size=2)
    assert accepted and [o.token_ids for o in two] == [o.token_ids for o in one]


def test_served_with_the_openai_client(tiny):
    """``tokenmill serve --speculative-config``: streamed and whole completions are the offline greedy text
    without drafts; /metrics counts the drafts (vLLM's spec_decode counters)."""
    from tests.test_server_e2e import Server, openai_client, scrape, wait_for

    prompt = "one two three one two three one two three one two"
    greedy = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    stop, n = mid_delta_stop(tiny)
    with LLM(tiny) as llm:
        want = llm.generate([prompt], greedy)[0].text
    s = Server("--model", tiny, "--served-model-name", "tiny", "--speculative-config", json.dumps(SPEC))
    try:
        client = openai_client(s)
        r = client.completions.create(model="tiny", prompt=prompt, max_tokens=32, temperature=0,
                                      extra_body={"ignore_eos": True})
        assert r.choices[0].text == want and r.usage.completion_tokens == 32
        chunks = list(client.completions.create(model="tiny", prompt=prompt, max_tokens=32, temperature=0,
                                                stream=True, extra_body={"ignore_eos": True}))
        assert "".join(c.choices[0].text for c in chunks if c.choices) == want
        with LLM(tiny) as llm:
            cut = llm.generate([STOP_PROMPT], SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True,
                                                             stop=[stop]))[0]
        for stream in (False, True):  # usage counts the tokens up to the stop string's, as without drafts
            r = client.completions.create(model="tiny", prompt=STOP_PROMPT, max_tokens=40, temperature=0,
                                          stop=[stop], stream=stream, stream_options={"include_usage": True}
                                          if stream else None, extra_body={"ignore_eos": True})
            chunks = list(r) if stream else [r]
            assert "".join(c.choices[0].text for c in chunks if c.choices) == cut.text
            assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
            assert chunks[-1].usage.completion_tokens == len(cut.token_ids) == n
        stats = s.engine_stats()
        assert stats.num_spec_draft_tokens >= stats.num_spec_accepted_tokens > 0 and stats.num_spec_drafts > 0

        def counted() -> dict:  # the frontend has the engine's numbers from its next STATS (every 2 s)
            got = {name.removeprefix("tokenmill:spec_decode_"): v for (name, *_), v in scrape(s).items()
                   if name.startswith("tokenmill:spec_decode")}
            return got if got.get("num_drafts_total") == stats.num_spec_drafts else None

        got = wait_for(counted, 10, "the spec_decode counters in /metrics")
        assert got == {"num_drafts_total": stats.num_spec_drafts, "num_draft_tokens_total": stats.num_spec_draft_tokens,
                       "num_accepted_tokens_total": stats.num_spec_accepted_tokens}
    finally:
        s.close()
