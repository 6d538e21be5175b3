"""Load a model: a Hugging Face folder (config.json + *.safetensors, sharded or
not; AWQ and GPTQ int4 ones kept packed, ``engine/quant.py``) or a single GGUF file
(config from its metadata; tensors dequantized with the ``gguf`` package, or on the
CPU kept packed where ``kernels.cpu`` multiplies their blocks as they are: see
``_gguf_packing``).

Both sources become one stream of ``(hf_name, tensor)`` pairs in Hugging Face
naming, which ``load_weights`` routes into the fused layers.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import glob
import json
import logging
import os
import re
from collections import Counter
from collections.abc import Iterator

import numpy as np
import torch

import kernels
from engine import quant
from engine.models.bert import BertModel, Encoder, load_encoder_weights
from engine.models.config import ModelConfig, QuantConfig
from engine.models.layers import RMSNorm, RowLinear
from engine.models.llama import LlamaForCausalLM
from engine.models.modernbert import ModernBertModel
from engine.models.moe import Experts
from engine.parallel import TPGroup

log = logging.getLogger("tokenmill.engine")


def load_model_config(path: str, overrides: dict | None = None) -> ModelConfig:
    """The model's config; ``overrides`` (vLLM's ``--hf-overrides``) replace config.json's values first
    (a nested map, Gemma 3's text_config say, key by key), or a GGUF file's as a config.json names them."""
    if path.endswith(".gguf"):
        cfg, eos = _gguf_config(path)
        return ModelConfig.from_hf(_override(cfg, overrides or {}), eos)
    with open(os.path.join(path, "config.json")) as f:
        cfg = _override(json.load(f), overrides or {})
    for file, method in (("quantize_config.json", "gptq"), ("quant_config.json", "awq")):
        if not cfg.get("quantization_config") and os.path.isfile(os.path.join(path, file)):
            with open(os.path.join(path, file)) as f:  # AutoGPTQ's and early AutoAWQ's own files
                settings = json.load(f)
            cfg["quantization_config"] = {"quant_method": method} | settings if isinstance(settings, dict) else settings
    eos = None
    gen = os.path.join(path, "generation_config.json")
    if os.path.isfile(gen):  # generation_config's eos list is the authoritative one (e.g. Llama 3)
        with open(gen) as f:
            g = json.load(f).get("eos_token_id")
        eos = [g] if isinstance(g, int) else g
    config = ModelConfig.from_hf(cfg, eos)
    if config.encoder is None and not config.tie_word_embeddings and "lm_head.weight" not in _safetensors_index(path):
        config = dataclasses.replace(config, lm_head=False)  # a bare backbone (Qwen3-Embedding 4B, 8B): embeds only
    return config


def _override(cfg: dict, overrides: dict) -> dict:
    out = dict(cfg)
    for k, v in overrides.items():
        out[k] = _override(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def build_model(path: str, cfg: ModelConfig, max_positions: int, dtype: torch.dtype,
                device: torch.device, tp: TPGroup | None = None, tokenizer: str | None = None) -> LlamaForCausalLM:
    """The model, or under tensor parallelism this rank's slice of it (``tp``).

    Its parameters are allocated once, in ``dtype``, on ``device``, and each checkpoint tensor is
    converted as it is copied in: the peak is the model's final size plus one tensor in flight (never
    a float32 copy of a bf16 model), and no freed float32 memory lingers in CUDA's caching allocator."""
    if cfg.encoder is not None:
        return _build_encoder(path, cfg, max_positions, dtype, device, tokenizer)
    with torch.device(device), _default_dtype(dtype):
        model = LlamaForCausalLM(cfg, max_positions, tp)  # the RoPE tables ask for float32 themselves
    if cfg.score_tokens:
        if path.endswith(".gguf"):
            raise ValueError("classifier_from_token needs a Hugging Face checkpoint (safetensors), not a GGUF file")
        model.score_rows = _score_rows(tokenizer or path, cfg.score_tokens)
    if path.endswith(".gguf"):
        weights = _gguf_weights(path, cfg, _gguf_packing(path, model, device))
    else:
        weights = _safetensors_weights(path)
        if cfg.gpt_oss:
            _mxfp4_packing(model, _safetensors_index(path), device)
        if cfg.quant is not None:
            index = _safetensors_index(path)
            packed = _quant_packing(model, cfg.quant, index, device, dtype)
            weights = quant.weights(weights, cfg.quant, set(index), packed)
    load_weights(model, weights)
    return model.eval()


def _build_encoder(path: str, cfg: ModelConfig, max_positions: int, dtype: torch.dtype, device: torch.device,
                   tokenizer: str | None) -> Encoder:
    """A BERT-style encoder (``engine/models/bert.py``) from a Hugging Face folder (on one rank: ``ModelRunner``)."""
    if cfg.quant is not None or path.endswith(".gguf"):
        raise ValueError(f"an encoder ({cfg.model_type}) loads from its safetensors checkpoint (not GGUF, AWQ, GPTQ)")
    with torch.device(device), _default_dtype(dtype):
        model = (ModernBertModel if cfg.encoder.modern is not None else BertModel)(cfg, max_positions)
    # a BERT cross-encoder types a pair's texts by its [SEP] (RoBERTa's tokenizers type none)
    if cfg.labels and not cfg.encoder.roberta and cfg.encoder.type_vocab_size > 1:
        from frontends.tokenizer import load_tokenizer

        model.sep_token_id = load_tokenizer(tokenizer or path).sep_token_id
        if model.sep_token_id is None:
            raise ValueError("a classifier with two token types needs its tokenizer's [SEP] token: it has none")
    load_encoder_weights(model, _safetensors_weights(path))
    return model.eval()


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    """Floating tensors made without a dtype (the layers' uninitialised weights) get ``dtype``, as in
    transformers' ``from_pretrained``."""
    before = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(before)


