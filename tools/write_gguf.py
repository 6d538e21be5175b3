"""A GGUF file from a model folder, as llama.cpp's converter and quantizer write them, for machines
without llama.cpp or a model hub: benchmarks of GGUF loading and of the CPU's packed kernels, and tests.

    python3 tools/write_gguf.py /tmp/s17 /tmp/s17/q4_k_m.gguf --type Q4_K_M

Tensors in GGUF names; llama's q/k rows permuted for its interleaved RoPE; a mixture of experts' parts
stacked per layer; the matrices in one type, or in a llama.cpp mix (``MIXES``: Q4_K_M keeps v and down
in Q6_K in some layers, the embeddings in Q6_K). The K-quants are written by ``quantize`` (gguf's
Python package reads them but does not write them): round to nearest with one scale per sub-block, not
llama.cpp's search for the best scales (the layouts are what matters here, not the quality). No
vocabulary unless given (serve such a file with ``--tokenizer FOLDER``).
"""

from __future__ import annotations

import argparse
import glob
import os
import re
import sys
from collections.abc import Callable

import gguf
import numpy as np
from gguf import GGMLQuantizationType
from gguf.quants import quantize as gguf_quantize

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from engine.loader import load_model_config  # noqa: E402

# the GGUF architecture of each model_type this writer knows
ARCH = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "qwen2_moe": "qwen2moe",
        "qwen3_moe": "qwen3moe", "mixtral": "llama", "phi3": "phi3", "gemma": "gemma", "gemma2": "gemma2",
        "gemma3_text": "gemma3", "granite": "granite", "olmo2": "olmo2", "olmo3": "olmo2", "gpt_oss": "gpt-oss"}


def _more_bits(i: int, n: int) -> bool:
    """llama.cpp's use_more_bits: the first and last eighth of the layers and every third between."""
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def mix(kind: str, num_layers: int, tied: bool) -> Callable[[str], str | None]:
    """A tensor's GGUF name -> its type in llama.cpp's ``kind`` file (Q4_K_M, Q5_K_M: v and down in Q6_K
    where ``_more_bits``, the output in Q6_K, and the embeddings where they are the output too (``tied``);
    other kinds: every matrix in that type)."""
    base = {"Q4_K_M": "Q4_K", "Q5_K_M": "Q5_K"}.get(kind)

    def type_of(name: str) -> str | None:
        if base is None:
            return kind if name.startswith(("blk.", "token_embd.", "output.")) else None
        if name == "output.weight" or tied and name == "token_embd.weight":
            return "Q6_K"
        if name == "token_embd.weight":
            return base
        if not name.startswith("blk."):
            return None
        more = any(p in name for p in ("attn_v.", "ffn_down")) and _more_bits(int(name.split(".")[1]), num_layers)
        return "Q6_K" if more else base

    return type_of


# what llama.cpp writes instead where a row is not whole super-blocks of 256 (llama-quant.cpp)
FALLBACK = {"Q2_K": "IQ4_NL", "Q3_K": "IQ4_NL", "IQ4_XS": "IQ4_NL", "Q4_K": "Q5_0", "Q5_K": "Q5_1", "Q6_K": "Q8_0"}


def block_type(kind: str, k: int) -> str | None:
    """The type a matrix of rows of ``k`` gets for ``kind`` (None: kept as floats)."""
    if kind in FALLBACK and k % 256:
        kind = FALLBACK[kind]
    return kind if k % 32 == 0 else None


def quantize(t: np.ndarray, kind: str) -> np.ndarray:
    """Rows of ``t`` (..., K) as ``kind`` blocks: uint8 (..., K / block weights * block bytes)."""
    own = {"Q2_K": _q2_k, "Q3_K": _q3_k, "Q4_K": _q45_k, "Q5_K": lambda x: _q45_k(x, 5), "Q6_K": _q6_k,
           "IQ4_NL": _iq4_nl, "IQ4_XS": _iq4_xs}
    if kind not in own:
        return gguf_quantize(t.astype(np.float32), GGMLQuantizationType[kind])
    weights = 32 if kind == "IQ4_NL" else 256
    if t.shape[-1] % weights:
        raise ValueError(f"{kind} needs rows of whole {weights}-weight blocks, got {t.shape[-1]} (see block_type)")
    x = t.astype(np.float32).reshape(-1, weights)
    return own[kind](x).reshape(*t.shape[:-1], -1)


