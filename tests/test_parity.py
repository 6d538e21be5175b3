"""Greedy token-for-token parity with Hugging Face transformers (fp32)."""

from __future__ import annotations

import json
import math
import os

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import kernels.reference as ref
from engine import LLM, SamplingParams
from tests.conftest import make_tiny_gemma3_multimodal, make_tiny_model, make_tiny_mxfp4_gpt_oss

PROMPTS = [
    "The quick brown fox jumps over the lazy dog because",
    "def fibonacci(n):\n    ",
    "请用一句话介绍一下长城的历史。",
]


def hf_greedy(model, ids: list[int], n: int) -> list[int]:
    out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                         max_new_tokens=n, do_sample=False, pad_token_id=0)
    return out[0, len(ids):].tolist()


def check_parity(llm: LLM, hf, tokenizer, prompts: list[str], n: int = 32) -> None:
    ids = [tokenizer.encode(p) for p in prompts]
    outs = llm.generate(ids, SamplingParams(max_tokens=n, temperature=0.0))
    for prompt, p_ids, out in zip(prompts, ids, outs, strict=True):
        assert out.token_ids == hf_greedy(hf, p_ids, n), prompt


@pytest.mark.parametrize("linear_rows", ["0", "64"], ids=["torch-linear", "c-linear"])
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "mistral", "phi3", "mixtral", "qwen2_moe", "qwen3_moe",
                                  "granite"])
def test_tiny_models_match_transformers(arch, linear_rows, tmp_path, smollm_tokenizer_dir, monkeypatch):
    """With every CPU linear step in torch, and with every step of up to 64 rows in the C kernel
    (``kernels.cpu.matmul``: decode steps, and these prompts' prefill)."""
    monkeypatch.setenv("TOKENMILL_CPU_LINEAR_ROWS", linear_rows)
    # Qwen3's head_dim is its own (128 with hidden 1024 in Qwen3-0.6B): here 24, not 64 / 4
    extra = {"head_dim": 24} if arch == "qwen3" else {}
    path = make_tiny_model(str(tmp_path / arch), arch, smollm_tokenizer_dir, seed=1, **extra)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    llm = LLM(path, device="cpu", dtype="float32", num_kv_blocks=256, max_model_len=512)
    check_parity(llm, hf, llm.tokenizer, PROMPTS)


def test_moe_dense_layers_and_stacked_experts_match_transformers(tmp_path, smollm_tokenizer_dir):
    """Qwen3-MoE with a dense MLP in layer 0 (``mlp_only_layers``), saved as transformers 5 holds it in
    memory: each layer's experts stacked (``experts.gate_up_proj`` (E, 2I, H), ``experts.down_proj``)."""
    from safetensors.torch import save_file

    path = make_tiny_model(str(tmp_path / "moe"), "qwen3_moe", smollm_tokenizer_dir, seed=3, mlp_only_layers=[0],
                           num_hidden_layers=3)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    stacked = {k: v.contiguous() for k, v in hf.state_dict().items()}
    assert "model.layers.1.mlp.experts.gate_up_proj" in stacked and "model.layers.0.mlp.gate_proj.weight" in stacked
    os.remove(os.path.join(path, "model.safetensors"))
    save_file(stacked, os.path.join(path, "model.safetensors"))
    llm = LLM(path, device="cpu", dtype="float32", num_kv_blocks=256, max_model_len=512)
    assert [type(layer.mlp).__name__ for layer in llm.engine.runner.model.layers] == ["GatedMLP", "SparseMoE",
                                                                                     "SparseMoE"]
    check_parity(llm, hf, llm.tokenizer, PROMPTS)


