"""The batched sampler: greedy, seeds, top-k/top-p/min-p, penalties, min_tokens, logprobs.

Pure torch on small hand-made logits; no model.
"""

from __future__ import annotations

import copy
import math

import numpy as np
import pytest
import torch

from engine.protocol import SamplingParams, unpack_top
from engine.sampler import (
    _SEED_MASK,
    Sampler,
    SamplingState,
    _row_keys,
    apply_min_p,
    apply_top_k_top_p,
    logprob_entries,
    logprob_tensors,
    process_logits,
)
from kernels import reference

EOS = 2
PROBS = [0.5, 0.2, 0.15, 0.1, 0.05]


def _call(sampler: Sampler, logits: torch.Tensor, params: list[SamplingParams], states=None,
          prompts=None, outputs=None):
    n = len(params)
    states = states if states is not None else [SamplingState(p) for p in params]
    prompts = prompts if prompts is not None else [[] for _ in range(n)]
    outputs = outputs if outputs is not None else [[] for _ in range(n)]
    return sampler(logits, params, states, prompts, outputs)


def _support(params: SamplingParams, n: int = 4000) -> set[int]:
    """Which tokens of PROBS can ``params`` ever pick (n draws in one batch)."""
    sampler = Sampler(len(PROBS), [], "cpu", seed=1)
    logits = torch.tensor(PROBS).log().expand(n, -1).contiguous()
    return set(_call(sampler, logits, [params] * n).token_ids)


# ----------------------------------------------------------------------------- greedy


def test_greedy_is_argmax_on_the_fast_path():
    torch.manual_seed(0)
    logits = torch.randn(6, 100)
    out = _call(Sampler(100, [EOS], "cpu"), logits, [SamplingParams(temperature=0.0)] * 6)
    assert out.token_ids == logits.argmax(-1).tolist()
    assert out.logprobs is None


def test_greedy_picks_the_first_of_equal_largest_as_argmax_does():
    """bf16 logits tie often: the fast path's ids (``max``'s indices, faster on the CPU) are argmax's, the first of
    equal largest, a NaN counting as largest, infinities among ties."""
    gen = torch.Generator().manual_seed(0)
    logits = (torch.randn(64, 3000, generator=gen) * 2).round().bfloat16()  # (integers: ties everywhere)
    logits[1, [5, 9]], logits[2, 40], logits[3, [0, 2999]] = float("inf"), float("nan"), 1e4
    out = _call(Sampler(3000, [EOS], "cpu"), logits, [SamplingParams(temperature=0.0)] * 64)
    assert out.token_ids == logits.argmax(-1).tolist() == logits.float().argmax(-1).tolist()
    assert out.token_ids[1:4] == [5, 40, 0]


def test_greedy_with_logprobs_is_still_argmax():
    torch.manual_seed(0)
    logits = torch.randn(4, 50)
    out = _call(Sampler(50, [EOS], "cpu"), logits, [SamplingParams(temperature=0.0, logprobs=0)] * 4)
    assert out.token_ids == logits.argmax(-1).tolist()


def test_bf16_logits_sample_as_their_float32_values():
    """The LM head's logits come in the model's dtype (``LMHead``): each row samples what the same values in
    float32 sample, greedy on the fast path or not, seeded, penalized, with logprobs."""
    torch.manual_seed(0)
    logits = torch.randn(4, 40).bfloat16()
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.0, logprobs=2),
              SamplingParams(temperature=0.7, seed=3, logprobs=1), SamplingParams(temperature=0.0, presence_penalty=1.5)]
    outputs = [[], [], [], logits[3].float().topk(2).indices.tolist()]  # (penalized: its output holds its two best)
    got, want = (_call(Sampler(40, [EOS], "cpu"), x, params, outputs=outputs) for x in (logits, logits.float()))
    assert got.token_ids == want.token_ids and got.logprobs == want.logprobs
    assert got.token_ids[:2] == logits.float().argmax(-1).tolist()[:2] and len(unpack_top(got.logprobs[1][1])) == 2
    fast = _call(Sampler(40, [EOS], "cpu"), logits, [SamplingParams(temperature=0.0)] * 4)
    assert fast.token_ids == logits.float().argmax(-1).tolist()


def test_padded_vocab_columns_are_never_sampled():
    logits = torch.zeros(2, 12)
    logits[:, 10:] = 100.0  # lm_head padding beyond the tokenizer's vocab
    out = _call(Sampler(10, [EOS], "cpu"), logits, [SamplingParams(temperature=0.0), SamplingParams(seed=1)])
    assert all(t < 10 for t in out.token_ids)


