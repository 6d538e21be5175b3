"""An fp8 KV cache (``--kv-cache-dtype fp8``, ``fp8_e4m3``, ``fp8_e5m2``): greedy output token for token
as transformers gives it with its cache rounded the same way (fp32), under the C kernels and the reference
ones (Triton's: tests/test_triton_kernels.py, and tests/test_cuda.py on a GPU); scheduling
(preemption, chunked prefill, the prefix cache, drafts, tensor parallel) changes no token; the cache holds
as many more tokens as its bytes say; the server takes the flag."""

from __future__ import annotations

import json
import urllib.request

import pytest
import torch
from transformers import AutoModelForCausalLM, DynamicCache

import kernels
from engine import LLM, EngineConfig, SamplingParams
from kernels.reference import to_cache
from tests.conftest import make_tiny_model

PROMPTS = [[1, 5, 6, 7, 8, 5, 6, 7, 8, 5, 6], [1, 822, 18755, 29898, 29876], [1, 3681, 338, 263] * 3]
KW = dict(device="cpu", dtype="float32", num_kv_blocks=128, max_model_len=256)
GREEDY = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
FP8 = {"fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, smollm_tokenizer_dir):
    return make_tiny_model(str(tmp_path_factory.mktemp("kv8")), "llama", smollm_tokenizer_dir, seed=1)


class RoundedCache(DynamicCache):
    """transformers' cache, K and V rounded on their way in as tokenmill's fp8 cache rounds them: the
    oracle (attention reads every key and value from it, the new token's too, as here)."""

    def __init__(self, dtype: torch.dtype):
        super().__init__()
        self.kv_dtype = dtype

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        def rounded(x: torch.Tensor) -> torch.Tensor:
            return to_cache(x, self.kv_dtype).to(x.dtype)
        return super().update(rounded(key_states), rounded(value_states), layer_idx, *args, **kwargs)


def tokens(model: str, kv: str, prompts=PROMPTS, params=GREEDY, **kw) -> list[list[int]]:
    with LLM(model, **(KW | kw), kv_cache_dtype=kv) as llm:
        return [o.token_ids for o in llm.generate(prompts, params)]


@pytest.mark.filterwarnings("ignore:`past_key_values` is deprecated")
@pytest.mark.parametrize("kv", ["fp8_e4m3", "fp8_e5m2"])
@pytest.mark.parametrize("path", ["c-graphs", "c-eager", "reference"])
def test_greedy_matches_transformers_with_its_cache_rounded_alike(tiny, kv, path, monkeypatch):
    """The C kernels (replayed as CPU graphs, and eager) and the reference kernels: transformers' tokens
    with a cache that rounds K and V to the same fp8; and not the tokens of the unrounded cache."""
    if path == "reference":
        monkeypatch.setattr(kernels, "_backend", "reference")
    got = tokens(tiny, kv, enforce_eager=path == "c-eager")
    hf = AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32).eval()
    for p, out in zip(PROMPTS, got, strict=True):
        want = hf.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                           max_new_tokens=GREEDY.max_tokens, do_sample=False, pad_token_id=0,
                           past_key_values=RoundedCache(FP8[kv]))[0, len(p):].tolist()
        assert out == want
    assert got != tokens(tiny, "auto")  # (this random model is that sensitive: the rounding shows)


def test_scheduling_changes_no_token(tiny):
    """A cache too small for every request at once (preemptions, then prefix-cache hits), a token budget
    of 3 (prompts in chunks), drafts (speculative decoding) and two tensor-parallel ranks: the tokens of
    a plain fp8 run."""
    prompts = [PROMPTS[0], PROMPTS[2], PROMPTS[0] + [9], PROMPTS[1] * 2]
    params = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)
    plain = tokens(tiny, "fp8", prompts, params)
    small = dict(num_kv_blocks=9, block_size=8, max_num_batched_tokens=64)
    with LLM(tiny, **(KW | small), kv_cache_dtype="fp8") as llm:
        assert [o.token_ids for o in llm.generate(prompts, params)] == plain
        assert llm.engine.scheduler.num_preemptions
    assert tokens(tiny, "fp8", prompts, params, max_num_batched_tokens=3) == plain
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
    with LLM(tiny, **KW, kv_cache_dtype="fp8", speculative_config=spec) as llm:
        assert [o.token_ids for o in llm.generate(prompts, params)] == plain
        assert llm.engine.scheduler.num_accepted_tokens
    assert tokens(tiny, "fp8", prompts, params, tensor_parallel_size=2) == plain


def test_prefix_cache_hits_read_the_rounded_blocks(tiny):
    """A prompt sharing another's first blocks finds them cached, and gets the tokens it gets alone."""
    shared = PROMPTS[2] * 3  # 36 tokens: two whole blocks of 16
    alone = tokens(tiny, "fp8", [shared + [7, 8]])
    with LLM(tiny, **KW, kv_cache_dtype="fp8") as llm:
        llm.generate([shared + [5]], GREEDY)
        out = llm.generate([shared + [7, 8]], GREEDY)[0]
        assert out.token_ids == alone[0] and out.num_cached_tokens == 32


@pytest.mark.parametrize("dtype,ratio", [("float32", 4), ("bfloat16", 2)])
def test_the_same_memory_holds_more_tokens(tiny, dtype, ratio):
    """--kv-cache-memory fixed: an fp8 cache has 4x fp32's blocks and 2x bf16's, and is allocated as fp8."""
    kw = dict(device="cpu", dtype=dtype, kv_cache_memory=4 << 20, max_model_len=256, max_num_seqs=256)
    with LLM(tiny, **kw) as llm:
        blocks = llm.engine.runner.facts.num_kv_blocks
    with LLM(tiny, **kw, kv_cache_dtype="fp8") as llm:
        facts = llm.engine.runner.facts
        assert facts.kv_dtype == torch.float8_e4m3fn and llm.engine.runner.kv_cache.dtype == torch.float8_e4m3fn
        assert facts.num_kv_blocks == ratio * blocks


def test_bad_values_are_refused():
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of auto, fp8, fp8_e4m3, fp8_e5m2, got 'int8'"):
        EngineConfig(kv_cache_dtype="int8")


def test_served_with_the_openai_client(tiny):
    """``tokenmill serve --kv-cache-dtype fp8``: the completion is the offline fp8 greedy text; /health
    counts the blocks a 2 MiB fp8 cache holds (a quarter of fp32's bytes per token)."""
    from tests.test_server_e2e import Server, openai_client

    prompt = "one two three one two three"
    with LLM(tiny, device="cpu", dtype="float32", kv_cache_dtype="fp8") as llm:
        want = llm.generate([prompt], SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True))[0].text
        cfg = llm.engine.runner.model_cfg
    s = Server("--model", tiny, "--served-model-name", "tiny", "--dtype", "float32", "--kv-cache-dtype", "fp8",
               "--kv-cache-memory", "2MiB", "--max-num-seqs", "256")
    try:
        r = openai_client(s).completions.create(model="tiny", prompt=prompt, max_tokens=24, temperature=0,
                                                extra_body={"ignore_eos": True})
        assert r.choices[0].text == want
        health = json.loads(urllib.request.urlopen(s.url + "/health", timeout=10).read())
        per_block = 2 * cfg.num_layers * 16 * cfg.num_kv_heads * cfg.head_dim  # one byte a value
        assert health["num_kv_blocks"] == (2 << 20) // per_block
        assert "KV cache in float8_e4m3fn" in s.log()
    finally:
        s.close()
