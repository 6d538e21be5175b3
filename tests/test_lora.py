"""LoRA adapters (``engine.lora``): PEFT folders read and checked, greedy output token for token that of
transformers running the adapter as PEFT does (fp32), adapters and the model alone mixed in one batch
(CPU graphs, eager, asynchronous scheduling, two tensor-parallel ranks), the prefix cache kept apart per
adapter, and the server's side (``/v1/models``, ``model`` naming one, the openai client)."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM

from engine import LLM, SamplingParams
from engine.lora import AdapterError, read_adapter
from tests.conftest import make_tiny_model
from tools.random_lora import make_lora

PROMPTS = [[1, 450, 4996, 17354, 1701, 432], [1, 822, 18755, 29898, 29876], [1, 3681, 338, 263]]


def with_adapter(hf, adapter_dir: str):
    """``hf`` computing y = x W^T + s (x A^T) B^T in each adapted layer, as PEFT's LoRA layer does."""
    a = read_adapter("ref", adapter_dir, 64)
    hooks = []
    for (layer, module), (lora_a, lora_b) in a.weights.items():
        lora_a, lora_b = lora_a.to(hf.device), lora_b.to(hf.device)
        lin = hf.model.layers[layer].get_submodule(module)
        hooks.append(lin.register_forward_hook(
            lambda mod, args, y, lora_a=lora_a, lora_b=lora_b: y + (args[0] @ lora_a.T) @ lora_b.T))
    return hooks


def hf_greedy(hf, ids: list[int], n: int) -> list[int]:
    out = hf.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                      max_new_tokens=n, do_sample=False, pad_token_id=0)
    return out[0, len(ids):].tolist()


@pytest.mark.parametrize(("eager", "overlap"), [(False, "off"), (True, "off"), (False, "on")],
                         ids=["cpu-graphs", "eager", "async-scheduling"])
def test_adapters_and_the_model_alone_in_one_batch_match_transformers(lora_tiny, eager, overlap):
    model, a, b = lora_tiny
    llm = LLM(model, device="cpu", dtype="float32", num_kv_blocks=128, max_model_len=256, enforce_eager=eager,
              async_scheduling=overlap, lora_modules={"a": a, "b": b})
    n = 12
    prompts = PROMPTS * 3
    loras = [None] * 3 + ["a"] * 3 + ["b"] * 3
    outs = llm.generate(prompts, SamplingParams(max_tokens=n, temperature=0.0), lora_request=loras)
    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    want = {None: [hf_greedy(hf, p, n) for p in PROMPTS]}
    for name, path in (("a", a), ("b", b)):
        hooks = with_adapter(hf, path)
        want[name] = [hf_greedy(hf, p, n) for p in PROMPTS]
        for h in hooks:
            h.remove()
    assert want["a"] != want[None] and want["b"] != want[None]  # the adapters change the output
    for out, lora, i in zip(outs, loras, [0, 1, 2] * 3, strict=True):
        assert out.token_ids == want[lora][i], (lora, i)


def test_the_prefix_cache_is_kept_apart_per_adapter(lora_tiny):
    model, a, b = lora_tiny
    llm = LLM(model, device="cpu", dtype="float32", num_kv_blocks=128, max_model_len=256,
              lora_modules={"a": a, "b": b})
    prompt = list(range(3, 3 + 40))
    greedy = SamplingParams(max_tokens=4, temperature=0.0)
    alone = llm.generate([prompt], greedy)[0]
    first_a = llm.generate([prompt], greedy, lora_request="a")[0]
    again_a = llm.generate([prompt], greedy, lora_request="a")[0]
    first_b = llm.generate([prompt], greedy, lora_request="b")[0]
    assert first_a.num_cached_tokens == 0 and first_b.num_cached_tokens == 0  # the model's blocks are not theirs
    assert again_a.num_cached_tokens == 32 and again_a.token_ids == first_a.token_ids
    assert llm.generate([prompt], greedy)[0].num_cached_tokens == 32
    assert alone.token_ids != first_a.token_ids