_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)")
_FUSED = {  # a checkpoint linear's name (its last part) -> (the fused layer beside it, part index)
    "q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
}
# a mixture of experts' tensors: one expert's ("experts.3.up_proj.weight") or all experts' stacked
# ("experts.up_proj": transformers 5's gate_up_proj and down_proj, and GGUF's *_exps)
_EXPERTS = re.compile(r"mlp\.experts\.(?:(\d+)\.(\w+)\.weight|(\w+))")
_MIXTRAL = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
# layers a checkpoint may hold already fused (Phi-3), by the parts they stand for
_UNFUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def _mixtral_name(name: str) -> str:
    """Mixtral's names in Qwen's spelling: block_sparse_moe.gate -> mlp.gate, experts.E.w1 -> gate_proj."""
    name = name.replace(".block_sparse_moe.", ".mlp.")
    return re.sub(r"\.experts\.(\d+)\.w([123])\.", lambda m: f".experts.{m[1]}.{_MIXTRAL['w' + m[2]]}.", name)


def load_weights(model: LlamaForCausalLM, weights: Iterator[tuple[str, torch.Tensor]]) -> None:
    """Copy each Hugging Face-named tensor into its (possibly fused) place; check nothing is missing."""
    seen: set[str] = set()
    mxfp4: dict[str, torch.Tensor] = {}  # GPT-OSS: an MXFP4 weight's blocks or scales, until the other comes
    with torch.no_grad():
        for name, w in weights:
            try:
                _load_one(model, name, w, seen, mxfp4)
            except (RuntimeError, IndexError) as e:  # (a shape the config does not make, most likely)
                if isinstance(e, torch.OutOfMemoryError):
                    raise
                raise ValueError(f"{name} {tuple(w.shape)} cannot be loaded: does the config describe this "
                                 f"checkpoint? ({type(e).__name__}: {e})") from e
    _check_complete(model, seen, mxfp4)


def _load_one(model: LlamaForCausalLM, name: str, w: torch.Tensor, seen: set[str], mxfp4: dict) -> None:
    """One checkpoint tensor into its place (``load_weights``); the names it filled join ``seen``."""
    if model.cfg.gpt_oss and (m := _GPT_OSS.fullmatch(name)):
        got = _load_gpt_oss(model, m, w, mxfp4)
        if got & seen:  # (a bf16 tensor and MXFP4 blocks of one weight, say)
            raise ValueError(f"{min(got & seen)} is held twice in the checkpoint")
        seen |= got
        return
    if model.vision is not None and model.vision.load(name, w):
        return
    if not name.startswith(("model.", "lm_head.", "score.")):
        name = "model." + name  # a backbone saved on its own (Qwen3-Embedding): no "model." prefix
    if ".block_sparse_moe." in name:
        name = _mixtral_name(name)
    if _holds_score_rows(model, name):
        _load_score_rows(model, w)
    if name == "model.embed_tokens.weight":
        model.embed_tokens.load(w)
    elif name == "lm_head.weight":
        if model.lm_head is not None and not model.cfg.tie_word_embeddings:
            model.lm_head.load(w)
    elif name == "model.norm.weight":
        model.norm.load(w)
    elif name == "score.weight" and model.score is not None:  # a sequence classifier's head
        if w.shape != model.score.weight.shape:
            raise ValueError(f"score.weight has {w.shape[0]} rows, but the config names "
                             f"{len(model.cfg.labels)} labels (id2label, num_labels)")
        model.score.weight.copy_(w)
    elif "rotary_emb." in name:
        return  # old checkpoints' inv_freq buffers, per layer or not: the model makes its own
    elif (m := _LAYER.fullmatch(name)) and (e := _EXPERTS.fullmatch(m.group(2))):
        seen |= _load_experts(model, int(m.group(1)), e, w)
        return
    elif m:
        if int(m.group(1)) >= len(model.layers):
            raise ValueError(f"{name}: a layer past the config's num_hidden_layers ({len(model.layers)})")
        layer = model.layers[int(m.group(1))]
        sub, kind = m.group(2).rsplit(".", 1)  # e.g. "self_attn.q_proj", "weight"
        head, _, last = sub.rpartition(".")
        fused = _FUSED.get(last)
        target = layer.get_submodule(f"{head}.{fused[0]}" if fused else sub)
        if kind == "g_perm":  # an act-order int4 layer's column order (engine.quant)
            target.set_perm(w)
            return
        if kind == "bias" and getattr(target, "bias", 0) is None:
            if w.any():  # GPTQ gives every int4 layer a bias: all zeros where the model has none
                raise ValueError(f"{name}: a nonzero bias, but {model.cfg.model_type} has none there")
            return
        if fused:
            target.load(fused[1], w, kind)
        elif last in _UNFUSED:  # fused in the checkpoint too: each part's rows to their place
            for part, rows in enumerate(w.split(target.full_sizes)):
                target.load(part, rows, kind)
            seen |= {f"model.layers.{m[1]}.{head}.{p}.{kind}" for p in _UNFUSED[last]}
            return
        elif isinstance(target, RowLinear):
            target.load(w, kind)
        elif isinstance(target, RMSNorm):
            target.load(w)
        else:
            getattr(target, kind).copy_(w)
    else:
        return  # a tensor the model does not use
    seen.add(name)


def _check_complete(model: LlamaForCausalLM, seen: set[str], mxfp4: dict) -> None:
    """Nothing the model needs is missing from the checkpoint."""
    expected = _expected_names(model.cfg)
    missing = sorted(expected - seen)
    if model.vision is not None:
        missing += sorted(model.vision.unloaded)
    if model.cfg.gpt_oss:  # as its checkpoints name them: all experts' part at once, gate and up together
        missing = list(dict.fromkeys(re.sub(r"experts\.(?:\d+\.)?(?:gate|up)_proj(?:\.weight)?", "experts.gate_up_proj",
                                            re.sub(r"experts\.\d+\.down_proj\.weight", "experts.down_proj", n))
                                     for n in missing))
    if mxfp4:  # (first: what the checkpoint does hold tells most)
        missing = sorted(n.rpartition("_")[0] + ("_scales" if n.endswith("_blocks") else "_blocks")
                         for n in mxfp4) + missing
    if missing:
        raise ValueError(f"checkpoint is missing {len(missing)} tensors, e.g. {missing[:3]}")


def _score_rows(path: str, tokens: tuple[str, ...]) -> list[int]:
    """The ids of vLLM's ``classifier_from_token`` tokens, as the model's tokenizer names them."""
    from frontends.tokenizer import load_tokenizer

    vocab = load_tokenizer(path).get_vocab()
    missing = [t for t in tokens if t not in vocab]
    if missing:
        raise ValueError(f"classifier_from_token: {missing} are not tokens of this model's vocabulary")
    return [vocab[t] for t in tokens]


