"""Engine behaviour: batching, chunked prefill and preemption never change greedy
outputs; blocks always come back; bad requests are refused with clear errors."""

from __future__ import annotations

import copy
import random

import pytest

from engine import LLM, SamplingParams
from engine.engine import RequestError
from tests.test_sampler import Untouchable, UntouchableMap

GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 10000) for _ in range(rng.randint(5, 60))] for _ in range(n)]


@pytest.fixture(scope="module")
def reference(tiny_llama) -> list[list[int]]:
    """Each prompt alone, unchunked, with plenty of blocks and no prefix caching."""
    llm = LLM(tiny_llama, dtype="float32", num_kv_blocks=512, max_model_len=512, enable_prefix_caching=False)
    return [llm.generate(p, GREEDY)[0].token_ids for p in prompts(6)]


def assert_all_blocks_free(llm: LLM) -> None:
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks
    assert sorted([*bm.free_block_ids, *bm.evictable]) == list(range(bm.num_blocks))
    assert not any(bm.ref_counts)
    assert not llm.engine.has_work() and not llm.engine.requests


def test_batched_equals_one_at_a_time(tiny_llama, reference):
    llm = LLM(tiny_llama, dtype="float32", num_kv_blocks=512, max_model_len=512)
    outs = llm.generate(prompts(6), GREEDY)
    assert [o.token_ids for o in outs] == reference
    assert all(o.finish_reason == "length" for o in outs)
    assert_all_blocks_free(llm)


def test_chunked_prefill_equals_unchunked(tiny_llama, reference):
    llm = LLM(tiny_llama, dtype="float32", num_kv_blocks=512, max_model_len=512, max_num_batched_tokens=7)
    outs = llm.generate(prompts(6), GREEDY)
    assert [o.token_ids for o in outs] == reference
    assert_all_blocks_free(llm)


def test_preemption_keeps_outputs(tiny_llama, reference):
    # 6 requests of up to 84 tokens need ~36 blocks of 16; give them 12.
    llm = LLM(tiny_llama, dtype="float32", num_kv_blocks=12, max_model_len=512)
    outs = llm.generate(prompts(6), GREEDY)
    assert llm.engine.scheduler.num_preemptions > 0
    assert [o.token_ids for o in outs] == reference
    assert_all_blocks_free(llm)


def test_abort_frees_blocks_midway(tiny_llama):
    llm = LLM(tiny_llama, dtype="float32", num_kv_blocks=64, max_model_len=512)
    eng = llm.engine
    for i, p in enumerate(prompts(4)):
        eng.add_request(f"r{i}", p, GREEDY)
    for _ in range(3):
        eng.step()
    assert eng.block_manager.num_free_blocks < eng.block_manager.num_blocks
    eng.abort(["r0", "r2"])
    eng.abort("r1")
    eng.abort(["unknown"])  # ignored
    while eng.has_work():
        deltas = eng.step()
        assert all(d.request_id == "r3" for d in deltas)
    assert_all_blocks_free(llm)


def test_deltas_carry_counts_and_finish(tiny_llama):
    llm = LLM(tiny_llama, dtype="float32", num_kv_blocks=64, max_model_len=512)
    eng = llm.engine
    eng.add_request("x", [5, 6, 7], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True, logprobs=2))
    deltas = []
    while eng.has_work():
        deltas += eng.step()
    assert [len(d.token_ids) for d in deltas] == [1, 1, 1]
    assert [d.finish_reason for d in deltas] == [None, None, "length"]
    assert all(d.num_prompt_tokens == 3 for d in deltas)
    lp, top, _ = deltas[0].logprobs[0]
    assert lp <= 0 and len(top) == 2 and top[0][1] >= top[1][1]


def test_stop_token_ids_and_min_tokens(tiny_llama):
    llm = LLM(tiny_llama, dtype="float32", num_kv_blocks=64, max_model_len=512)
    free = llm.generate([9, 10, 11], SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True))[0]
    stop_at = free.token_ids[3]
    out = llm.generate([9, 10, 11], SamplingParams(max_tokens=10, temperature=0.0, stop_token_ids=[stop_at],
                                                   ignore_eos=True))[0]
    assert out.token_ids == free.token_ids[:free.token_ids.index(stop_at) + 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop_at
    # the stop token that ends it is no text of it (a plain token here), as in the HTTP frontends
    assert out.text == llm.tokenizer.decode(out.token_ids[:-1], skip_special_tokens=True) != llm.tokenizer.decode(
        out.token_ids, skip_special_tokens=True)
    later = llm.generate([9, 10, 11], SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True,
                                                     stop_token_ids=[free.token_ids[0]], min_tokens=2))[0]
    assert later.token_ids[0] != free.token_ids[0]  # masked until two tokens exist


