"""Loading: parameters are made in the model's dtype, so a bf16 load never holds float32 weights."""

from __future__ import annotations

import dataclasses
import glob
import os

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch.utils._python_dispatch import TorchDispatchMode

from engine.loader import build_model, load_model_config
from engine.models.config import ModelConfig
from tests.conftest import make_tiny_model
from tools.write_gguf import write_gguf


class _Allocations(TorchDispatchMode):
    """Records the dtype and shape of every tensor any op returns."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: set[tuple[torch.dtype, tuple[int, ...]]] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (list, tuple)) else [out]:
            if isinstance(t, torch.Tensor):
                self.seen.add((t.dtype, tuple(t.shape)))
        return out


def _bf16_checkpoint(out_dir: str) -> str:
    make_tiny_model(out_dir, "llama", None)
    for file in glob.glob(f"{out_dir}/*.safetensors"):
        save_file({k: v.to(torch.bfloat16) for k, v in load_file(file).items()}, file, metadata={"format": "pt"})
    return out_dir


def test_bf16_load_allocates_no_float32_weight(tmp_path):
    path = _bf16_checkpoint(str(tmp_path))
    cfg = load_model_config(path)
    with _Allocations() as allocs:
        model = build_model(path, cfg, 256, torch.bfloat16, torch.device("cpu"))
    params = {tuple(p.shape) for p in model.parameters()}
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert not {shape for dtype, shape in allocs.seen if dtype == torch.float32} & params
    assert model.rotary.cos.dtype == torch.float32  # the RoPE tables stay float32, cast on use
    assert torch.get_default_dtype() == torch.float32  # and the default is back


def test_weights_are_converted_on_copy(tmp_path):
    path = make_tiny_model(str(tmp_path), "llama", None)  # float32 checkpoint
    cfg = load_model_config(path)
    exact = build_model(path, cfg, 256, torch.float32, torch.device("cpu"))
    half = build_model(path, cfg, 256, torch.bfloat16, torch.device("cpu"))
    for (name, a), (_, b) in zip(exact.named_parameters(), half.named_parameters(), strict=True):
        assert b.dtype == torch.bfloat16
        assert torch.equal(a.to(torch.bfloat16), b), name
    assert torch.equal(exact.rotary.cos, half.rotary.cos)


def test_mistrals_own_consolidated_file_beside_the_hf_one_is_left_alone(tmp_path):
    """Mistral's and Mixtral's repositories hold consolidated.safetensors (their format's names) too."""
    path = make_tiny_model(str(tmp_path), "mistral", None)
    cfg = load_model_config(path)
    want = build_model(path, cfg, 256, torch.float32, torch.device("cpu"))
    save_file({"layers.0.attention.wq.weight": torch.ones(4, 4)}, f"{path}/consolidated.safetensors")
    got = build_model(path, cfg, 256, torch.float32, torch.device("cpu"))
    for (name, a), (_, b) in zip(want.named_parameters(), got.named_parameters(), strict=True):
        assert torch.equal(a, b), name


def test_old_checkpoints_rotary_buffers_are_ignored(tmp_path):
    """Early Llama conversions saved each layer's ``rotary_emb.inv_freq``: the model makes its own."""
    path = make_tiny_model(str(tmp_path), "llama", None)
    cfg = load_model_config(path)
    want = build_model(path, cfg, 256, torch.float32, torch.device("cpu"))
    for file in glob.glob(f"{path}/*.safetensors"):
        tensors = load_file(file)
        tensors |= {f"model.layers.{i}.self_attn.rotary_emb.inv_freq": torch.ones(8) for i in range(cfg.num_layers)}
        save_file(tensors | {"model.rotary_emb.inv_freq": torch.ones(8)}, file)
    got = build_model(path, cfg, 256, torch.float32, torch.device("cpu"))
    for (name, a), (_, b) in zip(want.named_parameters(), got.named_parameters(), strict=True):
        assert torch.equal(a, b), name


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_bf16_load_peaks_at_the_model_size(tmp_path):
    # a float32 checkpoint: each tensor is converted on its way in, never the whole model
    path = make_tiny_model(str(tmp_path), "llama", None, hidden_size=256, intermediate_size=688,
                           num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=4, vocab_size=4096)
    cfg = load_model_config(path)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    model = build_model(path, cfg, 256, torch.bfloat16, torch.device("cuda"))
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    tables = sum(b.numel() * b.element_size() for b in model.buffers())
    largest = max(p.numel() for p in model.parameters())
    # the model, plus at most one checkpoint tensor in float32 and its bf16 twin in flight
    assert torch.cuda.max_memory_allocated() - before <= weights + tables + 6 * largest + (1 << 20)
    assert torch.cuda.memory_allocated() - before <= weights + tables + (1 << 20)


def _same_weights(folder: str, gguf_path: str, want_cfg: ModelConfig, got_cfg: ModelConfig) -> dict:
    """Check the model built from ``gguf_path`` holds the folder's weights exactly; returns their names."""
    want = build_model(folder, want_cfg, 64, torch.float32, torch.device("cpu")).state_dict()
    got = build_model(gguf_path, got_cfg, 64, torch.float32, torch.device("cpu")).state_dict()
    assert want.keys() == got.keys()
    for k in want:
        assert torch.equal(got[k], want[k]), k
    return want


def _packed_then_expanded(path: str, folder: str, monkeypatch, check) -> tuple[list, list]:
    """The GGUF at ``path`` served with its matrices kept packed, then expanded (the C kernel off,
    ``TOKENMILL_CPU_LINEAR_ROWS=0``): ``check(llm, packed)`` each engine (the folder's tokenizer: these
    files hold no vocabulary), and their greedy outputs the same; returns the prompts and the outputs."""
    from transformers import AutoTokenizer

    from engine import LLM, SamplingParams
    from kernels.cpu import matmul

    if not matmul.packed_available():
        pytest.skip("the C kernel does not build here")
    prompts = [[(7 * i + 3 * j) % 5000 + 3 for j in range(n)] for i, n in enumerate([4, 40])]
    outs = []
    for packed in (True, False):
        if not packed:
            monkeypatch.setenv("TOKENMILL_CPU_LINEAR_ROWS", "0")
        llm = LLM(path, device="cpu", dtype="float32", num_kv_blocks=64, max_model_len=128)
        llm.tokenizer = AutoTokenizer.from_pretrained(folder)
        check(llm, packed)
        outs.append([o.token_ids for o in llm.generate(prompts, SamplingParams(max_tokens=12, temperature=0.0,
                                                                               ignore_eos=True))])
    assert outs[0] == outs[1]
    return prompts, outs[0]


def test_a_granite_gguf_loads_as_its_folder(tmp_path):
    """Granite's scales from the metadata (granite.embedding_scale, residual_scale, attention.scale,
    logit_scale); its q/k rows permuted as llama's."""
    folder = make_tiny_model(str(tmp_path / "granite"), "granite", None)
    write_gguf(folder, str(tmp_path / "granite.gguf"), "granite")
    want_cfg, got_cfg = load_model_config(folder), load_model_config(str(tmp_path / "granite.gguf"))
    ids = dict(bos_token_id=None, eos_token_ids=(), rms_norm_eps=0, max_position_embeddings=0, residual_multiplier=0)
    assert dataclasses.replace(got_cfg, **ids) == dataclasses.replace(want_cfg, **ids)
    assert got_cfg.residual_multiplier == pytest.approx(want_cfg.residual_multiplier, rel=1e-7)  # (float32 there)
    _same_weights(folder, str(tmp_path / "granite.gguf"), want_cfg, got_cfg)


def test_a_qwen3_gguf_loads_as_its_folder(tmp_path):
    """Config from the GGUF metadata (head_dim its own), the per-head q/k norms found by their GGUF names."""
    folder = make_tiny_model(str(tmp_path / "qwen3"), "qwen3", None, head_dim=24)
    write_gguf(folder, str(tmp_path / "qwen3.gguf"))
    want_cfg, got_cfg = load_model_config(folder), load_model_config(str(tmp_path / "qwen3.gguf"))
    assert (got_cfg.model_type, got_cfg.head_dim, got_cfg.qk_norm, got_cfg.attention_bias) == ("qwen3", 24, True, False)
    want = _same_weights(folder, str(tmp_path / "qwen3.gguf"), want_cfg, got_cfg)
    assert any("q_norm" in k for k in want)


def test_a_yarn_gguf_reads_as_its_folder(tmp_path):
    """Qwen's long-context GGUF: rope.scaling.type yarn, its factor and original length, the ramp's betas;
    llama.cpp's keys that change the attention factor are refused, not guessed at."""
    rope = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64}
    folder = make_tiny_model(str(tmp_path / "q"), "qwen3", None, head_dim=24, rope_parameters=rope)
    write_gguf(folder, str(tmp_path / "q.gguf"), extra={"yarn_beta_fast": 32.0})
    assert load_model_config(str(tmp_path / "q.gguf")).rope_scaling == load_model_config(folder).rope_scaling
    write_gguf(folder, str(tmp_path / "odd.gguf"), extra={"yarn_log_multiplier": 0.1})
    with pytest.raises(ValueError, match="rope.scaling.yarn_log_multiplier is not supported yet"):
        load_model_config(str(tmp_path / "odd.gguf"))