@pytest.mark.parametrize("served", ["short", "short-by-cache", "long"])
def test_phi3_longrope_matches_transformers(served, tmp_path, smollm_tokenizer_dir):
    """Phi-3.5's LongRoPE (an original length of 64 here): served up to 64 tokens (asked for, or all the
    KV cache holds), the short factors, as transformers uses them for such contexts; served longer, the
    long ones, as transformers uses them for a prompt past 64 tokens (and everything after it); cos and
    sin scaled by the attention factor."""
    rope = {"rope_type": "longrope", "rope_theta": 10000.0, "original_max_position_embeddings": 64,
            "short_factor": [1.0 + i / 10 for i in range(8)], "long_factor": [2.0 + i / 2 for i in range(8)]}
    path = make_tiny_model(str(tmp_path / "phi3"), "phi3", smollm_tokenizer_dir, seed=3, rope_parameters=rope,
                           original_max_position_embeddings=64)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    size = {"short": dict(max_model_len=64), "short-by-cache": dict(num_kv_blocks=4), "long": dict(max_model_len=512)}
    llm = LLM(path, device="cpu", dtype="float32", **{"num_kv_blocks": 256, **size[served]})
    assert llm.engine.max_model_len == (512 if served == "long" else 64)
    assert llm.engine.runner.model_cfg.rope_scaling["attention_factor"] == pytest.approx(
        (1 + math.log(1024 / 64) / math.log(64)) ** 0.5)  # max_position_embeddings 1024 / 64
    if served != "long":
        check_parity(llm, hf, llm.tokenizer, ["The quick brown fox", "def fibonacci(n):"], n=16)
    else:
        check_parity(llm, hf, llm.tokenizer, [" ".join(["history"] * 80)])


@pytest.mark.parametrize("yarn", [{"factor": 4.0}, {"factor": 4.0, "beta_fast": 8, "truncate": False},
                                  {"factor": 8.0, "mscale": 1.0, "mscale_all_dim": 0.7}],
                         ids=["qwen-recipe", "untruncated", "deepseek-mscale"])
def test_yarn_matches_transformers(yarn, tmp_path, smollm_tokenizer_dir):
    """YaRN (Qwen2.5/Qwen3's long-context recipe, DeepSeek's mscale): prompts and outputs past the
    original 64 positions; served to factor x original where that passes max_position_embeddings."""
    rope = {"rope_type": "yarn", "rope_theta": 10000.0, "original_max_position_embeddings": 64, **yarn}
    path = make_tiny_model(str(tmp_path / "yarn"), "qwen3", smollm_tokenizer_dir, seed=3, rope_parameters=rope,
                           max_position_embeddings=128, head_dim=24)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    llm = LLM(path, device="cpu", dtype="float32", num_kv_blocks=256)
    assert llm.engine.max_model_len == 64 * yarn["factor"]
    check_parity(llm, hf, llm.tokenizer, [" ".join(["history"] * 80), " ".join(["a quick fox"] * 40)])


def test_yarn_by_hf_overrides_serves_the_stretch(tmp_path, smollm_tokenizer_dir):
    """Qwen's documented way: --hf-overrides '{"rope_scaling": {"rope_type": "yarn", ...}}' on a model
    without it, which then serves factor x original positions."""
    path = make_tiny_model(str(tmp_path / "q"), "qwen3", smollm_tokenizer_dir, seed=3, max_position_embeddings=128,
                           head_dim=24)
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128}
    llm = LLM(path, device="cpu", dtype="float32", num_kv_blocks=64, hf_overrides={"rope_scaling": yarn})
    assert llm.engine.max_model_len == 512
    assert llm.engine.runner.model_cfg.rope_scaling["attention_factor"] == pytest.approx(0.1 * math.log(4) + 1)


def test_phi4_mini_partial_rotary_matches_transformers(tmp_path, smollm_tokenizer_dir):
    """Phi-4-mini's RoPE turns 0.75 of each head's dims (12 of 16 here), with LongRoPE factors for those."""
    rope = {"rope_type": "longrope", "rope_theta": 10000.0, "original_max_position_embeddings": 64,
            "partial_rotary_factor": 0.75, "short_factor": [1.0 + i / 10 for i in range(6)],
            "long_factor": [2.0 + i / 2 for i in range(6)]}
    path = make_tiny_model(str(tmp_path / "phi4mini"), "phi3", smollm_tokenizer_dir, seed=5, rope_parameters=rope,
                           original_max_position_embeddings=64, partial_rotary_factor=0.75)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    llm = LLM(path, device="cpu", dtype="float32", num_kv_blocks=256, max_model_len=512)
    assert llm.engine.runner.model_cfg.rotary_dim == 12
    check_parity(llm, hf, llm.tokenizer, [" ".join(["history"] * 80), " ".join(["a quick fox"] * 40)])  # past 64


