"""Embeddings (``engine.pooling``, ``LLM.embed``): vectors equal to transformers' pooled hidden states
(fp32) however the prompt is chunked, cached, preempted or batched with generations; the model's
own pooling read from its sentence-transformers files or GGUF metadata; a Qwen3-Embedding-style
checkpoint (bare backbone, no ``model.`` prefix, no lm_head) that embeds and refuses to generate.
The HTTP API with the official ``openai`` client: ``test_embeddings_api``."""

from __future__ import annotations

import json
import os
import struct

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModel

from engine import LLM, SamplingParams
from engine.engine import RequestError
from engine.pooling import PoolerConfig
from engine.protocol import PoolingParams
from tests.conftest import make_tiny_model

KW = dict(device="cpu", dtype="float32", num_kv_blocks=256, max_model_len=512)
TEXTS = ["The quick brown fox jumps over the lazy dog", "hello " * 70, "x", "def f(n):\n    return n + 1"]


def hf_embedding(hf, ids: list[int], pooling: str, normalize: bool = True) -> torch.Tensor:
    with torch.no_grad():
        h = hf(torch.tensor([ids])).last_hidden_state[0]
    v = h[-1] if pooling == "last" else h[0] if pooling == "cls" else h.mean(0)
    return F.normalize(v, dim=0) if normalize else v


def close(got: list[float], want: torch.Tensor) -> bool:
    return torch.allclose(torch.tensor(got), want, atol=1e-5, rtol=1e-4)


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory, smollm_tokenizer_dir):
    path = make_tiny_model(str(tmp_path_factory.mktemp("qwen3")), "qwen3", smollm_tokenizer_dir, seed=3, head_dim=24)
    return path, AutoModel.from_pretrained(path, dtype=torch.float32).eval()


@pytest.mark.parametrize("pooling", ["last", "mean", "cls"])
def test_embeddings_match_transformers_chunked_and_cached(qwen3, pooling):
    """Chunks of 32 tokens (the 71-token prompt takes three steps); asked again, a last-token embedding
    comes from the prefix cache but for its last token, a mean or first-token one computes every token
    again (a CLS's first chunk's state kept until its last)."""
    path, hf = qwen3
    llm = LLM(path, max_num_batched_tokens=32, pooler_config={"pooling_type": pooling}, **KW)
    first, again = llm.embed(TEXTS), llm.embed(TEXTS)
    for a, b in zip(first, again, strict=True):
        want = hf_embedding(hf, a.prompt_token_ids, pooling)
        assert close(a.embedding, want) and close(b.embedding, want), a.prompt
    cached = [o.num_cached_tokens for o in again]
    assert (max(cached) >= 64) if pooling == "last" else cached == [0] * len(TEXTS)
    assert llm.engine.block_manager.num_free_blocks == llm.engine.block_manager.num_blocks


def test_dimensions_and_normalize(qwen3):
    path, hf = qwen3
    llm = LLM(path, **KW)
    ids = llm.tokenizer.encode(TEXTS[0])
    raw = hf_embedding(hf, ids, "last", normalize=False)
    assert close(llm.embed(ids, normalize=False)[0].embedding, raw)
    assert close(llm.embed(ids, dimensions=16)[0].embedding, F.normalize(raw[:16], dim=0))
    assert close(llm.embed(ids, dimensions=16, normalize=False)[0].embedding, raw[:16])
    with pytest.raises(RequestError, match="dimensions must be at most the model's 64") as e:
        llm.embed(ids, dimensions=65)
    assert e.value.param == "dimensions"


def test_embeddings_batched_with_generations_change_neither(tiny_llama):
    """Embedding requests join the same steps as generations: greedy tokens and vectors are as alone."""
    llm = LLM(tiny_llama, max_num_batched_tokens=48, pooler_config={"pooling_type": "mean"}, **KW)
    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    prompts = [llm.tokenizer.encode(t) for t in TEXTS]
    alone_tokens = [o.token_ids for o in llm.generate(prompts, greedy)]
    alone_vectors = [o.embedding for o in llm.embed(prompts)]
    eng = llm.engine
    for i, p in enumerate(prompts):
        eng.add_request(f"g{i}", p, greedy)
        eng.add_request(f"e{i}", p, SamplingParams(max_tokens=1), pooling=PoolingParams())
    tokens, vectors, mixed = {}, {}, 0
    while eng.has_work():
        batch_before = len(eng.scheduler.running)
        for d in eng.step():
            if d.embedding is not None:
                vectors[d.request_id] = torch.frombuffer(bytearray(d.embedding), dtype=torch.float32)
                mixed += batch_before > 1
            tokens.setdefault(d.request_id, []).extend(d.token_ids)
    assert [tokens[f"g{i}"] for i in range(len(prompts))] == alone_tokens
    assert all(close(alone_vectors[i], vectors[f"e{i}"]) for i in range(len(prompts)))
    assert all(tokens[f"e{i}"] == [] for i in range(len(prompts))) and mixed


