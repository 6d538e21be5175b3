"""llama.cpp's samplers (``engine.sampler_llamacpp``): each batched one against a plain per-row reference written
from llama.cpp's definition, then through the ``Sampler`` (seeds, greedy rows, mirostat's moving target), the
breakers' tokens, and a random model through ``LLM``. HTTP: ``tests/test_llamacpp.py``."""

from __future__ import annotations

import dataclasses
import math
import random

import numpy as np
import pytest
import torch

from engine import sampler_llamacpp as lc
from engine.protocol import SamplingParamError, SamplingParams
from engine.sampler import Sampler, SamplingState, process_logits
from frontends.text import dry_breaker_token_ids
from tests.test_sampler import _run_steps

# ----------------------------------------------------------------------------- DRY


def _dry_reference(window: list[int], breakers: list[list[int]], multiplier: float, base: float,
                   allowed: int) -> dict[int, float]:
    """DRY by its definition, the slow way: the last breaker caps the lengths; each earlier position's longest
    suffix shared with the window's end; the token after it penalised by the longest."""
    n = len(window)
    if n <= allowed:
        return {}
    limit = n
    for pos in range(n - 1, -1, -1):
        after = n - 1 - pos
        tails = [len(b) - 1 for b in breakers if b[0] == window[pos] and len(b) - 1 <= after
                 and window[pos + 1:pos + len(b)] == b[1:]]
        if tails:
            limit = after - max(tails)
            break
    if limit < allowed:
        return {}
    best: dict[int, int] = {}
    for i in range(n - 1):
        length = 0
        while length < limit and length <= i and window[i - length] == window[n - 1 - length]:
            length += 1
        if length >= allowed:
            best[window[i + 1]] = max(best.get(window[i + 1], 0), length)
    single = {b[0] for b in breakers if len(b) == 1}
    cap = int(lc.FLOAT_MAX_LOG / math.log(base)) if base > 1.000001 else None
    return {t: multiplier * base ** (L - allowed if cap is None else min(L - allowed, cap))
            for t, L in best.items() if t not in single}


def _dry(window, breakers, multiplier=0.8, base=1.75, allowed=2):
    tokens, pens = lc.dry_penalties(np.array(window, np.int64), lc.Breakers.of(breakers), multiplier, base, allowed)
    return dict(zip(tokens.tolist(), pens.tolist(), strict=True))


def test_dry_follows_llama_cpps_worked_example():
    # llama.cpp's comment: "a b c c b c y a b c" -> c would repeat "a b c" (3), y "b c" (2), b "c" (1)
    a, b, c, y = 1, 2, 3, 4
    window = [a, b, c, c, b, c, y, a, b, c]
    assert _dry(window, [], allowed=2) == pytest.approx({c: 0.8 * 1.75, y: 0.8})
    assert _dry(window, [], allowed=1) == pytest.approx({c: 0.8 * 1.75 ** 2, y: 0.8 * 1.75, b: 0.8})
    assert _dry(window, [[y]], allowed=1) == pytest.approx({c: 0.8 * 1.75 ** 2, b: 0.8})  # y: a breaker itself
    assert _dry(window, [[a]], allowed=1) == pytest.approx({c: 0.8 * 1.75, y: 0.8 * 1.75, b: 0.8})  # capped at 2
    assert _dry(window, [[b, c]], allowed=1) == {}  # "b c" ends the window: nothing after it to repeat
    assert _dry([a, b], [], allowed=2) == {}


def test_dry_matches_its_definition_on_random_histories():
    rng = random.Random(0)
    for case in range(300):
        n = rng.randint(1, 60)
        alphabet = rng.randint(2, 6)
        window = [rng.randrange(alphabet) for _ in range(n)]
        if case % 3 == 0:  # a loop: the model repeating itself
            period = window[:rng.randint(1, 8)]
            window = (period * 20)[:n]
        breakers = [[rng.randrange(alphabet) for _ in range(rng.randint(1, 3))] for _ in range(rng.randint(0, 2))]
        allowed, base = rng.randint(0, 4), rng.choice([1.0, 1.75, 3.0])
        assert _dry(window, breakers, 0.5, base, allowed) == pytest.approx(
            _dry_reference(window, breakers, 0.5, base, allowed)), (window, breakers, allowed)