def test_a_sliding_window_model_matches_past_its_window(tmp_path, smollm_tokenizer_dir):
    """Mistral-7B-v0.1's way (a 4096-token window, 32k positions), small: a window of 16, prompts and
    outputs past it, served to the model's whole length; prefill in chunks shorter than the window too."""
    path = make_tiny_model(str(tmp_path / "swa"), "mistral", smollm_tokenizer_dir, seed=4)
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config | {"sliding_window": 16}, f)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    for chunk in (2048, 8):
        llm = LLM(path, device="cpu", dtype="float32", num_kv_blocks=256, max_num_batched_tokens=chunk)
        assert llm.engine.max_model_len == 1024 and llm.engine.runner.model_cfg.window(1) == 16
        check_parity(llm, hf, llm.tokenizer, PROMPTS[:2])


@pytest.mark.parametrize("arch", ["gemma", "gemma2", "gemma3_text"])
def test_gemma_matches_transformers(arch, tmp_path, smollm_tokenizer_dir):
    """Gemma 1, 2, 3 (eager attention in transformers: Gemma 2's score cap is applied there): prompts and
    outputs past the sliding window, in one prefill and in chunks of 8 (a prefix in the cache)."""
    # Gemma 3 4B+'s RoPE: its global layers' scaled (linear, 8x), its sliding layers' not
    rope = {"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}
    extra = {"rope_parameters": rope} if arch == "gemma3_text" else {}
    path = make_tiny_model(str(tmp_path / arch), arch, smollm_tokenizer_dir, seed=6, **extra)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
    for chunk in (2048, 8):
        llm = LLM(path, device="cpu", dtype="float32", num_kv_blocks=256, max_num_batched_tokens=chunk)
        check_parity(llm, hf, llm.tokenizer, PROMPTS)


@pytest.mark.parametrize("arch", ["olmo2", "olmo3"])
def test_olmo_matches_transformers(arch, tmp_path, smollm_tokenizer_dir):
    """OLMo 2 and 3: norms after each sublayer only, q and k normed across all heads; OLMo 3's window of 16
    over three of each four layers (served from their own KV pool), in one prefill and in chunks of 8."""
    extra = dict(num_hidden_layers=4, sliding_window=16) if arch == "olmo3" else {}
    path = make_tiny_model(str(tmp_path / arch), arch, smollm_tokenizer_dir, seed=5, **extra)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    for chunk in (2048, 8):
        llm = LLM(path, device="cpu", dtype="float32", num_kv_blocks=256, max_num_batched_tokens=chunk)
        assert bool(llm.engine.runner.window_layers) == (arch == "olmo3")
        check_parity(llm, hf, llm.tokenizer, PROMPTS + [" ".join(["history"] * 30)])


def test_olmo3_flat_yarn_turns_its_full_layers_only(tmp_path, smollm_tokenizer_dir):
    """OLMo 3's long-context config.json: a flat rope_scaling (YaRN), which transformers gives its full
    layers alone; the sliding ones turn unscaled by the same base. No layer_types: three of each four slide."""
    path = make_tiny_model(str(tmp_path / "o3"), "olmo3", smollm_tokenizer_dir, seed=6, num_hidden_layers=4,
                           sliding_window=16)
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    for key in ("rope_parameters", "layer_types"):
        config.pop(key, None)
    config |= {"rope_theta": 500000.0, "max_position_embeddings": 128,  # (OLMo 3's base: transformers gives
               # the sliding layers its default, whatever rope_theta says)
               "rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}}
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    llm = LLM(path, device="cpu", dtype="float32", num_kv_blocks=256)
    cfg = llm.engine.runner.model_cfg
    assert cfg.local_rope_theta == 500000.0 and cfg.rope_scaling["rope_type"] == "yarn"
    assert [cfg.window(i) for i in range(4)] == [16, 16, 16, 0]
    check_parity(llm, hf, llm.tokenizer, [" ".join(["history"] * 50)])


def test_granite_scales_and_logprobs_match_transformers(tmp_path, smollm_tokenizer_dir):
    """Granite's scales, each of which greedy tokens may not show (the logits' is monotonic): the chosen
    tokens' logprobs against transformers' log-softmax, fp32."""
    path = make_tiny_model(str(tmp_path / "granite"), "granite", smollm_tokenizer_dir, seed=2)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    llm = LLM(path, device="cpu", dtype="float32", num_kv_blocks=64)
    ids = llm.tokenizer.encode(PROMPTS[0])
    out = llm.generate([ids], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=1))[0]
    with torch.no_grad():
        logp = hf(torch.tensor([ids + out.token_ids])).logits[0, len(ids) - 1:-1].log_softmax(-1)
    want = logp.gather(-1, torch.tensor(out.token_ids)[:, None])[:, 0]
    assert torch.allclose(torch.tensor([e[0] for e in out.logprobs]), want, atol=1e-4)


def test_gemma3_multimodal_checkpoint_serves_its_language_model(tmp_path, smollm_tokenizer_dir):
    """Gemma 3 4B+ are Gemma3ForConditionalGeneration: config.json's text_config (keys left out take
    transformers' defaults), weights under language_model.model.*, a vision tower beside them (unread)."""
    from transformers import Gemma3ForConditionalGeneration

    path = make_tiny_gemma3_multimodal(str(tmp_path / "gemma3mm"), smollm_tokenizer_dir)
    hf = Gemma3ForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
    llm = LLM(path, device="cpu", dtype="float32", num_kv_blocks=256)
    model_cfg = llm.engine.runner.model_cfg
    assert (model_cfg.num_heads, model_cfg.num_kv_heads, model_cfg.head_dim) == (8, 4, 256)
    assert model_cfg.window(3) == 0 and model_cfg.window(2) == 16 and model_cfg.local_rope_theta == 10000.0
    check_parity(llm, hf, llm.tokenizer, PROMPTS)


def test_gemma3_sliding_layers_keep_their_rope_base_when_the_window_spans_everything(tmp_path, smollm_tokenizer_dir):
    """A window as long as the positions is no window, but Gemma 3's sliding layers still turn RoPE by 10000."""
    path = make_tiny_model(str(tmp_path / "g3"), "gemma3_text", smollm_tokenizer_dir, seed=8, sliding_window=1024)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
    llm = LLM(path, device="cpu", dtype="float32", num_kv_blocks=256)
    assert llm.engine.runner.model_cfg.window(0) == 0 and llm.engine.runner.model.local == [True] * 3 + [False]
    check_parity(llm, hf, llm.tokenizer, PROMPTS[:2])


def test_llama3_rope_scaling_and_tied_embeddings(tmp_path, smollm_tokenizer_dir):
    rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
    path = make_tiny_model(str(tmp_path / "l3"), "llama", smollm_tokenizer_dir, seed=2,
                           rope_parameters=rope, tie_word_embeddings=True)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    llm = LLM(path, device="cpu", dtype="float32", num_kv_blocks=256, max_model_len=512)
    long_prompt = " ".join(["history"] * 80)  # past the original 64 positions
    check_parity(llm, hf, llm.tokenizer, [PROMPTS[0], long_prompt])


def test_default_smollm2_gguf_matches_transformers(default_gguf, smollm_tokenizer_dir):
    llm = LLM(device="cpu", dtype="float32")  # no model given: the bundled SmolLM2-135M-Instruct GGUF
    model = llm.engine.runner.model  # its Q4_1 / Q8_0 blocks multiplied as they are: no dequantized copy
    assert {layer.mlp.gate_up_proj.packed for layer in model.layers} == {"q4_1"}
    assert model.embed_tokens.packed == "q8_0" and model.lm_head.shard is model.embed_tokens
    tok = AutoTokenizer.from_pretrained(smollm_tokenizer_dir)  # (the GGUF's, as transformers reads it, saved once)
    hf = AutoModelForCausalLM.from_pretrained(os.path.dirname(default_gguf), gguf_file=os.path.basename(default_gguf),
                                              dtype=torch.float32).eval()
    chat = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                   add_generation_prompt=True, tokenize=False)
    check_parity(llm, hf, tok, [chat])
    check_parity(llm, hf, tok, PROMPTS, n=16)  # (transformers' generate is most of this test's time)
    answer = llm.generate(chat, SamplingParams(max_tokens=32, temperature=0.0))[0]
    assert answer.text == "The capital of France is Paris."
    assert answer.finish_reason == "stop"
    # vLLM's LLM.chat: conversations through the template (a list of them too), the same answer
    question = [{"role": "user", "content": "What is the capital of France?"}]
    both = llm.chat([question, [*question, {"role": "assistant", "content": "Paris."},
                                {"role": "user", "content": "And of Italy?"}]], SamplingParams(max_tokens=32, temperature=0.0))
    assert both[0].text == "The capital of France is Paris." and "Rome" in both[1].text