# ----------------------------------------------------------------------------- seeds


def _run_steps(sampler: Sampler, rows: list[tuple[SamplingParams, SamplingState, int]], steps: int,
               vocab: int = 64, device: str = "cpu") -> list[list[int]]:
    """Sample ``steps`` tokens for every row; row i's logits depend only on its key and the step."""
    outs: list[list[int]] = [[] for _ in rows]
    for step in range(steps):
        logits = torch.stack([
            torch.randn(vocab, generator=torch.Generator().manual_seed(1000 * key + step)) for _, _, key in rows
        ]).to(device)
        res = sampler(logits, [p for p, _, _ in rows], [s for _, s, _ in rows],
                      [[1, 2, 3] for _ in rows], [list(o) for o in outs])
        for o, t in zip(outs, res.token_ids, strict=True):
            o.append(t)
    return outs


def test_seeded_request_is_independent_of_the_batch():
    p = SamplingParams(temperature=1.0, top_p=0.95, seed=1234)
    alone = _run_steps(Sampler(64, [EOS], "cpu", seed=0), [(p, SamplingState(p), 7)], steps=8)[0]

    others = [
        SamplingParams(temperature=0.8),  # unseeded: engine generator
        SamplingParams(temperature=1.2, seed=99, top_k=5),  # another seeded row
        SamplingParams(temperature=0.0),  # greedy row
        SamplingParams(temperature=1.0, presence_penalty=1.0, logprobs=3),
    ]
    rows = [(o, SamplingState(o), key) for key, o in enumerate(others, start=20)]
    rows.insert(2, (p, SamplingState(p), 7))  # the same request, mid-batch
    in_batch = _run_steps(Sampler(64, [EOS], "cpu", seed=5), rows, steps=8)[2]
    assert in_batch == alone

    # and the seed matters: another seed gives another sequence
    q = SamplingParams(temperature=1.0, top_p=0.95, seed=4321)
    other_seed = _run_steps(Sampler(64, [EOS], "cpu"), [(q, SamplingState(q), 7)], steps=8)[0]
    assert other_seed != alone


def test_unseeded_rows_follow_the_engine_seed():
    p = SamplingParams(temperature=1.0)
    a = _run_steps(Sampler(64, [EOS], "cpu", seed=3), [(p, SamplingState(p), k) for k in range(4)], 5)
    b = _run_steps(Sampler(64, [EOS], "cpu", seed=3), [(p, SamplingState(p), k) for k in range(4)], 5)
    c = _run_steps(Sampler(64, [EOS], "cpu", seed=4), [(p, SamplingState(p), k) for k in range(4)], 5)
    assert a == b
    assert a != c


def _reference_noise(k0: int, k1: int, vocab: int) -> list[float]:
    """The seeded noise's spec in plain Python integers (no overflow anywhere)."""
    def mix(x: int) -> int:
        x ^= x >> 16
        x = x * 0x21F0AAAD & 0xFFFFFFFF
        x ^= x >> 15
        x = x * 0x735A2D97 & 0xFFFFFFFF
        return x ^ (x >> 15)
    return [-math.log(((mix(mix(v ^ k0) ^ k1) >> 9) + 0.5) / 2**23) for v in range(vocab)]


