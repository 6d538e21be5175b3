"""Tensor parallel on the CPU (gloo): T ranks give TP=1's greedy tokens, token for token.

Tiny random Llama, Qwen2 and Qwen3 models with KV heads both split (divisible by T) and replicated
(fewer than T), through chunked prefill, concurrent requests, a shared prefix, prompt
logprobs and a vocab that T does not divide, and embeddings; the default SmolLM2 GGUF with TP=3 and quantized
weights kept packed on each rank. Failures:
a killed worker fails the engine within seconds with a message naming the rank, and leaves no
process behind; an unsupported split is refused at start. ``tokenmill serve -tp 2`` answers
like TP=1, and when its engine (rank 0) dies the worker goes too.
"""

from __future__ import annotations

import multiprocessing
import os
import re
import signal
import time

import pytest
import torch

from engine import LLM, SamplingParams
from engine.models.config import ModelConfig
from engine.models.layers import ColumnLinear
from engine.parallel import StepInput, TensorParallelError, TPGroup, check_split
from tests.conftest import make_tiny_model
from tests.test_server_e2e import Server, openai_client, pid_alive, wait_for

KW = dict(device="cpu", dtype="float32", num_kv_blocks=48, max_model_len=256, max_num_batched_tokens=32)  # 32: prompts prefill in chunks
PREFIX = list(range(300, 340))  # two requests share it: prefix-cached blocks under TP too
PROMPTS = [
    PREFIX + [7, 11, 13],  # 43 tokens: two chunks
    PREFIX + [17, 19],
    [1, 5, 9, 200, 3000, 17] * 10,  # 60 tokens
    [42, 43],
]