def _f16(a: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """a (B, 1) as fp16 bytes (B, 2), and back as float32."""
    h = a.astype(np.float16)
    return h.view(np.uint8).reshape(-1, 2), h.astype(np.float32)


def _ratio(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return np.divide(a, b, out=np.zeros(np.broadcast(a, b).shape, np.float32), where=b != 0)


def _q45_k(x: np.ndarray, bits: int = 4) -> np.ndarray:
    """Q4_K / Q5_K: x (B, 256) -> (B, 144 / 176): d, dmin, 12 bytes of 6-bit scales and minimums,
    (Q5_K) 32 bytes of fifth bits, 128 bytes of 4-bit halves."""
    top = (1 << bits) - 1
    sub = x.reshape(-1, 8, 32)
    lo = np.minimum(sub.min(-1), 0)
    scale, low = (sub.max(-1) - lo) / top, -lo  # (B, 8): x = scale q - low
    d_bytes, d = _f16(scale.max(-1, keepdims=True) / 63)
    m_bytes, dmin = _f16(low.max(-1, keepdims=True) / 63)
    sc = np.clip(np.round(_ratio(scale, d)), 0, 63).astype(np.uint8)
    m = np.clip(np.round(_ratio(low, dmin)), 0, 63).astype(np.uint8)
    q = np.clip(np.round(_ratio(sub + (dmin * m)[..., None], (d * sc)[..., None])), 0, top).astype(np.uint8)
    scales = np.concatenate([sc[:, :4] | (sc[:, 4:] >> 4) << 6, m[:, :4] | (m[:, 4:] >> 4) << 6,
                             (sc[:, 4:] & 15) | (m[:, 4:] & 15) << 4], axis=1)
    qs = (q[:, 0::2] & 15) | (q[:, 1::2] & 15) << 4  # (B, 4, 32): sub-blocks 2i and 2i + 1 share bytes
    parts = [d_bytes, m_bytes, scales]
    if bits == 5:
        parts.append(sum((q[:, g] >> 4) << g for g in range(8)).astype(np.uint8))
    return np.concatenate(parts + [qs.reshape(-1, 128)], axis=1)


def _q6_k(x: np.ndarray) -> np.ndarray:
    """Q6_K: x (B, 256) -> (B, 210): 128 bytes of low 4 bits, 64 of high 2 bits, 16 int8 scales, d."""
    groups = x.reshape(-1, 16, 16)
    scale = np.abs(groups).max(-1) / 31  # (B, 16), x = scale (q - 32)
    d_bytes, d = _f16(scale.max(-1, keepdims=True) / 127)
    sc = np.clip(np.round(_ratio(scale, d)), -128, 127).astype(np.int8)
    q = np.clip(np.round(_ratio(groups, (d * sc)[..., None])) + 32, 0, 63).astype(np.uint8)
    q = q.reshape(-1, 2, 4, 32)  # (B, half, r, l): sub-block 4 half + r
    ql = np.concatenate([(q[:, :, 0] & 15) | (q[:, :, 2] & 15) << 4, (q[:, :, 1] & 15) | (q[:, :, 3] & 15) << 4],
                        axis=2)  # (B, half, 64)
    qh = sum((q[:, :, r] >> 4) << (2 * r) for r in range(4)).astype(np.uint8)  # (B, half, 32)
    return np.concatenate([ql.reshape(-1, 128), qh.reshape(-1, 64), sc.view(np.uint8), d_bytes], axis=1)



def _pack_2_bits(q: np.ndarray) -> np.ndarray:
    """(B, 8, 32) 2-bit values -> (B, 64): 32-weight piece 4h + s in bytes 32h + l, bits 2s."""
    q = q.reshape(-1, 2, 4, 32).astype(np.uint8)
    return sum(q[:, :, s] << (2 * s) for s in range(4)).astype(np.uint8).reshape(-1, 64)


def _q2_k(x: np.ndarray) -> np.ndarray:
    """Q2_K: x (B, 256) -> (B, 84): 4-bit scales and minimums per 16 weights, 2-bit weights, d, dmin."""
    groups = x.reshape(-1, 16, 16)
    lo = np.minimum(groups.min(-1), 0)
    scale, low = (groups.max(-1) - lo) / 3, -lo
    d_bytes, d = _f16(scale.max(-1, keepdims=True) / 15)
    m_bytes, dmin = _f16(low.max(-1, keepdims=True) / 15)
    sc = np.clip(np.round(_ratio(scale, d)), 0, 15).astype(np.uint8)
    m = np.clip(np.round(_ratio(low, dmin)), 0, 15).astype(np.uint8)
    q = np.clip(np.round(_ratio(groups + (dmin * m)[..., None], (d * sc)[..., None])), 0, 3)
    return np.concatenate([sc | m << 4, _pack_2_bits(q.reshape(-1, 8, 32)), d_bytes, m_bytes], axis=1)


def _q3_k(x: np.ndarray) -> np.ndarray:
    """Q3_K: x (B, 256) -> (B, 110): high-bit mask, 2-bit weights, 6-bit scales (less 32), d; weight
    d sc (q - 4), q 0..7, its bit 2 in the mask."""
    groups = x.reshape(-1, 16, 16)
    peak = np.take_along_axis(groups, np.abs(groups).argmax(-1)[..., None], -1)[..., 0]
    scale = peak / -4  # the value of largest magnitude becomes -4
    d_bytes, d = _f16(np.abs(scale).max(-1, keepdims=True) / 31)
    sc = np.clip(np.round(_ratio(scale, d)), -32, 31).astype(np.int8)
    q = (np.clip(np.round(_ratio(groups, (d * sc)[..., None])), -4, 3) + 4).astype(np.uint8).reshape(-1, 8, 32)
    mask = sum((q[:, p] >> 2) << p for p in range(8)).astype(np.uint8)  # (B, 32): bit p of byte l
    u = (sc.astype(np.int16) + 32).astype(np.uint8)  # (B, 16), 6 bits
    scales = np.concatenate([(u[:, :8] & 15) | (u[:, 8:] & 15) << 4,
                             sum(((u[:, 4 * j:4 * j + 4] >> 4) & 3) << (2 * j) for j in range(4)).astype(np.uint8)],
                            axis=1)
    return np.concatenate([mask, _pack_2_bits(q & 3), scales, d_bytes], axis=1)


_LEVELS = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], np.float32)