def _holds_score_rows(model: LlamaForCausalLM, name: str) -> bool:
    """Whether checkpoint tensor ``name`` holds the rows a ``classifier_from_token`` score head is made of
    (the LM head's, or the embeddings' where they are tied)."""
    cfg = model.cfg
    return bool(cfg.score_tokens) and name == ("model.embed_tokens.weight" if cfg.tie_word_embeddings
                                               else "lm_head.weight")


def _load_score_rows(model: LlamaForCausalLM, w: torch.Tensor) -> None:
    rows = w[model.score_rows].float() / model.cfg.logits_scaling  # (Granite divides its logits)
    model.score.weight.copy_((rows[1] - rows[0])[None] if len(rows) == 2 else rows)


def _language_model(name: str) -> str:
    """A multimodal checkpoint's language model (Gemma 3 4B+) in a text model's names: transformers 4's
    ``language_model.model.*`` and 5's ``model.language_model.*``; its vision tower's names stay apart."""
    for prefix in ("language_model.model.", "model.language_model."):
        if name.startswith(prefix):
            return "model." + name[len(prefix):]
    return name.removeprefix("language_model.")  # (language_model.lm_head.weight)


def _load_experts(model: LlamaForCausalLM, i: int, m: re.Match, w: torch.Tensor) -> set[str]:
    """Copy one expert's part, or a part of every expert (stacked), into layer ``i``'s experts;
    returns the per-expert names it filled."""
    experts = model.layers[i].mlp.experts
    which, part = (int(m[1]), m[2]) if m[1] is not None else (slice(None), m[3])
    if part == "gate_up_proj":  # transformers 5's (E, 2I, H): gate's rows, then up's
        half = w.shape[-2] // 2
        experts.load(which, 0, w.narrow(-2, 0, half))
        experts.load(which, 1, w.narrow(-2, half, half))
        parts = ["gate_proj", "up_proj"]
    elif part in experts.PARTS:
        experts.load(which, experts.PARTS.index(part), w)
        parts = [part]
    else:
        raise ValueError(f"model.layers.{i}.{m[0]}: not a part of an expert ({', '.join(experts.PARTS)})")
    ids = range(experts.w13.shape[0]) if isinstance(which, slice) else [which]
    return {f"model.layers.{i}.mlp.experts.{e}.{p}.weight" for e in ids for p in parts}


# GPT-OSS's own tensors: its attention sinks, its router, its experts stacked (bf16, or MXFP4 blocks and scales)
_GPT_OSS = re.compile(r"model\.layers\.(\d+)\.(self_attn\.sinks|mlp\.router\.(?:weight|bias)|"
                      r"mlp\.experts\.(gate_up_proj|down_proj|gate_proj|up_proj)(_bias|_blocks|_scales)?)")
_GPT_OSS_PARTS = {"gate_up_proj": ("gate_proj", "up_proj"), "gate_proj": ("gate_proj",), "up_proj": ("up_proj",),
                  "down_proj": ("down_proj",)}


def _load_gpt_oss(model: LlamaForCausalLM, m: re.Match, w: torch.Tensor, mxfp4: dict[str, torch.Tensor]) -> set[str]:
    """One of GPT-OSS's own tensors into layer ``m[1]``; returns the names it filled (an expert's part as
    ``experts.E.gate_proj.weight``, as other mixtures name them). Its experts come stacked, gate|up's outputs
    interleaved (gate, up, gate, ...): ``gate_up_proj`` (E, H, 2I) and ``down_proj`` (E, I, H) transposed (x W), or in
    MXFP4 as ``*_blocks`` and ``*_scales`` with the outputs first (W x); their biases (E, 2I) and (E, H), or from a
    GGUF file gate's and up's apart (``gate_proj_bias``, ``up_proj_bias``)."""
    layer, what, part, kind = model.layers[int(m[1])], m[2], m[3], m[4]
    name = f"model.layers.{m[1]}.{what}"
    filled = {f"model.layers.{m[1]}.mlp.experts.{e}.{p}.weight" for e in range(layer.mlp.experts.w13.shape[0])
              for p in _GPT_OSS_PARTS.get(part, ())}
    if what == "self_attn.sinks":
        layer.self_attn.load_sinks(w)
        return {name}
    if what.startswith("mlp.router."):
        getattr(layer.mlp.gate, what.rpartition(".")[2]).copy_(w)
        return {name}
    experts = layer.mlp.experts
    if kind == "_bias":
        if part == "gate_up_proj":
            experts.load_bias(0, w[:, 0::2])
            experts.load_bias(1, w[:, 1::2])
        else:
            experts.load_bias(Experts.PARTS.index(part), w)
        return {f"model.layers.{m[1]}.mlp.experts.{p}_bias" for p in _GPT_OSS_PARTS[part]}
    if part not in ("gate_up_proj", "down_proj"):
        raise ValueError(f"{name}: GPT-OSS's experts' weights come as gate_up_proj and down_proj")
    if kind in ("_blocks", "_scales"):
        other = name[:-len(kind)] + ("_scales" if kind == "_blocks" else "_blocks")
        if other not in mxfp4:
            mxfp4[name] = w
            return set()
        blocks, scales = (w, mxfp4.pop(other)) if kind == "_blocks" else (mxfp4.pop(other), w)
        name = name[:-len(kind)]
        count = experts.w13.shape[0]
        if blocks.dim() != 4 or blocks.shape[0] != count or blocks.shape[-1] != 16 or blocks.shape[:-1] != scales.shape \
                or blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
            raise ValueError(f"{name}_blocks and _scales must be uint8 ({count}, N, G, 16) and ({count}, N, G) in "
                             f"this model's config, got {tuple(blocks.shape)} {blocks.dtype} and "
                             f"{tuple(scales.shape)} {scales.dtype}")
        # an expert at a time: a whole layer's values in floats would be GBs (gpt-oss-20b: 32 x 5760 x 2880)
        for e in range(count):
            rows = quant.mxfp4_to_packed(blocks[e], scales[e]) if experts.packed == "mxfp4" \
                else quant.mxfp4_to_float(blocks[e], scales[e], experts.w13.dtype)
            _load_gpt_oss_expert(experts, e, part, rows, name)
        return filled
    if experts.packed is not None:  # (packed: this layer's MXFP4 blocks are in the checkpoint too)
        raise ValueError(f"{name} is held twice in the checkpoint: in floats, and as MXFP4 ({name}_blocks)")
    if w.dim() != 3 or w.shape[0] != experts.w13.shape[0]:
        raise ValueError(f"{name} must hold {experts.w13.shape[0]} experts' weights (E, K, N), got {tuple(w.shape)}")
    for e in range(w.shape[0]):
        _load_gpt_oss_expert(experts, e, part, w[e].t(), name)
    return filled