def test_dry_exponent_is_clamped_below_float32s_overflow_and_the_penalty_kept_finite():
    window = [7] * 400  # a 399-long repeat: base ** 397 would overflow
    cap = int(lc.FLOAT_MAX_LOG / math.log(2.0))
    assert _dry(window, [], multiplier=1e-20, base=2.0, allowed=2) == pytest.approx({7: 1e-20 * 2.0 ** cap})
    assert _dry(window, [], multiplier=1.0, base=2.0, allowed=2) == {7: lc.DRY_MAX_PENALTY}


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_dry_at_its_largest_keeps_allowed_tokens_and_grammars_whole(temperature):
    """The first review's finding: an infinite penalty made the only allowed token -inf, and the sampler then
    picked token 0. Capped, the allowed token is still the one sampled, however long the repeat."""
    p = SamplingParams(temperature=temperature, seed=1, allowed_token_ids=[7], dry_multiplier=1e30, dry_base=100.0,
                       dry_allowed_length=0, dry_breaker_token_ids=[[0]])
    got = Sampler(16, [], "cpu")(torch.randn(1, 16), [p], [SamplingState(p)], [[7] * 300], [[7] * 5]).token_ids
    assert got == [7]


@pytest.mark.parametrize("linear_steps", [0, 1, 3])
def test_dry_repeats_bisected_on_hashes_match_the_definition(monkeypatch, linear_steps):
    """Past ``LINEAR_STEPS`` the lengths are bisected on hashes: loops, long repeated passages, limits."""
    monkeypatch.setattr(lc, "LINEAR_STEPS", linear_steps)
    rng = random.Random(1)
    for case in range(40):
        n = rng.randint(2, 700)
        period = [rng.randrange(50) for _ in range(rng.randint(1, 9))]
        window = (period * n)[:n]
        if case % 2:  # a passage repeated, with noise around it
            passage = [rng.randrange(5) for _ in range(rng.randint(1, 60))]
            window = [rng.randrange(5) for _ in range(rng.randint(0, 50))] + passage + [9] + passage
        breakers = [[rng.randrange(50)]] if case % 3 == 0 else []
        allowed = rng.randint(0, 3)
        assert _dry(window, breakers, 0.5, 1.1, allowed) == pytest.approx(
            _dry_reference(window, breakers, 0.5, 1.1, allowed)), (window, breakers, allowed)
    long_loop = [5, 6, 7] * 3000  # a 9000-token loop: every third position repeats up to its start
    assert lc.repeat_lengths(np.array(long_loop, np.int64), 10**9)[-3:].tolist() == [8997, 0, 0]


def test_dry_in_process_logits_steers_greedy_over_its_window():
    vocab = 8
    logits = torch.zeros(3, vocab)
    logits[:, 3] = 1.0  # greedy's choice...
    params = [SamplingParams(temperature=0, dry_multiplier=2.0, dry_breaker_token_ids=[[6]]),
              SamplingParams(temperature=0, dry_multiplier=2.0, dry_penalty_last_n=3),
              SamplingParams(temperature=0)]
    states = [SamplingState(p) for p in params]
    assert all(s.reads_output and not s.plain_greedy for s in states[:2])
    prompt, out = [1, 2, 3, 1, 2], [4, 1, 2]  # ...would repeat "1 2 3" (as 4 would "1 2 4"); "4 1 2" alone: nothing
    got = process_logits(logits, params, states, [prompt] * 3, [out] * 3, [])
    assert got[0, 3] == pytest.approx(1.0 - 2.0) and got[0, 4] == pytest.approx(-2.0) and got[0].argmax() != 3
    assert got[1].tolist() == logits[1].tolist()  # its window, "4 1 2", repeats nothing
    assert got[2].tolist() == logits[2].tolist()