def _splitmix64_spec(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _SEED_MASK
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _SEED_MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _SEED_MASK
    return x ^ (x >> 31)


def test_seeded_noise_is_exactly_its_integer_spec():
    # every lane stays below 2**63, so any device's int64 ops give the spec's bits (CUDA as the CPU);
    # only the float32 log may differ from Python's by rounding
    pairs = [(0, 0), (1234, 7), (_SEED_MASK, 2**31), (-5 & _SEED_MASK, 1), (2**63 + 12345, 2**40 + 3)]
    spec = (_splitmix64_spec(seed ^ _splitmix64_spec(index)) for seed, index in pairs)
    keys = [(k & 0xFFFFFFFF, k >> 32) for k in spec]
    got_keys = _row_keys([seed for seed, _ in pairs], [index for _, index in pairs])
    assert got_keys.tolist() == [list(k) for k in keys]  # numpy's wrapping uint64: the same bits
    got = reference.exponentials(torch.tensor(keys), 300)
    want = torch.tensor([_reference_noise(k0, k1, 300) for k0, k1 in keys], dtype=torch.float32)
    assert torch.allclose(got, want, rtol=1e-6, atol=0)
    assert (got > 0).all() and got.isfinite().all()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_seeded_noise_and_tokens_are_the_same_on_cuda():
    keys = _row_keys([seed for seed in (0, 99, _SEED_MASK) for _ in range(3)], [0, 5, 1000] * 3)
    cpu, cuda = reference.exponentials(keys, 49152), reference.exponentials(keys.cuda(), 49152)
    assert torch.allclose(cuda.cpu(), cpu, rtol=1e-6, atol=0)
    p = SamplingParams(temperature=1.0, seed=1234)  # (no top-p: its cut could differ by float round-off)
    on = {dev: _run_steps(Sampler(64, [EOS], dev), [(p, SamplingState(p), 7)], steps=16, device=dev)[0]
          for dev in ("cpu", "cuda")}
    assert on["cpu"] == on["cuda"]


def test_seeded_sampling_follows_the_distribution():
    n = 20000
    params = [SamplingParams(temperature=1.0, seed=s) for s in range(n)]
    tokens = _call(Sampler(5, [], "cpu"), torch.tensor(PROBS).log().expand(n, -1).contiguous(), params).token_ids
    counts = torch.bincount(torch.tensor(tokens), minlength=5).float() / n
    assert torch.allclose(counts, torch.tensor(PROBS), atol=0.015)


def test_seeded_step_run_again_samples_the_same_token():
    # an out-of-memory rollback or a preemption runs a step again: a seeded row must not move on
    p = SamplingParams(temperature=1.0, seed=42)
    state, sampler = SamplingState(p), Sampler(64, [EOS], "cpu")
    logits = torch.zeros(1, 64)
    first = [_call(sampler, logits, [p], [state], outputs=[[5] * i]).token_ids[0] for i in range(6)]
    again = [_call(sampler, logits, [p], [state], outputs=[[5] * i]).token_ids[0] for i in range(6)]
    assert first == again
    assert len(set(first)) > 1  # the noise moves on with each token sampled


def test_sampling_follows_the_distribution():
    n = 20000
    counts = torch.bincount(torch.tensor(_call(
        Sampler(5, [], "cpu", seed=2), torch.tensor(PROBS).log().expand(n, -1).contiguous(),
        [SamplingParams(temperature=1.0)] * n).token_ids), minlength=5).float() / n
    assert torch.allclose(counts, torch.tensor(PROBS), atol=0.015)


def test_temperature_sharpens():
    n = 4000
    logits = torch.tensor(PROBS).log().expand(n, -1).contiguous()
    cold = _call(Sampler(5, [], "cpu", seed=2), logits, [SamplingParams(temperature=0.1)] * n).token_ids
    assert cold.count(0) / n > 0.99


# ----------------------------------------------------------------------------- top-k / top-p / min-p


@pytest.mark.parametrize(("params", "support"), [
    (SamplingParams(), {0, 1, 2, 3, 4}),
    (SamplingParams(top_k=1), {0}),
    (SamplingParams(top_k=2), {0, 1}),
    (SamplingParams(top_k=3), {0, 1, 2}),
    (SamplingParams(top_k=100), {0, 1, 2, 3, 4}),
    (SamplingParams(top_p=0.4), {0}),
    (SamplingParams(top_p=0.6), {0, 1}),
    (SamplingParams(top_p=0.75), {0, 1, 2}),
    (SamplingParams(top_p=0.9), {0, 1, 2, 3}),
    (SamplingParams(min_p=0.25), {0, 1, 2}),  # keeps p >= 0.125
    (SamplingParams(min_p=0.35), {0, 1}),  # keeps p >= 0.175
    (SamplingParams(min_p=0.15), {0, 1, 2, 3}),  # keeps p >= 0.075
    (SamplingParams(top_k=3, top_p=0.6), {0, 1}),
    # top-p runs on the top-k renormalised distribution: 0.5/0.85 = 0.59 < 0.65
    (SamplingParams(top_k=3, top_p=0.65), {0, 1}),
    (SamplingParams(top_k=3, top_p=0.55), {0}),
    (SamplingParams(top_k=4, min_p=0.25), {0, 1, 2}),
])
def test_which_tokens_can_be_sampled(params, support):
    assert _support(params) == support


def test_mixed_knobs_in_one_batch():
    rows = [SamplingParams(top_k=2), SamplingParams(top_p=0.75), SamplingParams(min_p=0.35),
            SamplingParams(), SamplingParams(temperature=0.0)]
    expected = [{0, 1}, {0, 1, 2}, {0, 1}, {0, 1, 2, 3, 4}, {0}]
    reps = 1000
    params = rows * reps
    logits = torch.tensor(PROBS).log().expand(len(params), -1).contiguous()
    got = _call(Sampler(5, [], "cpu", seed=7), logits, params).token_ids
    for r, exp in enumerate(expected):
        assert set(got[r::len(rows)]) == exp


def test_top_k_top_p_masks_directly():
    logits = torch.tensor(PROBS).log().expand(4, -1).contiguous()
    top_k = torch.tensor([2, 0, 3, 0])
    top_p = torch.tensor([1.0, 0.75, 0.6, 1.0])
    masked = apply_top_k_top_p(logits, top_k, top_p)
    kept = (masked > -math.inf).tolist()
    assert kept == [
        [True, True, False, False, False],
        [True, True, True, False, False],
        [True, True, False, False, False],
        [True] * 5,
    ]
    # kept logits are untouched
    assert torch.equal(masked[3], logits[3])
    # top-k alone takes the topk path
    kept_k = (apply_top_k_top_p(logits, top_k, None, max_k=3) > -math.inf).sum(-1).tolist()
    assert kept_k == [2, 5, 3, 5]


def test_top_p_over_top_k_candidates_matches_the_full_sort():
    torch.manual_seed(0)
    logits = torch.randn(8, 500) * 2
    top_k = torch.tensor([5, 50, 1, 20, 500, 7, 30, 12])
    top_p = torch.tensor([0.9, 0.5, 0.9, 1.0, 0.8, 0.3, 0.95, 0.99])
    full = apply_top_k_top_p(logits, top_k, top_p, max_k=500)
    for max_k in (50, 500):  # the largest k: candidates only, or all of V
        tk = top_k.clamp(max=max_k)
        ref = apply_top_k_top_p(logits, tk, top_p, max_k=max_k)
        fast = apply_top_k_top_p(logits, tk, top_p, max_k=max_k, every_row_has_k=True)
        assert torch.equal(fast, ref)
    assert torch.equal(ref, full)


def test_top_p_over_top_k_candidates_keeps_the_ties_the_full_sort_keeps():
    """Logits tied at a row's k-th value, some of them past topk's candidates: top-k keeps them all, and their
    mass counts in top-p's distribution, as in the full sort (and the race kernel): the same tokens kept."""
    g = torch.Generator().manual_seed(0)
    for _ in range(300):
        vocab = int(torch.randint(4, 40, (1,), generator=g))
        logits = torch.randint(0, int(torch.randint(2, 6, (1,), generator=g)), (4, vocab), generator=g) * 0.7
        top_k = torch.randint(1, vocab, (4,), generator=g)
        top_p = torch.where(torch.rand(4, generator=g) < 0.3, 1.0, torch.rand(4, generator=g))
        max_k = int(top_k.max())
        fast = apply_top_k_top_p(logits, top_k, top_p, max_k, every_row_has_k=True)
        assert torch.equal(fast, apply_top_k_top_p(logits, top_k, top_p, max_k)), (logits, top_k, top_p)


def test_min_p_mask_directly():
    logits = torch.tensor(PROBS).log().expand(3, -1).contiguous()
    kept = (apply_min_p(logits, torch.tensor([0.0, 0.25, 1.0])) > -math.inf).sum(-1).tolist()
    assert kept == [5, 3, 1]


# ----------------------------------------------------------------------------- penalties and bias


def _process(logits, params, prompts, outputs, eos=(EOS,)):
    return process_logits(logits, params, [SamplingState(p) for p in params],
                          prompts, outputs, list(eos))


def test_repetition_penalty_sees_prompt_and_output():
    logits = torch.tensor([[2.0, -2.0, 4.0, -1.0, 3.0, 0.5]])
    p = SamplingParams(repetition_penalty=2.0)
    got = _process(logits, [p], prompts=[[0, 1, 1]], outputs=[[3]])
    assert torch.equal(got, torch.tensor([[1.0, -4.0, 4.0, -2.0, 3.0, 0.5]]))
    assert torch.equal(logits, torch.tensor([[2.0, -2.0, 4.0, -1.0, 3.0, 0.5]]))  # input left alone


def test_presence_and_frequency_see_output_only():
    logits = torch.tensor([[1.0, 1.0, 1.0, 1.0, 1.0]])
    p = SamplingParams(presence_penalty=0.5, frequency_penalty=0.25)
    got = _process(logits, [p], prompts=[[4, 4, 4]], outputs=[[0, 2, 2, 2, 3]])
    # token 0: 1 - 0.5 - 0.25; token 2: 1 - 0.5 - 0.75; token 3: like 0; prompt-only token 4 untouched
    assert torch.allclose(got, torch.tensor([[0.25, 1.0, -0.25, 0.25, 1.0]]))


def test_negative_presence_and_frequency_encourage():
    logits = torch.zeros(1, 4)
    got = _process(logits, [SamplingParams(presence_penalty=-1.0, frequency_penalty=-0.5)], [[]], [[1, 1]])
    assert torch.allclose(got, torch.tensor([[0.0, 2.0, 0.0, 0.0]]))


def test_all_penalties_together_in_vllm_order():
    logits = torch.tensor([[3.0, -1.0, 2.0, 0.0]])
    p = SamplingParams(repetition_penalty=1.5, presence_penalty=0.5, frequency_penalty=0.5,
                       logit_bias={2: 1.0, 3: -2.0})
    got = _process(logits, [p], prompts=[[1]], outputs=[[0, 0, 2]])
    # bias first: [3, -1, 3, -2]; repetition on {0, 1, 2}: [2, -1.5, 2, -2];
    # then -0.5*[count>0] - 0.5*count with counts [2, 0, 1, 0]
    expected = torch.tensor([[2.0 - 0.5 - 1.0, -1.5, 2.0 - 0.5 - 0.5, -2.0]])
    assert torch.allclose(got, expected)


def test_penalties_only_touch_rows_that_ask():
    torch.manual_seed(0)
    logits = torch.randn(3, 8)
    params = [SamplingParams(), SamplingParams(frequency_penalty=1.0, repetition_penalty=1.3), SamplingParams()]
    got = _process(logits, params, prompts=[[1, 2], [1, 2], [1, 2]], outputs=[[3, 3], [3, 3], [3, 3]])
    assert torch.equal(got[0], logits[0]) and torch.equal(got[2], logits[2])
    exp = logits[1].clone()
    for t in (1, 2, 3):
        exp[t] = exp[t] / 1.3 if exp[t] > 0 else exp[t] * 1.3
    exp[3] -= 2.0
    assert torch.allclose(got[1], exp)


def _llama_cpp_penalties(logits: list[float], context: list[int], last_n: int, repeat: float, freq: float,
                         present: float) -> list[float]:
    """llama.cpp's penalties sampler, as written there: the last ``last_n`` tokens the sampler accepted (the
    server feeds it the prompt, then each token; -1: the context's size, 0: off), counted; each counted token's
    logit divided by ``repeat`` (multiplied where <= 0), then less ``count * freq + (count > 0) * present``."""
    if last_n == 0:
        return list(logits)
    window = context[-last_n:] if last_n > 0 else context
    out = list(logits)
    for tok in set(window):
        count = window.count(tok)
        out[tok] = out[tok] * repeat if out[tok] <= 0 else out[tok] / repeat
        out[tok] -= count * freq + (count > 0) * present
    return out


def test_repeat_last_n_is_llama_cpps_window_over_prompt_and_output():
    """``repeat_last_n`` (llama.cpp's) counts all three penalties over the context's last N tokens, the prompt's
    among them, as llama.cpp's sampler does (0: none); rows of vLLM's rules (None) beside them keep theirs."""
    torch.manual_seed(3)
    vocab = 12
    prompt = [1, 5, 5, 7, 2, 9, 9, 9]
    output = [3, 5, 3, 11]
    cases = [(0, 1.5, 0.5, 0.5), (1, 1.3, 0.0, 0.0), (3, 1.5, 0.4, 0.2), (6, 1.1, 0.3, -0.5), (10, 2.0, 0.1, 0.1),
             (12, 1.2, 0.2, 0.3), (64, 1.4, -0.2, 0.5), (-1, 1.25, 0.5, 0.25)]
    params = [SamplingParams(repeat_last_n=n, repetition_penalty=r, frequency_penalty=f, presence_penalty=pr)
              for n, r, f, pr in cases] + [SamplingParams(repetition_penalty=1.5, frequency_penalty=0.5)]
    logits = torch.randn(len(params), vocab)
    logits[:, 5] = -0.0  # (a zero logit: llama.cpp multiplies it)
    got = _process(logits, params, [prompt] * len(params), [output] * len(params))
    for row, (n, r, f, pr) in enumerate(cases):
        want = _llama_cpp_penalties(logits[row].tolist(), prompt + output, n, r, f, pr)
        assert torch.allclose(got[row], torch.tensor(want), atol=1e-6), n
    vllm = _process(logits[-1:], params[-1:], [prompt], [output])  # (the same row alone)
    assert torch.equal(got[-1], vllm[0])


def test_the_tokens_penalties_count():
    """The window as the output grows: the prompt's part (built once) shrinks, then only the output's last N."""
    state = SamplingState(SamplingParams(repeat_last_n=3, presence_penalty=1.0))
    prompt = [1, 2, 3, 4]
    for output, want in (([], [2, 3, 4]), ([7], [3, 4, 7]), ([7, 8], [4, 7, 8]), ([7, 8, 9], [7, 8, 9]),
                         ([7, 8, 9, 10], [8, 9, 10])):
        assert state.penalized(prompt, output, 3).tolist() == want
    state = SamplingState(SamplingParams(repeat_last_n=-1, presence_penalty=1.0))
    assert state.penalized(prompt, [7, 8], -1).tolist() == [1, 2, 3, 4, 7, 8]
    assert SamplingState(SamplingParams()).penalized(prompt, [7, 8], None).tolist() == [7, 8]
    assert not SamplingState(SamplingParams(repeat_last_n=0, repetition_penalty=2.0)).needs_penalties


def test_repeat_last_n_is_checked():
    for bad in (-2, 2**31, 1.5, True):
        with pytest.raises(ValueError, match="repeat_last_n"):
            SamplingParams(repeat_last_n=bad)


def test_logit_bias_is_added_and_out_of_vocab_ids_ignored():
    logits = torch.zeros(2, 5)
    params = [SamplingParams(logit_bias={1: 5.0, 4: -100.0, 99: 3.0}), SamplingParams()]
    got = _process(logits, params, [[], []], [[], []])
    assert torch.equal(got, torch.tensor([[0.0, 5.0, 0.0, 0.0, -100.0], [0.0] * 5]))


def test_logit_bias_steers_greedy_and_sampled_rows():
    logits = torch.zeros(2, 10)
    params = [SamplingParams(temperature=0.0, logit_bias={7: 50.0}),
              SamplingParams(temperature=1.0, seed=0, logit_bias={3: 100.0})]
    assert _call(Sampler(10, [EOS], "cpu"), logits, params).token_ids == [7, 3]


def test_frequency_penalty_changes_the_greedy_choice():
    logits = torch.tensor([[2.0, 1.5, 0.0]])
    p = SamplingParams(temperature=0.0, frequency_penalty=1.0)
    out = _call(Sampler(3, [EOS], "cpu"), logits, [p], outputs=[[0]])
    assert out.token_ids == [1]


# ----------------------------------------------------------------------------- min_tokens


def test_min_tokens_masks_eos_and_stop_ids():
    logits = torch.zeros(4, 6)
    params = [
        SamplingParams(min_tokens=3, stop_token_ids=[5]),
        SamplingParams(min_tokens=3, stop_token_ids=[5]),  # already has 3 tokens: free to stop
        SamplingParams(min_tokens=3, stop_token_ids=[5], ignore_eos=True),  # EOS stays allowed
        SamplingParams(stop_token_ids=[5]),
    ]
    got = _process(logits, params, [[]] * 4, [[1], [1, 1, 1], [], []])
    inf = -math.inf
    assert got.tolist() == [
        [0.0, 0.0, inf, 0.0, 0.0, inf],
        [0.0] * 6,
        [0.0, 0.0, 0.0, 0.0, 0.0, inf],
        [0.0] * 6,
    ]


def test_min_tokens_keeps_greedy_off_eos():
    logits = torch.tensor([[0.0, 1.0, 9.0, 0.0]] * 2)  # EOS is the argmax
    params = [SamplingParams(temperature=0.0, min_tokens=2), SamplingParams(temperature=0.0, min_tokens=2)]
    out = _call(Sampler(4, [EOS], "cpu"), logits, params, outputs=[[1], [1, 1]])
    assert out.token_ids == [1, 2]


class Untouchable(list):
    """A params list the sampler must not walk once the request's state exists."""

    def __iter__(self):
        raise AssertionError("a params list was walked on the hot path")

    __contains__ = __getitem__ = __iter__


class UntouchableMap(dict):
    def __iter__(self):
        raise AssertionError("a params map was walked on the hot path")

    items = keys = values = __contains__ = __getitem__ = __iter__


def _naive_min_tokens_and_bias(logits, params, outputs, eos):
    """The reference: walk every list, every step."""
    out = logits.float().clone()
    vocab = out.shape[1]
    for i, (p, o) in enumerate(zip(params, outputs, strict=True)):
        if len(o) < p.min_tokens:
            for t in [*p.stop_token_ids, *([] if p.ignore_eos else eos)]:
                if t < vocab:
                    out[i, t] = -math.inf
    for i, p in enumerate(params):
        for t, v in (p.logit_bias or {}).items():
            if t < vocab:
                out[i, t] += v
    return out


def test_precomputed_min_tokens_and_bias_match_a_naive_reference():
    vocab, eos = 300, [EOS, 7]
    params = [
        SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=[5, 9, 299, 300, 4000]),
        SamplingParams(temperature=0.0, min_tokens=3, ignore_eos=True, stop_token_ids=[11, 12],
                       logit_bias={11: 5.0, 13: -3.0, 500: 1.0}),
        SamplingParams(temperature=0.0, logit_bias={i: (i % 7) - 3.0 for i in range(0, 400, 3)}),
        SamplingParams(temperature=0.0, min_tokens=5, logit_bias={EOS: 50.0, 7: 50.0, 1: 0.5}),
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.0, min_tokens=2, ignore_eos=True, stop_token_ids=list(range(100, 2148)),
                       logit_bias={i: 0.25 for i in range(150, 2198)}),  # both at the cap, most out of vocab
        SamplingParams(temperature=0.0, min_tokens=4, stop_token_ids=[EOS, EOS, 40]),
    ]
    states = [SamplingState(p) for p in params]
    # Once the states exist, a step may not walk the lists: poison them.
    poisoned = []
    for p in params:
        q = copy.copy(p)
        q.stop_token_ids = Untouchable(p.stop_token_ids)
        q.logit_bias = UntouchableMap(p.logit_bias) if p.logit_bias is not None else None
        poisoned.append(q)
    sampler = Sampler(vocab, eos, "cpu")
    gen = torch.Generator().manual_seed(0)
    outputs: list[list[int]] = [[] for _ in params]
    for _ in range(6):
        logits = torch.randn(len(params), vocab, generator=gen) * 3
        logits[:, eos] += 6.0  # EOS and the stop ids would win when allowed
        logits[:, [5, 11, 40]] += 5.0
        expected = _naive_min_tokens_and_bias(logits, params, outputs, eos)
        got = process_logits(logits, poisoned, states, [[]] * len(params), outputs, eos)
        assert torch.equal(got, expected)
        tokens = sampler(logits, poisoned, states, [[]] * len(params), [list(o) for o in outputs]).token_ids
        assert tokens == expected.argmax(-1).tolist()
        for o, t in zip(outputs, tokens, strict=True):
            o.append(t)