def test_a_preempted_mean_embedding_starts_its_sum_afresh(qwen3):
    """12 blocks of 16 tokens for five generations growing from 20 to 80 tokens and a 71-token mean
    embedding prefilled 16 tokens a step: the embedding, admitted last, is preempted mid-prompt and
    recomputed from its first token."""
    path, hf = qwen3
    llm = LLM(path, **(KW | {"num_kv_blocks": 12}), max_num_batched_tokens=16,
              pooler_config={"pooling_type": "mean"})
    greedy = SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True)
    gen_prompts = [list(range(100 + 7 * i, 120 + 7 * i)) for i in range(5)]
    want_tokens = [o.token_ids for o in LLM(path, **KW).generate(gen_prompts, greedy)]
    eng = llm.engine
    for i, p in enumerate(gen_prompts):
        eng.add_request(f"g{i}", p, greedy)
    ids = llm.tokenizer.encode(TEXTS[1])
    eng.add_request("e", ids, SamplingParams(max_tokens=1), pooling=PoolingParams())
    embedding_request = eng.requests["e"]
    tokens, vector = {}, None
    while eng.has_work():
        for d in eng.step():
            tokens.setdefault(d.request_id, []).extend(d.token_ids)
            if d.embedding is not None:
                vector = torch.frombuffer(bytearray(d.embedding), dtype=torch.float32)
    assert embedding_request.num_preemptions > 0
    assert close(vector, hf_embedding(hf, ids, "mean"))
    assert [tokens[f"g{i}"] for i in range(5)] == want_tokens


def _sentence_transformers_files(path: str, modes: dict, normalize: bool = True) -> None:
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"})
    with open(os.path.join(path, "modules.json"), "w") as f:
        json.dump(modules, f)
    os.makedirs(os.path.join(path, "1_Pooling"), exist_ok=True)
    with open(os.path.join(path, "1_Pooling", "config.json"), "w") as f:
        json.dump({"word_embedding_dimension": 64, "pooling_mode_cls_token": False,
                   "pooling_mode_mean_tokens": False, "pooling_mode_lasttoken": False} | modes, f)


def test_a_qwen3_embedding_checkpoint_embeds_and_refuses_to_generate(tmp_path, smollm_tokenizer_dir):
    """Saved as Qwen3-Embedding ships: the bare Qwen3Model (``embed_tokens.weight``, ``layers.0...``: no
    ``model.`` prefix, no lm_head although untied) with sentence-transformers files saying last-token
    pooling, normalized."""
    folder = make_tiny_model(str(tmp_path / "causal"), "qwen3", smollm_tokenizer_dir, seed=4, head_dim=24)
    backbone = AutoModel.from_pretrained(folder, dtype=torch.float32).eval()
    path = str(tmp_path / "qwen3-embedding")
    backbone.save_pretrained(path, safe_serialization=True)
    for name in os.listdir(smollm_tokenizer_dir):
        os.link(os.path.join(smollm_tokenizer_dir, name), os.path.join(path, name))
    _sentence_transformers_files(path, {"pooling_mode_lasttoken": True})
    llm = LLM(path, **KW)
    assert llm.engine.pooler == PoolerConfig("last", True) and not llm.engine.can_generate
    assert llm.engine.runner.model.lm_head is None  # no vocabulary-sized head allocated for nothing
    for out in llm.embed(TEXTS):
        assert close(out.embedding, hf_embedding(backbone, out.prompt_token_ids, "last")), out.prompt
    with pytest.raises(RequestError, match="has no language-model head") as e:
        llm.generate(["Hello"], SamplingParams(max_tokens=4))
    assert e.value.status == 400
    # sampling params sent with an embedding ask for nothing: no logits (there is no head to make them)
    eng = llm.engine
    eng.add_request("x", [5, 6, 7], SamplingParams(max_tokens=3, prompt_logprobs=2, logprobs=1),
                    pooling=PoolingParams())
    deltas = [d for _ in range(3) for d in eng.step()]
    assert [(d.request_id, d.finish_reason, d.prompt_logprobs) for d in deltas] == [("x", "stop", None)]
    assert close(list(struct.unpack("<64f", deltas[0].embedding)), hf_embedding(backbone, [5, 6, 7], "last"))