def test_breakers_become_tokens_as_llama_cpp_finds_them():
    texts = ["a", ":", "x:", "b\n", "\n", "c*", "*d", "ab", "q"]
    encode = {"\n": [4], "*": [9, 9], "b\n": [3]}.__getitem__  # the rest of a breaker, tokenized
    got = dry_breaker_token_ids(["\n", ":", "*"], texts, encode)
    assert sorted(map(tuple, got)) == sorted([(1,), (2,), (3,), (4,), (5,), (6,)])  # each holds one: alone
    # "ab\n": "a" and "ab" end in its start ("a", "ab"): the rest of it follows them
    got = dry_breaker_token_ids(["ab\n"], texts, encode)
    assert sorted(map(tuple, got)) == [(0, 3), (7, 4)]


# ----------------------------------------------------------------------------- truncations


def _ref_rows(logits: torch.Tensor, fn) -> torch.Tensor:
    return torch.stack([fn(row.double().numpy(), i) for i, row in enumerate(logits)]).float()


def _softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x[np.isfinite(x)].max())
    return e / e.sum()


def _logits(rows: int = 6, vocab: int = 40, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, vocab, generator=g) * 2
    x[0, 5:9] = -math.inf  # masked tokens (a grammar, top-k before)
    return x


def test_top_n_sigma_matches_llama_cpp():
    x, n = _logits(), torch.tensor([0.5, 1.0, 1.5, 2.0, 3.0, 0.1])

    def ref(row, i):
        f = row[np.isfinite(row)]
        cut = f.max() - n[i].item() * f.std()
        return torch.from_numpy(np.where(row < cut, -np.inf, row))
    assert torch.equal(lc.apply_top_n_sigma(x, n), _ref_rows(x, ref))
    assert torch.equal(lc.apply_top_n_sigma(x / 0.5, n).isinf(), lc.apply_top_n_sigma(x, n).isinf())  # any temperature


def test_typical_matches_llama_cpp():
    x, p = _logits(), torch.tensor([0.2, 0.5, 0.9, 0.95, 0.01, 0.7])

    def ref(row, i):
        probs = _softmax(row)
        ok = probs > 0
        entropy = -(probs[ok] * np.log(probs[ok])).sum()
        shifted = np.where(ok, np.abs(-np.log(np.where(ok, probs, 1)) - entropy), np.inf)
        order = np.argsort(shifted, kind="stable")
        keep, total = [], 0.0
        for j in order:
            keep.append(j)
            total += probs[j]
            if total > p[i].item():
                break
        return torch.from_numpy(np.where(np.isin(np.arange(len(row)), keep), row, -np.inf))
    assert torch.equal(lc.apply_typical(x, p).isinf(), _ref_rows(x, ref).isinf())


def test_xtc_drops_all_top_choices_but_the_least_likely_where_its_draw_fires():
    probs = torch.tensor([[0.4, 0.3, 0.2, 0.1], [0.4, 0.3, 0.2, 0.1], [0.85, 0.05, 0.05, 0.05], [0.4, 0.3, 0.2, 0.1]])
    fire = torch.tensor([True, True, True, False])
    got = lc.apply_xtc(probs.log(), torch.tensor([0.15, 0.35, 0.1, 0.15]), fire)
    assert got.isinf().tolist() == [[True, True, False, False],  # 0.4, 0.3 go: 0.2 is the least above 0.15
                                    [False, False, False, False],  # one token above 0.35: nothing goes
                                    [False, False, False, False],  # one above 0.1
                                    [False, False, False, False]]  # its draw did not fire
    masked = torch.tensor([[0.5, 0.3, 0.2, 0.0]]).log()  # a threshold of 0: every token in, the least likely stays
    assert lc.apply_xtc(masked, torch.tensor([0.0]), torch.tensor([True])).isinf().tolist() == [[True, True, False, True]]


