"""Asynchronous scheduling (step N+1 scheduled and launched while step N runs), run on the CPU, where
it only changes the order of the host's work: outputs are token for token those of synchronous
steps, no token follows a finish, and every block comes back, through chunked prefill, stop tokens,
aborts, timeouts, preemption, prefix-cache hits, penalties (bad words' sampling waits for the step before),
seeded sampling and an out-of-memory step."""

from __future__ import annotations

import time

import pytest
import torch

from engine import LLM, SamplingParams
from engine.cli import _config_kwargs, build_parser
from engine.config import EngineConfig
from engine.step_buffers import DecodeGraphs, decode_buckets
from tests.test_engine import GREEDY, assert_all_blocks_free, prompts
from tests.test_engine_oom import BIG, has_big
from tests.test_prefix_caching import shared_prefix_prompts

# float32: the prefill cap learns from step times, so under load the two modes may batch differently,
# and only float32 keeps greedy tokens through any batching (bf16 is not batch-invariant)
KW = dict(num_kv_blocks=256, max_model_len=512, dtype="float32")


def pair(tiny_llama, **kw) -> tuple[LLM, LLM]:
    """The same engine with synchronous and with asynchronous steps."""
    kw = {**KW, **kw}
    return LLM(tiny_llama, async_scheduling="off", **kw), LLM(tiny_llama, async_scheduling="on", **kw)


def drive(llm: LLM, requests: list[tuple[list[int], SamplingParams]]) -> dict[str, tuple]:
    """Add ``requests`` (ids "0", "1", ...) and step until done: each one's (tokens, finish reason,
    stop reason, cached tokens). Asserts that no delta follows a request's finish."""
    eng = llm.engine
    for i, (p, params) in enumerate(requests):
        eng.add_request(str(i), p, params)
    tokens: dict[str, list[int]] = {str(i): [] for i in range(len(requests))}
    ends: dict[str, tuple] = {}
    while eng.has_work():
        for d in eng.step():
            assert d.request_id not in ends, f"a delta for {d.request_id} after its finish"
            tokens[d.request_id] += d.token_ids
            if d.finish_reason is not None:
                ends[d.request_id] = (d.finish_reason, d.stop_reason, d.num_cached_tokens)
    assert_all_blocks_free(llm)
    return {rid: (tokens[rid], *ends[rid]) for rid in tokens}


def launches(llm: LLM) -> tuple[list[bool], list[bool]]:
    """Record, for each step launched from now on, whether another step was in flight when its forward was
    launched, and whether it still was when its sampling was (its tokens not yet collected)."""
    eng, forwards, samplings, flying = llm.engine, [], [], [None]
    launch, collect, sample = eng._launch, eng._collect, eng.runner.launch_sampling

    def launching(out, batch, prev):
        flying[0] = prev
        if batch:  # (an empty one launches nothing)
            forwards.append(prev is not None)
        return launch(out, batch, prev)

    def collecting(flight):
        if flight is flying[0]:
            flying[0] = None
        return collect(flight)

    def sampling(launched):
        samplings.append(flying[0] is not None)
        return sample(launched)

    eng._launch, eng._collect, eng.runner.launch_sampling = launching, collecting, sampling
    return forwards, samplings


def mixed(tiny_llama) -> list[tuple[list[int], SamplingParams]]:
    """Prompts of different lengths, max_tokens from 1 up, and stop tokens that end two of them early
    (taken from a synchronous run without them)."""
    ps = prompts(6, seed=3)
    limits = [1, 24, 2, 17, 9, 24]
    free = LLM(tiny_llama, async_scheduling="off", **KW).generate(
        ps, [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True) for m in limits])
    stops = {1: free[1].token_ids[5], 3: free[3].token_ids[0]}
    return [(p, SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True,
                               stop_token_ids=[stops[i]] if i in stops else []))
            for i, (p, m) in enumerate(zip(ps, limits, strict=True))]


