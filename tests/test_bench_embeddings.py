"""``tools/bench_embeddings.py`` end to end on a tiny random-weight model: tokenmill's vectors equal
transformers' padded batches (fp32), and the stream's gaps are reported with and without embeddings."""

from __future__ import annotations

import json

import torch

from tools import bench_embeddings
from tools.random_model import build

TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=10256, max_position_embeddings=1024)


def test_bench_embeddings_agrees_with_transformers(tmp_path, capsys):
    path = build(str(tmp_path), "qwen3", torch.float32, **TINY)
    bench_embeddings.main(["--model", path, "--num-docs", "6", "--min-len", "8", "--max-len", "80",
                           "--hf-batch-size", "4", "--stream-tokens", "8"])
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["num_docs"] == 6 and summary["tokenmill_tok_s"] > 0 and summary["hf_tok_s"] > 0
    assert summary["max_abs_diff"] < 1e-4  # right-padded, masked batches pool the same vectors
    assert set(summary["stream_gap_ms"]) == {"alone", "beside_embeddings"}
    assert all(0 < median <= worst for median, worst in summary["stream_gap_ms"].values())


def test_bench_embeddings_on_an_encoder(tmp_path, capsys):
    """A BERT (``random_model``'s bge-small kind, smaller): its own length, its [CLS] pooling on both sides, and
    no stream (an encoder generates nothing)."""
    path = build(str(tmp_path), "bert", torch.float32, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, vocab_size=10256, max_position_embeddings=128)
    bench_embeddings.main(["--model", path, "--num-docs", "6", "--min-len", "8", "--max-len", "120",
                           "--hf-batch-size", "4"])
    out = capsys.readouterr().out
    summary = json.loads(out.strip().splitlines()[-1])
    assert "pooling cls" in out and summary["num_docs"] == 6 and summary["max_abs_diff"] < 1e-5
    assert "stream_gap_ms" not in summary