@pytest.mark.parametrize("arch,gguf_arch,widths", [("qwen3_moe", "qwen3moe", True), ("qwen2_moe", "qwen2moe", True),
                                                  ("qwen2_moe", "qwen2moe", False), ("mixtral", "llama", True)])
def test_a_moe_gguf_loads_as_its_folder(tmp_path, arch, gguf_arch, widths):
    """Experts stacked per layer (ffn_*_exps), the router (ffn_gate_inp), Qwen2-MoE's shared expert and its
    gate (a vector in GGUF), a dense layer found by its missing router; Mixtral is llama with experts. The
    experts' widths from their tensors where the metadata lacks them (as in early Qwen1.5-MoE files)."""
    extra = {"mlp_only_layers": [1]} if arch == "qwen3_moe" else {}
    folder = make_tiny_model(str(tmp_path / arch), arch, None, **extra)
    write_gguf(folder, str(tmp_path / "moe.gguf"), gguf_arch, widths=widths)
    want_cfg, got_cfg = load_model_config(folder), load_model_config(str(tmp_path / "moe.gguf"))
    assert got_cfg.model_type == arch and got_cfg.moe == want_cfg.moe
    want = _same_weights(folder, str(tmp_path / "moe.gguf"), want_cfg, got_cfg)
    assert any("experts.w13" in k for k in want)