def test_greedy_outputs_are_those_of_synchronous_steps(tiny_llama):
    reqs = mixed(tiny_llama)
    sync, overlapped = pair(tiny_llama, max_num_batched_tokens=24)  # prompts of up to 60 tokens: chunked
    seen, _ = launches(overlapped)
    want = drive(sync, reqs)
    assert drive(overlapped, reqs) == want
    assert sum(seen) > 0.8 * len(seen)  # steps did overlap
    assert [len(t) for t, *_ in want.values()] == [1, 6, 2, 1, 9, 24]  # no token past a finish
    assert [r for _, r, *_ in want.values()] == ["length", "stop", "length", "stop", "length", "length"]


def test_a_step_stays_in_flight_across_calls(tiny_llama):
    llm = LLM(tiny_llama, async_scheduling="on", **KW)
    eng = llm.engine
    eng.add_request("a", [5, 6, 7], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
    assert not eng.step()  # the prompt's step is launched, not yet collected
    assert eng.has_work() and eng.requests["a"].num_in_flight == 1
    (first,) = eng.step()  # the second step launched with the first's token as its input
    assert first.token_ids and eng.requests["a"].num_in_flight == 1
    (second,) = eng.step()  # the third is not launched: the second's token is the last
    (third,) = eng.step()
    assert third.finish_reason == "length" and not eng.has_work()
    sync = LLM(tiny_llama, async_scheduling="off", **KW).generate([5, 6, 7], SamplingParams(
        max_tokens=3, temperature=0.0, ignore_eos=True))[0]
    assert [*first.token_ids, *second.token_ids, *third.token_ids] == sync.token_ids
    assert_all_blocks_free(llm)


def test_an_aborted_request_with_a_token_in_flight_emits_nothing_more(tiny_llama):
    sync, overlapped = pair(tiny_llama)
    ps = prompts(3)
    want = sync.generate(ps, GREEDY)
    eng = overlapped.engine
    for i, p in enumerate(ps):
        eng.add_request(str(i), p, GREEDY)
    got = {"0": [], "1": [], "2": []}
    for _ in range(4):
        for d in eng.step():
            got[d.request_id] += d.token_ids
    assert eng.requests["1"].num_in_flight == 1
    eng.abort("1")
    while eng.has_work():
        for d in eng.step():
            assert d.request_id != "1"
            got[d.request_id] += d.token_ids
    assert got["0"] == want[0].token_ids and got["2"] == want[2].token_ids
    assert got["1"] == want[1].token_ids[:3]
    assert_all_blocks_free(overlapped)


def test_a_timeout_with_a_token_in_flight_ends_the_request_there(tiny_llama):
    llm = LLM(tiny_llama, async_scheduling="on", **KW)
    eng, now = llm.engine, [1000.0]
    eng.scheduler.clock = lambda: now[0]
    eng.add_request("slow", prompts(1)[0], GREEDY, deadline=1005.0)
    got = [t for _ in range(3) for d in eng.step() for t in d.token_ids]
    assert len(got) == 2 and eng.requests["slow"].num_in_flight == 1
    now[0] = 1006.0
    (d,) = eng.step()  # its third token, in flight, is dropped
    assert (d.request_id, d.token_ids, d.finish_reason) == ("slow", [], "timeout")
    assert not eng.step() and not eng.has_work()
    assert_all_blocks_free(llm)


def test_preemption_keeps_outputs(tiny_llama):
    reqs = [(p, GREEDY) for p in prompts(6)]
    sync, overlapped = pair(tiny_llama, num_kv_blocks=12)  # 6 requests of up to 84 tokens, 12 blocks of 16
    preempted_in_flight = []
    preempt = overlapped.engine.scheduler._preempt

    def recording(req, batch):
        preempted_in_flight.append(req.num_in_flight)
        preempt(req, batch)

    overlapped.engine.scheduler._preempt = recording
    want = drive(sync, reqs)
    assert drive(overlapped, reqs) == want
    assert any(preempted_in_flight)  # a request was preempted with its token in flight, and came back
    assert want == drive(LLM(tiny_llama, async_scheduling="off", **KW), reqs)  # preemption costs nothing


def test_prefix_cache_hits_include_blocks_filled_by_tokens_that_were_in_flight(tiny_llama):
    p = shared_prefix_prompts(1, prefix_len=30)[0][:30]
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    for llm in pair(tiny_llama):
        out = llm.generate(p, params)[0]
        # the third block holds 14 generated tokens, the last of them decoded from a token in flight
        follow_up = p + out.token_ids[:19]
        again = llm.generate([p, follow_up], params)
        assert [o.num_cached_tokens for o in again] == [16, 48]
        assert again[0].token_ids == out.token_ids
        assert_all_blocks_free(llm)


def test_penalties_count_the_token_in_flight_and_their_steps_overlap(tiny_llama):
    """Penalties read a request's token still in flight on the device: their steps overlap, with the tokens of
    synchronous steps (vLLM's rules over the output, llama.cpp's window over the context's last tokens, greedy
    and seeded). Bad words, read on the host, make the steps' sampling wait, not their forward."""
    rules = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, frequency_penalty=2.0)
    window = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, repetition_penalty=4.0, repeat_last_n=4)
    seeded = SamplingParams(max_tokens=16, temperature=1.0, seed=3, ignore_eos=True, frequency_penalty=2.0)
    sync, overlapped = pair(tiny_llama)
    seen, sampled_behind = launches(overlapped)
    ps = prompts(4, seed=5)
    reqs = [(ps[0], rules), (ps[1], window), (ps[2], seeded), (ps[3], GREEDY)]
    got = drive(overlapped, reqs)
    assert got == drive(sync, reqs)
    assert sum(seen) >= len(seen) - 2  # (all but the first steps: prompts, then their first decode)
    assert sampled_behind == seen
    free = drive(sync, [(p, GREEDY) for p in ps[:2]])
    assert got["0"][0] != free["0"][0] and got["1"][0] != free["1"][0]  # (the penalties bite)
    seen.clear()
    sampled_behind.clear()
    banned = [SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, bad_words=["x"],
                             bad_words_token_ids=[[free["0"][0][3]]])]
    assert drive(overlapped, [(ps[0], banned[0])]) == drive(sync, [(ps[0], banned[0])])
    assert all(seen[1:]) and not any(sampled_behind)  # each forward behind the step before, not the sampling