def test_the_models_pooling_and_the_override(tmp_path):
    path = str(tmp_path)
    assert PoolerConfig.of(path) == PoolerConfig("last", True)  # a decoder without sentence-transformers files
    _sentence_transformers_files(path, {"pooling_mode_mean_tokens": True}, normalize=False)
    assert PoolerConfig.of(path) == PoolerConfig("mean", False)
    assert PoolerConfig.of(path, {"pooling_type": "LAST"}) == PoolerConfig("last", False)
    assert PoolerConfig.of(path, {"normalize": True}) == PoolerConfig("mean", True)
    _sentence_transformers_files(path, {"pooling_mode_cls_token": True})
    assert PoolerConfig.of(path) == PoolerConfig("cls", True)
    _sentence_transformers_files(path, {"pooling_mode_max_tokens": True})
    with pytest.raises(ValueError, match="max"):
        PoolerConfig.of(path)
    assert PoolerConfig.of(path, {"pooling_type": "mean"}) == PoolerConfig("mean", True)
    _sentence_transformers_files(path, {"pooling_mode_mean_tokens": True, "pooling_mode_max_tokens": True})
    with pytest.raises(ValueError, match="mean\\+max"):
        PoolerConfig.of(path)
    assert PoolerConfig.of(path, {"pooling_type": "last"}) == PoolerConfig("last", True)
    os.remove(os.path.join(path, "1_Pooling", "config.json"))
    with pytest.raises(ValueError, match="unreadable"):
        PoolerConfig.of(path)
    assert PoolerConfig.of(path, {"pooling_type": "mean"}) == PoolerConfig("mean", True)


@pytest.mark.parametrize("code,want", [(1, "mean"), (3, "last"), (0, "last")])
def test_a_ggufs_pooling_type(tmp_path, code, want):
    """llama.cpp's ``<arch>.pooling_type`` (0 none: the default then)."""
    import gguf

    from engine import loader

    out = str(tmp_path / f"p{code}.gguf")
    w = gguf.GGUFWriter(out, "llama")
    w.add_uint32("llama.pooling_type", code)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    loader._gguf_reader.cache_clear()
    assert PoolerConfig.of(out).pooling_type == want


def test_a_model_whose_pooling_is_unsupported_still_generates(tiny_llama, tmp_path):
    """Max pooling in its sentence-transformers files: embeddings are refused, saying why."""
    folder = str(tmp_path / "cls_model")
    os.makedirs(folder)
    for name in os.listdir(tiny_llama):
        os.symlink(os.path.join(tiny_llama, name), os.path.join(folder, name))
    _sentence_transformers_files(folder, {"pooling_mode_max_tokens": True})
    llm = LLM(folder, **KW)
    assert llm.generate(["Hi"], SamplingParams(max_tokens=2, ignore_eos=True))[0].finish_reason == "length"
    with pytest.raises(RequestError, match="cannot embed.*max") as e:
        llm.embed("Hi")
    assert e.value.param == "input"


def test_an_input_as_long_as_the_cache_embeds(qwen3):
    """12 blocks of 16 tokens: max_model_len drops to 192, and a 192-token input fits (it samples no token
    after its prompt, so it needs no slot past it)."""
    path, hf = qwen3
    llm = LLM(path, **(KW | {"num_kv_blocks": 12}))
    assert llm.engine.max_model_len == 192
    ids = list(range(300, 492))
    assert close(llm.embed(ids)[0].embedding, hf_embedding(hf, ids, "last"))
    with pytest.raises(RequestError, match="maximum context length is 192") as e:
        llm.embed(ids + [7])
    assert e.value.param == "input"