def test_moe_checkpoints_that_do_not_fit_are_refused(tmp_path):
    path = make_tiny_model(str(tmp_path / "moe"), "qwen3_moe", None)
    cfg = load_model_config(path)
    file = glob.glob(f"{path}/*.safetensors")[0]
    tensors = load_file(file)
    tensors["model.layers.1.mlp.experts.3.up_proj.weight"] = torch.zeros(40, 64)  # 48 in the config
    save_file(tensors, file)
    with pytest.raises(ValueError, match=r"an expert's up_proj is 48 wide in this model's config, got a tensor of "
                                         r"shape \(40, 64\)"):
        build_model(path, cfg, 64, torch.float32, torch.device("cpu"))
    del tensors["model.layers.1.mlp.experts.3.up_proj.weight"]
    save_file(tensors, file)
    with pytest.raises(ValueError, match=r"missing 1 tensors, e.g. \['model.layers.1.mlp.experts.3.up_proj.weight"):
        build_model(path, cfg, 64, torch.float32, torch.device("cpu"))
    raw = {"model_type": "qwen3_moe", "vocab_size": 100, "hidden_size": 64, "intermediate_size": 128,
           "moe_intermediate_size": 48, "num_hidden_layers": 1, "num_attention_heads": 4, "num_experts": 4}
    with pytest.raises(ValueError, match="needs num_experts and num_experts_per_tok .* got 4 and 5"):
        ModelConfig.from_hf(raw | {"num_experts_per_tok": 5})
    gpt_oss = raw | {"model_type": "gpt_oss", "num_local_experts": 4, "num_experts_per_tok": 2}
    with pytest.raises(ValueError, match="int4 \\(AWQ, GPTQ\\) checkpoints of GPT-OSS are not supported"):
        ModelConfig.from_hf(gpt_oss | {"quantization_config": {"quant_method": "awq", "bits": 4}})


@pytest.mark.parametrize("fmt", ["Q8_0", "Q4_0", "Q4_0+Q8_0"])
def test_a_moe_ggufs_experts_stay_packed_on_the_cpu(tmp_path, fmt, monkeypatch, smollm_tokenizer_dir):
    """Experts stored as Q8_0 / Q4_0 blocks (and the other matrices) are kept so (as llama.cpp keeps them:
    the 3.5x to 7x smaller weights) and multiplied by the C kernel; greedy output as with them expanded.
    "Q4_0+Q8_0": down in more bits than gate and up, as in Q4_K_M files."""
    folder = make_tiny_model(str(tmp_path / "moe"), "qwen2_moe", smollm_tokenizer_dir, moe_intermediate_size=64)
    gguf_path = str(tmp_path / "moe.gguf")
    fmt, down = fmt.split("+") if "+" in fmt else (fmt, fmt)
    write_gguf(folder, gguf_path, "qwen2moe", matrices_as=lambda name: down if "ffn_down" in name else fmt
                if name.startswith("blk.") else None)

    def check(llm, packed):
        experts = llm.engine.runner.model.layers[0].mlp.experts
        assert (experts.packed, experts.packed_down) == ((fmt.lower(), down.lower()) if packed else (None,) * 2)
        assert experts.w13.dtype == (torch.uint8 if packed else torch.float32)

    _packed_then_expanded(gguf_path, folder, monkeypatch, check)


