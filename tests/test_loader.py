"""Loading: parameters are made in the model's dtype, so a bf16 load never holds float32 weights."""

from __future__ import annotations

import glob

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch.utils._python_dispatch import TorchDispatchMode

from engine.loader import build_model, load_model_config
from tests.conftest import make_tiny_model


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