def test_smallest_repetition_penalty_keeps_logits_finite():
    logits = torch.tensor([[3e4, -3e4, 1.0]])
    for r in (0.01, 10.0):
        got = _process(logits, [SamplingParams(repetition_penalty=r)], prompts=[[0, 1]], outputs=[[2]])
        assert torch.isfinite(got).all()


# ----------------------------------------------------------------------------- logprobs


def test_logprobs_are_raw_with_sorted_top_k():
    torch.manual_seed(0)
    logits = torch.randn(4, 30)
    params = [
        SamplingParams(temperature=0.0, logprobs=3),
        SamplingParams(temperature=0.5, top_k=2, repetition_penalty=2.0, logprobs=5, seed=1),
        SamplingParams(temperature=1.0, seed=2),  # did not ask
        SamplingParams(temperature=1.0, logprobs=0, logit_bias={0: 100.0}),
    ]
    out = _call(Sampler(30, [EOS], "cpu"), logits, params, prompts=[[1, 2]] * 4)
    raw = torch.log_softmax(logits, -1)
    assert out.logprobs[2] is None
    assert out.token_ids[3] == 0
    for i, k in ((0, 3), (1, 5), (3, 0)):
        tok_lp, packed, _ = out.logprobs[i]
        top = unpack_top(packed)  # (the engine's step packs the top-k as Outputs carries it)
        assert tok_lp == pytest.approx(raw[i, out.token_ids[i]].item(), abs=1e-6)  # raw, not processed
        assert len(top) == k
        exp_lp, exp_ids = raw[i].topk(k) if k else (torch.empty(0), torch.empty(0, dtype=torch.long))
        assert [t for t, _ in top] == exp_ids.tolist()
        assert [v for _, v in top] == pytest.approx(exp_lp.tolist(), abs=1e-6)
        assert [v for _, v in top] == sorted((v for _, v in top), reverse=True)