@pytest.mark.parametrize("arch,gguf_arch", [("gemma", "gemma"), ("gemma2", "gemma2"), ("gemma3_text", "gemma3")])
def test_a_gemma_gguf_loads_as_its_folder(tmp_path, arch, gguf_arch):
    """Gemma's norms stored as 1 + w (back to the same float32 weights), Gemma 2 and 3's four norms a layer
    (ffn_norm the MLP's input norm), the sliding window and its layers, Gemma 2's caps, Gemma 3's RoPE
    scaled on its global layers only, query_pre_attn_scalar as head_dim (not a 27B)."""
    rope = {"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}
    extra = {"rope_parameters": rope, "sliding_window_pattern": 6, "num_hidden_layers": 7} if arch == "gemma3_text" else {}
    if arch != "gemma":
        extra["query_pre_attn_scalar"] = 16  # head_dim, as in every Gemma 2 and 3 but the 27Bs
    folder = make_tiny_model(str(tmp_path / arch), arch, None, **extra)
    write_gguf(folder, str(tmp_path / "gemma.gguf"), gguf_arch)
    want_cfg, got_cfg = load_model_config(folder), load_model_config(str(tmp_path / "gemma.gguf"))
    ids = dict(bos_token_id=None, eos_token_ids=(), rms_norm_eps=0)  # (no vocabulary here; eps in float32)
    assert dataclasses.replace(got_cfg, **ids) == dataclasses.replace(want_cfg, **ids, max_position_embeddings=1024)
    assert got_cfg.gemma == int(arch[5:6] or 1) and (arch == "gemma") == (got_cfg.sliding_window is None)
    want = build_model(folder, want_cfg, 64, torch.float32, torch.device("cpu"))
    got = build_model(str(tmp_path / "gemma.gguf"), got_cfg, 64, torch.float32, torch.device("cpu"))
    want, got = want.state_dict(), got.state_dict()
    assert want.keys() == got.keys()
    for k in want:
        assert torch.equal(got[k], want[k]), k


@pytest.mark.parametrize("raw", [
    {"model_type": "gemma2", "num_hidden_layers": 6},  # caps, scale, window: Gemma2Config's defaults
    {"model_type": "gemma2", "num_hidden_layers": 6, "attn_logit_softcapping": None, "hidden_act": "gelu"},
    {"model_type": "gemma3_text", "num_hidden_layers": 7, "sliding_window": 512, "rope_scaling": {
        "rope_type": "linear", "factor": 8.0}},
    {"model_type": "gemma", "num_hidden_layers": 2, "hidden_act": "gelu"},  # Gemma 1's "gelu": tanh's
    {"model_type": "qwen2", "num_hidden_layers": 6, "use_sliding_window": True, "sliding_window": 64,
     "max_window_layers": 4},  # the window in layers 4 and 5 only
])
def test_configs_read_as_transformers_reads_them(raw):
    """Sliding layers, windows, caps, the attention scale and the activation, against transformers' config
    classes given the same (sparse) config.json."""
    from transformers import AutoConfig

    raw = {"vocab_size": 128, "hidden_size": 64, "intermediate_size": 96, "num_attention_heads": 4,
           "num_key_value_heads": 2, "head_dim": 16, "max_position_embeddings": 1024} | raw
    hf, cfg = AutoConfig.for_model(**raw), ModelConfig.from_hf(raw)
    windows = [hf.sliding_window if t == "sliding_attention" and hf.sliding_window < 1024 else 0  # (one as long
               for t in getattr(hf, "layer_types", None) or ["full_attention"] * cfg.num_layers]  # as the
    # positions never slides: none)
    assert [cfg.window(i) for i in range(cfg.num_layers)] == windows
    assert (cfg.attn_softcap, cfg.final_softcap) == (getattr(hf, "attn_logit_softcapping", None) or 0.0,
                                                     getattr(hf, "final_logit_softcapping", None) or 0.0)
    scalar = getattr(hf, "query_pre_attn_scalar", None)
    assert cfg.attn_scale == (None if scalar is None or raw["model_type"] == "gemma" else scalar ** -0.5)
    act = getattr(hf, "hidden_activation", None) or hf.hidden_act
    assert (cfg.hidden_act, act) in (("gelu_tanh", "gelu_pytorch_tanh"), ("silu", "silu"))
    if raw["model_type"] == "gemma3_text":
        rope = hf.rope_parameters
        assert (cfg.rope_theta, cfg.rope_scaling["factor"], cfg.local_rope_theta) == (
            rope["full_attention"]["rope_theta"], rope["full_attention"]["factor"],
            rope["sliding_attention"]["rope_theta"])


def test_hf_overrides_replace_config_values_before_the_model_is_read(tmp_path):
    """vLLM's --hf-overrides: top-level values, a nested map key by key (Gemma 3's text_config), a GGUF's."""
    from engine import LLM
    from tests.conftest import make_tiny_gemma3_multimodal

    folder = make_tiny_model(str(tmp_path / "mistral"), "mistral", None, sliding_window=16)
    assert load_model_config(folder).sliding_window == 16
    assert load_model_config(folder, {"sliding_window": None}).sliding_window is None
    llm = LLM(folder, hf_overrides={"sliding_window": 8, "max_position_embeddings": 256}, num_kv_blocks=64)
    assert llm.engine.runner.model_cfg.window(0) == 8 and llm.engine.max_model_len == 256
    mm = make_tiny_gemma3_multimodal(str(tmp_path / "g3"), None)
    cfg = load_model_config(mm, {"text_config": {"sliding_window": 8}})
    assert (cfg.window(0), cfg.num_heads, cfg.head_dim) == (8, 8, 256)  # the text_config's other values kept
    write_gguf(folder, str(tmp_path / "m.gguf"), "llama")
    assert load_model_config(str(tmp_path / "m.gguf"), {"rms_norm_eps": 1e-3}).rms_norm_eps == 1e-3


def test_embeddinggemma_is_refused_not_served_causally():
    with pytest.raises(ValueError, match=r"bidirectional attention \(EmbeddingGemma\) is not supported"):
        ModelConfig.from_hf({"model_type": "gemma3_text", "num_hidden_layers": 2, "hidden_size": 64,
                             "intermediate_size": 96, "use_bidirectional_attention": True})


def test_a_gemma2_gguf_without_caps_or_window_keys_gets_llama_cpps(tmp_path):
    """Converters of mid-2024 wrote neither: llama.cpp then assumes caps of 50 and 30 and a window of 4096.
    And a chat's end: EOT, or Gemma's <end_of_turn> found by its text where no id is given."""
    import gguf

    folder = make_tiny_model(str(tmp_path / "g2"), "gemma2", None, attn_logit_softcapping=None,
                             final_logit_softcapping=None, sliding_window=None)
    write_gguf(folder, str(tmp_path / "g2.gguf"), "gemma2")
    cfg = load_model_config(str(tmp_path / "g2.gguf"))
    assert (cfg.attn_softcap, cfg.final_softcap, cfg.sliding_window, cfg.window(0), cfg.window(1)) == \
        (50.0, 30.0, None, 0, 0)  # (4096 is past this file's 1024 positions: no window left)
    for eot, tokens in ((107, None), (None, ["<pad>", "<eos>", "<end_of_turn>"])):
        w = gguf.GGUFWriter(str(tmp_path / "eot.gguf"), "gemma2")
        for key, value in (("block_count", 1), ("embedding_length", 64), ("feed_forward_length", 96),
                           ("attention.head_count", 4), ("context_length", 8192), ("vocab_size", 128)):
            w.add_uint32(f"gemma2.{key}", value)
        w.add_uint32("tokenizer.ggml.eos_token_id", 1)
        if eot:
            w.add_uint32("tokenizer.ggml.eot_token_id", eot)
        if tokens:
            w.add_token_list(tokens)
        for f in (w.write_header_to_file, w.write_kv_data_to_file, w.write_tensors_to_file, w.close):
            f()
        from engine.loader import _gguf_reader
        _gguf_reader.cache_clear()
        cfg = load_model_config(str(tmp_path / "eot.gguf"))
        assert cfg.eos_token_ids == (1, eot or 2) and cfg.sliding_window == 4096 and cfg.window(0) == 4096


def test_a_gemma3_gguf_chats_with_its_own_tokenizer_and_ends_its_turn(tmp_path):
    """A Gemma 3 GGUF as llama.cpp writes its vocabulary (SentencePiece, <0xNN> byte tokens, no EOT id):
    transformers reads its tokenizer and template, and <end_of_turn>, found by its text, ends a turn."""
    from engine import LLM, SamplingParams

    tokens = ["<pad>", "<eos>", "<bos>", "<unk>"] + [f"<0x{i:02X}>" for i in range(256)] + [
        "<start_of_turn>", "<end_of_turn>", "▁hello", "▁world", "user", "model", "\n", "▁"]
    tokens += [f"t{i}" for i in range(300 - len(tokens))]
    template = ("{{ bos_token }}{% for m in messages %}<start_of_turn>{{ 'model' if m['role'] == 'assistant' else "
                "'user' }}\n{{ m['content'] }}<end_of_turn>\n{% endfor %}<start_of_turn>model\n")
    vocab = {"tokens": tokens, "types": [3, 3, 3, 2] + [6] * 256 + [3, 3] + [1] * (len(tokens) - 262), "bos": 2,
             "eos": 1, "chat_template": template}
    folder = make_tiny_model(str(tmp_path / "g3"), "gemma3_text", None, vocab_size=300)
    write_gguf(folder, str(tmp_path / "g3.gguf"), "gemma3", vocab=vocab)
    llm = LLM(str(tmp_path / "g3.gguf"), num_kv_blocks=64, dtype="float32")
    end_of_turn = tokens.index("<end_of_turn>")
    assert llm.engine.eos_token_ids == [1, end_of_turn]
    assert llm.tokenizer.decode(llm.tokenizer.encode("hello world", add_special_tokens=False)) == "hello world"
    out = llm.chat([{"role": "user", "content": "hello"}], SamplingParams(max_tokens=8, temperature=0.0,
                                                                          logit_bias={end_of_turn: 100.0}))[0]
    assert out.token_ids == [end_of_turn] and out.finish_reason == "stop" and out.text == ""
    assert out.prompt_token_ids[:2] == [2, tokens.index("<start_of_turn>")]


def test_a_phi3_gguf_loads_as_its_folder(tmp_path):
    """Phi-4-mini as llama.cpp writes it: q|k|v fused (attn_qkv), gate|up fused (ffn_up, twice as wide), the
    LongRoPE factors as tensors, the original length and attention factor in the metadata, RoPE over 12 of
    each head's 16 dims (rope.dimension_count)."""
    rope = {"rope_type": "longrope", "rope_theta": 10000.0, "original_max_position_embeddings": 64,
            "partial_rotary_factor": 0.75, "short_factor": [1.0 + i / 10 for i in range(6)],
            "long_factor": [2.0 + i / 2 for i in range(6)]}
    folder = make_tiny_model(str(tmp_path / "phi3"), "phi3", None, rope_parameters=rope,
                             original_max_position_embeddings=64, partial_rotary_factor=0.75)
    write_gguf(folder, str(tmp_path / "phi3.gguf"), "phi3")
    want_cfg, got_cfg = load_model_config(folder), load_model_config(str(tmp_path / "phi3.gguf"))
    assert got_cfg.model_type == "phi3" and got_cfg.rope_scaling.keys() == want_cfg.rope_scaling.keys()
    assert got_cfg.rotary_dim == want_cfg.rotary_dim == 12
    for key, value in want_cfg.rope_scaling.items():  # (float32 in the file)
        assert got_cfg.rope_scaling[key] == (pytest.approx(value, rel=1e-6) if key != "rope_type" else value)
    for served in (64, 256):  # the short factors, then the long ones
        want = build_model(folder, want_cfg, served, torch.float32, torch.device("cpu"))
        got = build_model(str(tmp_path / "phi3.gguf"), got_cfg, served, torch.float32, torch.device("cpu"))
        assert torch.allclose(got.rotary.cos, want.rotary.cos) and torch.allclose(got.rotary.sin, want.rotary.sin)
        want, got = want.state_dict(), got.state_dict()
        assert want.keys() == got.keys()
        for k in want:
            assert torch.equal(got[k], want[k]), k


@pytest.mark.parametrize("arch,gguf_arch", [("phi3", "phi3"), ("gemma3_text", "gemma3")])
def test_a_ggufs_matrices_stay_packed_on_the_cpu(tmp_path, monkeypatch, smollm_tokenizer_dir, arch, gguf_arch):
    """Phi-3's fused ones (attn_qkv, ffn_up) and Gemma 3's: multiplied packed, greedy as expanded."""
    folder = make_tiny_model(str(tmp_path / arch), arch, smollm_tokenizer_dir)
    write_gguf(folder, str(tmp_path / "phi3.gguf"), gguf_arch, matrices_as="Q8_0")

    def check(llm, packed):
        layer = llm.engine.runner.model.layers[1]
        assert {layer.self_attn.qkv_proj.packed, layer.mlp.gate_up_proj.packed} == {"q8_0" if packed else None}

    _packed_then_expanded(str(tmp_path / "phi3.gguf"), folder, monkeypatch, check)


def test_a_k_quant_gguf_stays_packed_on_the_cpu(tmp_path, monkeypatch, smollm_tokenizer_dir, caplog):
    """A Q4_K_M-style file (llama.cpp's mix: q, k, gate, up in Q4_K; v and down in Q6_K in some layers;
    the embeddings in Q6_K; one layer's output in Q5_K, one's gate in Q5_0, which llama.cpp writes where rows
    are not whole super-blocks; and a matrix each in Q2_K, Q3_K, IQ4_NL, IQ4_XS): every matrix kept packed,
    fused q|k|v of two or three formats multiplied a run at a time, greedy output as with everything expanded
    (and as transformers reads the same file)."""
    from transformers import AutoModelForCausalLM

    folder = make_tiny_model(str(tmp_path / "llama"), "llama", smollm_tokenizer_dir, hidden_size=256,
                             intermediate_size=512, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2,
                             tie_word_embeddings=False)
    types = {"token_embd": "Q6_K", "output": "Q6_K", "blk.0.attn_v": "Q6_K", "blk.0.ffn_down": "Q6_K",
             "blk.1.attn_output": "Q5_K", "blk.1.ffn_gate": "Q5_0",  # and the other formats the kernel reads:
             "blk.0.attn_output": "Q2_K", "blk.0.ffn_up": "Q3_K", "blk.1.attn_k": "IQ4_NL", "blk.1.ffn_down": "IQ4_XS"}
    path = str(tmp_path / "q4_k_m.gguf")
    write_gguf(folder, path, "llama", matrices_as=lambda name: types.get(name.removesuffix(".weight"), "Q4_K"))

    def check(llm, packed):
        model = llm.engine.runner.model
        first, second = model.layers
        if packed:
            assert ("GGUF: 16 matrices kept packed (6 Q4_K, 4 Q6_K, 1 IQ4_NL, 1 IQ4_XS, 1 Q2_K, 1 Q3_K, 1 Q5_0, "
                    "1 Q5_K)") in caplog.text
            assert [seg[:3] for seg in first.self_attn.qkv_proj.segments] == [("q4_k", 0, 384), ("q6_k", 384, 128)]
            assert first.mlp.down_proj.packed == "q6_k" and model.embed_tokens.packed == "q6_k"
            assert [seg[0] for seg in first.mlp.gate_up_proj.segments] == ["q4_k", "q3_k"]
            assert [seg[0] for seg in second.mlp.gate_up_proj.segments] == ["q5_0", "q4_k"]
            assert [seg[0] for seg in second.self_attn.qkv_proj.segments] == ["q4_k", "iq4_nl", "q4_k"]
            assert (first.self_attn.o_proj.packed, second.self_attn.o_proj.packed, second.mlp.down_proj.packed) == (
                "q2_k", "q5_k", "iq4_xs")
        else:
            assert first.self_attn.qkv_proj.weight.dtype == torch.float32

    with caplog.at_level("INFO", logger="tokenmill"):
        prompts, outs = _packed_then_expanded(path, folder, monkeypatch, check)
    hf = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file="q4_k_m.gguf", torch_dtype=torch.float32)
    for prompt, want in zip(prompts, outs, strict=True):
        got = hf.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False)[0, len(prompt):].tolist()
        assert got == want