def _mxfp4_packing(model: LlamaForCausalLM, index: dict[str, tuple[str, str]], device: torch.device) -> None:
    """Keep GPT-OSS's MXFP4 experts so (as ggml's MXFP4 blocks) where a kernel multiplies them as they are
    (``kernels.packed_formats``): gpt-oss-20b's experts in 10 GB, not 38 in bf16; under tensor parallelism each rank
    its share of whole blocks (``Experts.pack``). Elsewhere they are widened at load."""
    layers = [layer.mlp.experts for i, layer in enumerate(model.layers)  # (both parts: one format a layer)
              if all(f"model.layers.{i}.mlp.experts.{p}_blocks" in index for p in ("gate_up_proj", "down_proj"))]
    packed = [e for e in layers if e.packable("mxfp4")] if "mxfp4" in kernels.packed_formats(device) else []
    for experts in packed:
        experts.pack("mxfp4")
    if packed:
        log.info("MXFP4: the experts of %d layers kept packed (4.25 bits a weight)", len(packed))
    if len(packed) < len(layers):
        log.info("MXFP4: the experts of %d layers widened to the model's dtype at load", len(layers) - len(packed))


def _load_gpt_oss_expert(experts: Experts, e: int, part: str, w: torch.Tensor, name: str) -> None:
    """Expert ``e``'s gate_up_proj (2I, H), its rows interleaved, or down_proj (H, I), outputs first (packed: their
    rows of blocks)."""
    try:
        if part == "gate_up_proj":
            experts.load(e, 0, w[0::2])
            experts.load(e, 1, w[1::2])
        else:
            experts.load(e, 2, w)
    except (ValueError, RuntimeError) as err:  # (a wrong width, rows or packed bytes)
        raise ValueError(f"{name}, expert {e}: {err}") from None


def _expected_names(cfg: ModelConfig) -> set[str]:
    names = {"model.embed_tokens.weight", "model.norm.weight"}
    if cfg.lm_head and not cfg.tie_word_embeddings:
        names.add("lm_head.weight")
    if cfg.labels:
        names.add(("model.embed_tokens.weight" if cfg.tie_word_embeddings else "lm_head.weight") if cfg.score_tokens
                  else "score.weight")
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        names |= {p + s for s in (
            "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
            "self_attn.o_proj.weight", "post_attention_layernorm.weight")}
        if not cfg.olmo:  # (OLMo norms no sublayer's input)
            names.add(p + "input_layernorm.weight")
        if cfg.gemma >= 2:
            names.add(p + "pre_feedforward_layernorm.weight")
        if cfg.gemma >= 2 or cfg.olmo:
            names.add(p + "post_feedforward_layernorm.weight")
        if cfg.gpt_oss:
            names |= {p + "self_attn.sinks", p + "self_attn.o_proj.bias", p + "mlp.router.weight",
                      p + "mlp.router.bias"}
            names |= {f"{p}mlp.experts.{e}.{x}_proj.weight" for e in range(cfg.moe.num_experts)
                      for x in ("gate", "up", "down")}
            names |= {f"{p}mlp.experts.{x}_proj_bias" for x in ("gate", "up", "down")}
        elif cfg.sparse(i):
            names |= {f"{p}mlp.experts.{e}.{x}_proj.weight" for e in range(cfg.moe.num_experts)
                      for x in ("gate", "up", "down")}
            names.add(p + "mlp.gate.weight")
            if cfg.moe.shared_intermediate_size:
                names |= {p + f"mlp.shared_expert.{x}_proj.weight" for x in ("gate", "up", "down")}
                names.add(p + "mlp.shared_expert_gate.weight")
        else:
            names |= {p + f"mlp.{x}_proj.weight" for x in ("gate", "up", "down")}
        if cfg.attention_bias:
            names |= {p + f"self_attn.{x}_proj.bias" for x in "qkv"}
        if cfg.qk_norm:
            names |= {p + "self_attn.q_norm.weight", p + "self_attn.k_norm.weight"}
    return names


def _safetensors_files(path: str) -> list[str]:
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"{path}: no *.safetensors files (other checkpoint formats are not supported)")
    # Mistral's repositories ship the same weights in their own format beside Hugging Face's
    return [f for f in files if not os.path.basename(f).startswith("consolidated")] or files


def _safe_open(file: str):
    """``safe_open``, a file it cannot read (a truncated download, a header that lies) named as such."""
    from safetensors import SafetensorError, safe_open

    try:
        return safe_open(file, framework="pt")
    except SafetensorError as e:
        raise ValueError(f"{file}: not a readable safetensors file, truncated or corrupt? ({e})") from e


def _get_tensor(f, file: str, name: str) -> torch.Tensor:
    """Tensor ``name`` of ``f``, ``_safe_open``'s of ``file``, a tensor it cannot read named as such."""
    from safetensors import SafetensorError

    try:
        return f.get_tensor(name)
    except SafetensorError as e:
        raise ValueError(f"{file}: {name} cannot be read, truncated or corrupt? ({e})") from e


def _safetensors_weights(path: str) -> Iterator[tuple[str, torch.Tensor]]:
    """Each tensor, named as in a text model (``_language_model``)."""
    for file in _safetensors_files(path):
        with _safe_open(file) as f:
            for name in f.keys():
                yield _language_model(name), _get_tensor(f, file, name)