@pytest.fixture(scope="module")
def tokenizer(smollm_tokenizer_dir):
    """SmolLM2's, loaded once: handed to each LLM (loading it from a GGUF takes seconds)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm_tokenizer_dir)


def tiny(tmp_path, tok_dir, arch: str, heads: int, kv_heads: int, **kw) -> str:
    return make_tiny_model(str(tmp_path / f"{arch}-{heads}-{kv_heads}"), arch, tok_dir, seed=5,
                           num_attention_heads=heads, num_key_value_heads=kv_heads, hidden_size=16 * heads,
                           intermediate_size=192, **kw)


def params() -> list[SamplingParams]:
    greedy = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    with_logprobs = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, logprobs=2, prompt_logprobs=3)
    return [with_logprobs, greedy, with_logprobs, greedy]


def workers_of(llm: LLM) -> list:
    return llm.engine.runner.tp.driver.procs


def assert_close_logprobs(got, want) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        if w is None:
            assert g is None
            continue
        assert g[0] == pytest.approx(w[0], abs=1e-4)
        assert [t for t, _ in g[1]] == [t for t, _ in w[1]]
        assert [lp for _, lp in g[1]] == pytest.approx([lp for _, lp in w[1]], abs=1e-4)


# KV heads split (divisible by T) and replicated (fewer than T), each arch at T=2 and T=3;
# two vocab sizes that T does not divide (the last rank's vocab slice is padded).
@pytest.mark.parametrize("arch,heads,kv_heads,t,vocab", [
    ("llama", 6, 2, 2, 49152),  # 1 KV head per rank
    ("llama", 6, 1, 3, 49154),  # the KV head on every rank
    ("qwen2", 6, 1, 2, 49153),  # q/k/v biases; the KV head on both ranks
    ("qwen2", 6, 3, 3, 49152),  # 1 KV head per rank
    ("qwen3", 6, 1, 2, 49152),  # q/k norms, whole on every rank; the KV head on both ranks
    ("phi3", 6, 2, 2, 49152),  # q|k|v and gate|up fused in the checkpoint: split into parts, then sliced
    ("qwen3_moe", 6, 2, 2, 49152),  # each expert's width split; the router on every rank
    ("qwen2_moe", 6, 3, 3, 49153),  # and the shared expert's
    ("gemma3_text", 6, 2, 2, 49152),  # float32 norms (1 + w) and q/k norms on every rank; windows; GELU
    ("gemma2", 6, 1, 2, 49153),  # capped scores and logits (the cap after the gather)
    ("granite", 6, 2, 2, 49152),  # sublayer outputs scaled after their all-reduce, logits after the gather
    ("olmo2", 6, 2, 2, 49152),  # q/k norms across all heads: the ranks' sums of squares added
    ("olmo3", 6, 1, 2, 49152),  # ...the KV head kept by both ranks counted once
    ("gpt_oss", 6, 2, 2, 49152),  # each rank's heads' sinks, its share of the experts' biases; down's bias once
])
def test_tp_greedy_equals_tp1(tmp_path, smollm_tokenizer_dir, tokenizer, arch, heads, kv_heads, t, vocab):
    path = tiny(tmp_path, smollm_tokenizer_dir, arch, heads, kv_heads, vocab_size=vocab)
    with LLM(path, **KW) as ref:
        ref.tokenizer = tokenizer
        want = ref.generate(PROMPTS, params())
        want_vectors = [o.embedding for o in ref.embed(PROMPTS)]
    threads = torch.get_num_threads()
    with LLM(path, tensor_parallel_size=t, **KW) as llm:
        runner = llm.engine.runner
        assert (runner.tp.rank, runner.tp.size) == (0, t)
        assert runner.kv_cache.shape[4] == max(1, kv_heads // t)  # this rank's slice of the cache
        assert bool(runner.window_layers) == arch.startswith(("gemma", "gpt_oss"))  # sliding layers: own pool
        assert torch.get_num_threads() == max(1, threads // t)
        procs = workers_of(llm)
        assert len(procs) == t - 1 and all(p.is_alive() for p in procs)
        llm.tokenizer = tokenizer
        got = llm.generate(PROMPTS, params())
        got_vectors = [o.embedding for o in llm.embed(PROMPTS)]  # pooled on rank 0 from the whole hidden state
    assert torch.get_num_threads() == threads  # given back at close
    assert torch.allclose(torch.tensor(got_vectors), torch.tensor(want_vectors), atol=1e-5)
    assert all(p.exitcode == 0 for p in procs)  # the shutdown command, not a signal
    for g, w in zip(got, want, strict=True):
        assert g.token_ids == w.token_ids
        assert g.finish_reason == w.finish_reason == "length"
        assert g.num_cached_tokens == w.num_cached_tokens
    assert got[1].num_cached_tokens == 32  # two blocks of the shared prefix
    for g, w in zip(got, want, strict=True):
        if w.prompt_logprobs is not None:
            assert_close_logprobs(g.prompt_logprobs, w.prompt_logprobs)
            assert_close_logprobs(g.logprobs, w.logprobs)


def test_default_gguf_tp3_equals_tp1(default_gguf, tokenizer):
    """SmolLM2-135M: 9 heads, 3 KV heads, tied embeddings; 3 ranks of 3 heads and 1 KV head."""
    chat = tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                         add_generation_prompt=True, tokenize=False)
    p = SamplingParams(max_tokens=10, temperature=0.0)
    with LLM(device="cpu", dtype="float32", num_kv_blocks=16, max_model_len=128) as ref:
        ref.tokenizer = tokenizer
        want = ref.generate(chat, p)[0]
    with LLM(device="cpu", dtype="float32", tensor_parallel_size=3, num_kv_blocks=16, max_model_len=128) as llm:
        layer = llm.engine.runner.model.layers[0]  # kept as the file's Q4_1 blocks: down's 512 columns a rank
        assert (layer.self_attn.o_proj.packed, layer.mlp.down_proj.packed) == ("q4_1", "q4_1")
        llm.tokenizer = tokenizer
        got = llm.generate(chat, p)[0]
    assert got.token_ids == want.token_ids
    assert got.text == want.text == "The capital of France is Paris."


@pytest.mark.parametrize("kind", ["gguf", "mxfp4", "int4"])
def test_quantized_weights_stay_packed_on_each_rank(kind, tmp_path, smollm_tokenizer_dir, tokenizer):
    """A Qwen2-MoE GGUF (Q4_0 matrices, Q8_0 experts' down and embeddings), a GPT-OSS MXFP4 folder and a Qwen2-MoE
    GPTQ folder at TP=2: each rank keeps its rows, and whole blocks of its columns of o and down, as they are in
    the file (the C kernel multiplies them), the experts' blocks shared out where their width over 2 is not whole
    blocks; greedy tokens equal one rank's."""
    from kernels.cpu import matmul
    from tests.conftest import make_tiny_mxfp4_gpt_oss
    from tools.quantize_model import quantize_checkpoint
    from tools.write_gguf import write_gguf

    if not matmul.packed_available():
        pytest.skip("the C kernel does not build here")
    folder = tiny(tmp_path, smollm_tokenizer_dir, "qwen2_moe", 8, 2, moe_intermediate_size=96)  # hidden 128
    if kind == "gguf":
        path = str(tmp_path / "moe.gguf")
        write_gguf(folder, path, "qwen2moe", matrices_as=lambda name: "Q8_0" if "ffn_down_exps" in name or
                   name == "token_embd.weight" else "Q4_0" if name.startswith("blk.") else None)
        want_packed = ("q4_0", "q8_0", "q4_0")
    elif kind == "int4":
        path = quantize_checkpoint(folder, str(tmp_path / "int4"), method="gptq", group=32)
        want_packed = ("q4_z", "q4_z", "q4_z")
    else:
        path = make_tiny_mxfp4_gpt_oss(str(tmp_path / "mx"), smollm_tokenizer_dir)
        want_packed = ("mxfp4", "mxfp4", None)
    kw = KW | dict(num_kv_blocks=64)
    with LLM(path, **kw) as one:
        one.tokenizer = tokenizer
        want = [o.token_ids for o in one.generate(PROMPTS, params())]
    with LLM(path, tensor_parallel_size=2, **kw) as two:
        layer = two.engine.runner.model.layers[0]
        experts = layer.mlp.experts
        assert (experts.packed, experts.packed_down, layer.self_attn.o_proj.packed) == want_packed
        # the experts' width 96 (int4, GGUF): rank 0 keeps 2 of its 3 blocks of 32; 64 (MXFP4): 1 of 2
        assert experts.w2.shape[-1] == {"gguf": 2 * 34, "mxfp4": 17, "int4": 2 * 20}[kind]
        two.tokenizer = tokenizer
        got = [o.token_ids for o in two.generate(PROMPTS, params())]
    assert got == want


def test_killed_worker_fails_the_engine_cleanly(tmp_path, smollm_tokenizer_dir):
    path = tiny(tmp_path, smollm_tokenizer_dir, "llama", 6, 1)
    with LLM(path, tensor_parallel_size=3, **KW) as llm:
        procs = workers_of(llm)
        runner = llm.engine.runner
        forward, steps = runner.forward_step, []

        def forward_step(step):  # rank 2 dies in the middle of the 5th step, after its broadcast
            steps.append(time.monotonic())
            if len(steps) == 5:
                os.kill(procs[1].pid, signal.SIGKILL)
            return forward(step)

        runner.forward_step = forward_step
        with pytest.raises(TensorParallelError, match=r"tensor-parallel rank 2 \(pid \d+\) died \(killed by SIGKILL\)"):
            llm.generate([[1, 2, 3], [4, 5]], SamplingParams(max_tokens=20, ignore_eos=True))
        assert len(steps) == 5 and time.monotonic() - steps[-1] < 5.0  # the collective it broke failed fast
        wait_for(lambda: not any(p.is_alive() for p in procs), 5, "every worker to be gone")  # no orphan
        # the engine stays failed, with the same message, before sending anything
        with pytest.raises(TensorParallelError, match="rank 2"):
            llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2))
        assert len(steps) == 5
    assert multiprocessing.active_children() == []