def test_dynamic_temperature_matches_llama_cpp():
    x = _logits()
    x[1, 1:] = -math.inf  # one candidate: left as it is
    t, spread, exp = torch.tensor([0.8, 1.0, 0.5, 1.2, 0.3, 1.0]), torch.tensor([0.5, 0.5, 0.5, 1.0, 0.3, 1.5]), \
        torch.tensor([1.0, 1.0, 2.0, 0.5, 1.0, 0.0])

    def ref(row, i):
        f = np.isfinite(row)
        if f.sum() <= 1:
            return torch.from_numpy(row)
        probs = _softmax(row)
        ok = probs > 0
        entropy = -(probs[ok] * np.log(probs[ok])).sum()
        lo, hi = max(0.0, t[i].item() - spread[i].item()), t[i].item() + spread[i].item()
        dyn = lo + (hi - lo) * (entropy / math.log(f.sum())) ** exp[i].item()
        return torch.from_numpy(row / dyn)
    torch.testing.assert_close(lc.apply_dynamic_temperature(x, t, spread, exp), _ref_rows(x, ref), rtol=1e-5, atol=1e-5)
    zero = lc.apply_dynamic_temperature(x[:1], torch.tensor([0.2]), torch.tensor([0.5]), torch.tensor([1.0]))
    assert torch.isfinite(zero).sum() >= 1  # a range reaching below 0 clamps the low end at 0, not below


def test_mirostat_2_keeps_tokens_no_more_surprising_than_mu():
    x, mu = _logits(), torch.tensor([1.0, 3.0, 5.0, 0.0, 10.0, 2.0])
    got = lc.apply_mirostat(x, mu, 2, 40)
    for i, row in enumerate(x):
        probs = _softmax(row.double().numpy())
        keep = (-np.log2(np.maximum(probs, 1e-300)) <= mu[i].item()) | (probs == probs.max())
        assert (~got[i].isinf()).numpy().tolist() == keep.tolist()


def test_mirostat_1_keeps_llama_cpps_k():
    x, mu = _logits(vocab=300), torch.tensor([2.0, 4.0, 6.0, 8.0, 10.0, 3.0])
    got = lc.apply_mirostat(x, mu, 1, 300)
    for i, row in enumerate(x):
        probs = np.sort(_softmax(row.double().numpy()))[::-1]
        probs = probs[probs > 0]
        num = sum(math.log((j + 2) / (j + 1)) * math.log(probs[j] / probs[j + 1]) for j in range(99))
        s_hat = num / sum(math.log((j + 2) / (j + 1)) ** 2 for j in range(99))
        eps = s_hat - 1
        k = max(int((eps * 2 ** mu[i].item() / (1 - 300 ** -eps)) ** (1 / s_hat)), 1)
        assert abs(int((~got[i].isinf()).sum()) - min(k, len(probs))) <= 1  # (float32 against float64 at the edge)


# ----------------------------------------------------------------------------- through the sampler


@pytest.mark.parametrize("kw", [dict(xtc_probability=0.7, xtc_threshold=0.02), dict(typical_p=0.6, top_k=30),
                                dict(top_n_sigma=1.0), dict(dynatemp_range=0.5, min_p=0.05), dict(mirostat=2),
                                dict(mirostat=1, mirostat_tau=3.0)])
def test_a_seeded_request_is_independent_of_the_batch(kw):
    p = SamplingParams(temperature=0.9, seed=77, **kw)
    alone = _run_steps(Sampler(64, [], "cpu"), [(p, SamplingState(p), 5)], 8)[0]
    others = [SamplingParams(temperature=0.8, xtc_probability=1.0), SamplingParams(temperature=0),
              SamplingParams(temperature=1.1, mirostat=2, seed=3), SamplingParams(temperature=1.0, typical_p=0.3)]
    rows = [(o, SamplingState(o), k) for k, o in enumerate(others, start=20)]
    rows.insert(1, (p, SamplingState(p), 5))
    assert _run_steps(Sampler(64, [], "cpu", seed=9), rows, 8)[1] == alone
    q = SamplingParams(temperature=0.9, seed=78, **kw)
    assert _run_steps(Sampler(64, [], "cpu"), [(q, SamplingState(q), 5)], 8)[0] != alone


def test_greedy_rows_ignore_the_truncations():
    x = _logits(rows=2)
    params = [SamplingParams(temperature=0, xtc_probability=1.0, mirostat=2, typical_p=0.1, top_n_sigma=0.1,
                             dynatemp_range=1.0)] * 2
    assert Sampler(40, [], "cpu")(x, params, [SamplingState(p) for p in params], [[]] * 2, [[]] * 2).token_ids == \
        x.argmax(dim=-1).tolist()