def test_gpt_oss_matches_transformers(tmp_path, smollm_tokenizer_dir):
    """GPT-OSS: attention sinks, a window of 16 over every other layer (the prompts and outputs pass it), YaRN,
    biased router and experts, the clamped SwiGLU; prefill in chunks too, and decode both ways."""
    path = make_tiny_model(str(tmp_path / "gpt_oss"), "gpt_oss", smollm_tokenizer_dir, seed=1)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    llm = LLM(path, device="cpu", dtype="float32", num_kv_blocks=256, max_model_len=512)
    model = llm.engine.runner.model
    assert model.layers[0].self_attn.attn.window == 16 and model.layers[1].self_attn.attn.window == 0
    assert model.layers[0].self_attn.attn.sinks.abs().min() > 0
    check_parity(llm, hf, llm.tokenizer, PROMPTS, n=40)
    chunked = LLM(path, device="cpu", dtype="float32", num_kv_blocks=256, max_model_len=512,
                  max_num_batched_tokens=16, enforce_eager=True)
    check_parity(chunked, hf, chunked.tokenizer, PROMPTS[:2], n=24)


def test_gpt_oss_mxfp4_experts_hold_transformers_values(tmp_path, smollm_tokenizer_dir, monkeypatch):
    """GPT-OSS as OpenAI ships it: the experts in MXFP4 (``*_blocks``, ``*_scales``, config quant_method mxfp4),
    widened at load, or kept packed for the CPU's C kernel: exactly transformers' values either way (every nibble,
    scales of 2^-6..2^-3), greedy output equal."""
    path = make_tiny_mxfp4_gpt_oss(str(tmp_path / "mx"), smollm_tokenizer_dir)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()  # (widened: no GPU kernels here)
    for rows in ("0", "64"):  # widened at load (torch's GEMM only), and kept packed for the C kernel
        monkeypatch.setenv("TOKENMILL_CPU_LINEAR_ROWS", rows)
        llm = LLM(path, device="cpu", dtype="float32", num_kv_blocks=256, max_model_len=512)
        for ours, theirs in zip(llm.engine.runner.model.layers, hf.model.layers, strict=True):
            e = ours.mlp.experts
            assert e.packed == (None if rows == "0" else "mxfp4")
            w13, w2 = (e.w13, e.w2) if e.packed is None else (
                torch.stack([ref.dequantize(w, "mxfp4") for w in e.w13]), torch.stack([ref.dequantize(w, "mxfp4")
                                                                                       for w in e.w2]))
            gate_up = theirs.mlp.experts.gate_up_proj.transpose(1, 2)  # (E, 2I, H), gate and up rows interleaved
            assert torch.equal(w13, torch.cat([gate_up[:, 0::2], gate_up[:, 1::2]], dim=1))
            assert torch.equal(w2, theirs.mlp.experts.down_proj.transpose(1, 2))
            assert len(torch.unique(w13)) >= 25  # (FP4's 15 values times 4 scales)
        check_parity(llm, hf, llm.tokenizer, PROMPTS[:2], n=24)