def _safetensors_index(path: str, _last: list = [None, None]) -> dict[str, tuple[str, str]]:  # noqa: B006
    """Every tensor's name (as ``_safetensors_weights`` names it) -> its file and its name there, from
    the files' headers. Read again only where the files changed since the last call (``load_model_config``
    and ``build_model`` both ask, and a mixture of experts' checkpoint has tens of thousands of names)."""
    files = _safetensors_files(path)
    key = tuple((file, (st := os.stat(file)).st_size, st.st_mtime_ns) for file in files)
    if _last[0] != key:
        index: dict[str, tuple[str, str]] = {}
        for file in files:
            with _safe_open(file) as f:
                index.update({_language_model(name): (file, name) for name in f.keys()})
        _last[:] = [key, index]
    return _last[1]


def _read(index: dict[str, tuple[str, str]], name: str, files: dict) -> torch.Tensor | None:
    """One tensor of the checkpoint, or None where it has none of that name. ``files``: the files opened so far
    (a dict to keep them in: a mixture of experts' checkpoint has tens of thousands of tensors, and opening a file
    parses all their names)."""
    if name not in index:
        return None
    file, stored = index[name]
    if file not in files:
        files[file] = _safe_open(file)
    return _get_tensor(files[file], file, stored)


# each layer linear, by the checkpoint layers it fuses
_LINEARS = {"self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
            "self_attn.o_proj": ("self_attn.o_proj",), "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
            "mlp.down_proj": ("mlp.down_proj",)}


def _packable(q: QuantConfig, index: dict[str, tuple[str, str]], prefixes: list[str], k: int, permutable: bool,
              files: dict) -> bool:
    """Whether the checkpoint layers ``prefixes``, fused into one of ``k`` input columns (``permutable``: its
    input whole on this rank, and the layer's own), are all int4 and can be kept as Q4_Z blocks (``quant.packs``)."""
    if not all(f"{p}.qweight" in index for p in prefixes):
        return False
    g_idx = [_read(index, f"{p}.g_idx", files) for p in prefixes]
    if q.act_order and any(g is None or not torch.equal(g, g_idx[0]) for g in g_idx):
        return False  # fused parts gather their one input in one order
    return all(quant.packs(q, k, _read(index, f"{p}.scales", files), g, permutable=permutable)
               for p, g in zip(prefixes, g_idx, strict=True))


def _quant_packing(model: LlamaForCausalLM, q: QuantConfig, index: dict[str, tuple[str, str]], device: torch.device,
                   dtype: torch.dtype) -> set[str]:
    """Keep packed (Q4_Z) every layer linear whose checkpoint layers are all int4 and whose groups
    are whole blocks (``quant.packs``, which reads their scales and g_idx; under tensor parallelism, a
    rank's columns too), where a kernel multiplies packed weights (``kernels.packed_formats``): Triton's (CUDA,
    or the ``triton`` backend) or the CPU's C kernel (float32, bfloat16). A mixture of experts' experts are kept
    packed when all of a layer's can be, in column order (act-order's gather is a layer's own, and the experts
    share their input). The others are expanded to floats at load. Returns the checkpoint prefixes of the packed
    ones."""
    kernel = quant.FORMAT in kernels.packed_formats(device) and (
        device.type != "cpu" or kernels.backend() == "triton" or dtype in (torch.float32, torch.bfloat16))
    packed, files = set(), {}
    for i, layer in enumerate(model.layers):
        sparse = model.cfg.sparse(i)
        for sub, parts in _LINEARS.items():
            if sparse and sub.startswith("mlp."):  # Qwen2-MoE's shared expert: a gated MLP of its own
                if layer.mlp.shared_expert is None:
                    continue
                sub, parts = sub.replace("mlp.", "mlp.shared_expert."), [p.replace("mlp.", "mlp.shared_expert.")
                                                                        for p in parts]
            module = layer.get_submodule(sub)
            prefixes = [f"model.layers.{i}.{p}" for p in parts]
            if f"model.layers.{i}.{sub}.qweight" in index:  # fused in the checkpoint too (Phi-3)
                prefixes = [f"model.layers.{i}.{sub}"]
            k = module.weight.shape[1]  # this rank's columns
            split = isinstance(module, RowLinear) and module.tp.size > 1  # x's columns are over the ranks
            if kernel and k % 32 == 0 and _packable(q, index, prefixes, k * module.tp.size if split else k,
                                                    not split, files):
                module.pack(quant.FORMAT)
                packed.update(prefixes)
        if sparse:
            experts = layer.mlp.experts
            names = [_expert_prefixes(index, i, e) for e in range(experts.w13.shape[0])]  # each's gate, up, down
            if kernel and experts.packable(quant.FORMAT) and \
                    all(_packable(q, index, gate_up, experts.w13.shape[2], False, files) and
                        _packable(q, index, [down], experts.intermediate, False, files)
                        for *gate_up, down in names):
                experts.pack(quant.FORMAT)
                packed.update(p for parts in names for p in parts)
    int4 = {n.rsplit(".", 1)[0] for n in index if n.endswith(".qweight")}
    log.info("%s int4 checkpoint (groups of %s): %d of its %d int4 layers kept packed (Q4_Z, 5 bits a weight), "
             "the others expanded at load", q.method.upper(), q.group_size or "a whole row", len(packed & int4),
             len(int4))
    return packed


def _expert_prefixes(index: dict[str, tuple[str, str]], i: int, e: int) -> list[str]:
    """Expert ``e`` of layer ``i``'s gate, up and down in the checkpoint's names (Mixtral's w1, w3, w2)."""
    mixtral = f"model.layers.{i}.block_sparse_moe.experts.{e}"
    if f"{mixtral}.w1.qweight" in index:
        return [f"{mixtral}.{w}" for w in _MIXTRAL]
    return [f"model.layers.{i}.mlp.experts.{e}.{p}" for p in Experts.PARTS]


# ----------------------------------------------------------------------------- GGUF

