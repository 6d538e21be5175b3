"""AWQ and GPTQ int4 checkpoints made from a dense Hugging Face folder, for machines without a model
hub: every layer linear (a mixture of experts' experts too, not its router) quantized by rounding to
nearest (per output row and group of input columns, min-max, or symmetric about 8), then packed as
AutoAWQ's GEMM layout and AutoGPTQ's QuantLinear pack them (the packers follow theirs loop for loop;
tokenmill's loader, ``engine/quant.py``, reads them independently), with the ``quantization_config``
those write. Accuracy is round-to-nearest's, not
AWQ's or GPTQ's search: for loading, parity tests and speed, not for quality.

    python3 tools/quantize_model.py DENSE_DIR OUT_DIR [--method awq|gptq] [--group-size 128] [--sym]
        [--act-order] [--gptq-v2]

``--method mxfp4`` writes a GPT-OSS folder's experts in MXFP4 instead, as OpenAI ships gpt-oss (``mxfp4_checkpoint``).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
import shutil
import sys
import zlib

import torch
from safetensors.torch import load_file, save_file

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # (run as a script from a checkout)
from kernels.reference import MXFP4_LEVELS  # noqa: E402

AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]  # AutoAWQ's order_map: nibble i of a word holds row 8 c + AWQ_ORDER[i]
# the linears quantized, by their names without ".weight": attention's, the MLP's (Phi-3's fused ones too), and in a
# mixture of experts each expert's (Mixtral's w1, w3, w2) and Qwen2-MoE's shared expert's; not the router
LINEARS = re.compile(r".*\.(self_attn\.(?:q|k|v|o|qkv)_proj|mlp\.(?:gate|up|down|gate_up)_proj|"
                     r"(?:mlp|block_sparse_moe)\.experts\.\d+\.(?:gate_proj|up_proj|down_proj|w1|w2|w3)|"
                     r"mlp\.shared_expert\.(?:gate|up|down)_proj)")


def quantize(w: torch.Tensor, sym: bool, g_idx: torch.Tensor):
    """w (N, K) float32 -> integers (K, N), zeros (groups, N), fp16 scales (groups, N), and the exact
    weights s (q - z) (N, K) float32: per output row and group, asymmetric min-max or symmetric."""
    n, k = w.shape
    groups = int(g_idx.max()) + 1
    scales, zeros = torch.empty(groups, n, dtype=torch.float16), torch.empty(groups, n)
    for g in range(groups):
        cols = w[:, g_idx == g]
        if sym:
            s, z = cols.abs().amax(1) / 7.5, torch.full((n,), 8.0)
        else:
            lo, hi = cols.amin(1).clamp(max=0), cols.amax(1).clamp(min=0)
            s = (hi - lo) / 15
        s = torch.where(s.half() > 0, s, 1.0)  # an all-zero group (or one too small for fp16): any scale
        if not sym:
            z = torch.round(-lo / s.half().float()).clamp(0, 15)
        scales[g], zeros[g] = s.half(), z
    s, z = scales.float()[g_idx].t(), zeros[g_idx].t()  # (N, K)
    ints = torch.clamp(torch.round(w / s + z), 0, 15)
    return ints.t().to(torch.int64), zeros.to(torch.int64), scales, (ints - z) * s


def pack_awq(ints: torch.Tensor) -> torch.Tensor:
    """(R, C) integers -> (R, C / 8) int32, AutoAWQ's WQLinear_GEMM packing."""
    out = torch.zeros(ints.shape[0], ints.shape[1] // 8, dtype=torch.int64)
    for col in range(out.shape[1]):
        for i in range(8):
            out[:, col] |= ints[:, col * 8 + AWQ_ORDER[i]] << (i * 4)
    return _int32(out)


def pack_gptq(ints: torch.Tensor, zeros: torch.Tensor, v1: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """AutoGPTQ's QuantLinear.pack: qweight (K / 8, N), eight input columns to a word in order; qzeros
    (groups, N / 8), stored minus one in the original format (so a zero of 0 wraps to 15: masked to its
    nibble here, where AutoGPTQ's uint32 arithmetic lets it spill into the nibbles above)."""
    qweight = torch.zeros(ints.shape[0] // 8, ints.shape[1], dtype=torch.int64)
    for row in range(qweight.shape[0]):
        for j in range(8):
            qweight[row] |= ints[row * 8 + j] << (4 * j)
    stored = (zeros - 1) & 15 if v1 else zeros
    qzeros = torch.zeros(zeros.shape[0], zeros.shape[1] // 8, dtype=torch.int64)
    for col in range(qzeros.shape[1]):
        for j in range(8):
            qzeros[:, col] |= stored[:, col * 8 + j] << (4 * j)
    return _int32(qweight), _int32(qzeros)


def _int32(t: torch.Tensor) -> torch.Tensor:
    """uint32 words in int64 as the int32 a checkpoint stores (the top bit wraps the sign)."""
    return torch.where(t >= 2**31, t - 2**32, t).to(torch.int32)


FP4 = torch.tensor(MXFP4_LEVELS[:8]) / 2  # FP4 E2M1's magnitudes (0, 0.5, ... 6), a nibble's low 3 bits


def quantize_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w (N, K) -> MXFP4 as OpenAI ships GPT-OSS's experts: blocks (N, K / 32, 16) uint8, values 2i and 2i + 1 of a
    block in the low and high halves of byte i, and scales (N, K / 32) uint8, a power of two's exponent plus 127,
    chosen as ggml's quantizer chooses it (the block's largest magnitude over 4 to 8); each value the nearest."""
    b = w.float().unflatten(-1, (-1, 32))  # (N, G, 32)
    amax = b.abs().amax(-1)
    e = torch.where(amax > 0, torch.floor(torch.log2(amax)) - 2 + 127, torch.zeros_like(amax)).clamp(0, 254)
    scaled = b / torch.ldexp(torch.ones_like(amax), e.int() - 127)[..., None]
    nibbles = ((scaled.abs()[..., None] - FP4).abs().argmin(-1) + 8 * (scaled < 0)).to(torch.uint8)
    return nibbles[..., 0::2] | nibbles[..., 1::2] << 4, e.to(torch.uint8)


def mxfp4_checkpoint(dense: str, out: str) -> str:
    """Write ``out``: ``dense``'s GPT-OSS with its experts in MXFP4 (``*_blocks``, ``*_scales``, and the
    ``quantization_config`` OpenAI's checkpoints carry), the rest as it is."""
    tensors = _copy_without_weights(dense, out)
    for name in [n for n in tensors if n.endswith(("mlp.experts.gate_up_proj", "mlp.experts.down_proj"))]:
        w = tensors.pop(name).transpose(1, 2)  # (E, K, N) x W -> (E, N, K), outputs first
        parts = [quantize_mxfp4(x) for x in w]  # an expert at a time
        tensors[name + "_blocks"] = torch.stack([p[0] for p in parts])
        tensors[name + "_scales"] = torch.stack([p[1] for p in parts])
    save_file(tensors, os.path.join(out, "model.safetensors"))
    write_quantization_config(out, MXFP4_CONFIG)
    return out


def _copy_without_weights(dense: str, out: str) -> dict[str, torch.Tensor]:
    """``dense`` copied to ``out`` but its weights (and a sharded folder's index): its tensors, to write there."""
    shutil.copytree(dense, out)
    for f in glob.glob(os.path.join(out, "*.safetensors*")):
        os.remove(f)
    tensors = {}
    for f in glob.glob(os.path.join(dense, "*.safetensors")):
        tensors.update(load_file(f))
    return tensors


# what OpenAI's gpt-oss folders say of their MXFP4 experts
MXFP4_CONFIG = {"quant_method": "mxfp4", "modules_to_not_convert": [
    "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}


def write_quantization_config(folder: str, q: dict) -> None:
    """Set config.json's ``quantization_config`` in ``folder``."""
    with open(os.path.join(folder, "config.json")) as f:
        cfg = json.load(f)
    cfg["quantization_config"] = q
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(cfg, f)


def quantize_checkpoint(dense: str, out: str, method: str = "awq", group: int = 128, sym: bool = False,
                        act_order: bool = False, v1: bool = True, keep: tuple[str, ...] = (),
                        write_back: bool = False, shared_order: bool = True) -> str:
    """Write ``out``: ``dense``'s model with every layer linear but ``keep``'s quantized (``group`` -1:
    one group per row; ``act_order``: GPTQ's groups over a random permutation of the columns, the same
    for the layers reading one input, as GPTQ's one Hessian per input gives, unless ``shared_order`` is
    false; ``v1``: GPTQ's original format, zero points stored minus one). ``write_back``: also overwrite
    ``dense``'s linears with the exact weights ``out`` holds, a float32 reference for transformers."""
    tensors = _copy_without_weights(dense, out)
    quantized = {}
    for name, w in list(tensors.items()):
        prefix = name.removesuffix(".weight")
        if not name.endswith(".weight") or not LINEARS.fullmatch(prefix) or prefix.endswith(keep):
            quantized[name] = w
            continue
        k = w.shape[1]
        size = group if group > 0 else k
        g_idx = torch.arange(k) // size
        if act_order:  # q|k|v read one input, gate|up another
            reads = prefix.replace("k_proj", "q_proj").replace("v_proj", "q_proj").replace("up_proj", "gate_proj") \
                .replace(".w3", ".w1")
            seed = zlib.crc32((reads if shared_order else prefix).encode())
            g_idx = g_idx[torch.randperm(k, generator=torch.Generator().manual_seed(seed))]
        ints, zeros, scales, exact = quantize(w.float(), sym, g_idx)
        tensors[name] = exact.contiguous()
        if method == "awq":
            quantized |= {f"{prefix}.qweight": pack_awq(ints), f"{prefix}.qzeros": pack_awq(zeros),
                          f"{prefix}.scales": scales}
        else:
            qweight, qzeros = pack_gptq(ints, zeros, v1)
            quantized |= {f"{prefix}.qweight": qweight, f"{prefix}.qzeros": qzeros, f"{prefix}.scales": scales,
                          f"{prefix}.g_idx": g_idx.to(torch.int32)}
    if write_back:
        save_file(tensors, os.path.join(dense, "model.safetensors"))
    save_file(quantized, os.path.join(out, "model.safetensors"))
    write_quantization_config(out, (
        {"quant_method": "awq", "bits": 4, "group_size": group, "zero_point": True, "version": "gemm",
         "modules_to_not_convert": list(keep) or None} if method == "awq" else
        {"quant_method": "gptq", "bits": 4, "group_size": group, "sym": sym, "desc_act": act_order,
         "checkpoint_format": "gptq" if v1 else "gptq_v2"}))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("dense_dir")
    p.add_argument("out_dir")
    p.add_argument("--method", choices=("awq", "gptq", "mxfp4"), default="awq",
                   help="mxfp4: a GPT-OSS folder's experts in MXFP4, as OpenAI ships them (the other flags unused)")
    p.add_argument("--group-size", type=int, default=128, help="input columns per group; -1: one per row")
    p.add_argument("--sym", action="store_true", help="symmetric (zero point 8), as GPTQ's sym=True")
    p.add_argument("--act-order", action="store_true", help="GPTQ desc_act: groups over permuted columns")
    p.add_argument("--gptq-v2", action="store_true", help="GPTQ checkpoint_format gptq_v2 (zeros as they are)")
    a = p.parse_args()
    if a.method == "mxfp4":
        print(mxfp4_checkpoint(a.dense_dir, a.out_dir))
        return
    print(quantize_checkpoint(a.dense_dir, a.out_dir, a.method, a.group_size, a.sym, a.act_order, not a.gptq_v2))


if __name__ == "__main__":
    main()