def test_xtc_at_probability_1_never_picks_the_top_token_of_a_flat_head():
    probs = torch.tensor([0.3, 0.3, 0.25, 0.1, 0.05])
    p = SamplingParams(temperature=1.0, xtc_probability=1.0, xtc_threshold=0.2)
    n = 400
    got = Sampler(5, [], "cpu")(probs.log().expand(n, -1).contiguous(), [p] * n, [SamplingState(p) for _ in range(n)],
                               [[]] * n, [[]] * n).token_ids
    assert set(got) <= {2, 3, 4} and 2 in got  # 0.3 and 0.3 go, 0.25 (the least above 0.2) stays


def test_mirostat_keeps_the_temperature_a_dynamic_one_would_replace():
    """llama.cpp's mirostat chain is the temperature and mirostat: a dynamic temperature is not in it."""
    base = SamplingParams(temperature=0.3, mirostat=2, seed=4)
    dyn = dataclasses.replace(base, dynatemp_range=0.5)
    assert _run_steps(Sampler(64, [], "cpu"), [(base, SamplingState(base), 1)], 8) == \
        _run_steps(Sampler(64, [], "cpu"), [(dyn, SamplingState(dyn), 1)], 8)


def test_the_http_fields_are_read_as_llama_cpps_server_reads_them():
    from frontends import openai_params as op

    p = op.sampling_params({"dry_base": 0.5, "typical_p": 1.5, "dry_multiplier": -1, "xtc_probability": -0.5,
                            "xtc_threshold": 2, "dynatemp_range": -1, "top_n_sigma": -3,
                            "dry_sequence_breakers": '"\\n", ":"'}, max_tokens=4, logprobs=None, vocab_size=100)
    assert (p.dry_base, p.typical_p, p.dry_multiplier, p.xtc_probability, p.xtc_threshold, p.dynatemp_range,
            p.top_n_sigma) == (1.75, 1.0, 0.0, 0.0, 1.0, 0.0, -3)
    assert p.dry_sequence_breakers == ["\n", ":"] and not p.dry
    q = op.sampling_params({"dry_multiplier": 0.8, "dry_sequence_breakers": '["*"]'}, max_tokens=4, logprobs=None,
                           vocab_size=100)
    assert q.dry and q.dry_breakers == ["*"]


def test_mirostats_target_moves_by_each_sampled_tokens_surprise():
    p = SamplingParams(temperature=1.0, mirostat=2, mirostat_tau=3.0, mirostat_eta=0.5, seed=1)
    state = SamplingState(p)
    assert state.mu == 6.0 and state.reads_output
    logits = _logits(rows=1)
    sampled = Sampler(40, [], "cpu").sample(logits, [p], [state], [[]], [[]])
    assert state.mu == 6.0  # moved when the step's result is read, not before
    token = sampled.result().token_ids[0]
    kept = lc.apply_mirostat(logits / 1.0, torch.tensor([6.0]), 2, 40)
    surprise = -kept.log_softmax(dim=-1)[0, token].item() / math.log(2)
    assert state.mu == pytest.approx(6.0 - 0.5 * (surprise - 3.0), rel=1e-5)


@pytest.mark.parametrize("kw, param", [
    (dict(dry_multiplier=-1), "dry_multiplier"), (dict(dry_base=-1), "dry_base"),
    (dict(dry_allowed_length=-1), "dry_allowed_length"), (dict(dry_penalty_last_n=-2), "dry_penalty_last_n"),
    (dict(dry_sequence_breakers=[]), "dry_sequence_breakers"), (dict(dry_sequence_breakers=[1]), "dry_sequence_breakers"),
    (dict(dry_breaker_token_ids=[[]]), "dry_sequence_breakers"), (dict(xtc_probability=1.5), "xtc_probability"),
    (dict(xtc_threshold=-0.1), "xtc_threshold"), (dict(typical_p=0), "typical_p"),
    (dict(top_n_sigma=math.inf), "top_n_sigma"), (dict(dynatemp_range=-1), "dynatemp_range"),
    (dict(mirostat=3), "mirostat"), (dict(mirostat_tau=-1), "mirostat_tau"), (dict(mirostat_eta=True), "mirostat_eta"),
])
def test_bad_values_are_refused_by_name(kw, param):
    with pytest.raises(SamplingParamError) as e:
        SamplingParams(**kw)
    assert e.value.param == param