def test_unsupported_splits_are_refused_with_the_numbers(tmp_path, smollm_tokenizer_dir):
    def cfg(heads: int, kv: int, inter: int = 192) -> ModelConfig:
        return ModelConfig.from_hf({"model_type": "llama", "vocab_size": 100, "hidden_size": 16 * heads,
                                    "intermediate_size": inter, "num_hidden_layers": 1,
                                    "num_attention_heads": heads, "num_key_value_heads": kv})

    with pytest.raises(ValueError, match="tensor_parallel_size 4 does not divide the model's 6 attention heads"):
        check_split(cfg(6, 2), 4)
    with pytest.raises(ValueError, match="tensor_parallel_size 3 does not fit the model's 2 KV heads"):
        check_split(cfg(6, 2), 3)
    with pytest.raises(ValueError, match="tensor_parallel_size 2 does not divide the model's intermediate size 191"):
        check_split(cfg(6, 2, 191), 2)
    moe = ModelConfig.from_hf({"model_type": "qwen2_moe", "vocab_size": 100, "hidden_size": 96, "intermediate_size": 192,
                               "num_hidden_layers": 1, "num_attention_heads": 6, "num_key_value_heads": 6,
                               "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 96,
                               "shared_expert_intermediate_size": 100})
    with pytest.raises(ValueError, match="does not divide the model's shared expert's width 100"):
        check_split(moe, 3)
    check_split(cfg(8, 2), 4)  # 2 KV heads, each kept by 2 of the 4 ranks
    check_split(cfg(9, 3), 3)
    # at start, before any worker is started
    path = tiny(tmp_path, smollm_tokenizer_dir, "llama", 6, 2)
    with pytest.raises(ValueError, match="tensor_parallel_size 3 does not fit the model's 2 KV heads"):
        LLM(path, tensor_parallel_size=3, **KW)
    assert multiprocessing.active_children() == []
    with pytest.raises(ValueError, match="tensor_parallel_size must be positive"):
        LLM(path, tensor_parallel_size=0)


