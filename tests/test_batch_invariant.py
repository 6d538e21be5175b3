"""Batch-invariant mode (``batch_invariant``, ``--batch-invariant``): a token's numbers are the same bits
whatever else its step holds. The kernels row by row (a linear layer's rows, dense and packed, past the 64 rows
torch's GEMM otherwise takes; a prompt's queries against decode's), then the engine: the sampled tokens and
their top logprobs, compared bit for bit, of each prompt alone against batched, chunked, preempted, from the
prefix cache, drafted (speculative decoding) and beside a LoRA adapter's requests."""

from __future__ import annotations

import random

import pytest
import torch

import kernels
from engine import LLM, SamplingParams
from kernels.cpu import attention, matmul
from tests.test_packed_weights import packed_weight

pytestmark = pytest.mark.skipif(not (matmul.packed_available() and attention.available()), reason="no C compiler")

# top-5 logprobs of every sampled token: 6 floats a token that must match to the bit
GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, logprobs=5)


@pytest.fixture(autouse=True)
def back_to_normal():
    """The mode is the process's (an engine sets it): off again for the tests after these."""
    yield
    kernels.set_batch_invariant(False)


@pytest.fixture
def invariant():
    kernels.set_batch_invariant(True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_a_linear_rows_result_does_not_depend_on_the_other_rows(invariant, dtype):
    """Dense and packed (Q4_1, Q6_K), with a bias, at 1 to 200 rows: every row as it comes alone."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(200, 256, generator=gen).to(dtype)
    weights = [(torch.randn(96, 256, generator=gen).to(dtype), None)]
    weights += [(packed_weight(fmt, 96, 256, seed=1), fmt) for fmt in ("q4_1", "q6_k")]  # (256: a K-quant block)
    bias = torch.randn(96, generator=gen).to(dtype)
    for w, fmt in weights:
        alone = torch.cat([kernels.linear(x[i:i + 1], w, bias, fmt) for i in range(200)])
        for m in (2, 65, 200):  # (65: past matmul.ROWS, where torch's GEMM takes a step otherwise)
            assert torch.equal(kernels.linear(x[:m], w, bias, fmt), alone[:m]), (fmt, m)


@pytest.mark.parametrize("window,softcap", [(0, 0.0), (5, 0.0), (0, 3.0)], ids=["causal", "window", "softcap"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_a_prompts_queries_attend_as_decode_steps(invariant, dtype, window, softcap):
    """Two prompts, one whole and one a chunk after a cached prefix: each query's output is, bit for bit, what
    decode computes for it as the last token of its prefix."""
    gen = torch.Generator().manual_seed(1)
    bs, heads, kv_heads, d = 4, 4, 2, 16
    k_cache = torch.randn(12, bs, kv_heads, d, generator=gen).to(dtype)
    v_cache = torch.randn(12, bs, kv_heads, d, generator=gen).to(dtype)
    tables = torch.tensor([[3, 7, 1, 0, 0, 0], [5, 2, 9, 11, 4, 6]])
    seq_lens, q_lens = torch.tensor([10, 21]), torch.tensor([10, 8])  # the second: 13 tokens cached, 8 new
    query_start = torch.tensor([0, 10, 18])
    q = torch.randn(18, heads, d, generator=gen).to(dtype)
    unused = torch.empty(0, dtype=torch.int64)
    out = kernels.paged_prefill_attention(q, k_cache, v_cache, tables, seq_lens, query_start, unused, unused, 21,
                                          0.25, window, softcap)
    for row in range(18):
        b = int(row >= 10)
        length = int(seq_lens[b] - q_lens[b]) + row - int(query_start[b]) + 1
        one = kernels.paged_decode_attention(q[row:row + 1], k_cache, v_cache, tables[b:b + 1],
                                             torch.tensor([length]), length, 0.25, window, softcap)
        assert torch.equal(out[row:row + 1], one), row
    kernels.set_batch_invariant(False)  # (the other path: the same numbers, not the same bits)
    torch.testing.assert_close(kernels.paged_prefill_attention(q, k_cache, v_cache, tables, seq_lens, query_start,
                                                               unused, unused, 21, 0.25, window, softcap), out,
                               rtol=2e-2 if dtype == torch.bfloat16 else 1e-5, atol=1e-5)


def prompts(n: int = 6, seed: int = 0) -> list[list[int]]:
    """Random prompts of 5 to 60 tokens; batched, a prefill step holds far more than 64 rows."""
    rng = random.Random(seed)
    return [[rng.randrange(3, 10000) for _ in range(rng.randint(5, 60))] for _ in range(n)]


def answers(outs) -> list[tuple]:
    return [(o.token_ids, o.logprobs) for o in outs]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_greedy_tokens_and_logprobs_never_depend_on_the_batch(tiny_llama, dtype):
    """Each prompt alone (no prefix cache) against: all together, chunks of 7 tokens a step, 12 blocks for 6
    requests (preempted and recomputed), the same prompts again from the prefix cache, and ngram drafts."""
    base = dict(dtype=dtype, max_model_len=512, batch_invariant=True)
    llm = LLM(tiny_llama, num_kv_blocks=512, enable_prefix_caching=False, **base)
    alone = answers(llm.generate(p, GREEDY)[0] for p in prompts())
    for name, extra in [("batched", {}), ("chunked", dict(max_num_batched_tokens=7)),
                        ("preempted", dict(num_kv_blocks=12)),
                        ("drafted", dict(speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                                             "prompt_lookup_min": 1, "prompt_lookup_max": 2}))]:
        llm = LLM(tiny_llama, **{"num_kv_blocks": 512, **extra}, **base)
        assert answers(llm.generate(prompts(), GREEDY)) == alone, name
        if name == "preempted":
            assert llm.engine.scheduler.num_preemptions > 0
        if name == "batched":  # again: every prompt's blocks but its last token's from the cache
            outs = llm.generate(prompts(), GREEDY)
            assert all(o.num_cached_tokens for o in outs if len(o.prompt_token_ids) > 16)
            assert answers(outs) == alone, "prefix-cached"


@pytest.mark.parametrize("arch", ["qwen3", "gemma2", "mixtral", "qwen2_moe", "gpt_oss"])
def test_other_architectures_alone_and_batched(arch, tmp_path, smollm_tokenizer_dir):
    """Qwen3's norms of q and k, Gemma 2's caps and windows (its logits' tanh), mixtures of experts (Qwen2-MoE's
    shared expert and its sigmoid gate; GPT-OSS's sinks and clamped SwiGLU): alone against batched in chunks of 37
    tokens. (Torch's tanh and sigmoid go a row at a time in this mode: ``kernels.by_rows``.)"""
    from tests.conftest import make_tiny_model

    model = make_tiny_model(str(tmp_path), arch, smollm_tokenizer_dir)
    base = dict(dtype="float32", max_model_len=512, batch_invariant=True)
    llm = LLM(model, enable_prefix_caching=False, **base)
    alone = answers(llm.generate(p, GREEDY)[0] for p in prompts())
    llm = LLM(model, max_num_batched_tokens=37, **base)
    assert answers(llm.generate(prompts(), GREEDY)) == alone


def test_a_lora_adapters_requests_and_the_base_models_beside_them(lora_tiny):
    """Requests of an adapter, alone and in a batch with the base model's and another adapter's (the step's
    span of slots changes): the same bits."""
    model, a, b = lora_tiny
    llm = LLM(model, dtype="float32", max_model_len=512, num_kv_blocks=512, batch_invariant=True,
              lora_modules={"a": a, "b": b}, enable_prefix_caching=False)
    ps = prompts(4, seed=3)
    alone = [answers(llm.generate(p, GREEDY, lora_request=name)) for p, name in zip(ps, ["a", None, "b", "a"],
                                                                                     strict=True)]
    mixed = answers(llm.generate(ps, GREEDY, lora_request=["a", None, "b", "a"]))
    assert mixed == [x[0] for x in alone]


def test_an_engine_keeps_its_mode_beside_another_engine(tiny_llama):
    """The mode is the process's: an engine sets its own before each step, so one made later without it (or
    with it) changes nothing for the other."""
    base = dict(dtype="float32", max_model_len=512, enable_prefix_caching=False)
    invariant = LLM(tiny_llama, batch_invariant=True, **base)
    alone = answers(invariant.generate(p, GREEDY)[0] for p in prompts())
    LLM(tiny_llama, **base).generate(prompts(), GREEDY)
    assert not kernels.batch_invariant()
    assert answers(invariant.generate(prompts(), GREEDY)) == alone
    assert kernels.batch_invariant()


def test_batch_invariant_is_for_the_cpu_kernels(tiny_llama, monkeypatch, tmp_path, smollm_tokenizer_dir):
    """Refused where a step could leave the C kernels: other kernels, float16, heads they do not take,
    encoders."""
    from transformers import BertConfig

    from tests.conftest import make_tiny_model
    from tests.test_encoder import SHAPE, save_encoder

    with pytest.raises(ValueError, match="batch_invariant must be true or false"):
        LLM(tiny_llama, batch_invariant="yes")
    with pytest.raises(ValueError, match="batch_invariant needs float32 or bfloat16, not float16"):
        LLM(tiny_llama, batch_invariant=True, dtype="float16")
    odd = make_tiny_model(str(tmp_path / "odd"), "llama", smollm_tokenizer_dir, head_dim=12)
    with pytest.raises(ValueError, match=r"heads a multiple of 8 up to 256 wide \(this model's: 12\)"):
        LLM(odd, batch_invariant=True)
    bert = save_encoder(str(tmp_path / "bert"), BertConfig(**SHAPE, max_position_embeddings=64), head=False, seed=1)
    with pytest.raises(ValueError, match="batch_invariant is for generating models"):
        LLM(bert, batch_invariant=True)
    monkeypatch.setattr(kernels, "_backend", "reference")
    with pytest.raises(ValueError, match="CPU only, with its own kernels"):
        LLM(tiny_llama, batch_invariant=True)
    with pytest.raises(ValueError, match="TOKENMILL_KERNELS=auto"):
        kernels.set_batch_invariant(True)


def test_a_served_requests_answer_is_the_same_alone_and_among_concurrent_ones(tiny_llama):
    """``tokenmill serve --batch-invariant``, the official client: six chat completions one at a time, then the
    same six at once (batched, and from the prefix cache): the same tokens and top logprobs, bit for bit."""
    from concurrent.futures import ThreadPoolExecutor

    import openai

    from tests.test_server_e2e import Server, _post

    questions = ["What is the capital of France?", "Count to five.", "Name a color.", "Tell me a story " * 9,
                 "Why is the sky blue? Explain it at length, with examples. " * 3, "Hi"]
    server = Server("--model", tiny_llama, "--served-model-name", "tiny", "--dtype", "float32", "--max-model-len",
                    "512", "--batch-invariant", startup=120,
                    env={"VLLM_SERVER_DEV_MODE": "1"})  # (vLLM's /reset_prefix_cache)
    try:
        assert "batch-invariant mode" in server.log()
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)

        def ask(question: str) -> list:
            r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": question}],
                                               max_tokens=12, temperature=0, logprobs=True, top_logprobs=5,
                                               extra_body={"ignore_eos": True})
            return [(t.token, t.logprob, [(o.token, o.logprob) for o in t.top_logprobs])
                    for t in r.choices[0].logprobs.content]

        alone = []
        for q in questions:
            alone.append(ask(q))
            assert _post(server.url + "/reset_prefix_cache") == (200, b"")
        with ThreadPoolExecutor(len(questions)) as pool:
            assert list(pool.map(ask, questions)) == alone
            assert list(pool.map(ask, questions)) == alone  # (prefix-cached)
    finally:
        server.close()


def test_the_tool_counts_changed_answers(tiny_llama, capsys):
    """``tools/batch_invariance.py`` on the tiny llama, logprobs compared: none change with the mode."""
    from tools import batch_invariance

    summary = batch_invariance.main(["--model", tiny_llama, "--num-prompts", "10", "--max-tokens", "6", "--logprobs",
                                     "--batch-invariant"])
    assert summary["changed"] == {"batched": 0, "prefix-cached": 0, "batches of 8": 0}
    assert summary["num_prompts"] == 10 and capsys.readouterr().out.count(" 0 answers changed") == 3