def test_gpt_oss_gguf_matches_transformers(tmp_path, smollm_tokenizer_dir, monkeypatch):
    """A GPT-OSS GGUF file as llama.cpp's converter writes one (``tools/write_gguf.py``: its sinks, router and
    experts' parts split and outputs-first, biases too): in float32, greedy equal to transformers on the folder;
    its experts in MXFP4 (ggml's blocks, as llama.cpp's files hold them), kept packed on the CPU and widened alike."""
    from tools.write_gguf import write_gguf

    # (the SwiGLU's limit as llama.cpp fixes it: GGUF files do not say)
    path = make_tiny_model(str(tmp_path / "gpt_oss"), "gpt_oss", smollm_tokenizer_dir, seed=5, intermediate_size=64,
                           swiglu_limit=7.0)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    write_gguf(path, str(tmp_path / "f32.gguf"), "gpt-oss")
    llm = LLM(str(tmp_path / "f32.gguf"), tokenizer=path, device="cpu", dtype="float32", num_kv_blocks=256,
              max_model_len=512)
    assert llm.engine.runner.model.layers[0].self_attn.attn.window == 16
    check_parity(llm, hf, llm.tokenizer, PROMPTS, n=32)
    write_gguf(path, str(tmp_path / "mx.gguf"), "gpt-oss", lambda name: "MXFP4" if "_exps." in name else None)
    outs = []
    for rows in ("64", "0"):  # packed for the C kernel, and widened at load
        monkeypatch.setenv("TOKENMILL_CPU_LINEAR_ROWS", rows)
        llm = LLM(str(tmp_path / "mx.gguf"), tokenizer=path, device="cpu", dtype="float32", num_kv_blocks=256,
                  max_model_len=512)
        assert llm.engine.runner.model.layers[1].mlp.experts.packed == (None if rows == "0" else "mxfp4")
        outs.append([o.token_ids for o in llm.generate(PROMPTS, SamplingParams(max_tokens=24, temperature=0.0))])
    assert outs[0] == outs[1]
    # from OpenAI's layout (an MXFP4 folder): the same values in the file, the same tokens as the folder's
    from tools.quantize_model import mxfp4_checkpoint

    folder = mxfp4_checkpoint(path, str(tmp_path / "mx_folder"))
    write_gguf(folder, str(tmp_path / "mx2.gguf"), "gpt-oss", lambda name: "MXFP4" if "_exps." in name else None)
    monkeypatch.setenv("TOKENMILL_CPU_LINEAR_ROWS", "64")
    runs = [LLM(p, tokenizer=path, device="cpu", dtype="float32", num_kv_blocks=256, max_model_len=512)
            for p in (folder, str(tmp_path / "mx2.gguf"))]
    for a, b in zip(*(llm.engine.runner.model.layers for llm in runs), strict=True):  # (values: a -0 may be a 0)
        for w in ("w13", "w2"):
            assert torch.equal(*(torch.stack([ref.dequantize(e, "mxfp4") for e in getattr(x.mlp.experts, w)])
                                 for x in (a, b)))
    assert [[o.token_ids for o in llm.generate(PROMPTS, SamplingParams(max_tokens=24, temperature=0.0))]
            for llm in runs][0] == [o.token_ids for o in runs[1].generate(PROMPTS, SamplingParams(max_tokens=24,
                                                                                                   temperature=0.0))]