def test_seeded_sampling_is_reproducible_across_batches(tiny_llama):
    llm = LLM(tiny_llama, dtype="float32", num_kv_blocks=128, max_model_len=512)
    seeded = SamplingParams(max_tokens=12, temperature=1.0, seed=1234, ignore_eos=True)
    alone = llm.generate([1, 2, 3], seeded)[0].token_ids
    mixed = llm.generate([[1, 2, 3], [4, 5], [6, 7, 8, 9]],
                         [seeded, SamplingParams(max_tokens=12, temperature=0.9),
                          SamplingParams(max_tokens=5, temperature=0.0)])
    assert mixed[0].token_ids == alone


def test_prompt_logprobs_survive_chunking(tiny_llama):
    p = prompts(1)[0]
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=1)
    whole = LLM(tiny_llama, dtype="float32", num_kv_blocks=64, max_model_len=512).generate(p, params)[0]
    chunked = LLM(tiny_llama, dtype="float32", num_kv_blocks=64, max_model_len=512, max_num_batched_tokens=5).generate(p, params)[0]
    assert len(whole.prompt_logprobs) == len(p) and whole.prompt_logprobs[0] is None
    for a, b in zip(whole.prompt_logprobs[1:], chunked.prompt_logprobs[1:], strict=True):
        assert a[0] == pytest.approx(b[0], abs=1e-4)


def test_bad_requests_are_refused(tiny_llama):
    eng = LLM(tiny_llama, dtype="float32", num_kv_blocks=32, max_model_len=256, max_num_waiting_requests=2).engine
    with pytest.raises(RequestError, match="maximum context length is 256.*250 in the prompt \\+ 10"):
        eng.add_request("a", [1] * 250, SamplingParams(max_tokens=10))
    with pytest.raises(RequestError, match="empty"):
        eng.add_request("a", [], SamplingParams())
    with pytest.raises(RequestError, match="token ids"):
        eng.add_request("a", [1, 49152], SamplingParams())
    eng.add_request("a", [1], SamplingParams())
    with pytest.raises(RequestError, match="already in use"):
        eng.add_request("a", [1], SamplingParams())
    eng.add_request("b", [1], SamplingParams())
    with pytest.raises(RequestError) as e:
        eng.add_request("c", [1], SamplingParams())
    assert e.value.status == 429
    eng.add_request("c", [1], SamplingParams(), admitted=True)  # a beam search's later round: never a 429
    assert len(eng.scheduler.waiting) == 3


def test_out_of_vocab_stop_ids_and_bias_keys_are_refused(tiny_llama):
    eng = LLM(tiny_llama, dtype="float32", num_kv_blocks=32, max_model_len=256).engine
    for params, param in ((SamplingParams(stop_token_ids=[5, 49152]), "stop_token_ids"),
                          (SamplingParams(logit_bias={49152: 1.0}), "logit_bias")):
        with pytest.raises(RequestError) as e:
            eng.add_request("a", [1, 2], params)
        assert (e.value.status, e.value.param) == (400, param)
    assert not eng.requests and not eng.has_work()
    eng.add_request("a", [1, 2], SamplingParams(stop_token_ids=[49151], logit_bias={49151: 1.0}))


def test_steps_never_walk_the_params_lists(tiny_llama):
    """Stop ids and logit_bias at their caps are read once per request, not once per step."""
    llm = LLM(tiny_llama, dtype="float32", num_kv_blocks=64, max_model_len=512)
    free = llm.generate([9, 10, 11], SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True))[0].token_ids
    filler = [t for t in range(40000, 42100) if t not in free][:2046]
    bias = {t: 0.0 for t in range(2048)}  # changes nothing, but takes the processing path
    params = [
        SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, logit_bias=bias,
                       stop_token_ids=[free[3], *filler, free[3]]),
        SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, min_tokens=2,
                       stop_token_ids=[free[0], *filler, free[0]]),
    ]
    expected = llm.generate([[9, 10, 11]] * 2, params)
    assert expected[0].token_ids == free[:free.index(free[3]) + 1] and expected[0].stop_reason == free[3]
    eng = llm.engine
    for i, p in enumerate(params):
        eng.add_request(f"r{i}", [9, 10, 11], p)
        q = copy.copy(p)
        q.stop_token_ids = Untouchable(p.stop_token_ids)
        q.logit_bias = UntouchableMap(p.logit_bias) if p.logit_bias is not None else None
        eng.requests[f"r{i}"].params = q
    got: dict[str, list[int]] = {"r0": [], "r1": []}
    last = {}
    while eng.has_work():
        for d in eng.step():
            got[d.request_id] += d.token_ids
            last[d.request_id] = (d.finish_reason, d.stop_reason)
    for i, e in enumerate(expected):
        assert got[f"r{i}"] == e.token_ids and last[f"r{i}"] == (e.finish_reason, e.stop_reason)