def test_grammars_dry_and_mirostat_sample_once_the_step_before_is_collected(tiny_llama):
    """A grammar's next mask (and DRY's, mirostat's rows) needs the token in flight on the host: a step's forward
    is launched behind the step in flight, which is collected (its grammars advanced) before the step's sampling.
    Tokens and finishes as in synchronous steps, where requests end with their next step launched (a grammar past
    its end allows only the end of sequence there)."""
    sync, overlapped = pair(tiny_llama)
    forwards, samplings = launches(overlapped)
    ps = prompts(5, seed=11)
    reqs = [(ps[0], SamplingParams(max_tokens=40, temperature=0.0, regex="(yes|no|maybe)[0-9]{1,3}")),
            (ps[1], SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, dry_multiplier=2.0,
                                   dry_allowed_length=1, dry_breaker_token_ids=[])),
            (ps[2], SamplingParams(max_tokens=16, temperature=1.0, seed=4, mirostat=2, ignore_eos=True)),
            (ps[3], SamplingParams(max_tokens=40, temperature=1.0, seed=8, regex="[a-c]{3,9}")),
            (ps[4], GREEDY)]
    got = drive(overlapped, reqs)
    assert got == drive(sync, reqs)
    assert got["0"][1] == got["3"][1] == "stop" and len(got["0"][0]) < 40  # (ended by their grammars)
    assert len(forwards) > 16 and all(forwards[1:])
    assert not any(samplings[:14]) and any(samplings)  # (DRY's and mirostat's 16 tokens; the greedy row's last ones)


