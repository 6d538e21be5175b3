"""AWQ and GPTQ int4 checkpoints (``engine/quant.py``): packed as AutoAWQ and AutoGPTQ pack them
(``tools/quantize_model.py``, whose packers follow theirs independently of the loader), kept as Q4_Z
blocks or expanded, and served with greedy output equal to transformers' on the same weights."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

import kernels
import kernels.reference as ref
from engine import LLM, SamplingParams, quant
from engine.models.config import ModelConfig, QuantConfig
from engine.models.layers import RowLinear
from engine.parallel import TPGroup
from kernels.cpu import matmul
from tests.conftest import make_tiny_model
from tests.test_parity import PROMPTS, check_parity
from tools.quantize_model import pack_awq, pack_gptq, quantize, quantize_checkpoint


def random_q4_z(n: int, k: int, seed: int = 0) -> torch.Tensor:
    """Q4_Z rows with sensible scales and zero points (0 to 16, GPTQ's original format reaching 16)."""
    gen = torch.Generator().manual_seed(seed)
    d = (torch.rand(n, k // 32, generator=gen) * 0.1 + 0.01).half()
    z = torch.randint(0, 17, (n, k // 32), generator=gen).half()
    nibbles = torch.randint(0, 256, (n, k // 32, 16), generator=gen, dtype=torch.uint8)
    return torch.cat([torch.stack([d, z], -1).view(torch.uint8), nibbles], -1).reshape(n, -1)


# ----------------------------------------------------------------------------- the Q4_Z format


def test_q4_z_reference_is_scale_times_integer_minus_zero():
    w = random_q4_z(3, 64)
    blocks = w.view(3, 2, 20)
    d, z = blocks[..., :2].contiguous().view(torch.float16).float(), blocks[..., 2:4].contiguous().view(torch.float16)
    floats = ref.dequantize(w, "q4_z")
    for r in range(3):
        for b in range(2):
            for j in range(32):
                byte = int(blocks[r, b, 4 + j % 16])
                q = byte & 15 if j < 16 else byte >> 4
                assert floats[r, b * 32 + j] == d[r, b, 0] * (q - float(z[r, b, 0]))


@pytest.mark.parametrize("n,k", [(1, 32), (6, 96), (13, 576), (50, 1536)], ids=str)
def test_q4_z_c_kernels_are_the_dense_kernel_on_exact_weights(n, k, monkeypatch):
    if not matmul.packed_available():
        pytest.skip("no C compiler here")
    monkeypatch.setattr(matmul, "EXPAND_BYTES", 0)
    w = random_q4_z(n, k, seed=n + k)
    dense = ref.dequantize(w, "q4_z")
    assert torch.equal(matmul.dequantize(w, "q4_z"), dense)
    gen = torch.Generator().manual_seed(k)
    for m in (1, 2, 5, 64, 100):
        x = torch.randn(m, k, generator=gen)
        y = matmul.linear_packed(x, w, "q4_z")
        assert torch.equal(y, matmul.linear_c(x, dense)), m
        torch.testing.assert_close(y, F.linear(x, dense), rtol=1e-4, atol=1e-4)
    xb = torch.randn(3, k, generator=gen).bfloat16()
    torch.testing.assert_close(matmul.linear_packed(xb, w, "q4_z").float(), F.linear(xb.float(), dense),
                               rtol=1e-2, atol=2e-2)


def test_packed_linear_for_fp16_and_the_reference_backend(monkeypatch):
    w = random_q4_z(7, 64)
    x = torch.randn(4, 64).half().float()
    expected = F.linear(x, ref.dequantize(w, "q4_z"))
    assert torch.equal(matmul.linear_packed(x.half(), w, "q4_z"), expected.half())  # no C kernel for fp16
    monkeypatch.setattr(kernels, "_backend", "reference")
    assert torch.equal(kernels.linear(x, w, packed="q4_z"), expected)


# ----------------------------------------------------------------------------- checkpoints


def layer_parts(method: str, n: int = 16, k: int = 64, group: int = 32, sym: bool = False, v1: bool = True,
                act_order: bool = False):
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(n * k))
    g_idx = torch.arange(k) // (group if group > 0 else k)
    if act_order:
        g_idx = g_idx[torch.randperm(k, generator=torch.Generator().manual_seed(3))]
    ints, zeros, scales, exact = quantize(w, sym, g_idx)
    if method == "awq":
        parts = {"qweight": pack_awq(ints), "qzeros": pack_awq(zeros), "scales": scales}
    else:
        qweight, qzeros = pack_gptq(ints, zeros, v1)
        parts = {"qweight": qweight, "qzeros": qzeros, "scales": scales, "g_idx": g_idx.to(torch.int32)}
    q = QuantConfig(method, max(group, 0), int(method == "gptq" and v1), act_order)
    return q, parts, exact


@pytest.mark.parametrize("method,group,sym,v1", [
    ("awq", 32, False, True), ("awq", -1, False, True), ("gptq", 32, True, True), ("gptq", 64, False, True),
    ("gptq", 32, False, False)], ids=["awq-g32", "awq-per-row", "gptq-sym", "gptq-asym-g64", "gptq-v2"])
def test_a_layer_converts_to_its_exact_weights(method, group, sym, v1):
    q, parts, exact = layer_parts(method, group=group, sym=sym, v1=v1)
    assert quant.packs(q, 64)
    assert torch.equal(quant.convert("l", q, parts, pack=False), exact)
    packed = quant.convert("l", q, parts, pack=True)
    assert packed.dtype == torch.uint8 and packed.shape == (16, 64 // 32 * 20)
    assert torch.equal(ref.dequantize(packed, "q4_z"), exact)


def test_gptq_v1_zero_of_zero_wraps_to_sixteen_as_its_kernels_read_it():
    """AutoGPTQ stores z - 1 in 4 bits, so a zero point of 0 is stored as 15 and read back as 16
    (by its kernels, vLLM's and exllama's alike): the checkpoint means what they compute."""
    q, parts, _ = layer_parts("gptq", group=32, v1=True)
    parts["qzeros"] = torch.full_like(parts["qzeros"], -1)  # every stored nibble 15
    ints, zeros, _, _ = quant.unpack("l", q, parts)
    assert torch.equal(zeros, torch.full_like(zeros, 16.0))
    assert torch.equal(ref.dequantize(quant.convert("l", q, parts, pack=True), "q4_z"),
                       quant.convert("l", q, parts, pack=False))


def test_act_order_expands_and_refuses_to_pack():
    q, parts, exact = layer_parts("gptq", group=32, act_order=True)
    assert not quant.packs(q, 64)
    assert torch.equal(quant.convert("l", q, parts, pack=False), exact)
    in_order = QuantConfig("gptq", 32, 1, False)  # desc_act not set, yet the g_idx is shuffled
    assert quant.packs(in_order, 64) and not quant.packs(in_order, 64, g_idx=parts["g_idx"])
    with pytest.raises(ValueError, match="cannot be kept as Q4_Z blocks"):
        quant.convert("l", in_order, parts, pack=True)


def test_act_order_with_columns_already_in_group_order_needs_no_gather():
    """desc_act set, yet g_idx in column order (per-row groups, static groups): no permutation, so no
    g_perm and no index_select, and a row-parallel rank may keep its share packed."""
    _, parts, exact = layer_parts("gptq", group=32)
    q = QuantConfig("gptq", 32, 1, True)
    assert quant.packs(q, 64, parts["scales"], parts["g_idx"], permutable=False)
    names = {f"l.{p}" for p in parts}
    out = dict(quant.weights(((f"l.{p}", t) for p, t in parts.items()), q, names, packed={"l"}))
    assert list(out) == ["l.weight"] and torch.equal(ref.dequantize(out["l.weight"], "q4_z"), exact)


@pytest.mark.parametrize("edit,error", [
    (lambda p: p.pop("qzeros"), "qzeros missing"),
    (lambda p: p.update(scales=p["scales"][:1]), r"scales and qzeros must be \(2, 16\)"),
    (lambda p: p.update(g_idx=p["g_idx"] + 5), "g_idx must give each of 64 columns a group"),
], ids=["missing", "scales-shape", "g_idx-range"])
def test_a_malformed_layer_is_named(edit, error):
    q, parts, _ = layer_parts("gptq")
    edit(parts)
    with pytest.raises(ValueError, match="^model.layers.0.mlp.up_proj: .*" + error):
        quant.convert("model.layers.0.mlp.up_proj", q, parts, pack=True)


def test_an_act_order_layer_without_its_g_idx_is_named():
    """Its groups follow g_idx: read in column order instead, its weights would silently be others."""
    q, parts, _ = layer_parts("gptq", act_order=True)
    del parts["g_idx"]
    for pack in (True, False):
        with pytest.raises(ValueError, match="^l: g_idx missing, which an act-order"):
            quant.convert("l", q, parts, pack=pack)


@pytest.mark.parametrize("config,error", [
    ({"quant_method": "bitsandbytes"}, "unsupported quantization 'bitsandbytes'"),
    ({"quant_method": "gptq", "bits": 8}, "GPTQ with bits 8 is not supported"),
    ({"quant_method": "gptq", "bits": "4"}, "GPTQ with bits '4' is not supported"),
    ({"quant_method": "awq", "bits": 4, "version": "gemv"}, "AWQ version 'gemv'"),
    ({"quant_method": "awq", "w_bit": 4, "zero_point": False}, "zero_point=False"),
    ({"quant_method": "gptq", "bits": 4, "checkpoint_format": "marlin"}, "checkpoint_format 'marlin'"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 0}, "group_size must be a positive integer or -1, got 0"),
    ({"quant_method": "awq", "bits": 4, "group_size": "128"}, "group_size must be a positive integer or -1, got '128'"),
    ({"quant_method": "gptq", "bits": 4, "desc_act": "false"}, "desc_act must be true or false, got 'false'"),
    ("gptq", "quantization_config must be an object, got 'gptq'"),
    ({"quant_method": "gptq", "bits": 4, "pack_dtype": "int16"}, "pack_dtype 'int16'"),
    ({"quant_method": "gptq", "bits": 4, "dynamic": {"-:.*down_proj": {}}}, "per-module dynamic settings"),
    ({"quant_method": "compressed-tensors"}, "unsupported quantization 'compressed-tensors'"),
], ids=["method", "bits", "bits-string", "gemv", "no-zero-point", "format", "group", "group-string",
        "desc-act-string", "not-an-object", "pack-dtype", "dynamic", "compressed-tensors"])
def test_unsupported_quantization_configs_are_refused(config, error):
    with pytest.raises(ValueError, match=error):
        QuantConfig.from_hf(config)


def test_a_rank_keeps_whole_blocks_of_a_packed_row_parallel_layer():
    q, parts, exact = layer_parts("awq", n=16, k=128, group=32)
    packed = quant.convert("l", q, parts, pack=True)
    for rank in range(2):
        layer = RowLinear(128, 16, tp=TPGroup(rank=rank, size=2))
        layer.pack(quant.FORMAT)
        layer.load(packed)
        assert torch.equal(ref.dequantize(layer.weight, "q4_z"), exact[:, rank * 64:(rank + 1) * 64])


# ----------------------------------------------------------------------------- served


CASES = {  # name: (arch, quantize_checkpoint's arguments, whether the fused gate|up layer is kept packed)
    "awq": ("llama", dict(method="awq", group=32), True),
    "awq-qwen2-bias": ("qwen2", dict(method="awq", group=64), True),
    "gptq-sym": ("llama", dict(method="gptq", group=32, sym=True), True),
    "gptq-v2-per-row": ("llama", dict(method="gptq", group=-1, v1=False), True),
    "gptq-act-order": ("llama", dict(method="gptq", group=32, act_order=True), True),
    "awq-phi3-fused": ("phi3", dict(method="awq", group=32), True),  # q|k|v and gate|up fused in the checkpoint
    # gate and up each in its own column order: they cannot share one gathered input
    "gptq-act-order-unshared": ("llama", dict(method="gptq", group=32, act_order=True, shared_order=False), False),
}


@pytest.mark.parametrize("case", list(CASES))
def test_int4_checkpoints_match_transformers_on_their_weights(case, tmp_path, smollm_tokenizer_dir):
    arch, how, fused_packed = CASES[case]
    dense = make_tiny_model(str(tmp_path / "dense"), arch, smollm_tokenizer_dir, seed=3)
    quantize_checkpoint(dense, str(tmp_path / "int4"), **how, write_back=True)
    hf = AutoModelForCausalLM.from_pretrained(dense, dtype=torch.float32).eval()
    llm = LLM(str(tmp_path / "int4"), device="cpu", dtype="float32", num_kv_blocks=256, max_model_len=512)
    for layer in llm.engine.runner.model.layers:
        assert (layer.mlp.down_proj.packed, layer.mlp.gate_up_proj.packed) == ("q4_z", "q4_z" if fused_packed else None)
        assert layer.self_attn.qkv_proj.packed == ("q4_z" if fused_packed else None)
        act_order = how.get("act_order", False)
        assert (layer.mlp.down_proj.perm is not None, layer.mlp.gate_up_proj.perm is not None) == \
            (act_order, act_order and fused_packed)
    check_parity(llm, hf, llm.tokenizer, PROMPTS, n=24)


MOE_CASES = {  # name: (arch, quantize_checkpoint's arguments, whether the experts are kept packed)
    "gptq-qwen2-moe": ("qwen2_moe", dict(method="gptq", group=32), True),  # and its shared expert, a gated MLP
    "awq-mixtral": ("mixtral", dict(method="awq", group=64), True),  # experts named w1, w3, w2
    # each expert's columns in an order of its own: the experts share one input, so they are expanded
    "gptq-act-order-qwen3-moe": ("qwen3_moe", dict(method="gptq", group=32, act_order=True), False),
}


@pytest.mark.parametrize("case", list(MOE_CASES))
def test_int4_mixtures_of_experts_match_transformers_on_their_weights(case, tmp_path, smollm_tokenizer_dir):
    """Every expert quantized (not the router): kept as Q4_Z blocks, which the C kernel multiplies in the experts'
    loop, or expanded; greedy tokens equal transformers' on the exact weights."""
    arch, how, experts_packed = MOE_CASES[case]
    dense = make_tiny_model(str(tmp_path / "dense"), arch, smollm_tokenizer_dir, seed=3, moe_intermediate_size=64,
                            intermediate_size=64 if arch == "mixtral" else 128)
    path = quantize_checkpoint(dense, str(tmp_path / "int4"), **how, write_back=True)
    assert not any(name.endswith(".gate.qweight") for name in load_file(f"{path}/model.safetensors"))
    hf = AutoModelForCausalLM.from_pretrained(dense, dtype=torch.float32).eval()
    llm = LLM(path, device="cpu", dtype="float32", num_kv_blocks=256, max_model_len=512)
    for layer in llm.engine.runner.model.layers:
        experts = layer.mlp.experts
        assert (experts.packed, experts.packed_down) == (("q4_z", "q4_z") if experts_packed else (None, None))
        assert experts.w2.shape[-1] == (64 // 32 * 20 if experts_packed else 64)
        assert layer.self_attn.o_proj.packed == "q4_z"
        if arch == "qwen2_moe":
            shared = layer.mlp.shared_expert
            assert (shared.gate_up_proj.packed, shared.down_proj.packed) == ("q4_z", "q4_z")
    check_parity(llm, hf, llm.tokenizer, PROMPTS, n=16)


def test_an_int4_gemma3_multimodal_checkpoint_stays_packed(tmp_path, smollm_tokenizer_dir):
    """Its language model's layers, named language_model.model.*, are found for packing as a text model's."""
    from transformers import Gemma3ForConditionalGeneration

    from tests.conftest import make_tiny_gemma3_multimodal

    dense = make_tiny_gemma3_multimodal(str(tmp_path / "dense"), smollm_tokenizer_dir)
    quantize_checkpoint(dense, str(tmp_path / "int4"), method="awq", group=32, write_back=True)
    hf = Gemma3ForConditionalGeneration.from_pretrained(dense, dtype=torch.float32).eval()
    llm = LLM(str(tmp_path / "int4"), device="cpu", dtype="float32", num_kv_blocks=256, max_model_len=512)
    for layer in llm.engine.runner.model.layers:
        assert {layer.self_attn.qkv_proj.packed, layer.self_attn.o_proj.packed, layer.mlp.gate_up_proj.packed,
                layer.mlp.down_proj.packed} == {"q4_z"}
    check_parity(llm, hf, llm.tokenizer, PROMPTS[:2], n=16)


def test_layers_left_unquantized_load_as_floats(tmp_path, smollm_tokenizer_dir):
    dense = make_tiny_model(str(tmp_path / "dense"), "llama", smollm_tokenizer_dir, seed=4)
    quantize_checkpoint(dense, str(tmp_path / "int4"), method="awq", group=32,
                        keep=("mlp.down_proj", "self_attn.k_proj"), write_back=True)
    hf = AutoModelForCausalLM.from_pretrained(dense, dtype=torch.float32).eval()
    llm = LLM(str(tmp_path / "int4"), device="cpu", dtype="float32", num_kv_blocks=256, max_model_len=512)
    layer = llm.engine.runner.model.layers[0]
    assert (layer.mlp.down_proj.packed, layer.self_attn.qkv_proj.packed, layer.mlp.gate_up_proj.packed) == \
        (None, None, "q4_z")  # q and v are int4 but share a layer with the float k: expanded
    check_parity(llm, hf, llm.tokenizer, PROMPTS[:2], n=16)


def test_model_config_reads_the_quantization_config():
    base = dict(model_type="llama", vocab_size=8, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                num_attention_heads=4)
    assert ModelConfig.from_hf(base).quant is None
    cfg = ModelConfig.from_hf(base | {"quantization_config": {"quant_method": "gptq", "bits": 4, "group_size": -1,
                                                              "desc_act": True}})
    assert cfg.quant == QuantConfig("gptq", 0, 1, True)


def test_int4_checkpoint_on_triton_kernels_equals_the_reference(tmp_path, smollm_tokenizer_dir, monkeypatch):
    """Greedy tokens with every kernel Triton (Q4_Z layers through ``kernels.triton.linear_packed``;
    interpreted where there is no GPU) equal those with the references, fp32."""
    pytest.importorskip("triton")
    import kernels.triton as tri

    dense = make_tiny_model(str(tmp_path / "dense"), "qwen2", smollm_tokenizer_dir, seed=5)
    quantize_checkpoint(dense, str(tmp_path / "int4"), method="gptq", group=32, act_order=True)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    prompts = [[(7 * i + 3 * j) % 5000 + 3 for j in range(n)] for i, n in enumerate([5, 23])]
    outs, calls, real = {}, [], tri.linear_packed
    for name in ("reference", "triton"):
        monkeypatch.setattr(kernels, "_backend", name)
        if name == "triton":
            monkeypatch.setattr(tri, "linear_packed", lambda *a, **k: calls.append(a[2]) or real(*a, **k))
        llm = LLM(str(tmp_path / "int4"), device=device, dtype="float32", num_kv_blocks=64, max_model_len=128)
        outs[name] = [o.token_ids for o in llm.generate(prompts, SamplingParams(max_tokens=4, temperature=0.0,
                                                                                ignore_eos=True))]
    assert outs["triton"] == outs["reference"]
    assert set(calls) == {"q4_z"}


@pytest.mark.parametrize("act_order", [False, True], ids=["awq", "gptq-act-order"])
def test_int4_checkpoint_under_tensor_parallel_equals_one_rank(act_order, tmp_path, smollm_tokenizer_dir):
    """TP=2 on the CPU (gloo): each rank keeps its rows of the column-parallel layers and whole blocks
    of its columns of the row-parallel ones, packed (act-order: those expanded, their input split over
    the ranks); greedy tokens equal one rank's."""
    dense = make_tiny_model(str(tmp_path / "dense"), "qwen2", smollm_tokenizer_dir, seed=6)
    path = quantize_checkpoint(dense, str(tmp_path / "int4"), method="gptq" if act_order else "awq", group=32,
                               act_order=act_order)
    prompts = [[(5 * i + 11 * j) % 5000 + 3 for j in range(n)] for i, n in enumerate([9, 40, 3])]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    kw = dict(device="cpu", dtype="float32", num_kv_blocks=48, max_model_len=128, max_num_batched_tokens=32)
    with LLM(path, **kw) as one:
        want = [o.token_ids for o in one.generate(prompts, params)]
    with LLM(path, tensor_parallel_size=2, **kw) as two:
        layer = two.engine.runner.model.layers[0]
        assert layer.self_attn.qkv_proj.packed == "q4_z"
        if act_order:
            assert (layer.self_attn.o_proj.packed, layer.mlp.down_proj.packed) == (None, None)
        else:
            assert (layer.self_attn.o_proj.packed, layer.mlp.down_proj.packed) == ("q4_z", "q4_z")
            assert layer.self_attn.o_proj.weight.shape == (64, 32 // 32 * 20)  # half of K=64: one block
        got = [o.token_ids for o in two.generate(prompts, params)]
    assert got == want


# ----------------------------------------------------------------------------- what real checkpoints carry


@pytest.fixture(scope="module")
def gptq_pair(tmp_path_factory, smollm_tokenizer_dir) -> tuple[str, str]:
    """(a dense llama folder holding the exact weights, its GPTQ int4 twin)."""
    root = tmp_path_factory.mktemp("gptq")
    dense = make_tiny_model(str(root / "dense"), "llama", smollm_tokenizer_dir, seed=8)
    return dense, quantize_checkpoint(dense, str(root / "int4"), method="gptq", group=32, write_back=True)


def edited(src: str, dst: str, edit) -> str:
    """A copy of checkpoint folder ``src`` whose tensors ``edit(dict)`` changed (and whose
    config.json ``edit`` may change through the dict's "config.json" entry)."""
    shutil.copytree(src, dst)
    tensors = load_file(os.path.join(dst, "model.safetensors"))
    with open(os.path.join(dst, "config.json")) as f:
        tensors["config.json"] = json.load(f)
    edit(tensors)
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(tensors.pop("config.json"), f)
    save_file(tensors, os.path.join(dst, "model.safetensors"))
    return dst


def greedy(path: str, **kw) -> list[list[int]]:
    llm = LLM(path, device="cpu", num_kv_blocks=64, max_model_len=128, **({"dtype": "float32"} | kw))
    prompts = [[(3 * i + 7 * j) % 5000 + 3 for j in range(n)] for i, n in enumerate([6, 30])]
    return [o.token_ids for o in llm.generate(prompts, SamplingParams(max_tokens=6, temperature=0.0,
                                                                      ignore_eos=True))]


def test_gptq_zero_biases_are_skipped_and_a_real_one_refused(gptq_pair, tmp_path):
    dense, int4 = gptq_pair
    want = greedy(dense)

    def biases(value: float):
        def edit(t: dict) -> None:
            for name in [n for n in t if n.endswith(".qweight")]:
                t[name.replace(".qweight", ".bias")] = torch.full((t[name.replace(".qweight", ".scales")].shape[1],),
                                                                  value, dtype=torch.float16)
        return edit

    assert greedy(edited(int4, str(tmp_path / "zero"), biases(0.0))) == want
    with pytest.raises(ValueError, match=r"model\.layers\.\d+\..+\.bias: a nonzero bias, but llama has none"):
        LLM(edited(int4, str(tmp_path / "one"), biases(1.0)), device="cpu", num_kv_blocks=8)


def test_int4_words_that_are_not_int32_are_refused(gptq_pair, tmp_path):
    """(Review: a float32 qweight was cast to words, other weights served silently.)"""
    def floats(t: dict) -> None:
        name = next(n for n in t if n.endswith(".qweight"))
        t[name] = t[name].float()

    with pytest.raises(ValueError, match=r": qweight is torch\.float32, not int32 words"):
        LLM(edited(gptq_pair[1], str(tmp_path / "f"), floats), device="cpu", num_kv_blocks=8)


def test_settings_from_autogptqs_quantize_config_json(gptq_pair, tmp_path):
    dense, int4 = gptq_pair

    def move(t: dict) -> None:
        settings = t["config.json"].pop("quantization_config")
        settings.pop("quant_method")
        with open(tmp_path / "own" / "quantize_config.json", "w") as f:
            json.dump(settings, f)

    path = edited(int4, str(tmp_path / "own"), move)
    assert LLM(path, device="cpu", num_kv_blocks=8).engine.runner.model_cfg.quant.method == "gptq"
    assert greedy(path) == greedy(dense)


def test_layers_that_cannot_be_exact_blocks_are_expanded(gptq_pair, tmp_path, monkeypatch):
    """Scales float16 cannot hold (a bf16 one too small), float16 on the CPU (no C kernel for it), and the C kernel
    turned off (``TOKENMILL_CPU_LINEAR_ROWS=0``, as a GGUF's blocks): expanded at load."""
    dense, int4 = gptq_pair
    name = "model.layers.1.mlp.down_proj.scales"

    def tiny_scale(t: dict) -> None:
        t[name] = t[name].bfloat16()
        t[name][0, 0] = 3e-7

    path = edited(int4, str(tmp_path / "bf16"), tiny_scale)
    llm = LLM(path, device="cpu", dtype="float32", num_kv_blocks=8)
    assert [layer.mlp.down_proj.packed for layer in llm.engine.runner.model.layers] == ["q4_z", None]
    half = LLM(int4, device="cpu", dtype="float16", num_kv_blocks=8)
    assert {layer.mlp.down_proj.packed for layer in half.engine.runner.model.layers} == {None}
    monkeypatch.setenv("TOKENMILL_CPU_LINEAR_ROWS", "0")
    torch_only = LLM(int4, device="cpu", dtype="float32", num_kv_blocks=8)
    assert {layer.mlp.down_proj.packed for layer in torch_only.engine.runner.model.layers} == {None}


def test_a_layer_without_its_qweight_is_named():
    q, parts, _ = layer_parts("gptq")
    names = [f"model.layers.0.mlp.up_proj.{p}" for p in ("g_idx", "qzeros", "scales")]
    with pytest.raises(ValueError, match="^model.layers.0.mlp.up_proj: qweight missing \\(its g_idx is in"):
        list(quant.weights(((n, parts[n.rpartition(".")[2]]) for n in names), q, set(names), set()))


def test_quantization_flag_is_checked_against_the_checkpoint(gptq_pair, default_gguf):
    _, int4 = gptq_pair
    assert LLM(int4, device="cpu", num_kv_blocks=8, quantization="gptq_marlin").engine.runner.model_cfg.quant
    with pytest.raises(ValueError, match=f"--quantization awq, but {int4} is GPTQ int4"):
        LLM(int4, device="cpu", num_kv_blocks=8, quantization="awq")
    with pytest.raises(ValueError, match="is a GGUF file"):
        LLM(device="cpu", num_kv_blocks=8, quantization="gptq")


def test_serve_an_act_order_gptq_checkpoint_to_the_openai_client(tmp_path, smollm_tokenizer_dir):
    """``tokenmill serve -q gptq`` on an act-order GPTQ folder: the official client streams the
    offline greedy text, and the start-up log says what was kept packed."""
    from tests.test_server_e2e import Server, openai_client

    dense = make_tiny_model(str(tmp_path / "dense"), "llama", smollm_tokenizer_dir, seed=9)
    path = quantize_checkpoint(dense, str(tmp_path / "int4"), method="gptq", group=32, act_order=True)
    llm = LLM(path, device="cpu", dtype="float32", num_kv_blocks=64, max_model_len=256)
    want = llm.generate(["The capital of France is"], SamplingParams(max_tokens=12, temperature=0.0))[0].text
    server = Server("--model", path, "--served-model-name", "int4", "-q", "gptq", "--dtype", "float32",
                    "--max-model-len", "256")
    try:
        stream = openai_client(server).completions.create(model="int4", prompt="The capital of France is",
                                                          max_tokens=12, temperature=0.0, stream=True)
        assert "".join(c.choices[0].text for c in stream) == want
        assert "GPTQ int4 checkpoint (groups of 32): 14 of its 14 int4 layers kept packed" in server.log()
    finally:
        server.close()


def test_serve_refuses_a_careless_quantization_config_at_start(gptq_pair, tmp_path):
    """A config a tool wrote badly (bits as a string): the server exits at start, naming the value,
    without a traceback."""
    from tests.test_server_cli import tokenmill

    def careless(t: dict) -> None:
        t["config.json"]["quantization_config"]["bits"] = "4"

    path = edited(gptq_pair[1], str(tmp_path / "careless"), careless)
    r = tokenmill("serve", "--model", path, "--port", "0", timeout=120)
    assert r.returncode == 1
    assert "GPTQ with bits '4' is not supported: only 4-bit weights are" in r.stderr
    assert "Traceback" not in r.stderr