def test_max_model_len_never_exceeds_the_kv_cache(tiny_llama):
    eng = LLM(tiny_llama, dtype="float32", num_kv_blocks=4, max_model_len=256).engine  # 4 blocks x 16 = 64 tokens
    assert eng.max_model_len == 64 and eng.ready_info().max_model_len == 64
    eng.add_request("a", [1] * 31, SamplingParams(max_tokens=33))
    with pytest.raises(RequestError, match="maximum context length is 64"):
        eng.add_request("b", [1] * 31, SamplingParams(max_tokens=34))


def test_offline_stop_strings_and_refusals(tiny_llama):
    llm = LLM(tiny_llama, dtype="float32", num_kv_blocks=64, max_model_len=128)
    greedy = dict(temperature=0.0, ignore_eos=True)
    base = llm.generate([9, 10, 11], SamplingParams(max_tokens=6, **greedy))[0]
    words = base.text.split()
    first, last = words[0], words[-1]
    # a stop string matching at the very start leaves no text
    out = llm.generate([9, 10, 11], SamplingParams(max_tokens=6, stop=[base.text[:len(first) + 1]], **greedy))[0]
    assert out.text == "" and out.finish_reason == "stop"
    # one completed by the last allowed token is still cut
    out = llm.generate([9, 10, 11], SamplingParams(max_tokens=6, stop=[last], **greedy))[0]
    assert out.text == base.text[:base.text.rindex(last)] and out.finish_reason == "stop"
    # min_tokens: stop strings are not looked for before that many tokens
    out = llm.generate([9, 10, 11], SamplingParams(max_tokens=6, stop=[base.text[:len(first) + 1]],
                                                   min_tokens=6, **greedy))[0]
    assert out.text == base.text and out.finish_reason == "length"
    # a refused prompt leaves nothing behind in the engine
    with pytest.raises(RequestError):
        llm.generate([[1, 2], [1] * 200], SamplingParams(max_tokens=4))
    assert not llm.engine.has_work()
    assert llm.generate([9, 10, 11], SamplingParams(max_tokens=6, **greedy))[0].token_ids == base.token_ids


def test_an_eos_token_with_text_is_never_matched_by_stop_strings(tiny_llama, tmp_path):
    """The EOS that ends an output is no text, so no stop string can match in it (as the HTTP frontends)."""
    import json
    import shutil

    greedy = dict(temperature=0.0, ignore_eos=True)
    with LLM(tiny_llama, dtype="float32", num_kv_blocks=64, max_model_len=128) as llm:
        base = llm.generate([9, 10, 11], SamplingParams(max_tokens=6, **greedy))[0]
        texts = [llm.tokenizer.decode([t]) for t in base.token_ids]
    k = next(i for i in range(1, 6) if texts[i].strip() and texts[i].strip() not in "".join(texts[:i]))
    folder = shutil.copytree(tiny_llama, tmp_path / "m")  # the same model, its k-th greedy token its EOS
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": base.token_ids[k]}))
    with LLM(str(folder), dtype="float32", num_kv_blocks=64, max_model_len=128) as llm:
        out = llm.generate([9, 10, 11], SamplingParams(max_tokens=6, temperature=0.0,
                                                       stop=[texts[k].strip()]))[0]
    assert out.token_ids == base.token_ids[:k + 1]
    assert out.finish_reason == "stop" and out.stop_reason is None
    assert out.text == llm.tokenizer.decode(base.token_ids[:k], skip_special_tokens=True)


def test_config_is_validated():
    from engine.config import EngineConfig

    with pytest.raises(ValueError, match="dtype"):
        EngineConfig(dtype="float8")
    with pytest.raises(ValueError, match="block_size"):
        EngineConfig(block_size=3)
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        EngineConfig(gpu_memory_utilization=1.5)