def test_write_gguf_writes_llama_cpps_mix(tmp_path, smollm_tokenizer_dir):
    """``tools/write_gguf.py --type Q4_K_M``: v and down in Q6_K in llama.cpp's layers, the rest in Q4_K,
    the output in Q6_K (and the embeddings where tied); rows not whole super-blocks in llama.cpp's
    fallbacks (Q5_0, Q8_0)."""
    import subprocess
    import sys

    from gguf import GGUFReader

    wide = make_tiny_model(str(tmp_path / "wide"), "llama", smollm_tokenizer_dir, hidden_size=256,
                           intermediate_size=512, num_hidden_layers=2, tie_word_embeddings=True)
    narrow = make_tiny_model(str(tmp_path / "narrow"), "llama", smollm_tokenizer_dir, num_hidden_layers=2,
                             tie_word_embeddings=False)
    tool = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tools", "write_gguf.py")
    for folder in (wide, narrow):
        r = subprocess.run([sys.executable, tool, folder, f"{folder}.gguf", "--type", "Q4_K_M"], capture_output=True,
                           text=True, timeout=120)
        assert r.returncode == 0, r.stderr
    types = [{t.name: t.tensor_type.name for t in GGUFReader(f"{f}.gguf").tensors} for f in (wide, narrow)]
    # two layers: both in the first and last eighths, so v and down in more bits in both
    assert [types[0][n] for n in ("token_embd.weight", "blk.0.attn_q.weight", "blk.1.attn_v.weight",
                                  "blk.1.ffn_down.weight", "blk.0.ffn_up.weight")] == ["Q6_K", "Q4_K", "Q6_K", "Q6_K",
                                                                                       "Q4_K"]
    # untied: the output in Q6_K, the embeddings as the layers (here their fallbacks, Q8_0 and Q5_0)
    assert [types[1][n] for n in ("output.weight", "token_embd.weight", "blk.0.attn_q.weight",
                                  "blk.1.attn_v.weight")] == ["Q8_0", "Q5_0", "Q5_0", "Q8_0"]
    r = subprocess.run([sys.executable, tool, wide, str(tmp_path / "x.gguf"), "--type", "Q9_K"], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 2 and "unknown type 'Q9_K'" in r.stderr


@pytest.mark.parametrize("arch", ["olmo2", "olmo3"])
def test_an_olmo_gguf_loads_as_its_folder(tmp_path, arch):
    """OLMo 2 and 3 as llama.cpp writes them (architecture olmo2; OLMo 3 told by its sliding window, three
    of each four layers sliding): norms after each sublayer (post_attention_norm, post_ffw_norm), q and k
    normed across heads, RoPE rotate-half (no permuted rows)."""
    extra = dict(num_hidden_layers=4, sliding_window=16) if arch == "olmo3" else {}
    folder = make_tiny_model(str(tmp_path / arch), arch, None, **extra)
    write_gguf(folder, str(tmp_path / "o.gguf"), "olmo2")
    want_cfg, got_cfg = load_model_config(folder), load_model_config(str(tmp_path / "o.gguf"))
    ids = dict(bos_token_id=None, eos_token_ids=(), rms_norm_eps=0, max_position_embeddings=0)
    assert dataclasses.replace(got_cfg, **ids) == dataclasses.replace(want_cfg, **ids)
    assert got_cfg.model_type == arch and got_cfg.olmo and [got_cfg.window(i) for i in range(got_cfg.num_layers)] == (
        [16, 16, 16, 0] if arch == "olmo3" else [0, 0])
    want = _same_weights(folder, str(tmp_path / "o.gguf"), want_cfg, got_cfg)
    assert any("q_norm" in k for k in want)


def test_a_gguf_transformers_does_not_load_still_gives_its_tokenizer(tmp_path):
    """transformers reads a GGUF's tokenizer only for architectures it loads as models (not Granite's, not
    OLMo 2's): tokenmill reads it from the file's tokenizer keys anyway, and serves the file."""
    from engine import LLM, SamplingParams

    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{i:02X}>" for i in range(256)] + ["▁hello", "▁world"]
    tokens += [f"t{i}" for i in range(300 - len(tokens))]
    vocab = {"tokens": tokens, "types": [2, 3, 3] + [6] * 256 + [1] * (len(tokens) - 259), "bos": 1, "eos": 2,
             "chat_template": "{% for m in messages %}{{ m['content'] }}{% endfor %}"}
    folder = make_tiny_model(str(tmp_path / "granite"), "granite", None, vocab_size=300)
    write_gguf(folder, str(tmp_path / "granite.gguf"), "granite", vocab=vocab)
    llm = LLM(str(tmp_path / "granite.gguf"), num_kv_blocks=64, dtype="float32")
    ids = llm.tokenizer.encode("hello")
    assert ids[0] == 1 and llm.tokenizer.chat_template == vocab["chat_template"]
    out = llm.generate(["hello"], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))[0]
    assert len(out.token_ids) == 4 and out.prompt_token_ids == ids
    from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES
    assert "granite" not in GGUF_SUPPORTED_ARCHITECTURES  # (left as it was)