_GGUF_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_GGUF_LAYER = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm", "attn_qkv": "self_attn.qkv_proj",
    "post_attention_norm": "post_attention_layernorm", "post_ffw_norm": "post_feedforward_layernorm",
    # a mixture of experts: the router, each part of all experts stacked (E, ...), Qwen2-MoE's shared expert
    "ffn_gate_inp": "mlp.gate", "ffn_gate_exps": "mlp.experts.gate_proj", "ffn_up_exps": "mlp.experts.up_proj",
    "ffn_down_exps": "mlp.experts.down_proj", "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj", "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
    "attn_sinks": "self_attn.sinks",  # GPT-OSS's
}
_GGUF_EXPERT = {"ffn_gate": "gate_proj", "ffn_up": "up_proj", "ffn_down": "down_proj"}  # old Mixtral files: one each
_GGUF_PHI3 = {"ffn_up": "mlp.gate_up_proj"}  # Phi-3's ffn_up is gate|up fused (its attn_qkv, q|k|v)
_GGUF_GEMMA2 = {"ffn_norm": "pre_feedforward_layernorm"}  # Gemma 2 and 3's (they norm each sublayer's output too)
# GGUF architecture -> model_type (llama with experts: Mixtral)
_GGUF_ARCH = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "mistral": "mistral", "qwen2moe": "qwen2_moe",
              "qwen3moe": "qwen3_moe", "phi3": "phi3", "gemma": "gemma", "gemma2": "gemma2", "gemma3": "gemma3_text",
              "granite": "granite", "olmo2": "olmo2", "gpt-oss": "gpt_oss"}


def gguf_field(path: str, key: str, default=None):
    """One metadata field of the GGUF file at ``path``."""
    return _gguf_field(_gguf_reader(path), key, default)


def _gguf_field(reader, key: str, default=None):
    f = reader.fields.get(key)
    return default if f is None else f.contents()


@functools.lru_cache(maxsize=1)
def _gguf_reader(path: str):
    """Parsing a GGUF header takes seconds (the vocabulary is in it): do it once per load."""
    from gguf import GGUFReader

    try:
        return GGUFReader(path)
    except (ValueError, IndexError, KeyError, UnicodeDecodeError, OverflowError) as e:  # (not OSError, MemoryError)
        raise ValueError(f"{path}: not a readable GGUF file, truncated or corrupt? ({type(e).__name__}: {e})") from e


