"""``--dtype auto``: bfloat16 on CUDA and on CPUs with native bf16, float32 elsewhere, logged;
and the default model still answers sensibly in bf16."""

from __future__ import annotations

import logging

import pytest
import torch

from engine import LLM, SamplingParams, runtime
from engine.config import EngineConfig


@pytest.mark.parametrize("native,want", [(True, torch.bfloat16), (False, torch.float32)])
def test_auto_picks_bf16_only_where_the_cpu_has_it(monkeypatch, caplog, native, want):
    monkeypatch.setattr(runtime, "cpu_has_native_bf16", lambda: native)
    with caplog.at_level(logging.INFO, logger="tokenmill.engine"):
        assert runtime.pick_dtype(EngineConfig(dtype="auto"), torch.device("cpu")) == want
    assert f"dtype auto: {str(want).removeprefix('torch.')}" in caplog.text
    assert runtime.pick_dtype(EngineConfig(dtype="float32"), torch.device("cpu")) == torch.float32
    assert runtime.pick_dtype(EngineConfig(dtype="auto"), torch.device("cuda")) == torch.bfloat16


def test_cpu_bf16_probe_answers():
    assert runtime.cpu_has_native_bf16() in (True, False)


@pytest.mark.skipif(not runtime.cpu_has_native_bf16(), reason="no native bf16 on this CPU: auto picks float32 here, "
                    "and emulated bf16 matmuls are ~30x slower than float32 at batch 1")
def test_default_model_knows_paris_in_bf16(default_gguf):
    llm = LLM(dtype="bfloat16")
    chat = llm.tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                             add_generation_prompt=True, tokenize=False)
    answer = llm.generate(chat, SamplingParams(max_tokens=24, temperature=0.0))[0]
    assert "Paris" in answer.text
