"""``tools/bench_offline.py`` end to end on a tiny random-weight model: its JSON line carries the step
figures (decode step against the memory floor, the host's share of a step) with sane values."""

from __future__ import annotations

import json
import os

import pytest
import torch

from tools import bench_offline
from tools.random_model import build


@pytest.fixture(autouse=True)
def quick_ceiling(monkeypatch):
    """The FLOP ceiling timed over 5 ms a matmul, not 50 (5 of a run's 6 s on these tiny models; only > 0 is
    checked here)."""
    monkeypatch.setattr(bench_offline, "MATMUL_MIN_SECONDS", 0.005)


TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=bench_offline.TOKEN_ID_HIGH + 256, max_position_embeddings=512)


def test_bench_offline_reports_decode_floor_and_host_share(tmp_path, capsys):
    path = build(str(tmp_path), "llama", torch.float32, **TINY)
    bench_offline.main(["--model", path, "--num-requests", "3", "--max-num-seqs", "4"])
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])

    longest = max(r.max_tokens for r in bench_offline.make_workload(3, seed=0))
    # every prompt fits the first step's token budget: one prefill step, then decode-only steps
    assert summary["num_steps"] == longest
    assert summary["num_decode_steps"] == longest - 1
    assert summary["tokenmill_out_tok_s"] > 0
    assert 0 < summary["host_share"] < 1
    assert summary["device_idle_share"] is None  # (CUDA only: its events time the device)
    assert summary["mem_bandwidth_gb_s"] > 0
    assert summary["decode_step_ms"] > 0 and summary["decode_floor_ms"] > 0
    assert summary["decode_vs_floor"] > 0
    # every weight once (fp32, as in the checkpoint) but the input embedding: not tied, a step reads 3 rows
    read = os.path.getsize(os.path.join(path, "model.safetensors")) - 4 * TINY["vocab_size"] * TINY["hidden_size"]
    assert abs(summary["weight_bytes"] - read) < 0.01 * read


def test_long_prompts_and_a_model_without_its_window(tmp_path, capsys):
    """--prompt-len and --hf-overrides: a sliding window's decode floor counts its window's KV only."""
    path = build(str(tmp_path), "gemma3_text", torch.float32, **TINY, head_dim=16, sliding_window=32,
                 sliding_window_pattern=2)
    floors = {}
    for overrides in (None, '{"sliding_window": null}'):
        bench_offline.main(["--model", path, "--num-requests", "2", "--prompt-len", "300"]
                           + (["--hf-overrides", overrides] if overrides else []))
        summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
        assert summary["prompt_len_range"] == [300, 300] and summary["prompt_tokens"] == 600
        floors[overrides] = summary["decode_floor_ms"] * summary["mem_bandwidth_gb_s"] * 1e6  # its bytes
    assert summary["hf_overrides"] == {"sliding_window": None}
    # half the layers read 32 keys, not 300 and more: 2 sequences x ~330 keys x 256 bytes fewer (of ~2.8 MB)
    assert 0.5 < (floors['{"sliding_window": null}'] - floors[None]) / (2 * 300 * 256) < 1.5


def test_kv_memory_and_the_window_pool_flags(tmp_path, capsys):
    """--kv-cache-memory and --disable-hybrid-kv-cache-manager: with a window pool the full layer gets the
    memory the sliding one no longer keeps; the JSON line names both pools and the preemptions."""
    path = build(str(tmp_path), "gemma3_text", torch.float32, **TINY, head_dim=16, sliding_window=32,
                 sliding_window_pattern=2)  # layer 0 sliding, layer 1 full: 4 KiB a layer's block (fp32)
    pools = {}
    for flag in ([], ["--disable-hybrid-kv-cache-manager"]):
        bench_offline.main(["--model", path, "--num-requests", "2", "--prompt-len", "100", "--output-len", "5",
                            "--max-num-seqs", "8",
                            "--max-num-batched-tokens", "256", "--kv-cache-memory", "1M", *flag])
        summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
        assert summary["kv_cache_memory"] == 2**20 and summary["preemptions"] == 0
        assert summary["output_len_range"] == [5, 5] and summary["output_tokens"] == 10
        pools[bool(flag)] = summary["kv_blocks"], summary["kv_window_blocks"]
    # 256 layer-blocks: 128 each without; with, the sliding layer's 8 x (2 + 2 + 1) + 256 / 16 = 56
    assert pools == {True: (128, 0), False: (256 - 56, 56)}


def test_lora_adapters_from_random_lora(tmp_path, capsys):
    """``tools/random_lora.py`` writes an adapter for a model folder; ``--lora-modules`` runs every request with
    one (request i with adapter i mod N), which the step report counts among the weights read."""
    from tools import random_lora

    path = build(str(tmp_path), "llama", torch.float32, **TINY)
    adapters = [str(tmp_path / f"lora{i}") for i in range(2)]
    for i, out in enumerate(adapters):
        random_lora.main([path, out, "--rank", "8", "--seed", str(i), "--modules", "q_proj,v_proj,down_proj"])
    assert "rank 8 on q_proj, v_proj, down_proj" in capsys.readouterr().out
    bench_offline.main(["--model", path, "--num-requests", "3", "--max-num-seqs", "4"])
    plain = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    bench_offline.main(["--model", path, "--num-requests", "3", "--max-num-seqs", "4",
                        "--lora-modules", *(f"a{i}={p}" for i, p in enumerate(adapters))])
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["tokenmill_out_tok_s"] > 0
    # two slots of q|k|v (3 parts), v's neighbours zero, and down: (64 + 128) * 2 * 3 * 8 and (128 + 64) * 2 * 8
    extra = 4 * 2 * TINY["num_hidden_layers"] * ((64 + 128) * 3 * 8 + (128 + 64) * 8)
    assert summary["weight_bytes"] - plain["weight_bytes"] == extra


def test_speculative_decoding_counts_its_drafts(tmp_path, capsys):
    """``--speculative-config``: the JSON line counts drafts and those kept; steps with drafts are not decode-only
    steps (their floor is not one token's); the tokens are checked against the workload's lengths as ever."""
    path = build(str(tmp_path), "llama", torch.float32, **TINY)
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 2}
    bench_offline.main(["--model", path, "--num-requests", "3", "--max-num-seqs", "4", "--speculative-config",
                        json.dumps(spec)])
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["speculative_config"] == spec
    assert summary["draft_tokens"] >= summary["accepted_tokens"] >= 0 and summary["draft_tokens"] > 0
    longest = max(r.max_tokens for r in bench_offline.make_workload(3, seed=0))
    assert summary["num_steps"] <= longest  # drafts kept save steps, never add one