def test_breakers_default_to_llama_cpps_and_are_cut_as_there():
    assert SamplingParams().dry_breakers == ["\n", ":", "\"", "*"]
    assert SamplingParams(dry_sequence_breakers=["", "x" * 50, "é" * 30]).dry_breakers == ["x" * 40, "é" * 20]
    assert not SamplingParams(dry_multiplier=0.8, dry_base=0.9).dry  # llama.cpp's "off"s
    assert not SamplingParams(dry_multiplier=0.8, dry_penalty_last_n=0).dry
    with pytest.raises(SamplingParamError, match="dry_sequence_breakers"):
        SamplingParams(dry_breaker_token_ids=[[5]]).check_vocab(5)


# ----------------------------------------------------------------------------- a random model


@pytest.fixture(scope="module")
def llm(tiny_llama):
    from engine import LLM

    return LLM(tiny_llama, dtype="float32", num_kv_blocks=256, max_model_len=512, max_num_seqs=8)


def _repeats(tokens: list[int], start: int, params: SamplingParams) -> list[int]:
    """The positions from ``start`` whose token DRY would have penalised, given the tokens before it."""
    breakers = lc.Breakers.of(params.dry_breaker_token_ids)
    return [j for j in range(start, len(tokens))
            if tokens[j] in lc.dry_penalties(np.array(tokens[:j], np.int64), breakers, 1.0, params.dry_base,
                                             params.dry_allowed_length)[0].tolist()]


def test_dry_keeps_a_looping_model_from_repeating_itself(llm):
    loop = [11, 12, 13, 14, 15, 16] * 5
    prompts = [loop, [3, 1, 4, 1, 5, 9, 2, 6] * 3]
    free = llm.generate(prompts, SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True))
    dry = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, dry_multiplier=1000.0,
                         dry_sequence_breakers=["\x00"])
    got = llm.generate(prompts, dry)
    assert any(_repeats(p + o.token_ids, len(p), dry) for p, o in zip(prompts, free, strict=True))  # it would
    checked = dataclasses.replace(dry, dry_breaker_token_ids=llm._codec.dry_breakers(("\x00",)))
    for p, o in zip(prompts, got, strict=True):
        assert not _repeats(p + o.token_ids, len(p), checked)
    # llama.cpp's default breakers, as text: LLM makes them tokens (the engine reads only those)
    assert llm.generate(prompts[:1], SamplingParams(max_tokens=4, temperature=0.0, dry_multiplier=0.8))[0].token_ids
    from engine.engine import RequestError

    with pytest.raises(RequestError) as e:
        llm.engine.add_request("words", [1, 2], SamplingParams(dry_multiplier=0.8))
    assert e.value.status == 400 and e.value.param == "dry_sequence_breakers"


def test_llama_cpps_samplers_hold_under_asynchronous_scheduling_and_drafts(tiny_llama, llm):
    from engine import LLM

    prompts = [[1, 2, 3, 1, 2, 3, 1, 2], [5, 6, 7, 5, 6, 7]]
    cases = [SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, dry_multiplier=3.0, dry_allowed_length=1),
             SamplingParams(max_tokens=16, temperature=0.9, seed=5, ignore_eos=True, mirostat=2, mirostat_tau=4.0),
             SamplingParams(max_tokens=16, temperature=0.9, seed=6, ignore_eos=True, xtc_probability=0.5,
                            xtc_threshold=0.01, typical_p=0.8, top_n_sigma=2.0, dynatemp_range=0.4)]
    want = [[o.token_ids for o in llm.generate(prompts, p)] for p in cases]
    for kw in ({"async_scheduling": "on"},
               {"speculative_config": {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2,
                                       "prompt_lookup_min": 1}}):
        other = LLM(tiny_llama, dtype="float32", num_kv_blocks=256, max_model_len=512, **kw)
        for p, w in zip(cases, want, strict=True):
            assert [o.token_ids for o in other.generate(prompts, p)] == w, (kw, p)