def _nearest_level(x: np.ndarray, d: np.ndarray) -> np.ndarray:
    """The index of the level nearest x / d, for x (..., n) and d (..., 1)."""
    return np.abs(_ratio(x, d)[..., None] - _LEVELS).argmin(-1).astype(np.uint8)


def _iq4_nl(x: np.ndarray) -> np.ndarray:
    """IQ4_NL: x (B, 32) -> (B, 18): d, then 4-bit indices into the levels (Q4_0's layout)."""
    peak = np.take_along_axis(x, np.abs(x).argmax(-1)[:, None], -1)
    d_bytes, d = _f16(peak / -127)
    q = _nearest_level(x, d)
    return np.concatenate([d_bytes, q[:, :16] | q[:, 16:] << 4], axis=1)


def _iq4_xs(x: np.ndarray) -> np.ndarray:
    """IQ4_XS: x (B, 256) -> (B, 136): d, 2 high and 4 low bits of each 32 weights' scale (less 32), then
    each 32 weights' indices as IQ4_NL's."""
    sub = x.reshape(-1, 8, 32)
    peak = np.take_along_axis(sub, np.abs(sub).argmax(-1)[..., None], -1)[..., 0]
    scale = peak / -127
    d_bytes, d = _f16(np.abs(scale).max(-1, keepdims=True) / 31)
    ls = (np.clip(np.round(_ratio(scale, d)), -32, 31) + 32).astype(np.uint16)  # (B, 8)
    q = _nearest_level(sub, (d * (ls.astype(np.float32) - 32))[..., None])  # (B, 8, 32)
    high = sum(((ls[:, i] >> 4) & 3) << (2 * i) for i in range(8)).astype(np.uint16)
    low = ((ls[:, 0::2] & 15) | (ls[:, 1::2] & 15) << 4).astype(np.uint8)
    return np.concatenate([d_bytes, high.view(np.uint8).reshape(-1, 2), low,
                           (q[..., :16] | q[..., 16:] << 4).reshape(-1, 128)], axis=1)