def test_a_top_k_past_the_vocabulary_stops_at_its_own_row():
    """Rows asking for more top logprobs than the vocabulary has get the whole vocabulary, their own (the
    step's top-k is packed row after row: a row cut by its k would run into the next row's)."""
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0], [1.0, 2.0, 3.0, 4.0]])
    params = [SamplingParams(temperature=0.0, logprobs=6), SamplingParams(temperature=0.0, logprobs=6)]
    out = _call(Sampler(4, [EOS], "cpu"), logits, params)
    assert [[t for t, _ in unpack_top(lp[1])] for lp in out.logprobs] == [[0, 1, 2, 3], [3, 2, 1, 0]]


def test_no_logprobs_asked_means_none():
    out = _call(Sampler(8, [EOS], "cpu"), torch.randn(2, 8), [SamplingParams(seed=1), SamplingParams()])
    assert out.logprobs is None


def compute_logprobs(logits, ids, k):
    return [[t, unpack_top(top), r] for t, top, r in logprob_entries(*logprob_tensors(logits, ids, k))]


def test_logprobs_helpers_in_chunks():
    torch.manual_seed(0)
    logits = torch.randn(2500, 7)  # more rows than one chunk
    ids = torch.randint(0, 7, (2500,))
    got = compute_logprobs(logits, ids.tolist(), 2)
    raw = torch.log_softmax(logits, -1)
    assert len(got) == 2500
    for i in (0, 1023, 1024, 2499):
        assert got[i][0] == pytest.approx(raw[i, ids[i]].item(), abs=1e-6)
        assert [t for t, _ in got[i][1]] == raw[i].topk(2).indices.tolist()
        assert got[i][2] == raw[i].argsort(descending=True).tolist().index(ids[i].item()) + 1  # its rank
    assert compute_logprobs(logits[:2], ids[:2], 0)[0][1] == []


