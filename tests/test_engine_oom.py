"""A step that runs out of memory: rolled back, the engine keeps serving, the others' greedy tokens
do not change, and a request that keeps failing ends with finish reason "error"."""

from __future__ import annotations

import pytest
import torch

import engine.engine as engine_module
from engine import LLM, SamplingParams
from tests.test_engine import GREEDY, assert_all_blocks_free, prompts

BIG = list(range(100, 400))  # the request "too big for memory": every step that carries it fails


@pytest.fixture(scope="module")
def alone(tiny_llama) -> list[list[int]]:
    """Each prompt alone, no out-of-memory anywhere."""
    llm = LLM(tiny_llama, dtype="float32", num_kv_blocks=512, max_model_len=512, enable_prefix_caching=False)
    return [llm.generate(p, GREEDY)[0].token_ids for p in prompts(6)]


def fail_steps(llm: LLM, when) -> list[int]:
    """Make the runner raise ``torch.OutOfMemoryError`` for the steps where ``when(batch, n)`` holds
    (``n``: steps run so far); returns the list of failed step numbers, filled as it goes."""
    execute, failed, count = llm.engine.runner.execute, [], [0]

    def run(batch):
        n = count[0]
        count[0] += 1
        if when(batch, n):
            failed.append(n)
            raise torch.OutOfMemoryError("CUDA out of memory (test)")
        return execute(batch)

    llm.engine.runner.execute = run
    return failed


def has_big(batch, _n) -> bool:
    return any(r.prompt_token_ids == BIG for r in batch.requests)


def test_a_request_too_big_for_memory_ends_with_error_and_the_rest_finish(tiny_llama, alone):
    llm = LLM(tiny_llama, dtype="float32", num_kv_blocks=512, max_model_len=512)
    failed = fail_steps(llm, has_big)
    ps = prompts(6)
    outs = llm.generate([*ps[:3], BIG, *ps[3:]], GREEDY)
    big = outs.pop(3)
    assert (big.finish_reason, big.token_ids) == ("error", [])
    assert len(failed) == 2  # with everyone at first, then once more alone among the decodes
    assert [o.token_ids for o in outs] == alone
    assert all(o.finish_reason == "length" for o in outs)
    assert_all_blocks_free(llm)
    assert not llm.engine.scheduler.one_at_a_time  # recovered
    assert [o.token_ids for o in llm.generate(ps[:2], GREEDY)] == alone[:2]  # and still serving


def test_passing_out_of_memory_costs_nobody_anything(tiny_llama, alone):
    llm = LLM(tiny_llama, dtype="float32", num_kv_blocks=512, max_model_len=512)
    # the first step (all six prompts), then, once all six have come back one at a time (steps 1-6) and
    # decode together again, a decode step
    failed = fail_steps(llm, lambda batch, n: n in (0, 10))
    outs = llm.generate(prompts(6), GREEDY)
    assert failed == [0, 10]
    assert [o.token_ids for o in outs] == alone
    assert all(o.finish_reason == "length" for o in outs)
    assert_all_blocks_free(llm)


def test_a_lone_request_out_of_memory_ends_at_once(tiny_llama):
    llm = LLM(tiny_llama, dtype="float32", num_kv_blocks=512, max_model_len=512)
    failed = fail_steps(llm, has_big)
    out = llm.generate(BIG, GREEDY)[0]
    assert (out.finish_reason, failed) == ("error", [0])
    assert_all_blocks_free(llm)