def write_gguf(folder: str, out: str, arch: str = "qwen3", matrices_as: str | Callable | None = None,
                widths: bool = True, vocab: dict | None = None, extra: dict | None = None) -> None:
    """A tiny model folder as llama.cpp's converter writes it: float32 tensors, GGUF names, a mixture
    of experts' parts stacked per layer (E, ...), the layers' matrices in ``matrices_as`` (a GGUF type:
    "Q8_0", or a function of a tensor's GGUF name to its type or None) if given, and their widths in the metadata (``widths``; converters before mid-2024 left them
    out); llama's q/k rows permuted for its interleaved RoPE (Qwen's is the rotate-half one llama.cpp
    calls NEOX: no permutation). ``vocab``: a SentencePiece vocabulary to write too (``tokens``,
    ``types``, ``bos``, ``eos``, ``chat_template``); ``extra``: more ``rope.scaling.*`` floats (YaRN's)."""
    from safetensors.torch import load_file

    cfg = load_model_config(folder)
    if cfg.gpt_oss and cfg.moe.swiglu != (1.702, 7.0):  # (llama.cpp fixes them for the architecture)
        raise ValueError(f"a GPT-OSS GGUF file holds no SwiGLU alpha and limit: llama.cpp reads 1.702 and 7.0, this "
                         f"model has {cfg.moe.swiglu}")
    w = gguf.GGUFWriter(out, arch)
    values = [("context_length", 1024), ("embedding_length", cfg.hidden_size),
              ("feed_forward_length", cfg.intermediate_size), ("block_count", cfg.num_layers),
              ("attention.head_count", cfg.num_heads), ("attention.head_count_kv", cfg.num_kv_heads),
              ("attention.key_length", cfg.head_dim), ("vocab_size", cfg.vocab_size),
              ("rope.dimension_count", cfg.rotary_dim or cfg.head_dim)]
    if cfg.moe:
        values += [("expert_count", cfg.moe.num_experts), ("expert_used_count", cfg.moe.top_k)]
        if widths:
            values.append(("expert_feed_forward_length", cfg.moe.intermediate_size))
        if cfg.moe.shared_intermediate_size and widths:
            values.append(("expert_shared_feed_forward_length", cfg.moe.shared_intermediate_size))
    for key, value in values:
        w.add_uint32(f"{arch}.{key}", value)
    w.add_float32(f"{arch}.rope.freq_base", cfg.rope_theta)
    w.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", cfg.rms_norm_eps)
    if cfg.sliding_window:
        w.add_uint32(f"{arch}.attention.sliding_window", cfg.sliding_window)
    for key, cap in (("attn_logit_softcapping", cfg.attn_softcap), ("final_logit_softcapping", cfg.final_softcap)):
        if cap:
            w.add_float32(f"{arch}.{key}", cap)
    if arch == "granite":  # its scales
        for key, value in (("embedding_scale", cfg.embedding_multiplier), ("residual_scale", cfg.residual_multiplier),
                           ("attention.scale", cfg.attn_scale), ("logit_scale", cfg.logits_scaling)):
            w.add_float32(f"{arch}.{key}", value)
    if (cfg.rope_scaling or {}).get("rope_type") in ("linear", "yarn"):
        w.add_string(f"{arch}.rope.scaling.type", cfg.rope_scaling["rope_type"])
        w.add_float32(f"{arch}.rope.scaling.factor", cfg.rope_scaling["factor"])
    if (cfg.rope_scaling or {}).get("rope_type") == "yarn":  # as llama.cpp's converter writes Qwen's
        w.add_uint32(f"{arch}.rope.scaling.original_context_length",
                     cfg.rope_scaling["original_max_position_embeddings"])
        for key, value in (extra or {}).items():
            w.add_float32(f"{arch}.rope.scaling.{key}", value)
    names = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}
    layer = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
             "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
             "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
             "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "mlp.gate": "ffn_gate_inp",
             "mlp.shared_expert_gate": "ffn_gate_inp_shexp", "mlp.shared_expert.gate_proj": "ffn_gate_shexp",
             "mlp.shared_expert.up_proj": "ffn_up_shexp", "mlp.shared_expert.down_proj": "ffn_down_shexp",
             "block_sparse_moe.gate": "ffn_gate_inp", "self_attn.qkv_proj": "attn_qkv", "mlp.gate_up_proj": "ffn_up"}
    if cfg.gemma >= 2 or cfg.olmo:  # norms of each sublayer's output too (OLMo's: only those)
        layer |= {"post_attention_layernorm": "post_attention_norm", "pre_feedforward_layernorm": "ffn_norm",
                  "post_feedforward_layernorm": "post_ffw_norm"}
    rope = cfg.rope_scaling or {}
    if rope.get("rope_type") == "longrope":  # Phi-3.5's: the factors as tensors
        w.add_uint32(f"{arch}.rope.scaling.original_context_length", rope["original_max_position_embeddings"])
        w.add_float32(f"{arch}.rope.scaling.attn_factor", rope["attention_factor"])
        for kind in ("short", "long"):
            w.add_tensor(f"rope_factors_{kind}.weight", np.array(rope[f"{kind}_factor"], dtype=np.float32))
    experts: dict[str, dict[int, np.ndarray]] = {}
    tensors = {}
    for file in glob.glob(f"{folder}/*.safetensors"):
        tensors.update(load_file(file))
    if cfg.gpt_oss:
        tensors = _widen_mxfp4(tensors)
    for name, t in tensors.items():
        t = t.float().numpy()
        if arch == "gpt-oss" and (own := _gpt_oss(name, t)) is not None:
            for gguf_name, part in own:
                as_type = matrices_as(gguf_name) if callable(matrices_as) else matrices_as
                add_matrix(w, gguf_name, np.ascontiguousarray(part), as_type if part.ndim > 2 else None)
            continue
        if cfg.gemma and name.endswith("norm.weight"):
            t = t + 1  # (llama.cpp stores Gemma's norms as 1 + w)
        if arch in ("llama", "granite") and name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = cfg.num_heads if "q_proj" in name else cfg.num_kv_heads
            t = t.reshape(heads, 2, t.shape[0] // heads // 2, -1).swapaxes(1, 2).reshape(t.shape)
        if name not in names:
            _, _, i, sub = name.split(".", 3)
            sub, kind = sub.rsplit(".", 1)
            if ".experts." in sub:  # Qwen's experts.E.up_proj, Mixtral's experts.E.w3
                _, e, part = sub.rsplit(".", 2)
                part = {"w1": "gate", "w3": "up", "w2": "down"}.get(part, part.removesuffix("_proj"))
                experts.setdefault(f"blk.{i}.ffn_{part}_exps.weight", {})[int(e)] = t
                continue
            names[name] = f"blk.{i}.{layer[sub]}.{kind}"
        if names[name].endswith("ffn_gate_inp_shexp.weight"):
            t = t.reshape(-1)  # llama.cpp keeps the shared expert's gate as a vector
        as_type = matrices_as(names[name]) if callable(matrices_as) else matrices_as
        add_matrix(w, names[name], t, as_type if callable(matrices_as) or names[name].startswith("blk.") else None)
    for name, parts in experts.items():
        add_matrix(w, name, np.stack([parts[e] for e in sorted(parts)]), matrices_as(name) if callable(matrices_as)
             else matrices_as)
    if vocab:
        w.add_tokenizer_model("llama")
        w.add_token_list(vocab["tokens"])
        w.add_token_scores([0.0] * len(vocab["tokens"]))
        w.add_token_types(vocab["types"])
        w.add_bos_token_id(vocab["bos"])
        w.add_eos_token_id(vocab["eos"])
        w.add_chat_template(vocab["chat_template"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _widen_mxfp4(tensors: dict) -> dict:
    """An MXFP4 folder's experts (as OpenAI ships gpt-oss) as a bf16 folder holds them, (E, K, N), exactly; a
    ``matrices_as`` of MXFP4 writes the same values back (each block's scale and FP4 values recur)."""
    import torch

    from engine.quant import mxfp4_to_float

    out = {}
    for name, t in tensors.items():
        if name.endswith("_blocks"):
            base = name.removesuffix("_blocks")
            out[base] = mxfp4_to_float(t, tensors[base + "_scales"], torch.float32).transpose(1, 2)
        elif not name.endswith("_scales"):
            out[name] = t
    return out


def _gpt_oss(name: str, t: np.ndarray) -> list[tuple[str, np.ndarray]] | None:
    """GPT-OSS's own tensors as llama.cpp's converter writes them (None: a tensor named as other models'): its
    sinks, router and sublayer norm; its experts' gate|up split (their rows interleaved in the folder) and every
    part turned outputs-first, (E, N, K), their biases split alike."""
    m = re.fullmatch(r"model\.layers\.(\d+)\.(.+)", name)
    if not m:
        return None
    blk, sub = f"blk.{m[1]}", m[2]
    if sub == "self_attn.sinks":
        return [(f"{blk}.attn_sinks.weight", t)]
    if sub.startswith("mlp.router."):
        return [(f"{blk}.ffn_gate_inp.{sub.rpartition('.')[2]}", t)]
    if sub == "post_attention_layernorm.weight":
        return [(f"{blk}.post_attention_norm.weight", t)]
    if sub == "mlp.experts.gate_up_proj":  # (E, K, 2N), x W
        t = t.transpose(0, 2, 1)
        return [(f"{blk}.ffn_gate_exps.weight", t[:, 0::2]), (f"{blk}.ffn_up_exps.weight", t[:, 1::2])]
    if sub == "mlp.experts.gate_up_proj_bias":
        return [(f"{blk}.ffn_gate_exps.bias", t[:, 0::2]), (f"{blk}.ffn_up_exps.bias", t[:, 1::2])]
    if sub == "mlp.experts.down_proj":
        return [(f"{blk}.ffn_down_exps.weight", t.transpose(0, 2, 1))]
    if sub == "mlp.experts.down_proj_bias":
        return [(f"{blk}.ffn_down_exps.bias", t)]
    return None


def add_matrix(writer, name: str, t, as_type: str | None) -> None:
    """A tensor, as floats, or a matrix quantized to ``as_type`` (a K-quant's rows not whole super-blocks
    to its fallback, as llama.cpp does; rows not whole blocks of 32 kept as floats)."""
    as_type = as_type and t.ndim >= 2 and block_type(as_type, t.shape[-1])
    if as_type:
        writer.add_tensor(name, quantize(t, as_type), raw_dtype=gguf.GGMLQuantizationType[as_type])
    else:
        writer.add_tensor(name, t)

def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("folder", help="a model folder (config.json and safetensors)")
    p.add_argument("out", help="the .gguf file to write")
    p.add_argument("--type", default="Q4_K_M",
                   help="Q4_K_M, Q5_K_M (llama.cpp's mixes), or one type for every matrix: Q4_0, Q8_0, Q6_K, F32...")
    args = p.parse_args()
    cfg = load_model_config(args.folder)
    if cfg.model_type not in ARCH:
        p.error(f"no GGUF architecture for {cfg.model_type!r}; known: {', '.join(ARCH)}")
    kind = args.type.upper()
    if kind not in ("Q4_K_M", "Q5_K_M", "F32") and kind not in GGMLQuantizationType.__members__:
        p.error(f"unknown type {args.type!r}")
    write_gguf(args.folder, args.out, ARCH[cfg.model_type],
               None if kind == "F32" else mix(kind, cfg.num_layers, cfg.tie_word_embeddings))
    print(f"wrote {args.out} ({os.path.getsize(args.out) / 2**20:.1f} MiB)")


if __name__ == "__main__":
    main()