def test_out_of_memory_in_a_sampling_that_waited_for_the_step_before(tiny_llama):
    """A step's sampling that fails after its forward ran and the step before was collected in between (a
    grammar in it): the step is rolled back (its requests wait again, recomputed), the tokens collected are
    kept, and the outputs are those of synchronous steps."""
    sync, overlapped = pair(tiny_llama)
    ps = prompts(3, seed=12)
    reqs = [(ps[0], SamplingParams(max_tokens=30, temperature=0.0, regex="[a-z]{2,12}!")), (ps[1], GREEDY),
            (ps[2], GREEDY)]
    eng, calls, failed = overlapped.engine, [], []
    sample = eng.runner.launch_sampling

    def run(launched):
        calls.append(len(launched.sampled))
        if not failed and len(calls) > 1 and len(launched.sampled) == 3:
            failed.append(len(calls) - 1)
            raise torch.OutOfMemoryError("CUDA out of memory (test)")
        return sample(launched)

    eng.runner.launch_sampling = run
    _, behind = launches(overlapped)
    assert drive(overlapped, reqs) == drive(sync, reqs)
    assert failed and not behind[failed[0]] and eng.scheduler.num_preemptions == 3


def test_seeded_sampling_min_tokens_and_logprobs_match(tiny_llama):
    params = [SamplingParams(max_tokens=12, temperature=1.0, seed=7, ignore_eos=True, logprobs=2),
              SamplingParams(max_tokens=10, temperature=0.8, top_k=20, seed=11, min_tokens=6, logprobs=0),
              SamplingParams(max_tokens=8, temperature=0.0, min_tokens=5, stop_token_ids=[3, 4])]
    ps = prompts(3, seed=9)
    sync, overlapped = pair(tiny_llama)
    want, got = sync.generate(ps, params), overlapped.generate(ps, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    for g, w in zip(got, want, strict=True):
        assert (g.logprobs is None) == (w.logprobs is None)
        for (glp, gtop, _), (wlp, wtop, _) in zip(g.logprobs or [], w.logprobs or [], strict=True):
            assert glp == pytest.approx(wlp, abs=1e-5) and [t for t, _ in gtop] == [t for t, _ in wtop]
    assert_all_blocks_free(overlapped)


def test_decode_steps_padded_and_replayed_as_on_cuda(tiny_llama):
    """Decode steps padded to the graph batch sizes and run through the static buffers a CUDA graph
    replays (captured here as the eager forward itself): the tokens gathered from the step in flight
    reach them. 7 prompts in 14 blocks: preemption too."""
    reqs = [(p, GREEDY) for p in prompts(7)]
    sync, overlapped = pair(tiny_llama, num_kv_blocks=14, max_num_seqs=8, max_model_len=256)
    runner, f = overlapped.engine.runner, overlapped.engine.runner.facts
    runner.decode_buckets = decode_buckets(8)
    runner.graphs = DecodeGraphs(runner.model, runner.decode_buckets, f.max_model_len, runner.block_tables,
                                 runner.block_size, runner.model_cfg.hidden_size, f.dtype, f.device,
                                 capture=lambda forward: forward)
    gathered = []
    forward_step = runner.forward_step

    def counting(step):
        gathered.append(step.token_ids.count(-1))  # (tokens in flight: read from last_tokens)
        return forward_step(step)

    runner.forward_step = counting
    assert drive(overlapped, reqs) == drive(sync, reqs)
    assert overlapped.engine.scheduler.num_preemptions > 0 and max(gathered) > 1


def test_a_step_out_of_memory_while_another_is_in_flight(tiny_llama):
    sync, overlapped = pair(tiny_llama)
    ps = prompts(4)
    alone = [sync.generate(p, GREEDY)[0].token_ids for p in ps]
    eng = overlapped.engine
    launch, failed, (behind, _) = eng.runner.launch_forward, [], launches(overlapped)

    def run(batch):
        if has_big(batch, 0):
            failed.append(behind[-1])
            raise torch.OutOfMemoryError("CUDA out of memory (test)")
        return launch(batch)

    eng.runner.launch_forward = run
    tokens: dict[str, list[int]] = {str(i): [] for i in range(4)}
    ends: dict[str, str] = {}

    def step() -> None:
        for d in eng.step():
            assert d.request_id not in ends
            tokens.setdefault(d.request_id, []).extend(d.token_ids)
            if d.finish_reason is not None:
                ends[d.request_id] = d.finish_reason

    for i, p in enumerate(ps[:2]):
        eng.add_request(str(i), p, GREEDY)
    step()
    step()
    for rid, p in [("big", BIG), ("2", ps[2]), ("3", ps[3])]:  # join while a step is in flight
        eng.add_request(rid, p, GREEDY)
    while eng.has_work():
        step()
    assert (ends.pop("big"), tokens.pop("big")) == ("error", [])
    # behind a step in flight both times: the second time beside fellows whose tokens were in flight (so
    # no suspects: they survive it, suspects again, and only BIG, failing twice, ends)
    assert failed == [True, True]
    assert [tokens[str(i)] for i in range(4)] == alone
    assert all(r == "length" for r in ends.values())
    assert_all_blocks_free(overlapped)


def test_out_of_memory_at_once_ends_only_the_culprit(tiny_llama):
    """Submitted together, the step that carries BIG fails; its fellows come back one at a time. One
    whose next token is in flight has had its step's memory (a CUDA allocation fails at launch): it is
    no suspect when BIG's next step fails beside it. (Counted a suspect until the token came back, it
    ended with "error" too: the GPU run's CUDA test found it.)"""
    sync, overlapped = pair(tiny_llama)
    ps = prompts(4)
    alone = [sync.generate(p, GREEDY)[0].token_ids for p in ps]
    launch = overlapped.engine.runner.launch_forward

    def run(batch):
        if has_big(batch, 0):
            raise torch.OutOfMemoryError("CUDA out of memory (test)")
        return launch(batch)

    overlapped.engine.runner.launch_forward = run
    outs = overlapped.generate([*ps[:2], BIG, *ps[2:]], GREEDY)
    assert outs.pop(2).finish_reason == "error"
    assert [o.token_ids for o in outs] == alone and all(o.finish_reason == "length" for o in outs)
    assert_all_blocks_free(overlapped)


def test_the_setting(tiny_llama):
    parse = build_parser().parse_args
    assert _config_kwargs(parse(["generate", "--prompt", "x", "--async-scheduling", "on"]))["async_scheduling"] == "on"
    assert "async_scheduling" not in _config_kwargs(parse(["generate", "--prompt", "x"]))
    assert EngineConfig().async_scheduling == "auto"
    with pytest.raises(ValueError, match="async_scheduling"):
        EngineConfig(async_scheduling="yes")
    assert LLM(tiny_llama, device="cpu", **KW).engine.async_scheduling is False  # auto: off on the CPU
    assert LLM(tiny_llama, device="cpu", async_scheduling="on", **KW).engine.async_scheduling is True


def test_the_prefill_cap_learns_each_steps_own_time(tiny_llama):
    """Launch to collect spans the next step's launch (on the CPU its whole forward): the prefill cap
    must learn a step's own time, which on the CPU is its launch's."""
    llm = LLM(tiny_llama, async_scheduling="on", **KW)
    runner, sched, seen = llm.engine.runner, llm.engine.scheduler, []
    forward, observe = runner.forward_step, sched.observe

    def slow_forward(step):
        time.sleep(0.2)  # the rest of a tiny step takes milliseconds: two launches would be 0.4 s at least
        return forward(step)

    runner.forward_step = slow_forward
    sched.observe = lambda batch, seconds: seen.append(seconds) or observe(batch, seconds)
    llm.generate([[1, 2, 3, 4]], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
    assert len(seen) == 6 and all(0.2 <= s < 0.4 for s in seen), seen  # one launch each, never two


def test_a_step_stays_in_flight_when_scheduling_raises(tiny_llama):
    llm = LLM(tiny_llama, async_scheduling="on", **KW)
    eng = llm.engine
    eng.add_request("a", [1, 2, 3], SamplingParams(max_tokens=4, temperature=0.0))
    eng.step()
    in_flight = eng._in_flight
    assert in_flight is not None
    schedule = eng.scheduler.schedule
    eng.scheduler.schedule = lambda: (_ for _ in ()).throw(KeyboardInterrupt())
    with pytest.raises(KeyboardInterrupt):
        eng.step()
    assert eng._in_flight is in_flight  # not lost: the next step collects it
    eng.scheduler.schedule = schedule
    tokens = []
    while eng.has_work():
        tokens += [t for d in eng.step() for t in d.token_ids]
    assert len(tokens) == 4
    assert_all_blocks_free(llm)


def test_a_step_collected_before_the_next_ones_sampling_is_not_put_back_in_flight(tiny_llama):
    """Where the next step's sampling waits for the step in flight (a grammar), that step is collected between
    the next one's forward and sampling. Should its postprocessing raise (an interrupt), it is not put back in
    flight to be collected twice (its tokens' counts would go negative); the next step, launched, is rolled back.
    Should its collecting raise, it stays in flight."""
    llm = LLM(tiny_llama, async_scheduling="on", **KW)
    eng = llm.engine
    eng.add_request("g", [1, 2, 3], SamplingParams(max_tokens=8, temperature=0.0, regex="[a-z]{6,8}"))
    eng.step()
    in_flight, postprocess, collect = eng._in_flight, eng._postprocess, eng.runner.collect
    eng._postprocess = lambda out, ended, result: (_ for _ in ()).throw(KeyboardInterrupt())
    with pytest.raises(KeyboardInterrupt):
        eng.step()
    assert eng._in_flight is None and eng.requests["g"].num_in_flight == 0
    eng._postprocess = postprocess
    eng.step()
    in_flight = eng._in_flight
    eng.runner.collect = lambda launched: (_ for _ in ()).throw(KeyboardInterrupt())
    with pytest.raises(KeyboardInterrupt):
        eng.step()
    assert eng._in_flight is in_flight
    eng.runner.collect = collect
    while eng.has_work():
        eng.step()
    assert all(r.num_in_flight == 0 for r in eng.requests.values())
    assert_all_blocks_free(llm)


def test_prompt_logprobs_chunked_and_overlapped(tiny_llama):
    """Prompt logprobs come back with the step that computed them (``collect``), not at its launch: with a
    long prompt in chunks beside streams that decode, both modes give the same logprobs and tokens."""
    params = [SamplingParams(max_tokens=6, temperature=0.0, prompt_logprobs=2),
              SamplingParams(max_tokens=9, temperature=0.0)]
    long_prompt = prompts(1)[0] * 3
    off, on = pair(tiny_llama, num_kv_blocks=64, max_model_len=512, max_num_batched_tokens=16)
    a, b = (llm.generate([long_prompt, prompts(2)[1]], params) for llm in (off, on))
    assert len(b[0].prompt_logprobs) == len(long_prompt) and b[0].prompt_logprobs[0] is None
    for x, y in zip(a[0].prompt_logprobs[1:], b[0].prompt_logprobs[1:], strict=True):
        assert x[0] == pytest.approx(y[0], abs=1e-5) and [t for t, _ in x[1]] == [t for t, _ in y[1]]
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