def test_replicated_kv_heads_follow_their_query_heads():
    """8 query heads, 2 KV heads, 4 ranks: ranks 0-1 read KV head 0, ranks 2-3 KV head 1."""
    d, hidden = 4, 32
    full = torch.arange(8 * d + 2 * d + 2 * d, dtype=torch.float32)[:, None].expand(-1, hidden)
    q, k, v = full.split([8 * d, 2 * d, 2 * d])
    for rank in range(4):
        layer = ColumnLinear(hidden, [8 * d, 2 * d, 2 * d], tp=TPGroup(rank, 4), replicas=[1, 2, 2])
        for part, w in enumerate((q, k, v)):
            layer.load(part, w)
        lq, lk, lv = layer.weight.split(layer.out_sizes)
        assert torch.equal(lq, q[rank * 2 * d:(rank + 1) * 2 * d])  # query heads 2r, 2r+1
        assert torch.equal(lk, k[rank // 2 * d:(rank // 2 + 1) * d])
        assert torch.equal(lv, v[rank // 2 * d:(rank // 2 + 1) * d])


def test_step_input_packs_into_one_int64_tensor():
    step = StepInput(query_lens=[3, 1], computed_lens=[0, 17], token_ids=[5, 6, 7, 8], logits_rows=[0, 1, 2, 3],
                     table_rows=[2, 0], write_at=[40, 41, 0], write_ids=[4, 1, 2])
    header, payload = step.pack()
    assert header.dtype == payload.dtype == torch.int64 and header.numel() == 8
    assert payload.numel() == StepInput.payload_len(header.tolist()) == 3 * 2 + 4 + 4 + 2 * 3
    assert StepInput.unpack(header.tolist(), payload) == step
    step.lora_slots = [1, -1]  # with LoRA adapters: each sequence's slot
    header, payload = step.pack()
    assert payload.numel() == StepInput.payload_len(header.tolist()) == 3 * 2 + 4 + 4 + 2 * 3 + 2
    assert StepInput.unpack(header.tolist(), payload) == step


def test_step_input_does_not_grow_with_the_context_held():
    """A decode step of 256 sequences, one of them 128K tokens long, sends its 256 rows and nothing of
    the long table (which went out, write by write, as it grew)."""
    step = StepInput([1] * 256, [131072] + [100] * 255, list(range(256)), list(range(256)), list(range(256)), [], [])
    assert StepInput.payload_len(step.pack()[0].tolist()) == 5 * 256


@pytest.mark.parametrize("killed", ["engine", "worker"])
def test_serve_tp2_end_to_end(tmp_path, smollm_tokenizer_dir, tokenizer, killed):
    """One request through ``tokenmill serve -tp 2``; then, the server idle, rank 0 (the engine) dies and its
    worker goes with it (PR_SET_PDEATHSIG), or the worker dies and the engine finds out at once, not at its next
    request (its /health said ok until one was sacrificed); the launcher exits non-zero."""
    path = tiny(tmp_path, smollm_tokenizer_dir, "llama", 6, 2)
    prompt = "The capital of France is"
    with LLM(path, device="cpu", dtype="float32", max_model_len=256) as ref:
        ref.tokenizer = tokenizer
        want = ref.generate(prompt, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))[0]
    server = Server("--model", path, "--served-model-name", "tiny", "-tp", "2", "--max-model-len", "256",
                    "--device", "cpu", "--kv-cache-memory", "64M")
    try:
        r = openai_client(server).completions.create(model="tiny", prompt=prompt, max_tokens=8, temperature=0,
                                                     extra_body={"ignore_eos": True})
        assert r.choices[0].text == want.text
        worker = int(re.search(r"tensor parallel: 2 ranks \(gloo; workers (\d+)\)", server.log()).group(1))
        assert pid_alive(worker)
        if killed == "engine":
            os.kill(server.pids("tokenmill-engine")[-1], signal.SIGKILL)
            wait_for(lambda: not pid_alive(worker), 5, "the worker to die with rank 0")
        else:
            os.kill(worker, signal.SIGKILL)
        wait_for(lambda: server.proc.poll() is not None, 30, "the server to go down")
        assert server.proc.returncode != 0
        if killed == "worker":
            assert re.search(r"tensor-parallel rank 1 \(pid \d+\) died \(killed by SIGKILL\)", server.log())
    finally:
        server.close()