def test_a_top_k_past_any_vocabulary_cuts_nothing():
    # (a step reads the knobs as float32: a k past 2**128 must not become inf there)
    logits = torch.tensor([PROBS]).log()
    got = {k: _call(Sampler(5, [], "cpu"), logits, [SamplingParams(temperature=1.0, top_k=k, seed=3)]).token_ids
           for k in (0, 5, 10**40)}
    assert got[0] == got[5] == got[10**40]


def test_seeded_xtc_draws_are_exactly_their_integer_spec():
    from engine.sampler import _XTC_SALT

    seeds, counts = [0, 7, 2**63 + 5, 2**64 - 1], [0, 3, 100, 2**40]
    params = [SamplingParams(temperature=1.0, seed=x, xtc_threshold=0.1, xtc_probability=0.5) for x in seeds]
    got = Sampler(64, [EOS], "cpu")._uniforms([SamplingState(p) for p in params], counts, torch.device("cpu"))
    want = [(_splitmix64_spec(_splitmix64_spec(x ^ _XTC_SALT) ^ n) >> 40) * 2.0 ** -24
            for x, n in zip(seeds, counts, strict=True)]
    assert got.tolist() == want


def test_grammar_masks_unpacked_on_the_device_are_numpys():
    """A grammar's mask goes to the device as packed bits (``StateInfo.packed_mask``) and is unpacked there: the
    same bools as ``np.unpackbits``, for vocabularies that are no multiple of 8 and logits wider than the mask."""
    from engine.sampler import _unpack_bits_by_shifts, unpack_bits

    rng = np.random.default_rng(1)
    for size in (1, 7, 9, 4096, 151936):
        rows = np.stack([np.packbits(rng.random(size) < 0.4) for _ in range(3)])
        for n in (size, size + 5, max(size - 3, 1)):
            want = np.stack([np.unpackbits(r, count=n).view(bool) for r in rows])
            for unpack in (unpack_bits, _unpack_bits_by_shifts):  # (the host's, the devices')
                assert (unpack(torch.from_numpy(rows), n).numpy() == want).all(), (size, n)