@pytest.mark.parametrize("eager", [False, True], ids=["cpu-graphs", "eager"])
def test_steps_without_an_adapter_skip_it_and_graphs_keep_a_recording_each_way(lora_tiny, eager):
    """A step in which no token has an adapter skips the adapters' products; a CPU graph recorded for one kind
    of step is never replayed for the other: the model alone, an adapter, the model alone again, one stream
    each (the same batch size), each as a fresh engine gives it."""
    model, a, b = lora_tiny
    kw = dict(device="cpu", dtype="float32", num_kv_blocks=128, max_model_len=256, enforce_eager=eager)
    greedy = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    with LLM(model, **kw) as plain:
        want_alone = plain.generate([PROMPTS[0]], greedy)[0].token_ids
    with LLM(model, **kw, lora_modules={"a": a}) as llm:
        want_a = llm.generate([PROMPTS[0]], greedy, lora_request="a")[0].token_ids
    with LLM(model, **kw, lora_modules={"a": a}) as llm:
        runs = [llm.generate([PROMPTS[0]], greedy, lora_request=lora)[0].token_ids for lora in (None, "a", None)]
        assert runs == [want_alone, want_a, want_alone] and want_a != want_alone
        if not eager:
            assert {(1, 0), (1, 1)} <= set(llm.engine.runner.graphs.replays)


def test_unknown_adapter_is_refused(lora_tiny):
    model, a, _ = lora_tiny
    llm = LLM(model, device="cpu", dtype="float32", num_kv_blocks=64, max_model_len=128, lora_modules={"a": a})
    with pytest.raises(Exception, match="'nope' does not exist"):
        llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2), lora_request="nope")


@pytest.mark.parametrize(("config", "files", "match"), [
    ({"use_dora": True}, None, "DoRA"),
    ({"modules_to_save": ["lm_head"]}, None, "whole modules"),
    ({"bias": "lora_only"}, None, "biases"),
    ({"peft_type": "IA3"}, None, "only LoRA is served"),
    ({}, {"base_model.model.lm_head.lora_A.weight": torch.zeros(2, 64),
          "base_model.model.lm_head.lora_B.weight": torch.zeros(8, 2)}, "attention and MLP projections only"),
    ({}, {"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": torch.zeros(2, 64)}, "must both"),
    ({}, {"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": torch.zeros(32, 64),
          "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight": torch.zeros(64, 32)}, "max-lora-rank 16"),
    ({}, {"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": torch.zeros(0, 64),
          "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight": torch.zeros(64, 0)}, "rank 1 or more"),
    ({}, {"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": torch.tensor(1.0),  # (review: a 500)
          "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight": torch.zeros(64, 2)}, "rank 1 or more"),
    ({}, b"truncated", "cannot be read"),
    ([], None, "not a JSON object"),
])
def test_adapters_that_cannot_be_served_are_refused(lora_tiny, tmp_path, config, files, match):
    path = make_lora(lora_tiny[0], str(tmp_path / "x"), seed=0, **(config or {}))
    if isinstance(files, bytes):
        with open(os.path.join(path, "adapter_model.safetensors"), "wb") as f:
            f.write(files)
    elif files is not None:
        save_file(files, os.path.join(path, "adapter_model.safetensors"))
    if config == []:
        with open(os.path.join(path, "adapter_config.json"), "w") as f:
            json.dump([], f)
    with pytest.raises(AdapterError, match=match):
        read_adapter("x", path, 16)


def test_adapters_that_do_not_fit_the_model_are_refused_at_start(lora_tiny, tmp_path, smollm_tokenizer_dir):
    """An adapter made for another width (down_proj's lora_B rows: the model's hidden size), and one on a mixture
    of experts' MLP: refused when the engine starts, naming the layer."""
    model = lora_tiny[0]
    narrow = make_tiny_model(str(tmp_path / "narrow"), "llama", None, seed=0, hidden_size=32)
    wrong = make_lora(narrow, str(tmp_path / "narrow-lora"), seed=0, modules=("down_proj",))
    with pytest.raises(AdapterError, match=r"layer 0 mlp.down_proj's lora_A and lora_B are \(8, 128\) and \(32, 8\)"):
        LLM(model, device="cpu", dtype="float32", num_kv_blocks=16, max_model_len=64, lora_modules={"w": wrong})
    moe = make_tiny_model(str(tmp_path / "moe"), "qwen3_moe", None, seed=0)
    on_mlp = make_lora(moe, str(tmp_path / "moe-lora"), seed=0, modules=("q_proj", "up_proj"))
    with pytest.raises(AdapterError, match="no plain linear layer here"):
        LLM(moe, device="cpu", dtype="float32", num_kv_blocks=16, max_model_len=64, lora_modules={"m": on_mlp})