def test_gpt_oss_mxfp4_checkpoint_errors_name_the_tensor(tmp_path, smollm_tokenizer_dir):
    """A GPT-OSS folder in MXFP4 (``tools/quantize_model.py --method mxfp4``) loads, packed on the CPU; scales of
    the wrong shape, a weight held both in bf16 and in MXFP4, or blocks without their scales are refused with the
    checkpoint's own names. A config that says MXFP4 for another architecture is refused at start."""
    from tools.quantize_model import mxfp4_checkpoint

    dense = make_tiny_model(str(tmp_path / "dense"), "gpt_oss", smollm_tokenizer_dir, seed=4, intermediate_size=64,
                            num_hidden_layers=2)
    good = mxfp4_checkpoint(dense, str(tmp_path / "mx"))
    cfg = load_model_config(good)
    model = build_model(good, cfg, 256, torch.float32, torch.device("cpu"))
    assert all(layer.mlp.experts.packed == "mxfp4" for layer in model.layers)
    file = os.path.join(good, "model.safetensors")
    tensors = load_file(file)
    name = "model.layers.1.mlp.experts.down_proj"
    for change, message in [
        ({name + "_scales": tensors[name + "_scales"][:, :, :1].contiguous()}, f"{name}_blocks and _scales must be uint8"),
        ({name: torch.zeros(8, 64, 64)}, f"{name} is held twice"),
        ({name + "_scales": None}, "'model.layers.1.mlp.experts.down_proj_scales'"),
    ]:
        broken = {k: v for k, v in ({**tensors, **change}).items() if v is not None}
        save_file(broken, file)
        with pytest.raises(ValueError) as e:
            build_model(good, cfg, 256, torch.float32, torch.device("cpu"))
        assert message in str(e.value)
    mixed = {k: v for k, v in tensors.items() if k not in (name + "_blocks", name + "_scales")}  # down in floats:
    mixed[name] = torch.randn(8, 64, 64)  # (that layer's experts widened, both parts)
    save_file(mixed, file)
    model = build_model(good, cfg, 256, torch.float32, torch.device("cpu"))
    assert [layer.mlp.experts.packed for layer in model.layers] == ["mxfp4", None]
    with pytest.raises(ValueError, match="MXFP4 checkpoints are read for GPT-OSS's experts only"):
        ModelConfig.from_hf({"model_type": "llama", "vocab_size": 8, "hidden_size": 8, "intermediate_size": 8,
                             "num_hidden_layers": 1, "num_attention_heads": 1,
                             "quantization_config": {"quant_method": "mxfp4"}})