def _gguf_config(path: str) -> tuple[dict, list[int]]:
    r = _gguf_reader(path)
    arch = _gguf_field(r, "general.architecture")
    if arch not in _GGUF_ARCH:
        raise ValueError(f"unsupported GGUF architecture {arch!r}; tokenmill supports {', '.join(_GGUF_ARCH)}")
    a = lambda k, d=None: _gguf_field(r, f"{arch}.{k}", d)  # noqa: E731
    heads = a("attention.head_count")
    hidden = a("embedding_length")
    vocab = a("vocab_size") or len(r.fields["tokenizer.ggml.tokens"].data)
    head_dim = a("attention.key_length", hidden // heads)
    cfg = {
        "model_type": _GGUF_ARCH[arch],
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": a("feed_forward_length"),
        "num_hidden_layers": a("block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": a("attention.head_count_kv", heads),
        "head_dim": head_dim,
        "rms_norm_eps": a("attention.layer_norm_rms_epsilon", 1e-6),
        "rope_theta": a("rope.freq_base", 10000.0),
        "max_position_embeddings": a("context_length", 4096),
        "tie_word_embeddings": not any(t.name == "output.weight" for t in r.tensors),
        "attention_bias": any(t.name == "blk.0.attn_q.bias" for t in r.tensors),
        "bos_token_id": _gguf_field(r, "tokenizer.ggml.bos_token_id"),
        "sliding_window": a("attention.sliding_window"),
        "partial_rotary_factor": a("rope.dimension_count", head_dim) / head_dim,  # (Phi-4-mini's: 0.75)
    }
    factors = {t.name: t for t in r.tensors if t.name.startswith("rope_factors_")}
    if factors:  # Phi-3.5's LongRoPE: its factors are tensors
        cfg["rope_scaling"] = {"rope_type": "longrope", "original_max_position_embeddings": a(
            "rope.scaling.original_context_length"), "attention_factor": a("rope.scaling.attn_factor"), **{
            f"{kind}_factor": [float(x) for x in np.asarray(factors[f"rope_factors_{kind}.weight"].data).ravel()]
            for kind in ("short", "long")}}
    if a("rope.scaling.type") == "yarn":
        cfg["rope_scaling"] = _gguf_yarn(a)
    if arch.startswith("gemma"):
        cfg |= _gguf_gemma(arch, a, cfg)
    if arch == "olmo2" and cfg["sliding_window"]:  # OLMo 3, as llama.cpp reads it: three of each four layers slide
        cfg["model_type"] = "olmo3"
    if arch == "gpt-oss":  # as llama.cpp reads it: every other layer slides, from the first; its YaRN untruncated,
        # as its config.json says (llama.cpp rounds the ramp's ends out); its ends of a turn: below
        cfg["layer_types"] = ["sliding_attention" if i % 2 == 0 else "full_attention"
                              for i in range(cfg["num_hidden_layers"])]
        if cfg.get("rope_scaling"):
            cfg["rope_scaling"]["truncate"] = False
    if arch == "granite":  # its scales, as llama.cpp names them
        cfg |= {"embedding_multiplier": a("embedding_scale", 1.0), "residual_multiplier": a("residual_scale", 1.0),
                "attention_multiplier": a("attention.scale", head_dim ** -0.5), "logits_scaling": a("logit_scale", 1.0)}
    if a("expert_count"):  # a mixture of experts; its dense layers are those without a router
        cfg["model_type"] = {"llama": "mixtral"}.get(arch, cfg["model_type"])
        routed = sorted(int(t.name.split(".")[1]) for t in r.tensors if t.name.endswith(".ffn_gate_inp.weight"))
        # the widths as the tensors have them (older files lack the keys), else from the metadata
        rows = {t.name: int(t.shape[1]) if len(t.shape) > 1 else 0 for t in r.tensors}  # a tensor's N
        layer = f"blk.{routed[0] if routed else 0}"
        width = rows.get(f"{layer}.ffn_gate_exps.weight") or rows.get(f"{layer}.ffn_gate.0.weight") or a(
            "expert_feed_forward_length")
        cfg |= {"num_experts": a("expert_count"), "num_experts_per_tok": a("expert_used_count"),
                "moe_intermediate_size": width,
                "shared_expert_intermediate_size": rows.get(f"{layer}.ffn_up_shexp.weight") or a(
                    "expert_shared_feed_forward_length"),
                "norm_topk_prob": arch == "qwen3moe",  # as llama.cpp decides per architecture
                "mlp_only_layers": [i for i in range(cfg["num_hidden_layers"]) if i not in routed]}
        if arch == "llama" or not cfg["intermediate_size"]:  # Mixtral's: its experts' width
            cfg["intermediate_size"] = width or cfg["intermediate_size"]
    # llama.cpp ends a turn at EOS and at EOT (Gemma's <end_of_turn>: by its text where the id is not given)
    ends = [_gguf_field(r, "tokenizer.ggml.eos_token_id"), _gguf_field(r, "tokenizer.ggml.eot_token_id")]
    if arch.startswith("gemma") and ends[1] is None and "tokenizer.ggml.tokens" in r.fields:
        ends[1] = next((i for i, t in enumerate(r.fields["tokenizer.ggml.tokens"].contents()) if t == "<end_of_turn>"),
                       None)
    if arch == "gpt-oss" and "tokenizer.ggml.tokens" in r.fields:  # (not <|end|>, which ends a harmony message)
        tokens = r.fields["tokenizer.ggml.tokens"].contents()
        ends = [e for e in ends[:1] if e is not None and tokens[int(e)] != "<|end|>"] + [
            i for i, t in enumerate(tokens) if t in ("<|return|>", "<|call|>", "<|endoftext|>")]
    return cfg, list(dict.fromkeys(int(e) for e in ends if e is not None))


def _gguf_yarn(a) -> dict:
    """YaRN from a GGUF's metadata (Qwen's long-context files): its factor, original length and ramp. The
    keys by which llama.cpp changes YaRN's attention factor are refused, not guessed at."""
    odd = {k: a(f"rope.scaling.{k}") for k in ("attn_factor", "yarn_attn_factor", "yarn_log_multiplier",
                                               "yarn_ext_factor")}
    odd = {k: v for k, v in odd.items() if v is not None and v != (0.0 if k == "yarn_log_multiplier" else 1.0)}
    if odd:
        raise ValueError(f"YaRN with llama.cpp's {', '.join(f'rope.scaling.{k}' for k in odd)} is not supported yet: "
                         "serve the model's Hugging Face folder")
    yarn = {"rope_type": "yarn", "factor": a("rope.scaling.factor"),
            "original_max_position_embeddings": a("rope.scaling.original_context_length")}
    for key in ("beta_fast", "beta_slow"):
        if a(f"rope.scaling.yarn_{key}") is not None:
            yarn[key] = a(f"rope.scaling.yarn_{key}")
    return yarn


def _gguf_gemma(arch: str, a, cfg: dict) -> dict:
    """Gemma's keys as llama.cpp reads them: the sliding layers by pattern (Gemma 2's every other one from
    layer 0, Gemma 3's five of each six), Gemma 2's caps, query_pre_attn_scalar by size (hidden / heads in
    the 27Bs, else head_dim), Gemma 3's global RoPE scaling (its sliding layers: base 10000, unscaled)."""
    gemma2 = arch == "gemma2"  # (its caps and window as llama.cpp assumes them where a file lacks the keys)
    extra = {"query_pre_attn_scalar": cfg["hidden_size"] // cfg["num_attention_heads"]
             if (arch, cfg["num_hidden_layers"]) in (("gemma2", 46), ("gemma3", 62)) else cfg["head_dim"],
             "attn_logit_softcapping": a("attn_logit_softcapping", 50.0 if gemma2 else None),
             "final_logit_softcapping": a("final_logit_softcapping", 30.0 if gemma2 else None),
             "sliding_window": a("attention.sliding_window", 4096 if gemma2 else None)}
    pattern = a("attention.sliding_window_pattern", 2 if gemma2 else 6)  # n: each n-th layer is a full one
    if arch != "gemma":
        sliding = pattern if isinstance(pattern, list) else [(i + 1) % pattern != 0 for i in
                                                             range(cfg["num_hidden_layers"])]
        extra["layer_types"] = ["sliding_attention" if s else "full_attention" for s in sliding]
    if arch == "gemma3" and a("rope.scaling.type") == "linear":
        extra["rope_scaling"] = {"rope_type": "linear", "factor": a("rope.scaling.factor")}
    return extra


def _gguf_gpt_oss_name(m: re.Match) -> str:
    """A GPT-OSS GGUF tensor's name as ``_GPT_OSS`` reads it: its sinks, its router, its experts' biases (gate's
    and up's apart); its experts' stacked parts ``model.layers.L.mlp.experts.E.gate_proj.E`` (split by
    ``_gguf_weights``)."""
    layer, kind, suffix = f"model.layers.{m[1]}", m[2], m[4]
    if kind == "attn_sinks":
        return f"{layer}.self_attn.sinks"
    if kind == "ffn_gate_inp":
        return f"{layer}.mlp.router.{suffix}"
    part = _GGUF_LAYER[kind].rpartition(".")[2]  # gate_proj, up_proj, down_proj
    return f"{layer}.mlp.experts.{part}_bias" if suffix == "bias" else f"{layer}.mlp.experts.E.{part}.E"


def _unpermute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's interleaved-RoPE row order for q/k (as transformers' GGUF loader does)."""
    dim = w.shape[0] // n_heads // 2
    return w.reshape(n_heads, dim, 2, *w.shape[1:]).swapaxes(2, 1).reshape(w.shape)


# GGUF tensors (by the layer they fill) kept packed on the CPU
_GGUF_PARTS = {"self_attn.qkv_proj": ("attn_q", "attn_k", "attn_v"), "self_attn.o_proj": ("attn_output",),
               "mlp.gate_up_proj": ("ffn_gate", "ffn_up"), "mlp.down_proj": ("ffn_down",)}
_GGUF_PHI3_PARTS = {"self_attn.qkv_proj": ("attn_qkv",), "self_attn.o_proj": ("attn_output",),
                    "mlp.gate_up_proj": ("ffn_up",), "mlp.down_proj": ("ffn_down",)}
# ...and in a mixture of experts' layer: all experts at once (stacked), and Qwen2-MoE's shared expert
_GGUF_MOE_PARTS = {**{k: v for k, v in _GGUF_PARTS.items() if k.startswith("self_attn.")},
                   "mlp.experts": ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"),
                   "mlp.shared_expert.gate_up_proj": ("ffn_gate_shexp", "ffn_up_shexp"),
                   "mlp.shared_expert.down_proj": ("ffn_down_shexp",)}


def _gguf_packing(path: str, model: LlamaForCausalLM, device: torch.device) -> set[str]:
    """Pack every layer whose GGUF tensors are in block formats a kernel multiplies as they are
    (``kernels.packed_formats``), as llama.cpp keeps them: 2.6 to 8.5 bits a weight instead of 16 or 32, and the
    same numbers (their expansion is exact). A fused layer's parts may differ (Q4_K_M's q|k|v: v in Q6_K in half
    the layers), as may experts' gate|up and down. Under tensor parallelism a rank's columns of a row-parallel
    layer (o, down) must be whole blocks too (the experts' down: the ranks share its blocks, ``Experts.pack``).
    Returns the GGUF names of the tensors to load packed."""
    formats = kernels.packed_formats(device)
    if not formats:
        return set()
    types = {t.name: t.tensor_type.name.lower() for t in _gguf_reader(path).tensors}

    def fits(name: str, k: int) -> bool:  # a format the kernel reads, in whole blocks along this rank's K
        return types.get(name) in formats and k % kernels.reference.PACKED_BLOCKS[types[name]][0] == 0

    groups = [(model.embed_tokens, ["token_embd.weight"])]
    if not model.cfg.tie_word_embeddings:
        groups.append((model.lm_head.shard, ["output.weight"]))
    for i, layer in enumerate(model.layers):
        parts = _GGUF_MOE_PARTS if model.cfg.sparse(i) else _GGUF_PHI3_PARTS if model.cfg.model_type == "phi3" \
            else _GGUF_PARTS
        groups += [(layer.get_submodule(sub), [f"blk.{i}.{p}.weight" for p in names]) for sub, names in parts.items()
                   if not sub.startswith("mlp.shared_expert.") or layer.mlp.shared_expert is not None]
    packed = set()
    for module, names in groups:
        if isinstance(module, Experts):  # gate|up's K is the hidden size, down's their width
            gate, up, down = names
            if fits(gate, module.w13.shape[2]) and types[up] == types[gate] and types.get(down) in formats \
                    and module.packable(types[down]):
                module.pack(types[gate], types[down])
                packed.update(names)
        elif all(fits(n, module.weight.shape[1]) for n in names):
            if len(names) > 1:
                module.pack_parts([types[n] for n in names])
            else:
                module.pack(types[names[0]])
            packed.update(names)
    expanded = Counter(f.upper() for n, f in types.items() if n not in packed and f not in ("f32", "f16", "bf16"))
    log.info("GGUF: %d matrices kept packed (%s); quantized ones expanded at load: %s", len(packed),
             _counts(Counter(types[n].upper() for n in packed)), _counts(expanded))
    return packed


def _counts(c: Counter) -> str:
    return ", ".join(f"{n} {k}" for k, n in sorted(c.items(), key=lambda kv: (-kv[1], kv[0]))) or "none"


def _gguf_weights(path: str, cfg: ModelConfig, packed: set[str] = frozenset()) -> Iterator[tuple[str, torch.Tensor]]:
    """Each tensor in Hugging Face naming: dequantized to float32, or for ``packed`` names its rows of
    GGUF blocks as they are (uint8)."""
    from gguf.quants import dequantize

    r = _gguf_reader(path)
    llama_rope = cfg.model_type in ("llama", "mistral", "smollm", "mixtral", "granite")
    for t in r.tensors:
        if t.name in _GGUF_NAMES:
            name = _GGUF_NAMES[t.name]
        else:
            m = re.fullmatch(r"blk\.(\d+)\.(\w+)(?:\.(\d+))?\.(weight|bias)", t.name)
            if not m or m[2] not in (_GGUF_EXPERT if m[3] else _GGUF_LAYER):
                continue
            if cfg.gpt_oss and m[2] in ("attn_sinks", "ffn_gate_inp") or cfg.gpt_oss and m[2].endswith("_exps"):
                name = _gguf_gpt_oss_name(m)  # (its own names, ``_GPT_OSS``; its experts one by one)
            elif m[3]:  # one expert's part (Mixtral files before llama.cpp stacked them)
                name = f"model.layers.{m[1]}.mlp.experts.{m[3]}.{_GGUF_EXPERT[m[2]]}.weight"
            elif m[2].endswith("_exps"):  # all experts' part, stacked: named without "weight" (``_EXPERTS``)
                name = f"model.layers.{m[1]}.{_GGUF_LAYER[m[2]]}"
            else:
                own = _GGUF_PHI3 if cfg.model_type == "phi3" else _GGUF_GEMMA2 if cfg.gemma >= 2 else {}
                name = f"model.layers.{m[1]}.{own.get(m[2]) or _GGUF_LAYER[m[2]]}.{m[4]}"
        rows = [int(x) for x in reversed(t.shape)]  # GGUF lists dims fastest-first
        if t.name in packed:  # whole rows of blocks: permuting rows below works on them as on floats
            w = np.asarray(t.data, dtype=np.uint8).reshape(*rows[:-1], -1)
        else:
            w = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(rows)
        if llama_rope and name.endswith("q_proj.weight"):
            w = _unpermute(w, cfg.num_heads)
        elif llama_rope and name.endswith("k_proj.weight"):
            w = _unpermute(w, cfg.num_kv_heads)
        elif cfg.gemma and name.endswith("norm.weight"):
            w = w.astype(np.float64) - 1  # llama.cpp stores Gemma's norms as 1 + w (exact in float64: RMSNorm.load)
        if name.endswith(".E"):  # a GPT-OSS experts' part, stacked: one expert at a time (``_GPT_OSS`` takes its
            for e in range(w.shape[0]):  # stacked names in transformers' orientation, which differs)
                yield name[:-1].replace(".E.", f".{e}.") + "weight", torch.from_numpy(np.array(w[e], copy=True))
            continue
        yield name, torch.from_numpy(np.array(w, copy=True))  # writable: torch warns on read-only