def test_unsupported_architecture_is_named(tmp_path):
    import json

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(ValueError, match="unsupported architecture GPT2LMHeadModel.*llama, mistral, qwen2"):
        LLM(str(tmp_path))


def run_staged(llm: LLM, early: list[list[int]], late: list[list[int]], early_priority: int,
               late_priority: int, steps_between: int = 3) -> dict[str, list[int]]:
    """Add ``early``, step a few times, add ``late`` (another client's), run to completion: outputs by
    request id."""
    eng, out = llm.engine, {}
    for i, p in enumerate(early):
        eng.add_request(f"e{i}", p, GREEDY, early_priority, client="early")
    for _ in range(steps_between):
        for d in eng.step():
            out.setdefault(d.request_id, []).extend(d.token_ids)
    for i, p in enumerate(late):
        eng.add_request(f"l{i}", p, GREEDY, late_priority, client="late")
    while eng.has_work():
        for d in eng.step():
            out.setdefault(d.request_id, []).extend(d.token_ids)
    return out


@pytest.mark.parametrize("policy", ["fcfs", "priority", "short-first", "fair"])
@pytest.mark.parametrize("num_kv_blocks", [512, 12], ids=["roomy", "preempting"])
def test_policies_and_preemption_keep_outputs(tiny_llama, reference, policy, num_kv_blocks):
    llm = LLM(tiny_llama, dtype="float32", num_kv_blocks=num_kv_blocks, max_model_len=512, max_num_seqs=2,
              scheduling_policy=policy, long_prefill_token_threshold=8)
    ps = prompts(6)
    out = run_staged(llm, ps[:3], ps[3:], early_priority=5, late_priority=0)
    assert [out[f"e{i}"] for i in range(3)] + [out[f"l{i}"] for i in range(3)] == reference
    if policy in ("priority", "fair"):  # the urgent late ones (fair: the client with no seat) pushed an early
        assert llm.engine.scheduler.num_preemptions > 0  # one out of its seat
    assert llm.engine.stats().num_preemptions == llm.engine.scheduler.num_preemptions
    assert_all_blocks_free(llm)


def test_offline_priority_orders_admission(tiny_llama):
    llm = LLM(tiny_llama, dtype="float32", num_kv_blocks=64, max_model_len=256, max_num_seqs=1, scheduling_policy="priority")
    order = []
    step = llm.engine.step

    def spy():
        deltas = step()
        order.extend(d.request_id for d in deltas if d.finish_reason)
        return deltas

    llm.engine.step = spy
    outs = llm.generate(prompts(3), SamplingParams(max_tokens=2, ignore_eos=True), priority=[2, 0, 1])
    assert order == [outs[1].request_id, outs[2].request_id, outs[0].request_id]
    with pytest.raises(ValueError, match="priorities"):
        llm.generate(prompts(2), GREEDY, priority=[0])


def test_deadlines_end_requests_with_timeout(tiny_llama):
    llm = LLM(tiny_llama, dtype="float32", num_kv_blocks=64, max_model_len=256)
    eng = llm.engine
    now = [1000.0]
    eng.scheduler.clock = lambda: now[0]
    p = prompts(2)
    eng.add_request("late", p[0], GREEDY, deadline=999.0)  # already past: no token at all
    eng.add_request("slow", p[1], GREEDY, deadline=1005.0)
    deltas = eng.step()
    assert [(d.request_id, d.token_ids, d.finish_reason) for d in deltas if d.request_id == "late"] == \
        [("late", [], "timeout")]
    got = [t for d in deltas if d.request_id == "slow" for t in d.token_ids]
    got += [t for d in eng.step() for t in d.token_ids]
    now[0] = 1006.0
    (d,) = eng.step()
    assert (d.request_id, d.token_ids, d.finish_reason) == ("slow", [], "timeout") and len(got) == 2
    assert eng.stats().num_timeouts == 2
    assert_all_blocks_free(llm)


def test_server_default_timeout_applies_to_requests_without_their_own(tiny_llama):
    llm = LLM(tiny_llama, dtype="float32", num_kv_blocks=64, max_model_len=256, request_timeout=1e-9)
    out = llm.generate(prompts(1), GREEDY)[0]
    assert out.finish_reason == "timeout" and out.token_ids == []
    assert_all_blocks_free(llm)
