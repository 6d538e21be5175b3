"""Prefix caching in the engine: hits are reported, and greedy outputs are identical with it on and
off: a prefix ending mid-block, a chain partly evicted, chunked prefill, preemption, twins (n > 1),
prompt logprobs."""

from __future__ import annotations

import random

import pytest

from engine import LLM, SamplingParams
from tests.test_engine import assert_all_blocks_free

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
BS = 16


def shared_prefix_prompts(n: int, prefix_len: int = 40, seed: int = 0) -> list[list[int]]:
    """``n`` prompts that share their first ``prefix_len`` tokens (a system prompt), then differ."""
    rng = random.Random(seed)
    prefix = [rng.randrange(3, 10000) for _ in range(prefix_len)]
    return [prefix + [rng.randrange(3, 10000) for _ in range(rng.randint(3, 30))] for _ in range(n)]


def one_by_one(llm: LLM, prompts: list[list[int]], params: SamplingParams = GREEDY):
    return [llm.generate(p, params)[0] for p in prompts]


@pytest.fixture(scope="module")
def uncached(tiny_llama):
    return LLM(tiny_llama, dtype="float32", num_kv_blocks=256, max_model_len=512, enable_prefix_caching=False)


def test_a_shared_prefix_ending_mid_block_is_hit_and_outputs_are_unchanged(tiny_llama, uncached):
    prompts = shared_prefix_prompts(4)  # they diverge at token 40, inside the third block
    llm = LLM(tiny_llama, dtype="float32", num_kv_blocks=256, max_model_len=512)
    outs = one_by_one(llm, prompts)
    assert [o.num_cached_tokens for o in outs] == [0, 32, 32, 32]
    assert [o.token_ids for o in outs] == [o.token_ids for o in one_by_one(uncached, prompts)]
    s = llm.engine.stats()
    assert s.prefix_cache_hit_rate == pytest.approx(96 / sum(map(len, prompts)))
    assert s.kv_usage == 0.0 and s.num_free_blocks == 256  # cached blocks count as free
    assert_all_blocks_free(llm)


def test_a_repeated_prompt_hits_all_but_its_last_block(tiny_llama, uncached):
    p = shared_prefix_prompts(1, prefix_len=64)[0][:64]  # four whole blocks
    llm = LLM(tiny_llama, dtype="float32", num_kv_blocks=256, max_model_len=512)
    first, again = one_by_one(llm, [p, p])
    assert (first.num_cached_tokens, again.num_cached_tokens) == (0, 48)
    assert first.token_ids == again.token_ids == uncached.generate(p, GREEDY)[0].token_ids
    assert llm.reset_prefix_cache()  # vLLM's: the next prompt finds nothing cached
    cold, warm = one_by_one(llm, [p, p])
    assert (cold.num_cached_tokens, warm.num_cached_tokens) == (0, 48)
    assert cold.token_ids == warm.token_ids == first.token_ids
    assert_all_blocks_free(llm)


def test_a_hit_after_part_of_the_chain_was_evicted(tiny_llama, uncached):
    a = shared_prefix_prompts(1, prefix_len=100)[0][:100]  # 7 blocks with its outputs
    filler = shared_prefix_prompts(1, prefix_len=120, seed=1)[0][:120]  # needs 9 of the 12 blocks
    llm = LLM(tiny_llama, dtype="float32", num_kv_blocks=12, max_model_len=192)
    first, _, again = one_by_one(llm, [a, filler, a])
    bm = llm.engine.block_manager
    assert bm.num_evictions > 0
    assert 0 < again.num_cached_tokens < 96  # the head of a's chain survived, its tail did not
    assert again.token_ids == first.token_ids == uncached.generate(a, GREEDY)[0].token_ids
    assert_all_blocks_free(llm)


@pytest.mark.parametrize("budget", [7, 2048])
def test_batched_and_chunked_with_shared_prefixes(tiny_llama, uncached, budget):
    prompts = shared_prefix_prompts(6, seed=2)
    llm = LLM(tiny_llama, dtype="float32", num_kv_blocks=256, max_model_len=512, max_num_batched_tokens=budget)
    outs = llm.generate(prompts, GREEDY)
    assert [o.token_ids for o in outs] == [o.token_ids for o in one_by_one(uncached, prompts)]
    # all six arrive together: the first computes the prefix, the others hit its blocks in that same step
    assert sorted(o.num_cached_tokens for o in outs) == [0] + [32] * 5
    assert_all_blocks_free(llm)


def computed_tokens(llm: LLM) -> list[int]:
    """Counts the tokens each step computes, from now on."""
    counted = [0]
    sched = llm.engine.scheduler
    update = sched.update_from_output

    def counting(batch, seconds, rejected=None):
        counted[0] += batch.num_tokens
        update(batch, seconds, rejected)

    sched.update_from_output = counting
    return counted


@pytest.mark.parametrize("caching", [True, False])
def test_preemption_resumes_from_the_cache_and_keeps_outputs(tiny_llama, uncached, caching):
    prompts = shared_prefix_prompts(6, seed=3)
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    llm = LLM(tiny_llama, dtype="float32", num_kv_blocks=14, max_model_len=256, enable_prefix_caching=caching)
    computed = computed_tokens(llm)
    outs = llm.generate(prompts, params)
    s = llm.engine.scheduler
    assert s.num_preemptions > 0
    assert [o.token_ids for o in outs] == [o.token_ids for o in one_by_one(uncached, prompts, params)]
    assert_all_blocks_free(llm)
    # what was computed beyond each token once: recomputation after preemption, less what the cache
    # saved (the shared prefix, and a resumed request's own blocks)
    once = sum(map(len, prompts)) + 40 * len(prompts) - len(prompts)  # the last token is never computed
    redone = computed[0] - once
    if caching:
        assert redone < 0  # the cache saved more than preemption cost
    else:
        assert redone > 0


