"""A random LoRA adapter for a model folder, saved as PEFT saves one (``adapter_config.json``,
``adapter_model.safetensors``), so that adapters can be served and benchmarked without a hub or a
training run: A ~ N(0, 1/in), B ~ N(0, scale^2) (B nonzero, unlike PEFT's initialisation, so that the
adapter changes the output).

    python3 tools/random_lora.py /tmp/smollm2 /tmp/smollm2-lora-a [--rank 16] [--seed 1] [--modules q_proj,v_proj]
"""

from __future__ import annotations

import argparse
import json
import os

import torch

MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def make_lora(model_dir: str, out_dir: str, seed: int, r: int = 8, alpha: float = 16.0,
              modules: tuple[str, ...] = MODULES, scale: float = 0.5, **config) -> str:
    """Write the adapter into ``out_dir`` (``config``: more of ``adapter_config.json``); returns ``out_dir``."""
    from safetensors.torch import save_file

    with open(os.path.join(model_dir, "config.json")) as f:
        cfg = json.load(f)
    h, inter, heads = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_attention_heads"]
    d = cfg.get("head_dim") or h // heads
    kv = cfg["num_key_value_heads"] * d
    shapes = {"q_proj": (heads * d, h), "k_proj": (kv, h), "v_proj": (kv, h), "o_proj": (h, heads * d),
              "gate_proj": (inter, h), "up_proj": (inter, h), "down_proj": (h, inter)}
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for i in range(cfg["num_hidden_layers"]):
        for m in modules:
            out, inp = shapes[m]
            key = f"base_model.model.model.layers.{i}.{'self_attn' if m in MODULES[:4] else 'mlp'}.{m}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(r, inp, generator=g) / inp ** 0.5
            tensors[f"{key}.lora_B.weight"] = torch.randn(out, r, generator=g) * scale
    os.makedirs(out_dir, exist_ok=True)
    save_file(tensors, os.path.join(out_dir, "adapter_model.safetensors"))
    with open(os.path.join(out_dir, "adapter_config.json"), "w") as f:
        json.dump({"peft_type": "LORA", "r": r, "lora_alpha": alpha, "target_modules": list(modules),
                   "bias": "none", "base_model_name_or_path": model_dir, "task_type": "CAUSAL_LM",
                   "lora_dropout": 0.0, **config}, f, indent=1)
    return out_dir


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model", help="the model folder (its config.json gives the shapes)")
    p.add_argument("out", help="the adapter folder to write")
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--alpha", type=float, default=None, help="lora_alpha (default: twice the rank)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--modules", default=",".join(MODULES), help="the projections it adapts, comma-separated")
    args = p.parse_args(argv)
    modules = tuple(m for m in args.modules.split(",") if m)
    if not modules or set(modules) - set(MODULES):
        p.error(f"--modules: some of {', '.join(MODULES)}")
    make_lora(args.model, args.out, args.seed, args.rank, args.alpha or 2.0 * args.rank, modules, scale=0.02)
    print(f"{args.out}: rank {args.rank} on {', '.join(modules)}")


if __name__ == "__main__":
    main()