def test_scales_rslora_and_patterns(lora_tiny, tmp_path):
    model = lora_tiny[0]
    plain = read_adapter("p", make_lora(model, str(tmp_path / "p"), seed=0, r=4, alpha=8.0), 16)
    rs = read_adapter("r", make_lora(model, str(tmp_path / "r"), seed=0, r=4, alpha=8.0, use_rslora=True), 16)
    pat = read_adapter("q", make_lora(model, str(tmp_path / "q"), seed=0, r=4, alpha=8.0,
                                      alpha_pattern={"q_proj": 2.0}), 16)
    no_alpha = make_lora(model, str(tmp_path / "n"), seed=0, r=4)
    with open(os.path.join(no_alpha, "adapter_config.json")) as f:
        cfg = json.load(f)
    del cfg["lora_alpha"]
    with open(os.path.join(no_alpha, "adapter_config.json"), "w") as f:
        json.dump(cfg, f)
    key, other = (0, "self_attn.q_proj"), (0, "self_attn.k_proj")
    assert torch.allclose(read_adapter("n", no_alpha, 16).weights[key][1], plain.weights[key][1])  # PEFT's alpha 8
    raw = plain.weights[key][1] / 2.0  # alpha / r = 2
    assert torch.allclose(rs.weights[key][1], raw * 4.0)  # alpha / sqrt(r) = 4
    assert torch.allclose(pat.weights[key][1], raw * 0.5) and torch.equal(pat.weights[other][1], plain.weights[other][1])


def test_served_adapters_with_the_openai_client(lora_tiny):
    """``tokenmill serve --enable-lora --lora-modules``: /v1/models lists each adapter (its parent the model), a
    request's ``model`` picks one (responses name it), its text is the offline ``LLM``'s with that adapter;
    streamed chat too; an unknown name is a 404, and a bad adapter folder stops the start with its reason."""
    import openai

    from tests.test_server_e2e import Server, openai_client

    model, a, b = lora_tiny
    prompt = "The quick brown fox jumps over the lazy dog because"
    greedy = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    llm = LLM(model, lora_modules={"a": a, "b": b})
    want = {lora: llm.generate([prompt], greedy, lora_request=lora)[0].text for lora in (None, "a", "b")}
    assert len(set(want.values())) == 3
    llm.close()
    s = Server("--model", model, "--served-model-name", "tiny", "--enable-lora", "--lora-modules", f"a={a}",
               json.dumps({"name": "b", "path": b}))
    try:
        client = openai_client(s)
        listed = {m.id: m for m in client.models.list().data}
        assert list(listed) == ["tiny", "a", "b"]
        assert listed["a"].parent == "tiny" and listed["a"].root == a
        for name, lora in (("tiny", None), ("a", "a"), ("b", "b")):
            r = client.completions.create(model=name, prompt=prompt, max_tokens=10, temperature=0,
                                          extra_body={"ignore_eos": True})
            assert r.model == name and r.choices[0].text == want[lora], name
        chunks = list(client.chat.completions.create(model="b", messages=[{"role": "user", "content": "Hi"}],
                                                     max_tokens=5, temperature=0, stream=True))
        assert {c.model for c in chunks} == {"b"} and "".join(c.choices[0].delta.content or "" for c in chunks
                                                              if c.choices)
        with pytest.raises(openai.NotFoundError, match="'c' does not exist"):
            client.completions.create(model="c", prompt=prompt, max_tokens=2)
    finally:
        s.close()
    with pytest.raises(AssertionError, match="rank 8 passes --max-lora-rank 4"):
        Server("--model", model, "--enable-lora", "--lora-modules", f"a={a}", "--max-lora-rank", "4", startup=120)


def test_tensor_parallel_gives_one_ranks_tokens(lora_tiny):
    """Two ranks (gloo): each keeps its rows of B (q|k|v, gate|up) or columns of A (o, down); the same greedy
    tokens as one rank, adapters and the model alone in one batch."""
    model, a, b = lora_tiny
    kw = dict(device="cpu", dtype="float32", num_kv_blocks=64, max_model_len=128, lora_modules={"a": a, "b": b})
    greedy = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    loras = [None, "a", "b", "a"]
    prompts = PROMPTS + [list(range(5, 45))]
    with LLM(model, **kw) as one:
        want = [o.token_ids for o in one.generate(prompts, greedy, lora_request=loras)]
    with LLM(model, tensor_parallel_size=2, **kw) as two:
        assert [o.token_ids for o in two.generate(prompts, greedy, lora_request=loras)] == want