def test_twins_share_the_prompts_blocks(tiny_llama, uncached):
    """``n > 1`` reaches the engine as n requests with one prompt: one computes it, the others hit."""
    p = shared_prefix_prompts(1, prefix_len=50)[0]
    llm = LLM(tiny_llama, dtype="float32", num_kv_blocks=256, max_model_len=512)
    eng = llm.engine
    for i in range(4):
        eng.add_request(f"t{i}", p, GREEDY)
    peak_used = 0
    tokens: dict[str, list[int]] = {f"t{i}": [] for i in range(4)}
    while eng.has_work():
        for d in eng.step():
            tokens[d.request_id] += d.token_ids
        peak_used = max(peak_used, llm.engine.block_manager.num_used_blocks)
    want = uncached.generate(p, GREEDY)[0].token_ids
    assert all(t == want for t in tokens.values())
    assert eng.scheduler.num_cached_prompt_tokens == 3 * ((len(p) - 1) // BS) * BS
    # alone one needs ceil((len + 12) / 16) blocks; four sharing the prompt's full blocks need far fewer
    alone = -(-(len(p) + 12) // BS)
    assert peak_used <= alone + 3 * (alone - (len(p) - 1) // BS)
    assert_all_blocks_free(llm)


def test_prompt_logprobs_are_computed_even_when_cached(tiny_llama):
    p = shared_prefix_prompts(1, prefix_len=50)[0]
    llm = LLM(tiny_llama, dtype="float32", num_kv_blocks=256, max_model_len=512)
    with_lp = SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=1)
    first = llm.generate(p, with_lp)[0]
    llm.generate(p, GREEDY)  # now p is cached
    again = llm.generate(p, with_lp)[0]
    assert again.num_cached_tokens == 0  # it needs every prompt position's logits
    assert len(again.prompt_logprobs) == len(p)
    for x, y in zip(first.prompt_logprobs[1:], again.prompt_logprobs[1:], strict=True):
        assert x[0] == pytest.approx(y[0], abs=1e-4)
    assert again.token_ids == first.token_ids


def test_stats_report_fragmentation_and_usage(tiny_llama):
    llm = LLM(tiny_llama, dtype="float32", num_kv_blocks=64, max_model_len=512)
    eng = llm.engine
    eng.add_request("a", list(range(3, 23)), GREEDY)  # 20 tokens: two blocks, 12 empty slots
    eng.step()  # the prompt is computed, the first token sampled (not yet in the cache)
    s = eng.stats()
    assert (s.num_running, s.num_free_blocks, s.num_kv_blocks) == (1, 62, 64)
    assert s.kv_usage == pytest.approx(2 / 64)
    assert s.kv_fragmentation == pytest.approx(12 / 32)
    assert s.num_evictions == 0


def test_disabled_prefix_caching_reports_no_hits(tiny_llama):
    p = shared_prefix_prompts(1)[0]
    llm = LLM(tiny_llama, dtype="float32", num_kv_blocks=64, max_model_len=512, enable_prefix_caching=False)
    assert [o.num_cached_tokens for o in one_by_one(llm, [p, p])] == [0, 0]
    assert llm.engine.stats().prefix_cache_hit_rate == 0.0


def test_a_preempted_request_resumes_from_its_own_cached_blocks(tiny_llama, uncached):
    a_prompt, b_prompt = shared_prefix_prompts(1, prefix_len=40, seed=4)[0][:40], [7] * 40
    a_params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    b_params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    llm = LLM(tiny_llama, dtype="float32", num_kv_blocks=16, max_model_len=256, max_num_seqs=1, scheduling_policy="priority")
    eng, per_request = llm.engine, {}
    update = eng.scheduler.update_from_output

    def counting(batch, seconds, rejected=None):
        for r, n in zip(batch.requests, batch.num_new_tokens, strict=True):
            per_request[r.request_id] = per_request.get(r.request_id, 0) + n
        update(batch, seconds, rejected)

    eng.scheduler.update_from_output = counting
    eng.add_request("a", a_prompt, a_params, priority=5)
    tokens = {"a": [], "b": []}
    for _ in range(10):  # a has 40 + 9 tokens in the cache: three full blocks
        for d in eng.step():
            tokens[d.request_id] += d.token_ids
    eng.add_request("b", b_prompt, b_params, priority=0)  # more urgent: takes a's only seat
    while eng.has_work():
        for d in eng.step():
            tokens[d.request_id] += d.token_ids
    assert eng.scheduler.num_preemptions == 1
    assert tokens["a"] == uncached.generate(a_prompt, a_params)[0].token_ids
    # a computed each of its 69 tokens once, and again only those after its cached 48
    assert per_request["a"] == 69 + (40 + 10 - 1) - 48


def test_a_step_that_fails_leaves_no_uncomputed_block_findable(tiny_llama, uncached):
    p = shared_prefix_prompts(1, prefix_len=40)[0]
    llm = LLM(tiny_llama, dtype="float32", num_kv_blocks=64, max_model_len=512)
    runner = llm.engine.runner
    execute = runner.execute

    def interrupted(batch):
        runner.execute = execute  # once
        raise KeyboardInterrupt

    runner.execute = interrupted
    with pytest.raises(KeyboardInterrupt):  # twins: the second hits blocks the first was to fill
        llm.generate([p, p], GREEDY)
    assert not llm.engine.has_work() and llm.engine.block_manager.cached == {}
    assert_all_blocks_free(llm)
    again = llm.generate(p, GREEDY)[0]
    assert again.num_cached_tokens == 0 and again.token_ids == uncached.generate(p, GREEDY)[0].token_ids