def test_a_lone_request_out_of_memory_with_drafts_is_retried_without(tiny_llama):
    """Speculative decoding: a lone request whose step with drafts runs out of memory comes back
    without drafts (its tokens those of a run without any), and drafts resume once it has passed; one
    that fails without drafts too ends with "error"."""
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2, "prompt_lookup_min": 1}
    repeats = [5, 6, 7, 8] * 6
    want = LLM(tiny_llama, dtype="float32", num_kv_blocks=512, max_model_len=512).generate(repeats, GREEDY)[0]
    llm = LLM(tiny_llama, dtype="float32", num_kv_blocks=512, max_model_len=512, speculative_config=spec)
    failed = fail_steps(llm, lambda batch, n: batch.num_drafts > 0 and not failed)
    out = llm.generate(repeats, GREEDY)[0]
    assert len(failed) == 1 and (out.finish_reason, out.token_ids) == ("length", want.token_ids)
    s = llm.engine.scheduler
    assert not s.one_at_a_time and s.num_drafts > 0  # (drafted after the retry)
    failed = fail_steps(llm, lambda batch, n: batch.num_drafts > 0 or len(failed) == 1)
    out = llm.generate(repeats, GREEDY)[0]
    assert (out.finish_reason, len(failed)) == ("error", 2)
    assert_all_blocks_free(llm)


def test_seeded_tokens_survive_a_step_that_fails_after_sampling(tiny_llama):
    seeded = SamplingParams(max_tokens=12, temperature=1.0, seed=7, ignore_eos=True)
    ps = prompts(3)
    want = LLM(tiny_llama, dtype="float32", num_kv_blocks=512, max_model_len=512).generate(ps, seeded)
    llm = LLM(tiny_llama, dtype="float32", num_kv_blocks=512, max_model_len=512)
    execute, count = llm.engine.runner.execute, [0]

    def sample_then_fail(batch):  # the sampler has drawn its noise when memory runs out
        result = execute(batch)
        count[0] += 1
        if count[0] == 4:
            raise torch.OutOfMemoryError("CUDA out of memory (test)")
        return result

    llm.engine.runner.execute = sample_then_fail
    got = llm.generate(ps, seeded)
    assert count[0] > 4
    assert [o.token_ids for o in got] == [o.token_ids for o in want]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("overlap", ["off", "on"])
def test_a_real_cuda_out_of_memory_is_survived(tiny_llama, overlap):
    """Synchronous steps (``execute``) and, as CUDA runs by default, asynchronous ones (``launch_forward``)."""
    llm = LLM(tiny_llama, dtype="float32", device="cuda", num_kv_blocks=256, max_model_len=512,
              async_scheduling=overlap)
    ps = prompts(4)
    runner, name = llm.engine.runner, "launch_forward" if overlap == "on" else "execute"
    real = getattr(runner, name)

    def run(batch):  # the step carrying BIG asks the allocator for far more than any card has
        if has_big(batch, 0):
            torch.empty(1 << 50, dtype=torch.uint8, device="cuda")
        return real(batch)

    setattr(runner, name, run)
    outs = llm.generate([*ps[:2], BIG, *ps[2:]], GREEDY)
    assert outs.pop(2).finish_reason == "error"
    # (the exact tokens are checked on the CPU: batches of other sizes may round differently on a GPU)
    assert [(o.finish_reason, len(o.token_ids)) for o in outs] == [("length", GREEDY.max_tokens)] * 4
    assert_all_blocks_free(llm)
    assert llm.generate(ps[0], GREEDY)[0].finish_reason == "length"  # still serving


def test_recovery_ends_even_while_a_suspect_keeps_waiting(tiny_llama, monkeypatch):
    """Suspects that better-ranked arrivals keep waiting must not hold the server at one admission
    per step: the limit lifts ``OOM_RECOVERY_STEPS`` steps after the failure."""
    monkeypatch.setattr(engine_module, "OOM_RECOVERY_STEPS", 8)
    llm = LLM(tiny_llama, dtype="float32", num_kv_blocks=512, max_model_len=512, max_num_seqs=8, scheduling_policy="priority")
    fail_steps(llm, lambda _batch, n: n == 0)
    eng, ps = llm.engine, prompts(6)
    for i in range(2):
        eng.add_request(f"suspect{i}", ps[i], GREEDY, priority=1)
    flagged = []
    for step in range(20):
        eng.add_request(f"urgent{step}", ps[2 + step % 4], GREEDY, priority=0)  # one better-ranked per step
        eng.step()
        flagged.append(eng.scheduler.one_at_a_time)
    assert flagged[0] and not any(flagged[9:])