def test_a_gpt_oss_gguf_ends_a_turn_at_return_call_and_endoftext_not_end(tmp_path):
    """As llama.cpp reads a gpt-oss file: <|end|> ends a harmony message, not the turn, even where the file
    names it its end of sequence."""
    import gguf
    import numpy as np

    from engine.loader import _gguf_config, _gguf_reader

    path = str(tmp_path / "tok.gguf")
    w = gguf.GGUFWriter(path, "gpt-oss")
    for key in ("block_count", "embedding_length", "feed_forward_length", "attention.head_count", "context_length"):
        w.add_uint32(f"gpt-oss.{key}", 4)
    w.add_tokenizer_model("gpt2")
    w.add_token_list(["<|endoftext|>", "<|return|>", "<|end|>", "<|call|>", "a"])
    w.add_eos_token_id(2)
    w.add_tensor("token_embd.weight", np.zeros((5, 4), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    _gguf_reader.cache_clear()
    cfg, ends = _gguf_config(path)
    assert cfg["model_type"] == "gpt_oss" and ends == [0, 1, 3]
    assert cfg["layer_types"] == ["sliding_attention", "full_attention"] * 2


def _load(path: str) -> None:
    build_model(path, load_model_config(path), 64, torch.float32, torch.device("cpu"))


@pytest.mark.parametrize("change, words", [
    ({"vocab_size": 100}, "an embedding of 49152 rows, but the config's vocab_size is 100"),  # (it was cut, silently)
    ({"hidden_size": 128}, "cannot be loaded: does the config describe this checkpoint?"),
    ({"intermediate_size": 100}, "model.layers.0.mlp.down_proj.weight (64, 128) cannot be loaded"),
    ({"num_hidden_layers": 1}, "model.layers.1.input_layernorm.weight: a layer past the config's num_hidden_layers (1)"),
    ({"max_position_embeddings": "1024"}, "config.json's max_position_embeddings is '1024': a whole number"),
    ({"rms_norm_eps": "x"}, "config.json's rms_norm_eps is 'x': a number"),
])
def test_a_config_that_does_not_fit_its_weights_is_one_clear_error(tmp_path, change, words):
    """(Review: tracebacks of a size mismatch that named no tensor, an IndexError, a TypeError far from config.json,
    and an embedding of more rows than vocab_size cut to them, silently.)"""
    import json

    path = make_tiny_model(str(tmp_path), "llama", None)
    with open(f"{path}/config.json") as f:
        cfg = json.load(f)
    assert (cfg["vocab_size"], cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]) == (49152, 64, 128, 2)
    with open(f"{path}/config.json", "w") as f:
        json.dump(cfg | change, f)
    with pytest.raises(ValueError) as e:
        _load(path)
    assert words in str(e.value)


def test_a_truncated_or_lying_checkpoint_names_its_file(tmp_path):
    """(Review: safetensors' and gguf's own errors, several as tracebacks, none naming the file.)"""
    import json
    import struct

    path = make_tiny_model(str(tmp_path / "m"), "llama", None)
    write_gguf(path, str(tmp_path / "m.gguf"), "llama")
    (file,) = glob.glob(f"{path}/*.safetensors")
    whole = open(file, "rb").read()
    for cut in (len(whole) // 2, 1000, 20):
        with open(tmp_path / "m.gguf", "rb") as f:
            gguf = f.read()
        with open(tmp_path / "cut.gguf", "wb") as f:
            f.write(gguf[:cut])
        with pytest.raises(ValueError, match=f"{tmp_path}/cut.gguf: not a readable GGUF file, truncated or corrupt"):
            load_model_config(str(tmp_path / "cut.gguf"))
        from engine.loader import _gguf_reader
        _gguf_reader.cache_clear()
    with open(file, "wb") as f:
        f.write(whole[:len(whole) // 2])
    with pytest.raises(ValueError, match=f"{file}: not a readable safetensors file, truncated or corrupt"):
        _load(path)
    n = struct.unpack("<Q", whole[:8])[0]
    header = json.loads(whole[8:8 + n])
    name = next(k for k in header if k != "__metadata__")
    header[name]["dtype"] = "I64"  # (a dtype that does not fit its offsets)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    with open(file, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text + whole[8 + n:])
    with pytest.raises(ValueError, match=f"{file}: not a readable safetensors file"):
        _load(path)
